"""The monotonic counters the core keeps in the pool state (DESIGN §4 "Facts": good and total events per SLO,
decisions, victims, dead letters; what /metrics exposes): hand-computed, equal to the sums of the rows the fold
wrote, and carried by a saved state."""

from __future__ import annotations

import orjson
import pytest

from ledger import Fleet, FoldConfig, PoolState
from schemas import parse_event
from streams.rows import step_rows

from tests.metrics_oracle import rows_counters
from tests.monitoring_scenario import outage_events
from tests.test_evolve import chip, configured, finish, grant, start, submit, tick


def _waits_scenario():
    return [configured(), *[chip(f"c{i}") for i in range(1, 9)], grant("ga", "a", 4),
            *[submit(j, "a", 1, at=0) for j in ("ja1", "ja2", "ja3", "ja4")],  # in a's unused quota (4)
            submit("jb1", "b", 1, at=0),     # b holds no quota: not in quota
            start("jb1", at=30),             # latency only
            finish("ja3", "cancelled", at=100),  # in quota, ended while pending: counts for quota, never honoured
            start("ja1", at=600),            # in quota, within sched_slo_s (600: at the limit)
            start("ja2", at=601),            # in quota, late
            tick(700)]                       # ja4 still waits: counted by none


@pytest.mark.parametrize("sched_slo_s, a, b", [
    (600, [3, 1, 2, 1], [0, 0, 1, 1]),
    (601, [3, 2, 2, 2], [0, 0, 1, 1]),
    (20, [3, 0, 2, 0], [0, 0, 1, 0]),
])
def test_wait_counts_hand_computed(sched_slo_s, a, b):
    fleet = Fleet(FoldConfig(check_invariants=True, sched_slo_s=sched_slo_s))
    for e in _waits_scenario():
        assert fleet.apply(e).applied
    (s,) = fleet.pools.values()
    # [in quota and ended, of which started within sched_slo_s, started, of which within sched_slo_s]
    assert s.wait_counts == {"a": a, "b": b}
    assert s.run_counts == {} and s.decision_counts == {} and s.rejection_counts == {}


def test_counters_are_the_sums_of_the_rows_the_fold_wrote():
    """A seeded fleet with preemptions, an outage and progress reports, plus events the fold rejects: every counter
    in the state is what adding up the fold's own rows gives (the oracle of tests/metrics_oracle.py), and the
    invariants hold."""
    from streams.metrics import MetricsCollector, exposition, registry_of

    from tests.test_metrics import by, samples

    events = [parse_event(orjson.dumps(e)) for e in outage_events(days=3, outage_at_h=30)]
    fin = next(e for e in events if e.type == "job.finished")
    bad = [events[5].model_copy(update={"source": "elsewhere"}),  # its id seen before with another body
           fin.model_copy(update={"event_id": "x-1", "job_id": "nobody"})]  # a job never submitted
    k = events.index(fin) + 1
    fleet = Fleet(FoldConfig(check_invariants=False))
    rows = []
    for i, e in enumerate([*events[:k], *bad, *events[k:]]):
        step = fleet.apply(e)
        if step.rejection is not None:
            rows.append((e.pool, "deadletters", [None, None, None, None, step.rejection.code.value, None, None,
                                                 None, e.pool, None]))
        elif step.applied:
            rows.extend((e.pool, table, row) for table, row in step_rows(e, step, "t", 0, i))
    want = rows_counters(rows)
    s = samples(exposition(registry_of(MetricsCollector(fleet.pools, fleet.config), process=False)).decode())
    for name, values in want.items():
        assert by(s, name, *_LABELS[name]) == pytest.approx(values), name
    assert want["chipledger_decisions_total"] and want["chipledger_preemption_victims_total"]
    dead = want["chipledger_dead_letters_total"]  # the id seen before fails its entity check first (precedence)
    assert sum(dead.values()) == 2 and dead[("unknown_job",)] == 1
    assert sum(want["chipledger_lost_chip_seconds_total"].values()) > 0
    for state in fleet.pools.values():
        from ledger.fold import _check_counters

        _check_counters(state)


_LABELS = {
    "chipledger_allocated_chip_seconds_total": ("pool", "team"),
    "chipledger_useful_chip_seconds_total": ("pool", "team"),
    "chipledger_lost_chip_seconds_total": ("pool", "team"),
    "chipledger_in_quota_waits_total": ("pool", "team"),
    "chipledger_in_quota_waits_honoured_total": ("pool", "team"),
    "chipledger_started_waits_total": ("pool", "team"),
    "chipledger_started_waits_within_slo_total": ("pool", "team"),
    "chipledger_progress_judged_chip_seconds_total": ("pool", "team"),
    "chipledger_progress_at_rate_chip_seconds_total": ("pool", "team"),
    "chipledger_decisions_total": ("pool", "type", "rule", "verdict"),
    "chipledger_preemption_victims_total": ("pool", "team", "rule"),
    "chipledger_preemption_lost_work_chip_seconds_total": ("pool", "team", "rule"),
    "chipledger_dead_letters_total": ("code",),
    "chipledger_events_applied_total": ("pool",),
}


def test_a_saved_state_carries_the_counters_and_one_saved_before_them_starts_at_zero():
    fleet = Fleet(FoldConfig(check_invariants=True))
    for e in [*_waits_scenario(), finish("ja1", "failed", at=800), finish("nope", at=810)]:
        fleet.apply(e)
    (s,) = fleet.pools.values()
    assert s.run_counts["a"][0] > 0 and s.rejection_counts == {"unknown_job": 1}
    d = orjson.loads(orjson.dumps(s.to_dict()))  # as the worker's table holds it
    back = PoolState.from_dict(d)
    for name in ("wait_counts", "run_counts", "progress_counts", "decision_counts", "victim_counts",
                 "rejection_counts"):
        assert getattr(back, name) == getattr(s, name), name
    assert back.to_dict() == s.to_dict()
    del d["counters"]  # a state saved before the counters existed
    old = PoolState.from_dict(d)
    assert old.wait_counts == {} and old.run_counts == {} and old.rejection_counts == {}
    assert old.rejected == 1  # its own count of rejections stays


def test_sched_slo_s_is_part_of_the_fold_config_and_of_slo_settings():
    from analytics.slo_views import SloParams

    assert FoldConfig(**SloParams(sched_slo_s=900).fold_kwargs()).sched_slo_s == 900
    with pytest.raises(ValueError, match="sched_slo_s"):
        FoldConfig(sched_slo_s=0)
