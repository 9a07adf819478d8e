"""Trust boundaries on the real secure broker (issue 31): a producer speaks only for its own role and its own pools,
records are known by their signature, a forged predecessor holds back only its own producer, and the worker's
consumer-group names are the worker role's.

One broker for the module, started as a user would (`chipledger kafka up`: secure by default; `--no-tls` here, the
TLS listener has its own module), and one worker (`--sequencer-wait-ms 60000`) checking every record against the
broker's principals registry. The producers below are plain kafka-python producers that sign as the SDK does, so
they can put any type on any topic (the SDK picks the topic from the type)."""

from __future__ import annotations

import base64
import json
import os
import sys
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chipledger.cli import app  # noqa: E402
from kafka_support import check_prerequisites, free_port  # noqa: E402
from pipeline_support import WorkerProcess  # noqa: E402
from schemas import INPUT_TOPICS  # noqa: E402
from streams import broker  # noqa: E402
from streams.acl import local_connection  # noqa: E402
from streams.clients import KafkaConnection, read_password_file  # noqa: E402
from streams.principals import HEADER_PRINCIPAL, HEADER_SIG, read_key_file, sign  # noqa: E402
from streams.sequencer import HEADER_PREV, HEADER_PRODUCER, HEADER_SEQ, batch_format, unpack_batch  # noqa: E402
from streams.topics import create_topics  # noqa: E402

pytestmark = pytest.mark.kafka

EAST, WEST = "us-east1-a", "eu-west4-b"
ADMIN_TYPES = ("quota.granted", "quota.revoked", "pool.configured", "price.set", "budget.set", "burst.requested")
WAIT_MS = 60_000


def event(etype: str, pool: str, event_id: str, occurred_at: str = "2026-11-02T00:00:00Z", **fields) -> bytes:
    base = {"event_id": event_id, "type": etype, "occurred_at": occurred_at, "pool": pool, "source": "probe/x"}
    defaults = {"job.submitted": {"job_id": event_id, "team": "t", "chips": 1, "priority": 1},
                "job.started": {"job_id": fields.get("job_id", event_id)},
                "job.finished": {"job_id": fields.get("job_id", event_id), "outcome": "succeeded"},
                "pool.tick": {}, "pool.configured": {"flavor": "h100", "chips_per_node": 8},
                "chip.registered": {"chip_id": "c1", "node": "n1"},
                "quota.granted": {"grant_id": "g", "team": "t", "chips": 64}, "quota.revoked": {"grant_id": "g"},
                "price.set": {"price_id": "p", "per_chip_hour": 100, "unit": "USD-cent"},
                "budget.set": {"budget_id": "b", "team": "t", "period": "month", "amount": 5, "unit": "USD-cent"},
                "burst.requested": {"request_id": "r", "team": "t", "chips": 1,
                                    "window_start": "2026-11-02T01:00:00Z", "window_end": "2026-11-02T02:00:00Z"}}
    return json.dumps({**base, **defaults.get(etype, {}), **fields}, separators=(",", ":")).encode()


class Trust:
    def __init__(self, info, data_dir: Path, tmp: Path):
        self.info, self.data_dir, self.tmp = info, data_dir, tmp
        self.secrets = Path(info["secrets_dir"])
        self.keys: dict[str, bytes] = {}
        self.producers = {}

    def conn(self, user: str) -> KafkaConnection:
        if (self.secrets / f"{user}.password").is_file():
            return local_connection(self.info, user)
        return KafkaConnection(bootstrap=self.info["bootstrap_servers"], security_protocol="SASL_PLAINTEXT",
                               username=user, password=read_password_file(self.tmp / f"{user}.password"))

    def add(self, name: str, *args: str) -> None:
        res = CliRunner().invoke(app, ["kafka", "users", "add", name, *args, "--new-password-file",
                                       str(self.tmp / f"{name}.password"), "--data-dir", str(self.data_dir)])
        assert res.exit_code == 0, res.output
        self.keys[name] = read_key_file(self.tmp / f"{name}.key")

    def producer(self, user: str):
        from kafka import KafkaProducer

        if user not in self.producers:
            self.producers[user] = KafkaProducer(**self.conn(user).kafka_python(), acks="all", max_block_ms=10_000,
                                                 bootstrap_timeout_ms=10_000, retries=0, delivery_timeout_ms=10_000,
                                                 request_timeout_ms=8_000)
        return self.producers[user]

    def send(self, user: str, topic: str, value: bytes, pool: str, *, signer: str | None = "self",
             stamp=(b"", b"", b""), key: bytes | None = None):
        """Send `value` as `user`, signed by `signer` (None: unsigned; "self": the user's own key)."""
        headers = []
        if stamp[0]:
            headers = [(HEADER_PRODUCER, stamp[0]), (HEADER_SEQ, stamp[1]), (HEADER_PREV, stamp[2])]
        who = user if signer == "self" else signer
        if who is not None:
            signing_key = key or self.keys.get(who) or read_key_file(self.secrets / f"{who}.key")
            headers += [(HEADER_PRINCIPAL, who.encode()), (HEADER_SIG, sign(signing_key, pool.encode(), value,
                                                                             headers))]
        return self.producer(user).send(topic, key=pool.encode(), value=value, headers=headers).get(10)

    def read(self, topic: str, timeout_s: float = 5.0) -> list:
        from kafka import KafkaConsumer

        c = KafkaConsumer(topic, **local_connection(self.info).kafka_python(), group_id=None,
                          auto_offset_reset="earliest", consumer_timeout_ms=int(timeout_s * 1000))
        try:
            return list(c)
        finally:
            c.close()

    def dead_letter_rows(self) -> list[tuple[str, str, bytes]]:
        """(event_id, code, raw bytes) of every dead letter so far."""
        out = []
        for r in self.read("chipledger.deadletter", 3):
            for item in json.loads(r.value).get("items", []):
                for row in item["tables"].get("deadletters", []):
                    out.append((row[6], row[4], base64.b64decode(row[9])))
        return out

    def dead_letters(self) -> dict[str, tuple[str, bytes]]:
        """event_id -> (code, raw bytes) of the dead letters so far (the last one of an id)."""
        return {eid: (code, raw) for eid, code, raw in self.dead_letter_rows()}

    def applied_rows(self) -> dict[str, list]:
        """event id -> its `events` row, of the events the fold applied (on chipledger.journal)."""
        out = {}
        for r in self.read("chipledger.journal", 3):
            d = json.loads(r.value)
            for item in d.get("items", []) if isinstance(d, dict) else []:
                out.update({row[0]: row for row in item.get("tables", {}).get("events", [])})
        return out

    def applied(self) -> set[str]:
        return set(self.applied_rows())

    def logged(self) -> list:
        out = []
        for r in self.read("chipledger.log", 3):
            fmt = batch_format(r.headers)
            if fmt is not None:
                out += [(r.timestamp, e) for e in unpack_batch(r.value, fmt)]
        return out


@pytest.fixture(scope="module")
def trust(tmp_path_factory):
    check_prerequisites()
    broker.ensure_jars()
    tmp = tmp_path_factory.mktemp("kafka-trust")
    data_dir = tmp / "kafka"
    res = CliRunner().invoke(app, ["kafka", "up", "--no-tls", "--port", str(free_port()), "--data-dir",
                                   str(data_dir), "--timeout", "180"])
    if res.exit_code != 0:
        if broker.status(data_dir):
            broker.down(data_dir)
        pytest.fail(f"kafka up failed: {res.output}", pytrace=False)
    worker = None
    try:
        info = broker.status(data_dir)
        assert info["security_protocol"] == "SASL_PLAINTEXT" and "principals.json" in res.output
        secrets = Path(info["secrets_dir"])
        assert all((f.stat().st_mode & 0o077) == 0 for f in secrets.iterdir())
        assert {"admin.key", "cluster.key", "worker.key", "principals.json"} <= {f.name for f in secrets.iterdir()}
        created = create_topics(local_connection(info), partitions=3, timeout_s=60)
        assert set(created) >= set(INPUT_TOPICS)
        t = Trust(info, data_dir, tmp)
        t.add("slurm-east", "--role", "cluster", "--cluster", EAST)
        t.add("slurm-west", "--role", "cluster", "--cluster", WEST)
        env = {"CHIPLEDGER_KAFKA_USERNAME": "worker",
               "CHIPLEDGER_KAFKA_PASSWORD_FILE": str(secrets / "worker.password"),
               "CHIPLEDGER_KAFKA_PRINCIPALS_FILE": str(secrets / "principals.json")}
        os.environ.update(env)
        try:
            worker = WorkerProcess(info["bootstrap_servers"], tmp / "worker", tmp / "worker.log", "--tick-interval",
                                   "0", "--table-store", "memory", "--sequencer-wait-ms", str(WAIT_MS),
                                   app_id=f"chipledger-worker-{uuid.uuid4().hex[:6]}", clock_skew_s=None).start()
        finally:
            for k in env:
                os.environ.pop(k, None)
        t.worker = worker
        yield t
        for p in t.producers.values():
            p.close(2)
    finally:
        if worker is not None:
            worker.stop()
        broker.down(data_dir, timeout_s=30)


def wait_for(what, timeout_s: float, trust: Trust, ok=bool):
    """What `what()` returns once `ok` of it is true (checked every second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = what()
        if ok(got):
            return got
        if not trust.worker.alive():
            raise AssertionError(f"the worker exited:\n{trust.worker.tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout_s}s; worker log:\n{trust.worker.tail()}")
        time.sleep(1)


def test_a_cluster_principal_sending_admin_types_on_each_input_topic_is_refused(trust):
    """Refused by the broker on chipledger.quota (ACL), dead-lettered as wrong_role on jobs and chips."""
    from kafka.errors import KafkaError

    pool = f"{EAST}/roles"
    sent = {}
    for topic in INPUT_TOPICS:
        for etype in ADMIN_TYPES:
            eid = f"role-{topic.split('.')[-1]}-{etype}"
            value = event(etype, pool, eid)
            if topic == "chipledger.quota":
                with pytest.raises(KafkaError, match="TopicAuthorization"):
                    trust.send("slurm-east", topic, value, pool)
                trust.producers.pop("slurm-east").close(2)  # a refused write leaves the producer failed
                continue
            trust.send("slurm-east", topic, value, pool)
            sent[eid] = value
    # and an admin's job and chip events are not the admin's to send
    for etype in ("job.submitted", "chip.registered"):
        eid = f"role-admin-{etype}"
        sent[eid] = event(etype, pool, eid)
        trust.send("admin", "chipledger.quota", sent[eid], pool)
    dl = wait_for(trust.dead_letters, 120, trust, lambda d: all(e in d for e in sent))
    assert {eid: dl[eid] for eid in sent} == {eid: ("wrong_role", v) for eid, v in sent.items()}


def test_a_principal_of_one_cluster_cannot_act_on_another_clusters_pools_nor_squat_its_ids(trust):
    pool = f"{WEST}/h100"
    trust.send("admin", "chipledger.quota", event("pool.configured", pool, "sq-cfg"), pool)
    # the east principal claims the id of the west cluster's next job first, then marks one of its chips
    squat = event("job.submitted", pool, "sq-job", team="someone-else", chips=64)
    trust.send("slurm-east", "chipledger.jobs", squat, pool)
    chip = event("chip.registered", pool, "sq-chip")
    trust.send("slurm-east", "chipledger.chips", chip, pool)
    real = event("job.submitted", pool, "sq-job")
    trust.send("slurm-west", "chipledger.jobs", real, pool)
    rows = wait_for(trust.dead_letter_rows, 120, trust, lambda d: {"sq-chip", "sq-job"} <= {r[0] for r in d})
    assert [code for _, code, raw in rows if raw == squat] == ["not_owner"]
    assert [code for _, code, raw in rows if raw == chip] == ["not_owner"]
    assert not [code for _, code, raw in rows if raw == real]  # the real job is not a duplicate_conflict
    logged = wait_for(lambda: [e for _, e in trust.logged() if e.value == real], 60, trust)
    assert logged[0].principal == "slurm-west" and logged[0].origin == WEST
    assert not [e for _, e in trust.logged() if e.value == squat]  # never in the log
    # the events table says, for audit, which cluster each event was accepted from
    rows = wait_for(trust.applied_rows, 60, trust, lambda got: {"sq-cfg", "sq-job"} <= set(got))
    assert rows["sq-job"][-1] == WEST and rows["sq-cfg"][-1] == "*"  # the admin speaks for every cluster


def test_unsigned_and_badly_signed_records_are_dead_letters_with_their_bytes(trust):
    pool = f"{EAST}/sig"
    unsigned = event("job.submitted", pool, "sig-unsigned")
    trust.send("slurm-east", "chipledger.jobs", unsigned, pool, signer=None)
    other_key = event("job.submitted", pool, "sig-other-key")
    trust.send("slurm-east", "chipledger.jobs", other_key, pool, key=bytes(32))
    as_admin = event("job.submitted", pool, "sig-as-admin")  # claims to be the admin, signed with its own key
    trust.send("slurm-east", "chipledger.jobs", as_admin, pool, signer="admin", key=trust.keys["slurm-east"])
    want = {"sig-unsigned": unsigned, "sig-other-key": other_key, "sig-as-admin": as_admin}
    dl = wait_for(trust.dead_letters, 120, trust, lambda d: all(e in d for e in want))
    assert {e: dl[e] for e in want} == {e: ("bad_signature", v) for e, v in want.items()}


def test_a_forged_predecessor_holds_back_only_its_own_producer(trust):
    """With sequencer_wait_ms 60 s, a signed record naming a predecessor never sent no longer holds the pool's other
    producers' records behind it for the full wait (issue 31: 63 s instead of 2 s): they reach the log within the
    block bound (2 s), the input topics caught up."""
    pool = f"{EAST}/fwd"
    forged = event("job.submitted", pool, "fwd-forged")
    t0 = time.monotonic()
    trust.send("slurm-east", "chipledger.jobs", forged, pool, stamp=(b"forger", b"5", b"4"))
    honest = [event("job.submitted", pool, f"fwd-honest-{i}") for i in range(3)]
    for i, v in enumerate(honest, 1):
        trust.send("cluster", "chipledger.jobs", v, pool, stamp=(b"honest", str(i).encode(), str(i - 1).encode()))
    logged = wait_for(lambda: {e.value for _, e in trust.logged()}, WAIT_MS / 1000, trust,
                      lambda got: got >= set(honest))
    took = time.monotonic() - t0
    assert took < WAIT_MS / 1000 / 2, f"the honest records reached the log after {took:.1f} s"
    assert forged in logged  # released once it held others back for the block bound (forced: its own order suffers)
    # (the pool was never configured: the fold dead-letters all four as unknown_pool, after the log)
    assert trust.dead_letters().get("fwd-forged", ("",))[0] != "bad_signature"
    print(f"honest records in the log {took:.1f} s after the forged one was sent (sequencer_wait_ms {WAIT_MS})")
    assert "forced" in trust.worker.log.read_text()


def test_an_event_days_ahead_is_clock_ahead_and_later_honest_events_apply(trust):
    """Needs the core's clock_ahead against the append time (branch contract); skipped before it is merged."""
    from ledger.fold import FoldConfig, evolve
    from schemas import parse_event

    cfg = parse_event(event("pool.configured", "probe/x", "probe-cfg", occurred_at="2030-01-01T00:00:00Z"))
    _, step = evolve(None, cfg, FoldConfig(), None, origin="probe", appended_s=0)
    if step.rejection is None or step.rejection.code.value != "clock_ahead":
        pytest.skip("the core does not check clock_ahead yet (issue 31's core change is not merged)")
    pool = f"{EAST}/clock"
    now = time.time()
    iso = lambda s: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s))  # noqa: E731
    trust.send("admin", "chipledger.quota", event("pool.configured", pool, "clk-cfg", occurred_at=iso(now - 60)), pool)
    ahead = event("pool.tick", pool, "clk-ahead", occurred_at=iso(now + 3 * 86400))
    trust.send("slurm-east", "chipledger.jobs", ahead, pool)
    trust.send("slurm-east", "chipledger.jobs", event("job.submitted", pool, "clk-job", occurred_at=iso(now)), pool)
    later = event("pool.tick", pool, "clk-later", occurred_at=iso(now + 60))
    trust.send("slurm-east", "chipledger.jobs", later, pool)
    dl = wait_for(trust.dead_letters, 120, trust, lambda d: "clk-ahead" in d)
    assert dl["clk-ahead"] == ("clock_ahead", ahead)
    # the honest events after it are applied (not too_late: the pool clock did not move three days)
    applied = wait_for(trust.applied, 60, trust, lambda got: {"clk-cfg", "clk-job", "clk-later"} <= got)
    assert "clk-ahead" not in applied and "clk-job" not in dl and "clk-later" not in dl


def test_a_reader_cannot_be_named_like_a_workers_consumer_group(trust):
    for name in ("chipledger-worker-eu", "chipledger-worker"):
        res = CliRunner().invoke(app, ["kafka", "users", "add", name, "--role", "reader", "--new-password-file",
                                       str(trust.tmp / f"{name}.password"), "--data-dir", str(trust.data_dir)])
        assert res.exit_code == 2 and "would own the worker's consumer group" in res.output, res.output
    res = CliRunner().invoke(app, ["kafka", "users", "add", "w2", "--role", "worker", "--app-id", "other",
                                   "--new-password-file", str(trust.tmp / "w2.password"),
                                   "--data-dir", str(trust.data_dir)])
    assert res.exit_code == 2 and "must start with 'chipledger-worker'" in res.output, res.output


def test_a_removed_principal_s_records_are_refused_even_from_its_open_connection(trust):
    """`kafka users remove`: the worker refuses what the principal signs from its next look at the registry (1 s);
    a producer connected before keeps its connection until it reconnects, and what it appends then never counts."""
    from kafka.errors import KafkaError

    pool = f"{EAST}/revoked"
    trust.add("slurm-gone", "--role", "cluster", "--cluster", EAST)
    before = event("job.submitted", pool, "rv-before")
    trust.send("slurm-gone", "chipledger.jobs", before, pool)  # connected and accepted
    wait_for(lambda: [e for _, e in trust.logged() if e.value == before], 60, trust)
    res = CliRunner().invoke(app, ["kafka", "users", "remove", "slurm-gone", "--data-dir", str(trust.data_dir)])
    assert res.exit_code == 0 and "removed" in res.output, res.output
    time.sleep(2)  # the worker's next look at the registry
    after = event("job.submitted", pool, "rv-after")
    try:
        trust.send("slurm-gone", "chipledger.jobs", after, pool)  # its open connection may still append
    except KafkaError:
        return  # the connection was closed already: nothing appended
    dl = wait_for(trust.dead_letters, 60, trust, lambda d: "rv-after" in d)
    assert dl["rv-after"] == ("bad_signature", after)
    assert not [e for _, e in trust.logged() if e.value == after]
