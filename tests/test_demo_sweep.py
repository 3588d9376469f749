"""`kvpool demo --sweep`: the virtual demo at several bursts, side by side (issue 31, item 5).

Every figure asserted is virtual time (exact on any machine); nothing here
reads the machine's clock.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvpool.demo.cli import add_arguments, run
from kvpool.demo.report import sweep_table
from kvpool.demo.sweep import DEFAULT_SWEEP, parse_bursts
from kvpool.demo.traces import make_trace


@pytest.fixture(scope="module")
def default_sweep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``kvpool demo --sweep --json`` with every other option at its default, run once for the tests below."""
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "demo", "--sweep", "--json"],
                         cwd=tmp_path_factory.mktemp("sweep"), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def test_the_default_sweep_runs_bursts_10_16_24_with_one_row_per_engine_and_one_for_all(
        default_sweep: dict[str, Any]) -> None:
    data = default_sweep
    assert DEFAULT_SWEEP == (10, 16, 24)
    assert data["sweep"] == [10, 16, 24] and data["clock"] == "virtual" and data["compute"] == "shared"
    assert [r["burst"] for r in data["runs"]] == [10, 16, 24]
    for r in data["runs"]:
        trace = make_trace(data["engines"], data["duration"], r["burst"], data["seed"], data["trace"])
        assert r["requests"] == len(trace) == r["elastic"]["requests"] == r["static"]["requests"]
        assert r["same_requests_served"]
        assert [e["engine"] for e in r["engines"]] == [0, 1, 2, "all"]
        *engines, whole = r["engines"]
        for mode in ("elastic", "static"):
            assert sum(e["wait_s"][mode] for e in engines) == pytest.approx(whole["wait_s"][mode])
            assert whole["ttft_p99_s"][mode] == r[mode]["ttft_p99_s"]
        assert sum(e["preemptions"] for e in engines) == whole["preemptions"] == r["elastic"]["preemptions"]
        assert all(0 <= e["recomputed_share"] <= 1 for e in r["engines"])
        assert whole["static_mean_wait_s"] == pytest.approx(r["static"]["wait_s"] / r["requests"])
        assert "timeline" not in r["elastic"] and "outputs" not in r["static"]


def test_a_static_slice_waits_longer_the_larger_the_burst(default_sweep: dict[str, Any]) -> None:
    # Each burst is its own trace, so this is measured, not a law: over 3
    # shapes x 20 seeds x both --compute modes at 10, 12 and 16 a burst, a
    # static slice's mean wait a request rose with the burst in 118 of 120
    # cases (the two others: per-engine steady seeds 9 and 19, where a slice
    # waits under 8 ms a request at any of them). Seed 0, bursty, shared
    # compute at 10, 16, 24: 288, 2042, 5454 ms.
    means = [r["engines"][-1]["static_mean_wait_s"] for r in default_sweep["runs"]]
    assert means == sorted(means) and means[0] > 0, means
    for e in range(3):
        per_engine = [r["engines"][e]["wait_s"]["static"] for r in default_sweep["runs"]]
        assert per_engine == sorted(per_engine), (e, per_engine)


def test_the_sweep_table_fits_80_columns_with_a_row_per_burst_per_engine(default_sweep: dict[str, Any]) -> None:
    console = Console(width=80, file=io.StringIO(), force_terminal=False)
    console.print(sweep_table(default_sweep["runs"]))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert all(len(line) <= 80 for line in text.splitlines()), text
    cells = [line.split() for line in text.splitlines()]
    # A burst's first row reads "burst engine ..." (10 cells), the others "engine ..." (9).
    rows = [c for c in cells if len(c) in (9, 10) and (c[0].isdigit() or c[0] == "all")]
    assert [int(c[0]) for c in rows if len(c) == 10] == [10, 16, 24]
    assert [c[-9] for c in rows] == ["0", "1", "2", "all"] * 3


@pytest.mark.parametrize(("value", "message"), [
    ("10,x", "integers separated by commas"),
    ("", "integers separated by commas"),
    ("0,16", "every burst must be >= 1"),
    ("16,16", "given twice"),
])
def test_a_bad_sweep_exits_2_naming_what_is_wrong(value: str, message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert run(ap.parse_args(["--sweep", value])) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool demo: --sweep") and message in err, err


@pytest.mark.parametrize("other", [["--clock", "real"], ["--processes"]])
def test_a_sweep_refuses_the_real_clock_and_processes(other: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert run(ap.parse_args(["--sweep", *other])) == 2
    assert "--sweep runs on the virtual clock" in capsys.readouterr().err


def test_kvpool_demo_says_what_is_wrong_with_a_sweep_and_exits_2(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "demo", "--sweep", "10,sixteen"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stdout == ""
    assert "kvpool demo: --sweep takes requests a burst as integers separated by commas" in out.stderr
    assert "'10,sixteen'" in out.stderr


def test_parse_bursts_keeps_the_order_given() -> None:
    assert parse_bursts("24, 10,16") == (24, 10, 16)
