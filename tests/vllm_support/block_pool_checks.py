"""KVPoolBlockPool against vLLM's BlockPool contract, in the vLLM venv.

Run with the vLLM venv's Python: ``python block_pool_checks.py POOL_PREFIX``.
Each check builds its own space in its own pool and raises on a broken
contract; the script prints one JSON object {check name: "ok" | traceback}
(tests/test_adapter_vllm.py asserts every entry is "ok", for each vLLM
release in tests/_vllm_engines.RELEASES). Commit unit:
16 KiB pages x 1 region = 4 blocks of 4 KiB.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

from kvpool import Geometry, KVSpace, Pool, PoolExhausted
from kvpool.adapters.vllm.admission import check_one_request_fits
from kvpool.adapters.vllm import block_pool as bp
from kvpool.adapters.vllm.block_pool import KVPoolBlockPool

from bp_support import PAGE, BLOCK, N, PER_PAGE, CHECKS, block_pool, cache, cache_and_free, cached, check, other_space, plugin_frames, wait_below_guarantee, waiting_of
from hooks_checks import check_release  # this directory is the script's: first on sys.path


@check
def null_block_is_block_zero_and_never_handed_out(name: str) -> None:
    with block_pool(name, pages=N // PER_PAGE, caching=False) as p:
        assert p.null_block.block_id == 0 and p.null_block.is_null
        free = p.get_num_free_blocks()
        assert free == N - 1, free  # vLLM's count and the space agree
        blocks = p.get_new_blocks(free)
        assert 0 not in {b.block_id for b in blocks}
        assert all(b.ref_cnt == 1 for b in blocks)
        assert p.get_num_free_blocks() == 0 and p.get_usage() == 1.0
        p.free_blocks(blocks)
        assert p.get_num_free_blocks() == N - 1 and p.get_usage() == 0.0


@check
def free_blocks_without_cache_returns_memory(name: str) -> None:
    with block_pool(name, pages=N // PER_PAGE, caching=False) as p:
        blocks = p.get_new_blocks(4 * PER_PAGE)
        held = p.space.stats().committed_bytes
        assert held >= 4 * PAGE
        p.free_blocks(blocks)
        assert p.space.stats().used_blocks == 0  # (the null block is not counted)
        assert p.space.stats().committed_bytes < held


@check
def free_count_follows_the_pool_not_the_virtual_capacity(name: str) -> None:
    with block_pool(name, pages=3, caching=False) as p:
        # 64 virtual blocks, 3 pages of memory: 3 blocks of page 0 + 2 pages.
        assert p.free_block_queue.num_free_blocks == N - 1
        assert p.get_num_free_blocks() == 3 + 2 * PER_PAGE
        blocks = p.get_new_blocks(p.get_num_free_blocks())
        assert p.get_num_free_blocks() == 0
        try:
            p.get_new_blocks(1)
        except ValueError:
            pass  # vLLM's own contract for asking beyond get_num_free_blocks
        else:
            raise AssertionError("get_new_blocks beyond the free count must raise ValueError")
        p.free_blocks(blocks[:2])
        assert p.get_num_free_blocks() == 2


@check
def cached_blocks_stay_held_and_hit(name: str) -> None:
    with block_pool(name, pages=N // PER_PAGE, caching=True) as p:
        (a, b) = p.get_new_blocks(2)
        cache(p, a, b"A")
        used = p.space.stats().used_blocks
        free = p.get_num_free_blocks()
        p.free_blocks([a, b])
        assert p.num_evictable_blocks == 1
        assert p.space.stats().used_blocks == used - 1  # b went back, a is still held
        assert p.get_num_free_blocks() == free + 2  # both count as free for vLLM
        hit = cached(p, b"A")
        assert hit is a
        p.touch([a])
        assert a.ref_cnt == 1 and p.num_evictable_blocks == 0
        p.free_blocks([a])
        assert p.num_evictable_blocks == 1


@check
def a_shortage_evicts_the_least_recently_freed_cached_blocks(name: str) -> None:
    with block_pool(name, pages=2, caching=True) as p:
        # 3 + 4 blocks of memory; fill it, cache all, free oldest first.
        blocks = p.get_new_blocks(p.get_num_free_blocks())
        for i, blk in enumerate(blocks):
            cache(p, blk, b"k%d" % i)
        for blk in blocks:
            p.free_blocks([blk])
        assert p.num_evictable_blocks == len(blocks) == 7
        assert p.get_num_free_blocks() == 7  # all evictable
        new = p.get_new_blocks(3)
        assert len(new) == 3 and all(b.block_hash is None for b in new)
        assert [cached(p, b"k%d" % i) is None for i in range(7)] == [True] * 3 + [False] * 4
        assert p.num_evictable_blocks == 4


@check
def whole_cached_pages_are_reclaimed_oldest_first(name: str) -> None:
    with block_pool(name, pages=N // PER_PAGE, caching=True) as p:
        blocks = p.get_new_blocks(3 + 2 * PER_PAGE)  # page 0 (with the null block), pages 1, 2
        by_page: dict[int, list[object]] = {}
        for blk in blocks:
            by_page.setdefault(blk.block_id * BLOCK // PAGE, []).append(blk)
        for page in sorted(by_page, reverse=True):  # page 2 freed first: the oldest
            for blk in by_page[page]:
                cache(p, blk, b"b%d" % blk.block_id)
            p.free_blocks(by_page[page])
        before = p.space.stats().committed_bytes
        assert p.reclaim_pages(1) == 1
        assert all(cached(p, b"b%d" % blk.block_id) is None for blk in by_page[2])
        assert all(cached(p, b"b%d" % blk.block_id) is not None for blk in by_page[1] + by_page[0])
        p.space.trim()
        assert p.space.stats().committed_bytes == before - PAGE
        # Page 0 holds the null block: never a whole cached page.
        assert p.reclaim_pages(5) == 1
        assert p.num_evictable_blocks == len(by_page[0])


@check
def a_lowered_limit_reclaims_down_to_it(name: str) -> None:
    with block_pool(name, pages=N // PER_PAGE, caching=True) as p:
        cache_and_free(p, 3 + 3 * PER_PAGE)
        assert p.space.stats().committed_bytes == 4 * PAGE
        assert p.space.pool is not None
        p.space.pool.set_limit("eng", 2 * PAGE)
        p.on_step()  # over the limit: not throttled
        p.space.trim()
        assert p.space.stats().committed_bytes <= 2 * PAGE


@check
def a_pending_cache_hit_survives_pressure_until_it_is_touched(name: str) -> None:
    # Regression (review of the plugin): vLLM looks a hit up (ref 0), then
    # calls get_num_free_blocks / free_blocks, then touches it. Reclaiming in
    # between dropped the hit and left a block in use that the space thought
    # free.
    with block_pool(name, pages=4, caching=True) as p:
        blocks = cache_and_free(p, 3 + 3 * PER_PAGE)
        hit = cached(p, b"c%d" % blocks[3].block_id)  # on page 1: the oldest whole cached page
        assert hit is not None
        with other_space(p) as other:
            wait_below_guarantee(other, 2 * PER_PAGE)
            p.get_num_free_blocks()
            p.free_blocks([])
            assert cached(p, b"c%d" % blocks[3].block_id) is hit
            p.touch([hit])
            p.on_step()  # the step boundary: pages of cached blocks go
            assert p.lending and hit.ref_cnt == 1 and hit.block_hash is not None
            used = p.space.stats().used_blocks
            assert used == 1 + p.num_evictable_blocks  # the hit is still held by the space
            other.alloc(2 * PER_PAGE)
            other.report_waiting(0)
            p.on_step()
            fresh = p.get_new_blocks(p.get_num_free_blocks())
            assert fresh and hit not in fresh


@check
def another_tenant_taking_the_budget_after_the_check_makes_get_new_blocks_wait(name: str) -> None:
    import threading

    with block_pool(name, pages=4, caching=False) as p:
        free = p.get_num_free_blocks()
        assert free == 3 + 3 * PER_PAGE
        with KVSpace(Geometry(1, 1, BLOCK, N, page_bytes=PAGE), pool=p.space.pool, name="thief",
                     reserve_thread=False, reserve=(0, 0)) as thief:
            stolen = thief.alloc(PER_PAGE)  # one page of budget gone after vLLM's check
            threading.Timer(0.3, lambda: (thief.free(stolen), thief.trim())).start()
            blocks = p.get_new_blocks(free)  # waits for the budget instead of failing the step
            assert len(blocks) == free and len({b.block_id for b in blocks}) == free


@check
def get_new_blocks_waits_past_the_stall_bound_while_the_other_tenant_makes_progress(name: str) -> None:
    # Regression (CI of 2c3ec3c): a TP=2 engine and a hybrid one shared a
    # pool on a loaded machine; the hybrid engine took the memory the TP
    # engine's count had promised and finished its requests slowly, and
    # get_new_blocks raised after a fixed 30 s although the hybrid engine
    # was working all along. The wait is bounded by progress, not time: here
    # the thief keeps allocating and freeing for 3 stall bounds, then gives
    # the page back.
    import threading
    import time

    bp.STALL_S = 1.0
    with block_pool(name, pages=4, caching=False) as p:
        free = p.get_num_free_blocks()
        with KVSpace(Geometry(1, 1, BLOCK, N, page_bytes=PAGE), pool=p.space.pool, name="thief",
                     reserve_thread=False, reserve=(0, 0)) as thief:
            stolen = thief.alloc(PER_PAGE)  # after vLLM's check

            def busy() -> None:  # works (allocs counted in the ledger) for 3 s, then frees the page
                end = time.monotonic() + 3 * bp.STALL_S
                while time.monotonic() < end:
                    thief.free(stolen[:1])
                    stolen[:1] = thief.alloc(1)
                    time.sleep(0.02)
                thief.free(stolen)
                thief.trim()

            t = threading.Thread(target=busy)
            t.start()
            blocks = p.get_new_blocks(free)  # waits as long as the thief works
            t.join()
            assert len(blocks) == free and len({b.block_id for b in blocks}) == free


@check
def reset_prefix_cache_works_when_the_pool_backs_less_than_the_virtual_capacity(name: str) -> None:
    with block_pool(name, pages=3, caching=True) as p:
        cache_and_free(p, 5)
        assert p.get_num_free_blocks() < N - 1  # physical room is below vLLM's count
        assert p.reset_prefix_cache()
        assert p.num_evictable_blocks == 0 and p.space.stats().used_blocks == 0


@check
def a_block_touched_twice_in_one_call_is_no_longer_evictable(name: str) -> None:
    with block_pool(name, pages=N // PER_PAGE, caching=True) as p:
        (a,) = cache_and_free(p, 1)
        assert p.num_evictable_blocks == 1
        p.touch([a, a])
        assert a.ref_cnt == 2 and p.num_evictable_blocks == 0
        p.free_blocks([a, a])
        assert p.num_evictable_blocks == 1


@check
def reset_prefix_cache_gives_cached_blocks_back(name: str) -> None:
    with block_pool(name, pages=N // PER_PAGE, caching=True) as p:
        cache_and_free(p, 5)
        assert p.space.stats().used_blocks == 5  # cached: still held
        assert p.reset_prefix_cache()
        assert p.num_evictable_blocks == 0 and p.space.stats().used_blocks == 0


@check
def behaves_like_vllms_block_pool_on_a_random_workload(name: str) -> None:
    import random

    with block_pool(name, pages=N // PER_PAGE, caching=False) as p:
        ref = BlockPool(N, False, 16)
        rng = random.Random(7)
        mine: list[list[object]] = []
        theirs: list[list[object]] = []
        for _ in range(2000):
            assert p.get_num_free_blocks() == ref.get_num_free_blocks()
            assert abs(p.get_usage() - ref.get_usage()) < 1e-12
            n = rng.randint(1, 6)
            if rng.random() < 0.55 and n <= ref.get_num_free_blocks():
                mine.append(p.get_new_blocks(n))
                theirs.append(ref.get_new_blocks(n))
            elif mine:
                i = rng.randrange(len(mine))
                p.free_blocks(mine.pop(i))
                ref.free_blocks(theirs.pop(i))
        held = {b.block_id for group in mine for b in group}
        assert len(held) == sum(len(g) for g in mine)  # no block handed out twice
        assert p.space.stats().used_blocks == len(held)


@check
def admission_refuses_a_pool_that_cannot_hold_one_max_len_request(name: str) -> None:
    with block_pool(name, pages=3, caching=False) as p:  # 3 + 2 x 4 = 11 blocks, ever
        assert p.space.max_blocks() == 3 + 2 * PER_PAGE
        check_one_request_fits(p.space, max_model_len=11 * 16, block_size=16)  # fits exactly
        try:
            check_one_request_fits(p.space, max_model_len=11 * 16 + 1, block_size=16)
        except ValueError as e:
            msg = str(e)
        else:
            raise AssertionError("a request of 12 blocks cannot fit in 11")
        # vLLM's own wording, with the bytes needed and available.
        assert "KV cache is needed, which is larger than the available KV cache memory" in msg, msg
        assert f"({12 * BLOCK} bytes" in msg and f"({11 * BLOCK} bytes" in msg, msg
        assert f"pool capacity {3 * PAGE} bytes" in msg and "maximum model length is 176" in msg, msg


@check
def admission_counts_the_tenants_limit(name: str) -> None:
    with block_pool(name, pages=N // PER_PAGE, caching=False) as p:
        check_one_request_fits(p.space, max_model_len=40 * 16, block_size=16)
        assert p.space.pool is not None
        p.space.pool.set_limit("eng", 2 * PAGE)
        try:
            check_one_request_fits(p.space, max_model_len=40 * 16, block_size=16)
        except ValueError as e:
            assert f"tenant limit {2 * PAGE} bytes" in str(e) and "at most 7 blocks" in str(e), str(e)
        else:
            raise AssertionError("the limit holds 7 blocks, the request needs 40")


@check
def a_round_trip_is_one_native_alloc_and_one_native_free(name: str) -> None:
    with block_pool(name, pages=N // PER_PAGE, caching=True) as p:
        p.free_blocks(p.get_new_blocks(3 * PER_PAGE))  # pages committed (reserve 0: they go back)
        for n in (1, 5, 3 * PER_PAGE):
            before = p.space.stats()
            blocks = p.get_new_blocks(n)
            mid = p.space.stats()
            p.free_blocks(blocks)
            after = p.space.stats()
            assert (mid.allocs - before.allocs, mid.frees - before.frees) == (1, 0), (n, before, mid)
            assert (after.allocs - mid.allocs, after.frees - mid.frees) == (0, 1), (n, mid, after)
            assert after.used_blocks == 0 and p.free_block_queue.num_free_blocks == N - 1


@check
def a_round_trip_and_a_free_count_enter_only_the_plugins_two_methods(name: str) -> None:
    # Issues 12 and 34: vLLM's per-request calls have one implementation, the
    # native queue's (the count, get_new_blocks and what vLLM calls on the
    # queue, free_blocks' prepend_n); the plugin's class methods are one
    # frame each over it, and nothing else of the plugin runs while nothing
    # is unusual. vLLM's own frames run as in stock vLLM.
    for caching in (False, True):
        with block_pool(name, pages=N // PER_PAGE, caching=caching) as p:
            p.free_blocks(p.get_new_blocks(3 * PER_PAGE))
            for n in (1, 5, 3 * PER_PAGE):
                def round_trip() -> None:
                    p.get_num_free_blocks()
                    p.free_blocks(p.get_new_blocks(n))

                before = p.space.stats()
                frames = plugin_frames(round_trip)
                # (vLLM's own get_new_blocks reads the free count once more.)
                assert frames[:2] == ["get_num_free_blocks", "get_new_blocks"], (caching, n, frames)
                assert set(frames[2:]) <= {"get_num_free_blocks"}, (caching, n, frames)
                after = p.space.stats()
                assert (after.allocs - before.allocs, after.frees - before.frees) == (1, 1)
                assert p.free_block_queue.num_free_blocks == N - 1 and after.used_blocks == 0
            # Off the common case the plugin's slow path answers: an
            # allocation beyond the last count asks the count again.
            p.free_block_queue.promised = 0
            p.free_block_queue.num_free_blocks -= N  # vLLM's own count says no
            try:
                assert plugin_frames(lambda: p.get_new_blocks(1)) == []
            except ValueError:
                pass
            else:
                raise AssertionError("get_new_blocks beyond vLLM's own free count was granted")
            finally:
                p.free_block_queue.num_free_blocks += N


@check
def a_dropped_block_pool_is_collected_with_its_queue(name: str) -> None:
    import gc
    import weakref

    with block_pool(name, pages=2, caching=True) as p:
        p.free_blocks(p.get_new_blocks(2))
        pool_ref, queue_ref = weakref.ref(p), weakref.ref(p.free_block_queue)
        del p
        gc.collect()
        assert pool_ref() is None and queue_ref() is None  # the pool <-> queue cycle is traversed


@check
def a_shortage_evicts_the_oldest_cached_blocks_first(name: str) -> None:
    with block_pool(name, pages=2, caching=True) as p:
        old = cache_and_free(p, 3)  # page 0 (3 blocks beside the null one)
        new = cache_and_free(p, PER_PAGE)  # page 1: the whole pool is now cached
        assert p.num_evictable_blocks == 3 + PER_PAGE and p.space.available() == 0
        got = p.get_new_blocks(2)  # nothing left in the pool: the two oldest cached blocks go
        assert len(got) == 2 and p.num_evictable_blocks == 1 + PER_PAGE
        assert [cached(p, b"c%d" % b.block_id) for b in old[:2]] == [None, None]
        assert cached(p, b"c%d" % old[2].block_id) is old[2]
        assert all(cached(p, b"c%d" % b.block_id) is b for b in new)  # the newer ones stay
        p.free_blocks(got)
        assert p.free_block_queue.num_free_blocks == N - 1


@check
def a_limit_lowered_after_the_count_refuses_at_once_what_the_cache_cannot_serve(name: str) -> None:
    import threading

    from kvpool import RequestTooLarge

    with block_pool(name, pages=4, caching=True) as p:
        cached_blocks = cache_and_free(p, 3 + PER_PAGE)  # 2 pages, all 7 blocks cached
        free = p.get_num_free_blocks()  # vLLM's count: 2 more pages + the cache
        assert free == 2 * PER_PAGE + 3 + PER_PAGE, free
        p.space.set_limit(PAGE)  # an operator, between the count and the allocation: 3 blocks at most
        before = p.space.stats()
        outcome: list[BaseException | list[object]] = []

        def ask() -> None:
            try:
                outcome.append(p.get_new_blocks(3 * PER_PAGE))  # promised, but beyond limit + cache
            except BaseException as e:  # noqa: BLE001 - examined below
                outcome.append(e)

        t = threading.Thread(target=ask, daemon=True)
        t.start()
        t.join(120)  # a hang detector only: the refusal needs no waiting at all
        assert outcome, "get_new_blocks hung on a request the tenant can never hold"
        assert isinstance(outcome[0], RequestTooLarge), outcome
        after = p.space.stats()
        assert (after.used_blocks, after.committed_bytes) == (before.used_blocks, before.committed_bytes)
        assert p.num_evictable_blocks == 3 + PER_PAGE and p.free_block_queue.num_free_blocks == N - 1
        assert all(cached(p, b"c%d" % b.block_id) is b for b in cached_blocks)  # the cache is intact
        got = p.get_new_blocks(2)  # what the cache can serve still is (no new memory)
        assert len(got) == 2 and p.space.stats().committed_bytes <= before.committed_bytes
        p.free_blocks(got)


import lending_checks  # noqa: E402,F401  (registers its checks after these)


def main() -> None:
    check_release()
    prefix = sys.argv[1]
    results: dict[str, str] = {}
    for i, (name, fn) in enumerate(CHECKS.items()):
        bp.STALL_S = 30.0
        try:
            fn(f"{prefix}-{i}")
            results[name] = "ok"
        except BaseException:
            results[name] = traceback.format_exc()
        finally:
            Pool.remove(f"{prefix}-{i}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
