#!/usr/bin/env python3
"""kvpool's alloc+free hot path against its peers and against a bare C++ free list, one run.

Every figure is measured in the same run and printed next to baselines measured
in that run, so that the ratios compare like with like even when the absolute
numbers move from machine to machine.

Contenders
----------
- **C++ floor** (``freelist_baseline.cpp`` beside this script): a stack of free
  ids in one ``std::vector<int64_t>``; ``alloc(n)`` copies the top n ids into
  the caller's buffer and pops them, ``free(ids)`` pushes them back. No
  validation, no pages, no accounting. It is compiled when the script runs
  (``g++ -O2 -shared -fPIC``, ``$CXX`` overrides the compiler) into a temporary
  folder that is removed at exit, and loaded with ctypes. Three rows:

  - ``C++ loop``: ``iters`` round trips inside one C++ call, the pure floor
    (the single ctypes call is amortized over the calibrated loop);
  - ``ctypes, bare``: one ctypes call for alloc and one for free per round
    trip from a Python loop, ids passed by address in one reused numpy buffer:
    the cheapest way to drive the floor from Python;
  - ``ctypes + fresh array``: as kvpool's contract, every alloc fills a
    *fresh* ``np.empty(n, int64)`` array (its address read once with
    ``.ctypes.data``, which alone costs ~0.8 us in numpy) and free takes it
    back. (Passing the arrays through ``np.ctypeslib.ndpointer`` argument
    checks instead costs several us per round trip: slower than kvpool
    itself, so no floor.)

  Each ctypes call costs a few hundred ns of FFI (argument conversion), about
  what a nanobind call costs; ``ctypes, bare`` is therefore the floor for
  ratios of Python-facing allocators.

- **kvpool sync**: ``KVSpace(geometry, reserve=(0, big), reserve_thread=False)``,
  ``free(alloc(n))``. Every block is allocated once and freed before timing,
  so every page stays committed: no syscall is on the timed path, and the
  script fails if the page commit/release counters move while it times.

- **kvpool await**: ``KVCacheManager(geometry, pool=None, reserve=(0, big),
  reserve_thread=False)``, ``free(await alloc(n))`` in one asyncio task (no
  shared ledger, nobody waiting; pages pre-committed and checked as above).
  The await fast path yields to the event loop once after its grant (see
  ``bench_async.py``), which this row includes.

- **vLLM BlockPool** (``vllm.v1.core.block_pool.BlockPool``), only when a vLLM
  interpreter is present: ``$KVPOOL_VLLM_PYTHON``, else ``.venv-vllm/bin/python``
  in the repository root, else the cached venv that ``scripts/vllm_venv.sh``
  makes. A timing snippet (the same calibrated loops) runs in
  that interpreter in a subprocess and prints its results as JSON. The
  constructor's parameters are read from the installed vLLM at run time
  (``inspect.signature``; versions differ: ``hash_block_size`` in recent ones,
  ``num_single_type_managers`` in some older ones). The pool gets
  ``blocks + 1`` blocks, since vLLM keeps block 0 as its null block. Round
  trip = ``free_blocks(get_new_blocks(n))``, with prefix caching off
  (``enable_caching=False``: the bare free queue) and on (vLLM's default:
  ``get_new_blocks`` also checks each block for a cached hash to evict; these
  blocks have none). A third row also turns the returned ``KVCacheBlock``
  objects into block ids (``[b.block_id for b in blocks]``), what an engine
  needs for its block table and what kvpool returns directly. vLLM is pure
  Python, so it runs at the speed of *that* interpreter, whose version is
  printed. When no interpreter is found, the JSON records
  ``{"available": false, "why": ...}`` and the report says it was skipped.

Timing: ``time.perf_counter_ns`` with the garbage collector off. A repeat runs
a tight loop of ``iters`` round trips (``iters`` is calibrated so that one
repeat lasts a fixed time) and yields the mean per round trip; each figure is
the median of several repeats. Every raw repeat is kept in the JSON.

Figures
-------
1. **Round trip** (``roundtrip``): ``alloc(n)`` + ``free(ids)`` for n = 1,
   16, 256 on a 4096-block space / pool (1 layer x K/V, 4 KiB blocks, 64 KiB
   pages), nothing else held. Reported as ns per round trip (and per block in
   the JSON); ratios kvpool / each floor, vLLM / each floor and kvpool / vLLM.

2. **Alloc cost vs pool size** (``scale``): ``alloc(16)`` + ``free`` on
   spaces / pools of 1K, 64K and 1M blocks, as in ``bench_native.py`` figure 3
   (4 KiB blocks, 64 KiB pages, one region): every block is allocated, then a
   random half is freed (the same half for every contender), so that for
   kvpool every page is committed and partially used. The floor and vLLM
   (caching off) hold the same half. Reported as ns per round trip, the ratio
   of each contender to its own 1K figure, and kvpool / floor (and kvpool /
   vLLM) at each size. kvpool's 1M-block space commits ~4 GiB of shared memory
   while it exists; vLLM's 1M-block pool builds 1M Python objects.

Usage::

    python scripts/bench_peers.py [--quick] [--json PATH]

``--quick`` shortens every loop and uses smaller scale sizes (1K, 16K, 64K):
a smoke test whose numbers are noisier. Importing vLLM alone takes seconds.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _benchlib import (  # scripts/, on sys.path when a script runs
    BIG_RESERVE,
    AsyncBody,
    KiB,
    SyncBody,
    arepeat_ns,
    awaited_roundtrip_loop,
    find_vllm_python,
    fmt,
    geo_info,
    machine_info,
    no_page_syscalls,
    parse_args,
    ratio,
    repeat_ns,
    roundtrip_loop,
    run_marked_json,
    si,
    utc_now,
    version,
    with_timing,
    write_json,
)

from kvpool import Geometry, KVCacheManager, KVSpace

FLOOR_SRC = Path(__file__).resolve().parent / "freelist_baseline.cpp"
VLLM_MARK = "KVPOOL-BENCH-PEERS-JSON "
SIZES = (1, 16, 256)
ROUNDTRIP_BLOCKS = 4096
SCALE_N = 16


@dataclass(frozen=True)
class Settings:
    """Loop sizes of one run."""

    repeats: int
    target_s: float  # wall time of one timed repeat
    scale_sizes: tuple[int, ...]
    vllm_timeout_s: float


FULL = Settings(repeats=7, target_s=0.2, scale_sizes=(1 << 10, 1 << 16, 1 << 20), vllm_timeout_s=900)
QUICK = Settings(repeats=3, target_s=0.02, scale_sizes=(1 << 10, 1 << 14, 1 << 16), vllm_timeout_s=120)


def _roundtrip_geometry() -> Geometry:
    return Geometry(num_layers=1, num_kv_buffers=2, block_bytes=4 * KiB, num_blocks=ROUNDTRIP_BLOCKS,
                    page_bytes=64 * KiB)


def _scale_geometry(num_blocks: int) -> Geometry:
    return Geometry(num_layers=1, num_kv_buffers=1, block_bytes=4 * KiB, num_blocks=num_blocks,
                    page_bytes=64 * KiB)


def _held_mask(num_blocks: int, seed: int = 0) -> np.ndarray:
    """Which block ids (0 .. num_blocks-1) stay held once all are allocated; the other random half is freed."""
    return ~(np.random.default_rng(seed).random(num_blocks) < 0.5)


# --------------------------------------------------------------- timing helpers


def _repeat(body: SyncBody, settings: Settings) -> dict[str, Any]:
    """Calibrate, then time ``settings.repeats`` repeats; median and raw values."""
    return repeat_ns(body, settings.repeats, settings.target_s)


async def _arepeat(body: AsyncBody, settings: Settings) -> dict[str, Any]:
    """:func:`_repeat` for a coroutine body."""
    return await arepeat_ns(body, settings.repeats, settings.target_s)


# ------------------------------------------------------------- the C++ floor


class Floor:
    """``freelist_baseline.cpp``, compiled into a temporary folder and loaded with ctypes."""

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
        lib.fl_create.argtypes, lib.fl_create.restype = [i64], vp
        lib.fl_destroy.argtypes, lib.fl_destroy.restype = [vp], None
        lib.fl_available.argtypes, lib.fl_available.restype = [vp], i64
        lib.fl_alloc.argtypes, lib.fl_alloc.restype = [vp, i64, vp], i64
        lib.fl_free.argtypes, lib.fl_free.restype = [vp, vp, i64], i64
        lib.fl_roundtrips.argtypes, lib.fl_roundtrips.restype = [vp, i64, i64, vp], i64
        self.lib = lib

    def info(self) -> dict[str, Any]:
        return {"source": FLOOR_SRC.name, "compiler": self.compiler, "flags": self.flags,
                "compile_s": self.compile_s}

    @contextmanager
    def freelist(self, num_blocks: int) -> Iterator[int]:
        h = self.lib.fl_create(num_blocks)
        if not h:
            raise MemoryError(f"fl_create({num_blocks}) failed")
        try:
            yield h
        finally:
            self.lib.fl_destroy(h)

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _floor_bodies(floor: Floor, h: int, n: int) -> dict[str, Callable[[int], None]]:
    """The three floor loops for alloc(n) + free on free list ``h``."""
    lib = floor.lib
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

    return {"cpp_loop": cpp_loop, "ctypes_bare": ctypes_bare, "ctypes_fresh": ctypes_fresh}


def _timed_floor(floor: Floor, h: int, n: int, settings: Settings, which: tuple[str, ...]) -> dict[str, Any]:
    before = floor.lib.fl_available(h)
    bodies = _floor_bodies(floor, h, n)
    out = {name: _repeat(bodies[name], settings) for name in which}
    if floor.lib.fl_available(h) != before:
        raise RuntimeError(f"floor: round trips of {n} leaked blocks: {before} -> {floor.lib.fl_available(h)}")
    return out


# ---------------------------------------------------------------- kvpool


def _kvpool_sync(space: KVSpace, n: int, settings: Settings, what: str) -> dict[str, Any]:
    with no_page_syscalls(space, what):
        return _repeat(roundtrip_loop(space.alloc, space.free, n), settings)


async def _kvpool_await(settings: Settings) -> dict[str, Any]:
    m = KVCacheManager(_roundtrip_geometry(), pool=None, reserve=(0, BIG_RESERVE), reserve_thread=False,
                       name="bench-peers")
    out: dict[str, Any] = {}
    try:
        m.free(m.alloc_nowait(m.geometry.capacity))  # commit every page once; they stay committed
        for n in SIZES:
            with no_page_syscalls(m, f"await n={n}"):
                out[str(n)] = await _arepeat(awaited_roundtrip_loop(m.alloc, m.free, n), settings)
        st = m.stats()
        if st.waiting or st.used_blocks or st.granted_after_wait:
            raise RuntimeError(f"await round trip was not uncontended: {st}")
    finally:
        await m.aclose()
    return out


# ---------------------------------------------------------------- vLLM


# Runs in the vLLM interpreter: argv[1] is a JSON config; the last stdout line
# starting with the marker carries the results.
VLLM_SNIPPET = r'''
import gc, inspect, json, sys, time

cfg = json.loads(sys.argv[1])
t_import = time.perf_counter()
import vllm
from vllm.v1.core.block_pool import BlockPool
import_s = time.perf_counter() - t_import

KNOWN = {"enable_kv_cache_events": False, "hash_block_size": 16, "block_size": 16,
         "num_single_type_managers": 1}


def make_pool(usable, caching):
    """A BlockPool with ``usable`` blocks besides its null block 0."""
    sig = inspect.signature(BlockPool.__init__)
    kwargs = {}
    for name, p in list(sig.parameters.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name == "num_gpu_blocks":
            kwargs[name] = usable + 1
        elif name == "enable_caching":
            kwargs[name] = caching
        elif name in KNOWN:
            kwargs[name] = KNOWN[name]
        elif p.default is p.empty:
            raise TypeError(f"BlockPool{sig} has a required parameter this benchmark does not know: {name}")
    pool = BlockPool(**kwargs)
    if pool.get_num_free_blocks() != usable:
        raise RuntimeError(f"BlockPool({kwargs}) has {pool.get_num_free_blocks()} free blocks, expected {usable}")
    return pool, kwargs, str(sig)


# @timing@ (no_gc, loop_ns, calibrate, repeat_ns, roundtrip_loop: spliced in by _benchlib.with_timing())


def bodies(pool, n):
    plain = roundtrip_loop(pool.get_new_blocks, pool.free_blocks, n)

    def with_ids(iters):
        get, free = pool.get_new_blocks, pool.free_blocks
        for _ in range(iters):
            blocks = get(n)
            ids = [b.block_id for b in blocks]
            free(blocks)

    return {"plain": plain, "with_ids": with_ids}


def timed(pool, body):
    before = pool.get_num_free_blocks()
    res = repeat_ns(body, cfg["repeats"], cfg["target_s"])
    if pool.get_num_free_blocks() != before:
        raise RuntimeError(f"free blocks moved while timing: {before} -> {pool.get_num_free_blocks()}")
    return res


out = {"available": True, "python": sys.version.split()[0], "executable": sys.executable,
       "vllm": getattr(vllm, "__version__", None), "block_pool_file": inspect.getsourcefile(BlockPool),
       "import_s": import_s, "roundtrip": {}, "scale": {}}
for caching in (False, True):
    pool, kwargs, sig = make_pool(cfg["roundtrip_blocks"], caching)
    out["signature"], out.setdefault("kwargs", {})[str(caching).lower()] = sig, kwargs
    cases = {}
    for n in cfg["sizes"]:
        b = bodies(pool, n)
        cases[str(n)] = {"plain": timed(pool, b["plain"])}
        if not caching:
            cases[str(n)]["with_ids"] = timed(pool, b["with_ids"])
    out["roundtrip"]["caching_on" if caching else "caching_off"] = cases
    del pool

for size in cfg["scale_sizes"]:
    t0 = time.perf_counter()
    pool, _, _ = make_pool(size, False)
    blocks = pool.get_new_blocks(size)
    held = cfg["held"][str(size)]  # by block id; vLLM's ids are 1..size (0 is its null block)
    pool.free_blocks([b for b in blocks if not held[b.block_id - 1]])
    kept = [b for b in blocks if held[b.block_id - 1]]
    del blocks
    setup_s = time.perf_counter() - t0
    res = timed(pool, roundtrip_loop(pool.get_new_blocks, pool.free_blocks, cfg["scale_n"]))
    res.update(num_blocks=size, used_blocks=len(kept), setup_s=setup_s)
    out["scale"][str(size)] = res
    pool.free_blocks(kept)
    del kept, pool
    gc.collect()

print("\n" + cfg["mark"] + json.dumps(out), flush=True)
'''
VLLM_SNIPPET = with_timing(VLLM_SNIPPET)


def bench_vllm(settings: Settings, cwd: str) -> dict[str, Any]:
    py, origin = find_vllm_python()
    if py is None:
        return {"available": False, "why": origin}
    cfg = {
        "mark": VLLM_MARK,
        "repeats": settings.repeats,
        "target_s": settings.target_s,
        "sizes": list(SIZES),
        "roundtrip_blocks": ROUNDTRIP_BLOCKS,
        "scale_sizes": list(settings.scale_sizes),
        "scale_n": SCALE_N,
        "held": {str(s): _held_mask(s).tolist() for s in settings.scale_sizes},
    }
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # Through a file: the held masks of a 1M-block pool are too long for argv.
    cfg_path = os.path.join(cwd, "vllm-config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    code = "import sys, pathlib; sys.argv[1] = pathlib.Path(sys.argv[1]).read_text()\n" + VLLM_SNIPPET
    return run_marked_json(py, origin, ["-c", code, cfg_path], VLLM_MARK, cwd=cwd, env=env,
                           timeout_s=settings.vllm_timeout_s)


# ---------------------------------------------------------------- figures


def bench_roundtrip(settings: Settings, floor: Floor) -> dict[str, Any]:
    geo = _roundtrip_geometry()
    out: dict[str, Any] = {"geometry": geo_info(geo), "blocks": ROUNDTRIP_BLOCKS, "sizes": list(SIZES),
                           "floor": {}, "kvpool_sync": {}}
    with floor.freelist(ROUNDTRIP_BLOCKS) as h:
        for n in SIZES:
            out["floor"][str(n)] = _timed_floor(floor, h, n, settings, ("cpp_loop", "ctypes_bare", "ctypes_fresh"))
    with KVSpace(geo, reserve=(0, BIG_RESERVE), reserve_thread=False) as space:
        space.free(space.alloc(geo.capacity))  # commit every page once; they stay committed
        for n in SIZES:
            out["kvpool_sync"][str(n)] = _kvpool_sync(space, n, settings, f"round trip n={n}")
    out["kvpool_await"] = asyncio.run(_kvpool_await(settings))
    out["page_syscalls_during_timing"] = 0
    return out


def bench_scale(settings: Settings, floor: Floor) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for num_blocks in settings.scale_sizes:
        held = _held_mask(num_blocks)
        case: dict[str, Any] = {"num_blocks": num_blocks, "used_blocks": int(held.sum())}
        with floor.freelist(num_blocks) as h:
            ids = np.empty(num_blocks, np.int64)
            if floor.lib.fl_alloc(h, num_blocks, ids.ctypes.data) != num_blocks:
                raise RuntimeError(f"floor: could not allocate all {num_blocks} blocks")
            freed = np.ascontiguousarray(ids[~held[ids]])
            floor.lib.fl_free(h, freed.ctypes.data, freed.size)
            case["floor"] = _timed_floor(floor, h, SCALE_N, settings, ("cpp_loop", "ctypes_bare"))
            del ids, freed
        geo = _scale_geometry(num_blocks)
        with KVSpace(geo, reserve=(0, BIG_RESERVE), reserve_thread=False) as space:
            t0 = time.perf_counter()
            ids = space.alloc(geo.capacity)
            space.free(ids[~held[ids]])
            kept = ids[held[ids]]
            del ids
            setup_s = time.perf_counter() - t0
            partial = sum(1 for p in space.page_occupancy() if p.state == "active" and p.used < p.capacity)
            res = _kvpool_sync(space, SCALE_N, settings, f"scale {num_blocks}")
            res.update(geometry=geo_info(geo), partial_pages=partial, committed_bytes=space.allocated_bytes(),
                       setup_s=setup_s)
            space.free(kept)
            del kept
        case["kvpool_sync"] = res
        cases[str(num_blocks)] = case
    return {"n": SCALE_N, "cases": cases}


# ---------------------------------------------------------------- ratios


def _rows(res: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Figure 1: contender -> {n: median ns per round trip}."""
    rt, vl = res["roundtrip"], res["vllm"]
    rows: dict[str, dict[str, float | None]] = {}
    for key in ("cpp_loop", "ctypes_bare", "ctypes_fresh"):
        rows[f"floor_{key}"] = {n: rt["floor"][n][key]["median_ns"] for n in rt["floor"]}
    rows["kvpool_sync"] = {n: c["median_ns"] for n, c in rt["kvpool_sync"].items()}
    rows["kvpool_await"] = {n: c["median_ns"] for n, c in rt["kvpool_await"].items()}
    if vl.get("available"):
        rows["vllm_off"] = {n: c["plain"]["median_ns"] for n, c in vl["roundtrip"]["caching_off"].items()}
        rows["vllm_on"] = {n: c["plain"]["median_ns"] for n, c in vl["roundtrip"]["caching_on"].items()}
        rows["vllm_off_ids"] = {n: c["with_ids"]["median_ns"] for n, c in vl["roundtrip"]["caching_off"].items()}
    return rows


# (numerator row, denominator row); a ratio is named "numerator/denominator", less the "floor_" prefix.
RATIOS = (
    ("kvpool_sync", "floor_cpp_loop"),
    ("kvpool_sync", "floor_ctypes_bare"),
    ("kvpool_sync", "floor_ctypes_fresh"),
    ("kvpool_await", "floor_ctypes_bare"),
    ("kvpool_await", "kvpool_sync"),
    ("vllm_off", "floor_cpp_loop"),
    ("vllm_off", "floor_ctypes_bare"),
    ("vllm_on", "floor_ctypes_bare"),
    ("kvpool_sync", "vllm_off"),
    ("kvpool_sync", "vllm_on"),
    ("kvpool_sync", "vllm_off_ids"),
    ("kvpool_await", "vllm_off"),
    ("kvpool_await", "vllm_on"),
)
SCALE_RATIOS = (
    ("kvpool_sync", "floor_cpp_loop"),
    ("kvpool_sync", "floor_ctypes_bare"),
    ("kvpool_sync", "vllm_off"),
    ("vllm_off", "floor_cpp_loop"),
)


def _ratio_name(a: str, b: str) -> str:
    return f"{a.removeprefix('floor_')}/{b.removeprefix('floor_')}"


def compute_ratios(res: dict[str, Any]) -> None:
    rows = _rows(res)
    rt = res["roundtrip"]
    rt["ns_per_roundtrip"] = rows
    rt["ns_per_block"] = {k: {n: None if v is None else v / int(n) for n, v in r.items()} for k, r in rows.items()}
    rt["ratios"] = {_ratio_name(a, b): {n: ratio(rows[a][n], rows[b][n]) for n in rows[a]}
                    for a, b in RATIOS if a in rows and b in rows}

    sc, vl = res["scale"], res["vllm"]
    first = str(res["settings"]["scale_sizes"][0])
    for size, c in sc["cases"].items():
        ns: dict[str, float | None] = {
            "floor_cpp_loop": c["floor"]["cpp_loop"]["median_ns"],
            "floor_ctypes_bare": c["floor"]["ctypes_bare"]["median_ns"],
            "kvpool_sync": c["kvpool_sync"]["median_ns"],
        }
        if vl.get("available"):
            c["vllm_off"] = vl["scale"][size]
            ns["vllm_off"] = vl["scale"][size]["median_ns"]
        c["ns_per_roundtrip"] = ns
        c["ratios"] = {_ratio_name(a, b): ratio(ns[a], ns[b]) for a, b in SCALE_RATIOS if a in ns and b in ns}
    base = sc["cases"][first]["ns_per_roundtrip"]
    for c in sc["cases"].values():
        c["ratio_to_smallest"] = {k: ratio(v, base[k]) for k, v in c["ns_per_roundtrip"].items()}


# ---------------------------------------------------------------- report


LABELS = {
    "floor_cpp_loop": "floor: C++ loop",
    "floor_ctypes_bare": "floor: ctypes, bare",
    "floor_ctypes_fresh": "floor: ctypes + fresh array",
    "kvpool_sync": "kvpool KVSpace (sync)",
    "kvpool_await": "kvpool await alloc + free",
    "vllm_off": "vLLM BlockPool, caching off",
    "vllm_on": "vLLM BlockPool, caching on",
    "vllm_off_ids": "vLLM, caching off, + ids",
}

SHORT_LABELS = {  # a ratio "a/b" is labelled "<a> / <b>"
    "cpp_loop": "C++ loop",
    "ctypes_bare": "ctypes bare",
    "ctypes_fresh": "ctypes + fresh",
    "kvpool_sync": "kvpool sync",
    "kvpool_await": "kvpool await",
    "vllm_off": "vLLM off",
    "vllm_on": "vLLM on",
    "vllm_off_ids": "vLLM off + ids",
}


def _ratio_label(name: str) -> str:
    return " / ".join(SHORT_LABELS[part] for part in name.split("/"))


def format_report(res: dict[str, Any]) -> str:
    m, vl, fl = res["machine"], res["vllm"], res["floor"]
    lines = [
        (f"kvpool peers bench ({'quick' if res['quick'] else 'full'}) - {m['platform']}, "
         f"{m['nproc_usable']}/{m['nproc']} cpus, Python {m['python']}, floor: {fl['compiler']} "
         f"{' '.join(fl['flags'][:1])}"),
    ]
    if vl.get("available"):
        lines.append(f"vLLM {vl['vllm']} (Python {vl['python']}, {vl['origin']}): BlockPool{vl['signature']}")
    else:
        lines.append(f"vLLM: skipped ({vl['why']})")
    lines.append("")

    rt = res["roundtrip"]
    rows, ratios = rt["ns_per_roundtrip"], rt["ratios"]
    ns_cols = list(rt["kvpool_sync"])
    head = "".join(f"{'n = ' + n:>10}" for n in ns_cols)
    lines += [
        (f"1. alloc(n) + free round trip, {rt['blocks']}-block space / pool, nothing else held; "
         "kvpool pages kept committed (no syscalls)"),
        f"   {'ns per round trip':<32}{head}",
    ]
    for key, r in rows.items():
        lines.append(f"   {LABELS[key]:<32}" + "".join(f"{fmt(r[n], '.0f'):>10}" for n in ns_cols))
    lines.append(f"   {'ratio':<32}{head}")
    for key, r in ratios.items():
        lines.append(f"   {_ratio_label(key):<32}" + "".join(f"{fmt(r[n], '.2f'):>10}" for n in ns_cols))

    sc = res["scale"]
    sizes = list(sc["cases"])
    head = "".join(f"{si(int(s)):>10}" for s in sizes)
    keys = list(sc["cases"][sizes[0]]["ns_per_roundtrip"])
    lines += [
        "",
        f"2. alloc({sc['n']}) + free vs pool size (4 KiB blocks, 64 KiB pages, 1 region; a random half held)",
        f"   {'ns per round trip':<32}{head}",
    ]
    for key in keys:
        lines.append(f"   {LABELS[key]:<32}"
                     + "".join(f"{fmt(sc['cases'][s]['ns_per_roundtrip'][key], '.0f'):>10}" for s in sizes))
    lines.append(f"   {'ratio to ' + si(int(sizes[0])):<32}{head}")
    for key in keys:
        lines.append(f"   {LABELS[key]:<32}"
                     + "".join(f"{fmt(sc['cases'][s]['ratio_to_smallest'][key], '.2f'):>10}" for s in sizes))
    lines.append(f"   {'ratio':<32}{head}")
    for key in sc["cases"][sizes[0]]["ratios"]:
        lines.append(f"   {_ratio_label(key):<32}"
                     + "".join(f"{fmt(sc['cases'][s]['ratios'][key], '.2f'):>10}" for s in sizes))
    partial = " / ".join(str(sc["cases"][s]["kvpool_sync"]["partial_pages"]) for s in sizes)
    lines.append(f"   (kvpool partial pages: {partial})")
    lines += ["", f"total {res['elapsed_s']:.1f} s"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, "bench-peers.json", argv)
    settings = QUICK if args.quick else FULL

    t0 = time.perf_counter()
    floor = Floor()
    try:
        res: dict[str, Any] = {
            "when": utc_now(),
            "quick": args.quick,
            "settings": asdict(settings),
            "machine": machine_info(extra={
                "kvpool_log_level": os.environ.get("KVPOOL_LOG_LEVEL", "warning"),
                "anyio": version("anyio"),
            }),
            "floor": floor.info(),
        }
        res["roundtrip"] = bench_roundtrip(settings, floor)
        res["scale"] = bench_scale(settings, floor)
        res["vllm"] = bench_vllm(settings, floor.tmp)
    finally:
        floor.close()
    compute_ratios(res)
    res["elapsed_s"] = time.perf_counter() - t0

    print(format_report(res))
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
