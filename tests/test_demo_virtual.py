"""`kvpool demo --clock virtual`: the real managers and pool on a virtual clock (issue 14).

No test here reads the machine's clock: every figure asserted is virtual time,
so the assertions hold on a quiet machine and a busy one alike.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import pathlib
import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from kvpool import Geometry, KVCacheManager, Pool
from kvpool._demo_clock import VirtualClockLoop, VirtualDeadlock, run_virtual
from kvpool._demo_traces import SHAPES
from kvpool._demo_virtual import compare
from kvpool.demo import COMPUTE_BOUND_BURST, DEFAULT_BURST, options


def _virtual(*argv: str) -> dict[str, dict[str, Any]]:
    return run_virtual(compare(options(["--clock", "virtual", *argv])))


def test_poll_hands_another_tenants_free_to_a_waiter_at_once() -> None:
    # What the virtual demo relies on: no grant waits for the eventfd wake-up.
    name = f"demo-poll-{uuid.uuid4().hex[:8]}"
    Pool(name, capacity=4 * 4096)
    g = Geometry(1, 1, 512, 64, page_bytes=4096)

    async def main() -> None:
        a, b = (KVCacheManager(g, pool=name, name=n, reserve=(0, 0), reserve_thread=False) for n in "ab")
        held = a.alloc_nowait(32)  # the whole pool
        task = asyncio.create_task(b.alloc(8))
        while b.waiting == 0:
            await asyncio.sleep(0)
        a.free(held)
        b.poll()
        assert b.waiting == 0  # granted inside poll(), before any await
        assert len(await task) == 8
        await a.aclose()
        await b.aclose()

    try:
        asyncio.run(main())
    finally:
        Pool.remove(name)


def test_the_virtual_clock_jumps_to_each_timer_in_program_order() -> None:
    order: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        order.append((name, asyncio.get_running_loop().time()))

    async def main() -> None:
        # Same deadline for b and c: they wake in the order they slept.
        await asyncio.gather(sleeper("a", 3600.0), sleeper("b", 60.0), sleeper("c", 60.0))

    run_virtual(main())
    assert order == [("b", 60.0), ("c", 60.0), ("a", 3600.0)]


def test_a_virtual_run_where_every_task_waits_forever_raises_instead_of_hanging() -> None:
    async def main() -> None:
        await asyncio.Event().wait()

    with pytest.raises(VirtualDeadlock, match="every task waits"):
        run_virtual(main())
    assert issubclass(VirtualClockLoop, asyncio.SelectorEventLoop)


def test_the_same_seed_gives_identical_json(tmp_path: pathlib.Path) -> None:
    argv = [sys.executable, "-m", "kvpool.cli", "demo", "--clock", "virtual", "--trace", "saturated",
            "--seed", "7", "--plot", str(tmp_path / "demo.png"), "--json"]
    runs = [subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=240) for _ in range(2)]
    for out in runs:
        assert out.returncode == 0, out.stderr
    assert runs[0].stdout == runs[1].stdout
    data = json.loads(runs[0].stdout)
    assert data["clock"] == "virtual" and data["torch_threads"] == 1 and data["trace"] == "saturated"
    assert set(data["step_model"]) >= {"prefill_s", "decode_seq_s", "kv_block_s"}
    assert data["correctness"]["checked"] == 0 and data["correctness"]["same_requests_served"]
    assert set(data["ratios_elastic_over_static"]) >= {"tokens_per_s", "ttft_p99", "wait"}
    for mode in ("elastic", "static"):
        assert data[mode]["requests"] == data["requests"]
        assert all("ttft_p99_s" in e for e in data[mode]["engines"])
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("wake_ups", ["never", "before every step"])
@pytest.mark.parametrize(("shape", "seed"), [("steady", 12), ("steady", 6)])
def test_when_a_native_wake_up_arrives_changes_nothing(shape: str, seed: int, wake_ups: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The native watcher signals a space's eventfd at a real time the virtual
    # clock cannot see: on a busy machine later, in virtual time, than on a
    # quiet one. Until 2026-12-03 some grants waited for that wake-up: steady
    # seed 12 gave another elastic TTFT under six CPU-bound processes, and the
    # same as that when no wake-up ever came. A run must be the same whether
    # the wake-ups never come or come before every step (the earliest).
    from kvpool import _demo_virtual
    from kvpool.space import KVSpace

    # The load these seeds showed it at (the former default, 24 a burst).
    base = _virtual("--trace", shape, "--seed", str(seed), "--burst", str(COMPUTE_BOUND_BURST),
                    "--compute", "per-engine")
    if wake_ups == "never":  # each space's watchers wait on an eventfd no one signals
        silent: dict[int, int] = {}
        monkeypatch.setattr(KVSpace, "wakeup_fd", property(
            lambda space: silent.setdefault(id(space), os.eventfd(0, os.EFD_NONBLOCK))))
    else:
        step = _demo_virtual.VirtualEngine._step

        async def signalled_step(self: _demo_virtual.VirtualEngine) -> None:
            for eng in [self, *(self.peers or ())]:
                os.eventfd_write(eng.m.space.wakeup_fd, 1)
            await step(self)

        monkeypatch.setattr(_demo_virtual.VirtualEngine, "_step", signalled_step)
    try:
        other = _virtual("--trace", shape, "--seed", str(seed), "--burst", str(COMPUTE_BOUND_BURST),
                         "--compute", "per-engine")
    finally:
        monkeypatch.undo()
        if wake_ups == "never":
            for fd in silent.values():
                os.close(fd)
    for mode in ("elastic", "static"):
        assert other[mode]["engines"] == base[mode]["engines"], mode
        assert other[mode]["wait_s"] == base[mode]["wait_s"], mode


@pytest.mark.parametrize("shape", SHAPES)
def test_both_modes_serve_every_request_and_static_stays_in_its_slice(shape: str) -> None:
    res = _virtual("--trace", shape, "--seed", "1")
    assert res["elastic"]["requests"] == res["static"]["requests"] > 0
    assert set(res["elastic"]["outputs"]) == set(res["static"]["outputs"])
    slice_bytes = res["static"]["slice_bytes"]
    assert all(e["peak_committed_bytes"] <= slice_bytes for e in res["static"]["engines"])
    assert all(e["peak_committed_bytes"] <= res["elastic"]["pool_bytes"] for e in res["elastic"]["engines"])


def test_an_engine_borrows_beyond_its_slice_when_the_others_are_idle() -> None:
    res = _virtual("--trace", "bursty", "--seed", "2")
    assert max(e["peak_committed_bytes"] for e in res["elastic"]["engines"]) > res["static"]["slice_bytes"]


def test_sixteen_engines_share_a_million_block_pool() -> None:
    # The what-if of the issue: a GPU-sized pool, long prompts; bounded by the
    # test timeout, not by a wall-clock assertion.
    res = _virtual("--engines", "16", "--pool-blocks", str(1 << 20), "--prompt-scale", "256", "--burst", "60",
                   "--duration", "600", "--compute", "per-engine")
    el, st = res["elastic"], res["static"]
    assert len(el["engines"]) == len(st["engines"]) == 16
    assert el["requests"] == st["requests"] == 16 * (2 * 60 + 15)
    assert st["wait_s"] > 0  # the slices really are contended
    assert el["pool_bytes"] == (1 << 20) * 32 * 1024  # reported in the real engines' bytes


def test_the_timeline_records_requests_waiting_for_memory_and_the_plot_shows_them() -> None:
    # Issue 13: nothing on the plot explained a stall. Every monitor row now
    # has waiting-<e> (requests queued for KV) beside engine-<e> (memory).
    from kvpool.demo_report import figure

    res = _virtual("--trace", "bursty", "--seed", "1")
    for mode in ("elastic", "static"):
        rows = res[mode]["timeline"]
        for e, eng in enumerate(res[mode]["engines"]):
            series = [row[f"waiting-{e}"] for row in rows]
            assert all(isinstance(n, int) and 0 <= n <= eng["requests"] for n in series)
    st = res["static"]
    assert st["wait_s"] > 0  # the slices are contended in this trace...
    assert any(row[f"waiting-{e}"] > 0 for row in st["timeline"] for e in range(len(st["engines"])))  # ...and seen
    fig = figure(res, len(st["engines"]))
    try:
        assert len(fig.axes) == 4 and fig.axes[3].get_ylabel() == "waiting"  # a waiting panel under each mode
        drawn = [list(line.get_ydata()) for line in fig.axes[3].get_lines()]
        assert drawn == [[row[f"waiting-{e}"] for row in st["timeline"]] for e in range(len(st["engines"]))]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_the_virtual_clock_runs_in_one_process_only() -> None:
    with pytest.raises(ValueError, match="--processes"):
        options(["--clock", "virtual", "--processes"])


# ------------------------------------------------------------------ acceptance
#
# Issue 14: across 20 seeds and the three trace shapes, sharing must leave no
# engine worse off than its static slice (TTFT p99), and must at least halve
# the time requests wait for memory. Engines compute per engine here (each its
# own device): with one shared device a load that saturates compute is a
# queue for compute, not memory (elastic's waiting is 0.8-0.97x static's
# whatever the policy, since no memory policy shortens a queue for compute).
# Two loads: the demo's default (10 a burst, which the engines' compute keeps
# up with) and the former default (24 a burst: about 22 s of compute for 10 s
# of arrivals, compute-bound), kept so that the gap at high load stays seen.

# Where the bar is not met yet, the case is a strict xfail with the measured
# reason (the runs are exact: the same figures on any machine), so a change
# that meets it turns the mark into a failure that asks for its removal.
# Measured on this policy, every demo engine keeping its largest request as
# headroom (scripts/demo_virtual_sweep.py --compute per-engine --reference
# [--burst 24]); "alone" is each engine with a pool of the whole capacity to
# itself, the most memory any sharing policy could give it:
#   burst 10: bursty    worst p99 0.02-0.04x, waiting 0.00x (alone 0.00x)
#             steady    nobody waits for memory in either mode; p99 1.00x
#             saturated worst p99 1.00x, waiting 0.00-0.26x (alone 0.00-0.13x)
#   burst 24: bursty    worst p99 0.87-1.01x, waiting 0.75-0.80x (alone 0.38-0.43x)
#             steady    worst p99 0.14-1.00x, waiting 0.01-0.68x (alone 0.00-0.01x)
#             saturated worst p99 1.00x but seed 9 (1.71x), waiting 0.82-0.84x (alone 0.78-0.81x)
# Before the headroom rule (burst 24): p99 worse than static in 22 of 60 runs
# (bursty 0.85-1.04x, every saturated seed 2.05-5.20x); waiting bursty
# 0.69-0.76x, steady 0.00-0.56x, saturated 0.80-0.83x.
_HEADROOM_TAKEN = ("a request arrives while the memory kept free for it is held by a neighbour that grew within "
                   "its own guarantee; the borrower restores it only as its running requests finish (it is not "
                   "asked to preempt), so this one request waits (bursty 11: 1.006x, saturated 9: 1.71x)")
_HIGH = COMPUTE_BOUND_BURST  # 24 a burst: the figures below are measured at it
_BURSTS = (DEFAULT_BURST, _HIGH)
_P99_MISSES = {(_HIGH, "bursty", 11), (_HIGH, "saturated", 9)}
_WAIT_MISSES = {*((_HIGH, "bursty", s) for s in range(20)), (_HIGH, "steady", 5), (_HIGH, "steady", 6),
                *((_HIGH, "saturated", s) for s in range(20))}
_WAIT_WHY = {(_HIGH, "bursty"): "borrowing cuts waiting to 0.75-0.80x, where an engine alone with the whole pool "
                             "waits 0.38-0.43x: overlapping bursts split the pool and lending preempts",
             (_HIGH, "steady"): "seeds 5 and 6 overload one engine while the others run near their slices "
                             "(0.68x, 0.63x)",
             (_HIGH, "saturated"): "the saturated engine is compute-bound (about 1,515 of 2,765 tokens/s demanded): "
                                "even alone with the whole pool it waits 0.78-0.81x"}


@functools.cache
def _acceptance_run(burst: int, shape: str, seed: int) -> dict[str, dict[str, Any]]:
    """Both modes of one acceptance case, per-engine compute: the figures the
    tests below read (waiting, each engine's TTFT p99), run once per case for
    all of them. The runs are exact, so reading one run twice is the same as
    running it twice."""
    res = _virtual("--trace", shape, "--seed", str(seed), "--burst", str(burst), "--compute", "per-engine")
    return {mode: {"wait_s": r["wait_s"],
                   "engines": [{"engine": e["engine"], "ttft_p99_s": e["ttft_p99_s"]} for e in r["engines"]]}
            for mode, r in res.items()}


def _cases(misses: set[tuple[int, str, int]], why: Callable[[int, str], str]) -> list[object]:
    return [pytest.param(burst, shape, seed, marks=pytest.mark.xfail(strict=True, reason=why(burst, shape)))
            if (burst, shape, seed) in misses else pytest.param(burst, shape, seed)
            for burst in _BURSTS for shape in SHAPES for seed in range(20)]


@pytest.mark.parametrize(("burst", "shape", "seed"), _cases(_P99_MISSES, lambda burst, shape: _HEADROOM_TAKEN))
def test_no_engine_is_worse_off_sharing_the_pool_than_with_its_static_slice(burst: int, shape: str,
                                                                              seed: int) -> None:
    res = _acceptance_run(burst, shape, seed)
    el, st = res["elastic"], res["static"]
    worse = {e["engine"]: (round(e["ttft_p99_s"], 3), round(s["ttft_p99_s"], 3))
             for e, s in zip(el["engines"], st["engines"]) if e["ttft_p99_s"] > s["ttft_p99_s"]}
    assert not worse, f"TTFT p99 (elastic, static) worse when sharing, by engine: {worse}"


@pytest.mark.parametrize(("burst", "shape", "seed"),
                         _cases(_WAIT_MISSES, lambda burst, shape: _WAIT_WHY[burst, shape]))
def test_sharing_the_pool_halves_the_time_waiting_for_memory(burst: int, shape: str, seed: int) -> None:
    res = _acceptance_run(burst, shape, seed)
    el, st = res["elastic"], res["static"]
    assert el["wait_s"] <= 0.5 * st["wait_s"], (
        f"time waiting for memory: elastic {el['wait_s']:.1f} s vs static {st['wait_s']:.1f} s")


@pytest.mark.parametrize(("burst", "shape", "seed"), _cases(set(), lambda burst, shape: ""))
def test_sharing_the_pool_never_lengthens_the_time_waiting_for_memory(burst: int, shape: str, seed: int) -> None:
    # Where the halving above is not met, sharing must still not make the
    # engines wait longer in all than their static slices do.
    res = _acceptance_run(burst, shape, seed)
    el, st = res["elastic"], res["static"]
    assert el["wait_s"] <= st["wait_s"], (
        f"time waiting for memory: elastic {el['wait_s']:.1f} s vs static {st['wait_s']:.1f} s")
