"""A throwaway PostgreSQL cluster for the store tests, started from the server binaries on this machine.

`scripts/postgres.sh ensure` installs them (Debian's `postgresql` package); nothing needs to be running. The
cluster lives in a fresh temp dir, listens on 127.0.0.1 on a free port (its unix socket in the temp dir, never
the system's), trusts local connections, and is stopped and deleted at the end of the session.

PostgreSQL refuses to run as root: as root the cluster is run by the `postgres` system user the package
creates. Without the binaries the tests are skipped loudly, or fail with CHIPLEDGER_REQUIRE_POSTGRES=1 (CI).

Environment: CHIPLEDGER_PG_BIN (a directory with initdb, pg_ctl and postgres: overrides the lookup; point it
at a missing directory to see the skip), CHIPLEDGER_REQUIRE_POSTGRES.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

REQUIRE_ENV = "CHIPLEDGER_REQUIRE_POSTGRES"
BIN_ENV = "CHIPLEDGER_PG_BIN"
DB_NAME = "chipledger_test"
SERVER_TIMEZONE = "Asia/Kolkata"  # +05:30; see Cluster._start
SUPERUSER = "postgres"  # the cluster's superuser name (initdb -U), whoever runs the server process


class PostgresUnavailable(RuntimeError):
    """No server binaries, or no way to run them: a skip (or a failure when required)."""


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _has_server(d: Path) -> bool:
    return all(os.access(d / name, os.X_OK) for name in ("initdb", "pg_ctl", "postgres"))


def _version_key(path: str) -> tuple:
    ver = Path(path).parent.name
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.]", ver))


def find_bindir() -> Path:
    """The directory of initdb, pg_ctl and postgres (same lookup as scripts/postgres.sh)."""
    override = os.environ.get(BIN_ENV)
    if override:
        d = Path(override)
        if _has_server(d):
            return d
        raise PostgresUnavailable(f"{BIN_ENV}={override} has no initdb, pg_ctl and postgres")
    for cand in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True):
        if _has_server(Path(cand)):
            return Path(cand)
    initdb = shutil.which("initdb")
    if initdb and _has_server(Path(initdb).parent):
        return Path(initdb).parent
    raise PostgresUnavailable(
        "no PostgreSQL server binaries (/usr/lib/postgresql/<ver>/bin/{initdb,pg_ctl,postgres}); "
        "run `bash scripts/postgres.sh ensure` as root, or `apt-get install postgresql`, "
        f"or set {BIN_ENV}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _traversable_by_others(path: Path) -> bool:
    """Every ancestor of `path` can be entered by another user (so a server run as `postgres` reaches it)."""
    for p in [path, *path.parents]:
        try:
            if not os.stat(p).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    return True


class Cluster:
    """One PostgreSQL cluster in a temp dir. `start()` returns the URL of a fresh database; `stop()` removes it."""

    def __init__(self, bindir: Optional[Path] = None):
        self.bindir = bindir or find_bindir()
        self.run_as: Optional[str] = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                raise PostgresUnavailable(
                    "running as root and there is no `postgres` system user to run the server as "
                    "(PostgreSQL refuses to run as root; the postgresql package creates that user)") from None
            self.run_as = "postgres"
        self.base: Optional[Path] = None
        self.port: Optional[int] = None
        self.url: Optional[str] = None
        self.timings: dict[str, float] = {}

    @property
    def data(self) -> Path:
        return self.base / "data"

    @property
    def sockdir(self) -> Path:
        return self.base / "sock"

    @property
    def logfile(self) -> Path:
        return self.base / "server.log"

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        kw = {}
        if self.run_as is not None:
            pw = pwd.getpwnam(self.run_as)
            kw = dict(user=pw.pw_uid, group=pw.pw_gid, extra_groups=[])
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}  # no stray PGDATA/PGPORT/...
        env.update(LC_ALL="C", LANG="C", TZ="UTC")
        if self.run_as is not None:
            env["HOME"] = str(self.base)
        return subprocess.run([str(self.bindir / args[0]), *args[1:]], cwd=self.base, env=env, capture_output=True,
                              text=True, timeout=timeout, **kw)

    def _check(self, proc: subprocess.CompletedProcess, what: str) -> None:
        if proc.returncode != 0:
            log = self.logfile.read_text(errors="replace")[-3000:] if self.logfile.exists() else ""
            raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}\n"
                               f"--- server log ---\n{log}")

    def start(self) -> str:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> str:
        tmp = Path(tempfile.gettempdir())
        if self.run_as is not None and not _traversable_by_others(tmp):
            tmp = Path("/tmp")  # e.g. TMPDIR under /root: the postgres user could not reach the data dir
        self.base = Path(tempfile.mkdtemp(prefix="chipledger-pg-", dir=tmp))
        self.sockdir.mkdir()
        if self.run_as is not None:
            pw = pwd.getpwnam(self.run_as)
            for p in (self.base, self.sockdir):
                os.chown(p, pw.pw_uid, pw.pw_gid)
        t0 = time.monotonic()
        self._check(self._run("initdb", "-D", str(self.data), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8",
                              "--locale=C", "--no-sync"), "initdb")
        self.timings["initdb"] = time.monotonic() - t0
        for attempt in range(5):
            self.port = _free_port()
            # a conf file of our own, included last: later settings win
            (self.data / "chipledger.conf").write_text(
                f"listen_addresses = '127.0.0.1'\nport = {self.port}\n"
                f"unix_socket_directories = '{self.sockdir}'\n"
                "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"
                "max_connections = 50\nshared_buffers = 32MB\nlog_min_messages = warning\n"
                # deliberately not UTC (and not a whole hour): code relying on the server's zone shows up
                f"timezone = '{SERVER_TIMEZONE}'\n")
            if attempt == 0:
                with open(self.data / "postgresql.conf", "a") as f:
                    f.write("\ninclude = 'chipledger.conf'\n")
            self.logfile.unlink(missing_ok=True)
            t0 = time.monotonic()
            proc = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.logfile), "-w", "-t", "60", "start")
            if proc.returncode == 0:
                self.timings["start"] = time.monotonic() - t0
                break
            log = self.logfile.read_text(errors="replace") if self.logfile.exists() else ""
            if "already in use" not in log:  # only a port taken since _free_port is worth another try
                self._check(proc, "pg_ctl start")
        else:
            self._check(proc, "pg_ctl start (5 ports tried)")
        t0 = time.monotonic()
        import psycopg  # a dependency of the project (the store's PostgreSQL driver)

        with psycopg.connect(host="127.0.0.1", port=self.port, user=SUPERUSER, dbname="postgres",
                             autocommit=True, connect_timeout=10) as con:
            con.execute(f'CREATE DATABASE "{DB_NAME}" ENCODING \'UTF8\' TEMPLATE template0')
        self.timings["createdb"] = time.monotonic() - t0
        self.url = f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{DB_NAME}"
        return self.url

    def _stop_quietly(self) -> Optional[subprocess.CompletedProcess]:
        if self.base is None or not (self.data / "postmaster.pid").exists():
            return None
        return self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def stop(self) -> None:
        """Stop the server (fast shutdown: open sessions are ended) and delete the cluster."""
        if self.base is None:
            return
        t0 = time.monotonic()
        try:
            proc = self._stop_quietly()
            if proc is not None and proc.returncode != 0:
                self._check(proc, "pg_ctl stop")
            self.timings["stop"] = time.monotonic() - t0
        finally:
            if not (self.data / "postmaster.pid").exists():
                shutil.rmtree(self.base, ignore_errors=True)
                self.base = None
