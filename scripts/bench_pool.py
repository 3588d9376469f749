#!/usr/bin/env python3
"""Cross-process wake-up latency of a shared pool, against in-process hand-off.

Figure: an engine process (``holder``) holds the whole pool; this process has
a task parked in ``await manager.alloc(16)``. The holder frees its blocks and
trims (its pages go back to the pool), stamping ``time.monotonic_ns()`` (one
system-wide clock) right before; the waiter stamps when its ``alloc``
returns. The path is: holder's release -> ledger generation futex -> this
process's native watcher thread -> eventfd -> event loop -> dispatch.
Baseline, same run: the same wait satisfied by a ``free`` from another task
in this process (plain hand-off, no pool round trip). Reported: p50/p99 in
microseconds and the ratio cross-process / in-process.

Usage: ``python scripts/bench_pool.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import numpy as np
from _benchlib import machine_info, parse_args, utc_now, write_json

from kvpool import Geometry, KVCacheManager, Pool

GEOMETRY = Geometry(1, 2, 4096, 256, page_bytes=16384)  # 4 blocks a page
HOLD = 32  # blocks = 8 pages = the whole pool

HOLDER = textwrap.dedent(
    """
    import sys, time
    from kvpool import Geometry, KVSpace, Pool, PoolExhausted
    g = Geometry(1, 2, 4096, 256, page_bytes=16384)
    s = KVSpace(g, pool=Pool(sys.argv[1], create=False), name="holder", reserve_thread=False, reserve=(0, 0))
    ids = None
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "take":
            while True:
                try:
                    ids = s.alloc(32); break
                except PoolExhausted:
                    time.sleep(0.0005)
            print("took", flush=True)
        elif cmd == "give":
            t = time.monotonic_ns()
            s.free(ids); s.trim()
            print(t, flush=True)
    """
)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q))


async def cross_process(pool: Pool, rounds: int) -> list[float]:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, pool.name], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd="/tmp")
    assert holder.stdin is not None and holder.stdout is not None
    assert holder.stdout.readline().strip() == "ready"
    lat: list[float] = []
    try:
        async with KVCacheManager(GEOMETRY, pool=pool, name="waiter", reserve=(0, 0), reserve_thread=False) as m:
            for _ in range(rounds):
                holder.stdin.write("take\n")
                holder.stdin.flush()
                assert holder.stdout.readline().strip() == "took"
                task = asyncio.create_task(m.alloc(16))
                for _ in range(5):
                    await asyncio.sleep(0)
                assert m.waiting == 1
                holder.stdin.write("give\n")
                holder.stdin.flush()
                ids = await task
                t_grant = time.monotonic_ns()
                t_free = int(await asyncio.to_thread(holder.stdout.readline))
                lat.append((t_grant - t_free) / 1e3)
                m.free(ids)
                m.trim()
    finally:
        holder.kill()
        holder.wait()
        holder.stdin.close()
        holder.stdout.close()
    return lat


async def in_process(pool: Pool, rounds: int) -> list[float]:
    lat: list[float] = []
    async with KVCacheManager(GEOMETRY, pool=pool, name="inproc", reserve=(0, 0), reserve_thread=False) as m:
        for _ in range(rounds):
            held = m.alloc_nowait(HOLD)
            task = asyncio.create_task(m.alloc(16))
            for _ in range(5):
                await asyncio.sleep(0)
            t_free = time.monotonic_ns()
            m.free(held)
            ids = await task
            lat.append((time.monotonic_ns() - t_free) / 1e3)
            m.free(ids)
    return lat


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, "bench-pool.json", argv)
    rounds = 30 if args.quick else 300
    name = f"bench-{uuid.uuid4().hex[:8]}"
    pool = Pool(name, capacity=GEOMETRY.page_commit_bytes * (HOLD // 4))
    try:
        cross = asyncio.run(cross_process(pool, rounds))
        local = asyncio.run(in_process(pool, rounds))
    finally:
        Pool.remove(name)
    res: dict[str, Any] = {
        "when": utc_now(),
        "machine": machine_info(),
        "rounds": rounds,
        "cross_process_us": {"p50": _pct(cross, 50), "p99": _pct(cross, 99), "raw": cross},
        "in_process_us": {"p50": _pct(local, 50), "p99": _pct(local, 99), "raw": local},
    }
    res["ratio_p50"] = res["cross_process_us"]["p50"] / res["in_process_us"]["p50"]
    print(f"kvpool pool bench ({'quick' if args.quick else 'full'}), {rounds} rounds")
    print(f"  {'path':<44} {'p50 us':>9} {'p99 us':>9}")
    print(f"  {'in-process hand-off (free in another task)':<44} {res['in_process_us']['p50']:9.1f} "
          f"{res['in_process_us']['p99']:9.1f}")
    print(f"  {'cross-process (release -> futex -> eventfd)':<44} {res['cross_process_us']['p50']:9.1f} "
          f"{res['cross_process_us']['p99']:9.1f}")
    print(f"  ratio cross/in-process (p50): {res['ratio_p50']:.1f}x")
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
