"""The CLI as a user meets it: `chipledger run` and `chipledger sql` on a hand-computed fixture.

tests/fixtures/hand.jsonl: pool lab/a100 with 4 chips (c0..c3); team a has 2 chips of quota from 00:00, team b
1 chip from 01:00 (a grant sent at 00:00 with effective_from). Seven bad lines are mixed in. The expected
books below are computed by hand in milli-chip-seconds (1 chip for 1 s = 1000).

  ja1 (a, 3 chips) runs 00:40-02:00 on c0,c1,c2; c1 goes down 01:30 (a is not charged for it from then);
      checkpoint 01:45; preempted 02:00; runs again 02:10-03:00 on c0,c2,c3; a checkpoint stamped 02:25
      arrives after the 02:30 event, so it is applied at 02:30 (300 s late); fails at 03:00.
  jb1 (b, 1 chip, no placement) runs 01:15-02:40 and succeeds.
  c1 is down 01:30-02:30. 02:10-02:30: 4 chips charged on 3 available -> 1 chip overcommitted.
"""

from __future__ import annotations

import json
import sqlite3

import pytest
from typer.testing import CliRunner

from chipledger.cli import app

FIXTURE = "tests/fixtures/hand.jsonl"
H00, H01, H02, H03 = (f"2026-11-02T0{h}:00:00Z" for h in range(4))

EXPECTED_JOURNAL = {
    # hour 00: capacity 4 chips x 3600 s. ja1 00:40-01:00 (1200 s): 3 chips, 2 in quota, 1 borrowed.
    # idle: 4 chips x 2400 s + 1 chip x 1200 s.
    (H00, "capacity", None): 14_400_000,
    (H00, "idle", None): 10_800_000,
    (H00, "in_quota", "a"): 2_400_000,
    (H00, "borrowed", "a"): 1_200_000,
    (H00, "entitled", "a"): 7_200_000,
    # pending demand: ja1 (3 chips) waits 00:30-00:40
    (H00, "pending", "a"): 1_800_000,
    # hour 01: b's grant starts. ja1 3 chips until 01:30, then 2 (c1 down): in quota 2 x 3600, borrowed 1 x 1800.
    # jb1 01:15-02:00 in quota 1 x 2700. c1 unavailable 1 x 1800. idle 01:00-01:15: 1 chip x 900.
    (H01, "capacity", None): 14_400_000,
    (H01, "unavailable", None): 1_800_000,
    (H01, "idle", None): 900_000,
    (H01, "in_quota", "a"): 7_200_000,
    (H01, "borrowed", "a"): 1_800_000,
    (H01, "in_quota", "b"): 2_700_000,
    (H01, "entitled", "a"): 7_200_000,
    (H01, "entitled", "b"): 3_600_000,
    (H01, "pending", "b"): 900_000,     # jb1 (1 chip) waits 01:00-01:15
    # hour 02: ja1 02:10-03:00 3 chips (2 in quota, 1 borrowed) x 3000 s; jb1 02:00-02:40 1 chip x 2400 s;
    # c1 down 02:00-02:30; idle 02:00-02:10 2 chips x 600 s + 02:40-03:00 1 chip x 1200 s;
    # overcommitted 02:10-02:30 1 chip x 1200 s.
    (H02, "capacity", None): 14_400_000,
    (H02, "unavailable", None): 1_800_000,
    (H02, "idle", None): 2_400_000,
    (H02, "overcommitted", None): 1_200_000,
    (H02, "in_quota", "a"): 6_000_000,
    (H02, "borrowed", "a"): 3_000_000,
    (H02, "in_quota", "b"): 2_400_000,
    (H02, "entitled", "a"): 7_200_000,
    (H02, "entitled", "b"): 3_600_000,
    (H02, "pending", "a"): 1_800_000,   # ja1 (3 chips) waits again 02:00-02:10 after its preemption
    # hour 03: books closed at the 03:30 tick: 1800 s of an idle pool.
    (H03, "capacity", None): 7_200_000,
    (H03, "idle", None): 7_200_000,
    (H03, "entitled", "a"): 3_600_000,
    (H03, "entitled", "b"): 1_800_000,
}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    d = tmp_path_factory.mktemp("hand")
    runner = CliRunner()
    lake, db = d / "lake", d / "ledger.db"
    res = runner.invoke(app, ["run", "--events", FIXTURE, "--lake", str(lake), "--store", f"sqlite:///{db}",
                              "--json", "--check-invariants"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout), lake, db


def sql(lake, query, fmt="json"):
    res = CliRunner().invoke(app, ["sql", "--lake", str(lake), "--format", fmt, query])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout) if fmt == "json" else res.stdout


def test_run_counts(ran):
    summary, _, _ = ran
    assert summary["lines"] == 27
    assert summary["accepted"] == 20
    assert summary["duplicates"] == 1
    assert summary["late"] == 1
    assert summary["dead_letters"] == {"duplicate_conflict": 1, "not_json": 1, "schema_invalid": 1,
                                       "unknown_job": 1, "unknown_pool": 1, "unknown_type": 1}


def test_journal_exact(ran):
    _, lake, _ = ran
    rows = sql(lake, "SELECT hour, account, team, amount_mchip_s FROM journal")
    got = {(r["hour"], r["account"], r["team"]): r["amount_mchip_s"] for r in rows}
    assert got == EXPECTED_JOURNAL


def test_journal_conserves_every_hour(ran):
    _, lake, _ = ran
    rows = sql(lake, """
        SELECT hour,
          sum(amount_mchip_s) FILTER (WHERE account IN ('capacity', 'overcommitted')) AS lhs,
          sum(amount_mchip_s) FILTER (WHERE account IN ('unavailable', 'idle', 'in_quota', 'borrowed', 'burst')) AS rhs
        FROM journal GROUP BY hour ORDER BY hour""")
    assert len(rows) == 4
    assert all(r["lhs"] == r["rhs"] for r in rows), rows


def test_jobs_view(ran):
    _, lake, _ = ran
    rows = sql(lake, "SELECT * FROM jobs ORDER BY job_id")
    assert [r["job_id"] for r in rows] == ["ja1", "jb1"]
    ja1, jb1 = rows
    # run 1: 00:40-01:30 3 chips (9,000,000) + 01:30-02:00 2 chips (3,600,000); checkpoint at 01:45 saved
    # 10,800,000 -> lost 1,800,000. run 2: 3 chips x 3000 s = 9,000,000; checkpoint applied at 02:30 saved
    # 3,600,000 -> lost 5,400,000 when it failed.
    assert {k: ja1[k] for k in ("team", "chips", "priority", "submitted_at", "first_started_at",
                                                  "finished_at", "outcome", "preemptions", "allocated_mchip_s",
                                                  "lost_mchip_s")} == {
        "team": "a", "chips": 3.0, "priority": 10, "submitted_at": "2026-11-02T00:30:00Z",
        "first_started_at": "2026-11-02T00:40:00Z", "finished_at": "2026-11-02T03:00:00Z", "outcome": "failed",
        "preemptions": 1, "allocated_mchip_s": 21_600_000, "lost_mchip_s": 7_200_000}
    assert (jb1["outcome"], jb1["allocated_mchip_s"], jb1["lost_mchip_s"], jb1["first_started_at"]) == (
        "succeeded", 5_100_000, 0, "2026-11-02T01:15:00Z")


def test_deadletters_keep_raw_bytes(ran):
    import base64

    _, lake, _ = ran
    rows = sql(lake, 'SELECT "offset", error_code, event_id, raw_b64 FROM deadletters ORDER BY "offset"')
    assert [(r["offset"], r["error_code"]) for r in rows] == [
        (12, "duplicate_conflict"), (13, "not_json"), (14, "unknown_type"), (15, "schema_invalid"),
        (16, "unknown_job"), (17, "unknown_pool")]
    lines = open(FIXTURE, "rb").read().splitlines()
    for r in rows:
        assert base64.b64decode(r["raw_b64"]) == lines[r["offset"] - 1]


def test_late_event_recorded(ran):
    _, lake, _ = ran
    rows = sql(lake, "SELECT event_id, occurred_at, applied_at, lateness_s FROM events WHERE lateness_s > 0")
    assert rows == [{"event_id": "h-021", "occurred_at": "2026-11-02T02:25:00Z",
                     "applied_at": "2026-11-02T02:30:00Z", "lateness_s": 300}]


def test_store_balances(ran):
    summary, _, db = ran
    con = sqlite3.connect(db)
    teams = con.execute("SELECT team, nominal_milli, used_milli, entitled_mchip_s, in_quota_mchip_s, "
                        "borrowed_mchip_s FROM team_balances ORDER BY team").fetchall()
    assert teams == [("a", 2000, 0, 25_200_000, 15_600_000, 6_000_000),
                     ("b", 1000, 0, 9_000_000, 5_100_000, 0)]
    pool = con.execute("SELECT pool, chips, capacity_milli, applied, duplicates, rejected, late_events "
                       "FROM pool_balances").fetchall()
    # rejected counts the pool's own rejections (conflict, unknown job); parse failures never reach a pool
    assert pool == [("lab/a100", 4, 4000, 20, 1, 2, 1)]
    assert con.execute("SELECT consumer, partition, \"offset\" FROM tracking").fetchall() == [("embedded", 0, 27)]


def test_sql_formats(ran):
    _, lake, _ = ran
    out = sql(lake, "SELECT account, sum(amount_mchip_s) AS total FROM journal WHERE team = 'b' "
                    "GROUP BY account ORDER BY account", fmt="csv")
    assert out.splitlines() == ["account,total", "entitled,9000000", "in_quota,5100000", "pending,900000"]
    table = sql(lake, "SELECT count(*) AS n FROM events", fmt="table")
    assert "20" in table


def test_sql_error_is_clear(ran):
    _, lake, _ = ran
    res = CliRunner().invoke(app, ["sql", "--lake", str(lake), "SELECT nope FROM journal"])
    assert res.exit_code == 1
    assert "query failed" in res.output


def test_run_refuses_to_mix_lakes(ran, tmp_path):
    _, lake, _ = ran
    res = CliRunner().invoke(app, ["run", "--events", FIXTURE, "--lake", str(lake),
                                   "--store", f"sqlite:///{tmp_path / 'x.db'}"])
    assert res.exit_code == 1
    assert "--overwrite" in res.output


def test_run_missing_file(tmp_path):
    res = CliRunner().invoke(app, ["run", "--events", str(tmp_path / "nope.jsonl"), "--lake", str(tmp_path / "l"),
                                   "--store", f"sqlite:///{tmp_path / 'x.db'}"])
    assert res.exit_code == 1
    assert "does not exist" in res.output


def test_schema_export(tmp_path):
    res = CliRunner().invoke(app, ["schema", "export", str(tmp_path)])
    assert res.exit_code == 0, res.output
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "job.submitted.schema.json" in names and "pool.tick.schema.json" in names
    assert "decision.preempt.schema.json" in names and "deadletter.schema.json" in names
    schema = json.loads((tmp_path / "job.submitted.schema.json").read_text())
    assert schema["additionalProperties"] is False
    assert set(schema["required"]) >= {"event_id", "type", "occurred_at", "pool", "source", "job_id", "team", "chips"}
    assert "user" not in schema["required"]  # optional, added later: earlier producers' events stay valid
    user = [s for s in schema["properties"]["user"]["anyOf"] if s.get("type") == "string"][0]
    assert user["minLength"] == 1 and user["maxLength"] == 256 and user["pattern"] == "^[^\\x00-\\x1f\\x7f-\\x9f]*$"


def test_waits_fact(ran):
    """The fold's `waits` (docs/analytics.md): ja1 waits 00:30-00:40 (3 chips over a's 2: not in quota), jb1
    01:00-01:15 (b's grant starts at 01:00: in quota), ja1 again 02:00-02:10 after its preemption."""
    _, lake, _ = ran
    rows = sql(lake, 'SELECT job_id, run_index, kind, chips_milli, began_at, ended_at, "end", in_quota, borrowing '
                     "FROM waits ORDER BY began_at")
    assert [tuple(r.values()) for r in rows] == [
        ("ja1", 0, "first_start", 3000, "2026-11-02T00:30:00Z", "2026-11-02T00:40:00Z", "started", False,
         False),
        ("jb1", 0, "first_start", 1000, "2026-11-02T01:00:00Z", "2026-11-02T01:15:00Z", "started", True,
         False),
        ("ja1", 1, "restart", 3000, "2026-11-02T02:00:00Z", "2026-11-02T02:10:00Z", "started", False,
         False),
    ]


def test_free_chips_fact(ran):
    """The fold's `free_chips`: one row per second the free capacity changed (4 chips on one node n0)."""
    _, lake, _ = ran
    rows = sql(lake, "SELECT strftime(\"at\", '%H:%M') AS t, healthy_milli, in_use_milli, free_milli, "
                     "free_whole_nodes_milli AS whole, largest_startable_milli AS largest FROM free_chips ORDER BY 1")
    assert [tuple(r.values()) for r in rows] == [
        ("00:00", 4000, 0, 4000, 4000, 4000),
        ("00:40", 4000, 3000, 1000, 0, 1000),     # ja1 on c0-c2
        ("01:15", 4000, 4000, 0, None, None),     # jb1 runs without a placement: which chips are free is unknown
        ("01:30", 3000, 3000, 0, None, None),     # c1 down under ja1: a is not charged for it
        ("02:00", 3000, 1000, 2000, None, None),  # ja1 preempted
        ("02:10", 3000, 4000, 0, None, None),     # ja1 on c0, c2, c3: overcommitted (4 charged on 3)
        ("02:30", 4000, 4000, 0, None, None),     # c1 healthy again
        ("02:40", 4000, 3000, 1000, 0, 1000),  # jb1 done: c1 free, n0 not whole (ja1)
        ("03:00", 4000, 0, 4000, 4000, 4000),
    ]


def test_lake_upgrade_writes_the_facts_by_folding_the_events_again(ran, tmp_path):
    """A lake written before the fold wrote facts (here: the run's lake without them) gets them from
    `chipledger lake upgrade`: the same rows the run wrote; a second upgrade has nothing to do."""
    import shutil

    _, lake, _ = ran
    old = tmp_path / "old-lake"
    shutil.copytree(lake, old)
    for t in ("waits", "free_chips", "chip_states", "grant_intervals", "progress"):
        shutil.rmtree(old / t, ignore_errors=True)
    (old / "_lake.json").unlink()  # an earlier version wrote no manifest either
    # the views do not answer without the facts (they said "no wait" before): one line saying what to run
    refused = CliRunner().invoke(app, ["sql", "SELECT count(*) AS n FROM waits", "--lake", str(old)])
    assert refused.exit_code == 1 and f"chipledger lake upgrade --lake {old}" in refused.stderr
    res = CliRunner().invoke(app, ["lake", "upgrade", "--lake", str(old)])
    assert res.exit_code == 0, res.output
    assert ("folded 20 events again: waits 3 rows, free_chips 9 rows, progress 0 rows, chip_states 6 rows, "
            "grant_intervals 2 rows" in res.stderr)
    for q in ("SELECT * FROM wait_postings ORDER BY ALL", "SELECT * FROM free_chips ORDER BY ALL",
              "SELECT * FROM chip_state_changes ORDER BY ALL", "SELECT * FROM grant_postings ORDER BY ALL",
              "SELECT * FROM chip_states ORDER BY ALL", "SELECT * FROM grant_intervals ORDER BY ALL"):
        assert sql(old, q) == sql(lake, q)
    again = CliRunner().invoke(app, ["lake", "upgrade", "--lake", str(old)])
    assert again.exit_code == 0 and "nothing to upgrade" in again.stderr


def test_lake_upgrade_of_a_lake_without_grants_is_done_once(tmp_path):
    """A fact table the fold writes no row of (no quota.granted: no grant_intervals; no job: no waits) is an empty
    folder after `chipledger lake upgrade`, and a second upgrade has nothing to do (it folded the events again at
    every upgrade when it looked for Parquet files)."""
    import shutil

    lines = [line for line in open(FIXTURE) if '"pool.configured"' in line or '"chip.registered"' in line]
    events = tmp_path / "chips.jsonl"
    events.write_text("".join(lines))
    lake = tmp_path / "lake"
    res = CliRunner().invoke(app, ["run", "--events", str(events), "--lake", str(lake), "--store",
                                   f"sqlite:///{tmp_path / 'ledger.db'}"])
    assert res.exit_code == 0, res.output
    for t in ("waits", "free_chips", "chip_states", "grant_intervals"):
        shutil.rmtree(lake / t, ignore_errors=True)  # as a lake written before the fold wrote facts
    (lake / "_lake.json").unlink()  # and before commits
    first = CliRunner().invoke(app, ["lake", "upgrade", "--lake", str(lake)])
    assert first.exit_code == 0, first.output
    assert ("folded 5 events again: waits 0 rows, free_chips 1 rows, progress 0 rows, chip_states 4 rows, "
            "grant_intervals 0 rows" in first.stderr)
    from analytics.commits import read_manifest

    assert read_manifest(lake)["tables"]["grant_intervals"] == []  # an empty table, committed
    assert sql(lake, "SELECT count(*) AS n FROM grant_intervals") == [{"n": 0}]
    again = CliRunner().invoke(app, ["lake", "upgrade", "--lake", str(lake)])
    assert again.exit_code == 0 and "nothing to upgrade" in again.stderr and "folded" not in again.stderr


def test_lake_cache_is_retired_and_removes_an_old_cache(ran, tmp_path):
    import shutil

    _, lake, _ = ran
    copy = tmp_path / "lake"
    shutil.copytree(lake, copy)
    (copy / "_cache").mkdir()
    (copy / "_cache" / "analytics-0123.duckdb").write_bytes(b"old")
    res = CliRunner().invoke(app, ["lake", "cache", "--lake", str(copy)])
    assert res.exit_code == 0, res.output
    assert not (copy / "_cache").exists()
    assert "the analytics cache is retired" in res.stderr
