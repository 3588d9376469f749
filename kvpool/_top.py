"""What ``kvpool top`` shows: a pool snapshot and its table (torch-free).

A snapshot is plain data (the JSON of ``top --once --json``): every field of
:class:`~kvpool.pool.TenantInfo` per tenant, read in one pass of the ledger.
The table is drawn from it. Columns are a table of their own
(:data:`COLUMNS`): a column whose tenant field this ledger does not have is
left out, and adding a column is one row.

Fitting a terminal. Tenant names are what ``kvpool limit`` needs, so they
are never cut at the end. When the whole table is wider than the terminal:
names lose characters from the middle (``vllm-serve-a…-12345``: the start
and the identifying end stay), down to :data:`SOFT_NAME` characters; then
columns are left out, least telling first (:data:`DROP_ORDER`); then names
shrink to :data:`MIN_NAME`. A note under the table says what was shortened
or left out, and that ``--once --json`` has everything. Every name (of a tenant
or of the pool) goes in as :class:`rich.text.Text`, never as markup, so a
``[`` in a name is just a character.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from ._sizes import format_size
from .pool import Pool, TenantInfo

# The fields this ledger's tenants have: a column whose field is not among them is left out.
_FIELDS = frozenset(f.name for f in dataclasses.fields(TenantInfo))
SOFT_NAME = 20  # names shrink to this before any column is left out
MIN_NAME = 12  # below this a shortened name no longer says which tenant it is


def snapshot(pool: Pool) -> dict[str, Any]:
    """The pool's figures and live tenants from one read (dead tenants are reaped first)."""
    pool.reap()
    snap = pool.snapshot()  # committed is the sum of these very rows
    return {"pool": pool.name, "capacity": snap.capacity, "committed": snap.committed,
            "tenants": [dataclasses.asdict(t) for t in snap.tenants]}


def fmt_size(n: int | None) -> str:
    return "-" if n is None else format_size(n)


def _state(t: dict[str, Any]) -> Text:
    """What the tenant is doing about memory, when it is not simply running."""
    words = []
    if t.get("lending"):
        words.append("lending")  # gives memory back: a tenant below its guarantee is waiting
        if t.get("preempt_bytes"):
            words.append("preempting")  # completions will not cover the waiter's need in time
    if t.get("limit_state", "applied") != "applied":
        words.append("deferred")  # above a new limit: no growth, pages go back as they empty
    return Text(",".join(words) or "-", style="yellow" if words else "")


@dataclasses.dataclass(frozen=True)
class Column:
    header: str
    field: str  # the tenant field it shows (the column exists only if TenantInfo has it)
    cell: Callable[[dict[str, Any]], str | Text]
    justify: str = "right"


# One row per column after TENANT, in display order.
COLUMNS: tuple[Column, ...] = (
    Column("PID", "pid", lambda t: str(t["pid"])),
    Column("COMMITTED", "committed_bytes", lambda t: fmt_size(t.get("committed_bytes"))),
    Column("GUARANTEE", "guarantee_bytes", lambda t: fmt_size(t.get("guarantee_bytes"))),
    Column("BORROWED", "borrowed_bytes", lambda t: fmt_size(t.get("borrowed_bytes"))),
    Column("LIMIT", "limit_bytes", lambda t: fmt_size(t.get("limit_bytes"))),
    Column("WAITING", "waiting", lambda t: str(t.get("waiting", "-"))),
    Column("IDLE PAGES", "reserve_pages", lambda t: str(t.get("reserve_pages", "-"))),
    Column("STATE", "limit_state", _state, justify="left"),
)
# Left out first when the terminal is too narrow (the rest: PID, COMMITTED, LIMIT, WAITING).
DROP_ORDER = ("IDLE PAGES", "BORROWED", "STATE", "GUARANTEE")


def shorten_middle(name: str, width: int) -> str:
    """``name`` in at most ``width`` characters: head … tail, the tail (the identifying end) kept longer."""
    if len(name) <= width:
        return name
    keep = max(width, 3) - 1  # characters kept around the "…"
    head = keep // 2
    tail = keep - head  # the end gets the odd character
    return f"{name[:head]}…{name[len(name) - tail:]}"


def _title(snap: dict[str, Any]) -> Text:
    """The pool line above the table (its own line: a table title would wrap at the table's width)."""
    cap, used = snap["capacity"], snap["committed"]
    pct = 100.0 * used / cap if cap else 0.0
    return Text.assemble("pool ", (str(snap["pool"]), "bold"),
                         f": {fmt_size(used)} of {fmt_size(cap)} committed ({pct:.1f}%), "
                         f"{len(snap['tenants'])} tenants")


def _build(snap: dict[str, Any], names: Sequence[str], columns: Sequence[Column]) -> Table:
    # Two spaces between columns and none at the edges.
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    table.add_column("TENANT", no_wrap=True)
    for c in columns:
        table.add_column(c.header, justify="left" if c.justify == "left" else "right", no_wrap=True)
    for t, name in zip(snap["tenants"], names):
        table.add_row(Text(name), *(c.cell(t) for c in columns))
    return table


def render(snap: dict[str, Any], console: Console) -> RenderableType:
    """The table for this console's width (see the module's notes on fitting)."""
    full = [str(t["name"]) for t in snap["tenants"]]
    columns = [c for c in COLUMNS if c.field in _FIELDS]
    longest = max(map(len, full), default=0)

    def excess(names: Sequence[str], cols: Sequence[Column]) -> int:
        table = _build(snap, names, cols)
        natural = console.measure(table, options=console.options.update_width(1 << 16)).maximum
        return natural - console.width

    width = longest
    over = excess(full, columns)
    if over > 0:
        width = max(min(longest, SOFT_NAME), longest - over)
        drop = [h for h in DROP_ORDER if any(c.header == h for c in columns)]
        while excess([shorten_middle(n, width) for n in full], columns) > 0 and drop:
            gone = drop.pop(0)
            columns = [c for c in columns if c.header != gone]
        over = excess([shorten_middle(n, width) for n in full], columns)
        if over > 0:
            width = max(MIN_NAME, width - over)
    names = [shorten_middle(n, width) for n in full]
    parts: list[RenderableType] = [_title(snap), _build(snap, names, columns)]
    notes = []
    if names != full:
        notes.append("names shortened")
    hidden = [c.header for c in COLUMNS if c.field in _FIELDS and c not in columns]
    if hidden:
        notes.append(f"{', '.join(hidden)} left out")
    if notes:
        parts.append(Text(f"{'; '.join(notes)}: see `kvpool top --once --json`", style="dim"))
    return Group(*parts)
