"""`chipledger slurm watch`, `slurm actuate` and `import sacct` against a real Slurm (tests/slurm_support.py).

One workload of real sleep jobs asking for GPUs runs once for the module (about a minute): several accounts, jobs
of three Unix users in one account (root's, and alice's and bob's submitted by root with `sbatch --uid`), an
array, a two-node job, a failure, a timeout, a cancel, a job held then cancelled, a QOS preemption with
REQUEUE, an admin requeue, a requeued job cancelled during its hold-off, a node drained, a maintenance
reservation and the node set to FUTURE. The watcher polls while it runs and is
restarted half-way (a new Watcher on the same state file). Then:
- the books folded from what `slurm watch` sent equal `sreport` per account, per account and user
  (`usage_by_user`) and per partition to the GPU-second, and capacity / idle / down / maintenance (PLND Down, in node-seconds) equal `sreport cluster
  utilization`; the same for `import sacct` on sacct's dump;
- polling again, or a fresh watcher on the same state, sends no new event; a watcher started from scratch
  sends the same events;
- a requeued job is held from its End to its next run's Eligible (`job.preempted` with `held`, `job.released`):
  the ledger's pending demand per account equals what Slurm's own Eligible gives (Start − Eligible of each run,
  × GPUs), without the hold-offs, and each restart's wait (fact `waits`) begins at Slurm's Eligible; a job
  cancelled while held is no demand;
- a reclaim decision of the ledger requeues the real victim through `slurm actuate`, and the victim's requeue
  comes back through `watch` as `job.preempted` carrying the decision's id.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import pytest

from typer.testing import CliRunner

from chipledger.cli import app
from chipledger.embedded import run_file
from chipledger.adapters.slurm.actuate import Actuator, decisions_from_lake
from chipledger.adapters.slurm.watch import JsonlSink, Watcher, parse_since
from ledger.fold import FoldConfig

CLUSTER = "chipledger"
# the ledger's team of each Slurm account: vision and nlp are under the parent account research (scripts/slurm.sh)
TEAM = {"vision": "research/vision", "nlp": "research/nlp", "speech": "speech"}
ORGS = {"research": ("vision", "nlp")}
SETTLE_S = 2
WORKLOAD_MAX_S = 240  # the workload below takes ~90 s, up to ~150 s on a loaded machine


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _hour(t: int) -> int:
    return t - t % 3600


def _iso(t: int) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


def _with_final_ticks(src: Path, dst: Path, at: int) -> Path:
    """The watcher's events plus the tick it would send at `at` (nothing runs then): the books close there."""
    evs = _events(src)
    pools = sorted({e["pool"] for e in evs})
    ticks = [{"event_id": f"test-close-{p}", "type": "pool.tick", "occurred_at": _iso(at) + "Z", "pool": p,
              "source": f"{CLUSTER}/slurm"} for p in pools]
    dst.write_text("".join(json.dumps(e) + "\n" for e in evs + ticks))
    return dst


def _books(lake: Path) -> tuple[dict, dict]:
    """(GPU-seconds per team, pool accounts in GPU-seconds) from the lake's journal, all pools together."""
    con = duckdb.connect()
    rows = con.execute(f"SELECT account, team, sum(amount_mchip_s) FROM read_parquet('{lake}/journal/**/*.parquet') "
                       f"GROUP BY ALL").fetchall()
    teams: Counter = Counter()
    pool: Counter = Counter()
    for account, team, amount in rows:
        assert amount % 1000 == 0, (account, team, amount)  # whole GPUs x whole seconds
        if team is None:
            pool[account] += amount // 1000
        elif account in ("in_quota", "borrowed", "burst"):
            teams[team] += amount // 1000
    return dict(teams), dict(pool)


def _books_by_user(lake: Path) -> dict:
    """GPU-seconds per (team, user) from `chipledger sql` over the view usage_by_user, all pools together."""
    res = CliRunner().invoke(app, ["sql", "--lake", str(lake), "--format", "json",
                                   'SELECT team, "user", sum(allocated_mchip_s)::BIGINT AS mchip_s '
                                   'FROM usage_by_user GROUP BY ALL'])
    assert res.exit_code == 0, res.output
    out = {}
    for r in json.loads(res.stdout):
        assert r["mchip_s"] % 1000 == 0, r  # whole GPUs x whole seconds
        if r["mchip_s"]:
            out[(r["team"], r["user"])] = r["mchip_s"] // 1000
    return out


def _books_by_pool(lake: Path) -> dict:
    """GPU-seconds per (partition, team) from the lake's journal."""
    con = duckdb.connect()
    rows = con.execute(f"SELECT pool, team, sum(amount_mchip_s) FROM read_parquet('{lake}/journal/**/*.parquet') "
                       f"WHERE account IN ('in_quota', 'borrowed', 'burst') GROUP BY ALL").fetchall()
    return {(pool.split("/", 1)[1], team): amount // 1000 for pool, team, amount in rows if amount}


def _sreport_by_partition(cluster, start: int, end: int) -> dict:
    """GPU-seconds per (partition, account) from `sreport job SizesByAccount Partitions=P FlatView` (sreport's
    cluster reports have no partition; its job reports do)."""
    out = {}
    for part in ("a100", "h100"):
        text = cluster.cmd("sreport", "-n", "-P", "-t", "seconds", "-T", "gres/gpu", "job", "SizesByAccount",
                           f"Partitions={part}", "FlatView", "grouping=1000000", f"start={_iso(start)}",
                           f"end={_iso(end)}")
        for x in text.splitlines():
            f = x.split("|")
            if len(f) >= 4 and f[1]:
                used = sum(int(v) for v in f[2:-1])
                if used:
                    out[(part, TEAM[f[1]])] = used
    return out


def _sreport(cluster, start: int, end: int) -> tuple[dict, dict, dict]:
    """(GPU-seconds per account, GPU-seconds per (account, user), cluster utilization) over [start, end)."""
    cluster.cmd("sacctmgr", "-i", "rollup", _iso(start), _iso(end))
    util = cluster.cmd("sreport", "-n", "-P", "-t", "seconds", "-T", "gres/gpu", "cluster", "utilization",
                       f"start={_iso(start)}", f"end={_iso(end)}")
    (line,) = [x for x in util.splitlines() if x.strip()]
    _, _, alloc, down, pdown, idle, planned, reported = line.split("|")
    # a maintenance reservation holds a node's CPUs only (22.05 reservations carry no gres TRES), so sreport
    # counts it as PLND Down in cpu and as Idle in gres/gpu: the ledger's maintenance is compared in node-seconds
    cpu = cluster.cmd("sreport", "-n", "-P", "-t", "seconds", "-T", "cpu", "cluster", "utilization",
                      f"start={_iso(start)}", f"end={_iso(end)}")
    (cpu_line,) = [x for x in cpu.splitlines() if x.strip()]
    node = dict(kv.split("=", 1) for kv in cluster.cmd("scontrol", "-o", "show", "node", "n4").split() if "=" in kv)
    cpus, gpus = int(node["CPUTot"]), int(node["Gres"].split("(")[0].rsplit(":", 1)[1])
    pdown_cpu = int(cpu_line.split("|")[4])
    assert pdown_cpu % cpus == 0, (pdown_cpu, cpus)
    accounts = cluster.cmd("sreport", "-n", "-P", "-t", "seconds", "-T", "gres/gpu", "cluster",
                           "AccountUtilizationByUser", f"start={_iso(start)}", f"end={_iso(end)}")
    used, by_user = {}, {}
    for x in accounts.splitlines():
        f = x.split("|")  # cluster|account|login|proper name|TRES|used
        if len(f) == 6 and f[2] == "" and f[1] in TEAM:  # account rows (no user), by the ledger's team name
            used[TEAM[f[1]]] = int(f[5])
        elif len(f) == 6 and f[2] and int(f[5]):  # user rows
            by_user[(TEAM[f[1]], f[2])] = int(f[5])
    return used, by_user, {"allocated": int(alloc), "down": int(down), "planned_down": int(pdown), "idle": int(idle),
                  "planned": int(planned), "reported": int(reported),
                  "maintenance_gpu_s": pdown_cpu // cpus * gpus}  # n4's node-seconds in PLND Down x its GPUs


SACCT_FORMAT = "JobID,Account,User,Partition,Submit,Eligible,Start,End,State,AllocTRES,ReqTRES,Priority,AdminComment"


def _sacct_dump(slurm, workload) -> Path:
    """`sacct -a -D -X --parsable2` of the run (every run of every job), written once into the workload's dir."""
    path = workload["dir"] / "sacct.txt"
    if not path.exists():
        path.write_text(slurm.cmd("sacct", "-a", "-D", "-X", "--parsable2", "-S", _iso(workload["since"]),
                                  f"--format={SACCT_FORMAT}"))
    return path


def _dump_runs(dump: Path) -> dict:
    """job id -> its runs (dicts of the dump's columns) in Submit order."""
    lines = dump.read_text().splitlines()
    cols = lines[0].split("|")
    runs: dict = {}
    for x in lines[1:]:
        r = dict(zip(cols, x.split("|")))
        runs.setdefault(r["JobID"], []).append(r)
    for rs in runs.values():
        rs.sort(key=lambda r: r["Submit"])
    return runs


def _epoch(text: str):
    if text in ("", "Unknown", "None"):
        return None
    return int(datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp())


def _gpus(run: dict) -> int:
    tres = run["AllocTRES"] or run["ReqTRES"]
    return int(next((kv.split("=")[1] for kv in tres.split(",") if kv.startswith("gres/gpu=")), 0))


def _hold_offs(dump: Path) -> list[tuple[str, str, int, int]]:
    """(job, state of the earlier run, seconds from its End to the next run's Eligible, GPUs) for each requeue in a
    `sacct -D --parsable2` dump: the time Slurm holds a requeued job back (cred_expire), in which the ledger
    holds it too (`job.preempted` with `held`): not pending demand."""
    out = []
    for job, rs in _dump_runs(dump).items():
        for a, b in zip(rs, rs[1:]):
            gap = _epoch(b["Eligible"]) - _epoch(a["End"])
            out.append((job, a["State"].split()[0], gap, _gpus(a)))
    return out


def _eligible_demand(dump: Path) -> tuple[dict, dict]:
    """From Slurm's own Eligible: GPU-seconds each account's jobs waited while eligible (each run, from its
    Eligible to its Start, or to its End when it ended without starting after it was eligible), and each run's
    (job, index in Submit order) -> Eligible. A run cancelled while held (End at or before Eligible) waited 0."""
    demand: Counter = Counter()
    eligible = {}
    for job, rs in _dump_runs(dump).items():
        for k, r in enumerate(rs):
            el, start, end = _epoch(r["Eligible"]), _epoch(r["Start"]), _epoch(r["End"])
            if el is None or not _gpus(r):
                continue
            eligible[(job, k)] = el
            until = start if start is not None else end
            if until is not None and until > el:
                demand[TEAM[r["Account"]]] += (until - el) * _gpus(r)
    return dict(demand), eligible


# the ledger's policy in this test: a decision 1 s after a job waits, and any job started 1 s ago may be a victim
POLICY = FoldConfig(preemption_grace_s=1, min_runtime_s=1)
# a job that runs long the first time and briefly when Slurm runs it again (requeued or preempted)
RERUN_SHORT = 'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then sleep %d; else sleep %d; fi'


def _fold(events: Path, lake: Path):
    summary, _ = run_file(events, lake, fold_config=POLICY, overwrite=True)
    assert not summary.dead_letters and summary.late == 0, summary
    return summary


@pytest.fixture(scope="module")
def workload(slurm, tmp_path_factory):
    """Runs the jobs while a watcher polls (restarted half-way) and the actuator applies the ledger's reclaim
    decision; returns what the tests compare. About 90 s: Slurm enforces time limits in whole minutes, so the
    timeout job runs ~1 minute (the rest runs beside it)."""
    d = tmp_path_factory.mktemp("slurm-watch")
    state, out = d / "watch.state", d / "watch.jsonl"
    # the workload must lie within one clock hour: one that crossed xx:00 (a CI run at 21:58:53-22:00:19) had
    # sreport miss the seconds after the hour (vision 96 GPU-seconds against the ledger's and sacct's 115: the
    # timeout job's 19 s after 22:00), as the hour rolled up by `sacctmgr rollup` stopped at its boundary
    left = 3600 - time.time() % 3600
    if left < WORKLOAD_MAX_S:
        print(f"\nslurm workload: waiting {left + 5:.0f} s for the next clock hour (it must not cross one)")
        time.sleep(left + 5)
    since = parse_since("cluster", CLUSTER)
    w = Watcher(CLUSTER, state, JsonlSink(out), since=since, settle_s=SETTLE_S)
    w.poll()
    sb = slurm.sbatch
    jobs = {}
    # a100: 16 GPUs (n1, n2)
    jobs["timeout"] = sb("-A", "vision", "-p", "a100", "--gres=gpu:1", "-t", "1", "--wrap", "sleep 300")
    jobs["ok"] = sb("-A", "vision", "-p", "a100", "--gres=gpu:2", "--wrap", "sleep 4")
    # two other Unix users' jobs in vision (scripts/slurm.sh creates them), submitted for them by root
    jobs["alice"] = sb("--uid=alice", "-A", "vision", "-p", "a100", "--gres=gpu:2", "--wrap", "sleep 3")
    jobs["bob"] = sb("--uid=bob", "-A", "vision", "-p", "a100", "--gres=gpu:1", "--wrap", "sleep 5")
    jobs["array"] = sb("-A", "speech", "-p", "a100", "-a", "0-3", "--gres=gpu:1", "--wrap", "sleep 3")
    jobs["fail"] = sb("-A", "nlp", "-p", "a100", "--gres=gpu:1", "--wrap", "sleep 2; exit 3")
    jobs["cancel"] = sb("-A", "speech", "-p", "a100", "--gres=gpu:2", "--wrap", "sleep 300")
    jobs["held"] = sb("-A", "vision", "-p", "a100", "--hold", "--gres=gpu:4", "--wrap", "sleep 1")
    jobs["requeue"] = sb("-A", "vision", "-p", "a100", "--gres=gpu:2", "--wrap", RERUN_SHORT % (2, 300))
    jobs["requeue_cancel"] = sb("-A", "speech", "-p", "a100", "--gres=gpu:1", "--wrap", "sleep 300")
    # h100: 16 GPUs (n3, n4): a two-node job, then a QOS preemption, then the ledger's reclaim
    jobs["multi"] = sb("-A", "nlp", "-p", "h100", "-N", "2", "--gres=gpu:8", "--wrap", "sleep 3")
    slurm.wait(lambda: all(slurm.state(jobs[j]) == "RUNNING" for j in ("requeue", "cancel", "requeue_cancel")),
               what="jobs running")
    time.sleep(2)
    slurm.cmd("scontrol", "requeue", jobs["requeue"])  # an admin requeue
    slurm.cmd("scontrol", "requeue", jobs["requeue_cancel"])  # requeued, then cancelled in its hold-off (6 s)
    slurm.cmd("scancel", jobs["cancel"])
    slurm.cmd("scancel", jobs["held"])  # cancelled while held: never eligible
    time.sleep(2)  # (cancelled in the second of its requeue, 22.05 writes no record of the cancel)
    slurm.cmd("scancel", jobs["requeue_cancel"])
    w.poll()
    slurm.wait(lambda: slurm.state(jobs["multi"]) == "", what="two-node job done")
    jobs["victim"] = sb("-A", "speech", "-p", "h100", "-N", "2", "--gres=gpu:8", "--wrap", RERUN_SHORT % (2, 300))
    slurm.wait(lambda: slurm.state(jobs["victim"]) == "RUNNING", what="victim running")
    time.sleep(2)
    w.poll()
    jobs["high"] = sb("-A", "nlp", "-p", "h100", "--qos=high", "--gres=gpu:8", "--wrap", "sleep 3")
    w = Watcher(CLUSTER, state, JsonlSink(out), settle_s=SETTLE_S)  # restarted mid-run
    slurm.wait(lambda: slurm.state(jobs["victim"]) == "" and slurm.state(jobs["high"]) == "",
               what="QOS preemption played out")
    # the ledger's reclaim: speech (no h100 quota) borrows all 16 h100 GPUs; nlp (8 in quota) waits
    jobs["borrower"] = sb("-A", "speech", "-p", "h100", "-N", "2", "--gres=gpu:8", "--wrap", RERUN_SHORT % (2, 300))
    slurm.wait(lambda: slurm.state(jobs["borrower"]) == "RUNNING", what="borrower running")
    time.sleep(2)
    jobs["reclaimer"] = sb("-A", "nlp", "-p", "h100", "--gres=gpu:8", "--wrap", "sleep 3")
    decisions = []
    deadline = time.monotonic() + 60
    while not decisions:
        assert time.monotonic() < deadline, "the ledger made no reclaim decision"
        time.sleep(1)
        w.poll()
        _fold(out, d / "decide-lake")
        decisions = decisions_from_lake(d / "decide-lake")
    actuated = Actuator(CLUSTER, d / "actuate.state").apply_all(decisions)
    again = Actuator(CLUSTER, d / "actuate.state").apply_all(decisions)  # restart: applied once
    slurm.wait(lambda: slurm.state(jobs["borrower"]) == "" and slurm.state(jobs["reclaimer"]) == "",
               what="reclaim played out")
    slurm.cmd("scontrol", "update", "nodename=n4", "state=drain", "reason=fan")  # an idle node drained 3 s
    time.sleep(3)
    slurm.cmd("scontrol", "update", "nodename=n4", "state=resume")
    # a maintenance reservation on the idle n4 for about 3 s (planned for 10 minutes, ended early)
    slurm.cmd("scontrol", "create", "reservation", "reservationname=chipledger-maint", "starttime=now",
              "duration=10", "nodes=n4", "flags=maint", "users=root")
    time.sleep(3)
    slurm.cmd("scontrol", "delete", "reservationname=chipledger-maint")
    # n4 out of service for about 3 s (FUTURE): sinfo stops listing it, slurmdbd records it DOWN (sreport: Down)
    slurm.cmd("scontrol", "update", "nodename=n4", "state=future")
    time.sleep(1)
    w.poll()  # while sinfo does not list n4: its GPUs stay registered (down), not retired
    time.sleep(2)
    slurm.cmd("scontrol", "update", "nodename=n4", "state=resume")
    deadline = time.monotonic() + 150
    while not slurm.queue_empty():
        assert time.monotonic() < deadline, slurm.cmd("squeue")
        w.poll()
        time.sleep(1)
    time.sleep(SETTLE_S + 2)
    w.poll()
    end = int(time.time())
    return {"dir": d, "state": state, "out": out, "since": since, "jobs": jobs, "end": end,
            "decisions": decisions, "actuated": actuated, "again": again}


def test_watch_sends_each_event_once_and_a_restart_adds_nothing(workload):
    """Polling again adds only a tick; a watcher started from scratch (the CLI, --once) sends the same events."""
    evs = _events(workload["out"])
    ids = [e["event_id"] for e in evs]
    assert len(ids) == len(set(ids))
    before = len(evs)
    again = Watcher(CLUSTER, workload["state"], JsonlSink(workload["out"]), settle_s=SETTLE_S)
    res = again.poll()
    assert set(res.by_type) <= {"pool.tick"}, res
    fresh_out = workload["dir"] / "fresh.jsonl"
    res = CliRunner().invoke(app, ["slurm", "watch", "--once", "--since", "cluster", "--settle", str(SETTLE_S),
                                   "--state", str(workload["dir"] / "fresh.state"), "--out", str(fresh_out)])
    assert res.exit_code == 0, res.output

    def body(es):
        return sorted(json.dumps(e, sort_keys=True) for e in es if e["type"] != "pool.tick")

    assert body(_events(fresh_out)) == body(evs[:before])
    assert all(e["source"] == f"{CLUSTER}/slurm" for e in evs)


def _restarted(slurm, workload, job: str) -> bool:
    """Whether Slurm started `job` again after its requeue (its last run in accounting has a Start). The workload
    cancels `requeue_cancel` 2 s after its requeue, inside a hold-off of a few seconds; on a loaded machine the
    commands between can take longer, and Slurm then releases and starts it before the cancel: the ledger must follow
    what Slurm did either way."""
    runs = _dump_runs(_sacct_dump(slurm, workload))[job]
    start, eligible = _epoch(runs[-1]["Start"]), _epoch(runs[-1]["Eligible"])
    # a run cancelled while held has Start = End = the cancel, before its Eligible (measured on 22.05.8)
    return len(runs) > 1 and start is not None and eligible is not None and start >= eligible


def test_watch_maps_what_slurm_did(slurm, workload):
    jobs = workload["jobs"]
    evs = [e for e in _events(workload["out"]) if e["type"].startswith("job.")]
    of = lambda job: [(e["type"], e.get("outcome"), e.get("decision_id")) for e in evs if e["job_id"] == job]
    assert of(jobs["ok"]) == [("job.submitted", None, None), ("job.started", None, None),
                              ("job.finished", "succeeded", None)]
    assert of(jobs["fail"])[-1] == ("job.finished", "failed", None)
    assert of(jobs["timeout"])[-1] == ("job.finished", "failed", None)
    assert of(jobs["cancel"])[-1] == ("job.finished", "cancelled", None)
    assert of(jobs["held"]) == []  # cancelled while held: never demand
    assert [t for t, _, _ in of(jobs["requeue"])] == ["job.submitted", "job.started", "job.checkpointed",
                                                       "job.preempted", "job.released", "job.started",
                                                       "job.finished"]
    assert [t for t, _, _ in of(jobs["victim"])] == ["job.submitted", "job.started", "job.preempted",
                                                      "job.released", "job.started", "job.finished"]
    # requeued, then cancelled in its hold-off: held from the requeue to the cancel, never released (or, when Slurm
    # started it again before the cancel came, released, started and cancelled)
    again = [("job.released", None, None), ("job.started", None, None)]
    assert of(jobs["requeue_cancel"]) == [("job.submitted", None, None), ("job.started", None, None),
                                          ("job.checkpointed", None, None), ("job.preempted", None, None),
                                          *(again if _restarted(slurm, workload, jobs["requeue_cancel"]) else []),
                                          ("job.finished", "cancelled", None)]
    assert all(e.get("held") is True for e in evs if e["type"] == "job.preempted")
    # n4 set to FUTURE for a while: down (its node event), never retired
    chips = [e for e in _events(workload["out"]) if e["type"].startswith("chip.")]
    assert not [e for e in chips if e["type"] == "chip.retired"]
    future = {e["chip_id"] for e in chips if e.get("reason") == "DOWN: Set to State=FUTURE" and e["state"] == "down"}
    assert future == {f"n4-gpu{i}" for i in range(8)}
    assert {e["job_id"] for e in evs if e["job_id"].startswith(jobs["array"] + "_")} == \
        {f"{jobs['array']}_{i}" for i in range(4)}
    multi = [e for e in evs if e["job_id"] == jobs["multi"] and e["type"] == "job.submitted"]
    assert multi[0]["chips"] == 16 and multi[0]["chips_per_node"] == 8
    teams = {e["team"] for e in evs if e["type"] == "job.submitted"}
    assert teams == set(TEAM.values())  # the account hierarchy: research/vision, research/nlp, speech
    users = {e["job_id"]: e.get("user") for e in evs if e["type"] == "job.submitted"}
    assert users[jobs["alice"]] == "alice" and users[jobs["bob"]] == "bob" and users[jobs["ok"]] == "root"
    assert set(users.values()) == {"root", "alice", "bob"}


def test_watch_books_equal_sreport(slurm, workload):
    d = workload["dir"]
    start = _hour(workload["since"])
    end = _hour(workload["end"]) + 3600  # sreport rolls whole hours: close the books at the hour's end
    events = _with_final_ticks(workload["out"], d / "closed.jsonl", end)
    _fold(events, d / "lake")
    teams, pool = _books(d / "lake")
    used, by_user, util = _sreport(slurm, start, end)
    assert teams == used
    assert pool["capacity"] == util["reported"]
    print(f"\nsreport: per account {used}, cluster {util}\nledger:  per team {teams}, pool accounts {pool}")
    users = _books_by_user(d / "lake")
    print(f"per account and user: sreport {sorted(by_user.items())}\n"
          f"                      ledger  {sorted(users.items())}")
    assert users == by_user
    assert {u for (a, u) in users if a == "research/vision"} == {"root", "alice", "bob"}
    by_part, sreport_by_part = _books_by_pool(d / "lake"), _sreport_by_partition(slurm, start, end)
    print(f"per partition and account: sreport {sorted(sreport_by_part.items())}\n"
          f"                           ledger  {sorted(by_part.items())}")
    assert by_part == sreport_by_part
    maint = util["maintenance_gpu_s"]
    assert maint >= 8 * 2 and util["planned_down"] == 0  # n4's 8 GPUs in maintenance for about 3 s
    assert pool.get("unavailable", 0) == util["down"] + maint  # maintenance to the second it began and ended
    assert util["down"] >= 8 * 3 * 2  # n4's 8 GPUs drained for about 3 s, then FUTURE for about 3 s
    assert pool["idle"] + maint == util["idle"] + util["planned"]
    assert sum(teams.values()) == util["allocated"]
    assert pool.get("overcommitted", 0) == 0


def test_pending_demand_and_waits_begin_at_slurms_eligible(slurm, workload):
    """The hold-off of each requeue (End to the next Eligible) is no demand: the ledger's `pending` account per
    team equals the GPU-seconds Slurm's own Eligible gives, and each restart's wait begins at that Eligible."""
    d = workload["dir"]
    dump = _sacct_dump(slurm, workload)
    holds = _hold_offs(dump)
    expected, eligible = _eligible_demand(dump)
    con = duckdb.connect()
    rows = con.execute(f"SELECT team, sum(amount_mchip_s) FROM read_parquet('{d}/lake/journal/**/*.parquet') "
                       f"WHERE account = 'pending' GROUP BY ALL").fetchall()
    pending = {team: amount // 1000 for team, amount in rows if amount}
    held = sum(s * g for _, _, s, g in holds)
    print(f"\nrequeue hold-offs (End of a run to Eligible of the next; held, not pending demand): {holds}, "
          f"{held} GPU-seconds\npending GPU-seconds per account: from Slurm's Eligible {expected}, ledger {pending}")
    assert len(holds) >= 4 and held > 0  # the admin requeue, the requeue then cancel, the QOS preemption, the reclaim
    assert pending == expected
    waits = con.execute(f"SELECT DISTINCT job_id, run_index, epoch(began_at)::BIGINT, epoch(ended_at)::BIGINT "
                        f"FROM read_parquet('{d}/lake/waits/**/*.parquet') WHERE \"end\" <> 'open'").fetchall()
    restarts = {(j, k): (b, e) for j, k, b, e in waits if k > 0}
    restarted = _restarted(slurm, workload, workload["jobs"]["requeue_cancel"])
    # the job cancelled while held waited for no restart (unless Slurm started it again before the cancel came)
    assert restarts and len(restarts) == len(holds) - (0 if restarted else 1)
    for (job, k), (began, _) in restarts.items():
        assert began == eligible[(job, k)], (job, k, began, eligible[(job, k)])
    assert bool([w for w in waits if w[0] == workload["jobs"]["requeue_cancel"] and w[1] > 0]) == restarted


def test_actuate_applies_the_reclaim_and_watch_brings_it_back(workload):
    jobs = workload["jobs"]
    (decision,) = workload["decisions"]
    assert decision["rule"] == "reclaim" and decision["pool"] == f"{CLUSTER}/h100"
    assert decision["beneficiary"]["job_id"] == jobs["reclaimer"]
    assert [v["job_id"] for v in decision["victims"]] == [jobs["borrower"]]
    (done,) = workload["actuated"]
    assert done.applied == [(jobs["borrower"], "requeue")] and not done.skipped
    assert [o.skipped for o in workload["again"]] == ["applied before"]
    evs = [e for e in _events(workload["out"]) if e.get("job_id") == jobs["borrower"]]
    assert [(e["type"], e.get("decision_id")) for e in evs] == [
        ("job.submitted", None), ("job.started", None), ("job.preempted", decision["decision_id"]),
        ("job.released", None), ("job.started", None), ("job.finished", None)]
    reclaimer = [e["type"] for e in _events(workload["out"]) if e.get("job_id") == jobs["reclaimer"]]
    assert reclaimer == ["job.submitted", "job.started", "job.finished"]


def test_actuate_cli_dry_run_and_once_per_decision(workload):
    """The decision was applied (state file): the CLI on the same lake and state applies nothing again."""
    lake = workload["dir"] / "decide-lake"
    res = CliRunner().invoke(app, ["slurm", "actuate", "--lake", str(lake), "--state",
                                   str(workload["dir"] / "actuate.state")])
    assert res.exit_code == 0, res.output
    assert "decisions 1 applied 0 gone 0 skipped 1" in res.output
    res = CliRunner().invoke(app, ["slurm", "actuate", "--lake", str(lake), "--dry-run", "--state",
                                   str(workload["dir"] / "dry.state")])
    assert res.exit_code == 0, res.output
    assert "decisions 1 applied 0 gone 1 skipped 0 (dry run)" in res.output  # the victim is long finished


def test_import_sacct_books_equal_sreport(slurm, workload):
    d = workload["dir"]
    _sacct_dump(slurm, workload)
    (d / "sinfo.json").write_text(slurm.cmd("sinfo", "--json"))
    (d / "assoc.txt").write_text(slurm.cmd("sacctmgr", "-P", "show", "assoc",
                                           "format=id,account,user,partition,grptres,parentname"))
    (d / "node-events.txt").write_text(slurm.cmd("sacctmgr", "-n", "-P", "show", "event", "event=node",
                                                 f"start={_iso(workload['since'])}",
                                                 "format=nodename,start,end,state,reason"))
    (d / "reservations.txt").write_text(slurm.cmd("sacctmgr", "-n", "-P", "show", "reservation",
                                                  f"start={_iso(workload['since'])}",
                                                  "format=name,nodenames,start,end,flags"))
    res = CliRunner().invoke(app, ["import", "sacct", str(d / "sacct.txt"), "-o", str(d / "import.jsonl"),
                                   "--cluster", CLUSTER, "--nodes", str(d / "sinfo.json"), "--assoc",
                                   str(d / "assoc.txt"), "--inventory-at", str(workload["since"]),
                                   "--node-events", str(d / "node-events.txt"),
                                   "--reservations", str(d / "reservations.txt"), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert not [n for n in report["notes"] if n.startswith("WARNING")], report["notes"]
    start = _hour(workload["since"])
    end = _hour(workload["end"]) + 3600
    _fold(_with_final_ticks(d / "import.jsonl", d / "import-closed.jsonl", end), d / "import-lake")
    teams, pool = _books(d / "import-lake")
    used, by_user, util = _sreport(slurm, start, end)
    assert teams == used
    assert _books_by_user(d / "import-lake") == by_user == _books_by_user(d / "lake")
    maint = util["maintenance_gpu_s"]
    assert pool["capacity"] == util["reported"] and pool["idle"] + maint == util["idle"] + util["planned"]
    assert pool["unavailable"] == util["down"] + maint
    assert (teams, pool) == _books(d / "lake")  # and the same books as the watcher's


def _usage_lake(workload) -> Path:
    """The watcher's events folded with the books closed at the hour after the workload (what sreport rolls up)."""
    d = workload["dir"]
    lake = d / "usage-lake"
    if not lake.exists():
        end = _hour(workload["end"]) + 3600
        _fold(_with_final_ticks(workload["out"], d / "usage-closed.jsonl", end), lake)
    return lake


def test_usage_equals_sreport_account_utilization_by_user(slurm, workload):
    """`chipledger usage -t seconds -P` against `sreport -t seconds -T gres/gpu cluster AccountUtilizationByUser`:
    the org research (Slurm's parent account), its teams, speech and every user, to the GPU-second (sreport adds the
    GPU types up; the ledger keeps a row per flavor: summed here, for the comparison only)."""
    start = _hour(workload["since"])
    end = _hour(workload["end"]) + 3600
    lake = _usage_lake(workload)
    res = CliRunner().invoke(app, ["usage", "--lake", str(lake), "-S", _iso(start), "-E", _iso(end), "-t", "seconds",
                                   "-P", "-n"])
    assert res.exit_code == 0, res.output
    ours: Counter = Counter()
    for line in res.stdout.splitlines():
        cluster, account, login, tres, used = line.split("|")
        assert cluster == CLUSTER and tres in ("chip/a100", "chip/h100")
        ours[(account, login)] += int(used)
    slurm.cmd("sacctmgr", "-i", "rollup", _iso(start), _iso(end))
    text = slurm.cmd("sreport", "-n", "-P", "-t", "seconds", "-T", "gres/gpu", "cluster", "AccountUtilizationByUser",
                     f"start={_iso(start)}", f"end={_iso(end)}")
    theirs = {}
    for x in text.splitlines():
        f = x.split("|")  # cluster|account|login|proper name|TRES|used
        if len(f) == 6 and f[1] != "root" and int(f[5]):
            theirs[(TEAM.get(f[1], f[1]), f[2])] = int(f[5])
    print(f"\nsreport AccountUtilizationByUser {sorted(theirs.items())}\nchipledger usage               "
          f"{sorted(ours.items())}")
    assert dict(ours) == theirs
    assert ("research", "") in theirs and theirs[("research", "")] == sum(
        theirs.get((TEAM[a], ""), 0) for a in ORGS["research"])
    # hours: the same numbers in another unit (sreport rounds its hours; the ledger's are exact)
    res = CliRunner().invoke(app, ["usage", "--lake", str(lake), "-S", _iso(start), "-E", _iso(end), "-t",
                                   "minutes", "-P", "-n", "--no-users"])
    assert res.exit_code == 0, res.output
    assert {r.split("|")[1] for r in res.stdout.splitlines()} == {"research", *TEAM.values()}


def test_share_tree_is_sshares(slurm, workload):
    """`chipledger share` against `sshare -l -a`: the same tree (the org research over its teams vision and nlp,
    speech at the top, each team's users that ran jobs), and each user's usage equal to sreport's per user.

    sshare's RawUsage is not compared: the test cluster purges a finished job after MinJobAge=2 s, and Slurm's
    priority plugin adds usage once per PriorityCalcPeriod (measured on 22.05.8: jobs of a few seconds never reached
    RawUsage, even with PriorityCalcPeriod=1 and a fair-share weight). The ledger's raw shares are the nominal
    quota per pool, Slurm's the associations' Fairshare (1 here): a different quantity too."""
    lake = _usage_lake(workload)
    res = CliRunner().invoke(app, ["share", "--lake", str(lake), "--format", "json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    ours = {(r["account"], r["user"] or "") for r in rows}
    text = slurm.cmd("sshare", "-l", "-a", "-P", "-n", "-o", "Account,User,RawShares")
    tree, parent, depth_of = set(), {}, {}
    stack: list = []
    for x in text.splitlines():
        account, user, _ = x.split("|")
        depth = len(account) - len(account.lstrip(" "))
        account = account.strip()
        if not user:
            while stack and stack[-1][1] >= depth:
                stack.pop()
            parent[account] = stack[-1][0] if stack else None
            stack.append((account, depth))
        if account != "root":
            tree.add((TEAM.get(account, account), user))
    assert parent["vision"] == parent["nlp"] == "research" and parent["research"] == parent["speech"] == "root"
    assert {a for a, u in ours if not u} == {"research", *TEAM.values()}
    assert ours <= tree  # every team and user the ledger shows is an association of sshare's tree
    # teams: the core's numbers (nominal quota as raw shares: vision a100 8, nlp a100 4 and h100 8, speech none)
    shares = {(r["pool"], r["account"]): r["raw_shares"] for r in rows if not r["user"]}
    assert shares[(f"{CLUSTER}/a100", "research/vision")] == 8 and shares[(f"{CLUSTER}/h100", "research/nlp")] == 8
    assert shares[(f"{CLUSTER}/a100", "research")] == 12
    teams = [r for r in rows if not r["user"] and r["account"] in TEAM.values()]
    assert teams and all(r["fair_share"] is not None and 0 <= r["fair_share"] <= 1 for r in teams)
    # users: their allocated GPU-seconds, all pools together, are sreport's per account and user
    start, end = _hour(workload["since"]), _hour(workload["end"]) + 3600
    _, by_user, _ = _sreport(slurm, start, end)
    users: Counter = Counter()
    for r in rows:
        if r["user"]:
            users[(r["account"], r["user"])] += round(r["raw_usage_chip_s"])
    assert dict(users) == by_user


# --- `slurm watch --prices` on the real Slurm (issue 36) ----------------------------------------------------------

def _billing_weights(slurm, partition: str) -> str:
    """The partition's TRESBillingWeights as `scontrol show partition -o` gives it ('' when not set)."""
    from chipledger.adapters.slurm.commands import partition_billing_from_text

    return partition_billing_from_text(slurm.cmd("scontrol", "show", "partition", partition, "-o")).get(partition, "")


def _grp_tres_mins(slurm, account: str) -> str:
    """The account association's GrpTRESMins ('' when not set)."""
    out = slurm.cmd("sacctmgr", "-n", "-P", "show", "assoc", f"cluster={CLUSTER}", f"account={account}",
                    "format=user,grptresmins").splitlines()
    return next((mins for user, _, mins in (ln.partition("|") for ln in out) if not user), "")


def _set_weights(slurm, partition: str, weights: str) -> None:
    slurm.cmd("scontrol", "update", f"PartitionName={partition}", f"TRESBillingWeights={weights}")


def _set_mins(slurm, account: str, mins: str) -> None:
    slurm.cmd("sacctmgr", "-i", "modify", "account", account, "set", f"GrpTRESMins={mins}")


def test_watch_prices_maps_billing_weights_and_grp_tres_mins_of_the_real_slurm(slurm, tmp_path):
    """TRESBillingWeights set on the live partitions with `scontrol update` and GrpTRESMins on the live accounts with
    `sacctmgr modify`; `chipledger slurm watch --prices --once`, as a user runs it, sends them as price.set
    (the GPU's weight × 60 billing-minutes per chip-hour, the pool's GPU type first) and monthly budget.set (GPU-minutes
    as chip-minutes, with the chip-min price of 60 per chip-hour in those pools); the ledger applies them; a weight
    changed at run time is sent again (same price id) on the next poll, and nothing else is. The Slurm settings are
    put back afterwards (other tests share this Slurm)."""
    saved_w = {p: _billing_weights(slurm, p) for p in ("a100", "h100")}
    saved_m = {a: _grp_tres_mins(slurm, a) for a in ("vision", "nlp")}
    state, out = tmp_path / "watch.state", tmp_path / "events.jsonl"

    def watch() -> list[dict]:
        before = len(_events(out)) if out.exists() else 0
        res = CliRunner().invoke(app, ["slurm", "watch", "--prices", "--once", "--since", "cluster", "--settle",
                                       str(SETTLE_S), "--state", str(state), "--out", str(out)])
        assert res.exit_code == 0, res.output
        return [e for e in _events(out)[before:] if e["type"] in ("price.set", "budget.set")]

    def seen(evs: list[dict]) -> set:
        return {(e["type"], e["pool"], e.get("team"), e["unit"], e.get("per_chip_hour", e.get("amount")))
                for e in evs}

    a100, h100 = f"{CLUSTER}/a100", f"{CLUSTER}/h100"
    try:
        # a typed weight beats the untyped one; CPU and memory weights are not the chips' price
        _set_weights(slurm, "a100", "CPU=1.0,Mem=0.25G,GRES/gpu=1.5")
        _set_weights(slurm, "h100", "CPU=1.0,GRES/gpu=2.0,GRES/gpu:h100=4.5")
        _set_mins(slurm, "vision", "gres/gpu:a100=60000")
        _set_mins(slurm, "nlp", "gres/gpu:h100=30000")
        assert "GRES/gpu:h100=4.5" in _billing_weights(slurm, "h100")
        assert "gres/gpu:a100=60000" in _grp_tres_mins(slurm, "vision")
        first = watch()
        assert seen(first) == {
            ("price.set", a100, None, "slurm-billing-min", 90), ("price.set", h100, None, "slurm-billing-min", 270),
            ("price.set", a100, None, "chip-min", 60), ("price.set", h100, None, "chip-min", 60),
            ("budget.set", a100, TEAM["vision"], "chip-min", 60000),
            ("budget.set", h100, TEAM["nlp"], "chip-min", 30000)}
        assert all(e["period"] == "month" for e in first if e["type"] == "budget.set")
        # polling again sends nothing; a weight changed on the live partition is one new setting of its price id
        assert watch() == []
        _set_weights(slurm, "h100", "CPU=1.0,GRES/gpu=2.0,GRES/gpu:h100=5")
        again = watch()
        assert seen(again) == {("price.set", h100, None, "slurm-billing-min", 300)}
        [old] = [e for e in first if e["pool"] == h100 and e["unit"] == "slurm-billing-min"]
        assert again[0]["price_id"] == old["price_id"] and again[0]["event_id"] != old["event_id"]
        # the ledger applies every event the watcher sent (prices forward of the pool clock, budgets per team)
        run_file(out, tmp_path / "lake")
        from analytics.views import connect

        con = connect(tmp_path / "lake")
        assert con.execute("SELECT count(*) FROM deadletters WHERE event_type IN ('price.set', 'budget.set')"
                           ).fetchone()[0] == 0
        prices = con.execute("SELECT pool, unit, per_chip_hour FROM prices ORDER BY set_at, pool, unit").fetchall()
        assert len(prices) == 5 and prices[-1] == (h100, "slurm-billing-min", 300)
        budgets = con.execute("SELECT pool, team, amount, unit FROM budgets ORDER BY pool").fetchall()
        assert budgets == [(a100, TEAM["vision"], 60000, "chip-min"), (h100, TEAM["nlp"], 30000, "chip-min")]
    finally:
        for p, w in saved_w.items():
            _set_weights(slurm, p, w)
        for a, m in saved_m.items():
            _set_mins(slurm, a, m or "gres/gpu=-1,gres/gpu:a100=-1,gres/gpu:h100=-1,billing=-1")
    assert {p: _billing_weights(slurm, p) for p in saved_w} == saved_w
    assert {a: _grp_tres_mins(slurm, a) for a in saved_m} == saved_m
