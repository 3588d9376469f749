"""kvpool's SGLang plugin against SGLang's real classes (its unpacked source).

Run with the vLLM venv's Python and SGLang's source on the path
(scripts/sglang_src.sh): ``python plugin_checks.py POOL_NAME``. SGLang's own
``load_plugins()`` loads kvpool through its entry point first; every later
check runs with the hooks in place. Prints one JSON object {check name: "ok"
| traceback} (tests/test_adapter_sglang_plugin.py asserts every entry is
"ok"). What is not SGLang's here: a tree cache and stats observer of zero
(the leak check's other terms), and the original of the allocator hook (a
real ``KVCacheConfigurator`` needs a loaded model: the hook is called with
SGLang's ``PagedTokenToKVPoolAllocator`` built as SGLang builds it).
"""

from __future__ import annotations

import inspect
import json
import os
import pkgutil
import sys
import traceback
from array import array
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

os.environ["KVPOOL_SGLANG"] = "1"
os.environ.pop("SGLANG_PLUGINS", None)
os.environ["KVPOOL_SGLANG_PAGE_BYTES"] = str(16 << 10)  # 8 SGLang pages of 4 tokens x 2 heads x 64 x fp32 (2 KiB)

import sglang  # noqa: E402
from sglang.srt.mem_cache.allocator import (BaseTokenToKVPoolAllocator,  # noqa: E402
                                            PagedTokenToKVPoolAllocator)

from kvpool import Pool  # noqa: E402
from kvpool.adapters import sglang_plugin as plugin  # noqa: E402
from kvpool.adapters.sglang import KVPoolTokenAllocator  # noqa: E402

PS, HEADS, DIM, LAYERS, PAGES = 4, 2, 64, 2, 63  # + SGLang's padding page: 64 blocks of 2 KiB, 8 kvpool pages
BLOCK = PS * HEADS * DIM * 4
CHECKS: dict[str, Callable[[], None]] = {}
STOCK = {target: pkgutil.resolve_name(target) for target, _ in plugin.HOOKS}  # before SGLang loads the plugin


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


def kv_pool() -> Any:
    """SGLang's own MHATokenToKVPool, as its KV cache configurator builds one (CPU, float32)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(PAGES * PS, PS, torch.float32, HEADS, DIM, LAYERS, "cpu", False, enable_alt_stream=False)


def allocator(pool: Any, *, draft: Any = None) -> Any:
    """What the hooked KVCacheConfigurator._build_token_to_kv_pool_allocator returns for ``pool``."""
    def build(configurator: Any, **kw: Any) -> Any:  # SGLang's branch for page_size > 1 (kv_cache_configurator)
        return PagedTokenToKVPoolAllocator(PAGES * PS, page_size=PS, dtype=torch.float32, device="cpu",
                                           kvcache=kw["token_to_kv_pool"], need_sort=False)

    return plugin._build_allocator(build, None, sizes=None, token_to_kv_pool=pool, is_dsv4_model=False,
                                   req_to_token_pool=None, token_to_kv_pool_allocator=draft)


def extend(alloc: Any, prefix: list[int], seq: list[int], last_loc: list[int]) -> Any:
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return alloc.alloc_extend(t(prefix), t(prefix), t(seq), t(seq), t(last_loc), sum(seq) - sum(prefix))


@check
def sglangs_load_plugins_runs_kvpools_entry_point_and_wraps_every_target() -> None:
    from sglang.srt.plugins import load_plugins

    assert sglang.__version__ == "0.5.23", sglang.__version__
    load_plugins()
    for target, hook in plugin.HOOKS:
        now = pkgutil.resolve_name(target)
        assert now is not STOCK[target], f"{target} is not hooked"
        assert now.__wrapped__ is STOCK[target], target  # SGLang's AROUND wrapper over SGLang's own
        assert hook.__module__ == plugin.__name__


@check
def the_hooked_originals_take_the_arguments_the_hooks_read() -> None:
    # The allocator hook reads token_to_kv_pool and token_to_kv_pool_allocator
    # by keyword: SGLang's signature must keep them keyword-only.
    params = inspect.signature(STOCK[plugin.HOOKS[1][0]]).parameters
    for name in ("token_to_kv_pool", "token_to_kv_pool_allocator"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, params
    checker = STOCK[plugin.HOOKS[4][0]]
    assert list(inspect.signature(checker).parameters)[:3] == ["self", "ps", "uncached"]
    for target in (plugin.HOOKS[0][0], plugin.HOOKS[3][0]):
        assert list(inspect.signature(STOCK[target]).parameters) == ["self"], target
    assert list(inspect.signature(STOCK[plugin.HOOKS[2][0]]).parameters)[0] == "self"  # ingest_requests: forwarded
    # Both of SGLang's ordinary loops call ingest_requests once per iteration and on_idle when idle.
    from sglang.srt.managers.scheduler import Scheduler

    for loop in (Scheduler.event_loop_normal, Scheduler.event_loop_overlap):
        source = inspect.getsource(loop)
        assert source.count("self.ingest_requests()") == 1 and "self.on_idle()" in source, loop.__name__


@check
def sglangs_retraction_returns_the_requests_the_hook_counts() -> None:
    # The hook on retract_decode counts its frees as a preemption of the requests it
    # returns first (kvpool.adapters._sglang_preemption); a retracted request keeps its
    # output ids, prefilled again with its prompt.
    target = "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode"
    assert (target, plugin._retract_decode) in plugin.HOOKS
    retract = STOCK[target]
    assert list(inspect.signature(retract).parameters) == ["self"]
    source = inspect.getsource(retract)
    assert "return retracted_reqs, " in source and "self.release_req(" in source
    # A lender's last request is retracted, not aborted: the hook recognises SGLang's abort
    # by its message, and that request's KV was released as a retracted one's.
    assert '"Out of memory even after retracting all other requests "' in source, source
    assert "self.release_req(last_idx, 0, offload_kv=False)" in source
    # A lender's stalled chunked prefill is retracted as SGLang's pause does.
    from sglang.srt.managers.schedule_batch import retract_all
    from sglang.srt.managers.scheduler import Scheduler

    assert list(inspect.signature(retract_all).parameters) == [
        "reqs", "req_to_token_pool", "token_to_kv_pool_allocator", "tree_cache", "hisparse_coordinator", "offload_kv"]
    assert "is_retracted" in inspect.signature(Scheduler._add_request_to_queue).parameters
    pause = inspect.getsource(Scheduler)
    assert "retract_reqs.append(self.chunked_req)" in pause and "self.chunked_req = None" in pause


@check
def sglangs_kv_buffers_are_views_of_a_kvpool_space_that_commits_nothing_up_front() -> None:
    pool = kv_pool()
    space = pool.kvpool_space
    g = space.geometry
    assert (g.num_layers, g.num_kv_buffers, g.block_bytes, g.num_blocks) == (LAYERS, 2, BLOCK, PAGES + 1), g
    assert [tuple(b.shape) for b in pool.k_buffer + pool.v_buffer] == [((PAGES + 1) * PS, HEADS, DIM)] * 4
    memory = space.memory()
    lo, hi = memory.data_ptr(), memory.data_ptr() + memory.numel() * memory.element_size()
    assert all(lo <= b.data_ptr() < hi for b in pool.k_buffer + pool.v_buffer)
    assert space.stats().used_blocks == 0
    space.close()


@check
def sglangs_paged_allocator_becomes_kvpools_over_that_space_with_sglangs_base_behind() -> None:
    pool = kv_pool()
    alloc = allocator(pool)
    assert isinstance(alloc, KVPoolTokenAllocator) and isinstance(alloc, BaseTokenToKVPoolAllocator)
    assert alloc.space is pool.kvpool_space and alloc.get_kvcache() is pool
    assert alloc.available_size() == PAGES * PS and alloc.verify_byte_accounting() == []
    assert alloc.check_decode_capacity(num_tokens=PS, tree_cache=None)  # SGLang's base-class hook, on kvpool's size
    pool.kvpool_space.close()


@check
def kv_written_through_sglangs_pool_lands_in_held_pages_and_goes_back_after_the_flushes() -> None:
    pool = kv_pool()
    alloc = allocator(pool)
    stock = PagedTokenToKVPoolAllocator(PAGES * PS, page_size=PS, dtype=torch.float32, device="cpu",
                                        kvcache=None, need_sort=False)
    space = pool.kvpool_space
    # Two requests: 6 new tokens from scratch, and 5 more after a 2-token
    # prefix that holds one page already (its last token at last_loc).
    prefix, prefix_ref = alloc.alloc(PS), stock.alloc(PS)
    last, last_ref = int(prefix[1]), int(prefix_ref[1])
    loc = extend(alloc, [0, 2], [6, 7], [-1, last])
    ref = extend(stock, [0, 2], [6, 7], [-1, last_ref])
    assert (loc % PS).tolist() == (ref % PS).tolist()  # SGLang's slot layout within pages
    assert loc[6:8].tolist() == [last + 1, last + 2]  # the prefix's page continues after last_loc
    k = torch.randn(len(loc), HEADS, DIM)
    pool.set_kv_buffer(SimpleNamespace(layer_id=0), loc, k, -k)  # SGLang's own write path
    assert torch.equal(pool.get_key_buffer(0)[loc], k) and torch.equal(pool.get_value_buffer(0)[loc], -k)
    assert space.stats().used_blocks == 4  # the prefix's page and three new ones
    alloc.free(torch.cat([prefix, loc]))
    assert space.stats().used_blocks == 4  # pending: a step in flight may still read them
    sched = SimpleNamespace(token_to_kv_pool_allocator=alloc)
    plugin._ingest_requests(lambda s: None, sched)  # the top of the next iteration: one flush
    assert space.stats().used_blocks == 4
    plugin._on_idle(lambda s: None, sched)  # nothing in flight: everything pending goes back
    assert space.stats().used_blocks == 0
    space.close()


@check
def the_idle_leak_check_counts_pages_sglang_does_not_hold_not_what_the_pool_can_back() -> None:
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
    from sglang.srt.managers.scheduler_components.pool_stats_observer import PoolStats

    name = os.environ["KVPOOL_POOL"]
    Pool.remove(name)
    Pool(name, capacity=2 * (16 << 10) * 2 * LAYERS)  # 2 kvpool pages: 7 + 8 of SGLang's 63 pages
    pool = kv_pool()
    alloc = allocator(pool)
    zero = SimpleNamespace(protected_size=lambda: 0, session_held_tokens=lambda: 0)
    checker = SchedulerInvariantChecker(
        is_hybrid_swa=False, is_hybrid_ssm=False, disaggregation_mode=DisaggregationMode.NULL, page_size=PS,
        full_tokens_per_layer=None, swa_tokens_per_layer=None, max_total_num_tokens=PAGES * PS, tree_cache=zero,
        token_to_kv_pool_allocator=alloc, req_to_token_pool=None, pool_stats_observer=zero,
        get_last_batch=lambda: None, get_running_batch=lambda: None, scheduler_stage_metrics=None)

    def stats() -> Any:  # what SchedulerPoolStatsObserver._get_token_info reports
        available = alloc.available_size()
        return PoolStats(full_num_used=PAGES * PS - available, full_token_usage=0.0, full_available_size=available,
                         full_evictable_size=0)

    assert alloc.available_size() == 15 * PS < PAGES * PS, alloc.available_size()  # less than SGLang's size
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(dcp_enabled=False):  # as a server without decode context parallelism has it
        check_full_pool(checker, alloc, stats)
    pool.kvpool_space.close()


def check_full_pool(checker: Any, alloc: Any, stats: Callable[[], Any]) -> None:
    stock = STOCK[plugin.HOOKS[4][0]]
    assert stock(checker, stats())[0], "SGLang's own check calls the pool's edge a leak"
    leak, msg = checker._check_full_pool(stats())
    assert not leak, msg
    loc = alloc.alloc(2 * PS)  # held by no request SGLang knows of: a real leak
    leak, msg = checker._check_full_pool(stats())
    assert leak and f"available={(PAGES - 2) * PS}" in msg, msg
    leak, msg = checker._check_full_pool(stats(), uncached=2 * PS)  # owned by a request: accounted
    assert not leak, msg
    alloc.free(loc)


@check
def a_lender_admits_nothing_drops_its_prefix_cache_and_decodes_into_its_held_pages() -> None:
    # Module docstring of the plugin, 7: SGLang's own prefill budget, decode gate and radix
    # cache, with a second tenant waiting below its guarantee in a thread.
    import threading

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    from kvpool.adapters._reclaim import RECLAIM_STEPS

    from kvpool import Geometry, KVSpace

    for hook in ("check_decode_capacity", "create_prefill_budget"):  # SGLang calls them by these names
        assert (list(inspect.signature(getattr(BaseTokenToKVPoolAllocator, hook)).parameters)
                == list(inspect.signature(getattr(plugin._allocator_class, hook)).parameters)), hook
    for name in ("_available_and_evictable", "available_chunk_tokens", "has_capacity"):
        assert callable(getattr(PrefillBudget, name)), name
    name = os.environ["KVPOOL_POOL"]
    Pool.remove(name)
    commit = (16 << 10) * 2 * LAYERS
    Pool(name, capacity=4 * commit)  # 4 kvpool pages; two tenants: a guarantee of 2 each
    pool = kv_pool()
    alloc = allocator(pool)
    x: list[Any] = []
    y: list[Any] = []
    for i in range(3 * 8 - 1):  # 3 kvpool pages of 8 SGLang pages (but the padding one), interleaved
        got = alloc.alloc(PS)
        assert got is not None
        (x if i % 2 == 0 else y).append(got)
    cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                       page_size=PS))
    cached = alloc.alloc(PS)  # a finished request's page, kept for reuse: evictable
    cache.insert(InsertParams(key=RadixKey(list(range(PS))), value=cached))
    assert cache.evictable_size() == PS
    other = KVSpace(Geometry(1, 1, commit, 4, page_bytes=commit), pool=Pool(name), reserve=(0, 0),
                    reserve_thread=False, name="waiter")
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(other.acquire(2, stall=600)))
    waiter.start()
    while not any(t.waiting for t in Pool(name).tenants() if t.name == "waiter"):
        threading.Event().wait(0.002)
    # x's and y's requests, as SGLang's scheduler holds them: x within the reclaim bound of
    # its max_new_tokens, y far from it.
    rows = ReqToTokenPool(size=2, max_context_len=1024, device="cpu", enable_memory_saver=False)
    reqs = [Req(f"r{i}", "", array("i", [1] * 8), SamplingParams(max_new_tokens=n))
            for i, n in enumerate((RECLAIM_STEPS, 10 * RECLAIM_STEPS))]
    for r, idx, slots in zip(reqs, rows.alloc(reqs), (x, y)):
        held = torch.cat(slots)
        rows.write((idx, slice(0, len(held))), held.to(torch.int32))
        r.kv.kv_allocated_len = len(held)
    sched = SimpleNamespace(token_to_kv_pool_allocator=alloc, tree_cache=cache, req_to_token_pool=rows,
                            running_batch=SimpleNamespace(reqs=reqs), chunked_req=None)
    plugin._ingest_requests(lambda s: None, sched)  # the top of an iteration: the lender drops its cache
    assert alloc.giving_back() and cache.evictable_size() == 0
    me = next(t for t in Pool(name).tenants() if t.name == alloc.space.name)
    assert not me.preempts and me.freeing_bytes == 0  # x's pages are y's too: none empties when x finishes
    reqs[1].sampling_params.max_new_tokens = len(reqs[1].output_ids) + 1  # y is about to finish too
    plugin._ingest_requests(lambda s: None, sched)
    me = next(t for t in Pool(name).tenants() if t.name == alloc.space.name)
    assert me.freeing_bytes == 3 * commit  # every page it holds empties
    budget = alloc.create_prefill_budget(cache)
    assert isinstance(budget, PrefillBudget) and not budget.has_capacity()  # admits nothing
    alloc.flush()
    alloc.flush()  # the evicted page went back: x and y still hold every slot of their pages
    b = alloc.space.budget()  # as an eviction (one SGLang page: a kvpool block), not a completion
    assert (b.reclaimed_by_eviction_bytes, b.reclaimed_by_completion_bytes) == (commit // 8, 0), b
    assert not alloc.check_decode_capacity(num_tokens=PS, tree_cache=cache)
    assert budget.available_chunk_tokens(64) is None  # a chunk in progress waits too
    alloc.free(torch.cat(x))  # x finishes: its slots become room on pages y still holds
    alloc.flush()
    alloc.flush()
    room = len(x) * PS
    assert alloc.check_decode_capacity(num_tokens=room, tree_cache=cache)
    assert alloc.pending_pages().numel() * PS == room  # taken at the gate: no other engine can take them now
    assert not alloc.check_decode_capacity(num_tokens=room + PS, tree_cache=cache)
    assert budget.available_chunk_tokens(64) == min(64, room) and not budget.has_capacity()
    alloc.free(torch.cat(y))  # y finishes: the pages empty and go to the waiter
    alloc.flush()
    alloc.flush()
    waiter.join()
    assert len(got) == 1 and len(got[0]) == 2
    assert not alloc.giving_back() and alloc.create_prefill_budget(cache).has_capacity()
    assert alloc.space.budget().requests_preempted == 0
    plugin._ingest_requests(lambda s: None, sched)  # gives nothing back any more: freeing goes back to 0
    assert alloc.space.budget().freeing_bytes == 0
    other.close()
    pool.kvpool_space.close()


@check
def unsupported_configurations_are_refused_by_name() -> None:
    pool = kv_pool()
    for draft, words in ((object(), "speculative decoding"),):
        try:
            allocator(pool, draft=draft)
        except plugin.UnsupportedSGLang as e:
            assert words in str(e) and plugin.ENABLE_ENV in str(e), e
        else:
            raise AssertionError(f"{words} must be refused")
    pool.kvpool_space.close()
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    try:
        MHATokenToKVPool(PAGES * PS, PS, torch.float32, HEADS, DIM, LAYERS, "cpu", False, enable_alt_stream=False,
                         v_head_dim=DIM // 2)
    except plugin.UnsupportedSGLang as e:
        assert "different head sizes" in str(e), e
    else:
        raise AssertionError("K and V of different sizes must be refused")


@check
def an_untested_sglang_release_stops_sglang_naming_the_range() -> None:
    real = sglang.__version__
    sglang.__version__ = "0.5.24"
    plugin._installed = False
    try:
        plugin.register()
    except SystemExit as e:
        assert ">=0.5.23,<0.5.24" in str(e) and "SGLang 0.5.24" in str(e) and plugin.ALLOW_UNTESTED_ENV in str(e), e
    else:
        raise AssertionError("SGLang 0.5.24 must be refused")
    finally:
        sglang.__version__ = real
        plugin._installed = True


def main() -> None:
    os.environ["KVPOOL_POOL"] = sys.argv[1]
    Pool(sys.argv[1], capacity=64 << 20)
    results: dict[str, str] = {}
    try:
        for name, fn in CHECKS.items():
            try:
                fn()
                results[name] = "ok"
            except BaseException:
                results[name] = traceback.format_exc()
    finally:
        Pool.remove(sys.argv[1])
    print(json.dumps(results))


if __name__ == "__main__":
    main()
