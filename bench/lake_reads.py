"""Ad-hoc SQL as `chipledger sql` runs it, over one lake read three ways (docs/benchmarks-history.md, "Lake commits"):

    .venv/bin/python bench/lake_reads.py LAKE --code /work/main --mode glob   # an earlier checkout: globs per table
    .venv/bin/python bench/lake_reads.py LAKE --mode listed                   # the committed files, read_parquet
    .venv/bin/python bench/lake_reads.py LAKE --mode ro                       # the committed files through Arrow

A plain connection (no materialized intermediates), then four queries; the minimum of `--repeat` passes of each, CPU
(all threads) and wall seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

QUERIES = {
    "journal sum": "SELECT count(*), sum(amount_mchip_s) FROM journal",
    "jobs": "SELECT count(*), sum(allocated_mchip_s) FROM jobs",
    "goodput teams": "SELECT * FROM goodput WHERE level = 'team'",
    "waits by team": "SELECT pool, team, count(*), avg(epoch(ended_at) - epoch(began_at)) FROM waits GROUP BY ALL",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lake", type=Path)
    ap.add_argument("--mode", choices=("glob", "listed", "ro"), default="listed")
    ap.add_argument("--code", type=Path, default=Path(__file__).resolve().parents[1],
                    help="the checkout whose analytics.views to use (glob: one from before commits)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(args.code))
    from analytics.views import connect

    best: dict[str, tuple[float, float]] = {}

    def timed(name, fn):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        best[name] = min(best.get(name, (9e9, 9e9)), (time.process_time() - c0, time.perf_counter() - w0))
        return out

    for _ in range(args.repeat):
        con = timed("connect", lambda: connect(args.lake, read_only=True) if args.mode == "ro" else connect(args.lake))
        for name, q in QUERIES.items():
            timed(name, lambda: con.execute(q).fetchall())
        con.close()
    print(args.mode, "  ".join(f"{k}: {c:.2f} CPU s ({w:.2f} s)" for k, (c, w) in best.items()))


if __name__ == "__main__":
    main()
