"""Hypothesis stateful test of the allocator: >= 10 000 random operations.

After every step: no id held twice; every held id is in range, usable and on
an active (committed) page; the committed page count matches the memfd's real
allocation (st_blocks); available() is exactly what a following alloc
delivers. Failed operations (injected commit faults, shortages, bad frees)
must leave the state exactly as it was.
"""

from __future__ import annotations

import errno
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvpool import BackendError, Geometry, InvalidBlocks, KVSpace, PoolExhausted

from .conftest import FAKE_GRANULARITY, KiB, snapshot

# 6 KiB blocks on 16 KiB pages: 2 or 3 blocks a page, with straddlers.
GEOMETRY = Geometry(1, 2, 6 * KiB, 40, page_bytes=16 * KiB)
STEPS = {"count": 0}


class AllocatorMachine(RuleBasedStateMachine):
    thread = False
    device = "cpu"

    def __init__(self) -> None:
        super().__init__()
        # With the thread, an idle interval no run outlives: idle pages above
        # max then go back only on pressure (a limit, trim), never on the
        # thread's clock between two invariant checks.
        self.space = KVSpace(GEOMETRY, reserve=(1, 2), reserve_thread=self.thread, null_block=False,
                             device=self.device, idle_release_s=3600.0)
        self.held: set[int] = set()
        self.fault_armed = False

    def teardown(self) -> None:
        self.space.close()

    def _quiet(self) -> None:
        if self.thread:
            assert self.space.settle(60)

    @rule(n=st.integers(0, 30))
    def alloc(self, n: int) -> None:
        STEPS["count"] += 1
        before = None if self.thread else snapshot(self.space)
        try:
            ids = self.space.alloc(n).tolist()
        except (PoolExhausted, BackendError):
            self.fault_armed = False if not self.thread else self.fault_armed
            if before is not None:
                assert snapshot(self.space) == before
            return
        assert len(ids) == n == len(set(ids))
        assert not self.held.intersection(ids)
        self.held.update(ids)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_subset(self, data: st.DataObject) -> None:
        STEPS["count"] += 1
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held)), unique=True, min_size=1))
        self.space.free(ids)
        self.held.difference_update(ids)

    @rule(bad=st.sampled_from(["double", "range", "dup"]), data=st.data())
    def bad_free(self, bad: str, data: st.DataObject) -> None:
        STEPS["count"] += 1
        free_ids = [b for b in range(GEOMETRY.blocks) if GEOMETRY.usable(b) and b not in self.held]
        batch = sorted(self.held)[:3]
        if bad == "double" and free_ids:
            batch.append(data.draw(st.sampled_from(free_ids)))
        elif bad == "dup" and batch:
            batch.append(batch[0])
        else:
            batch.append(GEOMETRY.blocks + 3)
        self._quiet()
        before = snapshot(self.space)
        with pytest.raises(InvalidBlocks):
            self.space.free(batch)
        self._quiet()
        assert snapshot(self.space) == before

    @rule()
    def trim(self) -> None:
        STEPS["count"] += 1
        self.space.trim()

    @rule(nth=st.integers(1, 3), err=st.sampled_from([errno.EIO, errno.ENOSPC]))
    def arm_commit_fault(self, nth: int, err: int) -> None:
        STEPS["count"] += 1
        self.space._inject_fault("commit", nth, err)
        self.fault_armed = True

    @rule(pages=st.none() | st.integers(0, 20))
    def set_limit(self, pages: int | None) -> None:
        STEPS["count"] += 1
        self.space.set_limit(None if pages is None else pages * GEOMETRY.page_commit_bytes)

    @invariant()
    def books_match_memory(self) -> None:
        self._quiet()
        st_ = self.space.stats()
        assert st_.used_blocks == len(self.held)
        assert self.space.allocated_bytes() == st_.committed_bytes
        assert st_.committed_bytes == (st_.pages_active + st_.pages_reserve) * GEOMETRY.page_commit_bytes
        occ = {p.page: p for p in self.space.page_occupancy()}
        assert sum(p.used for p in occ.values()) == len(self.held)
        for b in self.held:
            page = GEOMETRY.page_of(b)
            assert 0 <= b < GEOMETRY.blocks and page is not None
            assert occ[page].state == "active"

    @invariant()
    def available_is_exactly_deliverable(self) -> None:
        if self.fault_armed:
            self.space._inject_fault("commit", 0, 0)  # disarm: the probe must not consume it
            self.fault_armed = False
        self._quiet()
        a = self.space.available()
        got = self.space.alloc(a) if a else None
        with pytest.raises(PoolExhausted):
            self.space.alloc(1)
        if got is not None:
            assert len(got) == a
            self.space.free(got)


class ThreadedAllocatorMachine(AllocatorMachine):
    thread = True


class CudaAllocatorMachine(AllocatorMachine):
    """The same machine on the CUDA backend over the fake driver, with driver faults."""

    device = "cuda:0"

    @rule(call=st.sampled_from([b"cuMemCreate", b"cuMemMap", b"cuMemSetAccess"]), nth=st.integers(1, 3),
          code=st.sampled_from([1, 2]))
    def arm_driver_fault(self, call: bytes, nth: int, code: int) -> None:
        STEPS["count"] += 1
        FAKE[0].fake_cuda_fail(call, nth, code)
        self.fault_armed = True

    @invariant()
    def the_driver_holds_exactly_the_committed_pages(self) -> None:
        st_ = self.space.stats()
        assert FAKE[0].fake_cuda_allocated() - FAKE_GRANULARITY == st_.committed_bytes

    @invariant()
    def available_is_exactly_deliverable(self) -> None:
        FAKE[0].fake_cuda_fail(b"none", 0, 0)  # the probe must not meet a driver fault
        super().available_is_exactly_deliverable()


FAKE: list[Any] = [None]


@pytest.mark.parametrize("machine", [AllocatorMachine, ThreadedAllocatorMachine, CudaAllocatorMachine],
                         ids=["inline", "thread", "cuda-fake"])
@pytest.mark.timeout(900)
def test_ten_thousand_random_operations_keep_every_invariant(
    machine: type[AllocatorMachine], fake_cuda_driver: str | None
) -> None:
    if machine is CudaAllocatorMachine:
        if fake_cuda_driver is None:
            pytest.skip("no C compiler to build the fake driver")
        import ctypes

        FAKE[0] = ctypes.CDLL(fake_cuda_driver)
        FAKE[0].fake_cuda_allocated.restype = ctypes.c_size_t
    STEPS["count"] = 0
    cfg = settings(
        max_examples=60,
        stateful_step_count=100,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    while STEPS["count"] < 10_000:
        run_state_machine_as_test(machine, settings=cfg)
    assert STEPS["count"] >= 10_000
