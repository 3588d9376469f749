"""Which of a lending engine's running requests free memory by completion, and which to preempt.

The engine plugins' side of the reclaim rule (ARCHITECTURE.md "Fair share",
rule 8): each step while lending a plugin publishes the bytes its running
requests free by completion within the bound (:meth:`Reclaim.freeing`: the
vLLM plugin and the SGLang allocator), and only when the pool's verdict asks
it to preempt does it choose victims, cheapest to recompute first
(:meth:`Reclaim.victims`: the vLLM plugin; SGLang never preempts for the
pool). Pages, not blocks: requests share pages, and only a page no remaining
request holds goes back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["RECLAIM_STEPS", "Reclaim", "Running"]

# The reclaim bound (ARCHITECTURE.md "Fair share", rule 8): a running request
# that finishes within this many decode steps frees its memory by completion,
# and its pages are published as ``freeing``. vLLM and SGLang decode one token
# per running request per step, so steps left = tokens left: the request's
# maximum new tokens minus
# the output so far (an upper bound: EOS or a stop string may end it sooner,
# so freeing is understated, never overstated). The demo engines' bound
# (demo/sched.py RECLAIM_STEPS), measured there on the virtual clock.
RECLAIM_STEPS = 256


@dataclass(frozen=True)
class Running:
    """A running request as the reclaim decision sees it (built by the
    engine's hook, only while this engine lends)."""

    request: Any  # the engine's request
    steps_left: int  # decode steps until max_tokens
    computed: int  # tokens a preemption would recompute
    block_ids: Sequence[int] | npt.NDArray[np.int64]  # every block it holds (every KV cache group's)


@dataclass(frozen=True)
class Reclaim:
    """The page arithmetic of one engine's space: ``page_first`` (each page's
    first block id, ascending) and ``page_commit_bytes``."""

    page_first: npt.NDArray[np.int64]
    page_commit_bytes: int

    def pages(self, block_ids: Sequence[int] | npt.NDArray[np.int64]) -> set[int]:
        ids = np.asarray(block_ids, dtype=np.int64)
        ids = ids[ids > 0]  # vLLM's null block (0) stands in for blocks a window dropped
        return set(np.unique(np.searchsorted(self.page_first, ids, side="right") - 1).tolist())

    def freeing(self, live: Sequence[Running]) -> int:
        """Bytes of the pages that go back when the running requests finishing
        within the bound complete: the pages only they hold (a page shared
        with a request that keeps running stays committed)."""
        finishing: set[int] = set()
        held: set[int] = set()
        for r in live:
            (finishing if r.steps_left <= RECLAIM_STEPS else held).update(self.pages(r.block_ids))
        return len(finishing - held) * self.page_commit_bytes

    def victims(self, live: Sequence[Running], need_bytes: int) -> list[Running]:
        """Running requests to preempt for ``need_bytes``, cheapest recompute
        first: those that do not finish within the bound before those that
        do (completion frees them anyway), a request never preempted before
        one that was (no ping-pong), then fewest computed tokens. Taken until
        the pages no remaining request holds cover the need: "about that
        much", to the page (a page that does not empty gives nothing back)."""
        pages = [self.pages(r.block_ids) for r in live]
        holders = Counter(p for ps in pages for p in ps)
        order = sorted(range(len(live)), key=lambda i: (
            live[i].steps_left <= RECLAIM_STEPS, int(getattr(live[i].request, "num_preemptions", 0)) > 0,
            live[i].computed))
        out: list[Running] = []
        gained = 0
        for i in order:
            if gained >= need_bytes:
                break
            out.append(live[i])
            for p in pages[i]:
                holders[p] -= 1
                gained += self.page_commit_bytes if holders[p] == 0 else 0
        return out
