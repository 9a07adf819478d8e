"""`chipledger alerts`: the firing burn-rate alerts and the exit status cron and monitoring rely on, on the
hand-computed lake of tests/test_slo_views.py (burn rates derived in test_burn_alerts_evaluated_at_03_00)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from chipledger.cli import app
from test_slo_views import run_slo_lake


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    return run_slo_lake(tmp_path_factory.mktemp("alerts"))


def alerts(lake, *args):
    return CliRunner().invoke(app, ["alerts", "--lake", str(lake), *args])


def test_quiet_at_the_end_of_the_log(lake):
    res = alerts(lake)
    assert (res.exit_code, res.output) == (0, "no burn-rate alert firing\n")


def test_a_page_exits_2(lake):
    res = alerts(lake, "--at", "2026-11-02T03:00:00Z")
    assert res.exit_code == 2
    lines = res.output.splitlines()
    assert lines[0].startswith("PAGE   page_6h   sched_latency  p/h100: burning 6.0× over 6h and 10.0× over 30m")
    assert [ln.split()[:3] for ln in lines[1:]] == [
        ["TICKET", "ticket_3d", "availability"], ["TICKET", "ticket_3d", "goodput"],
        ["TICKET", "ticket_3d", "quota_honoured"], ["TICKET", "ticket_3d", "sched_latency"]]


def test_tickets_only_exit_1(lake):
    # at 06:00 the short page windows (5 and 30 minutes) are empty; the 6-hour ticket window still burns
    res = alerts(lake, "--at", "2026-11-02T06:00:00Z", "--json")
    assert res.exit_code == 1
    got = json.loads(res.stdout)
    # availability no longer: 1,200 chip-s down of 6 x 21,600 in the last 6 hours is 0.93x the budget rate
    assert {(a["severity"], a["slo"]) for a in got} == {("ticket", s) for s in
                                                         ("goodput", "quota_honoured", "sched_latency")}
    qh = next(a for a in got if a["slo"] == "quota_honoured")
    assert (qh["alert"], qh["long_win"], qh["short_win"], qh["burn_rate"], qh["target"]) == (
        "ticket_3d", "3d", "6h", 1.0, 0.95)
    assert qh["long_burn"] == pytest.approx(10.0) and qh["evaluated_at"] == "2026-11-02T06:00:00Z"


def test_pool_filter_and_config_targets(lake, tmp_path):
    assert alerts(lake, "--at", "2026-11-02T03:00:00Z", "--pool", "other/pool").exit_code == 0
    assert alerts(lake, "--at", "2026-11-02T03:00:00Z", "--pool", "p/h100").exit_code == 2
    # a looser latency target: 0.6 of waits late over 6 h is 1.2x of a 50% budget, no longer a page
    cfg = tmp_path / "chipledger.toml"
    cfg.write_text("[slo]\nsched_latency = 0.5\n")
    res = alerts(lake, "--at", "2026-11-02T03:00:00Z", "--config", str(cfg))
    assert res.exit_code == 1 and "PAGE" not in res.output
    assert "ticket_3d sched_latency  p/h100: burning 1.2× over 3d" in res.output


def test_bad_instant_is_refused(lake):
    res = alerts(lake, "--at", "at noon")
    assert res.exit_code == 2 and "not an ISO 8601" in res.output
