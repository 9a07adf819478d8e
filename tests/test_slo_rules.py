"""`chipledger slo rules`: the rule file passes `promtool check rules`, and `promtool test rules` — on the SLO
counters of /metrics sampled every minute of event time while a seeded scenario with an outage is folded — finds
each burn-rate alert firing exactly when an independent evaluation of the windows over the same samples says it
should, and quiet when it should not (the real promtool; skipped loudly without it)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from analytics.slo_views import SloParams
from chipledger.cli import app
from chipledger.monitoring.slo_rules import ALERT_NAME, BURN_RULES, budget_rule, openslo, prometheus_rules, rule_groups, specs
from ledger import Fleet, FoldConfig
from schemas import parse_event
from streams.metrics import SLO_COUNTERS, MetricsCollector
from tests.monitoring_scenario import outage_events
from tests.prom_support import promtool

STEP_S = 60


def test_the_rule_file_has_every_window_and_alert_and_passes_promtool_check(tmp_path):
    params = SloParams()
    groups = rule_groups(params)["groups"]
    records = {(r["record"], r["labels"]["slo"]) for g in groups for r in g["rules"] if "record" in r}
    for slo in ("availability", "quota_honoured", "sched_latency", "goodput", "throughput"):
        for w in ("5m", "30m", "1h", "6h", "3d", "30d"):
            assert (f"chipledger:slo_errors:ratio_rate{w}", slo) in records
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    assert {(a["labels"]["slo"], a["labels"]["alert"], a["labels"]["severity"]) for a in alerts} == {
        (slo, a, sev) for slo in ("availability", "quota_honoured", "sched_latency", "goodput", "throughput")
        for a, sev, *_ in BURN_RULES + (budget_rule(params),)} | {
        ("budget", "budget_page", "page"), ("budget", "budget_ticket", "ticket")}
    spent = next(a for a in alerts if a["labels"]["slo"] == "sched_latency" and a["labels"]["alert"] == "budget_exhausted")
    assert spent["expr"] == 'chipledger:slo_errors:ratio_rate30d{slo="sched_latency"} >= (1 * 0.1)'
    assert spent["labels"]["severity"] == "ticket"
    page = next(a for a in alerts if a["labels"]["slo"] == "availability" and a["labels"]["alert"] == "page_1h")
    assert "ratio_rate1h{slo=\"availability\"} >= (14.4 * 0.01)" in page["expr"]
    assert "ratio_rate5m{slo=\"availability\"} >= (14.4 * 0.01)" in page["expr"]
    quota = next(a for a in alerts if a["labels"]["slo"] == "quota_honoured")
    assert "{{ $labels.team }}" in quota["annotations"]["summary"] and "chipledger why" in quota["annotations"]["look_at"]
    out = tmp_path / "rules.yml"
    res = CliRunner().invoke(app, ["slo", "rules", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert yaml.safe_load(out.read_text()) == rule_groups(params)
    check = promtool("check", "rules", str(out))
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    # 5 SLOs x (9 recording + 4 alerting), and the cost budgets' 4 windows x 2 recording + 2 alerting
    assert b"SUCCESS: 75 rules found" in check.stdout


def test_targets_come_from_the_slo_section(tmp_path):
    cfg = tmp_path / "chipledger.toml"
    cfg.write_text("[slo]\navailability = 0.999\nwindow_days = 28\n")
    res = CliRunner().invoke(app, ["slo", "rules", "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    groups = yaml.safe_load(res.stdout)["groups"]
    exprs = [r["expr"] for g in groups for r in g["rules"]]
    assert any("(14.4 * 0.001)" in e for e in exprs) and any("[28d]" in e for e in exprs)
    assert not any("[30d]" in e for e in exprs)
    bad = CliRunner().invoke(app, ["slo", "rules", "--format", "nagios"])
    assert bad.exit_code == 2 and "prometheus or openslo" in bad.output


def test_openslo_documents_name_the_counters_and_the_burn_rate_conditions():
    docs = list(yaml.safe_load_all(openslo(SloParams())))
    slos = [d for d in docs if d["kind"] == "SLO"]
    assert {d["metadata"]["name"] for d in slos} == {"chipledger-availability", "chipledger-quota-honoured",
                                                     "chipledger-sched-latency", "chipledger-goodput",
                                                     "chipledger-throughput"}
    for d in docs:
        assert d["apiVersion"] == "openslo/v1"
    avail = next(d for d in slos if d["metadata"]["name"] == "chipledger-availability")["spec"]
    ratio = avail["indicator"]["spec"]["ratioMetric"]
    assert ratio["counter"] is True
    assert "chipledger_available_chip_seconds_total" in ratio["good"]["metricSource"]["spec"]["query"]
    assert avail["objectives"][0]["target"] == 0.99 and avail["timeWindow"][0]["duration"] == "30d"
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "AlertPolicy"}
    assert set(avail["alertPolicies"]) <= set(policies)
    cond = policies["chipledger-availability-page-1h"]["spec"]["conditions"][0]["spec"]
    assert cond["condition"] == {"kind": "burnrate", "op": "gte", "threshold": 14.4, "lookbackWindow": "1h",
                                 "alertAfter": "5m"}


# --- promtool test rules over a seeded scenario ---------------------------------------------------------------

def _sample(events: list[dict], fold: FoldConfig):
    """Fold the events, with a pool.tick at every minute of event time; after each tick sample the SLO counters
    (the collector reads them from the pool states). Returns (series: {(name, labels)} -> values per minute,
    minutes)."""
    from schemas.events import epoch_s

    fleet = Fleet(fold)
    col = MetricsCollector(fleet.pools, fold)
    wanted = {n for total, good, _ in SLO_COUNTERS.values() for n in (total, good)}
    series: dict = {}
    pool = events[0]["pool"]
    parsed = [parse_event(json.dumps(e).encode()) for e in events]
    t0 = epoch_s(parsed[0].occurred_at)
    t0 -= t0 % STEP_S
    minute = 0

    def sample():
        for fam in col.counters():
            for s in fam.samples:
                if s.name in wanted:
                    key = (s.name, tuple(sorted(s.labels.items())))
                    vals = series.setdefault(key, [0.0] * minute)
                    vals.append(s.value)
        for vals in series.values():  # a series that vanished keeps its value
            if len(vals) < minute + 1:
                vals.append(vals[-1] if vals else 0.0)

    def tick(t):
        from schemas import parse_event as pe

        e = pe(json.dumps({"event_id": f"tick-{t}", "type": "pool.tick", "pool": pool, "source": "test/tick",
                           "occurred_at": f"{_iso(t)}"}).encode())
        assert fleet.apply(e).applied

    for e in parsed:
        t = epoch_s(e.occurred_at)
        while t0 + minute * STEP_S <= t and pool in fleet.pools:
            tick(t0 + minute * STEP_S)
            sample()
            minute += 1
        fleet.apply(e)
    return series, minute


def _iso(t: int) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


_MIN = {"5m": 5, "30m": 30, "1h": 60, "6h": 360, "3d": 4320, "30d": 43200}


def _ratios(series, spec, k: int, w: int) -> dict:
    """An independent evaluation of one error-ratio window: per group of the SLO's labels, (Δtotal − Δgood) /
    Δtotal between the samples at minutes k − w and k (None without events)."""
    d: dict = defaultdict(lambda: [0.0, 0.0])
    for (name, labels), vals in series.items():
        if name not in (spec.total, spec.good):
            continue
        lab = dict(labels)
        key = tuple(lab[n] for n in spec.by)
        delta = vals[k] - vals[max(0, k - w)]
        d[key][0 if name == spec.total else 1] += delta
    return {key: (t - g) / t if t > 0 else None for key, (t, g) in d.items()}


def _render(text: str, labels: dict) -> str:
    return text.replace("{{ $labels.pool }}", labels["pool"]).replace("{{ $labels.team }}", labels.get("team", ""))


def test_promtool_finds_each_alert_firing_when_it_should_and_quiet_when_it_should(tmp_path):
    params = SloParams()
    fold = FoldConfig(capacity_slo_target=params.availability, sched_slo_s=params.sched_slo_s)
    events = outage_events()
    series, minutes = _sample(events, fold)
    rules = rule_groups(params)
    alerts = {(r["labels"]["slo"], r["labels"]["alert"]): r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    sp = {s.slo: s for s in specs(params)}

    def evaluate(k):
        """The alerts firing at minute k, or None when a ratio is too near its threshold to call."""
        firing = []
        for slo, spec in sp.items():
            for alert, _sev, burn, long_w, short_w in BURN_RULES + (budget_rule(params),):
                th = burn * spec.budget
                rl, rs = _ratios(series, spec, k, _MIN[long_w]), _ratios(series, spec, k, _MIN[short_w])
                for key in rl:
                    for r in (rl[key], rs.get(key)):
                        if r is not None and abs(r - th) <= 1e-6 * th:
                            return None
                    if rl[key] is not None and rs.get(key) is not None and rl[key] >= th and rs[key] >= th:
                        firing.append((slo, alert, dict(zip(spec.by, key))))
        return firing

    tests, seen_firing, seen_quiet = [], set(), set()
    for k in range(30, minutes, 30):
        got = evaluate(k)
        if got is None:
            continue
        fired = {(slo, alert) for slo, alert, _ in got}
        new_f = fired - seen_firing
        new_q = {key for key in alerts if key not in fired} - seen_quiet
        if not new_f and not new_q:
            continue
        seen_firing |= fired
        seen_quiet |= {key for key in alerts if key not in fired}
        exp = []
        for slo, alert, labels in got:
            r = alerts[(slo, alert)]
            exp.append({"exp_labels": {**r["labels"], **labels},
                        "exp_annotations": {n: _render(v, labels) for n, v in r["annotations"].items()}})
        tests.append({"eval_time": f"{k}m", "alertname": ALERT_NAME, "exp_alerts": exp})
    # the outage makes every availability alert fire at some minute, and each is quiet at another
    for alert, *_ in BURN_RULES:
        assert ("availability", alert) in seen_firing, alert
        assert ("availability", alert) in seen_quiet, alert
    assert any(not t["exp_alerts"] for t in tests) or len(seen_quiet) == len(alerts)

    input_series = [{"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}",
                     "values": " ".join(repr(v) for v in vals[:minutes])}
                    for (name, labels), vals in sorted(series.items())]
    (tmp_path / "rules.yml").write_text(prometheus_rules(params))
    spec_file = tmp_path / "test.yml"
    spec_file.write_text(yaml.safe_dump({
        "rule_files": ["rules.yml"], "evaluation_interval": "5m",
        "tests": [{"interval": "1m", "input_series": input_series, "alert_rule_test": tests}]}, width=1 << 30))
    res = promtool("test", "rules", str(spec_file), cwd=tmp_path)
    out = res.stdout.decode() + res.stderr.decode()
    assert res.returncode == 0, out[-6000:]
    assert "SUCCESS" in out
    print(f"promtool test rules: {len(tests)} evaluation times, {len(input_series)} series of {minutes} minutes, "
          f"{sum(len(t['exp_alerts']) for t in tests)} expected alerts")


def test_slo_rules_json_is_the_rule_file_and_promtool_reads_it(tmp_path):
    """Issue 35, item 9: `slo rules --json` is the same rule file as JSON (which Prometheus reads: JSON is YAML);
    with --out, what was written."""
    import json

    from typer.testing import CliRunner

    from chipledger.cli import app

    res = CliRunner().invoke(app, ["slo", "rules", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc == rule_groups(SloParams())
    (tmp_path / "rules.json").write_text(res.stdout)
    check = promtool("check", "rules", str(tmp_path / "rules.json"))
    assert b"SUCCESS: 75 rules found" in check.stdout
    res = CliRunner().invoke(app, ["slo", "rules", "--json", "--out", str(tmp_path / "r.yml")])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["written"] == str(tmp_path / "r.yml") and (tmp_path / "r.yml").is_file()
    assert sum(g["recording_rules"] + g["alerting_rules"] for g in summary["groups"]) == 75
