"""Victim classes within `[policy] fair_share_tolerance`, the least-cost victim set, the restart cost and
cooperative preemption (`checkpoint_by`): scenario tests with hand-computed decisions (DESIGN §4,
docs/policy.md). Times are offsets from T0 as in tests/test_policy.py."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

import pytest

from ledger import FoldConfig
from ledger.policy import fair_shares
from tests.test_policy import CFG, T0, Run, checkpoint, ev, grant, pool, preempted, run, submit, tick

# 8 chips; ads 4, search 2, vision 2. ads ran a0 (4 chips) from 0 to 1548 s; search runs s1, s2 (2 chips each)
# from 1548 s, vision v1, v2 from 1780 s: at 5890 s U_ads = 4 × 1548, U_search = 4 × 4342, U_vision = 4 × 4110
# chip-s (x = U/ΣU = 0.1548, 0.4342, 0.4110), so with S = 0.25 F_search = 2^(-4 × 0.4342) ≈ 0.300 and
# F_vision = 2^(-4 × 0.4110) ≈ 0.320 (the close of hour 0 decays the usage by 2^(-1/168): F moves in the
# 4th digit). Lost work at 5890: s1 2 × 4342 (never checkpointed), s2 2 × 1000 (checkpointed at 4890),
# v1 2 × 100 (checkpointed at 5790), v2 2 × 4110. ads submits a1 (2 chips) at 5830: short, grace 60 s.
T = 5890


def _two_borrowers():
    return (pool(8) + [grant("ads", 4), grant("search", 2), grant("vision", 2)]
            + run("a0", "ads", 4, 0) + [ev("job.finished", 1548, job_id="a0", outcome="succeeded")]
            + run("s1", "search", 2, 1548) + run("s2", "search", 2, 1548)
            + run("v1", "vision", 2, 1780) + run("v2", "vision", 2, 1780)
            + [checkpoint("s2", T - 1000), checkpoint("v1", T - 100), submit("a1", "ads", 2, T - 60)])


def _cfg(**kw):
    return dataclasses.replace(CFG, **kw)


@pytest.mark.parametrize("tolerance, victim, lost", [(0.1, "v1", 200), (0.0, "s2", 2000), (1.0, "v1", 200),
                                                     (float("inf"), "v1", 200), (0.015, "s2", 2000)])
def test_tolerance_makes_close_fair_shares_one_victim_class(tolerance, victim, lost):
    r = Run(_two_borrowers(), config=_cfg(fair_share_tolerance=tolerance))
    [d] = r.apply(tick(T, eid="t"))
    shares = fair_shares(r.state, T0 + T, CFG.decay_half_life_s)
    fs, fv = shares["search"][1], shares["vision"][1]
    assert fs == pytest.approx(0.300, abs=0.002) and fv == pytest.approx(0.320, abs=0.002)
    assert [(v.job_id, v.lost_work_chip_s) for v in d.victims] == [(victim, lost)]
    assert d.numbers["fair_share_tolerance"] == min(tolerance, 1e300)
    if tolerance > fv - fs:  # one class: both teams' numbers are given, with the same class
        assert d.numbers["victim_class[search]"] == d.numbers["victim_class[vision]"] == 0
        assert (f"teams search, vision treated as equal (F {fs:.3f}, {fv:.3f} differ by less than "
                f"fair_share_tolerance {'infinite' if tolerance == float('inf') else f'{tolerance:g}'}), victims "
                f"with the least lost work taken from any of them") in d.message
    else:  # strict: search (lowest F) alone is the first class; vision is not looked at
        assert d.numbers["victim_class[search]"] == 0 and "victim_class[vision]" not in d.numbers
        assert "treated as equal" not in d.message and "fair_share_factor[vision]" not in d.numbers
    by = datetime.fromtimestamp(T0 + T + 60, timezone.utc)
    assert d.message.endswith(f"victims checkpoint by {by:%Y-%m-%d %H:%M:%S} UTC")


def test_strict_order_names_only_the_lowest_fair_share_team():
    r = Run(_two_borrowers(), config=_cfg(fair_share_tolerance=0.0))
    [d] = r.apply(tick(T, eid="t"))
    assert "treated as equal" not in d.message and "fair_share_factor[vision]" not in d.numbers
    assert "borrowing team(s) search to free 2 chips (2 needed, 2000 chip-s of work lost)" in d.message


def test_the_least_lost_work_set_not_the_greedy_one():
    # search (quota 0) runs x (4 chips, 250 s since its checkpoint: 1000 chip-s), y and z (2 chips each:
    # 150 s = 300 chip-s, 400 s = 800 chip-s). ads (quota 4) needs 4 chips: greedy in lost-work order takes y
    # then z (1100 chip-s); the least-lost set is x alone (1000). With a restart cost of 300 s per chip the
    # costs are x 1000 + 1200, y 300 + 600, z 800 + 600: x (2200) still beats y + z (2300).
    events = (pool(8) + [grant("ads", 4)] + run("x", "search", 4, 0) + run("y", "search", 2, 0)
              + run("z", "search", 2, 0)
              + [checkpoint("z", 1660), checkpoint("x", 1810), checkpoint("y", 1910), submit("a1", "ads", 4, 2000)])
    for restart in (0, 300):
        r = Run(events, config=_cfg(restart_cost_s=restart))
        [d] = r.apply(tick(2060, eid="t"))
        assert [(v.job_id, v.lost_work_chip_s) for v in d.victims] == [("x", 1000)]
        assert d.numbers["lost_work_chip_s"] == 1000 and d.numbers["restart_cost_chip_s"] == 4 * restart


def test_restart_cost_weighs_the_chips_restarted():
    # 6 chips, all search's (quota 0); ads (quota 2) needs 2. p (4 chips) checkpointed 25 s ago: 100 chip-s
    # lost; q (2 chips) 150 s ago: 300. Lost work alone takes p (100 < 300, freeing 2 more than needed); with
    # a restart cost of 300 s per chip p costs 100 + 1200 and q 300 + 600: q
    events = (pool(6, per_node=2) + [grant("ads", 2)] + run("p", "search", 4, 0) + run("q", "search", 2, 0)
              + [checkpoint("q", 1910), submit("a1", "ads", 2, 2000), checkpoint("p", 2035)])
    for restart, victim, lost in ((0, "p", 100), (300, "q", 300)):
        r = Run(events, config=_cfg(restart_cost_s=restart))
        [d] = r.apply(tick(2060, eid="t"))
        assert [(v.job_id, v.lost_work_chip_s) for v in d.victims] == [(victim, lost)], restart
        assert d.numbers["restart_cost_chip_s"] == (0 if restart == 0 else 2 * 300)


def test_cooperative_preemption_loses_only_the_work_after_the_notice_checkpoint():
    # the reclaim scenario of tests/test_policy.py: at 2060 s s1 is named (2 chips, 1120 chip-s lost if preempted
    # now); it checkpoints at 2100 s (before checkpoint_by = 2060 + 60) and is preempted at 2110 s: it really
    # loses 2 × 10 = 20 chip-s; the decision keeps its estimate at decision time
    from tests.test_policy import _reclaim_base

    r = Run(_reclaim_base() + [submit("a1", "ads", 2, 2000)])
    [d] = r.apply(tick(2060, eid="t"))
    assert d.checkpoint_by == datetime.fromtimestamp(T0 + 2060 + CFG.checkpoint_grace_s, timezone.utc)
    assert [(v.job_id, v.lost_work_chip_s) for v in d.victims] == [("s1", 1120)]
    r.fleet.apply(checkpoint("s1", 2100))
    step = r.fleet.apply(preempted("s1", 2110, d.decision_id))
    [jr] = [x for x in step.job_runs if x.end_reason == "preempted"]
    assert jr.job_id == "s1" and jr.lost_mchip_s == 2 * 10 * 1000
    assert d.numbers["lost_work_chip_s"] == 1120
    # without the notice checkpoint the same preemption loses everything since 1500
    r2 = Run(_reclaim_base() + [submit("a1", "ads", 2, 2000)])
    [d2] = r2.apply(tick(2060, eid="t"))
    step = r2.fleet.apply(preempted("s1", 2110, d2.decision_id))
    [jr] = [x for x in step.job_runs if x.end_reason == "preempted"]
    assert jr.lost_mchip_s == 2 * 610 * 1000


def test_tolerance_is_checked():
    with pytest.raises(ValueError, match="fair_share_tolerance must not be negative"):
        FoldConfig(fair_share_tolerance=-0.1)
    with pytest.raises(ValueError, match="restart_cost_s must not be negative"):
        FoldConfig(restart_cost_s=-1)
