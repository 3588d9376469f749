"""The tree keeps its rooms: the demo and the benchmarks are packages of their own, shipped inside kvpool.

``demo/`` and ``bench/`` are installed as ``kvpool.demo`` and
``kvpool.bench`` (pyproject's ``wheel.packages``, as ``adapters/`` is
``kvpool.adapters``). The library never imports them, but ``kvpool/cli.py``
does, inside the ``demo`` and ``bench`` commands. Within each, no module
imports one that imports it back, directly or through others (issue 34: the
demo's engines and its virtual clock used to import each other).

These read the source tree's imports (every ``import`` statement, a
function's lazy ones too; not ``importlib`` calls, which only
bench/suites.py makes, to load a suite), not the installed package.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = {"demo": "kvpool.demo", "bench": "kvpool.bench"}


def module_name(path: pathlib.Path, package: str) -> str:
    return package if path.stem == "__init__" else f"{package}.{path.stem}"


def imports(path: pathlib.Path, package: str) -> set[str]:
    """Every module ``path`` imports (at any depth), relative imports resolved as installed under ``package``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # one level: this package (every module here is directly in it)
                assert node.level == 1, f"{path}: {ast.unparse(node)}"
                base = f"{package}.{base}" if base else package
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from . import virtual` names a module
    return found


def graph(folder: str) -> dict[str, set[str]]:
    package = FOLDERS[folder]
    files = sorted((ROOT / folder).glob("*.py"))
    names = {module_name(f, package) for f in files}
    return {module_name(f, package): (imports(f, package) & names) - {module_name(f, package)} for f in files}


def cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``edges`` ([] if none): depth-first search, grey nodes on the stack."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_no_module_imports_one_that_imports_it_back(folder: str) -> None:
    edges = graph(folder)
    assert len(edges) > 3, edges  # the folder was read
    assert cycle(edges) == []


def test_the_demo_package_imports_nothing_at_its_top() -> None:
    # So that `kvpool.demo.report` and `.traces` load without torch.
    assert graph("demo")["kvpool.demo"] == set()
    assert not imports(ROOT / "demo" / "__init__.py", "kvpool.demo")


def test_the_library_imports_the_demo_and_bench_only_from_its_cli() -> None:
    for path in sorted((ROOT / "kvpool").rglob("*.py")):
        found = imports(path, "kvpool")
        hits = {m for m in found if m.split(".")[:2] in (["kvpool", "demo"], ["kvpool", "bench"])}
        if path.name == "cli.py":
            tree = ast.parse(path.read_text())
            top = {ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
            assert not any("demo" in t or "bench" in t for t in top), top  # only inside a command
        else:
            assert not hits, f"{path.relative_to(ROOT)} imports {sorted(hits)}"


@pytest.mark.parametrize("module", ["kvpool.demo.cli", "kvpool.demo.virtual", "kvpool.bench.report",
                                    "kvpool.bench.suites"])
def test_the_packages_ship_inside_kvpool(module: str) -> None:
    import kvpool

    mod = importlib.import_module(module)
    assert pathlib.Path(mod.__file__ or "").is_relative_to(pathlib.Path(kvpool.__file__ or "").parent)
