"""Start-up admission: can this tenant ever hold one ``max_model_len`` request?

Stock vLLM refuses to start when its KV cache cannot hold one request of the
model's max seq len (``check_enough_kv_cache_memory`` in
``vllm/v1/core/kv_cache_utils.py``). With the plugin, vLLM's own check runs
against the *virtual* capacity it reserved; what the engine can really hold
is the space's ``max_blocks()``: min(limit, pool capacity) through the page
formula, less the null block. Without this check an engine whose pool is too
small accepts requests and never schedules them (issue 14: a silent 150 s
hang). The refusal reuses vLLM's wording, with kvpool's numbers.

The guarantee (ARCHITECTURE.md, "Fair share") is checked too, but only warned
about: below it the engine still runs a long request whenever its
neighbours leave memory idle, and on the default equal share it moves as
tenants join and leave, so refusing on it would refuse engines that work.
"""

from __future__ import annotations

from typing import Any

from kvpool import KVSpace
from kvpool.tracing import get_logger

__all__ = ["blocks_per_request", "blocks_per_request_in_groups", "check_one_request_fits"]


def blocks_per_request(max_model_len: int, block_size: int) -> int:
    """Blocks one ``max_model_len`` request needs in a full-attention group."""
    return -(-max_model_len // block_size)


def blocks_per_request_in_groups(vllm_config: Any, kv_cache_config: Any) -> int:
    """Blocks one ``max_model_len`` request holds at once, all KV cache
    groups together, by each group's own spec (vLLM's figure: a
    sliding-window group keeps its window, a full-attention group the whole
    length)."""
    return sum(-(-int(g.kv_cache_spec.max_memory_usage_bytes(vllm_config)) // int(g.kv_cache_spec.page_size_bytes))
               for g in kv_cache_config.kv_cache_groups)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def _blocks_within(space: KVSpace, budget_bytes: int) -> int:
    """Blocks ``budget_bytes`` of page commits can hold (the page formula's
    largest pages first, less the null block)."""
    g = space.geometry
    pages = budget_bytes // g.page_commit_bytes
    caps = sorted((len(g.block_range(p)) for p in range(g.num_pages)), reverse=True)
    return max(0, sum(caps[:pages]) - (1 if space.null_block else 0))


def check_one_request_fits(space: KVSpace, *, max_model_len: int, block_size: int, num_groups: int = 1,
                           blocks_needed: int | None = None) -> None:
    """Raise ``ValueError`` (vLLM's own start-up refusal) if ``space`` can
    never hold one ``max_model_len`` request; warn if its guarantee cannot.

    ``blocks_needed``: what one such request holds at once over all KV cache
    groups (a sliding-window group keeps only its window); default: each of
    ``num_groups`` groups holds the whole length."""
    g = space.geometry
    per_request = (blocks_per_request(max_model_len, block_size) * num_groups if blocks_needed is None
                   else blocks_needed)
    bytes_per_block = g.region_block_bytes * g.num_regions  # every layer of a block
    most = space.max_blocks()
    b = space.budget()
    who = f"kvpool tenant '{space.name}'" + (f" of pool '{space.pool.name}'" if space.pool is not None else "")
    if per_request > most:
        needed, available = per_request * bytes_per_block, most * bytes_per_block
        bounds = [f"{g.capacity - (1 if space.null_block else 0)} blocks reserved by vLLM"]
        if b.pool_capacity is not None:
            bounds.append(f"pool capacity {b.pool_capacity} bytes")
        if b.limit_bytes is not None:
            bounds.append(f"tenant limit {b.limit_bytes} bytes")
        estimated = most * block_size // num_groups
        estimated_msg = (f"Based on the available memory, the estimated maximum model length is {estimated}. "
                         if estimated > 0 else "")
        raise ValueError(
            f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"({needed} bytes = {_mib(needed)}: {per_request} blocks of {block_size} tokens) KV cache is needed, "
            f"which is larger than the available KV cache memory ({available} bytes = {_mib(available)}: "
            f"{who} can hold at most {most} blocks; {', '.join(bounds)}, "
            f"{g.page_commit_bytes}-byte page commits). {estimated_msg}"
            f"Try a larger pool, raising this tenant's limit (`kvpool limit POOL TENANT MAX`) "
            f"or decreasing `max_model_len` when initializing the engine.")
    if b.pooled and _blocks_within(space, b.guarantee_bytes) < per_request:
        get_logger(pool=space.pool.name if space.pool else None, tenant=space.name).warning(
            "vllm guarantee below one request", max_model_len=max_model_len, blocks_needed=per_request,
            bytes_needed=per_request * bytes_per_block, guarantee_bytes=b.guarantee_bytes,
            guarantee_setting=b.guarantee_setting,
            hint="a max_model_len request runs only while neighbours leave memory idle; "
                 "raise this tenant's guarantee (`kvpool limit POOL TENANT MAX --min MIN`) to always fit one")
