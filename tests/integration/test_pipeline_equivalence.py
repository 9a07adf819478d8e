"""emit + worker + sink on a real Kafka broker gives the books `chipledger run` gives for the same file.

A seeded fleet scenario (3 pools, 2 days, bad lines mixed in) ends with each pool's `pool.tick` at an hour
boundary, so `run`'s final close of the books adds nothing to the journal; the open runs it posts at that close
(the worker never closes early) are the only rows of `run` the stream does not have, and the test names them.
"""

from __future__ import annotations

import base64
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chipledger.cli import app  # noqa: E402
from chipledger.sim.scenario import corrupt, generate, iter_jsonl  # noqa: E402
from kafka_support import module_broker  # noqa: E402
import ledger  # noqa: E402
from store import open_store  # noqa: E402
from pipeline_support import WorkerProcess, lake_tables, pump  # noqa: E402
from streams.sink import Sink  # noqa: E402

pytestmark = pytest.mark.kafka

PARSE_CODES = {"not_json", "unknown_type", "schema_invalid"}  # refused by emit: never reach Kafka


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    with module_broker(tmp_path_factory, partitions=3) as kafka:
        yield kafka["bootstrap"]


def test_emit_worker_sink_equals_run(bootstrap, tmp_path):
    events = tmp_path / "fleet.jsonl"
    labels: list = []
    lines = list(corrupt(iter_jsonl(generate(seed=11, days=2, pools=3, teams=5, progress=True)), seed=11, every=150,
                         labels=labels))
    events.write_text("\n".join(lines) + "\n")
    assert len(lines) > 4000 and {k for _, k in labels} >= {"not_json", "unknown_pool", "duplicate",
                                                             "duplicate_conflict", "illegal_transition"}
    runner = CliRunner()
    run = runner.invoke(app, ["run", "--events", str(events), "--lake", str(tmp_path / "run-lake"),
                              "--store", f"sqlite:///{tmp_path / 'run.db'}", "--json"])
    assert run.exit_code == 0, run.output
    import json

    summary = json.loads(run.stdout)

    emitted = runner.invoke(app, ["emit", str(events), "--bootstrap", bootstrap, "--timeout", "30"])
    assert emitted.exit_code == 1  # some lines were invalid
    invalid_lines = sorted(int(line.split(":")[0].split()[1]) for line in emitted.stderr.strip().splitlines())
    # a foreign producer's garbage on an input topic, keyed by a pool: dead-lettered with its bytes
    from kafka import KafkaProducer

    garbage = b"\xff\xfe not json at all"
    p = KafkaProducer(bootstrap_servers=bootstrap)
    p.send("chipledger.jobs", key=b"us-east1-a/h100-80gb", value=garbage).get(30)
    p.close()

    worker = WorkerProcess(bootstrap, tmp_path / "worker", tmp_path / "worker.log", "--tick-interval", "0",
                           "--fetch-max-wait-ms", "25", "--loglevel", "info", "--log-stalls-ms", "10",
                           app_id=f"eq-{uuid.uuid4().hex[:6]}").start()
    store = open_store(f"sqlite:///{tmp_path / 'sink.db'}")
    # batches of at most 200 output records: several batches however fast the worker is (on a quiet machine it is done
    # before the sink's first poll), so the marks and the compaction below have batches to work on
    sink = Sink(tmp_path / "lake", store, bootstrap=bootstrap, name="sink", max_records=200)
    semantic = sum(n for code, n in summary["dead_letters"].items() if code not in PARSE_CODES)
    want_applied = {b.pool: b.applied for b in open_store(f"sqlite:///{tmp_path / 'run.db'}").pool_balances()}
    try:
        pump(sink, lambda: sink.stats.rows["events"] == summary["accepted"]
             and sink.stats.rows["deadletters"] == semantic + 1
             and {b.pool: b.applied for b in store.pool_balances()} == want_applied, 180, worker)
    finally:
        worker.stop()
        sink.close()
    # the worker bounded its input fetches' wait at the broker (Faust itself would let them wait 1.5 s)
    log = (tmp_path / "worker.log").read_text()
    assert "input fetches wait at most 25 ms at the broker" in log
    # and it says which ledger core folds: the same one `chipledger run` used here
    assert f"ledger core {ledger.CORE}" in log
    # --log-stalls-ms: the backlog's fold holds the loop for slices of up to 20 ms (and the checkpoints serialize
    # the states): each stall over 10 ms is logged with its length and the code that held the loop
    import re

    stalls = re.findall(r"stall: event loop held (\d+) ms: \d+x (\S+:\d+ \S+)", log)
    assert stalls and all(int(ms) >= 10 for ms, _ in stalls)

    # the lines emit refused are the run's parse-level dead letters
    run_tables = lake_tables(tmp_path / "run-lake")
    got = lake_tables(tmp_path / "lake")
    from analytics.views import connect

    parse_dl = sorted(o for (o,) in connect(tmp_path / "run-lake").execute(
        "SELECT \"offset\" FROM deadletters WHERE error_code IN ('not_json', 'unknown_type', 'schema_invalid')"
    ).fetchall())
    assert invalid_lines == parse_dl and len(parse_dl) > 0

    assert got["events"] == run_tables["events"] and sum(got["events"].values()) == summary["accepted"]
    assert got["journal"] == run_tables["journal"] and len(got["journal"]) > 1000
    assert got["decisions"] == run_tables["decisions"] and len(got["decisions"]) > 0
    # job runs: the run's final close posts the runs still open (ended_at NULL) at the last tick; the rest equal
    open_at_close = Counter({r: n for r, n in run_tables["job_runs"].items() if r[8] is None})
    assert got["job_runs"] == run_tables["job_runs"] - open_at_close
    assert all(r[8] is not None for r in got["job_runs"])
    # facts: the run's close posts the waits still open (end 'open', ended_at NULL; the worker posts them only when
    # the hour they began in closes) and each pool's free chips of its last second if not posted yet; the rest equal
    def ended(rows):
        return Counter({r: n for r, n in rows.items() if r[10] != "open"})

    assert ended(got["waits"]) == ended(run_tables["waits"]) and len(got["waits"]) > 1000
    assert got["waits"] - ended(got["waits"]) <= run_tables["waits"] - ended(run_tables["waits"])
    last = {}
    for r in run_tables["free_chips"]:
        last[r[0]] = max(last.get(r[0], r[1]), r[1])
    closing = Counter({r: n for r, n in run_tables["free_chips"].items() if r[1] == last[r[0]]})
    assert run_tables["free_chips"] - closing <= got["free_chips"] <= run_tables["free_chips"]
    assert len(got["free_chips"]) > 1000
    # the throughput facts (posted at each progress report, never at a close) flow through the sink unchanged
    assert got["progress"] == run_tables["progress"] and len(got["progress"]) > 500
    # chip states and grant intervals are posted at the events themselves, never at a close: equal
    for t in ("chip_states", "grant_intervals"):
        assert got[t] == run_tables[t] and len(got[t]) > 0, t
    # dead letters: the run's semantic ones, plus the garbage (raw bytes kept)
    want_dl = Counter({r: n for r, n in run_tables["deadletters"].items() if r[0] not in PARSE_CODES})
    got_dl = got["deadletters"]
    garbage_rows = [r for r in got_dl if r[0] == "not_json"]
    assert len(garbage_rows) == 1
    assert got_dl - Counter(garbage_rows) == want_dl
    (raw_b64,) = connect(tmp_path / "lake").execute(
        "SELECT raw_b64 FROM deadletters WHERE error_code = 'not_json'").fetchone()
    assert base64.b64decode(raw_b64) == garbage

    # the store's balances are those of the run
    def balances(st):
        return [(b.pool, b.team, b.nominal_milli, b.used_milli, b.entitled_mchip_s, b.in_quota_mchip_s,
                 b.borrowed_mchip_s, b.burst_mchip_s) for b in st.team_balances()]

    assert balances(store) == balances(open_store(f"sqlite:///{tmp_path / 'run.db'}"))
    assert store.position("sink", "chipledger.journal", 0) is not None

    # the sink's books are its commits: the lake's mark is the store's last batch, every file in the tables' folders
    # is committed (none half visible), and compacting the sink's small files is one more commit that changes no view
    from analytics.commits import compact, mark, open_lake, unlisted_parquet

    lake = tmp_path / "lake"
    assert mark(lake, "sink:sink") == store.position("sink:batch", "lake", 0) > 1
    snap = open_lake(lake)
    assert sorted(snap.all_files()) == sorted(str(lake / f) for fs in unlisted_parquet(lake).values() for f in fs)
    assert not any((lake / "_staging").rglob("*.parquet"))
    replaced = compact(lake)
    assert replaced["events"] > 1 and open_lake(lake).commit == snap.commit + 1
    assert lake_tables(lake) == got
