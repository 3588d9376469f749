"""Engine adapters (shipped as ``kvpool.adapters``).

Thin front doors over the public :mod:`kvpool` API; they never import
``kvpool._native``. The blocking, vLLM and SGLang adapters land with their
own issues.
"""

from __future__ import annotations

__all__: list[str] = []
