"""The store contract (DESIGN §6), the same assertions on SQLite and on a real PostgreSQL server.

States come from the ledger core: the hand fixture folded by the embedded run, and small hand-written event
sequences folded with `ledger.Fleet`. The PostgreSQL cluster is started by the session (tests/pg.py); without
server binaries those cases are skipped loudly, or fail with CHIPLEDGER_REQUIRE_POSTGRES=1.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy.exc import IntegrityError, StatementError

from chipledger.embedded import run_file
from ledger import Fleet, FoldConfig
from ledger.books import BORROWED, ENTITLED, IN_QUOTA
from store import Base, open_store
from schemas import parse_payload

FIXTURE = Path(__file__).parent / "fixtures" / "hand.jsonl"
UTC = timezone.utc
T0 = datetime(2026, 11, 2, tzinfo=UTC)


def at(minutes: int) -> str:
    return (T0 + timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc(*args) -> datetime:
    return datetime(*args, tzinfo=UTC)


def assert_utc(value: datetime, expected: datetime) -> None:
    """The same instant, zone-aware, in UTC."""
    assert value == expected
    assert value.tzinfo is not None and value.utcoffset() == timedelta(0), value


# --- fixtures ------------------------------------------------------------------------------------------------

@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    st = open_store(url)
    Base.metadata.drop_all(st.engine)  # a clean slate: the PostgreSQL database is shared by the session
    Base.metadata.create_all(st.engine)
    try:
        yield st
    finally:
        Base.metadata.drop_all(st.engine)
        st.engine.dispose()


class Feed:
    """Hand-written events for a Fleet: the envelope filled in, each event parsed as on the wire."""

    def __init__(self, fleet: Fleet | None = None):
        self.fleet = fleet or Fleet(FoldConfig(check_invariants=True))
        self.n = 0

    def __call__(self, type_: str, pool: str, occurred_at: str, **fields) -> None:
        self.n += 1
        event = parse_payload({"event_id": f"e-{self.n}", "type": type_, "occurred_at": occurred_at, "pool": pool,
                               "source": "test/contract", **fields})
        assert not hasattr(event, "code"), event  # a Rejection: the test's events are wrong
        step = self.fleet.apply(event)
        assert step.applied, step

    def pool(self, name: str, chips: int = 2, minutes: int = 0) -> None:
        self("pool.configured", name, at(minutes), flavor="h100-80gb", chips_per_node=8)
        for i in range(chips):
            self("chip.registered", name, at(minutes), chip_id=f"c{i}", node="n0")

    def state(self, pool: str):
        return self.fleet.pools[pool]


def run_row(run_id: str, started: datetime, **over) -> dict:
    row = {"run_id": run_id, "kind": "embedded", "source": "test", "lake": "lake", "started_at": started,
           "finished_at": started + timedelta(seconds=5), "lines": 10, "accepted": 9, "duplicates": 1,
           "dead_letters": 0, "summary_json": {"note": run_id}}
    row.update(over)
    return row


def two_team_pool(feed: Feed, pool: str = "lab/h100") -> None:
    """Team a: 2 chips granted now until 2026-11-02T22:00Z, one job on c0 since 00:10.
    Team b: 1.5 chips granted from 17:30Z (future at the 02:00 tick), borrowing 0.5, lending 0."""
    feed.pool(pool)
    feed("quota.granted", pool, at(0), grant_id="g-now", team="a", chips=2,
         effective_until="2026-11-03T00:00:00+02:00")
    feed("quota.granted", pool, at(0), grant_id="g-later", team="b", chips=1.5, borrowing_limit=0.5,
         lending_limit=0, effective_from="2026-11-02T12:30:00-05:00")
    feed("job.submitted", pool, at(10), job_id="j1", team="a", chips=1)
    feed("job.started", pool, at(10), job_id="j1", chip_ids=["c0"])
    feed("pool.tick", pool, at(120))


def balances(store) -> dict:
    """Everything the store holds about pools, as plain values (for before/after comparisons)."""
    return {
        "pools": [(p.pool, p.clock, p.chips, p.capacity_milli, p.idle_milli, p.running_jobs, p.applied)
                  for p in store.pool_balances()],
        "teams": [(t.pool, t.team, t.nominal_milli, t.used_milli, t.in_quota_milli, t.entitled_mchip_s,
                   t.in_quota_mchip_s) for t in store.team_balances()],
        "grants": [(g.pool, g.grant_id, g.team, g.chips_milli, g.active, g.effective_from, g.effective_until)
                   for g in store.grants()],
        "runs": [(r.run_id, r.kind, r.lines, r.started_at, r.summary_json) for r in store.runs()],
    }


# --- the contract --------------------------------------------------------------------------------------------

def test_backend_driver(store, request):
    # postgresql:// URLs go to psycopg 3, sqlite:/// to the standard library driver
    expected = {"sqlite": ("sqlite", "pysqlite"), "postgresql": ("postgresql", "psycopg")}
    assert (store.engine.dialect.name, store.engine.dialect.driver) == expected[request.node.callspec.params["store"]]


def test_embedded_run_round_trip(store, tmp_path):
    summary, fleet = run_file(FIXTURE, tmp_path / "lake", store=store)
    state = fleet.pools["lab/a100"]

    [p] = store.pool_balances()
    assert (p.pool, p.flavor, p.chips_per_node, p.chips, p.capacity_milli, p.unavailable_milli, p.idle_milli,
            p.overcommitted_milli, p.running_jobs, p.pending_jobs) == (
        "lab/a100", "a100-40gb", 4, 4, 4000, 0, 4000, 0, 0, 0)
    assert (p.applied, p.duplicates, p.rejected, p.late_events, p.max_lateness_s) == (20, 1, 2, 1, 300)
    assert_utc(p.clock, utc(2026, 11, 2, 3, 30))

    teams = [(t.pool, t.team, t.nominal_milli, t.used_milli, t.in_quota_milli, t.borrowed_milli, t.burst_milli,
              t.running_jobs, t.pending_jobs, t.entitled_mchip_s, t.in_quota_mchip_s, t.borrowed_mchip_s,
              t.burst_mchip_s) for t in store.team_balances()]
    assert teams == [("lab/a100", "a", 2000, 0, 0, 0, 0, 0, 0, 25_200_000, 15_600_000, 6_000_000, 0),
                     ("lab/a100", "b", 1000, 0, 0, 0, 0, 0, 0, 9_000_000, 5_100_000, 0, 0)]
    # the same numbers as the folded state's books
    for t in store.team_balances():
        assert (t.entitled_mchip_s, t.in_quota_mchip_s, t.borrowed_mchip_s) == tuple(
            state.books.totals.get((acc, t.team), 0) for acc in (ENTITLED, IN_QUOTA, BORROWED))
    assert [t.team for t in store.team_balances(pool="lab/a100")] == ["a", "b"]
    assert store.team_balances(pool="nowhere/h100") == []

    ga, gb = store.grants()
    assert (ga.grant_id, ga.team, ga.chips_milli, ga.active, ga.effective_from, ga.effective_until) == (
        "g-a", "a", 2000, True, None, None)
    assert (gb.grant_id, gb.team, gb.chips_milli, gb.active, gb.effective_until) == ("g-b", "b", 1000, True, None)
    assert_utc(gb.effective_from, utc(2026, 11, 2, 1))
    assert (ga.borrowing_limit_milli, ga.lending_limit_milli) == (None, None)

    [run] = store.runs()
    assert run.run_id.startswith(summary.run_id + "-") and run.kind == "embedded"
    assert (run.source, run.lake) == (str(FIXTURE), str(tmp_path / "lake"))
    assert (run.lines, run.accepted, run.duplicates, run.dead_letters) == (27, 20, 1, 6)
    assert json.loads(run.summary_json) == summary.as_dict()
    for stamp in (run.started_at, run.finished_at):
        assert stamp.utcoffset() == timedelta(0)
    assert run.started_at <= run.finished_at <= datetime.now(UTC)

    assert store.position("embedded", "file:hand.jsonl", 0) == 27
    assert store.position("embedded", "file:hand.jsonl", 1) is None
    assert store.position("someone-else", "file:hand.jsonl", 0) is None


def test_grants_future_and_active_keep_their_instants(store):
    feed = Feed()
    two_team_pool(feed)
    store.save([feed.state("lab/h100")])

    g_later, g_now = store.grants()  # ordered by grant id
    assert (g_now.grant_id, g_now.team, g_now.chips_milli, g_now.active) == ("g-now", "a", 2000, True)
    assert g_now.effective_from is None
    assert_utc(g_now.effective_until, utc(2026, 11, 2, 22))  # sent as 2026-11-03T00:00:00+02:00
    assert (g_later.grant_id, g_later.team, g_later.chips_milli, g_later.active) == ("g-later", "b", 1500, False)
    assert (g_later.borrowing_limit_milli, g_later.lending_limit_milli) == (500, 0)  # 0 is a limit, not None
    assert_utc(g_later.effective_from, utc(2026, 11, 2, 17, 30))  # sent as 2026-11-02T12:30:00-05:00
    assert g_later.effective_until is None

    [p] = store.pool_balances()
    assert_utc(p.clock, utc(2026, 11, 2, 2))
    assert (p.capacity_milli, p.idle_milli, p.running_jobs, p.pending_jobs) == (2000, 1000, 1, 0)
    a, b = store.team_balances()
    assert (a.team, a.nominal_milli, a.used_milli, a.in_quota_milli, a.running_jobs) == ("a", 2000, 1000, 1000, 1)
    assert (a.entitled_mchip_s, a.in_quota_mchip_s) == (2000 * 7200, 1000 * (7200 - 600))
    # b holds only a future grant: a row with nothing in it yet
    assert (b.team, b.nominal_milli, b.used_milli, b.entitled_mchip_s, b.in_quota_mchip_s) == ("b", 0, 0, 0, 0)


def test_saving_again_replaces_balances_and_merges_run_and_tracking(store):
    feed = Feed()
    two_team_pool(feed)
    state = feed.state("lab/h100")
    store.save([state], run=run_row("r1", utc(2026, 11, 2, 2)), tracking=[("sink", "chips.events", 0, 100),
                                                                        ("sink", "chips.events", 1, 7)])
    # the same pool later: the job finished, g-now revoked
    feed("job.finished", "lab/h100", at(180), job_id="j1", outcome="succeeded")
    feed("quota.revoked", "lab/h100", at(210), grant_id="g-now")
    feed("pool.tick", "lab/h100", at(240))
    store.save([state], run=run_row("r1", utc(2026, 11, 2, 2), lines=25, accepted=24),
               tracking=[("sink", "chips.events", 0, 250)])

    [p] = store.pool_balances()
    assert_utc(p.clock, utc(2026, 11, 2, 4))
    assert (p.running_jobs, p.idle_milli, p.applied) == (0, 2000, state.applied)
    teams = [(t.team, t.nominal_milli, t.used_milli, t.entitled_mchip_s, t.in_quota_mchip_s)
             for t in store.team_balances()]
    assert teams == [("a", 0, 0, 2000 * 12600, 1000 * (10800 - 600)), ("b", 0, 0, 0, 0)]
    assert [g.grant_id for g in store.grants()] == ["g-later"]  # the revoked grant's row is gone
    [run] = store.runs()
    assert (run.run_id, run.lines, run.accepted) == ("r1", 25, 24)
    assert store.position("sink", "chips.events", 0) == 250
    assert store.position("sink", "chips.events", 1) == 7  # not in the second save: kept

    # saving an unchanged state again changes nothing and duplicates nothing
    before = balances(store)
    store.save([state], run=run_row("r1", utc(2026, 11, 2, 2), lines=25, accepted=24))
    assert balances(store) == before


def test_pools_not_in_a_save_keep_their_balances(store):
    feed = Feed()
    two_team_pool(feed, "lab/h100")
    feed.pool("lab/a100", chips=1)
    feed("quota.granted", "lab/a100", at(0), grant_id="g-z", team="z", chips=1)
    feed("pool.tick", "lab/a100", at(60))
    store.save(feed.fleet.pools.values())
    other_before = [b for b in (balances(store)["teams"] + balances(store)["grants"]) if b[0] == "lab/a100"]
    assert len(other_before) == 2

    feed("quota.revoked", "lab/h100", at(130), grant_id="g-later")
    feed("pool.tick", "lab/h100", at(180))
    store.save([feed.state("lab/h100")])

    assert [p.pool for p in store.pool_balances()] == ["lab/a100", "lab/h100"]
    a100 = next(p for p in store.pool_balances() if p.pool == "lab/a100")
    assert_utc(a100.clock, utc(2026, 11, 2, 1))
    after = balances(store)
    assert [b for b in after["teams"] + after["grants"] if b[0] == "lab/a100"] == other_before
    assert [g.grant_id for g in store.grants() if g.pool == "lab/h100"] == ["g-now"]


def test_a_failing_save_writes_nothing(store):
    feed = Feed()
    two_team_pool(feed)
    store.save([feed.state("lab/h100")], run=run_row("r1", utc(2026, 11, 2, 2)),
               tracking=[("sink", "chips.events", 0, 100)])
    before = balances(store)

    feed("job.finished", "lab/h100", at(180), job_id="j1", outcome="succeeded")
    feed("quota.revoked", "lab/h100", at(210), grant_id="g-now")
    feed("pool.tick", "lab/h100", at(240))
    feed.pool("lab/new")
    bad_run = run_row("r2", utc(2026, 11, 2, 4))
    del bad_run["kind"]  # NOT NULL: the database refuses the run row at the end of the transaction
    with pytest.raises(IntegrityError):
        store.save([feed.state("lab/h100"), feed.state("lab/new")], run=bad_run,
                   tracking=[("sink", "chips.events", 0, 250)])

    # the deletes and inserts before the failing row were rolled back with it
    assert balances(store) == before
    assert store.position("sink", "chips.events", 0) == 100

    # an instant without a zone is refused the same way (it would mean different things on each backend)
    naive = run_row("r3", datetime(2026, 11, 2, 4))
    with pytest.raises(StatementError, match="naive datetime"):
        store.save([feed.state("lab/h100")], run=naive, tracking=[("sink", "chips.events", 0, 250)])
    assert balances(store) == before
    assert store.position("sink", "chips.events", 0) == 100

    # and the store is still usable
    store.save([feed.state("lab/h100"), feed.state("lab/new")], run=run_row("r2", utc(2026, 11, 2, 4)),
               tracking=[("sink", "chips.events", 0, 250)])
    assert [p.pool for p in store.pool_balances()] == ["lab/h100", "lab/new"]
    assert [g.grant_id for g in store.grants()] == ["g-later"]
    assert store.position("sink", "chips.events", 0) == 250


def test_run_instants_in_any_zone_are_stored_as_utc_and_ordered_by_instant(store):
    # r-tokyo starts first although its wall-clock time is later: the store orders instants, not wall times
    tokyo = timezone(timedelta(hours=9))
    store.save([], run=run_row("r-tokyo", datetime(2026, 11, 2, 10, 0, tzinfo=tokyo)))
    store.save([], run=run_row("r-utc", utc(2026, 11, 2, 3, 0)))
    store.save([], run=run_row("r-kolkata", datetime(2026, 11, 2, 0, 0, 1, 250_000,
                                                      tzinfo=timezone(timedelta(hours=5, minutes=30)))))
    runs = store.runs()
    assert [r.run_id for r in runs] == ["r-kolkata", "r-tokyo", "r-utc"]
    assert_utc(runs[0].started_at, utc(2026, 11, 1, 18, 30, 1, 250_000))  # microseconds survive
    assert_utc(runs[1].started_at, utc(2026, 11, 2, 1))
    assert_utc(runs[1].finished_at, utc(2026, 11, 2, 1, 0, 5))
    assert_utc(runs[2].started_at, utc(2026, 11, 2, 3))


def test_large_integers_survive(store):
    feed = Feed()
    feed.pool("big/h100", chips=1)
    feed("quota.granted", "big/h100", at(0), grant_id="g-huge", team="t", chips=1_000_000,
         borrowing_limit=999_999.999)
    feed("pool.tick", "big/h100", at(30 * 24 * 60))  # 30 days of entitlement at a billion milli-chips (the most)
    state = feed.state("big/h100")
    big = 2**62 + 12345
    store.save([state], run=run_row("r-big", utc(2026, 12, 2), lines=2**40 + 1, accepted=2**33, duplicates=2**31,
                                    dead_letters=2**31 + 1),
               tracking=[("sink", "chips.events", 2**31 - 1, big)])

    [t] = store.team_balances()
    assert t.nominal_milli == 1_000_000_000
    assert t.entitled_mchip_s == 1_000_000_000 * 30 * 86400 == state.books.totals[(ENTITLED, "t")]
    assert t.entitled_mchip_s > 2**51
    [g] = store.grants()
    assert (g.chips_milli, g.borrowing_limit_milli) == (1_000_000_000, 999_999_999)
    [r] = store.runs()
    assert (r.lines, r.accepted, r.duplicates, r.dead_letters) == (2**40 + 1, 2**33, 2**31, 2**31 + 1)
    assert store.position("sink", "chips.events", 2**31 - 1) == big


def test_unicode_and_slashes_in_names(store):
    pool = "eu-west/h100 — Zürich/ラボ"
    team = "ml/研究 🚀 \"quoted\" 'single' %_"
    long_team = "é" * 256  # the schemas' limit, in characters (not bytes)
    feed = Feed()
    feed.pool(pool)
    feed("quota.granted", pool, at(0), grant_id="g/ü/1", team=team, chips=1)
    feed("quota.granted", pool, at(0), grant_id="g/" + "ß" * 254, team=long_team, chips=0.001)
    feed("pool.tick", pool, at(60))
    store.save([feed.state(pool)], tracking=[("sink/ü", "topic/ラボ", 0, 3)])

    assert [p.pool for p in store.pool_balances()] == [pool]
    teams = {t.team: t for t in store.team_balances(pool=pool)}
    assert set(teams) == {team, long_team}
    assert (teams[team].nominal_milli, teams[team].entitled_mchip_s) == (1000, 3_600_000)
    assert (teams[long_team].nominal_milli, teams[long_team].entitled_mchip_s) == (1, 3600)
    assert {(g.pool, g.grant_id, g.team) for g in store.grants()} == {
        (pool, "g/ü/1", team), (pool, "g/" + "ß" * 254, long_team)}
    assert store.team_balances(pool="eu-west/h100") == []  # no prefix matching on the slash
    assert store.position("sink/ü", "topic/ラボ", 0) == 3


# --- decisions index and statement runs ---------------------------------------------------------------------

BURST_EVENTS = [
    {"event_id": "c", "type": "pool.configured", "occurred_at": at(0), "pool": "p/burst", "source": "t",
     "flavor": "x", "chips_per_node": 2},
    {"event_id": "r0", "type": "chip.registered", "occurred_at": at(0), "pool": "p/burst", "source": "t",
     "chip_id": "c0", "node": "n0"},
    {"event_id": "r1", "type": "chip.registered", "occurred_at": at(0), "pool": "p/burst", "source": "t",
     "chip_id": "c1", "node": "n0"},
    {"event_id": "g", "type": "quota.granted", "occurred_at": at(0), "pool": "p/burst", "source": "t",
     "grant_id": "g", "team": "a", "chips": 1},
    {"event_id": "b1", "type": "burst.requested", "occurred_at": at(10), "pool": "p/burst", "source": "t",
     "request_id": "q1", "team": "a", "chips": 1, "window_start": at(60), "window_end": at(120)},
    {"event_id": "b2", "type": "burst.requested", "occurred_at": at(20), "pool": "p/burst", "source": "t",
     "request_id": "q2", "team": "a", "chips": 5, "window_start": at(60), "window_end": at(120)},
    {"event_id": "t", "type": "pool.tick", "occurred_at": at(180), "pool": "p/burst", "source": "t"},
]


def test_an_embedded_run_indexes_its_decisions(store, tmp_path):
    events = tmp_path / "burst.jsonl"
    events.write_text("".join(json.dumps(e) + "\n" for e in BURST_EVENTS))
    run_file(events, tmp_path / "lake", store=store)
    d1, d2 = store.decisions()
    assert (d1.decision_id, d1.type, d1.pool, d1.rule, d1.team, d1.job_id, d1.victims) == (
        "b1:burst:q1", "decision.burst", "p/burst", "burst_forecast", "a", None, 0)
    assert d1.verdict == "approved" and d2.decision_id == "b2:burst:q2"
    assert_utc(d1.at, utc(2026, 11, 2, 0, 10))
    assert_utc(d2.at, utc(2026, 11, 2, 0, 20))
    assert json.loads(d1.body)["chips_granted"] == 1.0 and d1.message.startswith("burst q1 of team a")
    assert [d.decision_id for d in store.decisions(since=utc(2026, 11, 2, 0, 15))] == ["b2:burst:q2"]
    assert [d.decision_id for d in store.decisions(until=utc(2026, 11, 2, 0, 15))] == ["b1:burst:q1"]
    assert store.decisions(pool="lab/a100") == []

    # a second run of another file replaces the index: its decisions are the current ones
    run_file(FIXTURE, tmp_path / "lake", store=store, overwrite=True)
    assert store.decisions() == []


def test_decisions_merge_by_id_and_roll_back_with_the_save(store):
    body = {"decision_id": "e9:reclaim:j1", "type": "decision.preempt", "pool": "lab/h100",
            "at": "2026-11-02T01:00:00Z", "rule": "reclaim", "beneficiary": {"job_id": "j1", "team": "b"},
            "victims": [{"job_id": "v1", "team": "a", "chips": 1.0, "lost_work_chip_s": 60, "preemption_count": 0},
                        {"job_id": "v2", "team": "a", "chips": 1.0, "lost_work_chip_s": 0, "preemption_count": 1}],
            "numbers": {}, "message": "reclaim for j1"}
    row = ("e9:reclaim:j1", "decision.preempt", "lab/h100", 1793581200, "reclaim", "reclaim for j1", json.dumps(body))
    store.save([], decisions=[row])
    store.save([], decisions=[row])  # the same decision again: still one row
    [d] = store.decisions()
    assert (d.team, d.job_id, d.victims, d.verdict) == ("b", "j1", 2, None)
    assert_utc(d.at, utc(2026, 11, 2, 1))
    # a save that fails indexes nothing
    with pytest.raises(IntegrityError):
        store.save([], decisions=[row[:0] + ("other",) + row[1:]], run={"run_id": "bad"})
    assert [x.decision_id for x in store.decisions()] == ["e9:reclaim:j1"]


def test_statement_runs_keep_their_positions_and_digest(store):
    store.record_statement(statement_id="a/2026-11", team="a", period_start=utc(2026, 11, 1),
                           period_end=utc(2026, 12, 1), positions={"chipledger.jobs/0": 1200, "chipledger.quota/0": 7},
                           output_digest="sha256:abc", formats=["md", "json"], issued_at=utc(2026, 12, 1, 6))
    store.record_statement(statement_id="b/2026-11", team="b", period_start=utc(2026, 11, 1),
                           period_end=utc(2026, 12, 1), positions={}, output_digest="sha256:def", formats=["csv"],
                           issued_at=utc(2026, 12, 1, 5))
    assert [s.statement_id for s in store.statement_runs()] == ["b/2026-11", "a/2026-11"]  # by issue time
    [a] = store.statement_runs(team="a")
    assert json.loads(a.positions_json) == {"chipledger.jobs/0": 1200, "chipledger.quota/0": 7}
    assert (a.output_digest, a.formats) == ("sha256:abc", "md,json")
    assert_utc(a.period_start, utc(2026, 11, 1))
    assert_utc(a.period_end, utc(2026, 12, 1))
    # issued again (reproduced): the same row, updated
    store.record_statement(statement_id="a/2026-11", team="a", period_start=utc(2026, 11, 1),
                           period_end=utc(2026, 12, 1), positions={"chipledger.jobs/0": 1200},
                           output_digest="sha256:abc", formats=["md"], issued_at=utc(2026, 12, 2))
    assert [(s.statement_id, s.formats) for s in store.statement_runs(team="a")] == [("a/2026-11", "md")]
    with pytest.raises(ValueError, match="is not after"):
        store.record_statement(statement_id="x", team="a", period_start=utc(2026, 12, 1),
                               period_end=utc(2026, 12, 1), positions={}, output_digest="", formats=[],
                               issued_at=utc(2026, 12, 2))
    assert len(store.statement_runs()) == 2


def test_portal_sessions_keep_the_newest_per_token_and_end(store):
    """The portal's sessions (chipledger/web/auth.py Sessions): a token keeps its newest `keep_per_token`, a start
    ends the sessions whose time is over (anyone's), signing out deletes one; instants come back in UTC."""
    from store.models import PortalSession

    def start(sid, token, at_h, hours=12):
        return store.start_session(PortalSession(session_sha256=sid, token_id=token, started_at=utc(2026, 12, 1, at_h),
                                                 expires_at=utc(2026, 12, 1, at_h) + timedelta(hours=hours)), 2)

    assert start("a1", "t", 1) == [] and start("old", "u", 1, hours=1) == []
    assert start("a2", "t", 2) == ["old"]  # (u's session ended at 02:00)
    assert start("a3", "t", 3) == ["a1"]   # t's oldest beyond two
    assert [store.session(x) is not None for x in ("a1", "a2", "a3", "old")] == [False, True, True, False]
    row = store.session("a3")
    assert row.token_id == "t"
    assert_utc(row.started_at, utc(2026, 12, 1, 3))
    assert_utc(row.expires_at, utc(2026, 12, 1, 15))
    assert store.end_session("a3") and not store.end_session("a3") and store.session("a3") is None


def test_a_store_from_an_earlier_version_gains_the_new_columns(store, tmp_path):
    # team_balances as chipledger wrote it before the fair-share columns (decayed usage, F, borrowed share)
    from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table, inspect, insert

    old = MetaData()
    Table("team_balances", old, Column("pool", String(256), primary_key=True),
          Column("team", String(256), primary_key=True),
          *[Column(c, BigInteger) for c in ("nominal_milli", "used_milli", "in_quota_milli", "borrowed_milli",
                                            "burst_milli")],
          Column("running_jobs", Integer), Column("pending_jobs", Integer),
          *[Column(c, BigInteger) for c in ("entitled_mchip_s", "in_quota_mchip_s", "borrowed_mchip_s",
                                            "burst_mchip_s")])
    Base.metadata.tables["team_balances"].drop(store.engine)
    old.create_all(store.engine)
    with store.engine.begin() as conn:
        conn.execute(insert(old.tables["team_balances"]).values(
            pool="lab/a100", team="a", nominal_milli=1, used_milli=0, in_quota_milli=0, borrowed_milli=0,
            burst_milli=0, running_jobs=0, pending_jobs=0, entitled_mchip_s=0, in_quota_mchip_s=0,
            borrowed_mchip_s=0, burst_mchip_s=0))
    assert "fair_share_factor" not in {c["name"] for c in inspect(store.engine).get_columns("team_balances")}

    reopened = open_store(store.engine.url.render_as_string(hide_password=False))
    try:
        cols = {c["name"] for c in inspect(reopened.engine).get_columns("team_balances")}
        assert {"decayed_usage_mchip_s", "fair_share_factor", "borrowed_share"} <= cols
        # the old row reads with the model defaults; opening again adds nothing
        [t] = reopened.team_balances()
        assert (t.team, t.nominal_milli, t.decayed_usage_mchip_s, t.fair_share_factor, t.borrowed_share) == (
            "a", 1, 0, 1.0, 0.0)
        from store.repo import upgrade_tables
        assert upgrade_tables(reopened.engine) == []
        # and a run saves its balances, fair-share columns included
        run_file(FIXTURE, tmp_path / "lake", store=reopened)
        teams = {t.team: t for t in reopened.team_balances()}
        assert sorted(teams) == ["a", "b"]
        assert all(0 < t.fair_share_factor <= 1 and t.decayed_usage_mchip_s > 0 for t in teams.values())
    finally:
        reopened.engine.dispose()


def test_hostile_records_never_reach_the_store(store, tmp_path):
    """The hostile fleet (tests/hostile_records.py) through the embedded run saves on both backends: a NUL in a
    team id (which PostgreSQL text refuses) is a dead letter at the contract, and the largest amounts fit."""
    import hostile_records as H

    H.write_fleet(tmp_path / "hostile.jsonl")
    summary, _ = run_file(tmp_path / "hostile.jsonl", tmp_path / "lake", store=store)
    assert summary.dead_letters["schema_invalid"] >= 6
    teams = {(t.pool, t.team) for t in store.team_balances()}
    assert teams == {(H.POOL_A, "team-a"), (H.POOL_A, "team-b"), (H.POOL_B, "team-c")}
    assert {p.pool for p in store.pool_balances()} == {H.POOL_A, H.POOL_B}


def test_portal_keys_are_made_once_and_read_after(store):
    """The portal's secret keys (CSRF tokens, aliases): the first portal's made key is kept; a later one (or a
    replica) reads it whatever it would make; keys of different names are apart."""
    made = [b"\x01" * 32, b"\x02" * 32, b"\x03" * 32]
    first = store.portal_key("csrf", lambda: made[0])
    assert first == made[0]
    assert store.portal_key("csrf", lambda: made[1]) == made[0]
    assert store.portal_key("aliases", lambda: made[2]) == made[2] != first
