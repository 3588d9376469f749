"""Suite ``native``: the native core (CPU memfd backend) and its Python faces, one run, one machine.

Every figure is printed next to a baseline measured in the same run; where
figures are compared, their repeats are interleaved (A B, A B, ...) so that a
load change on a shared machine hits both alike, and each figure is the median
of its repeats (every raw repeat is in the JSON).

Figures
-------
0. **Hot path** (``hot_path``, issue 12's goals), n = 1, 16, 256, on a
   4 layers x K/V space of 64 KiB blocks, 2 MiB pages, 4096 blocks:

   - baseline: a pure-Python free list, ``collections.deque`` of 4096 ids,
     round trip = ``ids = [popleft() for _ in range(n)]``, ``extend(ids)``;
   - ``KVSpace`` ``free(alloc(n))`` (``reserve=(0, big)``, no reserve
     thread: pages stay committed, checked), as a ratio to the deque; goals
     <= 2.0x at n = 1, <= 1.0x at n = 16, <= 0.25x at n = 256;
   - ``KVCacheManager.alloc_nowait`` + ``free`` (``pool=None``, the same
     reserve) against its own space's ``alloc`` + ``free``; goal <= 1.2x;
   - ``free(await alloc(n))`` granted at once (one task, nobody waiting)
     against ``alloc_nowait`` + ``free``; goal <= 1.5x.

   All four bodies of one n run in one event loop, their repeats interleaved.
   Then the **steady loop**: a default ``KVSpace`` (its reserve thread on,
   ``reserve=(1, 2)``, ``idle_release_s=1.0``) does ``free(alloc(n))`` for a
   warm-up, settles, then loops again; the page commits and releases counted
   through ``stats()`` over the second loop must be 0 (goal), also at
   n = 1024 (32 pages, far above the reserve's max of 2).

1. **Round trip vs the floor** (``roundtrip``): the ``KVSpace`` round trip as
   a ratio to two ``available()`` calls (the cheapest native calls: the cost
   of crossing Python -> native twice), and per block as a ratio to n = 1.

2. **Commit / release per page** (``page``): with ``reserve=(0, 0)`` and no
   reserve thread, ``alloc(1)`` on an empty space commits one page inline
   (``fallocate`` in each of the R = 8 regions of the memfd) and its free
   releases it (``FALLOC_FL_PUNCH_HOLE``). Baseline: the same syscalls through
   ctypes on an ``os.memfd_create`` file of the same layout, interleaved.
   First-touch faults are in neither.

3. **Alloc cost vs space size** (``scale``): 1K, 64K and 1M blocks (4 KiB
   blocks, 64 KiB pages, one region); every block allocated, a random half
   freed (every page committed and partially used), then ``alloc(16)`` +
   ``free`` timed; ratio to the 1K space. The 1M space commits ~4 GiB while
   it exists.

4. **A mirrored space** (``mirror``, :mod:`.mirror`): one page's commit and
   release through 2 rank processes against the same space direct.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import os
import statistics
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ._lib import BIG_RESERVE, Goal, KiB, MiB, fmt, geo_info, machine_line, no_page_syscalls, ratio, si, verdict
from .mirror import bench_mirror
from .mirror import format_lines as mirror_lines
from ._timing import (
    SyncBody,
    ainterleaved_ns,
    as_async,
    awaited_roundtrip_loop,
    interleaved_ns,
    no_gc,
    roundtrip_loop,
    time_pair,
)

TITLE = "native core and its Python faces"
FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2
HOT_SIZES = (1, 16, 256)
STEADY_SIZES = (1, 16, 256, 1024)
SPACE_GOALS = {1: 2.0, 16: 1.0, 256: 0.25}  # KVSpace round trip / deque round trip
MANAGER_GOAL = 1.2  # alloc_nowait + free / KVSpace alloc + free
AWAIT_GOAL = 1.5  # await alloc + free / alloc_nowait + free


@dataclass(frozen=True)
class Settings:
    repeats: int
    target_s: float  # wall time of one timed repeat
    steady_iters: int  # round trips of the steady loop (warm-up and counted, each)
    page_iters: int  # commits/releases per repeat (figure 2)
    page_repeats: int
    scale_sizes: tuple[int, ...]


FULL = Settings(repeats=7, target_s=0.2, steady_iters=20000, page_iters=40, page_repeats=7,
                scale_sizes=(1 << 10, 1 << 16, 1 << 20))
QUICK = Settings(repeats=3, target_s=0.03, steady_iters=2000, page_iters=8, page_repeats=3,
                 scale_sizes=(1 << 10, 1 << 14, 1 << 16))


def _geometry() -> Any:
    from kvpool import Geometry

    return Geometry(num_layers=4, num_kv_buffers=2, block_bytes=64 * KiB, num_blocks=4096)


# ------------------------------------------------------- figure 0: hot path

SHORT = {"deque": "deque", "space": "KVSpace", "nowait": "alloc_nowait", "await": "await alloc"}
ROWS = {  # row -> (label, baseline row)
    "deque": ("pure-Python deque free list (popleft n, extend)", None),
    "space": ("KVSpace alloc + free", "deque"),
    "nowait": ("KVCacheManager.alloc_nowait + free", "space"),
    "await": ("await alloc (granted at once) + free", "nowait"),
}


def _deque_loop(blocks: int, n: int) -> SyncBody:
    dq: deque[int] = deque(range(blocks))

    def body(iters: int) -> None:
        popleft, extend, r = dq.popleft, dq.extend, range(n)
        for _ in range(iters):
            ids = [popleft() for _ in r]
            extend(ids)

    return body


async def _hot_timings(s: Settings) -> dict[str, Any]:
    from kvpool import KVCacheManager

    geo = _geometry()
    m = KVCacheManager(geo, pool=None, name="bench-hot-path", reserve=(0, BIG_RESERVE), reserve_thread=False)
    out: dict[str, Any] = {}
    try:
        space = m.space
        m.free(m.alloc_nowait(geo.capacity))  # commit every page once; they stay committed
        for n in HOT_SIZES:
            bodies = {
                "deque": as_async(_deque_loop(geo.capacity, n)),
                "space": as_async(roundtrip_loop(space.alloc, space.free, n)),
                "nowait": as_async(roundtrip_loop(m.alloc_nowait, m.free, n)),
                "await": awaited_roundtrip_loop(m.alloc, m.free, n),
            }
            with no_page_syscalls(m, f"hot path n={n}"):
                out[str(n)] = await ainterleaved_ns(bodies, s.repeats, s.target_s)
        st = m.stats()
        if st.waiting or st.used_blocks or st.granted_after_wait:
            raise RuntimeError(f"the hot path was not uncontended: {st}")
    finally:
        await m.aclose()
    return out


def _steady_loop(s: Settings) -> dict[str, Any]:
    from kvpool import KVSpace

    geo = _geometry()
    out: dict[str, Any] = {}
    with KVSpace(geo) as space:  # the defaults: reserve thread on, reserve (1, 2), idle_release_s 1.0
        for n in STEADY_SIZES:
            body = roundtrip_loop(space.alloc, space.free, n)
            body(s.steady_iters)  # warm-up: the pages this n needs get committed
            space.settle()
            before = space.stats()
            t0 = time.perf_counter()
            body(s.steady_iters)
            loop_s = time.perf_counter() - t0
            after = space.stats()
            out[str(n)] = {"iters": s.steady_iters, "loop_s": loop_s,
                           "commits": after.commits - before.commits, "releases": after.releases - before.releases,
                           "inline_commits": after.inline_commits - before.inline_commits,
                           "inline_releases": after.inline_releases - before.inline_releases,
                           "pages_committed_after": after.committed_bytes // geo.page_commit_bytes}
        out["settings"] = {"reserve": "(1, 2) (default)", "reserve_thread": True, "idle_release_s": 1.0}
    return out


def bench_hot_path(s: Settings) -> dict[str, Any]:
    timings = asyncio.run(_hot_timings(s))
    steady = _steady_loop(s)
    rows: list[dict[str, Any]] = []
    goals: list[Goal] = []
    for key, (label, base) in ROWS.items():
        for n in HOT_SIZES:
            t = timings[str(n)]
            row: dict[str, Any] = {"row": key, "figure": label, "n": n, "ns": t[key]["median_ns"]}
            if base is not None:
                row.update(baseline=ROWS[base][0], baseline_ns=t[base]["median_ns"],
                           ratio=ratio(t[key]["median_ns"], t[base]["median_ns"]))
                limit = SPACE_GOALS[n] if key == "space" else MANAGER_GOAL if key == "nowait" else AWAIT_GOAL
                g = Goal(f"{SHORT[key]} / {SHORT[base]}, n = {n}", row["ratio"], limit)
                row.update(goal=f"<= {limit:g}", met=g.met)
                goals.append(g)
            rows.append(row)
    for n in STEADY_SIZES:
        c = steady[str(n)]
        ops = c["commits"] + c["releases"]
        g = Goal(f"steady loop page ops, n = {n}", ops, 0)
        goals.append(g)
        rows.append({"row": "steady", "figure": "steady loop, default KVSpace: page commits + releases after warm-up",
                     "n": n, "ns": None, "value": ops, "goal": "<= 0", "met": g.met})
    return {"geometry": geo_info(_geometry()), "sizes": list(HOT_SIZES), "timings": timings, "steady": steady,
            "rows": rows, "goals": [g.as_json() for g in goals]}


# ------------------------------------------------- figure 1: vs the floor


def bench_roundtrip(s: Settings) -> dict[str, Any]:
    from kvpool import KVSpace

    geo = _geometry()
    with KVSpace(geo, reserve=(0, BIG_RESERVE), reserve_thread=False) as space:
        space.free(space.alloc(geo.capacity))  # commit the pages once; they stay committed

        def floor(iters: int) -> None:
            available = space.available
            for _ in range(iters):
                available()
                available()

        bodies = {"floor": floor, **{str(n): roundtrip_loop(space.alloc, space.free, n) for n in HOT_SIZES}}
        with no_page_syscalls(space, "round trip"):
            t = interleaved_ns(bodies, s.repeats, s.target_s)
    out: dict[str, Any] = {"geometry": geo_info(geo), "floor": t["floor"], "cases": {}}
    for n in HOT_SIZES:
        c = {**t[str(n)], "n": n, "per_block_ns": t[str(n)]["median_ns"] / n}
        c["ratio_to_floor"] = c["median_ns"] / t["floor"]["median_ns"]
        c["per_block_ratio_to_n1"] = c["per_block_ns"] / t["1"]["median_ns"]
        out["cases"][str(n)] = c
    return out


# ---------------------------------------------- figure 2: commit/release


class RawMemfd:
    """A memfd laid out like a KV space's regions, driven by raw ``fallocate`` calls."""

    def __init__(self, geo: Any) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._fallocate = libc.fallocate
        self._fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        self._fallocate.restype = ctypes.c_int
        self.page_bytes, self.region_bytes, self.regions = geo.page_bytes, geo.region_bytes, geo.num_regions
        self.fd = os.memfd_create("kvpool-bench-raw", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.regions * self.region_bytes)

    def offsets(self, page: int) -> list[int]:
        return [r * self.region_bytes + page * self.page_bytes for r in range(self.regions)]

    def call(self, mode: int, offsets: list[int]) -> None:
        fallocate, fd, length = self._fallocate, self.fd, self.page_bytes
        for off in offsets:
            if fallocate(fd, mode, off, length) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"fallocate(mode={mode}, off={off}): {os.strerror(err)}")

    def allocated_bytes(self) -> int:
        return os.fstat(self.fd).st_blocks * 512

    def close(self) -> None:
        os.close(self.fd)


def bench_page(s: Settings) -> dict[str, Any]:
    from kvpool import Geometry, KVSpace

    geo = Geometry(num_layers=4, num_kv_buffers=2, block_bytes=64 * KiB, num_blocks=2048)
    raw = RawMemfd(geo)
    runs: dict[str, list[float]] = {k: [] for k in ("kvpool_commit", "kvpool_release", "raw_commit", "raw_release")}
    try:
        with KVSpace(geo, reserve=(0, 0), reserve_thread=False) as space:
            # Sanity, untimed: one alloc(1) = one page committed, its free = one released.
            ids = space.alloc(1)
            page = geo.page_of(int(ids[0]))
            assert page is not None
            if space.allocated_bytes() != geo.page_commit_bytes:
                raise RuntimeError(f"alloc(1) holds {space.allocated_bytes()} bytes, "
                                   f"expected one page commit of {geo.page_commit_bytes}")
            space.free(ids)
            if space.allocated_bytes() != 0:
                raise RuntimeError("free did not release the page")
            offsets = raw.offsets(page)
            raw.call(0, offsets)
            if raw.allocated_bytes() != geo.page_commit_bytes:
                raise RuntimeError(f"raw commit holds {raw.allocated_bytes()} bytes")
            raw.call(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offsets)

            before = space.stats()
            with no_gc():
                for _ in range(s.page_repeats):  # interleaved: drift hits both alike
                    rc, rr = time_pair(lambda: raw.call(0, offsets),
                                        lambda _: raw.call(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offsets),
                                        s.page_iters)
                    kc, kr = time_pair(lambda: space.alloc(1), space.free, s.page_iters)
                    for k, v in (("raw_commit", rc), ("raw_release", rr), ("kvpool_commit", kc),
                                 ("kvpool_release", kr)):
                        runs[k].append(v)
            after = space.stats()
            expected = s.page_repeats * s.page_iters
            commits = after.inline_commits - before.inline_commits
            releases = after.inline_releases - before.inline_releases
            if commits != expected or releases != expected:
                raise RuntimeError(f"expected {expected} inline commits/releases, got {commits}/{releases}")
    finally:
        raw.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"geometry": geo_info(geo), "page": page, "iters": s.page_iters, "repeats": s.page_repeats,
            "median_ns": med, "runs_ns": runs, "ratio_commit": med["kvpool_commit"] / med["raw_commit"],
            "ratio_release": med["kvpool_release"] / med["raw_release"]}


# ------------------------------------------------- figure 3: space size


def bench_scale(s: Settings, seed: int = 0) -> dict[str, Any]:
    import numpy as np

    from kvpool import Geometry, KVSpace

    n = 16
    cases: dict[str, Any] = {}
    for num_blocks in s.scale_sizes:
        geo = Geometry(num_layers=1, num_kv_buffers=1, block_bytes=4 * KiB, num_blocks=num_blocks,
                       page_bytes=64 * KiB)
        with KVSpace(geo, reserve=(0, BIG_RESERVE), reserve_thread=False) as space:
            t0 = time.perf_counter()
            ids = space.alloc(geo.capacity)
            mask = np.random.default_rng(seed).random(ids.size) < 0.5
            space.free(ids[mask])
            kept = ids[~mask]
            del ids
            setup_s = time.perf_counter() - t0
            partial = sum(1 for p in space.page_occupancy() if p.state == "active" and p.used < p.capacity)
            committed = space.allocated_bytes()
            with no_page_syscalls(space, f"scale {num_blocks}"):
                res = interleaved_ns({"rt": roundtrip_loop(space.alloc, space.free, n)}, s.repeats, s.target_s)["rt"]
            space.free(kept)
            del kept
        res.update(num_blocks=num_blocks, num_pages=geo.num_pages, used_blocks=int((~mask).sum()),
                   partial_pages=partial, committed_bytes=committed, setup_s=setup_s)
        cases[str(num_blocks)] = res
    base = cases[str(s.scale_sizes[0])]["median_ns"]
    for res in cases.values():
        res["ratio_to_smallest"] = res["median_ns"] / base
    return {"n": n, "cases": cases}


# ------------------------------------------------------------------- suite


def run(opts: argparse.Namespace) -> dict[str, Any]:
    s = QUICK if opts.quick else FULL
    res: dict[str, Any] = {"settings": asdict(s), "hot_path": bench_hot_path(s)}
    res["goals"] = res["hot_path"]["goals"]
    res["roundtrip"] = bench_roundtrip(s)
    res["page"] = bench_page(s)
    res["scale"] = bench_scale(s)
    res["mirror"] = bench_mirror(s.page_iters, s.page_repeats)
    return res


def _hot_cells(row: Mapping[str, Any]) -> tuple[str, str, str]:
    if row["row"] == "steady":
        return "-", str(row["value"]), row["goal"]
    if row.get("ratio") is None:
        return f"{row['ns']:.0f}", "baseline", ""
    return f"{row['ns']:.0f}", f"{row['ratio']:.3f}", row["goal"]


def hot_path_lines(hp: Mapping[str, Any], repeats: int) -> list[str]:
    lines = [f"0. hot path: each ratio to the row above it (steady: a count), measured in this run, "
             f"medians of {repeats} interleaved repeats",
             f"   {'figure':<50}{'n':>6}{'ns':>9}{'ratio':>10}  {'goal':<8}verdict"]
    for row in hp["rows"]:
        ns, val, goal = _hot_cells(row)
        label = "steady loop (default KVSpace): page ops" if row["row"] == "steady" else row["figure"]
        met = "" if "met" not in row else verdict(row["met"])
        lines.append(f"   {label:<50}{row['n']:>6}{ns:>9}{val:>10}  {goal:<8}{met}")
    unmet = [g["what"] for g in hp["goals"] if g["met"] is False]
    lines.append(f"   goals: {len(hp['goals']) - len(unmet)} of {len(hp['goals'])} met"
                 + (f"; unmet: {'; '.join(unmet)}" if unmet else ""))
    return lines


def format_report(res: Mapping[str, Any]) -> str:
    lines = [machine_line(res["machine"]) + f", shmem THP: {res['machine']['shmem_thp']}", ""]
    lines += hot_path_lines(res["hot_path"], res["settings"]["repeats"])

    rt = res["roundtrip"]
    g = rt["geometry"]
    lines += [
        "",
        f"1. alloc(n) + free round trip, pages kept committed (no syscalls); {g['num_layers']}x"
        f"{g['num_kv_buffers']} regions, {g['block_bytes'] // KiB} KiB blocks, {g['page_bytes'] // MiB} MiB pages",
        f"   {'case':<28}{'ns/call':>10}{'x floor':>9}{'ns/block':>11}{'x n=1':>8}",
        f"   {'floor: 2 x available()':<28}{rt['floor']['median_ns']:>10.0f}{1.0:>9.2f}",
    ]
    for c in rt["cases"].values():
        lines.append(f"   {'n = ' + str(c['n']):<28}{c['median_ns']:>10.0f}{c['ratio_to_floor']:>9.2f}"
                     f"{c['per_block_ns']:>11.1f}{c['per_block_ratio_to_n1']:>8.3f}")

    pg = res["page"]
    g, med = pg["geometry"], pg["median_ns"]
    lines += [
        "",
        f"2. commit / release of one page (R = {g['num_regions']} regions x {g['page_bytes'] // MiB} MiB "
        f"= {g['page_commit_bytes'] // MiB} MiB), {pg['repeats']} x {pg['iters']} pages",
        f"   {'':<12}{'raw us/page':>13}{'kvpool us/page':>16}{'kvpool/raw':>12}",
        f"   {'commit':<12}{med['raw_commit'] / 1e3:>13.1f}{med['kvpool_commit'] / 1e3:>16.1f}"
        f"{pg['ratio_commit']:>12.3f}",
        f"   {'release':<12}{med['raw_release'] / 1e3:>13.1f}{med['kvpool_release'] / 1e3:>16.1f}"
        f"{pg['ratio_release']:>12.3f}",
    ]

    sc = res["scale"]
    lines += [
        "",
        f"3. alloc({sc['n']}) + free vs space size (4 KiB blocks, 64 KiB pages, 1 region; a random half held)",
        f"   {'blocks':>8}{'pages':>8}{'partial':>9}{'committed':>13}{'ns/call':>10}{'x smallest':>12}",
    ]
    for c in sc["cases"].values():
        lines.append(f"   {si(c['num_blocks']):>8}{c['num_pages']:>8}{c['partial_pages']:>9}"
                     f"{c['committed_bytes'] / MiB:>9.0f} MiB{c['median_ns']:>10.0f}{c['ratio_to_smallest']:>12.2f}")
    if "mirror" in res:
        lines += mirror_lines(res["mirror"])
    return "\n".join(lines)


def markdown(res: Mapping[str, Any]) -> str:
    hp = res["hot_path"]
    t = hp["timings"]
    n_cols = [str(n) for n in hp["sizes"]]
    head = " | ".join(f"n = {n}" for n in n_cols)
    lines = [
        f"Hot path (issue 12), medians of {res['settings']['repeats']} interleaved repeats; each ratio is to "
        "the row above it, measured in the same run:",
        "",
        f"| round trip | {head} | goal |",
        "|---|" + "---|" * len(n_cols) + "---|",
    ]
    for key, (label, base) in ROWS.items():
        cells = []
        for n in n_cols:
            ns = t[n][key]["median_ns"]
            cells.append(f"{ns / 1e3:.2f} µs" + ("" if base is None else
                                                 f" ({fmt(ratio(ns, t[n][base]['median_ns']), '.2f')}×)"))
        goal = "baseline" if base is None else " / ".join(
            f"≤ {r['goal'].removeprefix('<= ')}× {verdict(r['met'])}" for r in hp["rows"] if r["row"] == key)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {goal} |")
    steady = [r for r in hp["rows"] if r["row"] == "steady"]
    lines += [
        "",
        "Steady `free(alloc(n))` loop on a default `KVSpace` (reserve thread, `reserve=(1, 2)`, "
        "`idle_release_s=1.0`), page commits + releases after warm-up (goal 0): "
        + ", ".join(f"n = {r['n']}: {r['value']} ({verdict(r['met'])})" for r in steady) + ".",
    ]
    rt, pg, sc = res["roundtrip"], res["page"], res["scale"]
    sizes = list(sc["cases"])
    lines += [
        "",
        "| figure | result |",
        "|---|---|",
        "| `KVSpace` round trip vs two bare native calls (`available()`), n = 1 / 16 / 256 | "
        + " / ".join(f"{c['ratio_to_floor']:.1f}×" for c in rt["cases"].values()) + " |",
        f"| page commit (R = {pg['geometry']['num_regions']} × {pg['geometry']['page_bytes'] // MiB} MiB), "
        f"kvpool vs raw `fallocate` | {pg['median_ns']['kvpool_commit'] / 1e3:.0f} vs "
        f"{pg['median_ns']['raw_commit'] / 1e3:.0f} µs ({pg['ratio_commit']:.2f}×) |",
        f"| page release, kvpool vs raw punch-hole | {pg['median_ns']['kvpool_release'] / 1e3:.0f} vs "
        f"{pg['median_ns']['raw_release'] / 1e3:.0f} µs ({pg['ratio_release']:.2f}×) |",
        f"| alloc(16)+free at {' / '.join(si(int(x)) for x in sizes[1:])} blocks vs {si(int(sizes[0]))} | "
        + " / ".join(f"{sc['cases'][x]['ratio_to_smallest']:.2f}×" for x in sizes[1:]) + " |",
    ]
    return "\n".join(lines)
