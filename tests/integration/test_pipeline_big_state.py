"""A busy pool: its state (most of it the dedup window of a day's event ids) outgrows the broker's 1 MiB record
limit, which Faust's table changelog topic keeps. The worker writes such a state in parts and reads it back; the
books equal `chipledger run`'s, and a restarted worker resumes from the parted state."""

from __future__ import annotations

import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chipledger.cli import app  # noqa: E402
from kafka_support import module_broker  # noqa: E402
from store import open_store  # noqa: E402
from pipeline_support import WorkerProcess, lake_tables, pump  # noqa: E402
from streams.sink import Sink  # noqa: E402

pytestmark = pytest.mark.kafka

POOL = "busy/h100"
T0 = datetime(2026, 11, 2, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    with module_broker(tmp_path_factory, partitions=2) as kafka:
        yield kafka["bootstrap"]


def _ts(s: int) -> str:
    return (T0 + timedelta(seconds=s)).strftime("%Y-%m-%dT%H:%M:%SZ")


def busy_pool(first: int, n: int, pool: str = POOL) -> list[bytes]:
    """`n` chip state changes of one pool, 2 s apart from event `first` on: all within the one-day dedup window."""
    POOL = pool  # noqa: N806 - the events' pool
    out = []
    if first == 0:
        out.append({"event_id": "b-cfg", "type": "pool.configured", "occurred_at": _ts(0), "pool": POOL,
                    "source": "t", "flavor": "h100", "chips_per_node": 8})
        out += [{"event_id": f"b-reg-{g}", "type": "chip.registered", "occurred_at": _ts(0), "pool": POOL,
                 "source": "t", "chip_id": f"n0-g{g}", "node": "n0"} for g in range(8)]
    out += [{"event_id": f"b-{i:06d}", "type": "chip.state_changed", "occurred_at": _ts(1 + i * 2), "pool": POOL,
             "source": "t", "chip_id": f"n0-g{i % 8}", "state": "degraded" if (i // 8) % 2 == 0 else "healthy",
             "reason": "flap"} for i in range(first, first + n)]
    return [orjson.dumps(e) for e in out]


def test_a_pool_state_over_the_broker_limit_is_written_in_parts_and_the_books_equal_run(bootstrap, tmp_path):
    first, second = busy_pool(0, 26_000), busy_pool(26_000, 4_000)
    runner = CliRunner()
    both = tmp_path / "both.jsonl"
    both.write_bytes(b"\n".join(first + second) + b"\n")
    run = runner.invoke(app, ["run", "--events", str(both), "--lake", str(tmp_path / "run-lake"),
                              "--store", f"sqlite:///{tmp_path / 'run.db'}", "--json"])
    assert run.exit_code == 0, run.output
    from ledger.state import PoolState  # noqa: F401 - the state's size is the point of the test

    f1 = tmp_path / "first.jsonl"
    f1.write_bytes(b"\n".join(first) + b"\n")
    f2 = tmp_path / "second.jsonl"
    f2.write_bytes(b"\n".join(second) + b"\n")
    app_id = f"big-{uuid.uuid4().hex[:6]}"
    store = open_store(f"sqlite:///{tmp_path / 'sink.db'}")
    sink = Sink(tmp_path / "lake", store, bootstrap=bootstrap, name="sink")
    want = {b.pool: b.applied for b in open_store(f"sqlite:///{tmp_path / 'run.db'}").pool_balances()}
    try:
        assert runner.invoke(app, ["emit", str(f1), "--bootstrap", bootstrap, "--timeout", "30"]).exit_code == 0
        worker = WorkerProcess(bootstrap, tmp_path / "worker", tmp_path / "worker.log", "--tick-interval", "0",
                               "--loglevel", "info", app_id=app_id).start()
        try:
            pump(sink, lambda: {b.pool: b.applied for b in store.pool_balances()} == {POOL: len(first)}, 240, worker)
            assert worker.alive(), worker.tail()
        finally:
            worker.stop()
        # a new worker of the group resumes from the table (the parted state) and folds the rest
        assert runner.invoke(app, ["emit", str(f2), "--bootstrap", bootstrap, "--timeout", "30"]).exit_code == 0
        worker = WorkerProcess(bootstrap, tmp_path / "worker2", tmp_path / "worker2.log", "--tick-interval", "0",
                               "--loglevel", "info", app_id=app_id).start()
        try:
            pump(sink, lambda: {b.pool: b.applied for b in store.pool_balances()} == want, 240, worker)
            assert worker.alive(), worker.tail()
        finally:
            worker.stop()
    finally:
        sink.close()
    # the table's changelog holds the state in parts below the limit, under a head (several versions of it)
    from kafka import KafkaConsumer, TopicPartition

    from streams.worker import PARTS_PREFIX, TABLE_PART_BYTES

    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=5000)
    topic = f"{app_id}-pool-state-changelog"
    tps = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic)]
    c.assign(tps)
    c.seek_to_beginning(*tps)
    records = list(c)
    c.close()
    heads = [r for r in records if r.key == POOL.encode() and r.value and r.value.startswith(PARTS_PREFIX)]
    parts = [r for r in records if r.key.startswith(POOL.encode() + b"\x00part\x00") and r.value is not None]
    assert heads and len(parts) >= 2 * len(heads) and all(len(r.value) <= TABLE_PART_BYTES for r in parts)
    assert any(r.value is None for r in records)  # the parts of a version replaced are deleted (tombstones)
    # the second worker resumed from the parted state: it did not fold the first 26,000 events again
    assert sink.stats.resent_dropped < 2_000, sink.stats
    log = (tmp_path / "worker.log").read_text() + (tmp_path / "worker2.log").read_text()
    assert "MessageSizeTooLarge" not in log and "RecordTooLarge" not in log
    run_tables, got = lake_tables(tmp_path / "run-lake"), lake_tables(tmp_path / "lake")
    for t in ("events", "chip_states", "deadletters"):
        assert got[t] == run_tables[t], t
    assert sum(got["events"].values()) == len(first) + len(second)


def _records(bootstrap: str, topic: str) -> list:
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=5000)
    tps = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic)]
    c.assign(tps)
    c.seek_to_beginning(*tps)
    records = list(c)
    c.close()
    return records
