"""The Alibaba GPU v2023 (openb) importer on the real trace in ../shared/traces, folded by the embedded run.

The expected numbers are measured on the released CSVs (see the trace's README.md): 1,213 GPU nodes with 6,212
GPUs in 7 models; 8,152 pods, 1,088 of them CPU-only; of the 7,064 GPU pods 861 are Pending, 4,149 Running
(32 deleted at the trace's last second 12,902,960, i.e. still up when the trace was cut), 1,869 Failed and 185
Succeeded. Small hand-made folders check the edge cases (garbled rows, unsorted input, bad files).
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import pytest

from analytics.views import connect
from chipledger.embedded import run_file
from chipledger.adapters.importers.alibaba_openb import DEFAULT_START, import_alibaba_openb
from chipledger.adapters.importers.base import TraceFormatError

OPENB = Path(__file__).resolve().parents[2] / "shared" / "traces" / "alibaba-gpu-v2023-openb"
END = "2023-05-30T08:09:20Z"  # DEFAULT_START + 12,902,960 s, the trace's last timestamp

GPUS_PER_POOL = {"alibaba-openb/a10": 2, "alibaba-openb/g2": 4392, "alibaba-openb/g3": 312,
                 "alibaba-openb/p100": 265, "alibaba-openb/t4": 842, "alibaba-openb/v100m16": 195,
                 "alibaba-openb/v100m32": 204}
CONFIGURED = {"alibaba-openb/a10": ("A10", 1), "alibaba-openb/g2": ("G2", 8), "alibaba-openb/g3": ("G3", 8),
              "alibaba-openb/p100": ("P100", 2), "alibaba-openb/t4": ("T4", 2),
              "alibaba-openb/v100m16": ("V100M16", 4), "alibaba-openb/v100m32": ("V100M32", 8)}


@pytest.fixture(scope="module")
def folded(tmp_path_factory):
    """(report, events as dicts, DuckDB connection on the folded lake, run summary), made once."""
    if not OPENB.is_dir():
        pytest.skip("../shared/traces not found: trace tests need the shared folder beside the repo "
                    f"(looked for {OPENB})")
    tmp = tmp_path_factory.mktemp("openb")
    out = tmp / "openb.jsonl"
    report = import_alibaba_openb(OPENB, out)
    summary, _ = run_file(out, tmp / "lake", overwrite=True)
    with open(out, encoding="utf-8") as f:
        events = [json.loads(line) for line in f]
    return report, events, connect(tmp / "lake"), summary


def _one(con, sql, *params):
    return con.execute(sql, list(params)).fetchone()[0]


def test_report_counts(folded):
    report, events, _, _ = folded
    assert report.rows_read == 8152
    assert dict(report.skipped) == {"cpu_only": 1088}
    assert dict(report.events) == {"pool.configured": 7, "chip.registered": 6212, "job.submitted": 8152 - 1088,
                                   "job.started": 7064 - 861, "job.finished": 7064 - 32, "pool.tick": 7}
    assert report.events_written == len(events)
    assert report.first_at == "2023-01-01T00:00:00Z" and report.last_at == END
    assert "openb_pod_list_default.csv is sorted by creation_time" in report.notes


def test_pools_and_chips(folded):
    report, events, con, _ = folded
    assert sorted(report.pools) == sorted(GPUS_PER_POOL)
    configured = {e["pool"]: (e["flavor"], e["chips_per_node"]) for e in events if e["type"] == "pool.configured"}
    assert configured == CONFIGURED
    chips = [e for e in events if e["type"] == "chip.registered"]
    assert Counter(e["pool"] for e in chips) == GPUS_PER_POOL
    assert sum(GPUS_PER_POOL.values()) == 6212
    assert len({e["chip_id"] for e in chips}) == 6212
    assert all(e["occurred_at"] == "2023-01-01T00:00:00Z" for e in chips)
    first = next(e for e in chips if e["node"] == "openb-node-0000")  # P100, 2 GPUs
    assert (first["pool"], first["chip_id"]) == ("alibaba-openb/p100", "openb-node-0000-g0")
    assert {e["chip_id"] for e in chips if e["node"] == "openb-node-0000"} == {"openb-node-0000-g0",
                                                                               "openb-node-0000-g1"}
    # the ledger agrees: capacity per pool = its GPUs for the whole first hour
    rows = con.execute("SELECT pool, amount_mchip_s FROM journal WHERE account = 'capacity' "
                       "AND hour = TIMESTAMPTZ '2023-01-01 00:00:00+00'").fetchall()
    assert {p: a // 3_600_000 for p, a in rows} == GPUS_PER_POOL


def test_jobs_teams_priorities_and_chips(folded):
    _, _, con, _ = folded
    assert _one(con, "SELECT count(*) FROM jobs") == 7064
    rows = con.execute("SELECT team, priority, count(*) FROM jobs GROUP BY ALL ORDER BY priority").fetchall()
    assert rows == [("qos/be", 0, 2948), ("qos/burstable", 100, 99), ("qos/ls", 200, 4011),
                    ("qos/guaranteed", 300, 6)]
    submitted = con.execute("SELECT team, preemptible FROM events "
                            "WHERE type = 'job.submitted' GROUP BY ALL").fetchall()
    assert sorted(submitted) == [("qos/be", True), ("qos/burstable", False), ("qos/guaranteed", False),
                                 ("qos/ls", False)]
    # GPU sharing: 3,078 single-GPU pods ask for a fraction, in milli-GPU
    assert _one(con, "SELECT count(*) FROM jobs WHERE chips_milli < 1000") == 3078
    assert dict(con.execute("SELECT chips_milli, count(*) FROM jobs WHERE chips_milli >= 1000 "
                            "GROUP BY ALL").fetchall()) == {1000: 6989 - 3078, 2000: 16, 4000: 15, 8000: 44}
    assert _one(con, "SELECT chips FROM jobs WHERE job_id = 'openb-pod-0001'") == 0.46


def test_pool_assignment_is_the_weighted_hash(folded):
    _, _, con, _ = folded
    per_pool = dict(con.execute("SELECT pool, count(*) FROM jobs GROUP BY pool").fetchall())
    assert per_pool == {"alibaba-openb/a10": 3, "alibaba-openb/g2": 5057, "alibaba-openb/g3": 331,
                        "alibaba-openb/p100": 309, "alibaba-openb/t4": 909, "alibaba-openb/v100m16": 221,
                        "alibaba-openb/v100m32": 234}
    # a pod runs on one node: k whole GPUs only go to pools with a node of >= k GPUs
    eight = {p for (p,) in con.execute("SELECT DISTINCT pool FROM jobs WHERE chips_milli = 8000").fetchall()}
    assert eight <= {"alibaba-openb/g2", "alibaba-openb/g3", "alibaba-openb/v100m16", "alibaba-openb/v100m32"}
    four = {p for (p,) in con.execute("SELECT DISTINCT pool FROM jobs WHERE chips_milli = 4000").fetchall()}
    assert "alibaba-openb/p100" not in four and "alibaba-openb/a10" not in four
    # no pool is ever asked for more chips than it has
    assert _one(con, "SELECT count(*) FROM journal WHERE account = 'overcommitted'") == 0


def test_outcomes_follow_the_phase_rule(folded):
    _, _, con, _ = folded
    rows = con.execute("SELECT first_started_at IS NOT NULL AS started, outcome, count(*) FROM jobs "
                       "GROUP BY ALL").fetchall()
    assert sorted(rows, key=str) == sorted([
        (True, "succeeded", 185),   # Succeeded
        (True, "failed", 1869),     # Failed
        (True, "cancelled", 4117),  # Running, deleted before the end: stopped or evicted
        (True, None, 32),           # Running, deleted at the trace's last second: still running
        (False, "cancelled", 861),  # Pending: withdrawn before being placed
    ], key=str)
    # the ones left running are exactly those whose deletion_time is the trace end
    still = {j for (j,) in con.execute("SELECT job_id FROM jobs WHERE outcome IS NULL").fetchall()}
    assert "openb-pod-0001" in still and len(still) == 32


def test_pending_pods_never_start(folded):
    _, events, con, _ = folded
    assert _one(con, "SELECT count(*) FROM jobs WHERE first_started_at IS NULL") == 897 - 36
    pending = {j for (j,) in con.execute("SELECT job_id FROM jobs WHERE first_started_at IS NULL").fetchall()}
    started = {e["job_id"] for e in events if e["type"] == "job.started"}
    assert not pending & started
    assert all("chip_ids" not in e for e in events if e["type"] == "job.started")


@pytest.mark.parametrize("pod,latency_s", [
    ("openb-pod-0607", 14330),  # the slowest: created 9,994,869, scheduled 10,009,199
    ("openb-pod-0653", 101),
    ("openb-pod-0216", 35),
])
def test_scheduling_latency_of_known_pods(folded, pod, latency_s):
    _, _, con, _ = folded
    assert _one(con, "SELECT epoch(first_started_at - submitted_at) FROM jobs WHERE job_id = ?", pod) == latency_s


def test_output_folds_cleanly_and_every_pool_closes_at_the_end(folded):
    report, events, con, summary = folded
    assert summary.dead_letter_total == 0 and summary.late == 0
    assert summary.accepted == len(events)
    times = [datetime.fromisoformat(e["occurred_at"].replace("Z", "+00:00")) for e in events]
    assert all(a <= b for a, b in zip(times, times[1:]))
    last = {}
    for e in events:
        last[e["pool"]] = e
    assert {p: (e["type"], e["occurred_at"]) for p, e in last.items()} == \
        {p: ("pool.tick", END) for p in GPUS_PER_POOL}
    assert len({e["event_id"] for e in events}) == len(events)
    assert {e["source"] for e in events} == {"alibaba-openb"}


# ---------------------------------------------------------------------------------------------------------
# edge cases on small hand-made folders (no shared folder needed)
# ---------------------------------------------------------------------------------------------------------

NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,2,T4\nn1,1,1,2,T4\nn2,1,1,0,\nn3,1,1,8,G2\n"
HEADER = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,"
          "scheduled_time\n")


def _folder(tmp_path, pods: str, nodes: str = NODES) -> Path:
    d = tmp_path / "trace"
    d.mkdir()
    (d / "openb_node_list_gpu_node.csv").write_text(nodes)
    (d / "openb_pod_list_default.csv").write_text(HEADER + pods)
    return d


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_garbled_rows_are_skipped_with_a_reason(tmp_path):
    pods = ("p0,1,1,1,500,,LS,Succeeded,0,100,10\n"
            "p1,1,1,x,1000,,LS,Running,5,100,6\n"        # bad num_gpu
            "p2,1,1,0,0,,BE,Running,5,100,6\n"           # CPU-only
            "p3,1,1,1,,,LS,Running,5,100,6\n"            # missing gpu_milli on a one-GPU pod
            "p4,1,1,2,1000,,XX,Running,5,100,6\n"        # unknown qos
            "p5,1,1,2,1000,,LS,Gone,5,100,6\n"           # unknown phase
            "p6,1,1,2,1000,,LS,Running,,100,6\n"         # no creation_time
            "p7,1,1,2,1000,,LS,Running,5,100,abc\n"      # garbled scheduled_time
            "p8,1,1,2,1000,,LS,Running,5,1e,6\n"         # garbled deletion_time
            "p9,1,1,2,1000,,LS,Running,50,100,6\n"       # scheduled before created
            "p10,1,1,16,1000,,LS,Running,50,100,60\n"    # no node has 16 GPUs
            "p0,1,1,1,500,,LS,Succeeded,60,100,70\n"     # the same pod again
            "p11,1,1,4,1000,,Guaranteed,Running,70,300,80\n")
    out = tmp_path / "o.jsonl"
    report = import_alibaba_openb(_folder(tmp_path, pods), out)
    assert dict(report.skipped) == {"bad_num_gpu": 1, "cpu_only": 1, "bad_gpu_milli": 1, "unknown_qos": 1,
                                    "unknown_phase": 1, "bad_creation_time": 1, "bad_scheduled_time": 1,
                                    "bad_deletion_time": 1, "times_out_of_order": 1, "no_pool_fits": 1,
                                    "duplicate_pod": 1, "node_without_gpu": 1}
    assert report.rows_read == 13
    events = _events(out)
    jobs = {e["job_id"]: e for e in events if e["type"] == "job.submitted"}
    assert set(jobs) == {"p0", "p11"}
    assert jobs["p0"]["chips"] == 0.5 and jobs["p11"]["pool"] == "alibaba-openb/g2"  # only G2 has 4+ GPU nodes
    # p11 is Running and deleted at the last timestamp (300): it stays running
    assert [e["type"] for e in events if e.get("job_id") == "p11"] == ["job.submitted", "job.started"]
    summary, _ = run_file(out, tmp_path / "lake", overwrite=True)
    assert summary.dead_letter_total == 0


def test_unsorted_input_is_sorted_and_start_shifts_times(tmp_path):
    pods = ("b,1,1,1,1000,,BE,Failed,50,90,60\n"
            "a,1,1,1,1000,,LS,Pending,10,40,\n"
            "c,1,1,1,1000,,LS,Pending,20,100,\n")  # Pending at the end (100): stays pending
    out = tmp_path / "o.jsonl"
    start = datetime(2024, 6, 1, tzinfo=timezone.utc)
    report = import_alibaba_openb(_folder(tmp_path, pods), out, start=start)
    assert any("NOT sorted" in n for n in report.notes)
    events = [e for e in _events(out) if "job_id" in e]
    assert [(e["job_id"], e["type"], e["occurred_at"]) for e in events] == [
        ("a", "job.submitted", "2024-06-01T00:00:10Z"),
        ("c", "job.submitted", "2024-06-01T00:00:20Z"),
        ("a", "job.finished", "2024-06-01T00:00:40Z"),
        ("b", "job.submitted", "2024-06-01T00:00:50Z"),
        ("b", "job.started", "2024-06-01T00:01:00Z"),
        ("b", "job.finished", "2024-06-01T00:01:30Z"),
    ]
    assert events[2]["outcome"] == "cancelled" and events[5]["outcome"] == "failed"
    assert events[0]["priority"] == 200 and events[3]["preemptible"] is True
    assert report.last_at == "2024-06-01T00:01:40Z"  # the ticks close the books at the trace end
    assert DEFAULT_START == datetime(2023, 1, 1, tzinfo=timezone.utc)


def test_bad_files_raise_trace_format_errors(tmp_path):
    with pytest.raises(TraceFormatError, match="openb_node_list_gpu_node.csv"):
        import_alibaba_openb(tmp_path, tmp_path / "o.jsonl")
    d = _folder(tmp_path, "", nodes="sn,gpu\nn0,2\n")
    with pytest.raises(TraceFormatError, match="missing column"):
        import_alibaba_openb(d, tmp_path / "o.jsonl")
    (d / "openb_node_list_gpu_node.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,0,\n")
    with pytest.raises(TraceFormatError, match="no GPU node"):
        import_alibaba_openb(d, tmp_path / "o.jsonl")
