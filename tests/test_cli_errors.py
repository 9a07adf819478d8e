"""Bad input on the command line gets one line on stderr and a non-zero exit, never a traceback (issue 17,
item 7): output paths that are files or cannot be written, a store whose driver is not installed, days of
nothing, a time zone that does not exist, a folder given as the events file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chipledger.cli import app
from test_slo_views import run_slo_lake


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    return run_slo_lake(tmp_path_factory.mktemp("errors"))


def one_error(args, code=None) -> str:
    res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code != 0 and (code is None or res.exit_code == code), (res.exit_code, res.output)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output
    return lines[0]


def test_report_out_a_file_or_unwritable(lake, tmp_path):
    f = tmp_path / "afile"
    f.write_text("")
    assert "cannot write the report into --out" in one_error(["report", "--lake", lake, "--out", f])
    assert "/proc/nope" in one_error(["report", "--lake", lake, "--out", "/proc/nope"])


def test_statements_out_a_file(lake, tmp_path):
    f = tmp_path / "afile"
    f.write_text("")
    line = one_error(["statements", "--lake", lake, "--period", "2026-11-02..2026-11-02", "--out", f,
                      "--store", f"sqlite:///{tmp_path / 's.db'}"])
    assert "cannot write statements into --out" in line and "Not a directory" in line


def test_schema_export_to_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("")
    assert "cannot write the schemas into" in one_error(["schema", "export", f])


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    from test_slo_views import slo_events

    f = tmp_path_factory.mktemp("ev") / "events.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in slo_events()))
    return f


def test_run_into_an_unwritable_lake(events, tmp_path):
    line = one_error(["run", "--events", events, "--lake", "/proc/x", "--store", f"sqlite:///{tmp_path / 's.db'}"])
    assert line.startswith("error: cannot run into lake /proc/x: ")


def test_run_with_a_store_whose_driver_is_missing(events, tmp_path):
    line = one_error(["run", "--events", events, "--lake", tmp_path / "l", "--store", "mysql://u@localhost/db"])
    assert "the database driver is not installed (Python module MySQLdb): pip install mysqlclient" in line
    assert "unknown database kind 'nosuchdb'" in one_error(["run", "--events", events, "--lake", tmp_path / "l",
                                                            "--store", "nosuchdb://x"])


def test_run_events_a_directory(tmp_path):
    line = one_error(["run", "--events", tmp_path, "--lake", tmp_path / "l",
                      "--store", f"sqlite:///{tmp_path / 's.db'}"], code=2)
    assert "is a directory: give the JSONL file of events" in line


@pytest.mark.parametrize("days", ["0", "-1"])
def test_demo_without_days(tmp_path, days):
    assert "--days must be more than 0" in one_error(["demo", "--days", days, "--out", tmp_path / "d"], code=2)


def test_import_helios_with_an_unknown_time_zone(tmp_path):
    src = Path(__file__).parent / "fixtures" / "helios"
    line = one_error(["import", "helios", src, "--tz", "Mars/Olympus", "-o", tmp_path / "x.jsonl"])
    assert "unknown time zone 'Mars/Olympus'" in line


def test_a_damaged_parquet_file_is_one_line_of_error(lake, tmp_path):
    """A truncated Parquet file in the lake gave DuckDB's traceback in report, sql and statements (review of
    issue 17); `alerts` already said so and exited 3."""
    import shutil

    broken = tmp_path / "lake"
    shutil.copytree(lake, broken)
    part = sorted((broken / "journal").rglob("*.parquet"))[0]
    part.write_bytes(part.read_bytes()[:100])
    for args in (["report", "--lake", broken], ["sql", "--lake", broken, "SELECT count(*) FROM journal"],
                 ["statements", "--lake", broken, "--period", "2026-11", "--out", tmp_path / "st",
                  "--store", f"sqlite:///{tmp_path / 'st.db'}"]):
        line = one_error(args, 1)
        assert "cannot read the lake" in line and part.name in line, line


def test_a_store_urls_password_is_never_printed(tmp_path):
    """`run` and `sink` printed the store URL with its password when the store could not be opened (issue 31)."""
    from store.repo import mask_url

    events = tmp_path / "e.jsonl"
    events.write_text("")
    for url in ("postgresql://alice:s3cr3t-pw@127.0.0.1:1/ledger", "bogus://alice:s3cr3t-pw@h/db"):
        for args in (["run", "--events", events, "--lake", tmp_path / "lake", "--store", url],
                     ["sink", "--store", url, "--bootstrap", "127.0.0.1:1", "--timeout", "1"]):
            res = CliRunner().invoke(app, [str(a) for a in args])
            assert res.exit_code != 0 and "s3cr3t-pw" not in res.output and "alice:***@" in res.output, res.output
    assert mask_url("postgresql://u:p@h/db") == "postgresql://u:***@h/db"
    assert mask_url("sqlite:///x.db") == "sqlite:///x.db"
