"""Where the plugin meets vLLM (0.32): small patches, installed once.

1. ``Executor.initialize_from_config`` (engine-core process, before any
   worker allocates): create the KV space for the config vLLM computed,
   refuse to start if the pool can never hold one ``max_model_len`` request
   (:mod:`.admission`, vLLM's own wording), and attach how to reach its
   memory to every worker's ``KVCacheConfig``.
2. ``allocate_kv_cache`` (worker): view that memory instead of allocating a
   zeroed buffer. The views are vLLM's own (``create_kv_cache_views``) with
   the layer stride of the space's regions.
3. ``kv_cache_coordinator.BlockPool`` (engine-core process): the scheduler's
   block pool becomes :class:`KVPoolBlockPool` over that space.
4. ``Scheduler.schedule``: each step starts with the block pool's budget
   check (no prefix-cache lookup is pending then); with async scheduling it
   also turns on vLLM's deferred block free, so a page is never released
   under a step still in flight.
5. ``EngineCoreProc`` (the engine-core process of a server): while it idles,
   its input queue wakes every ``IDLE_POLL_S`` so the block pool can give
   cached pages back to a pool that wants them, on the engine's own thread
   (vLLM's structures are not thread-safe, and an idle engine otherwise runs
   no scheduler call at all).

Layouts (one KV backing tensor of L same-shaped layers, block page ``p``)::

    layer-outermost (vLLM's default, LBHNC):
      vLLM   [ layer 0: b0 b1 ... bN-1 ][ layer 1: b0 ... ]     layer_stride = N*p
      kvpool [ region 0: page | page |..][ region 1: ... ]      one region per layer,
                                                                block_bytes = p
    block-outermost:
      vLLM   [ b0: l0 l1 .. ][ b1: l0 l1 .. ] ...               block_stride = L*p
      kvpool [ region 0: page | page | ... ]                     block_bytes = L*p

Either way block ``b`` of every layer lies in the pages kvpool commits when it
hands block ``b`` out.
"""

from __future__ import annotations

import dataclasses
import os
import queue
from typing import Any, cast

import torch

from kvpool import Geometry, KVSpace, Pool, SharedMemory, map_shared
from kvpool.pool import default_pool_name
from kvpool.tracing import get_logger

from .admission import check_one_request_fits
from .block_pool import KVPoolBlockPool

_ATTR = "kvpool_memory"  # the attribute carried by KVCacheConfig to workers
IDLE_POLL_S = 0.1
_installed = False
# Spaces created in this process, by shared-memory fd, until the scheduler
# and (in-process) the worker pick them up.
_spaces: dict[int, KVSpace] = {}


def install() -> None:
    global _installed
    if _installed:
        return
    import vllm.v1.core.kv_cache_coordinator as coordinator
    import vllm.v1.executor.abstract as executor
    import vllm.v1.worker.utils as worker_utils

    original_init = executor.Executor.initialize_from_config

    def initialize_from_config(self: Any, kv_cache_configs: list[Any]) -> None:
        self._kvpool_space = _create_space(self.vllm_config, kv_cache_configs)
        original_init(self, kv_cache_configs)

    original_shutdown = executor.Executor.shutdown

    def shutdown(self: Any) -> None:
        original_shutdown(self)
        space = getattr(self, "_kvpool_space", None)
        if space is not None:  # the workers are gone: give the memory back
            for fd in [fd for fd, s in _spaces.items() if s is space]:
                del _spaces[fd]
            space.close()

    executor.Executor.initialize_from_config = initialize_from_config
    executor.Executor.shutdown = shutdown

    original_allocate = worker_utils.allocate_kv_cache

    def allocate_kv_cache(kv_cache_config: Any, device: Any, layout: Any,
                          kernel_block_sizes: list[int] | None = None) -> dict[str, torch.Tensor]:
        if getattr(kv_cache_config, _ATTR, None) is None:
            return cast(dict[str, torch.Tensor], original_allocate(kv_cache_config, device, layout, kernel_block_sizes))
        return _views(kv_cache_config, device, layout, kernel_block_sizes)

    worker_utils.allocate_kv_cache = allocate_kv_cache
    import sys

    runner = sys.modules.get("vllm.v1.worker.gpu_model_runner")
    if runner is not None:  # imported before the plugin: patch its own name too
        runner.allocate_kv_cache = allocate_kv_cache  # type: ignore[attr-defined]
    coordinator.BlockPool = _block_pool
    _install_step_hook()
    _install_idle_hook()
    _installed = True


def _kvpool_block_pool(scheduler: Any) -> KVPoolBlockPool | None:
    block_pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    return block_pool if isinstance(block_pool, KVPoolBlockPool) else None


def _install_step_hook() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.schedule

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
            block_pool.on_step(queued)
        return original(self, *args, **kwargs)

    Scheduler.schedule = schedule


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


def _install_idle_hook() -> None:
    import vllm.v1.engine.core as core

    # Not __init__: vLLM loads plugins from inside EngineCore.__init__, too
    # late for the instance being built. The busy loop's input step runs after.
    original = core.EngineCoreProc._process_input_queue

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

    core.EngineCoreProc._process_input_queue = _process_input_queue


def _tensor_layout(kv_cache_config: Any) -> tuple[Any, Geometry]:
    """The one backing tensor and the kvpool geometry that matches it."""
    tensors = kv_cache_config.kv_cache_tensors
    if len(tensors) != 1 or len(kv_cache_config.kv_cache_groups) != 1:
        raise NotImplementedError(
            f"kvpool's vLLM plugin supports models with one KV cache group and one backing tensor; this model "
            f"has {len(kv_cache_config.kv_cache_groups)} groups and {len(tensors)} tensors "
            f"(unset KVPOOL_VLLM to run it without kvpool)")
    t = tensors[0]
    n, layers = int(kv_cache_config.num_blocks), len(t.layers)
    page_bytes = int(os.environ.get("KVPOOL_VLLM_PAGE_BYTES", str(2 << 20)))
    if t.offset != 0:
        raise NotImplementedError(f"kvpool's vLLM plugin needs the KV tensor at offset 0, got {t.offset}")
    if layers == 1 or t.layer_stride >= n * t.block_stride:  # layer-outermost
        if layers > 1 and t.layer_stride != n * t.block_stride:
            raise NotImplementedError(
                f"padded layer stride {t.layer_stride} != {n} blocks x {t.block_stride} bytes is not supported")
        g = Geometry(layers, 1, t.block_stride, n, page_bytes=page_bytes)
    elif t.block_stride >= layers * t.layer_stride:  # block-outermost
        g = Geometry(1, 1, t.block_stride, n, page_bytes=page_bytes)
    else:
        raise NotImplementedError(
            f"interleaved KV layout (layer stride {t.layer_stride}, block stride {t.block_stride}) is not supported")
    return t, g


def _create_space(vllm_config: Any, kv_cache_configs: list[Any]) -> KVSpace | None:
    if not kv_cache_configs:
        return None
    world = int(vllm_config.parallel_config.world_size)
    if len(kv_cache_configs) != 1 or world != 1:
        # One space per engine; each rank of a TP/PP engine would need its own.
        raise NotImplementedError(
            f"kvpool's vLLM plugin supports one worker per engine, this one has {world} "
            f"(unset KVPOOL_VLLM to run it without kvpool)")
    _, g = _tensor_layout(kv_cache_configs[0])
    device = str(vllm_config.device_config.device_type)
    if device not in ("cpu", "cuda"):
        raise NotImplementedError(f"kvpool's vLLM plugin runs on cpu or cuda, not {device}")
    space = KVSpace(
        g, device=device, null_block=True, pool=Pool(default_pool_name(), device=device),
        name=os.environ.get("KVPOOL_VLLM_TENANT") or f"vllm-{os.getpid()}",
    )
    try:
        # vLLM's own check saw the virtual capacity: judge what the pool can back.
        check_one_request_fits(space, max_model_len=int(vllm_config.model_config.max_model_len),
                               block_size=int(kv_cache_configs[0].kv_cache_groups[0].kv_cache_spec.block_size))
    except BaseException:
        space.close()  # leave the pool: a refused engine holds no share
        raise
    if device == "cpu":
        shared = space.shared_memory()
        handle: dict[str, Any] = dataclasses.asdict(shared)
    else:
        handle = {"pid": os.getpid(), "fd": -1 - len(_spaces), "size": g.num_regions * g.region_bytes}
    handle["region_bytes"] = g.region_bytes
    _spaces[handle["fd"]] = space
    for cfg in kv_cache_configs:
        setattr(cfg, _ATTR, handle)
    get_logger(pool=space.pool.name if space.pool else None, tenant=space.name).info(
        "vllm space created", num_blocks=g.num_blocks, num_layers=g.num_layers, block_bytes=g.block_bytes,
        page_bytes=g.page_bytes, device=device, pid=os.getpid())
    return space


def _views(kv_cache_config: Any, device: Any, layout: Any,
           kernel_block_sizes: list[int] | None) -> dict[str, torch.Tensor]:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, create_kv_cache_views

    handle = getattr(kv_cache_config, _ATTR)
    t, g = _tensor_layout(kv_cache_config)
    same_process = handle["pid"] == os.getpid() and handle["fd"] in _spaces
    if same_process:
        raw = _spaces[handle["fd"]].memory()  # the space's own mapping
    else:
        raw = map_shared(SharedMemory(handle["pid"], handle["fd"], handle["size"]))
    get_logger().info("vllm worker views", owner_pid=handle["pid"], pid=os.getpid(), shared_file=not same_process,
                      bytes=raw.numel(), layers=len(t.layers))
    raw = raw.view(torch.int8)
    if raw.device != torch.device(device):
        raise RuntimeError(f"the kvpool space lives on {raw.device}, vLLM's worker on {device}")
    placed = dataclasses.replace(t, layer_stride=g.region_bytes, size=raw.numel()) if g.num_layers > 1 else t
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.kv_cache_specs[t.layers[0]]
    kernel_block_size = kernel_block_sizes[0] if kernel_block_sizes else None
    views = create_kv_cache_views(raw, spec, int(kv_cache_config.num_blocks), layout, placed,
                                  kernel_block_size=kernel_block_size)
    return dict(zip(t.layers, views))


def _block_pool(num_gpu_blocks: int, enable_caching: bool, hash_block_size: int, *args: Any,
                **kwargs: Any) -> KVPoolBlockPool:
    """Stands in for ``BlockPool(...)`` in vLLM's KV cache coordinator."""
    for fd, space in reversed(list(_spaces.items())):
        if space.geometry.num_blocks == num_gpu_blocks and not space.closed:
            return KVPoolBlockPool(num_gpu_blocks, enable_caching, hash_block_size, *args, space=space, **kwargs)
    raise RuntimeError(
        f"KVPOOL_VLLM is set but no kvpool space with {num_gpu_blocks} blocks was created in this process "
        f"(the plugin creates it when vLLM initializes the KV cache)")
