"""The wait queue behind ``await KVCacheManager.alloc``.

Design
======

An ``alloc(n)`` that cannot be served at once parks a :class:`Waiter` here.
The queue decides *who* gets blocks and *when*; the manager decides *how*
(one native call per batch) and where wake-ups come from.

Ordering. Waiters are served by priority class (lower number first) and,
within a class, strictly in arrival order (FIFO). The *head* is the oldest
waiter of the best class.

Head-of-line. Grants never skip the head: if the head needs 100 blocks and
10 are free, a 1-block waiter behind it waits too. Otherwise a stream of
small requests could keep a large one waiting forever (starvation). The
price is that freed blocks can sit idle while the head accumulates enough;
that is the fairness trade tokio's batch semaphore makes too.

No barging. A new arrival may take blocks directly only if nobody it would
queue behind is waiting (no waiter of its class or a better one). Blocks
freed while waiters exist are handed off to them first (hand-off on
release), so a task that frees and immediately re-allocates queues behind
the earlier waiters.

Batch grants. On every wake-up the manager takes the longest prefix of the
queue (in service order) whose total fits in what is available, and serves
it with one native alloc whose ids are split among the waiters.

Cancellation. A waiter is WAITING, GRANTED or GONE. Cancelling a WAITING
waiter removes it (and may unblock those behind it: the manager
re-dispatches); cancelling a GRANTED waiter that has not resumed yet gives
its blocks back. Either way nothing leaks. Timeouts are cancellations.

Closing. ``drain()`` empties the queue and hands every waiter back; the
manager fails each with ``PoolClosed``.

Everything here runs on the event-loop thread; no locks.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterator
from enum import Enum
from typing import Any

import anyio

__all__ = ["WaitQueue", "Waiter", "WaiterState"]


class WaiterState(Enum):
    WAITING = "waiting"
    GRANTED = "granted"
    GONE = "gone"  # removed: cancelled, timed out, failed or closed


class Waiter:
    """One parked ``alloc(n)``."""

    __slots__ = ("n", "priority", "state", "result", "error", "wake", "enqueued_at", "below_guarantee")

    def __init__(self, n: int, priority: int) -> None:
        self.n = n
        self.priority = priority
        self.state = WaiterState.WAITING
        self.result: Any = None            # the granted ids (GRANTED)
        self.error: BaseException | None = None  # why it was failed (GONE by close/failure)
        # Set on grant, failure, or to hand the fd-watcher role over; the
        # waiter re-checks its state after every wake-up. Replaced after use.
        self.wake = anyio.Event()
        self.enqueued_at = time.perf_counter()
        self.below_guarantee = False  # it waited for memory its guarantee promised (traced as budget.reclaim)

    def rouse(self) -> None:
        self.wake.set()


class WaitQueue:
    def __init__(self) -> None:
        # priority -> FIFO of waiters; _order keeps the priorities sorted so
        # the head is found without scanning every class.
        self._classes: dict[int, deque[Waiter]] = {}
        self._order: list[int] = []
        # Read-only to others: the priorities with waiters, sorted; empty
        # exactly when nobody waits (the manager's hot path reads it).
        self.priorities = self._order

    def __len__(self) -> int:
        return sum(len(q) for q in self._classes.values())

    @property
    def waiting_blocks(self) -> int:
        """Blocks the queued waiters ask for together (read for stats only)."""
        return sum(w.n for w in self)

    def __iter__(self) -> Iterator[Waiter]:
        """Waiters in service order."""
        for p in self._order:
            yield from self._classes[p]

    def head(self) -> Waiter | None:
        return self._classes[self._order[0]][0] if self._order else None

    def has_waiters_at_or_before(self, priority: int) -> bool:
        """Would a new arrival of ``priority`` queue behind someone?"""
        return bool(self._order) and self._order[0] <= priority

    def _class(self, priority: int) -> deque[Waiter]:
        q = self._classes.get(priority)
        if q is None:
            q = self._classes[priority] = deque()
            bisect.insort(self._order, priority)
        return q

    def push(self, w: Waiter) -> None:
        self._class(w.priority).append(w)

    def remove(self, w: Waiter) -> bool:
        """Remove a waiting waiter (cancel/timeout); False if not queued."""
        q = self._classes.get(w.priority)
        if q is None or w.state is not WaiterState.WAITING:
            return False
        try:
            q.remove(w)
        except ValueError:
            return False
        if not q:
            self._drop_class(w.priority)
        return True

    def take_prefix(self, available: int) -> list[Waiter]:
        """Pop the longest head-first prefix whose total fits in ``available``."""
        batch: list[Waiter] = []
        total = 0
        while self._order:
            p = self._order[0]
            q = self._classes[p]
            w = q[0]
            if total + w.n > available:
                break
            q.popleft()
            total += w.n
            batch.append(w)
            if not q:
                self._drop_class(p)
        return batch

    def push_front(self, batch: list[Waiter]) -> None:
        """Undo ``take_prefix`` (the grant failed): same order, same place."""
        for w in reversed(batch):
            self._class(w.priority).appendleft(w)

    def drain(self) -> list[Waiter]:
        """Remove and return every waiter (closing)."""
        out = list(self)
        self._classes.clear()
        self._order.clear()
        return out

    def _drop_class(self, priority: int) -> None:
        del self._classes[priority]
        self._order.remove(priority)
