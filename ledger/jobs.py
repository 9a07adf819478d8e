"""A job's life and its runs: job.submitted, job.started, job.preempted, job.released, job.finished, the checks
of the job events, and the postings `job_runs`.

The rules:
- a job is pending (waiting in its team's queue: ledger/waits.py), running, or held (preempted with held: in
  neither until its job.released); an id is one job until it finishes; the active jobs of a pool hold at most
  the pool bound (MAX_POOL_CHIPS);
- a start places the job's chips evenly on the chips it names (the first chips take one milli-chip more), or
  without a placement; it is charged what is on available chips (ledger/rates.py);
- a run ends by a preemption or a finish: its allocation not yet posted is posted (`job_runs`), with the work
  lost since its last checkpoint when preempted or failed; its chips are freed;
- a preempted job is back in its queue (a new wait) unless held; a job remembers its last
  MAX_PREEMPTIONS_KEPT preemptions (anti-thrash, ledger/policy.py);
- each check returns a Rejection, or None when the event may be applied; checks never change the state.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from schemas.codes import Rejection, RejectionCode as RC
from schemas.events import MAX_POOL_CHIPS, MAX_POOL_MILLI, to_milli

from ledger import costs, policy
from ledger.chips import _node_change
from ledger.rates import _use
from ledger.state import Job, PoolState
from ledger.step import (
    DEFAULT_CONFIG, FINISHED, HELD, LOSES_WORK, MAX_PREEMPTIONS_KEPT, MILLI, PREEMPTED, STARTED, Step, _chips_text,
    _new_tuple, _rows,
)
from ledger.waits import _count_wait, _dequeue, _enqueue, _wait_begins, _wait_row


class JobRunRow(NamedTuple):
    """A posting of one run of a job (start → preemption or finish). A run still going when the books are
    closed posts what it has allocated so far with `ended_at` None; the rest is posted when it ends."""

    pool: str
    job_id: str
    team: str
    run_index: int
    chips_milli: int
    priority: int
    submitted_at: int
    started_at: int
    ended_at: Optional[int]
    end_reason: Optional[str]  # preempted | succeeded | failed | cancelled | None (still running)
    allocated_mchip_s: int
    lost_mchip_s: int
    posted_at: int


_MILLI_OF: dict[str, int] = {}  # a job's chips (a Decimal's text) -> milli-chips; jobs come in few sizes (bounded memo)


def _check_job_submitted(s: PoolState, d: dict):
    j = s.jobs.get(d["job_id"])
    if j is not None:
        return Rejection(RC.illegal_transition, f"job {d['job_id']!r} is already {j.status}")
    milli = _milli_of(d["chips"])
    if s.active_milli + milli > MAX_POOL_MILLI:
        return Rejection(RC.over_limit, f"the pool's active jobs would hold {_chips_text(s.active_milli + milli)} "
                         f"chips, over the pool bound of {MAX_POOL_CHIPS:,} (docs/events.md, Limits)")
    return None


def _unknown_job(s: PoolState, d: dict) -> Rejection:
    return Rejection(RC.unknown_job, f"job {d['job_id']!r} is not pending, held or running in pool {s.pool!r}")


def _check_job_started(s: PoolState, d: dict):
    chip_ids = d["chip_ids"]
    if chip_ids is not None:
        chips = s.chips
        for c in chip_ids:
            if c not in chips:
                unknown = [c for c in chip_ids if c not in chips]
                return Rejection(RC.unknown_chip, f"chips not registered in pool {s.pool!r}: {', '.join(unknown[:5])}")
    j = s.jobs.get(d["job_id"])
    if j is None:
        return _unknown_job(s, d)
    if j.status == "running":
        return Rejection(RC.illegal_transition, f"job {d['job_id']!r} is already running")
    if chip_ids is not None and len(chip_ids) * MILLI < j.chips_milli:
        return Rejection(RC.illegal_transition,
                         f"job {d['job_id']!r} needs {j.chips_milli / MILLI:g} chips but was placed on {len(chip_ids)}")
    return None


def _check_job_running(s: PoolState, d: dict):
    j = s.jobs.get(d["job_id"])
    if j is None:
        return _unknown_job(s, d)
    if j.status != "running":
        return Rejection(RC.illegal_transition, f"job {d['job_id']!r} is {j.status}, not running ({d['type']})")
    return None


def _check_job_held(s: PoolState, d: dict):
    j = s.jobs.get(d["job_id"])
    if j is None:
        return _unknown_job(s, d)
    if j.status != HELD:
        return Rejection(RC.illegal_transition, f"job {d['job_id']!r} is {j.status}, not held (job.released releases "
                         f"a job.preempted with held)")
    return None


def _check_job_queued(s: PoolState, d: dict):
    """job.waiting: the job is in the queue (pending, or held: a scheduler gives its held jobs a reason too)."""
    j = s.jobs.get(d["job_id"])
    if j is None:
        return _unknown_job(s, d)
    if j.status == "running":
        return Rejection(RC.illegal_transition, f"job {d['job_id']!r} is running, not waiting (job.waiting)")
    return None


def _check_job_active(s: PoolState, d: dict):
    if d["job_id"] not in s.jobs:
        return _unknown_job(s, d)
    return None


def _apply_job_submitted(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    milli = _milli_of(d["chips"])
    job_id = d["job_id"]
    team = d["team"]
    job = s.jobs[job_id] = Job(job_id, team, milli, d["priority"], d["preemptible"], d["chips_per_node"], t)
    s.active_milli += milli
    s.team(team)
    _enqueue(s, job, t)


def _milli_of(chips) -> int:
    """A job's chips (a Decimal) as milli-chips: e.chips_milli, memoized (Decimal arithmetic costs more than the
    rest of a submission). (core: memo) keyed by the Decimal's text; equal texts are equal values."""
    key = str(chips)
    milli = _MILLI_OF.get(key)
    if milli is None:
        if len(_MILLI_OF) >= 4096:
            _MILLI_OF.clear()
        milli = _MILLI_OF[key] = to_milli(chips)
    return milli


def _apply_job_started(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    job = s.jobs[d["job_id"]]
    name = job.team
    team = s.teams[name]
    held = job.status == HELD
    job.status = "running"
    job.run_index += 1
    job.run_started_at = job.last_safe_at = job.since = t
    if job.waiting_reason is not None:  # the wait it explained is over
        job.waiting_reason = job.waiting_message = None
    if job.first_started_at is None:
        job.first_started_at = t
    job.run_alloc_mchip_s = job.run_posted_mchip_s = job.alloc_at_safe_mchip_s = 0
    if job.charge_changes:
        job.charge_changes = []
    if held:  # started as it was released: a wait of 0 s (it was never pending), posted and counted like any other
        _wait_begins(s, job, t)
        row = _wait_row(s, job, job.run_index - 1, t, STARTED, t)
        _rows(step, "waits").append(row)
        _count_wait(s, job, row, t, STARTED, config)
    else:
        _dequeue(s, job, t, step, job.run_index - 1, STARTED, config)
    team.running += 1
    s.run_epoch += 1
    te = s.team_epoch
    te[name] = te.get(name, 0) + 1
    chips_milli = job.chips_milli
    if job.preemptible:
        pc = s.prio_chips.get(name)
        if pc is None:
            pc = s.prio_chips[name] = {}
        pc[job.priority] = pc.get(job.priority, 0) + chips_milli
    r = s.running_jobs.get(name)
    if r is None:
        r = s.running_jobs[name] = {}
    job_id = job.job_id
    r[job_id] = job
    chip_ids = d["chip_ids"]
    if chip_ids is None:
        job.placement = None
        charge = chips_milli
        s.unplaced_runs += 1
    else:  # spread evenly; the first `extra` chips take one milli-chip more
        n = len(chip_ids)
        base, extra = divmod(chips_milli, n)
        chips = s.chips
        if base and not extra:  # the common case: whole chips
            job.placement = dict.fromkeys(chip_ids, base)
            node = ""
            taken = 0  # chips of `node` that were free (a job's chips are mostly on one node: one change per node)
            for chip_id in chip_ids:
                chip = chips[chip_id]
                if not chip.jobs and chip.available:  # the chip was free
                    if chip.node != node:
                        if taken:
                            _node_change(s, node, 0, -taken)
                        node = chip.node
                        taken = 0
                    taken += 1
                chip.jobs[job_id] = base
            if taken:
                _node_change(s, node, 0, -taken)
            charge = base * n
            down = s.down
            if down:  # shares on unavailable chips are not charged
                charge -= base * len(down.intersection(chip_ids))
        else:
            charge = 0
            placement = job.placement = {}
            for i, chip_id in enumerate(chip_ids):
                share = base + 1 if i < extra else base
                if share:
                    placement[chip_id] = share
                    chip = chips[chip_id]
                    if not chip.jobs and chip.available:
                        _node_change(s, chip.node, 0, -1)
                    chip.jobs[job_id] = share
                    if chip.available:
                        charge += share
    job.charged_milli = charge
    if charge:  # job.since is t: nothing to accrue before the charge
        _use(s, team, charge, t)


def interruption_cause(d: dict) -> str:
    """The cause of a job.preempted (its fields): a decision's id on it makes it a preemption whatever it says
    (the actuator carried out the ledger's decision, by whatever mechanism); absent, preempted."""
    cause = d["cause"]
    if cause is None or d["decision_id"] is not None:
        return PREEMPTED
    return cause


def _apply_job_preempted(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    job = s.jobs[d["job_id"]]
    cause = interruption_cause(d)
    _end_run(s, job, t, cause, step)  # the run's end_reason is the cause; work since the checkpoint is lost for each
    if cause == PREEMPTED:  # only a preemption counts (max_preemptions, anti-thrash): DESIGN §4's cause table
        job.preemptions += 1
        job.preempted_at.append(t)
        if len(job.preempted_at) > MAX_PREEMPTIONS_KEPT:  # only the last max_preemptions matter
            del job.preempted_at[0]
    if d["held"]:  # back in the queue but not eligible yet: no demand and no wait until its job.released
        job.status = HELD
    else:
        job.status = "pending"
        _enqueue(s, job, t)


def _apply_job_released(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    job = s.jobs[d["job_id"]]
    job.status = "pending"
    _enqueue(s, job, t)  # its wait begins now (fact `waits`: began_at is the release)


def _apply_job_finished(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    job = s.jobs.pop(d["job_id"])
    s.active_milli -= job.chips_milli
    status = job.status
    if status == "running":
        _end_run(s, job, t, d["outcome"], step)
    elif status == "pending":
        _dequeue(s, job, t, step, job.run_index, FINISHED, config)


def _end_run(s: PoolState, job: Job, t: int, reason: str, step: Step) -> None:
    """Close a running job's run: post the rest of its allocation and the work lost, release its chips."""
    charged = job.charged_milli
    alloc = job.run_alloc_mchip_s = job.run_alloc_mchip_s + charged * (t - job.since)
    job.since = t
    # work since the last checkpoint is lost when a run is interrupted (any cause) or fails; not when it succeeds or
    # is cancelled
    lost = alloc - job.alloc_at_safe_mchip_s if reason in LOSES_WORK else 0
    name = job.team
    job_id = job.job_id
    amount = alloc - job.run_posted_mchip_s
    row = _new_tuple(JobRunRow, (s.pool, job_id, name, job.run_index, job.chips_milli, job.priority,
                                 job.submitted_at, job.run_started_at, t, reason, amount, lost, t))
    _rows(step, "job_runs").append(row)
    if s.prices:  # a priced pool: what the run cost, its peak use and its cost started off-peak (fact `run_costs`)
        costs.run_ended(s, job, t, reason, charged, _rows(step, "run_costs"))
    # the goodput counters count the whole run as it ends (its row holds only what a close of the books had not
    # posted yet), so that allocated - lost never goes back
    rc = s.run_counts.get(name)
    if rc is None:
        rc = s.run_counts[name] = [0, 0]
    rc[0] += alloc
    rc[1] += lost
    team = s.teams[name]
    if charged:
        job.charged_milli = 0
        _use(s, team, -charged, t)
    placement = job.placement
    if placement is None:
        s.unplaced_runs -= 1
    elif placement:
        chips = s.chips
        node = ""
        freed = 0
        for chip_id in placement:
            chip = chips.get(chip_id)
            if chip is None:  # the chip was retired
                continue
            cj = chip.jobs
            if job_id in cj:  # (not if retired and registered anew)
                del cj[job_id]
                if not cj and chip.available:  # the chip is free again
                    if chip.node != node:
                        if freed:
                            _node_change(s, node, 0, freed)
                        node = chip.node
                        freed = 0
                    freed += 1
        if freed:
            _node_change(s, node, 0, freed)
    job.placement = None
    team.running -= 1
    del s.running_jobs[name][job_id]
    s.run_epoch += 1
    te = s.team_epoch
    te[name] = te.get(name, 0) + 1
    if job.preemptible:
        pc = s.prio_chips[name]
        left = pc[job.priority] - job.chips_milli
        if left:
            pc[job.priority] = left
        else:
            del pc[job.priority]
    if s.marked:
        policy.victim_gone(s, job_id)


def _run_row(s: PoolState, job: Job, t: int, ended_at, reason, amount: int, lost: int) -> JobRunRow:
    return _new_tuple(JobRunRow, (s.pool, job.job_id, job.team, job.run_index, job.chips_milli, job.priority,
                     job.submitted_at, job.run_started_at, ended_at, reason, amount, lost, t))


def _accrue_job(job: Job, t: int) -> None:
    job.run_alloc_mchip_s += job.charged_milli * (t - job.since)
    job.since = t
