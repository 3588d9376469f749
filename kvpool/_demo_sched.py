"""The scheduler half of ``kvpool demo``'s engines: admission queue and preemption.

Both engines (the real one in :mod:`kvpool.demo`, the modeled one in
:mod:`kvpool._demo_virtual`) share this: what differs between them is only
how a step computes, so the decisions about memory are made here, once.

Admission. Requests join this engine's queue on arrival. One admitter takes
the head and waits in ``await alloc(blocks)`` (prompt plus the whole
generation budget), so the manager's wait queue, and the pool's fair-share
order, see exactly one waiting request per engine, as a server's scheduler
does. Time waiting for memory is counted from when a request joined the
queue to its grant, every time it joins (arrival, and each preemption).

Preemption (ARCHITECTURE.md, fair share, rule 5). While this tenant *lends* (it
holds more than its guarantee while a tenant below its own waits) the pool
refuses its allocs and gives its emptied pages back at once, but memory held
by running requests stays held until they finish: a lender whose requests
generate for a long time would starve its neighbours anyway. So, as vLLM does
when its cache is full, once per engine step the engine asks the manager
whether it lends and, while it does, preempts its most recently started
request: frees its blocks and puts it back at the head of its queue
(``recompute``: when it is admitted again, its prompt and the tokens it has
generated so far are prefilled anew; decoding is greedy, so the tokens that
follow are the same). A preempted request keeps the tokens it already emitted
and its first-token time.

When to stop preempting. ``lending`` turns false only once the waiting
tenant's grant has been taken (its published want drops to 0), not when
enough memory is free for it. Engines of one process hand freed capacity to
their peers at once (``KVCacheManager.poll``), so the verdict is current
after each preemption and an engine preempts exactly as many requests as the
waiter needs. Across processes the waiter takes its grant only when its own
event loop wakes, later: there an engine preempts one request per step and
looks again at the next, instead of emptying itself down to its guarantee
on a stale verdict.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any

from ._demo_clock import RealClock
from ._demo_traces import Request
from .manager import KVCacheManager


class Scheduler:
    """One engine's admission queue and its reaction to lending.

    Subclasses keep the running requests and say how to take the newest one
    out (:meth:`_take_newest`) and how a granted request joins
    (:meth:`_started`); :meth:`serve` steps the engine and calls
    :meth:`act_on_lending` at the start of every step.
    """

    def __init__(self, index: int, manager: KVCacheManager, clock: RealClock) -> None:
        self.index = index
        self.m = manager
        self.clock = clock  # its times: floats (real) or integer nanoseconds (virtual)
        # None: the peers live in other processes (see the module docstring).
        self.peers: Sequence[Scheduler] | None = None
        self.pending: deque[Request] = deque()  # waiting for memory, in admission order
        self.finished: list[Request] = []
        self._wait = 0.0  # in the clock's unit: exact sums on the virtual clock
        self._rewait = 0.0  # the part spent waiting again after a preemption
        self.tokens = 0
        self.preemptions = 0
        self.recomputed_tokens = 0  # prompt and generated tokens prefilled again after a preemption
        self.peak_committed = 0
        self.wake = asyncio.Event()  # something to run
        self._queued = asyncio.Event()  # something to admit
        self._alloc: asyncio.Task[Any] | None = None
        self._head_moved = False  # a preempted request went ahead of the one being allocated

    @property
    def waiting(self) -> int:
        return len(self.pending)

    @property
    def wait_s(self) -> float:
        """Seconds requests waited for memory: from joining the queue to the grant, every time."""
        return self.clock.seconds(self._wait)

    @property
    def preempted_wait_s(self) -> float:
        """The part of :attr:`wait_s` that preempted requests spent waiting again."""
        return self.clock.seconds(self._rewait)

    def report(self) -> dict[str, Any]:
        """This engine's raw figures, as :func:`kvpool.demo.summarize` takes them."""
        return {"engine": self.index, "ttft": [self.clock.seconds(r.first_token - r.arrived) for r in self.finished],
                "requests": len(self.finished), "tokens": self.tokens, "wait_s": self.wait_s,
                "preempted_wait_s": self.preempted_wait_s, "preemptions": self.preemptions,
                "recomputed_tokens": self.recomputed_tokens, "peak_committed_bytes": self.peak_committed,
                "outputs": {r.rid: r.output for r in self.finished}}

    # ---------------------------------------------------------- admission
    async def run(self, trace: list[Request], t0: float) -> None:
        """Serve this engine's requests: arrivals, admission and steps until all finish."""
        tasks = [asyncio.create_task(self._arrive(trace, t0)), asyncio.create_task(self._admit())]
        serve = asyncio.create_task(self.serve(len(trace)))
        try:
            # The admitter runs for good (a preemption re-queues): the run
            # ends with serve, or with the first error of any of the three.
            live = {serve, *tasks}
            while not serve.done():
                done, live = await asyncio.wait(live, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()
        finally:
            for t in (serve, *tasks):
                t.cancel()
            await asyncio.gather(serve, *tasks, return_exceptions=True)

    async def _arrive(self, trace: list[Request], t0: float) -> None:
        for r in trace:
            at = self.clock.at(t0, r.arrival)
            await self.clock.sleep_until(at)
            r.arrived = r.queued = at
            self.pending.append(r)
            self._queued.set()

    async def _admit(self) -> None:
        current = asyncio.current_task()
        assert current is not None
        while True:
            while not self.pending:
                self._queued.clear()
                await self._queued.wait()
            r = self.pending[0]
            self._alloc = asyncio.ensure_future(self.m.alloc(r.blocks))  # backpressure: waits here
            try:
                ids = await self._alloc
            except asyncio.CancelledError:
                if self._head_moved and not current.cancelling():
                    self._head_moved = False  # a preempted request is the head now: ask for it
                    continue
                raise
            finally:
                self._alloc = None
            self._head_moved = False
            # A preemption may have queued requests ahead of r after its grant.
            self.pending.remove(r)
            now = self.clock.now()
            r.admitted = now
            self._wait += now - r.queued
            if r.preemptions:
                self._rewait += now - r.queued
            # Committed bytes only grow at a grant: sampling here sees every peak.
            self.peak_committed = max(self.peak_committed, self.m.stats().committed_bytes)
            self._started(r, ids)
            self.wake.set()
            self._after_grant()

    def _after_grant(self) -> None:
        """Hook: the virtual engines re-poll their peers (a grant can end a lending)."""

    def _started(self, r: Request, ids: Any) -> None:
        raise NotImplementedError

    # --------------------------------------------------------- preemption
    def act_on_lending(self) -> None:
        """Once per step: while this tenant lends, preempt the newest running request."""
        while self.m.lending:
            taken = self._take_newest()
            if taken is None:
                return
            r, ids = taken
            self.m.free(ids)
            self.preemptions += 1
            r.preemptions += 1
            r.queued = self.clock.now()
            self.pending.appendleft(r)  # ahead of every request not yet admitted, as vLLM does
            if self._alloc is not None:  # the admitter waits for a later request: ask for r first
                self._head_moved = True
                self._alloc.cancel()
            self._queued.set()
            if self.peers is None:
                return  # across processes: one a step (see the module docstring)
            self.poll_peers()

    def poll_peers(self) -> None:
        # Synchronously, in a fixed order: what the native watcher's eventfd
        # would tell them later (at a time the virtual clock cannot see).
        for peer in self.peers or ():
            peer.m.poll()

    def _take_newest(self) -> tuple[Request, Any] | None:
        """Remove the most recently started request from the running ones: (request, its block ids)."""
        raise NotImplementedError

    async def serve(self, total: int) -> None:
        raise NotImplementedError
