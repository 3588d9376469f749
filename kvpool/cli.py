"""The ``kvpool`` command line.

``kvpool demo`` is the main job: several engines share one pool against a
static split of the same memory (see :mod:`kvpool.demo`).

Operator commands on the pools of this host (they read and write the shared
ledger only; no tenant process runs Python for them):

- ``kvpool pools [POOL ...]``: every pool (or the named ones) with its
  capacity, committed bytes, tenants, marked ``stale`` when no live tenant is
  left; ``--gc`` removes those.
- ``kvpool top [POOL]``: a live table of a pool's tenants (default pool:
  ``$KVPOOL_POOL``, else ``default``; ``--once`` for one snapshot, ``--once
  --json`` for a JSON object; piped, one table per interval).
- ``kvpool limit POOL TENANT SIZE [--min SIZE]``: cap a tenant's committed bytes (``none``
  clears); prints ``applied``, ``same``, ``stale`` or ``conflict``.
- ``kvpool metrics [POOL ...]``: the Prometheus text exposition, once, or
  served on ``/metrics`` with ``--listen HOST:PORT`` (:mod:`kvpool.metrics`).

``kvpool bench {native,async,pool,peers,policy,engines,all} [--quick] [--json
PATH]`` runs the benchmark harness (:mod:`kvpool.bench`); ``kvpool bench
report PATH`` prints the README's Numbers section from its JSON.

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
from .errors import KVPoolError, LedgerError
from .pool import Pool, check_pool_name, default_pool_name, ledger_path, list_pools

EXIT_OK, EXIT_REFUSED, EXIT_ERROR = 0, 1, 2
MiB = 1 << 20


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
        pool.reap()  # what is left is alive
        snap = pool.snapshot()  # one read: the total is the sum of these rows
        tenants = snap.tenants
    except (KVPoolError, OSError) as e:  # another user's pool (0600), another ledger layout, ...
        return {"name": name, "capacity": None, "committed": None, "tenants": None, "stale": None,
                "error": str(e)}
    return {"name": name, "capacity": snap.capacity, "committed": snap.committed, "tenants": len(tenants),
            "stale": not tenants}


def remove_if_stale(name: str) -> bool:
    """Remove a pool's ledger if no live tenant is left in it; True if removed.

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
        if Pool(name, create=False).tenants():
            return False
        if os.stat(path).st_ino != before:
            return False
    except (KVPoolError, OSError):
        return False  # unreadable or already gone: nothing of ours to remove
    Pool.remove(name)
    return True


def pools(args: argparse.Namespace) -> int:
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
            if r["stale"]:
                r["removed"] = remove_if_stale(r["name"])
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return EXIT_OK
    if not rows:
        print("no pools on this host")
        return EXIT_OK
    w = max(len("POOL"), *(len(r["name"]) for r in rows))  # whole names: `top` and `limit` need them
    print(f"{'POOL':<{w}}  {'CAPACITY MiB':>12}  {'COMMITTED MiB':>13}  {'TENANTS':>7}  STATUS")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<{w}}  {'?':>12}  {'?':>13}  {'?':>7}  unreadable: {r['error']}")
            continue
        status = "in use"
        if r["stale"]:
            status = "removed" if r.get("removed") else "stale: no live tenant"
        print(f"{r['name']:<{w}}  {_fmt_mib(r['capacity']):>12}  {_fmt_mib(r['committed']):>13}  "
              f"{r['tenants']:>7}  {status}")
    left = sum(1 for r in rows if r["stale"] and not r.get("removed"))
    if left and not args.gc:
        print(f"{left} pool(s) with no live tenant: `kvpool pools --gc` removes them")
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


# ------------------------------------------------------------------ limit

_LIMIT_EXIT = {"applied": EXIT_OK, "same": EXIT_OK, "stale": EXIT_REFUSED, "conflict": EXIT_REFUSED}


def limit(args: argparse.Namespace) -> int:
    try:
        pool = open_pool(args.pool)
        result = pool.set_limit(args.tenant, args.size, revision=args.revision)
        print(result)
        if args.min is _UNSET:
            return _LIMIT_EXIT[result]
        # The guarantee has its own revisions (the next one); `none` goes
        # back to the equal default share.
        guarantee = pool.set_guarantee(args.tenant, args.min)
    except (LedgerError, ValueError) as e:
        return _error(e)
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
    import threading

    from prometheus_client.exposition import start_http_server

    host, port = args.listen
    try:
        server, thread = start_http_server(port, host, registry=metrics_mod.registry(names))
    except OSError as e:
        return _error(f"cannot listen on {host}:{port}: {e.strerror or e}")
    shown = f"[{host}]" if ":" in host else host
    print(f"serving http://{shown}:{server.server_port}/metrics", flush=True)
    try:
        threading.Event().wait()  # the server thread answers; this one waits for Ctrl-C
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        thread.join()
    return EXIT_OK


# ------------------------------------------------------------------- demo

DEMO_HELP = "several engines share one pool, against a static split (CPU)"


def demo(args: argparse.Namespace) -> int:
    """``kvpool demo``: the only command that imports torch (and only here)."""
    try:
        from . import demo as demo_mod
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
    # The demo's own options live in kvpool.demo, which imports torch: they are
    # parsed there, after the command is known (see main).
    p = sub.add_parser("demo", help=DEMO_HELP, add_help=False)
    p.set_defaults(func=demo)

    p = sub.add_parser("pools", help="list the pools on this host")
    p.add_argument("pools", nargs="*", metavar="POOL", help="only these pools (default: every pool)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--gc", action="store_true",
                   help="remove the listed pools that have no live tenant (never one with a live tenant)")
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
                   help="bytes, or with a K/M/G/KiB/MiB/GiB suffix (binary units), or 'none' to clear")
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
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
