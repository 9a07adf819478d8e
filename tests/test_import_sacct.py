"""The Slurm `sacct --parsable2` importer: parsing, the event sequence it writes, and what the ledger makes of it.

Fixtures in tests/fixtures/sacct/ are written as sacct prints them:
- two_partitions_new_york.txt: `TZ=America/New_York sacct -a -D --parsable2 --format=JobID,User,Account,Partition,
  QOS,Priority,Submit,Start,End,State,AllocTRES,ReqTRES,NodeList` across the 2024-03-10 DST change (02:00 EST →
  03:00 EDT), with job steps, a non-GPU partition, a heterogeneous job, an array with a pending range, requeued
  runs (-D), a garbled line and an impossible time.
- legacy_parsable_utc.txt: `sacct -p` (trailing `|`), required columns only, a cluster tracking typed GPUs only.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import pytest
from typer.testing import CliRunner

from analytics.views import connect
from chipledger.cli import app
from chipledger.embedded import run_file
from chipledger.adapters.importers.base import TraceFormatError
from chipledger.adapters.importers.sacct import _array_tasks, _Clock, _gpus, _Skip, _state, import_sacct

FIXTURES = Path(__file__).parent / "fixtures" / "sacct"
NEW_YORK = FIXTURES / "two_partitions_new_york.txt"
LEGACY = FIXTURES / "legacy_parsable_utc.txt"
TZ = "America/New_York"


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def new_york(tmp_path_factory):
    d = tmp_path_factory.mktemp("sacct")
    out = d / "events.jsonl"
    report = import_sacct(NEW_YORK, out, tz=TZ)
    summary, _ = run_file(out, d / "lake", overwrite=True)
    return report, _events(out), summary, d / "lake"


# ---------------------------------------------------------------------------------------------------------
# parsing pieces
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tres, expected", [
    ("billing=8,cpu=8,gres/gpu=2,mem=64G,node=1", (2, 1)),
    ("billing=32,cpu=32,gres/gpu:a100=4,gres/gpu=4,mem=256G,node=1", (4, 1)),  # typed and untyped: not 8
    ("cpu=16,gres/gpu:v100=2,gres/gpu:v100s=2,mem=64G,node=2", (4, 2)),  # typed only: summed
    ("billing=16,cpu=16,mem=64G,node=1", (0, 1)),
    ("cpu=4,gres/gpumem=40G,gres/shard=2,gres/mps=50,node=1", (0, 1)),  # not GPUs
    ("cpu=8,gres/gpu=0,node=1", (0, 1)),  # a no_consume GRES is printed as 0
    ("cpu=8,gres/gpu=2", (2, None)),
])
def test_gpus_from_tres(tres, expected):
    assert _gpus(tres) == expected


@pytest.mark.parametrize("tres", ["cpu=8,gres/gpu=two,node=1", "cpu=8,gres/gpu,node=1", "gres/gpu:a100=1.5"])
def test_garbled_tres_is_a_skip(tres):
    with pytest.raises(_Skip) as e:
        _gpus(tres)
    assert e.value.reason == "bad_tres"


@pytest.mark.parametrize("spec, tasks", [
    ("3-5", [3, 4, 5]), ("1,3,7-9", [1, 3, 7, 8, 9]), ("0-15:4", [0, 4, 8, 12]), ("5-10%2", [5, 6, 7, 8, 9, 10]),
    ("7", [7]),
])
def test_pending_array_ranges(spec, tasks):
    assert _array_tasks(spec) == tasks


@pytest.mark.parametrize("spec, reason", [("5-", "bad_job_id"), ("9-3", "bad_job_id"), ("0-99999", "array_too_large")])
def test_bad_array_ranges(spec, reason):
    with pytest.raises(_Skip) as e:
        _array_tasks(spec)
    assert e.value.reason == reason


@pytest.mark.parametrize("text, state", [
    ("COMPLETED", "COMPLETED"), ("CANCELLED by 20011", "CANCELLED"), ("CANCELLED+", "CANCELLED"),
    ("OUT_OF_MEMORY", "OUT_OF_MEMORY"), ("requeued", "REQUEUED"), ("TO", "TIMEOUT"),
])
def test_states(text, state):
    assert _state(text) == state


def test_local_times_across_dst():
    clock = _Clock(TZ)
    assert clock("2024-03-09T21:58:03") == int(_utc("2024-03-10T02:58:03").timestamp())  # EST, UTC-5
    assert clock("2024-03-10T03:45:00") == int(_utc("2024-03-10T07:45:00").timestamp())  # EDT, UTC-4
    assert clock("2024-03-10T02:30:00") == int(_utc("2024-03-10T07:30:00").timestamp())  # skipped hour: EST
    assert clock("2024-11-03T01:30:00") == int(_utc("2024-11-03T05:30:00").timestamp())  # repeated: 1st (EDT)
    assert clock("Unknown") is None and clock("None") is None and clock("") is None
    assert clock("1709935083") == 1709935083  # SLURM_TIME_FORMAT=%s
    with pytest.raises(_Skip):
        clock("2024-03-10T25:61:00")
    with pytest.raises(_Skip):
        clock("Ystday 14:02")  # SLURM_TIME_FORMAT=relative cannot be read back


# ---------------------------------------------------------------------------------------------------------
# the events written
# ---------------------------------------------------------------------------------------------------------

def test_report_counts(new_york):
    report, events, _, _ = new_york
    assert report.rows_read == 25
    assert dict(report.skipped) == {"step": 4, "no_gpu": 2, "bad_row": 1, "bad_time": 1}
    assert dict(report.events) == {"pool.configured": 2, "job.submitted": 17, "job.started": 14,
                                   "job.preempted": 3, "job.checkpointed": 1, "job.finished": 10, "pool.tick": 2}
    assert report.events_written == len(events) == 49
    assert report.pools == ["slurm/a100", "slurm/h100"]  # no slurm/cpu: nothing there used a GPU
    assert (report.first_at, report.last_at) == ("2024-03-10T02:58:03Z", "2024-03-10T10:45:00Z")
    notes = " | ".join(report.notes)
    assert "no chip inventory" in notes and "held back up to 7800 s" in notes
    assert "requeued jobs whose runs were chained: 2" in notes


def test_events_in_time_order_and_well_formed(new_york):
    _, events, _, _ = new_york
    times = [e["occurred_at"] for e in events]
    assert times == sorted(times)
    assert len({e["event_id"] for e in events}) == len(events)
    assert all(e["source"] == "slurm/sacct" for e in events)
    configured = [e for e in events if e["type"] == "pool.configured"]
    assert [(e["pool"], e["flavor"], e["chips_per_node"]) for e in configured] == [
        ("slurm/a100", "a100", 8), ("slurm/h100", "h100", 8)]
    assert not any(e["type"] == "chip.registered" for e in events)
    assert [e["type"] for e in events[-2:]] == ["pool.tick", "pool.tick"]


def _by_job(events):
    jobs: dict[str, list[tuple[str, str]]] = {}
    for e in events:
        if "job_id" in e:
            jobs.setdefault(e["job_id"], []).append((e["type"], e.get("outcome") or e["occurred_at"]))
    return jobs


def test_lifecycles(new_york):
    _, events, _, _ = new_york
    jobs = _by_job(events)
    kinds = {j: [t for t, _ in seq] for j, seq in jobs.items()}
    assert sorted(kinds) == sorted(["51001", "51003", "51004", "51005", "51006", "51007", "51010_1", "51010_2",
                                    "51010_3", "51010_4", "51010_5", "51020+0", "51021", "51022", "51023",
                                    "51024", "51027"])
    S, R, P, F = "job.submitted", "job.started", "job.preempted", "job.finished"
    assert kinds["51001"] == [S, R, F]
    assert kinds["51004"] == [S, F]  # cancelled while pending: sacct's Start=End is not a start
    assert kinds["51005"] == [S, R, P]  # PREEMPTED, no later record: back to pending
    # REQUEUED run (an admin's scontrol requeue: checkpointed first, no work lost), then the run that completed
    assert kinds["51006"] == [S, R, "job.checkpointed", P, R, F]
    assert kinds["51007"] == [S, R, P, R]  # NODE_FAIL run requeued, then still RUNNING (End Unknown)
    assert kinds["51010_3"] == kinds["51010_4"] == kinds["51010_5"] == kinds["51023"] == [S]
    assert kinds["51024"] == [S, R]
    outcome = {j: seq[-1][1] for j, seq in jobs.items() if seq[-1][0] == F}
    assert outcome == {"51001": "succeeded", "51003": "failed", "51004": "cancelled", "51006": "succeeded",
                       "51010_1": "succeeded", "51010_2": "failed", "51020+0": "succeeded", "51021": "failed",
                       "51022": "failed", "51027": "cancelled"}


def test_submitted_fields(new_york):
    _, events, _, _ = new_york
    sub = {e["job_id"]: e for e in events if e["type"] == "job.submitted"}
    assert sub["51001"]["team"] == "vision" and sub["51001"]["chips"] == 4 and sub["51001"]["priority"] == 5120
    assert sub["51001"]["preemptible"] is True
    assert sub["51022"]["chips"] == 16 and sub["51022"]["chips_per_node"] == 8  # gres/gpu=16 on node=2
    assert sub["51004"]["chips"] == 1  # from ReqTRES: it never had an allocation
    assert sub["51023"]["pool"] == "slurm/a100"  # pending in `a100,h100`: first partition
    assert sub["51020+0"]["pool"] == "slurm/h100"
    assert {e["team"] for e in sub.values()} == {"vision", "nlp"}
    assert sub["51006"]["occurred_at"] == "2024-03-10T04:05:00Z"  # the first run's Submit, not the reset one


def test_same_input_same_ids(new_york, tmp_path):
    _, events, _, _ = new_york
    again = tmp_path / "again.jsonl"
    import_sacct(NEW_YORK, again, tz=TZ)
    assert _events(again) == events
    other = tmp_path / "other.jsonl"
    import_sacct(NEW_YORK, other, tz="UTC")  # another reading of the same file must not reuse the ids
    assert not {e["event_id"] for e in events} & {e["event_id"] for e in _events(other)}


def _shape(events):
    return Counter((e["type"], e["pool"], e["occurred_at"], e.get("job_id"), e.get("outcome")) for e in events)


def test_rows_in_any_order_give_the_same_events(new_york, tmp_path):
    """sacct lists by JobID; Submit goes back at requeued runs. Reversed, the importer still writes in time order."""
    _, events, _, _ = new_york
    header, *rows = NEW_YORK.read_text().splitlines()
    shuffled = tmp_path / "reversed.txt"
    shuffled.write_text("\n".join([header, *reversed(rows)]) + "\n")
    out = tmp_path / "reversed.jsonl"
    report = import_sacct(shuffled, out, tz=TZ)
    got = _events(out)
    assert _shape(got) == _shape(events)
    assert [e["occurred_at"] for e in got] == sorted(e["occurred_at"] for e in got)
    summary, _ = run_file(out, tmp_path / "lake", overwrite=True)
    assert summary.dead_letter_total == 0 and report.skipped == Counter(
        {"step": 4, "no_gpu": 2, "bad_row": 1, "bad_time": 1})


def test_many_jobs_shuffled_with_requeues(tmp_path):
    """2,000 jobs (every 7th requeued once), rows shuffled: same events as sorted, legal for the ledger."""
    rng = random.Random(11)
    header = "JobID|Account|Partition|Submit|Start|End|State|AllocTRES"
    rows = []
    for i in range(2000):
        sub = 1_700_000_000 + i * 37
        start = sub + rng.randrange(0, 900)
        end = start + rng.randrange(60, 7200)
        tres = f"cpu=8,gres/gpu={rng.choice([1, 2, 4, 8])},node=1"
        part, acct = rng.choice(["a", "b"]), rng.choice(["t1", "t2", "t3"])
        if i % 7 == 0:
            rows.append(f"{9000 + i}|{acct}|{part}|{sub}|{start}|{end}|REQUEUED|{tres}")
            sub, start = end, end + rng.randrange(0, 600)
            end = start + 300
        rows.append(f"{9000 + i}|{acct}|{part}|{sub}|{start}|{end}|{rng.choice(['COMPLETED', 'FAILED'])}|{tres}")
    ordered, shuffled = tmp_path / "ordered.txt", tmp_path / "shuffled.txt"
    ordered.write_text("\n".join([header, *rows]) + "\n")
    rng.shuffle(rows)
    shuffled.write_text("\n".join([header, *rows]) + "\n")
    a = import_sacct(ordered, tmp_path / "a.jsonl")
    b = import_sacct(shuffled, tmp_path / "b.jsonl")
    assert a.events == b.events and a.events["job.preempted"] == 286 and a.events["job.submitted"] == 2000
    assert _shape(_events(tmp_path / "a.jsonl")) == _shape(_events(tmp_path / "b.jsonl"))
    summary, _ = run_file(tmp_path / "b.jsonl", tmp_path / "lake", overwrite=True)
    assert summary.dead_letter_total == 0 and summary.accepted == b.events_written


def test_legacy_parsable_required_columns_only(tmp_path):
    out = tmp_path / "legacy.jsonl"
    report = import_sacct(LEGACY, out)
    assert report.rows_read == 5
    # 701: pending and no ReqTRES column, so its GPUs are unknown; 703: state not known; 704: `gres/gpu:v100=many`
    assert dict(report.skipped) == {"no_tres": 1, "unknown_state": 1, "bad_tres": 1}
    events = _events(out)
    sub = {e["job_id"]: e for e in events if e["type"] == "job.submitted"}
    assert sub["700"]["chips"] == 2 and sub["700"]["priority"] == 0
    assert sub["702"]["chips"] == 4  # typed only (v100 + v100s)
    fin = {e["job_id"]: e["outcome"] for e in events if e["type"] == "job.finished"}
    assert fin == {"700": "succeeded", "702": "failed"}  # DEADLINE → failed
    assert events[0]["occurred_at"] == "2023-11-02T08:00:00Z"
    summary, _ = run_file(out, tmp_path / "lake", overwrite=True)
    assert summary.dead_letter_total == 0


def test_cluster_column_names_the_pool(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("Cluster|JobID|Account|Partition|Submit|Start|End|State|AllocTRES|Priority\n"
                   "alpha|1|ml|gpu|2024-01-01T00:00:00|2024-01-01T00:00:10|2024-01-01T01:00:00|COMPLETED|"
                   "gres/gpu=8,node=1|4294967294\n")
    out = tmp_path / "c.jsonl"
    report = import_sacct(src, out, chips_per_node=4)
    events = _events(out)
    assert report.pools == ["slurm/alpha/gpu"]
    assert events[0]["chips_per_node"] == 4
    assert events[1]["priority"] == 2**31 - 1  # Slurm priorities are uint32; the contract's are int32


@pytest.mark.parametrize("text, message", [
    ("", "empty file"),
    ("JobID   Account  Partition\n------- -------- ---------\n", "--parsable2"),
    ("51001|vision|a100|2024-03-09T21:58:03|Unknown|Unknown|PENDING|\n", "noheader"),
    ("JobID|Account|Partition|Submit|Start|End|State\n1|a|b|2024-01-01T00:00:00|Unknown|Unknown|PENDING\n",
     "AllocTRES"),
])
def test_not_sacct_parsable_output(tmp_path, text, message):
    src = tmp_path / "bad.txt"
    src.write_text(text)
    with pytest.raises(TraceFormatError, match=message):
        import_sacct(src, tmp_path / "out.jsonl")


def test_bad_arguments(tmp_path):
    with pytest.raises(TraceFormatError, match="time zone"):
        import_sacct(LEGACY, tmp_path / "o.jsonl", tz="Mars/Olympus_Mons")
    with pytest.raises(TraceFormatError, match="chips_per_node"):
        import_sacct(LEGACY, tmp_path / "o.jsonl", chips_per_node=0)
    with pytest.raises(FileNotFoundError):
        import_sacct(tmp_path / "nope.txt", tmp_path / "o.jsonl")


# ---------------------------------------------------------------------------------------------------------
# through the ledger
# ---------------------------------------------------------------------------------------------------------

def test_folds_with_no_dead_letters(new_york):
    report, _, summary, _ = new_york
    assert summary.dead_letter_total == 0
    assert summary.accepted == report.events_written


def _job(con, job_id):
    return con.execute(
        "SELECT preemptions, outcome, epoch(first_started_at) - epoch(submitted_at) AS latency_s, "
        "allocated_mchip_s, lost_mchip_s, finished_at FROM jobs WHERE job_id = ?", [job_id]).fetchone()


def test_jobs_view(new_york):
    _, _, _, lake = new_york
    con = connect(lake)
    assert con.execute("SELECT count(*) FROM jobs").fetchone()[0] == 17
    # ran 22:00:10 EST → 04:00:10 EDT: 5 h of 4 chips, not the 6 h the wall clock shows
    assert _job(con, "51001")[:4] == (0, "succeeded", 127, 4 * 1000 * 5 * 3600)
    # submitted 01:05 EST, started 03:05 EDT: one hour of queueing
    assert _job(con, "51024")[:3] == (0, None, 3600)
    # requeued once; the first run (23:05:30 → 01:30 EST) was lost work
    # an admin requeue loses no work (a PREEMPTED run would: 51005), and since issue 35 item 4 it is not a
    # preemption either: a requeue (was counted as 1 preemption)
    assert _job(con, "51006")[:5] == (0, "succeeded", 30, 2000 * (8670 + 10800), 0)
    assert _job(con, "51005")[:2] == (1, None)  # preempted, not requeued in the file: still pending
    # node failure, requeued, running at the end: a failure, not a preemption (was counted as 1 preemption)
    assert _job(con, "51007")[:2] == (0, None)
    causes = dict(((j, (p, r, f)) for j, p, r, f in con.execute(
        "SELECT job_id, preemptions, requeues, failures FROM jobs WHERE job_id IN ('51005', '51006', '51007')"
    ).fetchall()))
    assert causes == {"51005": (1, 0, 0), "51006": (0, 1, 0), "51007": (0, 0, 1)}
    ends = dict(con.execute("SELECT job_id, end_reason FROM job_run_totals WHERE job_id IN ('51005', '51006', "
                            "'51007') AND run_index = 1").fetchall())
    assert ends == {"51005": "preempted", "51006": "requeued", "51007": "failure"}
    assert con.execute("SELECT sum(preemptions) FROM jobs").fetchone()[0] == con.execute(
        "SELECT count(*) FROM job_run_totals WHERE end_reason = 'preempted'").fetchone()[0] == 1
    assert _job(con, "51004")[:3] == (0, "cancelled", None)
    assert _job(con, "51003")[1] == "failed"  # TIMEOUT
    restart = con.execute("SELECT epoch(started_at) FROM job_run_totals WHERE job_id = '51006' AND run_index = 2"
                          ).fetchone()[0]
    assert restart == int(_utc("2024-03-10T07:45:00").timestamp())
    teams = dict(con.execute("SELECT team, count(*) FROM jobs GROUP BY team").fetchall())
    assert teams == {"vision": 10, "nlp": 7}


def test_no_capacity_so_use_is_overcommitted(new_york):
    _, _, _, lake = new_york
    con = connect(lake)
    rows = dict(con.execute("SELECT account, sum(amount_mchip_s) FROM journal WHERE team IS NULL "
                            "GROUP BY account").fetchall())
    used = con.execute("SELECT sum(allocated_mchip_s) FROM jobs").fetchone()[0]
    assert rows.get("capacity", 0) == 0 and rows["overcommitted"] == used


def test_cli_import_sacct(tmp_path):
    out = tmp_path / "cli.jsonl"
    res = CliRunner().invoke(app, ["import", "sacct", str(NEW_YORK), "-o", str(out), "--tz", TZ, "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output.strip().splitlines()[-1])
    assert report["events_written"] == 49 and report["skipped"]["step"] == 4
