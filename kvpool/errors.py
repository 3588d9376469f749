"""One error hierarchy for kvpool, by cause (ARCHITECTURE.md, "Errors").

An expected shortage is :class:`PoolExhausted` and carries the numbers;
misuse is :class:`InvalidBlocks` / :class:`GeometryError` (both
``ValueError``); a syscall or driver failure that is not a shortage is
:class:`BackendError` with the system's own message.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "BackendError",
    "GeometryError",
    "InvalidBlocks",
    "KVPoolError",
    "LedgerError",
    "PoolClosed",
    "PoolExhausted",
    "RequestTooLarge",
]


class KVPoolError(Exception):
    """Base class of every kvpool error."""


class PoolExhausted(KVPoolError):
    """Not enough blocks right now (an expected shortage, not a bug)."""

    def __init__(self, requested: int, available: int, detail: str = "") -> None:
        self.requested = requested
        self.available = available
        msg = f"requested {requested} blocks, {available} available"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class RequestTooLarge(PoolExhausted, ValueError):
    """A request larger than the tenant can ever hold: refused at once, never queued.

    ``max_blocks`` is the most this tenant can hold (the min of its limit and
    the pool's capacity, through the page formula). It is a
    :class:`PoolExhausted` (code that treats any miss as a shortage keeps
    working) and a ``ValueError`` (waiting cannot help: the request is wrong
    for this tenant).
    """

    def __init__(self, requested: int, max_blocks: int, detail: str = "", available: int = 0) -> None:
        self.max_blocks = max_blocks
        super().__init__(requested, available,
                         detail or f"this tenant can never hold more than {max_blocks} blocks")


class PoolClosed(KVPoolError):
    """The space or manager was closed; nothing can be allocated or freed."""


class GeometryError(KVPoolError, ValueError):
    """A geometry that cannot work; the message names the numbers and the fix."""


class InvalidBlocks(KVPoolError, ValueError):
    """A bad ``free``: unknown, repeated, out-of-range or malformed ids. Nothing was freed."""

    def __init__(self, message: str, ids: Sequence[int] = ()) -> None:
        self.ids = list(ids)
        super().__init__(message)


class BackendError(KVPoolError):
    """A syscall or driver failure that is not a shortage (carries its message)."""


class LedgerError(KVPoolError):
    """Bad pool name, layout-version mismatch or permissions on a pool ledger."""
