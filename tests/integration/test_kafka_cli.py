"""`chipledger kafka up|status|down` as a user runs them, against a real broker from Maven Central jars."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from chipledger.cli import app
from kafka_support import check_prerequisites, free_port
from streams import broker

pytestmark = pytest.mark.kafka


def test_kafka_up_status_down(tmp_path):
    check_prerequisites()
    runner = CliRunner()
    data = tmp_path / "kafka"
    port = free_port()
    res = runner.invoke(app, ["kafka", "up", "--insecure", "--port", str(port), "--data-dir", str(data)])
    try:
        assert res.exit_code == 0, res.output
        assert f"127.0.0.1:{port}" in res.output and "PLAINTEXT" in res.output
        assert "INSECURE" in res.stderr  # a plain broker says so (the secure default: test_kafka_tls.py)
        res = runner.invoke(app, ["kafka", "status", "--data-dir", str(data)])
        assert res.exit_code == 0, res.output
        assert "ready" in res.output
    finally:
        res = runner.invoke(app, ["kafka", "down", "--data-dir", str(data)])
    assert res.exit_code == 0 and "stopped" in res.output, res.output
    res = runner.invoke(app, ["kafka", "status", "--data-dir", str(data)])
    assert res.exit_code == 1 and "not running" in res.output
    assert broker.status(data) is None
