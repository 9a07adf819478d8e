"""The `chipledger` command line (typer + rich). Wiring only: the rules live in the ledger core."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
import typer.core
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from chipledger.config import Config, ConfigError, load_config

app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, add_completion=True,
                  help="chipledger: an event-sourced quota and demand ledger for shared accelerator fleets.")
schema_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="The event contract as JSON Schema.")
app.add_typer(schema_app, name="schema")
kafka_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        help="A local single-node Apache Kafka (KRaft) from Maven Central jars, for development.")
app.add_typer(kafka_app, name="kafka")
topics_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="The chipledger Kafka topics (inputs keyed by pool, outputs).")
app.add_typer(topics_app, name="topics")
lake_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Maintenance of the lake's Parquet files.")
app.add_typer(lake_app, name="lake")
log_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                      help="The sequenced log (chipledger.log): the one order the fold reads.")
app.add_typer(log_app, name="log")
slo_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="The SLOs for Prometheus: rules over /metrics.")
app.add_typer(slo_app, name="slo")
grafana_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="A Grafana dashboard over /metrics.")
app.add_typer(grafana_app, name="grafana")
from chipledger.slurm.cli import slurm_app  # noqa: E402 - `chipledger slurm watch|actuate` (docs/slurm.md)
app.add_typer(slurm_app, name="slurm")
from chipledger.adapters.kube.cli import kube_app  # noqa: E402 - `chipledger kube watch|actuate` (docs/kube.md)
app.add_typer(kube_app, name="kube")

console = Console()
err = Console(stderr=True)

PROGRESS_MIN_BYTES = 8 << 20  # show a progress bar for files larger than this

ConfigOpt = typer.Option(None, "--config", help="chipledger.toml (default: ./chipledger.toml if present)",
                         exists=False, dir_okay=False)


def _print_version(value: bool) -> None:
    if value:
        from chipledger import __version__

        typer.echo(f"chipledger {__version__}")
        raise typer.Exit()


@app.callback()
def _main_options(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="print the version and exit"),
):
    """chipledger: an event-sourced quota and demand ledger for shared accelerator fleets."""


def _config(path: Optional[Path]) -> Config:
    try:
        return load_config(path)
    except ConfigError as e:
        _fail(str(e), 2)


def _fail(message: str, code: int = 1):
    err.print(f"[red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def _os_error(e: OSError) -> str:
    """An OSError as one line: the path, then what the system said (no traceback)."""
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e}"


@app.command()
def run(
    events: Path = typer.Option(..., "--events", help="JSONL file of events, one JSON object per line"),
    lake: Optional[Path] = typer.Option(None, "--lake", help="lake folder (default [lake] path = ./lake)"),
    store: Optional[str] = typer.Option(None, "--store", help="store URL (default sqlite:///chipledger.db)"),
    config: Optional[Path] = ConfigOpt,
    overwrite: bool = typer.Option(False, "--overwrite", help="replace the tables of a lake that has data"),
    check: bool = typer.Option(False, "--check-invariants", help="assert conservation after every event (slow)"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
    strict: bool = typer.Option(False, "--strict", help="exit 1 when a line became a dead letter or the file "
                                                        "has no events (for CI and scripts)"),
):
    """Fold an event file in-process (no Kafka, no server) and write the lake and the store."""
    summary = _run(events, lake, store, _config(config), overwrite, check)
    if as_json:
        console.file.write(json.dumps(summary.as_dict()) + "\n")
    else:
        print_summary(summary)
    if summary.lines == summary.blank:
        err.print(f"warning: {events} has no events ({summary.lines} line(s), all blank): nothing was folded",
                  highlight=False, markup=False, soft_wrap=True)
        if strict:
            raise typer.Exit(1)
    if strict and summary.dead_letter_total:
        err.print(f"error: --strict: {summary.dead_letter_total:,} line(s) became dead letters (lines "
                  f"{_dead_lines(summary)})", highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(1)


def _dead_lines(summary, code=None) -> str:
    lines = sorted(n for c, ns in summary.dead_letter_lines.items() if code is None or c == code for n in ns)
    shown = ", ".join(map(str, lines[:10]))
    total = summary.dead_letters[code] if code else summary.dead_letter_total
    return shown + (f", … ({total - len(lines[:10]):,} more)" if total > len(lines[:10]) else "")


def _run(events: Path, lake: Optional[Path], store: Optional[str], cfg: Config, overwrite: bool, check: bool):
    from chipledger.config import fold_config
    from chipledger.embedded import RunError, run_file
    from ledger.store import open_store
    from ledger.store.repo import StoreError

    lake = lake or Path(cfg.lake.path)
    url = store or cfg.store.url
    try:
        st = open_store(url)
    except StoreError as e:
        _fail(str(e))
    fold = fold_config(cfg, check)
    if events.is_dir():
        _fail(f"--events {events} is a directory: give the JSONL file of events", 2)
    size = events.stat().st_size if events.is_file() else 0
    try:
        if size >= PROGRESS_MIN_BYTES and err.is_terminal:
            with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                          TransferSpeedColumn(), TimeRemainingColumn(), console=err, transient=True) as bar:
                task = bar.add_task(f"folding {events.name}", total=size)
                summary, _ = run_file(events, lake, fold_config=fold, overwrite=overwrite, store=st,
                                      progress=lambda n: bar.update(task, completed=n),
                                      max_event_bytes=cfg.ledger.max_event_bytes)
        else:
            summary, _ = run_file(events, lake, fold_config=fold, overwrite=overwrite, store=st,
                                  max_event_bytes=cfg.ledger.max_event_bytes)
    except RunError as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot run into lake {lake}: {_os_error(e)}")
    return summary


def _counts_table(title: str) -> Table:
    t = Table(title=title, show_header=False)
    t.add_column("what")
    t.add_column("count", justify="right")
    return t


def _add_breakdown(t: Table, label: str, counts) -> None:
    """A total row, then one indented row per key."""
    t.add_row(label, f"{sum(counts.values()):,}")
    for key, n in sorted(counts.items()):
        t.add_row(f"  {key}", f"{n:,}")


def print_summary(summary) -> None:
    t = _counts_table(f"run of {summary.source}")
    t.add_row("lines read", f"{summary.lines:,}")
    t.add_row("accepted", f"{summary.accepted:,}")
    t.add_row("duplicates dropped", f"{summary.duplicates:,}")
    t.add_row("late (applied at the pool clock)", f"{summary.late:,}")
    t.add_row("dead letters", f"{summary.dead_letter_total:,}")
    for code, n in sorted(summary.dead_letters.items()):
        t.add_row(f"  {code} (line{'s' if n > 1 else ''} {_dead_lines(summary, code)})", f"{n:,}")
    t.add_row("pools", f"{summary.pools:,}")
    for table, n in sorted(summary.rows_written.items()):
        t.add_row(f"lake rows: {table}", f"{n:,}")
    rate = summary.lines / summary.seconds if summary.seconds else 0
    t.add_row("seconds", f"{summary.seconds:.2f} ({rate:,.0f} lines/s)")
    t.add_row("ledger core", summary.core)
    console.print(t)
    console.print(f"lake: {summary.lake}")


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
    from chipledger.output import FORMATS, render

    if fmt not in FORMATS:
        _fail(f"--format must be one of {', '.join(FORMATS)}", 2)
    cfg = _config(config)
    con = _connect(_lake_dir(lake, cfg), slo=cfg.slo, config=cfg.lake.duckdb_config())
    if query is None:
        from chipledger.sqlshell import run_shell

        failures = run_shell(con, sys.stdin, console, err, fmt, view_names(), limit=limit)
        if failures and not sys.stdin.isatty():
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


def _lake_error(lake: Path, e: Exception) -> str:
    from analytics.views import duckdb_error_line

    line, out_of_memory = duckdb_error_line(e)
    if out_of_memory:
        return f"cannot read the lake {lake} within DuckDB's memory: {line}"
    return (f"cannot read the lake {lake}: {line} (a damaged Parquet file? restore it, or run the events again; "
            f"or [lake] spill_dir is not a folder DuckDB can write)")


def _lake_read(read, lake: Path):
    """`read()`, with a lake DuckDB cannot read (a truncated or damaged Parquet file, say) as one line of error
    instead of a traceback."""
    import duckdb

    try:
        return read()
    except duckdb.Error as e:
        _fail(_lake_error(lake, e))


def _connect(lake: Path, **kwargs):
    """analytics.views.connect, with an unreadable lake as one line of error."""
    from analytics.views import connect

    return _lake_read(lambda: connect(lake, **kwargs), lake)


def _lake_dir(lake: Optional[Path], cfg: Config) -> Path:
    lake = lake or Path(cfg.lake.path)
    if not lake.is_dir():
        _fail(f"lake {lake} does not exist (run `chipledger run` or `chipledger demo` first)")
    return lake


def _instant(text: Optional[str], option: str):
    if text is None:
        return None
    from chipledger.report import parse_instant

    try:
        return parse_instant(text)
    except ValueError:
        _fail(f"{option} {text!r} is not an ISO 8601 date or time (e.g. 2026-11-02 or 2026-11-02T03:00:00Z)", 2)


PoolOpt = typer.Option(None, "--pool", help="only this pool (default: all pools)")


@app.command()
def report(
    lake: Optional[Path] = typer.Option(None, "--lake", help="lake folder (default [lake] path = ./lake)"),
    pool: Optional[str] = PoolOpt,
    since: Optional[str] = typer.Option(None, "--since", help="start of the period (ISO 8601, UTC if no zone)"),
    until: Optional[str] = typer.Option(None, "--until",
                                        help="end of the period, and the instant error budgets end at "
                                             "(default: the latest event)"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for the charts (PNG) and report.html"),
    as_json: bool = typer.Option(False, "--json", help="print the report's sections as JSON"),
    config: Optional[Path] = ConfigOpt,
):
    """The SLO summary: error budgets, burn-rate alerts, availability, quota honoured, scheduling latency,
    goodput, fragmentation and demand peaks; with --out, charts as PNG and one HTML page."""
    from analytics.views import connect
    from chipledger.report import build_report, print_report, write_report

    cfg = _config(config)
    t0, t1 = _instant(since, "--since"), _instant(until, "--until")
    if t0 is not None and t1 is not None and t1 <= t0:
        _fail("--until must be after --since", 2)
    con = _connect(_lake_dir(lake, cfg), slo=cfg.slo, as_of=t1, materialize=True, config=cfg.lake.duckdb_config())
    if pool is not None:  # an unknown pool is an error, not an empty report (the rule `alerts` uses)
        from chipledger.alerts import AlertsError, check_pool, known_pools

        try:
            check_pool(_lake_read(lambda: known_pools(con), _lake_dir(lake, cfg)), pool)
        except AlertsError as e:
            _fail(str(e), 2)
    rep = _lake_read(lambda: build_report(con, pool=pool, since=t0, until=t1), lake or Path(cfg.lake.path))
    if not as_json:
        print_report(rep, console)
    written = []
    if out is not None:
        try:
            written = write_report(rep, out)
        except OSError as e:
            _fail(f"cannot write the report into --out {out} (a folder): {_os_error(e)}")
        if not as_json:
            for path in written:
                console.print(f"wrote {path}", highlight=False)
    if as_json:
        console.file.write(json.dumps({
            "title": rep.title, "subtitle": rep.subtitle, "pool": pool, "firing_pages": rep.firing_pages,
            "sections": [{"title": s.title, "columns": s.columns, "rows": s.rows, "note": s.note} for s in rep.sections],
            "files": [str(p) for p in written]}) + "\n")


class _AlertsCommand(typer.core.TyperCommand):
    """`alerts` exits 3 on a usage error too (click's 2 is `alerts`' "a page fires")."""

    def make_context(self, info_name, args, parent=None, **extra):
        from typer._click.exceptions import UsageError  # typer 0.29 vendors click as typer._click

        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except UsageError as e:
            from chipledger.alerts import EXIT_ERROR

            e.exit_code = EXIT_ERROR
            raise


@app.command(cls=_AlertsCommand)
def alerts(
    lake: Optional[Path] = typer.Option(None, "--lake", help="lake folder (default [lake] path = ./lake)"),
    pool: Optional[str] = PoolOpt,
    at: Optional[str] = typer.Option(None, "--at", help="evaluate at this instant (default: the latest event)"),
    max_age: Optional[str] = typer.Option(None, "--max-age", metavar="DURATION",
                                          help="an error (exit 3) when the newest event is older than this "
                                               "before --at, or before now (e.g. 15m, 2h, 1d)"),
    as_json: bool = typer.Option(False, "--json", help="print the instant and the firing alerts as JSON"),
    alertmanager: Optional[str] = typer.Option(None, "--alertmanager", metavar="URL",
                                               help="also send the firing alerts to this Alertmanager "
                                                    "(API v2, e.g. http://127.0.0.1:9093); exit 3 if it fails"),
    config: Optional[Path] = ConfigOpt,
):
    """Print the instant evaluated and the burn-rate alerts firing (SRE workbook windows: 1h & 5m at 14.4x and
    6h & 30m at 6x page, 3d & 6h at 1x ticket). Exit 0: none firing; 1: tickets only; 2: a page-level alert
    fires; 3: error (no lake, a lake without events, an unknown --pool, stale with --max-age, a bad option)."""
    import duckdb

    from analytics.views import connect
    from chipledger.alerts import EXIT_ERROR, AlertsError, evaluate, exit_status, parse_duration
    from chipledger.report import parse_instant

    try:
        cfg = load_config(config)
        root = lake or Path(cfg.lake.path)
        if not root.is_dir():
            raise AlertsError(f"lake {root} does not exist (run `chipledger run` or `chipledger demo` first)")
        try:
            t = parse_instant(at) if at is not None else None
        except ValueError:
            raise AlertsError(f"--at {at!r} is not an ISO 8601 date or time (e.g. 2026-11-02T03:00:00Z)") from None
        max_age_s = parse_duration(max_age) if max_age is not None else None
        con = connect(root, slo=cfg.slo, as_of=t, config=cfg.lake.duckdb_config())
        try:
            ev = evaluate(con, pool, max_age_s=max_age_s, at=t)
        finally:
            con.close()
    except (AlertsError, ConfigError) as e:
        _fail(str(e), EXIT_ERROR)
    except duckdb.Error as e:  # one line, as the other commands that read the lake say it
        _fail(_lake_error(root, e), EXIT_ERROR)
    except Exception as e:  # a monitor must see an error, never a traceback that might read as a firing state
        _fail(f"{type(e).__name__}: {e}", EXIT_ERROR)
    if as_json:
        console.file.write(json.dumps(ev.as_dict()) + "\n")
    else:
        console.print(f"evaluated at {ev.as_dict()['evaluated_at']} (newest event {ev.as_dict()['newest_event_at']}, "
                      f"{ev.age_s:,} s before {'--at' if t else 'now'}; {len(ev.pools)} pool(s))",
                      highlight=False, markup=False, soft_wrap=True)
        for a in ev.alerts:
            console.print(a.line(), highlight=False, markup=False, soft_wrap=True)
        if not ev.alerts:
            console.print("no burn-rate alert firing", highlight=False)
    if alertmanager is not None:
        from chipledger.alertmanager import AlertmanagerError, send

        try:
            sent = send(alertmanager, ev.alerts)
        except AlertmanagerError as e:
            _fail(str(e), EXIT_ERROR)
        err.print(f"sent {sent} alert(s) to {alertmanager}", highlight=False)
    raise typer.Exit(exit_status(ev.alerts))


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


@app.command()
def demo(
    seed: int = typer.Option(7, help="random seed of the scenario"),
    days: float = typer.Option(14, help="days of fleet history to simulate"),
    out: Path = typer.Option(Path("demo"), "--out", help="folder for the events file, lake and store"),
    trace: Optional[str] = typer.Option(None, "--trace", help="run on a real trace instead: alibaba-openb | helios"),
    trace_dir: Optional[Path] = typer.Option(None, "--trace-dir",
                                             help="the trace's folder (default: ../shared/traces/… if present)"),
    config: Optional[Path] = ConfigOpt,
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON (run, pools, teams, statements)"),
):
    """Generate a seeded fleet scenario (or import a real trace), run it on the embedded default and print a
    short summary."""
    from chipledger.demo import run_demo, run_trace_demo
    from chipledger.importers.base import TraceFormatError
    from chipledger.importers.registry import SHARED_TRACE_DIRS, find_shared_trace
    from chipledger.config import fold_config

    fold = fold_config(_config(config))
    import io

    shown = Console(file=io.StringIO()) if as_json else console  # --json: the tables are not printed
    if trace is None:
        if not days > 0:
            _fail(f"--days must be more than 0, got {days:g}", 2)
        try:
            result = run_demo(out, seed=seed, days=days, console=shown, fold_config=fold)
        except OSError as e:
            _fail(f"cannot write the demo into {out}: {_os_error(e)}")
        if as_json:
            console.file.write(json.dumps(_demo_json(result, out)) + "\n")
        return
    if trace not in SHARED_TRACE_DIRS:
        _fail(f"--trace must be one of {', '.join(SHARED_TRACE_DIRS)}", 2)
    src = trace_dir or find_shared_trace(trace)
    if src is None or not src.is_dir():
        _fail(f"trace folder not found: pass --trace-dir (the public trace copies live in ../shared/traces/"
              f"{SHARED_TRACE_DIRS[trace]} beside the repository)", 2)
    try:
        result = run_trace_demo(trace, src, out, console=shown, fold_config=fold)
    except (TraceFormatError, FileNotFoundError) as e:
        _fail(str(e))
    if as_json:
        console.file.write(json.dumps(_demo_json(result, out)) + "\n")


def _demo_json(result: dict, out: Path) -> dict:
    from chipledger.demo import ACCOUNT_ORDER

    return {
        "run": result["summary"], "lake": str(out / "lake"), "events": str(out / "events.jsonl"),
        "pools": [{"pool": r[0], **{f"{a}_chip_h": round(v or 0.0, 3) for a, v in zip(ACCOUNT_ORDER, r[1:])}}
                  for r in result["pools"]],
        "teams": [{"pool": p, "team": t, "quota_chip_h": round(q or 0.0, 3), "used_chip_h": round(u or 0.0, 3),
                   "borrowed_chip_h": round(b or 0.0, 3)} for p, t, q, u, b in result["teams"]],
        "statements": [{"period": s.period.label, "team": s.team, "partial": s.partial,
                        "files": [str(f) for f in s.files], "digest": s.digest} for s in result["statements"]],
    }


@app.command()
def backtest(
    events: Path = typer.Option(..., "--events", help="event log (JSONL) whose demand is replayed"),
    config: Path = typer.Option(..., "--config", help="the configuration to try ([policy], [backtest] quota)"),
    baseline: Optional[Path] = typer.Option(None, "--baseline", help="a second configuration, side by side "
                                            "(default: the defaults with the log's own quotas)"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for backtest.json and backtest.html"),
    quota: Optional[str] = typer.Option(None, "--quota", help="team=chips,… or pool:team=chips,…: the grants of "
                                        "--config's run (overrides its [backtest] quota)"),
    days: Optional[float] = typer.Option(None, "--days", help="only jobs submitted within this many days of "
                                         "the log's start"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
):
    """Replay a log's demand (submissions, chips, priorities, observed run times) through the simulated
    cluster under --config (and --baseline), the ledger deciding; report quota honoured, waits, lost work,
    utilisation, borrowed share, fairness and bursts side by side, and the simulated against the observed
    waits (docs/backtest.md)."""
    from chipledger.backtest import BacktestError, print_report, run_cli

    try:
        base_cfg = _config(baseline) if baseline is not None else Config()
        alt_cfg = _config(config)
        report = run_cli(events, alt_cfg, base_cfg, config.name,
                         baseline.name if baseline is not None else "defaults", quota, days, out)
    except BacktestError as err:
        _fail(str(err))
    if as_json:
        console.file.write(json.dumps(report) + "\n")
    else:
        print_report(report, console)


import_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Turn real traces and scheduler logs into event JSONL.")
app.add_typer(import_app, name="import")
OutOpt = typer.Option(..., "-o", "--out", help="event JSONL to write")


def _import(fmt: str, src: Path, out: Path, as_json: bool, **options) -> None:
    from chipledger.importers.base import TraceFormatError
    from chipledger.importers.registry import import_trace

    if not src.exists():
        _fail(f"{src} does not exist")
    try:
        report = import_trace(fmt, src, out, **options)
    except (TraceFormatError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot import into {out}: {_os_error(e)}")
    if as_json:
        console.file.write(json.dumps(report.as_dict()) + "\n")
        return
    t = _counts_table(f"import {fmt} {src}")
    t.add_row("rows read", f"{report.rows_read:,}")
    _add_breakdown(t, "events written", report.events)
    _add_breakdown(t, "rows skipped", report.skipped)
    t.add_row("pools", ", ".join(report.pools))
    t.add_row("time span", f"{report.first_at} … {report.last_at}")
    console.print(t)
    for note in report.notes:
        console.print(f"note: {escape(str(note))}")
    console.print(f"events: {out}  (fold them: chipledger run --events {out})")


JsonOpt = typer.Option(False, "--json", help="print the report as JSON")


@import_app.command("alibaba-openb")
def import_alibaba(src: Path = typer.Argument(..., help="folder with openb_node_list_gpu_node.csv and "
                                                         "openb_pod_list_default.csv"),
                   out: Path = OutOpt,
                   start: Optional[str] = typer.Option(None, help="UTC instant that trace second 0 maps to "
                                                                   "(default 2023-01-01T00:00:00Z)"),
                   as_json: bool = JsonOpt):
    """The Alibaba GPU cluster trace v2023 (openb): GPU nodes → pools and chips, pods → jobs."""
    options = {}
    if start is not None:
        from datetime import datetime

        try:
            options["start"] = datetime.fromisoformat(start.replace("Z", "+00:00"))
        except ValueError:
            _fail(f"--start {start!r} is not an ISO 8601 time", 2)
    _import("alibaba-openb", src, out, as_json, **options)


@import_app.command("helios")
def import_helios_cmd(src: Path = typer.Argument(..., help="folder with cluster_gpu_number.csv "
                                                            "(and cluster_log.csv when present)"),
                      out: Path = OutOpt,
                      cluster: Optional[str] = typer.Option(None, help="cluster name (default: the folder name)"),
                      tz: str = typer.Option("UTC", help="time zone of the trace's times and quota days"),
                      as_json: bool = JsonOpt):
    """Helios (SenseTime) quota files → time-bounded grants per virtual cluster, job logs → jobs."""
    _import("helios", src, out, as_json, tz=tz, **({"cluster": cluster} if cluster else {}))


@import_app.command("sacct")
def import_sacct_cmd(src: Path = typer.Argument(..., help="output of sacct --parsable2"),
                     out: Path = OutOpt,
                     tz: str = typer.Option("UTC", help="time zone of the sacct timestamps"),
                     chips_per_node: int = typer.Option(8, help="GPUs per node in the partitions"),
                     cluster: Optional[str] = typer.Option(None, help="pools <cluster>/<partition>, as `slurm "
                                                           "watch` names them"),
                     nodes: Optional[Path] = typer.Option(None, help="`sinfo --json` or `scontrol show node -o` dump: the chips (needs "
                                                         "--cluster)"),
                     assoc: Optional[Path] = typer.Option(None, help="`sacctmgr -P show assoc format=id,account,user,"
                                                          "partition,grptres` dump: GPU quotas (needs --nodes)"),
                     inventory_at: Optional[str] = typer.Option(None, help="when the chips and quotas take effect "
                                                                "(ISO 8601 or epoch; default the first Submit)"),
                     node_events: Optional[Path] = typer.Option(None, help="`sacctmgr -n -P show event event=node "
                                                                "format=nodename,start,end,state,reason` dump: "
                                                                "down/drain periods (needs --nodes)"),
                     reservations: Optional[Path] = typer.Option(None, help="`sacctmgr -n -P show reservation "
                                                                 "format=name,nodenames,start,end,flags` dump: "
                                                                 "maintenance periods (needs --nodes)"),
                     as_json: bool = JsonOpt):
    """Slurm accounting (sacct -D --parsable2): Account → team, Partition → pool, GPU TRES → chips."""
    at = None
    if inventory_at is not None:
        from chipledger.slurm.watch import WatchError, parse_since

        try:
            at = parse_since(inventory_at, cluster or "")
        except WatchError as e:
            _fail(str(e).replace("--since", "--inventory-at"), 2)
    _import("sacct", src, out, as_json, tz=tz, chips_per_node=chips_per_node, cluster=cluster, nodes=nodes,
            assoc=assoc, inventory_at=at, node_events=node_events, reservations=reservations)


DataDirOpt = typer.Option(Path(".kafka"), "--data-dir", help="broker config, data and log folder")


@kafka_app.command("up")
def kafka_up(port: int = typer.Option(9092, help="client port on 127.0.0.1 (the SASL listener with --secure)"),
             data_dir: Path = DataDirOpt,
             timeout: float = typer.Option(120, help="seconds to wait for the broker to answer"),
             secure: bool = typer.Option(False, "--secure", help="SASL/SCRAM, the standard authorizer (nothing "
                                         "allowed without an ACL) and the users of docs/security.md"),
             tls: bool = typer.Option(False, "--tls", help="with --secure: TLS on the listener (a throw-away CA "
                                      "in DATA_DIR/tls/ca.pem)")):
    """Download the broker jars once (Maven), format KRaft storage, start the broker and wait until it answers.

    With --secure it also creates the users admin, cluster, worker, sink and reader with their ACLs; their
    passwords are in DATA_DIR/secrets/<user>.password (0600), never printed."""
    from streams import broker

    if tls and not secure:
        _fail("--tls goes with --secure", 2)
    try:
        info = broker.up(port=port, data_dir=data_dir, timeout_s=timeout, secure=secure, tls=tls)
    except broker.BrokerError as e:
        _fail(str(e))
    console.print(f"kafka {info.get('version', '')} up at {info['bootstrap_servers']} (pid {info['pid']}, "
                  f"{info['security_protocol']}, log {info['log']})", highlight=False, soft_wrap=True)
    if secure:
        from streams.acl import local_connection, provision_defaults
        from streams.topics import KafkaSetupError

        try:
            files = provision_defaults(local_connection(info), info["secrets_dir"], timeout_s=timeout)
        except KafkaSetupError as e:
            _fail(str(e), 2)
        console.print(f"users {', '.join(files)}: passwords in {info['secrets_dir']}/<user>.password; super user "
                      f"{broker.SUPER_USER} (PLAIN) in {info['secrets_dir']}/{broker.SUPER_USER}.password",
                      highlight=False, soft_wrap=True)
        if tls:
            console.print(f"clients trust the CA {info['ca_file']} (--ca-file / [kafka] ssl_cafile)",
                          highlight=False, soft_wrap=True)


@kafka_app.command("status")
def kafka_status(data_dir: Path = DataDirOpt,
                 as_json: bool = typer.Option(False, "--json", help='print {"running", "ready", "port", …} as JSON')):
    """Say whether the local broker runs; exit 1 when it does not."""
    from streams import broker

    info = broker.status(data_dir)
    if as_json:
        console.file.write(json.dumps({"running": info is not None, "data_dir": str(data_dir),
                                       **({"ready": bool(info.get("ready")), "port": info.get("port"),
                                           "pid": info.get("pid"), "log": str(info.get("log"))} if info else {})})
                           + "\n")
        if info is None:
            raise typer.Exit(1)
        return
    if info is None:
        console.print(f"kafka: not running (data dir {data_dir})")
        raise typer.Exit(1)
    state = "ready" if info.get("ready") else "starting"
    console.print(f"kafka: {state} at 127.0.0.1:{info['port']} (pid {info['pid']}, {info['security_protocol']}, "
                  f"log {info['log']})", highlight=False, soft_wrap=True)


@kafka_app.command("down")
def kafka_down(data_dir: Path = DataDirOpt, timeout: float = typer.Option(60, help="seconds before SIGKILL")):
    """Stop the local broker cleanly."""
    from streams import broker

    was_running = broker.down(data_dir, timeout_s=timeout)
    console.print("kafka: stopped" if was_running else "kafka: was not running")



BootstrapOpt = typer.Option(None, "--bootstrap", metavar="HOST:PORT",
                            help="Kafka bootstrap servers (default [kafka] bootstrap / CHIPLEDGER_KAFKA_BOOTSTRAP)")
KafkaTimeoutOpt = typer.Option(10.0, "--timeout", min=0.1, help="seconds to wait for the broker to answer")
KafkaUserOpt = typer.Option(None, "--user", help="Kafka SASL/SCRAM user (default [kafka] username / "
                                                 "CHIPLEDGER_KAFKA_USERNAME)")
KafkaPasswordFileOpt = typer.Option(None, "--password-file", dir_okay=False,
                                    help="file whose first line is the user's password (default [kafka] "
                                         "password_file; or CHIPLEDGER_KAFKA_PASSWORD)")
KafkaCaFileOpt = typer.Option(None, "--ca-file", dir_okay=False,
                              help="CA certificate (PEM) the broker's TLS certificate is checked against; turns "
                                   "TLS on (default [kafka] ssl_cafile)")


def _kafka(cfg: Config, bootstrap: Optional[str], user: Optional[str] = None, password_file: Optional[Path] = None,
           ca_file: Optional[Path] = None):
    """The Kafka connection of a command: [kafka] config and environment, overridden by its options."""
    from streams.clients import KafkaSecurityError, connection_from_config

    try:
        return connection_from_config(cfg.kafka, bootstrap=bootstrap, username=user, password_file=password_file,
                                      ssl_cafile=ca_file)
    except KafkaSecurityError as e:
        _fail(str(e), 2)


users_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        help="SCRAM users of a secure broker and their roles (admin, cluster, worker, sink, "
                             "reader: docs/security.md). Needs the super user: [kafka] credentials, --user/"
                             "--password-file, or else the local broker of --data-dir.")
kafka_app.add_typer(users_app, name="users")


def _super(cfg: Config, bootstrap, user, password_file, ca_file, data_dir: Path):
    """The connection for user management: the given credentials, else the local broker's super user."""
    if user or password_file or cfg.kafka.username:
        return _kafka(cfg, bootstrap, user, password_file, ca_file)
    from streams import broker
    from streams.acl import local_connection
    from streams.clients import KafkaSecurityError

    info = broker.status(data_dir)
    if info is None or not info.get("secure"):
        _fail(f"no credentials given and no secure local broker runs in {data_dir}: pass --user and "
              "--password-file of a super user, or start one with `chipledger kafka up --secure`", 2)
    try:
        return local_connection(info).with_bootstrap(bootstrap)
    except KafkaSecurityError as e:
        _fail(str(e), 2)


@users_app.command("add")
def users_add(
    name: str = typer.Argument(..., help="user name (the principal User:NAME)"),
    role: list[str] = typer.Option(..., "--role", help="admin | cluster | worker | sink | reader (repeatable)"),
    new_password_file: Optional[Path] = typer.Option(None, "--new-password-file", dir_okay=False,
                                                     help="the user's password: read from this file if it exists, "
                                                          "else a random one is written to it (0600)"),
    password_from_env: Optional[str] = typer.Option(None, "--password-from-env", metavar="VAR",
                                                    help="or: the user's password is in this environment variable "
                                                         "(docker-compose)"),
    app_id: str = typer.Option("chipledger-worker", "--app-id",
                               help="worker role: the Faust app id its topics, groups and ids start with"),
    bootstrap: Optional[str] = BootstrapOpt, config: Optional[Path] = ConfigOpt,
    user: Optional[str] = KafkaUserOpt, password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt, data_dir: Path = DataDirOpt, timeout: float = KafkaTimeoutOpt,
):
    """Create a user, or set its password and roles (to rotate a password, give a new file)."""
    import os
    import secrets

    from streams.acl import add_user
    from streams.clients import KafkaSecurityError, read_password_file
    from streams.topics import KafkaSetupError

    from streams.clients import Secret

    if (new_password_file is None) == (password_from_env is None):
        _fail("give exactly one of --new-password-file and --password-from-env", 2)
    if password_from_env is not None and not os.environ.get(password_from_env):
        _fail(f"the environment variable {password_from_env} is not set", 2)
    conn = _super(_config(config), bootstrap, user, password_file, ca_file, data_dir)
    made = False
    if new_password_file is not None and not new_password_file.exists():
        try:
            fd = os.open(new_password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            _fail(f"cannot write {new_password_file}: {e.strerror}", 2)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(24) + "\n")
        made = True
    try:
        password = (Secret(os.environ[password_from_env]) if password_from_env is not None
                    else read_password_file(new_password_file))
        info = add_user(conn, name, role, password, app_id=app_id, timeout_s=timeout)
    except (KafkaSetupError, KafkaSecurityError, ValueError) as e:
        if made:
            new_password_file.unlink(missing_ok=True)
        _fail(str(e), 2)
    console.print(f"user {info.name}: roles {', '.join(info.roles)}"
                  + (f" (app id {info.app_id})" if info.app_id else "")
                  + f"; password {'written to' if made else 'from'} {new_password_file or password_from_env}",
                  highlight=False,
                  soft_wrap=True)


@users_app.command("list")
def users_list(
    bootstrap: Optional[str] = BootstrapOpt, config: Optional[Path] = ConfigOpt,
    user: Optional[str] = KafkaUserOpt, password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt, data_dir: Path = DataDirOpt, timeout: float = KafkaTimeoutOpt,
    as_json: bool = typer.Option(False, "--json", help="print the users as JSON"),
):
    """The SCRAM users, their mechanisms and the roles their ACLs give them."""
    from streams.acl import list_users
    from streams.topics import KafkaSetupError

    conn = _super(_config(config), bootstrap, user, password_file, ca_file, data_dir)
    try:
        users = list_users(conn, timeout_s=timeout)
    except KafkaSetupError as e:
        _fail(str(e), 2)
    if as_json:
        console.file.write(json.dumps([{"name": u.name, "mechanisms": list(u.mechanisms), "roles": list(u.roles),
                                        "app_id": u.app_id} for u in users]) + "\n")
        return
    for u in users:
        console.print(f"{u.name:<20} {','.join(u.roles) or '(no role)':<20} {','.join(u.mechanisms)}"
                      + (f"  app id {u.app_id}" if u.app_id else ""), markup=False, highlight=False, soft_wrap=True)


@users_app.command("remove")
def users_remove(
    name: str = typer.Argument(..., help="user name"),
    bootstrap: Optional[str] = BootstrapOpt, config: Optional[Path] = ConfigOpt,
    user: Optional[str] = KafkaUserOpt, password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt, data_dir: Path = DataDirOpt, timeout: float = KafkaTimeoutOpt,
):
    """Delete a user's SCRAM credentials and ACLs (its open connections end at their next authentication)."""
    from streams.acl import remove_user
    from streams.topics import KafkaSetupError

    conn = _super(_config(config), bootstrap, user, password_file, ca_file, data_dir)
    try:
        gone = remove_user(conn, name, timeout_s=timeout)
    except KafkaSetupError as e:
        _fail(str(e), 2)
    console.print(f"user {name}: {'removed' if gone else 'did not exist'}", highlight=False)
    if not gone:
        raise typer.Exit(1)


@topics_app.command("create")
def topics_create(
    bootstrap: Optional[str] = BootstrapOpt,
    partitions: Optional[int] = typer.Option(None, "--partitions", min=1,
                                             help="partitions per topic (default [kafka] partitions = 3)"),
    replication: int = typer.Option(1, "--replication", min=1, help="replication factor of new topics"),
    config: Optional[Path] = ConfigOpt,
    timeout: float = typer.Option(30.0, "--timeout", min=0.1, help="seconds to wait for the broker"),
    user: Optional[str] = KafkaUserOpt,
    password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt,
):
    """Create the input and output topics that are missing (idempotent); print each with created/exists.

    Exit 2 when no broker answers or an existing input topic has another partition count."""
    from streams.topics import KafkaSetupError, create_topics

    cfg = _config(config)
    conn = _kafka(cfg, bootstrap, user, password_file, ca_file)
    partitions = partitions or cfg.kafka.partitions
    try:
        result = create_topics(conn, partitions=partitions, replication=replication, timeout_s=timeout)
    except (KafkaSetupError, ValueError) as e:
        _fail(str(e), 2)
    width = max(len(name) for name in result)
    for name, what in result.items():
        console.print(f"{name:<{width}}  {what}", markup=False, highlight=False, soft_wrap=True)


@app.command()
def emit(
    file: Optional[Path] = typer.Argument(None, help="JSONL file of events (default or '-': stdin)",
                                          dir_okay=False),
    bootstrap: Optional[str] = BootstrapOpt,
    config: Optional[Path] = ConfigOpt,
    timeout: float = KafkaTimeoutOpt,
    user: Optional[str] = KafkaUserOpt,
    password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt,
):
    """Validate and publish JSONL events to Kafka (keyed by pool); report invalid lines on stderr.

    Exit 0 when every line was sent, 1 when some lines were invalid (the valid ones are still sent),
    2 when Kafka is not usable (no broker, missing topics, delivery failed)."""
    from streams import producer as producer_mod
    from streams.topics import KafkaSetupError

    cfg = _config(config)
    conn = _kafka(cfg, bootstrap, user, password_file, ca_file)
    bootstrap = conn.bootstrap
    if file is not None and str(file) != "-":
        if not file.is_file():
            _fail(f"events file {file} does not exist", 2)
        source = open(file, "rb")
    else:
        source = getattr(sys.stdin, "buffer", sys.stdin)

    def invalid(lineno: int, code: str, detail: str) -> None:
        err.print(f"line {lineno}: {code}: {escape(detail)}", highlight=False, soft_wrap=True)

    ms = int(timeout * 1000)
    try:
        with producer_mod.LedgerProducer(conn, bootstrap_timeout_ms=ms, max_block_ms=ms) as producer:
            report = producer_mod.emit_lines(producer, source, on_invalid=invalid)
    except KafkaSetupError as e:
        _fail(str(e), 2)
    finally:
        if source is not sys.stdin and source is not getattr(sys.stdin, "buffer", None):
            source.close()
    console.print(f"sent {report.sent}, invalid {len(report.invalid)}", highlight=False)
    if report.failed:
        _fail(f"{report.failed} event(s) could not be delivered to {bootstrap}: {report.first_failure}", 2)
    if report.invalid:
        raise typer.Exit(1)


@app.command()
def statements(
    period: Optional[str] = typer.Option(None, "--period", "-p",
                                         help="2026-11 (month), 2026-W45 (ISO week) or 2026-11-01..2026-11-15 (days, "
                                              "both included), UTC"),
    every: Optional[str] = typer.Option(None, "--every",
                                        help="week | month: issue each newly closed period once (recorded in the "
                                             "store); for cron"),
    due: bool = typer.Option(False, "--due", help="as --every with [statements] every (default month)"),
    lake: Optional[Path] = typer.Option(None, "--lake", help="lake folder (default [lake] path = ./lake)"),
    team: Optional[list[str]] = typer.Option(None, "--team", "-t", help="only this team (repeatable)"),
    fmt: Optional[str] = typer.Option(None, "--format", "-f",
                                      help="comma-separated md,html,csv,json (default [statements] formats)"),
    out: Optional[Path] = typer.Option(None, "--out", help="output folder (default [statements] out = ./statements)"),
    store: Optional[str] = typer.Option(None, "--store", help="store URL that records issued statements "
                                                               "(default [store] url)"),
    workers: int = typer.Option(1, "--workers", help="processes rendering charts and files"),
    as_json: bool = typer.Option(False, "--json", help="print what was issued as JSON"),
    config: Optional[Path] = ConfigOpt,
):
    """Issue quota statements per team and period: entitlement, use in quota, borrowed, burst, preemptions,
    goodput, scheduling, error budgets, fair share, top jobs (Markdown, HTML, CSV, JSON)."""
    import duckdb

    from chipledger.statements import StatementError, issue, issue_due, parse_formats, parse_period
    from ledger.store import open_store
    from ledger.store.repo import StoreError

    cfg = _config(config)
    if due and every is None:
        every = cfg.statements.every
    if (period is None) == (every is None):
        _fail("give exactly one of --period, --every and --due", 2)
    lake = lake or Path(cfg.lake.path)
    if not lake.is_dir():
        _fail(f"lake {lake} does not exist (run `chipledger run` or `chipledger demo` first)")
    out = out or Path(cfg.statements.out)
    try:
        formats = parse_formats(fmt or cfg.statements.formats)
        st = open_store(store or cfg.store.url)
        if every is not None:
            if every not in ("week", "month"):
                _fail("--every must be week or month", 2)
            done = issue_due(lake, every, out, st, teams=team or None, formats=formats, slo=cfg.slo,
                             workers=workers, duckdb_config=cfg.lake.duckdb_config())
        else:
            done = issue(lake, parse_period(period), out, teams=team or None, formats=formats, slo=cfg.slo,
                         store=st, workers=workers, duckdb_config=cfg.lake.duckdb_config())
    except (StatementError, StoreError) as e:
        _fail(str(e), 2)
    except OSError as e:
        _fail(f"cannot write statements into --out {out} (a folder): {_os_error(e)}")
    except duckdb.Error as e:
        _fail(_lake_error(lake, e))
    if as_json:
        console.file.write(json.dumps([{"period": s.period.label, "team": s.team, "partial": s.partial,
                                        "files": [str(f) for f in s.files], "digest": s.digest} for s in done])
                           + "\n")
        return
    t = Table(title=f"statements in {out}")
    for col in ("period", "team", "state", "files"):
        t.add_column(col)
    for s in done:
        t.add_row(s.period.label, s.team, "partial" if s.partial else "closed", str(len(s.files)))
    console.print(t)
    if not done:
        console.print("no statement due" if every else "no team in the lake")


@app.command()
def why(
    job_id: str = typer.Argument(..., help="the job's id"),
    lake: Optional[Path] = typer.Option(None, "--lake", help="lake folder (default [lake] path = ./lake)"),
    config: Optional[Path] = ConfigOpt,
    as_json: bool = typer.Option(False, "--json", help="print the explanation as JSON"),
):
    """Why is this job pending? Its current reason (recorded at the latest close of the books), earlier
    reasons and the preemption decisions naming it. Exit 1 when the lake does not know the job."""
    from analytics.views import connect
    from chipledger.why import explain

    cfg = _config(config)
    lake = lake or Path(cfg.lake.path)
    if not lake.is_dir():
        _fail(f"lake {lake} does not exist (run `chipledger run` or `chipledger demo` first)")
    ex = _lake_read(lambda: explain(connect(lake, config=cfg.lake.duckdb_config()), job_id), lake)
    if as_json:
        console.file.write(json.dumps(ex.as_dict()) + "\n")
    else:
        for line in ex.lines():
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    if not ex.found:
        raise typer.Exit(1)


@app.command()
def pending(
    lake: Optional[Path] = typer.Option(None, "--lake", help="lake folder (default [lake] path = ./lake)"),
    pool: Optional[str] = typer.Option(None, "--pool", help="only this pool"),
    team: Optional[str] = typer.Option(None, "--team", help="only this team"),
    config: Optional[Path] = ConfigOpt,
    as_json: bool = typer.Option(False, "--json", help="print the queue as JSON"),
):
    """The pending jobs at each pool's latest close of the books, in queue order (highest priority, longest
    waiting, job id): position in the pool and in the team, priority, chips, time waited, reason."""
    from analytics.views import connect
    from chipledger.why import _duration, pending_queue

    cfg = _config(config)
    con = _connect(_lake_dir(lake, cfg), config=cfg.lake.duckdb_config())
    if pool is not None:
        from chipledger.alerts import AlertsError, check_pool, known_pools

        try:
            check_pool(_lake_read(lambda: known_pools(con), _lake_dir(lake, cfg)), pool)
        except AlertsError as e:
            _fail(str(e), 2)
    rows = _lake_read(lambda: pending_queue(con, pool, team), lake or Path(cfg.lake.path))
    if as_json:
        console.file.write(json.dumps(rows) + "\n")
        return
    if not rows:
        console.print("no job pending" + (f" in {pool}" if pool else "") + (f" for team {team}" if team else ""),
                      markup=False, highlight=False)
        return
    t = Table(title="pending jobs, in queue order")
    for col, right in (("pool", False), ("#", True), ("team #", True), ("team", False), ("job", False),
                       ("priority", True), ("chips", True), ("waited", True), ("reason", False)):
        t.add_column(col, justify="right" if right else "left", overflow="fold")
    for r in rows:
        t.add_row(*map(escape, (r["pool"], f"{r['position']}/{r['queue_length']}", str(r["team_position"]),
                                r["team"], r["job_id"], str(r["priority"]), f"{r['chips']:g}",
                                _duration(r["waited_s"]), r["reason"])))
    console.print(t)


@app.command()
def worker(
    bootstrap: Optional[str] = BootstrapOpt,
    config: Optional[Path] = ConfigOpt,
    data_dir: Optional[Path] = typer.Option(None, "--data-dir",
                                            help="the worker's table state (default [worker] data_dir)"),
    table_store: Optional[str] = typer.Option(None, "--table-store", help="rocksdb | memory (default [worker] "
                                                                          "table_store = rocksdb)"),
    sequencer_wait_ms: Optional[int] = typer.Option(None, "--sequencer-wait-ms", min=0,
                                                    help="how long a record waits for its producer's previous "
                                                         "record of its pool once the input topics are caught up "
                                                         "(default [worker] sequencer_wait_ms = 60000)"),
    session_timeout: Optional[float] = typer.Option(None, "--session-timeout", min=1.0,
                                                    help="seconds before a dead worker's pools move to another "
                                                         "(default [worker] session_timeout_s = 6)"),
    tick_interval: Optional[int] = typer.Option(None, "--tick-interval", min=0,
                                                help="seconds of quiet before a pool gets a pool.tick; 0: none "
                                                     "(default [worker] tick_interval_s = 60)"),
    fetch_max_wait_ms: Optional[int] = typer.Option(None, "--fetch-max-wait-ms", min=0,
                                                    help="how long the broker may hold a fetch of the input topics "
                                                         "(default [worker] fetch_max_wait_ms = 20)"),
    checkpoint_interval_ms: Optional[int] = typer.Option(None, "--checkpoint-interval-ms", min=1,
                                                         help="how often the worker writes the changed pools' states "
                                                              "(table and snapshot for the store) and commits the "
                                                              "records they hold (default [worker] "
                                                              "checkpoint_interval_ms = 500)"),
    log_stalls_ms: Optional[int] = typer.Option(None, "--log-stalls-ms", min=0,
                                                help="log each event-loop stall longer than this many ms with the "
                                                     "code that held the loop; 0: off (default [worker] "
                                                     "log_stalls_ms = 0)"),
    app_id: str = typer.Option("chipledger-worker", "--app-id", help="Faust app id (consumer group, table topics)"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", min=0, max=65535,
                                               help="serve Prometheus /metrics of the pools this worker folds on "
                                                    "this port (default: no metrics)"),
    metrics_host: str = typer.Option("127.0.0.1", "--metrics-host", help="address /metrics listens on"),
    loglevel: str = typer.Option("warning", "--loglevel", help="debug | info | warning | error"),
    timeout: float = KafkaTimeoutOpt,
    user: Optional[str] = KafkaUserOpt,
    password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt,
):
    """Run the Faust worker: fold the input topics with the ledger core and send decisions, lake rows and dead
    letters to the output topics (run `chipledger sink` to write them to the lake and the store)."""
    from schemas import INPUT_TOPICS
    from streams.topics import ALL_TOPICS, KafkaSetupError, describe_partitions
    from streams.worker import WorkerSettings, run_worker

    cfg = _config(config)
    conn = _kafka(cfg, bootstrap, user, password_file, ca_file)
    bootstrap = conn.bootstrap
    try:
        counts = describe_partitions(conn, ALL_TOPICS, timeout_s=timeout)
    except KafkaSetupError as e:
        _fail(str(e), 2)
    missing = [t for t in ALL_TOPICS if t not in counts]
    if missing:
        _fail(f"topics missing at {bootstrap}: {', '.join(missing)}; create them with `chipledger topics create`", 2)
    store_kind = table_store or cfg.worker.table_store
    if store_kind not in ("rocksdb", "memory"):
        _fail(f"--table-store must be rocksdb or memory, got {store_kind!r}", 2)
    from chipledger.config import fold_config

    fold = fold_config(cfg)  # [ledger] and [policy]

    settings = WorkerSettings(
        bootstrap=bootstrap, kafka=conn, app_id=app_id, data_dir=data_dir or Path(cfg.worker.data_dir), table_store=store_kind,
        partitions=counts[INPUT_TOPICS[0]],
        sequencer_wait_ms=cfg.worker.sequencer_wait_ms if sequencer_wait_ms is None else sequencer_wait_ms,
        session_timeout_s=cfg.worker.session_timeout_s if session_timeout is None else session_timeout,
        tick_interval_s=cfg.worker.tick_interval_s if tick_interval is None else tick_interval,
        fetch_max_wait_ms=cfg.worker.fetch_max_wait_ms if fetch_max_wait_ms is None else fetch_max_wait_ms,
        log_stalls_ms=cfg.worker.log_stalls_ms if log_stalls_ms is None else log_stalls_ms,
        checkpoint_interval_ms=(cfg.worker.checkpoint_interval_ms if checkpoint_interval_ms is None
                                else checkpoint_interval_ms),
        fold_config=fold, metrics_port=metrics_port, metrics_host=metrics_host,
    )
    import ledger

    err.print(f"worker {app_id}: {conn.describe()}, {settings.partitions} partitions, table {store_kind} in "
              f"{settings.data_dir}", highlight=False)
    err.print(f"worker {app_id}: ledger core {ledger.CORE}", highlight=False, soft_wrap=True)
    run_worker(settings, loglevel)


@log_app.command("export")
def log_export(
    output: Path = typer.Option(..., "-o", "--output", help="the JSONL file to write"),
    pool: Optional[str] = typer.Option(None, "--pool", help="only this pool's events (default: every pool)"),
    bootstrap: Optional[str] = BootstrapOpt,
    config: Optional[Path] = ConfigOpt,
    timeout: float = KafkaTimeoutOpt,
    user: Optional[str] = KafkaUserOpt,
    password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt,
):
    """Write chipledger.log, in log order, as JSONL: `chipledger run` on the file gives the books the worker
    folded (docs/streaming.md)."""
    from streams.log import export_log
    from streams.topics import KafkaSetupError

    cfg = _config(config)
    conn = _kafka(cfg, bootstrap, user, password_file, ca_file)
    try:
        rep = export_log(conn, output, pool=pool, timeout_s=timeout)
    except KafkaSetupError as e:
        _fail(str(e), 2)
    except OSError as e:
        _fail(f"cannot write {output}: {e.strerror or e}")
    err.print(f"log export: {rep.written} events of {len(rep.pools)} pool(s) to {output}"
              + (f"; {rep.duplicates} logged twice, written once" if rep.duplicates else "")
              + (f"; {rep.unexportable} empty or multi-line value(s) left out (dead letters of the fold)"
                 if rep.unexportable else ""), highlight=False, soft_wrap=True)


@app.command()
def sink(
    bootstrap: Optional[str] = BootstrapOpt,
    lake: Optional[Path] = typer.Option(None, "--lake", help="lake folder (default [lake] path = ./lake)"),
    store: Optional[str] = typer.Option(None, "--store", help="store URL (default sqlite:///chipledger.db)"),
    config: Optional[Path] = ConfigOpt,
    name: str = typer.Option("sink", "--name", help="the sink's name in the store's tracking table"),
    until_idle: Optional[float] = typer.Option(None, "--until-idle", min=0.1,
                                               help="exit after this many seconds without records (default: run "
                                                    "until interrupted)"),
    as_json: bool = typer.Option(False, "--json", help="print what was written as JSON"),
    timeout: float = KafkaTimeoutOpt,
    user: Optional[str] = KafkaUserOpt,
    password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt,
):
    """Write the worker's outputs (lake rows, decisions, dead letters, balances) to the lake and the store,
    exactly once: positions and effects in one store transaction."""
    from ledger.store import open_store
    from ledger.store.repo import StoreError
    from streams.sink import Sink
    from streams.topics import KafkaSetupError

    cfg = _config(config)
    conn = _kafka(cfg, bootstrap, user, password_file, ca_file)
    try:
        st = open_store(store or cfg.store.url)
    except StoreError as e:
        _fail(str(e))
    try:
        s = Sink(lake or Path(cfg.lake.path), st, bootstrap=conn, name=name,
                 timeout_s=timeout)
    except KafkaSetupError as e:
        _fail(str(e), 2)
    try:
        stats = s.run(idle_exit_s=until_idle)
    except KeyboardInterrupt:
        stats = s.stats
    finally:
        s.close()
    if as_json:
        console.file.write(json.dumps(stats.as_dict()) + "\n")
    else:
        console.print(f"sink {name}: {stats.records:,} records, {stats.resent_dropped:,} re-sent dropped, "
                      f"rows {dict(sorted(stats.rows.items()))}", highlight=False)


def _write_text(text: str, out: Optional[Path]) -> None:
    if out is None:
        console.file.write(text)
        return
    try:
        out.write_text(text)
    except OSError as e:
        _fail(f"cannot write {out}: {e.strerror}")
    err.print(f"wrote {out}", highlight=False)


@slo_app.command("rules")
def slo_rules_cmd(
    out: Optional[Path] = typer.Option(None, "--out", help="file to write (default: standard output)"),
    fmt: str = typer.Option("prometheus", "--format", help="prometheus (rule file) | openslo (OpenSLO v1 documents)"),
    config: Optional[Path] = ConfigOpt,
):
    """Prometheus recording rules (error ratio of each SLO over 5m, 30m, 1h, 6h, 3d and the budget window) and
    multi-window burn-rate alerting rules (page 14.4x over 1h & 5m, page 6x over 6h & 30m, ticket 1x over 3d &
    6h) from the [slo] targets, over the counters of /metrics. Check them with `promtool check rules`."""
    from chipledger.slo_rules import openslo, prometheus_rules

    cfg = _config(config)
    if fmt not in ("prometheus", "openslo"):
        _fail(f"--format must be prometheus or openslo, got {fmt!r}", 2)
    _write_text(prometheus_rules(cfg.slo) if fmt == "prometheus" else openslo(cfg.slo), out)


@grafana_app.command("dashboard")
def grafana_dashboard_cmd(
    out: Optional[Path] = typer.Option(None, "--out", help="file to write (default: standard output)"),
    config: Optional[Path] = ConfigOpt,
):
    """A Grafana dashboard (JSON, import it or provision it) over /metrics and the rules of `slo rules`: fleet per
    pool and flavor, team use against quota, pending by reason, error budgets and burn rates, fragmentation,
    decisions, and the worker's health."""
    from chipledger.grafana import dashboard_json

    cfg = _config(config)
    _write_text(dashboard_json(cfg.slo), out)


@app.command("serve-metrics")
def serve_metrics(
    lake: Optional[Path] = typer.Option(None, "--lake", help="lake folder (default [lake] path = ./lake)"),
    port: int = typer.Option(9464, "--port", min=0, max=65535, help="port of /metrics (0: any free port)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
    poll: float = typer.Option(15.0, "--poll", min=0.1, help="seconds between looks for files added to the lake"),
    config: Optional[Path] = ConfigOpt,
):
    """Serve Prometheus /metrics for an embedded lake: its events folded again with the ledger core (the worker's
    counters and gauges), following the files added to it."""
    import asyncio

    from chipledger.config import fold_config
    from chipledger.monitoring import LakeMetrics, run_server

    cfg = _config(config)
    lm = LakeMetrics(_lake_dir(lake, cfg), fold_config(cfg))
    try:
        n = lm.poll()
    except Exception as e:  # noqa: BLE001 - a lake that cannot be read: say which and why
        _fail(f"cannot read lake {lm.lake}: {e}")
    err.print(f"serve-metrics: folded {n:,} events of {len(lm.fleet.pools)} pools from {lm.lake}", highlight=False)

    def started(bound: int) -> None:
        err.print(f"serve-metrics: http://{host}:{bound}/metrics", highlight=False)

    try:
        asyncio.run(run_server(lm, host, port, poll, started=started))
    except OSError as e:
        _fail(f"cannot listen on {host}:{port}: {e.strerror or e}")
    except KeyboardInterrupt:
        pass


@app.command()
def version():
    """Print the version."""
    from chipledger import __version__

    console.print(__version__)


def main():  # pragma: no cover - console script entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
