"""The producer SDK: validate an event against the wire contract, then publish it keyed by pool.

    with LedgerProducer("127.0.0.1:9092") as p:
        p.send({"event_id": "e-1", "type": "pool.tick", ...})   # model, dict, JSON str or bytes
        # -> kafka future resolving to RecordMetadata
        # a training loop reports its cumulative progress (the throughput SLO, docs/events.md "Progress counts"):
        p.send({"event_id": f"{job}:progress:{step}", "type": "job.progress", "job_id": job, "units": step,
                "unit": "step", ...})

Guarantees:
- nothing invalid reaches Kafka: every event is validated with `schemas.parse_event` / `parse_payload` first,
  and an invalid one raises `InvalidEvent` (its Rejection code and detail) without being handed to Kafka;
- the message key is the pool (`schemas.key_for`), the topic is `schemas.topic_for(type)`;
- the value is the canonical JSON of the validated model (`model_dump_json(exclude_none=True)`): sending the
  same event twice, in any input form, gives byte-identical messages (so dedup by body works downstream);
- acks=all with an idempotent producer (no duplicates or reordering on retries within a partition);
- topics are never auto-created (they need equal partition counts: `chipledger topics create`);
- every record carries the headers `chipledger-producer` (an id per LedgerProducer instance),
  `chipledger-seq` (a counter per instance, 1, 2, … in send order) and `chipledger-prev` (the seq of this
  instance's previous record of the same pool, 0 for its first): the worker's sequencer releases a record
  into `chipledger.log` once its predecessor is there, so for one producer the fold order is its send order
  whatever the timing (see docs/streaming.md and streams/sequencer.py). The record timestamp is the send time
  (never before the previous record's); it never changes the order (the input topics replace it with the
  broker's append time: `message.timestamp.type=LogAppendTime`);
- with a signing key (`KafkaConnection.signing_key`: `[kafka] signing_key_file`, or `<user>.key` beside the
  password file) every record is signed: headers `chipledger-principal` (the user) and `chipledger-sig`
  (streams/principals.py). A worker with a principals registry dead-letters unsigned records (`bad_signature`).

Transport failures raise `KafkaSetupError` (no broker, topic missing) or resolve the returned future with the
error (delivery failed after retries).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from pydantic import BaseModel

from schemas import Rejection, RejectionCode, key_for, parse_event, parse_payload, topic_for
from streams.clients import KafkaConnection, as_connection
from streams.topics import KafkaSetupError, describe_error

__all__ = [
    "InvalidEvent",
    "KafkaSetupError",
    "LedgerProducer",
    "EmitReport",
    "producer_config",
    "validate",
    "canonical_value",
    "emit_lines",
]

#: Defaults for kafka-python's KafkaProducer; any may be overridden except the delivery guarantees below.
DEFAULTS: dict[str, Any] = {
    "acks": "all",
    "enable_idempotence": True,
    "retries": 2**31 - 1,  # as Java's producer: retry until delivery_timeout_ms
    "max_in_flight_requests_per_connection": 5,  # the most idempotence keeps in order
    "linger_ms": 5,
    "delivery_timeout_ms": 120_000,
    "bootstrap_timeout_ms": 10_000,  # connecting to the cluster in __init__
    "max_block_ms": 10_000,  # waiting for a topic's metadata in send()
    "allow_auto_create_topics": False,
    "client_id": "chipledger-producer",
}
_GUARANTEES = {"acks": ("all", -1), "enable_idempotence": (True,)}
_FORBIDDEN = ("key_serializer", "value_serializer", "partitioner", "bootstrap_servers")

from streams.sequencer import HEADER_PRODUCER, HEADER_PREV, HEADER_SEQ  # noqa: E402 - stamped on every record
from streams.principals import HEADER_PRINCIPAL, HEADER_SIG, sign  # noqa: E402 - signed when there is a key


class InvalidEvent(ValueError):
    """The event does not satisfy the wire contract; it was not sent."""

    def __init__(self, rejection: Rejection):
        self.rejection = rejection
        self.code: RejectionCode = rejection.code
        self.detail: str = rejection.detail
        super().__init__(f"{rejection.code.value}: {rejection.detail}")


def validate(event_or_raw: Any):
    """An event model from a model, a decoded dict, or JSON text/bytes; raises `InvalidEvent` otherwise.

    Models are re-validated too (one may come from `model_construct`, or be a decision, not an input event)."""
    if isinstance(event_or_raw, (bytes, bytearray, memoryview, str)):
        parsed = parse_event(bytes(event_or_raw) if not isinstance(event_or_raw, str) else event_or_raw)
    elif isinstance(event_or_raw, BaseModel):
        try:
            payload = event_or_raw.model_dump(mode="json", exclude_none=True, warnings=False)
        except Exception as exc:  # noqa: BLE001 - an unserializable constructed model
            parsed = Rejection(RejectionCode.schema_invalid, f"cannot serialize {type(event_or_raw).__name__}: {exc}")
        else:
            parsed = parse_payload(payload)
    else:
        parsed = parse_payload(event_or_raw)
    if isinstance(parsed, Rejection):
        raise InvalidEvent(parsed)
    return parsed


def canonical_value(event) -> bytes:
    """The message value of a validated event: compact JSON without null optionals, fields in model order."""
    return event.model_dump_json(exclude_none=True).encode("utf-8")


def producer_config(bootstrap: "str | KafkaConnection", **overrides) -> dict[str, Any]:
    """The KafkaProducer keyword arguments LedgerProducer uses (address and security from `bootstrap`, a
    KafkaConnection or a PLAINTEXT address). Refuses overrides that would weaken delivery (acks, idempotence)
    or change what is sent (serializers, partitioner)."""
    for name in _FORBIDDEN:
        if name in overrides:
            raise ValueError(f"{name} cannot be overridden: LedgerProducer sets it")
    for name, allowed in _GUARANTEES.items():
        if name in overrides and overrides[name] not in allowed:
            raise ValueError(f"{name}={overrides[name]!r} would weaken delivery; LedgerProducer needs {allowed[0]!r}")
    return {**DEFAULTS, **overrides, **as_connection(bootstrap).kafka_python()}


class LedgerProducer:
    """Validating, pool-keyed, idempotent producer of chipledger input events.

    `bootstrap` is a `streams.clients.KafkaConnection` (address, SASL/SCRAM, TLS) or a PLAINTEXT address.
    `client` replaces the KafkaProducer (any object with `send(topic, value=, key=)`, `flush(timeout)`,
    `close(timeout)`); it exists for tests and embedding, and `bootstrap`/`overrides` are then unused.
    """

    def __init__(self, bootstrap: "str | KafkaConnection", *, client=None, **overrides):
        self.connection = as_connection(bootstrap)
        self.bootstrap = self.connection.bootstrap
        self.producer_id = uuid.uuid4().hex[:16]
        self._id_header = self.producer_id.encode("ascii")
        self._seq = 0
        self._prev: dict[bytes, int] = {}  # pool key -> seq of this producer's last record of that pool
        self._last_ms = 0
        self._order = threading.Lock()  # seq, timestamp and hand-over to Kafka in one step: send order = seq order
        self._signer = self.connection.signer()
        if client is not None:
            self._producer = client
            return
        from kafka import KafkaProducer
        from kafka.errors import KafkaError

        config = producer_config(self.connection, **overrides)
        try:
            self._producer = KafkaProducer(**config)
        except KafkaError as exc:  # KafkaTimeoutError "Unable to bootstrap", NoBrokersAvailable
            secs = config["bootstrap_timeout_ms"] / 1000
            raise KafkaSetupError(
                f"no Kafka broker answered at {self.connection.describe()} within {secs:g}s ({describe_error(exc)}); "
                "start one (`chipledger kafka up`) or pass --bootstrap HOST:PORT / set CHIPLEDGER_KAFKA_BOOTSTRAP"
            ) from None
        except ValueError as exc:
            raise KafkaSetupError(f"bad Kafka bootstrap address {self.bootstrap!r}: {exc}") from None

    def send(self, event_or_raw):
        """Validate, then publish to the event's topic keyed by its pool. Returns the kafka future.

        Raises `InvalidEvent` (nothing sent) for an event that breaks the contract, `KafkaSetupError` when the
        topic's metadata cannot be fetched (usually: the topic does not exist)."""
        event = validate(event_or_raw)
        topic = topic_for(event.type)
        if self._producer is None:
            raise RuntimeError("LedgerProducer is closed")
        from kafka.errors import KafkaTimeoutError

        value, key = canonical_value(event), key_for(event)
        try:
            with self._order:
                self._seq += 1
                # the send time, never before the previous record's (the wall clock may step back)
                self._last_ms = max(self._last_ms, int(time.time() * 1000))
                prev = self._prev.get(key, 0)
                headers = [(HEADER_PRODUCER, self._id_header), (HEADER_SEQ, str(self._seq).encode("ascii")),
                           (HEADER_PREV, str(prev).encode("ascii"))]
                if self._signer is not None:
                    who, signing_key = self._signer
                    headers += [(HEADER_PRINCIPAL, who.encode("utf-8")),
                                (HEADER_SIG, sign(signing_key, key, value, headers))]
                future = self._producer.send(topic, value=value, key=key, headers=headers,
                                             timestamp_ms=self._last_ms)
                self._prev[key] = self._seq
                return future
        except KafkaTimeoutError as exc:
            raise KafkaSetupError(
                f"cannot publish to {topic} at {self.bootstrap}: {exc} (does the topic exist? "
                "create the topics with `chipledger topics create`)"
            ) from None

    def flush(self, timeout: Optional[float] = None) -> None:
        """Block until every sent record is acknowledged or failed (`timeout` in seconds; `KafkaSetupError`
        when records are still pending then)."""
        if self._producer is None:
            return
        from kafka.errors import KafkaTimeoutError

        try:
            self._producer.flush(timeout)
        except KafkaTimeoutError as exc:
            raise KafkaSetupError(f"records to {self.bootstrap} still unacknowledged after {timeout}s: {exc}") from None

    def close(self, timeout: Optional[float] = None) -> None:
        """Flush and close the connection (idempotent)."""
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.close(timeout)

    def __enter__(self) -> "LedgerProducer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class EmitReport:
    """What `emit_lines` did: lines sent, invalid lines (line number, code, detail), delivery failures."""

    sent: int = 0
    invalid: list[tuple[int, str, str]] = field(default_factory=list)
    failed: int = 0
    first_failure: Optional[str] = None
    blank: int = 0


def emit_lines(producer: LedgerProducer, lines: Iterable[bytes | str], flush_timeout: Optional[float] = None,
               on_invalid=None) -> EmitReport:
    """Send each JSONL line through `producer`; skip blank lines; collect invalid ones (1-based line numbers)
    and, after a final flush, delivery failures. `on_invalid(lineno, code, detail)` is called as they occur.
    Raises `KafkaSetupError` as `LedgerProducer.send` does (the rest of the input is then not sent)."""
    report = EmitReport()
    lock = threading.Lock()
    acked = [0]

    def ok(_meta):
        with lock:
            acked[0] += 1

    def failed(exc):
        with lock:
            report.failed += 1
            if report.first_failure is None:
                report.first_failure = describe_error(exc)

    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            report.blank += 1
            continue
        try:
            future = producer.send(line)
        except InvalidEvent as exc:
            report.invalid.append((lineno, exc.code.value, exc.detail))
            if on_invalid is not None:
                on_invalid(lineno, exc.code.value, exc.detail)
            continue
        except KafkaSetupError as exc:
            raise KafkaSetupError(f"line {lineno}: {exc}") from None
        add_callback = getattr(future, "add_callback", None)
        if add_callback is not None:
            future.add_callback(ok)
            future.add_errback(failed)
        else:
            ok(None)
    producer.flush(flush_timeout)
    with lock:
        report.sent = acked[0]
    return report
