"""The virtual-clock demo across seeds and trace shapes: issue 14's acceptance, as a table.

For every shape and seed, runs ``kvpool demo --clock virtual`` in this
process (both modes) and prints, per shape, the worst engine's TTFT p99
ratio and the waiting ratio (elastic / static) over the seeds, and the seeds
that miss the acceptance bar (every engine's p99 <= static, waiting <= 0.5x).
The figures are exact: rerunning gives the same table on any machine.

    python scripts/demo_virtual_sweep.py [--seeds 20] [--json out.jsonl] [demo options...]
"""

from __future__ import annotations

import argparse
import json
import statistics

from kvpool._demo_clock import run_virtual
from kvpool._demo_traces import SHAPES
from kvpool._demo_virtual import compare
from kvpool.demo import options


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--json", help="also write one JSON line per run here")
    args, demo_argv = ap.parse_known_args()
    sink = open(args.json, "w") if args.json else None
    for shape in SHAPES:
        rows = []
        for seed in range(args.seeds):
            res = run_virtual(compare(options(["--clock", "virtual", "--trace", shape, "--seed", str(seed),
                                               *demo_argv])))
            el, st = res["elastic"], res["static"]
            row = {"shape": shape, "seed": seed,
                   "ttft_p99": [a["ttft_p99_s"] / b["ttft_p99_s"] for a, b in zip(el["engines"], st["engines"])],
                   "wait": el["wait_s"] / st["wait_s"] if st["wait_s"] else float("inf"),
                   "tokens_per_s": el["tokens_per_s"] / st["tokens_per_s"]}
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
    if sink is not None:
        sink.close()


if __name__ == "__main__":
    main()
