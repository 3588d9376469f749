"""Measure the ``kvpool demo`` engine's step times and fit the virtual clock's model.

``kvpool demo --clock virtual`` models an engine step's duration from its
batch instead of running it (demo/virtual.py, kvpool.demo.virtual). This script runs the
real engine's two kinds of step, one torch thread as the demo does, over a
grid of batch shapes, and fits by least squares:

    prefill of one request of T prompt tokens:  a_p + b_p * T
    decode of B sequences reading K KV blocks:  a_d + b_d * B + c_d * K

(A prefill's KV blocks grow with T, so a blocks term would be collinear with T.)

Each point is the minimum of several repeats (the machine is shared: the
minimum is the run least disturbed by others). Prints the constants and
the fit's worst relative error; paste them into kvpool.demo.virtual.StepModel.

    python scripts/demo_step_model.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvpool import Geometry, KVSpace
from kvpool.demo.common import PAGE_BYTES
from kvpool.demo.model import BLOCK_BYTES, HEAD_DIM, HEADS, LAYERS, PagedKV, TinyDecoder
from kvpool.demo.traces import BLOCK_TOKENS, VOCAB


def blocks_of(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = TinyDecoder(0)
    space = KVSpace(Geometry(LAYERS, 2, BLOCK_BYTES, 4096, page_bytes=PAGE_BYTES), pool=None)
    caches = space.tensors(torch.float32, (BLOCK_TOKENS, HEADS, HEAD_DIM))
    rng = np.random.default_rng(0)

    def best(fn: object, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()  # type: ignore[operator]
            times.append(time.perf_counter() - t)
        return min(times)

    prefill_rows, prefill_t = [], []
    for T in (16, 48, 80, 112, 136, 160, 192):  # the demo's prompts are 48-160 tokens
        ids = space.alloc(blocks_of(T))
        kv = PagedKV(caches, torch.from_numpy(ids))
        prompt = torch.from_numpy(rng.integers(0, VOCAB, T))
        model.forward(prompt, 0, kv)  # warm up this shape
        prefill_rows.append([1.0, T])
        prefill_t.append(best(lambda: model.forward(prompt, 0, kv), args.repeats))
        space.free(ids)

    decode_rows, decode_t = [], []
    for B in (1, 2, 4, 8, 16, 24):
        for ctx in (64, 160, 320):
            held = [space.alloc(blocks_of(ctx + 1)) for _ in range(B)]
            kvs = [PagedKV(caches, torch.from_numpy(ids)) for ids in held]
            toks = [int(x) for x in rng.integers(0, VOCAB, B)]
            pos = [ctx] * B
            model.decode(toks, pos, kvs)
            decode_rows.append([1.0, B, B * blocks_of(ctx + 1)])
            decode_t.append(best(lambda: model.decode(toks, pos, kvs), args.repeats))
            for ids in held:
                space.free(ids)
    space.close()

    print("prefill T -> ms:", [(int(r[1]), round(t * 1e3, 2)) for r, t in zip(prefill_rows, prefill_t)])
    for name, rows, ts, labels in (("prefill", prefill_rows, prefill_t, ("a_p", "b_p")),
                                   ("decode", decode_rows, decode_t, ("a_d", "b_d", "c_d"))):
        X, y = np.array(rows), np.array(ts)
        coef = np.linalg.lstsq(X, y, rcond=None)[0]
        err = np.max(np.abs(X @ coef - y) / y)
        print(f"{name}: " + ", ".join(f"{k} = {v * 1e6:.2f} us" for k, v in zip(labels, coef))
              + f"  (worst relative error {err:.1%}, {len(y)} points, min {y.min() * 1e3:.2f} ms,"
              f" max {y.max() * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
