"""A burst request from the portal on the real pipeline: a member sends it through the API (the producer SDK, a real
Kafka broker), the worker decides it, the sink writes the decision to the lake, and the portal shows it: pending
first, then the ledger's verdict and sentence."""

from __future__ import annotations

import json
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chipledger.cli import app  # noqa: E402
from chipledger.sim.scenario import generate, iter_jsonl  # noqa: E402
from kafka_support import module_broker  # noqa: E402
from pipeline_support import WorkerProcess, pump  # noqa: E402
from store import open_store  # noqa: E402
from streams.sink import Sink  # noqa: E402

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    with module_broker(tmp_path_factory, partitions=1) as kafka:
        yield kafka["bootstrap"]


def test_burst_request_from_the_portal_is_decided(bootstrap, tmp_path):
    from chipledger.web.app import Portal, build_app
    from chipledger.web.auth import TokenCache, new_token
    from chipledger.web.lake import LakeReader
    from streams.producer import LedgerProducer
    from tests.web_support import portal_config

    events = tmp_path / "fleet.jsonl"
    lines = list(iter_jsonl(generate(seed=5, days=0.5, pools=1, teams=3)))
    events.write_text("\n".join(lines) + "\n")
    teams = sorted({json.loads(x)["team"] for x in lines if '"quota.granted"' in x})
    pool = json.loads(lines[0])["pool"]
    runner = CliRunner()
    emitted = runner.invoke(app, ["emit", str(events), "--bootstrap", bootstrap, "--timeout", "30"])
    assert emitted.exit_code == 0, emitted.output
    worker = WorkerProcess(bootstrap, tmp_path / "worker", tmp_path / "worker.log", "--tick-interval", "0",
                           "--fetch-max-wait-ms", "25", app_id=f"portal-{uuid.uuid4().hex[:6]}").start()
    store = open_store(f"sqlite:///{tmp_path / 'sink.db'}")
    sink = Sink(tmp_path / "lake", store, bootstrap=bootstrap, name="sink")
    try:
        n_events = sum(1 for x in lines if x.strip())
        pump(sink, lambda: sink.stats.rows["events"] >= n_events - 5, 240, worker)
        reader = LakeReader(tmp_path / "lake")
        portal = Portal(cfg=portal_config(), reader=reader, store=store, tokens=TokenCache(store, ttl_s=0),
                        producer_factory=lambda: LedgerProducer(bootstrap))
        client = TestClient(build_app(portal))
        team = teams[0]
        _, token = new_token(store, "alice", team)
        h = {"Authorization": f"Bearer {token}"}
        now = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
        body = {"pool": pool, "team": team, "chips": 1, "window_start": (now + timedelta(hours=2)).isoformat(),
                "window_end": (now + timedelta(hours=6)).isoformat(), "reason": "eval sweep"}
        assert client.post("/api/v1/bursts/dry-run", json=body, headers=h).status_code == 200
        sent = client.post("/api/v1/bursts", json=body, headers=h)
        assert sent.status_code == 202, sent.text
        rid = sent.json()["request_id"]
        mine = client.get(f"/api/v1/teams/{team}/bursts", headers=h).json()["bursts"]
        assert [b["status"] for b in mine if b["request_id"] == rid] == ["pending"]
        before = sink.stats.rows.get("decisions", 0)
        pump(sink, lambda: sink.stats.rows.get("decisions", 0) > before, 120, worker)
        reader.refresh()
        mine = client.get(f"/api/v1/teams/{team}/bursts", headers=h).json()["bursts"]
        got = [b for b in mine if b["request_id"] == rid]
        assert len(got) == 1 and got[0]["status"] in ("approved", "partial", "denied"), got
        assert got[0]["requested_by"] == "alice" and rid in got[0]["message"]
    finally:
        worker.stop()
        sink.close()
