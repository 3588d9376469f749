"""An elastic replacement for vLLM's ``BlockPool`` (scheduler side).

vLLM's scheduler sees the engine's whole *virtual* capacity as block ids
(``num_gpu_blocks``); kvpool decides which of them are backed by memory.
Block id ``i`` in vLLM is block ``i`` of the kvpool space, so the worker's
tensors need no translation. Every vLLM block is in one of three states::

    kvpool-free   not held in the space; ref_cnt 0, no hash, in vLLM's free
                  queue (vLLM may count it, only the space can hand it out)
    in use        held; ref_cnt > 0
    evictable     held; ref_cnt 0 and still readable: a prefix-cached block
                  (or one released with ``unpin_blocks``) waiting in vLLM's
                  free queue for a cache hit

Why this shape:

* vLLM keeps every structure it already has (block objects, the free queue,
  the prefix-cache map), so cache hits, events and metrics behave as before;
  only *which* ids come out of ``get_new_blocks`` changes: the space picks
  them best-fit by page, so used blocks pack into few committed pages.
* ``get_num_free_blocks`` is what the space can deliver now (pool budget and
  limit included) plus the evictable blocks, capped by vLLM's own count.
  ``KVCacheManager.allocate_slots`` compares against it and returns ``None``
  on a shortage: the scheduler's own "cannot schedule now", so it preempts
  and retries instead of failing.
* A shortage in the space evicts evictable blocks, least recently freed
  first (any freed slot sits in a committed page and is reusable at once, so
  LRU order loses no memory). When the *pool* needs memory back (another
  tenant is waiting, or an operator lowered this engine's limit below what
  it holds), cached blocks are reclaimed by whole pages, oldest page first,
  so the pages can really be released. That is checked at the start of each
  scheduler step and, while a server's engine idles, from its idle loop:
  both on the engine's thread (vLLM's structures are not thread-safe) and
  never between a prefix-cache lookup and the touch that takes the hit.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvpool import KVSpace, PoolExhausted

from vllm.v1.core.block_pool import BlockPool

# How long get_new_blocks waits when another tenant took the budget between
# vLLM's free-block check and the allocation (a narrow race), before failing.
SHORTAGE_WAIT_S = 30.0
# How often the scheduler's calls look at the pool for pressure.
PRESSURE_CHECK_S = 0.05
# Pages reclaimed per pressure check: gives memory back in steps, keeps most
# of the cache while other tenants need only a little.
RECLAIM_PAGES_PER_CHECK = 4


class KVPoolShortage(ValueError):
    """The space could not deliver blocks vLLM was told were free (a race)."""


class KVPoolBlockPool(BlockPool):  # type: ignore[misc]
    """vLLM's ``BlockPool`` contract over a kvpool :class:`~kvpool.KVSpace`."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int, *args: Any,
                 space: KVSpace, **kwargs: Any) -> None:
        if not isinstance(space, KVSpace):
            raise TypeError(f"space must be a kvpool.KVSpace, got {type(space).__name__}")
        if space.geometry.num_blocks != num_gpu_blocks:
            raise ValueError(
                f"the KV space has {space.geometry.num_blocks} blocks but vLLM asked for {num_gpu_blocks}")
        if not space.null_block:
            raise ValueError("the KV space must hold block 0 as vLLM's null block (null_block=True)")
        super().__init__(num_gpu_blocks, enable_caching, hash_block_size, *args, **kwargs)
        self.space = space
        # Held blocks with ref_cnt 0, oldest first (dict order = LRU).
        self._evictable: dict[int, Any] = {}
        self._next_pressure_check = 0.0
        g = space.geometry
        self._block_bytes = g.region_block_bytes
        self._page_bytes = g.page_bytes
        self._blocks_per_page = max(1, g.page_bytes // g.region_block_bytes)
        self._reported_waiting = 0
        self._virtual_count = False

    # -- what vLLM asks ---------------------------------------------------------
    # No method here reclaims: vLLM looks up prefix-cache hits (ref 0) and
    # touches them later in the same allocate_slots, calling this pool (and
    # free_blocks, for skipped blocks) in between. Reclaiming there could drop
    # a hit before it is touched; pressure is handled at step start instead.
    def get_num_free_blocks(self) -> int:
        queued = int(self.free_block_queue.num_free_blocks)
        if self._virtual_count:
            return queued
        return min(queued, self.space.available() + len(self._evictable))

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        if num_blocks <= 0:
            return []
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool "
                             f"({self.free_block_queue.num_free_blocks} free)")
        # vLLM checked get_num_free_blocks; if another tenant took the budget
        # since, _alloc_ids waits for it rather than failing the step.
        ids = self._alloc_ids(num_blocks)
        all_blocks = self.blocks
        blocks = [all_blocks[i] for i in ids.tolist()]
        for block in blocks:
            self.free_block_queue.remove(block)
        if self._reuse_watchers:
            self._notify_reuse(blocks)
        for block in blocks:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt += 1
            if self.metrics_collector:
                self.metrics_collector.on_block_allocated(block)
        return blocks

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        ordered = list(ordered_blocks)
        super().free_blocks(ordered)
        release: list[int] = []
        caching, evictable, watchers = self.enable_caching, self._evictable, self._reuse_watchers
        for block in ordered:
            if block.ref_cnt != 0 or block.is_null or (block.pool is not None and block.pool is not self):
                continue
            bid = block.block_id
            if caching and block.block_hash is not None:
                evictable.pop(bid, None)
                evictable[bid] = block  # most recent at the end
            elif bid in watchers:
                evictable[bid] = block  # unpinned: readable until reused
            elif bid not in evictable:
                release.append(bid)
        if release:
            # A block listed twice in one call reached ref 0 once: dedupe.
            self.space.free(np.array(list(dict.fromkeys(release)), dtype=np.int64))
        if self._reported_waiting and self.free_block_queue.num_free_blocks == self.num_gpu_blocks - 1:
            # Nothing in use any more: an offline engine may never call again,
            # so it must not leave "waiting" behind in the ledger.
            self._report_waiting(0)

    def touch(self, blocks: Any) -> None:
        super().touch(blocks)
        for block in blocks:
            if block.ref_cnt > 0:
                self._evictable.pop(block.block_id, None)

    def unpin_blocks(self, blocks: Iterable[Any], on_reuse: Any) -> None:
        blocks = list(blocks)
        super().unpin_blocks(blocks, on_reuse)
        for block in blocks:
            if block.ref_cnt == 0:
                self._evictable.pop(block.block_id, None)
                self._evictable[block.block_id] = block  # readable until reused

    def evict_blocks(self, block_ids: set[int]) -> None:
        super().evict_blocks(block_ids)
        dropped = [self._evictable[i] for i in block_ids
                   if i in self._evictable and self._evictable[i].block_hash is None
                   and i not in self._reuse_watchers]
        self._release_evictable(dropped)

    def reset_prefix_cache(self) -> bool:
        # vLLM's check ("every block but the null one is free") must count
        # virtual blocks: the pool may not back them all right now.
        self._virtual_count = True
        try:
            if not super().reset_prefix_cache():
                return False
        finally:
            self._virtual_count = False
        self._release_evictable(list(self._evictable.values()))
        return True

    def on_step(self) -> None:
        """Called at the start of each scheduler step (the engine's thread, no
        prefix-cache lookup pending): give cached pages back if the pool
        wants memory, and tell it whether this engine is short."""
        self._maybe_reclaim()

    def on_idle(self) -> None:
        """Called by the engine core while it has no requests (its own thread):
        give cached pages back if the pool wants memory."""
        self._maybe_reclaim(idle=True)

    # -- kvpool side -----------------------------------------------------------
    def _alloc_ids(self, n: int) -> Any:
        deadline, waited = time.monotonic() + SHORTAGE_WAIT_S, False
        while True:
            try:
                ids = self.space.alloc(n)
                if waited:
                    self._report_waiting(0)
                return ids
            except PoolExhausted as e:
                if self._evictable:
                    short = max(1, n - e.available)
                    self._release_evictable(list(self._evictable.values())[:short])
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVPoolShortage(
                        f"kvpool: {n} blocks were free when vLLM checked but the pool has had only "
                        f"{e.available} for {SHORTAGE_WAIT_S:.0f} s (another tenant took the budget)") from e
                # Another tenant took the budget after vLLM's check: wait for
                # memory to come back rather than fail the step (and say so,
                # so engines holding cached pages give them up).
                self._report_waiting(1)
                waited = True
                self.space.wait_for_capacity(min(left, 0.05))

    def _report_waiting(self, waiting: int) -> None:
        """Tell the pool, on a change only (the ledger is shared memory)."""
        if waiting != self._reported_waiting and self.space.pool is not None:
            self.space.report_waiting(waiting)
            self._reported_waiting = waiting

    def _release_evictable(self, blocks: list[Any]) -> None:
        """Drop cached contents and give the blocks back to the space."""
        if not blocks:
            return
        if self._reuse_watchers:
            self._notify_reuse([b for b in blocks if b.block_id in self._reuse_watchers])
        ids = np.empty(len(blocks), dtype=np.int64)
        for k, block in enumerate(blocks):
            self._evictable.pop(block.block_id)
            self._maybe_evict_cached_block(block)
            ids[k] = block.block_id
        self.space.free(ids)

    def _maybe_reclaim(self, idle: bool = False) -> None:
        if self._evictable:
            # Unthrottled: over its limit an engine's cached pages cannot be
            # recommitted, so they must not stay counted as free.
            self.reclaim_pages(self._pages_over_limit())
        now = time.monotonic()
        if now < self._next_pressure_check:
            return
        self._next_pressure_check = now + PRESSURE_CHECK_S
        # vLLM never says it is waiting (a shortage is a None it handles
        # itself), so tell the pool when this engine is at its edge: less
        # than a page of room and nothing of its own left to evict.
        # An idle engine wants nothing.
        starving = 0 if idle else int(self.space.available() + len(self._evictable) < self._blocks_per_page)
        self._report_waiting(starving)
        if self._evictable and self._another_tenant_waits():
            self.reclaim_pages(RECLAIM_PAGES_PER_CHECK)

    def _pages_over_limit(self) -> int:
        """Pages this engine holds beyond its limit (the space's or the pool's)."""
        st = self.space.stats()  # one native call
        if st.limit_pages < 0:
            return 0
        return max(0, st.committed_bytes // st.page_commit_bytes - st.limit_pages)

    def _another_tenant_waits(self) -> bool:
        pool = self.space.pool
        me = self.space.name
        return pool is not None and any(t.waiting > 0 for t in pool.tenants() if t.name != me)

    def reclaim_pages(self, max_pages: int) -> int:
        """Evict the cached blocks of up to ``max_pages`` pages that hold
        nothing else, oldest first, so the space can release them; returns
        the number of pages emptied."""
        if max_pages <= 0 or not self._evictable:
            return 0
        per_page: dict[int, list[Any]] = {}
        for block in self._evictable.values():  # oldest first
            per_page.setdefault(block.block_id * self._block_bytes // self._page_bytes, []).append(block)
        used = {p.page: p.used for p in self.space.page_occupancy(list(per_page))}
        whole = [blocks for page, blocks in per_page.items() if used.get(page) == len(blocks)]
        victims = [b for blocks in whole[:max_pages] for b in blocks]
        self._release_evictable(victims)
        return min(len(whole), max_pages)

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks held for the prefix cache (or unpinned readers) right now."""
        return len(self._evictable)
