"""One error hierarchy for kvpool, by cause (DESIGN.md, "Errors").

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
