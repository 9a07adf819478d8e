"""The interactive side of `chipledger sql`: a small shell reading SQL until `.quit` or end of input.

A statement runs when its line ends with `;` (so it may span lines); what is left at end of input runs too.
Dot commands, alone on a line: `.tables` (the views), `.schema NAME` (a view's columns and types),
`.format table|csv|json|ndjson`, `.help`, `.quit` / `.exit`. On a terminal, lines are edited with readline
(arrows, Ctrl-R) and kept in a history file ($CHIPLEDGER_SQL_HISTORY, default ~/.chipledger_sql_history,
the last HISTORY_LINES). A failing statement prints its error and the shell goes on; the count of failures is
returned so a script fed on standard input can exit non-zero.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO

import duckdb
from rich.console import Console
from rich.markup import escape

from analytics.views import duckdb_error_line, refusal_line
from chipledger.cli.output import FORMATS, render

HELP = ("SQL over the lake views; end a statement with ';'. Commands: .tables  .schema NAME  "
        ".format table|csv|json|ndjson  .help  .quit")
HISTORY_LINES = 1000


def history_path() -> Path:
    return Path(os.environ.get("CHIPLEDGER_SQL_HISTORY") or Path.home() / ".chipledger_sql_history")


def _readline():
    """The readline module with the history loaded, or None (no readline on this platform)."""
    try:
        import readline
    except ImportError:  # pragma: no cover - Windows without pyreadline
        return None
    try:
        readline.read_history_file(history_path())
    except OSError:
        pass  # no history yet
    readline.set_history_length(HISTORY_LINES)
    return readline


def run_shell(con: duckdb.DuckDBPyConnection, inp: TextIO, out: Console, err: Console, fmt: str = "table",
              views: list[str] | None = None, limit: int | None = 100) -> int:
    interactive = inp.isatty()
    rl = None
    if interactive:
        out.print(HELP, highlight=False)
        rl = _readline()
    failures = 0
    buf: list[str] = []

    def read(prompt: str) -> str:
        if rl is None:
            if interactive:
                out.print(prompt, end="")
            return inp.readline()
        try:
            return input(prompt) + "\n"  # readline: line editing and history
        except EOFError:
            return ""

    def schema(name: str) -> None:
        nonlocal failures
        if not name:
            failures += 1
            err.print("[red]error:[/] .schema NAME (one of .tables)", soft_wrap=True)
            return
        try:
            cur = con.execute(f'DESCRIBE "{name.replace(chr(34), chr(34) * 2)}"')
            rows = [(r[0], r[1]) for r in cur.fetchall()]
        except duckdb.Error:
            failures += 1
            err.print(f"[red]error:[/] no view or table {escape(name)!s} (see .tables)", soft_wrap=True)
            return
        render(["column", "type"], rows, fmt, out, limit=None)

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
                line, out_of_memory = duckdb_error_line(e)
                refused = refusal_line(e)
                err.print(f"[red]error:[/] {escape(refused or (line if out_of_memory else str(e)))}", soft_wrap=True)
                continue
            if columns:
                render(columns, rows, fmt, out, limit=limit)

    try:
        while True:
            line = read("chipledger> " if not buf else "       ...> ")
            if not line:  # end of input
                break
            stripped = line.strip()
            if not buf and stripped.startswith("."):
                cmd, _, arg = stripped.partition(" ")
                if cmd in (".quit", ".exit"):
                    break
                if cmd == ".help":
                    out.print(HELP, highlight=False)
                elif cmd == ".tables":  # the views a person queries; base_* and calc_* are the views' internals
                    out.print("  ".join(v for v in views or [] if not v.startswith(("base_", "calc_"))),
                              highlight=False, soft_wrap=True)
                elif cmd == ".schema":
                    schema(arg.strip())
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
    finally:
        if rl is not None:
            try:
                rl.write_history_file(history_path())
            except OSError:
                pass  # a read-only home: the session still worked
    if "".join(buf).strip():
        execute("".join(buf))
    return failures
