"""Pools: one physical budget shared by every engine process on the host.

A pool is a shared-memory ledger, ``/dev/shm/kvpool-<name>`` (mode 0600),
that KV spaces join as tenants. Every page commit is first claimed in the
ledger (claim before commit), so engines racing for the last pages can
neither over-commit the pool nor leak a claim; every release returns its
claim and wakes waiters in every process (a futex on the ledger's
generation word). A tenant whose process died is reaped by the next one to
take the ledger's lock, and its budget returned.

Default capacity: half of what the device has free when the pool is created
(``MemAvailable`` on the CPU, ``cuMemGetInfo`` on a CUDA device;
``KVPOOL_POOL_FRACTION`` overrides the fraction, ``capacity=`` the bytes).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import cast

from . import _core
from .errors import LedgerError

__all__ = ["Pool", "TenantInfo", "list_pools"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SHM = "/dev/shm"
DEFAULT_FRACTION = 0.5
_RESULTS = ("applied", "stale", "conflict", "same")


def check_pool_name(name: object) -> str:
    """Validate a pool name before anything touches the filesystem."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise LedgerError(
            f"bad pool name {name!r}: use 1-64 characters from [A-Za-z0-9._-], starting with a letter or digit"
        )
    return name


def default_pool_name() -> str:
    """The pool a manager joins by default: ``$KVPOOL_POOL``, else ``default``."""
    return check_pool_name(os.environ.get("KVPOOL_POOL", "default"))


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise LedgerError("cannot read MemAvailable from /proc/meminfo")


def default_capacity(device: str = "cpu") -> int:
    """A fraction of what the device has free now: MemAvailable on the CPU,
    cuMemGetInfo's free bytes on a CUDA device."""
    frac = float(os.environ.get("KVPOOL_POOL_FRACTION", DEFAULT_FRACTION))
    if not 0 < frac <= 1:
        raise LedgerError(f"KVPOOL_POOL_FRACTION must be in (0, 1], got {frac}")
    if device.startswith("cuda"):
        ordinal = int(device.partition(":")[2] or 0)
        code, free, _total, msg = _core.native.cuda_mem_info(ordinal)
        if code != _core.CODE_OK:
            raise LedgerError(f"cannot size a pool on {device}: {msg}")
        return int(free * frac)
    return int(_mem_available() * frac)


@dataclass(frozen=True)
class TenantInfo:
    """One live tenant of a pool, as its ledger slot says."""

    slot: int
    pid: int
    name: str
    committed_bytes: int
    limit_bytes: int | None
    limit_revision: int
    limit_state: str  # "applied" or "deferred"
    waiting: int
    reserve_pages: int


class Pool:
    """A handle on a pool ledger (joining does not make this process a tenant).

    ``Pool("name")`` creates the pool if it does not exist (with
    ``capacity`` bytes, default: a fraction of MemAvailable) or joins it
    (``capacity`` is then ignored: the creator's stands). ``create=False``
    only joins and raises :class:`LedgerError` if the pool is missing.
    """

    def __init__(self, name: str = "default", *, capacity: int | None = None, create: bool = True,
                 device: str = "cpu") -> None:
        check_pool_name(name)
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0):
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        cap = capacity if capacity is not None else (default_capacity(device) if create else 0)
        _code, msg, ledger = _core.native.open_ledger(name, cap, create)
        if ledger is None:
            raise LedgerError(msg)
        self.name = name
        self._ledger = cast(_core.native.Ledger, ledger)

    @property
    def capacity(self) -> int:
        return int(self._ledger.capacity)

    @property
    def committed(self) -> int:
        """Bytes committed by every live tenant together."""
        return int(self._ledger.committed_total)

    def tenants(self) -> list[TenantInfo]:
        """Live tenants (dead ones are reaped first)."""
        out = []
        for slot, pid, name, committed, limit, rev, state, waiting, reserve in self._ledger.tenants():
            out.append(TenantInfo(slot, pid, name, committed, None if limit < 0 else limit, rev,
                                  "applied" if state == 0 else "deferred", waiting, reserve))
        return out

    def set_limit(self, tenant: str, limit_bytes: int | None, *, revision: int | None = None) -> str:
        """Cap a tenant's committed bytes; returns ``applied``, ``stale``, ``conflict`` or ``same``.

        The tenant applies it natively (stops growing, gives idle pages back)
        even with its reserve thread off; its ``limit_state`` turns from
        ``deferred`` to ``applied`` once its use is under the limit.
        """
        if limit_bytes is not None and (isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int)
                                        or limit_bytes < 0):
            raise ValueError(f"limit_bytes must be a non-negative int or None, got {limit_bytes!r}")
        code, result, msg = self._ledger.set_limit(tenant, -1 if limit_bytes is None else limit_bytes,
                                                   -1 if revision is None else revision)
        if code != _core.CODE_OK:
            raise LedgerError(msg)
        return _RESULTS[result]

    def reap(self) -> int:
        """Reap tenants whose process died; returns how many."""
        return int(self._ledger.reap())

    def __repr__(self) -> str:
        return f"<Pool {self.name}: {self.committed / 2**20:.1f}/{self.capacity / 2**20:.1f} MiB committed>"

    @staticmethod
    def remove(name: str) -> None:
        """Delete a pool's ledger file, ``/dev/shm/kvpool-<name>`` (missing: nothing to do).

        A ledger outlives its last tenant (it is a file, not a process);
        ``kvpool pools`` marks such pools ``stale`` and ``kvpool pools --gc``
        removes them. Tenants still attached keep working on the removed
        ledger, but a process that joins the name afterwards makes a new pool
        with a budget of its own: remove a pool only when none of its
        tenants is alive (``tenants()`` is empty), as ``--gc`` does.
        """
        check_pool_name(name)
        try:
            os.unlink(os.path.join(_SHM, f"kvpool-{name}"))
        except FileNotFoundError:
            pass


def ledger_path(name: str) -> str:
    """Where a pool's ledger lives."""
    return os.path.join(_SHM, f"kvpool-{check_pool_name(name)}")


def list_pools() -> list[str]:
    """Names of the pools on this host."""
    try:
        entries = os.listdir(_SHM)
    except OSError:
        return []
    return sorted(e[len("kvpool-"):] for e in entries if e.startswith("kvpool-") and _NAME.fullmatch(e[7:]))
