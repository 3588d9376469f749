"""A ledger no peer can block (issue 10: D3, D5, D9, D12), tried as a hostile peer would.

Real processes and real shared memory: tenants are stopped (SIGSTOP) inside a
claim and at arbitrary moments, run in another PID namespace, and the segment
is corrupted under them. Every test counts operations and waits for events;
the only time bounds are hang guards (``_hostile.bounded``), far beyond any
machine's load, because a native call blocked on a stopped peer holds no GIL
and the per-test timeout could not interrupt it.

Each test names the defect of the old main (884d081, a robust process-shared
mutex in the ledger) it pins and why it failed there.
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Callable

import pytest

from kvpool import KVPoolError, KVSpace, LedgerError, Pool, PoolExhausted

from . import _ledger_layout as L
from ._helpers import wait_until
from ._hostile import BLOCKS_PER_PAGE, G, PCB, Child, bounded, children, proc_state

__all__ = ["children"]  # the fixture, imported for the tests below


def space(pool: Pool, name: str, **kw: object) -> KVSpace:
    return KVSpace(G, pool=pool, name=name, reserve_thread=False, reserve=(0, 0), **kw)  # type: ignore[arg-type]


def page_rounds(me: KVSpace, n: int) -> int:
    """n rounds of alloc + free of one fresh page: each commits (claims) and
    releases a page. Returns the rounds done, proven by the space's counters."""
    before = me.stats()
    for _ in range(n):
        me.free(me.alloc(BLOCKS_PER_PAGE))
    after = me.stats()
    assert (after.commits - before.commits, after.releases - before.releases) == (n, n)
    return n


def wait_stopped(child: Child) -> None:
    wait_until(lambda: proc_state(child.pid) == "T" or child.proc.poll() is not None,
               f"child {child.pid} stops itself")
    assert proc_state(child.pid) == "T", f"child {child.pid} exited ({child.proc.poll()}) instead of stopping"


def pending_of(pool: Pool, name: str) -> int:
    return sum(r.pending for r in pool._ledger.snapshot().rows if r.name == name)


# ------------------------------------------------------------- D3: SIGSTOP

@pytest.mark.timeout(600)
def test_a_tenant_stopped_inside_a_claim_blocks_no_other_tenant(
    pool_name: str, children: Callable[..., Child]
) -> None:
    # D3: on 884d081 a tenant stopped while it held the ledger's process-shared
    # mutex froze every claim, release, Pool.tenants() and new tenant of the
    # pool for as long as it stayed stopped (repro/sigstop_ledger_freeze.py).
    # There the test hook does not exist either, so the child never stops.
    pool = Pool(pool_name, capacity=16 * PCB)
    me = space(pool, "me")
    me.alloc(4 * BLOCKS_PER_PAGE)  # four full pages held throughout
    child = children("stop_claim", pool_name, "stopper", str(2 * BLOCKS_PER_PAGE)).ready()
    child.send("go")
    wait_stopped(child)
    assert pending_of(pool, "stopper") == 2 * PCB  # stopped inside the claim, its bytes pending

    rounds = bounded(lambda: page_rounds(me, 50), "50 alloc/free rounds while a peer is stopped mid-claim")
    assert rounds == 50
    names = bounded(lambda: sorted(t.name for t in pool.tenants()), "Pool.tenants()")
    assert names == ["me", "stopper"]  # stopped is alive: not reaped
    assert bounded(lambda: pool.set_limit("me", 12 * PCB), "Pool.set_limit") == "applied"
    wait_until(lambda: me.limit_setting()[0] == 12 * PCB, "the owner sees its new limit")
    newcomer = bounded(lambda: space(pool, "newcomer"), "a new tenant joining")
    assert bounded(lambda: page_rounds(newcomer, 5), "the newcomer's alloc/free rounds") == 5
    newcomer.close()

    child.proc.kill()  # SIGKILL ends a stopped process too
    child.proc.wait()
    assert bounded(lambda: [t.name for t in pool.tenants()], "Pool.tenants() reaps") == ["me"]
    snap = pool._ledger.snapshot()
    assert sum(r.pending for r in snap.rows) == 0  # its pending claim left the books with it
    assert pool.committed == me.stats().committed_bytes == 4 * PCB
    me.close()
    assert pool.committed == 0


@pytest.mark.timeout(300)
def test_a_tenant_continued_after_a_stop_inside_its_claim_finishes_it(
    pool_name: str, children: Callable[..., Child]
) -> None:
    # The stop costs the others nothing and the stopped one nothing either:
    # continued, its claim is judged and granted as if it had never stopped.
    pool = Pool(pool_name, capacity=16 * PCB)
    child = children("stop_claim", pool_name, "stopper", str(2 * BLOCKS_PER_PAGE)).ready()
    child.send("go")
    wait_stopped(child)
    os.kill(child.pid, signal.SIGCONT)
    assert child.json("its grant") == {"granted": 2 * BLOCKS_PER_PAGE}
    assert pool.committed == 2 * PCB and pending_of(pool, "stopper") == 0


@pytest.mark.timeout(900)
def test_a_churning_tenant_stopped_at_any_moment_blocks_no_other_tenant(
    pool_name: str, children: Callable[..., Child], tmp_path: pathlib.Path
) -> None:
    # D3 without the hook: the churner is stopped after an arbitrary number of
    # its own operations (claims, releases, reaps, snapshots), 20 times. On
    # 884d081 a stop that lands while it holds the ledger mutex (most of its
    # time is spent in claims under it) leaves the parent's next commit
    # blocked: the round's hang guard fails.
    churn_limit = 24 * PCB
    pool = Pool(pool_name, capacity=churn_limit + 8 * PCB)  # the churner can never starve the parent
    ctl_path = tmp_path / "ctl"
    ctl_path.write_bytes(bytes(64))
    ctl = mmap.mmap(os.open(ctl_path, os.O_RDWR), 64)
    churner = children("churn", pool_name, "churner", str(ctl_path), str(churn_limit)).ready()
    me = space(pool, "me")
    rng = random.Random(20261201)

    def ops() -> int:
        return int(struct.unpack_from("<Q", ctl, 0)[0])

    stops = 0
    for r in range(20):
        target = ops() + rng.randint(1, 40)
        wait_until(lambda: ops() >= target or churner.proc.poll() is not None, f"the churner does op {target}")
        assert churner.proc.poll() is None, churner.proc.stderr.read() if churner.proc.stderr else ""
        os.kill(churner.pid, signal.SIGSTOP)
        wait_until(lambda: proc_state(churner.pid) == "T", "the churner stops")
        stops += 1
        done = bounded(lambda: page_rounds(me, 10), f"the parent's 10 alloc/free rounds in stop {r}")
        assert done == 10
        assert "churner" in bounded(lambda: [t.name for t in pool.tenants()], f"Pool.tenants() in stop {r}")
        assert pool.committed <= pool.capacity
        os.kill(churner.pid, signal.SIGCONT)
    assert stops == 20
    me.close()


# --------------------------------------------------------- D5: PID namespaces

def _can_unshare() -> str:
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    r = subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"], capture_output=True, text=True)
    return "" if r.returncode == 0 else f"unshare -p fails here: {r.stderr.strip()}"


@pytest.mark.timeout(600)
@pytest.mark.skipif(bool(_can_unshare()), reason=_can_unshare() or "-")
def test_tenants_in_two_pid_namespaces_share_a_pool_and_never_reap_each_other(
    pool_name: str, children: Callable[..., Child]
) -> None:
    # D5: on 884d081 a tenant in another PID namespace (a container sharing
    # /dev/shm) judged the host tenant's pid in its own namespace, found no
    # such process and reaped it: its alloc of the whole pool was granted on
    # top of the host's half (over-committed), repro/pidns_reaping.py.
    pages = 16
    pool = Pool(pool_name, capacity=pages * PCB)
    host = space(pool, "host")
    host.alloc(pages // 2 * BLOCKS_PER_PAGE)  # half the pool
    inside = children("pidns", pool_name, "inside", str(BLOCKS_PER_PAGE), str(pages * BLOCKS_PER_PAGE),
                      prefix=["unshare", "-p", "-f", "--mount-proc", "--kill-child"]).ready()
    seen = inside.json()
    assert seen["reaped"] == 0  # the host is not its to judge
    assert seen["alloc"] == "PoolExhausted"  # the whole pool, while the host holds half
    assert seen["hold"] == "granted" and seen["committed"] == PCB  # it then holds one page
    assert seen["pool_committed"] == (pages // 2 + 1) * PCB <= seen["capacity"]
    assert {(t["name"], t["visible"]) for t in seen["tenants"]} == {("host", False), ("inside", True)}
    assert seen["pid"] != inside.pid  # it really is in its own namespace

    assert pool.reap() == 0  # nor is the inside tenant the host's to judge
    rows = {t.name: t for t in pool.tenants()}
    assert set(rows) == {"host", "inside"}
    assert (rows["host"].visible, rows["inside"].visible) == (True, False)
    assert rows["inside"].committed_bytes == PCB and rows["host"].committed_bytes == pages // 2 * PCB
    # The host fills exactly what is left, never more.
    with pytest.raises(PoolExhausted):
        host.alloc((pages // 2) * BLOCKS_PER_PAGE)
    host.alloc((pages // 2 - 1) * BLOCKS_PER_PAGE)
    assert pool.committed == pool.capacity

    inside.send("look")
    again = inside.json()
    assert again["reaped"] == 0 and again["committed"] == PCB and again["pool_committed"] == pool.capacity
    assert {t["name"] for t in again["tenants"]} == {"host", "inside"}
    assert host.stats().committed_bytes == (pages - 1) * PCB
    assert inside.proc.stdin is not None
    inside.proc.stdin.close()  # it leaves the pool itself
    assert inside.proc.wait() == 0
    assert [t.name for t in pool.tenants()] == ["host"]
    assert pool.committed == (pages - 1) * PCB
    host.close()


@pytest.mark.timeout(600)
@pytest.mark.skipif(bool(_can_unshare()), reason=_can_unshare() or "-")
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_tenant_of_another_pid_namespace_that_dies_is_reaped_and_one_stopped_is_not(
    how: str, pool_name: str, children: Callable[..., Child]
) -> None:
    # Round 3 (pidns_dead_container_leak.py): a container's tenant SIGKILLed
    # with its whole namespace kept its bytes and its name in the ledger for
    # ever; the host was refused memory nobody held, and the restarted
    # container could not join under its name. Its slot's lock (ledger.hpp)
    # now tells: the kernel drops it with the process; a stopped one keeps it.
    pages = 16
    pool = Pool(pool_name, capacity=pages * PCB)
    host = space(pool, "host")
    inside = children("hold", pool_name, "container", str(pages // 2 * BLOCKS_PER_PAGE),
                      prefix=["unshare", "-p", "-f", "--mount-proc", "--kill-child"]).ready()
    assert inside.json()["committed"] == pages // 2 * PCB
    assert {t.name: t.visible for t in pool.tenants()} == {"host": True, "container": False}
    if how == "SIGSTOP":
        for pid in [inside.proc.pid, *_descendants(inside.proc.pid)]:  # unshare and the container's processes
            os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: all(proc_state(pid) == "T" for pid in _descendants(inside.proc.pid)), "all stopped")
        try:
            assert pool.reap() == 0  # stopped is not dead: its memory is still held
            with pytest.raises(PoolExhausted):
                host.alloc(pages * BLOCKS_PER_PAGE)
            assert {t.name for t in pool.tenants()} == {"host", "container"}
        finally:
            for pid in [inside.proc.pid, *_descendants(inside.proc.pid)]:
                os.kill(pid, signal.SIGCONT)
        host.close()
        return
    inside.proc.kill()  # unshare dies; --kill-child takes the namespace's init with it
    inside.proc.wait()

    def reaped() -> bool:
        pool.reap()  # what the next process to look does; the lock goes once the process has exited
        return "container" not in {t.name for t in pool.tenants()}

    wait_until(reaped, "the container's tenant is reaped")
    assert [t.name for t in pool.tenants()] == ["host"] and pool.committed == 0
    ids = host.alloc(pages * BLOCKS_PER_PAGE)  # the whole pool: nobody alive holds any of it
    host.free(ids)
    again = space(pool, "container")  # the restarted container joins under its name
    again.close()
    host.close()


def _descendants(pid: int) -> list[int]:
    out = []
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = f.read().split()
    for child in kids:
        out += [int(child), *_descendants(int(child))]
    return out


# ----------------------------------------------------- D9: corrupted segments

NAME_CHARS = re.compile(r"[A-Za-z0-9._?-]*")


def _kvpool_cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "kvpool")
    return bounded(lambda: subprocess.run([exe, *args], capture_output=True, text=True),
                   f"kvpool {' '.join(args)}")


@pytest.mark.timeout(600)
def test_a_ledger_whose_slots_are_random_bytes_is_read_without_hanging(pool_name: str) -> None:
    # D9: on 884d081 a corrupted mutex word hung every joiner and Pool.tenants()
    # forever, an invalid one made tenants() return [], and a name cut inside a
    # UTF-8 sequence made it raise UnicodeDecodeError (ledger_lock_word_hang.py).
    # Here (and there: the layout mirror checks the version) every slot becomes
    # random bytes behind a valid header; some are made to look live, with
    # names of random bytes (no NUL, high bits set).
    pool = Pool(pool_name, capacity=16 * PCB)
    L.check(pool_name)
    rng = random.Random(9)
    L.write_at(pool_name, L.SLOTS_OFFSET, rng.randbytes(L.MAX_TENANTS * L.SLOT_BYTES))
    for slot in (3, 17, 40, 63):
        t = L.TenantSlot.from_buffer_copy(rng.randbytes(L.SLOT_BYTES))
        t.pid, t.live = rng.randint(1, 2**31 - 1), 1
        L.write_at(pool_name, L.slot_offset(slot), bytes(t))
        L.write_at(pool_name, L.slot_offset(slot) + L.TenantSlot.name.offset,
                   bytes(rng.randint(0x80, 0xFF) for _ in range(L.NAME_BYTES)))

    held = L.live_locks(pool_name, (3, 17, 40, 63))  # they look live to a reaper too (foreign, lock held)
    fresh = Pool(pool_name, create=False)
    tenants = bounded(fresh.tenants, "Pool.tenants() of a corrupted ledger")
    assert len(tenants) >= 4  # the rows that look live are shown, not dropped
    for t in tenants:
        assert NAME_CHARS.fullmatch(t.name) and len(t.name) < L.NAME_BYTES, t.name  # sanitized: printable, bounded
    snap = bounded(fresh.snapshot, "Pool.snapshot() of a corrupted ledger")
    assert {t.slot for t in snap.tenants} == {t.slot for t in tenants}
    # (Its total of random figures: test_corrupted_rows_claiming_more_than_the_capacity_never_make_room.)
    top = _kvpool_cli("top", pool_name, "--once", "--json")
    assert top.returncode == 0, top.stderr[-2000:]
    shown = json.loads(top.stdout)
    assert shown["capacity"] == 16 * PCB and len(shown["tenants"]) == len(tenants)
    table = _kvpool_cli("top", pool_name, "--once")
    assert table.returncode == 0, table.stderr[-2000:]
    pools = _kvpool_cli("pools")
    assert pools.returncode == 0 and pool_name in pools.stdout, pools.stderr[-2000:]
    held.__exit__()
    # Joining: a typed error (no free slot, a shortage), never a hang or a crash.
    try:
        s = bounded(lambda: space(fresh, "joiner"), "a new tenant joining a corrupted ledger")
    except KVPoolError:
        pass
    else:
        s.close()


@pytest.mark.timeout(300)
def test_corrupted_rows_claiming_more_than_the_capacity_never_make_room(pool_name: str) -> None:
    # D9, bounds: rows another namespace owns are not reaped here while they
    # hold their slot's lock, so what they claim is believed; a row claiming more than the whole capacity is
    # corruption and must read as a full pool, never as a negative total.
    pool = Pool(pool_name, capacity=16 * PCB)
    me = space(pool, "me")
    for slot, name in ((10, b"corrupt-a"), (11, b"corrupt-b")):
        t = L.TenantSlot()
        t.pid, t.live, t.pidns, t.name, t.claimed = 4_000_000 + slot, 1, 12345, name, 2**63 - 1
        L.write_at(pool_name, L.slot_offset(slot), bytes(t))
    held = L.live_locks(pool_name, (10, 11))  # alive, as far as a reaper can tell: believed
    snap = pool.snapshot()
    assert 0 <= snap.committed and snap.committed == sum(t.committed_bytes for t in snap.tenants)
    with pytest.raises(PoolExhausted):
        me.alloc(16 * BLOCKS_PER_PAGE)
    assert me.stats().committed_bytes == 0
    # Once nothing holds their locks they are the books of the dead: reaped, and the pool is whole again.
    held.__exit__()
    assert pool.reap() == 2
    me.free(me.alloc(16 * BLOCKS_PER_PAGE))
    me.close()


@pytest.mark.timeout(600)
def test_a_settings_seqlock_left_odd_fails_writers_quickly_and_the_owner_keeps_allocating(pool_name: str) -> None:
    # D9 / D3 for settings: a writer that died (or stopped) inside a slot's
    # settings seqlock leaves its sequence odd. On 884d081 settings were under
    # the one ledger mutex, whose corrupted word hung everyone. Now a writer
    # gives up with a LedgerError after a bounded wait, and the owner's claims
    # (which read every slot's settings) go on.
    pool = Pool(pool_name, capacity=16 * PCB)
    L.check(pool_name)
    owner = space(pool, "owner")
    slot = L.slot_of(pool_name, "owner")
    seq = L.read(pool_name).tenants[slot].settings.seq
    assert seq % 2 == 0
    L.write_at(pool_name, L.slot_offset(slot) + L.SEQ_OFFSET, struct.pack("<Q", seq + 1))
    operator = Pool(pool_name, create=False)
    for value, revision in ((8 * PCB, None), (8 * PCB, 7)):
        with pytest.raises(LedgerError, match="busy|stopped or dead writer"):
            bounded(lambda: operator.set_limit("owner", value, revision=revision), "set_limit on a stuck seqlock")
    assert bounded(lambda: page_rounds(owner, 20), "the owner's alloc/free rounds") == 20
    assert [t.name for t in bounded(operator.tenants, "tenants()")] == ["owner"]
    assert owner.limit_setting() == (None, 0)  # nothing half-written was taken
    # The slot stays the owner's; once the sequence is even again, writers get in.
    L.write_at(pool_name, L.slot_offset(slot) + L.SEQ_OFFSET, struct.pack("<Q", seq + 2))
    assert operator.set_limit("owner", 8 * PCB) == "applied"
    wait_until(lambda: owner.limit_setting() == (8 * PCB, 1), "the owner sees the limit")
    owner.close()


# ------------------------------------------------------ D12: one-read snapshot

@pytest.mark.timeout(600)
@pytest.mark.parametrize("reader", ["Pool.snapshot", "kvpool top --json"])
def test_every_snapshot_total_is_the_sum_of_its_rows_under_churn(
    reader: str, pool_name: str, children: Callable[..., Child], tmp_path: pathlib.Path
) -> None:
    # D12: on 884d081 `kvpool top --json` read the rows and the total in two
    # steps, so under a busy tenant they disagreed (top_snapshot_not_atomic.py);
    # Pool.snapshot() did not exist. 2,000 reads while a child churns, and
    # reads go on until the child has done 200 operations among them.
    from kvpool._top import snapshot as _snapshot

    capacity = 32 * PCB
    pool = Pool(pool_name, capacity=capacity)
    ctl_path = tmp_path / "ctl"
    ctl_path.write_bytes(bytes(64))
    ctl = mmap.mmap(os.open(ctl_path, os.O_RDWR), 64)
    children("churn", pool_name, "churner", str(ctl_path), str(capacity)).ready()
    read: Callable[[], tuple[int, int, list[int]]]
    if reader == "Pool.snapshot":
        def read() -> tuple[int, int, list[int]]:
            s = pool.snapshot()
            return s.committed, s.capacity, [t.committed_bytes for t in s.tenants]
    else:
        def read() -> tuple[int, int, list[int]]:
            s = _snapshot(pool)  # what `kvpool top --once --json` prints
            return s["committed"], s["capacity"], [t["committed_bytes"] for t in s["tenants"]]

    def ops() -> int:
        return int(struct.unpack_from("<Q", ctl, 0)[0])

    start, reads, bad = ops(), 0, []
    while reads < 2000 or ops() < start + 200:
        committed, cap, rows = read()
        reads += 1
        if committed != sum(rows) or committed > cap:
            bad.append((committed, sum(rows), cap))
    assert not bad, f"{len(bad)} of {reads} snapshots disagree with their rows (committed, sum, capacity): {bad[:5]}"


@pytest.mark.timeout(300)
def test_a_pending_claim_is_in_the_total_exactly_as_in_its_row(pool_name: str, children: Callable[..., Child]) -> None:
    # D12 made deterministic: a tenant stopped inside its claim holds pending
    # bytes for as long as the test likes, so the total and its rows are
    # compared in exactly the state a churning tenant is in for a moment.
    pool = Pool(pool_name, capacity=16 * PCB)
    me = space(pool, "me")
    me.alloc(2 * BLOCKS_PER_PAGE)
    child = children("stop_claim", pool_name, "stopper", str(3 * BLOCKS_PER_PAGE)).ready()
    child.send("go")
    wait_stopped(child)
    snap = pool.snapshot()
    assert snap.committed == sum(t.committed_bytes for t in snap.tenants), (
        f"total {snap.committed}, rows {[(t.name, t.committed_bytes) for t in snap.tenants]}")
    me.close()
