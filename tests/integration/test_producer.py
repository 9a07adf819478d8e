"""`chipledger topics create` and `chipledger emit` against a real single-node Kafka (KRaft) from Maven jars.

Needs `java` (17+) and, unless the jar cache is already filled, `mvn` with access to Maven Central. Without
them the broker tests are skipped loudly; with CHIPLEDGER_REQUIRE_KAFKA=1 (CI) they fail instead. The
no-broker tests need neither.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

try:
    from streams import broker
except ImportError:  # run without an installed package / rootdir on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from streams import broker

from chipledger.cli import app
from schemas import INPUT_TOPICS, OUTPUT_TOPICS, Rejection, key_for, parse_event, topic_for
from streams.topics import ALL_TOPICS, TopicMismatchError, create_topics, describe_partitions

from kafka_support import check_prerequisites, free_port, start_broker

pytestmark = pytest.mark.kafka

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hand.jsonl"
PARTITIONS = 3
INVALID_LINES = {13: "not_json", 14: "unknown_type", 15: "schema_invalid"}


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    """A broker for this module (started on a free port in a temp dir, stopped at the end)."""
    check_prerequisites()
    data_dir = tmp_path_factory.mktemp("kafka")
    info = start_broker(data_dir, free_port())
    yield info["bootstrap_servers"]
    broker.down(data_dir, timeout_s=30)


@pytest.fixture(scope="module")
def created(bootstrap):
    """`chipledger topics create` run twice on the fresh broker (so every test can rely on the topics)."""
    runner = CliRunner()
    args = ["topics", "create", "--bootstrap", bootstrap, "--partitions", str(PARTITIONS), "--timeout", "30"]
    return runner.invoke(app, args), runner.invoke(app, args)


def _table(output: str) -> dict[str, str]:
    return dict(line.split() for line in output.strip().splitlines())


def test_topics_create_is_idempotent_with_the_asked_partitions(created, bootstrap):
    first, second = created
    assert first.exit_code == 0, first.output
    assert second.exit_code == 0, second.output
    names = list(ALL_TOPICS)  # the inputs, the sequenced log, the outputs
    assert _table(first.stdout) == {name: "created" for name in names}
    assert list(_table(first.stdout)) == names
    assert _table(second.stdout) == {name: "exists" for name in names}
    assert describe_partitions(bootstrap) == {name: PARTITIONS for name in names}


def test_topics_create_refuses_another_input_partition_count(created, bootstrap):
    with pytest.raises(TopicMismatchError, match=f"has {PARTITIONS}.*asked for {PARTITIONS + 2}.*co-partitioned"):
        create_topics(bootstrap, partitions=PARTITIONS + 2, timeout_s=30)
    res = CliRunner().invoke(app, ["topics", "create", "--bootstrap", bootstrap, "--partitions", "1"])
    assert res.exit_code == 2
    assert "partition count mismatch" in res.stderr and "chipledger.quota has 3" in res.stderr
    assert describe_partitions(bootstrap) == {n: PARTITIONS for n in ALL_TOPICS}


def _consume_inputs(bootstrap: str) -> list:
    """Every record of every input topic, from the beginning up to the current end offsets."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                             auto_offset_reset="earliest", bootstrap_timeout_ms=30000,
                             client_id=f"it-{uuid.uuid4().hex[:8]}")
    try:
        tps = [TopicPartition(t, p) for t in INPUT_TOPICS for p in range(PARTITIONS)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        records = []
        deadline = time.monotonic() + 30
        while any(consumer.position(tp) < end[tp] for tp in tps):
            assert time.monotonic() < deadline, f"timed out consuming: {len(records)} records so far"
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
        return records
    finally:
        consumer.close()


def test_emit_sends_each_valid_line_once_keyed_and_in_order(created, bootstrap):
    assert created[0].exit_code == 0
    t0 = time.monotonic()
    res = CliRunner().invoke(app, ["emit", "--bootstrap", bootstrap, "--timeout", "30", str(FIXTURE)])
    took = time.monotonic() - t0
    lines = FIXTURE.read_bytes().splitlines()
    assert len(lines) == 27
    valid = [(i, line) for i, line in enumerate(lines, 1) if i not in INVALID_LINES]
    assert res.exit_code == 1, res.output
    assert res.stdout.strip().splitlines()[-1] == f"sent {len(valid)}, invalid {len(INVALID_LINES)}"
    for n, code in INVALID_LINES.items():
        assert f"line {n}: {code}:" in res.stderr
    assert len(res.stderr.strip().splitlines()) == len(INVALID_LINES)
    assert took < 20

    records = _consume_inputs(bootstrap)
    assert len(records) == len(valid)  # exactly once: nothing lost, nothing duplicated, nothing invalid

    # each valid line arrived once, on the right topic, keyed by pool, with a value that parses to the same event
    expected = defaultdict(list)  # (topic, key, value) -> line numbers
    for i, line in valid:
        event = parse_event(line)
        expected[(topic_for(event.type), key_for(event), event.model_dump_json(exclude_none=True).encode())].append(i)
    got = defaultdict(int)
    for r in records:
        got[(r.topic, r.key, r.value)] += 1
        event = parse_event(r.value)
        assert not isinstance(event, Rejection), r
        assert r.key == event.pool.encode() and r.topic == topic_for(event.type)
    assert {k: len(v) for k, v in expected.items()} == dict(got)
    for r in records:
        assert parse_event(r.value) == parse_event(lines[expected[(r.topic, r.key, r.value)][0] - 1])

    # one pool, one partition per topic; within it, the pool's events in file order
    partition_of = {}
    by_tp = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.topic, r.partition, r.offset)):
        assert partition_of.setdefault((r.topic, r.key), r.partition) == r.partition
        by_tp[(r.topic, r.partition, r.key)].append(r.value)
    # co-partitioning: a pool has the same partition number in every input topic
    pools = {key for _, key in partition_of}
    for pool in pools:
        assert len({p for (t, k), p in partition_of.items() if k == pool}) == 1, pool
    for (topic, _, key), values in by_tp.items():
        file_order = [line for _, line in valid
                      if topic_for(parse_event(line).type) == topic and parse_event(line).pool.encode() == key]
        assert [parse_event(v) for v in values] == [parse_event(line) for line in file_order], (topic, key)
    assert pools == {b"lab/a100", b"nowhere/h100"}


@pytest.mark.parametrize("command", [["emit", str(FIXTURE)], ["topics", "create"]])
def test_no_broker_exits_2_quickly_with_a_clear_message(command):
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    res = CliRunner().invoke(app, [*command, "--bootstrap", f"127.0.0.1:{port}", "--timeout", "3"])
    took = time.monotonic() - t0
    assert res.exit_code == 2, res.output
    assert f"no Kafka broker answered at 127.0.0.1:{port}" in res.stderr
    assert "sent" not in res.stdout
    assert took < 20
