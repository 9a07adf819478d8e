"""Speed of `chipledger backtest` on the real Alibaba openb trace (a month of activity, 6,212 GPUs).

    .venv/bin/python bench/backtest.py [--trace ../shared/traces/alibaba-gpu-v2023-openb] [--repeat 3]

Imports the trace to event JSONL once, then times (best and median of --repeat, wall clock):
reading the log into the demand (`load_demand`), and the replay per configuration (`run_backtest`): the
defaults with no quota, and quotas qos/ls=300, qos/be=50 per pool with the default policy. Target: ≤ 10 s per
configuration.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chipledger.sim.backtest import load_demand, parse_quota, run_backtest  # noqa: E402
from chipledger.adapters.importers.alibaba_openb import import_alibaba_openb  # noqa: E402
from ledger import FoldConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", type=Path, default=ROOT.parent / "shared" / "traces" / "alibaba-gpu-v2023-openb")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        events = Path(tmp) / "openb.jsonl"
        import_alibaba_openb(args.trace, events)
        loads = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            demand = load_demand(events)
            loads.append(time.perf_counter() - t0)
        span = (max(j.submitted for j in demand.jobs) - demand.start) / 86400
        busy = sorted(j.submitted for j in demand.jobs)
        days99 = (busy[-1] - busy[len(busy) // 100]) / 86400
        chips = sum(p[0] for p in demand.pools.values())
        print(f"openb: {len(demand.jobs):,} jobs, {chips:,} chips in {len(demand.pools)} pools, {span:.0f} days "
              f"(99% of the jobs within the last {days99:.1f} days)")
        print(f"  read the log: min {min(loads):.2f} s, median {statistics.median(loads):.2f} s")
        fold = replace(FoldConfig(), policy_rows=False)
        for name, quotas in (("defaults, no quota", {}),
                             ("quota qos/ls=300, qos/be=50", parse_quota("qos/ls=300,qos/be=50", demand.pools))):
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                r = run_backtest(demand, fold, quotas)
                times.append(time.perf_counter() - t0)
            print(f"  replay, {name}: min {min(times):.2f} s, median {statistics.median(times):.2f} s "
                  f"({r['events_folded']:,} events folded, {r['preemptions']} preemptions; target <= 10 s)")


if __name__ == "__main__":
    main()
