"""The worker's /metrics has the cost series of `chipledger serve-metrics` (issue 36): a real worker on a real
Kafka broker (its own, so no other test's pools are in its topics) folds a log with prices and budgets, and its
`chipledger_team_cost_total` and `chipledger_team_budget_rate` equal what serve-metrics serves over `chipledger
run`'s lake of the same log. Needs Kafka (tests/kafka_support.py); skips loudly without, or fails under
CHIPLEDGER_REQUIRE_KAFKA."""

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
from kafka_support import free_port, module_broker  # noqa: E402
from store import open_store  # noqa: E402
from pipeline_support import WorkerProcess  # noqa: E402

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    with module_broker(tmp_path_factory, partitions=2) as kafka:  # a broker of its own (see the module's docstring)
        yield kafka["bootstrap"]


def _metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""



def _cost_series(text: str) -> dict:
    """{(sample name, sorted labels): value} of the cost and budget series of an exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith(("chipledger_team_cost", "chipledger_team_budget_rate"))}


def test_the_workers_metrics_have_the_cost_series_of_serve_metrics(bootstrap, tmp_path):
    """Issue 36: the worker's /metrics serves chipledger_team_cost_total and chipledger_team_budget_rate, equal to
    what `chipledger serve-metrics` serves over `chipledger run`'s lake of the same log: the demo's prices (a base
    price and a weekday peak band per pool) and budgets, and one pool's base price changed half-way."""
    import subprocess

    from chipledger.demo import with_prices

    events = list(with_prices(generate(seed=5, days=1, pools=2, teams=3, scale=0.3)))
    mid = events[len(events) // 2]
    events.insert(len(events) // 2, {"event_id": "price-base-again", "type": "price.set",
                                     "occurred_at": mid["occurred_at"], "pool": mid["pool"], "source": "finance/demo",
                                     "price_id": "base", "per_chip_hour": 999, "unit": "USD-cent"})
    path = tmp_path / "fleet.jsonl"
    write_jsonl(events, path)
    runner = CliRunner()
    run = runner.invoke(app, ["run", "--events", str(path), "--lake", str(tmp_path / "run-lake"),
                              "--store", f"sqlite:///{tmp_path / 'run.db'}"])
    assert run.exit_code == 0, run.output
    applied = {b.pool: b.applied for b in open_store(f"sqlite:///{tmp_path / 'run.db'}").pool_balances()}
    sm_port = free_port()
    serve_log = (tmp_path / "serve-metrics.log").open("wb")
    serving = subprocess.Popen([sys.executable, "-m", "chipledger.cli", "serve-metrics", "--lake",
                                str(tmp_path / "run-lake"), "--port", str(sm_port)], stdout=serve_log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    emitted = runner.invoke(app, ["emit", str(path), "--bootstrap", bootstrap, "--timeout", "30"])
    assert emitted.exit_code == 0, emitted.output
    port = free_port()
    worker = WorkerProcess(bootstrap, tmp_path / "worker", tmp_path / "worker.log", "--tick-interval", "0",
                           "--table-store", "memory", "--metrics-port", str(port),
                           app_id=f"cost-metrics-{uuid.uuid4().hex[:6]}").start()
    try:
        def applied_of(text: str) -> dict:
            from prometheus_client.parser import text_string_to_metric_families

            return {s.labels["pool"]: s.value for fam in text_string_to_metric_families(text)
                    if fam.name == "chipledger_events_applied" for s in fam.samples}

        deadline = time.monotonic() + 180
        while applied_of(_metrics(port)) != applied or applied_of(_metrics(sm_port)) != applied:
            assert worker.alive(), worker.tail()
            assert serving.poll() is None, (tmp_path / "serve-metrics.log").read_text()
            assert time.monotonic() < deadline, f"the /metrics never showed every event\n{worker.tail()}"
            time.sleep(1)
        got, want = _cost_series(_metrics(port)), _cost_series(_metrics(sm_port))
        costs = {k: v for k, v in want.items() if k[0] == "chipledger_team_cost_total"}
        # both pools priced, every team of the log with a cost in one of them, and budgets for the teams
        assert {dict(k[1])["pool"] for k in costs} == set(applied) and len(costs) >= 3 and all(costs.values())
        assert any(k[0] == "chipledger_team_budget_rate" for k in want)
        assert got == want
    finally:
        worker.stop()
        if serving.poll() is None:
            serving.terminate()
            serving.wait(30)
        serve_log.close()
