"""A team's budget burning, in `chipledger alerts` and in the real Prometheus with the same labels (issue 36).

Team a runs 3 chips at 100 USD-cent per chip-hour against a monthly budget of 2000 cents (≈ 2.8 cents an hour):
a day costs 7200 cents, over a hundred times the budget's rate. The lake grows a day at a time under
`chipledger serve-metrics`; when the second day arrives, `chipledger_team_cost_total` moves by a day's cost between
two scrapes a second apart, so Prometheus' 1d and 1h burns are far above 2× and `ChipledgerBudgetBurn` pages, with
the labels `chipledger alerts` gives the same alert (analytics' budget_alerts over the lake: 1d burn 108×).
Skipped loudly without the binaries (`bash scripts/prometheus.sh ensure`), a failure under
CHIPLEDGER_REQUIRE_PROMETHEUS=1.
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from chipledger.cli import app
from chipledger.embedded import run_file
from tests.integration.test_prometheus_live import scraped, wait_for

POOL = "lab/h100"
_n = iter(range(1, 10_000))


def _ev(typ: str, at: str, **fields) -> dict:
    return {"event_id": f"b{next(_n)}", "type": typ, "occurred_at": at, "pool": POOL, "source": "test", **fields}


def budget_events() -> list[dict]:
    d1, d2 = "2026-11-02T", "2026-11-03T"
    out = [_ev("pool.configured", d1 + "00:00:00Z", flavor="h100", chips_per_node=4),
           *[_ev("chip.registered", d1 + "00:00:00Z", chip_id=f"c{i}", node="n1") for i in range(4)],
           _ev("quota.granted", d1 + "00:00:00Z", grant_id="ga", team="a", chips=2),
           _ev("price.set", d1 + "00:00:00Z", price_id="std", per_chip_hour=100, unit="USD-cent"),
           _ev("budget.set", d1 + "00:00:00Z", budget_id="ba", team="a", period="month", amount=2000,
               unit="USD-cent"),
           _ev("job.submitted", d1 + "00:00:00Z", job_id="j1", team="a", chips=3, priority=1),
           _ev("job.started", d1 + "00:00:00Z", job_id="j1")]
    out += [_ev("pool.tick", f"{d1}{h:02d}:00:00Z") for h in range(1, 24)]
    out += [_ev("pool.tick", f"{d2}{h:02d}:00:00Z") for h in range(0, 24)]
    return out


def _labels(a: dict) -> dict:
    return {k: v for k, v in a["labels"].items() if k not in ("instance", "job")}


def test_budget_alert_fires_in_the_cli_and_in_prometheus_with_the_same_labels(prometheus, tmp_path):
    events = tmp_path / "events.jsonl"
    events.write_text("".join(json.dumps(e) + "\n" for e in budget_events()))
    lake = tmp_path / "lake"
    run_file(events, lake)
    # the CLI: the page fires over the whole lake
    r = CliRunner().invoke(app, ["alerts", "--lake", str(lake), "--json"])
    assert r.exit_code == 2, r.output
    cli = [a for a in json.loads(r.output)["firing"] if a["slo"] == "budget" and a["alert"] == "budget_page"]
    assert [(a["team"], a["unit"], a["period"]) for a in cli] == [("a", "USD-cent", "month")]
    from chipledger.monitoring.alertmanager import payload
    from chipledger.monitoring.alerts import evaluate
    from analytics.views import connect

    con = connect(lake)
    sent = [a for a in payload(evaluate(con).alerts) if a["labels"]["slo"] == "budget"
            and a["labels"]["alert"] == "budget_page"]
    con.close()
    # `sent`: the labels Alertmanager gets from `chipledger alerts --alertmanager`
    # Prometheus over serve-metrics; the lake is written again with the second day (serve-metrics folds it again:
    # its counters restart, which rate() takes as a reset, so the day's cost arrives within a second)
    grown = tmp_path / "grown"
    first = tmp_path / "day1.jsonl"
    first.write_text("".join(json.dumps(e) + "\n" for e in budget_events() if e["occurred_at"] < "2026-11-03"))
    run_file(first, grown)
    with scraped(prometheus, grown, tmp_path):
        wait_for("the first day's cost scraped", lambda: prometheus.query("chipledger_team_cost_total"))
        run_file(events, grown, overwrite=True)

        def firing():
            return [a for a in prometheus.api("alerts")["data"]["alerts"] if a["state"] == "firing"
                    and a["labels"].get("alertname") == "ChipledgerBudgetBurn"
                    and a["labels"].get("alert") == "budget_page"]
        got = wait_for("the budget page firing in Prometheus", firing, 60)
        assert [_labels(a) for a in got] == [s["labels"] for s in sent]
