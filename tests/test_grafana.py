"""`chipledger grafana dashboard`: the JSON is a well-formed Grafana dashboard; every panel expression parses
(promtool, as recording rules); chips are summed only within a pool or a flavor. (Every expression also runs in a
real Prometheus and names only metrics that exist: tests/integration/test_prometheus_live.py.)"""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from chipledger.cli import app
from chipledger.monitoring.grafana import dashboard
from tests.prom_support import promtool


def _exprs(d):
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def test_the_dashboard_is_well_formed(tmp_path):
    out = tmp_path / "dash.json"
    r = CliRunner().invoke(app, ["grafana", "dashboard", "--out", str(out)])
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d == json.loads(json.dumps(dashboard()))
    assert d["uid"] == "chipledger" and d["schemaVersion"] >= 36
    assert {v["name"] for v in d["templating"]["list"]} == {"datasource", "pool", "team"}
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in d["panels"])
    for part in ("Fleet", "quota", "Pending chips by reason", "Error budget", "Burn rate", "Fragmentation",
                 "Decisions", "worker"):
        assert part in titles, part
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"]
        for t in p["targets"]:
            assert t["expr"] and t["refId"]


def test_every_expression_parses_and_chips_are_summed_only_by_pool_or_flavor(tmp_path):
    exprs = _exprs(dashboard())
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr{i}", "expr": e.replace("$pool", ".*").replace("$team", ".*")
         .replace("$__rate_interval", "5m")} for i, e in enumerate(exprs)]}]}
    f = tmp_path / "exprs.yml"
    f.write_text(json.dumps(rules))
    res = promtool("check", "rules", str(f))
    assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()
    summed = 0
    for e in exprs:
        for m in re.finditer(r"\b(sum|avg|max|min)\b\s*(by\s*\(([^)]*)\))?\s*\(([^()]*(\([^()]*\))?[^()]*)\)", e):
            inner = m.group(4)
            if re.search(r"_chips\b|_chips\{", inner):
                keep = {x.strip() for x in (m.group(3) or "").split(",")}
                assert keep & {"pool", "flavor"}, e
                summed += 1
    assert summed >= 5  # the check saw the sums of chips


def test_slo_panels_read_at_a_glance():
    """Burn panels: one legend per window and series, a threshold line at the alert's factor; a budget-left stat per
    SLO; pending chips show 0 rather than "No data"."""
    from analytics.slo_views import SLOS
    from chipledger.monitoring.slo_rules import BURN_RULES

    panels = {p["title"]: p for p in dashboard()["panels"]}
    for _, severity, factor, long_w, short_w in BURN_RULES:
        (p,) = [p for t, p in panels.items() if t.startswith(f"Burn rate over {long_w} and {short_w} ")]
        legends = [t["legendFormat"] for t in p["targets"]]
        assert legends == [f"{{{{slo}}}} {{{{pool}}}} {{{{team}}}} over {w}" for w in (long_w, short_w)]
        steps = p["fieldConfig"]["defaults"]["thresholds"]["steps"]
        assert steps[-1]["value"] == factor and p["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] \
            in ("line", "dashed")
    stats = [p for p in panels.values() if p["type"] == "stat" and p["title"].startswith("Budget left: ")]
    assert [p["title"].removeprefix("Budget left: ") for p in stats] == list(SLOS)
    assert all('slo="' in p["targets"][0]["expr"] for p in stats)
    pending = panels["Pending chips by reason"]
    assert pending["fieldConfig"]["defaults"]["noValue"] == "0"
    assert any(" or " in t["expr"] and "0 * chipledger_pool_registered_chips" in t["expr"] for t in pending["targets"])


def test_alerts_carry_the_runbook_url_from_config():
    from analytics.slo_views import SloParams
    from chipledger.monitoring.alertmanager import payload
    from chipledger.monitoring.slo_rules import rule_groups

    params = SloParams(runbook_url="https://runbooks.example/{slo}#{alert}")
    alerts = [r for g in rule_groups(params)["groups"] for r in g["rules"] if "alert" in r]
    assert alerts and all(r["annotations"]["runbook_url"] == f"https://runbooks.example/{r['labels']['slo']}#"
                                                             f"{r['labels']['alert']}" for r in alerts)
    assert all("runbook_url" not in r["annotations"] for g in rule_groups(SloParams())["groups"]
               for r in g["rules"] if "alert" in r)
    from datetime import datetime, timezone

    from chipledger.monitoring.alerts import Alert

    a = Alert("page", "page_1h", "availability", "c/p", None, 14.4, "1h", 20.0, "5m", 30.0, 0.99,
              datetime(2026, 11, 4, tzinfo=timezone.utc))
    (item,) = payload([a], runbook_url=params.runbook_url)
    assert item["annotations"]["runbook_url"] == "https://runbooks.example/availability#page_1h"
