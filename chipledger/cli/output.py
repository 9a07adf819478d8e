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
MAX_PIPE_WIDTH = 400  # columns of a table written to a pipe or file (no terminal to fit): wide, not folded


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
        for c in columns:
            table.add_column(c, overflow="fold")
        for r in shown:
            table.add_row(*("" if v is None else (f"{v:,.3f}" if isinstance(v, float) else str(_plain(v))) for v in r))
        if console.is_terminal:
            console.print(table)
        else:  # a pipe or a file: as wide as the table needs (up to a bound) rather than folded into 80 columns
            natural = console.measure(table, options=console.options.update_width(MAX_PIPE_WIDTH)).maximum
            width = min(MAX_PIPE_WIDTH, max(console.width, natural))
            Console(file=console.file, width=width, no_color=console.no_color, highlight=False).print(table)
        if len(shown) < len(rows):
            console.print(f"({len(rows) - len(shown):,} more row(s) not shown, {len(rows):,} in all: --limit N or "
                          "--limit 0 for more, or --format csv|json|ndjson for every row)", highlight=False)
