"""Cancellation at any await point of ``alloc`` loses no block (issue 10, D1).

On 884d081 an ``alloc`` granted at once still passed one schedule point,
anyio's *shielded* checkpoint. The shield holds off anyio and trio
cancellation, but asyncio's own (``Task.cancel``, ``asyncio.wait_for``,
``asyncio.timeout``) went through it: the CancelledError left ``alloc`` with
the ids granted and nobody holding them (129-155 blocks leaked per storm).
Now an immediate grant has no schedule point at all (issue 12: it is one
native call), so the ids always reach the caller; an alloc that waits is
cancellable until it is granted, and a grant racing its cancellation is
given back.

The storms count cancellations, never time: each runs until it has cancelled
``target`` allocs, then checks that every block is back, that no id was handed
out twice, and that grants kept FIFO order within a priority class.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import anyio
import numpy as np
import pytest

from kvpool import Geometry, KVCacheManager

from .conftest import KiB

pytestmark = pytest.mark.anyio

G = Geometry(1, 2, 4 * KiB, 96, page_bytes=16 * KiB)  # 4 blocks a page, 24 pages


def fresh_manager() -> KVCacheManager:
    return KVCacheManager(G, pool=None, reserve=(0, 4), reserve_thread=True, name="storm")


# ------------------------------------------------------- one cancel, each kind
# Each returns the ids the caller got (empty if the cancellation won).

async def _cancel_task_after_its_first_step(m: KVCacheManager) -> np.ndarray:
    t = asyncio.ensure_future(m.alloc(4))
    await asyncio.sleep(0)  # the task runs its first step: an immediate grant completes it
    t.cancel()
    try:
        return await t
    except asyncio.CancelledError:
        return np.empty(0, dtype=np.int64)


async def _wait_for_that_expires_at_once(m: KVCacheManager) -> np.ndarray:
    inner = asyncio.ensure_future(m.alloc(4))
    await asyncio.sleep(0)
    try:
        return await asyncio.wait_for(inner, timeout=0)  # expired: wait_for cancels inner unless it is done
    except (asyncio.TimeoutError, TimeoutError):
        return np.empty(0, dtype=np.int64)


async def _asyncio_timeout_expiring_around_the_alloc(m: KVCacheManager) -> np.ndarray:
    if sys.version_info < (3, 11):
        pytest.skip("asyncio.timeout is new in Python 3.11")
    loop = asyncio.get_running_loop()
    ids = np.empty(0, dtype=np.int64)
    try:
        async with asyncio.timeout(10) as cm:
            cm.reschedule(loop.time())  # expiry is queued now: it runs at the first schedule point
            ids = await m.alloc(4)
            await asyncio.sleep(0)  # the caller's own next await takes the cancellation
    except TimeoutError:
        pass
    return ids


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(
    "cancel",
    [_cancel_task_after_its_first_step, _wait_for_that_expires_at_once, _asyncio_timeout_expiring_around_the_alloc],
    ids=["task_cancel", "wait_for", "asyncio_timeout"],
)
async def test_an_asyncio_cancel_around_an_immediate_grant_leaves_every_block_with_a_holder(
    anyio_backend: str, cancel: Callable[[KVCacheManager], Awaitable[np.ndarray]]
) -> None:
    async with fresh_manager() as m:
        got = [await cancel(m) for _ in range(50)]
        st = m.stats()
        # Every granted block reached a caller (on 884d081: granted, then lost).
        assert st.used_blocks == sum(len(g) for g in got)
        assert st.granted_at_once == sum(1 for g in got if len(g))
        for g in got:
            m.free(g)
        assert m.stats().used_blocks == 0 and m.available() == G.capacity
        ids = await m.alloc(G.capacity)  # every id is still there to hand out
        assert sorted(ids.tolist()) == sorted(set(ids.tolist()))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_immediate_grant_is_one_step_of_the_task(anyio_backend: str) -> None:
    # No schedule point between the grant and the return: a task created and
    # cancelled right after its first step has its ids, never a half grant.
    async with fresh_manager() as m:
        t = asyncio.ensure_future(m.alloc(4))
        await asyncio.sleep(0)
        assert t.done() and len(t.result()) == 4
        m.free(t.result())


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_asyncio_cancel_after_a_queued_grant_gives_the_blocks_back(anyio_backend: str) -> None:
    async with fresh_manager() as m:
        held = await m.alloc(G.capacity)
        t = asyncio.ensure_future(m.alloc(4))
        for _ in range(10):
            await asyncio.sleep(0)
        assert m.waiting == 1
        m.free(held[:4])  # granted now, but the task has not resumed yet ...
        t.cancel()        # ... and asyncio cancels it before it does
        with pytest.raises(asyncio.CancelledError):
            await t
        assert m.stats().used_blocks == G.capacity - 4 and m.available() == 4


# ------------------------------------------------------------------- storms

def _check_fifo(m: KVCacheManager, priority: int, called_at: float, errors: list[str]) -> None:
    # Granted: nobody of this class that called alloc before us may still be queued.
    earlier = [w for w in m._queue if w.priority == priority and w.enqueued_at < called_at]
    if earlier:
        errors.append(f"granted while {len(earlier)} earlier waiters of priority {priority} still wait")


def _assert_no_waiter_stuck(m: KVCacheManager) -> None:
    head = m._queue.head()
    assert head is None or head.n > m.space.available(), "the head waiter fits but was not granted"


async def _finish(m: KVCacheManager, held: list[np.ndarray], fifo_errors: list[str]) -> None:
    assert m.waiting == 0
    assert not fifo_errors, fifo_errors[:5]
    assert m.stats().used_blocks == sum(len(h) for h in held)  # nothing granted without a holder
    all_ids = np.concatenate(held) if held else np.empty(0, dtype=np.int64)
    assert len(set(all_ids.tolist())) == len(all_ids)  # no block handed out twice
    for h in held:
        m.free(h)  # every id is freeable
    assert m.stats().used_blocks == 0
    assert m.available() == G.capacity


ASYNCIO_KINDS = ("task_cancel", "task_cancel_at_once", "wait_for", "anyio_scope", "alloc_timeout") + (
    ("asyncio_timeout",) if sys.version_info >= (3, 11) else ()  # asyncio.timeout is new in 3.11
)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_10000_cancel_storm_on_asyncio_leaks_no_block_and_keeps_fifo(anyio_backend: str) -> None:
    target = 10_000
    rng = random.Random(20261201)
    counts: Counter[str] = Counter()
    held: list[np.ndarray] = []
    fifo_errors: list[str] = []
    loop = asyncio.get_running_loop()

    async with fresh_manager() as m:

        async def acquire(n: int, priority: int, timeout: float | None = None) -> None:
            called_at = time.perf_counter()
            ids = await m.alloc(n, priority=priority, timeout=timeout)
            held.append(ids)  # held before any later await could be cancelled
            _check_fifo(m, priority, called_at, fifo_errors)

        async def run(kind: str, n: int, priority: int, scope: anyio.CancelScope) -> None:
            try:
                if kind == "wait_for":
                    await asyncio.wait_for(acquire(n, priority), timeout=rng.choice((0, 0, 1e-4, 1e-3, None)))
                elif kind == "asyncio_timeout":
                    async with asyncio.timeout(rng.choice((0, 0, 1e-4, 1e-3, None))):
                        await acquire(n, priority)
                elif kind == "anyio_scope":
                    with scope:
                        await acquire(n, priority)
                    if scope.cancelled_caught:
                        counts[kind] += 1
                elif kind == "alloc_timeout":
                    await acquire(n, priority, timeout=rng.choice((0.0, 0.0, 1e-4)))
                else:
                    await acquire(n, priority)
            except (asyncio.CancelledError, asyncio.TimeoutError, TimeoutError):
                counts[kind] += 1

        live: dict[asyncio.Task[None], anyio.CancelScope] = {}
        while sum(counts.values()) < target:
            r = rng.random()
            if r < 0.45:
                kind = rng.choice(ASYNCIO_KINDS)
                scope = anyio.CancelScope()
                t = loop.create_task(run(kind, rng.randint(1, 24), rng.choice((0, 0, 0, 1)), scope))
                live[t] = scope
                t.add_done_callback(live.pop)
                if kind == "task_cancel_at_once":
                    loop.call_soon(t.cancel)  # lands on the checkpoint right after an immediate grant
            elif r < 0.65 and live:
                t, scope = rng.choice(list(live.items()))
                scope.cancel() if rng.random() < 0.3 else t.cancel()
            elif r < 0.95 and held:
                m.free(held.pop(rng.randrange(len(held))))
            await asyncio.sleep(0)
            _assert_no_waiter_stuck(m)
        for t in list(live):
            t.cancel()
        await asyncio.gather(*live, return_exceptions=True)
        await _finish(m, held, fifo_errors)
    assert all(counts[k] > 100 for k in ASYNCIO_KINDS), counts


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_10000_cancel_storm_on_trio_leaks_no_block_and_keeps_fifo(anyio_backend: str) -> None:
    import trio

    target = 10_000
    rng = random.Random(20261202)
    counts: Counter[str] = Counter()
    held: list[np.ndarray] = []
    fifo_errors: list[str] = []

    async with fresh_manager() as m:

        async def run(kind: str, n: int, priority: int, scope: trio.CancelScope) -> None:
            try:
                with scope:
                    if kind == "move_on_after":
                        scope.deadline = trio.current_time() + rng.choice((0, 0, 1e-4, 1e-3))
                    called_at = time.perf_counter()
                    ids = await m.alloc(n, priority=priority, timeout=0.0 if kind == "alloc_timeout" else None)
                    held.append(ids)
                    _check_fifo(m, priority, called_at, fifo_errors)
                if scope.cancelled_caught:
                    counts[kind] += 1
            except TimeoutError:
                counts[kind] += 1
            finally:
                del live[scope]

        live: dict[trio.CancelScope, None] = {}
        async with trio.open_nursery() as nursery:
            while sum(counts.values()) < target:
                r = rng.random()
                if r < 0.45:
                    kind = rng.choice(("cancel_scope", "move_on_after", "alloc_timeout"))
                    scope = trio.CancelScope()
                    live[scope] = None
                    nursery.start_soon(run, kind, rng.randint(1, 24), rng.choice((0, 0, 0, 1)), scope)
                elif r < 0.65 and live:
                    rng.choice(list(live)).cancel()
                elif r < 0.95 and held:
                    m.free(held.pop(rng.randrange(len(held))))
                await trio.lowlevel.checkpoint()
                _assert_no_waiter_stuck(m)
            for scope in list(live):
                scope.cancel()
        await _finish(m, held, fifo_errors)
    assert all(counts[k] > 100 for k in ("cancel_scope", "move_on_after", "alloc_timeout")), counts
