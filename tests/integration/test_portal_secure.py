"""The portal's burst request on the secure broker, signed as the `portal` principal (DESIGN §3): the worker, which
checks every input record against the principals registry, applies it and decides it; the same request signed with
another key is a dead letter. Reuses tests/integration/test_kafka_trust.py's secure broker and worker."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_kafka_trust import EAST, event, trust, wait_for  # noqa: E402,F401  (trust: the module's fixture)

pytestmark = pytest.mark.kafka


def test_portal_burst_request_signed_as_portal_is_applied_and_decided(trust, tmp_path):
    from chipledger.web.app import Portal, build_app
    from chipledger.web.auth import TokenCache, new_token
    from chipledger.web.lake import LakeReader
    from store.repo import open_store
    from streams.clients import KafkaConnection, read_password_file
    from streams.producer import LedgerProducer
    from tests.web_support import portal_config

    pool = f"{EAST}/portal-h100"
    trust.send("admin", "chipledger.quota", event("pool.configured", pool, "portal-pool-1"), pool)
    trust.send("admin", "chipledger.quota", event("quota.granted", pool, "portal-grant-1", team="t",
                                                  grant_id="portal-g"), pool)
    trust.add("portal", "--role", "portal", "--cluster", EAST)

    def connection(signing_key: bytes) -> KafkaConnection:
        return KafkaConnection(bootstrap=trust.info["bootstrap_servers"], security_protocol="SASL_PLAINTEXT",
                               username="portal", password=read_password_file(trust.tmp / "portal.password"),
                               signing_key=signing_key.hex())

    st = open_store(f"sqlite:///{tmp_path / 'store.db'}")
    _, token = new_token(st, "alice", "t")
    h = {"Authorization": f"Bearer {token}"}
    body = {"pool": pool, "team": "t", "chips": 1, "window_start": "2027-01-01T00:00:00Z",
            "window_end": "2027-01-01T04:00:00Z", "reason": "signed"}

    def submit(signing_key: bytes) -> dict:
        portal = Portal(cfg=portal_config(), reader=LakeReader(tmp_path / "no-lake"), store=st,
                        tokens=TokenCache(st, ttl_s=0),
                        producer_factory=lambda: LedgerProducer(connection(signing_key)))
        r = TestClient(build_app(portal)).post("/api/v1/bursts", json=body, headers=h)
        assert r.status_code == 202, r.text
        return r.json()

    good = submit(trust.keys["portal"])
    wait_for(lambda: good["event_id"] in trust.applied(), 120, trust)
    decided = wait_for(lambda: [r for r in trust.read("chipledger.decisions", 3)
                                if good["request_id"].encode() in r.value], 60, trust)
    assert decided
    assert good["event_id"] not in trust.dead_letters()

    forged = submit(bytes(32))  # the portal's name, another key: refused
    code = wait_for(lambda: trust.dead_letters().get(forged["event_id"], (None,))[0], 120, trust)
    assert code == "bad_signature"
    assert forged["event_id"] not in trust.applied()
