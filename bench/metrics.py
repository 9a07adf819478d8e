"""Benchmark: what feeding /metrics (streams/metrics.py) costs the fold.

    .venv/bin/python bench/metrics.py [--events 200000] [--repeat 5] [--seed 11] [--instructions N]

A seeded scenario (chipledger.scenario, 3 pools, scale 2) is parsed once; then, alternating in one process, the
same events are folded `--repeat` times each way, timed in CPU time (time.process_time):

- **without** (the baseline): what the worker does per record minus its I/O: `Fleet.apply` and the lake rows of
  the step (`streams.rows.step_rows`, grouped by table as the worker sends them);
- **with**: the same plus the worker's hook: two `perf_counter_ns` reads around the fold and
  `MetricsCollector.folded` with the record's tables.

Reported: min and median seconds of each, the ratio with / without (of the mins and of the medians), and the
cost of one scrape (`collect` of every family) at the end, min of 20. Figures go in docs/benchmarks.md.

With `--instructions N`: the same two loops over the first N events, each in its own child process under
`perf stat -e instructions:u` (where the kernel gives a hardware counter) or valgrind's callgrind (total Ir),
plus a `setup` child that only imports and parses the events (bench/replay.py's `count_phases`): a figure the
machine's load does not change. Reported: the instructions of the fold without and with the collector (each
minus setup), their ratio, and the collector's instructions per event.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ledger  # noqa: E402
from chipledger.scenario import generate  # noqa: E402
from ledger import Fleet, FoldConfig  # noqa: E402
from schemas import Rejection, parse_payload  # noqa: E402
from streams.metrics import MetricsCollector, exposition, registry_of  # noqa: E402
from streams.rows import step_rows  # noqa: E402


def fold(events, with_metrics: bool) -> tuple[float, MetricsCollector, Fleet]:
    fleet = Fleet(FoldConfig())
    col = MetricsCollector(fleet.pools, fleet.config)
    apply, perf = fleet.apply, time.perf_counter_ns
    gc.collect()
    t0 = time.process_time()
    for offset, e in enumerate(events):
        if with_metrics:
            t1 = perf()
        step = apply(e)
        if not step.applied:
            continue
        tables: dict[str, list] = {}
        for table, row in step_rows(e, step, "bench", 0, offset):
            tables.setdefault(table, []).append(list(row))
        outputs = [("chipledger.journal", {"origin": None, "tables": tables})]  # as the worker sends them
        if with_metrics:
            col.folded(e.pool, outputs, perf() - t1)
    return time.process_time() - t0, col, fleet


def parsed(seed: int, n: int) -> list:
    events = []
    for d in itertools.islice(generate(seed=seed, days=3650, pools=3, teams=10, scale=2.0), n):
        e = parse_payload(d)
        if not isinstance(e, Rejection):
            events.append(e)
    return events


PHASES = ("setup", "without", "with")


def count_instructions(n: int, seed: int, tool=None) -> dict:
    """Instructions of each phase over the first `n` events, one child process per phase (the module's text).
    Raises RuntimeError when nothing can count instructions here."""
    spec = importlib.util.spec_from_file_location("bench_replay", ROOT / "bench" / "replay.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    tool = tool or replay.instruction_tool()
    if tool is None:
        raise RuntimeError("cannot count instructions: no hardware counter for `perf stat -e instructions` and no "
                           "valgrind (Debian package valgrind; scripts/valgrind.sh ensure)")
    out: dict = {"tool": tool, "core": ledger.CORE}
    out.update(replay.count_phases(tool, PHASES, lambda phase, tmp: [
        sys.executable, str(Path(__file__).resolve()), "--phase-child", phase, str(n), str(seed)]))
    out["fold_without"] = out["without"] - out["setup"]
    out["fold_with"] = out["with"] - out["setup"]
    out["collector"] = out["with"] - out["without"]
    return out


def child_phase(phase: str, n: int, seed: int) -> None:
    events = parsed(seed, n)
    if phase != "setup":
        fold(events, phase == "with")
    print(len(events))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--instructions", type=int, default=0, metavar="N",
                    help="only count instructions without and with the collector over the first N events")
    ap.add_argument("--phase-child", nargs=3, metavar=("PHASE", "N", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase_child:
        phase, n, seed = args.phase_child
        child_phase(phase, int(n), int(seed))
        return 0
    if args.instructions:
        c = count_instructions(args.instructions, args.seed)
        n = c["events"]
        name = {"perf": "perf stat -e instructions:u", "callgrind": "valgrind --tool=callgrind, total Ir"}[c["tool"]]
        print(f"instructions ({name}), first {n:,} events, one child process per phase; ledger core: {c['core']}")
        print(f"  setup (imports, parse the events): {c['setup']:>16,}")
        print(f"  fold without the collector:        {c['fold_without']:>16,}  {c['fold_without'] / n:>9,.0f} per event")
        print(f"  fold with the collector:           {c['fold_with']:>16,}  {c['fold_with'] / n:>9,.0f} per event")
        print(f"  the collector:                     {c['collector']:>16,}  {c['collector'] / n:>9,.0f} per event")
        print(f"  ratio with / without: {c['fold_with'] / c['fold_without']:.4f}")
        return 0
    events = parsed(args.seed, args.events)
    print(f"ledger core: {ledger.CORE}; {len(events):,} events; repeat {args.repeat} (alternating)")
    times = {False: [], True: []}
    for _ in range(args.repeat):
        for w in (False, True):
            s, col, fleet = fold(events, w)
            times[w].append(s)
    lo = {w: min(v) for w, v in times.items()}
    med = {w: statistics.median(v) for w, v in times.items()}
    for w, label in ((False, "without the collector (baseline)"), (True, "with the collector")):
        print(f"{label:34} min {lo[w]:7.3f} s  median {med[w]:7.3f} s  ({len(events) / lo[w]:,.0f} events/s)")
    print(f"ratio with / without: min {lo[True] / lo[False]:.3f}, median {med[True] / med[False]:.3f}")
    reg = registry_of(col, process=False)
    scrape = []
    for _ in range(20):
        t0 = time.perf_counter()
        body = exposition(reg)
        scrape.append(time.perf_counter() - t0)
    print(f"one scrape: {min(scrape) * 1000:.1f} ms (min of 20), {len(body):,} bytes, "
          f"{sum(len(s.teams) for s in fleet.pools.values())} teams in {len(fleet.pools)} pools")
    return 0


if __name__ == "__main__":
    sys.exit(main())
