"""Project tooling stays honest: the benchmark runs, the package type-checks."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_native_benchmark_runs_and_writes_its_ratios(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_native.py"), "--quick", "--json", str(out)],
        check=True, cwd=tmp_path, capture_output=True,
    )
    data = json.loads(out.read_text())
    text = json.dumps(data)
    for key in ("roundtrip", "page", "scale"):
        assert key in text
    assert "ratio" in text


@pytest.mark.timeout(120)
def test_async_benchmark_runs_and_writes_its_ratios(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_async.py"), "--quick", "--json", str(out)],
        check=True, cwd=tmp_path, capture_output=True,
    )
    text = out.read_text()
    data = json.loads(text)
    assert data and "ratio" in text


@pytest.mark.timeout(180)
def test_pool_benchmark_runs_and_writes_its_ratio(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_pool.py"), "--quick", "--json", str(out)],
        check=True, cwd=tmp_path, capture_output=True,
    )
    data = json.loads(out.read_text())
    assert data["ratio_p50"] > 0 and len(data["cross_process_us"]["raw"]) == data["rounds"]


@pytest.mark.timeout(180)
def test_peer_benchmark_runs_against_its_floor(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_peers.py"), "--quick", "--json", str(out)],
        check=True, cwd=tmp_path, capture_output=True,
    )
    text = out.read_text()
    json.loads(text)
    assert "ratio" in text and "floor" in text


@pytest.mark.timeout(300)
def test_package_passes_mypy_strict() -> None:
    if shutil.which("mypy") is None and not _has_module("mypy"):
        pytest.skip("mypy is not installed")
    res = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
