"""`chipledger slo rules`, `grafana dashboard`, `serve-metrics` and `metrics history`: Prometheus and Grafana over the
ledger."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
import typer.core

from chipledger.cli._common import (ConfigOpt, _config, _fail, _instant, _lake_dir, _write_text, app, err, grafana_app,
                                   slo_app)


@slo_app.command("rules")
def slo_rules_cmd(
    out: Optional[Path] = typer.Option(None, "--out", help="file to write (default: standard output)"),
    fmt: str = typer.Option("prometheus", "--format", help="prometheus (rule file) | openslo (OpenSLO v1 documents)"),
    config: Optional[Path] = ConfigOpt,
    as_json: bool = typer.Option(False, "--json", help="without --out: the rule file as JSON (Prometheus reads it: "
                                                       "JSON is YAML); with --out: what was written, as JSON"),
):
    """Prometheus recording rules (error ratio of each SLO over 5m, 30m, 1h, 6h, 3d and the budget window) and
    multi-window burn-rate alerting rules (page 14.4x over 1h & 5m, page 6x over 6h & 30m, ticket 1x over 3d &
    6h, and a ticket while a budget is spent) from the [slo] targets, over the counters of /metrics. Check them
    with `promtool check rules`."""
    from chipledger.monitoring.slo_rules import openslo, prometheus_rules

    cfg = _config(config)
    if fmt not in ("prometheus", "openslo"):
        _fail(f"--format must be prometheus or openslo, got {fmt!r}", 2)
    if as_json:
        import json

        import yaml

        if fmt == "prometheus":
            from chipledger.monitoring.slo_rules import rule_groups

            doc = rule_groups(cfg.slo)
        else:
            doc = list(yaml.safe_load_all(openslo(cfg.slo)))
        if out is None:
            _write_text(json.dumps(doc) + "\n", None)
            return
        _write_text(prometheus_rules(cfg.slo) if fmt == "prometheus" else openslo(cfg.slo), out)
        groups = doc["groups"] if fmt == "prometheus" else []
        typer.echo(json.dumps({"written": str(out), "format": fmt, "groups": [
            {"name": g["name"], "recording_rules": sum("record" in r for r in g["rules"]),
             "alerting_rules": sum("alert" in r for r in g["rules"])} for g in groups],
            "documents": len(doc) if fmt == "openslo" else None}))
        return
    _write_text(prometheus_rules(cfg.slo) if fmt == "prometheus" else openslo(cfg.slo), out)


@grafana_app.command("dashboard")
def grafana_dashboard_cmd(
    out: Optional[Path] = typer.Option(None, "--out", help="file to write (default: standard output)"),
    config: Optional[Path] = ConfigOpt,
):
    """A Grafana dashboard (JSON, import it or provision it) over /metrics and the rules of `slo rules`: fleet per
    pool and flavor, team use against quota, pending by reason, error budgets and burn rates, fragmentation,
    decisions, and the worker's health."""
    from chipledger.monitoring.grafana import dashboard_json

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
    from chipledger.monitoring.server import LakeMetrics, run_server
    from chipledger.cli._common import _demo_lake

    lake = _demo_lake(lake, config)
    cfg = _config(config)
    lm = LakeMetrics(_lake_dir(lake, cfg), fold_config(cfg))

    listening = False

    def started(bound: int) -> None:
        nonlocal listening
        listening = True
        err.print(f"serve-metrics: http://{host}:{bound}/metrics (folding {lm.lake}: chipledger_metrics_loading 1 "
                  f"until done)", highlight=False)

    def loaded(n: int) -> None:
        err.print(f"serve-metrics: folded {n:,} events of {len(lm.fleet.pools)} pools from {lm.lake}",
                  highlight=False)

    try:
        asyncio.run(run_server(lm, host, port, poll, started=started, loaded=loaded))
    except KeyboardInterrupt:
        pass
    except OSError as e:
        if not listening:
            _fail(f"cannot listen on {host}:{port}: {e.strerror or e}")
        _fail(f"cannot read lake {lm.lake}: {e}")
    except Exception as e:  # noqa: BLE001 - a lake that cannot be read: say which and why
        _fail(f"cannot read lake {lm.lake}: {e}")


metrics_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                          help="The metrics of /metrics over a lake's history (for Prometheus backfill).")
app.add_typer(metrics_app, name="metrics")


def _seconds(text: str, option: str) -> int:
    from chipledger.monitoring.alerts import AlertsError, parse_duration

    try:
        s = parse_duration(text)
    except AlertsError:
        _fail(f"{option} {text!r} is not a duration (e.g. 60s, 5m, 1h)", 2)
    if s <= 0:
        _fail(f"{option} must be positive, got {text!r}", 2)
    return s


@metrics_app.command("history")
def metrics_history(
    lake: Optional[Path] = typer.Option(None, "--lake", help="lake folder (default [lake] path = ./lake)"),
    out: Path = typer.Option(..., "--out", "-o", help="OpenMetrics file to write ('-': standard output)"),
    step: str = typer.Option("60s", "--step", help="time between two samples of a series (event time)"),
    start: Optional[str] = typer.Option(None, "--start", help="first instant (ISO 8601; default: the first event)"),
    end: Optional[str] = typer.Option(None, "--end", help="last instant (ISO 8601; default: the last event)"),
    config: Optional[Path] = ConfigOpt,
):
    """Write the lake's history as OpenMetrics for `promtool tsdb create-blocks-from openmetrics FILE DATA_DIR`: the
    series /metrics serves (same names and labels), sampled every --step of event time, as a worker folding the
    lake's events as they happened would have served them. Then backfill the recording rules with `promtool tsdb
    create-blocks-from rules` (docs/monitoring.md, "History")."""
    import sys

    from chipledger.config import fold_config
    from chipledger.monitoring.history import write_history

    cfg = _config(config)
    lake_dir = _lake_dir(lake, cfg)
    step_s = _seconds(step, "--step")
    if step_s > 300:
        err.print(f"metrics history: --step {step_s} s is longer than Prometheus' lookback (5 minutes by default): "
                  "gauges go stale between two samples", highlight=False, soft_wrap=True)
    t0, t1 = _instant(start, "--start"), _instant(end, "--end")
    start_s = None if t0 is None else int(t0.timestamp())
    end_s = None if t1 is None else int(t1.timestamp())
    if start_s is not None and end_s is not None and end_s < start_s:
        _fail("--end is before --start", 2)
    try:
        if str(out) == "-":
            summary = write_history(lake_dir, fold_config(cfg), sys.stdout, step_s, start_s, end_s)
        else:
            tmp = out.with_name(out.name + ".part")
            with tmp.open("w", encoding="utf-8") as f:
                summary = write_history(lake_dir, fold_config(cfg), f, step_s, start_s, end_s)
            tmp.replace(out)
    except OSError as e:
        _fail(f"cannot write {out}: {e.strerror or e}")
    except duckdb_errors() as e:
        _fail(f"cannot read lake {lake_dir}: {e}")
    from datetime import datetime, timezone

    def iso(s):
        return "-" if s is None else datetime.fromtimestamp(s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    err.print(f"metrics history: {summary.events:,} events folded, {summary.series:,} series, {summary.samples:,} "
              f"samples at {summary.steps:,} instants {iso(summary.first_s)} .. {iso(summary.last_s)} every {step_s} s"
              + (f"; {summary.skipped:,} event rows did not fold again (a lake written with another [ledger] or "
                 f"[policy] configuration?)" if summary.skipped else "")
              + ("" if str(out) == "-" else f" -> {out}"), highlight=False, soft_wrap=True)


def duckdb_errors():
    import duckdb

    return duckdb.Error
