"""Input events: the envelope and one frozen pydantic model per event type (DESIGN §3).

Units on the wire are the ones people use: chips (up to 3 decimals, for MIG and time-sliced shares) and
RFC 3339 timestamps with a zone. The core works in integer milli-chips and integer seconds; `chips_milli`
and `at_s` give those values, so the conversion is written once, here.
"""

from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal, InvalidOperation
from typing import Annotated, Literal, Optional, Union

from pydantic_core import TzInfo
from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
    model_validator,
)

MILLI = 1000  # milli-chips per chip: the one scale for chip amounts in the whole project
# Bounds that keep every integer the ledger writes inside int64 (Parquet, PostgreSQL BIGINT, orjson), with
# room to spare (docs/events.md, "Limits"): an amount is at most MAX_CHIPS chips (1e9 milli-chips), a pool's
# totals (registered chips, chips of running jobs, of pending jobs, of the quota it holds) at most
# MAX_POOL_CHIPS each (the fold rejects what would pass them: `over_limit`), and event times lie in
# [MIN_TIME, MAX_TIME), 4.1e9 s. So any account's rate is at most 1e9 milli-chips and anything accrued over a
# pool's life at most 1e9 × 4.1e9 = 4.1e18 mchip-s (a job run, an account's total, a decayed usage), and the
# largest sum the fold keeps (a team's used + pending demand) at most 8.2e18 < 2^63 ≈ 9.22e18.
MAX_CHIPS = 1_000_000
MAX_POOL_CHIPS = 1_000_000
MAX_POOL_MILLI = MAX_POOL_CHIPS * MILLI
MAX_RUNTIME_S = 100 * 365 * 86400  # an expected run time is at most a century (keeps sums in int64)
MIN_TIME = datetime(1970, 1, 1, tzinfo=timezone.utc)
MAX_TIME = datetime(2100, 1, 1, tzinfo=timezone.utc)


def _to_decimal(value, *, allow_zero: bool) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
        raise ValueError("chips must be a JSON number")
    try:
        d = Decimal(str(value)) if isinstance(value, float) else Decimal(value)
    except InvalidOperation:
        raise ValueError(f"chips {value!r} is not a number") from None
    if not d.is_finite():
        raise ValueError("chips must be finite")
    if abs(d) > MAX_CHIPS:  # checked first: quantize below would overflow the Decimal context
        raise ValueError(f"chips must be <= {MAX_CHIPS}, got {value}")
    if d.as_tuple().exponent < -3 and d != d.quantize(Decimal("0.001")):
        raise ValueError(f"chips {value} has more than 3 decimals (the unit is 1/1000 chip)")
    if d < 0 or (d == 0 and not allow_zero):
        raise ValueError(f"chips must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return d.quantize(Decimal("0.001"))


def _serialize_chips(d: Decimal):
    return int(d) if d == d.to_integral_value() else float(d)


Chips = Annotated[
    Decimal,
    BeforeValidator(lambda v: _to_decimal(v, allow_zero=False)),
    PlainSerializer(_serialize_chips, when_used="json"),
    WithJsonSchema({"type": "number", "exclusiveMinimum": 0, "maximum": MAX_CHIPS, "multipleOf": 0.001,
                    "description": "chips (1 chip = 1000 milli-chips; at most 3 decimals)"}),
]
ChipLimit = Annotated[
    Decimal,
    BeforeValidator(lambda v: _to_decimal(v, allow_zero=True)),
    PlainSerializer(_serialize_chips, when_used="json"),
    WithJsonSchema({"type": "number", "minimum": 0, "maximum": MAX_CHIPS, "multipleOf": 0.001,
                    "description": "chips (at most 3 decimals)"}),
]


def _require_zone(value):
    # pydantic would accept a bare number as a UTC timestamp; the contract asks for RFC 3339 text with a zone
    # (and it would read a numeric string such as "1700000000" as Unix time too)
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(value, str):
        try:
            float(value)
            numeric = True
        except ValueError:
            pass
    if numeric:
        raise ValueError("timestamps must be RFC 3339 strings with a zone, e.g. 2026-11-02T08:00:00Z")
    return value


Timestamp = Annotated[AwareDatetime, BeforeValidator(_require_zone)]
# an event's own time lies in [MIN_TIME, MAX_TIME): schemas.parse checks it after validation (a constraint
# here would cost a third of the validation); grant and burst windows may reach further: they are instants
# the clock may never reach, and nothing is multiplied by them
EventTime = Annotated[Timestamp, WithJsonSchema({"type": "string", "format": "date-time",
                                                 "formatMinimum": "1970-01-01T00:00:00Z",
                                                 "formatExclusiveMaximum": "2100-01-01T00:00:00Z"})]
# ids and names never hold control characters (C0, DEL, C1): a NUL breaks PostgreSQL text, an escape code a
# terminal; free text (`reason`) may hold tabs and line breaks, no other C0 character. The patterns are in the
# JSON Schema for producers; schemas.parse checks them (`control_characters`), after validation and only
# when the message's bytes could hold such a character at all, which keeps them off the common path.
NO_CONTROL = r"^[^\x00-\x1f\x7f-\x9f]*$"
TEXT_PATTERN = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f]*$"
Name = Annotated[str, Field(min_length=1, max_length=256, json_schema_extra={"pattern": NO_CONTROL})]
Text = Annotated[str, Field(max_length=1024, json_schema_extra={"pattern": TEXT_PATTERN})]
TEXT_FIELDS = frozenset({"reason", "message"})  # the free-text fields; every other string of an event is an id or a name
# (job.waiting's `reason` is a machine word, not free text: schemas.parse checks it as a name)


def to_milli(chips: Decimal) -> int:
    """Chips (a validated Decimal with at most 3 decimals) as integer milli-chips."""
    return int(chips * MILLI)


def from_milli(milli: int) -> float:
    """Milli-chips as chips, for people and for the wire."""
    return milli / MILLI


_UNIX_ORDINAL = 719163  # date(1970, 1, 1).toordinal()
_OFFSET_S: dict = {}  # fixed-offset tzinfo -> its UTC offset in seconds (memoized: this runs once per event)


def epoch_s(ts: datetime) -> int:
    """A zone-aware timestamp as whole seconds since the Unix epoch (sub-second parts are floored)."""
    tz = ts.tzinfo
    off = _OFFSET_S.get(tz)
    if off is None:
        delta = ts.utcoffset()
        off = delta.days * 86400 + delta.seconds
        if isinstance(tz, (timezone, TzInfo)):  # fixed offsets only; a zone with DST is asked every time
            _OFFSET_S[tz] = off
    return (ts.toordinal() - _UNIX_ORDINAL) * 86400 + ts.hour * 3600 + ts.minute * 60 + ts.second - off


class _Event(BaseModel):
    """The envelope shared by every event."""

    model_config = ConfigDict(frozen=True, extra="forbid", str_strip_whitespace=False)

    event_id: str = Field(min_length=1, max_length=128, json_schema_extra={"pattern": NO_CONTROL},
                          description="unique id minted by the producer; re-sending it is a no-op")
    occurred_at: EventTime = Field(description="event time, RFC 3339 with a zone, in [1970-01-01, 2100-01-01)")
    pool: Name = Field(description="capacity domain: one accelerator flavor in one cluster")
    source: Name = Field(description="producer identity, e.g. cluster-a/kueue")
    schema_version: Literal[1] = Field(1, description="contract version; only 1 exists")

    @property
    def at_s(self) -> int:
        """Event time in whole epoch seconds."""
        return epoch_s(self.occurred_at)


class PoolConfigured(_Event):
    type: Literal["pool.configured"]
    flavor: Name
    chips_per_node: int = Field(ge=1, le=4096, strict=True)


class PoolTick(_Event):
    type: Literal["pool.tick"]


class ChipRegistered(_Event):
    type: Literal["chip.registered"]
    chip_id: Name
    node: Name


class ChipStateChanged(_Event):
    type: Literal["chip.state_changed"]
    chip_id: Name
    state: Literal["healthy", "degraded", "down", "maintenance"]
    reason: Optional[Text] = None


class ChipRetired(_Event):
    type: Literal["chip.retired"]
    chip_id: Name


class QuotaGranted(_Event):
    type: Literal["quota.granted"]
    grant_id: Name
    team: Name
    chips: Chips
    borrowing_limit: Optional[ChipLimit] = Field(None, description="chips this team may borrow; absent = unlimited")
    lending_limit: Optional[ChipLimit] = Field(None, description="chips of this quota others may borrow; absent = all")
    effective_from: Optional[Timestamp] = None
    effective_until: Optional[Timestamp] = None

    @model_validator(mode="after")
    def _window(self):
        if self.effective_from and self.effective_until and self.effective_until <= self.effective_from:
            raise ValueError("effective_until must be after effective_from")
        return self

    @property
    def chips_milli(self) -> int:
        return to_milli(self.chips)


class QuotaRevoked(_Event):
    type: Literal["quota.revoked"]
    grant_id: Name


class BurstRequested(_Event):
    type: Literal["burst.requested"]
    request_id: Name
    team: Name
    chips: Chips
    window_start: Timestamp
    window_end: Timestamp
    reason: Optional[Text] = None
    # the signed-in member who asked (set by the portal, whose principal may send bursts only for that member's
    # team); absent = sent by an admin or a tool. Optional and additive: the core never reads it
    requested_by: Optional[Name] = Field(None, description="the member who asked for the burst (set by the "
                                                           "portal); absent = an admin or a tool")

    @model_validator(mode="after")
    def _window(self):
        if self.window_end <= self.window_start:
            raise ValueError("window_end must be after window_start")
        return self

    @property
    def chips_milli(self) -> int:
        return to_milli(self.chips)


class JobSubmitted(_Event):
    type: Literal["job.submitted"]
    job_id: Name
    team: Name
    chips: Chips
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1, strict=True, description="higher wins")
    preemptible: bool = Field(True, strict=True)
    chips_per_node: Optional[int] = Field(None, ge=1, le=4096, strict=True)
    # who submitted it, inside its team (Slurm's User, a login): for per-user books; absent = unknown. Optional
    # and additive (schema_version stays 1): the core never reads it, analytics does (`usage_by_user`)
    user: Optional[Name] = Field(None, description="the user who submitted the job (e.g. a Unix login); "
                                                   "absent = unknown")
    # the producer's estimate of the run time, or the job's time limit (Slurm's TimeLimit), for start-time
    # estimates; and the Kubernetes namespace (a Kueue LocalQueue's) it was submitted in. Optional and additive
    expected_runtime_s: Optional[int] = Field(None, ge=1, le=MAX_RUNTIME_S, strict=True,
                                              description="seconds the job is expected to run (the producer's "
                                                          "estimate or its time limit); absent = unknown")
    namespace: Optional[Name] = Field(None, description="the Kubernetes namespace (of its Kueue LocalQueue) the "
                                                        "job was submitted in; absent = not Kubernetes or unknown")

    @property
    def chips_milli(self) -> int:
        return to_milli(self.chips)


class JobWaiting(_Event):
    """The scheduler's own reason a pending job waits (Kueue's condition reason, Slurm's Reason): legal only
    while the job is in the queue; the fold keeps the last one on the job (for `why` and the portal) and writes
    nothing to the books."""

    type: Literal["job.waiting"]
    job_id: Name
    reason: Annotated[str, Field(min_length=1, max_length=128, json_schema_extra={"pattern": NO_CONTROL},
                                 description="a machine word, e.g. Kueue's Pending reason or Slurm's "
                                             "Priority/Resources")]
    message: Optional[Text] = Field(None, description="the scheduler's own sentence, when it has one")


class JobStarted(_Event):
    type: Literal["job.started"]
    job_id: Name
    chip_ids: Optional[list[Name]] = Field(None, min_length=1, description="placement, when known")

    @model_validator(mode="after")
    def _unique(self):
        if self.chip_ids is not None and len(set(self.chip_ids)) != len(self.chip_ids):
            raise ValueError("chip_ids must not repeat")
        return self


# cumulative work units of a job (steps, samples, tokens): up to 10^18, so a count and its differences stay in int64
MAX_UNITS = 10**18
Units = Annotated[int, Field(ge=0, le=MAX_UNITS, strict=True,
                             description="cumulative work units of the job (steps, samples, tokens) since it "
                                         "was first started; never goes back within a run, and a restart "
                                         "continues from the count of the last checkpoint")]
UnitName = Annotated[str, Field(min_length=1, max_length=64, json_schema_extra={"pattern": NO_CONTROL},
                                description="the name of the work unit, e.g. step, sample or token")]


class JobCheckpointed(_Event):
    type: Literal["job.checkpointed"]
    job_id: Name
    units: Optional[Units] = None  # the job's count at the checkpoint (a progress report too), when known


class JobProgress(_Event):
    """A running job reports how much work it has done (its throughput SLO, docs/analytics.md)."""

    type: Literal["job.progress"]
    job_id: Name
    units: Units
    unit: UnitName


#: why a run was interrupted (DESIGN §4's cause table): lost work is booked for every cause, but only
#: `preempted` counts as a preemption (statements, max_preemptions, anti-thrash)
CAUSES = ("preempted", "requeued", "failure")


class JobPreempted(_Event):
    type: Literal["job.preempted"]
    job_id: Name
    decision_id: Optional[Name] = None
    # why the run ended: preempted (the default; always so with a decision_id, whatever is sent), requeued (an
    # admin's requeue or deactivation) or failure (a node or chip failed under the job). Optional and additive
    cause: Optional[Literal["preempted", "requeued", "failure"]] = Field(
        None, description="preempted (default; a decision_id makes it preempted whatever is sent), requeued (an "
                          "admin's requeue or deactivation) or failure (a node or chip failed under the job)")
    reason: Optional[Text] = Field(None, description="the scheduler's own reason, e.g. Kueue's "
                                                     "InCohortReclamation or Slurm's PREEMPTED")
    # back in the queue but not eligible to start yet (a scheduler's hold-off after a requeue: Slurm's next
    # Eligible): the job is held, neither running nor pending demand, until a `job.released` (or it starts or
    # finishes). Optional and additive (schema_version stays 1): absent or false = pending at once, as before
    held: Optional[bool] = Field(None, strict=True,
                                 description="true: the job is back in the queue but not eligible yet (held) "
                                             "until its job.released; absent or false: pending at once")


class JobReleased(_Event):
    """A held job (`job.preempted` with `held`) is eligible again: from now on it is pending demand and waits."""

    type: Literal["job.released"]
    job_id: Name


class JobFinished(_Event):
    type: Literal["job.finished"]
    job_id: Name
    outcome: Literal["succeeded", "failed", "cancelled"]


# prices and budgets (DESIGN §3, §9): integers in a declared unit, a currency's minor unit (USD-cent) or a billing
# unit (Slurm's TRESBillingWeights); bounded so a cost over a pool's life stays in int64 once accrued
MAX_PRICE = 10**9    # per chip-hour, in its unit
MAX_AMOUNT = 10**15  # a budget, in its unit
MoneyUnit = Annotated[str, Field(min_length=1, max_length=64, json_schema_extra={"pattern": NO_CONTROL},
                                 description="the unit of the amount: a currency's minor unit such as USD-cent, "
                                             "or billing (declared billing units)")]
HOURS_OF_WEEK = 168  # Monday 00:00 UTC = hour 0


class PriceSet(_Event):
    """A flavor's price in this pool, per chip-hour, from `effective_from` (not before the pool clock: prices
    apply forward; absent = at once) until `effective_until`, in the UTC hours of the week listed (absent =
    every hour). A price id set again replaces its earlier setting from its own effective_from."""

    type: Literal["price.set"]
    price_id: Name
    per_chip_hour: int = Field(ge=0, le=MAX_PRICE, strict=True, description="price of one chip for one hour, in `unit`")
    unit: MoneyUnit
    effective_from: Optional[Timestamp] = None
    effective_until: Optional[Timestamp] = None
    hours_of_week: Optional[list[Annotated[int, Field(ge=0, lt=HOURS_OF_WEEK, strict=True)]]] = Field(
        None, min_length=1, max_length=HOURS_OF_WEEK,
        description="UTC hours of the week (Monday 00:00 = 0 … 167) the price holds in; absent = every hour")

    @model_validator(mode="after")
    def _window(self):
        if self.effective_from and self.effective_until and self.effective_until <= self.effective_from:
            raise ValueError("effective_until must be after effective_from")
        h = self.hours_of_week
        if h is not None and len(set(h)) != len(h):
            raise ValueError("hours_of_week must not repeat")
        return self


class BudgetSet(_Event):
    """A team's budget in this pool per calendar period (UTC), from `effective_from` (absent = at once). A
    team's budget across pools is the sum of its pools' budgets (analytics)."""

    type: Literal["budget.set"]
    budget_id: Name
    team: Name
    period: Literal["month", "quarter"]
    amount: int = Field(ge=0, le=MAX_AMOUNT, strict=True, description="the budget of one period, in `unit`")
    unit: MoneyUnit
    effective_from: Optional[Timestamp] = None


EVENT_MODELS: dict[str, type[_Event]] = {
    m.model_fields["type"].annotation.__args__[0]: m
    for m in (PoolConfigured, PoolTick, ChipRegistered, ChipStateChanged, ChipRetired, QuotaGranted,
              QuotaRevoked, BurstRequested, JobSubmitted, JobStarted, JobCheckpointed, JobProgress, JobPreempted,
              JobReleased, JobFinished, JobWaiting, PriceSet, BudgetSet)
}

Event = Annotated[Union[tuple(EVENT_MODELS.values())], Field(discriminator="type")]
