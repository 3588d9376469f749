"""SGLang's retractions, counted as preemptions by :class:`~kvpool.adapters.sglang.KVPoolTokenAllocator`.

SGLang preempts by *retraction* (``ScheduleBatch.retract_decode``): when the
next decode does not fit it frees the running requests it values least
(fewest output tokens) until it does, and queues them to be prefilled again.
The plugin marks the frees of one such call (:meth:`Preemptions.begin` /
:meth:`Preemptions.end`); when those pages reach the space (the second
``flush()`` after the free, :mod:`kvpool.adapters._sglang_pages`) they are
freed with :meth:`kvpool.KVSpace.free_preempted`, so ``kvpool top``,
``stats()`` and Prometheus count an SGLang engine's preemptions, the tokens
it must recompute and the bytes they gave back (ARCHITECTURE.md "Fair
share", rule 8's counters). A marked page that SGLang takes back before it
reaches the space is no longer on its way back: its mark is dropped.

The allocator does not act on the pool's verdict (``preempt_bytes``): SGLang
hands a request one token's slot at a time, so the requests' slots
interleave on kvpool pages and retracting a request empties no page unless
its neighbours go too; a retraction would destroy work and give nothing
back (tried with a real server on 2026-12-07, docs/sglang.md "Lending").
While it lends, SGLang retracts only when the free slots of the pages it
holds run out (the allocator's ``decode_size``), and memory comes back by
completion.

Evictions the same way. While it lends the plugin drops SGLang's prefix
cache (its finished requests' KV) inside the allocator's ``evicting()``,
which marks each page freed meanwhile as it is freed (:meth:`Preemptions.freed`):
their pages reach the space with :meth:`kvpool.KVSpace.free_evicted`, counted
as reclaimed by eviction, not as requests finishing. A page SGLang holds again
before it reaches the space (an alloc, a ``restore_state``) loses its marks.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvpool import KVSpace

__all__ = ["Preemptions"]

Ids = npt.NDArray[np.int64]


class Preemptions:
    """Pages a retraction or an eviction freed, and the retractions' counts, until they reach the space."""

    def __init__(self, space: KVSpace, num_blocks: int) -> None:
        self.space = space
        self.marked = np.zeros(num_blocks, dtype=bool)  # freed by a retraction, not yet back in the space
        self.n_marked = 0  # how many are marked: an alloc never scans the whole mask
        self.requests = 0  # retracted requests whose pages are not yet back in the space
        self.tokens = 0
        self._pending_before: int | None = None
        self.evicted = np.zeros(num_blocks, dtype=bool)  # freed by dropping the prefix cache
        self.n_evicted = 0
        self.evicting = 0  # depth of open evictions: frees now are a cache's

    def begin(self, pending: int) -> None:
        """A retraction starts; ``pending``: how many pages are pending now."""
        self._pending_before = pending

    def end(self, pending_pages: Ids, requests: int, tokens: int) -> None:
        """The frees since :meth:`begin` (the tail of ``pending_pages``) retracted ``requests``
        requests (``tokens`` to recompute)."""
        before, self._pending_before = self._pending_before, None
        if before is None or requests <= 0:
            return
        freed = pending_pages[before:]
        if freed.size:
            self.n_marked += int(freed.size - self.marked[freed].sum())
            self.marked[freed] = True
            self.requests += requests
            self.tokens += tokens

    def freed(self, pages: Ids) -> None:
        """Pages SGLang just freed (pending now): a cache's while an eviction is open."""
        if self.evicting:
            pages = pages[~self.marked[pages] & ~self.evicted[pages]]
            self.n_evicted += int(pages.size)
            self.evicted[pages] = True

    def reused(self, pages: Ids) -> None:
        """Pages an alloc took (pending ones among them are no longer on their way back)."""
        if self.n_marked:  # only while a retraction's pages are on their way back
            self.n_marked -= int(self.marked[pages].sum())
            self.marked[pages] = False
            if not self.n_marked:  # all taken back: nothing of it will reach the space
                self.requests = self.tokens = 0
        if self.n_evicted:
            self.n_evicted -= int(self.evicted[pages].sum())
            self.evicted[pages] = False

    def give_back(self, pages: Ids) -> None:
        """Hand ``pages`` to the space: a retraction's as a preemption, an eviction's as an
        eviction, the rest as plain frees."""
        mark = self.marked[pages] if self.n_marked else None
        if mark is not None and mark.any():
            self.space.free_preempted(pages[mark], requests=max(1, self.requests), tokens=self.tokens)
            self.marked[pages[mark]] = False
            self.n_marked -= int(mark.sum())
            self.reused(pages[mark])  # (an eviction mark too: the page is back in the space)
            self.requests = self.tokens = 0
            pages = pages[~mark]
        evicted = self.evicted[pages] if self.n_evicted else None
        if evicted is not None and evicted.any():
            self.space.free_evicted(pages[evicted])
            self.evicted[pages[evicted]] = False
            self.n_evicted -= int(evicted.sum())
            pages = pages[~evicted]
        if pages.size:
            self.space.free(pages)
