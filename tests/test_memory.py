"""Physical memory really comes and goes; torch views are zero-copy."""

from __future__ import annotations

import pytest
import torch

from kvpool import Geometry

from .conftest import KiB

G = Geometry(3, 2, 8 * KiB, 96, page_bytes=64 * KiB)  # 8 blocks a page, R = 6


@pytest.mark.parametrize("pages", [1, 2, 5])
def test_blocks_on_k_pages_hold_k_page_commits_then_zero_after_trim(make_space, pages: int) -> None:
    space = make_space(G, reserve=(0, 16))
    ids = space.alloc(8 * pages)
    assert space.allocated_bytes() == pages * G.num_regions * G.page_bytes
    assert space.stats().committed_bytes == space.allocated_bytes()
    space.free(ids)
    assert space.allocated_bytes() == pages * G.page_commit_bytes  # idle reserve, still committed
    assert space.trim() == pages
    assert space.allocated_bytes() == 0
    assert space.stats().committed_bytes == 0


def test_region_tensors_are_zero_copy_over_the_reserved_range(make_space) -> None:
    space = make_space(G)
    for r in range(G.num_regions):
        t = space.region(r)
        assert t.dtype == torch.uint8 and t.numel() == G.region_bytes
        assert t.data_ptr() == space.region(0).data_ptr() + r * G.region_bytes
        assert space.view(r // 2, r % 2, torch.bfloat16, (4, 1024)).data_ptr() == t.data_ptr()


def test_writes_through_torch_land_and_read_back(make_space) -> None:
    space = make_space(G)
    ids = torch.from_numpy(space.alloc(10))
    k = space.view(2, 0, torch.float32, (2, 1024))
    v = space.view(2, 1, torch.float32, (2, 1024))
    k[ids] = torch.arange(10, dtype=torch.float32).view(10, 1, 1)
    v[ids] = -1.0
    assert torch.equal(k[ids][:, 1, 5], torch.arange(10, dtype=torch.float32))
    # Same bytes through the raw region.
    raw = space.region(4)[ids[3] * G.block_bytes : (ids[3] + 1) * G.block_bytes]
    assert torch.equal(raw.view(torch.float32), torch.full((2048,), 3.0))
    assert torch.all(space.view(2, 1, torch.float32, (2, 1024))[ids] == -1.0)


def test_a_released_page_reads_zeros_when_committed_again(make_space) -> None:
    space = make_space(G)
    ids = space.alloc(8)  # exactly page 0
    views = space.tensors(torch.int64, (1024,))
    for layer in views:
        for buf in layer:
            buf[torch.from_numpy(ids)] = 7
    space.free(ids)
    space.trim()
    again = torch.from_numpy(space.alloc(8))
    assert space.page_occupancy([0])[0].state == "active"
    for layer in views:
        for buf in layer:
            assert int(buf[again].abs().sum()) == 0


def test_contiguous_layout_gives_strided_per_layer_views(make_space) -> None:
    g = Geometry(2, 2, 4 * KiB, 32, page_bytes=64 * KiB, layout="contiguous")
    space = make_space(g)
    assert g.num_regions == 1 and g.region_block_bytes == 16 * KiB
    ids = torch.from_numpy(space.alloc(4))  # 4 blocks of 16 KiB: exactly page 0
    views = space.tensors(torch.float16, (2, 1024))
    for slot, t in enumerate(x for layer in views for x in layer):
        assert t.stride(0) == 16 * KiB // 2
        t[ids] = float(slot + 1)
    block = space.region(0).view(32, 4, 4 * KiB)[ids[0]]
    for slot in range(4):
        assert torch.all(block[slot].view(torch.float16) == slot + 1)
    # One commit per page id for the whole block: R = 1.
    assert space.allocated_bytes() == g.page_bytes
