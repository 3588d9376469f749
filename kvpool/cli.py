"""The ``kvpool`` command line.

``kvpool demo`` is the main job: several engines share one pool against a
static split of the same memory (see :mod:`kvpool.demo`, shipped from the
source folder ``demo/``).

Operator commands on the pools of this host (they read and write the shared
ledger only; no tenant process runs Python for them):

- ``kvpool pools [POOL ...]``: every pool (or the named ones) with its
  capacity, committed bytes, tenants and status: ``in use``, ``empty`` (no
  tenant yet, or all left cleanly: a pool made for servers about to start)
  or ``stale`` (its last tenant died without leaving); ``--gc`` removes the
  stale ones, ``--gc --empty`` the empty ones too.
- ``kvpool top [POOL]``: a live table of a pool's tenants (default pool:
  ``$KVPOOL_POOL``, else ``default``; ``--once`` for one snapshot, ``--once
  --json`` for a JSON object; piped, one table per interval).
- ``kvpool limit POOL TENANT SIZE [--min SIZE]``: cap a tenant's committed bytes (``none``
  clears) and optionally guarantee it ``--min``; prints ``applied``, ``same``,
  ``stale`` or ``conflict``. Every value is checked before anything is
  applied, and a guarantee the pool refuses takes the limit back: the
  command changes both or neither. Sizes need a unit (``512MiB``, ``2G``,
  ``4096B``).
- ``kvpool metrics [POOL ...]``: the Prometheus text exposition, once, or
  served on ``/metrics`` with ``--listen HOST:PORT`` (:mod:`kvpool.metrics`).

``kvpool bench {native,async,pool,peers,policy,engines,all} [--quick] [--json
PATH]`` runs the benchmark harness (:mod:`kvpool.bench`, from ``bench/``); ``kvpool bench
report PATH`` prints the Numbers page (docs/numbers.md) from its JSON.

Start-up: the operator commands never import torch, numpy or the manager
(``kvpool/__init__.py`` loads those lazily); this module imports only the
ledger handle at the top and the rest inside the command that needs it, so
``kvpool pools`` costs an interpreter start and a ledger read.

Exit codes: 0 success, 1 a limit that was not taken (stale / conflict),
2 errors (missing pool, bad pool name, unknown tenant, bad arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from . import __version__
from . import _sizes
from ._sizes import format_size, format_size_exact
from ._validate import shown
from .errors import KVPoolError, LedgerError
from .pool import Pool, check_pool_name, default_pool_name, ledger_path, list_pools

EXIT_OK, EXIT_REFUSED, EXIT_ERROR = 0, 1, 2


def parse_size(text: str) -> int | None:
    """``"512MiB"``, ``"1.5G"``, ``"4096B"`` -> bytes; ``"none"`` -> None (:func:`kvpool._sizes.parse_size`)."""
    try:
        return _sizes.parse_size(text)
    except _sizes.SizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return v


def _fmt(n: int | None) -> str:
    return "-" if n is None else format_size(n)


def _error(msg: object) -> int:
    print(f"kvpool: error: {msg}", file=sys.stderr)
    return EXIT_ERROR


def open_pool(name: str) -> Pool:
    """Join an existing pool; a missing one's error names the pools that do exist."""
    check_pool_name(name)
    try:
        return Pool(name, create=False)
    except LedgerError as e:
        others = list_pools()
        if name in others:  # it exists but cannot be opened: the ledger's own reason says why
            raise
        hint = f"pools on this host: {', '.join(others)}" if others else "there is no pool on this host"
        raise LedgerError(f"{e} ({hint}; `kvpool pools` lists them)") from None


# ------------------------------------------------------------------ pools

def _pool_row(name: str) -> dict[str, Any]:
    try:
        pool = Pool(name, create=False)
        pool.reap()  # what is left is alive (a dead tenant reaped here makes the pool stale)
        snap = pool.snapshot()  # one read: the total is the sum of these rows
    except (KVPoolError, OSError) as e:  # another user's pool (0600), another ledger layout, ...
        return {"name": name, "capacity": None, "committed": None, "tenants": None, "status": None,
                "stale": None, "error": str(e)}
    return {"name": name, "capacity": snap.capacity, "committed": snap.committed, "tenants": len(snap.tenants),
            "status": snap.status, "stale": snap.status == "stale"}


def remove_if_unused(name: str, *, empty: bool = False) -> bool:
    """Remove a pool's ledger if no live tenant is left and it is stale (its
    last tenant died), or, with ``empty``, also if it is empty; True if removed.

    Liveness is the ledger's own: ``tenants()`` reaps the dead (pid + start
    time) and returns the live. The file is removed only if it is still the
    one that was checked (same inode), so a pool removed and made anew in
    between is left alone. A tenant that joins between the check and the
    unlink keeps working on the removed ledger (``Pool.remove``); that window
    is one ``stat`` long.
    """
    path = ledger_path(name)
    try:
        before = os.stat(path).st_ino
        pool = Pool(name, create=False)
        if pool.tenants():
            return False
        if pool.snapshot().status != "stale" and not empty:
            return False
        if os.stat(path).st_ino != before:
            return False
    except (KVPoolError, OSError):
        return False  # unreadable or already gone: nothing of ours to remove
    Pool.remove(name)
    return True


def pools(args: argparse.Namespace) -> int:
    if args.empty and not args.gc:
        return _error("--empty needs --gc (it says which pools --gc removes)")
    names = list_pools()
    if args.pools:  # only these (and a named pool that does not exist is an error, not a silent no-op)
        try:
            for name in args.pools:
                if name not in names:
                    open_pool(name)
        except LedgerError as e:
            return _error(e)
        names = [n for n in names if n in set(args.pools)]
    rows = [_pool_row(name) for name in names]
    if args.gc:
        for r in rows:
            if r["status"] == "stale" or (args.empty and r["status"] == "empty"):
                r["removed"] = remove_if_unused(r["name"], empty=args.empty)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return EXIT_OK
    if not rows:
        print("no pools on this host")
        return EXIT_OK
    w = max(len("POOL"), *(len(r["name"]) for r in rows))  # whole names: `top` and `limit` need them
    print(f"{'POOL':<{w}}  {'CAPACITY':>10}  {'COMMITTED':>10}  {'TENANTS':>7}  STATUS")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<{w}}  {'?':>10}  {'?':>10}  {'?':>7}  unreadable: {r['error']}")
            continue
        status = {"in use": "in use", "empty": "empty: no tenant yet, or all left",
                  "stale": "stale: its last tenant died"}[r["status"]]
        if r.get("removed"):
            status = f"removed ({r['status']})"
        print(f"{r['name']:<{w}}  {_fmt(r['capacity']):>10}  {_fmt(r['committed']):>10}  "
              f"{r['tenants']:>7}  {status}")
    removed = [r["name"] for r in rows if r.get("removed")]
    stale_left = [r["name"] for r in rows if r["status"] == "stale" and not r.get("removed")]
    empty_left = [r["name"] for r in rows if r["status"] == "empty" and not r.get("removed")]
    if args.gc:
        print(f"removed {len(removed)} pool(s){': ' + ', '.join(removed) if removed else ''}"
              + (f"; kept {len(empty_left)} empty pool(s) (`--gc --empty` removes those)" if empty_left else ""))
    elif stale_left:
        print(f"{len(stale_left)} stale pool(s) (their last tenant died): `kvpool pools --gc` removes them")
    return EXIT_OK


# -------------------------------------------------------------------- top

def top(args: argparse.Namespace) -> int:
    from rich.console import Console

    from . import _top

    if args.json and not args.once:
        return _error("--json needs --once")
    try:
        pool = open_pool(args.pool if args.pool is not None else default_pool_name())
    except LedgerError as e:
        return _error(e)
    console = Console(highlight=False)  # no regex colouring of numbers inside cells
    if args.once:
        snap = _top.snapshot(pool)
        if args.json:
            json.dump(snap, sys.stdout, indent=2)
            print()
        else:
            console.print(_top.render(snap, console))
        return EXIT_OK
    import signal

    # SIGTERM (kill, a closing tmux pane) and SIGHUP end `top` as Ctrl-C does,
    # and every way out shows the cursor again (issue 32: it stayed hidden).
    # The `finally` below, not only `with Live`: a signal that lands inside
    # Live.__enter__, after it hid the cursor, skips Live.__exit__. Exit 128 +
    # the signal, as a shell reports it.
    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, leave)
    try:
        if not console.is_terminal:  # piped or logged: one whole table per interval, nothing redrawn
            while True:
                console.print(_top.render(_top.snapshot(pool), console))
                console.print()
                sys.stdout.flush()
                time.sleep(args.interval)
        from rich.live import Live

        with Live(_top.render(_top.snapshot(pool), console), console=console, auto_refresh=False,
                  screen=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(_top.render(_top.snapshot(pool), console), refresh=True)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        if console.is_terminal:
            console.show_cursor(True)


# ------------------------------------------------------------------ limit

_LIMIT_EXIT = {"applied": EXIT_OK, "same": EXIT_OK, "stale": EXIT_REFUSED, "conflict": EXIT_REFUSED}


def _check_limit(pool: Pool, tenant: str, size: int | None, minimum: int | None | object) -> None:
    """Every value of ``kvpool limit`` judged before any is applied (ValueError / LedgerError)."""
    snap = pool.snapshot()
    rows = [t for t in snap.tenants if t.name == tenant]
    if not rows:
        names = ", ".join(sorted(t.name for t in pool.tenants())) or "none"
        # shown(): quoted, escaped and cut, as the native core's quoted_name (a hostile name cannot flood a terminal).
        raise LedgerError(f"pool {pool.name!r} has no tenant {shown(tenant)} (tenants: {names})")
    if minimum is _UNSET or minimum is None:
        return
    assert isinstance(minimum, int)
    if size is not None and minimum > size:
        raise ValueError(f"--min {format_size_exact(minimum)} is more than the limit {format_size_exact(size)}: "
                         "a guarantee above the limit could never be used")
    others = sum(t.guarantee_setting for t in snap.tenants if t.name != tenant and t.guarantee_setting is not None)
    if others + minimum > snap.capacity:
        raise ValueError(f"--min {format_size_exact(minimum)} does not fit pool {pool.name!r}: other tenants' "
                         f"explicit guarantees hold {format_size_exact(others)} of its "
                         f"{format_size_exact(snap.capacity)}; nothing was changed")


def limit(args: argparse.Namespace) -> int:
    try:
        pool = open_pool(args.pool)
        _check_limit(pool, args.tenant, args.size, args.min)
        before = next(t for t in pool.snapshot().tenants if t.name == args.tenant)
        result = pool.set_limit(args.tenant, args.size, revision=args.revision)
        if args.min is _UNSET:
            print(result)
            return _LIMIT_EXIT[result]
        if result in ("stale", "conflict"):  # the limit was not taken: neither is the guarantee
            print(result)
            print("guarantee not changed (the limit was not taken)")
            return _LIMIT_EXIT[result]
        try:
            # The guarantee has its own revisions (the next one); `none` goes
            # back to the equal default share.
            guarantee = pool.set_guarantee(args.tenant, args.min)
        except (LedgerError, ValueError):
            # A tenant joined with a guarantee between the check and now:
            # take the limit back (its next revision), so both or neither hold.
            if result == "applied":
                pool.set_limit(args.tenant, before.limit_bytes)
            raise
    except (LedgerError, ValueError) as e:
        return _error(e)
    print(result)
    print(f"guarantee {guarantee}")
    return max(_LIMIT_EXIT[result], _LIMIT_EXIT[guarantee])


_UNSET: object = object()


def _revision(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"revision must be >= 0, got {v}")
    return v


# ---------------------------------------------------------------- metrics

def host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` (every interface) or ``[::1]:PORT`` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"bad address {text!r}: use HOST:PORT, e.g. 127.0.0.1:9464 or :9464")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host or "0.0.0.0", int(port)


def metrics(args: argparse.Namespace) -> int:
    from . import metrics as metrics_mod

    try:
        for name in args.pools:
            open_pool(name)  # a pool named at start-up must exist; later scrapes leave out one gone
    except LedgerError as e:
        return _error(e)
    names = args.pools or None  # none named: every pool on the host, listed anew at each scrape
    if args.listen is None:
        sys.stdout.write(metrics_mod.exposition(names))
        return EXIT_OK
    import asyncio

    from . import _exporter

    host, port = args.listen
    shown = f"[{host}]" if ":" in host else host
    reg = metrics_mod.registry(names)

    def render() -> bytes:
        from prometheus_client.exposition import generate_latest

        return generate_latest(reg)

    def listening(bound: int) -> None:
        print(f"serving http://{shown}:{bound}/metrics", flush=True)

    try:
        asyncio.run(_exporter.serve(host, port, render, listening))
    except OSError as e:
        return _error(f"cannot listen on {host}:{port}: {e.strerror or e}")
    except KeyboardInterrupt:
        pass
    return EXIT_OK


# ------------------------------------------------------------------- demo

DEMO_HELP = "several engines share one pool, against a static split (CPU)"


def demo(args: argparse.Namespace) -> int:
    """``kvpool demo``: the only command that imports torch (and only here)."""
    try:
        from .demo import cli as demo_mod
    except ImportError as e:
        return _error(f"kvpool demo needs torch (the operator commands do not): {e}")
    parser = argparse.ArgumentParser(prog="kvpool demo", description=DEMO_HELP)
    demo_mod.add_arguments(parser)
    return int(demo_mod.run(parser.parse_args(args.demo_args)))


BENCH_HELP = "benchmarks: every figure a ratio to a baseline measured in the same run (JSON out)"


def bench(args: argparse.Namespace) -> int:
    """``kvpool bench``: imported here, as the demo is (the suites load torch; ``report`` does not)."""
    from . import bench as bench_mod

    return bench_mod.main(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description="Elastic KV-cache allocator")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # The demo's own options live in kvpool.demo.cli, which imports torch: they are
    # parsed there, after the command is known (see main).
    p = sub.add_parser("demo", help=DEMO_HELP, add_help=False)
    p.set_defaults(func=demo)

    p = sub.add_parser("pools", help="list the pools on this host")
    p.add_argument("pools", nargs="*", metavar="POOL", help="only these pools (default: every pool)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--gc", action="store_true",
                   help="remove the stale pools (no live tenant, the last one died), never one with a live tenant")
    p.add_argument("--empty", action="store_true",
                   help="with --gc: remove empty pools too (no tenant yet, or all left cleanly)")
    p.set_defaults(func=pools)

    p = sub.add_parser("top", help="live table of a pool's tenants")
    p.add_argument("pool", nargs="?", default=None,
                   help="pool name (default: $KVPOOL_POOL, else 'default')")
    p.add_argument("--interval", type=_positive_float, default=1.0, metavar="SECONDS",
                   help="refresh period (default: %(default)s)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="with --once: print one JSON object")
    p.set_defaults(func=top)

    p = sub.add_parser("limit", help="cap a tenant's committed memory")
    p.add_argument("pool", help="pool name")
    p.add_argument("tenant", help="tenant name (as `kvpool top` shows it)")
    p.add_argument("size", type=parse_size, metavar="SIZE",
                   help="a size with a unit: B, K, M, G, T (KiB, MiB, ... alike; binary), e.g. 512MiB; "
                        "'none' clears")
    p.add_argument("--revision", type=_revision, default=None, metavar="N",
                   help="limit revision (default: the tenant's current one + 1)")
    p.add_argument("--min", type=parse_size, default=_UNSET, metavar="SIZE",
                   help="also guarantee the tenant SIZE ('none': back to an equal share of the pool); "
                        "explicit guarantees may not add up to more than the capacity")
    p.set_defaults(func=limit)

    p = sub.add_parser("metrics", help="Prometheus metrics of the pools (printed once, or served)")
    p.add_argument("pools", nargs="*", metavar="POOL", help="pools to export (default: every pool on this host)")
    p.add_argument("--listen", type=host_port, default=None, metavar="HOST:PORT",
                   help="serve /metrics on HOST:PORT (':9464' for every interface) until Ctrl-C")
    p.set_defaults(func=metrics)

    from .bench import add_arguments as add_bench_arguments  # argparse only: no suite is imported

    p = sub.add_parser("bench", help=BENCH_HELP, description=BENCH_HELP)
    add_bench_arguments(p.add_subparsers(dest="bench", required=True, metavar="SUITE"))
    p.set_defaults(func=bench)
    return parser


_NEGATIVE = re.compile(r"-\d|-\.\d")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["limit"]:
        # argparse reads "-5M" as an unknown option and then reports a missing
        # SIZE; say what is wrong with it instead.
        for before, token in zip(argv, argv[1:]):
            value = token.partition("=")[2] if token.startswith("--min=") else token
            if before != "--revision" and _NEGATIVE.match(value):
                parser.error(f"bad size {value!r}: a size cannot be negative")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        args.demo_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return int(args.func(args))
    except BrokenPipeError:  # `kvpool top | head`: the reader left; so do we, quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
