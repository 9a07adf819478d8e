"""The scheduler's actions: the queue, admission, the scheduling passes, the runs of jobs and what they report,
preemption, and (following the ledger) acting on its decisions.

- The queue is a priority queue (higher priority first, then submission order), one heap per job size, served
  best-effort: a job that does not fit is skipped (like Kueue's BestEffortFIFO). A team with a borrowing limit
  is not admitted beyond nominal + limit (+ its open bursts): its jobs are parked until its use drops.
- A run takes its chips, ends at its job's end (or failure), checkpoints every ``ckpt_iv``; a preempted job
  loses the work since its last checkpoint and comes back to the queue after a backoff.
- With ``progress``, a training job reports its cumulative steps at each start and every ``PROGRESS_IV_S``,
  at half speed while it holds a degraded chip (its own random stream, ``prng``).
- On its own, the scheduler reclaims: a job that fits its team's unused quota while other teams borrow makes
  it preempt borrowers' preemptible jobs after a short grace period; a priority >= 1000 job preempts
  lower-priority jobs of its own team. Following the ledger (``follow``), it does neither: it preempts the
  victims of each ``decision.preempt`` (naming the decision, after a cooperative checkpoint) and starts the
  beneficiary, and runs a burst's jobs only for the chips a ``decision.burst`` granted.
"""

from __future__ import annotations

import heapq
import itertools
import math

from chipledger.sim.scenario.fleet import _FRACTION_UNIT, DEGRADED, DOWN, _Pool, _shift_node


# job states (internal)
PENDING, RUNNING, DONE = range(3)
PROGRESS_IV_S = 900    # a training job reports its steps this often (with ``progress``)
DEGRADED_SPEED = 0.5   # the share of its speed a job keeps while it holds a degraded chip


class _Job:
    """A job as the cluster sees it; its `token` changes at each start and stop, voiding the timers set before."""

    __slots__ = ("id", "pool", "team", "milli", "prio", "preemptible", "work", "done", "run_start",
                 "run_done0", "run_end", "ckpt_t", "ckpt_iv", "fail_at", "outcome", "state", "token",
                 "chips", "seq", "queued", "parked", "n_preempt", "placement", "reclaim_t",
                 "prog", "spd", "units", "units_t", "units_ckpt", "slow")


class _Scheduler:
    """The scheduler's part of the simulation (mixed into engine._Sim): queue, passes, runs, preemption."""

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
