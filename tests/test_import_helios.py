"""The Helios importer (chipledger.adapters.importers.helios) on the real quota files and on a hand-made job log.

Real files: ../shared/traces/helios beside the repository (HeliosData, Hu et al. SC '21, CC BY 4.0). The
expected entitlements are computed here from the CSV with the csv module, independently of the importer,
and compared with what the ledger books after folding the importer's output.
Hand-made fixture: tests/fixtures/helios (our own rows in the Helios format, see its README).
"""

from __future__ import annotations

import csv
import json
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import pytest

from analytics.views import connect
from chipledger.embedded import run_file
from chipledger.adapters.importers.base import TraceFormatError
from chipledger.adapters.importers.helios import import_helios

UTC = timezone.utc
HELIOS = Path(__file__).resolve().parents[2] / "shared" / "traces" / "helios"
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "helios"
DAY_MCHIP_S = 1000 * 86400  # one chip for one day, in milli-chip-seconds

REAL = {  # folder, quota file, pool, grants, teams with quota, VC columns, chips registered
    "Venus": ("Venus", "cluster_gpu_number.csv", "helios-venus/gpu", 37, 24, 25, 1264),
    "Earth": ("Earth_vcs", "Earth_gpu_number.csv", "helios-earth/gpu", 57, 25, 25, 1232),
}


def read_quota(path: Path) -> dict[str, dict[date, int]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    vcs = [c for c in rows[0] if c not in ("date", "total")]
    return {vc: {date.fromisoformat(r["date"]): int(r[vc]) for r in rows} for vc in vcs}


def read_events(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def day_utc(d: date) -> datetime:
    return datetime(d.year, d.month, d.day, tzinfo=UTC)


def entitled_on(con, team: str, d: date) -> int:
    got = con.execute("SELECT sum(amount_mchip_s) FROM journal WHERE account = 'entitled' AND team = ? "
                      "AND hour >= ? AND hour < ?", [team, day_utc(d), day_utc(d + timedelta(days=1))]).fetchone()[0]
    return int(got or 0)


@pytest.fixture(scope="module", params=sorted(REAL))
def real(request, tmp_path_factory):
    """One real cluster imported and folded: (name, report, events, fold summary, connection, quota)."""
    folder, qfile, *_ = REAL[request.param]
    src = HELIOS / folder
    if not (src / qfile).is_file():
        pytest.skip(f"real Helios quota file {src / qfile} not found: these tests need ../shared/traces/helios "
                    f"beside the repository")
    tmp = tmp_path_factory.mktemp(f"helios-{request.param}")
    out = tmp / "events.jsonl"
    report = import_helios(src, out)
    summary, _ = run_file(out, tmp / "lake", overwrite=True)
    return request.param, report, read_events(out), summary, connect(tmp / "lake"), read_quota(src / qfile)


def test_real_grants_teams_and_capacity(real):
    name, report, events, summary, _, quota = real
    _, _, pool, n_grants, n_teams, n_vcs, chips = REAL[name]
    assert report.pools == [pool]
    grants = [e for e in events if e["type"] == "quota.granted"]
    assert len(grants) == n_grants == report.events["quota.granted"]
    assert len({g["team"] for g in grants}) == n_teams
    assert len(quota) == n_vcs
    assert {g["team"] for g in grants} == {vc for vc, days in quota.items() if any(days.values())}
    assert len({g["grant_id"] for g in grants}) == n_grants
    assert report.events["chip.registered"] == chips
    assert report.events["pool.configured"] == 1 and report.events["pool.tick"] == 1
    assert report.skipped == {} and report.rows_read == 181
    assert "quota: total = sum of VC columns on every day" in report.notes
    # grants are announced at their effective_from, in time order, and every run is one grant
    times = [e["occurred_at"] for e in events]
    assert times == sorted(times)
    for g in grants:
        assert g["occurred_at"] == g["effective_from"]
        assert g["grant_id"] == f"{g['team']}-{g['effective_from'][:10].replace('-', '')}"
        start = date.fromisoformat(g["effective_from"][:10])
        until = date.fromisoformat(g["effective_until"][:10])
        run = [quota[g["team"]][start + timedelta(days=i)] for i in range((until - start).days)]
        assert set(run) == {g["chips"]}
    assert events[-1]["type"] == "pool.tick" and events[-1]["occurred_at"] == "2020-09-29T00:00:00Z"
    assert summary.dead_letter_total == 0 and summary.accepted == len(events)


def test_real_daily_entitlement_equals_quota_file(real):
    _, _, _, _, con, quota = real
    days = sorted(next(iter(quota.values())))
    # a few pairs with the exact query: the first and last day, and both sides of each of the first changes
    pairs = [(vc, days[0]) for vc in list(quota)[:3]] + [(vc, days[-1]) for vc in list(quota)[-3:]]
    for vc, series in quota.items():
        changes = [d for d in days[1:] if series[d] != series[d - timedelta(days=1)]]
        pairs += [(vc, d) for c in changes[:1] for d in (c - timedelta(days=1), c)]
    assert len(pairs) > 10
    for vc, d in pairs:
        assert entitled_on(con, vc, d) == quota[vc][d] * DAY_MCHIP_S, (vc, d)
    # and every (vc, day) of the file at once, zero days included
    got = {(t, d.date()): int(a) for t, d, a in con.execute(
        "SELECT team, date_trunc('day', hour) AS d, sum(amount_mchip_s) FROM journal "
        "WHERE account = 'entitled' GROUP BY team, d").fetchall()}
    want = {(vc, d): v * DAY_MCHIP_S for vc, series in quota.items() for d, v in series.items() if v}
    assert {k: v for k, v in got.items() if v} == want


def test_real_whole_trace_entitlement_per_vc(real):
    _, _, _, _, con, quota = real
    got = dict(con.execute("SELECT team, sum(amount_mchip_s) FROM journal WHERE account = 'entitled' "
                           "GROUP BY team").fetchall())
    for vc, series in quota.items():
        assert int(got.get(vc, 0)) == sum(series.values()) * 86_400_000, vc
    cap = con.execute("SELECT sum(amount_mchip_s) FROM journal WHERE account = 'capacity'").fetchone()[0]
    assert cap == REAL[real[0]][6] * 181 * DAY_MCHIP_S
    # the authors' summary gives each cluster's gpu_num as the mean daily total, truncated (README of the copy)
    summary = HELIOS / "helios_cluster_summary.csv"
    if summary.is_file():
        with open(summary, newline="") as f:
            gpu_num = {r["id"]: int(r["gpu_num"]) for r in csv.DictReader(f)}
        assert sum(got.values()) // (181 * DAY_MCHIP_S) == gpu_num[real[0]]


# ---------------------------------------------------------------------------------------------------------
# the hand-made job log
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("helios-mini")
    out = tmp / "events.jsonl"
    report = import_helios(FIXTURE, out, cluster="Mini")
    summary, _ = run_file(out, tmp / "lake", overwrite=True)
    return report, read_events(out), summary, connect(tmp / "lake")


def _job_events(events):
    keep = ("job_id", "team", "chips", "outcome")
    return [(e["type"], e["occurred_at"][5:16].replace("T", " "), *(e[k] for k in keep if k in e))
            for e in events if e["type"].startswith("job.")]


def test_mini_exact_job_events(mini):
    report, events, _, _ = mini
    assert _job_events(events) == [
        ("job.submitted", "06-01 08:00", "1001", "vcA", 8),
        ("job.started", "06-01 08:00", "1001"),
        ("job.submitted", "06-01 09:00", "1002", "vcB", 4),
        ("job.started", "06-01 09:05", "1002"),
        ("job.finished", "06-01 09:30", "1002", "failed"),
        ("job.submitted", "06-01 09:30", "1003", "vcA", 16),
        ("job.finished", "06-01 10:00", "1001", "succeeded"),
        ("job.finished", "06-01 11:00", "1003", "cancelled"),  # start = end: cancelled in the queue
        ("job.submitted", "06-01 12:00", "1005", "vcB", 2),
        ("job.started", "06-01 12:10", "1005"),
        ("job.finished", "06-01 16:10", "1005", "failed"),  # TIMEOUT
        ("job.submitted", "06-02 00:30", "1008", "vcA", 1),
        ("job.started", "06-02 00:31", "1008"),
        ("job.finished", "06-02 03:31", "1008", "cancelled"),
        ("job.submitted", "06-02 09:59", "1010", "vcB", 4),  # listed after 1009, submitted before it
        ("job.submitted", "06-02 10:00", "1009", "vcX", 8),
        ("job.started", "06-02 10:00", "1009"),
        ("job.started", "06-02 10:20", "1010"),
        ("job.finished", "06-02 20:00", "1009", "failed"),  # NODE_FAIL
        ("job.finished", "06-03 02:00", "1010", "succeeded"),
        ("job.submitted", "06-03 20:00", "1012", "vcA", 8),
        ("job.submitted", "06-03 22:00", "1011", "vcA", 8),
        ("job.started", "06-03 23:00", "1012"),
        ("job.finished", "06-03 23:00", "1011", "cancelled"),  # empty start_time
        ("job.finished", "06-04 05:00", "1012", "succeeded"),
    ]
    sub = next(e for e in events if e["type"] == "job.submitted")
    assert sub["priority"] == 0 and sub["preemptible"] is True and "chips_per_node" not in sub
    assert all("chip_ids" not in e for e in events if e["type"] == "job.started")
    assert events[-1] == {**events[-1], "type": "pool.tick", "occurred_at": "2020-06-04T05:00:00Z"}


def test_mini_report_counts(mini):
    report, events, summary, _ = mini
    assert report.pools == ["helios-mini/gpu"]
    assert report.rows_read == 3 + 12
    assert dict(report.skipped) == {"cpu_only": 1, "bad_gpu_num": 1, "malformed_row": 1}
    assert report.events["job.submitted"] == 9 and report.events["job.finished"] == 9
    assert report.events["job.started"] == 7
    assert report.events["quota.granted"] == 3  # vcA 16 (2 days), vcA 8 (1 day), vcB 8 (3 days); vcZ none
    assert report.events["chip.registered"] == 24
    assert any("1 job(s) in 1 VC(s) without a quota column" in n and "vcX" in n for n in report.notes)
    assert any("1 row(s) submitted earlier" in n for n in report.notes)
    assert summary.dead_letter_total == 0 and summary.accepted == len(events)
    grants = {e["grant_id"]: (e["chips"], e["effective_from"], e["effective_until"])
              for e in events if e["type"] == "quota.granted"}
    assert grants == {
        "vcA-20200601": (16, "2020-06-01T00:00:00Z", "2020-06-03T00:00:00Z"),
        "vcA-20200603": (8, "2020-06-03T00:00:00Z", "2020-06-04T00:00:00Z"),
        "vcB-20200601": (8, "2020-06-01T00:00:00Z", "2020-06-04T00:00:00Z"),
    }


def test_mini_jobs_view_latency_and_entitlement(mini):
    _, _, _, con = mini
    rows = {r[0]: r[1:] for r in con.execute(
        "SELECT job_id, epoch(first_started_at) - epoch(submitted_at), outcome, team, chips_milli, "
        "allocated_mchip_s FROM jobs").fetchall()}
    assert set(rows) == {"1001", "1002", "1003", "1005", "1008", "1009", "1010", "1011", "1012"}
    assert rows["1002"][:2] == (300, "failed")
    assert rows["1010"][:2] == (1260, "succeeded")
    assert rows["1001"][:2] == (0, "succeeded")
    assert rows["1003"] == (None, "cancelled", "vcA", 16000, 0)  # never ran
    assert rows["1012"][4] == 8000 * 6 * 3600  # ran past the last quota day; the books stay open for it
    p50 = con.execute("SELECT quantile_disc(epoch(first_started_at) - epoch(submitted_at), 0.5) FROM jobs "
                      "WHERE first_started_at IS NOT NULL").fetchone()[0]
    assert p50 == 300  # latencies 0, 30, 60, 300, 600, 1260, 10800 s
    assert entitled_on(con, "vcA", date(2020, 6, 2)) == 16 * DAY_MCHIP_S
    assert entitled_on(con, "vcA", date(2020, 6, 3)) == 8 * DAY_MCHIP_S
    assert entitled_on(con, "vcB", date(2020, 6, 3)) == 8 * DAY_MCHIP_S
    assert entitled_on(con, "vcA", date(2020, 6, 4)) == 0  # the quota file ends on 06-03
    assert entitled_on(con, "vcZ", date(2020, 6, 1)) == 0


# ---------------------------------------------------------------------------------------------------------
# names, zones, ordering and bad input
# ---------------------------------------------------------------------------------------------------------

QUOTA = "date,vcA,vcB,total\n2020-06-01,8,0,8\n2020-06-02,8,8,16\n"
HEADER = "job_id,user,vc,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration,queue\n"


def _folder(tmp_path: Path, name: str, quota: str = QUOTA, log: str | None = None,
            quota_name: str = "cluster_gpu_number.csv") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / quota_name).write_text(quota)
    if log is not None:
        (d / "cluster_log.csv").write_text(HEADER + log)
    return d


def test_cluster_name_from_argument_file_or_folder(tmp_path):
    r = import_helios(_folder(tmp_path, "Saturn"), tmp_path / "a.jsonl")
    assert r.pools == ["helios-saturn/gpu"] and any("jobs: no cluster_log.csv" in n for n in r.notes)
    r = import_helios(_folder(tmp_path, "x_vcs", quota_name="Uranus_gpu_number.csv"), tmp_path / "b.jsonl")
    assert r.pools == ["helios-uranus/gpu"]
    r = import_helios(tmp_path / "Saturn", tmp_path / "c.jsonl", cluster="Neptune")
    assert r.pools == ["helios-neptune/gpu"]
    events = read_events(tmp_path / "c.jsonl")
    assert {e["source"] for e in events} == {"helios-neptune/slurm"}
    assert events[0]["event_id"] == "helios-neptune-00000001"


def test_zone_shifts_days_and_job_times(tmp_path):
    log = "1,u,vcA,1,1,1,COMPLETED,2020-06-01 08:00:00,2020-06-01 08:00:10,2020-06-01 09:00:00,0,0\n"
    r = import_helios(_folder(tmp_path, "Venus", log=log), tmp_path / "e.jsonl", tz="Asia/Shanghai")
    events = read_events(tmp_path / "e.jsonl")
    g = next(e for e in events if e.get("grant_id") == "vcA-20200601")
    assert (g["effective_from"], g["effective_until"]) == ("2020-05-31T16:00:00Z", "2020-06-02T16:00:00Z")
    assert next(e for e in events if e["type"] == "job.submitted")["occurred_at"] == "2020-06-01T00:00:00Z"
    assert "times: naive Helios times and quota days read as Asia/Shanghai" in r.notes
    with pytest.raises(ValueError, match="unknown time zone"):
        import_helios(tmp_path / "Venus", tmp_path / "f.jsonl", tz="Mars/Olympus")


def test_unsorted_log_within_and_beyond_the_window(tmp_path):
    log = ("1,u,vcA,1,1,1,COMPLETED,2020-06-01 10:00:00,2020-06-01 10:00:00,2020-06-01 10:05:00,0,0\n"
           "2,u,vcA,1,1,1,COMPLETED,2020-06-01 12:00:00,2020-06-01 12:00:00,2020-06-01 12:05:00,0,0\n"
           "3,u,vcA,1,1,1,COMPLETED,2020-06-01 11:30:00,2020-06-01 11:30:00,2020-06-01 11:35:00,0,0\n"
           "4,u,vcA,1,1,1,COMPLETED,2020-06-01 14:00:00,2020-06-01 14:00:00,2020-06-01 14:05:00,0,0\n"
           "5,u,vcA,1,1,1,COMPLETED,2020-06-01 12:30:00,2020-06-01 12:30:00,2020-06-01 12:35:00,0,0\n")
    r = import_helios(_folder(tmp_path, "Venus", log=log), tmp_path / "o.jsonl", reorder_window_s=3600)
    events = read_events(tmp_path / "o.jsonl")
    assert [e["job_id"] for e in events if e["type"] == "job.submitted"] == ["1", "3", "2", "4"]
    assert dict(r.skipped) == {"out_of_order": 1}  # job 5 is 90 min behind job 4: beyond the window
    assert any("more than 3600 s out of submit order" in n for n in r.notes)
    times = [e["occurred_at"] for e in events]
    assert times == sorted(times)


def test_garbled_rows_are_skipped_with_reasons(tmp_path):
    ok = "2020-06-01 10:00:00,2020-06-01 10:00:00,2020-06-01 11:00:00,3600,0"
    log = (f"1,u,vcA,1,1,1,SUSPENDED,{ok}\n"
           f"2,u,vcA,1,1,1,COMPLETED,2020-06-01 25:00:00,2020-06-01 10:00:00,2020-06-01 11:00:00,0,0\n"
           f"3,u,vcA,1,1,1,COMPLETED,2020-06-01 10:00:00,2020-06-01 12:00:00,2020-06-01 11:00:00,0,0\n"
           f"4,u,,1,1,1,COMPLETED,{ok}\n"
           f"5,u,vcA,-2,1,1,COMPLETED,{ok}\n"
           f"6,u,vcA,1,1,1,COMPLETED,2020-05-31 23:00:00,2020-06-01 10:00:00,2020-06-01 11:00:00,0,0\n"
           f"7,u,vcA,1.0,1,1,CANCELLED by 42,{ok}\n"
           f"7,u,vcA,1,1,1,COMPLETED,{ok}\n"
           f",u,vcA,1,1,1,COMPLETED,{ok}\n"
           f"8,u,vcA,1,1,1,COMPLETED,2020-06-01 10:00:00,2020-06-01 10:00:00,,0,0\n"
           "9,u,vcA,1,1,1,\"COMPLETED,2020-06-01\n")
    r = import_helios(_folder(tmp_path, "Venus", log=log), tmp_path / "g.jsonl")
    assert dict(r.skipped) == {"unknown_state": 1, "bad_time": 2, "time_order": 1, "missing_vc": 1,
                               "bad_gpu_num": 1, "before_quota_start": 1, "duplicate_job_id": 1,
                               "bad_job_id": 1, "malformed_row": 1}
    assert r.events["job.submitted"] == 1
    fin = [e for e in read_events(tmp_path / "g.jsonl") if e["type"] == "job.finished"]
    assert [(e["job_id"], e["outcome"]) for e in fin] == [("7", "cancelled")]


def test_quota_total_mismatch_is_noted(tmp_path):
    quota = "date,vcA,vcB,total\n2020-06-01,8,0,8\n2020-06-02,8,8,24\n2020-06-04,8,8,16\n"
    r = import_helios(_folder(tmp_path, "Venus", quota=quota), tmp_path / "m.jsonl")
    assert any("total ≠ sum of VC columns on 1 day(s), first 2020-06-02: total 24, sum 16" in n for n in r.notes)
    assert any("1 gap(s)" in n for n in r.notes)
    assert r.events["chip.registered"] == 24  # ceil(max(total) / 8) nodes × 8
    grants = {e["grant_id"]: e["effective_until"] for e in read_events(tmp_path / "m.jsonl")
              if e["type"] == "quota.granted"}
    # a missing day breaks a run: no entitlement on 06-03
    assert grants == {"vcA-20200601": "2020-06-03T00:00:00Z", "vcA-20200604": "2020-06-05T00:00:00Z",
                      "vcB-20200602": "2020-06-03T00:00:00Z", "vcB-20200604": "2020-06-05T00:00:00Z"}


@pytest.mark.parametrize("quota, message", [
    ("", "empty file"),
    ("day,vcA,total\n2020-06-01,8,8\n", "header must start with 'date'"),
    ("date,total\n2020-06-01,8\n", "no VC columns"),
    ("date,vcA,total\n2020-06-01,8\n", "2 fields, expected 3"),
    ("date,vcA,total\n2020-06-02,8,8\n2020-06-01,8,8\n", "does not follow"),
    ("date,vcA,total\n2020-06-01,eight,8\n", "not a whole number of GPUs in vcA"),
    ("date,vcA,total\n01/06/2020,8,8\n", "is not YYYY-MM-DD"),
])
def test_bad_quota_files_are_format_errors(tmp_path, quota, message):
    with pytest.raises(TraceFormatError, match=message):
        import_helios(_folder(tmp_path, "Venus", quota=quota), tmp_path / "x.jsonl")


def test_missing_files_and_columns(tmp_path):
    with pytest.raises(TraceFormatError, match="is not a folder"):
        import_helios(tmp_path / "nope", tmp_path / "x.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceFormatError, match="no cluster_gpu_number.csv"):
        import_helios(tmp_path / "empty", tmp_path / "x.jsonl")
    d = _folder(tmp_path, "Venus")
    (d / "cluster_log.csv").write_text("job_id,vc,gpu_num\n1,vcA,1\n")
    with pytest.raises(TraceFormatError, match="missing column.*state"):
        import_helios(d, tmp_path / "x.jsonl")
    assert not (tmp_path / "x.jsonl").exists()  # nothing written for an input that cannot be read
