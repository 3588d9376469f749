"""The demo's report drawn from made-up figures: a table that fits 80
columns with whole numbers, a plot whose legend is off the data and that
shows waiting requests when the run recorded them."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvpool.demo.report import figure, plot, summary_table

MiB = 1 << 20


def results(waiting: bool) -> dict[str, dict[str, Any]]:
    out = {}
    for mode in ("elastic", "static"):
        timeline = []
        for i in range(50):
            row: dict[str, Any] = {"t": i * 0.1, "engine-0": (i % 20) * 300_000, "engine-1": (20 - i % 20) * 300_000}
            if waiting:
                row["waiting-0"], row["waiting-1"] = i % 3, (i // 10) % 4
            timeline.append(row)
        engines = [{"engine": e, "requests": 54, "tokens": 7380, "tokens_per_s": 738.4 + e,
                    "ttft_p50_s": 0.0123, "ttft_p99_s": 0.404, "wait_s": 10.44, "peak_committed_bytes": 6.8 * MiB}
                   for e in range(2)]
        out[mode] = {"mode": mode, "elapsed_s": 10.0, "pool_bytes": 8 * MiB,
                     "slice_bytes": 4 * MiB if mode == "static" else None, "requests": 108, "tokens": 14760,
                     "tokens_per_s": 1476.8, "ttft_p50_s": 0.0123, "ttft_p99_s": 0.404, "wait_s": 20.9,
                     "engines": engines, "timeline": timeline}
    return out


def test_summary_fits_80_columns_with_whole_headers_and_one_colour_per_number() -> None:
    console = Console(width=80, file=io.StringIO(), force_terminal=True, color_system="truecolor")
    console.print(summary_table(results(waiting=False)))
    ansi = console.file.getvalue()  # type: ignore[attr-defined]
    plain = re.sub(r"\x1b\[[0-9;]*m", "", ansi)
    assert all(len(line) <= 80 for line in plain.splitlines())
    header = next(line for line in plain.splitlines() if "engine" in line and "mode" in line)
    for col in ("engine", "mode", "requests", "tok/s", "TTFT p50 s", "TTFT p99 s", "wait s", "peak MiB"):
        assert col in header  # on the one header line: nothing wrapped
    for number in ("738", "0.01", "0.40", "10.4", "6.8", "1477", "20.9"):
        assert number in ansi  # present with no colour code inside it


@pytest.mark.parametrize("waiting", [False, True])
def test_plot_legend_is_below_the_panels(waiting: bool, tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(results(waiting), 2)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
        legend = fig.legends[0].get_window_extent(renderer)
        for ax in fig.axes:
            assert ax.get_legend() is None  # no legend inside a panel
            assert not legend.overlaps(ax.get_window_extent(renderer))
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        assert labels == ["engine 0", "engine 1", "pool", "static slice"]
        assert len(fig.axes) == (4 if waiting else 2)  # a waiting panel under each mode, when recorded
        if waiting:
            assert fig.axes[1].get_ylabel() == "waiting"
            assert [max(line.get_ydata()) for line in fig.axes[1].get_lines()] == [2, 3]
    finally:
        plt.close(fig)
    out = tmp_path / "demo.png"
    plot(results(waiting), str(out), 2)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
def test_the_demo_prints_its_summary_in_80_columns_with_whole_coloured_numbers(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": "80"}  # colours on, as on a terminal
    r = subprocess.run([sys.executable, "-m", "kvpool.cli", "demo", "--engines", "2", "--duration", "1",
                        "--burst", "2", "--pool-mib", "4", "--check", "1", "--no-live",
                        "--plot", str(tmp_path / "demo.png")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=280, env=env)
    assert r.returncode == 0, r.stderr
    plain = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout)
    assert all(len(line) <= 80 for line in plain.splitlines()), plain
    ratios = re.findall(r"\d+\.\d+x", plain)
    assert len(ratios) == 4, plain  # throughput, TTFT p50, TTFT p99, waiting
    for token in ratios:
        assert token in r.stdout  # "0.40x" was "0." + "4" + "0x" in three colours
