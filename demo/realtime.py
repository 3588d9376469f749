"""``kvpool demo``'s real engines: tiny decoders over kvpool tensors, on one loop or one process each.

Each engine is a small decoder (random weights, real multi-head attention,
:mod:`kvpool.demo.model`) whose keys and values live in kvpool tensors,
addressed through per-request block tables. The engines serve a request
trace concurrently on one asyncio loop (:func:`run_mode`), or each in its own
process joined only by the pool ledger (:func:`run_mode_processes`, the
``--processes`` worker: :func:`worker`). Admission and preemption are the
scheduler's (:mod:`kvpool.demo.sched`).

Each engine computes with one torch thread: with two, elastic's larger
batches cross torch's intra-op parallel threshold while static's small ones
stay serial, and on a busy (oversubscribed) machine the spinning threads
collapse elastic's throughput (issue 14).

The monitors record, per engine and about every 0.1 s, committed memory
(``engine-<e>``) and the requests waiting for KV memory (``waiting-<e>``);
the plot draws both, so a stall (memory flat while requests queue) shows.

Correctness is checked in every run: a sample of requests is decoded again
with a plain contiguous KV cache and must give the same greedy tokens
(:func:`check_correctness`).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import random
import sys
import time
import uuid
from typing import Any

import torch

from kvpool import Geometry, KVCacheManager, Pool

from .clock import RealClock
from .common import COMMIT_BYTES_PER_BLOCK, PAGE_BYTES, headroom_bytes, stop_monitor, summarize
from .model import BLOCK_BYTES, HEAD_DIM, HEADS, LAYERS, ContiguousKV, PagedKV, TinyDecoder, greedy
from .sched import Running as RunningRequest
from .sched import Scheduler
from .traces import BLOCK_TOKENS, Request, make_trace

TORCH_THREADS = 1  # per engine; see the module docstring


# -------------------------------------------------------------------- engine

Running = tuple[Request, Any, torch.Tensor, PagedKV, torch.Tensor | None]  # ..., logits (None: to prefill)


class Engine(Scheduler):
    """The real engine: continuous batching over kvpool tensors (admission and preemption: Scheduler)."""

    def __init__(self, index: int, manager: KVCacheManager, model: TinyDecoder) -> None:
        super().__init__(index, manager, RealClock())
        self.model = model
        self.caches = manager.tensors(torch.float32, (BLOCK_TOKENS, HEADS, HEAD_DIM))
        self.running: list[Running] = []

    def _started(self, r: Request, ids: Any) -> None:
        blocks = torch.from_numpy(ids)
        self.running.append((r, ids, blocks, PagedKV(self.caches, blocks), None))

    def _running_requests(self) -> list[RunningRequest]:
        # logits None: admitted, not prefilled yet (nothing computed to lose).
        return [RunningRequest(r, ids, r.new_tokens - len(r.output),
                        0 if logits is None else len(r.prompt) + len(r.output))
                for r, ids, _, _, logits in self.running]

    def _take(self, r: Request) -> Any:
        i = next(i for i, run in enumerate(self.running) if run[0] is r)
        return self.running.pop(i)[1]

    async def serve(self, total: int) -> None:
        """Continuous batching: preempt if lending, prefill newcomers, then one decode step for everyone."""
        while len(self.finished) < total:
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
                continue
            self.act_on_lending()
            for i, (r, ids, blocks, kv, logits) in enumerate(self.running):
                if logits is None:  # prefill; after a preemption, of the prompt and what it generated
                    logits = self.model.forward(torch.tensor(r.prompt + r.output), 0, kv)
                    self.running[i] = (r, ids, blocks, kv, logits)
            still: list[Running] = []
            for r, ids, blocks, kv, logits in self.running:
                assert logits is not None
                tok = int(logits.argmax())
                if not r.output:
                    r.first_token = time.perf_counter()
                r.output.append(tok)
                self.tokens += 1
                if len(r.output) == r.new_tokens:
                    r.done = time.perf_counter()
                    self.m.free(ids)
                    self.finished.append(r)
                    continue
                still.append((r, ids, blocks, kv, None))
            if still:  # one batched decode step for every running request
                out = self.model.decode([r.output[-1] for r, *_ in still],
                                        [len(r.prompt) + len(r.output) - 1 for r, *_ in still],
                                        [kv for _, _, _, kv, _ in still])
                still = [(r, ids, blocks, kv, out[i]) for i, (r, ids, blocks, kv, _) in enumerate(still)]
            self.running = still
            self.step_ended(bool(self.running))
            await asyncio.sleep(0)  # let the other engines run


# ------------------------------------------------------------------ one mode

def announce_pool(mode: str, pool_name: str) -> None:
    """Name the run's pool on stderr, so `kvpool top` can be pointed at it (stdout stays the report's)."""
    print(f"kvpool demo: {mode} run on pool {pool_name} (watch it: kvpool top {pool_name})",
          file=sys.stderr, flush=True)



async def run_mode(mode: str, args: argparse.Namespace, trace: list[Request], model: TinyDecoder,
                   live: Any) -> dict[str, Any]:
    geometry = Geometry(LAYERS, 2, BLOCK_BYTES, args.blocks, page_bytes=PAGE_BYTES)
    pool_bytes = args.pool_blocks * COMMIT_BYTES_PER_BLOCK
    pool_name = f"demo-{mode}-{uuid.uuid4().hex[:6]}"
    pool = Pool(pool_name, capacity=pool_bytes)
    announce_pool(mode, pool_name)
    slice_bytes = pool_bytes // args.engines
    engines: list[Engine] = []
    timeline: list[dict[str, Any]] = []
    try:
        for e in range(args.engines):
            m = KVCacheManager(geometry, pool=pool, name=f"engine-{e}", reserve=(1, 2),
                               headroom_bytes=headroom_bytes(geometry, args.prompt_scale))
            if mode == "static":
                await m.set_limit(slice_bytes)
            engines.append(Engine(e, m, model))
        mine = {e: [r.fresh() for r in trace if r.engine == e]
                for e in range(args.engines)}
        t0 = time.perf_counter()
        peak = [0] * args.engines

        async def monitor() -> None:
            while True:
                now = time.perf_counter() - t0
                row: dict[str, Any] = {"t": round(now, 3)}
                for eng in engines:
                    c = eng.m.stats().committed_bytes
                    peak[eng.index] = max(peak[eng.index], c)
                    row[f"engine-{eng.index}"] = c
                    row[f"waiting-{eng.index}"] = eng.waiting  # requests queued for KV memory
                timeline.append(row)
                if live is not None:
                    live(mode, engines, now)
                await asyncio.sleep(0.1)

        mon = asyncio.create_task(monitor())
        for eng in engines:  # one process: a preemption hands its blocks to the others at once
            eng.peers = [p for p in engines if p is not eng]
        tasks = [asyncio.create_task(eng.run(mine[eng.index], t0)) for eng in engines]
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
        await stop_monitor(mon)
        return summarize(mode, args, elapsed, timeline, [
            eng.report() | {"peak_committed_bytes": max(peak[eng.index], eng.peak_committed)}
            for eng in engines
        ])
    finally:
        for eng in engines:
            await eng.m.aclose()
        Pool.remove(pool_name)



# ------------------------------------------------- one process per engine

async def run_mode_processes(mode: str, args: argparse.Namespace, live: Any) -> dict[str, Any]:
    """Each engine in its own process, joined only by the pool ledger."""
    import subprocess

    pool_bytes = args.pool_blocks * COMMIT_BYTES_PER_BLOCK
    pool_name = f"demo-{mode}-{uuid.uuid4().hex[:6]}"
    pool = Pool(pool_name, capacity=pool_bytes)
    announce_pool(mode, pool_name)
    argv = [f"--engines={args.engines}", f"--pool-blocks={args.pool_blocks}", f"--blocks={args.blocks}",
            f"--duration={args.duration}", f"--burst={args.burst}", f"--seed={args.seed}",
            f"--trace={args.trace}", f"--prompt-scale={args.prompt_scale}"]
    procs = [subprocess.Popen([sys.executable, "-m", "kvpool.demo", "--worker", mode, str(e), pool_name, *argv],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              # Their own process group: Ctrl-C at the terminal reaches only
                              # this process, which stops them (finally, below) and says so once.
                              process_group=0)
             for e in range(args.engines)]
    timeline: list[dict[str, Any]] = []
    try:
        for p in procs:
            assert p.stdout is not None
            line = await asyncio.to_thread(p.stdout.readline)
            if line.strip() != "ready":
                raise RuntimeError(f"demo worker failed to start: {line!r}")
        t0 = time.perf_counter() + 0.2  # CLOCK_MONOTONIC: one clock for every process
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(f"{t0!r}\n")
            p.stdin.flush()
        results: list[Any] = [None] * len(procs)

        async def collect(i: int, p: Any) -> None:
            results[i] = json.loads(await asyncio.to_thread(p.stdout.read))

        collectors = [asyncio.create_task(collect(i, p)) for i, p in enumerate(procs)]
        while not all(c.done() for c in collectors):
            now = time.perf_counter() - t0
            tenants = {t.name: t for t in pool.tenants()}
            row: dict[str, Any] = {"t": round(now, 3)}
            for e in range(args.engines):
                t = tenants.get(f"engine-{e}")
                row[f"engine-{e}"] = t.committed_bytes if t else 0
            timeline.append(row)
            if live is not None:
                live(mode, [(e, tenants.get(f"engine-{e}")) for e in range(args.engines)], now)
            await asyncio.sleep(0.1)
        await asyncio.gather(*collectors)
        elapsed = max(r["end"] for r in results) - t0
        _merge_waiting(timeline, t0, results)
        return summarize(mode, args, elapsed, timeline, results)
    finally:
        for p in procs:
            p.kill()
            p.wait()
            for pipe in (p.stdin, p.stdout):
                if pipe is not None:
                    pipe.close()
        Pool.remove(pool_name)


def _merge_waiting(timeline: list[dict[str, Any]], t0: float, results: list[dict[str, Any]]) -> None:
    """Add each worker's ``waiting-<e>`` to the parent's rows.

    The ledger tells the parent only the allocations parked in a manager (one
    per engine at most: the admitter's), not how many requests queue behind
    it, so each worker samples its own queue on the shared monotonic clock
    and the parent's row at time t takes each engine's latest sample at or
    before t (0 before its first)."""
    for e, res in enumerate(results):
        samples = res.get("waiting_samples", [])
        times = [at for at, _ in samples]
        for row in timeline:
            i = bisect.bisect_right(times, t0 + row["t"])
            row[f"waiting-{e}"] = int(samples[i - 1][1]) if i else 0


async def worker(mode: str, index: int, pool_name: str, args: argparse.Namespace) -> None:
    """The engine process of ``--processes``: serve this engine's share of the trace."""
    torch.set_num_threads(TORCH_THREADS)
    model = TinyDecoder(args.seed)
    trace = [r for r in make_trace(args.engines, args.duration, args.burst, args.seed, args.trace,
                                   args.prompt_scale) if r.engine == index]
    geometry = Geometry(LAYERS, 2, BLOCK_BYTES, args.blocks, page_bytes=PAGE_BYTES)
    m = KVCacheManager(geometry, pool=Pool(pool_name, create=False), name=f"engine-{index}", reserve=(1, 2),
                       headroom_bytes=headroom_bytes(geometry, args.prompt_scale))
    if mode == "static":
        await m.set_limit(args.pool_blocks * COMMIT_BYTES_PER_BLOCK // args.engines)
    eng = Engine(index, m, model)
    greedy(model, trace[0].prompt, 4, ContiguousKV())  # warm up before the clock starts
    print("ready", flush=True)
    t0 = float(await asyncio.to_thread(sys.stdin.readline))
    peak = 0
    waiting: list[tuple[float, int]] = []  # (perf_counter, requests queued for KV): the parent's plot rows

    async def monitor() -> None:
        nonlocal peak
        while True:
            peak = max(peak, m.stats().committed_bytes)
            waiting.append((time.perf_counter(), eng.waiting))
            await asyncio.sleep(0.05)

    mon = asyncio.create_task(monitor())
    await eng.run(trace, t0)  # eng.peers stays None: the others are in other processes
    end = time.perf_counter()
    mon.cancel()
    peak = max(peak, m.stats().committed_bytes, eng.peak_committed)
    await m.aclose()
    waiting.append((end, eng.waiting))
    json.dump(eng.report() | {"peak_committed_bytes": peak, "end": end, "waiting_samples": waiting}, sys.stdout)


def check_correctness(model: TinyDecoder, trace: list[Request], outputs: dict[str, list[int]],
                      sample: int, seed: int) -> list[str]:
    """Decode a sample again with a contiguous KV cache; return mismatching request ids."""
    rng = random.Random(seed)
    picks = rng.sample(trace, min(sample, len(trace)))
    bad = []
    for r in picks:
        ref = greedy(model, r.prompt, r.new_tokens, ContiguousKV())
        if outputs.get(r.rid) != ref:
            bad.append(r.rid)
    return bad

