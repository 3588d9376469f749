"""Mirrored spaces (kvpool.ranks, native/mirror.hpp): one engine's pages held by its ranks' processes.

Real processes throughout: the leader is this test process, each rank is
tests/_rank_child.py attached over /proc/<pid>/fd. On "cuda" the ranks run
the CUDA backend against the fake driver (tests/fake_cuda, one fake GPU per
rank, loaded in each rank's own process), which is the multi-GPU path; on
"cpu" each rank has its own memfd. No assertion depends on how fast a rank
answers: a stopped rank is judged by the leader's timeout, and every wait
for a rank is an event (its acknowledgement) with a generous deadline.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool import BackendError, Geometry, KVSpace, LedgerError, Pool, PoolExhausted, RankHandle, RankMemory

from ._helpers import wait_until
from .conftest import KiB

G = Geometry(2, 2, 4 * KiB, 64, page_bytes=16 * KiB)  # 4 regions, 16 pages, 4 blocks a page
RANKS = [2, 2]  # rank 0: regions 0-1, rank 1: regions 2-3
RANK_PAGE = 2 * G.page_bytes  # what one page costs each rank
CHILD = os.path.join(os.path.dirname(__file__), "_rank_child.py")


class Rank:
    """A rank's process, driven one JSON line at a time."""

    def __init__(self, handle: RankHandle, rank: int, device: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, CHILD, json.dumps(dataclasses.asdict(handle)), str(rank), device],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"rank process exited with {self.proc.wait()}"
        return dict(json.loads(line))

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture(params=["cpu", "cuda"])
def device(request: pytest.FixtureRequest, fake_cuda_driver: str | None) -> str:
    if request.param == "cuda" and fake_cuda_driver is None:
        pytest.skip("no C compiler to build the fake driver")
    return str(request.param)


def rank_device(device: str, rank: int) -> str:
    return "cpu" if device == "cpu" else f"cuda:{rank}"  # one (fake) GPU per rank


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    started: list[Rank] = []
    yield started
    for r in started:
        r.stop()


def start(ranks: list[Rank], space: KVSpace, device: str, **env: str) -> list[Rank]:
    new = [Rank(space.rank_handle(), r, rank_device(device, r), env) for r in range(len(space.ranks))]
    ranks.extend(new)
    for r in new:
        assert r.hello.get("ok"), r.hello
    return new


def stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped (kill()
    returns before the stop lands)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
        return all(s in ("T", "t") for s in states)

    wait_until(stopped, f"every thread of rank process {pid} is stopped", interval=0.01)


def mirrored(device: str, **kw: Any) -> KVSpace:
    # No reserve thread, pages released as they empty: every commit and
    # release is one the test asked for.
    return KVSpace(G, device="cpu" if device == "cpu" else "cuda:0", ranks=RANKS, reserve_thread=False,
                   reserve=(0, 0), idle_release_s=0, **kw)


def committed_pages(space: KVSpace) -> int:
    return space.stats().committed_bytes // G.page_commit_bytes


def test_a_page_is_mapped_on_every_rank_before_alloc_returns_and_the_pool_counts_all_ranks(
        device: str, pool_name: str, ranks: list[Rank]) -> None:
    pool = Pool(pool_name, capacity=64 * G.page_commit_bytes, device="cpu" if device == "cpu" else "cuda:0")
    space = mirrored(device, pool=pool, name="tp2")
    r0, r1 = start(ranks, space, device)
    ids = space.alloc(10)  # 3 pages
    # No sync: the ranks acknowledged the commits before alloc returned.
    for r in (r0, r1):
        assert r.call("stats")["committed_pages"] == 3 == committed_pages(space)
    # Each rank writes and reads its own copy of the blocks' bytes.
    for i, r in enumerate((r0, r1)):
        assert r.call("fill", offset=0, length=3 * G.page_bytes, value=7 + i)["ok"]
        assert r.call("read", offset=0, length=3 * G.page_bytes)["values"] == [7 + i]
    # The books: the tenant's committed bytes are what the ranks really hold.
    (row,) = [t for t in pool.tenants() if t.name == "tp2"]
    held = sum(r.call("stats")["allocated_bytes"] for r in (r0, r1))
    assert row.committed_bytes == space.stats().committed_bytes == held == 3 * G.page_commit_bytes
    assert space.allocated_bytes() == held
    space.free(ids)
    for r in (r0, r1):
        assert r.call("stats")["committed_pages"] == 0
    assert space.allocated_bytes() == 0
    # A page committed again reads zeros on every rank (no stale KV).
    ids = space.alloc(1)
    for r in (r0, r1):
        assert r.call("read", offset=0, length=G.page_bytes)["values"] == [0]
    space.free(ids)
    if device == "cuda":
        for r in (r0, r1):
            assert r.call("violations")["violations"] == 0
    space.close()


def test_a_rank_that_cannot_commit_rolls_the_others_back_and_the_alloc_is_a_shortage(
        fake_cuda_driver: str | None, pool_name: str, ranks: list[Rank]) -> None:
    if fake_cuda_driver is None:
        pytest.skip("no C compiler to build the fake driver")
    pool = Pool(pool_name, capacity=64 * G.page_commit_bytes, device="cuda:0")
    space = mirrored("cuda", pool=pool, name="tp2")
    r0, r1 = start(ranks, space, "cuda")
    first = space.alloc(4)  # page 0 on both ranks
    # Rank 1's GPU has room for that page only.
    assert r1.call("env", name="FAKE_CUDA_TOTAL", value=RANK_PAGE)["ok"]
    before = (space.stats().committed_bytes, space.available(), [t.committed_bytes for t in pool.tenants()])
    with pytest.raises(PoolExhausted, match="rank 1"):
        space.alloc(4)  # needs page 1
    assert (space.stats().committed_bytes, space.available(), [t.committed_bytes for t in pool.tenants()]) == before
    assert r0.call("stats")["committed_pages"] == 1  # rank 0 committed page 1, then rolled it back
    s1 = r1.call("stats")
    assert s1["committed_pages"] == 1 and s1["failures"] == 1 and "out of memory" in s1["last_error"].lower()
    # Room again: the same request goes through on both.
    assert r1.call("env", name="FAKE_CUDA_TOTAL", value=1 << 30)["ok"]
    second = space.alloc(4)
    assert [r.call("stats")["committed_pages"] for r in (r0, r1)] == [2, 2]
    space.free(first)
    space.free(second)
    for r in (r0, r1):
        assert r.call("violations")["violations"] == 0
    space.close()


def test_a_rank_that_cannot_map_what_the_space_holds_is_refused_at_attach_and_leaves_its_slot_free(
        fake_cuda_driver: str | None, ranks: list[Rank]) -> None:
    if fake_cuda_driver is None:
        pytest.skip("no C compiler to build the fake driver")
    space = mirrored("cuda")
    held = space.alloc(8)  # 2 pages, before any rank exists
    small = Rank(space.rank_handle(), 1, "cuda:1", {"FAKE_CUDA_TOTAL": str(RANK_PAGE)})  # room for 1 page
    ranks.append(small)
    assert small.hello["error"] == "PoolExhausted" and "cannot map the pages the space holds" in small.hello["message"]
    assert small.proc.wait() == 0
    assert "(0 attached)" in space.stats().backend
    (r1,) = [Rank(space.rank_handle(), 1, "cuda:1")]  # the slot is free again
    ranks.append(r1)
    assert r1.hello["committed_pages"] == 2
    space.free(held)
    assert r1.call("stats")["committed_pages"] == 0 and r1.call("violations")["violations"] == 0
    space.close()


def test_a_stopped_rank_costs_shortages_not_a_hang_and_catches_up_when_it_resumes(
        device: str, ranks: list[Rank]) -> None:
    space = mirrored(device, rank_timeout_s=0.5)
    r0, r1 = start(ranks, space, device)
    held = space.alloc(2)  # page 0, half used
    stop_process(r1.proc.pid)
    try:
        with pytest.raises(PoolExhausted, match="did not answer"):
            space.alloc(4)  # a new page: rank 1 never acknowledges it
        with pytest.raises(PoolExhausted, match="is behind"):
            space.alloc(4)  # from now on at once
        # Blocks of a page every rank holds need no rank: still granted.
        more = space.alloc(2)
        assert committed_pages(space) == 1
        assert r0.call("stats")["committed_pages"] == 1  # rank 0 gave back the page rank 1 never answered for
    finally:
        os.kill(r1.proc.pid, signal.SIGCONT)
    assert r1.call("sync")["synced"]
    ids = space.alloc(4)  # answered again: commits go through
    assert [r.call("stats")["committed_pages"] for r in (r0, r1)] == [2, 2] and committed_pages(space) == 2
    space.free(ids)
    space.free(more)
    space.free(held)
    assert [r.call("stats")["committed_pages"] for r in (r0, r1)] == [0, 0]
    space.close()


def test_a_rank_stopped_during_a_release_lets_go_of_the_page_when_it_resumes(device: str, ranks: list[Rank]) -> None:
    space = mirrored(device, rank_timeout_s=0.5)
    r0, r1 = start(ranks, space, device)
    ids = space.alloc(4)
    stop_process(r1.proc.pid)
    try:
        space.free(ids)  # the map says released; rank 1 does not answer in time
        assert committed_pages(space) == 0 and r0.call("stats")["committed_pages"] == 0
        assert "rank 1" in space.stats().last_error and "did not answer" in space.stats().last_error
    finally:
        os.kill(r1.proc.pid, signal.SIGCONT)
    s1 = r1.call("sync")
    assert s1["synced"] and s1["committed_pages"] == 0
    space.close()


def test_a_rank_that_exits_is_detached_and_a_new_process_catches_up(device: str, ranks: list[Rank]) -> None:
    space = mirrored(device, rank_timeout_s=3600)
    r0, r1 = start(ranks, space, device)
    held = space.alloc(4)
    r1.proc.kill()  # not reaped: a zombie, which holds no memory either
    # The leader notices the exit (not the hour-long timeout): the commit goes
    # through on the ranks that are left.
    more = space.alloc(4)
    assert committed_pages(space) == 2 and r0.call("stats")["committed_pages"] == 2
    assert "mirrored over 2 ranks (1 attached)" in space.stats().backend
    r1.stop()
    (new1,) = [Rank(space.rank_handle(), 1, rank_device(device, 1))]
    ranks.append(new1)
    assert new1.hello["committed_pages"] == 2  # mapped every page the space holds before answering
    space.free(more)
    space.free(held)
    assert new1.call("stats")["committed_pages"] == 0 == r0.call("stats")["committed_pages"]
    space.close()


def test_a_rank_attaching_late_maps_what_the_space_holds_and_closing_the_space_frees_every_rank(
        device: str, ranks: list[Rank]) -> None:
    space = KVSpace(G, device="cpu" if device == "cpu" else "cuda:0", ranks=RANKS, null_block=True,
                    reserve_thread=False, reserve=(0, 0), idle_release_s=0)
    space.alloc(5)  # before any rank exists: the ranks catch up when they attach
    pages = committed_pages(space)
    assert pages >= 2
    r0, r1 = start(ranks, space, device)
    for r in (r0, r1):
        assert r.hello["committed_pages"] == pages
    space.close()
    for r in (r0, r1):
        assert r.call("sync")["committed_pages"] == 0  # the leader closed: every page given back


def test_a_forked_child_closing_its_copy_of_a_rank_leaves_the_parents_rank_alone(device: str) -> None:
    space = mirrored(device)
    mem = RankMemory(space.rank_handle(), 0, device=rank_device(device, 0))
    RankMemory(space.rank_handle(), 1, device=rank_device(device, 1)).close()  # rank 1: none
    ids = space.alloc(4)
    pid = os.fork()
    if pid == 0:  # the child: drop the inherited rank (and space), then leave
        try:
            mem.close()
            space.close()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    # The parent's rank still holds its page, keeps its slot and follows the map.
    assert mem.stats().committed_pages == 1 and not mem.closed
    more = space.alloc(4)
    assert mem.stats().committed_pages == 2
    space.free(more)
    space.free(ids)
    assert mem.stats().committed_pages == 0
    mem.close()
    space.close()


def test_a_stale_handle_is_refused(device: str) -> None:
    old = mirrored(device)
    handle = old.rank_handle()
    old.close()
    new = mirrored(device)  # very likely the same fd number
    stale = dataclasses.replace(handle, fd=new.rank_handle().fd)
    with pytest.raises(ValueError, match="stale"):
        RankMemory(stale, 0, device=rank_device(device, 0))
    new.close()


def test_bad_arguments_are_refused_and_change_nothing(device: str) -> None:
    dev = "cpu" if device == "cpu" else "cuda:0"
    with pytest.raises(ValueError, match="add up to 3 regions"):
        KVSpace(G, device=dev, ranks=[2, 1])
    with pytest.raises(ValueError, match="ranks\\[1\\]"):
        KVSpace(G, device=dev, ranks=[4, 0])
    with pytest.raises(TypeError):
        KVSpace(G, device=dev, ranks="22")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank_timeout_s"):
        KVSpace(G, device=dev, ranks=RANKS, rank_timeout_s=0)
    with KVSpace(G, device=dev) as plain:
        with pytest.raises(ValueError, match="mirrored"):
            plain.rank_handle()
    space = mirrored(device)
    with pytest.raises(BackendError, match="ranks"):
        space.memory()
    with pytest.raises(BackendError, match="ranks"):
        space.region(0)
    handle = space.rank_handle()
    with pytest.raises(ValueError, match="rank"):
        RankMemory(handle, 2, device=rank_device(device, 0))
    with pytest.raises(ValueError, match="not cpu|not cuda"):
        RankMemory(handle, 0, device="cuda:0" if device == "cpu" else "cpu")
    mem = RankMemory(handle, 0, device=rank_device(device, 0))  # a rank may live in the leader's process too
    with pytest.raises(LedgerError, match="attached already"):
        RankMemory(handle, 0, device=rank_device(device, 0))
    ids = space.alloc(1)
    assert mem.stats().committed_pages == 1
    if device == "cpu":
        assert mem.region(1).shape == (G.region_bytes,) and int(mem.region(1)[:G.page_bytes].sum()) == 0
    mem.close()
    again = RankMemory(handle, 0, device=rank_device(device, 0))  # a closed rank's slot is free again
    assert again.stats().committed_pages == 1
    space.free(ids)
    assert again.stats().committed_pages == 0
    again.close()
    space.close()
    with pytest.raises((BackendError, ValueError)):
        RankMemory(handle, 1, device=rank_device(device, 1))  # the channel is gone
