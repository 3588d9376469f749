"""An SGLang token-to-KV allocator over a kvpool space (``kvpool.adapters.sglang``).

SGLang's scheduler hands out KV slots through a ``TokenToKVPoolAllocator``
(``page_size == 1``) or a ``PagedTokenToKVPoolAllocator`` (``page_size > 1``)
from ``sglang/srt/mem_cache/allocator.py``. :class:`KVPoolTokenAllocator`
keeps that contract for both page sizes while the pages live in a
:class:`kvpool.KVSpace`, so physical memory is committed only while SGLang
holds pages on it. It does not import SGLang.

Index mapping (the only thing this module owns; allocation is the space's)::

    kvpool block b  ==  SGLang page b  ==  tokens [b*page_size, (b+1)*page_size)

    tokens:  | 0 .. ps-1 | ps .. 2ps-1 | 2ps .. 3ps-1 | ...
    page:    |  0 (pad)  |      1      |      2       | ...   1..num_pages
    block:   |  0 (null) |      1      |      2       | ...   of the space

Page 0 is SGLang's padding slot (padded tokens write dummy KV there), so the
space is made with ``null_block=True``: block 0 is held from the start and
never handed out. The space has exactly ``num_pages + 1`` blocks, so every
token index fits SGLang's ``size + page_size`` KV buffers.

Why backup/restore needs a *deferred* set. SGLang's ``backup_state`` is a
snapshot of the free list and ``restore_state`` puts it back exactly: pages
allocated after the backup are free again, pages freed after it are held
again (EAGLE allocates draft slots for one step and rolls them back this
way). Freeing a page to the space would let it be released (punched to
zero) or handed out by another path, so a later restore could not give it
back intact. Hence, while a backup is live:

* a page that was held at backup time and is freed goes to ``_deferred``:
  logically free (counted by :meth:`available_size`, reused first by the
  next alloc) but still held in the space;
* a page allocated after the backup goes straight back to the space when
  freed (restore would free it anyway);
* each page's first change after the backup is journaled (``_touched`` /
  ``_was_held``, numpy arrays, so the cost is per call, not per page
  object), and restore only walks the journal: pages held now but not at
  backup are freed to the space in one call, deferred pages are held again.

Reusing deferred pages directly (instead of flushing them to the space when
an alloc would miss) means no alloc ever invalidates a live backup: restore
after ``backup, free(p), alloc -> p`` gives the same answer SGLang's own free
list gives. One backup is live at a time: a new ``backup_state()`` first
returns the deferred pages to the space and supersedes the old state, and
``clear()`` / :meth:`discard_backup` end it; restoring a superseded state
raises ``ValueError`` instead of corrupting the page table. A restored state
stays valid (it may be restored again, as SGLang's can).

``available_size()`` is what an alloc can deliver now (free pages of the
space within its pool budget and limit, plus deferred pages), never more:
SGLang admits work by it and treats a later ``None`` from ``alloc`` in
``alloc_token_slots`` as a fatal out-of-memory. When the pool cannot cover
the whole ``size``, it is therefore below ``size - used``, and SGLang's idle
leak check (``Scheduler.check_memory``: available + evictable ==
``max_total_num_tokens``) has to be relaxed by the integration.

SGLang drives the allocator from its scheduler thread only; like SGLang's own
allocators this class takes no lock.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvpool import Geometry, InvalidBlocks, KVSpace, MiB, Pool, PoolClosed, PoolExhausted
from kvpool.geometry import Layout
from kvpool.pool import default_pool_name

__all__ = ["AllocatorState", "KVPoolTokenAllocator"]

Ids = npt.NDArray[np.int64]
IntsLike = torch.Tensor | Sequence[int] | npt.NDArray[np.integer[Any]]

# Per-page state. Page 0 stays _FREE here: the space holds it as its null block and
# frees of it are refused by the range check.
_FREE, _HELD, _DEFERRED = 0, 1, 2
_uids = itertools.count()


@dataclass(frozen=True)
class AllocatorState:
    """What :meth:`KVPoolTokenAllocator.backup_state` returns; opaque to callers."""

    owner: int
    generation: int


def _ints(x: IntsLike, name: str) -> Ids:
    """A 1-D int64 numpy copy of an index/length argument (tensors come to the CPU)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.reshape(-1).astype(np.int64, copy=True)


def _ceil_div(a: Ids, b: int) -> Ids:
    return -(-a // b)


class KVPoolTokenAllocator:
    """SGLang ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` over a KV space.

    Args:
        size: tokens SGLang may address (``max_total_num_tokens``); pages are
            ``size // page_size``, numbered from 1.
        page_size: tokens per SGLang page (= one kvpool block).
        dtype: the KV cache dtype (SGLang reads it; :meth:`token_view` uses it).
        device: where index tensors live (SGLang's ``device``); also the
            device of a space this allocator creates.
        kvcache: SGLang's KV cache object, returned by :meth:`get_kvcache`.
        need_sort: accepted for SGLang compatibility; the space already picks
            best-fit pages, so nothing is sorted.
        space: an existing space to allocate from (made with
            ``null_block=True`` and ``num_blocks = size // page_size + 1``);
            it is not closed by :meth:`close`. Without it the allocator makes
            its own space from ``geometry`` or from the shape arguments below.
        geometry: the geometry of the space to create (``num_blocks`` must be
            ``size // page_size + 1``).
        num_layers, num_kv_buffers, token_bytes, page_bytes, layout: the
            geometry to build when neither ``space`` nor ``geometry`` is
            given; ``token_bytes`` is one token of one buffer of one layer
            (``head_num * head_dim * itemsize``).
        pool, reserve, reserve_thread, limit_bytes, name: as
            :class:`kvpool.KVSpace` (``pool="default"`` means ``$KVPOOL_POOL``).
    """

    def __init__(
        self,
        size: int,
        page_size: int = 1,
        *,
        dtype: torch.dtype,
        device: str = "cpu",
        kvcache: Any = None,
        need_sort: bool = False,
        space: KVSpace | None = None,
        geometry: Geometry | None = None,
        num_layers: int = 1,
        num_kv_buffers: int = 2,
        token_bytes: int | None = None,
        page_bytes: int = 2 * MiB,
        layout: Layout = "per_layer",
        pool: Pool | str | None = "default",
        reserve: tuple[int, int] = (1, 2),
        reserve_thread: bool = True,
        limit_bytes: int | None = None,
        name: str | None = None,
    ) -> None:
        for what, v in (("size", size), ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{what} must be a positive int, got {v!r}")
        if size < page_size:
            raise ValueError(f"size ({size}) holds no whole page of {page_size} tokens; use size >= page_size")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.dtype = dtype
        self.device = device
        self.need_sort = need_sort
        self._kvcache = kvcache
        self._uid = next(_uids)
        want = self.num_pages + 1

        if space is not None:
            if geometry is not None or token_bytes is not None:
                raise ValueError("pass either space= or the geometry to build one, not both")
            self._check_blocks(space.geometry, want)
            if not space.null_block:
                raise ValueError("the space must be made with null_block=True: SGLang writes padding to page 0")
            self.space, self._owns_space = space, False
        else:
            if geometry is None:
                if token_bytes is None:
                    raise ValueError(
                        "give space=, geometry= or token_bytes= (one token of one KV buffer of one layer, "
                        "head_num * head_dim * itemsize) to size the KV space"
                    )
                geometry = Geometry(num_layers, num_kv_buffers, page_size * token_bytes, want,
                                    page_bytes=page_bytes, layout=layout)
            self._check_blocks(geometry, want)
            if pool == "default":
                pool = default_pool_name()
            self.space = KVSpace(
                geometry, device=device, null_block=True, reserve=reserve,
                reserve_thread=reserve_thread, limit_bytes=limit_bytes, pool=pool, name=name,
            )
            self._owns_space = True

        # _state[p]: _FREE (in the space), _HELD (SGLang's) or _DEFERRED (see the module essay).
        self._state = np.zeros(want, dtype=np.int8)
        self._deferred: Ids = np.empty(0, dtype=np.int64)
        # Backup journal: _touched marks pages changed since the live backup,
        # _was_held their state at backup time; _touched_list enumerates them.
        self._touched = np.zeros(want, dtype=bool)
        self._was_held = np.zeros(want, dtype=bool)
        self._touched_list: list[Ids] = []
        self._generation = 0
        self._backup_live = False
        self.free_group: list[Ids] | None = None  # page ids per free() call, or None: no group
        self._closed = False

    @staticmethod
    def _check_blocks(geometry: Geometry, want: int) -> None:
        if geometry.blocks != want:
            raise ValueError(
                f"the space has num_blocks={geometry.blocks} but SGLang addresses pages 0..{want - 1}; "
                f"use num_blocks={want} (size // page_size + 1 for the padding page)"
            )
        if geometry.capacity != geometry.blocks:
            # SGLang counts every page id as its own; a straddling block could never be handed out.
            B = geometry.region_block_bytes
            raise ValueError(
                f"blocks of {B} bytes straddle the {geometry.page_bytes}-byte kvpool pages, so only "
                f"{geometry.capacity} of {geometry.blocks} SGLang pages could be handed out; use a "
                f"page_bytes that is a multiple of {B}"
            )

    # -- SGLang attributes ---------------------------------------------------
    @property
    def size_full(self) -> int:
        return self.size

    @property
    def is_not_in_free_group(self) -> bool:
        """SGLang <= 0.5.18 spelled "no free group is open" this way."""
        return self.free_group is None

    def get_kvcache(self) -> Any:
        return self._kvcache

    def get_cpu_copy(self, indices: Any, mamba_indices: Any = None) -> Any:
        return self._kvcache.get_cpu_copy(indices, mamba_indices=mamba_indices)

    def load_cpu_copy(self, kv_cache_cpu: Any, indices: Any, mamba_indices: Any = None) -> Any:
        return self._kvcache.load_cpu_copy(kv_cache_cpu, indices, mamba_indices=mamba_indices)

    def debug_print(self) -> str:
        return repr(self)

    def available_size(self) -> int:
        """Tokens a following ``alloc`` can deliver: the space's free pages plus deferred ones."""
        self._check_open()
        return (self.space.available() + int(self._deferred.size)) * self.page_size

    def held_pages(self) -> torch.Tensor:
        """Page ids SGLang holds now, ascending (for audits and tests)."""
        self._check_open()
        return torch.from_numpy(np.flatnonzero(self._state == _HELD).astype(np.int64))

    # -- allocation ----------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` token indices (whole pages), or ``None`` when they are not there."""
        self._check_open()
        if isinstance(need_size, bool) or not isinstance(need_size, (int, np.integer)) or need_size < 0:
            raise ValueError(f"need_size must be a non-negative int, got {need_size!r}")
        if need_size % self.page_size:
            raise ValueError(
                f"need_size ({need_size}) is not a multiple of page_size ({self.page_size}); "
                "SGLang allocates whole pages here (alloc_extend/alloc_decode fill partial ones)"
            )
        pages = self._take(int(need_size) // self.page_size)
        if pages is None:
            return None
        return self._to_device(self._tokens(pages))

    def alloc_extend(
        self,
        prefix_lens: IntsLike,
        prefix_lens_cpu: IntsLike,
        seq_lens: IntsLike,
        seq_lens_cpu: IntsLike,
        last_loc: IntsLike,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ) -> torch.Tensor | None:
        """Slots for extending request ``i`` from ``prefix_lens[i]`` to ``seq_lens[i]`` tokens.

        Tokens first fill the request's last partial page (after
        ``last_loc[i]``, the slot of its last prefix token), then new pages,
        taken in request order. Returns ``extend_num_tokens`` indices in
        request order, or ``None`` (nothing changed) when the new pages are
        not there. The lengths come from the ``*_cpu`` arguments.
        """
        self._check_open()
        pre, seq = _ints(prefix_lens_cpu, "prefix_lens_cpu"), _ints(seq_lens_cpu, "seq_lens_cpu")
        last = _ints(last_loc, "last_loc")
        if not len(pre) == len(seq) == len(last) == len(prefix_lens) == len(seq_lens):
            raise ValueError(
                f"batch sizes differ: prefix_lens {len(prefix_lens)}, seq_lens {len(seq_lens)}, "
                f"last_loc {len(last)}"
            )
        if (pre < 0).any() or (seq < pre).any():
            raise ValueError("alloc_extend needs 0 <= prefix_lens <= seq_lens for every request")
        ext = seq - pre
        if int(ext.sum()) != extend_num_tokens:
            raise ValueError(
                f"extend_num_tokens is {extend_num_tokens} but seq_lens - prefix_lens sum to {int(ext.sum())}"
            )
        ps = self.page_size
        first_new = _ceil_div(pre, ps)  # the first page index (within the request) that is new
        new_per_req = _ceil_div(seq, ps) - first_new
        need = int(new_per_req.sum())
        if num_new_pages is not None and num_new_pages != need:
            raise ValueError(f"num_new_pages is {num_new_pages} but the lengths need {need} new pages")
        # Tokens that go on the prefix's partial page continue after last_loc.
        partial = np.minimum(seq, first_new * ps) - pre > 0
        self._check_last_loc(last[partial], pre[partial])
        pages = self._take(need)
        if pages is None:
            return None
        req = np.repeat(np.arange(len(seq)), ext)
        start = np.cumsum(ext) - ext
        k = np.arange(int(ext.sum()), dtype=np.int64) - start[req]  # position within this extend
        pos = pre[req] + k  # position within the request's sequence
        page_start = np.cumsum(new_per_req) - new_per_req
        on_new = pos >= first_new[req] * ps
        out = last[req] + 1 + k
        slot = page_start[req] + pos // ps - first_new[req]
        out[on_new] = pages[slot[on_new]] * ps + pos[on_new] % ps
        return self._to_device(out)

    def alloc_decode(self, seq_lens: IntsLike, seq_lens_cpu: IntsLike, last_loc: IntsLike) -> torch.Tensor | None:
        """One slot per request whose length grows to ``seq_lens[i]``.

        The slot after ``last_loc[i]`` while the last page has room, else the
        first token of a new page (new pages in request order). ``None`` (and
        nothing changed) when the new pages are not there.
        """
        self._check_open()
        seq, last = _ints(seq_lens_cpu, "seq_lens_cpu"), _ints(last_loc, "last_loc")
        if not len(seq) == len(last) == len(seq_lens):
            raise ValueError(f"batch sizes differ: seq_lens {len(seq_lens)}, last_loc {len(last)}")
        if (seq < 1).any():
            raise ValueError("alloc_decode needs seq_lens >= 1 (the length after this token)")
        ps = self.page_size
        new = _ceil_div(seq, ps) != _ceil_div(seq - 1, ps)
        self._check_last_loc(last[~new], seq[~new] - 1)
        pages = self._take(int(new.sum()))
        if pages is None:
            return None
        out = last + 1
        out[new] = pages * ps
        return self._to_device(out)

    def _check_last_loc(self, last: Ids, pre: Ids) -> None:
        """A partial page is continued only after a held slot at the matching offset."""
        if not last.size:
            return
        ps = self.page_size
        bad = ((last + 1) % ps != pre % ps) | (last < ps) | (last >= self._state.size * ps)
        if not bad.any():
            bad = self._state[last // ps] != _HELD
        if bad.any():
            raise ValueError(
                f"last_loc {last[bad][:8].tolist()} is not a held slot at offset (prefix_len - 1) % "
                f"page_size of its page for prefix lengths {pre[bad][:8].tolist()}"
            )

    def _take(self, n: int) -> Ids | None:
        """``n`` page ids, all or nothing: deferred pages first, then the space."""
        reuse = min(n, int(self._deferred.size))
        fresh: Ids = np.empty(0, dtype=np.int64)
        if n > reuse:
            try:
                fresh = self.space.alloc(n - reuse)
            except PoolExhausted:
                return None
        pages = np.concatenate((self._deferred[:reuse], fresh))
        self._deferred = self._deferred[reuse:]
        self._journal(pages)
        self._state[pages] = _HELD
        return pages

    # -- free ----------------------------------------------------------------
    def free(self, free_index: IntsLike) -> None:
        """Free the pages of these token indices (inside a free group: at its end).

        Raises :class:`kvpool.InvalidBlocks` and frees nothing for a token of
        the padding page, out of range, not allocated (double free) or, with
        ``page_size == 1``, repeated in the batch. With ``page_size > 1``
        several tokens of one page free it once, as in SGLang.
        """
        self._check_open()
        pages = self._pages_of(free_index)
        if pages.size == 0:
            return
        if self.free_group is not None:
            self.free_group.append(pages)
            return
        self._free_pages(pages)

    def free_group_begin(self) -> None:
        """Collect frees until :meth:`free_group_end` (one space call for the group)."""
        self._check_open()
        if self.free_group is not None:
            raise RuntimeError("free groups cannot be nested: call free_group_end() first")
        self.free_group = []

    def free_group_end(self) -> None:
        """Apply the group's frees as one batch; a bad one fails the whole group."""
        pending, self.free_group = self.free_group, None
        if not pending:
            return
        self._check_open()
        pages = np.concatenate(pending)
        vals, counts = np.unique(pages, return_counts=True)
        if vals.size != pages.size:
            twice = vals[counts > 1][:8].tolist()
            raise InvalidBlocks(f"pages {twice} are freed by two calls of one free group; nothing was freed", twice)
        self._free_pages(vals)

    def _pages_of(self, free_index: IntsLike) -> Ids:
        """Validated unique page ids of a batch of token indices (a copy: groups keep it)."""
        arr = free_index.detach().cpu().numpy() if isinstance(free_index, torch.Tensor) else np.asarray(free_index)
        if arr.size == 0:
            return np.empty(0, dtype=np.int64)
        if arr.dtype.kind not in "iu":
            raise InvalidBlocks(f"token indices must be integers, got dtype {arr.dtype}")
        tokens = arr.reshape(-1).astype(np.int64)
        ps, end = self.page_size, self._state.size * self.page_size
        bad = (tokens < ps) | (tokens >= end)
        if bad.any():
            raise InvalidBlocks(
                f"token indices {tokens[bad][:8].tolist()} are outside [{ps}, {end}) "
                f"(page 0 is SGLang's padding page)", tokens[bad][:8].tolist(),
            )
        pages = np.unique(tokens // ps)
        if ps == 1 and pages.size != tokens.size:
            vals, counts = np.unique(tokens, return_counts=True)
            twice = vals[counts > 1][:8].tolist()
            raise InvalidBlocks(f"token indices {twice} are freed twice in one batch; nothing was freed", twice)
        return pages

    def _free_pages(self, pages: Ids) -> None:
        """Free unique pages SGLang holds: to the space, or deferred under a live backup."""
        not_held = pages[self._state[pages] != _HELD]
        if not_held.size:
            bad = not_held[:8].tolist()
            raise InvalidBlocks(f"pages {bad} are not allocated (double free?); nothing was freed", bad)
        if self._backup_live:
            self._journal(pages)
            keep = self._was_held[pages]
        else:
            keep = np.zeros(pages.size, dtype=bool)
        give = pages[~keep]
        if give.size:
            self.space.free(give)
        self._state[give] = _FREE
        self._state[pages[keep]] = _DEFERRED
        self._deferred = np.concatenate((self._deferred, pages[keep]))

    # -- backup / restore ------------------------------------------------------
    def backup_state(self) -> AllocatorState:
        """Snapshot the allocation for :meth:`restore_state`; supersedes an earlier snapshot."""
        self._check_open()
        self._end_backup()
        self._generation += 1
        self._backup_live = True
        return AllocatorState(self._uid, self._generation)

    def restore_state(self, state: AllocatorState) -> None:
        """Put back exactly the pages held at ``state``'s backup.

        Pages allocated since are freed, pages freed since are held again.
        Raises ``ValueError`` (changing nothing) for a state that is not this
        allocator's live backup.
        """
        self._check_open()
        if not isinstance(state, AllocatorState) or state.owner != self._uid:
            raise ValueError(f"{state!r} is not a backup of this allocator")
        if not self._backup_live or state.generation != self._generation:
            raise ValueError(
                f"backup {state.generation} is no longer restorable: a later backup_state(), clear() or "
                "discard_backup() ended it (one backup is live at a time)"
            )
        if not self._touched_list:
            return
        pages = np.concatenate(self._touched_list)
        now = self._state[pages]
        assert not (~self._was_held[pages] & (now == _DEFERRED)).any(), "deferred page not held at backup"
        assert not (self._was_held[pages] & (now == _FREE)).any(), "page held at backup went back to the space"
        give = pages[(now == _HELD) & ~self._was_held[pages]]
        if give.size:
            self.space.free(give)
        self._state[give] = _FREE
        self._state[pages[now == _DEFERRED]] = _HELD
        self._deferred = np.empty(0, dtype=np.int64)
        self._touched[pages] = False
        self._touched_list = []

    def discard_backup(self) -> None:
        """End the live backup without restoring it: deferred frees go to the space now."""
        self._check_open()
        self._end_backup()

    def _journal(self, pages: Ids) -> None:
        """Record the backup-time state of pages changing for the first time since the backup."""
        if not self._backup_live or not pages.size:
            return
        first = pages[~self._touched[pages]]
        if first.size:
            self._touched[first] = True
            self._was_held[first] = self._state[first] == _HELD
            self._touched_list.append(first)

    def _end_backup(self) -> None:
        if self._deferred.size:
            self.space.free(self._deferred)
            self._state[self._deferred] = _FREE
            self._deferred = np.empty(0, dtype=np.int64)
        if self._touched_list:
            self._touched[np.concatenate(self._touched_list)] = False
            self._touched_list = []
        self._backup_live = False

    # -- whole-allocator operations ------------------------------------------------
    def clear(self) -> None:
        """Return every page to the space, drop the free group and any backup."""
        self._check_open()
        pages = np.flatnonzero(self._state != _FREE).astype(np.int64)
        if pages.size:
            self.space.free(pages)
        self._state[:] = _FREE
        self._deferred = np.empty(0, dtype=np.int64)
        self._touched[:] = False
        self._touched_list = []
        self._backup_live = False
        self._generation += 1
        self.free_group = None

    def token_view(self, layer: int, buffer: int, token_shape: Sequence[int]) -> torch.Tensor:
        """Layer ``layer``'s KV buffer ``buffer`` indexed by token: ``(tokens, *token_shape)``.

        Zero-copy over the space (per-layer layout), so a KV cache built on
        these views commits memory only for pages SGLang holds.
        """
        g = self.space.geometry
        if g.layout != "per_layer":
            raise ValueError("token_view needs the per_layer layout (contiguous blocks interleave layers)")
        blocks = self.space.view(layer, buffer, self.dtype, (self.page_size, *token_shape))
        return blocks.view(g.blocks * self.page_size, *token_shape)

    # -- helpers ---------------------------------------------------------------
    def _tokens(self, pages: Ids) -> Ids:
        if self.page_size == 1:
            return pages
        offsets = np.arange(self.page_size, dtype=np.int64)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def _to_device(self, ids: Ids) -> torch.Tensor:
        return torch.from_numpy(ids).to(self.device)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosed("the SGLang allocator is closed")

    # -- lifecycle ---------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Give every page back (closing the space if this allocator made it). Idempotent."""
        if self._closed:
            return
        try:
            if self._owns_space:
                self.space.close()
            elif not self.space.closed:
                self.clear()
        finally:
            self._closed = True

    def __enter__(self) -> KVPoolTokenAllocator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return "<KVPoolTokenAllocator closed>"
        held = int((self._state == _HELD).sum())
        return (
            f"<KVPoolTokenAllocator {held}/{self.num_pages} pages of {self.page_size} tokens held, "
            f"{self._deferred.size} deferred, {self.space!r}>"
        )
