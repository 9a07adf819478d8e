"""The wire contract of chipledger: event, decision and dead-letter models, topics and parsing.

Everything that crosses a process boundary (Kafka message values, JSONL files, lake rows of raw events) is
defined here with pydantic v2. The ledger core imports these types; nothing here imports the core.
"""

from schemas.codes import RejectionCode, Rejection
from schemas.events import (
    EVENT_MODELS,
    Event,
    BudgetSet,
    BurstRequested,
    CAUSES,
    ChipRegistered,
    ChipRetired,
    ChipStateChanged,
    JobCheckpointed,
    JobFinished,
    JobPreempted,
    JobProgress,
    JobReleased,
    JobStarted,
    JobSubmitted,
    JobWaiting,
    PoolConfigured,
    PoolTick,
    PriceSet,
    QuotaGranted,
    QuotaRevoked,
    to_milli,
    from_milli,
    epoch_s,
    MILLI,
)
from schemas.outputs import DeadLetter, DecisionBurst, DecisionPreempt, JobRef, Victim, OUTPUT_MODELS
from schemas.parse import parse_event, parse_payload
from schemas.roles import ROLES, Principal, check as check_role, pool_cluster
from schemas.topics import (
    TOPIC_QUOTA,
    TOPIC_JOBS,
    TOPIC_CHIPS,
    TOPIC_DECISIONS,
    TOPIC_JOURNAL,
    TOPIC_DEADLETTER,
    INPUT_TOPICS,
    OUTPUT_TOPICS,
    key_for,
    topic_for,
)

__all__ = [name for name in dir() if not name.startswith("_")]
