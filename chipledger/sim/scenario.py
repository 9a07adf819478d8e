"""Seeded, streaming generator of a realistic accelerator-fleet scenario, as wire-format event dicts.

This module owns synthetic input: a fleet of pools (one chip flavor each), the chips in them, quota grants,
burst requests and a job workload that a cluster scheduler places on the chips, all written as the event
dicts of DESIGN §3. It is stdlib only, so it can feed tests, benchmarks and demos without the project's
dependencies, and so that it stays an *independent* model of a cluster: nothing here imports the ledger.

How the simulation works (a discrete-event simulation over one heap of future events):

- Time is integer epoch seconds. Every handler runs at "now" and only schedules events at >= now, so the
  output is in non-decreasing ``occurred_at`` order. Memory holds the chips, the running and pending jobs
  and one or two future events per job or chip incident: it does not grow with the number of days.
- Jobs arrive per pool by a Poisson process whose rate follows an hour-of-week profile (busy weekday
  afternoons UTC, quiet nights and weekends) and a per-day demand multiplier; now and then a team submits a
  sweep of 20-50 jobs at once. Sizes are mostly powers of two (single-node jobs stay on one node, multi-node
  jobs take whole free nodes); on GPU pools some jobs are MIG-like fractions (0.5/0.25/0.125 of a chip,
  packed on shared chips), ~10% of all jobs. Durations are lognormal (minutes to days). Arrival rates are
  calibrated per pool so that the offered load is ~90% of capacity on average (realised utilisation is
  ~65-75% after fragmentation, cancellations and failures): queues form at weekday peaks, drain at night.
- The scheduler is a priority queue (higher priority first, then submission order) served best-effort
  (a job that does not fit is skipped, like Kueue's BestEffortFIFO). Teams with a ``borrowing_limit`` are
  not admitted beyond nominal + limit (their jobs wait, parked, until the team's usage drops). A job that
  fits its team's unused quota while other teams borrow makes the scheduler reclaim (preempt borrowers'
  preemptible jobs) after a short grace period; a priority >= 1000 job preempts lower-priority jobs of its
  own team.
- Chips fail (down 1-12 h, sometimes a whole node), degrade for hours, go through planned night-time
  maintenance a node at a time, and one or two are retired. Jobs on a chip that goes down fail or are
  preempted shortly after; jobs on a node entering maintenance are evicted.
- Users cancel some jobs, impatient users cancel jobs that wait too long, ~6% of jobs fail.
- With ``progress``, the training jobs (placed, checkpointing) report their cumulative steps: ``job.progress``
  at each start (the checkpoint's count: a restart continues from it) and every ``PROGRESS_IV_S``, and
  ``job.checkpointed`` with ``units``. A job steps at its own speed (±5% per report) and at half of it while
  it holds a degraded chip (a synchronous job goes at its slowest chip's pace), so the ledger's throughput SLO
  finds the slow chips. Its own random stream: the rest of the scenario is the same with or without it.

- With ``follow`` (a callable given each event as it is emitted, returning the ledger's decisions as dicts:
  what a cluster's actuator receives from ``chipledger.decisions``), the cluster acts on the ledger instead of
  deciding itself: it preempts the victims of each ``decision.preempt`` a little later, naming the decision
  (``job.preempted`` with ``decision_id``) and starts the beneficiary on the chips freed; it runs a burst's
  jobs only for the chips a ``decision.burst`` granted (none when denied), and admits them above the team's
  borrowing limit during the window. Its own reclaim and priority preemption are off. The module still
  imports nothing of the ledger: the caller folds (chipledger.demo does).

``scale`` multiplies the job arrival rates *and* the pool sizes together (chips, failure and maintenance
processes follow the chip count), so a scaled scenario has the same utilisation and job shapes, just more
of everything. Scaling arrivals without capacity would only grow the queues until impatient users cancel.

Public API: :func:`generate`, :func:`write_jsonl`, :func:`iter_jsonl`, :func:`corrupt`, :data:`BAD_KINDS`.
``python -m chipledger.sim.scenario --help`` writes a scenario to JSONL and reports the generation speed.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
from bisect import bisect_right
from collections import deque
from datetime import datetime, timedelta, timezone
from typing import Iterable, Iterator

_heappush = heapq.heappush
_NO_FIELDS: dict = {}

UTC = timezone.utc
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

__all__ = ["generate", "write_jsonl", "iter_jsonl", "corrupt", "BAD_KINDS", "UTC"]

# chip states (internal); a chip is usable for placement while state < DOWN
HEALTHY, DEGRADED, DOWN, MAINT, RETIRED = range(5)
_STATE_NAMES = ("healthy", "degraded", "down", "maintenance")
# job states (internal)
PENDING, RUNNING, DONE = range(3)

_FRACTION_UNIT = 125  # fractional jobs are multiples of 1/8 chip, so a shared chip's free milli is too
PROGRESS_IV_S = 900    # a training job reports its steps this often (with ``progress``)
DEGRADED_SPEED = 0.5   # the share of its speed a job keeps while it holds a degraded chip

# (zone, cluster, flavor, chip-id prefix, chips per node, nodes at scale 1, fractional jobs allowed)
_POOL_TEMPLATES = (
    ("us-east1-a", "cluster-a", "h100-80gb", "h100", "g", 8, 20, True),
    ("us-central1-c", "cluster-b", "a100-40gb", "a100", "g", 8, 24, True),
    ("us-west4-a", "cluster-c", "tpu-v5e", "v5e", "c", 4, 24, False),
    ("europe-west4-b", "cluster-d", "h200-141gb", "h200", "g", 8, 8, True),
    ("us-east5-a", "cluster-e", "tpu-v6e", "v6e", "c", 4, 24, False),
    ("asia-northeast1-a", "cluster-f", "l4-24gb", "l4", "g", 4, 12, True),
    ("us-south1-a", "cluster-g", "mi300x-192gb", "mi300x", "g", 8, 6, True),
    ("europe-west1-b", "cluster-h", "a100-80gb", "a100x", "g", 8, 28, True),
)

_TEAMS = (
    ("llm-pretrain", "train"), ("vision", "research"), ("speech", "research"), ("recsys", "train"),
    ("search-ranking", "infer"), ("safety-evals", "infer"), ("robotics", "research"), ("ads-ml", "train"),
    ("applied-research", "research"), ("serving-canary", "infer"), ("genomics", "research"),
    ("translate", "train"), ("fraud", "infer"), ("music", "research"), ("maps", "infer"), ("weather", "train"),
)

# job shape by team profile: weight multiplier for jobs of >= 8 chips and < 8 chips, share of fractional
# jobs (GPU pools only), duration multiplier, and the priority mix as (priority, cumulative probability)
_PROFILES = {
    "train": (3.0, 0.35, 0.03, 2.0, ((0, 0.15), (100, 0.90), (1000, 1.0))),
    "research": (1.0, 1.0, 0.15, 1.0, ((0, 0.40), (100, 0.95), (1000, 1.0))),
    "infer": (0.3, 1.5, 0.40, 0.6, ((0, 0.20), (100, 0.70), (1000, 1.0))),
}
_SIZE_WEIGHTS = {1: 30, 2: 14, 4: 14, 8: 20, 16: 9, 32: 6, 64: 4, 128: 2, 256: 1}
_FRACTIONS = ((500, 0.50), (250, 0.85), (125, 1.0))  # (milli, cumulative probability)

# arrivals by hour of day (UTC) on weekdays; weekends at 40%
_HOUR_W = (0.35, 0.3, 0.3, 0.3, 0.35, 0.45, 0.6, 0.8, 1.0, 1.15, 1.25, 1.3,
           1.3, 1.4, 1.5, 1.5, 1.4, 1.2, 1.0, 0.85, 0.7, 0.6, 0.5, 0.4)
_HOW_W = tuple(w * (1.0 if d < 5 else 0.4) for d in range(7) for w in _HOUR_W)  # index: Monday 00h = 0
_HOW_MEAN = sum(_HOW_W) / len(_HOW_W)
_DAY_MULT_MAX = 1.5

_TARGET_UTIL = 0.92
_SWEEPS_PER_POOL_DAY = 0.5
_FAIL_PER_CHIP_S = 1.0 / (60 * 86400)  # a chip goes down about every 60 days
_DEGRADE_PER_CHIP_S = 1.0 / (90 * 86400)
_MAINT_PER_NODE_S = 1.0 / (45 * 86400)  # each node gets planned maintenance about every 45 days

_DOWN_REASONS_GPU = ("xid 79: GPU has fallen off the bus", "uncorrectable ECC error", "NVLink error",
                     "HBM row remap failure", "PCIe link down")
_DOWN_REASONS_TPU = ("ICI link down", "HBM uncorrectable error", "TPU runtime hang", "host kernel panic")
_DEGRADED_REASONS = ("correctable ECC errors above threshold", "thermal throttling",
                     "interconnect bandwidth degraded", "fan speed alarm")
_MAINT_REASONS = ("planned: driver upgrade", "planned: firmware update", "planned: kernel security patch",
                  "planned: cooling service")
_BURST_REASONS = ("paper deadline", "launch load test", "quarterly model refresh", "incident backfill",
                  "customer eval crunch")


class _Clock:
    """Epoch seconds to RFC 3339 text ("2026-11-02T08:00:00Z"), cheaply: the text up to the minute is
    cached (one strftime per day), the seconds come from a table."""

    __slots__ = ("_days", "_hm", "_ss", "_min", "_min_s")

    def __init__(self) -> None:
        self._days: dict[int, str] = {}
        self._hm = [f"{h:02d}:{m:02d}:" for h in range(24) for m in range(60)]
        self._ss = [f"{s:02d}Z" for s in range(60)]
        self._min = -1
        self._min_s = ""

    def __call__(self, t: int) -> str:
        mi, sec = divmod(t, 60)
        if mi != self._min:
            d, r = divmod(mi, 1440)
            pre = self._days.get(d)
            if pre is None:
                pre = self._days[d] = (_EPOCH + timedelta(days=d)).strftime("%Y-%m-%dT")
            self._min = mi
            self._min_s = pre + self._hm[r]
        return self._min_s + self._ss[sec]


def _wire_chips(milli: int):
    return milli // 1000 if milli % 1000 == 0 else milli / 1000


class _Job:
    __slots__ = ("id", "pool", "team", "milli", "prio", "preemptible", "work", "done", "run_start",
                 "run_done0", "run_end", "ckpt_t", "ckpt_iv", "fail_at", "outcome", "state", "token",
                 "chips", "seq", "queued", "parked", "n_preempt", "placement", "reclaim_t",
                 "prog", "spd", "units", "units_t", "units_ckpt", "slow")


class _Pool:
    __slots__ = (
        "idx", "name", "flavor", "sched_src", "health_src", "inv_src", "cpn", "gpu", "n_nodes",
        "n_chips", "chip_ids", "node_names", "state", "free", "jobs_on", "tokens",
        "node_free", "buckets", "partial", "free_whole", "queue", "pend_cls", "parked", "running", "use",
        "nominal",
        "blim", "grants", "reclaim_pending", "team_cum", "team_idx", "shape", "lam_mean", "day_idx", "day_mult",
        "fail_rate", "degrade_rate", "maint_rate", "sweep_rate", "max_whole", "burst",
    )


def _shift_node(p, n: int, d: int) -> None:
    """d chips of node n became wholly free (d > 0) or stopped being so (d < 0): move the node between
    free-count buckets."""
    nf = p.node_free[n]
    del p.buckets[nf][n]
    p.buckets[nf + d][n] = None
    p.node_free[n] = nf + d
    p.free_whole += d


def _shift_whole(p, c: int, d: int) -> None:
    """Chip c became wholly free (d=+1) or stopped being so (d=-1)."""
    _shift_node(p, c // p.cpn, d)


class _Sim:
    def __init__(self, seed: int, days: float, start: datetime, pools: int, teams: int, scale: float,
                 follow=None, load: float = None, failure_scale: float = 1.0, progress: bool = False):
        if pools < 1 or teams < 1:
            raise ValueError("need at least one pool and one team")
        if days <= 0 or scale <= 0:
            raise ValueError("days and scale must be positive")
        if start.tzinfo is None:
            start = start.replace(tzinfo=UTC)
        if failure_scale <= 0 or (load is not None and not 0 < load <= 1.5):
            raise ValueError("failure_scale must be > 0 and load in (0, 1.5]")
        self.seed = seed
        self.rng = random.Random(seed)
        self.follow = follow
        self.progress = progress
        self.prng = random.Random(seed * 7919 + 17)  # progress only: the rest of the scenario is unchanged by it
        self.load = _TARGET_UTIL if load is None else load
        self.failure_scale = failure_scale
        self.jobs_by_id: dict[str, _Job] = {}  # live jobs, when following the ledger's decisions
        self.bursts: dict[str, tuple] = {}     # request id -> (pool, team, window start, window end)
        self.t0 = int(start.timestamp())
        self.end = self.t0 + max(1, int(days * 86400))
        self.days = days
        self.scale = scale
        self.ts = _Clock()
        self.heap: list = []
        self._next_seq = itertools.count().__next__
        self.out: list[dict] = []
        self.n_ev = 0
        self.n_job = 0
        self.n_grant = 0
        self.n_burst = 0
        self.temp_grants: set[str] = set()
        self.job_seq = itertools.count()
        self.now = self.t0
        self.now_s = self.ts(self.t0)
        self.team_names = [
            _TEAMS[i % len(_TEAMS)][0] + ("" if i < len(_TEAMS) else f"-{i // len(_TEAMS) + 1}")
            for i in range(teams)]
        self.team_prof = [_PROFILES[_TEAMS[i % len(_TEAMS)][1]] for i in range(teams)]
        self.n_teams = teams
        self.pools = [self._make_pool(i) for i in range(pools)]
        span = self.end - self.t0
        self.retire_times = sorted(self.t0 + int(span * self.rng.uniform(0.15, 0.85))
                                   for _ in range(self.rng.choice((1, 1, 2))))

    # ------------------------------------------------------------------ setup

    def _make_pool(self, i: int) -> _Pool:
        rng = self.rng
        tpl = _POOL_TEMPLATES[i % len(_POOL_TEMPLATES)]
        zone, cluster, flavor, prefix, chip_letter, cpn, base_nodes, gpu = tpl
        k = i // len(_POOL_TEMPLATES)
        if k:
            zone, cluster = f"{zone}{k + 1}", f"{cluster}{k + 1}"
        p = _Pool()
        p.idx = i
        p.name = f"{zone}/{flavor}"
        p.flavor = flavor
        p.sched_src = f"{cluster}/kueue"
        p.health_src = f"{cluster}/node-health"
        p.inv_src = f"{cluster}/inventory"
        p.cpn = cpn
        p.gpu = gpu
        nodes1 = min(256 // cpn, max(32 // cpn, round(base_nodes * rng.uniform(0.75, 1.25))))
        p.n_nodes = max(2, round(nodes1 * self.scale))
        p.n_chips = p.n_nodes * cpn
        p.node_names = [f"{prefix}-n{n:03d}" for n in range(p.n_nodes)]
        p.chip_ids = [f"{p.node_names[c // cpn]}-{chip_letter}{c % cpn}" for c in range(p.n_chips)]
        p.state = [HEALTHY] * p.n_chips
        p.free = [1000] * p.n_chips
        p.jobs_on = [[] for _ in range(p.n_chips)]
        p.tokens = [0] * p.n_chips
        p.node_free = [cpn] * p.n_nodes
        p.buckets = [{} for _ in range(cpn + 1)]
        p.buckets[cpn] = dict.fromkeys(range(p.n_nodes))
        p.partial = [{} for _ in range(1000 // _FRACTION_UNIT)]
        p.free_whole = p.n_chips
        p.queue = {}  # job size (milli) -> heap of (-priority, seq, token, job)
        p.pend_cls = {}  # job size -> number of live entries in its queue
        p.parked = [{} for _ in range(self.n_teams)]  # team -> job size -> entries over the borrowing limit
        p.running = [{} for _ in range(self.n_teams)]
        p.use = [0] * self.n_teams
        p.nominal = [0] * self.n_teams
        p.blim = [None] * self.n_teams
        p.grants = {}
        p.reclaim_pending = False
        p.day_idx = -1
        p.day_mult = 1.0
        # job sizes are those of the scale-1 pool: scaling adds more jobs, not bigger ones
        max_whole = 1
        while max_whole * 2 <= min(nodes1 * cpn / 4, p.n_chips / 2):
            max_whole *= 2
        p.max_whole = max_whole
        p.fail_rate = p.n_chips * _FAIL_PER_CHIP_S * self.failure_scale
        p.degrade_rate = p.n_chips * _DEGRADE_PER_CHIP_S * self.failure_scale
        p.maint_rate = p.n_nodes * _MAINT_PER_NODE_S * self.failure_scale
        p.burst = [0] * self.n_teams  # team -> milli-chips of approved bursts whose window is open (follow mode)
        p.sweep_rate = _SWEEPS_PER_POOL_DAY * self.scale / 86400
        return p

    def _assign_quota(self) -> None:
        """Each team gets quota in 1-3 pools; per pool the quotas add up to 80-110% of capacity."""
        rng = self.rng
        n_pools = len(self.pools)
        members: list[list[int]] = [[] for _ in range(n_pools)]
        for tm in range(self.n_teams):
            k = min(n_pools, rng.choice((1, 1, 2, 2, 3)))
            for pi in sorted(rng.sample(range(n_pools), k)):
                members[pi].append(tm)
        for pi in range(n_pools):
            if not members[pi]:
                members[pi].append(rng.randrange(self.n_teams))
        for p, teams in zip(self.pools, members):
            weights = [rng.lognormvariate(0, 0.6) * (1.6 if self.team_prof[tm][0] > 1 else 1.0) for tm in teams]
            factor = rng.uniform(0.8, 1.1)
            total_w = sum(weights)
            for tm, w in zip(teams, weights):
                chips = max(1, round(p.n_chips * factor * w / total_w))
                blim = None
                llim = None
                if rng.random() < 0.3:
                    blim = max(0, round(chips * rng.uniform(0.25, 1.0)))
                if rng.random() < 0.2:
                    llim = max(0, round(chips * rng.uniform(0.2, 0.6)))
                self._grant(p, tm, chips, blim, llim, self.t0, None)
            # arrival mix: teams with quota by size and activity, a couple of quota-less borrowers
            tw = [(tm, p.nominal[tm] * rng.lognormvariate(0, 0.35)) for tm in teams]
            others = [tm for tm in range(self.n_teams) if tm not in teams]
            total = sum(w for _, w in tw)
            for tm in rng.sample(others, min(2, len(others))):
                tw.append((tm, total * 0.03))
            cum, acc = [], 0.0
            for _, w in tw:
                acc += w
                cum.append(acc)
            p.team_cum = cum
            p.team_idx = [tm for tm, _ in tw]
            p.shape = {tm: self._shape_table(p, tm) for tm in p.team_idx}

    def _shape_table(self, p: _Pool, tm: int):
        big, small, frac, dmult, prios = self.team_prof[tm]
        sizes, cum, acc = [], [], 0.0
        for k, w in _SIZE_WEIGHTS.items():
            if k > p.max_whole:
                break
            if k > p.cpn and k % p.cpn:
                continue
            acc += w * (big if k >= 8 else small)
            sizes.append(k * 1000)
            cum.append(acc)
        return (sizes, cum, frac if p.gpu else 0.0, dmult, prios)

    def _calibrate(self, p: _Pool) -> None:
        """Arrival rate so the offered load averages ~_TARGET_UTIL of capacity (sweeps included)."""
        r = random.Random(self.seed * 1_000_003 + p.idx)
        n = 2000
        total = 0.0
        for _ in range(n):
            tm = p.team_idx[bisect_right(p.team_cum, r.random() * p.team_cum[-1])]
            milli, _, work = self._sample_shape(r, p, tm)
            total += milli * work
        per_job = total / n / 1000  # chip-seconds
        sw = 0.0
        for _ in range(500):
            milli, work = self._sample_sweep_shape(r, p)
            sw += milli * work
        sweep_load = p.sweep_rate * 35 * (sw / 500 / 1000)  # chips busy on average
        base = max(0.3 * p.n_chips, self.load * p.n_chips - sweep_load)
        p.lam_mean = base / per_job

    def _sample_shape(self, r: random.Random, p: _Pool, tm: int):
        sizes, cum, frac, dmult, prios = p.shape[tm]
        if frac and r.random() < frac:
            u = r.random()
            for milli, c in _FRACTIONS:
                if u < c:
                    break
            work = 2400 * math.exp(1.0 * r.gauss(0.0, 1.0))
        else:
            milli = sizes[bisect_right(cum, r.random() * cum[-1])]
            k = milli // 1000
            work = 700 * (1 + 0.7 * math.log2(k)) * dmult * math.exp(1.4 * r.gauss(0.0, 1.0))
        u = r.random()
        for prio, c in prios:
            if u < c:
                break
        work = int(min(4 * 86400, max(120, work)))
        return milli, prio, work

    def _sample_sweep_shape(self, r: random.Random, p: _Pool):
        opts = (500, 1000, 1000, 2000, 4000) if p.gpu else (1000, 1000, 2000, 4000)
        milli = opts[r.randrange(len(opts))]
        if milli > p.max_whole * 1000:
            milli = 1000
        work = int(min(86400, max(120, 1500 * math.exp(0.7 * r.gauss(0.0, 1.0)))))
        return milli, work

    # ------------------------------------------------------------------ plumbing

    def _at(self, t: int, fn, a=None, b=None) -> None:
        if t < self.end:
            _heappush(self.heap, (t, self._next_seq(), fn, a, b))

    def _emit(self, typ: str, p: _Pool, source: str, fields: dict = _NO_FIELDS) -> None:
        self.n_ev += 1
        ev = {"event_id": f"ev-{self.n_ev:08d}", "type": typ, "occurred_at": self.now_s,
              "pool": p.name, "source": source, **fields}
        self.out.append(ev)
        if self.follow is not None:
            for d in self.follow(ev):
                self._on_decision(p, d)

    # ------------------------------------------------------------------ acting on the ledger's decisions

    def _on_decision(self, p: _Pool, d: dict) -> None:
        """A decision the ledger made on an event just emitted: the actuator acts on it shortly after."""
        if d.get("type") == "decision.preempt":
            self._at(self.now + self.rng.randrange(10, 61), self._act_preempt, p, d)
        elif d.get("type") == "decision.burst":
            b = self.bursts.get(d.get("request_id"))
            if b is None:
                return
            _, tm, ws, we = b
            granted = int(round(float(d.get("chips_granted") or 0) * 1000))
            if d.get("verdict") in ("approved", "partial") and granted >= 1000:
                self._at(ws, self._burst_window, p, (tm, granted, True))
                self._at(we, self._burst_window, p, (tm, granted, False))
                self._at(ws, self._burst_jobs, p, (tm, granted // 1000, we - ws))

    def _burst_window(self, p: _Pool, arg) -> None:
        tm, milli, opening = arg
        p.burst[tm] += milli if opening else -milli
        if opening and p.parked[tm]:
            self._unpark(p, tm)
            self._schedule(p)

    def _act_preempt(self, p: _Pool, d: dict) -> None:
        """Preempt the decision's victims still running, naming it, then start its beneficiary if it waits
        and fits on what was freed (the chips the ledger promised it)."""
        did = d.get("decision_id")
        freed = False
        for v in d.get("victims") or ():
            j = self.jobs_by_id.get(v.get("job_id"))
            if j is not None and j.state == RUNNING and j.pool is p:
                if j.ckpt_iv:  # cooperative: a job that checkpoints saves its work when told (checkpoint_by)
                    self._emit("job.checkpointed", p, p.sched_src, self._ckpt_fields(j))
                    j.done = j.run_done0 + (self.now - j.run_start)
                    j.ckpt_t = self.now
                self._preempt(j, did)
                freed = True
        ben = self.jobs_by_id.get((d.get("beneficiary") or {}).get("job_id"))
        if freed and ben is not None and ben.state == PENDING and ben.queued and ben.pool is p:
            chips = self._place(p, ben.milli)
            if chips is not None:
                self._dequeue(p, ben)
                self._start(p, ben, chips)
        self._schedule(p)

    def run(self) -> Iterator[dict]:
        self._setup()
        yield from self.out
        self.out.clear()
        heap = self.heap
        pop = heapq.heappop
        end = self.end
        out = self.out
        ts = self.ts
        while heap:
            t, _, fn, a, b = pop(heap)
            if t >= end:
                break
            if t != self.now:
                self.now = t
                self.now_s = ts(t)
            fn(a, b)
            if len(out) >= 512:  # hand events over in small batches: cheaper than one yield-from each
                yield from out
                out.clear()
        yield from out
        out.clear()
        self.now = end
        self.now_s = ts(end)
        for p in self.pools:
            self._emit("pool.tick", p, "chipledger/importer")
        yield from out
        out.clear()

    def _setup(self) -> None:
        for p in self.pools:
            self._emit("pool.configured", p, p.inv_src, {"flavor": p.flavor, "chips_per_node": p.cpn})
            names = p.node_names
            cpn = p.cpn
            for c, cid in enumerate(p.chip_ids):
                self._emit("chip.registered", p, p.inv_src, {"chip_id": cid, "node": names[c // cpn]})
        self._assign_quota()
        rng = self.rng
        span = self.end - self.t0
        for p in self.pools:
            self._calibrate(p)
            self._at(self.t0, self._arrive, p, (float(self.t0), False))
            self._at(self.t0 + int(rng.expovariate(p.sweep_rate)), self._sweep, p)
            self._at(self.t0 + int(rng.expovariate(p.fail_rate)), self._fail_proc, p)
            self._at(self.t0 + int(rng.expovariate(p.degrade_rate)), self._degrade_proc, p)
            self._at(self.t0 + int(rng.expovariate(p.maint_rate)), self._maint_plan, p)
        # quota changes: a temporary grant early on, one team's quota changed halfway through
        # (admins work office hours: in a multi-day scenario both happen on the day's 10:00/14:00 UTC)
        half = self.t0 + span // 2
        if span >= 2 * 86400:
            self._at((self.t0 + int(span * 0.3)) // 86400 * 86400 + 14 * 3600, self._temp_grant)
            half = half // 86400 * 86400 + 10 * 3600
        self._at(half, self._change_quota)
        # a few burst requests: the first within the first week, then about one per pool every 8 days
        self.burst_rate = len(self.pools) / ((3 if self.follow is not None else 8) * 86400)
        self._at(self.t0 + int(min(span, 7 * 86400) * rng.uniform(0.1, 0.5)), self._burst)

    # ------------------------------------------------------------------ quota and bursts

    def _grant(self, p: _Pool, tm: int, chips: int, blim, llim, eff_from: int, eff_until) -> str:
        self.n_grant += 1
        gid = f"grant-{self.n_grant:04d}-{self.team_names[tm]}"
        f = {"grant_id": gid, "team": self.team_names[tm], "chips": chips}
        if blim is not None:
            f["borrowing_limit"] = blim
        if llim is not None:
            f["lending_limit"] = llim
        f["effective_from"] = self.ts(eff_from)
        if eff_until is not None:
            f["effective_until"] = self.ts(eff_until)
        self._emit("quota.granted", p, "fleet-admin/quota-api", f)
        if eff_from <= self.now:
            self._grant_on(p, (gid, tm, chips * 1000, blim))
        else:
            self._at(eff_from, self._grant_on, p, (gid, tm, chips * 1000, blim))
        if eff_until is not None:
            self._at(eff_until, self._grant_off, p, gid)
        return gid

    def _grant_on(self, p: _Pool, g) -> None:
        gid, tm, milli, blim = g
        p.grants[gid] = g
        p.nominal[tm] += milli
        if blim is not None:
            p.blim[tm] = blim * 1000 if p.blim[tm] is None else p.blim[tm] + blim * 1000
        self._unpark(p, tm)
        self._schedule(p)

    def _grant_off(self, p: _Pool, gid: str) -> None:
        g = p.grants.pop(gid, None)
        if g is None:
            return
        _, tm, milli, blim = g
        p.nominal[tm] -= milli
        if blim is not None and p.blim[tm] is not None:
            p.blim[tm] -= blim * 1000
        self._unpark(p, tm)
        self._schedule(p)

    def _temp_grant(self, _a, _b) -> None:
        rng = self.rng
        p = self.pools[rng.randrange(len(self.pools))]
        tm = p.team_idx[rng.randrange(len(p.team_idx))]
        start = self.now + 6 * 3600
        gid = self._grant(p, tm, max(1, round(p.n_chips * 0.1)), None, None, start, start + 3 * 86400)
        self.temp_grants.add(gid)

    def _change_quota(self, _a, _b) -> None:
        rng = self.rng
        old = [(p, g) for p in self.pools for g in p.grants.values() if g[0] not in self.temp_grants]
        if not old:
            return
        p, (gid, tm, milli, blim) = old[rng.randrange(len(old))]
        chips = max(1, round(milli / 1000 * rng.choice((0.6, 0.75, 1.25, 1.5))))
        delay = min(86400, (self.end - self.now) // 2)
        eff = self.now + max(60, delay)
        self._grant(p, tm, chips, blim, None, eff, None)
        self._at(eff, self._revoke, p, gid)

    def _revoke(self, p: _Pool, gid: str) -> None:
        self._emit("quota.revoked", p, "fleet-admin/quota-api", {"grant_id": gid})
        self._grant_off(p, gid)

    def _burst(self, _a, _b) -> None:
        """The burst process: someone decides to ask; the request goes in during weekday office hours."""
        rng = self.rng
        t = self.now
        self._at(t + 3600 + int(rng.expovariate(self.burst_rate)), self._burst)
        day, sec = divmod(t, 86400)
        if (day + 3) % 7 < 5 and 9 * 3600 <= sec < 18 * 3600:
            self._burst_request(None, None)
            return
        if sec >= 9 * 3600:
            day += 1
        while (day + 3) % 7 >= 5:
            day += 1
        self._at(day * 86400 + 9 * 3600 + rng.randrange(8 * 3600), self._burst_request)

    def _burst_request(self, _a, _b) -> None:
        rng = self.rng
        p = self.pools[rng.randrange(len(self.pools))]
        tm = p.team_idx[rng.randrange(len(p.team_idx))]
        chips = p.cpn
        while chips * 2 <= max(p.cpn, p.n_chips // 4) and rng.random() < 0.6:
            chips *= 2
        ws = (self.now + rng.randrange(2 * 3600, 36 * 3600)) // 3600 * 3600 + 3600
        we = ws + rng.randrange(4, 49) * 3600
        if self.follow is not None:
            # a team that asks the ledger plans: it holds quota in the pool, and often asks for the small hours
            # UTC, when chips are idle (approved), or the morning (cut to what the forecast leaves), else any time
            with_quota = [t for t in p.team_idx if p.nominal[t] > 0]
            tm = with_quota[rng.randrange(len(with_quota))] if with_quota else tm
            u = rng.random()
            if u < 0.75:
                day = self.now // 86400 + 1
                start_h = rng.randrange(1, 4) if u < 0.45 else rng.randrange(8, 11)
                ws = day * 86400 + start_h * 3600
                we = ws + rng.randrange(3, 6) * 3600
        self.n_burst += 1
        req = f"burst-{self.n_burst:03d}-{self.team_names[tm]}"
        if self.follow is not None:  # the jobs come if and as far as the ledger grants it (_on_decision)
            self.bursts[req] = (p, tm, ws, we)
        self._emit("burst.requested", p, "team-portal/bursts",
                   {"request_id": req, "team": self.team_names[tm], "chips": chips,
                    "window_start": self.ts(ws), "window_end": self.ts(we),
                    "reason": _BURST_REASONS[rng.randrange(len(_BURST_REASONS))]})
        if self.follow is None:
            self._at(ws, self._burst_jobs, p, (tm, chips, we - ws))

    def _burst_jobs(self, p: _Pool, arg) -> None:
        tm, chips, window = arg
        rng = self.rng
        size = p.cpn
        n = chips // size
        while n > 16:
            size *= 2
            n = chips // size
        for _ in range(n):
            work = int(window * rng.uniform(0.3, 0.9))
            self._submit(p, tm, size * 1000, 100, True, work, rng.randrange(1, 30))

    # ------------------------------------------------------------------ arrivals

    def _arrive(self, p: _Pool, arg) -> None:
        """Poisson arrivals whose rate is constant within an hour: the next gap is drawn with the rate of
        the current hour, and redrawn at the hour boundary if it would cross it (exact, by memorylessness)."""
        tf, real = arg
        rng = self.rng
        if real:
            tm = p.team_idx[bisect_right(p.team_cum, rng.random() * p.team_cum[-1])]
            milli, prio, work = self._sample_shape(rng, p, tm)
            preemptible = rng.random() < (0.2 if prio >= 1000 else 0.95)
            self._submit(p, tm, milli, prio, preemptible, work, rng.randrange(1, 45))
        t = int(tf)
        day = t // 86400
        if day != p.day_idx:
            p.day_idx = day
            p.day_mult = min(_DAY_MULT_MAX, max(0.6, rng.lognormvariate(0.0, 0.2)))
        rate = p.lam_mean * _HOW_W[(t // 3600 + 72) % 168] * p.day_mult / _HOW_MEAN
        boundary = (t // 3600 + 1) * 3600
        nt = tf + rng.expovariate(rate)
        if nt < boundary:
            self._at(int(nt), self._arrive, p, (nt, True))
        else:
            self._at(boundary, self._arrive, p, (float(boundary), False))

    def _sweep(self, p: _Pool, _b) -> None:
        rng = self.rng
        self._at(self.now + max(1, int(rng.expovariate(p.sweep_rate))), self._sweep, p)
        tm = p.team_idx[bisect_right(p.team_cum, rng.random() * p.team_cum[-1])]
        milli, _ = self._sample_sweep_shape(rng, p)
        for i in range(rng.randint(20, 50)):
            work = int(min(86400, max(120, 1500 * math.exp(0.7 * rng.gauss(0.0, 1.0)))))
            self._submit(p, tm, milli, 0, True, work, 1 + i // 4 + rng.randrange(20))

    def _submit(self, p: _Pool, tm: int, milli: int, prio: int, preemptible: bool, work: int,
                admit_delay: int) -> None:
        rng = self.rng
        self.n_job += 1
        j = _Job()
        j.id = f"job-{self.n_job:07d}"
        j.pool = p
        j.team = tm
        j.milli = milli
        j.prio = prio
        j.preemptible = preemptible
        j.work = work
        j.done = 0
        j.state = PENDING
        j.token = 0
        j.chips = None
        j.seq = next(self.job_seq)
        j.queued = False
        j.parked = False
        j.n_preempt = 0
        j.placement = rng.random() >= 0.03
        j.reclaim_t = 0
        j.ckpt_iv = rng.randrange(1800, 7201) if milli >= 1000 and work >= 3600 and rng.random() < 0.85 else 0
        j.prog = self.progress and j.placement and j.ckpt_iv > 0
        if j.prog:
            j.spd = self.prng.uniform(0.5, 4.0)  # steps per second of the whole job
            j.units = 0.0
            j.units_t = 0
            j.units_ckpt = 0
            j.slow = False
        u = rng.random()
        j.fail_at = None
        if u < 0.065:
            j.fail_at = max(1, int(work * rng.uniform(0.02, 0.95)))
        elif u < 0.095:
            self._at(self.now + 60 + int(2400 * math.exp(1.2 * rng.gauss(0.0, 1.0))), self._user_cancel, j)
        f = {"job_id": j.id, "team": self.team_names[tm], "chips": _wire_chips(milli), "priority": prio,
             "preemptible": preemptible}
        if milli >= p.cpn * 1000:
            f["chips_per_node"] = p.cpn
        if self.follow is not None:
            self.jobs_by_id[j.id] = j
        self._emit("job.submitted", p, p.sched_src, f)
        self._at(self.now + admit_delay, self._admit, j, 0)

    # ------------------------------------------------------------------ placement structures

    def _take(self, p: _Pool, c: int, m: int) -> None:
        f = p.free[c]
        if f == 1000:
            _shift_whole(p, c, -1)
        else:
            del p.partial[f // _FRACTION_UNIT][c]
        f -= m
        p.free[c] = f
        if f:
            p.partial[f // _FRACTION_UNIT][c] = None

    def _give(self, p: _Pool, c: int, m: int) -> None:
        f = p.free[c]
        g = f + m
        p.free[c] = g
        if p.state[c] < DOWN:
            if f:
                del p.partial[f // _FRACTION_UNIT][c]
            if g == 1000:
                _shift_whole(p, c, +1)
            else:
                p.partial[g // _FRACTION_UNIT][c] = None

    def _unusable(self, p: _Pool, c: int) -> None:
        f = p.free[c]
        if f == 1000:
            _shift_whole(p, c, -1)
        elif f:
            del p.partial[f // _FRACTION_UNIT][c]

    def _usable(self, p: _Pool, c: int) -> None:
        f = p.free[c]
        if f == 1000:
            _shift_whole(p, c, +1)
        elif f:
            p.partial[f // _FRACTION_UNIT][c] = None

    def _fits(self, p: _Pool, m: int) -> bool:
        if m < 1000:
            if p.free_whole:
                return True
            part = p.partial
            for i in range(m // _FRACTION_UNIT, len(part)):
                if part[i]:
                    return True
            return False
        k = m // 1000
        cpn = p.cpn
        if k < cpn:
            b = p.buckets
            for nf in range(k, cpn + 1):
                if b[nf]:
                    return True
            return False
        return len(p.buckets[cpn]) >= k // cpn

    def _place(self, p: _Pool, m: int):
        cpn = p.cpn
        b = p.buckets
        if m < 1000:
            part = p.partial
            for i in range(m // _FRACTION_UNIT, len(part)):
                if part[i]:
                    return [next(iter(part[i]))]
            for nf in range(1, cpn + 1):  # best fit: keep whole nodes whole
                if b[nf]:
                    n = next(iter(b[nf]))
                    base = n * cpn
                    for c in range(base, base + cpn):
                        if p.free[c] == 1000 and p.state[c] < DOWN:
                            return [c]
            return None
        k = m // 1000
        if k < cpn:
            for nf in range(k, cpn + 1):
                if b[nf]:
                    n = next(iter(b[nf]))
                    base = n * cpn
                    chips = []
                    free, state = p.free, p.state
                    for c in range(base, base + cpn):
                        if free[c] == 1000 and state[c] < DOWN:
                            chips.append(c)
                            if len(chips) == k:
                                return chips
            return None
        need = k // cpn
        if len(b[cpn]) < need:
            return None
        chips = []
        for n in list(itertools.islice(b[cpn], need)):
            chips.extend(range(n * cpn, n * cpn + cpn))
        return chips

    def _allowed(self, p: _Pool, j: _Job) -> bool:
        lim = p.blim[j.team]
        return lim is None or p.use[j.team] + j.milli <= p.nominal[j.team] + lim + p.burst[j.team]

    def _enqueue(self, p: _Pool, j: _Job) -> None:
        j.queued = True
        entry = (-j.prio, j.seq, j.token, j)
        if not self._allowed(p, j):
            self._park(p, entry)
            return
        m = j.milli
        p.pend_cls[m] = p.pend_cls.get(m, 0) + 1
        q = p.queue.get(m)
        if q is None:
            q = p.queue[m] = []
        heapq.heappush(q, entry)

    def _park(self, p: _Pool, entry) -> None:
        """Set aside a queued job its team's borrowing limit does not admit now (Kueue would not even
        consider it), so that scheduling passes do not trip over it; _unpark brings it back."""
        j = entry[3]
        j.parked = True
        lst = p.parked[j.team].get(j.milli)
        if lst is None:
            p.parked[j.team][j.milli] = [entry]
        else:
            lst.append(entry)

    def _unpark(self, p: _Pool, tm: int) -> None:
        """The team's usage or quota changed: requeue its parked jobs that its limit may admit now."""
        lim = p.blim[tm]
        room = None if lim is None else p.nominal[tm] + lim + p.burst[tm] - p.use[tm]
        parked = p.parked[tm]
        for m in [m for m in parked if room is None or m <= room]:
            q = p.queue.get(m)
            if q is None:
                q = p.queue[m] = []
            n = 0
            for e in parked.pop(m):
                j = e[3]
                if j.parked and j.state == PENDING and j.queued and e[2] == j.token:
                    j.parked = False
                    heapq.heappush(q, e)
                    n += 1
            p.pend_cls[m] = p.pend_cls.get(m, 0) + n

    def _dequeue(self, p: _Pool, j: _Job) -> None:
        if j.queued:
            j.queued = False
            if j.parked:
                j.parked = False  # its entry in the parked list is now stale
            else:
                p.pend_cls[j.milli] -= 1

    def _admit(self, j: _Job, tok: int) -> None:
        """The job reaches the scheduler (a few seconds after submission, or after a preemption backoff)."""
        if j.token != tok or j.state != PENDING:
            return
        p = j.pool
        rng = self.rng
        if self._allowed(p, j) and self._fits(p, j.milli):
            self._start(p, j, self._place(p, j.milli))
            return
        self._enqueue(p, j)
        # impatient users cancel jobs that wait too long (the timer is void once the job starts)
        patience = (1800 + int(8 * 3600 * math.exp(0.9 * rng.gauss(0.0, 1.0))) if not j.n_preempt
                    else 6 * 3600 + int(24 * 3600 * math.exp(0.5 * rng.gauss(0.0, 1.0))))
        self._at(self.now + patience, self._patience, j, j.token)
        self._maybe_reclaim(p, j)

    @staticmethod
    def _head(q: list):
        """The first live entry of one size class's queue (dropping entries of cancelled jobs)."""
        while q:
            e = q[0]
            j = e[3]
            if j.state == PENDING and j.queued and e[2] == j.token:
                return e
            heapq.heappop(q)
        return None

    def _schedule(self, p: _Pool) -> None:
        """A best-effort priority-FIFO pass: repeatedly start the best pending job among the size classes
        that fit now (one queue per job size, so jobs that cannot fit cost nothing); jobs over their team's
        borrowing limit are parked. Then, if the head of the whole queue is still waiting, consider a reclaim.
        """
        queue, pend = p.queue, p.pend_cls
        head = self._head
        buckets, partial, cpn = p.buckets, p.partial, p.cpn
        while p.free_whole or any(partial):
            # what fits now: the largest free single-node block, whole free nodes, the largest shared slot
            max_nf = cpn
            while max_nf and not buckets[max_nf]:
                max_nf -= 1
            full = len(buckets[cpn])
            max_part = 1000 if p.free_whole else 0
            if not max_part:
                for i in range(len(partial) - 1, 0, -1):
                    if partial[i]:
                        max_part = i * _FRACTION_UNIT
                        break
            best = None
            for m, cnt in pend.items():
                if not cnt:
                    continue
                if m < 1000:
                    if m > max_part:
                        continue
                else:
                    k = m // 1000
                    if (k > max_nf) if k < cpn else (k // cpn > full):
                        continue
                e = head(queue[m])
                if e is not None and (best is None or e < best):
                    best = e
            if best is None:
                break
            j = best[3]
            heapq.heappop(queue[j.milli])
            pend[j.milli] -= 1
            if not self._allowed(p, j):
                self._park(p, best)
                continue
            j.queued = False
            self._start(p, j, self._place(p, j.milli))
        if not p.reclaim_pending:
            best = None
            for m, cnt in pend.items():
                if cnt and m >= 1000:
                    e = head(queue[m])
                    if e is not None and (best is None or e < best):
                        best = e
            if best is not None:
                self._maybe_reclaim(p, best[3])

    def _start(self, p: _Pool, j: _Job, chips: list[int]) -> None:
        j.state = RUNNING
        j.token += 1
        tok = j.token
        j.chips = chips
        m = j.milli
        jobs_on = p.jobs_on
        if m >= 1000:
            # whole chips, all free and usable, grouped by node (as _place returns them)
            free, node_free, buckets, cpn = p.free, p.node_free, p.buckets, p.cpn
            prev_n, k = -1, 0
            for c in chips:
                free[c] = 0
                jobs_on[c].append(j)
                n = c // cpn
                if n != prev_n:
                    if k:
                        nf = node_free[prev_n]
                        del buckets[nf][prev_n]
                        buckets[nf - k][prev_n] = None
                        node_free[prev_n] = nf - k
                    prev_n, k = n, 0
                k += 1
            nf = node_free[prev_n]
            del buckets[nf][prev_n]
            buckets[nf - k][prev_n] = None
            node_free[prev_n] = nf - k
            p.free_whole -= len(chips)
        else:
            for c in chips:
                self._take(p, c, m)
                jobs_on[c].append(j)
        p.use[j.team] += m
        p.running[j.team][j] = None
        t = self.now
        j.run_start = t
        j.ckpt_t = t
        j.run_done0 = j.done
        if j.placement:
            ids = p.chip_ids
            self._emit("job.started", p, p.sched_src, {"job_id": j.id, "chip_ids": [ids[c] for c in chips]})
        else:
            self._emit("job.started", p, p.sched_src, {"job_id": j.id})
        if j.prog:  # a restart continues from the last checkpoint's count
            j.units = float(j.units_ckpt)
            j.units_t = t
            j.slow = any(p.state[c] == DEGRADED for c in chips)
            self._emit("job.progress", p, p.sched_src, {"job_id": j.id, "units": j.units_ckpt, "unit": "step"})
            self._at(t + PROGRESS_IV_S, self._report, j, tok)
        remaining = j.work - j.done
        if j.fail_at is not None and j.fail_at - j.done < remaining:
            end = t + j.fail_at - j.done
            j.outcome = "failed"
        else:
            end = t + remaining
            j.outcome = "succeeded"
        j.run_end = end
        self._at(end, self._end, j, tok)
        if j.ckpt_iv and t + j.ckpt_iv < end:
            self._at(t + j.ckpt_iv, self._ckpt, j, tok)

    def _stop(self, p: _Pool, j: _Job) -> None:
        m = j.milli
        jobs_on = p.jobs_on
        if m >= 1000:
            free, cpn, state = p.free, p.cpn, p.state
            prev_n, k = -1, 0  # chips freed on node prev_n so far (a job's chips come node by node)
            for c in j.chips:
                free[c] = 1000
                jobs_on[c].remove(j)
                if state[c] < DOWN:
                    n = c // cpn
                    if n != prev_n:
                        if k:
                            _shift_node(p, prev_n, k)
                        prev_n, k = n, 0
                    k += 1
            if k:
                _shift_node(p, prev_n, k)
        else:
            for c in j.chips:
                self._give(p, c, m)
                jobs_on[c].remove(j)
        p.use[j.team] -= m
        del p.running[j.team][j]
        j.chips = None
        if p.parked[j.team]:
            self._unpark(p, j.team)

    def _finish(self, j: _Job, outcome: str) -> None:
        p = j.pool
        self.jobs_by_id.pop(j.id, None)
        self._emit("job.finished", p, p.sched_src, {"job_id": j.id, "outcome": outcome})
        if j.state == RUNNING:
            self._stop(p, j)
        else:
            self._dequeue(p, j)
        j.state = DONE
        j.token += 1

    def _end(self, j: _Job, tok: int) -> None:
        if j.token != tok or j.state != RUNNING:
            return
        self._finish(j, j.outcome)
        self._schedule(j.pool)

    def _ckpt(self, j: _Job, tok: int) -> None:
        if j.token != tok or j.state != RUNNING:
            return
        p = j.pool
        t = self.now
        self._emit("job.checkpointed", p, p.sched_src, self._ckpt_fields(j))
        j.done = j.run_done0 + (t - j.run_start)
        j.ckpt_t = t
        if t + j.ckpt_iv < j.run_end:
            self._at(t + j.ckpt_iv, self._ckpt, j, tok)

    def _steps(self, j: _Job) -> int:
        """Bring a reporting job's step count up to now (at half speed while it holds a degraded chip)."""
        dt = self.now - j.units_t
        if dt > 0:
            j.units += j.spd * (DEGRADED_SPEED if j.slow else 1.0) * dt * self.prng.uniform(0.95, 1.05)
            j.units_t = self.now
        return int(j.units)

    def _ckpt_fields(self, j: _Job) -> dict:
        if not j.prog:
            return {"job_id": j.id}
        j.units_ckpt = self._steps(j)
        return {"job_id": j.id, "units": j.units_ckpt}

    def _report(self, j: _Job, tok: int) -> None:
        if j.token != tok or j.state != RUNNING:
            return
        p = j.pool
        self._emit("job.progress", p, p.sched_src, {"job_id": j.id, "units": self._steps(j), "unit": "step"})
        if self.now + PROGRESS_IV_S < j.run_end:
            self._at(self.now + PROGRESS_IV_S, self._report, j, tok)

    def _preempt(self, j: _Job, decision_id: str | None = None) -> None:
        """Running -> pending; work since the last checkpoint is lost; back in the queue after a backoff."""
        p = j.pool
        self._emit("job.preempted", p, p.sched_src,
                   {"job_id": j.id} if decision_id is None else {"job_id": j.id, "decision_id": decision_id})
        self._stop(p, j)
        j.state = PENDING
        j.token += 1
        j.n_preempt += 1
        self._at(self.now + self.rng.randrange(15, 121), self._admit, j, j.token)

    def _patience(self, j: _Job, tok: int) -> None:
        if j.token == tok and j.state == PENDING:
            self._finish(j, "cancelled")

    def _user_cancel(self, j: _Job, _b) -> None:
        if j.state == PENDING:
            self._finish(j, "cancelled")
        elif j.state == RUNNING:
            self._finish(j, "cancelled")
            self._schedule(j.pool)

    # ------------------------------------------------------------------ reclaim / priority preemption

    def _maybe_reclaim(self, p: _Pool, j: _Job) -> None:
        """Schedule a reclaim (or priority preemption) check for a waiting job after a grace period, which
        lets natural completions make room first. ``reclaim_t`` rate-limits the checks per job."""
        if p.reclaim_pending or j.milli < 1000 or self.now < j.reclaim_t or self.follow is not None:
            return  # (following the ledger, preemption is its decision)
        tm = j.team
        eligible = j.prio >= 1000
        if p.use[tm] + j.milli <= p.nominal[tm]:
            borrowed = 0
            for i in range(self.n_teams):
                if i != tm and p.use[i] > p.nominal[i]:
                    borrowed += p.use[i] - p.nominal[i]
            eligible = borrowed >= j.milli
        if not eligible:
            j.reclaim_t = self.now + 300
            return
        p.reclaim_pending = True
        self._at(self.now + self.rng.randrange(120, 601), self._reclaim, p, j)

    def _reclaim(self, p: _Pool, j: _Job) -> None:
        p.reclaim_pending = False
        if j.state != PENDING or not j.queued:
            self._schedule(p)
            return
        if self._fits(p, j.milli) and self._allowed(p, j):
            self._schedule(p)
            return
        t = self.now
        j.reclaim_t = t + 1800
        tm = j.team
        cands = []
        budget = {}
        if p.use[tm] + j.milli <= p.nominal[tm]:  # reclaim borrowed chips from other teams
            for i in range(self.n_teams):
                if i == tm or p.use[i] <= p.nominal[i]:
                    continue
                budget[i] = p.use[i] - p.nominal[i]
                for v in itertools.islice(reversed(p.running[i]), 64):
                    if v.preemptible and v.milli >= 1000 and t - v.run_start >= 600 and v.n_preempt < 3:
                        cands.append(v)
        elif j.prio >= 1000:  # priority within the team
            for v in itertools.islice(reversed(p.running[tm]), 128):
                if (v.preemptible and v.prio < j.prio and v.milli >= 1000 and t - v.run_start >= 600
                        and v.n_preempt < 3):
                    cands.append(v)
        if not cands:
            self._schedule(p)
            return
        # lowest priority first, then least work lost (chips x seconds since the last checkpoint)
        cands.sort(key=lambda v: (v.prio, v.milli * (t - v.ckpt_t), -v.run_start, v.seq))
        victims = self._pick_victims(p, j, cands, budget)
        if victims:
            for v in victims:
                self._preempt(v)
            chips = self._place(p, j.milli)
            if chips is not None:
                self._dequeue(p, j)
                self._start(p, j, chips)
        self._schedule(p)

    def _pick_victims(self, p: _Pool, j: _Job, cands: list, budget: dict):
        cpn = p.cpn
        k = j.milli // 1000
        state, node_free = p.state, p.node_free
        extra: dict[int, int] = {}
        chosen = []
        for v in cands:
            if budget:
                left = budget.get(v.team, 0)
                if left <= 0:
                    continue  # that team no longer borrows: leave its jobs alone
                budget[v.team] = left - v.milli
            chosen.append(v)
            for c in v.chips:
                if state[c] < DOWN:
                    n = c // cpn
                    extra[n] = extra.get(n, 0) + 1
            if k < cpn:
                target = next((n for n in {c // cpn for c in v.chips} if node_free[n] + extra.get(n, 0) >= k),
                              None)
                if target is not None:
                    # keep only the victims on the target node, in order, until the job fits there
                    kept, have = [], node_free[target]
                    for w in chosen:
                        on = sum(1 for c in w.chips if c // cpn == target and state[c] < DOWN)
                        if on:
                            kept.append(w)
                            have += on
                            if have >= k:
                                return kept
                    return kept
            else:
                done_nodes = {n for n, e in extra.items() if node_free[n] + e == cpn}
                if len(p.buckets[cpn]) + len(done_nodes) >= k // cpn:
                    return [w for w in chosen if any(c // cpn in done_nodes for c in w.chips)]
        return None

    # ------------------------------------------------------------------ chip health

    def _set_state(self, p: _Pool, c: int, new: int, reason: str | None) -> None:
        old = p.state[c]
        if old < DOWN <= new:
            self._unusable(p, c)
        if self.progress:  # the reporting jobs on the chip: their steps so far at the old pace, then the new one
            for j in p.jobs_on[c]:
                if j.prog and j.state == RUNNING:
                    self._steps(j)
        p.state[c] = new
        if self.progress:
            for j in p.jobs_on[c]:
                if j.prog and j.state == RUNNING:
                    j.slow = any(p.state[x] == DEGRADED for x in j.chips)
        if new < DOWN <= old:
            self._usable(p, c)
        p.tokens[c] += 1
        f = {"chip_id": p.chip_ids[c], "state": _STATE_NAMES[new]}
        if reason:
            f["reason"] = reason
        self._emit("chip.state_changed", p, p.health_src, f)

    def _fail_proc(self, p: _Pool, _b) -> None:
        rng = self.rng
        t = self.now
        self._at(t + 1 + int(rng.expovariate(p.fail_rate)), self._fail_proc, p)
        reasons = _DOWN_REASONS_GPU if p.gpu else _DOWN_REASONS_TPU
        back = t + rng.randrange(3600, 12 * 3600 + 1)
        if rng.random() < 0.15:  # the whole node drops off
            n = rng.randrange(p.n_nodes)
            chips = [c for c in range(n * p.cpn, (n + 1) * p.cpn) if p.state[c] < DOWN]
            for c in chips:
                self._chip_down(p, c, "node unreachable")
                self._at(back, self._chip_up, p, (c, p.tokens[c], "node repaired"))
            return
        c = rng.randrange(p.n_chips)
        if p.state[c] >= DOWN:
            return
        self._chip_down(p, c, reasons[rng.randrange(len(reasons))])
        if self.retire_times and t >= self.retire_times[0]:
            self.retire_times.pop(0)
            self._at(t + rng.randrange(2 * 3600, 24 * 3600), self._chip_retire, p, (c, p.tokens[c]))
        else:
            self._at(back, self._chip_up, p, (c, p.tokens[c], "repaired, health checks passed"))

    def _chip_down(self, p: _Pool, c: int, reason: str) -> None:
        self._set_state(p, c, DOWN, reason)
        for j in p.jobs_on[c]:
            self._at(self.now + self.rng.randrange(5, 181), self._job_fault, j, j.token)

    def _job_fault(self, j: _Job, tok: int) -> None:
        if j.token != tok or j.state != RUNNING:
            return
        if j.preemptible and self.rng.random() < 0.5:
            self._preempt(j)
        else:
            self._finish(j, "failed")
        self._schedule(j.pool)

    def _chip_up(self, p: _Pool, arg) -> None:
        c, tok, reason = arg
        if p.tokens[c] != tok or p.state[c] == RETIRED:
            return
        self._set_state(p, c, HEALTHY, reason)
        self._schedule(p)

    def _chip_retire(self, p: _Pool, arg) -> None:
        c, tok = arg
        if p.tokens[c] != tok or p.state[c] != DOWN:
            return
        p.state[c] = RETIRED  # already out of the placement structures since it went down
        p.tokens[c] += 1
        self._emit("chip.retired", p, p.inv_src, {"chip_id": p.chip_ids[c]})

    def _degrade_proc(self, p: _Pool, _b) -> None:
        rng = self.rng
        self._at(self.now + 1 + int(rng.expovariate(p.degrade_rate)), self._degrade_proc, p)
        c = rng.randrange(p.n_chips)
        if p.state[c] != HEALTHY:
            return
        self._set_state(p, c, DEGRADED, _DEGRADED_REASONS[rng.randrange(len(_DEGRADED_REASONS))])
        self._at(self.now + rng.randrange(2 * 3600, 48 * 3600), self._chip_up,
                 p, (c, p.tokens[c], "back within thresholds"))

    def _maint_plan(self, p: _Pool, _b) -> None:
        rng = self.rng
        t = self.now
        self._at(t + 1 + int(rng.expovariate(p.maint_rate)), self._maint_plan, p)
        n = rng.randrange(p.n_nodes)
        # the next night at 02:00 UTC, at least 6 hours ahead, on a weekday
        begin = (t + 6 * 3600 - 2 * 3600) // 86400 * 86400 + 86400 + 2 * 3600
        while ((begin // 86400) + 3) % 7 >= 5:
            begin += 86400
        self._at(begin + rng.randrange(0, 3 * 3600), self._maint_begin, p, n)

    def _maint_begin(self, p: _Pool, n: int) -> None:
        rng = self.rng
        live = [c for c in range(n * p.cpn, (n + 1) * p.cpn) if p.state[c] != RETIRED]
        if not live or any(p.state[c] >= DOWN for c in live):
            return
        reason = _MAINT_REASONS[rng.randrange(len(_MAINT_REASONS))]
        evict = {}
        for c in live:
            self._set_state(p, c, MAINT, reason)
            for j in p.jobs_on[c]:
                evict[j] = None
        for j in evict:
            self._at(self.now + rng.randrange(10, 91), self._evict, j, j.token)
        back = self.now + rng.randrange(2 * 3600, 6 * 3600 + 1)
        for c in live:
            self._at(back, self._chip_up, p, (c, p.tokens[c], "maintenance complete"))

    def _evict(self, j: _Job, tok: int) -> None:
        if j.token != tok or j.state != RUNNING:
            return
        if j.preemptible:
            self._preempt(j)
        else:
            self._finish(j, "failed")
        self._schedule(j.pool)


def generate(seed: int = 7, days: float = 14, start: datetime = datetime(2026, 11, 2, tzinfo=UTC),
             pools: int = 3, teams: int = 10, scale: float = 1.0, *, follow=None, load: float | None = None,
             failure_scale: float = 1.0, progress: bool = False) -> Iterator[dict]:
    """Yield a fleet scenario as wire-format event dicts (DESIGN §3), in non-decreasing ``occurred_at``.

    Deterministic: the same arguments give the same events. Streaming: memory follows the number of chips
    and active jobs, not ``days``. ``scale`` multiplies job arrival rates and pool sizes together.
    Each pool starts with ``pool.configured`` and its ``chip.registered`` events and ends with ``pool.tick``
    at ``start + days``; jobs still running or pending then are left open.

    ``follow(event) -> [decision dicts]``: the cluster acts on the ledger's decisions (see the module's
    docstring). ``load``: the offered load as a fraction of capacity (default ~0.92); ``failure_scale``
    multiplies the rates of chip failures, degradations and maintenance. ``progress``: training jobs report their
    steps (job.progress, job.checkpointed with units), slowed by degraded chips.
    """
    return _Sim(seed, days, start, pools, teams, scale, follow, load, failure_scale, progress).run()


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def iter_jsonl(events: Iterable[dict]) -> Iterator[str]:
    """Compact JSON text of each event (no newline)."""
    enc = _ENCODE
    for ev in events:
        yield enc(ev)


def write_jsonl(events: Iterable[dict], path) -> int:
    """Write one compact JSON object per line; return the number of lines written."""
    n = 0
    enc = _ENCODE
    with open(path, "w", encoding="utf-8") as fh:
        buf = []
        for ev in events:
            buf.append(enc(ev))
            if len(buf) >= 4096:
                fh.write("\n".join(buf))
                fh.write("\n")
                n += len(buf)
                buf.clear()
        if buf:
            fh.write("\n".join(buf))
            fh.write("\n")
            n += len(buf)
    return n


# ---------------------------------------------------------------------- corruption

BAD_KINDS = (
    "not_json", "unknown_type", "missing_field", "extra_field", "naive_timestamp", "zero_chips",
    "negative_chips", "unknown_job", "unknown_chip", "unknown_pool", "illegal_transition", "duplicate",
    "duplicate_conflict",
)


def corrupt(lines: Iterable[str], seed: int, every: int = 500, labels: list | None = None) -> Iterator[str]:
    """Pass ``lines`` through, inserting about one deliberately bad line per ``every`` lines.

    Bad kinds cycle through :data:`BAD_KINDS`. Every bad line has a fresh, unique ``event_id``
    (``bad-<seed>-<n>-<kind>``) except the two duplicate kinds, which reuse the id of an earlier line of the
    same ``occurred_at``. Inserted lines carry the ``occurred_at`` of the line before them and end with a
    newline when the input lines do. If ``labels`` is a list, ``(output_index, kind)`` is appended to it for
    each inserted line. A kind that cannot be made yet (no pending job for ``illegal_transition``) is tried
    again after the next line.
    """
    if every < 1:
        raise ValueError("every must be >= 1")
    rng = random.Random(seed)
    enc = _ENCODE
    ring: deque = deque(maxlen=64)  # recent good input lines: (text, event)
    pending: dict[str, str] = {}  # job id -> pool, for jobs pending now
    teams: list[str] = []
    kind_i = 0
    n_bad = 0
    out_i = 0
    jitter = max(0, every // 5)
    gap = max(1, every + rng.randint(-jitter, jitter))
    since = 0
    prev = None
    for line in lines:
        yield line
        out_i += 1
        since += 1
        nl = "\n" if line.endswith("\n") else ""
        text = line.rstrip("\r\n")
        try:
            ev = json.loads(text)
        except ValueError:
            ev = None
        if isinstance(ev, dict) and isinstance(ev.get("occurred_at"), str) and "pool" in ev:
            prev = ev
            ring.append((text, ev))
            typ = ev.get("type")
            jid = ev.get("job_id")
            if typ == "job.submitted":
                pending[jid] = ev["pool"]
                if ev.get("team") not in teams and len(teams) < 64:
                    teams.append(ev.get("team"))
            elif typ == "job.preempted":
                pending[jid] = ev["pool"]
            elif typ in ("job.started", "job.finished"):
                pending.pop(jid, None)
        if since < gap or prev is None:
            continue
        kind = BAD_KINDS[kind_i % len(BAD_KINDS)]
        bad = _make_bad(kind, rng, seed, n_bad, prev, ring, pending, teams, enc)
        if bad is None:
            continue
        yield bad + nl
        if labels is not None:
            labels.append((out_i, kind))
        out_i += 1
        n_bad += 1
        kind_i += 1
        since = 0
        gap = max(1, every + rng.randint(-jitter, jitter))


def _make_bad(kind, rng, seed, n, prev, ring, pending, teams, enc):
    at = prev["occurred_at"]
    pool = prev["pool"]
    source = prev.get("source", "chaos/corrupt")
    eid = f"bad-{seed}-{n:06d}-{kind}"
    team = teams[rng.randrange(len(teams))] if teams else "vision"
    ghost = f"job-bad-{seed}-{n:06d}"

    def env(typ, **fields):
        ev = {"event_id": eid, "type": typ, "occurred_at": at, "pool": pool, "source": source}
        ev.update(fields)
        return ev

    def submitted(**over):
        f = {"job_id": ghost, "team": team, "chips": 1, "priority": 100, "preemptible": True}
        f.update(over)
        return env("job.submitted", **f)

    if kind == "not_json":
        text = enc(submitted())
        return text[: max(12, len(text) * 2 // 3)]
    if kind == "unknown_type":
        return enc(env("job.teleported", job_id=ghost))
    if kind == "missing_field":
        ev = submitted()
        del ev["team"]
        return enc(ev)
    if kind == "extra_field":
        return enc(submitted(queue_name="default"))
    if kind == "naive_timestamp":
        ev = env("pool.tick")
        naive = at[:-1] if at.endswith("Z") else at[:19]
        ev["occurred_at"] = naive
        return enc(ev)
    if kind == "zero_chips":
        return enc(submitted(chips=0))
    if kind == "negative_chips":
        return enc(env("quota.granted", grant_id=f"grant-bad-{seed}-{n:06d}", team=team, chips=-8))
    if kind == "unknown_job":
        return enc(env("job.started", job_id=f"job-ghost-{seed}-{n:06d}"))
    if kind == "unknown_chip":
        return enc(env("chip.state_changed", chip_id=f"ghost-chip-{seed}-{n:06d}", state="down",
                       reason="xid 79: GPU has fallen off the bus"))
    if kind == "unknown_pool":
        ev = submitted()
        ev["pool"] = "nowhere-1z/ghost-accel"
        return enc(ev)
    if kind == "illegal_transition":
        if not pending:
            return None
        jid = next(reversed(pending))
        ev = env("job.checkpointed", job_id=jid)
        ev["pool"] = pending[jid]
        return enc(ev)
    same = [(t, e) for t, e in ring if e.get("occurred_at") == at]
    text, ev = same[rng.randrange(len(same))]
    if kind == "duplicate":
        return text
    # duplicate_conflict: same event_id, a different body
    ev = dict(ev)
    if isinstance(ev.get("chips"), (int, float)) and not isinstance(ev.get("chips"), bool):
        ev["chips"] = ev["chips"] * 2
    elif ev.get("type") == "job.finished":
        ev["outcome"] = "failed" if ev.get("outcome") != "failed" else "succeeded"
    elif ev.get("type") == "chip.state_changed":
        ev["state"] = "down" if ev.get("state") != "down" else "healthy"
    else:
        ev["source"] = f"{ev.get('source', 'unknown')}/replayed"
    return enc(ev)


# ---------------------------------------------------------------------- command line

def _main(argv=None) -> int:
    import argparse
    import sys
    import time

    ap = argparse.ArgumentParser(prog="python -m chipledger.sim.scenario",
                                 description="Write a seeded fleet scenario as JSONL and report the speed.")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--days", type=float, default=14)
    ap.add_argument("--pools", type=int, default=3)
    ap.add_argument("--teams", type=int, default=10)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--start", default="2026-11-02T00:00:00Z")
    ap.add_argument("--out", help="JSONL path (omit to only count and time generation)")
    ap.add_argument("--corrupt-every", type=int, default=0, help="insert a bad line about every N lines")
    args = ap.parse_args(argv)
    start = datetime.fromisoformat(args.start)
    events = generate(args.seed, args.days, start, args.pools, args.teams, args.scale)
    t0 = time.perf_counter()
    if args.out:
        lines = (s + "\n" for s in iter_jsonl(events))
        if args.corrupt_every:
            lines = corrupt(lines, args.seed, args.corrupt_every)
        n = 0
        with open(args.out, "w", encoding="utf-8") as fh:
            for s in lines:
                fh.write(s)
                n += 1
    else:
        counts: dict[str, int] = {}
        n = 0
        for ev in events:
            n += 1
            counts[ev["type"]] = counts.get(ev["type"], 0) + 1
        print(json.dumps(counts, sort_keys=True), file=sys.stderr)
    dt = time.perf_counter() - t0
    print(f"{n} lines in {dt:.2f}s ({n / dt:,.0f}/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
