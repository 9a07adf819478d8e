"""Crash safety on a real broker: kill -9 the worker at random points while a 200k-event stream flows, and stop and
start the broker mid-stream; the final journal and balances equal the embedded fold (no chip-second lost or
doubled). The kill points come from a seeded RNG (printed), so a failure reproduces."""

from __future__ import annotations

import random
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chipledger.embedded import run_file  # noqa: E402
from chipledger.sim.scenario import generate, write_jsonl  # noqa: E402
from kafka_support import module_broker  # noqa: E402
from store import open_store  # noqa: E402
from pipeline_support import WorkerProcess, pump  # noqa: E402
from streams import broker  # noqa: E402
from streams.producer import LedgerProducer, emit_lines  # noqa: E402
from streams.sink import Sink  # noqa: E402

pytestmark = pytest.mark.kafka

EVENTS = 200_000
SEED = 23


@pytest.fixture(scope="module")
def kafka(tmp_path_factory):
    with module_broker(tmp_path_factory, partitions=3) as kafka:
        yield kafka


def _scan(lake: Path, sql: str):
    """`sql` over the lake's raw Parquet (`{journal}`, `{events}`: the table's files), read directly."""
    import duckdb

    con = duckdb.connect()
    files = {name: f"read_parquet('{lake}/{name}/**/*.parquet')" for name in ("journal", "events", "decisions")}
    return con.execute(sql.format(**files)).fetchall()


def _journal(lake: Path) -> Counter:
    # the journal view's definition: postings summed per (pool, hour, account, team)
    return Counter(_scan(lake, "SELECT pool, hour, account, team, sum(amount_mchip_s)::BIGINT AS a "
                               "FROM {journal} GROUP BY ALL HAVING a <> 0"))


def _balances(store) -> list:
    return [(b.pool, b.team, b.nominal_milli, b.used_milli, b.entitled_mchip_s, b.in_quota_mchip_s,
             b.borrowed_mchip_s, b.burst_mchip_s, b.running_jobs, b.pending_jobs) for b in store.team_balances()]


@pytest.mark.timeout(1200)
def test_kill9_worker_and_restart_broker_mid_stream_lose_and_double_nothing(kafka, tmp_path):
    bootstrap = kafka["bootstrap"]
    events = tmp_path / "fleet.jsonl"
    days = 52  # about 200k events for this seed (the scenario's events per day grow with its history)
    n = write_jsonl(generate(seed=SEED, days=days, pools=3, teams=6), events)
    while n < EVENTS:
        days += 1
        n = write_jsonl(generate(seed=SEED, days=days, pools=3, teams=6), events)
    summary, _ = run_file(events, tmp_path / "run-lake", store=open_store(f"sqlite:///{tmp_path / 'run.db'}"))
    assert summary.accepted == n and n >= EVENTS
    want_store = open_store(f"sqlite:///{tmp_path / 'run.db'}")

    rng = random.Random(SEED)
    # fractions of the events written by the sink, one in each third of the stream
    kill_at = [rng.uniform(0.05, 0.3), rng.uniform(0.35, 0.6), rng.uniform(0.65, 0.9)]
    restart_after = rng.uniform(0.1, 0.4)  # fraction of the second half emitted when the broker is restarted
    print(f"kill -9 at {[round(k, 3) for k in kill_at]} of the stream, broker restart after "
          f"{restart_after:.3f} of the second half")

    # the first half is in the log when the worker starts (a backlog); the second half flows while it folds,
    # and the broker is stopped and started while the producer is sending it
    lines = events.read_bytes().splitlines()
    head = n // 2
    with LedgerProducer(bootstrap) as p:
        first = emit_lines(p, lines[:head], flush_timeout=300)
    assert first.sent == head and not first.failed
    cut = head + int((n - head) * restart_after)
    report = {}

    def produce():
        with LedgerProducer(bootstrap, delivery_timeout_ms=300_000) as p:
            report["a"] = emit_lines(p, lines[head:cut], flush_timeout=300)
            report["cut_done"] = time.monotonic()
            report["b"] = emit_lines(p, lines[cut:], flush_timeout=300)

    app_id = f"crash-{uuid.uuid4().hex[:6]}"
    worker = WorkerProcess(bootstrap, tmp_path / "worker", tmp_path / "worker.log", "--tick-interval", "0",
                           app_id=app_id).start()
    store = open_store(f"sqlite:///{tmp_path / 'sink.db'}")
    sink = Sink(tmp_path / "lake", store, bootstrap=bootstrap, name="sink")
    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    t0 = time.monotonic()
    print(f"{n:,} events; embedded run done; {head:,} emitted before the worker starts")
    kills = 0
    restarted_broker = False
    broker_back = None
    supervised = []  # worker exits during the broker outage, restarted as a supervisor would (compose: restart)

    def pump_supervised(done, timeout_s):
        while True:
            try:
                return pump(sink, done, timeout_s, worker)
            except AssertionError as exc:
                # Faust gives up when the broker vanishes at a bad moment (e.g. while it declares its topics):
                # an exit within a minute of the broker's restart is restarted once; any other exit fails
                if not str(exc).startswith("worker exited") or broker_back is None or supervised \
                        or time.monotonic() - broker_back > 60:
                    raise
                supervised.append(str(exc).splitlines()[-1][:200])
                print(f"{time.monotonic() - t0:6.1f}s worker exited during the broker restart; restarted")
                worker.start()

    try:
        while kills < len(kill_at) or not restarted_broker:
            target = int(n * kill_at[kills]) if kills < len(kill_at) else None
            pump_supervised(lambda: (target is not None and sink.stats.rows["events"] >= target)
                            or (not restarted_broker and "cut_done" in report), 300)
            if not restarted_broker and "cut_done" in report:
                # the producer is sending the rest: stop the broker under it, start it again
                broker.down(kafka["data_dir"], timeout_s=60)
                time.sleep(2)
                broker.up(port=kafka["port"], data_dir=kafka["data_dir"], timeout_s=180, secure=False)
                restarted_broker = True
                broker_back = time.monotonic()
                print(f"{time.monotonic() - t0:6.1f}s broker stopped and started")
                continue
            worker.kill9()
            kills += 1
            print(f"{time.monotonic() - t0:6.1f}s kill -9 #{kills} at {sink.stats.rows['events']:,} events in the lake")
            worker.start()
        want_applied = {b.pool: b.applied for b in want_store.pool_balances()}
        pump_supervised(lambda: sink.stats.rows["events"] >= n
                        and {b.pool: b.applied for b in store.pool_balances()} == want_applied, 420)
        producer.join(60)
    finally:
        worker.stop()
        sink.close()
    assert kills == 3 and restarted_broker
    assert head + report["a"].sent + report["b"].sent == n
    assert not report["a"].failed and not report["b"].failed  # the producer retried through the broker restart
    print(f"{time.monotonic() - t0:6.1f}s caught up; sink: {sink.stats.as_dict()}")
    # nothing lost, nothing doubled: every event once, the books and balances of the embedded fold
    ids = _scan(tmp_path / "lake", "SELECT count(*), count(DISTINCT event_id) FROM {events}")
    assert ids == [(n, n)]
    assert _journal(tmp_path / "lake") == _journal(tmp_path / "run-lake")
    decisions = "SELECT decision_id, type, pool, \"at\", rule, message, body FROM {decisions}"
    assert Counter(_scan(tmp_path / "lake", decisions)) == Counter(_scan(tmp_path / "run-lake", decisions))
    assert _balances(store) == _balances(want_store)
