"""The producer SDK without a broker: validation before sending, routing, keys, canonical values, `emit`.

A fake stands in for kafka-python's KafkaProducer here (and only here): it records what would have been sent,
so these tests can prove that invalid events never reach it. tests/integration/test_producer.py runs the
same paths against a real broker.
"""

from __future__ import annotations

import json
import socket
import time
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from chipledger.cli import app
from schemas import (
    TOPIC_CHIPS,
    TOPIC_JOBS,
    TOPIC_QUOTA,
    DecisionBurst,
    JobSubmitted,
    PoolTick,
    QuotaGranted,
    Rejection,
    RejectionCode,
    parse_event,
)
from streams import producer as producer_mod
from streams.producer import (
    InvalidEvent,
    KafkaSetupError,
    LedgerProducer,
    canonical_value,
    emit_lines,
    producer_config,
    validate,
)
from streams.topics import create_topics
from streams.clients import as_connection

FIXTURE = Path(__file__).parent / "fixtures" / "hand.jsonl"
INVALID_LINES = {13: "not_json", 14: "unknown_type", 15: "schema_invalid"}  # 1-based line numbers in FIXTURE

ENV = {"occurred_at": "2026-11-02T00:00:00Z", "pool": "lab/a100", "source": "lab/kueue"}


class FakeFuture:
    def __init__(self, error: Exception | None = None):
        self.error = error

    def add_callback(self, fn, *args):
        if self.error is None:
            fn(*args, "metadata")
        return self

    def add_errback(self, fn, *args):
        if self.error is not None:
            fn(*args, self.error)
        return self


class FakeKafka:
    """Stands in for KafkaProducer: records (topic, key, value) of every send."""

    def __init__(self, error: Exception | None = None, send_raises: Exception | None = None):
        self.sent: list[tuple[str, bytes, bytes]] = []
        self.headers: list[tuple[dict, int]] = []  # (headers, timestamp_ms) of every send
        self.flushes = 0
        self.closed = 0
        self.error = error
        self.send_raises = send_raises

    def send(self, topic, value=None, key=None, headers=None, timestamp_ms=None):
        if self.send_raises is not None:
            raise self.send_raises
        assert isinstance(value, bytes) and isinstance(key, bytes)
        self.sent.append((topic, key, value))
        self.headers.append((dict(headers or ()), timestamp_ms))
        return FakeFuture(self.error)

    def flush(self, timeout=None):
        self.flushes += 1

    def close(self, timeout=None):
        self.closed += 1


def _lines() -> list[bytes]:
    return FIXTURE.read_bytes().splitlines()


def _valid_lines() -> list[tuple[int, bytes]]:
    return [(i, line) for i, line in enumerate(_lines(), 1) if i not in INVALID_LINES]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fixture_has_the_expected_invalid_lines():
    lines = _lines()
    assert len(lines) == 27
    for i, line in enumerate(lines, 1):
        parsed = parse_event(line)
        if i in INVALID_LINES:
            assert isinstance(parsed, Rejection) and parsed.code.value == INVALID_LINES[i], (i, parsed)
        else:
            assert not isinstance(parsed, Rejection), (i, parsed)


def test_valid_events_are_keyed_by_pool_routed_by_type_and_canonical():
    fake = FakeKafka()
    producer = LedgerProducer("unused:9092", client=fake)
    valid = _valid_lines()
    for _, line in valid:
        assert isinstance(producer.send(line), FakeFuture)
    assert len(fake.sent) == len(valid) == 24
    prefix_topic = {"pool": TOPIC_QUOTA, "quota": TOPIC_QUOTA, "burst": TOPIC_QUOTA, "job": TOPIC_JOBS,
                    "chip": TOPIC_CHIPS}
    for (_, line), (topic, key, value) in zip(valid, fake.sent):
        event = parse_event(line)
        assert topic == prefix_topic[event.type.split(".")[0]]
        assert key == event.pool.encode()
        assert value == event.model_dump_json(exclude_none=True).encode()
        assert parse_event(value) == event
    assert {k for _, k, _ in fake.sent} == {b"lab/a100", b"nowhere/h100"}


BAD_INPUTS = [
    (b'{"event_id": "x", "type": "job.started", ', RejectionCode.not_json),
    (b"\xff\xfe not utf-8", RejectionCode.not_json),
    ("[1, 2]", RejectionCode.not_json),
    ([{"type": "pool.tick"}], RejectionCode.not_json),
    (None, RejectionCode.not_json),
    ({**ENV, "event_id": "x", "type": "job.exploded"}, RejectionCode.unknown_type),
    ({**ENV, "event_id": "x"}, RejectionCode.unknown_type),
    ({**ENV, "event_id": "x", "type": "pool.tick", "occurred_at": "2026-11-02T00:00:00"},
     RejectionCode.schema_invalid),
    ({**ENV, "event_id": "x", "type": "pool.tick", "occurred_at": 1700000000}, RejectionCode.schema_invalid),
    ({**ENV, "event_id": "x", "type": "pool.tick", "extra": 1}, RejectionCode.schema_invalid),
    ({**ENV, "event_id": "", "type": "pool.tick"}, RejectionCode.schema_invalid),
    ({**ENV, "event_id": "x", "type": "pool.tick", "schema_version": 2}, RejectionCode.schema_invalid),
    ({**ENV, "event_id": "x", "type": "quota.granted", "grant_id": "g", "team": "a", "chips": -1},
     RejectionCode.schema_invalid),
    ({**ENV, "event_id": "x", "type": "quota.granted", "grant_id": "g", "team": "a", "chips": 0.0001},
     RejectionCode.schema_invalid),
    ({"event_id": "x", "type": "pool.tick", "occurred_at": ENV["occurred_at"], "source": "s"},
     RejectionCode.schema_invalid),
    ({**ENV, "event_id": "x", "type": "job.progress", "job_id": "j", "units": -5, "unit": "step"},
     RejectionCode.schema_invalid),
    ({**ENV, "event_id": "x", "type": "job.progress", "job_id": "j", "units": 5}, RejectionCode.schema_invalid),
    ({**ENV, "event_id": "x", "type": "job.checkpointed", "job_id": "j", "units": 0.5}, RejectionCode.schema_invalid),
]


def test_progress_is_sent_to_the_jobs_topic_keyed_by_pool():
    fake = FakeKafka()
    producer = LedgerProducer("unused:9092", client=fake)
    producer.send({**ENV, "event_id": "p-1", "type": "job.progress", "job_id": "j", "units": 12_000, "unit": "step"})
    producer.send({**ENV, "event_id": "c-1", "type": "job.checkpointed", "job_id": "j", "units": 12_500})
    (t1, k1, v1), (t2, k2, v2) = fake.sent
    assert (t1, k1, t2, k2) == (TOPIC_JOBS, b"lab/a100", TOPIC_JOBS, b"lab/a100")
    assert json.loads(v1)["units"] == 12_000 and json.loads(v1)["unit"] == "step"
    assert json.loads(v2)["units"] == 12_500


@pytest.mark.parametrize("bad,code", BAD_INPUTS, ids=[f"{c.value}-{i}" for i, (_, c) in enumerate(BAD_INPUTS)])
def test_invalid_events_raise_and_are_never_sent(bad, code):
    fake = FakeKafka()
    producer = LedgerProducer("unused:9092", client=fake)
    with pytest.raises(InvalidEvent) as info:
        producer.send(bad)
    assert isinstance(info.value, ValueError)
    assert info.value.code == code and info.value.rejection.code == code
    assert info.value.detail and code.value in str(info.value)
    assert fake.sent == []


def test_models_are_revalidated_before_sending():
    fake = FakeKafka()
    producer = LedgerProducer("unused:9092", client=fake)
    # model_construct skips validation: the SDK must still refuse it
    forged = PoolTick.model_construct(event_id="x", type="pool.tick", occurred_at="not a time", pool="p",
                                      source="s", schema_version=1)
    with pytest.raises(InvalidEvent) as info:
        producer.send(forged)
    assert info.value.code == RejectionCode.schema_invalid
    # an output model is not an input event
    decision = DecisionBurst(decision_id="d", pool="p", at=ENV["occurred_at"], request_id="r", team="a",
                             verdict="denied", chips_granted=0, window_start="2026-11-02T01:00:00Z",
                             window_end="2026-11-02T02:00:00Z", rule="budget", numbers={}, message="no")
    with pytest.raises(InvalidEvent) as info:
        producer.send(decision)
    assert info.value.code == RejectionCode.unknown_type
    assert fake.sent == []


def test_every_input_form_gives_byte_identical_messages():
    raw = {**ENV, "event_id": "j-1", "type": "job.submitted", "job_id": "j", "team": "a", "chips": 1.5,
           "priority": 3, "chips_per_node": None}
    model = JobSubmitted.model_validate(raw)
    text = json.dumps(dict(reversed(list(raw.items()))), indent=2)  # other key order, whitespace, explicit null
    forms = [model, raw, text, text.encode(), bytearray(text.encode()), json.dumps(raw)]
    fake = FakeKafka()
    producer = LedgerProducer("unused:9092", client=fake)
    for form in forms:
        producer.send(form)
    assert len({m for m in fake.sent}) == 1
    topic, key, value = fake.sent[0]
    assert (topic, key) == (TOPIC_JOBS, b"lab/a100")
    assert b"null" not in value and b'"chips":1.5' in value and b'"preemptible":true' in value
    assert parse_event(value) == model


CANONICAL_CASES = [
    {**ENV, "event_id": "q-1", "type": "quota.granted", "grant_id": "g", "team": "a", "chips": 0.125,
     "borrowing_limit": 0, "lending_limit": 2.5, "effective_from": "2026-11-02T05:30:00+05:30",
     "effective_until": "2026-12-01T00:00:00.123456-08:00"},
    {**ENV, "event_id": "q-2", "type": "quota.granted", "grant_id": "g", "team": "a", "chips": 999999.999},  # the largest amount (MAX_CHIPS)
    {**ENV, "event_id": "b-1", "type": "burst.requested", "request_id": "r", "team": "a", "chips": 8,
     "window_start": "2026-11-02T10:00:00Z", "window_end": "2026-11-02T12:00:00Z", "reason": "ünïcödé ✓"},
    {**ENV, "event_id": "s-1", "type": "job.started", "job_id": "j", "chip_ids": ["c0", "c1"]},
    {**ENV, "event_id": "c-1", "type": "chip.state_changed", "chip_id": "c0", "state": "down", "reason": None},
    {**ENV, "event_id": "p-1", "type": "job.preempted", "job_id": "j", "decision_id": "d-1"},
]


@pytest.mark.parametrize("raw", CANONICAL_CASES + [json.loads(line) for _, line in _valid_lines()],
                         ids=lambda raw: raw["event_id"])
def test_canonical_value_reparses_to_an_equal_model(raw):
    event = validate(raw)
    value = canonical_value(event)
    again = parse_event(value)
    assert again == event
    assert canonical_value(again) == value  # a fixed point: re-sending a consumed event is byte-identical
    assert b"null" not in value


@settings(max_examples=150, deadline=None)
@given(
    milli=st.integers(min_value=1, max_value=10**9),  # up to MAX_CHIPS
    ts=st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2099, 12, 31),  # below MAX_TIME
                    timezones=st.sampled_from([timezone.utc, timezone(timedelta(hours=5, minutes=30)),
                                               timezone(timedelta(hours=-8))])),
    # ids hold no control characters; lone surrogates (Cs) are not text JSON can carry (orjson refuses them)
    text=st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=20),
)
def test_canonical_value_roundtrip_property(milli, ts, text):
    event = QuotaGranted(event_id="e" + text[:100], type="quota.granted", occurred_at=ts, pool="p" + text,
                         source="s", grant_id="g", team=text or "t", chips=Decimal(milli) / 1000)
    value = canonical_value(event)
    assert parse_event(value) == event
    assert canonical_value(validate(value)) == value


def test_emit_lines_sends_valid_lines_and_reports_invalid_ones_by_line_number():
    lines = _lines()
    lines.insert(3, b"")  # blank lines are skipped but still counted as lines
    lines.insert(7, b"   \r")
    fake = FakeKafka()
    seen = []
    report = emit_lines(LedgerProducer("unused:9092", client=fake), lines,
                        on_invalid=lambda n, code, detail: seen.append((n, code)))
    shifted = {n + (n >= 4) + (n >= 7): code for n, code in INVALID_LINES.items()}
    assert [(n, code) for n, code, _ in report.invalid] == sorted(shifted.items()) == seen
    assert report.sent == 24 and len(fake.sent) == 24 and report.blank == 2 and report.failed == 0
    assert fake.flushes == 1


def test_emit_lines_counts_delivery_failures():
    report = emit_lines(LedgerProducer("unused:9092", client=FakeKafka(error=RuntimeError("broker gone"))),
                        [line for _, line in _valid_lines()])
    assert report.sent == 0 and report.failed == 24 and "broker gone" in report.first_failure


def test_send_metadata_timeout_is_a_setup_error():
    from kafka.errors import KafkaTimeoutError

    fake = FakeKafka(send_raises=KafkaTimeoutError("Failed to update metadata after 3.0 secs."))
    with pytest.raises(KafkaSetupError, match="topics create"):
        LedgerProducer("h:1", client=fake).send(_valid_lines()[0][1])
    with pytest.raises(KafkaSetupError, match="line 1:"):
        emit_lines(LedgerProducer("h:1", client=fake), [_valid_lines()[0][1]])


def test_context_manager_closes_once():
    fake = FakeKafka()
    with LedgerProducer("unused:9092", client=fake) as producer:
        producer.send(_valid_lines()[0][1])
        producer.flush()
    assert fake.closed == 1 and fake.flushes == 1
    producer.close()
    assert fake.closed == 1


def test_producer_config_keeps_delivery_guarantees():
    cfg = producer_config("h:9092", linger_ms=20, client_id="me")
    assert cfg["acks"] == "all" and cfg["enable_idempotence"] is True
    assert cfg["retries"] > 0 and cfg["linger_ms"] == 20 and cfg["client_id"] == "me"
    assert cfg["allow_auto_create_topics"] is False and cfg["bootstrap_servers"] == "h:9092"
    assert cfg["max_in_flight_requests_per_connection"] <= 5
    assert producer_config("h:9092", acks=-1)["acks"] == -1
    for bad in ({"acks": 1}, {"acks": 0}, {"enable_idempotence": False}, {"value_serializer": str.encode},
                {"key_serializer": str.encode}, {"bootstrap_servers": "x:1"}):
        with pytest.raises(ValueError):
            producer_config("h:9092", **bad)


def test_producer_without_broker_is_a_quick_setup_error():
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(KafkaSetupError, match=f"no Kafka broker answered at 127.0.0.1:{port}"):
        LedgerProducer(f"127.0.0.1:{port}", bootstrap_timeout_ms=1000)
    with pytest.raises(KafkaSetupError, match=f"no Kafka broker answered at 127.0.0.1:{port}"):
        create_topics(f"127.0.0.1:{port}", timeout_s=1)
    assert time.monotonic() - t0 < 10


def test_create_topics_checks_arguments_before_connecting():
    for bad in ({"partitions": 0}, {"partitions": True}, {"replication": 0}, {"partitions": "3"}):
        with pytest.raises(ValueError):
            create_topics("127.0.0.1:1", timeout_s=0.1, **bad)


# ---------------------------------------------------------------------------------------- CLI (with the fake)


@pytest.fixture
def fake_cli(monkeypatch):
    """`chipledger emit` with the fake standing in for KafkaProducer."""
    state = {"fake": FakeKafka(), "bootstrap": None}

    class Patched(LedgerProducer):
        def __init__(self, bootstrap, **overrides):
            state["bootstrap"], state["overrides"] = as_connection(bootstrap).bootstrap, overrides
            state["connection"] = bootstrap
            super().__init__(bootstrap, client=state["fake"])

    monkeypatch.setattr(producer_mod, "LedgerProducer", Patched)
    monkeypatch.delenv("CHIPLEDGER_KAFKA_BOOTSTRAP", raising=False)
    return state


def test_cli_emit_reports_invalid_lines_and_exits_1(fake_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no chipledger.toml here
    res = CliRunner().invoke(app, ["emit", "--bootstrap", "h:1", str(FIXTURE)])
    assert res.exit_code == 1, res.output
    assert res.stdout.strip().splitlines()[-1] == "sent 24, invalid 3"
    for n, code in INVALID_LINES.items():
        assert f"line {n}: {code}:" in res.stderr
    assert len(fake_cli["fake"].sent) == 24 and fake_cli["fake"].closed == 1
    assert fake_cli["bootstrap"] == "h:1"


def test_cli_emit_from_stdin_all_valid_exits_0_and_reads_config(fake_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "k.toml").write_text('[kafka]\nbootstrap = "from-config:9092"\n')
    lines = b"\n".join(line for _, line in _valid_lines()[:5]) + b"\n\n\n"
    res = CliRunner().invoke(app, ["emit", "--config", "k.toml", "--timeout", "2"], input=lines)
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == "sent 5, invalid 0" and res.stderr == ""
    assert fake_cli["bootstrap"] == "from-config:9092"
    assert fake_cli["overrides"] == {"bootstrap_timeout_ms": 2000, "max_block_ms": 2000}
    monkeypatch.setenv("CHIPLEDGER_KAFKA_BOOTSTRAP", "from-env:9092")
    res = CliRunner().invoke(app, ["emit", "-"], input=lines)
    assert res.exit_code == 0 and fake_cli["bootstrap"] == "from-env:9092"


def test_cli_emit_delivery_failure_exits_2(fake_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake_cli["fake"] = FakeKafka(error=RuntimeError("NotEnoughReplicas"))
    res = CliRunner().invoke(app, ["emit", "--bootstrap", "h:1", str(FIXTURE)])
    assert res.exit_code == 2
    assert "could not be delivered" in res.stderr and "NotEnoughReplicas" in res.stderr


def test_cli_emit_missing_file_exits_2(fake_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["emit", "--bootstrap", "h:1", "nope.jsonl"])
    assert res.exit_code == 2 and "does not exist" in res.stderr


def test_every_record_carries_producer_id_seq_and_a_monotonic_timestamp(monkeypatch):
    import streams.producer as sp

    clock = iter([5.000, 5.002, 4.990, 5.010])  # the wall clock steps back once
    monkeypatch.setattr(sp.time, "time", lambda: next(clock))
    fake = FakeKafka()
    a, b = LedgerProducer("unused:1", client=fake), LedgerProducer("unused:1", client=FakeKafka())
    assert a.producer_id != b.producer_id and len(a.producer_id) == 16
    for i in range(4):
        a.send({**ENV, "event_id": f"t{i}", "type": "pool.tick"})
    assert [h["chipledger-seq"] for h, _ in fake.headers] == [b"1", b"2", b"3", b"4"]
    assert {h["chipledger-producer"] for h, _ in fake.headers} == {a.producer_id.encode()}
    assert [ts for _, ts in fake.headers] == [5000, 5002, 5002, 5010]
    with pytest.raises(InvalidEvent):
        a.send({**ENV, "event_id": "bad", "type": "pool.tick", "chips": 1})
    assert len(fake.headers) == 4  # an invalid event takes no seq


def test_cli_emit_takes_the_credentials_from_the_environment(fake_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pw = tmp_path / "pw"
    pw.write_text("hunter2-secret\n")
    monkeypatch.setenv("CHIPLEDGER_KAFKA_USERNAME", "cluster-a")
    monkeypatch.setenv("CHIPLEDGER_KAFKA_PASSWORD_FILE", str(pw))
    res = CliRunner().invoke(app, ["emit", "--bootstrap", "h:1", str(FIXTURE)])
    conn = fake_cli["connection"]
    assert conn.security_protocol == "SASL_PLAINTEXT" and conn.username == "cluster-a"
    assert conn.password.encode() == b"hunter2-secret" and "hunter2" not in res.output
    res = CliRunner().invoke(app, ["emit", "--bootstrap", "h:1", "--password-file", str(tmp_path / "none"),
                                   str(FIXTURE)])
    assert res.exit_code == 2 and "cannot read the Kafka password file" in res.stderr
