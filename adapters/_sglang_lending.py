"""A lending SGLang engine's side of the pool (ARCHITECTURE.md "Fair share", rules 5, 6 and 8).

:class:`LenderGates` are :class:`~kvpool.adapters.sglang.KVPoolTokenAllocator`'s
methods the plugin's gates call: what the next decode can get
(``decode_size``), that decode's pages taken at SGLang's gate (``reserve``),
whether the engine gives memory back now (``giving_back``), what its
completions free (``publish_freeing``), and which frees drop its prefix cache
(``evicting``).

While the engine gives memory back the pool grants it no new page: it admits
nothing, drops its prefix cache, and its running requests decode into the
free slots of the pages it holds, so the pages empty as they finish.

Its freeing. The judge of the pool (native/budget.cpp, rule 6) asks lenders
to preempt only what the starving waiters need beyond what the lenders'
running requests free within the reclaim bound. SGLang never preempts for the
pool (its requests interleave on kvpool pages a token at a time, so a
retraction empties no page), so its allocator tells the pool so
(``KVSpace.set_preempts(False)``) and publishes what its completions will
free: the judge counts them and asks the lenders that do preempt (a vLLM
engine beside it) only for the rest, instead of asking SGLang, which would
not act, and leaving the waiter to SGLang's completions however far off.
A running request's KV is every slot it addresses, its shared prefix
included (``req_to_token[row, :kv_allocated_len]``); its pages empty when it
finishes only if no request that keeps running holds a slot on them (its own
prefix-cache entry is evicted at the next iteration while the engine gives
memory back). The arithmetic is the vLLM plugin's
(:class:`kvpool.adapters._reclaim.Reclaim`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from kvpool import InvalidBlocks, KVSpace, PoolClosed, PoolExhausted

from ._reclaim import Reclaim, Running
from ._sglang_pages import PageStates, host_ints
from ._sglang_preemption import Preemptions

__all__ = ["Freeing", "LenderGates"]


class Freeing:
    """One SGLang engine's published freeing (owner-written, republished when it changes)."""

    def __init__(self, space: KVSpace, page_size: int, num_slots: int) -> None:
        g = space.geometry
        self.space, self.page_size, self.num_slots = space, page_size, num_slots
        self.reclaim = Reclaim(np.asarray(g._ranges[0], dtype=np.int64), g.page_commit_bytes)
        self.published = 0

    def publish(self, requests: Iterable[tuple[int, Any]]) -> int:
        """``requests``: (decode steps left, token indices) of each running request.
        Publishes, and returns, the bytes of the pages that empty when those
        with at most ``RECLAIM_STEPS`` left finish."""
        live = []
        for steps_left, tokens in requests:
            if isinstance(steps_left, bool) or not isinstance(steps_left, (int, np.integer)) or steps_left < 0:
                raise ValueError(f"steps left must be a non-negative int, got {steps_left!r}")
            t = host_ints(tokens, "token indices", InvalidBlocks)
            bad = (t < 0) | (t >= self.num_slots)
            if bad.any():
                raise InvalidBlocks(f"token indices {t[bad][:8].tolist()} are outside [0, {self.num_slots})",
                                    t[bad][:8].tolist())
            live.append(Running(None, int(steps_left), 0, np.unique(t // self.page_size)))
        freeing = self.reclaim.freeing(live) if live else 0
        if freeing != self.published:
            self.space.publish_freeing(freeing)
            self.published = freeing
        return freeing


class LenderGates:
    """The allocator's lending methods (module docstring); mixed into
    :class:`~kvpool.adapters.sglang.KVPoolTokenAllocator`, whose state they read."""

    space: KVSpace
    page_size: int
    _pages: PageStates
    _freeing: Freeing
    _preempted: Preemptions
    _closed: bool

    def _check_open(self) -> None:
        """Every public method's first call: a closed allocator refuses, changing nothing."""
        if self._closed:
            raise PoolClosed("the SGLang allocator is closed")

    def decode_size(self) -> int:
        """Tokens the running requests' next decode can get: :meth:`available_size`
        and, while this engine gives memory back (it lends, or restores the
        others' headroom), the free slots of the kvpool pages it holds.

        SGLang's decode gate (the plugin's ``check_decode_capacity``). A lender
        does not grow onto new pages, but its running requests keep decoding
        into the pages it holds, so they finish and the pages empty (reclaim
        by completion, ARCHITECTURE.md "Fair share" rules 5 and 8) instead of
        SGLang retracting them one after another and aborting the last.
        """
        self._check_open()
        st = self.space.stats()  # one snapshot: room and the verdict read together
        b = st.budget
        space = st.room_blocks if b.lending or b.restoring else st.available  # (available is 0 while giving back)
        return (int(space) + int(self._pages.pending.size)) * self.page_size

    def reserve(self, num_tokens: int) -> bool:
        """SGLang's decode gate (the plugin's ``check_decode_capacity``): whether the next
        decode's ``num_tokens`` fit (:meth:`decode_size`), with the pages they need that are
        not pending taken from the space now, as pending pages the alloc takes first. So no
        other engine takes them between SGLang's gate and its alloc, whose ``None`` is fatal
        to SGLang; a miss here makes SGLang retract instead (its gate's contract)."""
        self._check_open()
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        need = -(-int(num_tokens) // self.page_size) - int(self._pages.pending.size)
        if need <= 0:
            return True
        st = self.space.stats()
        lends = st.budget.lending or st.budget.restoring
        if lends and need > st.room_blocks:  # a lender gets only the free slots of its pages (decode_size)
            return False
        try:
            pages = self.space.alloc(need, promised=lends)  # best fit: a lender's free slots, no new page
        except PoolExhausted:
            return False
        self._pages.reserve(np.asarray(pages, dtype=np.int64))
        return True

    def giving_back(self) -> bool:
        """Whether this engine gives memory back now (it lends to a tenant below
        its guarantee, or restores the others' headroom). It then admits
        nothing and drops its prefix cache (the plugin's prefill budget and
        iteration hook), so its pages empty as its running requests finish."""
        self._check_open()
        return self._gives_back()

    def _gives_back(self) -> bool:
        """Whether the space gives memory back (the budget alone: 6 us, where stats() takes 15)."""
        b = self.space.budget()
        return bool(b.lending or b.restoring)

    @contextlib.contextmanager
    def evicting(self) -> Iterator[None]:
        """The frees inside drop SGLang's prefix cache (the plugin wraps its eviction while
        the engine gives memory back): their pages reach the space as an eviction
        (:meth:`kvpool.KVSpace.free_evicted`), counted as reclaimed by eviction, not by completion."""
        self._check_open()
        self._preempted.evicting += 1  # (nested: the outermost ends it)
        try:
            yield
        finally:
            self._preempted.evicting -= 1

    def publish_freeing(self, requests: Iterable[tuple[int, Any]]) -> int:
        """Publish, and return, the bytes this engine's running requests give back by completion
        within the reclaim bound; ``requests``: (decode steps left, token indices it holds) of each
        (the module docstring). The plugin calls it every iteration."""
        self._check_open()
        return self._freeing.publish(requests)
