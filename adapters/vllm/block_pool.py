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

* vLLM keeps its block objects, prefix-cache map, events and metrics, and
  its own ``get_new_blocks`` / ``free_blocks`` / ``touch`` / ``unpin_blocks``
  run unchanged. Only the free block queue they call is kvpool's
  (:class:`_SpaceFreeQueue`): the space hands out ids best-fit by page (used
  blocks pack into few committed pages) and answers vLLM's block objects in
  one native call per batch; freed blocks go back in one native call.
* ``get_num_free_blocks`` is what the space can deliver now (pool budget and
  limit included) plus the evictable blocks, capped by vLLM's own count.
  ``KVCacheManager.allocate_slots`` compares against it and returns ``None``
  on a shortage: the scheduler's own "cannot schedule now", so it preempts
  and retries instead of failing.
* A shortage in the space evicts evictable blocks, least recently freed
  first (any freed slot sits in a committed page and is reusable at once, so
  LRU order loses no memory).
* Fair share (ARCHITECTURE.md): the space's budget is the one judge of whether
  this engine must give memory back. It is read once per scheduler step
  (``on_step``), from a server's idle loop (``on_idle``) and when an
  allocation misses, never per block op. While the budget says ``lending``
  (this engine borrows above its guarantee and a tenant below its own
  waits), the engine

    1. gives whole cached pages back, oldest first, as many as the waiting
       tenants want (the space releases emptied pages at once);
    2. stops admitting: a request that is not running (new, or preempted
       before) is answered 0 by ``get_num_free_blocks``, so vLLM's
       ``allocate_slots`` returns ``None`` (its own "cannot schedule now")
       and the waiting queue stays where it is;
    3. lets its running requests finish (rule 8, reclaim by completion
       first): a running request may still grow into free blocks of the
       pages this engine already holds (:meth:`_room_in_held_pages`; never a
       new page: the pool's free memory is the waiter's), so the memory
       comes back as they complete;
    4. preempts only on the verdict: each step it publishes ``freeing`` (the
       pages its running requests that finish within ``_reclaim.RECLAIM_STEPS``
       free, :meth:`_freeing`) and reads ``preempt_bytes``; only when that
       is > 0 does :meth:`on_step` name victims, about that much, the
       cheapest to recompute first (:meth:`_victims`), which the scheduler
       hook preempts through vLLM's own ``_preempt_request``. Their blocks go
       back through :meth:`preempting`, counted as reclaimed by preemption in
       the tenant's slot (``kvpool top``); any other preemption vLLM makes
       (a running request with no room left in its pages) is counted the
       same way.

  The same step check gives back whole cached pages above a lowered limit.
  Reclaiming happens only at those points: on the engine's thread (vLLM's
  structures are not thread-safe) and never between a prefix-cache lookup
  and the touch that takes the hit.
* The other direction: vLLM never says it waits (a shortage is a ``None``
  it handles itself), so at each step the engine reports one waiting
  request to the pool while its scheduler has requests queued and either
  less than a page of room is left or vLLM's last step could not allocate
  (``allocate_slots`` answered ``None``: a request needs more blocks than
  the free count, however many that is, see :meth:`note_miss`); below its
  guarantee that makes borrowers lend.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import numpy as np

from kvpool import BudgetStats, KVSpace, PoolExhausted, RequestTooLarge
from kvpool.block_queue import FreeQueue, raise_alloc_failure
from kvpool.tracing import get_logger

from .._reclaim import Reclaim, Running

from vllm.v1.core.block_pool import BlockPool

# When another tenant's claim took the pool's free memory between vLLM's
# free-block check and the allocation (a race a promise cannot win: the
# memory is gone), get_new_blocks waits in KVSpace.acquire for it to come
# back, for as long as the other tenants make progress; it fails only once
# none has for this long (a stopped or hung peer holds the memory).
STALL_S = 30.0
# Pages given back per step above a lowered limit, or (at least) while lending.
RECLAIM_PAGES_PER_CHECK = 4
class _SpaceFreeQueue(FreeQueue):
    """vLLM's free block queue, kept by the space: what vLLM's own
    ``BlockPool`` methods (``get_new_blocks``, ``free_blocks``, ``touch``,
    ``unpin_blocks``) call on ``free_block_queue``, with the native allocator
    in place of vLLM's linked list.

    The hot half is native (:class:`kvpool.block_queue.FreeQueue`):
    ``popleft_n`` answers vLLM's block objects from one native alloc,
    ``prepend_n`` frees them in one native call, ``append_n`` holds cached
    blocks as evictable, and the counters vLLM and the
    plugin share (``num_free_blocks``, ``promised``, ``lending``...) live
    there. Off its common case it calls back into the plugin
    (``KVPoolBlockPool._take_short``, :meth:`_keep_readable`,
    ``_report_waiting``). The rest is here.

    vLLM's free queue has two ends: blocks freed without a cache hash go to
    the head (reused first), cached ones and unpinned ones to the tail (LRU
    eviction). Here the head is the space itself (the blocks go back to it,
    and it hands out ids best-fit by page) and the tail is ``evictable``
    (held blocks, oldest first). ``num_free_blocks`` is vLLM's own figure:
    both ends together, the virtual count (the plugin's
    ``get_num_free_blocks`` says what the pool can back).

    Only the methods vLLM 0.32 calls exist: a vLLM that calls another fails
    loudly here instead of handing out wrong ids."""

    def __init__(self, pool: KVPoolBlockPool) -> None:
        super().__init__(pool.space, pool.blocks, pool._reuse_watchers, pool,
                         checked_get_new=KVPoolBlockPool._get_new_blocks_slow, host_get_new=BlockPool.get_new_blocks,
                         take_short=pool._take_short, report_waiting=pool._report_waiting,
                         keep_readable=self._keep_readable, id_attr="block_id",
                         total=pool.num_gpu_blocks - 1)  # every block but vLLM's null block
        self._pool = pool

    def _keep_readable(self, blocks: list[Any]) -> list[Any]:
        """Unpinned blocks (a reuse watcher waits on them) go to the tail;
        returns the others."""
        watchers, evictable = self._pool._reuse_watchers, self.evictable
        rest = []
        for b in blocks:
            if b.block_id in watchers:
                evictable[b.block_id] = b
                self.num_free_blocks += 1
            else:
                rest.append(b)
        return rest

    def remove(self, block: Any) -> None:
        """A prefix-cache hit on a block at ref 0 (``touch``): in use again."""
        if self.evictable.pop(block.block_id, None) is None:
            raise AssertionError(f"kvpool: block {block.block_id} touched at ref 0 but not held as evictable")
        self.num_free_blocks -= 1

    def get_all_free_blocks(self) -> list[Any]:
        """Every block vLLM counts as free: the space's, then the tail (LRU)."""
        held = self.evictable
        return [b for b in self._pool.blocks[1:] if b.ref_cnt == 0 and b.block_id not in held] + list(
            held.values())


class KVPoolBlockPool(BlockPool):  # type: ignore[misc]
    """vLLM's ``BlockPool`` contract over a kvpool :class:`~kvpool.KVSpace`."""

    free_block_queue: Any  # a _SpaceFreeQueue

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
        # vLLM built its linked list (and took block 0 from it as the null
        # block); the space is the free queue from here on.
        for block in self.blocks:
            block.prev_free_block = block.next_free_block = None
        queue = self.free_block_queue = _SpaceFreeQueue(self)
        self._evictable = queue.evictable
        g = space.geometry
        self._page_commit_bytes = g.page_commit_bytes
        # Less room than a page holds on average: "at the edge" (see on_step).
        self._blocks_per_page = max(1, math.ceil(g.capacity / g.num_pages))
        self._missed = False  # vLLM could not allocate since the last step check
        # The budget's lending verdict as last read (once per step, or on a
        # shortage) is the queue's ``lending``: the free count answers from it
        # without reading the budget.
        self._lend_pages = 0  # cached pages given back in this lending episode
        # Reclaim by completion first (rule 8). While lending, a running
        # request's allocate_slots runs with _growing set (the scheduler
        # hook): the free count is then _room, the free blocks of the pages
        # this engine holds (None: not read since the last step or
        # preemption), never the pool's.
        self._growing = False
        self._room: int | None = None
        self._freeing_published = 0
        self._page_first = np.asarray(space.geometry._ranges[0], dtype=np.int64)  # first block of each page
        self._reclaim = Reclaim(self._page_first, self._page_commit_bytes)  # what completes, whom to preempt
        self._log = get_logger(pool=space.pool.name if space.pool else None, tenant=space.name)

    # -- what vLLM asks ---------------------------------------------------------
    # No method here reclaims: vLLM looks up prefix-cache hits (ref 0) and
    # touches them later in the same allocate_slots, calling this pool (and
    # free_blocks, for skipped blocks) in between. Reclaiming there could drop
    # a hit before it is touched; the budget is acted on at step start instead.
    def get_num_free_blocks(self) -> int:
        # What the space can deliver now plus the evictable blocks, capped by
        # vLLM's own count. A lender answers 0: it does not grow, not even
        # into its own cache, so vLLM sees a full cache and preempts, as it
        # would with no memory left. vLLM allocates right after this answer,
        # trusting it: what it was told it gets, even if the budget starts
        # lending in between (issue 14; the queue's ``promised``). One
        # implementation: the queue's native count.
        queue = self.free_block_queue
        if self._growing and queue.lending and not queue.virtual_count:
            return self._growth_count()
        return queue.get_num_free_blocks()  # type: ignore[no-any-return]

    def _growth_count(self) -> int:
        """A lender's free count for a running request: what its held pages
        still have free. Promised like any count (the space grants a promised
        alloc while lending), and exact: a promise the held pages cannot keep
        would take a new page from the pool, the waiter's memory."""
        queue = self.free_block_queue
        if self._room is None:
            self._room = self._room_in_held_pages()
        free = min(self._room, int(queue.num_free_blocks))
        queue.promised = free
        return free

    def _room_in_held_pages(self) -> int:
        """Free blocks on this engine's ACTIVE pages (what a grant fills
        without committing a page): the space's own count, one native call,
        only while lending: at most once per step and once per preemption."""
        return self.space.stats().room_blocks

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        # vLLM's contract: beyond the free count is a ValueError. The count
        # vLLM last read stands even if a fresh one would say less (issue 14).
        # One implementation: the queue's native get_new_blocks runs the case
        # that count (or vLLM's own, while not lending) covers, and calls
        # _get_new_blocks_slow for the rest.
        return self.free_block_queue.get_new_blocks(num_blocks)  # type: ignore[no-any-return]

    def _get_new_blocks_slow(self, num_blocks: Any) -> list[Any]:
        """``get_new_blocks`` past the queue's covered case: an argument that is
        not a plain int (made one, then asked again), or blocks beyond the last
        count. The space is asked first (a fresh count: a grant means it would
        have covered them); only a refusal is vLLM's ValueError."""
        if type(num_blocks) is not int:
            return self.free_block_queue.get_new_blocks(operator.index(num_blocks))  # type: ignore[no-any-return]
        queue = self.free_block_queue
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool ({queue.promised} free)")
        # vLLM's own get_new_blocks does the rest (reuse callbacks, cache
        # eviction, ref counts, metrics) over the blocks the space chose
        # (_SpaceFreeQueue.popleft_n); its own free-count check reads the
        # virtual count, as the promise above already stands.
        virtual, queue.virtual_count = queue.virtual_count, True
        try:
            return super().get_new_blocks(num_blocks)  # type: ignore[no-any-return]
        finally:
            queue.virtual_count = virtual

    def get_usage(self) -> float:
        # vLLM's "KV cache usage": blocks in use over what this engine can use
        # now (in use + the free count), not over its virtual capacity. Stock
        # vLLM's 1 - free / total read 92-95% on an idle engine whose pool
        # backs a fraction of the virtual blocks.
        queue = self.free_block_queue
        queued = int(queue.num_free_blocks)
        in_use = self.num_gpu_blocks - 1 - queued
        if queue.virtual_count:
            usable = in_use + queued
        elif queue.lending:
            usable = in_use
        else:
            usable = in_use + min(queued, self.space.available() + len(self._evictable))
        return in_use / usable if usable else (1.0 if queue.lending else 0.0)

    def physical(self) -> dict[str, int]:
        """What the space really holds and what the pool can back (the
        figures the plugin logs beside vLLM's virtual ones)."""
        st = self.space.stats()
        g = self.space.geometry
        return {"committed_bytes": st.committed_bytes, "used_blocks": st.used_blocks,
                "available_blocks": st.available, "max_blocks": st.max_blocks,
                "virtual_blocks": g.capacity - 1, "bytes_per_block": g.region_block_bytes * g.num_regions}

    def evict_blocks(self, block_ids: set[int]) -> None:
        super().evict_blocks(block_ids)
        dropped = [self._evictable[i] for i in block_ids
                   if i in self._evictable and self._evictable[i].block_hash is None
                   and i not in self._reuse_watchers]
        self._release_evictable(dropped, cached=True)  # vLLM just dropped their hashes

    def reset_prefix_cache(self) -> bool:
        # vLLM's check ("every block but the null one is free") must count
        # virtual blocks: the pool may not back them all right now.
        queue = self.free_block_queue
        virtual, queue.virtual_count = queue.virtual_count, True
        was_cached = {i for i, b in self._evictable.items() if b.block_hash is not None}  # the reset drops hashes
        try:
            if not super().reset_prefix_cache():
                return False
        finally:
            queue.virtual_count = virtual
        blocks = list(self._evictable.values())
        self._release_evictable(blocks, cached=[b.block_id in was_cached for b in blocks])
        return True

    def on_step(self, num_waiting: int | None = None,
                running: Callable[[], Sequence[Running]] | None = None) -> list[Any]:
        """Called at the start of each scheduler step (the engine's thread, no
        prefix-cache lookup pending) with the number of requests vLLM has
        queued (``None``: unknown, taken as some) and a reader of its running
        requests (called only while this engine lends): act on the
        budget's verdict, publish what completes within the bound, and tell
        the pool whether this engine is short. Returns the requests to
        preempt now (vLLM's, cheapest first; empty unless the verdict's
        ``preempt_bytes`` > 0)."""
        return self._check_budget(num_waiting, running)

    def note_miss(self) -> None:
        """vLLM's ``allocate_slots`` answered ``None`` (the free count did not
        cover a request): with requests queued at the next step, this engine
        waits for memory, even if more than a page of room is left (a
        300-token prompt needs more than one page of blocks)."""
        self._missed = True

    def on_idle(self) -> None:
        """Called by the engine core while it has no requests (its own thread):
        give cached pages back if the budget says so."""
        self._check_budget(0, None)

    @contextmanager
    def preempting(self, request: Any) -> Iterator[None]:
        """Around vLLM's ``_preempt_request(request)``: the blocks it frees go
        back as a preemption (``KVSpace.free_preempted``: requests preempted,
        tokens to recompute, bytes reclaimed by preemption in the tenant's
        slot) instead of the queue's plain free. Blocks that stay cached
        (prefix caching) are held as usual and counted when given back."""
        queue = self.free_block_queue
        tokens = max(0, int(request.num_computed_tokens))  # vLLM zeroes it
        freed: list[Any] = []
        # vLLM's free_blocks calls free_block_queue.prepend_n: collect them
        # (an instance attribute shadows the native method for this call only).
        queue.prepend_n = freed.extend
        try:
            yield
        finally:
            del queue.prepend_n
            if self._reuse_watchers:
                freed = queue._keep_readable(freed)
            if freed:
                ids = np.fromiter((b.block_id for b in freed), dtype=np.int64, count=len(freed))
                self.space.free_preempted(ids, requests=1, tokens=tokens)
                queue.num_free_blocks += len(freed)
            queue.note_if_idle()
            self._room = None  # the freed slots of pages still held are room again

    @property
    def lending(self) -> bool:
        """The budget's lending verdict as this engine last acted on it."""
        return bool(self.free_block_queue.lending)

    @property
    def _lending(self) -> bool:
        return bool(self.free_block_queue.lending)

    # -- kvpool side -----------------------------------------------------------
    def _take_short(self, n: int, promised: bool, failure: Any) -> list[Any]:
        """``popleft_n`` off its fast path: a grant while this engine lends
        (the budget is read again), or a refusal: the space could not deliver
        all ``n``, so reuse cached blocks (oldest first) for what it lacks, or
        wait for another tenant's memory."""
        queue = self.free_block_queue
        if type(failure) is list:  # granted (as promised) while lending
            return self._granted(n, failure)
        if not promised:
            # Asked beyond the last count: now the count decides (vLLM's
            # ValueError, nothing changed), and covers the request if it can.
            virtual, queue.virtual_count = queue.virtual_count, False  # (inside vLLM's get_new_blocks)
            try:
                free = self.get_num_free_blocks()
            finally:
                queue.virtual_count = virtual
            if n > free:
                raise ValueError(f"Cannot get {n} free blocks from the pool ({free} free)")
            promised = True
        # A shortage: the one other moment the budget is read.
        self._set_lending(self.space.budget())
        try:
            raise_alloc_failure(failure, n)  # raises; RequestTooLarge (admission, or a limit lowered since the
        except RequestTooLarge:       # count) is never grantable: waiting cannot help
            raise
        except PoolExhausted as e:
            short_of = e
        evictable = self._evictable
        while evictable:
            # Cached blocks go back to the space, oldest first, and the whole
            # request is asked again: at least one per round (the space's
            # figure of what it lacks is a hint, not a promise), all of them
            # if this engine lends.
            short = len(evictable) if self._lending else max(1, n - short_of.available)
            self._release_evictable(list(itertools.islice(evictable.values(), short)))
            try:
                return self._granted(n, self.space.acquire(n, items=cast(list[Any], self.blocks), promised=promised, timeout=0))
            except PoolExhausted as e:
                if isinstance(e, RequestTooLarge):
                    raise
                short_of = e
        # Nothing of its own left to give: another tenant's claim took the
        # pool's free bytes after vLLM's check (a promise cannot outbid
        # physical memory). Wait for memory to come back rather than fail
        # the step; the space reports the wait, so borrowers lend if this
        # engine is below its guarantee.
        self._log.warning("vllm shortage after free count", requested=n, lending=self._lending,
                          available=self.space.available())
        return self._granted(n, self.space.acquire(n, items=cast(list[Any], self.blocks), promised=promised, stall=STALL_S))

    def _granted(self, n: int, blocks: list[Any]) -> list[Any]:
        queue = self.free_block_queue
        queue.promised = max(0, queue.promised - n)
        if self._growing and self._room is not None:
            self._room = max(0, self._room - n)
        if self._lending:  # granted: the space may no longer lend
            self._set_lending(self.space.budget())
        return blocks

    def _check_budget(self, num_waiting: int | None,
                      running: Callable[[], Sequence[Running]] | None) -> list[Any]:
        """Once per step: read the budget, give back what it asks for, publish
        what completes within the bound, report want; the victims to preempt."""
        self.free_block_queue.promised = 0  # a free count promises blocks to its own step only
        self._room = None
        b = self.space.budget()  # one native call
        self._set_lending(b)
        live: Sequence[Running] = ()
        # Only a lender's freeing is read (the verdict counts it up to what
        # it borrows, while someone below its guarantee waits): the others
        # publish 0 and skip the walk, which costs a pass over the running
        # requests' blocks each step.
        if running is not None and b.lending and self.space.pool is not None:
            live = running()
            freeing = self._reclaim.freeing(live)
            if freeing != self._freeing_published:
                self.space.publish_freeing(freeing)
                self._freeing_published = freeing
                b = self.space.budget()  # the verdict counts it
                self._set_lending(b)
        elif self._freeing_published and self.space.pool is not None:
            self.space.publish_freeing(0)
            self._freeing_published = 0
        if self._evictable:
            # Unthrottled: over its limit an engine's cached pages cannot be
            # recommitted, so they must not stay counted as free.
            self.reclaim_pages(self._pages_over_limit(b))
            if self._lending:
                self._lend_pages += self.reclaim_pages(self._pages_to_lend(b))
        # At the edge (less than a page of room, nothing of its own left to
        # evict) with requests queued: this engine waits for memory. An idle
        # engine wants nothing.
        queued = 1 if num_waiting is None else num_waiting
        missed, self._missed = self._missed, False
        short = queued > 0 and (missed or self.space.available() + len(self._evictable) < self._blocks_per_page)
        self._report_waiting(int(short))
        if not (b.lending and b.preempt_bytes > 0 and live):
            return []
        victims = self._reclaim.victims(live, b.preempt_bytes)
        self._log.info("vllm preempt", preempt_bytes=b.preempt_bytes, freeing_bytes=b.freeing_bytes,
                       requests=len(victims), tokens=sum(v.computed for v in victims),
                       running=len(live))
        return [v.request for v in victims]

    def _set_lending(self, b: BudgetStats) -> None:
        queue = self.free_block_queue
        if b.lending == queue.lending:
            return
        queue.lending = b.lending
        if b.lending:
            self._lend_pages = queue.lend_refusals = 0
            self._log.info("vllm lend", borrowed_bytes=b.borrowed_bytes, guarantee_bytes=b.guarantee_bytes,
                           claimed_bytes=b.claimed_bytes, cached_blocks=len(self._evictable))
        else:
            self._log.info("vllm lend end", pages_given_back=self._lend_pages, free_counts_refused=queue.lend_refusals,
                           claimed_bytes=b.claimed_bytes, guarantee_bytes=b.guarantee_bytes)

    def _pages_over_limit(self, b: BudgetStats) -> int:
        """Pages this engine holds beyond the limit in force."""
        if b.limit_bytes is None:
            return 0
        pcb = self._page_commit_bytes
        return max(0, b.claimed_bytes // pcb - b.limit_bytes // pcb)

    def _pages_to_lend(self, b: BudgetStats) -> int:
        """Cached pages to give back now: what the tenants waiting below their
        guarantees still want (at least one page, so each step makes
        progress), never more than this engine borrows."""
        pcb = self._page_commit_bytes
        borrowed = math.ceil(b.borrowed_bytes / pcb)
        if borrowed <= 0 or self.space.pool is None:
            return 0
        me, wanted = self.space.name, 0
        for t in self.space.pool.snapshot().tenants:  # one ledger read, while lending only
            if t.name != me and t.want_bytes > 0 and t.committed_bytes < t.guarantee_bytes:
                wanted += min(t.want_bytes, t.guarantee_bytes - t.committed_bytes)
        return min(borrowed, max(1, math.ceil(wanted / pcb)))

    def _report_waiting(self, waiting: int) -> None:
        """Tell the pool, on a change only (the ledger is shared memory)."""
        queue = self.free_block_queue
        if waiting != queue.reported_waiting and self.space.pool is not None:
            self.space.report_waiting(waiting)
            queue.reported_waiting = waiting

    def _release_evictable(self, blocks: list[Any], cached: bool | list[bool] | None = None) -> None:
        """Drop cached contents and give the blocks back to the space: the prefix
        cache's as an eviction (while lending, reclaimed by eviction, not by completion).
        ``cached``: which were the cache's, where vLLM already dropped their hashes
        (default: those with a hash now)."""
        if not blocks:
            return
        if self._reuse_watchers:
            self._notify_reuse([b for b in blocks if b.block_id in self._reuse_watchers])
        ids = np.empty(len(blocks), dtype=np.int64)
        was = np.zeros(len(blocks), dtype=bool)
        for k, block in enumerate(blocks):
            self._evictable.pop(block.block_id)
            was[k] = block.block_hash is not None
            self._maybe_evict_cached_block(block)
            ids[k] = block.block_id
        if cached is not None:
            was[:] = cached
        if was.any():
            self.space.free_evicted(ids[was])
        if not was.all():
            self.space.free(ids[~was])

    def reclaim_pages(self, max_pages: int) -> int:
        """Evict the cached blocks of up to ``max_pages`` pages that hold
        nothing else, oldest first, so the space can release them; returns
        the number of pages emptied."""
        if max_pages <= 0 or not self._evictable:
            return 0
        page_of = self.space.geometry.page_of
        per_page: dict[int, list[Any]] = {}
        for block in self._evictable.values():  # oldest first
            page = page_of(block.block_id)
            if page is not None:  # (a straddling block is never handed out)
                per_page.setdefault(page, []).append(block)
        used = {p.page: p.used for p in self.space.page_occupancy(list(per_page))}
        whole = [blocks for page, blocks in per_page.items() if used.get(page) == len(blocks)]
        victims = [b for blocks in whole[:max_pages] for b in blocks]
        self._release_evictable(victims)
        return min(len(whole), max_pages)

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks held for the prefix cache (or unpinned readers) right now."""
        return len(self._evictable)
