"""SGLang's KV buffers as zero-copy views of a kvpool space (re-exported by :mod:`kvpool.adapters.sglang`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool import KVSpace

__all__ = ["token_view"]


def token_view(space: KVSpace, layer: int, buffer: int, dtype: torch.dtype, page_size: int,
               token_shape: Sequence[int]) -> torch.Tensor:
    """Layer ``layer``'s KV buffer ``buffer`` of ``space`` indexed by SGLang token slot:
    ``(num_blocks * page_size, *token_shape)``, slot ``t`` in block ``t // page_size``
    (per-layer layout; zero-copy)."""
    g = space.geometry
    if g.layout != "per_layer":
        raise ValueError("token_view needs the per_layer layout (contiguous blocks interleave layers)")
    blocks = space.view(layer, buffer, dtype, (page_size, *token_shape))
    return blocks.view(g.blocks * page_size, *token_shape)
