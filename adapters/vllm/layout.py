"""How vLLM's KV cache tensors lie in a kvpool space (vLLM 0.32).

vLLM describes its KV cache as one backing allocation of ``size`` bytes and
a list of ``KVCacheTensor`` placements in it: layer ``layers[l]``'s page for
block ``b`` starts at ``offset + l * layer_stride + b * block_stride``. A
model with several KV cache groups (a sliding-window + full-attention hybrid
such as Gemma 3, under vLLM's hybrid allocator) has one placement per group
(per spec within a group), all of the same backing allocation: the groups
*overlay* each other, which is sound because one block pool serves every
group and a block id belongs to one group at a time. MLA has one latent
buffer per layer: one group, placed like any other.

kvpool maps the backing allocation onto a space whose block ``b`` covers
every byte any placement uses for block ``b``, so handing out block ``b``
(to whichever group) commits exactly the memory vLLM will touch::

    layer-outermost (vLLM's default, LBHNC), N blocks of page p:
      vLLM   [ slot 0: b0 b1 ... bN-1 ][ slot 1: b0 ... ] ...   slot stride = N*p
      kvpool [ region 0: page | page |..][ region 1: ... ]       one region per slot,
                                                                 block_bytes = p
      (a slot holds one layer of each group: group g's layer l sits in slot
      offset / (N*p) + l; a hybrid of single-layer groups has one slot)
    block-outermost:
      vLLM   [ b0: l0 l1 .. ][ b1: l0 l1 .. ] ...                block_stride = bytes per block
      kvpool [ region 0: page | page | ... ]                      block_bytes = bytes per block

The views handed to vLLM's attention are vLLM's own
(``create_kv_cache_views``), over the space's memory, with kvpool's region
stride in place of vLLM's slot stride (a region is padded to whole pages).

A tensor- or pipeline-parallel engine has one ``KVCacheConfig`` per rank
(the same block count; per-rank shards of the heads, or each stage's layers).
Its space holds every rank's regions back to back (:class:`EngineLayout`):
block ``b`` of the space covers block ``b`` of every rank, so a page is
committed on every rank or on none and the pool's books count them all;
rank ``r``'s worker views only its own regions.

Supported: attention specs (full, sliding window, chunked local, MLA) in any
number of groups. Refused, naming the spec: layers without per-layer views
(Mamba / linear-attention state, HiSparse pools), host-resident tensors and
mixed placements.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from kvpool import Geometry

__all__ = ["EngineLayout", "Placement", "SpaceLayout", "engine_layout", "space_layout", "view_tensor"]

_DEFAULT_PAGE_BYTES = 2 << 20


@dataclasses.dataclass(frozen=True)
class Placement:
    """One of vLLM's ``KVCacheTensor``: its group and first region in the space."""

    tensor: Any        # vllm.v1.kv_cache_interface.KVCacheTensor
    group: int         # index into kv_cache_config.kv_cache_groups
    spec: Any          # the per-layer KVCacheSpec of its layers
    first_region: int  # layer-outermost: region of layers[0]; block-outermost: 0


@dataclasses.dataclass(frozen=True)
class SpaceLayout:
    """The kvpool geometry for one ``KVCacheConfig`` and where each of its
    tensors lies in it."""

    geometry: Geometry
    layer_outermost: bool
    placements: tuple[Placement, ...]

    @property
    def num_groups(self) -> int:
        return len({p.group for p in self.placements})


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """One space for every rank of an engine: rank ``r``'s regions start at
    ``first_regions[r]``, each rank laid out as ``ranks[r]``."""

    geometry: Geometry
    ranks: tuple[SpaceLayout, ...]
    first_regions: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return self.ranks[0].num_groups


def _refuse(what: str) -> NotImplementedError:
    return NotImplementedError(f"kvpool's vLLM plugin does not support {what} (unset KVPOOL_VLLM to run it "
                               f"without kvpool)")


def _group_of(kv_cache_config: Any, layer: str) -> tuple[int, Any]:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        if layer in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[layer]
            return i, spec
    raise _refuse(f"a KV cache tensor whose layer {layer!r} is in no KV cache group")


def _check_spec(spec: Any, layers: list[str]) -> None:
    from vllm.v1.kv_cache_interface import AttentionSpec

    if not isinstance(spec, AttentionSpec) or not spec.has_layer_views:
        raise _refuse(f"{type(spec).__name__} layers ({', '.join(layers[:3])}{', ...' if len(layers) > 3 else ''}): "
                      f"only attention KV caches (full, sliding window, chunked local, MLA) are paged by kvpool")


def space_layout(kv_cache_config: Any, page_bytes: int | None = None) -> SpaceLayout:
    """The geometry whose block ``b`` covers every byte vLLM's placements use
    for block ``b``; refuses a layout kvpool cannot page."""
    tensors = list(kv_cache_config.kv_cache_tensors)
    if not tensors:
        raise _refuse("a model without KV cache tensors (attention-free)")
    n = int(kv_cache_config.num_blocks)
    if page_bytes is None:
        page_bytes = int(os.environ.get("KVPOOL_VLLM_PAGE_BYTES", str(_DEFAULT_PAGE_BYTES)))
    sizes = {int(t.size) for t in tensors}
    strides = {int(t.block_stride) for t in tensors}
    if len(sizes) != 1 or len(strides) != 1:
        raise _refuse(f"KV cache tensors of different sizes {sorted(sizes)} or block strides {sorted(strides)}")
    size, p = sizes.pop(), strides.pop()
    placed: list[tuple[Any, int, Any]] = []
    for t in tensors:
        if getattr(t, "host_resident", False):
            raise _refuse(f"host-resident KV cache tensors ({t.layers[0]})")
        group, spec = _group_of(kv_cache_config, t.layers[0])
        _check_spec(spec, list(t.layers))
        placed.append((t, group, spec))

    def layer_outer(t: Any) -> bool:
        return len(t.layers) == 1 and t.offset % (n * p) == 0 or int(t.layer_stride) == n * p

    if all(layer_outer(t) for t in tensors) and size % (n * p) == 0:
        regions = size // (n * p)
        out = []
        for t, group, spec in placed:
            first = int(t.offset) // (n * p)
            if int(t.offset) % (n * p) or first + len(t.layers) > regions:
                raise _refuse(f"a KV cache tensor at offset {t.offset} outside whole layer slots of {n * p} bytes")
            out.append(Placement(t, group, spec, first))
        return SpaceLayout(Geometry(regions, 1, p, n, page_bytes=page_bytes), True, tuple(out))
    if size == n * p and all(int(t.offset) + len(t.layers) * int(t.layer_stride) <= p for t in tensors):
        return SpaceLayout(Geometry(1, 1, p, n, page_bytes=page_bytes), False,
                           tuple(Placement(t, group, spec, 0) for t, group, spec in placed))
    t = tensors[0]
    raise _refuse(f"this KV layout (size {size}, {n} blocks, layer stride {t.layer_stride}, block stride {p}, "
                  f"offset {t.offset})")


def view_tensor(layout: SpaceLayout, placement: Placement, raw_bytes: int) -> Any:
    """The placement as it lies in the space's memory of ``raw_bytes``."""
    g, t = layout.geometry, placement.tensor
    if not layout.layer_outermost:
        return dataclasses.replace(t, size=raw_bytes)
    return dataclasses.replace(t, size=raw_bytes, offset=placement.first_region * g.region_bytes,
                               layer_stride=g.region_bytes)



def engine_layout(kv_cache_configs: Any, page_bytes: int | None = None) -> EngineLayout:
    """The space of an engine whose ranks have these ``KVCacheConfig`` (one
    per rank, in rank order): every rank's regions back to back. Ranks must
    page alike (same blocks, block bytes per region, page size and layout
    order), as tensor-parallel shards and the stages of a uniform model do."""
    ranks = tuple(space_layout(cfg, page_bytes) for cfg in kv_cache_configs)
    if not ranks:
        raise _refuse("an engine without KV cache configs")
    first = ranks[0]
    for r, lay in enumerate(ranks):
        a, b = first.geometry, lay.geometry
        if (a.num_blocks, a.block_bytes, a.page_bytes, first.layer_outermost) != \
                (b.num_blocks, b.block_bytes, b.page_bytes, lay.layer_outermost):
            raise _refuse(f"ranks that page differently (rank 0: {a.num_blocks} blocks of {a.block_bytes} bytes per "
                          f"region; rank {r}: {b.num_blocks} blocks of {b.block_bytes} bytes)")
    starts, total = [], 0
    for lay in ranks:
        starts.append(total)
        total += lay.geometry.num_regions
    g = first.geometry
    return EngineLayout(Geometry(total, 1, g.block_bytes, g.num_blocks, page_bytes=g.page_bytes), ranks,
                        tuple(starts))
