"""Benchmark: what pricing costs the fold, the per-run facts (`run_costs`) included.

    .venv/bin/python bench/run_costs.py [--days 10] [--seed 7] [--repeat 5] [--events FILE]

The demo's seeded fleet (chipledger/demo.py: a base price and a weekday 09:00–17:59 peak band at 1.6× in every
pool, budgets) is folded, parse excluded, in this process, alternating with the same events without their
`price.set` and `budget.set` (no pool priced: no `costs` and no `run_costs`, the fold as before prices). Each is
folded `--repeat` times; the CPU time of each fold (the process's, garbage collector off while it runs) is taken,
and the min and median printed with their ratio, priced ÷ unpriced: the cost of pricing each journal posting
(ledger/costs.py `price_postings`) and each run as it ends (`run_ended`: its cost, peak seconds and the search for
its off-peak start). The fold runs compiled when `make` built the core for these sources, else as plain Python; it
says which. No target of its own: the figure says what a priced pool costs over an unpriced one.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _events(path: Path, priced: bool) -> list:
    import orjson

    from schemas import Rejection
    from schemas.parse import parse_payload

    out = []
    for line in path.read_bytes().splitlines():
        try:
            e = parse_payload(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
        if isinstance(e, Rejection) or (not priced and e.type in ("price.set", "budget.set")):
            continue
        out.append(e)
    return out


def _fold(events) -> tuple[float, int]:
    from ledger import Fleet, FoldConfig

    fleet = Fleet(FoldConfig())
    gc.collect()
    gc.disable()
    try:
        t = time.process_time()
        runs = 0
        for e in events:
            runs += len(fleet.apply(e).run_costs)
        return time.process_time() - t, runs
    finally:
        gc.enable()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--days", type=float, default=10)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--events", type=Path, default=None, help="a demo file already written (default: write one)")
    args = ap.parse_args()

    import ledger.fold
    from chipledger.demo import write_events

    path = args.events
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="bench-run-costs-")) / "events.jsonl"
        write_events(path, seed=args.seed, days=args.days)
    priced, unpriced = _events(path, True), _events(path, False)
    times: dict[str, list[float]] = {"priced": [], "unpriced": []}
    rows = 0
    for _ in range(args.repeat):  # alternating, so both see the same load
        s, rows = _fold(priced)
        times["priced"].append(s)
        times["unpriced"].append(_fold(unpriced)[0])
    core = "compiled" if ledger.fold.__file__.endswith((".so", ".pyd")) else "plain Python"
    print(f"core: {core}; {len(priced):,} events ({len(priced) - len(unpriced)} price.set/budget.set), "
          f"{rows:,} run_costs rows")
    for k, v in times.items():
        print(f"{k:9s} min {min(v):.3f} s  median {statistics.median(v):.3f} s  "
              f"({len(priced if k == 'priced' else unpriced) / min(v):,.0f} events/s at best)")
    print(f"priced ÷ unpriced: min {min(times['priced']) / min(times['unpriced']):.2f}×, "
          f"median {statistics.median(times['priced']) / statistics.median(times['unpriced']):.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
