"""``kvpool metrics``: the Prometheus exposition of a pool's ledger.

Tenants are KV spaces of this test process; the exporter reads the same
ledger (in this process for the one-shot text, as its own process for the
HTTP server). Every exposition is parsed with prometheus_client's own parser.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool import Geometry, KVSpace, Pool, PoolExhausted, RequestTooLarge, TenantInfo
from kvpool import metrics as kvmetrics
from kvpool.cli import host_port, main

KiB = 1024
MiB = 1 << 20
GEOMETRY = Geometry(2, 2, 4 * KiB, 256, page_bytes=64 * KiB)  # one page commit: 256 KiB
PCB = GEOMETRY.page_commit_bytes
PER_PAGE = len(GEOMETRY.block_range(0))
CAPACITY = 64 * MiB

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """name + sorted labels -> value, for every sample of an exposition."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def tenant_key(name: str, pool: str, tenant: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return (name, (("pool", pool), ("tenant", tenant)))


@pytest.fixture
def pool_name(pool_name: str) -> str:
    """conftest.py's private pool name, its pool made here (the exporter reads a pool that exists)."""
    Pool(pool_name, capacity=CAPACITY)
    return pool_name


def test_exposition_matches_the_ledger(pool_name: str, make_space: Callable[..., KVSpace]) -> None:
    pool = Pool(pool_name, create=False)
    a = make_space(GEOMETRY, pool=pool, name="engine-a")
    b = make_space(GEOMETRY, pool=pool, name="engine-b", reserve=(1, 1), headroom_bytes=2 * PCB)
    for _ in range(3):
        a.alloc(PER_PAGE)
    b.alloc(PER_PAGE)
    assert pool.set_limit("engine-b", 8 * MiB) == "applied"

    samples = parse(kvmetrics.exposition([pool_name]))
    ledger = {t.name: t for t in pool.tenants()}
    for name, t in ledger.items():
        assert samples[tenant_key("kvpool_tenant_committed_bytes", pool_name, name)] == t.committed_bytes
        assert samples[tenant_key("kvpool_tenant_waiting_requests", pool_name, name)] == t.waiting
        assert samples[tenant_key("kvpool_tenant_idle_pages", pool_name, name)] == t.reserve_pages
        assert samples[("kvpool_tenant_info", (("pid", str(t.pid)), ("pool", pool_name), ("slot", str(t.slot)),
                                               ("tenant", name)))] == 1
    assert ledger["engine-a"].committed_bytes == 3 * PCB
    assert ledger["engine-b"].keep_free_bytes == 2 * PCB and ledger["engine-a"].keep_free_bytes == 0
    assert samples[tenant_key("kvpool_tenant_limit_bytes", pool_name, "engine-b")] == 8 * MiB
    assert samples[tenant_key("kvpool_tenant_limit_revision", pool_name, "engine-b")] == 1
    assert samples[tenant_key("kvpool_tenant_limit_deferred", pool_name, "engine-b")] == 0
    # No limit is no sample (not a made-up 0, which would read as "may not grow").
    assert tenant_key("kvpool_tenant_limit_bytes", pool_name, "engine-a") not in samples
    assert samples[("kvpool_pool_capacity_bytes", (("pool", pool_name),))] == CAPACITY
    assert samples[("kvpool_pool_committed_bytes", (("pool", pool_name),))] == pool.committed
    assert samples[("kvpool_pool_tenants", (("pool", pool_name),))] == 2
    # Fair-share figures, as the ledger states them (absent from a ledger without them).
    fields = {f.name for f in dataclasses.fields(TenantInfo)}
    for metric, field in (("kvpool_tenant_guarantee_bytes", "guarantee_bytes"),
                          ("kvpool_tenant_borrowed_bytes", "borrowed_bytes"),
                          ("kvpool_tenant_wanted_bytes", "want_bytes"), ("kvpool_tenant_lending", "lending"),
                          ("kvpool_tenant_keep_free_bytes", "keep_free_bytes")):
        for name, t in ledger.items():
            if field in fields:
                assert samples[tenant_key(metric, pool_name, name)] == float(getattr(t, field)), metric
            else:
                assert tenant_key(metric, pool_name, name) not in samples


def test_names_and_labels_follow_prometheus_conventions(pool_name: str,
                                                        make_space: Callable[..., KVSpace]) -> None:
    make_space(GEOMETRY, pool=Pool(pool_name, create=False), name="engine-a").alloc(PER_PAGE)
    families = list(text_string_to_metric_families(kvmetrics.exposition([pool_name])))
    assert families
    for fam in families:
        assert re.fullmatch(r"kvpool_(pool|tenant)_[a-z_]+", fam.name), fam.name
        assert fam.type in ("gauge", "counter") and fam.documentation
        if fam.type == "counter":  # the family is named without _total, its samples with it
            assert not fam.name.endswith("_total") and {s.name for s in fam.samples} == {fam.name + "_total"}
        assert "bytes" not in fam.name or fam.name.endswith("_bytes")
        for s in fam.samples:
            assert set(s.labels) <= {"pool", "tenant", "pid", "slot"}
            assert s.labels["pool"] == pool_name


def test_a_tenants_allocs_and_shortages_are_counters_of_what_it_did(pool_name: str,
                                                                   make_space: Callable[..., KVSpace]) -> None:
    pool = Pool(pool_name, create=False)
    space = make_space(GEOMETRY, pool=pool, name="engine-a", limit_bytes=2 * PCB)  # at most 2 pages
    idle = make_space(GEOMETRY, pool=pool, name="engine-b")
    for _ in range(5):
        space.alloc(1)
    with pytest.raises(PoolExhausted):
        space.alloc(2 * PER_PAGE)  # within its limit, more than it has left: a shortage
    with pytest.raises(RequestTooLarge):
        space.alloc(3 * PER_PAGE)  # beyond its limit: refused at admission, also a shortage
    families = {f.name: f for f in text_string_to_metric_families(kvmetrics.exposition([pool_name]))}
    for name, done in (("kvpool_tenant_allocs", {"engine-a": 5, "engine-b": 0}),
                       ("kvpool_tenant_shortages", {"engine-a": 2, "engine-b": 0})):
        fam = families[name]
        assert fam.type == "counter"
        assert {s.labels["tenant"]: s.value for s in fam.samples if s.name == name + "_total"} == done
    assert {(t.name, t.allocs, t.shortages) for t in pool.tenants()} == {("engine-a", 5, 2), ("engine-b", 0, 0)}
    assert idle.stats().allocs == 0


def test_a_tenant_field_the_ledger_gains_is_exported_without_new_code(monkeypatch: pytest.MonkeyPatch) -> None:
    row = SimpleNamespace(slot=0, pid=1, name="engine-a", committed_bytes=3 * MiB, limit_bytes=None,
                          limit_revision=0, limit_state="applied", waiting=0, reserve_pages=0,
                          guarantee_bytes=2 * MiB, borrowed_bytes=MiB)
    monkeypatch.setattr(kvmetrics, "read_pool", lambda name: kvmetrics.PoolSample(name, CAPACITY, 3 * MiB, [row]))
    samples = parse(kvmetrics.exposition(["p"]))
    assert samples[tenant_key("kvpool_tenant_guarantee_bytes", "p", "engine-a")] == 2 * MiB
    assert samples[tenant_key("kvpool_tenant_borrowed_bytes", "p", "engine-a")] == MiB


def test_every_pool_when_none_is_named_and_a_vanished_one_is_left_out(
    pool_name: str, make_space: Callable[..., KVSpace], capsys: pytest.CaptureFixture[str]
) -> None:
    make_space(GEOMETRY, pool=Pool(pool_name, create=False), name="engine-a")
    capsys.readouterr()
    assert main(["metrics"]) == 0
    samples = parse(capsys.readouterr().out)
    assert ("kvpool_pool_capacity_bytes", (("pool", pool_name),)) in samples
    collector = kvmetrics.PoolCollector([pool_name, "test-metrics-gone"])
    names = {s.labels["pool"] for fam in collector.collect() for s in fam.samples}
    assert names == {pool_name}


def test_bad_listen_addresses_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert host_port("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert host_port(":9464") == ("0.0.0.0", 9464)
    assert host_port("[::1]:9464") == ("::1", 9464)
    for bad in ("9464", "host:", "host:http", "host:70000"):
        with pytest.raises(SystemExit) as e:
            main(["metrics", "--listen", bad])
        assert e.value.code == 2
        assert "bad address" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_listen_serves_metrics_that_follow_the_ledger(pool_name: str, make_space: Callable[..., KVSpace],
                                                      tmp_path: Path) -> None:
    pool = Pool(pool_name, create=False)
    space = make_space(GEOMETRY, pool=pool, name="engine-a")
    space.alloc(PER_PAGE)
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "metrics", pool_name, "--listen", "127.0.0.1:0"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once the socket is listening
        m = re.fullmatch(r"serving (http://127\.0\.0\.1:\d+/metrics)\n", line)
        assert m, (line, proc.communicate(timeout=20))
        url = m.group(1)

        def scrape() -> Samples:
            with urllib.request.urlopen(url, timeout=30) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/plain")
                return parse(resp.read().decode())

        key = tenant_key("kvpool_tenant_committed_bytes", pool_name, "engine-a")
        assert scrape()[key] == pool.tenants()[0].committed_bytes == PCB
        space.alloc(2 * PER_PAGE)  # each scrape reads the ledger anew
        assert scrape()[key] == pool.tenants()[0].committed_bytes == 3 * PCB
        assert scrape()[tenant_key("kvpool_tenant_allocs_total", pool_name, "engine-a")] == 2
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "Traceback" not in err, err


# ------------------------------------------------------- the exporter's front
#
# Round 3 (metrics_listen.py): prometheus_client's server answered 200 with the
# metrics on any path and held a thread per idle connection (400 idle
# connections: 402 threads), none ever timed out.


@pytest.fixture
def exporter(pool_name: str, tmp_path: Path) -> Iterator[int]:
    """A `kvpool metrics --listen` process on a free port; yields the port."""
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "metrics", pool_name, "--listen", "127.0.0.1:0"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # printed once the socket listens
    m = re.fullmatch(r"serving http://127\.0\.0\.1:(\d+)/metrics\n", line)
    try:
        assert m, (line, proc.communicate(timeout=20))
        proc.port = int(m.group(1))  # type: ignore[attr-defined]
        yield proc  # type: ignore[misc]
    finally:
        proc.kill()
        proc.communicate()


def ask(port: int, request: bytes) -> bytes:
    """Send a raw request and read the whole answer (the exporter closes every connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(request)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("request_line", "status"), [
    (b"GET /metrics HTTP/1.1", 200),
    (b"GET /metrics?name[]=kvpool_pool_capacity_bytes HTTP/1.0", 200),
    (b"HEAD /metrics HTTP/1.1", 200),
    (b"GET /foo HTTP/1.1", 404),
    (b"GET / HTTP/1.1", 404),
    (b"GET /../../etc/passwd HTTP/1.0", 404),
    (b"GET /metrics/../metrics HTTP/1.1", 404),
    (b"BREW /metrics HTTP/1.1", 405),
    (b"\x00\xff\xfe garbage", 400),
    (b"GET /metrics", 400),  # HTTP/0.9
])
def test_the_exporter_answers_metrics_on_metrics_only(exporter: Any, request_line: bytes, status: int,
                                                      pool_name: str) -> None:
    answer = ask(exporter.port, request_line + b"\r\nHost: x\r\n\r\n")
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
    head, _, body = answer.partition(b"\r\n\r\n")
    if status == 200 and not request_line.startswith(b"HEAD"):
        assert f'kvpool_pool_capacity_bytes{{pool="{pool_name}"}}'.encode() in body
    else:
        assert b"kvpool_" not in body
    assert b"Connection: close" in head


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.mark.timeout(300)
def test_idle_connections_cost_no_threads_and_do_not_delay_a_scrape(exporter: Any, pool_name: str) -> None:
    from kvpool._exporter import MAX_CONNECTIONS

    idle = []
    try:
        for _ in range(400):  # what the reproducer held open: a request line, then nothing
            s = socket.create_connection(("127.0.0.1", exporter.port), timeout=60)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            idle.append(s)
        # A scrape beside them is answered (the exporter reads heads concurrently)...
        answer = ask(exporter.port, b"GET /metrics HTTP/1.1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        # ... and they hold no thread each (was 402 threads for 400 connections).
        assert threads_of(exporter.pid) < 16
        # Past the cap, a connection is closed at once instead of queued.
        over = []
        for _ in range(MAX_CONNECTIONS - len(idle) + 1):
            over.append(socket.create_connection(("127.0.0.1", exporter.port), timeout=60))
        over[-1].sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        # closed without an answer (or reset); never a hang
        try:
            assert over[-1].recv(100) == b""
        except ConnectionResetError:
            pass
        for s in over:
            s.close()
        # An idle connection is closed by the exporter once its head time is out (the event, not a clock of ours).
        try:
            assert idle[0].recv(100) == b""
        except ConnectionResetError:
            pass
    finally:
        for s in idle:
            s.close()
