"""Reclaim by completion first (issue 31; budget.hpp, rule 6).

The native budget is the one judge: a lender is asked to preempt
(``preempt_bytes``) only what the starving waiters need beyond what the
lenders' running requests free within the bound (their published
``freeing``), split most borrowed first. Events and counts only: no test
here reads a clock.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from kvpool import Geometry, KVCacheManager, Pool
from kvpool._demo_clock import RealClock
from kvpool import _demo_sched
from kvpool._demo_sched import Running, Scheduler
from kvpool._demo_traces import Request

from ._helpers import until

PAGE = 4096  # one region: a page commit is one page, 8 blocks of 512 bytes
GEOMETRY = Geometry(1, 1, 512, 256, page_bytes=PAGE)


def _manager(pool: str, name: str) -> KVCacheManager:
    return KVCacheManager(GEOMETRY, pool=pool, name=name, reserve=(0, 0), reserve_thread=False)


async def _wait_queued(m: KVCacheManager, alloc: Any) -> asyncio.Task[Any]:
    task: asyncio.Task[Any] = asyncio.ensure_future(alloc)
    await until(lambda: m.waiting != 0, "the alloc queues", interval=0)
    return task


def _pages(m: KVCacheManager, n: int) -> list[Any]:
    """n allocations of one whole page each (8 blocks: a fresh page every time)."""
    return [m.alloc_nowait(8) for _ in range(n)]


# ----------------------------------------------------------------- the verdict

@pytest.mark.parametrize(("freeing_pages", "preempt_pages"), [(2, 0), (3, 0), (1, 1), (0, 2)])
def test_a_lender_is_asked_to_preempt_only_what_its_completions_do_not_cover(
        pool_name: str, freeing_pages: int, preempt_pages: int) -> None:
    Pool(pool_name, capacity=8 * PAGE)  # two tenants: 4 pages guaranteed each

    async def main() -> None:
        a, b = _manager(pool_name, "a"), _manager(pool_name, "b")
        _pages(a, 7)  # borrows 3 pages; 1 page free
        waiter = await _wait_queued(b, b.alloc(24))  # 3 pages: 1 free, 2 short, within its guarantee
        a.publish_freeing(freeing_pages * PAGE)
        verdict = a.budget()
        assert verdict.lending and verdict.freeing_bytes == freeing_pages * PAGE
        assert verdict.preempt_bytes == preempt_pages * PAGE
        assert a.space.pool is not None
        row = next(t for t in a.space.pool.tenants() if t.name == "a")
        assert (row.freeing_bytes, row.preempt_bytes) == (freeing_pages * PAGE, preempt_pages * PAGE)
        assert b.budget().preempt_bytes == 0  # the waiter lends nothing
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        await a.aclose()
        await b.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(("a_freeing", "a_share", "c_share"), [(0, 2, 1), (1, 1, 1), (2, 0, 1), (3, 0, 1)])
def test_two_lenders_split_the_deficit_most_borrowed_first(pool_name: str, a_freeing: int, a_share: int,
                                                            c_share: int) -> None:
    Pool(pool_name, capacity=12 * PAGE)  # three tenants: 4 pages guaranteed each

    async def main() -> None:
        a, b, c = _manager(pool_name, "a"), _manager(pool_name, "b"), _manager(pool_name, "c")
        _pages(a, 6)  # borrows 2
        _pages(c, 5)  # borrows 1; 1 page free
        waiter = await _wait_queued(b, b.alloc(32))  # 4 pages: 3 short
        a.publish_freeing(a_freeing * PAGE)
        # Deficit 3 pages less a's freeing (up to what it borrows): a first
        # (it borrows most), at most what it borrows beyond its freeing; a
        # freeing beyond what it borrows covers nothing (at its guarantee it admits again).
        assert a.budget().preempt_bytes == a_share * PAGE
        assert c.budget().preempt_bytes == c_share * PAGE
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        for m in (a, b, c):
            await m.aclose()

    asyncio.run(main())


def test_freeing_is_validated(pool_name: str) -> None:
    Pool(pool_name, capacity=8 * PAGE)

    async def main() -> None:
        a = _manager(pool_name, "a")
        with pytest.raises(ValueError, match="freeing_bytes"):
            a.publish_freeing(-1)
        with pytest.raises(ValueError, match="requests"):
            a.free_preempted(a.alloc_nowait(1), requests=0, tokens=1)
        await a.aclose()

    asyncio.run(main())


def test_a_lender_counts_what_it_gives_back_by_completion_and_by_preemption(pool_name: str) -> None:
    Pool(pool_name, capacity=8 * PAGE)

    async def main() -> None:
        a, b = _manager(pool_name, "a"), _manager(pool_name, "b")
        held = _pages(a, 7)
        waiter = await _wait_queued(b, b.alloc(24))
        assert a.budget().preempt_bytes == 2 * PAGE
        a.free(held.pop())  # a request finishes: by completion
        a.free_preempted(held.pop(), requests=1, tokens=40)  # acted on the verdict
        b.poll()
        assert len(await waiter) == 24
        got = a.budget()
        assert (got.preemptions_asked, got.requests_preempted, got.tokens_recomputed) == (1, 1, 40)
        assert got.reclaimed_by_completion_bytes == 8 * 512
        assert got.reclaimed_by_preemption_bytes == 8 * 512
        assert a.space.pool is not None
        row = next(t for t in a.space.pool.tenants() if t.name == "a")
        assert (row.preemptions_asked, row.requests_preempted, row.tokens_recomputed) == (1, 1, 40)
        assert (row.reclaimed_by_completion_bytes, row.reclaimed_by_preemption_bytes) == (8 * 512, 8 * 512)
        await a.aclose()
        await b.aclose()

    asyncio.run(main())


# ------------------------------------------------- the engines act on it (issue 31's test)

class _Lender(Scheduler):
    """A demo engine reduced to its running requests: (request, ids, steps left, computed tokens)."""

    def __init__(self, m: KVCacheManager, waiter: KVCacheManager) -> None:
        super().__init__(0, m, RealClock())
        self.peers = [SimpleNamespace(m=waiter)]  # type: ignore[list-item]  # poll_peers reads .m only
        self.running: list[tuple[Request, Any, int, int]] = []

    def _running_requests(self) -> list[Running]:
        return [Running(r, ids, left, computed) for r, ids, left, computed in self.running]

    def _take(self, r: Request) -> Any:
        i = next(i for i, run in enumerate(self.running) if run[0] is r)
        return self.running.pop(i)[1]

    def finish(self, r: Request) -> None:
        i = next(i for i, run in enumerate(self.running) if run[0] is r)
        self.m.free(self.running.pop(i)[1])
        self.poll_peers()


def _saturated(pool_name: str, steps_left: list[int]) -> tuple[KVCacheManager, KVCacheManager, _Lender]:
    """Both tenants' compute and memory saturated: the lender runs 7 one-page requests (borrowing 3
    pages of a 4-page guarantee), the waiter, below its guarantee, waits for 3 pages with 1 free."""
    Pool(pool_name, capacity=8 * PAGE)
    a, b = _manager(pool_name, "lender"), _manager(pool_name, "waiter")
    lender = _Lender(a, b)
    for i, left in enumerate(steps_left):
        r = Request(f"r{i}", 0, 0.0, 40 + 10 * i, 100, 0)
        r.admitted = float(i)
        lender.running.append((r, a.alloc_nowait(8), left, 40 + 10 * i + 100 - left))
    return a, b, lender


def test_a_waiter_below_its_guarantee_is_granted_from_completions_with_no_preemption(
        pool_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_demo_sched, "RECLAIM_STEPS", 16)

    async def main() -> None:
        # Two requests finish within the bound: they cover the waiter's 2 missing pages.
        a, b, lender = _saturated(pool_name, [90, 80, 70, 60, 50, 1, 16])
        waiter = await _wait_queued(b, b.alloc(24))
        lender.act_on_lending()
        assert lender.preemptions == 0 and a.budget().preempt_bytes == 0
        for r, *_ in [run for run in lender.running if run[2] <= _demo_sched.RECLAIM_STEPS]:
            lender.act_on_lending()  # a step: still nothing to preempt
            assert lender.preemptions == 0
            lender.finish(r)
        assert len(await waiter) == 24
        got = a.budget()
        assert (got.preemptions_asked, got.requests_preempted, got.reclaimed_by_preemption_bytes) == (0, 0, 0)
        assert got.reclaimed_by_completion_bytes == 2 * 8 * 512
        await a.aclose()
        await b.aclose()

    asyncio.run(main())


def test_when_completions_come_too_late_the_lender_preempts_exactly_the_cheapest_requests(
        pool_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_demo_sched, "RECLAIM_STEPS", 16)

    async def main() -> None:
        # One request finishes within the bound (1 page); the second page
        # must be preempted: one request, the one with the fewest computed
        # tokens among those that do not finish within the bound.
        a, b, lender = _saturated(pool_name, [90, 30, 70, 60, 50, 1, 95])
        computed = {r.rid: c for r, _, left, c in lender.running if left > _demo_sched.RECLAIM_STEPS}
        waiter = await _wait_queued(b, b.alloc(24))
        lender.act_on_lending()
        assert lender.preemptions == 1 and lender.preemptions_asked == 1
        (victim,) = lender.pending
        assert computed[victim.rid] == min(computed.values()) and victim.preemptions == 1
        assert a.budget().preempt_bytes == 0  # the deficit is covered: the finishing request does the rest
        lender.act_on_lending()
        assert lender.preemptions == 1
        (finishing,) = [r for r, _, left, _ in lender.running if left <= _demo_sched.RECLAIM_STEPS]
        lender.finish(finishing)
        assert len(await waiter) == 24
        got = a.budget()
        assert (got.preemptions_asked, got.requests_preempted, got.tokens_recomputed) == (1, 1, computed[victim.rid])
        assert got.reclaimed_by_preemption_bytes == 8 * 512
        assert got.reclaimed_by_completion_bytes == 8 * 512
        await a.aclose()
        await b.aclose()

    asyncio.run(main())


def test_a_waiter_above_its_guarantee_never_makes_anyone_preempt(pool_name: str) -> None:
    Pool(pool_name, capacity=12 * PAGE)  # three tenants: 4 pages guaranteed each

    async def main() -> None:
        a, b, c = _manager(pool_name, "a"), _manager(pool_name, "b"), _manager(pool_name, "c")
        _pages(a, 5)  # borrows 1 page
        _pages(b, 5)  # borrows 1 page too
        _pages(c, 2)  # the pool is full
        waiter = await _wait_queued(b, b.alloc(8))  # b waits above its guarantee: a does not lend for it
        verdict = a.budget()
        assert not verdict.lending and verdict.preempt_bytes == 0
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        for m in (a, b, c):
            await m.aclose()

    asyncio.run(main())
