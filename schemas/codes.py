"""Rejection codes: why an input was not applied. Values, not exceptions.

The enum order is the precedence order: when several codes apply to one input, the first one listed wins.
The numeric value of each code is its rank, so `min()` over candidate codes gives the one to report.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RejectionCode(str, Enum):
    bad_key = "bad_key"                    # Kafka only: no message key, or not the event's pool / partition
    bad_signature = "bad_signature"        # Kafka only: unsigned, unknown principal or a signature that does not check (streams.principals)
    wrong_role = "wrong_role"              # Kafka only: the principal's roles may not send this event type (schemas.roles)
    not_owner = "not_owner"                # Kafka only: the pool is not of a cluster the principal speaks for
    too_large = "too_large"                # the message is over [ledger] max_event_bytes (checked before parsing)
    not_json = "not_json"                  # the bytes are not one JSON object (bad UTF-8, syntax, not an object)
    too_deep = "too_deep"                  # JSON nested deeper than MAX_DEPTH (no event nests beyond 2)
    unknown_type = "unknown_type"          # `type` missing or not one of the event types
    schema_invalid = "schema_invalid"      # fields missing, extra, of the wrong type or out of range
    unknown_pool = "unknown_pool"          # the pool was never configured
    clock_ahead = "clock_ahead"            # event time further ahead of its append time than [ledger] max_clock_skew_s
    clock_jump = "clock_jump"              # further ahead of the pool clock than [ledger] max_clock_jump_s
    too_late = "too_late"                  # older than the pool clock minus the dedup window: not applied
    unknown_chip = "unknown_chip"          # a chip id that is not registered in the pool
    unknown_job = "unknown_job"            # a job id that is not active in the pool
    unknown_grant = "unknown_grant"        # a grant id that is not held in the pool
    illegal_transition = "illegal_transition"  # the event is not allowed in the entity's current state
    progress_backwards = "progress_backwards"  # a progress count below the run's last, or a restart's below its checkpoint's
    over_limit = "over_limit"              # it would take a pool total past its bound (schemas.events.MAX_POOL_*)
    duplicate_conflict = "duplicate_conflict"  # an event id seen before, with a different body

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {code: i for i, code in enumerate(RejectionCode)}


MAX_DETAIL = 500  # characters: every rejection's detail is cut to this (it goes into dead letters)


def cap_detail(text: str) -> str:
    return text if len(text) <= MAX_DETAIL else text[: MAX_DETAIL - 1] + "…"


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why one input was refused: a code (see precedence above) and a sentence for people, at most MAX_DETAIL
    characters (cut when longer, whoever wrote it)."""

    code: RejectionCode
    detail: str

    def __post_init__(self):
        if len(self.detail) > MAX_DETAIL:
            object.__setattr__(self, "detail", cap_detail(self.detail))
