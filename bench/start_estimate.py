"""How good is the portal's "when will my job start" (chipledger/web/estimate.py)? Each job's estimate is made at its
submission, from what was known then (the running jobs and their expected ends, the queue ahead), and compared with
its real first start: median and p90 of |estimate − start|, over every job and over the jobs that waited.

    python bench/start_estimate.py EVENTS.jsonl [--seed 1] [--json OUT]

Methods, side by side (each the same walk of `estimate_start`, only the runtimes differ):
- `expected`: the producer's `expected_runtime_s`; a job without one uses the median runtime so far of its team's
  jobs of that size (else of the pool's): what the portal does;
- `history`: the medians only (no producer estimate);
- `time_limit`: the naive method of `squeue --start`: every job runs to its time limit.
When the events carry no `expected_runtime_s` (the demo's), it is made from the job's real runtime times a
log-normal error (σ = 0.5, seeded: a user's guess), or with `--given trace` exactly the job's real run length from
the trace (deletion − scheduling for openb: a perfect producer, the method's best case; jobs without an end keep
the history fallback), and the time limit is twice the real runtime rounded up to 1, 2,
4, 8, 24 or 72 hours (what users ask Slurm for). Capacity: the chips registered (health changes are not followed).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import defaultdict
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chipledger.web.estimate import Running, Waiting, estimate_start  # noqa: E402

LIMITS_H = (1, 2, 4, 8, 24, 72)


def _t(s: str) -> int:
    return int(datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp())


def _pct(values: list[int], q: float):
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(math.ceil(q * len(v))) - 1)]


def measure(events_path: Path, seed: int = 1, given_from: str = "noisy") -> dict:
    events = []
    for line in events_path.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue  # the demo's deliberately broken lines (the ledger dead-letters them too)
        if isinstance(e, dict) and isinstance(e.get("pool"), str) and isinstance(e.get("occurred_at"), str):
            events.append(e)
    # pass 1 (for the synthetic producer estimates only): each job's real first run length and first start
    first_start, first_end, subs = {}, {}, {}
    for e in events:
        k = (e["pool"], e.get("job_id"))
        if e.get("type") not in ("job.submitted", "job.started", "job.finished", "job.preempted"):
            continue
        if e["type"] == "job.submitted":
            subs[k] = e
        elif e["type"] == "job.started" and k not in first_start:
            first_start[k] = _t(e["occurred_at"])
        elif e["type"] in ("job.finished", "job.preempted") and k in first_start and k not in first_end:
            first_end[k] = _t(e["occurred_at"])
    rng = random.Random(seed)
    given, limit = {}, {}
    for k, e in subs.items():
        real = first_end.get(k, first_start.get(k, 0) + 3600) - first_start.get(k, 0) if k in first_start else 3600
        real = max(real, 60)
        if e.get("expected_runtime_s"):
            given[k] = e["expected_runtime_s"]
        else:
            noisy = max(60, int(real * math.exp(rng.gauss(0, 0.5))))  # drawn in both modes: the same draws
            if given_from == "noisy":
                given[k] = noisy
            elif k in first_end:  # "trace": the real run length, where the trace has an end
                given[k] = real
        limit[k] = next((h * 3600 for h in LIMITS_H if h * 3600 >= 2 * real), 2 * real)
    # pass 2: walk the events; at each submission estimate the start with what is known then
    capacity = defaultdict(int)
    running: dict = defaultdict(dict)      # pool -> job -> (chips milli, start s, team)
    pending: dict = defaultdict(dict)      # pool -> job -> (priority, submitted s, chips milli, team)
    history = defaultdict(list)            # (pool, team, chips) -> runtimes so far
    pool_history = defaultdict(list)
    made = {m: {} for m in ("expected", "history", "time_limit")}

    def med(xs):
        return sorted(xs)[len(xs) // 2] if xs else None

    def runtime(method, pool, job, team, chips):
        if method == "time_limit":
            return limit[(pool, job)]
        if method == "expected" and (pool, job) in given:
            return given[(pool, job)]
        return med(history[(pool, team, chips)]) or med(pool_history[pool])

    for e in events:
        try:
            pool, kind, t = e["pool"], e["type"], _t(e["occurred_at"])
        except (KeyError, ValueError):
            continue
        job = e.get("job_id")
        if kind == "chip.registered":
            capacity[pool] += 1000
        elif kind == "chip.retired":
            capacity[pool] -= 1000
        elif kind == "job.submitted":
            if not job or not e.get("team") or not isinstance(e.get("chips"), (int, float)) or job in pending[pool] \
                    or job in running[pool]:
                continue  # an invalid or repeated submission: the ledger rejects it too
            chips = round(e["chips"] * 1000)
            prio = e.get("priority", 0)
            ahead_keys = sorted((-p, s, j) for j, (p, s, c, tm) in pending[pool].items()
                                if (p, -s) >= (prio, -t))
            used = sum(c for c, s, tm in running[pool].values())
            for m in made:
                rs = []
                for j, (c, s, tm) in running[pool].items():
                    rt = runtime(m, pool, j, tm, c)
                    rs.append(Running(c, None if rt is None else max(s + rt, t)))
                ahead = [Waiting(j, pending[pool][j][2], runtime(m, pool, j, pending[pool][j][3], pending[pool][j][2]))
                         for _, _, j in ahead_keys]
                est = estimate_start(t, max(capacity[pool] - used, 0), rs, ahead,
                                     Waiting(job, chips, None), capacity[pool])
                made[m][(pool, job)] = (t, est.start_s)
            pending[pool][job] = (prio, t, chips, e["team"])
        elif kind == "job.started":
            p = pending[pool].pop(job, None)
            if p is not None:
                running[pool][job] = (p[2], t, p[3])
        elif kind in ("job.finished", "job.preempted"):
            r = running[pool].pop(job, None)
            if r is not None:
                history[(pool, r[2], r[0])].append(t - r[1])
                pool_history[pool].append(t - r[1])
            if kind == "job.preempted" and r is not None:
                pending[pool][job] = (0, t, r[0], r[2])  # back in the queue (its restart is not measured)
            if kind == "job.finished":
                pending[pool].pop(job, None)
    out = {"events": str(events_path), "jobs": len(subs), "given": given_from, "methods": {}}
    for m, ests in made.items():
        errs, waited_errs, missing, later = [], [], 0, 0
        for k, (sub, est) in ests.items():
            later += est is not None and est > sub
            if k not in first_start:
                continue
            if est is None:
                missing += 1
                continue
            err = abs(est - first_start[k])
            errs.append(err)
            if first_start[k] - sub > 60:
                waited_errs.append(err)
        out["methods"][m] = {"estimated": len(errs), "no_estimate": missing, "estimated_later_than_now": later,
                             "median_error_s": _pct(errs, 0.5), "p90_error_s": _pct(errs, 0.9),
                             "waited_jobs": len(waited_errs), "waited_median_error_s": _pct(waited_errs, 0.5),
                             "waited_p90_error_s": _pct(waited_errs, 0.9)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("events", type=Path)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--given", choices=("noisy", "trace"), default="noisy",
                    help="without expected_runtime_s in the events: the real runtime × a log-normal error (noisy) "
                         "or the trace's real runtime itself (trace)")
    ap.add_argument("--json", type=Path, help="also write the result here (the portal shows portal-accuracy.json "
                                              "beside its lake)")
    a = ap.parse_args()
    res = measure(a.events, a.seed, a.given)
    e = res["methods"]["expected"]
    n = res["methods"]["time_limit"]
    res["text"] = (f"on {a.events.name}, estimates made at submission were off by a median "
                   f"{e['waited_median_error_s']} s (p90 {e['waited_p90_error_s']} s) for jobs that waited; the "
                   f"time-limit method: {n['waited_median_error_s']} s (p90 {n['waited_p90_error_s']} s)")
    print(json.dumps(res, indent=2))
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
