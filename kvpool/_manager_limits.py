"""The limit and guarantee side of a :class:`~kvpool.KVCacheManager`: setting
them (revisioned), and tracing the native budget's verdicts as they change.

The native budget owns every figure and verdict (ARCHITECTURE.md, "Fair share");
this mixin only forwards settings and logs what the budget decided. Split
from :mod:`kvpool.manager`, which holds the queueing and the hot path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio.to_thread

from . import _validate as V
from ._manager_types import LimitState
from .errors import PoolClosed

if TYPE_CHECKING:
    from .space import BudgetStats, KVSpace, SpaceStats


class _LimitsMixin:
    # Set by KVCacheManager.__init__.
    name: str
    space: KVSpace
    _closed: bool  # stored in the native base (ManagerFace)
    _limit_deferred: bool  # stored in the native base: its free takes the slow path while True
    _log: Any  # a structlog bound logger (tracing.get_logger)
    _preempt_bytes: int = 0  # the last preemption verdict traced
    _lending: bool
    _guarantee: int

    def _dispatch(self, available: int | None = None) -> None:
        raise NotImplementedError  # KVCacheManager's

    @property
    def _limit_state(self) -> LimitState:
        """APPLIED or DEFERRED as last read from the native verdict (stored as the base's ``_limit_deferred``)."""
        return LimitState.DEFERRED if self._limit_deferred else LimitState.APPLIED

    @_limit_state.setter
    def _limit_state(self, state: LimitState) -> None:
        self._limit_deferred = state is LimitState.DEFERRED

    async def set_limit(self, limit_bytes: int | None, *, revision: int | None = None) -> LimitState:
        """Cap this tenant's committed bytes.

        Revisions order concurrent setters (this process, ``kvpool limit``, a
        controller): a lower revision than the one in force is ``STALE``; the
        same revision with another value is a ``CONFLICT``; repeating a
        revision is idempotent. A limit below current use is ``DEFERRED``
        (growth stops, pages go back as they empty) and turns ``APPLIED``
        once usage is under it. In a pool the limit lives in the ledger, so
        ``kvpool top`` shows it and ``kvpool limit`` shares the revisions.
        """
        limit_bytes = V.optional_integer("limit_bytes", limit_bytes)
        revision = V.optional_integer("revision", revision, lo=-(2**63))  # below the one in force: stale
        if self._closed:
            raise PoolClosed(f"manager {self.name!r} is closed")
        cur_bytes, cur_rev = self._limit_setting()
        if revision is not None and (isinstance(revision, bool) or not isinstance(revision, int)):
            raise TypeError(f"revision must be an int or None, got {revision!r}")
        # The native budget judges the revision (stale, conflict, same) and
        # applies the limit (releases idle pages above it, wakes waiters).
        if revision is not None and revision < 0:
            outcome = "stale"  # every revision in force is >= 0
        else:
            outcome = self.space._set_limit(limit_bytes, -1 if revision is None else revision)
        if outcome == "stale":
            self._log.info("limit.stale", limit_bytes=limit_bytes, revision=revision, current=cur_rev)
            return LimitState.STALE
        if outcome == "conflict":
            self._log.info("limit.conflict", limit_bytes=limit_bytes, revision=revision, current_bytes=cur_bytes)
            return LimitState.CONFLICT
        if outcome == "same":
            return self._refresh_limit_state()
        # Let the reserve thread give idle pages back before judging.
        await anyio.to_thread.run_sync(self.space.settle, 2.0)
        if self._closed:
            raise PoolClosed(f"manager {self.name!r} is closed")
        state = self._refresh_limit_state(force_log=True)
        self._dispatch()  # a raised limit lets waiters grow
        return state

    def _limit_setting(self) -> tuple[int | None, int]:
        """(limit bytes, revision) in force (the native budget's)."""
        return self.space.limit_setting()

    def set_guarantee(self, guarantee_bytes: int | None, *, revision: int | None = None) -> LimitState:
        """Guarantee this tenant ``guarantee_bytes`` of its pool (``None``: the equal default share).

        Revisioned like limits (``STALE``/``CONFLICT`` as there); explicit
        guarantees may not add up to more than the pool's capacity
        (``ValueError`` naming the numbers). Returns ``APPLIED`` when in force.
        """
        if self._closed:
            raise PoolClosed(f"manager {self.name!r} is closed")
        if self.space.pool is None:
            raise ValueError("set_guarantee needs a pool: a private manager has the whole budget")
        if revision is not None and (isinstance(revision, bool) or not isinstance(revision, int)):
            raise TypeError(f"revision must be an int or None, got {revision!r}")
        outcome = self.space._set_guarantee(guarantee_bytes, -1 if revision is None else revision)
        self._refresh_budget()
        if outcome == "stale":
            return LimitState.STALE
        if outcome == "conflict":
            return LimitState.CONFLICT
        self._dispatch()  # a raised guarantee may let waiters in
        return LimitState.APPLIED

    def set_headroom(self, headroom_bytes: int) -> None:
        """Ask borrowers to leave ``headroom_bytes`` of this tenant's unused guarantee free.

        See :meth:`kvpool.KVSpace.set_headroom`: a request of up to that
        size is then granted at once instead of waiting for a borrower's
        next step. Not revisioned: only the engine knows its next step.
        """
        if self._closed:
            raise PoolClosed(f"manager {self.name!r} is closed")
        self.space.set_headroom(headroom_bytes)
        self._log.info("budget.headroom", headroom_bytes=int(headroom_bytes))

    def budget(self) -> BudgetStats:
        """The tenant's budget (:meth:`kvpool.KVSpace.budget`), its verdicts traced as they change."""
        if self._closed:
            raise PoolClosed(f"manager {self.name!r} is closed")
        b = self.space.budget()
        self._refresh_budget(b)
        return b

    def publish_freeing(self, freeing_bytes: int) -> None:
        """What this tenant's running requests free within the reclaim bound
        (:meth:`kvpool.KVSpace.publish_freeing`); an engine calls it every step."""
        if self._closed:
            raise PoolClosed(f"manager {self.name!r} is closed")
        self.space.publish_freeing(freeing_bytes)

    def free_preempted(self, blocks: Any, *, requests: int, tokens: int) -> None:
        """Free the blocks of ``requests`` preempted requests with ``tokens`` to recompute
        (:meth:`kvpool.KVSpace.free_preempted`); one trace event per call."""
        if self._closed:
            raise PoolClosed(f"manager {self.name!r} is closed")
        self.space.free_preempted(blocks, requests=requests, tokens=tokens)
        self._log.info("budget.preempted", requests=int(requests), tokens=int(tokens))
        self._after_free()

    def free_evicted(self, blocks: Any) -> None:
        """Free cached blocks this engine drops, a prefix cache's entries
        (:meth:`kvpool.KVSpace.free_evicted`: while lending, reclaimed by eviction)."""
        if self._closed:
            raise PoolClosed(f"manager {self.name!r} is closed")
        self.space.free_evicted(blocks)
        self._log.info("budget.evicted")
        self._after_free()

    def _after_free(self) -> None:
        raise NotImplementedError

    def _refresh_limit_state(self, s: SpaceStats | None = None, *, log: bool = True,
                             force_log: bool = False) -> LimitState:
        """Read the native verdict (from ``s``, a snapshot just taken, if given)."""
        if s is None:
            s = self.space.stats()
        new = LimitState.DEFERRED if s.limit_deferred else LimitState.APPLIED
        if log and (force_log or new is not self._limit_state):
            event = "limit.applied" if new is LimitState.APPLIED else "limit.deferred"
            lim, rev = self._limit_setting()
            self._log.info(event, limit_bytes=lim, revision=rev, committed_bytes=s.committed_bytes)
        self._limit_state = new  # while DEFERRED the native free takes the slow path, which re-judges it
        return new

    @property
    def limit_state(self) -> LimitState:
        if not self._closed and (self._limit_state is LimitState.DEFERRED or self.space.pool is not None):
            self._refresh_limit_state()
        return self._limit_state


    def _refresh_budget(self, b: BudgetStats | None = None) -> None:
        """Trace the budget's verdicts as they change (the native budget decides them)."""
        if b is None:
            b = self.space.budget()
        if b.preempt_bytes != self._preempt_bytes:
            self._preempt_bytes = b.preempt_bytes
            if b.preempt_bytes:
                self._log.info("budget.preempt", preempt_bytes=b.preempt_bytes, freeing_bytes=b.freeing_bytes)
        if b.lending != self._lending:
            self._lending = b.lending
            if b.lending:
                self._log.info("budget.lend", borrowed_bytes=b.borrowed_bytes, guarantee_bytes=b.guarantee_bytes,
                               claimed_bytes=b.claimed_bytes)
            else:
                self._log.info("budget.lend.done", claimed_bytes=b.claimed_bytes)
        if b.guarantee_bytes != self._guarantee:
            self._guarantee = b.guarantee_bytes
            self._log.info("budget.guarantee", guarantee_bytes=b.guarantee_bytes,
                           explicit=b.guarantee_setting is not None, revision=b.guarantee_revision)
