"""The plugin's patch table against real vLLM, in the vLLM venv.

Run with the vLLM venv's Python: ``python hooks_checks.py``. Each check
starts and ends with vLLM unpatched; the script prints one JSON object
{check name: "ok" | traceback} (tests/test_adapter_vllm_hooks.py asserts
every entry is "ok"). No engine is started: these are the install's own
contracts (all-or-nothing, idempotent, reversible, version-gated).
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import re
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any

import vllm

from kvpool.adapters.vllm import _hooks as H
from kvpool.adapters.vllm import _patching as P

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


def targets() -> dict[str, Any]:
    """What every patch point's attribute is bound to right now."""
    out: dict[str, Any] = {}
    for point in H.PATCHES:
        r = P.resolve(point)
        if r is None:
            continue
        owner, leaf, _ = r
        out[point.name] = getattr(owner, leaf)
    return out


def assert_stock(stock: dict[str, Any]) -> None:
    now = targets()
    assert now.keys() == stock.keys(), (now.keys(), stock.keys())
    changed = [name for name in stock if now[name] is not stock[name]]
    assert not changed, f"still patched: {changed}"
    assert not H.installed()
    assert not any(isinstance(f, P._OnImport) for f in sys.meta_path), "the import hook is still in place"


def assert_patched_once(stock: dict[str, Any]) -> None:
    now = targets()
    for name, original in stock.items():
        replacement = now[name]
        assert getattr(replacement, "__kvpool_patch__", None) == name, name
        assert replacement.__wrapped__ is original, f"{name} wraps a replacement, not vLLM's original"
    assert H.installed()


def boom(original: Any) -> Any:
    raise RuntimeError("injected: this patch point's replacement cannot be built")


@check
def a_patch_point_failing_midway_leaves_vllm_unpatched_and_a_second_install_is_clean() -> None:
    stock = targets()
    half = len(H.PATCHES) // 2
    failing = H.PatchPoint("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output", boom)
    try:
        H.install(H.PATCHES[:half] + (failing,) + H.PATCHES[half:])
    except RuntimeError as e:
        assert "injected" in str(e), e
    else:
        raise AssertionError("the failing patch point did not fail the install")
    assert_stock(stock)  # the points set before the failure were put back
    # A setter that refuses (a built-in type) midway, too.
    frozen = H.PatchPoint("builtins", "int.bit_length", lambda original: (lambda self: 0))
    try:
        H.install(H.PATCHES[:half] + (frozen,) + H.PATCHES[half:])
    except TypeError:
        pass
    else:
        raise AssertionError("setting an attribute of int must fail")
    assert_stock(stock)
    H.install()
    try:
        assert_patched_once(stock)
    finally:
        H.uninstall()
    assert_stock(stock)


def _fresh(code: str) -> Any:
    """Run ``code`` in a fresh process (as an engine installs the plugin); its last stdout line as JSON."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@check
def the_cpu_workers_row_is_set_when_vllm_imports_it_and_install_never_imports_it() -> None:
    # Regression: a row that imported vLLM's CPU worker at install loaded it
    # in the engine-core process too, where it patches torch process-wide
    # (torch.Event, pin_memory, ...) and imports gpu_model_runner, which then
    # bound the unpatched allocate_kv_cache (engines allocated vLLM's own KV
    # cache), and a TP=2 engine's ranks started differently.
    report = _fresh(
        "import sys, json, torch\n"
        "from kvpool.adapters.vllm import _hooks as H\n"
        "stock_event = torch.Event\n"
        "H.install()\n"
        "r = {'imported_at_install': 'vllm.v1.worker.cpu_worker' in sys.modules,\n"
        "     'torch_untouched': torch.Event is stock_event}\n"
        "import vllm.v1.worker.cpu_worker as w\n"
        "r['row'] = getattr(w.CPUWorker.determine_available_memory, '__kvpool_patch__', None)\n"
        "r['unpatched_allocate_kv_cache'] = sorted(n for n, m in list(sys.modules.items()) if n.startswith('vllm.')\n"
        "    and callable(getattr(m, 'allocate_kv_cache', None))\n"
        "    and getattr(m.allocate_kv_cache, '__kvpool_patch__', None) is None)\n"
        "H.uninstall()\n"
        "r['after_uninstall'] = getattr(w.CPUWorker.determine_available_memory, '__kvpool_patch__', None)\n"
        "r['still_patched_after_uninstall'] = sorted(n for n, m in list(sys.modules.items())\n"
        "    if n.startswith('vllm.') and getattr(getattr(m, 'allocate_kv_cache', None), '__kvpool_patch__', None))\n"
        "print(json.dumps(r))\n")
    assert report == {"imported_at_install": False, "torch_untouched": True,
                      "row": "vllm.v1.worker.cpu_worker.CPUWorker.determine_available_memory",
                      "unpatched_allocate_kv_cache": [], "after_uninstall": None,
                      "still_patched_after_uninstall": []}, report


@check
def an_on_import_row_that_does_not_resolve_fails_vllms_import_by_name() -> None:
    report = _fresh(
        "import json\n"
        "from kvpool.adapters.vllm import _hooks as H\n"
        "gone = H.PatchPoint('vllm.v1.worker.cpu_worker', 'CPUWorker.renamed', lambda o: o, on_import=True)\n"
        "H.install(H.PATCHES + (gone,))\n"
        "try:\n"
        "    import vllm.v1.worker.cpu_worker\n"
        "    r = 'imported'\n"
        "except H.UnsupportedVLLM as e:\n"
        "    r = str(e)\n"
        "print(json.dumps(r))\n")
    assert "vllm.v1.worker.cpu_worker.CPUWorker.renamed" in report, report


_PACKAGE = {  # a stand-in for vLLM modules: "target" is an on_import row's module, "importer" imports it
    "fakevllm/__init__.py": "",
    "fakevllm/target.py": "class C:\n    def m(self):\n        return 'stock'\n",
    "fakevllm/importer.py": "from fakevllm import target\n\ndef f():\n    return 'stock'\n",
}


def _fresh_with_package(body: str) -> Any:
    import tempfile

    root = tempfile.mkdtemp(prefix="kvpool-hooks-")
    for rel, text in _PACKAGE.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    head = ("import json, sys\n"
            f"sys.path.insert(0, {root!r})\n"
            "from kvpool.adapters.vllm import _patching as P\n"
            "patched = lambda original: (lambda *a: 'patched')\n"
            "ROW = P.PatchPoint('fakevllm.target', 'C.m', patched, on_import=True)\n")
    return _fresh(head + body)


@check
def an_on_import_row_whose_module_another_row_imports_is_set() -> None:
    # Regression (review): install listed the on_import rows already imported
    # before it imported the other rows' modules, and the rest after: a row
    # whose module one of those imports pulled in was in neither list.
    r = _fresh_with_package(
        "P.install([P.PatchPoint('fakevllm.importer', 'f', patched), ROW])\n"
        "import fakevllm.target as t, fakevllm.importer as i\n"
        "out = [i.f(), t.C().m(), P.installed()]\n"
        "P.uninstall()\n"
        "print(json.dumps(out + [i.f(), t.C().m(), P.installed(), any(isinstance(f, P._OnImport) for f in sys.meta_path)]))\n")
    assert r == ["patched", "patched", True, "stock", "stock", False, False], r


@check
def a_failed_on_import_row_fails_every_import_until_uninstalled() -> None:
    # Regression (review): the rows were taken off the pending list before
    # they were set, so a second import of a module whose row did not resolve
    # ran stock vLLM while the plugin said it was installed.
    r = _fresh_with_package(
        "P.install([P.PatchPoint('fakevllm.target', 'C.renamed', patched, on_import=True)])\n"
        "out = []\n"
        "for _ in range(2):\n"
        "    try:\n"
        "        import fakevllm.target\n"
        "        out.append('imported')\n"
        "    except P.UnsupportedVLLM as e:\n"
        "        out.append('refused' if 'fakevllm.target.C.renamed' in str(e) else str(e))\n"
        "P.uninstall()\n"
        "import fakevllm.target as t\n"
        "print(json.dumps(out + [t.C().m()]))\n")
    assert r == ["refused", "refused", "stock"], r


@check
def the_import_hooks_loader_copies_and_reads_source_as_the_modules_own() -> None:
    r = _fresh_with_package(
        "import copy, inspect\n"
        "P.install([ROW])\n"
        "import fakevllm.target as t\n"
        "copy.copy(t.__loader__)\n"
        "print(json.dumps(['class C' in inspect.getsource(t), t.C().m()]))\n")
    assert r == [True, "patched"], r


@check
def an_explicit_kv_size_is_virtual_on_cpu_after_vllms_warm_up() -> None:
    from types import SimpleNamespace

    calls: list[str] = []
    row = next(p for p in H.PATCHES if p.attr == "CPUWorker.determine_available_memory")
    replacement = row.make(lambda self: calls.append("vllm's own rule") or 123)
    runner = SimpleNamespace(warming_up_model=lambda: calls.append("warm-up"))
    worker = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_memory_bytes=None), model_runner=runner,
                             _should_warm_up_model=lambda: True)
    assert replacement(worker) == 123 and calls == ["vllm's own rule"]  # a fraction of the node: vLLM decides
    calls.clear()
    worker.cache_config.kv_cache_memory_bytes = 1 << 50  # beyond any node: virtual
    assert replacement(worker) == 1 << 50 and calls == ["warm-up"]
    calls.clear()
    worker._should_warm_up_model = lambda: False
    assert replacement(worker) == 1 << 50 and calls == []


@check
def an_unresolvable_patch_point_refuses_by_name_and_patches_nothing() -> None:
    stock = targets()
    gone = H.PatchPoint("vllm.v1.core.sched.scheduler", "Scheduler.renamed_in_a_later_vllm", boom)
    try:
        H.install(H.PATCHES + (gone,))
    except H.UnsupportedVLLM as e:
        assert "vllm.v1.core.sched.scheduler.Scheduler.renamed_in_a_later_vllm" in str(e), e
        assert "nothing was patched" in str(e), e
    else:
        raise AssertionError("an attribute that does not exist must refuse the install")
    assert_stock(stock)


@check
def install_twice_wraps_once_and_uninstall_restores_every_original() -> None:
    stock = targets()
    H.install()
    first = targets()
    H.install()  # a retry (vLLM loads plugins in several places): a no-op
    assert targets() == first and all(first[n] is targets()[n] for n in first)
    assert_patched_once(stock)
    H.uninstall()
    assert_stock(stock)
    H.uninstall()  # nothing installed: a no-op
    H.install()  # and again, from stock: one level of wrapping
    try:
        assert_patched_once(stock)
    finally:
        H.uninstall()
    assert_stock(stock)


@check
def an_untested_vllm_release_is_refused_naming_the_range_unless_forced() -> None:
    stock = targets()
    real = vllm.__version__
    os.environ.pop(P.ALLOW_UNTESTED_ENV, None)
    try:
        for ok in ("0.32.0", "0.32.7", "0.32.0+cpu", "0.32.1.dev3", "0.33.0", "0.33.1rc1"):
            P.check_version(ok)
        for bad in ("0.34.0", "0.31.2", "1.0.0", "unknown"):
            vllm.__version__ = bad
            try:
                H.install()
            except H.UnsupportedVLLM as e:
                msg = str(e)
                assert ">=0.32,<0.34" in msg and f"vLLM {bad}" in msg and P.ALLOW_UNTESTED_ENV in msg, msg
            else:
                raise AssertionError(f"vLLM {bad} must be refused")
            assert_stock(stock)
        records: list[logging.LogRecord] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append(record)

        keep = Keep()
        P._vllm_log.addHandler(keep)
        os.environ[P.ALLOW_UNTESTED_ENV] = "1"
        try:
            H.install()  # forced: patched, with a warning naming the range
            assert_patched_once(stock)
        finally:
            P._vllm_log.removeHandler(keep)
            H.uninstall()
        assert any(r.levelno == logging.WARNING and ">=0.32,<0.34" in r.getMessage() for r in records), records
    finally:
        vllm.__version__ = real
        os.environ.pop(P.ALLOW_UNTESTED_ENV, None)
    assert_stock(stock)


def _calls(sig: inspect.Signature) -> list[tuple[list[str], dict[str, str]]]:
    """The ways a caller may call a function of this signature: every
    parameter by position, and every parameter that may be by keyword."""
    named = [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional = [p.name for p in named if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword_only = {p.name: p.name for p in named if p.kind == p.KEYWORD_ONLY}
    only_positional = [p.name for p in named if p.kind == p.POSITIONAL_ONLY]
    by_keyword = {p.name: p.name for p in named if p.kind != p.POSITIONAL_ONLY}
    return [(positional, keyword_only), (only_positional, by_keyword)]


def _signature_problems() -> list[str]:
    """Calls vLLM makes that a replacement would not take, and calls a
    replacement makes that vLLM's original would not take."""
    import vllm.v1.worker.cpu_worker  # noqa: F401  (its row is on_import; run in a fresh process)

    problems = []
    for point in H.PATCHES:
        r = P.resolve(point, sys.modules[point.module] if point.on_import else None)
        assert r is not None, point.name
        original = r[2]
        want, got = inspect.signature(original), inspect.signature(point.make(original))
        for args, kwargs in _calls(want):
            try:
                got.bind(*args, **kwargs)
            except TypeError as e:
                problems.append(f"{point.name}: vLLM's call ({args}, {kwargs}) does not fit the replacement {got}: {e}")
        if not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in got.parameters.values()):
            forwarded = [p.name for p in got.parameters.values()]
            try:
                want.bind(*forwarded)
            except TypeError as e:
                problems.append(f"{point.name}: the replacement calls vLLM's {want} with {forwarded}: {e}")
    # What the replacements call in vLLM, as they call it (_hooks._views).
    from vllm.v1.kv_cache_interface import create_kv_cache_views

    try:
        inspect.signature(create_kv_cache_views).bind("raw", "spec", "num_blocks", "kv_layout", "view",
                                                      kernel_block_size=None)
    except TypeError as e:
        problems.append(f"create_kv_cache_views{inspect.signature(create_kv_cache_views)}: {e}")
    return problems


def _in_a_fresh_process(function: str) -> Any:
    """This module's ``function()`` in a fresh process (vLLM's CPU worker patches torch as it loads)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return _fresh(f"import json, sys\nsys.path.insert(0, {here!r})\nimport hooks_checks\n"
                  f"print(json.dumps(hooks_checks.{function}()))\n")


@check
def every_replacement_takes_every_call_vllm_makes_to_the_original_and_forwards_it() -> None:
    # Issue 33: the table must fit the release it patches, not only resolve
    # in it. vLLM may call an original with any parameter by position or by
    # keyword (0.32 and 0.33 build BlockPool by keyword); the replacement
    # must accept each such call, and a replacement that names its
    # parameters calls the original with them, which the original must take.
    problems = _in_a_fresh_process("_signature_problems")
    assert problems == [], "\n".join(problems)


# What the replacements (and the block pool) read on vLLM's objects: a
# release that renames one fails here by name, not in an engine.
READS = {
    "vllm.v1.core.sched.scheduler.Scheduler": ("waiting", "kv_holding_waiting", "defer_block_free",
                                               "kv_cache_manager", "vllm_config", "schedule", "running",
                                               "_preempt_request", "_request_blocks_can_be_freed",
                                               "requires_kv_delivery"),
    "vllm.v1.core.kv_cache_manager.KVCacheManager": ("block_pool", "allocate_slots", "get_block_ids"),
    "vllm.v1.request.Request": ("request_id", "status", "max_tokens", "num_output_tokens", "num_computed_tokens",
                                "num_preemptions"),
    "vllm.v1.engine.core.EngineCore": ("model_executor", "scheduler"),
    "vllm.v1.engine.core.EngineCoreProc": ("input_queue",),
    "vllm.v1.executor.abstract.Executor": ("vllm_config",),
    "vllm.v1.worker.cpu_worker.CPUWorker": ("cache_config", "model_runner", "_should_warm_up_model"),
    "vllm.v1.worker.cpu_model_runner.CPUModelRunner": ("warming_up_model",),
    "vllm.config.VllmConfig": ("max_concurrent_batches", "parallel_config", "device_config", "model_config",
                               "cache_config"),
    "vllm.v1.core.block_pool.BlockPool": ("blocks", "free_block_queue", "null_block", "enable_caching",
                                          "num_gpu_blocks", "_reuse_watchers", "get_new_blocks", "free_blocks",
                                          "touch", "get_num_free_blocks", "get_usage", "reset_prefix_cache",
                                          "get_cached_block", "_insert_block_hash"),
    "vllm.v1.core.kv_cache_utils.KVCacheBlock": ("block_id", "ref_cnt", "block_hash", "is_null",
                                                 "prev_free_block", "next_free_block"),
    "vllm.v1.kv_cache_interface.KVCacheConfig": ("num_blocks", "kv_cache_tensors", "kv_cache_groups"),
    "vllm.v1.kv_cache_interface.KVCacheTensor": ("size", "layers", "layer_stride", "block_stride", "offset"),
}


def _missing_reads() -> list[str]:
    """The READS no class (or base) of this vLLM defines or assigns."""
    missing = []
    for path, attrs in READS.items():
        module, name = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        source = "".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith("vllm"))
        fields = set(getattr(cls, "__dataclass_fields__", {})) | set(getattr(cls, "__slots__", ()))
        for attr in attrs:
            assigned = re.search(rf"self\.{attr}\s*(:[^=\n]*)?=[^=]", source)
            if not (hasattr(cls, attr) or attr in fields or assigned):
                missing.append(f"{path}.{attr}")
    return missing


@check
def every_attribute_the_plugin_reads_on_vllms_objects_is_there() -> None:
    missing = _in_a_fresh_process("_missing_reads")
    assert missing == [], f"not set by this vLLM: {missing}"


@check
def the_block_pool_is_found_through_the_configs_handle_not_by_size() -> None:
    from types import SimpleNamespace

    stock = targets()
    H.install()
    try:
        import vllm.v1.core.kv_cache_coordinator as coordinator

        cfg = SimpleNamespace()  # a KVCacheConfig without the plugin's handle
        H._building.config = cfg
        try:
            coordinator.BlockPool(16, False, 16)
        except RuntimeError as e:
            assert "carries no kvpool space" in str(e), e
        else:
            raise AssertionError("a config without a handle must not get some other space's pool")
        finally:
            H._building.config = None
    finally:
        H.uninstall()
    assert_stock(stock)


# ------------------------------------------------------- the space's layout
# (kvpool.adapters.vllm.layout) over KV cache configs as vLLM 0.32 builds them.

def _attention(window: int | None = None) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if window is None:
        return FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    return SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                             sliding_window=window)


def _config(num_blocks: int, tensors: list[Any], groups: list[tuple[list[str], Any]]) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups])


@check
def hybrid_groups_of_two_layers_overlay_one_region_per_layer_slot() -> None:
    # Gemma-2 style (alternating window / full), layer-outermost: each group's
    # tensor holds its two layers in slots 0 and 1 of the same allocation.
    from vllm.v1.kv_cache_interface import KVCacheTensor

    from kvpool.adapters.vllm.layout import space_layout, view_tensor

    n, page = 64, 8192
    tensors = [KVCacheTensor(size=2 * n * page, layers=names, layer_stride=n * page, block_stride=page)
               for names in (["l0", "l2"], ["l1", "l3"])]
    cfg = _config(n, tensors, [(["l0", "l2"], _attention(64)), (["l1", "l3"], _attention())])
    layout = space_layout(cfg, page_bytes=64 << 10)
    g = layout.geometry
    assert (g.num_layers, g.block_bytes, g.num_blocks) == (2, page, n), g
    assert layout.layer_outermost and layout.num_groups == 2
    assert [(p.group, p.first_region) for p in layout.placements] == [(0, 0), (1, 0)]
    placed = view_tensor(layout, layout.placements[1], g.num_regions * g.region_bytes)
    assert placed.layer_stride == g.region_bytes and placed.offset == 0 and placed.layers == ["l1", "l3"]


@check
def tensors_at_later_layer_slots_start_at_their_region() -> None:
    # One group with two specs (vLLM places the second spec's layers after
    # the first's): its second tensor starts at slot 2, region 2 of the space.
    from vllm.v1.kv_cache_interface import KVCacheTensor

    from kvpool.adapters.vllm.layout import space_layout, view_tensor

    n, page = 48, 8192
    tensors = [KVCacheTensor(size=3 * n * page, layers=["a", "b"], layer_stride=n * page, block_stride=page),
               KVCacheTensor(size=3 * n * page, layers=["c"], layer_stride=3 * n * page, block_stride=page,
                             offset=2 * n * page)]
    cfg = _config(n, tensors, [(["a", "b"], _attention()), (["c"], _attention(32))])
    layout = space_layout(cfg, page_bytes=64 << 10)
    assert layout.geometry.num_layers == 3
    assert [p.first_region for p in layout.placements] == [0, 2]
    g = layout.geometry
    assert view_tensor(layout, layout.placements[1], g.num_regions * g.region_bytes).offset == 2 * g.region_bytes


@check
def a_block_outermost_hybrid_is_one_region_of_whole_blocks() -> None:
    from vllm.v1.kv_cache_interface import KVCacheTensor

    from kvpool.adapters.vllm.layout import space_layout

    n, page = 32, 8192
    per_block = 2 * page  # two layer slots per block
    tensors = [KVCacheTensor(size=n * per_block, layers=names, layer_stride=page, block_stride=per_block)
               for names in (["l0", "l2"], ["l1", "l3"])]
    cfg = _config(n, tensors, [(["l0", "l2"], _attention(64)), (["l1", "l3"], _attention())])
    layout = space_layout(cfg, page_bytes=64 << 10)
    g = layout.geometry
    assert not layout.layer_outermost and (g.num_layers, g.block_bytes) == (1, per_block), g


@check
def a_mamba_layer_is_refused_naming_its_spec() -> None:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheTensor, MambaSpec

    from kvpool.adapters.vllm.layout import space_layout

    mamba = MambaSpec(block_size=32, shapes=((4, 64),), dtypes=(torch.bfloat16,))
    n = 16
    tensors = [KVCacheTensor(size=n * 8192, layers=["attn"], layer_stride=n * 8192, block_stride=8192),
               KVCacheTensor(size=n * 8192, layers=["ssm"], layer_stride=n * 8192, block_stride=8192)]
    cfg = _config(n, tensors, [(["attn"], _attention()), (["ssm"], mamba)])
    try:
        space_layout(cfg, page_bytes=64 << 10)
    except NotImplementedError as e:
        assert "MambaSpec layers (ssm)" in str(e) and "unset KVPOOL_VLLM" in str(e), e
    else:
        raise AssertionError("a Mamba layer must be refused")


@check
def every_ranks_regions_follow_the_previous_ranks_in_one_space() -> None:
    # Pipeline-parallel stages of a 5-layer model (3 + 2 layers, per-rank
    # configs of the same block count): one space of 5 regions, stage 1 from
    # region 3. Tensor-parallel shards are the equal-stage case.
    from vllm.v1.kv_cache_interface import KVCacheTensor

    from kvpool.adapters.vllm.layout import engine_layout

    n, page = 64, 4096

    def stage(names: list[str]) -> Any:
        tensor = KVCacheTensor(size=len(names) * n * page, layers=names, layer_stride=n * page, block_stride=page)
        return _config(n, [tensor], [(names, _attention())])

    engine = engine_layout([stage(["l0", "l1", "l2"]), stage(["l3", "l4"])], page_bytes=64 << 10)
    g = engine.geometry
    assert (g.num_layers, g.block_bytes, g.num_blocks) == (5, page, n), g
    assert engine.first_regions == (0, 3) and [r.geometry.num_regions for r in engine.ranks] == [3, 2]
    assert all(r.geometry.region_bytes == g.region_bytes for r in engine.ranks)
    assert g.page_commit_bytes == 5 * (64 << 10)  # a page commits on every rank at once


@check
def ranks_that_page_differently_are_refused() -> None:
    from vllm.v1.kv_cache_interface import KVCacheTensor

    from kvpool.adapters.vllm.layout import engine_layout

    n = 64

    def rank(page: int) -> Any:
        return _config(n, [KVCacheTensor(size=n * page, layers=["l0"], layer_stride=n * page, block_stride=page)],
                       [(["l0"], _attention())])

    try:
        engine_layout([rank(4096), rank(8192)], page_bytes=64 << 10)
    except NotImplementedError as e:
        assert "ranks that page differently" in str(e) and "rank 1" in str(e), e
    else:
        raise AssertionError("ranks of different block bytes must be refused")


def check_release() -> None:
    """The vLLM imported is the release the test asked for (tests/_vllm_engines.Release)."""
    expected = os.environ.get("KVPOOL_EXPECT_VLLM")
    if expected and not vllm.__version__.startswith(expected):
        sys.exit(f"expected vLLM {expected}, imported {vllm.__version__} from {vllm.__file__}")


def main() -> None:
    check_release()
    # Imported up front, as a worker process has them: the table's
    # "if imported" points are then patched and checked too.
    import vllm.v1.worker.gpu.attn_utils  # noqa: F401
    import vllm.v1.worker.gpu_model_runner  # noqa: F401

    results: dict[str, str] = {}
    for name, fn in CHECKS.items():
        try:
            fn()
            results[name] = "ok"
        except BaseException:
            results[name] = traceback.format_exc()
        finally:
            H.uninstall()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
