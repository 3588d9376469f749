"""``kvpool demo``'s command line: its options, both modes in turn, the live table and the summary.

The same trace is served twice: once elastic (the engines share the pool)
and once static, with every engine capped at an equal slice of the same pool
(``set_limit(pool / engines)``): the split engines use today. The summary
compares the two runs; each ratio is elastic / static. ``--clock real`` runs
the engines (:mod:`kvpool.demo.realtime`); ``--clock virtual`` runs the same
managers and pool with modeled step times on a virtual clock
(:mod:`kvpool.demo.virtual`): exact figures, independent of machine load.
``--trace`` picks the arrival shape (:mod:`kvpool.demo.traces`).

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

Why 10 stays the default (issue 31, item 5; measured 2026-12-07 on the
virtual clock, 3 shapes x 20 seeds, ``--compute shared`` as a real-time run
on one machine is, and ``per-engine``): memory already matters at 10. A
static slice makes a bursty trace's request wait 0.12-0.29 s on average
where sharing makes it wait at most 8 ms (TTFT p99 0.5-1.1 s against
0.01-0.09 s), and sharing wins every engine's TTFT p99 in all 40 bursty
runs. A larger default would show the slices waiting longer (12 a burst:
0.23-0.76 s a request) but, with one shared compute, sharing loses some
engine's p99 in more runs: 27 of 60 at 10 (steady and saturated shapes), 37
of 60 at 12, 48 of 60 at 16 (per engine compute: none at any of them).
``--sweep`` shows 10, 16 and 24 side by side (:mod:`kvpool.demo.sweep`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import torch

from .clock import run_virtual
from .common import COMMIT_BYTES_PER_BLOCK, PAGE_BYTES
from .model import BLOCK_BYTES, ContiguousKV, TinyDecoder, greedy
from .realtime import TORCH_THREADS, check_correctness, run_mode, run_mode_processes
from .report import ReportConsole, plot, summary_table, sweep_table
from .sweep import DEFAULT_SWEEP, parse_bursts, sweep
from .traces import SHAPES, make_trace
from .virtual import blocks_per_page, run_mode_virtual, step_model

DEFAULT_BURST = 10  # requests per burst: compute keeps up, a static slice already waits (module docstring)
COMPUTE_BOUND_BURST = 24  # the former default: compute-bound here, whatever the memory policy
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a job ended by Ctrl-C


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


def derive(args: argparse.Namespace) -> str:
    """Fill in the figures derived from the options; return what is wrong with them ("" if nothing)."""
    if args.pool_blocks is None:
        args.pool_blocks = (args.pool_mib << 20) // COMMIT_BYTES_PER_BLOCK
    if args.engines < 1 or args.pool_blocks < 1 or args.pool_mib < 1 or args.duration <= 0 or args.burst < 1:
        return "--engines, --pool-mib, --pool-blocks and --burst must be >= 1, --duration > 0"
    if not args.prompt_scale > 0:
        return f"--prompt-scale must be > 0, got {args.prompt_scale}"
    if isinstance(args.sweep, str):
        try:
            args.sweep = parse_bursts(args.sweep)
        except ValueError as e:
            return str(e)
    if args.sweep:
        if args.clock == "real" or args.processes:
            return "--sweep runs on the virtual clock, in this process: drop --clock real and --processes"
        args.clock = "virtual"
    elif args.clock is None:
        args.clock = "real"
    if args.clock == "virtual" and args.processes:
        return "--clock virtual runs every engine in this process: drop --processes"
    return ""


def _too_big(args: argparse.Namespace, trace: list[Any]) -> str:
    """What is wrong if the trace's largest request does not fit a static slice ("" if it fits)."""
    biggest = max(r.blocks for r in trace)
    if biggest <= _slice_blocks(args):
        return ""
    return (f"the largest request needs {biggest} blocks but a static slice holds {_slice_blocks(args)} "
            f"(pool {args.pool_blocks} blocks / {args.engines} engines): use a larger --pool-mib/--pool-blocks, "
            "fewer --engines or a smaller --prompt-scale")


def _slice_blocks(args: argparse.Namespace) -> int:
    """Blocks a static slice can hold: whole pages only, as the limit counts them."""
    if args.clock == "virtual":
        per_page = blocks_per_page(args.pool_blocks)
    else:
        per_page = PAGE_BYTES // BLOCK_BYTES
    return int(args.pool_blocks // (args.engines * per_page) * per_page)


async def main_async(args: argparse.Namespace) -> int:
    from rich.live import Live
    from rich.table import Table

    console = ReportConsole(stderr=args.json)  # highlighting off: "0.40x" stays one colour
    problem = derive(args)
    if problem:
        print(f"kvpool demo: {problem}", file=sys.stderr)
        return 2
    virtual = args.clock == "virtual"
    torch.set_num_threads(TORCH_THREADS)
    trace = make_trace(args.engines, args.duration, args.burst, args.seed, args.trace, args.prompt_scale)
    problem = _too_big(args, trace)
    if problem:
        print(f"kvpool demo: {problem}", file=sys.stderr)
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
        clock = ("virtual (engine steps modeled from their batches, not run: "
                 "kvpool.demo.virtual; no figure depends on this machine's load)")
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
            runner = run_mode_virtual(mode, args, trace, render)
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
            out["step_model"] = step_model()
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
                        "with and where memory already matters: on the virtual clock a static slice makes a bursty "
                        "trace's request wait 0.12-0.29 s on average, sharing at most 0.008 s, and sharing wins every "
                        "engine's TTFT p99 in all 40 bursty runs measured; above 10, with one shared compute, "
                        "sharing loses some engine's p99 in more runs: 37 of 60 at 12, 48 of 60 at 16, against 27 "
                        f"of 60 at 10; {COMPUTE_BOUND_BURST} is compute-bound on a 2-core machine; see --sweep)")
    p.add_argument("--seed", type=int, default=0, help="trace and weights seed")
    p.add_argument("--trace", choices=SHAPES, default="bursty",
                   help="arrival shape: bursty (default), steady, saturated (engine 0 overloaded, others light)")
    p.add_argument("--prompt-scale", type=float, default=1.0,
                   help="stretch prompts (48-160 tokens at 1): a large pool's what-if with long contexts")
    p.add_argument("--clock", choices=("real", "virtual"), default=None,
                   help="real (the default): run the engines; virtual: model their step times on a virtual "
                        "clock (exact, load-independent, fast; the default with --sweep)")
    p.add_argument("--compute", choices=("shared", "per-engine"), default="shared",
                   help="virtual clock: one device runs one engine step at a time (shared, as the real "
                        "in-process demo's one thread) or every engine has its own (per-engine)")
    p.add_argument("--check", type=int, default=6, help="requests re-decoded with a contiguous cache")
    p.add_argument("--plot", default="kvpool-demo.png", help="where to write the PNG plot")
    p.add_argument("--processes", action="store_true",
                   help="one process per engine, joined only by the pool (default: one process)")
    p.add_argument("--no-live", action="store_true", help="no live progress table")
    p.add_argument("--json", action="store_true", help="print every figure as JSON on stdout")
    p.add_argument("--sweep", nargs="?", const=",".join(map(str, DEFAULT_SWEEP)), default=None, metavar="BURSTS",
                   help="run the demo at each of these bursts (default "
                        f"{','.join(map(str, DEFAULT_SWEEP))}) on the virtual clock, both modes, and print one "
                        "table of them side by side (per engine: TTFT p99, waiting, preemptions, recompute, "
                        "static's mean wait); --trace, --seed, --compute and the pool options apply to each")


def options(argv: list[str]) -> argparse.Namespace:
    """The demo's options from ``argv``, derived figures filled in (ValueError if they do not fit)."""
    ap = argparse.ArgumentParser(prog="kvpool demo")
    add_arguments(ap)
    args = ap.parse_args(argv)
    problem = derive(args)
    if problem:
        raise ValueError(problem)
    return args


def run_sweep(args: argparse.Namespace) -> int:
    """``--sweep``: the demo at each burst on the virtual clock, one table (or ``--json``) for them all."""
    for burst in args.sweep:
        problem = _too_big(args, make_trace(args.engines, args.duration, burst, args.seed, args.trace,
                                            args.prompt_scale))
        if problem:
            print(f"kvpool demo: at {burst} a burst {problem}", file=sys.stderr)
            return 2
    console = ReportConsole(stderr=args.json)
    pool_mib = args.pool_blocks * COMMIT_BYTES_PER_BLOCK / 2**20
    if not args.json:
        console.print(f"{args.engines} engines, {args.trace} trace over {args.duration:g} s, seed {args.seed}, "
                      f"{args.compute} compute;\npool {pool_mib:g} MiB ({pool_mib / args.engines:.1f} MiB a "
                      f"static slice); virtual clock; bursts {', '.join(map(str, args.sweep))}")
    runs = sweep(args, args.sweep)
    if args.json:
        json.dump({"engines": args.engines, "pool_mib": pool_mib, "pool_blocks": args.pool_blocks,
                   "seed": args.seed, "trace": args.trace, "duration": args.duration,
                   "prompt_scale": args.prompt_scale, "clock": "virtual", "compute": args.compute,
                   "sweep": list(args.sweep), "step_model": step_model(), "runs": runs}, sys.stdout, indent=1)
        print()
    else:
        console.print(sweep_table(runs))
        console.print("p99: TTFT p99 (s); wait: time waiting for memory (s, all requests summed);\n"
                      "preempt, recomp: elastic's preemptions, tokens recomputed (% of those served);\n"
                      "static ms/req: a static slice's mean wait a request (where memory matters)")
    if not all(r["same_requests_served"] for r in runs):
        print("kvpool demo: correctness check FAILED (the two modes served different requests)", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    """The demo; Ctrl-C ends it with one line and exit 130 (its pools removed on the way out)."""
    problem = derive(args)
    if problem:
        print(f"kvpool demo: {problem}", file=sys.stderr)
        return 2
    try:
        if args.sweep:
            return run_sweep(args)
        if args.clock == "virtual":
            return run_virtual(main_async(args))
        return asyncio.run(main_async(args))
    except KeyboardInterrupt:
        print("kvpool demo: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED

