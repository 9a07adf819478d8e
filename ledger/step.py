"""What one event did (`Step`), the fold's settings (`FoldConfig`) and the words the fold's modules share.

The fold is split by concern (ledger/fold.py has `evolve` and the dispatch; each module below says its rules
first): ledger/clock.py (the clock, the closing of hours, closing the books), ledger/rates.py (what each account
accrues at), ledger/chips.py (chips and nodes, free chips), ledger/grants.py (grants and bursts),
ledger/jobs.py (a job's life and its runs), ledger/waits.py (the queues and the waits), ledger/hol.py
(head-of-line blocking), ledger/progress.py (throughput), ledger/invariants.py (conservation, for tests).

How the fold is written for the compiled core
---------------------------------------------
These modules are compiled together with mypyc (ledger/_compiled.py). A few idioms keep the hot path native
where measurements under callgrind showed the generic path cost most (docs/benchmarks-history.md); code that
uses one says only which, as `(core: NAME)`:

- *fields*: an event's fields are read once from its `__dict__` (`d`, in evolve and the checks and applies of
  the frequent types), not as attributes: a pydantic model defines `__getattr__`, so every attribute read goes
  through CPython's slot_tp_getattr_hook (about 200 instructions; about 14 reads per event). The rare types
  take the event itself (`e`) and read its properties (chips_milli, at_s).
- *typed*: locals, dict values and the constants taken from schemas are given int types (`t: int`,
  `dict[str, list[int]]`, the `Final[int]`s below): the compiled core then does their arithmetic on machine
  integers. A name imported from schemas is an untyped object to it, and a module-level `Final` is a C static,
  not a look-up in the module's dict at each use.
- *direct calls*: evolve dispatches by an if-chain of event types, each branch calling its function; the
  fold's modules append rows through the plain function `_rows(step, table)`, not the method `Step.rows`. A
  call through a dict of functions, or to a method of the non-native `Step`, is a Python-level call from the
  compiled core (about 1,800 instructions).
- *no __init__*: rows are made as `_new_tuple(RowType, values)` and a Step as `_new_object(Step)` plus its two
  slots, skipping the Python-level `__new__`/`__init__` (slot_tp_init).
- *written out*: the hottest helpers are inlined by hand where they run for every event or run (epoch_s in
  evolve, split_use and set_rate in rates._use), and the common case is tested first.
- *memo*: a job's chips (a Decimal) become milli-chips through a bounded memo keyed by the Decimal's text
  (hashing a Decimal with decimals takes a modular power, about 3,000 instructions a look-up; its text a few
  hundred).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Optional

from mypy_extensions import mypyc_attr
from schemas.codes import Rejection
from schemas.events import _OFFSET_S, _UNIX_ORDINAL, MILLI as _MILLI

from ledger.state import NO_ROWS


_new_tuple: Final = tuple.__new__  # (core: no __init__) a NamedTuple row without its Python-level __new__
_new_object: Final = object.__new__
# (core: typed) the same values as schemas', as C statics with int types
UNIX_ORDINAL: Final[int] = _UNIX_ORDINAL
MILLI: Final[int] = _MILLI
OFFSET_S: Final[dict] = _OFFSET_S  # the same dict (epoch_s fills it), typed: a native look-up, not a method call

DEFAULT_DEDUP_WINDOW_S = 86_400  # event ids are remembered for a day of event time
DEFAULT_MAX_CLOCK_JUMP_S = 400 * 86_400  # an event further ahead of its pool's clock is `clock_jump`
DEFAULT_MAX_CLOCK_SKEW_S = 300  # an event further ahead of its append time is `clock_ahead` ([ledger] max_clock_skew_s)
MAX_PREEMPTIONS_KEPT = 16  # a job remembers the instants of its last 16 preemptions (anti-thrash)
MAX_REFERENCE_REPORTS = 256  # a job's reference rate is the median of at most this many intervals (bounded state)

# how a run was interrupted (job.preempted's cause, DESIGN §4): the run's end_reason in job_runs
PREEMPTED: Final = "preempted"
REQUEUED: Final = "requeued"
FAILURE: Final = "failure"
LOSES_WORK: Final = frozenset({PREEMPTED, REQUEUED, FAILURE, "failed"})  # "failed": a job.finished outcome

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
              "chip_states", "grant_intervals", "prices", "budgets", "costs",
              "run_costs")

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
    costs: list = NO_ROWS    # ledger.costs.CostRow
    run_costs: list = NO_ROWS  # ledger.costs.RunCostRow

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
                f"grant_intervals={self.grant_intervals}, prices={self.prices}, budgets={self.budgets}, "
                f"costs={self.costs}, run_costs={self.run_costs})")

    @property
    def applied(self) -> bool:
        return self.rejection is None and not self.duplicate


def _rows(step: Step, table: str) -> list:
    """`step.rows(table)` as a plain function (core: direct calls)."""
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


def _chips_text(milli: int) -> str:
    """Milli-chips as exact chips for a detail (1000000.001, not 1e+06)."""
    whole, frac = divmod(milli, MILLI)
    return f"{whole}.{frac:03d}".rstrip("0") if frac else str(whole)
