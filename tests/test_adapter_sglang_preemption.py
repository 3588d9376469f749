"""SGLang's retractions counted as preemptions (issue 31, item 3; kvpool.adapters._sglang_preemption).

Two engines on one real pool: ``a`` (SGLang's allocator) borrows, ``b`` (a
second allocator) waits below its guarantee in a thread, as SGLang's
scheduler would in an alloc. Events and counts only: the loop below is
SGLang's own retraction loop (``ScheduleBatch.retract_decode``: retract the
least valued request until ``check_decode_capacity``, i.e. ``available_size()
>= the next decode``), applied to the allocator directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvpool import Pool
from kvpool.adapters import sglang_plugin
from kvpool.adapters.sglang import KVPoolTokenAllocator

from . import _sglang_support as S
from ._helpers import wait_until
from ._sglang_support import MakeAlloc
from .conftest import KiB

make_alloc = pytest.fixture(name="make_alloc")(S.make_alloc_fixture)

PAGE = 32 * KiB  # one kvpool page commit of make_alloc's geometry: 4 blocks (SGLang pages) x 2 regions
BLOCKS_PER_PAGE = 4


@pytest.fixture
def lending(make_alloc: MakeAlloc, pool_name: str) -> Iterator[tuple[KVPoolTokenAllocator, S.Waiter,
                                                                     list[torch.Tensor]]]:
    """``a`` holds 7 of the pool's 8 pages (its guarantee is 4) in 7 one-page requests and
    ``b`` 1; ``b`` waits for 3 more pages, all within its guarantee."""
    Pool(pool_name, capacity=8 * PAGE)
    a, b = make_alloc(1, pool=pool_name), make_alloc(1, pool=pool_name)
    first = a.alloc(BLOCKS_PER_PAGE - 1)  # the rest of the padding page
    assert first is not None
    requests = [first] + [a.alloc(BLOCKS_PER_PAGE) for _ in range(6)]
    assert all(r is not None for r in requests) and a.space.stats().committed_bytes == 7 * PAGE
    assert a.available_size() == 0
    waiter = S.Waiter(b, BLOCKS_PER_PAGE - 1 + 3 * BLOCKS_PER_PAGE)
    wait_until(lambda: S.waiting(pool_name, b.space.name), "b waits, and tells the pool so")
    try:
        yield a, waiter, requests
    finally:
        if waiter.thread.is_alive():
            for r in requests:
                a.free(r)
            a.flush()
            a.flush()
        waiter.join()


def _retract(a: KVPoolTokenAllocator, running: list[torch.Tensor], need: int) -> int:
    """SGLang's retraction loop (schedule_batch.py, 0.5.23) as the plugin wraps it: pop the
    least valued request until the next decode's ``need`` tokens fit. Returns how many."""
    a.begin_preemption()
    n = 0
    while a.available_size() < need and running:
        a.free(running.pop())
        n += 1
    a.end_preemption(n, 40 * n)
    return n


@pytest.mark.timeout(120)
def test_a_lending_sglang_engines_retraction_reaches_the_pool_as_a_preemption(lending: Any) -> None:
    a, waiter, running = lending
    a.flush()
    assert a.space.budget().lending
    assert a.available_size() == 0  # the pool refuses a lender's growth: its next decode does not fit
    assert _retract(a, running, need=1) == 1  # SGLang's own loop: one request covers one decode
    a.flush()
    a.flush()  # its page reaches the space (and, emptied, the pool) as a preemption
    c = a.space.budget()
    assert (c.requests_preempted, c.tokens_recomputed, c.reclaimed_by_preemption_bytes) == (1, 40, PAGE)
    for r in running[1:]:  # the rest complete
        a.free(r)
    a.flush()
    a.flush()
    got = waiter.join()
    assert got is not None and len(got) == BLOCKS_PER_PAGE - 1 + 3 * BLOCKS_PER_PAGE
    c = a.space.budget()
    assert c.requests_preempted == 1 and c.reclaimed_by_completion_bytes >= 2 * PAGE
    assert a.space.pool is not None
    row = next(t for t in a.space.pool.tenants() if t.name == a.space.name)
    assert (row.requests_preempted, row.reclaimed_by_preemption_bytes) == (1, PAGE)


@pytest.mark.timeout(120)
def test_a_lending_sglang_engines_dropped_prefix_cache_reaches_the_pool_as_an_eviction(lending: Any) -> None:
    a, waiter, running = lending
    a.flush()
    assert a.space.budget().lending
    with a.evicting():  # the plugin wraps its drop of SGLang's prefix cache
        a.free(running.pop())  # a finished request's cached KV
    a.begin_preemption()
    retracted = running.pop()
    a.free(retracted)
    a.end_preemption(1, 10)
    with a.evicting():
        a.free(running.pop())  # a second one
    # Pending pages are reused first, oldest first: SGLang takes the first evicted page back
    # before it reaches the space, so only the second counts (and this one, freed later, completes).
    again = a.alloc(BLOCKS_PER_PAGE)
    assert again is not None
    a.flush()
    a.flush()  # the evicted and the retracted pages reach the space, each as what it was
    c = a.space.budget()
    assert (c.reclaimed_by_eviction_bytes, c.reclaimed_by_preemption_bytes, c.reclaimed_by_completion_bytes) == (
        PAGE, PAGE, 0), c
    for r in [*running[1:], again]:  # the rest complete
        a.free(r)
    a.flush()
    a.flush()
    assert waiter.join() is not None
    c = a.space.budget()
    assert c.reclaimed_by_eviction_bytes == PAGE and c.reclaimed_by_completion_bytes >= PAGE
    assert a.space.pool is not None
    row = next(t for t in a.space.pool.tenants() if t.name == a.space.name)
    assert (row.reclaimed_by_eviction_bytes, row.reclaimed_by_preemption_bytes) == (PAGE, PAGE)


@pytest.mark.timeout(120)
def test_an_eviction_is_marked_as_each_page_is_freed_nested_or_not_and_a_restore_takes_the_mark_back(
        lending: Any) -> None:
    a, waiter, running = lending
    a.flush()
    with a.evicting():
        with a.evicting():  # (nested: the outer one still marks)
            a.free(running.pop())
        a.free(running.pop())
    state = a.backup_state()
    with a.evicting():
        page = running.pop()
        a.free(page)
    a.restore_state(state)  # held again: not on its way back any more, so no longer the cache's
    a.free(page)  # a completion this time
    a.flush()
    a.flush()
    assert waiter.join() is not None
    c = a.space.budget()
    assert (c.reclaimed_by_eviction_bytes, c.reclaimed_by_completion_bytes) == (2 * PAGE, PAGE), c


def test_a_retracted_page_sglang_takes_back_before_it_reaches_the_space_is_not_counted(
        make_alloc: MakeAlloc) -> None:
    a = make_alloc(1)
    x = a.alloc(4)
    a.begin_preemption()
    a.free(x)
    a.end_preemption(1, 20)
    again = a.alloc(4)  # pending pages are reused first
    assert again is not None and sorted(again.tolist()) == sorted(x.tolist())
    a.free(again)  # a completion this time
    a.flush()
    a.flush()
    assert a.space.budget().requests_preempted == 0


def test_an_engine_that_does_not_lend_sees_the_space_as_before(make_alloc: MakeAlloc, pool_name: str) -> None:
    Pool(pool_name, capacity=8 * PAGE)
    a = make_alloc(1, pool=pool_name)
    before = a.available_size()
    a.flush()
    assert not a.space.budget().lending and a.available_size() == before == a.space.available()
    x = a.alloc(10)
    assert x is not None
    a.begin_preemption()
    a.free(x)
    a.end_preemption(1, 12)  # a retraction with no lending is counted all the same
    a.flush()
    a.flush()
    c = a.space.budget()
    assert (c.requests_preempted, c.tokens_recomputed) == (1, 12)


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_end_preemption_refuses_bad_counts_and_changes_nothing(make_alloc: MakeAlloc, bad: Any) -> None:
    a = make_alloc(1)
    x = a.alloc(4)
    a.begin_preemption()
    a.free(x)
    before = S.state_of(a)
    with pytest.raises(ValueError, match="requests"):
        a.end_preemption(bad, 1)
    with pytest.raises(ValueError, match="tokens"):
        a.end_preemption(1, bad)
    assert S.state_of(a) == before


def test_the_plugin_counts_what_sglangs_retract_decode_returns(make_alloc: MakeAlloc) -> None:
    # The hook on ScheduleBatch.retract_decode: whatever the original frees is a preemption of
    # the requests it returns (prompt + output tokens each). SGLang's batch is stood in for by
    # the two attributes the hook reads; the real hook point is checked in plugin_checks.py.
    a = make_alloc(1)
    x, y = a.alloc(4), a.alloc(4)
    reqs = [SimpleNamespace(origin_input_ids=[1] * 30, output_ids=[2] * 5)]

    def retract_decode(batch: Any) -> tuple[list[Any], float, list[Any]]:
        batch.token_to_kv_pool_allocator.free(x)
        return reqs, 0.5, []

    out = sglang_plugin._retract_decode(retract_decode, SimpleNamespace(token_to_kv_pool_allocator=a))
    assert out == (reqs, 0.5, [])
    a.free(y)  # a completion: not a preemption
    a.flush()
    a.flush()
    c = a.space.budget()
    assert (c.requests_preempted, c.tokens_recomputed) == (1, 35)
    assert a.space.stats().committed_bytes <= PAGE  # both went back (the padding page stays)
