"""kvpool.adapters.sglang: SGLang's token-to-KV allocator contract over a kvpool space.

SGLang itself is not installed (CUDA-only kernels); these are contract tests
of sglang/srt/mem_cache/allocator.py's behaviour: padding page 0, whole-page
allocs, None on a miss, free groups, backup/restore, and the extend/decode
slot layout compared with a pure-Python reference of SGLang's algorithm.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvpool import Geometry, InvalidBlocks, KVSpace, PoolClosed
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


page_sizes = pytest.mark.parametrize("ps", [1, 4])


def i64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def state_of(a: KVPoolTokenAllocator) -> tuple[object, ...]:
    return (snapshot(a.space), a.held_pages().tolist(), a.available_size())


def pages_of(tokens: torch.Tensor, ps: int) -> set[int]:
    return set((tokens // ps).tolist())


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
def test_alloc_beyond_capacity_returns_none_and_changes_nothing(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
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


@page_sizes
def test_a_bad_free_in_a_group_fails_the_whole_group(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    x = a.alloc(4 * ps)
    assert x is not None
    before = state_of(a)
    a.free_group_begin()
    a.free(x[:ps])
    a.free(x[:ps])  # the same page again: only the batch at the end can tell
    with pytest.raises(InvalidBlocks):
        a.free_group_end()
    assert state_of(a) == before


# -- backup / restore ----------------------------------------------------------------
@page_sizes
def test_restore_undoes_allocs_and_frees_since_the_backup(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    kept = a.alloc(6 * ps)
    assert kept is not None
    before = state_of(a)
    state = a.backup_state()
    draft = a.alloc(9 * ps)
    assert draft is not None
    a.free(kept[: 2 * ps])  # held at the backup: must come back
    a.free(draft[: 3 * ps])  # allocated after it: stays free
    more = a.alloc(4 * ps)
    assert more is not None
    a.restore_state(state)
    assert state_of(a) == before
    # a restored state stays restorable, as SGLang's free-list snapshot does
    assert a.alloc(5 * ps) is not None
    a.restore_state(state)
    assert state_of(a) == before


@page_sizes
def test_a_page_freed_after_the_backup_is_held_again_by_restore(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    x = a.alloc(2 * ps)
    assert x is not None
    page = int(x[0]) // ps
    state = a.backup_state()
    used = a.space.stats().used_blocks
    a.free(x[:ps])
    assert page not in a.held_pages().tolist()
    assert a.available_size() == (NUM_PAGES - 1) * ps
    assert a.space.stats().used_blocks == used  # kept in the space: it may come back
    a.restore_state(state)
    assert page in a.held_pages().tolist() and a.available_size() == (NUM_PAGES - 2) * ps
    a.free(x[:ps])  # held again, so freeable again
    assert page not in a.held_pages().tolist()


@page_sizes
def test_freeing_a_deferred_page_again_is_a_double_free(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    x = a.alloc(3 * ps)
    assert x is not None
    a.backup_state()
    a.free(x[:ps])  # deferred: still held in the space, so only the adapter can tell
    before = state_of(a)
    with pytest.raises(InvalidBlocks, match="not allocated"):
        a.free(x[:ps])
    with pytest.raises(InvalidBlocks):
        a.free(torch.cat((x[ps : 2 * ps], x[:ps])))
    assert state_of(a) == before and a.available_size() == (NUM_PAGES - 2) * ps


@page_sizes
def test_an_alloc_that_needs_a_deferred_page_takes_it_and_restore_still_holds(
    make_alloc: MakeAlloc, ps: int
) -> None:
    a = make_alloc(ps)
    full = a.alloc(NUM_PAGES * ps)
    assert full is not None
    before = state_of(a)
    state = a.backup_state()
    a.free(full[:ps])
    again = a.alloc(ps)  # the only free page is the deferred one
    assert again is not None and pages_of(again, ps) == pages_of(full[:ps], ps)
    assert a.alloc(ps) is None
    a.restore_state(state)
    assert state_of(a) == before


@page_sizes
def test_restore_returns_pages_allocated_since_the_backup_to_the_space(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    assert a.alloc(3 * ps) is not None
    used = a.space.stats().used_blocks
    state = a.backup_state()
    assert a.alloc(20 * ps) is not None
    assert a.space.stats().used_blocks == used + 20
    a.restore_state(state)
    assert a.space.stats().used_blocks == used


def test_a_new_backup_supersedes_the_old_one(make_alloc: MakeAlloc) -> None:
    a, other = make_alloc(4), make_alloc(4)
    x = a.alloc(8)
    assert x is not None
    old = a.backup_state()
    a.free(x[:4])  # deferred under the old backup
    used = a.space.stats().used_blocks
    new = a.backup_state()
    assert a.space.stats().used_blocks == used - 1  # the new backup returned it to the space
    assert a.alloc(4) is not None
    before = state_of(a)
    with pytest.raises(ValueError, match="no longer restorable"):
        a.restore_state(old)
    with pytest.raises(ValueError, match="not a backup of this allocator"):
        a.restore_state(other.backup_state())
    assert state_of(a) == before
    a.restore_state(new)
    assert a.held_pages().tolist() == [int(x[4]) // 4]


def test_discard_backup_gives_deferred_pages_back_and_ends_the_backup(make_alloc: MakeAlloc) -> None:
    a = make_alloc(1)
    x = a.alloc(3)
    assert x is not None
    state = a.backup_state()
    a.free(x)
    used = a.space.stats().used_blocks
    a.discard_backup()
    assert a.space.stats().used_blocks == used - 3
    assert a.available_size() == NUM_PAGES
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
    s.trim()
    assert base < s.stats().committed_bytes < grown
    a.free(held[20 * ps :])
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


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("seed", range(3))
def test_extend_and_decode_match_sglangs_reference_on_random_batches(ps: int, seed: int) -> None:
    rng = random.Random(seed)
    num_pages = 48
    with KVPoolTokenAllocator(num_pages * ps, ps, dtype=torch.bfloat16, token_bytes=4 * KiB // ps,
                              page_bytes=16 * KiB, pool=None, reserve=(0, 0), reserve_thread=False) as a:
        rows: list[list[int]] = []  # each live request's token slots, as SGLang's req_to_token
        for _ in range(60):
            held_before = set(a.held_pages().tolist())
            step = rng.random() if a.available_size() > a.size // 4 else rng.random() * 1.3
            if step < 0.45:
                picked = rng.sample(range(len(rows)), k=min(len(rows), rng.randint(0, 3)))
                fresh = rng.randint(0 if picked else 1, 2)
                pre = [len(rows[i]) for i in picked] + [0] * fresh
                seq = [p + rng.randint(0, 2 * ps + 1) for p in pre]
                last = [rows[i][-1] if rows[i] else -1 for i in picked] + [-1] * fresh
                need = sum(-(-s // ps) - -(-p // ps) for p, s in zip(pre, seq))
                ext = sum(seq) - sum(pre)
                before = state_of(a)
                got = a.alloc_extend(i64(pre), i64(pre), i64(seq), i64(seq), i64(last), ext)
                if got is None:
                    assert need * ps > a.available_size() and state_of(a) == before
                    continue
                assert got.dtype == torch.int64
                check_against_reference(got, lambda pg: ref_alloc_extend(pre, seq, last, pg, ps), need,
                                        set(a.held_pages().tolist()) - held_before, ps)
                starts = np.cumsum([0] + [s - p for p, s in zip(pre, seq)])
                for j, i in enumerate(picked):
                    rows[i] += got[starts[j] : starts[j + 1]].tolist()
                rows += [got[starts[j] : starts[j + 1]].tolist() for j in range(len(picked), len(pre))]
            elif step < 0.8 and rows:
                picked = [i for i in range(len(rows)) if rows[i] and rng.random() < 0.6]
                seq = [len(rows[i]) + 1 for i in picked]
                last = [rows[i][-1] for i in picked]
                need = sum(1 for s in seq if (s - 1) % ps == 0)
                before = state_of(a)
                got = a.alloc_decode(i64(seq), i64(seq), i64(last))
                if got is None:
                    assert need * ps > a.available_size() and state_of(a) == before
                    continue
                check_against_reference(got, lambda pg: ref_alloc_decode(seq, last, pg, ps), need,
                                        set(a.held_pages().tolist()) - held_before, ps)
                for j, i in enumerate(picked):
                    rows[i].append(int(got[j]))
            elif rows:
                done = rows.pop(rng.randrange(len(rows)))
                a.free(torch.tensor(done, dtype=torch.int64))
            every = [x for r in rows for x in r]
            assert len(set(every)) == len(every) and min(every, default=ps) >= ps  # no slot twice, none padding
            assert {x // ps for x in every} == set(a.held_pages().tolist())


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


def test_extend_and_decode_reject_inconsistent_arguments(make_alloc: MakeAlloc) -> None:
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
    with pytest.raises(ValueError, match="num_new_pages"):
        a.alloc_extend([0], [0], [5], [5], [-1], 5, num_new_pages=1)
    assert state_of(a) == before


# -- whole allocator ---------------------------------------------------------------------
@page_sizes
def test_clear_returns_everything(make_alloc: MakeAlloc, ps: int) -> None:
    a = make_alloc(ps)
    empty = a.space.stats().used_blocks
    x = a.alloc(30 * ps)
    assert x is not None
    state = a.backup_state()
    a.free(x[:ps])  # deferred
    a.free_group_begin()
    a.free(x[ps : 2 * ps])
    a.clear()
    assert a.available_size() == NUM_PAGES * ps and a.held_pages().numel() == 0
    assert a.space.stats().used_blocks == empty  # deferred and grouped pages went back too
    assert a.alloc(NUM_PAGES * ps) is not None
    with pytest.raises(ValueError, match="no longer restorable"):
        a.restore_state(state)
    a.free_group_end()  # the group was dropped by clear


def test_sglang_attributes(make_alloc: MakeAlloc) -> None:
    cache = object()
    a = make_alloc(4, kvcache=cache)
    assert (a.size, a.size_full, a.page_size, a.num_pages) == (NUM_PAGES * 4, NUM_PAGES * 4, 4, NUM_PAGES)
    assert a.dtype == torch.float16 and a.device == "cpu" and a.get_kvcache() is cache
    assert isinstance(a.backup_state(), AllocatorState)
    assert "4 tokens" in a.debug_print()


def test_an_existing_space_is_borrowed_not_closed(make_space: Callable[..., KVSpace]) -> None:
    g = Geometry(1, 2, 4 * KiB, NUM_PAGES + 1, page_bytes=16 * KiB)
    space = make_space(g, null_block=True)
    with KVPoolTokenAllocator(NUM_PAGES * 4, 4, dtype=torch.float16, space=space) as a:
        assert a.alloc(8) is not None
        assert space.available() == g.capacity - 1 - 2
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


def test_a_closed_allocator_refuses_work(make_alloc: MakeAlloc) -> None:
    a = make_alloc(1)
    x = a.alloc(2)
    assert x is not None
    a.close()
    assert a.closed and "closed" in repr(a) and a.space.closed
    for call in (lambda: a.alloc(1), lambda: a.free(x), a.available_size, a.backup_state):
        with pytest.raises(PoolClosed):
            call()
