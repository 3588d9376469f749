"""Fair share and idle pages: no tenant keeps idle pages from one that waits
below its guarantee (issue 14, ARCHITECTURE.md "Fair share"; reserve release policy).

Tenants are KVSpaces of one private pool in this process, without a reserve
thread, so every page move is the call's own doing and each check follows
the call that caused it.
"""

from __future__ import annotations

import pytest

from kvpool import KVSpace, Pool, PoolExhausted

from .test_fair_share import BPP, G, PCB, POOL_PAGES, _space


def test_a_tenant_whose_own_lowered_guarantee_makes_it_lend_gives_its_idle_pages_back_at_once(
        pool_name: str) -> None:
    # Regression (found by test_budget_stateful under load): a tenant's own
    # set_guarantee refreshed its budget itself, so the space never acted on
    # the new verdict: it lent (refused its own allocs) yet kept its idle
    # reserve pages while a tenant below its guarantee waited for them.
    pool = Pool(pool_name, capacity=POOL_PAGES * PCB)
    lender = KVSpace(G, pool=pool, name="l", reserve_thread=False, reserve=(0, 2), guarantee_bytes=6 * PCB)
    w = _space(pool, "w")  # the default share: the 2 pages l's guarantee leaves
    try:
        ids = lender.alloc(6 * BPP)
        lender.free(ids[: 2 * BPP])  # 4 pages in use, 2 kept idle (the reserve's max)
        w_ids = w.alloc(2 * BPP)  # the pool is full
        with pytest.raises(PoolExhausted):
            w.alloc(1)
        w.report_waiting(1)  # at its guarantee: nobody owes it anything yet
        assert not lender.budget().lending and lender.stats().pages_reserve == 2
        lender.set_guarantee(None)  # equal shares, 4 pages each: w waits below its own, l holds 6: l lends
        # Both idle pages went back with the change itself (which ends the
        # lending: l is back at its share).
        assert lender.stats().pages_reserve == 0
        assert lender.budget().claimed_bytes == 4 * PCB and not lender.budget().lending
        assert len(w.alloc(2 * BPP)) == 2 * BPP  # and serve the waiter
        w.free(w_ids)
    finally:
        w.close()
        lender.close()


def test_a_tenant_within_its_guarantee_gives_its_idle_pages_to_a_tenant_waiting_below_its_own(
        pool_name: str) -> None:
    # Regression (seen with a hybrid vLLM engine beside an idle TP=2 one):
    # under pressure only idle pages above the reserve's max went back, so a
    # neighbour within its guarantee kept its reserve idle while a tenant
    # below its guarantee waited for a request that needed those pages, for
    # as long as the neighbour stayed idle (forever, there).
    pool = Pool(pool_name, capacity=POOL_PAGES * PCB)
    idle = KVSpace(G, pool=pool, name="idle", reserve_thread=False, reserve=(0, 2))
    w = _space(pool, "w")
    try:
        ids = idle.alloc(3 * BPP)
        idle.free(ids[: 2 * BPP])  # 1 page in use, 2 idle (its reserve's max); 3 pages < its share of 4
        w_ids = w.alloc(3 * BPP)  # 3 pages; 2 free in the pool
        with pytest.raises(PoolExhausted):
            w.alloc(4 * BPP)  # one request of 4 pages: w would hold 7, more than its share, but
        assert idle.stats().pages_reserve == 2  # (nobody waits yet: idle keeps its reserve)
        w.free(w_ids[: 2 * BPP])  # w, now 1 page, below its share, still wants 4 pages; 4 are free
        with pytest.raises(PoolExhausted):
            w.alloc(5 * BPP)  # 5 pages: within what idle leaves idle, not within what is free
        w.report_waiting(1)
        assert not idle.budget().lending  # idle is within its guarantee: it lends nothing it uses...
        assert idle.stats().pages_reserve == 0  # ...but keeps no idle page while w waits below its own
        assert len(w.alloc(5 * BPP)) == 5 * BPP
        w.report_waiting(0)
    finally:
        w.close()
        idle.close()
