"""Figure 4 of suite ``native``: what a mirrored space's page map costs.

A mirrored space (``kvpool.ranks``) commits a page by publishing it in its
channel and waiting until every rank's process mapped it. Timed here: one
page's commit (``alloc(1)`` on an empty space) and release (its ``free``)
through 2 rank processes (``python -m kvpool.bench.mirror <handle> <rank>``,
each holding its half of the regions in its own memfd), against the same
geometry's space that commits into its own memfd, interleaved, medians of the
repeats. The rank processes do the syscalls in parallel (each half the
regions), so the ratio is the protocol's cost net of that.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
from typing import Any

from ._lib import KiB, end_child, geo_info
from ._timing import no_gc, time_pair


def bench_mirror(page_iters: int, page_repeats: int) -> dict[str, Any]:
    from kvpool import Geometry, KVSpace

    geo = Geometry(num_layers=4, num_kv_buffers=2, block_bytes=64 * KiB, num_blocks=2048)  # 8 regions
    half = geo.num_regions // 2
    runs: dict[str, list[float]] = {k: [] for k in ("direct_commit", "direct_release", "mirrored_commit",
                                                     "mirrored_release")}
    direct = KVSpace(geo, reserve=(0, 0), reserve_thread=False)
    mirrored = KVSpace(geo, reserve=(0, 0), reserve_thread=False, ranks=[half, half], rank_timeout_s=60)
    handle = json.dumps(dataclasses.asdict(mirrored.rank_handle()))
    ranks = [subprocess.Popen([sys.executable, "-m", "kvpool.bench.mirror", handle, str(r)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        for p in ranks:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"a rank process did not attach: {line!r} (exit {p.poll()})")
        before = mirrored.stats()
        with no_gc():
            for _ in range(page_repeats):  # interleaved: drift hits both alike
                dc, dr = time_pair(lambda: direct.alloc(1), direct.free, page_iters)
                mc, mr = time_pair(lambda: mirrored.alloc(1), mirrored.free, page_iters)
                for k, v in (("direct_commit", dc), ("direct_release", dr), ("mirrored_commit", mc),
                             ("mirrored_release", mr)):
                    runs[k].append(v)
        after = mirrored.stats()
        expected = page_iters * page_repeats
        if (after.inline_commits - before.inline_commits, after.inline_releases - before.inline_releases) != \
                (expected, expected):
            raise RuntimeError("the mirrored space did not commit and release one page per iteration")
    finally:
        for p in ranks:
            end_child(p, timeout=60)
        mirrored.close()
        direct.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"geometry": geo_info(geo), "ranks": 2, "iters": page_iters, "repeats": page_repeats,
            "median_ns": med, "runs_ns": runs, "ratio_commit": med["mirrored_commit"] / med["direct_commit"],
            "ratio_release": med["mirrored_release"] / med["direct_release"]}


def format_lines(mi: dict[str, Any]) -> list[str]:
    g, med = mi["geometry"], mi["median_ns"]
    return [
        "",
        f"4. a mirrored space: one page ({g['num_regions']} regions) committed and released through "
        f"{mi['ranks']} rank processes vs the same space direct, {mi['repeats']} x {mi['iters']} pages",
        f"   {'':<12}{'direct us/page':>16}{'mirrored us/page':>18}{'mirrored/direct':>17}",
        f"   {'commit':<12}{med['direct_commit'] / 1e3:>16.1f}{med['mirrored_commit'] / 1e3:>18.1f}"
        f"{mi['ratio_commit']:>17.3f}",
        f"   {'release':<12}{med['direct_release'] / 1e3:>16.1f}{med['mirrored_release'] / 1e3:>18.1f}"
        f"{mi['ratio_release']:>17.3f}",
    ]


def _rank_main(handle_json: str, rank: int) -> None:
    """A rank's process: attach, say ready, hold the memory until stdin closes."""
    from kvpool import RankHandle, RankMemory

    with RankMemory(RankHandle.from_dict(json.loads(handle_json)), rank, device="cpu"):
        print("ready", flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]))
