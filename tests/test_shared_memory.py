"""A space's memory seen from another process (KVSpace.shared_memory / map_shared).

The vLLM plugin's worker maps the scheduler's space this way, so these tests
use real processes: pages one side commits are visible to the other, and
released pages read as zeros there too.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

from kvpool import BackendError, Geometry, KVSpace, Pool, SharedMemory, map_shared

G = Geometry(2, 1, 4096, 64, page_bytes=16384)


@pytest.fixture
def space(pool_name: str) -> Iterator[KVSpace]:
    s = KVSpace(G, pool=Pool(pool_name, capacity=1 << 24), reserve_thread=False, reserve=(0, 0))
    yield s
    s.close()


def test_memory_is_every_region_back_to_back(space: KVSpace) -> None:
    mem = space.memory()
    assert mem.dtype == torch.uint8 and mem.numel() == G.num_regions * G.region_bytes
    for r in range(G.num_regions):
        assert space.region(r).data_ptr() == mem.data_ptr() + r * G.region_bytes


def _child(code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True,
                          text=True, timeout=240)  # a hang guard, inside the test timeout


def test_another_process_sees_committed_blocks_and_writes_back(space: KVSpace, tmp_path: pathlib.Path) -> None:
    a, b = (int(i) for i in space.alloc(2))
    mem = space.memory()
    off_a, off_b = G.region_bytes + a * 4096, G.region_bytes + b * 4096  # region 1
    mem[off_a] = 123
    h = space.shared_memory()
    res = _child(f"""
        from kvpool import SharedMemory, map_shared
        t = map_shared(SharedMemory({h.pid}, {h.fd}, {h.size}))
        print(int(t[{off_a}]))
        t[{off_b}] = 45
        """, tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["123"]
    assert int(mem[off_b]) == 45
    committed = space.stats().committed_bytes
    assert space.allocated_bytes() == committed  # the child's write used committed memory only


def test_a_released_page_reads_zero_in_the_other_process(space: KVSpace, tmp_path: pathlib.Path) -> None:
    ids = space.alloc(4)  # page 0 of both regions
    mem = space.memory()
    mem[int(ids[0]) * 4096] = 9
    h = space.shared_memory()
    other = map_shared(h)  # a second mapping of the file, as a worker holds it
    assert int(other[int(ids[0]) * 4096]) == 9
    space.free(ids)
    space.trim()
    assert space.stats().committed_bytes == 0
    assert int(other[int(ids[0]) * 4096]) == 0  # the punched hole, seen through the other mapping


def test_map_shared_rejects_a_wrong_handle(space: KVSpace) -> None:
    h = space.shared_memory()
    with pytest.raises(BackendError, match="expected"):
        map_shared(SharedMemory(h.pid, h.fd, h.size + 4096))
    with pytest.raises(BackendError, match="owner process alive"):
        map_shared(SharedMemory(2**22 + 12345, h.fd, h.size))


def test_a_closed_space_has_no_shared_memory(space: KVSpace) -> None:
    from kvpool import PoolClosed

    space.close()
    with pytest.raises(PoolClosed):
        space.shared_memory()
    with pytest.raises(PoolClosed):
        space.memory()


def test_report_waiting_reaches_the_ledger(space: KVSpace) -> None:
    assert space.pool is not None
    space.report_waiting(3)
    assert [t.waiting for t in space.pool.tenants() if t.name == space.name] == [3]
    with pytest.raises(ValueError, match=">= 0"):
        space.report_waiting(-1)
    assert [t.waiting for t in space.pool.tenants() if t.name == space.name] == [3]
