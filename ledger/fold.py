"""The fold: `evolve(state, event) -> (state, step)`, pure, deterministic, integer.

No I/O, no wall clock, no logging. Time advances only with `occurred_at`, and the pool clock is monotonic: an
event older than the clock is applied at the clock and its lateness recorded. Before an event is applied the
clock is advanced to it, closing hours and applying grant boundaries on the way, so every interval is accrued
at the rates that held during it.

For speed the fold updates the `PoolState` it is given and returns it; `PoolState.copy()` keeps a snapshot.
A rejected or duplicate event changes nothing but counters.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Any, Final, NamedTuple, Optional

from mypy_extensions import mypyc_attr
from schemas.codes import Rejection, RejectionCode as RC
from schemas.events import _OFFSET_S, _UNIX_ORDINAL, MAX_POOL_CHIPS, MAX_POOL_MILLI, MILLI as _MILLI, epoch_s, to_milli

from ledger.books import (
    BORROWED, BURST, CAPACITY, ENTITLED, HOUR_S, IDLE, IN_QUOTA, OVERCOMMITTED, PENDING, UNAVAILABLE, Books,
    hour_of,
    set_rate,
)
from ledger import policy, prices
from ledger.state import NO_ROWS, Chip, Grant, Job, PoolState, Progress, Team, digest_of, fingerprint

_new_tuple: Final = tuple.__new__  # a NamedTuple row without its Python-level __new__ (one per run ended)
_new_object: Final = object.__new__
# Final (a C static in the compiled core, not a look-up in the module's dict at each use) and typed: a name
# imported from schemas is an untyped object to the compiled core (its arithmetic generic)
UNIX_ORDINAL: Final[int] = _UNIX_ORDINAL
MILLI: Final[int] = _MILLI
OFFSET_S: Final[dict] = _OFFSET_S  # the same dict (epoch_s fills it), typed: a native look-up, not a method call


_MILLI_OF: dict[str, int] = {}  # a job's chips (a Decimal's text) -> milli-chips; jobs come in few sizes (bounded memo)

DEFAULT_DEDUP_WINDOW_S = 86_400  # event ids are remembered for a day of event time
DEFAULT_MAX_CLOCK_JUMP_S = 400 * 86_400  # an event further ahead of its pool's clock is `clock_jump`
DEFAULT_MAX_CLOCK_SKEW_S = 300  # an event further ahead of its append time is `clock_ahead` ([ledger] max_clock_skew_s)
MAX_PREEMPTIONS_KEPT = 16  # a job remembers the instants of its last 16 preemptions (anti-thrash)
MAX_REFERENCE_REPORTS = 256  # a job's reference rate is the median of at most this many intervals (bounded state)


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


class FreeChipsRow(NamedTuple):
    """A fact (lake table `free_chips`): a pool's free capacity from `at` on, posted when it changes (at most one
    row per pool and second: the last). The node figures are None while a run without a placement is going."""

    pool: str
    at: int
    registered_milli: int
    healthy_milli: int       # healthy or degraded
    in_use_milli: int        # charged to running jobs (shares on available chips)
    down_milli: int          # down or in maintenance
    free_milli: int          # healthy - in use (0 when overcommitted)
    free_whole_nodes_milli: Optional[int]   # free chips on nodes with nothing placed and every chip available
    largest_startable_milli: Optional[int]  # max(free_whole_nodes, the most free chips on one node)


class ChipStateRow(NamedTuple):
    """A fact (lake table `chip_states`): a chip's registration and state from `at` on, posted at each chip event
    (registered, state changed, retired). `seq` orders a pool's rows of one second: the pool's events applied
    before this one."""

    pool: str
    chip_id: str
    node: str
    at: int
    seq: int
    state: str        # healthy | degraded | down | maintenance | retired
    registered: bool
    available: bool   # registered and healthy or degraded: its chip-seconds count as healthy


class GrantIntervalRow(NamedTuple):
    """A fact (lake table `grant_intervals`): one incarnation of a grant (a `quota.granted` the pool holds), in
    effect from `effective_from` until `effective_until` (None: until revoked). Posted when granted, with the end
    it was granted for; when it ends earlier (amended by a re-grant of its id, or revoked) its end is posted
    (`ended` true, `granted_at` and `effective_from` None): the earlier end holds (before the incarnation took
    effect, it never was)."""

    pool: str
    grant_id: str
    team: str
    version: int          # the incarnation: unique in the pool (a re-grant of the id is a new one)
    chips_milli: int
    borrowing_limit_milli: Optional[int]
    lending_limit_milli: Optional[int]
    granted_at: Optional[int]
    effective_from: Optional[int]   # max(granted_at, the grant's effective_from)
    effective_until: Optional[int]
    ended: bool
    posted_at: int


STARTED: Final = "started"
FINISHED: Final = "finished"
HELD: Final = "held"  # a job's status between a job.preempted with held and its job.released: neither running nor pending
OPEN: Final = "open"
NEVER: Final = 1 << 62


@mypyc_attr(native_class=False)
class Step:
    """What one event did: either applied (with its outputs), dropped as a duplicate, or rejected.

    `occurred_s` is the event time, `applied_at` the pool clock it was applied at (later when it was late by
    `lateness_s`); `journal`, `job_runs` and `decisions` (ledger.policy.DecisionRow) are the outputs, with
    `balances` and `pending` (BalanceRow / PendingRow) when an hour closes: each list is named like its lake
    table. One is made per event: its output lists are one shared, read-only empty list (`NO_ROWS`) until
    the fold gives it rows, and its other fields are class defaults until they differ."""

    # the two fields every event sets are slots; the others are class defaults, set on the instance only when
    # they differ (a step is made per event: its construction is two stores)
    __slots__ = ("occurred_s", "applied_at", "__dict__")
    # the output lists, lake table names
    TABLES = ("journal", "job_runs", "decisions", "balances", "pending", "waits", "free_chips", "progress",
              "chip_states", "grant_intervals", "prices", "budgets")

    lateness_s = 0
    duplicate = False
    rejection: Optional[Rejection] = None
    journal: list = NO_ROWS
    job_runs: list = NO_ROWS
    decisions: list = NO_ROWS
    balances: list = NO_ROWS
    pending: list = NO_ROWS
    waits: list = NO_ROWS
    free_chips: list = NO_ROWS
    progress: list = NO_ROWS  # fact rows of the throughput SLO (ProgressRow)
    chip_states: list = NO_ROWS
    grant_intervals: list = NO_ROWS
    prices: list = NO_ROWS   # ledger.prices.PriceRow
    budgets: list = NO_ROWS  # ledger.prices.BudgetRow

    def __init__(self, occurred_s: int = 0, applied_at: Optional[int] = None):
        self.occurred_s = occurred_s
        self.applied_at = applied_at

    def rows(self, table: str) -> list:
        """The step's own output list `table` (one of TABLES), made when its first row comes."""
        return _rows(self, table)

    def __repr__(self) -> str:
        return (f"Step(occurred_s={self.occurred_s}, applied_at={self.applied_at}, lateness_s={self.lateness_s}, "
                f"duplicate={self.duplicate}, rejection={self.rejection}, journal={self.journal}, "
                f"job_runs={self.job_runs}, decisions={self.decisions}, balances={self.balances}, "
                f"pending={self.pending}, waits={self.waits}, free_chips={self.free_chips}, "
                f"progress={self.progress}, chip_states={self.chip_states}, "
                f"grant_intervals={self.grant_intervals}, prices={self.prices}, budgets={self.budgets})")

    @property
    def applied(self) -> bool:
        return self.rejection is None and not self.duplicate


def _rows(step: Step, table: str) -> list:
    """`step.rows(table)` as a plain function: the fold's own calls go native (a method of the non-native Step is
    a Python-level call from the compiled core, about 1,800 instructions under callgrind)."""
    d: dict = step.__dict__
    out = d.get(table)
    if out is None:
        out = d[table] = []
    return out


@dataclass(frozen=True, slots=True)
class FoldConfig:
    dedup_window_s: int = DEFAULT_DEDUP_WINDOW_S
    max_clock_jump_s: int = DEFAULT_MAX_CLOCK_JUMP_S
    max_clock_skew_s: int = DEFAULT_MAX_CLOCK_SKEW_S  # how far an event may be ahead of its append time (or, in a file, of its pool)
    check_invariants: bool = False  # assert conservation after every event (tests, debug mode)
    # policy (docs/policy.md; [policy] in chipledger.toml)
    decay_half_life_s: int = 7 * 86400   # fair-share usage half-life (Slurm's default)
    preemption_grace_s: int = 120        # a short job waits this long for natural completions before a decision
    min_runtime_s: int = 600             # a job that started less than this ago is never a victim
    max_preemptions: int = 3             # a job preempted this often within the window is never a victim
    preemption_window_s: int = 86400
    decision_timeout_s: int = 900        # a decision nobody acted on is forgotten and may be made anew
    candidates_per_team: int = 4         # pending jobs of a team (its queue head) looked at per evaluation
    victim_order: str = "goodput"        # goodput (DESIGN §4) | naive (lowest priority, most recent)
    fair_share_tolerance: float = 0.1    # teams whose F differ by less than this are one victim class (0: strict)
    restart_cost_s: int = 0              # seconds of a victim's chips a restart costs, weighed with its lost work
    checkpoint_grace_s: int = 60         # a decision's checkpoint_by = its instant + this (cooperative preemption)
    capacity_slo_target: float = 0.99    # capacity SLO whose error budget gates bursts
    policy_rows: bool = True             # emit balance and pending-reason rows when an hour closes
    hol_blocking: bool = True            # measure head-of-line blocking (waits.blocked_s / blocked_by; costs per event)
    # throughput ([slo] throughput_*; docs/analytics.md): an interval between two progress reports is slow when its
    # units per chip-second are below this fraction of the job's reference rate, the median rate of its first
    # stretch of healthy intervals lasting throughput_reference_s, of at least throughput_reference_reports intervals
    throughput_fraction: float = 0.8
    throughput_reference_s: int = 1800
    throughput_reference_reports: int = 3
    # [slo] sched_slo_s: a wait that ends in a start within this many seconds is good for the wait SLOs (the
    # counters of PoolState.wait_counts)
    sched_slo_s: int = 600

    def __post_init__(self):
        for name in ("decay_half_life_s", "candidates_per_team", "max_preemptions", "max_clock_jump_s", "sched_slo_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_preemptions > MAX_PREEMPTIONS_KEPT:
            raise ValueError(f"max_preemptions must be at most {MAX_PREEMPTIONS_KEPT}, got {self.max_preemptions}")
        for name in ("preemption_grace_s", "min_runtime_s", "preemption_window_s", "decision_timeout_s",
                     "dedup_window_s", "max_clock_skew_s", "restart_cost_s", "checkpoint_grace_s", "throughput_reference_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.victim_order not in ("goodput", "naive"):
            raise ValueError(f"victim_order must be goodput or naive, got {self.victim_order!r}")
        if not self.fair_share_tolerance >= 0.0:  # also NaN
            raise ValueError(f"fair_share_tolerance must not be negative, got {self.fair_share_tolerance}")
        if not 0.0 < self.throughput_fraction <= 1.0:  # also NaN
            raise ValueError(f"throughput_fraction must be above 0 and at most 1, got {self.throughput_fraction}")
        if not 1 <= self.throughput_reference_reports <= MAX_REFERENCE_REPORTS:
            raise ValueError(f"throughput_reference_reports must be between 1 and {MAX_REFERENCE_REPORTS}, got "
                             f"{self.throughput_reference_reports}")
        if not 0.0 < self.capacity_slo_target < 1.0:
            raise ValueError(f"capacity_slo_target must be between 0 and 1, got {self.capacity_slo_target}")


DEFAULT_CONFIG = FoldConfig()


# ---------------------------------------------------------------------------------------------------------
# evolve
# ---------------------------------------------------------------------------------------------------------

def evolve(state: Optional[PoolState], event, config: FoldConfig = DEFAULT_CONFIG, raw: Any = None, *,
           origin: Optional[str] = None, appended_s: Optional[int] = None):
    """Apply one validated event to its pool's state. Returns (state, Step).

    `state` is None for a pool never configured; only `pool.configured` may create it. `raw` is the message
    value as received, when the caller has it: it identifies duplicates. From the edge, both optional: `origin`,
    the cluster the event was accepted from (Kafka: the verified principal's cluster; a file: the cluster part of
    `source`, which stands in when it is None), and `appended_s`, the broker's append time in epoch seconds.
    """
    # the event's fields, read from its __dict__ here and by the checks and applies of the frequent types: a pydantic
    # model defines __getattr__, so each attribute read goes through CPython's slot_tp_getattr_hook (about 200
    # instructions under callgrind; ≈ 14 reads per event)
    d: dict = event.__dict__
    ts = d["occurred_at"]
    off = OFFSET_S.get(ts.tzinfo)  # epoch_s, written out: this runs for every event
    t: int  # typed (as are the parts below): the compiled core then does the frame's arithmetic on machine integers
    if off is None:
        t = epoch_s(ts)
    else:
        day: int = ts.toordinal()
        hour: int = ts.hour
        minute: int = ts.minute
        second: int = ts.second
        offset: int = off
        t = (day - UNIX_ORDINAL) * 86400 + hour * 3600 + minute * 60 + second - offset
    # the step without Step.__init__ (a Python-level call through slot_tp_init from the compiled core): the object,
    # then its two slots
    step = _new_object(Step)
    step.occurred_s = t
    step.applied_at = None
    etype: str = d["type"]
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
    event_id = d["event_id"]
    dedup = state.dedup
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
    # the check of the event's type (the types in order of frequency; each branch calls its function directly, not
    # through a table: a call through a dict of functions is a Python-level call from the compiled core)
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
        prices.apply_price_set(state, event, t, _rows(step, "prices"))
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
    state.dedup_order.append(event_id)
    dedup[event_id] = (body, t)
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


def _too_late(state: PoolState, t: int, config: FoldConfig) -> Rejection:
    return Rejection(RC.too_late, f"event time {policy._utc(t)} UTC is {state.clock - t} s behind the pool clock "
                     f"{policy._utc(state.clock)} UTC, more than the dedup window ({config.dedup_window_s} s): it "
                     f"cannot be told from a duplicate; to apply it on purpose, send it again with a new event_id "
                     f"and occurred_at at or after the pool clock (docs/events.md)")


def close_books(state: PoolState, until: Optional[int] = None,
                config: FoldConfig = DEFAULT_CONFIG) -> tuple[list, list]:
    """Bring the books up to `until` (default: the pool clock) and post everything accrued so far: the open
    hour's journal so far and each running job's allocation so far. Returns (journal rows, job run rows).

    Closing does not change what later events will post in total; it only posts earlier what is known."""
    step = Step()
    if until is not None and until > state.clock:
        _advance(state, until, step, config)
    t = state.clock
    journal = _rows(step, "journal")
    runs = []
    state.books.flush(t, journal)
    for job in state.jobs.values():
        if job.status == "running":
            _accrue_job(job, t)
            amount = job.run_alloc_mchip_s - job.run_posted_mchip_s
            if amount:
                runs.append(_run_row(state, job, t, None, None, amount, 0))
                job.run_posted_mchip_s = job.run_alloc_mchip_s
    return journal, runs


def close_facts(state: PoolState) -> dict[str, list]:
    """The facts a close of the books posts at the pool clock: each wait still open (a later posting of the same
    wait supersedes it) and the free chips of the current second not posted yet. {"waits": rows, "free_chips":
    rows}."""
    t = state.clock
    pending = sorted((job for job in state.jobs.values() if job.status == "pending"), key=_wait_order)
    waits = [_wait_row(state, job, job.run_index, None, OPEN, t) for job in pending]
    step = Step()
    if state.fc_row is not None:
        _post_free_chips(state, step)
    return {"waits": waits, "free_chips": list(step.free_chips)}


# ---------------------------------------------------------------------------------------------------------
# facts: free chips (one row per change, at most one per pool and second) and the waits
# ---------------------------------------------------------------------------------------------------------

def free_chips_values(s: PoolState) -> tuple[int, int, int, int, int, Optional[int], Optional[int]]:
    """(registered, healthy, in use, down, free, free on whole nodes, largest startable), milli-chips, now."""
    healthy = s.capacity_milli - s.unavailable_milli
    in_use = s.charged_milli
    free = healthy - in_use
    if free < 0:
        free = 0
    whole: Optional[int] = None
    largest: Optional[int] = None
    if not s.unplaced_runs:
        w = s.whole_free_milli
        counts = s.node_free_counts
        most = max(counts) * MILLI if counts else 0
        whole = w
        largest = w if w > most else most
    return (s.capacity_milli, healthy, in_use, s.unavailable_milli, free, whole, largest)


def _free_chips_changed(s: PoolState, t: int) -> None:
    """After an event that may change the free capacity: the row of this second, if it differs from the last posted."""
    v = free_chips_values(s)
    row = s.fc_row
    if row is not None:  # a row of this second (one of an earlier second was posted before the event)
        if v == s.fc_posted:
            s.fc_row = None
            s.fc_due = NEVER
        else:
            s.fc_row = _new_tuple(FreeChipsRow, (s.pool, t, v[0], v[1], v[2], v[3], v[4], v[5], v[6]))
    elif v != s.fc_posted:
        s.fc_row = _new_tuple(FreeChipsRow, (s.pool, t, v[0], v[1], v[2], v[3], v[4], v[5], v[6]))
        s.fc_due = t + 1


def _post_free_chips(s: PoolState, step: Step) -> None:
    row: Any = s.fc_row
    if row.__class__ is not FreeChipsRow:  # restored from a saved state as a plain tuple
        row = _new_tuple(FreeChipsRow, tuple(row))
    _rows(step, "free_chips").append(row)
    s.fc_posted = tuple(row[2:])
    s.fc_row = None
    s.fc_due = NEVER


def _node_change(s: PoolState, node: str, d_reg: int, d_free: int) -> None:
    """A node's registered and free chips change: the counts of nodes by free chips and the whole free chips follow."""
    nodes: dict[str, list[int]] = s.nodes  # typed: the compiled core reads and writes the counts as machine integers
    counts: dict[int, int] = s.node_free_counts
    n = nodes.get(node)
    if n is None:
        n = nodes[node] = [0, 0]
    else:
        reg, free = n[0], n[1]
        c = counts[free] - 1
        if c:
            counts[free] = c
        else:
            del counts[free]
        if free == reg:
            s.whole_free_milli -= reg * MILLI
    reg = n[0] = n[0] + d_reg
    free = n[1] = n[1] + d_free
    if reg <= 0:
        del nodes[node]
        return
    counts[free] = counts.get(free, 0) + 1
    if free == reg:
        s.whole_free_milli += reg * MILLI


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
    # typed locals: the compiled core then reads the members' chips and the figures as machine integers
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


# ---------------------------------------------------------------------------------------------------------
# facts: throughput (job.progress, and job.checkpointed with units; docs/analytics.md, "throughput")
# ---------------------------------------------------------------------------------------------------------

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


_STATE_RANK = {"degraded": 1, "maintenance": 2, "down": 3}  # the worst state an unhealthy chip had is kept
MAX_HELD_LISTED = 16


def _chip_unhealthy(s: PoolState, chip: Chip, chip_id: str) -> None:
    """A chip with jobs on it became degraded, down or in maintenance: each job reporting progress in its run
    notes it for its open interval (its worst state)."""
    state = chip.state
    jobs = s.jobs
    for job_id in chip.jobs:
        job = jobs[job_id]
        pr = job.progress
        if pr is not None and pr.run == job.run_index:
            bad = pr.unhealthy
            had = bad.get(chip_id)
            if had is None or _STATE_RANK[had] < _STATE_RANK[state]:
                bad[chip_id] = state


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


def _median(values: list) -> float:
    v = sorted(values)
    n = len(v)
    mid = n // 2
    return float(v[mid]) if n % 2 else (v[mid - 1] + v[mid]) / 2.0


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


def _apply_job_progress(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    pr = _progress(s, s.jobs[d["job_id"]], d["units"], t, step, config)
    if not pr.unit:
        pr.unit = d["unit"]


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


def _unit_text(unit: str) -> str:
    return repr(unit) if len(unit) <= 64 else repr(unit[:64]) + "…"


def _check_job_checkpointed(s: PoolState, d: dict):
    rejection = _check_job_running(s, d)
    if rejection is None and d["units"] is not None:
        return _check_units(s, d, s.jobs[d["job_id"]])
    return rejection


# ---------------------------------------------------------------------------------------------------------
# checks: a Rejection, or None when the event may be applied. They never change the state. Those of the frequent
# types take `d`, the event's fields (its __dict__, read once by evolve); quota.* take the event (its properties)
# ---------------------------------------------------------------------------------------------------------

def _chips_text(milli: int) -> str:
    """Milli-chips as exact chips for a detail (1000000.001, not 1e+06)."""
    whole, frac = divmod(milli, MILLI)
    return f"{whole}.{frac:03d}".rstrip("0") if frac else str(whole)


def _check_chip_registered(s: PoolState, d: dict):
    if d["chip_id"] in s.chips:
        return Rejection(RC.illegal_transition, f"chip {d['chip_id']!r} is already registered")
    if len(s.chips) >= MAX_POOL_CHIPS:
        return Rejection(RC.over_limit, f"pool {s.pool!r} already has {MAX_POOL_CHIPS:,} chips, the most a pool may "
                         f"register (docs/events.md, Limits)")
    return None


def _check_chip_known(s: PoolState, d: dict):
    if d["chip_id"] not in s.chips:
        return Rejection(RC.unknown_chip, f"chip {d['chip_id']!r} is not registered in pool {s.pool!r}")
    return None


def _held_grant(s: PoolState, e) -> Optional[Grant]:
    """The grant `e.grant_id` as it will be held when `e` is applied: a grant whose `effective_until` the
    clock passes on the way to `e` has ended by then. Checks run before the clock advances (a rejected event
    must not move it), so without this the verdict would depend on whether some other event came between."""
    g = s.grants.get(e.grant_id)
    t = max(e.at_s, s.clock)
    if g is not None and g.effective_until is not None and g.effective_until <= t:
        return None
    return g


def _check_quota_granted(s: PoolState, e):
    g = _held_grant(s, e)
    if g is not None and g.team != e.team:
        return Rejection(RC.illegal_transition,
                         f"grant {e.grant_id!r} belongs to team {g.team!r}, not {e.team!r}; revoke it and grant anew")
    own = s.grants.get(e.grant_id)
    held = s.held_milli - (own.chips_milli if own is not None else 0)  # a re-grant replaces its own amount
    if held + e.chips_milli > MAX_POOL_MILLI:
        return Rejection(RC.over_limit, f"the grants held in pool {s.pool!r} would total {_chips_text(held + e.chips_milli)} "
                         f"chips, over the pool bound of {MAX_POOL_CHIPS:,} (docs/events.md, Limits)")
    return None


def _check_quota_revoked(s: PoolState, e):
    if _held_grant(s, e) is None:
        return Rejection(RC.unknown_grant, f"grant {e.grant_id!r} is not held in pool {s.pool!r}")
    return None


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


# ---------------------------------------------------------------------------------------------------------
# the clock
# ---------------------------------------------------------------------------------------------------------

def policy_rows(state: PoolState, config: FoldConfig = DEFAULT_CONFIG) -> tuple[list, list]:
    """Balance rows of every team and the reason of every pending job at the pool clock (read-only: what a
    close of the books adds to the hourly rows)."""
    balances: list = []
    pending: list = []
    policy.snapshot(state, state.clock, balances, pending, config)
    return balances, pending


def _advance(state: PoolState, t: int, step: Step, config: FoldConfig = DEFAULT_CONFIG) -> None:
    """Move the pool clock to t, closing hours and applying grant and burst boundaries in time order."""
    books = state.books
    bounds = state.boundaries
    while True:
        hour_end = books.open_hour + 3600
        b = bounds[0][0] if bounds else None
        if b is not None and b < hour_end:
            if b > t:
                break
            instant, _, kind, ident, version = heapq.heappop(bounds)
            _BOUNDARY[kind](state, ident, version, instant)
        elif hour_end <= t:
            books.close_hour(_rows(step, "journal"))
            policy.hour_closed(state, hour_end - HOUR_S, step, config)
            if state.pending_sizes:
                _post_open_waits(state, hour_end - HOUR_S, step)
            # a stretch of hours that post nothing is closed at once, not hour by hour: the cost of a jump of
            # the clock follows the rows it writes, not the hours it spans
            stop = t if b is None or b > t else b
            if stop - books.open_hour >= HOUR_S and _quiet(state, config):
                n = (stop - books.open_hour) // HOUR_S
                policy.quiet_hours_closed(state, books.open_hour, n, config)
                books.skip_hours(n)
        else:
            break
    state.clock = t
    state.reset_until()


def _quiet(state: PoolState, config: FoldConfig) -> bool:
    """Whether closing an hour now writes no row: nothing accrues (every rate is 0) and no balance rows are due
    (no teams, or no policy rows). Pending jobs accrue to `pending`, so they make a pool not quiet."""
    if config.policy_rows and state.teams:
        return False
    for acc in state.books.accounts.values():
        if acc[0]:
            return False
    return True


def _forget_ids(state: PoolState, horizon: int) -> None:
    """Drop the remembered event ids applied before `horizon` (they are in arrival order, and so in clock order)."""
    order = state.dedup_order
    dedup = state.dedup
    popleft = order.popleft
    while order:
        eid = order[0]
        if dedup[eid][1] >= horizon:
            break
        popleft()
        del dedup[eid]


def _grant_on(state: PoolState, grant_id: str, version: int, t: int) -> None:
    g = state.grants.get(grant_id)
    if g is None or g.version != version or g.active:
        return
    if g.effective_until is not None and g.effective_until <= t:
        return
    g.active = True
    team = state.team(g.team)
    team.nominal_milli += g.chips_milli
    _retally_team(state, team, t)
    state.policy_full = True
    state.other_epoch += 1
    state.quota_epoch += 1


def _grant_off(state: PoolState, grant_id: str, version: int, t: int) -> None:
    g = state.grants.get(grant_id)
    if g is None or g.version != version:
        return
    _deactivate(state, g, t)
    del state.grants[grant_id]
    state.held_milli -= g.chips_milli
    state.policy_full = True
    state.other_epoch += 1
    state.quota_epoch += 1


def _burst_on(state: PoolState, request_id: str, version: int, t: int) -> None:
    b = state.bursts.get(request_id)
    if b is None or b[4]:
        return
    b[4] = True
    team = state.teams[b[0]]
    team.burst_milli += b[1]
    _retally_team(state, team, t)
    state.policy_full = True
    state.other_epoch += 1
    state.quota_epoch += 1


def _burst_off(state: PoolState, request_id: str, version: int, t: int) -> None:
    b = state.bursts.pop(request_id, None)
    if b is None or not b[4]:
        return
    team = state.teams[b[0]]
    team.burst_milli -= b[1]
    _retally_team(state, team, t)
    state.policy_full = True
    state.other_epoch += 1
    state.quota_epoch += 1


_BOUNDARY: Final = {"grant_on": _grant_on, "grant_off": _grant_off, "burst_on": _burst_on, "burst_off": _burst_off}


# ---------------------------------------------------------------------------------------------------------
# rates: after any change, the affected team's split and the pool's buckets are re-tallied
# ---------------------------------------------------------------------------------------------------------

def split_use(use_milli: int, nominal_milli: int, burst_milli: int) -> tuple[int, int, int]:
    """The team split of DESIGN §4: (in_quota, borrowed, burst)."""
    in_quota = use_milli if use_milli < nominal_milli else nominal_milli
    over = use_milli - in_quota
    burst = over if over < burst_milli else burst_milli
    return in_quota, over - burst, burst


def _retally_team(state: PoolState, team: Team, t: int) -> None:
    """The team's split and entitlement after its use, quota or bursts changed."""
    iq, bo, bu, en, _ = state.books.team_accounts(team.name)
    in_quota, borrowed, burst = split_use(team.use_milli, team.nominal_milli, team.burst_milli)
    set_rate(iq, in_quota, t)
    set_rate(bo, borrowed, t)
    set_rate(bu, burst, t)
    set_rate(en, team.nominal_milli, t)


def _retally_pool(state: PoolState, t: int) -> None:
    """The pool's buckets after its chips or the charged total changed (idle is derived by the books)."""
    cap, unav, _, over = state.books.pool_accounts()
    available = state.capacity_milli - state.unavailable_milli
    charged = state.charged_milli
    set_rate(cap, state.capacity_milli, t)
    set_rate(unav, state.unavailable_milli, t)
    set_rate(over, charged - available if charged > available else 0, t)


def _charge(state: PoolState, job: Job, new_charge: int, t: int) -> None:
    """Change what a running job is charged from instant t on; the team's split and the pool's overcommitted
    bucket follow (capacity, unavailable and entitlement do not change with a charge)."""
    delta = new_charge - job.charged_milli
    if not delta:
        return
    job.run_alloc_mchip_s += job.charged_milli * (t - job.since)
    job.since = t
    job.charged_milli = new_charge
    _use(state, state.teams[job.team], delta, t)


def _use(state: PoolState, team: Team, delta: int, t: int) -> None:
    """The team's use changes by `delta` milli-chips at t: its in-quota / borrowed / burst split and the pool's
    overcommitted bucket follow; the pool's idle bucket is derived from the others when the books post
    (`Books._post`). (`split_use` and `set_rate` written out: this runs at every start and end of a run.)"""
    use = team.use_milli = team.use_milli + delta
    charged = state.charged_milli = state.charged_milli + delta
    books = state.books
    h = books._handles.get(team.name)
    if h is None:
        h = books.team_accounts(team.name)
    nominal = team.nominal_milli
    acc = h[0]
    if use <= nominal:  # the common case: all in quota, nothing borrowed, no burst in use
        if acc[0] != use:
            acc[2] += acc[0] * (t - acc[1])
            acc[1] = t
            acc[0] = use
        acc = h[1]
        if acc[0]:
            acc[2] += acc[0] * (t - acc[1])
            acc[1] = t
            acc[0] = 0
        acc = h[2]
        if acc[0]:
            acc[2] += acc[0] * (t - acc[1])
            acc[1] = t
            acc[0] = 0
    else:
        if acc[0] != nominal:
            acc[2] += acc[0] * (t - acc[1])
            acc[1] = t
            acc[0] = nominal
        over = use - nominal
        burst = team.burst_milli
        if over < burst:
            burst = over
        rate = over - burst
        acc = h[1]
        if acc[0] != rate:
            acc[2] += acc[0] * (t - acc[1])
            acc[1] = t
            acc[0] = rate
        acc = h[2]
        if acc[0] != burst:
            acc[2] += acc[0] * (t - acc[1])
            acc[1] = t
            acc[0] = burst
    h = books._handles.get(None)
    if h is None:
        h = books.pool_accounts()
    acc = h[3]  # overcommitted: what is charged beyond the available chips (rare)
    free = state.capacity_milli - state.unavailable_milli - charged
    if free < 0:
        if acc[0] != -free:
            acc[2] += acc[0] * (t - acc[1])
            acc[1] = t
            acc[0] = -free
    elif acc[0]:
        acc[2] += acc[0] * (t - acc[1])
        acc[1] = t
        acc[0] = 0


def _pending_demand(state: PoolState, name: str, jobs: int, milli: int, t: int) -> None:
    """Change a team's pending jobs and chips, and the rate of its `pending` account, at t."""
    team = state.teams[name]
    team.pending += jobs
    rate = team.pending_milli = team.pending_milli + milli
    h = state.books._handles.get(name)
    if h is None:
        h = state.books.team_accounts(name)
    set_rate(h[4], rate, t)


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


def _accrue_job(job: Job, t: int) -> None:
    job.run_alloc_mchip_s += job.charged_milli * (t - job.since)
    job.since = t


# ---------------------------------------------------------------------------------------------------------
# apply: one function per event type; the event has passed its check. As for the checks: `d` is the event's
# fields, `e` the event itself for the rare types that read its properties (chips_milli, at_s)
# ---------------------------------------------------------------------------------------------------------

def _apply_pool_configured(s: PoolState, e, t, step, config=DEFAULT_CONFIG):
    s.flavor = e.flavor
    s.chips_per_node = e.chips_per_node


def _apply_chip_registered(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    chip_id = d["chip_id"]
    node = d["node"]
    chip = s.chips[chip_id] = Chip(node)
    s.capacity_milli += MILLI
    _node_change(s, node, 1, 1)
    _retally_pool(s, t)
    _post_chip_state(s, chip_id, chip, t, step)


def _apply_chip_state_changed(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    chip_id = d["chip_id"]
    state = d["state"]
    chip = s.chips[chip_id]
    was = chip.available
    chip.set_state(state)
    if chip.jobs and state != "healthy":  # the throughput fact notes the chips a job held that were not healthy
        _chip_unhealthy(s, chip, chip_id)
    _post_chip_state(s, chip_id, chip, t, step)
    now = chip.available
    if was == now:
        return
    if now:
        s.down.discard(chip_id)
        s.unavailable_milli -= MILLI
    else:
        s.down.add(chip_id)
        s.unavailable_milli += MILLI
    s.run_epoch += 1
    s.other_epoch += 1
    if not chip.jobs:
        _node_change(s, chip.node, 0, 1 if now else -1)
    for job_id, share in chip.jobs.items():
        job = s.jobs[job_id]
        _charge(s, job, job.charged_milli + (share if now else -share), t)
    _retally_pool(s, t)


def _apply_chip_retired(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    chip_id = d["chip_id"]
    chip = s.chips.pop(chip_id)
    _post_chip_state(s, chip_id, None, t, step, chip.node)
    s.capacity_milli -= MILLI
    _node_change(s, chip.node, -1, -1 if chip.available and not chip.jobs else 0)
    s.run_epoch += 1
    s.other_epoch += 1
    if not chip.available:
        s.down.discard(chip_id)
        s.unavailable_milli -= MILLI
    else:
        for job_id, share in chip.jobs.items():  # a retired chip is charged to nobody
            job = s.jobs[job_id]
            _charge(s, job, job.charged_milli - share, t)
    _retally_pool(s, t)


def _post_chip_state(s: PoolState, chip_id: str, chip: Optional[Chip], t: int, step: Step, node: str = "") -> None:
    """The chip's registration and state from t on (fact `chip_states`); `chip` None: retired from `node`."""
    if chip is None:
        row = (s.pool, chip_id, node, t, s.applied, "retired", False, False)
    else:
        row = (s.pool, chip_id, chip.node, t, s.applied, chip.state, True, chip.available)
    _rows(step, "chip_states").append(_new_tuple(ChipStateRow, row))


def _post_grant(s: PoolState, g: Grant, t: int, step: Step) -> None:
    """A grant the pool holds from t, in effect from max(t, effective_from) until its effective_until (fact
    `grant_intervals`). Never empty: a grant is held only while its effective_until is ahead of the clock, and
    the schema has it after effective_from."""
    start = t if g.effective_from is None or g.effective_from < t else g.effective_from
    _rows(step, "grant_intervals").append(_grant_row(s, g, t, start, g.effective_until, False, t))


def _post_grant_end(s: PoolState, g: Grant, t: int, step: Step) -> None:
    """A grant held until t (revoked, or amended by a re-grant of its id) ends at t, before the end it was granted
    for (a grant's effective_until passes before any event at or after it): the end of its incarnation."""
    _rows(step, "grant_intervals").append(_grant_row(s, g, None, None, t, True, t))


def _grant_row(s: PoolState, g: Grant, granted: Optional[int], start: Optional[int], until: Optional[int],
               ended: bool, t: int) -> GrantIntervalRow:
    return _new_tuple(GrantIntervalRow, (s.pool, g.grant_id, g.team, g.version, g.chips_milli,
                                         g.borrowing_limit_milli, g.lending_limit_milli, granted, start, until,
                                         ended, t))


def _ts(ts) -> Optional[int]:
    return None if ts is None else epoch_s(ts)


def _milli_or_none(chips) -> Optional[int]:
    return None if chips is None else int(chips * MILLI)


def _apply_quota_granted(s: PoolState, e, t, step, config=DEFAULT_CONFIG):
    old = s.grants.pop(e.grant_id, None)
    if old is not None:
        s.held_milli -= old.chips_milli
        _post_grant_end(s, old, t, step)
    if old is not None:  # a re-grant under the same id amends the grant
        _deactivate(s, old, t)
    # versions are unique in the pool, not per grant: a grant id revoked and granted anew must not match the
    # boundaries still queued for its earlier incarnation
    s.seq += 1
    version = s.seq
    g = Grant(e.grant_id, e.team, e.chips_milli, _milli_or_none(e.borrowing_limit),
              _milli_or_none(e.lending_limit), _ts(e.effective_from), _ts(e.effective_until), version)
    s.team(e.team)
    if g.effective_until is not None and g.effective_until <= t:
        return  # already over: nothing to hold
    s.grants[g.grant_id] = g
    s.held_milli += g.chips_milli
    _post_grant(s, g, t, step)
    if g.effective_from is None or g.effective_from <= t:
        _grant_on(s, g.grant_id, version, t)
    else:
        s.push_boundary(g.effective_from, "grant_on", g.grant_id, version)
    if g.effective_until is not None:
        s.push_boundary(g.effective_until, "grant_off", g.grant_id, version)


def _deactivate(s: PoolState, g: Grant, t: int) -> None:
    if g.active:
        g.active = False
        team = s.teams[g.team]
        team.nominal_milli -= g.chips_milli
        _retally_team(s, team, t)
        s.other_epoch += 1
        s.quota_epoch += 1


def _apply_quota_revoked(s: PoolState, e, t, step, config=DEFAULT_CONFIG):
    g = s.grants.pop(e.grant_id)  # the check saw it held at t
    s.held_milli -= g.chips_milli
    _post_grant_end(s, g, t, step)
    _deactivate(s, g, t)


def _apply_burst_requested(s: PoolState, e, t, step, config=DEFAULT_CONFIG):
    """Decide the request now; an approved or cut burst is a reservation for its window (burst_on/off)."""
    s.team(e.team)
    decision, reservation = policy.decide_burst(s, e, t, config)
    _rows(step, "decisions").append(policy.decision_row(decision, t))
    policy.count_decision(s, "burst", decision.rule, decision.verdict)
    if reservation is not None and e.request_id not in s.bursts:  # a request id is decided once
        s.bursts[e.request_id] = reservation
        start, end = reservation[2], reservation[3]
        if start <= t:
            _burst_on(s, e.request_id, 0, t)
        else:
            s.push_boundary(start, "burst_on", e.request_id)
        s.push_boundary(end, "burst_off", e.request_id)


def _milli_of(chips) -> int:
    """A job's chips (a Decimal) as milli-chips: e.chips_milli, memoized (Decimal arithmetic costs more than the
    rest of a submission). Keyed by the Decimal's text: hashing a Decimal with decimals takes a modular power
    (about 3,000 instructions a look-up under callgrind), its text a few hundred; equal texts are equal values."""
    key = str(chips)
    milli = _MILLI_OF.get(key)
    if milli is None:
        if len(_MILLI_OF) >= 4096:
            _MILLI_OF.clear()
        milli = _MILLI_OF[key] = to_milli(chips)
    return milli


def _apply_job_submitted(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    milli = _milli_of(d["chips"])
    job_id = d["job_id"]
    team = d["team"]
    job = s.jobs[job_id] = Job(job_id, team, milli, d["priority"], d["preemptible"], d["chips_per_node"], t)
    s.active_milli += milli
    s.team(team)
    _enqueue(s, job, t)


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


def _end_run(s: PoolState, job: Job, t: int, reason: str, step: Step) -> None:
    """Close a running job's run: post the rest of its allocation and the work lost, release its chips."""
    charged = job.charged_milli
    alloc = job.run_alloc_mchip_s = job.run_alloc_mchip_s + charged * (t - job.since)
    job.since = t
    lost = alloc - job.alloc_at_safe_mchip_s if reason == "preempted" or reason == "failed" else 0
    name = job.team
    job_id = job.job_id
    amount = alloc - job.run_posted_mchip_s
    row = _new_tuple(JobRunRow, (s.pool, job_id, name, job.run_index, job.chips_milli, job.priority,
                                 job.submitted_at, job.run_started_at, t, reason, amount, lost, t))
    _rows(step, "job_runs").append(row)
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


def _apply_job_preempted(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    job = s.jobs[d["job_id"]]
    _end_run(s, job, t, "preempted", step)
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
    # held (cancelled before it was eligible again): it was no demand and had no wait, so nothing is posted


# what preemption looks at after an event (evolve): nothing, the job of the event, or every queue's head
_NO_LOOK: Final = 0
_JOB: Final = 1
_ALL: Final = 2


# ---------------------------------------------------------------------------------------------------------
# invariants (for tests and debug mode): recomputed from scratch, compared with the incremental state
# ---------------------------------------------------------------------------------------------------------

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
