"""The operator CLI (``kvpool pools / top / limit``) end to end.

Tenants are real child processes holding real KV spaces in a real shared
pool ledger; the CLI runs as its own process, exactly as an operator would
run it. Each test gets a pool of its own, removed at teardown.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvpool import Geometry, LedgerError, Pool, list_pools
from kvpool.cli import main, parse_size

from ._helpers import wait_until

KiB = 1024
MiB = 1 << 20
# 4 regions x 64 KiB pages: one page commit is 256 KiB and holds 16 blocks.
GEOMETRY = Geometry(2, 2, 4 * KiB, 256, page_bytes=64 * KiB)
PCB = GEOMETRY.page_commit_bytes
PER_PAGE = len(GEOMETRY.block_range(0))
CAPACITY = 64 * MiB

# A tenant: joins the pool, allocates `pages` whole pages (one alloc per
# page), says "ready", then obeys stdin: "free K" frees its K first allocs,
# "alloc N" tries to allocate N blocks, "stats" reports. No reserve thread
# and no idle reserve, so committed memory is exactly the pages in use, and
# any limit the operator sets is applied by the native pool watcher thread
# alone: this loop never calls kvpool while it waits on stdin.
CHILD = textwrap.dedent(
    """
    import os, sys
    from kvpool import Geometry, KVSpace, Pool, PoolExhausted
    pool_name, name, pages, capacity = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    g = Geometry(2, 2, 4 * 1024, 256, page_bytes=64 * 1024)
    per_page = len(g.block_range(0))
    space = KVSpace(g, pool=Pool(pool_name, capacity=capacity), name=name, reserve_thread=False, reserve=(0, 0))
    allocs = [space.alloc(per_page) for _ in range(pages)]

    def report(tag):
        st = space.stats()
        print(tag, os.getpid(), st.committed_bytes, st.pages_active, st.pages_reserve, flush=True)

    report("ready")
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "free":
            k = int(cmd[1])
            for ids in allocs[:k]:
                space.free(ids)
            del allocs[:k]
            report("freed")
        elif cmd[0] == "alloc":
            try:
                allocs.append(space.alloc(int(cmd[1])))
                print("alloc ok", flush=True)
            except PoolExhausted as e:
                print("alloc exhausted", e.available, flush=True)
        elif cmd[0] == "stats":
            report("stats")
    space.close()
    """
)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[str]
    pid: int = 0
    committed: int = 0
    pages_active: int = 0

    def send(self, line: str) -> list[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline().split()
        assert out, f"tenant {self.name} died (rc {self.proc.poll()})"
        return out


@dataclass
class Tenants:
    pool: str
    cwd: Path
    children: dict[str, Child] = field(default_factory=dict)

    def start(self, pages: dict[str, int]) -> None:
        """Start one tenant per entry (in parallel) and wait until each is ready."""
        script = self.cwd / "tenant.py"
        script.write_text(CHILD)
        for name, n in pages.items():
            proc = subprocess.Popen(
                [sys.executable, str(script), self.pool, name, str(n), str(CAPACITY)],
                cwd=self.cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            self.children[name] = Child(name, proc)
        for name, n in pages.items():
            c = self.children[name]
            assert c.proc.stdout is not None
            line = c.proc.stdout.readline().split()
            assert line and line[0] == "ready", f"tenant {name} failed to start (rc {c.proc.wait()})"
            c.pid, c.committed, c.pages_active = int(line[1]), int(line[2]), int(line[3])
            assert c.pid == c.proc.pid
            assert c.pages_active == n and c.committed == n * PCB

    def stop_all(self) -> None:
        for c in self.children.values():
            if c.proc.poll() is None:
                c.proc.kill()
            c.proc.wait()
            for f in (c.proc.stdin, c.proc.stdout):
                if f is not None:
                    f.close()


@pytest.fixture
def tenants(pool_name: str, tmp_path: Path) -> Iterator[Tenants]:
    Pool(pool_name, capacity=CAPACITY)  # created here, so the children's race to create it does not matter
    t = Tenants(pool_name, tmp_path)
    try:
        yield t
    finally:
        t.stop_all()


def kvpool_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI as its own process (from a folder that is not the repo, so it imports the installed package)."""
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60)


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The same CLI code in this process (which is no tenant): saves a ~1 s interpreter start per call."""
    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse errors
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def top_json(cwd: Path, pool: str) -> dict[str, Any]:
    r = kvpool_cli(cwd, "top", pool, "--once", "--json")
    assert r.returncode == 0, r.stderr
    snap: dict[str, Any] = json.loads(r.stdout)
    return snap


def top_json_inproc(capsys: pytest.CaptureFixture[str], pool: str) -> dict[str, Any]:
    rc, out, err = run_main(capsys, "top", pool, "--once", "--json")
    assert rc == 0, err
    snap: dict[str, Any] = json.loads(out)
    return snap


def by_name(snap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in snap["tenants"]}


def tenant_info(pool: str, name: str) -> Any:
    return {t.name: t for t in Pool(pool, create=False).tenants()}[name]


@pytest.mark.timeout(60)
def test_top_once_json_shows_live_tenants(tenants: Tenants, capsys: pytest.CaptureFixture[str]) -> None:
    tenants.start({"engine-a": 4, "engine-b": 2})
    snap = top_json(tenants.cwd, tenants.pool)
    assert snap["pool"] == tenants.pool
    assert snap["capacity"] == CAPACITY
    rows = by_name(snap)
    assert set(rows) == {"engine-a", "engine-b"}
    for name, child in tenants.children.items():
        row = rows[name]
        assert row["pid"] == child.proc.pid
        assert row["committed_bytes"] == child.pages_active * PCB
        assert row["limit_bytes"] is None
        assert row["limit_state"] == "applied"
        assert row["waiting"] == 0
        assert row["reserve_pages"] == 0
        assert {"slot", "limit_revision"} <= set(row)
    assert snap["committed"] == (4 + 2) * PCB

    # The human-readable snapshot (a rich table) names both tenants too.
    rc, out, err = run_main(capsys, "top", tenants.pool, "--once")
    assert rc == 0, err
    assert "engine-a" in out and "engine-b" in out
    assert str(tenants.children["engine-a"].pid) in out
    assert "1.5 MiB of 64.0 MiB committed" in out  # header: pool committed / capacity


@pytest.mark.timeout(60)
def test_limit_deferred_then_applied_natively(tenants: Tenants, capsys: pytest.CaptureFixture[str]) -> None:
    tenants.start({"engine-a": 4, "engine-b": 2})
    a = tenants.children["engine-a"]

    # Below its use (4 pages = 1 MiB): the ledger takes the new revision ...
    r = kvpool_cli(tenants.cwd, "limit", tenants.pool, "engine-a", "512KiB")
    assert (r.returncode, r.stdout.strip()) == (0, "applied"), r.stderr
    # ... and engine-a's native watcher reports it cannot meet it yet (no idle page to give back).
    wait_until(lambda: tenant_info(tenants.pool, "engine-a").limit_state == "deferred",
               "engine-a's watcher reports the limit deferred", interval=0.02)
    rows = by_name(top_json(tenants.cwd, tenants.pool))
    assert rows["engine-a"]["limit_bytes"] == 512 * KiB
    assert rows["engine-a"]["limit_revision"] == 1
    assert rows["engine-a"]["limit_state"] == "deferred"
    assert rows["engine-a"]["committed_bytes"] == 4 * PCB
    assert rows["engine-b"]["limit_bytes"] is None and rows["engine-b"]["limit_state"] == "applied"

    # Growth stopped at once, natively: even one block more is refused.
    assert a.send("alloc 1")[:2] == ["alloc", "exhausted"]

    # The engine finishes 3 of its 4 requests: pages go back and the limit is met.
    freed = a.send("free 3")
    assert freed[0] == "freed" and int(freed[2]) == PCB
    wait_until(lambda: by_name(top_json_inproc(capsys, tenants.pool))["engine-a"]["limit_state"] == "applied",
               "kvpool top shows engine-a's limit applied", interval=0.02)
    snap = top_json_inproc(capsys, tenants.pool)
    rows = by_name(snap)
    assert rows["engine-a"]["limit_bytes"] == 512 * KiB
    assert rows["engine-a"]["committed_bytes"] == PCB
    assert snap["committed"] == (1 + 2) * PCB

    # Clearing the limit: growth is allowed again.
    assert run_main(capsys, "limit", tenants.pool, "engine-a", "none")[:2] == (0, "applied\n")
    wait_until(lambda: tenant_info(tenants.pool, "engine-a").limit_bytes is None,
               "engine-a's limit is cleared", interval=0.02)
    assert a.send(f"alloc {3 * PER_PAGE}") == ["alloc", "ok"]


@pytest.mark.timeout(60)
def test_limit_revisions_stale_conflict_same(tenants: Tenants, capsys: pytest.CaptureFixture[str]) -> None:
    tenants.start({"engine-a": 1})
    pool, cwd = tenants.pool, tenants.cwd
    assert run_main(capsys, "limit", pool, "engine-a", "8M", "--revision", "5")[:2] == (0, "applied\n")
    # Refusals through the real process boundary: output and exit status 1.
    r = kvpool_cli(cwd, "limit", pool, "engine-a", "4M", "--revision", "4")
    assert (r.returncode, r.stdout.strip()) == (1, "stale"), r.stderr
    r = kvpool_cli(cwd, "limit", pool, "engine-a", "4M", "--revision", "5")
    assert (r.returncode, r.stdout.strip()) == (1, "conflict"), r.stderr
    assert run_main(capsys, "limit", pool, "engine-a", f"{8 * MiB}B", "--revision", "5")[:2] == (0, "same\n")
    info = tenant_info(pool, "engine-a")
    assert (info.limit_bytes, info.limit_revision) == (8 * MiB, 5)
    # Without --revision the next one is taken.
    assert run_main(capsys, "limit", pool, "engine-a", "1g")[:2] == (0, "applied\n")
    info = tenant_info(pool, "engine-a")
    assert (info.limit_bytes, info.limit_revision) == (1 << 30, 6)
    # Errors: unknown tenant, missing pool, bad size, bad revision -> 2, and nothing changed.
    rc, out, err = run_main(capsys, "limit", pool, "engine-zz", "1M")
    assert rc == 2 and "engine-zz" in err and out == ""
    rc, out, err = run_main(capsys, "limit", "missing-pool-xyz", "engine-a", "1M")
    assert rc == 2 and "missing-pool-xyz" in err and out == ""
    rc, out, err = run_main(capsys, "limit", pool, "engine-a", "12 parsecs")
    assert rc == 2 and "bad size" in err and out == ""
    rc, out, err = run_main(capsys, "limit", pool, "engine-a", "1M", "--revision", "-3")
    assert rc == 2 and "revision" in err and out == ""
    info = tenant_info(pool, "engine-a")
    assert (info.limit_bytes, info.limit_revision) == (1 << 30, 6)


@pytest.mark.timeout(60)
def test_pools_and_errors(tenants: Tenants, capsys: pytest.CaptureFixture[str]) -> None:
    tenants.start({"engine-a": 3, "engine-b": 1})
    # The console script this time (the same entry point an operator runs).
    exe = shutil.which("kvpool") or str(Path(sys.executable).parent / "kvpool")
    r = subprocess.run([exe, "pools", "--json"], cwd=tenants.cwd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = {p["name"]: p for p in json.loads(r.stdout)}
    assert rows[tenants.pool] == {"name": tenants.pool, "capacity": CAPACITY, "committed": 4 * PCB, "tenants": 2,
                                  "status": "in use", "stale": False}
    rc, out, err = run_main(capsys, "pools")
    assert rc == 0 and tenants.pool in out and "1.0" in out

    r = kvpool_cli(tenants.cwd, "top", "missing-pool-xyz", "--once")
    assert r.returncode == 2
    assert "missing-pool-xyz" in r.stderr and "does not exist" in r.stderr and r.stdout == ""
    for args in (("top", "../x", "--once", "--json"), ("top", "../x"), ("limit", "../x", "engine-a", "1M")):
        rc, out, err = run_main(capsys, *args)
        assert rc == 2 and "bad pool name" in err and out == "", args
    assert not any(p.startswith("..") or p == "x" for p in list_pools())
    rc, out, err = run_main(capsys, "top", tenants.pool, "--json")  # live mode has no JSON
    assert rc == 2 and "--once" in err


@pytest.mark.timeout(60)
def test_killed_tenant_leaves_top(tenants: Tenants, capsys: pytest.CaptureFixture[str]) -> None:
    tenants.start({"engine-a": 2, "engine-b": 3})
    b = tenants.children["engine-b"]
    assert top_json_inproc(capsys, tenants.pool)["committed"] == 5 * PCB
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait()  # reaped by us: the pid is gone, not a zombie
    snap = top_json(tenants.cwd, tenants.pool)
    assert set(by_name(snap)) == {"engine-a"}
    assert snap["committed"] == 2 * PCB
    # The survivor is untouched.
    assert by_name(snap)["engine-a"]["pid"] == tenants.children["engine-a"].pid
    assert by_name(snap)["engine-a"]["committed_bytes"] == 2 * PCB


@pytest.mark.timeout(60)
def test_top_piped_prints_one_table_per_interval_and_exits_on_ctrl_c(tenants: Tenants) -> None:
    tenants.start({"engine-a": 1})
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "top", tenants.pool, "--interval", "0.05"],
                            cwd=tenants.cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        frames = 0
        while frames < 3:  # whole tables, one after another: the view refreshes
            line = proc.stdout.readline()
            assert line, proc.communicate()
            frames += line.startswith(f"pool {tenants.pool}:")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "Traceback" not in err


@pytest.mark.timeout(60)
def test_top_on_a_terminal_redraws_live_and_exits_on_ctrl_c(tenants: Tenants) -> None:
    import os
    import pty

    tenants.start({"engine-a": 1})
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "top", tenants.pool, "--interval", "0.05"],
                            cwd=tenants.cwd, stdout=follower, stderr=subprocess.PIPE, text=True)
    os.close(follower)
    seen = b""
    try:
        while seen.count(b"engine-a") < 3:  # the first frame and two redraws
            chunk = os.read(leader, 4096)
            assert chunk, proc.communicate()
            seen += chunk
        assert b"\x1b[?25l" in seen  # a terminal gets the live view: cursor hidden, redrawn in place
        proc.send_signal(signal.SIGINT)
        while proc.poll() is None:
            try:
                if not os.read(leader, 4096):
                    break
            except OSError:  # EIO: the child closed the terminal
                break
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        os.close(leader)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def test_size_parsing() -> None:
    assert parse_size("0B") == 0
    assert parse_size("4096B") == parse_size("4096 b") == 4096
    assert parse_size("64K") == parse_size("64kib") == parse_size("64KB") == 64 * KiB
    assert parse_size("512MiB") == parse_size("512m") == 512 * MiB
    assert parse_size("2G") == parse_size("2gib") == 2 << 30
    assert parse_size("1T") == 1 << 40
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("0.25K") == 256 and parse_size(".5M") == 512 * KiB
    with pytest.raises(argparse.ArgumentTypeError, match="whole number of bytes"):
        parse_size("1.1G")  # 1181116006.4 bytes
    assert parse_size("NONE") is None and parse_size("none") is None
    for bad in ("", "1.3B", "G", "abc", "1 2", "1GB2", "1BB", "1Bi", "5X"):
        with pytest.raises(argparse.ArgumentTypeError, match="bad size"):
            parse_size(bad)
    # Issue 32: a bare number meant bytes (`kvpool limit P t 10` set a 10-byte
    # limit), and a negative one got argparse's "missing SIZE".
    for bare in ("0", "10", "4096", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="needs a unit"):
            parse_size(bare)
    for negative in ("-1", "-5M", "-0.5G"):
        with pytest.raises(argparse.ArgumentTypeError, match="cannot be negative"):
            parse_size(negative)
    with pytest.raises(LedgerError):
        Pool("../x", create=False)
