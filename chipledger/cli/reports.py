"""`chipledger report`, `alerts`, `statements`, `why` and `pending`: what the lake says, for people and monitors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
import typer.core
from rich.markup import escape
from rich.table import Table

from chipledger.reports.tables import id_column, print_table

from chipledger.config import ConfigError, load_config

from chipledger.cli._common import ConfigOpt, PoolOpt, _config, _connect, _demo_lake, _fail, _working, _instant, _lake_dir, _lake_error, _lake_read, _os_error, app, console, err


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
    lake = _demo_lake(lake, config)
    from analytics.views import connect
    from chipledger.reports.report import build_report, print_report, typed, write_report

    cfg = _config(config)
    t0, t1 = _instant(since, "--since"), _instant(until, "--until")
    if t0 is not None and t1 is not None and t1 <= t0:
        _fail("--until must be after --since", 2)
    lake = _lake_dir(lake, cfg)
    con = _connect(lake, slo=cfg.slo, as_of=t1, materialize=True, config=cfg.lake.duckdb_config())
    if pool is not None:  # an unknown pool is an error, not an empty report (the rule `alerts` uses)
        from chipledger.monitoring.alerts import AlertsError, check_pool, known_pools

        try:
            check_pool(_lake_read(lambda: known_pools(con), lake), pool)
        except AlertsError as e:
            _fail(str(e), 2)
    with _working("computing the report…"):
        rep = _lake_read(lambda: build_report(con, pool=pool, since=t0, until=t1), lake)
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
            # typed values (numbers, fractions for percentages, null for "–"), as `alerts --json` has; the page and
            # the tables show the same cells as text
            "sections": [{"title": s.title, "columns": s.columns, "rows": [[typed(c) for c in r] for r in s.rows],
                          "note": s.note} for s in rep.sections],
            "files": [str(p) for p in written]}) + "\n")


class _AlertsCommand(typer.core.TyperCommand):
    """`alerts` exits 3 on a usage error too (click's 2 is `alerts`' "a page fires")."""

    def make_context(self, info_name, args, parent=None, **extra):
        from typer._click.exceptions import UsageError  # typer 0.29 vendors click as typer._click

        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except UsageError as e:
            from chipledger.monitoring.alerts import EXIT_ERROR

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
    lake = _demo_lake(lake, config)
    import duckdb

    from analytics.views import connect
    from chipledger.monitoring.alerts import EXIT_ERROR, AlertsError, evaluate, exit_status, parse_duration
    from chipledger.reports.report import parse_instant

    try:
        cfg = load_config(config)
        root = lake or Path(cfg.lake.path)
        from analytics.commits import open_lake
        from analytics.lake import LakeError

        try:
            open_lake(root)
        except LakeError as e:
            raise AlertsError(str(e)) from None
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
        from chipledger.monitoring.alertmanager import AlertmanagerError, send

        try:
            sent = send(alertmanager, ev.alerts, runbook_url=cfg.slo.runbook_url)
        except AlertmanagerError as e:
            _fail(str(e), EXIT_ERROR)
        err.print(f"sent {sent} alert(s) to {alertmanager}", highlight=False)
    raise typer.Exit(exit_status(ev.alerts))


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
    lake = _demo_lake(lake, config)
    import duckdb

    from chipledger.reports.statements import StatementError, issue, issue_due, parse_formats, parse_period
    from store import open_store
    from store.repo import StoreError

    cfg = _config(config)
    if due and every is None:
        every = cfg.statements.every
    if (period is None) == (every is None):
        _fail("give exactly one of --period, --every and --due", 2)
    lake = _lake_dir(lake, cfg)
    out = out or Path(cfg.statements.out)
    try:
        formats = parse_formats(fmt or cfg.statements.formats)
        st = open_store(store or cfg.store.url)
        if every is not None:
            if every not in ("week", "month"):
                _fail("--every must be week or month", 2)
            with _working(f"issuing the {every}ly statements due…"):
                done = issue_due(lake, every, out, st, teams=team or None, formats=formats, slo=cfg.slo,
                                 workers=workers, duckdb_config=cfg.lake.duckdb_config())
        else:
            with _working(f"issuing the statements of {period}…"):
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
        id_column(t, col)
    for s in done:
        t.add_row(s.period.label, s.team, "partial" if s.partial else "closed", str(len(s.files)))
    print_table(t, console)
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
    lake = _demo_lake(lake, config)
    from analytics.views import connect
    from chipledger.reports.why import explain

    cfg = _config(config)
    lake = _lake_dir(lake, cfg)
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
    at: Optional[str] = typer.Option(None, "--at", help="the queue at the latest close of the books at or before "
                                                       "this instant (ISO 8601; default: the latest)"),
):
    """The pending jobs at each pool's latest close of the books, in queue order (highest priority, longest
    waiting, job id): position in the pool and in the team, priority, chips, time waited, reason."""
    lake = _demo_lake(lake, config)
    from analytics.views import connect
    from chipledger.reports.why import _duration, books_as_of, pending_queue

    cfg = _config(config)
    lake = _lake_dir(lake, cfg)
    con = _connect(lake, config=cfg.lake.duckdb_config())
    if pool is not None:
        from chipledger.monitoring.alerts import AlertsError, check_pool, known_pools

        try:
            check_pool(_lake_read(lambda: known_pools(con), lake), pool)
        except AlertsError as e:
            _fail(str(e), 2)
    if team is not None:
        from chipledger.monitoring.alerts import AlertsError, check_team
        from chipledger.reports.statements import known_teams

        try:
            check_team(_lake_read(lambda: known_teams(con), lake), team)
        except AlertsError as e:
            _fail(str(e), 2)
    t_at = _instant(at, "--at")
    rows = _lake_read(lambda: pending_queue(con, pool, team, at=t_at), lake)
    as_of = _lake_read(lambda: books_as_of(con, pool, t_at), lake)
    if as_json:
        console.file.write(json.dumps(rows) + "\n")
        return
    if as_of is None:
        _fail(f"no close of the books at or before --at {at}" if at else "the lake has no books yet", 1)
    if not rows:
        console.print("no job pending" + (f" in {pool}" if pool else "") + (f" for team {team}" if team else "")
                      + f" as of {as_of}", markup=False, highlight=False)
        return
    console.print(f"pending jobs, in queue order, as of {as_of} (the latest close of the books"
                  + (f" at or before {at})" if at else ")"), markup=False, highlight=False, soft_wrap=True)
    t = Table()
    for col, right in (("pool", False), ("#", True), ("team #", True), ("team", False), ("job", False),
                       ("priority", True), ("chips", True), ("waited", True)):
        id_column(t, col, right=right)
    t.add_column("reason")  # text: wraps at spaces only
    for r in rows:
        t.add_row(*map(escape, (r["pool"], f"{r['position']}/{r['queue_length']}", str(r["team_position"]),
                                r["team"], r["job_id"], str(r["priority"]), f"{r['chips']:g}",
                                _duration(r["waited_s"]), r["reason"])))
    print_table(t, console)
