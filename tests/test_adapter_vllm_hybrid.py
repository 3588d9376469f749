"""kvpool.adapters.vllm with several KV cache groups (issue 11, item 2).

A tiny random Gemma 3 (tests/vllm_support/tiny_gemma3.py): five
sliding-window layers (window 64) and one full-attention layer, for which
vLLM 0.32 builds six KV cache groups of one layer each over one block pool,
their six KV tensors overlaying one backing allocation. The plugin pages that
allocation as one region: a kvpool block is one layer slot of one block id,
whichever group holds it. Commit unit here: one 64 KiB page = 4 blocks of 32
tokens (16 KiB each, float32).

Greedy tokens are compared with the same engine without the plugin; prompts
of 5-200 tokens plus 96 generated reach past the window, so the sliding
groups really drop blocks while the full group keeps them. The engines run
in float32: in bfloat16 this random Gemma 3's greedy tokens depend on batch
composition (stock vLLM with a small KV cache, which preempts, and with a
large one differ in 1 of 10 outputs), so a capped pool, which schedules
differently, could not be compared token for token. In float32 the two stock
runs agree.
"""

from __future__ import annotations

import pathlib

import pytest

from kvpool import Pool

from ._vllm_engines import GEMMA_PAGE, MAX_TOKENS, build_model, committed, phase, prompts, require_vllm, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

require_vllm()

PAGE = GEMMA_PAGE
UNIT = PAGE  # one region: a commit is one page
BLOCK = 16 << 10  # 32 tokens x 2 KV heads x 32 x float32, K and V
# max_model_len 512 with 256-token chunks: one request holds at most 16
# full-attention blocks and 5 x 11 sliding-window blocks (vLLM's own
# per-group figures): 71 blocks, 18 pages with the null block.
ENGINE = {"max_model_len": 512, "max_num_batched_tokens": 256, "dtype": "float32", "page_bytes": PAGE}
PROMPTS = prompts(0)
PROMPTS_2 = [(p[:64] if len(p) > 64 else []) + q for p, q in zip(PROMPTS, prompts(1))]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_model("tiny_gemma3.py", tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def reference(gemma: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[int]]]:
    """Stock vLLM on the hybrid: the tokens every plugin run must reproduce."""
    res = run_engine(tmp_path_factory.mktemp("gemma-reference"),
                     {"model": gemma, **ENGINE, "phases": [phase(PROMPTS), phase(PROMPTS_2)]}, plugin=False)
    return {"p1": res["phases"][0]["tokens"], "p2": res["phases"][1]["tokens"]}


def test_the_reference_depends_on_the_prompt(reference: dict[str, list[list[int]]]) -> None:
    # A random model whose greedy output ignored its input would compare
    # equal whatever the KV cache held.
    outs = reference["p1"] + reference["p2"]
    assert all(len(o) == MAX_TOKENS for o in outs)
    assert len({tuple(o) for o in outs}) == len(outs)
    assert all(len(set(o)) > 4 for o in outs)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_hybrid_model_on_a_capped_pool_is_elastic_and_identical_to_stock(
        gemma: str, reference: dict[str, list[list[int]]], pool_name: str, tmp_path: pathlib.Path,
        prefix_caching: bool) -> None:
    cap = 24 * UNIT  # 95 blocks: less than the ten prompts hold at once, so memory is recycled
    Pool(pool_name, capacity=cap)
    phases = [phase(PROMPTS), phase(PROMPTS_2, sleep_s=0.3)]
    if prefix_caching:
        phases[1]["limit_bytes"] = 20 * UNIT  # cached blocks stay held while idle: a lower limit evicts pages
    res = run_engine(tmp_path, {"model": gemma, **ENGINE, "prefix_caching": prefix_caching, "phases": phases},
                     plugin=True, pool=pool_name, tenant="gemma", env_extra={"KVPOOL_VLLM_IDLE_RELEASE_S": "0"})
    assert res["phases"][0]["tokens"] == reference["p1"]
    assert res["phases"][1]["tokens"] == reference["p2"]
    created = [e for e in res["events"] if e["event"] == "vllm space created"]
    assert len(created) == 1 and created[0]["kv_cache_groups"] == 6, created
    assert created[0]["num_layers"] == 1 and created[0]["block_bytes"] == BLOCK  # the groups share one region
    c = committed(res)
    peak = max(c)
    assert peak >= cap - UNIT and c[0] < peak  # rose to the cap: the work needs more than the pool
    after_peak = c[c.index(peak):]
    assert min(after_peak) <= peak - 2 * UNIT  # and fell after it
    assert sum(ph["preemptions"] for ph in res["phases"]) > 0  # the cap really bound: vLLM preempted


def test_a_hybrid_engine_whose_pool_cannot_hold_one_request_refuses_with_the_groups_figures(
        gemma: str, pool_name: str, tmp_path: pathlib.Path) -> None:
    pool = Pool(pool_name, capacity=17 * UNIT)  # 67 blocks; one 512-token request holds 71 (16 + 5 x 11)
    proc, out_path = run_engine(tmp_path, {"model": gemma, **ENGINE, "phases": [phase(PROMPTS[:1])]}, plugin=True,
                                pool=pool_name, tenant="too-small", wait=False)
    _, stderr = proc.communicate(timeout=400)
    assert proc.returncode != 0 and not out_path.exists()
    assert "KV cache is needed, which is larger than the available KV cache memory" in stderr, stderr[-4000:]
    assert f"({71 * BLOCK} bytes" in stderr and "71 blocks of 32 tokens" in stderr, stderr[-4000:]
    assert f"({67 * BLOCK} bytes" in stderr, stderr[-4000:]
    assert [t.name for t in pool.tenants()] == []


def test_a_pool_that_holds_one_request_starts_the_hybrid_engine(
        gemma: str, reference: dict[str, list[list[int]]], pool_name: str, tmp_path: pathlib.Path) -> None:
    # The admission figure is vLLM's own per-group need, not max_model_len
    # blocks in each of the six groups (6 x 16 = 96 blocks would refuse it).
    Pool(pool_name, capacity=18 * UNIT)  # 71 blocks
    res = run_engine(tmp_path, {"model": gemma, **ENGINE, "phases": [phase(PROMPTS[:2])]}, plugin=True,
                     pool=pool_name, tenant="just-fits", env_extra={"KVPOOL_VLLM_IDLE_RELEASE_S": "0"})
    assert res["phases"][0]["tokens"] == reference["p1"][:2]


def test_the_hybrid_workers_process_maps_every_groups_views(
        gemma: str, reference: dict[str, list[list[int]]], pool_name: str, tmp_path: pathlib.Path) -> None:
    # vLLM's default on CPU: the worker is another process; it maps the
    # engine core's memory file and views it once per group's tensor.
    Pool(pool_name, capacity=256 << 20)
    res = run_engine(tmp_path, {"model": gemma, **ENGINE, "in_process": False, "phases": [phase(PROMPTS)]},
                     plugin=True, pool=pool_name, tenant="gemma-mp")
    assert res["phases"][0]["tokens"] == reference["p1"]
    views = [e for e in res["events"] if e["event"] == "vllm worker views"]
    assert len(views) == 1 and views[0]["shared_file"] is True, views
    assert views[0]["tensors"] == 6 and views[0]["groups"] == 6, views
    assert max(committed(res)) >= 2 * UNIT
