"""Benchmark of the policy layer: victim orders on a simulated cluster, and the cost of deciding.

    .venv/bin/python bench/policy.py [--seeds 1-60] [--days 5] [--restart-cost 300] [--coop 0.5,1]
                                     [--chips 10000] [--jobs 5000] [--events 20000]

1. Closed loop on an oversubscribed demo fleet (one pool of 512 chips on 8-chip nodes, six teams whose quotas
   add up to the capacity, demand about 1.4× the capacity, jobs of 1-64 chips running 4 h on average that
   checkpoint every 10 to 60 min), run by the simulated cluster of `chipledger.sim.simcluster` (shared with
   `chipledger backtest`; its assumptions are in docs/backtest.md): the ledger decides, the cluster preempts the
   named victims 10 s after a decision. The same demand (same seed) runs under every victim order of one run:
   the Kueue-classic order (`victim_order = "naive"`: borrowing teams, lowest priority, most recently started)
   and the goodput order with `fair_share_tolerance` 0, 0.05, 0.1, 0.2, 0.3 and inf (`restart_cost_s` at its
   default), plus 0.1 and inf with the restart cost weighed (`restart_cost_s` = --restart-cost); a paired
   comparison of the two on the lost work including the restart cost. Per seed: lost chip-hours,
   lost chip-hours with the restart cost (+ chips × --restart-cost per preemption), preemptions, quota
   honoured (of the jobs submitted while they fit their team's unused quota, the share started within
   10 minutes), fairness: the mean over reclaimed chips of (F of the victim's team − the lowest F among the
   borrowing teams then; 0 for the strictly fair choice), and Jain's index of usage/share (x = −log2 F) among
   the teams borrowing, sampled hourly. Reported: the mean over seeds with a 95% interval (± 1.96 s/√n), and
   per-seed paired differences against Kueue-classic. Target: at the default, ≥ 30% less lost work than
   Kueue-classic, quota honoured no worse, fairness within a stated bound of tolerance 0.
   Cooperative preemption, separately: the default order with the share --coop of victims checkpointing on
   notice (30 s after the decision) before they are preempted.
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

from chipledger.sim.simcluster import Cluster, SimJob, SimPool  # noqa: E402
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


def simulate(order: str, seed: int, days: float, tolerance: float = 0.1, restart_cost_s: int = 300,
             coop_share: float = 0.0, tick_s: int = 60) -> dict:
    """One closed-loop run of the shared simulated cluster; returns the figures of one seed and order."""
    capacity = 512
    teams = {"ads": 128, "search": 96, "vision": 96, "speech": 64, "research": 64, "infra": 64}
    cfg = FoldConfig(victim_order=order, policy_rows=False, fair_share_tolerance=tolerance,
                     restart_cost_s=restart_cost_s)
    jobs = [SimJob(f"j{i}", POOL, team, chips * 1000, prio, ts, work, ckpt_every=ck)
            for i, (ts, team, chips, prio, work, ck) in enumerate(workload(seed, days, capacity, teams))]
    cluster = Cluster([SimPool(POOL, capacity, 8, "a100")], {POOL: teams}, cfg, coop_share=coop_share,
                      tick_s=tick_s, source="bench")
    r = cluster.run(jobs, t0=T0 - 60)
    honoured = [j for j in jobs if j.in_quota_at_submit]
    quick = sum(1 for j in honoured if j.first_start is not None and j.first_start - j.submitted <= 600)
    return {"lost_chip_h": r.lost_mchip_s / 3.6e6, "preemptions": r.preemptions,
            "preempted_chips": r.preempted_milli / 1000, "in_quota_jobs": len(honoured),
            "honoured": quick / len(honoured) if honoured else 1.0,
            "f_excess": r.f_excess_sum / r.f_excess_chips if r.f_excess_chips else 0.0,
            "jain": r.jain_sum / r.jain_n if r.jain_n else 1.0, "events": r.events}


def mean_ci(xs: list) -> tuple[float, float]:
    """Mean and the half-width of its 95% interval (normal approximation, ± 1.96 s/√n)."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, float("nan")
    sd = statistics.stdev(xs)
    return m, 1.96 * sd / n ** 0.5


def decision_time(chips: int, running: int, events: int, seed: int, tolerance: float = 0.1) -> dict:
    """Per-event fold time (ns) on a big, full pool with pending demand."""
    rng = random.Random(seed)
    cfg = FoldConfig(policy_rows=False, fair_share_tolerance=tolerance)
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


def seeds_of(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            out += range(int(lo), int(hi) + 1)
        elif part:
            out.append(int(part))
    return out


DEFAULT_RC = FoldConfig().restart_cost_s
ORDERS = [  # (label, victim_order, fair_share_tolerance, restart_cost_s weighed: None = the default)
    ("kueue-classic", "naive", 0.0, 0),
    ("tolerance 0", "goodput", 0.0, None),
    ("tolerance 0.05", "goodput", 0.05, None),
    ("tolerance 0.1", "goodput", 0.1, None),
    ("tolerance 0.2", "goodput", 0.2, None),
    ("tolerance 0.3", "goodput", 0.3, None),
    ("tolerance inf", "goodput", float("inf"), None),
    ("tolerance 0.1, restart cost weighed", "goodput", 0.1, "restart"),
    ("tolerance inf, restart cost weighed", "goodput", float("inf"), "restart"),
]


def closed_loop(seeds: list, days: float, restart: int, coops: list, no_ticks: bool = True, out=print) -> dict:
    runs: dict = {}
    specs = [(o[0], o[1], o[2], DEFAULT_RC if o[3] is None else restart if o[3] == "restart" else o[3], 0.0, 60)
             for o in ORDERS]
    specs += [(f"tolerance 0.1, coop {c:g}", "goodput", 0.1, DEFAULT_RC, c, 60) for c in coops]
    if no_ticks:  # the cluster without the worker's ticks of a quiet pool (what #4's bench ran)
        specs += [("kueue-classic, no ticks", "naive", 0.0, 0, 0.0, 0),
                  ("tolerance 0.1, no ticks", "goodput", 0.1, DEFAULT_RC, 0.0, 0)]
    labels = [sp[0] for sp in specs]
    t_start = time.perf_counter()
    for seed in seeds:
        for label, order, tol, rc, coop, tick in specs:
            r = simulate(order, seed, days, tol, rc, coop, tick)
            r["lost_rc_chip_h"] = r["lost_chip_h"] + r["preempted_chips"] * restart / 3600
            runs.setdefault(label, []).append(r)
        k = runs["kueue-classic"][-1]
        d = runs["tolerance 0.1"][-1]
        out(f"  seed {seed}: kueue-classic lost {k['lost_chip_h']:8,.1f} chip-h ({k['preemptions']:4,} preemptions), "
            f"tolerance 0.1 {d['lost_chip_h']:8,.1f} ({d['preemptions']:4,}); {time.perf_counter() - t_start:6.1f} s")
    table = {}
    for label in labels:
        rs = runs[label]
        base = runs["kueue-classic, no ticks" if label.endswith("no ticks") else "kueue-classic"]
        strict = runs["tolerance 0"]
        row = {}
        for key in ("lost_chip_h", "lost_rc_chip_h", "preemptions", "honoured", "f_excess", "jain"):
            row[key] = mean_ci([r[key] for r in rs])
        row["less_lost"] = mean_ci([1 - r["lost_chip_h"] / b["lost_chip_h"] for r, b in zip(rs, base)
                                    if b["lost_chip_h"] > 0])
        row["less_lost_rc"] = mean_ci([1 - r["lost_rc_chip_h"] / b["lost_rc_chip_h"] for r, b in zip(rs, base)
                                       if b["lost_rc_chip_h"] > 0])
        row["less_lost_total"] = 1 - sum(r["lost_chip_h"] for r in rs) / sum(b["lost_chip_h"] for b in base)
        row["honoured_diff"] = mean_ci([r["honoured"] - b["honoured"] for r, b in zip(rs, base)])
        row["jain_vs_strict"] = mean_ci([r["jain"] - s_["jain"] for r, s_ in zip(rs, strict)])
        table[label] = row
    # paired: the restart cost weighed or not, on the lost work including the restart cost
    for tol in ("0.1", "inf"):
        a, b = runs[f"tolerance {tol}, restart cost weighed"], runs[f"tolerance {tol}"]
        m, ci = mean_ci([x["lost_rc_chip_h"] - y["lost_rc_chip_h"] for x, y in zip(a, b)])
        out(f"  tolerance {tol}: restart cost {restart} s weighed minus not weighed (default {DEFAULT_RC} s), lost "
            f"work incl. restart cost per seed: {m:+,.1f} ± {ci:,.1f} chip-h")
    return table


def print_table(table: dict, seeds: list, days: float, restart: int, out=print) -> None:
    n = len(seeds)
    out(f"\n{n} seeds ({seeds[0]}..{seeds[-1]}), {days:g} days each, 512 chips; mean ± 95% interval; "
        f"restart cost {restart} s per preempted chip")
    out("| order | lost chip-h | less lost than Kueue-classic (per seed; total) | lost incl. restart cost chip-h "
        "(less than Kueue-classic) | preemptions | quota honoured (diff. to Kueue-classic) | F excess of "
        "victims | Jain's index (diff. to tolerance 0) |")
    out("|---|---:|---:|---:|---:|---:|---:|---:|")

    def f(mc, fmt):
        return f"{format(mc[0], fmt)} ± {format(mc[1], fmt)}"

    for label, row in table.items():
        out(f"| {label} | {f(row['lost_chip_h'], ',.0f')} | {f(row['less_lost'], '.1%')}; "
            f"{row['less_lost_total']:.1%} | {f(row['lost_rc_chip_h'], ',.0f')} ({f(row['less_lost_rc'], '.1%')}) | "
            f"{f(row['preemptions'], ',.0f')} | {f(row['honoured'], '.1%')} ({f(row['honoured_diff'], '+.1%')}) | "
            f"{f(row['f_excess'], '.3f')} | {f(row['jain'], '.3f')} ({f(row['jain_vs_strict'], '+.3f')}) |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--days", type=float, default=5)
    ap.add_argument("--seeds", default="1-60", help="closed-loop runs, one per seed: 1-60 or 5,6,7 ('' for none)")
    ap.add_argument("--restart-cost", type=int, default=300,
                    help="seconds per preempted chip added to the lost work (and weighed: restart_cost_s)")
    ap.add_argument("--coop", default="0.5,1", help="shares of victims checkpointing on notice")
    ap.add_argument("--seed", type=int, default=5, help="seed of the decision-time pool")
    ap.add_argument("--chips", type=int, default=10_000)
    ap.add_argument("--jobs", type=int, default=5_000)
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--no-decision-time", action="store_true")
    ap.add_argument("--decision-tolerances", default="0.1", help="fair_share_tolerance values of the decision-time "
                    "runs, alternated (e.g. 0,0.1 for an A/B)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the decision-time runs")
    ap.add_argument("--no-tick-rows", action="store_true", help="leave out the two runs without pool ticks")
    args = ap.parse_args()

    seeds = seeds_of(args.seeds)
    coops = [float(x) for x in args.coop.split(",") if x]
    if seeds:
        print(f"closed loop: 512 chips, 6 teams, {args.days:g} days, seeds {seeds[0]}..{seeds[-1]} ({len(seeds)})")
        table = closed_loop(seeds, args.days, args.restart_cost, coops, not args.no_tick_rows)
        print_table(table, seeds, args.days, args.restart_cost)
    if args.no_decision_time:
        return
    print(f"decision time: {args.chips:,} chips, {args.jobs:,} running jobs, {args.events:,} events")
    for rnd in range(args.rounds):
        for tol in [float(x) for x in args.decision_tolerances.split(",") if x]:
            d = decision_time(args.chips, args.jobs, args.events, args.seed, tol)
            print(f"  round {rnd + 1}, fair_share_tolerance {tol:g}: per event median {d['median_ms']:.3f} ms, p99 "
                  f"{d['p99_ms']:.3f} ms (target median < 1 ms); events that made a decision ({d['decisions']:,}): "
                  f"median {d['decision_median_ms']:.3f} ms, p99 {d['decision_p99_ms']:.3f} ms")


if __name__ == "__main__":
    main()
