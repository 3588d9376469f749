"""Hypothesis stateful test of the fair-share budget (issue 14, ARCHITECTURE.md "Fair share").

Tenants are KVSpaces of one private pool in this process (no reserve thread,
so every page move is the step's own doing), plus idle tenants in child
processes that hold memory and can be SIGKILLed. Rules: join, leave, alloc,
free, set_limit, set_guarantee, set_headroom, start and stop waiting (``report_waiting``
after a refused alloc, as a manager does when it queues a request), spawn
and SIGKILL a child tenant.

After every step, once every tenant has taken the pool's news (``budget()``,
which is what its watcher or its next call does):
  * the pool's committed bytes are within its capacity;
  * no tenant is above an applied limit (a lowered limit only shrinks it);
  * explicit guarantees add up to at most the capacity;
  * while some tenant below its guarantee waits, every tenant above its own
    is ``lending`` and keeps no idle pages;
  * a waiting tenant below its guarantee is granted (its alloc succeeds)
    once the pool's free memory covers its request within its guarantee and
    ahead of what other such waiters want. Waiters are retried after every
    step, as a manager's dispatch retries on every wake-up;
  * every tenant publishes keep_free = min(headroom, guarantee - claimed).
And at every grant: a claim that takes a tenant past its guarantee leaves at
least what the other tenants not waiting keep free (the headroom rule).
"""

from __future__ import annotations

import collections
import itertools
import os
import pathlib
import select
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from typing import IO

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import event as _hypothesis_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvpool import KVSpace, LedgerError, Pool, PoolExhausted, RequestTooLarge

from . import _fair_child as child

G = child.GEOMETRY  # 4 blocks a page, every page whole: page arithmetic is exact
PCB = G.page_commit_bytes
BPP = 4
CAP_PAGES = 8
CAP = CAP_PAGES * PCB
MAX_TENANTS = 5
GUARD_S = 240  # hang guard for a child's answer (only turns a hang into a message)
SEEN: collections.Counter[str] = collections.Counter()  # what the run reached (printed with -s)


def event(what: str) -> None:
    SEEN[what] += 1
    _hypothesis_event(what)


@dataclass
class Tenant:
    space: KVSpace
    held: list[int] = field(default_factory=list)
    waiting: int = 0              # blocks of the request it waits for (0: none)
    ceiling: int | None = None    # bytes it may hold: its limit, or what it held when a lower one came


@dataclass
class Child:
    pid: int
    pidfd: int


class Factory:
    """tests/_fair_child.py's tenant factory: one interpreter per test, a fork per child tenant."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(pathlib.Path(child.__file__)), "factory"],
                                     cwd="/tmp", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def hold(self, pool: str, name: str, n: int) -> tuple[int, int] | str:
        """(pid, blocks held) of a new child tenant, or its error text."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"hold {pool} {name} {n}\n")
        self.proc.stdin.flush()
        out: IO[str] = self.proc.stdout
        ready, _, _ = select.select([out], [], [], GUARD_S)
        assert ready, f"child tenant {name} did not answer in {GUARD_S} s"
        words = out.readline().split()
        assert words[1] == name, words
        if words[0] == "error":
            return " ".join(words[2:])
        return int(words[2]), int(words[3])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the factory exits; its children die with it
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class BudgetMachine(RuleBasedStateMachine):
    factory: Factory | None = None  # set by the test: one per run

    def __init__(self) -> None:
        super().__init__()
        self.pool_name = f"test-budget-{uuid.uuid4().hex[:10]}"
        self.pool = Pool(self.pool_name, capacity=CAP)
        self.tenants: dict[str, Tenant] = {}
        self.children: dict[str, Child] = {}
        self.names = itertools.count()

    def teardown(self) -> None:
        for t in self.tenants.values():
            t.space.close()
        for c in self.children.values():
            self._kill(c)
        Pool.remove(self.pool_name)

    # ------------------------------------------------------------- helpers
    def _count(self) -> int:
        return len(self.tenants) + len(self.children)

    def _explicit(self, but: str | None = None) -> int:
        return sum(t.guarantee_setting or 0 for t in self.pool.snapshot().tenants if t.name != but)

    def _pick(self, data: st.DataObject, waiting: bool | None = None) -> tuple[str, Tenant] | None:
        names = sorted(n for n, t in self.tenants.items() if waiting is None or bool(t.waiting) == waiting)
        if not names:
            return None
        name = data.draw(st.sampled_from(names))
        return name, self.tenants[name]

    def _shrink_ceiling(self, t: Tenant) -> None:
        """Pages given back under a lowered limit never come back above it."""
        if t.ceiling is not None:
            limit = t.space.budget().limit_bytes
            assert limit is not None
            t.ceiling = max(limit, min(t.ceiling, t.space.stats().committed_bytes))

    def _retry(self, t: Tenant) -> bool:
        """A manager's dispatch: try the waiting request again; True if granted.

        Every retry also checks the promise: a waiter below its guarantee whose
        request the pool's free memory covers is granted."""
        covered = self._covered(t)
        if covered:
            event("a waiter below its guarantee was covered by free memory")
        before = self._before(t)
        try:
            ids = t.space.alloc(t.waiting)
        except RequestTooLarge:
            assert not covered, covered
            self._stop_waiting(t)  # the manager fails such a waiter (a lowered limit)
            return False
        except PoolExhausted:
            assert not covered, covered
            return False
        t.held.extend(ids.tolist())
        self._check_borrow(t, before)
        self._stop_waiting(t)
        return True

    def _before(self, t: Tenant) -> tuple[int, int, int]:
        """(claimed, guarantee, what the others not waiting keep free) before t's alloc."""
        b = t.space.budget()
        keep = sum(r.keep_free_bytes for r in self.pool.snapshot().tenants
                   if r.name != t.space.name and r.want_bytes == 0)
        return b.claimed_bytes, b.guarantee_bytes, keep

    def _check_borrow(self, t: Tenant, before: tuple[int, int, int]) -> None:
        """The headroom rule at a grant: growing past the guarantee leaves what the others keep free."""
        claimed, guarantee, keep = before
        grew = t.space.budget().claimed_bytes - claimed
        if grew > max(0, guarantee - claimed):
            snap = self.pool.snapshot()
            free = snap.capacity - snap.committed
            if keep:
                event("a borrower grew beside a tenant keeping headroom free")
            assert free >= keep, (f"{t.space.name} grew {grew} bytes past its guarantee ({claimed} of {guarantee} "
                                  f"claimed) leaving {free} free, less than the {keep} others keep free")

    def _stop_waiting(self, t: Tenant) -> None:
        t.waiting = 0
        t.space.report_waiting(0)

    def _kill(self, c: Child) -> None:
        try:
            os.kill(c.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        ready, _, _ = select.select([c.pidfd], [], [], GUARD_S)  # readable once it exited
        assert ready, f"pid {c.pid} survived SIGKILL for {GUARD_S} s"
        os.close(c.pidfd)

    # --------------------------------------------------------------- rules
    @precondition(lambda self: self._count() < MAX_TENANTS)
    @rule(guarantee=st.none() | st.integers(0, CAP_PAGES), roomy=st.booleans(), headroom=st.integers(0, 3))
    def join(self, guarantee: int | None, roomy: bool, headroom: int) -> None:
        name = f"t{next(self.names)}"
        g = None if guarantee is None else guarantee * PCB
        explicit = self._explicit()
        try:
            space = KVSpace(G, pool=self.pool, name=name, reserve_thread=False,
                            reserve=(0, 2) if roomy else (0, 0), guarantee_bytes=g, headroom_bytes=headroom * PCB)
        except (ValueError, LedgerError) as e:  # LedgerError today; Pool.set_guarantee says ValueError
            assert g is not None and explicit + g > CAP, e
            assert name not in {t.name for t in self.pool.snapshot().tenants}
            return
        assert g is None or explicit + g <= CAP
        self.tenants[name] = Tenant(space)

    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        picked = self._pick(data)
        if picked is None:
            return
        name, t = picked
        t.space.close()
        del self.tenants[name]
        assert name not in {r.name for r in self.pool.snapshot().tenants}

    @rule(data=st.data(), n=st.integers(1, 3 * BPP))
    def alloc(self, data: st.DataObject, n: int) -> None:
        picked = self._pick(data)
        if picked is None:
            return
        _, t = picked
        if t.waiting:  # a manager never lets a new alloc pass its queue: dispatch instead
            self._retry(t)
            return
        max_blocks, available = t.space.max_blocks(), t.space.available()
        before = self._before(t)
        try:
            ids = t.space.alloc(n)
        except RequestTooLarge:
            assert n > max_blocks
            return
        except PoolExhausted:
            assert not (n > max_blocks and n > available), "should have been refused as too large"
            return
        assert n <= max(max_blocks, available)
        t.held.extend(ids.tolist())
        self._check_borrow(t, before)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        picked = self._pick(data)
        if picked is None or not picked[1].held:
            return
        _, t = picked
        if data.draw(st.booleans()):
            # Every block of one page: the page empties (lenders give such pages back).
            page = G.page_of(data.draw(st.sampled_from(t.held)))
            idx = [i for i, blk in enumerate(t.held) if G.page_of(blk) == page]
        else:
            k = data.draw(st.integers(1, len(t.held)))
            idx = sorted(data.draw(st.sets(st.integers(0, len(t.held) - 1), min_size=k, max_size=k)))
        t.space.free([t.held[i] for i in idx])
        t.held = [b for i, b in enumerate(t.held) if i not in set(idx)]
        self._shrink_ceiling(t)
        if t.waiting:
            self._retry(t)  # the manager's free dispatches its waiters

    @rule(data=st.data(), pages=st.none() | st.integers(0, CAP_PAGES))
    def set_limit(self, data: st.DataObject, pages: int | None) -> None:
        picked = self._pick(data)
        if picked is None:
            return
        _, t = picked
        limit = None if pages is None else pages * PCB
        t.space.set_limit(limit)
        t.ceiling = None if limit is None else max(limit, t.space.stats().committed_bytes)
        assert t.space.budget().limit_bytes == limit
        if t.waiting and t.waiting > t.space.max_blocks():
            self._stop_waiting(t)  # the manager fails a waiter that can never fit any more

    @rule(data=st.data(), pages=st.none() | st.integers(0, CAP_PAGES))
    def set_guarantee(self, data: st.DataObject, pages: int | None) -> None:
        picked = self._pick(data)
        if picked is None:
            return
        name, t = picked
        g = None if pages is None else pages * PCB
        before = t.space.budget()
        explicit = self._explicit(but=name)
        try:
            t.space.set_guarantee(g)
        except ValueError as e:
            assert g is not None and explicit + g > CAP, e
            after = t.space.budget()
            assert (after.guarantee_setting, after.guarantee_revision) == (
                before.guarantee_setting, before.guarantee_revision)
            return
        assert g is None or explicit + g <= CAP
        b = t.space.budget()
        assert (b.guarantee_setting, b.guarantee_revision) == (g, before.guarantee_revision + 1)

    @rule(data=st.data(), pages=st.integers(0, 3))
    def set_headroom(self, data: st.DataObject, pages: int) -> None:
        picked = self._pick(data)
        if picked is not None:
            picked[1].space.set_headroom(pages * PCB)
            assert picked[1].space.budget().headroom_bytes == pages * PCB

    @rule(data=st.data(), n=st.integers(1, 3 * BPP))
    def start_waiting(self, data: st.DataObject, n: int) -> None:
        picked = self._pick(data, waiting=False)
        if picked is None:
            return
        _, t = picked
        before = self._before(t)
        try:
            ids = t.space.alloc(n)
        except RequestTooLarge:
            return  # admission: never queued
        except PoolExhausted:
            t.waiting = n
            t.space.report_waiting(1)  # the manager queued it
            return
        t.held.extend(ids.tolist())
        self._check_borrow(t, before)

    @rule(data=st.data())
    def stop_waiting(self, data: st.DataObject) -> None:
        picked = self._pick(data, waiting=True)
        if picked is not None:
            self._stop_waiting(picked[1])  # timed out or cancelled

    @precondition(lambda self: self.factory is not None and self._count() < MAX_TENANTS)
    @rule(n=st.integers(1, CAP_PAGES * BPP))
    def spawn_child(self, n: int) -> None:
        assert self.factory is not None
        name = f"c{next(self.names)}"
        got = self.factory.hold(self.pool_name, name, n)
        assert not isinstance(got, str), got
        pid, held = got
        assert 0 <= held <= n
        self.children[name] = Child(pid, os.pidfd_open(pid))

    @rule(data=st.data())
    def sigkill_child(self, data: st.DataObject) -> None:
        if not self.children:
            return
        name = data.draw(st.sampled_from(sorted(self.children)))
        self._kill(self.children.pop(name))
        event("a child tenant was SIGKILLed")
        # Its budget comes back to whoever looks (here: tenants() reaps).
        assert name not in {t.name for t in self.pool.tenants()}

    # ----------------------------------------------------------- invariants
    def _news(self) -> None:
        """Every tenant takes the pool's news, as its watcher does (twice: one's news is another's)."""
        for _ in range(2):
            for t in self.tenants.values():
                t.space.budget()

    @invariant()
    def after_every_step(self) -> None:
        self._news()
        self._check()
        self._serve()
        self._news()
        self._check()

    def _check(self) -> None:
        snap = self.pool.snapshot()
        assert snap.committed <= snap.capacity == CAP
        assert sum(r.guarantee_setting or 0 for r in snap.tenants) <= CAP
        rows = {r.name: r for r in snap.tenants}
        for name, t in self.tenants.items():
            s = t.space.stats()
            b = s.budget
            assert rows[name].committed_bytes == b.claimed_bytes == s.committed_bytes
            if b.limit_bytes is not None:
                assert t.ceiling is not None and s.committed_bytes <= t.ceiling, (name, s.committed_bytes, t.ceiling)
                t.ceiling = max(b.limit_bytes, min(t.ceiling, s.committed_bytes))
            starving = [r.name for r in snap.tenants
                        if r.name != name and r.want_bytes > 0 and r.committed_bytes < r.guarantee_bytes]
            if starving and b.claimed_bytes > b.guarantee_bytes:
                event("a borrower lends to a tenant below its guarantee")
                assert b.lending, f"{name} borrows ({b.claimed_bytes} > {b.guarantee_bytes}) while {starving} wait"
            if b.lending:
                assert s.pages_reserve == 0, f"{name} lends but keeps {s.pages_reserve} idle pages"
            keep = min(b.headroom_bytes, max(0, b.guarantee_bytes - b.claimed_bytes))
            assert b.keep_free_bytes == rows[name].keep_free_bytes == keep, (name, b, rows[name])

    def _serve(self) -> None:
        for _, t in sorted(self.tenants.items()):
            if t.waiting:
                self._retry(t)

    def _covered(self, t: Tenant) -> str:
        """Why t's waiting request must be granted now ("" if the rules do not promise it)."""
        name = t.space.name
        snap = self.pool.snapshot()
        s = t.space.stats()
        b = s.budget
        usable = s.pages_active * BPP - s.used_blocks + s.pages_reserve * BPP
        need = max(0, -(-(t.waiting - usable) // BPP))  # pages to commit
        ahead = sum(min(r.want_bytes, r.guarantee_bytes - r.committed_bytes) for r in snap.tenants
                    if r.name != name and r.want_bytes > 0 and r.committed_bytes < r.guarantee_bytes)
        fits_limit = b.limit_bytes is None or (s.pages_active + s.pages_reserve + need) * PCB <= b.limit_bytes
        free = snap.capacity - snap.committed
        if (b.claimed_bytes < b.guarantee_bytes and b.claimed_bytes + need * PCB <= b.guarantee_bytes
                and need * PCB + ahead <= free and fits_limit and t.waiting <= s.max_blocks):
            return (f"{name} waits below its guarantee ({b.claimed_bytes} < {b.guarantee_bytes}) for {t.waiting} "
                    f"blocks ({need} pages) and the pool has {free} bytes free ({ahead} wanted by others below "
                    "theirs), yet its alloc was refused")
        return ""

@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_budget_keeps_its_invariants_under_random_tenants() -> None:
    cfg = settings(max_examples=int(os.environ.get("KVPOOL_BUDGET_EXAMPLES", "60")), stateful_step_count=40,
                   deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    BudgetMachine.factory = Factory()
    try:
        run_state_machine_as_test(BudgetMachine, settings=cfg)
        print("reached:", dict(SEEN))
    finally:
        BudgetMachine.factory.close()
        BudgetMachine.factory = None
