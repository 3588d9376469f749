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
(on the CPU the smaller of ``MemAvailable`` and the room left in this
process's memory cgroup; ``cuMemGetInfo`` on a CUDA device;
``KVPOOL_POOL_FRACTION`` overrides the fraction, ``capacity=`` the bytes).

The memory cgroup matters because out of memory at commit is not a shortage
the pool can report: a commit past the cgroup's ``memory.max`` is answered by
the cgroup's OOM killer with SIGKILL (issue 10, D13). So the default stays
inside the cgroup, and an explicit capacity larger than the machine (or the
cgroup) can back at all is refused unless the caller says ``overcommit=True``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import cast

from . import _core
from . import _validate as V
from ._sizes import format_size, format_size_exact
from .errors import LedgerError

__all__ = ["MemoryCgroup", "Pool", "PoolSnapshot", "TenantInfo", "backing_memory", "cgroup_memory",
           "default_capacity", "list_pools"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SHM = "/dev/shm"
DEFAULT_FRACTION = 0.5


def check_pool_name(name: object) -> str:
    """Validate a pool name before anything touches the filesystem."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise LedgerError(
            f"bad pool name {V.shown(name)}: use 1-64 characters from [A-Za-z0-9._-], starting with a letter or digit"
        )
    return name


def default_pool_name() -> str:
    """The pool a manager joins by default: ``$KVPOOL_POOL``, else ``default``."""
    return check_pool_name(os.environ.get("KVPOOL_POOL", "default"))


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise LedgerError(f"cannot read {key} from /proc/meminfo")


# -------------------------------------------------------------- memory cgroup
#
# v2: /sys/fs/cgroup/<path>/memory.max ("max" = none) and memory.current;
# v1: /sys/fs/cgroup/memory/<path>/memory.limit_in_bytes (a huge number =
# none) and memory.usage_in_bytes; <path> from /proc/self/cgroup. A parent's
# limit binds its children too, so every ancestor is read up to the root and
# the tightest wins. Usage counts the page cache; its inactive part is
# reclaimable (as MemAvailable counts it), so it is not taken as used.
# KVPOOL_CGROUP names the cgroup directory to start from (tests, containers
# whose /proc/self/cgroup path is not visible under the mount).

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
_V1_UNLIMITED = 1 << 62  # v1 writes "no limit" as PAGE_COUNTER_MAX pages: ~2**63


@dataclass(frozen=True)
class MemoryCgroup:
    """The memory cgroup that binds this process most tightly."""

    path: str        # the cgroup directory with the least room left
    headroom: int    # bytes still free under every limit above this process (>= 0)
    limit: int       # the lowest limit above this process, in bytes
    limit_path: str  # the cgroup directory that sets it


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _inactive_file(directory: str, key: str) -> int:
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_starts() -> list[tuple[str, str]]:
    """(directory, version) of this process's memory cgroups, leaf first."""
    override = os.environ.get("KVPOOL_CGROUP")
    if override:
        version = "v1" if os.path.exists(os.path.join(override, "memory.limit_in_bytes")) else "v2"
        return [(override, version)]
    starts = []
    try:
        with open(PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            mount, version = CGROUP_ROOT, "v2"
        elif "memory" in controllers.split(","):
            mount, version = os.path.join(CGROUP_ROOT, "memory"), "v1"
        else:
            continue
        leaf = os.path.normpath(os.path.join(mount, path.lstrip("/")))
        starts.append((leaf if os.path.isdir(leaf) else mount, version))
    return starts


def cgroup_memory() -> MemoryCgroup | None:
    """The tightest memory cgroup limit above this process, or ``None`` when none binds."""
    levels: list[MemoryCgroup] = []
    for start, version in _cgroup_starts():
        limit_file, usage_file, cache_key = (
            ("memory.max", "memory.current", "inactive_file") if version == "v2"
            else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        )
        d = start
        # Up to the first directory without the file: above the cgroup tree
        # (v2's root cgroup has no memory.max either).
        while os.path.exists(os.path.join(d, limit_file)):
            limit = _read_int(os.path.join(d, limit_file))
            if limit is not None and limit < _V1_UNLIMITED:
                used = (_read_int(os.path.join(d, usage_file)) or 0) - _inactive_file(d, cache_key)
                levels.append(MemoryCgroup(d, max(0, limit - max(0, used)), limit, d))
            if os.path.dirname(d) == d:
                break
            d = os.path.dirname(d)
    if not levels:
        return None
    room = min(levels, key=lambda c: c.headroom)
    low = min(levels, key=lambda c: c.limit)
    return MemoryCgroup(room.path, room.headroom, low.limit, low.limit_path)


def _fraction() -> float:
    raw = os.environ.get("KVPOOL_POOL_FRACTION")
    if raw is None:
        return DEFAULT_FRACTION
    try:
        frac = float(raw)
    except ValueError:
        frac = float("nan")
    if not 0 < frac <= 1:  # NaN fails too
        raise LedgerError(f"KVPOOL_POOL_FRACTION must be a number in (0, 1], got {V.shown(raw)}")
    return frac


def default_capacity(device: str = "cpu") -> int:
    """A fraction of what the device has free now: on the CPU the smaller of
    MemAvailable and the room left in this process's memory cgroup,
    cuMemGetInfo's free bytes on a CUDA device. Never 0: a fraction that leaves
    nothing is refused with :class:`LedgerError`."""
    device = V.device(device)
    frac = _fraction()
    if device.startswith("cuda"):
        mem = _core.native.cuda_mem_info(int(device.partition(":")[2]))
        if mem.code != _core.CODE_OK:
            raise LedgerError(f"cannot size a pool on {device}: {mem.message}")
        free_bytes, what = int(mem.free_bytes), f"{device} free memory"
    else:
        free_bytes, what = _meminfo("MemAvailable"), "MemAvailable"
        cg = cgroup_memory()
        if cg is not None and cg.headroom < free_bytes:
            free_bytes, what = cg.headroom, f"room left in the memory cgroup {cg.path}"
    capacity = int(free_bytes * frac)
    if capacity <= 0:
        raise LedgerError(
            f"a default pool would hold nothing: KVPOOL_POOL_FRACTION {frac} x {what} "
            f"{format_size_exact(free_bytes)} = {format_size_exact(capacity)}; raise the fraction or pass capacity="
        )
    return capacity


def backing_memory(device: str = "cpu") -> tuple[int, str] | None:
    """The most bytes ``device`` can back at all, and where that figure comes from
    (on the CPU the smaller of MemTotal and this process's memory cgroup limit);
    ``None`` where the device cannot say."""
    device = V.device(device)
    if device.startswith("cuda"):
        mem = _core.native.cuda_mem_info(int(device.partition(":")[2]))
        return (int(mem.total_bytes), f"{device} total memory") if mem.code == _core.CODE_OK else None
    total, what = _meminfo("MemTotal"), "MemTotal"
    cg = cgroup_memory()
    if cg is not None and cg.limit < total:
        total, what = cg.limit, f"the memory cgroup limit of {cg.limit_path}"
    return total, what


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
    restoring: bool                # gives back what other tenants keep free (their headroom)
    headroom_bytes: int            # of its unused guarantee, asked to be kept free from borrowers
    keep_free_bytes: int           # what that asks now: min(headroom, guarantee - committed)
    visible: bool                  # in this PID namespace (its liveness is judged here)
    allocs: int                    # allocs granted since it joined (monotonic)
    shortages: int                 # allocs refused for lack of memory or admission (monotonic)
    # Reclaim by completion first (issue 31; kvpool.BudgetStats says more).
    freeing_bytes: int = 0         # its running requests free within the reclaim bound (engine-published)
    preempt_bytes: int = 0         # while lending: what it is asked to preempt now (0: by completion only)
    preemptions_asked: int = 0     # verdicts with preempt_bytes > 0 its engine acted on (monotonic)
    requests_preempted: int = 0    # (monotonic)
    tokens_recomputed: int = 0     # prompt and generated tokens of preempted requests (monotonic)
    reclaimed_by_completion_bytes: int = 0  # block bytes given back while lending by requests finishing
    reclaimed_by_preemption_bytes: int = 0  # block bytes given back by preemption
    reclaimed_by_eviction_bytes: int = 0  # block bytes of cached blocks dropped while lending (a prefix cache)
    preempts: bool = True          # its engine acts on the verdict (False: by completion only, never asked)


# A pool with no live tenant is one of two kinds (issue 32): *empty*, made
# for later or left cleanly by everyone (keep it: servers are about to join
# it, and it holds the capacity the operator chose), or *stale*, its last
# tenant died without leaving (the books of a crash: `kvpool pools --gc`
# removes it). The ledger records how its last tenant went (LastExit).
_LAST_EXIT = {0: "none", 1: "left", 2: "died"}


@dataclass(frozen=True)
class PoolSnapshot:
    """Every live tenant read in one pass; ``committed`` is the sum of these rows."""

    name: str
    capacity: int
    committed: int
    tenants: list[TenantInfo]
    last_exit: str = "none"  # how the last tenant to go went: "none" yet, "left" cleanly, "died"

    @property
    def status(self) -> str:
        """``"in use"`` (a live tenant), ``"empty"`` (none, and none died) or ``"stale"``."""
        if self.tenants:
            return "in use"
        return "stale" if self.last_exit == "died" else "empty"


class Pool:
    """A handle on a pool ledger (joining does not make this process a tenant).

    ``Pool("name")`` creates the pool if it does not exist (with
    ``capacity`` bytes, default: :func:`default_capacity`) or joins it.
    Joining with an explicit ``capacity`` other than the pool's raises
    :class:`LedgerError` (a pool's capacity is its creator's; asking for
    another one silently got the old one, issue 32): pass no capacity to
    join whatever it is. ``create=False`` only joins and raises
    :class:`LedgerError` if the pool is missing.

    A ``capacity`` larger than the device can back at all (MemTotal or the
    memory cgroup's limit on the CPU, the device's total on CUDA) is refused
    with :class:`LedgerError` unless ``overcommit=True``: commits beyond the
    backing would meet the OOM killer, not a :class:`PoolExhausted`.
    """

    def __init__(self, name: str = "default", *, capacity: int | None = None, create: bool = True,
                 device: str = "cpu", overcommit: bool = False) -> None:
        check_pool_name(name)
        capacity = V.optional_integer("capacity", capacity, lo=1)
        create = V.flag("create", create)
        overcommit = V.flag("overcommit", overcommit)
        device = V.device(device)
        if capacity is not None and create and not overcommit:
            backing = backing_memory(device)
            if backing is not None and capacity > backing[0]:
                raise LedgerError(
                    f"capacity {format_size_exact(capacity)} is more than this machine can back: {backing[1]} "
                    f"is {format_size_exact(backing[0])}; use capacity <= {backing[0]}, or pass overcommit=True "
                    "to create it anyway (commits beyond the backing are OOM-killed, not refused)"
                )
        cap = capacity if capacity is not None else (default_capacity(device) if create else 0)
        opened = _core.native.open_ledger(name, cap, create)
        if opened.value is None:
            if opened.code == _core.CODE_INVALID and "capacity" in opened.message:
                raise ValueError(opened.message)
            raise LedgerError(opened.message)
        self.name = name
        self._ledger = cast(_core.native.Ledger, opened.value)
        if capacity is not None and self._ledger.capacity != capacity:
            raise LedgerError(
                f"pool {name!r} exists with capacity {format_size_exact(self._ledger.capacity)}, not the "
                f"{format_size_exact(capacity)} asked for: a pool keeps its creator's capacity. Join it without "
                f"capacity=, or, once no tenant is left in it, remove it (`kvpool pools --gc --empty {name}`) "
                "and create it again"
            )

    @property
    def capacity(self) -> int:
        return int(self._ledger.capacity)

    @property
    def committed(self) -> int:
        """Bytes claimed by every live tenant together (the sum of the snapshot's rows)."""
        return self.snapshot().committed

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
                want_bytes=r.want, lending=bool(r.lending), restoring=bool(r.restoring),
                headroom_bytes=r.headroom,
                keep_free_bytes=r.keep_free, visible=bool(r.visible),
                allocs=r.allocs, shortages=r.shortages, freeing_bytes=r.freeing, preempt_bytes=r.preempt_bytes,
                preemptions_asked=r.preempt_asked, requests_preempted=r.preempted,
                tokens_recomputed=r.recomputed_tokens, reclaimed_by_completion_bytes=r.reclaimed_completion,
                reclaimed_by_preemption_bytes=r.reclaimed_preemption,
                reclaimed_by_eviction_bytes=r.reclaimed_eviction, preempts=bool(r.preempts),
            ))
        # The total is the sum of these rows (claims in flight, counted by
        # the ledger's judges, are in neither).
        return PoolSnapshot(self.name, int(snap.capacity), sum(t.committed_bytes for t in tenants), tenants,
                            _LAST_EXIT[int(snap.last_exit.value)])

    def tenants(self) -> list[TenantInfo]:
        """Live tenants (dead ones of this PID namespace are reaped first)."""
        self._ledger.reap()
        return self.snapshot().tenants

    def _set(self, tenant: str, guarantee: bool, value: int | None, revision: int | None) -> str:
        what = "guarantee_bytes" if guarantee else "limit_bytes"
        tenant = V.text("tenant", tenant)
        value = V.optional_integer(what, value)
        revision = V.optional_integer("revision", revision, hi=2**53)
        out = self._ledger.set_setting(tenant, guarantee, -1 if value is None else value,
                                       -1 if revision is None else revision)
        if out.code == _core.CODE_INVALID:
            raise ValueError(out.message)
        if out.code != _core.CODE_OK:
            raise LedgerError(out.message)
        return out.result.name.lower()  # applied, stale, conflict or same

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
        return f"<Pool {self.name}: {format_size(self.committed)} of {format_size(self.capacity)} committed>"

    @staticmethod
    def remove(name: str) -> None:
        """Delete a pool's ledger file, ``/dev/shm/kvpool-<name>`` (missing: nothing to do).

        A ledger outlives its last tenant (it is a file, not a process);
        ``kvpool pools`` marks a pool whose last tenant died ``stale`` and one
        left cleanly (or not joined yet) ``empty``; ``kvpool pools --gc``
        removes the stale ones, ``--gc --empty`` the empty ones too. Tenants still attached keep working on the removed
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
