"""Operator experience of the CLI: start-up without torch, finding pools,
whole tenant names, stale pools and their removal.

Tenants here are KV spaces of this test process (or a child killed to make a
dead tenant); the CLI runs as its own process where start-up is the point,
in this process (``main``) elsewhere. Every pool is private to its test.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvpool import Geometry, KVSpace, Pool, list_pools
from kvpool import _top
from kvpool.cli import main
from kvpool.pool import ledger_path

KiB = 1024
MiB = 1 << 20
GEOMETRY = Geometry(2, 2, 4 * KiB, 256, page_bytes=64 * KiB)  # one page commit: 256 KiB
PCB = GEOMETRY.page_commit_bytes
PER_PAGE = len(GEOMETRY.block_range(0))

# Put on PYTHONPATH, this makes `import torch` (and kvpool's torch-dependent
# modules) raise ImportError in the CLI's process.
NO_TORCH = textwrap.dedent(
    """
    import sys
    for name in ("torch", "kvpool.manager", "kvpool.space", "kvpool.demo", "kvpool.geometry"):
        sys.modules[name] = None
    """
)


@pytest.fixture
def pools(pool_names: Callable[[], str]) -> Callable[..., str]:
    """Make pools with private names (conftest.py's ``pool_names``: every one is removed at teardown)."""

    def make(capacity: int = 64 * MiB) -> str:
        name = pool_names()
        Pool(name, capacity=capacity)
        return name

    return make


def cli(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, env=env)


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse: --help, --version, bad arguments
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.timeout(120)
def test_operator_commands_work_with_torch_unimportable(
    tmp_path: Path, pools: Callable[..., str], make_space: Callable[..., KVSpace]
) -> None:
    name = pools()
    space = make_space(GEOMETRY, pool=Pool(name, create=False), name="engine-a")
    space.alloc(PER_PAGE)
    (tmp_path / "sitecustomize.py").write_text(NO_TORCH)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True,
                           timeout=60)
    assert probe.returncode != 0 and "import of torch halted" in probe.stderr  # the shim works

    r = cli(tmp_path, "pools", env=env)
    assert r.returncode == 0 and name in r.stdout, r.stderr
    r = cli(tmp_path, "pools", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert {p["name"]: p for p in json.loads(r.stdout)}[name]["committed"] == PCB
    r = cli(tmp_path, "top", name, "--once", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert [(t["name"], t["committed_bytes"]) for t in json.loads(r.stdout)["tenants"]] == [("engine-a", PCB)]
    r = cli(tmp_path, "top", name, "--once", env=env)
    assert r.returncode == 0 and "engine-a" in r.stdout, r.stderr
    r = cli(tmp_path, "limit", name, "engine-a", "1M", env=env)
    assert (r.returncode, r.stdout) == (0, "applied\n"), r.stderr
    r = cli(tmp_path, "metrics", name, env=env)
    assert r.returncode == 0, r.stderr
    assert f'kvpool_tenant_committed_bytes{{pool="{name}",tenant="engine-a"}} {float(PCB)}' in r.stdout
    r = cli(tmp_path, "--version", env=env)
    assert r.returncode == 0 and r.stdout.strip() == f"kvpool {importlib.metadata.version('kvpool')}"
    # The demo is the command that needs torch: it says so instead of pretending.
    r = cli(tmp_path, "demo", "--help", env=env)
    assert r.returncode != 0 and "torch" in r.stderr


def test_importing_kvpool_imports_no_torch() -> None:
    code = "import sys, kvpool, kvpool.cli, kvpool.metrics; print(sorted(m for m in ('torch', " \
           "'kvpool.manager', 'kvpool.space', 'kvpool.geometry') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert (r.returncode, r.stdout.strip()) == (0, "[]"), r.stderr


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_main(capsys, "--version")
    assert (rc, out.strip()) == (0, f"kvpool {importlib.metadata.version('kvpool')}")
    rc, out, _ = run_main(capsys, "--help")
    assert rc == 0
    for command in ("demo", "pools", "top", "limit", "metrics"):
        assert command in out
    rc, out, _ = run_main(capsys, "demo", "--help")  # the demo's own options, from kvpool.demo.cli
    assert rc == 0 and "--engines" in out and "kvpool demo" in out
    rc, _, err = run_main(capsys, "pools", "--bogus")
    assert rc == 2 and "--bogus" in err


def test_top_without_a_pool_name_uses_KVPOOL_POOL(
    pools: Callable[..., str], make_space: Callable[..., KVSpace], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = pools()
    make_space(GEOMETRY, pool=Pool(name, create=False), name="engine-a")
    monkeypatch.setenv("KVPOOL_POOL", name)
    rc, out, err = run_main(capsys, "top", "--once", "--json")
    assert rc == 0, err
    snap = json.loads(out)
    assert snap["pool"] == name and [t["name"] for t in snap["tenants"]] == ["engine-a"]


def test_a_missing_pool_error_names_the_pools_that_exist(
    pools: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    name = pools()
    for args in (("top", "no-such-pool-xyz", "--once"), ("limit", "no-such-pool-xyz", "engine-a", "1M"),
                 ("metrics", "no-such-pool-xyz")):
        rc, out, err = run_main(capsys, *args)
        assert rc == 2 and out == "", args
        assert "'no-such-pool-xyz' does not exist" in err and name in err and "kvpool pools" in err, err


def snap_of(*names: str) -> dict[str, Any]:
    """A snapshot as `top` reads it, with made-up tenants (rendering only)."""
    tenants = [{"slot": i, "pid": 4_000_000 + i, "name": n, "committed_bytes": 3 * MiB, "limit_bytes": None,
                "limit_revision": 0, "limit_state": "applied", "waiting": 2, "reserve_pages": 1,
                "guarantee_bytes": 2 * MiB, "guarantee_setting": None, "guarantee_revision": 0,
                "borrowed_bytes": MiB, "want_bytes": 0, "lending": False, "visible": True}
               for i, n in enumerate(names)]
    return {"pool": "p", "capacity": 64 * MiB, "committed": 3 * MiB * len(names), "tenants": tenants}


def rendered(snap: dict[str, Any], width: int) -> str:
    console = Console(width=width, file=io.StringIO(), highlight=False, color_system=None)
    console.print(_top.render(snap, console))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def test_top_shows_whole_tenant_names_and_pids_when_they_fit() -> None:
    name = "vllm-serve-llama-3-8b-instruct-224567"
    out = rendered(snap_of(name, "engine-0"), 120)
    assert name in out and "4000000" in out and "shortened" not in out and "left out" not in out
    header = next(line for line in out.splitlines() if line.startswith("TENANT"))
    assert header.split() == ["TENANT", "PID", "COMMITTED", "GUARANTEE", "BORROWED", "LIMIT", "WAITING", "IDLE",
                              "PAGES", "STATE"]  # one line: nothing wrapped


def test_top_at_80_columns_keeps_short_names_whole_and_leaves_out_the_least_telling_column() -> None:
    out = rendered(snap_of("vllm-224567", "vllm-224568"), 80)
    assert all(len(line) <= 80 for line in out.splitlines())
    assert "vllm-224567" in out and "vllm-224568" in out
    header = next(line for line in out.splitlines() if line.startswith("TENANT"))
    assert header.split() == ["TENANT", "PID", "COMMITTED", "GUARANTEE", "BORROWED", "LIMIT", "WAITING", "STATE"]
    assert "IDLE PAGES left out" in out and "--json" in out


def test_top_at_80_columns_shortens_long_names_in_the_middle_keeping_the_identifying_end() -> None:
    long = "vllm-serve-meta-llama-3-70b-instruct-tp8-replica-b-" + "224567"
    out = rendered(snap_of(long, "vllm-serve-meta-llama-3-70b-instruct-tp8-replica-b-224568"), 80)
    assert all(len(line) <= 80 for line in out.splitlines())
    assert "224567" in out and "224568" in out  # the ends that tell the two apart
    assert "vllm-" in out and "…" in out and long not in out
    assert "names shortened" in out and "--json" in out  # and where the whole names are
    header = next(line for line in out.splitlines() if line.startswith("TENANT")).split()
    assert {"PID", "COMMITTED", "LIMIT", "WAITING"} <= set(header)  # never left out


def test_shorten_middle() -> None:
    assert _top.shorten_middle("engine-0", 12) == "engine-0"
    s = _top.shorten_middle("abcdefghijklmnopqrstuvwxyz", 11)
    assert len(s) == 11 and s.startswith("abcde") and s.endswith("vwxyz") and "…" in s


@pytest.mark.parametrize("name", ["[/x]", "[bold]engine[/bold]", "[link=x]y", "a]b[c"])
def test_top_renders_names_that_look_like_markup_verbatim(name: str) -> None:
    out = rendered(snap_of(name), 100)  # a markup parse of "[/x]" would raise MarkupError
    assert name in out


def test_top_shows_a_column_only_when_the_ledger_has_its_field(monkeypatch: pytest.MonkeyPatch) -> None:
    snap = snap_of("engine-0")
    snap["tenants"][0]["guarantee_bytes"] = 5 * MiB
    out = rendered(snap, 120)
    assert "GUARANTEE" in out and "5.0" in out
    monkeypatch.setattr(_top, "_FIELDS", _top._FIELDS - {"guarantee_bytes", "borrowed_bytes"})  # an older ledger
    out = rendered(snap, 120)
    assert "GUARANTEE" not in out and "BORROWED" not in out and "left out" not in out


def test_top_state_says_lending_and_deferred() -> None:
    snap = snap_of("engine-0", "engine-1", "engine-2")
    snap["tenants"][0]["lending"] = True
    snap["tenants"][1]["limit_state"] = "deferred"
    rows = {line.split()[0]: line.split()[-1] for line in rendered(snap, 120).splitlines()
            if line.startswith("engine-")}
    assert rows == {"engine-0": "lending", "engine-1": "deferred", "engine-2": "-"}


# ------------------------------------------------------------ stale pools

DEAD_TENANT = textwrap.dedent(
    """
    import sys
    from kvpool import Geometry, KVSpace, Pool
    g = Geometry(2, 2, 4 * 1024, 256, page_bytes=64 * 1024)
    space = KVSpace(g, pool=Pool(sys.argv[1], create=False), name="doomed", reserve_thread=False, reserve=(0, 0))
    space.alloc(len(g.block_range(0)))
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


def dead_tenant_pool(tmp_path: Path, name: str) -> None:
    """Leave ``name`` with one tenant whose process was SIGKILLed holding a page."""
    script = tmp_path / "dead.py"
    script.write_text(DEAD_TENANT)
    proc = subprocess.Popen([sys.executable, str(script), name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()


@pytest.mark.timeout(120)
def test_pools_tells_empty_from_stale_and_gc_removes_only_stale_ones(
    tmp_path: Path, pools: Callable[..., str], make_space: Callable[..., KVSpace],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Issue 32: a pool made for servers about to start (the recipe's step 2)
    # or left cleanly is *empty* and --gc keeps it; one whose last tenant died
    # is *stale* and --gc removes it; --gc --empty removes both.
    live, empty, left, dead = pools(), pools(), pools(), pools()
    make_space(GEOMETRY, pool=Pool(live, create=False), name="engine-a").alloc(PER_PAGE)
    with KVSpace(GEOMETRY, pool=Pool(left, create=False), name="gone", reserve_thread=False, reserve=(0, 0)) as s:
        s.alloc(PER_PAGE)  # committed, then left cleanly
    dead_tenant_pool(tmp_path, dead)
    junk = f"test-ops-junk-{uuid.uuid4().hex[:6]}"  # not a ledger of this layout: never ours to judge
    fd = os.open(ledger_path(junk), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.write(fd, b"not a ledger")
    os.close(fd)
    try:
        mine = (live, empty, left, dead, junk)  # never other pools of this host: --gc would judge them too
        rc, out, err = run_main(capsys, "pools", "--json", *mine)
        assert rc == 0, err
        rows = {r["name"]: r for r in json.loads(out)}
        assert set(rows) == set(mine)
        assert rows[live]["status"] == "in use" and rows[live]["tenants"] == 1
        assert rows[empty]["status"] == "empty" and rows[empty]["tenants"] == 0
        assert rows[left]["status"] == "empty" and rows[left]["committed"] == 0
        assert rows[dead]["status"] == "stale" and rows[dead]["committed"] == 0  # the dead tenant was reaped
        assert [rows[n]["stale"] for n in (live, empty, left, dead)] == [False, False, False, True]
        assert rows[junk]["status"] is None and "layout" in rows[junk]["error"]

        rc, out, err = run_main(capsys, "pools", *mine)
        assert rc == 0, err
        lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("test-")}
        assert "in use" in lines[live] and "empty" in lines[empty] and "empty" in lines[left]
        assert "stale" in lines[dead] and "unreadable" in lines[junk]
        assert "1 stale pool(s)" in out and "kvpool pools --gc" in out

        rc, out, err = run_main(capsys, "pools", "--gc", *mine)
        assert rc == 0, err
        lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("test-")}
        assert "removed" in lines[dead] and "removed" not in lines[empty] + lines[left] + lines[live]
        assert f"removed 1 pool(s): {dead}; kept 2 empty pool(s)" in out
        names = set(list_pools())
        assert {live, empty, left, junk} <= names and dead not in names
        assert Pool(live, create=False).tenants()[0].committed_bytes == PCB  # untouched

        rc, out, err = run_main(capsys, "pools", "--gc", "--empty", live, empty, left, junk)
        assert rc == 0, err
        names = set(list_pools())
        assert {live, junk} <= names and not {empty, left} & names
        assert "removed 2 pool(s): " in out
        rc, _, err = run_main(capsys, "pools", "--empty")
        assert rc == 2 and "--empty needs --gc" in err
        rc, _, err = run_main(capsys, "pools", "no-such-pool-xyz")
        assert rc == 2 and "does not exist" in err
    finally:
        os.unlink(ledger_path(junk))


def test_gc_leaves_a_pool_whose_tenant_joined_after_listing(
    pools: Callable[..., str], make_space: Callable[..., KVSpace], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import kvpool.cli as cli_mod

    name = pools()
    real = cli_mod._pool_row

    def listed_then_joined(pool_name: str) -> dict[str, Any]:
        row = real(pool_name)  # listed with no tenant ...
        if pool_name == name:
            make_space(GEOMETRY, pool=Pool(name, create=False), name="late")  # ... then one joins
        return row

    monkeypatch.setattr(cli_mod, "_pool_row", listed_then_joined)
    rc, out, err = run_main(capsys, "pools", "--gc", "--empty", "--json", name)
    assert rc == 0, err
    row = {r["name"]: r for r in json.loads(out)}[name]
    assert row["status"] == "empty" and row["removed"] is False  # judged again at removal time
    assert name in list_pools()


def _settings(pool: str) -> dict[str, tuple[int | None, int, int | None, int]]:
    return {t.name: (t.limit_bytes, t.limit_revision, t.guarantee_setting, t.guarantee_revision)
            for t in Pool(pool, create=False).snapshot().tenants}


def test_limit_with_a_min_checks_every_value_before_applying_any(
    pools: Callable[..., str], make_space: Callable[..., KVSpace], capsys: pytest.CaptureFixture[str],
) -> None:
    # Issue 32 / round-3 cli_limit_partial.py: `limit P t 1M --min 70M` applied
    # the limit, then failed on the guarantee (exit 2, half done).
    pool = pools(64 * MiB)
    make_space(GEOMETRY, pool=Pool(pool, create=False), name="t")
    make_space(GEOMETRY, pool=Pool(pool, create=False), name="u", guarantee_bytes=40 * MiB)
    before = _settings(pool)
    for args, why in (
        (("1M", "--min", "70M"), "--min 70.0 MiB is more than the limit 1.0 MiB"),
        (("100M", "--min", "30M"), "--min 30.0 MiB does not fit pool .*40.0 MiB of its 64.0 MiB"),
        (("10",), "needs a unit"),
        (("-5M",), "cannot be negative"),
        (("8M", "--min", "-1G"), "cannot be negative"),
        (("8M", "--min=-1G"), "cannot be negative"),
    ):
        rc, out, err = run_main(capsys, "limit", pool, "t", *args)
        assert rc == 2 and out == "", (args, out)
        import re
        assert re.search(why, err), (args, err)
        assert _settings(pool) == before, args  # nothing changed
    rc, out, err = run_main(capsys, "limit", pool, "t", "32MiB", "--min", "16MiB")
    assert (rc, out) == (0, "applied\nguarantee applied\n"), err
    assert _settings(pool)["t"] == (32 * MiB, 1, 16 * MiB, 1)


def test_limit_takes_its_limit_back_when_the_pool_refuses_the_guarantee_after_the_check(
    pools: Callable[..., str], make_space: Callable[..., KVSpace], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvpool.cli as cli_mod

    pool = pools(64 * MiB)
    make_space(GEOMETRY, pool=Pool(pool, create=False), name="t")
    make_space(GEOMETRY, pool=Pool(pool, create=False), name="u", guarantee_bytes=40 * MiB)
    # As if u's guarantee arrived between the check and the apply.
    monkeypatch.setattr(cli_mod, "_check_limit", lambda *a: None)
    rc, out, err = run_main(capsys, "limit", pool, "t", "48MiB", "--min", "30MiB")
    assert rc == 2 and "does not fit" in err
    limit, limit_rev, guarantee, guarantee_rev = _settings(pool)["t"]
    assert (limit, guarantee, guarantee_rev) == (None, None, 0)  # the limit was taken back ...
    assert limit_rev == 2  # ... by a revision of its own (applied at 1, back to none at 2)


def test_limit_with_a_stale_revision_leaves_the_guarantee_alone(
    pools: Callable[..., str], make_space: Callable[..., KVSpace], capsys: pytest.CaptureFixture[str],
) -> None:
    pool = pools(64 * MiB)
    make_space(GEOMETRY, pool=Pool(pool, create=False), name="t")
    assert run_main(capsys, "limit", pool, "t", "32MiB", "--revision", "5")[0] == 0
    rc, out, _ = run_main(capsys, "limit", pool, "t", "16MiB", "--revision", "4", "--min", "8MiB")
    assert rc == 1 and out.startswith("stale\n") and "guarantee not changed" in out
    assert _settings(pool)["t"] == (32 * MiB, 5, None, 0)


HIDE_CURSOR, SHOW_CURSOR = b"\x1b[?25l", b"\x1b[?25h"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_top_on_a_terminal_shows_the_cursor_again_however_it_is_stopped(
    sig: signal.Signals, pools: Callable[..., str], tmp_path: Path,
) -> None:
    # Issue 32: `kvpool top` killed by SIGTERM (kill, a closing tmux pane)
    # left the terminal's cursor hidden; only Ctrl-C restored it.
    import pty

    name = pools()
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "top", name, "--interval", "0.05"],
                            stdin=follower, stdout=follower, stderr=follower, cwd=tmp_path,
                            env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"})
    os.close(follower)
    seen = b""
    try:
        while HIDE_CURSOR not in seen:  # the event: the live table is on screen, cursor hidden
            seen += os.read(leader, 65536)
        proc.send_signal(sig)
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the last writer closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    assert seen.rindex(SHOW_CURSOR) > seen.rindex(HIDE_CURSOR), seen[-300:]
    assert b"Traceback" not in seen, seen[-2000:]
    assert rc == (0 if sig == signal.SIGINT else 128 + sig), (rc, seen[-300:])
