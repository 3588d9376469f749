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
  pool's ledger while it serves.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

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


def serve(model: str, log: pathlib.Path, pool: str, tenants: list[list[tuple[str, int]]], **env: str) -> list[Any]:
    """Start SGLang's server on ``model``, generate PROMPTS greedily, stop it; the
    pool's tenants are read while it still holds them."""
    from kvpool import Pool

    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [PYTHON, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu", "--attention-backend",
             "torch_native", "--port", str(port), "--mem-fraction-static", "0.05", "--skip-server-warmup"],
            env=sglang_env(KVPOOL_POOL=pool, **env), stdout=out, stderr=subprocess.STDOUT,
            cwd=log.parent)  # not the checkout: `python -m` puts the cwd first, and its kvpool/ has no adapters
    try:
        # Until it listens, or fails if it exits; no deadline of ours (a busy
        # machine starts it slower): a hang ends in the test's timeout.
        wait_listening(port, lambda: proc.poll() is None, log.read_text)
        params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
        outs = [post(port, "/generate", {"input_ids": p, "sampling_params": params})["output_ids"] for p in PROMPTS]
        tenants.append([(t.name, t.committed_bytes) for t in Pool(pool).tenants()])
        return outs
    finally:
        proc.terminate()
        proc.wait(60)


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

