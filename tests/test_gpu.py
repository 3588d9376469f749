"""Real-device checks of the CUDA backend (marker `gpu`; run by scripts/gpu_check.sh).

They skip unless KVPOOL_REAL_CUDA=1, a real driver loads, and torch has
CUDA; scripts/gpu_check.sh counts a skip as a failure. Every figure the
commit/release benchmark measures goes to $KVPOOL_GPU_OUT/gpu-bench.json;
nothing here asserts on time.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import kvpool
from kvpool import Geometry, KVSpace, Pool

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture(autouse=True)
def real_cuda() -> None:
    if os.environ.get("KVPOOL_REAL_CUDA") != "1":
        pytest.skip("set KVPOOL_REAL_CUDA=1 on a GPU machine (scripts/gpu_check.sh)")
    if kvpool.cuda_unavailable_reason():
        pytest.skip(kvpool.cuda_unavailable_reason())
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")


def _driver_free() -> int:
    """Free device bytes per cuMemGetInfo (not torch's caching allocator)."""
    torch.cuda.synchronize()
    mem = kvpool._core.native.cuda_mem_info(torch.cuda.current_device())
    assert mem.code == 0, mem.message
    return int(mem.free_bytes)


@pytest.fixture
def pool() -> Iterator[Pool]:
    name = f"gpu-check-{os.getpid()}"
    p = Pool(name, capacity=8 << 30, device="cuda:0")
    yield p
    Pool.remove(name)


def test_every_region_of_several_pages_reads_back_its_own_pattern(pool: Pool) -> None:
    # 8 regions x 2 MiB pages; blocks of 256 KiB: 8 a page. Written from a
    # thread that never touched CUDA, with the reserve thread committing on
    # its own thread: both must have a context (issue 15 item 2).
    g = Geometry(4, 2, 256 * 1024, 512, page_bytes=2 * MiB)
    with KVSpace(g, device="cuda:0", pool=pool, name="pattern", reserve_thread=True, reserve=(2, 4)) as s:
        got: list[object] = []
        t = threading.Thread(target=lambda: got.append(s.alloc(8 * 6)))  # 6 pages
        t.start()
        t.join()
        ids = torch.from_numpy(got[0]).cuda()  # type: ignore[arg-type]
        assert pool.committed >= 6 * g.page_commit_bytes
        views = [s.region(r)[: g.blocks * g.block_bytes].view(g.blocks, g.block_bytes) for r in range(g.num_regions)]
        for r, v in enumerate(views):
            # A different byte per (region, block): aliasing or a lost page shows.
            pattern = ((ids * 7 + r * 31) % 251 + 1).to(torch.uint8).unsqueeze(1)
            v[ids] = pattern.expand(-1, g.block_bytes)
        torch.cuda.synchronize()
        for r, v in enumerate(views):
            pattern = ((ids * 7 + r * 31) % 251 + 1).to(torch.uint8)
            assert torch.equal(v[ids][:, 0], pattern) and torch.equal(v[ids][:, -1], pattern)
            assert int(v[ids].to(torch.int64).sum()) == int(pattern.to(torch.int64).sum()) * g.block_bytes
        # Blocks on uncommitted pages read zeros (the zeroed zero page).
        free_ids = sorted(set(range(g.blocks)) - set(ids.tolist()))[-8:]
        assert int(views[3][torch.tensor(free_ids, device="cuda")].to(torch.int64).sum()) == 0
        s.free(got[0])  # type: ignore[arg-type]
        assert s.settle(30.0)


def test_fresh_pages_read_zero_after_another_tenants_data(pool: Pool) -> None:
    g = Geometry(2, 2, 2 * MiB, 64, page_bytes=2 * MiB)
    with KVSpace(g, device="cuda:0", pool=pool, name="a", reserve_thread=False, reserve=(0, 0)) as a:
        ids = a.alloc(64)
        for r in range(g.num_regions):
            a.region(r).fill_(0xEE)
        torch.cuda.synchronize()
        a.free(ids)  # released: the memory goes back to the driver
    with KVSpace(g, device="cuda:0", pool=pool, name="b", reserve_thread=False, reserve=(0, 0)) as b:
        b.alloc(64)  # very likely the same physical memory
        for r in range(g.num_regions):
            assert int(b.region(r).to(torch.int64).sum()) == 0


def test_released_memory_returns_to_the_device_after_free_and_after_close() -> None:
    g = Geometry(8, 2, 1 * MiB, 256, page_bytes=2 * MiB)
    before = _driver_free()
    s = KVSpace(g, device="cuda:0", reserve_thread=False, reserve=(0, 0))
    ids = s.alloc(128)  # 64 pages x 16 regions x 2 MiB = 2 GiB
    assert before - _driver_free() >= 0.95 * s.allocated_bytes()
    s.free(ids)
    assert _driver_free() >= before - 64 * MiB  # the zero page and driver slack stay
    s.alloc(128)
    s.close()
    assert _driver_free() >= before - 64 * MiB


def test_a_kernel_still_reading_a_page_is_fenced_before_its_release() -> None:
    # Issue 15 item 4: release() unmapped while kernels could still read the
    # page; without the fence this is error 700 and the context is lost.
    g = Geometry(1, 1, 2 * MiB, 16, page_bytes=2 * MiB)
    with KVSpace(g, device="cuda:0", reserve_thread=False, reserve=(0, 0)) as s:
        ids = s.alloc(4)
        t = s.region(0)
        torch.cuda._sleep(200_000_000)  # keep the stream busy, then read the pages
        total = t[: 4 * 2 * MiB].to(torch.int64).sum()
        s.free(ids)  # releases inline: must wait for the read above
        torch.cuda.synchronize()
        assert int(total) == 0


def test_a_mirrored_space_maps_every_rank_in_its_own_process(pool: Pool) -> None:
    # Issue 11 item 5, the multi-rank CUDA path (kvpool.ranks): this process
    # is the engine core (commits, books), each rank a process of its own
    # that maps the pages on its GPU (rank r on GPU r mod the device count).
    from .test_mirror import Rank

    g = Geometry(4, 2, 256 * 1024, 256, page_bytes=2 * MiB)  # 8 regions, 4 a rank; 8 blocks a page
    per_rank = 4 * g.region_bytes
    n = torch.cuda.device_count()
    with KVSpace(g, device="cuda:0", pool=pool, name="mirrored", ranks=[4, 4], reserve_thread=False,
                 reserve=(0, 0), idle_release_s=0) as s:
        ranks = [Rank(s.rank_handle(), r, f"cuda:{r % n}") for r in range(2)]
        try:
            assert all(r.hello.get("ok") for r in ranks), [r.hello for r in ranks]
            ids = s.alloc(16)  # 2 pages, mapped on both ranks before alloc returns
            assert [r.call("stats")["committed_pages"] for r in ranks] == [2, 2]
            assert s.allocated_bytes() == pool.committed == 2 * g.page_commit_bytes
            for i, r in enumerate(ranks):  # each rank's own copy of region 0's two pages
                assert r.call("fill", offset=0, length=2 * g.page_bytes, value=i + 1)["ok"]
            for i, r in enumerate(ranks):
                assert r.call("read", offset=0, length=2 * g.page_bytes)["values"] == [i + 1]
                assert r.call("read", offset=per_rank - g.region_bytes, length=2 * g.page_bytes)["values"] == [0]
            s.free(ids)
            assert [r.call("stats")["committed_pages"] for r in ranks] == [0, 0]
            ids = s.alloc(8)  # committed again: zeros, on every rank
            for r in ranks:
                assert r.call("read", offset=0, length=g.page_bytes)["values"] == [0]
            s.free(ids)
        finally:
            for r in ranks:
                r.stop()


@pytest.mark.parametrize("where", ["never committed", "released"])
def test_a_stray_write_to_an_unmapped_page_is_an_illegal_memory_access(tmp_path, where: str) -> None:  # type: ignore[no-untyped-def]
    code = textwrap.dedent(
        f"""
        import torch, kvpool
        g = kvpool.Geometry(1, 1, 2 << 20, 16, page_bytes=2 << 20)
        s = kvpool.KVSpace(g, device="cuda:0", reserve_thread=False, reserve=(0, 0))
        t = s.region(0)
        if {where == "released"!r}:
            ids = s.alloc(3)
            t[5 << 20] = 7
            s.free(ids)
        assert int(t[5 << 20].item()) == 0      # reads the zeroed, read-only zero page
        print("read ok", flush=True)
        t[5 << 20] = 1                           # stray write: must fault
        torch.cuda.synchronize()
        print("no fault", flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert "read ok" in out.stdout and "no fault" not in out.stdout, out.stdout + out.stderr
    assert "illegal memory access" in out.stderr, out.stderr[-2000:]


# --- cost: kvpool's commit/release per page against the raw driver calls ----

class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Loc),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", ctypes.c_ubyte * 8)]


class _Access(ctypes.Structure):
    _fields_ = [("location", _Loc), ("flags", ctypes.c_int)]


def _raw_cost(pages: int, regions: int, page_bytes: int) -> dict[str, float]:
    """The same recipe as the backend, by hand: per region cuMemCreate + cuMemMap
    (offset 0) + cuMemSetAccess + a zero fill, one stream sync per page; release
    = context sync + cuMemUnmap + cuMemRelease per region."""
    cu = ctypes.CDLL("libcuda.so.1")
    torch.cuda.init()
    torch.cuda.synchronize()  # torch's primary context is current on this thread
    dev = torch.cuda.current_device()
    u64, sz = ctypes.c_uint64, ctypes.c_size_t
    prop = _Prop()
    prop.type, prop.location = 1, _Loc(1, dev)
    acc = _Access(_Loc(1, dev), 3)
    va = u64()
    total = regions * pages * page_bytes
    assert cu.cuMemAddressReserve(ctypes.byref(va), sz(total), sz(page_bytes), u64(0), ctypes.c_ulonglong(0)) == 0
    stream = ctypes.c_void_p()
    assert cu.cuStreamCreate(ctypes.byref(stream), 1) == 0
    handles: list[list[ctypes.c_uint64]] = []
    t0 = time.perf_counter()
    for p in range(pages):
        hs = []
        for r in range(regions):
            h = u64()
            a = u64(va.value + (r * pages + p) * page_bytes)
            assert cu.cuMemCreate(ctypes.byref(h), sz(page_bytes), ctypes.byref(prop), ctypes.c_ulonglong(0)) == 0
            assert cu.cuMemMap(a, sz(page_bytes), sz(0), h, ctypes.c_ulonglong(0)) == 0
            assert cu.cuMemSetAccess(a, sz(page_bytes), ctypes.byref(acc), sz(1)) == 0
            assert cu.cuMemsetD8Async(a, ctypes.c_ubyte(0), sz(page_bytes), stream) == 0
            hs.append(h)
        assert cu.cuStreamSynchronize(stream) == 0
        handles.append(hs)
    t1 = time.perf_counter()
    for p, hs in enumerate(handles):
        assert cu.cuCtxSynchronize() == 0
        for r, h in enumerate(hs):
            assert cu.cuMemUnmap(u64(va.value + (r * pages + p) * page_bytes), sz(page_bytes)) == 0
            assert cu.cuMemRelease(h) == 0
    t2 = time.perf_counter()
    cu.cuStreamDestroy_v2(stream)
    assert cu.cuMemAddressFree(va, sz(total)) == 0
    return {"raw_commit_us": (t1 - t0) / pages * 1e6, "raw_release_us": (t2 - t1) / pages * 1e6}


def test_commit_and_release_cost_per_page_against_raw_driver_calls() -> None:
    pages, page_bytes = 200, 2 * MiB
    g = Geometry(8, 2, 256 * 1024, 8 * pages, page_bytes=page_bytes)  # 16 regions, 8 blocks a page
    per_page = len(g.block_range(0))
    free0 = _driver_free()
    t_open = time.perf_counter()
    with KVSpace(g, device="cuda:0", reserve_thread=False, reserve=(0, 0)) as s:
        t0 = time.perf_counter()
        held = [s.alloc(per_page) for _ in range(pages)]  # one inline commit each
        t1 = time.perf_counter()
        for ids in held:
            s.free(ids)  # one inline release each
        t2 = time.perf_counter()
    t3 = time.perf_counter()
    res = {
        "device": torch.cuda.get_device_name(), "driver_free_bytes_at_start": free0,
        "pages": pages, "regions": g.num_regions, "page_bytes": page_bytes,
        "kvpool_open_ms": (t0 - t_open) * 1e3, "kvpool_close_ms": (t3 - t2) * 1e3,
        "kvpool_commit_us": (t1 - t0) / pages * 1e6, "kvpool_release_us": (t2 - t1) / pages * 1e6,
    }
    res.update(_raw_cost(pages, g.num_regions, page_bytes))
    res["commit_ratio"] = res["kvpool_commit_us"] / res["raw_commit_us"]
    res["release_ratio"] = res["kvpool_release_us"] / res["raw_release_us"]
    print(json.dumps(res, indent=1))
    out = os.environ.get("KVPOOL_GPU_OUT")
    if out:
        with open(os.path.join(out, "gpu-bench.json"), "w") as f:
            json.dump(res, f, indent=1)
    assert _driver_free() >= free0 - 64 * MiB  # everything went back
