"""A virtual clock for ``kvpool demo --clock virtual``: asyncio whose time jumps.

The loop's ``time()`` is a number this module advances, never the machine's
clock. Whenever no callback is ready, instead of sleeping until the next
timer the selector moves the clock to that timer at once (autojump). A run
therefore takes as much virtual time as its sleeps add up to, whatever the
machine's load, and as little wall time as its Python takes.

Why asyncio and not trio's ``MockClock(autojump_threshold=0)``: the demo must
give identical figures for the same seed, and its engines often act at the
same virtual instant (one free grants several engines' waiters, which all
resume at that instant and may allocate again). trio randomizes the order of
every batch of runnable tasks on purpose (a module-level ``random.Random``
reverses half the batches) and breaks deadline ties by ``id()``, so two
runs could hand the pool's last pages to different engines. asyncio runs
ready callbacks first in, first out and keeps its timers in a heap fed in
program order: the same program gives the same interleaving every time.

File descriptors still work, but the managers' wake-ups do not drive a run:
the native watcher threads signal the spaces' eventfds when the pool's
generation moves, at real, not virtual, times (on a busy machine later, in
virtual time, than on a quiet one: a grant that waited for one made the same
seed give other figures under load). The demo mutes those fds
(:meth:`VirtualClockLoop.mute`) and registers an idle hook instead
(:meth:`VirtualClockLoop.on_idle`): whenever nothing is ready and the clock
would jump, the hooks run first (the demo re-checks every waiting engine's
capacity, what the wake-up would have made it do), and while a hook reports
that it made something ready the clock stays. Every grant thus happens at a
point of the program, never at a point of the machine's time.
Nothing in a virtual run may wait for a thread (``to_thread``): the clock
would jump past it. A run in which every task waits and no timer is due is a
deadlock, reported as :class:`VirtualDeadlock` rather than hung.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualDeadlock(RuntimeError):
    """Every task waits and no timer will ever wake one."""


class _JumpingSelector(selectors.DefaultSelector):
    """Never sleeps: reports the fds ready now, else jumps the clock to the next timer."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        muted = self._loop._muted
        ready = [(key, ev) for key, ev in super().select(0) if key.fd not in muted]
        if ready or timeout == 0:
            return ready
        if self._loop._run_idle_hooks():
            return ready  # a hook made callbacks ready at this instant: run them before time moves
        if timeout is None:
            raise VirtualDeadlock(
                f"virtual clock at {self._loop.time():.3f} s: every task waits and no timer is due "
                "(an alloc that no free will ever satisfy?)")
        self._loop.advance(timeout)
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on a virtual clock that starts at 0 and jumps to each timer.

    The clock counts whole nanoseconds (an int), so that two runs which reach
    the same instant by different sums of sleeps read the same time: with a
    float clock, elastic and static TTFTs that are equal by construction
    differed by 1e-12 relative (issue 14, steady seed 7, "p99 1.0000000000039x").
    A timer due less than half a nanosecond ahead is run without moving the
    clock (asyncio runs timers within its 1 ns clock resolution).
    """

    def __init__(self) -> None:
        self._ns = 0
        self._muted: set[int] = set()
        self._idle_hooks: list[Callable[[], bool]] = []
        super().__init__(_JumpingSelector(self))

    def mute(self, fd: int) -> None:
        """Never report ``fd`` ready: its readers do not run (see the module docstring)."""
        self._muted.add(fd)

    def unmute(self, fd: int) -> None:
        self._muted.discard(fd)

    def on_idle(self, hook: Callable[[], bool]) -> Callable[[], None]:
        """Run ``hook`` whenever nothing is ready, before the clock jumps; it
        returns whether it made anything ready (then the clock stays). Returns
        the function that removes it."""
        self._idle_hooks.append(hook)
        return lambda: self._idle_hooks.remove(hook)

    def _run_idle_hooks(self) -> bool:
        acted = False
        for hook in list(self._idle_hooks):
            acted = hook() or acted  # every hook runs, in the order registered
        return acted

    def time(self) -> float:
        return self._ns / 1e9

    def now_ns(self) -> int:
        return self._ns

    def advance(self, seconds: float) -> None:
        # A timer set by NanoClock is due at ns / 1e9 exactly: the rounding
        # recovers its integer whatever instant the clock jumps from.
        self._ns += max(0, round(seconds * 1e9))


class RealClock:
    """The machine's clock for the demo's engines: float seconds (CLOCK_MONOTONIC, one for every process)."""

    def now(self) -> float:
        return time.perf_counter()

    def at(self, t0: float, offset_s: float) -> float:
        return t0 + offset_s

    def seconds(self, span: float) -> float:
        return span

    async def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            await asyncio.sleep(delay)


class NanoClock(RealClock):
    """A :class:`VirtualClockLoop`'s clock in integer nanoseconds: spans are exact differences."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualClockLoop), "NanoClock runs on run_virtual's loop"
        self._loop = loop

    def now(self) -> int:
        return self._loop.now_ns()

    def at(self, t0: float, offset_s: float) -> int:
        return int(t0) + round(offset_s * 1e9)

    def seconds(self, span: float) -> float:
        return span / 1e9

    async def sleep_until(self, t: float) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()
        handle = self._loop.call_at(int(t) / 1e9, fut.set_result, None)
        try:
            await fut
        finally:
            handle.cancel()

    async def sleep(self, seconds: float) -> None:
        """Sleep a modeled span, rounded to the nanosecond (the step model's figures are whole microseconds)."""
        await self.sleep_until(self.now() + round(seconds * 1e9))


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualClockLoop`."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(main)
