"""A process that forks while it holds a KV space (run as a script, not collected).

    python _fork_child.py POOL|- RESERVE_THREAD(0|1) MODE

The parent (this script) builds a space (in POOL, or private with "-"),
writes a pattern into 64 blocks, forks, and waits for the child. The child
treats its inherited copy as MODE says, checks that the copy is inert (every
call a Closed error, nothing released) and exits. The parent then checks its
data, its memory and its ledger row, and prints one JSON line. Forking is done
here, not in pytest's own process, to keep that one single-threaded and clean.

  close   the child calls close(), then alloc/free: PoolClosed
  use     the child calls alloc/free/trim/set_limit without closing: PoolClosed
  del     the child drops its references and collects them
  exit    the child returns through the interpreter's normal exit (finalizers run)

    python _fork_child.py - 0 read-released

The parent releases its pages after the fork; the child then only reads its
inherited view (numpy: torch's thread pool is not fork-safe) and exits. The
parent prints its allocated and committed bytes.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch

from kvpool import Geometry, KVSpace, Pool, PoolClosed

G = Geometry(1, 2, 4096, 256, page_bytes=16384)


def child_checks(s: KVSpace, ids: list[int], mode: str) -> list[str]:
    """What the inherited space did that it should not have (empty: inert)."""
    wrong: list[str] = []

    def closed_error(what: str, fn: object) -> None:
        try:
            fn()  # type: ignore[operator]
        except PoolClosed:
            return
        except Exception as e:  # noqa: BLE001 -- reported to the parent
            wrong.append(f"{what}: {type(e).__name__}: {e}")
            return
        wrong.append(f"{what}: no error")

    if mode == "close":
        s.close()
    closed_error("alloc", lambda: s.alloc(1))
    closed_error("free", lambda: s.free(ids[:4]))
    closed_error("trim", s.trim)
    if mode == "use":
        closed_error("set_limit", lambda: s.set_limit(G.page_commit_bytes))
    if s.allocated_bytes() != 0:
        wrong.append(f"allocated_bytes {s.allocated_bytes()} in the child (its mapping is not the parent's memory)")
    return wrong


def read_released() -> None:
    s = KVSpace(G, reserve_thread=False, reserve=(0, 0))
    ids = s.alloc(64)
    v = s.view(0, 0, torch.int32, (1024,))
    v[torch.from_numpy(ids)] = 5
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.read(go_r, 1)  # the parent has released every page
        os.write(1, f"child read {int(v.numpy().sum())}\n".encode())
        os._exit(0)
    s.free(ids)
    released = {"allocated_bytes": s.allocated_bytes(), "committed_bytes": s.stats().committed_bytes}
    os.write(go_w, b"x")
    _, status = os.waitpid(pid, 0)  # any end of the child will do (a fault is fine): the parent's books matter
    after = {"allocated_bytes": s.allocated_bytes(), "committed_bytes": s.stats().committed_bytes}
    s.close()
    print(json.dumps({"child_status": os.waitstatus_to_exitcode(status), "released": released, "after": after}),
          flush=True)


def main() -> None:
    if sys.argv[3] == "read-released":
        read_released()
        return
    pool_arg, reserve_thread, mode = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
    pool = None if pool_arg == "-" else Pool(pool_arg, create=False)
    s = KVSpace(G, pool=pool, name="parent" if pool else None, reserve_thread=reserve_thread,
                reserve=(1, 2) if reserve_thread else (0, 0))
    ids = s.alloc(64).tolist()
    v = s.view(0, 0, torch.int32, (1024,))
    t_ids = torch.tensor(ids)
    v[t_ids] = (t_ids * 7 + 1).to(torch.int32).unsqueeze(1)
    if reserve_thread:
        s.settle(60)

    def figures() -> dict[str, object]:
        st = s.stats()
        out: dict[str, object] = {"allocated_bytes": s.allocated_bytes(), "committed_bytes": st.committed_bytes,
                                  "used_blocks": st.used_blocks, "releases": st.releases}
        if pool is not None:
            out["ledger"] = [(t.name, t.committed_bytes) for t in pool.tenants()]
            out["pool_committed"] = pool.committed
        return out

    before = figures()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            wrong = child_checks(s, ids, mode) if mode in ("close", "use") else []
            os.write(w, json.dumps(wrong).encode())
            os.close(w)
            if mode == "del":
                del s, v
                gc.collect()
            if mode == "exit":
                sys.exit(0)  # the interpreter finalizes the inherited space
        except BaseException as e:  # noqa: BLE001 -- reported through the exit status
            if isinstance(e, SystemExit):
                raise
            os._exit(3)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child_report = f.read()
    _, status = os.waitpid(pid, 0)  # the test's timeout bounds this: a hung child fails it
    after = figures()
    data_ok = bool(torch.equal(v[t_ids][:, 0], (t_ids * 7 + 1).to(torch.int32)) and
                   torch.equal(v[t_ids], v[t_ids][:, :1].expand(-1, 1024)))
    # The parent's space still works after the child is gone.
    s.free(s.alloc(8))
    s.free(ids)
    s.close()
    print(json.dumps({"child_status": os.waitstatus_to_exitcode(status), "child_wrong": json.loads(child_report or "[]"),
                      "before": before, "after": after, "data_ok": data_ok,
                      "pool_committed_after_close": pool.committed if pool else 0}), flush=True)


if __name__ == "__main__":
    main()
