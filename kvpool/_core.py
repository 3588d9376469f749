"""The only module that imports the native extension.

It turns the native core's failures (the ``Outcome`` of the colder calls,
and the ``Failure`` of the alloc/free hot path) into the :mod:`kvpool.errors`
hierarchy so that no other module sees raw codes.
"""

from __future__ import annotations

from typing import Any, NoReturn

from . import _native
from .errors import BackendError, InvalidBlocks, KVPoolError, LedgerError, PoolClosed, PoolExhausted, RequestTooLarge

native = _native

CODE_OK: int = _native.CODE_OK
CODE_SHORTAGE: int = _native.CODE_SHORTAGE
CODE_INVALID: int = _native.CODE_INVALID
CODE_BACKEND: int = _native.CODE_BACKEND
CODE_CLOSED: int = _native.CODE_CLOSED
CODE_LEDGER: int = _native.CODE_LEDGER
CODE_UNSATISFIABLE: int = _native.CODE_UNSATISFIABLE


def raise_failure(f: _native.Failure, *, requested: int = 0, ids: bool = False) -> NoReturn:
    """Raise the kvpool error for a failed native ``alloc`` (``requested``) or ``free`` (``ids``)."""
    raise_status(f.code, f.message, requested=requested, available=f.available,
                 bad_ids=list(f.bad_ids) if ids else None, max_blocks=f.max_blocks)


def checked(out: Any) -> Any:
    """A native ``Outcome`` (``code``, ``message``) back if it succeeded; else its kvpool error raised."""
    if out.code != CODE_OK:
        raise_status(out.code, out.message)
    return out


def raise_status(code: int, message: str, *, requested: int = 0, available: int = 0,
                 bad_ids: list[int] | None = None, max_blocks: int = 0) -> NoReturn:
    """Raise the kvpool error for a native failure code.

    ``bad_ids`` is given by calls that take block ids (free): their misuse is
    :class:`InvalidBlocks`; any other misuse is a plain ``ValueError``.
    """
    if code == CODE_SHORTAGE:
        # The plain shortage message only repeats the numbers; keep real causes
        # (an ENOSPC from the backend, an injected fault).
        detail = "" if message.startswith("requested ") else message
        raise PoolExhausted(requested, available, detail)
    if code == CODE_UNSATISFIABLE:
        raise RequestTooLarge(requested, max_blocks, message, available)
    if code == CODE_INVALID:
        if bad_ids is not None:
            raise InvalidBlocks(message, bad_ids)
        raise ValueError(message)
    if code == CODE_LEDGER:
        raise LedgerError(message)
    if code == CODE_CLOSED:
        raise PoolClosed(message)
    if code == CODE_BACKEND:
        raise BackendError(message)
    raise KVPoolError(f"unexpected native status {code}: {message}")
