"""Sizes in and out: the one formatter (native, shared with the core's
messages) and the operator commands' size parser.

Out: :func:`format_size` gives ``"128.0 MiB"``, ``"1.0 PiB"`` (binary units,
one decimal); :func:`format_size_exact` adds the byte count where that
rounds (``"11.8 MiB (12345678 bytes)"``): errors about a limit or a capacity
use it, since the operator compares them with what they typed. Both are the
native core's (``native/sizes.hpp``), so a native message and a Python one
write the same size the same way.

In: :func:`parse_size` takes what the CLI takes: a number with a unit,
``B`` for bytes, ``K``/``KiB``/``KB``, ``M``..., ``G``..., ``T``... (all
binary: a KV cache is sized in powers of two), or ``none``. A bare number is
refused (``kvpool limit P t 10`` meaning 10 bytes was a trap, issue 32), and
so is a negative one, each with a message that says what to write.
"""

from __future__ import annotations

import re

from . import _core

__all__ = ["SizeError", "format_size", "format_size_exact", "parse_size"]

_SIZE = re.compile(r"\s*([+-]?)(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_UNITS = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SPELLINGS = {"", "b", "ib"}  # after the letter: K, KB, KiB (any case)
_HOW = "write a number with a unit: B, K, M, G or T (KiB, MiB, ... alike: binary), e.g. 512MiB or 2G"


class SizeError(ValueError):
    """A size the operator commands cannot read (the message says what to write)."""


_INT64 = range(-(2**63), 2**63)


def format_size(n: int) -> str:
    """``n`` bytes as people read them: ``"128.0 MiB"``, ``"1.0 PiB"``, ``"512 B"``."""
    n = int(n)
    # Beyond int64 (only a geometry or a typo can get there): the count itself.
    return str(_core.native.format_size(n)) if n in _INT64 else f"{n} bytes"


def format_size_exact(n: int) -> str:
    """:func:`format_size`, with the exact count where that rounds."""
    n = int(n)
    return str(_core.native.format_size_exact(n)) if n in _INT64 else f"{n} bytes"


def parse_size(text: str, *, allow_none: bool = True) -> int | None:
    """``"512MiB"``, ``"1.5G"``, ``"4096B"`` -> bytes; ``"none"`` -> ``None`` (if allowed).

    Raises :class:`SizeError` for a bare number, a negative size, an unknown
    unit or a fraction of a byte.
    """
    if allow_none and text.strip().lower() == "none":
        return None
    m = _SIZE.fullmatch(text)
    unit = (m.group(3) if m else "").lower()
    if m is None or (unit and (unit[0] not in _UNITS or unit[1:] not in _SPELLINGS or unit[0] == "b" and unit != "b")):
        extra = ", or 'none'" if allow_none else ""
        raise SizeError(f"bad size {text!r}: {_HOW}{extra}")
    sign, num = m.group(1), m.group(2)
    if sign == "-" and float(num) != 0:
        raise SizeError(f"bad size {text!r}: a size cannot be negative")
    if not unit:
        raise SizeError(f"bad size {text!r}: a size needs a unit ({num}B for bytes, {num}MiB, {num}G, ...)")
    mult = _UNITS[unit[0]]
    if "." in num:
        whole, _, frac = num.partition(".")
        # Exact arithmetic: 1.1 GiB in floats is not a whole number of bytes
        # even where the decimal is.
        scale: int = 10 ** len(frac)
        scaled = int(whole or "0") * mult * scale + int(frac or "0") * mult
        if scaled % scale:
            raise SizeError(f"bad size {text!r}: not a whole number of bytes")
        return scaled // scale
    return int(num) * mult
