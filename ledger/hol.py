"""Head-of-line blocking (fact `waits`: blocked_s and blocked_by): the seconds a pending job could have started
and did not, and the waiting jobs ahead of it that held the chips then.

The rules:
- a pending job could start iff it has no decision in flight and fits what its team could start with now
  (policy.could_start; for a job asking for chips per node, whole free nodes);
- such a job accrues blocked seconds from the instant it could start until it starts or no longer could, and
  so does each of the first three jobs ahead of it in the pool's queue order (priority, then waiting longest,
  then job id) that could not start: they are its blockers;
- the blocked seconds are posted with the job's wait (ledger/waits.py).

The look (`_hol`, after an event that changed the chips, the quotas, the decisions in flight or the queues) is
incremental over an index of the queues by (team, chips per node); ledger/invariants.py checks it against a
look from scratch.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any, Optional

from ledger import policy
from ledger.state import Job, PoolState
from ledger.step import NEVER


def _hol(s: PoolState, t: int) -> None:
    """Head-of-line blocking at t, after the event: each pending job that could start now (policy.could_start)
    and did not accrues blocked seconds from now on, and so do the waiting jobs ahead of it in the pool's queue
    order (priority, then waiting longest, then job id) that could not start (the first 3): they held the chips.
    A job whose state and blockers did not change keeps accruing from where it began.

    Incremental: a pending job could start iff it has no decision in flight and its chips are at most what its
    group (team, chips per node) could start with (policy.startable_milli, and whole_nodes_milli for a job asking
    for chips per node). Only the jobs whose chips lie between a group's figure at the last look and now, the
    jobs queued since, and those whose decision in flight came or went are looked at; the first three jobs that
    cannot start are the first of the pool's queue order not among those that can, and the blockers of every job
    that can start are looked at again only when those three changed."""
    s.hol_sig = (s.run_epoch, s.other_epoch, s.queue_changes, s.capacity_milli)
    # (core: typed) locals
    groups: dict[tuple[str, Optional[int]], list[tuple[int, str, Job]]]
    if s.hol_groups is None:
        groups = _hol_index(s)
    else:
        groups = s.hol_groups
    ctx = policy.hol_context(s)
    teams = s.teams
    inflight = s.inflight
    able = s.hol_able
    most: dict[tuple[str, Optional[int]], int] = s.hol_max
    newly: list = []
    team_most: dict[str, int] = {}
    whole: dict[int, int] = {}
    for gkey, members in groups.items():
        name = gkey[0]
        tm = team_most.get(name)
        if tm is None:
            m = team_most[name] = policy.startable_milli(s, teams[name], ctx)
        else:
            m = tm
        # a figure below the group's smallest job, or at least its largest, says the same of every job in it
        smallest = members[0][0]
        if m < smallest:
            m = -1
        else:
            cpn = gkey[1]
            if cpn is not None:
                wc = whole.get(cpn)
                if wc is None:
                    w = whole[cpn] = policy.whole_nodes_milli(s, cpn)
                else:
                    w = wc
                if w < m:
                    m = w if w >= smallest else -1
            if m >= members[-1][0]:
                m = NEVER
        old = most.get(gkey)
        if old == m:
            continue
        most[gkey] = m
        if old is None:
            lo, hi = 0, len(members)
        elif old < m:
            lo, hi = bisect_left(members, (old + 1,)), bisect_left(members, (m + 1,))
        else:
            lo, hi = bisect_left(members, (m + 1,)), bisect_left(members, (old + 1,))
        for i in range(lo, hi):
            _hol_verdict(s, members[i][2], m, t, newly)
    if s.hol_new:
        for job in s.hol_new.values():
            _hol_verdict(s, job, most[(job.team, job.chips_per_node)], t, newly)
        s.hol_new = {}
    if inflight or s.hol_inflight:
        now = set(inflight)
        jobs = s.jobs
        for jid in now ^ s.hol_inflight:
            job = jobs.get(jid)
            if job is not None and job.status == "pending":
                _hol_verdict(s, job, most[(job.team, job.chips_per_node)], t, newly)
        s.hol_inflight = now
    s.hol_any = bool(able)
    if not able:
        s.hol_first = None
        return
    first: list = []
    order: list[tuple[int, int, str]] = s.hol_order
    for k in order:
        if k[2] not in able:
            first.append(k)
            if len(first) == 3:
                break
    todo = newly if first == s.hol_first else list(able.values())
    s.hol_first = first
    for job in todo:
        if first:
            key = (-job.priority, job.waiting_since, job.job_id)
            head = [k[2] for k in first if k < key]
        else:
            head = []
        if job.hol_from >= 0:
            if job.hol_ahead == head:
                continue
            _hol_accrue(job, t)
        job.hol_from = t
        job.hol_ahead = head


def _hol_verdict(s: PoolState, job: Job, most_milli: int, t: int, newly: list) -> None:
    """Whether the job could start now (at most `most_milli` chips, no decision in flight): one that now can joins
    `newly` (its blockers are set after), one that no longer can stops accruing."""
    jid = job.job_id
    if job.chips_milli <= most_milli and jid not in s.inflight:
        if jid not in s.hol_able:
            s.hol_able[jid] = job
            newly.append(job)
    elif jid in s.hol_able:
        del s.hol_able[jid]
        if job.hol_from >= 0:
            _hol_accrue(job, t)
            job.hol_from = -1
            job.hol_ahead = []


def _hol_index(s: PoolState) -> dict:
    """Build the head-of-line index from the queues (first look, or after a restore): every group is looked at
    whole at the next look, and every job's blockers."""
    groups: dict = {}
    order: list = []
    able: dict = {}
    for queue in s.waiting.values():
        for job in queue.values():
            gkey = (job.team, job.chips_per_node)
            g = groups.get(gkey)
            if g is None:
                g = groups[gkey] = []
            g.append((job.chips_milli, job.job_id, job))
            order.append((-job.priority, job.waiting_since, job.job_id))
            if job.hol_from >= 0:
                able[job.job_id] = job
    for g in groups.values():
        g.sort(key=_member_key)
    order.sort()
    s.hol_groups = groups
    s.hol_order = order
    s.hol_max = {}
    s.hol_able = able
    s.hol_new = {}
    s.hol_inflight = set()
    s.hol_first = None
    return groups


def _member_key(m: tuple) -> tuple:
    return (m[0], m[1])


def _hol_join(s: PoolState, job: Job) -> None:
    """A job joined a queue (its waiting_since set): into the head-of-line index, looked at at the next look."""
    groups: Any = s.hol_groups
    gkey = (job.team, job.chips_per_node)
    g = groups.get(gkey)
    if g is None:
        g = groups[gkey] = []
    g.insert(bisect_left(g, (job.chips_milli, job.job_id)), (job.chips_milli, job.job_id, job))
    insort(s.hol_order, (-job.priority, job.waiting_since, job.job_id))
    s.hol_new[job.job_id] = job


def _hol_leave(s: PoolState, job: Job) -> None:
    """A job left its queue: out of the head-of-line index (its wait was posted with its blocked seconds)."""
    groups: Any = s.hol_groups
    gkey = (job.team, job.chips_per_node)
    g = groups[gkey]
    del g[bisect_left(g, (job.chips_milli, job.job_id))]
    if not g:
        del groups[gkey]
        s.hol_max.pop(gkey, None)
    order = s.hol_order
    del order[bisect_left(order, (-job.priority, job.waiting_since, job.job_id))]
    jid = job.job_id
    s.hol_able.pop(jid, None)
    s.hol_new.pop(jid, None)


def _hol_accrue(job: Job, t: int) -> None:
    """Add the seconds since hol_from to the job's blocked seconds and to each blocker ahead of it."""
    dt = t - job.hol_from
    if dt > 0:
        job.hol_s += dt
        hb = job.hol_blockers
        for b in job.hol_ahead:
            hb[b] = hb.get(b, 0) + dt
