"""kvpool.adapters.vllm with MLA attention (issue 11, item 2).

A tiny random DeepSeek-V2 (tests/vllm_support/tiny_deepseek_v2.py): MLA
keeps one latent buffer per layer (576 values a token), one KV cache group,
one tensor. vLLM on CPU forces block_size 16 for it and turns prefix caching
off (so only "off" can be tested here). Blocks are 18 KiB; a 72 KiB page
holds 4 of them, 2 layers make a 144 KiB commit.

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

import pytest

from kvpool import Pool

from ._vllm_engines import MAX_TOKENS, build_model, committed, phase, pool_name, prompts, require_vllm, run_engine  # pool_name: a fixture

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

require_vllm()

BLOCK = 16 * 576 * 2  # 16 tokens x 576 latent values x bf16
PAGE = 4 * BLOCK
UNIT = 2 * PAGE  # two layers
ENGINE = {"max_model_len": 512, "block_size": 16}
PLUGIN_ENV = {"KVPOOL_VLLM_PAGE_BYTES": str(PAGE), "KVPOOL_VLLM_IDLE_RELEASE_S": "0"}
PROMPTS = prompts(0)
PROMPTS_2 = prompts(1)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_model("tiny_deepseek_v2.py", tmp_path_factory.mktemp("tiny-deepseek-v2"))


@pytest.fixture(scope="module")
def reference(deepseek: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[int]]]:
    res = run_engine(tmp_path_factory.mktemp("mla-reference"),
                     {"model": deepseek, **ENGINE, "phases": [phase(PROMPTS), phase(PROMPTS_2)]}, plugin=False)
    assert sum(ph["preemptions"] for ph in res["phases"]) == 0
    outs = res["phases"][0]["tokens"] + res["phases"][1]["tokens"]
    # A random model whose greedy output ignored its input would compare
    # equal whatever the KV cache held.
    assert all(len(o) == MAX_TOKENS for o in outs) and len({tuple(o) for o in outs}) == len(outs)
    return {"p1": res["phases"][0]["tokens"], "p2": res["phases"][1]["tokens"]}


def test_an_mla_engine_is_elastic_and_identical_to_stock(
        deepseek: str, reference: dict[str, list[list[int]]], pool_name: str, tmp_path: pathlib.Path) -> None:
    Pool(pool_name, capacity=256 * UNIT)  # 1,023 blocks: the ten prompts hold about 111 at most
    res = run_engine(tmp_path, {"model": deepseek, **ENGINE, "phases": [phase(PROMPTS), phase(PROMPTS_2, sleep_s=0.3)]},
                     plugin=True, pool=pool_name, tenant="mla", env_extra=PLUGIN_ENV)
    assert res["phases"][0]["tokens"] == reference["p1"]
    assert res["phases"][1]["tokens"] == reference["p2"]
    assert sum(ph["preemptions"] for ph in res["phases"]) == 0
    created = [e for e in res["events"] if e["event"] == "vllm space created"]
    assert len(created) == 1 and created[0]["num_layers"] == 2 and created[0]["block_bytes"] == BLOCK, created
    c = committed(res)
    peak = max(c)
    assert peak >= 8 * UNIT and c[0] < peak  # rose with the load (32 blocks and more)...
    assert min(c[c.index(peak):]) <= peak - 2 * UNIT  # ...and fell after it


def test_an_mla_engines_worker_process_maps_the_latent_buffer(
        deepseek: str, pool_name: str, tmp_path: pathlib.Path) -> None:
    # vLLM's default on CPU: the worker in its own process, scheduling ahead
    # of it (async). There this model's greedy tokens depend on timing, in
    # stock vLLM too (measured: two stock runs at different times differed in
    # 7 of 10 outputs, two others agreed), so tokens are not compared here:
    # the worker maps the engine core's latent buffer, serves every request
    # to its length, and memory rises with the load.
    pool = Pool(pool_name, capacity=256 * UNIT)
    res = run_engine(tmp_path, {"model": deepseek, **ENGINE, "in_process": False, "phases": [phase(PROMPTS)]},
                     plugin=True, pool=pool_name, tenant="mla-mp", env_extra=PLUGIN_ENV)
    views = [e for e in res["events"] if e["event"] == "vllm worker views"]
    assert len(views) == 1 and views[0]["shared_file"] is True and views[0]["tensors"] == 1, views
    created = [e for e in res["events"] if e["event"] == "vllm space created"]
    assert views[0]["owner_pid"] == created[0]["pid"] != views[0]["pid"]
    assert [len(t) for t in res["phases"][0]["tokens"]] == [MAX_TOKENS] * len(PROMPTS)
    assert max(committed(res)) >= 8 * UNIT
    assert max(total for _, total, _, _ in res["samples"]) <= pool.capacity
