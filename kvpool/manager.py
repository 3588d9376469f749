"""KVCacheManager: the asyncio-first face of a KV space.

``await manager.alloc(n)`` returns n block ids, waiting with FIFO
backpressure while they are not there; it never returns ``None``. The
ordering rules live in :mod:`kvpool._waitqueue`; this module wires the queue
to the native space, to wake-ups and to traces.

Wake-ups. Blocks freed in this process are handed to waiters by ``free``
itself (same thread, no round trip). Capacity that appears natively (the
reserve thread committing or releasing pages, later: other processes
freeing pool budget) is signalled on the space's eventfd; while anyone
waits, exactly one waiter also watches that fd through the event loop
(``anyio.wait_readable``) and re-dispatches when it turns readable. When the
watcher leaves (granted, cancelled) it hands the role to the next waiter.
No background task, no polling, no native thread calling into Python.

Threading. A manager belongs to one event loop; call it from that loop's
thread (engines on other threads use ``kvpool.adapters.blocking``).

Hot path. ``alloc_nowait``, ``free`` and an ``alloc`` granted at once make
one native call each and nothing else: they are the methods of the
manager's native base class (``kvpool._native.ManagerFace``), the one
implementation of each, and run no Python frame. They check ``n`` and the
ids themselves and hand arguments that are not plain ints / int64 arrays or
lists, and every unusual state (someone queued, closed, a deferred limit,
DEBUG tracing), to the slow paths below (``_alloc_nowait_slow``,
``_free_slow``). The state they read is stored in the base only
(``_closed``, ``_limit_deferred``, ``_granted_at_once``). ``alloc`` returns
a native coroutine (``kvpool._native.AllocCall``, a
``collections.abc.Coroutine`` that asyncio tasks and trio take): its first
send is the same one native call, and anything but a grant hands over to
``_alloc_slow``, the queued wait. An ``alloc``
granted at once returns without a schedule point (like ``asyncio.Lock``
acquired when free): no cancellation can land between the grant and the
return, so none can lose the blocks; a cancellation already requested is
delivered at the caller's next await. Nothing is taken before that first
send, so a call never awaited holds nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from collections.abc import Iterable, Sequence, Sized
from types import TracebackType
from typing import NoReturn

import anyio
import anyio.lowlevel
import numpy as np
import torch

from . import _core
from . import _validate as V
from . import tracing
from ._waitqueue import WaitQueue, Waiter, WaiterState
from .errors import KVPoolError, PoolClosed, PoolExhausted, RequestTooLarge
from .geometry import Geometry
from .pool import Pool, default_pool_name
from ._manager_limits import _LimitsMixin
from ._manager_types import LimitState, ManagerStats, Reservation
from ._sizes import format_size_exact
from .space import BlockIds, KVSpace, PageInfo, alloc_failed, free_refused

__all__ = ["Blocks", "KVCacheManager", "LimitState", "ManagerStats", "Reservation"]

Blocks = BlockIds
_EMPTY: BlockIds = np.empty(0, dtype=np.int64)
_names = itertools.count(1000)
_ndarray = np.ndarray
_core_code_unsatisfiable = _core.CODE_UNSATISFIABLE
_trace = tracing.state  # read on the hot path: per-request events only when DEBUG is on
_DEBUG = tracing.DEBUG





def _limit_text(n: int | None) -> str:
    return "none" if n is None or n < 0 else format_size_exact(n)


_ManagerFace = _core.native.ManagerFace


class KVCacheManager(_LimitsMixin, _ManagerFace):
    """Awaitable block allocation over one KV space.

    Args:
        geometry: the space's shape.
        pool: the pool to join (a :class:`Pool` or its name; ``"default"``
            means ``$KVPOOL_POOL`` if set); ``None``: no pool, a private budget.
        device: ``"cpu"``.
        name: this tenant's name (default ``<pid>-<n>``).
        null_block: hold block 0 for the engine's padding.
        reserve, reserve_thread, idle_release_s: see :class:`kvpool.KVSpace`.
        limit_bytes: initial cap on committed bytes (revision 0).
        guarantee_bytes: in a pool, bytes this tenant can always get back
            (revision 0; ``None``: an equal share of the pool among its
            tenants). See ARCHITECTURE.md, "Fair share".
        headroom_bytes: in a pool, bytes of this tenant's unused guarantee
            borrowers must leave free, so its next request of up to that
            size is granted at once (default 0). See :meth:`set_headroom`.
    """

    # Stored in the native base (ManagerFace), the one store of each (the
    # stub omits private names): annotations only, no class attribute.
    _closed: bool
    _limit_deferred: bool
    _granted_at_once: int

    def __init__(
        self,
        geometry: Geometry,
        *,
        pool: Pool | str | None = "default",
        device: str = "cpu",
        name: str | None = None,
        null_block: bool = False,
        reserve: tuple[int, int] = (1, 2),
        reserve_thread: bool = True,
        limit_bytes: int | None = None,
        guarantee_bytes: int | None = None,
        idle_release_s: float = 1.0,
        headroom_bytes: int = 0,
    ) -> None:
        self.name = name if name is not None else f"{os.getpid()}-{next(_names)}"
        if pool == "default":
            pool = default_pool_name()
        self.space = KVSpace(
            geometry, device=device, null_block=null_block, reserve=reserve,
            reserve_thread=reserve_thread, limit_bytes=limit_bytes, pool=pool, name=self.name,
            guarantee_bytes=guarantee_bytes, idle_release_s=idle_release_s, headroom_bytes=headroom_bytes,
        )
        self.pool = self.space.pool.name if self.space.pool is not None else "-"

        self.geometry = geometry
        self._usable = geometry.capacity - (1 if null_block else 0)
        self._native = self.space._space  # the slow paths call it directly (one call per alloc/free)
        self._queue = WaitQueue()
        self._priorities = self._queue.priorities  # non-empty while anyone waits (read on the hot path)
        # alloc_nowait, free and alloc are the native base's (ManagerFace,
        # bindings_hot.cpp; module docstring). Its table: the slow paths below.
        super().__init__(
            self._native, slow_alloc=KVCacheManager._alloc_nowait_slow, slow_free=KVCacheManager._free_slow,
            slow_await=KVCacheManager._alloc_slow, alloc_refused=KVCacheManager._alloc_refused,
            try_refused=KVCacheManager._try_refused, free_refused=free_refused, waiters=self._priorities,
            trace_state=_trace, debug_level=_DEBUG, usable=self._usable)
        self._watcher: Waiter | None = None
        self._watch_scope: anyio.CancelScope | None = None
        self._watcher_gone: anyio.Event | None = None
        self._reported_waiting = 0
        self._limit_state = LimitState.APPLIED
        self._lending = False
        self._guarantee = 0
        self._counts = {"after_wait": 0, "timeouts": 0, "cancellations": 0, "shortages": 0}
        self._log = tracing.get_logger(pool=self.pool, tenant=self.name)
        self._refresh_limit_state(log=False)
        self._refresh_budget()

    # ------------------------------------------------------------------ alloc
    def _validate(self, n: int, priority: int) -> int:
        """The checked ``n`` (an int) of an alloc."""
        n = V.integer("n", n)
        V.integer("priority", priority, lo=-(2**63))
        if self._closed:
            raise PoolClosed(f"manager {self.name!r} is closed")
        if n > self._usable:
            raise RequestTooLarge(n, self._usable, f"alloc({n}) can never be granted: the space holds "
                                  f"{self._usable} usable blocks")
        return n

    def _admit(self, n: int) -> None:
        """Refuse at once what this tenant can never hold (it would block the queue's head forever)."""
        max_blocks = self.space.max_blocks()
        if n > max_blocks:
            self._counts["shortages"] += 1
            self._log.info("alloc.refused", requested=n, max_blocks=max_blocks)
            b = self.space.budget()
            raise RequestTooLarge(
                n, max_blocks,
                f"this tenant can never hold more than {max_blocks} blocks "
                f"(limit {_limit_text(b.limit_bytes)}, pool capacity {_limit_text(b.pool_capacity)})",
            )

    def _grant_now(self, n: int) -> BlockIds:
        """n ids now, or the kvpool error (PoolExhausted, RequestTooLarge, ...)."""
        r = self._native.alloc(n)
        if not isinstance(r, _ndarray):
            alloc_failed(r, n)
        if _trace.level <= _DEBUG:
            self._trace_pages()
        return r

    def _trace_pages(self) -> None:
        """DEBUG only: the page commits / releases the last native alloc / free made inline."""
        if (c := self._native.last_alloc_commits):
            self._log.debug("pages.committed", pages=c, by="alloc")

    # alloc_nowait(n, *, priority=0), free(blocks) and alloc(n, *, timeout,
    # priority) are ManagerFace's (native); their documentation is there
    # (help(KVCacheManager.alloc)). Below: their slow paths.
    def _alloc_nowait_slow(self, n: int, priority: int) -> BlockIds:
        """``alloc_nowait`` with an unusual argument or state: checked, then granted or refused here."""
        n = self._validate(n, priority)
        if n == 0:
            return _EMPTY.copy()
        if self._priorities and self._priorities[0] <= priority:
            self._counts["shortages"] += 1
            self._log.info("alloc.shortage", requested=n, available=0, waiting=len(self._queue))
            raise PoolExhausted(n, 0, f"{len(self._queue)} earlier waiters are queued")
        r = self._native.alloc(n)
        if not isinstance(r, _ndarray):
            self._alloc_refused(r, n)
        self._granted_at_once += 1
        if _trace.level <= _DEBUG:
            self._trace_pages()
            self._log.debug("alloc.granted", n=n, waited_ms=0.0, priority=priority)
        return r

    def _alloc_refused(self, r: _core.native.Failure, n: int) -> NoReturn:
        """An ``alloc_nowait`` the native core refused: counted, traced, raised."""
        self._counts["shortages"] += 1
        self._log.info("alloc.shortage", requested=n, available=r.available, waiting=0)
        alloc_failed(r, n)

    def _try_refused(self, r: _core.native.Failure, n: int) -> NoReturn:
        """An ``await alloc`` refused at once for more than a shortage: raised (admission counted)."""
        if r.code == _core_code_unsatisfiable:
            self._counts["shortages"] += 1  # admission: never queued
        alloc_failed(r, n)

    async def _alloc_slow(self, n: int, timeout: float | None, priority: int,
                          r: _core.native.Failure | None) -> BlockIds:
        """``await alloc`` past its first try: ``r`` is a shortage (queue) or None (check everything first)."""
        if r is None:
            n = self._validate(n, priority)
            if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                        or math.isnan(timeout)):
                raise ValueError(f"timeout must be a number of seconds or None, got {timeout!r}")
            if n == 0:
                return _EMPTY.copy()
            if not self._queue.has_waiters_at_or_before(priority):
                try:
                    ids = self._grant_now(n)
                except RequestTooLarge:
                    self._counts["shortages"] += 1
                    raise  # admission: never queued
                except PoolExhausted:
                    pass
                else:
                    self._granted_at_once += 1
                    if _trace.level <= _DEBUG:
                        self._log.debug("alloc.granted", n=n, waited_ms=0.0, priority=priority)
                    return ids
        # It waits: a schedule point at least, and cancellable from here on.
        await anyio.lowlevel.checkpoint_if_cancelled()
        self._admit(n)
        w = Waiter(n, priority)
        if self.space.pool is not None:
            b = self.space.budget()
            w.below_guarantee = b.claimed_bytes < b.guarantee_bytes
        self._queue.push(w)
        self._report_waiting()
        scope = anyio.fail_after(timeout) if timeout is not None else contextlib.nullcontext()
        try:
            with scope:
                await self._park(w)
        except BaseException as exc:
            after_grant = self._abandon(w)
            waited_ms = (time.perf_counter() - w.enqueued_at) * 1e3
            if isinstance(exc, TimeoutError):
                self._counts["timeouts"] += 1
                self._log.info("alloc.timeout", n=n, waited_ms=round(waited_ms, 3), priority=priority)
            elif not isinstance(exc, KVPoolError):
                self._counts["cancellations"] += 1
                self._log.info("alloc.cancelled", n=n, waited_ms=round(waited_ms, 3), after_grant=after_grant)
            raise
        if w.state is not WaiterState.GRANTED:
            assert w.error is not None
            raise w.error
        self._counts["after_wait"] += 1
        if w.below_guarantee:
            self._log.info("budget.reclaim", n=n, waited_ms=round((time.perf_counter() - w.enqueued_at) * 1e3, 3))
        self._log.info("alloc.waited", n=n, waited_ms=round((time.perf_counter() - w.enqueued_at) * 1e3, 3),
                       priority=priority)
        return w.result  # type: ignore[no-any-return]

    async def reserve(self, n: int, *, timeout: float | None = None, priority: int = 0) -> Reservation:
        """Set n blocks aside (waiting like ``alloc``); hand them out with ``take``."""
        return Reservation(self, await self.alloc(n, timeout=timeout, priority=priority))

    async def _park(self, w: Waiter) -> None:
        while w.state is WaiterState.WAITING:
            if self._watcher is None:
                # Become the fd watcher while waiting (see module docstring).
                self._watcher = w
                try:
                    with anyio.CancelScope() as scope:
                        self._watch_scope = scope
                        await anyio.wait_readable(self.space.wakeup_fd)
                    if not scope.cancel_called:
                        self.space.drain_wakeups()
                        self._on_native_wakeup()
                finally:
                    self._watcher = None
                    self._watch_scope = None
                    if self._watcher_gone is not None:
                        self._watcher_gone.set()
                    head = self._queue.head()
                    if head is not None and head is not w:
                        head.rouse()  # hand the watcher role over
            else:
                await w.wake.wait()
                w.wake = anyio.Event()

    def _abandon(self, w: Waiter) -> bool:
        """The waiter's task is leaving early: leave nothing behind. True if it had been granted."""
        if w.state is WaiterState.WAITING:
            self._queue.remove(w)
            w.state = WaiterState.GONE
            self._dispatch()  # the ones behind it may fit now
            return False
        if w.state is WaiterState.GRANTED:
            w.state = WaiterState.GONE
            ids, w.result = w.result, None
            if not self._closed:
                self.free(ids)
            return True
        return False

    def _dispatch(self, available: int | None = None) -> None:
        """Grant the longest head-first prefix of the queue that fits (one native call).

        ``available`` is what the native call just before reported (free's),
        so the hot path asks for it only when nobody told it.
        """
        while len(self._queue) and not self._closed:
            batch = self._queue.take_prefix(self.space.available() if available is None else available)
            if not batch:
                head = self._queue.head()
                if head is not None and head.n > self.space.max_blocks():
                    # A lowered limit made the head impossible: fail it rather
                    # than let it block everyone behind it.
                    self._queue.remove(head)
                    head.state = WaiterState.GONE
                    head.error = RequestTooLarge(head.n, self.space.max_blocks())
                    self._wake(head)
                    available = None
                    continue
                break
            total = sum(w.n for w in batch)
            available = None  # asked again if anyone is left
            try:
                ids = self._grant_now(total)
            except PoolExhausted:
                self._queue.push_front(batch)  # e.g. out of memory at commit: wait for the next wake-up
                break
            except KVPoolError as e:
                available = None
                for w in batch:
                    w.state, w.error = WaiterState.GONE, e
                    self._wake(w)
                continue
            off = 0
            for w in batch:
                w.result = ids[off : off + w.n]
                off += w.n
                w.state = WaiterState.GRANTED
                self._wake(w)
        self._ensure_watcher()
        self._report_waiting()

    def _report_waiting(self) -> None:
        # What `kvpool top` shows in the waiting column. Only on a change: every
        # free dispatches, and the free path must stay one native call.
        n = len(self._queue)
        if n != self._reported_waiting and self.space.pool is not None and not self._closed:
            self.space.report_waiting(n)
            self._reported_waiting = n

    def _ensure_watcher(self) -> None:
        # The watcher role is handed to the head when the watcher leaves; if
        # that head was granted before it ran, nobody would watch the eventfd
        # any more. Rouse the current head so one waiter always watches.
        if self._watcher is None:
            head = self._queue.head()
            if head is not None:
                head.rouse()

    def _wake(self, w: Waiter) -> None:
        w.rouse()
        if w is self._watcher and self._watch_scope is not None:
            self._watch_scope.cancel()

    def poll(self) -> None:
        """Re-check the native capacity now and grant the waiters that fit.

        Capacity another tenant gives back reaches this manager through the
        space's eventfd, whenever the event loop next looks at it. A caller
        that knows capacity just changed and drives every tenant from one
        thread (``kvpool demo --clock virtual``) calls this to hand it over
        at that instant, so no grant depends on when the loop looked.
        """
        if self._closed:
            raise PoolClosed(f"manager {self.name!r} is closed")
        self._on_native_wakeup()

    def _on_native_wakeup(self) -> None:
        self._dispatch()
        if self._limit_state is LimitState.DEFERRED or self.space.pool is not None:
            self._refresh_limit_state()  # an operator may have set a limit in the pool
        if self.space.pool is not None:
            self._refresh_budget()

    # ------------------------------------------------------------------- free
    def _free_slow(self, blocks: Iterable[int] | BlockIds | torch.Tensor) -> None:
        """``free`` with an unusual argument or state (queued waiters, a deferred limit, DEBUG, closed)."""
        if self._closed:
            raise PoolClosed(f"manager {self.name!r} is closed")
        available: int | None
        if type(blocks) is _ndarray:
            try:
                r = self._native.free(blocks)
            except TypeError:  # not a 1-D C-contiguous int64 array: the space converts it
                available = self.space._free(blocks)
            else:
                if not isinstance(r, int):
                    _core.raise_failure(r, ids=True)
                available = r
        else:
            available = self.space._free(blocks)
        if _trace.level <= _DEBUG:  # per-request events only when DEBUG is on
            self._log.debug("free", n=len(blocks) if isinstance(blocks, Sized) else None)
            if (released := self._native.last_free_releases):
                self._log.debug("pages.released", pages=released, by="free")
        if self._priorities:
            self._dispatch(available)
        if self._limit_deferred:
            self._refresh_limit_state()

    def _after_free(self) -> None:
        """What a free does after the native call: waiters first, a deferred limit re-judged."""
        if self._priorities:
            self._dispatch()
        if self._limit_deferred:
            self._refresh_limit_state()

    # ------------------------------------------------------------ observation
    def available(self, *, priority: int = 0) -> int:
        """Blocks an ``alloc_nowait(n, priority=priority)`` would get right now.

        Zero while earlier waiters are queued (they get freed blocks first).
        """
        V.integer("priority", priority, lo=-(2**63))
        if self._closed:
            raise PoolClosed(f"manager {self.name!r} is closed")
        if self._queue.has_waiters_at_or_before(priority):
            return 0
        return self.space.available()

    @property
    def lending(self) -> bool:
        """Whether this tenant lends right now: it holds more than its guarantee
        while a tenant below its own waits. Its allocs are refused until then;
        an engine should give memory back (preempt, drop cached blocks)."""
        if self._closed or self.space.pool is None:
            return False
        b = self.space.budget()
        self._refresh_budget(b)
        return b.lending

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def stats(self) -> ManagerStats:
        s = self.space.stats()  # one snapshot: available and the limit verdict come from it too
        c = self._counts
        limit_bytes, limit_revision = s.budget.limit_bytes, s.budget.limit_revision
        if not self._closed and (self._limit_state is LimitState.DEFERRED or self.space.pool is not None):
            self._refresh_limit_state(s)
        available = 0 if self._closed or self._queue.has_waiters_at_or_before(0) else s.available
        return ManagerStats(
            pool=self.pool, tenant=self.name, capacity=s.capacity, used_blocks=s.used_blocks,
            available=available, waiting=len(self._queue),
            waiting_blocks=self._queue.waiting_blocks, committed_bytes=s.committed_bytes,
            limit_bytes=limit_bytes, limit_revision=limit_revision, limit_state=self._limit_state,
            guarantee_bytes=s.budget.guarantee_bytes, borrowed_bytes=s.budget.borrowed_bytes,
            lending=s.budget.lending, granted_at_once=self._granted_at_once, granted_after_wait=c["after_wait"], timeouts=c["timeouts"],
            cancellations=c["cancellations"], shortages=c["shortages"], space=s,
        )

    def page_occupancy(self, pages: Sequence[int] | None = None) -> list[PageInfo]:
        return self.space.page_occupancy(pages)

    def trim(self) -> int:
        """Release idle committed pages now; returns how many."""
        released = self.space.trim()
        if released:
            self._log.debug("pages.released", pages=released, by="trim")
        if self._limit_deferred:
            self._refresh_limit_state()
        return released

    def tensors(self, dtype: torch.dtype, block_shape: Sequence[int]) -> list[list[torch.Tensor]]:
        return self.space.tensors(dtype, block_shape)

    def view(self, layer: int, buffer: int, dtype: torch.dtype, block_shape: Sequence[int]) -> torch.Tensor:
        return self.space.view(layer, buffer, dtype, block_shape)

    # -------------------------------------------------------------- lifecycle
    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        """Fail every waiter with :class:`PoolClosed` and release all memory."""
        if self._closed:
            await anyio.lowlevel.checkpoint()
            return
        self._closed = True
        err = PoolClosed(f"manager {self.name!r} was closed")
        for w in self._queue.drain():
            w.state, w.error = WaiterState.GONE, err
            self._wake(w)
        if self._watcher is not None:
            # Let the watcher leave wait_readable before its fd is closed.
            self._watcher_gone = anyio.Event()
            if self._watch_scope is not None:
                self._watch_scope.cancel()
            with anyio.CancelScope(shield=True):
                await self._watcher_gone.wait()
        self.space.close()
        self._log.info("closed")
        await anyio.lowlevel.checkpoint()

    async def __aenter__(self) -> KVCacheManager:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        if self._closed:
            return f"<KVCacheManager {self.pool}/{self.name} closed>"
        s = self.space.stats()
        return (f"<KVCacheManager {self.pool}/{self.name}: {s.used_blocks}/{s.capacity} blocks used "
                f"with {len(self._queue)} waiting>")


