"""Benchmark: the embedded fold against parsing + validating the same file alone, in the same run.

    .venv/bin/python bench/replay.py [--events 1000000] [--rss 1000000,5000000] [--out bench/out] [--opcodes N]
                                     [--instructions N [--instructions-from K] [--cache-sim [OPTS]]
                                      [--native-profile RUNS [--native-only]]] [--hol-off] [--inline]

1. Generates a seeded scenario file of N events (scale fixed, days chosen to reach N, so the event rate per
   day stays the same and only the length of history grows).
2. Times, in this process, alternating and keeping the best of `--repeat` runs of each (wall time, and CPU time
   of the process for (a) and (b)): (a) validation only:
   read each line and `parse_event` it (the baseline); (b) parse + `Fleet.apply` (with the embedded run's
   collector: automatic collection off, the young objects collected and frozen every 65,536 lines), from which
   the fold's own
   cost is derived as (b) - (a); (c) the embedded run: `run_file` (parse, fold, lake writes, close of the
   books; the `events` table written by its forked events process), with the CPU time of the run's process and
   of the events process; with `--inline` also (d) the embedded run with the whole lake in its own process
   (`events_process=False`). Prints events/s for each and its ratio to the baseline (targets: the fold alone
   and the embedded run >= 0.5 x the validation-only rate).
3. With `--opcodes N`: the Python opcodes the fold executes per event over N events (after the first 20,000),
   by event type: a count the machine's load does not change, to compare two versions of the fold. Only the
   plain Python core runs opcodes: run it with CHIPLEDGER_PURE_PYTHON=1.

The fold runs compiled (mypyc) when `make` built it, else as plain Python (ledger/_compiled.py); the bench
prints which. CHIPLEDGER_PURE_PYTHON=1 measures the plain Python core.
4. With `--digest N`: folds the first N events of the bench file (no timing) and prints a sha256 over every
   step's outputs in order (each list of `Step.TABLES`: journal rows, job runs, decisions, balances, pending rows,
   the facts; dead letters, and when and how late each event was applied), then the closed books and the final
   state: two versions of the fold
   that print the same digest gave identical outputs.
5. Peak RSS: runs the embedded run on 1M and 5M events, each in a fresh child process, and reports
   ru_maxrss and the pool state sizes (target: memory follows active jobs and chips, not history).
6. With `--instructions N`: instructions executed (user space) over the first N events of the bench file, a
   figure that depends neither on the machine's load nor much on its processor: Linux `perf stat -e
   instructions:u` where the kernel gives a hardware counter, else valgrind's callgrind (total Ir; ~50x slower,
   so keep N in the tens of thousands); it says which. Each phase runs in its own child process on the same
   sample: setup (imports, reading the sample into memory), validate only, parse + fold (+ close), the embedded
   run; the phases' costs are the differences: validation = validate - setup, fold alone = parse + fold -
   validate, lake writer = embedded run - parse + fold (rows, canonical JSON, Arrow, Parquet, close-of-books
   rows). With `--instructions-from K` (callgrind only) the sample is events K..K+N instead, with the pools' state
   folded up to event K first and not counted: the first events of the file cost the fold less than later ones
   (its pools fill with jobs). Only the counted part runs inside `sys.call_tracing`, and callgrind collects only
   there (`--collect-atstart=no --toggle-collect=sys_call_tracing`); validation and the fold are counted, not
   the lake writer. With `--cache-sim` (callgrind only) callgrind also simulates the caches and the bench prints
   each phase's data reads and writes and its first- and last-level data cache misses per event (the caches it
   simulates are valgrind's reading of the processor unless given, e.g. `--cache-sim='--D1=32768,8,64
   --LL=1048576,8,64'`: a KVM guest can report a nonsense last level, here a 256 MiB direct-mapped one; with
   `--branch-sim=yes` among them, the conditional and indirect branches and their mispredictions too). With
   `--native-profile RUNS` (and `--instructions N --instructions-from K` for the events; `--native-only` skips the
   counts) validation and parse + fold run RUNS times each, alternating, under `perf record -e cpu-clock` (a
   software clock: no hardware counter needed), sampled only inside the counted region: their native CPU time per
   event and per symbol, for setting beside the instructions (where the time per instruction differs).
7. With `--gc-time`: one more parse + fold and embedded run after the timed ones, with the cyclic garbage
   collector's passes in this process timed (gc.callbacks): their count per generation and their share of the CPU.
8. With `--hol-off`: the fold is also timed (alternating with the others) and, with `--instructions`, counted with
   `[ledger] hol_blocking = false`, and the cost of head-of-line blocking printed as the ratio of the fold alone
   with it to the fold alone without it (CPU time and instructions).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCALE = 4.0
SEED = 11


def events_per_day() -> float:
    from chipledger.sim.scenario import generate

    n = sum(1 for _ in generate(seed=SEED, days=7, scale=SCALE))
    return n / 7


def make_file(path: Path, n: int, per_day: float) -> int:
    from chipledger.sim.scenario import generate, write_jsonl

    days = n / per_day * 1.05 + 1
    return write_jsonl(islice(generate(seed=SEED, days=days, scale=SCALE), n), path)


def time_validate(path: Path) -> tuple[float, int, float]:
    """(wall seconds, lines, CPU seconds of this process)."""
    from schemas import parse_event

    c0 = time.process_time()
    t0 = time.perf_counter()
    n = 0
    with open(path, "rb") as f:
        for line in f:
            parse_event(line)
            n += 1
    return time.perf_counter() - t0, n, time.process_time() - c0


def time_fold(path: Path, hol_blocking: bool = True) -> tuple[float, int, float]:
    """(wall seconds, lines, CPU seconds of this process)."""
    from chipledger.embedded import GC_FREEZE_MASK, GcPause
    from ledger import Fleet, FoldConfig
    from schemas import Rejection, parse_event

    fleet = Fleet(FoldConfig(hol_blocking=hol_blocking))
    with GcPause() as paused:  # the collector as the embedded run has it
        c0 = time.process_time()
        t0 = time.perf_counter()
        n = 0
        with open(path, "rb") as f:
            for line in f:
                n += 1
                if not n & GC_FREEZE_MASK:
                    paused.checkpoint()
                e = parse_event(line)
                if not isinstance(e, Rejection):
                    fleet.apply(e, line)
        fleet.close()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dt, n, cpu


class GcTimer:
    """With `--gc-time`: the cyclic collector's passes in this process (gc.callbacks) while a phase runs: count per
    generation and seconds inside them (a callback per pass costs ~1 µs: the timed passes are not used for the
    phase's figures)."""

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.seconds = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.passes[info["generation"]] += 1

    def measure(self, fn, *args, **kwargs):
        import gc

        gc.callbacks.append(self)
        try:
            return fn(*args, **kwargs)
        finally:
            gc.callbacks.remove(self)


def time_embedded(path: Path, lake: Path, events_process: bool = True) -> tuple[float, dict, dict]:
    """(wall seconds, the run's summary, the state's sizes and "cpu_s" / "events_cpu_s": CPU seconds of the
    run's process and of the events process it forks)."""
    from chipledger.embedded import run_file

    before = os.times()
    t0 = time.perf_counter()
    summary, fleet = run_file(path, lake, overwrite=True, events_process=events_process)
    dt = time.perf_counter() - t0
    after = os.times()
    state = {
        "pools": len(fleet.pools),
        "chips": sum(len(s.chips) for s in fleet.pools.values()),
        "active_jobs": sum(len(s.jobs) for s in fleet.pools.values()),
        "dedup_ids": sum(len(s.dedup) for s in fleet.pools.values()),
        "accounts": sum(len(s.books.accounts) for s in fleet.pools.values()),
        "cpu_s": after.user + after.system - before.user - before.system,
        "events_cpu_s": after.children_user + after.children_system - before.children_user - before.children_system,
    }
    return dt, summary.as_dict(), state


def count_opcodes(path: Path, skip: int, n: int) -> tuple[float, dict]:
    """Python opcodes the fold executes per event (Fleet.apply and everything it calls), over the events
    skip..skip+n of the file after folding the first `skip` untraced: a figure the machine's load does not move,
    for comparing two versions of the fold. Returns (opcodes per event, {event type: opcodes per event})."""
    from ledger import Fleet
    from schemas import Rejection, parse_event

    fleet = Fleet()
    events = []
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if i >= skip + n:
                break
            e = parse_event(line)
            if isinstance(e, Rejection):
                continue
            if i < skip:
                fleet.apply(e, line)
            else:
                events.append((e, line))
    count = [0]

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            count[0] += 1
        return tracer

    by_type: dict = {}
    sys.settrace(tracer)
    try:
        for e, line in events:
            c0 = count[0]
            fleet.apply(e, line)
            t = by_type.setdefault(e.type, [0, 0])
            t[0] += count[0] - c0
            t[1] += 1
    finally:
        sys.settrace(None)
    total = sum(t[0] for t in by_type.values())
    return total / max(len(events), 1), {k: v[0] / v[1] for k, v in by_type.items()}


PHASES = ("setup", "validate", "fold", "embedded", "embedded_inline")
HOL_OFF_PHASE = "fold_hol_off"  # the fold with [ledger] hol_blocking = false (--hol-off)


def instruction_tool() -> Optional[str]:
    """'perf' when `perf stat` can count instructions here (a hardware counter the kernel lets us read; not on
    most virtual machines), else 'callgrind' when valgrind is installed, else None."""
    if shutil.which("perf"):
        try:
            p = subprocess.run(["perf", "stat", "-x,", "-e", "instructions:u", "true"], capture_output=True,
                               text=True, timeout=30)
            if p.returncode == 0 and _perf_count(p.stderr) is not None:
                return "perf"
        except (OSError, subprocess.TimeoutExpired):
            pass
    if shutil.which("valgrind"):
        return "callgrind"
    return None


def _perf_count(text: str) -> Optional[int]:
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2].startswith("instructions") and fields[0].strip().isdigit():
            return int(fields[0])
    return None


def _callgrind_count(text: str) -> Optional[int]:
    m = re.search(r"Collected\s*:\s*([0-9]+)", text)
    return int(m.group(1)) if m else None


def _callgrind_events(text: str) -> dict:
    """{event: count} from a callgrind log's "Events :" and "Collected :" lines (Ir alone, or with --cache-sim=yes
    also Dr, Dw, I1mr, D1mr, D1mw, ILmr, DLmr, DLmw: reads, writes and the misses of the first-level and last-level
    caches callgrind simulates)."""
    names = re.search(r"Events\s*:\s*([A-Za-z0-9 ]+)", text)
    values = re.search(r"Collected\s*:\s*([0-9 ]+)", text)
    if not names or not values:
        return {}
    return dict(zip(names.group(1).split(), (int(v) for v in values.group(1).split())))


# callgrind collects only inside `sys.call_tracing` (the C function sys_call_tracing), where a child counting a
# later sample runs its counted part (--instructions-from)
CALLGRIND_REGION = ("--collect-atstart=no", "--toggle-collect=sys_call_tracing")
# ...and, when a C compiler and valgrind's headers are here, instruments nothing before it: the child calls
# CALLGRIND_START_INSTRUMENTATION (a client request, through a small library built for the run) right before the
# region, so the fold of the events before the sample runs ~10x faster under valgrind than instrumented (the
# count is the same: nothing is collected there either way)
_START_C = ("#include <valgrind/callgrind.h>\n"
            "void chipledger_callgrind_start(void) { CALLGRIND_START_INSTRUMENTATION; }\n")
START_LIBRARY_ENV = "CHIPLEDGER_CALLGRIND_START"


def build_callgrind_start(folder: Path) -> Optional[Path]:
    """The shared library whose function starts callgrind's instrumentation, built in `folder`; None without a C
    compiler or valgrind's headers (the later sample is then instrumented from the start: slower, same count)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src, lib = folder / "callgrind_start.c", folder / "callgrind_start.so"
    src.write_text(_START_C)
    p = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], capture_output=True, text=True)
    return lib if p.returncode == 0 and lib.exists() else None


def start_instrumentation() -> None:
    """In a child under callgrind started with --instr-atstart=no: instrument from here on (no-op without the
    library)."""
    lib = os.environ.get(START_LIBRARY_ENV)
    if lib:
        import ctypes

        ctypes.CDLL(lib).chipledger_callgrind_start()


def counted(tool: str, child: list[str], log: Path, env: dict, what: str,
            callgrind_args: tuple = (), keep: Optional[Path] = None) -> tuple[int, int, str, dict]:
    """Run the command `child` under `tool` ('perf' or 'callgrind'): (instructions its own process executed, those
    of the processes it forked (callgrind, one log per process; perf counts them in the first figure), its stdout,
    and callgrind's collected events of its own process ({} with perf; the cache misses with --cache-sim=yes)).
    `callgrind_args`: more options for callgrind (CALLGRIND_REGION: count one region only); `keep`: a folder for
    callgrind's profiles (`<what>.<pid>.out`, for callgrind_annotate), else none is written."""
    if tool == "perf":  # counts the processes the run forks too (perf's default)
        cmd = ["perf", "stat", "-x,", "-e", "instructions:u", "-o", str(log), "--", *child]
    else:  # one log per process (%p): the run's own, and the events process it forks
        out = f"{keep}/{what}.%p.out" if keep is not None else "/dev/null"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *callgrind_args,
               f"--log-file={log.with_suffix('')}.%p.log", *child]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stdout, stderr = p.communicate()
    forked = 0
    events: dict = {}
    if tool == "perf":
        text = log.read_text() if log.exists() else ""
        count = _perf_count(text)
    else:
        own = log.with_suffix("").with_name(f"{log.stem}.{p.pid}.log")
        text = own.read_text() if own.exists() else ""
        count = _callgrind_count(text)
        events = _callgrind_events(text)
        for other in log.parent.glob(f"{log.stem}.*.log"):
            if other != own:
                forked += _callgrind_count(other.read_text()) or 0
    if p.returncode != 0 or count is None:
        raise RuntimeError(f"{tool} on phase {what} failed (exit {p.returncode}): {(stderr or text).strip()[-2000:]}")
    return count, forked, stdout, events


def count_phases(tool: str, phases, child_argv, jobs: int = 2, callgrind_args: tuple = (),
                 keep: Optional[Path] = None, start_late: bool = False) -> dict:
    """{phase: instructions, phase_forked: those of the processes it forked, "events": the count the last child
    printed}: `child_argv(phase, tmp dir)` run under `tool` for each phase, `jobs` at a time (the counts are per
    process, so two children at a time on this 2-core machine change nothing). bench/metrics.py counts its phases
    with it too. `start_late` (callgrind): no instrumentation until the child calls start_instrumentation(), when
    the library for it can be built here."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same dict layouts in every child
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="chipledger-icount-") as tmp:
        if start_late and tool == "callgrind":
            lib = build_callgrind_start(Path(tmp))
            if lib is not None:
                env[START_LIBRARY_ENV] = str(lib)
                callgrind_args = ("--instr-atstart=no", *callgrind_args)
            out["instrumented_late"] = lib is not None

        def run(phase: str) -> tuple[int, int, int, dict]:
            count, forked, stdout, collected = counted(tool, child_argv(phase, tmp), Path(tmp) / f"{phase}.log", env,
                                                       phase, callgrind_args, keep)
            return count, forked, int(stdout.strip().splitlines()[-1]), collected

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for phase, (count, forked, events, collected) in zip(phases, pool.map(run, phases)):
                out[phase] = count
                out[f"{phase}_forked"] = forked
                out["events"] = events
                if len(collected) > 1:  # callgrind's cache simulation: every event it collected
                    out[f"{phase}_collected"] = collected
    return out


def fold_lines(fleet, lines: list, first: int) -> None:
    """Parse and fold `lines` (line numbers from `first`) as the embedded run does: automatic cyclic collection off,
    the young objects collected and frozen every GC_FREEZE_MASK + 1 lines (chipledger.embedded.GcPause)."""
    from chipledger.embedded import GC_FREEZE_MASK, GcPause
    from schemas import Rejection, parse_event

    with GcPause() as paused:
        for n, line in enumerate(lines, first):
            if not n & GC_FREEZE_MASK:
                paused.checkpoint()
            e = parse_event(line)
            if not isinstance(e, Rejection):
                fleet.apply(e, line)


def child_phase(phase: str, sample: str, lake: str, skip: int = 0) -> None:
    """Run in a child process under the counting tool: every phase imports the same modules and reads the sample
    into memory, then does its phase's work (nothing for 'setup'). With `skip` (a later sample): the phase's work
    on the lines after the first `skip` runs inside `sys.call_tracing` (the region callgrind counts with
    CALLGRIND_REGION), the fold having folded the first `skip` lines before it; prints the lines counted."""
    from chipledger.embedded import run_file
    from ledger import Fleet, FoldConfig
    from schemas import parse_event

    with open(sample, "rb") as f:
        lines = f.readlines()
    if skip:
        if phase not in ("validate", "fold", HOL_OFF_PHASE):
            raise SystemExit(f"--phase-child {phase}: a later sample counts validate and fold only")
        fleet = Fleet(FoldConfig(hol_blocking=phase == "fold"))
        counted_lines = lines[skip:]
        if phase != "validate":
            fold_lines(fleet, lines[:skip], 1)

        def region() -> None:
            if phase == "validate":
                for line in counted_lines:
                    parse_event(line)
                return
            fold_lines(fleet, counted_lines, skip + 1)
            fleet.close()

        start_instrumentation()
        perf_control("enable")
        c0 = time.process_time()
        sys.call_tracing(region, ())
        cpu = time.process_time() - c0
        perf_control("disable")
        print(f"cpu_s {cpu!r}")
        print(len(counted_lines))
        return
    if phase == "validate":
        for line in lines:
            parse_event(line)
    elif phase in ("fold", HOL_OFF_PHASE):
        fleet = Fleet(FoldConfig(hol_blocking=phase == "fold"))
        fold_lines(fleet, lines, 1)
        fleet.close()
    elif phase == "embedded":
        run_file(Path(sample), Path(lake), overwrite=True)
    elif phase == "embedded_inline":
        run_file(Path(sample), Path(lake), overwrite=True, events_process=False)
    print(len(lines))


def count_instructions(sample: Path, tool: Optional[str] = None, jobs: int = 2, hol_off: bool = False,
                       skip: int = 0, keep: Optional[Path] = None, cache_sim: str = "") -> dict:
    """Instructions each phase executes over the events of `sample`, one child process per phase (see 6. in the
    module's text). Returns {"tool", "events", "setup", "validate", "fold", "embedded" (the raw totals), and the
    derived "validation", "fold_alone", "lake_writer"}; with `hol_off` also "fold_hol_off" and "fold_alone_hol_off"
    (the fold with [ledger] hol_blocking = false). With `skip` (callgrind only): the events of `sample` after the
    first `skip`, the state folded up to them not counted; then {"tool", "core", "skip", "events", "validate",
    "fold", "validation", "fold_alone"} (and the hol-off pair). Raises RuntimeError when no tool can count here,
    or for `skip` when the tool is not callgrind. `keep`: a folder for callgrind's profile of each phase. `cache_sim`
    (callgrind only): callgrind simulates the caches too (`--cache-sim=yes`), and each phase's collected events are
    kept as "<phase>_collected" ({"Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw"}); its value is
    the caches simulated, callgrind's own options ("--D1=32768,8,64 --LL=1048576,8,64"), or "yes" for the ones
    valgrind reads from the processor (on a KVM guest that can be nonsense: a 256 MiB direct-mapped LL)."""
    tool = tool or instruction_tool()
    if tool is None:
        raise RuntimeError("cannot count instructions: `perf stat -e instructions` has no hardware counter here "
                           "(or perf is missing: Debian package linux-perf) and valgrind is not installed "
                           "(Debian package valgrind)")
    import ledger

    out: dict = {"tool": tool, "core": ledger.CORE}
    me = str(Path(__file__).resolve())
    if cache_sim and tool != "callgrind":
        raise RuntimeError(f"the cache simulation (--cache-sim) is callgrind's; {tool} counts instructions only")
    cache_args = ("--cache-sim=yes", *(cache_sim.split() if cache_sim != "yes" else ())) if cache_sim else ()
    if skip:
        if tool != "callgrind":
            raise RuntimeError(f"a later sample (--instructions-from) is counted with valgrind's callgrind only "
                               f"(it collects inside one region of the process); {tool} counts whole processes")
        phases = ("validate", "fold", HOL_OFF_PHASE) if hol_off else ("validate", "fold")
        out["skip"] = skip
        out.update(count_phases(tool, phases, lambda phase, tmp: [
            sys.executable, me, "--phase-child", phase, str(sample), str(Path(tmp) / f"lake-{phase}"),
            "--skip", str(skip)], jobs, (*cache_args, *CALLGRIND_REGION), keep, start_late=True))
        out["validation"] = out["validate"]
        out["fold_alone"] = out["fold"] - out["validate"]
        if hol_off:
            out["fold_alone_hol_off"] = out[HOL_OFF_PHASE] - out["validate"]
        return out
    phases = (*PHASES, HOL_OFF_PHASE) if hol_off else PHASES
    out.update(count_phases(tool, phases, lambda phase, tmp: [sys.executable, me, "--phase-child", phase, str(sample),
                                                               str(Path(tmp) / f"lake-{phase}")], jobs, cache_args, keep))
    out["validation"] = out["validate"] - out["setup"]
    out["fold_alone"] = out["fold"] - out["validate"]
    out["lake_writer"] = out["embedded"] - out["fold"]  # in the run's process (the events table is elsewhere)
    out["events_process"] = out["embedded_forked"]
    out["lake_writer_inline"] = out["embedded_inline"] - out["fold"]  # the whole lake in the run's process
    if hol_off:
        out["fold_alone_hol_off"] = out[HOL_OFF_PHASE] - out["validate"]
    return out


def print_instructions(c: dict) -> None:
    n = c["events"]
    name = {"perf": "perf stat -e instructions:u", "callgrind": "valgrind --tool=callgrind, total Ir"}[c["tool"]]
    v = c["validation"] / n
    if c.get("skip"):
        k = c["skip"]
        print(f"\ninstructions ({name}, inside the counted region only), events {k:,} to {k + n:,} (the state folded "
              f"up to event {k:,} not counted), one child process per phase; ledger core: {c['core']}")
        for label, key in (("validation", "validation"), ("fold alone", "fold_alone")):
            per = c[key] / n
            print(f"  {label:<54} {c[key]:>16,}  {per:>9,.0f} per event  validation/this {v / per if per else 0:.2f}")
        if "fold_alone_hol_off" in c:
            off = c["fold_alone_hol_off"]
            print(f"  fold alone, hol_blocking = false {off:>16,}  {off / n:>9,.0f} per event; head-of-line blocking "
                  f"costs x{c['fold_alone'] / off:.2f} (fold alone with it / without it)")
        print("  (the lake writer is not counted on a later sample)")
        return
    print(f"\ninstructions ({name}), first {n:,} events, one child process per phase; ledger core: {c['core']}")
    print(f"  setup (imports, read the sample): {c['setup']:>16,}")
    rows = [("validation", "validation"), ("fold alone", "fold_alone"),
            ("lake writer, all in the run's process", "lake_writer_inline")]
    if c["tool"] == "callgrind":
        rows += [("lake writer, the run's process (events table forked)", "lake_writer"),
                 ("events process (forked: parse + events table)", "events_process")]
    for label, key in rows:
        per = c[key] / n
        print(f"  {label:<54} {c[key]:>16,}  {per:>9,.0f} per event  validation/this {v / per if per else 0:.2f}")
    for label, key in (("embedded run, lake in the run's process", "embedded_inline"),
                       ("embedded run, the run's process" if c["tool"] == "callgrind" else "embedded run, all processes",
                        "embedded")):
        e = (c[key] - c["setup"]) / n
        print(f"  {label:<54} {c[key] - c['setup']:>16,}  {e:>9,.0f} per event  validation/this {v / e:.2f}")
    if "fold_alone_hol_off" in c:
        off = c["fold_alone_hol_off"]
        print(f"  fold alone, hol_blocking = false {off:>16,}  {off / n:>9,.0f} per event; head-of-line blocking "
              f"costs x{c['fold_alone'] / off:.2f} (fold alone with it / without it)")


# --native-profile: the counted region of a child sampled by `perf record -e cpu-clock` (a software clock: it needs
# no hardware counter, so it works on a virtual machine), started and stopped by the child through perf's control
# fifos ("ctl,ack" in this variable)
PERF_CTL_ENV = "CHIPLEDGER_PERF_CTL"


def perf_control(command: str) -> None:
    """In a child under `perf record --control fifo:...`: send `command` ("enable"/"disable"), wait for the ack."""
    spec = os.environ.get(PERF_CTL_ENV)
    if not spec:
        return
    ctl, ack = spec.split(",")
    with open(ctl, "w") as c, open(ack, "rb") as a:
        c.write(command + "\n")
        c.flush()
        a.read(5)  # "ack\n\0"


def _perf_symbols(data: Path) -> dict:
    """{(object, symbol): samples} from `perf report` of one perf.data (symbols without a name: "(unnamed)")."""
    out = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "dso,sym", "-n",
                          "--percent-limit", "0"], capture_output=True, text=True).stdout
    found: dict = {}
    for line in out.splitlines():
        m = re.match(r"\s*[0-9.]+%\s+(\d+)\s+(\S+)\s+\[.\]\s+(.*)$", line)
        if m:
            sym = m.group(3).strip()
            key = (m.group(2), "(unnamed)" if sym.startswith("0x") else sym)
            found[key] = found.get(key, 0) + int(m.group(1))
    return found


def native_profile(sample: Path, skip: int, repeat: int = 3) -> dict:
    """Where the CPU time of validation and of parse + fold goes natively, over events skip.. of `sample` (the state
    folded up to `skip` first, not sampled): each phase `repeat` times, alternating, in its own child under `perf record
    -e cpu-clock -F 4999`, sampling only the counted region. Returns {phase: {"cpu_s": [region CPU seconds per run],
    "events", "symbols": {(object, symbol): samples}, "samples"}}. Raises RuntimeError without perf."""
    if not shutil.which("perf"):
        raise RuntimeError("--native-profile needs Linux perf (Debian package linux-perf)")
    me = str(Path(__file__).resolve())
    out: dict = {phase: {"cpu_s": [], "symbols": {}, "samples": 0} for phase in ("validate", "fold")}
    with tempfile.TemporaryDirectory(prefix="chipledger-perf-") as tmp:
        for i in range(repeat):
            for phase in ("validate", "fold"):
                ctl, ack, data = Path(tmp) / f"ctl{i}{phase}", Path(tmp) / f"ack{i}{phase}", Path(tmp) / f"{phase}{i}.data"
                os.mkfifo(ctl)
                os.mkfifo(ack)
                cmd = ["perf", "record", "-q", "-e", "cpu-clock", "-F", "4999", "-D", "-1", "--control",
                       f"fifo:{ctl},{ack}", "-o", str(data), "--", sys.executable, me, "--phase-child", phase,
                       str(sample), str(Path(tmp) / "lake"), "--skip", str(skip)]
                p = subprocess.run(cmd, capture_output=True, text=True,
                                   env={**os.environ, "PYTHONHASHSEED": "0", PERF_CTL_ENV: f"{ctl},{ack}"})
                if p.returncode != 0:
                    raise RuntimeError(f"perf record on phase {phase} failed: {p.stderr.strip()[-2000:]}")
                lines = p.stdout.strip().splitlines()
                o = out[phase]
                o["events"] = int(lines[-1])
                o["cpu_s"].append(float(lines[-2].split()[1]))
                for key, n in _perf_symbols(data).items():
                    o["symbols"][key] = o["symbols"].get(key, 0) + n
                    o["samples"] += n
    return out


def print_native_profile(prof: dict, skip: int, top: int = 25) -> None:
    """Per event: the region's CPU time (min and median of the runs), and for the symbols taking the most of parse +
    fold, their share of it in ns (the samples' share of the runs' summed CPU time) beside validation's."""
    import statistics

    def ns_per(phase: str) -> dict:
        o = prof[phase]
        per = sum(o["cpu_s"]) / (len(o["cpu_s"]) * o["events"]) * 1e9
        return {k: per * n / o["samples"] for k, n in o["symbols"].items()} if o["samples"] else {}

    v, f = prof["validate"], prof["fold"]
    n = f["events"]
    vmin, fmin = min(v["cpu_s"]) / n * 1e6, min(f["cpu_s"]) / n * 1e6
    print(f"\nnative CPU time (perf record -e cpu-clock, events {skip:,} to {skip + n:,}, {len(f['cpu_s'])} runs of each "
          f"phase alternating): validation {vmin:.2f} us/event (median {statistics.median(v['cpu_s']) / n * 1e6:.2f}), "
          f"parse + fold {fmin:.2f} (median {statistics.median(f['cpu_s']) / n * 1e6:.2f}), fold alone "
          f"{fmin - vmin:.2f} us/event (min - min): ratio {vmin / (fmin - vmin):.2f}")
    vn, fn = ns_per("validate"), ns_per("fold")
    by_object: dict = {}
    for (obj, _), ns in fn.items():
        by_object[obj] = by_object.get(obj, 0.0) + ns
    print("  parse + fold by object (ns per event): " + ", ".join(
        f"{obj} {ns:,.0f}" for obj, ns in sorted(by_object.items(), key=lambda kv: -kv[1])[:6]))
    print(f"  {'parse + fold':>12} {'validation':>10}  ns per event, by symbol")
    for key, ns in sorted(fn.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {ns:12,.0f} {vn.get(key, 0):10,.0f}  {key[1]} [{key[0]}]")


CACHE_EVENTS = ("Dr", "Dw", "D1mr", "D1mw", "DLmr", "DLmw", "I1mr", "ILmr", "Bc", "Bcm", "Bi", "Bim")


def cache_per_event(c: dict) -> dict:
    """{phase: {event: per event}} for validation and the fold alone (and the lake writer on a first sample) from
    callgrind's cache simulation (--cache-sim), the same differences as the instruction counts; with "D1m" (first
    level data misses, reads and writes) and "DLm" (last level) added."""
    n = c["events"]
    get = lambda phase: c.get(f"{phase}_collected", {})  # noqa: E731
    pairs = [("validation", "validate", "setup" if not c.get("skip") else None), ("fold alone", "fold", "validate")]
    if not c.get("skip"):
        pairs.append(("lake writer (the run's process)", "embedded", "fold"))
    out: dict = {}
    for label, phase, minus in pairs:
        a, b = get(phase), get(minus) if minus else {}
        if not a or (minus and not b):
            continue
        d = {k: (a.get(k, 0) - b.get(k, 0)) / n for k in ("Ir", *CACHE_EVENTS)}
        d["D1m"], d["DLm"] = d["D1mr"] + d["D1mw"], d["DLmr"] + d["DLmw"]
        out[label] = d
    return out


def print_cache(c: dict) -> None:
    per = cache_per_event(c)
    if not per:
        return
    print("  cache simulation (callgrind --cache-sim=yes), per event: data reads, writes, first-level (D1) and "
          "last-level (LL) data misses, instruction fetch misses")
    for label, d in per.items():
        print(f"    {label:<32} Ir {d['Ir']:>8,.0f}  Dr {d['Dr']:>8,.0f}  Dw {d['Dw']:>7,.0f}  D1 misses {d['D1m']:>6,.0f} "
              f"(reads {d['D1mr']:,.0f})  LL misses {d['DLm']:>5,.1f}  I1 misses {d['I1mr']:>6,.0f}  "
              f"D1 misses per 1,000 Ir {1000 * d['D1m'] / d['Ir'] if d['Ir'] else 0:.1f}"
              + (f"  branches: conditional {d['Bc']:,.0f} ({d['Bcm']:,.0f} mispredicted), indirect {d['Bi']:,.0f} "
                 f"({d['Bim']:,.0f} mispredicted)" if d["Bc"] else ""))


def fold_digest(path: Path, n: int) -> tuple[str, int, str]:
    """sha256 over everything the fold put out for the first n lines of `path`, in order, then the closed books,
    the policy rows at the end and the final state of every pool without its monotonic counters; and a sha256 of
    the counters alone (PoolState.counters_dict; added with issue #20, kept apart so that the first digest
    compares with the runs before them). Returns (hex digest, lines folded, counters' hex digest)."""
    import hashlib

    from ledger import Fleet, Step
    from schemas import Rejection, parse_event

    h = hashlib.sha256()
    upd = h.update
    fleet = Fleet()
    lines = 0
    with open(path, "rb") as f:
        for line in islice(f, n):
            lines += 1
            raw = line.rstrip(b"\r\n")
            e = parse_event(raw)
            if isinstance(e, Rejection):
                upd(repr(("dead", e.code.value, e.detail)).encode())
                continue
            step = fleet.apply(e, raw)
            if step.rejection is not None:
                upd(repr(("dead", step.rejection.code.value, step.rejection.detail)).encode())
                continue
            upd(repr(("step", step.occurred_s, step.applied_at, step.lateness_s, step.duplicate)).encode())
            for table in Step.TABLES:
                for row in getattr(step, table):
                    upd(repr((table, tuple(row))).encode())
    journal, runs = fleet.close()
    for table, rows in (("journal", journal), ("job_runs", runs), *fleet.policy_rows().items(),
                        *fleet.close_facts().items()):
        for row in rows:
            upd(repr(("close", table, tuple(row))).encode())
    states = fleet.to_dict()
    counters = {}
    for pool, d in states.items():
        counters[pool] = d.pop("counters")
    upd(json.dumps(states, sort_keys=True).encode())
    return h.hexdigest(), lines, hashlib.sha256(json.dumps(counters, sort_keys=True).encode()).hexdigest()


def child_rss(path: str, lake: str) -> None:
    """Run in a fresh process: the embedded run, then print peak RSS (its own, and the largest of the processes
    it forked: the events process) and state sizes as JSON."""
    dt, summary, state = time_embedded(Path(path), Path(lake))
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    forked_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"seconds": dt, "lines": summary["lines"], "peak_rss_mib": rss_kib / 1024,
                      "events_process_rss_mib": forked_kib / 1024, **state}))


def copies_file(src: Path, dst: Path, copies: int) -> int:
    """`copies` copies of the bench file `src`, each copy's pools renamed (`c<k>-<pool>`, as bench/analytics.py
    --copies renames them), interleaved line by line (line i of copy 0, of copy 1, …): a file in time order with
    copies × the pools, of similar sizes. Returns its lines."""
    lines = src.read_bytes().splitlines()
    n = 0
    with open(dst, "wb") as f:
        for line in lines:
            for k in range(copies):
                f.write(line.replace(b'"pool":"', f'"pool":"c{k}-'.encode(), 1) + b"\n")
                n += 1
    return n


class TreeMemory:
    """Samples, every `every_s` in a thread, the resident memory of this process and all its descendants together
    (from /proc): the peak of their summed RSS (pages a fork shares are counted in each process) and of their
    summed PSS (shared pages divided among the processes sharing them: what the tree really holds)."""

    def __init__(self, every_s: float = 0.25) -> None:
        import threading

        self.every_s, self.peak_rss_kib, self.peak_pss_kib = every_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)
        self._thread.start()

    @staticmethod
    def _tree(pid: int) -> list[int]:
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            try:
                for t in os.listdir(f"/proc/{p}/task"):
                    with open(f"/proc/{p}/task/{t}/children") as f:
                        todo.extend(int(c) for c in f.read().split())
            except OSError:
                pass
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            rss = pss = 0
            for p in self._tree(os.getpid()):
                try:
                    with open(f"/proc/{p}/smaps_rollup") as f:
                        for line in f:
                            if line.startswith("Rss:"):
                                rss += int(line.split()[1])
                            elif line.startswith("Pss:"):
                                pss += int(line.split()[1])
                except OSError:
                    pass  # the process ended meanwhile
            self.peak_rss_kib, self.peak_pss_kib = max(self.peak_rss_kib, rss), max(self.peak_pss_kib, pss)

    def stop(self) -> "TreeMemory":
        self._stop.set()
        self._thread.join()
        return self


def parallel_child(phase: str, path: str, lake: str, jobs: str, own_sessions: bool = False) -> None:
    """In a fresh process: one phase of the parallel bench (run, upgrade, backtest) with `jobs` processes; prints
    JSON: wall seconds, CPU seconds of this process and of every process it forked and waited for, events, peak
    RSS (this process's and the largest forked one's) and the peak of all of them together (TreeMemory). With
    `own_sessions` every process it forks starts a session of its own (see bench_parallel)."""
    from chipledger.embedded import run_file

    if own_sessions:
        os.register_at_fork(after_in_child=os.setsid)
    j = int(jobs)
    load0 = os.getloadavg()[0]
    tree = TreeMemory()
    before = os.times()
    t0 = time.perf_counter()
    if phase == "run":
        summary, _ = run_file(Path(path), Path(lake), overwrite=True, jobs=j)
        events = summary.accepted
    elif phase == "upgrade":
        from chipledger.refold import FACT_TABLES, refold_facts

        events = refold_facts(Path(lake), tables=list(FACT_TABLES), jobs=j)["events"]
    else:
        from chipledger.config import Config
        from chipledger.sim.backtest import run_cli

        from dataclasses import replace

        base = Config()
        alt = replace(base, policy=replace(base.policy, fair_share_tolerance=0.0))  # decides differently
        report = run_cli(Path(path), alt, Config(), "tolerance-0", "defaults", None, None, None, jobs=j)
        events = sum(c["events_folded"] for c in report["configs"].values())
    dt = time.perf_counter() - t0
    after = os.times()
    print(json.dumps({"seconds": dt, "events": events, "load": [load0, os.getloadavg()[0]],
                      "cpu_s": after.user + after.system - before.user - before.system,
                      "children_cpu_s": (after.children_user + after.children_system - before.children_user
                                         - before.children_system),
                      "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "children_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
                      "tree_rss_mib": tree.stop().peak_rss_kib / 1024, "tree_pss_mib": tree.peak_pss_kib / 1024}))


def bench_parallel(src: Path, out: Path, copies: int, jobs: list[int], repeat: int, own_sessions: bool = False) -> None:
    """--parallel-copies: `run`, `lake upgrade` and a two-configuration `backtest` on the file of pool-renamed
    copies at each job count, alternating, each phase in a fresh process; prints per phase and job count the median
    and the best events/s, the speed-up over the first job count, events per CPU-second, peak RSS and the load
    average during the runs.

    On a Linux machine shared with other sessions the kernel's autogroup scheduler (/proc/sys/kernel/
    sched_autogroup_enabled) divides the CPU between sessions first, then between the processes of a session: when
    other sessions keep the cores busy, a phase gets about one session's share however many processes it forks, and
    `--jobs 2` cannot be faster than `--jobs 1`. `own_sessions` (--own-sessions) puts the phase and every process
    it forks in a session of its own, so each process competes as a process of a machine without other sessions
    does: the speed-up then says what the split gains (at any load, the ratio of the busiest processes' CPU), not
    what the scheduler allows this session."""
    import statistics

    path = out / f"copies-{copies}-{src.name}"
    n = copies_file(src, path, copies)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            autogroup = "on" if f.read().strip() == "1" else "off"
    except OSError:
        autogroup = "unknown"
    print(f"\nparallel replays: {n:,} lines, {copies} copies of {src.name} ({copies * 3} pools); load average "
          f"{' '.join(load)} on {os.cpu_count()} cores; autogroup scheduling {autogroup}; "
          f"{'each process in a session of its own' if own_sessions else 'one session'}")
    results: dict = {}
    for r in range(repeat):
        for phase in ("run", "upgrade", "backtest"):
            for j in jobs:
                lake = out / "lake-parallel"
                if phase == "upgrade" and not (lake / "_lake.json").exists():
                    raise SystemExit("the upgrade phase needs the run phase's lake")
                cmd = [sys.executable, __file__, "--parallel-child", phase, str(path), str(lake), str(j),
                       *(["--own-sessions"] if own_sessions else [])]
                proc = subprocess.run(cmd, capture_output=True, text=True, start_new_session=own_sessions)
                if proc.returncode != 0:
                    raise SystemExit(f"{phase} --jobs {j} failed: {proc.stderr[-2000:]}")
                results.setdefault((phase, j), []).append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"{'phase':<9} {'jobs':>4} {'events/s med':>13} {'best':>9} {'speed-up med':>13} {'best':>6} "
          f"{'events/CPU-s':>13} {'CPU-s':>7} {'peak RSS MiB (run, largest forked, all: RSS / PSS)':>52} "
          f"{'load':>10}")
    for phase in ("run", "upgrade", "backtest"):
        base = None
        for j in jobs:
            rs = results[(phase, j)]
            rates = [x["events"] / x["seconds"] for x in rs]
            cpu = [x["cpu_s"] + x["children_cpu_s"] for x in rs]
            med, best = statistics.median(rates), max(rates)
            if base is None:
                base = (med, best)
            per_cpu = statistics.median(x["events"] / c for x, c in zip(rs, cpu))
            rss = [max(x[k] for x in rs) for k in ("rss_mib", "children_rss_mib", "tree_rss_mib", "tree_pss_mib")]
            loads = [v for x in rs for v in x["load"]]
            print(f"{phase:<9} {j:>4} {med:>13,.0f} {best:>9,.0f} {med / base[0]:>12.2f}x {best / base[1]:>5.2f}x "
                  f"{per_cpu:>13,.0f} {statistics.median(cpu):>7.1f} {rss[0]:>26.0f}, {rss[1]:.0f}, {rss[2]:.0f} / "
                  f"{rss[3]:.0f} {min(loads):>5.1f}–{max(loads):.1f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--rss", default="1000000,5000000", help="sizes for the peak-RSS runs ('' to skip)")
    ap.add_argument("--out", type=Path, default=None, help="keep the files here (default: a temp folder)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed runs of each kind; the best is kept (0: none, e.g. for --instructions alone)")
    ap.add_argument("--digest", type=int, default=0, metavar="N",
                    help="only fold the first N events of the bench file and print a digest of all outputs")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--phase-child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--skip", type=int, default=0, help=argparse.SUPPRESS)  # with --phase-child: a later sample
    ap.add_argument("--instructions", type=int, default=0, metavar="N",
                    help="also count instructions per phase over the first N events (perf, else valgrind)")
    ap.add_argument("--instructions-from", type=int, default=0, metavar="K",
                    help="with --instructions N: count events K..K+N instead, the state folded up to event K not "
                         "counted (valgrind's callgrind only; validation and the fold, not the lake writer)")
    ap.add_argument("--callgrind-out", type=Path, default=None, metavar="DIR",
                    help="with --instructions under callgrind: keep each phase's profile in DIR (<phase>.<pid>.out, "
                         "for callgrind_annotate)")
    ap.add_argument("--cache-sim", nargs="?", const="yes", default="", metavar="'--D1=S,A,L --LL=S,A,L'",
                    help="with --instructions under callgrind: simulate the caches too (--cache-sim=yes; optionally "
                         "more callgrind options, e.g. '--D1=32768,8,64 --LL=1048576,8,64 --branch-sim=yes') and print "
                         "each phase's first- and last-level cache misses (and branch mispredictions) per event")
    ap.add_argument("--native-profile", type=int, default=0, metavar="RUNS",
                    help="with --instructions N --instructions-from K: also sample the native CPU time of validation and "
                         "of parse + fold over the same events with `perf record -e cpu-clock` (RUNS runs of each) and "
                         "print it per symbol beside validation's")
    ap.add_argument("--native-only", action="store_true",
                    help="with --native-profile: only the native profile, not callgrind's counts")
    ap.add_argument("--gc-time", action="store_true",
                    help="after the timed runs, one more parse + fold and embedded run with the cyclic collector's "
                         "passes timed (gc.callbacks): its share of each")
    ap.add_argument("--hol-off", action="store_true",
                    help="also time (and count) the fold with [ledger] hol_blocking = false: the cost of head-of-line "
                         "blocking")
    ap.add_argument("--inline", action="store_true",
                    help="also time the embedded run with the whole lake written in its own process (no events process)")
    ap.add_argument("--opcodes", type=int, default=0, metavar="N",
                    help="also count the fold's Python opcodes per event over N events after the first 20,000")
    ap.add_argument("--parallel-copies", type=int, default=0, metavar="K",
                    help="also time run, lake upgrade and a two-configuration backtest on K pool-renamed copies of the "
                         "bench file (--events / K events each) at each of --jobs")
    ap.add_argument("--jobs", default="1,2", help="job counts for --parallel-copies")
    ap.add_argument("--own-sessions", action="store_true",
                    help="with --parallel-copies: each timed phase and every process it forks in a session of its own "
                         "(on a shared machine with autogroup scheduling; see bench_parallel)")
    ap.add_argument("--parallel-child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.parallel_child:
        parallel_child(*args.parallel_child, own_sessions=args.own_sessions)
        return 0
    if args.child:
        child_rss(*args.child)
        return 0
    if args.phase_child:
        child_phase(*args.phase_child, skip=args.skip)
        return 0
    import ledger

    if args.instructions_from and not args.instructions:
        ap.error("--instructions-from K needs --instructions N (the events counted after the first K)")
    if args.instructions_from < 0:
        ap.error("--instructions-from must not be negative")
    if args.opcodes and ledger.CORE == "compiled":
        ap.error("--opcodes: the compiled core runs no Python opcodes; run with CHIPLEDGER_PURE_PYTHON=1")
    out = args.out or Path(tempfile.mkdtemp(prefix="chipledger-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    per_day = events_per_day()
    if args.digest:
        p = out / f"events-{args.events}.jsonl"
        if not p.exists():  # kept with --out: the same seeded file either way
            make_file(p, args.events, per_day)
        t0 = time.process_time()
        digest, lines, counters = fold_digest(p, args.digest)
        print(f"digest of the fold's outputs and final state, first {lines:,} lines of {p}: {digest} "
              f"({time.process_time() - t0:.1f} s CPU); of the states' counters: {counters}")
        return 0
    print(f"scenario: seed {SEED}, scale {SCALE}, {per_day:,.0f} events/day; ledger core: {ledger.CORE}")
    if args.parallel_copies:
        src = out / f"events-{args.events // args.parallel_copies}.jsonl"
        make_file(src, args.events // args.parallel_copies, per_day)
        bench_parallel(src, out, args.parallel_copies, [int(j) for j in args.jobs.split(",")], max(1, args.repeat),
                       args.own_sessions)
    sizes = sorted({args.events, *(int(s) for s in args.rss.split(",") if s)})
    files = {}
    for n in sizes:
        p = out / f"events-{n}.jsonl"
        t0 = time.perf_counter()
        files[n] = p
        written = make_file(p, n, per_day)
        print(f"generated {written:,} events in {time.perf_counter() - t0:.1f} s -> {p} "
              f"({p.stat().st_size / 2**20:,.0f} MiB)")

    path = files[args.events]
    if args.repeat > 0:  # --repeat 0: no timed runs (only the counts asked for)
        # alternate the runs and keep the best of each: this machine's speed drifts by +-20% over minutes, and
        # the ratio should compare like with like
        v_s = f_s = e_s = i_s = v_cpu = f_cpu = e_cpu = e2_cpu = i_cpu = h_s = h_cpu = float("inf")
        for _ in range(args.repeat):
            v, n, vc = time_validate(path)
            f, _, fc = time_fold(path)
            if args.hol_off:
                h, _, hc = time_fold(path, hol_blocking=False)
                h_s, h_cpu = min(h_s, h), min(h_cpu, hc)
            e, summary, state = time_embedded(path, out / "lake")
            v_s, f_s, e_s = min(v_s, v), min(f_s, f), min(e_s, e)
            v_cpu, f_cpu = min(v_cpu, vc), min(f_cpu, fc)
            e_cpu, e2_cpu = min(e_cpu, state["cpu_s"]), min(e2_cpu, state["events_cpu_s"])
            if args.inline:
                i, _, istate = time_embedded(path, out / "lake-inline", events_process=False)
                i_s, i_cpu = min(i_s, i), min(i_cpu, istate["cpu_s"])
        if args.gc_time:  # one more pass of each, with the collector's passes timed (not used above)
            gc_fold, gc_run = GcTimer(), GcTimer()
            _, _, gc_fold_cpu = gc_fold.measure(time_fold, path)
            _, _, gc_state = gc_run.measure(time_embedded, path, out / "lake")
        v_rate, f_rate, e_rate = n / v_s, n / f_s, n / e_s
        fold_alone_rate = n / (f_s - v_s)  # the fold's own cost: (parse + fold) - (parse alone)
        print(f"\n{n:,} events (best of {args.repeat} alternating runs each)")
        print(f"  validate only (baseline): {v_s:7.2f} s  {v_rate:>10,.0f} events/s")
        print(f"  fold alone (derived):     {f_s - v_s:7.2f} s  {fold_alone_rate:>10,.0f} events/s  "
              f"ratio {fold_alone_rate / v_rate:.2f}  (target >= 0.50)")
        print(f"  parse + fold:             {f_s:7.2f} s  {f_rate:>10,.0f} events/s  ratio {f_rate / v_rate:.2f}")
        # the same in CPU time of this process: on a shared machine, time the scheduler gives to other processes
        # inflates the long runs (parse + fold) more than the short one (validate only) in wall time
        print(f"  in CPU time: validate only {v_cpu:.2f} s, parse + fold {f_cpu:.2f} s, fold alone "
              f"{f_cpu - v_cpu:.2f} s  ratio {v_cpu / (f_cpu - v_cpu):.2f}")
        if args.hol_off:
            print(f"  hol_blocking = false: parse + fold {h_s:.2f} s, CPU {h_cpu:.2f} s, fold alone "
                  f"{h_cpu - v_cpu:.2f} s; head-of-line blocking costs x{(f_cpu - v_cpu) / (h_cpu - v_cpu):.2f} of "
                  f"the fold alone (CPU)")
        print(f"  embedded run (with lake): {e_s:7.2f} s  {e_rate:>10,.0f} events/s  ratio {e_rate / v_rate:.2f}  "
              f"(target >= 0.20: issue 37; the fold alone's 0.50 above was withdrawn there)")
        print(f"    in CPU time: the run's process {e_cpu:.2f} s (ratio {v_cpu / e_cpu:.2f}), its events process "
              f"{e2_cpu:.2f} s")
        if args.inline:
            print(f"  embedded run, lake in one process: {i_s:7.2f} s  {n / i_s:>10,.0f} events/s  ratio "
                  f"{n / i_s / v_rate:.2f}; CPU {i_cpu:.2f} s (ratio {v_cpu / i_cpu:.2f})")
        if args.gc_time:
            for label, timer, cpu in (("parse + fold", gc_fold, gc_fold_cpu),
                                      ("embedded run, the run's process", gc_run, gc_state["cpu_s"])):
                print(f"  cyclic gc in {label}: {timer.seconds:.3f} s of {cpu:.2f} s CPU ({100 * timer.seconds / cpu:.1f}%), "
                      f"passes by generation {timer.passes[0]:,} / {timer.passes[1]:,} / {timer.passes[2]:,}")
        print(f"  accepted {summary['accepted']:,}, dead letters {sum(summary['dead_letters'].values()):,}, "
              f"rows {summary['rows_written']}")

    if args.opcodes:
        per_event, by_type = count_opcodes(path, 20_000, args.opcodes)
        print(f"\nfold: {per_event:,.0f} Python opcodes per event (events 20,000 to {20_000 + args.opcodes:,}); by type: "
              + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(by_type.items(), key=lambda kv: -kv[1])))

    if args.native_profile and not (args.instructions and args.instructions_from):
        ap.error("--native-profile RUNS needs --instructions N --instructions-from K (the events sampled)")
    if args.instructions and not args.native_only:
        k = args.instructions_from
        sample = out / (f"sample-{k}-{args.instructions}.jsonl" if k else f"sample-{args.instructions}.jsonl")
        with open(path, "rb") as f, open(sample, "wb") as g:
            g.writelines(islice(f, k + args.instructions))
        t0 = time.perf_counter()
        try:
            if args.callgrind_out is not None:
                args.callgrind_out.mkdir(parents=True, exist_ok=True)
            c = count_instructions(sample, hol_off=args.hol_off, skip=k, keep=args.callgrind_out,
                                   cache_sim=args.cache_sim)
        except RuntimeError as err:
            print(f"\ninstructions: {err}", file=sys.stderr)
            return 2
        print_instructions(c)
        print_cache(c)
        print(f"  ({time.perf_counter() - t0:.0f} s)")
    if args.native_profile:
        k = args.instructions_from
        sample = out / f"sample-{k}-{args.instructions}.jsonl"
        with open(path, "rb") as f, open(sample, "wb") as g:
            g.writelines(islice(f, k + args.instructions))
        try:
            prof = native_profile(sample, k, args.native_profile)
        except RuntimeError as err:
            print(f"\nnative profile: {err}", file=sys.stderr)
            return 2
        print_native_profile(prof, k)

    results = []
    for n_rss in (int(s) for s in args.rss.split(",") if s):
        proc = subprocess.run([sys.executable, __file__, "--child", str(files[n_rss]), str(out / f"lake-{n_rss}")],
                              capture_output=True, text=True, check=True)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
    if results:
        print("\npeak RSS of the embedded run (fresh process each)")
        for r in results:
            print(f"  {r['lines']:>10,} events: {r['peak_rss_mib']:7.1f} MiB peak RSS (the events process "
                  f"{r['events_process_rss_mib']:.1f} MiB), {r['seconds']:6.1f} s (CPU: the run's process "
                  f"{r['cpu_s']:.1f} s, its events process {r['events_cpu_s']:.1f} s); state at "
                  f"end: {r['active_jobs']:,} active jobs, {r['chips']:,} chips, {r['dedup_ids']:,} ids in the "
                  f"dedup window")
        if len(results) >= 2:
            a, b = results[0], results[-1]
            print(f"  RSS ratio {b['lines'] / a['lines']:.0f}x events: {b['peak_rss_mib'] / a['peak_rss_mib']:.2f}x "
                  f"(events process {b['events_process_rss_mib'] / a['events_process_rss_mib']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
