"""Suite ``engines``: kvpool's vLLM plugin against vLLM itself, one run.

Everything runs in the vLLM interpreter (:func:`kvpool.bench._lib.find_vllm_python`),
in child processes. That venv holds a *snapshot* of kvpool (installed by
``scripts/vllm_venv.sh``): the report says whether its ``adapters/vllm``
files match this checkout's (or, outside a checkout, the harness's own).

Figures
-------
1. **Block pool hot path** (``blockpool``): ``python -m
   kvpool.bench._vllm_side blockpool``. Contenders, ``num_gpu_blocks`` =
   4096 (block 0 is vLLM's null block), built as vLLM's KV cache coordinator
   builds them: ``vllm`` (``BlockPool``), ``kvpool`` (``KVPoolBlockPool``
   over a private ``KVSpace``, ``reserve=(0, big)``, no reserve thread),
   ``kvpool_tenant`` (the same space as a tenant of a pool ledger, as the
   plugin runs in an engine), and ``kvspace`` (the bare ``KVSpace`` round
   trip of the ``kvpool`` contender). Geometry: what the plugin builds for
   the tiny model (2 layers of 8 KiB blocks, 64 KiB pages). Pages stay
   committed (checked). The contenders are built first and timed in turn,
   repeat by repeat (a load change hits them alike: each ratio compares
   loops run seconds apart, not a minute). Round trip = ``free_blocks(get_new_blocks(n))``,
   n = 1, 16, 256, prefix caching off and on; ``get_num_free_blocks()``
   alone. Goals (issue 12): the plugin <= 1.0x vLLM at n >= 16 and <= 1.5x at
   n = 1, caching on and off; ``get_num_free_blocks`` <= 2x vLLM's.
   ``--profile`` adds cProfile tables of the round trips.

2. **Generation** (``generation``): the checkout's
   ``tests/vllm_support/run_engine.py`` runs an in-process vLLM engine on the
   tiny random Llama of ``tests/vllm_support/tiny_llama.py``, with and
   without the plugin (``KVPOOL_VLLM=1``, ``KVPOOL_VLLM_PAGE_BYTES`` = 64 KiB
   by default, ``--page-bytes``). 16 prompts of 5 to 200 tokens, greedy,
   ``ignore_eos``, 128 new tokens, batch <= 16, prefix caching off, 64 MiB of
   KV cache. Each process warms up with one whole batch (untimed: the plugin
   commits its pages there, as stock vLLM allocates its cache at start-up),
   then runs the batch several times; the
   configurations alternate process by process (A B, B A, A B, B A, ...: 8
   processes of 6 measured phases each per configuration). Reported:
   tokens/s per phase, the median per configuration, the ratio plugin /
   vLLM (goal >= 0.99), and the ratio within each adjacent pair of
   processes (same repeat: plugin median / vLLM median), whose median is
   less sensitive to the machine drifting during the run than the pooled
   one: one process to the next, the same configuration's tokens/s spreads
   by up to about 30% on this 2-core VM. Greedy tokens must be identical across every phase
   of both (the suite fails otherwise). Runs during which other processes
   took more than 0.1 core are done again (at most twice) and marked.

Without a vLLM interpreter (or outside a checkout, for figure 2) the JSON
records ``{"available": false, "why": ...}`` and the suite does not fail.
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
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ._lib import (BIG_RESERVE, VLLM_ENV, Goal, KiB, MiB, checkout, find_vllm_python, fmt, goal_lines,
                   machine_line, ratio, run_vllm_side)

TITLE = "the vLLM plugin vs vLLM"
SIZES = (1, 16, 256)
KINDS = ("vllm", "kvpool", "kvpool_tenant")
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
LABELS = {"vllm": "vLLM BlockPool", "kvpool": "KVPoolBlockPool (private space)",
          "kvpool_tenant": "KVPoolBlockPool (pool tenant)"}


@dataclass(frozen=True)
class Settings:
    repeats: int
    target_s: float
    processes: int  # engine processes per configuration (alternating)
    phases: int  # measured generate() calls per engine process
    retries: int  # times an engine run disturbed by other processes is done again
    prompts: int
    max_tokens: int
    blockpool_timeout_s: float
    engine_timeout_s: float


FULL = Settings(repeats=5, target_s=0.1, processes=8, phases=6, retries=2, prompts=16, max_tokens=128,
                blockpool_timeout_s=600, engine_timeout_s=400)
QUICK = Settings(repeats=3, target_s=0.02, processes=1, phases=1, retries=0, prompts=8, max_tokens=32,
                 blockpool_timeout_s=180, engine_timeout_s=300)


def _child_env(**more: str) -> dict[str, str]:
    """A vLLM child's environment: no plugin unless asked, kvpool events as JSON lines on stderr."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("KVPOOL_VLLM") and k != VLLM_ENV) and k not in ("KVPOOL_POOL", "PYTHONPATH")}
    env.update(VLLM_LOGGING_LEVEL="WARNING", KVPOOL_LOG_LEVEL="info", KVPOOL_LOG_FORMAT="json")
    env.update(more)
    return env


class OtherLoad:
    """CPU time the rest of the machine used while a figure ran, in cores (None where unknown).

    System-wide busy time from ``/proc/stat`` less this process's and its
    children's (``getrusage``).
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


def _adapter_hashes() -> dict[str, str]:
    """This checkout's adapters/vllm files (outside a checkout: the harness's installed ones)."""
    root = checkout()
    if root is not None:
        folder = root / "adapters" / "vllm"
    else:
        import kvpool

        folder = Path(kvpool.__file__).parent / "adapters" / "vllm"
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.py"))}


# ------------------------------------------------------- figure 1: block pool


def bench_blockpool(s: Settings, py: str, origin: str, cwd: str, page_bytes: int, profile: bool) -> dict[str, Any]:
    from kvpool import Pool

    pool_name = f"bench-engines-bp-{uuid.uuid4().hex[:8]}"
    cfg: dict[str, Any] = {
        "repeats": s.repeats, "target_s": s.target_s, "sizes": list(SIZES), "kinds": list(KINDS),
        "num_gpu_blocks": NUM_GPU_BLOCKS, "hash_block_size": HASH_BLOCK_SIZE, "num_layers": NUM_LAYERS,
        "block_bytes": BLOCK_BYTES, "page_bytes": page_bytes, "big_reserve": BIG_RESERVE, "pool_name": pool_name,
        "pool_capacity": POOL_CAPACITY, "profile": profile, "profile_top": 12,
    }
    res = run_vllm_side(py, origin, "blockpool", cfg, cwd=cwd, env=_child_env(VLLM_LOGGING_LEVEL="ERROR"),
                        timeout_s=s.blockpool_timeout_s)
    if not res["available"]:
        Pool.remove(pool_name)  # the program removes it unless it died first
        return res
    res.update(num_gpu_blocks=NUM_GPU_BLOCKS, sizes=list(SIZES),
               geometry={"num_layers": NUM_LAYERS, "block_bytes": BLOCK_BYTES, "page_bytes": page_bytes,
                         "blocks_per_page": page_bytes // BLOCK_BYTES})
    us: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    for key, kinds in res["roundtrip"].items():
        us[key] = {kind: {n: r["median_ns"] / 1e3 for n, r in cases.items()} for kind, cases in kinds.items()}
        ratios[key] = {f"{kind}/vllm": {n: ratio(us[key][kind][n], us[key]["vllm"][n]) for n in us[key][kind]}
                       for kind in kinds if kind != "vllm"}
    us["kvspace"] = {n: r["median_ns"] / 1e3 for n, r in res["kvspace"].items()}
    us["num_free"] = {kind: r["median_ns"] / 1e3 for kind, r in res["num_free"].items()}
    ratios["num_free"] = {f"{kind}/vllm": ratio(us["num_free"][kind], us["num_free"]["vllm"])
                          for kind in us["num_free"] if kind != "vllm"}
    res["us"], res["ratios"] = us, ratios
    return res


def blockpool_goals(bp: Mapping[str, Any]) -> list[Goal]:
    goals = []
    for key in ("caching_off", "caching_on"):
        for n in SIZES:
            goals.append(Goal(f"KVPoolBlockPool / vLLM, {key.replace('_', ' ')}, n = {n}",
                              bp["ratios"][key]["kvpool/vllm"][str(n)], 1.5 if n == 1 else 1.0))
    goals.append(Goal("get_num_free_blocks, kvpool / vLLM", bp["ratios"]["num_free"]["kvpool/vllm"], 2.0))
    return goals


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


def _run_engine(py: str, support: Path, tmp: Path, cfg: dict[str, Any], plugin: bool, pool_name: str, tag: str,
                page_bytes: int, timeout_s: float) -> dict[str, Any]:
    cfg_path, out_path = tmp / f"engine-{tag}.json", tmp / f"engine-{tag}.out.json"
    cfg_path.write_text(json.dumps(cfg))
    env = _child_env(KVPOOL_VLLM="1", KVPOOL_POOL=pool_name, KVPOOL_VLLM_PAGE_BYTES=str(page_bytes),
                     KVPOOL_VLLM_TENANT=f"bench-{tag}") if plugin else _child_env()
    t0 = time.perf_counter()
    proc = subprocess.run([py, str(support / "run_engine.py"), str(cfg_path), str(out_path)], check=False,
                          capture_output=True, text=True, cwd=tmp, env=env, timeout=timeout_s)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"engine {tag} (plugin={plugin}) exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(out_path.read_text())
    created = [e for e in _events(proc.stderr) if e.get("event") == "vllm space created"]
    if bool(created) != plugin:
        raise RuntimeError(f"engine {tag}: plugin={plugin} but {len(created)} 'vllm space created' events")
    res["process_s"], res["space"] = wall_s, created[0] if created else None
    return res


def bench_generation(s: Settings, py: str, tmp: Path, page_bytes: int) -> dict[str, Any]:
    from kvpool import Pool

    root = checkout()
    if root is None:
        return {"available": False, "why": "not run in a kvpool checkout: its tests/vllm_support programs are needed"}
    support = root / "tests" / "vllm_support"
    model = tmp / "tiny-llama"
    t0 = time.perf_counter()
    subprocess.run([py, str(support / "tiny_llama.py"), str(model)], check=True, cwd=tmp, capture_output=True,
                   env=_child_env(), timeout=300)
    build_s = time.perf_counter() - t0
    prompts = _prompts(s.prompts)
    cfg = {"model": str(model), "in_process": True, "prefix_caching": False, "block_size": ENGINE_BLOCK_SIZE,
           "kv_cache_memory_bytes": KV_CACHE_BYTES, "max_num_seqs": MAX_NUM_SEQS,
           # The warm-up is one whole batch: the plugin commits its pages then,
           # as stock vLLM allocates and zeroes its cache at start-up (neither is timed).
           "phases": [{"prompts": prompts, "max_tokens": s.max_tokens}] * (1 + s.phases)}
    pool_name = f"bench-engines-{uuid.uuid4().hex[:8]}"
    Pool(pool_name, capacity=POOL_CAPACITY)
    runs: dict[str, list[dict[str, Any]]] = {"vllm": [], "kvpool": []}
    disturbed: list[dict[str, Any]] = []
    order: list[str] = []
    try:
        for rep in range(s.processes):
            for name in (("vllm", "kvpool") if rep % 2 == 0 else ("kvpool", "vllm")):  # A B, B A, ...
                for attempt in range(1 + s.retries):
                    load = OtherLoad()
                    res = _run_engine(py, support, tmp, cfg, name == "kvpool", pool_name, f"{name}-{rep}-{attempt}",
                                      page_bytes, s.engine_timeout_s)
                    phases = res["phases"][1:]  # the warm-up is not measured
                    run = {"init_s": res["init_s"], "process_s": res["process_s"],
                           "num_gpu_blocks": res["num_gpu_blocks"], "other_load_cores": load.cores(),
                           "space": res["space"], "gen_s": [p["gen_s"] for p in phases],
                           "tokens_per_s": [sum(map(len, p["tokens"])) / p["gen_s"] for p in phases],
                           "tokens": [p["tokens"] for p in phases]}
                    quiet = run["other_load_cores"] is None or run["other_load_cores"] <= OTHER_LOAD_RETRY
                    if quiet or attempt == s.retries:
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
        "prompt_lengths": [len(p) for p in prompts], "max_tokens": s.max_tokens,
        "measured_phases_per_process": s.phases, "processes_per_config": s.processes, "order": order,
        "rerun_disturbed": disturbed, "plugin_page_bytes": page_bytes, "tokens_identical": not any(mismatched.values()),
        "phases_differing_from_reference": mismatched, "configs": {}}
    for name, rs in runs.items():
        tps = [x for r in rs for x in r["tokens_per_s"]]
        for r in rs:
            del r["tokens"]
        out["configs"][name] = {"median_tokens_per_s": statistics.median(tps), "min_tokens_per_s": min(tps),
                                "max_tokens_per_s": max(tps), "phases": len(tps),
                                "median_init_s": statistics.median(r["init_s"] for r in rs), "processes": rs}
    c = out["configs"]
    out["ratio_tokens_per_s"] = ratio(c["kvpool"]["median_tokens_per_s"], c["vllm"]["median_tokens_per_s"])
    # Process r of each configuration ran next to the other's process r (A B, B A, ...).
    out["pair_ratios"] = [statistics.median(k["tokens_per_s"]) / statistics.median(v["tokens_per_s"])
                          for k, v in zip(c["kvpool"]["processes"], c["vllm"]["processes"])]
    out["ratio_pairs_median"] = statistics.median(out["pair_ratios"])
    out["ratio_init_s"] = ratio(c["kvpool"]["median_init_s"], c["vllm"]["median_init_s"])
    return out


# ------------------------------------------------------------------- suite


def run(opts: argparse.Namespace) -> dict[str, Any]:
    s = QUICK if opts.quick else FULL
    py, origin = find_vllm_python()
    res: dict[str, Any] = {"settings": asdict(s), "vllm_python": py, "vllm_python_origin": origin, "goals": []}
    if py is None:
        res["blockpool"] = res["generation"] = {"available": False, "why": origin}
        return res
    tmp = Path(tempfile.mkdtemp(prefix="kvpool-bench-engines-"))
    try:
        load = OtherLoad()
        bp = res["blockpool"] = bench_blockpool(s, py, origin, str(tmp), opts.page_bytes, opts.profile)
        bp["other_load_cores"] = load.cores()
        if not bp.get("available"):
            res["generation"] = {"available": False, "why": "the block pool program failed: " + bp["why"]}
            return res
        res["installed_adapter_matches_checkout"] = bp["adapter_hashes"] == _adapter_hashes()
        goals = blockpool_goals(bp)
        load = OtherLoad()
        gen = res["generation"] = bench_generation(s, py, tmp, opts.page_bytes)
        gen["other_load_cores"] = load.cores()
        if gen.get("available"):
            goals.append(Goal("tokens/s, plugin / vLLM", gen["ratio_tokens_per_s"], 0.99, ">="))
            if not gen["tokens_identical"]:
                res["failed"] = f"greedy tokens differ: {gen['phases_differing_from_reference']}"
        res["goals"] = [g.as_json() for g in goals]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def _blockpool_lines(res: Mapping[str, Any]) -> list[str]:
    bp = res["blockpool"]
    lines = [f"vLLM {bp['vllm']} (Python {bp['python']}, {bp['origin']}), installed kvpool {bp['kvpool']}: "
             + ("adapters/vllm matches this checkout" if res["installed_adapter_matches_checkout"]
                else "adapters/vllm DIFFERS from this checkout (rerun scripts/vllm_venv.sh)")]
    g, sizes = bp["geometry"], [str(n) for n in bp["sizes"]]
    head = "".join(f"{'n = ' + n:>10}" for n in sizes)
    us, ratios = bp["us"], bp["ratios"]
    lines += ["", f"1. free_blocks(get_new_blocks(n)), {bp['num_gpu_blocks']} blocks ({g['num_layers']} layers x "
              f"{g['block_bytes'] // KiB} KiB, {g['page_bytes'] // KiB} KiB pages); kvpool pages kept committed"]
    for key, title in (("caching_off", "prefix caching off"), ("caching_on", "prefix caching on")):
        lines.append(f"   {'us per round trip, ' + title:<40}{head}")
        for kind, row in us[key].items():
            lines.append(f"     {LABELS[kind]:<38}" + "".join(f"{fmt(row[n], '.2f'):>10}" for n in sizes))
        if key == "caching_off":
            lines.append(f"     {'KVSpace alloc + free alone':<38}"
                         + "".join(f"{fmt(us['kvspace'][n], '.2f'):>10}" for n in sizes))
        for name, row in ratios[key].items():
            lines.append(f"     {'ratio ' + name.replace('_', ' '):<38}" + "".join(f"{fmt(row[n], '.2f'):>10}"
                                                                              for n in sizes))
    lines.append(f"   {'get_num_free_blocks(), us per call':<40}" + "".join(f"{k:>16}" for k in us["num_free"]))
    lines.append(f"   {'':<40}" + "".join(f"{fmt(v, '.3f'):>16}" for v in us["num_free"].values()))
    for kind, profs in bp.get("profile", {}).items():
        for n, prof in profs.items():
            lines.append(f"   profile, {LABELS[kind]} n={n}, caching off (cProfile, {prof['iters']} round trips)")
            for row in prof["top_by_tottime"][:8]:
                lines.append(f"     {row['share'] * 100:6.1f}%{row['tottime_us_per_roundtrip']:8.2f} us"
                             f"{row['ncalls_per_roundtrip']:8.1f} calls  {row['function']}")
    return lines


def format_report(res: Mapping[str, Any]) -> str:
    bp, gen = res["blockpool"], res["generation"]
    lines = [machine_line(res["machine"])]
    if not bp.get("available"):
        return "\n".join([*lines, f"vLLM: skipped ({bp['why']})"])
    lines += _blockpool_lines(res)
    lines.append("")
    if not gen.get("available"):
        lines.append(f"2. generation: skipped ({gen['why']})")
    else:
        e, c = gen["engine"], gen["configs"]
        lines += [f"2. generation, tiny Llama, in-process engine: {len(gen['prompt_lengths'])} prompts x "
                  f"{gen['max_tokens']} new tokens, batch <= {e['max_num_seqs']}, {e['kv_cache_memory_bytes'] // MiB} "
                  f"MiB KV cache, plugin pages {gen['plugin_page_bytes'] // KiB} KiB; order "
                  f"{' '.join('A' if o == 'vllm' else 'B' for o in gen['order'])} (A = vLLM, B = +kvpool)",
                  f"   {'':<26}{'tok/s median':>13}{'min':>9}{'max':>9}{'init s':>9}   per process (* disturbed)"]
        for name, label in (("vllm", "vLLM"), ("kvpool", "vLLM + kvpool plugin")):
            cc = c[name]
            per = " ".join(f"{statistics.median(p['tokens_per_s']):.0f}{'*' if p['disturbed'] else ''}"
                           for p in cc["processes"])
            lines.append(f"   {label:<26}{cc['median_tokens_per_s']:>13.0f}{cc['min_tokens_per_s']:>9.0f}"
                         f"{cc['max_tokens_per_s']:>9.0f}{cc['median_init_s']:>9.2f}   {per}")
        pr = gen.get("pair_ratios") or []
        if pr:
            lines.append(f"   adjacent pairs, plugin / vLLM: median {gen['ratio_pairs_median']:.3f} "
                         f"(min {min(pr):.3f}, max {max(pr):.3f}; {len(pr)} pairs)")
        lines.append(f"   ratio kvpool / vLLM: tokens/s {fmt(gen['ratio_tokens_per_s'], '.3f')}, init "
                     f"{fmt(gen['ratio_init_s'], '.2f')}; tokens identical: "
                     + ("yes" if gen["tokens_identical"] else f"NO ({gen['phases_differing_from_reference']})"))
    lines += goal_lines(res["goals"])
    kept = sum(p["disturbed"] for c in gen.get("configs", {}).values() for p in c["processes"])
    if kept or (bp.get("other_load_cores") or 0) > OTHER_LOAD_WARN:
        lines.append("WARNING: other processes took CPU while this ran; rerun on a quiet machine")
    return "\n".join(lines)


def markdown(res: Mapping[str, Any]) -> str:
    bp, gen = res["blockpool"], res["generation"]
    if not bp.get("available"):
        return f"vLLM side skipped: {bp['why']}."
    us, r = bp["us"], bp["ratios"]
    cols = [str(n) for n in bp["sizes"]]

    def pair(a: Mapping[str, Any], b: Mapping[str, Any], n: str, spec: str, unit: str) -> str:
        return f"{fmt(a[n], spec)} / {fmt(b[n], spec)}{unit}"

    stale = "" if res.get("installed_adapter_matches_checkout") else (
        " **Its kvpool's `adapters/vllm` differed from this checkout's: these are not this checkout's numbers.**")
    lines = [f"vLLM {bp['vllm']} ({bp['origin']}); plugin pages {bp['geometry']['page_bytes'] // KiB} KiB.{stale}",
             "", "| figure | " + " | ".join(f"n = {n}" for n in cols) + " |", "|---|" + "---|" * len(cols),
             "| `free_blocks(get_new_blocks(n))`, vLLM `BlockPool`, caching off / on | "
             + " | ".join(pair(us["caching_off"]["vllm"], us["caching_on"]["vllm"], n, ".2f", " µs") for n in cols)
             + " |",
             "| same, `KVPoolBlockPool`, caching off / on | "
             + " | ".join(pair(us["caching_off"]["kvpool"], us["caching_on"]["kvpool"], n, ".2f", " µs")
                          for n in cols) + " |",
             "| ratio kvpool / vLLM, caching off / on (goal ≤ 1.5× at n = 1, ≤ 1.0× above) | "
             + " | ".join(pair(r["caching_off"]["kvpool/vllm"], r["caching_on"]["kvpool/vllm"], n, ".2f", "×")
                          for n in cols) + " |",
             "", f"`get_num_free_blocks()`: {us['num_free']['kvpool']:.3f} µs against vLLM's "
             f"{us['num_free']['vllm']:.3f} µs ({fmt(r['num_free']['kvpool/vllm'], '.2f')}×, goal ≤ 2×)."]
    if gen.get("available"):
        c = gen["configs"]
        lines.append(f"Generation, {len(gen['prompt_lengths'])} prompts × {gen['max_tokens']} new tokens, "
                     f"{gen['processes_per_config']} process(es) per configuration, alternating: "
                     f"{c['kvpool']['median_tokens_per_s']:,.0f} vs {c['vllm']['median_tokens_per_s']:,.0f} tokens/s "
                     f"({fmt(gen['ratio_tokens_per_s'], '.3f')}×, goal ≥ 0.99)"
                     + (f"; adjacent process pairs: median {gen['ratio_pairs_median']:.3f}× "
                        f"({min(gen['pair_ratios']):.3f}–{max(gen['pair_ratios']):.3f}×)"
                        if gen.get("pair_ratios") else "")
                     + "; greedy tokens "
                     + ("identical" if gen["tokens_identical"] else "DIFFERENT")
                     + f"; engine start-up {fmt(gen['ratio_init_s'], '.2f')}×.")
    return "\n".join(lines)
