"""The vLLM plugin on a real GPU: stock vLLM against KVPOOL_VLLM=1, same tokens.

Run by scripts/gpu_check.sh on a lent GPU machine whose image has vLLM
(``python gpu_vllm_check.py OUT_DIR``): builds the tiny random-weight Llama
(tiny_llama.py, no hub), runs run_engine.py on it twice, stock and with the
plugin on a pool capped below what the prompts need at once (so the plugin
commits, releases and recycles pages while vLLM preempts), and compares the
greedy tokens. Writes OUT_DIR/gpu-vllm.json; exit 0 only if every prompt's
tokens are identical and the plugin's tenant really committed memory.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys
import uuid

HERE = pathlib.Path(__file__).parent
PAGE = 128 << 10  # the plugin's page per layer, as the CPU tests use


def engine(out: pathlib.Path, model: str, prompts: list[list[int]], *, plugin: bool, pool: str) -> dict:
    cfg = {"model": model, "dtype": "float32", "max_num_seqs": 10, "kv_cache_memory_bytes": 64 << 20,
           "max_model_len": 512,  # 16 blocks: one request fits the small pool below
           "phases": [{"prompts": prompts, "max_tokens": 64}], "pool": pool if plugin else None,
           "tenant": "gpu-check" if plugin else None}
    cfg_path = out / f"cfg-{'plugin' if plugin else 'stock'}.json"
    res_path = cfg_path.with_suffix(".out.json")
    cfg_path.write_text(json.dumps(cfg))
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    env.pop("KVPOOL_VLLM", None)
    if plugin:
        env.update(KVPOOL_VLLM="1", KVPOOL_VLLM_PAGE_BYTES=str(PAGE), KVPOOL_POOL=pool, KVPOOL_VLLM_TENANT="gpu-check")
    r = subprocess.run([sys.executable, str(HERE / "run_engine.py"), str(cfg_path), str(res_path)], env=env,
                       capture_output=True, text=True, timeout=400)
    if r.returncode != 0:
        raise SystemExit(f"{'plugin' if plugin else 'stock'} engine failed:\n{r.stderr[-4000:]}")
    return json.loads(res_path.read_text())


def main() -> int:
    out = pathlib.Path(sys.argv[1])
    model = out / "tiny-llama"
    model.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(HERE / "tiny_llama.py"), str(model)], check=True, timeout=300)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 40, 90, 150, 33, 64, 120)]
    from kvpool import Pool

    pool = f"gpu-check-{uuid.uuid4().hex[:6]}"
    # 4 page commits of the two-layer model (32 blocks of 32 tokens): one 512-token
    # request fits, the 8 prompts at once (36 blocks) do not, so pages recycle.
    Pool(pool, capacity=4 * 2 * PAGE)
    try:
        stock = engine(out, str(model), prompts, plugin=False, pool=pool)
        plugin = engine(out, str(model), prompts, plugin=True, pool=pool)
    finally:
        Pool.remove(pool)
    same = [a == b for a, b in zip(stock["phases"][0]["tokens"], plugin["phases"][0]["tokens"])]
    peak = (plugin["phases"][0].get("tenants_max") or {}).get("gpu-check", 0)
    verdict = {"prompts": len(prompts), "identical": sum(same), "plugin_peak_committed_bytes": peak,
               "plugin_preemptions": plugin["phases"][0].get("preemptions")}
    (out / "gpu-vllm.json").write_text(json.dumps(verdict, indent=1))
    print(json.dumps(verdict))
    return 0 if all(same) and len(same) == len(prompts) and peak > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
