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


def _ev(n, typ, minute, **fields):
    from datetime import datetime, timedelta, timezone

    at = datetime(2026, 11, 2, tzinfo=timezone.utc) + timedelta(minutes=minute)
    return json.dumps({"event_id": f"e{n}", "type": typ, "occurred_at": at.isoformat().replace("+00:00", "Z"),
                       "pool": "lab/a100", "source": "lab/kueue", **fields})


@pytest.fixture(scope="module")
def why_lake(tmp_path_factory):
    """8 chips; team a: quota 2 + borrowing limit 1, team b: quota 6. j-big (a, 4 chips) can never start under
    these grants (1 short), j-huge (b, 10 chips) never in this pool (2 short); j-gone was cancelled before it ran;
    j-ok ran and finished."""
    tmp = tmp_path_factory.mktemp("why")
    rows = [("pool.configured", 0, {"flavor": "a100", "chips_per_node": 4})]
    rows += [("chip.registered", 0, {"chip_id": f"c{i}", "node": f"n{i // 4}"}) for i in range(8)]
    rows += [("quota.granted", 0, {"grant_id": "g-a", "team": "a", "chips": 2, "borrowing_limit": 1}),
             ("quota.granted", 0, {"grant_id": "g-b", "team": "b", "chips": 6}),
             ("job.submitted", 10, {"job_id": "j-big", "team": "a", "chips": 4, "priority": 0}),
             ("job.submitted", 10, {"job_id": "j-huge", "team": "b", "chips": 10, "priority": 0}),
             ("job.submitted", 20, {"job_id": "j-gone", "team": "a", "chips": 1, "priority": 0}),
             ("job.finished", 30, {"job_id": "j-gone", "outcome": "cancelled"}),
             ("job.submitted", 20, {"job_id": "j-ok", "team": "b", "chips": 1, "priority": 5}),
             ("job.started", 21, {"job_id": "j-ok"}),
             ("job.finished", 50, {"job_id": "j-ok", "outcome": "succeeded"}),
             ("pool.tick", 120, {})]
    rows.sort(key=lambda r: r[1])
    src = tmp / "events.jsonl"
    src.write_text("".join(_ev(i, t, m, **f) + "\n" for i, (t, m, f) in enumerate(rows)))
    res = runner.invoke(app, ["run", "--events", str(src), "--lake", str(tmp / "lake"),
                              "--store", f"sqlite:///{tmp / 'w.db'}"])
    assert res.exit_code == 0, res.output
    return tmp / "lake"


def test_why_says_a_job_can_never_start_and_by_how_much(why_lake):
    """Item 5: 32 chips against quota 18 + borrowing limit 11 was "would start when its team's own jobs
    finish"."""
    res = runner.invoke(app, ["why", "j-big", "--lake", str(why_lake)])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0] == "job j-big (team a, pool lab/a100): pending"
    assert lines[1] == ("  cannot start: it asks for 4 chips and team a may hold at most 3 in lab/a100 under the "
                        "current grants (quota 2 + borrowing limit 1): 1 chips short, whatever else runs")
    assert "  would start when: a larger quota or borrowing_limit for team a (by at least 1 chips)" in res.stdout
    doc = json.loads(runner.invoke(app, ["why", "j-big", "--lake", str(why_lake), "--json"]).stdout)
    assert doc["short_chips"] == 1.0 and doc["status"] == "pending"
    res = runner.invoke(app, ["why", "j-huge", "--lake", str(why_lake)])
    assert ("  cannot start: it asks for 10 chips and pool lab/a100 has 8 registered: 2 chips short, whatever else "
            "runs") in res.stdout.splitlines()


def test_why_on_a_cancelled_job_that_never_ran_and_on_a_finished_job(why_lake):
    """Item 5 and 12: a job cancelled before it ever ran is not "finished"; a finished job's timeline."""
    res = runner.invoke(app, ["why", "j-gone", "--lake", str(why_lake)])
    lines = res.stdout.splitlines()
    assert lines[0] == "job j-gone (team a, pool lab/a100): cancelled before it ever started"
    assert lines[-2:] == ["    2026-11-02T00:20:00Z  submitted: 1 chips, priority 0",
                          "    2026-11-02T00:30:00Z  finished: cancelled (it never ran)"]
    assert json.loads(runner.invoke(app, ["why", "j-gone", "--lake", str(why_lake), "--json"]).stdout)["status"] \
        == "cancelled"
    res = runner.invoke(app, ["why", "j-ok", "--lake", str(why_lake)])
    lines = res.stdout.splitlines()
    assert lines[0] == "job j-ok (team b, pool lab/a100): finished, succeeded"
    assert lines[lines.index("  timeline:") + 1:] == [
        "    2026-11-02T00:20:00Z  submitted: 1 chips, priority 5", "    2026-11-02T00:21:00Z  started (run 1)",
        "    2026-11-02T00:50:00Z  finished: succeeded"]


def test_slurm_actuate_dry_run_lists_each_victim_and_why_it_is_skipped(tmp_path, monkeypatch):
    """Items 9 and 12: `slurm actuate --dry-run` printed only counts; it lists each decision's victims, what would
    be done to each and why one is skipped, and --json says the same for scripts."""
    import chipledger.adapters.slurm.actuate as actuate

    states = {"4": "RUNNING", "5": "COMPLETED"}
    monkeypatch.setattr(actuate, "Ops", lambda: _FakeOps(states))
    decisions = tmp_path / "decisions.jsonl"
    rows = [{"decision_id": "d-1", "type": "decision.preempt", "pool": "c1/h100", "rule": "reclaim",
             "beneficiary": {"job_id": "7", "team": "nlp"},
             "victims": [{"job_id": "4", "team": "speech", "chips": 16}, {"job_id": "5", "team": "speech", "chips": 8}]},
            {"decision_id": "d-2", "type": "decision.preempt", "pool": "c2/a100", "rule": "reclaim",
             "beneficiary": {"job_id": "8", "team": "nlp"}, "victims": [{"job_id": "9", "team": "ads", "chips": 4}]}]
    decisions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["slurm", "actuate", "--cluster", "c1", "--decisions", str(decisions), "--state", str(tmp_path / "s"),
            "--dry-run"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    out = res.stdout.splitlines()
    assert any("d-1" in ln and " 4 " in ln and "speech" in ln and "would requeue" in ln for ln in out), res.stdout
    assert any("d-1" in ln and " 5 " in ln and "skipped: not running (completed)" in ln for ln in out), res.stdout
    assert any("d-2" in ln and "decision skipped: pool c2/a100 is not of cluster c1" in ln for ln in out), res.stdout
    assert out[-1] == "decisions 2 applied 1 gone 1 skipped 1 (dry run)"
    doc = json.loads(runner.invoke(app, args + ["--json"]).stdout)
    assert doc["dry_run"] and doc["totals"] == {"decisions": 2, "applied": 1, "gone": 1, "skipped": 1}
    assert doc["decisions"][0]["victims"] == [
        {"job_id": "4", "team": "speech", "chips": 16, "done": "would requeue"},
        {"job_id": "5", "team": "speech", "chips": 8, "skipped": "not running (completed)"}]
    assert doc["decisions"][1]["skipped"] == "pool c2/a100 is not of cluster c1"


class _FakeOps:
    def __init__(self, states):
        self.states = states

    def job_state(self, job):
        return self.states.get(job)

    def mark(self, job, comment):
        raise AssertionError("a dry run changes nothing")

    requeue = cancel = mark


def test_statements_per_flavor_folded_tables_and_a_period_after_the_books(demo_lake_of, tmp_path):
    """Item 11: "(total)" added A100, H100 and TPU chip-hours; the preemptions table was not folded at 50 rows and
    wrapped ids; the fair-share factor had 6 decimals; a period after the books' end wrote all-zero files, exit 0."""
    lake = demo_lake_of(14, 7)
    res = runner.invoke(app, ["statements", "--lake", str(lake), "--period", "2026-11-02..2026-11-15", "--team",
                              "ads-ml", "--out", str(tmp_path / "st"), "--store", f"sqlite:///{tmp_path / 's.db'}"])
    assert res.exit_code == 0, res.output
    folder = tmp_path / "st" / "2026-11-02..2026-11-15"
    st = json.loads((folder / "ads-ml.json").read_text())
    flavors = [t["flavor"] for t in st["totals"]]
    assert flavors == ["a100-40gb", "h100-80gb", "tpu-v5e"]
    csv = (folder / "ads-ml.csv").read_text().splitlines()
    assert [r.split(",")[2] for r in csv if "(total" in r] == [f"(total {f})" for f in flavors]
    md = (folder / "ads-ml.md").read_text()
    assert "| | a100-40gb chip-hours | h100-80gb chip-hours | tpu-v5e chip-hours |" in md
    assert "Chips of different flavors are not added up" in md
    suffered = st["preemptions"]["suffered"]["jobs"]
    assert len(suffered) > 50
    section = md.split("## Preemptions suffered")[1].split("## Preemptions caused")[0]
    assert sum(1 for line in section.splitlines() if line.startswith("| 2026-")) == 50
    assert f"… and {len(suffered) - 50} more (the first 50 shown" in section
    fair = md.split("## Fair share")[1].split("##")[0]
    factors = [line.split("|")[3].strip() for line in fair.splitlines() if line.startswith("| us-")]
    assert factors and all(len(f.split(".")[1]) == 3 for f in factors if f != "n/a")
    html = (folder / "ads-ml.html").read_text()
    assert f"<details><summary>{len(suffered) - 50} more</summary>" in html and 'td.id { white-space: nowrap; }' in html
    # a period that starts after the books end is an error, and writes nothing
    res = runner.invoke(app, ["statements", "--lake", str(lake), "--period", "2026-12", "--out", str(tmp_path / "x"),
                              "--store", f"sqlite:///{tmp_path / 's.db'}"])
    assert res.exit_code == 2 and not (tmp_path / "x").exists()
    assert res.stderr.splitlines() == ["error: period 2026-12 starts at 2026-12-01T00:00:00Z, after the books end "
                                       "(2026-11-16T00:00:00Z): nothing to state yet (a period up to 2026-11-16 is "
                                       "partial)"]


def test_the_reports_demand_heatmap_is_per_pool(demo_lake_of):
    """Item 11: the report's demand heat map added the chips of unlike pools; one map per pool."""
    from analytics.views import connect
    from chipledger.reports import charts
    from chipledger.reports.report import build_report

    rep = build_report(connect(demo_lake_of(14, 7), materialize=True))
    assert sorted(rep.heatmaps) == ["us-central1-c/a100-40gb", "us-east1-a/h100-80gb", "us-west4-a/tpu-v5e"]
    assert rep.heatmap == []  # no one map of every pool
    fig = charts.heatmap_charts(rep.heatmaps)
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == sorted(rep.heatmaps)
    one = build_report(connect(demo_lake_of(14, 7), materialize=True), pool="us-west4-a/tpu-v5e")
    assert list(one.heatmaps) == ["us-west4-a/tpu-v5e"] and one.heatmap == one.heatmaps["us-west4-a/tpu-v5e"]


def test_sql_dot_commands_as_the_argument(waiting_lake):
    """Item 12: `chipledger sql ".tables"` was a DuckDB parser error, and .tables listed the internal views."""
    res = runner.invoke(app, ["sql", "--lake", str(waiting_lake), ".tables"])
    assert res.exit_code == 0, res.output
    views = res.stdout.split()
    assert {"journal", "jobs", "pending", "error_budget", "burn_alerts"} <= set(views)
    assert not [v for v in views if v.startswith(("base_", "calc_"))]
    res = runner.invoke(app, ["sql", "--lake", str(waiting_lake), ".schema jobs"])
    assert res.exit_code == 0 and "job_id" in res.stdout
    res = runner.invoke(app, ["sql", "--lake", str(waiting_lake), ".nope"])
    assert res.exit_code == 1 and "unknown command .nope" in res.stderr


def test_one_exit_code_scheme(waiting_lake, tmp_path):
    """Item 12: exit codes differed between commands for the same error; docs/cli.md, "Exit codes": 1 the command
    could not do its work (here: no lake), 2 the command line is wrong (an unknown name), alerts 3 for any error."""
    nowhere = str(tmp_path / "nowhere")
    for args in (["report"], ["pending"], ["why", "j1"], ["statements", "--period", "2026-11"], ["sql", "SELECT 1"],
                 ["lake", "upgrade"], ["serve-metrics"]):
        res = runner.invoke(app, [*args, "--lake", nowhere])
        assert res.exit_code == 1, (args, res.output)
        assert len(res.stderr.splitlines()) == 1 and res.stderr.startswith("error: "), (args, res.stderr)
    for args in (["report", "--pool", "x/y"], ["pending", "--pool", "x/y"], ["pending", "--team", "nobody"]):
        res = runner.invoke(app, [*args, "--lake", str(waiting_lake)])
        assert res.exit_code == 2 and res.stderr.startswith("error: unknown "), (args, res.output)
    assert runner.invoke(app, ["alerts", "--lake", nowhere]).exit_code == 3


def test_pending_says_as_of_when_and_takes_at(waiting_lake):
    """Item 12: `pending` gains "as of" and --at (the queue at the latest close of the books at or before it)."""
    res = runner.invoke(app, ["pending", "--lake", str(waiting_lake)])
    assert res.exit_code == 0, res.output
    assert "as of 2026-11-02T09:06:40Z (the latest close of the books)" in res.stdout
    res = runner.invoke(app, ["pending", "--lake", str(waiting_lake), "--at", "2026-11-02T09:05:00Z"])
    assert res.exit_code == 0, res.output
    assert "as of 2026-11-02T09:00:00Z (the latest close of the books at or before 2026-11-02T09:05:00Z)" in res.stdout
    assert any(" a1 " in line for line in res.stdout.splitlines())
    [row] = json.loads(runner.invoke(app, ["pending", "--lake", str(waiting_lake), "--at", "2026-11-02T09:05:00Z",
                                           "--json"]).stdout)
    assert (row["job_id"], row["at"]) == ("a1", "2026-11-02T09:00:00Z")
    res = runner.invoke(app, ["pending", "--lake", str(waiting_lake), "--at", "2026-11-02T08:10:00Z"])
    assert res.exit_code == 1 and "no close of the books at or before --at 2026-11-02T08:10:00Z" in res.stderr
    res = runner.invoke(app, ["pending", "--lake", str(waiting_lake), "--at", "noon"])
    assert res.exit_code == 2


def test_lake_upgrade_json(tmp_path):
    """Item 9: `lake upgrade --json` says what was done, for scripts."""
    from test_lake_commits import HAND, _layout_one, cli, run

    lake = tmp_path / "lake"
    assert run(HAND, lake).exit_code == 0
    _layout_one(lake)
    (lake / "waits").rename(tmp_path / "waits-gone")
    up = cli("lake", "upgrade", "--lake", lake, "--json")
    assert up.exit_code == 0, up.output
    doc = json.loads(up.stdout)
    assert (doc["layout_before"], doc["layout"], doc["upgraded"]) == (1, 2, True)
    assert sum(doc["adopted_files"].values()) > 0
    assert {"waits", "progress"} <= set(doc["refolded"]["rows"])
    again = json.loads(cli("lake", "upgrade", "--lake", lake, "--json").stdout)
    assert again["upgraded"] is False and again["refolded"] is None


def test_long_commands_show_progress_on_a_terminal_only(monkeypatch, why_lake, tmp_path):
    """Item 12: long commands were silent until done; on a terminal a spinner says what they do, and in a pipe or a
    log nothing is written (no escape codes)."""
    import chipledger.cli._common as common

    buf = io.StringIO()
    monkeypatch.setattr(common, "err", Console(file=buf, force_terminal=True, width=80))
    with common._working("issuing the statements of 2026-11…"):
        pass
    assert "issuing the statements of 2026-11…" in buf.getvalue()
    monkeypatch.undo()
    res = runner.invoke(app, ["statements", "--lake", str(why_lake), "--period", "2026-11-02..2026-11-02",
                              "--out", str(tmp_path / "st"), "--store", f"sqlite:///{tmp_path / 's.db'}"])
    assert res.exit_code == 0, res.output
    assert "\x1b[" not in res.stdout + res.stderr and "issuing" not in res.stderr


def test_statements_json_totals_are_per_flavor_and_cost_per_unit(demo_lake_of, tmp_path):
    """Issue 36: `statements --format json` had a `totals` adding every pool's chip-hours across unlike chips (A100,
    H100 and TPU hours as one number). Now as the Markdown, HTML and CSV: `totals` one block per flavor (its pools
    added), `daily` per flavor and day, and across flavors only money, `cost.totals` one per unit."""
    lake = demo_lake_of(14, 7)
    res = runner.invoke(app, ["statements", "--lake", str(lake), "--period", "2026-11-02..2026-11-08", "--team",
                              "ads-ml", "--format", "json", "--out", str(tmp_path / "st"),
                              "--store", f"sqlite:///{tmp_path / 's.db'}"])
    assert res.exit_code == 0, res.output
    st = json.loads((tmp_path / "st" / "2026-11-02..2026-11-08" / "ads-ml.json").read_text())
    assert st["schema"] == "chipledger.statement/2" and "totals_by_flavor" not in st
    pools_of: dict = {}
    for p in st["pools"]:
        pools_of.setdefault(p["flavor"], []).append(p)
    assert len(pools_of) == 3  # A100, H100 and TPU pools: three totals, none across them
    accounts = ("entitled", "in_quota", "borrowed", "burst", "used", "unused_entitlement", "pending")
    assert [t["flavor"] for t in st["totals"]] == sorted(pools_of)
    for t in st["totals"]:
        mine = pools_of[t["flavor"]]
        assert t["pools"] == [p["pool"] for p in mine]
        for a in accounts:
            assert t[f"{a}_mchip_s"] == sum(p[f"{a}_mchip_s"] for p in mine), (t["flavor"], a)
            assert t[f"{a}_chip_h"] == pytest.approx(t[f"{a}_mchip_s"] / 3_600_000, abs=5e-4)  # 3 decimals
        for a in ("entitled", "in_quota", "borrowed", "burst"):
            assert sum(d[f"{a}_mchip_s"] for d in st["daily"] if d["flavor"] == t["flavor"]) == t[f"{a}_mchip_s"]
    assert {d["flavor"] for d in st["daily"]} <= set(pools_of)
    cost = st["cost"]
    assert cost["priced"] and cost["totals"]
    units = [t["unit"] for t in cost["totals"]]
    assert len(units) == len(set(units))  # one money total per unit
    for t in cost["totals"]:
        assert t["total_scaled"] == sum(c["total_scaled"] for c in cost["by_pool"] if c["unit"] == t["unit"])
    assert {c["flavor"] for c in cost["by_pool"]} == set(pools_of)

