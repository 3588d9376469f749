"""Suite ``peers``: kvpool's alloc+free against a bare C++ free list and vLLM's ``BlockPool``, one run.

Contenders
----------
- **C++ floor** (``_floor.cpp`` beside this module): a stack of free ids in
  one ``std::vector<int64_t>``; no validation, no pages, no accounting. It is
  compiled when the suite runs (``g++ -O2 -shared -fPIC``, ``$CXX``
  overrides) into a temporary folder and loaded with ctypes. Rows: ``C++
  loop`` (the round trips inside one C++ call: the pure floor), ``ctypes,
  bare`` (one ctypes call each way, ids in one reused buffer: the cheapest
  way to drive the floor from Python), ``ctypes + fresh array`` (every alloc
  fills a fresh ``np.empty(n, int64)``, as kvpool's contract).
- **kvpool sync**: ``KVSpace(reserve=(0, big), reserve_thread=False)``,
  ``free(alloc(n))``, pages pre-committed (checked), its repeats interleaved
  with the floor's.
- **kvpool await**: ``KVCacheManager(pool=None, ...)``, ``free(await
  alloc(n))`` in one task, nobody waiting.
- **vLLM BlockPool**, when a vLLM interpreter is found
  (:func:`kvpool.bench._lib.find_vllm_python`): ``python -m
  kvpool.bench._vllm_side peers`` times ``free_blocks(get_new_blocks(n))``
  with prefix caching off and on (and off + extracting the ids) with the same
  loops, in that interpreter. Otherwise the JSON says why it was skipped.

Figures
-------
1. **Round trip** (``roundtrip``) for n = 1, 16, 256 on 4096 blocks
   (1 layer x K/V, 4 KiB blocks, 64 KiB pages): ns per round trip; ratios to
   each floor and kvpool / vLLM.
2. **Alloc cost vs pool size** (``scale``): ``alloc(16)`` + ``free`` at 1K,
   64K and 1M blocks with the same random half held by every contender;
   each contender's ratio to its own 1K figure, and kvpool / floor / vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._lib import (BIG_RESERVE, KiB, find_vllm_python, fmt, geo_info, machine_line, no_page_syscalls, ratio,
                   run_vllm_side, si)
from ._timing import SyncBody, arepeat_ns, awaited_roundtrip_loop, interleaved_ns, roundtrip_loop

if TYPE_CHECKING:
    import numpy as np

    from kvpool import Geometry

TITLE = "kvpool vs a bare C++ free list and vLLM's BlockPool"
FLOOR_SRC = Path(__file__).resolve().parent / "_floor.cpp"
SIZES = (1, 16, 256)
ROUNDTRIP_BLOCKS = 4096
SCALE_N = 16


@dataclass(frozen=True)
class Settings:
    repeats: int
    target_s: float
    scale_sizes: tuple[int, ...]
    vllm_timeout_s: float


FULL = Settings(repeats=7, target_s=0.2, scale_sizes=(1 << 10, 1 << 16, 1 << 20), vllm_timeout_s=900)
QUICK = Settings(repeats=3, target_s=0.02, scale_sizes=(1 << 10, 1 << 14, 1 << 16), vllm_timeout_s=120)


def _geometry(num_blocks: int, kv_buffers: int) -> Geometry:
    from kvpool import Geometry

    return Geometry(num_layers=1, num_kv_buffers=kv_buffers, block_bytes=4 * KiB, num_blocks=num_blocks,
                    page_bytes=64 * KiB)


def _held_mask(num_blocks: int, seed: int = 0) -> np.ndarray[Any, Any]:
    """Which block ids stay held once all are allocated; the other random half is freed."""
    import numpy as np

    return ~(np.random.default_rng(seed).random(num_blocks) < 0.5)


# ------------------------------------------------------------- the C++ floor


class Floor:
    """``_floor.cpp``, compiled into a temporary folder and loaded with ctypes."""

    def __init__(self) -> None:
        self.cxx = os.environ.get("CXX", "g++")
        exe = shutil.which(self.cxx)
        if exe is None:
            raise RuntimeError(f"the floor needs a C++ compiler: {self.cxx!r} is not on PATH (set $CXX)")
        self.tmp = tempfile.mkdtemp(prefix="kvpool-bench-peers-")
        so = os.path.join(self.tmp, "libfreelist.so")
        self.flags = ["-O2", "-std=c++17", "-shared", "-fPIC"]
        t0 = time.perf_counter()
        res = subprocess.run([exe, *self.flags, str(FLOOR_SRC), "-o", so], check=False, capture_output=True, text=True)
        self.compile_s = time.perf_counter() - t0
        if res.returncode != 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise RuntimeError(f"compiling {FLOOR_SRC.name} failed:\n{res.stderr}")
        ver = subprocess.run([exe, "--version"], check=False, capture_output=True, text=True).stdout
        self.compiler = ver.splitlines()[0] if ver else self.cxx
        lib = ctypes.CDLL(so)
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        for name, args, ret in (("fl_create", [i64], vp), ("fl_destroy", [vp], None), ("fl_available", [vp], i64),
                                ("fl_alloc", [vp, i64, vp], i64), ("fl_free", [vp, vp, i64], i64),
                                ("fl_roundtrips", [vp, i64, i64, vp], i64)):
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, ret
        self.lib = lib

    def info(self) -> dict[str, Any]:
        return {"source": FLOOR_SRC.name, "compiler": self.compiler, "flags": self.flags, "compile_s": self.compile_s}

    @contextmanager
    def freelist(self, num_blocks: int) -> Iterator[int]:
        h = self.lib.fl_create(num_blocks)
        if not h:
            raise MemoryError(f"fl_create({num_blocks}) failed")
        try:
            yield h
        finally:
            self.lib.fl_destroy(h)

    def bodies(self, h: int, n: int, which: tuple[str, ...]) -> dict[str, SyncBody]:
        """The floor loops for alloc(n) + free on free list ``h``."""
        import numpy as np

        lib = self.lib
        buf = np.empty(max(n, 1), np.int64)  # the closures keep it alive: they pass its address

        def cpp_loop(iters: int) -> None:
            if lib.fl_roundtrips(h, n, iters, buf.ctypes.data) != 0:
                raise RuntimeError(f"floor: alloc({n}) failed inside the C++ loop")

        def ctypes_bare(iters: int) -> None:
            alloc, free, addr = lib.fl_alloc, lib.fl_free, buf.ctypes.data
            for _ in range(iters):
                free(h, addr, alloc(h, n, addr))

        def ctypes_fresh(iters: int) -> None:
            alloc, free, empty, i64 = lib.fl_alloc, lib.fl_free, np.empty, np.int64
            for _ in range(iters):
                ids = empty(n, i64)
                a = ids.ctypes.data
                free(h, a, alloc(h, n, a))

        every = {"cpp_loop": cpp_loop, "ctypes_bare": ctypes_bare, "ctypes_fresh": ctypes_fresh}
        return {f"floor_{k}": every[k] for k in which}

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


# ---------------------------------------------------------------- figures


async def _kvpool_await(s: Settings) -> dict[str, Any]:
    from kvpool import KVCacheManager

    m = KVCacheManager(_geometry(ROUNDTRIP_BLOCKS, 2), pool=None, reserve=(0, BIG_RESERVE), reserve_thread=False,
                       name="bench-peers")
    out: dict[str, Any] = {}
    try:
        m.free(m.alloc_nowait(m.geometry.capacity))  # commit every page once; they stay committed
        for n in SIZES:
            with no_page_syscalls(m, f"await n={n}"):
                out[str(n)] = await arepeat_ns(awaited_roundtrip_loop(m.alloc, m.free, n), s.repeats, s.target_s)
    finally:
        await m.aclose()
    return out


def bench_roundtrip(s: Settings, floor: Floor) -> dict[str, Any]:
    from kvpool import KVSpace

    geo = _geometry(ROUNDTRIP_BLOCKS, 2)
    rows: dict[str, dict[str, Any]] = {}
    with KVSpace(geo, reserve=(0, BIG_RESERVE), reserve_thread=False) as space, \
            floor.freelist(ROUNDTRIP_BLOCKS) as h:
        space.free(space.alloc(geo.capacity))  # commit every page once; they stay committed
        for n in SIZES:
            before = floor.lib.fl_available(h)
            bodies = {**floor.bodies(h, n, ("cpp_loop", "ctypes_bare", "ctypes_fresh")),
                      "kvpool_sync": roundtrip_loop(space.alloc, space.free, n)}
            with no_page_syscalls(space, f"round trip n={n}"):
                for key, r in interleaved_ns(bodies, s.repeats, s.target_s).items():
                    rows.setdefault(key, {})[str(n)] = r
            if floor.lib.fl_available(h) != before:
                raise RuntimeError(f"floor: round trips of {n} leaked blocks")
    rows["kvpool_await"] = asyncio.run(_kvpool_await(s))
    return {"geometry": geo_info(geo), "blocks": ROUNDTRIP_BLOCKS, "sizes": list(SIZES), "timings": rows}


def bench_scale(s: Settings, floor: Floor) -> dict[str, Any]:
    import numpy as np

    from kvpool import KVSpace

    cases: dict[str, Any] = {}
    for num_blocks in s.scale_sizes:
        held = _held_mask(num_blocks)
        geo = _geometry(num_blocks, 1)
        with floor.freelist(num_blocks) as h, KVSpace(geo, reserve=(0, BIG_RESERVE), reserve_thread=False) as space:
            ids = np.empty(num_blocks, np.int64)
            if floor.lib.fl_alloc(h, num_blocks, ids.ctypes.data) != num_blocks:
                raise RuntimeError(f"floor: could not allocate all {num_blocks} blocks")
            freed = np.ascontiguousarray(ids[~held[ids]])
            floor.lib.fl_free(h, freed.ctypes.data, freed.size)
            ids = space.alloc(geo.capacity)
            space.free(ids[~held[ids]])
            kept = ids[held[ids]]
            partial = sum(1 for p in space.page_occupancy() if p.state == "active" and p.used < p.capacity)
            bodies = {**floor.bodies(h, SCALE_N, ("cpp_loop", "ctypes_bare")),
                      "kvpool_sync": roundtrip_loop(space.alloc, space.free, SCALE_N)}
            with no_page_syscalls(space, f"scale {num_blocks}"):
                t = interleaved_ns(bodies, s.repeats, s.target_s)
            committed = space.allocated_bytes()
            space.free(kept)
            del ids, freed, kept
        cases[str(num_blocks)] = {"num_blocks": num_blocks, "used_blocks": int(held.sum()), "timings": t,
                                  "partial_pages": partial, "committed_bytes": committed, "geometry": geo_info(geo)}
    return {"n": SCALE_N, "cases": cases}


def bench_vllm(s: Settings, cwd: str) -> dict[str, Any]:
    py, origin = find_vllm_python()
    if py is None:
        return {"available": False, "why": origin}
    cfg = {"repeats": s.repeats, "target_s": s.target_s, "sizes": list(SIZES), "roundtrip_blocks": ROUNDTRIP_BLOCKS,
           "scale_sizes": list(s.scale_sizes), "scale_n": SCALE_N,
           "held": {str(n): _held_mask(n).tolist() for n in s.scale_sizes}}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    return run_vllm_side(py, origin, "peers", cfg, cwd=cwd, env=env, timeout_s=s.vllm_timeout_s)


# ---------------------------------------------------------------- ratios

# (numerator row, denominator row); a ratio is named "numerator/denominator", less the "floor_" prefix.
RATIOS = (
    ("kvpool_sync", "floor_cpp_loop"), ("kvpool_sync", "floor_ctypes_bare"), ("kvpool_sync", "floor_ctypes_fresh"),
    ("kvpool_await", "floor_ctypes_bare"), ("kvpool_await", "kvpool_sync"), ("vllm_off", "floor_cpp_loop"),
    ("vllm_off", "floor_ctypes_bare"), ("vllm_on", "floor_ctypes_bare"), ("kvpool_sync", "vllm_off"),
    ("kvpool_sync", "vllm_on"), ("kvpool_sync", "vllm_off_ids"), ("kvpool_await", "vllm_off"),
    ("kvpool_await", "vllm_on"),
)
SCALE_RATIOS = (("kvpool_sync", "floor_cpp_loop"), ("kvpool_sync", "floor_ctypes_bare"),
                ("kvpool_sync", "vllm_off"), ("vllm_off", "floor_cpp_loop"))


def _ratio_name(a: str, b: str) -> str:
    return f"{a.removeprefix('floor_')}/{b.removeprefix('floor_')}"


def compute_ratios(res: dict[str, Any]) -> None:
    rt, vl = res["roundtrip"], res["vllm"]
    rows: dict[str, dict[str, float | None]] = {k: {n: c["median_ns"] for n, c in r.items()}
                                                 for k, r in rt["timings"].items()}
    if vl.get("available"):
        off, on = vl["roundtrip"]["caching_off"], vl["roundtrip"]["caching_on"]
        rows["vllm_off"] = {n: c["plain"]["median_ns"] for n, c in off.items()}
        rows["vllm_on"] = {n: c["plain"]["median_ns"] for n, c in on.items()}
        rows["vllm_off_ids"] = {n: c["with_ids"]["median_ns"] for n, c in off.items()}
    rt["ns_per_roundtrip"] = rows
    rt["ratios"] = {_ratio_name(a, b): {n: ratio(rows[a][n], rows[b][n]) for n in rows[a]}
                    for a, b in RATIOS if a in rows and b in rows}
    sc = res["scale"]
    for size, c in sc["cases"].items():
        ns: dict[str, float | None] = {k: r["median_ns"] for k, r in c["timings"].items()}
        if vl.get("available"):
            ns["vllm_off"] = vl["scale"][size]["median_ns"]
        c["ns_per_roundtrip"] = ns
        c["ratios"] = {_ratio_name(a, b): ratio(ns[a], ns[b]) for a, b in SCALE_RATIOS if a in ns and b in ns}
    base = sc["cases"][str(res["settings"]["scale_sizes"][0])]["ns_per_roundtrip"]
    for c in sc["cases"].values():
        c["ratio_to_smallest"] = {k: ratio(v, base[k]) for k, v in c["ns_per_roundtrip"].items()}


def run(opts: argparse.Namespace) -> dict[str, Any]:
    s = QUICK if opts.quick else FULL
    floor = Floor()
    try:
        res: dict[str, Any] = {"settings": asdict(s), "floor": floor.info()}
        res["roundtrip"] = bench_roundtrip(s, floor)
        res["scale"] = bench_scale(s, floor)
        res["vllm"] = bench_vllm(s, floor.tmp)
    finally:
        floor.close()
    compute_ratios(res)
    return res


# ---------------------------------------------------------------- report

LABELS = {
    "floor_cpp_loop": "floor: C++ loop", "floor_ctypes_bare": "floor: ctypes, bare",
    "floor_ctypes_fresh": "floor: ctypes + fresh array", "kvpool_sync": "kvpool KVSpace (sync)",
    "kvpool_await": "kvpool await alloc + free", "vllm_off": "vLLM BlockPool, caching off",
    "vllm_on": "vLLM BlockPool, caching on", "vllm_off_ids": "vLLM, caching off, + ids",
}
SHORT = {"cpp_loop": "C++ loop", "ctypes_bare": "ctypes bare", "ctypes_fresh": "ctypes + fresh",
         "kvpool_sync": "kvpool sync", "kvpool_await": "kvpool await", "vllm_off": "vLLM off", "vllm_on": "vLLM on",
         "vllm_off_ids": "vLLM off + ids"}


def _ratio_label(name: str) -> str:
    return " / ".join(SHORT[part] for part in name.split("/"))


def _vllm_line(vl: Mapping[str, Any]) -> str:
    if vl.get("available"):
        return f"vLLM {vl['vllm']} (Python {vl['python']}, {vl['origin']}): BlockPool{vl['signature']}"
    return f"vLLM: skipped ({vl['why']})"


def format_report(res: Mapping[str, Any]) -> str:
    fl, rt, sc = res["floor"], res["roundtrip"], res["scale"]
    lines = [machine_line(res["machine"]) + f"; floor: {fl['compiler']} {fl['flags'][0]}", _vllm_line(res["vllm"]), ""]
    cols = [str(n) for n in rt["sizes"]]
    head = "".join(f"{'n = ' + n:>10}" for n in cols)
    lines += [f"1. alloc(n) + free round trip, {rt['blocks']} blocks, nothing else held; kvpool pages kept committed",
              f"   {'ns per round trip':<32}{head}"]
    for key, r in rt["ns_per_roundtrip"].items():
        lines.append(f"   {LABELS[key]:<32}" + "".join(f"{fmt(r[n], '.0f'):>10}" for n in cols))
    lines.append(f"   {'ratio':<32}{head}")
    for key, r in rt["ratios"].items():
        lines.append(f"   {_ratio_label(key):<32}" + "".join(f"{fmt(r[n], '.2f'):>10}" for n in cols))
    sizes = list(sc["cases"])
    head = "".join(f"{si(int(x)):>10}" for x in sizes)
    keys = list(sc["cases"][sizes[0]]["ns_per_roundtrip"])
    lines += ["", f"2. alloc({sc['n']}) + free vs pool size (4 KiB blocks, 64 KiB pages, 1 region; a random half held)",
              f"   {'ns per round trip':<32}{head}"]
    for key in keys:
        lines.append(f"   {LABELS[key]:<32}"
                     + "".join(f"{fmt(sc['cases'][x]['ns_per_roundtrip'][key], '.0f'):>10}" for x in sizes))
    lines.append(f"   {'ratio to ' + si(int(sizes[0])):<32}{head}")
    for key in keys:
        lines.append(f"   {LABELS[key]:<32}"
                     + "".join(f"{fmt(sc['cases'][x]['ratio_to_smallest'][key], '.2f'):>10}" for x in sizes))
    lines.append(f"   {'ratio':<32}{head}")
    for key in sc["cases"][sizes[0]]["ratios"]:
        lines.append(f"   {_ratio_label(key):<32}"
                     + "".join(f"{fmt(sc['cases'][x]['ratios'][key], '.2f'):>10}" for x in sizes))
    return "\n".join(lines)


def _time(ns: float | None) -> str:
    return "-" if ns is None else f"{ns:.0f} ns" if ns < 1000 else f"{ns / 1e3:.2f} µs"


def markdown(res: Mapping[str, Any]) -> str:
    rt, sc = res["roundtrip"], res["scale"]
    rows, ratios = rt["ns_per_roundtrip"], rt["ratios"]
    cols = [str(n) for n in rt["sizes"]]
    vl = res["vllm"]
    lines = [f"vLLM {vl['vllm']}'s `BlockPool` ran in its own venv ({vl['origin']}, Python {vl['python']}; "
             "`python -m kvpool.bench._vllm_side peers`), timed by the same loops."
             if vl.get("available") else f"vLLM: skipped ({vl['why']}).", "",
             "| alloc(n)+free round trip | " + " | ".join(f"n = {n}" for n in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for key in rows:
        lines.append(f"| {LABELS[key]} | " + " | ".join(_time(rows[key][n]) for n in cols) + " |")
    for key in ("kvpool_sync/ctypes_bare", "kvpool_sync/vllm_off", "kvpool_sync/vllm_on"):
        if key in ratios:
            lines.append(f"| ratio {_ratio_label(key)} | " + " | ".join(f"{fmt(ratios[key][n], '.2f')}×" for n in cols)
                         + " |")
    sizes = list(sc["cases"])
    flat = {k: max(abs((c["ratio_to_smallest"][k] or 1) - 1) for c in sc["cases"].values())
            for k in sc["cases"][sizes[0]]["ratio_to_smallest"]}
    lines += ["", f"alloc({sc['n']})+free from {si(int(sizes[0]))} to {si(int(sizes[-1]))} blocks (a random half "
              "held), largest change against the smallest: "
              + ", ".join(f"{LABELS[k]} {v:.0%}" for k, v in flat.items()) + "."]
    return "\n".join(lines)
