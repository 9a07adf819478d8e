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


def test_the_demo_cluster_acts_on_the_ledgers_decisions(demo_lake_of):
    """The seeded demo a new user runs (`chipledger demo`: seed 7, 14 days): the simulated cluster preempts the
    victims the ledger's decisions name, with the decision's id, so statements can say which decision and for
    which team; bursts are approved, cut and denied; the capacity, goodput budgets hold."""
    con = connect(demo_lake_of(14, 7))
    with_id, known, preempted = con.execute("""
        SELECT count(*) FILTER (WHERE body->>'decision_id' IS NOT NULL),
               count(*) FILTER (WHERE body->>'decision_id' IN (SELECT decision_id FROM decisions)), count(*)
        FROM events WHERE type = 'job.preempted'""").fetchone()
    # every named decision exists; the preemptions without one are the cluster's own (chip failures, maintenance)
    assert with_id == known and with_id >= 0.8 * preempted and with_id > 50
    # each victim preempted for a decision was one the decision named
    stray = con.execute("""
        SELECT count(*) FROM events e WHERE type = 'job.preempted' AND body->>'decision_id' IS NOT NULL
          AND NOT EXISTS (SELECT 1 FROM decision_victims v WHERE v.decision_id = e.body->>'decision_id'
                          AND v.job_id = e.job_id)""").fetchone()[0]
    assert stray == 0
    acted = con.execute("SELECT count(*) FROM decision_victims WHERE preempted_at IS NOT NULL").fetchone()[0]
    assert acted == with_id
    verdicts = dict(con.execute("SELECT verdict, count(*) FROM decisions WHERE type = 'decision.burst' "
                                "GROUP BY ALL").fetchall())
    assert set(verdicts) == {"approved", "partial", "denied"}, verdicts
    # an approved burst was used: burst chip-seconds in the journal
    assert con.execute("SELECT sum(amount_mchip_s) FROM journal WHERE account = 'burst'").fetchone()[0] > 0
    budgets = dict(con.execute("SELECT slo, remaining FROM error_budget WHERE pool IS NULL").fetchall())
    assert budgets["availability"] > 0 and budgets["goodput"] > 0, budgets
    # the statements' decision and beneficiary columns are filled
    from chipledger.reports.statements import compute_statements, parse_period

    sts = compute_statements(con, parse_period("2026-W46"))
    jobs = [j for st in sts for j in st["preemptions"]["suffered"]["jobs"]]
    assert sum(1 for j in jobs if j["decision_id"] and j["beneficiary_team"]) >= 0.5 * len(jobs) > 0


def test_after_the_demo_the_next_commands_read_its_lake(tmp_path, monkeypatch):
    """Issue 35, item 10: after `make demo` (chipledger demo, out demo/) in a folder, the obvious next
    commands need no --lake: with no ./lake they read demo/lake and say so on stderr."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    res = runner.invoke(app, ["demo", "--days", "2", "--seed", "3"])
    assert res.exit_code == 0, res.output
    assert "next, on this lake" in res.output and "  chipledger report\n" in res.output
    for args in (["report"], ["pending"], ["alerts"], ["sql", "SELECT count(*) AS n FROM jobs"]):
        res = runner.invoke(app, args)
        assert res.exit_code in (0, 1, 2) if args == ["alerts"] else res.exit_code == 0, (args, res.output)
        assert "does not exist" not in res.output, args
        assert "reading the demo's lake demo/lake" in res.stderr, args
    # a ./lake of one's own wins, and an explicit --lake is never replaced
    res = runner.invoke(app, ["report", "--lake", "elsewhere"])
    assert res.exit_code != 0 and "elsewhere does not exist" in res.stderr
