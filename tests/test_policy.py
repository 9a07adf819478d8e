"""The policy layer (ledger/policy.py): scenario tests with exact, hand-computed decisions.

Times are offsets in seconds from T0 = 2026-11-02T08:00:00Z (a Monday, the start of a UTC hour). Chips are
given in chips; the core's numbers are milli-chips. The policy configuration of these tests (CFG) has a 60 s
grace, a 300 s minimum runtime, at most 2 preemptions in 3600 s and a 600 s decision timeout.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from ledger import FoldConfig, Fleet, check_invariants
from ledger.books import BORROWED, BURST, IN_QUOTA
from ledger.policy import (
    NOT_ON_WHOLE_NODES, NOTHING_TO_LEND, OVER_BORROWING_LIMIT, PREEMPTION_IN_FLIGHT, READY, WAITING_FOR_CHIPS,
    WAITING_GRACE, WOULD_BORROW, decision_of, fair_shares, hour_of_week, pending_reason,
)

# the events of these tests: in the pool POOL, at offsets from T0 (2026-11-02T08:00:00Z, a Monday)
from tests.test_evolve import POOL, T0, ev

H = 3600
CFG = FoldConfig(check_invariants=True, preemption_grace_s=60, min_runtime_s=300, max_preemptions=2,
                 preemption_window_s=3600, decision_timeout_s=600)


def pool(chips: int = 8, per_node: int = 4):
    out = [ev("pool.configured", 0, flavor="h100", chips_per_node=per_node)]
    out += [ev("chip.registered", 0, chip_id=f"c{i}", node=f"n{i // per_node}") for i in range(chips)]
    return out


def grant(team, chips, **kw): return ev("quota.granted", 0, grant_id=f"g-{team}", team=team, chips=chips, **kw)
def submit(jid, team, chips, at=0, **kw): return ev("job.submitted", at, job_id=jid, team=team, chips=chips, **kw)
def start(jid, at=0, **kw): return ev("job.started", at, job_id=jid, **kw)
def run(jid, team, chips, at=0, **kw): return [submit(jid, team, chips, at, **kw), start(jid, at)]
def checkpoint(jid, at): return ev("job.checkpointed", at, job_id=jid)
def preempted(jid, at, decision_id=None):
    return ev("job.preempted", at, job_id=jid, **({"decision_id": decision_id} if decision_id else {}))
def tick(at, eid=None): return ev("pool.tick", at, eid=eid)
def burst(rid, team, chips, at, ws, we):
    return ev("burst.requested", at, request_id=rid, team=team, chips=chips, window_start=ws, window_end=we)


class Run:
    """Fold events one by one, checking conservation after each; keep every decision with its event id."""

    def __init__(self, events=(), config=CFG):
        self.fleet = Fleet(config)
        self.decisions: list = []
        self.apply(events)

    def apply(self, events):
        out = []
        for e in events if isinstance(events, (list, tuple)) else [events]:
            step = self.fleet.apply(e)
            assert step.rejection is None, (e, step.rejection)
            check_invariants(self.state)
            for row in step.decisions:
                d = decision_of(row)
                assert row[0] == d.decision_id and row[3] == step.applied_at
                out.append(d)
        self.decisions += out
        return out

    @property
    def state(self):
        return self.fleet.pools[POOL]


def victims(d):
    return [(v.job_id, v.team, v.chips, v.lost_work_chip_s, v.preemption_count) for v in d.victims]


# =========================================================================================================
# reclaim
# =========================================================================================================

def _reclaim_base():
    """8 chips; ads 4, search 2, vision 2. search runs 4 chips from 0 (borrows 2), vision 4 chips from 1000
    (borrows 2); at 2000 ads submits a 2-chip job that fits its unused quota but nothing is free."""
    return (pool() + [grant("ads", 4), grant("search", 2), grant("vision", 2)]
            + run("s1", "search", 2) + run("s2", "search", 2) + run("v1", "vision", 2, 1000)
            + run("v2", "vision", 2, 1000) + [checkpoint("s1", 1500), checkpoint("v1", 1990)])


def test_reclaim_waits_out_the_grace_then_takes_the_lowest_fair_share_borrower():
    r = Run(_reclaim_base())
    assert r.apply(submit("a1", "ads", 2, 2000)) == []          # short since 2000: grace until 2060
    assert r.apply(tick(2059)) == []
    assert r.state.policy_due == T0 + 2060
    [d] = r.apply(tick(2060, eid="tick-2060"))
    # U_search = 4 chips × 2060 s, U_vision = 4 × 1060: F_search = 2^(-(8240/12480)/0.25) = 0.16089,
    # F_vision = 2^(-(4240/12480)/0.25) = 0.39023 -> search's jobs go first even though vision's v1 lost only
    # 2 × 70 chip-s of work; within search s1 (checkpointed at 1500: 2 chips × 560 s = 1120 chip-s) loses less than s2
    assert (d.decision_id, d.rule, d.beneficiary.job_id, d.beneficiary.team) == (
        "tick-2060:reclaim:a1", "reclaim", "a1", "ads")
    assert victims(d) == [("s1", "search", 2.0, 1120, 0)]
    assert d.numbers["need_chips"] == 2 and d.numbers["free_chips"] == 0 and d.numbers["freed_chips"] == 2
    assert d.numbers["fair_share_factor[search]"] == pytest.approx(2 ** (-(8240 / 12480) / 0.25), abs=1e-6)
    assert d.numbers["borrowed_chips[search]"] == 2 and d.numbers["lost_work_chip_s"] == 1120
    assert d.message == ("reclaim: job a1 (2 chips) fits team ads's unused quota but only 0 chips are free; "
                         "preempt 1 job(s) of borrowing team(s) search to free 2 chips (2 needed, 1120 chip-s of "
                         "work lost); victims checkpoint by 2026-11-02 08:35:20 UTC")
    assert d.checkpoint_by == datetime.fromtimestamp(T0 + 2060 + CFG.checkpoint_grace_s, timezone.utc)
    assert d.at == datetime.fromtimestamp(T0 + 2060, timezone.utc)


def test_a_decision_in_flight_is_not_repeated_and_is_settled_when_the_cluster_acts():
    r = Run(_reclaim_base() + [submit("a1", "ads", 2, 2000)])
    [d] = r.apply(tick(2060, eid="t1"))
    assert r.apply([tick(2100), submit("a2", "ads", 1, 2200), tick(2259)]) == []  # a2 waits its own grace
    # a2's own decision does not count on s1 again: search borrows 2, both promised to a1, so vision gives
    # v1 (checkpointed at 1990: 2 × 270 chip-s lost, less than v2's 2 × 1260)
    [d2] = r.apply(tick(2260, eid="t2"))
    assert (d2.decision_id, victims(d2)) == ("t2:reclaim:a2", [("v1", "vision", 2.0, 540, 0)])
    # the cluster follows the advice: s1 is preempted for the decision, a1 starts on its chips
    assert r.apply(preempted("s1", 2310, d.decision_id)) == []
    assert r.state.marked == {"v1": "a2"} and r.state.inflight["a1"][3] == []
    assert r.apply(start("a1", 2320)) == []
    assert "a1" not in r.state.inflight


def test_a_decision_nobody_acted_on_is_made_anew_after_the_timeout():
    r = Run(_reclaim_base() + [submit("a1", "ads", 2, 2000)])
    [d1] = r.apply(tick(2060, eid="t1"))
    assert r.apply(tick(2659)) == []
    [d2] = r.apply(tick(2660, eid="t2"))  # 2060 + 600: the first one timed out
    assert d2.decision_id == "t2:reclaim:a1" and victims(d2)[0][0] == "s1"
    assert victims(d2) == [("s1", "search", 2.0, 2 * (2660 - 1500), 0)]


def test_a_decision_ignored_again_waits_twice_as_long_before_the_next():
    r = Run(_reclaim_base() + [submit("a1", "ads", 2, 2000)])
    assert [d.decision_id for d in r.apply([tick(2060, eid="t1"), tick(2660, eid="t2")])] == [
        "t1:reclaim:a1", "t2:reclaim:a1"]
    assert r.state.ignored == {"a1": 1}
    assert r.apply(tick(3859)) == []                       # 2660 + 2 × 600
    [d3] = r.apply(tick(3860, eid="t3"))
    assert d3.decision_id == "t3:reclaim:a1" and r.state.inflight["a1"][4] == T0 + 3860 + 4 * 600
    # the cluster acts on this one: s1 goes; a1 starting settles it and forgets the count
    r.apply([preempted("s1", 3870, d3.decision_id), start("a1", 3880)])
    assert r.state.ignored == {} and r.state.inflight == {}


def test_natural_completion_in_the_grace_period_means_no_decision():
    r = Run(_reclaim_base() + [submit("a1", "ads", 2, 2000)])
    r.apply(ev("job.finished", 2030, job_id="v2", outcome="succeeded"))
    assert r.apply([tick(2060), tick(5000)]) == [] and r.state.short_since == {}


def test_no_reclaim_when_nobody_borrows():
    # quotas oversubscribed: every team inside its quota, nothing free, ads fits its unused quota -> it waits
    r = Run(pool(4) + [grant("ads", 4), grant("search", 4)] + run("s1", "search", 4)
            + [submit("a1", "ads", 2, 10), tick(1000)])
    assert r.decisions == []
    assert pending_reason(r.state, r.state.jobs["a1"], T0 + 1000, CFG)[0] == WAITING_FOR_CHIPS


@pytest.mark.parametrize("case, jobs, expected", [
    # (job, chips, priority, started at, checkpointed at): search borrows everything above its 0 quota
    ("lowest priority first, whatever the lost work",
     [("x", 2, 5, 0, 1900), ("y", 2, 1, 0, None)], ["y"]),
    ("then least lost work",
     [("x", 2, 1, 0, 1900), ("y", 2, 1, 0, None)], ["x"]),
    ("then most recently started",
     [("x", 2, 1, 0, 1900), ("y", 2, 1, 100, 1900)], ["y"]),
    ("then job id",
     [("y", 2, 1, 0, 1900), ("x", 2, 1, 0, 1900)], ["x"]),
])
def test_victim_order_tie_breakers(case, jobs, expected):
    events = pool(4) + [grant("ads", 2)]
    for jid, chips, prio, at, ck in jobs:
        events += run(jid, "search", chips, at, priority=prio)
    events += [checkpoint(jid, ck) for jid, _, _, _, ck in jobs if ck is not None]
    r = Run(events + [submit("a1", "ads", 2, 2000), tick(2060, eid="t")])
    [d] = r.decisions
    assert [v.job_id for v in d.victims] == expected, case


def test_naive_order_is_lowest_priority_then_most_recent():
    events = pool(4) + [grant("ads", 2)] + run("x", "search", 2, 0) + run("y", "search", 2, 100)
    events += [checkpoint("y", 1999)]  # y lost almost nothing, x lost 2 × 2060 chip-s
    cfg = FoldConfig(check_invariants=True, preemption_grace_s=60, min_runtime_s=300, victim_order="naive")
    r = Run(events + [submit("a1", "ads", 2, 2000), tick(2060)], config=cfg)
    assert [v.job_id for v in r.decisions[0].victims] == ["y"]
    r = Run(events + [submit("a1", "ads", 2, 2000), tick(2060)])  # goodput: x? no: y lost 2 × 61 < x's
    assert [v.job_id for v in r.decisions[0].victims] == ["y"]
    events2 = pool(4) + [grant("ads", 2)] + run("x", "search", 2, 0) + run("y", "search", 2, 100)
    events2 += [checkpoint("x", 1999)]
    r = Run(events2 + [submit("a1", "ads", 2, 2000), tick(2060)], config=cfg)
    assert [v.job_id for v in r.decisions[0].victims] == ["y"]   # naive: most recent, loses 2 × 1960
    r = Run(events2 + [submit("a1", "ads", 2, 2000), tick(2060)])
    assert [(v.job_id, v.lost_work_chip_s) for v in r.decisions[0].victims] == [("x", 122)]


def test_free_no_more_than_needed_drops_victims_that_became_unneeded():
    # search borrows 6 with jobs of 1 (least lost work) and 4 chips; ads needs 3 of its 2+... quota
    events = pool(8) + [grant("ads", 3), grant("search", 2)] + run("big", "search", 4, 0, priority=1)
    events += run("small", "search", 1, 0, priority=1) + run("mid", "search", 3, 0, priority=2)
    events += [checkpoint("big", 1500), checkpoint("small", 1990)]
    # free 0; ads needs 3. Order (same F): priority 1 first: small (lost 1×70), big (lost 4×560), then mid.
    # greedy: small (1) + big (4) = 5 >= 3; small is then not needed (5 - 1 >= 3): victims [big]
    r = Run(events + [submit("a1", "ads", 3, 2000), tick(2060)])
    [d] = r.decisions
    assert victims(d) == [("big", "search", 4.0, 2240, 0)]
    assert d.numbers["need_chips"] == 3 and d.numbers["freed_chips"] == 4


def _two_short_base():
    """12 chips; ads 4, vision 4, search 4. search runs s1-s4 (2 chips each) and x1, x2 (1 chip each) from 0:
    it borrows 6 and 2 chips are free. Checkpoints leave x1 the least lost work at 2060 (1 × 65 chip-s), then
    x2 (1 × 70), s4 (2 × 260), s3, s2, s1."""
    events = pool(12) + [grant("ads", 4), grant("vision", 4), grant("search", 4)]
    for jid in ("s1", "s2", "s3", "s4"):
        events += run(jid, "search", 2)
    events += run("x1", "search", 1) + run("x2", "search", 1)
    return events + [checkpoint("s1", 1500), checkpoint("s2", 1600), checkpoint("s3", 1700),
                     checkpoint("s4", 1800), checkpoint("x2", 1990), checkpoint("x1", 1995)]


def test_free_chips_a_decision_in_flight_counts_on_are_not_counted_again():
    # a1 (3 chips) counts on the 2 free chips and x1's 1; w1 (3 chips, vision) comes while that decision is in
    # flight: the free chips are a1's, so w1 needs all its 3 chips (before: 1, and x2 alone was named, which
    # would have left w1 short once a1 started)
    r = Run(_two_short_base() + [submit("a1", "ads", 3, 2000), submit("w1", "vision", 3, 2000)])
    d1, d2 = r.apply(tick(2060, eid="t1"))
    assert (d1.decision_id, victims(d1)) == ("t1:reclaim:a1", [("x1", "search", 1.0, 65, 0)])
    assert d1.numbers["need_chips"] == 1 and d1.numbers["free_chips"] == 2 and "promised_chips" not in d1.numbers
    assert (d2.decision_id, victims(d2)) == ("t1:reclaim:w1", [("x2", "search", 1.0, 70, 0),
                                                               ("s4", "search", 2.0, 520, 0)])
    assert (d2.numbers["need_chips"], d2.numbers["free_chips"], d2.numbers["promised_chips"],
            d2.numbers["freed_chips"]) == (3, 0, 2, 3)
    assert "only 0 chips are free, 2 more promised to decisions in flight;" in d2.message


def test_a_job_that_fits_the_free_chips_but_not_beside_a_decision_in_flight_waits_its_grace():
    # a1 (3 chips) is in flight on the 2 free chips and x1; w1 (2 chips) fits the 2 free chips, but they are
    # a1's: it is short from 2070 (before: it was taken to fit, and no decision was ever made for it), and after
    # its grace it needs all its 2 chips: x2 (1 chip) and s4 (2) cover them, x2 is then not needed
    r = Run(_two_short_base() + [submit("a1", "ads", 3, 2000)])
    [d1] = r.apply(tick(2060, eid="t1"))
    assert victims(d1) == [("x1", "search", 1.0, 65, 0)]
    assert r.apply([submit("w1", "vision", 2, 2070), tick(2129)]) == []
    [d2] = r.apply(tick(2130, eid="t2"))
    assert (d2.decision_id, victims(d2)) == ("t2:reclaim:w1", [("s4", "search", 2.0, 660, 0)])
    assert (d2.numbers["need_chips"], d2.numbers["free_chips"], d2.numbers["promised_chips"]) == (2, 0, 2)
    # the cluster acts on a1's decision and starts a1: nothing is promised any more
    r.apply([preempted("x1", 2140, d1.decision_id), start("a1", 2140)])
    assert "a1" not in r.state.inflight and list(r.state.inflight) == ["w1"]


def test_the_folds_no_look_shortcut_counts_the_free_chips_a_decision_in_flight_holds():
    # as above, but a tick first settles the look-ups (nothing due before 2660, when a1's decision times out), so
    # w1's submission takes the fold's shortcut for jobs that fit: it must still see that the 2 free chips are
    # a1's, and so be short from its submission (2070) and get its decision when its grace ends at 2130
    r = Run(_two_short_base() + [submit("a1", "ads", 3, 2000)])
    [d1] = r.apply(tick(2060, eid="t1"))
    assert r.apply(tick(2061)) == [] and r.state.policy_due == T0 + 2660 and not r.state.policy_full
    assert r.apply(submit("w1", "vision", 2, 2070)) == []
    assert r.state.short_since.get("w1") == T0 + 2070
    [d2] = r.apply(tick(2130, eid="t2"))
    assert (d2.decision_id, d2.numbers["promised_chips"]) == ("t2:reclaim:w1", 2)


def test_the_folds_no_look_shortcut_counts_the_quota_a_decision_in_flight_holds():
    # ads (4 chips of quota, no borrowing) has a1 (3 chips) in flight; s1 finishes, so 2 chips are free beyond
    # the 3 promised to a1. a2 (ads, 2 chips) fits ads's unused quota as it stands (4) but not beside a1 (1 left)
    # and ads cannot borrow: heading ads's queue, it is looked at at once, not taken to fit
    events = pool(12) + [grant("ads", 4, borrowing_limit=0), grant("vision", 4), grant("search", 4)]
    for jid in ("s1", "s2", "s3", "s4"):
        events += run(jid, "search", 2)
    events += run("x1", "search", 1) + run("x2", "search", 1)
    r = Run(events + [submit("a1", "ads", 3, 2000)])
    [d1] = r.apply(tick(2060, eid="t1"))
    assert victims(d1) == [("x1", "search", 1.0, 2060, 0)]
    assert r.apply([tick(2061), ev("job.finished", 2065, job_id="s1", outcome="succeeded")]) == [] and r.state.policy_due == T0 + 2660
    assert r.apply(submit("a2", "ads", 2, 2070, priority=1)) == []  # it heads ads's queue
    # short of chips it may use from its submission, its grace ending at 2130 (taken to fit: never looked at)
    assert r.state.short_since.get("a2") == T0 + 2070 and r.state.wakes.get("a2") == T0 + 2130


def test_a_pending_reason_counts_what_decisions_in_flight_hold():
    # a1's decision is in flight on the 2 free chips (and x1's 1): w1 (vision, 2 chips) fits the free chips only
    # as if they were nobody's; its reason says it waits out its grace, with the promised chips (it said "ready")
    r = Run(_two_short_base() + [submit("a1", "ads", 3, 2000)])
    r.apply(tick(2060, eid="t1"))
    r.apply(submit("w1", "vision", 2, 2070))
    code, msg = pending_reason(r.state, r.state.jobs["w1"], T0 + 2080, CFG)
    assert code == WAITING_GRACE
    assert msg == ("fits its team's unused quota but only 0 of 2 chips are free (2 more promised to decisions in "
                   "flight); waiting out the preemption grace until 2026-11-02 08:35:30 UTC")
    # ads's own a2 (1 chip): ads's 4 chips of quota are 3 promised to a1 and 1 unused, so it fits its quota, and
    # no free chip is left for it either
    r.apply(submit("a2", "ads", 1, 2090))
    code, msg = pending_reason(r.state, r.state.jobs["a2"], T0 + 2090, CFG)
    assert code == WAITING_GRACE and "only 0 of 1 chips are free (2 more promised" in msg
    r.apply(submit("a3", "ads", 2, 2095))  # beside a1 it would borrow: search's free chips are promised
    code, msg = pending_reason(r.state, r.state.jobs["a3"], T0 + 2095, CFG)
    assert code == NOTHING_TO_LEND and "(free 0 (2 more promised to decisions in flight)" in msg


def test_a_team_is_taken_from_only_while_it_still_borrows():
    # search borrows 1 chip (3 used of 2), vision borrows 2 (3 of 1); all jobs have 1 chip. ads needs 3.
    # U_search = 3 × 2060, U_vision = 3 × 1060 (of 9360 chip-s); S = 2/6 and 1/6:
    # F_search = 2^(-(6180/9360)·3) = 0.2530 > F_vision = 2^(-(3180/9360)·6) = 0.2430, so vision goes first,
    # but only two of its three jobs (it borrows 2); the third chip comes from search
    events = pool(6) + [grant("ads", 3), grant("search", 2), grant("vision", 1)]
    events += run("s1", "search", 1, 0) + run("s2", "search", 1, 0) + run("s3", "search", 1, 0)
    events += run("v1", "vision", 1, 1000) + run("v2", "vision", 1, 1000) + run("v3", "vision", 1, 1000)
    r = Run(events + [submit("a1", "ads", 3, 2000), tick(2060)])
    [d] = r.decisions
    assert [(v.job_id, v.team) for v in d.victims] == [("v1", "vision"), ("v2", "vision"), ("s1", "search")]
    assert d.numbers["fair_share_factor[vision]"] == pytest.approx(2 ** (-(3180 / 9360) * 6), abs=1e-6)


# =========================================================================================================
# protections
# =========================================================================================================

def test_non_preemptible_jobs_are_never_victims():
    events = pool(4) + [grant("ads", 2)] + run("x", "search", 2, 0, preemptible=False) + run("y", "search", 2, 0)
    events += [checkpoint("x", 1999)]
    r = Run(events + [submit("a1", "ads", 2, 2000), tick(2060)])
    assert [v.job_id for v in r.decisions[0].victims] == ["y"]


def test_min_runtime_protects_and_the_decision_comes_when_it_ends():
    events = pool(4) + [grant("ads", 2)] + run("x", "search", 4, 1900)
    r = Run(events + [submit("a1", "ads", 2, 2000)])
    assert r.apply(tick(2060)) == []            # x started 160 s ago: protected until 1900 + 300
    assert r.state.policy_due == T0 + 2200
    assert r.apply(tick(2199)) == []
    [d] = r.apply(tick(2200))
    assert victims(d) == [("x", "search", 4.0, 4 * 300, 0)]


def test_max_preemptions_within_the_window_protects():
    events = pool(4) + [grant("ads", 2)] + run("x", "search", 2, 0) + run("y", "search", 2, 0)
    # x was preempted twice in the last hour (restarted each time): with max 2 it may not be chosen again
    events += [preempted("x", 400), start("x", 410), preempted("x", 800), start("x", 810)]
    events += [checkpoint("x", 1999)]
    r = Run(events + [submit("a1", "ads", 2, 2000), tick(2060)])
    [d] = r.decisions
    assert [v.job_id for v in d.victims] == ["y"]
    # after the window (400 + 3600) x is eligible again
    r2 = Run(events + [checkpoint("y", 4000), checkpoint("x", 4005), submit("a1", "ads", 2, 4010), tick(4070)])
    assert [(v.job_id, v.preemption_count) for v in r2.decisions[0].victims] == [("x", 1)]


# =========================================================================================================
# priority
# =========================================================================================================

def test_priority_rule_within_a_team_at_quota_that_cannot_borrow():
    events = pool(8) + [grant("ads", 4, borrowing_limit=0)]
    events += run("lo", "ads", 2, 0, priority=1) + run("mid", "ads", 2, 0, priority=5)
    r = Run(events + [submit("hi", "ads", 2, 2000, priority=9)])
    # 4 chips are free but ads may not borrow: need = borrowed 0 + 2 - limit 0 = 2
    assert pending_reason(r.state, r.state.jobs["hi"], T0 + 2000, CFG)[0] == OVER_BORROWING_LIMIT
    [d] = r.apply(tick(2060, eid="p"))
    assert (d.decision_id, d.rule) == ("p:priority:hi", "priority")
    assert victims(d) == [("lo", "ads", 2.0, 2 * 2060, 0)]
    assert d.numbers["need_chips"] == 2 and d.numbers["free_chips"] == 4
    assert d.message.startswith("priority: job hi (priority 9, 2 chips) of team ads, at its quota and unable to "
                                "borrow, preempts 1 lower-priority job(s)")


def test_priority_rule_never_takes_equal_or_higher_priority():
    events = pool(4) + [grant("ads", 4, borrowing_limit=0)] + run("same", "ads", 4, 0, priority=5)
    r = Run(events + [submit("hi", "ads", 2, 2000, priority=5), tick(2060), tick(9000)])
    assert r.decisions == []


# =========================================================================================================
# bursts
# =========================================================================================================

def test_burst_approved_partial_and_denied_with_exact_numbers():
    r = Run(pool(8) + [grant("ads", 4), grant("search", 4, lending_limit=1)])
    # no usage yet: F = 1; search does not lend 3 of its 4 unused chips; no history: forecast = demand now (0)
    [d] = r.apply(burst("b1", "ads", 4, 100, 3600, 7200))
    assert (d.verdict, d.chips_granted, d.rule, d.decision_id) == ("approved", 4.0, "burst_forecast",
                                                                   f"{d.decision_id.split(':')[0]}:burst:b1")
    assert d.numbers["forecast_idle_chips"] == 5 and d.numbers["others_guaranteed_chips"] == 3
    # an overlapping request sees the first reservation: 8 - 3 - 0 - 4 = 1
    [d2] = r.apply(burst("b2", "vision", 3, 200, 5000, 9000))
    assert (d2.verdict, d2.chips_granted, d2.numbers["other_bursts_chips"]) == ("partial", 1.0, 4.0)
    # a window already over
    [d3] = r.apply(burst("b3", "ads", 1, 300, 100, 200))
    assert (d3.verdict, d3.chips_granted) == ("denied", 0.0)


def test_burst_is_accounted_as_burst_in_its_window_then_expires():
    r = Run(pool(8) + [grant("ads", 2)])
    [d] = r.apply(burst("b1", "ads", 2, 0, 3600, 7200))
    assert d.verdict == "approved"
    r.apply(run("a1", "ads", 4, 100))               # 2 over its quota: borrowed before the window
    rate = r.state.books.rate
    assert (rate(IN_QUOTA, "ads"), rate(BORROWED, "ads"), rate(BURST, "ads")) == (2000, 2000, 0)
    r.apply(tick(3600))
    assert (rate(IN_QUOTA, "ads"), rate(BORROWED, "ads"), rate(BURST, "ads")) == (2000, 0, 2000)
    r.apply(tick(7200))
    assert (rate(IN_QUOTA, "ads"), rate(BORROWED, "ads"), rate(BURST, "ads")) == (2000, 2000, 0)
    assert r.state.bursts == {} and r.state.teams["ads"].burst_milli == 0


def test_burst_with_usage_is_cut_by_fair_share():
    r = Run(pool(8) + [grant("ads", 4), grant("search", 4)] + run("a1", "ads", 2, 0))
    # at 1000: U_ads = 2000 chip-s, the only usage: F_ads = 2^(-1/0.5) = 0.25, so it may take 2F = 50% of the
    # forecast idle 8 - 2 (demand now) = 6 -> 3 chips
    [d] = r.apply(burst("b1", "ads", 4, 1000, 3600, 7200))
    assert (d.verdict, d.chips_granted) == ("partial", 3.0)
    assert d.numbers["fair_share_factor"] == 0.25 and d.numbers["fair_share_allowance"] == 0.5


def test_no_burst_while_the_capacity_error_budget_burns():
    r = Run(pool(8) + [grant("ads", 4), ev("chip.state_changed", 0, chip_id="c0", state="down"), tick(H)])
    # one chip of 8 down for the hour: 12.5% unavailable against a 1% budget: the budget is spent
    [d] = r.apply(burst("b1", "ads", 1, H + 10, 2 * H, 3 * H))
    assert (d.verdict, d.chips_granted) == ("denied", 0.0)
    assert d.numbers["error_budget_left"] == pytest.approx(1 - 12.5) and "error budget" in d.message


def test_forecast_uses_the_hour_of_week_history():
    # a week of history: 6 chips busy in hour 10:00 of every day's... only Monday 10:00 is seen
    r = Run(pool(8) + [grant("ads", 8)] + run("a1", "ads", 6, 2 * H) + [ev("job.finished", 3 * H, job_id="a1",
                                                                           outcome="succeeded")])
    how = hour_of_week(T0 + 2 * H)
    assert how == 10 and r.state.profile[how] == [6000, 1]
    # a week later, a burst for Monday 10:00-11:00: forecast demand 6 (history), not the 0 of now
    week = 7 * 24 * H
    [d] = r.apply(burst("b1", "ads", 4, week, week + 2 * H, week + 3 * H))
    assert d.numbers["forecast_demand_chips"] == 6 and d.numbers["forecast_hours_with_history"] == 1
    assert (d.verdict, d.chips_granted) == ("partial", 2.0)


def test_reclaim_takes_ordinary_borrowing_before_bursts():
    events = pool(8) + [grant("ads", 4), grant("search", 1), grant("vision", 1)]
    r = Run(events)
    [b] = r.apply(burst("b1", "search", 2, 0, 0, 10 * H))
    assert b.verdict == "approved"
    # search: 3 used = 1 quota + 2 burst; vision: 3 used = 1 quota + 2 borrowed. search has used more (lower F)
    r.apply(run("s1", "search", 1, 0) + run("s2", "search", 2, 0) + run("v1", "vision", 1, 500)
            + run("v2", "vision", 2, 500))
    r.apply([run_ for run_ in run("a0", "ads", 2, 600)])
    [d] = r.apply([submit("a1", "ads", 2, 2000), tick(2060)])
    assert [v.team for v in d.victims] == ["vision"] and "burst_chips[search]" not in d.numbers


# =========================================================================================================
# fair share and balances
# =========================================================================================================

def test_decayed_usage_and_balance_rows_at_each_close_of_an_hour():
    cfg = FoldConfig(check_invariants=True, decay_half_life_s=7200)
    fleet = Fleet(cfg)
    steps = [fleet.apply(e) for e in pool(4) + [grant("ads", 1), grant("search", 3)] + run("a1", "ads", 2, 0)
             + [tick(H), tick(2 * H)]]
    rows = [b for s in steps for b in s.balances]
    by = {(b.team, b.at - T0): b for b in rows}
    # hour 1: ads used 2 chips × 3600 s; hour 2: 7_200_000 × 2^(-1/2) rounded, plus another 7_200_000
    assert by[("ads", H)].decayed_usage_mchip_s == 7_200_000
    assert by[("ads", 2 * H)].decayed_usage_mchip_s == round(7_200_000 * 2 ** -0.5) + 7_200_000 == 12_291_169
    assert by[("ads", H)][3:8] == (1000, 2000, 1000, 0, 0) and by[("search", H)].decayed_usage_mchip_s == 0
    assert by[("ads", H)].lendable_milli == 4000
    state = fleet.pools[POOL]
    fs = fair_shares(state, T0 + 2 * H, 7200)
    assert fs["ads"] == (12_291_169, 2 ** (-1 / 0.25)) and fs["search"] == (0, 1.0)
    # mid-hour, the value is computed on demand: decayed by the part of the hour, plus what accrued
    half = fair_shares(state, T0 + 2 * H + 1800, 7200)["ads"][0]
    assert half == round(12_291_169 * 2 ** (-1800 / 7200)) + 2000 * 1800


def test_pending_rows_explain_each_reason():
    events = pool(8, per_node=4) + [grant("ads", 4), grant("search", 2, borrowing_limit=1),
                                    grant("vision", 2, lending_limit=0)]
    events += run("s1", "search", 2, 0) + run("s2", "search", 1, 0)   # search at its limit: 1 borrowed
    events += run("a0", "ads", 1, 0)
    events += [ev("job.started", 0, job_id="x", chip_ids=["c4"]) if False else tick(0)]
    events += [submit("ready", "ads", 2, 10), submit("borrow", "ads", 4, 20), submit("limit", "search", 1, 30),
               submit("nodes", "ads", 2, 40, chips_per_node=4)]
    fleet = Fleet(CFG)
    for e in events:
        assert fleet.apply(e).rejection is None
    state = fleet.pools[POOL]
    t = T0 + 100
    reasons = {j: pending_reason(state, state.jobs[j], t, CFG) for j in ("ready", "borrow", "limit", "nodes")}
    # free: 8 - 4 = 4 chips, vision keeps its 2 unused chips (lends none) -> 2 to lend
    assert reasons["ready"][0] == READY
    assert reasons["borrow"] == (NOTHING_TO_LEND, "would borrow 1 chips but only 2 chips are free to lend "
                                                  "(free 4, less other teams' unlent quota)")
    assert reasons["limit"] == (OVER_BORROWING_LIMIT, "would borrow 1 chips but team search already borrows 1 of "
                                                      "its limit 1")
    # no placement was given: every chip looks free on its node, so a 2-per-node... fits: ready
    assert reasons["nodes"][0] == READY


def test_not_on_whole_nodes_when_free_chips_are_scattered():
    events = pool(8, per_node=4) + [grant("ads", 8)]
    events += [submit("p", "search", 4, 0), ev("job.started", 0, job_id="p", chip_ids=["c0", "c1", "c4", "c5"])]
    events += [submit("w", "ads", 4, 10, chips_per_node=4), submit("v", "ads", 4, 10)]
    r = Run(events)
    st = r.state
    assert pending_reason(st, st.jobs["w"], T0 + 20, CFG)[0] == NOT_ON_WHOLE_NODES
    assert pending_reason(st, st.jobs["v"], T0 + 20, CFG)[0] == READY


def test_reasons_waiting_grace_in_flight_and_would_borrow():
    r = Run(_reclaim_base() + [submit("a1", "ads", 2, 2000)])
    st = r.state
    code, msg = pending_reason(st, st.jobs["a1"], T0 + 2010, CFG)
    assert code == WAITING_GRACE and msg.endswith("until 2026-11-02 08:34:20 UTC")
    [d] = r.apply(tick(2060, eid="g"))
    code, msg = pending_reason(st, st.jobs["a1"], T0 + 2061, CFG)
    assert code == PREEMPTION_IN_FLIGHT and "g:reclaim:a1" in msg
    r2 = Run(pool(8) + [grant("ads", 1)] + [submit("b", "ads", 3, 0)])
    assert pending_reason(r2.state, r2.state.jobs["b"], T0, CFG)[0] == WOULD_BORROW


def test_policy_state_survives_json_and_replays_identically():
    events = _reclaim_base() + [submit("a1", "ads", 2, 2000), tick(2060, eid="x"), tick(2100), tick(2700)]
    whole = Run(events)
    first = Run(events[:20])
    restored = Fleet.from_dict(first.fleet.to_dict(), CFG)
    out = [decision_of(row) for e in events[20:] for row in restored.apply(e).decisions]
    assert [d.model_dump() for d in first.decisions + out] == [d.model_dump() for d in whole.decisions]
    assert restored.pools[POOL].to_dict() == whole.state.to_dict()


def test_fold_config_rejects_bad_policy_values():
    for kw in ({"decay_half_life_s": 0}, {"preemption_grace_s": -1}, {"victim_order": "random"},
               {"capacity_slo_target": 1.0}, {"max_preemptions": 0}, {"max_preemptions": 17}):
        with pytest.raises(ValueError):
            FoldConfig(**kw)
