"""Argument checks shared by every public entry point (ARCHITECTURE.md, invariant 10).

Each check runs before any state changes and raises with a message that names
the argument and the value it got. Numbers bound for the native core must fit
its ``int64``: a larger Python int would otherwise surface as nanobind's
``TypeError`` with a signature dump, and a ``bool`` would pass as 0 or 1
(``set_limit(True)`` was a 1-byte limit, ``free([id, True])`` freed block 1).

Values are shown in messages through :func:`shown`: ``repr``-quoted (so a
name with control characters or terminal escapes cannot drive the terminal
that prints the error) and cut to a bounded length (a 1 MB name or a huge
list cannot flood it), as the native core's ``quoted_name`` does.

Kinds of error, as in the rest of kvpool: a number of the wrong kind or out of
range is a ``ValueError``; an object of the wrong kind (a pool, a device, a
name, a flag) is a ``TypeError``; bad block ids are :class:`InvalidBlocks`.

This module imports neither torch nor the native core, so the operator
commands (``kvpool top``, ``pools``, ``limit``) can use it.
"""

from __future__ import annotations

import math
import reprlib
import sys
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

from .errors import InvalidBlocks

__all__ = [
    "INT64_MAX",
    "block_ids",
    "device",
    "flag",
    "int_array",
    "integer",
    "optional_integer",
    "seconds",
    "shown",
    "text",
]

INT64_MAX = 2**63 - 1
SHOWN_CHARS = 80  # of a value in a message; past it, "..." and the value's length

_reprs = reprlib.Repr()
_reprs.maxstring = _reprs.maxother = _reprs.maxlong = SHOWN_CHARS


def shown(value: object) -> str:
    """``value`` as an error message may quote it: its ``repr`` (every
    non-printable character escaped), cut after :data:`SHOWN_CHARS` characters
    with the value's length named."""
    if isinstance(value, str):
        r = repr(value)
        if len(r) <= SHOWN_CHARS:
            return r
        return f"{r[:SHOWN_CHARS]}... ({len(value)} characters)"
    r = _reprs.repr(value)  # containers: their first few items, each bounded
    return r if len(r) <= SHOWN_CHARS else f"{r[:SHOWN_CHARS]}..."


# numpy is imported where arrays are made, not here: the operator commands
# (`kvpool pools`, `limit`) validate their values through this module and
# never need it (issue 32: it was half their start-up). A numpy scalar can
# only exist in a process that imported numpy, so its types are looked up
# in sys.modules.


def _np_types(*names: str) -> tuple[type, ...]:
    np_mod = sys.modules.get("numpy")
    return tuple(getattr(np_mod, n) for n in names) if np_mod is not None else ()


def _is_bool(value: object) -> bool:
    return isinstance(value, (bool, *_np_types("bool_")))


def _is_int(value: object) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or isinstance(value, _np_types("integer"))


def integer(name: str, value: object, *, lo: int = 0, hi: int = INT64_MAX) -> int:
    """``value`` as an int in ``[lo, hi]`` (bools and floats refused); ValueError otherwise."""
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {shown(value)}")
    v = int(cast(Any, value))  # an int or a numpy integer: checked above
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if v > hi:
        why = " (the native core's int64)" if hi == INT64_MAX else ""
        raise ValueError(f"{name} must be <= {hi}{why}, got {v}")
    return v


def optional_integer(name: str, value: object, *, lo: int = 0, hi: int = INT64_MAX) -> int | None:
    """:func:`integer`, or ``None`` passed through."""
    return None if value is None else integer(name, value, lo=lo, hi=hi)


def seconds(name: str, value: object, *, allow_inf: bool = True) -> float:
    """A non-negative number of seconds (bools and NaN refused)."""
    if _is_bool(value) or not isinstance(value, (int, float, *_np_types("integer", "floating"))):
        raise ValueError(f"{name} must be a number of seconds, got {shown(value)}")
    v = float(cast(Any, value))
    if math.isnan(v) or v < 0 or (math.isinf(v) and not allow_inf):
        bound = "" if allow_inf else " and finite"
        raise ValueError(f"{name} must be >= 0{bound} seconds, got {shown(value)}")
    return v


def flag(name: str, value: object) -> bool:
    """A real bool (``"no"`` or ``0`` would read as a wish of the other sign)."""
    if not _is_bool(value):
        raise TypeError(f"{name} must be True or False, got {shown(value)}")
    return bool(value)


def text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {shown(value)} ({type(value).__name__})")
    return value


def device(value: object) -> str:
    """``"cpu"``, ``"cuda"`` (torch's current device, else ``"cuda:0"``) or ``"cuda:N"``, normalized."""
    if not isinstance(value, str):
        raise TypeError(
            f"device must be 'cpu', 'cuda' or 'cuda:N', got {shown(value)} ({type(value).__name__})")
    if value == "cpu":
        return value
    if value == "cuda":
        # As torch means it: its current device (when torch is loaded and
        # sees CUDA), else device 0. Never imports torch itself.
        torch = sys.modules.get("torch")
        try:
            if torch is not None and torch.cuda.is_available():
                return f"cuda:{int(torch.cuda.current_device())}"
        except Exception:  # noqa: BLE001 - a broken CUDA runtime: fall back to device 0
            pass
        return "cuda:0"
    if value.startswith("cuda:") and value[5:].isascii() and value[5:].isdigit() and int(value[5:]) < 2**31:
        return f"cuda:{int(value[5:])}"
    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {shown(value)}")


def block_ids(blocks: object) -> npt.NDArray[np.int64]:
    """A free batch as a C-contiguous int64 array; the ids themselves are checked natively.

    Accepts a numpy array, a torch tensor or any iterable of ints. Refuses
    bools (``True`` is not block 1), floats and ints beyond int64, naming
    them, with :class:`InvalidBlocks`.
    """
    return int_array("block ids", blocks, InvalidBlocks)


def int_array(what: str, values: object, error: type[ValueError] = ValueError) -> npt.NDArray[np.int64]:
    """``values`` (an array, a tensor, any iterable of ints) as a 1-D C-contiguous int64 array.

    ``error`` (a ``ValueError``; :class:`InvalidBlocks` for block ids) is
    raised, naming the offending values, for bools, non-integers and ints
    beyond int64; range checks against the space are the native core's.
    """

    import numpy as np

    def fail(message: str, bad: list[int] | None = None) -> ValueError:
        return InvalidBlocks(message, bad or []) if issubclass(error, InvalidBlocks) else error(message)

    torch = sys.modules.get("torch")  # a tensor can only come from a process that imported torch
    if torch is not None and isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    if isinstance(values, np.ndarray):
        arr = values
    else:
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise fail(f"{what} must be a sequence of ints, got {shown(values)}")
        seq: Any = values if isinstance(values, (list, tuple)) else list(values)
        kinds = set(map(type, seq))  # one C-speed pass; the slow scans below run only on an error
        if bool in kinds or np.bool_ in kinds:
            bools = [x for x in seq if isinstance(x, (bool, np.bool_))]
            raise fail(f"{what} must be ints, not bools: got {bools[:8]} in the batch")
        arr = np.asarray(seq)
        if arr.dtype == object:  # ints beyond int64/uint64, or mixed objects
            bad = [x for x in seq if not _is_int(x) or not -(2**63) <= int(x) <= INT64_MAX]
            raise fail(f"{what} {bad[:8]} are not ints in the int64 range",
                       [int(x) for x in bad[:8] if _is_int(x)])
    if arr.ndim != 1:
        raise fail(f"{what} must be a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise fail(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize >= 8 and int(arr.max()) > INT64_MAX:
        big = [int(x) for x in arr if int(x) > INT64_MAX]
        raise fail(f"{what} {big[:8]} are out of range", big)
    return np.ascontiguousarray(arr, dtype=np.int64)
