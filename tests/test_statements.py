"""Quota statements as a team lead meets them: `chipledger run`, then `chipledger statements`, then the files.

Fixture (built below, numbers by hand; 1 chip-hour = 3,600,000 milli-chip-seconds):
  pool lab/a100, 4 chips on 2 nodes, from 2026-11-02 00:00.
  org/alpha: grant g-a of 2 chips at 00:00, cut to 1 chip at 12:00 (the same grant id granted again: a quota
     changed mid-period). Job j1 (3 chips, c1-c3) runs from 00:00 and is preempted 2026-11-03 06:00 with no
     checkpoint (30 h × 3 chips of work lost); it then waits.
  beta: 2 chips of quota, no job.
  quiet: 1 chip of quota ending 2026-11-03 00:00, no job: nothing at all on day two.
  The books close at 2026-11-04 00:00 (a pool.tick).
Day one (2026-11-02): alpha entitled 2×12 + 1×12 = 36 chip-h, all used in quota (it runs 3 chips), borrowed
  1×12 + 2×12 = 36 chip-h. beta entitled 48, unused 48. quiet entitled 24, unused 24.
  Pool: capacity 96 = alpha's 72 + idle 24.
Day two (2026-11-03): alpha entitled 24; 3 chips until 06:00 = in quota 6, borrowed 12; unused 18; waiting
  3 chips × 18 h = 54 chip-h pending.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chipledger.cli import app
from chipledger.reports.statements import (StatementError, closed_periods, file_stem, parse_period, period_containing)

H = 3_600_000  # milli-chip-seconds in one chip-hour
runner = CliRunner()


def ev(i: int, typ: str, at: str, **fields) -> dict:
    return {"event_id": f"e{i:03d}", "type": typ, "occurred_at": at, "pool": "lab/a100", "source": "test", **fields}


def fixture_events() -> list[dict]:
    d1, d2, d3 = "2026-11-02T", "2026-11-03T", "2026-11-04T"
    out = [ev(1, "pool.configured", d1 + "00:00:00Z", flavor="a100", chips_per_node=2)]
    for n, chip in enumerate(("c1", "c2", "c3", "c4")):
        out.append(ev(2 + n, "chip.registered", d1 + "00:00:00Z", chip_id=chip, node=f"n{n // 2 + 1}"))
    out += [
        ev(10, "quota.granted", d1 + "00:00:00Z", grant_id="g-a", team="org/alpha", chips=2),
        ev(11, "quota.granted", d1 + "00:00:00Z", grant_id="g-b", team="beta", chips=2),
        ev(12, "quota.granted", d1 + "00:00:00Z", grant_id="g-q", team="quiet", chips=1,
           effective_until=d2 + "00:00:00Z"),
        ev(13, "job.submitted", d1 + "00:00:00Z", job_id="j1", team="org/alpha", chips=3, priority=1),
        ev(14, "job.started", d1 + "00:00:00Z", job_id="j1", chip_ids=["c1", "c2", "c3"]),
        ev(15, "quota.granted", d1 + "12:00:00Z", grant_id="g-a", team="org/alpha", chips=1),
        ev(16, "job.preempted", d2 + "06:00:00Z", job_id="j1"),
        ev(17, "pool.tick", d3 + "00:00:00Z"),
    ]
    return out


def burst_events() -> list[dict]:
    """beta (1 chip of quota) asks for a 1-chip burst 21:00-03:00 across midnight and runs 2 chips 21:00-03:00:
    1 chip in quota and 1 chip of burst for 3 h on each side of midnight."""
    d1, d2 = "2026-11-02T", "2026-11-03T"
    out = [ev(1, "pool.configured", d1 + "00:00:00Z", flavor="a100", chips_per_node=2)]
    for n, chip in enumerate(("c1", "c2", "c3", "c4")):
        out.append(ev(2 + n, "chip.registered", d1 + "00:00:00Z", chip_id=chip, node=f"n{n // 2 + 1}"))
    out += [
        ev(10, "quota.granted", d1 + "00:00:00Z", grant_id="g-b", team="beta", chips=1),
        ev(11, "burst.requested", d1 + "20:00:00Z", request_id="r1", team="beta", chips=1,
           window_start=d1 + "21:00:00Z", window_end=d2 + "03:00:00Z"),
        ev(12, "job.submitted", d1 + "21:00:00Z", job_id="jb", team="beta", chips=2, priority=1),
        ev(13, "job.started", d1 + "21:00:00Z", job_id="jb"),
        ev(14, "job.finished", d2 + "03:00:00Z", job_id="jb", outcome="succeeded"),
        ev(15, "pool.tick", d2 + "12:00:00Z"),
    ]
    return out


def run_fixture(tmp_path: Path, events: list[dict]) -> tuple[Path, str]:
    src = tmp_path / "events.jsonl"
    src.write_text("".join(json.dumps(e) + "\n" for e in events))
    lake, store = tmp_path / "lake", f"sqlite:///{tmp_path / 'store.db'}"
    r = runner.invoke(app, ["run", "--events", str(src), "--lake", str(lake), "--store", store])
    assert r.exit_code == 0, r.output
    return lake, store


def statements(lake: Path, store: str, out: Path, *args: str):
    r = runner.invoke(app, ["statements", "--lake", str(lake), "--store", store, "--out", str(out), *args])
    return r


def load(out: Path, period: str, team: str) -> dict:
    return json.loads((out / period / f"{file_stem(team)}.json").read_text())


def a100(st: dict) -> dict:
    """The statement's total of its one flavor (the fixture's pool is lab/a100), zeros when it used no pool:
    `totals` is one block per flavor, never a sum across flavors."""
    assert len(st["totals"]) <= 1 and all(t["flavor"] == "a100" for t in st["totals"]), st["totals"]
    zero = {k: 0 for k in ("entitled_mchip_s", "in_quota_mchip_s", "borrowed_mchip_s", "burst_mchip_s",
                           "used_mchip_s", "unused_entitlement_mchip_s", "pending_mchip_s")}
    return st["totals"][0] if st["totals"] else zero


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("statements")
    lake, store = run_fixture(tmp, fixture_events())
    out = tmp / "out"
    for period in ("2026-11-02..2026-11-02", "2026-11-03..2026-11-03", "2026-11-02..2026-11-03"):
        r = statements(lake, store, out, "--period", period)
        assert r.exit_code == 0, r.output
    return tmp, lake, store, out


def test_day_one_figures_are_exact(books):
    _, _, _, out = books
    a = load(out, "2026-11-02..2026-11-02", "org/alpha")
    assert a["partial"] is False and a["books_closed_through"] == "2026-11-03T00:00:00Z"
    t = a100(a)
    assert (t["entitled_mchip_s"], t["in_quota_mchip_s"], t["borrowed_mchip_s"], t["burst_mchip_s"]) == \
        (36 * H, 36 * H, 36 * H, 0)
    assert t["unused_entitlement_mchip_s"] == 0 and t["used_mchip_s"] == 72 * H
    assert t["entitled_chip_h"] == 36.0
    b = a100(load(out, "2026-11-02..2026-11-02", "beta"))
    assert (b["entitled_mchip_s"], b["used_mchip_s"], b["unused_entitlement_mchip_s"]) == (48 * H, 0, 48 * H)
    q = a100(load(out, "2026-11-02..2026-11-02", "quiet"))
    assert (q["entitled_mchip_s"], q["unused_entitlement_mchip_s"]) == (24 * H, 24 * H)
    # the quota change at noon shows in the daily series: 36 chip-h entitled on the day
    assert a["daily"] == [{"flavor": "a100", "day": "2026-11-02", "entitled_mchip_s": 36 * H, "in_quota_mchip_s": 36 * H,
                           "borrowed_mchip_s": 36 * H, "burst_mchip_s": 0}]


def test_day_two_preemption_and_pending(books):
    _, _, _, out = books
    a = load(out, "2026-11-03..2026-11-03", "org/alpha")
    t = a100(a)
    assert (t["entitled_mchip_s"], t["in_quota_mchip_s"], t["borrowed_mchip_s"]) == (24 * H, 6 * H, 12 * H)
    assert t["unused_entitlement_mchip_s"] == 18 * H and t["pending_mchip_s"] == 54 * H
    s = a["preemptions"]["suffered"]
    assert s["count"] == 1 and s["lost_work_mchip_s"] == 90 * H
    assert s["jobs"][0]["job_id"] == "j1" and s["jobs"][0]["at"] == "2026-11-03T06:00:00Z"
    assert a["goodput"]["allocated_mchip_s"] == 90 * H and a["goodput"]["lost_mchip_s"] == 90 * H
    assert a["goodput"]["goodput"] == 0.0 and a["goodput"]["met"] is False
    # the restart wait began in the period and has not ended
    assert a["scheduling"]["restarts"] == 1 and a["scheduling"]["started"] == 0


def test_team_with_no_activity_gets_a_zero_statement(books):
    _, _, _, out = books
    q = load(out, "2026-11-03..2026-11-03", "quiet")
    assert q["pools"] == [] and q["top_jobs"] == [] and q["preemptions"]["suffered"]["count"] == 0
    assert q["totals"] == [] and q["daily"] == []  # no pool used: no total, of any flavor
    assert "No pool used" in (out / "2026-11-03..2026-11-03" / "quiet.html").read_text()


def test_totals_reconcile_with_the_journal(books):
    from analytics.views import connect

    _, lake, _, out = books
    con = connect(lake)
    for period, (start, end) in {"2026-11-02..2026-11-02": ("2026-11-02", "2026-11-03"),
                                 "2026-11-03..2026-11-03": ("2026-11-03", "2026-11-04"),
                                 "2026-11-02..2026-11-03": ("2026-11-02", "2026-11-04")}.items():
        for team in ("org/alpha", "beta", "quiet"):
            st = load(out, period, team)
            for account in ("entitled", "in_quota", "borrowed", "burst", "pending"):
                want = con.execute(
                    "SELECT coalesce(sum(amount_mchip_s), 0) FROM journal WHERE team = ? AND account = ? "
                    "AND hour >= CAST(? AS TIMESTAMPTZ) AND hour < CAST(? AS TIMESTAMPTZ)",
                    [team, account, start + "T00:00:00Z", end + "T00:00:00Z"]).fetchone()[0]
                assert a100(st)[f"{account}_mchip_s"] == want, (period, team, account)
            for rec in st["reconciliation"]:
                assert rec["balanced"] is True
                assert rec["teams_used_mchip_s"] + rec["idle_mchip_s"] + rec["unavailable_mchip_s"] == \
                    rec["capacity_mchip_s"] + rec["overcommitted_mchip_s"]
    # two days = day one + day two, to the milli-chip-second
    for team in ("org/alpha", "beta", "quiet"):
        both = a100(load(out, "2026-11-02..2026-11-03", team))
        d1 = a100(load(out, "2026-11-02..2026-11-02", team))
        d2 = a100(load(out, "2026-11-03..2026-11-03", team))
        assert all(both[k] == d1[k] + d2[k] for k in both if k.endswith("_mchip_s"))
    pool = load(out, "2026-11-02..2026-11-02", "org/alpha")["reconciliation"][0]
    assert (pool["capacity_mchip_s"], pool["teams_used_mchip_s"], pool["idle_mchip_s"]) == (96 * H, 72 * H, 24 * H)


def test_reissuing_gives_byte_identical_files(books):
    tmp, lake, store, out = books
    again = tmp / "again"
    r = statements(lake, store, again, "--period", "2026-11-02..2026-11-03")
    assert r.exit_code == 0, r.output
    first = sorted((out / "2026-11-02..2026-11-03").iterdir())
    second = sorted((again / "2026-11-02..2026-11-03").iterdir())
    assert [p.name for p in first] == [p.name for p in second] and len(first) == 3 * 5
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes(), a.name
    st = load(out, "2026-11-02..2026-11-03", "beta")
    assert st["computed_at_positions"] == {"file:events.jsonl/0": len(fixture_events())}


def test_html_and_markdown_structure(books):
    _, _, _, out = books
    folder = out / "2026-11-02..2026-11-02"
    html = (folder / "org%2Falpha.html").read_text()
    # summary first, then the chart, then details
    order = [html.index(x) for x in ('id="summary"', 'id="chart"', 'id="pools"', 'id="reconciliation"')]
    assert order == sorted(order)
    assert "<svg" in html and "<h1>Quota statement: org/alpha, 2026-11-02..2026-11-02</h1>" in html
    md = (folder / "org%2Falpha.md").read_text()
    assert md.startswith("# Quota statement: org/alpha, 2026-11-02..2026-11-02\n")
    assert "![use against quota](org%252Falpha.svg)" in md and (folder / "org%2Falpha.svg").read_bytes().startswith(b"<?xml")
    assert "| Entitled (quota × time) | 36.0 |" in md
    csv = (folder / "org%2Falpha.csv").read_text().splitlines()
    assert csv[0].startswith("period,team,pool,partial,") and csv[-1].split(",")[2] == "(total a100)"  # per flavor


def test_partial_period_is_marked(books):
    _, lake, store, out = books
    r = statements(lake, store, out, "--period", "2026-11", "--format", "json", "--team", "beta")
    assert r.exit_code == 0, r.output
    st = load(out, "2026-11", "beta")
    assert st["partial"] is True and st["books_closed_through"] == "2026-11-04T00:00:00Z"
    assert a100(st)["entitled_mchip_s"] == 96 * H
    assert "partial" in r.output


def test_burst_spanning_two_periods(tmp_path):
    lake, store = run_fixture(tmp_path, burst_events())
    out = tmp_path / "out"
    for p in ("2026-11-02..2026-11-02", "2026-11-03..2026-11-03"):
        assert statements(lake, store, out, "--period", p, "--format", "json").exit_code == 0
    d1 = a100(load(out, "2026-11-02..2026-11-02", "beta"))
    d2 = a100(load(out, "2026-11-03..2026-11-03", "beta"))
    assert (d1["burst_mchip_s"], d2["burst_mchip_s"]) == (3 * H, 3 * H)
    assert (d1["in_quota_mchip_s"], d2["in_quota_mchip_s"]) == (3 * H, 3 * H)
    assert d1["borrowed_mchip_s"] == d2["borrowed_mchip_s"] == 0


def test_every_issues_each_closed_period_once(tmp_path):
    lake, store = run_fixture(tmp_path, fixture_events())
    out = tmp_path / "weekly"
    # the books end 2026-11-04: no week is closed yet
    r = statements(lake, store, out, "--every", "week")
    assert r.exit_code == 0 and "no statement due" in r.output
    # a longer history: a tick on 2026-11-17 closes weeks 45 (Nov 2-8) and 46 (Nov 9-15)
    events = fixture_events() + [ev(99, "pool.tick", "2026-11-17T00:00:00Z")]
    (tmp_path / "longer").mkdir()
    lake, store = run_fixture(tmp_path / "longer", events)
    r = statements(lake, store, out, "--every", "week")
    assert r.exit_code == 0, r.output
    issued = sorted(p.name for p in out.iterdir())
    assert issued == ["2026-W45", "2026-W46"]
    rows = sqlite3.connect(store.removeprefix("sqlite:///")).execute(
        "SELECT statement_id, positions_json FROM statement_runs ORDER BY 1").fetchall()
    assert [r[0] for r in rows] == [f"{t}@{w}" for t in ("beta", "org/alpha", "quiet")
                                    for w in ("2026-W45", "2026-W46")]
    assert json.loads(rows[0][1]) == {"file:events.jsonl/0": len(events)}
    # again: nothing new is due, nothing is rewritten
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    r = statements(lake, store, out, "--every", "week")
    assert r.exit_code == 0 and "no statement due" in r.output
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    # --due takes the kind from [statements] every (here from the environment): months, none closed yet
    r = runner.invoke(app, ["statements", "--due", "--lake", str(lake), "--store", store, "--out", str(out)],
                      env={"CHIPLEDGER_STATEMENTS_EVERY": "month"})
    assert r.exit_code == 0 and "no statement due" in r.output


def test_bad_requests_get_clear_errors(books):
    _, lake, store, out = books
    r = statements(lake, store, out, "--period", "2026-13")
    assert r.exit_code == 2 and "month must be 01-12" in r.output
    r = statements(lake, store, out, "--period", "2026-11", "--team", "nobody")
    assert r.exit_code == 2 and "unknown team" in r.output and "org/alpha" in r.output
    r = statements(lake, store, out, "--period", "2026-11", "--format", "pdf")
    assert r.exit_code == 2 and "--format" in r.output
    r = statements(lake, store, out)
    assert r.exit_code == 2 and "exactly one of --period, --every and --due" in r.output


@pytest.mark.parametrize("text,kind,start,end", [
    ("2026-11", "month", "2026-11-01", "2026-12-01"),
    ("2026-12", "month", "2026-12-01", "2027-01-01"),
    ("2026-W45", "week", "2026-11-02", "2026-11-09"),
    ("2026-W53", "week", "2026-12-28", "2027-01-04"),
    ("2026-11-01..2026-11-15", "custom", "2026-11-01", "2026-11-16"),
])
def test_parse_period(text, kind, start, end):
    p = parse_period(text)
    assert (p.kind, p.start.date().isoformat(), p.end.date().isoformat()) == (kind, start, end)


@pytest.mark.parametrize("text", ["2026-00", "2026-W54", "2026-11-15..2026-11-01", "last month", "2026-11-01..x"])
def test_parse_period_rejects(text):
    with pytest.raises(StatementError):
        parse_period(text)


def test_closed_periods():
    from datetime import datetime, timezone

    utc = timezone.utc
    weeks = closed_periods("week", datetime(2026, 11, 4, tzinfo=utc), datetime(2026, 11, 23, tzinfo=utc))
    assert [p.label for p in weeks] == ["2026-W45", "2026-W46", "2026-W47"]
    months = closed_periods("month", datetime(2026, 10, 31, 23, tzinfo=utc), datetime(2026, 12, 1, tzinfo=utc))
    assert [p.label for p in months] == ["2026-10", "2026-11"]
    assert period_containing("week", datetime(2027, 1, 1, tzinfo=utc)).label == "2026-W53"


def test_preemption_caused_and_suffered_through_a_decision(tmp_path):
    """alpha (1 chip of quota) borrows 3 of the pool's 4 chips; beta (3 chips of quota) submits a 2-chip job at
    01:00. After the grace period the ledger decides a reclaim (seen at the 01:05 tick); the cluster acts on it
    at 01:06 naming the decision. alpha's statement shows the preemption suffered with the decision and its
    beneficiary; beta's shows the preemption caused with the work its victim lost."""
    d = "2026-11-02T"
    base = [ev(1, "pool.configured", d + "00:00:00Z", flavor="a100", chips_per_node=2)]
    base += [ev(2 + n, "chip.registered", d + "00:00:00Z", chip_id=c, node=f"n{n // 2 + 1}")
             for n, c in enumerate(("c1", "c2", "c3", "c4"))]
    base += [
        ev(10, "quota.granted", d + "00:00:00Z", grant_id="g-a", team="alpha", chips=1),
        ev(11, "quota.granted", d + "00:00:00Z", grant_id="g-b", team="beta", chips=3),
        ev(12, "job.submitted", d + "00:00:00Z", job_id="ja", team="alpha", chips=4, priority=1),
        ev(13, "job.started", d + "00:00:00Z", job_id="ja"),
        ev(14, "job.submitted", d + "01:00:00Z", job_id="jb", team="beta", chips=2, priority=1),
        ev(15, "pool.tick", d + "01:05:00Z"),
    ]
    first = tmp_path / "first"
    first.mkdir()
    lake, _ = run_fixture(first, base)
    from analytics.views import connect

    rows = connect(lake).execute(
        "SELECT decision_id, rule, team FROM decisions WHERE type = 'decision.preempt'").fetchall()
    assert len(rows) == 1 and rows[0][1:] == ("reclaim", "beta")
    decision_id = rows[0][0]
    events = base + [
        ev(16, "job.preempted", d + "01:06:00Z", job_id="ja", decision_id=decision_id),
        ev(17, "job.started", d + "01:06:00Z", job_id="jb"),
        ev(18, "pool.tick", "2026-11-03T00:00:00Z"),
    ]
    lake, store = run_fixture(tmp_path, events)
    out = tmp_path / "out"
    assert statements(lake, store, out, "--period", "2026-11-02..2026-11-02", "--format", "json,md").exit_code == 0
    alpha = load(out, "2026-11-02..2026-11-02", "alpha")["preemptions"]
    assert alpha["suffered"]["count"] == 1
    job = alpha["suffered"]["jobs"][0]
    assert (job["job_id"], job["decision_id"], job["beneficiary_team"], job["beneficiary_job_id"]) == \
        ("ja", decision_id, "beta", "jb")
    assert job["lost_work_mchip_s"] == 4 * 3960 * 1000  # 4 chips from 00:00 to 01:06, never checkpointed
    beta = load(out, "2026-11-02..2026-11-02", "beta")["preemptions"]
    assert beta["caused"]["count"] == 1 and beta["suffered"]["count"] == 0
    caused = beta["caused"]["decisions"][0]
    assert (caused["decision_id"], caused["rule"], caused["job_id"], caused["victims"]) == \
        (decision_id, "reclaim", "jb", 1)
    assert caused["lost_work_mchip_s"] == 4 * 3900 * 1000  # the victim's work at the decision (01:05)
    assert (caused["own_victims"], caused["others_victims"], caused["own_lost_work_mchip_s"],
            caused["others_lost_work_mchip_s"]) == (0, 1, 0, 4 * 3900 * 1000)
    assert "| reclaim | jb | 0 | 1 | 0.0 | 4.3 |" in (out / "2026-11-02..2026-11-02" / "beta.md").read_text()


def test_preemptions_caused_of_the_teams_own_jobs_are_not_others_work(tmp_path):
    """alpha holds 2 chips and may not borrow; its 2-chip job a1 (priority 1) runs from 00:00; at 01:00 it
    submits a2 (2 chips, priority 9): the priority rule preempts alpha's own a1. The statement counts that
    victim and its lost work (2 chips x 3,900 s at the 01:05 decision) as the team's own, not others'."""
    d = "2026-11-02T"
    events = [ev(1, "pool.configured", d + "00:00:00Z", flavor="a100", chips_per_node=2)]
    events += [ev(2 + n, "chip.registered", d + "00:00:00Z", chip_id=c, node=f"n{n // 2 + 1}")
               for n, c in enumerate(("c1", "c2", "c3", "c4"))]
    events += [
        ev(10, "quota.granted", d + "00:00:00Z", grant_id="g-a", team="alpha", chips=2, borrowing_limit=0),
        ev(11, "job.submitted", d + "00:00:00Z", job_id="a1", team="alpha", chips=2, priority=1),
        ev(12, "job.started", d + "00:00:00Z", job_id="a1"),
        ev(13, "job.submitted", d + "01:00:00Z", job_id="a2", team="alpha", chips=2, priority=9),
        ev(14, "pool.tick", d + "01:05:00Z"),  # after the grace period: the decision
        ev(15, "pool.tick", "2026-11-03T00:00:00Z"),
    ]
    lake, store = run_fixture(tmp_path, events)
    out = tmp_path / "out"
    assert statements(lake, store, out, "--period", "2026-11-02..2026-11-02", "--format", "json,md").exit_code == 0
    caused = load(out, "2026-11-02..2026-11-02", "alpha")["preemptions"]["caused"]
    assert caused["decisions"][0]["rule"] == "priority"
    assert (caused["count"], caused["victims"], caused["own_victims"], caused["others_victims"]) == (1, 1, 1, 0)
    assert (caused["own_lost_work_mchip_s"], caused["others_lost_work_mchip_s"]) == (2 * 3900 * 1000, 0)
    md = (out / "2026-11-02..2026-11-02" / "alpha.md").read_text()
    assert ("1 decisions, 1 victims: 1 of the team's own jobs (2.2 chip-hours of own work lost), 0 of other "
            "teams' jobs (0.0 chip-hours of others' work lost)") in md


def test_chart_per_pool_never_adds_unlike_chips(tmp_path):
    """gamma holds 4 chips of lab/a100 and uses 1 (under quota there) and borrows 2 TPU chips in lab/tpu where
    it holds none. Added on one axis that reads 3 chips used against 4 of quota, 2 of them borrowed; per pool
    it is 1 of 4 in quota on the A100s and 2 borrowed on the TPUs."""
    d1, d2 = "2026-11-02T", "2026-11-03T"
    events = []
    for k, (pool, flavor) in enumerate((("lab/a100", "a100"), ("lab/tpu", "tpu-v5e"))):
        def pev(i, typ, at, **f):
            return {**ev(100 * k + i, typ, at, **f), "pool": pool}
        events += [pev(1, "pool.configured", d1 + "00:00:00Z", flavor=flavor, chips_per_node=4)]
        events += [pev(2 + n, "chip.registered", d1 + "00:00:00Z", chip_id=f"{flavor}-{n}", node="n1")
                   for n in range(4)]
    events += [
        {**ev(20, "quota.granted", d1 + "00:00:00Z", grant_id="g", team="gamma", chips=4), "pool": "lab/a100"},
        {**ev(21, "job.submitted", d1 + "00:00:00Z", job_id="ga", team="gamma", chips=1, priority=1),
         "pool": "lab/a100"},
        {**ev(22, "job.started", d1 + "00:00:00Z", job_id="ga"), "pool": "lab/a100"},
        {**ev(120, "job.submitted", d1 + "00:00:00Z", job_id="gt", team="gamma", chips=2, priority=1),
         "pool": "lab/tpu"},
        {**ev(121, "job.started", d1 + "00:00:00Z", job_id="gt"), "pool": "lab/tpu"},
        {**ev(30, "pool.tick", d2 + "00:00:00Z"), "pool": "lab/a100"},
        {**ev(130, "pool.tick", d2 + "00:00:00Z"), "pool": "lab/tpu"},
    ]
    lake, store = run_fixture(tmp_path, events)
    out = tmp_path / "out"
    assert statements(lake, store, out, "--period", "2026-11-02..2026-11-02", "--format", "json,html").exit_code == 0
    st = load(out, "2026-11-02..2026-11-02", "gamma")
    days = {p["pool"]: p["daily"] for p in st["pools"]}
    assert days["lab/a100"] == [{"day": "2026-11-02", "entitled_mchip_s": 4 * 86_400_000,
                                 "in_quota_mchip_s": 86_400_000, "borrowed_mchip_s": 0, "burst_mchip_s": 0}]
    assert days["lab/tpu"] == [{"day": "2026-11-02", "entitled_mchip_s": 0, "in_quota_mchip_s": 0,
                                "borrowed_mchip_s": 2 * 86_400_000, "burst_mchip_s": 0}]
    from chipledger.reports.statements import _chart, chart_svg

    svg = chart_svg(st).decode()
    fig, arts = _chart(2)
    assert [a[4].get_text() for a in arts] == ["lab/a100", "lab/tpu"]  # one panel per pool, titled
    assert ">lab/a100<" in svg and ">lab/tpu<" in svg
    # the A100 panel: quota line at 4, in quota 1, nothing borrowed; the TPU panel: 2 borrowed, no quota
    (_, a_patches, a_quota, _, _), (_, t_patches, t_quota, _, _) = arts
    assert list(a_quota.get_data().values) == [4.0] and list(a_patches[1].get_data().values) == [1.0]
    assert list(t_quota.get_data().values) == [0.0] and list(t_patches[1].get_data().values) == [2.0]


def test_totals_never_add_unlike_chips(tmp_path):
    """gamma uses A100s and TPUs (the scenario of the chart test): no chip total across them, one per flavor."""
    import csv as csv_mod
    import io as io_mod

    test_chart_per_pool_never_adds_unlike_chips(tmp_path)
    out = tmp_path / "out2"
    lake, store = tmp_path / "lake", None
    from chipledger.reports.statements import render_csv
    st = load(tmp_path / "out", "2026-11-02..2026-11-02", "gamma")
    assert [(t["flavor"], t["in_quota_mchip_s"], t["borrowed_mchip_s"]) for t in st["totals"]] == [
        ("a100", 86_400_000, 0), ("tpu-v5e", 0, 2 * 86_400_000)]
    rows = list(csv_mod.reader(io_mod.StringIO(render_csv(st).decode())))
    assert [r[2] for r in rows[1:]] == ["lab/a100", "lab/tpu", "(total a100)", "(total tpu-v5e)"]
    assert st["cost"]["priced"] is False and st["cost"]["totals"] == []  # no price: no cost, not zero
    del out, lake, store
