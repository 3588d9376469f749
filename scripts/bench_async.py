#!/usr/bin/env python3
"""Benchmarks of the asyncio face of kvpool (``KVCacheManager``), one run, one machine.

Every figure is measured in the same process and printed next to a baseline
measured in that same run, so that the ratios compare like with like even when
the absolute numbers move from machine to machine.

Everything runs under one ``asyncio.run`` (the default asyncio event loop).
Page syscalls are kept off every timed path: each manager is built with
``reserve=(0, big)`` and no reserve thread, and every block of its space is
allocated once and freed before timing, so all pages stay committed; the
script checks that ``stats().space.commits`` / ``releases`` do not move while
it times, and fails otherwise.

Timing: ``time.perf_counter_ns`` with the garbage collector off. Round trips
(figure 1) run a tight loop of ``iters`` calls (``iters`` calibrated so that
one repeat lasts a fixed time) and yield the mean per call; latencies
(figure 2) are timestamped one by one. Each figure is the median of several
repeats; every raw repeat is kept in the JSON.

Figures
-------
1. **Uncontended round trip** (``roundtrip``): ``free(await alloc(n))``
   against ``free(alloc_nowait(n))`` for n = 1 and 16, one task, nobody
   waiting. Reported as ns per round trip and the await/nowait ratio. The
   ``await`` fast path yields to the event loop once after its grant (anyio's
   ``cancel_shielded_checkpoint``), so a row ``await asyncio.sleep(0)`` (one
   bare event-loop pass, also ratioed against nowait n = 1) shows how much of
   the difference that yield alone explains.

2. **Hand-off latency** (``handoff``): an exhausted space; ``depth`` tasks
   each wait in ``await alloc(1)``; a releasing task frees one block at a time.
   Latency of a grant = the perf_counter_ns at which the granted task resumes
   after its ``await alloc(1)`` returned, minus the perf_counter_ns taken just
   before the ``free`` that granted it. Between two frees the releaser waits
   until the granted task has resumed, then lets the loop settle (a few
   ``sleep(0)``), so each sample is one isolated hand-off, not a backlog.
   Two queue disciplines, depth 1, 100 and 1000:

   - ``steady``: the granted task gives its block back to the releaser and
     queues again at the tail, so the queue holds ``depth`` waiters at every
     grant;
   - ``drain``: ``depth`` waiters are queued once and released one by one
     (each waiter measured exactly once; the depth at grant goes from
     ``depth`` down to 1); repeated until there are enough samples.

   Reported as p50 and p99 in µs (medians over repeats), and each p50 as a
   ratio to the 1-waiter p50 of the same discipline. One waiter of the queue
   also watches the space's eventfd (``anyio.wait_readable``; see
   ``kvpool.manager``); a grant to that *watcher* is delivered by cancelling
   its wait instead of setting its Event, a different code path. The column
   ``via watcher`` gives the share of grants that went to the watcher, and
   the JSON splits p50 by path (read from manager internals, diagnostic only).

3. **Grants per second under contention** (``contention``): 64 tasks share a
   space of 256 blocks, each looping ``ids = await alloc(k)`` (k drawn
   uniformly from 1..8, a fixed sequence per task) -> ``await sleep(0)`` ->
   ``free(ids)`` for a fixed time. Reported as grants/s (from the manager's
   ``granted_at_once + granted_after_wait`` counters over the window), the
   share granted at once vs after waiting, and the ratio against the same loop
   run by a single task (never waits), measured in the same run. A third row
   runs the 64 tasks on a space big enough that nobody ever waits (512
   blocks), to separate the price of waiting from the price of 64 tasks
   sharing one loop. The JSON also keeps grants per task (min / max) as a
   fairness check.

Usage::

    python scripts/bench_async.py [--quick] [--json PATH]

``--quick`` shortens every loop (smoke test); its numbers are noisier.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from _benchlib import (  # scripts/, on sys.path when a script runs
    BIG_RESERVE,
    AsyncBody,
    KiB,
    arepeat_ns,
    awaited_roundtrip_loop,
    geo_info,
    machine_info,
    no_gc,
    no_page_syscalls,
    parse_args,
    utc_now,
    version,
    write_json,
)

from kvpool import Geometry, KVCacheManager

DEPTHS = (1, 100, 1000)
SETTLE_PASSES = 4  # event-loop passes between two hand-offs


@dataclass(frozen=True)
class Settings:
    """Loop sizes of one run."""

    repeats: int
    target_s: float  # wall time of one timed repeat (figure 1)
    handoff_samples: int  # grants per repeat, per depth and discipline (figure 2)
    handoff_warmup: int  # grants discarded before timing (steady discipline)
    contention_s: float  # wall time of one repeat (figure 3)


FULL = Settings(repeats=5, target_s=0.2, handoff_samples=2000, handoff_warmup=300, contention_s=1.0)
QUICK = Settings(repeats=3, target_s=0.03, handoff_samples=300, handoff_warmup=50, contention_s=0.15)


def _geometry(num_blocks: int) -> Geometry:
    """A small space: 1 layer x K/V, 4 KiB blocks, 64 KiB pages (bookkeeping is what we time)."""
    return Geometry(num_layers=1, num_kv_buffers=2, block_bytes=4 * KiB, num_blocks=num_blocks,
                    page_bytes=64 * KiB)


def _manager(num_blocks: int, name: str) -> KVCacheManager:
    m = KVCacheManager(_geometry(num_blocks), reserve=(0, BIG_RESERVE), reserve_thread=False, name=name)
    m.free(m.alloc_nowait(m.geometry.capacity))  # commit every page once; they stay committed
    return m


# --------------------------------------------------------------- timing helpers


async def _repeat(body: AsyncBody, settings: Settings) -> dict[str, Any]:
    """Calibrate, then time ``settings.repeats`` repeats; median and raw values."""
    return await arepeat_ns(body, settings.repeats, settings.target_s, max_iters=1 << 24)


def _pct(sorted_values: list[int], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values)) - 1))
    return float(sorted_values[k])


# ----------------------------------------------- figure 1: uncontended round trip


async def bench_roundtrip(settings: Settings) -> dict[str, Any]:
    sizes = (1, 16)
    m = _manager(1024, "bench-roundtrip")
    out: dict[str, Any] = {"geometry": geo_info(m.geometry), "cases": {}}
    try:
        async def loop_pass(iters: int) -> None:
            sleep = asyncio.sleep
            for _ in range(iters):
                await sleep(0)

        out["sleep0"] = await _repeat(loop_pass, settings)
        for n in sizes:
            async def nowait(iters: int, n: int = n) -> None:
                alloc_nowait, free = m.alloc_nowait, m.free
                for _ in range(iters):
                    free(alloc_nowait(n))

            with no_page_syscalls(m, f"round trip n={n}"):
                res_nowait = await _repeat(nowait, settings)
                res_await = await _repeat(awaited_roundtrip_loop(m.alloc, m.free, n), settings)
            out["cases"][str(n)] = {
                "n": n,
                "nowait": res_nowait,
                "await": res_await,
                "ratio_await_to_nowait": res_await["median_ns"] / res_nowait["median_ns"],
            }
        st = m.stats()
        if st.waiting or st.used_blocks or st.granted_after_wait:
            raise RuntimeError(f"round trip was not uncontended: {st}")
        out["page_syscalls_during_timing"] = 0
    finally:
        await m.aclose()
    out["sleep0"]["ratio_to_nowait_n1"] = out["sleep0"]["median_ns"] / out["cases"]["1"]["nowait"]["median_ns"]
    return out


# ------------------------------------------------------ figure 2: hand-off latency


class _Probe:
    """Which waiter watches the eventfd (manager internals; diagnostic only, may be absent)."""

    def __init__(self, m: KVCacheManager) -> None:
        self._m = m
        self.available = hasattr(m, "_watcher") and hasattr(m, "_queue")

    def head_is_watcher(self) -> bool | None:
        if not self.available:
            return None
        m: Any = self._m
        head = m._queue.head()
        return head is not None and head is m._watcher


async def _settle() -> None:
    for _ in range(SETTLE_PASSES):
        await asyncio.sleep(0)


def _summarize(lat: list[int], via: list[bool | None]) -> dict[str, Any]:
    s = sorted(lat)
    res: dict[str, Any] = {"samples": len(s), "p50_ns": _pct(s, 50), "p99_ns": _pct(s, 99), "max_ns": float(s[-1])}
    if via and via[0] is not None:
        w = sorted(x for x, v in zip(lat, via) if v)
        e = sorted(x for x, v in zip(lat, via) if not v)
        res["via_watcher_share"] = len(w) / len(lat)
        res["p50_via_watcher_ns"] = _pct(w, 50) if w else None
        res["p50_via_event_ns"] = _pct(e, 50) if e else None
    return res


class _Handoff:
    """An exhausted space whose blocks the releaser holds, granted one at a time to waiters."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.probe = _Probe(m)
        ids = m.alloc_nowait(m.geometry.capacity)  # exhaust the space: the releaser holds every block
        self.held = [ids[i : i + 1] for i in range(len(ids))]
        self.t_free = 0  # perf_counter_ns just before the latest granting free
        self.lat: list[int] = []
        self.back: deque[Any] = deque()
        self.resumed = asyncio.Event()

    async def waiter(self, forever: bool) -> None:
        """Wait in ``alloc(1)`` once (or again and again); log each grant's latency, hand the block back."""
        m, lat, back, resumed = self.m, self.lat, self.back, self.resumed
        while True:
            got = await m.alloc(1)
            t = time.perf_counter_ns()
            lat.append(t - self.t_free)
            back.append(got)
            resumed.set()
            if not forever:
                return

    async def grant(self, waiting: int, what: str, via: list[bool | None]) -> None:
        """Free one block to the head of a queue of ``waiting`` waiters; return once the grantee resumed."""
        m = self.m
        await _settle()
        if m.waiting != waiting:
            raise RuntimeError(f"{what} hand-off: {m.waiting} waiting, expected {waiting}")
        via.append(self.probe.head_is_watcher())
        self.resumed.clear()
        blk = self.held.pop()
        self.t_free = time.perf_counter_ns()
        m.free(blk)
        await self.resumed.wait()
        self.held.append(self.back.popleft())


async def _handoff_steady(depth: int, settings: Settings) -> list[dict[str, Any]]:
    """``depth`` waiters; each granted one hands its block back and re-queues at the tail."""
    m = _manager(64, f"bench-handoff-steady-{depth}")
    h = _Handoff(m)
    tasks = [asyncio.create_task(h.waiter(forever=True)) for _ in range(depth)]
    repeats: list[dict[str, Any]] = []
    try:
        while m.waiting < depth:
            await asyncio.sleep(0)
        with no_page_syscalls(m, f"hand-off steady depth={depth}"), no_gc():
            for r in range(settings.repeats + 1):  # round 0: warm-up, discarded
                n = settings.handoff_warmup if r == 0 else settings.handoff_samples
                h.lat.clear()
                via: list[bool | None] = []
                for _ in range(n):
                    await h.grant(depth, "steady", via)
                if r:
                    repeats.append(_summarize(list(h.lat), via))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await m.aclose()
    return repeats


async def _handoff_drain(depth: int, settings: Settings) -> list[dict[str, Any]]:
    """``depth`` waiters queued once, released one by one; repeated until enough samples."""
    m = _manager(64, f"bench-handoff-drain-{depth}")
    h = _Handoff(m)

    async def one_drain(via: list[bool | None]) -> None:
        tasks = [asyncio.create_task(h.waiter(forever=False)) for _ in range(depth)]
        try:
            while m.waiting < depth:
                await asyncio.sleep(0)
            for i in range(depth):
                await h.grant(depth - i, "drain", via)
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    drains_per_repeat = max(1, -(-settings.handoff_samples // depth))
    repeats: list[dict[str, Any]] = []
    try:
        with no_page_syscalls(m, f"hand-off drain depth={depth}"), no_gc():
            await one_drain([])  # warm-up, discarded
            for _ in range(settings.repeats):
                h.lat.clear()
                via: list[bool | None] = []
                for _ in range(drains_per_repeat):
                    await one_drain(via)
                repeats.append(_summarize(list(h.lat), via))
    finally:
        await m.aclose()
    return repeats


def _median_of(repeats: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in repeats if r.get(key) is not None]
    return statistics.median(vals) if vals else None


async def bench_handoff(settings: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {"geometry": geo_info(_geometry(64)), "settle_passes": SETTLE_PASSES, "modes": {}}
    for mode, fn in (("steady", _handoff_steady), ("drain", _handoff_drain)):
        cases: dict[str, Any] = {}
        for depth in DEPTHS:
            reps = await fn(depth, settings)
            cases[str(depth)] = {
                "depth": depth,
                "p50_ns": _median_of(reps, "p50_ns"),
                "p99_ns": _median_of(reps, "p99_ns"),
                "via_watcher_share": _median_of(reps, "via_watcher_share"),
                "p50_via_watcher_ns": _median_of(reps, "p50_via_watcher_ns"),
                "p50_via_event_ns": _median_of(reps, "p50_via_event_ns"),
                "repeats": reps,
            }
        base = cases[str(DEPTHS[0])]["p50_ns"]
        for c in cases.values():
            c["p50_ratio_to_depth1"] = c["p50_ns"] / base
        out["modes"][mode] = cases
    out["page_syscalls_during_timing"] = 0
    return out


# ------------------------------------------------ figure 3: contended grants/s


async def _contention_run(m: KVCacheManager, sizes: list[list[int]], duration_s: float) -> dict[str, Any]:
    """``len(sizes)`` tasks loop alloc -> sleep(0) -> free for ``duration_s``; counters over the window."""
    stop = False
    per_task = [0] * len(sizes)

    async def worker(idx: int) -> None:
        seq = sizes[idx]
        alloc, free, sleep = m.alloc, m.free, asyncio.sleep
        i = 0
        while not stop:
            ids = await alloc(seq[i % len(seq)])
            i += 1
            await sleep(0)
            free(ids)
        per_task[idx] = i

    s0 = m.stats()
    t0 = time.perf_counter_ns()
    tasks = [asyncio.create_task(worker(i)) for i in range(len(sizes))]
    await asyncio.sleep(duration_s)
    s1 = m.stats()  # the window ends here (synchronous: no task runs in between)
    t1 = time.perf_counter_ns()
    stop = True
    await asyncio.gather(*tasks)
    s2 = m.stats()
    if s2.used_blocks or s2.waiting:
        raise RuntimeError(f"contention run left {s2.used_blocks} blocks used, {s2.waiting} waiting")
    at_once = s1.granted_at_once - s0.granted_at_once
    after_wait = s1.granted_after_wait - s0.granted_after_wait
    grants = at_once + after_wait
    elapsed = (t1 - t0) / 1e9
    return {
        "elapsed_s": elapsed,
        "grants": grants,
        "grants_per_s": grants / elapsed,
        "granted_at_once": at_once,
        "granted_after_wait": after_wait,
        "at_once_share": at_once / grants if grants else float("nan"),
        "per_task_min": min(per_task),
        "per_task_max": max(per_task),
    }


async def bench_contention(settings: Settings, seed: int = 0) -> dict[str, Any]:
    tasks, blocks, kmax, seq_len = 64, 256, 8, 4096
    rng = np.random.default_rng(seed)
    sizes = [[int(x) for x in rng.integers(1, kmax + 1, size=seq_len)] for _ in range(tasks)]
    configs = {
        "contended": (blocks, sizes),                       # 64 tasks, 256 blocks
        "single": (blocks, sizes[:1]),                      # baseline: 1 task, same space, same sizes
        "uncontended_64": (tasks * kmax, sizes),            # 64 tasks that never wait
    }
    out: dict[str, Any] = {"tasks": tasks, "blocks": blocks, "k_range": [1, kmax], "cases": {}}
    mgrs = {name: _manager(nb, f"bench-contention-{name}") for name, (nb, _) in configs.items()}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    try:
        with no_gc():
            for name, (_, sz) in configs.items():  # warm-up, discarded
                await _contention_run(mgrs[name], sz, settings.contention_s / 4)
            for _ in range(settings.repeats):
                # Interleaved so that drift hits every configuration alike.
                for name, (_, sz) in configs.items():
                    with no_page_syscalls(mgrs[name], f"contention {name}"):
                        runs[name].append(await _contention_run(mgrs[name], sz, settings.contention_s))
    finally:
        for mgr in mgrs.values():
            await mgr.aclose()
    for name, (nb, sz) in configs.items():
        rs = runs[name]
        out["cases"][name] = {
            "tasks": len(sz),
            "blocks": nb,
            "geometry": geo_info(_geometry(nb)),
            "grants_per_s": statistics.median(r["grants_per_s"] for r in rs),
            "at_once_share": statistics.median(r["at_once_share"] for r in rs),
            "per_task_min": min(r["per_task_min"] for r in rs),
            "per_task_max": max(r["per_task_max"] for r in rs),
            "runs": rs,
        }
    base = out["cases"]["single"]["grants_per_s"]
    for c in out["cases"].values():
        c["ratio_to_single"] = c["grants_per_s"] / base
    out["page_syscalls_during_timing"] = 0
    return out


# ------------------------------------------------------------------- report


def _machine_info() -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    return machine_info(
        runtime={"event_loop": f"{type(loop).__module__}.{type(loop).__qualname__}"},
        extra={
            "anyio": version("anyio"),
            "structlog": version("structlog"),
            "kvpool_log_level": os.environ.get("KVPOOL_LOG_LEVEL", "warning"),
        },
    )


def _us(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e3:.1f}"


def format_report(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [
        f"kvpool async bench ({'quick' if res['quick'] else 'full'}) - {m['platform']}, "
        f"{m['nproc_usable']}/{m['nproc']} cpus, Python {m['python']}, {m['event_loop']}, "
        f"anyio {m['anyio']}, log level {m['kvpool_log_level']}",
        "",
    ]

    rt = res["roundtrip"]
    lines += [
        "1. uncontended round trip, one task, pages kept committed (no syscalls)",
        f"   {'n':>4}{'nowait ns':>12}{'await ns':>12}{'await/nowait':>14}",
    ]
    for c in rt["cases"].values():
        lines.append(
            f"   {c['n']:>4}{c['nowait']['median_ns']:>12.0f}{c['await']['median_ns']:>12.0f}"
            f"{c['ratio_await_to_nowait']:>14.2f}"
        )
    s0 = rt["sleep0"]
    lines.append(f"   one bare loop pass, await asyncio.sleep(0): {s0['median_ns']:.0f} ns "
                 f"({s0['ratio_to_nowait_n1']:.2f} x nowait n=1)")

    ho = res["handoff"]
    lines += [
        "",
        "2. hand-off latency: free() by the releaser -> the granted waiter resumes (exhausted space, alloc(1) each)",
        f"   {'queue':<8}{'depth':>6}{'p50 us':>9}{'p99 us':>9}{'x depth 1':>11}{'via watcher':>13}"
        f"{'p50 watcher':>13}{'p50 event':>11}",
    ]
    for mode, cases in ho["modes"].items():
        for c in cases.values():
            share = c["via_watcher_share"]
            lines.append(
                f"   {mode:<8}{c['depth']:>6}{_us(c['p50_ns']):>9}{_us(c['p99_ns']):>9}"
                f"{c['p50_ratio_to_depth1']:>11.2f}{'-' if share is None else f'{share:.1%}':>13}"
                f"{_us(c['p50_via_watcher_ns']):>13}{_us(c['p50_via_event_ns']):>11}"
            )
    lines.append("   (steady: the granted waiter re-queues at the tail; drain: depth waiters released one by one)")

    ct = res["contention"]
    lines += [
        "",
        f"3. grants/s: tasks loop alloc(k in 1..{ct['k_range'][1]}) -> sleep(0) -> free, "
        f"{res['settings']['contention_s']:g} s per repeat",
        f"   {'case':<34}{'grants/s':>11}{'x single':>10}{'at once':>9}{'after wait':>12}{'per task min/max':>18}",
    ]
    labels = {
        "contended": f"{ct['tasks']} tasks, {ct['blocks']} blocks",
        "single": f"1 task, {ct['blocks']} blocks (baseline)",
        "uncontended_64": f"{ct['tasks']} tasks, {ct['cases']['uncontended_64']['blocks']} blocks (no wait)",
    }
    for name, c in ct["cases"].items():
        lines.append(
            f"   {labels[name]:<34}{c['grants_per_s']:>11.0f}{c['ratio_to_single']:>10.2f}"
            f"{c['at_once_share']:>9.1%}{1 - c['at_once_share']:>12.1%}"
            f"{c['per_task_min']:>9}/{c['per_task_max']}"
        )
    lines += ["", f"total {res['elapsed_s']:.1f} s"]
    return "\n".join(lines)


async def _run(settings: Settings, quick: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "when": utc_now(),
        "quick": quick,
        "settings": asdict(settings),
        "machine": _machine_info(),
    }
    res["roundtrip"] = await bench_roundtrip(settings)
    res["handoff"] = await bench_handoff(settings)
    res["contention"] = await bench_contention(settings)
    res["elapsed_s"] = time.perf_counter() - t0
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, "bench-async.json", argv)
    settings = QUICK if args.quick else FULL

    res = asyncio.run(_run(settings, args.quick))
    print(format_report(res))
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
