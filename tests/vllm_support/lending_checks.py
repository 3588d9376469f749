"""The vLLM block pool's checks as a lending or waiting tenant of a pool (registered in
bp_support.CHECKS; run by block_pool_checks.py, in the vLLM venv)."""

from __future__ import annotations

from collections.abc import Callable

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

from kvpool import Geometry, KVSpace, Pool, PoolExhausted
from kvpool.adapters.vllm.admission import check_one_request_fits
from kvpool.adapters.vllm import block_pool as bp
from kvpool.adapters.vllm.block_pool import KVPoolBlockPool

from bp_support import PAGE, BLOCK, N, PER_PAGE, CHECKS, block_pool, cache, cache_and_free, cached, check, other_space, plugin_frames, wait_below_guarantee, waiting_of


@check
def a_borrower_gives_cached_pages_back_while_a_tenant_below_its_guarantee_waits(name: str) -> None:
    with block_pool(name, pages=4, caching=True) as p:
        blocks = cache_and_free(p, 3 + 3 * PER_PAGE)  # the whole pool, all cached
        held = p.num_evictable_blocks
        assert held == len(blocks)
        with other_space(p) as other:  # guarantees: 2 pages each, eng borrows 2
            p.on_step()
            assert p.num_evictable_blocks == held and not p.lending  # nobody waits: the cache stays
            wait_below_guarantee(other, PER_PAGE)
            p.get_num_free_blocks()
            p.free_blocks([])
            assert p.num_evictable_blocks == held  # never from vLLM's own calls (a hit may be pending)
            p.on_step()
            assert p.lending and p.space.budget().lending
            # One page back, what the waiter wants (the oldest whole cached page).
            assert p.num_evictable_blocks == held - PER_PAGE
            # Counted as the cache's eviction, not as requests finishing.
            b = p.space.budget()
            assert (b.reclaimed_by_eviction_bytes, b.reclaimed_by_completion_bytes) == (PER_PAGE * BLOCK, 0), b
            assert p.get_num_free_blocks() == 0  # vLLM sees a full cache: it preempts
            assert len(other.alloc(PER_PAGE)) == PER_PAGE  # granted
            other.report_waiting(0)
            p.on_step()
            assert not p.lending and p.get_num_free_blocks() == p.num_evictable_blocks > 0


@check
def a_lenders_prefix_cache_reset_counts_as_eviction(name: str) -> None:
    # vLLM's reset drops every hash before the plugin gives the blocks back: they still
    # count as the cache's (reclaimed by eviction), not as requests finishing.
    with block_pool(name, pages=4, caching=True) as p:
        blocks = cache_and_free(p, 3 + 3 * PER_PAGE)  # the whole pool, all cached
        with other_space(p) as other:
            wait_below_guarantee(other, PER_PAGE)
            p.on_step()
            assert p.lending
            held = p.num_evictable_blocks
            assert p.reset_prefix_cache() and p.num_evictable_blocks == 0
            b = p.space.budget()
            assert b.reclaimed_by_eviction_bytes == len(blocks) * BLOCK, b
            assert b.reclaimed_by_completion_bytes == 0 and held == len(blocks) - PER_PAGE, b
            assert len(other.alloc(PER_PAGE)) == PER_PAGE


@check
def a_tenant_below_its_guarantee_keeps_its_cache_when_another_waits(name: str) -> None:
    with block_pool(name, pages=N // PER_PAGE, caching=True) as p:
        cache_and_free(p, 3 + 2 * PER_PAGE)  # 3 pages of a 16-page pool: below its 8-page guarantee
        held = p.num_evictable_blocks
        with other_space(p) as other:
            other.report_waiting(1)
            p.on_step()
            assert not p.lending and p.num_evictable_blocks == held


@check
def an_alloc_after_the_count_gives_the_cache_back_when_the_engine_turns_lender(name: str) -> None:
    import threading

    with block_pool(name, pages=4, caching=True) as p:
        cache_and_free(p, 3 + 3 * PER_PAGE)  # the whole pool, all cached
        with other_space(p) as other:
            free = p.get_num_free_blocks()  # vLLM's check, before the verdict turns
            assert free > 2
            wait_below_guarantee(other, 2 * PER_PAGE)
            served = threading.Event()

            def serve() -> None:  # the waiter takes what it wanted, then stops waiting
                other.acquire(2 * PER_PAGE)
                other.report_waiting(0)
                served.set()

            t = threading.Thread(target=serve)
            t.start()
            got = p.get_new_blocks(2)  # promised: the lender's cache goes back, the 2 blocks are granted
            t.join()
            assert served.is_set() and len(got) == 2 and p.num_evictable_blocks == 0
            p.on_step()
            assert not p.lending


@check
def the_free_count_vllm_read_is_granted_even_if_the_engine_turns_lender_before_it_allocates(name: str) -> None:
    # Regression (issue 14): the budget's lending verdict flipped between
    # vLLM's get_num_free_blocks and get_new_blocks (another process started
    # waiting below its guarantee); the alloc was refused, get_new_blocks
    # waited 30 s and raised a shortage in the scheduler.
    with block_pool(name, pages=4, caching=False) as p:
        held = p.get_new_blocks(3 + 2 * PER_PAGE)  # pages 0-2: borrows a page above its 2-page guarantee
        with other_space(p) as other:
            p.on_step(1)
            assert not p.lending
            free = p.get_num_free_blocks()  # vLLM's check: the last free page
            assert free == PER_PAGE, free
            wait_below_guarantee(other, 2 * PER_PAGE)  # needs 2 pages, 1 is free: waits below its guarantee
            assert p.space.budget().lending  # the verdict turned after vLLM's check

            def no_wait(*args: object, **kwargs: object) -> object:
                raise AssertionError("get_new_blocks waited although vLLM had been told the blocks were free")

            p.space.acquire = no_wait  # type: ignore[method-assign]
            got = p.get_new_blocks(free)  # granted at once, as the count said
            assert len(got) == free and not {b.block_id for b in got} & {b.block_id for b in held}
            # From the next count on the engine lends: vLLM sees a full cache.
            assert p.get_num_free_blocks() == 0
            p.on_step(1)
            assert p.lending and p.get_num_free_blocks() == 0
            p.free_blocks(got + held[:PER_PAGE + 3])  # its emptied pages go back to the pool at once
            assert len(other.alloc(2 * PER_PAGE)) == 2 * PER_PAGE  # the waiter is served
            other.report_waiting(0)
            p.on_step(0)
            assert not p.lending


@check
def a_lender_admits_nothing_new_lets_running_requests_grow_and_preempts_only_on_the_verdict(name: str) -> None:
    # Issue 31 item 4 (ARCHITECTURE.md "Fair share", rule 8). Three running
    # requests: a (page 0, long, costly), b (page 1, long, cheap), c (page 2,
    # finishing within the bound; page 2 has one block free).
    from types import SimpleNamespace

    with block_pool(name, pages=4, caching=False) as p:
        got = p.get_new_blocks(3 + 2 * PER_PAGE)  # pages 0-2: borrows a page above its 2-page guarantee
        by_page = {pg: [b for b in got if b.block_id // PER_PAGE == pg] for pg in range(3)}
        p.free_blocks(by_page[2][-1:])  # room for one block in page 2
        reqs = {k: SimpleNamespace(num_computed_tokens=t, num_preemptions=0) for k, t in
                (("a", 500), ("b", 20), ("c", 90))}
        blocks = {"a": by_page[0], "b": by_page[1], "c": by_page[2][:-1]}
        steps = {"a": 10_000, "b": 10_000, "c": 10}

        def running() -> list[bp.Running]:
            return [bp.Running(reqs[k], steps[k], reqs[k].num_computed_tokens, [b.block_id for b in blocks[k]])
                    for k in blocks]

        with other_space(p) as other:
            wait_below_guarantee(other, 2 * PER_PAGE)  # lacks one page; c's completion frees one
            assert p.on_step(1, running) == []  # verdict 0: nothing to preempt
            b = p.space.budget()
            assert p.lending and b.freeing_bytes == PAGE and b.preempt_bytes == 0, b
            assert p.get_num_free_blocks() == 0  # a new request is not admitted
            committed = p.space.stats().committed_bytes
            p._growing = True  # (the allocate_slots hook, for a running request)
            try:
                assert p.get_num_free_blocks() == 1  # a running one grows into the pages it holds...
                blocks["c"] += p.get_new_blocks(1)
                assert p.get_num_free_blocks() == 0
            finally:
                p._growing = False
            assert p.space.stats().committed_bytes == committed  # ...never into a new page
            # A light waiter (below its headroom) needs its page now: the verdict asks.
            other.set_headroom(2 * PAGE)
            victims = p.on_step(1, running)
            assert p.space.budget().preempt_bytes == PAGE
            assert victims == [reqs["b"]], victims  # one page: the cheapest recompute not finishing soon
            with p.preempting(reqs["b"]):
                p.free_blocks(blocks.pop("b"))  # what vLLM's _preempt_request frees
            b = p.space.budget()
            assert (b.preemptions_asked, b.requests_preempted, b.tokens_recomputed) == (1, 1, 20), b
            assert b.reclaimed_by_preemption_bytes == PER_PAGE * BLOCK, b
            assert p.space.stats().committed_bytes == committed - PAGE  # its page went back at once
            assert len(other.alloc(2 * PER_PAGE)) == 2 * PER_PAGE
            other.report_waiting(0)
            p.on_step(0, running)
            assert not p.lending
            p.free_blocks(blocks["a"] + blocks["c"])


@check
def a_count_does_not_promise_past_its_own_step(name: str) -> None:
    with block_pool(name, pages=4, caching=False) as p:
        held = p.get_new_blocks(3 + 2 * PER_PAGE)
        with other_space(p) as other:
            assert p.get_num_free_blocks() == PER_PAGE
            p.on_step(1)  # a new step: the earlier count promises nothing any more
            wait_below_guarantee(other, 2 * PER_PAGE)
            # Without a count covering it a lender's alloc is refused at once,
            # as vLLM's BlockPool refuses more than its free count.
            try:
                p.get_new_blocks(1)
            except ValueError as e:
                assert not isinstance(e, PoolExhausted) and "Cannot get 1 free blocks" in str(e), e  # no wait
            else:
                raise AssertionError("a lender's alloc without a fresh free count must not be granted")
            other.report_waiting(0)
            p.free_blocks(held)


@check
def kv_cache_usage_is_measured_against_what_the_pool_can_back(name: str) -> None:
    with block_pool(name, pages=3, caching=False) as p:  # 64 virtual blocks, 11 backed
        assert p.get_usage() == 0.0  # was 1 - 11/63 = 83% on an idle engine
        blocks = p.get_new_blocks(5)
        assert abs(p.get_usage() - 5 / 11) < 1e-12
        p.get_new_blocks(p.get_num_free_blocks())
        assert p.get_usage() == 1.0
        p.free_blocks(blocks)
        assert abs(p.get_usage() - 6 / 11) < 1e-12
        phys = p.physical()
        assert phys["max_blocks"] == 11 and phys["virtual_blocks"] == N - 1 and phys["used_blocks"] == 6


@check
def an_engine_at_the_pools_edge_reports_waiting_until_it_holds_nothing(name: str) -> None:
    with block_pool(name, pages=2, caching=False) as p:
        waiting = waiting_of(p)
        blocks = p.get_new_blocks(p.get_num_free_blocks() - 2)
        p.on_step(0)
        assert waiting() == [0]  # at the edge, but vLLM has nothing queued
        p.on_step(3)
        assert waiting() == [1]  # less than a page of room left, nothing to evict, requests queued
        p.free_blocks(blocks[:1])
        assert waiting() == [1]  # still holding blocks
        p.free_blocks(blocks[1:])
        assert waiting() == [0]  # idle engines must not keep asking


@check
def an_engine_whose_request_does_not_fit_reports_waiting_with_pages_of_room_left(name: str) -> None:
    # Regression: "short" was only "less than a page of room", so an engine
    # whose next request needed more blocks than its room (but more than a
    # page was left) never said it waited; an idle neighbour holding its
    # reserve then never lent, and the engine spun forever (seen with a
    # hybrid engine beside a TP=2 one).
    with block_pool(name, pages=4, caching=False) as p:
        waiting = waiting_of(p)
        assert p.get_num_free_blocks() > 2 * PER_PAGE  # pages of room
        p.on_step(2)
        assert waiting() == [0]  # queued requests alone are not a shortage (vLLM may batch them later)
        p.note_miss()  # allocate_slots answered None: a request needs more than the free count
        p.on_step(2)
        assert waiting() == [1]
        p.on_step(2)
        assert waiting() == [0]  # a miss counts for the next step only
        p.note_miss()
        p.on_step(0)
        assert waiting() == [0]  # nothing queued any more: nothing to wait for
