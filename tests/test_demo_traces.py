"""The demo's request traces: shapes, sizes, and the seed as their only input."""

from __future__ import annotations

from collections import Counter

import pytest

from kvpool.demo.traces import BLOCK_TOKENS, NEW_TOKENS, PROMPT_TOKENS, SHAPES, make_trace


@pytest.mark.parametrize("shape", SHAPES)
def test_a_trace_is_a_function_of_its_seed(shape: str) -> None:
    def key(seed: int) -> list[tuple[str, float, list[int], int]]:
        return [(r.rid, r.arrival, r.prompt, r.new_tokens) for r in make_trace(3, 10.0, 24, seed, shape)]

    assert key(5) == key(5)
    assert key(5) != key(6)


@pytest.mark.parametrize("shape", SHAPES)
def test_requests_arrive_in_order_within_the_run_with_sizes_in_range(shape: str) -> None:
    trace = make_trace(4, 10.0, 24, 0, shape)
    assert [r.arrival for r in trace] == sorted(r.arrival for r in trace)
    assert all(0 <= r.arrival <= 10.0 for r in trace)
    assert all(PROMPT_TOKENS[0] <= len(r.prompt) == r.prompt_len <= PROMPT_TOKENS[1] for r in trace)
    assert all(NEW_TOKENS[0] <= r.new_tokens <= NEW_TOKENS[1] for r in trace)
    assert all(r.blocks == -(-(r.prompt_len + r.new_tokens) // BLOCK_TOKENS) for r in trace)


def test_steady_gives_every_engine_the_work_of_a_bursty_engine() -> None:
    bursty = Counter(r.engine for r in make_trace(3, 10.0, 24, 0, "bursty"))
    steady = Counter(r.engine for r in make_trace(3, 10.0, 24, 0, "steady"))
    assert bursty == steady == {0: 54, 1: 54, 2: 54}


def test_saturated_overloads_engine_zero_and_leaves_the_others_a_trickle() -> None:
    per_engine = Counter(r.engine for r in make_trace(3, 10.0, 24, 0, "saturated"))
    assert per_engine == {0: 8 * 24, 1: 6, 2: 6}


def test_bursty_engines_burst_one_after_another() -> None:
    engines, duration, burst = 3, 10.0, 24
    trace = make_trace(engines, duration, burst, 0, "bursty")
    period = duration / 2
    for k in range(2):
        for e in range(engines):
            # Engine e's k-th burst window; the next engine's starts after it ends.
            t0 = k * period + (e + 0.5) * period / engines
            t1 = t0 + period / engines / 3
            assert t1 < t0 + period / engines
            inside = [r for r in trace if t0 <= r.arrival <= t1]
            assert sum(r.engine == e for r in inside) >= burst


def test_prompt_scale_stretches_prompts_not_generations() -> None:
    plain, long = make_trace(2, 10.0, 8, 0), make_trace(2, 10.0, 8, 0, prompt_scale=64)
    assert [r.new_tokens for r in plain] == [r.new_tokens for r in long]
    assert [r.prompt_len * 64 for r in plain] == [r.prompt_len for r in long]


def test_an_unknown_shape_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="bursty, steady, saturated"):
        make_trace(2, 10.0, 8, 0, "spiky")
