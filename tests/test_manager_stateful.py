"""Hypothesis stateful test of KVCacheManager.

Interleaves alloc (waiting and nowait), free, cancel, timeout, set_limit,
trim and reservations; after every step checks ARCHITECTURE.md's invariants: no
block held twice, used blocks equal what the model holds, the books match
the memfd, no head waiter that fits is left waiting, an applied limit is
respected, and available() is deliverable.

The manager lives on an event loop in a BlockingPortal thread; the state
machine drives it from the test thread.
"""

from __future__ import annotations

import itertools
from typing import Any

import anyio
import anyio.from_thread
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvpool import Geometry, KVCacheManager, LimitState, PoolExhausted, RequestTooLarge, Reservation

from .conftest import KiB

G = Geometry(1, 2, 6 * KiB, 48, page_bytes=16 * KiB)  # 2-3 blocks a page, straddlers
STEPS = {"count": 0}


async def _settle_tasks() -> None:
    for _ in range(30):
        await anyio.lowlevel.checkpoint()


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cm = anyio.from_thread.start_blocking_portal("asyncio")
        self.portal = self.cm.__enter__()
        self.m: KVCacheManager = self.portal.call(self._make)
        self.held: dict[int, list[int]] = {}   # handle -> ids the test owns
        self.waiters: dict[int, dict[str, Any]] = {}
        self.reservations: list[Reservation] = []
        self.ids = itertools.count()
        self.revision = 0

    async def _make(self) -> KVCacheManager:
        return KVCacheManager(G, reserve=(1, 2), reserve_thread=True, name="stateful")

    def teardown(self) -> None:
        try:
            for w in self.waiters.values():
                self.portal.call(w["scope"].cancel)
            self.portal.call(_settle_tasks)
            self.portal.call(self.m.aclose)
        finally:
            self.cm.__exit__(None, None, None)

    def _step(self) -> None:
        STEPS["count"] += 1
        self.portal.call(_settle_tasks)

    # ----------------------------------------------------------------- rules
    @rule(n=st.integers(1, 12), prio=st.integers(0, 2), timeout=st.sampled_from([None, None, 0.0]))
    def alloc_wait(self, n: int, prio: int, timeout: float | None) -> None:
        key = next(self.ids)
        entry: dict[str, Any] = {"n": n, "scope": None, "state": "waiting"}
        self.waiters[key] = entry

        async def run() -> None:
            scope = entry["scope"] = anyio.CancelScope()
            with scope:
                try:
                    ids = await self.m.alloc(n, timeout=timeout, priority=prio)
                except TimeoutError:
                    entry["state"] = "timeout"
                    return
                except RequestTooLarge:
                    # Admission: refused at once, never queued, only when the
                    # limit makes n impossible (issue 14).
                    assert n > self.m.space.max_blocks()
                    entry["state"] = "refused"
                    return
                self.held[key] = ids.tolist()
                entry["state"] = "granted"
            if scope.cancelled_caught:
                entry["state"] = "cancelled"

        self.portal.start_task_soon(run)
        self._step()
        if entry["state"] != "waiting":
            del self.waiters[key]

    @rule(n=st.integers(1, 12))
    def alloc_nowait(self, n: int) -> None:
        try:
            ids = self.portal.call(self.m.alloc_nowait, n)
        except PoolExhausted:
            self._step()
            return
        self.held[next(self.ids)] = ids.tolist()
        self._step()

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.held)))
        ids = self.held.pop(key)
        k = data.draw(st.integers(1, len(ids)))
        self.portal.call(self.m.free, ids[:k])
        if ids[k:]:
            self.held[key] = ids[k:]
        self._step()

    @precondition(lambda self: any(w["state"] == "waiting" for w in self.waiters.values()))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(k for k, w in self.waiters.items() if w["state"] == "waiting")))
        self.portal.call(self.waiters[key]["scope"].cancel)
        self._step()

    @rule(pages=st.none() | st.integers(0, 20), jump=st.sampled_from([1, 1, 0, -1]))
    def set_limit(self, pages: int | None, jump: int) -> None:
        rev = self.revision + jump
        limit = None if pages is None else pages * G.page_commit_bytes
        state = self.portal.call(lambda: self.m.set_limit(limit, revision=rev))
        if jump < 0:
            assert state is LimitState.STALE
        elif jump > 0:
            self.revision = rev
            assert state in (LimitState.APPLIED, LimitState.DEFERRED)
        self._step()

    @rule()
    def trim(self) -> None:
        self.portal.call(self.m.trim)
        self._step()

    @rule(n=st.integers(1, 8), take=st.integers(0, 10))
    def reserve(self, n: int, take: int) -> None:
        try:
            r = self.portal.call(lambda: self.m.reserve(n, timeout=0.0))
        except TimeoutError:
            self._step()
            return
        except RequestTooLarge:
            # Admission: refused at once only if the limit makes n impossible.
            assert n > self.m.space.max_blocks()
            self._step()
            return
        try:
            taken = r.take(take).tolist()
            if taken:
                self.held[next(self.ids)] = taken
        except PoolExhausted:
            assert take > n and r.remaining == n  # a failed take changes nothing
        self.portal.call(r.close)
        self._step()

    # ------------------------------------------------------------ invariants
    @invariant()
    def invariants_hold(self) -> None:
        for k in [k for k, w in self.waiters.items() if w["state"] != "waiting"]:
            del self.waiters[k]
        self.portal.call(lambda: anyio.to_thread.run_sync(self.m.space.settle, 5.0))
        st_ = self.portal.call(self.m.stats)
        owned = [b for ids in self.held.values() for b in ids]
        assert len(owned) == len(set(owned)), "a block is held twice"
        assert st_.used_blocks == len(owned)
        assert self.m.space.allocated_bytes() == st_.space.committed_bytes
        head = self.m._queue.head()
        assert head is None or head.n > self.m.space.available(), "a waiter that fits is stuck"
        if st_.limit_bytes is not None and self.portal.call(lambda: self.m.limit_state) is LimitState.APPLIED:
            assert st_.committed_bytes <= st_.limit_bytes
        if st_.waiting == 0:
            a = self.portal.call(self.m.available)
            if a:
                got = self.portal.call(self.m.alloc_nowait, a)
                assert len(got) == a
                self.portal.call(self.m.free, got)


@pytest.mark.timeout(900)
def test_random_interleavings_keep_the_manager_invariants() -> None:
    STEPS["count"] = 0
    cfg = settings(max_examples=60, stateful_step_count=40, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    run_state_machine_as_test(ManagerMachine, settings=cfg)
    assert STEPS["count"] > 100
