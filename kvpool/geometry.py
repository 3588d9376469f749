"""KV-space geometry: one formula for pages and blocks (ARCHITECTURE.md, "Geometry").

A space has ``R`` regions (``num_layers * num_kv_buffers`` for the per-layer
layout, one for the contiguous layout). Page ``p`` is ``page_bytes`` at the
same offset of every region; committing it costs ``R * page_bytes``::

    region r:  |<----- page 0 ----->|<----- page 1 ----->|
    blocks:    | b0  | b1  |  b2 (straddles: never used) | b3 ...

Page ``p`` holds blocks ``[ceil(p*P/B), floor((p+1)*P/B))`` clipped to
``[0, num_blocks)``. The ranges come from the native core, so Python figures
and the allocator can never disagree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np

from . import _core
from ._sizes import format_size
from ._validate import integer
from .errors import GeometryError

__all__ = ["MAX_VIRTUAL_BYTES", "MiB", "Geometry"]

MiB = 1 << 20
Layout = Literal["per_layer", "contiguous"]

# The most virtual memory one space may reserve: user space on x86-64 and
# aarch64 (4-level page tables) is 2**47 bytes, and CUDA's unified address
# space is no larger. Every product Geometry computes (regions x region
# bytes, pages x page bytes, blocks x block bytes) is bounded by it in Python
# ints before any reaches the native core's int64: 2**43 + 1 regions of
# 2 MiB wrapped there to a 2 MiB memory file that the first commit then grew
# until the OOM killer came (issue 10, D8).
MAX_VIRTUAL_BYTES = 1 << 47


def _check_int(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise GeometryError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise GeometryError(f"{name} must be positive, got {value}")


def _check_virtual(what: str, size: int, fix: str) -> None:
    if size > MAX_VIRTUAL_BYTES:
        raise GeometryError(
            f"{what} = {size} bytes exceeds the {MAX_VIRTUAL_BYTES} bytes (2**47, 128 TiB) of virtual "
            f"address space a KV space can reserve; {fix}"
        )


@dataclass(frozen=True)
class Geometry:
    """Shape of one KV space.

    Args:
        num_layers: attention layers sharing the space.
        num_kv_buffers: buffers per layer (2 for K and V, 1 for MLA).
        block_bytes: bytes of one block in one buffer of one layer.
        num_blocks: blocks the engine addresses; ``None`` derives it from
            ``memory_bytes``.
        page_bytes: commit granularity per region (default 2 MiB).
        layout: ``"per_layer"`` (one region per layer and buffer) or
            ``"contiguous"`` (all layers of a block adjacent, one region).
        memory_bytes: physical budget used when ``num_blocks`` is ``None``.
        granularity: the backend's smallest page step (CPU: the base page).
    """

    num_layers: int
    num_kv_buffers: int
    block_bytes: int
    num_blocks: int | None
    page_bytes: int = 2 * MiB
    layout: Layout = "per_layer"
    memory_bytes: int | None = field(default=None, compare=False)
    granularity: int = field(default_factory=lambda: int(_core.native.cpu_granularity()), compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_buffers", "block_bytes", "page_bytes", "granularity"):
            _check_int(name, getattr(self, name))
        _check_int("num_blocks", self.num_blocks, allow_none=True)
        _check_int("memory_bytes", self.memory_bytes, allow_none=True)
        if self.layout not in ("per_layer", "contiguous"):
            raise GeometryError(f"layout must be 'per_layer' or 'contiguous', got {self.layout!r}")
        for name in ("page_bytes", "block_bytes", "granularity"):
            _check_virtual(name, getattr(self, name), f"use a smaller {name}")
        self.check_granularity(self.granularity)
        g, P, B = self.granularity, self.page_bytes, self.region_block_bytes
        if self.layout == "contiguous":
            _check_virtual(
                "a contiguous block (block_bytes x num_layers x num_kv_buffers)", B,
                "use fewer layers or smaller blocks, or the per_layer layout",
            )
        if B > P:
            fix = math.ceil(B / g) * g
            what = "block_bytes" if self.layout == "per_layer" else (
                f"a contiguous block (block_bytes {self.block_bytes} x {self.num_layers} layers "
                f"x {self.num_kv_buffers} buffers)"
            )
            raise GeometryError(
                f"{what} = {B} is larger than page_bytes ({P}); the smallest page size that fits "
                f"is page_bytes={fix} ({format_size(fix)})"
            )
        if self.num_blocks is None:
            if self.memory_bytes is None:
                raise GeometryError("num_blocks=None needs memory_bytes to derive the capacity from")
            pages = self.memory_bytes // self.page_commit_bytes
            if pages == 0:
                raise GeometryError(
                    f"memory_bytes ({self.memory_bytes}) is less than one page commit "
                    f"({self.page_commit_bytes} = {self.num_regions} regions x {P}); "
                    f"use memory_bytes >= {self.page_commit_bytes}"
                )
            _check_virtual(f"memory_bytes ({self.memory_bytes}) in whole page commits", pages * self.page_commit_bytes,
                           "use a smaller memory_bytes")
            object.__setattr__(self, "num_blocks", (pages * P) // B)
        # The native formula's products, in Python ints (no wrap-around), before
        # page_ranges is asked: pages = ceil(num_blocks x B / P).
        _check_virtual(f"num_blocks ({self.blocks}) x block bytes ({B})", self.blocks * B,
                       "use fewer or smaller blocks")
        pages = -(-self.blocks * B // P)
        _check_virtual(f"{pages} pages x page_bytes ({P}) per region", pages * P, "use fewer or smaller blocks")
        R = self.num_regions
        regions = (f"num_regions ({R} = num_layers {self.num_layers} x num_kv_buffers {self.num_kv_buffers})"
                   if self.layout == "per_layer" else "one contiguous region")
        _check_virtual(
            f"{regions} x region bytes ({pages} pages x {P})", R * pages * P,
            "use fewer layers, fewer or smaller blocks, or split the model over several spaces",
        )
        if self.capacity == 0:
            raise GeometryError(
                f"no block of {B} bytes fits whole in a {P}-byte page with num_blocks="
                f"{self.num_blocks}; raise num_blocks or page_bytes"
            )

    # -- sizes --------------------------------------------------------------
    @property
    def num_regions(self) -> int:
        """Virtual regions of the space (R)."""
        return self.num_layers * self.num_kv_buffers if self.layout == "per_layer" else 1

    @property
    def region_block_bytes(self) -> int:
        """Bytes of one block inside one region (``B`` in the formula)."""
        if self.layout == "per_layer":
            return self.block_bytes
        return self.block_bytes * self.num_layers * self.num_kv_buffers

    @property
    def blocks(self) -> int:
        """``num_blocks`` as an int (always set after construction)."""
        assert self.num_blocks is not None
        return self.num_blocks

    @cached_property
    def _ranges(self) -> tuple[Any, Any]:
        r = _core.native.page_ranges(self.page_bytes, self.region_block_bytes, self.blocks)
        return r.first, r.last

    @property
    def num_pages(self) -> int:
        return len(self._ranges[0])

    @property
    def region_bytes(self) -> int:
        """Virtual bytes reserved per region (whole pages)."""
        return self.num_pages * self.page_bytes

    @property
    def page_commit_bytes(self) -> int:
        """Physical bytes committed per page: ``R * page_bytes``."""
        return self.num_regions * self.page_bytes

    @cached_property
    def capacity(self) -> int:
        """Blocks that can really be allocated (straddling blocks excluded)."""
        first, last = self._ranges
        return int((last - first).sum())

    def block_range(self, page: int) -> range:
        """Block ids held by ``page``."""
        page = integer("page", page, lo=-(2**63))
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} out of range [0, {self.num_pages})")
        first, last = self._ranges
        return range(int(first[page]), int(last[page]))

    def page_of(self, block: int) -> int | None:
        """Page of ``block``, or ``None`` for a straddling block."""
        block = integer("block", block, lo=-(2**63))
        if not 0 <= block < self.blocks:
            raise IndexError(f"block {block} out of range [0, {self.blocks})")
        # Read off the native ranges so the formula lives once. They are
        # disjoint and ascending, so only the last page starting at or before
        # ``block`` can hold it (page 0 starts at block 0: always one).
        first, last = self._ranges
        page = int(np.searchsorted(first, block, side="right")) - 1
        return page if block < last[page] else None

    def usable(self, block: int) -> bool:
        """Whether ``block`` lies whole inside a page (can be handed out)."""
        return self.page_of(block) is not None

    # -- checks ----------------------------------------------------------------
    def check_granularity(self, granularity: int, device: str | None = None) -> None:
        """Raise :class:`GeometryError` unless ``page_bytes`` is a multiple of
        ``granularity`` (the step of ``device``'s backend), naming the fix."""
        _check_int("granularity", granularity)
        P, g = self.page_bytes, granularity
        if P % g:
            fix = math.ceil(P / g) * g
            backend = f"{device} backend" if device else "backend"
            raise GeometryError(
                f"page_bytes ({P}) is not a multiple of the {backend} granularity ({g}); "
                f"use page_bytes={fix} ({format_size(fix)})"
            )

    def check_tensors(self, tensors: Sequence[Any]) -> None:
        """Check KV tensors created before the space against this geometry.

        ``tensors`` has one entry per layer: either one tensor whose first
        dimension is ``num_kv_buffers`` or a sequence of ``num_kv_buffers``
        tensors. Raises :class:`GeometryError` on any mismatch.
        """
        if len(tensors) != self.num_layers:
            raise GeometryError(
                f"tensors have {len(tensors)} layers but the geometry has num_layers={self.num_layers}"
            )
        for i, layer in enumerate(tensors):
            if hasattr(layer, "shape"):
                bufs = int(layer.shape[0]) if layer.dim() > 0 else 0
                per_buf = layer.numel() * layer.element_size() // max(bufs, 1)
            else:
                bufs = len(layer)
                per_buf = min(t.numel() * t.element_size() for t in layer) if bufs else 0
            if bufs != self.num_kv_buffers:
                raise GeometryError(
                    f"layer {i} has {bufs} KV buffers but the geometry has "
                    f"num_kv_buffers={self.num_kv_buffers}"
                )
            held = per_buf // self.block_bytes
            if held < self.blocks:
                raise GeometryError(
                    f"tensors of layer {i} hold {held} blocks of {self.block_bytes} bytes but "
                    f"num_blocks={self.blocks}; use num_blocks<={held} or larger tensors"
                )
