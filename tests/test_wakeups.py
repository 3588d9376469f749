"""Cross-process wake-ups are events, not polling (issue 10, item 10).

The pool's generation word moves only on changes another tenant may act on
(budget released while someone waits, a setting, a join or leave, a want
appearing or going); each tenant's watcher sleeps until it moves. Before,
the watcher woke every second on an idle space and every release anywhere
woke every tenant.
"""

from __future__ import annotations

import select

import pytest

from kvpool import Geometry, KVSpace, Pool, PoolExhausted

G = Geometry(1, 2, 4096, 256, page_bytes=16384)  # 4 blocks a page
PCB = G.page_commit_bytes


@pytest.fixture
def pool(pool_name: str) -> Pool:
    return Pool(pool_name, capacity=64 * PCB)


def test_releases_nobody_waits_for_move_no_generation(pool: Pool) -> None:
    with KVSpace(G, pool=pool, name="idle", reserve_thread=False, reserve=(0, 0)) as idle, \
         KVSpace(G, pool=pool, name="busy", reserve_thread=False, reserve=(0, 0)) as busy:
        # busy's join moved the generation after idle's watcher started: wait
        # for idle's watcher to signal that one, then nothing more may come.
        poller = select.poll()
        poller.register(idle.wakeup_fd, select.POLLIN)
        while not poller.poll(1000):
            pass
        idle.drain_wakeups()
        before = pool._ledger.generation
        for _ in range(200):  # every round commits and releases a page
            busy.free(busy.alloc(4))
        assert busy.stats().releases >= 200
        assert pool._ledger.generation == before  # nobody was woken
        assert idle.drain_wakeups() == 0


def test_a_waiting_tenant_is_woken_by_the_release_it_waits_for(pool: Pool) -> None:
    small = Pool(f"{pool.name}-s", capacity=2 * PCB)
    try:
        with KVSpace(G, pool=small, name="a", reserve_thread=False, reserve=(0, 0)) as a, \
             KVSpace(G, pool=small, name="b", reserve_thread=False, reserve=(0, 0)) as b:
            a.alloc(4)
            held = b.alloc(4)  # the pool is full
            with pytest.raises(PoolExhausted):
                a.alloc(4)
            a.report_waiting(1)  # now a request of `a` waits for memory
            a.drain_wakeups()
            before = small._ledger.generation
            b.free(held)  # releases the page `a` waits for
            assert small._ledger.generation != before
            poller = select.poll()
            poller.register(a.wakeup_fd, select.POLLIN)
            while not poller.poll(1000):  # an event: the test's timeout bounds a missing one
                pass
            assert len(a.alloc(4)) == 4
            a.report_waiting(0)
    finally:
        Pool.remove(small.name)
