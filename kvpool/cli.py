"""The ``kvpool`` command line.

``kvpool demo`` is the main job: several engines share one pool against a
static split of the same memory (see :mod:`kvpool.demo`).

Operator commands on the pools of this host (they read and write the shared
ledger only; no tenant process runs Python for them):

- ``kvpool pools``: every pool with its capacity, committed bytes, tenants.
- ``kvpool top [POOL]``: a live table of a pool's tenants (``--once`` for one
  snapshot, ``--once --json`` for a JSON object).
- ``kvpool limit POOL TENANT SIZE``: cap a tenant's committed bytes (``none``
  clears); prints ``applied``, ``same``, ``stale`` or ``conflict``.

Exit codes: 0 success, 1 a limit that was not taken (stale / conflict),
2 errors (missing pool, bad pool name, unknown tenant, bad arguments).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from . import demo as demo_mod
from .errors import LedgerError
from .geometry import MiB
from .pool import Pool, list_pools

EXIT_OK, EXIT_REFUSED, EXIT_ERROR = 0, 1, 2


_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmg](?:i?b)?|b)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int | None:
    """``"512"``, ``"64K"``, ``"1.5GiB"``, ``"100mb"`` -> bytes (binary units); ``"none"`` -> None."""
    if text.strip().lower() == "none":
        return None
    m = _SIZE.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: use bytes, a number with K, M, G, KiB, MiB or GiB, or 'none'"
        )
    unit = (m.group(2) or "").lower()
    mult = _UNITS[unit[:1]]
    num = m.group(1)
    if "." in num:
        value = float(num) * mult
        if value != int(value):
            raise argparse.ArgumentTypeError(f"bad size {text!r}: not a whole number of bytes")
        return int(value)
    return int(num) * mult


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return v


def _fmt_mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def _error(msg: object) -> int:
    print(f"kvpool: error: {msg}", file=sys.stderr)
    return EXIT_ERROR


def pools(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for name in list_pools():
        try:
            pool = Pool(name, create=False)
            tenants = pool.tenants()
            rows.append({"name": name, "capacity": pool.capacity, "committed": pool.committed,
                         "tenants": len(tenants)})
        except LedgerError as e:  # another user's pool (0600), an incompatible ledger version, ...
            rows.append({"name": name, "capacity": None, "committed": None, "tenants": None, "error": str(e)})
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return EXIT_OK
    if not rows:
        print("no pools on this host")
        return EXIT_OK
    print(f"{'POOL':<24} {'CAPACITY MiB':>14} {'COMMITTED MiB':>14} {'TENANTS':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<24} {'?':>14} {'?':>14} {'?':>8}  ({r['error']})")
        else:
            print(f"{r['name']:<24} {_fmt_mib(r['capacity']):>14} {_fmt_mib(r['committed']):>14} {r['tenants']:>8}")
    return EXIT_OK


def _snapshot(pool: Pool) -> dict[str, Any]:
    tenants = pool.tenants()  # reaps dead tenants first, so committed below is live-only
    return {"pool": pool.name, "capacity": pool.capacity, "committed": pool.committed,
            "tenants": [dataclasses.asdict(t) for t in tenants]}


def _table(snap: dict[str, Any]) -> Table:
    cap, used = snap["capacity"], snap["committed"]
    pct = 100.0 * used / cap if cap else 0.0
    table = Table(
        title=(f"pool [bold]{snap['pool']}[/bold]: {_fmt_mib(used)} / {_fmt_mib(cap)} MiB committed "
               f"({pct:.1f}%), {len(snap['tenants'])} tenants"),
        title_justify="left",
    )
    table.add_column("TENANT")
    table.add_column("PID", justify="right")
    table.add_column("COMMITTED MiB", justify="right")
    table.add_column("LIMIT MiB", justify="right")
    table.add_column("WAITING", justify="right")
    table.add_column("IDLE PAGES", justify="right")
    table.add_column("LIMIT STATUS")
    for t in snap["tenants"]:
        state = t["limit_state"]
        table.add_row(
            t["name"], str(t["pid"]), _fmt_mib(t["committed_bytes"]), _fmt_mib(t["limit_bytes"]),
            str(t["waiting"]), str(t["reserve_pages"]),
            state if state == "applied" else f"[yellow]{state}[/yellow]",
        )
    return table


def top(args: argparse.Namespace) -> int:
    if args.json and not args.once:
        return _error("--json needs --once")
    try:
        pool = Pool(args.pool, create=False)
    except LedgerError as e:
        return _error(e)
    if args.once:
        snap = _snapshot(pool)
        if args.json:
            json.dump(snap, sys.stdout, indent=2)
            print()
        else:
            Console().print(_table(snap))
        return EXIT_OK
    try:
        with Live(_table(_snapshot(pool)), auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(_table(_snapshot(pool)), refresh=True)
    except KeyboardInterrupt:
        return EXIT_OK


_LIMIT_EXIT = {"applied": EXIT_OK, "same": EXIT_OK, "stale": EXIT_REFUSED, "conflict": EXIT_REFUSED}


def limit(args: argparse.Namespace) -> int:
    try:
        result = Pool(args.pool, create=False).set_limit(args.tenant, args.size, revision=args.revision)
    except (LedgerError, ValueError) as e:
        return _error(e)
    print(result)
    return _LIMIT_EXIT[result]


def _revision(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"revision must be >= 0, got {v}")
    return v


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool", description="Elastic KV-cache allocator")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="several engines share one pool, against a static split (CPU)")
    demo_mod.add_arguments(p)
    p.set_defaults(func=demo_mod.run)

    p = sub.add_parser("pools", help="list the pools on this host")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=pools)

    p = sub.add_parser("top", help="live table of a pool's tenants")
    p.add_argument("pool", nargs="?", default="default", help="pool name (default: %(default)s)")
    p.add_argument("--interval", type=_positive_float, default=1.0, metavar="SECONDS",
                   help="refresh period (default: %(default)s)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="with --once: print one JSON object")
    p.set_defaults(func=top)

    p = sub.add_parser("limit", help="cap a tenant's committed memory")
    p.add_argument("pool", help="pool name")
    p.add_argument("tenant", help="tenant name (as `kvpool top` shows it)")
    p.add_argument("size", type=parse_size, metavar="SIZE",
                   help="bytes, or with a K/M/G/KiB/MiB/GiB suffix (binary units), or 'none' to clear")
    p.add_argument("--revision", type=_revision, default=None, metavar="N",
                   help="limit revision (default: the tenant's current one + 1)")
    p.set_defaults(func=limit)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
