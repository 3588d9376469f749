"""An SGLang token-to-KV allocator over a kvpool space (``kvpool.adapters.sglang``).

:class:`KVPoolTokenAllocator` keeps the contract of SGLang's
``TokenToKVPoolAllocator`` (``page_size == 1``) and
``PagedTokenToKVPoolAllocator`` (``page_size > 1``) while the pages live in a
:class:`kvpool.KVSpace`, so memory is committed only while SGLang holds pages
on it. It does not import SGLang.

Supported SGLang surface (``sglang/srt/mem_cache/allocator.py`` and its
successor package ``mem_cache/allocator/``): ``alloc(need_size)``, the
six-argument ``alloc_extend`` (releases without the ``*_cpu`` arguments are
not supported), ``alloc_decode``, ``free``, free groups (``free_group is
None`` or the older ``is_not_in_free_group``), ``backup_state`` /
``restore_state``, the attributes and pass-throughs of SGLang's base class,
and ``free_full``, ``free_segment(s)``, ``get_all_free_pages``. Not provided:
``evict_to_free_tokens``/``check_decode_capacity`` (they drive SGLang's
tree-cache eviction, whose API moves between releases; SGLang's base-class
defaults are written against ``available_size``, so an integration may list
``BaseTokenToKVPoolAllocator`` as a second base after this class, as
:mod:`kvpool.adapters.sglang_plugin` does, overriding
``check_decode_capacity`` with :meth:`KVPoolTokenAllocator.reserve`),
``verify_byte_accounting``, ``translate_kv_indices_for_transfer``,
``resize`` and ``merge_and_sort_free``.

Index mapping (the only thing this module owns; allocation is the space's)::

    tokens:  | 0 .. ps-1 | ps .. 2ps-1 | 2ps .. 3ps-1 | ...
    page:    |  0 (pad)  |      1      |      2       | ...   SGLang's, 1..num_pages
    block:   |  0 (null) |      1      |      2       | ...   the space's

Page 0 is SGLang's padding slot (padded tokens write dummy KV there): the
space is made with ``null_block=True`` and ``num_pages + 1`` blocks.

Freed pages stay in the space for a step, and backups are single-use: the
page lifecycle (held, pending, aged, marked by a live backup) is
:mod:`kvpool.adapters._sglang_pages`, whose essay says why. **Call**
:meth:`KVPoolTokenAllocator.flush` **at the end of every scheduler loop
iteration**, idle ones included: nothing else but :meth:`clear` and
:meth:`close` returns freed pages to the space.

Shortages. ``available_size()`` is what an alloc can deliver now: the
space's free pages within its pool budget and limit, plus pending ones.
SGLang admits work by it and treats a later ``None`` as a fatal
out-of-memory, so when another engine takes the budget in between, an alloc
waits in :meth:`kvpool.KVSpace.acquire` (the pool sees this engine waiting)
for as long as the other tenants make progress, and returns ``None`` once
none has for ``shortage_wait_s``; never when SGLang's own allocator would
miss too. The decode gate leaves no such gap: :meth:`KVPoolTokenAllocator.reserve`
takes the pages it counts (a miss there makes SGLang retract, not fail).
Below the pool's edge ``available_size()`` is less than ``size - used``, so
SGLang's idle leak check (available + evictable == ``max_total_num_tokens``)
has to be relaxed by the integration.

Lending (ARCHITECTURE.md "Fair share", rules 5 and 8). While this engine
gives memory back (it borrows and a tenant below its guarantee waits, or it
restores the others' headroom) the pool refuses it new pages. It then admits
nothing and drops its prefix cache (:meth:`KVPoolTokenAllocator.giving_back`:
the plugin's prefill budget and iteration hook), and its running requests
decode into the free slots of the pages it already holds
(:meth:`KVPoolTokenAllocator.decode_size`, taken by the plugin's decode gate,
:meth:`KVPoolTokenAllocator.reserve`; it commits no page), so its pages empty as
they finish. An alloc its gates counted just before the verdict turned is
honoured from the pool's free memory (rule 5). SGLang retracts a request
only when those slots run out (counted as a preemption,
:meth:`KVPoolTokenAllocator.begin_preemption`). It never preempts for the
pool: its space says so, and it publishes what its completions free
(:meth:`KVPoolTokenAllocator.publish_freeing`).

Bad frees raise. SGLang's allocators silently take some double frees (at
``page_size == 1`` the slot lands in the free list twice); this one raises
:class:`kvpool.InvalidBlocks` and changes nothing, deliberately: a page handed
out twice corrupts two requests.

SGLang drives the allocator from its scheduler thread only; like SGLang's own
allocators this class takes no lock.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvpool import Geometry, InvalidBlocks, KVSpace, MiB, Pool, PoolExhausted
from kvpool.geometry import Layout
from kvpool.pool import default_pool_name

from ._sglang_lending import Freeing, LenderGates
from ._sglang_pages import AllocatorState, IntsLike, PageStates, host_ints
from ._sglang_preemption import Preemptions
from ._sglang_views import token_view

__all__ = ["AllocatorState", "KVPoolTokenAllocator", "token_view"]

Ids = npt.NDArray[np.int64]

_uids = itertools.count()


class KVPoolTokenAllocator(LenderGates):
    """SGLang ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` over a KV space.

    Frees reach the space at the second :meth:`flush` after them: call
    :meth:`flush` at the end of every scheduler loop iteration, idle ones
    included (:mod:`kvpool.adapters._sglang_pages`, "Safe points").

    Args:
        size: tokens SGLang may address (``max_total_num_tokens``); pages are
            ``size // page_size``, numbered from 1.
        page_size: tokens per SGLang page (= one kvpool block).
        dtype, device, kvcache, need_sort: SGLang's; ``device`` is where index
            tensors live (and a created space); ``need_sort`` is ignored (the
            space picks best-fit pages).
        debug: check ``last_loc`` against the held pages (a host copy: one
            sync per alloc). ``None``: when ``$SGLANG_DEBUG_MEMORY_POOL`` is set.
        shortage_wait_s: when only the pool's budget is short, an alloc waits
            while other tenants make progress and gives up (``None``) once
            none has for this long (a stopped peer); ``0`` returns ``None``
            at once.
        space: a space to borrow (``null_block=True``, ``num_blocks = size //
            page_size + 1``); :meth:`close` leaves it open. Without it the
            allocator makes one from ``geometry`` or from ``num_layers``,
            ``num_kv_buffers``, ``token_bytes`` (one token of one buffer of one
            layer: ``head_num * head_dim * itemsize``), ``page_bytes``, ``layout``.
        pool, reserve, reserve_thread, limit_bytes, name: as
            :class:`kvpool.KVSpace` (``pool="default"`` means ``$KVPOOL_POOL``).
    """

    def __init__(
        self, size: int, page_size: int = 1, *, dtype: torch.dtype, device: str = "cpu",
        kvcache: Any = None, need_sort: bool = False, debug: bool | None = None,
        shortage_wait_s: float = 5.0,
        space: KVSpace | None = None, geometry: Geometry | None = None,
        num_layers: int = 1, num_kv_buffers: int = 2, token_bytes: int | None = None,
        page_bytes: int = 2 * MiB, layout: Layout = "per_layer",
        pool: Pool | str | None = "default", reserve: tuple[int, int] = (1, 2),
        reserve_thread: bool = True, limit_bytes: int | None = None, name: str | None = None,
    ) -> None:
        for what, v in (("size", size), ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{what} must be a positive int, got {v!r}")
        if size < page_size:
            raise ValueError(f"size ({size}) holds no whole page of {page_size} tokens; use size >= page_size")
        if not shortage_wait_s >= 0:
            raise ValueError(f"shortage_wait_s must be >= 0, got {shortage_wait_s!r}")
        self.size, self.page_size, self.num_pages = size, page_size, size // page_size
        self.dtype, self.device, self.need_sort = dtype, device, need_sort
        if debug is None:  # SGLang's own switch for the same checks in its paged allocator
            debug = os.environ.get("SGLANG_DEBUG_MEMORY_POOL", "").lower() in ("1", "true")
        self.debug = debug
        self.shortage_wait_s = float(shortage_wait_s)
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
                    raise ValueError("give space=, geometry= or token_bytes= (one token of one KV buffer of one "
                                     "layer, head_num * head_dim * itemsize) to size the KV space")
                geometry = Geometry(num_layers, num_kv_buffers, page_size * token_bytes, want,
                                    page_bytes=page_bytes, layout=layout)
            self._check_blocks(geometry, want)
            if pool == "default":
                pool = default_pool_name()
            self.space = KVSpace(geometry, device=device, null_block=True, reserve=reserve,
                                 reserve_thread=reserve_thread, limit_bytes=limit_bytes, pool=pool, name=name)
            self._owns_space = True

        self._pages = PageStates(want)  # every page's state, the pending pages and the live backup
        self._preempted = Preemptions(self.space, want)  # SGLang's retractions, counted when their pages go back
        self.space.set_preempts(False)  # SGLang never preempts for the pool: the judge asks the other lenders
        self._freeing = Freeing(self.space, page_size, want * page_size)  # what its completions give back
        self.free_group: list[Ids] | None = None  # page ids per free() call, or None: no group
        self._closed = False

    @staticmethod
    def _check_blocks(geometry: Geometry, want: int) -> None:
        if geometry.blocks != want:
            raise ValueError(f"the space has num_blocks={geometry.blocks} but SGLang addresses pages 0..{want - 1}; "
                             f"use num_blocks={want} (size // page_size + 1 for the padding page)")
        if geometry.capacity != geometry.blocks:
            # SGLang counts every page id as its own; a straddling block could never be handed out.
            B = geometry.region_block_bytes
            raise ValueError(f"blocks of {B} bytes straddle the {geometry.page_bytes}-byte kvpool pages, so only "
                             f"{geometry.capacity} of {geometry.blocks} SGLang pages could be handed out; use a "
                             f"page_bytes that is a multiple of {B}")

    # -- SGLang attributes and pass-throughs -----------------------------------
    @property
    def size_full(self) -> int:
        return self.size

    @property
    def is_not_in_free_group(self) -> bool:
        """Older SGLang spelled "no free group is open" this way."""
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
        """Tokens a following ``alloc`` can deliver: the space's free pages plus pending ones."""
        self._check_open()
        return (self.space.available() + int(self._pages.pending.size)) * self.page_size

    def held_pages(self) -> torch.Tensor:
        """Page ids SGLang holds now, ascending (for audits and tests)."""
        self._check_open()
        return torch.from_numpy(np.flatnonzero(self._held_mask()).astype(np.int64))

    def pending_pages(self) -> torch.Tensor:
        """Page ids that are logically free but still held in the space, ascending."""
        self._check_open()
        return torch.from_numpy(np.sort(self._pages.pending))

    def get_all_free_pages(self) -> torch.Tensor:
        """Every page id SGLang does not hold (its free-list census; the pool may not back them all)."""
        self._check_open()
        free = np.flatnonzero(~self._held_mask()[1:]).astype(np.int64) + 1
        return torch.from_numpy(free).to(self.device)

    def _held_mask(self) -> npt.NDArray[np.bool_]:
        return self._pages.held_mask()

    # -- allocation ----------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` token indices (whole pages), or ``None`` when they are not there."""
        self._check_open()
        if isinstance(need_size, bool) or not isinstance(need_size, (int, np.integer)) or need_size < 0:
            raise ValueError(f"need_size must be a non-negative int, got {need_size!r}")
        if need_size % self.page_size:
            raise ValueError(f"need_size ({need_size}) is not a multiple of page_size ({self.page_size}); SGLang "
                             "allocates whole pages here (alloc_extend/alloc_decode fill partial ones)")
        pages = self._take(int(need_size) // self.page_size)
        if pages is None:
            return None
        if self.page_size > 1:
            pages = (pages[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)
        return self._to_device(pages)

    def alloc_extend(self, prefix_lens: IntsLike, prefix_lens_cpu: IntsLike, seq_lens: IntsLike,
                     seq_lens_cpu: IntsLike, last_loc: IntsLike, extend_num_tokens: int,
                     num_new_pages: int | None = None) -> torch.Tensor | None:
        """Slots for extending request ``i`` from ``prefix_lens[i]`` to ``seq_lens[i]`` tokens.

        Tokens first fill the request's last partial page (after
        ``last_loc[i]``, the slot of its last prefix token), then new pages,
        taken in request order. ``None`` (nothing changed) when the new pages
        are not there. Lengths come from the ``*_cpu`` arguments; ``last_loc``
        stays on its device.
        """
        self._check_open()
        pre, seq = host_ints(prefix_lens_cpu, "prefix_lens_cpu"), host_ints(seq_lens_cpu, "seq_lens_cpu")
        if not len(pre) == len(seq) == len(last_loc) == len(prefix_lens) == len(seq_lens):
            raise ValueError(f"batch sizes differ: prefix_lens {len(prefix_lens)}, seq_lens {len(seq_lens)}, "
                             f"last_loc {len(last_loc)}")
        if (pre < 0).any() or (seq < pre).any():
            raise ValueError("alloc_extend needs 0 <= prefix_lens <= seq_lens for every request")
        if int((seq - pre).sum()) != extend_num_tokens:
            raise ValueError(f"extend_num_tokens is {extend_num_tokens} but seq_lens - prefix_lens sum to "
                             f"{int((seq - pre).sum())}")
        return self._extend(pre, seq, last_loc, num_new_pages)

    def alloc_decode(self, seq_lens: IntsLike, seq_lens_cpu: IntsLike, last_loc: IntsLike) -> torch.Tensor | None:
        """One slot per request whose length grows to ``seq_lens[i]``: an extend by one token
        (the slot after ``last_loc[i]``, or the first of a new page); ``None`` as ``alloc_extend``."""
        self._check_open()
        seq = host_ints(seq_lens_cpu, "seq_lens_cpu")
        if not len(seq) == len(last_loc) == len(seq_lens):
            raise ValueError(f"batch sizes differ: seq_lens {len(seq_lens)}, last_loc {len(last_loc)}")
        if (seq < 1).any():
            raise ValueError("alloc_decode needs seq_lens >= 1 (the length after this token)")
        return self._extend(seq - 1, seq, last_loc, None)

    def _extend(self, pre: Ids, seq: Ids, last_loc: IntsLike, num_new_pages: int | None) -> torch.Tensor | None:
        """SGLang's extend layout; only host lengths are read, ``last_loc`` is added on its device.

        Per request: [continue the prefix's partial page][whole new pages][partial new page].
        """
        ps = self.page_size
        ext = seq - pre
        first_new = -(-pre // ps)  # the first page index (within the request) that is new
        new_per_req = -(-seq // ps) - first_new
        need = int(new_per_req.sum())
        if num_new_pages is not None and num_new_pages != need:
            raise ValueError(f"num_new_pages is {num_new_pages} but the lengths need {need} new pages")
        last = last_loc if isinstance(last_loc, torch.Tensor) else torch.as_tensor(np.asarray(last_loc))
        if last.numel() and (last.is_floating_point() or last.is_complex()):
            raise ValueError(f"last_loc must hold integers, got dtype {last.dtype}")
        if self.debug:  # tokens on the prefix's partial page continue after last_loc
            partial = np.minimum(seq, first_new * ps) - pre > 0
            self._check_last_loc(host_ints(last, "last_loc")[partial], pre[partial])
        pages = self._take(need)
        if pages is None:
            return None
        req = np.repeat(np.arange(len(seq)), ext)
        k = np.arange(int(ext.sum()), dtype=np.int64) - (np.cumsum(ext) - ext)[req]  # position in this extend
        pos = pre[req] + k  # position in the request's sequence
        on_new = pos >= first_new[req] * ps
        slot = (np.cumsum(new_per_req) - new_per_req)[req] + pos // ps - first_new[req]
        base = 1 + k  # continuation slots: last_loc[req] + 1 + k, the last_loc part added on the device
        base[on_new] = pages[slot[on_new]] * ps + pos[on_new] % ps
        if on_new.all():
            return self._to_device(base)
        dev = self._to_device(np.stack((base, req, ~on_new)))  # one host-to-device copy
        last = last.to(device=dev.device, dtype=torch.int64)
        return dev[0] + torch.where(dev[2] != 0, last[dev[1]], 0)

    def _check_last_loc(self, last: Ids, pre: Ids) -> None:
        """A partial page is continued only after a held slot at the matching offset (debug)."""
        if not last.size:
            return
        ps = self.page_size
        bad = ((last + 1) % ps != pre % ps) | (last < ps) | (last >= self._pages.state.size * ps)
        if not bad.any():
            bad = ~self._held_mask()[last // ps]
        if bad.any():
            raise ValueError(f"last_loc {last[bad][:8].tolist()} is not a held slot at offset (prefix_len - 1) % "
                             f"page_size of its page for prefix lengths {pre[bad][:8].tolist()}")

    def _take(self, n: int) -> Ids | None:
        """``n`` page ids, all or nothing: pending pages (oldest first), then the space."""
        pages = self._pages.take(n, lambda m: self._alloc_space(m, n))
        if pages is not None:
            self._preempted.reused(pages)
        return pages

    def _alloc_space(self, m: int, n: int) -> Ids | None:
        """``m`` blocks of the space, waiting (``KVSpace.acquire``) when only the pool budget is short."""
        try:
            return self.space.alloc(m)
        except PoolExhausted:
            # SGLang's own allocator misses too when n exceeds the pages it does not hold.
            if n > self.num_pages - int(self._held_mask().sum()):
                return None
        promised = self._gives_back()
        if promised:
            # While giving memory back the pool grants only a promised alloc,
            # and SGLang allocates only what its gates counted: the held
            # pages' free slots (decode_size; best fit fills them first, so
            # no page is committed), or what they counted just before the
            # verdict turned, honoured as vLLM's free count is (ARCHITECTURE.md
            # "Fair share", rule 5) from the pool's free memory. (With none
            # free it waits as any alloc does, up to shortage_wait_s.)
            try:
                return self.space.alloc(m, promised=True)
            except PoolExhausted:
                pass
        if self.shortage_wait_s <= 0:
            return None
        try:
            return self.space.acquire(m, promised=promised, stall=self.shortage_wait_s)
        except PoolExhausted:  # RequestTooLarge included: SGLang's miss
            return None

    # -- free ----------------------------------------------------------------
    def free(self, free_index: IntsLike) -> None:
        """Make the pages of these token indices pending (inside a free group: at its end).

        Raises :class:`kvpool.InvalidBlocks` and frees nothing for a token of
        the padding page, out of range, not allocated (double free) or, at
        ``page_size == 1``, repeated; at ``page_size > 1`` several tokens of
        one page free it once, as in SGLang.
        """
        self._check_open()
        pages = self._page_ids(free_index)
        if pages.size == 0:
            return
        if self.free_group is not None:
            self.free_group.append(pages)
            return
        self._free_pages(pages)

    def free_full(self, free_index: IntsLike) -> None:
        """SGLang's hybrid-SWA hook; a single pool has no SWA peer, so a plain :meth:`free`."""
        self.free(free_index)

    def free_segment(self, free_index: IntsLike, *, start_pos: int) -> None:
        """Free one page-aligned slice of a request's KV row: a :meth:`free`."""
        self.free_segments([(free_index, start_pos)])

    def free_segments(self, segments: Iterable[tuple[IntsLike, int]]) -> None:
        """Several :meth:`free_segment` calls as one :meth:`free` (all or nothing)."""
        parts = [np.empty(0, dtype=np.int64)]
        for free_index, start_pos in segments:
            if start_pos % self.page_size:
                raise ValueError(f"free_segment start {start_pos} is not aligned to page_size {self.page_size}")
            parts.append(host_ints(free_index, "token indices", InvalidBlocks))
        self.free(np.concatenate(parts))

    def free_group_begin(self) -> None:
        """Collect frees until :meth:`free_group_end` (one batch for the group)."""
        self._check_open()
        if self.free_group is not None:
            raise RuntimeError("free groups cannot be nested: call free_group_end() first")
        self.free_group = []

    def free_group_end(self) -> None:
        """Apply the group's frees as one batch; pages touched by several calls are freed once
        (``page_size > 1``, as SGLang's ``free(torch.cat(group))``).

        A bad id raises :class:`kvpool.InvalidBlocks` and changes nothing: the
        group stays open with its frees, so none of the good ones is lost.
        """
        if not self.free_group:
            self.free_group = None
            return
        self._check_open()
        self._free_pages(self._unique(np.concatenate(self.free_group), "by two calls of one free group"))
        self.free_group = None

    def _page_ids(self, free_index: IntsLike) -> Ids:
        """Validated unique page ids of a batch of token indices."""
        tokens = host_ints(free_index, "token indices", InvalidBlocks)
        if tokens.size == 0:
            return tokens
        ps, end = self.page_size, self._pages.state.size * self.page_size
        bad = (tokens < ps) | (tokens >= end)
        if bad.any():
            raise InvalidBlocks(f"token indices {tokens[bad][:8].tolist()} are outside [{ps}, {end}) (page 0 is "
                                "SGLang's padding page)", tokens[bad][:8].tolist())
        return self._unique(tokens // ps, "twice in one batch")

    def _unique(self, pages: Ids, how: str) -> Ids:
        """Unique page ids; at ``page_size == 1`` a repeat is a double free (SGLang's token
        allocator would put the slot in its free list twice)."""
        unique = np.unique(pages)
        if self.page_size == 1 and unique.size != pages.size:
            vals, counts = np.unique(pages, return_counts=True)
            twice = vals[counts > 1][:8].tolist()
            raise InvalidBlocks(f"token indices {twice} are freed {how}; nothing was freed", twice)
        return unique

    def _free_pages(self, pages: Ids) -> None:
        """Make unique pages SGLang holds pending (kept, if held at the live backup)."""
        self._pages.free(pages)
        self._preempted.freed(pages)

    # -- backup / restore ------------------------------------------------------
    def backup_state(self) -> AllocatorState:
        """Snapshot the allocation for one :meth:`restore_state`; ends an earlier backup."""
        self._check_open()
        return AllocatorState(self._uid, self._pages.backup())

    def restore_state(self, state: AllocatorState) -> None:
        """Put back exactly the pages held at ``state``'s backup, and end it.

        Pages allocated since become pending (in the space until the second
        :meth:`flush`: EAGLE writes draft KV into them next), pages freed since
        are held again. ``ValueError`` (nothing changed) for a state that is
        not this allocator's live backup, e.g. one restored already.
        """
        self._check_open()
        if not isinstance(state, AllocatorState) or state.owner != self._uid:
            raise ValueError(f"{state!r} is not a backup of this allocator")
        self._preempted.reused(self._pages.restore(state.generation))  # held again: no longer on their way back

    # -- safe points -------------------------------------------------------------
    def flush(self) -> int:
        """A safe point: call at the end of every scheduler loop iteration, idle or not.

        Gives the space the pages already pending at the previous flush (one
        step after their free) and ends a live backup; returns how many.
        """
        self._check_open()
        return self._pages.flush(self._preempted.give_back)

    def clear(self) -> None:
        """Return every page to the space now; drop the free group and any backup."""
        self._check_open()
        self._pages.clear(self._preempted.give_back)
        self.free_group = None

    # -- preemption (SGLang's retraction) ------------------------------------------
    def begin_preemption(self) -> None:
        """The frees until :meth:`end_preemption` are a retraction (the plugin wraps
        ``ScheduleBatch.retract_decode``)."""
        self._check_open()
        self._preempted.begin(int(self._pages.pending.size))

    def end_preemption(self, requests: int, tokens: int) -> None:
        """The frees since :meth:`begin_preemption` retracted ``requests`` requests (``tokens`` to
        recompute): their pages reach the space as a preemption (:meth:`kvpool.KVSpace.free_preempted`)."""
        self._check_open()
        for what, v in (("requests", requests), ("tokens", tokens)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{what} must be a non-negative int, got {v!r}")
        self._preempted.end(self._pages.pending, int(requests), int(tokens))

    def token_view(self, layer: int, buffer: int, token_shape: Sequence[int]) -> torch.Tensor:
        """Layer ``layer``'s KV buffer ``buffer`` indexed by token: ``(tokens, *token_shape)``.

        Zero-copy over the space (per-layer layout), so a KV cache built on
        these views commits memory only for pages SGLang holds.
        """
        return token_view(self.space, layer, buffer, self.dtype, self.page_size, token_shape)

    # -- helpers and lifecycle ---------------------------------------------------
    def _to_device(self, ids: Ids) -> torch.Tensor:
        return torch.from_numpy(ids).to(self.device)

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
        return (f"<KVPoolTokenAllocator {int(self._held_mask().sum())}/{self.num_pages} pages of "
                f"{self.page_size} tokens held, {self._pages.pending.size} pending, {self.space!r}>")
