"""A simulated cluster driven by the ledger core's decisions: `bench/policy.py` and `chipledger backtest`.

The cluster owns what runs; the ledger (a `Fleet` folding every event the cluster sends, exactly as the
embedded run or the Kafka worker would) decides preemptions. Assumptions (docs/backtest.md):

- placement: a pool is a bag of chips; a job starts when its chips are free (no nodes, no fragmentation);
- start order, whenever chips are freed or a job arrives: first the beneficiaries of decisions the cluster
  acted on, then jobs that fit their team's quota, then borrowers; each in priority, then arrival order; any
  job that fits starts (no head-of-line blocking);
- a decision is acted on `act_delay_s` after it (the victims still running are preempted, with the
  decision id) unless its beneficiary started meanwhile; with `coop_share` > 0, that share of the victims
  (chosen by a hash of decision and job id, so runs are reproducible) checkpoint on notice `coop_ckpt_s` after
  the decision (at the latest at `checkpoint_by`) and are preempted right after;
- runs end when the job's work is done: a job needs `work` seconds of running; a preempted job goes back to
  its queue and redoes the work since its last checkpoint (periodic checkpoints every `ckpt_every` s when
  given); a job that never started in the log leaves its queue at `cancel_at` if it has not started by then.

Everything is integer event time (seconds) and milli-chips; the same inputs give the same result.
"""

from __future__ import annotations

import heapq
import math
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Iterable, Optional

from ledger import FoldConfig, Fleet
from ledger.policy import decision_of, fair_shares
from schemas import Rejection, parse_payload

MILLI = 1000


def iso(t: int) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def _grant_id(team: str) -> str:
    """The simulated grant of a team: `g-TEAM`, or, for a team name too long for an id (the contract allows 256
    characters for both), its first 200 characters and a sha256 prefix."""
    gid = f"g-{team}"
    if len(gid) <= 256:
        return gid
    import hashlib

    return f"g-{team[:200]}~{hashlib.sha256(team.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"


@dataclass
class SimJob:
    """One job of the demand. `work`: seconds of running it needs; `ckpt_every`: its checkpoint interval (None:
    it never checkpoints by itself); `cancel_at`: it leaves its queue then if it has not started."""

    jid: str
    pool: str
    team: str
    chips_milli: int
    prio: int
    submitted: int
    work: int
    preemptible: bool = True
    ckpt_every: Optional[int] = None
    cancel_at: Optional[int] = None
    # filled by the run
    done_safe: int = 0
    started: Optional[int] = None
    first_start: Optional[int] = None
    finished: Optional[int] = None
    in_quota_at_submit: bool = False
    running: bool = False
    version: int = 0
    preemptions: int = 0


@dataclass(frozen=True)
class SimPool:
    name: str
    chips: int  # whole chips registered (capacity)
    chips_per_node: int = 8
    flavor: str = "sim"


@dataclass
class BurstRequest:
    pool: str
    t: int
    request_id: str
    team: str
    chips: float
    window_start: int
    window_end: int


@dataclass
class SimResult:
    jobs: list
    lost_mchip_s: int = 0
    preemptions: int = 0
    preempted_milli: int = 0  # Σ chips of the preempted runs (a restart cost per chip is this × seconds)
    decisions: int = 0
    # per pool: allocated chip-seconds (milli), borrowed (above quota) chip-seconds, capacity chip-seconds
    used_mchip_s: dict = field(default_factory=dict)
    borrowed_mchip_s: dict = field(default_factory=dict)
    capacity_mchip_s: dict = field(default_factory=dict)
    # fairness: per reclaim victim, chips × (F of its team − lowest F among the borrowing teams then)
    f_excess_sum: float = 0.0
    f_excess_chips: float = 0.0
    jain_sum: float = 0.0
    jain_n: int = 0
    bursts: dict = field(default_factory=lambda: {"approved": 0, "partial": 0, "denied": 0})
    events: int = 0
    span_s: int = 0


def _coop(decision_id: str, job_id: str, share: float) -> bool:
    if share <= 0:
        return False
    if share >= 1:
        return True
    return zlib.crc32(f"{decision_id}/{job_id}".encode()) / 2 ** 32 < share


class Cluster:
    """A closed loop of pools, quotas, demand and the ledger's decisions (see the module docstring)."""

    def __init__(self, pools: Iterable[SimPool], quotas: dict, config: FoldConfig, *, act_delay_s: int = 10,
                 coop_share: float = 0.0, coop_ckpt_s: int = 30, sample_s: int = 3600, fairness: bool = True,
                 tick_s: int = 60, source: str = "sim", prices: Optional[dict] = None):
        self.pools = {p.name: p for p in pools}
        # pool -> [(instant, price.set fields)]: each sent to the pool at its instant, in order (a log's price history;
        # ledger/costs.py prices the run); one the fold rejects is skipped, as the fold of the log rejected it
        self.prices = prices or {}
        self.costs: list = []       # the fold's cost rows of the run (ledger.costs.CostRow)
        self.quotas = {p: dict(quotas.get(p, {})) for p in self.pools}  # pool -> team -> chips
        self.config = config
        self.act_delay_s, self.coop_share, self.coop_ckpt_s = act_delay_s, coop_share, coop_ckpt_s
        self.sample_s = sample_s
        self.tick_s = tick_s
        self.fairness = fairness
        self.source = source
        self.fleet = Fleet(config)
        self.seq = 0
        self.last_event: dict = {}

    # -- the ledger side ------------------------------------------------------------------------------------
    def send(self, pool: str, etype: str, t: int, strict: bool = True, **fields):
        self.seq += 1
        self.last_event[pool] = t
        e = parse_payload({"event_id": f"sim-{self.seq}", "type": etype, "occurred_at": iso(t), "pool": pool,
                           "source": self.source, **fields})
        if isinstance(e, Rejection):
            raise ValueError(f"simulated {etype} not valid: {e}")
        step = self.fleet.apply(e)
        if step.rejection is not None and strict:
            raise ValueError(f"simulated {etype} rejected by the ledger: {step.rejection}")
        if step.costs:
            self.costs.extend(step.costs)
        return step

    # -- the run --------------------------------------------------------------------------------------------
    def run(self, jobs: list, bursts: Iterable[BurstRequest] = (), t0: Optional[int] = None) -> SimResult:
        res = SimResult(jobs=jobs)
        if t0 is None:
            t0 = min((j.submitted for j in jobs), default=0) - 60
        for p in self.pools.values():
            self.send(p.name, "pool.configured", t0, flavor=p.flavor, chips_per_node=p.chips_per_node)
            for i in range(p.chips):
                self.send(p.name, "chip.registered", t0, chip_id=f"c{i}", node=f"n{i // p.chips_per_node}")
            for team, q in sorted(self.quotas[p.name].items()):
                if q > 0:
                    self.send(p.name, "quota.granted", t0, grant_id=_grant_id(team), team=team, chips=q)
        quota = {p: {team: round(q * MILLI) for team, q in qs.items()} for p, qs in self.quotas.items()}
        free = {p: self.pools[p].chips * MILLI for p in self.pools}
        used: dict = {p: {} for p in self.pools}
        pending: dict = {p: {} for p in self.pools}
        pending_team: dict = {p: {} for p in self.pools}
        first: dict = {p: [] for p in self.pools}  # beneficiaries of decisions acted on: started first
        by_id: dict = {}
        timers: list = []
        tseq = 0
        # area integrals per pool: allocated and borrowed milli-chips × seconds
        last_t = {p: t0 for p in self.pools}
        over = {p: 0 for p in self.pools}  # Σ_team max(0, used - quota), milli
        for p in self.pools:
            res.used_mchip_s[p] = res.borrowed_mchip_s[p] = 0

        def at(t, kind, payload, version=0):
            nonlocal tseq
            tseq += 1
            heapq.heappush(timers, (t, tseq, kind, payload, version))

        # the Kafka worker's tick: a pool with no event for tick_s gets a pool.tick (worker tick_interval_s),
        # so the ledger's grace periods and timeouts come on time in a quiet pool; here while jobs are pending
        ticking = set()
        last_event = self.last_event

        def tick_later(p, t):
            if self.tick_s and p not in ticking and pending[p]:
                ticking.add(p)
                at(last_event[p] + self.tick_s, "tick", p)

        def accrue(p, t):
            dt = t - last_t[p]
            if dt > 0:
                res.used_mchip_s[p] += dt * (self.pools[p].chips * MILLI - free[p])
                res.borrowed_mchip_s[p] += dt * over[p]
                last_t[p] = t

        def change_use(p, team, delta, t):
            accrue(p, t)
            u = used[p]
            q = quota[p].get(team, 0)
            before = u.get(team, 0)
            after = before + delta
            u[team] = after
            over[p] += max(0, after - q) - max(0, before - q)
            free[p] -= delta

        def on_step(p, step, t):
            for run in step.job_runs:
                if run.end_reason == "preempted":
                    res.lost_mchip_s += run.lost_mchip_s
                    res.preemptions += 1
            for row in step.decisions:
                if row[1] == "decision.preempt":
                    d = decision_of(row)
                    res.decisions += 1
                    if self.fairness and d.rule == "reclaim":
                        self._fairness(p, d, t, used[p], quota[p], res)
                    notice(p, d, t)
                else:
                    v = decision_of(row).verdict
                    res.bursts[v] = res.bursts.get(v, 0) + 1

        def notice(p, d, t):
            coop = []
            for v in d.victims:
                if _coop(d.decision_id, v.job_id, self.coop_share):
                    coop.append(v.job_id)
            at(t + self.act_delay_s, "act", (p, d, frozenset(coop)))
            if coop:
                at(t + min(self.coop_ckpt_s, self.config.checkpoint_grace_s), "coop", (p, d, tuple(coop)))

        def start(job: SimJob, t: int):
            p = job.pool
            pending[p].pop(job.jid, None)
            pending_team[p][job.team] -= job.chips_milli
            job.running = True
            job.started = t
            job.version += 1
            if job.first_start is None:
                job.first_start = t
            change_use(p, job.team, job.chips_milli, t)
            on_step(p, self.send(p, "job.started", t, job_id=job.jid), t)
            left = job.work - job.done_safe
            if job.ckpt_every is not None and job.ckpt_every < left:
                at(t + job.ckpt_every, "ckpt", job.jid, job.version)
            at(t + left, "finish", job.jid, job.version)

        def stop(job: SimJob, t: int):
            job.running = False
            job.version += 1
            change_use(job.pool, job.team, -job.chips_milli, t)

        def requeue(job: SimJob, t: int, d):
            stop(job, t)
            job.preemptions += 1
            res.preempted_milli += job.chips_milli
            job.started = None
            pending[job.pool][job.jid] = job
            pending_team[job.pool][job.team] = pending_team[job.pool].get(job.team, 0) + job.chips_milli
            on_step(job.pool, self.send(job.pool, "job.preempted", t, job_id=job.jid, decision_id=d.decision_id), t)
            tick_later(job.pool, t)

        def schedule(p: str, t: int):
            pend = pending[p]
            if not pend:
                return
            fl = first[p]
            for jid in list(fl):
                job = pend.get(jid)
                if job is None:
                    fl.remove(jid)
                elif job.chips_milli <= free[p]:
                    fl.remove(jid)
                    start(job, t)
            if not pend or free[p] <= 0:
                return
            smallest = min(j.chips_milli for j in pend.values())
            if smallest > free[p]:
                return
            queue = sorted(pend.values(), key=_queue_key)
            q = quota[p]
            u = used[p]
            for job in queue:
                if job.chips_milli <= free[p] and u.get(job.team, 0) + job.chips_milli <= q.get(job.team, 0):
                    start(job, t)
            for job in queue:
                if free[p] < smallest:
                    break
                if job.running or job.jid not in pend:
                    continue
                if job.chips_milli <= free[p] and job.jid not in fl:
                    start(job, t)

        for p in self.pools:  # first: a price set at an instant holds for what happens at that instant
            for pt, fields in self.prices.get(p, ()):
                at(max(pt, t0), "price", (p, fields))
        for job in jobs:
            at(job.submitted, "submit", job)
            if job.cancel_at is not None:
                at(job.cancel_at, "cancel", job.jid)
        for b in bursts:
            at(b.t, "burst", b)
        end_t = max((j.submitted for j in jobs), default=t0)
        if self.fairness and self.sample_s:
            first_sample = (t0 // self.sample_s + 1) * self.sample_s
            at(first_sample, "sample", None)
        t = t_end = t0
        while timers:
            t, _, kind, payload, version = heapq.heappop(timers)
            if kind == "price":  # the ledger's, not the cluster's: not part of the span
                self.send(payload[0], "price.set", t, strict=False, **payload[1])
                continue
            if kind != "sample":
                t_end = t  # the span ends with the last thing the cluster did (samples only look)
            if kind == "submit":
                job = payload
                p = job.pool
                by_id[job.jid] = job
                pt = pending_team[p].get(job.team, 0)
                job.in_quota_at_submit = (used[p].get(job.team, 0) + pt + job.chips_milli
                                          <= quota[p].get(job.team, 0))
                pending[p][job.jid] = job
                pending_team[p][job.team] = pt + job.chips_milli
                on_step(p, self.send(p, "job.submitted", t, job_id=job.jid, team=job.team,
                                     chips=job.chips_milli / MILLI, priority=job.prio,
                                     preemptible=job.preemptible), t)
                schedule(p, t)
                tick_later(p, t)
            elif kind == "tick":
                p = payload
                ticking.discard(p)
                if pending[p] and last_event[p] + self.tick_s <= t:
                    on_step(p, self.send(p, "pool.tick", t), t)
                    schedule(p, t)
                tick_later(p, t)
            elif kind == "ckpt":
                job = by_id.get(payload)
                if job is None or not job.running or job.version != version:
                    continue
                job.done_safe += t - job.started
                job.started = t
                self.send(job.pool, "job.checkpointed", t, job_id=job.jid)
                if job.ckpt_every < job.work - job.done_safe:
                    at(t + job.ckpt_every, "ckpt", job.jid, job.version)
            elif kind == "finish":
                job = by_id.get(payload)
                if job is None or not job.running or job.version != version:
                    continue
                stop(job, t)
                job.finished = t
                del by_id[job.jid]
                on_step(job.pool, self.send(job.pool, "job.finished", t, job_id=job.jid, outcome="succeeded"), t)
                schedule(job.pool, t)
            elif kind == "cancel":
                job = by_id.get(payload)
                if job is None or job.first_start is not None or job.running:
                    continue
                p = job.pool
                pending[p].pop(job.jid, None)
                pending_team[p][job.team] -= job.chips_milli
                del by_id[job.jid]
                job.finished = t
                on_step(p, self.send(p, "job.finished", t, job_id=job.jid, outcome="cancelled"), t)
            elif kind == "coop":  # victims that checkpoint on notice, then are preempted
                p, d, coop = payload
                if d.beneficiary.job_id not in pending[p]:
                    continue
                acted = False
                for jid in coop:
                    job = by_id.get(jid)
                    if job is not None and job.running:
                        job.done_safe += t - job.started
                        job.started = t
                        self.send(p, "job.checkpointed", t, job_id=jid)
                        requeue(job, t, d)
                        acted = True
                if acted and d.beneficiary.job_id in pending[p]:
                    if d.beneficiary.job_id not in first[p]:
                        first[p].append(d.beneficiary.job_id)
                    schedule(p, t)
            elif kind == "act":
                p, d, coop = payload
                if d.beneficiary.job_id not in pending[p]:
                    continue  # it started (or left) meanwhile: settled, nobody is preempted for it
                acted = False
                for v in d.victims:
                    if v.job_id in coop:
                        continue
                    job = by_id.get(v.job_id)
                    if job is not None and job.running:
                        requeue(job, t, d)
                        acted = True
                if acted and d.beneficiary.job_id in pending[p]:
                    if d.beneficiary.job_id not in first[p]:
                        first[p].append(d.beneficiary.job_id)
                schedule(p, t)
            elif kind == "burst":
                b = payload
                on_step(b.pool, self.send(b.pool, "burst.requested", t, request_id=b.request_id, team=b.team,
                                          chips=b.chips, window_start=iso(b.window_start),
                                          window_end=iso(b.window_end)), t)
            elif kind == "sample":
                self._sample(t, used, quota, res)
                if t < end_t or any(j.running for j in by_id.values()):
                    at(t + self.sample_s, "sample", None)
        for p in self.pools:
            accrue(p, t_end)
            res.capacity_mchip_s[p] = (t_end - t0) * self.pools[p].chips * MILLI
        res.events = self.seq
        res.span_s = t_end - t0
        return res

    # -- fairness -------------------------------------------------------------------------------------------
    def _fairness(self, p: str, d, t: int, used: dict, quota: dict, res: SimResult) -> None:
        """Chips × (F of the victim's team − the lowest F among the teams that could have given chips)."""
        state = self.fleet.pools[p]
        fs = fair_shares(state, t, self.config.decay_half_life_s)
        borrowers = [n for n, u in used.items() if u > quota.get(n, 0) and n != d.beneficiary.team and n in fs]
        if not borrowers:
            return
        low = min(fs[n][1] for n in borrowers)
        for v in d.victims:
            if v.team in fs:
                res.f_excess_sum += v.chips * (fs[v.team][1] - low)
                res.f_excess_chips += v.chips

    def _sample(self, t: int, used: dict, quota: dict, res: SimResult) -> None:
        """Jain's index of usage / share, x = (U/ΣU)/S = -log2 F, among the teams borrowing now (≥ 2)."""
        for p in self.pools:
            state = self.fleet.pools.get(p)
            if state is None:
                continue
            borrowers = [n for n, u in used[p].items() if u > quota[p].get(n, 0)]
            if len(borrowers) < 2:
                continue
            fs = fair_shares(state, t, self.config.decay_half_life_s)
            xs = []
            for n in borrowers:
                f = fs.get(n, (0, 1.0))[1]
                xs.append(-math.log2(f) if f > 0 else 0.0)
            s1 = sum(xs)
            s2 = sum(x * x for x in xs)
            if s2 > 0:
                res.jain_sum += s1 * s1 / (len(xs) * s2)
                res.jain_n += 1


def _queue_key(j: SimJob):
    return (-j.prio, j.submitted, j.jid)
