"""Geometry: the one page/block formula, validation messages, derived capacity."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import Geometry, GeometryError, KVSpace, MiB, PoolExhausted

from .conftest import KiB, snapshot


def test_non_divisible_geometry_has_capacity_three_not_four(make_space) -> None:
    g = Geometry(1, 1, 6 * MiB, 4, page_bytes=14 * MiB)
    assert g.capacity == 3
    assert g.num_pages == 2
    assert [g.block_range(p) for p in range(2)] == [range(0, 2), range(3, 4)]
    assert g.page_of(2) is None and not g.usable(2)
    space = make_space(g)
    assert space.available() == 3
    before = snapshot(space)
    with pytest.raises(PoolExhausted) as err:
        space.alloc(4)
    assert (err.value.requested, err.value.available) == (4, 3)
    assert snapshot(space) == before
    assert sorted(space.alloc(3).tolist()) == [0, 1, 3]


def test_block_larger_than_page_names_the_smallest_page_that_fits() -> None:
    with pytest.raises(GeometryError, match=r"3145728 is larger than page_bytes \(2097152\).*page_bytes=3145728"):
        Geometry(1, 2, 3 * MiB, 10)
    # Not a multiple of the granularity: round up to it.
    with pytest.raises(GeometryError, match=r"page_bytes=2101248"):
        Geometry(1, 2, 2 * MiB + 1, 10)


def test_contiguous_block_larger_than_page_names_the_layers() -> None:
    with pytest.raises(GeometryError, match=r"x 4 layers x 2 buffers.*page_bytes=4194304"):
        Geometry(4, 2, 512 * KiB, 10, layout="contiguous")


@pytest.mark.parametrize("field", ["num_layers", "num_kv_buffers", "block_bytes", "num_blocks", "page_bytes"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_sizes_are_rejected_by_name(field: str, value: int) -> None:
    kw = dict(num_layers=1, num_kv_buffers=2, block_bytes=4 * KiB, num_blocks=8, page_bytes=64 * KiB)
    kw[field] = value
    with pytest.raises(GeometryError, match=f"{field} must be positive, got {value}"):
        Geometry(**kw)  # type: ignore[arg-type]


def test_page_not_a_multiple_of_granularity_names_the_fix() -> None:
    with pytest.raises(GeometryError, match=r"granularity \(4096\); use page_bytes=12288"):
        Geometry(1, 1, 1024, 8, page_bytes=10000, granularity=4096)
    with pytest.raises(GeometryError, match=r"use page_bytes=2097152"):
        Geometry(1, 1, 1024, 8, page_bytes=64 * KiB, granularity=2 * MiB)


def test_check_granularity_names_the_device_and_the_fix() -> None:
    g = Geometry(1, 1, 1024, 8, page_bytes=10000, granularity=16)
    g.check_granularity(16, "cpu")
    with pytest.raises(GeometryError, match=r"^page_bytes \(10000\) is not a multiple of the cpu backend "
                       r"granularity \(4096\); use page_bytes=12288 \(12\.0 KiB\)$"):
        g.check_granularity(4096, "cpu")


def test_num_blocks_none_derives_capacity_from_a_byte_budget() -> None:
    g = Geometry(2, 2, 6 * KiB, None, page_bytes=64 * KiB, memory_bytes=1 * MiB)
    # 1 MiB / (4 regions x 64 KiB) = 4 pages -> floor(4 * 64 / 6) = 42 blocks addressed.
    assert g.num_blocks == 42
    assert g.num_pages == 4
    assert g.capacity == sum(len(g.block_range(p)) for p in range(4)) == 40
    with pytest.raises(GeometryError, match="needs memory_bytes"):
        Geometry(1, 1, 4 * KiB, None)
    with pytest.raises(GeometryError, match="less than one page commit"):
        Geometry(2, 2, 4 * KiB, None, page_bytes=64 * KiB, memory_bytes=100 * KiB)


def test_tensors_created_first_are_checked_against_the_geometry() -> None:
    block = 4 * KiB
    layers = [torch.zeros(2, 10, block, dtype=torch.uint8) for _ in range(3)]
    Geometry(3, 2, block, 10).check_tensors(layers)
    with pytest.raises(GeometryError, match=r"hold 10 blocks .* num_blocks=11; use num_blocks<=10"):
        Geometry(3, 2, block, 11).check_tensors(layers)
    with pytest.raises(GeometryError, match=r"3 layers but the geometry has num_layers=4"):
        Geometry(4, 2, block, 10).check_tensors(layers)
    with pytest.raises(GeometryError, match=r"layer 0 has 2 KV buffers .* num_kv_buffers=1"):
        Geometry(3, 1, block, 10).check_tensors(layers)
    # A list of per-buffer tensors works too.
    Geometry(1, 2, block, 10).check_tensors([[torch.zeros(10, block, dtype=torch.uint8)] * 2])


def test_space_created_first_rejects_views_of_another_block_size(make_space) -> None:
    space = make_space(Geometry(2, 2, 4 * KiB, 64, page_bytes=64 * KiB))
    assert space.view(1, 1, torch.float16, (16, 128)).shape == (64, 16, 128)
    with pytest.raises(GeometryError, match=r"is 8192 bytes but the geometry's block_bytes is 4096"):
        space.view(0, 0, torch.float16, (32, 128))
    with pytest.raises(IndexError):
        space.view(2, 0, torch.float16, (16, 128))


@settings(max_examples=60, deadline=None)
@given(
    page_kib=st.integers(1, 24).map(lambda k: 4 * k),
    block_div=st.floats(0.05, 1.0),
    num_blocks=st.integers(1, 120),
    layers=st.integers(1, 3),
    layout=st.sampled_from(["per_layer", "contiguous"]),
)
def test_every_reported_capacity_figure_is_exactly_allocatable(
    page_kib: int, block_div: float, num_blocks: int, layers: int, layout: str
) -> None:
    page = page_kib * KiB
    block = max(64, int(page * block_div / (layers * 2 if layout == "contiguous" else 1)))
    try:
        g = Geometry(layers, 2, block, num_blocks, page_bytes=page, layout=layout)  # type: ignore[arg-type]
    except GeometryError:
        return  # no whole block fits: nothing to allocate
    with KVSpace(g, reserve_thread=False, reserve=(0, 0)) as space:
        assert space.available() == g.capacity == space.stats().capacity
        assert g.capacity == sum(len(g.block_range(p)) for p in range(g.num_pages))
        held: list[int] = []
        while True:
            try:
                held += space.alloc(1).tolist()
            except PoolExhausted as e:
                assert e.available == 0
                break
        assert len(held) == len(set(held)) == g.capacity
        assert all(g.usable(b) for b in held)
        space.free(held)
        assert space.available() == g.capacity
        # All at once, too.
        assert len(space.alloc(g.capacity)) == g.capacity


@settings(max_examples=200, deadline=None)
@given(
    page_kib=st.integers(1, 64).map(lambda k: 4 * k),
    block_bytes=st.integers(1, 256 * KiB),
    num_blocks=st.integers(1, 300),
    layers=st.integers(1, 3),
    layout=st.sampled_from(["per_layer", "contiguous"]),
)
def test_page_of_agrees_with_block_range_membership(
    page_kib: int, block_bytes: int, num_blocks: int, layers: int, layout: str
) -> None:
    try:
        g = Geometry(layers, 2, block_bytes, num_blocks, page_bytes=page_kib * KiB, layout=layout)  # type: ignore[arg-type]
    except GeometryError:
        return  # block larger than a page, or no whole block fits
    owner: dict[int, int] = {}
    for p in range(g.num_pages):
        for b in g.block_range(p):
            assert b not in owner
            owner[b] = p
    assert [g.page_of(b) for b in range(g.blocks)] == [owner.get(b) for b in range(g.blocks)]
    for b in (-1, g.blocks):
        with pytest.raises(IndexError):
            g.page_of(b)


# Issue 10, D8: 2**43 + 1 regions x 2 MiB wrapped to a 2 MiB memory file in the
# native core's int64 and the first commit grew it until the OOM killer came;
# page_bytes=2**62 was a bare mmap EINVAL. Every product is bounded up front.
@pytest.mark.parametrize(
    "kw, named",
    [
        (dict(num_layers=2**43 + 1, num_kv_buffers=1, block_bytes=16 * KiB, num_blocks=4, page_bytes=2 * MiB),
         r"num_regions \(8796093022209 = num_layers 8796093022209 x num_kv_buffers 1\) x region bytes"),
        (dict(num_layers=2**20, num_kv_buffers=2, block_bytes=2 * MiB, num_blocks=1024, page_bytes=2 * MiB),
         r"num_regions \(2097152 = .*\) x region bytes \(1024 pages x 2097152\) = 4503599627370496 bytes"),
        (dict(num_layers=1, num_kv_buffers=1, block_bytes=4 * KiB, num_blocks=4, page_bytes=2**62),
         r"page_bytes = 4611686018427387904 bytes exceeds the 140737488355328 bytes"),
        (dict(num_layers=1, num_kv_buffers=1, block_bytes=2**63, num_blocks=4, page_bytes=2**64),
         r"page_bytes = 18446744073709551616 bytes exceeds"),
        (dict(num_layers=1, num_kv_buffers=2, block_bytes=64 * KiB, num_blocks=2**40, page_bytes=64 * KiB),
         r"num_blocks \(1099511627776\) x block bytes \(65536\) = 72057594037927936 bytes exceeds"),
        (dict(num_layers=2, num_kv_buffers=2, block_bytes=4 * KiB, num_blocks=None, memory_bytes=2**60,
              page_bytes=64 * KiB),
         r"memory_bytes \(1152921504606846976\) in whole page commits = 1152921504606846976 bytes exceeds"),
        (dict(num_layers=2**40, num_kv_buffers=2, block_bytes=1 * MiB, num_blocks=4, page_bytes=2 * MiB,
              layout="contiguous"),
         r"a contiguous block \(block_bytes x num_layers x num_kv_buffers\) = 2305843009213693952 bytes exceeds"),
    ],
    ids=["regions_wrap_int64", "regions_x_region", "page_2_62", "page_2_64", "blocks_x_block", "memory_bytes",
         "contiguous_block"],
)
def test_a_geometry_beyond_the_virtual_address_space_is_refused_with_its_numbers(kw: dict, named: str) -> None:
    with pytest.raises(GeometryError, match=named):
        Geometry(**kw)


def test_a_geometry_of_exactly_the_virtual_address_space_is_accepted() -> None:
    g = Geometry(1024, 1, 2 * MiB, 2**16, page_bytes=2 * MiB)  # 2**10 regions x 2**16 pages x 2**21 = 2**47
    assert g.num_regions * g.region_bytes == 2**47 and g.capacity == 2**16
    with pytest.raises(GeometryError, match="140737488355328"):
        Geometry(1025, 1, 2 * MiB, 2**16, page_bytes=2 * MiB)


def test_a_page_of_2_62_bytes_is_a_geometry_error_before_any_space_is_made(make_space) -> None:
    with pytest.raises(GeometryError, match="page_bytes = 4611686018427387904"):
        make_space(Geometry(1, 1, 4 * KiB, 4, page_bytes=2**62))


@pytest.mark.parametrize("method", ["block_range", "page_of"])
@pytest.mark.parametrize("bad", [True, 1.0, "1", None])
def test_page_and_block_lookups_refuse_what_is_not_an_int(method: str, bad: object) -> None:
    g = Geometry(1, 1, 4 * KiB, 16, page_bytes=16 * KiB)
    with pytest.raises(ValueError, match=f"must be an int, got {bad!r}"):
        getattr(g, method)(bad)
