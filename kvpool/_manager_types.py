"""The values a :class:`~kvpool.KVCacheManager` hands out: limit outcomes, stats, reservations.

Split from :mod:`kvpool.manager` (which re-exports them) so that module holds
only the manager's queueing and hot path.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import anyio.lowlevel

from . import _validate as V
from .errors import PoolClosed, PoolExhausted
from .space import BlockIds, SpaceStats

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["LimitState", "ManagerStats", "Reservation"]


class LimitState(str, Enum):
    """Outcome of ``set_limit``."""

    APPLIED = "applied"    # committed memory is within the limit
    DEFERRED = "deferred"  # growth stopped; pages go back as they empty
    STALE = "stale"        # an older revision than the one in force: ignored
    CONFLICT = "conflict"  # same revision, different value: refused


@dataclass(frozen=True)
class ManagerStats:
    pool: str
    tenant: str
    capacity: int
    used_blocks: int
    available: int
    waiting: int
    waiting_blocks: int
    committed_bytes: int
    limit_bytes: int | None
    limit_revision: int
    limit_state: LimitState
    guarantee_bytes: int
    borrowed_bytes: int
    lending: bool
    granted_at_once: int
    granted_after_wait: int
    timeouts: int
    cancellations: int
    shortages: int
    space: SpaceStats


class Reservation:
    """Blocks set aside by ``await manager.reserve(n)``, handed out with ``take``.

    Closing (or leaving the ``with`` block) gives what was not taken back.
    A failed ``take`` changes nothing: the reservation is never cancelled
    silently.
    """

    def __init__(self, manager: KVCacheManager, ids: BlockIds) -> None:
        self._manager = manager
        self._ids = ids
        self._pos = 0
        self._closed = False

    @property
    def remaining(self) -> int:
        return 0 if self._closed else len(self._ids) - self._pos

    def take(self, k: int) -> BlockIds:
        if self._closed:
            raise PoolClosed("reservation is closed")
        k = V.integer("k", k)
        if k > self.remaining:
            raise PoolExhausted(k, self.remaining, "reservation holds fewer blocks")
        out = self._ids[self._pos : self._pos + k]
        self._pos += k
        return out

    def close(self) -> None:
        """Return the blocks not taken to the manager. Idempotent."""
        if self._closed:
            return
        rest = self._ids[self._pos :]
        self._closed = True
        if len(rest) and not self._manager.closed:
            self._manager.free(rest)

    async def aclose(self) -> None:
        self.close()
        await anyio.lowlevel.checkpoint()

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Reservation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Reservation {self.remaining}/{len(self._ids)} blocks left>"
