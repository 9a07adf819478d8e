"""Rendering query results for people (rich tables) and for programs (CSV, JSON)."""

from __future__ import annotations

import csv
import io
import json
from datetime import date, datetime
from decimal import Decimal
from typing import Sequence

from rich.console import Console
from rich.table import Table

FORMATS = ("table", "csv", "json", "ndjson")
TABLE_LIMIT = 100  # rows a table shows by default: a person reads a table, a program reads csv/json/ndjson
from chipledger.reports.tables import MAX_PIPE_WIDTH, CliConsole, id_column, print_table  # noqa: F401


def _plain(v):
    if isinstance(v, datetime):
        return v.isoformat().replace("+00:00", "Z")
    if isinstance(v, date):
        return v.isoformat()
    if isinstance(v, Decimal):
        return float(v)
    return v


def render(columns: Sequence[str], rows: Sequence[Sequence], fmt: str, console: Console, title: str | None = None,
           limit: int | None = TABLE_LIMIT):
    """Rows as a table (at most `limit` rows, None or 0: all, with a note of the rows not shown), CSV, JSON
    (one array) or NDJSON (one object per line); CSV, JSON and NDJSON are never cut."""
    if fmt == "json":
        console.file.write(json.dumps([{c: _plain(v) for c, v in zip(columns, r)} for r in rows], indent=None) + "\n")
    elif fmt == "ndjson":
        write = console.file.write
        for r in rows:
            write(json.dumps({c: _plain(v) for c, v in zip(columns, r)}) + "\n")
    elif fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(columns)
        for r in rows:
            w.writerow(["" if v is None else _plain(v) for v in r])
        console.file.write(buf.getvalue())
    else:
        shown = rows[:limit] if limit else rows
        table = Table(title=title, show_lines=False)
        for c, cells in zip(columns, zip(*shown) if shown else [()] * len(columns)):
            # text with spaces may wrap at a space; ids and numbers never wrap
            if any(isinstance(v, str) and " " in v for v in cells):
                table.add_column(c, overflow="fold")
            else:
                id_column(table, c, right=any(isinstance(v, (int, float, Decimal)) for v in cells))
        for r in shown:
            table.add_row(*("" if v is None else (f"{v:,.3f}" if isinstance(v, (float, Decimal)) else str(_plain(v)))
                            for v in r))
        print_table(table, console)
        if len(shown) < len(rows):
            console.print(f"({len(rows) - len(shown):,} more row(s) not shown, {len(rows):,} in all: --limit N or "
                          "--limit 0 for more, or --format csv|json|ndjson for every row)", highlight=False)
