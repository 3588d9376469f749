"""kvpool.adapters.sglang: SGLang's token-to-KV allocator contract over a kvpool space.

SGLang itself is not installed (CUDA-only kernels); these are contract tests
of its allocator's behaviour (sglang/srt/mem_cache/allocator.py and the
allocator/ package): padding page 0, whole-page allocs, None on a miss, free
groups, backup/restore, and the extend/decode slot layout compared with a
pure-Python reference of SGLang's algorithm; plus what this adapter adds on
top: freed pages stay in the space until the second flush(), bounded waits
for pool budget, no host copy of last_loc.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvpool import Geometry, InvalidBlocks, KVSpace, Pool, PoolClosed
from kvpool.adapters.sglang import AllocatorState, KVPoolTokenAllocator

from .conftest import KiB, snapshot

NUM_PAGES = 63  # + the padding page = 64 blocks of 4 KiB: 16 kvpool pages of 16 KiB
MakeAlloc = Callable[..., KVPoolTokenAllocator]


@pytest.fixture
def make_alloc() -> Iterator[MakeAlloc]:
    made: list[KVPoolTokenAllocator] = []

    def make(page_size: int, **kw: Any) -> KVPoolTokenAllocator:
        if "space" not in kw and "geometry" not in kw:
            kw.setdefault("token_bytes", 4 * KiB // page_size)  # one SGLang page = one 4 KiB block
            kw.setdefault("page_bytes", 16 * KiB)
            kw.setdefault("reserve", (0, 0))
            kw.setdefault("reserve_thread", False)
        a = KVPoolTokenAllocator(NUM_PAGES * page_size, page_size, dtype=torch.float16, **kw)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


@pytest.fixture
def pool_name() -> Iterator[str]:
    name = f"test-sglang-{uuid.uuid4().hex[:10]}"
    yield name
    Pool.remove(name)


page_sizes = pytest.mark.parametrize("ps", [1, 4])


def i64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def state_of(a: KVPoolTokenAllocator) -> tuple[object, ...]:
    """Everything a refused call must leave unchanged: the space, every page's
    state (held / pending / marked by a live backup), the pending order and age,
    the backup and the open free group."""
    group = None if a.free_group is None else [g.tolist() for g in a.free_group]
    return (snapshot(a.space), a.held_pages().tolist(), a.available_size(), a._state.tobytes(),
            a._pending.tolist(), a._aged, a._backup_live, a._generation, group)


def pages_of(tokens: torch.Tensor, ps: int) -> set[int]:
    return set((tokens // ps).tolist())


def used(a: KVPoolTokenAllocator) -> int:
    """Blocks held in the space (the padding block is not counted)."""
    return int(a.space.stats().used_blocks)


# -- alloc -------------------------------------------------------------------------
@page_sizes
def test_alloc_hands_out_unique_int64_whole_pages_and_never_the_padding_page(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    assert a.available_size() == a.size == NUM_PAGES * ps
    got: list[torch.Tensor] = []
    rng = random.Random(ps)
    while a.available_size():
        t = a.alloc(min(rng.randint(1, 5) * ps, a.available_size()))
        assert t is not None
        assert t.dtype == torch.int64 and t.device == torch.device("cpu") and t.dim() == 1
        rows = t.view(-1, ps)
        assert torch.equal(rows, rows[:, :1] + torch.arange(ps))  # whole pages, in order
        assert (rows[:, 0] % ps == 0).all()
        got.append(t)
    every = torch.cat(got)
    assert len(set(every.tolist())) == every.numel() == NUM_PAGES * ps  # all of it, each once
    assert int(every.min()) >= ps and int(every.max()) < (NUM_PAGES + 1) * ps
    assert sorted(pages_of(every, ps)) == a.held_pages().tolist() == list(range(1, NUM_PAGES + 1))
    assert a.alloc(ps) is None


@page_sizes
@pytest.mark.timeout(60)
def test_alloc_beyond_capacity_returns_none_at_once_and_changes_nothing(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    # A miss SGLang's own allocator has too must not wait for the pool: with an
    # hour's wait allowed, a wait would end in this test's timeout.
    a.shortage_wait_s = 3600
    assert a.alloc(10 * ps) is not None
    before = state_of(a)
    assert a.alloc(a.available_size() + ps) is None
    assert state_of(a) == before
    assert a.alloc(a.available_size()) is not None and a.available_size() == 0
    before = state_of(a)
    assert a.alloc(ps) is None
    assert state_of(a) == before


def test_paged_alloc_refuses_a_partial_page_and_zero_is_empty(make_alloc: MakeAlloc) -> None:
    a = make_alloc(4)
    before = state_of(a)
    with pytest.raises(ValueError, match="multiple of page_size"):
        a.alloc(6)
    with pytest.raises(ValueError, match="non-negative"):
        a.alloc(-4)
    empty = a.alloc(0)
    assert empty is not None and empty.numel() == 0 and empty.dtype == torch.int64
    assert state_of(a) == before


# -- free --------------------------------------------------------------------------
@page_sizes
def test_freed_pages_are_reused(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    full = a.alloc(NUM_PAGES * ps)
    assert full is not None and a.alloc(ps) is None
    gone = full[5 * ps : 12 * ps]
    a.free(gone)
    assert a.available_size() == 7 * ps
    again = a.alloc(7 * ps)
    assert again is not None and set(again.tolist()) == set(gone.tolist())
    a.free(torch.empty(0, dtype=torch.int64))  # empty is a no-op
    assert a.available_size() == 0


@page_sizes
def test_a_bad_free_raises_and_frees_nothing(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    held = a.alloc(8 * ps)
    assert held is not None
    a.free(held[:ps])
    before = state_of(a)
    bad_batches = {
        "double free": held[:ps],
        "double free among good ones": torch.cat((held[ps : 3 * ps], held[:ps])),
        "padding page": torch.tensor([0]),
        "negative": torch.tensor([-1]),
        "beyond the pool": torch.tensor([(NUM_PAGES + 1) * ps]),
        "never allocated": torch.tensor([int(held.max()) + ps]),
        "floats": torch.tensor([float(ps)]),
    }
    for why, batch in bad_batches.items():
        with pytest.raises(InvalidBlocks):
            a.free(batch)
        assert state_of(a) == before, why


def test_a_token_index_repeated_in_one_batch_is_a_double_free_at_page_size_one(make_alloc: MakeAlloc) -> None:
    a = make_alloc(1)
    held = a.alloc(4)
    assert held is not None
    before = state_of(a)
    with pytest.raises(InvalidBlocks, match="twice"):
        a.free(torch.cat((held, held[:1])))
    assert state_of(a) == before


def test_paged_free_releases_the_unique_pages_of_its_tokens(make_alloc: MakeAlloc) -> None:
    a = make_alloc(4)
    held = a.alloc(12)
    assert held is not None
    # two tokens of the first page (one twice) and one of the third: those two pages, whole
    a.free(torch.tensor([int(held[1]), int(held[3]), int(held[3]), int(held[8])]))
    assert a.held_pages().tolist() == [int(held[4]) // 4]
    assert a.available_size() == (NUM_PAGES - 1) * 4


@page_sizes
def test_a_free_group_applies_its_frees_only_at_the_end(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    x, y = a.alloc(3 * ps), a.alloc(2 * ps)
    assert x is not None and y is not None
    a.free_group_begin()
    with pytest.raises(RuntimeError, match="nested"):
        a.free_group_begin()
    a.free(x)
    a.free(y)
    assert a.available_size() == (NUM_PAGES - 5) * ps and len(a.held_pages()) == 5
    a.free_group_end()
    assert a.available_size() == NUM_PAGES * ps and len(a.held_pages()) == 0
    a.free_group_end()  # no group: nothing to do


def test_free_group_end_frees_a_page_two_calls_of_the_group_touched_once(make_alloc: MakeAlloc) -> None:
    # Regression: SGLang's free_group_end is free(torch.cat(group)) and its paged free
    # dedups pages, so a request's KV freed in two slices split mid-page is legal; this
    # raised InvalidBlocks after clearing the group, losing every free of the group.
    a = make_alloc(4)
    row = a.alloc(12)
    assert row is not None
    a.free_group_begin()
    a.free(row[:6])  # pages 0 and 1 of the row
    a.free(row[6:])  # page 1 again, and 2
    a.free_group_end()
    assert a.held_pages().numel() == 0 and a.free_group is None
    assert a.pending_pages().tolist() == sorted(pages_of(row, 4))


@page_sizes
def test_a_bad_free_in_a_group_raises_and_keeps_the_group(make_alloc: MakeAlloc, ps: int) -> None:
    # Regression: the group was cleared before the batch was checked, so one bad id
    # lost every good free of the group.
    a = make_alloc(ps)
    x = a.alloc(4 * ps)
    assert x is not None
    a.free(x[3 * ps :])
    a.free_group_begin()
    a.free(x[:ps])
    a.free(x[ps : 3 * ps])
    a.free(x[3 * ps :])  # freed already: only the batch at the end can tell
    before = state_of(a)
    with pytest.raises(InvalidBlocks, match="not allocated"):
        a.free_group_end()
    assert state_of(a) == before  # nothing freed, the group still open with its frees
    assert a.free_group is not None
    a.free_group.pop()
    a.free_group_end()
    assert a.held_pages().numel() == 0 and a.free_group is None


def test_a_token_freed_by_two_calls_of_a_group_is_a_double_free_at_page_size_one(make_alloc: MakeAlloc) -> None:
    a = make_alloc(1)  # SGLang's token allocator would put the slot in its free list twice
    x = a.alloc(3)
    assert x is not None
    a.free_group_begin()
    a.free(x[:2])
    a.free(x[1:])
    before = state_of(a)
    with pytest.raises(InvalidBlocks, match="two calls"):
        a.free_group_end()
    assert state_of(a) == before


@page_sizes
def test_free_full_free_segment_and_free_segments_are_frees(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    x = a.alloc(6 * ps)
    assert x is not None
    a.free_full(x[:ps])
    a.free_segment(x[ps : 2 * ps], start_pos=ps)
    if ps > 1:
        with pytest.raises(ValueError, match="aligned"):
            a.free_segment(x[2 * ps : 3 * ps], start_pos=1)
        with pytest.raises(ValueError, match="aligned"):
            a.free_segments([(x[2 * ps : 3 * ps], 2 * ps), (x[3 * ps :], 1)])
    before = state_of(a)
    with pytest.raises(InvalidBlocks):  # all or nothing: the first segment is not freed either
        a.free_segments([(x[2 * ps : 3 * ps], 2 * ps), (x[:ps], 0)])
    assert state_of(a) == before
    a.free_segments([(x[2 * ps : 4 * ps], 2 * ps), (x[4 * ps :], 4 * ps)])
    assert a.held_pages().numel() == 0 and a.available_size() == NUM_PAGES * ps


@page_sizes
def test_get_all_free_pages_is_every_page_sglang_does_not_hold(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    x = a.alloc(5 * ps)
    assert x is not None
    a.free(x[:ps])  # pending pages are free to SGLang
    free = a.get_all_free_pages()
    assert free.dtype == torch.int64
    assert free.tolist() == sorted(set(range(1, NUM_PAGES + 1)) - pages_of(x[ps:], ps))


# -- pages stay in the space until the second flush ------------------------------------
@page_sizes
def test_overlap_free_keeps_pages_in_the_space_until_the_second_flush(make_alloc: MakeAlloc, ps: int) -> None:
    # Regression: SGLang's overlap scheduler frees a finished request's KV while the next
    # batch, which may still hold the request, runs; free() gave the pages to the space at
    # once, so they could be released under the kernel.
    a = make_alloc(ps)
    x = a.alloc(20 * ps)
    assert x is not None
    k = a.token_view(0, 0, (a.space.geometry.block_bytes // ps // 2,))
    blocks = used(a)
    a.free(x)
    assert used(a) == blocks and a.available_size() == NUM_PAGES * ps  # logically free at once
    committed = a.space.allocated_bytes()
    k[x] = 1.0  # the running batch still writes its KV: the memory must be there
    assert a.space.allocated_bytes() == committed
    assert a.flush() == 0 and used(a) == blocks  # the step that freed them ends
    assert a.flush() == 20 and used(a) == 0  # one step later: back to the space
    assert a.pending_pages().numel() == 0 and a.available_size() == NUM_PAGES * ps


@page_sizes
def test_an_alloc_reuses_pending_pages_oldest_first(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    x = a.alloc(6 * ps)
    assert x is not None
    a.free(x[: 2 * ps])
    a.flush()  # x[:2] aged
    a.free(x[2 * ps : 4 * ps])
    y = a.alloc(3 * ps)
    assert y is not None and pages_of(y, ps) == pages_of(x[: 3 * ps], ps)
    assert a.flush() == 0  # the aged pages were taken; x[3] is young
    assert a.flush() == 1 and a.pending_pages().numel() == 0


# -- backup / restore ----------------------------------------------------------------
@page_sizes
def test_restore_undoes_allocs_and_frees_since_the_backup(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    kept = a.alloc(6 * ps)
    assert kept is not None
    held = a.held_pages().tolist()
    state = a.backup_state()
    draft = a.alloc(9 * ps)
    assert draft is not None
    a.free(kept[: 2 * ps])  # held at the backup: must come back
    a.free(draft[: 3 * ps])  # allocated after it: stays free
    more = a.alloc(4 * ps)
    assert more is not None
    a.restore_state(state)
    assert a.held_pages().tolist() == held and a.available_size() == (NUM_PAGES - 6) * ps


@page_sizes
def test_a_restored_backup_cannot_be_restored_again(make_alloc: MakeAlloc, ps: int) -> None:
    # Regression: a restored backup stayed live, so frees of pages held at backup time
    # were deferred until the next backup_state(): forever on a server gone idle.
    a = make_alloc(ps)
    x = a.alloc(4 * ps)
    assert x is not None
    state = a.backup_state()
    assert a.alloc(2 * ps) is not None
    a.restore_state(state)
    before = state_of(a)
    with pytest.raises(ValueError, match="restored already"):
        a.restore_state(state)
    assert state_of(a) == before


@page_sizes
def test_an_idle_server_gives_back_pages_freed_after_an_eagle_step(make_alloc: MakeAlloc, ps: int) -> None:
    # Regression (as above): the pages of a request that finishes after EAGLE's
    # backup/restore must reach the space without another backup_state().
    a = make_alloc(ps)
    x = a.alloc(10 * ps)
    assert x is not None
    state = a.backup_state()
    assert a.alloc(3 * ps) is not None  # draft slots
    a.restore_state(state)
    a.free(x)  # the request finishes; the server then goes idle
    a.flush()
    a.flush()
    assert used(a) == 0 and a.pending_pages().numel() == 0 and a.available_size() == NUM_PAGES * ps


@page_sizes
def test_restore_keeps_draft_pages_in_the_space_while_eagle_writes_them(make_alloc: MakeAlloc, ps: int) -> None:
    # Regression: EAGLE's _draft_preprocess_decode calls restore_state() before the draft
    # forward writes draft KV into batch.out_cache_loc; restore gave those pages to the
    # space, so the writes landed in released memory (behind the ledger on the CPU, a
    # fault on CUDA).
    a = make_alloc(ps)
    assert a.alloc(3 * ps) is not None
    blocks = used(a)
    state = a.backup_state()
    draft = a.alloc(20 * ps)
    assert draft is not None
    a.restore_state(state)
    assert used(a) == blocks + 20 and a.available_size() == (NUM_PAGES - 3) * ps
    assert a.pending_pages().tolist() == sorted(pages_of(draft, ps))
    k = a.token_view(0, 1, (a.space.geometry.block_bytes // ps // 2,))
    committed = a.space.allocated_bytes()
    k[draft] = 2.0  # the draft forward runs after the restore
    assert a.space.allocated_bytes() == committed
    a.flush()
    assert a.flush() == 20 and used(a) == blocks


@page_sizes
def test_a_page_freed_after_the_backup_is_held_again_by_restore(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    x = a.alloc(2 * ps)
    assert x is not None
    page = int(x[0]) // ps
    state = a.backup_state()
    blocks = used(a)
    a.free(x[:ps])
    assert page not in a.held_pages().tolist()
    assert a.available_size() == (NUM_PAGES - 1) * ps
    assert used(a) == blocks  # kept in the space: it may come back
    a.restore_state(state)
    assert page in a.held_pages().tolist() and a.available_size() == (NUM_PAGES - 2) * ps
    a.free(x[:ps])  # held again, so freeable again
    assert page not in a.held_pages().tolist()


@page_sizes
def test_freeing_a_kept_page_again_is_a_double_free(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    x = a.alloc(3 * ps)
    assert x is not None
    a.backup_state()
    a.free(x[:ps])  # kept: still held in the space, so only the adapter can tell
    before = state_of(a)
    with pytest.raises(InvalidBlocks, match="not allocated"):
        a.free(x[:ps])
    with pytest.raises(InvalidBlocks):
        a.free(torch.cat((x[ps : 2 * ps], x[:ps])))
    assert state_of(a) == before and a.available_size() == (NUM_PAGES - 2) * ps


@page_sizes
def test_an_alloc_that_needs_a_kept_page_takes_it_and_restore_still_holds(
    make_alloc: MakeAlloc, ps: int
) -> None:
    a = make_alloc(ps)
    full = a.alloc(NUM_PAGES * ps)
    assert full is not None
    held = a.held_pages().tolist()
    state = a.backup_state()
    a.free(full[:ps])
    again = a.alloc(ps)  # the only free page is the kept one
    assert again is not None and pages_of(again, ps) == pages_of(full[:ps], ps)
    assert a.alloc(ps) is None
    a.free(again)
    a.restore_state(state)
    assert a.held_pages().tolist() == held and a.pending_pages().numel() == 0


@page_sizes
def test_a_page_pending_at_the_backup_and_taken_after_it_is_pending_again_after_restore(
    make_alloc: MakeAlloc, ps: int
) -> None:
    a = make_alloc(ps)
    x = a.alloc(4 * ps)
    assert x is not None
    a.free(x[:ps])  # pending: free to SGLang at backup time
    state = a.backup_state()
    y = a.alloc(ps)
    assert y is not None and pages_of(y, ps) == pages_of(x[:ps], ps)
    a.restore_state(state)
    assert a.held_pages().tolist() == sorted(pages_of(x[ps:], ps))
    assert a.pending_pages().tolist() == sorted(pages_of(x[:ps], ps))


def test_a_new_backup_flush_or_clear_ends_the_live_one(make_alloc: MakeAlloc) -> None:
    a, other = make_alloc(4), make_alloc(4)
    x = a.alloc(8)
    assert x is not None
    old = a.backup_state()
    a.free(x[:4])  # kept under the old backup
    draft = a.alloc(4)
    assert draft is not None
    new = a.backup_state()  # the old one ends: the kept page is plain pending, the draft held
    assert a.held_pages().tolist() == sorted(pages_of(torch.cat((x[4:], draft)), 4))
    before = state_of(a)
    with pytest.raises(ValueError, match="no longer restorable"):
        a.restore_state(old)
    with pytest.raises(ValueError, match="not a backup of this allocator"):
        a.restore_state(other.backup_state())
    assert state_of(a) == before
    a.free(draft)
    a.restore_state(new)
    assert a.held_pages().tolist() == sorted(pages_of(torch.cat((x[4:], draft)), 4))
    for end in (a.flush, a.clear):
        state = a.backup_state()
        end()
        with pytest.raises(ValueError, match="no longer restorable"):
            a.restore_state(state)


# -- memory follows use -----------------------------------------------------------------
@page_sizes
def test_committed_memory_follows_the_pages_sglang_holds(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    s = a.space
    base = s.stats().committed_bytes
    assert base == s.geometry.page_commit_bytes  # only the padding page's kvpool page
    held = a.alloc(40 * ps)
    assert held is not None
    grown = s.stats().committed_bytes
    assert grown > base and s.allocated_bytes() >= grown
    a.free(held[: 20 * ps])
    a.flush()
    a.flush()
    s.trim()
    assert base < s.stats().committed_bytes < grown
    a.free(held[20 * ps :])
    a.flush()
    a.flush()
    s.trim()
    assert s.stats().committed_bytes == base and s.allocated_bytes() == base


def test_token_view_writes_land_in_the_held_pages(make_alloc: MakeAlloc) -> None:
    a = make_alloc(4)
    held = a.alloc(8)
    assert held is not None
    g = a.space.geometry
    k = a.token_view(0, 0, (g.block_bytes // 4 // 2,))  # float16 rows of one token
    assert k.shape[0] == (NUM_PAGES + 1) * 4
    committed = a.space.allocated_bytes()
    k[held] = 3.0
    # read back through the space's block view, only on committed kvpool pages
    # (touching an uncommitted page of a memfd mapping would allocate it)
    blocks = a.space.view(0, 0, torch.float16, (4, k.shape[1]))
    kv_pages = {g.page_of(int(b)) for b in held // 4}
    on_them = [b for p in kv_pages if p is not None for b in g.block_range(p)]
    written = {(b, t) for b in on_them for t in range(4) if bool((blocks[b, t] != 0).any())}
    assert written == {(int(x) // 4, int(x) % 4) for x in held}
    assert (blocks[held // 4, held % 4] == 3.0).all()
    assert a.space.allocated_bytes() == committed  # held pages were committed already


# -- shortages --------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_an_alloc_waits_while_another_engine_gives_the_pool_budget_back(
    make_alloc: MakeAlloc, pool_name: str
) -> None:
    # Regression: SGLang admits work by available_size() and treats None from an alloc as
    # a fatal out-of-memory; another engine taking the pool's budget in between killed it.
    Pool(pool_name, capacity=6 * 32 * KiB)  # 6 kvpool pages of 2 x 16 KiB
    a, b = make_alloc(4, pool=pool_name), make_alloc(4, pool=pool_name)  # one page each: padding
    taken = a.alloc(a.available_size())
    assert taken is not None and b.available_size() == 3 * 4  # the rest of b's padding page
    b.shortage_wait_s = 0
    before = state_of(b)
    assert b.alloc(4 * 4) is None and state_of(b) == before  # no wait: None at once

    freed = threading.Event()

    def b_waiting() -> bool:
        return any(ten.waiting == 1 for ten in Pool(pool_name).tenants() if ten.name == b.space.name)

    def other_engine() -> None:
        while not b_waiting():  # b waits, and tells the pool so; then the budget comes back
            time.sleep(0.005)
        freed.set()
        a.free(taken)
        a.flush()
        a.flush()

    b.shortage_wait_s = 3600  # bounded by this test's timeout, not by a clock assertion
    t = threading.Thread(target=other_engine)
    t.start()
    try:
        got = b.alloc(4 * 4)
    finally:
        t.join()
    assert got is not None and freed.is_set()  # granted only once the other engine gave back
    assert all(ten.waiting == 0 for ten in Pool(pool_name).tenants())  # no longer reported waiting


@pytest.mark.timeout(60)
def test_an_alloc_sglang_itself_could_not_serve_does_not_wait_for_the_pool(
    make_alloc: MakeAlloc, pool_name: str
) -> None:
    Pool(pool_name, capacity=3 * 32 * KiB)
    a = make_alloc(4, pool=pool_name)
    a.shortage_wait_s = 3600  # a wait would end in this test's timeout
    assert a.alloc(a.available_size()) is not None
    assert a.alloc(NUM_PAGES * 4) is None  # more than the pages SGLang does not hold
    assert all(ten.waiting == 0 for ten in Pool(pool_name).tenants())


# -- extend / decode against SGLang's reference algorithm -----------------------------------
def ref_alloc_extend(pre: list[int], seq: list[int], last: list[int], pages: list[int], ps: int) -> list[int]:
    """SGLang's three-part layout: fill the prefix's partial page, then whole new
    pages, then a partial new page; new pages are taken in request order."""
    out: list[int] = []
    nxt = 0
    for p, s, loc in zip(pre, seq, last):
        cpre = -(-p // ps)
        num1 = min(s, cpre * ps) - p
        out += [loc + 1 + j for j in range(num1)]
        if p + num1 == s:
            continue
        for _ in range(s // ps - cpre):
            out += [pages[nxt] * ps + j for j in range(ps)]
            nxt += 1
        if s % ps:
            out += [pages[nxt] * ps + j for j in range(s % ps)]
            nxt += 1
    assert nxt == len(pages)
    return out


def ref_alloc_decode(seq: list[int], last: list[int], pages: list[int], ps: int) -> list[int]:
    out, nxt = [], 0
    for s, loc in zip(seq, last):
        if -(-s // ps) == -(-(s - 1) // ps):
            out.append(loc + 1)
        else:
            out.append(pages[nxt] * ps)
            nxt += 1
    assert nxt == len(pages)
    return out


def check_against_reference(got: torch.Tensor, ref: Callable[[list[int]], list[int]], n_pages: int,
                            new_pages: set[int], ps: int) -> None:
    """``got`` must be the reference's output for some order of the new pages:
    recover that order from where the reference puts each new page, then compare all."""
    probe = [10**9 + j for j in range(n_pages)]
    symbolic = ref(probe)
    assert len(symbolic) == got.numel()
    order: dict[int, int] = {}
    for sym, real in zip(symbolic, got.tolist()):
        if sym // ps >= 10**9:
            order.setdefault(sym // ps - 10**9, real // ps)
    pages = [order[j] for j in range(n_pages)]
    assert got.tolist() == ref(pages)
    assert len(set(pages)) == n_pages and set(pages) == new_pages


def record_rows(rows: list[list[int]], picked: list[int], pre: list[int], seq: list[int], got: torch.Tensor) -> None:
    starts = np.cumsum([0] + [s - p for p, s in zip(pre, seq)])
    for j, i in enumerate(picked):
        rows[i] += got[starts[j] : starts[j + 1]].tolist()
    rows += [got[starts[j] : starts[j + 1]].tolist() for j in range(len(picked), len(pre))]


def try_extend(a: KVPoolTokenAllocator, rows: list[list[int]], picked: list[int], fresh: int, grow: Callable[[], int],
               ps: int) -> tuple[list[int], list[int], torch.Tensor] | None:
    """alloc_extend for rows ``picked`` plus ``fresh`` new requests; checked against the reference."""
    pre = [len(rows[i]) for i in picked] + [0] * fresh
    seq = [p + grow() for p in pre]
    last = [rows[i][-1] if rows[i] else -1 for i in picked] + [-1] * fresh
    need = sum(-(-s // ps) - -(-p // ps) for p, s in zip(pre, seq))
    held_before, before = set(a.held_pages().tolist()), state_of(a)
    got = a.alloc_extend(i64(pre), i64(pre), i64(seq), i64(seq), i64(last), sum(seq) - sum(pre))
    if got is None:
        assert need * ps > a.available_size() and state_of(a) == before
        return None
    assert got.dtype == torch.int64
    check_against_reference(got, lambda pg: ref_alloc_extend(pre, seq, last, pg, ps), need,
                            set(a.held_pages().tolist()) - held_before, ps)
    return pre, seq, got


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_random_steps_match_sglangs_reference_through_backups_groups_and_flushes(ps: int, seed: int) -> None:
    """Extends and decodes checked against SGLang's layout, mixed with frees (some in
    groups, split mid-page), EAGLE-style backup/draft/restore steps (some freeing a
    request inside the backup, some abandoned) and flushes; after every step the rows
    SGLang would hold are exactly the held pages, and held + pending is what the space holds."""
    rng = random.Random(seed)
    num_pages = 48
    with KVPoolTokenAllocator(num_pages * ps, ps, dtype=torch.bfloat16, token_bytes=4 * KiB // ps,
                              page_bytes=16 * KiB, pool=None, reserve=(0, 0), reserve_thread=False,
                              debug=True) as a:
        rows: list[list[int]] = []  # each live request's token slots, as SGLang's req_to_token
        for _ in range(120):
            step = rng.random() if a.available_size() > a.size // 4 else rng.random() * 1.2
            if step < 0.3:
                picked = rng.sample(range(len(rows)), k=min(len(rows), rng.randint(0, 3)))
                done = try_extend(a, rows, picked, rng.randint(0 if picked else 1, 2),
                                  lambda: rng.randint(0, 2 * ps + 1), ps)
                if done is not None:
                    record_rows(rows, picked, *done)
            elif step < 0.5 and rows:
                picked = [i for i in range(len(rows)) if rows[i] and rng.random() < 0.6]
                seq = [len(rows[i]) + 1 for i in picked]
                last = [rows[i][-1] for i in picked]
                need = sum(1 for s in seq if (s - 1) % ps == 0)
                held_before, before = set(a.held_pages().tolist()), state_of(a)
                got = a.alloc_decode(i64(seq), i64(seq), i64(last))
                if got is None:
                    assert need * ps > a.available_size() and state_of(a) == before
                    continue
                check_against_reference(got, lambda pg: ref_alloc_decode(seq, last, pg, ps), need,
                                        set(a.held_pages().tolist()) - held_before, ps)
                for j, i in enumerate(picked):
                    rows[i].append(int(got[j]))
            elif step < 0.7 and rows:
                grouped = rng.random() < 0.5
                if grouped:
                    a.free_group_begin()
                for _ in range(rng.randint(1, 2) if grouped else 1):
                    if rows:
                        row = rows.pop(rng.randrange(len(rows)))
                        cut = rng.randint(0, len(row)) if grouped else len(row)
                        a.free(i64(row[:cut]))  # two slices of one row may share a page
                        a.free(i64(row[cut:]))
                if grouped:
                    a.free_group_end()
            elif step < 0.9 and rows:
                held = a.held_pages().tolist()
                state = a.backup_state()
                gone = rows.pop(rng.randrange(len(rows))) if rng.random() < 0.4 else None
                if gone is not None:
                    a.free(i64(gone))  # held at the backup: restore holds it again
                if gone is not None and rng.random() < 0.3:
                    continue  # abandoned: the next backup or flush ends it, the request stays freed
                picked = rng.sample(range(len(rows)), k=min(len(rows), rng.randint(1, 3)))
                draft = try_extend(a, rows, [i for i in picked if rows[i]], 0, lambda: rng.randint(1, 3), ps)
                a.restore_state(state)
                if gone is not None:
                    rows.append(gone)
                assert a.held_pages().tolist() == held
                if draft is not None:
                    new_pages = pages_of(draft[2], ps) - set(held)
                    assert new_pages <= set(a.pending_pages().tolist())
            else:
                a.flush()
            every = [x for r in rows for x in r]
            assert len(set(every)) == len(every) and min(every, default=ps) >= ps  # no slot twice, none padding
            held_now, pending = set(a.held_pages().tolist()), set(a.pending_pages().tolist())
            assert {x // ps for x in every} == held_now and not held_now & pending
            assert a.space.stats().used_blocks == len(held_now) + len(pending)
            assert a.available_size() == (num_pages - len(held_now)) * ps
        for r in rows:
            a.free(i64(r))
        a.flush()
        a.flush()
        assert a.space.stats().used_blocks == 0


def test_extend_fills_the_prefix_page_then_new_pages(make_alloc: MakeAlloc) -> None:
    a = make_alloc(4)
    first = a.alloc(4)
    assert first is not None
    p = int(first[0]) // 4
    # request: 2 tokens already on page p (slots 4p, 4p+1), extend to 11 tokens
    got = a.alloc_extend([2], [2], [11], [11], [4 * p + 1], 9)
    assert got is not None
    assert got[:2].tolist() == [4 * p + 2, 4 * p + 3]
    new = got[2:].view(-1).tolist()
    assert new[:4] == list(range(new[0], new[0] + 4)) and new[0] % 4 == 0
    assert new[4:] == list(range(new[4], new[4] + 3)) and new[4] % 4 == 0
    assert len(a.held_pages()) == 3


def test_extend_and_decode_return_none_when_the_new_pages_are_missing(make_alloc: MakeAlloc) -> None:
    a = make_alloc(4)
    held = a.alloc((NUM_PAGES - 1) * 4)
    assert held is not None
    before = state_of(a)
    assert a.alloc_extend([0, 0], [0, 0], [3, 2], [3, 2], [-1, -1], 5) is None  # two pages, one free
    assert a.alloc_decode([5, 9], [5, 9], [int(held[3]), int(held[7])]) is None
    assert state_of(a) == before
    one = a.alloc_decode([5], [5], [int(held[3])])
    assert one is not None and int(one[0]) % 4 == 0 and a.available_size() == 0


@pytest.mark.parametrize("debug", ["flag", "SGLANG_DEBUG_MEMORY_POOL"])
def test_extend_and_decode_reject_inconsistent_arguments(make_alloc: MakeAlloc, debug: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if debug == "flag":
        a = make_alloc(4, debug=True)
    else:
        monkeypatch.setenv(debug, "1")  # SGLang's own switch for these checks
        a = make_alloc(4)
    held = a.alloc(4)
    assert held is not None
    before = state_of(a)
    with pytest.raises(ValueError, match="extend_num_tokens"):
        a.alloc_extend([0], [0], [3], [3], [-1], 4)
    with pytest.raises(ValueError, match="prefix_lens <= seq_lens"):
        a.alloc_extend([3], [3], [2], [2], [int(held[2])], -1)
    with pytest.raises(ValueError, match="last_loc"):  # offset does not match the prefix length
        a.alloc_extend([2], [2], [3], [3], [int(held[2])], 1)
    with pytest.raises(ValueError, match="last_loc"):  # a page nobody holds
        a.alloc_decode([2], [2], [int(held[0]) + 4])
    with pytest.raises(ValueError, match="last_loc must hold integers"):
        a.alloc_decode([2], [2], torch.tensor([4.0]))
    with pytest.raises(ValueError, match="num_new_pages"):
        a.alloc_extend([0], [0], [5], [5], [-1], 5, num_new_pages=1)
    with pytest.raises(ValueError, match="batch sizes differ"):
        a.alloc_decode([2, 3], [2, 3], [int(held[0])])
    assert state_of(a) == before


def test_extend_and_decode_leave_last_loc_on_its_device(make_space: Callable[..., KVSpace],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: alloc_decode copied last_loc to the host on every decode step (a
    # GPU->CPU sync) only to validate it. A meta tensor has no data to copy: any host
    # copy raises, while arithmetic on the device works.
    monkeypatch.delenv("SGLANG_DEBUG_MEMORY_POOL", raising=False)  # the default: no debug checks
    space = make_space(Geometry(1, 2, 4 * KiB, NUM_PAGES + 1, page_bytes=16 * KiB), null_block=True)
    a = KVPoolTokenAllocator(NUM_PAGES * 4, 4, dtype=torch.float16, device="meta", space=space)
    assert a.alloc(8) is not None
    meta = torch.empty(3, dtype=torch.int64, device="meta")
    got = a.alloc_decode(meta, i64([3, 5, 9]), meta)  # one continues a page, two need new ones
    assert got is not None and got.device.type == "meta" and got.shape == (3,)
    got = a.alloc_extend(meta, i64([2, 4, 0]), meta, i64([11, 9, 3]), meta, 17)
    assert got is not None and got.device.type == "meta" and got.shape == (17,)
    assert len(a.held_pages()) == 2 + 2 + 5
    a.close()


def test_without_debug_last_loc_is_used_as_given(make_alloc: MakeAlloc) -> None:
    a = make_alloc(4, debug=False)
    held = a.alloc(4)
    assert held is not None
    got = a.alloc_decode([2], [2], [int(held[0]) + 4])  # not held: only debug mode looks
    assert got is not None and got.tolist() == [int(held[0]) + 5]


# -- whole allocator ---------------------------------------------------------------------
@page_sizes
def test_clear_returns_everything(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    x = a.alloc(30 * ps)
    assert x is not None
    a.free(x[2 * ps : 4 * ps])  # pending
    state = a.backup_state()
    a.free(x[:ps])  # kept
    a.free_group_begin()
    a.free(x[ps : 2 * ps])
    a.clear()
    assert a.available_size() == NUM_PAGES * ps and a.held_pages().numel() == 0
    assert used(a) == 0 and a.pending_pages().numel() == 0  # pending, kept and grouped pages went back too
    assert a.alloc(NUM_PAGES * ps) is not None
    with pytest.raises(ValueError, match="no longer restorable"):
        a.restore_state(state)
    a.free_group_end()  # the group was dropped by clear


def test_sglang_pass_throughs_reach_the_kv_cache(make_alloc: MakeAlloc) -> None:
    calls: list[tuple[object, ...]] = []

    class KVCache:
        def get_cpu_copy(self, indices: Any, mamba_indices: Any = None) -> str:
            calls.append(("get", indices, mamba_indices))
            return "cpu copy"

        def load_cpu_copy(self, kv_cache_cpu: Any, indices: Any, mamba_indices: Any = None) -> None:
            calls.append(("load", kv_cache_cpu, indices, mamba_indices))

    cache = KVCache()
    a = make_alloc(4, kvcache=cache)
    assert (a.size, a.size_full, a.page_size, a.num_pages) == (NUM_PAGES * 4, NUM_PAGES * 4, 4, NUM_PAGES)
    assert a.dtype == torch.float16 and a.device == "cpu" and a.get_kvcache() is cache
    assert a.get_cpu_copy("idx", mamba_indices="m") == "cpu copy"
    a.load_cpu_copy("copy", "idx")
    assert calls == [("get", "idx", "m"), ("load", "copy", "idx", None)]
    assert a.is_not_in_free_group
    a.free_group_begin()
    assert not a.is_not_in_free_group
    a.free_group_end()
    assert isinstance(a.backup_state(), AllocatorState)
    x = a.alloc(12)
    assert x is not None
    a.free(x[8:])
    assert "2/63 pages of 4 tokens held, 1 pending" in a.debug_print()


def test_an_existing_space_is_borrowed_not_closed(make_space: Callable[..., KVSpace]) -> None:
    g = Geometry(1, 2, 4 * KiB, NUM_PAGES + 1, page_bytes=16 * KiB)
    space = make_space(g, null_block=True)
    with KVPoolTokenAllocator(NUM_PAGES * 4, 4, dtype=torch.float16, space=space) as a:
        x = a.alloc(12)
        assert x is not None and space.available() == g.capacity - 1 - 3
        a.free(x[:4])  # pending pages go back on close too
    assert not space.closed and space.available() == g.capacity - 1  # pages back, space open
    with pytest.raises(PoolClosed):
        a.alloc(4)
    a.close()  # idempotent


def test_construction_is_validated(make_space: Callable[..., KVSpace]) -> None:
    g = Geometry(1, 2, 4 * KiB, NUM_PAGES + 1, page_bytes=16 * KiB)
    with pytest.raises(ValueError, match="null_block=True"):
        KVPoolTokenAllocator(NUM_PAGES * 4, 4, dtype=torch.float16, space=make_space(g))
    with pytest.raises(ValueError, match=f"num_blocks={NUM_PAGES + 1}"):
        KVPoolTokenAllocator(NUM_PAGES * 4, 4, dtype=torch.float16,
                             space=make_space(Geometry(1, 2, 4 * KiB, 80, page_bytes=16 * KiB), null_block=True))
    with pytest.raises(ValueError, match="token_bytes"):
        KVPoolTokenAllocator(64, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match="straddle"):  # 12 KiB blocks on 16 KiB pages: some never usable
        KVPoolTokenAllocator(NUM_PAGES * 4, 4, dtype=torch.float16, token_bytes=3 * KiB, page_bytes=16 * KiB,
                             pool=None)
    with pytest.raises(ValueError, match="page_size"):
        KVPoolTokenAllocator(64, 0, dtype=torch.float16, token_bytes=64)
    with pytest.raises(ValueError, match="no whole page"):
        KVPoolTokenAllocator(3, 4, dtype=torch.float16, token_bytes=64)
    with pytest.raises(ValueError, match="shortage_wait_s"):
        KVPoolTokenAllocator(64, 4, dtype=torch.float16, token_bytes=64, shortage_wait_s=-1)


def test_a_closed_allocator_refuses_work(make_alloc: MakeAlloc) -> None:
    a = make_alloc(1)
    x = a.alloc(2)
    assert x is not None
    a.close()
    assert a.closed and "closed" in repr(a) and a.space.closed
    for call in (lambda: a.alloc(1), lambda: a.free(x), a.available_size, a.backup_state, a.flush):
        with pytest.raises(PoolClosed):
            call()
