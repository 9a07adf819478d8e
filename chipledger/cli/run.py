"""`chipledger run`, `demo` and `backtest`: folding an event file in-process, the seeded demo, what-if replays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
import typer.core
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from chipledger.reports.tables import print_table

from chipledger.config import Config

from chipledger.cli._common import ConfigOpt, PROGRESS_MIN_BYTES, _config, _fail, _os_error, _working, app, console, err


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
    jobs: Optional[int] = typer.Option(None, "--jobs", min=1, help="processes folding disjoint sets of pools "
                                       "(default: the machine's cores); the lake has the same rows whatever the "
                                       "number (docs/architecture.md, Parallel replays)"),
):
    """Fold an event file in-process (no Kafka, no server) and write the lake and the store."""
    summary = _run(events, lake, store, _config(config), overwrite, check, jobs)
    if as_json:
        console.file.write(json.dumps(summary.as_dict()) + "\n")
    else:
        print_summary(summary)
    if summary.lines == summary.blank:
        err.print(f"warning: {events} has no events ({summary.lines} line(s), all blank): nothing was folded",
                  highlight=False, markup=False, soft_wrap=True)
        if strict:
            raise typer.Exit(1)
    if summary.accepted == 0 and summary.dead_letter_total:
        # a run that accepts nothing is a failure, not a success with a table of dead letters (issue 35, item 7)
        codes = ", ".join(f"{c} {n:,}" for c, n in sorted(summary.dead_letters.items()))
        hint = _foreign_format_hint(events)
        _fail(f"no line of {events} was accepted: {summary.dead_letter_total:,} dead letter(s) ({codes}); "
              + (hint or "`chipledger run` folds JSONL events, one JSON object per line (docs/events.md)"), 1)
    if strict and summary.dead_letter_total:
        err.print(f"error: --strict: {summary.dead_letter_total:,} line(s) became dead letters (lines "
                  f"{_dead_lines(summary)})", highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(1)


def _foreign_format_hint(events: Path) -> str:
    """What to run instead when the file is another format an importer reads (Slurm's sacct output), or ""."""
    try:
        with events.open("rb") as f:
            head = f.read(4096).decode("utf-8", "replace").lstrip("\ufeff")
    except OSError:
        return ""
    first = next((line for line in head.splitlines() if line.strip()), "")
    cols = {c.strip() for c in first.split("|")}
    if "|" in first and "JobID" in cols and ({"State", "Submit", "Start", "AllocTRES", "Partition"} & cols):
        return (f"it looks like Slurm accounting (`sacct --parsable2`): convert it first with "
                f"`chipledger import sacct {events} -o events.jsonl`, then `chipledger run --events events.jsonl`")
    if first.split()[:1] == ["JobID"]:
        return ("it looks like `sacct` output in columns: dump it with `sacct --parsable2 -a -D -X --format=…` "
                "(docs/importers.md) and convert it with `chipledger import sacct FILE -o events.jsonl`")
    return ""


def _dead_lines(summary, code=None) -> str:
    lines = sorted(n for c, ns in summary.dead_letter_lines.items() if code is None or c == code for n in ns)
    shown = ", ".join(map(str, lines[:10]))
    total = summary.dead_letters[code] if code else summary.dead_letter_total
    return shown + (f", … ({total - len(lines[:10]):,} more)" if total > len(lines[:10]) else "")


def _run(events: Path, lake: Optional[Path], store: Optional[str], cfg: Config, overwrite: bool, check: bool,
         jobs: Optional[int] = None):
    from chipledger.config import fold_config
    from chipledger.embedded import RunError, RunInterrupted, cores, run_file
    from store import open_store
    from store.repo import StoreError

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
                                      max_event_bytes=cfg.ledger.max_event_bytes, jobs=jobs or cores())
        else:
            summary, _ = run_file(events, lake, fold_config=fold, overwrite=overwrite, store=st,
                                  max_event_bytes=cfg.ledger.max_event_bytes, jobs=jobs or cores())
    except RunInterrupted as e:  # Ctrl-C: one line, the shell's code for SIGINT
        err.print(str(e), highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(130)
    except KeyboardInterrupt:  # before the run began
        err.print(f"interrupted: nothing was committed to lake {lake}", highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(130)
    except RunError as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot run into lake {lake}: {_os_error(e)}")
    return summary


def _counts_table(title: str) -> Table:
    t = Table(title=title, show_header=False)
    t.add_column("what")
    t.add_column("count", justify="right", no_wrap=True)
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
    print_table(t, console)
    console.print(f"lake: {summary.lake} (commit {summary.commit}: the run's files are its books)", highlight=False)


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
    from chipledger.adapters.importers.base import TraceFormatError
    from chipledger.adapters.importers.registry import SHARED_TRACE_DIRS, find_shared_trace
    from chipledger.config import fold_config

    fold = fold_config(_config(config))
    import io

    shown = Console(file=io.StringIO()) if as_json else console  # --json: the tables are not printed
    if trace is None:
        if not days > 0:
            _fail(f"--days must be more than 0, got {days:g}", 2)
        try:
            with _working(f"simulating {days:g} days of the fleet and folding them…"):
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
    config: Optional[List[Path]] = typer.Option(None, "--config", help="the configuration to try ([policy], "
                                                "[backtest] quota; default: the defaults, with --quota); repeat it "
                                                "for a sweep (the configurations are simulated in parallel)"),
    baseline: Optional[Path] = typer.Option(None, "--baseline", help="a second configuration, side by side "
                                            "(default: the defaults with the log's own quotas)"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for backtest.json and backtest.html"),
    quota: Optional[str] = typer.Option(None, "--quota", help="team=chips,… or pool:team=chips,…: the grants of "
                                        "--config's run (overrides its [backtest] quota)"),
    days: Optional[float] = typer.Option(None, "--days", help="only jobs submitted within this many days of "
                                         "the log's start"),
    new_team: bool = typer.Option(False, "--new-team", help="let --quota name a team the log does not have "
                                  "(else an error listing the log's teams)"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
    jobs: Optional[int] = typer.Option(None, "--jobs", min=1, help="processes reading the log (a part of the "
                                       "file each) and configurations simulated at once, each in a process of its "
                                       "own (default: the machine's cores)"),
):
    """Replay a log's demand (submissions, chips, priorities, observed run times) through the simulated
    cluster under --config (and --baseline), the ledger deciding; report quota honoured, waits, lost work,
    utilisation, borrowed share, fairness and bursts side by side, and the simulated against the observed
    waits (docs/backtest.md)."""
    from chipledger.embedded import cores
    from chipledger.sim.backtest import BacktestError, print_report, run_cli

    configs = list(config or [])
    if not configs and quota is None:
        _fail("give --config FILE or --quota team=chips,… (or both): the change to try", 2)
    # the column of the change is named by what changed: the file, the --quota, or both (issue 35, item 11)
    alt_name = " + ".join(n for n in (configs[0].name if configs else None,
                                      f"--quota {quota}" if quota else None) if n)
    try:
        base_cfg = _config(baseline) if baseline is not None else Config()
        alt_cfg = _config(configs[0]) if configs else Config()
        with _working("replaying the demand under every configuration…"):
            report = run_cli(events, alt_cfg, base_cfg, alt_name,
                             baseline.name if baseline is not None else "defaults", quota, days, out,
                             allow_new_team=new_team, more=tuple((c.name, _config(c)) for c in configs[1:]),
                             jobs=jobs or cores())
    except BacktestError as e:
        _fail(str(e), e.exit_code)
    for w in report.get("warnings", []):
        err.print(f"warning: {w}", markup=False, highlight=False, soft_wrap=True)
    if as_json:
        console.file.write(json.dumps(report) + "\n")
    else:
        print_report(report, console)
