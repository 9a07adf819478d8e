"""Output records: decisions (topic chipledger.decisions) and dead letters (topic chipledger.deadletter).

Decisions carry a deterministic `decision_id` derived from the triggering event id and the rule, so replays
and retries produce the same id. Dead letters keep the raw bytes (base64) so nothing is ever lost.
"""

from __future__ import annotations

import base64
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from schemas.codes import RejectionCode
from schemas.events import Timestamp


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class JobRef(_Frozen):
    job_id: str
    team: str


class Victim(_Frozen):
    job_id: str
    team: str
    chips: float = Field(description="chips freed by preempting this job")
    lost_work_chip_s: int = Field(description="chip-seconds of work since the job's last checkpoint or start")
    preemption_count: int = Field(description="times this job was preempted before, within the window")


class DecisionPreempt(_Frozen):
    decision_id: str
    type: Literal["decision.preempt"] = "decision.preempt"
    pool: str
    at: Timestamp = Field(description="event time of the decision")
    rule: Literal["reclaim", "priority"]
    beneficiary: JobRef
    victims: list[Victim]
    checkpoint_by: Optional[Timestamp] = Field(
        None, description="cooperative preemption: a victim that checkpoints before this instant loses only the "
                          "work after that checkpoint (the decision's instant + [policy] checkpoint_grace_s)")
    numbers: dict[str, float] = Field(description="the fair-share and quota numbers the rule used")
    message: str = Field(description="one line for people")


class DecisionBurst(_Frozen):
    decision_id: str
    type: Literal["decision.burst"] = "decision.burst"
    pool: str
    at: Timestamp
    request_id: str
    team: str
    verdict: Literal["approved", "partial", "denied"]
    chips_granted: float
    window_start: Timestamp
    window_end: Timestamp
    rule: str
    numbers: dict[str, float]
    message: str


class DeadLetter(_Frozen):
    """One input that was not applied, with where it came from and its bytes as received."""

    topic: str = Field(description="original topic, or 'file:<path>' for the embedded run")
    partition: int = Field(description="original partition (0 for a file)")
    offset: int = Field(description="original offset (line number, from 1, for a file)")
    raw_b64: str = Field(description="the message value exactly as received, base64")
    error_code: RejectionCode
    detail: str
    event_id: Optional[str] = None
    event_type: Optional[str] = None
    pool: Optional[str] = None

    @property
    def raw(self) -> bytes:
        return base64.b64decode(self.raw_b64)

    @staticmethod
    def encode_raw(raw: bytes) -> str:
        return base64.b64encode(raw).decode("ascii")


OUTPUT_MODELS = {"decision.preempt": DecisionPreempt, "decision.burst": DecisionBurst, "deadletter": DeadLetter}
