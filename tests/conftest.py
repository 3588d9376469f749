from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

import os
import signal
import uuid

import pytest

from kvpool import Geometry, KVSpace, Pool

from . import _helpers

# A suite started in the background without job control (`nohup ... &`, a
# CI runner) inherits SIGINT *ignored*, and so would every child it starts:
# the tests that press Ctrl-C on `kvpool top` / `kvpool metrics --listen`
# would then wait forever for an exit. A handler (unlike SIG_IGN) is not
# inherited across exec, so children start with SIGINT at its default, as
# from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

KiB = 1024


FAKE_CUDA_SRC = os.path.join(os.path.dirname(__file__), "fake_cuda", "fake_libcuda.c")
FAKE_GRANULARITY = 4096


@pytest.fixture(scope="session", autouse=True)
def fake_cuda_driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str | None]:
    """Build the fake libcuda and point kvpool at it for this run (set before any
    cuda space is made: the driver is loaded once per process). None without gcc."""
    import shutil
    import subprocess

    if shutil.which("gcc") is None or os.environ.get("KVPOOL_REAL_CUDA") == "1":
        yield None  # scripts/gpu_check.sh runs against the real driver
        return
    out = str(tmp_path_factory.mktemp("fake_cuda") / "libcuda.so.1")
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", out, FAKE_CUDA_SRC], check=True)
    os.environ["KVPOOL_LIBCUDA"] = out
    os.environ["FAKE_CUDA_GRANULARITY"] = str(FAKE_GRANULARITY)
    yield out


@pytest.fixture(scope="session", autouse=True)
def private_default_pool() -> Iterator[None]:
    """Managers built with the default pool join a pool private to this run,
    never the host's real ``default`` (children inherit the variable)."""
    name = f"test-session-{os.getpid()}"
    os.environ["KVPOOL_POOL"] = name
    yield
    Pool.remove(name)


@pytest.fixture
def pool_names(request: pytest.FixtureRequest) -> Iterator[Callable[[], str]]:
    """Make pool names private to this test; each one's pool is removed at
    teardown (whether the test made it or not). Names start with the test's
    module (``test-pool-3f9a...``), so a ledger left in /dev/shm says whose it is."""
    owner = request.module.__name__.rpartition(".")[2].replace("_", "-")
    made: list[str] = []

    def make() -> str:
        made.append(f"{owner}-{uuid.uuid4().hex[:10]}")
        return made[-1]

    yield make
    for name in made:
        Pool.remove(name)


@pytest.fixture
def pool_name(pool_names: Callable[[], str]) -> str:
    """A pool name private to this test, its pool removed at teardown."""
    return pool_names()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report names the waits (tests/_helpers.py) still under way
    when it failed: a hang cut short by the test's timeout reads as the event
    that never came."""
    report: pytest.TestReport = yield
    if report.failed and _helpers.unfinished:
        report.sections.append(("unfinished waits", "\n".join(
            f"still waiting until: {_helpers.describe(w)}" for w in _helpers.unfinished)))
    if call.when == "teardown":
        _helpers.unfinished.clear()
    return report


@pytest.fixture
def make_space() -> Iterator[Callable[..., KVSpace]]:
    """Build spaces that are closed at teardown. Defaults: small pages, no thread."""
    spaces: list[KVSpace] = []

    def make(geometry: Geometry | None = None, **kw: Any) -> KVSpace:
        if geometry is None:
            geometry = Geometry(2, 2, 4 * KiB, 256, page_bytes=64 * KiB)
        kw.setdefault("reserve_thread", False)
        kw.setdefault("reserve", (0, 0))
        s = KVSpace(geometry, **kw)
        spaces.append(s)
        return s

    yield make
    for s in spaces:
        s.close()


def snapshot(space: KVSpace) -> tuple[object, ...]:
    """Everything a failed operation must leave unchanged."""
    st = space.stats()
    return (
        st.used_blocks,
        st.available,
        st.pages_free,
        st.pages_reserve,
        st.pages_active,
        st.committed_bytes,
        tuple(space.page_occupancy()),
        space.allocated_bytes(),
    )
