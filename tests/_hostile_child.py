"""Tenant processes for the hostile ledger tests (run as a script, not collected).

    python _hostile_child.py MODE POOL NAME [ARGS...]

Every mode joins POOL (never creates it) as tenant NAME with no reserve
thread and no reserve, so each alloc that needs a page claims it in the
ledger and each free that empties one releases it. A mode prints "ready"
once it is a tenant, then what it is asked for as one JSON line.

  stop_claim POOL NAME BLOCKS   on the line "go": the next claim stops this
                                process (SIGSTOP, claim pending), alloc BLOCKS
  churn POOL NAME CTL LIMIT     alloc/free forever under a limit of LIMIT bytes;
                                ops counted as a u64 at offset 0 of the file CTL
  hold POOL NAME BLOCKS         alloc BLOCKS, print {"committed"}, wait for EOF
  pidns POOL NAME BLOCKS ASK    (inside another PID namespace) reap, try to
                                alloc ASK, then hold BLOCKS, print what it saw;
                                on each further stdin line print tenants()
  register POOL NAME ROUNDS CTL INDEX
                                race another process registering NAME-<round>
                                (see _race_register)
"""

from __future__ import annotations

import json
import mmap
import os
import random
import struct
import sys
import time

from kvpool import Geometry, KVSpace, KVPoolError, LedgerError, Pool, PoolExhausted

G = Geometry(1, 2, 4096, 256, page_bytes=16384)  # 4 blocks a page, 32 KiB per page commit


def join(pool: str, name: str, limit_bytes: int | None = None) -> tuple[Pool, KVSpace]:
    p = Pool(pool, create=False)
    return p, KVSpace(G, pool=p, name=name, reserve_thread=False, reserve=(0, 0), limit_bytes=limit_bytes)


def rows(p: Pool) -> list[dict[str, object]]:
    # getattr: builds before D5 have no `visible` (and still report the rest)
    return [{"name": t.name, "pid": t.pid, "visible": getattr(t, "visible", None), "committed": t.committed_bytes}
            for t in p.tenants()]


def stop_claim(pool: str, name: str, blocks: int) -> None:
    p, space = join(pool, name)
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    p._ledger.inject_stop_mid_claim()  # the space claims through this very ledger object
    ids = space.alloc(blocks)  # stops inside; a SIGCONT lets it finish
    print(json.dumps({"granted": len(ids)}), flush=True)
    sys.stdin.read()


def churn(pool: str, name: str, ctl_path: str, limit_bytes: int) -> None:
    # The limit keeps room in the pool for the parent whatever the churn does.
    p, space = join(pool, name, limit_bytes)
    fd = os.open(ctl_path, os.O_RDWR)
    ctl = mmap.mmap(fd, 64)
    rng = random.Random(os.getpid())
    held: list[list[int]] = []
    ops = 0
    print("ready", flush=True)
    while True:
        if rng.random() < 0.05:
            p.tenants()  # reaps and reads every slot: stops land in those paths too
        elif held and (len(held) > 6 or rng.random() < 0.5):
            space.free(held.pop(rng.randrange(len(held))))
        else:
            try:
                held.append(space.alloc(rng.randint(1, 12)).tolist())
            except PoolExhausted:
                pass
        ops += 1
        struct.pack_into("<Q", ctl, 0, ops)


def hold(pool: str, name: str, blocks: int) -> None:
    _p, space = join(pool, name)
    space.alloc(blocks)
    print("ready", flush=True)
    print(json.dumps({"committed": space.stats().committed_bytes, "pid": os.getpid()}), flush=True)
    sys.stdin.read()


def pidns(pool: str, name: str, blocks: int, ask: int) -> None:
    p, space = join(pool, name)
    print("ready", flush=True)
    reaped = p.reap()
    try:
        space.alloc(ask)
        outcome = "granted"
    except PoolExhausted as e:
        outcome = type(e).__name__  # RequestTooLarge would say nothing about the other tenants
    try:
        space.alloc(blocks)
        hold = "granted"
    except PoolExhausted as e:  # an over-committed pool (the old defect) has nothing left
        hold = type(e).__name__
    print(json.dumps({"pid": os.getpid(), "reaped": reaped, "alloc": outcome, "hold": hold,
                      "committed": space.stats().committed_bytes, "pool_committed": p.committed,
                      "capacity": p.capacity, "tenants": rows(p)}), flush=True)
    for _line in sys.stdin:
        print(json.dumps({"reaped": p.reap(), "committed": space.stats().committed_bytes,
                          "pool_committed": p.committed, "tenants": rows(p)}), flush=True)


def _race_register(pool: str, name: str, rounds: int, ctl_path: str, index: int) -> None:
    """Two processes (index 0 and 1) register the same name each round.

    ctl: u64 phase of each process at 8*index; u8 outcome of round r of process
    i at 64 + 2*r + i (1 won, 2 refused as a duplicate, 3 other error), and
    the number of tenants named so that the winner saw while both had tried
    at 64 + 2*rounds + r.
    """
    fd = os.open(ctl_path, os.O_RDWR)
    ctl = mmap.mmap(fd, 0)
    p = Pool(pool, create=False)
    other = 1 - index

    def barrier(phase: int) -> None:
        struct.pack_into("<Q", ctl, 8 * index, phase)
        while struct.unpack_from("<Q", ctl, 8 * other)[0] < phase:
            time.sleep(0)  # the other process is live and spinning too: yield, never sleep a fixed time

    print("ready", flush=True)
    for r in range(rounds):
        barrier(3 * r + 1)
        space = None
        try:
            space = KVSpace(G, pool=p, name=f"{name}-{r}", reserve_thread=False, reserve=(0, 0))
            ctl[64 + 2 * r + index] = 1
        except LedgerError as e:
            ctl[64 + 2 * r + index] = 2 if "already has a live tenant" in str(e) else 3
            if ctl[64 + 2 * r + index] == 3:
                print(f"round {r}: {e}", file=sys.stderr, flush=True)
        except KVPoolError as e:
            ctl[64 + 2 * r + index] = 3
            print(f"round {r}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        barrier(3 * r + 2)
        if space is not None:
            ctl[64 + 2 * rounds + r] = sum(t.name == f"{name}-{r}" for t in p.tenants())
            space.close()
        barrier(3 * r + 3)
    print(json.dumps({"done": rounds}), flush=True)


def main() -> None:
    mode, pool, name, *rest = sys.argv[1:]
    if mode == "stop_claim":
        stop_claim(pool, name, int(rest[0]))
    elif mode == "churn":
        churn(pool, name, rest[0], int(rest[1]))
    elif mode == "hold":
        hold(pool, name, int(rest[0]))
    elif mode == "pidns":
        pidns(pool, name, int(rest[0]), int(rest[1]))
    elif mode == "register":
        _race_register(pool, name, int(rest[0]), rest[1], int(rest[2]))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
