"""``kvpool demo --clock virtual``: the demo's engines with modeled step times.

Everything that decides *who gets memory when* is real: each engine is a
real :class:`~kvpool.KVCacheManager` (its wait queue, its in-process hand-off
of freed blocks) over a real KV space, all joined by a real shared
:class:`~kvpool.Pool` with a private name; every admission is one
``await alloc`` and every completion one ``free``. What is modeled is only
how long an engine's step takes: instead of running the attention math the
engine sleeps, on a virtual clock (:mod:`kvpool.demo.clock`), for

    prefill of n new requests of T tokens in all:   n * a_p + b_p * T
    decode step of B sequences reading K KV blocks:  a_d + b_d * B + c_d * K

with the constants of :class:`StepModel`, measured on the 2-core machine the
demo was developed on with the real engines (one torch thread, the minimum
of 15 repeats per batch shape, two runs; ``scripts/demo_step_model.py``
re-measures them). The engines follow the real ones' loop: preempt while
lending (:mod:`kvpool.demo.sched`; a preempted request's prompt and the
tokens it generated are prefilled again, at the prefill rate), prefill the
newcomers, emit one token for every running request (the newcomers' first),
free the finished, one batched decode step for the rest. Times are integer
nanoseconds (:class:`kvpool.demo.clock.NanoClock`), so equal spans compare
equal in both modes.

Compute (``--compute``): ``shared`` (the default) runs one engine step at a
time on one device, in the order the engines ask for it (FIFO), as the real
in-process demo does on its one thread and as engines time-share one GPU;
``per-engine`` gives every engine its own device (one engine per core or
per GPU), so their steps overlap and only memory is shared.

The results are exact: the same seed gives the same JSON on a quiet machine
and a busy one. The default run takes about a second a mode; 16 engines on a
million-block pool (tests/test_demo_virtual.py) some tens of seconds on the
busy 2-core development machine, most of it in the pool's page releases.

What the model says about this engine: its decode runs attention per
sequence, so a step costs 0.66 ms more for every sequence and batching saves
only the 0.4 ms a step. More memory lets an engine admit sooner (lower TTFT,
less waiting for memory) but barely raises its throughput; an engine whose
compute is saturated waits about as long with the whole pool as with a slice.

Determinism, in the pool's terms: the spaces commit and release pages inline
(no reserve thread), keep no idle pages (``reserve=(0, 0)``: an emptied page
goes back to the pool inside the ``free`` that emptied it), and after every
free or grant the engine's peers re-dispatch at once (``KVCacheManager.poll``)
instead of when the native watcher's eventfd wake-up reaches them. Those
wake-ups are muted, and before the clock moves every engine that still waits
polls once more (:func:`poll_waiting`, the loop's idle hook): a wake-up
arrives at a real time, so a grant that waited for one made the same seed
give other figures on a busy machine (steady seed 12 until 2026-12-03).

The virtual spaces hold the same blocks and pages as the real demo's
(8 blocks a page) in 1/64 of the bytes (one 4 KiB region page instead of
four 64 KiB ones: no KV data is stored); every byte figure is reported in the
real engines' bytes so the two clocks' tables compare directly. Pools of
more than 32 768 blocks get pages of 16, 32, 64... blocks, the fewest that
keep them at 4 096 pages (a million blocks: 256 a page, as a 2 MiB page of
8 KiB blocks). Why: every page released is a release in the pool's ledger
that wakes every tenant's native watcher thread; on the busy development
machine an alloc and free of 27 pages took 1.7 ms with one tenant in the pool
and 7.2 ms with 16. At 8 blocks a page a million-block what-if spends its
minutes there.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvpool import Geometry, KVCacheManager, Pool

from .clock import NanoClock, VirtualClockLoop
from .common import COMMIT_BYTES_PER_BLOCK, headroom_bytes, stop_monitor, summarize
from .sched import Running, Scheduler
from .traces import BLOCK_TOKENS, Request, make_trace, shifted

BLOCKS_PER_PAGE = 8  # as the real demo: 64 KiB pages of 8 KiB blocks
VIRTUAL_BLOCK_BYTES = 512  # 8 to the base page: the smallest pages the CPU backend takes
MAX_PAGES = 4096  # see the module docstring: page releases are what a big what-if pays for


def blocks_per_page(pool_blocks: int) -> int:
    """The real demo's 8, doubled until the pool has at most MAX_PAGES pages."""
    bpp = BLOCKS_PER_PAGE
    while pool_blocks > MAX_PAGES * bpp:
        bpp *= 2
    return bpp


@dataclass(frozen=True)
class StepModel:
    """Seconds an engine step takes, from its batch (see the module docstring).

    Measured 2026-12-01 on the development machine (2 cores, shared), one
    torch thread: prefill 0.47-0.69 ms + 39-47 us a token over prompts of
    16-192 tokens; decode 0.08-0.64 ms + 0.65-0.70 ms a sequence + 11-15 us
    a KV block read, over 1-24 sequences of 64-320 tokens. Rounded means.
    """

    prefill_s: float = 0.6e-3        # a_p: per request prefilled (one forward call each)
    prefill_token_s: float = 43e-6   # b_p: per prompt token
    decode_s: float = 0.4e-3         # a_d: per decode step
    decode_seq_s: float = 0.66e-3    # b_d: per sequence in the step (attention runs per sequence)
    kv_block_s: float = 12e-6        # c_d: per KV block the step's attention reads

    def prefill(self, requests: int, tokens: int) -> float:
        return requests * self.prefill_s + tokens * self.prefill_token_s

    def decode(self, sequences: int, kv_blocks: int) -> float:
        return self.decode_s + sequences * self.decode_seq_s + kv_blocks * self.kv_block_s


class VirtualEngine(Scheduler):
    """One engine's scheduler loop, stepping on the virtual clock."""

    def __init__(self, index: int, manager: KVCacheManager, steps: StepModel, device: asyncio.Lock) -> None:
        self.nano = NanoClock()  # exact spans: see VirtualClockLoop
        super().__init__(index, manager, self.nano)
        self.steps = steps
        self.device = device  # held for a whole step; shared by every engine when compute is shared
        self.incoming: list[tuple[Request, Any]] = []  # admitted, joining at the next step
        # The running batch, as parallel arrays (a step touches them all at once).
        self.batch: list[tuple[Request, Any]] = []
        self.context = np.empty(0, dtype=np.int64)  # tokens whose K/V the next decode reads
        self.left = np.empty(0, dtype=np.int64)     # tokens still to generate

    @property
    def running(self) -> list[tuple[Request, Any]]:  # what the live table counts
        return self.batch + self.incoming

    def _started(self, r: Request, ids: Any) -> None:
        self.incoming.append((r, ids))

    def _after_grant(self) -> None:
        # A grant can change what the others may take without freeing
        # anything (a tenant that reached its guarantee stops making the
        # others lend), so they re-check too.
        self.poll_peers()

    def _free(self, ids: Any) -> None:
        self.m.free(ids)  # own waiters first: the manager's in-process hand-off
        self.poll_peers()

    def _running_requests(self) -> list[Running]:
        # Admitted, not prefilled yet: nothing computed, nothing to recompute.
        out = [Running(r, ids, r.new_tokens - r.generated, 0) for r, ids in self.incoming]
        out += [Running(r, ids, int(left), int(ctx))
                for (r, ids), left, ctx in zip(self.batch, self.left, self.context)]
        return out

    def _take(self, r: Request) -> Any:
        for i, (q, ids) in enumerate(self.incoming):
            if q is r:
                del self.incoming[i]
                return ids
        i = next(i for i, (q, _) in enumerate(self.batch) if q is r)
        _, ids = self.batch.pop(i)
        r.generated = r.new_tokens - int(self.left[i])
        self.context, self.left = np.delete(self.context, i), np.delete(self.left, i)
        return ids

    async def serve(self, total: int) -> None:
        while len(self.finished) < total:
            if not self.batch and not self.incoming:
                self.wake.clear()
                await self.wake.wait()
                continue
            async with self.device:  # asyncio.Lock is FIFO: the engines take turns, deterministically
                await self._step()
                self.step_ended(bool(self.batch or self.incoming))

    async def _step(self) -> None:
        """One iteration of the real engine's loop: preempt if lending, prefill, emit, free, decode."""
        self.act_on_lending()
        new, self.incoming = self.incoming, []
        if new:
            # A preempted request is prefilled again with what it generated
            # (counted as recomputed when it was preempted).
            await self.nano.sleep(self.steps.prefill(len(new), sum(r.prompt_len + r.generated for r, _ in new)))
            self.batch += new
            self.context = np.concatenate([self.context, [r.prompt_len + r.generated for r, _ in new]])
            self.left = np.concatenate([self.left, [r.new_tokens - r.generated for r, _ in new]])
        now = self.nano.now()
        for r, _ in new:
            if not r.generated:
                r.first_token = now
        self.tokens += len(self.batch)  # one token for every running request
        self.left -= 1
        done = self.left == 0
        if done.any():
            keep = ~done
            for (r, ids), d in zip(self.batch, done):
                if d:
                    r.done = now
                    r.generated = r.new_tokens
                    self.finished.append(r)
                    self._free(ids)
            self.batch = [b for b, k in zip(self.batch, keep) if k]
            self.context, self.left = self.context[keep], self.left[keep]
        if self.batch:
            # The decode step writes one token per sequence and reads all of its K/V.
            self.context += 1
            kv_blocks = int(((self.context + BLOCK_TOKENS - 1) // BLOCK_TOKENS).sum())
            await self.nano.sleep(self.steps.decode(len(self.batch), kv_blocks))


async def run_mode_virtual(mode: str, args: argparse.Namespace, trace: list[Request],
                           live: Any) -> dict[str, Any]:
    """One mode of the demo on the virtual clock; the same summary as a real run.

    ``mode``: ``elastic``, ``static``, or ``alone`` (a reference: each engine
    with a pool of the whole capacity to itself).
    """
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualClockLoop), "run it with kvpool.demo.clock.run_virtual"
    pool_blocks: int = args.pool_blocks
    bpp = blocks_per_page(pool_blocks)
    num_blocks = max(args.blocks, pool_blocks + bpp)  # an engine may grow to the whole pool
    geometry = Geometry(1, 1, VIRTUAL_BLOCK_BYTES, num_blocks, page_bytes=bpp * VIRTUAL_BLOCK_BYTES)
    to_real = COMMIT_BYTES_PER_BLOCK // VIRTUAL_BLOCK_BYTES  # bytes figures in the real engines' geometry
    pool_bytes = pool_blocks * VIRTUAL_BLOCK_BYTES
    pool_name = f"demo-virtual-{mode}-{uuid.uuid4().hex[:6]}"
    # "alone" (a reference, not a mode of the demo): every engine has a pool
    # of the whole capacity to itself, the most memory any sharing policy
    # could ever give it (scripts/demo_virtual_sweep.py --reference).
    pool_names = [f"{pool_name}-{e}" for e in range(args.engines)] if mode == "alone" else [pool_name] * args.engines
    for name in dict.fromkeys(pool_names):
        Pool(name, capacity=pool_bytes)
    steps = StepModel()
    shared = asyncio.Lock()
    engines: list[VirtualEngine] = []
    timeline: list[dict[str, Any]] = []
    unhook: Callable[[], None] | None = None
    try:
        for e in range(args.engines):
            # The static limit at construction: set_limit waits in a thread,
            # which a virtual clock would jump past.
            limit = pool_bytes // args.engines if mode == "static" else None
            m = KVCacheManager(geometry, pool=pool_names[e], name=f"engine-{e}",
                               reserve=(0, 0), reserve_thread=False, limit_bytes=limit,
                               headroom_bytes=headroom_bytes(geometry, args.prompt_scale))
            engines.append(VirtualEngine(e, m, steps, shared if args.compute == "shared" else asyncio.Lock()))
        for eng in engines:  # the next engines first, so no engine is always polled last
            eng.peers = engines[eng.index + 1:] + engines[: eng.index]
            loop.mute(eng.m.space.wakeup_fd)  # its wake-ups come at real times: see kvpool.demo.clock
        unhook = loop.on_idle(lambda: poll_waiting(engines))
        mine = {e: [r.fresh() for r in trace if r.engine == e] for e in range(args.engines)}
        t0 = loop.time()

        async def monitor() -> None:
            while True:
                now = loop.time() - t0
                row: dict[str, Any] = {"t": round(now, 3)}
                for eng in engines:
                    row[f"engine-{eng.index}"] = eng.m.stats().committed_bytes * to_real
                    row[f"waiting-{eng.index}"] = eng.waiting  # requests queued for KV memory
                timeline.append(row)
                if live is not None:
                    live(mode, engines, now)
                await asyncio.sleep(args.duration / 100)

        mon = asyncio.create_task(monitor())
        t0_ns = NanoClock().now()
        tasks = [asyncio.create_task(eng.run(mine[eng.index], t0_ns)) for eng in engines]
        # A run that cannot finish (an alloc no free will satisfy) ends here
        # instead of advancing the clock forever behind the monitor.
        horizon = 1000 * args.duration
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), horizon)
        except TimeoutError:
            stuck = {eng.index: eng.waiting for eng in engines if eng.waiting}
            raise RuntimeError(f"virtual {mode} run unfinished after {horizon:.0f} virtual s "
                               f"(engines waiting for memory: {stuck})") from None
        elapsed = loop.time() - t0
        await stop_monitor(mon)
        return summarize(mode, args, elapsed, timeline, [
            eng.report() | {"peak_committed_bytes": eng.peak_committed * to_real,
                            "reclaimed_by_completion_bytes": eng.reclaimed.get("completion", 0) * to_real,
                            "reclaimed_by_preemption_bytes": eng.reclaimed.get("preemption", 0) * to_real}
            for eng in engines
        ])
    finally:
        if unhook is not None:
            unhook()
        for eng in engines:
            loop.unmute(eng.m.space.wakeup_fd)
            await eng.m.aclose()
        for name in dict.fromkeys(pool_names):
            Pool.remove(name)


def poll_waiting(engines: list[VirtualEngine]) -> bool:
    """The virtual clock's idle hook: what the eventfd wake-ups would make the
    engines do, in a fixed order. True if it granted (or failed) a waiter."""
    acted = False
    for eng in engines:
        if (before := eng.m.waiting):
            eng.m.poll()
            acted = acted or eng.m.waiting != before
    return acted


async def compare(args: argparse.Namespace,
                  modes: tuple[str, ...] = ("elastic", "static")) -> dict[str, dict[str, Any]]:
    """``modes`` of ``args`` (see :func:`kvpool.demo.cli.options`) on the virtual clock, one trace, no output;
    ``alone`` is the reference of :func:`run_mode_virtual`, and ``shifted`` another: the static split
    on the same requests each arriving up to 1 ms later (:func:`kvpool.demo.traces.shifted`), whose
    figures against static's are the noise of the measurement itself.

    Run it with :func:`kvpool.demo.clock.run_virtual`.
    """
    trace = make_trace(args.engines, args.duration, args.burst, args.seed, args.trace, args.prompt_scale)
    out = {}
    for mode in modes:
        if mode == "shifted":  # the static split on the same requests, each up to 1 ms later
            out[mode] = await run_mode_virtual("static", args, shifted(trace, args.seed), None)
        else:
            out[mode] = await run_mode_virtual(mode, args, trace, None)
    return out


def step_model() -> dict[str, float]:
    """The model's constants, for the JSON output."""
    return asdict(StepModel())
