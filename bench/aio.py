"""Suite ``async``: the asyncio face of kvpool (``KVCacheManager``), one run, one machine.

Everything runs under one ``asyncio.run`` (the default event loop). Each
manager is private (``pool=None``), built with ``reserve=(0, big)`` and no
reserve thread, and every block of its space is allocated once and freed
before timing, so every page stays committed; the suite checks that
``stats().space.commits`` / ``releases`` do not move while it times.

Figures
-------
1. **Uncontended round trip** (``roundtrip``): ``free(await alloc(n))``
   against ``free(alloc_nowait(n))`` for n = 1 and 16, one task, nobody
   waiting, repeats interleaved; ratio await / nowait. A row ``await
   asyncio.sleep(0)`` (one bare event-loop pass) is ratioed against nowait
   n = 1.

2. **Hand-off latency** (``handoff``): an exhausted space; ``depth`` tasks
   each wait in ``await alloc(1)``; a releasing task frees one block at a
   time. Latency = perf_counter_ns when the granted task resumes minus the one
   taken just before the granting ``free``. Between two frees the releaser
   waits until the grantee resumed, then lets the loop settle, so each sample
   is one isolated hand-off. ``steady``: the grantee hands its block back and
   queues again at the tail (``depth`` waiters at every grant); ``drain``:
   ``depth`` waiters released one by one. Depth 1, 100, 1000; p50 and p99
   (medians over repeats), each p50 as a ratio to depth 1 of the same
   discipline. ``via watcher``: the share of grants that went to the waiter
   watching the space's eventfd (manager internals; diagnostic only).

3. **Grants per second under contention** (``contention``): 64 tasks share
   256 blocks, each looping ``await alloc(k)`` (k in 1..8) -> ``sleep(0)``
   -> ``free``; grants/s from the manager's counters, against one task alone
   on the same space and 64 tasks on a space big enough that nobody waits;
   the three interleaved repeat by repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ._lib import BIG_RESERVE, KiB, geo_info, machine_line, no_page_syscalls
from ._timing import ainterleaved_ns, awaited_roundtrip_loop, no_gc, percentile, roundtrip_loop

if TYPE_CHECKING:
    from kvpool import Geometry, KVCacheManager

TITLE = "KVCacheManager under asyncio"
DEPTHS = (1, 100, 1000)
SETTLE_PASSES = 4  # event-loop passes between two hand-offs


@dataclass(frozen=True)
class Settings:
    repeats: int
    target_s: float  # wall time of one timed repeat (figure 1)
    handoff_samples: int  # grants per repeat, per depth and discipline (figure 2)
    handoff_warmup: int  # grants discarded before timing (steady discipline)
    contention_s: float  # wall time of one repeat (figure 3)


FULL = Settings(repeats=5, target_s=0.2, handoff_samples=2000, handoff_warmup=300, contention_s=1.0)
QUICK = Settings(repeats=3, target_s=0.03, handoff_samples=300, handoff_warmup=50, contention_s=0.15)


def _geometry(num_blocks: int) -> Geometry:
    """A small space: 1 layer x K/V, 4 KiB blocks, 64 KiB pages (bookkeeping is what is timed)."""
    from kvpool import Geometry

    return Geometry(num_layers=1, num_kv_buffers=2, block_bytes=4 * KiB, num_blocks=num_blocks, page_bytes=64 * KiB)


def _manager(num_blocks: int, name: str) -> KVCacheManager:
    from kvpool import KVCacheManager

    m = KVCacheManager(_geometry(num_blocks), pool=None, reserve=(0, BIG_RESERVE), reserve_thread=False, name=name)
    m.free(m.alloc_nowait(m.geometry.capacity))  # commit every page once; they stay committed
    return m


# ----------------------------------------------- figure 1: uncontended round trip


async def bench_roundtrip(s: Settings) -> dict[str, Any]:
    m = _manager(1024, "bench-roundtrip")
    out: dict[str, Any] = {"geometry": geo_info(m.geometry), "cases": {}}
    try:
        async def loop_pass(iters: int) -> None:
            sleep = asyncio.sleep
            for _ in range(iters):
                await sleep(0)

        bodies: dict[str, Any] = {"sleep0": loop_pass}
        for n in (1, 16):
            nowait = roundtrip_loop(m.alloc_nowait, m.free, n)

            async def nowait_body(iters: int, body: Any = nowait) -> None:
                body(iters)

            bodies[f"nowait {n}"] = nowait_body
            bodies[f"await {n}"] = awaited_roundtrip_loop(m.alloc, m.free, n)
        with no_page_syscalls(m, "round trip"):
            t = await ainterleaved_ns(bodies, s.repeats, s.target_s)
        st = m.stats()
        if st.waiting or st.used_blocks or st.granted_after_wait:
            raise RuntimeError(f"round trip was not uncontended: {st}")
    finally:
        await m.aclose()
    for n in (1, 16):
        a, w = t[f"await {n}"], t[f"nowait {n}"]
        out["cases"][str(n)] = {"n": n, "nowait": w, "await": a,
                                "ratio_await_to_nowait": a["median_ns"] / w["median_ns"]}
    out["sleep0"] = {**t["sleep0"], "ratio_to_nowait_n1": t["sleep0"]["median_ns"] / t["nowait 1"]["median_ns"]}
    return out


# ------------------------------------------------------ figure 2: hand-off latency


def _head_is_watcher(m: KVCacheManager) -> bool | None:
    """Whether the queue's head watches the eventfd (manager internals; None where they are absent)."""
    mm: Any = m
    if not (hasattr(mm, "_watcher") and hasattr(mm, "_queue")):
        return None
    head = mm._queue.head()
    return head is not None and head is mm._watcher


async def _settle() -> None:
    for _ in range(SETTLE_PASSES):
        await asyncio.sleep(0)


def _summarize(lat: list[int], via: list[bool | None]) -> dict[str, Any]:
    res: dict[str, Any] = {"samples": len(lat), "p50_ns": percentile(lat, 50), "p99_ns": percentile(lat, 99),
                           "max_ns": float(max(lat))}
    if via and via[0] is not None:
        w = [x for x, v in zip(lat, via) if v]
        e = [x for x, v in zip(lat, via) if not v]
        res["via_watcher_share"] = len(w) / len(lat)
        res["p50_via_watcher_ns"] = percentile(w, 50) if w else None
        res["p50_via_event_ns"] = percentile(e, 50) if e else None
    return res


class _Handoff:
    """An exhausted space whose blocks the releaser holds, granted one at a time to waiters."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        ids = m.alloc_nowait(m.geometry.capacity)
        self.held = [ids[i : i + 1] for i in range(len(ids))]
        self.t_free = 0  # perf_counter_ns just before the latest granting free
        self.lat: list[int] = []
        self.back: deque[Any] = deque()
        self.resumed = asyncio.Event()

    async def waiter(self, forever: bool) -> None:
        m, lat, back, resumed = self.m, self.lat, self.back, self.resumed
        while True:
            got = await m.alloc(1)
            lat.append(time.perf_counter_ns() - self.t_free)
            back.append(got)
            resumed.set()
            if not forever:
                return

    async def grant(self, waiting: int, what: str, via: list[bool | None]) -> None:
        """Free one block to the head of a queue of ``waiting`` waiters; return once the grantee resumed."""
        await _settle()
        if self.m.waiting != waiting:
            raise RuntimeError(f"{what} hand-off: {self.m.waiting} waiting, expected {waiting}")
        via.append(_head_is_watcher(self.m))
        self.resumed.clear()
        blk = self.held.pop()
        self.t_free = time.perf_counter_ns()
        self.m.free(blk)
        await self.resumed.wait()
        self.held.append(self.back.popleft())


async def _handoff_steady(depth: int, s: Settings) -> list[dict[str, Any]]:
    m = _manager(64, f"bench-handoff-steady-{depth}")
    h = _Handoff(m)
    tasks = [asyncio.create_task(h.waiter(forever=True)) for _ in range(depth)]
    repeats: list[dict[str, Any]] = []
    try:
        while m.waiting < depth:
            await asyncio.sleep(0)
        with no_page_syscalls(m, f"hand-off steady depth={depth}"), no_gc():
            for r in range(s.repeats + 1):  # round 0: warm-up, discarded
                h.lat.clear()
                via: list[bool | None] = []
                for _ in range(s.handoff_warmup if r == 0 else s.handoff_samples):
                    await h.grant(depth, "steady", via)
                if r:
                    repeats.append(_summarize(list(h.lat), via))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await m.aclose()
    return repeats


async def _handoff_drain(depth: int, s: Settings) -> list[dict[str, Any]]:
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

    repeats: list[dict[str, Any]] = []
    try:
        with no_page_syscalls(m, f"hand-off drain depth={depth}"), no_gc():
            await one_drain([])  # warm-up, discarded
            for _ in range(s.repeats):
                h.lat.clear()
                via: list[bool | None] = []
                for _ in range(max(1, -(-s.handoff_samples // depth))):
                    await one_drain(via)
                repeats.append(_summarize(list(h.lat), via))
    finally:
        await m.aclose()
    return repeats


def _median_of(repeats: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in repeats if r.get(key) is not None]
    return statistics.median(vals) if vals else None


async def bench_handoff(s: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {"geometry": geo_info(_geometry(64)), "settle_passes": SETTLE_PASSES, "modes": {}}
    for mode, fn in (("steady", _handoff_steady), ("drain", _handoff_drain)):
        cases: dict[str, Any] = {}
        for depth in DEPTHS:
            reps = await fn(depth, s)
            cases[str(depth)] = {"depth": depth, "repeats": reps, **{
                k: _median_of(reps, k) for k in ("p50_ns", "p99_ns", "via_watcher_share", "p50_via_watcher_ns",
                                                 "p50_via_event_ns")}}
        base = cases[str(DEPTHS[0])]["p50_ns"]
        for c in cases.values():
            c["p50_ratio_to_depth1"] = c["p50_ns"] / base
        out["modes"][mode] = cases
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
    grants = at_once + s1.granted_after_wait - s0.granted_after_wait
    elapsed = (t1 - t0) / 1e9
    return {"elapsed_s": elapsed, "grants": grants, "grants_per_s": grants / elapsed, "granted_at_once": at_once,
            "at_once_share": at_once / grants if grants else float("nan"),
            "per_task_min": min(per_task), "per_task_max": max(per_task)}


async def bench_contention(s: Settings, seed: int = 0) -> dict[str, Any]:
    import numpy as np

    tasks, blocks, kmax, seq_len = 64, 256, 8, 4096
    rng = np.random.default_rng(seed)
    sizes = [[int(x) for x in rng.integers(1, kmax + 1, size=seq_len)] for _ in range(tasks)]
    configs = {"contended": (blocks, sizes), "single": (blocks, sizes[:1]), "uncontended_64": (tasks * kmax, sizes)}
    out: dict[str, Any] = {"tasks": tasks, "blocks": blocks, "k_range": [1, kmax], "contention_s": s.contention_s,
                           "cases": {}}
    mgrs = {name: _manager(nb, f"bench-contention-{name}") for name, (nb, _) in configs.items()}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    try:
        with no_gc():
            for name, (_, sz) in configs.items():  # warm-up, discarded
                await _contention_run(mgrs[name], sz, s.contention_s / 4)
            for _ in range(s.repeats):
                for name, (_, sz) in configs.items():  # interleaved: drift hits every configuration alike
                    with no_page_syscalls(mgrs[name], f"contention {name}"):
                        runs[name].append(await _contention_run(mgrs[name], sz, s.contention_s))
    finally:
        for mgr in mgrs.values():
            await mgr.aclose()
    for name, (nb, sz) in configs.items():
        rs = runs[name]
        out["cases"][name] = {"tasks": len(sz), "blocks": nb,
                              "grants_per_s": statistics.median(r["grants_per_s"] for r in rs),
                              "at_once_share": statistics.median(r["at_once_share"] for r in rs),
                              "per_task_min": min(r["per_task_min"] for r in rs),
                              "per_task_max": max(r["per_task_max"] for r in rs), "runs": rs}
    base = out["cases"]["single"]["grants_per_s"]
    for c in out["cases"].values():
        c["ratio_to_single"] = c["grants_per_s"] / base
    return out


# ------------------------------------------------------------------- suite


async def _run(s: Settings) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    return {"settings": asdict(s), "event_loop": f"{type(loop).__module__}.{type(loop).__qualname__}",
            "roundtrip": await bench_roundtrip(s), "handoff": await bench_handoff(s),
            "contention": await bench_contention(s)}


def run(opts: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_run(QUICK if opts.quick else FULL))


def _us(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e3:.1f}"


def _labels(ct: Mapping[str, Any]) -> dict[str, str]:
    return {"contended": f"{ct['tasks']} tasks, {ct['blocks']} blocks",
            "single": f"1 task, {ct['blocks']} blocks (baseline)",
            "uncontended_64": f"{ct['tasks']} tasks, {ct['cases']['uncontended_64']['blocks']} blocks (no wait)"}


def format_report(res: Mapping[str, Any]) -> str:
    m = res["machine"]
    lines = [machine_line(m) + f", {res['event_loop']}, anyio {m['anyio']}, log level {m['kvpool_log_level']}", ""]
    rt = res["roundtrip"]
    lines += ["1. uncontended round trip, one task, pages kept committed (no syscalls), interleaved repeats",
              f"   {'n':>4}{'nowait ns':>12}{'await ns':>12}{'await/nowait':>14}"]
    for c in rt["cases"].values():
        lines.append(f"   {c['n']:>4}{c['nowait']['median_ns']:>12.0f}{c['await']['median_ns']:>12.0f}"
                     f"{c['ratio_await_to_nowait']:>14.2f}")
    s0 = rt["sleep0"]
    lines.append(f"   one bare loop pass, await asyncio.sleep(0): {s0['median_ns']:.0f} ns "
                 f"({s0['ratio_to_nowait_n1']:.2f} x nowait n=1)")
    lines += ["", "2. hand-off latency: free() by the releaser -> the granted waiter resumes (alloc(1) each)",
              f"   {'queue':<8}{'depth':>6}{'p50 us':>9}{'p99 us':>9}{'x depth 1':>11}{'via watcher':>13}"
              f"{'p50 watcher':>13}{'p50 event':>11}"]
    for mode, cases in res["handoff"]["modes"].items():
        for c in cases.values():
            share = c["via_watcher_share"]
            lines.append(f"   {mode:<8}{c['depth']:>6}{_us(c['p50_ns']):>9}{_us(c['p99_ns']):>9}"
                         f"{c['p50_ratio_to_depth1']:>11.2f}{'-' if share is None else f'{share:.1%}':>13}"
                         f"{_us(c['p50_via_watcher_ns']):>13}{_us(c['p50_via_event_ns']):>11}")
    ct = res["contention"]
    lines += ["", f"3. grants/s: tasks loop alloc(k in 1..{ct['k_range'][1]}) -> sleep(0) -> free, "
              f"{ct['contention_s']:g} s per repeat",
              f"   {'case':<34}{'grants/s':>11}{'x single':>10}{'at once':>9}{'per task min/max':>18}"]
    for name, c in ct["cases"].items():
        lines.append(f"   {_labels(ct)[name]:<34}{c['grants_per_s']:>11.0f}{c['ratio_to_single']:>10.2f}"
                     f"{c['at_once_share']:>9.1%}{c['per_task_min']:>9}/{c['per_task_max']}")
    return "\n".join(lines)


def markdown(res: Mapping[str, Any]) -> str:
    rt, ho, ct = res["roundtrip"], res["handoff"]["modes"], res["contention"]
    c1, c16 = rt["cases"]["1"], rt["cases"]["16"]

    def rt_cell(c: Mapping[str, Any]) -> str:
        return (f"{c['await']['median_ns'] / 1e3:.2f} vs {c['nowait']['median_ns'] / 1e3:.2f} µs "
                f"({c['ratio_await_to_nowait']:.2f}×)")

    st = ho["steady"]
    cc = ct["cases"]["contended"]
    return "\n".join([
        "| figure | result |",
        "|---|---|",
        f"| `await alloc` + free vs `alloc_nowait` + free, n = 1 / 16 | {rt_cell(c1)} / {rt_cell(c16)}; "
        f"a bare `sleep(0)` loop pass is {rt['sleep0']['median_ns'] / 1e3:.2f} µs |",
        "| hand-off `free` → waiter resumes, " + " / ".join(str(d) for d in DEPTHS) + " waiters (steady; p50, p99) | "
        + " / ".join(_us(st[str(d)]["p50_ns"]) for d in DEPTHS) + " µs p50; "
        + " / ".join(_us(st[str(d)]["p99_ns"]) for d in DEPTHS) + " µs p99 |",
        f"| grants/s, {ct['tasks']} contending tasks on {ct['blocks']} blocks | {cc['grants_per_s']:,.0f}/s, "
        f"{cc['ratio_to_single']:.2f}× one task alone ({1 - cc['at_once_share']:.0%} granted after waiting; "
        f"per-task grants {cc['per_task_min']}–{cc['per_task_max']}) |",
    ])
