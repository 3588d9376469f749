"""kvpool's SGLang plugin (kvpool.adapters.sglang_plugin) against real SGLang.

SGLang cannot be pip-installed on this CPU machine (it pins a CUDA torch and
CUDA-only kernels), but its source runs here: everything below runs in the
vLLM venv ($KVPOOL_VLLM_PYTHON), which holds the CPU torch and most of
SGLang's pure-Python dependencies, with SGLang's own unpacked wheel first on
the path ($KVPOOL_SGLANG_SOURCE, built by scripts/sglang_src.sh; a
torchvision stand-in is the one stub). SGLang's ``load_plugins()`` finds
kvpool through its entry point (kvpool installed in that venv).

* Unit level (tests/sglang_support/plugin_checks.py, one child; each check
  reports "ok" or its traceback): SGLang's own ``MHATokenToKVPool``,
  ``PagedTokenToKVPoolAllocator``, ``SchedulerInvariantChecker`` and hook
  registry with the plugin in place.
* A real server: ``python -m sglang.launch_server --device cpu
  --attention-backend torch_native`` on a tiny random Llama, stock and with
  ``KVPOOL_SGLANG=1``: the same greedy tokens, and the tenant's pages in the
  pool's ledger while it serves. And a server that borrows when a second
  tenant asks for its guarantee: every request finishes (before, SGLang
  aborted one with HTTP 500) and the waiter gets its memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import re
import socket
import subprocess
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ._helpers import wait_until
from ._vllm_engines import wait_listening

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]

HERE = pathlib.Path(__file__).parent / "sglang_support"
PYTHON = os.environ.get("KVPOOL_VLLM_PYTHON", "")
SOURCE = os.environ.get("KVPOOL_SGLANG_SOURCE", "")

if not (PYTHON and SOURCE):
    if os.environ.get("KVPOOL_REQUIRE_VLLM") == "1":
        raise RuntimeError("KVPOOL_REQUIRE_VLLM=1 but KVPOOL_VLLM_PYTHON or KVPOOL_SGLANG_SOURCE is not set "
                           "(run scripts/test.sh)")
    pytest.skip("set KVPOOL_VLLM_PYTHON and KVPOOL_SGLANG_SOURCE (scripts/test.sh does)", allow_module_level=True)

CHECK_NAMES = re.findall(r"^@check\ndef (\w+)", (HERE / "plugin_checks.py").read_text(), re.M)
assert len(CHECK_NAMES) >= 5, CHECK_NAMES  # the pattern still matches the checks file


def sglang_env(**more: str) -> dict[str, str]:
    """The environment of a child that imports SGLang's source (stock unless ``more`` says)."""
    env = dict(os.environ)
    path = [os.path.join(SOURCE, d) for d in ("src", "deps", "stubs")]
    env["PYTHONPATH"] = os.pathsep.join([*path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for name in ("KVPOOL_SGLANG", "KVPOOL_SGLANG_ALLOW_UNTESTED", "SGLANG_PLUGINS"):
        env.pop(name, None)
    env.update(more)
    return env


@pytest.fixture(scope="session")
def plugin_checks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env = sglang_env()
    res = subprocess.run([PYTHON, str(HERE / "plugin_checks.py"), f"test-sgl-{uuid.uuid4().hex[:6]}"],
                         cwd=tmp_path_factory.mktemp("sglang"), env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    results: dict[str, str] = json.loads(res.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_sglang_plugin(plugin_checks: dict[str, str], name: str) -> None:
    assert plugin_checks[name] == "ok", plugin_checks[name]


# ------------------------------------------------------------ a real server

PROMPTS = [list(range(1, 11)), list(range(11, 36))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(port: int, path: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=540) as r:  # the test's timeout is the real bound
        return json.load(r)


@contextlib.contextmanager
def server(model: str, log: pathlib.Path, pool: str, *args: str, **env: str) -> Iterator[int]:
    """SGLang's server on ``model`` while the block runs; yields its port."""
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [PYTHON, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu", "--attention-backend",
             "torch_native", "--port", str(port), "--mem-fraction-static", "0.05", "--skip-server-warmup", *args],
            env=sglang_env(KVPOOL_POOL=pool, **env), stdout=out, stderr=subprocess.STDOUT,
            cwd=log.parent)  # not the checkout: `python -m` puts the cwd first, and its kvpool/ has no adapters
    try:
        # Until it listens, or fails if it exits; no deadline of ours (a busy
        # machine starts it slower): a hang ends in the test's timeout.
        wait_listening(port, lambda: proc.poll() is None, log.read_text)
        yield port
    finally:
        proc.terminate()
        proc.wait(60)


def serve(model: str, log: pathlib.Path, pool: str, tenants: list[list[tuple[str, int]]], **env: str) -> list[Any]:
    """Start SGLang's server on ``model``, generate PROMPTS greedily, stop it; the
    pool's tenants are read while it still holds them."""
    from kvpool import Pool

    with server(model, log, pool, **env) as port:
        params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
        outs = [post(port, "/generate", {"input_ids": p, "sampling_params": params})["output_ids"] for p in PROMPTS]
        tenants.append([(t.name, t.committed_bytes) for t in Pool(pool).tenants()])
        return outs


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    out = tmp_path_factory.mktemp("sglang-llama")
    subprocess.run([PYTHON, str(pathlib.Path(__file__).parent / "vllm_support" / "tiny_llama.py"), str(out)],
                   check=True, cwd=out, capture_output=True, timeout=300)
    yield str(out)


def test_a_real_sglang_server_generates_the_same_tokens_with_kvpool_holding_its_pages(
        tiny_llama: str, tmp_path: pathlib.Path, pool_name: str) -> None:
    from kvpool import Pool

    pool = pool_name
    Pool(pool, capacity=256 << 20)
    tenants: list[list[tuple[str, int]]] = []
    stock = serve(tiny_llama, tmp_path / "stock.log", pool, tenants)
    with_kvpool = serve(tiny_llama, tmp_path / "kvpool.log", pool, tenants, KVPOOL_SGLANG="1")
    assert with_kvpool == stock and all(len(o) == 24 for o in stock)
    assert tenants[0] == []  # stock SGLang: not a tenant
    (name, committed), = tenants[1]
    assert name.startswith("sglang-") and committed > 0, tenants  # its pages, in the pool's books
    assert "kvpool is on: pool '" + pool + "'" in (tmp_path / "kvpool.log").read_text()



@dataclasses.dataclass
class Lent:
    outs: list[Any]  # per request: its output length, or "HTTP <code>"
    row: Any  # SGLang's tenant row at the end
    log: str  # SGLang's log
    freeing: int  # the most freeing SGLang published while the waiter waited
    asked: int  # the most SGLang was asked to preempt meanwhile


def lend(model: str, tmp_path: pathlib.Path, pool: str, *, pool_pages: int, requests: int, prompt: int, new: int,
         at: int, want: int, args: tuple[str, ...] = ()) -> Lent:
    """SGLang (4096 tokens in kvpool pages of 32) serves ``requests`` requests of ``prompt`` +
    ``new`` tokens on a pool of ``pool_pages`` pages; once it holds ``at`` pages a second tenant
    asks for ``want`` (its guarantee: half the pool), which SGLang must lend, then frees them."""
    from kvpool import Geometry, KVSpace, Pool

    commit = 16 << 10  # one kvpool page of SGLang's: 4 KiB (32 tokens) x 2 layers x K/V
    Pool(pool, capacity=pool_pages * commit)
    log = tmp_path / "lending.log"
    with server(model, log, pool, "--max-total-tokens", "4096", *args, KVPOOL_SGLANG="1",
                KVPOOL_SGLANG_PAGE_BYTES="4096", KVPOOL_SGLANG_TENANT="sglang-lender") as port:
        outs: list[Any] = [None] * requests

        def generate(i: int) -> None:
            body = {"input_ids": [3 + (i + k) % 500 for k in range(prompt)],
                    "sampling_params": {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}}
            try:
                outs[i] = len(post(port, "/generate", body)["output_ids"])
            except urllib.error.HTTPError as e:
                outs[i] = f"HTTP {e.code}"

        def sglang() -> Any:
            return next(t for t in Pool(pool).tenants() if t.name == "sglang-lender")

        clients = [threading.Thread(target=generate, args=(i,)) for i in range(requests)]
        for c in clients:
            c.start()
        wait_until(lambda: sglang().committed_bytes >= at * commit or not any(c.is_alive() for c in clients),
                   f"SGLang holds {at} pages")
        assert sglang().committed_bytes >= at * commit, "SGLang finished before it borrowed"
        waiter = KVSpace(Geometry(1, 1, commit, want, page_bytes=commit), pool=Pool(pool), reserve=(0, 0),
                         reserve_thread=False, name="waiter")
        seen = {"freeing": 0, "asked": 0}
        granted = threading.Event()

        def watch() -> None:  # SGLang's published figures while the waiter waits
            while not granted.is_set():
                row = sglang()
                seen["freeing"] = max(seen["freeing"], row.freeing_bytes)
                seen["asked"] = max(seen["asked"], row.preempt_bytes)
                granted.wait(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            # Its guarantee, so SGLang lends. A stall (nobody frees anything for 120 s) is
            # the failure this guards against; the test's timeout bounds the rest.
            got = waiter.acquire(want, stall=120)
            assert len(got) == want
            waiter.free(got)
        finally:
            granted.set()
            watcher.join()
            waiter.close()
        for c in clients:
            c.join()
        row = sglang()
    return Lent(outs, row, log.read_text(), seen["freeing"], seen["asked"])


def retractions(log: str) -> int:
    """Requests SGLang's scheduler logged as retracted."""
    return sum(int(n) for n in re.findall(r"#retracted_reqs: (\d+)", log))


def test_a_lending_sglang_server_finishes_every_request_and_the_waiter_gets_its_guarantee(
        tiny_llama: str, tmp_path: pathlib.Path, pool_name: str) -> None:
    # 4 requests of 1000 tokens borrow past SGLang's guarantee (64 of 128 pages); at 72 pages
    # a second tenant asks for its 64. Before the lending gates (plugin docstring, 7) SGLang's
    # decode gate missed at every step while it lent: it retracted three requests and aborted
    # the fourth (HTTP 500). Now its requests decode into the free slots of the pages it
    # holds, retract only when those run out, and all finish.
    r = lend(tiny_llama, tmp_path, pool_name, pool_pages=128, requests=4, prompt=16, new=1000, at=72, want=64)
    assert r.outs == [1000] * 4  # none aborted
    # Pages went back as requests finished, while lending: each finished request's KV goes
    # into SGLang's radix cache, and the plugin drops that cache while lending (an eviction).
    assert r.row.reclaimed_by_eviction_bytes > 0
    assert r.row.requests_preempted == retractions(r.log)  # every retraction logged, counted as a preemption
    assert "aborted" not in r.log
    # It tells the pool it never preempts for it (never asked), and publishes the pages its
    # requests within the reclaim bound empty as they finish (the 4 requests all come within
    # it, a few hundred decode steps, before the waiter has its 64 pages).
    assert not r.row.preempts and r.asked == 0 and r.freeing > 0


def test_a_lending_sglang_servers_last_request_is_retracted_not_aborted(
        tiny_llama: str, tmp_path: pathlib.Path, pool_name: str) -> None:
    # One request of 1916 tokens; at 40 of the pool's 64 pages a tenant asks for its 32. The
    # request fills its last page within 32 tokens: SGLang's retraction keeps one request and
    # aborted it (HTTP 500, measured on the code before). The hook queues it again instead;
    # it is prefilled again once the waiter has its memory, and finishes.
    r = lend(tiny_llama, tmp_path, pool_name, pool_pages=64, requests=1, prompt=16, new=1900, at=40, want=32)
    assert r.outs == [1900]
    assert r.row.requests_preempted == retractions(r.log) == 1
    assert "is retracted, not aborted" in r.log


def test_a_lending_sglang_servers_stalled_chunked_prefill_is_retracted_and_finishes(
        tiny_llama: str, tmp_path: pathlib.Path, pool_name: str) -> None:
    # A prompt of 1800 tokens prefilled in chunks of 64; at 40 of the pool's 64 pages a tenant
    # asks for its 32. Lending, SGLang admits nothing and a chunk continues only into free
    # slots of its pages; with nothing else running none come. Measured on the code before:
    # the chunk and the waiter both waited until the waiter's 120 s stall gave up. Now
    # on_idle retracts the chunk (a preemption), the waiter is granted, and the request
    # is prefilled again and finishes.
    r = lend(tiny_llama, tmp_path, pool_name, pool_pages=64, requests=1, prompt=1800, new=8, at=40, want=32,
             args=("--chunked-prefill-size", "64"))
    assert r.outs == [8]
    assert r.row.requests_preempted == 1 and "kvpool: retracted chunked prefill" in r.log
