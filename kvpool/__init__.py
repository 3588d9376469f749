"""kvpool: an elastic KV-cache allocator for LLM inference servers.

The public names are loaded on first use (PEP 562 ``__getattr__``): the
errors are plain Python and import at once, every other name imports its
module when it is first touched. Why: the operator commands (``kvpool pools``,
``top``, ``limit``, ``metrics``) read a 9 KiB ledger and must not pay for
``import torch`` (1.8 s on a quiet machine, several seconds on a loaded one),
which ``space`` and ``manager`` need. ``from kvpool import KVCacheManager``
works as before; it just imports torch then, not before.
"""

from __future__ import annotations

import importlib
import typing

from .errors import BackendError as BackendError
from .errors import GeometryError as GeometryError
from .errors import InvalidBlocks as InvalidBlocks
from .errors import KVPoolError as KVPoolError
from .errors import LedgerError as LedgerError
from .errors import PoolClosed as PoolClosed
from .errors import PoolExhausted as PoolExhausted
from .errors import RequestTooLarge as RequestTooLarge

if typing.TYPE_CHECKING:  # the type checker sees plain imports; at run time they are lazy
    from .geometry import Geometry as Geometry
    from .geometry import MiB as MiB
    from .manager import Blocks as Blocks
    from .manager import KVCacheManager as KVCacheManager
    from .manager import LimitState as LimitState
    from .manager import ManagerStats as ManagerStats
    from .manager import Reservation as Reservation
    from .pool import Pool as Pool
    from .pool import TenantInfo as TenantInfo
    from .pool import list_pools as list_pools
    from ._space_stats import BudgetStats as BudgetStats
    from ._space_stats import PageInfo as PageInfo
    from ._space_stats import SpaceStats as SpaceStats
    from .ranks import RankHandle as RankHandle
    from .ranks import RankMemory as RankMemory
    from .space import KVSpace as KVSpace
    from .shared_memory import SharedMemory as SharedMemory
    from .shared_memory import cuda_unavailable_reason as cuda_unavailable_reason
    from .shared_memory import map_shared as map_shared
    from .tracing import bind_request as bind_request

__version__ = "0.1.0"

# name -> the submodule that defines it (imported on first access).
_LAZY = {
    "Geometry": "geometry",
    "MiB": "geometry",
    "Blocks": "manager",
    "KVCacheManager": "manager",
    "LimitState": "manager",
    "ManagerStats": "manager",
    "Reservation": "manager",
    "Pool": "pool",
    "TenantInfo": "pool",
    "list_pools": "pool",
    "BudgetStats": "_space_stats",
    "KVSpace": "space",
    "RankHandle": "ranks",
    "RankMemory": "ranks",
    "PageInfo": "_space_stats",
    "SharedMemory": "shared_memory",
    "SpaceStats": "_space_stats",
    "cuda_unavailable_reason": "shared_memory",
    "map_shared": "shared_memory",
    "bind_request": "tracing",
}

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
    "RankHandle",
    "RankMemory",
    "RequestTooLarge",
    "SharedMemory",
    "SpaceStats",
    "TenantInfo",
    "list_pools",
    "map_shared",
]


def __getattr__(name: str) -> typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
