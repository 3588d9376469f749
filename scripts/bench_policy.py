#!/usr/bin/env python3
"""The fair-share policy's cost (issue 14), one run, one machine.

Every figure is printed next to a baseline measured in the same run.

Figures
-------
1. **Round trip** (``roundtrip``): ``alloc(n)`` + ``free(ids)`` of one
   :class:`kvpool.KVSpace` for n = 1 and 16, pages kept committed
   (``reserve=(0, big)``, no reserve thread; the script checks that no page is
   committed or released while it times). Three setups: a private space (no
   pool: the budget has no ledger, so no policy is judged), the same space as
   the only tenant of a pool, and as one of 8 tenants (7 idle spaces in this
   process, each holding one page). The pooled paths read the ledger to judge
   the fair-share rules (the space's ``available`` after each call). Ratios:
   pooled / private, the issue's budget for the policy being <= 1.1x the
   no-policy path (the old code is not built here: the private space is the
   no-ledger baseline), and 8 tenants / 1 tenant. The three spaces live at
   once and their timed loops are interleaved repeat by repeat, so that a
   load change on a shared machine hits all of them alike. Each setup is
   also timed on the bindings alone (``/bindings``: the native calls without
   the Python wrapper's validation), where the policy's share shows best.

2. **Reclaim** (``reclaim``): two processes. Tenant A (a child process, no
   reserve) borrows the whole pool; tenant B (this process, a
   :class:`kvpool.KVCacheManager` below its guarantee) waits in
   ``await alloc(4)`` (one page). A frees the blocks of one page; it stamps
   ``time.monotonic_ns()`` (one clock for every process) right before the free
   that empties the page, which goes back to the pool at once because A lends;
   B stamps when its ``alloc`` returns. The path: A's release -> ledger
   generation futex -> B's watcher thread -> eventfd -> event loop -> grant.
   Baseline, same run, same processes: B with a guarantee of 0 (what every
   tenant was before issue 14): A is no lender, the same free releases the
   same page (no reserve), B is granted as a borrower. p50/p99 in µs over
   200 rounds each, and the ratio policy / baseline.

Usage: ``python scripts/bench_policy.py [--quick] [--json PATH]``
(``--child POOL`` is tenant A, started by the script itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from _benchlib import (
    BIG_RESERVE,
    calibrate,
    KiB,
    MiB,
    geo_info,
    loop_ns,
    machine_info,
    no_gc,
    no_page_syscalls,
    parse_args,
    ratio,
    roundtrip_loop,
    utc_now,
    write_json,
)

from kvpool import Geometry, KVCacheManager, KVSpace, Pool, PoolExhausted

# Round trip: 16 blocks a page, 2 regions.
RT_GEOMETRY = Geometry(1, 2, 4 * KiB, 4096, page_bytes=64 * KiB)
RT_SIZES = (1, 16)
OTHER_TENANTS = 7

# Reclaim: 4 blocks a page, a pool of 8 page commits (32 blocks).
RC_GEOMETRY = Geometry(1, 2, 4 * KiB, 256, page_bytes=16 * KiB)
RC_BPP = 4
RC_POOL_PAGES = 8


# ------------------------------------------------------------- round trip


def _raw_alloc(space: KVSpace) -> Callable[[int], Any]:
    """The binding's alloc, returning only the ids (its tuple also carries code, counts and message)."""
    alloc = space._space.alloc

    def call(n: int) -> Any:
        return alloc(n)[1]

    return call


def roundtrip(repeats: int, target_s: float) -> dict[str, Any]:
    """The three setups alive at once, their repeats interleaved so that load drifts hit all alike."""
    setups = ("private", "pooled_1_tenant", f"pooled_{OTHER_TENANTS + 1}_tenants")
    pool_names = [f"bench-policy-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    pool1, pool8 = (Pool(p, capacity=64 * MiB) for p in pool_names)
    spaces: dict[str, KVSpace] = {}
    idle: list[KVSpace] = []
    try:
        for i in range(OTHER_TENANTS):
            o = KVSpace(RT_GEOMETRY, pool=pool8, name=f"idle{i}", reserve=(0, 0), reserve_thread=False)
            o.alloc(16)  # one page each: live rows in every ledger snapshot
            idle.append(o)
        for setup, pool in zip(setups, (None, pool1, pool8)):
            spaces[setup] = KVSpace(RT_GEOMETRY, reserve=(0, BIG_RESERVE), reserve_thread=False, pool=pool,
                                    name="timed")
        out: dict[str, Any] = {s: {} for s in setups}
        for n in RT_SIZES:
            bodies = {}
            for setup, space in spaces.items():
                space.free(space.alloc(n))  # commit the pages once; they stay (big reserve)
                if space.pool is not None:
                    assert not space.budget().lending
                bodies[setup] = roundtrip_loop(space.alloc, space.free, n)
                # The bindings alone (no Python validation): the policy's share of the native call.
                bodies[setup + "/bindings"] = roundtrip_loop(_raw_alloc(space), space._space.free, n)
            with contextlib.ExitStack() as checks, no_gc():
                for setup, space in spaces.items():
                    checks.enter_context(no_page_syscalls(space, f"{setup} round trip n={n}"))
                iters: dict[str, int] = {}
                for setup, body in bodies.items():
                    body(16)  # warm-up
                    iters[setup] = calibrate(body, target_s, max_iters=1 << 22)
                runs: dict[str, list[float]] = {s: [] for s in bodies}
                for _ in range(repeats):
                    for setup, body in bodies.items():
                        runs[setup].append(loop_ns(body, iters[setup]))
            for key, r in runs.items():
                out.setdefault(key, {})[f"n={n}"] = {"median_ns": statistics.median(r), "min_ns": min(r),
                                                     "runs_ns": r, "iters": iters[key]}
    finally:
        for sp in [*spaces.values(), *idle]:
            sp.close()
        for p in pool_names:
            Pool.remove(p)
    ratios: dict[str, Any] = {}
    for level in ("", "/bindings"):
        base = out["private" + level]
        for setup in setups[1:]:
            ratios[setup + level] = {k: ratio(out[setup + level][k]["median_ns"], base[k]["median_ns"]) for k in base}
        one, many = out[setups[1] + level], out[setups[2] + level]
        ratios["tenants_8_over_1" + level] = {k: ratio(many[k]["median_ns"], one[k]["median_ns"]) for k in one}
    out["ratios"] = ratios
    return out


# ---------------------------------------------------------------- reclaim


def child_main(pool_name: str) -> None:
    """Tenant A: ``fill`` borrows the whole pool; ``give`` empties the page of its lowest blocks."""
    g = RC_GEOMETRY
    space = KVSpace(g, pool=Pool(pool_name, create=False), name="A", reserve=(0, 0), reserve_thread=False)
    held: list[int] = []
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "fill":
            while True:
                try:
                    held.append(int(space.alloc(1)[0]))
                except PoolExhausted:
                    break
            print(f"full {len(held)}", flush=True)
        elif cmd == "give":
            held.sort()
            page = g.page_of(held[0])
            blocks = [b for b in held if g.page_of(b) == page]
            if len(blocks) > 1:
                space.free(blocks[:-1])  # the page is not empty yet: nothing goes back
            t = time.monotonic_ns()
            space.free(blocks[-1:])      # empties it: back to the pool at once
            held = [b for b in held if g.page_of(b) != page]
            print(t, flush=True)
    space.close()


async def _rounds(pool: Pool, child: subprocess.Popen[str], guarantee: int | None, rounds: int) -> list[float]:
    assert child.stdin is not None and child.stdout is not None
    lat: list[float] = []
    async with KVCacheManager(RC_GEOMETRY, pool=pool, name=f"B{guarantee}", reserve=(0, 0), reserve_thread=False,
                              guarantee_bytes=guarantee) as m:
        for _ in range(rounds):
            child.stdin.write("fill\n")
            child.stdin.flush()
            full = child.stdout.readline().split()
            assert full[0] == "full" and int(full[1]) == RC_POOL_PAGES * RC_BPP, full
            task = asyncio.create_task(m.alloc(RC_BPP))
            while m.waiting != 1:
                await asyncio.sleep(0)
            child.stdin.write("give\n")
            child.stdin.flush()
            ids = await task
            t_grant = time.monotonic_ns()
            t_free = int(await asyncio.to_thread(child.stdout.readline))
            lat.append((t_grant - t_free) / 1e3)
            m.free(ids)  # no reserve: B's page goes back, A refills it next round
        if guarantee is None:
            assert m.stats().granted_after_wait == rounds
    return lat


def _pcts(xs: list[float]) -> dict[str, Any]:
    a = np.array(xs)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "raw": xs}


def reclaim(rounds: int) -> dict[str, Any]:
    name = f"bench-policy-{uuid.uuid4().hex[:8]}"
    pool = Pool(name, capacity=RC_POOL_PAGES * RC_GEOMETRY.page_commit_bytes)
    child = subprocess.Popen([sys.executable, __file__, "--child", name], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd="/tmp")
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        # Interleaved halves so that load drifts hit both alike.
        policy: list[float] = []
        plain: list[float] = []
        for _ in range(2):
            policy += asyncio.run(_rounds(pool, child, None, rounds // 2))  # B below its guarantee: A lends
            plain += asyncio.run(_rounds(pool, child, 0, rounds // 2))      # no guarantee: A just frees
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=60)
        if child.stdout is not None:
            child.stdout.close()
        Pool.remove(name)
    res: dict[str, Any] = {"rounds": rounds, "lend_reclaim_us": _pcts(policy), "no_guarantee_us": _pcts(plain)}
    res["ratio_p50"] = ratio(res["lend_reclaim_us"]["p50"], res["no_guarantee_us"]["p50"])
    res["ratio_p99"] = ratio(res["lend_reclaim_us"]["p99"], res["no_guarantee_us"]["p99"])
    return res


# ------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child_main(argv[1])
        return 0
    args = parse_args(__doc__, "bench-policy.json", argv)
    repeats, target_s = (3, 0.05) if args.quick else (11, 0.2)
    rounds = 40 if args.quick else 200
    rt = roundtrip(repeats, target_s)
    rc = reclaim(rounds)
    res: dict[str, Any] = {
        "when": utc_now(),
        "machine": machine_info(),
        "quick": args.quick,
        "roundtrip": {"geometry": geo_info(RT_GEOMETRY), **rt},
        "reclaim": {"geometry": geo_info(RC_GEOMETRY), "pool_pages": RC_POOL_PAGES, **rc},
    }
    print(f"kvpool policy bench ({'quick' if args.quick else 'full'})")
    print("  alloc(n) + free round trip, ns per call (median)")
    setups = [s for s in rt if s != "ratios"]
    print(f"  {'setup':<30}" + "".join(f"{'n=' + str(n):>10}{'ratio':>8}" for n in RT_SIZES))
    for s in setups:
        cells = ""
        for n in RT_SIZES:
            k = f"n={n}"
            r = 1.0 if s.startswith("private") else rt["ratios"][s][k]
            cells += f"{rt[s][k]['median_ns']:10.0f}{r:8.2f}"
        print(f"  {s:<30}{cells}")
    for level in ("", "/bindings"):
        print(f"  ratio 8 tenants / 1 tenant{level}: " + ", ".join(
            f"n={n} {rt['ratios']['tenants_8_over_1' + level][f'n={n}']:.2f}x" for n in RT_SIZES))
    print(f"  cross-process reclaim, {rounds} rounds: B's grant after A's free that empties its page")
    print(f"  {'path':<44} {'p50 us':>9} {'p99 us':>9}")
    print(f"  {'no guarantee (A frees, B borrows)':<44} {rc['no_guarantee_us']['p50']:9.1f} "
          f"{rc['no_guarantee_us']['p99']:9.1f}")
    print(f"  {'lend + reclaim (B below its guarantee)':<44} {rc['lend_reclaim_us']['p50']:9.1f} "
          f"{rc['lend_reclaim_us']['p99']:9.1f}")
    print(f"  ratio policy / no guarantee: p50 {rc['ratio_p50']:.2f}x, p99 {rc['ratio_p99']:.2f}x")
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
