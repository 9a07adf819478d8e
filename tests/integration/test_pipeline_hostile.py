"""No poison pill on the Kafka path: every hostile record of tests/hostile_records.py, sent to the input topics
of a real broker, becomes a dead letter with its expected code (or is applied / dropped as the list says), the
pools go on, and the books of the valid events equal `chipledger run` on them. Once in backlog mode (all sent,
then the worker starts) and once live (sent with pauses into the running worker), each under its own pool names.

Also a malformed output record (`{"kind":"rows"}` on chipledger.deadletter) does not stop the sink: it is a dead
letter of the sink with its raw bytes, and the sink reads on. The records are stamped with the SDK's headers
(producer id, seq, previous seq of the key) but sent by a plain producer: the SDK would refuse them."""

from __future__ import annotations

import base64
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hostile_records as H  # noqa: E402
from chipledger.cli import app  # noqa: E402
from kafka_support import module_broker  # noqa: E402
from store import open_store  # noqa: E402
from pipeline_support import WorkerProcess, lake_tables, strip_prefix  # noqa: E402
from streams.sequencer import HEADER_PREV, HEADER_PRODUCER, HEADER_SEQ  # noqa: E402
from streams.sink import Sink  # noqa: E402
from schemas.parse import DEFAULT_MAX_EVENT_BYTES  # noqa: E402

pytestmark = pytest.mark.kafka

INPUT_LIMIT = 1_000_000  # the input topics keep the broker's default max.message.bytes (1 MiB): larger ones are
# refused by the broker at the producer (nothing reaches the worker), so they are not sent here


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    with module_broker(tmp_path_factory, partitions=3) as kafka:
        yield kafka["bootstrap"]


def _renamed(lines, prefix: bytes):
    out = []
    for ln in H.fleet_lines(kafka=True) if lines is None else lines:
        if len(ln.raw) > INPUT_LIMIT:
            continue
        # a record with no pool to key by (raw bytes) is keyed by pool A, as a pool-keyed producer sends it
        key = (ln.key if ln.key is not None else H.POOL_A.encode()).replace(b"hostile/", prefix + b"hostile/")
        out.append(H.Line(ln.raw.replace(b"hostile/", prefix + b"hostile/"), ln.expect, ln.name, key, ln.topic,
                          ln.kafka_only, ln.why))
    return out


def _send(bootstrap, lines, pause_every=0):
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, max_request_size=2 << 20,
                      linger_ms=2)
    pid, prev = uuid.uuid4().hex[:16].encode(), {}
    for seq, ln in enumerate(lines, 1):
        key = ln.key or None
        headers = [(HEADER_PRODUCER, pid), (HEADER_SEQ, str(seq).encode()),
                   (HEADER_PREV, str(prev.get(key, 0)).encode())]
        prev[key] = seq
        p.send(ln.topic, key=key, value=ln.raw, headers=headers)
        if pause_every and seq % pause_every == 0:
            p.flush()
            time.sleep(0.3)
    p.flush(60)
    p.close()


def _expected(lines):
    dead = Counter(ln.expect for ln in lines if ln.expect not in (H.VALID, H.DUPLICATE))
    return sum(1 for ln in lines if ln.expect == H.VALID), dead


def _wait(sink, worker, events, dead, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while sink.stats.rows["events"] < events or sink.stats.rows["deadletters"] < dead:
        assert worker.alive(), worker.tail()
        assert time.monotonic() < deadline, f"not there after {timeout_s}s: {sink.stats.as_dict()}\n{worker.tail()}"
        sink.poll_once(timeout_ms=200, batch_ms=300)




@pytest.mark.timeout(600)
def test_hostile_records_backlog_and_live_are_dead_letters_and_the_books_of_the_valid_ones_equal_run(
        bootstrap, tmp_path):
    fleet = H.fleet_lines(kafka=True)
    valid = H.write_lines(tmp_path / "valid.jsonl", H.valid_only([ln for ln in fleet if len(ln.raw) <= INPUT_LIMIT]))
    res = CliRunner().invoke(app, ["run", "--events", str(valid), "--lake", str(tmp_path / "run-lake"),
                                   "--store", f"sqlite:///{tmp_path / 'run.db'}"])
    assert res.exit_code == 0, res.output
    want = lake_tables(tmp_path / "run-lake")
    want["job_runs"] = Counter({r: n for r, n in want["job_runs"].items() if r[8] is not None})

    backlog, live = _renamed(None, b"bk~"), _renamed(None, b"lv~")
    n_events, dead = _expected(backlog)
    assert dead["bad_key"] == 2 and dead["too_large"] >= 1 and dead["too_deep"] >= 2
    _send(bootstrap, backlog)  # backlog: everything is in the topics before the worker starts
    worker = WorkerProcess(bootstrap, tmp_path / "worker", tmp_path / "worker.log", "--tick-interval", "0",
                           "--table-store", "memory", app_id=f"hostile-{uuid.uuid4().hex[:6]}").start()
    store = open_store(f"sqlite:///{tmp_path / 'sink.db'}")
    sink = Sink(tmp_path / "lake", store, bootstrap=bootstrap, name="sink", batch_ms=300)
    try:
        _wait(sink, worker, n_events, sum(dead.values()))
        # a malformed output record: a dead letter of the sink, and the sink goes on
        from kafka import KafkaProducer

        p = KafkaProducer(bootstrap_servers=bootstrap)
        p.send("chipledger.deadletter", key=b"x", value=b'{"kind":"rows"}').get(30)
        p.close()
        _send(bootstrap, live, pause_every=7)  # live: into the running worker, with pauses
        _wait(sink, worker, 2 * n_events, 2 * sum(dead.values()) + 1)
        for _ in range(10):
            sink.poll_once(timeout_ms=200, batch_ms=200)
    finally:
        worker.stop()
        sink.close()
    log = (tmp_path / "worker.log").read_text()
    assert "Traceback" not in log and sink.stats.malformed == 1
    got_all = lake_tables(tmp_path / "lake")
    from analytics.views import connect

    con = connect(tmp_path / "lake")
    for prefix in ("bk~", "lv~"):
        got = strip_prefix(got_all, prefix)
        for name in ("events", "journal", "job_runs", "decisions"):
            assert got[name] == want[name], f"{prefix}: {name} differs from run on the valid events"
    # every hostile record is one dead letter with its expected code and the raw bytes it was sent with
    got_dl = Counter((base64.b64decode(r), code) for r, code in con.execute(
        "SELECT raw_b64, error_code FROM deadletters WHERE detail NOT LIKE 'sink:%'").fetchall())
    # a too_large record keeps its first [ledger] max_event_bytes bytes, as `chipledger run` keeps a too long line's
    want_dl = Counter((ln.raw[:DEFAULT_MAX_EVENT_BYTES] if ln.expect == "too_large" else ln.raw, ln.expect)
                      for ln in backlog + live if ln.expect not in (H.VALID, H.DUPLICATE))
    names = {(ln.raw[:DEFAULT_MAX_EVENT_BYTES] if ln.expect == "too_large" else ln.raw, ln.expect): ln.name
             for ln in backlog + live}
    assert got_dl == want_dl, {names.get(k, k[1]): (got_dl[k], want_dl[k]) for k in set(got_dl) | set(want_dl)
                               if got_dl[k] != want_dl[k]}
    (raw,) = con.execute("SELECT raw_b64 FROM deadletters WHERE detail LIKE 'sink:%'").fetchone()
    assert base64.b64decode(raw) == b'{"kind":"rows"}'
