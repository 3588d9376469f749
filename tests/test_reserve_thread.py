"""The reserve thread: keeps min..max idle pages, obeys limits, never needs the GIL."""

from __future__ import annotations

import random
import select
import subprocess
import sys
import textwrap

import pytest

from kvpool import Geometry, KVSpace

from .conftest import KiB

G = Geometry(2, 2, 4 * KiB, 256, page_bytes=16 * KiB)  # 4 blocks a page, 64 pages


def test_thread_commits_the_minimum_reserve_before_any_alloc() -> None:
    with KVSpace(G, reserve=(3, 5)) as space:
        assert space.settle(60)
        st = space.stats()
        assert st.pages_reserve == 3 and st.used_blocks == 0
        assert space.allocated_bytes() == 3 * G.page_commit_bytes
        assert space.drain_wakeups() >= 1  # each commit signals the eventfd


def test_steady_alloc_free_loop_stays_within_min_and_max_without_an_idle_interval() -> None:
    # idle_release_s=0: pages above max go back as they empty (the default
    # keeps them through an idle interval: tests/test_hot_path.py).
    rng = random.Random(7)
    with KVSpace(G, reserve=(2, 4), idle_release_s=0) as space:
        held: list[int] = []
        for step in range(600):
            if held and (rng.random() < 0.5 or space.available() < 40):
                k = rng.randint(1, len(held))
                space.free(held[:k])
                del held[:k]
            else:
                held += space.alloc(rng.randint(1, 12)).tolist()
            if step % 25 == 0:
                assert space.settle(60)
                st = space.stats()
                assert 2 <= st.pages_reserve <= 4, st
                assert space.allocated_bytes() == st.committed_bytes
        assert space.stats().commits > 0 and space.stats().releases > 0


def test_eventfd_turns_readable_when_the_thread_adds_capacity() -> None:
    with KVSpace(G, reserve=(1, 1)) as space:
        assert space.settle(60)
        space.drain_wakeups()
        ids = space.alloc(4)  # takes the idle page; the thread commits another
        ready, _, _ = select.select([space.wakeup_fd], [], [], 5)
        assert ready == [space.wakeup_fd]
        assert space.drain_wakeups() >= 1
        space.free(ids)


def test_wait_for_capacity_returns_on_the_threads_signal_and_consumes_it() -> None:
    with KVSpace(G, reserve=(1, 1)) as space:
        assert space.settle(60)
        space.drain_wakeups()
        assert space.wait_for_capacity(0) is False  # nothing signalled: returns at once
        ids = space.alloc(4)  # the thread commits a new idle page and signals
        assert space.wait_for_capacity(60) is True
        assert space.drain_wakeups() == 0  # consumed
        with pytest.raises(ValueError, match=">= 0"):
            space.wait_for_capacity(-1)
        space.free(ids)


def test_thread_respects_the_limit_and_gives_pages_back_above_it() -> None:
    with KVSpace(G, reserve=(4, 8)) as space:
        ids = space.alloc(16)  # 4 active pages
        assert space.settle(60)
        space.set_limit(5 * G.page_commit_bytes)
        assert space.settle(60)
        st = space.stats()
        assert st.pages_active + st.pages_reserve <= 5
        assert space.available() == 4  # one more page within the limit
        space.free(ids)
        space.set_limit(2 * G.page_commit_bytes)
        assert space.settle(60)
        assert space.allocated_bytes() <= 2 * G.page_commit_bytes


def test_trim_releases_idle_pages_and_the_thread_refills_the_minimum() -> None:
    with KVSpace(G, reserve=(2, 2)) as space:
        assert space.settle(60)
        assert space.trim() >= 2
        assert space.settle(60)
        assert space.stats().pages_reserve == 2


def test_many_spaces_start_and_stop_cleanly() -> None:
    for _ in range(40):
        space = KVSpace(G, reserve=(2, 3))
        space.alloc(5)
        space.close()
        assert space.allocated_bytes() == 0


@pytest.mark.timeout(300)
def test_python_thread_holding_the_gil_does_not_deadlock_the_reserve_thread(tmp_path) -> None:
    # The shape of kvcached issue 371: a native thread must never need the GIL
    # while Python code (holding it) waits on native work. Run in a child so a
    # deadlock fails this test instead of hanging the suite.
    script = textwrap.dedent(
        """
        import threading
        from kvpool import Geometry, KVSpace
        g = Geometry(2, 2, 4096, 1024, page_bytes=16384)
        space = KVSpace(g, reserve=(2, 4))
        stop = False
        def spin():
            x = 0
            while not stop:  # pure Python: holds the GIL except at switch points
                x += 1
        t = threading.Thread(target=spin); t.start()
        for i in range(3000):
            ids = space.alloc(9)       # crosses pages: needs the thread's commits
            if i % 7 == 0:
                space.settle(60)        # waits on the native thread
            space.free(ids)
        stop = True; t.join()
        st = space.stats()
        space.close()
        print("ok", st.commits, st.releases)
        """
    )
    # cwd outside the repo: its kvpool/ source folder has no compiled _native.
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")
