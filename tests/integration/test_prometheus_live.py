"""The monitoring stack for real: a Prometheus server (127.0.0.1, free port, temp storage, 1 s scrape and rule
evaluation) scraping `chipledger serve-metrics` over a lake that grows a day at a time, loaded with the rules of
`chipledger slo rules`; an Alertmanager fed by `chipledger alerts --alertmanager`; the Grafana dashboard's
expressions run by that Prometheus. Skipped loudly without the binaries (`bash scripts/prometheus.sh ensure`),
a failure under CHIPLEDGER_REQUIRE_PROMETHEUS=1.

The day added burns the capacity budget (most of the pool's chips down), so the counters Prometheus scrapes move
by a day of event time between two scrapes a second apart: the real page rule's 1h and 5m error ratios are both
far above 14.4 × the budget and the alert fires (the windows themselves are tested by `promtool test rules`,
tests/test_slo_rules.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from analytics.slo_views import SloParams
from chipledger.cli import app
from chipledger.embedded import run_file
from chipledger.monitoring.grafana import dashboard
from chipledger.sim.scenario import write_jsonl
from ledger import FoldConfig
from store import open_store
from tests.monitoring_scenario import outage_events
from tests.prom_support import Prometheus, free_port, stop

FOLD = FoldConfig(capacity_slo_target=SloParams().availability)


def wait_for(what: str, fn, timeout_s: float = 60.0, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")


@contextmanager
def scraped(prometheus, lake: Path, tmp_path: Path):
    """`chipledger serve-metrics` over `lake` on a free port, scraped by `prometheus` with the rules `slo rules`
    writes: yields (the target host:port, the rules file); at the end the server stops and Prometheus forgets both."""
    rules = tmp_path / "rules.yml"
    assert CliRunner().invoke(app, ["slo", "rules", "--out", str(rules)]).exit_code == 0
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "chipledger.cli", "serve-metrics", "--lake", str(lake),
                               "--port", str(port), "--poll", "0.5"], stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)
    try:
        target = f"127.0.0.1:{port}"
        wait_for("serve-metrics", lambda: _get(f"http://{target}/metrics"), 60)
        prometheus.configure([target], [rules])
        yield target, rules
    finally:
        stop(server)
        log.close()
        prometheus.configure([], [])


@pytest.fixture(scope="module")
def burning_lake(tmp_path_factory):
    """A 3-day lake whose third day has 60% of the chips down for 22 hours, with the store of the run."""
    root = tmp_path_factory.mktemp("burning")
    events = root / "events.jsonl"
    write_jsonl(outage_events(days=3, outage_at_h=49, outage_hours=22), events)
    store = open_store(f"sqlite:///{root / 'store.db'}")
    run_file(events, root / "lake", fold_config=FOLD, store=store)
    return root, store


def _copy_days(src: Path, dst: Path, days: list[str]) -> None:
    """The days' files copied into `dst` and committed (a reader sees only committed files)."""
    from lake_support import commit_written

    for table in ("events", "deadletters"):
        for d in days:
            if (src / table / d).exists():
                shutil.copytree(src / table / d, dst / table / d)
    commit_written(dst)


def _value(prom: Prometheus, expr: str) -> dict:
    return {tuple(sorted((k, v) for k, v in r["metric"].items() if k not in ("instance", "job", "__name__"))):
            float(r["value"][1]) for r in prom.query(expr)}


def test_prometheus_scrapes_serve_metrics_loads_the_rules_and_the_page_fires(prometheus, burning_lake, tmp_path):
    root, store = burning_lake
    lake = root / "lake"
    days = sorted(p.name for p in (lake / "events").iterdir())
    grown = tmp_path / "lake"
    burning = "day=2026-11-04"  # the outage's day (hour 49 since 2026-11-02)
    assert burning in days
    _copy_days(lake, grown, [d for d in days if d < burning])
    with scraped(prometheus, grown, tmp_path) as (target, rules):
        wait_for("the target up", lambda: _value(prometheus, 'up{job="chipledger"}') == {(): 1.0})
        # the rule set loads and every rule evaluates
        def rules_ok():
            groups = prometheus.api("rules")["data"]["groups"]
            names = {g["name"] for g in groups}
            healthy = all(r["health"] == "ok" for g in groups for r in g["rules"])
            return names >= {"chipledger-slo-availability", "chipledger-slo-alerts"} and healthy and groups
        groups = wait_for("the rules loaded and evaluated", rules_ok)
        # every rule `slo rules` wrote (12 per SLO) is loaded
        written = len(re.findall(r"^\s*- (?:alert|record):", rules.read_text(), re.M))
        assert written >= 48 and sum(len(g["rules"]) for g in groups) == written
        reg = "chipledger_registered_chip_seconds_total"
        before = wait_for("the first days scraped", lambda: _value(prometheus, reg))
        assert not _firing(prometheus, "page_1h")
        _copy_days(lake, grown, [d for d in days if d >= burning])  # the burning day arrives
        wait_for("the last day scraped", lambda: _value(prometheus, reg) != before and _value(prometheus, reg))
        page = wait_for("the availability page alert firing", lambda: _firing(prometheus, "page_1h"), 30)
        (labels,) = [a["labels"] for a in page]
        assert labels["severity"] == "page" and labels["slo"] == "availability"
        assert labels["pool"] == next(iter(store.pool_balances())).pool
        assert labels["long_window"] == "1h" and labels["short_window"] == "5m"
        ratio = _value(prometheus, 'chipledger:slo_errors:ratio_rate5m{slo="availability"}')
        assert all(v >= 14.4 * 0.01 for v in ratio.values()) and ratio
        # the gauges Prometheus holds are the ledger's balances (the store the run wrote)
        teams = {(t.pool, t.team): t for t in store.team_balances()}
        for metric, attr, scale in (("chipledger_team_used_chips", "used_milli", 1000),
                                    ("chipledger_team_nominal_chips", "nominal_milli", 1000),
                                    ("chipledger_team_borrowed_chips", "borrowed_milli", 1000),
                                    ("chipledger_team_running_jobs", "running_jobs", 1),
                                    ("chipledger_team_pending_jobs", "pending_jobs", 1)):
            got = {(d["pool"], d["team"]): v for k, v in _value(prometheus, metric).items() for d in [dict(k)]}
            assert got == {k: getattr(t, attr) / scale for k, t in teams.items()}, metric
        pools = {p.pool: p for p in store.pool_balances()}
        got = {dict(k)["pool"]: v for k, v in _value(prometheus, "chipledger_pool_down_chips").items()}
        assert got == {p: b.unavailable_milli / 1000 for p, b in pools.items()}
        # the dashboard: every expression runs in this Prometheus, every metric it names is served (by serve-metrics,
        # or by the worker: its consumer lag) or recorded by the rules
        from streams.metrics import MetricsCollector, exposition, registry_of

        worker_only = exposition(registry_of(MetricsCollector({}, FOLD, lag=lambda: {}), process=False)).decode()
        exposed = set(re.findall(r"^# TYPE (\S+) (\S+)", _get(f"http://{target}/metrics").decode() + worker_only,
                                 re.M))
        names = {n for n, _ in exposed} | {n + "_total" for n, t in exposed if t == "counter"} | {
            n + "_bucket" for n, t in exposed if t == "histogram"}
        records = {r["name"] for g in groups for r in g["rules"] if r["type"] == "recording"}
        for expr in _dashboard_exprs():
            res = prometheus.api("query", query=expr)
            assert res["status"] == "success", (expr, res)
            for m in re.findall(r"\b(chipledger[a-z0-9_:]*)", expr):
                assert m in names or m in records, (m, expr)


def _get(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read()
    except OSError:
        return b""


def _firing(prom: Prometheus, alert: str) -> list:
    return [a for a in prom.api("alerts")["data"]["alerts"]
            if a["state"] == "firing" and a["labels"].get("alert") == alert
            and a["labels"].get("alertname") == "ChipledgerErrorBudgetBurn"]


def _dashboard_exprs() -> list[str]:
    out = []
    for p in dashboard()["panels"]:
        for t in p.get("targets", []):
            out.append(t["expr"].replace("$pool", ".*").replace("$team", ".*").replace("$__rate_interval", "1m"))
    return out


def test_alerts_reach_a_real_alertmanager_with_their_labels(alertmanager, burning_lake):
    root, store = burning_lake
    pool = next(iter(store.pool_balances())).pool
    r = CliRunner().invoke(app, ["alerts", "--lake", str(root / "lake"), "--at", "2026-11-04T10:00:00Z",
                                 "--alertmanager", alertmanager.url])
    assert r.exit_code == 2, r.output  # in the outage a page fires in the lake's burn_alerts
    assert "sent" in r.output
    def ours():
        return [a for a in alertmanager.alerts() if a["labels"].get("alertname") == "ChipledgerErrorBudgetBurn"]
    got = wait_for("the alerts in Alertmanager", ours, 20)
    page = [a for a in got if a["labels"]["alert"] == "page_1h" and a["labels"]["slo"] == "availability"]
    assert page, got
    labels = page[0]["labels"]
    assert labels["severity"] == "page" and labels["pool"] == pool and labels["short_window"] == "5m"
    assert page[0]["status"]["state"] == "active"
    assert f"chipledger report --pool {pool}" in page[0]["annotations"]["look_at"]
    # unreachable: a clear error, exit 3
    r = CliRunner().invoke(app, ["alerts", "--lake", str(root / "lake"), "--alertmanager",
                                 f"http://127.0.0.1:{free_port()}"])
    assert r.exit_code == 3 and "cannot reach Alertmanager" in r.output and "Traceback" not in r.output
