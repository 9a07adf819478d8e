"""Benchmark of the policy layer: goodput-aware victims against the naive order, and the cost of deciding.

    .venv/bin/python bench/policy.py [--days 7] [--seed 5] [--chips 10000] [--jobs 5000] [--events 20000]

1. Closed loop on an oversubscribed demo fleet (one pool of 512 chips on 8-chip nodes, six teams whose quotas
   add up to the capacity, demand about 1.4× the capacity, jobs of 1-64 chips running 4 h on average that
   checkpoint every 10 to 60 min). A small cluster simulator acts on the ledger's decisions: it preempts the named victims (job.preempted
   with the decision_id) 10 s after a decision unless the beneficiary started meanwhile, starts pending jobs when chips are free (jobs a decision made
   room for first, then jobs inside their team's quota, then borrowers; each in priority and arrival order),
   checkpoints running jobs, and finishes them when their work is done (a preempted job redoes the work since
   its last checkpoint). The same demand (same seed, same arrivals) runs twice in this process: victims in the
   goodput order (DESIGN §4) and in the naive order (lowest priority, then most recently started). Reported:
   work lost to preemptions (chip-hours), preemptions, and quota honoured: of the jobs submitted while they fit
   their team's unused quota, the share started within 10 minutes. Target: >= 30% less lost work, quota
   honoured no worse.
2. Decision time: a pool of `--chips` chips with `--jobs` running jobs (every chip busy, ten teams, most of
   them borrowing) and a queue of pending jobs; then `--events` more events (submissions, finishes, starts,
   checkpoints) are folded one at a time and timed. Reported: median and p99 time per event, over all events
   and over the events that made a preemption decision. Target: median < 1 ms.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ledger import FoldConfig, Fleet  # noqa: E402
from ledger.policy import decision_of  # noqa: E402
from schemas import Rejection, parse_payload  # noqa: E402

POOL = "bench/a100"
T0 = 1_793_606_400  # 2026-11-02T00:00:00Z + 8 h, a Monday


def iso(t: int) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


class Ledger:
    """The fold plus the event ids: what the cluster sends and what it gets back."""

    def __init__(self, config: FoldConfig):
        self.fleet = Fleet(config)
        self.seq = 0
        self.lost_mchip_s = 0
        self.preemptions = 0

    def send(self, etype: str, t: int, **fields) -> list:
        self.seq += 1
        e = parse_payload({"event_id": f"ev-{self.seq}", "type": etype, "occurred_at": iso(t), "pool": POOL,
                           "source": "bench", **fields})
        assert not isinstance(e, Rejection), e
        step = self.fleet.apply(e)
        assert step.rejection is None, (etype, fields, step.rejection)
        for run in step.job_runs:
            if run.end_reason == "preempted":
                self.lost_mchip_s += run.lost_mchip_s
                self.preemptions += 1
        return [decision_of(row) for row in step.decisions if row[1] == "decision.preempt"]


class Job:
    __slots__ = ("jid", "team", "chips", "prio", "work", "done_safe", "ckpt_every", "submitted", "started",
                 "first_start", "in_quota_at_submit", "running", "version")

    def __init__(self, jid, team, chips, prio, work, ckpt_every, submitted):
        self.jid, self.team, self.chips, self.prio, self.work = jid, team, chips, prio, work
        self.done_safe = 0  # work saved by the last checkpoint (seconds of this job's run time)
        self.ckpt_every = ckpt_every
        self.submitted = submitted
        self.started = None
        self.first_start = None
        self.in_quota_at_submit = False
        self.running = False
        self.version = 0  # bumps at each start/stop, so stale timer events are ignored


def workload(seed: int, days: float, capacity: int, teams: dict[str, int]) -> list[tuple]:
    """The demand: (submit time, team, chips, priority, work seconds, checkpoint interval), seeded."""
    rng = random.Random(seed)
    out = []
    names = sorted(teams)
    weights = [teams[n] for n in names]
    sizes = [1, 2, 4, 8, 8, 16, 16, 32, 64]
    mean_size = sum(sizes) / len(sizes)
    mean_work = 4 * 3600
    rate = 1.4 * capacity / (mean_size * mean_work)  # arrivals per second for ~1.4x the capacity
    t = float(T0)
    end = T0 + days * 86400
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            break
        team = rng.choices(names, weights)[0]
        prio = rng.choice((0, 0, 0, 1, 1, 2))
        out.append((int(t), team, rng.choice(sizes), prio, int(rng.expovariate(1 / mean_work)) + 300,
                    rng.randrange(600, 3600)))
    return out


def simulate(order: str, seed: int, days: float) -> dict:
    """One closed-loop run; returns lost chip-hours, preemptions, quota honoured and counts."""
    capacity = 512
    teams = {"ads": 128, "search": 96, "vision": 96, "speech": 64, "research": 64, "infra": 64}
    cfg = FoldConfig(victim_order=order, policy_rows=False)
    led = Ledger(cfg)
    led.send("pool.configured", T0 - 60, flavor="a100", chips_per_node=8)
    for i in range(capacity):
        led.send("chip.registered", T0 - 60, chip_id=f"c{i}", node=f"n{i // 8}")
    for team, q in teams.items():
        led.send("quota.granted", T0 - 60, grant_id=f"g-{team}", team=team, chips=q)
    jobs: dict[str, Job] = {}
    timers: list = []  # (t, seq, kind, job id or decision, version)
    tseq = 0
    used = {t: 0 for t in teams}
    free = capacity
    pending: dict[str, Job] = {}
    everyone: list[Job] = []
    priority_start: list[str] = []  # beneficiaries of decisions acted on: started first

    def at(t, kind, payload, version=0):
        nonlocal tseq
        tseq += 1
        heapq.heappush(timers, (t, tseq, kind, payload, version))

    for i, (ts, team, chips, prio, work, ck) in enumerate(workload(seed, days, capacity, teams)):
        at(ts, "submit", Job(f"j{i}", team, chips, prio, work, ck, ts))

    def on_decisions(ds, t):
        for d in ds:
            at(t + 10, "act", d)

    def start(job: Job, t: int):
        nonlocal free
        pending.pop(job.jid, None)
        job.running = True
        job.started = t
        job.version += 1
        if job.first_start is None:
            job.first_start = t
        free -= job.chips
        used[job.team] += job.chips
        on_decisions(led.send("job.started", t, job_id=job.jid), t)
        left = job.work - job.done_safe
        if job.ckpt_every < left:
            at(t + job.ckpt_every, "ckpt", job.jid, job.version)
        at(t + left, "finish", job.jid, job.version)

    def stop(job: Job, t: int):
        nonlocal free
        job.running = False
        job.version += 1
        free += job.chips
        used[job.team] -= job.chips

    def schedule(t: int):
        # jobs a decision made room for, then in-quota jobs, then borrowers; priority, then arrival
        for jid in list(priority_start):
            job = pending.get(jid)
            if job is None:
                priority_start.remove(jid)
            elif job.chips <= free:
                priority_start.remove(jid)
                start(job, t)
        queue = sorted(pending.values(), key=lambda j: (-j.prio, j.submitted, j.jid))
        for job in queue:
            if job.chips <= free and used[job.team] + job.chips <= teams[job.team]:
                start(job, t)
        for job in queue:
            if job.running:
                continue
            if job.chips <= free and job.jid not in priority_start:
                start(job, t)

    while timers:
        t, _, kind, payload, version = heapq.heappop(timers)
        if kind == "submit":
            job = payload
            jobs[job.jid] = job
            everyone.append(job)
            job.in_quota_at_submit = used[job.team] + sum(
                p.chips for p in pending.values() if p.team == job.team) + job.chips <= teams[job.team]
            pending[job.jid] = job
            on_decisions(led.send("job.submitted", t, job_id=job.jid, team=job.team, chips=job.chips,
                                  priority=job.prio), t)
            schedule(t)
        elif kind == "ckpt":
            job = jobs.get(payload)
            if job is None or not job.running or job.version != version:
                continue
            job.done_safe += t - job.started
            job.started = t
            led.send("job.checkpointed", t, job_id=job.jid)
            if job.ckpt_every < job.work - job.done_safe:
                at(t + job.ckpt_every, "ckpt", job.jid, job.version)
        elif kind == "finish":
            job = jobs.get(payload)
            if job is None or not job.running or job.version != version:
                continue
            stop(job, t)
            del jobs[job.jid]
            on_decisions(led.send("job.finished", t, job_id=job.jid, outcome="succeeded"), t)
            schedule(t)
        elif kind == "act":
            d = payload
            if d.beneficiary.job_id not in pending:
                continue  # it started (or left) meanwhile: the decision is settled, nobody is preempted for it
            acted = False
            for v in d.victims:
                job = jobs.get(v.job_id)
                if job is not None and job.running:
                    stop(job, t)
                    pending[job.jid] = job
                    on_decisions(led.send("job.preempted", t, job_id=job.jid, decision_id=d.decision_id), t)
                    acted = True
            if acted and d.beneficiary.job_id in pending:
                priority_start.append(d.beneficiary.job_id)
            schedule(t)
    led.send("pool.tick", t + 60)
    honoured = [j for j in everyone if j.in_quota_at_submit]
    quick = sum(1 for j in honoured if j.first_start is not None and j.first_start - j.submitted <= 600)
    return {"lost_chip_h": led.lost_mchip_s / 3.6e6, "preemptions": led.preemptions,
            "in_quota_jobs": len(honoured), "honoured": quick / len(honoured) if honoured else 1.0,
            "events": led.seq}


def decision_time(chips: int, running: int, events: int, seed: int) -> dict:
    """Per-event fold time (ns) on a big, full pool with pending demand."""
    rng = random.Random(seed)
    cfg = FoldConfig(policy_rows=False)
    led = Ledger(cfg)
    t = T0
    led.send("pool.configured", t, flavor="a100", chips_per_node=8)
    for i in range(chips):
        led.send("chip.registered", t, chip_id=f"c{i}", node=f"n{i // 8}")
    teams = [f"team-{k}" for k in range(10)]
    for k, team in enumerate(teams):  # quotas: 10% each; the first half of the teams uses more than that
        led.send("quota.granted", t, grant_id=f"g{k}", team=team, chips=chips // 10)
    per_job = chips // running
    live: list[str] = []
    n = 0
    for i in range(running):
        team = teams[i % 10] if i % 3 else teams[rng.randrange(5)]
        jid = f"r{n}"
        n += 1
        led.send("job.submitted", t, job_id=jid, team=team, chips=per_job, priority=rng.randrange(3))
        led.send("job.started", t, job_id=jid)
        live.append(jid)
    t += 3600
    queue: list[str] = []
    times: list[int] = []
    with_decision: list[int] = []
    for _ in range(events):
        t += rng.randrange(1, 20)
        r = rng.random()
        if r < 0.35:
            jid = f"r{n}"
            n += 1
            fields = dict(job_id=jid, team=teams[rng.randrange(10)], chips=per_job * rng.choice((1, 1, 2, 4)),
                          priority=rng.randrange(3))
            etype = "job.submitted"
            queue.append(jid)
        elif r < 0.65 and live:
            jid = live.pop(rng.randrange(len(live)))
            etype, fields = "job.finished", dict(job_id=jid, outcome="succeeded")
        elif r < 0.9 and queue:
            jid = queue.pop(0)
            etype, fields = "job.started", dict(job_id=jid)
            live.append(jid)
        elif live:
            etype, fields = "job.checkpointed", dict(job_id=live[rng.randrange(len(live))])
        else:
            continue
        led.seq += 1
        e = parse_payload({"event_id": f"ev-{led.seq}", "type": etype, "occurred_at": iso(t), "pool": POOL,
                           "source": "bench", **fields})
        t0 = time.perf_counter_ns()
        step = led.fleet.apply(e)
        dt = time.perf_counter_ns() - t0
        times.append(dt)
        if step.decisions:
            with_decision.append(dt)
    times.sort()
    with_decision.sort()

    def pct(xs, p):
        return xs[min(len(xs) - 1, int(p * len(xs)))] / 1e6 if xs else float("nan")

    return {"events": len(times), "median_ms": statistics.median(times) / 1e6, "p99_ms": pct(times, 0.99),
            "decisions": len(with_decision),
            "decision_median_ms": statistics.median(with_decision) / 1e6 if with_decision else float("nan"),
            "decision_p99_ms": pct(with_decision, 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--days", type=float, default=7)
    ap.add_argument("--seeds", default="5,6,7,8,9,10,11,12,13,14,15,16",
                    help="closed-loop runs, one per seed; totals are summed")
    ap.add_argument("--seed", type=int, default=5, help="seed of the decision-time pool")
    ap.add_argument("--chips", type=int, default=10_000)
    ap.add_argument("--jobs", type=int, default=5_000)
    ap.add_argument("--events", type=int, default=20_000)
    args = ap.parse_args()

    seeds = [int(x) for x in args.seeds.split(",") if x]
    print(f"closed loop: 512 chips, 6 teams, {args.days:g} days, seeds {seeds}")
    total = {o: {"lost_chip_h": 0.0, "preemptions": 0, "in_quota_jobs": 0, "quick": 0.0} for o in ("goodput", "naive")}
    for seed in seeds:
        for order in ("goodput", "naive"):
            t0 = time.perf_counter()
            r = simulate(order, seed, args.days)
            tot = total[order]
            tot["lost_chip_h"] += r["lost_chip_h"]
            tot["preemptions"] += r["preemptions"]
            tot["in_quota_jobs"] += r["in_quota_jobs"]
            tot["quick"] += r["honoured"] * r["in_quota_jobs"]
            print(f"  seed {seed} {order:8s} lost {r['lost_chip_h']:9,.1f} chip-h in {r['preemptions']:5,} "
                  f"preemptions; quota honoured {r['honoured']:.1%} of {r['in_quota_jobs']:,} in-quota jobs "
                  f"({r['events']:,} events, {time.perf_counter() - t0:.1f} s)")
    g, n = total["goodput"], total["naive"]
    less = 1 - g["lost_chip_h"] / n["lost_chip_h"] if n["lost_chip_h"] else 0.0
    hg = g["quick"] / g["in_quota_jobs"] if g["in_quota_jobs"] else 1.0
    hn = n["quick"] / n["in_quota_jobs"] if n["in_quota_jobs"] else 1.0
    print(f"  all seeds: goodput {g['lost_chip_h']:,.1f} chip-h lost ({g['preemptions']:,} preemptions), naive "
          f"{n['lost_chip_h']:,.1f} ({n['preemptions']:,}): {less:.0%} less lost work (target >= 30%); quota "
          f"honoured {hg:.1%} vs {hn:.1%} (target: no worse)")
    print(f"decision time: {args.chips:,} chips, {args.jobs:,} running jobs, {args.events:,} events")
    d = decision_time(args.chips, args.jobs, args.events, args.seed)
    print(f"  per event: median {d['median_ms']:.3f} ms, p99 {d['p99_ms']:.3f} ms (target median < 1 ms)")
    print(f"  events that made a decision ({d['decisions']:,}): median {d['decision_median_ms']:.3f} ms, "
          f"p99 {d['decision_p99_ms']:.3f} ms")


if __name__ == "__main__":
    main()
