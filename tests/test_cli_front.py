"""What new users met on a normal day (issue 35), at the level they meet it: the command line through typer's
CliRunner (a pipe, as `… | grep` is), on a small lake of the policy scenario (test_policy_cli.py)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

from chipledger.cli import app
from chipledger.reports.tables import id_column, print_table
from test_policy_cli import _run, _write

runner = CliRunner()


@pytest.fixture(scope="module")
def waiting_lake(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("front")
    src, cfg = _write(tmp, "preemption_grace_s = 60\nmin_runtime_s = 300\ndecision_timeout_s = 600")
    lake, _ = _run(tmp, src, cfg, "w")
    return lake


def test_an_unknown_team_is_one_error_line_naming_the_known_ones(waiting_lake):
    """Item 3: `pending --team typo` printed "no job pending" and exited 0."""
    res = runner.invoke(app, ["pending", "--lake", str(waiting_lake), "--team", "serch"])
    assert res.exit_code == 2
    assert res.stderr.splitlines() == ["error: unknown team 'serch'; the lake knows: org/ads, search, vision"]
    res = runner.invoke(app, ["pending", "--lake", str(waiting_lake), "--team", "search"])
    assert res.exit_code == 0 and "no job pending for team search" in res.output


def test_tables_in_a_pipe_never_cut_ids_or_numbers(waiting_lake):
    """Item 8: `pending | grep job-0002395` found nothing ("job-00 / 02395"); in a pipe every row is one line and
    every id whole; `sql` likewise."""
    res = runner.invoke(app, ["pending", "--lake", str(waiting_lake)])
    assert res.exit_code == 0, res.output
    [row] = [line for line in res.stdout.splitlines() if " a1 " in line]
    assert "us-east1-a/h100" in row and "org/ads" in row and "preemption_in_flight" in row
    long_id = "job-" + "0" * 120 + "2395"
    res = runner.invoke(app, ["sql", "--lake", str(waiting_lake),
                              f"SELECT '{long_id}' AS job_id, 15741234567.25 AS chip_s, 'a b c ' || repeat('x', 90) AS note"])
    assert res.exit_code == 0, res.output
    [row] = [line for line in res.stdout.splitlines() if long_id in line]
    assert "15,741,234,567.250" in row and "x" * 90 in row


def test_on_a_narrow_terminal_ids_and_numbers_stay_whole():
    """Item 8: on an 80-column terminal, a table too wide is printed at the width it needs (the terminal wraps the
    line) rather than cutting an id or a number; text columns wrap at spaces."""
    out = io.StringIO()
    con = Console(file=out, width=80, force_terminal=True, color_system=None)
    t = Table(title="pending")
    id_column(t, "pool")
    id_column(t, "job")
    id_column(t, "chips", right=True)
    t.add_column("reason")
    pool, job = "us-central1-c/a100-40gb-" + "p" * 20, "job-00023950000000000000000000001"
    t.add_row(pool, job, "15,741,000", "waits for " + "quota " * 12)
    print_table(t, con)
    text = out.getvalue()
    assert pool in text and job in text and "15,741,000" in text and "…" not in text


def test_a_run_that_accepts_nothing_fails_and_a_sacct_dump_names_the_importer(tmp_path):
    """Item 7: `chipledger run` on a raw sacct file dead-lettered 9 of 9 lines and exited 0, without a hint."""
    from pathlib import Path

    sacct = Path(__file__).parent / "fixtures" / "sacct" / "two_partitions_new_york.txt"
    res = runner.invoke(app, ["run", "--events", str(sacct), "--lake", str(tmp_path / "lake"),
                              "--store", f"sqlite:///{tmp_path / 'a.db'}"])
    assert res.exit_code == 1, res.output
    [line] = res.stderr.splitlines()
    assert line.startswith(f"error: no line of {sacct} was accepted: ") and "not_json" in line
    assert f"chipledger import sacct {sacct} -o events.jsonl" in line
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"type": "job.finished"}\nnot json\n')
    res = runner.invoke(app, ["run", "--events", str(junk), "--lake", str(tmp_path / "lake2"),
                              "--store", f"sqlite:///{tmp_path / 'b.db'}", "--json"])
    assert res.exit_code == 1 and json.loads(res.stdout)["accepted"] == 0
    assert "`chipledger run` folds JSONL events, one JSON object per line" in res.stderr
