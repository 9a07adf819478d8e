"""Who sent a record (streams/principals.py) without a broker: signatures, the registry, the role check before the
sequencer, the sequencer's bound on a missing or forged predecessor, and the log export line."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from types import SimpleNamespace

import orjson
import pytest

from schemas import topic_for
from schemas.codes import RejectionCode as RC
from streams.principals import HEADER_PRINCIPAL, HEADER_SIG, Accepted, Registry, RegistryError, sign
from streams.producer import LedgerProducer, canonical_value, validate
from streams.sequencer import (HEADER_PREV, HEADER_PRODUCER, HEADER_SEQ, TP, SeqState, Sequencer, Stamp,
                               key_partition, unpack_batch)

EAST, WEST = "us-east1-a/h100-80gb", "eu-west4-b/a100"


def ev(etype: str, pool: str = EAST, i: int = 1, **fields) -> bytes:
    base = {"event_id": f"{etype}-{i}", "type": etype, "occurred_at": "2026-11-02T00:00:00Z", "pool": pool,
            "source": "x/y"}
    defaults = {"job.submitted": {"job_id": f"j{i}", "team": "t", "chips": 1, "priority": 1},
                "job.finished": {"job_id": f"j{i}", "outcome": "succeeded"},
                "chip.retired": {"chip_id": "c1"}, "pool.tick": {},
                "pool.configured": {"flavor": "h100", "chips_per_node": 8},
                "quota.granted": {"grant_id": "g", "team": "t", "chips": 64},
                "quota.revoked": {"grant_id": "g"},
                "price.set": {"price_id": "p", "per_chip_hour": 100, "unit": "USD-cent"},
                "budget.set": {"budget_id": "b", "team": "t", "period": "month", "amount": 5, "unit": "USD-cent"},
                "burst.requested": {"request_id": "r", "team": "t", "chips": 1,
                                    "window_start": "2026-11-02T01:00:00Z", "window_end": "2026-11-02T02:00:00Z"}}
    return canonical_value(validate({**base, **defaults.get(etype, {}), **fields}))


@pytest.fixture
def registry(tmp_path):
    reg = Registry(path=tmp_path / "principals.json")
    reg.put("admins", ["admin"])
    reg.put("slurm-east", ["cluster"], ["us-east1-a"])
    reg.put("kueue-east", ["cluster"], ["us-east1-a"], ["quota", "pools"])
    reg.put("portal", ["portal"], ["us-east1-a", "eu-west4-b"])
    reg.put("chipledger-worker", ["worker"])
    reg.save()
    return reg


def signed(reg: Registry, who: str, value: bytes, pool: str = EAST, stamp=(b"p", b"1", b"0")):
    headers = [(HEADER_PRODUCER, stamp[0]), (HEADER_SEQ, stamp[1]), (HEADER_PREV, stamp[2])]
    return headers + [(HEADER_PRINCIPAL, who.encode()), (HEADER_SIG, sign(reg.entries[who].key, pool.encode(), value,
                                                                             headers))]


def test_a_signed_record_of_its_own_role_and_cluster_is_accepted_with_its_origin(registry):
    v = ev("job.submitted")
    assert registry.verify(EAST.encode(), v, signed(registry, "slurm-east", v)) == Accepted("slurm-east", "us-east1-a")
    q = ev("quota.granted")
    assert registry.verify(EAST.encode(), q, signed(registry, "admins", q)) == Accepted("admins", "*")
    t = ev("pool.tick")
    assert registry.verify(EAST.encode(), t, signed(registry, "chipledger-worker", t)) == Accepted(
        "chipledger-worker", "*")


def test_unsigned_unknown_and_badly_signed_records_are_bad_signature(registry, tmp_path):
    v = ev("job.submitted")
    good = signed(registry, "slurm-east", v)
    assert registry.verify(EAST.encode(), v, good[:3]).code == RC.bad_signature  # no signature
    other = Registry()
    other.put("slurm-east", ["cluster"], ["us-east1-a"])  # the same name, another key
    assert registry.verify(EAST.encode(), v, signed(other, "slurm-east", v)).code == RC.bad_signature
    forged_name = good[:3] + [(HEADER_PRINCIPAL, b"admins"), good[4]]  # someone else's name on one's own signature
    assert registry.verify(EAST.encode(), v, forged_name).code == RC.bad_signature
    assert registry.verify(EAST.encode(), v, good[:3] + [(HEADER_PRINCIPAL, b"nobody"), good[4]]).code == \
        RC.bad_signature
    # what a signature covers: the value, the key and the sequencer headers
    assert registry.verify(EAST.encode(), v.replace(b'"chips":1', b'"chips":9'), good).code == RC.bad_signature
    assert registry.verify(WEST.encode(), v, good).code == RC.bad_signature
    moved = [(HEADER_PRODUCER, b"p"), (HEADER_SEQ, b"1"), (HEADER_PREV, b"7")] + good[3:]  # a forged predecessor
    assert registry.verify(EAST.encode(), v, moved).code == RC.bad_signature


def test_each_admin_type_from_a_cluster_principal_is_wrong_role_and_another_clusters_pool_not_owner(registry):
    for etype in ("quota.granted", "quota.revoked", "pool.configured", "price.set", "budget.set", "burst.requested"):
        v = ev(etype)
        got = registry.verify(EAST.encode(), v, signed(registry, "slurm-east", v))
        assert got.code == RC.wrong_role, etype
    for etype in ("job.submitted", "chip.retired"):  # and an admin sends no job or chip event
        v = ev(etype)
        assert registry.verify(EAST.encode(), v, signed(registry, "admins", v)).code == RC.wrong_role
    # --may quota / pools: those types, for its own cluster only
    for etype in ("quota.granted", "pool.configured"):
        v = ev(etype)
        assert isinstance(registry.verify(EAST.encode(), v, signed(registry, "kueue-east", v)), Accepted)
        w = ev(etype, WEST)
        assert registry.verify(WEST.encode(), w, signed(registry, "kueue-east", w, WEST)).code == RC.not_owner
    assert registry.verify(EAST.encode(), ev("price.set"), signed(registry, "kueue-east", ev("price.set"))).code == \
        RC.wrong_role
    w = ev("job.finished", WEST)
    assert registry.verify(WEST.encode(), w, signed(registry, "slurm-east", w, WEST)).code == RC.not_owner


def test_the_registry_file_is_0600_read_again_when_it_changes_and_a_removed_principal_is_refused(registry):
    assert (os.stat(registry.path).st_mode & 0o777) == 0o600
    worker_view = Registry.load(registry.path)
    v = ev("job.submitted")
    headers = signed(registry, "slurm-east", v)
    assert isinstance(worker_view.verify(EAST.encode(), v, headers), Accepted)
    assert not worker_view.reload()  # unchanged
    registry.remove("slurm-east")
    registry.save()
    assert worker_view.reload()
    assert worker_view.verify(EAST.encode(), v, headers).code == RC.bad_signature
    with pytest.raises(RegistryError, match="give --cluster"):
        Registry().put("c", ["cluster"])
    with pytest.raises(RegistryError, match="does not exist"):
        Registry.load(registry.path.with_name("missing.json"))


def test_the_producer_signs_what_the_worker_verifies(registry, tmp_path):
    from streams.clients import KafkaConnection

    sent = []

    class Client:
        def send(self, topic, value, key, headers, timestamp_ms):
            sent.append((topic, key, value, headers))

    conn = KafkaConnection(username="slurm-east", signing_key=registry.entries["slurm-east"].key.hex())
    p = LedgerProducer(conn, client=Client())
    for i in range(3):
        p.send(ev("job.submitted", i=i))
    assert all(isinstance(registry.verify(k, v, h), Accepted) for _, k, v, h in sent)
    unsigned = LedgerProducer("127.0.0.1:1", client=Client())
    unsigned.send(ev("job.submitted", i=9))
    assert registry.verify(sent[-1][1], sent[-1][2], sent[-1][3]).code == RC.bad_signature


def test_the_sequencer_stage_dead_letters_refused_records_with_their_bytes_and_logs_who_sent_the_rest(registry):
    from streams.worker import SequencerStage, WorkerSettings

    sent = []

    async def send(topic, key, value, headers=None):
        sent.append((topic, key, value, dict(headers or [])))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    stage = SequencerStage(WorkerSettings(checkpoint_interval_ms=0, partitions=3, principals=registry),
                           load=lambda pool, e: None, store=lambda pool, v, e: None, send=send,
                           caught_up=lambda tp: True)
    part = key_partition(EAST.encode(), 3)
    offsets = Counter()
    records = [("slurm-east", ev("job.submitted", i=1)), ("slurm-east", ev("quota.granted")),
               (None, ev("job.submitted", i=2)), ("admins", ev("pool.configured"))]
    for n, (who, v) in enumerate(records, 1):
        topic = topic_for(orjson.loads(v)["type"])
        headers = signed(registry, who, v, stamp=(b"p", str(n).encode(), b"0")) if who else []
        m = SimpleNamespace(topic=topic, partition=part, offset=offsets[topic], key=EAST.encode(), value=v,
                            timestamp=1_800_000_000.0, timestamp_type=1, headers=headers)
        offsets[topic] += 1
        stage.receive(SimpleNamespace(message=m, ack=lambda: None))

    async def go():
        await stage.drain()
        await stage.settle()
    asyncio.run(go())
    logged = [e for t, _, v, h in sent if t == "chipledger.log" for e in unpack_batch(v)]
    assert sorted((e.value, e.principal, e.origin, e.appended_ms) for e in logged) == sorted([
        (records[0][1], "slurm-east", "us-east1-a", 1_800_000_000_000),
        (records[3][1], "admins", "*", 1_800_000_000_000)])
    rows = [r for t, _, v, _ in sent if t == "chipledger.deadletter"
            for it in orjson.loads(v)["items"] for r in it["tables"]["deadletters"]]
    import base64

    assert sorted((r[4], base64.b64decode(r[9])) for r in rows) == sorted([
        ("wrong_role", records[1][1]), ("bad_signature", records[2][1])])


def test_a_missing_predecessor_holds_other_producers_records_for_block_ms_only():
    seq = Sequencer(wait_ms=60_000, block_ms=2_000)
    tp = TP("chipledger.jobs", 0)
    state = SeqState()
    seq.push("c/p", tp, 0, Stamp("forger/x", 5, 4), 0.0, "forged")  # its predecessor 4 never comes
    seq.push("c/p", tp, 1, Stamp("honest/y", 1, 0), 0.0, "honest")
    assert seq.release("c/p", state, 1.0) == []
    got = seq.release("c/p", state, 2.5)
    assert [(r.item, r.note) for r in got] == [("forged", "forced"), ("honest", None)]
    # alone (only its own producer's records behind it), it waits the full wait_ms
    seq.push("c/q", tp, 2, Stamp("forger/x", 9, 8), 10.0, "own-1")
    seq.push("c/q", tp, 3, Stamp("forger/x", 10, 9), 10.0, "own-2")
    assert seq.release("c/q", SeqState(), 30.0) == []
    assert [r.item for r in seq.release("c/q", SeqState(), 70.0)] == ["own-1", "own-2"]


def test_log_export_writes_the_append_time_and_origin_the_worker_logged():
    import io

    from streams import logline
    from streams.log import export_records
    from streams.sequencer import BATCH_FORMAT, HEADER_BATCH, Entry, pack_batch

    a, b = ev("job.submitted", i=1), ev("job.submitted", i=2)
    value = pack_batch([Entry("chipledger.jobs", 0, 7, 1, a, 1_800_000_000_123, "slurm-east", "us-east1-a"),
                        Entry("chipledger.jobs", 0, 8, 1, b)])  # a record of a topic with producer times
    rec = SimpleNamespace(key=EAST.encode(), value=value, headers=[(HEADER_BATCH, BATCH_FORMAT)])
    out = io.BytesIO()
    export_records([rec], out)
    first, second = out.getvalue().splitlines()
    assert logline.unwrap(first) == (a, "us-east1-a", 1_800_000_000)
    assert second == b  # nothing known: a plain line, as before


def test_a_principal_added_a_moment_ago_is_known_at_its_first_record(registry):
    """The worker looks at the registry file once a second; a record of a principal it does not know yet makes it
    look again at once, so a producer added just before it sends loses nothing."""
    from streams.worker import SequencerStage, WorkerSettings

    worker_view = Registry.load(registry.path)
    stage = SequencerStage(WorkerSettings(checkpoint_interval_ms=0, partitions=3, principals=worker_view,
                                          principals_reload_s=3600),
                           load=lambda pool, e: None, store=lambda pool, v, e: None, send=None,
                           caught_up=lambda tp: True)
    registry.put("kueue-new", ["cluster"], ["us-east1-a"])
    registry.save()
    v = ev("job.submitted")
    m = SimpleNamespace(topic="chipledger.jobs", partition=key_partition(EAST.encode(), 3), offset=0,
                        key=EAST.encode(), value=v, timestamp=1.0, timestamp_type=1,
                        headers=signed(registry, "kueue-new", v))
    stage.receive(SimpleNamespace(message=m, ack=lambda: None))
    assert stage.counts["refused"] == 0 and stage.seq.buffered == 1


def test_run_on_a_log_export_records_the_cluster_each_event_was_accepted_from(tmp_path):
    from analytics.views import connect
    from chipledger.embedded import run_file
    from streams import logline

    cfg = ev("pool.configured")
    job = ev("job.submitted", i=1)
    plain = ev("job.submitted", i=2)
    path = tmp_path / "export.jsonl"
    path.write_bytes(logline.wrap(cfg, 1_793_577_600_000, "*") + b"\n"
                     + logline.wrap(job, 1_793_577_600_000, "us-east1-a") + b"\n" + plain + b"\n")
    for events_process in (False, True):
        lake = tmp_path / f"lake-{events_process}"
        run_file(path, lake, events_process=events_process)
        got = dict(connect(lake).execute("SELECT event_id, accepted_from FROM base_event_log").fetchall())
        assert got == {"pool.configured-1": "*", "job.submitted-1": "us-east1-a", "job.submitted-2": None}


@pytest.mark.skipif(os.name != "posix", reason="file modes")
def test_a_registry_readable_by_others_is_refused_and_a_broken_edit_keeps_the_last_good_one_loudly(registry, caplog):
    """Review (medium): the registry holds every producer's signing key, yet the worker read it whatever its mode:
    made world-readable, every local user could sign as any principal. Like ssh with a private key, it is refused
    (at start; while running, the last good registry is kept and the worker says why)."""
    os.chmod(registry.path, 0o644)
    with pytest.raises(RegistryError, match="readable by other users"):
        Registry.load(registry.path)
    os.chmod(registry.path, 0o600)
    worker_view = Registry.load(registry.path)
    registry.remove("slurm-east")
    registry.save()
    os.chmod(registry.path, 0o640)
    with caplog.at_level("WARNING"):
        assert not worker_view.reload()
    assert "slurm-east" in worker_view.entries  # kept, and said
    assert "readable by other users" in caplog.text
    os.chmod(registry.path, 0o600)  # put right: read again
    assert worker_view.reload() and "slurm-east" not in worker_view.entries


def test_a_principal_cannot_take_a_place_in_the_order_of_a_principal_named_like_a_prefix_of_it(tmp_path):
    """Review (low): producer ids were namespaced as PRINCIPAL/PRODUCER, so principal `east` sending producer
    `p/q` shared the order of principal `east/p`'s producer `q`: a forged missing predecessor then held east/p's
    records back for the full sequencer_wait_ms (as its own producer's), not the short block."""
    from streams.worker import SequencerStage, WorkerSettings

    reg = Registry(path=tmp_path / "principals.json")
    reg.put("east", ["cluster"], ["us-east1-a"])
    reg.put("east/p", ["cluster"], ["us-east1-a"])
    reg.save()
    sent, now = [], [0.0]

    async def send(topic, key, value, headers=None):
        sent.append((topic, value))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    stage = SequencerStage(WorkerSettings(checkpoint_interval_ms=0, partitions=3, principals=reg,
                                          sequencer_wait_ms=60_000, sequencer_block_ms=2_000),
                           load=lambda pool, e: None, store=lambda pool, v, e: None, send=send,
                           caught_up=lambda tp: True, clock=lambda: now[0])
    part = key_partition(EAST.encode(), 3)
    records = [("east", ev("job.submitted", i=1), (b"p/q", b"5", b"4")),  # its predecessor 4 never comes
               ("east/p", ev("job.submitted", i=2), (b"q", b"1", b"0"))]
    for off, (who, v, stamp) in enumerate(records):
        m = SimpleNamespace(topic="chipledger.jobs", partition=part, offset=off, key=EAST.encode(), value=v,
                            timestamp=1_800_000_000.0, timestamp_type=1, headers=signed(reg, who, v, stamp=stamp))
        stage.receive(SimpleNamespace(message=m, ack=lambda: None))

    async def go(at):
        now[0] = at
        await stage.drain()
        await stage.settle()
    asyncio.run(go(3.0))  # past the block: the honest record of another principal is not held for the full wait
    logged = [e.value for t, v in sent if t == "chipledger.log" for e in unpack_batch(v)]
    assert records[1][1] in logged


def test_a_portal_burst_request_names_who_asked(registry):
    """Review (medium): DESIGN §3 gives the portal `burst.requested` "with requested_by" (the signed-in member),
    but the worker accepted the portal principal's requests without it: a portal credential could ask bursts for
    any team of its clusters in no one's name. An admin's request needs no requested_by."""
    anonymous = ev("burst.requested")
    named = ev("burst.requested", requested_by="alice")
    assert registry.verify(EAST.encode(), anonymous, signed(registry, "portal", anonymous)).code == RC.wrong_role
    assert isinstance(registry.verify(EAST.encode(), named, signed(registry, "portal", named)), Accepted)
    assert isinstance(registry.verify(EAST.encode(), anonymous, signed(registry, "admins", anonymous)), Accepted)
