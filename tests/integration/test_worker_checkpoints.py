"""Outputs never wait for a checkpoint (a real broker): with `--checkpoint-interval-ms` far longer than the test, the
worker's outputs of a whole file reach the sink while the group's committed offsets stay where its first checkpoint
put them; a worker started after it reads the uncommitted records again, and the sink drops what it re-sends."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chipledger.sim.scenario import generate, iter_jsonl  # noqa: E402
from kafka_support import module_broker  # noqa: E402
from store import open_store  # noqa: E402
from pipeline_support import WorkerProcess, pump  # noqa: E402
from schemas.topics import TOPIC_LOG  # noqa: E402
from streams.sink import Sink  # noqa: E402

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    with module_broker(tmp_path_factory, partitions=3) as kafka:
        yield kafka["bootstrap"]


def emit(bootstrap: str, lines: list[str]) -> None:
    from streams.producer import LedgerProducer, emit_lines

    with LedgerProducer(bootstrap) as p:
        report = emit_lines(p, [line.encode() for line in lines], flush_timeout=60)
    assert report.sent == len(lines) and not report.invalid


def log_commits(bootstrap: str, group: str) -> tuple[int, int]:
    """(offsets the group committed on chipledger.log, the log's end offsets), summed over its partitions."""
    from kafka import KafkaConsumer, TopicPartition

    # a consumer of the group that never subscribes: it only asks the coordinator what the group committed
    cons = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        tps = [TopicPartition(TOPIC_LOG, p) for p in sorted(cons.partitions_for_topic(TOPIC_LOG))]
        committed = {tp: cons.committed(tp) for tp in tps}
        ends = cons.end_offsets(tps)
    finally:
        cons.close()
    return sum(committed[tp] or 0 for tp in tps), sum(ends.values())


def test_outputs_reach_the_sink_while_the_checkpoint_that_commits_them_has_not_come(bootstrap, tmp_path):
    lines = list(iter_jsonl(generate(seed=4, days=1, pools=3, teams=4)))
    first, rest = lines[:300], lines[300:]
    group = f"ckpt-{uuid.uuid4().hex[:6]}"
    # checkpoints 10 minutes apart: at most one (the worker's first drain) during the test
    worker = WorkerProcess(bootstrap, tmp_path / "worker", tmp_path / "worker.log", "--tick-interval", "0",
                           "--checkpoint-interval-ms", "600000", app_id=group).start()
    sink = Sink(tmp_path / "lake", open_store(f"sqlite:///{tmp_path / 'sink.db'}"), bootstrap=bootstrap, name="sink")
    try:
        emit(bootstrap, first)
        pump(sink, lambda: sink.stats.rows["events"] == len(first), 180, worker)
        emit(bootstrap, rest)
        pump(sink, lambda: sink.stats.rows["events"] == len(lines), 180, worker)
        committed, end = log_commits(bootstrap, group)
        # every event's outputs are in the lake, while the log records of the second part are not committed:
        # the fold sent their outputs without waiting for a checkpoint
        assert committed < end, (committed, end)
        worker.stop()
        # a worker started now reads every uncommitted log record again (a crash would, too); it folds them
        # again (skipped: the table holds them, or folded anew from an older table) and the sink drops every
        # output it sends again: the lake gets no event twice
        dropped = sink.stats.resent_dropped
        again = WorkerProcess(bootstrap, tmp_path / "worker", tmp_path / "worker.log", "--tick-interval", "0",
                              app_id=group).start()
        try:
            # (its sequencer logs the uncommitted input records again, too: the log grows, and the fold skips them)
            pump(sink, lambda: len(set(log_commits(bootstrap, group))) == 1, 180, again)
            for _ in range(10):
                sink.poll_once(timeout_ms=200)
        finally:
            again.stop()
        assert sink.stats.rows["events"] == len(lines) and sink.stats.resent_dropped > dropped
    finally:
        worker.stop()
        sink.close()
