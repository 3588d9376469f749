#!/usr/bin/env python3
"""kvpool's vLLM plugin against vLLM itself: the block pool hot path and tiny-model generation, one run.

Everything runs in the vLLM interpreter (``$KVPOOL_VLLM_PYTHON``, else
``.venv-vllm/bin/python`` in the repository root, else the cached venv that
``scripts/vllm_venv.sh`` makes), in child processes, and every ratio compares
figures measured in this run. That venv holds a *snapshot* of kvpool
(installed, not editable): the report says whether its ``adapters/vllm``
files still match this checkout (rerun ``scripts/vllm_venv.sh`` if not).

Figures
-------
1. **Block pool hot path** (``blockpool``), one subprocess running a timing
   snippet (the calibrated loops of ``_benchlib``) in the vLLM interpreter.
   Contenders, all with ``num_gpu_blocks`` = 4096 (block 0 is vLLM's null
   block, 4095 usable), built as vLLM's KV cache coordinator builds them:

   - ``vllm``: ``vllm.v1.core.block_pool.BlockPool``;
   - ``kvpool``: ``KVPoolBlockPool`` over a private ``KVSpace`` (no pool
     ledger), ``null_block=True``, ``reserve=(0, big)``,
     ``reserve_thread=False``;
   - ``kvpool_tenant``: the same, but the space is a tenant of a pool ledger
     (a private ``kvpool.Pool`` created for the run and removed after it), as
     the plugin runs in an engine: ``available()`` then also reads the pool's
     budget;
   - ``kvspace``: the bare ``KVSpace.free(KVSpace.alloc(n))`` of the
     ``kvpool`` contender's space: the native part of its round trip.

   The geometry is the one the plugin builds for the tiny model of figure 2
   (2 layers of 8 KiB blocks, 64 KiB pages: 8 blocks a page). Every block is
   allocated once through the block pool and freed before timing, so every
   page stays committed: no syscall is on the timed path, and the snippet
   fails if the page commit/release counters (or the free-block count) move
   while it times. Round trip = ``free_blocks(get_new_blocks(n))`` for n = 1,
   16, 256, with prefix caching off and on (``enable_caching``; these blocks
   carry no hash, so "on" exercises the eviction check on every block).
   Also ``get_num_free_blocks()`` alone (the scheduler calls it every step).
   Reported in us per call; ratios kvpool / vLLM. ``--profile`` adds, per n,
   the functions that dominate the ``vllm`` and ``kvpool`` round trips
   (cProfile, caching off; its own overhead inflates every figure: read the
   shares).

2. **Generation** (``generation``): ``tests/vllm_support/run_engine.py`` runs
   an in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on the
   tiny random Llama of ``tests/vllm_support/tiny_llama.py`` (built into a
   temporary folder), with and without the plugin (``KVPOOL_VLLM=1``, a pool
   created for the run, ``KVPOOL_VLLM_PAGE_BYTES`` = 64 KiB by default: with
   the plugin's 2 MiB default this workload (~110 blocks, 256 to a page)
   fits in one page per layer, so pages would hardly ever be committed or
   released while it runs; ``--page-bytes`` changes it). Same prompts (16, of
   5 to 200 tokens), greedy, ``ignore_eos``, 128 new tokens, batch limit 16,
   prefix caching off, 64 MiB of KV cache (4096 blocks of 32 tokens). Each
   engine process runs a short warm-up batch, then the same batch several
   times (one "phase" each); the configurations alternate process by process
   (A B, B A, A B: the machine is shared and drifts). Reported: generated
   tokens/s per phase (tokens / wall time of ``LLM.generate``), the median
   over every phase of a configuration, and the ratio plugin / vLLM. The
   greedy tokens of every phase of every process must be identical across
   both configurations; the JSON records it (``tokens_identical``) and the
   script exits 1 (after writing it) if not. The plugin's "vllm space
   created" event must appear in plugin runs and only there.

   vLLM's CPU worker keeps a busy thread on every core, so another process
   taking even a fraction of a core slows an engine run many times over.
   The bench measures what other processes took during each run (system CPU
   time from ``/proc/stat`` less its own and its children's) and does a run
   again (at most twice) when that exceeded 0.1 core; runs kept disturbed
   are marked, and the report warns.

When no vLLM interpreter is found, the JSON records ``{"available": false,
"why": ...}`` for both figures and the script exits 0.

Usage::

    python scripts/bench_engines.py [--quick] [--json PATH | --out PATH] [--page-bytes N] [--profile]

``--quick`` shortens the timing loops and runs one engine process per
configuration with one measured phase of 8 prompts x 32 tokens: a smoke test
whose numbers are noisy. Importing vLLM alone takes seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _benchlib import (  # scripts/, on sys.path when a script runs
    BIG_RESERVE,
    ROOT,
    VLLM_ENV,
    KiB,
    MiB,
    find_vllm_python,
    fmt,
    machine_info,
    ratio,
    run_marked_json,
    utc_now,
    version,
    with_timing,
    write_json,
)

from kvpool import Pool

SUPPORT = ROOT / "tests" / "vllm_support"
ADAPTER_DIR = ROOT / "adapters" / "vllm"
MARK = "KVPOOL-BENCH-ENGINES-JSON "

SIZES = (1, 16, 256)
# What the plugin builds for the tiny model (2 layers, 2 KV heads x 32 dims,
# bf16, K and V, 32-token blocks = 8 KiB a layer) at 64 MiB of KV cache.
NUM_GPU_BLOCKS = 4096
BLOCK_BYTES = 8 * KiB
NUM_LAYERS = 2
HASH_BLOCK_SIZE = 32
KV_CACHE_BYTES = 64 * MiB
ENGINE_BLOCK_SIZE = 32
POOL_CAPACITY = 256 * MiB  # well above the 64 MiB a space can commit: no shortage on any path
PROMPT_LENGTHS = (5, 17, 40, 90, 150, 33, 64, 120, 8, 200, 12, 77, 26, 110, 55, 180)
MAX_NUM_SEQS = 16  # the whole batch at once, in every run (bf16 kernels are not batch-invariant)
OTHER_LOAD_WARN = 0.25  # cores
# vLLM's CPU worker keeps a busy thread on every core, so an engine run during
# which other processes took more than this (in cores, averaged) is done again.
OTHER_LOAD_RETRY = 0.1


@dataclass(frozen=True)
class Settings:
    """Loop and run sizes of one run."""

    repeats: int  # timed repeats per block-pool figure
    target_s: float  # wall time of one timed repeat
    processes: int  # engine processes per configuration (alternating)
    phases: int  # measured generate() calls per engine process
    retries: int  # times an engine run disturbed by other processes is done again
    prompts: int  # prompts per batch (the first of PROMPT_LENGTHS)
    max_tokens: int  # new tokens per prompt
    blockpool_timeout_s: float
    engine_timeout_s: float


FULL = Settings(repeats=5, target_s=0.1, processes=3, phases=4, retries=2, prompts=16, max_tokens=128,
                blockpool_timeout_s=600, engine_timeout_s=400)
QUICK = Settings(repeats=3, target_s=0.02, processes=1, phases=1, retries=0, prompts=8, max_tokens=32,
                 blockpool_timeout_s=180, engine_timeout_s=300)


# ------------------------------------------------------------ the interpreter


def _child_env(**more: str) -> dict[str, str]:
    """The environment of a vLLM child: no plugin unless asked, kvpool events as JSON lines on stderr."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("KVPOOL_VLLM") and k != VLLM_ENV) and k not in ("KVPOOL_POOL", "PYTHONPATH")}
    env.update(VLLM_LOGGING_LEVEL="WARNING", KVPOOL_LOG_LEVEL="info", KVPOOL_LOG_FORMAT="json")
    env.update(more)
    return env


class OtherLoad:
    """CPU time the rest of the machine used while a figure ran, in cores (Linux; None elsewhere).

    System-wide busy time from ``/proc/stat`` less this process's and its
    children's (``getrusage``): what other processes took from the bench.
    """

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        mine = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                   for f in ("ru_utime", "ru_stime"))
        return time.monotonic(), busy, mine

    def cores(self) -> float | None:
        end = self._sample()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        return max(0.0, ((end[1] - self.start[1]) - (end[2] - self.start[2])) / (end[0] - self.start[0]))


def _checkout_adapter_hashes() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ADAPTER_DIR.glob("*.py"))}


# ------------------------------------------------------- figure 1: block pool

# Runs in the vLLM interpreter (cwd: a temporary folder, so that the checkout's
# uninstalled ``kvpool/`` cannot shadow the installed one): argv[1] is a JSON
# config; the last stdout line starting with the marker carries the results.
BLOCKPOOL_SNIPPET = r'''
import cProfile, hashlib, json, os, pathlib, pstats, sys, time

cfg = json.loads(sys.argv[1])
t_import = time.perf_counter()
import vllm
from vllm.v1.core.block_pool import BlockPool
import kvpool
import kvpool.adapters.vllm as kv_vllm
from kvpool import Geometry, KVSpace, Pool
from kvpool.adapters.vllm.block_pool import KVPoolBlockPool
import_s = time.perf_counter() - t_import

# @timing@ (no_gc, loop_ns, calibrate, repeat_ns, roundtrip_loop: spliced in by _benchlib.with_timing())

N, HASH = cfg["num_gpu_blocks"], cfg["hash_block_size"]
REPEATS, TARGET = cfg["repeats"], cfg["target_s"]


def make(kind, caching, ledger):
    """(block pool, its space or None) as vLLM's KV cache coordinator would build it."""
    if kind == "vllm":
        return BlockPool(N, caching, HASH), None
    g = Geometry(cfg["num_layers"], 1, cfg["block_bytes"], N, page_bytes=cfg["page_bytes"])
    space = KVSpace(g, null_block=True, reserve=(0, cfg["big_reserve"]), reserve_thread=False,
                    pool=ledger if kind == "kvpool_tenant" else None,
                    name="bench-engines" if kind == "kvpool_tenant" else None)
    pool = KVPoolBlockPool(N, caching, HASH, space=space)
    # Every block once through the pool: every page committed, and kept so.
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))
    s = space.stats()
    if s.pages_free or s.pages_releasing or s.committed_bytes != s.num_pages * s.page_commit_bytes:
        raise RuntimeError(f"{kind}: not every page stayed committed after the warm-up: {s}")
    return pool, space


def counters(space):
    if space is None:
        return None
    s = space.stats()
    return s.commits, s.releases


def timed(pool, space, body, what):
    free0, c0 = pool.get_num_free_blocks(), counters(space)
    res = repeat_ns(body, REPEATS, TARGET)
    free1, c1 = pool.get_num_free_blocks(), counters(space)
    if free1 != free0:
        raise RuntimeError(f"{what}: free blocks moved while timing: {free0} -> {free1}")
    if c1 != c0:
        raise RuntimeError(f"{what}: pages were committed/released while timing: {c0} -> {c1}")
    return res


def roundtrip(pool, n):
    return roundtrip_loop(pool.get_new_blocks, pool.free_blocks, n)


def num_free(pool):
    def body(iters):
        f = pool.get_num_free_blocks
        for _ in range(iters):
            f()
    return body


def profile(body, iters, top):
    pr = cProfile.Profile()
    pr.enable()
    body(iters)
    pr.disable()
    st = pstats.Stats(pr).stats
    total = sum(v[2] for v in st.values()) or 1e-12
    rows = sorted(st.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return {"iters": iters, "total_s": total, "top_by_tottime": [
        {"function": f"{os.path.basename(f)}:{line}({name})", "ncalls_per_roundtrip": nc / iters,
         "tottime_us_per_roundtrip": tt / iters * 1e6, "cumtime_us_per_roundtrip": ct / iters * 1e6,
         "share": tt / total}
        for (f, line, name), (cc, nc, tt, ct, _) in rows]}


adapter_dir = pathlib.Path(kv_vllm.__file__).parent
out = {"available": True, "python": sys.version.split()[0], "executable": sys.executable,
       "vllm": getattr(vllm, "__version__", None), "kvpool": kvpool.__version__, "kvpool_file": kvpool.__file__,
       "import_s": import_s, "adapter_hashes": {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                                for p in sorted(adapter_dir.glob("*.py"))},
       "roundtrip": {}, "num_free": {}, "kvspace": {}, "profile": {}}
ledger = Pool(cfg["pool_name"], capacity=cfg["pool_capacity"])
try:
    for caching in (False, True):
        key = "caching_on" if caching else "caching_off"
        out["roundtrip"][key] = {}
        for kind in cfg["kinds"]:
            pool, space = make(kind, caching, ledger)
            out["roundtrip"][key][kind] = {
                str(n): timed(pool, space, roundtrip(pool, n), f"{kind} {key} n={n}") for n in cfg["sizes"]}
            if not caching:
                out["num_free"][kind] = timed(pool, space, num_free(pool), f"{kind} get_num_free_blocks")
                if kind == "kvpool":
                    out["kvspace"] = {
                        str(n): timed(pool, space, roundtrip_loop(space.alloc, space.free, n), f"kvspace n={n}")
                        for n in cfg["sizes"]}
                if cfg["profile"] and kind in ("vllm", "kvpool"):
                    out["profile"][kind] = {str(n): profile(roundtrip(pool, n), max(200, 20000 // n),
                                                            cfg["profile_top"]) for n in cfg["sizes"]}
            if space is not None:
                space.close()
            del pool, space
finally:
    Pool.remove(cfg["pool_name"])

print("\n" + cfg["mark"] + json.dumps(out), flush=True)
'''
BLOCKPOOL_SNIPPET = with_timing(BLOCKPOOL_SNIPPET)
KINDS = ("vllm", "kvpool", "kvpool_tenant")


def bench_blockpool(settings: Settings, py: str, origin: str, cwd: str, page_bytes: int,
                    profile: bool) -> dict[str, Any]:
    pool_name = f"bench-engines-bp-{uuid.uuid4().hex[:8]}"
    cfg: dict[str, Any] = {
        "mark": MARK, "repeats": settings.repeats, "target_s": settings.target_s, "sizes": list(SIZES),
        "kinds": list(KINDS), "num_gpu_blocks": NUM_GPU_BLOCKS, "hash_block_size": HASH_BLOCK_SIZE,
        "num_layers": NUM_LAYERS, "block_bytes": BLOCK_BYTES, "page_bytes": page_bytes,
        "big_reserve": BIG_RESERVE, "pool_name": pool_name,
        "pool_capacity": POOL_CAPACITY, "profile": profile, "profile_top": 12,
    }
    res = run_marked_json(py, origin, ["-c", BLOCKPOOL_SNIPPET, json.dumps(cfg)], MARK, cwd=cwd,
                          env=_child_env(VLLM_LOGGING_LEVEL="ERROR"), timeout_s=settings.blockpool_timeout_s)
    if not res["available"]:
        Pool.remove(pool_name)  # the snippet removes it unless it died first
        return res
    res.update(num_gpu_blocks=NUM_GPU_BLOCKS, sizes=list(SIZES),
               geometry={"num_layers": NUM_LAYERS, "block_bytes": BLOCK_BYTES, "page_bytes": page_bytes,
                         "blocks_per_page": page_bytes // BLOCK_BYTES},
               page_syscalls_during_timing=0)
    _blockpool_summary(res)
    return res


def _blockpool_summary(res: dict[str, Any]) -> None:
    """us per call and kvpool / vLLM ratios, next to the raw figures."""
    us: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    for key, kinds in res["roundtrip"].items():
        us[key] = {kind: {n: r["median_ns"] / 1e3 for n, r in cases.items()} for kind, cases in kinds.items()}
        ratios[key] = {f"{kind}/vllm": {n: ratio(us[key][kind][n], us[key]["vllm"][n]) for n in us[key][kind]}
                       for kind in kinds if kind != "vllm"}
    us["kvspace"] = {n: r["median_ns"] / 1e3 for n, r in res["kvspace"].items()}
    # What the Python layer adds on top of the native alloc + free, per round trip.
    us["kvpool_minus_kvspace"] = {n: us["caching_off"]["kvpool"][n] - us["kvspace"][n] for n in us["kvspace"]}
    us["kvpool_minus_vllm"] = {n: us["caching_off"]["kvpool"][n] - us["caching_off"]["vllm"][n]
                               for n in us["kvspace"]}
    us["num_free"] = {kind: r["median_ns"] / 1e3 for kind, r in res["num_free"].items()}
    ratios["num_free"] = {f"{kind}/vllm": ratio(us["num_free"][kind], us["num_free"]["vllm"])
                          for kind in us["num_free"] if kind != "vllm"}
    res["us"] = us
    res["ratios"] = ratios


# ------------------------------------------------------- figure 2: generation


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 512) for _ in range(k)] for k in PROMPT_LENGTHS[:n]]


def _events(stderr: str) -> list[dict[str, Any]]:
    out = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _run_engine(py: str, tmp: Path, cfg: dict[str, Any], plugin: bool, pool_name: str, tag: str,
                page_bytes: int, timeout_s: float) -> dict[str, Any]:
    cfg_path = tmp / f"engine-{tag}.json"
    out_path = tmp / f"engine-{tag}.out.json"
    cfg_path.write_text(json.dumps(cfg))
    env = _child_env(KVPOOL_VLLM="1", KVPOOL_POOL=pool_name, KVPOOL_VLLM_PAGE_BYTES=str(page_bytes),
                     KVPOOL_VLLM_TENANT=f"bench-{tag}") if plugin else _child_env()
    t0 = time.perf_counter()
    proc = subprocess.run([py, str(SUPPORT / "run_engine.py"), str(cfg_path), str(out_path)], check=False,
                          capture_output=True, text=True, cwd=tmp, env=env, timeout=timeout_s)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"engine {tag} (plugin={plugin}) exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(out_path.read_text())
    created = [e for e in _events(proc.stderr) if e.get("event") == "vllm space created"]
    if bool(created) != plugin:
        raise RuntimeError(f"engine {tag}: plugin={plugin} but {len(created)} 'vllm space created' events")
    res["process_s"] = wall_s
    res["space"] = created[0] if created else None
    return res


def bench_generation(settings: Settings, py: str, tmp: Path, page_bytes: int) -> dict[str, Any]:
    model = tmp / "tiny-llama"
    t0 = time.perf_counter()
    subprocess.run([py, str(SUPPORT / "tiny_llama.py"), str(model)], check=True, cwd=tmp, capture_output=True,
                   env=_child_env(), timeout=300)
    build_s = time.perf_counter() - t0
    prompts = _prompts(settings.prompts)
    warmup = {"prompts": prompts[:2], "max_tokens": 8}
    measured = {"prompts": prompts, "max_tokens": settings.max_tokens}
    cfg = {"model": str(model), "in_process": True, "prefix_caching": False, "block_size": ENGINE_BLOCK_SIZE,
           "kv_cache_memory_bytes": KV_CACHE_BYTES, "max_num_seqs": MAX_NUM_SEQS,
           "phases": [warmup] + [measured] * settings.phases}
    pool_name = f"bench-engines-{uuid.uuid4().hex[:8]}"
    Pool(pool_name, capacity=POOL_CAPACITY)
    runs: dict[str, list[dict[str, Any]]] = {"vllm": [], "kvpool": []}
    disturbed: list[dict[str, Any]] = []  # runs done again because other processes took CPU meanwhile
    order: list[str] = []
    try:
        for rep in range(settings.processes):
            # A B, B A, A B, ...: a drift of the shared machine hits both alike.
            for name in (("vllm", "kvpool") if rep % 2 == 0 else ("kvpool", "vllm")):
                for attempt in range(1 + settings.retries):
                    load = OtherLoad()
                    res = _run_engine(py, tmp, cfg, name == "kvpool", pool_name, f"{name}-{rep}-{attempt}",
                                      page_bytes, settings.engine_timeout_s)
                    phases = res["phases"][1:]  # the warm-up is not measured
                    run = {
                        "init_s": res["init_s"], "process_s": res["process_s"],
                        "num_gpu_blocks": res["num_gpu_blocks"], "other_load_cores": load.cores(),
                        "space": res["space"],
                        "gen_s": [p["gen_s"] for p in phases],
                        "tokens_per_s": [sum(map(len, p["tokens"])) / p["gen_s"] for p in phases],
                        "generated_tokens": [sum(map(len, p["tokens"])) for p in phases],
                        "tokens": [p["tokens"] for p in phases],
                    }
                    quiet = run["other_load_cores"] is None or run["other_load_cores"] <= OTHER_LOAD_RETRY
                    if quiet or attempt == settings.retries:
                        run["disturbed"] = not quiet
                        break
                    disturbed.append({"config": name, **{k: v for k, v in run.items() if k != "tokens"}})
                order.append(name)
                runs[name].append(run)
    finally:
        Pool.remove(pool_name)

    reference = runs["vllm"][0]["tokens"][0]
    mismatched = {name: sum(1 for r in rs for t in r["tokens"] if t != reference) for name, rs in runs.items()}
    out: dict[str, Any] = {
        "available": True, "model_build_s": build_s, "engine": {k: v for k, v in cfg.items() if k != "phases"},
        "prompt_lengths": [len(p) for p in prompts], "max_tokens": settings.max_tokens,
        "measured_phases_per_process": settings.phases, "processes_per_config": settings.processes,
        "order": order, "rerun_disturbed": disturbed, "plugin_page_bytes": page_bytes, "pool_capacity": POOL_CAPACITY,
        "tokens_identical": not any(mismatched.values()),
        "phases_differing_from_reference": mismatched,
        "reference_tokens": reference,
        "configs": {},
    }
    for name, rs in runs.items():
        tps = [x for r in rs for x in r["tokens_per_s"]]
        for r in rs:
            del r["tokens"]
        out["configs"][name] = {"median_tokens_per_s": statistics.median(tps), "min_tokens_per_s": min(tps),
                                "max_tokens_per_s": max(tps), "phases": len(tps),
                                "median_init_s": statistics.median(r["init_s"] for r in rs), "processes": rs}
    c = out["configs"]
    out["ratio_tokens_per_s"] = ratio(c["kvpool"]["median_tokens_per_s"], c["vllm"]["median_tokens_per_s"])
    out["ratio_init_s"] = ratio(c["kvpool"]["median_init_s"], c["vllm"]["median_init_s"])
    return out


# ---------------------------------------------------------------- report


LABELS = {
    "vllm": "vLLM BlockPool",
    "kvpool": "KVPoolBlockPool (private space)",
    "kvpool_tenant": "KVPoolBlockPool (pool tenant)",
}


def format_report(res: dict[str, Any]) -> str:
    m, bp, gen = res["machine"], res["blockpool"], res["generation"]
    lines = [(f"kvpool engines bench ({'quick' if res['quick'] else 'full'}) - {m['platform']}, "
              f"{m['nproc_usable']}/{m['nproc']} cpus")]
    if not bp.get("available"):
        lines.append(f"vLLM: skipped ({bp['why']})")
        lines += ["", f"total {res['elapsed_s']:.1f} s"]
        return "\n".join(lines)
    lines.append(f"vLLM {bp['vllm']} (Python {bp['python']}, {bp['origin']}), installed kvpool {bp['kvpool']}: "
                 + ("adapters/vllm matches this checkout" if res["installed_adapter_matches_checkout"]
                    else "adapters/vllm DIFFERS from this checkout (rerun scripts/vllm_venv.sh)"))
    g = bp["geometry"]
    sizes = [str(n) for n in bp["sizes"]]
    head = "".join(f"{'n = ' + n:>10}" for n in sizes)
    lines += [
        "",
        (f"1. free_blocks(get_new_blocks(n)), {bp['num_gpu_blocks']} blocks ({g['num_layers']} layers x "
         f"{g['block_bytes'] // KiB} KiB, {g['page_bytes'] // KiB} KiB pages), nothing else held; "
         "kvpool pages kept committed (no syscalls)"),
    ]
    us, ratios = bp["us"], bp["ratios"]
    for key, title in (("caching_off", "prefix caching off"), ("caching_on", "prefix caching on")):
        lines.append(f"   {'us per round trip, ' + title:<40}{head}")
        for kind, row in us[key].items():
            lines.append(f"     {LABELS[kind]:<38}" + "".join(f"{fmt(row[n], '.2f'):>10}" for n in sizes))
        if key == "caching_off":
            lines.append(f"     {'KVSpace alloc + free alone':<38}"
                         + "".join(f"{fmt(us['kvspace'][n], '.2f'):>10}" for n in sizes))
        for name, row in ratios[key].items():
            kind = name.split("/")[0]
            label = "ratio " + ("kvpool" if kind == "kvpool" else "kvpool tenant") + " / vLLM"
            lines.append(f"     {label:<38}" + "".join(f"{fmt(row[n], '.2f'):>10}" for n in sizes))
    lines.append(f"   {'get_num_free_blocks(), us per call':<40}"
                 + "".join(f"{k:>16}" for k in us["num_free"]))
    lines.append(f"   {'':<40}" + "".join(f"{fmt(v, '.3f'):>16}" for v in us["num_free"].values()))
    lines.append(f"   {'ratio / vLLM':<40}{'':>16}"
                 + "".join(f"{fmt(v, '.2f'):>16}" for v in ratios["num_free"].values()))
    for kind, profs in bp.get("profile", {}).items():
        for n, prof in profs.items():
            lines.append(f"   profile, {LABELS[kind]} round trip n={n}, caching off (cProfile, {prof['iters']} "
                         f"round trips, {prof['total_s'] / prof['iters'] * 1e6:.2f} us each under the profiler)")
            lines.append(f"     {'own %':>6}{'own us':>8}{'calls':>8}  function (top by own time)")
            for row in prof["top_by_tottime"][:8]:
                lines.append(f"     {row['share'] * 100:6.1f}{row['tottime_us_per_roundtrip']:8.2f}"
                             f"{row['ncalls_per_roundtrip']:8.1f}  {row['function']}")

    lines.append("")
    if not gen.get("available"):
        lines.append(f"2. generation: skipped ({gen['why']})")
    else:
        e, c = gen["engine"], gen["configs"]
        lines += [
            (f"2. generation, tiny Llama, in-process engine: {len(gen['prompt_lengths'])} prompts x "
             f"{gen['max_tokens']} new tokens (greedy, ignore_eos), batch <= {e['max_num_seqs']}, "
             f"{e['kv_cache_memory_bytes'] // MiB} MiB KV cache, plugin pages {gen['plugin_page_bytes'] // KiB} KiB"),
            (f"   {gen['processes_per_config']} processes per config x {gen['measured_phases_per_process']} "
             f"phases, order {' '.join('A' if o == 'vllm' else 'B' for o in gen['order'])} (A = vLLM, B = +kvpool); "
             f"{len(gen['rerun_disturbed'])} run(s) done again (other processes took > {OTHER_LOAD_RETRY} core)"),
            f"   {'':<26}{'tok/s median':>13}{'min':>9}{'max':>9}{'init s':>9}   per-process medians (* disturbed)",
        ]
        for name, label in (("vllm", "vLLM"), ("kvpool", "vLLM + kvpool plugin")):
            cc = c[name]
            per = " ".join(f"{statistics.median(p['tokens_per_s']):.0f}{'*' if p['disturbed'] else ''}"
                           for p in cc["processes"])
            lines.append(f"   {label:<26}{cc['median_tokens_per_s']:>13.0f}{cc['min_tokens_per_s']:>9.0f}"
                         f"{cc['max_tokens_per_s']:>9.0f}{cc['median_init_s']:>9.2f}   {per}")
        lines.append(f"   ratio kvpool / vLLM: tokens/s {fmt(gen['ratio_tokens_per_s'], '.3f')}, "
                     f"init {fmt(gen['ratio_init_s'], '.2f')}; tokens identical: "
                     + ("yes" if gen["tokens_identical"]
                        else f"NO (phases differing: {gen['phases_differing_from_reference']})"))
    lines += ["", f"total {res['elapsed_s']:.1f} s"]
    loads = [(name, res[name]["other_load_cores"]) for name in ("blockpool", "generation")
             if res[name].get("other_load_cores") is not None]
    if loads:
        lines[-1] += "; other processes' load: " + ", ".join(f"{load:.2f} cores during {name}" for name, load in loads)
    kept_disturbed = sum(p["disturbed"] for c in gen.get("configs", {}).values() for p in c["processes"])
    if kept_disturbed or (bp.get("other_load_cores") or 0) > OTHER_LOAD_WARN:
        lines.append("WARNING: other processes took CPU while this ran ("
                     + (f"{kept_disturbed} engine run(s) kept disturbed after retries" if kept_disturbed
                        else "during the block pool figure")
                     + "); rerun on a quiet machine")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short loops, one engine per configuration; noisy")
    ap.add_argument("--json", "--out", dest="json", default="bench-engines.json", metavar="PATH",
                    help="where to write the raw results")
    ap.add_argument("--page-bytes", type=int, default=64 * KiB, metavar="N",
                    help="kvpool page per layer, for the block pool figure and KVPOOL_VLLM_PAGE_BYTES (default 64 KiB)")
    ap.add_argument("--profile", action="store_true", help="also profile the kvpool round trip (cProfile)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    t0 = time.perf_counter()
    py, origin = find_vllm_python()
    res: dict[str, Any] = {
        "when": utc_now(),
        "quick": args.quick,
        "settings": asdict(settings),
        "machine": machine_info(extra={"anyio": version("anyio"), "vllm_python": py, "vllm_python_origin": origin}),
    }
    if py is None:
        res["blockpool"] = res["generation"] = {"available": False, "why": origin}
    else:
        tmp = Path(tempfile.mkdtemp(prefix="kvpool-bench-engines-"))
        try:
            load = OtherLoad()
            res["blockpool"] = bench_blockpool(settings, py, origin, str(tmp), args.page_bytes, args.profile)
            res["blockpool"]["other_load_cores"] = load.cores()
            if res["blockpool"].get("available"):
                res["installed_adapter_matches_checkout"] = (
                    res["blockpool"]["adapter_hashes"] == _checkout_adapter_hashes())
                load = OtherLoad()
                res["generation"] = bench_generation(settings, py, tmp, args.page_bytes)
                res["generation"]["other_load_cores"] = load.cores()
            else:
                res["generation"] = {"available": False, "why": "the block pool snippet failed: "
                                     + res["blockpool"]["why"]}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    res["elapsed_s"] = time.perf_counter() - t0
    print(format_report(res))
    write_json(res, args.json)
    return 0 if res["generation"].get("tokens_identical", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
