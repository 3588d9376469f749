"""Helpers of the hostile tests (not collected): child tenants, process states,
and a guard for the calls a hang would keep from the test's timeout.

A call here waits for an event (a line, a native call's return) and fails
only after a guard far beyond any machine's load: the guard turns a hang into
a message, it never decides how much happens in a given time. Polled waits
(``wait_until``) are in _helpers.py, and the ``pool_name`` fixture in conftest.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import pytest

from kvpool import Geometry

T = TypeVar("T")

G = Geometry(1, 2, 4096, 256, page_bytes=16384)  # as in _hostile_child.py: 4 blocks a page
PCB = G.page_commit_bytes  # 32 KiB per page commit
BLOCKS_PER_PAGE = 4
CHILD = pathlib.Path(__file__).with_name("_hostile_child.py")
GUARD_S = float(os.environ.get("KVPOOL_HOSTILE_GUARD_S", "240"))  # lowered only to prove old builds fail fast


def bounded(fn: Callable[[], T], what: str, guard_s: float = GUARD_S) -> T:
    """Run ``fn`` in a thread and fail (instead of hanging the test) if it does
    not return within the guard. A native call that waits on a stopped peer
    holds no GIL, so the test's own timeout could not interrupt it."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # re-raised in the test's thread
            err.append(e)

    t = threading.Thread(target=run, daemon=True, name=f"bounded: {what}")
    t.start()
    t.join(guard_s)
    assert not t.is_alive(), f"{what}: still blocked after {guard_s} s (waits on another process)"
    if err:
        raise err[0]
    return out[0]


def proc_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat ('' once the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2]


class Child:
    """A tenant process running _hostile_child.py; killed at the end of the test."""

    def __init__(self, args: Sequence[str], *, prefix: Sequence[str] = (), cwd: str | None = None) -> None:
        self.proc = subprocess.Popen([*prefix, sys.executable, str(CHILD), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
        self.pid = self.proc.pid

    def line(self, what: str = "a line") -> str:
        assert self.proc.stdout is not None
        text = bounded(self.proc.stdout.readline, f"the child's {what}")
        if not text:
            assert self.proc.stderr is not None
            raise AssertionError(f"child exited ({self.proc.wait()}) before {what}: {self.proc.stderr.read()[-2000:]}")
        return text.strip()

    def ready(self) -> Child:
        assert self.line("ready") == "ready"
        return self

    def json(self, what: str = "its report") -> Any:
        return json.loads(self.line(what))

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL also ends a stopped process
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def children() -> Iterator[Callable[..., Child]]:
    started: list[Child] = []

    def start(*args: str, prefix: Sequence[str] = ()) -> Child:
        c = Child(args, prefix=prefix)
        started.append(c)
        return c

    yield start
    for c in started:
        c.kill()
