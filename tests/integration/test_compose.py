"""docker-compose.yml (no Docker engine here): every chipledger command it runs exists in the CLI with those
options, every CHIPLEDGER_* variable it sets is a configuration key of the right type, and the stack has what
the deployment needs (KRaft broker, PostgreSQL, topic init before worker and sink)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
import yaml

from chipledger.cli import app
from chipledger.config import load_config

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _commands(compose: dict):
    for name, svc in compose["services"].items():
        entry = svc.get("entrypoint") or []
        cmd = list(entry) + list(svc.get("command") or [])
        if cmd and cmd[0] == "chipledger":
            yield name, cmd[1:], svc


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
    assert seen == {"topics": "create", "worker": "worker", "sink": "sink", "emit": "emit", "cli": "chipledger"}


def test_the_checker_refuses_what_the_cli_does_not_have():
    with pytest.raises(AssertionError, match="no command"):
        check_cli_args(["wroker"])
    with pytest.raises(AssertionError, match="has no option --tick"):
        check_cli_args(["worker", "--tick", "5"])
    with pytest.raises(AssertionError, match="--sequencer-wait-ms 'soon'"):
        check_cli_args(["worker", "--sequencer-wait-ms", "soon"])


def test_environment_is_valid_configuration(compose):
    for name, _, svc in _commands(compose):
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        cfg = load_config(env=env)  # unknown keys or wrong types raise
        assert cfg.kafka.bootstrap == "kafka:9092"
        assert cfg.store.url.startswith("postgresql://") and "@postgres:" in cfg.store.url
        assert cfg.worker.table_store == "rocksdb" and cfg.lake.path == "/data/lake"
        assert all(k.startswith("CHIPLEDGER_") for k in env)


def test_stack_shape(compose):
    s = compose["services"]
    kafka_env = s["kafka"]["environment"]
    assert kafka_env["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, one combined node
    assert kafka_env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == 1
    assert s["postgres"]["image"].startswith("postgres:")
    for svc in ("worker", "sink"):
        assert s[svc]["depends_on"]["topics"]["condition"] == "service_completed_successfully"
    assert s["sink"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert (COMPOSE.parent / "Dockerfile").is_file()
