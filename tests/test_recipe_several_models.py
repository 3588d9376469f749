"""docs/serving-several-models.md: the operator's recipe runs as written (issue 13, item 7).

Every ```bash block of the recipe runs, in order, in bash (``set -eo
pipefail``) with this venv's ``bin`` first on ``PATH``, in an empty folder.
Two substitutions keep the run private to the test, and nothing else is
changed: the line ``export KVPOOL_POOL=models`` names a pool of the test's
own, and the exporter's ``127.0.0.1:9464`` becomes a free port. An HTML
comment before a block says how it runs:

* ``creates the pool``: run; then two stand-ins for the vLLM servers
  (tests/_recipe_engine.py) join the pool as ``chat`` and ``code``;
* ``installs``: the ``pip install`` step, which is this test's own set-up
  (kvpool is installed in the venv it runs from): not run;
* ``needs vllm``: the vLLM server block, not run here (no vLLM, no
  model); every ``KVPOOL_*`` variable it sets must be one kvpool reads, and it
  serves on 127.0.0.1 only;
* ``background``: started in a session of its own, stopped at the end;
* ``after the servers stop``: run once the stand-ins have exited.

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
import uuid
from collections.abc import Iterator

import pytest

from kvpool import Pool, list_pools
from kvpool.pool import backing_memory

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECIPE = ROOT / "docs" / "serving-several-models.md"
ENGINE = pathlib.Path(__file__).with_name("_recipe_engine.py")
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


@pytest.fixture
def pool() -> Iterator[str]:
    name = f"test-recipe-{uuid.uuid4().hex[:8]}"
    yield name
    Pool.remove(name)


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


@pytest.mark.timeout(600)
def test_the_recipe_runs_as_written_on_a_private_pool(pool: str, tmp_path: pathlib.Path) -> None:
    backing = backing_memory("cpu")
    if backing is not None and backing[0] < 8 * GiB:
        pytest.skip(f"the recipe's pool is 8 GiB; {backing[1]} is {backing[0]} bytes")
    port = free_port()
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("KVPOOL_POOL", None)
    engines: list[subprocess.Popen[str]] = []
    background: list[subprocess.Popen[bytes]] = []
    outputs: list[str] = []

    def script(code: str) -> str:
        return "set -eo pipefail\n" + code.replace(POOL_LINE, f"export KVPOOL_POOL={pool}").replace(
            PORT, f"127.0.0.1:{port}")

    def stop_engines() -> None:
        for e in engines:
            if e.poll() is None:
                assert e.stdin is not None
                e.stdin.close()
        for e in engines:
            assert e.wait(timeout=120) == 0

    prelude = ""  # the environment the blocks set (the export), carried into the blocks after it
    try:
        for how, code in blocks():
            if how in SKIPPED:
                continue
            if how == "after the servers stop":
                stop_engines()
            if how == "background":
                with open(tmp_path / f"background-{len(background)}.log", "wb") as log:  # the child keeps its own fd
                    background.append(subprocess.Popen(["bash", "-c", prelude + script(code)], cwd=tmp_path, env=env,
                                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
                continue
            r = subprocess.run(["bash", "-c", prelude + script(code)], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, f"recipe block failed:\n{code}\n--- stderr:\n{r.stderr}\n--- stdout:\n{r.stdout}"
            outputs.append(r.stdout)
            if how == "creates the pool":
                prelude = script("\n".join(ln for ln in code.splitlines() if ln.startswith("export "))) + "\n"
                assert f"<Pool {pool}: 0.0/8192.0 MiB committed>" in r.stdout
                assert re.search(rf"^{re.escape(pool)}\s+8192\.0\s+0\.0\s+0\b", r.stdout, re.M), r.stdout
                for tenant, pages in (("chat", 3), ("code", 1)):
                    e = subprocess.Popen([sys.executable, str(ENGINE), pool, tenant, str(pages)], cwd=tmp_path,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                    engines.append(e)
                    assert e.stdout is not None
                    line = e.stdout.readline()  # the stand-in has joined and committed
                    assert json.loads(line)["committed"] == pages * 2 * (2 << 20), line
        assert len(outputs) == len([h for h, _ in blocks() if h not in (*SKIPPED, "background")])
    finally:
        for b in background:
            os.killpg(b.pid, signal.SIGTERM)
            b.wait(timeout=60)
        for e in engines:
            if e.poll() is None:
                e.kill()
                e.wait()
            for f in (e.stdin, e.stdout):
                if f is not None and not f.closed:
                    f.close()

    _create, limits, top, scrape, gc = outputs
    # 4. the settings, as printed and as the ledger holds them (read before the stand-ins left: the outputs)
    assert limits.split() == ["applied", "guarantee", "applied", "applied", "guarantee", "applied"]
    # 5. top: the table and the JSON snapshot both show the two tenants with their settings
    assert re.search(r"^chat\s", top, re.M) and re.search(r"^code\s", top, re.M), top
    snap = json.loads(top[top.index("\n{") + 1:] if not top.startswith("{") else top)
    rows = {t["name"]: t for t in snap["tenants"]}
    assert set(rows) == {"chat", "code"}
    assert rows["chat"]["limit_bytes"] == 6 * GiB and rows["chat"]["guarantee_setting"] == 4 * GiB
    assert rows["code"]["limit_bytes"] is None and rows["code"]["guarantee_setting"] == 2 * GiB
    assert rows["chat"]["committed_bytes"] == 3 * 4 * 2**20 and rows["code"]["committed_bytes"] == 4 * 2**20
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
