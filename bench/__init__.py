"""``kvpool bench``: one harness for every benchmark of kvpool.

``kvpool bench SUITE [--quick] [--json PATH]`` runs one suite (or ``all``),
prints its report and writes every raw figure to a JSON file;
``kvpool bench report PATH... [--write-readme docs/numbers.md]`` turns those files into
the Numbers page (docs/numbers.md) (:mod:`kvpool.bench.report`).

Every figure is printed as a ratio to a baseline measured in the same run
(the absolute numbers move from machine to machine; the ratios compare like
with like), and every goal of an issue is printed with met / UNMET.

Rooms:

- :mod:`.suites`: which suites there are and how one is imported (this
  file's command line and :mod:`.report` both read it);
- :mod:`._timing`: the calibrated loops, interleaved repeats, percentiles
  (the standard library only: the vLLM side imports it too);
- :mod:`._lib`: machine info, goals, page-syscall checks, the vLLM
  interpreter and how its programs run, JSON;
- one module per suite (``native``, ``aio`` for ``async``, ``pool``,
  ``peers``, ``policy``, ``engines``), each with ``run``, ``format_report``
  and ``markdown``;
- :mod:`._vllm_side`: the programs that run inside the vLLM venv
  (``python -m kvpool.bench._vllm_side``), never imported by the harness.

This package imports nothing heavy at import time: ``kvpool --help`` lists
the command without loading torch.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .suites import HELP, SUITES, suite


def add_arguments(sub: Any) -> None:
    """The ``kvpool bench`` subcommands, on an argparse subparsers object (no import of a suite)."""
    for name in (*SUITES, "all"):
        p = sub.add_parser(name, help=HELP.get(name, "every suite above, in that order, into one JSON"))
        p.add_argument("--quick", action="store_true", help="short loops (a smoke test); noisier numbers")
        p.add_argument("--json", default=f"bench-{name}.json", metavar="PATH",
                       help="where to write the raw results (default: %(default)s)")
        if name in ("engines", "all"):
            p.add_argument("--page-bytes", type=int, default=64 * 1024, metavar="N",
                           help="engines: the plugin's page per layer (default: 64 KiB)")
            p.add_argument("--profile", action="store_true", help="engines: cProfile the block pool round trips")
        p.set_defaults(bench=name)
    p = sub.add_parser("report", help="the Numbers page (docs/numbers.md) as markdown, from a bench JSON")
    p.add_argument("paths", nargs="+", metavar="JSON",
                   help="files written by `kvpool bench ... --json` (a later file's suite wins)")
    p.add_argument("--write-readme", metavar="README", default=None,
                   help="also replace each suite's section between its markers in this file (docs/numbers.md)")
    p.set_defaults(bench="report")


def main(args: argparse.Namespace) -> int:
    """Run ``kvpool bench ...`` as parsed by :func:`add_arguments`."""
    if args.bench == "report":
        from . import report

        return report.main(args.paths, args.write_readme)
    from ._lib import machine_info, utc_now, write_json

    names = list(SUITES) if args.bench == "all" else [args.bench]
    args.page_bytes = getattr(args, "page_bytes", 64 * 1024)
    args.profile = getattr(args, "profile", False)
    t0 = time.perf_counter()
    res: dict[str, Any] = {"harness": "kvpool bench", "when": utc_now(), "quick": args.quick,
                           "command": f"kvpool bench {args.bench}" + (" --quick" if args.quick else ""),
                           "machine": machine_info(), "suites": {}}
    failed: list[str] = []
    for name in names:
        mod = suite(name)
        t1 = time.perf_counter()
        out = mod.run(args)
        out["elapsed_s"] = time.perf_counter() - t1
        res["suites"][name] = out
        print(f"== {name}: {mod.TITLE} ({'quick' if args.quick else 'full'}, {out['elapsed_s']:.1f} s)")
        print(mod.format_report({**out, "machine": res["machine"], "quick": args.quick}))
        print(flush=True)
        if out.get("failed"):
            failed.append(f"{name}: {out['failed']}")
        write_json(res, args.json)  # after each suite: a later crash keeps what was measured
    res["elapsed_s"] = time.perf_counter() - t0
    write_json(res, args.json)
    print(f"wrote {args.json} ({res['elapsed_s']:.1f} s)")
    for f in failed:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failed else 0
