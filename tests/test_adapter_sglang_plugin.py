"""kvpool's SGLang plugin (kvpool.adapters.sglang_plugin) against SGLang's real classes.

SGLang cannot be installed on this CPU machine (it pins a CUDA torch and
CUDA-only kernels), so the checks (tests/sglang_support/plugin_checks.py)
run in one child of the vLLM venv ($KVPOOL_VLLM_PYTHON), which holds the CPU
torch and most of SGLang's pure-Python dependencies, with SGLang's own
unpacked wheel first on the path ($KVPOOL_SGLANG_SOURCE, built by
scripts/sglang_src.sh; a torchvision stand-in is the one stub). SGLang's
``load_plugins()`` finds kvpool through its entry point (kvpool installed
in that venv), and the checks drive SGLang's own ``MHATokenToKVPool``,
``PagedTokenToKVPoolAllocator``, ``SchedulerInvariantChecker`` and hook
registry; each reports "ok" or its traceback.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import uuid

import pytest

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


@pytest.fixture(scope="session")
def plugin_checks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env = dict(os.environ)
    path = [os.path.join(SOURCE, d) for d in ("src", "deps", "stubs")]
    env["PYTHONPATH"] = os.pathsep.join([*path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for name in ("KVPOOL_SGLANG", "KVPOOL_SGLANG_ALLOW_UNTESTED", "SGLANG_PLUGINS"):
        env.pop(name, None)
    res = subprocess.run([PYTHON, str(HERE / "plugin_checks.py"), f"test-sgl-{uuid.uuid4().hex[:6]}"],
                         cwd=tmp_path_factory.mktemp("sglang"), env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    results: dict[str, str] = json.loads(res.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_sglang_plugin(plugin_checks: dict[str, str], name: str) -> None:
    assert plugin_checks[name] == "ok", plugin_checks[name]
