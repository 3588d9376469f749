"""README.md: every Python example runs as printed, and every link lands.

Each ```python block runs on its own in a fresh interpreter (no shared
prelude: a reader copies one block, so each block must stand alone), in an
empty folder, with ``$KVPOOL_POOL`` naming a pool private to the test so the
examples never touch the host's real ``default`` pool. A block that needs
hardware or an engine this machine may lack is marked in the README with an
HTML comment on the line before it, ``<!-- readme-test: needs gpu -->`` or
``<!-- readme-test: needs vllm -->``; it is skipped unless that is present.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvpool import Pool, cuda_unavailable_reason

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"(?:<!-- readme-test: needs (?P<need>\w+) -->\n)?```python\n(?P<code>.*?)^```", re.S | re.M)


def blocks() -> list[tuple[str, str | None, str]]:
    """(an id naming the block by its first line, what it needs, its code)."""
    text = README.read_text()
    out = []
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        out.append((f"README.md:{line}", m.group("need"), m.group("code")))
    return out


def missing(need: str | None) -> str | None:
    if need is None:
        return None
    if need == "gpu":
        return cuda_unavailable_reason() if os.environ.get("KVPOOL_REAL_CUDA") == "1" else "needs a GPU"
    if need == "vllm":
        return None if os.environ.get("KVPOOL_VLLM_PYTHON") else "needs the vLLM venv"
    raise AssertionError(f"unknown readme-test marker: needs {need}")


def test_the_readme_has_python_examples() -> None:
    assert len(blocks()) >= 4  # a regex that matched nothing would pass every test below


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("where", "need", "code"), blocks(), ids=[b[0] for b in blocks()])
def test_readme_example_runs(where: str, need: str | None, code: str, tmp_path: Path) -> None:
    reason = missing(need)
    if reason:
        pytest.skip(reason)
    pool = f"test-readme-{uuid.uuid4().hex[:8]}"
    python = os.environ.get("KVPOOL_VLLM_PYTHON", sys.executable) if need == "vllm" else sys.executable
    try:
        r = subprocess.run([python, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=170,
                           env={**os.environ, "KVPOOL_POOL": pool})
    finally:
        Pool.remove(pool)
    assert r.returncode == 0, f"{where} failed:\n{r.stderr}"


def test_readme_links_point_into_the_repo() -> None:
    text = README.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "expected links to docs/ at least"
    for link in local:
        target = (ROOT / link).resolve()
        assert target.is_relative_to(ROOT), f"{link} points outside the repository"
        assert target.exists(), f"{link} is not in the repository"


def test_every_kvpool_command_line_in_the_readme_parses() -> None:
    import shlex

    from kvpool.cli import _parser

    lines = [ln[2:] for ln in README.read_text().splitlines() if ln.startswith("$ kvpool ")]
    assert len(lines) >= 4
    for line in lines:
        argv = shlex.split(line.split("  #")[0])[1:]  # drop the trailing comment and "kvpool"
        args, rest = _parser().parse_known_args(argv)  # argparse exits (SystemExit) on a bad one
        assert rest == [] or args.command == "demo", line
