"""docs/serving-several-models.md: the operator's recipe runs as written (issue 13, item 7).

Every ```bash block of the recipe runs, in order, in bash (``set -eo
pipefail``) with the venv's ``bin`` first on ``PATH`` (this one for the
stand-in run, the vLLM venv's for the real one), in an empty folder.
Substitutions keep the run private to the test, and nothing else is
changed: the line ``export KVPOOL_POOL=models`` names a pool of the test's
own, the exporter's ``127.0.0.1:9464`` and the servers' ports become free
ports, and (real run) the model names become local tiny models. An HTML
comment before a block says how it runs:

* ``creates the pool``: run; then (stand-in run) two stand-ins for the vLLM servers
  (tests/_recipe_engine.py) join the pool as ``chat`` and ``code``;
* ``installs``: the ``pip install`` step, which is this test's own set-up
  (kvpool is installed in the venv it runs from): not run;
* ``needs vllm``: the vLLM server block. With the vLLM venv
  ($KVPOOL_VLLM_PYTHON) it runs as written (its servers in a session of their
  own), with the recipe's model names replaced by tiny local models and its
  ports by free ones; each server answers one completion before the next
  block runs. The stand-in run skips it and checks that every ``KVPOOL_*``
  variable it sets is one kvpool reads, and that it serves on 127.0.0.1 only;
* ``background``: started in a session of its own, stopped at the end;
* ``after the servers stop``: run once the stand-ins have exited (or the servers
  were stopped with SIGTERM, as a service manager stops them).

The figures each block prints are checked against the ledger.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from kvpool import Pool, list_pools
from kvpool.pool import backing_memory

from ._helpers import wait_until
from ._vllm_engines import wait_listening

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECIPE = ROOT / "docs" / "serving-several-models.md"
ENGINE = pathlib.Path(__file__).with_name("_recipe_engine.py")
TINY = pathlib.Path(__file__).with_name("vllm_support") / "tiny_llama.py"
READY = "Application startup complete"
BLOCK = re.compile(r"(?:<!-- recipe-test: (?P<how>[^>]*?) -->\n)?```bash\n(?P<code>.*?)^```", re.S | re.M)
POOL_LINE = "export KVPOOL_POOL=models"
PORT = "127.0.0.1:9464"
GiB = 2**30
SKIPPED = ("installs", "needs vllm")
KNOWN_HOW = {None, "installs", "creates the pool", "needs vllm", "background", "after the servers stop"}


def blocks() -> list[tuple[str | None, str]]:
    return [(m.group("how"), m.group("code")) for m in BLOCK.finditer(RECIPE.read_text())]


def kvpool_reads(var: str) -> bool:
    """Whether kvpool's sources (the package and the adapters) read ``var``."""
    return any(var in p.read_text() for d in ("kvpool", "adapters") for p in (ROOT / d).rglob("*.py"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_recipe_has_its_blocks_and_every_marker_is_known() -> None:
    found = blocks()
    assert [how for how, _ in found].count("creates the pool") == 1
    assert [how for how, _ in found].count("needs vllm") == 1
    assert {how for how, _ in found} <= KNOWN_HOW
    assert sum(code.count(POOL_LINE) for _, code in found) == 1  # the substitution has one place to land
    assert len(found) >= 6


def test_every_kvpool_command_in_the_recipe_parses() -> None:
    from kvpool.cli import _parser

    lines = [ln.strip() for _, code in blocks() for ln in code.splitlines() if ln.strip().startswith("kvpool ")]
    assert len(lines) >= 6
    for line in lines:
        argv = shlex.split(line, comments=True)
        argv = argv[1:argv.index("|")] if "|" in argv else argv[1:]
        argv = [a for a in argv if a != "&"]
        args, rest = _parser().parse_known_args(argv)  # argparse exits (SystemExit) on a bad one
        assert rest == [], line


def test_the_vllm_block_sets_only_variables_kvpool_reads_and_serves_locally() -> None:
    (code,) = [code for how, code in blocks() if how == "needs vllm"]
    names = set(re.findall(r"\b(KVPOOL_[A-Z_]+)=", code))
    assert {"KVPOOL_VLLM", "KVPOOL_VLLM_TENANT"} <= names
    assert all(kvpool_reads(v) for v in names), names
    serves = [ln for ln in code.replace("\\\n", " ").splitlines() if "vllm.entrypoints.openai.api_server" in ln]
    assert len(serves) == 2 and all("--host 127.0.0.1" in ln for ln in serves)
    # The variables table names only variables kvpool reads, and the vLLM block's among them.
    table = set(re.findall(r"^\| `(KVPOOL_[A-Z_]+)`", RECIPE.read_text(), re.M))
    table |= set(re.findall(r"`, `(KVPOOL_[A-Z_]+)` \|", RECIPE.read_text()))
    assert names <= table and all(kvpool_reads(v) for v in table), table


def test_the_readme_links_the_recipe() -> None:
    assert "](docs/serving-several-models.md)" in (ROOT / "README.md").read_text()


class Recipe:
    """The recipe's blocks, run in order on a private pool.

    ``servers`` is None for the stand-in run; otherwise the vLLM venv's
    python, whose ``bin`` then comes first on ``PATH`` (the recipe installs
    kvpool where vLLM runs: scripts/vllm_venv.sh did), and ``models`` maps
    each of the recipe's model names to a local tiny model.
    """

    def __init__(self, pool: str, tmp_path: pathlib.Path, python: str, models: dict[str, str] | None = None) -> None:
        self.pool, self.tmp, self.models = pool, tmp_path, models
        self.ports = {PORT: f"127.0.0.1:{free_port()}"}
        if models is not None:
            for old in ("--port 8001", "--port 8002"):
                self.ports[old] = f"--port {free_port()}"
        self.env = {**os.environ, "PATH": f"{pathlib.Path(python).parent}{os.pathsep}{os.environ['PATH']}"}
        for k in [k for k in self.env if k.startswith("KVPOOL_") or k == "VLLM_LOGGING_LEVEL"]:
            del self.env[k]
        self.engines: list[subprocess.Popen[str]] = []
        self.background: list[subprocess.Popen[bytes]] = []
        self.servers: subprocess.Popen[str] | None = None
        self.server_lines: list[str] = []
        self._changed = threading.Condition()
        self.outputs: list[str] = []
        self.prelude = ""  # the environment the blocks set (the export), carried into the blocks after it

    def script(self, code: str) -> str:
        code = code.replace(POOL_LINE, f"export KVPOOL_POOL={self.pool}")
        for old, new in {**self.ports, **(self.models or {})}.items():
            code = code.replace(old, new)
        return self.prelude + "set -eo pipefail\n" + code

    def port_of(self, tenant: str) -> int:
        return int(self.ports["--port 8001" if tenant == "chat" else "--port 8002"].split()[1])

    # -- the stand-ins, or the real servers

    def start_stand_ins(self) -> None:
        for tenant, pages in (("chat", 3), ("code", 1)):
            e = subprocess.Popen([sys.executable, str(ENGINE), self.pool, tenant, str(pages)], cwd=self.tmp,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.engines.append(e)
            assert e.stdout is not None
            line = e.stdout.readline()  # the stand-in has joined and committed
            assert json.loads(line)["committed"] == pages * 2 * (2 << 20), line

    def start_servers(self, code: str) -> None:
        """The vLLM block as written (its two ``&`` servers), in a session of
        its own whose shell waits for them; ready when both log so."""
        self.servers = subprocess.Popen(["bash", "-c", self.script(code) + "\nwait"], cwd=self.tmp, env=self.env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        self._reader = threading.Thread(target=self._read_servers, daemon=True)
        self._reader.start()
        with self._changed:
            self._changed.wait_for(lambda: self.servers.poll() is not None  # type: ignore[union-attr]
                                   or sum(READY in ln for ln in self.server_lines) == 2)
            assert self.servers.poll() is None, "a server exited while starting:\n" + self.server_log()[-8000:]
        for tenant in ("chat", "code"):
            wait_listening(self.port_of(tenant), lambda: self.servers is not None and self.servers.poll() is None,
                           self.server_log)

    def _read_servers(self) -> None:
        assert self.servers is not None and self.servers.stdout is not None
        for line in self.servers.stdout:
            with self._changed:
                self.server_lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def server_log(self) -> str:
        with self._changed:
            return "\n".join(self.server_lines)

    def complete(self, tenant: str, model: str) -> dict[str, Any]:
        """One completion, as a client of the server sends it."""
        body = json.dumps({"model": model, "prompt": "the quick brown fox", "max_tokens": 16,
                           "temperature": 0.0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port_of(tenant)}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out: dict[str, Any] = json.loads(r.read())
        return out

    def stop_engines(self) -> None:
        for e in self.engines:
            if e.poll() is None:
                assert e.stdin is not None
                e.stdin.close()
        for e in self.engines:
            assert e.wait(timeout=120) == 0
        if self.servers is not None and self.servers.poll() is None:
            os.killpg(self.servers.pid, signal.SIGTERM)  # as a service manager stops them
            self.servers.wait(timeout=300)
            # The shell waited for the API servers, not for their engine-core
            # processes, which leave the pool as they exit: the blocks after
            # this one (--gc) need the pool empty, as a service manager that
            # waits for the whole unit leaves it.
            pool = Pool(self.pool, create=False)
            wait_until(lambda: not pool.tenants(), "the servers' engine-core processes leave the pool", interval=0.05)

    # -- the run

    def run(self, on_servers_up: Callable[[], None] = lambda: None) -> list[str]:
        try:
            for how, code in blocks():
                if how == "installs" or (how == "needs vllm" and self.models is None):
                    continue
                if how == "after the servers stop":
                    self.stop_engines()
                if how == "needs vllm":
                    self.start_servers(code)
                    on_servers_up()
                    continue
                if how == "background":
                    with open(self.tmp / f"background-{len(self.background)}.log", "wb") as log:
                        self.background.append(subprocess.Popen(  # the child keeps its own fd
                            ["bash", "-c", self.script(code)], cwd=self.tmp, env=self.env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True))
                    continue
                r = subprocess.run(["bash", "-c", self.script(code)], cwd=self.tmp, env=self.env,
                                   capture_output=True, text=True, timeout=300)
                assert r.returncode == 0, f"recipe block failed:\n{code}\n--- stderr:\n{r.stderr}\n--- stdout:\n{r.stdout}"
                self.outputs.append(r.stdout)
                if how == "creates the pool":
                    self.prelude = self.script("\n".join(ln for ln in code.splitlines() if ln.startswith("export ")))
                    self.prelude += "\n"
                    assert f"<Pool {self.pool}: 0 B of 8.0 GiB committed>" in r.stdout
                    # Step 2 followed literally keeps the pool (issue 32): a pool made for later use is
                    # empty, not stale, so nothing tells the operator to collect it.
                    assert re.search(rf"^{re.escape(self.pool)}\s+8\.0 GiB\s+0 B\s+0\s+empty\b", r.stdout, re.M), r.stdout
                    assert "--gc" not in r.stdout, r.stdout
                    if self.models is None:
                        self.start_stand_ins()
            assert len(self.outputs) == len([h for h, _ in blocks() if h not in (*SKIPPED, "background")])
            return self.outputs
        finally:
            for b in self.background:
                os.killpg(b.pid, signal.SIGTERM)
                b.wait(timeout=60)
            for e in self.engines:
                if e.poll() is None:
                    e.kill()
                    e.wait()
                for f in (e.stdin, e.stdout):
                    if f is not None and not f.closed:
                        f.close()
            if self.servers is not None:
                if self.servers.poll() is None:
                    os.killpg(self.servers.pid, signal.SIGKILL)
                self.servers.wait()
                self._reader.join(timeout=60)
                assert self.servers.stdout is not None
                self.servers.stdout.close()
                (self.tmp / "servers.log").write_text(self.server_log())  # kept for a failure's post-mortem


def check_operator_outputs(pool: str, outputs: list[str]) -> dict[str, dict[str, Any]]:
    """Blocks 4-6 as printed: the settings, top's table and JSON, the scrape,
    --gc. Returns top's rows by tenant."""
    _create, limits, top, scrape, gc = outputs
    # 4. the settings, as printed and as the ledger holds them (read before the servers left: the outputs)
    assert limits.split() == ["applied", "guarantee", "applied", "applied", "guarantee", "applied"]
    # 5. top: the table and the JSON snapshot both show the two tenants with their settings
    assert re.search(r"^chat\s", top, re.M) and re.search(r"^code\s", top, re.M), top
    snap = json.loads(top[top.index("\n{") + 1:] if not top.startswith("{") else top)
    rows = {t["name"]: t for t in snap["tenants"]}
    assert set(rows) == {"chat", "code"}
    assert rows["chat"]["limit_bytes"] == 6 * GiB and rows["chat"]["guarantee_setting"] == 4 * GiB
    assert rows["code"]["limit_bytes"] is None and rows["code"]["guarantee_setting"] == 2 * GiB
    # the scrape and the one-off exposition: the ledger's figures for this pool
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, s.labels.get("pool"), s.labels.get("tenant")): s.value
               for f in text_string_to_metric_families(scrape) for s in f.samples}
    assert samples[("kvpool_tenant_committed_bytes", pool, "chat")] == rows["chat"]["committed_bytes"]
    assert samples[("kvpool_tenant_committed_bytes", pool, "code")] == rows["code"]["committed_bytes"]
    assert samples[("kvpool_tenant_guarantee_bytes", pool, "chat")] == 4 * GiB
    assert samples[("kvpool_tenant_guarantee_bytes", pool, "code")] == 2 * GiB
    # 6. --gc removed the pool once its tenants were gone, and said so
    assert re.search(rf"^{re.escape(pool)}\s.*removed", gc, re.M), gc
    assert pool not in list_pools()
    return rows


def skip_unless_8_gib() -> None:
    backing = backing_memory("cpu")
    if backing is not None and backing[0] < 8 * GiB:
        pytest.skip(f"the recipe's pool is 8 GiB; {backing[1]} is {backing[0]} bytes")


@pytest.mark.timeout(600)
def test_the_recipe_runs_as_written_on_a_private_pool(pool_name: str, tmp_path: pathlib.Path) -> None:
    skip_unless_8_gib()
    rows = check_operator_outputs(pool_name, Recipe(pool_name, tmp_path, sys.executable).run())
    # the stand-ins' pages (2 MiB over two layers), as the ledger counts them
    assert rows["chat"]["committed_bytes"] == 3 * 4 * 2**20 and rows["code"]["committed_bytes"] == 4 * 2**20


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_the_recipe_runs_with_two_real_vllm_servers(pool_name: str, tmp_path: pathlib.Path) -> None:
    """The whole recipe, its vLLM block included: two OpenAI servers (tiny
    local models under the recipe's model names) with the plugin on the pool;
    each answers a completion before the operator blocks run."""
    vllm_python = os.environ.get("KVPOOL_VLLM_PYTHON", "")
    if not vllm_python:
        if os.environ.get("KVPOOL_REQUIRE_VLLM") == "1":
            raise RuntimeError("KVPOOL_REQUIRE_VLLM=1 but KVPOOL_VLLM_PYTHON is not set (run scripts/test.sh)")
        pytest.skip("set KVPOOL_VLLM_PYTHON to a vLLM venv's python (scripts/test.sh does)")
    skip_unless_8_gib()
    (code,) = [code for how, code in blocks() if how == "needs vllm"]
    names = re.findall(r"--model (\S+)", code)
    assert len(names) == 2
    models = {}
    for i, name in enumerate(names):  # the recipe's --max-model-len 4096 must fit the model
        out = tmp_path / f"model-{i}"
        subprocess.run([vllm_python, str(TINY), str(out), "4096"], check=True, cwd=tmp_path, capture_output=True,
                       timeout=300)
        models[f"--model {name} "] = f"--model {out} "
    recipe = Recipe(pool_name, tmp_path, vllm_python, models)
    served: dict[str, dict[str, Any]] = {}

    def traffic() -> None:  # what the servers are for: one completion each, so each commits KV pages
        for tenant, model in (("chat", tmp_path / "model-0"), ("code", tmp_path / "model-1")):
            served[tenant] = recipe.complete(tenant, str(model))
        seen = {t.name: t for t in Pool(pool_name, create=False).tenants()}
        assert set(seen) == {"chat", "code"}
        assert all(t.allocs > 0 and t.committed_bytes > 0 for t in seen.values()), seen

    rows = check_operator_outputs(pool_name, recipe.run(traffic))
    assert all(out["usage"]["completion_tokens"] == 16 for out in served.values()), served
    # Each server says the plugin is on, for its pool and tenant, at vLLM's default log level.
    log = recipe.server_log()
    for tenant in ("chat", "code"):
        assert re.search(rf"kvpool is on: pool '{re.escape(pool_name)}' .*tenant '{tenant}'", log), log[-8000:]
        assert 0 < rows[tenant]["committed_bytes"] <= (rows[tenant]["limit_bytes"] or 8 * GiB)
