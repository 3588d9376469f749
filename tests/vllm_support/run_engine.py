"""Run one vLLM engine on the tiny model and report what it did, as JSON.

Run with the vLLM venv's Python: ``python run_engine.py CONFIG.json OUT.json``.
Used by tests/test_adapter_vllm.py and scripts/bench_engines.py. The plugin is
on when the environment says so (``KVPOOL_VLLM=1``); this script never
imports kvpool's adapters itself, so it measures vLLM as an operator runs it.

CONFIG keys: model, phases (list of {prompts: [[token ids]], max_tokens,
limit_bytes?}), prefix_caching, kv_cache_memory_bytes, max_num_seqs,
block_size, in_process (bool), tenant (for limits), pool (sampled every few
ms when set), ready_file / go_file (optional start barrier).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def main() -> None:
    cfg = json.loads(open(sys.argv[1]).read())
    out_path = sys.argv[2]
    if cfg.get("in_process", True):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(
        model=cfg["model"], dtype="bfloat16", block_size=cfg.get("block_size", 32),
        max_model_len=cfg.get("max_model_len", 1024), kv_cache_memory_bytes=cfg.get("kv_cache_memory_bytes", 64 << 20),
        distributed_executor_backend="uni" if cfg.get("in_process", True) else None,
        enable_prefix_caching=cfg.get("prefix_caching", False), enforce_eager=True, seed=0,
        max_num_seqs=cfg.get("max_num_seqs", 8), max_num_batched_tokens=cfg.get("max_num_batched_tokens", 1024),
    )
    init_s = time.monotonic() - t0

    pool = None
    samples: list[tuple[float, int, int]] = []  # (t, pool committed, this tenant committed)
    stop = threading.Event()
    if cfg.get("pool"):
        from kvpool import Pool

        pool = Pool(cfg["pool"], create=False)
        tenant = cfg.get("tenant")

        def sample() -> None:
            while not stop.is_set():
                mine = sum(t.committed_bytes for t in pool.tenants() if t.name == tenant)
                samples.append((time.monotonic(), pool.committed, mine))
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

    if cfg.get("ready_file"):
        open(cfg["ready_file"], "w").close()
        while not os.path.exists(cfg["go_file"]):
            time.sleep(0.01)

    phases = []
    for phase in cfg["phases"]:
        if phase.get("limit_bytes") is not None:
            assert pool is not None
            assert pool.set_limit(cfg["tenant"], phase["limit_bytes"]) in ("applied", "deferred", "same")
        if phase.get("sleep_s"):
            time.sleep(phase["sleep_s"])
        sp = SamplingParams(temperature=0, max_tokens=phase.get("max_tokens", 32), ignore_eos=True)
        start = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": p} for p in phase["prompts"]], sp, use_tqdm=False)
        gen_s = time.monotonic() - start
        phases.append({
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "gen_s": gen_s,
            "start": start,
            "end": start + gen_s,
        })
    stop.set()
    result = {
        "init_s": init_s,
        "phases": phases,
        "samples": samples,
        "pid": os.getpid(),
        "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)
    del llm


if __name__ == "__main__":
    main()
