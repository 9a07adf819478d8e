"""The embedded run: fold a JSONL event file in-process with the ledger core, write the lake and the store.

This is the same core the Kafka worker uses; only the edges differ (a file instead of topics). Each run folds
its file from an empty state. The run writes its files (the events process's too) into a staging folder of the lake
and commits them in one manifest swap at its end (analytics/commits.py): until then no reader sees any of them, and
a run interrupted (Ctrl-C, SIGKILL) leaves the lake as it was; its staged files are removed by the next run. Bad lines become dead letters with their raw bytes; the run never stops for them.
A line longer than `[ledger] max_event_bytes` is never held whole: it is `too_large`, and its dead letter keeps
its first max_event_bytes bytes (the detail gives its size and sha256).
"""

from __future__ import annotations

import gc
import hashlib
import multiprocessing
import os
import shutil
import signal
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import orjson
import pyarrow as pa
from sqlalchemy.exc import SQLAlchemyError
from analytics.commits import (LakeLayoutError, clear_uncommitted, publish, read_manifest, staging_dir,
                                unlisted_parquet)
from analytics.lake import TABLES, LakeError, LakeWriter, clear_lake
from analytics.lake_rows import read_rows
import ledger
from ledger import Fleet, FoldConfig
from schemas import Rejection, RejectionCode, parse_event
from schemas.parse import DEFAULT_MAX_EVENT_BYTES, size_rejection
from streams import logline
from streams.rows import EventColumns, StepOutputs, deadletter_row, event_row  # noqa: F401 (event_row: re-export)

ProgressFn = Callable[[int], None]  # called with bytes read so far

# The cyclic garbage collector during a run (docs/benchmarks-history.md, issue 22 part 5). The fold makes almost no
# cyclic garbage (30 objects in 300,000 events: what it drops is freed by reference counting), but the run's
# process allocates many tracked containers that live long (the pools' state, the lake's buffered rows), and the
# collector's automatic passes over them (a young pass every 700 net allocations, an older one every tenth, a full
# one every hundredth) cost ~5% of the run's process. So the run turns automatic collection off (GcPause) and,
# every 65,536 lines, collects the young objects once (the cycles those lines made are freed, so memory stays
# bounded) and moves what survives into the permanent generation (gc.freeze), which no later pass scans. At its
# end it unfreezes and turns collection back on. The events process does the same per 65,536 rows;
# bench/replay.py folds the same way.
GC_FREEZE_MASK = 0xFFFF


_FORKED_CHILD = False


def forked_child() -> None:
    """The first thing a process forked to do part of a command's work does (a fold process of `--jobs`, the events
    process, a part of `lake upgrade`, a backtest's worker): every object it came with is frozen, never collected
    here, and stays so. The parent's garbage holds objects whose finalizers must not run in a copy of the parent: a
    DuckDB connection (its destructor stops threads the copy does not have), Arrow's buffers; a parent that ran other
    work first (the test suite's process) has plenty. CI: three forked processes died of a segmentation fault while
    collecting it ("Garbage-collecting")."""
    global _FORKED_CHILD
    _FORKED_CHILD = True
    gc.freeze()


class GcPause:
    """Automatic cyclic collection off from its making until `end()` (then as it was found), with `checkpoint()`
    every GC_FREEZE_MASK + 1 lines; `end()` also empties the permanent generation (not in a forked process: what it
    came with stays frozen, see forked_child). Also a context manager."""

    def __init__(self) -> None:
        self.enabled = gc.isenabled()
        gc.disable()

    @staticmethod
    def checkpoint() -> None:
        gc.collect(0)  # with automatic collection off, everything allocated since the last checkpoint is young
        gc.freeze()

    def end(self) -> None:
        if not _FORKED_CHILD:
            gc.unfreeze()  # what the run froze may be collected again (the caller keeps the fleet or drops it)
        if self.enabled:
            gc.enable()

    def __enter__(self) -> "GcPause":
        return self

    def __exit__(self, *exc) -> None:
        self.end()


DEAD_LINES_KEPT = 20  # line numbers of dead letters kept per code in the summary (all are in the lake)
UTF8_BOM = b"\xef\xbb\xbf"  # what Windows tools write at the start of a UTF-8 file: not part of the first event


class RunError(RuntimeError):
    pass


class RunInterrupted(RunError):
    """The run was interrupted (Ctrl-C) before its commit: nothing of it is in the lake or the store."""


@dataclass
class RunSummary:
    source: str
    lake: str
    run_id: str
    lines: int = 0
    blank: int = 0
    accepted: int = 0
    duplicates: int = 0
    late: int = 0
    dead_letters: Counter = field(default_factory=Counter)
    dead_letter_lines: dict = field(default_factory=dict)  # code -> the first DEAD_LINES_KEPT line numbers
    rows_written: dict = field(default_factory=dict)
    pools: int = 0
    seconds: float = 0.0
    core: str = field(default_factory=lambda: ledger.CORE)  # the fold compiled or as plain Python (ledger/_compiled.py)
    commit: int = 0  # the lake's commit that made the run's files its books

    @property
    def dead_letter_total(self) -> int:
        return sum(self.dead_letters.values())

    def as_dict(self) -> dict:
        return {
            "source": self.source, "lake": self.lake, "run_id": self.run_id, "lines": self.lines,
            "blank": self.blank, "accepted": self.accepted, "duplicates": self.duplicates, "late": self.late,
            "dead_letters": dict(sorted(self.dead_letters.items())),
            "dead_letter_lines": dict(sorted(self.dead_letter_lines.items())), "rows_written": dict(self.rows_written),
            "pools": self.pools, "seconds": round(self.seconds, 3), "core": self.core, "commit": self.commit,
        }


def _note_line(summary: RunSummary, code: str, lineno: int) -> None:
    lines = summary.dead_letter_lines.setdefault(code, [])
    if len(lines) < DEAD_LINES_KEPT:
        lines.append(lineno)


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=6)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _lines(f, max_bytes: int):
    """(line, bytes read, too_large) for each line of a binary file. A line of at most max_bytes bytes (without
    its end) comes whole and `too_large` is None; a longer one is read on in chunks, never held whole: `line`
    is its first max_bytes bytes and `too_large` the Rejection naming its size and sha256."""
    readline = f.readline
    limit = max_bytes + 2  # the line's end (\r\n) may come on top
    while True:
        line = readline(limit)
        if not line:
            return
        ended = line[-1:] == b"\n"
        if len(line) <= max_bytes or (ended and len(line.rstrip(b"\r\n")) <= max_bytes):
            yield line, len(line), None
            continue
        digest = hashlib.sha256()
        head = line[:max_bytes]
        read = size = 0
        chunk = line
        while chunk:
            read += len(chunk)
            if chunk[-1:] == b"\n":
                chunk = chunk.rstrip(b"\r\n")
                digest.update(chunk)
                size += len(chunk)
                break
            digest.update(chunk)
            size += len(chunk)
            chunk = readline(1 << 20)
        yield head, read, size_rejection(size, max_bytes, digest.hexdigest())


# A plain file has no append time (docs/events.md, "Clocks ahead"). An event that would move its pool's clock more
# than FILE_TOLERANCE ahead (max(max_clock_skew_s, dedup_window_s)) is judged by the file's own next lines of that
# pool (at most LOOKAHEAD_POOL_LINES of them, within LOOKAHEAD_LINES lines of the file): an honest gap is followed
# by lines at or after it; the lines after one event far ahead are far behind it. Only the pool's other sources
# vouch while one is in reach (a fast source's own next lines are as fast). Later lines may honestly be late
# by up to the dedup window (the fold applies them), so they vouch for an event up to that far ahead of them; an
# event further ahead of the latest of them is `clock_ahead` and not folded: it could only have made them too_late.
# With no later line of the pool in reach there is nothing to judge it by, and nothing after it to harm: it is folded.
LOOKAHEAD_LINES = 100_000
LOOKAHEAD_POOL_LINES = 16


def file_tolerance_s(config: FoldConfig) -> int:
    """How far ahead of its pool's next lines a plain file's event may be (see above)."""
    return max(config.max_clock_skew_s, config.dedup_window_s)


def _latest_next_s(path: Path, at: int, event, max_bytes: int, tolerance_s: int) -> Optional[int]:
    """The latest event time of the next lines of `event`'s pool after byte `at` of the file at `path` (None: no
    such line within reach). It stops at the first line that vouches for the event (at most tolerance_s before it):
    an honest gap costs a read up to the pool's next line. Only the pool's other sources vouch while any is in
    reach: a source whose clock runs fast (or two lines far ahead) cannot vouch for itself; a file with no other
    source of the pool in reach is judged by that source's own next lines."""
    vouch = event.at_s - tolerance_s
    # the pool as JSON text, unquoted (an export line quotes it again): a cheap filter before a line is parsed
    needle = orjson.dumps(event.pool)[1:-1]
    latest: Optional[int] = None  # of the other sources' lines
    own: Optional[int] = None  # of the event's own source's lines
    found = 0
    with open(path, "rb") as f:
        f.seek(at)
        for i, (line, _, too_large) in enumerate(_lines(f, max_bytes)):
            if i >= LOOKAHEAD_LINES or found >= LOOKAHEAD_POOL_LINES:
                break
            if too_large is not None or needle not in line:
                continue
            raw = line.rstrip(b"\r\n")
            if logline.is_wrapped(raw):
                un = logline.unwrap(raw)
                if isinstance(un, Rejection):
                    continue
                raw = un[0]
            other = parse_event(raw, max_bytes)
            if isinstance(other, Rejection) or other.pool != event.pool:
                continue
            t = other.at_s
            if other.source == event.source:
                own = t if own is None else max(own, t)
                continue
            found += 1
            if t >= vouch:
                return t
            if latest is None or t > latest:
                latest = t
    return latest if found else own


def _ahead_of_file(events_path: Path, at: int, event, pools: dict, config: FoldConfig,
                   max_bytes: int) -> Optional[Rejection]:
    """`clock_ahead` for a plain line whose event would move its pool's clock (or start a pool) further ahead than
    the file's next lines of that pool vouch for; None otherwise (see FILE_TOLERANCE above)."""
    state = pools.get(event.pool)
    tolerance = file_tolerance_s(config)
    t = event.at_s
    if state is None:
        if event.type != "pool.configured":
            return None
    elif not tolerance < t - state.clock <= config.max_clock_jump_s:  # (further: clock_jump, the fold's)
        return None
    latest = _latest_next_s(events_path, at, event, max_bytes, tolerance)
    if latest is None or t - latest <= tolerance:
        return None
    return Rejection(RejectionCode.clock_ahead,
                     f"event time {_utc(t)} UTC is {t - latest} s ahead of the latest of the next lines of pool "
                     f"{event.pool[:128]!r} in this file ({_utc(latest)} UTC), more than they may be late "
                     f"({tolerance} s: the larger of [ledger] max_clock_skew_s and dedup_window_s): a file has no "
                     f"append time, so its own later lines are the evidence; not applied, the pool clock is not "
                     f"moved (docs/events.md, Clocks ahead)")


def _utc(t: int) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _raw(line: bytes, offset: int) -> bytes:
    """The message of a line: without its end, and without a UTF-8 byte order mark at the start of the file."""
    raw = line.rstrip(b"\r\n")
    if offset == 1 and raw.startswith(UTF8_BOM):
        raw = raw[3:]
    return raw


class _EventsHere:
    """The `events` rows written by the run's own lake writer, in this process (where there is no fork): gathered
    in columns, handed to the writer every EVENTS_BATCH events."""

    def __init__(self, writer: LakeWriter, topic: str):
        self.writer = writer
        self.columns = EventColumns(topic)
        self.rows = 0

    def applied(self, event, step, offset: int, origin: Optional[str] = None) -> None:
        columns = self.columns
        columns.applied(event, offset, step.occurred_s, step.applied_at, step.lateness_s, origin)
        if len(columns) >= EVENTS_BATCH:
            self._flush()

    def _flush(self) -> None:
        self.rows += len(self.columns)
        self.writer.add_batch("events", self.columns.batch())

    def finish(self) -> None:
        """Hand on what is left (before the writer closes)."""
        self._flush()

    def close(self) -> int:
        return self.rows

    def stop(self) -> None:
        pass


# the events process: what the fold said about each applied event, sent in batches of this many events
EVENTS_BATCH = 4096
# the messages to the events process: a batch of numbers (line, event time, applied time, lateness per event), or
# a file of the run's writer to encode (its path; its rows in Arrow's IPC format beside it, named with IPC_SUFFIX);
# an empty message is the end
_NUMBERS, _FILE = b"n", b"f"
IPC_SUFFIX = ".arrow-ipc"


class _EventsProcess:
    """The `events` table written by a second process, beside the fold: it reads the same file, parses the lines
    the fold applied (the same pure `parse_event`, so the same events) and writes their rows, each with the
    event time, the applied time and the lateness the fold sent for it. The run's process sends those three
    numbers and the line number per applied event (32 bytes) instead of building the row, its canonical JSON and
    its Arrow columns: on a machine with two cores the lake's largest table is written while the fold goes on.
    The files are the ones the run's own writer would write (same names, same rows in the same order).
    It also encodes the run's own files (the fact tables and dead letters: `encode`), whose Parquet encoding in
    the run's threads cost the fold ~0.6 s of 8.5 at 300k events (their Python parts hold its GIL)."""

    def __init__(self, events_path: Path, lake: Path, run_id: str, topic: str, max_event_bytes: int):
        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_events_child, name="chipledger-events",
                                 args=(events_path, lake, run_id, topic, max_event_bytes, child), daemon=True)
        self._proc.start()
        child.close()
        self._batch = array("q")
        self.rows = 0

    def applied(self, event, step, offset: int, origin: Optional[str] = None) -> None:
        # (the events process reads the line's origin itself)
        batch = self._batch
        batch.extend((offset, step.occurred_s, step.applied_at, step.lateness_s))
        if len(batch) >= 4 * EVENTS_BATCH:
            self._send()

    def _send(self) -> None:
        self.rows += len(self._batch) // 4
        self._message(_NUMBERS + self._batch.tobytes())
        self._batch = array("q")

    def _message(self, message: bytes) -> None:
        try:
            self._conn.send_bytes(message)
        except (BrokenPipeError, ConnectionResetError):
            raise RunError(self._failure()) from None

    def encode(self, data: pa.Table, path: Path) -> None:
        """A file of the run's own lake writer (LakeWriter's `encode`), written by this process: the rows go to a
        file beside it in Arrow's IPC format (a copy of their memory, without the GIL) and its name through the
        pipe (never blocking on the other process); the process encodes the Parquet file and removes the IPC
        file. The files are the ones the run's writer would write itself."""
        staged = path.with_name(path.name + IPC_SUFFIX)
        with pa.OSFile(str(staged), "wb") as sink, pa.ipc.new_file(sink, data.schema) as out:
            out.write_table(data)
        self._message(_FILE + os.fsencode(path))

    def finish(self) -> None:
        """Send what is left (perhaps nothing: a message of numbers, never the end; before the writer's last
        files)."""
        self._send()

    def close(self) -> int:
        """Send the end, wait for the process to write its files (and the run's writer's), return the rows it
        wrote to the events table."""
        try:
            self._conn.send_bytes(b"")  # the end
            status, what = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise RunError(self._failure()) from None
        self._proc.join()
        if status != "ok":
            raise RunError(f"writing the lake in the events process failed: {what}")
        if what != self.rows:
            raise RunError(f"the events process wrote {what} rows, the run applied {self.rows}")
        return what

    def _failure(self) -> str:
        try:  # the process may have said why before it stopped reading
            if self._conn.poll(1):
                status, what = self._conn.recv()
                if status != "ok":
                    return f"writing the lake in the events process failed: {what}"
        except (EOFError, OSError):
            pass
        from chipledger.parallel import how_it_ended  # (parallel imports this module)

        return f"the process writing the lake's events table and files stopped: {how_it_ended(self._proc)}"

    def stop(self) -> None:
        """End the process if it is still running (the run failed before `close`)."""
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join()
        self._conn.close()


def _events_child(events_path: Path, lake: Path, run_id: str, topic: str, max_event_bytes: int, conn) -> None:
    """The events process's work (see _EventsProcess): read batches of (line number, event time, applied time,
    lateness) until an empty one, write those lines' rows, answer ("ok", rows written) or ("error", why)."""
    # Ctrl-C reaches the whole process group: the run's process decides (it stops this one), so no second
    # KeyboardInterrupt and traceback from here
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    forked_child()  # what came with the fork (the run's modules and state) is not this process's garbage
    paused = GcPause()  # the collector as in the run's process (see GC_FREEZE_MASK)
    writer = LakeWriter(lake, run_id)
    columns = EventColumns(topic)  # the rows in columns, a batch of them per batch received
    add = columns.add
    rows = 0
    try:
        with open(events_path, "rb") as f:
            lines = enumerate(_lines(f, max_event_bytes), start=1)
            while True:
                message = conn.recv_bytes()
                if not message:  # the end
                    break
                if message[:1] == _FILE:  # a file of the run's writer (_EventsProcess.encode)
                    path = Path(os.fsdecode(message[1:]))
                    staged = path.with_name(path.name + IPC_SUFFIX)
                    data = pa.ipc.open_file(pa.py_buffer(staged.read_bytes())).read_all()
                    staged.unlink()
                    writer.encode_file(data, path)
                    continue
                batch = array("q")
                batch.frombytes(message[1:])
                if not batch:
                    continue
                for offset in batch[0::4]:
                    for n, (line, _, _) in lines:
                        if n == offset:
                            break
                    raw = _raw(line, offset)
                    origin = None
                    if logline.is_wrapped(raw):  # (the run applied it: a well-formed export line)
                        raw, origin, _ = logline.unwrap(raw)
                    add(parse_event(raw, max_event_bytes), origin)
                    rows += 1
                    if not rows & GC_FREEZE_MASK:
                        paused.checkpoint()
                columns.numbers = batch  # (line number, event time, applied time, lateness) per event, as sent
                writer.add_batch("events", columns.batch())
        writer.close()
        conn.send(("ok", rows))
    except Exception as exc:  # told to the run, which fails with it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        paused.end()
        conn.close()


def cores() -> int:
    """The cores this process may run on (the default of `--jobs`)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, n or 1)


def _events_table(events_path: Path, lake: Path, run_id: str, topic: str, max_event_bytes: int,
                  events_process: bool):
    """(where the `events` rows go, the run's lake writer): with an events process (`events_process`, where
    processes fork, on more than one core) that process also encodes the writer's files (_EventsProcess.encode)."""
    if events_process and "fork" in multiprocessing.get_all_start_methods() and cores() > 1:
        events = _EventsProcess(events_path, lake, run_id, topic, max_event_bytes)
        return events, LakeWriter(lake, run_id, encode=events.encode)
    writer = LakeWriter(lake, run_id)
    return _EventsHere(writer, topic), writer


def fold_lines(events_path: Path, fleet: Fleet, summary: RunSummary, dead, applied, topic: str,
               max_event_bytes: int, paused: GcPause, progress: Optional[ProgressFn] = None,
               mine=None) -> tuple[int, int]:
    """Fold the lines of the file at `events_path` into `fleet`: the one per-line rule of a run, used by the run's
    process (chipledger.embedded.run_file) and by each process of a pool-parallel run (chipledger.parallel).
    `dead(row, code, line)` gets each dead letter (its row's seen_at is 0: the caller stamps it) and
    `applied(event, step, line, origin)` each applied event (`origin`: a `log export` line's, else None); blank
    lines, duplicates and late events are counted in `summary`. `mine`: when given, a function of the line number
    saying whether this process folds that line (the others are read past). Returns (the number of lines, the bytes
    read)."""
    pools = fleet.pools
    fold_config = fleet.config
    tolerance_s = file_tolerance_s(fold_config)
    export_prefix = logline.PREFIX
    read_bytes = offset = 0
    with open(events_path, "rb") as f:
        for offset, (line, n, too_large) in enumerate(_lines(f, max_event_bytes), start=1):
            read_bytes += n
            if not offset & GC_FREEZE_MASK:
                paused.checkpoint()
            if progress is not None and offset % 4096 == 0:
                progress(read_bytes)
            if mine is not None and not mine(offset):
                continue
            if too_large is not None:
                dead(deadletter_row(line, too_large, topic, 0, offset, 0), too_large.code.value, offset)
                continue
            raw = _raw(line, offset) if offset == 1 else line.rstrip(b"\r\n")  # (_raw: the first line may have a BOM)
            if not raw or raw.isspace():  # (bytes.strip's blanks; no copy of the line)
                summary.blank += 1
                continue
            origin = appended = None
            if raw.startswith(export_prefix):  # a line of a `log export`: the record's value, its append time and origin
                un = logline.unwrap(raw)
                if isinstance(un, Rejection):
                    dead(deadletter_row(raw, un, topic, 0, offset, 0), un.code.value, offset)
                    continue
                raw, origin, appended = un
            event = parse_event(raw, max_event_bytes)
            if isinstance(event, Rejection):
                dead(deadletter_row(raw, event, topic, 0, offset, 0), event.code.value, offset)
                continue
            # no append time (a plain line, or an export line without one): one that would move its pool's clock
            # far is checked against the file's later lines
            if appended is None:
                pool_state = pools.get(event.pool)
                # (the aware time's float seconds are never below its whole seconds, `at_s`, nor a second above:
                # only an event they put ahead pays for the exact check, a Python property)
                if (event.occurred_at.timestamp() - pool_state.clock > tolerance_s
                        and event.at_s - pool_state.clock > tolerance_s if pool_state is not None
                        else event.type == "pool.configured"):
                    ahead = _ahead_of_file(events_path, f.tell(), event, pools, fold_config, max_event_bytes)
                    if ahead is not None:
                        dead(deadletter_row(raw, ahead, topic, 0, offset, 0, event), ahead.code.value, offset)
                        continue
            step = fleet.apply(event, raw, origin, appended)
            if step.rejection is not None:
                dead(deadletter_row(raw, step.rejection, topic, 0, offset, 0, event), step.rejection.code.value,
                     offset)
                continue
            if step.duplicate:
                summary.duplicates += 1
                continue
            summary.accepted += 1
            if step.lateness_s:
                summary.late += 1
            applied(event, step, offset, origin)
    return offset, read_bytes


def run_file(events_path: Path, lake: Path, *, fold_config: FoldConfig = FoldConfig(), overwrite: bool = False,
             progress: Optional[ProgressFn] = None, store=None,
             max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
             events_process: bool = True, jobs: int = 1) -> tuple[RunSummary, Fleet]:
    """Fold `events_path` into a fresh lake at `lake`, then save balances to `store` (a store.Store).
    `max_event_bytes` is [ledger] max_event_bytes: a longer line is a `too_large` dead letter. With
    `events_process` (and where processes can fork, with more than one core) the `events` table is written by a
    second process beside the fold (_EventsProcess); the lake is the same either way. With `jobs` > 1 (where
    processes can fork) `jobs` processes fold disjoint sets of pools (chipledger.parallel): the lake has the same
    rows as with one."""
    events_path, lake = Path(events_path), Path(lake)
    if not events_path.is_file():
        raise RunError(f"events file {events_path} does not exist")
    from analytics.commits import LakeBusy, writing

    try:
        with writing(lake, f"chipledger run of {events_path.name}"):
            return _run_file(events_path, lake, fold_config, overwrite, progress, store, max_event_bytes,
                             events_process, jobs)
    except LakeBusy as e:
        raise RunError(str(e)) from None


def _run_file(events_path: Path, lake: Path, fold_config: FoldConfig, overwrite: bool, progress, store,
              max_event_bytes: int, events_process: bool, jobs: int) -> tuple[RunSummary, Fleet]:
    previous = _previous_commit(lake, overwrite)
    started = time.monotonic()
    started_wall = datetime.now(timezone.utc)
    run_id = file_digest(events_path)
    summary = RunSummary(source=str(events_path), lake=str(lake), run_id=run_id)
    # file names: the input's digest (the same input gives the same names); replacing a lake's books, the commit's
    # number too, so no staged file has a committed file's name
    names = run_id if not previous else f"{run_id}-c{previous + 1}"
    stage = staging_dir(lake, f"run-{names}")
    topic = f"file:{events_path.name}"
    parallel = jobs > 1 and "fork" in multiprocessing.get_all_start_methods()
    try:
        if parallel:
            from chipledger.parallel import fold_parallel

            written, fleet, read_bytes = fold_parallel(events_path, stage, names, fold_config, summary, topic,
                                                       max_event_bytes, jobs, progress)
        else:
            written, fleet, read_bytes = _fold_here(events_path, stage, names, fold_config, summary, topic,
                                                    max_event_bytes, events_process, progress)
    except BaseException as exc:
        # nothing of this run is committed: its staged files go (the next run would remove them too)
        shutil.rmtree(stage, ignore_errors=True)
        if isinstance(exc, KeyboardInterrupt):
            raise RunInterrupted(f"interrupted: nothing of this run was committed to lake {lake} (it is as it was); "
                                 f"run it again (no --overwrite needed for what never committed)") from None
        raise
    summary.rows_written = {t: written[t] for t in TABLES if t in written}  # in lake table order
    summary.pools = len(fleet.pools)
    if progress is not None:
        progress(read_bytes)
    # the commit and the store's record of the run: Ctrl-C waits for them (a second or two), so an interrupted run
    # is either wholly committed or not at all
    with _sigint_deferred():
        try:
            summary.commit = publish(lake, stage, by=f"run {run_id} of {events_path.name}", replace=TABLES,
                                     grace_s=0)
        except LakeError as e:
            shutil.rmtree(stage, ignore_errors=True)
            raise RunError(str(e)) from None
        summary.seconds = time.monotonic() - started
        if store is not None:
            try:
                _save(store, lake, summary, fleet, run_id, started_wall, events_path, topic)
            except SQLAlchemyError as e:  # (one transaction: the store is as it was)
                raise RunError(f"lake {lake} is committed (commit {summary.commit}), but the store could not record "
                               f"the run: {store.describe(e)}; the store is as it was before the run: fix it and run "
                               f"again with --overwrite") from None
    return summary, fleet


def _save(store, lake: Path, summary: RunSummary, fleet: Fleet, run_id: str, started_wall: datetime,
          events_path: Path, topic: str) -> None:
    """The store's record of a committed run: its pools' balances, the run, the input's position, its decisions."""
    store.save(
        fleet.pools.values(),
        run={"run_id": f"{run_id}-{started_wall:%Y%m%dT%H%M%S}", "kind": "embedded",
             "source": str(events_path), "lake": str(lake), "started_at": started_wall,
             "finished_at": datetime.now(timezone.utc), "lines": summary.lines, "accepted": summary.accepted,
             "duplicates": summary.duplicates, "dead_letters": summary.dead_letter_total,
             "summary_json": summary.as_dict()},
        tracking=[("embedded", topic, 0, summary.lines)],
        replace_all=True,  # the run folded from an empty state: pools of earlier runs are not current
        decisions=read_rows(lake, "decisions"),  # the run's decisions, indexed (replacing earlier runs')
    )


def _fold_here(events_path: Path, stage: Path, names: str, fold_config: FoldConfig, summary: RunSummary, topic: str,
               max_event_bytes: int, events_process: bool, progress: Optional[ProgressFn]) -> tuple[dict, Fleet, int]:
    """The run's fold in this process (the `events` table, with `events_process`, in a second one): the lake's
    files written to `stage`; returns (rows written by table, the fleet, bytes read)."""
    events, writer = _events_table(events_path, stage, names, topic, max_event_bytes, events_process)
    fleet = Fleet(fold_config)
    seen_clock = 0  # the latest event time applied so far: when a dead letter was seen, in event time
    early: list = []  # dead letters before any event was applied: stamped with the first applied time
    add = writer.add
    outputs = StepOutputs(writer)  # the fact tables' rows, handed to the writer in columns every EVENTS_BATCH events
    gather = outputs.made.append
    unflushed = 0

    def dead(row: tuple, code: str, offset: int) -> None:
        summary.dead_letters[code] += 1
        _note_line(summary, code, offset)
        if seen_clock:
            add("deadletters", row[:3] + (seen_clock,) + row[4:])
        else:
            early.append(row)

    def applied(event, step, offset: int, origin: Optional[str]) -> None:
        nonlocal seen_clock, unflushed
        at = step.applied_at
        if at > seen_clock:
            seen_clock = at
            if early:  # the dead letters that came before any applied event
                for row in early:
                    add("deadletters", row[:3] + (at,) + row[4:])
                early.clear()
        events.applied(event, step, offset, origin)
        made = step.__dict__  # (StepOutputs.add, inline)
        if made:
            gather(made)
        unflushed += 1
        if unflushed == EVENTS_BATCH:
            outputs.flush()
            unflushed = 0

    try:
        paused = GcPause()
        try:
            offset, read_bytes = fold_lines(events_path, fleet, summary, dead, applied, topic, max_event_bytes,
                                            paused, progress)
            summary.lines = offset if read_bytes else 0
            for row in early:  # no event was applied at all: the dead letters keep time 0 (1970-01-01)
                add("deadletters", row)
            outputs.close(*fleet.close(), {**fleet.policy_rows(), **fleet.close_facts()})
            events.finish()
            written = writer.close()  # (with an events process, its last files go there before the end does)
            events_written = events.close()
        finally:
            events.stop()
            paused.end()
        if events_written:
            written["events"] = events_written
    except BaseException:
        try:
            writer.wait()
        except Exception:  # noqa: BLE001 - a write failing now changes nothing: the caller removes the folder
            pass
        raise
    return written, fleet, read_bytes


def _previous_commit(lake: Path, overwrite: bool) -> int:
    """Check the lake a run is about to replace and return its commit number (0: no books yet). Staged files of an
    interrupted run are removed; a lake with books needs `overwrite`; a lake written before commits (or with a
    broken manifest) is cleared with `overwrite` (its files are not this layout's)."""
    clear_uncommitted(lake)
    try:
        m = read_manifest(lake)
    except LakeLayoutError as e:
        if not overwrite:
            raise RunError(f"{e} (or pass --overwrite to replace the lake)") from None
        clear_lake(lake)
        return 0
    if m is None:
        if unlisted_parquet(lake):
            if not overwrite:
                raise RunError(f"lake {lake} already has data (written before commits); pass --overwrite to replace "
                               f"it, or choose another --lake")
            clear_lake(lake)
        return 0
    if any(m["tables"].get(t) for t in TABLES):
        if not overwrite:
            raise RunError(f"lake {lake} already has data; pass --overwrite to replace it, or choose another --lake")
    return int(m.get("commit", 0))


class _sigint_deferred:
    """SIGINT held back while the block runs (in the main thread; elsewhere a no-op): a Ctrl-C then comes after it."""

    def __enter__(self):
        self.blocked = hasattr(signal, "pthread_sigmask") and threading_is_main()
        if self.blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        return self

    def __exit__(self, *exc):
        if self.blocked:
            try:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            except KeyboardInterrupt:  # the Ctrl-C held back: the run is committed, so it is done
                pass
        return False


def threading_is_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
