"""The policy layer as a user meets it: `chipledger run --config` with a [policy] section, the lake views
`decisions`, `decision_victims`, `balances`, `balances_org`, `pending`, and `chipledger why JOB_ID`.

The events are the reclaim scenario of test_policy.py (8 chips; ads 4, search 2, vision 2; search and vision
each borrow 2; ads submits a1 (2 chips) at 2000 s), then a tick at 2060 s and one at 4000 s (closing hour 0).
"""

from __future__ import annotations

import json
import sqlite3

from typer.testing import CliRunner

from analytics.views import connect
from chipledger.cli import app
from test_policy import T0, _reclaim_base, submit, tick

runner = CliRunner()


def _write(tmp_path, policy: str):
    events = _reclaim_base() + [submit("a1", "org/ads", 2, 2000), tick(2060, eid="tick-2060"), tick(4000, eid="tick-4000")]
    # the ads team is a path here (org/ads), so org totals have something to sum
    lines = []
    for e in events:
        d = json.loads(e.model_dump_json(exclude_none=True))
        if d.get("team") == "ads":
            d["team"] = "org/ads"
        if d.get("grant_id") == "g-ads":
            d["grant_id"] = "g-org-ads"
        lines.append(json.dumps(d))
    src = tmp_path / "events.jsonl"
    src.write_text("\n".join(lines) + "\n")
    cfg = tmp_path / "chipledger.toml"
    cfg.write_text(f"[policy]\n{policy}\n")
    return src, cfg


def _run(tmp_path, src, cfg, name):
    lake = tmp_path / f"lake-{name}"
    store = f"sqlite:///{tmp_path / f'{name}.db'}"
    res = runner.invoke(app, ["run", "--events", str(src), "--lake", str(lake), "--store", store,
                              "--config", str(cfg), "--check-invariants"])
    assert res.exit_code == 0, res.output
    return lake, tmp_path / f"{name}.db"


def test_run_writes_decisions_balances_and_reasons_and_why_explains(tmp_path):
    src, cfg = _write(tmp_path, "preemption_grace_s = 60\nmin_runtime_s = 300\ndecision_timeout_s = 600")
    lake, db = _run(tmp_path, src, cfg, "a")
    con = connect(lake)
    assert con.execute("SELECT decision_id, type, rule, team, beneficiary_job_id, victims, need_chips, "
                       "freed_chips, lost_work_chip_s FROM decisions ORDER BY \"at\"").fetchall() == [
        ("tick-2060:reclaim:a1", "decision.preempt", "reclaim", "org/ads", "a1", 1, 2.0, 2.0, 1120),
        # nobody acted on it: it timed out at 2660 and was made anew at the next event (4000); by then
        # F_search = 2^(-(16000/28000)/0.25) = 0.205 and F_vision = 2^(-(12000/28000)/0.25) = 0.305 differ by less
        # than fair_share_tolerance 0.1: one victim class, and vision's v1 (checkpointed at 1990: 2 × 2010 =
        # 4020 chip-s) loses less than search's s1 (2 × 2500 = 5000)
        ("tick-4000:reclaim:a1", "decision.preempt", "reclaim", "org/ads", "a1", 1, 2.0, 2.0, 4020)]
    # the victims' lost work is the estimate at decision time; checkpoint_by = the decision's instant + 60 s
    assert con.execute("SELECT decision_id, epoch(checkpoint_by - \"at\")::INT FROM decision_victims").fetchall() == [
        ("tick-2060:reclaim:a1", 60), ("tick-4000:reclaim:a1", 60)]
    assert con.execute("SELECT decision_id, job_id, team, chips, lost_work_chip_s, preemption_count, preempted_at "
                       "FROM decision_victims ORDER BY \"at\"").fetchall() == [
        ("tick-2060:reclaim:a1", "s1", "search", 2.0, 1120, 0, None),
        ("tick-4000:reclaim:a1", "v1", "vision", 2.0, 4020, 0, None)]
    # hour 0 closed at 3600: balances then and at the end of the run (4000)
    rows = con.execute('SELECT team, epoch("at")::BIGINT - ?, nominal_chips, used_chips, borrowed_chips, '
                       'decayed_usage_mchip_s, round(fair_share_factor, 6), round(borrowed_share, 6) '
                       'FROM balances ORDER BY "at", team', [T0]).fetchall()
    # hour 0: search used 4 chips × 3600 s, vision 4 × 2600, ads 0; lendable 8 (all quota lends)
    u_s, u_v = 14_400_000, 10_400_000
    f = lambda u: round(2 ** (-(u / (u_s + u_v)) / 0.25), 6)  # noqa: E731
    assert rows[:3] == [("org/ads", 3600, 4.0, 0.0, 0.0, 0, 1.0, 0.0),
                        ("search", 3600, 2.0, 4.0, 2.0, u_s, f(u_s), 0.25),
                        ("vision", 3600, 2.0, 4.0, 2.0, u_v, f(u_v), 0.25)]
    assert [r[:2] for r in rows[3:]] == [("org/ads", 4000), ("search", 4000), ("vision", 4000)]
    assert con.execute('SELECT org, nominal_chips, teams FROM balances_org WHERE pool IS NULL AND '
                       'epoch("at") = ? ORDER BY org', [T0 + 3600]).fetchall() == [
        ("org", 4.0, 1), ("search", 2.0, 1), ("vision", 2.0, 1)]
    [(job, reason, waited)] = con.execute("SELECT job_id, reason, waited_s FROM pending").fetchall()
    assert (job, reason, waited) == ("a1", "preemption_in_flight", 2000)
    # why
    res = runner.invoke(app, ["why", "a1", "--lake", str(lake), "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "job a1 (team org/ads, pool us-east1-a/h100): pending" in out
    assert "why, as of 2026-11-02T09:06:40Z: preemption_in_flight: decision tick-4000:reclaim:a1" in out
    assert "tick-2060:reclaim:a1 (beneficiary)" in out and "tick-4000:reclaim:a1 (beneficiary)" in out
    res = runner.invoke(app, ["why", "s1", "--lake", str(lake), "--json"])
    ex = json.loads(res.output)
    assert ex["status"] == "running" and [d[1:3] for d in ex["decisions"]][0] == ["tick-2060:reclaim:a1", "victim"]
    res = runner.invoke(app, ["why", "nobody", "--lake", str(lake)])
    assert res.exit_code == 1 and "not in the lake" in res.output
    # the store has the fair share of each team
    with sqlite3.connect(db) as c:
        got = c.execute("SELECT team, decayed_usage_mchip_s, round(fair_share_factor, 6), borrowed_share "
                        "FROM team_balances ORDER BY team").fetchall()
    assert got[1][:3] == ("search", u_s, f(u_s))


def test_a_long_grace_in_the_config_means_no_decision_and_why_says_so(tmp_path):
    src, cfg = _write(tmp_path, "preemption_grace_s = 100000")
    lake, _ = _run(tmp_path, src, cfg, "b")
    con = connect(lake)
    assert con.execute("SELECT count(*) FROM decisions").fetchone()[0] == 0
    res = runner.invoke(app, ["why", "a1", "--lake", str(lake)])
    assert "waiting_grace: fits its team's unused quota but only 0 of 2 chips are free; waiting out the " \
           "preemption grace until 2026-11-03 12:20:00 UTC" in res.output


def test_a_bad_policy_value_is_an_error_that_names_it(tmp_path):
    src, cfg = _write(tmp_path, 'victim_order = "random"')
    res = runner.invoke(app, ["run", "--events", str(src), "--lake", str(tmp_path / "l"), "--config", str(cfg)])
    assert res.exit_code == 2 and "victim_order must be goodput or naive" in res.output


def test_policy_views_exist_on_an_empty_lake(tmp_path):
    con = connect(tmp_path)
    for name in ("decisions", "decision_victims", "balances", "balances_org", "pending", "pending_history"):
        assert con.execute(f'SELECT count(*) FROM "{name}"').fetchone()[0] == 0, name


def test_policy_settings_from_the_environment_override_the_file(tmp_path):
    from chipledger.config import Config, fold_config, load_config

    cfg = tmp_path / "c.toml"
    cfg.write_text("[policy]\npreemption_grace_s = 30\nmin_runtime_s = 60\n")
    fold = fold_config(load_config(cfg, env={"CHIPLEDGER_POLICY_MIN_RUNTIME_S": "90",
                                             "CHIPLEDGER_POLICY_VICTIM_ORDER": "naive"}), check_invariants=True)
    assert (fold.preemption_grace_s, fold.min_runtime_s, fold.victim_order, fold.check_invariants) == (
        30, 90, "naive", True)
    assert fold_config(Config()).decay_half_life_s == 7 * 86400


def test_why_shows_a_finished_jobs_whole_history_and_pending_shows_the_queue(tmp_path):
    """a1 waits (reasons recorded at 3600 and 4000: preemption_in_flight), then the cluster preempts s1 for the
    decision at 4100, a1 starts and finishes at 5000. `why a1` lists every reason it had, its last one too;
    while it waits (a lake folded up to 4000), `why` gives its place in the queue, the time waited and what
    would unblock it, and `chipledger pending` lists the queue."""
    from test_policy import preempted, start

    src, cfg = _write(tmp_path, "preemption_grace_s = 60\nmin_runtime_s = 300\ndecision_timeout_s = 600")
    waiting_lake, _ = _run(tmp_path, src, cfg, "w")
    more = [preempted("s1", 4100, decision_id="tick-4000:reclaim:a1"), start("a1", 4100),
            ev_finished("a1", 5000), tick(8000, eid="tick-8000")]
    with src.open("a") as f:
        for e in more:
            f.write(e.model_dump_json(exclude_none=True) + "\n")
    lake, _ = _run(tmp_path, src, cfg, "f")
    res = runner.invoke(app, ["why", "a1", "--lake", str(lake)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0] == "job a1 (team org/ads, pool us-east1-a/h100): finished, succeeded"
    history = lines[lines.index("  reasons recorded while it waited (each change):") + 1:
                    lines.index("  decisions naming it:")]
    assert len(history) == 1 and history[-1].startswith("    2026-11-02T09:00:00Z  preemption_in_flight: decision tick-2060:reclaim:a1")
    ex = json.loads(runner.invoke(app, ["why", "a1", "--lake", str(lake), "--json"]).output)
    assert [h[1] for h in ex["history"]] == ["preemption_in_flight"] and ex["position"] is None

    res = runner.invoke(app, ["why", "a1", "--lake", str(waiting_lake)])
    assert "  queue: 1 of 1 pending in the pool, 1 in its team's queue; waiting since 2026-11-02T08:33:20Z " \
           "(33m 20s)" in res.output
    assert "  would start when: the cluster preempting the decision's victims" in res.output
    res = runner.invoke(app, ["pending", "--lake", str(waiting_lake), "--json"])
    [row] = json.loads(res.output)
    assert (row["pool"], row["position"], row["team_position"], row["team"], row["job_id"], row["priority"],
            row["chips"], row["waited_s"], row["reason"]) == (
        "us-east1-a/h100", 1, 1, "org/ads", "a1", 0, 2.0, 2000, "preemption_in_flight")
    res = runner.invoke(app, ["pending", "--lake", str(waiting_lake), "--team", "search"])
    assert res.exit_code == 0 and "no job pending for team search" in res.output
    res = runner.invoke(app, ["pending", "--lake", str(waiting_lake), "--pool", "nope"])
    assert res.exit_code == 2 and "unknown pool 'nope'" in res.output
    # at the end, s1 (preempted for a1) waits again
    res = runner.invoke(app, ["pending", "--lake", str(lake), "--json"])
    assert [(r["job_id"], r["team"], r["reason"]) for r in json.loads(res.output)] == [
        ("s1", "search", "would_borrow")]


def ev_finished(jid, at):
    from test_policy import ev

    return ev("job.finished", at, job_id=jid, outcome="succeeded")
