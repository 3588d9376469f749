"""The virtual-clock demo across seeds and trace shapes: issue 14's acceptance, as a table.

For every shape and seed, runs ``kvpool demo --clock virtual`` in this
process (both modes) and prints, per shape, the worst engine's TTFT p99
ratio and the waiting ratio (elastic / static) over the seeds, and the seeds
that miss the acceptance bar (every engine's p99 <= static, waiting <= 0.5x).
The figures are exact: rerunning gives the same table on any machine.

``--noise`` also runs the static split on the same requests, each arriving up
to 1 ms later (:func:`kvpool.demo.traces.shifted`): how far an engine's TTFT
p99 moves when nothing but the phase of the steps changes, the noise of the
measurement itself. Per burst and shape it prints that envelope (the largest
ratio shifted/static over the seeds and engines) and judges issue 31's p99
bar against it as well as against the literal 1%: with one shared device a
light engine's p99 over its two to six requests is one request's wait for
the step in progress, which a 1 ms shift alone moves by up to 1.3x.

``--reference`` also runs every engine *alone*: each with a pool of the
whole capacity to itself, the most memory any sharing policy could give it,
and prints that reference's waiting ratio to static beside elastic's. Where
even the reference waits more than half as long as static, no policy of the
pool can meet the waiting bar for that shape: the queue is for compute.
Alone, the engines together may hold up to one pool *each*: the script
prints for how much of the run they held more than the one pool a sharing
policy has (``alone_over_pool``, from the alone run's timeline). Where that
share is large, alone's waiting is a bound no policy of one pool can reach,
and issue 31's "<= 0.5x static where alone waits <= 0.25x" is judged a
second time with the 0.5x bar only where alone's engines fitted the pool
for at least 95% of the run.

Each case runs through :mod:`kvpool.demo.sweep`, as ``kvpool demo --sweep``
does (one implementation of a sweep's runs and figures); ``--sweep BURSTS``
among the demo options runs every burst in turn (default: ``--burst``'s one).
``kvpool demo --sweep`` shows one shape and seed per engine; this script
summarises many seeds per shape against the acceptance bars.

    python scripts/demo_virtual_sweep.py [--seeds 20] [--reference] [--noise] [--json out.jsonl] [demo options...]
"""

from __future__ import annotations

import argparse
import json
import statistics

from kvpool.demo.cli import options
from kvpool.demo.common import COMMIT_BYTES_PER_BLOCK
from kvpool.demo.sweep import per_engine, ratio, run_case
from kvpool.demo.traces import SHAPES


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--json", help="also write one JSON line per run here")
    ap.add_argument("--reference", action="store_true",
                    help="also run every engine alone with the whole pool (the best any policy could give it)")
    ap.add_argument("--noise", action="store_true",
                    help="also run static on the same requests shifted by up to 1 ms (the measurement's own noise)")
    args, demo_argv = ap.parse_known_args()
    sink = open(args.json, "w") if args.json else None
    modes = ("elastic", "static", *(("alone",) if args.reference else ()), *(("shifted",) if args.noise else ()))
    base = options(["--clock", "virtual", *demo_argv])
    bursts = base.sweep or (base.burst,)
    for burst, shape in ((b, s) for b in bursts for s in SHAPES):
        if len(bursts) > 1 and shape == SHAPES[0]:
            print(f"{burst} a burst:")
        rows = []
        for seed in range(args.seeds):
            opts = options(["--clock", "virtual", "--trace", shape, "--seed", str(seed), *demo_argv])
            res = run_case(opts, burst, modes)
            el, st = res["elastic"], res["static"]
            figures = per_engine(res)
            row = {"burst": burst, "shape": shape, "seed": seed,
                   "ttft_p99": [ratio(f["ttft_p99_s"]["elastic"], f["ttft_p99_s"]["static"]) for f in figures[:-1]],
                   "wait": ratio(el["wait_s"], st["wait_s"]),
                   "tokens_per_s": el["tokens_per_s"] / st["tokens_per_s"],
                   "preemptions": el["preemptions"],
                   "recomputed": figures[-1]["recomputed_share"]}
            if args.noise:
                row["noise_ttft_p99"] = [ratio(a["ttft_p99_s"], b["ttft_p99_s"])
                                         for a, b in zip(res["shifted"]["engines"], st["engines"])]
            if args.reference:
                alone = res["alone"]
                row["alone_wait"] = ratio(alone["wait_s"], st["wait_s"])
                row["alone_ttft_p99"] = [a["ttft_p99_s"] / b["ttft_p99_s"]
                                         for a, b in zip(alone["engines"], st["engines"])]
                row["alone_over_pool"] = over_pool(alone["timeline"], opts.pool_blocks * COMMIT_BYTES_PER_BLOCK)
            rows.append(row)
            if sink is not None:
                print(json.dumps(row), file=sink, flush=True)
        worst = [max(r["ttft_p99"]) for r in rows]
        wait = [r["wait"] for r in rows]
        miss = [r["seed"] for r in rows if max(r["ttft_p99"]) > 1 or r["wait"] > 0.5]
        print(f"{shape:9}  worst engine's TTFT p99 ratio min {min(worst):.2f} median {statistics.median(worst):.2f} "
              f"max {max(worst):.2f}; waiting ratio min {min(wait):.2f} median {statistics.median(wait):.2f} "
              f"max {max(wait):.2f}; throughput median {statistics.median(r['tokens_per_s'] for r in rows):.2f}; "
              f"seeds missing the bar: {miss if miss else 'none'}")
        rec = [r["recomputed"] for r in rows]
        print(f"{'':9}  preemptions median {statistics.median(r['preemptions'] for r in rows)} max "
              f"{max(r['preemptions'] for r in rows)}; tokens recomputed / served max {max(rec):.2%}")
        noise = 1.01
        if args.noise:
            worst_noise = max(max(r["noise_ttft_p99"]) for r in rows)
            noise = max(1.01, worst_noise)
            print(f"{'':9}  noise: static on the requests shifted by up to 1 ms / static, worst engine's TTFT p99 "
                  f"max {worst_noise:.2f}, over 1.01 in "
                  f"{sum(max(r['noise_ttft_p99']) > 1.01 for r in rows)} of {len(rows)} seeds")
        if args.reference:
            # Issue 31's bar: p99 <= 1.01x static, recompute <= 2%, waiting <= 0.5x where the
            # engines alone with the whole pool wait <= 0.25x static, else <= 1.0x.
            def misses(p99_bar: float, fits: float = 0.0) -> list[int]:
                # fits: the 0.5x waiting bar applies only where alone's engines together held
                # more than the pool for at most this share of the run (0: the literal bar).
                return [r["seed"] for r in rows if max(r["ttft_p99"]) > p99_bar or r["recomputed"] > 0.02
                        or r["wait"] > (0.5 if r["alone_wait"] <= 0.25 and (not fits or r["alone_over_pool"] <= fits)
                                        else 1.0)]

            print(f"{'':9}  issue 31's bar: seeds missing it: {misses(1.01) or 'none'}")
            if args.noise:
                print(f"{'':9}  the same with the p99 bar at the noise ({noise:.2f}x): seeds missing it: "
                      f"{misses(noise) or 'none'}")
            over = [r["alone_over_pool"] for r in rows]
            print(f"{'':9}  alone, the engines together held more than one pool for {min(over):.0%}-{max(over):.0%} "
                  f"of the run; with the 0.5x waiting bar only where they fitted it 95% of the time"
                  f"{' and the p99 bar at the noise' if args.noise else ''}: seeds missing it: "
                  f"{misses(noise, 0.05) or 'none'}")
            alone = [r["alone_wait"] for r in rows]
            print(f"{'':9}  alone (each engine with the whole pool): waiting ratio min {min(alone):.2f} "
                  f"median {statistics.median(alone):.2f} max {max(alone):.2f}; seeds where even it waits more "
                  f"than 0.5x static: {[r['seed'] for r in rows if r['alone_wait'] > 0.5] or 'none'}")
    if sink is not None:
        sink.close()


def over_pool(timeline: list[dict[str, float]], pool_bytes: int) -> float:
    """The share of a run's samples in which its engines together held more than ``pool_bytes``."""
    held = [sum(v for k, v in row.items() if k.startswith("engine-")) for row in timeline]
    return sum(h > pool_bytes for h in held) / len(held) if held else 0.0


if __name__ == "__main__":
    main()
