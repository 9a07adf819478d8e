"""`chipledger slo rules`, `grafana dashboard` and `serve-metrics`: Prometheus and Grafana over the ledger."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
import typer.core

from chipledger.cli._common import ConfigOpt, _config, _fail, _lake_dir, _write_text, app, err, grafana_app, slo_app


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
