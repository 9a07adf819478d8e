"""The interactive side of `chipledger sql`: a small shell reading SQL until `.quit` or end of input.

A statement runs when its line ends with `;` (so it may span lines); what is left at end of input runs too.
Dot commands, alone on a line: `.tables` (the views), `.format table|csv|json`, `.help`, `.quit` / `.exit`.
A failing statement prints its error and the shell goes on; the count of failures is returned so a script fed
on standard input can exit non-zero.
"""

from __future__ import annotations

from typing import TextIO

import duckdb
from rich.console import Console
from rich.markup import escape

from chipledger.output import FORMATS, render

HELP = ("SQL over the lake views; end a statement with ';'. Commands: .tables  .format table|csv|json  "
        ".help  .quit")


def run_shell(con: duckdb.DuckDBPyConnection, inp: TextIO, out: Console, err: Console, fmt: str = "table",
              views: list[str] | None = None, limit: int | None = 100) -> int:
    interactive = inp.isatty()
    if interactive:
        out.print(HELP, highlight=False)
    failures = 0
    buf: list[str] = []

    def execute(text: str) -> None:
        nonlocal failures
        try:
            statements = con.extract_statements(text)
        except duckdb.Error as e:
            failures += 1
            err.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
            return
        for st in statements:
            try:
                cur = con.execute(st)
                rows = cur.fetchall()
                columns = [d[0] for d in cur.description] if cur.description else []
            except duckdb.Error as e:
                failures += 1
                err.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
                continue
            if columns:
                render(columns, rows, fmt, out, limit=limit)

    while True:
        if interactive:
            out.print("chipledger> " if not buf else "       ...> ", end="")
        line = inp.readline()
        if not line:  # end of input
            break
        stripped = line.strip()
        if not buf and stripped.startswith("."):
            cmd, _, arg = stripped.partition(" ")
            if cmd in (".quit", ".exit"):
                break
            if cmd == ".help":
                out.print(HELP, highlight=False)
            elif cmd == ".tables":
                out.print("  ".join(views or []), highlight=False, soft_wrap=True)
            elif cmd == ".format" and arg.strip() in FORMATS:
                fmt = arg.strip()
            else:
                failures += 1
                err.print(f"[red]error:[/] unknown command {escape(stripped)!s} ({HELP})", soft_wrap=True)
            continue
        if not stripped and not buf:
            continue
        buf.append(line)
        if stripped.endswith(";"):
            execute("".join(buf))
            buf.clear()
    if "".join(buf).strip():
        execute("".join(buf))
    return failures
