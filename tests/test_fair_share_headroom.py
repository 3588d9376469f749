"""Headroom (ARCHITECTURE.md, "Fair share", rule 6): borrowers leave part of an idle guarantee free.

A borrower gives memory back only at its next step (it preempts then), so
without headroom a light engine's next request waits up to one borrower step
even though its static slice would have served it at once. With
``headroom_bytes`` the tenant asks borrowers to leave ``min(headroom,
guarantee - claimed)`` of the pool free; growing within one's own guarantee
may still take it.

Real shared memory; the two-process test a real borrower process. Nothing
here depends on timing: each check is one call's answer.
"""

from __future__ import annotations

import pathlib

import pytest

from kvpool import KVCacheManager, KVSpace, Pool, PoolClosed, PoolExhausted

from . import _fair_child as child
from ._helpers import until
from .test_fair_share import BPP, POOL_BLOCKS, POOL_PAGES, churning_tenant, step

G = child.GEOMETRY  # 4 blocks a page
PCB = G.page_commit_bytes
CAP = POOL_PAGES * PCB


def space(pool: Pool, name: str, **kw: object) -> KVSpace:
    return KVSpace(G, pool=pool, name=name, reserve_thread=False, reserve=(0, 0), **kw)  # type: ignore[arg-type]


def row(pool: Pool, name: str):  # type: ignore[no-untyped-def]
    return next(t for t in pool.snapshot().tenants if t.name == name)


# ----------------------------------------------------------------- two processes

@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("headroom_pages", [0, 2])
async def test_a_borrower_in_another_process_leaves_the_headroom_free(
    pool_name: str, tmp_path: pathlib.Path, headroom_pages: int, anyio_backend: str
) -> None:
    # B is idle (holds nothing); A, in its own process, borrows all it can and
    # churns. With 0 headroom (the control: what every tenant got before this
    # rule) A takes the whole pool and B's first request finds nothing free;
    # with 2 pages of headroom A stops 2 pages short and B's request of 2
    # pages is granted at once, without A giving anything back.
    pool = Pool(pool_name, capacity=CAP)
    n = 2 * BPP
    async with KVCacheManager(G, pool=pool, name="B", reserve=(0, 0), headroom_bytes=headroom_pages * PCB) as b:
        async with churning_tenant(pool_name, tmp_path) as ctl:
            assert ctl["held"] == POOL_BLOCKS - headroom_pages * BPP
            assert row(pool, "B").keep_free_bytes == headroom_pages * PCB
            ctl["mode"] = child.STEP
            await until(lambda: ctl["phase"] == child.STEPPING, "tenant A switches to steps")
            await step(ctl)  # A churns inside its pages: it never needs a claim
            if headroom_pages == 0:
                with pytest.raises(PoolExhausted):
                    b.alloc_nowait(n)
                return
            ids = b.alloc_nowait(n)
            assert len(ids) == n and b.stats().committed_bytes == n // BPP * PCB
            releases = ctl["releases"]
            await step(ctl)
            assert ctl["releases"] == releases  # A gave nothing back for it
            # B is 2 pages into its 4-page guarantee: it still asks for 2 kept
            # free, and none is, so a borrower's growth would be refused.
            assert b.space.budget().keep_free_bytes == 2 * PCB
            b.free(ids)


# ------------------------------------------------------------------ one process

def test_growing_past_the_guarantee_stops_at_what_others_keep_free(pool_name: str) -> None:
    pool = Pool(pool_name, capacity=CAP)
    b = space(pool, "B", headroom_bytes=2 * PCB)
    a = space(pool, "A")
    try:
        # Two tenants on the default share: 4 pages each; B keeps 2 of its 4 free.
        assert b.budget().guarantee_bytes == 4 * PCB
        assert b.budget().keep_free_bytes == 2 * PCB
        r = row(pool, "B")
        assert (r.headroom_bytes, r.keep_free_bytes) == (2 * PCB, 2 * PCB)
        # Nobody waits (the budget's quiet path): A may borrow all but B's 2 pages.
        assert a.available() == (POOL_PAGES - 2) * BPP
        held = a.alloc((POOL_PAGES - 2) * BPP)
        assert a.available() == 0
        with pytest.raises(PoolExhausted):
            a.alloc(1)
        # Within its own guarantee B takes its headroom at once...
        got = b.alloc(BPP)
        # ...and still asks for min(2 pages, 4 - 1) kept free: A stays refused.
        assert b.budget().keep_free_bytes == 2 * PCB
        b.free(got)
        # A third tenant with no guarantee is a borrower too; while it waits
        # (the full judgement, not the quiet path) it is refused what B keeps free.
        c = space(pool, "C", guarantee_bytes=0)
        try:
            a.free(held[: 2 * BPP])  # 2 pages back: 4 free, B keeps 2
            assert c.available() == 2 * BPP
            c.alloc(2 * BPP)
            with pytest.raises(PoolExhausted):
                c.alloc(1)
            c.report_waiting(1)  # it queues: every judgement is a full one now
            assert a.available() == 0
            with pytest.raises(PoolExhausted):
                a.alloc(1)
            c.report_waiting(0)
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_a_borrower_restores_taken_headroom_and_stops_once_it_is_free_again(pool_name: str) -> None:
    pool = Pool(pool_name, capacity=CAP)
    b = space(pool, "B", headroom_bytes=2 * PCB)
    a = space(pool, "A")
    try:
        held = a.alloc((POOL_PAGES - 2) * BPP)  # all but B's 2 pages
        a.free(held[:1])  # one block free inside A's own pages
        assert a.available() == 1
        # B grows within its guarantee into its headroom: it still asks for 2
        # pages kept free and none is, so A restores them: no alloc, not even
        # inside its own pages, and no preemption asked (lending stays false).
        got = b.alloc(2 * BPP)
        ab = a.budget()
        assert ab.restoring and not ab.lending
        assert row(pool, "A").restoring and not row(pool, "A").lending
        assert a.available() == 0
        with pytest.raises(PoolExhausted):
            a.alloc(1)
        # B gives its pages back: A hears of it (the release bumps the pool's
        # generation because A restores) and borrows inside its pages again.
        b.free(got)
        assert not a.budget().restoring and a.available() == 1
        assert len(a.alloc(1)) == 1
    finally:
        a.close()
        b.close()


def test_keep_free_follows_the_guarantee_and_the_claims(pool_name: str) -> None:
    pool = Pool(pool_name, capacity=CAP)
    b = space(pool, "B", headroom_bytes=3 * PCB, guarantee_bytes=4 * PCB)
    try:
        assert b.budget().keep_free_bytes == 3 * PCB
        held = b.alloc(2 * BPP)  # 2 of 4 pages: min(3, 4 - 2) = 2
        assert b.budget().keep_free_bytes == 2 * PCB
        more = b.alloc(3 * BPP)  # 5 pages: above its guarantee, keeps nothing free
        assert b.budget().keep_free_bytes == 0 and row(pool, "B").keep_free_bytes == 0
        b.free(more)
        b.free(held)
        assert b.budget().keep_free_bytes == 3 * PCB
        b.set_headroom(0)
        assert row(pool, "B").keep_free_bytes == 0 and b.budget().headroom_bytes == 0
        b.set_headroom(8 * PCB)  # more than the guarantee: capped by it
        assert b.budget().keep_free_bytes == 4 * PCB
    finally:
        b.close()


@pytest.mark.parametrize("bad", [-1, True, 1.5, "4096", None])
def test_a_bad_headroom_is_refused_and_changes_nothing(pool_name: str, bad: object) -> None:
    pool = Pool(pool_name, capacity=CAP)
    with pytest.raises(ValueError, match="headroom_bytes"):
        space(pool, "X", headroom_bytes=bad)
    assert pool.snapshot().tenants == []  # no slot was taken
    b = space(pool, "B", headroom_bytes=PCB)
    try:
        with pytest.raises(ValueError, match="headroom_bytes"):
            b.set_headroom(bad)  # type: ignore[arg-type]
        assert b.budget().headroom_bytes == PCB and row(pool, "B").keep_free_bytes == PCB
    finally:
        b.close()
    with pytest.raises(PoolClosed):
        b.set_headroom(0)


def test_headroom_needs_a_pool() -> None:
    with pytest.raises(ValueError, match="needs a pool"):
        KVSpace(G, headroom_bytes=PCB)
    s = KVSpace(G)
    try:
        s.set_headroom(0)  # nothing to keep free from: 0 is accepted, anything else refused
        with pytest.raises(ValueError, match="needs a pool"):
            s.set_headroom(PCB)
        assert s.budget().headroom_bytes == 0
    finally:
        s.close()
