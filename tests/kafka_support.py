"""What the Kafka tests share: the skip-or-fail rule, free ports, and a broker started for a test module.

Kafka tests need `java` (17+) and, unless the jar cache is filled, `mvn`. Without them they skip with a loud
reason, except under CHIPLEDGER_REQUIRE_KAFKA=1 (CI), where they fail.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path

import pytest

from streams import broker

REQUIRE = os.environ.get("CHIPLEDGER_REQUIRE_KAFKA", "").strip() not in ("", "0", "false", "no")


def unavailable(reason: str) -> None:
    msg = f"REAL KAFKA TESTS NOT RUN: {reason}"
    if REQUIRE:
        pytest.fail(f"{msg} (CHIPLEDGER_REQUIRE_KAFKA=1)", pytrace=False)
    pytest.skip(msg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def check_prerequisites() -> None:
    """Skip (or fail under CHIPLEDGER_REQUIRE_KAFKA=1) when a broker cannot be started here."""
    java_home = os.environ.get("JAVA_HOME")
    if not (shutil.which("java") or (java_home and (Path(java_home) / "bin" / "java").exists())):
        unavailable("no `java` on PATH (Kafka 4 needs Java 17+)")
    if not (shutil.which("mvn") or os.environ.get("MVN")) and not broker._jars_complete(
        broker.default_cache_dir(), broker._version()
    ):
        unavailable(f"no `mvn` on PATH and no cached Kafka jars in {broker.default_cache_dir()}")
    if importlib.util.find_spec("kafka") is None:
        unavailable("kafka-python is not installed")


def start_broker(data_dir: Path, port: int) -> dict:
    """Start a broker for a test module; a failure to start fails the test (the prerequisites were there)."""
    try:
        broker.ensure_jars()
        return broker.up(port=port, data_dir=data_dir, timeout_s=180, secure=False)
    except broker.BrokerError as exc:
        if broker.status(data_dir):
            broker.down(data_dir)
        pytest.fail(f"could not start Kafka: {exc}", pytrace=False)


@contextmanager
def module_broker(tmp_path_factory, partitions: int):
    """A broker for a test module with chipledger's topics (`partitions` each), stopped at the end:
    {"bootstrap", "data_dir", "port"} (the last two to stop and start it again in a test)."""
    from streams.topics import create_topics

    check_prerequisites()
    data_dir = tmp_path_factory.mktemp("kafka")
    port = free_port()
    info = start_broker(data_dir, port)
    create_topics(info["bootstrap_servers"], partitions=partitions, timeout_s=60)
    try:
        yield {"bootstrap": info["bootstrap_servers"], "data_dir": data_dir, "port": port}
    finally:
        broker.down(data_dir, timeout_s=30)
