"""The simulation's engine: one heap of future events, the clock, and the emission of events, over the parts of
the scenario (the fleet, the teams' demand, the scheduler's actions, the faults), which `_Sim` puts together.

- Time is integer epoch seconds. Every handler runs at "now" and only schedules events at >= now (`_at`), so
  the output is in non-decreasing ``occurred_at`` order. Memory holds the chips, the running and pending jobs
  and one or two future events per job or chip incident: it does not grow with the number of days.
- Every part draws from the one seeded random stream (``rng``) in the order the heap runs them, so the same
  arguments give the same events; the progress reports have their own (``prng``).
- With ``follow``, each emitted event is handed to it at once and the decisions it returns are acted on
  (scheduler.py).
"""

from __future__ import annotations

import heapq
import itertools
import random
from datetime import datetime
from typing import Iterator

from chipledger.sim.scenario.demand import _PROFILES, _TARGET_UTIL, _TEAMS, _Demand
from chipledger.sim.scenario.faults import _Faults
from chipledger.sim.scenario.fleet import _Fleet, _Pool
from chipledger.sim.scenario.scheduler import _Job, _Scheduler
from chipledger.sim.scenario.wire import UTC, _Clock


_heappush = heapq.heappush
_NO_FIELDS: dict = {}


class _Sim(_Fleet, _Demand, _Scheduler, _Faults):
    """The simulation: the parts put together over one heap of future events and one random stream."""

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
