"""README.md: what a newcomer needs on one page, and nothing that drifts from the rest (issue 32).

The README keeps the two commands, the demo's table, one example per
audience, a few figures and the links to docs/; everything else lives in
docs/. tests/test_docs.py runs its examples and follows its links (with
every docs page's); this module checks what is particular to the README.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TWO_COMMANDS = """```bash
scripts/demo.sh     # installs kvpool (CPU) into .venv and runs `kvpool demo`
scripts/test.sh     # installs kvpool with test extras into .venv and runs the whole suite
```"""


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def test_the_readme_is_a_page_a_newcomer_reads() -> None:
    assert len(README.read_text().splitlines()) <= 250


def test_the_readme_keeps_the_two_commands() -> None:
    # .ci/run is scripts/test.sh: the README's command is CI's.
    assert TWO_COMMANDS in section("Two commands")
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_has_an_example_for_each_audience() -> None:
    using = section("Using it")
    assert re.search(r"```python\n(?:.*\n)*?.*await kv\.alloc\(", using)  # an engine author
    assert "KVPOOL_VLLM=1 python -m vllm.entrypoints.openai.api_server --model" in using  # a vLLM user
    for command in ("kvpool pools", "kvpool limit", "kvpool top"):  # an operator
        assert f"$ {command} " in using, command


def test_the_readmes_figures_are_the_numbers_pages() -> None:
    # The README quotes a few figures of docs/numbers.md, which `kvpool bench report` writes: each must be there.
    numbers = (ROOT / "docs" / "numbers.md").read_text()
    figures = re.findall(r"\d+\.\d+(?: / \d+\.\d+)* ?(?:µs|×)|\d{1,3}(?:,\d{3})+", section("Numbers"))
    assert len(figures) >= 8
    missing = [f for f in figures if f not in numbers]
    assert not missing, f"README figures not in docs/numbers.md: {missing}"
    date = re.search(r"on (\d{4}-\d\d-\d\d)", section("Numbers"))
    assert date and f", {date.group(1)} (" in numbers  # the date the README gives is a run's date there
