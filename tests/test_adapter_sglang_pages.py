"""kvpool.adapters.sglang: the life of SGLang's pages (kvpool.adapters._sglang_pages).

Freed pages stay in the space until the second flush() (SGLang's overlap
scheduler and EAGLE still write them), pending pages are reused oldest
first, and backup_state/restore_state put SGLang's free list back exactly,
once, while keeping draft pages in the space.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool import InvalidBlocks

from . import _sglang_support as S
from ._sglang_support import NUM_PAGES, MakeAlloc, page_sizes, pages_of, state_of, used

make_alloc = pytest.fixture(name="make_alloc")(S.make_alloc_fixture)


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
