"""Shared fixtures. `postgres_url`: a real PostgreSQL server for the session (see tests/pg.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pg  # noqa: E402  (tests/pg.py)


@pytest.fixture(scope="session")
def postgres_url():
    """URL of an empty database on a throwaway cluster started for this session, stopped and removed at the
    end. Without server binaries: skipped loudly, or a failure with CHIPLEDGER_REQUIRE_POSTGRES=1."""
    try:
        cluster = pg.Cluster()
    except pg.PostgresUnavailable as err:
        msg = f"POSTGRESQL STORE TESTS NOT RUN: {err}"
        if pg.required():
            pytest.fail(f"{msg} ({pg.REQUIRE_ENV}=1)", pytrace=False)
        pytest.skip(msg)
    try:
        url = cluster.start()
    except Exception as err:  # binaries present but the server would not start: always a failure
        pytest.fail(f"could not start a PostgreSQL cluster with {cluster.bindir}: {err}", pytrace=False)
    try:
        yield url
    finally:
        cluster.stop()
