"""D7: a KV space inherited across fork() is inert in the child (issue 10).

On 884d081 a forked child that closed or merely dropped its inherited copy
of a KVSpace punched holes in the memfd it shares with the parent: the
parent's committed KV pages read back as zeros while its books still said
allocated, and its next writes allocated memory outside the pool's
accounting (repro/fork_child_destroys_parent_kv.py). The child could also
unregister the parent's ledger slot. Now the child's copy answers every call
with PoolClosed and its close() releases nothing.

The fork happens in a subprocess (_fork_child.py); this test reads what it
saw. A child that hangs in its destructor hangs that subprocess: the bound is
the test's timeout, never a sleep.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from kvpool import Pool

from ._hostile import PCB

SCRIPT = pathlib.Path(__file__).with_name("_fork_child.py")


def run_fork(pool: str, reserve_thread: bool, mode: str) -> dict[str, object]:
    p = subprocess.run([sys.executable, str(SCRIPT), pool, "1" if reserve_thread else "0", mode],
                       capture_output=True, text=True, timeout=500)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["close", "use", "del", "exit"])
@pytest.mark.parametrize("reserve_thread", [False, True], ids=["inline", "reserve-thread"])
@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "private"])
def test_a_forked_child_never_releases_its_parents_kv(
    pooled: bool, reserve_thread: bool, mode: str, pool_name: str
) -> None:
    if pooled:
        Pool(pool_name, capacity=64 * PCB)
    out = run_fork(pool_name if pooled else "-", reserve_thread, mode)
    assert out["child_status"] == 0
    assert out["child_wrong"] == []  # every call on the inherited copy was PoolClosed, it held no memory
    assert out["data_ok"], "the parent's KV data changed when the child let go of its copy"
    assert out["after"] == out["before"]  # allocated bytes, committed pages, used blocks, ledger row and total
    before = out["before"]
    assert isinstance(before, dict) and before["allocated_bytes"] == before["committed_bytes"] > 0
    if pooled:
        assert before["ledger"] == [["parent", before["committed_bytes"]]]
        assert out["pool_committed_after_close"] == 0  # the parent's close still returns everything


@pytest.mark.timeout(600)
def test_a_forked_childs_read_of_its_inherited_view_allocates_nothing_behind_the_parents_books() -> None:
    """Issue 10, D6/D7: the child kept the parent's MAP_SHARED memfd mapping of
    every committed page; after the parent released (punched) them, a mere
    read of the child's inherited view allocated them in the parent's memfd
    again, outside the books. Now the CPU backend's fork handler makes every
    space of the process inert in the child: its view reads zeros and maps
    none of the parent's memory."""
    p = subprocess.run([sys.executable, str(SCRIPT), "-", "0", "read-released"],
                       capture_output=True, text=True, timeout=500)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["child_status"] == 0  # the read itself is allowed: it sees the inert range, it does not fault
    assert "child read 0" in lines  # zeros, not the parent's 5s: the child holds none of the parent's memory
    assert out["released"] == {"allocated_bytes": 0, "committed_bytes": 0}
    assert out["after"] == out["released"], f"the child's read allocated {out['after']['allocated_bytes']} bytes"
