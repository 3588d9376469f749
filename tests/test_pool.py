"""The shared pool: one ledger, many engine processes (real processes, real shared memory)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import pathlib
import select
import signal
import stat
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from kvpool import BackendError, Geometry, KVSpace, LedgerError, Pool, PoolExhausted, RequestTooLarge, list_pools

from kvpool import MiB

from ._helpers import until, wait_until
from .conftest import KiB

G = Geometry(1, 2, 4 * KiB, 256, page_bytes=16 * KiB)  # 4 blocks a page, 32 KiB per page commit
PCB = G.page_commit_bytes
CHILD = pathlib.Path(__file__).with_name("_pool_child.py")


def memfd_bytes(pid: int) -> int:
    """Real memory behind a process's kvpool memfds (st_blocks through /proc)."""
    total = 0
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            if os.readlink(f"{fd_dir}/{fd}").startswith("/memfd:kvpool-space"):
                total += os.stat(f"{fd_dir}/{fd}").st_blocks * 512
        except OSError:
            pass
    return total


def stop(p: subprocess.Popen[str]) -> None:
    p.kill()
    p.wait()
    for pipe in (p.stdin, p.stdout, p.stderr):
        if pipe is not None:
            pipe.close()


# ------------------------------------------------------------------ security

@pytest.mark.parametrize("bad", ["../x", "", "a" * 65, "a/b", ".hidden", "-x", "name with space", 7])
def test_bad_pool_names_are_refused_before_touching_the_filesystem(bad: object) -> None:
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(LedgerError, match="bad pool name"):
        Pool(bad)  # type: ignore[arg-type]
    assert set(os.listdir("/dev/shm")) == before


def test_the_ledger_segment_is_owner_only(pool_name: str) -> None:
    old = os.umask(0)
    try:
        Pool(pool_name, capacity=10 * PCB)
    finally:
        os.umask(old)
    mode = os.stat(f"/dev/shm/kvpool-{pool_name}").st_mode
    assert stat.S_IMODE(mode) == 0o600
    assert pool_name in list_pools()


def test_a_ledger_of_another_layout_version_is_refused(pool_name: str) -> None:
    Pool(pool_name, capacity=10 * PCB)
    path = f"/dev/shm/kvpool-{pool_name}"
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 99))  # the version field, after the 8-byte magic
    with pytest.raises(LedgerError, match="another layout version.*rm it: `kvpool pools --gc` removes only ledgers it can read"):
        Pool(pool_name)
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(LedgerError, match="another layout"):
        Pool(pool_name)


def own_memfds(prefix: str) -> list[int]:
    fd_dir = "/proc/self/fd"
    out = []
    for fd in os.listdir(fd_dir):
        try:
            if os.readlink(f"{fd_dir}/{fd}").startswith(f"/memfd:{prefix}"):
                out.append(int(fd))
        except OSError:
            pass
    return out


@pytest.mark.parametrize("kind", ["kv", "mirror channel"])
def test_a_peer_that_opens_a_memfd_through_proc_cannot_resize_it(pool_name: str, kind: str) -> None:
    # Regression (round 3, memfd_unsealed.py): a same-user process opened
    # /proc/<pid>/fd/<n>, ftruncate(0)'d the KV memfd, and the engine died of
    # SIGBUS at its next touch of KV memory. Now both memfds are sealed.
    prefix = "kvpool-space" if kind == "kv" else "kvpool-mirror"
    before = set(own_memfds(prefix))
    ranks = None if kind == "kv" else [1, 1]
    with KVSpace(G, pool=Pool(pool_name, capacity=4 * PCB), name="s", ranks=ranks, reserve_thread=False,
                 reserve=(0, 0)) as s:
        (fd,) = set(own_memfds(prefix)) - before
        peer = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # another open file, as a peer's
        try:
            size = os.fstat(peer).st_size
            for new_size in (0, size // 2, size * 2):
                with pytest.raises(PermissionError):
                    os.ftruncate(peer, new_size)
            with pytest.raises(OSError) as e:
                os.posix_fallocate(peer, size, 4096)  # growing by fallocate
            assert e.value.errno == errno.EPERM
            import fcntl

            with pytest.raises(PermissionError):  # F_SEAL_SEAL: nobody can seal our punch-holes away
                fcntl.fcntl(peer, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            assert os.fstat(peer).st_size == size
        finally:
            os.close(peer)
        if kind == "kv":  # the engine's memory is whole and usable
            ids = s.alloc(8)
            view = s.view(0, 0, torch.int64, (512,))
            view[torch.from_numpy(ids)] = 3
            assert int(view[torch.from_numpy(ids)].sum()) == 3 * 8 * 512
            s.free(ids)


def test_joining_a_missing_pool_without_create_fails(pool_name: str) -> None:
    with pytest.raises(LedgerError, match="does not exist"):
        Pool(pool_name, create=False)


def test_memory_released_by_one_tenant_reads_zeros_in_another(pool_name: str) -> None:
    pool = Pool(pool_name, capacity=2 * PCB)
    with KVSpace(G, pool=pool, name="a", reserve_thread=False, reserve=(0, 0)) as a:
        ids = a.alloc(8)  # the whole pool
        a.view(0, 0, torch.int64, (512,))[torch.from_numpy(ids)] = 7
        with KVSpace(G, pool=pool, name="b", reserve_thread=False, reserve=(0, 0)) as b:
            with pytest.raises(PoolExhausted):
                b.alloc(1)
            a.free(ids)  # released: the pool budget is back
            got = torch.from_numpy(b.alloc(8))
            for layer in b.tensors(torch.int64, (512,)):
                for buf in layer:
                    assert int(buf[got].abs().sum()) == 0


# ------------------------------------------------------- claim before commit

def test_claims_cap_the_pool_and_available_counts_the_budget(pool_name: str) -> None:
    pool = Pool(pool_name, capacity=5 * PCB)
    with KVSpace(G, pool=pool, name="a", reserve_thread=False, reserve=(0, 0)) as a, \
         KVSpace(G, pool=pool, name="b", reserve_thread=False, reserve=(0, 0)) as b:
        a.alloc(12)  # 3 pages
        assert b.available() == 8 and a.available() == 8
        with pytest.raises(PoolExhausted):
            b.alloc(9)
        b.alloc(8)
        assert pool.committed == 5 * PCB == a.allocated_bytes() + b.allocated_bytes()
        assert {t.name: t.committed_bytes for t in pool.tenants()} == {"a": 3 * PCB, "b": 2 * PCB}
    assert pool.committed == 0 and pool.tenants() == []


def test_each_tenants_alloc_and_shortage_counters_are_exact_after_a_known_sequence(pool_name: str) -> None:
    # Issue 13 item 4: the ledger counts, per tenant, each answer its space
    # gives an alloc (granted, or refused for lack of memory or admission),
    # once per call: the binding's non-blocking try that would block is no
    # answer; an empty alloc, the null block and a driver failure count for
    # nothing.
    pool = Pool(pool_name, capacity=5 * PCB)

    def counters() -> dict[str, tuple[int, int]]:
        return {t.name: (t.allocs, t.shortages) for t in pool.tenants()}

    with KVSpace(G, pool=pool, name="a", reserve_thread=False, reserve=(0, 0)) as a, \
         KVSpace(G, pool=pool, name="b", reserve_thread=False, reserve=(0, 0), null_block=True) as b:
        assert counters() == {"a": (0, 0), "b": (0, 0)}  # b's null block is no alloc of its engine
        held = a.alloc(12)  # 3 pages committed inline: tried non-blocking, then blocking; one grant
        a.alloc(0)
        a._inject_fault("commit", 1, errno.EIO)
        with pytest.raises(BackendError):
            a.alloc(1)  # a driver failure, not a shortage
        a._inject_fault("commit", 1, errno.ENOSPC)
        with pytest.raises(PoolExhausted):
            a.alloc(4)  # out of memory at commit: a shortage
        with pytest.raises(PoolExhausted):
            b.alloc(9)  # 3 on its pinned page + 4 on the last free page of the pool
        with pytest.raises(RequestTooLarge):
            b.alloc(100)  # beyond the pool's capacity: refused at admission
        b.alloc(7)
        a.free(held[:2])
        a.alloc(2)  # the holes just freed: no commit, granted non-blocking
        assert counters() == {"a": (2, 1), "b": (1, 2)}
        # The ledger's counts are the space's own.
        for space in (a, b):
            st = space.stats()
            assert counters()[space.name] == (st.allocs, st.shortages)
        slot_a = next(t.slot for t in pool.tenants() if t.name == "a")
    with KVSpace(G, pool=pool, name="c", reserve_thread=False, reserve=(0, 0)) as c:
        # A new tenant in a's old slot starts from zero.
        assert [(t.slot, t.allocs, t.shortages) for t in pool.tenants()] == [(slot_a, 0, 0)]
        c.alloc(1)
        assert counters() == {"c": (1, 0)}


def test_tenant_names_are_unique_in_a_pool(pool_name: str) -> None:
    pool = Pool(pool_name, capacity=5 * PCB)
    with KVSpace(G, pool=pool, name="same", reserve_thread=False):
        with pytest.raises(Exception, match="already has a live tenant"):
            KVSpace(G, pool=pool, name="same", reserve_thread=False)


def test_a_pool_limit_set_by_an_operator_is_applied_natively(pool_name: str) -> None:
    pool = Pool(pool_name, capacity=50 * PCB)
    with KVSpace(G, pool=pool, name="eng", reserve_thread=False, reserve=(0, 4)) as s:
        ids = s.alloc(16)  # 4 pages
        s.free(ids[:8])    # 2 idle reserve pages kept (max 4)
        assert pool.set_limit("eng", 3 * PCB) == "applied"
        # The tenant's pool watcher gives the idle page above the limit back.
        wait_until(lambda: s.allocated_bytes() <= 3 * PCB, "the idle page above the limit goes back")
        assert s.allocated_bytes() == 3 * PCB
        assert s.available() == 4  # 2 full pages + 1 idle page within the limit
        with pytest.raises(PoolExhausted):
            s.alloc(5)
        assert pool.set_limit("eng", 3 * PCB, revision=0) == "stale"
        assert pool.set_limit("eng", 4 * PCB, revision=1) == "conflict"
        assert pool.set_limit("eng", 3 * PCB, revision=1) == "same"


# ----------------------------------------------------- dead-engine reclaim

def _start_holder(pool_name: str, tmp_path: pathlib.Path, blocks: int) -> subprocess.Popen[str]:
    code = textwrap.dedent(
        f"""
        import sys
        from kvpool import Geometry, KVSpace, Pool
        g = Geometry(1, 2, 4096, 256, page_bytes=16384)
        s = KVSpace(g, pool=Pool({pool_name!r}, create=False), name="holder", reserve_thread=False, reserve=(0, 0))
        ids = s.alloc({blocks})
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() == "free":
                s.free(ids); s.trim(); print("freed", flush=True)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_a_killed_tenant_has_its_budget_returned(pool_name: str, tmp_path: pathlib.Path) -> None:
    pool = Pool(pool_name, capacity=8 * PCB)
    p = _start_holder(pool_name, tmp_path, 32)  # the whole pool
    try:
        assert pool.committed == 8 * PCB
        assert memfd_bytes(p.pid) == 8 * PCB
        with KVSpace(G, pool=pool, name="me", reserve_thread=False, reserve=(0, 0)) as me:
            with pytest.raises(PoolExhausted):
                me.alloc(1)
            p.kill()
            p.wait()
            assert len(me.alloc(32)) == 32  # the next claim reaps the dead tenant
            assert [t.name for t in pool.tenants()] == ["me"]
    finally:
        stop(p)


# --------------------------------------------------- many processes, kills

@pytest.mark.timeout(900)
def test_four_processes_with_kills_keep_the_ledger_exact(pool_name: str, tmp_path: pathlib.Path) -> None:
    # Counts kills and operations, never what happens in a given time: the old
    # form counted kills inside a fixed 8 s window and failed on a busy machine
    # (issue 10, item 12).
    kills_wanted, ops_between_kills = 8, 20
    capacity = 24 * PCB  # small: tenants run into each other constantly
    pool = Pool(pool_name, capacity=capacity)
    ctl_path = tmp_path / "ctl"
    ctl_path.write_bytes(bytes(64))
    ctl = mmap.mmap(os.open(ctl_path, os.O_RDWR), 64)
    procs: dict[int, subprocess.Popen[str]] = {}

    pending: dict[int, subprocess.Popen[str]] = {}

    def start(i: int) -> None:
        # Non-blocking: a new tenant joins the sampled set once it says ready.
        pending[i] = subprocess.Popen(
            [sys.executable, str(CHILD), pool_name, str(i), str(ctl_path)],
            cwd=tmp_path, stdout=subprocess.PIPE, text=True)

    def promote_ready() -> bool:
        for i, p in list(pending.items()):
            assert p.stdout is not None
            if select.select([p.stdout], [], [], 0)[0]:
                assert p.stdout.readline().strip() == "ready"
                procs[i] = pending.pop(i)
        return not pending

    def op_counts() -> dict[int, int]:
        # Each child counts its operations at ctl[8 + 8 * index] (pid -> count).
        return {p.pid: struct.unpack_from("<Q", ctl, 8 + 8 * i)[0] for i, p in procs.items()}

    def sample() -> None:
        # Reap before pausing: budget coming back wakes the reserve threads
        # (the pool watcher), which must settle before memory is compared.
        pool.reap()
        # Pause first, then promote: a child that says ready from now on sees
        # the flag before its first operation; starting children commit nothing.
        ctl[0] = 1
        promote_ready()
        wait_until(lambda: all(ctl[1 + i] == 1 for i in procs), "every tenant pauses")
        assert pool.reap() == 0  # nothing died while paused
        everyone = [*procs.values(), *pending.values()]
        # Paused tenants do no alloc/free, but one tenant's settling release
        # can wake another's reserve thread (budget came back) for one more
        # bounded commit: compare at quiescence, where a leak still shows.
        books: list[tuple[int, int]] = []

        def quiet() -> bool:
            committed, real = pool.committed, sum(memfd_bytes(p.pid) for p in everyone)
            books.append((committed, real))
            return committed == real and pool.committed == committed

        wait_until(quiet, lambda: f"the ledger matches real memory (last committed, real: {books[-1]})")
        assert pool.committed <= capacity
        tenants = {t.pid for t in pool.tenants()}
        assert {p.pid for p in procs.values()} <= tenants <= {p.pid for p in everyone}
        ctl[0] = 0

    try:
        for i in range(4):
            start(i)
        wait_until(promote_ready, "4 tenants start")
        samples = 0
        for kill in range(kills_wanted):
            # At most one tenant is still starting (the last one killed): kills
            # overlap a join, and the count of kills does not outrun restarts.
            wait_until(lambda: (promote_ready(), len(procs) >= 3)[1], f"a restarted tenant starts before kill {kill}")
            # Survivors keep going while others die: every tenant alive at the
            # previous kill does operations since (a stalled one fails here).
            since = op_counts()
            wait_until(lambda: all(n >= since[pid] + ops_between_kills
                                   for pid, n in op_counts().items() if pid in since),
                       f"every live tenant does {ops_between_kills} operations after kill {kill}")
            sample()
            victim = sorted(procs)[kill % len(procs)]
            procs[victim].send_signal(signal.SIGKILL)
            stop(procs.pop(victim))
            ctl[1 + victim] = 0
            sample()  # the dead budget comes back at the next lock
            samples += 2
            start(victim)
        assert samples == 2 * kills_wanted
    finally:
        ctl[0] = 0
        for p in [*procs.values(), *pending.values()]:
            stop(p)


# --------------------------------------------------- cross-process wake-ups

@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_waiter_is_granted_when_another_process_frees(
    anyio_backend: str, pool_name: str, tmp_path: pathlib.Path
) -> None:
    import anyio

    from kvpool import KVCacheManager

    pool = Pool(pool_name, capacity=8 * PCB)
    p = _start_holder(pool_name, tmp_path, 32)  # holds the whole pool
    try:
        async with KVCacheManager(G, pool=pool, name="waiter", reserve=(0, 0), reserve_thread=False) as m:
            got: list[int] = []

            async def want() -> None:
                got.extend((await m.alloc(16)).tolist())

            async with anyio.create_task_group() as tg:
                tg.start_soon(want)
                for _ in range(20):
                    await anyio.lowlevel.checkpoint()
                assert got == [] and m.waiting == 1
                assert [t.waiting for t in pool.tenants() if t.name == "waiter"] == [1]
                assert p.stdin is not None
                p.stdin.write("free\n")
                p.stdin.flush()
                # No Python call in this process: the release reaches us through
                # the ledger futex -> native watcher -> eventfd -> event loop.
                await until(lambda: bool(got), "the other process's free wakes the waiter")
            assert len(got) == 16
    finally:
        stop(p)


def test_a_killed_tenant_not_yet_waited_for_is_reaped(pool_name: str, tmp_path: pathlib.Path) -> None:
    # Bug: a SIGKILLed tenant stays a zombie until its parent waits; kill(pid, 0)
    # and the start time still matched, so its budget stayed claimed.
    pool = Pool(pool_name, capacity=8 * PCB)
    p = _start_holder(pool_name, tmp_path, 32)
    try:
        p.send_signal(signal.SIGKILL)
        def zombie() -> bool:  # wait for the zombie, without reaping it
            with open(f"/proc/{p.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"

        wait_until(zombie, "the killed tenant becomes a zombie")
        assert pool.tenants() == [] and pool.committed == 0
    finally:
        stop(p)


def test_a_new_limit_is_judged_at_once_even_if_the_tenant_cannot_report(
    pool_name: str, tmp_path: pathlib.Path
) -> None:
    # Bug: limit_state was only what the tenant last reported, so right after
    # `kvpool limit` a reader could see a limit below use next to "applied".
    pool = Pool(pool_name, capacity=8 * PCB)
    p = _start_holder(pool_name, tmp_path, 16)  # 4 pages
    try:
        p.send_signal(signal.SIGSTOP)  # its watcher cannot report anything now
        assert pool.set_limit("holder", 2 * PCB) == "applied"
        (t,) = pool.tenants()
        assert (t.limit_bytes, t.limit_state) == (2 * PCB, "deferred")
        assert pool.set_limit("holder", None) == "applied"
        assert pool.tenants()[0].limit_state == "applied"
    finally:
        p.send_signal(signal.SIGCONT)
        stop(p)


def test_a_duplicate_tenant_name_is_a_ledger_error_not_a_geometry_error(pool_name: str) -> None:
    # Bug: every Invalid from create_space became GeometryError, so a name
    # taken in the pool read as a bad geometry.
    pool = Pool(pool_name, capacity=5 * PCB)
    with KVSpace(G, pool=pool, name="same", reserve_thread=False):
        with pytest.raises(LedgerError, match="already has a live tenant named 'same'"):
            KVSpace(G, pool=pool, name="same", reserve_thread=False)
        assert [t.name for t in pool.tenants()] == ["same"]


def test_a_null_block_that_does_not_fit_the_pool_asks_for_one_block(pool_name: str) -> None:
    # Bug: the shortage said "requested 0 blocks": the null block is one.
    pool = Pool(pool_name, capacity=PCB // 2)
    with pytest.raises(PoolExhausted) as err:
        KVSpace(G, pool=pool, name="nb", null_block=True, reserve_thread=False)
    assert (err.value.requested, err.value.available) == (1, 0)
    assert pool.tenants() == [] and pool.committed == 0  # the failed space gave its slot back


def test_a_failed_space_creation_never_unregisters_a_slot_another_thread_took(pool_name: str) -> None:
    # Bug: create_space unregistered the tenant slot again after a failed
    # Space::create, whose ~Space had already given it back; with the GIL
    # released, another thread of this process could have registered in that
    # slot meanwhile, and lost it (the pid matches) while its space lived on.
    import threading

    pool = Pool(pool_name, capacity=PCB // 2)  # no room for a null block's page
    stop = threading.Event()

    def fail_forever() -> None:
        while not stop.is_set():
            with pytest.raises(PoolExhausted):
                KVSpace(G, pool=pool, name="failing", null_block=True, reserve_thread=False)

    lost = 0
    t = threading.Thread(target=fail_forever)
    t.start()
    try:
        for i in range(300):
            with KVSpace(G, pool=pool, name=f"live-{i}", reserve_thread=False):
                if f"live-{i}" not in {x.name for x in pool.tenants()}:
                    lost += 1
    finally:
        stop.set()
        t.join()
    assert lost == 0


def test_asking_for_another_capacity_of_an_existing_pool_raises_and_changes_nothing(pool_name: str) -> None:
    # Issue 32: re-creating a pool with another capacity silently returned the old one.
    Pool(pool_name, capacity=8 * MiB)
    with pytest.raises(LedgerError, match=rf"pool '{pool_name}' exists with capacity 8.0 MiB, not the 16.0 MiB"):
        Pool(pool_name, capacity=16 * MiB)
    assert Pool(pool_name).capacity == 8 * MiB  # no capacity: joins whatever it is
    assert Pool(pool_name, capacity=8 * MiB).capacity == 8 * MiB  # the same capacity joins too
    assert Pool(pool_name, create=False).capacity == 8 * MiB
