"""The held state (ledger/jobs.py): a job back in the queue but not eligible yet (`job.preempted` with `held`,
until `job.released`) is neither running nor pending: no pending demand, no wait, no candidate for decisions.
Hand-computed books and facts, exact to the milli-chip-second (times are offsets from T0, the start of an hour).
"""

from __future__ import annotations

import json

from ledger import PoolState, check_invariants, close_books
from ledger.books import PENDING
from ledger.fold import close_facts, policy_rows

from tests.test_evolve import H, H0, POOL, T0, chip, configured, finish, fold, grant, hour_rows, preempt, run, \
    start, submit, tick, ev
from tests.test_policy import Run, grant as pgrant, pool as ppool, run as prun, submit as psubmit, tick as ptick, \
    ev as pev


def release(jid, at=0, **kw):
    return ev("job.released", at, job_id=jid, **kw)


def _waits(steps, state=None):
    rows = [w for s in steps for w in s.waits]
    if state is not None:
        rows += close_facts(state)["waits"]
    return [(w.job_id, w.run_index, w.kind, w.began_at - T0, None if w.ended_at is None else w.ended_at - T0, w.end)
            for w in rows]


BASE = [configured(0), chip("c1"), chip("c2"), grant("g", "ads", 2)]


def test_the_hold_off_is_not_pending_demand_and_the_wait_begins_at_the_release():
    state, steps, books, runs = run(BASE + [
        submit("j", "ads", 2), start("j", 100), preempt("j", 1000, held=True), release("j", 1300), start("j", 1500),
        finish("j", "succeeded", 2000), tick(H)])
    # pending: 2000 × 100 before the first start + 2000 × 200 from the release to the restart; the 300 s held
    # between the preemption and the release are not demand (without `held` they would be: 2000 × 600)
    assert hour_rows(books, H0)[(PENDING, "ads")] == 2000 * 300
    assert _waits(steps) == [("j", 0, "first_start", 0, 100, "started"), ("j", 1, "restart", 1300, 1500, "started")]
    assert [(r.run_index, r.started_at - T0, r.ended_at - T0, r.end_reason) for r in runs] == [
        (1, 100, 1000, "preempted"), (2, 1500, 2000, "succeeded")]


def test_a_held_job_cancelled_before_its_release_leaves_no_pending_demand_and_no_wait():
    state, steps, books, runs = run(BASE + [
        submit("j", "ads", 2), start("j", 100), preempt("j", 1000, held=True), finish("j", "cancelled", 1500),
        tick(H)])
    assert hour_rows(books, H0)[(PENDING, "ads")] == 2000 * 100  # the first wait only
    assert _waits(steps) == [("j", 0, "first_start", 0, 100, "started")]
    assert "j" not in state.jobs and [r.end_reason for r in runs] == ["preempted"]
    assert steps[-2].waits == [] and steps[-2].job_runs == []  # the cancel posts nothing


def test_a_held_job_started_without_a_release_waited_zero_seconds():
    state, steps, books, runs = run(BASE + [
        submit("j", "ads", 2), start("j", 100), preempt("j", 1000, held=True), start("j", 1400),
        finish("j", "succeeded", 2000), tick(H)])
    assert hour_rows(books, H0)[(PENDING, "ads")] == 2000 * 100
    assert _waits(steps) == [("j", 0, "first_start", 0, 100, "started"), ("j", 1, "restart", 1400, 1400, "started")]



def test_a_wait_from_held_is_counted_for_the_wait_slos_like_its_row():
    """The 0-second wait of a held job started without a release is posted and counted (PoolState.wait_counts:
    in quota, honoured, started, within sched_slo_s); a held job cancelled is neither."""
    state, steps, books, runs = run(BASE + [
        submit("j", "ads", 2), start("j", 100), preempt("j", 1000, held=True), start("j", 1400),
        preempt("j", 1500, held=True), finish("j", "cancelled", 1600), tick(H)])
    assert len(_waits(steps)) == 2
    assert state.wait_counts["ads"] == [2, 2, 2, 2]

def test_a_held_job_is_in_no_queue_count_or_fact_and_round_trips():
    fleet, steps = fold(BASE + [submit("j", "ads", 2), start("j", 100), preempt("j", 1000, held=True),
                                submit("k", "ads", 1, 1100)])
    s = fleet.pools[POOL]
    team = s.teams["ads"]
    assert s.jobs["j"].status == "held" and s.jobs["j"].preemptions == 1
    assert (team.pending, team.pending_milli, team.running) == (1, 1000, 0)  # k alone waits
    assert set(s.waiting["ads"]) == {"k"} and s.pending_sizes == {1000: 1}
    assert s.active_milli == 3000  # a held job is still the pool's (bounds: docs/events.md, Limits)
    balances, pending = policy_rows(s)
    assert [p.job_id for p in pending] == ["k"]
    assert [(w[0], w[5]) for w in _waits([], s)] == [("k", "open")]  # the open waits: k's, not the held job's
    again = PoolState.from_dict(json.loads(json.dumps(s.to_dict())))
    check_invariants(again)
    assert again.jobs["j"].status == "held" and "j" not in again.waiting.get("ads", {})
    assert "j" not in again.running_jobs.get("ads", {})
    step = fleet.apply(release("j", 1200))
    assert step.applied and (team.pending, team.pending_milli) == (2, 3000)
    journal, _ = close_books(s, T0 + H)
    # pending: k 1000 × (3600 − 1100), j 2000 × 100 then 2000 × (3600 − 1200)
    assert sum(r.amount_mchip_s for r in journal if r.account == PENDING) == 1000 * 2500 + 2000 * 100 + 2000 * 2400


def test_a_held_job_is_no_candidate_for_a_reclaim_until_released():
    """8 chips; ads 4, search 2, vision 2. ads's a1 is preempted and held at 1000; vision takes the 2 chips it
    freed (borrowing 2, as search does). While a1 is held no reclaim is decided for it; released at 2000, it fits
    ads's unused quota, nothing is free, and after the grace (60 s) the reclaim comes."""
    r = Run(ppool() + [pgrant("ads", 4), pgrant("search", 2), pgrant("vision", 2)]
            + prun("a1", "ads", 2) + prun("s1", "search", 2) + prun("s2", "search", 2) + prun("v1", "vision", 2))
    assert r.apply([pev("job.preempted", 1000, job_id="a1", held=True)] + prun("v2", "vision", 2, 1001)) == []
    assert r.apply([ptick(1100), ptick(1500), ptick(1999)]) == []
    assert r.state.short_since == {} and r.state.wakes == {}
    assert r.apply(pev("job.released", 2000, job_id="a1")) == []  # short since 2000: grace until 2060
    [d] = r.apply(ptick(2060, eid="tick-2060"))
    assert (d.rule, d.beneficiary.job_id) == ("reclaim", "a1")


def test_cli_run_books_a_held_job_and_why_says_it_is_held(tmp_path):
    """As a user meets it: `chipledger run` on a JSONL with a requeue held for 300 s, `chipledger sql` over the
    lake's `waits` and journal, and `chipledger why` on the job while held and after its release."""
    from typer.testing import CliRunner

    from chipledger.cli import app

    def write(events, name):
        path = tmp_path / name
        path.write_text("".join(e.model_dump_json(exclude_none=True) + "\n" for e in events))
        return path

    held = BASE + [submit("j", "ads", 2), start("j", 100), preempt("j", 1000, held=True, eid="held-j")]
    later = [release("j", 1300), start("j", 1500, eid="restart-j"), finish("j", "succeeded", 2000), tick(H)]
    runner = CliRunner()
    lake = tmp_path / "lake-held"
    res = runner.invoke(app, ["run", "--events", str(write(held + [tick(1200)], "held.jsonl")), "--lake", str(lake),
                              "--check-invariants"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["why", "j", "--lake", str(lake)])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[0] == f"job j (team ads, pool {POOL}): held"
    assert "held: back in the queue but not eligible yet" in res.output
    lake = tmp_path / "lake-all"
    res = runner.invoke(app, ["run", "--events", str(write(held + later, "all.jsonl")), "--lake", str(lake),
                              "--check-invariants"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["sql", "--lake", str(lake), "--format", "json",
                              "SELECT run_index, epoch(began_at)::BIGINT - %d AS began, epoch(ended_at)::BIGINT - %d "
                              "AS ended FROM waits WHERE job_id = 'j' ORDER BY run_index" % (T0, T0)])
    assert res.exit_code == 0, res.output
    assert [(r["run_index"], r["began"], r["ended"]) for r in json.loads(res.stdout)] == [(0, 0, 100), (1, 1300, 1500)]
    res = runner.invoke(app, ["sql", "--lake", str(lake), "--format", "json",
                              "SELECT sum(amount_mchip_s)::BIGINT AS p FROM journal WHERE account = 'pending'"])
    assert json.loads(res.stdout) == [{"p": 2000 * 300}]
    res = runner.invoke(app, ["why", "j", "--lake", str(lake)])
    assert res.output.splitlines()[0].startswith(f"job j (team ads, pool {POOL}): finished, ")


def test_held_jobs_are_a_gauge_per_team_at_a_scrape():
    """`chipledger_team_held_jobs`: the jobs held now, per team (a team without any shows 0); a release takes the
    job out again."""
    from prometheus_client.parser import text_string_to_metric_families

    from ledger import FoldConfig
    from streams.metrics import MetricsCollector, exposition, registry_of
    from tests.test_evolve import fold as fold_events

    def held(events):
        fleet, _ = fold_events(events)
        text = exposition(registry_of(MetricsCollector(fleet.pools, FoldConfig()), process=False)).decode()
        return {s.labels["team"]: s.value for fam in text_string_to_metric_families(text)
                if fam.name == "chipledger_team_held_jobs" for s in fam.samples}

    base = BASE + [grant("g2", "nlp", 1), submit("j", "ads", 1), submit("k", "ads", 1), start("j", 100),
                   start("k", 100), preempt("j", 1000, held=True)]
    assert held(base) == {"ads": 1, "nlp": 0}
    assert held(base + [preempt("k", 1100, held=True)]) == {"ads": 2, "nlp": 0}
    assert held(base + [release("j", 1300)]) == {"ads": 0, "nlp": 0}
