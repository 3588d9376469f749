"""Engine adapters (shipped as ``kvpool.adapters``).

Thin front doors over the public :mod:`kvpool` API; they never import
``kvpool._native``:

* :mod:`kvpool.adapters.blocking`: a ``KVCacheManager`` for engine threads;
* :mod:`kvpool.adapters.vllm`: the vLLM plugin (``KVPOOL_VLLM=1``);
* :mod:`kvpool.adapters.sglang`: an SGLang token-to-KV allocator.

Each is imported on its own: importing this package loads none of them.
"""

from __future__ import annotations

__all__: list[str] = []
