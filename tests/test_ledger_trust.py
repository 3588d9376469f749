"""D2: a pool segment is trusted only if it is ours (issue 10).

Someone else creates /dev/shm/kvpool-<name> first: world-writable, owned by
another user, a symbolic link to a file of ours, not a regular file. On
884d081 a root engine joined such a file unchecked, and the squatter then
controlled its budget (capacity := 0), its liveness (a truncated file is a
SIGBUS) and its locking (a forged mutex word hangs it): repro/pool_squat.sh.
Now every such file is refused with a LedgerError and never followed, written
or re-moded. The planted files are valid ledgers of this very build, so
nothing but the trust check can refuse them.
"""

from __future__ import annotations

import hashlib
import os
import stat
import uuid
from collections.abc import Callable, Iterator

import pytest

from kvpool import KVSpace, LedgerError, Pool

from ._hostile import G

SHM = "/dev/shm"


@pytest.fixture
def names() -> Iterator[Callable[[], str]]:
    made: list[str] = []

    def make() -> str:
        made.append(f"test-trust-{uuid.uuid4().hex[:10]}")
        return made[-1]

    yield make
    for n in made:
        path = f"{SHM}/kvpool-{n}"
        if os.path.lexists(path):
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.unlink(path)


def valid_ledger_bytes(names: Callable[[], str]) -> bytes:
    """The bytes of a fresh, valid ledger of this build (made, read, removed)."""
    src = names()
    Pool(src, capacity=1 << 20)
    with open(f"{SHM}/kvpool-{src}", "rb") as f:
        data = f.read()
    Pool.remove(src)
    return data


def fingerprint(path: str) -> tuple[object, ...]:
    st = os.lstat(path)
    digest = ""
    if stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    return st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, st.st_ino, digest


def plant(path: str, data: bytes, mode: int, uid: int | None = None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, data)
    os.close(fd)
    if uid is not None:
        os.chown(path, uid, -1)
    os.chmod(path, mode)


def assert_refused_untouched(name: str, *watched: str, match: str) -> None:
    before = {p: fingerprint(p) for p in watched}
    for attempt in (lambda: Pool(name), lambda: Pool(name, create=False), lambda: Pool(name, capacity=1 << 20),
                    lambda: KVSpace(G, pool=name, name="victim", reserve_thread=False, reserve=(0, 0))):
        with pytest.raises(LedgerError, match=match):
            attempt()
    assert {p: fingerprint(p) for p in watched} == before  # not written, re-moded, replaced or followed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [0o666, 0o644, 0o640, 0o620, 0o602, 0o700], ids=lambda m: f"{m:04o}")
def test_a_pool_file_others_can_touch_is_refused(mode: int, names: Callable[[], str]) -> None:
    name = names()
    path = f"{SHM}/kvpool-{name}"
    plant(path, valid_ledger_bytes(names), mode)
    assert_refused_untouched(name, path, match=f"not ours.*mode {mode:04o}")


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_pool_file_owned_by_another_user_is_refused(names: Callable[[], str]) -> None:
    name = names()
    path = f"{SHM}/kvpool-{name}"
    plant(path, valid_ledger_bytes(names), 0o600, uid=65534)  # nobody, mode exactly 0600
    assert_refused_untouched(name, path, match="not ours.*owned by uid 65534")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target_kind", ["our own pool", "a missing file"])
def test_a_pool_file_that_is_a_symbolic_link_is_never_followed(target_kind: str, names: Callable[[], str]) -> None:
    name = names()
    path = f"{SHM}/kvpool-{name}"
    if target_kind == "our own pool":
        target_name = names()
        Pool(target_name, capacity=1 << 20)  # a real ledger of ours, valid in every way
        target = f"{SHM}/kvpool-{target_name}"
    else:
        target = f"{SHM}/kvpool-{names()}"  # O_CREAT through a dangling link would create it
    os.symlink(target, path)
    watched = [path, target] if os.path.exists(target) else [path]
    assert_refused_untouched(name, *watched, match="symbolic link|not ours")
    assert os.path.islink(path) and os.path.exists(target) == (target_kind == "our own pool")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_pool_path_that_is_not_a_regular_file_is_refused(kind: str, names: Callable[[], str]) -> None:
    name = names()
    path = f"{SHM}/kvpool-{name}"
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    else:
        os.mkdir(path, 0o700)
    assert_refused_untouched(name, path, match="not ours.*regular file|Is a directory")
    assert stat.S_ISFIFO(os.lstat(path).st_mode) if kind == "fifo" else os.path.isdir(path)
