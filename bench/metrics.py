"""Benchmark: what /metrics (streams/metrics.py) costs the worker's fold.

    .venv/bin/python bench/metrics.py [--events 200000] [--repeat 5] [--seed 11] [--batch 100]
                                      [--scrape-every 10000] [--instructions N] [--phases setup,fold,without,with]

A seeded scenario (chipledger.sim.scenario, 3 pools, scale 2) is parsed once; then, alternating in one process, the
same events are folded `--repeat` times each way, timed in CPU time (time.process_time):

- **without** (the baseline): what the worker does per record minus its I/O, with no /metrics: `Fleet.apply` and
  the lake rows of the step (`streams.rows.step_rows`, grouped by table as the worker sends them), in drains of
  `--batch` records;
- **with**: the same with /metrics: the worker's two `perf_counter_ns` reads around each drain and
  `MetricsCollector.fold_batch`, and a scrape (`exposition` of every family, as Prometheus gets it) every
  `--scrape-every` events. The counters are kept by the core in both (they are part of the fold); the collector
  does nothing per record.

A realistic scrape rate: Prometheus scrapes every 15 s by default; at the worker's 4,700–7,500 events/s of CPU
(bench/stream.py, docs/benchmarks.md) that is one scrape per 70,000–110,000 events. The default, one per 10,000,
scrapes about ten times more often than that.

Reported: min and median seconds of each, the ratio with / without (of the mins and of the medians), and the
cost of one scrape at the end, min of 20. Figures go in docs/benchmarks.md.

With `--instructions N`: the phases over the first N events, each in its own child process under
`perf stat -e instructions:u` (where the kernel gives a hardware counter) or valgrind's callgrind (total Ir): a
figure the machine's load does not change. `setup` imports every module the phases use (the scrape's too) and
parses the events, `fold` runs `Fleet.apply` alone (what the core's counters cost is this phase before and after
them), `without` and `with` the loops above, but `with` without a scrape, and `scrapes` is `with` plus
10 scrapes at even intervals: the cost of one scrape is (scrapes − with) / 10. Reported: each
phase minus setup, per event; what /metrics costs per event (with − without, plus one scrape per 10,000 and per
100,000 events); the ratio with / without at one scrape per `--scrape-every` events.
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
from chipledger.sim.scenario import generate  # noqa: E402
from ledger import Fleet, FoldConfig  # noqa: E402
from schemas import Rejection, parse_payload  # noqa: E402
from streams.metrics import MetricsCollector, exposition, registry_of  # noqa: E402
from streams.rows import step_rows  # noqa: E402
# what a scrape imports (the store's balance functions, the core's pending reasons): in every phase's setup
import store.repo  # noqa: E402,F401


def fold(events, with_metrics: bool, batch: int = 100, scrape_every: int = 10_000):
    """The worker's path over `events` in drains of `batch` records, with or without /metrics. Returns (CPU
    seconds, the collector or None, the fleet, scrapes made)."""
    fleet = Fleet(FoldConfig())
    col = reg = None
    if with_metrics:
        col = MetricsCollector(fleet.pools, fleet.config)
        reg = registry_of(col, process=False)
    apply, perf = fleet.apply, time.perf_counter_ns
    scrapes = 0
    gc.collect()
    t0 = time.process_time()
    for start in range(0, len(events), batch):
        if with_metrics:
            t1 = perf()
        for offset in range(start, min(start + batch, len(events))):
            e = events[offset]
            step = apply(e)
            if not step.applied:
                continue
            tables: dict[str, list] = {}
            for table, row in step_rows(e, step, "bench", 0, offset):
                tables.setdefault(table, []).append(list(row))
            _ = [("chipledger.journal", {"origin": None, "tables": tables})]  # as the worker sends them
        if with_metrics:
            col.fold_batch(min(batch, len(events) - start), perf() - t1)
            if scrape_every and (start + batch) // scrape_every != start // scrape_every:
                exposition(reg)
                scrapes += 1
    return time.process_time() - t0, col, fleet, scrapes


def fold_alone(events) -> Fleet:
    fleet = Fleet(FoldConfig())
    apply = fleet.apply
    for e in events:
        apply(e)
    return fleet


def parsed(seed: int, n: int) -> list:
    events = []
    for d in itertools.islice(generate(seed=seed, days=3650, pools=3, teams=10, scale=2.0), n):
        e = parse_payload(d)
        if not isinstance(e, Rejection):
            events.append(e)
    return events


PHASES = ("setup", "fold", "without", "with", "scrapes")
SCRAPES_COUNTED = 10


def count_instructions(n: int, seed: int, tool=None, phases=PHASES, batch: int = 100,
                       scrape_every: int = 10_000) -> dict:
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
    out.update(replay.count_phases(tool, phases, lambda phase, tmp: [
        sys.executable, str(Path(__file__).resolve()), "--phase-child", phase, str(n), str(seed), str(batch),
        str(scrape_every)]))
    for phase in ("fold", "without", "with", "scrapes"):
        if phase in out:
            out[f"{phase}_net"] = out[phase] - out["setup"]
    if "with" in out and "without" in out:
        out["metrics"] = out["with"] - out["without"]  # what /metrics costs the worker's path, scrapes aside
    if "scrapes" in out and "with" in out:
        out["scrape"] = (out["scrapes"] - out["with"]) // SCRAPES_COUNTED  # one scrape
    return out


def child_phase(phase: str, n: int, seed: int, batch: int, scrape_every: int) -> None:
    events = parsed(seed, n)
    if phase == "fold":
        fold_alone(events)
    elif phase == "scrapes":
        fold(events, True, batch, -(-len(events) // SCRAPES_COUNTED))
    elif phase != "setup":
        fold(events, phase == "with", batch, 0)
    print(len(events))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--batch", type=int, default=100, help="records per drain (one fold_batch each)")
    ap.add_argument("--scrape-every", type=int, default=10_000, metavar="EVENTS", help="one scrape per this many events")
    ap.add_argument("--instructions", type=int, default=0, metavar="N",
                    help="only count instructions of the phases over the first N events")
    ap.add_argument("--phases", default=",".join(PHASES), help="with --instructions: which phases (setup is needed)")
    ap.add_argument("--phase-child", nargs=5, metavar=("PHASE", "N", "SEED", "BATCH", "SCRAPE_EVERY"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase_child:
        phase, n, seed, batch, every = args.phase_child
        child_phase(phase, int(n), int(seed), int(batch), int(every))
        return 0
    if args.instructions:
        phases = tuple(p for p in args.phases.split(",") if p)
        if "setup" not in phases or not set(phases) <= set(PHASES):
            ap.error(f"--phases: a comma-separated subset of {','.join(PHASES)} with setup")
        c = count_instructions(args.instructions, args.seed, phases=phases, batch=args.batch,
                               scrape_every=args.scrape_every)
        n = c["events"]
        name = {"perf": "perf stat -e instructions:u", "callgrind": "valgrind --tool=callgrind, total Ir"}[c["tool"]]
        print(f"instructions ({name}), first {n:,} events, one child process per phase; ledger core: {c['core']}; "
              f"drains of {args.batch}, a scrape every {args.scrape_every:,} events")
        print(f"  setup (imports, parse the events): {c['setup']:>16,}")
        for phase, label in (("fold", "fold alone (Fleet.apply)"), ("without", "worker path without /metrics"),
                             ("with", "worker path with /metrics, no scrape"),
                             ("scrapes", f"the same with {SCRAPES_COUNTED} scrapes")):
            if phase in c:
                v = c[f"{phase}_net"]
                print(f"  {label + ':':<40}{v:>16,}  {v / n:>9,.0f} per event")
        if "metrics" in c:
            print(f"  /metrics without its scrapes (with - without): {c['metrics']:>14,}  {c['metrics'] / n:>9,.1f} "
                  f"per event")
        if "scrape" in c:
            print(f"  one scrape: {c['scrape']:,} instructions")
        if "metrics" in c and "scrape" in c:
            for every in sorted({args.scrape_every, 10_000, 100_000}):
                per = c["metrics"] / n + c["scrape"] / every
                print(f"  /metrics with a scrape every {every:,} events: {per:,.1f} per event, ratio with / without "
                      f"{1 + per * n / c['without_net']:.4f}")
        return 0
    events = parsed(args.seed, args.events)
    print(f"ledger core: {ledger.CORE}; {len(events):,} events; repeat {args.repeat} (alternating); drains of "
          f"{args.batch}, a scrape every {args.scrape_every:,} events")
    times = {False: [], True: []}
    for _ in range(args.repeat):
        for w in (False, True):
            s, col, fleet, scrapes = fold(events, w, args.batch, args.scrape_every)
            times[w].append(s)
    lo = {w: min(v) for w, v in times.items()}
    med = {w: statistics.median(v) for w, v in times.items()}
    for w, label in ((False, "without /metrics (baseline)"), (True, f"with /metrics ({scrapes} scrapes)")):
        print(f"{label:34} min {lo[w]:7.3f} s  median {med[w]:7.3f} s  ({len(events) / lo[w]:,.0f} events/s)")
    print(f"ratio with / without: min {lo[True] / lo[False]:.3f}, median {med[True] / med[False]:.3f}")
    from streams.metrics import exposition, registry_of

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
