"""Every public entry point refuses bad input with a typed error naming the value,
and changes nothing (ARCHITECTURE.md invariant 10; issue 10, item 11).

On 884d081: ``free([id, True])`` freed block 1, ``KVSpace.set_limit(1.5)`` and
``set_limit(True)`` became a 1-byte limit, ints beyond int64 surfaced as
nanobind's ``TypeError`` with a signature dump, ``pool=123`` was an
``AttributeError``, ``KVPOOL_POOL_FRACTION=1e-30`` made a pool of capacity 0.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvpool import Geometry, InvalidBlocks, KVCacheManager, KVSpace, LedgerError, Pool, SharedMemory, map_shared
from kvpool.adapters.blocking import BlockingKVCacheManager

from .conftest import KiB, snapshot

G = Geometry(1, 2, 4 * KiB, 64, page_bytes=16 * KiB)  # 4 blocks a page, 16 pages
BIG = 2**63  # one past int64
HUGE = 2**64


def shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def state(space: KVSpace) -> tuple[object, ...]:
    lim = space.limit_setting() if space.pool is not None else None
    return (*snapshot(space), space.stats().limit_pages, lim, space.stats().allocs, space.stats().frees)


# ---------------------------------------------------------------- KVSpace

SPACE_CALLS: list[tuple[str, Callable[[KVSpace, Any], object], type[Exception], str]] = [
    ("free_bool", lambda s, ids: s.free([int(ids[0]), True]), InvalidBlocks, r"not bools: got \[True\]"),
    ("free_np_bool", lambda s, ids: s.free([int(ids[0]), np.True_]), InvalidBlocks, r"not bools"),
    ("free_float", lambda s, ids: s.free([int(ids[0]), 1.5]), InvalidBlocks, r"dtype float64"),
    ("free_beyond_int64", lambda s, ids: s.free([int(ids[0]), HUGE]), InvalidBlocks, str(HUGE)),
    ("free_str", lambda s, ids: s.free("12"), InvalidBlocks, r"sequence of ints, got '12'"),
    ("free_int", lambda s, ids: s.free(3), InvalidBlocks, r"sequence of ints, got 3"),
    ("alloc_beyond_int64", lambda s, ids: s.alloc(BIG), ValueError, str(BIG)),
    ("alloc_bool", lambda s, ids: s.alloc(True), ValueError, "got True"),
    ("set_limit_float", lambda s, ids: s.set_limit(1.5), ValueError, "limit_bytes must be an int, got 1.5"),
    ("set_limit_bool", lambda s, ids: s.set_limit(True), ValueError, "limit_bytes must be an int, got True"),
    ("set_limit_beyond_int64", lambda s, ids: s.set_limit(BIG), ValueError, str(BIG)),
    ("set_limit_negative", lambda s, ids: s.set_limit(-1), ValueError, ">= 0, got -1"),
    ("set_reserve_beyond_int64", lambda s, ids: s.set_reserve(0, BIG), ValueError, f"max_pages .* got {BIG}"),
    ("set_reserve_bool", lambda s, ids: s.set_reserve(True, 2), ValueError, "min_pages must be an int, got True"),
    ("set_reserve_float", lambda s, ids: s.set_reserve(0, 2.5), ValueError, "max_pages must be an int, got 2.5"),
    ("set_reserve_negative", lambda s, ids: s.set_reserve(-1, 2), ValueError, "min_pages must be >= 0, got -1"),
    ("page_occupancy_bool", lambda s, ids: s.page_occupancy([0, True]), ValueError, "not bools"),
    ("page_occupancy_float", lambda s, ids: s.page_occupancy([1.5]), ValueError, "page ids must be integers"),
    ("page_occupancy_beyond_int64", lambda s, ids: s.page_occupancy([HUGE]), ValueError, str(HUGE)),
    ("report_waiting_beyond_int32", lambda s, ids: s.report_waiting(2**31), ValueError, str(2**31)),
    ("report_waiting_bool", lambda s, ids: s.report_waiting(True), ValueError, "got True"),
    ("settle_str", lambda s, ids: s.settle("1"), ValueError, "timeout must be a number of seconds, got '1'"),
    ("settle_nan", lambda s, ids: s.settle(float("nan")), ValueError, "nan"),
    ("settle_inf", lambda s, ids: s.settle(float("inf")), ValueError, "finite"),
    ("wait_for_capacity_nan", lambda s, ids: s.wait_for_capacity(float("nan")), ValueError, "nan"),
    ("wait_for_capacity_bool", lambda s, ids: s.wait_for_capacity(True), ValueError, "got True"),
    ("region_bool", lambda s, ids: s.region(True), ValueError, "index must be an int, got True"),
    ("region_float", lambda s, ids: s.region(0.0), ValueError, "index must be an int, got 0.0"),
    ("view_bool_layer", lambda s, ids: s.view(True, 0, torch.float16, (2048,)), ValueError, "layer .* got True"),
    ("view_dtype", lambda s, ids: s.view(0, 0, "float16", (2048,)), TypeError, "'float16'"),
    ("view_negative_shape", lambda s, ids: s.view(0, 0, torch.float16, (-1, -2048)), ValueError, "got -1"),
]


@pytest.mark.parametrize("pooled", [False, True], ids=["private", "pooled"])
@pytest.mark.parametrize("call, error, named", [c[1:] for c in SPACE_CALLS], ids=[c[0] for c in SPACE_CALLS])
def test_bad_input_to_a_space_is_refused_by_name_and_changes_nothing(
    pooled: bool, call: Callable[[KVSpace, Any], object], error: type[Exception], named: str,
    make_space: Callable[..., KVSpace], pool_name: str,
) -> None:
    pool = Pool(pool_name, capacity=64 * G.page_commit_bytes) if pooled else None
    space = make_space(G, pool=pool, name="v")
    ids = space.alloc(4)
    before = state(space)
    with pytest.raises(error, match=named):
        call(space, ids)
    assert state(space) == before
    space.free(ids)  # and every id is still held exactly once


def test_free_takes_any_iterable_of_ints(make_space: Callable[..., KVSpace]) -> None:
    # The signature says Iterable[int]: a set or a generator is a batch too.
    space = make_space(G)
    ids = space.alloc(6)
    space.free({int(i) for i in ids[:3]})
    space.free(int(i) for i in ids[3:])
    assert space.stats().used_blocks == 0


CTOR_ARGS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("limit_float", dict(limit_bytes=1.5), ValueError, "limit_bytes must be an int, got 1.5"),
    ("limit_bool", dict(limit_bytes=True), ValueError, "limit_bytes must be an int, got True"),
    ("limit_beyond_int64", dict(limit_bytes=BIG), ValueError, str(BIG)),
    ("reserve_beyond_int64", dict(reserve=(0, BIG)), ValueError, f"reserve max .* got {BIG}"),
    ("reserve_bool", dict(reserve=(True, 2)), ValueError, "reserve min must be an int, got True"),
    ("reserve_float", dict(reserve=(0, 1.5)), ValueError, "reserve max must be an int, got 1.5"),
    ("reserve_not_a_pair", dict(reserve=5), ValueError, r"\(min, max\) pair of page counts, got 5"),
    ("null_block_str", dict(null_block="yes"), TypeError, "null_block must be True or False, got 'yes'"),
    ("reserve_thread_int", dict(reserve_thread=1), TypeError, "reserve_thread must be True or False, got 1"),
    ("pool_int", dict(pool=123), TypeError, "pool must be a kvpool.Pool, a pool name or None, got 123"),
    ("name_int", dict(name=123), TypeError, "name must be a str, got 123"),
    ("device_int", dict(device=0), TypeError, "device must be .* got 0"),
    ("device_bad_ordinal", dict(device="cuda:x"), ValueError, "got 'cuda:x'"),
]


@pytest.mark.parametrize("kind", ["space", "manager"])
@pytest.mark.parametrize("kw, error, named", [c[1:] for c in CTOR_ARGS], ids=[c[0] for c in CTOR_ARGS])
def test_bad_construction_arguments_are_refused_before_a_pool_is_touched(
    kind: str, kw: dict[str, Any], error: type[Exception], named: str, pool_name: str
) -> None:
    kw = {"pool": pool_name, "reserve_thread": False, **kw}  # a pool that does not exist yet
    before = shm()
    with pytest.raises(error, match=named):
        if kind == "space":
            KVSpace(G, **kw)
        else:
            KVCacheManager(G, **kw)
    assert shm() == before  # no ledger created


@pytest.mark.parametrize("bad", ["g", None, (1, 2, 4096, 64)])
def test_a_geometry_that_is_not_one_is_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match="geometry must be a kvpool.Geometry"):
        KVSpace(bad, pool=None)  # type: ignore[arg-type]


# --------------------------------------------------------- KVCacheManager

@pytest.fixture
async def manager() -> Any:
    async with KVCacheManager(G, pool=None, reserve=(0, 2), reserve_thread=False, name="v") as m:
        yield m


MANAGER_CALLS: list[tuple[str, Callable[[KVCacheManager, Any], Any], type[Exception], str]] = [
    ("alloc_beyond_int64", lambda m, ids: m.alloc(BIG), ValueError, str(BIG)),
    ("alloc_timeout_bool", lambda m, ids: m.alloc(1, timeout=True), ValueError, "timeout .* got True"),
    ("alloc_priority_float", lambda m, ids: m.alloc(1, priority=0.5), ValueError, "priority must be an int, got 0.5"),
    ("alloc_nowait_beyond_int64", lambda m, ids: m.alloc_nowait(BIG), ValueError, str(BIG)),
    ("reserve_bool", lambda m, ids: m.reserve(True), ValueError, "n must be an int, got True"),
    ("free_bool", lambda m, ids: m.free([int(ids[0]), True]), InvalidBlocks, r"not bools: got \[True\]"),
    ("set_limit_beyond_int64", lambda m, ids: m.set_limit(BIG), ValueError, str(BIG)),
    ("set_limit_float", lambda m, ids: m.set_limit(1.5), ValueError, "got 1.5"),
    ("set_limit_revision_bool", lambda m, ids: m.set_limit(4096, revision=True), ValueError, "revision .* got True"),
    ("set_limit_revision_beyond_int64", lambda m, ids: m.set_limit(4096, revision=BIG), ValueError, str(BIG)),
    ("available_priority_str", lambda m, ids: m.available(priority="0"), ValueError, "got '0'"),
]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("call, error, named", [c[1:] for c in MANAGER_CALLS], ids=[c[0] for c in MANAGER_CALLS])
async def test_bad_input_to_a_manager_is_refused_by_name_and_changes_nothing(
    anyio_backend: str, manager: KVCacheManager, call: Callable[[KVCacheManager, Any], Any],
    error: type[Exception], named: str,
) -> None:
    ids = await manager.alloc(4)
    before = (state(manager.space), manager.stats().limit_bytes, manager.stats().limit_revision, manager.waiting)
    with pytest.raises(error, match=named):
        result = call(manager, ids)
        if hasattr(result, "__await__"):
            await result
    assert (state(manager.space), manager.stats().limit_bytes, manager.stats().limit_revision,
            manager.waiting) == before
    manager.free(ids)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_reservation_takes_numpy_ints_and_refuses_bools(anyio_backend: str, manager: KVCacheManager) -> None:
    async with await manager.reserve(8) as r:
        assert len(r.take(np.int64(2))) == 2
        for bad, named in ((True, "got True"), (1.5, "got 1.5"), (BIG, str(BIG)), (-1, "got -1")):
            with pytest.raises(ValueError, match=named):
                r.take(bad)  # type: ignore[arg-type]
        assert r.remaining == 6


# ------------------------------------------------------------------- Pool

POOL_ARGS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("capacity_beyond_int64", dict(capacity=BIG, overcommit=True), ValueError, f"capacity .* got {BIG}"),
    ("capacity_bool", dict(capacity=True), ValueError, "capacity must be an int, got True"),
    ("capacity_float", dict(capacity=1.5e6), ValueError, "capacity must be an int, got 1500000.0"),
    ("capacity_zero", dict(capacity=0), ValueError, "capacity must be >= 1, got 0"),
    ("create_str", dict(capacity=1 << 20, create="yes"), TypeError, "create must be True or False, got 'yes'"),
    ("overcommit_int", dict(capacity=1 << 20, overcommit=1), TypeError, "overcommit must be True or False, got 1"),
    ("device_int", dict(capacity=1 << 20, device=1), TypeError, "device must be .* got 1"),
]


@pytest.mark.parametrize("kw, error, named", [c[1:] for c in POOL_ARGS], ids=[c[0] for c in POOL_ARGS])
def test_bad_pool_arguments_are_refused_before_the_ledger_is_created(
    kw: dict[str, Any], error: type[Exception], named: str, pool_name: str
) -> None:
    before = shm()
    with pytest.raises(error, match=named):
        Pool(pool_name, **kw)
    assert shm() == before


POOL_LIMITS: list[tuple[str, tuple[Any, ...], dict[str, Any], type[Exception], str]] = [
    ("limit_float", ("v", 1.5), {}, ValueError, "limit_bytes must be an int, got 1.5"),
    ("limit_bool", ("v", True), {}, ValueError, "limit_bytes must be an int, got True"),
    ("limit_beyond_int64", ("v", BIG), {}, ValueError, str(BIG)),
    ("tenant_int", (7, 4096), {}, TypeError, "tenant must be a str, got 7"),
    ("revision_bool", ("v", 4096), dict(revision=True), ValueError, "revision must be an int, got True"),
    ("revision_beyond_int64", ("v", 4096), dict(revision=BIG), ValueError, str(BIG)),
]


@pytest.mark.parametrize("args, kw, error, named", [c[1:] for c in POOL_LIMITS], ids=[c[0] for c in POOL_LIMITS])
def test_bad_pool_set_limit_is_refused_by_name_and_changes_nothing(
    args: tuple[Any, ...], kw: dict[str, Any], error: type[Exception], named: str, pool_name: str,
    make_space: Callable[..., KVSpace],
) -> None:
    pool = Pool(pool_name, capacity=64 * G.page_commit_bytes)
    space = make_space(G, pool=pool, name="v")
    space.alloc(4)
    before = (state(space), pool.tenants())
    with pytest.raises(error, match=named):
        pool.set_limit(*args, **kw)
    assert (state(space), pool.tenants()) == before


@pytest.mark.parametrize(
    "fraction, named",
    [("1e-30", r"KVPOOL_POOL_FRACTION 1e-30 x MemAvailable [\d.]+ [KMGT]iB \(\d+ bytes\) = 0 B"), ("abc", "got 'abc'"),
     ("nan", "got 'nan'"), ("0", "got '0'"), ("1.5", "got '1.5'")],
)
def test_a_pool_fraction_that_leaves_nothing_is_refused(
    fraction: str, named: str, pool_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPOOL_POOL_FRACTION", fraction)
    monkeypatch.setenv("KVPOOL_CGROUP", "/nonexistent")  # MemAvailable alone, whatever this host's cgroup
    before = shm()
    with pytest.raises(LedgerError, match=named):
        Pool(pool_name)
    assert shm() == before


# --------------------------------------------------------- blocking adapter

def test_the_blocking_adapter_forwards_the_same_refusals() -> None:
    with BlockingKVCacheManager(G, pool=None, reserve_thread=False, reserve=(0, 0)) as b:
        ids = b.alloc(4)
        before = state(b.manager.space)
        for call, error, named in (
            (lambda: b.alloc(BIG), ValueError, str(BIG)),
            (lambda: b.alloc(1, timeout=True), ValueError, "got True"),
            (lambda: b.alloc_nowait(True), ValueError, "got True"),
            (lambda: b.free([int(ids[0]), True]), InvalidBlocks, "not bools"),
        ):
            with pytest.raises(error, match=named):
                call()
        assert state(b.manager.space) == before


@pytest.mark.parametrize("backend, error", [("nope", ValueError), (5, TypeError)])
def test_the_blocking_adapter_names_a_bad_backend(backend: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=f"backend must be 'asyncio' or 'trio', got {backend!r}"):
        BlockingKVCacheManager(G, backend=backend, pool=None)  # type: ignore[arg-type]


def test_a_thread_the_os_refuses_is_a_backend_error_with_its_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    # std::thread throws std::system_error when a pids cgroup or RLIMIT_NPROC
    # refuses a thread; nanobind passed it on as a bare RuntimeError.
    import kvpool._core as core
    from kvpool import BackendError

    def refuse(*args: object) -> object:
        raise RuntimeError("Resource temporarily unavailable")

    monkeypatch.setattr(core.native, "create_space", refuse)
    with pytest.raises(BackendError, match=r"cannot start its threads \(Resource temporarily unavailable\)"):
        KVSpace(G, pool=None)


@pytest.mark.parametrize(
    "bad, error, named",
    [("x", TypeError, "got 'x'"), (SharedMemory(pid="1", fd=3, size=10), ValueError, "SharedMemory.pid"),  # type: ignore[arg-type]
     (SharedMemory(pid=1, fd=True, size=10), ValueError, "SharedMemory.fd must be an int, got True"),
     (SharedMemory(pid=2**70, fd=3, size=10), ValueError, str(2**70))],
)
def test_map_shared_refuses_what_is_not_a_space_handle(bad: object, error: type[Exception], named: str) -> None:
    with pytest.raises(error, match=named):
        map_shared(bad)  # type: ignore[arg-type]
