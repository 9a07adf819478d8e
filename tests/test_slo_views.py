"""The first SLO views on the hand-computed fixture (tests/fixtures/hand.jsonl, see tests/test_cli.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from chipledger.cli import app


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    d = tmp_path_factory.mktemp("slo")
    res = CliRunner().invoke(app, ["run", "--events", "tests/fixtures/hand.jsonl", "--lake", str(d / "lake"),
                                   "--store", f"sqlite:///{d / 'x.db'}"])
    assert res.exit_code == 0, res.output
    return d / "lake"


def sql(lake, query):
    res = CliRunner().invoke(app, ["sql", "--lake", str(lake), "--format", "json", query])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_slo_capacity(lake):
    # 4 chips registered 00:00-03:30 = 4 x 12,600 s; c1 down 01:30-02:30 = 3,600 s
    rows = sql(lake, "SELECT * FROM slo_capacity")
    assert rows == [{"day": "2026-11-02", "pool": "lab/a100", "registered_mchip_s": 50_400_000,
                     "healthy_mchip_s": 46_800_000, "availability": pytest.approx(46.8 / 50.4)}]


def test_oversubscription(lake):
    rows = sql(lake, "SELECT hour, entitled_mchip_s, capacity_mchip_s, ratio FROM oversubscription ORDER BY hour")
    # a has 2 of 4 chips from 00:00; b adds 1 from 01:00
    assert [(r["entitled_mchip_s"], r["capacity_mchip_s"], r["ratio"]) for r in rows] == [
        (7_200_000, 14_400_000, 0.5), (10_800_000, 14_400_000, 0.75), (10_800_000, 14_400_000, 0.75),
        (5_400_000, 7_200_000, 0.75)]


def test_goodput(lake):
    rows = sql(lake, "SELECT level, team, job_id, allocated_mchip_s, lost_mchip_s, goodput FROM goodput "
                     "ORDER BY level, team NULLS FIRST, job_id NULLS FIRST")
    # ja1: 21.6M allocated, 7.2M lost (1.8M at the preemption, 5.4M at the failure); jb1: 5.1M, none lost
    assert rows == [
        {"level": "job", "team": "a", "job_id": "ja1", "allocated_mchip_s": 21_600_000, "lost_mchip_s": 7_200_000,
         "goodput": pytest.approx(14.4 / 21.6)},
        {"level": "job", "team": "b", "job_id": "jb1", "allocated_mchip_s": 5_100_000, "lost_mchip_s": 0,
         "goodput": 1.0},
        {"level": "pool", "team": None, "job_id": None, "allocated_mchip_s": 26_700_000, "lost_mchip_s": 7_200_000,
         "goodput": pytest.approx(19.5 / 26.7)},
        {"level": "team", "team": "a", "job_id": None, "allocated_mchip_s": 21_600_000, "lost_mchip_s": 7_200_000,
         "goodput": pytest.approx(14.4 / 21.6)},
        {"level": "team", "team": "b", "job_id": None, "allocated_mchip_s": 5_100_000, "lost_mchip_s": 0,
         "goodput": 1.0},
    ]


def test_demand_hourly(lake):
    rows = sql(lake, "SELECT team, hour, running_mchip_s, pending_mchip_s, demand_mchip_s FROM demand_hourly "
                     "ORDER BY team, hour")
    got = {(r["team"], r["hour"][11:13]): (r["running_mchip_s"], r["pending_mchip_s"], r["demand_mchip_s"])
           for r in rows}
    # a: ja1 waits 00:30-00:40 and 02:00-02:10 (3 chips), runs as in test_cli's journal; b: jb1 waits 01:00-01:15
    assert got == {
        ("a", "00"): (3_600_000, 1_800_000, 5_400_000),
        ("a", "01"): (9_000_000, 0, 9_000_000),
        ("a", "02"): (9_000_000, 1_800_000, 10_800_000),
        ("a", "03"): (0, 0, 0),
        ("b", "01"): (2_700_000, 900_000, 3_600_000),
        ("b", "02"): (2_400_000, 0, 2_400_000),
        ("b", "03"): (0, 0, 0),
    }


# --- the SLO views on a second hand-computed fixture -----------------------------------------------------------
# Pool p: 3 nodes of 2 chips (n0: c0 c1, n1: c2 c3, n2: c4 c5), Monday 2026-11-02, then nothing on Tuesday (a
# day without events) until a tick at Wednesday 00:00. Team a holds 2 chips (g1, amended to 4 at 01:20: quota
# changed mid-day), team b 1 chip.
#   A1 (a, 2 chips, prio 5)  submitted 00:00, started 00:05 on c0 c1, finished 03:00
#   B1 (b, 2 chips, prio 1)  submitted 00:10, started 00:30 on c2 c3, checkpoint 01:30, preempted 02:00,
#                            restarted 02:05, preempted 02:30 (twice), restarted 02:50, finished 03:00
#   A2 (a, 1 chip, prio 5)   submitted 01:00, cancelled 01:08 before starting
#   A3 (a, 1 chip, prio 5)   submitted 01:25 (fits a's new quota), started 01:45 on c4, finished 02:15
#   c5 in maintenance 02:20-02:40 (a chip down for part of an hour)

from datetime import datetime, timezone  # noqa: E402

from analytics.sqlite_mirror import mirror  # noqa: E402
from analytics.views import connect  # noqa: E402
from chipledger.embedded import run_file  # noqa: E402

P = "p/h100"


def _ev(n, etype, hhmm, day=2, **fields):
    return {"event_id": f"s-{n}", "type": etype, "occurred_at": f"2026-11-0{day}T{hhmm}:00Z", "pool": P,
            "source": "test", **fields}


def slo_events():
    e = [_ev(0, "pool.configured", "00:00", flavor="h100", chips_per_node=2)]
    e += [_ev(f"r{i}", "chip.registered", "00:00", chip_id=f"c{i}", node=f"n{i // 2}") for i in range(6)]
    e += [_ev("g1", "quota.granted", "00:00", grant_id="g1", team="a", chips=2),
          _ev("gb", "quota.granted", "00:00", grant_id="gb", team="b", chips=1),
          _ev(1, "job.submitted", "00:00", job_id="A1", team="a", chips=2, priority=5),
          _ev(2, "job.started", "00:05", job_id="A1", chip_ids=["c0", "c1"]),
          _ev(3, "job.submitted", "00:10", job_id="B1", team="b", chips=2, priority=1),
          _ev(4, "job.started", "00:30", job_id="B1", chip_ids=["c2", "c3"]),
          _ev(5, "job.submitted", "01:00", job_id="A2", team="a", chips=1, priority=5),
          _ev(6, "job.finished", "01:08", job_id="A2", outcome="cancelled"),
          _ev(7, "quota.granted", "01:20", grant_id="g1", team="a", chips=4),
          _ev(8, "job.submitted", "01:25", job_id="A3", team="a", chips=1, priority=5),
          _ev(9, "job.checkpointed", "01:30", job_id="B1"),
          _ev(10, "job.started", "01:45", job_id="A3", chip_ids=["c4"]),
          _ev(11, "job.preempted", "02:00", job_id="B1"),
          _ev(12, "job.started", "02:05", job_id="B1", chip_ids=["c2", "c3"]),
          _ev(13, "job.finished", "02:15", job_id="A3", outcome="succeeded"),
          _ev(14, "chip.state_changed", "02:20", chip_id="c5", state="maintenance"),
          _ev(15, "job.preempted", "02:30", job_id="B1"),
          _ev(16, "chip.state_changed", "02:40", chip_id="c5", state="healthy"),
          _ev(17, "job.started", "02:50", job_id="B1", chip_ids=["c2", "c3"]),
          _ev(18, "job.finished", "03:00", job_id="A1", outcome="succeeded"),
          _ev(19, "job.finished", "03:00", job_id="B1", outcome="succeeded"),
          _ev(20, "pool.tick", "00:00", day=4)]
    return e


def run_slo_lake(d):
    """Fold slo_events() into a lake under folder d (shared by the report and alerts tests); returns the lake."""
    f = d / "events.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in slo_events()))
    summary, _ = run_file(f, d / "lake")
    assert summary.dead_letters == {} and summary.accepted == len(slo_events())
    return d / "lake"


@pytest.fixture(scope="module")
def slo_lake(tmp_path_factory):
    return run_slo_lake(tmp_path_factory.mktemp("slo2"))


def q(con, query):
    cur = con.execute(query)
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def hm(ts):
    return None if ts is None else ts.strftime("%H:%M")


def test_grant_intervals_follow_the_amendment(slo_lake):
    rows = q(connect(slo_lake), "SELECT grant_id, team, chips_milli, effective_from, effective_until "
                                "FROM grant_intervals ORDER BY grant_id, effective_from")
    assert [(r["grant_id"], r["chips_milli"], hm(r["effective_from"]), hm(r["effective_until"])) for r in rows] == [
        ("g1", 2000, "00:00", "01:20"), ("g1", 4000, "01:20", None), ("gb", 1000, "00:00", None)]


def test_sched_waits_classify_each_wait(slo_lake):
    rows = q(connect(slo_lake), "SELECT job_id, kind, after_run, quota_class, nominal_milli, running_milli, "
                                "waiting_since, started_at, wait_s, slo_result FROM sched_waits "
                                "ORDER BY waiting_since, job_id")
    got = [(r["job_id"], r["kind"], r["after_run"], r["quota_class"], r["nominal_milli"], r["running_milli"],
            hm(r["waiting_since"]), hm(r["started_at"]), r["wait_s"], r["slo_result"]) for r in rows]
    assert got == [
        # A1 fits a's 2 chips; B1 wants 2 of b's 1: borrowing
        ("A1", "first_start", 0, "in_quota", 2000, 0, "00:00", "00:05", 300, "within"),
        ("B1", "first_start", 0, "borrowing", 1000, 0, "00:10", "00:30", 1200, "late"),
        # A2: a's 2 chips are all running (A1); cancelled after 8 minutes, before the 10-minute threshold
        ("A2", "first_start", 0, "borrowing", 2000, 2000, "01:00", None, None, "open"),
        # A3: after the amendment a has 4, 2 running: 1 more fits
        ("A3", "first_start", 0, "in_quota", 4000, 2000, "01:25", "01:45", 1200, "late"),
        # B1's own run ended at the preemption instant: not counted as running
        ("B1", "restart", 1, "borrowing", 1000, 0, "02:00", "02:05", 300, "within"),
        ("B1", "restart", 2, "borrowing", 1000, 0, "02:30", "02:50", 1200, "late"),
    ]


def test_slo_quota_honoured(slo_lake):
    rows = q(connect(slo_lake), "SELECT * FROM slo_quota_honoured")
    assert rows == [{"pool": P, "team": "a", "day": datetime(2026, 11, 2).date(), "in_quota_submissions": 2,
                     "honoured": 1, "late": 1, "open": 0, "attainment": 0.5, "target": 0.95, "sched_slo_s": 600}]


def test_slo_sched_latency_nearest_rank_percentiles(slo_lake):
    rows = q(connect(slo_lake), "SELECT * FROM slo_sched_latency ORDER BY priority")
    assert rows == [
        # B1: waits 300, 1200, 1200 -> p50 is the 2nd of 3
        {"pool": P, "priority": 1, "quota_class": "borrowing", "waits": 3, "first_starts": 1, "restarts": 2,
         "p50_s": 1200, "p90_s": 1200, "p99_s": 1200, "max_s": 1200, "within_slo": pytest.approx(1 / 3)},
        # A1 300, A3 1200 (A2 never started: not a latency)
        {"pool": P, "priority": 5, "quota_class": "in_quota", "waits": 2, "first_starts": 2, "restarts": 0,
         "p50_s": 300, "p90_s": 1200, "p99_s": 1200, "max_s": 1200, "within_slo": 0.5},
    ]


def test_error_budget_over_the_whole_history(slo_lake):
    rows = {(r["slo"], r["pool"]): r for r in q(connect(slo_lake), "SELECT * FROM error_budget")}
    assert set(rows) == {(s, p) for s in ("availability", "quota_honoured", "sched_latency", "goodput")
                         for p in (P, None)}
    av = rows[("availability", P)]
    # 6 chips x 48 h registered; c5 in maintenance 20 minutes
    assert (av["good"], av["total"], av["bad"], av["unit"]) == (1_035_600_000, 1_036_800_000, 1_200_000, "mchip_s")
    assert av["consumed"] == pytest.approx((1.2 / 1036.8) / 0.01)
    assert av["remaining"] == pytest.approx(1 - (1.2 / 1036.8) / 0.01)
    assert (hm(av["window_end"]), av["window_end"].day, av["window_start"].day, av["window_start"].month) == (
        "00:00", 4, 5, 10)  # 30 days back from the last event (2026-11-04 00:00)
    gp = rows[("goodput", P)]
    # allocated: A1 2x10,500 s, B1 2x5,400 + 2x1,500 + 2x600, A3 1,800; lost: B1 2x1,800 (since the checkpoint)
    # and 2x1,500 (the whole second run)
    assert (gp["good"], gp["total"]) == (31_200_000, 37_800_000)
    assert gp["consumed"] == pytest.approx((6.6 / 37.8) / 0.1)
    assert (rows[("sched_latency", P)]["good"], rows[("sched_latency", P)]["total"]) == (2, 5)
    qh = rows[("quota_honoured", P)]
    assert (qh["good"], qh["total"], qh["sli"], qh["budget"]) == (1, 2, 0.5, pytest.approx(0.05))
    assert qh["consumed"] == pytest.approx(10.0) and qh["remaining"] == pytest.approx(-9.0)
    assert {k: rows[("goodput", None)][k] for k in ("good", "total")} == {"good": 31_200_000, "total": 37_800_000}


def test_at_the_end_of_the_log_only_the_spent_budgets_fire(slo_lake):
    # nothing happened in the last 6 hours before Wednesday 00:00: no short window burns; but budgets spent over
    # the 30-day window are a ticket each, per pool and team as the Prometheus rules' labels (issue 35, item 6)
    rows = q(connect(slo_lake), "SELECT alert, severity, slo, team, long_win, short_win, long_burn FROM burn_alerts "
                                "WHERE firing ORDER BY slo, team")
    assert [(r["alert"], r["severity"], r["slo"], r["team"], r["long_win"], r["short_win"]) for r in rows] == [
        ("budget_exhausted", "ticket", "goodput", "b", "30d", "30d"),
        ("budget_exhausted", "ticket", "quota_honoured", "a", "30d", "30d"),
        ("budget_exhausted", "ticket", "sched_latency", "a", "30d", "30d"),
        ("budget_exhausted", "ticket", "sched_latency", "b", "30d", "30d")]
    # the budget's burn over its window is the share of the budget consumed (error_budget): 10x for quota honoured
    assert rows[1]["long_burn"] == pytest.approx(10.0)


def test_burn_alerts_evaluated_at_03_00(slo_lake):
    con = connect(slo_lake, as_of=datetime(2026, 11, 2, 3, tzinfo=timezone.utc))
    # per SLO, pool and team (None: availability, a pool's SLO), the labels of the Prometheus rules
    rows = {(r["alert"], r["slo"], r["team"]): r for r in q(con, "SELECT * FROM burn_alerts")}
    firing = sorted((k for k, r in rows.items() if r["firing"]), key=str)
    assert firing == sorted([("page_6h", "sched_latency", "b"), ("ticket_3d", "availability", None),
                             ("ticket_3d", "goodput", "b"), ("ticket_3d", "quota_honoured", "a"),
                             ("ticket_3d", "sched_latency", "a"), ("ticket_3d", "sched_latency", "b")]
                            + [("budget_exhausted", k[1], k[2]) for k in (
                                ("", "availability", None), ("", "goodput", "b"), ("", "quota_honoured", "a"),
                                ("", "sched_latency", "a"), ("", "sched_latency", "b"))], key=str)
    sl = rows[("page_6h", "sched_latency", "b")]
    # team b, 6 h: 2 of B1's 3 waits late = 0.667 / 0.1 budget; 30 min: B1's second restart, late at 02:40 = 1.0 / 0.1
    assert (sl["long_burn"], sl["short_burn"], sl["burn_rate"]) == (pytest.approx(20 / 3), pytest.approx(10.0), 6.0)
    # team a: A1 within, A3 late: 0.5 / 0.1 over 6 h, nothing in the last 30 minutes
    sla = rows[("page_6h", "sched_latency", "a")]
    assert (sla["long_burn"], sla["short_burn"], sla["firing"]) == (pytest.approx(5.0), None, False)
    av = rows[("page_1h", "availability", None)]
    # last hour: 1,200 of 21,600 chip-s down; last 5 minutes: none
    assert (av["long_burn"], av["short_burn"], av["firing"]) == (pytest.approx(1200 / 21600 / 0.01), 0.0, False)
    av6 = rows[("page_6h", "availability", None)]
    # 6 h window: the pool exists from 00:00 (64,800 chip-s); 30 min window: c5 down 02:30-02:40
    assert (av6["long_burn"], av6["short_burn"]) == (pytest.approx(1200 / 64800 / 0.01),
                                                     pytest.approx(600 / 10800 / 0.01))
    gp, gpa = rows[("page_1h", "goodput", "b")], rows[("page_1h", "goodput", "a")]
    # runs ending in (02:00, 03:00]: team b: B1's 2nd (3.0M, all lost) and 3rd (1.2M); team a: A3 and A1, none lost
    assert gp["long_burn"] == pytest.approx(3.0 / 4.2 / 0.1) and gpa["long_burn"] == 0.0
    assert rows[("page_1h", "quota_honoured", "a")]["long_burn"] is None  # nothing resolved in that hour
    assert all(r["evaluated_at"] == datetime(2026, 11, 2, 3, tzinfo=timezone.utc) for r in rows.values())


def test_targets_come_from_the_slo_settings(slo_lake):
    from analytics.slo_views import SloParams

    con = connect(slo_lake, slo=SloParams(sched_latency=0.5, sched_slo_s=1200, window_days=1))
    [r] = q(con, "SELECT * FROM error_budget WHERE slo = 'sched_latency' AND pool IS NOT NULL")
    # with a 20-minute threshold every wait is within; the window is 1 day back from Wednesday 00:00: empty
    assert (r["target"], r["good"], r["total"], r["sli"], r["consumed"], r["window_start"].day) == (
        0.5, 0, 0, None, None, 3)
    [r] = q(con, "SELECT honoured, late FROM slo_quota_honoured")
    assert (r["honoured"], r["late"]) == (2, 0)


def test_fragmentation_over_time(slo_lake):
    rows = q(connect(slo_lake), "SELECT * FROM fragmentation ORDER BY valid_from")
    got = [(hm(r["valid_from"]), r["free_chips"], r["whole_node_free_chips"], r["largest_job_chips"],
            None if r["fragmentation"] is None else round(r["fragmentation"], 4)) for r in rows]
    assert got == [
        ("00:00", 6, 6, 6, 0.0),
        ("00:05", 4, 4, 4, 0.0),      # A1 on n0
        ("00:30", 2, 2, 2, 0.0),      # B1 on n1
        ("01:45", 1, 0, 1, 1.0),      # A3 on c4: only c5 free, on a half-used node (a 1-chip job fits)
        ("02:00", 3, 2, 2, 0.3333),   # B1 preempted: n1 whole again, c5 alone
        ("02:05", 1, 0, 1, 1.0),
        ("02:15", 2, 2, 2, 0.0),      # A3 done: n2 whole
        ("02:20", 1, 0, 1, 1.0),      # c5 in maintenance
        ("02:30", 3, 2, 2, 0.3333),
        ("02:40", 4, 4, 4, 0.0),      # c5 back
        ("02:50", 2, 2, 2, 0.0),
        ("03:00", 6, 6, 6, 0.0),
    ]
    assert all(r["placement_known"] for r in rows)
    assert rows[-1]["valid_until"] == datetime(2026, 11, 4, tzinfo=timezone.utc)
    assert sum(r["duration_s"] for r in rows) == 48 * 3600


def test_demand_shaping_hour_of_week(slo_lake):
    con = connect(slo_lake)
    pool = {r["hour_of_week"]: r for r in q(con, "SELECT * FROM demand_shaping WHERE team IS NULL")}
    assert sorted(pool) == list(range(48))  # Monday and Tuesday, one hour each (Tuesday had no events)
    # Monday 00:00-01:00: running A1 6,600 + B1 3,600 chip-s, pending A1 600 + B1 2,400
    h0 = pool[0]
    assert (h0["day_of_week"], h0["hour_of_day"], h0["hours_observed"]) == (0, 0, 1)
    assert h0["demand_chips"] == pytest.approx(13200 / 3600)
    assert h0["pending_share"] == pytest.approx(3000 / 13200)
    assert h0["idle_chips"] == pytest.approx((21600 - 10200) / 3600)
    assert pool[1]["demand_chips"] == pytest.approx(16980 / 3600)
    assert pool[2]["demand_chips"] == pytest.approx(15300 / 3600)
    assert pool[30]["demand_chips"] == 0 and pool[30]["idle_chips"] == 6.0
    # the peak (Monday 01:00) against the mean over the 48 observed hours
    assert h0["peak_to_average"] == pytest.approx(16980 * 48 / 45480)
    assert [h for h, r in sorted(pool.items()) if r["pool_peak"]] == [1, 2]  # 4.25 >= 0.9 x 4.7167
    assert [h for h, r in sorted(pool.items()) if r["offpeak_idle"]] == list(range(3, 48))
    team_a = {r["hour_of_week"]: r for r in q(con, "SELECT * FROM demand_shaping WHERE team = 'a'")}
    assert team_a[1]["demand_chips"] == pytest.approx(9780 / 3600)
    assert team_a[1]["share_of_pool"] == pytest.approx(9780 / 16980)
    peaks = q(con, "SELECT team, peak_demand_chip_h, share_of_peak, rank FROM demand_peak_teams ORDER BY rank")
    assert peaks == [
        {"team": "a", "peak_demand_chip_h": pytest.approx(17880 / 3600), "share_of_peak": pytest.approx(17880 / 32280),
         "rank": 1},
        {"team": "b", "peak_demand_chip_h": pytest.approx(4.0), "share_of_peak": pytest.approx(14400 / 32280),
         "rank": 2},
    ]


def test_chip_states_agree_with_the_journal(slo_lake):
    con = connect(slo_lake)
    [(registered, available)] = con.execute(
        "SELECT sum(duration_s) FILTER (WHERE registered), sum(duration_s) FILTER (WHERE available) "
        "FROM chip_states").fetchall()
    [(cap, healthy)] = con.execute("SELECT sum(registered_mchip_s), sum(healthy_mchip_s) FROM slo_capacity").fetchall()
    assert (registered * 1000, available * 1000) == (cap, healthy) == (1_036_800_000, 1_035_600_000)


SLO_USER_VIEWS = ("sched_waits", "slo_quota_honoured", "slo_sched_latency", "error_budget", "burn_alerts",
                  "fragmentation", "demand_shaping", "demand_peak_teams", "chip_states", "grant_intervals")


def _norm(v):
    if isinstance(v, datetime):
        return int(v.timestamp())
    if hasattr(v, "isoformat"):  # a date
        return v.isoformat()
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, float):
        return round(v, 9)
    return v


@pytest.mark.parametrize("view", SLO_USER_VIEWS)
def test_the_same_sql_on_sqlite_gives_the_same_rows(slo_lake, view):
    duck = connect(slo_lake, as_of=datetime(2026, 11, 2, 3, tzinfo=timezone.utc))
    lite = mirror(duck)
    a = sorted((tuple(_norm(v) for v in r) for r in duck.execute(f"SELECT * FROM {view}").fetchall()), key=repr)
    b = sorted((tuple(_norm(v) for v in r) for r in lite.execute(f"SELECT * FROM {view}").fetchall()), key=repr)
    assert a and a == b


def test_fragmentation_takes_a_chips_last_state_of_a_second(tmp_path):
    """Several state changes in the same second: the fold's free_chips keeps the last state of the second, and a
    second that ends where it began (here 01:00: c0 down and up, c2 up and into maintenance) adds no step."""
    e = [_ev(0, "pool.configured", "00:00", flavor="h100", chips_per_node=2)]
    e += [_ev(f"r{i}", "chip.registered", "00:00", chip_id=f"c{i}", node=f"n{i // 2}") for i in range(4)]
    e += [_ev(1, "chip.state_changed", "00:30", chip_id="c2", state="down"),
          _ev(2, "chip.state_changed", "01:00", chip_id="c0", state="down"),
          _ev(3, "chip.state_changed", "01:00", chip_id="c0", state="healthy"),
          _ev(4, "chip.state_changed", "01:00", chip_id="c2", state="healthy"),
          _ev(5, "chip.state_changed", "01:00", chip_id="c2", state="maintenance"),
          _ev(6, "pool.tick", "02:00")]
    f = tmp_path / "events.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in e))
    summary, _ = run_file(f, tmp_path / "lake")
    assert summary.dead_letters == {} and summary.accepted == len(e)
    duck = connect(tmp_path / "lake", materialize={"calc_free_steps"})
    for con in (duck, mirror(duck)):
        rows = con.execute("SELECT from_s, until_s, free_milli, free_whole_nodes_milli FROM calc_free_steps "
                           "ORDER BY from_s").fetchall()
        t0 = rows[0][0]
        assert [(t - t0, u - t0, free, whole) for t, u, free, whole in rows] == [(0, 1800, 4000, 4000),
                                                                                 (1800, 7200, 3000, 2000)]
