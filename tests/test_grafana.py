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
