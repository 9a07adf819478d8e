"""`chipledger slo rules`: Prometheus recording and alerting rules over the SLO counters of `/metrics`
(streams/metrics.py SLO_COUNTERS), from the `[slo]` targets; or the same SLOs as OpenSLO v1 documents.

The SRE workbook's multi-window, multi-burn-rate alerts (ch. 5 of "The Site Reliability Workbook"), the windows
and thresholds of the `burn_alerts` view (docs/analytics.md):

- recording rules: each SLO's error ratio (1 − good/total; 0 over a window without events) over 5m, 30m, 1h, 6h, 3d and the budget window
  (`[slo] window_days`, 30d), `chipledger:slo_errors:ratio_rate<window>{slo, pool[, team]}`; the target and the
  budget (1 − target) as `chipledger:slo_target:ratio` and `chipledger:slo_error_budget:ratio`; the budget left
  over the window `chipledger:slo_error_budget_remaining:ratio`;
- alerting rules `ChipledgerErrorBudgetBurn`: page when both the 1h and the 5m error ratio burn at least 14.4×
  the budget, page at 6× over 6h and 30m, ticket at 1× over 3d and 6h, and a ticket (`budget_exhausted`) while
  the budget window's budget is spent; labels `severity`, `slo`, `alert`
  (page_1h, page_6h, ticket_3d, as in `chipledger alerts`), `long_window`, `short_window`, and the `pool` (and
  `team`) of the series.

Budgets (analytics/cost_views.py `budget_alerts`, the same rules): `chipledger:team_cost:rate<window>{team, unit}`
(the teams' in-quota, borrowed and burst cost per second, from `chipledger_team_cost_total`), the burn
`chipledger:budget_burn:rate<window>{team, unit, period}` (that rate / `chipledger_team_budget_rate`, the budget
per second of its current period), and `ChipledgerBudgetBurn`: page at 2× over 1d and 1h, ticket at 1× over 3d
and 6h; labels `severity`, `slo` = budget, `alert` (budget_page, budget_ticket, as in `chipledger alerts`),
`long_window`, `short_window`, and the series' `team`, `unit`, `period`.

Availability is a pool's SLO (its chips); quota honoured, scheduling latency, goodput and throughput are counted per team
and rated per pool and team, so a page names the team whose in-quota jobs do not start.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from analytics.cost_views import BUDGET_RULES, BUDGET_WINDOWS_S
from analytics.slo_views import SLOS
from streams.metrics import SLO_COUNTERS

#: (alert id, severity, burn rate, long window, short window): the burn_alerts view's rules
BURN_RULES = (
    ("page_1h", "page", 14.4, "1h", "5m"),
    ("page_6h", "page", 6.0, "6h", "30m"),
    ("ticket_3d", "ticket", 1.0, "3d", "6h"),
)
SHORT_WINDOWS = ("5m", "30m", "1h", "6h", "3d")


def budget_rule(slo_params) -> tuple:
    """The ticket while the budget window's error budget is spent (the burn_alerts view's `budget_exhausted`), in
    BURN_RULES' shape: burn at least 1 over the budget window (its budget left below 0)."""
    budget_w = f"{int(slo_params.window_days)}d"
    return ("budget_exhausted", "ticket", 1.0, budget_w, budget_w)


def budget_alert_rule(spec, slo_params) -> dict:
    """The alerting rule of budget_rule: an exhausted budget is never silent, even when nothing burns fast now."""
    alert, severity, burn, window, _ = budget_rule(slo_params)
    rule = alert_rule(spec, alert, severity, burn, window, window, int(slo_params.window_days),
                      getattr(slo_params, "runbook_url", ""))
    who = "pool {{ $labels.pool }}" + (" team {{ $labels.team }}" if "team" in spec.by else "")
    rule["expr"] = f'chipledger:slo_errors:ratio_rate{window}{{slo="{spec.slo}"}} >= ({burn:g} * {spec.budget:g})'
    rule["annotations"]["summary"] = f"{spec.slo} error budget spent on {who}"
    rule["annotations"]["description"] = (
        f"The {spec.slo} SLO (target {100 * spec.target:g}%) of {who} has spent its {int(slo_params.window_days)}-day "
        f"error budget (budget left below 0): {_DESCRIBE[spec.slo]}.")
    return rule


ALERT_NAME = "ChipledgerErrorBudgetBurn"
BUDGET_ALERT_NAME = "ChipledgerBudgetBurn"

_DESCRIBE = {
    "availability": "registered chips of the pool are down or in maintenance",
    "quota_honoured": "jobs that fit the team's unused quota do not start within [slo] sched_slo_s",
    "sched_latency": "jobs wait longer than [slo] sched_slo_s to start or restart",
    "goodput": "work is lost to preemptions and failures (allocated chip-seconds since the last checkpoint)",
    "throughput": "running jobs make progress below [slo] throughput_fraction of their own reference rate",
}
_LOOK = {
    "availability": "`chipledger report --pool {{ $labels.pool }}` (availability by day, error budgets); "
                    "`chipledger sql \"SELECT * FROM chip_states WHERE pool = '{{ $labels.pool }}' AND NOT available\"`",
    "quota_honoured": "`chipledger sql \"SELECT job_id, reason, message FROM pending WHERE pool = '{{ $labels.pool }}' "
                      "AND team = '{{ $labels.team }}'\"` then `chipledger why JOB_ID`; "
                      "`chipledger report --pool {{ $labels.pool }}`",
    "sched_latency": "`chipledger sql \"SELECT job_id, reason, message FROM pending WHERE pool = '{{ $labels.pool }}' "
                     "AND team = '{{ $labels.team }}'\"` then `chipledger why JOB_ID`; "
                     "`chipledger report --pool {{ $labels.pool }}`",
    "goodput": "`chipledger sql \"SELECT * FROM decisions WHERE pool = '{{ $labels.pool }}'\"` (preemptions and their "
               "victims); `chipledger report --pool {{ $labels.pool }}` (goodput by team)",
    "throughput": "`chipledger sql \"SELECT job_id, slow_s, slowest_fraction, unhealthy_chips_while_slow FROM throughput "
                  "WHERE pool = '{{ $labels.pool }}' AND team = '{{ $labels.team }}' AND slow_s > 0\"` then "
                  "`chipledger why JOB_ID`; `chipledger report --pool {{ $labels.pool }}`",
}


@dataclass(frozen=True)
class SloSpec:
    slo: str
    target: float
    total: str       # counter names
    good: str
    by: tuple[str, ...]  # labels the ratios are kept by

    @property
    def budget(self) -> float:
        return round(1.0 - self.target, 12)


def specs(slo_params) -> list[SloSpec]:
    out = []
    for name in SLOS:
        total, good, extra = SLO_COUNTERS[name]
        out.append(SloSpec(name, float(getattr(slo_params, name)), total, good, ("pool",) + extra))
    return out


def ratio_rule(spec: SloSpec, window: str) -> dict:
    by = ", ".join(spec.by)
    total = f"sum by ({by}) (rate({spec.total}[{window}]))"
    good = f"sum by ({by}) (rate({spec.good}[{window}]))"
    # a window without events has no errors, not 0/0: the ratio is 0 there (a NaN would show as a gap or "NaN" in
    # Grafana and make the budget left NaN; the alerts compare with >=, which NaN never is, so they do not change)
    return {"record": f"chipledger:slo_errors:ratio_rate{window}",
            "expr": f"({total} - {good}) / ({total} > 0)\nor\n{total} * 0",
            "labels": {"slo": spec.slo}}


def _team(spec: SloSpec, template: str) -> str:
    return template if "team" in spec.by else template.replace(" AND team = '{{ $labels.team }}'", "")


def alert_rule(spec: SloSpec, alert: str, severity: str, burn: float, long_w: str, short_w: str,
               window_days: int, runbook_url: str = "") -> dict:
    threshold = f"({burn:g} * {spec.budget:g})"
    sel = f'{{slo="{spec.slo}"}}'
    who = "pool {{ $labels.pool }}" + (" team {{ $labels.team }}" if "team" in spec.by else "")
    return {
        "alert": ALERT_NAME,
        "expr": (f"chipledger:slo_errors:ratio_rate{long_w}{sel} >= {threshold}\n"
                 f"and\nchipledger:slo_errors:ratio_rate{short_w}{sel} >= {threshold}"),
        "labels": {"severity": severity, "slo": spec.slo, "alert": alert, "long_window": long_w,
                   "short_window": short_w},
        "annotations": {
            "summary": f"{spec.slo} error budget burning at {burn:g}x or more on {who}",
            "description": (f"The {spec.slo} SLO (target {100 * spec.target:g}%) of {who} spends its "
                            f"{window_days}-day error budget at {burn:g}x the sustainable rate or faster, over "
                            f"both {long_w} and {short_w}: {_DESCRIBE[spec.slo]}."),
            "look_at": _team(spec, _LOOK[spec.slo]),
            **runbook(runbook_url, spec.slo, alert),
        },
    }


def budget_annotations(burn: float, long_w: str, short_w: str, team: str = "{{ $labels.team }}",
                       unit: str = "{{ $labels.unit }}") -> dict:
    """The annotations of a budget burn alert (Prometheus' rule and `chipledger alerts --alertmanager` alike)."""
    return {
        "summary": f"team {team} spends its {unit} budget at {burn:g}x or more",
        "description": (f"Team {team} spends its cost budget in {unit} at {burn:g}x the rate that lasts the period "
                        f"or faster, over both {long_w} and {short_w}: at this rate the budget runs out before the "
                        f"period ends."),
        "look_at": f"`chipledger sql \"SELECT * FROM budget WHERE team = '{team}'\"`; the team's statement "
                   f"(`chipledger statements --team {team}`): cost per pool and peak-band use",
    }


def budget_groups(runbook_url: str = "") -> list[dict]:
    """The budget burn rules: cost rates and burns per window, and the alerts of BUDGET_RULES (each with the
    `runbook_url` of `[slo] runbook_url`, as the SLO alerts)."""
    rules: list[dict] = []
    for w in BUDGET_WINDOWS_S:
        rules.append({"record": f"chipledger:team_cost:rate{w}",
                      "expr": f"sum by (team, unit) (rate(chipledger_team_cost_total[{w}]))",
                      "labels": {"slo": "budget"}})
        rules.append({"record": f"chipledger:budget_burn:rate{w}",
                      "expr": (f"chipledger:team_cost:rate{w}\n/ on (team, unit) group_right\n"
                               f"sum by (team, unit, period) (chipledger_team_budget_rate > 0)"),
                      "labels": {"slo": "budget"}})
    alerts = [{
        "alert": BUDGET_ALERT_NAME,
        "expr": (f"chipledger:budget_burn:rate{long_w} >= {burn:g}\nand\n"
                 f"chipledger:budget_burn:rate{short_w} >= {burn:g}"),
        "labels": {"severity": severity, "slo": "budget", "alert": alert, "long_window": long_w,
                   "short_window": short_w},
        "annotations": {**budget_annotations(burn, long_w, short_w), **runbook(runbook_url, "budget", alert)},
    } for alert, severity, burn, long_w, short_w in BUDGET_RULES]
    return [{"name": "chipledger-budget", "rules": rules}, {"name": "chipledger-budget-alerts", "rules": alerts}]


def runbook(template: str, slo: str, alert: str) -> dict:
    """The `runbook_url` annotation from `[slo] runbook_url` (`{slo}` and `{alert}` filled in), or none."""
    if not template:
        return {}
    return {"runbook_url": template.replace("{slo}", slo).replace("{alert}", alert)}


def rule_groups(slo_params) -> dict:
    """The rule file as a dict (YAML-ready): one recording group per SLO, one alerting group."""
    budget_w = f"{int(slo_params.window_days)}d"
    groups = []
    for spec in specs(slo_params):
        rules = [ratio_rule(spec, w) for w in SHORT_WINDOWS + (budget_w,)]
        rules += [
            {"record": "chipledger:slo_target:ratio", "expr": f"vector({spec.target:g})", "labels": {"slo": spec.slo}},
            {"record": "chipledger:slo_error_budget:ratio", "expr": f"vector({spec.budget:g})",
             "labels": {"slo": spec.slo}},
            {"record": "chipledger:slo_error_budget_remaining:ratio",
             "expr": f'1 - chipledger:slo_errors:ratio_rate{budget_w}{{slo="{spec.slo}"}} / {spec.budget:g}',
             "labels": {"slo": spec.slo}},
        ]
        groups.append({"name": f"chipledger-slo-{spec.slo}", "rules": rules})
    alerts = []
    for spec in specs(slo_params):
        for alert, severity, burn, long_w, short_w in BURN_RULES:
            alerts.append(alert_rule(spec, alert, severity, burn, long_w, short_w, int(slo_params.window_days),
                                     getattr(slo_params, "runbook_url", "")))
    groups.append({"name": "chipledger-slo-alerts", "rules": alerts})
    alerts += [budget_alert_rule(spec, slo_params) for spec in specs(slo_params)]
    groups += budget_groups(getattr(slo_params, "runbook_url", ""))
    return {"groups": groups}


def _dump(data) -> str:
    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, value):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, width=120, allow_unicode=True)


HEADER = ("# Prometheus rules for chipledger's SLOs, written by `chipledger slo rules` from the [slo] targets.\n"
          "# Load them with `rule_files:` in prometheus.yml; check them with `promtool check rules FILE`.\n")


def prometheus_rules(slo_params) -> str:
    return HEADER + _dump(rule_groups(slo_params))


def openslo(slo_params) -> str:
    """The SLOs as OpenSLO v1 documents (one SLO each, ratio of Prometheus counters, occurrences budgeting,
    rolling window) with their burn-rate AlertConditions."""
    docs = []
    window = f"{int(slo_params.window_days)}d"
    for spec in specs(slo_params):
        by = ", ".join(spec.by)
        docs.append({
            "apiVersion": "openslo/v1", "kind": "SLO",
            "metadata": {"name": f"chipledger-{spec.slo.replace('_', '-')}", "displayName": f"chipledger {spec.slo}"},
            "spec": {
                "description": f"chipledger {spec.slo}; bad events: {_DESCRIBE[spec.slo]}",
                "service": "chipledger",
                "indicator": {
                    "metadata": {"name": f"chipledger-{spec.slo.replace('_', '-')}-ratio"},
                    "spec": {"ratioMetric": {
                        "counter": True,
                        "good": {"metricSource": {"type": "Prometheus",
                                                  "spec": {"query": f"sum by ({by}) ({spec.good})"}}},
                        "total": {"metricSource": {"type": "Prometheus",
                                                   "spec": {"query": f"sum by ({by}) ({spec.total})"}}},
                    }},
                },
                "timeWindow": [{"duration": window, "isRolling": True}],
                "budgetingMethod": "Occurrences",
                "objectives": [{"displayName": spec.slo, "target": spec.target}],
                "alertPolicies": [f"chipledger-{spec.slo.replace('_', '-')}-{a.replace('_', '-')}"
                                  for a, *_ in BURN_RULES],
            },
        })
        for alert, severity, burn, long_w, short_w in BURN_RULES:
            name = f"chipledger-{spec.slo.replace('_', '-')}-{alert.replace('_', '-')}"
            docs.append({
                "apiVersion": "openslo/v1", "kind": "AlertPolicy",
                "metadata": {"name": name},
                "spec": {
                    "description": f"{severity} when the budget burns at {burn:g}x over {long_w} and {short_w}",
                    "alertWhenBreaching": True,
                    "conditions": [{"kind": "AlertCondition", "metadata": {"name": f"{name}-condition"},
                                    "spec": {"severity": severity,
                                             "condition": {"kind": "burnrate", "op": "gte", "threshold": burn,
                                                           "lookbackWindow": long_w, "alertAfter": short_w}}}],
                },
            })
    return "".join("---\n" + _dump(d) for d in docs)
