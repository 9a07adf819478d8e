"""Fixtures of the monitoring integration tests: one real Prometheus and one real Alertmanager per session
(tests/prom_support.py; skipped loudly without the binaries, a failure under CHIPLEDGER_REQUIRE_PROMETHEUS=1)."""

from __future__ import annotations

import pytest

from tests.prom_support import Alertmanager, Prometheus, tool


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory):
    tool("prometheus")
    p = Prometheus(tmp_path_factory.mktemp("prometheus"))
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="session")
def alertmanager(tmp_path_factory):
    tool("prometheus-alertmanager", "alertmanager")
    a = Alertmanager(tmp_path_factory.mktemp("alertmanager"))
    try:
        yield a
    finally:
        a.stop()
