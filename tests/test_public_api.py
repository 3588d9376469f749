"""The public surface is exactly ``kvpool.__all__`` (STYLE.md item 1)."""

from __future__ import annotations

import __future__
import types

import pytest

import kvpool
import kvpool.adapters


def test_all_names_exist_and_nothing_public_is_missing() -> None:
    # dir() lists the lazily imported names too (kvpool/__init__.py's __dir__).
    public = {
        name
        for name in dir(kvpool)
        if not name.startswith("_")
        and not isinstance(getattr(kvpool, name), (types.ModuleType, __future__._Feature))
    }
    assert set(kvpool.__all__) == public
    for name in kvpool.__all__:
        assert getattr(kvpool, name) is not None


def test_a_name_kvpool_does_not_have_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        kvpool.no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        exec("from kvpool import no_such_name", {})


def test_errors_form_one_hierarchy_by_cause() -> None:
    for cls in (kvpool.PoolExhausted, kvpool.PoolClosed, kvpool.GeometryError, kvpool.InvalidBlocks,
                kvpool.BackendError, kvpool.LedgerError):
        assert issubclass(cls, kvpool.KVPoolError)
    assert issubclass(kvpool.GeometryError, ValueError)
    assert issubclass(kvpool.InvalidBlocks, ValueError)
    assert not issubclass(kvpool.PoolExhausted, ValueError)


def test_adapters_ship_inside_the_package() -> None:
    assert kvpool.adapters.__name__ == "kvpool.adapters"
