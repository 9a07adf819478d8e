"""`chipledger sql`, `lake upgrade|cache` and `schema export`: the lake and the contract, for SQL and for producers."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
import typer.core

from chipledger.cli._common import ConfigOpt, _config, _connect, _fail, _lake_dir, _os_error, app, console, err, lake_app, schema_app


@app.command()
def sql(
    query: Optional[str] = typer.Argument(None, help="SQL over the lake views (journal, events, jobs, job_runs, "
                                                     "error_budget, …); none: read SQL from standard input"),
    lake: Optional[Path] = typer.Option(None, "--lake", help="lake folder (default [lake] path = ./lake)"),
    fmt: str = typer.Option("table", "--format", "-f", help="table | csv | json | ndjson"),
    limit: int = typer.Option(100, "--limit", min=0, help="rows a table shows (0: all); csv, json and ndjson "
                                                         "are never cut"),
    config: Optional[Path] = ConfigOpt,
):
    """Run SQL with DuckDB over the lake's views; without a query, an interactive shell (until .quit or end of
    input; statements end with ';'). Quote the column "at" (a DuckDB keyword): ORDER BY "at"."""
    import duckdb

    from analytics.views import connect, view_names
    from chipledger.cli.output import FORMATS, render
    from chipledger.cli._common import _demo_lake

    lake = _demo_lake(lake, config)

    if fmt not in FORMATS:
        _fail(f"--format must be one of {', '.join(FORMATS)}", 2)
    cfg = _config(config)
    con = _connect(_lake_dir(lake, cfg), slo=cfg.slo, config=cfg.lake.duckdb_config())
    if query is None:
        from chipledger.cli.sqlshell import run_shell

        failures = run_shell(con, sys.stdin, console, err, fmt, view_names(), limit=limit)
        if failures and not sys.stdin.isatty():
            raise typer.Exit(1)
        return
    if query.lstrip().startswith("."):  # a shell command as the argument: `chipledger sql .tables`, `.schema jobs`
        import io

        from chipledger.cli.sqlshell import run_shell

        if run_shell(con, io.StringIO(query.strip() + "\n"), console, err, fmt, view_names(), limit=limit):
            raise typer.Exit(1)
        return
    try:
        cur = con.execute(query)
        rows = cur.fetchall()
        columns = [d[0] for d in cur.description] if cur.description else []
    except duckdb.Error as e:
        from analytics.views import duckdb_error_line

        line, out_of_memory = duckdb_error_line(e)
        _fail(f"query failed: {line}" if out_of_memory else f"query failed: {e}")
    render(columns, rows, fmt, console, limit=limit)


@lake_app.command("upgrade")
def lake_upgrade(
    lake: Optional[Path] = typer.Option(None, "--lake", help="the lake's folder (default [lake] path)"),
    config: Optional[Path] = ConfigOpt,
):
    """Bring a lake written by an earlier chipledger up to this version's tables, in place: `events` files gain
    the typed event fields they lack (all of them, or the later `user`), taken from each row's JSON body, and the
    fact tables the fold now writes (`waits`, `free_chips`) are written by folding the lake's events again (with
    this config's [ledger] and [policy]). Safe to run again, and while readers are open."""
    from analytics.lake import LakeError, upgrade_events_files
    from chipledger.config import fold_config
    from chipledger.refold import missing_fact_tables, refold_facts

    cfg = _config(config)
    root = lake or Path(cfg.lake.path)
    if not root.is_dir():
        _fail(f"no lake at {root}", 2)
    try:
        done = upgrade_events_files(root)
    except LakeError as e:
        _fail(str(e), 1)
    for p in done:
        typer.echo(str(p))
    missing = missing_fact_tables(root)
    if done:
        typer.echo(f"{len(done)} events file(s) upgraded in {root}", err=True)
    if missing:
        try:
            out = refold_facts(root, fold_config(cfg), tables=missing)
        except (OSError, ValueError) as e:
            _fail(f"{root}: could not fold the lake's events again: {e}", 1)
        rows = ", ".join(f"{t} {n:,} rows" for t, n in out["rows"].items())
        typer.echo(f"folded {out['events']:,} events again: {rows}", err=True)
        if out["rejected"]:
            typer.echo(f"warning: {sum(out['rejected'].values()):,} events of the lake were not applied this time "
                       f"({out['rejected']}): written by another version of the core?", err=True)
    if not done and not missing:
        typer.echo(f"{root}: nothing to upgrade", err=True)


@lake_app.command("cache")
def lake_cache(
    lake: Optional[Path] = typer.Option(None, "--lake", help="the lake's folder (default [lake] path)"),
    config: Optional[Path] = ConfigOpt,
    as_json: bool = typer.Option(False, "--json", help='print {"state": "retired", "removed": path or null}'),
):
    """Retired: the views answer from the fold's facts without a cache (docs/analytics.md). Removes the cache
    folder an earlier version left in the lake (LAKE/_cache), if any."""
    import shutil

    root = lake or Path(_config(config).lake.path)
    if not root.is_dir():
        _fail(f"no lake at {root}", 2)
    old = root / "_cache"
    removed = old.exists()
    if removed:
        shutil.rmtree(old, ignore_errors=True)
    if as_json:
        typer.echo(json.dumps({"state": "retired", "removed": str(old) if removed else None}))
        return
    if removed:
        typer.echo(f"removed {old}, the analytics cache of an earlier version", err=True)
    typer.echo("the analytics cache is retired: every view is an aggregation of the lake's rows and the fold's facts "
               "and needs no cache (a lake without the fact tables: `chipledger lake upgrade`)", err=True)


@schema_app.command("export")
def schema_export(out: Path = typer.Argument(..., help="folder to write one JSON Schema file per type into")):
    """Write one JSON Schema per event, decision and dead-letter type, for producers in other languages."""
    from schemas.export import export_json_schemas

    try:
        written = export_json_schemas(out)
    except OSError as e:
        _fail(f"cannot write the schemas into {out} (a folder): {_os_error(e)}")
    for p in written:
        console.print(str(p))
