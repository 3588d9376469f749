"""The pool ledger's byte layout, mirrored from native/ledger.hpp with ctypes
(not collected: a helper for the hostile tests that write a segment by hand).

    offset 0                                                       18984
    | header (40 B) | slot 0 (296 B) | slot 1 | ... | slot 63 |
      magic u64, version u32, header_bytes u32, capacity i64,
      generation u32, pad u32, tickets u64

    slot: pid i32 | live u32 | pidns u64 | start_time u64 | name[72] |
          claimed | pending | want | wait_ticket | waiting i32 | limit_state i32 |
          reserve_pages | lending i32 | no_preempt i32 | judged_revision | headroom | keep_free |
          allocs u64 | shortages u64 | freeing | preempt_bytes | preempt_asked u64 |
          preempted u64 | recomputed_tokens u64 | reclaimed_completion u64 | reclaimed_preemption u64 |
          reclaimed_eviction u64 | settings: seq u64, limit,
          limit_revision, guarantee, guarantee_revision

`check(path)` proves the mirror against a real segment (its size and header
fields), so a layout change in ledger.hpp fails loudly here, not as a
mysterious hostile-test result.
"""

from __future__ import annotations

import ctypes
import os

MAX_TENANTS = 64
NAME_BYTES = 72


class SlotSettings(ctypes.Structure):
    _fields_ = [("seq", ctypes.c_uint64), ("limit", ctypes.c_int64), ("limit_revision", ctypes.c_int64),
                ("guarantee", ctypes.c_int64), ("guarantee_revision", ctypes.c_int64)]


class TenantSlot(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_int32), ("live", ctypes.c_uint32), ("pidns", ctypes.c_uint64),
                ("start_time", ctypes.c_uint64), ("name", ctypes.c_char * NAME_BYTES),
                ("claimed", ctypes.c_int64), ("pending", ctypes.c_int64), ("want", ctypes.c_int64),
                ("wait_ticket", ctypes.c_uint64), ("waiting", ctypes.c_int32), ("limit_state", ctypes.c_int32),
                ("reserve_pages", ctypes.c_int64), ("lending", ctypes.c_int32), ("no_preempt", ctypes.c_int32),
                ("judged_revision", ctypes.c_int64), ("headroom", ctypes.c_int64), ("keep_free", ctypes.c_int64),
                ("allocs", ctypes.c_uint64), ("shortages", ctypes.c_uint64),
                ("freeing", ctypes.c_int64), ("preempt_bytes", ctypes.c_int64),
                ("preempt_asked", ctypes.c_uint64), ("preempted", ctypes.c_uint64),
                ("recomputed_tokens", ctypes.c_uint64), ("reclaimed_completion", ctypes.c_uint64),
                ("reclaimed_preemption", ctypes.c_uint64), ("reclaimed_eviction", ctypes.c_uint64),
                ("settings", SlotSettings)]


class LedgerHeader(ctypes.Structure):
    _fields_ = [("magic", ctypes.c_uint64), ("version", ctypes.c_uint32), ("header_bytes", ctypes.c_uint32),
                ("capacity", ctypes.c_int64), ("generation", ctypes.c_uint32), ("last_exit", ctypes.c_uint32),
                ("tickets", ctypes.c_uint64), ("tenants", TenantSlot * MAX_TENANTS)]


SLOTS_OFFSET = LedgerHeader.tenants.offset
SLOT_BYTES = ctypes.sizeof(TenantSlot)
SEQ_OFFSET = TenantSlot.settings.offset + SlotSettings.seq.offset  # within a slot


def path_of(pool: str) -> str:
    return f"/dev/shm/kvpool-{pool}"


def slot_offset(slot: int) -> int:
    return SLOTS_OFFSET + slot * SLOT_BYTES


def read(pool: str) -> LedgerHeader:
    with open(path_of(pool), "rb") as f:
        return LedgerHeader.from_buffer_copy(f.read())


def check(pool: str) -> None:
    """Fail unless this mirror matches the real segment of ``pool``."""
    size = os.stat(path_of(pool)).st_size
    assert size == ctypes.sizeof(LedgerHeader), (
        f"ledger.hpp changed: the segment is {size} bytes, this mirror {ctypes.sizeof(LedgerHeader)}")
    h = read(pool)
    assert h.magic == 0x4B56504F4F4C4C34 and h.version == 6 and h.header_bytes == size, "ledger.hpp changed"


def slot_of(pool: str, tenant: str) -> int:
    h = read(pool)
    for i, t in enumerate(h.tenants):
        if t.pid > 0 and t.live == 1 and t.name == tenant.encode():
            return i
    raise LookupError(f"no live tenant {tenant!r} in pool {pool!r}")


def write_at(pool: str, offset: int, data: bytes) -> None:
    """Write bytes into the live segment (the file shares pages with every mapping)."""
    fd = os.open(path_of(pool), os.O_RDWR | os.O_NOFOLLOW)
    try:
        assert os.pwrite(fd, data, offset) == len(data)
    finally:
        os.close(fd)


class live_locks:
    """Hold the liveness locks of ``slots`` (ledger.hpp: a live tenant holds an
    open-file-description lock on its slot's first byte), so rows written by
    hand look like live tenants of another PID namespace instead of being
    reaped as dead ones. A context manager; the locks go with it."""

    def __init__(self, pool: str, slots: list[int] | tuple[int, ...]) -> None:
        import fcntl

        self.fd = os.open(path_of(pool), os.O_RDWR | os.O_NOFOLLOW)
        for slot in slots:  # a process-associated lock: it conflicts with the ledger's OFD locks all the same
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, slot_offset(slot), os.SEEK_SET)

    def __enter__(self) -> live_locks:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
