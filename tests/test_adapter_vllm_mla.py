"""kvpool.adapters.vllm with MLA attention (issue 11, item 2).

A tiny random DeepSeek-V2 (tests/vllm_support/tiny_deepseek_v2.py): MLA
keeps one latent buffer per layer (576 values a token), one KV cache group,
one tensor. vLLM on CPU has two MLA backends and each test names the one it
runs: the reference ``CPU_MLA`` (every x86 CPU; vLLM forces block_size 16
and turns prefix caching off for it) and ``AMX_MLA`` (vLLM's default on a
CPU with AMX tiles; block sizes a multiple of 32; skipped elsewhere). Left
to vLLM, the same test ran another kernel at another geometry on another
machine, and block_size 16 failed at start-up on AMX. Prefix caching is off
in both (the reference backend allows nothing else). With the reference
backend blocks are 18 KiB; a 72 KiB page holds 4 of them, 2 layers make a
144 KiB commit.

The pool here is large enough that vLLM never preempts: on this model a
preempted request is recomputed through MLA's prefill path, whose numerics
differ from the decode kernel's, and stock vLLM itself then gives other
tokens (5 of 10 outputs differ between a stock engine with a small KV cache
and one with a large cache, bf16 and float32 alike). Memory still rises with
load and falls after: pages are committed as blocks are used. With the
worker in its own process (the last test) tokens are not compared: there
they depend on timing in stock vLLM too.
"""

from __future__ import annotations

import pathlib
import platform

import pytest

from kvpool import Pool

from ._vllm_engines import MAX_TOKENS, build_model, committed, phase, prompts, require_vllm, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

require_vllm()

# vLLM's two CPU MLA backends and the block size each takes: the reference
# kernels (every x86 CPU) and the AMX kernels (CPUs with AMX tiles, which
# vLLM picks by default there).
BACKENDS = {"CPU_MLA": 16, "AMX_MLA": 32}
PROMPTS = prompts(0)
PROMPTS_2 = prompts(1)


def _has_amx() -> bool:
    # vLLM's own test for picking AMX_MLA (vllm/platforms/cpu.py).
    import torch

    return platform.machine() == "x86_64" and bool(torch.cpu._is_amx_tile_supported())


class Backend:
    """One MLA backend's engine settings and the kvpool geometry they give:
    a block is block_size tokens x 576 latent values x bf16, a page holds 4
    blocks, a commit covers both layers."""

    def __init__(self, name: str) -> None:
        self.name, self.block_size = name, BACKENDS[name]
        self.block = self.block_size * 576 * 2
        self.page = 4 * self.block
        self.unit = 2 * self.page
        self.engine = {"max_model_len": 512, "block_size": self.block_size, "attention_backend": name,
                       "dtype": "bfloat16"}
        self.plugin_env = {"KVPOOL_VLLM_PAGE_BYTES": str(self.page), "KVPOOL_VLLM_IDLE_RELEASE_S": "0"}


@pytest.fixture(scope="module", params=list(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "AMX_MLA" and not _has_amx():
        pytest.skip("vLLM's AMX MLA backend needs a CPU with AMX tiles")
    return Backend(request.param)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_model("tiny_deepseek_v2.py", tmp_path_factory.mktemp("tiny-deepseek-v2"))


@pytest.fixture(scope="module")
def reference(deepseek: str, backend: Backend, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[int]]]:
    res = run_engine(tmp_path_factory.mktemp("mla-reference"),
                     {"model": deepseek, **backend.engine, "phases": [phase(PROMPTS), phase(PROMPTS_2)]},
                     plugin=False)
    assert sum(ph["preemptions"] for ph in res["phases"]) == 0
    outs = res["phases"][0]["tokens"] + res["phases"][1]["tokens"]
    # A random model whose greedy output ignored its input would compare
    # equal whatever the KV cache held.
    assert all(len(o) == MAX_TOKENS for o in outs) and len({tuple(o) for o in outs}) == len(outs)
    return {"p1": res["phases"][0]["tokens"], "p2": res["phases"][1]["tokens"]}


def test_an_mla_engine_is_elastic_and_identical_to_stock(
        deepseek: str, backend: Backend, reference: dict[str, list[list[int]]], pool_name: str,
        tmp_path: pathlib.Path) -> None:
    unit = backend.unit
    Pool(pool_name, capacity=256 * unit)  # 1,023 blocks: the ten prompts hold at most about 111 (of 16 tokens)
    res = run_engine(tmp_path, {"model": deepseek, **backend.engine,
                                "phases": [phase(PROMPTS), phase(PROMPTS_2, sleep_s=0.3)]},
                     plugin=True, pool=pool_name, tenant="mla", env_extra=backend.plugin_env)
    assert res["phases"][0]["tokens"] == reference["p1"]
    assert res["phases"][1]["tokens"] == reference["p2"]
    assert sum(ph["preemptions"] for ph in res["phases"]) == 0
    created = [e for e in res["events"] if e["event"] == "vllm space created"]
    assert len(created) == 1 and created[0]["num_layers"] == 2 and created[0]["block_bytes"] == backend.block, created
    c = committed(res)
    peak = max(c)
    assert peak >= 8 * unit and c[0] < peak  # rose with the load (32 blocks and more)...
    assert min(c[c.index(peak):]) <= peak - 2 * unit  # ...and fell after it


def test_an_mla_engines_worker_process_maps_the_latent_buffer(
        deepseek: str, pool_name: str, tmp_path: pathlib.Path) -> None:
    # vLLM's default on CPU: the worker in its own process, scheduling ahead
    # of it (async). There this model's greedy tokens depend on timing, in
    # stock vLLM too (measured: two stock runs at different times differed in
    # 7 of 10 outputs, two others agreed), so tokens are not compared here:
    # the worker maps the engine core's latent buffer, serves every request
    # to its length, and memory rises with the load. The reference backend,
    # which every x86 CPU runs.
    backend = Backend("CPU_MLA")
    pool = Pool(pool_name, capacity=256 * backend.unit)
    res = run_engine(tmp_path, {"model": deepseek, **backend.engine, "in_process": False, "phases": [phase(PROMPTS)]},
                     plugin=True, pool=pool_name, tenant="mla-mp", env_extra=backend.plugin_env)
    views = [e for e in res["events"] if e["event"] == "vllm worker views"]
    assert len(views) == 1 and views[0]["shared_file"] is True and views[0]["tensors"] == 1, views
    created = [e for e in res["events"] if e["event"] == "vllm space created"]
    assert views[0]["owner_pid"] == created[0]["pid"] != views[0]["pid"]
    assert [len(t) for t in res["phases"][0]["tokens"]] == [MAX_TOKENS] * len(PROMPTS)
    assert max(committed(res)) >= 8 * backend.unit
    assert max(total for _, total, _, _ in res["samples"]) <= pool.capacity
