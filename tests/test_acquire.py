"""KVSpace.acquire: the one bounded wait of synchronous callers (issue 34).

The wait is bounded by what other tenants do, not by how long they take:
it goes on while any of them claims, frees or is granted memory, and gives
up ("the pool stalled") once none has for ``stall`` seconds. The tests wait
for events (the ledger showing the waiter, a thread's result) and count;
the only clock is the peers' own pacing and ``stall`` itself, which a test
either wants to pass (a stopped peer) or keeps a working peer well inside.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvpool import Geometry, KVSpace, Pool, PoolClosed, PoolExhausted, RequestTooLarge

from ._helpers import wait_until

PAGE = 4096
PER_PAGE = 8
GEOMETRY = Geometry(1, 1, PAGE // PER_PAGE, 64, page_bytes=PAGE)  # 8 pages of 8 blocks


def _space(pool: str, name: str, guarantee_bytes: int | None = None) -> KVSpace:
    return KVSpace(GEOMETRY, pool=pool, name=name, reserve_thread=False, reserve=(0, 0),
                   guarantee_bytes=guarantee_bytes)


def _row(pool: str, name: str) -> Any:
    return next(t for t in Pool(pool).snapshot().tenants if t.name == name)


class _Acquirer(threading.Thread):
    """acquire() on a thread; `result` is its blocks or the exception it raised."""

    def __init__(self, space: KVSpace, n: int, **kw: Any) -> None:
        super().__init__(daemon=True)
        self.space, self.n, self.kw = space, n, kw
        self.result: Any = None

    def run(self) -> None:
        try:
            self.result = self.space.acquire(self.n, **self.kw)
        except BaseException as e:  # noqa: BLE001 - examined by the test
            self.result = e


def test_acquire_grants_at_once_when_the_memory_is_there(pool_name: str) -> None:
    Pool(pool_name, capacity=8 * PAGE)
    with _space(pool_name, "a") as a:
        ids = a.acquire(3)
        assert isinstance(ids, np.ndarray) and len(set(ids.tolist())) == 3
        items = [f"block{i}" for i in range(GEOMETRY.num_blocks)]
        got = a.acquire(2, items=items)
        assert isinstance(got, list) and all(g.startswith("block") for g in got)
        assert a.stats().used_blocks == 5 and a.stats().shortages == 0


def test_acquire_refuses_bad_arguments_and_changes_nothing(pool_name: str) -> None:
    Pool(pool_name, capacity=8 * PAGE)
    with _space(pool_name, "a") as a:
        for kw, err in ((dict(stall=0), ValueError), (dict(stall=float("nan")), ValueError),
                        (dict(stall=float("inf")), ValueError), (dict(timeout=-1), ValueError),
                        (dict(promised=1), TypeError), (dict(items=(1, 2)), TypeError),
                        (dict(items=["x"]), ValueError)):
            with pytest.raises(err):
                a.acquire(1, **kw)  # type: ignore[call-overload]
        with pytest.raises(ValueError):
            a.acquire(-1)
        with pytest.raises(RequestTooLarge):  # never grantable: refused at once, never waited for
            a.acquire(GEOMETRY.num_blocks + 1, stall=3600)
        assert a.stats().used_blocks == 0 and _row(pool_name, "a").waiting == 0


def test_acquire_waits_while_the_peer_works_and_is_granted_when_it_frees(pool_name: str) -> None:
    # The peer holds the whole pool, all of it its guarantee (so it is no
    # lender), and keeps working (allocs counted in the ledger) for three
    # stall bounds before it frees: the waiter waits it out. With a fixed
    # deadline of one stall bound it would have failed.
    Pool(pool_name, capacity=4 * PAGE)
    stall = 1.0
    with _space(pool_name, "peer", 4 * PAGE) as peer, _space(pool_name, "waiter", 0) as waiter:
        held = peer.alloc(4 * PER_PAGE)
        w = _Acquirer(waiter, PER_PAGE, stall=stall)
        w.start()
        wait_until(lambda: _row(pool_name, "waiter").waiting == 1, "the pool sees the waiter waiting")
        assert _row(pool_name, "waiter").want_bytes > 0
        end = time.monotonic() + 3 * stall
        rounds = 0
        while time.monotonic() < end:
            peer.free(held[:1])
            held[:1] = peer.alloc(1)
            rounds += 1
            time.sleep(0.02)
        assert w.result is None and w.is_alive()  # still waiting after 3 stall bounds of work
        peer.free(held[:PER_PAGE])
        peer.trim()
        w.join()
        assert isinstance(w.result, np.ndarray) and len(w.result) == PER_PAGE, w.result
        row = _row(pool_name, "waiter")
        assert row.waiting == 0 and row.want_bytes == 0  # the wait is no longer published
        assert waiter.stats().shortages == 0  # one answer, a grant: its retries are not shortages
        assert rounds > 0


def test_a_stopped_peer_costs_a_shortage_not_a_hang(pool_name: str, tmp_path: Any) -> None:
    Pool(pool_name, capacity=4 * PAGE)
    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", f"""
import pathlib, time
from kvpool import Geometry, KVSpace
s = KVSpace(Geometry(1, 1, {PAGE // PER_PAGE}, 64, page_bytes={PAGE}), pool={pool_name!r}, name="holder",
            reserve_thread=False, reserve=(0, 0))
held = s.alloc({4 * PER_PAGE})
pathlib.Path({str(ready)!r}).write_text("x")
while True:
    time.sleep(60)
"""], cwd=tmp_path)
    try:
        wait_until(lambda: ready.exists() or child.poll() is not None, "the holder holds the pool")
        assert child.poll() is None
        os.kill(child.pid, signal.SIGSTOP)
        with _space(pool_name, "a") as a, _space(pool_name, "b") as b:
            # Two waiters starved by the stopped holder: each one's retries are
            # no progress for the other, so both give up.
            wa, wb = _Acquirer(a, PER_PAGE, stall=0.3), _Acquirer(b, PER_PAGE, stall=0.3)
            wa.start()
            wb.start()
            wa.join()
            wb.join()
            for w, s, name in ((wa, a, "a"), (wb, b, "b")):
                assert isinstance(w.result, PoolExhausted) and not isinstance(w.result, RequestTooLarge)
                assert "stalled" in str(w.result), w.result
                assert s.stats().used_blocks == 0 and s.stats().shortages == 1
                assert _row(pool_name, name).waiting == 0
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait()


def test_acquire_gives_up_after_its_timeout_even_while_others_work(pool_name: str) -> None:
    Pool(pool_name, capacity=4 * PAGE)
    with _space(pool_name, "peer") as peer, _space(pool_name, "waiter") as waiter:
        peer.alloc(4 * PER_PAGE)
        with pytest.raises(PoolExhausted, match="gave up after"):
            waiter.acquire(1, timeout=0)
        assert waiter.stats().used_blocks == 0 and _row(pool_name, "waiter").waiting == 0


def test_a_caller_that_reports_its_own_waiting_keeps_it(pool_name: str) -> None:
    # The vLLM plugin reports its queued requests per step; a wait inside
    # get_new_blocks must not clear that report when it ends.
    Pool(pool_name, capacity=4 * PAGE)
    with _space(pool_name, "peer") as peer, _space(pool_name, "waiter") as waiter:
        held = peer.alloc(4 * PER_PAGE)
        waiter.report_waiting(3)
        w = _Acquirer(waiter, 1, stall=3600)
        w.start()
        wait_until(lambda: waiter.stats().shortages > 0 or w.result is not None, "the waiter waits")
        peer.free(held[:PER_PAGE])
        peer.trim()
        w.join()
        assert isinstance(w.result, np.ndarray)
        assert _row(pool_name, "waiter").waiting == 3


def test_closing_the_space_ends_a_wait(pool_name: str) -> None:
    Pool(pool_name, capacity=4 * PAGE)
    with _space(pool_name, "peer") as peer:
        peer.alloc(4 * PER_PAGE)
        waiter = _space(pool_name, "waiter")
        w = _Acquirer(waiter, 1, stall=3600)
        w.start()
        wait_until(lambda: _row(pool_name, "waiter").waiting == 1, "the waiter waits")
        waiter.close()
        w.join()
        assert isinstance(w.result, PoolClosed), w.result


def test_ctrl_c_ends_a_wait_with_nothing_held(pool_name: str) -> None:
    Pool(pool_name, capacity=4 * PAGE)
    with _space(pool_name, "peer") as peer, _space(pool_name, "waiter") as waiter:
        peer.alloc(4 * PER_PAGE)

        def interrupt() -> None:
            wait_until(lambda: _row(pool_name, "waiter").waiting == 1, "the waiter waits")
            os.kill(os.getpid(), signal.SIGINT)

        t = threading.Thread(target=interrupt, daemon=True)
        t.start()
        with pytest.raises(KeyboardInterrupt):
            waiter.acquire(1, stall=3600)  # on the main thread: signals are checked between sleeps
        t.join()
        assert waiter.stats().used_blocks == 0
        row = _row(pool_name, "waiter")
        assert row.waiting == 0 and row.want_bytes == 0
