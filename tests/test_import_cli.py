"""`chipledger import …` and `chipledger demo --trace …` as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from analytics.views import connect
from chipledger.cli import app

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
OPENB = SHARED / "alibaba-gpu-v2023-openb"
VENUS = SHARED / "helios" / "Venus"
needs_shared = pytest.mark.skipif(not OPENB.is_dir() or not VENUS.is_dir(),
                                  reason="../shared/traces not found: trace tests need the shared folder beside the repo")


def import_json(fmt: str, src: Path, out: Path) -> dict:
    """`chipledger import FMT SRC -o OUT --json`, which must succeed; its report."""
    res = CliRunner().invoke(app, ["import", fmt, str(src), "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@needs_shared
def test_import_alibaba_cli_then_run(tmp_path):
    out = tmp_path / "openb.jsonl"
    report = import_json("alibaba-openb", OPENB, out)
    assert report["rows_read"] == 8152
    assert report["skipped"].get("cpu_only") == 1088
    assert report["events"]["job.submitted"] == 8152 - 1088
    res = CliRunner().invoke(app, ["run", "--events", str(out), "--lake", str(tmp_path / "lake"),
                                   "--store", f"sqlite:///{tmp_path / 'x.db'}", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["dead_letters"] == {}


@needs_shared
def test_demo_on_the_real_trace(tmp_path):
    res = CliRunner().invoke(app, ["demo", "--trace", "alibaba-openb", "--trace-dir", str(OPENB),
                                   "--out", str(tmp_path / "d")])
    assert res.exit_code == 0, res.output
    assert "trace alibaba-openb" in res.output and "chip-hours by account per pool" in res.output
    con = connect(tmp_path / "d" / "lake")
    assert con.execute("SELECT count(*) FROM jobs").fetchone()[0] == 8152 - 1088


@needs_shared
def test_import_helios_cli(tmp_path):
    report = import_json("helios", VENUS, tmp_path / "venus.jsonl")
    assert report["events"]["quota.granted"] > 0 and report["pools"] == ["helios-venus/gpu"]


def test_import_sacct_cli(tmp_path):
    fixtures = sorted((Path(__file__).parent / "fixtures" / "sacct").glob("*.txt")) + \
        sorted((Path(__file__).parent / "fixtures" / "sacct").glob("*.psv"))
    assert fixtures, "sacct fixtures missing"
    out = tmp_path / "sacct.jsonl"
    res = CliRunner().invoke(app, ["import", "sacct", str(fixtures[0]), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "events written" in res.output and out.stat().st_size > 0


def test_import_errors_are_clear(tmp_path):
    res = CliRunner().invoke(app, ["import", "alibaba-openb", str(tmp_path / "nope"), "-o", str(tmp_path / "x")])
    assert res.exit_code == 1 and "does not exist" in res.output
    res = CliRunner().invoke(app, ["demo", "--trace", "nosuch", "--out", str(tmp_path / "d")])
    assert res.exit_code == 2 and "--trace must be one of" in res.output
    res = CliRunner().invoke(app, ["demo", "--trace", "alibaba-openb", "--trace-dir", str(tmp_path / "nope"),
                                   "--out", str(tmp_path / "d")])
    assert res.exit_code == 2 and "trace folder not found" in res.output
