"""Where the plugin meets vLLM (0.32 and 0.33): the table of patch points
(:data:`PATCHES`) and their replacements. How a table is applied
(all-or-nothing, version-gated, reversible, rows set when vLLM imports their
module) is :mod:`._patching`'s concept.

One table serves both releases: 0.33 moved none of these names. Its
differences at these points are new trailing keyword parameters
(``num_hash_lookahead_tokens`` on ``BlockPool`` and
``KVCacheCoordinator.__init__``), which the replacements forward, and
vLLM's own ``touch``/``free_blocks`` now skip the null block, which the
plugin never hands out. 0.33's ``ExecutorWithExternalLauncher`` gains its
own ``shutdown``; it calls the patched ``UniProcExecutor.shutdown`` first.

The points, in the order they act:

1. ``Executor.initialize_from_config`` (engine-core process, before any
   worker allocates): create the KV space for the config vLLM computed,
   refuse to start if the pool can never hold one ``max_model_len`` request
   (:mod:`.admission`, vLLM's own wording), and attach the handle to its
   memory (``kvpool_memory``, with the rank's first region) to every rank's
   ``KVCacheConfig``: one space for all ranks of a TP/PP engine.
   The executors' ``shutdown`` (``UniProcExecutor``, ``MultiprocExecutor``)
   closes the space after the workers are gone.
2. ``EngineCore._initialize_kv_caches``: the scheduler's ``KVCacheConfig``
   is a deep copy taken before (1); attach the same handle to it.
3. ``allocate_kv_cache`` (worker; also under the names ``gpu_model_runner``,
   ``gpu.attn_utils`` and ``hisparse.binding`` bound, where those modules
   were imported before the plugin; one imported later binds the patched
   original):
   view that memory instead of allocating a zeroed buffer. The views are
   vLLM's own (``create_kv_cache_views``) with the layer stride of the
   space's regions.
4. ``KVCacheCoordinator.__init__`` notes the config it is building for;
   ``kv_cache_coordinator.BlockPool`` (engine-core process) then builds
   :class:`KVPoolBlockPool` over the space that config's handle names.
5. ``Scheduler.schedule``: each step starts with the block pool's budget
   check (no prefix-cache lookup is pending then), which publishes what the
   running requests free within the reclaim bound and names the requests
   the verdict asks to preempt; they are preempted there, through vLLM's
   own ``_preempt_request``, before any request of the step is scheduled.
   With async scheduling it also turns on vLLM's deferred block free, so a
   page is never released under a step still in flight.
   ``Scheduler._preempt_request``: every preemption frees its blocks as one,
   counted in the tenant's slot. ``KVCacheManager.allocate_slots``: while
   lending, a running request's call may grow into the pages the engine
   holds (the free count for others is 0); a ``None`` (a request the free
   count does not cover) marks the engine short for the next check.
6. ``EngineCoreProc._process_input_queue`` (the engine-core process of a
   server): while it idles, its input queue wakes every ``IDLE_POLL_S`` so
   the block pool can give cached pages back to a pool that wants them, on
   the engine's own thread (vLLM's structures are not thread-safe, and an
   idle engine otherwise runs no scheduler call at all).
7. ``CPUWorker.determine_available_memory`` (CPU worker; set when vLLM
   imports the CPU worker, never imported by the plugin: that module patches
   torch for its whole process): vLLM refuses an explicit KV size above its
   NUMA node's available memory, a check for the zeroed buffer it would
   allocate. Under the plugin that size is virtual and the pool backs it, so
   the size is taken as given (vLLM's warm-up still runs). Without it a
   server sized at the whole pool failed to start whenever the node's free
   memory dipped below the pool (two servers loading at once).

Where vLLM's KV tensors lie in the space (one layer slot per region; hybrid
groups overlay each other, as in vLLM) is :mod:`.layout`'s concept.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, cast

import torch

from kvpool import KVSpace, Pool, RankHandle, RankMemory, SharedMemory, map_shared
from kvpool.pool import default_pool_name
from kvpool.tracing import get_logger

from . import _patching
from ._patching import PatchPoint, UnsupportedVLLM, installed, uninstall
from .admission import blocks_per_request_in_groups, check_one_request_fits
from .._reclaim import Running
from .block_pool import KVPoolBlockPool
from .layout import engine_layout, space_layout, view_tensor

__all__ = ["PATCHES", "PatchPoint", "UnsupportedVLLM", "install", "installed", "uninstall"]

_ATTR = "kvpool_memory"  # the attribute carried by KVCacheConfig to workers and the scheduler
IDLE_POLL_S = 0.1
_vllm_log = _patching._vllm_log
# Spaces created in this process, by shared-memory fd, until the scheduler
# and (in-process) the worker pick them up.
_spaces: dict[int, KVSpace] = {}
# The KVCacheConfig a coordinator is being built for, on this thread (point 4).
_building = threading.local()


def install(points: Sequence[PatchPoint] | None = None) -> None:
    """Patch vLLM in this process (once; a repeat call does nothing)."""
    _patching.install(PATCHES if points is None else points)


# ------------------------------------------------------------- replacements

def _initialize_from_config(original: Any) -> Any:
    def initialize_from_config(self: Any, kv_cache_configs: list[Any]) -> None:
        created = _create_space(self.vllm_config, kv_cache_configs)
        if created is not None:
            self._kvpool_space, self._kvpool_handle = created
        original(self, kv_cache_configs)

    return initialize_from_config


def _shutdown(original: Any) -> Any:
    def shutdown(self: Any) -> None:
        original(self)
        space = getattr(self, "_kvpool_space", None)
        if space is not None:  # the workers are gone: give the memory back
            for fd in [fd for fd, s in _spaces.items() if s is space]:
                del _spaces[fd]
            space.close()

    return shutdown


def _initialize_kv_caches(original: Any) -> Any:
    def _initialize_kv_caches(self: Any, vllm_config: Any) -> Any:
        scheduler_config = original(self, vllm_config)
        handle = getattr(self.model_executor, "_kvpool_handle", None)
        if handle is not None:
            setattr(scheduler_config, _ATTR, handle)
        return scheduler_config

    return _initialize_kv_caches


def _allocate_kv_cache(original: Any) -> Any:
    def allocate_kv_cache(kv_cache_config: Any, device: Any, layout: Any,
                          kernel_block_sizes: list[int] | None = None) -> dict[str, torch.Tensor]:
        if getattr(kv_cache_config, _ATTR, None) is None:
            return cast(dict[str, torch.Tensor], original(kv_cache_config, device, layout, kernel_block_sizes))
        return _views(kv_cache_config, device, layout, kernel_block_sizes)

    return allocate_kv_cache


def _coordinator_init(original: Any) -> Any:
    def __init__(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        outer = getattr(_building, "config", None)
        _building.config = kv_cache_config
        try:
            original(self, kv_cache_config, *args, **kwargs)
        finally:
            _building.config = outer

    return __init__


def _block_pool_class(original: Any) -> Any:
    def BlockPool(num_gpu_blocks: int, enable_caching: bool, hash_block_size: int, *args: Any,
                  **kwargs: Any) -> Any:
        """Stands in for ``BlockPool(...)`` in vLLM's KV cache coordinator."""
        cfg = getattr(_building, "config", None)
        handle = getattr(cfg, _ATTR, None)
        space = _spaces.get(handle["fd"]) if handle is not None else None
        if space is None or space.closed:
            raise RuntimeError(
                "KVPOOL_VLLM is set but the scheduler's KV cache config carries no kvpool space of this process "
                f"({'no config' if cfg is None else 'handle ' + repr(handle)}; the plugin creates the space when "
                "vLLM initializes the KV cache)")
        return KVPoolBlockPool(num_gpu_blocks, enable_caching, hash_block_size, *args, space=space, **kwargs)

    return BlockPool


def _kvpool_block_pool(scheduler: Any) -> KVPoolBlockPool | None:
    block_pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    return block_pool if isinstance(block_pool, KVPoolBlockPool) else None


def _schedule(original: Any) -> Any:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        block_pool = _kvpool_block_pool(self)
        if block_pool is not None:
            if not getattr(self, "_kvpool_armed", False):
                self._kvpool_armed = True
                if self.vllm_config.max_concurrent_batches > 1:
                    # Async scheduling: a finished request's blocks may still
                    # be written by the step in flight; vLLM's own fence holds
                    # their free back, so kvpool never releases a page under it.
                    self.defer_block_free = True
            # Preempted requests wait in the same queues as new ones.
            queued = len(self.waiting) + len(getattr(self, "kv_holding_waiting", ()))
            victims = block_pool.on_step(queued, lambda: _running(self))
            if victims:
                _preempt(self, victims)
        return original(self, *args, **kwargs)

    return schedule


def _running(scheduler: Any) -> list[Running]:
    """vLLM's running requests as the reclaim decision sees them (read only
    while the engine lends): steps to ``max_tokens``, computed tokens,
    blocks of every group."""
    manager = scheduler.kv_cache_manager
    out = []
    for r in scheduler.running:
        ids = [i for group in manager.get_block_ids(r.request_id) for i in group]
        out.append(Running(r, max(0, int(r.max_tokens) - int(r.num_output_tokens)), int(r.num_computed_tokens), ids))
    return out


def _preempt(scheduler: Any, victims: list[Any]) -> None:
    """Preempt the verdict's victims at the start of a step, as vLLM's own
    schedule loop does when its cache is full (``running`` minus the victim,
    then ``_preempt_request``, which puts it at the head of the waiting queue
    and tells the workers), before any request of this step is scheduled."""
    now = time.monotonic()
    for request in victims:
        if request not in scheduler.running or not scheduler._request_blocks_can_be_freed(request):
            continue  # a deferred free would not help now (vLLM's own rule)
        scheduler.running.remove(request)
        scheduler._preempt_request(request, now, drop_stale_output=scheduler.requires_kv_delivery)


def _preempt_request(original: Any) -> Any:
    # Every preemption (the verdict's, or vLLM's own when a running request
    # has no room) frees its blocks as one: counted in the tenant's slot.
    def _preempt_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        block_pool = _kvpool_block_pool(self)
        if block_pool is None:
            original(self, request, *args, **kwargs)
            return
        with block_pool.preempting(request):
            original(self, request, *args, **kwargs)

    return _preempt_request


def _allocate_slots(original: Any) -> Any:
    from vllm.v1.request import RequestStatus

    running = RequestStatus.RUNNING

    def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        block_pool = getattr(self, "block_pool", None)
        if (isinstance(block_pool, KVPoolBlockPool) and block_pool.free_block_queue.lending
                and request.status == running):
            # A lender's running request may grow into the pages it holds
            # (rule 8: reclaim by completion first); a new one gets 0.
            block_pool._growing = True
            try:
                blocks = original(self, request, *args, **kwargs)
            finally:
                block_pool._growing = False
        else:
            blocks = original(self, request, *args, **kwargs)
        if blocks is None and isinstance(block_pool, KVPoolBlockPool):
            block_pool.note_miss()  # vLLM's "cannot schedule now": this engine is short
        return blocks

    return allocate_slots


def _cpu_available_memory(original: Any) -> Any:
    # vLLM's CPU worker refuses an explicit KV size (--kv-cache-memory-bytes,
    # VLLM_CPU_KVCACHE_SPACE) above its NUMA node's available memory: a check
    # for the zeroed buffer it would allocate. Under the plugin that size is
    # the virtual capacity (README: size each server at the whole pool); the
    # memory is committed page by page within the pool, whose capacity is
    # checked against the machine when it is created and whose fit for one
    # request is checked at start-up (point 1). vLLM's warm-up runs as before.
    def determine_available_memory(self: Any) -> int:
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is None:  # sized as a fraction of the node: vLLM's own rule
            return int(original(self))
        if self._should_warm_up_model():
            self.model_runner.warming_up_model()
        _vllm_log.info("kvpool: the KV cache's %d bytes are virtual; the pool commits them page by page "
                       "(vLLM's check against this node's free memory does not apply)", explicit)
        return int(explicit)

    return determine_available_memory


class _IdleAwareQueue(queue.Queue):  # type: ignore[type-arg]
    """The engine core's input queue: a blocking get wakes up while idle."""

    on_idle: Any = None

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if not block or timeout is not None or self.on_idle is None:
            return super().get(block, timeout)
        while True:
            try:
                return super().get(True, IDLE_POLL_S)
            except queue.Empty:
                try:
                    self.on_idle()
                except Exception as e:  # never take the engine's loop down
                    get_logger().warning("vllm idle reclaim failed", error=repr(e))


def _process_input_queue(original: Any) -> Any:
    # Not __init__: vLLM loads plugins from inside EngineCore.__init__, too
    # late for the instance being built. The busy loop's input step runs after.
    def _process_input_queue(self: Any) -> None:
        if not getattr(self, "_kvpool_idle_armed", False):
            self._kvpool_idle_armed = True
            block_pool = _kvpool_block_pool(getattr(self, "scheduler", None))
            if block_pool is not None and type(self.input_queue) is queue.Queue:
                # Same object, new class: the input thread already holds it.
                q = self.input_queue
                q.__class__ = _IdleAwareQueue
                cast(_IdleAwareQueue, q).on_idle = block_pool.on_idle
        original(self)

    return _process_input_queue


# The table (module docstring). Order matters only for readability: every row
# is resolved before any is set.
PATCHES: tuple[PatchPoint, ...] = (
    PatchPoint("vllm.v1.executor.abstract", "Executor.initialize_from_config", _initialize_from_config),
    # Each executor has its own shutdown (none calls Executor.shutdown).
    PatchPoint("vllm.v1.executor.uniproc_executor", "UniProcExecutor.shutdown", _shutdown),
    PatchPoint("vllm.v1.executor.multiproc_executor", "MultiprocExecutor.shutdown", _shutdown),
    PatchPoint("vllm.v1.engine.core", "EngineCore._initialize_kv_caches", _initialize_kv_caches),
    PatchPoint("vllm.v1.worker.utils", "allocate_kv_cache", _allocate_kv_cache),
    PatchPoint("vllm.v1.worker.gpu_model_runner", "allocate_kv_cache", _allocate_kv_cache, if_imported=True),
    PatchPoint("vllm.v1.worker.gpu.attn_utils", "allocate_kv_cache", _allocate_kv_cache, if_imported=True),
    PatchPoint("vllm.v1.hisparse.binding", "allocate_kv_cache", _allocate_kv_cache, if_imported=True),
    PatchPoint("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.__init__", _coordinator_init),
    PatchPoint("vllm.v1.core.kv_cache_coordinator", "BlockPool", _block_pool_class),
    PatchPoint("vllm.v1.core.sched.scheduler", "Scheduler.schedule", _schedule),
    PatchPoint("vllm.v1.core.sched.scheduler", "Scheduler._preempt_request", _preempt_request),
    PatchPoint("vllm.v1.core.kv_cache_manager", "KVCacheManager.allocate_slots", _allocate_slots),
    PatchPoint("vllm.v1.engine.core", "EngineCoreProc._process_input_queue", _process_input_queue),
    PatchPoint("vllm.v1.worker.cpu_worker", "CPUWorker.determine_available_memory", _cpu_available_memory,
               on_import=True),
)


def _create_space(vllm_config: Any, kv_cache_configs: list[Any]) -> tuple[KVSpace, dict[str, Any]] | None:
    if not kv_cache_configs:
        return None
    world = int(vllm_config.parallel_config.world_size)
    if len(kv_cache_configs) != world:
        raise NotImplementedError(
            f"kvpool's vLLM plugin expects one KV cache config per rank, got {len(kv_cache_configs)} for {world} "
            f"ranks (unset KVPOOL_VLLM to run it without kvpool)")
    if len({id(cfg) for cfg in kv_cache_configs}) != len(kv_cache_configs):
        kv_cache_configs[:] = [copy.copy(cfg) for cfg in kv_cache_configs]  # each rank carries its own handle
    layout = engine_layout(kv_cache_configs)
    g = layout.geometry
    device = str(vllm_config.device_config.device_type)
    if device not in ("cpu", "cuda"):
        raise NotImplementedError(f"kvpool's vLLM plugin runs on cpu or cuda, not {device}")
    # On CPU every rank's worker can map the engine core's memory file; on
    # CUDA a mapping belongs to its process, so each rank's worker maps its
    # own pages: a mirrored space (kvpool.ranks). KVPOOL_VLLM_MIRROR=1 runs
    # the mirrored path on CPU too (how it is tested with real vLLM here).
    mirror = _mirror_wanted(device, world)
    block_size = int(kv_cache_configs[0].kv_cache_groups[0].kv_cache_spec.block_size)
    idle = os.environ.get("KVPOOL_VLLM_IDLE_RELEASE_S", "1.0")
    try:
        idle_release_s = float(idle)
    except ValueError:
        raise ValueError(f"KVPOOL_VLLM_IDLE_RELEASE_S must be a number of seconds, got {idle!r}") from None
    space = KVSpace(
        g, device=device, null_block=True, pool=Pool(default_pool_name(), device=device),
        name=os.environ.get("KVPOOL_VLLM_TENANT") or f"vllm-{os.getpid()}",
        idle_release_s=idle_release_s,
        ranks=[rank.geometry.num_regions for rank in layout.ranks] if mirror else None,
    )
    try:
        # vLLM's own check saw the virtual capacity: judge what the pool can back.
        check_one_request_fits(space, max_model_len=int(vllm_config.model_config.max_model_len),
                               block_size=block_size, num_groups=layout.num_groups,
                               blocks_needed=blocks_per_request_in_groups(vllm_config, kv_cache_configs[0]))
    except BaseException:
        space.close()  # leave the pool: a refused engine holds no share
        raise
    if mirror:
        ranks = space.rank_handle()
        handle: dict[str, Any] = {"pid": ranks.pid, "fd": ranks.fd, "size": g.num_regions * g.region_bytes,
                                  "mirror": dataclasses.asdict(ranks)}
    elif device == "cpu":
        handle = dataclasses.asdict(space.shared_memory())
    else:
        handle = {"pid": os.getpid(), "fd": -1 - len(_spaces), "size": g.num_regions * g.region_bytes}
    handle["region_bytes"] = g.region_bytes
    _spaces[handle["fd"]] = space
    for index, (cfg, first, rank) in enumerate(zip(kv_cache_configs, layout.first_regions, layout.ranks)):
        # Rank r's worker views its own regions (layout.engine_layout).
        setattr(cfg, _ATTR, {**handle, "first_region": first, "num_regions": rank.geometry.num_regions,
                             "rank": index})
    get_logger(pool=space.pool.name if space.pool else None, tenant=space.name).info(
        "vllm space created", num_blocks=g.num_blocks, num_layers=g.num_layers, block_bytes=g.block_bytes,
        kv_cache_groups=layout.num_groups, ranks=world, mirrored=mirror,
        page_bytes=g.page_bytes, device=device, pid=os.getpid())
    _log_start(space, block_size, int(vllm_config.model_config.max_model_len), world)
    return space, handle


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def _log_start(space: KVSpace, block_size: int, max_model_len: int, ranks: int) -> None:
    """The one line that says the plugin is on, at vLLM's default level, with
    the physical figures beside vLLM's virtual "KV cache size"."""
    g, st = space.geometry, space.stats()
    per_block = g.region_block_bytes * g.num_regions
    virtual = g.capacity - 1  # less the null block
    pool = space.pool
    concurrency = st.max_blocks * block_size / max_model_len
    _vllm_log.info(
        "kvpool is on: pool '%s' (capacity %s), tenant '%s'; vLLM's KV cache size above is virtual: %d blocks "
        "(%d tokens, %s of address space); %d rank%s%s; page %d bytes per layer (%s per commit, all ranks); "
        "the pool can back %d blocks "
        "now (%d tokens), at most %d (%s, maximum concurrency %.2fx for %d tokens per request); committed %s",
        pool.name if pool else "-", _size(pool.capacity) if pool else "-", space.name, virtual,
        virtual * block_size, _size(virtual * per_block), ranks, "" if ranks == 1 else "s",
        " (mirrored: each maps its own pages)" if space.ranks else "", g.page_bytes,
        _size(g.page_commit_bytes), st.available,
        st.available * block_size, st.max_blocks, _size(st.max_blocks * per_block), concurrency, max_model_len,
        _size(st.committed_bytes))


def _mirror_wanted(device: str, world: int) -> bool:
    forced = os.environ.get("KVPOOL_VLLM_MIRROR", "")
    if forced not in ("", "0", "1"):
        raise ValueError(f"KVPOOL_VLLM_MIRROR must be 0 or 1, got {forced!r}")
    return forced == "1" or (device == "cuda" and world > 1)


# This process's ranks of mirrored spaces, by (leader pid, channel nonce, rank):
# held for the worker's life (the views read their memory).
_ranks: dict[tuple[int, int, int], RankMemory] = {}


def _rank_memory(handle: dict[str, Any], device: Any) -> RankMemory:
    key = (int(handle["pid"]), int(handle["mirror"]["nonce"]), int(handle["rank"]))
    mem = _ranks.get(key)
    if mem is None or mem.closed:
        dev = torch.device(device)
        where = "cpu" if dev.type == "cpu" else f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
        mem = _ranks[key] = RankMemory(RankHandle.from_dict(handle["mirror"]), key[2], device=where)
    return mem


def _views(kv_cache_config: Any, device: Any, kv_layout: Any,
           kernel_block_sizes: list[int] | None) -> dict[str, torch.Tensor]:
    from vllm.v1.kv_cache_interface import create_kv_cache_views

    handle = getattr(kv_cache_config, _ATTR)
    layout = space_layout(kv_cache_config)
    g = layout.geometry
    if (g.region_bytes, g.num_regions) != (handle["region_bytes"], handle.get("num_regions", g.num_regions)):
        raise RuntimeError(f"this rank's KV layout ({g.num_regions} regions of {g.region_bytes} bytes) is not the "
                           f"one the kvpool space was made for ({handle})")
    same_process = handle["pid"] == os.getpid() and handle["fd"] in _spaces
    if "mirror" in handle:
        raw = _rank_memory(handle, device).memory()  # this rank's own pages, its regions only
    else:
        if same_process:
            raw = _spaces[handle["fd"]].memory()  # the space's own mapping
        else:
            raw = map_shared(SharedMemory(handle["pid"], handle["fd"], handle["size"]))
        start = handle.get("first_region", 0) * g.region_bytes  # this rank's regions (layout.EngineLayout)
        raw = raw[start:start + g.num_regions * g.region_bytes]
    get_logger().info("vllm worker views", owner_pid=handle["pid"], pid=os.getpid(), shared_file=not same_process,
                      mirrored="mirror" in handle, rank=handle.get("rank", 0),
                      first_region=handle.get("first_region", 0), bytes=raw.numel(), tensors=len(layout.placements),
                      groups=layout.num_groups)
    raw = raw.view(torch.int8)
    if raw.device != torch.device(device):
        raise RuntimeError(f"the kvpool space lives on {raw.device}, vLLM's worker on {device}")
    views: dict[str, torch.Tensor] = {}
    for placement in layout.placements:
        kernel_block_size = None
        if kernel_block_sizes is not None and placement.group < len(kernel_block_sizes):
            kernel_block_size = kernel_block_sizes[placement.group]
        views.update(zip(placement.tensor.layers, create_kv_cache_views(
            raw, placement.spec, int(kv_cache_config.num_blocks), kv_layout,
            view_tensor(layout, placement, raw.numel()), kernel_block_size=kernel_block_size)))
    return views
