"""Timing loops and percentiles of the benchmark harness: the standard library only.

A *body* ``body(iters)`` runs its own loop of ``iters`` iterations; the
helpers time whole loops, so the clock is read twice per repeat, not per
call. ``repeat_ns`` calibrates ``iters`` so that one repeat lasts about
``target_s`` and returns the median of the repeats with every raw value.
``interleaved_ns`` does the same for several bodies at once, their repeats
taken in turn (A B C, A B C, ...), so that a load change on a shared machine
hits every contender alike: use it wherever figures are compared as a ratio.

Why the standard library only: the vLLM-side programs
(:mod:`kvpool.bench._vllm_side`) import this module in the vLLM venv, where
the harness's numpy and kvpool build may differ, and a figure measured there
must be timed by the same loops as its baseline here.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

SyncBody = Callable[[int], None]
AsyncBody = Callable[[int], Awaitable[None]]
MAX_ITERS = 1 << 24  # calibration stops growing the loop here
WARMUP_ITERS = 16


@contextmanager
def no_gc() -> Iterator[None]:
    """Collect once, then keep the garbage collector off for the block."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _next_iters(iters: int, elapsed_ns: int, target_s: float, max_iters: int) -> int:
    """The calibrated count once a loop of ``iters`` took ``elapsed_ns``, or 0 to try 4x more."""
    elapsed = elapsed_ns / 1e9
    if elapsed >= target_s / 4 or iters >= max_iters:
        return max(WARMUP_ITERS, int(iters * target_s / max(elapsed, 1e-9)))
    return 0


def loop_ns(body: SyncBody, iters: int) -> float:
    """Mean ns of one iteration of ``body`` over ``iters`` iterations."""
    t0 = time.perf_counter_ns()
    body(iters)
    return (time.perf_counter_ns() - t0) / iters


def calibrate(body: SyncBody, target_s: float, max_iters: int = MAX_ITERS) -> int:
    """Iterations for which one run of ``body`` lasts about ``target_s``."""
    iters = WARMUP_ITERS
    while True:
        t0 = time.perf_counter_ns()
        body(iters)
        found = _next_iters(iters, time.perf_counter_ns() - t0, target_s, max_iters)
        if found:
            return found
        iters *= 4


def summary(runs: Sequence[float], iters: int) -> dict[str, Any]:
    """The JSON form of one timed figure: median, min, every raw repeat, the loop length."""
    return {"median_ns": statistics.median(runs), "min_ns": min(runs), "runs_ns": list(runs), "iters": iters}


def repeat_ns(body: SyncBody, repeats: int, target_s: float, max_iters: int = MAX_ITERS) -> dict[str, Any]:
    """Warm up, calibrate, then time ``repeats`` loops with the GC off."""
    return interleaved_ns({"body": body}, repeats, target_s, max_iters)["body"]


def interleaved_ns(bodies: Mapping[str, SyncBody], repeats: int, target_s: float,
                   max_iters: int = MAX_ITERS) -> dict[str, dict[str, Any]]:
    """Every body warmed up and calibrated, then their repeats taken in turn; a summary each."""
    with no_gc():
        iters: dict[str, int] = {}
        for name, body in bodies.items():
            body(WARMUP_ITERS)
            iters[name] = calibrate(body, target_s, max_iters)
        runs: dict[str, list[float]] = {name: [] for name in bodies}
        for _ in range(repeats):
            for name, body in bodies.items():
                runs[name].append(loop_ns(body, iters[name]))
    return {name: summary(runs[name], iters[name]) for name in bodies}


def roundtrip_loop(alloc: Callable[[int], Any], free: Callable[[Any], Any], n: int) -> SyncBody:
    """A body whose loop does ``free(alloc(n))``: the round trip every allocator here is timed on."""

    def body(iters: int) -> None:
        a, f, k = alloc, free, n  # locals: the timed loop reads no closure cells
        for _ in range(iters):
            f(a(k))

    return body


# ----------------------------------------------------------------- coroutines


def awaited_roundtrip_loop(alloc: Callable[[int], Awaitable[Any]], free: Callable[[Any], Any], n: int) -> AsyncBody:
    """:func:`roundtrip_loop` for an awaited ``alloc``: ``free(await alloc(n))``."""

    async def body(iters: int) -> None:
        a, f, k = alloc, free, n
        for _ in range(iters):
            f(await a(k))

    return body


def as_async(body: SyncBody) -> AsyncBody:
    """A synchronous body as a coroutine body (it never yields): to interleave it with awaited ones."""

    async def run(iters: int) -> None:
        body(iters)

    return run


async def aloop_ns(body: AsyncBody, iters: int) -> float:
    """:func:`loop_ns` for a coroutine body."""
    t0 = time.perf_counter_ns()
    await body(iters)
    return (time.perf_counter_ns() - t0) / iters


async def acalibrate(body: AsyncBody, target_s: float, max_iters: int = MAX_ITERS) -> int:
    """:func:`calibrate` for a coroutine body."""
    iters = WARMUP_ITERS
    while True:
        t0 = time.perf_counter_ns()
        await body(iters)
        found = _next_iters(iters, time.perf_counter_ns() - t0, target_s, max_iters)
        if found:
            return found
        iters *= 4


async def ainterleaved_ns(bodies: Mapping[str, AsyncBody], repeats: int, target_s: float,
                          max_iters: int = MAX_ITERS) -> dict[str, dict[str, Any]]:
    """:func:`interleaved_ns` for coroutine bodies."""
    with no_gc():
        iters: dict[str, int] = {}
        for name, body in bodies.items():
            await body(WARMUP_ITERS)
            iters[name] = await acalibrate(body, target_s, max_iters)
        runs: dict[str, list[float]] = {name: [] for name in bodies}
        for _ in range(repeats):
            for name, body in bodies.items():
                runs[name].append(await aloop_ns(body, iters[name]))
    return {name: summary(runs[name], iters[name]) for name in bodies}


async def arepeat_ns(body: AsyncBody, repeats: int, target_s: float, max_iters: int = MAX_ITERS) -> dict[str, Any]:
    """:func:`repeat_ns` for a coroutine body."""
    return (await ainterleaved_ns({"body": body}, repeats, target_s, max_iters))["body"]


# ---------------------------------------------------------------- percentiles


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), NaN for no values."""
    s = sorted(values)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def percentiles(values: Sequence[float], raw: bool = True) -> dict[str, Any]:
    """p50 / p99 / max of latency samples (and the samples themselves unless ``raw`` is false)."""
    out: dict[str, Any] = {"samples": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99),
                           "max": max(values) if values else float("nan")}
    if raw:
        out["raw"] = list(values)
    return out


def time_pair(commit: Any, release: Any, iters: int) -> tuple[float, float]:
    """Mean ns of ``commit()`` and of ``release(its result)`` over ``iters`` pairs."""
    commit_ns = release_ns = 0
    clock = time.perf_counter_ns
    for _ in range(iters):
        t0 = clock()
        x = commit()
        t1 = clock()
        release(x)
        t2 = clock()
        commit_ns += t1 - t0
        release_ns += t2 - t1
    return commit_ns / iters, release_ns / iters
