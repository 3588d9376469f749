"""set_limit: applied / deferred / stale / conflict, and what waiters see."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

from kvpool import Geometry, KVCacheManager, LimitState, PoolExhausted
from kvpool import tracing

from .conftest import KiB

pytestmark = pytest.mark.anyio

G = Geometry(1, 2, 4 * KiB, 64, page_bytes=16 * KiB)  # 4 blocks a page
PAGE = G.page_commit_bytes


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=[False, True], ids=["inline", "thread"])
async def manager(request: pytest.FixtureRequest) -> AsyncIterator[KVCacheManager]:
    async with KVCacheManager(G, reserve=(0, 1), reserve_thread=request.param) as m:
        yield m


async def let_tasks_park() -> None:
    for _ in range(20):
        await anyio.lowlevel.checkpoint()


async def test_a_limit_above_use_is_applied_at_once(manager: KVCacheManager) -> None:
    await manager.alloc(8)
    assert await manager.set_limit(4 * PAGE) is LimitState.APPLIED
    assert manager.available() == 8  # 2 more pages within the limit
    with pytest.raises(PoolExhausted):
        manager.alloc_nowait(9)


async def test_a_limit_below_use_is_deferred_until_frees_bring_use_under_it(manager: KVCacheManager) -> None:
    ids = await manager.alloc(16)  # 4 pages
    with tracing.capture() as events:
        assert await manager.set_limit(2 * PAGE) is LimitState.DEFERRED
        assert manager.available() == 0  # growth stopped
        manager.free(ids[:4])
        assert manager.limit_state is LimitState.DEFERRED  # 3 pages still in use
        manager.free(ids[4:8])
        assert manager.space.settle(60)  # the reserve thread gives emptied pages back
        assert manager.limit_state is LimitState.APPLIED
    assert manager.stats().committed_bytes <= 2 * PAGE
    names = [e["event"] for e in events if e["event"].startswith("limit.")]
    assert names == ["limit.deferred", "limit.applied"]
    assert events[-1]["limit_bytes"] == 2 * PAGE


async def test_revisions_order_setters(manager: KVCacheManager) -> None:
    assert await manager.set_limit(8 * PAGE, revision=5) is LimitState.APPLIED
    assert await manager.set_limit(1 * PAGE, revision=4) is LimitState.STALE
    assert await manager.set_limit(2 * PAGE, revision=5) is LimitState.CONFLICT
    assert await manager.set_limit(8 * PAGE, revision=5) is LimitState.APPLIED  # idempotent
    st = manager.stats()
    assert (st.limit_bytes, st.limit_revision) == (8 * PAGE, 5)
    assert await manager.set_limit(None) is LimitState.APPLIED  # next revision, no cap
    assert manager.stats().limit_revision == 6


async def test_raising_the_limit_lets_blocked_allocs_grow(manager: KVCacheManager) -> None:
    await manager.set_limit(2 * PAGE)
    await manager.alloc(8)
    got: list[int] = []

    async def want() -> None:
        got.extend((await manager.alloc(6)).tolist())

    async with anyio.create_task_group() as tg:
        tg.start_soon(want)
        await let_tasks_park()
        assert got == [] and manager.waiting == 1
        assert await manager.set_limit(3 * PAGE) is LimitState.APPLIED
        await let_tasks_park()
        assert got == []  # 4 more blocks are not 6: keeps waiting as the limit says
        assert await manager.set_limit(4 * PAGE) is LimitState.APPLIED
        await let_tasks_park()
    assert len(got) == 6


async def test_a_waiter_blocked_by_a_deferred_limit_is_granted_only_within_it(manager: KVCacheManager) -> None:
    ids = await manager.alloc(16)
    assert await manager.set_limit(3 * PAGE) is LimitState.DEFERRED
    got: list[int] = []

    async def want() -> None:
        got.extend((await manager.alloc(4)).tolist())

    async with anyio.create_task_group() as tg:
        tg.start_soon(want)
        await let_tasks_park()
        manager.free(ids[:4])  # 3 pages in use: applied, but no room for a new page
        assert manager.space.settle(60)  # the emptied page goes back (reserve thread or inline)
        await let_tasks_park()
        assert manager.limit_state is LimitState.APPLIED
        assert got == []
        manager.free(ids[4:8])  # now one page of room
        await let_tasks_park()
    assert len(got) == 4
    assert manager.space.settle(60)
    assert manager.space.allocated_bytes() <= 3 * PAGE


@pytest.mark.parametrize("reserve_thread", [False, True], ids=["inline", "thread"])
async def test_a_pooled_construction_limit_is_the_one_limit_set_limit_replaces(reserve_thread: bool) -> None:
    # Bug: in a pool, set_limit woke the native side with set_limit_pages(-1),
    # which deleted the limit given at construction there while Python still
    # counted it: after raising the limit an alloc within it succeeded, yet
    # limit_state said DEFERRED, the ledger said applied and
    # stats().limit_bytes was None (the construction limit was in no ledger).
    async with KVCacheManager(G, reserve=(0, 1), reserve_thread=reserve_thread, limit_bytes=4 * PAGE) as m:
        assert m.space.pool is not None
        st = m.stats()
        assert (st.limit_bytes, st.limit_revision, st.limit_state) == (4 * PAGE, 0, LimitState.APPLIED)
        (me,) = [t for t in m.space.pool.tenants() if t.name == m.name]
        assert me.limit_bytes == 4 * PAGE  # `kvpool top` shows it
        with pytest.raises(PoolExhausted):
            m.alloc_nowait(17)  # 5 pages: above the construction limit
        assert await m.set_limit(10 * PAGE) is LimitState.APPLIED
        await m.alloc(32)  # 8 pages: within the new limit
        assert m.limit_state is LimitState.APPLIED
        st = m.stats()
        assert (st.limit_bytes, st.limit_revision, st.limit_state) == (10 * PAGE, 1, LimitState.APPLIED)
        assert st.space.limit_pages == 10
        (me,) = [t for t in m.space.pool.tenants() if t.name == m.name]
        assert (me.limit_bytes, me.limit_state) == (10 * PAGE, "applied")
        with pytest.raises(PoolExhausted):
            m.alloc_nowait(9)  # 3 more pages: above the new limit


async def test_the_manager_ledger_and_stats_share_one_deferred_verdict() -> None:
    async with KVCacheManager(G, reserve=(0, 0), reserve_thread=False) as m:
        assert m.space.pool is not None
        ids = await m.alloc(16)  # 4 pages
        assert await m.set_limit(2 * PAGE + 1) is LimitState.DEFERRED  # not a page multiple: 2 pages
        (me,) = [t for t in m.space.pool.tenants() if t.name == m.name]
        st = m.stats()
        assert (st.limit_state, st.space.limit_deferred, me.limit_state) == (LimitState.DEFERRED, True, "deferred")
        m.free(ids[:8])  # 2 pages in use: within 2 pages + 1 byte
        (me,) = [t for t in m.space.pool.tenants() if t.name == m.name]
        st = m.stats()
        assert (st.limit_state, st.space.limit_deferred, me.limit_state) == (LimitState.APPLIED, False, "applied")
