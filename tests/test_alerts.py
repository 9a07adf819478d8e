"""`chipledger alerts`: the firing burn-rate alerts and the exit status cron and monitoring rely on, on the
hand-computed lake of tests/test_slo_views.py (burn rates derived in test_burn_alerts_evaluated_at_03_00).
Exit 0 none firing, 1 tickets only, 2 a page, 3 an error (never one of the firing states)."""

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


def test_spent_budgets_are_tickets_at_the_end_of_the_log(lake):
    """Issue 35, item 6: nothing burns fast at the end of the log, but budgets spent over the window are not
    silent: a ticket each (exit 1), per pool and team, as the Prometheus rules label them."""
    res = alerts(lake)
    assert res.exit_code == 1, res.output
    first, *lines = res.stdout.splitlines()
    assert first.startswith("evaluated at 2026-11-04T00:00:00Z (newest event 2026-11-04T00:00:00Z, ")
    assert first.endswith(" s before now; 1 pool(s))")
    assert lines == [
        "TICKET budget_exhausted goodput        pool p/h100 team b: error budget spent: 440.0% of the 30d budget "
        "consumed (target 90%)",
        "TICKET budget_exhausted quota_honoured pool p/h100 team a: error budget spent: 1000.0% of the 30d budget "
        "consumed (target 95%)",
        "TICKET budget_exhausted sched_latency  pool p/h100 team a: error budget spent: 500.0% of the 30d budget "
        "consumed (target 90%)",
        "TICKET budget_exhausted sched_latency  pool p/h100 team b: error budget spent: 666.7% of the 30d budget "
        "consumed (target 90%)"]


def test_quiet_when_no_budget_is_spent(lake, tmp_path):
    cfg = tmp_path / "loose.toml"
    cfg.write_text("[slo]\navailability = 0.5\nquota_honoured = 0.4\nsched_latency = 0.3\ngoodput = 0.2\n")
    res = alerts(lake, "--config", str(cfg))
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[1] == "no burn-rate alert firing"


def test_a_page_exits_2(lake):
    res = alerts(lake, "--at", "2026-11-02T03:00:00Z")
    assert res.exit_code == 2
    head, *lines = res.output.splitlines()
    assert head == "evaluated at 2026-11-02T03:00:00Z (newest event 2026-11-02T03:00:00Z, 0 s before --at; 1 pool(s))"
    assert lines[0].startswith("PAGE   page_6h          sched_latency  pool p/h100 team b: burning 6.7× over 6h and "
                               "10.0× over 30m")
    assert [ln.split(":")[0].split() for ln in lines[1:]] == [
        ["TICKET", "budget_exhausted", "availability", "pool", "p/h100"],
        ["TICKET", "budget_exhausted", "goodput", "pool", "p/h100", "team", "b"],
        ["TICKET", "budget_exhausted", "quota_honoured", "pool", "p/h100", "team", "a"],
        ["TICKET", "budget_exhausted", "sched_latency", "pool", "p/h100", "team", "a"],
        ["TICKET", "budget_exhausted", "sched_latency", "pool", "p/h100", "team", "b"],
        ["TICKET", "ticket_3d", "availability", "pool", "p/h100"],
        ["TICKET", "ticket_3d", "goodput", "pool", "p/h100", "team", "b"],
        ["TICKET", "ticket_3d", "quota_honoured", "pool", "p/h100", "team", "a"],
        ["TICKET", "ticket_3d", "sched_latency", "pool", "p/h100", "team", "a"],
        ["TICKET", "ticket_3d", "sched_latency", "pool", "p/h100", "team", "b"]]


def test_tickets_only_exit_1(lake):
    # at 06:00 the short page windows (5 and 30 minutes) are empty; the 6-hour ticket window still burns
    res = alerts(lake, "--at", "2026-11-02T06:00:00Z", "--json")
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert (doc["evaluated_at"], doc["newest_event_at"], doc["pools"]) == (
        "2026-11-02T06:00:00Z", "2026-11-02T03:00:00Z", ["p/h100"])  # newest at or before --at
    got = doc["firing"]
    # availability no longer: 1,200 chip-s down of 6 x 21,600 in the last 6 hours is 0.93x the budget rate
    assert {(a["severity"], a["slo"], a["team"]) for a in got if a["alert"] == "ticket_3d"} == {
        ("ticket", "goodput", "b"), ("ticket", "quota_honoured", "a"), ("ticket", "sched_latency", "a"),
        ("ticket", "sched_latency", "b")}
    qh = next(a for a in got if a["slo"] == "quota_honoured" and a["alert"] == "ticket_3d")
    assert (qh["alert"], qh["pool"], qh["team"], qh["long_win"], qh["short_win"], qh["burn_rate"], qh["target"]) == (
        "ticket_3d", "p/h100", "a", "3d", "6h", 1.0, 0.95)
    assert qh["long_burn"] == pytest.approx(10.0) and qh["evaluated_at"] == "2026-11-02T06:00:00Z"


def test_pool_filter_and_config_targets(lake, tmp_path):
    assert alerts(lake, "--at", "2026-11-02T03:00:00Z", "--pool", "p/h100").exit_code == 2
    # a looser latency target: 0.6 of waits late over 6 h is 1.2x of a 50% budget, no longer a page
    cfg = tmp_path / "chipledger.toml"
    cfg.write_text("[slo]\nsched_latency = 0.5\n")
    res = alerts(lake, "--at", "2026-11-02T03:00:00Z", "--config", str(cfg))
    assert res.exit_code == 1 and "PAGE" not in res.output
    assert "ticket_3d        sched_latency  pool p/h100 team b: burning 1.3× over 3d" in res.output


def test_bad_instant_is_an_error(lake):
    res = alerts(lake, "--at", "at noon")
    assert res.exit_code == 3 and "not an ISO 8601" in res.stderr and res.stdout == ""


def error_line(res) -> str:
    """An error is exit 3, one line on stderr, nothing on stdout (nothing a monitor could read as all clear)."""
    assert res.exit_code == 3, (res.exit_code, res.output)
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_unknown_pool_is_an_error(lake):
    line = error_line(alerts(lake, "--at", "2026-11-02T03:00:00Z", "--pool", "other/pool"))
    assert line == "error: unknown pool 'other/pool'; the lake knows: p/h100"


def test_missing_and_empty_lakes_are_errors(tmp_path):
    assert "does not exist" in error_line(alerts(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    assert "the lake has no events" in error_line(alerts(tmp_path / "empty"))


def test_usage_errors_are_errors_not_pages(lake):
    res = alerts(lake, "--no-such-option")
    assert res.exit_code == 3 and res.stdout == ""
    assert error_line(alerts(lake, "--max-age", "soon")).endswith("is not a duration (e.g. 90s, 15m, 2h, 1d)")


def test_max_age_staleness(lake):
    # against --at: the newest event (2026-11-04 00:00) is 1 h before 01:00 (fresh: the spent budgets' tickets)
    assert alerts(lake, "--at", "2026-11-04T01:00:00Z", "--max-age", "2h").exit_code == 1
    line = error_line(alerts(lake, "--at", "2026-11-04T01:00:00Z", "--max-age", "30m"))
    assert line == ("error: stale: the newest event is at 2026-11-04T00:00:00Z, 3,600 s before "
                    "2026-11-04T01:00:00Z (--at), more than --max-age 1,800 s")
    # against the wall clock (the lake's events are in the past): stale
    assert "(now), more than --max-age 86,400 s" in error_line(alerts(lake, "--max-age", "1d"))
    # the pool's own newest event
    assert "the newest event of p/h100 is at" in error_line(alerts(lake, "--pool", "p/h100", "--max-age", "1d"))


def test_parse_duration():
    from chipledger.monitoring.alerts import AlertsError, parse_duration

    assert [parse_duration(t) for t in ("90", "90s", "15m", "2h", "1d", "1w")] == [90, 90, 900, 7200, 86400, 604800]
    for bad in ("", "1.5h", "-1h", "h", "2 hours"):
        with pytest.raises(AlertsError):
            parse_duration(bad)


def test_evaluate_returns_the_alerts_and_the_instant(lake):
    """The evaluation other code calls (e.g. to send to Alertmanager), apart from printing and exit codes."""
    from datetime import datetime, timezone

    from analytics.views import connect
    from chipledger.monitoring.alerts import evaluate

    at = datetime(2026, 11, 2, 3, tzinfo=timezone.utc)
    ev = evaluate(connect(lake, as_of=at), at=at)
    assert ev.evaluated_at == at and ev.alerts[0].severity == "page" and len(ev.alerts) == 11


def test_report_refuses_an_unknown_pool(lake):
    res = CliRunner().invoke(app, ["report", "--lake", str(lake), "--pool", "other/pool"])
    assert res.exit_code == 2 and "unknown pool 'other/pool'; the lake knows: p/h100" in res.stderr


def test_an_instant_before_the_first_event_is_an_error_not_all_clear(lake):
    """--at before any event: the lake cannot answer (it printed 'no burn-rate alert firing', exit 0, and a
    newest event after the instant, '0 s before --at', which --max-age then passed). Review of issue 17."""
    res = alerts(lake, "--at", "2026-10-01T00:00:00Z", "--max-age", "1h")
    assert res.exit_code == 3, res.output
    assert error_line(res).startswith("error: no event at or before --at 2026-10-01T00:00:00Z: nothing to evaluate")
    assert alerts(lake, "--at", "2026-10-01T00:00:00Z", "--pool", "p/h100").exit_code == 3
    # the newest event shown (and aged) is the newest at or before the instant, never a later one
    head = alerts(lake, "--at", "2026-11-02T03:00:00Z").output.splitlines()[0]
    assert "(newest event 2026-11-02T03:00:00Z, 0 s before --at" in head, head  # the lake has one at 03:00
    head = alerts(lake, "--at", "2026-11-02T03:00:30Z").output.splitlines()[0]
    assert "(newest event 2026-11-02T03:00:00Z, 30 s before --at" in head, head


def test_one_label_set_for_the_cli_and_the_prometheus_rules(lake):
    """Issue 35, item 6: the CLI's alerts were per pool while the rules are per pool and team for 4 of 5 SLOs, so
    Alertmanager could not merge the same burn from both. Each alert `alerts --alertmanager` sends carries exactly
    the labels the matching Prometheus rule gives it (the rule's own and its series' pool and team)."""
    from datetime import datetime, timezone

    from analytics.slo_views import SloParams
    from analytics.views import connect
    from chipledger.monitoring.alertmanager import payload
    from chipledger.monitoring.alerts import evaluate
    from chipledger.monitoring.slo_rules import ALERT_NAME, rule_groups, specs

    rules = {(r["labels"]["slo"], r["labels"]["alert"]): r for g in rule_groups(SloParams())["groups"]
             for r in g["rules"] if "alert" in r}
    series = {s.slo: s.by for s in specs(SloParams())}
    at = datetime(2026, 11, 2, 3, tzinfo=timezone.utc)
    ev = evaluate(connect(lake, as_of=at), at=at)
    assert {a.alert for a in ev.alerts} == {"page_6h", "ticket_3d", "budget_exhausted"}
    for a, item in zip(ev.alerts, payload(ev.alerts)):
        rule = rules[(a.slo, a.alert)]
        assert rule["alert"] == item["labels"]["alertname"] == ALERT_NAME
        assert set(item["labels"]) == {"alertname", *rule["labels"], *series[a.slo]}, a
        assert {k: item["labels"][k] for k in rule["labels"]} == rule["labels"], a
