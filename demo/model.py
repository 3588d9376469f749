"""The model of ``kvpool demo``'s engines: a tiny decoder whose K/V live in kvpool blocks.

Random weights, real multi-head attention; attention reads keys and values
through a request's block table (:class:`PagedKV`), and :class:`ContiguousKV`
is the plain reference the demo's correctness check decodes against.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .traces import BLOCK_TOKENS, VOCAB

HIDDEN, LAYERS, HEADS = 128, 2, 4
HEAD_DIM = HIDDEN // HEADS
BLOCK_BYTES = BLOCK_TOKENS * HEADS * HEAD_DIM * 4  # float32 keys (or values) of one block, one layer


class TinyDecoder:
    """A random-weight decoder; attention reads K/V through a block table."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

        self.embed = torch.randn(VOCAB, HIDDEN, generator=g)
        pos = torch.arange(4096).unsqueeze(1)
        freq = torch.exp(torch.arange(0, HIDDEN, 2) * (-math.log(10000.0) / HIDDEN))
        self.pos = torch.zeros(4096, HIDDEN)
        self.pos[:, 0::2], self.pos[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
        self.layers = [
            {"qkv": w(HIDDEN, 3 * HIDDEN), "o": w(HIDDEN, HIDDEN), "up": w(HIDDEN, 4 * HIDDEN),
             "down": w(4 * HIDDEN, HIDDEN)}
            for _ in range(LAYERS)
        ]
        self.head = w(HIDDEN, VOCAB)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, x.shape[-1:])

    def forward(self, tokens: torch.Tensor, start: int, kv: Any) -> torch.Tensor:
        """Run ``tokens`` (positions start..start+T-1); ``kv`` stores and returns K/V per layer."""
        x = self.embed[tokens] + self.pos[start : start + len(tokens)]
        T = len(tokens)
        for li, layer in enumerate(self.layers):
            h = self._norm(x)
            q, k, v = torch.split(h @ layer["qkv"], HIDDEN, dim=-1)
            q, k, v = (t.view(T, HEADS, HEAD_DIM) for t in (q, k, v))
            keys, values = kv.write_and_read(li, start, k, v)  # (start+T, HEADS, HEAD_DIM)
            att = torch.einsum("thd,shd->hts", q, keys) / math.sqrt(HEAD_DIM)
            causal = torch.arange(start + T).unsqueeze(0) > (torch.arange(T) + start).unsqueeze(1)
            att = att.masked_fill(causal, float("-inf")).softmax(-1)
            x = x + torch.einsum("hts,shd->thd", att, values).reshape(T, HIDDEN) @ layer["o"]
            x = x + torch.relu(self._norm(x) @ layer["up"]) @ layer["down"]
        return self._norm(x[-1]) @ self.head  # logits of the last position

    def decode(self, tokens: list[int], positions: list[int], kvs: list[Any]) -> torch.Tensor:
        """One decode step for a batch: linear layers batched, attention per sequence."""
        B = len(tokens)
        x = self.embed[torch.tensor(tokens)] + self.pos[torch.tensor(positions)]
        for li, layer in enumerate(self.layers):
            q, k, v = torch.split(self._norm(x) @ layer["qkv"], HIDDEN, dim=-1)
            q, k, v = (t.view(B, HEADS, HEAD_DIM) for t in (q, k, v))
            outs = []
            for b in range(B):
                keys, values = kvs[b].write_and_read(li, positions[b], k[b : b + 1], v[b : b + 1])
                att = (torch.einsum("hd,shd->hs", q[b], keys) / math.sqrt(HEAD_DIM)).softmax(-1)
                outs.append(torch.einsum("hs,shd->hd", att, values).reshape(HIDDEN))
            x = x + torch.stack(outs) @ layer["o"]
            x = x + torch.relu(self._norm(x) @ layer["up"]) @ layer["down"]
        return self._norm(x) @ self.head  # (B, VOCAB)


class PagedKV:
    """K/V of one request inside kvpool tensors: block table -> (block, offset) slots."""

    def __init__(self, caches: list[list[torch.Tensor]], blocks: torch.Tensor) -> None:
        self.caches = caches  # [layer][0=K, 1=V] -> (num_blocks, BLOCK_TOKENS, HEADS, HEAD_DIM)
        self.blocks = blocks

    def write_and_read(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pos = torch.arange(start, start + len(k))
        blk, off = self.blocks[pos // BLOCK_TOKENS], pos % BLOCK_TOKENS
        kc, vc = self.caches[layer]
        kc[blk, off] = k
        vc[blk, off] = v
        n = start + len(k)
        used = self.blocks[: (n + BLOCK_TOKENS - 1) // BLOCK_TOKENS]
        keys = kc[used].reshape(-1, HEADS, HEAD_DIM)[:n]
        values = vc[used].reshape(-1, HEADS, HEAD_DIM)[:n]
        return keys, values


class ContiguousKV:
    """The reference: a plain growing tensor per layer (what the check compares against)."""

    def __init__(self) -> None:
        self.k: list[torch.Tensor] = [torch.empty(0, HEADS, HEAD_DIM) for _ in range(LAYERS)]
        self.v: list[torch.Tensor] = [torch.empty(0, HEADS, HEAD_DIM) for _ in range(LAYERS)]

    def write_and_read(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.k[layer] = torch.cat([self.k[layer][:start], k])
        self.v[layer] = torch.cat([self.v[layer][:start], v])
        return self.k[layer], self.v[layer]


def greedy(model: TinyDecoder, prompt: list[int], new: int, kv: Any) -> list[int]:
    out: list[int] = []
    logits = model.forward(torch.tensor(prompt), 0, kv)
    for i in range(new):
        tok = int(logits.argmax())
        out.append(tok)
        if i + 1 < new:
            logits = model.forward(torch.tensor([tok]), len(prompt) + i, kv)
    return out
