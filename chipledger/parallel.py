"""Pool-parallel replays: a run's file folded by several processes, each owning a disjoint set of pools.

Pools share nothing in the fold (DESIGN §2: one key, one order per pool), so a replay splits by pool:

1. One pass over the file (`route_lines`) reads each line's `pool` field without parsing the event (a byte pattern;
   a line where the pattern is absent or ambiguous is parsed in full) and notes the pool of every line, 4 bytes a
   line. A line with no readable pool (too large, blank, not JSON, no pool) is this process's own: it can only be
   a dead letter or a blank line, and is handled here, once.
2. The pools are dealt to `jobs` processes (the largest first, each to the least loaded: `deal_pools`), which are
   forked after the pass and fold their pools' lines with the run's own per-line rule (chipledger.embedded.
   fold_lines), in file order: a pool's lines reach one process in the order the file has them, so its state, its
   outputs and the file clock check (which reads the next lines of the same pool) are those of `--jobs 1`. Each
   process writes its rows (`events` included) to the run's staging folder, files named `part-<run>-j<k>-…`.
3. Dead letters are the one table whose rows depend on other pools: a dead letter's `seen_at` is the latest event
   time applied by any pool before its line. The processes send theirs back, and write the lines where their own
   latest applied time rose to two files beside the staged tables (16 bytes a rise, on disk: not held in memory
   by any process, as the history would be); this process finds each dead letter's time in them by bisection and
   writes the `deadletters` table exactly as one process would (same rows, same order, same file names).
4. The run commits all staged files in one manifest swap (as every run does), so an interrupted parallel run
   leaves nothing visible; the processes ignore Ctrl-C and are ended by this one.

What is not byte-identical to `--jobs 1`: the Parquet files of the tables other than `deadletters` (each process
writes its own files, so a table's rows are split into other files, and within a day the rows of different
pools are grouped by process, not interleaved in file order). Every table holds the same rows (tests compare the
sorted rows, table by table); nothing reads meaning into a row's position in a file: the views order by time,
`seq` and ids, and the store indexes decisions by id.
"""

from __future__ import annotations

import mmap
import multiprocessing
import multiprocessing.connection
import re
import signal
from array import array
from bisect import bisect_left
from collections import Counter
from pathlib import Path
from typing import Optional

from analytics.lake import TABLES, LakeWriter
from ledger import Fleet, FoldConfig
from ledger.state import PoolState
from schemas import Rejection, parse_event
from streams import logline
from streams.rows import EventColumns, StepOutputs

from chipledger import embedded
from chipledger.embedded import GC_FREEZE_MASK, GcPause, RunError, RunSummary, _lines, _note_line, _raw

# a line's pool: the `"pool": "…"` member of a plain line, or of the escaped value of a `log export` line
# (`\"pool\":\"…\"`); a name with a backslash (an escape) or a second match is left to the full parse
_POOL = re.compile(rb'(\\?)"pool\1"\s*:\s*\1"([^"\\]*)\1"')
NO_POOL = -1  # a line that is this process's own (no readable pool)
RISES_BATCH = 1 << 16  # a fold process's rises of its latest applied time held before they are written out


def _pool_of(raw: bytes, max_event_bytes: int) -> Optional[str]:
    # the common case first, without the pattern (a third of the routing pass's time): a compact plain line whose
    # only "pool" is the member `"pool":"<name>"`; what the pattern reads there is the same name
    i = raw.find(b'"pool":"')
    if i >= 0 and raw.count(b"pool") == 1:
        j = raw.find(b'"', i + 8)
        if j >= 0 and b"\\" not in raw[i + 8:j]:
            try:
                return raw[i + 8:j].decode("utf-8")
            except UnicodeDecodeError:
                pass  # the full parse says what it is
    m = _POOL.search(raw)
    if m is not None and _POOL.search(raw, m.end()) is None:
        try:
            return m.group(2).decode("utf-8")
        except UnicodeDecodeError:
            pass  # the full parse says what it is
    # absent or ambiguous: the full parse decides (rare: a pool written with escapes, a nested "pool" member)
    if logline.is_wrapped(raw):
        un = logline.unwrap(raw)
        if isinstance(un, Rejection):
            return None
        raw = un[0]
    event = parse_event(raw, max_event_bytes)
    return None if isinstance(event, Rejection) else event.pool


def route_lines(events_path: Path, max_event_bytes: int, progress=None) -> tuple[array, list[str], list[int], int]:
    """(pool index of each line, NO_POOL for this process's own; the pools in order of first appearance; each
    pool's number of lines; bytes read)."""
    route = array("i")
    index: dict[str, int] = {}
    pools: list[str] = []
    counts: list[int] = []
    read_bytes = 0
    with open(events_path, "rb") as f:
        for n, (line, size, too_large) in enumerate(_lines(f, max_event_bytes), start=1):
            read_bytes += size
            if progress is not None and n % 4096 == 0:
                progress(read_bytes)
            pool = None if too_large is not None else _pool_of(_raw(line, n), max_event_bytes)
            if pool is None:
                route.append(NO_POOL)
                continue
            i = index.get(pool)
            if i is None:
                i = index[pool] = len(pools)
                pools.append(pool)
                counts.append(0)
            counts[i] += 1
            route.append(i)
    return route, pools, counts, read_bytes


def deal_pools(pools: list[str], counts: list[int], jobs: int) -> list[int]:
    """The process of each pool: the pools with the most lines first, each to the process with the fewest lines so
    far (ties: the lower process), so processes get about equal work; a function of the file alone."""
    load = [0] * jobs
    owner = [0] * len(pools)
    for i in sorted(range(len(pools)), key=lambda i: (-counts[i], pools[i])):
        k = min(range(jobs), key=lambda k: (load[k], k))
        owner[i] = k
        load[k] += counts[i]
    return owner


def fold_parallel(events_path: Path, stage: Path, names: str, fold_config: FoldConfig, summary: RunSummary,
                  topic: str, max_event_bytes: int, jobs: int, progress=None) -> tuple[dict, Fleet, int]:
    """The run's fold by up to `jobs` processes (see the module's docstring): files written to `stage`; returns
    (rows written by table, the fleet of all pools, bytes read), as chipledger.embedded._fold_here does."""
    route, pools, counts, read_bytes = route_lines(events_path, max_event_bytes, progress)
    jobs = min(jobs, len(pools))
    if jobs < 2:  # one pool (or none): nothing to split
        return embedded._fold_here(events_path, stage, names, fold_config, summary, topic, max_event_bytes, True,
                                   progress)
    owner = deal_pools(pools, counts, jobs)
    ctx = multiprocessing.get_context("fork")
    procs, conns = [], []
    try:
        for k in range(jobs):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, name=f"chipledger-fold-{k}", daemon=True,
                            args=(k, events_path, stage, names, fold_config, topic, max_event_bytes, route, owner,
                                  pools, child_end))
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        # this process's own lines (no readable pool) while the others fold: dead letters and blank lines
        dead: list = []
        if NO_POOL in route:  # (else no second read of the file here)
            paused = GcPause()
            try:
                embedded.fold_lines(events_path, Fleet(fold_config), summary,
                                    lambda row, code, line: dead.append((line, code, row)), _never_applied, topic,
                                    max_event_bytes, paused, None, mine=lambda n: route[n - 1] == NO_POOL)
            finally:
                paused.end()
        results = collect(procs, conns, "fold", RunError)
        for p in procs:
            p.join()
    finally:
        end_processes(procs, conns)
    return _merge(results, dead, route, pools, stage, names, fold_config, summary), _fleet(results, pools,
                                                                                           fold_config), read_bytes


def collect(procs: list, conns: list, what: str, error: type[Exception]) -> dict:
    """What each forked process k sends back through its pipe `conns[k]` as ("ok", result), by k, in whatever order
    they finish. Raises `error` ("<what> process k stopped/failed") when one dies or reports a failure."""
    results: dict = {}
    waiting = dict(zip(conns, range(len(conns))))
    while waiting:
        for conn in multiprocessing.connection.wait(list(waiting)):
            k = waiting.pop(conn)
            try:
                status, got = conn.recv()
            except (EOFError, OSError):  # (OSError: it died in the middle of sending)
                raise error(f"{what} process {k} stopped: {how_it_ended(procs[k])}") from None
            if status != "ok":
                raise error(f"{what} process {k} failed: {got}")
            results[k] = got
    return results


def how_it_ended(proc) -> str:
    """How a forked process that stopped without its answer ended, for the error line: the signal that killed it
    (SIGKILL: the kernel's out-of-memory killer, or someone's kill -9; SIGSEGV: a crash) or its exit code."""
    proc.join(timeout=5)
    code = proc.exitcode
    if code is None:
        return "it closed its pipe and still runs"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = {signal.SIGKILL: " (out of memory? the kernel's OOM killer sends it)",
                signal.SIGSEGV: " (a crash)"}.get(-code, "")
        return f"killed by {name}{hint}"
    return f"exit code {code}"


def end_processes(procs: list, conns: list) -> None:
    """Ends the forked processes still running (an error in another) and closes the pipes."""
    for p in procs:
        if p.is_alive():
            p.terminate()
        p.join()
    for c in conns:
        c.close()


def _never_applied(event, step, line, origin) -> None:  # this process's lines are never events
    raise AssertionError(f"line {line} has a pool yet was routed as having none")


def _rises_paths(stage: Path, k: int) -> tuple[Path, Path]:
    """The files where process k writes the lines at which its latest applied event time rose, and those times."""
    return stage / f"_rises-j{k}.lines", stage / f"_rises-j{k}.times"


class _Rises:
    """A process's rises (lines and times, both increasing), read from its two files through mmap."""

    def __init__(self, stage: Path, k: int):
        self._maps: list = []
        self.lines, self.times = (self._view(p) for p in _rises_paths(stage, k))

    def _view(self, path: Path):
        with open(path, "rb") as f:
            if not path.stat().st_size:
                return memoryview(b"").cast("q")
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._maps.append(m)
        return memoryview(m).cast("q")

    def before(self, line: int) -> int:
        """The latest time this process applied before `line` (0: none)."""
        i = bisect_left(self.lines, line)
        return self.times[i - 1] if i else 0

    def close(self) -> None:
        self.lines.release()
        self.times.release()
        for m in self._maps:
            m.close()


def _merge(results: dict[int, dict], dead: list, route: array, pools: list[str], stage: Path, names: str,
           fold_config: FoldConfig, summary: RunSummary) -> dict:
    """Add the processes' counts to `summary` and write the `deadletters` table as one process would: each dead
    letter stamped with the latest event time applied before its line (by any pool), those before the first
    applied event with that event's time (0 when none was applied), in line order."""
    written: Counter = Counter()
    for k in sorted(results):
        r = results[k]
        summary.accepted += r["accepted"]
        summary.duplicates += r["duplicates"]
        summary.late += r["late"]
        written.update(r["written"])
        dead.extend(r["dead"])
    summary.lines = len(route)
    dead.sort(key=lambda d: d[0])
    rises = [_Rises(stage, k) for k in sorted(results)]
    try:
        firsts = [(r.lines[0], r.times[0]) for r in rises if len(r.lines)]
        first_at = min(firsts)[1] if firsts else 0  # the time of the file's first applied event
        writer = LakeWriter(stage, names)  # the names of a one-process run: this table's files are those it writes
        seen = 0
        for line, code, row in dead:
            seen = max([seen, *(r.before(line) for r in rises)])
            summary.dead_letters[code] += 1
            _note_line(summary, code, line)
            writer.add("deadletters", row[:3] + (seen or first_at,) + row[4:])
        written.update(writer.close())
    finally:
        for r in rises:
            r.close()
        for k in results:
            for path in _rises_paths(stage, k):
                path.unlink(missing_ok=True)
    summary.pools = sum(len(r["pools"]) for r in results.values())
    return {t: written[t] for t in TABLES if written.get(t)}


def _fleet(results: dict[int, dict], pools: list[str], fold_config: FoldConfig) -> Fleet:
    """The fleet of every process's pools, in order of first appearance in the file (as one process holds them)."""
    states = {}
    for r in results.values():
        states.update(r["pools"])
    return Fleet(fold_config, {p: PoolState.from_dict(states[p]) for p in pools if p in states})


def _worker(k: int, events_path: Path, stage: Path, names: str, fold_config: FoldConfig, topic: str,
            max_event_bytes: int, route: array, owner: list[int], pools: list[str], conn) -> None:
    """Fold the lines of the pools dealt to process `k` and write their rows; send ("ok", what it did) or
    ("error", why)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's process's to handle (it ends this one)
    embedded.forked_child()  # what came with the fork is not this process's garbage
    paused = GcPause()
    mine_of = bytes(1 if o == k else 0 for o in owner) + b"\0"  # index NO_POOL (-1): the last byte, not ours
    mine_pools = {p for p, o in zip(pools, owner) if o == k}
    writer = LakeWriter(stage, f"{names}-j{k}")
    columns = EventColumns(topic)  # the events rows in columns, handed to the writer every EVENTS_BATCH events
    outputs = StepOutputs(writer)  # the fact tables' rows, in columns at the same time
    gather = outputs.made.append
    fleet = Fleet(fold_config)
    summary = RunSummary(source=str(events_path), lake="", run_id=names)
    dead: list = []
    # where this process's latest applied event time rose: (line, time), appended to two files every RISES_BATCH
    rise_lines, rise_times = array("q"), array("q")
    Path(stage).mkdir(parents=True, exist_ok=True)
    rise_files = [open(p, "wb") for p in _rises_paths(stage, k)]
    seen = 0

    def flush_rises() -> None:
        rise_lines.tofile(rise_files[0])
        rise_times.tofile(rise_files[1])
        del rise_lines[:], rise_times[:]

    def misrouted(pool, line: int) -> None:
        if pool is not None and pool not in mine_pools:
            raise RunError(f"line {line}: its pool {pool[:64]!r} was read differently by the routing pass; "
                           f"run it with --jobs 1")

    def on_dead(row, code, line):
        misrouted(row[8], line)
        dead.append((line, code, row))

    def on_applied(event, step, line, origin):
        nonlocal seen
        if event.pool not in mine_pools:
            misrouted(event.pool, line)
        at = step.applied_at
        if at > seen:
            seen = at
            rise_lines.append(line)
            rise_times.append(at)
            if len(rise_lines) >= RISES_BATCH:
                flush_rises()
        columns.applied(event, line, step.occurred_s, at, step.lateness_s, origin)
        made = step.__dict__  # (StepOutputs.add, inline)
        if made:
            gather(made)
        if len(columns) >= embedded.EVENTS_BATCH:
            writer.add_batch("events", columns.batch())
            outputs.flush()

    try:
        embedded.fold_lines(events_path, fleet, summary, on_dead, on_applied, topic, max_event_bytes, paused,
                            None, mine=lambda n: mine_of[route[n - 1]])
        writer.add_batch("events", columns.batch())
        outputs.close(*fleet.close(), {**fleet.policy_rows(), **fleet.close_facts()})
        written = writer.close()
        flush_rises()
        for f in rise_files:
            f.close()
        conn.send(("ok", {"accepted": summary.accepted, "duplicates": summary.duplicates, "late": summary.late,
                          "written": written, "dead": dead,
                          "pools": {p: s.to_dict() for p, s in fleet.pools.items()}}))
    except Exception as exc:  # told to the run, which fails with it
        try:
            writer.wait()
        except Exception:  # noqa: BLE001
            pass
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        for f in rise_files:
            f.close()
        paused.end()
        conn.close()
