"""Shared fixtures. `postgres_url`: a real PostgreSQL server for the session (see tests/pg.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import browser as browser_mod  # noqa: E402  (tests/browser.py)
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


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for the session (tests/browser.py). Without chromium and chromedriver: skipped
    loudly, or a failure with CHIPLEDGER_REQUIRE_CHROMIUM=1."""
    try:
        browser_mod.find()
    except browser_mod.ChromiumUnavailable as err:
        msg = f"BROWSER TESTS NOT RUN: {err}"
        if browser_mod.required():
            pytest.fail(f"{msg} ({browser_mod.REQUIRE_ENV}=1)", pytrace=False)
        pytest.skip(msg)
    b = browser_mod.Browser()  # a browser that is installed but does not start is always a failure
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="session")
def demo_lake_of(tmp_path_factory):
    """`demo_lake_of(days, seed)`: the lake of `chipledger demo --days DAYS --seed SEED`, made once per session (a
    test that changes it works on a copy)."""
    from typer.testing import CliRunner

    from chipledger.cli import app

    made: dict[tuple, Path] = {}

    def lake(days: int, seed: int) -> Path:
        if (days, seed) not in made:
            out = tmp_path_factory.mktemp(f"demo-{days}d-{seed}") / "demo"
            res = CliRunner().invoke(app, ["demo", "--days", str(days), "--seed", str(seed), "--out", str(out)])
            assert res.exit_code == 0, res.output
            made[days, seed] = out / "lake"
        return made[days, seed]

    return lake


def _started(support, make, unavailable: type[Exception], tag: str, what: str, cleanup=lambda: None):
    """A session's service fixture body: the service made and started, yielded, stopped (and `cleanup()`) at the end.
    Not installed (`unavailable`): skipped loudly, or a failure when `support.required()`; installed but would not
    start: always a failure (the logs are kept)."""
    try:
        cluster = make()
    except unavailable as err:
        msg = f"{tag} TESTS NOT RUN: {err}"
        cleanup()
        if support.required():
            pytest.fail(f"{msg} ({support.REQUIRE_ENV}=1)", pytrace=False)
        pytest.skip(msg)
    try:
        cluster.start()
    except Exception as err:  # installed but would not start: always a failure (the logs are kept)
        cluster.stop()
        pytest.fail(f"could not start {what}: {err}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()
        cleanup()


@pytest.fixture(scope="session")
def slurm():
    """A real Slurm (slurmctld, slurmdbd on MariaDB, 4 slurmd x 8 fake GPUs) started once for the session by
    scripts/slurm.sh and stopped at the end (tests/slurm_support.py). Without Slurm installed: skipped loudly,
    or a failure with CHIPLEDGER_REQUIRE_SLURM=1."""
    import shutil
    import tempfile

    import slurm_support

    # not under pytest's basetemp: another pytest session of the same user prunes old basetemps, and the
    # daemons' state (MariaDB's data, the sockets) must outlive that
    state_dir = Path(tempfile.mkdtemp(prefix="chipledger-slurm-"))
    yield from _started(slurm_support, lambda: slurm_support.Cluster(state_dir), slurm_support.SlurmUnavailable,
                        "SLURM", "Slurm", cleanup=lambda: shutil.rmtree(state_dir, ignore_errors=True))


@pytest.fixture(scope="session")
def kube():
    """A real kube-apiserver, etcd, kube-controller-manager, kube-scheduler, kwok and Kueue on 127.0.0.1, started
    once for the session by scripts/kube.sh (or reused when `make test` already started it) and stopped at the end
    if started here (tests/kube_support.py). Without the built binaries: skipped loudly, or a failure with
    CHIPLEDGER_REQUIRE_KUBE=1."""
    import kube_support

    yield from _started(kube_support, kube_support.Cluster, kube_support.KubeUnavailable, "KUBERNETES",
                        "the Kubernetes control plane")
