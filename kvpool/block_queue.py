"""The native free-block queue an engine's block pool builds on (for engine adapters).

An engine whose scheduler keeps its own block objects and free queue (vLLM's
``BlockPool``) replaces that queue with one over a :class:`~kvpool.KVSpace`:
:class:`FreeQueue` answers the engine's block objects from one native alloc,
frees them in one native call, keeps cached blocks as evictable, and is the
one implementation of the engine's two per-request calls (its free count,
``get_num_free_blocks``, and its ``get_new_blocks``): the adapter's methods
call these. Off its common case (a shortage, a grant while the tenant
lends, blocks a reuse watcher waits on) it calls the adapter back through
the callables given here, each checked when the queue is built: the native
core names no method of any adapter.

Adapters import this module, never ``kvpool._native``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from . import _core
from .space import KVSpace, alloc_failed

__all__ = ["FreeQueue", "raise_alloc_failure"]

Failure = _core.native.Failure


def _free_refused(failure: Any) -> NoReturn:
    _core.raise_failure(failure, ids=True)


def raise_alloc_failure(answer: Any, n: int) -> NoReturn:
    """Raise the kvpool error for a refused native alloc of ``n`` (what a
    ``take_short`` callback is handed when the answer is not a list)."""
    alloc_failed(answer, n)


class FreeQueue(_core.native.VllmFreeQueue):
    """The native queue over ``space``; see the module docstring.

    ``blocks``: the engine's block objects, indexed by block id (an entry per
    block of the space); ``watchers``: the engine's reuse watchers (a dict,
    never rebound); ``host``: the engine's block pool, first argument of
    ``checked_get_new`` and ``host_get_new`` (the adapter's and the engine's
    own ``get_new_blocks``); ``take_short(n, covered, answer)``: an alloc off
    its common case (``answer`` a list of blocks granted while lending, or a
    refusal for :func:`raise_alloc_failure`); ``report_waiting(k)``: tell the
    pool; ``keep_readable(blocks)``: the blocks no reuse watcher waits on;
    ``id_attr``: the blocks' int id attribute; ``total``: the blocks the
    engine may use.
    """

    def __init__(self, space: KVSpace, blocks: list[Any], watchers: dict[int, Any], host: Any, *,
                 checked_get_new: Callable[[Any, int], list[Any]], host_get_new: Callable[[Any, int], list[Any]],
                 take_short: Callable[[int, bool, Any], list[Any]], report_waiting: Callable[[int], None],
                 keep_readable: Callable[[list[Any]], list[Any]], id_attr: str, total: int) -> None:
        if not isinstance(space, KVSpace):
            raise TypeError(f"space must be a kvpool.KVSpace, got {type(space).__name__}")
        super().__init__(space._space, blocks, {}, watchers, host, checked_get_new, host_get_new, _free_refused,
                         take_short, report_waiting, keep_readable, id_attr, total)
