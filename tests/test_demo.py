"""`chipledger demo` as a user runs it: a seeded scenario end to end on the embedded default."""

from __future__ import annotations

from typer.testing import CliRunner

from analytics.views import connect
from chipledger.cli import app


def test_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    res = CliRunner().invoke(app, ["demo", "--days", "3", "--seed", "3", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "chip-hours by account per pool" in res.output
    assert "each team's use against its quota" in res.output
    con = connect(out / "lake")
    pools = con.execute("SELECT count(DISTINCT pool) FROM journal").fetchone()[0]
    teams = con.execute("SELECT count(DISTINCT team) FROM journal WHERE account = 'entitled'").fetchone()[0]
    assert pools >= 3 and teams >= 5
    # the scenario has failures, checkpoints and preemptions: they show in the books
    counts = dict(con.execute("SELECT type, count(*) FROM events GROUP BY type").fetchall())
    for kind in ("job.checkpointed", "chip.state_changed", "job.finished", "quota.granted"):
        assert counts.get(kind, 0) > 0, kind
    assert con.execute("SELECT count(*) FROM jobs WHERE outcome = 'failed'").fetchone()[0] > 0
    # the corrupted lines became dead letters, and the books balance in every pool and hour
    assert con.execute("SELECT count(*) FROM deadletters").fetchone()[0] > 0
    unbalanced = con.execute("""
        SELECT count(*) FROM (
          SELECT pool, hour,
            sum(amount_mchip_s) FILTER (WHERE account IN ('capacity', 'overcommitted')) AS lhs,
            sum(amount_mchip_s) FILTER (WHERE account IN ('unavailable', 'idle', 'in_quota', 'borrowed', 'burst')) AS rhs
          FROM journal GROUP BY pool, hour) WHERE lhs IS DISTINCT FROM rhs""").fetchone()[0]
    assert unbalanced == 0


def test_demo_is_reproducible(tmp_path):
    runner = CliRunner()
    for name in ("a", "b"):
        res = runner.invoke(app, ["demo", "--days", "1", "--seed", "5", "--out", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
    assert (tmp_path / "a" / "events.jsonl").read_bytes() == (tmp_path / "b" / "events.jsonl").read_bytes()
    q = "SELECT pool, hour, account, team, amount_mchip_s FROM journal ORDER BY ALL"
    a = connect(tmp_path / "a" / "lake").execute(q).fetchall()
    b = connect(tmp_path / "b" / "lake").execute(q).fetchall()
    assert a == b and len(a) > 0


def test_demo_issues_the_first_closed_week_statements(tmp_path):
    out = tmp_path / "demo"
    res = CliRunner().invoke(app, ["demo", "--days", "8", "--seed", "3", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "quota statements for 2026-W45" in res.output
    con = connect(out / "lake")
    teams = {r[0] for r in con.execute("SELECT DISTINCT team FROM journal WHERE team IS NOT NULL").fetchall()}
    written = {p.stem for p in (out / "statements" / "2026-W45").glob("*.json")}
    assert written and written == {t.replace("/", "%2F") for t in teams}
    assert all((out / "statements" / "2026-W45" / f"{t}.html").is_file() for t in written)
