"""`chipledger grafana dashboard`: a Grafana dashboard (JSON model, schemaVersion 39) over the metrics of
`/metrics` (streams/metrics.py) and the recording rules of `chipledger slo rules` (chipledger/monitoring/slo_rules.py).

Chips of different flavors are never added up: fleet panels show one series per pool, or sum by flavor (an H100
and a TPU v5e chip are not the same unit). Variables: the Prometheus data source, the pools and the teams.
"""

from __future__ import annotations

import json

from analytics.slo_views import SLOS
from chipledger.monitoring.slo_rules import ALERT_NAME, BURN_RULES

POOL = 'pool=~"$pool"'
TEAM = 'pool=~"$pool", team=~"$team"'


def _ts(title: str, exprs: list[tuple[str, str]], unit: str = "short", stack: bool = False, desc: str = "",
        kind: str = "timeseries", max_: float | None = None) -> dict:
    panel = {
        "type": kind, "title": title, "description": desc,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "targets": [{"refId": chr(ord("A") + i), "expr": e, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, (e, legend) in enumerate(exprs)],
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"stacking": {"mode": "normal" if stack else "none"}}},
                        "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull"]}},
    }
    if max_ is not None:
        panel["fieldConfig"]["defaults"]["max"] = max_
    return panel


def _zero(panel: dict) -> dict:
    """No series shows as 0, not "No data"."""
    panel["fieldConfig"]["defaults"]["noValue"] = "0"
    return panel


def _row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def _thresholds(panel: dict, factor: float, color: str = "red") -> dict:
    """Draw a dashed line at `factor` (the alert's burn rate) on a time series panel."""
    d = panel["fieldConfig"]["defaults"]
    d["thresholds"] = {"mode": "absolute", "steps": [{"color": "transparent", "value": None},
                                                     {"color": color, "value": factor}]}
    d["custom"]["thresholdsStyle"] = {"mode": "dashed"}
    return panel


def burn_panel(long_w: str, short_w: str, factor: float, severity: str) -> dict:
    """Burn rate (error ratio / budget) over an alert's two windows: one legend entry per window and series, and
    the alert's factor as a threshold line (it fires when both windows are above it)."""
    def burn(w: str) -> tuple[str, str]:
        return (f"chipledger:slo_errors:ratio_rate{w}{{{POOL}}} / on (slo) group_left () "
                "chipledger:slo_error_budget:ratio", "{{slo}} {{pool}} {{team}} over " + w)

    return _thresholds(_ts(f"Burn rate over {long_w} and {short_w} ({severity} at {factor:g} on both)",
                           [burn(long_w), burn(short_w)],
                           desc=f"Error ratio over each window divided by the error budget (1 − target): 1 spends "
                                f"the budget exactly over the window; the {severity} fires when both lines are at "
                                f"or above {factor:g} (the dashed line)."), factor)


def budget_stat(slo: str) -> dict:
    """A stat: the budget left of one SLO, its worst pool (and team), as a share of the budget."""
    panel = _ts(f"Budget left: {slo}", [(
        f'min(chipledger:slo_error_budget_remaining:ratio{{slo="{slo}", {POOL}}})', slo)], unit="percentunit",
        kind="stat", desc=f"1 − errors over the budget window / budget, the lowest of the selected pools (and "
                          f"teams) for {slo}; below 0 the SLO is missed.")
    panel["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "background", "graphMode": "area", "textMode": "value"}
    panel["fieldConfig"]["defaults"]["thresholds"] = {"mode": "absolute", "steps": [
        {"color": "red", "value": None}, {"color": "orange", "value": 0}, {"color": "green", "value": 0.25}]}
    panel["fieldConfig"]["defaults"]["noValue"] = "no events"  # e.g. throughput while no job reports progress
    panel["gridPos_w"] = 24 // len(SLOS)
    return panel


def panels() -> list[dict]:
    return [
        _row("Fleet (per pool; sums only by flavor)"),
        _ts("Chips by pool", [
            (f"chipledger_pool_registered_chips{{{POOL}}}", "{{pool}} registered"),
            (f"chipledger_pool_healthy_chips{{{POOL}}}", "{{pool}} healthy"),
            (f"chipledger_pool_down_chips{{{POOL}}}", "{{pool}} down"),
            (f"chipledger_pool_idle_chips{{{POOL}}}", "{{pool}} idle"),
        ], desc="Registered, healthy (healthy or degraded), down or in maintenance, and idle chips of each pool."),
        _ts("Healthy and idle chips by flavor", [
            (f"sum by (flavor) (chipledger_pool_healthy_chips{{{POOL}}})", "{{flavor}} healthy"),
            (f"sum by (flavor) (chipledger_pool_idle_chips{{{POOL}}})", "{{flavor}} idle"),
        ], desc="Summed across the pools of one flavor only."),
        _ts("Use by account, per pool", [
            (f"sum by (pool) (chipledger_team_in_quota_chips{{{POOL}}})", "{{pool}} in quota"),
            (f"sum by (pool) (chipledger_team_borrowed_chips{{{POOL}}})", "{{pool}} borrowed"),
            (f"sum by (pool) (chipledger_team_burst_chips{{{POOL}}})", "{{pool}} burst"),
        ], stack=True),
        _ts("Jobs running and pending, per pool", [
            (f"sum by (pool) (chipledger_team_running_jobs{{{POOL}}})", "{{pool}} running"),
            (f"sum by (pool) (chipledger_team_pending_jobs{{{POOL}}})", "{{pool}} pending"),
        ]),
        _row("Teams: use against quota"),
        _ts("Used vs nominal quota", [
            (f"chipledger_team_used_chips{{{TEAM}}}", "{{pool}} {{team}} used"),
            (f"chipledger_team_nominal_chips{{{TEAM}}}", "{{pool}} {{team}} nominal"),
        ]),
        _ts("Borrowed and burst chips", [
            (f"chipledger_team_borrowed_chips{{{TEAM}}}", "{{pool}} {{team}} borrowed"),
            (f"chipledger_team_burst_chips{{{TEAM}}}", "{{pool}} {{team}} burst"),
        ]),
        _ts("Fair-share factor (0.5 = using exactly its share)", [
            (f"chipledger_team_fair_share_factor{{{TEAM}}}", "{{pool}} {{team}}"),
        ], max_=1.0),
        _ts("Borrowed share of the pool's lendable chips", [
            (f"chipledger_team_borrowed_share{{{TEAM}}}", "{{pool}} {{team}}"),
        ], unit="percentunit"),
        _ts("Jobs waiting longer than [slo] sched_slo_s now", [
            (f"chipledger_team_pending_jobs_over_slo{{{TEAM}}}", "{{pool}} {{team}}"),
        ], desc="The wait SLOs count a wait when it ends: this shows the waits that will count as late."),
        _zero(_ts("Pending chips by reason", [
            (f"sum by (pool, reason) (chipledger_team_pending_chips{{{TEAM}}})", "{{pool}} {{reason}}"),
            # nothing pending has no series at all: 0 per pool, so the panel shows 0 rather than "No data"
            (f"sum by (pool) (chipledger_team_pending_chips{{{TEAM}}}) or sum by (pool) "
             f"(0 * chipledger_pool_registered_chips{{{POOL}}})", "{{pool}} all reasons"),
        ], stack=False, desc="Why jobs wait (docs/policy.md); `chipledger why JOB` tells one job's story. "
                             "\"all reasons\" is their sum, 0 when nothing waits.")),
        _row("SLOs: error budgets and burn rates"),
        *[budget_stat(slo) for slo in SLOS],
        _ts("Error budget left (rolling window)", [
            (f"chipledger:slo_error_budget_remaining:ratio{{{POOL}}}", "{{slo}} {{pool}} {{team}}"),
        ], unit="percentunit", desc="1 − (errors over the window / budget); below 0 the SLO is missed."),
        *[burn_panel(long_w, short_w, factor, severity) for _, severity, factor, long_w, short_w in BURN_RULES],
        _ts("Burn-rate alerts firing", [
            (f'count by (severity, slo, pool) (ALERTS{{alertname="{ALERT_NAME}", alertstate="firing", {POOL}}})',
             "{{severity}} {{slo}} {{pool}}"),
        ], desc="The alerts of `chipledger slo rules` (Prometheus' ALERTS series)."),
        _row("Fragmentation"),
        _ts("Free chips: all, on whole free nodes, largest startable job", [
            (f"chipledger_pool_free_chips{{{POOL}}}", "{{pool}} free"),
            (f"chipledger_pool_free_whole_node_chips{{{POOL}}}", "{{pool}} on whole nodes"),
            (f"chipledger_pool_largest_startable_job_chips{{{POOL}}}", "{{pool}} largest job"),
        ]),
        _ts("Fragmented share of free chips", [
            (f"1 - chipledger_pool_free_whole_node_chips{{{POOL}}} / chipledger_pool_free_chips{{{POOL}}}", "{{pool}}"),
        ], unit="percentunit"),
        _row("Decisions and lost work"),
        _ts("Decisions per hour", [
            (f"sum by (pool, type, rule, verdict) (increase(chipledger_decisions_total{{{POOL}}}[1h]))",
             "{{pool}} {{type}} {{rule}} {{verdict}}"),
        ]),
        _ts("Preemption victims per hour, by team", [
            (f"sum by (pool, team) (increase(chipledger_preemption_victims_total{{{TEAM}}}[1h]))", "{{pool}} {{team}}"),
        ]),
        _ts("Work lost (chip-seconds per second)", [
            (f"sum by (pool, team) (rate(chipledger_lost_chip_seconds_total{{{TEAM}}}[$__rate_interval]))",
             "{{pool}} {{team}}"),
        ]),
        _row("The worker"),
        _ts("Seconds since the last record folded, per pool", [
            (f"time() - chipledger_pool_last_fold_timestamp_seconds{{{POOL}}}", "{{pool}}"),
        ], unit="s"),
        _ts("Event time behind wall time, per pool", [
            (f"time() - chipledger_pool_clock_timestamp_seconds{{{POOL}}}", "{{pool}}"),
        ], unit="s"),
        _ts("Events applied and dead letters per second", [
            (f"sum by (pool) (rate(chipledger_events_applied_total{{{POOL}}}[$__rate_interval]))", "{{pool}} applied"),
            ("sum by (code) (rate(chipledger_dead_letters_total[$__rate_interval]))", "dead letters {{code}}"),
        ]),
        _ts("Fold time per record (p50, p99)", [
            ("histogram_quantile(0.5, sum by (le) (rate(chipledger_fold_duration_seconds_bucket[$__rate_interval])))",
             "p50"),
            ("histogram_quantile(0.99, sum by (le) (rate(chipledger_fold_duration_seconds_bucket[$__rate_interval])))",
             "p99"),
        ], unit="s"),
        _ts("Consumer lag (records)", [("sum by (topic) (chipledger_consumer_lag_records)", "{{topic}}")]),
    ]


def _layout(items: list[dict]) -> list[dict]:
    out, x, y = [], 0, 0
    for i, p in enumerate(items, start=1):
        p = dict(p, id=i)
        if p["type"] == "row":
            if x:
                y += 8
            x = 0
            p["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
            y += 1
        else:
            w = p.pop("gridPos_w", 12)
            h = 4 if p["type"] == "stat" else 8
            if x + w > 24:
                x, y = 0, y + 8
            p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
            x += w
            if x >= 24:
                x, y = 0, y + h
        out.append(p)
    return out


def dashboard(slo_params=None) -> dict:
    def var(name, query, label):
        return {"name": name, "label": label, "type": "query", "datasource": {"type": "prometheus",
                                                                             "uid": "${datasource}"},
                "query": {"query": query, "refId": f"{name}-var"}, "definition": query, "refresh": 2,
                "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}}

    return {
        "uid": "chipledger", "title": "chipledger: quota, demand and SLOs", "tags": ["chipledger"],
        "timezone": "utc", "schemaVersion": 39, "version": 1, "editable": True, "refresh": "1m",
        "time": {"from": "now-24h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
            var("pool", "label_values(chipledger_pool_info, pool)", "pool"),
            var("team", "label_values(chipledger_team_nominal_chips, team)", "team"),
        ]},
        "annotations": {"list": []},
        "panels": _layout(panels()),
    }


def dashboard_json(slo_params=None) -> str:
    return json.dumps(dashboard(slo_params), indent=2) + "\n"
