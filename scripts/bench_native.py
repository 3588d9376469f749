#!/usr/bin/env python3
"""Micro-benchmarks of the kvpool native core (CPU memfd backend), one run, one machine.

Every figure is measured in the same process and printed next to a baseline
measured in that same run, so that the ratios compare like with like even when
the absolute numbers move from machine to machine.

Timing: ``time.perf_counter_ns`` with the garbage collector off. A repeat runs
a tight loop of ``iters`` calls (``iters`` is calibrated so that one repeat
lasts a fixed time) and yields the mean per call; each figure is the median
of several repeats. Every raw repeat is kept in the JSON.

Figures
-------
1. **Round trip** (``roundtrip``): ``alloc(n)`` + ``free(ids)`` through the
   public :class:`kvpool.KVSpace` API for n = 1, 16, 256 blocks, with pages kept
   committed (``reserve=(0, big)``, no reserve thread): no syscall is on this
   path, and the script checks that the page commit/release counters do not
   move while it times. Reported as ns per call (one alloc + one free) and ns
   per block. Baselines: ``floor`` = two ``available()`` calls, the cheapest
   public native calls (the cost of crossing Python -> native twice), for the
   per-call ratio; the n = 1 case for the per-block ratio.

2. **Commit / release per page** (``page``): with ``reserve=(0, 0)`` and no
   reserve thread, an ``alloc(1)`` on an empty space commits exactly one page
   inline (``fallocate`` of the page's range in each of the R regions of the
   memfd) and freeing that block releases it inline (``FALLOC_FL_PUNCH_HOLE``
   in each region). Baseline: the same syscalls issued directly through ctypes
   on an ``os.memfd_create`` file of the same layout, timed in the same run
   (interleaved repeats). Reported as µs per page and the kvpool/raw ratio.
   Geometry: 4 layers x 2 KV buffers, 64 KiB blocks, 2 MiB pages (R = 8, so one
   page commits 16 MiB). The raw path pays one ctypes call per region; the
   first-touch faults of a fallocated page are *not* included in either.

3. **Alloc cost vs space size** (``scale``): spaces of 1K, 64K and 1M blocks
   (4 KiB blocks, 64 KiB pages, one region: the figure is about bookkeeping,
   which does not depend on R). Every block is allocated, then a random half is
   freed, so every page is committed and partially used (the allocator has
   as many partial pages as the space has pages); then ``alloc(16)`` +
   ``free`` round trips are timed. Reported as ns per call and the ratio to
   the 1K-block space. The 1M-block space commits 2-4 GiB while it exists;
   each space is emptied and closed before the next one is built.

Usage::

    python scripts/bench_native.py [--quick] [--json PATH]

``--quick`` shortens every loop (smoke test); its numbers are noisier.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from _benchlib import (  # scripts/, on sys.path when a script runs
    BIG_RESERVE,
    KiB,
    MiB,
    SyncBody,
    geo_info,
    machine_info,
    no_gc,
    no_page_syscalls,
    parse_args,
    read_text,
    repeat_ns,
    roundtrip_loop,
    si,
    utc_now,
    write_json,
)

from kvpool import Geometry, KVSpace

FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2
SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


@dataclass(frozen=True)
class Settings:
    """Loop sizes of one run."""

    repeats: int
    target_s: float  # wall time of one timed repeat (micro-benchmarks)
    page_iters: int  # commits/releases per repeat (figure 2)
    page_repeats: int
    scale_sizes: tuple[int, ...]


FULL = Settings(repeats=7, target_s=0.2, page_iters=40, page_repeats=7,
                scale_sizes=(1 << 10, 1 << 16, 1 << 20))
QUICK = Settings(repeats=3, target_s=0.03, page_iters=8, page_repeats=3,
                 scale_sizes=(1 << 10, 1 << 14, 1 << 16))  # smoke test: keep memory small


# --------------------------------------------------------------- timing helpers


def _repeat(body: SyncBody, settings: Settings) -> dict[str, Any]:
    """Calibrate, then time ``settings.repeats`` repeats; median and raw values."""
    return repeat_ns(body, settings.repeats, settings.target_s, max_iters=1 << 24)


# -------------------------------------------------------- figure 1: round trip


def bench_roundtrip(settings: Settings) -> dict[str, Any]:
    geo = Geometry(num_layers=4, num_kv_buffers=2, block_bytes=64 * KiB, num_blocks=4096)
    sizes = (1, 16, 256)
    out: dict[str, Any] = {"geometry": geo_info(geo), "cases": {}}
    with KVSpace(geo, reserve=(0, BIG_RESERVE), reserve_thread=False) as space:
        space.free(space.alloc(max(sizes)))  # commit the pages once; they stay committed

        def floor(iters: int) -> None:
            available = space.available
            for _ in range(iters):
                available()
                available()

        out["floor"] = _repeat(floor, settings)
        for n in sizes:
            with no_page_syscalls(space, f"round trip n={n}"):
                res = _repeat(roundtrip_loop(space.alloc, space.free, n), settings)
            res["n"] = n
            res["per_block_ns"] = res["median_ns"] / n
            out["cases"][str(n)] = res
        out["page_syscalls_during_timing"] = 0
    base_call = out["floor"]["median_ns"]
    base_block = out["cases"]["1"]["per_block_ns"]
    for res in out["cases"].values():
        res["ratio_to_floor"] = res["median_ns"] / base_call
        res["per_block_ratio_to_n1"] = res["per_block_ns"] / base_block
    return out


# ---------------------------------------------------- figure 2: commit/release


class RawMemfd:
    """A memfd laid out like a KV space's regions, driven by raw ``fallocate`` calls."""

    def __init__(self, geo: Geometry) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._fallocate = libc.fallocate
        self._fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        self._fallocate.restype = ctypes.c_int
        self.page_bytes = geo.page_bytes
        self.region_bytes = geo.region_bytes
        self.regions = geo.num_regions
        self.fd = os.memfd_create("kvpool-bench-raw", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.regions * self.region_bytes)

    def _offsets(self, page: int) -> list[int]:
        return [r * self.region_bytes + page * self.page_bytes for r in range(self.regions)]

    def _call(self, mode: int, offsets: list[int]) -> None:
        fallocate, fd, length = self._fallocate, self.fd, self.page_bytes
        for off in offsets:
            if fallocate(fd, mode, off, length) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"fallocate(mode={mode}, off={off}): {os.strerror(err)}")

    def commit(self, offsets: list[int]) -> None:
        self._call(0, offsets)

    def release(self, offsets: list[int]) -> None:
        self._call(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offsets)

    def allocated_bytes(self) -> int:
        return os.fstat(self.fd).st_blocks * 512

    def close(self) -> None:
        os.close(self.fd)


def _time_raw(raw: RawMemfd, page: int, iters: int) -> tuple[float, float]:
    offsets = raw._offsets(page)
    commit_ns = release_ns = 0
    clock = time.perf_counter_ns
    for _ in range(iters):
        t0 = clock()
        raw.commit(offsets)
        t1 = clock()
        raw.release(offsets)
        t2 = clock()
        commit_ns += t1 - t0
        release_ns += t2 - t1
    return commit_ns / iters, release_ns / iters


def _time_kvpool(space: KVSpace, iters: int) -> tuple[float, float]:
    alloc, free = space.alloc, space.free
    commit_ns = release_ns = 0
    clock = time.perf_counter_ns
    for _ in range(iters):
        t0 = clock()
        ids = alloc(1)
        t1 = clock()
        free(ids)
        t2 = clock()
        commit_ns += t1 - t0
        release_ns += t2 - t1
    return commit_ns / iters, release_ns / iters


def bench_page(settings: Settings) -> dict[str, Any]:
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
            raw.commit(raw._offsets(page))
            if raw.allocated_bytes() != geo.page_commit_bytes:
                raise RuntimeError(f"raw commit holds {raw.allocated_bytes()} bytes")
            raw.release(raw._offsets(page))

            before = space.stats()
            with no_gc():
                for _ in range(settings.page_repeats):
                    # Interleaved so that drift (page cache, frequency) hits both alike.
                    rc, rr = _time_raw(raw, page, settings.page_iters)
                    kc, kr = _time_kvpool(space, settings.page_iters)
                    runs["raw_commit"].append(rc)
                    runs["raw_release"].append(rr)
                    runs["kvpool_commit"].append(kc)
                    runs["kvpool_release"].append(kr)
            after = space.stats()
            expected = settings.page_repeats * settings.page_iters
            commits = after.inline_commits - before.inline_commits
            releases = after.inline_releases - before.inline_releases
            if commits != expected or releases != expected:
                raise RuntimeError(f"expected {expected} inline commits/releases, got {commits}/{releases}")
    finally:
        raw.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "geometry": geo_info(geo),
        "page": page,
        "iters": settings.page_iters,
        "repeats": settings.page_repeats,
        "median_ns": med,
        "runs_ns": runs,
        "ratio_commit": med["kvpool_commit"] / med["raw_commit"],
        "ratio_release": med["kvpool_release"] / med["raw_release"],
    }


# ------------------------------------------------------ figure 3: space size


def bench_scale(settings: Settings, seed: int = 0) -> dict[str, Any]:
    n = 16
    cases: dict[str, Any] = {}
    for num_blocks in settings.scale_sizes:
        geo = Geometry(num_layers=1, num_kv_buffers=1, block_bytes=4 * KiB, num_blocks=num_blocks,
                       page_bytes=64 * KiB)
        with KVSpace(geo, reserve=(0, BIG_RESERVE), reserve_thread=False) as space:
            t0 = time.perf_counter()
            ids = space.alloc(geo.capacity)
            rng = np.random.default_rng(seed)
            mask = rng.random(ids.size) < 0.5
            space.free(ids[mask])
            kept = ids[~mask]
            del ids
            setup_s = time.perf_counter() - t0
            st = space.stats()
            partial = sum(1 for p in space.page_occupancy() if p.state == "active" and p.used < p.capacity)
            committed = space.allocated_bytes()
            with no_page_syscalls(space, f"scale {num_blocks}"):
                res = _repeat(roundtrip_loop(space.alloc, space.free, n), settings)
            space.free(kept)
            del kept
            res.update(
                num_blocks=num_blocks,
                num_pages=geo.num_pages,
                used_blocks=st.used_blocks,
                partial_pages=partial,
                committed_bytes=committed,
                setup_s=setup_s,
                geometry=geo_info(geo),
            )
        cases[str(num_blocks)] = res
    base = cases[str(settings.scale_sizes[0])]["median_ns"]
    for res in cases.values():
        res["ratio_to_smallest"] = res["median_ns"] / base
    return {"n": n, "cases": cases}


# ------------------------------------------------------------------- report


def format_report(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [
        f"kvpool native bench ({'quick' if res['quick'] else 'full'}) - {m['platform']}, "
        f"{m['nproc_usable']}/{m['nproc']} cpus, Python {m['python']}, shmem THP: {m['shmem_thp']}",
        "",
    ]

    rt = res["roundtrip"]
    g = rt["geometry"]
    lines += [
        f"1. alloc(n) + free round trip, pages kept committed (no syscalls); "
        f"{g['num_layers']}x{g['num_kv_buffers']} regions, {g['block_bytes'] // KiB} KiB blocks, "
        f"{g['page_bytes'] // MiB} MiB pages",
        f"   {'case':<28}{'ns/call':>10}{'x floor':>9}{'ns/block':>11}{'x n=1':>8}",
        f"   {'floor: 2 x available()':<28}{rt['floor']['median_ns']:>10.0f}{1.0:>9.2f}{'':>11}{'':>8}",
    ]
    for c in rt["cases"].values():
        lines.append(
            f"   {'n = ' + str(c['n']):<28}{c['median_ns']:>10.0f}{c['ratio_to_floor']:>9.2f}"
            f"{c['per_block_ns']:>11.1f}{c['per_block_ratio_to_n1']:>8.3f}"
        )

    pg = res["page"]
    g = pg["geometry"]
    med = pg["median_ns"]
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
        f"3. alloc({sc['n']}) + free vs space size (4 KiB blocks, 64 KiB pages, 1 region; "
        "a random half of the blocks held)",
        f"   {'blocks':>8}{'pages':>8}{'partial':>9}{'committed':>11}{'ns/call':>10}{'x 1K':>8}",
    ]
    for c in sc["cases"].values():
        lines.append(
            f"   {si(c['num_blocks']):>8}{c['num_pages']:>8}{c['partial_pages']:>9}"
            f"{c['committed_bytes'] / MiB:>8.0f} MiB{c['median_ns']:>10.0f}{c['ratio_to_smallest']:>8.2f}"
        )
    lines += ["", f"total {res['elapsed_s']:.1f} s"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, "bench-native.json", argv)
    settings = QUICK if args.quick else FULL

    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "when": utc_now(),
        "quick": args.quick,
        "settings": asdict(settings),
        "machine": machine_info(kernel_settings={"shmem_thp": read_text(SHMEM_THP)}),
    }
    res["roundtrip"] = bench_roundtrip(settings)
    res["page"] = bench_page(settings)
    res["scale"] = bench_scale(settings)
    res["elapsed_s"] = time.perf_counter() - t0

    print(format_report(res))
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
