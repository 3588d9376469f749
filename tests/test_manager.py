"""KVCacheManager core behaviour; runs under asyncio and trio (anyio backends)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import numpy as np
import pytest

from kvpool import Geometry, KVCacheManager, PoolClosed, PoolExhausted

from ._helpers import until
from .conftest import KiB

pytestmark = pytest.mark.anyio

# 4 blocks a page, 16 pages: 64 blocks.
G = Geometry(1, 2, 4 * KiB, 64, page_bytes=16 * KiB)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def manager() -> AsyncIterator[KVCacheManager]:
    async with KVCacheManager(G, reserve=(0, 2), reserve_thread=False, name="t") as m:
        yield m


async def let_tasks_park() -> None:
    for _ in range(20):
        await anyio.lowlevel.checkpoint()


async def test_alloc_returns_ids_at_once_when_blocks_are_there(manager: KVCacheManager) -> None:
    ids = await manager.alloc(10)
    assert len(set(ids.tolist())) == 10
    assert manager.stats().granted_at_once == 1
    assert (await manager.alloc(0)).size == 0


async def test_alloc_nowait_raises_pool_exhausted_with_numbers(manager: KVCacheManager) -> None:
    await manager.alloc(60)
    with pytest.raises(PoolExhausted) as err:
        manager.alloc_nowait(5)
    assert (err.value.requested, err.value.available) == (5, 4)


async def test_waiters_are_served_fifo_within_a_priority(manager: KVCacheManager) -> None:
    held = await manager.alloc(64)
    order: list[int] = []

    async def want(i: int, n: int) -> None:
        await manager.alloc(n)
        order.append(i)

    async with anyio.create_task_group() as tg:
        for i, n in enumerate([3, 1, 2, 1]):
            tg.start_soon(want, i, n)
            await let_tasks_park()
        assert manager.waiting == 4
        for b in held[:7]:
            manager.free([b])
            await let_tasks_park()
    assert order == [0, 1, 2, 3]


async def test_lower_priority_number_is_served_first(manager: KVCacheManager) -> None:
    held = await manager.alloc(64)
    order: list[str] = []

    async def want(tag: str, prio: int) -> None:
        await manager.alloc(2, priority=prio)
        order.append(tag)

    async with anyio.create_task_group() as tg:
        for tag, prio in [("low-a", 5), ("high", 0), ("low-b", 5), ("urgent", -1)]:
            tg.start_soon(want, tag, prio)
            await let_tasks_park()
        for k in range(4):
            manager.free(held[2 * k : 2 * k + 2])
            await let_tasks_park()
    assert order == ["urgent", "high", "low-a", "low-b"]


async def test_a_task_that_frees_and_reallocates_queues_behind_earlier_waiters(manager: KVCacheManager) -> None:
    mine = await manager.alloc(64)
    got: list[str] = []

    async def earlier() -> None:
        await manager.alloc(4)
        got.append("earlier")

    async with anyio.create_task_group() as tg:
        tg.start_soon(earlier)
        await let_tasks_park()
        manager.free(mine[:4])  # hand-off: the earlier waiter gets these
        with pytest.raises(PoolExhausted):
            manager.alloc_nowait(1)  # no barging
        assert manager.available() == 0 or manager.waiting == 0
        await let_tasks_park()
    assert got == ["earlier"]
    assert manager.stats().used_blocks == 64


async def test_a_big_head_request_is_not_starved_by_small_ones(manager: KVCacheManager) -> None:
    held = list((await manager.alloc(60)).tolist())
    done = anyio.Event()

    async def big() -> None:
        await manager.alloc(30)
        done.set()

    async def small_churn() -> None:
        # A continuous stream of 1-block allocs and frees behind the head.
        while not done.is_set():
            ids = await manager.alloc(1)
            await anyio.lowlevel.checkpoint()
            manager.free(ids)

    async with anyio.create_task_group() as tg:
        tg.start_soon(big)
        await let_tasks_park()
        for _ in range(3):
            tg.start_soon(small_churn)
        with anyio.fail_after(60):  # a hang guard only
            while not done.is_set():
                if held:
                    manager.free([held.pop()])
                await let_tasks_park()
        tg.cancel_scope.cancel()  # stop the churners (some may still be queued)
    assert done.is_set()
    assert manager.waiting == 0


async def test_timeout_raises_and_holds_nothing(manager: KVCacheManager) -> None:
    await manager.alloc(62)
    with pytest.raises(TimeoutError):
        await manager.alloc(5, timeout=0.05)
    assert manager.waiting == 0
    assert manager.stats().used_blocks == 62 and manager.stats().timeouts == 1
    assert len(manager.alloc_nowait(2)) == 2


async def test_cancel_before_grant_removes_the_waiter_and_unblocks_those_behind(manager: KVCacheManager) -> None:
    held = await manager.alloc(64)
    got: list[int] = []

    async def want(n: int) -> None:
        got.extend((await manager.alloc(n)).tolist())

    big_scope = anyio.CancelScope()

    async def big() -> None:
        with big_scope:
            await manager.alloc(10)

    async with anyio.create_task_group() as tg:
        tg.start_soon(big)
        await let_tasks_park()
        tg.start_soon(want, 2)
        await let_tasks_park()
        manager.free(held[:2])  # not enough for the head (10): the 2-block waiter waits behind it
        await let_tasks_park()
        assert got == []
        big_scope.cancel()  # the head leaves: the waiter behind it fits now
        await until(lambda: bool(got), "the waiter behind the cancelled head is granted", interval=0)
    assert sorted(got) == sorted(held[:2].tolist())
    assert manager.waiting == 0


async def test_cancel_after_grant_gives_the_blocks_back(manager: KVCacheManager) -> None:
    # tokio's cancel_acquire_releases_permits, in kvpool's terms.
    held = await manager.alloc(64)
    scope = anyio.CancelScope()

    async def want() -> None:
        with scope:
            await manager.alloc(4)

    async with anyio.create_task_group() as tg:
        tg.start_soon(want)
        await let_tasks_park()
        manager.free(held[:4])  # granted now, but the task has not resumed yet
        scope.cancel()          # ... and is cancelled before it does
    st = manager.stats()
    assert st.used_blocks == 60 and st.cancellations == 1
    assert manager.available() == 4


async def test_closing_fails_every_waiter_with_pool_closed() -> None:
    m = KVCacheManager(G, reserve_thread=False, reserve=(0, 0))
    await m.alloc(64)
    errors: list[BaseException] = []

    async def want(n: int) -> None:
        try:
            await m.alloc(n)
        except PoolClosed as e:
            errors.append(e)

    async with anyio.create_task_group() as tg:
        for n in (1, 5, 9):
            tg.start_soon(want, n)
        await let_tasks_park()
        await m.aclose()
    assert len(errors) == 3
    with pytest.raises(PoolClosed):
        await m.alloc(1)
    with pytest.raises(PoolClosed):
        m.free(np.array([1]))
    assert m.space.allocated_bytes() == 0


async def test_reservation_hands_out_blocks_and_returns_the_rest(manager: KVCacheManager) -> None:
    async with await manager.reserve(10) as r:
        a = r.take(3)
        with pytest.raises(PoolExhausted):
            r.take(8)  # a failed take leaves the reservation intact
        assert r.remaining == 7
        b = r.take(7)
        assert len(set(a.tolist()) | set(b.tolist())) == 10
    r2 = await manager.reserve(5)
    r2.take(2)
    r2.close()
    assert manager.stats().used_blocks == 12


async def test_the_eventfd_watcher_role_survives_a_granted_heir() -> None:
    # Bug (found by the async benchmark): the watcher, when granted, handed
    # its role to the head; a second free granted that head before it ran, and
    # nobody watched the eventfd any more: native-only capacity never arrived.
    g = Geometry(1, 1, 4 * KiB, 64, page_bytes=64 * KiB)
    async with KVCacheManager(g, reserve=(0, 0), limit_bytes=g.page_commit_bytes) as m:
        held = m.alloc_nowait(16)  # exhausted under the 1-page limit
        got: list[int] = []

        async def want(n: int) -> None:
            got.extend((await m.alloc(n)).tolist())

        async with anyio.create_task_group() as tg:
            for n in (1, 1, 4):
                tg.start_soon(want, n)
                await let_tasks_park()
            m.free(held[:1])  # the watcher is granted and hands over to the next head
            await anyio.lowlevel.checkpoint()
            m.free(held[1:2])  # ... which is granted before it ran
            await let_tasks_park()
            m.space.set_limit(None)  # capacity only the eventfd reports
            await until(lambda: len(got) >= 6, "the eventfd's capacity reaches all three waiters")
        assert m.waiting == 0


async def test_wakeups_from_native_capacity_reach_waiters_through_the_eventfd() -> None:
    async with KVCacheManager(G, reserve=(0, 0), limit_bytes=2 * G.page_commit_bytes) as m:
        await m.alloc(8)  # the limit: 2 pages = 8 blocks
        got: list[int] = []

        async def want() -> None:
            got.extend((await m.alloc(4)).tolist())

        async with anyio.create_task_group() as tg:
            tg.start_soon(want)
            await let_tasks_park()
            assert got == []
            # An outside actor (as the pool ledger will be) raises the limit
            # natively: only the eventfd tells the manager.
            m.space.set_limit(None)
            await until(lambda: bool(got), "the eventfd's capacity reaches the waiter")
        assert len(got) == 4


async def test_repr_shows_used_total_and_waiting(manager: KVCacheManager) -> None:
    await manager.alloc(5)
    assert "5/64 blocks used with 0 waiting" in repr(manager)


async def test_bad_arguments_raise_value_error(manager: KVCacheManager) -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            await manager.alloc(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="can never be granted"):
        await manager.alloc(65)
