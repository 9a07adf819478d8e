"""Benchmark: quota statements for 1,000 teams × one month from a generated lake of ~10M job events.

    .venv/bin/python bench/statements.py [--events 10000000] [--teams 1000] [--workers 2] [--out DIR] [--reuse]

The lake is generated directly (as bench/analytics.py does, with `--teams` teams instead of its dozen),
because a fold of 10M events takes minutes. Timed, in one process:
1. the baseline: the month's journal totals per team and account written as one JSON file per team (one
   DuckDB aggregate plus orjson: the least a statement is);
2. `chipledger statements --period <the lake's last closed month>` for every team, in all four formats
   (md, html, csv, json; a chart per team), with `--workers` rendering processes.
Target: 2. in <= 60 s on this 2-core machine. Prints both times and their ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _analytics_bench():
    spec = importlib.util.spec_from_file_location("bench_analytics", ROOT / "bench" / "analytics.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def baseline(lake: Path, start: datetime, end: datetime, out: Path) -> int:
    import orjson

    from analytics.views import connect
    from chipledger.reports.statements import file_stem

    con = connect(lake)
    rows = con.execute("""
        SELECT team, account, sum(amount_mchip_s)::BIGINT FROM journal_postings
        WHERE team IS NOT NULL AND hour >= ? AND hour < ? GROUP BY ALL ORDER BY ALL""", [start, end]).fetchall()
    con.close()
    per_team: dict[str, dict] = {}
    for team, account, amount in rows:
        per_team.setdefault(team, {})[f"{account}_mchip_s"] = int(amount)
    out.mkdir(parents=True, exist_ok=True)
    for team, totals in per_team.items():
        (out / f"{file_stem(team)}.json").write_bytes(orjson.dumps(totals, option=orjson.OPT_SORT_KEYS))
    return len(per_team)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--teams", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("/tmp/chipledger-bench-statements"))
    ap.add_argument("--reuse", action="store_true", help="reuse the lake of an earlier run with the same --out")
    args = ap.parse_args()

    from chipledger.reports.statements import FORMATS, issue

    lake = args.out / "lake"
    if not (args.reuse and lake.is_dir()):
        gen = _analytics_bench()
        gen.TEAMS = tuple(f"org-{i % 20:02d}/team-{i:04d}" for i in range(args.teams))
        shutil.rmtree(args.out, ignore_errors=True)
        t = time.perf_counter()
        counts = gen.generate(args.out, args.events)
        print(f"generated lake: {counts} in {time.perf_counter() - t:.1f} s -> {lake}")
    # the last month whose books are closed: the statements a monthly run issues
    from chipledger.reports.statements import books_closed_through_files, closed_periods

    first_hour = datetime.fromtimestamp(_analytics_bench().T0, timezone.utc)
    period = closed_periods("month", first_hour, min(books_closed_through_files(lake).values()))[-1]

    for d in ("baseline", "statements"):
        shutil.rmtree(args.out / d, ignore_errors=True)
    t = time.perf_counter()
    n_base = baseline(lake, period.start, period.end, args.out / "baseline")
    base_s = time.perf_counter() - t

    t = time.perf_counter()
    issued = issue(lake, period, args.out / "statements", formats=FORMATS, workers=args.workers)
    full_s = time.perf_counter() - t
    files = sum(len(i.files) for i in issued)
    size = sum(p.stat().st_size for i in issued for p in i.files)

    print(f"\nperiod {period.label}, {len(issued):,} teams ({n_base:,} with journal rows), "
          f"{args.workers} rendering process(es)")
    print(f"  baseline (journal totals per team as JSON): {base_s:7.2f} s")
    print(f"  statements, all formats ({files:,} files, {size / 2**20:.0f} MiB): {full_s:7.2f} s  "
          f"({full_s / max(len(issued), 1) * 1000:.1f} ms per team)  target <= 60 s: "
          f"{'met' if full_s <= 60 else 'NOT met'}")
    print(f"  ratio statements / baseline: {full_s / base_s:.1f}x")


if __name__ == "__main__":
    main()
