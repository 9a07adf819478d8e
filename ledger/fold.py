"""The fold: `evolve(state, event) -> (state, step)`, pure, deterministic, integer.

No I/O, no wall clock, no logging. Time advances only with `occurred_at` (ledger/clock.py). For speed the fold
updates the `PoolState` it is given and returns it; `PoolState.copy()` keeps a snapshot. A rejected or duplicate
event changes nothing but counters.

The rules of one event, in order (evolve):
0. an event further ahead of its append time (`appended_s`, from the edge) than [ledger] max_clock_skew_s is
   `clock_ahead`: it never moves, nor starts, a pool clock;
1. a pool exists from its `pool.configured` on (before it: `unknown_pool`);
2. ids are deduplicated per (origin, event_id): an id its origin sent before with byte-identical bytes is a
   duplicate (dropped, counted); with other bytes it is `duplicate_conflict`, after the checks below;
3. time: an event further behind the clock than the dedup window is `too_late` (it cannot be told from a re-sent
   one whose id was forgotten); one further ahead than [ledger] max_clock_jump_s is `clock_jump`;
4. the check of its type (each concern's module: ledger/chips.py, grants.py, jobs.py, progress.py; prices.py);
5. the clock advances to it (a late event is applied at the clock, its lateness recorded), closing hours and
   applying boundaries on the way (ledger/clock.py);
6. the apply of its type, then the free chips fact when the capacity may have changed;
7. preemption looks at the pending jobs the event concerns (ledger/policy.py), and head-of-line blocking is
   measured again when what it depends on changed (ledger/hol.py);
8. its id is remembered for the dedup window.

The other modules of the fold, and the compiled core's idioms (the `(core: NAME)` notes), are listed in
ledger/step.py. The names other packages import from here are re-exported below.
"""

from __future__ import annotations

from typing import Any, Final, Optional

from schemas.codes import Rejection, RejectionCode as RC
from schemas.events import epoch_s

from ledger import costs, policy, prices
from ledger.books import Books, hour_of
from ledger.chips import (
    ChipStateRow, FreeChipsRow, _apply_chip_registered, _apply_chip_retired, _apply_chip_state_changed,
    _check_chip_known, _check_chip_registered, _free_chips_changed, _post_free_chips, free_chips_values,
)
from ledger.clock import _advance, _forget_ids, close_books, close_facts, policy_rows
from ledger.grants import (
    GrantIntervalRow, _apply_burst_requested, _apply_quota_granted, _apply_quota_revoked, _check_quota_granted,
    _check_quota_revoked,
)
from ledger.hol import _hol
from ledger.invariants import _check_counters, check_invariants
from ledger.jobs import (
    JobRunRow, _apply_job_finished, _apply_job_preempted, _apply_job_released, _apply_job_started,
    _apply_job_submitted, _check_job_active, _check_job_held, _check_job_queued, _check_job_running,
    _check_job_started, _check_job_submitted, interruption_cause,
)
from ledger.progress import (
    ProgressRow, _apply_job_checkpointed, _apply_job_progress, _check_job_checkpointed, _check_job_progress,
)
from ledger.rates import split_use
from ledger.state import ORIGIN_SEP, PoolState, digest_of, fingerprint, origin_of
from ledger.step import (
    DEFAULT_CONFIG, DEFAULT_DEDUP_WINDOW_S, DEFAULT_MAX_CLOCK_JUMP_S, DEFAULT_MAX_CLOCK_SKEW_S, HELD, OFFSET_S,
    UNIX_ORDINAL, FoldConfig, Step, _new_object, _rows,
)
from ledger.waits import WaitRow

__all__ = [  # what other packages import from ledger.fold (each defined in its concern's module)
    "DEFAULT_CONFIG", "DEFAULT_DEDUP_WINDOW_S", "DEFAULT_MAX_CLOCK_JUMP_S", "DEFAULT_MAX_CLOCK_SKEW_S", "HELD",
    "ChipStateRow", "FoldConfig", "FreeChipsRow", "GrantIntervalRow", "JobRunRow", "ProgressRow", "Step", "WaitRow",
    "check_invariants", "close_books", "close_facts", "evolve", "free_chips_values", "policy_rows", "split_use",
    "_check_counters", "interruption_cause",
]


# what preemption looks at after an event (evolve): nothing, the job of the event, or every queue's head
_NO_LOOK: Final = 0
_JOB: Final = 1
_ALL: Final = 2


def evolve(state: Optional[PoolState], event, config: FoldConfig = DEFAULT_CONFIG, raw: Any = None, *,
           origin: Optional[str] = None, appended_s: Optional[int] = None):
    """Apply one validated event to its pool's state. Returns (state, Step).

    `state` is None for a pool never configured; only `pool.configured` may create it. `raw` is the message
    value as received, when the caller has it: it identifies duplicates. From the edge, both optional: `origin`,
    the cluster the event was accepted from (Kafka: the verified principal's cluster; a file: the cluster part of
    `source`, which stands in when it is None), and `appended_s`, the broker's append time in epoch seconds.
    """
    # (core: fields) the event's fields, read here and by the checks and applies of the frequent types
    d: dict = event.__dict__
    ts = d["occurred_at"]
    off = OFFSET_S.get(ts.tzinfo)  # (core: written out) epoch_s
    t: int  # (core: typed) as are the parts below
    if off is None:
        t = epoch_s(ts)
    else:
        day: int = ts.toordinal()
        hour: int = ts.hour
        minute: int = ts.minute
        second: int = ts.second
        offset: int = off
        t = (day - UNIX_ORDINAL) * 86400 + hour * 3600 + minute * 60 + second - offset
    # (core: no __init__) the step: the object, then its two slots
    step = _new_object(Step)
    step.occurred_s = t
    step.applied_at = None
    etype: str = d["type"]
    # a producer's clock, bounded by the broker's (or a file's stand-in, chipledger.embedded): an event further
    # ahead of its append time than the skew allowed is not applied and never moves (or starts) a pool clock
    if appended_s is not None and t - appended_s > config.max_clock_skew_s:
        step.rejection = _clock_ahead(t, appended_s, config)
        if state is not None:
            _reject(state, step, step.rejection)
        return state, step
    if state is None:
        if etype != "pool.configured":
            step.rejection = Rejection(RC.unknown_pool, f"pool {event.pool!r} was never configured")
            return state, step
        state = PoolState(pool=event.pool, flavor=event.flavor, chips_per_node=event.chips_per_node,
                          clock=t, books=Books(event.pool, hour_of(t)))
    # duplicates: "identical" means byte-identical message values, which is what a producer's retry sends, told
    # apart by a stable 64-bit digest of the body (ledger.state.fingerprint; without raw bytes the event's
    # canonical JSON stands in). The window keeps an accepted event's raw bytes and digests them only when its
    # id comes again (or the state is saved): most ids never do.
    body: Any
    if raw is None or raw.__class__ is not bytes:
        body = fingerprint(raw if raw is not None else event.model_dump_json().encode())
    else:
        body = raw
    # ids are deduplicated per (origin, event_id): two replicas of one cluster's adapter never count an event
    # twice, and another cluster cannot claim an id (DESIGN §3)
    event_id = d["event_id"]
    if origin is None:
        origin = origin_of(d["source"])
    key = origin + ORIGIN_SEP + event_id
    dedup = state.dedup
    seen = dedup.get(key)
    if seen is None and state.legacy_ids:  # a state saved before ids were kept per origin: its ids, as they were
        seen = dedup.get(event_id)
    if seen is not None:
        if digest_of(seen[0]) == digest_of(body):
            state.duplicates += 1
            step.duplicate = True
            return state, step
    # time, before the entity checks (precedence): an event older than the dedup window cannot be told from a
    # re-sent one whose id was forgotten, and one far ahead of the clock would close years of hours
    clock = state.clock
    if t < clock - config.dedup_window_s:
        _reject(state, step, _too_late(state, t, config))
        return state, step
    if t - clock > config.max_clock_jump_s:
        _reject(state, step, Rejection(RC.clock_jump, f"event time {policy._utc(t)} UTC is {t - clock} s ahead of the "
                                   f"pool clock {policy._utc(clock)} UTC, more than [ledger] max_clock_jump_s "
                                   f"({config.max_clock_jump_s} s)"))
        return state, step
    # the check of the event's type, the types in order of frequency (core: direct calls)
    rejection: Optional[Rejection]
    if etype == "job.started":
        rejection = _check_job_started(state, d)
    elif etype == "job.submitted":
        rejection = _check_job_submitted(state, d)
    elif etype == "job.finished":
        rejection = _check_job_active(state, d)
    elif etype == "job.checkpointed":
        rejection = _check_job_checkpointed(state, d)
    elif etype == "chip.state_changed" or etype == "chip.retired":
        rejection = _check_chip_known(state, d)
    elif etype == "job.preempted":
        rejection = _check_job_running(state, d)
    elif etype == "job.progress":
        rejection = _check_job_progress(state, d)
    elif etype == "chip.registered":
        rejection = _check_chip_registered(state, d)
    elif etype == "quota.granted":
        rejection = _check_quota_granted(state, event)
    elif etype == "quota.revoked":
        rejection = _check_quota_revoked(state, event)
    elif etype == "job.released":
        rejection = _check_job_held(state, d)
    elif etype == "job.waiting":
        rejection = _check_job_queued(state, d)
    elif etype == "price.set":
        rejection = prices.check_price_set(state, event)
    else:  # pool.configured, pool.tick, burst.requested, budget.set: nothing to check
        rejection = None
    if rejection is not None or seen is not None:
        _reject(state, step, rejection or Rejection(RC.duplicate_conflict,
                                                    f"event_id {event_id!r} was seen before with a different body"))
        return state, step

    if t < clock:
        lateness = clock - t
        step.lateness_s = lateness
        state.late_events += 1
        if lateness > state.max_lateness_s:
            state.max_lateness_s = lateness
        t = clock
    elif t < state.until:
        state.clock = t  # the common case: no hour closes and no grant boundary passes before this event
    else:
        _advance(state, t, step, config)
        _forget_ids(state, t - config.dedup_window_s)
    step.applied_at = t
    if t >= state.fc_due:  # the free chips of an earlier second are final: post them
        _post_free_chips(state, step)
    # apply, and what the event type changes: the free capacity (a `free_chips` fact row when it differs), and
    # which pending jobs preemption looks at after it (docs/policy.md): after new demand (a job submitted or sent
    # back to the queue: just that job), capacity or quota changes and ticks (every queue's head). A job.started
    # or job.finished only takes or frees chips the cluster itself placed; a shortage it leaves is seen at the
    # next of these, or when an instant the policy asked for comes.
    capacity = False
    trigger = _NO_LOOK
    if etype == "job.started":
        _apply_job_started(state, d, t, step, config)
        capacity = True
    elif etype == "job.submitted":
        _apply_job_submitted(state, d, t, step, config)
        trigger = _JOB
    elif etype == "job.finished":
        _apply_job_finished(state, d, t, step, config)
        capacity = True
    elif etype == "job.checkpointed":
        _apply_job_checkpointed(state, d, t, step, config)
    elif etype == "chip.state_changed":
        _apply_chip_state_changed(state, d, t, step, config)
        capacity = True
        trigger = _ALL
    elif etype == "job.preempted":
        _apply_job_preempted(state, d, t, step, config)
        capacity = True
        if not d["held"]:  # held: no new demand to look at (its job.released is)
            trigger = _JOB
    elif etype == "job.progress":
        _apply_job_progress(state, d, t, step, config)
    elif etype == "chip.registered":
        _apply_chip_registered(state, d, t, step, config)
        capacity = True
    elif etype == "quota.granted":
        _apply_quota_granted(state, event, t, step, config)
        trigger = _ALL
    elif etype == "burst.requested":
        _apply_burst_requested(state, event, t, step, config)
        trigger = _ALL
    elif etype == "pool.tick":
        trigger = _ALL
    elif etype == "pool.configured":
        _apply_pool_configured(state, event, t, step, config)
    elif etype == "chip.retired":
        _apply_chip_retired(state, d, t, step, config)
        capacity = True
        trigger = _ALL
    elif etype == "quota.revoked":
        _apply_quota_revoked(state, event, t, step, config)
        trigger = _ALL
    elif etype == "job.released":
        _apply_job_released(state, d, t, step, config)
        trigger = _JOB
    elif etype == "job.waiting":  # the scheduler's own reason, kept on the job; nothing for the books or the policy
        job_w = state.jobs[d["job_id"]]
        job_w.waiting_reason = d["reason"]
        job_w.waiting_message = d["message"]
    elif etype == "price.set":
        costs.apply_price_set(state, event, t, step)  # posts and prices the books up to t, then the new price
    elif etype == "budget.set":
        prices.apply_budget_set(state, event, t, _rows(step, "budgets"))
    else:
        raise KeyError(etype)
    if capacity:
        _free_chips_changed(state, t)
    state.applied += 1
    # preemption is looked at only after a change that can leave a pending job short, or when a moment it
    # asked for (grace end, timeout, a protection ending) has come; never without pending jobs
    if state.pending_sizes:
        if trigger == _ALL or state.policy_full:
            state.policy_full = False
            policy.evaluate(state, event_id, t, step, config)
        else:
            # just the jobs whose moment came, and a job that just joined a queue (the only new demand) if it
            # heads its team's queue
            due = [jid for jid, w in state.wakes.items() if w <= t] if t >= state.policy_due else None
            if trigger == _JOB:
                job: Any = state.jobs[d["job_id"]]
                team = state.teams[job.team]
                chips = job.chips_milli
                # the common case needs no look: the job fits its team's unused quota and the free chips, less
                # what decisions in flight hold for their beneficiaries (as policy.evaluate counts them); with
                # decisions in flight, it is looked at when other jobs are due now (their decisions may take free
                # chips first) or a decision has timed out (the look lets it go)
                fits = chips <= policy.unused_quota(state, team) and chips <= policy.unpromised_free(state)[0]
                if (state.inflight and (due or t >= state.inflight_next)) or not fits:
                    heads = state.heads.get(job.team)
                    if heads is not None:
                        for h in heads:
                            if h is job:  # identity: Job's dataclass __eq__ compares every field
                                break
                        else:
                            job = None
                    if job is not None:
                        if due is None:
                            due = [job.job_id]
                        else:
                            due.append(job.job_id)
            if due:
                policy.evaluate(state, event_id, t, step, config, due)
    # head-of-line blocking: which pending jobs could start now, looked at again only when the chips, the quotas,
    # the decisions in flight or the queues changed
    if state.pending_sizes and config.hol_blocking:
        sig = (state.run_epoch, state.other_epoch, state.queue_changes, state.capacity_milli)
        if sig != state.hol_sig:
            # no job can start while the smallest pending job is larger than the free chips: nothing to look at
            # unless some job was able to at the last look (it stops accruing now)
            if state.hol_any or min(state.pending_sizes) <= policy.free_milli(state):
                _hol(state, t)
            else:
                state.hol_sig = sig
    # remember the id (an accepted event's id was not in the window: `seen` is None here); ids that fell out
    # of the window are forgotten when an hour closes, so an id is remembered for at least the window
    state.dedup_order.append(key)
    dedup[key] = (body, t)
    if config.check_invariants:
        check_invariants(state)
    return state, step


def _reject(state: PoolState, step: Step, rejection: Rejection) -> None:
    """The event is rejected (a dead letter): counted in the pool's state, by code."""
    state.rejected += 1
    code = rejection.code.value
    rc = state.rejection_counts
    rc[code] = rc.get(code, 0) + 1
    step.rejection = rejection


def _clock_ahead(t: int, appended_s: int, config: FoldConfig) -> Rejection:
    return Rejection(RC.clock_ahead, f"event time {policy._utc(t)} UTC is {t - appended_s} s ahead of its append time "
                     f"{policy._utc(appended_s)} UTC, more than [ledger] max_clock_skew_s ({config.max_clock_skew_s} "
                     f"s): the producer's clock is ahead; it is not applied and does not move the pool clock "
                     f"(docs/events.md, Clocks ahead)")


def _too_late(state: PoolState, t: int, config: FoldConfig) -> Rejection:
    return Rejection(RC.too_late, f"event time {policy._utc(t)} UTC is {state.clock - t} s behind the pool clock "
                     f"{policy._utc(state.clock)} UTC, more than the dedup window ({config.dedup_window_s} s): it "
                     f"cannot be told from a duplicate; to apply it on purpose, send it again with a new event_id "
                     f"and occurred_at at or after the pool clock (docs/events.md)")


def _apply_pool_configured(s: PoolState, e, t, step, config=DEFAULT_CONFIG):
    s.flavor = e.flavor
    s.chips_per_node = e.chips_per_node
