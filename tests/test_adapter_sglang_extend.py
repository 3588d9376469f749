"""kvpool.adapters.sglang: alloc_extend / alloc_decode against SGLang's algorithm.

A pure-Python reference of SGLang's extend/decode slot layout (continue the
prefix's partial page, then new pages in request order) is compared with the
adapter over random steps through backups, free groups and flushes; plus
argument checks and last_loc staying on its device.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvpool import Geometry, KVSpace
from kvpool.adapters.sglang import KVPoolTokenAllocator

from . import _sglang_support as S
from ._sglang_support import NUM_PAGES, i64, MakeAlloc, pages_of, state_of
from .conftest import KiB

make_alloc = pytest.fixture(name="make_alloc")(S.make_alloc_fixture)


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
