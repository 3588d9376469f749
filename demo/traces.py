"""Request traces of ``kvpool demo``: which engine asks for what, and when.

A trace is a list of :class:`Request`, sorted by arrival, generated from a
seed alone (same seed, same trace, on any machine). Every request is admitted
with one ``alloc`` of its prompt plus its whole generation budget, so its
size in blocks is known at arrival.

Shapes (``--trace``):

- ``bursty`` (the default, the demo's original trace): each engine bursts
  twice, at staggered times, while the others are quiet, over a background
  trickle. Sharing wins when one engine can borrow what the quiet ones hold.
- ``steady``: every engine receives requests at the same constant rate
  (a Poisson process: uniform arrival times given their count) at a load
  near its static slice, so only the random fluctuations differ. Sharing wins
  by multiplexing: a momentary peak of one engine meets a dip of another.
- ``saturated``: engine 0 is overloaded for the whole run (several slices of
  demand, all the time) while the others serve only a light trickle. The
  light engines must not pay for the saturated one: with a static split they
  never wait, so this is the shape that tests the guarantee.

Every shape gives the engines requests of the same size distribution; only
when they arrive differs, so the figures compare the sharing policy, not
the work.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass, field

BLOCK_TOKENS = 16
VOCAB = 256
PROMPT_TOKENS = (48, 160)
NEW_TOKENS = (96, 192)
SHAPES = ("bursty", "steady", "saturated")


@dataclass
class Request:
    rid: str
    engine: int
    arrival: float
    prompt_len: int
    new_tokens: int
    token_seed: int  # the prompt's token ids are drawn from it only when an engine reads them
    arrived: float = 0.0  # the engine's clock at arrival
    queued: float = 0.0  # when it last joined its engine's queue (arrival, or its latest preemption)
    admitted: float = 0.0  # its latest grant
    first_token: float = 0.0
    done: float = 0.0
    output: list[int] = field(default_factory=list)
    generated: int = 0  # tokens emitted so far (the virtual clock's count; a preemption keeps them)
    preemptions: int = 0

    @functools.cached_property
    def prompt(self) -> list[int]:
        # Drawn lazily: the virtual clock never reads token ids, and a
        # what-if of 50 000 long prompts would otherwise build 10^8 ints.
        rng = random.Random(self.token_seed)
        return [rng.randrange(VOCAB) for _ in range(self.prompt_len)]

    @property
    def blocks(self) -> int:
        return (self.prompt_len + self.new_tokens + BLOCK_TOKENS - 1) // BLOCK_TOKENS

    def fresh(self) -> Request:
        """The same request, not yet served (each mode serves its own copy)."""
        return Request(self.rid, self.engine, self.arrival, self.prompt_len, self.new_tokens, self.token_seed)


def max_request_blocks(prompt_scale: float = 1.0) -> int:
    """Blocks of the largest request a trace can hold: what one admission can ask for."""
    prompt = max(1, round(PROMPT_TOKENS[1] * prompt_scale))
    return (prompt + NEW_TOKENS[1] + BLOCK_TOKENS - 1) // BLOCK_TOKENS


# Arrival times of engine e's requests, one function per shape; each draws
# from the trace's one generator, engine by engine.

def _bursty(e: int, engines: int, duration: float, burst: int, rng: random.Random) -> list[float]:
    """Staggered bursts: engine e bursts while the others are quiet, plus a trickle."""
    period = duration / 2
    times = [rng.uniform(0, duration) for _ in range(max(1, burst // 4))]  # background trickle
    for k in range(2):
        t0 = k * period + (e + 0.5) * period / engines
        times += [t0 + rng.uniform(0, period / engines / 3) for _ in range(burst)]
    return times


def _steady(e: int, engines: int, duration: float, burst: int, rng: random.Random) -> list[float]:
    # As many requests per engine as a bursty engine gets (two bursts and the
    # trickle), spread over the whole run: the same work at a constant rate.
    return [rng.uniform(0, duration) for _ in range(2 * burst + max(1, burst // 4))]


def _saturated(e: int, engines: int, duration: float, burst: int, rng: random.Random) -> list[float]:
    # Engine 0: eight bursts' worth (four times a bursty engine's work) spread
    # over the run, more than its slice can serve; the others: the trickle only.
    n = 8 * burst if e == 0 else max(1, burst // 4)
    return [rng.uniform(0, duration) for _ in range(n)]


_ARRIVALS = {"bursty": _bursty, "steady": _steady, "saturated": _saturated}


def make_trace(engines: int, duration: float, burst: int, seed: int, shape: str = "bursty",
               prompt_scale: float = 1.0) -> list[Request]:
    """The requests of every engine, sorted by arrival.

    ``prompt_scale`` stretches prompts (not generations, so the number of
    decode steps stays the same): what-ifs on a large pool keep the same
    contention with longer contexts instead of more requests.
    """
    if shape not in _ARRIVALS:
        raise ValueError(f"unknown trace shape {shape!r}: use one of {', '.join(SHAPES)}")
    rng = random.Random(seed)
    reqs: list[Request] = []
    for e in range(engines):
        for t in sorted(_ARRIVALS[shape](e, engines, duration, burst, rng)):
            plen = max(1, round(rng.randint(*PROMPT_TOKENS) * prompt_scale))
            reqs.append(Request(f"e{e}-{len(reqs)}", e, t, plen, rng.randint(*NEW_TOKENS), rng.getrandbits(32)))
    return sorted(reqs, key=lambda r: r.arrival)


# How far :func:`shifted` moves an arrival: at most 1 ms, less than one decode
# step of the demo's engines (0.4 ms + 0.66 ms a sequence) and below the
# timing noise of a real run on a busy machine.
SHIFT_S = 1e-3


def shifted(trace: list[Request], seed: int, span_s: float = SHIFT_S) -> list[Request]:
    """The same requests, each arriving up to ``span_s`` later (a seeded uniform draw), sorted by arrival.

    The same work at the same load, met at another phase of the engines'
    steps: a static split on it against the static split on ``trace`` is the
    noise of the measurement itself (``scripts/demo_virtual_sweep.py --noise``).
    """
    if span_s < 0:
        raise ValueError(f"span_s must be >= 0, got {span_s}")
    rng = random.Random(f"shifted-{seed}")
    out = [dataclasses.replace(r.fresh(), arrival=r.arrival + rng.uniform(0, span_s)) for r in trace]
    return sorted(out, key=lambda r: r.arrival)
