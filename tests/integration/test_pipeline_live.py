"""Live is replay: events emitted into a worker that is already running, with random pauses in the send, give the
books of `chipledger run` on the same file, every time; and `chipledger run` on `chipledger log export` gives the
sink's lake.

Ten runs on one broker, one worker and one sink: each run sends the same seeded fleet (bad lines mixed in) under
its own pool names (`r<i>~<pool>`), through a new producer, in chunks separated by random pauses. The lake of
each run, with its prefix taken off, must equal the embedded run of the file (the rows `run`'s final close posts
for runs still open excepted, as in test_pipeline_equivalence.py)."""

from __future__ import annotations

import random
import sys
import time
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
from store import open_store  # noqa: E402
from pipeline_support import WorkerProcess, lake_tables, pump, strip_prefix  # noqa: E402
from streams.producer import LedgerProducer, emit_lines  # noqa: E402
from streams.sink import Sink  # noqa: E402

pytestmark = pytest.mark.kafka

RUNS = 10
PARSE_CODES = {"not_json", "unknown_type", "schema_invalid"}  # refused by the producer: never reach Kafka


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    with module_broker(tmp_path_factory, partitions=3) as kafka:
        yield kafka["bootstrap"]




def _without_open_runs(tables: dict) -> dict:
    return {**tables, "job_runs": Counter({r: n for r, n in tables["job_runs"].items() if r[8] is not None})}


@pytest.mark.timeout(900)
def test_live_emit_with_random_pauses_gives_the_books_of_run_every_time(bootstrap, tmp_path):
    lines = list(corrupt(iter_jsonl(generate(seed=11, days=1, pools=3, teams=4)), seed=11, every=150))
    events = tmp_path / "fleet.jsonl"
    events.write_text("\n".join(lines) + "\n")
    runner = CliRunner()
    run = runner.invoke(app, ["run", "--events", str(events), "--lake", str(tmp_path / "run-lake"),
                              "--store", f"sqlite:///{tmp_path / 'run.db'}"])
    assert run.exit_code == 0, run.output
    want = _without_open_runs(lake_tables(tmp_path / "run-lake"))
    want_dl = Counter({r: n for r, n in want["deadletters"].items() if r[0] not in PARSE_CODES})
    assert sum(want["events"].values()) > 2000 and want_dl

    worker = WorkerProcess(bootstrap, tmp_path / "worker", tmp_path / "worker.log", "--tick-interval", "0",
                           "--table-store", "memory", app_id=f"live-{uuid.uuid4().hex[:6]}").start()
    store = open_store(f"sqlite:///{tmp_path / 'sink.db'}")
    sink = Sink(tmp_path / "lake", store, bootstrap=bootstrap, name="sink", batch_ms=300)
    rng = random.Random(15)
    accepted = sum(want["events"].values())
    semantic = sum(want_dl.values())
    try:
        for i in range(RUNS):
            prefix = f"r{i}~"
            mine = [line.replace('"pool":"', f'"pool":"{prefix}') for line in lines]
            cuts = sorted(rng.sample(range(1, len(mine)), 6))
            with LedgerProducer(bootstrap) as p:
                start = 0
                for cut in cuts + [len(mine)]:
                    emit_lines(p, mine[start:cut], flush_timeout=60)
                    start = cut
                    # the worker folds the first part meanwhile: the rest arrives while it is idle or busy
                    sink.poll_once(timeout_ms=50, batch_ms=rng.choice((0, 50, 200)))
                    time.sleep(rng.choice((0, 0, 0.02, 0.1, 0.4)))
            pump(sink, lambda: sink.stats.rows["events"] >= (i + 1) * accepted
                 and sink.stats.rows["deadletters"] >= (i + 1) * semantic, 120, worker)
        # the last outputs (state snapshots) follow the rows: let the sink read them
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            sink.poll_once(timeout_ms=200, batch_ms=200)
    finally:
        worker.stop()
        sink.close()
    assert "Traceback" not in (tmp_path / "worker.log").read_text()

    got_all = lake_tables(tmp_path / "lake")
    for i in range(RUNS):
        got = strip_prefix(got_all, f"r{i}~")
        assert got["events"] == want["events"], f"run {i}: events differ"
        assert got["journal"] == want["journal"], f"run {i}: journal differs"
        assert got["decisions"] == want["decisions"], f"run {i}: decisions differ"
        assert got["job_runs"] == want["job_runs"], f"run {i}: job runs differ"
        assert got["deadletters"] == want_dl, f"run {i}: dead letters differ"

    # the log, exported, is the books: `chipledger run` on it gives the sink's lake
    export = tmp_path / "log.jsonl"
    res = runner.invoke(app, ["log", "export", "--bootstrap", bootstrap, "-o", str(export)])
    assert res.exit_code == 0, res.output
    refused = sum(n for r, n in want["deadletters"].items() if r[0] in PARSE_CODES)  # by the producer
    assert len(export.read_bytes().splitlines()) == RUNS * (len(lines) - refused)
    res = runner.invoke(app, ["run", "--events", str(export), "--lake", str(tmp_path / "export-lake"),
                              "--store", f"sqlite:///{tmp_path / 'export.db'}"])
    assert res.exit_code == 0, res.output
    replay = _without_open_runs(lake_tables(tmp_path / "export-lake"))
    for name in ("events", "journal", "decisions", "job_runs", "deadletters"):
        assert replay[name] == got_all[name], f"{name}: run on the export differs from the sink's lake"
    # one pool's export is that pool's part of the log, in the same order
    one = tmp_path / "one.jsonl"
    res = runner.invoke(app, ["log", "export", "--bootstrap", bootstrap, "--pool", "r3~us-east1-a/h100-80gb",
                              "-o", str(one)])
    assert res.exit_code == 0, res.output
    from streams import logline

    def value(x):  # the record's value: export lines carry its append time (and origin) around it
        return logline.unwrap(x)[0] if logline.is_wrapped(x) else x
    assert one.read_bytes().splitlines() == [x for x in export.read_bytes().splitlines()
                                            if b'"pool":"r3~us-east1-a/h100-80gb"' in value(x)]
    assert all(logline.is_wrapped(x) for x in export.read_bytes().splitlines())  # each with its append time
