"""Physical memory really comes and goes; torch views are zero-copy."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

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


# --- reads of uncommitted pages (issue 10, D6) and the mappings behind them ---

D6 = Geometry(1, 2, 64 * KiB, 1024, page_bytes=2 << 20)  # 64 MiB a region, R = 2


def _rss_kib() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem"):
                out[key] = int(value.split()[0])
    return out


def _mappings_over(space, geometry: Geometry) -> int:  # type: ignore[no-untyped-def]
    lo = space.region(0).data_ptr()
    hi = lo + geometry.num_regions * geometry.region_bytes
    n = 0
    with open("/proc/self/maps") as f:
        for line in f:
            a, b = (int(x, 16) for x in line.split()[0].split("-"))
            n += a < hi and b > lo
    return n


def test_reading_every_uncommitted_block_through_a_view_allocates_nothing(make_space) -> None:
    # Regression, D6: one read of an uncommitted block allocated 64 KiB of the
    # memfd, k.sum() the whole 64 MiB region, none of it in the books, and
    # trim() gave none of it back.
    space = make_space(D6)
    k = space.view(0, 0, torch.uint8, (64 * KiB,))
    v = space.view(0, 1, torch.uint8, (64 * KiB,))
    before = _rss_kib()
    for block in range(D6.num_blocks):
        assert int(k[block].sum()) == 0
    assert int(k.sum()) == 0 and int(v.sum()) == 0
    after = _rss_kib()
    assert space.allocated_bytes() == 0 and space.stats().committed_bytes == 0
    assert after["RssShmem"] - before["RssShmem"] < 1024  # KiB; the old code: +131072
    assert after["RssAnon"] - before["RssAnon"] < 16 * 1024  # zeros come from the kernel's zero page
    # Committed pages still work and read back; releasing them gives all back.
    ids = torch.from_numpy(space.alloc(64))
    k[ids] = 3
    assert int(k[ids].sum()) == 3 * 64 * 64 * KiB and int(k.sum()) == 3 * 64 * 64 * KiB
    assert space.allocated_bytes() == 2 * D6.page_commit_bytes
    space.free(ids.numpy())
    space.trim()
    assert space.allocated_bytes() == 0 and int(k.sum()) == 0


def test_a_stray_write_to_an_uncommitted_page_faults_instead_of_allocating(tmp_path) -> None:  # type: ignore[no-untyped-def]
    code = (
        "import torch, kvpool\n"
        "s = kvpool.KVSpace(kvpool.Geometry(1, 1, 4096, 64, page_bytes=65536), reserve_thread=False, reserve=(0, 0))\n"
        "k = s.view(0, 0, torch.uint8, (4096,))\n"
        "s.alloc(16)\n"
        "k[3] = 1\n"  # committed: fine
        "print('committed write ok', flush=True)\n"
        "k[40] = 1\n"  # page 2: uncommitted, read-only
        "print('no fault', flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert "committed write ok" in out.stdout and "no fault" not in out.stdout
    assert out.returncode == -signal.SIGSEGV


def test_mappings_grow_with_runs_of_committed_pages_not_with_pages(make_space) -> None:
    # Each committed slice is its own mmap; adjacent ones must merge (same
    # memfd, contiguous offsets), or a big space would hit vm.max_map_count.
    g = Geometry(1, 2, 64 * KiB, 32 * 32, page_bytes=64 * KiB * 32)  # 32 pages a region
    space = make_space(g)
    assert _mappings_over(space, g) == 1
    held = [space.alloc(32) for _ in range(16)]  # pages 0..15 of both regions
    assert _mappings_over(space, g) == 4  # [file][anon][file][anon]
    for ids in held[1::2]:
        space.free(ids)  # every other page back: 8 runs of one page per region
    committed = [o.state != "free" for o in space.page_occupancy()]
    slices = committed * g.num_regions  # VA order: region 0's pages, then region 1's
    runs = 1 + sum(a != b for a, b in zip(slices, slices[1:]))
    assert _mappings_over(space, g) == runs == 32
    for ids in held[::2]:
        space.free(ids)
    assert _mappings_over(space, g) == 1


def test_commits_past_the_mapping_budget_are_a_shortage_naming_the_cap(tmp_path) -> None:  # type: ignore[no-untyped-def]
    code = (
        "import kvpool\n"
        "s = kvpool.KVSpace(kvpool.Geometry(1, 1, 4096, 64, page_bytes=65536), reserve_thread=False, reserve=(0, 0))\n"
        "try:\n"
        "    s.alloc(1)\n"
        "except kvpool.PoolExhausted as e:\n"
        "    print('refused:', e)\n"
        "print('allocated', s.allocated_bytes(), 'committed', s.stats().committed_bytes)\n"
    )
    env = dict(os.environ, KVPOOL_MAX_MAPPINGS="1")  # the first commit needs 2: [file][anon]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env=env, check=True)
    assert "refused:" in out.stdout and "vm.max_map_count" in out.stdout, out.stdout
    assert "allocated 0 committed 0" in out.stdout
    env["KVPOOL_MAX_MAPPINGS"] = "2"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env=env, check=True)
    assert "refused" not in out.stdout and "allocated 65536 committed 65536" in out.stdout


def test_a_closed_space_is_inert_reads_zero(make_space) -> None:
    space = make_space(G)
    k = space.view(0, 0, torch.uint8, (8 * KiB,))
    ids = torch.from_numpy(space.alloc(8))
    k[ids] = 9
    space.close()
    assert int(k.sum()) == 0 and space.allocated_bytes() == 0


@pytest.fixture(scope="session")
def backend_harness(tmp_path_factory: pytest.TempPathFactory) -> str:
    """tests/fake_cuda/backend_harness.cpp built with the native sources: drives a
    Backend directly (abandon() across fork, the commit/release benchmark)."""
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path_factory.mktemp("harness") / "backend_harness")
    cmd = ["g++", "-std=c++17", "-O1", "-I", os.path.join(root, "native"),
           os.path.join(root, "tests", "fake_cuda", "backend_harness.cpp"),
           os.path.join(root, "native", "cpu_backend.cpp"), os.path.join(root, "native", "cuda_backend.cpp"),
           os.path.join(root, "native", "cuda_driver.cpp"),
           "-o", out, "-ldl", "-lpthread"]
    cuda_include = "/usr/local/cuda/include"
    if os.path.exists(os.path.join(cuda_include, "cuda.h")):
        cmd[2:2] = ["-I", cuda_include, "-DKVPOOL_HAVE_CUDA_H=1"]
    subprocess.run(cmd, check=True)
    return out


def test_a_forked_child_abandons_its_copy_without_touching_the_parents_memory(backend_harness: str) -> None:
    # D7's backend half: the child's copy is made inert in the child only (no
    # punch-hole into the shared memfd); the parent's data and books stay.
    out = subprocess.run([backend_harness, "cpu-fork"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
