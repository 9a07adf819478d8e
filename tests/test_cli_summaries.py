"""What a person and a script need from the CLI (issue 17, item 11): --version, shell completion, --json on
the commands that print a summary, and the SQL shell's line editing, history and .schema."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chipledger import __version__
from chipledger.cli import app
from test_slo_views import run_slo_lake

CLI = str(Path(sys.executable).parent / "chipledger")


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    return run_slo_lake(tmp_path_factory.mktemp("summaries"))


def invoke(*args, input=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def test_version_and_completion():
    res = invoke("--version")
    assert (res.exit_code, res.stdout) == (0, f"chipledger {__version__}\n")
    # as a user runs it, from bash: typer detects the shell from the parent process (the test suite itself may run
    # under sh, e.g. make's recipe shell, which typer does not support); `"$0" …; exit $?` keeps bash as the parent
    out = subprocess.run(["bash", "-c", '"$0" --show-completion; exit $?', str(CLI)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "_CHIPLEDGER_COMPLETE=complete_bash" in out.stdout


def test_report_json(lake):
    res = invoke("report", "--lake", lake, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    titles = [s["title"] for s in doc["sections"]]
    assert titles[0].startswith("Error budgets") and "Goodput of the runs that ended in the period" in titles
    budgets = doc["sections"][0]
    assert budgets["columns"][:3] == ["SLO", "target", "attained"]
    # typed numbers, not display strings (issue 35, item 9): fractions for percentages, good / total as numbers
    assert budgets["rows"][2] == ["quota_honoured", 0.95, 0.5, {"good": 1, "total": 2, "unit": "waits"},
                                  pytest.approx(10.0), pytest.approx(-9.0)]
    assert not any(isinstance(v, str) and v.endswith("%") for s in doc["sections"] for r in s["rows"] for v in r)
    days = next(s for s in doc["sections"] if s["title"] == "Availability by day")
    assert days["rows"][0][:2] == ["2026-11-02", "p/h100"] and isinstance(days["rows"][0][2], float)


def test_statements_json(lake, tmp_path):
    res = invoke("statements", "--lake", lake, "--period", "2026-11-02..2026-11-02", "--out", tmp_path / "o",
                 "--store", f"sqlite:///{tmp_path / 's.db'}", "--format", "json", "--json")
    assert res.exit_code == 0, res.output
    issued = json.loads(res.stdout)
    assert {s["team"] for s in issued} == {"a", "b"}
    assert all(Path(f).is_file() for s in issued for f in s["files"]) and issued[0]["digest"].startswith("sha256:")


def test_lake_cache_json(lake):
    (lake / "_cache").mkdir(exist_ok=True)  # what an earlier version left
    first = json.loads(invoke("lake", "cache", "--lake", lake, "--json").stdout)
    assert first == {"state": "retired", "removed": str(lake / "_cache")}
    assert json.loads(invoke("lake", "cache", "--lake", lake, "--json").stdout) == {"state": "retired",
                                                                                 "removed": None}


def test_demo_json(tmp_path):
    res = invoke("demo", "--days", "1", "--seed", "5", "--out", tmp_path / "d", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)  # the whole stdout is the JSON document: no tables around it
    assert doc["run"]["accepted"] > 0 and len(doc["pools"]) == 3
    assert {"pool", "capacity_chip_h", "idle_chip_h"} <= set(doc["pools"][0])
    assert doc["teams"] and doc["statements"] == []  # one day: no week closed


def test_kafka_status_json(tmp_path):
    res = invoke("kafka", "status", "--data-dir", tmp_path / "none", "--json")
    assert res.exit_code == 1 and json.loads(res.stdout) == {"running": False, "data_dir": str(tmp_path / "none")}


def test_sql_schema(lake):
    res = invoke("sql", "--lake", lake, "--format", "csv", input=".schema decision_victims\n.schema nope\n")
    assert res.stdout.splitlines()[:3] == ["column,type", "decision_id,VARCHAR", "pool,VARCHAR"]
    assert "no view or table nope" in res.stderr and res.exit_code == 1


def test_sql_shell_on_a_terminal_edits_lines_and_keeps_history(lake, tmp_path):
    """A real terminal (a pty): readline edits the line (Ctrl-A goes to its start) and the session's lines are
    in the history file afterwards, for the next session's arrow keys."""
    import pty

    history = tmp_path / "history"
    master, slave = pty.openpty()
    env = {**os.environ, "CHIPLEDGER_SQL_HISTORY": str(history), "TERM": "dumb", "COLUMNS": "120"}
    proc = subprocess.Popen([CLI, "sql", "--lake", str(lake), "--format", "csv"], stdin=slave, stdout=slave,
                            stderr=slave, env=env, close_fds=True)
    os.close(slave)
    seen = b""

    def read_until(token: bytes, timeout: float = 60) -> None:
        nonlocal seen
        end = time.monotonic() + timeout
        while token not in seen and time.monotonic() < end:
            r, _, _ = select.select([master], [], [], 0.2)
            if r:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    break
        assert token in seen, seen[-2000:]

    try:
        read_until(b"chipledger> ")
        # typed "42 AS answer;", then Ctrl-A (start of line) and "SELECT ": readline makes it one statement
        os.write(master, b"42 AS answer;\x01SELECT \r")
        read_until(b"answer\r\n42")
        os.write(master, b".quit\r")
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert proc.returncode == 0
    assert "SELECT 42 AS answer;" in history.read_text()
