"""The suites of ``kvpool bench``: their names, their one-line help, and how one is imported.

Its own module so that the command line (:mod:`kvpool.bench`) and the
Numbers page's generator (:mod:`kvpool.bench.report`) both read it without
importing each other. A suite module is imported only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Mapping
from typing import Any, Protocol, cast

# suite -> module (``async`` is a keyword). The order is the order of ``all``.
SUITES: Mapping[str, str] = {
    "native": "native",
    "async": "aio",
    "pool": "pool",
    "peers": "peers",
    "policy": "policy",
    "engines": "engines",
}
HELP = {
    "native": "the native core: hot-path table (goals), round trip, page commit/release, space size",
    "async": "KVCacheManager under asyncio: await vs nowait, hand-off latency, grants/s",
    "pool": "cross-process wake-up through the pool ledger vs in-process hand-off",
    "peers": "kvpool vs a bare C++ free list and vLLM's BlockPool (vLLM side in its venv)",
    "policy": "the fair-share policy's cost: pooled vs private round trip, lend + reclaim",
    "engines": "the vLLM plugin vs vLLM: block pool hot path, tiny-model generation (needs the vLLM venv)",
}


class Suite(Protocol):
    """What a suite module provides."""

    TITLE: str

    def run(self, opts: argparse.Namespace) -> dict[str, Any]: ...

    def format_report(self, res: Mapping[str, Any]) -> str: ...

    def markdown(self, res: Mapping[str, Any]) -> str: ...


def suite(name: str) -> Suite:
    """The module of suite ``name`` (imported now)."""
    return cast(Suite, importlib.import_module(f".{SUITES[name]}", __package__))
