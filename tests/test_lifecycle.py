"""Closing a space releases everything; a closed space says so clearly."""

from __future__ import annotations

import pytest
import torch

from kvpool import Geometry, KVSpace, MiB, PoolClosed

from .conftest import KiB


def _shmem_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1])
    raise AssertionError("no Shmem line")


def test_using_a_closed_space_raises_pool_closed() -> None:
    space = KVSpace(Geometry(1, 2, 4 * KiB, 64, page_bytes=64 * KiB))
    ids = space.alloc(4)
    space.close()
    assert space.closed
    for call in (lambda: space.alloc(1), lambda: space.free(ids), space.available, space.trim,
                 lambda: space.set_limit(0), lambda: space.region(0), lambda: space.page_occupancy([0])):
        with pytest.raises(PoolClosed, match="closed"):
            call()
    space.close()  # idempotent
    assert "closed" in repr(space)


def test_closing_gives_every_committed_byte_back() -> None:
    g = Geometry(2, 2, 64 * KiB, 1024, page_bytes=2 * MiB)
    space = KVSpace(g, reserve=(2, 4))
    space.alloc(1024)
    assert space.allocated_bytes() == 32 * g.page_commit_bytes  # 256 MiB
    before = _shmem_kib()
    space.close()
    dropped_mib = (before - _shmem_kib()) / 1024
    assert dropped_mib > 0.9 * 256
    assert space.allocated_bytes() == 0


def test_views_outliving_the_space_read_zeros() -> None:
    with KVSpace(Geometry(1, 1, 4 * KiB, 16, page_bytes=64 * KiB)) as space:
        ids = space.alloc(2)
        view = space.view(0, 0, torch.int32, (1024,))
        view[torch.from_numpy(ids)] = 5
    assert int(view[torch.from_numpy(ids)].sum()) == 0


def test_context_manager_closes() -> None:
    with KVSpace(Geometry(1, 1, 4 * KiB, 16, page_bytes=64 * KiB)) as space:
        space.alloc(1)
    assert space.closed
