"""When will my job start: an estimate with its basis, like `squeue --start`, never a promise.

`estimate_start` is pure: from the chips free now, the running jobs' expected ends and the queue ahead of the job
(the core's order: priority, then longest waiting), it walks time forward without backfill: each job ahead starts
when enough chips are free (and then holds them for its own expected runtime); the job's estimate is when its turn
comes and its chips are free. Expected runtimes: the producer's `expected_runtime_s` on `job.submitted`, else the
median run length of the team's jobs of that size in the pool, else of the pool's, else unknown (then no estimate).
It ignores quota (a job over its team's borrowing limit may wait longer) and jobs submitted later with a higher
priority: the basis says so.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Running:
    chips_milli: int
    expected_end_s: Optional[int]     # None: unknown


@dataclass(frozen=True)
class Waiting:
    job_id: str
    chips_milli: int
    expected_runtime_s: Optional[int]


@dataclass(frozen=True)
class Estimate:
    start_s: Optional[int]            # None: cannot be estimated (an unknown runtime ahead, or too large for the pool)
    basis: str


def estimate_start(now_s: int, free_milli: int, running: list[Running], ahead: list[Waiting], job: Waiting,
                   capacity_milli: int) -> Estimate:
    if job.chips_milli > capacity_milli:
        return Estimate(None, f"it asks for more chips than the pool has available ({capacity_milli / 1000:g})")
    ends: list[tuple[int, int]] = []
    unknown = 0
    for r in running:
        if r.expected_end_s is None:
            unknown += 1
        else:
            heapq.heappush(ends, (max(r.expected_end_s, now_s), r.chips_milli))
    free = free_milli
    t = now_s
    for i, w in enumerate([*ahead, job]):
        while free < w.chips_milli:
            if not ends:
                why = (f"{unknown} running job(s) without an expected end" if unknown else
                       "the chips ahead of it never free up")
                return Estimate(None, f"no estimate: {why}")
            t, chips = heapq.heappop(ends)
            free += chips
            while ends and ends[0][0] == t:
                free += heapq.heappop(ends)[1]
        if w is job:
            break
        if w.expected_runtime_s is None:
            # by its place in the queue, never its id: the job ahead may be another team's (ids of other teams'
            # jobs are not shown to members)
            return Estimate(None, f"no estimate: the {_ordinal(i + 1)} job in the pool's queue, ahead of it, has no "
                                  f"expected runtime")
        free -= w.chips_milli
        heapq.heappush(ends, (t + w.expected_runtime_s, w.chips_milli))
    ahead_chips = sum(w.chips_milli for w in ahead) / 1000
    basis = (f"{len(ahead)} job(s) ahead in the pool's queue needing {ahead_chips:g} chips, {free_milli / 1000:g} "
             f"chips free now, {len(running)} running job(s) ending as expected"
             + (f" ({unknown} without an expected end, left out)" if unknown else "")
             + "; quota limits and later higher-priority jobs may delay it")
    return Estimate(t, basis)



def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
