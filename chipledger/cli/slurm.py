"""`chipledger slurm watch|actuate`: the command line of the Slurm adapter (wiring only; docs/slurm.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from chipledger.cli._common import _fail, _log

from chipledger.reports.tables import CliConsole

slurm_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        help="A live Slurm: watch it into events, apply the ledger's preemptions to it.")
err = CliConsole(stderr=True)  # wide in a pipe: lines and tables never folded
out = CliConsole()



def _cluster(name: Optional[str]) -> str:
    from chipledger.adapters.slurm import commands

    if name:
        return name
    try:
        return commands.cluster_name()
    except commands.SlurmError as e:
        _fail(f"cannot tell the cluster's name ({e}); pass --cluster", 2)


ClusterOpt = typer.Option(None, "--cluster", help="Slurm ClusterName (default: scontrol show config)")
ConfigOpt = typer.Option(None, "--config", help="chipledger.toml (default: ./chipledger.toml if present)",
                         dir_okay=False)


def _bootstrap(bootstrap: Optional[str], config: Optional[Path]):
    """The Kafka connection: [kafka] config and environment (address, and credentials where streams.clients
    provides them: the same as every chipledger producer), --bootstrap overriding the address."""
    from chipledger.cli._common import _adapter_kafka
    from chipledger.config import ConfigError, load_config

    try:
        cfg = load_config(config)
    except ConfigError as e:
        _fail(str(e), 2)
    return _adapter_kafka(cfg, bootstrap, _fail)


@slurm_app.command("watch")
def watch(
    cluster: Optional[str] = ClusterOpt,
    state: Path = typer.Option(Path("slurm-watch.state"), "--state", help="the watcher's cursor (JSON file)"),
    emit: str = typer.Option("jsonl", "--emit", help="jsonl (to --out) or kafka (to the input topics)"),
    out_file: Optional[Path] = typer.Option(None, "--out", help="JSONL file the events are appended to"),
    since: Optional[str] = typer.Option(None, "--since", help="first poll only: now, cluster (when it registered "
                                        "with slurmdbd), epoch seconds or ISO 8601 (default now)"),
    interval: float = typer.Option(30.0, "--interval", help="seconds between polls"),
    settle: int = typer.Option(5, "--settle", help="seconds an instant must be in the past before it is sent"),
    once: bool = typer.Option(False, "--once", help="poll once and exit"),
    prices: bool = typer.Option(False, "--prices", help="also mirror the partitions' TRESBillingWeights (GPU) as "
                                "price.set and the associations' GrpTRESMins as monthly budget.set (the Kafka "
                                "principal needs `--may prices`)"),
    bootstrap: Optional[str] = typer.Option(None, "--bootstrap", help="Kafka bootstrap (default [kafka] bootstrap)"),
    config: Optional[Path] = ConfigOpt,
):
    """Poll Slurm (sinfo, sacctmgr, sacct -D) and send inventory, chip states, quotas and jobs as events.

    Ids derive from Slurm's own, and --state is the cursor: polling again or restarting sends nothing twice."""
    from chipledger.adapters.slurm.commands import SlurmError
    from chipledger.adapters.slurm.watch import JsonlSink, KafkaSink, Watcher, WatchError, parse_since
    from chipledger.cli._common import _watch_sink

    name = _cluster(cluster)
    sink = _watch_sink(emit, out_file, JsonlSink, KafkaSink, lambda: _bootstrap(bootstrap, config), _fail)
    try:
        first = None if state.exists() else parse_since(since or "now", name)
        watcher = Watcher(name, state, sink, since=first, settle_s=settle, log=_log, prices=prices)
    except (WatchError, SlurmError) as e:
        _fail(str(e), 2)
    try:
        while True:
            try:
                res = watcher.poll()
                _log(f"watermark {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(res.watermark))}: sent "
                     f"{res.sent} {json.dumps(res.by_type, sort_keys=True)}"
                     + (f", late {res.late}" if res.late else "")
                     + (f", notes {json.dumps(res.notes, sort_keys=True)}" if res.notes else ""))
            except SlurmError as e:
                if once:
                    _fail(str(e), 1)
                _log(f"poll failed, retrying in {interval:g}s: {e}")
            if once:
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        sink.close()


@slurm_app.command("actuate")
def actuate(
    cluster: Optional[str] = ClusterOpt,
    state: Path = typer.Option(Path("slurm-actuate.state"), "--state", help="decision ids applied (JSON file)"),
    decisions: Optional[Path] = typer.Option(None, "--decisions", help="JSONL file of decisions"),
    lake: Optional[Path] = typer.Option(None, "--lake", help="read decisions from a lake (embedded runs)"),
    kafka: bool = typer.Option(False, "--kafka", help="consume chipledger.decisions"),
    action: str = typer.Option("requeue", "--action", help="requeue (scontrol requeue) or cancel (scancel)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="say what would be done, change nothing"),
    follow: bool = typer.Option(False, "--follow", help="with --kafka: keep consuming"),
    bootstrap: Optional[str] = typer.Option(None, "--bootstrap", help="Kafka bootstrap (default [kafka] bootstrap)"),
    config: Optional[Path] = ConfigOpt,
    as_json: bool = typer.Option(False, "--json", help="print each decision's victims and what was done (or would "
                                                       "be) as JSON"),
):
    """Apply each decision.preempt of this cluster's pools to its victims, once per decision id. Prints each
    decision's victims and what was done to each, or why it was skipped (--dry-run: what would be done)."""
    from chipledger.adapters.slurm.actuate import ActuateError, Actuator, decisions_from_kafka
    from chipledger.cli._common import _actuate
    from chipledger.adapters.slurm.commands import SlurmError

    if sum(x is not None and x is not False for x in (decisions, lake, kafka or None)) != 1:
        _fail("give exactly one of --decisions FILE, --lake DIR, --kafka", 2)
    name = _cluster(cluster)
    try:
        act = Actuator(name, state, action=action, dry_run=dry_run, log=_log)
    except ActuateError as e:
        _fail(str(e), 2)
    totals, done = _actuate(act, decisions, lake,
                            lambda: decisions_from_kafka(_bootstrap(bootstrap, config), name, follow=follow),
                            (ActuateError, SlurmError), _fail, keep=True)
    outcomes = [(o, {str(v.get("job_id", "")): v for v in d.get("victims") or ()}) for o, d in done]
    if as_json:
        out.file.write(json.dumps({"dry_run": dry_run, "action": action, "totals": totals,
                                   "decisions": [_outcome_json(o, victims) for o, victims in outcomes]}) + "\n")
        return
    _print_outcomes(outcomes)
    out.print(" ".join(f"{k} {v}" for k, v in totals.items()) + (" (dry run)" if dry_run else ""), highlight=False)


def _outcome_json(o, victims: dict) -> dict:
    """One decision: its victims and what was done (or would be) to each, or why the decision was skipped."""
    return {"decision_id": o.decision_id, "pool": o.pool, "skipped": o.skipped or None,
            "victims": [{"job_id": j, "team": victims.get(j, {}).get("team"), "chips": victims.get(j, {}).get("chips"),
                         "done": what} for j, what in o.applied]
                       + [{"job_id": j, "team": victims.get(j, {}).get("team"), "chips": victims.get(j, {}).get("chips"),
                           "skipped": f"not running ({state.lower() if state else 'gone'})"} for j, state in o.gone]}


def _print_outcomes(outcomes: list) -> None:
    """A table: each decision's victims and what was done to each (or would be), or why it was skipped."""
    from rich.table import Table

    from chipledger.reports.tables import id_column, print_table

    if not outcomes:
        return
    t = Table(title="decisions and their victims")
    for col in ("decision", "pool", "victim", "team", "chips"):
        id_column(t, col, right=col == "chips")
    t.add_column("what")
    for o, victims in outcomes:
        if o.skipped:
            t.add_row(o.decision_id, o.pool, "–", "", "", f"decision skipped: {o.skipped}")
            continue
        for j, what in o.applied:
            v = victims.get(j, {})
            t.add_row(o.decision_id, o.pool, j, str(v.get("team", "")), str(v.get("chips", "")), what)
        for j, state in o.gone:
            v = victims.get(j, {})
            t.add_row(o.decision_id, o.pool, j, str(v.get("team", "")), str(v.get("chips", "")),
                      f"skipped: not running ({state.lower() if state else 'gone'})")
    for cell in t.columns:
        cell._cells = [escape(c) if isinstance(c, str) else c for c in cell._cells]
    print_table(t, out)
