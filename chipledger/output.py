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

FORMATS = ("table", "csv", "json")


def _plain(v):
    if isinstance(v, datetime):
        return v.isoformat().replace("+00:00", "Z")
    if isinstance(v, date):
        return v.isoformat()
    if isinstance(v, Decimal):
        return float(v)
    return v


def render(columns: Sequence[str], rows: Sequence[Sequence], fmt: str, console: Console, title: str | None = None):
    if fmt == "json":
        console.file.write(json.dumps([{c: _plain(v) for c, v in zip(columns, r)} for r in rows], indent=None) + "\n")
    elif fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(columns)
        for r in rows:
            w.writerow(["" if v is None else _plain(v) for v in r])
        console.file.write(buf.getvalue())
    else:
        table = Table(title=title, show_lines=False)
        for c in columns:
            table.add_column(c, overflow="fold")
        for r in rows:
            table.add_row(*("" if v is None else (f"{v:,.3f}" if isinstance(v, float) else str(_plain(v))) for v in r))
        console.print(table)
