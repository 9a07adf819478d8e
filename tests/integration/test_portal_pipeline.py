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


def test_burst_request_from_the_portal_is_decided(bootstrap, tmp_path, browser):
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

        # the same in a browser: the form, pending, then the decision
        _browser_request(browser, portal, token, team, now, sink, worker, reader)
    finally:
        worker.stop()
        sink.close()


def _browser_request(browser, portal, token, team, now, sink, worker, reader):
    import re
    import socket
    import threading
    import time

    import uvicorn
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from chipledger.web.app import build_app

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(build_app(portal), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    try:
        d = browser.driver
        d.delete_all_cookies()
        d.get(base + "/login")
        d.find_element(By.ID, "token").send_keys(token)
        d.find_element(By.ID, "signin").click()
        WebDriverWait(d, 15).until(lambda drv: not drv.current_url.endswith("/login"))  # signed in (the cookie set)
        d.get(base + f"/teams/{team}/bursts")
        assert not d.find_elements(By.ID, "nokafka")  # this portal has Kafka: the form can send
        d.find_element(By.ID, "chips").clear()
        d.find_element(By.ID, "chips").send_keys("2")
        d.find_element(By.ID, "window_start").send_keys(f"{now + timedelta(hours=3):%Y-%m-%dT%H:%M}")
        d.find_element(By.ID, "window_end").send_keys(f"{now + timedelta(hours=5):%Y-%m-%dT%H:%M}")
        d.find_element(By.ID, "reason").send_keys("from the browser")
        d.find_element(By.ID, "submit").click()
        sent = WebDriverWait(d, 30).until(lambda drv: drv.find_elements(By.ID, "sent"))[0].text
        rid = re.search(r"Sent as (\S+):", sent).group(1)

        def status():
            d.get(base + f"/teams/{team}/bursts")
            for tr in d.find_elements(By.CSS_SELECTOR, "#bursts tbody tr"):
                if tr.find_element(By.CSS_SELECTOR, "td").text == rid:
                    return tr.find_element(By.CSS_SELECTOR, "td.status").text
            return None

        assert status() == "pending"
        before = sink.stats.rows.get("decisions", 0)
        pump(sink, lambda: sink.stats.rows.get("decisions", 0) > before, 120, worker)
        reader.refresh()
        assert status() in ("approved", "partial", "denied")
    finally:
        srv.should_exit = True
