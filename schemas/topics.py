"""Kafka topic names and the partitioning key. One key (the pool), one partition, one order."""

from __future__ import annotations

TOPIC_QUOTA = "chipledger.quota"
TOPIC_JOBS = "chipledger.jobs"
TOPIC_CHIPS = "chipledger.chips"
TOPIC_DECISIONS = "chipledger.decisions"
TOPIC_JOURNAL = "chipledger.journal"
TOPIC_DEADLETTER = "chipledger.deadletter"
TOPIC_LOG = "chipledger.log"  # the sequenced log: a pool's input events in the one order the fold reads

INPUT_TOPICS = (TOPIC_QUOTA, TOPIC_JOBS, TOPIC_CHIPS)
OUTPUT_TOPICS = (TOPIC_DECISIONS, TOPIC_JOURNAL, TOPIC_DEADLETTER)

_TOPIC_BY_PREFIX = {
    "quota": TOPIC_QUOTA,
    "burst": TOPIC_QUOTA,
    "pool": TOPIC_QUOTA,
    "price": TOPIC_QUOTA,
    "budget": TOPIC_QUOTA,
    "job": TOPIC_JOBS,
    "chip": TOPIC_CHIPS,
}


def key_for(event) -> bytes:
    """The Kafka message key of an event: its pool, UTF-8 encoded."""
    return event.pool.encode("utf-8")


def topic_for(event_type: str) -> str:
    """The input topic an event type is published to (pool and quota events share the quota topic)."""
    prefix = event_type.split(".", 1)[0]
    try:
        return _TOPIC_BY_PREFIX[prefix]
    except KeyError:
        raise ValueError(f"no topic for event type {event_type!r}") from None
