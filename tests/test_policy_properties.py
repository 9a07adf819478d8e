"""Property tests of the policy layer (hypothesis): random pools, quotas (with borrowing and lending limits),
jobs (priorities, non-preemptible ones, checkpoints) and a small cluster that starts jobs when chips are free
and follows the ledger's preemption decisions some of the time.

Properties: a victim is never protected (non-preemptible, younger than min_runtime_s, preempted
max_preemptions times within the window) nor named by another decision in flight; a decision frees at least
what it needs and less than that plus its largest victim; reclaim victims belong to other, borrowing teams and
priority victims to the beneficiary's team with a lower priority; conservation holds after every event; the
same log gives the same decisions, also when the fold is split and its state carried through JSON; under a
steady load (no new jobs) the decisions stop, and no job is ever taken from for a job that was taken from for
it (no cycle).
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timezone

from hypothesis import example, HealthCheck, event, given, settings
from hypothesis import strategies as st
import pytest

from ledger import FoldConfig, Fleet, PoolState, check_invariants
from ledger.policy import decision_of
from schemas import Rejection, parse_payload

T0 = 1_793_606_400
POOL = "p/h100"
CFG = FoldConfig(check_invariants=True, preemption_grace_s=30, min_runtime_s=120, max_preemptions=2,
                 preemption_window_s=1800, decision_timeout_s=300)
# each property runs with the victim classes of fair_share_tolerance 0 (strict F order), 0.1 (the default) and 1
# (every borrowing team in one class): 60 examples each
TOLERANCES = pytest.mark.parametrize("tol", [0.0, 0.1, 1.0])
SETTINGS = dict(deadline=None, max_examples=60,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def iso(t: int) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


class Cluster:
    """Folds what it does into a fleet; starts pending jobs when chips are free; follows decisions when told."""

    def __init__(self, chips: int, config: FoldConfig = CFG):
        self.fleet = Fleet(config)
        self.seq = 0
        self.t = T0
        self.log: list[dict] = []
        self.decisions: list = []
        self.capacity = chips
        self.send("pool.configured", flavor="h100", chips_per_node=4)
        for i in range(chips):
            self.send("chip.registered", chip_id=f"c{i}", node=f"n{i // 4}")

    @property
    def state(self) -> PoolState:
        return self.fleet.pools[POOL]

    def send(self, etype: str, **fields):
        self.seq += 1
        d = {"event_id": f"x{self.seq}", "type": etype, "occurred_at": iso(self.t), "pool": POOL,
             "source": "prop", **fields}
        self.log.append(d)
        e = parse_payload(d)
        assert not isinstance(e, Rejection), (d, e)
        before = self.fleet.pools.get(POOL)
        step = self.fleet.apply(e)
        assert step.rejection is None, (d, step.rejection)
        check_invariants(self.state)
        for row in step.decisions:
            dec = decision_of(row)
            if dec.type == "decision.preempt":
                check_decision(self.state, dec, self.t)
                self.decisions.append(dec)
        return step

    def free(self) -> int:
        return self.capacity * 1000 - self.state.charged_milli

    def start_what_fits(self):
        for job in sorted((j for j in self.state.jobs.values() if j.status == "pending"),
                          key=lambda j: (-j.priority, j.waiting_since, j.job_id)):
            if job.chips_milli <= self.free():
                self.send("job.started", job_id=job.job_id)

    def follow(self, dec):
        """Preempt the victims, then start the beneficiary on the chips they freed (what the advice is for)."""
        for v in dec.victims:
            j = self.state.jobs.get(v.job_id)
            if j is not None and j.status == "running":
                self.send("job.preempted", job_id=v.job_id, decision_id=dec.decision_id)
        ben = self.state.jobs.get(dec.beneficiary.job_id)
        if ben is not None and ben.status == "pending" and ben.chips_milli <= self.free():
            self.send("job.started", job_id=ben.job_id)


def check_decision(state: PoolState, d, t: int) -> None:
    need = round(d.numbers["need_chips"] * 1000)
    freed = round(d.numbers["freed_chips"] * 1000)
    sizes = [round(v.chips * 1000) for v in d.victims]
    assert sizes and freed == sum(sizes) >= need, d
    assert freed - need < min(sizes), ("freed more than needed beyond one job", d)
    assert len({v.job_id for v in d.victims}) == len(d.victims)
    ben = state.jobs[d.beneficiary.job_id]
    assert ben.status == "pending"
    for v in d.victims:
        job = state.jobs[v.job_id]
        assert job.status == "running" and job.preemptible, ("protected victim", v)
        assert t - job.run_started_at >= CFG.min_runtime_s, ("victim younger than min_runtime", v)
        recent = [p for p in job.preempted_at if p > t - CFG.preemption_window_s]
        assert len(recent) < CFG.max_preemptions, ("victim preempted too often", v)
        assert state.marked[v.job_id] == ben.job_id  # named by this decision only
        if d.rule == "reclaim":
            assert job.team != ben.team
        else:
            assert job.team == ben.team and job.priority < ben.priority


@st.composite
def workloads(draw):
    chips = draw(st.integers(4, 10))
    teams = draw(st.lists(st.sampled_from(["ads", "org/search", "org/vision", "speech"]), min_size=2,
                          max_size=4, unique=True))
    grants = []
    for team in teams:
        q = draw(st.integers(1, max(1, chips // 2)))
        g = {"chips": q}
        if draw(st.booleans()):
            g["borrowing_limit"] = draw(st.integers(0, chips))
        if draw(st.booleans()):
            g["lending_limit"] = draw(st.integers(0, q))
        grants.append((team, g))
    actions = draw(st.lists(st.tuples(
        st.sampled_from(["submit", "submit", "submit", "tick", "tick", "finish", "checkpoint", "follow", "start"]),
        st.sampled_from(teams), st.sampled_from([1, 1, 2, 3, 4]), st.integers(0, 3), st.booleans(),
        st.integers(30, 600)), min_size=10, max_size=60))
    return chips, grants, actions


def run_workload(chips, grants, actions, config=CFG) -> Cluster:
    c = Cluster(chips, config)
    for team, g in grants:
        c.send("quota.granted", grant_id=f"g-{team}", team=team, **g)
    n = 0
    for kind, team, size, prio, flag, dt in actions:
        c.t += dt
        if kind == "submit":
            n += 1
            c.send("job.submitted", job_id=f"j{n}", team=team, chips=size, priority=prio, preemptible=flag or prio < 3)
            if dt % 3:  # the cluster mostly starts what fits right away (so teams borrow idle chips)
                c.start_what_fits()
        elif kind == "start":
            c.start_what_fits()
        elif kind == "finish":
            running = sorted(j for j, job in c.state.jobs.items() if job.status == "running")
            if running:
                c.send("job.finished", job_id=running[(size + prio) % len(running)], outcome="succeeded")
        elif kind == "checkpoint":
            running = sorted(j for j, job in c.state.jobs.items() if job.status == "running")
            if running:
                c.send("job.checkpointed", job_id=running[prio % len(running)])
        elif kind == "follow":
            for d in [d for d in c.decisions if d.beneficiary.job_id in c.state.inflight]:
                c.follow(d)
            c.start_what_fits()
        else:
            c.send("pool.tick")
    return c


def _cfg(tol: float) -> FoldConfig:
    return dataclasses.replace(CFG, fair_share_tolerance=tol)


@TOLERANCES
@settings(**SETTINGS)
@given(w=workloads())
def test_decisions_respect_protections_and_free_no_more_than_needed(tol, w):
    c = run_workload(*w, config=_cfg(tol))  # the checks run on every decision as it is made
    event(f"preemption decisions: {min(len(c.decisions), 3)}{'+' if len(c.decisions) > 3 else ''}")
    event(f"priority decisions: {min(sum(d.rule == 'priority' for d in c.decisions), 1)}")


# found by CI: a job whose decisions had timed out unacted started while the only other policy state was the
# `blocked` memo, which a checkpoint does not carry; the fold settled its `ignored` count only when the memo
# was non-empty, so a fold restored from a checkpoint kept the count and the one folded straight through did not.
IGNORED_COUNT_AFTER_RESTORE = (
    4, [("ads", {"chips": 1}), ("org/search", {"chips": 1})],
    [("submit", "ads", 1, 0, False, 31)]
    + [("tick", "ads", 1, 0, False, 30)]
    + [("finish", "ads", 1, 0, False, 30)]
    + [("submit", "ads", 3, 0, False, 31)]
    + [("submit", "ads", 4, 1, False, 30)]
    + [("submit", "ads", 1, 0, False, 30)]
    + [("submit", "org/search", 1, 0, False, 30)]
    + [("submit", "ads", 1, 0, False, 30)] * 9
    + [("start", "ads", 1, 0, False, 30)]
    + [("finish", "ads", 1, 0, False, 30)]
    + [("submit", "ads", 1, 0, False, 30)]
    + [("submit", "org/search", 1, 0, False, 180)]
    + [("submit", "ads", 1, 0, False, 181)]
    + [("submit", "ads", 1, 0, False, 209)]
    + [("finish", "ads", 1, 0, False, 30)] * 4
    + [("tick", "ads", 1, 0, False, 30)]
    + [("finish", "ads", 1, 0, False, 30)]
    + [("follow", "ads", 1, 0, False, 30)],
)


@TOLERANCES
@settings(**SETTINGS)
@given(w=workloads(), cut=st.integers(0, 10_000))
@example(w=IGNORED_COUNT_AFTER_RESTORE, cut=30)
def test_same_log_same_decisions_also_split_through_json(tol, w, cut):
    cfg = _cfg(tol)
    c = run_workload(*w, config=cfg)
    rows = [d.model_dump() for d in c.decisions]
    log = [parse_payload(d) for d in c.log]
    again = Fleet(cfg)
    assert [decision_of(r).model_dump() for e in log for r in again.apply(e).decisions
            if r[1] == "decision.preempt"] == rows
    k = cut % (len(log) + 1)
    first = Fleet(cfg)
    out = [r for e in log[:k] for r in first.apply(e).decisions]
    second = Fleet.from_dict(json.loads(json.dumps(first.to_dict())), cfg)
    out += [r for e in log[k:] for r in second.apply(e).decisions]
    assert [decision_of(r).model_dump() for r in out if r[1] == "decision.preempt"] == rows
    assert second.to_dict() == again.to_dict()


# found by CI: two jobs of a team each fit its one unused chip, so each got a reclaim decision at the same instant;
# then the team borrowed, and the victims' team reclaimed from it (a cycle). A decision in flight now holds the
# quota of the job it makes room for.
TWO_CLAIMS_ON_ONE_CHIP = (6, [("ads", {"chips": 1}), ("org/search", {"chips": 2}), ("org/vision", {"chips": 1}),
                              ("speech", {"chips": 1})],
                          [("submit", "ads", 1, 0, False, 30)] * 15
                          + [("submit", "org/search", 2, 1, False, 30), ("submit", "org/search", 4, 1, False, 30),
                             ("submit", "ads", 3, 1, False, 30)])

# found by hypothesis (tolerance 0.1): ads borrows three chips; search's j7 and vision's jobs reclaim them; the
# cluster then starts search's j8 on the chip left over, in the same second as j7. When ads's j1 reclaims its quota
# from search, the victim must be j8, not j7 (first by job id), for which j1 was taken: j7 is protected from j1
STARTED_IN_ONE_SECOND = (4, [("ads", {"chips": 1}), ("org/search", {"chips": 1}), ("org/vision", {"chips": 2})],
                         [("submit", "ads", 1, 0, False, 30)] * 2 + [("submit", "ads", 2, 0, False, 30)] * 4
                         + [("submit", "org/search", 1, 0, False, 30)] * 2
                         + [("submit", "org/vision", 1, 0, False, 30)] * 2)
# also found (tolerance 0.1): search's j5 (priority 0) takes ads's j1; search then borrows for j7 (priority 1); when
# j1 reclaims, the lowest priority of search is j5, the job j1 was taken for: j5 is protected from j1 for a window
# (Job.displaced), and j1 takes j6
LOWEST_PRIORITY_DISPLACED_IT = (5, [("ads", {"chips": 1}), ("org/search", {"chips": 2})],
                                [("submit", "ads", 1, 0, False, 30), ("submit", "ads", 4, 0, False, 30),
                                 ("submit", "ads", 2, 0, False, 31)] + [("tick", "ads", 1, 0, False, 30)] * 4
                                + [("submit", "ads", 2, 0, False, 30), ("submit", "org/search", 1, 0, False, 30),
                                   ("submit", "org/search", 1, 1, False, 30), ("submit", "org/search", 3, 1, False, 30)])


@TOLERANCES
@settings(**SETTINGS)
@given(w=workloads())
@example(w=TWO_CLAIMS_ON_ONE_CHIP)
@example(w=STARTED_IN_ONE_SECOND)
@example(w=LOWEST_PRIORITY_DISPLACED_IT)
def test_steady_load_settles_without_cycles(tol, w):
    chips, grants, actions = w
    c = run_workload(chips, grants, [a for a in actions if a[0] == "submit"], config=_cfg(tol))
    # steady load: no new jobs, nothing finishes; the cluster follows every decision and starts what fits
    for _ in range(60):
        c.t += 200
        c.send("pool.tick")
        for d in [d for d in c.decisions if d.beneficiary.job_id in c.state.inflight]:
            c.follow(d)
        c.start_what_fits()
    event(f"steady: decisions {min(len(c.decisions), 2)}")
    late = [d for d in c.decisions if datetime.timestamp(d.at) > c.t - 20 * 200]
    assert late == [], f"still deciding after {60 * 200} s of steady load: {[d.message for d in late]}"
    taken_for = {(v.job_id, d.beneficiary.job_id) for d in c.decisions for v in d.victims}
    assert not any((b, v) in taken_for for v, b in taken_for), "a preemption cycle"
