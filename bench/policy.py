"""Suite ``policy``: the fair-share policy's cost (issue 14), one run, one machine.

Figures
-------
1. **Round trip** (``roundtrip``): ``free(alloc(n))`` of one ``KVSpace`` for
   n = 1 and 16, pages kept committed (``reserve=(0, big)``, no reserve
   thread; checked). Three setups alive at once, their repeats interleaved: a
   private space (no pool: no policy is judged), the same space as the only
   tenant of a pool, and as one of 8 tenants (7 idle spaces, one page each).
   Each is also timed on the bindings alone (``/bindings``: the native calls
   without the Python wrapper), where the policy's share shows best. Ratios
   pooled / private (goal <= 1.1x, issue 14's budget for the policy) and
   8 tenants / 1.

2. **Reclaim** (``reclaim``): tenant A (``python -m kvpool.bench.policy
   lender POOL``, no reserve) borrows the whole pool; tenant B (this process,
   a ``KVCacheManager`` below its guarantee) waits in ``await alloc(4)``
   (one page). A frees the blocks of one page, stamping
   ``time.monotonic_ns()`` right before the free that empties it (back to
   the pool at once: A lends); B stamps when its ``alloc`` returns.
   Baseline, same run, same processes: B with a guarantee of 0 (A is no
   lender; B is granted as a borrower). Interleaved halves; p50/p99 in µs and
   the ratio policy / baseline.

3. **Reclaim by preemption** (``reclaim.preemption``, issue 31): the same
   two tenants, B below its guarantee waiting in ``await alloc(4)``, but A
   publishes no ``freeing`` (no completion due), so the verdict asks A to
   preempt. A polls its own ``budget().preempt_bytes`` (as an engine does
   at each step) and stamps when it turns > 0 (the verdict latency, from
   B's wait), then frees that page with ``free_preempted`` (counted as
   reclaimed by preemption) and stamps the free; B stamps its grant. p50/p99
   of the verdict latency and of free -> grant, beside reclaim by
   completion (2.) in the same run; A's preemption counters are checked.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._lib import BIG_RESERVE, Goal, cross_process_grant_us, KiB, MiB, geo_info, goal_lines, machine_line, no_page_syscalls, ratio
from ._timing import SyncBody, interleaved_ns, percentiles, roundtrip_loop

if TYPE_CHECKING:
    from kvpool import Geometry, KVCacheManager, KVSpace, Pool

TITLE = "the fair-share policy's cost"
RT_SIZES = (1, 16)
OTHER_TENANTS = 7
POLICY_GOAL = 1.1  # pooled / private round trip
RC_BPP = 4  # reclaim: 4 blocks a page, a pool of 8 page commits (32 blocks)
RC_POOL_PAGES = 8
SETUPS = ("private", "pooled_1_tenant", f"pooled_{OTHER_TENANTS + 1}_tenants")


def _rt_geometry() -> Geometry:
    from kvpool import Geometry

    return Geometry(1, 2, 4 * KiB, 4096, page_bytes=64 * KiB)  # 16 blocks a page, 2 regions


def _rc_geometry() -> Geometry:
    from kvpool import Geometry

    return Geometry(1, 2, 4 * KiB, 256, page_bytes=16 * KiB)


# ------------------------------------------------------------- round trip


def roundtrip(repeats: int, target_s: float) -> dict[str, Any]:
    from kvpool import KVSpace, Pool

    pool_names = [f"bench-policy-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    pool1, pool8 = (Pool(p, capacity=64 * MiB) for p in pool_names)
    spaces: dict[str, KVSpace] = {}
    idle: list[KVSpace] = []
    out: dict[str, Any] = {}
    try:
        for i in range(OTHER_TENANTS):
            o = KVSpace(_rt_geometry(), pool=pool8, name=f"idle{i}", reserve=(0, 0), reserve_thread=False)
            o.alloc(16)  # one page each: live rows in every ledger snapshot
            idle.append(o)
        for setup, pool in zip(SETUPS, (None, pool1, pool8)):
            spaces[setup] = KVSpace(_rt_geometry(), reserve=(0, BIG_RESERVE), reserve_thread=False, pool=pool,
                                    name="timed")
        for n in RT_SIZES:
            bodies: dict[str, SyncBody] = {}
            for setup, space in spaces.items():
                space.free(space.alloc(n))  # commit the pages once; they stay (big reserve)
                if space.pool is not None:
                    assert not space.budget().lending
                bodies[setup] = roundtrip_loop(space.alloc, space.free, n)
                # The bindings alone: alloc returns the ids array (or a Failure), free the blocks available.
                bodies[setup + "/bindings"] = roundtrip_loop(space._space.alloc, space._space.free, n)
            with contextlib.ExitStack() as checks:
                for setup, space in spaces.items():
                    checks.enter_context(no_page_syscalls(space, f"{setup} round trip n={n}"))
                t = interleaved_ns(bodies, repeats, target_s, max_iters=1 << 22)
            for key, r in t.items():
                out.setdefault(key, {})[f"n={n}"] = r
    finally:
        for sp in [*spaces.values(), *idle]:
            sp.close()
        for p in pool_names:
            Pool.remove(p)
    ratios: dict[str, Any] = {}
    for level in ("", "/bindings"):
        base = out["private" + level]
        for setup in SETUPS[1:]:
            ratios[setup + level] = {k: ratio(out[setup + level][k]["median_ns"], base[k]["median_ns"]) for k in base}
        one, many = out[SETUPS[1] + level], out[SETUPS[2] + level]
        ratios["tenants_8_over_1" + level] = {k: ratio(many[k]["median_ns"], one[k]["median_ns"]) for k in one}
    out["ratios"] = ratios
    return out


# ---------------------------------------------------------------- reclaim


def lender(pool_name: str) -> None:
    """Tenant A: ``fill`` borrows the whole pool; ``give`` empties the page of its lowest blocks."""
    from kvpool import KVSpace, Pool, PoolExhausted

    g = _rc_geometry()
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
        elif cmd in ("give", "preempt"):
            held.sort()
            page = g.page_of(held[0])
            blocks = [b for b in held if g.page_of(b) == page]
            t_verdict = 0
            if cmd == "preempt":  # wait for the verdict, as an engine reads it at each step
                while space.budget().preempt_bytes <= 0:
                    time.sleep(0.0001)
                t_verdict = time.monotonic_ns()
            if cmd == "preempt":  # one request, the page's blocks, preempted: back to the pool, counted
                t = time.monotonic_ns()
                space.free_preempted(blocks, requests=1, tokens=len(blocks))
            else:
                if len(blocks) > 1:
                    space.free(blocks[:-1])  # the page is not empty yet: nothing goes back
                t = time.monotonic_ns()
                space.free(blocks[-1:])  # empties it: back to the pool at once (A lends)
            held = [b for b in held if g.page_of(b) != page]
            print(*((t, t_verdict) if cmd == "preempt" else (t,)), flush=True)
        elif cmd == "counts":
            b = space.budget()
            print(b.requests_preempted, b.reclaimed_by_preemption_bytes, flush=True)
    space.close()


async def _preempt_round(m: KVCacheManager, child: subprocess.Popen[str]) -> tuple[float, float]:
    """One round of reclaim by preemption: (µs from B's wait to A's verdict, µs from A's free to B's grant)."""
    assert child.stdin is not None and child.stdout is not None
    task = asyncio.create_task(m.alloc(RC_BPP))
    while m.waiting != 1:
        await asyncio.sleep(0)
    t_wait = time.monotonic_ns()
    child.stdin.write("preempt\n")
    child.stdin.flush()
    ids = await task
    t_grant = time.monotonic_ns()
    t_free, t_verdict = map(int, (await asyncio.to_thread(child.stdout.readline)).split())
    m.free(ids)
    m.trim()  # the granted page goes back; the child refills it next round
    return max(0.0, (t_verdict - t_wait) / 1e3), (t_grant - t_free) / 1e3


async def _rounds(pool: Pool, child: subprocess.Popen[str], guarantee: int | None, rounds: int,
                  preempt: bool = False) -> list[Any]:
    from kvpool import KVCacheManager

    assert child.stdin is not None and child.stdout is not None
    lat: list[Any] = []
    async with KVCacheManager(_rc_geometry(), pool=pool, name=f"B{guarantee}", reserve=(0, 0), reserve_thread=False,
                              guarantee_bytes=guarantee) as m:
        for _ in range(rounds):
            child.stdin.write("fill\n")
            child.stdin.flush()
            full = child.stdout.readline().split()
            assert full[0] == "full" and int(full[1]) == RC_POOL_PAGES * RC_BPP, full
            lat.append(await _preempt_round(m, child) if preempt else await cross_process_grant_us(m, child, RC_BPP))
    return lat


def reclaim(rounds: int) -> dict[str, Any]:
    from kvpool import Pool

    name = f"bench-policy-{uuid.uuid4().hex[:8]}"
    pool = Pool(name, capacity=RC_POOL_PAGES * _rc_geometry().page_commit_bytes)
    child = subprocess.Popen([sys.executable, "-m", "kvpool.bench.policy", "lender", name], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd="/tmp")
    policy: list[float] = []
    plain: list[float] = []
    preempted: list[tuple[float, float]] = []
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        for _ in range(2):  # interleaved thirds: a load drift hits all alike
            policy += asyncio.run(_rounds(pool, child, None, rounds // 2))  # B below its guarantee: A lends
            plain += asyncio.run(_rounds(pool, child, 0, rounds // 2))  # no guarantee: A just frees
            preempted += asyncio.run(_rounds(pool, child, None, rounds // 2, preempt=True))  # A preempts
        assert child.stdin is not None
        child.stdin.write("counts\n")
        child.stdin.flush()
        requests, reclaimed = map(int, child.stdout.readline().split())
        if requests != len(preempted) or reclaimed != len(preempted) * _rc_geometry().page_commit_bytes:
            raise RuntimeError(f"the lender counted {requests} preemptions and {reclaimed} bytes reclaimed by "
                               f"preemption for {len(preempted)} rounds")
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=60)
        if child.stdout is not None:
            child.stdout.close()
        Pool.remove(name)
    res: dict[str, Any] = {"rounds": rounds, "lend_reclaim_us": percentiles(policy),
                           "no_guarantee_us": percentiles(plain)}
    res["ratio_p50"] = ratio(res["lend_reclaim_us"]["p50"], res["no_guarantee_us"]["p50"])
    res["ratio_p99"] = ratio(res["lend_reclaim_us"]["p99"], res["no_guarantee_us"]["p99"])
    res["preemption"] = {"verdict_us": percentiles([v for v, _ in preempted]),
                         "grant_after_free_us": percentiles([g for _, g in preempted]),
                         "counted_requests": requests, "counted_bytes": reclaimed}
    return res


# ------------------------------------------------------------------ suite


def run(opts: argparse.Namespace) -> dict[str, Any]:
    repeats, target_s = (3, 0.05) if opts.quick else (11, 0.2)
    rt = roundtrip(repeats, target_s)
    rc = reclaim(40 if opts.quick else 200)
    goals = [Goal(f"{setup} / private, {k}", rt["ratios"][setup][k], POLICY_GOAL)
             for setup in SETUPS[1:] for k in rt["ratios"][setup]]
    return {"repeats": repeats, "roundtrip": {"geometry": geo_info(_rt_geometry()), **rt},
            "reclaim": {"geometry": geo_info(_rc_geometry()), "pool_pages": RC_POOL_PAGES, **rc},
            "goals": [g.as_json() for g in goals]}


def format_report(res: Mapping[str, Any]) -> str:
    rt, rc = res["roundtrip"], res["reclaim"]
    lines = [machine_line(res["machine"]), "",
             f"1. alloc(n) + free round trip, ns per call (medians of {res['repeats']} interleaved repeats), "
             "ratio to the private space",
             f"   {'setup':<30}" + "".join(f"{'n=' + str(n):>10}{'ratio':>8}" for n in RT_SIZES)]
    for setup in (s + level for level in ("", "/bindings") for s in SETUPS):
        cells = ""
        for n in RT_SIZES:
            k = f"n={n}"
            r = 1.0 if setup.startswith("private") else rt["ratios"][setup][k]
            cells += f"{rt[setup][k]['median_ns']:10.0f}{r:8.2f}"
        lines.append(f"   {setup:<30}{cells}")
    for level in ("", "/bindings"):
        lines.append(f"   ratio 8 tenants / 1 tenant{level}: " + ", ".join(
            f"n={n} {rt['ratios']['tenants_8_over_1' + level][f'n={n}']:.2f}x" for n in RT_SIZES))
    lines += goal_lines(res["goals"])
    lines += ["", f"2. cross-process reclaim, {rc['rounds']} rounds: B's grant after A's free that empties its page",
              f"   {'path':<44}{'p50 us':>9}{'p99 us':>9}",
              f"   {'no guarantee (A frees, B borrows)':<44}{rc['no_guarantee_us']['p50']:9.1f}"
              f"{rc['no_guarantee_us']['p99']:9.1f}",
              f"   {'lend + reclaim (B below its guarantee)':<44}{rc['lend_reclaim_us']['p50']:9.1f}"
              f"{rc['lend_reclaim_us']['p99']:9.1f}",
              f"   ratio policy / no guarantee: p50 {rc['ratio_p50']:.2f}x, p99 {rc['ratio_p99']:.2f}x"]
    if "preemption" in rc:
        pe = rc["preemption"]
        lines += ["", "3. reclaim by preemption (A publishes no freeing: the verdict asks it to preempt)",
                  f"   {'B waits -> A reads a verdict > 0':<44}{pe['verdict_us']['p50']:9.1f}{pe['verdict_us']['p99']:9.1f}",
                  f"   {'A frees the preempted page -> B granted':<44}{pe['grant_after_free_us']['p50']:9.1f}"
                  f"{pe['grant_after_free_us']['p99']:9.1f}",
                  f"   counted by A: {pe['counted_requests']} requests preempted, "
                  f"{pe['counted_bytes']} bytes reclaimed by preemption"]
    return "\n".join(lines)


def markdown(res: Mapping[str, Any]) -> str:
    rt, rc = res["roundtrip"], res["reclaim"]
    r = rt["ratios"]
    return "\n".join([
        "| figure | n = 1 | n = 16 |",
        "|---|---|---|",
        "| `KVSpace` round trip, private (no policy) | "
        + " | ".join(f"{rt['private'][f'n={n}']['median_ns'] / 1e3:.2f} µs" for n in RT_SIZES) + " |",
        *(f"| same, {label} / private (goal ≤ {POLICY_GOAL:g}×) | "
          + " | ".join(f"{r[setup][f'n={n}']:.2f}×" for n in RT_SIZES) + " |"
          for setup, label in ((SETUPS[1], "1 pool tenant"), (SETUPS[2], f"{OTHER_TENANTS + 1} pool tenants"))),
        "",
        f"Cross-process lend + reclaim (B below its guarantee, A lends the page it empties): p50 "
        f"{rc['lend_reclaim_us']['p50']:.0f} µs, p99 {rc['lend_reclaim_us']['p99']:.0f} µs, against "
        f"{rc['no_guarantee_us']['p50']:.0f} / {rc['no_guarantee_us']['p99']:.0f} µs with no guarantee "
        f"({rc['ratio_p50']:.2f}× at p50; {rc['rounds']} rounds).",
        *([] if "preemption" not in rc else [
            "",
            f"Reclaim by preemption (A publishes no freeing; it reads its verdict as an engine does each step): "
            f"B's wait to A's verdict p50 {rc['preemption']['verdict_us']['p50']:.0f} µs, p99 "
            f"{rc['preemption']['verdict_us']['p99']:.0f} µs; A's preempted free to B's grant p50 "
            f"{rc['preemption']['grant_after_free_us']['p50']:.0f} µs, p99 "
            f"{rc['preemption']['grant_after_free_us']['p99']:.0f} µs."]),
    ])


if __name__ == "__main__":
    if sys.argv[1:2] != ["lender"] or len(sys.argv) != 3:
        sys.exit("usage: python -m kvpool.bench.policy lender POOL  (started by `kvpool bench policy`)")
    lender(sys.argv[2])
