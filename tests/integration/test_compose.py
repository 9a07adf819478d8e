"""docker-compose.yml (no Docker engine here): every chipledger command it runs exists in the CLI with those
options, every CHIPLEDGER_* variable it sets is a configuration key of the right type, and the stack has what
the deployment needs (KRaft broker, PostgreSQL, users and topic init before worker and sink). Security: SASL on
every broker listener with the standard authorizer, every Kafka client authenticated as its own principal,
every secret from the environment (.env.example names them all), nothing published on the host."""

from __future__ import annotations

from pathlib import Path

import re

import pytest
import typer
import yaml

from chipledger.cli import app
from chipledger.config import load_config

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"
ENV_EXAMPLE = COMPOSE.parent / ".env.example"
_VAR = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)(?::?[-?][^}]*)?\}")


def _dotenv() -> dict:
    return dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
                if line.strip() and not line.startswith("#"))


def _interpolate(value, env: dict):
    """Compose's ${VAR}, ${VAR:?message}, ${VAR:-default} and $$, as `docker compose config` would."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value
    out = _VAR.sub(lambda m: env[m.group(1)], value.replace("$$", "\0"))
    return out.replace("\0", "$")


@pytest.fixture(scope="module")
def compose_raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose(compose_raw) -> dict:
    return _interpolate(compose_raw, _dotenv())


def _commands(compose: dict):
    for name, svc in compose["services"].items():
        entry = svc.get("entrypoint") or []
        cmd = list(entry) + list(svc.get("command") or [])
        if cmd and cmd[0] == "chipledger":
            yield name, cmd[1:], svc
        elif cmd[:2] == ["sh", "-ec"]:  # a script: each of its chipledger lines
            for line in cmd[2].splitlines():
                if line.strip().startswith("chipledger "):
                    yield name, line.split()[1:], svc


def check_cli_args(args: list[str]):
    """Resolve `args` against the chipledger CLI like the shell would; fail on an unknown command or option, or
    an option value of the wrong type. (Typer's commands are click-like: groups have `commands`.)"""
    cmd = typer.main.get_command(app)
    rest = list(args)
    while hasattr(cmd, "commands") and rest and not rest[0].startswith("-"):
        sub = cmd.commands.get(rest[0])
        assert sub is not None, f"no command {rest[0]!r} in {args}"
        cmd, rest = sub, rest[1:]
    opts = {o: p for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    opts["--help"] = None
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            assert name in opts, f"{' '.join(args)}: {cmd.name} has no option {name}"
            p = opts[name]
            if p is not None and not p.is_flag and "=" not in arg:
                i += 1
                assert i < len(rest), f"{' '.join(args)}: {name} needs a value"
                try:
                    kind = p.type_descriptor.annotation
                    if kind in (int, float):  # the value is of the option's type
                        kind(rest[i])
                except ValueError as exc:
                    raise AssertionError(f"{' '.join(args)}: {name} {rest[i]!r}: {exc}") from None
        else:
            assert any(p.param_type_name == "argument" for p in cmd.params), f"{cmd.name} takes no argument {arg!r}"
        i += 1
    return cmd


def test_every_chipledger_command_in_compose_exists_with_its_options(compose):
    seen = {}
    for name, args, _ in _commands(compose):
        seen[name] = check_cli_args(args).name or "chipledger"  # the root group has no name
    assert seen == {"topics": "create", "worker": "worker", "sink": "sink", "emit": "emit", "cli": "chipledger",
                    "users": "add", "portal": "serve"}


def test_the_checker_refuses_what_the_cli_does_not_have():
    with pytest.raises(AssertionError, match="no command"):
        check_cli_args(["wroker"])
    with pytest.raises(AssertionError, match="has no option --tick"):
        check_cli_args(["worker", "--tick", "5"])
    with pytest.raises(AssertionError, match="--sequencer-wait-ms 'soon'"):
        check_cli_args(["worker", "--sequencer-wait-ms", "soon"])


def test_environment_is_valid_configuration(compose):
    from streams.clients import connection_from_config

    principals = {}
    for name, _, svc in _commands(compose):
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        cfg = load_config(env=env)  # unknown keys or wrong types raise
        assert cfg.kafka.bootstrap == "kafka:9092"
        assert cfg.store.url.startswith("postgresql://chipledger@postgres:")  # the password is PGPASSWORD's
        assert cfg.worker.table_store == "rocksdb" and cfg.lake.path == "/data/lake"
        assert all(k.startswith("CHIPLEDGER_") or k == "PGPASSWORD" for k in env)
        if name != "cli":  # every Kafka client authenticates, as its own principal
            signs = cfg.kafka.signing_key_file
            if signs:  # made by the users service in its volume: here only its place is checked
                assert (name, signs.split("/")[1]) in (("emit", "emit-key"), ("portal", "portal-key"))
            conn = connection_from_config(cfg.kafka.__class__(**{**cfg.kafka.__dict__, "signing_key_file": ""}))
            assert conn.security_protocol == "SASL_PLAINTEXT" and conn.password
            principals[name] = conn.username
    assert principals == {"topics": "kafka-admin", "users": "kafka-admin", "worker": "worker", "sink": "sink",
                          "emit": "emit", "portal": "portal"}
    # the worker checks every record against the registry the users service writes; only they mount it
    registry = {name for name, _, svc in _commands(compose)
                if (svc.get("environment") or {}).get("CHIPLEDGER_KAFKA_PRINCIPALS_FILE")}
    assert registry == {"users", "worker"}
    mounts = {name: [str(v).split(":")[0] for v in svc.get("volumes") or ()] for name, _, svc in _commands(compose)}
    assert {n for n, vs in mounts.items() if "principals" in vs} == {"users", "worker"}
    assert {n for n, vs in mounts.items() if "emit-key" in vs} == {"users", "emit"}
    assert {n for n, vs in mounts.items() if "portal-key" in vs} == {"users", "portal"}


def test_no_secret_in_the_file_and_nothing_published(compose_raw, compose):
    text = COMPOSE.read_text()
    used = set(_VAR.findall(text))
    assert used <= set(_dotenv()), f"not in .env.example: {used - set(_dotenv())}"
    assert {"KAFKA_ADMIN_PASSWORD", "POSTGRES_PASSWORD", "CHIPLEDGER_WORKER_PASSWORD"} <= used

    def walk(value, path=""):
        if isinstance(value, dict):
            for k, v in value.items():
                yield from walk(v, f"{path}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                yield from walk(v, f"{path}[{i}]")
        else:
            yield path, str(value)

    for path, value in walk(compose_raw):
        for m in re.finditer(r'password="([^"]*)"', value):
            assert m.group(1).startswith("${") or m.group(1) == "%s", f"{path}: a password in the file"
        if re.search(r"PASSWORD$", path.split(".")[-1]):
            assert value.startswith("${"), f"{path}: a password in the file"
    for name, svc in compose["services"].items():
        assert "ports" not in svc, f"{name} publishes a port"
        assert "network_mode" not in svc
    kafka = compose["services"]["kafka"]["environment"]
    assert "PLAINTEXT" not in kafka["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].replace("SASL_PLAINTEXT", "")
    assert kafka["KAFKA_AUTHORIZER_CLASS_NAME"].endswith("StandardAuthorizer")
    assert kafka["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
    assert kafka["KAFKA_SUPER_USERS"] == "User:kafka-admin"
    # the roles the users service gives are the ones docs/security.md names
    script = compose["services"]["users"]["command"][0]
    assert "users add worker --role worker" in script and "users add sink --role sink" in script


def test_stack_shape(compose):
    s = compose["services"]
    kafka_env = s["kafka"]["environment"]
    assert kafka_env["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, one combined node
    assert kafka_env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == 1
    assert s["postgres"]["image"].startswith("postgres:")
    for svc in ("worker", "sink", "emit"):
        assert s[svc]["depends_on"]["topics"]["condition"] == "service_completed_successfully"
        assert s[svc]["depends_on"]["users"]["condition"] == "service_completed_successfully"
    assert s["sink"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert (COMPOSE.parent / "Dockerfile").is_file()
