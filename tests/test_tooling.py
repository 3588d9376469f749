"""Project tooling stays honest: every benchmark runs and writes its ratios, the package type-checks."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# suite -> the ratio keys its JSON must hold (the figures themselves are not judged here)
BENCHMARKS = {
    "native": ("hot_path", "ratio", "ratio_to_floor", "ratio_commit", "ratio_to_smallest"),
    "async": ("ratio_await_to_nowait", "p50_ratio_to_depth1", "ratio_to_single"),
    "pool": ("ratio_p50", "cross_process_us", "in_process_us"),
    "peers": ("ratios", "ratio_to_smallest", "floor"),
    "policy": ("ratios", "ratio_p50", "reclaim", "preemption", "verdict_us", "grant_after_free_us"),
}


def run_bench(suite: str, out: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """``kvpool bench SUITE --quick --json OUT`` through the installed package, in OUT's folder."""
    return subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", suite, "--quick", "--json", str(out)],
                          check=True, cwd=out.parent, capture_output=True, text=True)


@pytest.fixture(scope="module")
def quick_json(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    """suite -> its ``--quick`` JSON, run once per module (the report test reuses the suite's run)."""
    done: dict[str, dict[str, Any]] = {}

    def get(suite: str) -> dict[str, Any]:
        if suite not in done:
            out = tmp_path_factory.mktemp(f"bench-{suite}") / "bench.json"
            run_bench(suite, out)
            done[suite] = json.loads(out.read_text())
        return done[suite]

    return get


def keys(obj: object) -> set[str]:
    """Every key of a JSON value, at any depth."""
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in keys(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in keys(v)}
    return set()


@pytest.mark.timeout(600)  # a hang guard: the benchmarks' own timings are not judged here
@pytest.mark.parametrize("suite", sorted(BENCHMARKS))
def test_benchmark_suite_runs_quick_and_writes_json_with_its_ratios(
        suite: str, quick_json: Callable[[str], dict[str, Any]]) -> None:
    res = quick_json(suite)
    assert res["harness"] == "kvpool bench" and res["quick"] is True and res["machine"]["nproc"]
    assert list(res["suites"]) == [suite]
    found = keys(res["suites"][suite])
    for key in BENCHMARKS[suite]:
        assert key in found, f"{suite}: no {key!r} in its JSON"


@pytest.mark.timeout(600)
def test_native_hot_path_prints_every_goal_with_a_verdict_as_a_ratio_measured_in_the_run(
        quick_json: Callable[[str], dict[str, Any]]) -> None:
    hp = quick_json("native")["suites"]["native"]["hot_path"]
    goals = {g["what"]: g for g in hp["goals"]}
    for n in (1, 16, 256):
        for what in (f"KVSpace / deque, n = {n}", f"alloc_nowait / KVSpace, n = {n}",
                     f"await alloc / alloc_nowait, n = {n}", f"steady loop page ops, n = {n}"):
            assert what in goals and goals[what]["met"] in (True, False), what
    assert {g["limit"] for g in goals.values()} == {2.0, 1.0, 0.25, 1.2, 1.5, 0}
    for row in hp["rows"]:
        if row["row"] in ("space", "nowait", "await"):
            assert row["ratio"] == pytest.approx(row["ns"] / row["baseline_ns"])


@pytest.mark.timeout(600)
def test_the_readme_numbers_are_what_the_report_generator_writes_for_a_json(
        quick_json: Callable[[str], dict[str, Any]], tmp_path: pathlib.Path) -> None:
    res = quick_json("native")
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(res))
    readme = tmp_path / "numbers.md"
    original = (ROOT / "docs" / "numbers.md").read_text()  # where the Numbers live since the README split
    readme.write_text(original)
    printed = subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "report", str(path), "--write-readme",
                              str(readme)], check=True, cwd=tmp_path, capture_output=True, text=True).stdout
    written = readme.read_text()
    begin, end = "<!-- bench:native:begin -->", "<!-- bench:native:end -->"
    assert printed.startswith(begin) and printed.rstrip().endswith(end)
    assert printed.rstrip() in written  # what it prints is what it wrote
    # Only the native block changed: the text around it, and the other suites' blocks, are as they were.
    assert written[:written.index(begin)] == original[:original.index(begin)]
    assert written[written.index(end):] == original[original.index(end):]
    assert "KVSpace alloc + free" in printed and re.search(r"\b(met|UNMET)\b", printed)


def test_the_bench_command_needs_no_torch_to_list_or_report() -> None:
    code = ("import sys\nfrom kvpool.cli import _parser\n_parser().parse_args(['bench', 'report', 'x.json'])\n"
            "import kvpool.bench.report\nassert 'torch' not in sys.modules, 'torch was imported'\n"
            "assert not [m for m in sys.modules if m.startswith('vllm')]")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/tmp", timeout=60)


@pytest.mark.timeout(900)  # a cold mypy run on a loaded 2-core machine takes minutes
def test_package_passes_mypy_strict() -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed")
    res = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_engine_benchmark_runs_quick_against_real_vllm(tmp_path: pathlib.Path) -> None:
    import os

    if not os.environ.get("KVPOOL_VLLM_PYTHON"):
        pytest.skip("set KVPOOL_VLLM_PYTHON to a vLLM venv's python (scripts/test.sh does)")
    out = tmp_path / "bench.json"
    # In the checkout: the generation figure runs its tests/vllm_support programs.
    subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "engines", "--quick", "--json", str(out)],
                   check=True, cwd=ROOT / "tests", capture_output=True)
    res = json.loads(out.read_text())["suites"]["engines"]
    assert res["installed_adapter_matches_checkout"] is True
    assert res["blockpool"]["available"] and res["blockpool"]["ratios"]
    gen = res["generation"]
    assert gen["available"] and gen["tokens_identical"] is True and gen["ratio_tokens_per_s"] > 0
    assert {g["what"] for g in res["goals"]} >= {"tokens/s, plugin / vLLM", "get_num_free_blocks, kvpool / vLLM"}


SETUP_SCRIPTS = ("setup.sh", "demo.sh", "test.sh", "vllm_venv.sh", "vllm_src.sh", "sglang_src.sh")


def test_progress_lines_go_to_stderr_with_the_elapsed_time() -> None:
    res = subprocess.run(["bash", "-c", ". scripts/_progress.sh; step building kvpool"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin", "KVPOOL_T0": "0"})
    assert res.returncode == 0 and res.stdout == "", res.stderr  # stdout stays the caller's (demo --json)
    assert re.fullmatch(r"\[kvpool +\d+s\] building kvpool\n", res.stderr), res.stderr


# A command that can take minutes: a venv, a pip install (not the pip self-update) or download, pytest, the demo.
LONG_STEP = re.compile(r"-m venv|pip install (?!-q --upgrade pip)|pip download|bin/pytest|bin/kvpool\" demo")


@pytest.mark.parametrize("script", SETUP_SCRIPTS)
def test_every_long_setup_step_announces_itself_first(script: str) -> None:
    lines = [ln.strip() for ln in (ROOT / "scripts" / script).read_text().splitlines()]
    assert ". scripts/_progress.sh" in lines
    announced = False
    for ln in lines:
        if ln.startswith("step "):
            announced = True
        elif LONG_STEP.search(ln):
            assert announced, f"{script}: {ln!r} runs without a progress line before it"
            announced = False
