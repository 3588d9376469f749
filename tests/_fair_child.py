"""Tenant processes for the fair-share tests (run as a script, not collected).

``python _fair_child.py churn POOL NAME CTL`` — tenant A of issue 14's
acceptance test. A KVSpace with no reserve thread and no reserve (every page
it empties goes back at once, so releases are the policy's doing, not a
thread's timing). It borrows the whole pool one block at a time, then
churns: free its lowest held block, alloc one block, again and again.

Why the lowest id: best fit hands the freed block straight back (it sits on
the only partly used page), so without a policy that says no the churn
recycles one block forever and no page ever empties — the measured failure
of the old policy (issue 14: "its pages never empty"). And once A's allocs
are refused, freeing lowest-first empties its pages one after another, so
the frees a waiter needs are exactly the blocks of the pages it needs.

The counter file (``CTL``, 8-byte little-endian words named in ``WORDS``)
is shared with the test: the test sets ``mode`` (run freely, step on
``token``, stop); the child counts its frees, allocs and refusals there.

``python _fair_child.py factory`` — forks tenants on demand for the
stateful test's SIGKILL rule, so each costs a fork, not an interpreter and
a torch import. It reads ``hold POOL NAME N`` lines on stdin; each forks a
child (from this single-threaded process: safe) that joins POOL as NAME,
allocates up to N blocks, prints ``held NAME PID K`` (or ``error NAME
why``) and sleeps until killed. Children die with the factory
(PR_SET_PDEATHSIG), and the factory exits when its stdin closes; SIGCHLD is
ignored so the kernel reaps killed children at once.
"""

from __future__ import annotations

import heapq
import mmap
import os
import struct
import sys
import time

from kvpool import Geometry, KVSpace, Pool, PoolExhausted

# 4 blocks a page, 2 regions: a page commit is 32 KiB. Shared with the tests.
GEOMETRY = Geometry(1, 2, 4096, 256, page_bytes=16384)

WORDS = (
    "mode",                  # test -> child: RUN, STEP or STOP
    "token",                 # test -> child: in STEP mode, do steps up to this count
    "done",                  # child -> test: steps done (STEP mode)
    "phase",                 # child -> test: STARTING, HOLDING, STEPPING, STOPPED
    "frees",                 # blocks freed (one per free call)
    "allocs",                # allocs granted (one block each, after the initial fill)
    "refusals",              # allocs refused (PoolExhausted)
    "first_refusal_frees",   # `frees` when the first refusal came (-1: none yet)
    "allocs_after_refusal",  # allocs granted after the first refusal
    "violations",            # granted while above its guarantee with a tenant below its own waiting
    "held",                  # blocks held now
    "releases",              # pages this space gave back to the pool (its stats)
    "min_held_after_refusal",  # fewest blocks held since the first refusal (-1: none yet)
)
IDX = {w: i for i, w in enumerate(WORDS)}
CTL_BYTES = 8 * len(WORDS)
RUN, STEP, STOP = 0, 1, 2
STARTING, HOLDING, STEPPING, STOPPED = 0, 1, 2, 3


class Ctl:
    """The counter file, mapped."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, CTL_BYTES)
        finally:
            os.close(fd)

    def __getitem__(self, word: str) -> int:
        return int(struct.unpack_from("<q", self._mm, 8 * IDX[word])[0])

    def __setitem__(self, word: str, value: int) -> None:
        struct.pack_into("<q", self._mm, 8 * IDX[word], value)

    @staticmethod
    def create(path: str) -> Ctl:
        with open(path, "wb") as f:
            f.write(bytes(CTL_BYTES))
        ctl = Ctl(path)
        ctl["first_refusal_frees"] = -1
        ctl["min_held_after_refusal"] = -1
        return ctl


def starving_other(pool: Pool, me: str) -> bool:
    """Whether another tenant waits below its guarantee (one ledger read)."""
    return any(t.name != me and t.want_bytes > 0 and t.committed_bytes < t.guarantee_bytes
               for t in pool.snapshot().tenants)


def churn(pool_name: str, name: str, ctl_path: str) -> None:
    ctl = Ctl(ctl_path)
    pool = Pool(pool_name, create=False)
    space = KVSpace(GEOMETRY, pool=pool, name=name, reserve_thread=False, reserve=(0, 0))
    held: list[int] = []  # a heap: the lowest id on top
    # Borrow the whole pool (nobody waits yet: all of it is free to borrow).
    while True:
        try:
            heapq.heappush(held, int(space.alloc(1)[0]))
        except PoolExhausted:
            break
    ctl["held"] = len(held)
    ctl["phase"] = HOLDING
    frees = allocs = refusals = after = violations = 0
    first = min_held = -1
    while True:
        mode = ctl["mode"]
        if mode == STOP:
            break
        if mode == STEP:
            ctl["phase"] = STEPPING
            if ctl["done"] >= ctl["token"]:
                time.sleep(0.0002)
                continue
        if held:
            space.free([heapq.heappop(held)])
            frees += 1
        above = False
        if first >= 0:
            b = space.budget()
            above = b.claimed_bytes > b.guarantee_bytes
        try:
            block = int(space.alloc(1)[0])
        except PoolExhausted:
            refusals += 1
            if first < 0:
                first = frees
        else:
            heapq.heappush(held, block)
            allocs += 1
            if first >= 0:
                after += 1
                # Granted although it borrows while someone below its guarantee
                # waits (read after the grant: that waiter was waiting throughout).
                if above and starving_other(pool, name):
                    violations += 1
        if first >= 0:
            min_held = len(held) if min_held < 0 else min(min_held, len(held))
        ctl["frees"], ctl["allocs"], ctl["refusals"] = frees, allocs, refusals
        ctl["first_refusal_frees"], ctl["allocs_after_refusal"] = first, after
        ctl["violations"], ctl["held"] = violations, len(held)
        ctl["min_held_after_refusal"] = min_held
        ctl["releases"] = space.stats().releases
        if mode == STEP:
            ctl["done"] = ctl["done"] + 1
    ctl["phase"] = STOPPED
    space.close()


def _hold(pool_name: str, name: str, n: int) -> None:
    """A forked tenant: hold up to n blocks, never call again (an idle or hung engine)."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the factory
    try:
        space = KVSpace(GEOMETRY, pool=Pool(pool_name, create=False), name=name, reserve_thread=False,
                        reserve=(0, 0))
        got = 0
        while got < n:
            try:
                space.alloc(1)
                got += 1
            except PoolExhausted:
                break
    except Exception as e:  # noqa: BLE001 - reported to the test, which judges it
        print(f"error {name} {type(e).__name__}: {e}", flush=True)
        os._exit(1)
    print(f"held {name} {os.getpid()} {got}", flush=True)
    while True:
        time.sleep(60)


def factory() -> None:
    import signal

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps killed children
    for line in sys.stdin:
        cmd, pool_name, name, n = line.split()
        assert cmd == "hold"
        if os.fork() == 0:
            try:
                _hold(pool_name, name, int(n))
            finally:
                os._exit(0)


def main() -> None:
    role = sys.argv[1]
    if role == "churn":
        churn(sys.argv[2], sys.argv[3], sys.argv[4])
    elif role == "factory":
        factory()
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
