"""Project tooling stays honest: every benchmark runs and writes its ratios, the package type-checks."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# script -> what its JSON must hold
BENCHMARKS = {
    "bench_native.py": ("roundtrip", "page", "scale", "ratio"),
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
