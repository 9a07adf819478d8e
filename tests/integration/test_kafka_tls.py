"""`chipledger kafka up` (the secure default): SASL/SCRAM over TLS with a throw-away CA. Each role's representative check
over TLS, the worker and the sink over TLS give the books of `chipledger run`, and a client that does not trust the
CA (another CA, or the system's) is refused. One broker for the module."""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chipledger.cli import app  # noqa: E402
from kafka_support import check_prerequisites, free_port  # noqa: E402
from store import open_store  # noqa: E402
from pipeline_support import WorkerProcess, lake_tables, pump  # noqa: E402
from schemas import OUTPUT_TOPICS  # noqa: E402
from streams import broker  # noqa: E402
from streams.acl import local_connection  # noqa: E402
from streams.clients import KafkaConnection, read_password_file  # noqa: E402
from streams.sink import Sink  # noqa: E402
from streams.topics import KafkaSetupError, create_topics, describe_partitions  # noqa: E402

pytestmark = pytest.mark.kafka

HAND = Path(__file__).resolve().parents[1] / "fixtures" / "hand.jsonl"


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    check_prerequisites()
    broker.ensure_jars()
    data_dir = tmp_path_factory.mktemp("kafka-tls") / "kafka"
    res = CliRunner().invoke(app, ["kafka", "up", "--port", str(free_port()), "--data-dir",
                                   str(data_dir), "--timeout", "180"])
    if res.exit_code != 0:
        if broker.status(data_dir):
            broker.down(data_dir)
        pytest.fail(f"kafka up --secure --tls failed: {res.output}", pytrace=False)
    try:
        info = broker.status(data_dir)
        assert info["security_protocol"] == "SASL_SSL" and Path(info["ca_file"]).is_file()
        assert "clients trust the CA" in res.output
        create_topics(local_connection(info), partitions=3, timeout_s=60)
        yield info
    finally:  # also when the set-up fails: no broker left running
        broker.down(data_dir, timeout_s=30)


def _as(info, user, **kw) -> KafkaConnection:
    conn = local_connection(info, user)
    return KafkaConnection(**{**{f: getattr(conn, f) for f in conn.__dataclass_fields__}, **kw})


def _send(conn, topic):
    from kafka import KafkaProducer

    p = KafkaProducer(**conn.kafka_python(), max_block_ms=8000, bootstrap_timeout_ms=8000, retries=0,
                      delivery_timeout_ms=8000, request_timeout_ms=5000)
    try:
        return p.send(topic, key=b"lab/a100", value=b"{}").get(10)
    finally:
        p.close(2)


def test_a_client_that_does_not_trust_the_ca_is_refused(tls, tmp_path):
    from kafka.errors import KafkaError

    from streams.tls import make_ca

    stranger = make_ca(tmp_path, name="other", cn="someone else")["ca"]
    for conn in (_as(tls, "admin", ssl_cafile=str(stranger)), _as(tls, "admin", ssl_cafile=None)):
        with pytest.raises(KafkaSetupError, match="no Kafka broker answered"):
            describe_partitions(conn, timeout_s=5)
    # the right CA but no SASL: no
    with pytest.raises(KafkaSetupError):
        describe_partitions(KafkaConnection(bootstrap=tls["bootstrap_servers"], security_protocol="SSL",
                                            ssl_cafile=tls["ca_file"]), timeout_s=5)
    # nor without TLS at all
    with pytest.raises(KafkaSetupError):
        describe_partitions(tls["bootstrap_servers"], timeout_s=5)
    # the broker's certificate names 127.0.0.1 and localhost: the host name check holds
    assert describe_partitions(local_connection(tls), timeout_s=10)
    assert _send(_as(tls, "admin"), "chipledger.quota").topic == "chipledger.quota"
    with pytest.raises(KafkaError, match="TopicAuthorization"):
        _send(_as(tls, "cluster"), "chipledger.quota")
    for topic in ("chipledger.jobs", *OUTPUT_TOPICS):
        with pytest.raises(KafkaError, match="TopicAuthorization"):
            _send(_as(tls, "reader"), topic)


def test_worker_and_sink_over_tls_give_the_books_of_run(tls, tmp_path):
    runner = CliRunner()
    run = runner.invoke(app, ["run", "--events", str(HAND), "--lake", str(tmp_path / "run-lake"),
                              "--store", f"sqlite:///{tmp_path / 'run.db'}", "--json"])
    assert run.exit_code == 0, run.output
    accepted = json.loads(run.stdout)["accepted"]
    pw = tmp_path / "feeder.password"
    add = runner.invoke(app, ["kafka", "users", "add", "feeder", "--role", "admin", "--role", "cluster",
                              "--new-password-file", str(pw), "--data-dir", str(tls["data_dir"])])
    assert add.exit_code == 0, add.output
    env = {"CHIPLEDGER_KAFKA_BOOTSTRAP": tls["bootstrap_servers"], "CHIPLEDGER_KAFKA_SSL_CAFILE": tls["ca_file"]}
    emitted = runner.invoke(app, ["emit", str(HAND), "--user", "feeder", "--password-file", str(pw),
                                  "--timeout", "30"], env=env)
    assert emitted.exit_code in (0, 1), emitted.output
    worker_env = {**env, "CHIPLEDGER_KAFKA_USERNAME": "worker",
                  "CHIPLEDGER_KAFKA_PASSWORD_FILE": str(Path(tls["secrets_dir"]) / "worker.password"),
                  "CHIPLEDGER_KAFKA_PRINCIPALS_FILE": str(Path(tls["secrets_dir"]) / "principals.json")}
    os.environ.update(worker_env)
    try:
        worker = WorkerProcess(tls["bootstrap_servers"], tmp_path / "w", tmp_path / "worker.log", "--tick-interval",
                               "0", app_id=f"chipledger-worker-{uuid.uuid4().hex[:6]}").start()
    finally:
        for k in worker_env:
            os.environ.pop(k, None)
    store = open_store(f"sqlite:///{tmp_path / 'sink.db'}")
    sink = Sink(tmp_path / "lake", store, bootstrap=_as(tls, "sink"), name="sink")
    try:
        pump(sink, lambda: sink.stats.rows["events"] >= accepted and store.pool_balances(), 120, worker)
    finally:
        worker.stop()
        sink.close()
    got, want = lake_tables(tmp_path / "lake"), lake_tables(tmp_path / "run-lake")
    assert got["events"] == want["events"] and got["decisions"] == want["decisions"]
    # the run closes its books at the end of the file; the stream has every row up to there
    assert got["journal"] and not (got["journal"] - want["journal"])
    passwords = [read_password_file(f).reveal() for f in Path(tls["secrets_dir"]).glob("*.password")]
    log = (tmp_path / "worker.log").read_text()
    assert "SASL_SSL, user worker" in log and not any(p in log or p in emitted.output for p in passwords)
