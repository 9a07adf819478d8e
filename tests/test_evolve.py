"""The fold (ledger/): table-driven outcomes for every event type and every rejection code the core produces,
then hand-computed journal scenarios, exact to the milli-chip-second.

Times are offsets in seconds from T0 = 2026-11-02T08:00:00Z, which is the start of a UTC hour (hour H0);
H1 = T0 + 3600. Amounts are milli-chip-seconds: a 1-chip rate for one hour is 1000 × 3600 = 3_600_000.
"""

from __future__ import annotations

import itertools
from datetime import datetime, timezone

import pytest

from ledger import (
    FoldConfig, Fleet, JournalRow, PoolState, check_invariants, close_books, evolve, hour_of, split_use,
)
from ledger.policy import decision_of
from ledger.books import BORROWED, CAPACITY, ENTITLED, IDLE, IN_QUOTA, OVERCOMMITTED, PENDING, UNAVAILABLE
from schemas import Rejection, RejectionCode as RC, parse_payload

T0 = 1_793_606_400  # 2026-11-02T08:00:00Z
H = 3600
H0, H1, H2 = T0, T0 + H, T0 + 2 * H
POOL = "us-east1-a/h100"
CFG = FoldConfig(check_invariants=True)

_ids = itertools.count(1)


def iso(offset_s: int) -> str:
    return datetime.fromtimestamp(T0 + offset_s, timezone.utc).isoformat().replace("+00:00", "Z")


def ev(etype: str, at: int = 0, *, eid: str | None = None, pool: str = POOL, **fields):
    """A validated event at T0 + `at` seconds; `effective_*`/`window_*` fields are offsets from T0 too."""
    for k in ("effective_from", "effective_until", "window_start", "window_end"):
        if k in fields and fields[k] is not None:
            fields[k] = iso(fields[k])
    d = {"event_id": eid or f"e{next(_ids)}", "type": etype, "occurred_at": iso(at), "pool": pool,
         "source": "test", **fields}
    e = parse_payload(d)
    assert not isinstance(e, Rejection), e
    return e


# short names for the table
def configured(at=0, **kw): return ev("pool.configured", at, flavor="h100", chips_per_node=8, **kw)
def tick(at, **kw): return ev("pool.tick", at, **kw)
def chip(cid, at=0, node="n1", **kw): return ev("chip.registered", at, chip_id=cid, node=node, **kw)
def chip_state(cid, state, at=0, **kw): return ev("chip.state_changed", at, chip_id=cid, state=state, **kw)
def retire(cid, at=0, **kw): return ev("chip.retired", at, chip_id=cid, **kw)
def grant(gid, team, chips, at=0, **kw): return ev("quota.granted", at, grant_id=gid, team=team, chips=chips, **kw)
def revoke(gid, at=0, **kw): return ev("quota.revoked", at, grant_id=gid, **kw)
def burst(rid, team, chips, at=0, **kw):
    return ev("burst.requested", at, request_id=rid, team=team, chips=chips, window_start=at + 60,
              window_end=at + 3660, **kw)
def submit(jid, team, chips, at=0, **kw): return ev("job.submitted", at, job_id=jid, team=team, chips=chips, **kw)
def start(jid, at=0, chip_ids=None, **kw):
    return ev("job.started", at, job_id=jid, **({"chip_ids": chip_ids} if chip_ids is not None else {}), **kw)
def checkpoint(jid, at=0, **kw): return ev("job.checkpointed", at, job_id=jid, **kw)
def progress(jid, units, at=0, unit="step", **kw): return ev("job.progress", at, job_id=jid, units=units, unit=unit, **kw)
def preempt(jid, at=0, **kw): return ev("job.preempted", at, job_id=jid, **kw)
def finish(jid, outcome="succeeded", at=0, **kw): return ev("job.finished", at, job_id=jid, outcome=outcome, **kw)
def release(jid, at=0, **kw): return ev("job.released", at, job_id=jid, **kw)
def waiting(jid, reason="Priority", at=0, **kw): return ev("job.waiting", at, job_id=jid, reason=reason, **kw)
def price(pid, cents, at=0, **kw): return ev("price.set", at, price_id=pid, per_chip_hour=cents, unit="USD-cent", **kw)
def budget(bid, team, amount, at=0, **kw):
    return ev("budget.set", at, budget_id=bid, team=team, period="month", amount=amount, unit="USD-cent", **kw)


def fold(events, config=CFG):
    """Fold a list of events into a fleet; every prior event of a table case must be applied."""
    fleet = Fleet(config)
    steps = [fleet.apply(e) for e in events]
    return fleet, steps


COUNTERS = ("applied", "duplicates", "rejected", "late_events", "max_lateness_s")


def without_counters(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in COUNTERS}


# =========================================================================================================
# table: (case id, prior events, event under test, expected: "applied" | "duplicate" | RejectionCode)
# =========================================================================================================

def BASE():
    """A configured pool with chips c1..c3 on node n1, c4 on n2, and team `ads` holding a 2-chip grant."""
    return [configured(), chip("c1"), chip("c2"), chip("c3"), chip("c4", node="n2"), grant("g1", "ads", 2)]


def _dup_pair(make):
    """(prior, event): the event under test re-sends an applied event's exact body."""
    first = make()
    return [first], first


def _conflict_pair(make, other):
    first = make()
    return [first], other(eid=first.event_id)


CASES = [
    # --- pool.configured / pool.tick ---------------------------------------------------------------------
    ("configure a new pool", [], configured(), "applied"),
    ("reconfigure a pool", [configured()], configured(10), "applied"),
    ("tick", BASE(), tick(60), "applied"),
    ("tick an unconfigured pool", [], tick(0), RC.unknown_pool),
    ("event for a pool other than the configured one", BASE(),
     ev("job.submitted", 10, pool="eu-west4/tpu", job_id="j1", team="ads", chips=1), RC.unknown_pool),
    *[(f"{t} for an unconfigured pool", [], e, RC.unknown_pool) for t, e in [
        ("chip.registered", chip("c1")), ("chip.state_changed", chip_state("c1", "down")),
        ("chip.retired", retire("c1")), ("quota.granted", grant("g", "ads", 1)), ("quota.revoked", revoke("g")),
        ("burst.requested", burst("b", "ads", 1)), ("job.submitted", submit("j", "ads", 1)),
        ("job.started", start("j")), ("job.checkpointed", checkpoint("j")), ("job.preempted", preempt("j")),
        ("job.released", release("j")), ("job.finished", finish("j"))]],

    # --- chips -------------------------------------------------------------------------------------------
    ("register a chip", BASE(), chip("c9", 10), "applied"),
    ("chip registered twice", BASE(), chip("c1", 10), RC.illegal_transition),
    ("chip registered twice on another node", BASE(), chip("c1", 10, node="n7"), RC.illegal_transition),
    ("re-register a retired chip id", BASE() + [retire("c4", 5)], chip("c4", 10), "applied"),
    *[(f"chip state -> {s}", BASE(), chip_state("c1", s, 10), "applied")
      for s in ("healthy", "degraded", "down", "maintenance")],
    ("chip state of an unknown chip", BASE(), chip_state("c9", "down", 10), RC.unknown_chip),
    ("chip state of a retired chip", BASE() + [retire("c1", 5)], chip_state("c1", "healthy", 10), RC.unknown_chip),
    ("retire a chip", BASE(), retire("c1", 10), "applied"),
    ("retire a down chip", BASE() + [chip_state("c1", "down", 5)], retire("c1", 10), "applied"),
    ("retire an unknown chip", BASE(), retire("c9", 10), RC.unknown_chip),
    ("retire a chip twice", BASE() + [retire("c1", 5)], retire("c1", 10), RC.unknown_chip),

    # --- quota -------------------------------------------------------------------------------------------
    ("grant", BASE(), grant("g2", "search", 1, 10), "applied"),
    ("grant with a future window", BASE(), grant("g2", "search", 1, 10, effective_from=100, effective_until=200),
     "applied"),
    ("grant already over", BASE(), grant("g2", "search", 1, 10, effective_until=5), "applied"),
    ("amend a grant (same team)", BASE(), grant("g1", "ads", 3, 10), "applied"),
    ("re-grant a grant id to another team", BASE(), grant("g1", "search", 2, 10), RC.illegal_transition),
    ("re-grant a pending grant id to another team",
     BASE() + [grant("g2", "ads", 1, 5, effective_from=1000)], grant("g2", "search", 1, 10), RC.illegal_transition),
    ("grant id of an ended grant may go to another team",
     BASE() + [grant("g2", "ads", 1, 5, effective_until=100)], grant("g2", "search", 1, 200), "applied"),
    ("... also when a tick passed its end first",
     BASE() + [grant("g2", "ads", 1, 5, effective_until=100), tick(150)], grant("g2", "search", 1, 200), "applied"),
    ("grant id of a revoked grant may go to another team",
     BASE() + [revoke("g1", 5)], grant("g1", "search", 1, 10), "applied"),
    ("revoke", BASE(), revoke("g1", 10), "applied"),
    ("revoke a grant not yet in effect", BASE() + [grant("g2", "ads", 1, 5, effective_from=1000)],
     revoke("g2", 10), "applied"),
    ("revoke an unknown grant", BASE(), revoke("g9", 10), RC.unknown_grant),
    ("revoke twice", BASE() + [revoke("g1", 5)], revoke("g1", 10), RC.unknown_grant),
    ("revoke a grant that ended on its own",
     BASE() + [grant("g2", "ads", 1, 5, effective_until=100)], revoke("g2", 200), RC.unknown_grant),
    ("... the same verdict when a tick passed its end first",
     BASE() + [grant("g2", "ads", 1, 5, effective_until=100), tick(150)], revoke("g2", 200), RC.unknown_grant),
    ("revoke at the very instant a grant ends",
     BASE() + [grant("g2", "ads", 1, 5, effective_until=100)], revoke("g2", 100), RC.unknown_grant),
    ("revoke one second before a grant ends",
     BASE() + [grant("g2", "ads", 1, 5, effective_until=100)], revoke("g2", 99), "applied"),
    ("burst request", BASE(), burst("b1", "ads", 2, 10), "applied"),
    ("burst request of a team without quota", BASE(), burst("b1", "newteam", 0.5, 10), "applied"),

    # --- jobs --------------------------------------------------------------------------------------------
    ("submit", BASE(), submit("j1", "ads", 1, 10), "applied"),
    ("submit for a team without quota", BASE(), submit("j1", "nobody", 1, 10), "applied"),
    ("submit an active job id again", BASE() + [submit("j1", "ads", 1, 5)], submit("j1", "ads", 1, 10),
     RC.illegal_transition),
    ("submit a running job id again", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6)],
     submit("j1", "ads", 1, 10), RC.illegal_transition),
    ("reuse a finished job id", BASE() + [submit("j1", "ads", 1, 5), finish("j1", "cancelled", 6)],
     submit("j1", "ads", 1, 10), "applied"),
    ("start without placement", BASE() + [submit("j1", "ads", 2, 5)], start("j1", 10), "applied"),
    ("start with placement", BASE() + [submit("j1", "ads", 2, 5)], start("j1", 10, ["c1", "c2"]), "applied"),
    ("start on more chips than needed", BASE() + [submit("j1", "ads", 2, 5)], start("j1", 10, ["c1", "c2", "c3"]),
     "applied"),
    ("start a fractional job on one chip", BASE() + [submit("j1", "ads", 0.5, 5)], start("j1", 10, ["c1"]),
     "applied"),
    ("start on a down chip", BASE() + [submit("j1", "ads", 1, 5), chip_state("c1", "down", 6)],
     start("j1", 10, ["c1"]), "applied"),
    ("start overcommitting the pool", BASE() + [submit("j1", "ads", 9, 5)], start("j1", 10), "applied"),
    ("restart after preemption", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), preempt("j1", 7)],
     start("j1", 10), "applied"),
    ("job.started twice", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6)], start("j1", 10),
     RC.illegal_transition),
    ("start an unknown job", BASE(), start("j9", 10), RC.unknown_job),
    ("start a finished job", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), finish("j1", at=7)],
     start("j1", 10), RC.unknown_job),
    ("start with unknown chip ids", BASE() + [submit("j1", "ads", 2, 5)], start("j1", 10, ["c1", "c9"]),
     RC.unknown_chip),
    ("start on a retired chip", BASE() + [submit("j1", "ads", 1, 5), retire("c1", 6)], start("j1", 10, ["c1"]),
     RC.unknown_chip),
    ("placement on fewer chips than the job needs", BASE() + [submit("j1", "ads", 3, 5)],
     start("j1", 10, ["c1", "c2"]), RC.illegal_transition),
    ("placement on fewer chips than a fractional job needs", BASE() + [submit("j1", "ads", 1.5, 5)],
     start("j1", 10, ["c1"]), RC.illegal_transition),
    # precedence: the code of highest rank wins
    ("unknown chip AND unknown job -> unknown_chip", BASE(), start("j9", 10, ["c9"]), RC.unknown_chip),
    ("unknown chip AND already running -> unknown_chip", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6)],
     start("j1", 10, ["c9"]), RC.unknown_chip),
    ("too few chips AND already running -> illegal_transition",
     BASE() + [submit("j1", "ads", 2, 5), start("j1", 6)], start("j1", 10, ["c1"]), RC.illegal_transition),
    ("checkpoint", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6)], checkpoint("j1", 10), "applied"),
    ("checkpoint a pending job", BASE() + [submit("j1", "ads", 1, 5)], checkpoint("j1", 10), RC.illegal_transition),
    ("checkpoint a preempted job", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), preempt("j1", 7)],
     checkpoint("j1", 10), RC.illegal_transition),
    ("checkpoint an unknown job", BASE(), checkpoint("j9", 10), RC.unknown_job),
    # progress (docs/events.md, "Progress counts")
    ("progress", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6)], progress("j1", 0, 10), "applied"),
    ("progress of a pending job", BASE() + [submit("j1", "ads", 1, 5)], progress("j1", 0, 10), RC.illegal_transition),
    ("progress of an unknown job", BASE(), progress("j9", 0, 10), RC.unknown_job),
    ("progress with the same count", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), progress("j1", 7, 7)],
     progress("j1", 7, 10), "applied"),
    ("progress going back", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), progress("j1", 7, 7)],
     progress("j1", 6, 10), RC.progress_backwards),
    ("progress in another unit", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), progress("j1", 7, 7)],
     progress("j1", 8, 10, unit="token"), RC.illegal_transition),
    ("another unit AND going back -> illegal_transition",
     BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), progress("j1", 7, 7)],
     progress("j1", 1, 10, unit="token"), RC.illegal_transition),
    ("checkpoint with units going back", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), progress("j1", 7, 7)],
     checkpoint("j1", 10, units=3), RC.progress_backwards),
    ("restart below the checkpoint's count",
     BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), checkpoint("j1", 7, units=50), preempt("j1", 8),
               start("j1", 9)], progress("j1", 49, 10), RC.progress_backwards),
    ("restart below the count before the preemption (work lost, done again)",
     BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), checkpoint("j1", 7, units=50), progress("j1", 80, 8),
               preempt("j1", 8), start("j1", 9)], progress("j1", 60, 10), "applied"),
    ("preempt", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6)], preempt("j1", 10, decision_id="d1"), "applied"),
    ("preempt a pending job", BASE() + [submit("j1", "ads", 1, 5)], preempt("j1", 10), RC.illegal_transition),
    ("preempt twice", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), preempt("j1", 7)], preempt("j1", 10),
     RC.illegal_transition),
    ("preempt an unknown job", BASE(), preempt("j9", 10), RC.unknown_job),
    # held: back in the queue but not eligible yet (job.preempted with held), until job.released
    ("preempt and hold", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6)], preempt("j1", 10, held=True), "applied"),
    ("preempt with held false (pending at once)", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6)],
     preempt("j1", 10, held=False), "applied"),
    ("preempt a held job", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), preempt("j1", 7, held=True)],
     preempt("j1", 10, held=True), RC.illegal_transition),
    ("release a held job", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), preempt("j1", 7, held=True)],
     release("j1", 10), "applied"),
    ("release twice", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), preempt("j1", 7, held=True),
                                release("j1", 8)], release("j1", 10), RC.illegal_transition),
    ("release a pending job", BASE() + [submit("j1", "ads", 1, 5)], release("j1", 10), RC.illegal_transition),
    ("release a job preempted without held", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), preempt("j1", 7)],
     release("j1", 10), RC.illegal_transition),
    ("release a running job", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6)], release("j1", 10),
     RC.illegal_transition),
    ("release an unknown job", BASE(), release("j9", 10), RC.unknown_job),
    ("release a finished job", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), preempt("j1", 7, held=True),
                                          finish("j1", "cancelled", 8)], release("j1", 10), RC.unknown_job),
    ("start a held job (released as it starts)",
     BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), preempt("j1", 7, held=True)], start("j1", 10), "applied"),
    *[(f"finish a held job: {o}", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), preempt("j1", 7, held=True)],
       finish("j1", o, 10), "applied") for o in ("succeeded", "failed", "cancelled")],
    ("checkpoint a held job", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), preempt("j1", 7, held=True)],
     checkpoint("j1", 10), RC.illegal_transition),
    ("progress of a held job", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), preempt("j1", 7, held=True)],
     progress("j1", 0, 10), RC.illegal_transition),
    ("submit a held job id again", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), preempt("j1", 7, held=True)],
     submit("j1", "ads", 1, 10), RC.illegal_transition),
    *[(f"finish a running job: {o}", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6)], finish("j1", o, 10),
       "applied") for o in ("succeeded", "failed", "cancelled")],
    *[(f"finish a pending job: {o}", BASE() + [submit("j1", "ads", 1, 5)], finish("j1", o, 10), "applied")
      for o in ("succeeded", "failed", "cancelled")],
    ("finish an unknown job", BASE(), finish("j9", "succeeded", 10), RC.unknown_job),
    ("finish twice", BASE() + [submit("j1", "ads", 1, 5), finish("j1", "cancelled", 6)], finish("j1", "failed", 10),
     RC.unknown_job),

    # job.waiting: the scheduler's reason while the job is in the queue (pending or held)
    ("waiting reason of a pending job", BASE() + [submit("j1", "ads", 1, 5)], waiting("j1", "Priority", 10,
                                                                                     message="8 chips short"), "applied"),
    ("waiting reason of a held job", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6), preempt("j1", 7, held=True)],
     waiting("j1", "BeginTime", 10), "applied"),
    ("waiting reason of a running job", BASE() + [submit("j1", "ads", 1, 5), start("j1", 6)], waiting("j1", "x", 10),
     RC.illegal_transition),
    ("waiting reason of an unknown job", BASE(), waiting("j9", "Priority", 10), RC.unknown_job),
    # prices apply forward; budgets from any instant
    ("price from now", BASE(), price("p1", 250, 10), "applied"),
    ("price from later, in some hours", BASE(), price("p1", 250, 10, effective_from=3600, hours_of_week=[1, 2]),
     "applied"),
    ("price from before the pool clock", BASE() + [tick(100)], price("p1", 250, 101, effective_from=50),
     RC.illegal_transition),
    ("budget", BASE(), budget("b1", "ads", 100_000, 10, effective_from=-86400), "applied"),

    # --- duplicates --------------------------------------------------------------------------------------
    ("identical duplicate of a tick", BASE() + [tick(10, eid="t1")], tick(10, eid="t1"), "duplicate"),
    ("identical duplicate of a submit (dropped before its check)",
     BASE() + [submit("j1", "ads", 1, 5, eid="s1")], submit("j1", "ads", 1, 5, eid="s1"), "duplicate"),
    ("identical duplicate of a start, after the job finished",
     BASE() + [submit("j1", "ads", 1, 5), start("j1", 6, eid="st1"), finish("j1", at=7)], start("j1", 6, eid="st1"),
     "duplicate"),
    ("identical duplicate of a configure", [configured(0, eid="cfg")], configured(0, eid="cfg"), "duplicate"),
    ("duplicate with a different body", BASE() + [tick(10, eid="t1")], tick(11, eid="t1"), RC.duplicate_conflict),
    ("duplicate id, another type", BASE() + [tick(10, eid="x1")], submit("j1", "ads", 1, 10, eid="x1"),
     RC.duplicate_conflict),
    ("duplicate id, one field changed", BASE() + [submit("j1", "ads", 1, 5, eid="s1"), finish("j1", at=6)],
     submit("j1", "ads", 2, 5, eid="s1"), RC.duplicate_conflict),
    ("conflicting duplicate that is also illegal -> illegal_transition",
     BASE() + [submit("j1", "ads", 1, 5, eid="s1")], submit("j1", "ads", 2, 5, eid="s1"), RC.illegal_transition),
]

_case_ids = [c[0] for c in CASES]
assert len(set(_case_ids)) == len(_case_ids), "case ids must be unique"


@pytest.mark.parametrize("prior, event, expected", [c[1:] for c in CASES], ids=_case_ids)
def test_outcome(prior, event, expected):
    fleet, steps = fold(prior)
    for e, s in zip(prior, steps):
        assert s.applied, f"prior event {e.type} {e.event_id} not applied: {s.rejection}"
    state = fleet.pools.get(event.pool)
    before = state.to_dict() if state is not None else None

    step = fleet.apply(event)
    after_state = fleet.pools.get(event.pool)

    if expected == "applied":
        assert step.applied and step.rejection is None and not step.duplicate
        assert step.applied_at == event.at_s
        assert after_state.applied == (before["applied"] if before else 0) + 1
        assert after_state.clock == event.at_s
        return
    assert not step.applied
    assert step.applied_at is None
    assert step.journal == [] and step.job_runs == [] and step.decisions == []
    after = after_state.to_dict() if after_state is not None else None
    if expected == "duplicate":
        assert step.duplicate and step.rejection is None
        assert after["duplicates"] == before["duplicates"] + 1
        before["duplicates"] += 1
        assert after == before  # nothing but the counter moved
        return
    assert isinstance(step.rejection, Rejection)
    assert step.rejection.code == expected, step.rejection
    assert step.rejection.detail
    if expected == RC.unknown_pool:
        assert after_state is None  # no state is created for a pool never configured
        return
    assert after["rejected"] == before["rejected"] + 1
    before["rejected"] += 1
    rejections = before["counters"]["rejections"]  # the dead letters by code (/metrics)
    rejections[expected.value] = rejections.get(expected.value, 0) + 1
    assert after == before  # nothing but the counters moved


def test_every_core_code_and_event_type_is_in_the_table():
    core_codes = {RC.unknown_pool, RC.unknown_chip, RC.unknown_job, RC.unknown_grant, RC.illegal_transition,
                  RC.progress_backwards, RC.duplicate_conflict}
    assert core_codes <= {c[3] for c in CASES}
    from schemas import EVENT_MODELS
    applied_types = {c[2].type for c in CASES if c[3] == "applied"}
    assert applied_types == set(EVENT_MODELS)


def test_evolve_is_the_fold_of_one_pool():
    state, step = evolve(None, tick(0))
    assert state is None and step.rejection.code == RC.unknown_pool
    state, step = evolve(None, configured(0), CFG)
    assert isinstance(state, PoolState) and step.applied and (state.clock, state.applied) == (T0, 1)
    same, step = evolve(state, chip("c1", 10), CFG)
    assert same is state and state.capacity_milli == 1000 and step.applied_at == T0 + 10


def test_id_of_a_rejected_event_is_not_remembered():
    fleet, steps = fold(BASE() + [revoke("g9", 5, eid="r1"), revoke("g9", 5, eid="r1"), tick(10, eid="r1")])
    assert [s.rejection.code if s.rejection else "applied" for s in steps[-3:]] == [
        RC.unknown_grant, RC.unknown_grant, "applied"]
    assert fleet.pools[POOL].duplicates == 0 and fleet.pools[POOL].rejected == 2


def test_duplicates_are_counted_not_applied():
    fleet, steps = fold(BASE() + [submit("j1", "ads", 1, 10, eid="s1")] * 3 + [tick(20, eid="t")] * 2)
    s = fleet.pools[POOL]
    assert [st.duplicate for st in steps[-5:]] == [False, True, True, False, True]
    assert s.duplicates == 3 and s.rejected == 0 and s.applied == len(BASE()) + 2
    assert s.teams["ads"].pending == 1


def test_rejections_are_counted():
    fleet, steps = fold(BASE() + [finish("j9", at=10), revoke("g9", 11), chip("c1", 12), tick(13)])
    s = fleet.pools[POOL]
    assert [st.rejection.code if st.rejection else None for st in steps[-4:]] == [
        RC.unknown_job, RC.unknown_grant, RC.illegal_transition, None]
    assert s.rejected == 3 and s.clock == T0 + 13


def test_a_rejected_event_does_not_advance_the_clock_or_close_hours():
    fleet, _ = fold(BASE())
    step = fleet.apply(finish("j9", at=3 * H))  # far in the future, rejected
    assert step.rejection.code == RC.unknown_job and step.journal == []
    s = fleet.pools[POOL]
    assert s.clock == T0 and s.books.open_hour == H0


def test_dedup_window_expires():
    cfg = FoldConfig(check_invariants=True, dedup_window_s=100)
    # ids are forgotten when an hour closes: an id is remembered for at least the window
    fleet, steps = fold([configured(0), tick(10, eid="t1"), tick(50), tick(200), tick(10, eid="t1")], cfg)
    assert steps[-1].duplicate  # t=200 is past the window but no hour has closed yet
    fleet, steps = fold([configured(0), tick(10, eid="t1"), tick(3700), tick(10, eid="t1")], cfg)
    # the hour closed at t=3600; by t=3700 the id t1 (seen at 10) is outside the 100 s window, and so is the
    # re-send's own time: it cannot be told from a new event, so it is too_late (not applied, not remembered)
    assert steps[-1].rejection.code == RC.too_late and steps[-1].journal == []
    assert not [k for k in fleet.pools[POOL].dedup if k.endswith("\x1ft1")]  # (ids are kept per origin)
    fleet, steps = fold([configured(0), tick(10, eid="t1"), tick(100), tick(10, eid="t1")], cfg)
    assert steps[-1].duplicate  # still inside the window


# =========================================================================================================
# journal scenarios
# =========================================================================================================

def run(events, close_at=None):
    """Fold; return (state, steps, books, runs) with books = {(hour, account, team): amount} summed over all
    steps plus a final close of the books (at the pool clock, or advanced to `close_at`)."""
    fleet, steps = fold(events)
    state = fleet.pools[POOL]
    journal = [r for s in steps for r in s.journal]
    runs = [r for s in steps for r in s.job_runs]
    j, r = close_books(state, None if close_at is None else T0 + close_at)
    check_invariants(state)
    journal += j
    runs += r
    assert all(isinstance(row, JournalRow) and row.pool == POOL for row in journal)
    books = {}
    for row in journal:
        assert row.hour % H == 0 and row.amount_mchip_s > 0
        assert (row.team is None) == (row.account in (CAPACITY, UNAVAILABLE, IDLE, OVERCOMMITTED))
        key = (row.hour, row.account, row.team)
        books[key] = books.get(key, 0) + row.amount_mchip_s
    for hour in {k[0] for k in books}:  # conservation, per hour
        lhs = books.get((hour, CAPACITY, None), 0) + books.get((hour, OVERCOMMITTED, None), 0)
        rhs = books.get((hour, UNAVAILABLE, None), 0) + books.get((hour, IDLE, None), 0) + sum(
            v for (h, a, t), v in books.items() if h == hour and a in (IN_QUOTA, BORROWED, "burst"))
        assert lhs == rhs, (hour, lhs, rhs)
    return state, steps, books, runs


def hour_rows(books, hour):
    return {(a, t): v for (h, a, t), v in books.items() if h == hour}


def test_two_chip_pool_one_chip_quota_two_chip_job_across_an_hour():
    state, steps, books, runs = run([
        configured(0), chip("c1"), chip("c2"), grant("g", "ads", 1), submit("j", "ads", 2),
        start("j", 1800),
        finish("j", "succeeded", H + 900),
        tick(2 * H),
    ])
    # H0: capacity 2 chips × 3600 s = 7_200_000. Idle 2000 × 1800 (before the start) = 3_600_000.
    #     The job uses 2000 from 1800 to 3600; nominal 1000 → in_quota 1000 × 1800, borrowed 1000 × 1800.
    #     entitled 1000 × 3600. Check: 7.2M = 3.6M + 1.8M + 1.8M.
    #     The job waits 0..1800: pending 2000 × 1800 = 3_600_000 (demand, outside the conservation identity).
    assert hour_rows(books, H0) == {
        (CAPACITY, None): 7_200_000, (IDLE, None): 3_600_000,
        (IN_QUOTA, "ads"): 1_800_000, (BORROWED, "ads"): 1_800_000, (ENTITLED, "ads"): 3_600_000,
        (PENDING, "ads"): 3_600_000,
    }
    # H1: the job runs 900 s more: in_quota 1000 × 900, borrowed 1000 × 900; idle 2000 × 2700 = 5_400_000.
    assert hour_rows(books, H1) == {
        (CAPACITY, None): 7_200_000, (IDLE, None): 5_400_000,
        (IN_QUOTA, "ads"): 900_000, (BORROWED, "ads"): 900_000, (ENTITLED, "ads"): 3_600_000,
    }
    assert not hour_rows(books, H2)  # closed exactly at H2: nothing accrued yet
    # H0 is posted by the first event past the hour (the finish), H1 by the tick at H2
    finish_step, tick_step = steps[-2], steps[-1]
    by_account = lambda r: (r.account, r.team or "")
    assert sorted(finish_step.journal, key=by_account) == sorted(
        (JournalRow(POOL, H0, a, t, v) for (a, t), v in hour_rows(books, H0).items()), key=by_account)
    assert sorted(tick_step.journal, key=by_account) == sorted(
        (JournalRow(POOL, H1, a, t, v) for (a, t), v in hour_rows(books, H1).items()), key=by_account)
    # one run: 2000 × (1800 + 900) = 5_400_000 allocated, nothing lost
    assert runs == [finish_step.job_runs[0]]
    r = runs[0]
    assert (r.job_id, r.team, r.run_index, r.chips_milli) == ("j", "ads", 1, 2000)
    assert (r.submitted_at, r.started_at, r.ended_at, r.end_reason) == (T0, T0 + 1800, T0 + H + 900, "succeeded")
    assert (r.allocated_mchip_s, r.lost_mchip_s, r.posted_at) == (5_400_000, 0, T0 + H + 900)
    assert "j" not in state.jobs and state.teams["ads"].running == 0 and state.teams["ads"].use_milli == 0


def test_chip_down_under_a_running_job_is_not_charged():
    state, steps, books, runs = run([
        configured(0), chip("c1"), chip("c2"), grant("g", "ads", 2),
        submit("j", "ads", 2), start("j", 0, ["c1", "c2"]),
        chip_state("c2", "down", 600),
        chip_state("c2", "healthy", 1200),
        finish("j", "succeeded", 1800),
        tick(H),
    ])
    # capacity 7_200_000; unavailable 1000 × 600 (c2 down 600..1200) = 600_000.
    # in_quota: 2000 × 600 + 1000 × 600 + 2000 × 600 = 3_000_000 (never the down chip).
    # idle: 2000 × 1800 after the finish = 3_600_000. Check: 0.6M + 3.6M + 3.0M = 7.2M.
    assert hour_rows(books, H0) == {
        (CAPACITY, None): 7_200_000, (UNAVAILABLE, None): 600_000, (IDLE, None): 3_600_000,
        (IN_QUOTA, "ads"): 3_000_000, (ENTITLED, "ads"): 7_200_000,
    }
    assert [(r.allocated_mchip_s, r.lost_mchip_s) for r in runs] == [(3_000_000, 0)]


def test_chip_down_rates_while_it_is_down():
    fleet, _ = fold([configured(0), chip("c1"), chip("c2"), grant("g", "ads", 2), submit("j", "ads", 2),
                     start("j", 0, ["c1", "c2"]), chip_state("c2", "maintenance", 600)])
    s = fleet.pools[POOL]
    rate = s.books.rate
    assert (rate(CAPACITY), rate(UNAVAILABLE), rate(IDLE), rate(IN_QUOTA, "ads")) == (2000, 1000, 0, 1000)
    assert s.jobs["j"].charged_milli == 1000 and s.teams["ads"].use_milli == 1000
    # degraded chips are still available (and charged)
    fleet.apply(chip_state("c2", "degraded", 700))
    assert (rate(UNAVAILABLE), rate(IN_QUOTA, "ads")) == (0, 2000)


def test_overcommit():
    state, steps, books, runs = run([
        configured(0), chip("c1"), chip("c2"), grant("g", "ads", 1),
        submit("j1", "ads", 2), start("j1", 0),
        submit("j2", "search", 1, 600), start("j2", 600),
        finish("j1", "succeeded", 1200),
        tick(H),
    ])
    # 600..1200: 3 chips charged on 2 available → overcommitted 1000 × 600 = 600_000.
    # ads: use 2000 for 0..1200, nominal 1000 → in_quota 1_200_000, borrowed 1_200_000; entitled 3_600_000.
    # search (no quota): 1000 × 3000 (600..3600) borrowed = 3_000_000.
    # idle: 1000 × 2400 (1200..3600) = 2_400_000.
    # Check: capacity 7.2M + overcommitted 0.6M = idle 2.4M + ads 2.4M + search 3.0M = 7.8M.
    assert hour_rows(books, H0) == {
        (CAPACITY, None): 7_200_000, (OVERCOMMITTED, None): 600_000, (IDLE, None): 2_400_000,
        (IN_QUOTA, "ads"): 1_200_000, (BORROWED, "ads"): 1_200_000, (ENTITLED, "ads"): 3_600_000,
        (BORROWED, "search"): 3_000_000,
    }
    # j2 still runs: the close of the books posts its allocation so far (1000 × 3000), ended_at None
    j2 = [r for r in runs if r.job_id == "j2"]
    assert len(j2) == 1
    assert (j2[0].ended_at, j2[0].end_reason, j2[0].allocated_mchip_s, j2[0].posted_at) == (
        None, None, 3_000_000, T0 + H)
    assert [r.allocated_mchip_s for r in runs if r.job_id == "j1"] == [2_400_000]


def test_overcommit_rates_and_back():
    fleet, _ = fold([configured(0), chip("c1"), submit("j1", "ads", 3), start("j1", 0)])
    rate = fleet.pools[POOL].books.rate
    assert (rate(CAPACITY), rate(IDLE), rate(OVERCOMMITTED), rate(BORROWED, "ads")) == (1000, 0, 2000, 3000)
    fleet.apply(chip("c2", 10))
    fleet.apply(chip("c3", 10))
    fleet.apply(chip("c4", 10))
    assert (rate(CAPACITY), rate(IDLE), rate(OVERCOMMITTED)) == (4000, 1000, 0)


def test_grant_window_inside_an_hour():
    events = [
        configured(0), chip("c1"), chip("c2"),
        submit("j", "ads", 2), start("j", 0),
        grant("g", "ads", 1, 0, effective_from=900, effective_until=2700),
        tick(H),
    ]
    state, steps, books, runs = run(events)
    # the job uses 2000 all hour. Quota 1000 only in [900, 2700):
    # in_quota = 1000 × 1800 = 1_800_000; borrowed = 2000 × 900 + 1000 × 1800 + 2000 × 900 = 5_400_000;
    # entitled = 1000 × 1800 = 1_800_000. Check: 1.8M + 5.4M = 7.2M = capacity (idle 0).
    assert hour_rows(books, H0) == {
        (CAPACITY, None): 7_200_000, (IN_QUOTA, "ads"): 1_800_000, (BORROWED, "ads"): 5_400_000,
        (ENTITLED, "ads"): 1_800_000,
    }
    assert state.grants == {} and state.teams["ads"].nominal_milli == 0 and state.boundaries == []

    # the split changes exactly at those instants: close the books of a copy at instants around them
    fleet, _ = fold(events[:-1])
    base = fleet.pools[POOL]

    def in_quota_until(offset):
        s = base.copy()
        journal, _ = close_books(s, T0 + offset)
        check_invariants(s)
        return sum(r.amount_mchip_s for r in journal if r.account == IN_QUOTA)

    assert in_quota_until(900) == 0
    assert in_quota_until(901) == 1000
    assert in_quota_until(2700) == 1000 * 1800
    assert in_quota_until(2701) == 1000 * 1800


def test_grant_window_across_hours_and_hour_boundary_instants():
    # a grant from exactly H1 to exactly H2 on an idle pool: entitled only in H1
    state, steps, books, runs = run([
        configured(0), chip("c1"), grant("g", "ads", 0.25, 0, effective_from=H, effective_until=2 * H),
        tick(3 * H),
    ])
    assert (H0, ENTITLED, "ads") not in books and (H2, ENTITLED, "ads") not in books
    assert books[(H1, ENTITLED, "ads")] == 250 * 3600
    assert books[(H2, IDLE, None)] == 1000 * 3600


def test_quota_revoked_mid_hour():
    state, steps, books, runs = run([
        configured(0), chip("c1"), chip("c2"), grant("g", "ads", 2),
        submit("j", "ads", 1), start("j", 0),
        revoke("g", 1200),
        tick(H),
    ])
    # use 1000 all hour; nominal 2000 until 1200, then 0.
    # in_quota 1000 × 1200 = 1_200_000; borrowed 1000 × 2400 = 2_400_000; entitled 2000 × 1200 = 2_400_000.
    # idle 1000 × 3600 = 3_600_000. Check: 3.6M + 1.2M + 2.4M = 7.2M.
    assert hour_rows(books, H0) == {
        (CAPACITY, None): 7_200_000, (IDLE, None): 3_600_000,
        (IN_QUOTA, "ads"): 1_200_000, (BORROWED, "ads"): 2_400_000, (ENTITLED, "ads"): 2_400_000,
    }


def test_amended_grant_takes_the_new_amount_from_the_amendment():
    state, steps, books, runs = run([
        configured(0), chip("c1"), grant("g", "ads", 1), grant("g", "ads", 0.5, 1800), tick(H),
    ])
    # entitled 1000 × 1800 + 500 × 1800 = 2_700_000
    assert books[(H0, ENTITLED, "ads")] == 2_700_000
    assert state.teams["ads"].nominal_milli == 500


def test_revoked_then_regranted_id_is_not_ended_by_the_old_window():
    # bug fixed: versions were per grant id, so the re-grant (version 0 again) matched the old grant_off
    state, steps, books, runs = run([
        configured(0), chip("c1"), grant("g", "ads", 1, 0, effective_until=1800),
        revoke("g", 600), grant("g", "ads", 1, 1200),
        tick(2 * H),
    ])
    # entitled: 1000 × 600 (0..600) + 1000 × 2400 (1200..3600) in H0, and all of H1
    assert books[(H0, ENTITLED, "ads")] == 3_000_000
    assert books[(H1, ENTITLED, "ads")] == 3_600_000
    assert state.teams["ads"].nominal_milli == 1000 and "g" in state.grants


def test_amendment_already_over_drops_the_pending_grant():
    # bug fixed: the amendment returned early and left the old grant (and its pending start) in place
    state, steps, books, runs = run([
        configured(0), chip("c1"), grant("g", "ads", 1, 0, effective_from=1800),
        tick(600), grant("g", "ads", 1, 900, effective_until=300),
        tick(H),
    ])
    assert (H0, ENTITLED, "ads") not in books
    assert state.grants == {} and state.teams["ads"].nominal_milli == 0


def test_late_event_is_applied_at_the_clock():
    state, steps, books, runs = run([
        configured(0), chip("c1"), grant("g", "ads", 1), submit("j", "ads", 1),
        tick(1000),
        start("j", 400),                 # 600 s late
        tick(1500),
        checkpoint("j", 1450),           # 50 s late: the maximum stays 600
        finish("j", "failed", 2000),
        tick(H),
    ])
    late_start, late_ckpt = steps[5], steps[7]
    assert (late_start.applied_at, late_start.lateness_s) == (T0 + 1000, 600)
    assert (late_ckpt.applied_at, late_ckpt.lateness_s) == (T0 + 1500, 50)
    assert steps[4].lateness_s == 0
    assert (state.late_events, state.max_lateness_s) == (2, 600)
    # use 1000 from 1000 (the clock) to 2000: in_quota 1_000_000; idle 1000 × 2600 = 2_600_000;
    # pending 1000 × 1000 (it waits until the start is applied, at the clock)
    assert hour_rows(books, H0) == {
        (CAPACITY, None): 3_600_000, (IDLE, None): 2_600_000, (IN_QUOTA, "ads"): 1_000_000,
        (ENTITLED, "ads"): 3_600_000, (PENDING, "ads"): 1_000_000,
    }
    # the run starts at the clock; failed → lost since the checkpoint at 1500: 1000 × 500
    (r,) = runs
    assert (r.started_at, r.ended_at, r.end_reason) == (T0 + 1000, T0 + 2000, "failed")
    assert (r.allocated_mchip_s, r.lost_mchip_s) == (1_000_000, 500_000)


def test_late_event_does_not_reopen_a_closed_hour():
    state, steps, books, runs = run([
        configured(0), chip("c1"), submit("j", "ads", 1), tick(H + 100),
        start("j", 1000),  # in H0 by its own time, but H0 is closed: applied at H1+100
        tick(2 * H),
    ])
    assert (H0, BORROWED, "ads") not in books
    assert books[(H1, BORROWED, "ads")] == 1000 * 3500
    assert steps[4].lateness_s == H + 100 - 1000


def test_fractional_chips_share_one_chip():
    state, steps, books, runs = run([
        configured(0), chip("c1"), grant("g", "ads", 0.5),
        submit("ja", "ads", 0.5), submit("jb", "search", 0.5),
        start("ja", 0, ["c1"]),
        start("jb", 1200, ["c1"]),
        chip_state("c1", "down", 2400),
        finish("ja", "succeeded", 3000), preempt("jb", 3000),
        tick(H),
    ])
    # ads: 500 × 2400 in quota = 1_200_000; entitled 500 × 3600 = 1_800_000.
    # search: 500 × 1200 (1200..2400) borrowed = 600_000.
    # idle: 500 × 1200 (0..1200, half the chip) = 600_000; unavailable: 1000 × 1200 (2400..3600) = 1_200_000.
    # Check: 1.2M + 0.6M + 1.2M + 0.6M = 3.6M = capacity.
    # search waits 0..1200 and again from its preemption at 3000: pending 500 × (1200 + 600) = 900_000.
    assert hour_rows(books, H0) == {
        (CAPACITY, None): 3_600_000, (UNAVAILABLE, None): 1_200_000, (IDLE, None): 600_000,
        (IN_QUOTA, "ads"): 1_200_000, (ENTITLED, "ads"): 1_800_000, (BORROWED, "search"): 600_000,
        (PENDING, "search"): 900_000,
    }
    by_job = {r.job_id: r for r in runs}
    assert (by_job["ja"].allocated_mchip_s, by_job["ja"].lost_mchip_s, by_job["ja"].chips_milli) == (1_200_000, 0, 500)
    # preempted with no checkpoint: everything since the start is lost (only what was charged: the chip was down)
    assert (by_job["jb"].allocated_mchip_s, by_job["jb"].lost_mchip_s, by_job["jb"].end_reason) == (
        600_000, 600_000, "preempted")
    assert state.chips["c1"].jobs == {}


def test_fractional_placement_splits_shares_over_chips():
    fleet, _ = fold([configured(0), chip("c1"), chip("c2"), chip("c3"), submit("j", "ads", 2),
                     start("j", 0, ["c1", "c2", "c3"])])
    s = fleet.pools[POOL]
    # 2000 milli over 3 chips: 667 + 667 + 666
    assert s.jobs["j"].placement == {"c1": 667, "c2": 667, "c3": 666}
    assert [s.chips[c].jobs for c in ("c1", "c2", "c3")] == [{"j": 667}, {"j": 667}, {"j": 666}]
    fleet.apply(chip_state("c3", "down", 10))
    assert s.jobs["j"].charged_milli == 1334 and s.books.rate(UNAVAILABLE) == 1000


def test_checkpoint_then_preemption_then_failure():
    state, steps, books, runs = run([
        configured(0), chip("c1"), chip("c2"), chip("c3"), chip("c4"), grant("g", "ads", 4),
        submit("j", "ads", 4), start("j", 100),
        checkpoint("j", 1000),
        preempt("j", 1600, decision_id="d1"),
        start("j", 2000),
        finish("j", "failed", 2500),
        tick(H),
    ])
    run1, run2 = runs
    # run 1: 4000 × 1500 allocated = 6_000_000; lost since the checkpoint: 4000 × 600 = 2_400_000
    assert (run1.run_index, run1.started_at, run1.ended_at, run1.end_reason) == (1, T0 + 100, T0 + 1600, "preempted")
    assert (run1.allocated_mchip_s, run1.lost_mchip_s) == (6_000_000, 2_400_000)
    # run 2 has no checkpoint of its own: lost since its start, 4000 × 500 = 2_000_000 (all of it)
    assert (run2.run_index, run2.started_at, run2.ended_at, run2.end_reason) == (2, T0 + 2000, T0 + 2500, "failed")
    assert (run2.allocated_mchip_s, run2.lost_mchip_s) == (2_000_000, 2_000_000)
    assert run1.submitted_at == run2.submitted_at == T0
    # in_quota 4000 × (1500 + 500) = 8_000_000; idle 4000 × 3600 − 8M = 6_400_000;
    # pending 4000 × (100 before the start + 400 between the preemption and the restart) = 2_000_000
    assert hour_rows(books, H0) == {
        (CAPACITY, None): 14_400_000, (IDLE, None): 6_400_000, (IN_QUOTA, "ads"): 8_000_000,
        (ENTITLED, "ads"): 14_400_000, (PENDING, "ads"): 2_000_000,
    }


def test_preemption_bookkeeping_on_the_job():
    fleet, steps = fold([configured(0), chip("c1"), submit("j", "ads", 1), start("j", 10), preempt("j", 20)])
    s = fleet.pools[POOL]
    j = s.jobs["j"]
    assert (j.status, j.preemptions, j.run_index, j.first_started_at) == ("pending", 1, 1, T0 + 10)
    assert (s.teams["ads"].pending, s.teams["ads"].running) == (1, 0)
    fleet.apply(start("j", 30))
    assert (j.status, j.run_index, j.first_started_at, j.run_started_at) == ("running", 2, T0 + 10, T0 + 30)


def test_two_checkpoints_and_a_close_of_the_books_between():
    fleet, steps = fold([configured(0), chip("c1"), submit("j", "ads", 1), start("j", 0), checkpoint("j", 100),
                         checkpoint("j", 300)])
    s = fleet.pools[POOL]
    _, partial = close_books(s, T0 + 400)   # posts 1000 × 400 so far, ended_at None
    assert [(r.allocated_mchip_s, r.ended_at) for r in partial] == [(400_000, None)]
    step = fleet.apply(preempt("j", 1000))
    # the rest: 1000 × 600; lost since the checkpoint at 300: 1000 × 700 (spans the close of the books)
    assert [(r.allocated_mchip_s, r.lost_mchip_s, r.end_reason) for r in step.job_runs] == [
        (600_000, 700_000, "preempted")]
    # the goodput counters (/metrics) count the whole run as it ends: allocated never below lost
    assert s.run_counts == {"ads": [1_000_000, 700_000]}


def test_failed_job_loses_since_start_and_succeeded_loses_nothing():
    _, _, _, runs = run([configured(0), chip("c1"), chip("c2"), submit("a", "t", 1), submit("b", "t", 1),
                         start("a", 0), start("b", 0), finish("a", "failed", 700), finish("b", "succeeded", 700)])
    assert sorted((r.job_id, r.allocated_mchip_s, r.lost_mchip_s) for r in runs) == [
        ("a", 700_000, 700_000), ("b", 700_000, 0)]


def test_cancelled_pending_job_has_no_run_row():
    state, steps, books, runs = run([
        configured(0), chip("c1"), grant("g", "ads", 1), submit("j", "ads", 1, 10), finish("j", "cancelled", 20),
        tick(H),
    ])
    assert runs == [] and steps[-2].job_runs == []
    assert "j" not in state.jobs
    assert (state.teams["ads"].pending, state.teams["ads"].running) == (0, 0)
    # it waited 10..20: pending 1000 × 10
    assert hour_rows(books, H0) == {(CAPACITY, None): 3_600_000, (IDLE, None): 3_600_000,
                                    (ENTITLED, "ads"): 3_600_000, (PENDING, "ads"): 10_000}


def test_cancelled_running_job_loses_nothing():
    _, steps, _, runs = run([configured(0), chip("c1"), submit("j", "ads", 1), start("j", 0),
                             finish("j", "cancelled", 50)])
    assert [(r.end_reason, r.allocated_mchip_s, r.lost_mchip_s) for r in runs] == [("cancelled", 50_000, 0)]


def test_chip_retired_under_a_running_job():
    state, steps, books, runs = run([
        configured(0), chip("c1"), chip("c2"), grant("g", "ads", 2),
        submit("j", "ads", 2), start("j", 0, ["c1", "c2"]),
        retire("c2", 1200),
        finish("j", "succeeded", 2400),
        tick(H),
    ])
    # capacity: 2000 × 1200 + 1000 × 2400 = 4_800_000.
    # in_quota: 2000 × 1200 + 1000 × 1200 = 3_600_000 (the retired chip is charged to nobody).
    # idle: 1000 × 1200 (2400..3600) = 1_200_000. Check: 3.6M + 1.2M = 4.8M.
    # entitled 2000 × 3600 = 7_200_000 (more than the capacity: quotas may be oversubscribed).
    assert hour_rows(books, H0) == {
        (CAPACITY, None): 4_800_000, (IDLE, None): 1_200_000, (IN_QUOTA, "ads"): 3_600_000,
        (ENTITLED, "ads"): 7_200_000,
    }
    assert [r.allocated_mchip_s for r in runs] == [3_600_000]
    assert set(state.chips) == {"c1"} and state.chips["c1"].jobs == {}


def test_down_chip_retired_under_a_running_job_then_id_reused():
    fleet, steps = fold([
        configured(0), chip("c1"), chip("c2"), submit("j", "ads", 2), start("j", 0, ["c1", "c2"]),
        chip_state("c2", "down", 100), retire("c2", 200), chip("c2", 300),
        chip_state("c2", "down", 400),   # the new c2 holds nothing of j
        chip_state("c2", "healthy", 500),
    ])
    s = fleet.pools[POOL]
    rate = s.books.rate
    assert s.jobs["j"].charged_milli == 1000
    assert (rate(CAPACITY), rate(UNAVAILABLE), rate(IDLE), rate(BORROWED, "ads")) == (2000, 0, 1000, 1000)
    step = fleet.apply(finish("j", "succeeded", 600))
    # 2000 × 100 + 1000 × 500
    assert [r.allocated_mchip_s for r in step.job_runs] == [700_000]


def test_job_without_placement_is_not_touched_by_chip_state():
    fleet, _ = fold([configured(0), chip("c1"), submit("j", "ads", 1), start("j", 0), chip_state("c1", "down", 10)])
    rate = fleet.pools[POOL].books.rate
    # the cluster did not say where the job runs, so it stays charged; the pool shows the anomaly
    assert (rate(UNAVAILABLE), rate(BORROWED, "ads"), rate(OVERCOMMITTED)) == (1000, 1000, 1000)


def test_denied_burst_request_changes_no_account():
    # the only chip is busy and there is no history: the forecast demand is the demand now (1 chip) -> no idle
    fleet, steps = fold([configured(0), chip("c1"), submit("j", "ads", 1), start("j", 0), burst("b", "ads", 1, 10)])
    assert steps[-1].journal == []
    [row] = steps[-1].decisions
    d = decision_of(row)
    assert (d.type, d.verdict, d.chips_granted, d.numbers["forecast_idle_chips"]) == ("decision.burst", "denied", 0, 0)
    assert fleet.pools[POOL].teams["ads"].burst_milli == 0


def test_hours_with_no_event_are_closed_by_a_tick():
    state, steps, books, runs = run([configured(0), chip("c1"), submit("j", "ads", 1), start("j", 1800),
                                     tick(3 * H + 60)])
    assert {h for h, _, _ in books} == {H0, H1, H2, T0 + 3 * H}
    assert [books[(h, BORROWED, "ads")] for h in (H0, H1, H2, T0 + 3 * H)] == [
        1_800_000, 3_600_000, 3_600_000, 60_000]
    tick_hours = sorted({r.hour for r in steps[-1].journal})
    assert tick_hours == [H0, H1, H2]  # the open hour is only posted by the close of the books


def test_close_of_the_books_mid_hour_posts_deltas():
    events = [configured(0), chip("c1"), chip("c2"), grant("g", "ads", 1), submit("j", "ads", 2), start("j", 600),
              finish("j", "succeeded", 3000), tick(H)]
    _, _, once, runs_once = run(events)
    fleet = Fleet(CFG)
    journal, runs = [], []
    for i, e in enumerate(events):
        s = fleet.apply(e)
        journal += s.journal
        runs += s.job_runs
        j, r = close_books(fleet.pools[POOL])  # close after every event
        journal += j
        runs += r
    j, r = close_books(fleet.pools[POOL])
    journal += j
    runs += r
    sums = {}
    for row in journal:
        sums[(row.hour, row.account, row.team)] = sums.get((row.hour, row.account, row.team), 0) + row.amount_mchip_s
    assert sums == once
    assert sum(r.allocated_mchip_s for r in runs) == sum(r.allocated_mchip_s for r in runs_once) == 2000 * 2400


def test_close_books_until_advances_the_clock():
    fleet, _ = fold([configured(0), chip("c1")])
    s = fleet.pools[POOL]
    journal, runs = close_books(s, T0 + H + 10)
    assert s.clock == T0 + H + 10 and s.books.open_hour == H1
    assert sorted((r.hour, r.account, r.amount_mchip_s) for r in journal) == [
        (H0, CAPACITY, 3_600_000), (H0, IDLE, 3_600_000), (H1, CAPACITY, 10_000), (H1, IDLE, 10_000)]
    # a close in the past of the clock changes nothing
    assert close_books(s, T0) == ([], [])


def test_first_event_mid_hour_opens_that_hour():
    fleet, _ = fold([configured(1234)])
    s = fleet.pools[POOL]
    assert (s.clock, s.books.open_hour) == (T0 + 1234, hour_of(T0 + 1234)) == (T0 + 1234, H0)


def test_two_pools_are_independent():
    other = "eu-west4-b/tpu"
    fleet, steps = fold([configured(0), ev("pool.configured", 0, pool=other, flavor="tpu", chips_per_node=4),
                         chip("c1"), ev("chip.registered", 0, pool=other, chip_id="c1", node="n"),
                         submit("j", "ads", 1), start("j", 0),
                         ev("job.finished", 10, pool=other, job_id="j", outcome="succeeded"),
                         tick(100), ev("pool.tick", 100, pool=other)])
    assert steps[-3].rejection.code == RC.unknown_job
    assert fleet.pools[POOL].jobs["j"].status == "running"
    journal, runs = fleet.close()
    assert [(r.pool, r.allocated_mchip_s) for r in runs] == [(POOL, 100_000)]
    assert {r.pool for r in journal} == {other, POOL}


@pytest.mark.parametrize("use, nominal, burst, expected", [
    (0, 0, 0, (0, 0, 0)), (500, 1000, 0, (500, 0, 0)), (1000, 1000, 0, (1000, 0, 0)),
    (2500, 1000, 0, (1000, 1500, 0)), (2500, 1000, 1000, (1000, 500, 1000)), (2500, 1000, 2000, (1000, 0, 1500)),
    (500, 0, 1000, (0, 0, 500)), (0, 1000, 1000, (0, 0, 0)),
])
def test_split_use(use, nominal, burst, expected):
    assert split_use(use, nominal, burst) == expected
    assert sum(expected) == use


def test_state_round_trips_through_dict():
    import json
    fleet, _ = fold(BASE() + [submit("j", "ads", 1.5, 5), start("j", 6, ["c1", "c2"]),
                              grant("g2", "b", 1, 7, effective_from=100, effective_until=5000), tick(3 * H, eid="t")])
    s = fleet.pools[POOL]
    d = s.to_dict()
    again = PoolState.from_dict(json.loads(json.dumps(d)))
    assert again.to_dict() == d
    check_invariants(again)
    assert without_counters(s.copy().to_dict()) == without_counters(d)
