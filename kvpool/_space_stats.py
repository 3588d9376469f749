"""What a KV space reports: its budget, a snapshot of its counters, a page's occupancy.

Plain frozen dataclasses built from the native core's bound types (one
conversion each, in ``_from_native``); :mod:`kvpool.space` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["BudgetStats", "PageInfo", "PageStateName", "SpaceStats"]

PageStateName = Literal["free", "committing", "reserve", "active", "releasing"]


@dataclass(frozen=True)
class BudgetStats:
    """A tenant's budget as its one native owner sees it (ARCHITECTURE.md, "Fair share").

    ``guarantee_bytes`` is the guarantee in force: the explicit one
    (``guarantee_setting``), or an equal share of what explicit guarantees
    leave among the pool's tenants on the default. ``borrowed_bytes`` is
    what the tenant holds above it; while ``lending`` (it borrows and a
    tenant below its guarantee waits) its allocs are refused and its emptied
    pages go back to the pool at once. ``headroom_bytes`` is how much of
    its unused guarantee the tenant asks borrowers to leave free, and
    ``keep_free_bytes`` what that asks now (``min(headroom, guarantee -
    claimed)``). While ``restoring`` it borrows what the others keep free
    (one of them grew within its guarantee into it): its allocs are refused
    and its emptied pages go back, as a lender's, but its engine need not
    preempt. A private space (no pool) has no guarantee (0), never lends
    and keeps nothing free.

    Reclaim by completion first (issue 31): ``freeing_bytes`` is what the
    tenant's engine published its running requests will free within the
    reclaim bound; while lending, ``preempt_bytes`` is the budget's verdict:
    the part of the starving waiters' need that the pool's free memory and
    every lender's completions cannot cover, this lender's share of it
    (0: it gives back by completion only, and preempts nothing). The
    counters are the tenant's own, since it joined: ``preemptions_asked``
    (verdicts with ``preempt_bytes > 0`` its engine acted on),
    ``requests_preempted``, ``tokens_recomputed`` (their prompt and
    generated tokens, prefilled again), and the block bytes it gave back
    while lending, ``reclaimed_by_completion_bytes`` (requests that
    finished), ``reclaimed_by_preemption_bytes`` and
    ``reclaimed_by_eviction_bytes`` (cached blocks it dropped,
    :meth:`KVSpace.free_evicted`: a prefix cache's). ``preempts`` is false
    for a tenant whose engine never acts on the verdict
    (:meth:`KVSpace.set_preempts`): it is never asked (``preempt_bytes``
    stays 0) and the other lenders are asked its share.
    """

    pooled: bool
    limit_bytes: int | None
    limit_revision: int
    guarantee_bytes: int
    guarantee_setting: int | None
    guarantee_revision: int
    claimed_bytes: int
    borrowed_bytes: int
    want_bytes: int
    lending: bool
    restoring: bool
    headroom_bytes: int
    keep_free_bytes: int
    pool_capacity: int | None
    freeing_bytes: int = 0
    preempt_bytes: int = 0
    preemptions_asked: int = 0
    requests_preempted: int = 0
    tokens_recomputed: int = 0
    reclaimed_by_completion_bytes: int = 0
    reclaimed_by_preemption_bytes: int = 0
    reclaimed_by_eviction_bytes: int = 0
    preempts: bool = True

    @classmethod
    def _from_native(cls, b: Any) -> BudgetStats:
        return cls(
            pooled=bool(b.pooled), limit_bytes=None if b.limit_bytes < 0 else int(b.limit_bytes),
            limit_revision=int(b.limit_revision), guarantee_bytes=int(b.guarantee_bytes),
            guarantee_setting=None if b.guarantee_setting < 0 else int(b.guarantee_setting),
            guarantee_revision=int(b.guarantee_revision), claimed_bytes=int(b.claimed_bytes),
            borrowed_bytes=int(b.borrowed_bytes), want_bytes=int(b.want_bytes), lending=bool(b.lending), restoring=bool(b.restoring),
            headroom_bytes=int(b.headroom_bytes), keep_free_bytes=int(b.keep_free_bytes),
            pool_capacity=None if b.pool_capacity < 0 else int(b.pool_capacity),
            freeing_bytes=int(b.freeing_bytes), preempt_bytes=int(b.preempt_bytes),
            preemptions_asked=int(b.preemptions_asked), requests_preempted=int(b.requests_preempted),
            tokens_recomputed=int(b.tokens_recomputed),
            reclaimed_by_completion_bytes=int(b.reclaimed_by_completion_bytes),
            reclaimed_by_preemption_bytes=int(b.reclaimed_by_preemption_bytes),
            reclaimed_by_eviction_bytes=int(b.reclaimed_by_eviction_bytes),
            preempts=bool(b.preempts),
        )


@dataclass(frozen=True)
class SpaceStats:
    """A consistent snapshot of one space (taken under its lock)."""

    num_blocks: int
    capacity: int
    num_pages: int
    used_blocks: int
    available: int
    pages_free: int
    pages_committing: int
    pages_reserve: int
    pages_active: int
    pages_releasing: int
    room_blocks: int  # free blocks on active pages: what an alloc fills without committing a page
    committed_bytes: int
    page_commit_bytes: int
    limit_pages: int
    limit_deferred: bool  # committed pages above the limit in force (the one verdict)
    allocs: int
    frees: int
    shortages: int
    commits: int
    releases: int
    inline_commits: int
    inline_releases: int
    commit_failures: int
    release_failures: int
    last_error: str
    max_blocks: int  # the most this tenant can ever hold: larger allocs raise RequestTooLarge
    budget: BudgetStats
    backend: str  # what the backend chose (mapping count, CUDA map-offset mode)

    @classmethod
    def _from_native(cls, s: Any) -> SpaceStats:
        names = [f for f in cls.__dataclass_fields__ if f != "budget"]
        return cls(**{f: getattr(s, f) for f in names}, budget=BudgetStats._from_native(s.budget))


@dataclass(frozen=True)
class PageInfo:
    page: int
    state: PageStateName
    used: int
    capacity: int
