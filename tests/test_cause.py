"""Issue 35 item 4: an interruption's cause (DESIGN §4's table). Every cause books the work lost since the last
checkpoint; only `preempted` counts as a preemption (the job's count, max_preemptions and anti-thrash, the
`jobs` view, statements' preemptions suffered); a decision id makes it `preempted` whatever is sent; the run's
`end_reason` in job_runs is the cause."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from chipledger.cli import app
from ledger import FoldConfig, evolve
from ledger.fold import interruption_cause
from schemas import parse_event

CFG = FoldConfig(check_invariants=True)
POOL = "lab/a100"
runner = CliRunner()


def ev(i, typ, at, **fields) -> dict:
    return {"event_id": f"e{i:03d}", "type": typ, "occurred_at": at, "pool": POOL, "source": "lab/slurm", **fields}


def setup() -> list[dict]:
    d = "2026-11-02T"
    return [ev(1, "pool.configured", d + "00:00:00Z", flavor="a100", chips_per_node=2),
            ev(2, "chip.registered", d + "00:00:00Z", chip_id="c1", node="n1"),
            ev(3, "quota.granted", d + "00:00:00Z", grant_id="g", team="t", chips=1),
            ev(4, "job.submitted", d + "00:00:00Z", job_id="j", team="t", chips=1),
            ev(5, "job.started", d + "00:00:00Z", job_id="j")]


def fold(events):
    state, steps = None, []
    for e in events:
        state, step = evolve(state, parse_event(orjson.dumps(e)), CFG)
        steps.append(step)
    return state, steps


@pytest.mark.parametrize("fields, cause", [
    ({}, "preempted"), ({"cause": "preempted"}, "preempted"), ({"cause": "requeued"}, "requeued"),
    ({"cause": "failure"}, "failure"),
    ({"cause": "requeued", "decision_id": "d-1"}, "preempted"),  # the actuator carried out the ledger's decision
    ({"cause": "failure", "decision_id": "d-1"}, "preempted"),
])
def test_cause_of_an_interruption(fields, cause):
    e = parse_event(orjson.dumps(ev(9, "job.preempted", "2026-11-02T01:00:00Z", job_id="j", **fields)))
    assert interruption_cause(e.__dict__) == cause
    state, steps = fold(setup() + [ev(6, "job.checkpointed", "2026-11-02T00:30:00Z", job_id="j"),
                                   ev(7, "job.preempted", "2026-11-02T01:00:00Z", job_id="j", **fields)])
    (run,) = steps[-1].job_runs
    assert run.end_reason == cause
    assert run.allocated_mchip_s == 3600 * 1000 and run.lost_mchip_s == 1800 * 1000  # lost for every cause
    job = state.jobs["j"]
    counted = cause == "preempted"
    assert job.preemptions == (1 if counted else 0) and len(job.preempted_at) == (1 if counted else 0)
    assert state.run_counts["t"] == [3600 * 1000, 1800 * 1000]  # goodput's counters count every cause


def test_requeues_never_use_up_max_preemptions():
    cfg = FoldConfig(check_invariants=True, max_preemptions=1)
    events = setup()
    for k in range(3):  # three admin requeues and restarts
        events += [ev(10 + 2 * k, "job.preempted", f"2026-11-02T0{1 + k}:00:00Z", job_id="j", cause="requeued"),
                   ev(11 + 2 * k, "job.started", f"2026-11-02T0{1 + k}:00:10Z", job_id="j")]
    state = None
    for e in events:
        state, step = evolve(state, parse_event(orjson.dumps(e)), cfg)
        assert step.applied
    job = state.jobs["j"]
    assert job.preemptions == 0 and job.preempted_at == [] and job.run_index == 4


def test_statements_and_jobs_view_count_only_preemptions(tmp_path):
    """A team's job is preempted once, requeued by an admin once and interrupted by a node failure once: the
    statement lists one preemption suffered, the `jobs` view says 1 / 1 / 1, and goodput counts all three runs'
    lost work."""
    d = "2026-11-02T"
    events = setup() + [
        ev(10, "job.preempted", d + "01:00:00Z", job_id="j"),
        ev(11, "job.started", d + "01:00:00Z", job_id="j"),
        ev(12, "job.preempted", d + "02:00:00Z", job_id="j", cause="requeued", reason="scontrol requeue"),
        ev(13, "job.started", d + "02:00:00Z", job_id="j"),
        ev(14, "job.preempted", d + "03:00:00Z", job_id="j", cause="failure", reason="NODE_FAIL"),
        ev(15, "job.started", d + "03:00:00Z", job_id="j"),
        ev(16, "job.finished", d + "04:00:00Z", job_id="j", outcome="succeeded"),
        ev(17, "pool.tick", "2026-11-03T00:00:00Z"),
    ]
    src = tmp_path / "e.jsonl"
    src.write_text("".join(json.dumps(e) + "\n" for e in events))
    lake, store = tmp_path / "lake", f"sqlite:///{tmp_path / 's.db'}"
    r = runner.invoke(app, ["run", "--events", str(src), "--lake", str(lake), "--store", store])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["sql", "--lake", str(lake), "--format", "json",
                            "SELECT preemptions, requeues, failures, lost_mchip_s FROM jobs"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == [{"preemptions": 1, "requeues": 1, "failures": 1, "lost_mchip_s": 3 * 3600_000}]
    out = tmp_path / "out"
    r = runner.invoke(app, ["statements", "--lake", str(lake), "--store", store, "--out", str(out),
                            "--period", "2026-11-02..2026-11-02"])
    assert r.exit_code == 0, r.output
    (f,) = [p for p in (out / "2026-11-02..2026-11-02").glob("*.json") if p.stem.startswith("t")]
    st = json.loads(f.read_text())
    assert st["preemptions"]["suffered"]["count"] == 1
    assert st["preemptions"]["suffered"]["jobs"][0]["at"] == "2026-11-02T01:00:00Z"
    assert st["goodput"]["lost_mchip_s"] == 3 * 3600_000
    inter = st["interruptions"]
    assert inter["requeued"] == {"count": 1, "lost_work_mchip_s": 3600_000}
    assert inter["failure"] == {"count": 1, "lost_work_mchip_s": 3600_000}
    md = f.with_suffix(".md").read_text()
    assert ("\nInterrupted by an admin (requeued): 1 runs (1.0 chip-hours of work lost); lost to failures: 1 runs "
            "(1.0 chip-hours of work lost). Neither counts as a preemption.\n\n## ") in md
    assert "Interrupted by an admin (requeued): 1 runs" in f.with_suffix(".html").read_text()


def test_why_shows_the_schedulers_own_reason(tmp_path):
    """job.waiting: the fold keeps the last reason on the job (cleared as it starts); `why` shows it."""
    d = "2026-11-02T"
    events = setup()[:3] + [
        ev(4, "job.submitted", d + "00:00:00Z", job_id="big", team="t", chips=2),  # more than the pool has
        ev(5, "job.waiting", d + "00:01:00Z", job_id="big", reason="Resources"),
        ev(6, "job.waiting", d + "00:02:00Z", job_id="big", reason="Priority",
           message="waiting for higher-priority jobs in the cohort"),
        ev(7, "pool.tick", d + "02:00:00Z"),
    ]
    state, steps = fold(events)
    assert all(s.applied for s in steps)
    job = state.jobs["big"]
    assert (job.waiting_reason, job.waiting_message) == ("Priority", "waiting for higher-priority jobs in the cohort")
    assert state.copy().jobs["big"].waiting_reason == "Priority"  # saved with the state
    src = tmp_path / "e.jsonl"
    src.write_text("".join(json.dumps(e) + "\n" for e in events))
    lake = tmp_path / "lake"
    r = runner.invoke(app, ["run", "--events", str(src), "--lake", str(lake), "--store", f"sqlite:///{tmp_path}/s.db"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["why", "big", "--lake", str(lake), "--json"])
    assert r.exit_code == 0, r.output
    ex = json.loads(r.output)
    assert (ex["scheduler_reason"], ex["scheduler_message"], ex["scheduler_reason_at"]) == (
        "Priority", "waiting for higher-priority jobs in the cohort", "2026-11-02T00:02:00Z")
    r = runner.invoke(app, ["why", "big", "--lake", str(lake)])
    assert "the scheduler says, as of 2026-11-02T00:02:00Z: Priority: waiting for higher-priority" in r.output
    # started: the reason it gave for the wait is gone
    started, _ = fold(events + [ev(8, "chip.registered", d + "02:00:00Z", chip_id="c2", node="n1"),
                                ev(9, "job.started", d + "02:00:01Z", job_id="big")])
    assert started.jobs["big"].waiting_reason is None and started.jobs["big"].waiting_message is None
