"""streams/clients.py: one connection for every Kafka client, from [kafka] config and the environment; the
password never shows in a repr, a str, a format, a settings dict a library logs, or an error message."""

from __future__ import annotations

import logging
import ssl

import pytest

from chipledger.config import ConfigError, load_config
from streams.clients import KafkaConnection, KafkaSecurityError, Secret, as_connection, connection_from_config

PW = "s3cr3t-Pa55word-xyz"


def _cfg(env, tmp_path=None):
    return load_config(env={k: str(v) for k, v in env.items()})


def test_plaintext_by_default_and_from_an_address():
    conn = connection_from_config(_cfg({}).kafka)
    assert conn.security_protocol == "PLAINTEXT" and conn.bootstrap == "127.0.0.1:9092"
    assert conn.kafka_python() == {"bootstrap_servers": "127.0.0.1:9092", "security_protocol": "PLAINTEXT"}
    assert conn.faust_credentials() is None and conn.faust_broker() == "kafka://127.0.0.1:9092"
    assert as_connection("h:1").bootstrap == "h:1" and as_connection(conn) is conn
    assert KafkaConnection(bootstrap="a:1, b:2").faust_broker() == "kafka://a:1;kafka://b:2"


def test_sasl_from_environment_with_a_password_file(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text(PW + "\n")
    cfg = _cfg({"CHIPLEDGER_KAFKA_USERNAME": "worker", "CHIPLEDGER_KAFKA_PASSWORD_FILE": pw,
                "CHIPLEDGER_KAFKA_BOOTSTRAP": "k:9"})
    conn = connection_from_config(cfg.kafka)
    assert conn.security_protocol == "SASL_PLAINTEXT" and conn.sasl_mechanism == "SCRAM-SHA-512"
    kp = conn.kafka_python()
    assert kp["sasl_plain_username"] == "worker" and kp["sasl_plain_password"].encode() == PW.encode()
    assert isinstance(kp["sasl_plain_password"], Secret)
    creds = conn.faust_credentials()
    assert creds.username == "worker" and creds.mechanism.value == "SCRAM-SHA-512"
    assert creds.protocol.value == "SASL_PLAINTEXT"
    # the option wins over the config
    other = tmp_path / "pw2"
    other.write_text("other\n")
    assert connection_from_config(cfg.kafka, username="u2", password_file=other).password.encode() == b"other"


def test_the_password_is_never_printed(tmp_path, caplog):
    conn = connection_from_config(_cfg({"CHIPLEDGER_KAFKA_USERNAME": "adm", "CHIPLEDGER_KAFKA_PASSWORD": PW}).kafka)
    settings = conn.kafka_python()
    texts = [repr(conn), str(conn), conn.describe(), repr(settings), str(settings), f"{conn.password}",
             "%s" % conn.password, repr(_cfg({"CHIPLEDGER_KAFKA_PASSWORD": PW})), repr(conn.faust_credentials())]
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("t").debug("Starting KafkaAdminClient with configuration: %s", settings)
    texts.append(caplog.text)
    assert all(PW not in t for t in texts), texts
    assert conn.password.reveal() == PW and conn.password == PW


def test_incomplete_settings_are_clear_errors_without_the_secret(tmp_path):
    with pytest.raises(KafkaSecurityError, match="needs a user name"):
        connection_from_config(_cfg({"CHIPLEDGER_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}).kafka)
    with pytest.raises(KafkaSecurityError, match="has no password"):
        connection_from_config(_cfg({"CHIPLEDGER_KAFKA_USERNAME": "u"}).kafka)
    with pytest.raises(KafkaSecurityError, match="cannot read the Kafka password file"):
        connection_from_config(_cfg({"CHIPLEDGER_KAFKA_USERNAME": "u",
                                     "CHIPLEDGER_KAFKA_PASSWORD_FILE": tmp_path / "nope"}).kafka)
    with pytest.raises(KafkaSecurityError, match="security_protocol must be one of"):
        connection_from_config(_cfg({"CHIPLEDGER_KAFKA_SECURITY_PROTOCOL": "KERBEROS"}).kafka)
    with pytest.raises(KafkaSecurityError, match="sasl_mechanism"):
        connection_from_config(_cfg({"CHIPLEDGER_KAFKA_USERNAME": "u", "CHIPLEDGER_KAFKA_PASSWORD": PW,
                                     "CHIPLEDGER_KAFKA_SASL_MECHANISM": "GSSAPI"}).kafka)
    with pytest.raises(KafkaSecurityError, match="is not a file"):
        connection_from_config(_cfg({"CHIPLEDGER_KAFKA_SSL_CAFILE": tmp_path / "ca.pem"}).kafka)
    toml = tmp_path / "c.toml"
    toml.write_text("[kafka]\npassword = 12345678\n")
    with pytest.raises(ConfigError) as info:
        load_config(toml, env={})
    assert "12345678" not in str(info.value)


@pytest.mark.skipif(__import__("shutil").which("keytool") is None, reason="no keytool (Java)")
def test_tls_context_from_a_ca_file(tmp_path):
    from streams.tls import make_ca_and_broker_cert

    files = make_ca_and_broker_cert(tmp_path, hostnames=["localhost"], ips=["127.0.0.1"])
    conn = connection_from_config(_cfg({"CHIPLEDGER_KAFKA_USERNAME": "u", "CHIPLEDGER_KAFKA_PASSWORD": PW,
                                        "CHIPLEDGER_KAFKA_SSL_CAFILE": files["ca"]}).kafka)
    assert conn.security_protocol == "SASL_SSL"
    ctx = conn.kafka_python()["ssl_context"]
    assert isinstance(ctx, ssl.SSLContext) and ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED
    assert conn.faust_credentials().protocol.value == "SASL_SSL"
    only_tls = connection_from_config(_cfg({"CHIPLEDGER_KAFKA_SSL_CAFILE": files["ca"]}).kafka)
    assert only_tls.security_protocol == "SSL" and only_tls.faust_credentials().protocol.value == "SSL"
