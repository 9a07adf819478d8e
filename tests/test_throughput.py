"""The throughput facts (lake table `progress`, docs/analytics.md "throughput"), hand-computed, and the rejections
of bad progress counts.

Pool of 8 chips on two nodes of 4 (n1: c1–c4, n2: c5–c8); team a holds all 8 of quota. Job j1 runs on n1 and
reports its progress in steps; its reference rate is the median of its first 3 healthy intervals (300 s: the
[slo] throughput_reference_s of this test). Times are offsets from T0 (tests/test_evolve.py).
"""

from __future__ import annotations

import pytest

from ledger import Fleet, FoldConfig, ProgressRow
from schemas.codes import RejectionCode as RC

from tests.test_evolve import (
    POOL, T0, checkpoint, chip, chip_state, configured, finish, grant, preempt, progress, start, submit, tick,
)

CFG = FoldConfig(check_invariants=True, throughput_reference_s=300, throughput_reference_reports=3)
N1 = ["c1", "c2", "c3", "c4"]
N2 = ["c5", "c6", "c7", "c8"]


def pool():
    return [configured(), *[chip(c, node="n1") for c in N1], *[chip(c, node="n2") for c in N2],
            grant("ga", "a", 8), grant("gb", "b", 8)]


# (event, the rejection code it must get, or None)
SCENARIO = [
    (submit("j1", "a", 4, at=50), None),
    (progress("j1", 0, at=60), RC.illegal_transition),    # pending: not running
    (progress("jx", 0, at=60), RC.unknown_job),
    (start("j1", at=100, chip_ids=N1), None),
    (progress("j1", 0, at=100), None),                    # the run's first report: its baseline
    (progress("j1", 400, at=200), None),                  # 400 steps / (4 chips × 100 s) = 1.0
    (progress("j1", 840, at=300), None),                  # 440 / 400 = 1.1
    (progress("j1", 839, at=350), RC.progress_backwards),  # below 840, reported in this run
    (progress("j1", 900, at=350, unit="token"), RC.illegal_transition),  # it counts steps
    (progress("j1", 1200, at=400), None),                 # 360 / 400 = 0.9: 300 s healthy, reference 1.0
    (chip_state("c3", "degraded", at=450), None),
    (progress("j1", 1500, at=500), None),                 # 0.75 < 0.8: slow, 100 s, c3 degraded
    (progress("j1", 1800, at=600), None),                 # 0.75: slow again
    (chip_state("c3", "healthy", at=650), None),
    (progress("j1", 2150, at=700), None),                 # 0.875: not slow (c3 was degraded until 650)
    (checkpoint("j1", at=750, units=2400), None),         # 250 / 200 = 1.25; work up to 2400 is safe
    (preempt("j1", at=800), None),
    (start("j1", at=900, chip_ids=N2), None),
    (progress("j1", 2399, at=900), RC.progress_backwards),  # a restart continues from the checkpoint's 2400
    (progress("j1", 2400, at=900), None),                 # the new run's baseline
    (progress("j1", 2350, at=1000), RC.progress_backwards),
    (progress("j1", 2800, at=1000), None),                # 1.0
    (chip_state("c5", "down", at=1050), None),            # j1 is charged 3 chips from here
    (progress("j1", 3100, at=1100), None),                # 300 / (4×50 + 3×50 chip-s) = 0.857…: not slow
    (checkpoint("j1", at=1150, units=3000), RC.progress_backwards),
    (finish("j1", at=1200), None),
    (tick(1300), None),
]


def _row(run, began, ended, u0, u1, charged, rate, ref, slow, slow_s, healthy, unhealthy="", held=""):
    return ProgressRow(POOL, "j1", "a", run, T0 + 50, "step", T0 + began, T0 + ended, u0, u1, 4000, charged, rate, ref, slow,
                       slow_s, healthy, unhealthy, held, T0 + ended)


EXPECTED = [
    _row(1, 100, 200, 0, 400, 400_000, 1.0, None, None, 0, True),
    _row(1, 200, 300, 400, 840, 400_000, 1.1, None, None, 0, True),
    _row(1, 300, 400, 840, 1200, 400_000, 0.9, None, None, 0, True),
    _row(1, 400, 500, 1200, 1500, 400_000, 0.75, 1.0, True, 100, False, "c3:degraded",
         "c3:degraded,c1:healthy,c2:healthy,c4:healthy"),
    _row(1, 500, 600, 1500, 1800, 400_000, 0.75, 1.0, True, 100, False, "c3:degraded",
         "c3:degraded,c1:healthy,c2:healthy,c4:healthy"),
    _row(1, 600, 700, 1800, 2150, 400_000, 0.875, 1.0, False, 0, False, "c3:degraded"),
    _row(1, 700, 750, 2150, 2400, 200_000, 1.25, 1.0, False, 0, True),
    _row(2, 900, 1000, 2400, 2800, 400_000, 1.0, 1.0, False, 0, True),
    _row(2, 1000, 1100, 2800, 3100, 350_000, 300 * 1000 / 350_000, 1.0, False, 0, False, "c5:down"),
]


def fold_scenario(config=CFG):
    fleet = Fleet(config)
    rows = []
    for e in pool():
        assert fleet.apply(e).applied
    for e, code in SCENARIO:
        step = fleet.apply(e)
        got = None if step.rejection is None else step.rejection.code
        assert got == code, (e.type, e.occurred_at, step.rejection)
        rows += step.progress
    return fleet, rows


def test_hand_computed_rates_reference_and_slow_seconds():
    _, rows = fold_scenario()
    assert rows == EXPECTED
    assert sum(r.slow_s for r in rows) == 200
    # the degraded chip is named on every slow interval
    assert {r.unhealthy_chips for r in rows if r.slow} == {"c3:degraded"}


def test_rejection_details_say_why():
    fleet, _ = fold_scenario()
    f = Fleet(CFG)
    for e in pool():
        f.apply(e)
    for e in (submit("j", "a", 1, at=1), start("j", at=2), progress("j", 10, at=3), checkpoint("j", at=4, units=20),
              preempt("j", at=5), start("j", at=6)):
        assert f.apply(e).applied
    back = f.apply(progress("j", 19, at=7)).rejection
    assert back.code == RC.progress_backwards and "below 20, the count of its last checkpoint" in back.detail
    assert f.apply(progress("j", 25, at=8)).applied
    back = f.apply(progress("j", 24, at=9)).rejection
    assert back.code == RC.progress_backwards and "below 25" in back.detail and "in this run" in back.detail
    unit = f.apply(progress("j", 30, at=9, unit="sample")).rejection
    assert unit.code == RC.illegal_transition and "'step', not 'sample'" in unit.detail


def test_checkpoint_without_units_keeps_the_last_count_safe():
    f = Fleet(CFG)
    for e in pool():
        f.apply(e)
    for e in (submit("j", "a", 1, at=1), start("j", at=2), progress("j", 10, at=3), checkpoint("j", at=4),
              preempt("j", at=5), start("j", at=6)):
        assert f.apply(e).applied
    assert f.apply(progress("j", 9, at=7)).rejection.code == RC.progress_backwards
    assert f.apply(progress("j", 10, at=7)).applied


def test_jobs_without_progress_write_no_rows_and_same_books():
    """Progress reports change no account: the journal and the runs are those of the same log without them."""
    with_progress = Fleet(CFG)
    without = Fleet(CFG)
    out_a, out_b = [], []
    for e in pool():
        with_progress.apply(e), without.apply(e)
    for e, code in SCENARIO:
        step = with_progress.apply(e)
        if step.applied:
            out_a.append((step.journal, step.job_runs, step.waits, step.free_chips))
        if e.type == "job.progress" or (e.type == "job.checkpointed" and code is not None):
            continue
        if e.type == "job.checkpointed":
            e = checkpoint(e.job_id, at=e.at_s - T0)
        step = without.apply(e)
        assert not step.progress
        out_b.append((step.journal, step.job_runs, step.waits, step.free_chips))
    # (a row may be posted at another event: free chips are posted at the first event of a later second)
    for table in range(4):
        assert [r for o in out_a for r in o[table]] == [r for o in out_b for r in o[table]]
    (end_a,), (end_b,) = with_progress.pools.values(), without.pools.values()
    assert end_a.books.to_dict() == end_b.books.to_dict()


def test_a_slow_job_without_an_unhealthy_chip_has_no_cause():
    f = Fleet(FoldConfig(check_invariants=True, throughput_reference_s=0, throughput_reference_reports=1))
    for e in pool():
        f.apply(e)
    for e in (submit("j", "a", 2, at=0), start("j", at=0, chip_ids=["c1", "c2"]), progress("j", 0, at=0),
              progress("j", 200, at=100)):  # 1.0: the reference, from one interval
        assert f.apply(e).applied
    step = f.apply(progress("j", 250, at=200))  # 0.25
    (row,) = step.progress
    assert (row.slow, row.slow_s, row.healthy, row.unhealthy_chips, row.held_chips) == (
        True, 100, True, "", "c1:healthy,c2:healthy")


def test_reference_stretch_starts_again_after_an_unhealthy_interval():
    f = Fleet(FoldConfig(check_invariants=True, throughput_reference_s=200, throughput_reference_reports=2))
    for e in pool():
        f.apply(e)
    evs = [submit("j", "a", 1, at=0), start("j", at=0, chip_ids=["c1"]), progress("j", 0, at=0),
           progress("j", 100, at=100),                      # 1.0, healthy
           chip_state("c1", "degraded", at=150), chip_state("c1", "healthy", at=200),
           progress("j", 130, at=200),                      # 0.3, c1 degraded in it: the stretch starts again
           progress("j", 330, at=300), progress("j", 630, at=400),  # 2.0, 3.0: reference 2.5
           progress("j", 830, at=500)]                      # 2.0 >= 0.8 × 2.5: not slow
    rows = []
    for e in evs:
        step = f.apply(e)
        assert step.applied
        rows += step.progress
    assert [r.reference_units_per_chip_s for r in rows] == [None, None, None, None, 2.5]
    assert rows[-1].slow is False


def test_state_round_trip_keeps_progress():
    fleet, _ = fold_scenario()
    for name, st in fleet.pools.items():
        from ledger import PoolState
        again = PoolState.from_dict(st.to_dict())
        assert again.to_dict() == st.to_dict()


@pytest.mark.parametrize("bad", [-1, 10**18 + 1, 1.5, "3", True])
def test_schema_rejects_bad_counts(bad):
    from schemas import parse_payload
    from schemas.codes import Rejection
    raw = {"event_id": "e", "type": "job.progress", "occurred_at": "2026-11-02T08:00:00Z", "pool": POOL,
           "source": "s", "job_id": "j", "units": bad, "unit": "step"}
    got = parse_payload(raw)
    assert isinstance(got, Rejection) and got.code == RC.schema_invalid


def test_a_saved_state_without_progress_leaves_the_throughput_fields_out():
    """A log without progress saves the same state as before progress existed (digests over states unchanged)."""
    from dataclasses import fields
    from ledger import Job, PoolState
    f = Fleet(CFG)
    for e in [*pool(), submit("j", "a", 1, at=1), start("j", at=2), checkpoint("j", at=3), submit("k", "a", 1, at=4),
              start("k", at=4), progress("k", 5, at=5)]:
        assert f.apply(e).applied
    (state,) = f.pools.values()
    saved = state.to_dict()
    names = [x.name for x in fields(Job)]
    # the job's list ends with progress (the fields after it, `displaced`, the scheduler's `waiting_*` reason and the
    # run's `charge_changes` priced as it ends, are saved apart, only where set)
    assert names[names.index("progress") + 1:] == ["displaced", "waiting_reason", "waiting_message", "charge_changes"]
    assert len(saved["jobs"]["j"]) == names.index("progress")
    assert len(saved["jobs"]["k"]) == names.index("progress") + 1
    assert "displaced" not in saved or not saved["displaced"]
    assert "waiting" not in saved or not saved["waiting"]
    assert not saved.get("charges")  # an unpriced pool's jobs keep no pieces
    again = PoolState.from_dict(saved)
    assert again.jobs["j"] == state.jobs["j"] and again.jobs["k"] == state.jobs["k"]
