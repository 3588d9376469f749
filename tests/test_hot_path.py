"""The hot path's deterministic properties (issue 12): counted, never timed.

- One native call per ``alloc`` / ``free`` (``KVSpace``, ``alloc_nowait``,
  an ``await alloc`` granted at once), counted through a proxy of the native
  space.
- No page thrash: after warm-up a steady alloc(n)/free loop commits and
  releases no page, at any n (counted through ``stats()``).
- Idle pages above the reserve's max still go back: at once when another
  tenant of the pool waits, after the idle interval otherwise (waited for as
  events, with the test's timeout as the only deadline).
- Every id form the checked path took still works, with the same errors.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from kvpool import Geometry, InvalidBlocks, KVCacheManager, KVSpace, Pool, PoolExhausted

from ._helpers import until
from .conftest import KiB

G = Geometry(1, 1, 4 * KiB, 1024, page_bytes=64 * KiB)  # 16 blocks a page, 64 pages
NEVER = 3600.0  # an idle interval no test outlives: only pressure may release


class CountingNative:
    """Stands in for a native Space and counts every method called through it."""

    def __init__(self, native: Any) -> None:
        self._native = native
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._native, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def python_frames(fn: Any, *args: Any) -> tuple[Any, list[str]]:
    """``fn(*args)`` and the Python functions it entered (a call that stays native enters none)."""
    entered: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(None)
    return result, entered


def ops(space: KVSpace) -> tuple[int, int]:
    st = space.stats()
    return st.allocs, st.frees


def page_ops(space: KVSpace) -> tuple[int, int]:
    st = space.stats()
    return st.commits, st.releases


# ------------------------------------------------------- one native call each

def test_kvspace_alloc_and_free_are_one_native_call_each() -> None:
    sp = KVSpace(G, reserve=(0, 64), idle_release_s=NEVER)
    try:
        sp.free(sp.alloc(40))  # warm: pages committed
        for n in (1, 16, 40):
            before = ops(sp)
            ids, frames = python_frames(sp.alloc, n)
            assert frames == [] and len(ids) == n
            _, frames = python_frames(sp.free, ids)
            assert frames == []
            _, frames = python_frames(sp.free, sp.alloc(n).tolist())  # the vLLM plugin's form: a list
            assert frames == []
            assert ops(sp) == (before[0] + 2, before[1] + 2)
        # Anything else takes the slow path (one Python frame: it converts, then calls the face again).
        ids = sp.alloc(4)
        _, frames = python_frames(sp.free, tuple(ids.tolist()))
        assert frames[0] == "_free_slow"
        _, frames = python_frames(sp.alloc, np.int64(3))
        assert frames[0] == "_alloc_slow"
    finally:
        sp.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_manager_alloc_nowait_await_alloc_and_free_are_one_native_call_each(anyio_backend: str) -> None:
    m = KVCacheManager(G, pool=None, reserve=(0, 64))
    async with m:
        m.free(m.alloc_nowait(40))
        before = ops(m.space)
        ids, frames = python_frames(m.alloc_nowait, 16)
        assert frames == [] and len(ids) == 16
        _, frames = python_frames(m.free, ids)
        assert frames == []
        assert ops(m.space) == (before[0] + 1, before[1] + 1)
        # await alloc granted at once: one native call and no Python frame
        # (on 3f47a8d the coroutine's own frame, "alloc", was entered).
        coro = m.alloc(16)

        def step() -> Any:
            try:
                coro.send(None)
            except StopIteration as done:
                return done.value
            raise AssertionError("an alloc granted at once suspended")

        ids, frames = python_frames(step)
        assert frames == ["step"] and len(ids) == 16
        m.free(ids)
        assert ops(m.space) == (before[0] + 2, before[1] + 2)
        assert m.stats().granted_at_once == 3


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_manager_hot_path_hands_every_unusual_state_to_the_checked_path(
        anyio_backend: str) -> None:
    """A free while someone waits must dispatch; DEBUG must trace; a closed manager must refuse:
    the native hot path sees each state and takes the class's method then."""
    import anyio

    from kvpool import PoolClosed, tracing

    m = KVCacheManager(G, pool=None, reserve=(0, 64))
    held = m.alloc_nowait(G.capacity)
    granted: list[Any] = []
    async with anyio.create_task_group() as tg:
        async def waiter() -> None:
            granted.append(await m.alloc(8))

        tg.start_soon(waiter)
        await until(lambda: m.waiting > 0, "the waiter queues", interval=0)
        _, frames = python_frames(m.free, held[:8])
        assert frames[0] == "_free_slow"  # it hands the 8 blocks to the waiter
    assert len(granted) == 1 and len(granted[0]) == 8
    m.free(granted[0])

    with tracing.capture() as events:
        _, frames = python_frames(m.alloc_nowait, 1)
    assert frames[0] == "_alloc_nowait_slow"
    assert any(e.get("event") == "alloc.granted" for e in events)

    ids = m.alloc_nowait(1)
    await m.aclose()
    with pytest.raises(PoolClosed):
        m.free(ids)
    with pytest.raises(PoolClosed):
        m.alloc_nowait(1)


def test_await_alloc_is_a_coroutine_that_holds_nothing_before_its_first_send() -> None:
    """The instance's alloc returns a native coroutine: nothing is taken when it is made, so one
    never awaited, closed or thrown into first leaks nothing; it cannot be reused once done; it
    answers odd sends and throws as CPython's coroutines do."""
    import asyncio
    import collections.abc
    import gc

    async def main() -> None:
        async with KVCacheManager(G, pool=None, reserve=(0, 64)) as m:
            allocs = ops(m.space)[0]
            coro = m.alloc(8)
            assert isinstance(coro, collections.abc.Coroutine) and asyncio.iscoroutine(coro)
            with pytest.warns(RuntimeWarning, match="'KVCacheManager.alloc' was never awaited"):
                del coro
                gc.collect()
            m.alloc(8).close()
            c = m.alloc(8)
            with pytest.raises(asyncio.CancelledError):
                c.throw(asyncio.CancelledError())
            with pytest.raises(RuntimeError, match="reuse"):
                c.send(None)
            c = m.alloc(8)
            with pytest.raises(TypeError):
                c.send(1)  # it stays unstarted, as a coroutine does
            with pytest.raises(TypeError, match="traceback"):
                c.throw(ValueError, ValueError("v"), "not a traceback")
            with pytest.raises(RuntimeError, match="raised StopIteration") as raised:
                c.throw(StopIteration(42))  # PEP 479, as a coroutine that never started
            assert isinstance(raised.value.__cause__, StopIteration)
            with pytest.raises(RuntimeError, match="reuse"):
                c.throw(ValueError("late"))
            assert ops(m.space)[0] == allocs and m.space.available() == G.capacity
            with pytest.raises(TypeError):
                type(c)()  # only a manager makes one
            gc.collect()
            # asyncio.create_task takes it; a task cancelled before its first step holds nothing.
            t = asyncio.create_task(m.alloc(8))
            ids = await t
            assert len(ids) == 8
            t = asyncio.create_task(m.alloc(8))
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            assert m.space.available() == G.capacity - 8
            m.free(ids)
            # Past a shortage it is the checked coroutine's: it queues, and a cancellation leaks nothing.
            held = m.alloc_nowait(G.capacity)
            t = asyncio.create_task(m.alloc(4))
            await until(lambda: m.waiting > 0, "the alloc queues", interval=0)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            assert m.waiting == 0 and m.stats().cancellations == 1
            m.free(held)
            assert m.space.available() == G.capacity

    asyncio.run(main())


@pytest.mark.parametrize("op", ["send", "throw", "close"])
def test_await_alloc_refuses_re_entry_while_its_checked_coroutine_runs(op: str) -> None:
    """A send, throw or close from inside the running call (here from an int subclass that the
    checked path converts) is refused as a coroutine refuses it; the call goes on. Before the
    running flag the first try ran unguarded, and the inner coroutine was dropped under its
    own send (a segfault)."""
    import asyncio

    calls: list[Any] = []
    refused: list[str] = []

    class N(int):  # not a plain int: the checked path converts it, calling back here
        def __index__(self) -> int:
            c = calls[0]
            try:
                if op == "send":
                    c.send(None)
                elif op == "throw":
                    c.throw(ValueError("nested"))
                else:
                    c.close()
            except ValueError as e:
                refused.append(str(e))
            return 2

        __int__ = __index__

    async def main() -> None:
        async with KVCacheManager(G, pool=None, reserve=(0, 64)) as m:
            c = m.alloc(N(2))
            calls.append(c)
            assert c.cr_running is False
            ids = await c
            assert len(ids) == 2
            m.free(ids)
            assert m.space.available() == G.capacity

    asyncio.run(main())
    assert refused and all(r == "coroutine already executing" for r in refused)


def test_trio_runs_await_alloc_as_a_task_and_waits_in_it() -> None:
    trio = pytest.importorskip("trio")

    async def main() -> None:
        async with KVCacheManager(G, pool=None, reserve=(0, 64)) as m:
            held = m.alloc_nowait(G.capacity)
            got: list[Any] = []

            async def waiter() -> None:
                got.append(await m.alloc(4))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                nursery.start_soon(m.alloc, 2)  # trio takes the native coroutine as a task of its own
                await until(lambda: m.waiting >= 2, "both allocs queue", interval=0)
                m.free(held[:6])
            assert len(got) == 1 and len(got[0]) == 4
            assert m.space.available() == 0  # the task's 2 blocks stay allocated: trio dropped its result
            m.free(held[6:])

    trio.run(main)


# ------------------------------------------------------------- no page thrash

@pytest.mark.parametrize("n", [1, 16, 17, 256, 1000])
def test_a_steady_alloc_free_loop_commits_and_releases_no_page_after_warm_up(n: int) -> None:
    # The default reserve (1, 2) with its thread: on 1b75068^ a free that
    # emptied pages beyond the reserve's max gave them back and the next
    # alloc committed them again (13 651 releases in 20 000 round trips at n = 256).
    sp = KVSpace(G, idle_release_s=NEVER)
    try:
        for _ in range(3):  # warm-up: the working set, plus the reserve's min refilled while it is held
            ids = sp.alloc(n)
            assert sp._space.settle(60.0)
            sp.free(ids)
            assert sp._space.settle(60.0)
        before = page_ops(sp)
        for _ in range(2000):
            sp.free(sp.alloc(n))
        assert sp._space.settle(60.0)
        assert page_ops(sp) == before
        assert sp.stats().allocs >= 2003
    finally:
        sp.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_steady_manager_loop_commits_and_releases_no_page_after_warm_up(anyio_backend: str) -> None:
    async with KVCacheManager(G, pool=None, idle_release_s=NEVER) as m:
        for _ in range(3):
            ids = await m.alloc(256)
            assert m.space._space.settle(60.0)
            m.free(ids)
            m.free(m.alloc_nowait(100))
            assert m.space._space.settle(60.0)
        before = page_ops(m.space)
        for _ in range(1000):
            m.free(await m.alloc(256))
            m.free(m.alloc_nowait(100))
        assert m.space._space.settle(60.0)
        assert page_ops(m.space) == before


# ------------------------------------------------------- release on pressure

def test_idle_pages_above_max_go_back_after_the_idle_interval() -> None:
    sp = KVSpace(G, reserve=(0, 2), idle_release_s=0.05)
    try:
        sp.free(sp.alloc(16 * 10))  # 10 pages emptied: 8 above the reserve's max
        # The thread releases them once a whole interval passed in which none
        # was used, and signals each release on the eventfd: waited for as
        # events (the test's timeout is the only deadline). A page leaves the
        # reserve when its release starts and counts once it is done: wait
        # for both (a stress run caught the last one still in flight).
        while (st := sp.stats()).pages_reserve > 2 or st.pages_releasing > 0:
            sp.wait_for_capacity(float("inf"))
        st = sp.stats()
        assert st.pages_reserve == 2 and st.releases == 8
    finally:
        sp.close()


def test_without_an_idle_interval_pages_go_back_as_they_empty() -> None:
    sp = KVSpace(G, reserve=(0, 2), idle_release_s=0)
    try:
        sp.free(sp.alloc(16 * 10))
        assert sp._space.settle(60.0)
        assert sp.stats().pages_reserve == 2
    finally:
        sp.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_idle_pages_above_max_go_back_at_once_when_another_tenant_waits(
    anyio_backend: str, pool_name: str
) -> None:
    pool = Pool(pool_name, capacity=32 * 64 * KiB)  # 32 pages
    a = KVCacheManager(G, pool=pool, name="a", reserve=(0, 2), idle_release_s=NEVER)
    b = KVCacheManager(G, pool=pool, name="b", reserve=(0, 2), idle_release_s=NEVER)
    async with a, b:
        a.free(a.alloc_nowait(16 * 30))  # a borrowed 30 of the 32 pages and keeps them idle ...
        assert a.space.stats().pages_reserve == 30
        # ... until b waits: b needs one page more than the 2 left, yet all
        # 28 above a's max go back, not just the one b's wait needed (the
        # waiter is served, and stops waiting, long before the last goes).
        got = await b.alloc(16 * 3)
        assert len(got) == 48
        assert a.space._space.settle(60.0)
        assert a.space.stats().pages_reserve <= 2
        b.free(got)


# ----------------------------------------------------------- every id form

@pytest.mark.parametrize(
    "form",
    [
        lambda ids: ids.tolist(),
        lambda ids: tuple(ids.tolist()),
        lambda ids: ids.astype(np.int32),
        lambda ids: ids.astype(">i8"),
        lambda ids: np.repeat(ids, 2)[::2],  # not contiguous
        lambda ids: torch.from_numpy(ids.copy()),
    ],
    ids=["list", "tuple", "int32", "big-endian", "strided", "tensor"],
)
def test_free_takes_every_id_form_through_the_checked_path(form: Any) -> None:
    sp = KVSpace(G)
    try:
        ids = sp.alloc(20)
        sp.free(form(ids))
        assert sp.stats().used_blocks == 0
        with pytest.raises(InvalidBlocks) as e:
            sp.free(form(ids))  # double free: nothing freed, ids named
        assert set(e.value.ids) == set(ids.tolist())
    finally:
        sp.close()


def test_hot_path_errors_are_the_checked_paths_errors() -> None:
    sp = KVSpace(G)
    try:
        with pytest.raises(ValueError, match="n must be >= 0"):
            sp.alloc(-1)
        with pytest.raises(ValueError, match="int64"):
            sp.alloc(2**63)
        with pytest.raises(ValueError, match="must be an int"):
            sp.alloc(True)
        with pytest.raises(PoolExhausted):
            sp.alloc(G.capacity + 1)
        with pytest.raises(InvalidBlocks, match="bool"):
            sp.free(np.array([True]))
        with pytest.raises(InvalidBlocks, match="1-D"):
            sp.free(np.zeros((2, 2), dtype=np.int64))
        assert sp.stats().used_blocks == 0 and sp.available() == G.capacity
    finally:
        sp.close()


def test_a_subclass_that_overrides_alloc_or_free_keeps_its_own() -> None:
    calls: list[str] = []

    class Logged(KVSpace):
        def free(self, blocks: Any) -> None:
            calls.append("free")
            super().free(blocks)

    class LoggedManager(KVCacheManager):
        def alloc_nowait(self, n: int, *, priority: int = 0) -> Any:
            calls.append("alloc_nowait")
            return super().alloc_nowait(n, priority=priority)

    sp = Logged(G)
    try:
        sp.free(sp.alloc(3))
        assert calls == ["free"] and sp.stats().used_blocks == 0
    finally:
        sp.close()
    m = LoggedManager(G, pool=None)
    m.free(m.alloc_nowait(3))
    assert calls == ["free", "alloc_nowait"] and m.stats().used_blocks == 0
    m.space.close()


# ------------------------------------------- one implementation (issue 34)

def test_the_hot_entry_points_are_the_classes_own_methods_with_no_copy_on_the_instance() -> None:
    """alloc / free / alloc_nowait / await alloc have one implementation: the native base's method,
    found on the class, none bound on the instance (a breakpoint or a mock on the class fires)."""
    from kvpool import _core

    sp = KVSpace(G)
    m = KVCacheManager(G, pool=None)
    try:
        assert KVSpace.alloc is _core.native.SpaceFace.alloc and KVSpace.free is _core.native.SpaceFace.free
        for name in ("alloc_nowait", "free", "alloc"):
            assert getattr(KVCacheManager, name) is getattr(_core.native.ManagerFace, name), name
        assert not {"alloc", "free", "alloc_nowait"} & (set(vars(sp)) | set(vars(m)))
    finally:
        sp.close()
        m.space.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_mock_on_the_class_method_sees_every_call(anyio_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before issue 34 an instance's methods were bound copies: a spy on the class never fired."""
    calls: list[tuple[str, Any]] = []

    def spy(name: str, real: Any) -> Any:
        def f(self: Any, *args: Any, **kw: Any) -> Any:
            calls.append((name, args[0] if args else None))
            return real(self, *args, **kw)
        return f

    for cls, name in ((KVSpace, "alloc"), (KVSpace, "free"), (KVCacheManager, "alloc_nowait"),
                      (KVCacheManager, "free"), (KVCacheManager, "alloc")):
        monkeypatch.setattr(cls, name, spy(f"{cls.__name__}.{name}", getattr(cls, name)))
    sp = KVSpace(G)
    m = KVCacheManager(G, pool=None)
    try:
        sp.free(sp.alloc(2))
        m.free(m.alloc_nowait(3))
        m.free(await m.alloc(4))
    finally:
        sp.close()
        await m.aclose()
    assert [c[0] for c in calls] == ["KVSpace.alloc", "KVSpace.free", "KVCacheManager.alloc_nowait",
                                     "KVCacheManager.free", "KVCacheManager.alloc", "KVCacheManager.free"]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_faces_state_has_one_store(anyio_backend: str) -> None:
    """closed, a deferred limit and the at-once count live in the native base only: what the
    manager reads is what the face acts on."""
    m = KVCacheManager(G, pool=None, reserve=(0, 64))
    m.free(m.alloc_nowait(2))
    m.free(await m.alloc(2))
    assert m._granted_at_once == 2 == m.stats().granted_at_once
    await m.aclose()
    m = KVCacheManager(G, pool=None, reserve=(0, 0), reserve_thread=False)  # pages go back as the free empties them
    ids = m.alloc_nowait(G.capacity // 2)
    assert await m.set_limit(G.page_bytes) is not None
    assert m._limit_deferred and m.limit_state.name == "DEFERRED"
    _, frames = python_frames(m.free, ids[:1])
    assert frames[0] == "_free_slow"  # the face saw the deferred limit
    m.free(ids[1:])
    assert not m._limit_deferred and m.limit_state.name == "APPLIED"
    await m.aclose()
    assert m._closed and m.closed


def test_a_face_refuses_a_table_entry_that_is_not_callable_when_it_is_built() -> None:
    from kvpool import _core

    sp = KVSpace(G)
    try:
        with pytest.raises(TypeError, match="SpaceFace: slow_free must be callable, got NoneType"):
            _core.native.SpaceFace(sp._space, slow_alloc=print, slow_free=None, alloc_refused=print,
                                   free_refused=print)
        with pytest.raises(TypeError, match="ManagerFace: try_refused must be callable, got int"):
            _core.native.ManagerFace(sp._space, slow_alloc=print, slow_free=print, slow_await=print,
                                     alloc_refused=print, try_refused=1, free_refused=print, waiters=[],
                                     trace_state=_core.native.TraceLevel(), debug_level=10, usable=4)
    finally:
        sp.close()
