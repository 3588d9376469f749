"""Project tooling stays honest: every benchmark runs and writes its ratios, the package type-checks."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# script -> what its JSON must hold
BENCHMARKS = {
    "bench_native.py": ("roundtrip", "page", "scale", "ratio"),
    "bench_policy.py": ("roundtrip", "reclaim"),
    "bench_async.py": ("ratio",),
    "bench_pool.py": ("ratio_p50", "cross_process_us", "in_process_us"),
    "bench_peers.py": ("ratio", "floor"),
}


@pytest.mark.timeout(600)  # a hang guard: the benchmarks' own timings are not judged here
@pytest.mark.parametrize("script", sorted(BENCHMARKS))
def test_benchmark_runs_quick_and_writes_json_with_ratios(script: str, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--quick", "--json", str(out)],
        check=True, cwd=tmp_path, capture_output=True,
    )
    text = out.read_text()
    assert json.loads(text)
    for key in BENCHMARKS[script]:
        assert key in text, f"{script}: no {key!r} in its JSON"


@pytest.mark.timeout(900)  # a cold mypy run on a loaded 2-core machine takes minutes
def test_package_passes_mypy_strict() -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed")
    res = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_engine_benchmark_runs_quick_against_real_vllm(tmp_path: pathlib.Path) -> None:
    import os

    if not os.environ.get("KVPOOL_VLLM_PYTHON"):
        pytest.skip("set KVPOOL_VLLM_PYTHON to a vLLM venv's python (scripts/test.sh does)")
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_engines.py"), "--quick", "--json", str(out)],
                   check=True, cwd=tmp_path, capture_output=True)
    res = json.loads(out.read_text())
    assert res["installed_adapter_matches_checkout"] is True
    assert res["blockpool"]["available"] and res["blockpool"]["ratios"]
    gen = res["generation"]
    assert gen["available"] and gen["tokens_identical"] is True and gen["ratio_tokens_per_s"] > 0


SETUP_SCRIPTS = ("setup.sh", "demo.sh", "test.sh", "vllm_venv.sh")


def test_progress_lines_go_to_stderr_with_the_elapsed_time() -> None:
    res = subprocess.run(["bash", "-c", ". scripts/_progress.sh; step building kvpool"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin", "KVPOOL_T0": "0"})
    assert res.returncode == 0 and res.stdout == "", res.stderr  # stdout stays the caller's (demo --json)
    assert re.fullmatch(r"\[kvpool +\d+s\] building kvpool\n", res.stderr), res.stderr


# A command that can take minutes: a venv, a pip install (not the pip self-update), pytest, the demo.
LONG_STEP = re.compile(r"-m venv|pip install (?!-q --upgrade pip)|bin/pytest|bin/kvpool\" demo")


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
