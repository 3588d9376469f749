"""A CPU space's memory seen from another process, and whether CUDA can back a space.

The owner of a space keeps the allocator; another process that only needs
to read or write the blocks it is handed (a worker) maps the same memory
file through :func:`map_shared`, with no message per page.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import _core
from . import _validate as V
from .errors import BackendError

__all__ = ["SharedMemory", "cuda_unavailable_reason", "map_shared"]


@dataclass(frozen=True)
class SharedMemory:
    """What another process needs to map a CPU space's memory (:func:`map_shared`).

    The owner keeps the allocator (alloc, free, commits); the other process
    only maps the same memory file, so pages the owner commits are visible
    there with no message per page. It must never write outside blocks the
    owner handed out: a write into a released page would allocate memory
    behind the ledger's back.
    """

    pid: int
    fd: int
    size: int


def map_shared(shared: SharedMemory) -> torch.Tensor:
    """Map ``shared`` (from :meth:`KVSpace.shared_memory` in another process).

    Returns a flat ``uint8`` tensor over all regions, laid out as
    :meth:`KVSpace.memory`. The mapping lives as long as the tensor.
    """
    import mmap

    if not isinstance(shared, SharedMemory):
        raise TypeError(f"map_shared takes the SharedMemory of KVSpace.shared_memory(), got {shared!r}")
    V.integer("SharedMemory.pid", shared.pid, lo=1, hi=2**31 - 1)
    V.integer("SharedMemory.fd", shared.fd, hi=2**31 - 1)
    V.integer("SharedMemory.size", shared.size)
    path = f"/proc/{shared.pid}/fd/{shared.fd}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise BackendError(f"cannot open the shared KV memory {path}: {e} (is the owner process alive?)") from e
    try:
        size = os.fstat(fd).st_size
        if size != shared.size:
            raise BackendError(f"{path} is {size} bytes, expected {shared.size}: not the space's memory file")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise BackendError(f"cannot map the shared KV memory {path}: {e}") from e
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)  # the tensor keeps the mapping alive


def cuda_unavailable_reason() -> str:
    """Why the CUDA backend cannot be used on this machine ("" when it can)."""
    return str(_core.native.cuda_unavailable_reason())
