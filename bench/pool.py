"""Suite ``pool``: cross-process wake-up through a shared pool, against in-process hand-off.

An engine process (the *holder*, ``python -m kvpool.bench.pool holder POOL``)
holds the whole pool; this process has a task parked in ``await
manager.alloc(16)``. The holder frees its blocks and trims (its pages go back
to the pool), stamping ``time.monotonic_ns()`` (one clock for every process)
right before; the waiter stamps when its ``alloc`` returns. The path: the
holder's release -> ledger generation futex -> this process's watcher thread
-> eventfd -> event loop -> grant (and the commit of the granted pages).
Baseline, same run, same pool: the same wait satisfied by a ``free`` from
another task in this process (a hand-off: its pages stay committed). The two are
interleaved in halves. p50/p99 in µs; ratio cross-process / in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._lib import cross_process_grant_us, end_child, machine_line, ratio
from ._timing import percentiles

if TYPE_CHECKING:
    from kvpool import Geometry, Pool

TITLE = "cross-process wake-up through the pool ledger"
HOLD = 32  # blocks = 8 pages = the whole pool


def _geometry() -> Geometry:
    from kvpool import Geometry

    return Geometry(1, 2, 4096, 256, page_bytes=16384)  # 4 blocks a page


def holder(pool_name: str) -> None:
    """The other engine: ``take`` holds the whole pool, ``give`` frees and trims it, after a timestamp."""
    from kvpool import KVSpace, Pool, PoolExhausted

    s = KVSpace(_geometry(), pool=Pool(pool_name, create=False), name="holder", reserve_thread=False, reserve=(0, 0))
    ids = None
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "take":
            while True:
                try:
                    ids = s.alloc(HOLD)
                    break
                except PoolExhausted:
                    time.sleep(0.0005)
            print("took", flush=True)
        elif cmd == "give":
            assert ids is not None
            t = time.monotonic_ns()
            s.free(ids)
            s.trim()
            print(t, flush=True)
    s.close()


async def cross_process(pool: Pool, child: subprocess.Popen[str], rounds: int) -> list[float]:
    from kvpool import KVCacheManager

    assert child.stdin is not None and child.stdout is not None
    lat: list[float] = []
    async with KVCacheManager(_geometry(), pool=pool, name="waiter", reserve=(0, 0), reserve_thread=False) as m:
        for _ in range(rounds):
            child.stdin.write("take\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "took"
            lat.append(await cross_process_grant_us(m, child, 16))
    return lat


async def in_process(pool: Pool, rounds: int) -> list[float]:
    from kvpool import KVCacheManager

    lat: list[float] = []
    async with KVCacheManager(_geometry(), pool=pool, name="inproc", reserve=(0, 0), reserve_thread=False) as m:
        for _ in range(rounds):
            held = m.alloc_nowait(HOLD)
            task = asyncio.create_task(m.alloc(16))
            while m.waiting != 1:
                await asyncio.sleep(0)
            t_free = time.monotonic_ns()
            m.free(held)
            ids = await task
            lat.append((time.monotonic_ns() - t_free) / 1e3)
            m.free(ids)
            m.trim()
    return lat


def run(opts: argparse.Namespace) -> dict[str, Any]:
    from kvpool import Pool

    rounds = 30 if opts.quick else 300
    name = f"bench-{uuid.uuid4().hex[:8]}"
    pool = Pool(name, capacity=_geometry().page_commit_bytes * (HOLD // 4))
    cross: list[float] = []
    local: list[float] = []
    child = subprocess.Popen([sys.executable, "-m", "kvpool.bench.pool", "holder", name], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd="/tmp")
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        for _ in range(2):  # interleaved halves: a load drift hits both alike
            cross += asyncio.run(cross_process(pool, child, rounds // 2))
            local += asyncio.run(in_process(pool, rounds // 2))
    finally:
        end_child(child, timeout=30)
        Pool.remove(name)
    res: dict[str, Any] = {"rounds": rounds, "cross_process_us": percentiles(cross),
                           "in_process_us": percentiles(local)}
    res["ratio_p50"] = ratio(res["cross_process_us"]["p50"], res["in_process_us"]["p50"])
    return res


def format_report(res: Mapping[str, Any]) -> str:
    c, i = res["cross_process_us"], res["in_process_us"]
    return "\n".join([
        machine_line(res["machine"]) + f"; {res['rounds']} rounds",
        f"   {'path':<46}{'p50 us':>9}{'p99 us':>9}",
        f"   {'in-process hand-off (free in another task)':<46}{i['p50']:>9.1f}{i['p99']:>9.1f}",
        f"   {'cross-process (release -> futex -> eventfd)':<46}{c['p50']:>9.1f}{c['p99']:>9.1f}",
        f"   ratio cross / in-process (p50): {res['ratio_p50']:.2f}x",
    ])


def markdown(res: Mapping[str, Any]) -> str:
    c, i = res["cross_process_us"], res["in_process_us"]
    return (f"An `await alloc` in one process granted by another process's release (free + trim): p50 "
            f"{c['p50']:.0f} µs, p99 {c['p99']:.0f} µs, against {i['p50']:.0f} / {i['p99']:.0f} µs when a task in "
            f"the same process frees ({res['ratio_p50']:.1f}× at p50; {res['rounds']} rounds). The cross-process "
            "path includes the holder's page releases and the waiter's commits; in-process, the freed pages "
            "stay committed (idle pages go back only after `idle_release_s`) and hand the blocks over directly.")


if __name__ == "__main__":
    if sys.argv[1:2] != ["holder"] or len(sys.argv) != 3:
        sys.exit("usage: python -m kvpool.bench.pool holder POOL  (started by `kvpool bench pool`)")
    holder(sys.argv[2])
