"""`slurm watch --emit kafka` and `slurm actuate --kafka` against a real Kafka broker (no Slurm needed: the
watcher reads the outputs captured from Slurm 22.05.8 in tests/fixtures/slurm, as tests/test_slurm_mapping.py).

- the watcher sends through LedgerProducer (its config, so the producer's credentials apply): the input topics
  then hold exactly the events the JSONL sink gets, each once, keyed by pool; a restarted watcher adds no event
  but the tick;
- the actuator consumes chipledger.decisions in its consumer group and applies a decision once, even when the
  decision is on the topic twice and the actuator is restarted.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chipledger.adapters.slurm.actuate import Actuator, decisions_from_kafka  # noqa: E402
from chipledger.adapters.slurm.watch import KafkaSink, Watcher  # noqa: E402
from schemas import INPUT_TOPICS, TOPIC_DECISIONS  # noqa: E402
from streams import broker  # noqa: E402
from streams.producer import LedgerProducer  # noqa: E402
from streams.topics import create_topics  # noqa: E402

from kafka_support import check_prerequisites, free_port, start_broker  # noqa: E402
from test_slurm_mapping import CLUSTER, FIX, NOW, FakeOps, FakeSlurm, ListSink, _decision  # noqa: E402
from chipledger.adapters.slurm import commands  # noqa: E402

pytestmark = pytest.mark.kafka
PARTITIONS = 2


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    check_prerequisites()
    data_dir = tmp_path_factory.mktemp("kafka")
    info = start_broker(data_dir, free_port())
    create_topics(info["bootstrap_servers"], partitions=PARTITIONS, timeout_s=60)
    yield info["bootstrap_servers"]
    broker.down(data_dir, timeout_s=30)


def _consume(bootstrap: str, topics) -> list:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                             auto_offset_reset="earliest", client_id=f"it-{uuid.uuid4().hex[:8]}")
    try:
        tps = [TopicPartition(t, p) for t in topics for p in range(PARTITIONS)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        records = []
        deadline = time.monotonic() + 30
        while any(consumer.position(tp) < end[tp] for tp in tps):
            assert time.monotonic() < deadline
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
        return records
    finally:
        consumer.close()


def _connection(bootstrap: str):
    from chipledger.config import KafkaConfig
    from streams.clients import connection_from_config

    return connection_from_config(KafkaConfig(), bootstrap=bootstrap)


def _fake():
    load = lambda name: json.loads((FIX / name).read_text())  # noqa: E731
    return FakeSlurm(commands.nodes_from_sinfo_json(load("sinfo.json")),
                     commands.assocs_from_text((FIX / "assoc.txt").read_text()),
                     commands.runs_from_sacct_json(load("sacct.json")))


def test_watch_emits_to_kafka_once(bootstrap, tmp_path):
    fake = _fake()
    expected = ListSink()
    Watcher(CLUSTER, tmp_path / "jsonl.state", expected, since=NOW - 400, settle_s=5, slurm=fake.slurm(),
            clock=lambda: NOW).poll()
    sink = KafkaSink(LedgerProducer(_connection(bootstrap)))  # as the CLI builds it: [kafka] config + --bootstrap
    Watcher(CLUSTER, tmp_path / "k.state", sink, since=NOW - 400, settle_s=5, slurm=fake.slurm(),
            clock=lambda: NOW).poll()
    Watcher(CLUSTER, tmp_path / "k.state", sink, settle_s=5, slurm=fake.slurm(), clock=lambda: NOW).poll()  # restart
    sink.close()
    records = _consume(bootstrap, INPUT_TOPICS)
    got = [json.loads(r.value) for r in records]
    assert sorted(e["event_id"] for e in got) == sorted(e["event_id"] for e in expected.events)
    assert all(r.key.decode() == json.loads(r.value)["pool"] for r in records)


def test_actuate_from_kafka_applies_a_decision_once(bootstrap, tmp_path):
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=bootstrap)
    d = _decision("d-kafka")
    for _ in range(2):  # the same decision twice (a retried output)
        p.send(TOPIC_DECISIONS, key=d["pool"].encode(), value=json.dumps(d).encode())
    p.flush()
    p.close()
    fake = FakeOps({"4": "RUNNING"})
    group = f"g-{uuid.uuid4().hex[:6]}"
    act = Actuator(CLUSTER, tmp_path / "a.state", ops=fake.ops())
    outcomes = []
    for decision, commit in decisions_from_kafka(_connection(bootstrap), CLUSTER, group=group, timeout_s=5):
        outcomes.append(act.apply(decision))
        commit()
    assert [o.skipped for o in outcomes] == ["", "applied before"]
    assert fake.calls == [("mark", "4", "chipledger-preempt:d-kafka"), ("requeue", "4")]
    again = list(decisions_from_kafka(bootstrap, CLUSTER, group=group, timeout_s=3))  # restarted: committed
    assert again == []
