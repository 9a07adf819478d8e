"""`usage_by_user` (docs/analytics.md): the runs' chip-seconds (`job_runs`, the core's) summed by the `user` of each
job's submission, through the CLI a user runs (`chipledger run`, then `chipledger sql` in a subprocess).

Pool lab/p, 4 chips; by hand, in milli-chip-seconds:
  j1  team t, alice, 2 chips: 00:00-00:10                                  1,200,000
  j2  team t, bob,   1 chip:  00:05-00:15 (preempted: 600,000 lost), 00:20-00:30  1,200,000
  j1  again after it finished (a new job): team t, bob, 1 chip: 00:10-00:20       600,000
  j3  team u, no user, 1 chip: 00:00-01:10 (across an hour)               4,200,000
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from chipledger.cli import app

ROOT = Path(__file__).resolve().parents[1]
POOL = "lab/p"


def _events() -> list[dict]:
    out = []

    def e(t: str, type: str, **fields):
        out.append({"event_id": f"u-{len(out):03d}", "type": type, "occurred_at": f"2026-11-02T{t}Z", "pool": POOL,
                    "source": "lab/test", **fields})

    e("00:00:00", "pool.configured", flavor="a100", chips_per_node=4)
    for i in range(4):
        e("00:00:00", "chip.registered", chip_id=f"c{i}", node="n0")
    e("00:00:00", "quota.granted", grant_id="g-t", team="t", chips=2)
    e("00:00:00", "job.submitted", job_id="j1", team="t", chips=2, user="alice")
    e("00:00:00", "job.submitted", job_id="j2", team="t", chips=1, user="bob")
    e("00:00:00", "job.submitted", job_id="j3", team="u", chips=1)  # no user: an earlier producer
    e("00:00:00", "job.started", job_id="j1")
    e("00:00:00", "job.started", job_id="j3")
    e("00:05:00", "job.started", job_id="j2")
    e("00:10:00", "job.finished", job_id="j1", outcome="succeeded")
    e("00:10:00", "job.submitted", job_id="j1", team="t", chips=1, user="bob")
    e("00:10:00", "job.started", job_id="j1")
    e("00:15:00", "job.preempted", job_id="j2")
    e("00:20:00", "job.started", job_id="j2")
    e("00:20:00", "job.finished", job_id="j1", outcome="succeeded")
    e("00:30:00", "job.finished", job_id="j2", outcome="succeeded")
    e("01:10:00", "job.finished", job_id="j3", outcome="succeeded")
    e("02:00:00", "pool.tick")
    return out


def _sql(lake: Path, query: str) -> list[dict]:
    p = subprocess.run([sys.executable, "-m", "chipledger.cli", "sql", "--lake", str(lake), "--format", "json", query],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_usage_by_user_sums_the_runs_by_the_submitting_user(tmp_path):
    events = tmp_path / "events.jsonl"
    events.write_text("".join(json.dumps(x) + "\n" for x in _events()))
    lake = tmp_path / "lake"
    res = CliRunner().invoke(app, ["run", "--events", str(events), "--lake", str(lake), "--store",
                                   f"sqlite:///{tmp_path / 's.db'}", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["dead_letters"] == {}
    rows = _sql(lake, 'SELECT pool, team, "user", jobs, runs, allocated_mchip_s, lost_mchip_s, allocated_chip_h '
                      'FROM usage_by_user ORDER BY team, "user"')
    assert rows == [
        {"pool": POOL, "team": "t", "user": "alice", "jobs": 1, "runs": 1, "allocated_mchip_s": 1_200_000,
         "lost_mchip_s": 0, "allocated_chip_h": 1_200_000 / 3.6e6},
        {"pool": POOL, "team": "t", "user": "bob", "jobs": 2, "runs": 3, "allocated_mchip_s": 1_800_000,
         "lost_mchip_s": 600_000, "allocated_chip_h": 1_800_000 / 3.6e6},
        {"pool": POOL, "team": "u", "user": None, "jobs": 1, "runs": 1, "allocated_mchip_s": 4_200_000,
         "lost_mchip_s": 0, "allocated_chip_h": 4_200_000 / 3.6e6},
    ]
    # per team, the users' sum is the team's in the books (the journal: in_quota + borrowed + burst)
    books = _sql(lake, "SELECT team, sum(amount_mchip_s)::BIGINT AS used FROM journal "
                       "WHERE account IN ('in_quota', 'borrowed', 'burst') GROUP BY team ORDER BY team")
    assert books == [{"team": "t", "used": 3_000_000}, {"team": "u", "used": 4_200_000}]
    # the jobs view shows each submission's user
    jobs = _sql(lake, 'SELECT job_id, "user", allocated_mchip_s FROM jobs ORDER BY job_id, submitted_at')
    assert [(j["job_id"], j["user"], j["allocated_mchip_s"]) for j in jobs] == [
        ("j1", "alice", 1_200_000), ("j1", "bob", 600_000), ("j2", "bob", 1_200_000), ("j3", None, 4_200_000)]
