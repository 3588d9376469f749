"""kvpool native core (private: use the kvpool package)"""

from typing import Annotated

import numpy
from numpy.typing import NDArray


CODE_OK: int = 0

CODE_SHORTAGE: int = 1

CODE_INVALID: int = 2

CODE_BACKEND: int = 3

CODE_CLOSED: int = 4

CODE_LEDGER: int = 5

def cpu_granularity() -> int:
    """Smallest page size step of the CPU backend."""

def cuda_unavailable_reason() -> str:
    """Why the CUDA backend cannot be used here (empty when it can)."""

def cuda_mem_info(device: int) -> tuple[int, int, int, str]:
    """(code, free bytes, total bytes, message) of a CUDA device."""

def page_ranges(page_bytes: int, block_bytes: int, num_blocks: int) -> tuple[object, object]:
    """Per-page block ranges [first, last) of a geometry (the one formula)."""

class Space:
    def alloc(self, n: int) -> tuple[int, object, int, int, str]:
        """
        All-or-nothing: (code, ids | None, available, pages committed inline, message).
        """

    def free(self, ids: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)]) -> tuple[int, list[int], int, int, str]:
        """
        Validates the whole batch first: (code, bad_ids, pages released inline, available after, message).
        """

    def available(self) -> int: ...

    def trim(self) -> tuple[int, int, str]:
        """Release every idle committed page: (code, released, message)."""

    def set_limit(self, limit_bytes: int, revision: int) -> tuple[int, int, str]:
        """
        Set and apply this tenant's one limit (-1: none); in a pool under `revision` (-1: next): (code, result: 0 applied 1 stale 2 conflict 3 same, message).
        """

    def set_reserve(self, min_pages: int, max_pages: int) -> tuple[int, str]: ...

    def page_occupancy(self, pages: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)]) -> tuple[int, object, object, str]:
        """(code, used blocks, page states, message)."""

    def stats(self) -> dict[str, object]: ...

    def settle(self, timeout_s: float) -> bool:
        """Wait until the reserve thread is idle; False on timeout."""

    def inject_fault(self, kind: int, nth: int, errno: int) -> None:
        """Test-only: fail the nth next commit (0) or release (1)."""

    def allocated_bytes(self) -> int:
        """Bytes the backend really holds (memfd st_blocks on CPU)."""

    def region(self, region: int) -> Annotated[NDArray[numpy.uint8], dict(shape=(None,))]:
        """Region memory as a DLPack-capable byte array."""

    def memory(self) -> Annotated[NDArray[numpy.uint8], dict(shape=(None,))]:
        """All regions, back to back, as one DLPack-capable byte array."""

    @property
    def share_fd(self) -> int:
        """The memfd another process can map (-1: none)."""

    def report_waiting(self, waiting: int) -> None: ...

    def ledger_limit(self) -> tuple[int, int]:
        """
        (limit bytes, revision) in the pool for this tenant; (-1, -1) without a pool.
        """

    @property
    def eventfd(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...

class Ledger:
    @property
    def name(self) -> str: ...

    @property
    def capacity(self) -> int: ...

    @property
    def committed_total(self) -> int: ...

    def tenants(self) -> list[tuple[int, int, str, int, int, int, int, int, int]]:
        """
        (slot, pid, name, committed, limit, limit_revision, limit_state, waiting, reserve_pages) per live tenant.
        """

    def set_limit(self, tenant: str, limit_bytes: int, revision: int) -> tuple[int, int, str]:
        """
        (code, result: 0 applied 1 stale 2 conflict 3 same, message); revision < 0 = next.
        """

    def reap(self) -> int: ...

    def inject_crash_mid_release(self) -> None:
        """
        Test hook: the next release kills this process inside the ledger's critical section.
        """

def open_ledger(name: str, capacity: int, create: bool) -> tuple[int, str, object]:
    """Open (or create) a pool ledger: (code, message, Ledger | None)."""

def create_space(num_regions: int, page_bytes: int, block_bytes: int, num_blocks: int, null_block: bool, reserve_min: int, reserve_max: int, reserve_thread: bool, limit_bytes: int, device: str, ledger: Ledger | None, tenant: str) -> tuple[int, str, object]:
    """
    Create a KV space, as a tenant of `ledger` if given: (code, message, Space | None).
    """
