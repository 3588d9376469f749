"""``kvpool demo``: several engines share one pool, live, against a static split.

Each engine is a small decoder (random weights, real multi-head attention)
whose keys and values live in kvpool tensors, addressed through per-request
block tables. The engines serve a bursty request trace concurrently on one
asyncio loop; each request is admitted with ``await alloc(blocks)`` for its
prompt plus its generation budget, so a burst *waits* for memory instead of
failing. While the pool makes an engine lend (it holds more than its
guarantee while a neighbour below its own waits), the engine preempts its
newest requests as vLLM does when its cache is full: frees their blocks and
recomputes them later (:mod:`kvpool._demo_sched`). The same trace is then
served again with every engine capped at an equal slice of the same pool
(``set_limit(pool / engines)``): the static split engines use today. The summary compares the two runs; the ratio is
elastic / static.

Each engine computes with one torch thread: with two, elastic's larger
batches cross torch's intra-op parallel threshold while static's small ones
stay serial, and on a busy (oversubscribed) machine the spinning threads
collapse elastic's throughput (issue 14). ``--clock virtual`` runs the same
engines, managers and pool with modeled step times on a virtual clock
(:mod:`kvpool._demo_virtual`): exact figures, independent of machine load.
``--trace`` picks the arrival shape (:mod:`kvpool._demo_traces`).

The default load (``--burst 10``: 66 requests in 10 s, three engines) is one
the engines' compute keeps up with on the 2-core development machine, so
memory, not compute, is what a static slice runs short of, as on a GPU where
KV memory limits the batch. Until 2026-12-03 the default was 24 a burst: 162
requests need about 22 s of this engine's compute (one thread, attention per
sequence), so both modes queued for compute and no memory policy could help;
on a quiet machine elastic then lost to static in 5 of 5 runs (TTFT p50
1.10-1.41x), its preemptions' recompute adding to the compute queue. 12 a
burst still lost in 3 of 7 quiet runs, whenever the machine ran slower than
usual; ``--burst 24`` still runs the compute-bound load.

The monitors record, per engine and about every 0.1 s, committed memory
(``engine-<e>``) and the requests waiting for KV memory (``waiting-<e>``);
the plot draws both, so a stall (memory flat while requests queue) shows.

Correctness is checked in every run: a sample of requests is decoded again
with a plain contiguous KV cache and must give the same greedy tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import random
import sys
import time
import uuid
from typing import Any

import torch

from ._demo_clock import RealClock
from ._demo_model import (BLOCK_BYTES, HEAD_DIM, HEADS, LAYERS, ContiguousKV, PagedKV, TinyDecoder,
                          greedy)
from ._demo_sched import Running as RunningRequest
from ._demo_sched import Scheduler
from ._demo_traces import BLOCK_TOKENS, SHAPES, Request, make_trace, max_request_blocks
from .geometry import Geometry
from .manager import KVCacheManager
from .pool import Pool

DEFAULT_BURST = 10  # requests per burst: compute keeps up (module docstring)
COMPUTE_BOUND_BURST = 24  # the former default: compute-bound here, whatever the memory policy

PAGE_BYTES = 64 * 1024
COMMIT_BYTES_PER_BLOCK = BLOCK_BYTES * LAYERS * 2  # what one block costs the pool (every region)
TORCH_THREADS = 1  # per engine; see the module docstring


# -------------------------------------------------------------------- engine

Running = tuple[Request, Any, torch.Tensor, PagedKV, torch.Tensor | None]  # ..., logits (None: to prefill)


class Engine(Scheduler):
    """The real engine: continuous batching over kvpool tensors (admission and preemption: Scheduler)."""

    def __init__(self, index: int, manager: KVCacheManager, model: TinyDecoder) -> None:
        super().__init__(index, manager, RealClock())
        self.model = model
        self.caches = manager.tensors(torch.float32, (BLOCK_TOKENS, HEADS, HEAD_DIM))
        self.running: list[Running] = []

    def _started(self, r: Request, ids: Any) -> None:
        blocks = torch.from_numpy(ids)
        self.running.append((r, ids, blocks, PagedKV(self.caches, blocks), None))

    def _running_requests(self) -> list[RunningRequest]:
        # logits None: admitted, not prefilled yet (nothing computed to lose).
        return [RunningRequest(r, ids, r.new_tokens - len(r.output),
                        0 if logits is None else len(r.prompt) + len(r.output))
                for r, ids, _, _, logits in self.running]

    def _take(self, r: Request) -> Any:
        i = next(i for i, run in enumerate(self.running) if run[0] is r)
        return self.running.pop(i)[1]

    async def serve(self, total: int) -> None:
        """Continuous batching: preempt if lending, prefill newcomers, then one decode step for everyone."""
        while len(self.finished) < total:
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
                continue
            self.act_on_lending()
            for i, (r, ids, blocks, kv, logits) in enumerate(self.running):
                if logits is None:  # prefill; after a preemption, of the prompt and what it generated
                    logits = self.model.forward(torch.tensor(r.prompt + r.output), 0, kv)
                    self.running[i] = (r, ids, blocks, kv, logits)
            still: list[Running] = []
            for r, ids, blocks, kv, logits in self.running:
                assert logits is not None
                tok = int(logits.argmax())
                if not r.output:
                    r.first_token = time.perf_counter()
                r.output.append(tok)
                self.tokens += 1
                if len(r.output) == r.new_tokens:
                    r.done = time.perf_counter()
                    self.m.free(ids)
                    self.finished.append(r)
                    continue
                still.append((r, ids, blocks, kv, None))
            if still:  # one batched decode step for every running request
                out = self.model.decode([r.output[-1] for r, *_ in still],
                                        [len(r.prompt) + len(r.output) - 1 for r, *_ in still],
                                        [kv for _, _, _, kv, _ in still])
                still = [(r, ids, blocks, kv, out[i]) for i, (r, ids, blocks, kv, _) in enumerate(still)]
            self.running = still
            self.step_ended(bool(self.running))
            await asyncio.sleep(0)  # let the other engines run


# ------------------------------------------------------------------ one mode

def headroom_bytes(geometry: Geometry, prompt_scale: float) -> int:
    """What each engine asks borrowers to keep free: the pages of its largest request.

    ARCHITECTURE.md, "Fair share", rule 6: with it an engine's next
    admission is granted at once instead of waiting for a borrower's step.
    """
    per_page = geometry.page_bytes // geometry.region_block_bytes
    return -(-max_request_blocks(prompt_scale) // per_page) * geometry.page_commit_bytes


def announce_pool(mode: str, pool_name: str) -> None:
    """Name the run's pool on stderr, so `kvpool top` can be pointed at it (stdout stays the report's)."""
    print(f"kvpool demo: {mode} run on pool {pool_name} (watch it: kvpool top {pool_name})",
          file=sys.stderr, flush=True)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def run_mode(mode: str, args: argparse.Namespace, trace: list[Request], model: TinyDecoder,
                   live: Any) -> dict[str, Any]:
    geometry = Geometry(LAYERS, 2, BLOCK_BYTES, args.blocks, page_bytes=PAGE_BYTES)
    pool_bytes = args.pool_blocks * COMMIT_BYTES_PER_BLOCK
    pool_name = f"demo-{mode}-{uuid.uuid4().hex[:6]}"
    pool = Pool(pool_name, capacity=pool_bytes)
    announce_pool(mode, pool_name)
    slice_bytes = pool_bytes // args.engines
    engines: list[Engine] = []
    timeline: list[dict[str, Any]] = []
    try:
        for e in range(args.engines):
            m = KVCacheManager(geometry, pool=pool, name=f"engine-{e}", reserve=(1, 2),
                               headroom_bytes=headroom_bytes(geometry, args.prompt_scale))
            if mode == "static":
                await m.set_limit(slice_bytes)
            engines.append(Engine(e, m, model))
        mine = {e: [r.fresh() for r in trace if r.engine == e]
                for e in range(args.engines)}
        t0 = time.perf_counter()
        peak = [0] * args.engines

        async def monitor() -> None:
            while True:
                now = time.perf_counter() - t0
                row: dict[str, Any] = {"t": round(now, 3)}
                for eng in engines:
                    c = eng.m.stats().committed_bytes
                    peak[eng.index] = max(peak[eng.index], c)
                    row[f"engine-{eng.index}"] = c
                    row[f"waiting-{eng.index}"] = eng.waiting  # requests queued for KV memory
                timeline.append(row)
                if live is not None:
                    live(mode, engines, now)
                await asyncio.sleep(0.1)

        mon = asyncio.create_task(monitor())
        for eng in engines:  # one process: a preemption hands its blocks to the others at once
            eng.peers = [p for p in engines if p is not eng]
        tasks = [asyncio.create_task(eng.run(mine[eng.index], t0)) for eng in engines]
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
        mon.cancel()
        try:
            await mon
        except asyncio.CancelledError:
            pass
        return summarize(mode, args, elapsed, timeline, [
            eng.report() | {"peak_committed_bytes": max(peak[eng.index], eng.peak_committed)}
            for eng in engines
        ])
    finally:
        for eng in engines:
            await eng.m.aclose()
        Pool.remove(pool_name)


def summarize(mode: str, args: argparse.Namespace, elapsed: float, timeline: list[dict[str, Any]],
              raw: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's figures from each engine's raw results (same shape in- or cross-process, either clock)."""
    pool_bytes = args.pool_blocks * COMMIT_BYTES_PER_BLOCK
    per_engine = [{
        "engine": r["engine"], "requests": r["requests"], "tokens": r["tokens"],
        "tokens_per_s": r["tokens"] / elapsed, "ttft_p50_s": _pct(r["ttft"], 50),
        "ttft_p99_s": _pct(r["ttft"], 99), "wait_s": r["wait_s"],
        "peak_committed_bytes": r["peak_committed_bytes"],
        "preemptions": r["preemptions"], "recomputed_tokens": r["recomputed_tokens"],
        "preempted_wait_s": r["preempted_wait_s"], "preemptions_asked": r.get("preemptions_asked", 0),
        "reclaimed_by_completion_bytes": r.get("reclaimed_by_completion_bytes", 0),
        "reclaimed_by_preemption_bytes": r.get("reclaimed_by_preemption_bytes", 0),
        "waits_escalated": r.get("waits_escalated", 0),
    } for r in raw]
    all_ttft = [t for r in raw for t in r["ttft"]]
    return {
        "mode": mode, "elapsed_s": elapsed, "pool_bytes": pool_bytes,
        "slice_bytes": pool_bytes // args.engines if mode == "static" else None,
        "processes": bool(args.processes),
        "requests": sum(p["requests"] for p in per_engine),
        "tokens": sum(p["tokens"] for p in per_engine),
        "tokens_per_s": sum(p["tokens"] for p in per_engine) / elapsed,
        "ttft_p50_s": _pct(all_ttft, 50), "ttft_p99_s": _pct(all_ttft, 99),
        "wait_s": sum(p["wait_s"] for p in per_engine),
        "preemptions": sum(p["preemptions"] for p in per_engine),
        "preempted_wait_s": sum(p["preempted_wait_s"] for p in per_engine),
        "recomputed_tokens": sum(p["recomputed_tokens"] for p in per_engine),
        "preemptions_asked": sum(p["preemptions_asked"] for p in per_engine),
        "reclaimed_by_completion_bytes": sum(p["reclaimed_by_completion_bytes"] for p in per_engine),
        "reclaimed_by_preemption_bytes": sum(p["reclaimed_by_preemption_bytes"] for p in per_engine),
        # Waits a shared device made an engine ask for at once (kvpool._demo_sched, issue 31).
        "waits_escalated": sum(p["waits_escalated"] for p in per_engine),
        "engines": per_engine, "timeline": timeline,
        "outputs": {rid: out for r in raw for rid, out in r["outputs"].items()},
    }


# ------------------------------------------------- one process per engine

async def run_mode_processes(mode: str, args: argparse.Namespace, live: Any) -> dict[str, Any]:
    """Each engine in its own process, joined only by the pool ledger."""
    import subprocess

    pool_bytes = args.pool_blocks * COMMIT_BYTES_PER_BLOCK
    pool_name = f"demo-{mode}-{uuid.uuid4().hex[:6]}"
    pool = Pool(pool_name, capacity=pool_bytes)
    announce_pool(mode, pool_name)
    argv = [f"--engines={args.engines}", f"--pool-blocks={args.pool_blocks}", f"--blocks={args.blocks}",
            f"--duration={args.duration}", f"--burst={args.burst}", f"--seed={args.seed}",
            f"--trace={args.trace}", f"--prompt-scale={args.prompt_scale}"]
    procs = [subprocess.Popen([sys.executable, "-m", "kvpool.demo", "--worker", mode, str(e), pool_name, *argv],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              # Their own process group: Ctrl-C at the terminal reaches only
                              # this process, which stops them (finally, below) and says so once.
                              process_group=0)
             for e in range(args.engines)]
    timeline: list[dict[str, Any]] = []
    try:
        for p in procs:
            assert p.stdout is not None
            line = await asyncio.to_thread(p.stdout.readline)
            if line.strip() != "ready":
                raise RuntimeError(f"demo worker failed to start: {line!r}")
        t0 = time.perf_counter() + 0.2  # CLOCK_MONOTONIC: one clock for every process
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(f"{t0!r}\n")
            p.stdin.flush()
        results: list[Any] = [None] * len(procs)

        async def collect(i: int, p: Any) -> None:
            results[i] = json.loads(await asyncio.to_thread(p.stdout.read))

        collectors = [asyncio.create_task(collect(i, p)) for i, p in enumerate(procs)]
        while not all(c.done() for c in collectors):
            now = time.perf_counter() - t0
            tenants = {t.name: t for t in pool.tenants()}
            row: dict[str, Any] = {"t": round(now, 3)}
            for e in range(args.engines):
                t = tenants.get(f"engine-{e}")
                row[f"engine-{e}"] = t.committed_bytes if t else 0
            timeline.append(row)
            if live is not None:
                live(mode, [(e, tenants.get(f"engine-{e}")) for e in range(args.engines)], now)
            await asyncio.sleep(0.1)
        await asyncio.gather(*collectors)
        elapsed = max(r["end"] for r in results) - t0
        _merge_waiting(timeline, t0, results)
        return summarize(mode, args, elapsed, timeline, results)
    finally:
        for p in procs:
            p.kill()
            p.wait()
            for pipe in (p.stdin, p.stdout):
                if pipe is not None:
                    pipe.close()
        Pool.remove(pool_name)


def _merge_waiting(timeline: list[dict[str, Any]], t0: float, results: list[dict[str, Any]]) -> None:
    """Add each worker's ``waiting-<e>`` to the parent's rows.

    The ledger tells the parent only the allocations parked in a manager (one
    per engine at most: the admitter's), not how many requests queue behind
    it, so each worker samples its own queue on the shared monotonic clock
    and the parent's row at time t takes each engine's latest sample at or
    before t (0 before its first)."""
    for e, res in enumerate(results):
        samples = res.get("waiting_samples", [])
        times = [at for at, _ in samples]
        for row in timeline:
            i = bisect.bisect_right(times, t0 + row["t"])
            row[f"waiting-{e}"] = int(samples[i - 1][1]) if i else 0


async def worker(mode: str, index: int, pool_name: str, args: argparse.Namespace) -> None:
    """The engine process of ``--processes``: serve this engine's share of the trace."""
    torch.set_num_threads(TORCH_THREADS)
    model = TinyDecoder(args.seed)
    trace = [r for r in make_trace(args.engines, args.duration, args.burst, args.seed, args.trace,
                                   args.prompt_scale) if r.engine == index]
    geometry = Geometry(LAYERS, 2, BLOCK_BYTES, args.blocks, page_bytes=PAGE_BYTES)
    m = KVCacheManager(geometry, pool=Pool(pool_name, create=False), name=f"engine-{index}", reserve=(1, 2),
                       headroom_bytes=headroom_bytes(geometry, args.prompt_scale))
    if mode == "static":
        await m.set_limit(args.pool_blocks * COMMIT_BYTES_PER_BLOCK // args.engines)
    eng = Engine(index, m, model)
    greedy(model, trace[0].prompt, 4, ContiguousKV())  # warm up before the clock starts
    print("ready", flush=True)
    t0 = float(await asyncio.to_thread(sys.stdin.readline))
    peak = 0
    waiting: list[tuple[float, int]] = []  # (perf_counter, requests queued for KV): the parent's plot rows

    async def monitor() -> None:
        nonlocal peak
        while True:
            peak = max(peak, m.stats().committed_bytes)
            waiting.append((time.perf_counter(), eng.waiting))
            await asyncio.sleep(0.05)

    mon = asyncio.create_task(monitor())
    await eng.run(trace, t0)  # eng.peers stays None: the others are in other processes
    end = time.perf_counter()
    mon.cancel()
    peak = max(peak, m.stats().committed_bytes, eng.peak_committed)
    await m.aclose()
    waiting.append((end, eng.waiting))
    json.dump(eng.report() | {"peak_committed_bytes": peak, "end": end, "waiting_samples": waiting}, sys.stdout)


def check_correctness(model: TinyDecoder, trace: list[Request], outputs: dict[str, list[int]],
                      sample: int, seed: int) -> list[str]:
    """Decode a sample again with a contiguous KV cache; return mismatching request ids."""
    rng = random.Random(seed)
    picks = rng.sample(trace, min(sample, len(trace)))
    bad = []
    for r in picks:
        ref = greedy(model, r.prompt, r.new_tokens, ContiguousKV())
        if outputs.get(r.rid) != ref:
            bad.append(r.rid)
    return bad


# ------------------------------------------------------------------- report

# The report (summary table, plot) is torch-free and lives in its own module.
from .demo_report import plot, summary_table  # noqa: E402


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    el, st = results["elastic"], results["static"]

    def r(a: float, b: float) -> float:
        return a / b if b else float("inf")

    return {
        "tokens_per_s": r(el["tokens_per_s"], st["tokens_per_s"]),
        "ttft_p50": r(el["ttft_p50_s"], st["ttft_p50_s"]),
        "ttft_p99": r(el["ttft_p99_s"], st["ttft_p99_s"]),
        "wait": r(el["wait_s"], st["wait_s"]),
        "elapsed": r(el["elapsed_s"], st["elapsed_s"]),
    }


def _derive(args: argparse.Namespace) -> str:
    """Fill in the figures derived from the options; return what is wrong with them ("" if nothing)."""
    if args.pool_blocks is None:
        args.pool_blocks = (args.pool_mib << 20) // COMMIT_BYTES_PER_BLOCK
    if args.engines < 1 or args.pool_blocks < 1 or args.pool_mib < 1 or args.duration <= 0 or args.burst < 1:
        return "--engines, --pool-mib, --pool-blocks and --burst must be >= 1, --duration > 0"
    if not args.prompt_scale > 0:
        return f"--prompt-scale must be > 0, got {args.prompt_scale}"
    if args.clock == "virtual" and args.processes:
        return "--clock virtual runs every engine in this process: drop --processes"
    return ""


def _slice_blocks(args: argparse.Namespace) -> int:
    """Blocks a static slice can hold: whole pages only, as the limit counts them."""
    if args.clock == "virtual":
        from ._demo_virtual import blocks_per_page

        per_page = blocks_per_page(args.pool_blocks)
    else:
        per_page = PAGE_BYTES // BLOCK_BYTES
    return int(args.pool_blocks // (args.engines * per_page) * per_page)


async def main_async(args: argparse.Namespace) -> int:
    from .demo_report import ReportConsole as Console  # highlighting off: "0.40x" stays one colour
    from rich.live import Live
    from rich.table import Table

    console = Console(stderr=args.json)
    problem = _derive(args)
    if problem:
        print(f"kvpool demo: {problem}", file=sys.stderr)
        return 2
    virtual = args.clock == "virtual"
    torch.set_num_threads(TORCH_THREADS)
    trace = make_trace(args.engines, args.duration, args.burst, args.seed, args.trace, args.prompt_scale)
    biggest = max(r.blocks for r in trace)
    if biggest > _slice_blocks(args):
        print(f"kvpool demo: the largest request needs {biggest} blocks but a static slice holds "
              f"{_slice_blocks(args)} (pool {args.pool_blocks} blocks / {args.engines} engines): use a larger "
              "--pool-mib/--pool-blocks, fewer --engines or a smaller --prompt-scale", file=sys.stderr)
        return 2
    model = None if virtual else TinyDecoder(args.seed)
    if model is not None:
        # Warm torch up so the first mode timed does not pay for first calls.
        greedy(model, trace[0].prompt, 4, ContiguousKV())
    show_live = not args.no_live and console.is_terminal
    live_ctx = Live(console=console, refresh_per_second=4, transient=True) if show_live else None

    def render(mode: str, engines: list[Any], now: float) -> None:
        if live_ctx is None:
            return
        t = Table(title=f"{mode} run, t = {now:5.1f} s")
        for col in ("engine", "running", "waiting", "done", "committed MiB"):
            t.add_column(col, justify="right")
        for eng in engines:
            if isinstance(eng, tuple):  # (index, TenantInfo | None) from the pool ledger
                e, info = eng
                t.add_row(str(e), "-", str(info.waiting if info else 0), "-",
                          f"{(info.committed_bytes if info else 0) / 2**20:.1f}")
            else:  # an Engine or a VirtualEngine of this process
                t.add_row(str(eng.index), str(len(eng.running)), str(eng.waiting), str(len(eng.finished)),
                          f"{eng.m.stats().committed_bytes / 2**20:.1f}")
        live_ctx.update(t)

    pool_mib = args.pool_blocks * COMMIT_BYTES_PER_BLOCK / 2**20
    if virtual:
        from . import _demo_virtual
        clock = ("virtual (engine steps modeled from their batches, not run: "
                 "kvpool/_demo_virtual.py; no figure depends on this machine's load)")
    else:
        clock = (f"real; torch: {TORCH_THREADS} compute thread per engine (more threads collapse when the "
                 "machine is busy: issue 14)")
    if not args.json:
        console.print(f"{args.engines} engines, {len(trace)} requests ({args.trace} trace) over "
                      f"{args.duration:g} s, pool {pool_mib:g} MiB = {args.pool_blocks} blocks "
                      f"({pool_mib / args.engines:.1f} MiB a slice when static); clock: {clock}")
    results: dict[str, dict[str, Any]] = {}
    for mode in ("elastic", "static"):
        if virtual:
            runner = _demo_virtual.run_mode_virtual(mode, args, trace, render)
        elif args.processes:
            runner = run_mode_processes(mode, args, render)
        else:
            assert model is not None
            runner = run_mode(mode, args, trace, model, render)
        if live_ctx is not None:
            with live_ctx:
                results[mode] = await runner
        else:
            results[mode] = await runner
        if not args.json:
            console.print(f"{mode}: {results[mode]['requests']} requests in {results[mode]['elapsed_s']:.1f} s"
                          + (" (virtual)" if virtual else ""))
    served_same = set(results["elastic"]["outputs"]) == set(results["static"]["outputs"]) == {r.rid for r in trace}
    # The virtual clock computes no tokens: nothing to compare, said as None.
    same_tokens = None if virtual else results["elastic"]["outputs"] == results["static"]["outputs"]
    checked = 0 if model is None else min(args.check, len(trace))
    bad = [] if model is None else check_correctness(model, trace, results["elastic"]["outputs"], args.check,
                                                     args.seed)
    plot(results, args.plot, args.engines)
    rat = ratios(results)
    if args.json:
        out = {
            "engines": args.engines, "pool_mib": pool_mib, "pool_blocks": args.pool_blocks, "seed": args.seed,
            "requests": len(trace), "trace": args.trace, "prompt_scale": args.prompt_scale,
            "clock": args.clock, "torch_threads": TORCH_THREADS, "plot": args.plot,
            "ratios_elastic_over_static": rat,
            "correctness": {"checked": checked, "mismatches": bad,
                            "same_requests_served": served_same, "same_tokens_both_modes": same_tokens},
            "elastic": {k: v for k, v in results["elastic"].items() if k != "outputs"},
            "static": {k: v for k, v in results["static"].items() if k != "outputs"},
        }
        if virtual:
            out["step_model"] = _demo_virtual.step_model()
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        console.print(summary_table(results))
        console.print(
            f"elastic / static: throughput {rat['tokens_per_s']:.2f}x, TTFT p50 {rat['ttft_p50']:.2f}x, "
            f"TTFT p99 {rat['ttft_p99']:.2f}x, time waiting for memory {rat['wait']:.2f}x "
            "(below 1 is better for TTFT and waiting)")
        el = results["elastic"]
        console.print(f"preemptions while lending (elastic): {el['preemptions']} requests on "
                      f"{el['preemptions_asked']} verdicts, {el['recomputed_tokens']} tokens prefilled again; "
                      f"memory given back while lending: {el['reclaimed_by_completion_bytes'] / 2**20:.1f} MiB "
                      f"by completion, {el['reclaimed_by_preemption_bytes'] / 2**20:.1f} MiB by preemption")
        if virtual:
            console.print(f"correctness: not checked (the virtual clock computes no tokens); both modes served "
                          f"the same requests: {'yes' if served_same else 'NO'}; plot: {args.plot}")
        else:
            console.print(f"correctness: {checked} sampled requests match a contiguous-KV "
                          f"decode: {'yes' if not bad else 'NO: ' + ', '.join(bad)}; both modes served the same "
                          f"requests: {'yes' if served_same else 'NO'}; plot: {args.plot}")
    if bad or not served_same or same_tokens is False:
        print("kvpool demo: correctness check FAILED", file=sys.stderr)
        return 1
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=int, default=3, help="engines sharing the pool (default 3)")
    p.add_argument("--pool-mib", type=int, default=8, help="pool size in MiB (default 8)")
    p.add_argument("--pool-blocks", type=int, default=None,
                   help="pool size in blocks (of 32 KiB, 8 a page); overrides --pool-mib")
    p.add_argument("--blocks", type=int, default=4096, help="virtual blocks per engine (default 4096)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of request arrivals (default 10)")
    p.add_argument("--burst", type=int, default=DEFAULT_BURST,
                   help=f"requests per burst (default {DEFAULT_BURST}: a load one torch thread per engine keeps up "
                        f"with; {COMPUTE_BOUND_BURST} is compute-bound on a 2-core machine)")
    p.add_argument("--seed", type=int, default=0, help="trace and weights seed")
    p.add_argument("--trace", choices=SHAPES, default="bursty",
                   help="arrival shape: bursty (default), steady, saturated (engine 0 overloaded, others light)")
    p.add_argument("--prompt-scale", type=float, default=1.0,
                   help="stretch prompts (48-160 tokens at 1): a large pool's what-if with long contexts")
    p.add_argument("--clock", choices=("real", "virtual"), default="real",
                   help="real: run the engines; virtual: model their step times on a virtual clock "
                        "(exact, load-independent, fast)")
    p.add_argument("--compute", choices=("shared", "per-engine"), default="shared",
                   help="virtual clock: one device runs one engine step at a time (shared, as the real "
                        "in-process demo's one thread) or every engine has its own (per-engine)")
    p.add_argument("--check", type=int, default=6, help="requests re-decoded with a contiguous cache")
    p.add_argument("--plot", default="kvpool-demo.png", help="where to write the PNG plot")
    p.add_argument("--processes", action="store_true",
                   help="one process per engine, joined only by the pool (default: one process)")
    p.add_argument("--no-live", action="store_true", help="no live progress table")
    p.add_argument("--json", action="store_true", help="print every figure as JSON on stdout")


def options(argv: list[str]) -> argparse.Namespace:
    """The demo's options from ``argv``, derived figures filled in (ValueError if they do not fit)."""
    ap = argparse.ArgumentParser(prog="kvpool demo")
    add_arguments(ap)
    args = ap.parse_args(argv)
    problem = _derive(args)
    if problem:
        raise ValueError(problem)
    return args


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a job ended by Ctrl-C


def run(args: argparse.Namespace) -> int:
    """The demo; Ctrl-C ends it with one line and exit 130 (its pools removed on the way out)."""
    try:
        if args.clock == "virtual":
            from ._demo_clock import run_virtual

            return run_virtual(main_async(args))
        return asyncio.run(main_async(args))
    except KeyboardInterrupt:
        print("kvpool demo: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    # Worker entry of `kvpool demo --processes`: kvpool.demo --worker MODE INDEX POOL [options]
    if len(sys.argv) > 4 and sys.argv[1] == "--worker":
        ap = argparse.ArgumentParser()
        add_arguments(ap)
        wargs = ap.parse_args(sys.argv[5:])
        _derive(wargs)
        try:
            asyncio.run(worker(sys.argv[2], int(sys.argv[3]), sys.argv[4], wargs))
        except KeyboardInterrupt:  # Ctrl-C reaches every worker too: the parent says it, once
            sys.exit(EXIT_INTERRUPTED)
