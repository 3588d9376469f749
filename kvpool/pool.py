"""Pools: one physical budget shared by every engine process on the host.

A pool is a shared-memory ledger, ``/dev/shm/kvpool-<name>`` (mode 0600,
owned by this user: a segment anyone else made is refused), that KV spaces
join as tenants. Every page commit is first claimed in the ledger (claim
before commit), so engines racing for the last pages can neither
over-commit the pool nor leak a claim; every release returns its claim and
wakes waiters in every process (a futex on the ledger's generation word).
The ledger has no lock: no tenant, stopped, dead or hostile, can make
another wait (native/ledger.hpp). A tenant whose process died is reaped by
whoever notices (only tenants in this PID namespace are judged), and its
budget returned.

Fair share: every tenant has a guarantee (explicit, or an equal share of
the capacity among the live tenants); above it a tenant borrows what no one
waits for, and lends it back while a tenant below its guarantee waits.

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

__all__ = ["Pool", "PoolSnapshot", "TenantInfo", "list_pools"]

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
    guarantee_bytes: int           # in force: explicit, or the equal default share
    guarantee_setting: int | None  # explicit guarantee (None: the default share)
    guarantee_revision: int
    borrowed_bytes: int            # committed above the guarantee
    want_bytes: int                # what its waiting requests need beyond what it holds
    lending: bool                  # gives memory back to a tenant below its guarantee
    visible: bool                  # in this PID namespace (its liveness is judged here)


@dataclass(frozen=True)
class PoolSnapshot:
    """Every live tenant read in one pass; ``committed`` is the sum of these rows."""

    name: str
    capacity: int
    committed: int
    tenants: list[TenantInfo]


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
            if _code == _core.CODE_INVALID and "capacity" in msg:
                raise ValueError(msg)
            raise LedgerError(msg)
        self.name = name
        self._ledger = cast(_core.native.Ledger, ledger)

    @property
    def capacity(self) -> int:
        return int(self._ledger.capacity)

    @property
    def committed(self) -> int:
        """Bytes claimed by every live tenant together."""
        return int(self._ledger.snapshot().claimed_total)

    def snapshot(self) -> PoolSnapshot:
        """Capacity, total and tenants from one read of the ledger (never waits on a tenant)."""
        snap = self._ledger.snapshot()
        tenants = []
        for r in snap.rows:
            g = int(snap.guarantee_of(r))
            tenants.append(TenantInfo(
                slot=r.slot, pid=r.pid, name=r.name, committed_bytes=r.claimed,
                limit_bytes=None if r.limit < 0 else r.limit, limit_revision=r.limit_revision,
                limit_state="deferred" if r.limit_state == 1 else "applied", waiting=r.waiting,
                reserve_pages=r.reserve_pages, guarantee_bytes=g,
                guarantee_setting=None if r.guarantee < 0 else r.guarantee,
                guarantee_revision=r.guarantee_revision, borrowed_bytes=max(0, r.claimed - g),
                want_bytes=r.want, lending=bool(r.lending), visible=bool(r.visible),
            ))
        return PoolSnapshot(self.name, int(snap.capacity), int(snap.claimed_total), tenants)

    def tenants(self) -> list[TenantInfo]:
        """Live tenants (dead ones of this PID namespace are reaped first)."""
        self._ledger.reap()
        return self.snapshot().tenants

    def _set(self, tenant: str, guarantee: bool, value: int | None, revision: int | None) -> str:
        what = "guarantee_bytes" if guarantee else "limit_bytes"
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{what} must be an int or None, got {value!r}")
        if value is not None and not 0 <= value < 2**63:
            raise ValueError(f"{what} must be in [0, 2**63) or None, got {value!r}")
        if revision is not None and (isinstance(revision, bool) or not isinstance(revision, int)):
            raise TypeError(f"revision must be an int or None, got {revision!r}")
        if revision is not None and not 0 <= revision <= 2**53:
            raise ValueError(f"revision must be in [0, 2**53] or None, got {revision!r}")
        if not isinstance(tenant, str):
            raise TypeError(f"tenant must be a str, got {tenant!r}")
        code, result, msg = self._ledger.set_setting(tenant, guarantee, -1 if value is None else value,
                                                     -1 if revision is None else revision)
        if code == _core.CODE_INVALID:
            raise ValueError(msg)
        if code != _core.CODE_OK:
            raise LedgerError(msg)
        return _RESULTS[result]

    def set_limit(self, tenant: str, limit_bytes: int | None, *, revision: int | None = None) -> str:
        """Cap a tenant's committed bytes; returns ``applied``, ``stale``, ``conflict`` or ``same``.

        The tenant applies it natively (stops growing, gives idle pages back)
        even with its reserve thread off; its ``limit_state`` turns from
        ``deferred`` to ``applied`` once its use is under the limit.
        """
        return self._set(tenant, False, limit_bytes, revision)

    def set_guarantee(self, tenant: str, guarantee_bytes: int | None, *, revision: int | None = None) -> str:
        """Guarantee a tenant ``guarantee_bytes`` (``None``: back to the equal default share).

        Revisioned like limits. Explicit guarantees may not add up to more
        than the capacity: such a setting raises ``ValueError`` with the numbers.
        """
        return self._set(tenant, True, guarantee_bytes, revision)

    def reap(self) -> int:
        """Reap tenants whose process died; returns how many."""
        return int(self._ledger.reap())

    def __repr__(self) -> str:
        return f"<Pool {self.name}: {self.committed / 2**20:.1f}/{self.capacity / 2**20:.1f} MiB committed>"

    @staticmethod
    def remove(name: str) -> None:
        """Delete a pool's ledger file (tenants already attached keep working)."""
        check_pool_name(name)
        try:
            os.unlink(os.path.join(_SHM, f"kvpool-{name}"))
        except FileNotFoundError:
            pass


def list_pools() -> list[str]:
    """Names of the pools on this host."""
    try:
        entries = os.listdir(_SHM)
    except OSError:
        return []
    return sorted(e[len("kvpool-"):] for e in entries if e.startswith("kvpool-") and _NAME.fullmatch(e[7:]))
