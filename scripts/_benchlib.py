"""Helpers shared by the benchmark scripts (``bench_native.py``, ``bench_async.py``).

The scripts run as ``python scripts/bench_x.py``, which puts this folder on
``sys.path``, so they import this module as plain ``_benchlib``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib import metadata
from typing import Any

import numpy as np

import kvpool
from kvpool import Geometry

KiB = 1 << 10
MiB = 1 << 20
BIG_RESERVE = 1 << 30  # "keep every emptied page committed"


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
