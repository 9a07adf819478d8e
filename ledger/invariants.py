"""The fold's invariants, for tests and debug mode ([ledger] check_invariants): recomputed from scratch and
compared with the incremental state after an event. Conservation: capacity + overcommitted = unavailable + idle
+ every team's in quota, borrowed and burst; every index the fold keeps (queues, running jobs, pending sizes,
nodes, the head-of-line index) agrees with the jobs and chips; counters never go back. A failure is a bug
(AssertionError), never a rejection.
"""

from __future__ import annotations

from schemas.events import MAX_POOL_MILLI

from ledger import policy
from ledger.books import BORROWED, BURST, CAPACITY, ENTITLED, IDLE, IN_QUOTA, OVERCOMMITTED, PENDING, UNAVAILABLE
from ledger.rates import split_use
from ledger.state import PoolState
from ledger.step import DEFAULT_CONFIG, HELD, MILLI


def check_invariants(s: PoolState) -> None:
    """Conservation and consistency of one pool; raises AssertionError on a bug."""
    cap = MILLI * len(s.chips)
    unav = MILLI * sum(1 for c in s.chips.values() if not c.available)
    assert s.capacity_milli == cap, (s.capacity_milli, cap)
    assert s.unavailable_milli == unav, (s.unavailable_milli, unav)
    use: dict[str, int] = {}
    for job in s.jobs.values():
        if job.status != "running":
            continue
        if job.placement is None:
            charge = job.chips_milli
        else:
            charge = sum(share for cid, share in job.placement.items()
                         if cid in s.chips and job.job_id in s.chips[cid].jobs and s.chips[cid].available)
        assert job.charged_milli == charge, (job.job_id, job.charged_milli, charge)
        use[job.team] = use.get(job.team, 0) + charge
    rate = s.books.rate
    team_total = 0
    for name, team in s.teams.items():
        assert team.use_milli == use.get(name, 0), (name, team.use_milli, use.get(name, 0))
        nominal = sum(g.chips_milli for g in s.grants.values() if g.team == name and g.active)
        assert team.nominal_milli == nominal, (name, team.nominal_milli, nominal)
        assert min(team.use_milli, team.nominal_milli, team.burst_milli, team.running, team.pending) >= 0
        iq, bo, bu = rate(IN_QUOTA, name), rate(BORROWED, name), rate(BURST, name)
        assert (iq, bo, bu) == split_use(team.use_milli, team.nominal_milli, team.burst_milli)
        assert rate(ENTITLED, name) == team.nominal_milli
        waiting = [j for j in s.jobs.values() if j.team == name and j.status == "pending"]
        assert team.pending == len(waiting), (name, team.pending, len(waiting))
        assert team.pending_milli == sum(j.chips_milli for j in waiting), (name, team.pending_milli)
        assert rate(PENDING, name) == team.pending_milli
        team_total += iq + bo + bu
    assert s.charged_milli == team_total
    lhs = rate(CAPACITY) + rate(OVERCOMMITTED)
    rhs = rate(UNAVAILABLE) + rate(IDLE) + team_total
    assert lhs == rhs, f"conservation broken in {s.pool}: capacity+overcommitted={lhs} != {rhs}"
    assert min(rate(IDLE), rate(OVERCOMMITTED)) == 0
    for name, team in s.teams.items():
        active = sum(b[1] for b in s.bursts.values() if b[0] == name and b[4])
        assert team.burst_milli == active, (name, team.burst_milli, active)
    pc: dict = {}
    for j in s.jobs.values():
        if j.status == "running" and j.preemptible:
            pc.setdefault(j.team, {})
            pc[j.team][j.priority] = pc[j.team].get(j.priority, 0) + j.chips_milli
    assert pc == {k: v for k, v in s.prio_chips.items() if v}, (pc, s.prio_chips)
    assert all(j.status in ("pending", "running", HELD) for j in s.jobs.values())
    queued = {(j.team, j.job_id) for j in s.jobs.values() if j.status == "pending"}
    assert queued == {(t, jid) for t, q in s.waiting.items() for jid in q}, "policy queue index out of date"
    running = {(j.team, j.job_id) for j in s.jobs.values() if j.status == "running"}
    assert running == {(t, jid) for t, q in s.running_jobs.items() for jid in q}, "running index out of date"
    sizes: dict[int, int] = {}
    for j in s.jobs.values():
        if j.status == "pending":
            sizes[j.chips_milli] = sizes.get(j.chips_milli, 0) + 1
    assert sizes == s.pending_sizes, (sizes, s.pending_sizes)
    assert s.active_milli == sum(j.chips_milli for j in s.jobs.values()) <= MAX_POOL_MILLI, s.active_milli
    assert s.held_milli == sum(g.chips_milli for g in s.grants.values()) <= MAX_POOL_MILLI, s.held_milli
    for acc in s.books.accounts.values():
        assert acc[0] >= 0 and acc[2] >= 0 and acc[1] >= s.books.open_hour
    nodes: dict = {}
    for c in s.chips.values():
        n = nodes.setdefault(c.node, [0, 0])
        n[0] += 1
        n[1] += 1 if c.available and not c.jobs else 0
    assert nodes == s.nodes, (nodes, s.nodes)
    counts: dict = {}
    for reg, free in nodes.values():
        counts[free] = counts.get(free, 0) + 1
    assert counts == s.node_free_counts, (counts, s.node_free_counts)
    assert s.whole_free_milli == sum(MILLI * r for r, f in nodes.values() if r == f)
    assert s.unplaced_runs == sum(1 for j in s.jobs.values() if j.status == "running" and j.placement is None)
    _check_counters(s)
    if s.pending_sizes:
        ctx = policy.hol_context(s)
        for j in s.jobs.values():
            if j.status == "pending":
                why = policy.pending_reason(s, j, s.clock, DEFAULT_CONFIG, ctx)[0]
                assert policy.could_start(s, j, ctx) == (why in policy.STARTABLE), (j.job_id, why)
        if s.hol_groups is not None:  # head-of-line blocking is measured: its index against a look from scratch
            _check_hol(s, ctx)


def _check_counters(s: PoolState) -> None:
    """The monotonic counters: good never above total, nothing negative, every dead letter of the pool counted."""
    for team, (quota, honoured, started, within) in s.wait_counts.items():
        assert 0 <= honoured <= quota and 0 <= within <= started and honoured <= within, (team, quota, honoured,
                                                                                          started, within)
    for team, (alloc, lost) in s.run_counts.items():
        assert 0 <= lost <= alloc, (team, alloc, lost)
    for team, (judged, at_rate) in s.progress_counts.items():
        assert 0 <= at_rate <= judged, (team, judged, at_rate)
    for key, n in s.decision_counts.items():
        assert n > 0, key
    victims = 0
    for key, (n, lost) in s.victim_counts.items():
        assert n > 0 and lost >= 0, (key, n, lost)
        victims += n
    assert victims == 0 or s.decision_counts, "victims without a preemption decision"
    for key, cost in s.cost_counts.items():
        assert cost >= 0 and key[0] is not None, (key, cost)
    # equal but for a state saved before the counters existed (its earlier rejections have no code)
    assert sum(s.rejection_counts.values()) <= s.rejected, (s.rejection_counts, s.rejected)


def _check_hol(s: PoolState, ctx) -> None:
    """The jobs that accrue head-of-line blocking are those that could start, each with the first three jobs
    ahead of it in the pool's queue order that could not (what _hol keeps incrementally, computed whole)."""
    pending = [j for j in s.jobs.values() if j.status == "pending"]
    stuck = sorted((-j.priority, j.waiting_since, j.job_id) for j in pending if not policy.could_start(s, j, ctx))
    first = stuck[:3]
    for j in pending:
        ok = policy.could_start(s, j, ctx)
        assert (j.hol_from >= 0) == ok == (j.job_id in s.hol_able), (j.job_id, j.hol_from, ok)
        if ok:
            key = (-j.priority, j.waiting_since, j.job_id)
            assert j.hol_ahead == [k[2] for k in first if k < key], (j.job_id, j.hol_ahead, first)
    assert len(s.hol_able) == sum(1 for j in pending if j.hol_from >= 0)
    assert s.hol_order == sorted((-j.priority, j.waiting_since, j.job_id) for j in pending)
