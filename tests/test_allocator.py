"""Block allocator: all-or-nothing alloc, whole-batch free validation, null block, best fit."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvpool import Geometry, InvalidBlocks, PoolExhausted

from .conftest import KiB, snapshot

# 4 KiB blocks on 16 KiB pages: 4 blocks a page; 6 KiB blocks make straddlers.
SMALL = Geometry(1, 2, 4 * KiB, 16, page_bytes=16 * KiB)
STRADDLE = Geometry(1, 1, 6 * KiB, 8, page_bytes=16 * KiB)  # blocks 2 and 5 straddle


def test_alloc_returns_distinct_int64_ids_in_range(make_space) -> None:
    space = make_space(SMALL)
    ids = space.alloc(7)
    assert ids.dtype == np.int64 and ids.shape == (7,)
    assert len(set(ids.tolist())) == 7 and all(0 <= i < 16 for i in ids)
    assert space.available() == 9
    assert space.stats().used_blocks == 7


def test_alloc_zero_is_empty_and_negative_is_rejected(make_space) -> None:
    space = make_space(SMALL)
    assert space.alloc(0).size == 0
    with pytest.raises(ValueError):
        space.alloc(-1)
    with pytest.raises(ValueError):
        space.alloc(1.5)  # type: ignore[arg-type]


def test_shortage_changes_nothing_and_carries_numbers(make_space) -> None:
    space = make_space(SMALL)
    space.alloc(10)
    before = snapshot(space)
    with pytest.raises(PoolExhausted) as err:
        space.alloc(7)
    assert (err.value.requested, err.value.available) == (7, 6)
    assert snapshot(space) == before
    assert space.stats().shortages == 1


BAD_FREES = {
    "never allocated": lambda held: [held[0], 15],
    "double free": None,  # handled in the test
    "duplicate in one batch": lambda held: [held[0], held[1], held[0]],
    "negative": lambda held: [held[0], -3],
    "beyond num_blocks": lambda held: [held[0], 16],
}


@pytest.mark.parametrize("case", sorted(BAD_FREES))
def test_bad_free_names_the_ids_and_frees_nothing(make_space, case: str) -> None:
    space = make_space(SMALL)
    held = space.alloc(3).tolist()
    if case == "double free":
        space.free([held[2]])
        batch, bad = [held[0], held[2]], [held[2]]
    else:
        batch = BAD_FREES[case](held)
        bad = [batch[-1]]
    before = snapshot(space)
    with pytest.raises(InvalidBlocks) as err:
        space.free(batch)
    assert err.value.ids == bad
    assert str(bad[0]) in str(err.value)
    assert snapshot(space) == before


def test_free_of_a_straddling_id_is_rejected(make_space) -> None:
    space = make_space(STRADDLE)
    held = space.alloc(2).tolist()
    before = snapshot(space)
    with pytest.raises(InvalidBlocks, match="2 straddles a page boundary") as err:
        space.free(held + [2])
    assert err.value.ids == [2]
    assert snapshot(space) == before


@pytest.mark.parametrize(
    "batch, message",
    [
        (np.array([1.0, 2.0]), "must be integers, got dtype float64"),
        (np.array([[0, 1]]), "must be a 1-D sequence, got shape"),
        (torch.tensor([[0]]), "must be a 1-D sequence"),
        (np.array([True]), "must be integers, got dtype bool"),
        (np.array([2**63], dtype=np.uint64), "out of range"),
    ],
)
def test_free_of_wrong_dtype_or_shape_is_rejected(make_space, batch: object, message: str) -> None:
    space = make_space(SMALL)
    space.alloc(3)
    before = snapshot(space)
    with pytest.raises(InvalidBlocks, match=message):
        space.free(batch)  # type: ignore[arg-type]
    assert snapshot(space) == before


def test_free_accepts_lists_numpy_and_torch_ids(make_space) -> None:
    space = make_space(SMALL)
    a, b, c = space.alloc(2), space.alloc(2), space.alloc(2)
    space.free(a.tolist())
    space.free(torch.from_numpy(b).to(torch.int32))
    space.free(c.astype(np.uint16))
    assert space.stats().used_blocks == 0


def test_null_block_is_held_from_the_start_and_never_handed_out(make_space) -> None:
    space = make_space(SMALL, null_block=True)
    assert space.available() == 15
    ids = space.alloc(15).tolist()
    assert 0 not in ids
    with pytest.raises(InvalidBlocks, match="0 is the null block"):
        space.free([0])
    space.free(ids)
    space.trim()
    # The null block's page stays committed (pinned) for the space's life.
    assert space.page_occupancy([0])[0].state == "active"
    assert space.allocated_bytes() == SMALL.page_commit_bytes


def test_best_fit_fills_the_page_that_completes_a_request(make_space) -> None:
    space = make_space(SMALL, reserve=(0, 4))
    first = space.alloc(16).tolist()  # 4 full pages
    # Leave 1 free block on page 0, 3 free on page 1, 2 on page 2.
    space.free([first[0]] + first[4:7] + first[8:10])
    got = space.alloc(2).tolist()
    assert sorted(got) == sorted(first[8:10])  # the page with exactly 2 free
    got = space.alloc(1).tolist()
    assert got == [first[0]]  # smallest bucket that fits
    occ = space.page_occupancy()
    assert [p.used for p in occ] == [4, 1, 4, 4]


def test_page_occupancy_reports_state_and_use(make_space) -> None:
    space = make_space(SMALL, reserve=(0, 1))
    ids = space.alloc(5)
    occ = space.page_occupancy([0, 1, 2])
    assert [(p.state, p.used, p.capacity) for p in occ] == [("active", 4, 4), ("active", 1, 4), ("free", 0, 4)]
    space.free(ids)
    assert [p.state for p in space.page_occupancy([0, 1])].count("reserve") == 1  # max 1 kept idle
    with pytest.raises(IndexError):
        space.page_occupancy([4])


def test_room_blocks_counts_the_free_blocks_of_active_pages_through_allocs_and_frees(make_space) -> None:
    # The figure a lender's running requests grow into (the vLLM plugin's and
    # the SGLang allocator's room): free blocks on ACTIVE pages only, never a
    # reserve or free page's.
    space = make_space(SMALL, reserve=(0, 1))

    def by_pages() -> int:
        return sum(p.capacity - p.used for p in space.page_occupancy() if p.state == "active")

    ids = space.alloc(6).tolist()  # page 0 full, page 1 half
    assert space.stats().room_blocks == by_pages() == 2
    space.free([ids[0], ids[5]])  # one from each page, in one batch
    assert space.stats().room_blocks == by_pages() == 4
    space.free(ids[4:5])  # page 1 empties: no longer active, so no longer room
    assert space.page_occupancy([1])[0].state != "active"
    assert space.stats().room_blocks == by_pages() == 1
    space.alloc(1)
    assert space.stats().room_blocks == by_pages() == 0


@pytest.mark.parametrize(("geometry", "null_block"), [(SMALL, True), (STRADDLE, False), (STRADDLE, True)])
def test_room_blocks_is_the_page_walk_with_a_null_block_and_straddling_blocks(make_space, geometry: Geometry,
                                                                               null_block: bool) -> None:
    # The null block is held (never room); a straddling block belongs to no page (never room).
    space = make_space(geometry, null_block=null_block, reserve=(0, 1))
    rng = random.Random(7)
    held: list[int] = []
    for _ in range(200):
        if held and (rng.random() < 0.5 or space.available() == 0):
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            space.free(held[:k])
            del held[:k]
        else:
            held += space.alloc(rng.randint(1, space.available())).tolist()
        walk = sum(p.capacity - p.used for p in space.page_occupancy() if p.state == "active")
        assert space.stats().room_blocks == walk


def test_misuse_that_involves_no_block_ids_is_a_value_error_not_invalid_blocks(make_space) -> None:
    # Bug: every native Invalid became InvalidBlocks, so set_reserve(3, 1)
    # raised "invalid blocks" though no block id was involved.
    space = make_space()
    with pytest.raises(ValueError, match="reserve needs 0 <= min <= max") as err:
        space.set_reserve(3, 1)
    assert not isinstance(err.value, InvalidBlocks)
    with pytest.raises(InvalidBlocks):  # bad ids still are
        space.free([10**6])
