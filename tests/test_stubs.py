"""The checked-in ``kvpool/_native.pyi`` matches the built extension."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

STUB = pathlib.Path(__file__).resolve().parent.parent / "kvpool" / "_native.pyi"


def test_native_stub_in_the_tree_is_current(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("nanobind.stubgen")
    out = tmp_path / "_native.pyi"
    subprocess.run(
        [sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "kvpool._native", "-o", str(out)],
        check=True,
        cwd=tmp_path,  # not the repo root: its kvpool/ source folder has no _native
    )
    assert out.read_text() == STUB.read_text(), (
        "kvpool/_native.pyi is stale: regenerate with "
        "`python -m nanobind.stubgen -m kvpool._native -o kvpool/_native.pyi`"
    )
