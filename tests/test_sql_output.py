"""`chipledger sql` output a person can read (issue 17, item 9): a table shows at most --limit rows (100) with
a note of the rest, CSV/JSON/NDJSON are never cut, and a table written to a pipe is as wide as it needs rather
than folded into 80 columns."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from chipledger.cli import app
from test_slo_views import run_slo_lake


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    return run_slo_lake(tmp_path_factory.mktemp("sqlout"))


def sql(lake, *args, input=None):
    return CliRunner().invoke(app, ["sql", "--lake", str(lake), *args], input=input)


def data_rows(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("│")]


def test_table_is_capped_with_a_note(lake):
    res = sql(lake, "SELECT range AS n FROM range(250)")
    assert res.exit_code == 0, res.output
    assert len(data_rows(res.stdout)) == 100
    assert "(150 more row(s) not shown, 250 in all: --limit N or --limit 0 for more" in res.stdout
    assert len(data_rows(sql(lake, "SELECT range AS n FROM range(250)", "--limit", "0").stdout)) == 250
    assert len(data_rows(sql(lake, "SELECT range AS n FROM range(250)", "--limit", "7").stdout)) == 7


def test_machine_formats_are_never_cut(lake):
    q = "SELECT range AS n FROM range(250)"
    assert len(sql(lake, q, "-f", "csv").stdout.splitlines()) == 251
    assert len(json.loads(sql(lake, q, "-f", "json").stdout)) == 250
    lines = sql(lake, q, "-f", "ndjson").stdout.splitlines()
    assert len(lines) == 250 and json.loads(lines[-1]) == {"n": 249}


def test_a_table_to_a_pipe_is_not_folded(lake):
    res = sql(lake, "SELECT repeat('x', 150) AS wide, 42 AS answer")
    rows = data_rows(res.stdout)
    assert len(rows) == 1 and "x" * 150 in rows[0] and "42" in rows[0]


def test_the_shell_caps_tables_too(lake):
    res = sql(lake, input="SELECT range FROM range(120);\n")
    assert len(data_rows(res.stdout)) == 100 and "20 more row(s) not shown" in res.stdout
