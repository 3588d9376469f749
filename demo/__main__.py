"""The engine process of ``kvpool demo --processes``: ``python -m kvpool.demo --worker MODE INDEX POOL [options]``.

Started by :func:`kvpool.demo.realtime.run_mode_processes`, once per engine;
``kvpool demo`` itself is :mod:`kvpool.demo.cli`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from .cli import EXIT_INTERRUPTED, add_arguments, derive
from .realtime import worker


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[0] != "--worker":
        print("usage: python -m kvpool.demo --worker MODE INDEX POOL [options]  (started by `kvpool demo "
              "--processes`; the demo itself is `kvpool demo`)", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(argv[4:])
    derive(args)
    try:
        asyncio.run(worker(argv[1], int(argv[2]), argv[3], args))
    except KeyboardInterrupt:  # Ctrl-C reaches every worker too: the parent says it, once
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
