"""The throughput SLO as a user meets it, through the CLI in a subprocess: `chipledger run` of the hand-computed
log of tests/test_throughput.py, then `sql`, `report`, `why`, `statements` and `slo rules`; an imported trace
without progress; and the demo, whose degraded chips slow its training jobs down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_throughput import SCENARIO, pool

CLI = str(Path(sys.executable).parent / "chipledger")
FIXTURES = Path(__file__).parent / "fixtures"
TOML = "[slo]\nthroughput_reference_s = 300\nthroughput_reference_reports = 3\n"


def cli(*args, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "250"}
    res = subprocess.run([CLI, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    if check:
        assert res.returncode == 0, res.stdout + res.stderr
    return res


@pytest.fixture(scope="module")
def hand(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("throughput")
    lines = [e.model_dump_json(exclude_none=True) for e in pool()] + \
            [e.model_dump_json(exclude_none=True) for e, _ in SCENARIO]
    (d / "events.jsonl").write_text("\n".join(lines) + "\n")
    (d / "chipledger.toml").write_text(TOML)
    res = cli("run", "--events", "events.jsonl", "--lake", "lake", "--store", "sqlite:///s.db", "--json", cwd=d)
    summary = json.loads(res.stdout)
    assert summary["dead_letters"]["progress_backwards"] == 4
    return d


def sql(d: Path, query: str):
    return json.loads(cli("sql", "--lake", "lake", "--format", "json", query, cwd=d).stdout)


def test_sql_throughput_and_slo_views(hand):
    (run1, run2) = sql(hand, "SELECT * FROM throughput ORDER BY run_index")
    assert (run1["slow_s"], run1["slow_mchip_s"], run1["judged_mchip_s"]) == (200, 800_000, 1_400_000)
    assert run1["reference_units_per_chip_s"] == 1.0 and run1["slowest_fraction"] == 0.75
    assert run1["unhealthy_chips_while_slow"] == "c3:degraded"
    assert run1["chips_held_while_slow"] == "c1:healthy,c2:healthy,c3:degraded,c4:healthy"
    assert (run2["slow_s"], run2["judged_mchip_s"], run2["attainment"]) == (0, 750_000, 1.0)
    (day,) = sql(hand, "SELECT * FROM slo_throughput")
    assert (day["team"], day["judged_mchip_s"], day["good_mchip_s"], day["slow_s"]) == ("a", 2_150_000, 1_350_000, 200)
    (budget,) = sql(hand, "SELECT * FROM error_budget WHERE slo = 'throughput' AND pool IS NOT NULL")
    assert (budget["good"], budget["total"], budget["unit"]) == (1_350_000, 2_150_000, "mchip_s")
    alerts = sql(hand, "SELECT alert FROM burn_alerts WHERE slo = 'throughput'")
    assert sorted(a["alert"] for a in alerts) == ["budget_exhausted", "page_1h", "page_6h", "ticket_3d"]


def test_report_shows_the_throughput_and_the_degraded_chip(hand):
    out = cli("report", "--lake", "lake", cwd=hand).stdout
    assert "Throughput of running jobs" in out
    line = next(ln for ln in out.splitlines() if "c3:degraded" in ln)
    assert "62.79%" in line and "200" in line
    budget = next(ln for ln in out.splitlines() if ln.strip("│ ").startswith("throughput"))
    assert "1,350,000 / 2,150,000 mchip_s" in budget


def test_why_says_when_and_how_much_the_job_slowed(hand):
    out = cli("why", "j1", "--lake", "lake", cwd=hand).stdout
    assert "run 1: 0.9231 step/chip-s, reference 1; slow 3m 20s" in out
    assert ("run 1: 2026-11-02T08:06:40Z … 2026-11-02T08:10:00Z (3m 20s), down to 75% of its reference rate; "
            "unhealthy chips held: c3:degraded") in out
    doc = json.loads(cli("why", "j1", "--lake", "lake", "--json", cwd=hand).stdout)
    assert doc["slowdowns"] == [[1, "2026-11-02T08:06:40Z", "2026-11-02T08:10:00Z", 200, 0.75, "c3:degraded"]]


def test_the_team_statement_says_how_much_ran_slow_and_where(hand):
    cli("statements", "--period", "2026-11", "--lake", "lake", "--out", "st", "--store", "sqlite:///s.db",
        "--format", "md,json", cwd=hand)
    st = json.loads((hand / "st" / "2026-11" / "a.json").read_text())
    tp = st["throughput"]
    assert (tp["judged_mchip_s"], tp["slow_mchip_s"], tp["slow_s"], tp["met"]) == (2_150_000, 800_000, 200, False)
    assert tp["slow_on_chips"] == [{"pool": "us-east1-a/h100", "chip_id": "c3", "state": "degraded",
                                    "slow_mchip_s": 800_000}]
    md = (hand / "st" / "2026-11" / "a.md").read_text()
    assert "0.2 chip-hours ran slow (200 job-seconds), on unhealthy chips: c3 (degraded, 0.2 chip-h)" in md
    b = json.loads((hand / "st" / "2026-11" / "b.json").read_text())["throughput"]
    assert (b["jobs_reporting"], b["attainment"], b["met"]) == (0, None, None)
    assert "no job of the team reported progress" in (hand / "st" / "2026-11" / "b.md").read_text()


def test_slo_rules_have_the_throughput_counters(hand):
    out = cli("slo", "rules", cwd=hand).stdout
    assert "chipledger_progress_judged_chip_seconds_total" in out and 'slo="throughput"' in out


def test_an_imported_trace_without_progress_leaves_the_slo_empty_and_says_so(tmp_path):
    trace = FIXTURES / "helios"
    cli("import", "helios", trace, "--out", "events.jsonl", cwd=tmp_path)
    cli("run", "--events", "events.jsonl", "--lake", "lake", "--store", "sqlite:///s.db", cwd=tmp_path)
    assert sql(tmp_path, "SELECT count(*) AS n FROM progress") == [{"n": 0}]
    out = cli("report", "--lake", "lake", cwd=tmp_path).stdout
    assert "no job reported progress in the period" in out
    assert "no progress reported" in next(ln for ln in out.splitlines() if ln.strip("│ ").startswith("throughput"))


def test_the_demo_reports_progress_and_names_its_degraded_chips(tmp_path):
    cli("demo", "--days", "3", "--seed", "3", "--out", "demo", cwd=tmp_path)
    (t,) = sql(tmp_path / "demo", "SELECT count(*) AS n, count(*) FILTER (WHERE slow) AS slow, "
                                  "count(*) FILTER (WHERE slow AND unhealthy_chips = '') AS slow_no_cause "
                                  "FROM progress")
    assert t["n"] > 100 and t["slow"] > 0
    # a slow interval of the demo is always one on a degraded chip (its jobs step at ±5% of their pace otherwise)
    assert t["slow_no_cause"] == 0
    out = cli("report", "--lake", "demo/lake", cwd=tmp_path).stdout
    assert "Throughput of running jobs" in out and ":degraded" in out


def test_the_portable_throughput_views_agree_on_sqlite(hand):
    """slo_throughput and the throughput points of the error budget are portable SQL (analytics/slo_views.py): the
    same rows on DuckDB and on SQLite over the same base rows."""
    from analytics.sqlite_mirror import mirror
    from analytics.views import connect

    duck = connect(hand / "lake")
    lite = mirror(duck)
    for sql in ("SELECT pool, team, jobs_reporting, intervals, reported_mchip_s, judged_mchip_s, good_mchip_s, "
                "slow_mchip_s, slow_s, attainment FROM slo_throughput",
                "SELECT slo, pool, at_s, good, total FROM calc_sli_points WHERE slo = 'throughput' ORDER BY at_s"):
        assert duck.execute(sql).fetchall() == lite.execute(sql).fetchall() != []
