"""A real single-node Apache Kafka (KRaft) on 127.0.0.1, run from Maven Central jars.

No Docker, no Kafka tarball: the broker's runtime classpath is that of
``org.apache.kafka:kafka_2.13`` (plus a log4j2 backend), which Maven copies once
into a cache.  One JVM runs a combined controller+broker node (``node.id=1``).

Public API (stdlib only)::

    ensure_jars(cache_dir=None) -> Path          # download/cache the classpath once
    up(port=9092, data_dir=Path(".kafka"), controller_port=None, timeout_s=120) -> dict
    status(data_dir=Path(".kafka")) -> dict | None
    down(data_dir=Path(".kafka"), timeout_s=60) -> bool

Also runnable as a script: ``python -m streams.broker up|down|status [--port N] [--data-dir D]``.

Files inside ``data_dir``: ``server.properties``, ``log4j2.properties``,
``broker.json`` (ports and cluster id, kept across restarts), ``kafka.pid``,
``kafka.log`` (the JVM's stdout/stderr, i.e. the broker log; the previous run's is
kept as ``kafka.log.prev``) and ``data/`` (Kafka's log.dirs / KRaft metadata).

Environment overrides: ``CHIPLEDGER_KAFKA_VERSION`` (default :data:`KAFKA_VERSION`),
``CHIPLEDGER_KAFKA_CACHE`` (the lib directory), ``JAVA_HOME`` (else ``java`` on PATH),
``MVN`` (else ``mvn`` on PATH).
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = [
    "BrokerError",
    "KAFKA_VERSION",
    "LOG4J_VERSION",
    "default_cache_dir",
    "ensure_jars",
    "up",
    "status",
    "down",
]

log = logging.getLogger(__name__)

#: Kafka release run by default (Scala 2.13 build; Kafka 4.x needs Java 17+).
KAFKA_VERSION = "4.3.1"
#: log4j2 backend: Kafka 4 logs through slf4j 1.7 -> log4j2, like its own distribution.
LOG4J_VERSION = "2.24.3"
#: Pinned so an old Maven does not fall back to an ancient default plugin version.
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"

HOST = "127.0.0.1"
NODE_ID = 1
JVM_OPTS = [
    "-Xmx512m",
    "-Xms256m",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-Djava.awt.headless=true",
]
# Short-lived tool JVMs (StorageTool): start fast, stay small.
TOOL_JVM_OPTS = ["-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Djava.awt.headless=true"]

_MARKER = ".chipledger-complete"
_PID_FILE = "kafka.pid"
_LOG_FILE = "kafka.log"
_STATE_FILE = "broker.json"
_PROPS_FILE = "server.properties"
_LOG4J_FILE = "log4j2.properties"
_LOG_DIRS = "data"

# Popen handles of brokers started by this process: kept so they are reaped (no
# zombies, no "subprocess still running" ResourceWarning) and so down() can wait().
_CHILDREN: dict[int, subprocess.Popen] = {}


class BrokerError(RuntimeError):
    """The local Kafka broker could not be provisioned, started or stopped."""


# --------------------------------------------------------------------------- helpers


def _version() -> str:
    return os.environ.get("CHIPLEDGER_KAFKA_VERSION", "").strip() or KAFKA_VERSION


def default_cache_dir(version: str | None = None) -> Path:
    """``$CHIPLEDGER_KAFKA_CACHE`` or ``~/.cache/chipledger/kafka/<version>/lib``."""
    env = os.environ.get("CHIPLEDGER_KAFKA_CACHE")
    if env:
        return Path(env).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "chipledger" / "kafka" / (version or _version()) / "lib"


def _tail(text: str | bytes | None, lines: int = 40) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # ANSI colours (Maven)
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _file_tail(path: Path, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return _tail(fh.read(), lines)
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"


def _find_java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home:
        cand = Path(home) / "bin" / "java"
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    java = shutil.which("java")
    if not java:
        raise BrokerError(
            "no `java` found (JAVA_HOME unset/invalid and no java on PATH): Kafka "
            f"{_version()} needs a Java 17+ runtime, e.g. `apt-get install openjdk-17-jre-headless`"
        )
    return java


def _find_mvn() -> str:
    mvn = os.environ.get("MVN") or shutil.which("mvn")
    if not mvn:
        raise BrokerError(
            "no `mvn` found on PATH: Maven is needed once to download the Kafka jars "
            "from Maven Central (e.g. `apt-get install maven`), or pre-fill the jar "
            f"cache at {default_cache_dir()}"
        )
    return mvn


@contextmanager
def _flock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _classpath(lib: Path) -> str:
    return str(lib / "*")  # JVM classpath wildcard: every jar in lib/


# ------------------------------------------------------------------------ ensure_jars


_POM = """<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0"
         xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance"
         xsi:schemaLocation="http://maven.apache.org/POM/4.0.0 http://maven.apache.org/xsd/maven-4.0.0.xsd">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.chipledger</groupId>
  <artifactId>kafka-broker-runtime</artifactId>
  <version>0</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>{kafka}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-core</artifactId>
      <version>{log4j}</version>
      <scope>runtime</scope>
    </dependency>
    <dependency>
      <!-- slf4j 1.7 binding: Kafka {kafka} is built against slf4j-api 1.7.x -->
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>{log4j}</version>
      <scope>runtime</scope>
    </dependency>
  </dependencies>
</project>
"""


def _jars_complete(lib: Path, version: str) -> bool:
    marker = lib / _MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if info.get("kafka") != version:
        return False
    return all((lib / name).is_file() for name in info.get("jars", []))


def ensure_jars(cache_dir: Path | None = None) -> Path:
    """Return a directory holding the Kafka broker's runtime classpath (all jars).

    Downloaded once with Maven (``dependency:copy-dependencies``, runtime scope) and
    cached; later calls return at once.  Safe against concurrent callers (file lock).
    """
    version = _version()
    lib = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir(version)
    lib = lib.absolute()
    if _jars_complete(lib, version):
        return lib
    with _flock(lib.parent / (lib.name + ".lock")):
        if _jars_complete(lib, version):  # another process finished meanwhile
            return lib
        mvn = _find_mvn()
        _find_java()  # Maven needs it too; fail with the clearer message
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=".mvn-", dir=lib.parent) as tmp:
            work = Path(tmp)
            (work / "pom.xml").write_text(_POM.format(kafka=version, log4j=LOG4J_VERSION))
            out_dir = work / "lib"
            cmd = [
                mvn,
                "-B",
                "-ntp",
                "-U",  # do not honour a cached earlier resolution failure
                "-Dstyle.color=never",
                "-f",
                str(work / "pom.xml"),
                f"{DEPENDENCY_PLUGIN}:copy-dependencies",
                "-DincludeScope=runtime",
                f"-DoutputDirectory={out_dir}",
                "-Dmdep.overWriteReleases=true",
            ]
            log.info("downloading Kafka %s jars with Maven into %s", version, lib)
            try:
                proc = subprocess.run(
                    cmd,
                    cwd=work,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    timeout=1800,
                )
            except subprocess.TimeoutExpired as exc:
                raise BrokerError(
                    f"Maven timed out after {exc.timeout:.0f}s fetching org.apache.kafka:kafka_2.13:"
                    f"{version}; last output:\n{_tail(exc.output)}"
                ) from None
            if proc.returncode != 0:
                raise BrokerError(
                    f"Maven failed (exit {proc.returncode}) fetching org.apache.kafka:kafka_2.13:"
                    f"{version} (command: {' '.join(cmd)}); last output:\n{_tail(proc.stdout)}"
                )
            jars = sorted(p.name for p in out_dir.glob("*.jar")) if out_dir.is_dir() else []
            needed = [f"kafka_2.13-{version}.jar", f"log4j-core-{LOG4J_VERSION}.jar"]
            missing = [n for n in needed if n not in jars]
            if missing:
                raise BrokerError(
                    f"Maven succeeded but {missing} not in {out_dir}; last output:\n{_tail(proc.stdout)}"
                )
            (out_dir / _MARKER).write_text(
                json.dumps({"kafka": version, "log4j": LOG4J_VERSION, "jars": jars}, indent=1)
            )
            if lib.exists():
                shutil.rmtree(lib)
            os.replace(out_dir, lib)
        log.info("Kafka %s: %d jars cached in %s (%.1fs)", version, len(jars), lib, time.monotonic() - t0)
    return lib


# ------------------------------------------------------------------ Kafka wire probe


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by peer")
        buf += chunk
    return bytes(buf)


def _api_versions(port: int, host: str = HOST, timeout: float = 2.0,
                  ca_file: str | None = None) -> dict[int, tuple[int, int]]:
    """Send a Kafka ApiVersions v0 request; return {api_key: (min, max)}.

    Raises OSError/ConnectionError/ValueError if nothing Kafka-like answers.
    Wire format: int32 size | header v1 (int16 api_key=18, int16 version=0,
    int32 correlation_id, int16-length client_id) | empty v0 body.  Response:
    int32 size | int32 correlation_id | int16 error_code | int32 n | n x (int16 key,
    int16 min, int16 max).  A broker that dislikes v0 still answers in v0 layout with
    UNSUPPORTED_VERSION (35) and its list, so 0 and 35 both prove a live Kafka.
    """
    client_id = b"chipledger-probe"
    correlation_id = 0x43484950  # "CHIP"
    payload = struct.pack(">hhih", 18, 0, correlation_id, len(client_id)) + client_id
    with socket.create_connection((host, port), timeout=timeout) as raw:
        sock = raw
        if ca_file:  # a TLS listener: ApiVersions is answered before SASL authentication, not before TLS
            import ssl

            sock = ssl.create_default_context(cafile=ca_file).wrap_socket(raw, server_hostname=host)
        sock.settimeout(timeout)
        sock.sendall(struct.pack(">i", len(payload)) + payload)
        (size,) = struct.unpack(">i", _recv_exact(sock, 4))
        if not 10 <= size <= 1 << 20:
            raise ValueError(f"not a Kafka ApiVersions response (size {size})")
        body = _recv_exact(sock, size)
    corr, error_code, count = struct.unpack_from(">ihi", body, 0)
    if corr != correlation_id:
        raise ValueError(f"correlation id mismatch ({corr:#x})")
    if error_code not in (0, 35) or not 0 < count < 1000 or len(body) < 10 + 6 * count:
        raise ValueError(f"unexpected ApiVersions response (error {error_code}, {count} apis)")
    apis = {}
    for i in range(count):
        key, lo, hi = struct.unpack_from(">hhh", body, 10 + 6 * i)
        apis[key] = (lo, hi)
    return apis


def _answers(port: int | None, timeout: float = 2.0, ca_file: str | None = None) -> bool:
    if not port:
        return False
    try:
        return 18 in _api_versions(port, timeout=timeout, ca_file=ca_file)
    except (OSError, ValueError, struct.error):
        return False


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the JVM does
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# -------------------------------------------------------------------- process state


def _alive(pid: int) -> bool:
    proc = _CHILDREN.get(pid)
    if proc is not None:
        if proc.poll() is not None:
            _CHILDREN.pop(pid, None)
            return False
        return True
    try:  # reap it if it happens to be our (zombie) child
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie still answers kill(0)
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return False
    except (OSError, IndexError):
        pass
    return True


def _is_our_broker(pid: int, data_dir: Path) -> bool:
    """Guard against PID reuse: the process must be kafka.Kafka on our server.properties."""
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not Path("/proc/self").exists():
        return True  # no procfs (macOS): trust the pid file
    try:
        args = cmdline.read_bytes().split(b"\0")
    except OSError:
        return False
    return b"kafka.Kafka" in args and str(data_dir / _PROPS_FILE).encode() in args


def _read_pid(data_dir: Path) -> int | None:
    try:
        return int((data_dir / _PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def _read_state(data_dir: Path) -> dict:
    try:
        return json.loads((data_dir / _STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_state(data_dir: Path, state: dict) -> None:
    tmp = data_dir / (_STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    os.replace(tmp, data_dir / _STATE_FILE)


def _info(data_dir: Path, pid: int, state: dict, ready: bool) -> dict:
    port = state.get("port")
    return {
        "pid": pid,
        "port": port,
        "controller_port": state.get("controller_port"),
        "bootstrap_servers": f"{HOST}:{port}",
        "data_dir": data_dir,
        "log": data_dir / _LOG_FILE,
        "version": state.get("version"),
        "cluster_id": state.get("cluster_id"),
        "ready": ready,
        "secure": bool(state.get("secure")),
        "tls": bool(state.get("tls")),
        "security_protocol": _protocol(state),
        "ca_file": state.get("ca_file"),
        "secrets_dir": data_dir / SECRETS_DIR if state.get("secure") else None,
    }


def _dir(data_dir: Path | str) -> Path:
    return Path(data_dir).expanduser().resolve()


def status(data_dir: Path = Path(".kafka")) -> dict | None:
    """Describe the broker of ``data_dir`` if its process is alive, else None.

    The dict has pid, port, controller_port, bootstrap_servers, data_dir, log,
    version, cluster_id and ready (True when the port answers a Kafka ApiVersions
    request).  A stale pid file (process gone or pid reused) is removed.
    """
    data_dir = _dir(data_dir)
    pid = _read_pid(data_dir)
    if pid is None:
        return None
    if not (_alive(pid) and _is_our_broker(pid, data_dir)):
        try:
            (data_dir / _PID_FILE).unlink()
        except OSError:
            pass
        return None
    state = _read_state(data_dir)
    return _info(data_dir, pid, state, _answers(state.get("port"), ca_file=state.get("ca_file")))


# ------------------------------------------------------------------------------- up


def _cluster_id() -> str:
    """A Kafka Uuid as ``StorageTool random-uuid`` prints it (22 chars base64url)."""
    while True:
        raw = bytearray(os.urandom(16))
        raw[6] = (raw[6] & 0x0F) | 0x40  # version 4, like java.util.UUID.randomUUID
        raw[8] = (raw[8] & 0x3F) | 0x80
        text = base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
        if not text.startswith("-"):  # Kafka rejects ids that look like CLI flags
            return text


SECRETS_DIR = "secrets"
#: the super user of a --secure broker: the broker's own connections and the set-up (ACLs, users, topics)
SUPER_USER = "kafka-admin"
_AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
_PLAIN = "org.apache.kafka.common.security.plain.PlainLoginModule"
_SCRAM = "org.apache.kafka.common.security.scram.ScramLoginModule"


def _protocol(state: dict) -> str:
    if not state.get("secure"):
        return "SSL" if state.get("tls") else "PLAINTEXT"
    return "SASL_SSL" if state.get("tls") else "SASL_PLAINTEXT"


def _write_secret(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(value + "\n")


def _secret(data_dir: Path, name: str) -> str:
    """The password in secrets/<name>.password, made (random, 0600) the first time."""
    import secrets

    folder = data_dir / SECRETS_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"{name}.password"
    if path.is_file():
        return path.read_text().splitlines()[0]
    value = secrets.token_urlsafe(24)
    _write_secret(path, value)
    return value


def _security_properties(data_dir: Path, tls: bool) -> dict:
    """SASL on both listeners, the standard authorizer denying what no ACL allows, TLS on the client listener
    when asked. The super user authenticates with PLAIN against this file's JAAS entry (KRaft controllers do
    not take SCRAM, and it exists before any SCRAM credential can be created); everyone else uses SCRAM."""
    pw = _secret(data_dir, SUPER_USER)
    plain = f'{_PLAIN} required username="{SUPER_USER}" password="{pw}" user_{SUPER_USER}="{pw}";'
    props = {
        "listener.security.protocol.map": f"CONTROLLER:SASL_PLAINTEXT,CLIENT:{'SASL_SSL' if tls else 'SASL_PLAINTEXT'}",
        "inter.broker.listener.name": "CLIENT",
        "sasl.mechanism.inter.broker.protocol": "PLAIN",
        "sasl.mechanism.controller.protocol": "PLAIN",
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        "listener.name.controller.plain.sasl.jaas.config": plain,
        "listener.name.client.sasl.enabled.mechanisms": "PLAIN,SCRAM-SHA-512,SCRAM-SHA-256",
        "listener.name.client.plain.sasl.jaas.config": plain,
        "listener.name.client.scram-sha-512.sasl.jaas.config": f"{_SCRAM} required;",
        "listener.name.client.scram-sha-256.sasl.jaas.config": f"{_SCRAM} required;",
        "authorizer.class.name": _AUTHORIZER,
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:{SUPER_USER}",
        "connections.max.reauth.ms": 0,
    }
    if tls:
        tls_dir = data_dir / "tls"
        store, store_pw = tls_dir / "broker.p12", tls_dir / "broker.p12.password"
        if not (store.is_file() and store_pw.is_file() and (tls_dir / "ca.pem").is_file()):
            from streams.tls import TlsError, make_ca_and_broker_cert

            try:
                make_ca_and_broker_cert(tls_dir, hostnames=["localhost"], ips=[HOST])
            except TlsError as exc:
                raise BrokerError(f"cannot make the broker's TLS certificate: {exc}") from None
        spw = store_pw.read_text().strip()
        props.update({
            "ssl.keystore.type": "PKCS12", "ssl.keystore.location": store, "ssl.keystore.password": spw,
            "ssl.key.password": spw,
            "ssl.truststore.type": "PKCS12", "ssl.truststore.location": store, "ssl.truststore.password": spw,
            "ssl.client.auth": "none", "ssl.endpoint.identification.algorithm": "https",
        })
    return props


def _server_properties(data_dir: Path, port: int, cport: int, secure: bool = False, tls: bool = False) -> str:
    props = {
        "process.roles": "broker,controller",
        "node.id": NODE_ID,
        "controller.quorum.bootstrap.servers": f"{HOST}:{cport}",
        "listeners": f"PLAINTEXT://{HOST}:{port},CONTROLLER://{HOST}:{cport}",
        "advertised.listeners": f"PLAINTEXT://{HOST}:{port},CONTROLLER://{HOST}:{cport}",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": data_dir / _LOG_DIRS,
        "num.partitions": 1,
        "default.replication.factor": 1,
        "min.insync.replicas": 1,
        "offsets.topic.replication.factor": 1,
        "offsets.topic.num.partitions": 10,
        "transaction.state.log.replication.factor": 1,
        "transaction.state.log.min.isr": 1,
        "transaction.state.log.num.partitions": 10,
        "share.coordinator.state.topic.replication.factor": 1,
        "share.coordinator.state.topic.min.isr": 1,
        "group.initial.rebalance.delay.ms": 0,
        "auto.create.topics.enable": "false",
        "delete.topic.enable": "true",
        "num.network.threads": 2,
        "num.io.threads": 4,
        "num.recovery.threads.per.data.dir": 1,
        "log.cleaner.dedupe.buffer.size": 32 * 1024 * 1024,
        "log.retention.hours": 168,
    }
    if secure:
        props["listeners"] = f"CLIENT://{HOST}:{port},CONTROLLER://{HOST}:{cport}"
        props["advertised.listeners"] = f"CLIENT://{HOST}:{port},CONTROLLER://{HOST}:{cport}"
        props.update(_security_properties(data_dir, tls))
    lines = ["# Written by streams/broker.py on every `up`; edits are overwritten."]
    lines += [f"{k}={v}" for k, v in props.items()]
    return "\n".join(lines) + "\n"


_LOG4J2 = """\
# Written by streams/broker.py: the broker logs to stdout, which goes to kafka.log.
status = warn
name = chipledger-kafka
# keep logging while Kafka's own shutdown hook runs (log4j's would stop it first)
shutdownHook = disable
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = STDOUT
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.statechange.name = state.change.logger
logger.statechange.level = WARN
logger.clients.name = org.apache.kafka.clients
logger.clients.level = WARN
logger.appinfo.name = org.apache.kafka.common.utils.AppInfoParser
logger.appinfo.level = WARN
# the full config dumps (hundreds of lines, several times per start)
logger.config.name = org.apache.kafka.common.config.AbstractConfig
logger.config.level = WARN
"""


def _java_cmd(java: str, lib: Path, data_dir: Path, opts: list[str], *main: str) -> list[str]:
    return [
        java,
        *opts,
        f"-Dlog4j2.configurationFile={data_dir / _LOG4J_FILE}",
        f"-Dkafka.logs.dir={data_dir}",
        "-cp",
        _classpath(lib),
        *main,
    ]


def _format_storage(java: str, lib: Path, data_dir: Path, cluster_id: str) -> None:
    cmd = _java_cmd(
        java, lib, data_dir, TOOL_JVM_OPTS,
        "kafka.tools.StorageTool", "format",
        "--cluster-id", cluster_id,
        "--config", str(data_dir / _PROPS_FILE),
        "--standalone",
    )  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, cwd=data_dir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, timeout=180,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise BrokerError(f"kafka StorageTool format timed out; output:\n{_tail(exc.output)}") from None
    if proc.returncode != 0:
        raise BrokerError(
            f"kafka StorageTool format failed (exit {proc.returncode}) for {data_dir}; "
            f"output:\n{_tail(proc.stdout)}"
        )


def _wait_ready(data_dir: Path, pid: int, port: int, deadline: float, ca_file: str | None = None) -> bool:
    """Wait for our broker's port to answer; False on early exit, raises nothing."""
    while time.monotonic() < deadline:
        if not _alive(pid):
            return False
        if _answers(port, timeout=min(2.0, max(0.2, deadline - time.monotonic())), ca_file=ca_file):
            return True
        time.sleep(0.2)
    return _answers(port, ca_file=ca_file)


def up(
    port: int = 9092,
    data_dir: Path = Path(".kafka"),
    controller_port: int | None = None,
    timeout_s: float = 120,
    secure: bool = True,
    tls: bool | None = None,
) -> dict:
    """Start (or find) the single-node KRaft broker for ``data_dir`` on 127.0.0.1:port.

    Secure by default (issue 31). ``secure``: SASL on every listener (SCRAM for users, PLAIN for the super user :data:`SUPER_USER`, whose
    password is made in ``data_dir/secrets``), the standard authorizer, nothing allowed without an ACL
    (streams/acl.py creates the users and their ACLs). ``tls`` (with ``secure``): the client listener is
    SASL_SSL, with a throw-away CA and broker certificate in ``data_dir/tls`` (``ca.pem`` for the clients); by
    default as ``secure``. ``secure=False``: a plain PLAINTEXT broker (anyone who reaches the port may write
    anything: tests, benchmarks, `chipledger kafka up --insecure`).

    Returns {pid, port, controller_port, bootstrap_servers, data_dir, log, version,
    cluster_id, ready}.  If the broker of this data_dir is already running, returns it
    (its port may differ from ``port``: the running one wins).  Storage is formatted
    only the first time.  The controller port, when not given, is the previous run's
    (kept in broker.json) if still free, else a free ephemeral port.  Raises
    BrokerError naming the problem (no java/mvn, Maven failure, port in use, broker
    exited early, timeout) with the tail of the relevant output.
    """
    if tls is None:
        tls = secure
    if tls and not secure:
        raise BrokerError("--tls goes with --secure (TLS on the SASL listener)")
    data_dir = _dir(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    if secure:
        os.chmod(data_dir, 0o700)  # server.properties holds the super user's password
    deadline = time.monotonic() + timeout_s
    with _flock(data_dir / ".broker.lock"):
        current = status(data_dir)
        if current is not None:
            if (current["secure"], current["tls"]) != (secure, tls):
                raise BrokerError(f"the broker of {data_dir} runs {current['security_protocol']}; stop it "
                                  "(`chipledger kafka down`) to start it with other security settings")
            if not current["ready"]:  # starting (e.g. by another process): wait for it
                if not _wait_ready(data_dir, current["pid"], current["port"], deadline, current["ca_file"]):
                    raise BrokerError(
                        f"Kafka broker pid {current['pid']} in {data_dir} is running but port "
                        f"{current['port']} does not answer Kafka requests; see "
                        f"{data_dir / _LOG_FILE}:\n{_file_tail(data_dir / _LOG_FILE)}"
                    )
                current["ready"] = True
            if current["port"] != port:
                log.warning("Kafka already running for %s on port %s (asked %s)", data_dir, current["port"], port)
            return current

        java = _find_java()
        lib = ensure_jars()
        version = _version()
        state = _read_state(data_dir)
        formatted = (data_dir / _LOG_DIRS / "meta.properties").is_file()
        if formatted and state.get("version") and state["version"] != version:
            log.warning("data dir %s was formatted by Kafka %s, running %s", data_dir, state["version"], version)
        if controller_port is None:
            # Reuse the port of the previous run (the KRaft voter endpoint recorded at
            # format time) unless something else took it; a lone voter copes with a change.
            controller_port = state.get("controller_port")
            if not controller_port or controller_port == port or not _port_free(controller_port):
                controller_port = _free_port()
        if controller_port == port:
            raise BrokerError(f"controller_port and port must differ (both {port})")
        for what, p in (("port", port), ("controller_port", controller_port)):
            if not _port_free(p):
                raise BrokerError(f"{what} {p} on {HOST} is already in use by another process")

        cluster_id = state.get("cluster_id") if formatted else None
        state = {
            "version": version if not formatted else state.get("version", version),
            "port": port,
            "controller_port": controller_port,
            "cluster_id": cluster_id or _cluster_id(),
            "secure": secure,
            "tls": tls,
            "ca_file": str(data_dir / "tls" / "ca.pem") if tls else None,
        }
        props_path = data_dir / _PROPS_FILE
        props_path.touch(mode=0o600)
        os.chmod(props_path, 0o600)
        props_path.write_text(_server_properties(data_dir, port, controller_port, secure, tls))
        (data_dir / _LOG4J_FILE).write_text(_LOG4J2)
        _write_state(data_dir, state)
        if not formatted:
            _format_storage(java, lib, data_dir, state["cluster_id"])

        log_path = data_dir / _LOG_FILE
        if log_path.exists():
            os.replace(log_path, data_dir / (_LOG_FILE + ".prev"))
        cmd = _java_cmd(java, lib, data_dir, JVM_OPTS, "kafka.Kafka", str(data_dir / _PROPS_FILE))
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                cmd,
                cwd=data_dir,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: survives us, killpg-able
                close_fds=True,
            )
        _CHILDREN[proc.pid] = proc
        (data_dir / _PID_FILE).write_text(f"{proc.pid}\n")
        deadline = time.monotonic() + timeout_s  # the JVM's own budget (not the download's)

        if _wait_ready(data_dir, proc.pid, port, deadline, state["ca_file"]):
            return _info(data_dir, proc.pid, state, True)
        if proc.poll() is not None:
            _CHILDREN.pop(proc.pid, None)
            try:
                (data_dir / _PID_FILE).unlink()
            except OSError:
                pass
            raise BrokerError(
                f"Kafka broker exited early (exit code {proc.returncode}); last lines of "
                f"{log_path}:\n{_file_tail(log_path)}"
            )
        _stop(data_dir, proc.pid, 15)
        raise BrokerError(
            f"Kafka broker did not answer on {HOST}:{port} within {timeout_s:.0f}s (stopped it); "
            f"last lines of {log_path}:\n{_file_tail(log_path)}"
        )


# ----------------------------------------------------------------------------- down


def _signal(pid: int, sig: int) -> None:
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return
    try:
        if pgid == pid and pgid != os.getpgrp():  # its own group, as up() starts it
            os.killpg(pgid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_dead(pid: int, deadline: float) -> bool:
    proc = _CHILDREN.get(pid)
    while time.monotonic() < deadline:
        if proc is not None:
            try:
                proc.wait(timeout=min(0.2, max(0.01, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                continue
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return not _alive(pid)


def _stop(data_dir: Path, pid: int, timeout_s: float) -> None:
    _signal(pid, signal.SIGTERM)
    if not _wait_dead(pid, time.monotonic() + timeout_s):
        log.warning("Kafka pid %s ignored SIGTERM for %.0fs: SIGKILL", pid, timeout_s)
        _signal(pid, signal.SIGKILL)
        if not _wait_dead(pid, time.monotonic() + 15):
            raise BrokerError(f"Kafka broker pid {pid} did not die even after SIGKILL")
    _CHILDREN.pop(pid, None)
    try:
        (data_dir / _PID_FILE).unlink()
    except OSError:
        pass


def down(data_dir: Path = Path(".kafka"), timeout_s: float = 60) -> bool:
    """Stop the broker of ``data_dir`` (SIGTERM its process group; SIGKILL after
    ``timeout_s``).  Returns True if a broker was stopped, False if none was running.
    Data (topics, offsets) stays in ``data_dir`` for the next ``up``."""
    data_dir = _dir(data_dir)
    with _flock(data_dir / ".broker.lock"):
        current = status(data_dir)
        if current is None:
            return False
        _stop(data_dir, current["pid"], timeout_s)
        return True


# ------------------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streams.broker", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "jars"])
    parser.add_argument("--data-dir", type=Path, default=Path(".kafka"))
    parser.add_argument("--port", type=int, default=9092)
    parser.add_argument("--controller-port", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "jars":
            print(ensure_jars())
        elif args.command == "up":
            info = up(args.port, args.data_dir, args.controller_port, args.timeout or 120, secure=False)
            print(json.dumps(info, default=str, indent=1))
        elif args.command == "down":
            print("stopped" if down(args.data_dir, args.timeout or 60) else "not running")
        else:
            info = status(args.data_dir)
            print(json.dumps(info, default=str, indent=1) if info else "not running")
            return 0 if info else 3
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
