"""Create chipledger's Kafka topics (idempotently) with kafka-python's admin client.

The three input topics (quota, jobs, chips) are keyed by pool and must have the same partition count: a pool's
events then land on the same partition number in every input topic (co-partitioning), so one worker owns the
whole pool. The output topics (decisions, journal, deadletter) get the same count for symmetry.

    create_topics(bootstrap, partitions=3, replication=1, timeout_s=30) -> {topic: "created" | "exists"}

Errors that stop a setup (no broker at the address, an input topic with another partition count, a refused
creation) raise `KafkaSetupError`, with a message meant for the person running the command.
"""

from __future__ import annotations

import logging
import time

from schemas import INPUT_TOPICS, OUTPUT_TOPICS
from schemas.topics import TOPIC_LOG
from streams.clients import KafkaConnection, as_connection

__all__ = ["KafkaSetupError", "TopicMismatchError", "ALL_TOPICS", "admin_client", "kafka_consumer", "create_topics",
           "describe_partitions", "describe_error"]

log = logging.getLogger(__name__)

ALL_TOPICS = tuple(INPUT_TOPICS) + (TOPIC_LOG,) + tuple(OUTPUT_TOPICS)
#: the log and the inputs need the same partition count (a pool's partition number is the same in all of them)
COPARTITIONED = tuple(INPUT_TOPICS) + (TOPIC_LOG,)
#: topic configs at creation: the log is kept for good (restarts, replicas and audits re-read it); the log and the
#: outputs take records up to 8 MiB (a log record is an input record plus headers, a dead letter holds an input
#: record's bytes in base64), so an input the broker accepted can always be logged and dead-lettered
#: The inputs keep the broker's append time, not the producer's (a producer's clock is a claim; issue 31): the worker
#: passes it to the core, which refuses an event further ahead of it than [ledger] max_clock_skew_s (clock_ahead)
INPUT_CONFIGS = {"message.timestamp.type": "LogAppendTime"}
TOPIC_CONFIGS = {TOPIC_LOG: {"retention.ms": "-1", "retention.bytes": "-1", "max.message.bytes": str(8 << 20)},
                 **{t: {"max.message.bytes": str(8 << 20)} for t in OUTPUT_TOPICS},
                 **{t: dict(INPUT_CONFIGS) for t in INPUT_TOPICS}}

_UNKNOWN_TOPIC = 3  # UNKNOWN_TOPIC_OR_PARTITION
_TOPIC_EXISTS = 36  # TOPIC_ALREADY_EXISTS


class KafkaSetupError(RuntimeError):
    """Kafka is not usable as configured: no broker answers, a topic is missing or has the wrong shape, …"""


class TopicMismatchError(KafkaSetupError):
    """An existing input topic has a partition count other than the one asked for."""


def describe_error(exc: BaseException) -> str:
    """`Name: message` for an exception, once (kafka-python's errors already start with their class name)."""
    name, text = type(exc).__name__, str(exc)
    return text if text.startswith(name) else f"{name}: {text}" if text else name


def _no_broker(bootstrap, exc: BaseException, timeout_s: float) -> KafkaSetupError:
    return KafkaSetupError(
        f"no Kafka broker answered at {as_connection(bootstrap).describe()} within {timeout_s:g}s ({describe_error(exc)}); "
        "start one (`chipledger kafka up`) or pass --bootstrap HOST:PORT / set CHIPLEDGER_KAFKA_BOOTSTRAP"
    )


def kafka_consumer(bootstrap: "str | KafkaConnection", *, client_id: str, timeout_s: float = 30, **settings):
    """A kafka-python `KafkaConsumer` without a group (the caller assigns partitions and seeks), with the
    connection's security settings (`bootstrap`: a KafkaConnection or a PLAINTEXT address), or
    `KafkaSetupError` when no broker answers."""
    from kafka import KafkaConsumer
    from kafka.errors import KafkaError

    conn = as_connection(bootstrap)
    try:
        return KafkaConsumer(**conn.kafka_python(), enable_auto_commit=False, group_id=None,
                             bootstrap_timeout_ms=max(1, int(timeout_s * 1000)), client_id=client_id, **settings)
    except KafkaError as exc:
        raise _no_broker(bootstrap, exc, timeout_s) from None
    except ValueError as exc:
        raise KafkaSetupError(f"bad Kafka bootstrap address {conn.bootstrap!r}: {exc}") from None


def admin_client(bootstrap: "str | KafkaConnection", timeout_s: float = 30):
    """A connected `KafkaAdminClient` (`bootstrap`: a KafkaConnection or a PLAINTEXT address), or
    `KafkaSetupError` when no broker answers within `timeout_s`."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    ms = max(1, int(timeout_s * 1000))
    conn = as_connection(bootstrap)
    try:
        return KafkaAdminClient(**conn.kafka_python(), bootstrap_timeout_ms=ms, request_timeout_ms=ms,
                                client_id="chipledger-admin")
    except KafkaError as exc:  # KafkaTimeoutError ("Unable to bootstrap"), NoBrokersAvailable, …
        raise _no_broker(bootstrap, exc, timeout_s) from None
    except ValueError as exc:  # a malformed address, e.g. "host:port"
        raise KafkaSetupError(f"bad Kafka bootstrap address {conn.bootstrap!r}: {exc}") from None


def _partition_counts(admin, names) -> dict[str, int]:
    """name -> partition count for the topics of `names` that exist (missing ones are left out)."""
    import kafka.errors as Errors

    counts = {}
    for t in admin.describe_topics(list(names)):
        code = t.get("error_code", 0)
        if code == _UNKNOWN_TOPIC:
            continue
        if code != 0:
            raise KafkaSetupError(f"cannot describe topic {t.get('name')}: {Errors.for_code(code).__name__}")
        counts[t["name"]] = len(t.get("partitions") or [])
    return counts


def describe_partitions(bootstrap: "str | KafkaConnection", topics=ALL_TOPICS, timeout_s: float = 30) -> dict[str, int]:
    """Partition count of each existing topic among `topics` (missing topics are absent from the result)."""
    from kafka.errors import KafkaError

    admin = admin_client(bootstrap, timeout_s)
    try:
        return _partition_counts(admin, topics)
    except KafkaError as exc:
        raise KafkaSetupError(f"describing topics at {bootstrap} failed: {describe_error(exc)}") from None
    finally:
        admin.close()


def _check_inputs(counts: dict[str, int], partitions: int) -> None:
    wrong = {n: counts[n] for n in COPARTITIONED if n in counts and counts[n] != partitions}
    if wrong:
        have = ", ".join(f"{n} has {c}" for n, c in wrong.items())
        raise TopicMismatchError(
            f"input topic partition count mismatch: {have}, asked for {partitions}. All input topics "
            f"({', '.join(INPUT_TOPICS)}) must have the same number of partitions so that a pool's events are "
            "co-partitioned; run again with --partitions matching the existing topics, or recreate them"
        )


def _adopt_append_time(admin, names: list[str]) -> list[str]:
    """Existing input topics that still keep producer times get message.timestamp.type=LogAppendTime (an
    incremental change: their other configs stay). Returns those changed."""
    from kafka.admin import ConfigResource, ConfigResourceType

    if not names:
        return []
    described = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names])
    topics = described.get("topic", {}) if isinstance(described, dict) else {}
    todo = [n for n in names if (topics.get(n, {}).get("message.timestamp.type") or {}).get("value") != "LogAppendTime"]
    if todo:
        result = admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, n, configs=dict(INPUT_CONFIGS))
                                      for n in todo])
        failed = {n: r for n, r in (result.get("topic") or {}).items() if r != "OK"}
        if failed:
            raise KafkaSetupError(f"cannot make the input topics keep the broker's append time: {failed}")
        log.warning("input topics %s now keep the broker's append time (LogAppendTime)", ", ".join(todo))
    return todo


def create_topics(bootstrap: "str | KafkaConnection", partitions: int = 3, replication: int = 1, timeout_s: float = 30) -> dict[str, str]:
    """Create the input and output topics that are missing; return {topic: "created" | "exists"}.

    Idempotent: topics that already exist are reported as "exists" and left alone, except that an existing input
    topic whose partition count differs from `partitions` is an error (`TopicMismatchError`), raised before
    anything is created. Raises `KafkaSetupError` when no broker answers at `bootstrap` within `timeout_s`, or
    when the broker refuses a creation (e.g. a replication factor above the number of brokers).
    """
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions must be a positive integer, got {partitions!r}")
    if isinstance(replication, bool) or not isinstance(replication, int) or replication < 1:
        raise ValueError(f"replication must be a positive integer, got {replication!r}")
    import kafka.errors as Errors

    ms = max(1, int(timeout_s * 1000))
    admin = admin_client(bootstrap, timeout_s)
    try:
        existing = _partition_counts(admin, ALL_TOPICS)
        _check_inputs(existing, partitions)
        result = {name: "exists" for name in existing}
        missing = [name for name in ALL_TOPICS if name not in existing]
        if missing:
            spec = {name: {"num_partitions": partitions, "replication_factor": replication,
                           **({"configs": TOPIC_CONFIGS[name]} if name in TOPIC_CONFIGS else {})} for name in missing}
            response = admin.create_topics(spec, timeout_ms=ms, raise_errors=False)
            problems: dict[str, list[str]] = {}  # one line per distinct reason, naming its topics
            created, raced = [], []
            for t in response["topics"]:
                code = t.get("error_code", 0)
                if code == 0:
                    created.append(t["name"])
                elif code == _TOPIC_EXISTS:  # created by someone else meanwhile
                    raced.append(t["name"])
                else:
                    name = Errors.for_code(code).__name__
                    why = f"{name}: {t['error_message']}" if t.get("error_message") else name
                    problems.setdefault(why, []).append(t["name"])
            if problems:
                text = "; ".join(f"{', '.join(names)}: {why}" for why, names in problems.items())
                raise KafkaSetupError(f"Kafka at {bootstrap} refused to create topics: {text}")
            if created:
                admin.wait_for_topics(created, timeout_ms=ms)  # leaders elected: producers can send at once
            if raced:
                _check_inputs(_partition_counts(admin, raced), partitions)
            result.update({n: "created" for n in created})
            result.update({n: "exists" for n in raced})
        for name in _adopt_append_time(admin, [n for n in INPUT_TOPICS if result.get(n) == "exists"]):
            result[name] = "exists, now LogAppendTime"
        log.info("topics at %s: %s", bootstrap, result)
        return {name: result[name] for name in ALL_TOPICS}
    except Errors.KafkaError as exc:
        raise KafkaSetupError(f"creating topics at {bootstrap} failed: {describe_error(exc)}") from None
    finally:
        admin.close()


def ensure_changelogs(bootstrap: "str | KafkaConnection", app_id: str, tables, partitions: int,
                      timeout_s: float = 30) -> bool:
    """Create the worker's table changelog topics (`<app id>-<table>-changelog`: compacted, one partition per input
    partition, as Faust declares them) when missing, and wait until their leaders are elected; True when they are.

    Faust creates them itself at its start, then checks a table's partitions against its consumer's metadata at the
    first write: when that metadata lists the new topic before its partitions, the check reads 0 partitions, raises
    PartitionsMismatch ("…changelog has 0 partitions") and the worker stops on a perfectly clean start (seen in CI,
    once a minute apart in two tests). Created here first, the topics are whole before Faust's first metadata request.
    Any error leaves it to Faust (its own error then says what is wrong)."""
    import kafka.errors as Errors

    names = [f"{app_id}-{t}-changelog" for t in tables]
    ms = max(1, int(timeout_s * 1000))
    try:
        admin = admin_client(bootstrap, timeout_s)
    except KafkaSetupError:
        return False
    try:
        missing = [n for n in names if n not in _partition_counts(admin, names)]
        if missing:
            spec = {n: {"num_partitions": partitions, "replication_factor": 1,
                        "configs": {"cleanup.policy": "compact"}} for n in missing}
            response = admin.create_topics(spec, timeout_ms=ms, raise_errors=False)
            if any(t.get("error_code", 0) not in (0, _TOPIC_EXISTS) for t in response["topics"]):
                return False
        admin.wait_for_topics(names, timeout_ms=ms)
        return True
    except (Errors.KafkaError, KafkaSetupError):
        return False
    finally:
        admin.close()


def wait_group_coordinator(bootstrap: "str | KafkaConnection", group: str, timeout_s: float = 30) -> bool:
    """Wait until the broker has a coordinator for consumer group `group`; True when it has one.

    A new broker creates its offsets topic (`__consumer_offsets`) only at the first FindCoordinator request
    and answers COORDINATOR_NOT_AVAILABLE (then NOT_COORDINATOR, COORDINATOR_LOAD_IN_PROGRESS) until that topic is led.
    A worker that starts then gets an aiokafka ERROR "Group Coordinator Request failed" and a WARNING
    "Marking the coordinator dead" on a perfectly clean start (issue 35 item 12). Asking here first, with
    kafka-python's admin client that does not log it, makes the broker ready before Faust's consumers ask.
    Any other answer (authorization, …) stops the wait: Faust's own errors then say what is wrong."""
    import kafka.errors as Errors

    deadline = time.monotonic() + timeout_s
    try:
        admin = admin_client(bootstrap, timeout_s)
    except KafkaSetupError:
        return False
    try:
        while True:
            try:
                # OffsetFetch after FindCoordinator: unlike DescribeGroups it decodes no member metadata, so a second
                # worker joining a running group gets no kafka-python "Unable to decode member_metadata" WARNING
                admin.list_group_offsets(group)
                return True
            except (Errors.CoordinatorNotAvailableError, Errors.CoordinatorLoadInProgressError,
                    Errors.NotCoordinatorError):  # the offsets partition is still being loaded
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)
            except Errors.KafkaError:
                return False
    finally:
        admin.close()
