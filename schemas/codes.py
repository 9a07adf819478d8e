"""Rejection codes: why an input was not applied. Values, not exceptions.

The enum order is the precedence order: when several codes apply to one input, the first one listed wins.
The numeric value of each code is its rank, so `min()` over candidate codes gives the one to report.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RejectionCode(str, Enum):
    not_json = "not_json"                  # the bytes are not one JSON object
    unknown_type = "unknown_type"          # `type` missing or not one of the event types
    schema_invalid = "schema_invalid"      # fields missing, extra, of the wrong type or out of range
    unknown_pool = "unknown_pool"          # the pool was never configured
    unknown_chip = "unknown_chip"          # a chip id that is not registered in the pool
    unknown_job = "unknown_job"            # a job id that is not active in the pool
    unknown_grant = "unknown_grant"        # a grant id that is not held in the pool
    illegal_transition = "illegal_transition"  # the event is not allowed in the entity's current state
    duplicate_conflict = "duplicate_conflict"  # an event id seen before, with a different body

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {code: i for i, code in enumerate(RejectionCode)}


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why one input was refused: a code (see precedence above) and a sentence for people."""

    code: RejectionCode
    detail: str
