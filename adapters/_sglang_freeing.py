"""What a lending SGLang engine gives back by completion: its ``freeing`` in the pool's ledger.

The judge of the pool (native/budget.cpp, rule 6; ARCHITECTURE.md "Fair
share", rule 8) asks lenders to preempt only what the starving waiters need
beyond what the lenders' running requests free within the reclaim bound.
SGLang never preempts for the pool (its requests interleave on kvpool pages a
token at a time, so a retraction empties no page), so its allocator tells the
pool so (``KVSpace.set_preempts(False)``) and publishes what its completions
will free: then the judge counts them and asks the lenders that do preempt
(a vLLM engine beside it) only for the rest, instead of asking SGLang, which
would not act, and leaving the waiter to SGLang's completions however far
off they are.

A running request's KV is every slot it addresses, its shared prefix
included (``req_to_token[row, :kv_allocated_len]``). Its pages empty when it
finishes only if no request that keeps running holds a slot on them; the
finished request's own prefix-cache entry is evicted at the next iteration
while the engine gives memory back (the plugin's ``ingest_requests`` hook).
The arithmetic is the vLLM plugin's (:class:`kvpool.adapters._reclaim.Reclaim`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from kvpool import InvalidBlocks, KVSpace

from ._reclaim import Reclaim, Running

__all__ = ["Freeing"]


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
            t = np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens, dtype=np.int64).ravel()
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
