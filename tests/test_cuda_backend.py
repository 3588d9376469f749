"""The CUDA backend against a fake driver (host memory behind the VMM entry points).

What cannot exist here is only the device: the backend's driver loading,
sliced commits, zero-page backing, error values and rollbacks all run for
real through tests/fake_cuda/fake_libcuda.c, loaded as libcuda.so.1.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

import kvpool
from kvpool import BackendError, Geometry, GeometryError, KVSpace, Pool, PoolExhausted

from .conftest import FAKE_GRANULARITY, KiB, snapshot

G = Geometry(2, 2, 4 * KiB, 64, page_bytes=16 * KiB)  # R = 4, 4 blocks a page
PAGE_COMMIT = G.page_commit_bytes
OOM, INVALID = 2, 1  # CUresult codes


@pytest.fixture
def fake(fake_cuda_driver: str | None) -> ctypes.CDLL:
    if fake_cuda_driver is None:
        pytest.skip("no C compiler to build the fake driver")
    lib = ctypes.CDLL(fake_cuda_driver)  # the same handle kvpool dlopen()s
    lib.fake_cuda_allocated.restype = ctypes.c_size_t
    lib.fake_cuda_live_handles.restype = ctypes.c_size_t
    lib.fake_cuda_fail(b"none", 0, 0)
    return lib


@pytest.fixture
def space(fake: ctypes.CDLL) -> Iterator[KVSpace]:
    s = KVSpace(G, device="cuda:0", reserve_thread=False, reserve=(0, 0))
    yield s
    s.close()
    assert fake.fake_cuda_live_handles() == 0 and fake.fake_cuda_allocated() == 0, "the backend leaked"


def driver_bytes(fake: ctypes.CDLL) -> int:
    """Physical bytes held for pages (the fake's total minus the shared zero page)."""
    return int(fake.fake_cuda_allocated()) - FAKE_GRANULARITY


def test_import_without_a_driver_reports_why_and_cuda_raises_clearly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {k: v for k, v in os.environ.items() if k != "KVPOOL_LIBCUDA"}
    env["LD_LIBRARY_PATH"] = str(tmp_path)  # nowhere with a libcuda
    code = (
        "import kvpool\n"
        "print(kvpool.cuda_unavailable_reason())\n"
        "try:\n"
        "    kvpool.KVSpace(kvpool.Geometry(1, 1, 4096, 8), device='cuda')\n"
        "except kvpool.BackendError as e:\n"
        "    print('raised:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         check=True)
    assert "cannot load the CUDA driver" in out.stdout and "libcuda.so.1" in out.stdout
    assert "raised: cannot create KV space on cuda:0: cannot load the CUDA driver" in out.stdout


def test_commit_is_one_allocation_mapped_in_slices_and_release_frees_it(space: KVSpace, fake: ctypes.CDLL) -> None:
    assert kvpool.cuda_unavailable_reason() == ""
    assert driver_bytes(fake) == 0
    ids = space.alloc(12)  # 3 pages
    assert space.allocated_bytes() == driver_bytes(fake) == 3 * PAGE_COMMIT
    assert fake.fake_cuda_live_handles() == 1 + 3  # zero page + one allocation per page
    space.free(ids)
    assert driver_bytes(fake) == 0 and fake.fake_cuda_live_handles() == 1


def region_address(space: KVSpace, r: int | None) -> int:
    """Data pointer of region r's DLPack capsule, or of all regions' (None);
    torch here has no CUDA to wrap it."""

    class DLDevice(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]

    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice)]

    capsule = space._space.memory() if r is None else space._space.region(r)
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    tensor = ctypes.cast(get(capsule, b"dltensor"), ctypes.POINTER(DLTensor)).contents
    assert (tensor.device.device_type, tensor.device.device_id) == (2, 0)  # kDLCUDA, device 0
    return int(tensor.data)


def test_writes_land_padding_reads_zeros_and_a_recommitted_page_is_fresh(space: KVSpace) -> None:
    ids = space.alloc(4).tolist()  # page 0 of every region
    addr = [region_address(space, r) for r in range(G.num_regions)]
    assert addr[1] - addr[0] == G.region_bytes
    for r, a in enumerate(addr):
        ctypes.memset(a, r + 1, G.page_bytes)
        assert ctypes.string_at(a, 8) == bytes([r + 1]) * 8
    assert ctypes.string_at(addr[0] + G.page_bytes, 16) == bytes(16)  # page 1: the read-only zero page
    space.free(ids)
    space.alloc(4)
    assert ctypes.string_at(addr[2], 64) == bytes(64)  # fresh allocation: no old KV data


@pytest.mark.parametrize(
    "call, nth, code, error",
    [("cuMemCreate", 2, OOM, PoolExhausted), ("cuMemCreate", 1, INVALID, BackendError),
     ("cuMemMap", 3, INVALID, BackendError), ("cuMemSetAccess", 2, INVALID, BackendError)],
)
def test_every_driver_failure_is_a_value_and_rolls_back(
    space: KVSpace, fake: ctypes.CDLL, call: str, nth: int, code: int, error: type[Exception]
) -> None:
    held = space.alloc(6).tolist()  # pre-existing partial page must survive
    before, drv = snapshot(space), driver_bytes(fake)
    fake.fake_cuda_fail(call.encode(), nth, code)
    with pytest.raises(error, match="fake"):
        space.alloc(4 * 3)
    assert snapshot(space) == before and driver_bytes(fake) == drv
    fake.fake_cuda_fail(b"none", 0, 0)
    assert len(space.alloc(4 * 3)) == 12
    space.free(held)


def test_out_of_memory_returns_the_pool_claim(fake: ctypes.CDLL) -> None:
    name = f"test-cuda-{os.getpid()}"
    pool = Pool(name, capacity=16 * PAGE_COMMIT)
    try:
        with KVSpace(G, device="cuda", pool=pool, name="gpu", reserve_thread=False, reserve=(0, 0)) as s:
            fake.fake_cuda_fail(b"cuMemCreate", 1, OOM)
            with pytest.raises(PoolExhausted):
                s.alloc(8)
            assert pool.committed == 0  # the claim came back
            s.alloc(8)
            assert pool.committed == 2 * PAGE_COMMIT == driver_bytes(fake)
    finally:
        Pool.remove(name)


def test_page_size_must_be_a_multiple_of_the_driver_granularity(fake: ctypes.CDLL) -> None:
    os.environ["FAKE_CUDA_GRANULARITY"] = str(32 * KiB)
    try:
        with pytest.raises(GeometryError, match=r"not a multiple of the CUDA granularity \(32768\)"):
            KVSpace(G, device="cuda:0")
        # ... and names the fix (the page size rounded up to the granularity).
        with pytest.raises(GeometryError, match=r"\(32768\); use page_bytes=32768$"):
            KVSpace(G, device="cuda:0")
    finally:
        os.environ["FAKE_CUDA_GRANULARITY"] = str(FAKE_GRANULARITY)
    assert fake.fake_cuda_live_handles() == 0


def test_unknown_device_strings_are_rejected() -> None:
    for bad in ("gpu", "cuda:x", "cuda1"):
        with pytest.raises(ValueError, match="device must be"):
            KVSpace(G, device=bad)


def test_a_pool_created_for_a_cuda_space_defaults_to_the_device_free_memory(fake: ctypes.CDLL) -> None:
    name = f"test-cuda-cap-{os.getpid()}"
    os.environ["FAKE_CUDA_TOTAL"] = str(512 * 1024 * 1024)
    try:
        with KVSpace(G, device="cuda:0", pool=name, name="gpu", reserve_thread=False) as s:
            assert s.pool is not None and s.pool.capacity == 256 * 1024 * 1024  # half of the free bytes
    finally:
        os.environ.pop("FAKE_CUDA_TOTAL")
        Pool.remove(name)


def test_a_cuda_space_is_one_flat_memory_but_cannot_be_mapped_elsewhere(space: KVSpace) -> None:
    from kvpool import BackendError

    base = region_address(space, None)
    assert [region_address(space, r) for r in range(G.num_regions)] == [
        base + r * G.region_bytes for r in range(G.num_regions)]
    with pytest.raises(BackendError, match="only CPU spaces"):
        space.shared_memory()


def test_a_failed_unmap_in_release_maps_the_done_regions_back(space: KVSpace, fake: ctypes.CDLL) -> None:
    # Bug: when a region's unmap failed at region > 0, the earlier regions were
    # left on the read-only zero page while the page stayed committed (RESERVE):
    # its data was gone from view and a write to it faulted.
    ids = space.alloc(4)  # page 0 of every region
    addr = [region_address(space, r) for r in range(G.num_regions)]
    for r, a in enumerate(addr):
        ctypes.memset(a, r + 1, 16)
    fake.fake_cuda_fail(b"cuMemUnmap", 3, INVALID)  # release: regions 0, 1 unmap, region 2 fails
    space.free(ids)  # no reserve kept: the emptied page is released inline, and that fails
    st = space.stats()
    assert (st.pages_reserve, st.release_failures) == (1, 1)  # still committed, kept as idle reserve
    assert "cuMemUnmap" in st.last_error
    assert space.allocated_bytes() == driver_bytes(fake) == PAGE_COMMIT
    for r, a in enumerate(addr):  # every region sees its memory again, readable and writable
        assert ctypes.string_at(a, 16) == bytes([r + 1]) * 16
        ctypes.memset(a, 0, 16)  # would fault on the read-only zero page
    assert space.trim() == 1
    assert driver_bytes(fake) == 0
