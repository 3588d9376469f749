"""Mirrored spaces: one engine's KV cache over ranks that live in their own processes.

A tensor- or pipeline-parallel engine on CUDA cannot have its scheduler
commit the pages its workers read: a CUDA VMM mapping belongs to the process
that made it. A *mirrored* :class:`~kvpool.KVSpace` (``ranks=[...]``) keeps
the allocator, the budget and the pool's books in the engine's process (the
*leader*) and lets each rank's process hold its own memory
(:class:`RankMemory`). The page map is the message (``native/mirror.hpp``):
a commit of page ``p`` publishes ``want[p] = 1`` in a shared channel, every
attached rank's sync thread maps it on its own device and acknowledges, and
only then does the leader's ``alloc`` return the blocks. A rank that cannot
commit (out of memory) makes the others release the page and the ``alloc``
fail with :class:`~kvpool.PoolExhausted`; a rank that stops answering costs
one wait of ``rank_timeout_s`` and then shortages, never a hang; a rank that
exits is detached; a rank that attaches late maps every page the space holds
before it answers.

Leader (the engine core)::

    space = KVSpace(geometry, device="cuda", pool="default", ranks=[n0, n1])
    handle = space.rank_handle()          # picklable: send it to the workers

Rank ``r`` (its worker process, its own GPU)::

    mem = RankMemory(handle, r, device=f"cuda:{r}")
    kv = mem.memory()                     # rank r's regions, back to back

On the CPU the same works with one memfd per rank (``device="cpu"``), which is
how the protocol is tested against real processes without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from . import _core
from . import _validate as V
from .errors import PoolClosed

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_RANKS", "RankHandle", "RankMemory"]

MAX_RANKS: int = _core.native.MAX_RANKS  # ranks a mirrored space can have (the channel's slots)

RankStats = _core.native.RankStats  # the bound type: what a rank's process sees of its memory


@dataclass(frozen=True)
class RankHandle:
    """What a rank's process needs to attach to a mirrored space
    (:meth:`KVSpace.rank_handle`): the leader's pid and channel descriptor,
    reached through ``/proc/<pid>/fd`` (same user)."""

    pid: int
    fd: int
    nonce: int                     # the channel's random identity: a stale handle is refused
    rank_regions: tuple[int, ...]  # regions of each rank, in the space's order
    region_bytes: int

    @property
    def num_ranks(self) -> int:
        return len(self.rank_regions)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankHandle:
        """The handle back from ``dataclasses.asdict`` of one (JSON, vLLM's config)."""
        return cls(pid=d["pid"], fd=d["fd"], nonce=d["nonce"], rank_regions=tuple(d["rank_regions"]),
                   region_bytes=d["region_bytes"])


class RankMemory:
    """Rank ``rank``'s memory of a mirrored space, held by this process.

    Attaching maps every page the space holds now; from then on a sync thread
    follows the leader's commits and releases. :meth:`close` (or the leader
    closing, or exiting) gives the memory back.
    """

    def __init__(self, handle: RankHandle, rank: int, *, device: str = "cpu") -> None:
        if not isinstance(handle, RankHandle):
            raise TypeError(f"handle must be a kvpool.RankHandle, got {type(handle).__name__}")
        rank = V.integer("rank", rank, hi=handle.num_ranks - 1)
        device = V.device(device)
        opened = _core.native.attach_rank(V.integer("handle.pid", handle.pid, lo=1, hi=2**31 - 1),
                                          V.integer("handle.fd", handle.fd, hi=2**31 - 1),
                                          V.integer("handle.nonce", handle.nonce, lo=1, hi=2**64 - 1),
                                          rank, device)
        if opened.value is None:
            _core.raise_status(opened.code, f"cannot attach rank {rank} on {device}: {opened.message}")
        self._mem = cast(_core.native.RankMemory, opened.value)
        self.rank = rank
        self.device = device
        self.handle = handle

    def memory(self) -> torch.Tensor:
        """This rank's regions, back to back, as one flat ``uint8`` tensor (zero-copy)."""
        import torch.utils.dlpack  # here, not at import: a rank process that only attaches needs no torch

        self._check_open()
        return torch.utils.dlpack.from_dlpack(self._mem.memory())

    def region(self, index: int) -> torch.Tensor:
        """This rank's region ``index`` (0-based within the rank) as a flat ``uint8`` tensor."""
        s = self.stats()  # the channel's figures, checked at attach (not the handle's)
        index = V.integer("index", index, hi=s.num_regions - 1)
        return self.memory()[index * s.region_bytes:(index + 1) * s.region_bytes]

    def stats(self) -> RankStats:
        """What this rank holds (committed pages, bytes its backend allocated, its counters)."""
        return self._mem.stats()

    def sync(self, timeout: float = 5.0) -> bool:
        """Wait until this rank matches the leader's page map; ``False`` on timeout."""
        return bool(self._mem.sync(V.seconds("timeout", timeout, allow_inf=False)))

    @property
    def closed(self) -> bool:
        return bool(self._mem.closed)

    def _check_open(self) -> None:
        if self._mem.closed:
            raise PoolClosed(f"rank {self.rank}'s memory is closed")

    def close(self) -> None:
        """Give this rank's memory back and leave its slot (a new process may attach). Idempotent.

        ``closed`` is also true once the leader closed the space (or exited)
        and this rank gave its memory back.
        """
        self._mem.close()

    def __enter__(self) -> RankMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return f"<RankMemory rank {self.rank} closed>"
        s = self.stats()
        return f"<RankMemory rank {self.rank} of {self.handle.num_ranks}, {s.committed_pages} pages on {self.device}>"
