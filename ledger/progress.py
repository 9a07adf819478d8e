"""Throughput (fact `progress`; docs/analytics.md, "throughput"): job.progress, and job.checkpointed with units.

The rules:
- a running job reports its cumulative units done; the count never goes back within a run, and a restarted
  run continues from its last checkpoint's count; a job reports in one unit;
- the first report of a run is its baseline (a start's set-up is not work); each later report closes the
  interval since the previous one: units per chip-second the job was charged in it (a fact row);
- a job's reference rate is the median rate of its first stretch of healthy intervals lasting
  [slo] throughput_reference_s, of at least throughput_reference_reports intervals (at most
  MAX_REFERENCE_REPORTS); an unhealthy interval ends the stretch;
- once the reference is known, an interval is slow when its rate is below throughput_fraction of it; judged
  intervals count for the throughput SLO (PoolState.progress_counts);
- an interval is healthy when every chip the job held was healthy throughout (ledger/chips.py notes the others);
- a checkpoint is the job's safe point: the work lost at a preemption is the allocation since it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from schemas.codes import Rejection, RejectionCode as RC

from ledger import policy
from ledger.jobs import _check_job_running
from ledger.state import Job, PoolState, Progress
from ledger.step import DEFAULT_CONFIG, MAX_REFERENCE_REPORTS, MILLI, FoldConfig, Step, _new_tuple, _rows


class ProgressRow(NamedTuple):
    """A fact (lake table `progress`): one interval between two progress reports of a run of a job, posted at
    the second report. The first report of a run is its baseline (a start's set-up is not work). The rate is
    the units done per chip-second the job was charged in the interval; it is judged against the job's
    reference rate once that is known (`slow` None before: the interval is not judged)."""

    pool: str
    job_id: str
    team: str
    run_index: int
    submitted_at: int        # tells a job from an earlier one of the same id (as in job_runs and waits)
    unit: str
    began_at: int            # the previous report of the run
    ended_at: int            # this report
    units_from: int          # cumulative counts at the two reports
    units_to: int
    chips_milli: int         # the job's chips
    charged_mchip_s: int     # chip-seconds the job was charged in the interval (shares on unavailable chips are not)
    units_per_chip_s: Optional[float]            # None when nothing was charged (every chip it held was down)
    reference_units_per_chip_s: Optional[float]  # the job's reference rate, None until it is known
    slow: Optional[bool]     # units_per_chip_s < throughput_fraction × reference; None: not judged
    slow_s: int              # the interval's seconds when slow, else 0
    healthy: bool            # every chip it held was healthy throughout (a job without placement: True)
    unhealthy_chips: str     # the chips it held that were not healthy at some instant, "chip:state", sorted
    held_chips: str          # when slow: every chip it held with its state now (unhealthy first; at most 16)
    posted_at: int


MAX_HELD_LISTED = 16


def _check_job_progress(s: PoolState, d: dict):
    rejection = _check_job_running(s, d)
    if rejection is not None:
        return rejection
    j = s.jobs[d["job_id"]]
    pr = j.progress
    if pr is not None and pr.unit and d["unit"] != pr.unit:
        return Rejection(RC.illegal_transition, f"job {d['job_id']!r} reports its progress in {_unit_text(pr.unit)}, "
                         f"not {_unit_text(d['unit'])}")
    return _check_units(s, d, j)


def _check_job_checkpointed(s: PoolState, d: dict):
    rejection = _check_job_running(s, d)
    if rejection is None and d["units"] is not None:
        return _check_units(s, d, s.jobs[d["job_id"]])
    return rejection


def _check_units(s: PoolState, d: dict, job: Job):
    """A progress count never goes back within a run, and a restart continues from the last checkpoint's count."""
    pr = job.progress
    if pr is None:
        return None
    units = d["units"]
    if pr.run == job.run_index:
        if units < pr.units:
            return Rejection(RC.progress_backwards, f"job {d['job_id']!r}: units {units} is below {pr.units}, the "
                             f"count it reported at {policy._utc(pr.at)} UTC in this run")
    elif units < pr.safe:
        return Rejection(RC.progress_backwards, f"job {d['job_id']!r}: units {units} is below {pr.safe}, the "
                         f"count of its last checkpoint: a restarted run continues from there")
    return None


def _unit_text(unit: str) -> str:
    return repr(unit) if len(unit) <= 64 else repr(unit[:64]) + "…"


def _apply_job_progress(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    pr = _progress(s, s.jobs[d["job_id"]], d["units"], t, step, config)
    if not pr.unit:
        pr.unit = d["unit"]


def _apply_job_checkpointed(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    job = s.jobs[d["job_id"]]
    units = d["units"]
    if units is not None:  # a progress report too (before the checkpoint's own accrual: it reads the allocation)
        _progress(s, job, units, t, step, config).safe = units
    else:
        pr = job.progress
        if pr is not None and pr.run == job.run_index:  # the count at the checkpoint is at least the run's last
            pr.safe = pr.units
    job.alloc_at_safe_mchip_s = job.run_alloc_mchip_s = job.run_alloc_mchip_s + job.charged_milli * (t - job.since)
    job.since = job.last_safe_at = t


def _progress(s: PoolState, job: Job, units: int, t: int, step: Step, config: FoldConfig) -> Progress:
    """A progress report of a running job (its count passed _check_units): close the open interval (a fact row)
    and open the next one. The count is kept whatever the interval: a report in the same second as the previous
    one closes none (the next interval starts at the earlier report). Returns the job's Progress."""
    pr = job.progress
    if pr is None:
        pr = job.progress = Progress()
    alloc = job.run_alloc_mchip_s + job.charged_milli * (t - job.since)
    if pr.run != job.run_index:  # the run's first report: its baseline
        pr.run = job.run_index
        pr.unhealthy = _unhealthy_now(s, job)
    elif t > pr.at:
        bad = pr.unhealthy
        healthy = not bad
        charged = alloc - pr.alloc_mchip_s
        dt = t - pr.at
        rate: Optional[float] = None
        ref: Optional[float] = None
        slow: Optional[bool] = None
        if charged > 0:
            rate = (units - pr.units_from) * MILLI / charged
            if pr.ref_rate >= 0.0:
                ref = pr.ref_rate
                slow = rate < config.throughput_fraction * ref
            elif healthy:  # the first stretch of healthy intervals gives the job its reference rate
                pr.ref_rates.append(rate)
                pr.ref_s += dt
                n = len(pr.ref_rates)
                if n >= config.throughput_reference_reports and (pr.ref_s >= config.throughput_reference_s
                                                                 or n >= MAX_REFERENCE_REPORTS):
                    pr.ref_rate = _median(pr.ref_rates)
                    pr.ref_rates = []
            else:  # an unhealthy interval ends the stretch: it starts again at the next healthy one
                if pr.ref_rates:
                    pr.ref_rates = []
                pr.ref_s = 0
        if slow is not None:  # judged: counted for the throughput SLO (PoolState.progress_counts)
            pc = s.progress_counts.get(job.team)
            if pc is None:
                pc = s.progress_counts[job.team] = [0, 0]
            pc[0] += charged
            if not slow:
                pc[1] += charged
        _rows(step, "progress").append(_new_tuple(ProgressRow, (
            s.pool, job.job_id, job.team, job.run_index, job.submitted_at, pr.unit, pr.at, t, pr.units_from, units,
            job.chips_milli, charged, rate, ref, slow, dt if slow else 0, healthy,
            ",".join(f"{c}:{bad[c]}" for c in sorted(bad)), _held_text(s, job) if slow else "", t)))
        if bad:
            pr.unhealthy = _unhealthy_now(s, job)
    else:
        pr.units = units
        return pr
    pr.units = pr.units_from = units
    pr.at = t
    pr.alloc_mchip_s = alloc
    return pr


def _median(values: list) -> float:
    v = sorted(values)
    n = len(v)
    mid = n // 2
    return float(v[mid]) if n % 2 else (v[mid - 1] + v[mid]) / 2.0


def _unhealthy_now(s: PoolState, job: Job) -> dict:
    """The chips of a job's placement that are not healthy now (chip id -> state)."""
    out: dict = {}
    placement = job.placement
    if placement:
        chips = s.chips
        for chip_id in placement:
            chip = chips.get(chip_id)
            if chip is not None and chip.state != "healthy" and job.job_id in chip.jobs:
                out[chip_id] = chip.state
    return out


def _held_text(s: PoolState, job: Job) -> str:
    placement = job.placement
    if not placement:
        return ""
    chips = s.chips
    held = [(chip_id, chips[chip_id].state) for chip_id in placement
            if chip_id in chips and job.job_id in chips[chip_id].jobs]
    held.sort(key=lambda cs: (cs[1] == "healthy", cs[0]))
    text = ",".join(f"{c}:{st}" for c, st in held[:MAX_HELD_LISTED])
    if len(held) > MAX_HELD_LISTED:
        text += f",+{len(held) - MAX_HELD_LISTED} more"
    return text
