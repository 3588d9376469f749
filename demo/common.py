"""What the demo's two clocks share: the pool's cost of a block, each engine's headroom, a mode's figures.

The real engines (:mod:`kvpool.demo.realtime`) and the modeled ones
(:mod:`kvpool.demo.virtual`) size the same pool, ask for the same headroom
and report a mode in the same shape, so their tables compare directly. Both
import this module; it imports neither (no import cycle in the package).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from kvpool import Geometry

from .model import BLOCK_BYTES, LAYERS
from .traces import max_request_blocks

PAGE_BYTES = 64 * 1024  # the real engines' page: 8 blocks of 8 KiB a layer
COMMIT_BYTES_PER_BLOCK = BLOCK_BYTES * LAYERS * 2  # what one block costs the pool (every region)


def headroom_bytes(geometry: Geometry, prompt_scale: float) -> int:
    """What each engine asks borrowers to keep free: the pages of its largest request.

    ARCHITECTURE.md, "Fair share", rule 6: with it an engine's next
    admission is granted at once instead of waiting for a borrower's step.
    """
    per_page = geometry.page_bytes // geometry.region_block_bytes
    return -(-max_request_blocks(prompt_scale) // per_page) * geometry.page_commit_bytes


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile of xs, nearest rank (0.0 for none)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def summarize(mode: str, args: argparse.Namespace, elapsed: float, timeline: list[dict[str, Any]],
              raw: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's figures from each engine's raw results (same shape in- or cross-process, either clock)."""
    pool_bytes = args.pool_blocks * COMMIT_BYTES_PER_BLOCK
    per_engine = [{
        "engine": r["engine"], "requests": r["requests"], "tokens": r["tokens"],
        "tokens_per_s": r["tokens"] / elapsed, "ttft_p50_s": pct(r["ttft"], 50),
        "ttft_p99_s": pct(r["ttft"], 99), "wait_s": r["wait_s"],
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
        "ttft_p50_s": pct(all_ttft, 50), "ttft_p99_s": pct(all_ttft, 99),
        "wait_s": sum(p["wait_s"] for p in per_engine),
        "preemptions": sum(p["preemptions"] for p in per_engine),
        "preempted_wait_s": sum(p["preempted_wait_s"] for p in per_engine),
        "recomputed_tokens": sum(p["recomputed_tokens"] for p in per_engine),
        "preemptions_asked": sum(p["preemptions_asked"] for p in per_engine),
        "reclaimed_by_completion_bytes": sum(p["reclaimed_by_completion_bytes"] for p in per_engine),
        "reclaimed_by_preemption_bytes": sum(p["reclaimed_by_preemption_bytes"] for p in per_engine),
        # Waits a shared device made an engine ask for at once (kvpool.demo.sched, issue 31).
        "waits_escalated": sum(p["waits_escalated"] for p in per_engine),
        "engines": per_engine, "timeline": timeline,
        "outputs": {rid: out for r in raw for rid, out in r["outputs"].items()},
    }


async def stop_monitor(mon: asyncio.Task[None]) -> None:
    """End a run's monitor task (its timeline is complete once the engines are done)."""
    mon.cancel()
    try:
        await mon
    except asyncio.CancelledError:
        pass
