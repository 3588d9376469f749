"""kvpool for vLLM: a ``vllm.general_plugins`` plugin.

Enable it with one environment variable, ``KVPOOL_VLLM=1``; vLLM loads the
plugin in every one of its processes (entry point ``kvpool`` in kvpool's
``pyproject.toml``). What changes:

* **Engine-core process** (where the scheduler runs): when vLLM initializes
  the KV cache, the plugin creates a kvpool :class:`~kvpool.KVSpace` with the
  geometry vLLM computed (its whole, *virtual* capacity) as a tenant of the
  pool ``$KVPOOL_POOL`` (default ``default``), and the scheduler's
  ``BlockPool`` becomes :class:`KVPoolBlockPool`: physical memory is
  committed page by page as blocks are used, and given back as they empty.
* **Worker** (same process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, its own
  process by default on CPU): the KV tensors vLLM binds are views of the
  space's memory, in the layout vLLM asked for. A worker in another process
  maps the space's memory file (:func:`kvpool.map_shared`), so pages the
  scheduler commits are visible to it with no message per page.

Sharing follows the pool's fair-share policy (ARCHITECTURE.md): the engine
borrows memory its neighbours leave idle, and while a tenant below its
guarantee waits it lends: cached pages go back first, then vLLM sees a full
cache and preempts (:mod:`.block_pool`). At start-up the engine refuses, in
vLLM's own words, a pool or limit that can never hold one ``max_model_len``
request (:mod:`.admission`).

Optional settings: ``KVPOOL_VLLM_PAGE_BYTES`` (commit unit per layer,
default 2 MiB), ``KVPOOL_VLLM_TENANT`` (the tenant name, default
``vllm-<pid>``) and ``KVPOOL_VLLM_IDLE_RELEASE_S`` (how long emptied pages
above the reserve stay committed while no other tenant waits, default 1 s;
0: they go back as they empty; see ``KVSpace(idle_release_s=)``). Supported: attention KV caches in one or several
groups (full attention, sliding-window hybrids; :mod:`.layout`), one worker
per engine, on CPU (both process modes) and on CUDA with the worker in the
engine-core process.
"""

from __future__ import annotations

import os

__all__ = ["ENABLE_ENV", "enabled", "register"]

ENABLE_ENV = "KVPOOL_VLLM"


def enabled() -> bool:
    """Whether ``$KVPOOL_VLLM`` turns the plugin on (``1``/``true``/``yes``)."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """vLLM's plugin hook: patch vLLM in this process when the plugin is enabled."""
    if not enabled():
        return
    from ._hooks import install

    install()
