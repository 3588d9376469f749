"""``kvpool bench report``: the Numbers page (docs/numbers.md), generated from a bench JSON.

Each suite of the JSON becomes one markdown block between its markers::

    <!-- bench:native:begin -->
    `kvpool bench native` on <machine>, <date>: ...
    <!-- bench:native:end -->

``kvpool bench report PATH...`` prints the blocks (markers included);
``--write-readme docs/numbers.md`` also replaces each block between the same
markers in that file, leaving every other suite's block as it was, so a
suite run on another occasion (``engines`` needs the vLLM venv) updates only
its own. A suite whose figures were not measured (no vLLM interpreter) is
left out, and said so on stderr: a skipped run never overwrites numbers.

This module reads JSON only: no numpy, no torch, no kvpool space.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._lib import machine_line
from .suites import suite


def begin(name: str) -> str:
    return f"<!-- bench:{name}:begin -->"


def end(name: str) -> str:
    return f"<!-- bench:{name}:end -->"


def measured(suite_res: Mapping[str, Any]) -> bool:
    """Whether a suite measured its figures (engines without a vLLM interpreter did not)."""
    return all(suite_res.get(k, {}).get("available", True) for k in ("blockpool", "vllm_side")) \
        and suite_res.get("available", True)


def blocks(res: Mapping[str, Any]) -> dict[str, str]:
    """suite -> its README block (markers included), for every suite of ``res`` that measured its figures."""
    out: dict[str, str] = {}
    for name, sres in res["suites"].items():
        if not measured(sres):
            continue
        head = (f"`kvpool bench {name}{' --quick' if res['quick'] else ''}` on {machine_line(res['machine'])}, "
                f"{res['when'][:10]} ({sres['elapsed_s']:.0f} s; every raw repeat in its JSON):")
        body = suite(name).markdown({**sres, "machine": res["machine"], "quick": res["quick"]})
        out[name] = f"{begin(name)}\n{head}\n\n{body}\n{end(name)}"
    return out


def render(res: Mapping[str, Any]) -> str:
    """The markdown ``kvpool bench report`` prints: the blocks, a blank line between."""
    return "\n\n".join(blocks(res).values()) + "\n"


def write_readme(readme: str, res: Mapping[str, Any]) -> str:
    """``readme`` with each measured suite's block replaced between its markers."""
    for name, block in blocks(res).items():
        pattern = re.compile(re.escape(begin(name)) + r".*?" + re.escape(end(name)), re.S)
        found = list(pattern.finditer(readme))
        if len(found) != 1:
            raise ValueError(f"the README needs exactly one {begin(name)} ... {end(name)} pair for suite {name!r}")
        readme = readme[:found[0].start()] + block + readme[found[0].end():]
    return readme


def main(paths: Sequence[str], readme_path: str | None) -> int:
    """Print the blocks of every file (a later file's suite replaces an earlier one's); write them if asked."""
    merged: dict[str, str] = {}
    results: list[Mapping[str, Any]] = []
    for path in paths:
        try:
            res = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            print(f"kvpool: error: cannot read {path}: {e}", file=sys.stderr)
            return 2
        if not isinstance(res, dict) or "suites" not in res:
            print(f"kvpool: error: {path} is not a `kvpool bench` JSON (no 'suites')", file=sys.stderr)
            return 2
        for name, sres in res["suites"].items():
            if not measured(sres):
                print(f"kvpool bench report: {path}: {name} measured nothing (left out)", file=sys.stderr)
        merged.update(blocks(res))
        results.append(res)
    sys.stdout.write("\n\n".join(merged.values()) + "\n")
    if readme_path is not None:
        p = Path(readme_path)
        try:
            text = p.read_text()
            for res in results:
                text = write_readme(text, res)
            p.write_text(text)
        except (OSError, ValueError) as e:
            print(f"kvpool: error: {readme_path}: {e}", file=sys.stderr)
            return 2
        print(f"wrote {', '.join(merged)} into {readme_path}", file=sys.stderr)
    return 0
