"""The report of ``kvpool demo``: the summary table and the plot (torch-free).

Both take the figures :mod:`kvpool.demo` collects (one dict per mode, as in
its ``--json`` output) and only draw them:

- the table fits 80 columns (short headers, two-space gaps, no edges) and is
  printed without rich's highlighting, so a number is never split into
  differently coloured pieces;
- the sweep's table (``--sweep``) puts the bursts one under the other,
  each engine's elastic and static figures side by side, in 80 columns too;
- the plot shows committed memory per engine per mode with the pool (and the
  static slice) as lines, the legend below the panels, off the data; when the
  run's timeline records waiting requests per engine (``waiting-<e>`` in each
  row), a panel under each mode shows them, which is what explains a stall:
  memory flat while requests queue.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

__all__ = ["ReportConsole", "figure", "plot", "summary_table", "sweep_table"]


class ReportConsole(Console):
    """The demo's console: rich's, with highlighting off by default.

    rich colours what looks like a number in every printed string, and its
    patterns split ``0.40x`` into a cyan ``0.``, a plain ``4`` and a cyan ``0x``
    (a hex prefix); the demo's lines are figures, so none is highlighted.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("highlight", False)
        super().__init__(**kwargs)


def _waiting_series(res: dict[str, Any], e: int) -> list[float] | None:
    """Engine e's waiting requests over the run, if the run's timeline recorded them."""
    rows = res["timeline"]
    key = f"waiting-{e}"
    if not rows or not all(key in row for row in rows):
        return None
    return [float(row[key]) for row in rows]


def plot(results: dict[str, dict[str, Any]], path: str, engines: int) -> None:
    """Write the figure (PNG) to ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(results, engines)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def figure(results: dict[str, dict[str, Any]], engines: int) -> Any:
    """Committed memory per engine, one panel per mode; below each, waiting requests when recorded.

    The legend sits under the panels, never over the data; the waiting panel
    explains a flat stretch (a stall: requests queued for memory, none admitted).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ("elastic", "static")
    with_waiting = all(_waiting_series(results[m], e) is not None for m in modes for e in range(engines))
    ratios = [3, 1] * len(modes) if with_waiting else [1] * len(modes)
    fig, axes = plt.subplots(len(ratios), 1, figsize=(9, 7.5 if with_waiting else 6), sharex=True,
                             gridspec_kw={"height_ratios": ratios})
    colours = [f"C{e % 10}" for e in range(engines)]
    for i, mode in enumerate(modes):
        res = results[mode]
        t = [row["t"] for row in res["timeline"]]
        ax = axes[2 * i] if with_waiting else axes[i]
        for e in range(engines):
            ax.plot(t, [row[f"engine-{e}"] / 2**20 for row in res["timeline"]], color=colours[e],
                    label=f"engine {e}")
        ax.axhline(res["pool_bytes"] / 2**20, color="black", linestyle="--", linewidth=1, label="pool")
        if res["slice_bytes"]:
            ax.axhline(res["slice_bytes"] / 2**20, color="grey", linestyle=":", linewidth=1,
                       label="static slice")
        ax.set_ylim(0, res["pool_bytes"] / 2**20 * 1.08)  # headroom above the pool line
        ax.set_title(f"{mode}: {res['tokens_per_s']:.0f} tok/s, TTFT p99 {res['ttft_p99_s']:.2f} s, "
                     f"{res['wait_s']:.1f} s waiting for memory", fontsize=10)
        ax.set_ylabel("committed MiB")
        if with_waiting:
            wax = axes[2 * i + 1]
            for e in range(engines):
                wax.step(t, _waiting_series(res, e) or [], where="post", color=colours[e], linewidth=1)
            wax.set_ylabel("waiting", fontsize=8)
            wax.set_ylim(bottom=0)
    axes[-1].set_xlabel("seconds")
    # One legend for every panel (an engine has one colour throughout), below them all.
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def summary_table(results: dict[str, dict[str, Any]]) -> Any:
    """Per engine and overall, both modes: fits 80 columns (short headers, two-space gaps, no edges)."""
    from rich import box
    from rich.table import Table

    el, st = results["elastic"], results["static"]
    table = Table(title="kvpool demo: elastic pool vs static split (same trace, same memory)",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True,
                  highlight=False)  # numbers keep one colour: no regex highlighting inside cells
    for col in ("engine", "mode", "requests", "tok/s", "TTFT p50 s", "TTFT p99 s", "wait s", "peak MiB"):
        table.add_column(col, justify="right", no_wrap=True)
    for e in range(len(el["engines"])):
        for res in (el, st):
            p = res["engines"][e]
            table.add_row(str(e), res["mode"], str(p["requests"]), f"{p['tokens_per_s']:.0f}",
                          f"{p['ttft_p50_s']:.2f}", f"{p['ttft_p99_s']:.2f}", f"{p['wait_s']:.1f}",
                          f"{p['peak_committed_bytes'] / 2**20:.1f}")
    for res in (el, st):
        table.add_row("all", res["mode"], str(res["requests"]), f"{res['tokens_per_s']:.0f}",
                      f"{res['ttft_p50_s']:.2f}", f"{res['ttft_p99_s']:.2f}", f"{res['wait_s']:.1f}", "",
                      style="bold")
    return table


def sweep_table(runs: list[dict[str, Any]]) -> Any:
    """``--sweep``: per burst, per engine and all, elastic beside static; fits 80 columns.

    Headers take two lines (figure, then mode) so that ten columns fit; the
    units are in the line the demo prints under the table.
    """
    from rich import box
    from rich.table import Table

    table = Table(title="kvpool demo --sweep: elastic pool vs static split, by burst",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True,
                  highlight=False)
    for col in ("burst", "engine", "p99 s\nelastic", "p99 s\nstatic", "p99\nel/st", "wait s\nelastic",
                "wait s\nstatic", "preempt", "recomp\n%", "static\nms/req"):
        table.add_column(col, justify="right", no_wrap=True)
    for i, run in enumerate(runs):
        if i:
            table.add_section()
        for row in run["engines"]:
            p99, wait = row["ttft_p99_s"], row["wait_s"]
            table.add_row(str(run["burst"]) if row is run["engines"][0] else "",
                          str(row["engine"]), f"{p99['elastic']:.3f}", f"{p99['static']:.3f}",
                          f"{p99['elastic'] / p99['static']:.2f}x" if p99["static"] else "-",
                          f"{wait['elastic']:.2f}", f"{wait['static']:.2f}", str(row["preemptions"]),
                          f"{100 * row['recomputed_share']:.1f}", f"{1e3 * row['static_mean_wait_s']:.1f}",
                          style="bold" if row["engine"] == "all" else None)
    return table
