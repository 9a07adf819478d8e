"""The teams' demand: quotas and their changes, burst requests, and the jobs teams submit.

- Each team has quota in 1-3 pools; per pool the quotas add up to 80-110% of its capacity, some with a
  borrowing or lending limit. Early on one team gets a temporary grant; halfway through one team's quota is
  changed (a new grant, the old one revoked), during office hours.
- Jobs arrive per pool by a Poisson process whose rate follows an hour-of-week profile (busy weekday afternoons
  UTC, quiet nights and weekends) and a per-day multiplier, calibrated so that the offered load averages the
  target (``load``) of capacity; now and then a team submits a sweep of 20-50 small jobs at once.
- A job's shape comes from its team's profile (train, research, infer): sizes mostly powers of two, some
  fractional on GPU pools, lognormal durations, a priority mix; most checkpoint; ~6% fail, some are cancelled by
  their users, and impatient users cancel jobs that wait too long.
- A burst request goes in during weekday office hours; its jobs come for its window (following the ledger:
  only as far as the ledger grants it).
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right

from chipledger.sim.scenario.fleet import _Pool
from chipledger.sim.scenario.scheduler import PENDING, RUNNING, _Job
from chipledger.sim.scenario.wire import _wire_chips


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
_BURST_REASONS = ("paper deadline", "launch load test", "quarterly model refresh", "incident backfill",
                  "customer eval crunch")


class _Demand:
    """The teams' part of the simulation (mixed into engine._Sim): quotas, bursts, arrivals, submissions and
    cancellations."""

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

    def _patience(self, j: _Job, tok: int) -> None:
        if j.token == tok and j.state == PENDING:
            self._finish(j, "cancelled")

    def _user_cancel(self, j: _Job, _b) -> None:
        if j.state == PENDING:
            self._finish(j, "cancelled")
        elif j.state == RUNNING:
            self._finish(j, "cancelled")
            self._schedule(j.pool)
