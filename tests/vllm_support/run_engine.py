"""Run one vLLM engine on the tiny model and report what it did, as JSON.

Run with the vLLM venv's Python: ``python run_engine.py CONFIG.json OUT.json``.
Used by tests/test_adapter_vllm.py and `kvpool bench engines`. The plugin is
on when the environment says so (``KVPOOL_VLLM=1``); this script never
imports kvpool's adapters itself, so it measures vLLM as an operator runs it.

CONFIG keys: model, dtype (default bfloat16), phases (list of {prompts: [[token ids]], max_tokens,
limit_bytes?, sleep_s?, wait_file?, done_file?, barrier?}), prefix_caching,
kv_cache_memory_bytes, max_num_seqs, block_size, max_model_len, attention_backend (a vLLM
backend name; default vLLM's choice), in_process
(bool), tensor_parallel_size (default 1; ranks are worker processes, one
core each), tenant (for limits), pool (sampled every few ms when set),
ready_file / go_file (optional start barrier).

With ``sample_memory``, the plugin on and the engine core in this process,
the samples also carry the real memory of the space's memory file (its allocated bytes, by
SEEK_DATA/SEEK_HOLE, not kvpool's books) in ``ranks`` equal slices, one per
rank; each phase ends with ``quiescent`` = [ledger bytes, [bytes per rank]]
read together. ``shutdown_check``: shut the engine down before exiting and
report the pool's tenants then (``tenants_after_shutdown``).

Phases are ordered by events, not time: ``wait_file`` holds a phase back
until that file exists, ``done_file`` is created when it ends. A phase with
``barrier`` {committed_bytes, ready_file, go_file} steps the engine itself
and, after the first step at which this tenant holds at least
committed_bytes with requests still running, creates ready_file and parks
(between steps) until go_file exists. Each phase reports the pool's tenants
as it started (``tenants_at_start``), the least and most each held while
it ran (``tenants_min`` / ``tenants_max``, sampled), and, in-process, the
scheduler's preemptions during it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any


def main() -> None:
    cfg = json.loads(open(sys.argv[1]).read())
    out_path = sys.argv[2]
    if cfg.get("in_process", True):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    tp = int(cfg.get("tensor_parallel_size", 1))
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1))
                                                                    for i in range(tp)))
    from vllm import LLM, SamplingParams

    preemptions = [0]
    if cfg.get("in_process", True):
        # The scheduler runs in this process: count its preemptions.
        from vllm.v1.core.sched.scheduler import Scheduler

        original_preempt = Scheduler._preempt_request

        def counting_preempt(self: Any, *args: Any, **kwargs: Any) -> Any:
            preemptions[0] += 1
            return original_preempt(self, *args, **kwargs)

        Scheduler._preempt_request = counting_preempt

    t0 = time.monotonic()
    llm = LLM(
        model=cfg["model"], dtype=cfg.get("dtype", "bfloat16"), block_size=cfg.get("block_size", 32),
        max_model_len=cfg.get("max_model_len", 1024), kv_cache_memory_bytes=cfg.get("kv_cache_memory_bytes", 64 << 20),
        distributed_executor_backend="mp" if tp > 1 else "uni" if cfg.get("in_process", True) else None,
        tensor_parallel_size=tp,
        enable_prefix_caching=cfg.get("prefix_caching", False), enforce_eager=True, seed=0,
        max_num_seqs=cfg.get("max_num_seqs", 8), max_num_batched_tokens=cfg.get("max_num_batched_tokens", 1024),
        attention_backend=cfg.get("attention_backend"),
    )
    init_s = time.monotonic() - t0

    pool = None
    samples: list[tuple[float, int, int, list[int]]] = []  # (t, pool committed, this tenant's, memory per rank)
    stop = threading.Event()
    current: dict[str, Any] = {}  # the running phase's min/max per tenant (the sampler fills them)
    lock = threading.Lock()
    if cfg.get("pool"):
        from kvpool import Pool

        pool = Pool(cfg["pool"], create=False)
        tenant = cfg.get("tenant")

        def sample() -> None:
            while not stop.is_set():
                snap = pool.snapshot()
                held = {t.name: t.committed_bytes for t in snap.tenants}
                samples.append((time.monotonic(), snap.committed, held.get(tenant, 0),
                                memory_per_rank(tp) if cfg.get("sample_memory") else []))
                with lock:
                    if current:
                        for name, c in held.items():
                            current["min"][name] = min(current["min"].get(name, c), c)
                            current["max"][name] = max(current["max"].get(name, c), c)
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

    def wait_for(path: str) -> None:
        while not os.path.exists(path):
            time.sleep(0.01)

    def held_now() -> dict[str, int]:
        return {t.name: t.committed_bytes for t in pool.snapshot().tenants} if pool is not None else {}

    if cfg.get("ready_file"):
        open(cfg["ready_file"], "w").close()
        wait_for(cfg["go_file"])

    phases = []
    for phase in cfg["phases"]:
        if phase.get("wait_file"):
            wait_for(phase["wait_file"])
        if phase.get("limit_bytes") is not None:
            assert pool is not None
            assert pool.set_limit(cfg["tenant"], phase["limit_bytes"]) in ("applied", "deferred", "same")
        if phase.get("sleep_s"):
            time.sleep(phase["sleep_s"])
        sp = SamplingParams(temperature=0, max_tokens=phase.get("max_tokens", 32), ignore_eos=True)
        at_start = held_now()
        with lock:
            current.update(min=dict(at_start), max=dict(at_start))
        preempted_before = preemptions[0]
        start = time.monotonic()
        barrier_reached, preempted_at_barrier = None, None
        if phase.get("barrier"):
            tokens, preempted_at_barrier = stepped(llm, phase["prompts"], sp, phase["barrier"], cfg.get("tenant"),
                                                   pool, preemptions)
            barrier_reached = preempted_at_barrier is not None
        else:
            outs = llm.generate([{"prompt_token_ids": p} for p in phase["prompts"]], sp, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
        gen_s = time.monotonic() - start
        with lock:
            low, high = current.pop("min"), current.pop("max")
        quiescent = None
        if pool is not None:
            for _ in range(100):  # the ledger and the memory file, read while neither moves
                before, memory, after = held_now().get(cfg.get("tenant"), 0), memory_per_rank(tp), \
                    held_now().get(cfg.get("tenant"), 0)
                if before == after:
                    quiescent = [after, memory]
                    break
        phases.append({
            "quiescent": quiescent,
            "tokens": tokens,
            "gen_s": gen_s,
            "start": start,
            "end": start + gen_s,
            "tenants_at_start": at_start,
            "tenants_min": low,
            "tenants_max": high,
            "preemptions": preemptions[0] - preempted_before,
            "barrier_reached": barrier_reached,
            # Preemptions from the barrier's release to the phase's end.
            "preemptions_after_barrier": None if preempted_at_barrier is None
            else preemptions[0] - preempted_at_barrier,
        })
        if phase.get("done_file"):
            open(phase["done_file"], "w").close()
    stop.set()
    result = {
        "init_s": init_s,
        "phases": phases,
        "samples": samples,
        "pid": os.getpid(),
        "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
    }
    if cfg.get("shutdown_check") and pool is not None:
        # The engine shut down, this process still alive: its tenant must
        # have left the pool (the executor's shutdown closes the space).
        llm.llm_engine.engine_core.shutdown()
        result["tenants_after_shutdown"] = [t.name for t in pool.tenants()]
    with open(out_path, "w") as f:
        json.dump(result, f)
    del llm


def memory_per_rank(ranks: int) -> list[int]:
    """Allocated bytes of this process's kvpool memory files, in ``ranks``
    equal slices (the space holds rank r's regions in slice r); a mirrored
    space (KVPOOL_VLLM_MIRROR=1) has none here: then each worker process (a
    descendant) holds one file, its rank's memory, listed in pid order.
    [] when no process holds one (the plugin off, or the engine core elsewhere)."""
    own = _allocated(os.getpid())
    if own:
        out = [0] * ranks
        for size, extents in own:
            step = size // ranks
            for data, hole in extents:
                for r in range(ranks):  # the extent's bytes in each rank's slice
                    out[r] += max(0, min(hole, (r + 1) * step) - max(data, r * step))
        return out
    per_worker = [sum(hole - data for _, extents in files for data, hole in extents)
                  for pid in _descendants() if (files := _allocated(pid))]
    return per_worker if len(per_worker) == ranks else []


def _allocated(pid: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """(size, allocated extents) of each kvpool memory file process ``pid`` holds."""
    files = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for name in names:
        try:
            if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("/memfd:kvpool-space"):
                continue
            fd = os.open(f"/proc/{pid}/fd/{name}", os.O_RDONLY)
        except OSError:
            continue  # closed meanwhile
        try:
            size, pos, extents = os.fstat(fd).st_size, 0, []
            while pos < size:
                try:
                    data = os.lseek(fd, pos, os.SEEK_DATA)
                except OSError:
                    break  # no data after pos
                hole = os.lseek(fd, data, os.SEEK_HOLE)
                extents.append((data, hole))
                pos = hole
            files.append((size, extents))
        finally:
            os.close(fd)
    return files


def _descendants() -> list[int]:
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    mine, found = {os.getpid()}, True
    while found:
        found = False
        for pid, ppid in parent.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                found = True
    return sorted(mine - {os.getpid()})


def stepped(llm: Any, prompts: list[list[int]], sp: Any, barrier: dict[str, Any], tenant: str | None,
            pool: Any, preemptions: list[int]) -> tuple[list[list[int]], int | None]:
    """Generate by stepping the engine, parking once at the barrier (see the
    module doc); returns the tokens and the preemption count at the barrier's
    release (``None``: never reached)."""
    assert pool is not None and tenant, "a barrier needs the pool and the tenant"
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"barrier-{i}-", {"prompt_token_ids": p}, sp)
    done: dict[int, list[int]] = {}  # by prompt index (vLLM may suffix the ids)
    reached: int | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id.split("-")[1])] = list(out.outputs[0].token_ids)
        if reached is None and engine.has_unfinished_requests():
            mine = sum(t.committed_bytes for t in pool.snapshot().tenants if t.name == tenant)
            if mine >= barrier["committed_bytes"]:
                open(barrier["ready_file"], "w").close()
                while not os.path.exists(barrier["go_file"]):
                    time.sleep(0.01)
                reached = preemptions[0]
    if reached is None:
        open(barrier["ready_file"], "w").close()  # never reached: let the waiter see it and fail
    return [done[i] for i in range(len(prompts))], reached


if __name__ == "__main__":
    main()
