"""What the SGLang adapter's tests share (imported by tests/test_adapter_sglang*.py, not collected).

The tests are split by concept: the allocator's contract (alloc, free, free
groups, memory, shortages, lifecycle) in test_adapter_sglang.py, the page
lifecycle (pending until the second flush, backup/restore) in
test_adapter_sglang_pages.py, and the extend/decode slot layout against
SGLang's reference in test_adapter_sglang_extend.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvpool import Pool
from kvpool.adapters.sglang import KVPoolTokenAllocator

from .conftest import KiB, snapshot

NUM_PAGES = 63  # + the padding page = 64 blocks of 4 KiB: 16 kvpool pages of 16 KiB
MakeAlloc = Callable[..., KVPoolTokenAllocator]


def make_alloc_fixture() -> Iterator[MakeAlloc]:
    """The ``make_alloc`` fixture: allocators of NUM_PAGES pages, closed at the end."""
    made: list[KVPoolTokenAllocator] = []

    def make(page_size: int, **kw: Any) -> KVPoolTokenAllocator:
        if "space" not in kw and "geometry" not in kw:
            kw.setdefault("token_bytes", 4 * KiB // page_size)  # one SGLang page = one 4 KiB block
            kw.setdefault("page_bytes", 16 * KiB)
            kw.setdefault("reserve", (0, 0))
            kw.setdefault("reserve_thread", False)
        a = KVPoolTokenAllocator(NUM_PAGES * page_size, page_size, dtype=torch.float16, **kw)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


page_sizes = pytest.mark.parametrize("ps", [1, 4])


def i64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def state_of(a: KVPoolTokenAllocator) -> tuple[object, ...]:
    """Everything a refused call must leave unchanged: the space, every page's
    state (held / pending / marked by a live backup), the pending order and age,
    the backup and the open free group."""
    group = None if a.free_group is None else [g.tolist() for g in a.free_group]
    return (snapshot(a.space), a.held_pages().tolist(), a.available_size(), a._pages.state.tobytes(),
            a._pages.pending.tolist(), a._pages.aged, a._pages.backup_live, a._pages.generation, group)


def pages_of(tokens: torch.Tensor, ps: int) -> set[int]:
    return set((tokens // ps).tolist())


def used(a: KVPoolTokenAllocator) -> int:
    """Blocks held in the space (the padding block is not counted)."""
    return int(a.space.stats().used_blocks)


def waiting(pool: str, name: str) -> bool:
    """Whether tenant ``name`` of ``pool`` tells the pool it waits."""
    return any(t.waiting == 1 for t in Pool(pool).tenants() if t.name == name)


class Waiter:
    """``b`` asks for ``n`` SGLang pages in a thread; it waits in the pool until granted."""

    def __init__(self, b: KVPoolTokenAllocator, n: int) -> None:
        self.got: Any = None
        b.shortage_wait_s = 3600  # bounded by the test's timeout, not by a clock assertion
        self.thread = threading.Thread(target=lambda: setattr(self, "got", b.alloc(n)))
        self.thread.start()

    def join(self) -> Any:
        self.thread.join()
        return self.got
