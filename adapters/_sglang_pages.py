"""The life of SGLang's pages inside :class:`~kvpool.adapters.sglang.KVPoolTokenAllocator`.

One state per SGLang page, the pending list and the live backup; the
allocator asks this table which pages to hand out, free, give back to the
space at a flush, or put back at a restore, and does the space calls itself
(so a failing space call changes nothing here: each method that gives pages
back calls its ``give_back`` before it changes a state).

Freed pages stay in the space for a step. SGLang frees KV the GPU may still
touch: the overlap scheduler (its default) frees a finished request in
``process_batch_result`` while the next batch, which may still hold it, runs;
EAGLE calls ``restore_state`` *before* its draft forward writes into the slots
the restore just freed. Given to the space then, a page could be released
(punched out on the CPU, unmapped on CUDA) under the kernel. So a free makes
a page *pending*: logically free (counted by :meth:`available_size`, reused
first by this allocator's allocs, as SGLang's free list would) but still held
in the space, which gets it back at the second :meth:`flush` after the free::

    FREE ──alloc──► HELD ──free──► PENDING ──flush──► PENDING (aged) ──flush──► FREE
                     ▲                          │
                     └── alloc, oldest first ───┘

**Safe points.** Call :meth:`flush` at the end of every scheduler loop
iteration, idle ones included (SGLang's loop keeps turning while idle, so an
idle server gives memory back within two iterations). By the second flush
the batch that could still read a page has had its output copied to the
host, which waits for the kernels before it. :meth:`clear` (SGLang clears only
when idle) and :meth:`close` return everything at once; nothing else returns
pages, so without :meth:`flush` freed pages stay committed to this engine.

Backups are single-use. SGLang's ``restore_state`` puts its free list back
exactly: pages allocated since the backup are free again, pages freed since
are held again. While a backup is live, a page allocated from the free pages
is *NEW*, and a freed page that was held at the backup is *KEPT* (pending,
but restore holds it again); the pages allocated since are listed, so a
restore touches only them and the pending list::

    restore:     NEW -> PENDING        KEPT -> HELD
    backup ends: NEW -> HELD           KEPT -> PENDING

Restoring ends the backup (no SGLang caller restores one twice: a second
restore raises ``ValueError`` and changes nothing), and so do a new
``backup_state()``, :meth:`flush` and :meth:`clear`.

Page 0 (SGLang's padding page, the space's null block) stays ``FREE`` here:
the space holds it and the allocator's range check refuses frees of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvpool import InvalidBlocks

__all__ = ["AllocatorState", "IntsLike", "PageStates", "host_ints"]


@dataclass(frozen=True)
class AllocatorState:
    """What :meth:`KVPoolTokenAllocator.backup_state` returns (the live backup's owner and
    generation); opaque to callers."""

    owner: int
    generation: int

Ids = npt.NDArray[np.int64]
IntsLike = torch.Tensor | Sequence[int] | npt.NDArray[np.integer[Any]]


def host_ints(x: IntsLike, name: str, error: type[Exception] = ValueError) -> Ids:
    """A 1-D int64 numpy copy of host-side integers (a tensor comes to the CPU);
    ``error`` (with ``name`` in its message) when they are not integers."""
    arr = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if arr.size and arr.dtype.kind not in "iu":
        raise error(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.reshape(-1).astype(np.int64, copy=True)

# Per-page state (the diagrams above).
FREE, HELD, NEW, PENDING, KEPT = 0, 1, 2, 3, 4


class PageStates:
    """Every SGLang page's state, the pending pages (oldest first) and the live backup."""

    def __init__(self, num_blocks: int) -> None:
        self.state = np.zeros(num_blocks, dtype=np.int8)  # FREE/HELD/NEW/PENDING/KEPT per page
        # Pending and kept pages, oldest first; the first `aged` have seen a flush
        # (the next flush releases them). Kept pages are never aged: a flush ends the backup.
        self.pending: Ids = np.empty(0, dtype=np.int64)
        self.aged = 0
        self.since: list[Ids] = []  # pages allocated while the live backup lasts
        self.generation = 0
        self.backup_live = False

    def held_mask(self) -> npt.NDArray[np.bool_]:
        held: npt.NDArray[np.bool_] = (self.state == HELD) | (self.state == NEW)
        return held

    def take(self, n: int, fresh: Callable[[int], Ids | None]) -> Ids | None:
        """``n`` page ids, all or nothing: pending pages (oldest first), then ``fresh(m)`` from the space."""
        reuse = min(n, int(self.pending.size))
        got: Ids = np.empty(0, dtype=np.int64)
        if n > reuse:
            more = fresh(n - reuse)
            if more is None:
                return None
            got = more
        pages = np.concatenate((self.pending[:reuse], got))
        self.pending = self.pending[reuse:]
        self.aged = max(0, self.aged - reuse)
        if self.backup_live:
            self.state[pages] = np.where(self.state[pages] == KEPT, HELD, NEW)
            self.since.append(pages)
        else:
            self.state[pages] = HELD
        return pages

    def free(self, pages: Ids) -> None:
        """Make unique pages SGLang holds pending (kept, if held at the live backup)."""
        state = self.state[pages]
        not_held = pages[(state != HELD) & (state != NEW)]
        if not_held.size:
            bad = not_held[:8].tolist()
            raise InvalidBlocks(f"pages {bad} are not allocated (double free?); nothing was freed", bad)
        self.state[pages] = np.where(state == HELD, KEPT, PENDING) if self.backup_live else PENDING
        self.pending = np.concatenate((self.pending, pages))

    def reserve(self, pages: Ids) -> None:
        """Fresh pages from the space, taken ahead of an alloc a gate counted: pending
        (young, the next allocs take them first; back to the space at the second flush
        if none does)."""
        self.state[pages] = PENDING
        self.pending = np.concatenate((self.pending, pages))

    def backup(self) -> int:
        """Start a backup (ending an earlier one); returns its generation."""
        self.end_backup()
        self.generation += 1
        self.backup_live = True
        return self.generation

    def restore(self, generation: int) -> Ids:
        """Put back the pages held at backup ``generation`` and end it; ``ValueError`` if it is not live.
        Returns the pending pages held again."""
        if not self.backup_live or generation != self.generation:
            raise ValueError(f"backup {generation} is no longer restorable: it was restored already, or a "
                             "later backup_state(), flush() or clear() ended it (a backup is restored at most once)")
        return self.end_backup(restore=True)

    def end_backup(self, restore: bool = False) -> Ids:
        """Turn the live backup's marks into plain states (the table in the module essay);
        returns the pending pages a restore holds again."""
        if not self.backup_live:
            return np.empty(0, dtype=np.int64)
        kept = self.state[self.pending] == KEPT
        back = self.pending[kept] if restore else np.empty(0, dtype=np.int64)
        assert not kept[: self.aged].any(), "kept pages are young: a flush ends the backup before aging"
        since = np.unique(np.concatenate(self.since)) if self.since else np.empty(0, dtype=np.int64)
        new = since[self.state[since] == NEW]
        if restore:
            self.state[self.pending[kept]] = HELD
            self.state[new] = PENDING
            self.pending = np.concatenate((self.pending[~kept], new))
        else:
            self.state[self.pending[kept]] = PENDING
            self.state[new] = HELD
        self.since = []
        self.backup_live = False
        return back

    def flush(self, give_back: Callable[[Ids], None]) -> int:
        """End a live backup, hand ``give_back`` the pages already pending at the
        previous flush, and age the rest; returns how many went back."""
        self.end_backup()
        old = self.pending[: self.aged]
        if old.size:
            give_back(old)
            self.state[old] = FREE
        self.pending = self.pending[self.aged :]
        self.aged = int(self.pending.size)
        return int(old.size)

    def clear(self, give_back: Callable[[Ids], None]) -> None:
        """Hand ``give_back`` every page that is not free, then forget every state and the backup."""
        pages = np.flatnonzero(self.state != FREE).astype(np.int64)
        if pages.size:
            give_back(pages)
        self.state[:] = FREE
        self.pending = np.empty(0, dtype=np.int64)
        self.aged = 0
        self.since = []
        self.backup_live = False
        self.generation += 1
