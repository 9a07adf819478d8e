"""The faults: chips fail, degrade, go through maintenance and are retired, and the jobs on them suffer.

- A chip goes down about every 60 days (sometimes a whole node drops off) and is back after 1-12 h; one or two
  chips of the scenario are retired instead of repaired. A job on a chip that goes down fails, or (preemptible)
  is preempted, a little later.
- A chip degrades about every 90 days, for 2-48 h (the jobs reporting progress on it slow down).
- Each node gets planned maintenance about every 45 days, at night on a weekday, a node at a time: the jobs on
  it are evicted (preempted, or failed when not preemptible).
- Every rate is multiplied by ``failure_scale``.
"""

from __future__ import annotations

from chipledger.sim.scenario.fleet import _STATE_NAMES, DEGRADED, DOWN, HEALTHY, MAINT, RETIRED, _Pool
from chipledger.sim.scenario.scheduler import RUNNING, _Job


_DOWN_REASONS_GPU = ("xid 79: GPU has fallen off the bus", "uncorrectable ECC error", "NVLink error",
                     "HBM row remap failure", "PCIe link down")
_DOWN_REASONS_TPU = ("ICI link down", "HBM uncorrectable error", "TPU runtime hang", "host kernel panic")
_DEGRADED_REASONS = ("correctable ECC errors above threshold", "thermal throttling",
                     "interconnect bandwidth degraded", "fan speed alarm")
_MAINT_REASONS = ("planned: driver upgrade", "planned: firmware update", "planned: kernel security patch",
                  "planned: cooling service")


class _Faults:
    """The faults' part of the simulation (mixed into engine._Sim): chip incidents and their jobs."""

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
