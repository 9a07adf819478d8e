"""`chipledger sql`, `lake upgrade|cache` and `schema export`: the lake and the contract, for SQL and for producers."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
import typer.core

from chipledger.cli._common import (ConfigOpt, _config, _connect, _fail, _lake_dir, _lake_error, _os_error, app,
                                   console, err, lake_app, schema_app)


@app.command()
def sql(
    query: Optional[str] = typer.Argument(None, help="SQL over the lake views (journal, events, jobs, job_runs, "
                                                     "error_budget, …); none: read SQL from standard input"),
    lake: Optional[Path] = typer.Option(None, "--lake", help="lake folder (default [lake] path = ./lake)"),
    fmt: str = typer.Option("table", "--format", "-f", help="table | csv | json | ndjson"),
    limit: int = typer.Option(100, "--limit", min=0, help="rows a table shows (0: all); csv, json and ndjson "
                                                         "are never cut"),
    allow_files: bool = typer.Option(False, "--allow-files",
                                     help="let DuckDB read and write files (COPY … TO, read_csv, ATTACH, …); by "
                                          "default it reads the lake's committed files and nothing else"),
    config: Optional[Path] = ConfigOpt,
):
    """Run SQL with DuckDB over the lake's views; without a query, an interactive shell (until .quit or end of
    input; statements end with ';'). Quote the column "at" (a DuckDB keyword): ORDER BY "at". The lake is read
    read-only: DuckDB's file access is off (COPY … TO, read_csv, ATTACH refused) unless --allow-files."""
    import duckdb

    from analytics.views import connect, view_names
    from chipledger.cli.output import FORMATS, render
    from chipledger.cli._common import _demo_lake

    lake = _demo_lake(lake, config)

    if fmt not in FORMATS:
        _fail(f"--format must be one of {', '.join(FORMATS)}", 2)
    cfg = _config(config)
    con = _connect(_lake_dir(lake, cfg), slo=cfg.slo, config=cfg.lake.duckdb_config(), read_only=not allow_files)
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
        from analytics.views import duckdb_error_line, refusal_line, unreadable_file

        line, out_of_memory = duckdb_error_line(e)
        refused = refusal_line(e)
        if refused:
            _fail(refused)
        if unreadable_file(e):
            _fail(_lake_error(_lake_dir(lake, cfg), e))
        _fail(f"query failed: {line}" if out_of_memory else f"query failed: {e}")
    render(columns, rows, fmt, console, limit=limit)


@lake_app.command("upgrade")
def lake_upgrade(
    lake: Optional[Path] = typer.Option(None, "--lake", help="the lake's folder (default [lake] path)"),
    config: Optional[Path] = ConfigOpt,
    as_json: bool = typer.Option(False, "--json", help="print what was done as JSON (events files upgraded, files "
                                                       "adopted per table, fact tables folded again)"),
    jobs: Optional[int] = typer.Option(None, "--jobs", min=1, help="processes folding disjoint sets of pools "
                                       "again (default: the machine's cores); the same rows whatever the number"),
):
    """Bring a lake written by an earlier chipledger up to this version's layout, in place: `events` files gain
    the typed event fields they lack (all of them, or the later `user`), taken from each row's JSON body; a lake
    written before commits (layout 1) is adopted: the Parquet files in its tables' folders become its books, in one
    commit (docs/upgrading.md); and the fact tables the fold now writes (`waits`, `free_chips`, `progress`,
    `chip_states`, `grant_intervals`, the price facts `prices`, `budgets`, `costs`, `run_costs`) that the lake lacks
    are written by folding its events again (with this config's [ledger] and [policy]), in one more commit. Safe to
    run again, and while readers are open."""
    from analytics.commits import LAYOUT_VERSION, adopt, lake_layout, open_lake, writing
    from analytics.lake import LakeError, upgrade_events_files
    from chipledger.config import fold_config
    from chipledger.embedded import cores
    from chipledger.refold import REFOLDABLE, missing_fact_tables, refold_facts

    cfg = _config(config)
    root = lake or Path(cfg.lake.path)
    if not root.is_dir():  # a missing lake is exit 1 here as in every command (docs/cli.md, "Exit codes")
        _fail(f"no lake at {root}", 1)
    try:
        with writing(root, "chipledger lake upgrade"):
            layout = lake_layout(root)
            if layout is not None and layout > LAYOUT_VERSION:
                _fail(f"lake {root} has layout {layout}, written by a newer chipledger: upgrade chipledger")
            committed = open_lake(root, ("events",)).table_files("events") if layout == LAYOUT_VERSION else None
            done = upgrade_events_files(root, committed or [] if layout == LAYOUT_VERSION else None)
            report = {"lake": str(root), "layout_before": layout, "events_files_upgraded": [str(p) for p in done],
                      "adopted_files": {}, "refolded": None}
            for p in done if not as_json else ():
                typer.echo(str(p))
            if done:
                typer.echo(f"{len(done)} events file(s) upgraded in {root}", err=True)
            adopted = adopt(root, refoldable=REFOLDABLE) if layout == 1 else {}
            report["adopted_files"] = dict(adopted)
            if adopted:
                per_table = ", ".join(f"{t} {n}" for t, n in adopted.items() if n)
                typer.echo(f"adopted {sum(adopted.values()):,} Parquet file(s) written before commits as the lake's "
                           f"books (layout {LAYOUT_VERSION}): {per_table}", err=True)
            missing = missing_fact_tables(root)
            if missing:
                try:
                    from chipledger.cli._common import _working

                    with _working(f"folding the lake's events again for {', '.join(missing)}…"):
                        out = refold_facts(root, fold_config(cfg), tables=missing, jobs=jobs or cores())
                except (OSError, ValueError) as e:
                    _fail(f"{root}: could not fold the lake's events again: {e}", 1)
                report["refolded"] = {"events": out["events"], "rows": dict(out["rows"]),
                                      "not_applied": dict(out["rejected"])}
                rows = ", ".join(f"{t} {n:,} rows" for t, n in out["rows"].items())
                typer.echo(f"folded {out['events']:,} events again: {rows}", err=True)
                if out["rejected"]:
                    typer.echo(f"warning: {sum(out['rejected'].values()):,} events of the lake were not applied this "
                               f"time ({out['rejected']}): written by another version of the core?", err=True)
            open_lake(root)  # what every reader checks: the upgrade must leave a lake they read
    except LakeError as e:
        _fail(str(e), 1)
    if as_json:
        report["layout"] = LAYOUT_VERSION
        report["upgraded"] = bool(done or missing or adopted)
        typer.echo(json.dumps(report))
    if not done and not missing and not adopted:
        typer.echo(f"{root}: nothing to upgrade", err=True)


@lake_app.command("compact")
def lake_compact(
    lake: Optional[Path] = typer.Option(None, "--lake", help="the lake's folder (default [lake] path)"),
    min_files: int = typer.Option(2, "--min-files", min=2, help="rewrite a table's day when it has this many files"),
    config: Optional[Path] = ConfigOpt,
):
    """Rewrite the sink's small files (one per table, day and batch) as one file per table and day, in one commit:
    readers see the old files or the new ones, never both; the old files are deleted 10 minutes later. Safe while
    the sink runs."""
    from analytics.commits import compact

    from analytics.lake import LakeError

    root = _lake_dir(lake, _config(config))
    try:
        replaced = compact(root, min_files=min_files)
    except LakeError as e:
        _fail(str(e))
    n = sum(replaced.values())
    if not n:
        typer.echo(f"{root}: nothing to compact (no table has a day of {min_files} files or more)", err=True)
        return
    typer.echo(f"{root}: compacted {n:,} file(s): " + ", ".join(f"{t} {k}" for t, k in replaced.items() if k), err=True)


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
    if not root.is_dir():  # a missing lake is exit 1 here as in every command (docs/cli.md, "Exit codes")
        _fail(f"no lake at {root}", 1)
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
