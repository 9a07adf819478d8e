"""The queues and the waits (fact `waits`): a job waits to start from its submission, its preemption or the
release of a held job, until it starts or finishes.

The rules:
- a waiting job's chips are its team's pending demand (the `pending` account) and it is in its team's queue for
  the policy (ledger/policy.py) and in the head-of-line index (ledger/hol.py);
- a wait notes, when it begins, its team's nominal quota and use: whether it fitted the team's unused quota
  (`in_quota`) and whether the team was borrowing;
- a wait is posted when it ends (`started` or `finished`), and while still open at the close of the hour it
  began in and at a close of the books (`open`; a later posting of the same wait supersedes it);
- each wait that ends is counted for the wait SLOs (PoolState.wait_counts: in quota, honoured, started, started
  within [slo] sched_slo_s).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from ledger import policy
from ledger.books import HOUR_S
from ledger.hol import _hol_join, _hol_leave
from ledger.rates import _pending_demand
from ledger.state import Job, PoolState
from ledger.step import OPEN, STARTED, FoldConfig, Step, _new_tuple, _rows


class WaitRow(NamedTuple):
    """A fact (lake table `waits`): one wait of a job to be started, posted when it ends (`end` started, or
    finished while pending), and at a close of the books while still open (`end` open, `ended_at` None; a later
    posting of the same wait supersedes it). `in_quota` and `borrowing` are the team's state when it began."""

    pool: str
    job_id: str
    team: str
    run_index: int   # the run it leads to: 0 the first start, 1 the first restart, ...
    kind: str        # first_start | restart
    priority: int
    chips_milli: int
    submitted_at: int
    began_at: int    # the submission, the preemption, or the release of a held job
    ended_at: Optional[int]
    end: str         # started | finished | open
    in_quota: bool   # it fitted its team's unused nominal quota (nominal - use) when it began
    borrowing: bool  # its team used more than its nominal quota when it began
    team_nominal_milli: int  # the team's nominal quota (grants in effect) when it began
    team_used_milli: int     # the chips the team was charged for when it began
    blocked_s: int   # head-of-line blocking (seconds it could have started and did not)
    blocked_by: str  # the waiting jobs ahead of it that held the chips then (comma-separated, at most 3)
    posted_at: int


def _enqueue(state: PoolState, job: Job, t: int) -> None:
    """The job starts waiting: its chips join its team's pending demand and the policy's queue of the team; the
    wait notes whether it fits the team's unused nominal quota and whether the team borrows (fact `waits`)."""
    name = job.team
    milli = job.chips_milli
    _pending_demand(state, name, 1, milli, t)
    _wait_begins(state, job, t)
    state.queue_changes += 1
    q = state.waiting.get(name)
    if q is None:
        q = state.waiting[name] = {}
    q[job.job_id] = job
    if state.hol_groups is not None:
        _hol_join(state, job)
    sizes = state.pending_sizes
    sizes[milli] = sizes.get(milli, 0) + 1
    heads = state.heads.get(name)
    if heads is not None:  # keep the cached queue head (top candidates_per_team jobs) without a full sort
        key = (-job.priority, t, job.job_id)
        if len(heads) < state.heads_k:
            heads.append(job)
            heads.sort(key=policy.queue_key)
        elif heads and key < policy.queue_key(heads[-1]):
            heads[-1] = job
            heads.sort(key=policy.queue_key)


def _dequeue(state: PoolState, job: Job, t: int, step: Step, run_index: int, end: str, config: FoldConfig) -> None:
    """The job stops waiting (it started or finished): its chips leave its team's pending demand and queue, and
    its wait is posted (fact `waits`) and counted for the wait SLOs (PoolState.wait_counts)."""
    row = _wait_row(state, job, run_index, t, end, t)
    _rows(step, "waits").append(row)
    state.queue_changes += 1
    _count_wait(state, job, row, t, end, config)
    name = job.team
    milli = job.chips_milli
    _pending_demand(state, name, -1, -milli, t)
    job_id = job.job_id
    del state.waiting[name][job_id]
    if state.hol_groups is not None:
        _hol_leave(state, job)
    sizes = state.pending_sizes
    n = sizes[milli] - 1
    if n:
        sizes[milli] = n
    else:
        del sizes[milli]
    # skip the call when there is no policy state to settle; the test reads only state that a checkpoint
    # carries (blocked is a memo, rebuilt after a restore, so it cannot decide what the state becomes)
    if state.short_since or state.inflight or state.ignored or state.wakes or state.blocked:
        policy.job_left_queue(state, job_id)
    heads = state.heads.get(name)
    if heads is not None:
        for h in heads:
            if h is job:  # identity: Job's dataclass __eq__ compares every field
                del state.heads[name]
                break


def _wait_begins(state: PoolState, job: Job, t: int) -> None:
    """A wait of the job begins at t (fact `waits`): it notes its team's nominal quota and use then."""
    job.waiting_since = t
    team = state.teams[job.team]
    job.wait_nominal_milli = team.nominal_milli
    job.wait_used_milli = team.use_milli
    job.hol_s = 0
    job.hol_from = -1
    if job.hol_ahead:
        job.hol_ahead = []
    if job.hol_blockers:
        job.hol_blockers = {}


def _count_wait(state: PoolState, job: Job, row, t: int, end: str, config: FoldConfig) -> None:
    """Count a wait that ended (its row posted) for the wait SLOs (PoolState.wait_counts: in quota, honoured,
    started, within sched_slo_s)."""
    wc = state.wait_counts.get(job.team)
    if wc is None:
        wc = state.wait_counts[job.team] = [0, 0, 0, 0]
    if end == STARTED:
        within = 1 if t - job.waiting_since <= config.sched_slo_s else 0
        wc[2] += 1
        wc[3] += within
        if row[11]:  # in_quota
            wc[0] += 1
            wc[1] += within
    elif row[11]:
        wc[0] += 1


def _wait_row(s: PoolState, job: Job, run_index: int, ended_at: Optional[int], end: str, t: int) -> WaitRow:
    nominal = job.wait_nominal_milli
    used = job.wait_used_milli
    chips = job.chips_milli
    blocked = job.hol_s
    by = ""
    if blocked or job.hol_from >= 0:
        blockers = job.hol_blockers
        f = job.hol_from
        if f >= 0 and t > f:  # the seconds it could have started up to now
            blocked += t - f
            if job.hol_ahead:
                blockers = dict(blockers)
                for b in job.hol_ahead:
                    blockers[b] = blockers.get(b, 0) + t - f
        if blockers:
            by = ",".join(sorted(blockers, key=lambda b: (-blockers[b], b))[:3])
    return _new_tuple(WaitRow, (s.pool, job.job_id, job.team, run_index,
                                "first_start" if run_index == 0 else "restart", job.priority, chips,
                                job.submitted_at, job.waiting_since, ended_at, end, chips <= nominal - used,
                                used > nominal, nominal, used, blocked, by, t))


def _post_open_waits(s: PoolState, hour_start: int, step: Step) -> None:
    """At the close of an hour, the waits that began in it and are still open (so a reader of a lake the Kafka
    sink writes, whose books are never closed early, sees a long wait within the hour after it began)."""
    began = [job for queue in s.waiting.values() for job in queue.values() if job.waiting_since >= hour_start]
    if began:
        began.sort(key=_wait_order)  # the order of the queues is not kept by a saved state
        rows = _rows(step, "waits")
        for job in began:
            rows.append(_wait_row(s, job, job.run_index, None, OPEN, hour_start + HOUR_S))


def _wait_order(job: Job) -> tuple:
    return (job.waiting_since, job.job_id)
