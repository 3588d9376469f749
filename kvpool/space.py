"""KVSpace: one engine's KV cache over the native core, synchronous.

This is the thin wrapper of the foundation: every method is one native call
(never one per block). The asyncio manager builds on it.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable, Sequence
from typing import Literal, NoReturn, TypeVar, cast, overload

import numpy as np
import numpy.typing as npt
import torch
import torch.utils.dlpack

from . import _core
from . import _validate as V
from ._space_stats import BudgetStats, PageInfo, PageStateName, SpaceStats
from .errors import BackendError, GeometryError, InvalidBlocks, PoolClosed
from .geometry import Geometry
from .pool import Pool
from .ranks import MAX_RANKS, RankHandle
from .shared_memory import SharedMemory, cuda_unavailable_reason
from ._sizes import format_size

T = TypeVar("T")

__all__ = ["BudgetStats", "KVSpace", "PageInfo", "SpaceStats"]

BlockIds = npt.NDArray[np.int64]
_STATE_NAMES: tuple[PageStateName, ...] = ("free", "committing", "reserve", "active", "releasing")
_tenant_ids = itertools.count()
_FAULT_KINDS = {"commit": 0, "release": 1}


_ndarray = np.ndarray


def alloc_failed(f: _core.native.Failure, n: int) -> NoReturn:
    """Raise for a failed native alloc of ``n`` (KVSpace and the manager's fast path share it)."""
    if f.code == _core.CODE_INVALID:
        V.integer("n", n)  # a negative n: the same ValueError as a non-int n
    _core.raise_failure(f, requested=n)


def free_refused(f: _core.native.Failure) -> NoReturn:
    """Raise for a refused native free (KVSpace and the manager's hot path share it)."""
    _core.raise_failure(f, ids=True)


_SpaceFace = _core.native.SpaceFace


class KVSpace(_SpaceFace):
    """Reserve virtual KV regions for ``geometry``; commit pages as blocks are used.

    Args:
        geometry: the space's shape.
        device: ``"cpu"`` (memfd backend) or ``"cuda[:N]"`` (driver VMM API,
            loaded at run time; see :func:`cuda_unavailable_reason`).
        null_block: hold block 0 from the start and never hand it out.
        reserve: ``(min, max)`` idle committed pages kept ready.
        reserve_thread: run the background thread that keeps the reserve;
            without it pages are committed inline and released when they
            empty beyond ``max``.
        idle_release_s: idle pages above ``max`` go back to the pool at once
            while another tenant waits (or this one is over its limit or
            lends), otherwise only after staying unused this long (seconds;
            0: as they empty). A steady alloc/free loop then commits and
            releases nothing; ``trim()`` gives every idle page back now.
        limit_bytes: cap on committed bytes (``None``: no cap).
        guarantee_bytes: in a pool, bytes this tenant can always get back
            (``None``: an equal share of the capacity among the pool's
            tenants). Explicit guarantees may not add up to more than the
            pool's capacity.
        headroom_bytes: in a pool, bytes of this tenant's unused guarantee
            that borrowers must leave free (default 0), so that its next
            request is granted at once instead of waiting for a borrower to
            give memory back (which it does at its own next step). Size it
            to what the engine's next step can ask for; borrowing from this
            tenant's idle guarantee stops that much short. See
            :meth:`set_headroom`.
        ranks: a *mirrored* space (:mod:`kvpool.ranks`): the regions of each
            rank of a tensor- or pipeline-parallel engine, in order (adding up
            to ``geometry.num_regions``). This space then holds no memory
            itself: each rank's process attaches a :class:`~kvpool.RankMemory`
            (:meth:`rank_handle`) and maps its own pages, and a commit
            returns once every attached rank mapped it.
        rank_timeout_s: how long a commit or release of a mirrored space
            waits for a rank; a rank that did not answer in time is *behind*
            and makes every later commit a shortage until it answers.
    """

    def __init__(
        self,
        geometry: Geometry,
        *,
        device: str = "cpu",
        null_block: bool = False,
        reserve: tuple[int, int] = (1, 2),
        reserve_thread: bool = True,
        limit_bytes: int | None = None,
        pool: Pool | str | None = None,
        name: str | None = None,
        guarantee_bytes: int | None = None,
        idle_release_s: float = 1.0,
        headroom_bytes: int = 0,
        ranks: Sequence[int] | None = None,
        rank_timeout_s: float = 5.0,
    ) -> None:
        if not isinstance(geometry, Geometry):
            raise TypeError(f"geometry must be a kvpool.Geometry, got {type(geometry).__name__}")
        # Every argument is checked before the pool is opened (it may create a ledger file).
        device = V.device(device)
        null_block = V.flag("null_block", null_block)
        reserve_thread = V.flag("reserve_thread", reserve_thread)
        idle_release_s = V.seconds("idle_release_s", idle_release_s, allow_inf=False)
        lo, hi = self._reserve_arg(reserve)
        limit = self._limit_arg(limit_bytes)
        if pool is not None and not isinstance(pool, (str, Pool)):
            raise TypeError(f"pool must be a kvpool.Pool, a pool name or None, got {pool!r} ({type(pool).__name__})")
        if name is not None:
            V.text("name", name)
        rank_regions = self._ranks_arg(ranks, geometry)
        rank_timeout_s = V.seconds("rank_timeout_s", rank_timeout_s, allow_inf=False)
        if not 0 < rank_timeout_s <= 3600:
            raise ValueError(f"rank_timeout_s must be in (0, 3600] seconds, got {rank_timeout_s!r}")
        if device == "cpu":
            geometry.check_granularity(int(_core.native.cpu_granularity()), device)
        self.geometry = geometry
        self.device = device
        self.null_block = null_block
        guarantee = self._limit_arg(guarantee_bytes, "guarantee_bytes")
        if guarantee >= 0 and pool is None:
            raise ValueError("guarantee_bytes needs a pool: a private space has the whole budget")
        headroom = self._headroom_arg(headroom_bytes, pooled=pool is not None)
        self.pool = Pool(pool, device=device) if isinstance(pool, str) else pool
        self.name = name if name is not None else f"{os.getpid()}-{next(_tenant_ids)}"
        try:
            opened = _core.native.create_space(
                geometry.num_regions, geometry.page_bytes, geometry.region_block_bytes, geometry.blocks,
                null_block, lo, hi, reserve_thread, idle_release_s, limit, guarantee, headroom, device,
                self.pool._ledger if self.pool is not None else None, self.name, list(rank_regions),
                rank_timeout_s,
            )
        except RuntimeError as e:
            # The core turns a refused thread into a BackendError status
            # itself; this catches a std::system_error escaping elsewhere
            # (nanobind passes it on as a bare RuntimeError).
            raise BackendError(
                f"cannot create KV space on {device}: cannot start its threads ({e}); the process or its "
                "pids cgroup may be out of threads"
            ) from e
        code, msg, space = opened.code, opened.message, opened.value
        if space is None:
            if code == _core.CODE_INVALID and msg.startswith("guarantee_bytes="):
                raise ValueError(msg)
            if code == _core.CODE_INVALID:
                raise GeometryError(f"cannot create KV space on {device}: {msg}")
            # A shortage here is the null block's page not fitting: 1 block asked.
            _core.raise_status(code, f"cannot create KV space on {device}: {msg}", requested=1)
        self._space = cast(_core.native.Space, space)
        # alloc and free are the native base's (SpaceFace, bindings_hot.cpp):
        # one native call each, the one implementation. They take a plain int
        # n and ids as an int64 array or a list of ints themselves, and hand
        # any other argument to the slow paths below, which convert it and
        # call them again.
        super().__init__(self._space, slow_alloc=KVSpace._alloc_slow, slow_free=KVSpace._free_slow,
                         alloc_refused=alloc_failed, free_refused=free_refused)
        self._regions: list[torch.Tensor] | None = None
        self.ranks = rank_regions

    @staticmethod
    def _ranks_arg(ranks: Sequence[int] | None, geometry: Geometry) -> tuple[int, ...]:
        """The checked regions of each rank of a mirrored space (() when not mirrored)."""
        if ranks is None:
            return ()
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            raise TypeError(f"ranks must be a sequence of region counts, got {ranks!r}")
        counts = tuple(V.integer(f"ranks[{i}]", r, lo=1) for i, r in enumerate(ranks))
        if not 1 <= len(counts) <= MAX_RANKS:
            raise ValueError(f"ranks must name 1 to {MAX_RANKS} ranks, got {len(counts)}")
        if sum(counts) != geometry.num_regions:
            raise ValueError(f"ranks {list(counts)} add up to {sum(counts)} regions; the geometry has "
                             f"{geometry.num_regions}")
        return counts

    @staticmethod
    def _limit_arg(limit_bytes: int | None, what: str = "limit_bytes") -> int:
        """The native form of a limit (or guarantee): -1 for none."""
        limit = V.optional_integer(what, limit_bytes)
        return -1 if limit is None else limit

    @staticmethod
    def _headroom_arg(headroom_bytes: int, *, pooled: bool) -> int:
        """The checked headroom: bytes >= 0, and none asked of a private space."""
        headroom = V.integer("headroom_bytes", headroom_bytes)
        if headroom and not pooled:
            raise ValueError("headroom_bytes needs a pool: a private space has no neighbours to keep it free from")
        return headroom

    @staticmethod
    def _reserve_arg(reserve: tuple[int, int]) -> tuple[int, int]:
        if not isinstance(reserve, (tuple, list)) or len(reserve) != 2:
            raise ValueError(f"reserve must be a (min, max) pair of page counts, got {reserve!r}")
        lo, hi = V.integer("reserve min", reserve[0]), V.integer("reserve max", reserve[1])
        if hi < lo:
            raise ValueError(f"reserve needs 0 <= min <= max, got {tuple(reserve)}")
        return lo, hi

    # -- allocation ---------------------------------------------------------
    # alloc(n, *, promised=False) and free(blocks) are SpaceFace's (native);
    # their documentation is there (help(KVSpace.alloc)). These are their slow
    # paths: any argument but a plain int / bool / int64 array / list of ints.
    def _alloc_slow(self, n: object, promised: object) -> BlockIds:
        """``alloc``'s arguments checked and made plain, then ``alloc`` itself."""
        n = V.integer("n", n)
        return _SpaceFace.alloc(self, n, promised=V.flag("promised", promised))

    @overload
    def acquire(self, n: int, *, items: None = None, promised: bool = False, stall: float = 30.0,
                timeout: float | None = None) -> BlockIds: ...

    @overload
    def acquire(self, n: int, *, items: list[T], promised: bool = False, stall: float = 30.0,
                timeout: float | None = None) -> list[T]: ...

    def acquire(self, n: int, *, items: list[T] | None = None, promised: bool = False, stall: float = 30.0,
                timeout: float | None = None) -> BlockIds | list[T]:
        """Allocate ``n`` blocks, all or nothing, waiting for memory to come back.

        The one bounded wait of synchronous callers (the vLLM plugin's block
        pool, the SGLang allocator; an asyncio engine awaits
        :meth:`KVCacheManager.alloc` instead). This thread blocks with the GIL
        released; while it waits the pool sees this tenant waiting (so
        borrowers lend), and it wakes when other tenants give memory back.

        The wait is bounded by what other tenants *do*, not by how long they
        take: it goes on while any of them claims, frees or is granted
        memory, joins, leaves or changes a setting, and raises
        :class:`PoolExhausted` ("the pool stalled") once none has for
        ``stall`` seconds: a stopped or hung peer costs a shortage, a busy
        one only time. ``timeout`` (``None``: none) bounds the whole wait.
        :class:`RequestTooLarge` at once for a request this tenant can never
        hold; :class:`PoolClosed` if the space closes meanwhile; a signal
        handler's exception (``KeyboardInterrupt``) ends the wait with nothing
        held.

        ``items``: a list with an entry per block; the answer is then
        ``[items[i] for i in ids]`` (the vLLM plugin's block objects).
        ``promised``: as :meth:`alloc`.
        """
        n = V.integer("n", n, hi=V.INT64_MAX)
        stall = V.seconds("stall", stall, allow_inf=False)
        if stall <= 0:
            raise ValueError(f"stall must be > 0 seconds, got {stall}")
        limit = math.inf if timeout is None else V.seconds("timeout", timeout)
        if items is not None and type(items) is not list:
            raise TypeError(f"items must be a list (an entry per block), got {type(items).__name__}")
        self._check_open()
        r = self._space.acquire(n, items, V.flag("promised", promised), stall, limit)
        if isinstance(r, _core.native.Failure):
            alloc_failed(r, n)
        return r

    def _free_slow(self, blocks: object) -> None:
        """``free``'s ids checked and made an int64 array, then ``free`` itself."""
        ids = V.block_ids(blocks)
        if ids.size == 0:
            self._check_open()
            return
        _SpaceFace.free(self, ids)

    def _free(self, blocks: Iterable[int] | BlockIds | torch.Tensor) -> int | None:
        """``free`` that returns the blocks available after it (``None``: nothing freed, no native call)."""
        if type(blocks) is _ndarray and blocks.size:
            try:
                r = self._space.free(blocks)
            except TypeError:  # not a 1-D C-contiguous int64 array: convert
                r = self._space.free(V.block_ids(blocks))
        else:
            ids = V.block_ids(blocks)
            if ids.size == 0:
                self._check_open()
                return None
            r = self._space.free(ids)
        if not isinstance(r, int):
            _core.raise_failure(r, ids=True)
        return r

    def available(self) -> int:
        """Blocks a following ``alloc`` can deliver with no other actor in between."""
        self._check_open()
        return int(self._space.available())

    def trim(self) -> int:
        """Release every idle committed page now; returns the number released."""
        out = _core.checked(self._space.trim())
        return int(out.released)

    def set_limit(self, limit_bytes: int | None) -> None:
        """Cap committed memory. Growth stops at once; pages go back as they empty.

        In a pool the limit lives in the ledger (the tenant's one limit, as
        ``kvpool limit`` sets it) under the next revision.
        """
        self._set_limit(limit_bytes, -1)

    def _set_limit(self, limit_bytes: int | None, revision: int) -> str:
        """Set and apply the limit; in a pool under ``revision`` (-1: next).

        Returns how it was taken: ``applied``, ``stale``, ``conflict`` or ``same``.
        """
        limit = self._limit_arg(limit_bytes)
        revision = V.integer("revision", revision, lo=-1)
        out = _core.checked(self._space.set_limit(limit, revision))
        return str(out.result.name).lower()  # applied, stale, conflict or same

    def limit_setting(self) -> tuple[int | None, int]:
        """(limit bytes, revision) in force (in the pool ledger, or the private budget)."""
        b = self.budget()
        return b.limit_bytes, b.limit_revision

    def set_guarantee(self, guarantee_bytes: int | None) -> None:
        """Set this tenant's guarantee in its pool (``None``: the default equal share)."""
        self._set_guarantee(guarantee_bytes, -1)

    def _set_guarantee(self, guarantee_bytes: int | None, revision: int) -> str:
        """Set the guarantee under ``revision`` (-1: next); returns how the pool took it."""
        out = _core.checked(self._space.set_guarantee(self._limit_arg(guarantee_bytes, "guarantee_bytes"), revision))
        return str(out.result.name).lower()  # applied, stale, conflict or same

    def set_headroom(self, headroom_bytes: int) -> None:
        """Ask borrowers to leave up to ``headroom_bytes`` of this tenant's unused guarantee free.

        Borrowers (tenants growing past their own guarantee) never take the
        last ``min(headroom_bytes, guarantee - claimed)`` bytes of the pool
        while this tenant does not wait, so a request of up to that size is
        granted at once. 0 (the default) keeps nothing free: the tenant's
        next request may wait for a borrower to give memory back at its next
        step. Only this tenant's owner sets it; it is not revisioned.
        """
        self._check_open()
        headroom = self._headroom_arg(headroom_bytes, pooled=self.pool is not None)
        if self.pool is None:
            return  # 0 asked of a private space: nothing to keep free
        _core.checked(self._space.set_headroom(headroom))

    def budget(self) -> BudgetStats:
        """The tenant's budget: limit, guarantee, what it borrows, whether it lends
        and, while it lends, how much it must preempt (``preempt_bytes``)."""
        self._check_open()
        return BudgetStats._from_native(self._space.budget())

    def publish_freeing(self, freeing_bytes: int) -> None:
        """Tell the pool how many bytes this tenant's running requests free within the reclaim bound.

        The engine computes it every step (the block bytes of the requests
        that finish within the bound); while it lends, its neighbours'
        waiters count on that memory coming back by completion, and only
        what it does not cover is asked of lenders as ``preempt_bytes``
        (:meth:`budget`). Owner-written, not revisioned; >= 0.
        """
        self._check_open()
        _core.checked(self._space.publish_freeing(V.integer("freeing_bytes", freeing_bytes)))

    def set_preempts(self, preempts: bool) -> None:
        """Whether this tenant's engine acts on the ``preempt_bytes`` verdict (default True).
        False (an engine that reclaims by completion only, as SGLang's allocator): it is never
        asked (``preempt_bytes`` stays 0), its ``freeing`` still counts, and the lenders that
        preempt are asked the rest."""
        self._check_open()
        if not isinstance(preempts, bool):
            raise TypeError(f"preempts must be a bool, got {type(preempts).__name__}")
        _core.checked(self._space.set_preempts(preempts))

    def free_preempted(self, blocks: Iterable[int] | BlockIds | torch.Tensor, *, requests: int,
                       tokens: int) -> None:
        """Free the blocks of ``requests`` preempted requests (``tokens`` to recompute), counted
        as memory reclaimed by preemption (:class:`BudgetStats`). A bad id raises
        :class:`InvalidBlocks` and frees nothing."""
        self._check_open()
        n_req = V.integer("requests", requests, lo=1)
        n_tok = V.integer("tokens", tokens)
        r = self._space.free_preempted(V.block_ids(blocks), n_req, n_tok)
        if isinstance(r, _core.native.Failure):  # None: freed
            _core.raise_failure(r, ids=True)

    def free_evicted(self, blocks: Iterable[int] | BlockIds | torch.Tensor) -> None:
        """Free cached blocks the engine drops (a prefix cache's entries), counted while it lends
        as memory reclaimed by eviction (:class:`BudgetStats`), not by completion. A bad id
        raises :class:`InvalidBlocks` and frees nothing."""
        self._check_open()
        r = self._space.free_evicted(V.block_ids(blocks))
        if isinstance(r, _core.native.Failure):  # None: freed
            _core.raise_failure(r, ids=True)

    def max_blocks(self) -> int:
        """The most blocks this tenant can ever hold; larger allocs raise :class:`RequestTooLarge`."""
        self._check_open()
        return int(self._space.max_blocks())

    def set_reserve(self, min_pages: int, max_pages: int) -> None:
        """Keep between ``min_pages`` and ``max_pages`` committed idle pages."""
        lo, hi = V.integer("min_pages", min_pages), V.integer("max_pages", max_pages)
        _core.checked(self._space.set_reserve(lo, hi))

    # -- observation --------------------------------------------------------
    def stats(self) -> SpaceStats:
        return SpaceStats._from_native(self._space.stats())

    def page_occupancy(self, pages: Sequence[int] | None = None) -> list[PageInfo]:
        """State and used-block count of ``pages`` (all pages by default)."""
        g = self.geometry
        arr = np.arange(g.num_pages, dtype=np.int64) if pages is None else V.int_array("page ids", pages)
        occ = self._space.page_occupancy(np.ascontiguousarray(arr))
        if occ.code != _core.CODE_OK:
            if occ.code == _core.CODE_INVALID:
                raise IndexError(occ.message)
            _core.raise_status(occ.code, occ.message)
        return [
            PageInfo(int(p), _STATE_NAMES[int(s)], int(u), len(g.block_range(int(p))))
            for p, u, s in zip(arr, occ.used, occ.states)
        ]

    def allocated_bytes(self) -> int:
        """Bytes the backend really holds (CPU: the memfd's ``st_blocks``)."""
        return int(self._space.allocated_bytes())

    def report_waiting(self, waiting: int) -> None:
        """Tell the pool how many requests of this tenant wait for memory.

        ``kvpool top`` shows it, and other tenants read it as a sign that the
        pool wants memory back (the vLLM plugin then gives cached pages up).
        """
        waiting = V.integer("waiting", waiting, hi=2**31 - 1)  # an int32 in the ledger slot
        self._check_open()
        self._space.report_waiting(waiting)

    def settle(self, timeout: float = 5.0) -> bool:
        """Wait until the reserve thread has nothing left to do."""
        return bool(self._space.settle(V.seconds("timeout", timeout, allow_inf=False)))

    @property
    def wakeup_fd(self) -> int:
        """An eventfd that turns readable when the reserve thread adds capacity."""
        self._check_open()
        return int(self._space.eventfd)

    def drain_wakeups(self) -> int:
        """Consume pending wake-ups of :attr:`wakeup_fd`; returns their count."""
        try:
            return int.from_bytes(os.read(self.wakeup_fd, 8), "little")
        except BlockingIOError:
            return 0

    def wait_for_capacity(self, timeout: float) -> bool:
        """Block this thread (GIL released) until :attr:`wakeup_fd` signals that
        capacity may have appeared, or ``timeout`` seconds; consumes the wake-ups.

        Returns whether it was signalled. Callers re-try their alloc either way:
        budget another process gives back may arrive between signals.
        """
        import select

        t = V.seconds("timeout", timeout)
        # poll, not select: select refuses fds above 1024, and engines hold many fds.
        poller = select.poll()
        poller.register(self.wakeup_fd, select.POLLIN)
        signalled = bool(poller.poll(None if math.isinf(t) else min(math.ceil(t * 1000), 2**31 - 1)))
        self.drain_wakeups()
        return signalled

    # -- tensors ------------------------------------------------------------
    def region(self, index: int) -> torch.Tensor:
        """Region ``index`` as a flat ``uint8`` tensor (zero-copy, DLPack)."""
        index = V.integer("index", index, lo=-(2**63))
        self._check_open()
        self._check_holds_memory()
        if self._regions is None:
            self._regions = [
                torch.utils.dlpack.from_dlpack(self._space.region(r)) for r in range(self.geometry.num_regions)
            ]
        if not 0 <= index < len(self._regions):
            raise IndexError(f"region {index} out of range [0, {len(self._regions)})")
        return self._regions[index]

    def memory(self) -> torch.Tensor:
        """All regions, back to back, as one flat ``uint8`` tensor (zero-copy).

        Region ``r`` starts at ``r * geometry.region_bytes``; engines that view
        one flat KV buffer with their own strides (vLLM) use this.
        """
        self._check_open()
        self._check_holds_memory()
        return torch.utils.dlpack.from_dlpack(self._space.memory())

    def _check_holds_memory(self) -> None:
        if self.ranks:
            raise BackendError(f"this mirrored space holds no memory itself: each of its {len(self.ranks)} ranks "
                               "maps its own (kvpool.RankMemory with rank_handle())")

    def rank_handle(self) -> RankHandle:
        """What each rank's process passes to :class:`~kvpool.RankMemory` (mirrored spaces)."""
        self._check_open()
        if not self.ranks:
            raise ValueError("rank_handle() is for a mirrored space (KVSpace(..., ranks=[...]))")
        return RankHandle(pid=os.getpid(), fd=int(self._space.mirror_fd), nonce=int(self._space.mirror_nonce),
                          rank_regions=self.ranks, region_bytes=self.geometry.region_bytes)

    def shared_memory(self) -> SharedMemory:
        """A handle another process passes to :func:`map_shared` (CPU spaces)."""
        self._check_open()
        self._check_holds_memory()
        fd = int(self._space.share_fd)
        if fd < 0:
            raise BackendError(f"a {self.device} space cannot be mapped by another process (only CPU spaces can)")
        g = self.geometry
        return SharedMemory(pid=os.getpid(), fd=fd, size=g.num_regions * g.region_bytes)

    def view(self, layer: int, buffer: int, dtype: torch.dtype, block_shape: Sequence[int]) -> torch.Tensor:
        """Layer ``layer``, KV buffer ``buffer`` as ``(num_blocks, *block_shape)`` of ``dtype``.

        Per-layer layout: a contiguous view of that layer's region. Contiguous
        layout: a strided view into the single region (blocks hold every layer).
        """
        g = self.geometry
        layer = V.integer("layer", layer, lo=-(2**63))
        buffer = V.integer("buffer", buffer, lo=-(2**63))
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if not isinstance(block_shape, (tuple, list, torch.Size)):
            raise ValueError(f"block_shape must be a sequence of positive ints, got {block_shape!r}")
        block_shape = [V.integer("block_shape entries", d, lo=1) for d in block_shape]
        if not 0 <= layer < g.num_layers or not 0 <= buffer < g.num_kv_buffers:
            raise IndexError(
                f"(layer {layer}, buffer {buffer}) out of range ({g.num_layers} layers, "
                f"{g.num_kv_buffers} buffers)"
            )
        itemsize = torch.empty((), dtype=dtype).element_size()
        want = math.prod(block_shape) * itemsize
        if want != g.block_bytes:
            raise GeometryError(
                f"block_shape {tuple(block_shape)} of {dtype} is {want} bytes but the geometry's "
                f"block_bytes is {g.block_bytes}"
            )
        n = g.blocks
        if g.layout == "per_layer":
            raw = self.region(layer * g.num_kv_buffers + buffer)[: n * g.block_bytes].view(n, g.block_bytes)
        else:
            slot = layer * g.num_kv_buffers + buffer
            raw = self.region(0)[: n * g.region_block_bytes].view(n, g.num_layers * g.num_kv_buffers, g.block_bytes)
            raw = raw[:, slot, :]
        return raw.view(dtype).view(n, *block_shape)

    def tensors(self, dtype: torch.dtype, block_shape: Sequence[int]) -> list[list[torch.Tensor]]:
        """Every (layer, buffer) view, ``[layer][buffer]``."""
        g = self.geometry
        return [[self.view(l, b, dtype, block_shape) for b in range(g.num_kv_buffers)] for l in range(g.num_layers)]

    # -- lifecycle ----------------------------------------------------------
    @property
    def closed(self) -> bool:
        return bool(self._space.closed)

    def _check_open(self) -> None:
        if self._space.closed:
            raise PoolClosed("KV space is closed")

    def close(self) -> None:
        """Stop the reserve thread and give every committed byte back. Idempotent.

        Views that outlive the space read zeros and fault on write.
        """
        self._space.close()

    def __enter__(self) -> KVSpace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _inject_fault(self, kind: Literal["commit", "release"], nth: int, err: int) -> None:
        """Test-only: fail the ``nth`` next page ``kind`` with errno ``err`` (0 clears)."""
        self._space.inject_fault(_FAULT_KINDS[kind], nth, err)

    def __repr__(self) -> str:
        if self.closed:
            return "<KVSpace closed>"
        s = self.stats()
        return (
            f"<KVSpace {s.used_blocks}/{s.capacity} blocks used, "
            f"{format_size(s.committed_bytes)} committed on {self.device}>"
        )
