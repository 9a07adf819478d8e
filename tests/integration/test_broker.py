"""Integration tests for streams/broker.py: a real single-node Kafka (KRaft) from Maven jars.

Needs `java` (17+) and, unless the jar cache is already filled, `mvn` with access to
Maven Central.  Without them these tests are skipped loudly; with
CHIPLEDGER_REQUIRE_KAFKA=1 (CI) they fail instead.
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import pytest

try:
    from streams import broker
except ImportError:  # run without an installed package / rootdir on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from streams import broker

from kafka_support import check_prerequisites, free_port, port_open, start_broker

pytestmark = pytest.mark.kafka

@pytest.fixture(scope="module")
def kafka_env(tmp_path_factory):
    """Prerequisites + a data dir and port for this module's broker; stops it at the end."""
    check_prerequisites()
    data_dir = tmp_path_factory.mktemp("kafka")
    env = {"data_dir": data_dir, "port": free_port()}
    t0 = time.monotonic()
    info = start_broker(data_dir, env["port"])
    print(f"\nkafka: jars + up {time.monotonic() - t0:.1f}s -> {info['bootstrap_servers']}")
    env["first"] = info
    yield env
    broker.down(data_dir, timeout_s=30)


@pytest.fixture
def kafka(kafka_env):
    """The running broker (restarted if a previous test stopped it): up() is idempotent."""
    return broker.up(port=kafka_env["port"], data_dir=kafka_env["data_dir"], timeout_s=180, secure=False)


def test_status_reports_running_broker(kafka, kafka_env):
    st = broker.status(kafka_env["data_dir"])
    assert st is not None
    assert st["pid"] == kafka["pid"]
    assert st["port"] == kafka_env["port"]
    assert st["ready"] is True
    assert st["bootstrap_servers"] == f"127.0.0.1:{kafka_env['port']}"
    assert Path(st["log"]).is_file()
    assert (kafka_env["data_dir"] / "kafka.pid").read_text().strip() == str(kafka["pid"])
    # the port speaks the Kafka protocol (ApiVersions lists CreateTopics=19, Produce=0, Fetch=1)
    apis = broker._api_versions(kafka_env["port"])
    assert {0, 1, 18, 19} <= set(apis)


def test_up_again_returns_the_running_broker(kafka, kafka_env):
    t0 = time.monotonic()
    again = broker.up(port=kafka_env["port"], data_dir=kafka_env["data_dir"], secure=False)
    assert again["pid"] == kafka["pid"]
    assert time.monotonic() - t0 < 5


def test_create_produce_consume_roundtrip(kafka):
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

    bootstrap = kafka["bootstrap_servers"]
    topic = f"chipledger-it-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, bootstrap_timeout_ms=30000)
    try:
        admin.create_topics({topic: {"num_partitions": 1, "replication_factor": 1}}, wait_for_metadata=True)
        assert topic in admin.list_topics()
    finally:
        admin.close()

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", bootstrap_timeout_ms=30000)
    try:
        meta = producer.send(topic, key=b"pool-a", value=b'{"chip_seconds": 42}').get(timeout=30)
        assert meta.topic == topic and meta.offset == 0
    finally:
        producer.close()

    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"it-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        bootstrap_timeout_ms=30000,
    )
    try:
        got = []
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=1000).values():
                got.extend(records)
        assert [(r.key, r.value) for r in got] == [(b"pool-a", b'{"chip_seconds": 42}')]
        consumer.commit()
    finally:
        consumer.close()


def test_up_on_busy_port_raises_clear_error(kafka, tmp_path):
    with pytest.raises(broker.BrokerError, match="already in use"):
        broker.up(port=kafka["port"], data_dir=tmp_path / "other", timeout_s=30, secure=False)
    assert broker.status(tmp_path / "other") is None


def test_down_stops_broker_and_closes_port(kafka, kafka_env):
    pid, port, data_dir = kafka["pid"], kafka_env["port"], kafka_env["data_dir"]
    assert port_open(port)
    assert broker.down(data_dir, timeout_s=60) is True
    assert broker.status(data_dir) is None
    assert not (data_dir / "kafka.pid").exists()
    assert not port_open(port)
    assert not Path(f"/proc/{pid}").exists() or not broker._alive(pid)
    assert broker.down(data_dir) is False  # idempotent
