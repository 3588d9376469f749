"""kvpool: an elastic KV-cache allocator for LLM inference servers."""

from __future__ import annotations

from .errors import BackendError as BackendError
from .errors import GeometryError as GeometryError
from .errors import InvalidBlocks as InvalidBlocks
from .errors import KVPoolError as KVPoolError
from .errors import LedgerError as LedgerError
from .errors import PoolClosed as PoolClosed
from .errors import PoolExhausted as PoolExhausted
from .errors import RequestTooLarge as RequestTooLarge
from .geometry import MiB as MiB
from .manager import Blocks as Blocks
from .manager import KVCacheManager as KVCacheManager
from .manager import LimitState as LimitState
from .manager import ManagerStats as ManagerStats
from .manager import Reservation as Reservation
from .geometry import Geometry as Geometry
from .pool import Pool as Pool
from .pool import TenantInfo as TenantInfo
from .pool import list_pools as list_pools
from .space import KVSpace as KVSpace
from .space import PageInfo as PageInfo
from .space import SharedMemory as SharedMemory
from .space import BudgetStats as BudgetStats
from .space import SpaceStats as SpaceStats
from .space import cuda_unavailable_reason as cuda_unavailable_reason
from .space import map_shared as map_shared
from .tracing import bind_request as bind_request

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "Blocks",
    "BudgetStats",
    "KVCacheManager",
    "LimitState",
    "ManagerStats",
    "Reservation",
    "bind_request",
    "cuda_unavailable_reason",
    "Geometry",
    "GeometryError",
    "InvalidBlocks",
    "KVPoolError",
    "KVSpace",
    "LedgerError",
    "MiB",
    "PageInfo",
    "Pool",
    "PoolClosed",
    "PoolExhausted",
    "RequestTooLarge",
    "SharedMemory",
    "SpaceStats",
    "TenantInfo",
    "list_pools",
    "map_shared",
]
