"""A KVCacheManager driven from engine threads (``kvpool.adapters.blocking``).

Engines that schedule on plain threads (vLLM's scheduler, a custom worker
loop) call kvpool synchronously. This adapter runs one
:class:`kvpool.KVCacheManager` on an event loop in a background thread (an
anyio ``BlockingPortal``) and forwards every call through the portal, so it
is one implementation of allocation with another front door: the same FIFO
queue, fairness, cancellation safety and traces.

Any number of threads may call it at once; coroutines on the portal's loop
(``run_coroutine``) share the same manager. Calling a blocking method from
the portal's own loop thread would deadlock and raises ``RuntimeError``.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, TypeVar, cast

import anyio.from_thread
import numpy as np
import numpy.typing as npt
import torch

from kvpool import Geometry, KVCacheManager, ManagerStats, PoolClosed

__all__ = ["BlockingKVCacheManager"]

T = TypeVar("T")
BlockIds = npt.NDArray[np.int64]


class BlockingKVCacheManager:
    """Synchronous front door: ``alloc(n, timeout=)``, ``alloc_nowait``, ``free``,
    ``available``, ``stats``, ``close``. Arguments as :class:`kvpool.KVCacheManager`."""

    def __init__(self, geometry: Geometry, *, backend: str = "asyncio", **kwargs: Any) -> None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be 'asyncio' or 'trio', got {backend!r} ({type(backend).__name__})")
        if backend not in ("asyncio", "trio"):
            raise ValueError(f"backend must be 'asyncio' or 'trio', got {backend!r}")
        self._cm: AbstractContextManager[anyio.from_thread.BlockingPortal] = (
            anyio.from_thread.start_blocking_portal(backend)
        )
        self._portal = self._cm.__enter__()
        self._loop_thread: int | None = None
        self._lock = threading.Lock()
        self._closed = False
        try:
            self.manager: KVCacheManager = self._portal.call(self._make, geometry, kwargs)
        except BaseException:
            self._cm.__exit__(None, None, None)
            raise

    async def _make(self, geometry: Geometry, kwargs: dict[str, Any]) -> KVCacheManager:
        self._loop_thread = threading.get_ident()
        return KVCacheManager(geometry, **kwargs)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._closed:
            raise PoolClosed("blocking manager is closed")
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("BlockingKVCacheManager called from its own event loop: await the manager instead")
        return self._portal.call(fn, *args)

    def alloc(self, n: int, *, timeout: float | None = None, priority: int = 0) -> BlockIds:
        """Block this thread until n blocks are granted (FIFO), or raise TimeoutError / PoolClosed."""
        return cast(BlockIds, self._call(lambda: self.manager.alloc(n, timeout=timeout, priority=priority)))

    def alloc_nowait(self, n: int, *, priority: int = 0) -> BlockIds:
        return cast(BlockIds, self._call(lambda: self.manager.alloc_nowait(n, priority=priority)))

    def free(self, blocks: Iterable[int] | BlockIds | torch.Tensor) -> None:
        self._call(self.manager.free, blocks)

    def available(self) -> int:
        return int(self._call(self.manager.available))

    def stats(self) -> ManagerStats:
        return cast(ManagerStats, self._call(self.manager.stats))

    def run_coroutine(self, fn: Callable[[KVCacheManager], Awaitable[T]]) -> T:
        """Run ``fn(manager)`` on the manager's loop (coroutines sharing the pool)."""
        return cast(T, self._call(lambda: fn(self.manager)))

    def close(self) -> None:
        """Fail every waiter with PoolClosed, release all memory, stop the loop. Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                self._portal.call(self.manager.aclose)
            finally:
                self._closed = True
                self._cm.__exit__(None, None, None)

    def __enter__(self) -> BlockingKVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return "<BlockingKVCacheManager closed>" if self._closed else f"<Blocking {self.manager!r}>"
