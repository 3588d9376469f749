"""The reclaim rule (ARCHITECTURE.md "Fair share", rule 8) in :class:`~kvpool.adapters.sglang.KVPoolTokenAllocator`.

SGLang has one figure for memory, ``available_size()``: its prefill admission
(``PrefillAdder``) reads it, and so does its decode gate
(``BaseTokenToKVPoolAllocator.check_decode_capacity``, 0.5.23), on which its
retraction loop (``ScheduleBatch.retract_decode``, SGLang's preemption)
converges: it retracts the running request it values least (fewest output
tokens: the cheapest to recompute), one at a time, until the next decode fits.
So the allocator acts on the rule through that figure, as a miss:

* **Stops growing.** While this tenant lends, the pool refuses its allocs of
  new pages; ``available_size()`` is then the pending pages plus the free
  blocks on the pages it has committed (``room``, read at each safe point),
  never memory the waiter is owed. Its running requests keep decoding into
  that room instead of being retracted because the pool said no.
* **Preempts only on the verdict, and only what it asks.** The verdict
  ``preempt_bytes`` becomes ``owed`` blocks (in this space's block
  commits), and ``available_size()`` is ``pending + room - owed``: pending
  pages go back at the next safe points, so they count towards the verdict
  and an alloc takes the room first. SGLang's decode gate then misses until
  its retraction has freed enough requests to cover the verdict and the next
  decode. With no verdict (0: completions cover the waiter) nothing is
  retracted for the pool.
* **Counted.** The plugin marks the frees of one ``retract_decode`` call
  (:meth:`Lending.begin_preemption` / :meth:`Lending.end_preemption`); when
  those pages reach the space it frees them with
  :meth:`kvpool.KVSpace.free_preempted` (requests and tokens retracted), so
  ``kvpool top``, ``stats()`` and Prometheus count an SGLang engine's
  preemptions and the bytes they reclaimed.

What it does not do (yet): publish ``freeing``. SGLang inserts a finished
request's KV into its radix cache instead of freeing it, so completions give
memory back only when the cache evicts; this engine publishes 0 and the
verdict asks it for the whole deficit its neighbours' completions do not
cover. Blocks, not pages: the verdict is met when enough *blocks* are
pending; a page goes back only once all its blocks are free, and whatever
did not come back is asked again by the next verdict.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvpool import KVSpace

__all__ = ["Lending"]

Ids = npt.NDArray[np.int64]


class Lending:
    """One allocator's view of its budget's lending verdict, read at each safe point."""

    def __init__(self, space: KVSpace, num_blocks: int) -> None:
        self.space = space
        g = space.geometry
        self.block_commit_bytes = g.page_commit_bytes // (g.page_bytes // g.region_block_bytes)
        self.lending = False
        self.room = 0  # free blocks on this space's committed pages (while lending)
        self.owed = 0  # blocks the verdict asks for (pending ones count towards it)
        self.marked = np.zeros(num_blocks, dtype=bool)  # freed by a retraction, not yet back in the space
        self.requests = 0  # retracted requests whose pages are not yet back in the space
        self.tokens = 0
        self._pending_before: int | None = None

    def refresh(self) -> None:
        """At a safe point: read the verdict and, while lending, the room on committed pages."""
        b = self.space.budget()
        self.lending = bool(b.lending or b.restoring)
        if not self.lending:
            self.room = self.owed = 0
            return
        self.room = sum(p.capacity - p.used for p in self.space.page_occupancy() if p.state == "active")
        self.owed = -(-int(b.preempt_bytes) // self.block_commit_bytes) if b.lending else 0

    def available(self, pending: int) -> int:
        """Blocks an alloc may take now while lending: pending ones and the room, less what is owed."""
        return max(0, pending + self.room - self.owed)

    def took(self, from_space: int) -> None:
        """An alloc took ``from_space`` blocks of the space (the room shrinks)."""
        self.room = max(0, self.room - from_space)

    def reused(self, pages: Ids) -> None:
        """Pending pages an alloc took back: no longer on their way to the space."""
        self.marked[pages] = False

    # -- counting SGLang's retractions ----------------------------------------
    def begin_preemption(self, pending: int) -> None:
        self._pending_before = pending

    def end_preemption(self, pending_pages: Ids, requests: int, tokens: int) -> None:
        """The frees since :meth:`begin_preemption` (the tail of ``pending_pages``) were a retraction
        of ``requests`` requests (``tokens`` to recompute)."""
        before, self._pending_before = self._pending_before, None
        if before is None or requests <= 0:
            return
        freed = pending_pages[before:]
        if freed.size:
            self.marked[freed] = True
            self.requests += requests
            self.tokens += tokens

    def give_back(self, pages: Ids) -> None:
        """Hand ``pages`` to the space: a retraction's as a preemption, the rest as plain frees."""
        mark = self.marked[pages]
        if mark.any():
            self.space.free_preempted(pages[mark], requests=max(1, self.requests), tokens=self.tokens)
            self.marked[pages[mark]] = False
            self.requests = self.tokens = 0
            rest = pages[~mark]
            if rest.size:
                self.space.free(rest)
        else:
            self.space.free(pages)
