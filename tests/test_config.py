"""Configuration: chipledger.toml, environment overrides, clear errors, and the CLI honouring them."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from chipledger.cli import app
from chipledger.config import Config, ConfigError, load_config


def test_defaults_without_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config(env={}) == Config()
    cfg = load_config(env={})
    assert (cfg.lake.path, cfg.store.url, cfg.ledger.dedup_window_s) == ("lake", "sqlite:///chipledger.db", 86400)


def test_file_then_environment(tmp_path):
    f = tmp_path / "chipledger.toml"
    f.write_text('[lake]\npath = "/data/lake"\n[ledger]\ndedup_window_s = 600\ndebug_invariants = true\n')
    cfg = load_config(f, env={"CHIPLEDGER_LEDGER_DEDUP_WINDOW_S": "120", "CHIPLEDGER_STORE_URL": "sqlite:///x.db"})
    assert cfg.lake.path == "/data/lake"
    assert cfg.ledger.dedup_window_s == 120          # the environment wins over the file
    assert cfg.ledger.debug_invariants is True
    assert cfg.store.url == "sqlite:///x.db"


@pytest.mark.parametrize("text, message", [
    ("[lake\npath = 1", "not valid TOML"),
    ("[lakes]\npath = 'x'", "unknown section [lakes]"),
    ("[lake]\nfolder = 'x'", "unknown key 'folder' in [lake]"),
    ("[ledger]\ndedup_window_s = 'a day'", "[ledger] dedup_window_s must be a int"),
    ("[slo]\nthroughput_fraction = 1.5", "[slo] throughput_fraction must be above 0 and at most 1, got 1.5"),
    ("[slo]\nthroughput_reference_s = -1", "[slo] throughput_reference_s must not be negative"),
    ("[slo]\nthroughput_reference_reports = 0", "[slo] throughput_reference_reports must be between 1 and 256"),
    ("[slo]\nthroughput = 1", "[slo] throughput must be a target between 0 and 1"),
])
def test_bad_files_say_what_is_wrong(tmp_path, text, message):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(f, env={})


def test_bad_environment_value(tmp_path):
    with pytest.raises(ConfigError, match="CHIPLEDGER_LEDGER_DEBUG_INVARIANTS"):
        load_config(env={"CHIPLEDGER_LEDGER_DEBUG_INVARIANTS": "maybe"})


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})


def test_run_uses_the_config_file(tmp_path):
    cfg = tmp_path / "chipledger.toml"
    cfg.write_text(f'[lake]\npath = "{tmp_path / "from-config"}"\n[store]\nurl = "sqlite:///{tmp_path / "c.db"}"\n')
    res = CliRunner().invoke(app, ["run", "--events", "tests/fixtures/hand.jsonl", "--config", str(cfg), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["lake"] == str(tmp_path / "from-config")
    assert (tmp_path / "c.db").exists()
    res = CliRunner().invoke(app, ["sql", "--config", str(cfg), "--format", "csv", "SELECT count(*) AS n FROM jobs"])
    assert res.exit_code == 0 and res.stdout.splitlines() == ["n", "2"], res.output


def test_cli_reports_a_bad_config(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[nope]\n")
    res = CliRunner().invoke(app, ["run", "--events", "tests/fixtures/hand.jsonl", "--config", str(cfg)])
    assert res.exit_code == 2
    assert "unknown section [nope]" in res.output


def test_bursts_are_gated_by_the_slo_availability_target(tmp_path):
    from chipledger.config import fold_config

    f = tmp_path / "c.toml"
    f.write_text("[slo]\navailability = 0.995\n")
    assert fold_config(load_config(f, env={})).capacity_slo_target == 0.995
    assert fold_config(load_config(env={"CHIPLEDGER_SLO_AVAILABILITY": "0.9"})).capacity_slo_target == 0.9
    f.write_text("[policy]\ncapacity_slo_target = 0.995\n")
    with pytest.raises(ConfigError, match=r"\[policy\] capacity_slo_target is now \[slo\] availability"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match="CHIPLEDGER_POLICY_CAPACITY_SLO_TARGET"):
        load_config(env={"CHIPLEDGER_POLICY_CAPACITY_SLO_TARGET": "0.9"})


def test_the_fold_judges_throughput_with_the_slo_settings(tmp_path):
    from chipledger.config import fold_config

    f = tmp_path / "c.toml"
    f.write_text("[slo]\nthroughput_fraction = 0.5\nthroughput_reference_s = 60\n")
    fc = fold_config(load_config(f, env={"CHIPLEDGER_SLO_THROUGHPUT_REFERENCE_REPORTS": "5"}))
    assert (fc.throughput_fraction, fc.throughput_reference_s, fc.throughput_reference_reports) == (0.5, 60, 5)
