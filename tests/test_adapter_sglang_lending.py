"""A lending SGLang engine reclaims by completion (kvpool.adapters.sglang: decode_size, giving_back).

Two engines on one real pool: ``a`` (SGLang's allocator) borrows with two
running requests whose slots interleave on its kvpool pages, one token at a
time, as SGLang's decode hands them out; ``b`` waits below its guarantee in
a thread. Before this, the pool refused every alloc of a lender, the free
slots of its own pages included, so SGLang's decode gate missed at every
step: a real server retracted its requests one after another and aborted
the last (docs/sglang.md, "Lending"). Events and counts only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvpool import InvalidBlocks, Pool, PoolClosed
from kvpool.adapters._reclaim import RECLAIM_STEPS

from . import _sglang_support as S
from ._helpers import wait_until
from ._sglang_support import MakeAlloc, Waiter, i64

make_alloc = pytest.fixture(name="make_alloc")(S.make_alloc_fixture)

BLOCKS_PER_PAGE = 4  # make_alloc's geometry: 4 SGLang pages (blocks) per kvpool page, 2 regions
PAGE = 32 * 1024  # one kvpool page commit


@pytest.fixture
def lending(make_alloc: MakeAlloc, pool_name: str) -> Iterator[tuple[Any, Waiter, list[int], list[int]]]:
    """``a`` holds 7 of the pool's 8 pages (its guarantee is 4) in two requests ``x`` and
    ``y`` of interleaved slots; ``b`` holds 1 and waits for 3 more, all within its guarantee."""
    Pool(pool_name, capacity=8 * PAGE)
    a, b = make_alloc(1, pool=pool_name), make_alloc(1, pool=pool_name)
    x: list[int] = []
    y: list[int] = []
    for i in range(7 * BLOCKS_PER_PAGE - 1):  # every slot of 7 pages but the padding block
        got = a.alloc(1)
        assert got is not None
        (x if i % 2 == 0 else y).append(int(got))
    assert a.space.stats().committed_bytes == 7 * PAGE and a.available_size() == 0
    waiter = Waiter(b, BLOCKS_PER_PAGE - 1 + 3 * BLOCKS_PER_PAGE)
    wait_until(lambda: S.waiting(pool_name, b.space.name), "b waits, and tells the pool so")
    try:
        yield a, waiter, x, y
    finally:
        if waiter.thread.is_alive():
            a.clear()
        waiter.join()


def _decode(a: Any, slots: list[int]) -> Any:
    """One decode step of one request (SGLang's alloc_decode); its new slot joins ``slots``."""
    got = a.alloc_decode(i64([len(slots) + 1]), i64([len(slots) + 1]), i64([slots[-1]]))
    if got is not None:
        slots.append(int(got[0]))
    return got


@pytest.mark.timeout(120)
def test_a_lenders_running_request_decodes_into_the_free_slots_of_its_pages_and_finishes(lending: Any) -> None:
    a, waiter, x, y = lending
    a.shortage_wait_s = 0  # a refusal answers None at once (SGLang's decode would then miss)
    a.flush()
    assert a.giving_back() and a.available_size() == 0 == a.decode_size()
    a.free(i64(x))  # x finishes: its slots lie on every page y still uses, so no page empties
    a.flush()
    a.flush()  # its slots reach the space: room on held pages, not new memory
    room = len(x)
    assert a.space.stats().room_blocks == room
    assert a.available_size() == 0 and a.decode_size() == room  # SGLang's decode gate sees the room
    committed = a.space.stats().committed_bytes
    for _ in range(room):  # y decodes on, into x's old slots
        assert _decode(a, y) is not None
    assert set(y) >= set(x) and a.space.stats().committed_bytes == committed  # not one page more
    assert a.decode_size() == 0 and _decode(a, y) is None  # no room left: the lender takes no new page
    assert waiter.thread.is_alive()
    a.free(i64(y))  # y finishes: every page empties, and goes to the waiter
    a.flush()
    a.flush()
    got = waiter.join()
    assert got is not None and len(got) == BLOCKS_PER_PAGE - 1 + 3 * BLOCKS_PER_PAGE
    c = a.space.budget()
    assert c.requests_preempted == 0 and c.reclaimed_by_completion_bytes >= 3 * PAGE


def test_an_engine_that_gives_nothing_back_decodes_within_what_the_space_can_deliver(
        make_alloc: MakeAlloc, pool_name: str) -> None:
    Pool(pool_name, capacity=8 * PAGE)
    a = make_alloc(1, pool=pool_name)
    x = a.alloc(6)  # page 0 (3 slots past the padding block) and 3 of page 1
    assert x is not None and a.space.stats().room_blocks == 1
    a.free(x[:2])  # pending: counted in available_size, as before
    assert not a.giving_back()
    assert a.decode_size() == a.available_size() == a.space.available() + 2  # room is not added twice


def test_a_closed_allocator_refuses_the_lending_figures(make_alloc: MakeAlloc) -> None:
    from kvpool import PoolClosed

    a = make_alloc(1)
    a.close()
    for f in (a.decode_size, a.giving_back):
        with pytest.raises(PoolClosed):
            f()


def test_a_lenders_alloc_beyond_its_room_in_a_full_pool_misses_and_changes_nothing(lending: Any) -> None:
    a, waiter, x, y = lending
    a.shortage_wait_s = 0
    a.free(i64(x[:3]))
    a.flush()
    a.flush()
    assert a.decode_size() == 3
    before = S.state_of(a)
    assert a.alloc(4) is None  # 4 > 3 free slots, and the pool has no free page: refused whole
    assert S.state_of(a) == before
    got = a.alloc(3)
    assert got is not None and sorted(got.tolist()) == sorted(x[:3])
    assert isinstance(got, torch.Tensor)


@pytest.mark.timeout(120)
def test_an_alloc_counted_before_the_verdict_turned_is_honoured_from_the_pools_free_memory(
        make_alloc: MakeAlloc, pool_name: str) -> None:
    # SGLang admits a prefill by available_size(), then allocates it; if a tenant below its
    # guarantee starts waiting in between, this engine lends. Before, its alloc then waited
    # (not promised) for a lending that its own blocked scheduler could never end, and
    # returned None after shortage_wait_s: SGLang's fatal "Prefill out of memory".
    Pool(pool_name, capacity=8 * PAGE)
    a, b = make_alloc(1, pool=pool_name), make_alloc(1, pool=pool_name)
    assert a.alloc(5 * BLOCKS_PER_PAGE - 1) is not None  # 5 pages: 1 over its guarantee of 4
    admitted = a.available_size()
    assert admitted >= BLOCKS_PER_PAGE  # SGLang's gate: a one-page prefill fits
    waiter = Waiter(b, BLOCKS_PER_PAGE - 1 + 3 * BLOCKS_PER_PAGE)  # 3 pages more: 2 free, so it waits
    wait_until(lambda: S.waiting(pool_name, b.space.name), "b waits, and tells the pool so")
    assert a.giving_back()
    a.shortage_wait_s = 0  # a refusal answers None at once
    got = a.alloc(BLOCKS_PER_PAGE)
    assert got is not None and len(got) == BLOCKS_PER_PAGE  # honoured: one of the 2 free pages
    assert a.space.stats().committed_bytes == 6 * PAGE
    assert a.decode_size() == a.available_size() == 0  # and it grows no further
    a.clear()  # every page back: b is granted
    assert waiter.join() is not None


@pytest.mark.timeout(120)
def test_a_lending_sglang_engine_is_never_asked_to_preempt_and_its_completions_lower_the_others_share(
        make_alloc: MakeAlloc, pool_name: str) -> None:
    # Three engines, 6 pages guaranteed each: SGLang ``a`` holds 9 (borrows 3), ``c``
    # (an engine that acts on the verdict, as vLLM's plugin does) holds 8 (borrows 2),
    # ``b`` holds 1 and waits for 3 more in a full pool. Before, the judge asked SGLang
    # for all 3 (it borrows most), which it never acts on, and ``c`` for nothing: the
    # waiter waited for SGLang's completions, however far off.
    Pool(pool_name, capacity=18 * PAGE)
    a, b, c = (make_alloc(1, pool=pool_name) for _ in range(3))  # each commits page 0 (the padding block)
    c.space.set_preempts(True)  # c stands for an engine that acts on the verdict
    short = a.alloc(BLOCKS_PER_PAGE - 1)  # the rest of page 0
    soon = a.alloc(2 * BLOCKS_PER_PAGE)  # 2 pages of its own
    late = a.alloc(6 * BLOCKS_PER_PAGE)  # 6 pages
    assert short is not None and soon is not None and late is not None
    assert c.alloc(8 * BLOCKS_PER_PAGE - 1) is not None
    waiter = Waiter(b, 4 * BLOCKS_PER_PAGE - 1)
    wait_until(lambda: S.waiting(pool_name, b.space.name), "b waits, and tells the pool so")
    try:
        assert a.giving_back() and not a.space.budget().preempts
        assert (a.space.budget().preempt_bytes, c.space.budget().preempt_bytes) == (0, 2 * PAGE)
        # ``soon`` finishes within the bound: its 2 pages empty then, the others' do not.
        far = 10 * RECLAIM_STEPS
        assert a.publish_freeing([(far, short), (RECLAIM_STEPS, soon), (far, late)]) == 2 * PAGE
        rows = {t.name: t for t in Pool(pool_name).tenants()}
        assert rows[a.space.name].freeing_bytes == 2 * PAGE and not rows[a.space.name].preempts
        assert c.space.budget().preempt_bytes == 1 * PAGE  # 3 needed, 2 come by completion
        # A long request sharing one of soon's pages (a common prefix) keeps that page.
        assert a.publish_freeing([(RECLAIM_STEPS, soon), (far, torch.cat([late, soon[:1]]))]) == PAGE
        assert c.space.budget().preempt_bytes == 2 * PAGE
        assert a.publish_freeing([(0, soon), (RECLAIM_STEPS, late)]) == 8 * PAGE
        assert c.space.budget().preempt_bytes == 0  # SGLang's completions cover all 3
        # Bad input raises and changes nothing.
        for bad, error in (([(-1, soon)], ValueError), ([(True, soon)], ValueError),
                           ([(1, soon), (1, i64([0, 10_000]))], InvalidBlocks),
                           ([(1, soon.to(torch.float32))], InvalidBlocks)):  # indices, not values
            with pytest.raises(error):
                a.publish_freeing(bad)
            assert a.space.budget().freeing_bytes == 8 * PAGE
        assert a.publish_freeing(()) == 0 and a.space.budget().freeing_bytes == 0
        a.close()
        with pytest.raises(PoolClosed):
            a.publish_freeing(())
    finally:
        if not a.closed:
            a.clear()
        c.clear()
        assert waiter.join() is not None


def test_the_decode_gate_takes_its_pages_so_no_other_engine_can_take_them_before_the_alloc(
        make_alloc: MakeAlloc, pool_name: str) -> None:
    # SGLang checks the next decode (check_decode_capacity), then allocates it; an alloc's
    # None there is fatal to SGLang ("Out of memory", the scheduler raises). Before, the
    # gate only counted: another engine could take the pool's free memory in between.
    Pool(pool_name, capacity=8 * PAGE)  # two tenants: 4 pages guaranteed each
    a, b = make_alloc(1, pool=pool_name), make_alloc(1, pool=pool_name)
    a.shortage_wait_s = b.shortage_wait_s = 0  # a refusal answers None at once
    assert a.alloc(BLOCKS_PER_PAGE - 1) is not None  # page 0 full: no free slot on a's pages
    free = 8 - 2  # pages: a's and b's page 0 are committed

    def b_takes_every_free_page() -> Any:
        got = b.alloc(free * BLOCKS_PER_PAGE)
        assert got is not None
        return got

    assert a.decode_size() >= BLOCKS_PER_PAGE  # the gate as it was: it counts the pool's free memory
    taken = b_takes_every_free_page()
    assert a.alloc(BLOCKS_PER_PAGE) is None  # the race: SGLang's fatal None
    b.free(taken)
    b.flush()
    b.flush()
    committed = a.space.stats().committed_bytes
    assert a.reserve(BLOCKS_PER_PAGE)  # the gate now takes the page it counted...
    assert a.space.stats().committed_bytes == committed + PAGE and a.available_size() >= BLOCKS_PER_PAGE
    free -= 1
    taken = b_takes_every_free_page()
    got = a.alloc(BLOCKS_PER_PAGE)  # ...so the alloc finds it
    assert got is not None and a.space.stats().committed_bytes == committed + PAGE
    assert a.reserve(0) and a.reserve(BLOCKS_PER_PAGE - 1) is False  # a full pool: SGLang retracts instead
    before = S.state_of(a)
    assert not a.reserve(1) and S.state_of(a) == before  # a miss changes nothing
    b.free(taken)
    b.flush()
    b.flush()
    assert a.reserve(2 * BLOCKS_PER_PAGE)  # not taken by an alloc: back to the space at the second flush
    assert a.space.stats().committed_bytes == committed + 3 * PAGE
    a.flush()
    a.flush()
    assert a.space.stats().committed_bytes == committed + PAGE
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="num_tokens"):
            a.reserve(bad)  # type: ignore[arg-type]
    a.close()
    with pytest.raises(PoolClosed):
        a.reserve(1)


@pytest.mark.timeout(120)
def test_a_lenders_decode_gate_takes_only_the_free_slots_of_its_pages(lending: Any) -> None:
    a, waiter, x, y = lending
    a.free(i64(x[:3]))
    a.flush()
    a.flush()  # 3 free slots on pages a still holds
    committed = a.space.stats().committed_bytes
    assert not a.reserve(4)  # more than its room: SGLang retracts (the pool grants a lender no page)
    assert a.reserve(3) and a.space.stats().committed_bytes == committed  # its room, no page more
    got = a.alloc(3)
    assert got is not None and sorted(got.tolist()) == sorted(x[:3]) and a.decode_size() == 0
