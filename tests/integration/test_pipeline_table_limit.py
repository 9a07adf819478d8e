"""A changelog whose record limit is below the parts' size (an operator's broker): the broker refuses the parts
of a grown pool state; its head is never sent, so the pool's previous value stays whole, and once the limit is
raised a new worker restores it and folds on. (Its own broker: the other busy-pool tests' input would come
first.)"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chipledger.cli import app  # noqa: E402
from kafka_support import module_broker  # noqa: E402
from store import open_store  # noqa: E402
from pipeline_support import WorkerProcess, pump  # noqa: E402
from streams.sink import Sink  # noqa: E402
from test_pipeline_big_state import _records, busy_pool  # noqa: E402

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    with module_broker(tmp_path_factory, partitions=2) as kafka:
        yield kafka["bootstrap"]


def test_a_changelog_that_refuses_the_parts_never_gets_their_head_and_the_worker_goes_on_once_it_takes_them(
        bootstrap, tmp_path):
    """An operator's changelog limit below the parts' size: the broker refuses each part (and would take a head):
    the worker stops at that checkpoint, as it must (nothing acked), but the changelog keeps the pool's previous
    value whole; once the limit is raised, a new worker reads it and folds on."""
    from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient, NewTopic

    from streams.worker import read_parted

    pool = "busy/limited"
    app_id = f"lim-{uuid.uuid4().hex[:6]}"
    topic = f"{app_id}-pool-state-changelog"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, 2, 1, topic_configs={"cleanup.policy": "compact",
                                                              "max.message.bytes": "790000"})])
    events = busy_pool(0, 26_000, pool)
    runner = CliRunner()
    f = tmp_path / "start.jsonl"  # a small state first: written plain
    f.write_bytes(b"\n".join(events[:2_000]) + b"\n")
    assert runner.invoke(app, ["emit", str(f), "--bootstrap", bootstrap, "--timeout", "30"]).exit_code == 0
    worker = WorkerProcess(bootstrap, tmp_path / "w1", tmp_path / "w1.log", "--tick-interval", "0",
                           "--table-store", "memory", app_id=app_id).start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(
                r.key == pool.encode() and r.value and orjson.loads(r.value)["applied"] == 2_000
                for r in _records(bootstrap, topic)):
            time.sleep(1)
        f = tmp_path / "rest.jsonl"  # then the rest: the state grows past the parts' size
        f.write_bytes(b"\n".join(events[2_000:]) + b"\n")
        assert runner.invoke(app, ["emit", str(f), "--bootstrap", bootstrap, "--timeout", "30"]).exit_code == 0
        deadline = time.monotonic() + 240
        while worker.alive() and time.monotonic() < deadline:
            time.sleep(1)
        assert not worker.alive(), "the worker went on although its table write was refused"
    finally:
        worker.stop()
    assert "MessageSizeTooLarge" in (tmp_path / "w1.log").read_text(errors="replace")
    # the changelog as a restore reads it: the pool's value is whole (the last plain one), no head without parts
    table: dict = {}
    for r in _records(bootstrap, topic):
        if r.value is None:
            table.pop(r.key, None)
        else:
            table[r.key] = r.value
    value, head = read_parted(table, pool)  # raises for a head without its parts
    assert head is None and 2_000 <= orjson.loads(value)["applied"] < len(events)
    # the operator raises the limit: a new worker restores that value and folds the rest
    admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs={"max.message.bytes": "1048588"})])
    admin.close()
    store = open_store(f"sqlite:///{tmp_path / 'sink.db'}")
    sink = Sink(tmp_path / "lake", store, bootstrap=bootstrap, name=f"sink-{app_id}")
    worker = WorkerProcess(bootstrap, tmp_path / "w2", tmp_path / "w2.log", "--tick-interval", "0",
                           "--table-store", "memory", app_id=app_id).start()
    try:
        pump(sink, lambda: {b.pool: b.applied for b in store.pool_balances()}.get(pool) == len(events), 240, worker)
        assert worker.alive(), worker.tail()

        def heads() -> list:  # the grown state, written in parts this time (the checkpoint after the snapshot)
            return [r for r in _records(bootstrap, topic) if r.key == pool.encode() and r.value
                    and r.value.startswith(b"\x00parts ")]
        deadline = time.monotonic() + 60
        while not heads() and time.monotonic() < deadline:
            time.sleep(1)
        assert heads() and worker.alive(), worker.tail()
    finally:
        worker.stop()
        sink.close()
    assert "is missing" not in (tmp_path / "w2.log").read_text(errors="replace")

