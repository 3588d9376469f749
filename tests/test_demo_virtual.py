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
from typing import Any

import pytest

from kvpool import Geometry, KVCacheManager, Pool
from kvpool.demo.cli import COMPUTE_BOUND_BURST, DEFAULT_BURST, options
from kvpool.demo.clock import VirtualClockLoop, VirtualDeadlock, run_virtual
from kvpool.demo.traces import SHAPES
from kvpool.demo.virtual import compare

from ._helpers import until


def _virtual(*argv: str) -> dict[str, dict[str, Any]]:
    return run_virtual(compare(options(["--clock", "virtual", *argv])))


def test_poll_hands_another_tenants_free_to_a_waiter_at_once(pool_name: str) -> None:
    # What the virtual demo relies on: no grant waits for the eventfd wake-up.
    Pool(pool_name, capacity=4 * 4096)
    g = Geometry(1, 1, 512, 64, page_bytes=4096)

    async def main() -> None:
        a, b = (KVCacheManager(g, pool=pool_name, name=n, reserve=(0, 0), reserve_thread=False) for n in "ab")
        held = a.alloc_nowait(32)  # the whole pool
        task = asyncio.create_task(b.alloc(8))
        await until(lambda: b.waiting != 0, "b's alloc queues", interval=0)
        a.free(held)
        b.poll()
        assert b.waiting == 0  # granted inside poll(), before any await
        assert len(await task) == 8
        await a.aclose()
        await b.aclose()

    asyncio.run(main())


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
    from kvpool.demo import virtual as demo_virtual
    from kvpool.space import KVSpace

    # The load these seeds showed it at (the former default, 24 a burst).
    base = _virtual("--trace", shape, "--seed", str(seed), "--burst", str(COMPUTE_BOUND_BURST),
                    "--compute", "per-engine")
    if wake_ups == "never":  # each space's watchers wait on an eventfd no one signals
        silent: dict[int, int] = {}
        monkeypatch.setattr(KVSpace, "wakeup_fd", property(
            lambda space: silent.setdefault(id(space), os.eventfd(0, os.EFD_NONBLOCK))))
    else:
        step = demo_virtual.VirtualEngine._step

        async def signalled_step(self: demo_virtual.VirtualEngine) -> None:
            for eng in [self, *(self.peers or ())]:
                os.eventfd_write(eng.m.space.wakeup_fd, 1)
            await step(self)

        monkeypatch.setattr(demo_virtual.VirtualEngine, "_step", signalled_step)
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
    from kvpool.demo.report import figure

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
# Issue 31 (after issue 14): across 20 seeds, the three trace shapes and
# three loads (10, 16 and 24 requests a burst; 24 is about 22 s of compute
# for 10 s of arrivals), engines computing per engine (each its own device;
# with one shared device a load that saturates compute is a queue for
# compute, not memory), sharing the pool must
#   * leave no engine's TTFT p99 worse than its static slice's (1% tolerance),
#   * recompute at most 2% of the tokens it serves (preemption's cost), and
#   * cut the time waiting for memory to at most 0.5x static wherever every
#     engine alone with the whole pool (the most memory any policy could
#     give it: scripts/demo_virtual_sweep.py --reference) waits at most
#     0.25x static, else to at most 1.0x (there the queue is for compute).
#
# Where a bar is not met yet, the case is a strict xfail with the measured
# reason (the runs are exact: the same figures on any machine), so a change
# that meets it turns the mark into a failure that asks for its removal.
# Measured on this policy (reclaim by completion first, issue 31; bound
# RECLAIM_STEPS = 256; every demo engine keeping its largest request as
# headroom), scripts/demo_virtual_sweep.py --compute per-engine --reference:
#   burst 10: every case meets every bar (as before issue 31: no preemption)
#   burst 16: bursty    worst p99 <= 0.86x, waiting 0.25-0.40x (alone 0.02-0.12x), recompute <= 1.2%
#             (before: recompute up to 15.5%, 18 of 20 seeds over 2%)
#   burst 24: bursty    worst p99 <= 1.02x, waiting 0.76-0.80x (alone 0.38-0.43x), recompute <= 3.5%
#             (before: recompute up to 28%, every seed over 2%)
#             steady    worst p99 <= 1.06x, waiting 0.01-0.65x (alone 0.00-0.01x), at most 2 preemptions
#             saturated worst p99 1.00x but seed 9 (1.71x), waiting 0.82-0.84x (alone 0.78-0.81x)
_HIGH = COMPUTE_BOUND_BURST  # 24 a burst
_BURSTS = (DEFAULT_BURST, 16, _HIGH)
# (burst, shape) where every engine alone with the whole pool waits <= 0.25x
# static, so the waiting bar is 0.5x (else 1.0x). The alone reference does
# not depend on the sharing policy; test_the_alone_reference_sets_the_waiting_bars
# checks it on seed 0 (measured over 20 seeds: burst 10 alone 0.00-0.13x;
# 16 bursty 0.02-0.12x, steady 0.00x, saturated 0.59-0.69x; 24 bursty
# 0.38-0.43x, steady 0.00-0.01x, saturated 0.78-0.81x).
_HALF_BAR = {*((DEFAULT_BURST, shape) for shape in SHAPES), (16, "bursty"), (16, "steady"), (_HIGH, "steady")}

_HEADROOM_TAKEN = ("a light engine's request arrives while the memory kept free for it is held by a neighbour "
                   "that grew within its own guarantee; the borrower is asked to preempt for it (a light "
                   "waiter's headroom is urgent) but only at its next step, so this one request waits about one "
                   "of the saturated engine's steps (saturated 9: 1.71x)")
_P99_MISSES = {(_HIGH, "saturated", 9): _HEADROOM_TAKEN,
               (_HIGH, "bursty", 5): "a bursting engine's request waits for completions below its guarantee "
                                     "instead of preempting (0 preemptions): 1.019x",
               (_HIGH, "steady", 2): "engine 0's requests wait for a neighbour's completions (no preemption, "
                                     "bound 256 steps): 1.062x; one preemption (bound 8) gives 0.27x",
               (_HIGH, "steady", 11): "as steady 2: waits for completions instead of preempting, 1.042x"}
_URGENT = "recomputed: a light engine's headroom (urgent: no completion covers it in time) taken from long requests"
_RECOMPUTE_MISSES = {(_HIGH, "bursty", 2): f"3.3% {_URGENT}", (_HIGH, "bursty", 6): f"3.5% {_URGENT}",
                     (_HIGH, "bursty", 9): f"2.8% {_URGENT}", (_HIGH, "bursty", 15): f"2.05% {_URGENT}",
                     (_HIGH, "bursty", 16): f"2.6% {_URGENT}"}
_WAIT_MISSES = {(_HIGH, "steady", 5): "seed 5 overloads one engine while the others run near their slices: "
                                      "0.66x where the bar is 0.5x (alone 0.00x)"}


@functools.cache
def _acceptance_run(burst: int, shape: str, seed: int) -> dict[str, dict[str, Any]]:
    """Both modes of one acceptance case, per-engine compute: the figures the
    tests below read, run once per case for all of them. The runs are exact,
    so reading one run twice is the same as running it twice."""
    res = _virtual("--trace", shape, "--seed", str(seed), "--burst", str(burst), "--compute", "per-engine")
    return {mode: {"wait_s": r["wait_s"], "tokens": r["tokens"], "recomputed_tokens": r["recomputed_tokens"],
                   "engines": [{"engine": e["engine"], "ttft_p99_s": e["ttft_p99_s"]} for e in r["engines"]]}
            for mode, r in res.items()}


def _cases(misses: dict[tuple[int, str, int], str]) -> list[object]:
    return [pytest.param(burst, shape, seed, marks=pytest.mark.xfail(strict=True, reason=misses[burst, shape, seed]))
            if (burst, shape, seed) in misses else pytest.param(burst, shape, seed)
            for burst in _BURSTS for shape in SHAPES for seed in range(20)]


@pytest.mark.parametrize(("burst", "shape", "seed"), _cases(_P99_MISSES))
def test_no_engine_is_worse_off_sharing_the_pool_than_with_its_static_slice(burst: int, shape: str,
                                                                              seed: int) -> None:
    res = _acceptance_run(burst, shape, seed)
    el, st = res["elastic"], res["static"]
    worse = {e["engine"]: (round(e["ttft_p99_s"], 4), round(s["ttft_p99_s"], 4))
             for e, s in zip(el["engines"], st["engines"]) if e["ttft_p99_s"] > 1.01 * s["ttft_p99_s"]}
    assert not worse, f"TTFT p99 (elastic, static) worse by more than 1% when sharing, by engine: {worse}"


@pytest.mark.parametrize(("burst", "shape", "seed"), _cases(_RECOMPUTE_MISSES))
def test_sharing_recomputes_at_most_two_percent_of_the_tokens_served(burst: int, shape: str, seed: int) -> None:
    el = _acceptance_run(burst, shape, seed)["elastic"]
    assert el["recomputed_tokens"] <= 0.02 * el["tokens"], (
        f"recomputed {el['recomputed_tokens']} of {el['tokens']} tokens served")


@pytest.mark.parametrize(("burst", "shape", "seed"), _cases(_WAIT_MISSES))
def test_sharing_cuts_the_time_waiting_for_memory_as_far_as_the_alone_reference_allows(
        burst: int, shape: str, seed: int) -> None:
    res = _acceptance_run(burst, shape, seed)
    el, st = res["elastic"], res["static"]
    bar = 0.5 if (burst, shape) in _HALF_BAR else 1.0
    assert el["wait_s"] <= bar * st["wait_s"], (
        f"time waiting for memory: elastic {el['wait_s']:.2f} s vs static {st['wait_s']:.2f} s (bar {bar}x)")


@pytest.mark.parametrize("burst", _BURSTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_alone_reference_sets_the_waiting_bars(burst: int, shape: str) -> None:
    # Each engine alone with a pool of the whole capacity: the bar is 0.5x
    # static where that waits <= 0.25x static (seed 0 of each case).
    res = run_virtual(compare(options(["--clock", "virtual", "--trace", shape, "--seed", "0", "--burst", str(burst),
                                       "--compute", "per-engine"]), ("static", "alone")))
    alone, st = res["alone"]["wait_s"], res["static"]["wait_s"]
    assert (alone <= 0.25 * st) == ((burst, shape) in _HALF_BAR), (alone, st)
