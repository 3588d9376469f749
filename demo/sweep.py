"""``kvpool demo --sweep``: one trace shape at several loads, side by side, on the virtual clock.

Each burst (requests a burst, ``--burst``) is one run of the demo: both
modes, elastic and static, on the same trace, with every other option as
given. Per burst and engine the sweep reports what tells whether memory
matters at that load and whether sharing helps there: TTFT p99 and time
waiting for memory, elastic and static; the elastic engine's preemptions and
its tokens recomputed (a share of the tokens it served); and static's own
mean wait per request, the figure that says whether a static slice runs
short at all. Where static barely waits, no memory policy has anything to
win; where both modes wait alike, the queue is for compute.

Only the virtual clock: the figures are exact (the same on any machine, at
any load), so the bursts compare with each other, and a sweep of three
bursts takes seconds instead of minutes.

``scripts/demo_virtual_sweep.py`` (seeds x shapes, issue 31's acceptance
bars) runs its cases through :func:`run_case` and :func:`per_engine` too:
one implementation of a sweep's run and its figures.
"""

from __future__ import annotations

import argparse
from typing import Any

from .clock import run_virtual
from .virtual import compare

DEFAULT_SWEEP = (10, 16, 24)  # issue 31: the default load, the middle, the former compute-bound default


def parse_bursts(text: str) -> tuple[int, ...]:
    """``"10,16,24"`` -> (10, 16, 24); ValueError naming what is wrong (kept in order, no repeats)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        bursts = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--sweep takes requests a burst as integers separated by commas (e.g. 10,16,24), "
                         f"got {text!r}") from None
    if not bursts or any(b < 1 for b in bursts):
        raise ValueError(f"--sweep: every burst must be >= 1, got {text!r}")
    if len(set(bursts)) != len(bursts):
        raise ValueError(f"--sweep: a burst is given twice in {text!r}")
    return bursts


def run_case(args: argparse.Namespace, burst: int,
             modes: tuple[str, ...] = ("elastic", "static")) -> dict[str, dict[str, Any]]:
    """``modes`` of the demo with ``args`` (derived: :func:`kvpool.demo.cli.options`) at ``burst``,
    on the virtual clock; ``alone`` is :func:`kvpool.demo.virtual.run_mode_virtual`'s reference."""
    opts = argparse.Namespace(**vars(args))
    opts.burst = burst
    return run_virtual(compare(opts, modes))


def ratio(a: float, b: float) -> float:
    """a / b; 0 when both are 0 (nobody waited in either: any bar on the ratio is met)."""
    return a / b if b else (0.0 if not a else float("inf"))


def per_engine(res: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One run's figures, per engine and then ``all`` (the whole run): elastic and static side by side."""
    el, st = res["elastic"], res["static"]
    rows = []
    for e, s in [*zip(el["engines"], st["engines"]), (el, st)]:
        rows.append({
            "engine": e.get("engine", "all"),
            "ttft_p99_s": {"elastic": e["ttft_p99_s"], "static": s["ttft_p99_s"]},
            "wait_s": {"elastic": e["wait_s"], "static": s["wait_s"]},
            "preemptions": e["preemptions"],
            "recomputed_tokens": e["recomputed_tokens"],
            "tokens": e["tokens"],
            "recomputed_share": e["recomputed_tokens"] / e["tokens"] if e["tokens"] else 0.0,
            # What a static slice makes a request wait on average: where memory matters.
            "static_mean_wait_s": s["wait_s"] / s["requests"] if s["requests"] else 0.0,
        })
    return rows


def sweep(args: argparse.Namespace, bursts: tuple[int, ...]) -> list[dict[str, Any]]:
    """Every burst of the sweep: its figures (:func:`per_engine`) and both modes' summaries (no timelines)."""
    runs = []
    for burst in bursts:
        res = run_case(args, burst)
        served = set(res["elastic"]["outputs"]) == set(res["static"]["outputs"])
        runs.append({
            "burst": burst, "requests": res["elastic"]["requests"], "same_requests_served": served,
            "engines": per_engine(res),
            **{mode: {k: v for k, v in res[mode].items() if k not in ("outputs", "timeline")}
               for mode in ("elastic", "static")},
        })
    return runs
