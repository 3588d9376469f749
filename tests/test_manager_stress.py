"""10 000 random cancellations and timeouts among concurrent waiters leak nothing.

Waiters of random sizes come and go; some time out, some are cancelled
(before or after their grant), holders free random batches. Throughout, no
waiter may sit at the head of the queue while its request fits; at the end
every block is back.
"""

from __future__ import annotations

import random

import anyio
import numpy as np
import pytest

from kvpool import Geometry, KVCacheManager

from .conftest import KiB

G = Geometry(1, 2, 4 * KiB, 96, page_bytes=16 * KiB)  # 4 blocks a page


def assert_no_waiter_stuck(m: KVCacheManager) -> None:
    head = m._queue.head()
    assert head is None or head.n > m.space.available(), "the head waiter fits but was not granted"


@pytest.mark.anyio
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "anyio_backend, target", [("asyncio", 10_000), ("trio", 2_000)], ids=["asyncio", "trio"]
)
async def test_random_cancellations_and_timeouts_leak_no_block(anyio_backend: str, target: int) -> None:
    rng = random.Random(20261129)
    counts = {"timeout": 0, "cancel": 0, "granted": 0}
    held: list[np.ndarray] = []
    live: list[anyio.CancelScope] = []

    async with KVCacheManager(G, reserve=(0, 4), reserve_thread=True) as m:

        async def waiter(n: int, timeout: float | None, scope: anyio.CancelScope) -> None:
            try:
                with scope:
                    try:
                        ids = await m.alloc(n, timeout=timeout, priority=rng.choice((0, 0, 0, 1)))
                    except TimeoutError:
                        counts["timeout"] += 1
                        return
                    held.append(ids)
                    counts["granted"] += 1
                if scope.cancelled_caught:
                    counts["cancel"] += 1
            finally:
                live.remove(scope)

        async with anyio.create_task_group() as tg:
            while counts["timeout"] + counts["cancel"] < target:
                r = rng.random()
                if r < 0.40:
                    scope = anyio.CancelScope()
                    live.append(scope)
                    timeout = rng.choice((None, None, 0.0, 0.0, 0.0005))
                    tg.start_soon(waiter, rng.randint(1, 24), timeout, scope)
                elif r < 0.65 and live:
                    rng.choice(live).cancel()
                elif r < 0.95 and held:
                    m.free(held.pop(rng.randrange(len(held))))
                if rng.random() < 0.3:
                    await anyio.sleep(0)
                else:
                    await anyio.lowlevel.checkpoint()
                assert_no_waiter_stuck(m)
            for scope in list(live):
                scope.cancel()
        # Every task finished: only the blocks in `held` may be in use.
        assert m.waiting == 0
        assert m.stats().used_blocks == sum(len(h) for h in held)
        all_ids = np.concatenate(held) if held else np.empty(0, dtype=np.int64)
        assert len(set(all_ids.tolist())) == len(all_ids)  # no block handed out twice
        for h in held:
            m.free(h)
        assert m.stats().used_blocks == 0
        assert m.available() == G.capacity
    assert counts["timeout"] > 100 and counts["cancel"] > 100 and counts["granted"] > 100
