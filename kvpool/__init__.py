"""kvpool: an elastic KV-cache allocator for LLM inference servers."""

from __future__ import annotations

from .errors import BackendError as BackendError
from .errors import GeometryError as GeometryError
from .errors import InvalidBlocks as InvalidBlocks
from .errors import KVPoolError as KVPoolError
from .errors import LedgerError as LedgerError
from .errors import PoolClosed as PoolClosed
from .errors import PoolExhausted as PoolExhausted
from .geometry import MiB as MiB
from .geometry import Geometry as Geometry
from .space import KVSpace as KVSpace
from .space import PageInfo as PageInfo
from .space import SpaceStats as SpaceStats

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "Geometry",
    "GeometryError",
    "InvalidBlocks",
    "KVPoolError",
    "KVSpace",
    "LedgerError",
    "MiB",
    "PageInfo",
    "PoolClosed",
    "PoolExhausted",
    "SpaceStats",
]
