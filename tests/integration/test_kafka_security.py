"""A secure broker (`chipledger kafka up --secure`: SASL/SCRAM, the standard authorizer, the roles' ACLs) refuses
what each principal may not do, and the pipeline run by the admin, worker and sink principals gives the books of
`chipledger run`, with a forged output record dead-lettered and no password in any log, output or exception.

One broker for the module (started through the CLI, as a user would).
"""

from __future__ import annotations

import json
import logging
import os
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
from kafka_support import check_prerequisites, free_port  # noqa: E402
from store import open_store  # noqa: E402
from pipeline_support import WorkerProcess, lake_tables, pump  # noqa: E402
from schemas import INPUT_TOPICS, OUTPUT_TOPICS  # noqa: E402
from streams import broker  # noqa: E402
from streams.acl import LOG_TOPIC, local_connection  # noqa: E402
from streams.clients import KafkaConnection, read_password_file  # noqa: E402
from streams.sink import FORGED_ORIGIN, Sink  # noqa: E402
from streams.topics import KafkaSetupError, create_topics, describe_partitions  # noqa: E402

pytestmark = pytest.mark.kafka

PARSE_CODES = {"not_json", "unknown_type", "schema_invalid"}
ALL = tuple(INPUT_TOPICS) + (LOG_TOPIC,) + tuple(OUTPUT_TOPICS)
POOL = "us-east1-a/h100-80gb"


class Secure:
    """The module's broker: its info, the CLI outputs seen, and every password it made."""

    def __init__(self, info, data_dir: Path, outputs: list[str]):
        self.info, self.data_dir, self.outputs = info, data_dir, outputs
        self.secrets = Path(info["secrets_dir"])

    def conn(self, user=None, password_file=None) -> KafkaConnection:
        if password_file is None:
            return local_connection(self.info, user)
        return KafkaConnection(bootstrap=self.info["bootstrap_servers"], security_protocol="SASL_PLAINTEXT",
                               username=user, password=read_password_file(password_file))

    def env(self, user: str, password_file: Path | None = None) -> dict:
        return {"CHIPLEDGER_KAFKA_BOOTSTRAP": self.info["bootstrap_servers"], "CHIPLEDGER_KAFKA_USERNAME": user,
                "CHIPLEDGER_KAFKA_PASSWORD_FILE": str(password_file or self.secrets / f"{user}.password"),
                "CHIPLEDGER_KAFKA_PRINCIPALS_FILE": str(self.secrets / "principals.json")}

    def passwords(self) -> list[str]:
        files = list(self.secrets.glob("*.password")) + list(self.data_dir.parent.glob("*.password"))
        return [f.read_text().strip() for f in files]


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    check_prerequisites()
    broker.ensure_jars()
    data_dir = tmp_path_factory.mktemp("kafka-secure") / "kafka"
    port = free_port()
    runner = CliRunner()
    res = runner.invoke(app, ["kafka", "up", "--no-tls", "--port", str(port), "--data-dir", str(data_dir),
                              "--timeout", "180"])
    if res.exit_code != 0:
        if broker.status(data_dir):
            broker.down(data_dir)
        pytest.fail(f"kafka up --secure failed: {res.output}", pytrace=False)
    try:
        info = broker.status(data_dir)
        s = Secure(info, data_dir, [res.output])
        create_topics(s.conn(), partitions=3, timeout_s=60)  # with the sequencer's log
        yield s
    finally:  # also when the set-up fails: no broker left running
        broker.down(data_dir, timeout_s=30)


def _producer(conn: KafkaConnection):
    from kafka import KafkaProducer

    return KafkaProducer(**conn.kafka_python(), max_block_ms=8000, bootstrap_timeout_ms=8000, acks="all",
                         delivery_timeout_ms=8000, request_timeout_ms=5000, retries=0)


def _refused(conn: KafkaConnection, topics) -> dict[str, str]:
    """topic -> the error of a write to it (every one must fail)."""
    from kafka.errors import KafkaError

    out = {}
    p = _producer(conn)
    try:
        for topic in topics:
            try:
                p.send(topic, key=POOL.encode(), value=b'{"x":1}').get(10)
                out[topic] = "ACCEPTED"
            except KafkaError as exc:
                out[topic] = type(exc).__name__ + ": " + str(exc)
    finally:
        p.close(2)
    return out


def test_an_unauthenticated_client_cannot_connect(secure):
    with pytest.raises(KafkaSetupError, match="no Kafka broker answered"):
        describe_partitions(secure.info["bootstrap_servers"], timeout_s=5)
    res = CliRunner().invoke(app, ["emit", "--bootstrap", secure.info["bootstrap_servers"], "--timeout", "5",
                                   str(Path(__file__).parents[1] / "fixtures" / "hand.jsonl")],
                             env={"CHIPLEDGER_KAFKA_USERNAME": "", "CHIPLEDGER_KAFKA_PASSWORD_FILE": ""})
    assert res.exit_code == 2 and "no Kafka broker answered" in res.stderr
    # a known user with a wrong password neither
    bad = KafkaConnection(bootstrap=secure.info["bootstrap_servers"], security_protocol="SASL_PLAINTEXT",
                          username="cluster", password="not-the-password")
    with pytest.raises(KafkaSetupError) as info:
        describe_partitions(bad, timeout_s=5)
    assert "not-the-password" not in str(info.value)
    secure.outputs += [res.output, str(info.value)]


def test_a_cluster_principal_may_write_jobs_and_chips_only(secure):
    cluster = secure.conn("cluster")
    got = _refused(cluster, ("chipledger.quota", LOG_TOPIC, *OUTPUT_TOPICS))
    assert all("TopicAuthorizationFailed" in why for why in got.values()), got
    secure.outputs += list(got.values())
    p = _producer(cluster)
    for topic in ("chipledger.jobs", "chipledger.chips"):
        assert p.send(topic, key=POOL.encode(), value=b"{}").get(10).topic == topic
    p.close(2)


def test_a_team_reader_cannot_write_anything_and_can_read(secure, tmp_path):
    pw = tmp_path / "team-a.password"
    res = CliRunner().invoke(app, ["kafka", "users", "add", "team-a", "--role", "reader", "--new-password-file",
                                   str(pw), "--data-dir", str(secure.data_dir)])
    assert res.exit_code == 0, res.output
    assert "written to" in res.output and pw.read_text().strip() not in res.output
    assert (pw.stat().st_mode & 0o077) == 0
    reader = secure.conn("team-a", pw)
    got = _refused(reader, ALL)
    assert all("TopicAuthorizationFailed" in why for why in got.values()), got
    from kafka import KafkaConsumer

    c = KafkaConsumer(**reader.kafka_python(), group_id="team-a.statements", auto_offset_reset="earliest",
                      consumer_timeout_ms=3000)
    c.subscribe(["chipledger.jobs"])
    assert any(True for _ in c)  # the cluster test's record (read through its own group)
    c.close()
    listed = CliRunner().invoke(app, ["kafka", "users", "list", "--json", "--data-dir", str(secure.data_dir)])
    users = {u["name"]: u["roles"] for u in json.loads(listed.stdout)}
    assert users == {"admin": ["admin"], "cluster": ["cluster"], "worker": ["worker"], "sink": ["sink"],
                     "reader": ["reader"], "team-a": ["reader"]}
    # a reader may not manage users either
    denied = CliRunner().invoke(app, ["kafka", "users", "list", "--user", "team-a", "--password-file", str(pw),
                                      "--bootstrap", secure.info["bootstrap_servers"]])
    assert denied.exit_code == 2, denied.output
    removed = CliRunner().invoke(app, ["kafka", "users", "remove", "team-a", "--data-dir", str(secure.data_dir)])
    assert removed.exit_code == 0 and "removed" in removed.output
    with pytest.raises(KafkaSetupError):
        describe_partitions(reader, timeout_s=5)
    secure.outputs += [res.output, listed.output, denied.output, removed.output, *got.values()]


def test_admin_worker_and_sink_give_the_books_of_run_and_a_forged_record_is_dead_lettered(secure, tmp_path,
                                                                                          caplog):
    events = tmp_path / "fleet.jsonl"
    lines = list(corrupt(iter_jsonl(generate(seed=5, days=1, pools=2, teams=4)), seed=5, every=150))
    events.write_text("\n".join(lines) + "\n")
    runner = CliRunner()
    run = runner.invoke(app, ["run", "--events", str(events), "--lake", str(tmp_path / "run-lake"),
                              "--store", f"sqlite:///{tmp_path / 'run.db'}", "--json"])
    assert run.exit_code == 0, run.output
    summary = json.loads(run.stdout)

    # one producer for the whole file (its send order is the fold order): a user with both producer roles
    feeder_pw = tmp_path / "feeder.password"
    add = runner.invoke(app, ["kafka", "users", "add", "feeder", "--role", "admin", "--role", "cluster",
                              "--new-password-file", str(feeder_pw), "--data-dir", str(secure.data_dir)])
    assert add.exit_code == 0, add.output
    # the admin principal alone may write quota
    from streams.producer import LedgerProducer

    probe = {"event_id": "admin-probe", "type": "quota.granted", "occurred_at": "2026-11-02T00:00:00Z",
             "pool": "probe/none", "source": "admins", "grant_id": "g-probe", "team": "t", "chips": 1}
    with LedgerProducer(secure.conn("admin")) as p:
        assert p.send(probe).get(10).topic == "chipledger.quota"

    # the finding: a forged output record claiming origin offset 10^12 of a pool, ahead of the worker's rows
    # (on a secure broker only the worker may write outputs: the super user stands in for a stolen identity)
    forged_pool = POOL  # a pool of the scenario
    assert f'"pool":"{POOL}"' in events.read_text()
    p = _producer(secure.conn())
    forged = {"kind": "rows", "pool": forged_pool,
              "items": [{"origin": [topic, part, 10**12], "tables": {"journal": []}}
                        for topic in INPUT_TOPICS for part in range(3)]}
    p.send("chipledger.journal", key=forged_pool.encode(), value=json.dumps(forged).encode()).get(10)
    p.close(2)

    emitted = runner.invoke(app, ["emit", str(events), "--timeout", "30"], env=secure.env("feeder", feeder_pw))
    assert emitted.exit_code == 1, emitted.output  # some lines were invalid
    worker = WorkerProcess(secure.info["bootstrap_servers"], tmp_path / "worker", tmp_path / "worker.log",
                           "--tick-interval", "0", "--loglevel", "info",
                           app_id=f"chipledger-worker-{uuid.uuid4().hex[:6]}")
    os.environ.update(secure.env("worker"))  # the worker subprocess takes its credentials from the environment
    try:
        worker.start()
    finally:
        for k in secure.env("worker"):
            os.environ.pop(k, None)
    store = open_store(f"sqlite:///{tmp_path / 'sink.db'}")
    semantic = sum(n for code, n in summary["dead_letters"].items() if code not in PARSE_CODES)
    want_applied = {b.pool: b.applied for b in open_store(f"sqlite:///{tmp_path / 'run.db'}").pool_balances()}
    with caplog.at_level(logging.DEBUG):
        sink = Sink(tmp_path / "lake", store, bootstrap=secure.conn("sink"), name="sink")
        try:
            pump(sink, lambda: sink.stats.rows["events"] >= summary["accepted"]
                 and {b.pool: b.applied for b in store.pool_balances() if b.pool != "probe/none"} == want_applied
                 and sink.stats.rows["deadletters"] >= semantic + sink.stats.forged, 180, worker)
        finally:
            worker.stop()
            sink.close()
    assert sink.stats.forged == 9  # 3 input topics x 3 partitions, each beyond its end

    run_tables = lake_tables(tmp_path / "run-lake")
    got = lake_tables(tmp_path / "lake")
    # the admin's probe (a pool of its own) is the one event the run does not have
    probe_rows = Counter({r: n for r, n in got["events"].items() if r[0] == "admin-probe"})
    assert sum(probe_rows.values()) in (0, 1)
    assert got["events"] - probe_rows == run_tables["events"]
    assert got["journal"] == run_tables["journal"] and len(got["journal"]) > 100
    assert got["decisions"] == run_tables["decisions"]
    open_at_close = Counter({r: n for r, n in run_tables["job_runs"].items() if r[8] is None})
    assert got["job_runs"] == run_tables["job_runs"] - open_at_close
    forged_rows = Counter({r: n for r, n in got["deadletters"].items() if r[0] == FORGED_ORIGIN})
    assert sum(forged_rows.values()) == 9 and all(r[4] == forged_pool for r in forged_rows)
    want_dl = Counter({r: n for r, n in run_tables["deadletters"].items() if r[0] not in PARSE_CODES})
    # the probe, and the bytes the other tests wrote to the input topics (emit refuses what does not parse)
    # ... and the unsigned bytes the other tests wrote as plain producers (bad_signature before any parse)
    probe_dl = Counter({r: n for r, n in got["deadletters"].items()
                        if r[2] == "admin-probe" or r[0] in PARSE_CODES or r[0] == "bad_signature"})
    assert got["deadletters"] - forged_rows - probe_dl == want_dl

    # no password anywhere: CLI outputs (kafka up, users, emit), worker log, sink log, broker log, exceptions
    texts = secure.outputs + [add.output, emitted.output, emitted.stderr, (tmp_path / "worker.log").read_text(),
                              caplog.text, (secure.data_dir / "kafka.log").read_text(errors="replace")]
    passwords = secure.passwords() + [feeder_pw.read_text().strip()]
    assert len(passwords) >= 7 and all(len(pw) >= 16 for pw in passwords)
    leaks = [i for i, t in enumerate(texts) for pw in passwords if pw in t]
    assert not leaks, f"a password in text #{leaks[0]}"
    worker_log = (tmp_path / "worker.log").read_text()
    assert "ledger core" in worker_log and "SASL_PLAINTEXT, user worker" in worker_log


def test_a_reader_cannot_commit_the_workers_offsets(secure, tmp_path):
    """A reader named `chipledger` owned every group starting with `chipledger`, so it could commit the worker's
    group past events never folded, and the worker skipped them silently (review of issue 16). Its groups are
    now `chipledger` and `chipledger.*`; a reader named like the worker's group is refused."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.errors import GroupAuthorizationFailedError
    from kafka.structs import OffsetAndMetadata

    pw = tmp_path / "chipledger.password"
    res = CliRunner().invoke(app, ["kafka", "users", "add", "chipledger", "--role", "reader", "--new-password-file",
                                   str(pw), "--data-dir", str(secure.data_dir)])
    assert res.exit_code == 0, res.output
    thief = KafkaConsumer(**secure.conn("chipledger", pw).kafka_python(), group_id="chipledger-worker",
                          enable_auto_commit=False)
    tp = TopicPartition("chipledger.jobs", 0)
    thief.assign([tp])
    with pytest.raises(GroupAuthorizationFailedError):
        thief.commit({tp: OffsetAndMetadata(1_000_000, "", -1)})
    thief.close()
    refused = CliRunner().invoke(app, ["kafka", "users", "add", "chipledger-worker", "--role", "reader",
                                       "--new-password-file", str(tmp_path / "w.password"),
                                       "--data-dir", str(secure.data_dir)])
    assert refused.exit_code != 0 and "would own the worker's consumer group" in refused.output
