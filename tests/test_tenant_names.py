"""D10: tenant names follow the pool-name rule, and no two live tenants share one (issue 10).

On 884d081 tenant names were not validated: a non-ASCII name over 63 bytes
was cut inside a UTF-8 sequence in its ledger slot (then Pool.tenants(),
`kvpool top` and `kvpool pools` raised UnicodeDecodeError while it lived),
two 100-byte names truncated to the same 63 bytes passed the duplicate check,
and rich markup in a name crashed `kvpool top` (tenant_name_breaks_cli.py).
Now a name is `[A-Za-z0-9][A-Za-z0-9._-]{0,63}` or refused before anything
is registered; registration is a CAS on the slot and a twin check after
publishing, so two racing processes never both win a name.
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest

from kvpool import KVCacheManager, KVSpace, LedgerError, Pool

from . import _ledger_layout as L
from ._helpers import wait_until
from ._hostile import G, Child, children

__all__ = ["children"]

BAD_NAMES = [
    pytest.param("a" * 65, id="65-bytes"),
    pytest.param("é" * 40, id="80-bytes-of-utf8"),
    pytest.param("é", id="non-ascii"),
    pytest.param("[/x]", id="rich-closing-tag"),
    pytest.param("[bold]x[/bold]", id="rich-markup"),
    pytest.param("with space", id="space"),
    pytest.param("", id="empty"),
    pytest.param(".hidden", id="leading-dot"),
    pytest.param("-x", id="leading-dash"),
    pytest.param("nul\x00x", id="nul"),
    pytest.param("a/b", id="slash"),
    pytest.param("tab\tx", id="tab"),
]


def nothing_registered(pool: Pool) -> None:
    assert pool.tenants() == [] and pool.committed == 0
    assert all(t.pid == 0 and t.live == 0 for t in L.read(pool.name).tenants)  # no slot taken, not even for a moment left


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad", BAD_NAMES)
def test_a_bad_tenant_name_is_refused_naming_the_rule_and_registers_nothing(bad: str, pool_name: str) -> None:
    pool = Pool(pool_name, capacity=1 << 20)
    with pytest.raises(LedgerError, match=r"bad tenant name.*\[A-Za-z0-9\._-\]"):
        KVSpace(G, pool=pool, name=bad, reserve_thread=False, reserve=(0, 0))
    nothing_registered(pool)
    with pytest.raises(LedgerError, match=r"bad tenant name"):
        KVCacheManager(G, pool=pool, name=bad, reserve_thread=False, reserve=(0, 0))
    nothing_registered(pool)


@pytest.mark.timeout(120)
def test_a_64_byte_name_is_kept_whole_and_addressable(pool_name: str) -> None:
    # On 884d081 it was cut to 63 bytes: `kvpool limit POOL <name>` found no tenant.
    pool = Pool(pool_name, capacity=1 << 20)
    name = "n" * 63 + "z"
    with KVSpace(G, pool=pool, name=name, reserve_thread=False, reserve=(0, 0)) as s:
        assert [t.name for t in pool.tenants()] == [name]
        assert pool.set_limit(name, 4 * G.page_commit_bytes) == "applied"
        wait_until(lambda: s.limit_setting()[0] == 4 * G.page_commit_bytes, "the tenant sees its limit")
        # One byte less is another tenant, not a duplicate; the same 64 bytes are.
        with KVSpace(G, pool=pool, name=name[:63], reserve_thread=False, reserve=(0, 0)):
            with pytest.raises(LedgerError, match="already has a live tenant"):
                KVSpace(G, pool=pool, name=name, reserve_thread=False, reserve=(0, 0))
            assert sorted(t.name for t in pool.tenants()) == sorted([name, name[:63]])


@pytest.mark.timeout(900)
def test_two_processes_racing_for_one_name_never_both_win(
    pool_name: str, children: Callable[..., Child], tmp_path: pathlib.Path
) -> None:
    # 2 processes x 50 rounds, released together by a barrier in shared memory:
    # in every round exactly one registers the name and the other is refused
    # as a duplicate (never both: two live twins; never neither: a name lost
    # to the race), and the winner sees one tenant of that name.
    rounds = 50
    Pool(pool_name, capacity=1 << 20)
    ctl_path = tmp_path / "ctl"
    ctl_path.write_bytes(bytes(64 + 3 * rounds))
    racers = [children("register", pool_name, "twin", str(rounds), str(ctl_path), str(i)) for i in (0, 1)]
    for r in racers:
        r.ready()
    for r in racers:
        assert r.json("its end") == {"done": rounds}
    ctl = mmap.mmap(os.open(ctl_path, os.O_RDONLY), 0, prot=mmap.PROT_READ)
    outcomes = [(ctl[64 + 2 * r], ctl[64 + 2 * r + 1]) for r in range(rounds)]
    bad = [(r, o) for r, o in enumerate(outcomes) if sorted(o) != [1, 2]]
    assert not bad, f"rounds where not exactly one won (1 won, 2 duplicate, 3 other error): {bad}"
    assert all(ctl[64 + 2 * rounds + r] == 1 for r in range(rounds))
    assert Pool(pool_name).tenants() == []


@pytest.mark.timeout(300)
def test_a_tenant_in_the_middle_of_registering_is_not_reaped(pool_name: str) -> None:
    # The state of a slot between register_tenant's pid CAS and its
    # start_time store, made by hand: the slot was used and freed before (it
    # keeps that tenant's pidns and start time), and a live process of this
    # namespace has just CASed its pid in.
    pool = Pool(pool_name, capacity=1 << 20)
    with KVSpace(G, pool=pool, name="before", reserve_thread=False, reserve=(0, 0)):
        slot = L.slot_of(pool_name, "before")
    old = L.read(pool_name).tenants[slot]
    assert old.pid == 0 and old.live == 0
    registrant = subprocess.Popen(["sleep", "1000"])  # alive throughout, started after this process
    try:
        # A freed slot no longer keeps its last tenant's identity; put a stale
        # one back by hand (this namespace, an older start time), as a slot
        # caught between the pid CAS and the start-time store would look.
        base = L.slot_offset(slot)
        L.write_at(pool_name, base + L.TenantSlot.pidns.offset, os.stat("/proc/self/ns/pid").st_ino.to_bytes(8, "little"))
        L.write_at(pool_name, base + L.TenantSlot.start_time.offset, (1).to_bytes(8, "little"))
        L.write_at(pool_name, base, registrant.pid.to_bytes(4, "little", signed=True))
        assert pool.reap() == 0
        assert L.read(pool_name).tenants[slot].pid == registrant.pid  # still the registrant's slot
    finally:
        registrant.send_signal(signal.SIGKILL)
        registrant.wait()
        L.write_at(pool_name, L.slot_offset(slot), bytes(4))



# --------------------------------------------------- names in error messages
#
# On the old code a bad (user-supplied) name went into the error message raw
# and whole: a terminal escape in it drove the terminal that printed
# `kvpool limit`'s error, and a 100 kB name made a 100 kB message. Now every
# message quotes a name repr-style (non-printable bytes escaped) and cuts it
# after 80 characters, naming its length.

HOSTILE = "\x1b[2J\x1b]0;owned\x07" + "n" * 5000  # clear screen, set the title, then a flood


def assert_quoted_safely(message: str, name: str = HOSTILE) -> None:
    assert "\x1b" not in message and "\x07" not in message, f"a raw control character in {message!r}"
    assert "\\x1b[2J" in message  # escaped, still recognisable
    assert len(message) < 400, f"a {len(message)}-character message for a {len(name)}-character name"
    assert str(len(name.encode())) in message or str(len(name)) in message  # the length is named


@pytest.mark.timeout(120)
def test_a_bad_tenant_name_is_quoted_escaped_and_cut_in_the_error(pool_name: str) -> None:
    pool = Pool(pool_name, capacity=1 << 20)
    with pytest.raises(LedgerError, match="bad tenant name") as e:
        KVSpace(G, pool=pool, name=HOSTILE, reserve_thread=False, reserve=(0, 0))
    assert_quoted_safely(str(e.value))
    nothing_registered(pool)


@pytest.mark.timeout(120)
def test_an_unknown_tenant_in_a_limit_is_quoted_escaped_and_cut(pool_name: str) -> None:
    pool = Pool(pool_name, capacity=1 << 20)
    with pytest.raises(LedgerError, match="has no tenant") as e:
        pool.set_limit(HOSTILE, 1 << 16)
    assert_quoted_safely(str(e.value))
    # The operator's path: `kvpool limit POOL NAME SIZE` prints it on stderr.
    p = subprocess.run([sys.executable, "-m", "kvpool.cli", "limit", pool_name, HOSTILE, "64K"],
                       capture_output=True, text=True, timeout=120, cwd="/")
    assert p.returncode == 2 and "has no tenant" in p.stderr
    assert_quoted_safely(p.stderr)


@pytest.mark.timeout(120)
def test_a_bad_pool_name_is_quoted_escaped_and_cut_in_the_error() -> None:
    with pytest.raises(LedgerError, match="bad pool name") as e:
        Pool(HOSTILE, capacity=1 << 20)
    assert_quoted_safely(str(e.value))


# ------------------------------------------------ corrupt names in the ledger
#
# A slot whose stored name is not a valid name (a corrupted segment, a
# hostile writer) was shown as its bytes with each bad one turned into '?':
# 71 '?' for a slot of junk, every such slot alike, and unreadable in
# `kvpool top`. Now it reads "?slot<N>", plus ":<prefix>" when it starts with
# name characters.


def corrupt_name(pool: str, slot: int, raw: bytes) -> None:
    L.write_at(pool, L.slot_offset(slot) + L.TenantSlot.name.offset, raw.ljust(L.NAME_BYTES, b"\0"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("raw", "shown"), [
    pytest.param(b"\xff" * L.NAME_BYTES, "?slot{slot}", id="junk-without-nul"),
    pytest.param(b"\xe9\x00", "?slot{slot}", id="non-ascii"),
    pytest.param(b"vllm-engine-a\xff\xfe[/x]", "?slot{slot}:vllm-engine-a", id="a-readable-prefix"),
    pytest.param(b"q" * 40 + b"\x1b[2J", "?slot{slot}:" + "q" * 16, id="a-long-prefix-cut"),
    pytest.param(b"x" * L.NAME_BYTES, "?slot{slot}:" + "x" * 16, id="too-long-to-be-valid"),
])
def test_a_corrupt_name_in_a_slot_reads_short_and_recognisable(raw: bytes, shown: str, pool_name: str) -> None:
    pool = Pool(pool_name, capacity=1 << 20)
    with KVSpace(G, pool=pool, name="neighbour", reserve_thread=False, reserve=(0, 0)), \
            KVSpace(G, pool=pool, name="victim", reserve_thread=False, reserve=(0, 0)):
        slot = L.slot_of(pool_name, "victim")
        try:
            corrupt_name(pool_name, slot, raw)
            expected = shown.format(slot=slot)
            assert sorted(t.name for t in pool.tenants()) == sorted(["neighbour", expected])
            # `kvpool top` shows the same row, and a valid name can never equal it.
            p = subprocess.run([sys.executable, "-m", "kvpool.cli", "top", pool_name, "--once", "--json"],
                               capture_output=True, text=True, timeout=120, cwd="/")
            assert p.returncode == 0, p.stderr
            assert expected in {t["name"] for t in json.loads(p.stdout)["tenants"]}
            with pytest.raises(LedgerError, match="bad tenant name"):
                KVSpace(G, pool=pool, name=expected, reserve_thread=False, reserve=(0, 0))
        finally:
            corrupt_name(pool_name, slot, b"victim")  # so that the slot unregisters as itself


@pytest.mark.timeout(120)
def test_two_corrupt_slots_do_not_look_alike(pool_name: str) -> None:
    pool = Pool(pool_name, capacity=1 << 20)
    with KVSpace(G, pool=pool, name="one", reserve_thread=False, reserve=(0, 0)), \
            KVSpace(G, pool=pool, name="two", reserve_thread=False, reserve=(0, 0)):
        slots = {n: L.slot_of(pool_name, n) for n in ("one", "two")}
        try:
            for slot in slots.values():
                corrupt_name(pool_name, slot, b"\xff" * 8)
            names = [t.name for t in pool.tenants()]
            assert sorted(names) == sorted(f"?slot{s}" for s in slots.values()) and len(set(names)) == 2
        finally:
            for n, slot in slots.items():
                corrupt_name(pool_name, slot, n.encode())
