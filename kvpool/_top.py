"""What ``kvpool top`` shows: a pool snapshot and its table (torch-free).

A snapshot is plain data (the JSON of ``top --once --json``); the table is
drawn from it. Columns are a table of their own (:data:`COLUMNS`): a tenant
field that :class:`~kvpool.pool.TenantInfo` does not have yet
(``guarantee_bytes`` before the fair-share ledger) leaves its column out;
adding a column is one row.

Tenant names are what ``kvpool limit`` needs, so they are never cut at the
end: when the table is wider than the terminal, names lose characters from
the middle (``vllm-serve-a…-12345``), keeping the start and the identifying
end, and a note says where the whole names are. Every name goes in as
:class:`rich.text.Text`, never as markup, so a ``[`` in a name is just a
character.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .pool import Pool, TenantInfo

MiB = 1 << 20
# The fields this ledger's tenants have: a column whose field is not among them is left out.
_FIELDS = frozenset(f.name for f in dataclasses.fields(TenantInfo))
MIN_NAME = 12  # below this a shortened name no longer says which tenant it is


def snapshot(pool: Pool) -> dict[str, Any]:
    """The pool's figures and live tenants, read now (dead tenants are reaped first)."""
    tenants = pool.tenants()  # reaps first, so committed below is live-only
    return {"pool": pool.name, "capacity": pool.capacity, "committed": pool.committed,
            "tenants": [dataclasses.asdict(t) for t in tenants]}


def fmt_mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def _limit_status(t: dict[str, Any]) -> Text:
    state = str(t["limit_state"])
    return Text(state, style="" if state == "applied" else "yellow")


# (header, the tenant field it needs, its cell): one row per column after TENANT.
COLUMNS: tuple[tuple[str, str, Callable[[dict[str, Any]], str | Text]], ...] = (
    ("PID", "pid", lambda t: str(t["pid"])),
    ("COMMITTED", "committed_bytes", lambda t: fmt_mib(t["committed_bytes"])),
    ("LIMIT", "limit_bytes", lambda t: fmt_mib(t["limit_bytes"])),
    ("STATUS", "limit_state", _limit_status),  # of the limit: applied, or deferred while use is above it
    ("GUARANTEE", "guarantee_bytes", lambda t: fmt_mib(t["guarantee_bytes"])),
    ("BORROWED", "borrowed_bytes", lambda t: fmt_mib(t["borrowed_bytes"])),
    ("WAITING", "waiting", lambda t: str(t["waiting"])),
    ("IDLE PAGES", "reserve_pages", lambda t: str(t["reserve_pages"])),
)


def shorten_middle(name: str, width: int) -> str:
    """``name`` in at most ``width`` characters: head … tail, the tail (the identifying end) kept longer."""
    if len(name) <= width:
        return name
    keep = max(width, 3) - 1  # characters kept around the "…"
    head = keep // 2
    tail = keep - head  # the end gets the odd character
    return f"{name[:head]}…{name[len(name) - tail:]}"


def _build(snap: dict[str, Any], names: list[str]) -> Table:
    cap, used = snap["capacity"], snap["committed"]
    pct = 100.0 * used / cap if cap else 0.0
    table = Table(
        title=(f"pool [bold]{escape(snap['pool'])}[/bold]: {fmt_mib(used)} / {fmt_mib(cap)} MiB committed "
               f"({pct:.1f}%), {len(snap['tenants'])} tenants; sizes in MiB"),
        # Two spaces between columns and none at the edges: the eight columns and a
        # 17-character name fit 80 columns.
        title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True,
    )
    table.add_column("TENANT", no_wrap=True)
    present = [c for c in COLUMNS if c[1] in _FIELDS]
    for header, _key, _cell in present:
        table.add_column(header, justify="left" if header == "STATUS" else "right", no_wrap=True)
    for t, name in zip(snap["tenants"], names):
        table.add_row(Text(name), *(cell(t) for _h, _k, cell in present))
    return table


def render(snap: dict[str, Any], console: Console) -> RenderableType:
    """The table for this console's width: whole names when they fit, else shortened in the middle."""
    names = [str(t["name"]) for t in snap["tenants"]]
    table = _build(snap, names)
    longest = max(map(len, names), default=0)
    natural = console.measure(table, options=console.options.update_width(1 << 16)).maximum  # unconstrained
    excess = natural - console.width
    if excess <= 0 or longest <= MIN_NAME:
        return table
    width = max(MIN_NAME, longest - excess)
    short = [shorten_middle(n, width) for n in names]
    if short == names:
        return table
    note = Text("names shortened to fit: `kvpool top --once --json` shows them whole", style="dim")
    return Group(_build(snap, short), note)
