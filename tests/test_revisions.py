"""D11: setting revisions are bounded to 2**53 and later changes still apply (issue 10).

On 884d081 `Pool.set_limit(..., revision=2**63 - 1)` (and `kvpool limit
--revision`) was accepted; "the next revision" then overflowed, every later
change was answered "stale" and KVSpace.set_limit silently did nothing: the
tenant's limit could never change again (revision_overflow_lockout.py). Now a
revision above 2**53 (exact in a double, so in JSON and Python floats too) is
a ValueError naming it, and nothing changes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvpool import KVSpace, Pool

from ._helpers import wait_until
from ._hostile import PCB, G

TOO_BIG = [pytest.param(2**53 + 1, id="2**53+1"), pytest.param(2**63 - 1, id="INT64_MAX"),
           pytest.param(2**64, id="2**64")]


@pytest.fixture
def tenant(pool_name: str) -> Iterator[tuple[Pool, KVSpace]]:
    pool = Pool(pool_name, capacity=16 * PCB)
    s = KVSpace(G, pool=pool, name="t", reserve_thread=False, reserve=(0, 0))
    yield pool, s
    s.close()


def kvpool_cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "kvpool")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("revision", TOO_BIG)
@pytest.mark.parametrize("setting", ["limit", "guarantee"])
def test_a_revision_beyond_2_53_is_refused_and_later_changes_still_apply(
    setting: str, revision: int, tenant: tuple[Pool, KVSpace]
) -> None:
    pool, s = tenant
    set_ = pool.set_limit if setting == "limit" else pool.set_guarantee
    assert set_("t", 2 * PCB, revision=5) == "applied"
    with pytest.raises(ValueError, match=rf"revision.*{revision}"):
        set_("t", 3 * PCB, revision=revision)
    (row,) = pool.tenants()
    assert (row.limit_bytes, row.limit_revision) == ((2 * PCB, 5) if setting == "limit" else (None, 0))
    assert (row.guarantee_setting, row.guarantee_revision) == ((2 * PCB, 5) if setting == "guarantee" else (None, 0))
    # The next change, from the pool and from the tenant itself, applies.
    assert set_("t", 4 * PCB) == "applied"
    if setting == "limit":
        wait_until(lambda: s.limit_setting() == (4 * PCB, 6), "the tenant sees revision 6")
        s.set_limit(None)
        assert s.limit_setting() == (None, 7)
        assert pool.tenants()[0].limit_bytes is None
    else:
        wait_until(lambda: s.budget().guarantee_revision == 6, "the tenant sees revision 6")
        s.set_guarantee(None)
        assert (s.budget().guarantee_setting, s.budget().guarantee_revision) == (None, 7)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("revision", TOO_BIG)
def test_the_space_refuses_a_revision_beyond_2_53_too(revision: int, tenant: tuple[Pool, KVSpace]) -> None:
    pool, s = tenant
    with pytest.raises(ValueError, match="revision"):
        s._set_limit(PCB, revision)
    assert s.limit_setting() == (None, 0)
    s.set_limit(3 * PCB)
    assert s.limit_setting() == (3 * PCB, 1) and pool.tenants()[0].limit_bytes == 3 * PCB


@pytest.mark.timeout(300)
def test_kvpool_limit_refuses_an_int64_max_revision_and_takes_the_next_change(
    pool_name: str, tenant: tuple[Pool, KVSpace]
) -> None:
    pool, _s = tenant
    r = kvpool_cli("limit", pool_name, "t", "1M", "--revision", str(2**63 - 1))
    assert r.returncode != 0 and "revision" in r.stderr, (r.returncode, r.stdout, r.stderr)
    assert pool.tenants()[0].limit_bytes is None
    r = kvpool_cli("limit", pool_name, "t", "2M")
    assert r.returncode == 0 and r.stdout.strip() == "applied", (r.returncode, r.stdout, r.stderr)
    assert pool.tenants()[0].limit_bytes == 2 << 20


@pytest.mark.timeout(120)
def test_the_last_revision_is_accepted_and_a_next_one_is_a_loud_error(tenant: tuple[Pool, KVSpace]) -> None:
    # 2**53 itself is in range. There is no revision after it: a "next"
    # change then raises (it must not be answered stale, nor do nothing).
    pool, s = tenant
    assert pool.set_limit("t", 2 * PCB, revision=2**53) == "applied"
    wait_until(lambda: s.limit_setting() == (2 * PCB, 2**53), "the tenant sees the last revision")
    with pytest.raises(ValueError, match="revision"):
        pool.set_limit("t", 3 * PCB)
    with pytest.raises(ValueError, match="revision"):
        s.set_limit(None)
    assert s.limit_setting() == (2 * PCB, 2**53)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reserve_thread", [False, True])
def test_the_tenants_own_next_change_applies_right_after_an_operators(
    reserve_thread: bool, pool_name: str
) -> None:
    pool = Pool(pool_name, capacity=16 * PCB)
    with KVSpace(G, pool=pool, name="t", reserve_thread=reserve_thread, reserve=(0, 0)) as s:
        lost = 0
        for i in range(1, 51):
            assert pool.set_limit("t", 4 * PCB, revision=10 * i) == "applied"
            s.set_limit(None)  # the next revision after the operator's: must apply
            lost += pool.tenants()[0].limit_bytes is not None
        assert lost == 0, f"{lost} of 50 KVSpace.set_limit(None) calls returned and changed nothing"
