"""kvpool.adapters.sglang: SGLang's token-to-KV allocator contract over a kvpool space.

SGLang itself is not installed (CUDA-only kernels); these are contract tests
of its allocator's behaviour (sglang/srt/mem_cache/allocator.py and the
allocator/ package): padding page 0, whole-page allocs, None on a miss, free
groups, backup/restore, and the extend/decode slot layout compared with a
pure-Python reference of SGLang's algorithm; plus what this adapter adds on
top: freed pages stay in the space until the second flush(), bounded waits
for pool budget, no host copy of last_loc.

The page lifecycle (pending until the second flush, backup/restore) is
tested in test_adapter_sglang_pages.py, the extend/decode layout in
test_adapter_sglang_extend.py; shared fixtures in _sglang_support.py.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvpool import Geometry, InvalidBlocks, KVSpace, Pool, PoolClosed
from kvpool.adapters.sglang import AllocatorState, KVPoolTokenAllocator

from . import _sglang_support as S
from ._sglang_support import NUM_PAGES, MakeAlloc, page_sizes, pages_of, state_of, used
from ._helpers import wait_until
from .conftest import KiB

make_alloc = pytest.fixture(name="make_alloc")(S.make_alloc_fixture)


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
        wait_until(b_waiting, "b waits, and tells the pool so")  # then the budget comes back
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
