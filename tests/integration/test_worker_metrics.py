"""`chipledger worker --metrics-port`: a real worker on a real Kafka broker serves /metrics for the pools it
folds, a real Prometheus scrapes it, and what Prometheus holds is the books `chipledger run` gives for the same
file (its store's balances, its lake's sums). Needs Kafka (tests/kafka_support.py) and Prometheus
(tests/prom_support.py); each skips loudly without, or fails under its CHIPLEDGER_REQUIRE_… variable."""

from __future__ import annotations

import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chipledger.cli import app  # noqa: E402
from chipledger.sim.scenario import generate, write_jsonl  # noqa: E402
from kafka_support import check_prerequisites, free_port, start_broker  # noqa: E402
from store import open_store  # noqa: E402
from pipeline_support import WorkerProcess  # noqa: E402
from streams import broker  # noqa: E402
from streams.topics import create_topics  # noqa: E402
from tests.prom_support import tool  # noqa: E402

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    tool("prometheus")  # skip before starting a broker for nothing
    check_prerequisites()
    data_dir = tmp_path_factory.mktemp("kafka")
    info = start_broker(data_dir, free_port())
    create_topics(info["bootstrap_servers"], partitions=2, timeout_s=60)
    yield info["bootstrap_servers"]
    broker.down(data_dir, timeout_s=30)


def _metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""


def test_a_worker_serves_metrics_prometheus_scrapes_them_and_they_are_the_books(bootstrap, prometheus, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    events = tmp_path / "fleet.jsonl"
    write_jsonl(generate(seed=3, days=1, pools=2, teams=3, scale=0.3), events)
    runner = CliRunner()
    run = runner.invoke(app, ["run", "--events", str(events), "--lake", str(tmp_path / "run-lake"),
                              "--store", f"sqlite:///{tmp_path / 'run.db'}"])
    assert run.exit_code == 0, run.output
    store = open_store(f"sqlite:///{tmp_path / 'run.db'}")
    applied = {b.pool: b.applied for b in store.pool_balances()}
    emitted = runner.invoke(app, ["emit", str(events), "--bootstrap", bootstrap, "--timeout", "30"])
    assert emitted.exit_code == 0, emitted.output
    port = free_port()
    worker = WorkerProcess(bootstrap, tmp_path / "worker", tmp_path / "worker.log", "--tick-interval", "0",
                           "--table-store", "memory", "--metrics-port", str(port),
                           app_id=f"metrics-{uuid.uuid4().hex[:6]}").start()
    try:
        def folded():
            got = {}
            for fam in text_string_to_metric_families(_metrics(port)):
                if fam.name == "chipledger_events_applied":
                    got = {s.labels["pool"]: s.value for s in fam.samples if s.name.endswith("_total")}
            return got == applied
        deadline = time.monotonic() + 180
        while not folded():
            assert worker.alive(), worker.tail()
            assert time.monotonic() < deadline, f"the worker's /metrics never showed every event\n{worker.tail()}"
            time.sleep(1)
        prometheus.configure([f"127.0.0.1:{port}"], [])
        deadline = time.monotonic() + 60
        while not prometheus.query('chipledger_team_used_chips{job="chipledger"}'):
            assert time.monotonic() < deadline, "Prometheus never scraped the worker"
            time.sleep(0.5)
        teams = {(t.pool, t.team): t for t in store.team_balances()}
        for metric, attr, scale in (("chipledger_team_used_chips", "used_milli", 1000),
                                    ("chipledger_team_nominal_chips", "nominal_milli", 1000),
                                    ("chipledger_team_in_quota_chips", "in_quota_milli", 1000),
                                    ("chipledger_team_pending_jobs", "pending_jobs", 1)):
            got = {(r["metric"]["pool"], r["metric"]["team"]): float(r["value"][1])
                   for r in prometheus.query(metric)}
            assert got == {k: getattr(t, attr) / scale for k, t in teams.items()}, metric
        lag = prometheus.query("chipledger_consumer_lag_records")
        assert lag and all(float(r["value"][1]) == 0 for r in lag)
        folds = prometheus.query("chipledger_fold_duration_seconds_count")
        assert folds and float(folds[0]["value"][1]) >= sum(applied.values())
        stale = prometheus.query("time() - chipledger_pool_last_fold_timestamp_seconds")
        assert {r["metric"]["pool"] for r in stale} == set(applied)
    finally:
        worker.stop()
        prometheus.configure([], [])
