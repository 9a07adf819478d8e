"""``python -m chipledger.sim.scenario``: write a seeded fleet scenario as JSONL and report the speed."""

from __future__ import annotations

import json
from datetime import datetime

from chipledger.sim.scenario import corrupt, generate, iter_jsonl


def _main(argv=None) -> int:
    import argparse
    import sys
    import time

    ap = argparse.ArgumentParser(prog="python -m chipledger.sim.scenario",
                                 description="Write a seeded fleet scenario as JSONL and report the speed.")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--days", type=float, default=14)
    ap.add_argument("--pools", type=int, default=3)
    ap.add_argument("--teams", type=int, default=10)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--start", default="2026-11-02T00:00:00Z")
    ap.add_argument("--out", help="JSONL path (omit to only count and time generation)")
    ap.add_argument("--corrupt-every", type=int, default=0, help="insert a bad line about every N lines")
    args = ap.parse_args(argv)
    start = datetime.fromisoformat(args.start)
    events = generate(args.seed, args.days, start, args.pools, args.teams, args.scale)
    t0 = time.perf_counter()
    if args.out:
        lines = (s + "\n" for s in iter_jsonl(events))
        if args.corrupt_every:
            lines = corrupt(lines, args.seed, args.corrupt_every)
        n = 0
        with open(args.out, "w", encoding="utf-8") as fh:
            for s in lines:
                fh.write(s)
                n += 1
    else:
        counts: dict[str, int] = {}
        n = 0
        for ev in events:
            n += 1
            counts[ev["type"]] = counts.get(ev["type"], 0) + 1
        print(json.dumps(counts, sort_keys=True), file=sys.stderr)
    dt = time.perf_counter() - t0
    print(f"{n} lines in {dt:.2f}s ({n / dt:,.0f}/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
