"""Helpers the tests share (not collected): waiting for an event.

A test waits for what another thread, process or native watcher does at its
own pace: a tenant queues, a child stops, a limit reaches a peer. The wait
polls a predicate and has no deadline of its own: how fast the event comes
is never an assumption, and on a busy machine it may come late. The test's
timeout (pytest-timeout: ``timeout`` in pyproject.toml or a test's
``@pytest.mark.timeout``) is the one bound; a wait it cuts short is named in
the failed test's report ("unfinished waits", conftest.py), so a hang reads
as the event that never came.

The ``pool_name`` fixture (a pool private to one test) is in conftest.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio

What = str | Callable[[], str]

# Waits begun and not yet over, oldest first. One a timeout (or any error)
# interrupts stays here: conftest.py names it in the failed test's report
# and empties the list after every test.
unfinished: list[What] = []


def wait_until(cond: Callable[[], bool], what: What, interval: float = 0.002) -> None:
    """Return once ``cond()`` holds, polling every ``interval`` s. ``what``
    names the event (a callable: built at report time, with the state then)."""
    with _waiting(what):
        while not cond():
            time.sleep(interval)


async def until(cond: Callable[[], bool], what: What, interval: float = 0.002) -> None:
    """``wait_until`` for async tests: the event loop runs between polls (the
    event often needs it: a grant comes through the manager's eventfd).
    ``interval=0`` polls at every turn of the loop."""
    with _waiting(what):
        while not cond():
            await anyio.sleep(interval)


def describe(what: What) -> str:
    if isinstance(what, str):
        return what
    try:
        return what()
    except Exception as e:  # the report must not fail on the state it describes
        return f"<{what!r} raised {e!r}>"


@contextmanager
def _waiting(what: What) -> Iterator[None]:
    unfinished.append(what)
    yield  # not in a finally: an interrupted wait stays listed for the report
    unfinished.remove(what)
