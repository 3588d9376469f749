"""kvpool for an SGLang server: an ``sglang.srt.plugins`` general plugin.

Enable it with one environment variable::

    KVPOOL_SGLANG=1 python -m sglang.launch_server --model-path ... [SGLang's own arguments]

SGLang loads general plugins (entry point ``kvpool`` in kvpool's
``pyproject.toml``) in every one of its processes and applies the hooks they
register through its own ``HookRegistry``; this one does nothing unless
``KVPOOL_SGLANG=1``. (``SGLANG_PLUGINS``, when set, must list ``kvpool``.)

What changes, in the scheduler process, at SGLang's own points:

1. ``MHATokenToKVPool._create_buffers_normal``: the KV buffers are views of
   a :class:`kvpool.KVSpace` (one region per layer and K/V, SGLang's token
   slots in order, slot 0's page is SGLang's padding page = the space's null
   block) in the pool ``$KVPOOL_POOL``, instead of ``torch.zeros`` of the
   whole capacity. SGLang still sizes the cache (``--mem-fraction-static``,
   ``--max-total-tokens``): that size is *virtual*; memory is committed page by
   page as SGLang holds pages, and given back as they empty.
2. ``KVCacheConfigurator._build_token_to_kv_pool_allocator``: SGLang's
   ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` becomes
   :class:`KVPoolSGLangAllocator` over that space (kvpool's
   :class:`~kvpool.adapters.sglang.KVPoolTokenAllocator` with SGLang's base
   class behind it for the scheduler's capacity hooks).
3. ``Scheduler.ingest_requests`` (the first call of every iteration of
   SGLang's normal and overlap event loops) flushes the allocator: its end of
   the previous iteration, the safe point after which a freed page may go
   back to the space (:mod:`kvpool.adapters._sglang_pages`). ``Scheduler.on_idle``
   (nothing in flight) flushes twice: every pending page goes back.
4. ``SchedulerInvariantChecker._check_full_pool`` (SGLang's idle and busy
   memory-leak checks): the conservation check counts every page SGLang does
   not hold as available, as SGLang's own allocators do. The allocator's
   ``available_size()`` is what the *pool* can back now, which is less
   whenever other engines hold memory: not a leak.
5. ``_dispatch_event_loop_once``: refuses, naming the reason, the loops
   whose iterations do not call ``ingest_requests`` exactly once (pipeline
   parallelism, PD disaggregation, PD multiplexing, MLX overlap) and tensor
   parallelism (each rank's scheduler would allocate from its own space, and
   SGLang's ranks must allocate alike).
6. ``ScheduleBatch.retract_decode`` (SGLang's preemption): the pages a
   retraction frees reach the space as a preemption
   (:meth:`kvpool.KVSpace.free_preempted`), so ``kvpool top``, ``stats()``
   and Prometheus count this engine's preemptions
   (:mod:`kvpool.adapters._sglang_preemption`, which also says why the
   allocator does not act on the pool's reclaim verdict).
7. Lending (the allocator's ``giving_back()``, read once per iteration and
   by the gates below): while the pool asks this engine for memory back,
   ``ingest_requests`` also evicts SGLang's whole prefix cache (finished
   requests' KV would keep pages from emptying; its pages reach the space
   as an eviction, ``reclaimed_by_eviction_bytes``), the allocator's
   ``create_prefill_budget`` admits nothing (a chunked prefill in progress
   continues only into the held pages' free slots), and its
   ``check_decode_capacity`` (SGLang's decode gate, which its retraction
   loop converges on) counts the free slots of the pages it holds: running
   requests decode on and finish, and their pages go back as they empty.
   When those slots run out SGLang retracts requests (6); the last one,
   which SGLang would abort, is retracted too (queued again, not failed),
   and a chunked prefill that cannot continue with nothing running is
   retracted at ``on_idle``. Each iteration ``ingest_requests`` publishes
   the engine's ``freeing`` (the pages its running requests within
   ``RECLAIM_STEPS`` of ``max_new_tokens`` empty as they finish,
   :mod:`kvpool.adapters._sglang_lending`; 0 while it gives nothing back),
   so the pool asks a lender that preempts beside it only for the rest.

Supported: MHA models with SGLang's default (NHD, unquantized) KV layout,
any page size, one scheduler per engine (TP=1, no DP attention), on CPU and
CUDA (the CUDA path is untested: no GPU here). Refused at start-up, by name:
hybrid (SWA, Mamba), MLA/DSA, HND or quantized KV caches, speculative
decoding (the draft model's KV pool would share the allocator but not the
space), and the loops above. A refusal stops SGLang (``SystemExit`` from
the plugin: SGLang logs and skips a plugin that raises an ``Exception``,
which would run stock SGLang under ``KVPOOL_SGLANG=1``).

Optional settings: ``KVPOOL_SGLANG_PAGE_BYTES`` (commit unit per layer and
K/V, default 2 MiB; a multiple of SGLang's page of KV), ``KVPOOL_SGLANG_TENANT``
(default ``sglang-<pid>``). Tested with SGLang 0.5.23 (:data:`TESTED`;
``KVPOOL_SGLANG_ALLOW_UNTESTED=1`` forces another release).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pkgutil
import re
from collections.abc import Callable
from typing import Any

import torch

from kvpool import Geometry, KVSpace, MiB, Pool
from kvpool.pool import default_pool_name
from kvpool.tracing import get_logger

from .sglang import KVPoolTokenAllocator, token_view

__all__ = ["ALLOW_UNTESTED_ENV", "ENABLE_ENV", "HOOKS", "TESTED", "UnsupportedSGLang", "enabled", "install",
           "register"]

ENABLE_ENV = "KVPOOL_SGLANG"
ALLOW_UNTESTED_ENV = "KVPOOL_SGLANG_ALLOW_UNTESTED"
# SGLang releases the hooks are tested with: [low, high).
TESTED = ((0, 5, 23), (0, 5, 24))
_log = logging.getLogger("sglang.kvpool")  # SGLang's namespace: shown at its level, in its format
_installed = False


class UnsupportedSGLang(RuntimeError):
    """This SGLang release or configuration is one the plugin does not support."""


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def enabled() -> bool:
    """Whether ``$KVPOOL_SGLANG`` turns the plugin on."""
    return _truthy(ENABLE_ENV)


def register() -> None:
    """SGLang's plugin hook (entry point ``sglang.srt.plugins``: ``kvpool``)."""
    if not enabled():
        return
    try:
        install()
    except UnsupportedSGLang as e:
        _log.error("%s", e)
        raise SystemExit(f"kvpool: {e}") from e  # an Exception would be logged and skipped by SGLang


# ------------------------------------------------------------- replacements
# AROUND hooks: SGLang's HookRegistry calls hook(original, *args, **kwargs).

def _unsupported(what: str) -> UnsupportedSGLang:
    return UnsupportedSGLang(f"kvpool's SGLang plugin does not support {what}; unset {ENABLE_ENV} to run SGLang "
                             "without kvpool")


def _device(device: Any) -> str:
    dev = torch.device(device)
    if dev.type == "cpu":
        return "cpu"
    if dev.type == "cuda":
        return f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
    raise _unsupported(f"the {dev.type} device (cpu and cuda only)")


def _create_buffers_normal(original: Callable[..., Any], pool: Any) -> None:
    """``MHATokenToKVPool._create_buffers_normal``: K/V buffers are views of a kvpool space."""
    if not enabled():
        original(pool)
        return
    if pool.kv_cache_layout != "nhd" or getattr(pool, "use_hnd", False):
        raise _unsupported(f"the {pool.kv_cache_layout!r} KV cache layout (SGLang's default NHD only)")
    if pool.v_head_dim != pool.head_dim:
        raise _unsupported(f"K and V of different head sizes ({pool.head_dim} and {pool.v_head_dim})")
    ps = int(pool.page_size)
    rows = int(pool.size) + ps
    if rows % ps:
        raise _unsupported(f"a KV pool of {pool.size} tokens, not a whole number of {ps}-token pages")
    token_shape = (int(pool.head_num), int(pool.head_dim))
    dtype = pool.store_dtype
    block_bytes = ps * token_shape[0] * token_shape[1] * dtype.itemsize
    page_bytes = int(os.environ.get("KVPOOL_SGLANG_PAGE_BYTES", str(2 * MiB)))
    device = _device(pool.device)
    space = KVSpace(Geometry(int(pool.layer_num), 2, block_bytes, rows // ps, page_bytes=page_bytes),
                    device=device, null_block=True, pool=Pool(default_pool_name(), device=device),
                    name=os.environ.get("KVPOOL_SGLANG_TENANT") or f"sglang-{os.getpid()}")
    pool.k_buffer = [token_view(space, layer, 0, dtype, ps, token_shape) for layer in range(pool.layer_num)]
    pool.v_buffer = [token_view(space, layer, 1, dtype, ps, token_shape) for layer in range(pool.layer_num)]
    pool.kvpool_space = space
    g = space.geometry
    get_logger(pool=space.pool.name if space.pool else None, tenant=space.name).info(
        "sglang space created", tokens=int(pool.size), page_size=ps, num_blocks=g.num_blocks,
        num_layers=g.num_layers, block_bytes=g.block_bytes, page_bytes=g.page_bytes, device=device, pid=os.getpid())
    _log.info("kvpool is on: pool '%s', tenant '%s'; SGLang's KV cache of %d tokens is virtual (%d pages of %d "
              "tokens); memory is committed %d bytes at a time as pages are used", space.pool.name if space.pool
              else "-", space.name, int(pool.size), rows // ps - 1, ps, g.page_commit_bytes)


_stock_allocators: tuple[type, ...] = ()  # SGLang's two plain allocators (set at install)
_allocator_class: type[KVPoolTokenAllocator] | None = None


def _build_allocator(original: Callable[..., Any], configurator: Any, *args: Any, **kwargs: Any) -> Any:
    """``KVCacheConfigurator._build_token_to_kv_pool_allocator``: SGLang's plain allocator over the space."""
    allocator = original(configurator, *args, **kwargs)
    token_to_kv_pool: Any = kwargs.get("token_to_kv_pool")
    space = getattr(token_to_kv_pool, "kvpool_space", None)
    if not enabled() or space is None:
        if enabled():
            raise _unsupported(f"this KV cache ({type(token_to_kv_pool).__name__}; kvpool backs SGLang's "
                               "MHATokenToKVPool in its default NHD, unquantized layout only)")
        return allocator
    if kwargs.get("token_to_kv_pool_allocator") is not None:
        raise _unsupported("speculative decoding (a draft model's KV cache shares the target's allocator)")
    if type(allocator) not in _stock_allocators:
        raise _unsupported(f"SGLang's {type(allocator).__name__} (TokenToKVPoolAllocator and "
                           "PagedTokenToKVPoolAllocator only)")
    if allocator.need_sort:
        raise _unsupported("PD disaggregation")
    if allocator.page_size != token_to_kv_pool.page_size or allocator.size != token_to_kv_pool.size:
        raise _unsupported(f"an allocator of {allocator.size} tokens in pages of {allocator.page_size} over a KV "
                           f"cache of {token_to_kv_pool.size} in pages of {token_to_kv_pool.page_size} "
                           "(decode context parallelism)")
    assert _allocator_class is not None
    return _allocator_class(allocator.size, allocator.page_size, dtype=allocator.dtype, device=allocator.device,
                            kvcache=token_to_kv_pool, need_sort=False, space=space)


def _kvpool_allocator(scheduler: Any) -> KVPoolTokenAllocator | None:
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    return allocator if isinstance(allocator, KVPoolTokenAllocator) else None


def _ingest_requests(original: Callable[..., Any], scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """``Scheduler.ingest_requests``: the top of a loop iteration is the previous one's end.
    While the engine gives memory back, its prefix cache goes first (module docstring, 7)."""
    allocator = _kvpool_allocator(scheduler)
    if allocator is not None:
        allocator.flush()
        if allocator.giving_back():
            with allocator.evicting():  # counted as reclaimed by eviction
                _drop_prefix_cache(getattr(scheduler, "tree_cache", None))
            allocator.publish_freeing(_running(scheduler))
        else:
            allocator.publish_freeing(())  # 0 (republished only when it was not)
    return original(scheduler, *args, **kwargs)


def _running(scheduler: Any) -> list[tuple[int, Any]]:
    """(decode steps left, token slots held) of every request holding KV: the running
    batch's and a chunked prefill's (which does not finish within the bound)."""
    reqs = list(getattr(getattr(scheduler, "running_batch", None), "reqs", None) or ())
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None and all(r is not chunked for r in reqs):
        reqs.append(chunked)
    reqs = [r for r in reqs if r.kv.req_pool_idx is not None and r.kv.kv_allocated_len > 0]
    if not reqs:
        return []
    # One copy to the host for all of them (the table lives on SGLang's device).
    rows = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
    table = scheduler.req_to_token_pool.req_to_token
    held = table[rows.to(table.device), : max(r.kv.kv_allocated_len for r in reqs)].cpu()
    out = []
    for i, r in enumerate(reqs):
        cap = r.sampling_params.max_new_tokens
        left = (1 << 30) if r is chunked or cap is None else max(0, int(cap) - len(r.output_ids))
        out.append((left, held[i, : r.kv.kv_allocated_len]))
    return out


def _drop_prefix_cache(tree_cache: Any) -> None:
    """Evict every unlocked prefix-cache entry: finished requests' KV that SGLang keeps
    for reuse would otherwise keep the pages from emptying."""
    evictable = int(tree_cache.evictable_size()) if tree_cache is not None else 0
    if evictable > 0:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        tree_cache.evict(EvictParams(num_tokens=evictable))


def _on_idle(original: Callable[..., Any], scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """``Scheduler.on_idle``: no batch is in flight, so every pending page can go back
    (and a lender's stalled chunked prefill is retracted, module docstring, 7)."""
    allocator = _kvpool_allocator(scheduler)
    if allocator is not None:
        allocator.flush()
        allocator.flush()
        _retract_stalled_chunk(scheduler, allocator)
    return original(scheduler, *args, **kwargs)


def _retract_stalled_chunk(scheduler: Any, allocator: KVPoolTokenAllocator) -> None:
    """A lender's chunked prefill waits for free slots on its pages (the prefill budget);
    with nothing running, none will come: retract it as SGLang's own pause does
    (``retract_all``, back to the waiting queue), counted as a preemption, so its pages
    empty and the engine admits it again once it no longer gives memory back."""
    req = getattr(scheduler, "chunked_req", None)
    if (req is None or req.finished() or getattr(req, "inflight_middle_chunks", 0) > 0
            or getattr(getattr(scheduler, "running_batch", None), "reqs", None) or not allocator.giving_back()
            or allocator.decode_size() >= allocator.page_size):
        return
    from sglang.srt.managers.schedule_batch import retract_all

    allocator.begin_preemption()
    retract_all(reqs=[req], req_to_token_pool=scheduler.req_to_token_pool, token_to_kv_pool_allocator=allocator,
                tree_cache=scheduler.tree_cache, hisparse_coordinator=getattr(scheduler, "hisparse_coordinator", None),
                offload_kv=False)
    allocator.end_preemption(1, len(req.origin_input_ids) + len(req.output_ids))
    scheduler.chunked_req = None
    scheduler._add_request_to_queue(req, is_retracted=True)
    _log.warning("kvpool: retracted chunked prefill %s: this engine gives memory back and its pages have no free "
                 "slot for the next chunk", req.rid)


def _check_full_pool(original: Callable[..., Any], checker: Any, ps: Any, *args: Any, **kwargs: Any) -> Any:
    """``SchedulerInvariantChecker._check_full_pool``: pages SGLang does not hold are available."""
    allocator = checker.token_to_kv_pool_allocator
    if isinstance(allocator, KVPoolTokenAllocator):
        free = int(allocator.get_all_free_pages().numel()) * allocator.page_size
        ps = dataclasses.replace(ps, full_available_size=free)
    return original(checker, ps, *args, **kwargs)


def _dispatch_event_loop_once(original: Callable[..., Any], scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """``_dispatch_event_loop_once``: only loops that flush once per iteration (module docstring, 5)."""
    if _kvpool_allocator(scheduler) is not None:
        from sglang.srt.runtime_context import get_parallel

        mode = getattr(scheduler.disaggregation_mode, "name", str(scheduler.disaggregation_mode))
        parallel = get_parallel()
        why = [what for what, on in (("PD disaggregation", mode != "NULL"),
                                     ("PD multiplexing", bool(getattr(scheduler, "enable_pdmux", False))),
                                     # Each rank's scheduler would hold its own space: their
                                     # allocations must agree, and one rank's pool may be short.
                                     ("tensor parallelism", getattr(parallel, "tp_size", 1) > 1),
                                     ("pipeline parallelism", getattr(parallel, "pp_size", 1) > 1),
                                     ("the MLX overlap loop", bool(getattr(scheduler, "enable_overlap_mlx", False))))
               if on]
        if why:
            raise _unsupported(", ".join(why))
    return original(scheduler, *args, **kwargs)


def _retract_decode(original: Callable[..., Any], batch: Any, *args: Any, **kwargs: Any) -> Any:
    """``ScheduleBatch.retract_decode``: SGLang's preemption. The pages it frees reach the
    space as a preemption, counted in the tenant's slot (module docstring, 6)."""
    allocator = getattr(batch, "token_to_kv_pool_allocator", None)
    if not isinstance(allocator, KVPoolTokenAllocator):
        return original(batch, *args, **kwargs)
    allocator.begin_preemption()
    out = original(batch, *args, **kwargs)
    retracted, _, aborted = out
    if aborted and allocator.giving_back():
        # SGLang keeps one request and aborts it when even that one does not
        # fit: for a lender that is only a shortage of free slots on the pages
        # it holds (decode_size). Its KV is released exactly as a retracted
        # one's (release_req, reset_for_retract): queue it again instead.
        for req in [r for r in aborted if r.beam_group is None and _out_of_memory(r)]:
            req.to_finish = None
            aborted.remove(req)
            retracted.append(req)
            _log.warning("kvpool: request %s is retracted, not aborted: this engine gives memory back and its "
                         "pages have no free slot for its next token", req.rid)
    # A retracted request keeps its output: its prompt and output are prefilled again.
    tokens = sum(len(r.origin_input_ids) + len(r.output_ids) for r in retracted)
    allocator.end_preemption(len(retracted), tokens)
    return out


def _out_of_memory(req: Any) -> bool:
    """Whether SGLang's retract_decode aborted ``req`` as the last request that does not fit."""
    return "Out of memory even after retracting" in str(getattr(req.to_finish, "message", ""))


# SGLang's targets and kvpool's AROUND hooks (module docstring, 1-7).
HOOKS: tuple[tuple[str, Callable[..., Any]], ...] = (
    ("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal", _create_buffers_normal),
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool_allocator",
     _build_allocator),
    ("sglang.srt.managers.scheduler.Scheduler.ingest_requests", _ingest_requests),
    ("sglang.srt.managers.scheduler.Scheduler.on_idle", _on_idle),
    ("sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker._check_full_pool",
     _check_full_pool),
    ("sglang.srt.managers.scheduler._dispatch_event_loop_once", _dispatch_event_loop_once),
    ("sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode", _retract_decode),
)


def check_version(version: str) -> None:
    """Refuse an SGLang release outside :data:`TESTED` unless forced."""
    (lo, hi) = TESTED
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if m is not None and lo <= tuple(int(x) for x in m.groups()) < hi:
        return
    tested = f">={'.'.join(map(str, lo))},<{'.'.join(map(str, hi))}"
    if _truthy(ALLOW_UNTESTED_ENV):
        _log.warning("kvpool: SGLang %s is outside the tested range %s; hooking anyway (%s is set)", version,
                     tested, ALLOW_UNTESTED_ENV)
        return
    raise UnsupportedSGLang(
        f"kvpool's SGLang plugin is tested with SGLang {tested} and this is SGLang {version}: its hook points "
        f"(kvpool.adapters.sglang_plugin.HOOKS) may no longer match. Unset {ENABLE_ENV} to run stock SGLang, install "
        f"a tested release, or set {ALLOW_UNTESTED_ENV}=1 to try anyway.")


def install() -> None:
    """Register the hooks with SGLang's ``HookRegistry`` (once), after checking the
    release and that every target exists: all of them or none."""
    global _installed, _allocator_class, _stock_allocators
    if _installed:
        return
    import sglang
    from sglang.srt.mem_cache.allocator import (BaseTokenToKVPoolAllocator, PagedTokenToKVPoolAllocator,
                                                TokenToKVPoolAllocator)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_version(str(sglang.__version__))
    for target, _ in HOOKS:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError) as e:
            raise UnsupportedSGLang(f"kvpool's SGLang plugin cannot find {target} in this SGLang ({e}); nothing was "
                                    f"hooked. Unset {ENABLE_ENV} to run stock SGLang.") from e
    _stock_allocators = (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator)
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget

    _allocator_class = _sglang_allocator_class(BaseTokenToKVPoolAllocator, _prefill_budget_class(PrefillBudget))
    for target, hook in HOOKS:
        HookRegistry.register(target, hook, HookType.AROUND)
    _installed = True


def _prefill_budget_class(base: type) -> type:
    class KVPoolPrefillBudget(base):  # type: ignore[misc]
        """SGLang's prefill budget, empty while the engine gives memory back: it
        admits no new request, and a chunked prefill in progress continues only
        into the free slots of the pages it holds."""

        allocator: KVPoolTokenAllocator

        def _available_and_evictable(self) -> int:
            return 0 if self.allocator.giving_back() else int(super()._available_and_evictable())

        def available_chunk_tokens(self, chunk_limit: int) -> int | None:
            if not self.allocator.giving_back():
                return super().available_chunk_tokens(chunk_limit)  # type: ignore[no-any-return]
            room = self.allocator.decode_size() // self.page_size * self.page_size
            return min(chunk_limit, room) if room > 0 else None  # None: the chunk waits

    return KVPoolPrefillBudget


def _sglang_allocator_class(base: type, budget_class: type) -> type[KVPoolTokenAllocator]:
    class KVPoolSGLangAllocator(KVPoolTokenAllocator, base):  # type: ignore[misc]
        """kvpool's allocator first; SGLang's base class supplies the scheduler's
        capacity hooks (``check_decode_capacity``, ``evict_to_free_tokens``,
        ``create_prefill_budget``, ``verify_byte_accounting`` ...), written
        against ``available_size()``: what the pool can back now."""

        # No page free list: SGLang's audits read get_all_free_pages() instead.
        free_pages = None
        release_pages = None

        def check_decode_capacity(self, *, num_tokens: int, tree_cache: Any, requests: Any = None,
                                  spec_algorithm: Any = None) -> bool:
            """SGLang's decode gate (its retraction loop converges on it): what the
            running requests can get, the held pages' free slots included while
            giving back (:meth:`decode_size`), taken now (:meth:`reserve`)."""
            self.evict_to_free_tokens(tree_cache, num_tokens)
            return self.reserve(num_tokens)

        def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> Any:
            return budget_class(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

        def merge_and_sort_free(self) -> None:
            """Nothing to merge: the space hands out pages best-fit."""

        def resize(self, config: Any) -> None:
            raise NotImplementedError("kvpool's SGLang allocator cannot be resized (its space is fixed at start-up)")

        def get_cpu_copy(self, indices: Any, mamba_indices: Any = None, req_pool_index: Any = None) -> Any:
            return self._kvcache.get_cpu_copy(indices, mamba_indices=mamba_indices, req_pool_index=req_pool_index)

        def load_cpu_copy(self, kv_cache_cpu: Any, indices: Any, mamba_indices: Any = None,
                          req_pool_index: Any = None) -> Any:
            return self._kvcache.load_cpu_copy(kv_cache_cpu, indices, mamba_indices=mamba_indices,
                                               req_pool_index=req_pool_index)

    return KVPoolSGLangAllocator
