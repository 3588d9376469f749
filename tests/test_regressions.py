"""Regression tests, each named after the bug it pins (found in review of the native core)."""

from __future__ import annotations

import errno
import time

import pytest

from kvpool import Geometry, KVSpace, PoolExhausted

from .conftest import KiB

G = Geometry(2, 2, 4 * KiB, 256, page_bytes=16 * KiB)  # 4 blocks a page


def test_idle_pages_above_a_lowered_limit_are_not_handed_out() -> None:
    # Bug: after set_limit below the committed pages, available() and alloc
    # still counted the idle reserve, so alloc(12) grew a 1-page tenant to 4
    # active pages and available() depended on the reserve thread's timing.
    with KVSpace(G, reserve=(4, 8)) as space:
        assert space.settle(60)
        space.alloc(3)  # one active page with one free block
        assert space.settle(60)
        space.set_limit(1 * G.page_commit_bytes)
        assert space.available() == 1  # only the hole on the active page
        with pytest.raises(PoolExhausted):
            space.alloc(2)
        assert len(space.alloc(1)) == 1
        assert space.settle(60)
        st = space.stats()
        assert st.pages_active == 1 and st.pages_reserve == 0
        assert space.allocated_bytes() == G.page_commit_bytes


def test_one_failed_refill_does_not_stop_the_reserve_thread_for_good() -> None:
    # Bug: a commit failure in the reserve thread set a back-off flag that
    # nothing ever cleared; the reserve stayed below its minimum.
    with KVSpace(G, reserve=(1, 1)) as space:
        assert space.settle(60)
        space._inject_fault("commit", 1, errno.ENOSPC)
        space.trim()  # the thread refills, and that commit fails
        while space.stats().pages_reserve != 1:  # an event: a refill that never comes ends in the test's timeout
            space.settle(60)
            time.sleep(0.005)
        st = space.stats()
        assert st.commit_failures == 1
        assert st.pages_reserve == 1


def test_alloc_far_beyond_capacity_is_a_shortage_not_a_memory_error() -> None:
    # Bug: the binding allocated the id buffer before asking the core, so
    # alloc(10**11) raised MemoryError instead of PoolExhausted.
    with KVSpace(G, reserve_thread=False, reserve=(0, 0)) as space:
        with pytest.raises(PoolExhausted) as err:
            space.alloc(10**11)
        assert err.value.requested == 10**11
        assert err.value.available == G.capacity


def test_a_geometry_beyond_64_bit_offsets_is_refused() -> None:
    from kvpool import GeometryError

    with pytest.raises(GeometryError, match="virtual address space"):
        Geometry(1, 1, 1 << 40, 1 << 30, page_bytes=1 << 41)


class _CountingSpace:
    """Wraps a native space and records the name of every method called on it."""

    def __init__(self, inner: object) -> None:
        self._inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def counted(*args: object, **kwargs: object) -> object:
            self.calls.append(name)
            return attr(*args, **kwargs)

        return counted


@pytest.mark.anyio
async def test_a_free_that_grants_a_waiter_makes_two_native_calls() -> None:
    # Hot path: with waiters queued, free made four native calls (free,
    # available, alloc, available) though free and alloc both know what is
    # available after them. Now: free, then the waiter's alloc.
    import anyio

    from kvpool import KVCacheManager

    async with KVCacheManager(G, pool=None, reserve=(0, 0), reserve_thread=False) as m:
        held = await m.alloc(G.capacity)
        got: list[int] = []

        async def want() -> None:
            got.extend((await m.alloc(8)).tolist())

        async with anyio.create_task_group() as tg:
            tg.start_soon(want)
            for _ in range(20):
                await anyio.lowlevel.checkpoint()
            assert m.waiting == 1
            counting = _CountingSpace(m._native)
            native, m._native = m._native, counting  # type: ignore[assignment]
            try:
                m.free(held[:8])
            finally:
                m._native = native
            assert counting.calls == ["free", "alloc"]
        assert len(got) == 8


@pytest.mark.anyio
async def test_manager_stats_take_one_space_snapshot() -> None:
    # ManagerStats read the space twice (stats, then available; a third time
    # for the limit verdict), so its fields could come from different moments.
    from kvpool import KVCacheManager

    async with KVCacheManager(G, pool=None, reserve=(0, 0), reserve_thread=False) as m:
        await m.alloc(5)
        counting = _CountingSpace(m.space._space)
        native, m.space._space = m.space._space, counting  # type: ignore[assignment]
        try:
            st = m.stats()
        finally:
            m.space._space = native
        assert counting.calls == ["stats"]
        assert (st.used_blocks, st.available) == (5, G.capacity - 5)


def test_wait_for_capacity_works_when_the_eventfd_is_above_1024() -> None:
    # Bug (issue 10, item 10): wait_for_capacity used select.select, which raises
    # "filedescriptor out of range" for fds >= 1024; engines hold many fds and
    # both engine adapters call it on every shortage wait.
    import os
    import resource

    want = 1100
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want + 64:
        if hard != resource.RLIM_INFINITY and hard < want + 64:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} leaves no fd above 1024")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want + 64, hard))
    fds: list[int] = []
    try:
        while not fds or fds[-1] < want:
            fds.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        with KVSpace(G, reserve_thread=False, reserve=(0, 0)) as space:
            assert space.wakeup_fd > 1024
            assert space.wait_for_capacity(0) is False  # nothing signalled: returns at once
            os.write(space.wakeup_fd, (1).to_bytes(8, "little"))  # as the native side signals
            assert space.wait_for_capacity(60) is True
            assert space.drain_wakeups() == 0  # consumed
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
