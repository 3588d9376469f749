"""The wait queue's ordering rules, without a manager."""

from __future__ import annotations

import pytest

from kvpool._waitqueue import WaitQueue, Waiter


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _q(*specs: tuple[int, int]) -> tuple[WaitQueue, list[Waiter]]:
    q = WaitQueue()
    ws = [Waiter(n, p) for n, p in specs]
    for w in ws:
        q.push(w)
    return q, ws


@pytest.mark.anyio
async def test_service_order_is_priority_then_arrival() -> None:
    q, ws = _q((1, 5), (1, 0), (1, 5), (1, -1), (1, 0))
    assert list(q) == [ws[3], ws[1], ws[4], ws[0], ws[2]]
    assert q.head() is ws[3]


@pytest.mark.anyio
async def test_take_prefix_never_skips_the_head() -> None:
    q, ws = _q((10, 0), (1, 0), (1, 0))
    assert q.take_prefix(5) == []  # the 1-block waiters behind must not overtake
    assert q.take_prefix(12) == ws
    assert len(q) == 0 and q.waiting_blocks == 0


@pytest.mark.anyio
async def test_push_front_restores_the_exact_order() -> None:
    q, ws = _q((2, 0), (3, 1), (4, 0))
    batch = q.take_prefix(6)
    assert batch == [ws[0], ws[2]]
    q.push_front(batch)
    assert list(q) == [ws[0], ws[2], ws[1]] and q.waiting_blocks == 9


@pytest.mark.anyio
async def test_new_arrivals_queue_behind_equal_or_better_waiters_only() -> None:
    q, _ = _q((1, 3))
    assert q.has_waiters_at_or_before(3) and q.has_waiters_at_or_before(7)
    assert not q.has_waiters_at_or_before(2)


@pytest.mark.anyio
async def test_remove_only_removes_queued_waiters() -> None:
    q, ws = _q((1, 0), (2, 0))
    assert q.remove(ws[0]) and not q.remove(ws[0])
    assert list(q) == [ws[1]] and q.waiting_blocks == 2
