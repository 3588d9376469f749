"""Real-device checks of the CUDA backend (marker `gpu`; run by scripts/gpu_check.sh).

They skip cleanly unless KVPOOL_REAL_CUDA=1, a real driver loads, and torch
has CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kvpool
from kvpool import Geometry, KVSpace

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


def _free_bytes() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def test_alloc_writes_from_torch_land_and_read_back() -> None:
    g = Geometry(4, 2, 256 * 1024, 512, page_bytes=2 * MiB)
    with KVSpace(g, device="cuda:0", reserve_thread=False, reserve=(0, 0)) as s:
        k = torch.from_dlpack(s._space.region(0)).view(torch.float16)
        assert k.is_cuda
        ids = torch.from_numpy(s.alloc(16)).cuda()
        blocks = k[: g.blocks * g.block_bytes // 2].view(g.blocks, -1)
        blocks[ids] = torch.arange(16, dtype=torch.float16, device="cuda").unsqueeze(1)
        assert torch.equal(blocks[ids][:, 7].cpu(), torch.arange(16, dtype=torch.float16))


def test_released_memory_returns_to_the_device() -> None:
    g = Geometry(8, 2, 1 * MiB, 256, page_bytes=2 * MiB)
    with KVSpace(g, device="cuda:0", reserve_thread=False, reserve=(0, 0)) as s:
        before = _free_bytes()
        ids = s.alloc(128)  # 64 pages x 16 regions x 2 MiB = 2 GiB
        assert before - _free_bytes() >= 0.95 * s.allocated_bytes()
        s.free(ids)
        assert _free_bytes() >= before - 64 * MiB


def test_a_stray_write_to_an_unmapped_page_faults(tmp_path) -> None:  # type: ignore[no-untyped-def]
    code = textwrap.dedent(
        """
        import torch, kvpool
        g = kvpool.Geometry(1, 1, 2 << 20, 16, page_bytes=2 << 20)
        s = kvpool.KVSpace(g, device="cuda:0", reserve_thread=False, reserve=(0, 0))
        t = torch.from_dlpack(s._space.region(0))
        assert int(t[5 << 20].item()) == 0      # padding reads zeros (read-only zero page)
        t[5 << 20] = 1                           # stray write: must fault
        torch.cuda.synchronize()
        print("no fault")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert "no fault" not in out.stdout
    assert out.returncode != 0
