"""`chipledger kafka`, `topics`, `emit`, `worker`, `log export` and `sink`: the Kafka pipeline's commands."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
import typer.core
from rich.markup import escape

from chipledger.config import Config

from chipledger.cli._common import BootstrapOpt, ConfigOpt, DataDirOpt, KafkaCaFileOpt, KafkaPasswordFileOpt, KafkaTimeoutOpt, KafkaUserOpt, _config, _fail, _kafka, app, console, err, kafka_app, log_app, topics_app


@kafka_app.command("up")
def kafka_up(port: int = typer.Option(9092, help="client port on 127.0.0.1 (the SASL listener unless --insecure)"),
             data_dir: Path = DataDirOpt,
             timeout: float = typer.Option(120, help="seconds to wait for the broker to answer"),
             insecure: bool = typer.Option(False, "--insecure", help="a plain broker: no authentication, no TLS, no "
                                           "ACLs (anyone who reaches the port may write anything; tests only)"),
             tls: bool = typer.Option(True, "--tls/--no-tls", help="TLS on the SASL listener (a throw-away CA in "
                                      "DATA_DIR/tls/ca.pem); --no-tls: SASL_PLAINTEXT"),
             secure: bool = typer.Option(True, "--secure", hidden=True, help="the default (kept for scripts)"),
             cluster: list[str] = typer.Option(["*"], "--cluster", help="the clusters the default `cluster` user "
                                               "speaks for (repeatable; default every cluster: add one user per "
                                               "cluster with `kafka users add … --cluster NAME`)")):
    """Download the broker jars once (Maven), format KRaft storage, start the broker and wait until it answers.

    Secure by default: SASL/SCRAM over TLS, the standard authorizer (nothing allowed without an ACL), the users
    admin, cluster, worker, sink and reader with their ACLs (passwords in DATA_DIR/secrets/<user>.password, 0600,
    never printed), the producers' signing keys (DATA_DIR/secrets/<user>.key) and the principals registry the
    worker checks every record against (DATA_DIR/secrets/principals.json). --insecure: a plain broker."""
    from streams import broker

    secure = not insecure
    tls = tls and secure
    try:
        info = broker.up(port=port, data_dir=data_dir, timeout_s=timeout, secure=secure, tls=tls)
    except broker.BrokerError as e:
        _fail(str(e))
    console.print(f"kafka {info.get('version', '')} up at {info['bootstrap_servers']} (pid {info['pid']}, "
                  f"{info['security_protocol']}, log {info['log']})", highlight=False, soft_wrap=True)
    if not secure:
        err.print("INSECURE: no authentication, no TLS, no ACLs: anyone who reaches the port may grant quota, forge "
                  "job events or write the books (docs/security.md); for tests only", highlight=False, soft_wrap=True)
        return
    from streams.acl import PRINCIPALS_FILE, local_connection, provision_defaults
    from streams.topics import KafkaSetupError

    try:
        files = provision_defaults(local_connection(info), info["secrets_dir"], timeout_s=timeout, clusters=cluster)
    except KafkaSetupError as e:
        _fail(str(e), 2)
    secrets_dir = info["secrets_dir"]
    console.print(f"users {', '.join(files)}: passwords in {secrets_dir}/<user>.password, signing keys of admin, "
                  f"cluster and worker in {secrets_dir}/<user>.key (0600); super user {broker.SUPER_USER} (PLAIN) in "
                  f"{secrets_dir}/{broker.SUPER_USER}.password", highlight=False, soft_wrap=True)
    console.print(f"the worker checks every record against {secrets_dir}/{PRINCIPALS_FILE} "
                  "([kafka] principals_file / CHIPLEDGER_KAFKA_PRINCIPALS_FILE)", highlight=False, soft_wrap=True)
    if tls:
        console.print(f"clients trust the CA {info['ca_file']} (--ca-file / [kafka] ssl_cafile)",
                      highlight=False, soft_wrap=True)


@kafka_app.command("status")
def kafka_status(data_dir: Path = DataDirOpt,
                 as_json: bool = typer.Option(False, "--json", help='print {"running", "ready", "port", …} as JSON')):
    """Say whether the local broker runs; exit 1 when it does not."""
    from streams import broker

    info = broker.status(data_dir)
    if as_json:
        console.file.write(json.dumps({"running": info is not None, "data_dir": str(data_dir),
                                       **({"ready": bool(info.get("ready")), "port": info.get("port"),
                                           "pid": info.get("pid"), "log": str(info.get("log"))} if info else {})})
                           + "\n")
        if info is None:
            raise typer.Exit(1)
        return
    if info is None:
        console.print(f"kafka: not running (data dir {data_dir})")
        raise typer.Exit(1)
    state = "ready" if info.get("ready") else "starting"
    console.print(f"kafka: {state} at 127.0.0.1:{info['port']} (pid {info['pid']}, {info['security_protocol']}, "
                  f"log {info['log']})", highlight=False, soft_wrap=True)


@kafka_app.command("down")
def kafka_down(data_dir: Path = DataDirOpt, timeout: float = typer.Option(60, help="seconds before SIGKILL")):
    """Stop the local broker cleanly."""
    from streams import broker

    was_running = broker.down(data_dir, timeout_s=timeout)
    console.print("kafka: stopped" if was_running else "kafka: was not running")


users_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        help="SCRAM users of a secure broker and their roles (admin, cluster, portal, worker, sink, "
                             "reader: docs/security.md). Needs the super user: [kafka] credentials, --user/"
                             "--password-file, or else the local broker of --data-dir.")


kafka_app.add_typer(users_app, name="users")


def _super(cfg: Config, bootstrap, user, password_file, ca_file, data_dir: Path):
    """The connection for user management: the given credentials, else the local broker's super user."""
    if user or password_file or cfg.kafka.username:
        return _kafka(cfg, bootstrap, user, password_file, ca_file)
    from streams import broker
    from streams.acl import local_connection
    from streams.clients import KafkaSecurityError

    info = broker.status(data_dir)
    if info is None or not info.get("secure"):
        _fail(f"no credentials given and no secure local broker runs in {data_dir}: pass --user and "
              "--password-file of a super user, or start one with `chipledger kafka up`", 2)
    try:
        return local_connection(info).with_bootstrap(bootstrap)
    except KafkaSecurityError as e:
        _fail(str(e), 2)


def _registry_path(cfg: Config, principals: Optional[Path], data_dir: Path) -> Optional[Path]:
    if principals is not None:
        return principals
    if cfg.kafka.principals_file:
        return Path(cfg.kafka.principals_file)
    from streams.acl import PRINCIPALS_FILE

    local = Path(data_dir) / "secrets" / PRINCIPALS_FILE
    return local if local.parent.is_dir() else None


def _registry(cfg: Config, principals: Optional[Path], data_dir: Path, must: bool = True):
    """The principals registry `users` changes (made when missing)."""
    from streams.principals import Registry, RegistryError

    path = _registry_path(cfg, principals, data_dir)
    if path is None:
        if not must:
            return None
        _fail("no principals registry: pass --principals FILE or set [kafka] principals_file (the local broker's is "
              "DATA_DIR/secrets/principals.json)", 2)
    try:
        return Registry.load(path) if path.exists() else Registry(path=path)
    except RegistryError as e:
        _fail(str(e), 2)


@users_app.command("add")
def users_add(
    name: str = typer.Argument(..., help="user name (the principal User:NAME)"),
    role: list[str] = typer.Option(..., "--role", help="admin | cluster | portal | worker | sink | reader (repeatable)"),
    new_password_file: Optional[Path] = typer.Option(None, "--new-password-file", dir_okay=False,
                                                     help="the user's password: read from this file if it exists, "
                                                          "else a random one is written to it (0600)"),
    password_from_env: Optional[str] = typer.Option(None, "--password-from-env", metavar="VAR",
                                                    help="or: the user's password is in this environment variable "
                                                         "(docker-compose)"),
    app_id: str = typer.Option("chipledger-worker", "--app-id",
                               help="worker role: the Faust app id its topics, groups and ids start with (starts "
                                    "with chipledger-worker)"),
    cluster: list[str] = typer.Option([], "--cluster", help="cluster / portal role: a cluster it speaks for (the "
                                                            "CLUSTER of pools CLUSTER/NAME; repeatable)"),
    may: list[str] = typer.Option([], "--may", help="cluster role: also pools (pool.configured), quota (quota.*) or "
                                                    "prices (price.set, budget.set) for its own clusters' pools"),
    new_key_file: Optional[Path] = typer.Option(None, "--new-key-file", dir_okay=False,
                                                help="where the producer's signing key is written (0600; default: "
                                                     "beside --new-password-file, NAME.key)"),
    rotate_key: bool = typer.Option(False, "--rotate-key", help="give an existing principal a new signing key"),
    principals: Optional[Path] = typer.Option(None, "--principals", dir_okay=False,
                                              help="the principals registry (default [kafka] principals_file, else "
                                                   "the local broker's DATA_DIR/secrets/principals.json)"),
    bootstrap: Optional[str] = BootstrapOpt, config: Optional[Path] = ConfigOpt,
    user: Optional[str] = KafkaUserOpt, password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt, data_dir: Path = DataDirOpt, timeout: float = KafkaTimeoutOpt,
):
    """Create a user, or set its password and roles (to rotate a password, give a new file). A producing user
    (admin, cluster, portal, worker) also gets a signing key and its entry in the principals registry: its roles,
    clusters and --may rights, which the worker checks on every record it sends."""
    import os
    import secrets

    from streams.acl import add_user
    from streams.clients import KafkaSecurityError, read_password_file
    from streams.topics import KafkaSetupError

    from streams.clients import Secret

    if (new_password_file is None) == (password_from_env is None):
        _fail("give exactly one of --new-password-file and --password-from-env", 2)
    from streams.acl import SIGNING_ROLES

    signs = bool(set(role) & set(SIGNING_ROLES))
    cfg0 = _config(config)
    registry = _registry(cfg0, principals, data_dir) if signs else None
    if signs:
        if new_key_file is None and new_password_file is not None:
            new_key_file = new_password_file.with_name(f"{new_password_file.stem}.key")
        if new_key_file is None:
            _fail("a producing user needs --new-key-file (its signing key) with --password-from-env", 2)
        from streams.principals import new_key

        try:
            entry = registry.put(name, role, cluster, may, key=new_key() if rotate_key else None)
        except ValueError as e:
            _fail(str(e), 2)
    elif cluster or may:
        _fail("--cluster and --may are for producing roles (cluster, portal)", 2)
    if password_from_env is not None and not os.environ.get(password_from_env):
        _fail(f"the environment variable {password_from_env} is not set", 2)
    conn = _super(_config(config), bootstrap, user, password_file, ca_file, data_dir)
    made = False
    if new_password_file is not None and not new_password_file.exists():
        try:
            fd = os.open(new_password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            _fail(f"cannot write {new_password_file}: {e.strerror}", 2)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(24) + "\n")
        made = True
    try:
        password = (Secret(os.environ[password_from_env]) if password_from_env is not None
                    else read_password_file(new_password_file))
        info = add_user(conn, name, role, password, app_id=app_id, timeout_s=timeout, may=may)
        if registry is not None:
            from streams.principals import write_secret_file

            write_secret_file(new_key_file, entry.key.hex() + "\n")
            registry.save()
        elif principals is not None or _registry_path(cfg0, None, data_dir) is not None:
            reg = _registry(cfg0, principals, data_dir, must=False)
            if reg is not None and reg.remove(name):  # no producing role any more: its signatures stop counting
                reg.save()
    except (KafkaSetupError, KafkaSecurityError, ValueError) as e:
        if made:
            new_password_file.unlink(missing_ok=True)
        _fail(str(e), 2)
    console.print(f"user {info.name}: roles {', '.join(info.roles)}"
                  + (f" (app id {info.app_id})" if info.app_id else "")
                  + (f"; clusters {', '.join(sorted(entry.principal.clusters))}"
                     + (f", may {', '.join(sorted(entry.principal.may))}" if entry.principal.may else "")
                     + f"; signing key in {new_key_file}, registry {registry.path}" if registry is not None else "")
                  + f"; password {'written to' if made else 'from'} {new_password_file or password_from_env}",
                  highlight=False,
                  soft_wrap=True)


@users_app.command("list")
def users_list(
    bootstrap: Optional[str] = BootstrapOpt, config: Optional[Path] = ConfigOpt,
    user: Optional[str] = KafkaUserOpt, password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt, data_dir: Path = DataDirOpt, timeout: float = KafkaTimeoutOpt,
    as_json: bool = typer.Option(False, "--json", help="print the users as JSON"),
):
    """The SCRAM users, their mechanisms and the roles their ACLs give them."""
    from streams.acl import list_users
    from streams.topics import KafkaSetupError

    cfg = _config(config)
    conn = _super(cfg, bootstrap, user, password_file, ca_file, data_dir)
    try:
        users = list_users(conn, timeout_s=timeout)
    except KafkaSetupError as e:
        _fail(str(e), 2)
    reg = _registry(cfg, None, data_dir, must=False)
    known = reg.entries if reg is not None else {}
    from dataclasses import replace

    # a producing principal's roles are the registry's (its ACLs alone cannot tell admin from portal, or a
    # cluster's --may quota from the admin role)
    users = [replace(u, roles=tuple(sorted(known[u.name].principal.roles))) if u.name in known else u for u in users]
    if as_json:
        console.file.write(json.dumps([{"name": u.name, "mechanisms": list(u.mechanisms), "roles": list(u.roles),
                                        "app_id": u.app_id,
                                        **({"clusters": sorted(known[u.name].principal.clusters),
                                            "may": sorted(known[u.name].principal.may)} if u.name in known else {})}
                                       for u in users]) + "\n")
        return
    for u in users:
        p = known[u.name].principal if u.name in known else None
        console.print(f"{u.name:<20} {','.join(u.roles) or '(no role)':<20} {','.join(u.mechanisms)}"
                      + (f"  app id {u.app_id}" if u.app_id else "")
                      + (f"  clusters {','.join(sorted(p.clusters))}" + (f" may {','.join(sorted(p.may))}" if p.may
                                                                          else "") if p is not None else ""),
                      markup=False, highlight=False, soft_wrap=True)


@users_app.command("remove")
def users_remove(
    name: str = typer.Argument(..., help="user name"),
    bootstrap: Optional[str] = BootstrapOpt, config: Optional[Path] = ConfigOpt,
    user: Optional[str] = KafkaUserOpt, password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt, data_dir: Path = DataDirOpt, timeout: float = KafkaTimeoutOpt,
):
    """Delete a user's SCRAM credentials and ACLs (its open connections end at their next authentication)."""
    from streams.acl import remove_user
    from streams.topics import KafkaSetupError

    cfg = _config(config)
    conn = _super(cfg, bootstrap, user, password_file, ca_file, data_dir)
    try:
        gone = remove_user(conn, name, timeout_s=timeout)
    except KafkaSetupError as e:
        _fail(str(e), 2)
    reg = _registry(cfg, None, data_dir, must=False)
    if reg is not None and reg.remove(name):  # the worker refuses its records from its next look at the file
        reg.save()
        gone = True
    console.print(f"user {name}: {'removed' if gone else 'did not exist'}", highlight=False)
    if not gone:
        raise typer.Exit(1)


@topics_app.command("create")
def topics_create(
    bootstrap: Optional[str] = BootstrapOpt,
    partitions: Optional[int] = typer.Option(None, "--partitions", min=1,
                                             help="partitions per topic (default [kafka] partitions = 3)"),
    replication: int = typer.Option(1, "--replication", min=1, help="replication factor of new topics"),
    config: Optional[Path] = ConfigOpt,
    timeout: float = typer.Option(30.0, "--timeout", min=0.1, help="seconds to wait for the broker"),
    user: Optional[str] = KafkaUserOpt,
    password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt,
):
    """Create the input and output topics that are missing (idempotent); print each with created/exists.

    Exit 2 when no broker answers or an existing input topic has another partition count."""
    from streams.topics import KafkaSetupError, create_topics

    cfg = _config(config)
    conn = _kafka(cfg, bootstrap, user, password_file, ca_file)
    partitions = partitions or cfg.kafka.partitions
    try:
        result = create_topics(conn, partitions=partitions, replication=replication, timeout_s=timeout)
    except (KafkaSetupError, ValueError) as e:
        _fail(str(e), 2)
    width = max(len(name) for name in result)
    for name, what in result.items():
        console.print(f"{name:<{width}}  {what}", markup=False, highlight=False, soft_wrap=True)


@app.command()
def emit(
    file: Optional[Path] = typer.Argument(None, help="JSONL file of events (default or '-': stdin)",
                                          dir_okay=False),
    bootstrap: Optional[str] = BootstrapOpt,
    config: Optional[Path] = ConfigOpt,
    timeout: float = KafkaTimeoutOpt,
    user: Optional[str] = KafkaUserOpt,
    password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt,
):
    """Validate and publish JSONL events to Kafka (keyed by pool); report invalid lines on stderr.

    Exit 0 when every line was sent, 1 when some lines were invalid (the valid ones are still sent),
    2 when Kafka is not usable (no broker, missing topics, delivery failed)."""
    from streams import producer as producer_mod
    from streams.topics import KafkaSetupError

    cfg = _config(config)
    conn = _kafka(cfg, bootstrap, user, password_file, ca_file)
    bootstrap = conn.bootstrap
    if file is not None and str(file) != "-":
        if not file.is_file():
            _fail(f"events file {file} does not exist", 2)
        source = open(file, "rb")
    else:
        source = getattr(sys.stdin, "buffer", sys.stdin)

    def invalid(lineno: int, code: str, detail: str) -> None:
        err.print(f"line {lineno}: {code}: {escape(detail)}", highlight=False, soft_wrap=True)

    ms = int(timeout * 1000)
    try:
        with producer_mod.LedgerProducer(conn, bootstrap_timeout_ms=ms, max_block_ms=ms) as producer:
            report = producer_mod.emit_lines(producer, source, on_invalid=invalid)
    except KafkaSetupError as e:
        _fail(str(e), 2)
    finally:
        if source is not sys.stdin and source is not getattr(sys.stdin, "buffer", None):
            source.close()
    console.print(f"sent {report.sent}, invalid {len(report.invalid)}", highlight=False)
    if report.failed:
        _fail(f"{report.failed} event(s) could not be delivered to {bootstrap}: {report.first_failure}", 2)
    if report.invalid:
        raise typer.Exit(1)


@app.command()
def worker(
    bootstrap: Optional[str] = BootstrapOpt,
    config: Optional[Path] = ConfigOpt,
    data_dir: Optional[Path] = typer.Option(None, "--data-dir",
                                            help="the worker's table state (default [worker] data_dir)"),
    table_store: Optional[str] = typer.Option(None, "--table-store", help="rocksdb | memory (default [worker] "
                                                                          "table_store = rocksdb)"),
    sequencer_wait_ms: Optional[int] = typer.Option(None, "--sequencer-wait-ms", min=0,
                                                    help="how long a record waits for its producer's previous "
                                                         "record of its pool once the input topics are caught up "
                                                         "(default [worker] sequencer_wait_ms = 60000)"),
    sequencer_block_ms: Optional[int] = typer.Option(None, "--sequencer-block-ms", min=0,
                                                     help="... and how long when records of another producer wait "
                                                          "behind it (default [worker] sequencer_block_ms = 2000)"),
    principals: Optional[Path] = typer.Option(None, "--principals", dir_okay=False,
                                              help="the principals registry every input record is checked against "
                                                   "(default [kafka] principals_file)"),
    trust_unsigned: bool = typer.Option(False, "--trust-unsigned",
                                        help="without a registry: trust every record's claims (a plain broker; "
                                             "never on a shared one)"),
    session_timeout: Optional[float] = typer.Option(None, "--session-timeout", min=1.0,
                                                    help="seconds before a dead worker's pools move to another "
                                                         "(default [worker] session_timeout_s = 6)"),
    tick_interval: Optional[int] = typer.Option(None, "--tick-interval", min=0,
                                                help="seconds of quiet before a pool gets a pool.tick; 0: none "
                                                     "(default [worker] tick_interval_s = 60)"),
    fetch_max_wait_ms: Optional[int] = typer.Option(None, "--fetch-max-wait-ms", min=0,
                                                    help="how long the broker may hold a fetch of the input topics "
                                                         "(default [worker] fetch_max_wait_ms = 20)"),
    checkpoint_interval_ms: Optional[int] = typer.Option(None, "--checkpoint-interval-ms", min=1,
                                                         help="how often the worker writes the changed pools' states "
                                                              "(table and snapshot for the store) and commits the "
                                                              "records they hold (default [worker] "
                                                              "checkpoint_interval_ms = 500)"),
    log_stalls_ms: Optional[int] = typer.Option(None, "--log-stalls-ms", min=0,
                                                help="log each event-loop stall longer than this many ms with the "
                                                     "code that held the loop; 0: off (default [worker] "
                                                     "log_stalls_ms = 0)"),
    app_id: str = typer.Option("chipledger-worker", "--app-id", help="Faust app id (consumer group, table topics)"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", min=0, max=65535,
                                               help="serve Prometheus /metrics of the pools this worker folds on "
                                                    "this port (default: no metrics)"),
    metrics_host: str = typer.Option("127.0.0.1", "--metrics-host", help="address /metrics listens on"),
    loglevel: str = typer.Option("warning", "--loglevel", help="debug | info | warning | error"),
    timeout: float = KafkaTimeoutOpt,
    user: Optional[str] = KafkaUserOpt,
    password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt,
):
    """Run the Faust worker: fold the input topics with the ledger core and send decisions, lake rows and dead
    letters to the output topics (run `chipledger sink` to write them to the lake and the store)."""
    from schemas import INPUT_TOPICS
    from streams.topics import ALL_TOPICS, KafkaSetupError, describe_partitions
    from streams.worker import WorkerSettings, run_worker

    cfg = _config(config)
    conn = _kafka(cfg, bootstrap, user, password_file, ca_file)
    bootstrap = conn.bootstrap
    try:
        counts = describe_partitions(conn, ALL_TOPICS, timeout_s=timeout)
    except KafkaSetupError as e:
        _fail(str(e), 2)
    missing = [t for t in ALL_TOPICS if t not in counts]
    if missing:
        _fail(f"topics missing at {bootstrap}: {', '.join(missing)}; create them with `chipledger topics create`", 2)
    from streams.topics import wait_group_coordinator

    # a new broker has no group coordinator until its offsets topic is led: wait here, quietly, rather than let
    # Faust's consumers log an ERROR and a WARNING for it on a clean start (issue 35 item 12)
    wait_group_coordinator(conn, app_id, timeout_s=timeout)
    from streams.topics import ensure_changelogs
    from streams.worker import SEQ_TABLE_NAME, TABLE_NAME

    # the tables' changelogs whole before Faust's first metadata request (else its first table write may read them as
    # having 0 partitions and stop the worker)
    ensure_changelogs(conn, app_id, (TABLE_NAME, SEQ_TABLE_NAME), counts[INPUT_TOPICS[0]], timeout_s=timeout)
    store_kind = table_store or cfg.worker.table_store
    if store_kind not in ("rocksdb", "memory"):
        _fail(f"--table-store must be rocksdb or memory, got {store_kind!r}", 2)
    from chipledger.config import fold_config
    from streams.principals import Registry, RegistryError

    fold = fold_config(cfg)  # [ledger] and [policy]
    registry_path = principals or (Path(cfg.kafka.principals_file) if cfg.kafka.principals_file else None)
    registry = None
    if registry_path is not None:
        try:
            registry = Registry.load(registry_path)
        except RegistryError as e:
            _fail(str(e), 2)
    elif conn.sasl and not trust_unsigned:
        _fail("the worker checks who sent each record against the principals registry: pass --principals FILE or "
              "set [kafka] principals_file (`chipledger kafka up` made DATA_DIR/secrets/principals.json), or "
              "--trust-unsigned to trust every record's claims", 2)
    if conn.sasl and not app_id.startswith("chipledger-worker"):  # the worker role's ACLs cover only these
        _fail(f"--app-id must start with chipledger-worker (consumer group names reserved for workers), got "
              f"{app_id!r}", 2)

    settings = WorkerSettings(
        bootstrap=bootstrap, kafka=conn, app_id=app_id, data_dir=data_dir or Path(cfg.worker.data_dir), table_store=store_kind,
        partitions=counts[INPUT_TOPICS[0]],
        sequencer_wait_ms=cfg.worker.sequencer_wait_ms if sequencer_wait_ms is None else sequencer_wait_ms,
        sequencer_block_ms=cfg.worker.sequencer_block_ms if sequencer_block_ms is None else sequencer_block_ms,
        principals=registry,
        session_timeout_s=cfg.worker.session_timeout_s if session_timeout is None else session_timeout,
        tick_interval_s=cfg.worker.tick_interval_s if tick_interval is None else tick_interval,
        fetch_max_wait_ms=cfg.worker.fetch_max_wait_ms if fetch_max_wait_ms is None else fetch_max_wait_ms,
        log_stalls_ms=cfg.worker.log_stalls_ms if log_stalls_ms is None else log_stalls_ms,
        checkpoint_interval_ms=(cfg.worker.checkpoint_interval_ms if checkpoint_interval_ms is None
                                else checkpoint_interval_ms),
        fold_config=fold, metrics_port=metrics_port, metrics_host=metrics_host,
        max_event_bytes=cfg.ledger.max_event_bytes,
    )
    import ledger

    err.print(f"worker {app_id}: {conn.describe()}, {settings.partitions} partitions, table {store_kind} in "
              f"{settings.data_dir}", highlight=False)
    err.print(f"worker {app_id}: ledger core {ledger.CORE}", highlight=False, soft_wrap=True)
    if registry is not None:
        err.print(f"worker {app_id}: every input record must be signed by one of the {len(registry.entries)} "
                  f"principal(s) of {registry.path}", highlight=False, soft_wrap=True)
    else:
        err.print(f"worker {app_id}: UNSIGNED RECORDS TRUSTED: no principals registry, so a record's source and "
                  "pool are taken at their word (docs/security.md)", highlight=False, soft_wrap=True)
    run_worker(settings, loglevel)


@log_app.command("export")
def log_export(
    output: Path = typer.Option(..., "-o", "--output", help="the JSONL file to write"),
    pool: Optional[str] = typer.Option(None, "--pool", help="only this pool's events (default: every pool)"),
    bootstrap: Optional[str] = BootstrapOpt,
    config: Optional[Path] = ConfigOpt,
    timeout: float = KafkaTimeoutOpt,
    user: Optional[str] = KafkaUserOpt,
    password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt,
):
    """Write chipledger.log, in log order, as JSONL: `chipledger run` on the file gives the books the worker
    folded (docs/streaming.md)."""
    from streams.log import export_log
    from streams.topics import KafkaSetupError

    cfg = _config(config)
    conn = _kafka(cfg, bootstrap, user, password_file, ca_file)
    try:
        rep = export_log(conn, output, pool=pool, timeout_s=timeout)
    except KafkaSetupError as e:
        _fail(str(e), 2)
    except OSError as e:
        _fail(f"cannot write {output}: {e.strerror or e}")
    err.print(f"log export: {rep.written} events of {len(rep.pools)} pool(s) to {output}"
              + (f"; {rep.duplicates} logged twice, written once" if rep.duplicates else "")
              + (f"; {rep.unexportable} empty or multi-line value(s) left out (dead letters of the fold)"
                 if rep.unexportable else ""), highlight=False, soft_wrap=True)


@app.command()
def sink(
    bootstrap: Optional[str] = BootstrapOpt,
    lake: Optional[Path] = typer.Option(None, "--lake", help="lake folder (default [lake] path = ./lake)"),
    store: Optional[str] = typer.Option(None, "--store", help="store URL (default sqlite:///chipledger.db)"),
    config: Optional[Path] = ConfigOpt,
    name: str = typer.Option("sink", "--name", help="the sink's name in the store's tracking table"),
    until_idle: Optional[float] = typer.Option(None, "--until-idle", min=0.1,
                                               help="exit after this many seconds without records (default: run "
                                                    "until interrupted)"),
    as_json: bool = typer.Option(False, "--json", help="print what was written as JSON"),
    timeout: float = KafkaTimeoutOpt,
    user: Optional[str] = KafkaUserOpt,
    password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt,
):
    """Write the worker's outputs (lake rows, decisions, dead letters, balances) to the lake and the store,
    exactly once: positions and effects in one store transaction."""
    from analytics.lake import LakeError
    from store import open_store
    from store.repo import StoreError
    from streams.sink import Sink
    from streams.topics import KafkaSetupError

    cfg = _config(config)
    conn = _kafka(cfg, bootstrap, user, password_file, ca_file)
    try:
        st = open_store(store or cfg.store.url)
    except StoreError as e:
        _fail(str(e))
    try:
        s = Sink(lake or Path(cfg.lake.path), st, bootstrap=conn, name=name,
                 timeout_s=timeout)
    except KafkaSetupError as e:
        _fail(str(e), 2)
    except LakeError as e:  # a lake of another layout: one line saying what to run
        _fail(str(e))
    try:
        stats = s.run(idle_exit_s=until_idle)
    except KeyboardInterrupt:
        stats = s.stats
    finally:
        s.close()
    if as_json:
        console.file.write(json.dumps(stats.as_dict()) + "\n")
    else:
        console.print(f"sink {name}: {stats.records:,} records, {stats.resent_dropped:,} re-sent dropped, "
                      f"rows {dict(sorted(stats.rows.items()))}", highlight=False)
