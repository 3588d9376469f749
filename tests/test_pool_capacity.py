"""A pool's capacity respects what the machine and its memory cgroup can back (issue 10, D13).

Out of memory at commit is not a shortage the pool can report: past the
cgroup's ``memory.max`` the kernel's OOM killer sends SIGKILL. So the default
capacity is a fraction of min(MemAvailable, room left in the cgroup), and an
explicit capacity larger than MemTotal or the cgroup limit is refused unless
``overcommit=True``. The cgroups here are fake directories (``KVPOOL_CGROUP``
or a fake ``/proc/self/cgroup``), so the figures are exact on any host.
"""

from __future__ import annotations

import os
import pathlib

import pytest

import kvpool.pool as pool_mod
from kvpool import LedgerError, Pool

MiB = 1 << 20


def meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(key)


def make_cgroup(path: pathlib.Path, version: str, limit: int | str, usage: int, inactive_file: int = 0) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if version == "v2":
        (path / "memory.max").write_text(f"{limit}\n")
        (path / "memory.current").write_text(f"{usage}\n")
        (path / "memory.stat").write_text(f"anon 1\ninactive_file {inactive_file}\nactive_file 5\n")
    else:
        (path / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (path / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (path / "memory.stat").write_text(f"cache 1\ninactive_file 9\ntotal_inactive_file {inactive_file}\n")


@pytest.fixture
def small_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_POOL_FRACTION", raising=False)
    if meminfo("MemAvailable") < 256 * MiB:
        pytest.skip("needs 256 MiB available to tell a cgroup limit from MemAvailable")


@pytest.mark.parametrize(
    "version, limit, usage, inactive, room",
    [
        ("v2", 64 * MiB, 16 * MiB, 4 * MiB, 52 * MiB),   # page cache that can be reclaimed is not used
        ("v2", 64 * MiB, 70 * MiB, 0, 0),                # over its limit (reclaiming): no room
        ("v1", 96 * MiB, 32 * MiB, 0, 64 * MiB),
    ],
)
def test_the_default_capacity_is_a_fraction_of_the_room_left_in_the_memory_cgroup(
    version: str, limit: int, usage: int, inactive: int, room: int, tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch, small_host: None, pool_name: str,
) -> None:
    leaf = tmp_path / "cg" / "engine"
    make_cgroup(leaf, version, limit, usage, inactive)
    monkeypatch.setenv("KVPOOL_CGROUP", str(leaf))
    cg = pool_mod.cgroup_memory()
    assert cg is not None and (cg.path, cg.headroom, cg.limit, cg.limit_path) == (str(leaf), room, limit, str(leaf))
    if room == 0:
        before = set(os.listdir("/dev/shm"))
        with pytest.raises(LedgerError, match=rf"room left in the memory cgroup {leaf} 0 B = 0 B"):
            Pool(pool_name)
        assert set(os.listdir("/dev/shm")) == before
    else:
        assert pool_mod.default_capacity() == room // 2
        assert Pool(pool_name).capacity == room // 2


def test_a_parent_cgroup_limit_binds_its_children(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, small_host: None
) -> None:
    parent = tmp_path / "cg" / "pod"
    make_cgroup(parent, "v2", 40 * MiB, 8 * MiB)
    make_cgroup(parent / "engine", "v2", "max", 1 * MiB)  # no limit of its own
    monkeypatch.setenv("KVPOOL_CGROUP", str(parent / "engine"))
    cg = pool_mod.cgroup_memory()
    assert cg is not None and (cg.path, cg.headroom, cg.limit) == (str(parent), 32 * MiB, 40 * MiB)
    assert pool_mod.default_capacity() == 16 * MiB
    # The least room and the lowest limit may sit at different levels.
    make_cgroup(parent, "v2", 100 * MiB, 90 * MiB)
    make_cgroup(parent / "engine", "v2", 50 * MiB, 0)
    cg = pool_mod.cgroup_memory()
    assert cg is not None and (cg.path, cg.headroom) == (str(parent), 10 * MiB)
    assert (cg.limit, cg.limit_path) == (50 * MiB, str(parent / "engine"))


@pytest.mark.parametrize("version, unlimited", [("v2", "max"), ("v1", 9223372036854771712)])
def test_an_unlimited_cgroup_leaves_mem_available(
    version: str, unlimited: int | str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    small_host: None,
) -> None:
    make_cgroup(tmp_path / "cg", version, unlimited, 1 * MiB)
    monkeypatch.setenv("KVPOOL_CGROUP", str(tmp_path / "cg"))
    assert pool_mod.cgroup_memory() is None
    cap = pool_mod.default_capacity()
    assert abs(cap - meminfo("MemAvailable") // 2) < 64 * MiB  # MemAvailable moves a little meanwhile


def test_this_process_cgroup_is_found_from_proc_self_cgroup(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "sys-fs-cgroup"
    make_cgroup(root / "memory" / "a" / "b", "v1", 48 * MiB, 8 * MiB)
    make_cgroup(root / "memory", "v1", 9223372036854771712, 1)  # the v1 root: unlimited
    make_cgroup(root / "x" / "y", "v2", 20 * MiB, 4 * MiB)     # the unified hierarchy's leaf
    proc = tmp_path / "cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/a/b\n3:cpu,cpuacct:/\n0::/x/y\n")
    monkeypatch.delenv("KVPOOL_CGROUP", raising=False)
    monkeypatch.setattr(pool_mod, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(pool_mod, "PROC_CGROUP", str(proc))
    cg = pool_mod.cgroup_memory()
    assert cg is not None and (cg.path, cg.headroom) == (str(root / "x" / "y"), 16 * MiB)
    assert (cg.limit, cg.limit_path) == (20 * MiB, str(root / "x" / "y"))
    # A path the mount does not show (a container without a cgroup namespace): the mount's own cgroup.
    proc.write_text("4:memory:/not/here\n")
    cg = pool_mod.cgroup_memory()
    assert cg is None  # the v1 root is unlimited


def test_a_capacity_beyond_the_cgroup_limit_is_refused_unless_overcommit(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, pool_name: str
) -> None:
    make_cgroup(tmp_path / "cg", "v2", 64 * MiB, 0)
    monkeypatch.setenv("KVPOOL_CGROUP", str(tmp_path / "cg"))
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(LedgerError, match=(
            rf"capacity 64.0 MiB \({64 * MiB + 1} bytes\) is more than this machine can back: the memory cgroup limit of "
            rf"{tmp_path / 'cg'} is 64.0 MiB; use capacity <= {64 * MiB}, .*overcommit=True")):
        Pool(pool_name, capacity=64 * MiB + 1)
    assert set(os.listdir("/dev/shm")) == before
    assert Pool(pool_name, capacity=64 * MiB).capacity == 64 * MiB  # up to the limit is fine
    Pool.remove(pool_name)
    assert Pool(pool_name, capacity=1 << 40, overcommit=True).capacity == 1 << 40  # said out loud


def test_a_capacity_beyond_mem_total_is_refused_unless_overcommit(
    monkeypatch: pytest.MonkeyPatch, pool_name: str
) -> None:
    monkeypatch.setenv("KVPOOL_CGROUP", "/nonexistent")  # no cgroup: MemTotal binds
    total = meminfo("MemTotal")
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(LedgerError, match=rf"capacity .* \({total + 1} bytes\) .* MemTotal is .*use capacity <= {total}, .*overcommit=True"):
        Pool(pool_name, capacity=total + 1)
    assert set(os.listdir("/dev/shm")) == before
    assert Pool(pool_name, capacity=total + 1, overcommit=True).capacity == total + 1


def test_joining_an_existing_pool_judges_no_capacity(monkeypatch: pytest.MonkeyPatch, pool_name: str) -> None:
    Pool(pool_name, capacity=8 * MiB)
    monkeypatch.setenv("KVPOOL_CGROUP", "/nonexistent")
    assert Pool(pool_name, create=False).capacity == 8 * MiB
