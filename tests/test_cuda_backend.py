"""The CUDA backend against a strict fake driver (host memory behind the VMM entry points).

What cannot exist here is only the device: the backend's driver loading,
commits, zero-page backing, error values and rollbacks all run for real
through tests/fake_cuda/fake_libcuda.c, loaded as libcuda.so.1. The fake
enforces the real driver's rules (see its header) and counts every breach as
a violation; every test here ends by asserting there was none. Each test runs
in both offset modes: offsets allowed (the start-up probe proves them, one
allocation per page in R slices) and FAKE_CUDA_MAP_OFFSET_ZERO=1 (cuda.h's
"currently must be zero": one allocation per region per page).
"""

from __future__ import annotations

import ctypes
import gc
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

import kvpool
from kvpool import BackendError, Geometry, GeometryError, KVSpace, Pool, PoolExhausted

from .conftest import FAKE_GRANULARITY, KiB, snapshot
from .test_memory import backend_harness  # noqa: F401 - the fixture

G = Geometry(2, 2, 4 * KiB, 64, page_bytes=16 * KiB)  # R = 4, 4 blocks a page
R = G.num_regions
PAGE_COMMIT = G.page_commit_bytes
OOM, INVALID = 2, 1  # CUresult codes
FRESH = 0xA5  # what the fake's fresh allocations hold (never zeros)


@pytest.fixture(autouse=True, params=["offsets-probed", "offset-zero"])
def offset_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "offset-zero":
        os.environ["FAKE_CUDA_MAP_OFFSET_ZERO"] = "1"
    yield request.param
    os.environ.pop("FAKE_CUDA_MAP_OFFSET_ZERO", None)


@pytest.fixture
def fake(fake_cuda_driver: str | None) -> Iterator[ctypes.CDLL]:
    if fake_cuda_driver is None:
        pytest.skip("no C compiler to build the fake driver")
    lib = ctypes.CDLL(fake_cuda_driver)  # the same handle kvpool dlopen()s
    for name in ("fake_cuda_allocated", "fake_cuda_live_handles", "fake_cuda_mappings"):
        getattr(lib, name).restype = ctypes.c_size_t
    lib.fake_cuda_violations.restype = ctypes.c_long
    lib.fake_cuda_calls.restype = ctypes.c_long
    lib.fake_cuda_violation_text.restype = ctypes.c_char_p
    lib.fake_cuda_fail(b"none", 0, 0)
    lib.fake_cuda_reset_violations()
    yield lib
    lib.fake_cuda_fail(b"none", 0, 0)
    assert lib.fake_cuda_violations() == 0, lib.fake_cuda_violation_text().decode()


def per_page_handles(mode: str) -> int:
    return 1 if mode == "offsets-probed" else R


@pytest.fixture
def space(fake: ctypes.CDLL) -> Iterator[KVSpace]:
    s = KVSpace(G, device="cuda:0", reserve_thread=False, reserve=(0, 0))
    yield s
    s.close()
    # Every page's memory is back; only the device's zero granule stays while
    # a space object lives (stale tensors keep reading it).
    assert fake.fake_cuda_live_handles() == 1 and driver_bytes(fake) == 0, "the backend leaked"


def driver_bytes(fake: ctypes.CDLL) -> int:
    """Physical bytes held for pages (the fake's total minus the device's shared zero granule)."""
    return int(fake.fake_cuda_allocated()) - FAKE_GRANULARITY


def region_address(space: KVSpace, r: int | None, device: int = 0) -> int:
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
    assert (tensor.device.device_type, tensor.device.device_id) == (2, device)  # kDLCUDA, the ordinal
    return int(tensor.data)


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


def test_commit_maps_at_offset_zero_unless_the_probe_proved_offsets(
    space: KVSpace, fake: ctypes.CDLL, offset_mode: str
) -> None:
    # Issue 15 item 1: the old backend mapped one R x P allocation at offsets
    # r x P; a driver that enforces "offset must be zero" failed every commit.
    assert kvpool.cuda_unavailable_reason() == ""
    assert driver_bytes(fake) == 0
    ids = space.alloc(12)  # 3 pages
    assert space.allocated_bytes() == driver_bytes(fake) == 3 * PAGE_COMMIT
    assert fake.fake_cuda_live_handles() == 1 + 3 * per_page_handles(offset_mode)  # + the zero page
    addr = [region_address(space, r) for r in range(R)]
    for r, a in enumerate(addr):  # regions never alias, whichever way they were mapped
        ctypes.memset(a, r + 1, G.page_bytes)
    for r, a in enumerate(addr):
        assert ctypes.string_at(a, G.page_bytes) == bytes([r + 1]) * G.page_bytes
    space.free(ids)
    assert driver_bytes(fake) == 0 and fake.fake_cuda_live_handles() == 1


def test_a_driver_that_ignores_offsets_is_caught_by_the_probe(fake: ctypes.CDLL, offset_mode: str) -> None:
    # With offsets silently treated as 0, sliced regions of one allocation alias:
    # region 1's writes would land in region 0. The probe must see it.
    os.environ["FAKE_CUDA_MAP_OFFSET_IGNORED"] = "1"
    try:
        with KVSpace(G, device="cuda:0", reserve_thread=False, reserve=(0, 0)) as s:
            s.alloc(4)
            assert fake.fake_cuda_live_handles() == 1 + R  # one allocation per region
            addr = [region_address(s, r) for r in range(R)]
            for r, a in enumerate(addr):
                ctypes.memset(a, r + 1, 64)
            assert [ctypes.string_at(a, 1)[0] for a in addr] == list(range(1, R + 1))
    finally:
        os.environ.pop("FAKE_CUDA_MAP_OFFSET_IGNORED")


def _primary(fake: ctypes.CDLL, ordinal: int) -> ctypes.c_void_p:
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    assert fake.cuDeviceGet(ctypes.byref(dev), ordinal) == 0
    assert fake.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    return ctx


def _current(fake: ctypes.CDLL) -> int | None:
    ctx = ctypes.c_void_p()
    assert fake.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return ctx.value


def test_every_thread_calls_the_driver_in_a_context_and_the_callers_is_restored(fake: ctypes.CDLL) -> None:
    # Issue 15 item 2: only open() made a context current, on the creating
    # thread (and left it current); the reserve thread, other Python threads
    # and close() called the driver with none.
    assert kvpool.cuda_unavailable_reason() == ""  # driver loaded and initialised
    mine = _primary(fake, 1)  # this thread works on device 1, as torch would
    assert fake.cuCtxSetCurrent(mine) == 0
    try:
        s = KVSpace(G, device="cuda:0", reserve_thread=True, reserve=(1, 2))
        assert _current(fake) == mine.value
        errors: list[BaseException] = []

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(30):
                    held = s.alloc(rng.randint(1, 8))
                    s.free(held)
                assert _current(fake) is None  # a fresh thread: nothing was left current
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert s.settle(30.0)
        threading.Thread(target=s.close).start()  # close from another thread, too
        while not s.closed:
            pass
        assert _current(fake) == mine.value
        del s
        gc.collect()
    finally:
        fake.cuCtxSetCurrent(None)
        dev = ctypes.c_int()
        fake.cuDeviceGet(ctypes.byref(dev), 1)
        fake.cuDevicePrimaryCtxRelease(dev)


def test_the_retained_primary_context_is_released(fake: ctypes.CDLL) -> None:
    assert fake.fake_cuda_primary_refs(0) == 0
    s = KVSpace(G, device="cuda:0", reserve_thread=False, reserve=(0, 0))
    s.alloc(4)
    assert fake.fake_cuda_primary_refs(0) == 1
    s.close()
    del s
    gc.collect()
    # The space object is gone: every handle, mapping and reservation with it.
    assert fake.fake_cuda_primary_refs(0) == 0
    assert fake.fake_cuda_live_handles() == 0 and fake.fake_cuda_allocated() == 0 and fake.fake_cuda_mappings() == 0
    mem = kvpool._core.native.cuda_mem_info(0)
    assert mem.code == 0 and mem.free_bytes == mem.total_bytes
    assert fake.fake_cuda_primary_refs(0) == 0 and _current(fake) is None


def test_padding_and_fresh_pages_read_zeros_though_the_driver_gives_dirty_memory(space: KVSpace) -> None:
    # Issue 15 item 3: the zero page was never zeroed and fresh allocations
    # were handed out as the driver left them (the fake: 0xA5).
    base = region_address(space, None)
    assert ctypes.string_at(base, 64) == bytes(64)  # uncommitted: the zero page
    ids = space.alloc(4).tolist()  # page 0 of every region
    for r in range(R):
        a = region_address(space, r)
        assert ctypes.string_at(a, G.page_bytes) == bytes(G.page_bytes)
        assert ctypes.string_at(a + G.page_bytes, 16) == bytes(16)  # page 1: still the zero page
        ctypes.memset(a, 0x77, G.page_bytes)  # a tenant's KV data
    space.free(ids)
    space.alloc(4)
    for r in range(R):  # fresh memory again, zeroed: no KV data crosses tenants
        assert ctypes.string_at(region_address(space, r), G.page_bytes) == bytes(G.page_bytes)


def test_release_and_close_fence_kernels_before_unmapping(space: KVSpace, fake: ctypes.CDLL) -> None:
    # Issue 15 item 4: an unmap while kernels may still read the page is error
    # 700 on a real device; the fake counts it as a violation.
    ids = space.alloc(8)
    fake.fake_cuda_launch()
    space.free(ids[:4])  # page emptied and released inline
    assert fake.fake_cuda_violations() == 0, fake.fake_cuda_violation_text().decode()
    fake.fake_cuda_launch()
    space.close()


def test_open_sets_access_once_over_the_whole_reservation(fake: ctypes.CDLL) -> None:
    # Issue 15 item 6: one cuMemSetAccess per granule at open (~112k driver
    # calls for a 110 GB space); one call over the mapped reservation is legal.
    big = Geometry(4, 2, 4 * KiB, 4 * 64, page_bytes=16 * KiB)  # 8 regions x 64 pages
    before = fake.fake_cuda_calls(b"cuMemSetAccess")
    with KVSpace(big, device="cuda:0", reserve_thread=False, reserve=(0, 0)):
        # zero page read-write to zero-fill it, the reservation read-only, and
        # (offsets mode) the probe's one
        assert fake.fake_cuda_calls(b"cuMemSetAccess") - before <= 3


@pytest.mark.parametrize(
    "call, nth, code, error",
    [("cuMemCreate", 2, OOM, PoolExhausted), ("cuMemCreate", 1, INVALID, BackendError),
     ("cuMemMap", 3, INVALID, BackendError), ("cuMemMap", 2, OOM, PoolExhausted),
     ("cuMemSetAccess", 2, INVALID, BackendError), ("cuMemSetAccess", 1, OOM, PoolExhausted),
     ("cuMemUnmap", 2, INVALID, BackendError), ("cuMemsetD8Async", 3, INVALID, BackendError),
     ("cuStreamSynchronize", 1, INVALID, BackendError)],
)
def test_every_driver_failure_is_a_value_and_rolls_back(
    space: KVSpace, fake: ctypes.CDLL, call: str, nth: int, code: int, error: type[Exception]
) -> None:
    # Issue 15 item 5: OOM from cuMemMap/cuMemSetAccess is a shortage, and a
    # rollback leaves the VA exactly as the driver wants it (no unmap of a
    # hole, no map over mapped VA: the fake fails the test otherwise).
    held = space.alloc(6).tolist()  # pre-existing partial page must survive
    before, drv = snapshot(space), driver_bytes(fake)
    fake.fake_cuda_fail(call.encode(), nth, code)
    with pytest.raises(error, match="fake"):
        space.alloc(4 * 3)
    assert snapshot(space) == before and driver_bytes(fake) == drv
    fake.fake_cuda_fail(b"none", 0, 0)
    again = space.alloc(4 * 3)
    assert len(again) == 12
    for r in range(R):  # the pages committed after the failure are whole and zeroed
        a = region_address(space, r)
        assert ctypes.string_at(a + 2 * G.page_bytes, 3 * G.page_bytes) == bytes(3 * G.page_bytes)
    space.free(held)
    space.free(again)


def test_out_of_memory_returns_the_pool_claim(fake: ctypes.CDLL, pool_name: str) -> None:
    pool = Pool(pool_name, capacity=16 * PAGE_COMMIT)
    with KVSpace(G, device="cuda", pool=pool, name="gpu", reserve_thread=False, reserve=(0, 0)) as s:
        fake.fake_cuda_fail(b"cuMemCreate", 1, OOM)
        with pytest.raises(PoolExhausted):
            s.alloc(8)
        assert pool.committed == 0  # the claim came back
        s.alloc(8)
        assert pool.committed == 2 * PAGE_COMMIT == driver_bytes(fake)


def test_a_zero_page_that_cannot_be_mapped_back_leaves_a_hole_the_next_commit_fills(
    space: KVSpace, fake: ctypes.CDLL
) -> None:
    # Bug: restore_zero's failures were ignored, so the next commit unmapped
    # a hole (the real driver refuses) and the page could never commit again.
    ids = space.alloc(4)
    fake.fake_cuda_fail(b"cuMemMap", 1, INVALID)  # release: the first zero-page remap fails
    space.free(ids)
    st = space.stats()
    assert st.pages_reserve == 0 and st.committed_bytes == 0 == driver_bytes(fake)  # released all the same
    ids = space.alloc(4)  # the same page, hole and all
    assert space.page_occupancy([0])[0].state == "active"
    for r in range(R):
        a = region_address(space, r)
        ctypes.memset(a, 9, 16)
        assert ctypes.string_at(a, 16) == bytes([9]) * 16
    space.free(ids)


def test_a_failed_cuMemRelease_keeps_the_memory_counted_until_the_space_goes(fake: ctypes.CDLL) -> None:
    s = KVSpace(G, device="cuda:0", reserve_thread=False, reserve=(0, 0))
    ids = s.alloc(4)
    fake.fake_cuda_fail(b"cuMemRelease", 1, INVALID)
    s.free(ids)
    assert s.stats().pages_reserve == 0  # released: the VA is back on the zero page
    held = driver_bytes(fake)
    assert held > 0 and s.allocated_bytes() == held  # the audit sees what the driver still holds
    s.close()
    del s
    gc.collect()
    assert fake.fake_cuda_live_handles() == 0 and fake.fake_cuda_allocated() == 0


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
    gc.collect()
    assert fake.fake_cuda_live_handles() == 0 and fake.fake_cuda_primary_refs(0) == 0


def test_a_second_device_is_addressed_by_its_ordinal(fake: ctypes.CDLL) -> None:
    # Issue 15 item 7: the CUdevice handle was passed where CUmemLocation.id
    # wants the ordinal (the fake's handles are 100 + ordinal).
    with KVSpace(G, device="cuda:1", reserve_thread=False, reserve=(0, 0)) as s:
        ids = s.alloc(4)
        a = region_address(s, 0, device=1)
        ctypes.memset(a, 3, 16)
        assert ctypes.string_at(a, 16) == bytes([3]) * 16
        s.free(ids)
    with pytest.raises(BackendError, match="cuDeviceGet"):
        KVSpace(G, device="cuda:2")


def test_a_device_without_virtual_memory_management_is_refused(fake: ctypes.CDLL) -> None:
    os.environ["FAKE_CUDA_NO_VMM"] = "1"
    try:
        with pytest.raises(BackendError, match="does not support the virtual memory management API"):
            KVSpace(G, device="cuda:0")
    finally:
        os.environ.pop("FAKE_CUDA_NO_VMM")
    gc.collect()
    assert fake.fake_cuda_primary_refs(0) == 0


def test_tensors_that_outlive_close_read_zeros_from_reserved_va(space: KVSpace, fake: ctypes.CDLL) -> None:
    # The VA used to be freed at close: a stale tensor could then reach memory
    # the driver hands to the next reservation (another tenant's KV).
    ids = space.alloc(4)
    a = region_address(space, 1)
    ctypes.memset(a, 5, 64)
    space.close()
    assert driver_bytes(fake) == 0
    assert ctypes.string_at(a, 64) == bytes(64)
    del ids


def test_unknown_device_strings_are_rejected() -> None:
    for bad in ("gpu", "cuda:x", "cuda1"):
        with pytest.raises(ValueError, match="device must be"):
            KVSpace(G, device=bad)


def test_a_pool_created_for_a_cuda_space_defaults_to_the_device_free_memory(
    fake: ctypes.CDLL, pool_name: str,
) -> None:
    os.environ["FAKE_CUDA_TOTAL"] = str(512 * 1024 * 1024)
    try:
        with KVSpace(G, device="cuda:0", pool=pool_name, name="gpu", reserve_thread=False) as s:
            assert s.pool is not None and s.pool.capacity == 256 * 1024 * 1024  # half of the free bytes
    finally:
        os.environ.pop("FAKE_CUDA_TOTAL")


def test_a_cuda_space_is_one_flat_memory_but_cannot_be_mapped_elsewhere(space: KVSpace) -> None:
    base = region_address(space, None)
    assert [region_address(space, r) for r in range(R)] == [base + r * G.region_bytes for r in range(R)]
    with pytest.raises(BackendError, match="only CPU spaces"):
        space.shared_memory()


def test_a_failed_unmap_in_release_maps_the_done_regions_back(space: KVSpace, fake: ctypes.CDLL) -> None:
    # Bug: when a region's unmap failed at region > 0, the earlier regions were
    # left on the read-only zero page while the page stayed committed (RESERVE):
    # its data was gone from view and a write to it faulted.
    ids = space.alloc(4)  # page 0 of every region
    addr = [region_address(space, r) for r in range(R)]
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


def test_a_random_run_with_the_reserve_thread_and_a_pool_keeps_books_and_driver_in_step(
    fake: ctypes.CDLL, pool_name: str,
) -> None:
    pool = Pool(pool_name, capacity=10 * PAGE_COMMIT)
    rng = random.Random(15)
    with KVSpace(G, device="cuda:0", pool=pool, name="run", reserve_thread=True, reserve=(1, 3)) as s:
        held: list[list[int]] = []
        for step in range(300):
            if held and (rng.random() < 0.45 or len(held) > 12):
                s.free(held.pop(rng.randrange(len(held))))
            else:
                try:
                    held.append(s.alloc(rng.randint(1, 9)).tolist())
                except PoolExhausted:
                    pass
            if step % 50 == 0:
                assert s.settle(30.0)
                assert s.allocated_bytes() == driver_bytes(fake) == s.stats().committed_bytes == pool.committed
        for ids in held:
            s.free(ids)
        assert s.settle(30.0)
        assert s.stats().used_blocks == 0
        assert driver_bytes(fake) == s.stats().committed_bytes == pool.committed  # the idle reserve
    assert driver_bytes(fake) == 0 == pool.committed


def test_a_forked_child_abandons_its_copy_without_calling_the_driver(
    fake: ctypes.CDLL, backend_harness: str  # noqa: F811 - the fixture
) -> None:
    # The driver is unusable after fork and every object is the parent's: the
    # child's copy forgets them (no unmap, no release, no context call).
    out = subprocess.run([backend_harness, "cuda-fork"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
