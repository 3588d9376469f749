"""A failed alloc leaves the exact prior state (ARCHITECTURE.md invariant 3).

Faults come from the native test-only hook: the nth next page commit fails.
"""

from __future__ import annotations

import errno

import pytest

from kvpool import BackendError, Geometry, PoolExhausted

from .conftest import KiB, snapshot

G = Geometry(2, 2, 4 * KiB, 64, page_bytes=16 * KiB)  # 4 blocks a page, 16 pages, R = 4


def test_pages_committed_by_the_failed_call_are_released(make_space) -> None:
    space = make_space(G)
    before = snapshot(space)
    space._inject_fault("commit", 3, errno.EIO)  # pages 1 and 2 commit, page 3 fails
    with pytest.raises(BackendError, match="injected fault"):
        space.alloc(12)
    assert snapshot(space) == before
    assert space.allocated_bytes() == 0
    assert space.stats().commit_failures == 1
    assert len(space.alloc(12)) == 12  # the fault was one-shot


def test_pre_existing_partial_pages_keep_their_free_lists(make_space) -> None:
    space = make_space(G)
    held = space.alloc(6).tolist()  # page 0 full, page 1 half used
    space.free(held[:1])  # page 0 has one hole
    before = snapshot(space)
    free_before = {
        p.page: set(G.block_range(p.page)) - set(held[1:]) for p in space.page_occupancy() if p.state == "active"
    }
    space._inject_fault("commit", 2, errno.EIO)
    with pytest.raises(BackendError):
        space.alloc(3 + 8)  # the 3 holes + 2 new pages; the second commit fails
    assert snapshot(space) == before
    # The holes are exactly the ones that were free before.
    got = set(space.alloc(3).tolist())
    assert got == set().union(*free_before.values())


def test_idle_reserve_pages_stay(make_space) -> None:
    space = make_space(G, reserve=(0, 2))
    space.free(space.alloc(8))  # two pages emptied and kept idle (max 2)
    assert space.stats().pages_reserve == 2
    before = snapshot(space)
    space._inject_fault("commit", 1, errno.EIO)
    with pytest.raises(BackendError):
        space.alloc(8 + 4)  # both idle pages + one new page, whose commit fails
    assert snapshot(space) == before
    assert space.stats().pages_reserve == 2
    assert space.allocated_bytes() == 2 * G.page_commit_bytes


def test_out_of_memory_at_commit_is_a_shortage_not_an_error(make_space) -> None:
    space = make_space(G)
    before = snapshot(space)
    space._inject_fault("commit", 1, errno.ENOSPC)
    with pytest.raises(PoolExhausted, match="No space left on device") as err:
        space.alloc(4)
    assert err.value.requested == 4
    assert snapshot(space) == before


def test_a_failed_release_keeps_the_page_and_the_books_straight(make_space) -> None:
    space = make_space(G, reserve=(0, 4))
    space.free(space.alloc(8))
    space._inject_fault("release", 1, errno.EIO)
    with pytest.raises(BackendError, match="release"):
        space.trim()
    st = space.stats()
    assert st.pages_reserve == 1 and st.release_failures == 1
    assert space.allocated_bytes() == st.committed_bytes == G.page_commit_bytes
    assert space.trim() == 1
    assert space.allocated_bytes() == 0


def test_a_failed_inline_commit_reports_what_is_really_available(make_space) -> None:
    # Bug: the commit-failure path reported partial_free + idle reserve as
    # available, not available(): a fresh space said 0 blocks while all 64 were.
    space = make_space(G)
    space._inject_fault("commit", 1, errno.ENOSPC)
    with pytest.raises(PoolExhausted) as err:
        space.alloc(8)
    assert err.value.available == space.available() == 64
