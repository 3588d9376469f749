"""Fair share (issue 14): guarantee, borrow, lend, reclaim, admission.

Real processes and real shared memory. The tests count operations (frees,
refusals, steps) and wait for events; a hang ends in the test's timeout.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from kvpool import (
    Geometry,
    KVCacheManager,
    KVSpace,
    LedgerError,
    LimitState,
    Pool,
    PoolExhausted,
    RequestTooLarge,
)
from kvpool._sizes import format_size_exact

from . import _fair_child as child
from ._helpers import until
from .conftest import KiB

G = child.GEOMETRY            # 4 blocks a page, 32 KiB per page commit
PCB = G.page_commit_bytes
BPP = 4                        # blocks per page of G
POOL_PAGES = 8                 # the churn tests' pool: 8 page commits = 32 blocks
POOL_BLOCKS = POOL_PAGES * BPP
CHILD = pathlib.Path(child.__file__)
GUARD_S = 240  # hang guard only (see the module docstring)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def churning_tenant(pool_name: str, tmp_path: pathlib.Path, name: str = "A") -> AsyncIterator[child.Ctl]:
    """Tenant A in its own process: borrows the whole pool, then churns (tests/_fair_child.py)."""
    ctl_path = str(tmp_path / f"ctl-{name}")
    ctl = child.Ctl.create(ctl_path)
    # cwd: the installed kvpool, never the source tree's kvpool/ (it has no _native).
    p = subprocess.Popen([sys.executable, str(CHILD), "churn", pool_name, name, ctl_path], cwd=tmp_path,
                         stderr=subprocess.PIPE, text=True)
    try:
        await until(lambda: ctl["phase"] >= child.HOLDING or p.poll() is not None, "tenant A fills the pool")
        assert p.poll() is None, f"tenant A died: {p.stderr.read() if p.stderr else ''}"
        yield ctl
        ctl["mode"] = child.STOP
        await until(lambda: ctl["phase"] == child.STOPPED or p.poll() is not None, "tenant A stops")
    finally:
        p.kill()
        p.wait()
        if p.stderr is not None:
            p.stderr.close()


async def step(ctl: child.Ctl) -> None:
    """Let tenant A do exactly one churn step (free one block, alloc one block)."""
    target = ctl["done"] + 1
    ctl["token"] = target
    await until(lambda: ctl["done"] >= target, "tenant A does one step")


def frees_of_pages(n: int) -> int:
    """Frees that empty the pages n blocks need, when a lender frees lowest ids first."""
    return -(-n // BPP) * BPP


# =============================================================================
# 1. Two processes: a churning borrower lends to a waiter below its guarantee.
#
# Without the policy (main before issue 14, no guarantees) these fail: A's
# free(lowest) + alloc(1) gets the same block back (best fit: the only partly
# used page), its pages never empty, nothing goes back to the pool, and B's
# alloc waits forever for memory its static half would have had. The lockstep
# test then fails on its step bound (B still waiting after 2x A's holdings in
# steps), the free-running one on its hang guard. The control test below
# reproduces exactly that old behaviour by giving B no guarantee.
# =============================================================================


async def test_a_waiter_below_its_guarantee_is_granted_after_the_frees_of_the_pages_it_needs(
    pool_name: str, tmp_path: pathlib.Path
) -> None:
    pool = Pool(pool_name, capacity=POOL_PAGES * PCB)
    async with KVCacheManager(G, pool=pool, name="B", reserve=(0, 0)) as b:
        async with churning_tenant(pool_name, tmp_path) as ctl:
            # A borrows the whole pool and recycles its own blocks: no page empties.
            await until(lambda: ctl["frees"] >= 4 * POOL_BLOCKS, "tenant A churns")
            assert ctl["held"] == POOL_BLOCKS
            assert ctl["refusals"] == 0 and ctl["releases"] == 0
            ctl["mode"] = child.STEP
            await until(lambda: ctl["phase"] == child.STEPPING, "tenant A switches to steps")
            frees0, allocs0, refusals0 = ctl["frees"], ctl["allocs"], ctl["refusals"]

            g = b.space.budget().guarantee_bytes
            assert g == POOL_PAGES * PCB // 2  # two tenants on the default share
            n = 2 * BPP                         # 2 pages: half of B's guarantee
            got: list[int] = []

            async def want() -> None:
                got.extend((await b.alloc(n)).tolist())

            steps = 0
            async with anyio.create_task_group() as tg:
                tg.start_soon(want)
                await until(lambda: b.waiting == 1, "B queues its alloc")
                while not got and steps < 2 * POOL_BLOCKS:
                    await step(ctl)
                    steps += 1
                    b.poll()  # hand over what A's step freed now: the count must not depend on the loop
                    for _ in range(3):
                        await anyio.lowlevel.checkpoint()
                    if not got:
                        # While B waits, every re-alloc of A is refused.
                        assert ctl["allocs"] == allocs0, f"A re-allocated while B waited (step {steps})"
                assert got, f"B still waits after {steps} of A's steps: A never lent"
            frees = ctl["frees"] - frees0
            # B needs 2 pages; A frees lowest ids first, so its frees empty its
            # pages one by one and each emptied page goes back at once. Slack:
            # BPP - 1 frees, for a page A had begun to empty before it saw B
            # (none in this lockstep run, where A paused between whole steps).
            assert frees_of_pages(n) <= frees <= frees_of_pages(n) + BPP - 1, frees
            assert ctl["refusals"] - refusals0 == steps  # every step's alloc was refused
            assert ctl["allocs"] == allocs0
            assert len(got) == n and b.stats().committed_bytes == 2 * PCB
            # Nobody waits any more: A may borrow again (its next alloc is granted).
            await step(ctl)
            assert ctl["allocs"] == allocs0 + 1
        assert not b.space.budget().lending


async def test_without_a_guarantee_the_churn_starves_the_waiter_as_on_the_old_policy(
    pool_name: str, tmp_path: pathlib.Path
) -> None:
    # The control of the test above: B with an explicit guarantee of 0 is what
    # every tenant was before issue 14. Same churn, same request: A is never
    # refused, never empties a page, and B is not granted.
    pool = Pool(pool_name, capacity=POOL_PAGES * PCB)
    async with KVCacheManager(G, pool=pool, name="B", reserve=(0, 0), guarantee_bytes=0) as b:
        async with churning_tenant(pool_name, tmp_path) as ctl:
            ctl["mode"] = child.STEP
            await until(lambda: ctl["phase"] == child.STEPPING, "tenant A switches to steps")
            got: list[int] = []

            async def want() -> None:
                got.extend((await b.alloc(2 * BPP)).tolist())

            async with anyio.create_task_group() as tg:
                tg.start_soon(want)
                await until(lambda: b.waiting == 1, "B queues its alloc")
                for _ in range(2 * POOL_BLOCKS):
                    await step(ctl)
                    b.poll()
                assert not got
                assert ctl["refusals"] == 0 and ctl["releases"] == 0 and ctl["held"] == POOL_BLOCKS
                tg.cancel_scope.cancel()
            assert b.waiting == 0


async def test_a_free_running_churn_lends_to_a_waiter_through_the_pool_alone(
    pool_name: str, tmp_path: pathlib.Path
) -> None:
    # No lockstep, no poll(): A churns at full speed in its process; B's grant
    # reaches it through the ledger futex -> watcher -> eventfd -> event loop.
    pool = Pool(pool_name, capacity=POOL_PAGES * PCB)
    async with KVCacheManager(G, pool=pool, name="B", reserve=(0, 0)) as b:
        async with churning_tenant(pool_name, tmp_path) as ctl:
            await until(lambda: ctl["frees"] >= 4 * POOL_BLOCKS, "tenant A churns")
            n = 2 * BPP
            with anyio.fail_after(GUARD_S):
                ids = await b.alloc(n)
            held_at_grant = ctl["held"]  # A writes it after each step: it may lag A by one step
            a_row = {t.name: t for t in pool.snapshot().tenants}["A"]
            assert len(ids) == n
            assert ctl["first_refusal_frees"] >= 0 and ctl["refusals"] >= 1, "A was never refused"
        # Counted after A stopped (its last words are written).
        assert ctl["violations"] == 0, "A was granted an alloc while it borrowed and B waited"
        # A gave up at least the blocks of B's pages, and never more than it
        # borrowed: it is never pushed below its guarantee of 16 blocks (one
        # under it between a free and its re-alloc). So B was granted within
        # A's borrowed blocks of net frees.
        guarantee_blocks = POOL_BLOCKS // 2
        assert ctl["min_held_after_refusal"] >= guarantee_blocks - 1
        assert frees_of_pages(n) - 1 <= POOL_BLOCKS - held_at_grant <= POOL_BLOCKS - guarantee_blocks + 1
        assert a_row.guarantee_bytes == POOL_PAGES * PCB // 2 <= a_row.committed_bytes
        b.free(ids)


# =============================================================================
# 2. Admission and the queue: regressions of issue 14.
# =============================================================================

# The geometry of /work/shared/repro/hol_unsatisfiable_waiter.py: 4 blocks a
# page, 128 KiB per page commit; a 1 MiB pool holds 8 pages = 32 blocks of the
# space's 256.
G_REPRO = Geometry(num_layers=1, num_kv_buffers=2, block_bytes=16 * KiB, num_blocks=256, page_bytes=64 * KiB)


async def test_an_alloc_the_pool_can_never_back_raises_at_once_and_never_blocks_the_queue(pool_name: str) -> None:
    # Regression (issue 14, hol_unsatisfiable_waiter.py): alloc(100) in a pool
    # of 32 blocks was queued forever, and alloc(1) behind it waited too.
    Pool(pool_name, capacity=1 << 20)
    async with KVCacheManager(G_REPRO, pool=pool_name, name="t") as kv:
        results: dict[str, object] = {}

        async def big() -> None:
            try:
                await kv.alloc(100)
            except RequestTooLarge as e:
                results["big"] = e

        async with anyio.create_task_group() as tg:
            tg.start_soon(big)
            await anyio.sleep(0)
            with anyio.fail_after(GUARD_S):  # hang guard: it is granted at once
                small = await kv.alloc(1)
        e = results["big"]
        assert isinstance(e, RequestTooLarge) and isinstance(e, PoolExhausted) and isinstance(e, ValueError)
        assert e.requested == 100 and e.max_blocks == 32
        assert "32" in str(e) and format_size_exact(1 << 20) in str(e)  # the numbers, as the operator writes sizes
        assert kv.waiting == 0 and kv.stats().shortages >= 1
        with pytest.raises(RequestTooLarge):
            kv.alloc_nowait(33)
        kv.free(small)
        held = kv.alloc_nowait(32)  # the most it can hold is grantable
        kv.free(held)


def test_a_space_refuses_what_the_pool_can_never_back_at_once(pool_name: str) -> None:
    s = KVSpace(G_REPRO, pool=Pool(pool_name, capacity=1 << 20), name="s", reserve_thread=False, reserve=(0, 0))
    try:
        before = s.stats()
        with pytest.raises(RequestTooLarge) as info:
            s.alloc(33)
        assert info.value.max_blocks == 32 and info.value.requested == 33
        after = s.stats()
        assert (after.used_blocks, after.committed_bytes) == (before.used_blocks, before.committed_bytes)
        assert s.max_blocks() == 32 and len(s.alloc(32)) == 32
    finally:
        s.close()


@pytest.mark.parametrize("pooled", [False, True], ids=["private", "pooled"])
async def test_an_alloc_beyond_the_limit_raises_at_once(pooled: bool, pool_name: str) -> None:
    pool = Pool(pool_name, capacity=POOL_PAGES * PCB) if pooled else None
    async with KVCacheManager(G, pool=pool, name="t", reserve=(0, 0), limit_bytes=2 * PCB) as m:
        with pytest.raises(RequestTooLarge) as info:
            await m.alloc(2 * BPP + 1)
        assert info.value.max_blocks == 2 * BPP and m.waiting == 0
        with pytest.raises(RequestTooLarge):
            m.space.alloc(2 * BPP + 1)
        ids = await m.alloc(2 * BPP)
        m.free(ids)


async def test_a_lowered_limit_fails_a_waiter_that_can_never_fit_and_serves_the_one_behind() -> None:
    async with KVCacheManager(G, pool=None, name="t", reserve=(0, 0), reserve_thread=False,
                              limit_bytes=8 * PCB) as m:
        held = m.alloc_nowait(6 * BPP)  # 6 full pages
        out: dict[str, object] = {}

        async def ask(key: str, n: int) -> None:
            try:
                out[key] = await m.alloc(n)
            except RequestTooLarge as e:
                out[key] = e

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, "head", 3 * BPP)  # fits the limit of 8 pages, not now
            await until(lambda: m.waiting == 1, "the head queues")
            tg.start_soon(ask, "next", 2)
            await until(lambda: m.waiting == 2, "the second queues behind it")
            state = await m.set_limit(2 * PCB)  # now it can never hold 3 pages
            assert state is LimitState.DEFERRED
            await until(lambda: "head" in out, "the head is failed")
            assert isinstance(out["head"], RequestTooLarge) and out["head"].max_blocks == 2 * BPP
            assert m.waiting == 1  # the small one waits for memory, not behind the head
            m.free(held[BPP:])     # 5 pages empty and go back: 1 page committed, limit 2
            await until(lambda: "next" in out, "the second is granted")
        assert isinstance(out["next"], np.ndarray) and len(out["next"]) == 2
        assert m.limit_state is LimitState.APPLIED


async def test_an_operators_lower_limit_fails_a_waiter_through_the_pool(pool_name: str) -> None:
    pool = Pool(pool_name, capacity=POOL_PAGES * PCB)
    other = KVSpace(G, pool=pool, name="other", reserve_thread=False, reserve=(0, 0))
    try:
        other_ids = other.alloc(4 * BPP)  # its guarantee: half the pool
        async with KVCacheManager(G, pool=pool, name="m", reserve=(0, 0)) as m:
            mine = m.alloc_nowait(4 * BPP)
            out: list[BaseException] = []

            async def ask() -> None:
                try:
                    await m.alloc(5 * BPP)  # within the pool, not now (nobody borrows: nobody lends)
                except RequestTooLarge as e:
                    out.append(e)

            async with anyio.create_task_group() as tg:
                tg.start_soon(ask)
                await until(lambda: m.waiting == 1, "the waiter queues")
                # Another handle, as `kvpool limit` would: no call into m at all.
                assert Pool(pool_name, create=False).set_limit("m", 4 * PCB) == "applied"
                await until(lambda: bool(out), "the waiter is failed by the pool's wake-up")
            assert out[0].max_blocks == 4 * BPP  # type: ignore[attr-defined]
            assert m.waiting == 0
            m.free(mine)
        other.free(other_ids)
    finally:
        other.close()


# =============================================================================
# 3. Guarantees: default share, explicit settings, revisions, the capacity cap.
# =============================================================================


def _space(pool: Pool, name: str, **kw: object) -> KVSpace:
    return KVSpace(G, pool=pool, name=name, reserve_thread=False, reserve=(0, 0), **kw)  # type: ignore[arg-type]


def _guarantees(pool: Pool) -> dict[str, int]:
    return {t.name: t.guarantee_bytes for t in pool.tenants()}


def test_the_default_guarantee_is_an_equal_share_as_tenants_join_and_leave(pool_name: str) -> None:
    cap = 12 * PCB
    pool = Pool(pool_name, capacity=cap)
    spaces: list[KVSpace] = []
    try:
        for k in range(1, 5):
            spaces.append(_space(pool, f"t{k}"))
            assert _guarantees(pool) == {f"t{i}": cap // k for i in range(1, k + 1)}
            for s in spaces:
                b = s.budget()
                assert (b.guarantee_bytes, b.guarantee_setting, b.pool_capacity) == (cap // k, None, cap)
        while spaces:
            spaces.pop(0).close()
            k = len(spaces)
            assert _guarantees(pool) == {s.name: cap // k for s in spaces}
            assert all(s.budget().guarantee_bytes == cap // k for s in spaces)
    finally:
        for s in spaces:
            s.close()


def test_an_explicit_guarantee_at_construction_leaves_the_rest_to_the_default_share(pool_name: str) -> None:
    cap = 12 * PCB
    pool = Pool(pool_name, capacity=cap)
    a = _space(pool, "a", guarantee_bytes=6 * PCB)
    b, c = _space(pool, "b"), _space(pool, "c")
    try:
        assert _guarantees(pool) == {"a": 6 * PCB, "b": 3 * PCB, "c": 3 * PCB}
        ba = a.budget()
        assert (ba.guarantee_bytes, ba.guarantee_setting, ba.guarantee_revision) == (6 * PCB, 6 * PCB, 0)
        assert b.budget().guarantee_setting is None and b.budget().guarantee_bytes == 3 * PCB
        row = {t.name: t for t in pool.tenants()}["a"]
        assert (row.guarantee_setting, row.guarantee_revision) == (6 * PCB, 0)
    finally:
        for s in (a, b, c):
            s.close()


async def test_a_manager_takes_a_guarantee_and_sets_it_revisioned(pool_name: str) -> None:
    cap = 8 * PCB
    pool = Pool(pool_name, capacity=cap)
    async with KVCacheManager(G, pool=pool, name="m", reserve=(0, 0), guarantee_bytes=2 * PCB) as m:
        s = m.stats()
        assert s.guarantee_bytes == 2 * PCB and s.space.budget.guarantee_setting == 2 * PCB
        assert m.set_guarantee(3 * PCB, revision=1) is LimitState.APPLIED
        assert m.stats().guarantee_bytes == 3 * PCB and m.space.budget().guarantee_revision == 1
        assert m.set_guarantee(4 * PCB, revision=1) is LimitState.CONFLICT
        assert m.set_guarantee(1 * PCB, revision=0) is LimitState.STALE
        assert m.space.budget().guarantee_bytes == 3 * PCB
        assert m.set_guarantee(None) is LimitState.APPLIED  # next revision: back to the default share
        b = m.space.budget()
        assert (b.guarantee_setting, b.guarantee_revision, b.guarantee_bytes) == (None, 2, cap)


def test_pool_set_guarantee_is_revisioned_like_limits(pool_name: str) -> None:
    cap = 8 * PCB
    pool = Pool(pool_name, capacity=cap)
    a, b = _space(pool, "a"), _space(pool, "b")
    try:
        assert pool.set_guarantee("a", 6 * PCB, revision=1) == "applied"
        assert _guarantees(pool) == {"a": 6 * PCB, "b": 2 * PCB}
        assert a.budget().guarantee_bytes == 6 * PCB and b.budget().guarantee_bytes == 2 * PCB
        assert pool.set_guarantee("a", 6 * PCB, revision=1) == "same"
        assert pool.set_guarantee("a", 5 * PCB, revision=1) == "conflict"
        assert pool.set_guarantee("a", 1 * PCB, revision=0) == "stale"
        assert _guarantees(pool) == {"a": 6 * PCB, "b": 2 * PCB}
        assert pool.set_guarantee("a", None) == "applied"  # revision 2
        row = {t.name: t for t in pool.tenants()}["a"]
        assert (row.guarantee_setting, row.guarantee_revision, row.guarantee_bytes) == (None, 2, cap // 2)
        with pytest.raises(LedgerError):
            pool.set_guarantee("nobody", PCB)
    finally:
        a.close()
        b.close()


def test_explicit_guarantees_above_the_capacity_are_refused_with_the_numbers_and_change_nothing(
    pool_name: str,
) -> None:
    cap = 8 * PCB
    pool = Pool(pool_name, capacity=cap)
    a = _space(pool, "a", guarantee_bytes=5 * PCB)
    b = _space(pool, "b")
    try:
        before = [(t.name, t.guarantee_bytes, t.guarantee_setting, t.guarantee_revision) for t in pool.tenants()]
        with pytest.raises(ValueError) as info:
            pool.set_guarantee("b", 4 * PCB, revision=1)
        msg = str(info.value)
        assert all(format_size_exact(n) in msg for n in (4 * PCB, 9 * PCB, cap)), msg
        with pytest.raises(ValueError):
            pool.set_guarantee("b", cap + 1)
        with pytest.raises(ValueError):
            b.set_guarantee(4 * PCB)
        after = [(t.name, t.guarantee_bytes, t.guarantee_setting, t.guarantee_revision) for t in pool.tenants()]
        assert after == before
        # The refused revision was not taken: revision 1 still applies.
        assert pool.set_guarantee("b", 3 * PCB, revision=1) == "applied"
        # At construction: refused, and no tenant slot is left behind.
        with pytest.raises((ValueError, LedgerError)) as info2:
            _space(pool, "c", guarantee_bytes=1 * PCB)
        assert format_size_exact(1 * PCB) in str(info2.value) and format_size_exact(cap) in str(info2.value)
        assert sorted(t.name for t in pool.tenants()) == ["a", "b"]
    finally:
        a.close()
        b.close()


async def test_a_manager_guarantee_above_the_capacity_is_refused(pool_name: str) -> None:
    pool = Pool(pool_name, capacity=4 * PCB)
    async with KVCacheManager(G, pool=pool, name="m", reserve=(0, 0)) as m:
        with pytest.raises(ValueError):
            m.set_guarantee(5 * PCB)
        b = m.space.budget()
        assert (b.guarantee_setting, b.guarantee_revision) == (None, 0)
    with pytest.raises(ValueError):
        async with KVCacheManager(G, pool=None, name="p") as p:
            p.set_guarantee(PCB)


@pytest.mark.parametrize("equal", [False, True], ids=["furthest_below_first", "fifo_among_equals"])
def test_waiters_are_granted_furthest_below_their_guarantee_first(equal: bool, pool_name: str) -> None:
    pool = Pool(pool_name, capacity=POOL_PAGES * PCB)
    # `late` arrives second; it is further below its guarantee unless `equal`.
    early = _space(pool, "early", guarantee_bytes=2 * PCB)
    late = _space(pool, "late", guarantee_bytes=(2 if equal else 4) * PCB)
    lender = _space(pool, "lender")  # the default share: what the explicit ones leave
    spaces = (early, late, lender)
    try:
        held = lender.alloc(POOL_BLOCKS)  # borrows the whole pool
        for s in (early, late):
            with pytest.raises(PoolExhausted):
                s.alloc(BPP)
            s.report_waiting(1)  # queued by its manager: wants one page
        assert lender.budget().lending
        lender.free(held[:BPP])  # one page empties and goes back at once
        assert pool.snapshot().committed == (POOL_PAGES - 1) * PCB
        first, second = (early, late) if equal else (late, early)
        with pytest.raises(PoolExhausted):
            second.alloc(BPP)  # the page is the first one's
        assert len(first.alloc(BPP)) == BPP
        first.report_waiting(0)
        lender.free(held[BPP : 2 * BPP])
        assert len(second.alloc(BPP)) == BPP
    finally:
        for s in spaces:
            s.close()


# =============================================================================
# 4. Bugs found while writing these tests (xfail(strict=True): the branch stays
#    green; a fix turns them into failures that ask for the marker's removal).
# =============================================================================


def test_a_borrower_lends_as_soon_as_a_waiting_tenant_drops_below_its_guarantee(pool_name: str) -> None:
    pool = Pool(pool_name, capacity=POOL_PAGES * PCB)
    w = _space(pool, "w", guarantee_bytes=4 * PCB)
    lender = _space(pool, "l", guarantee_bytes=2 * PCB)  # 2 pages nobody is guaranteed: both may borrow
    try:
        w_ids = w.alloc(5 * BPP)       # borrows 1 page
        l_ids = lender.alloc(3 * BPP)  # borrows 1 page; the pool is full
        with pytest.raises(PoolExhausted):
            w.alloc(3 * BPP)
        w.report_waiting(1)  # its manager queued the request; w is above its guarantee: nobody lends yet
        assert not lender.budget().lending  # l has taken this news
        w.free(w_ids[: 2 * BPP])  # 2 pages go back: w holds 3 pages, below its guarantee of 4, still waiting
        with pytest.raises(PoolExhausted):
            w.alloc(3 * BPP)  # its manager's dispatch: 2 pages free, 3 wanted
        row = {t.name: t for t in pool.snapshot().tenants}["w"]
        assert row.want_bytes > 0 and row.committed_bytes < row.guarantee_bytes
        # l borrows (3 pages > 2) while w waits below its guarantee: l lends.
        assert lender.budget().lending
        lender.free(l_ids[:1])
        with pytest.raises(PoolExhausted):
            lender.alloc(1)  # a lender's re-alloc is refused
    finally:
        w.close()
        lender.close()


def test_a_guarantee_that_does_not_fit_is_the_same_error_at_construction_and_when_set(pool_name: str) -> None:
    pool = Pool(pool_name, capacity=4 * PCB)
    a = _space(pool, "a", guarantee_bytes=3 * PCB)
    try:
        with pytest.raises(ValueError):
            pool.set_guarantee("a", 5 * PCB)
        try:
            _space(pool, "b", guarantee_bytes=2 * PCB)
        except Exception as e:  # noqa: BLE001 - the type is what is judged
            assert isinstance(e, ValueError) and not isinstance(e, LedgerError), type(e)
        else:
            raise AssertionError("not refused")
    finally:
        a.close()
