"""The embedded run's events process (chipledger/embedded.py, _EventsProcess): the `events` table written by a
second process beside the fold gives the very files the run's own writer gives, bad lines, duplicates and late
events included, and a failure of that process fails the run instead of leaving a lake without events."""

from __future__ import annotations

import gc
import json
import multiprocessing

import pytest

from analytics.lake import TABLES
from chipledger.demo import write_events
from chipledger.embedded import RunError, run_file

pytestmark = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")


def _with_bad_lines(path):
    """A seeded fleet's file with a byte order mark, a duplicate, a conflicting duplicate, a late event and
    lines that are not events, spread through it."""
    lines = path.read_bytes().splitlines()
    first = json.loads(lines[40])
    late = {**json.loads(lines[300]), "event_id": "late-1", "type": "pool.tick"}
    late = {k: late[k] for k in ("event_id", "type", "occurred_at", "pool", "source")}
    bad = [b"not json", b'{"type": "job.started"}', lines[40], json.dumps({**first, "source": "x"}).encode(),
           json.dumps(late).encode(), b"", b"[1, 2]"]
    out = [b"\xef\xbb\xbf" + lines[0]]
    for i, line in enumerate(lines[1:], 1):
        out.append(line)
        if i % 500 == 0:
            out.append(bad[(i // 500) % len(bad)])
    path.write_bytes(b"\n".join(out) + b"\n")


def _files(lake):
    return {str(p.relative_to(lake)): p.read_bytes() for p in sorted(lake.rglob("*.parquet"))}


def test_the_events_process_writes_the_files_the_run_would(tmp_path):
    events = tmp_path / "events.jsonl"
    write_events(events, seed=3, days=3)
    _with_bad_lines(events)
    (a, _), (b, _) = (run_file(events, tmp_path / f"lake-{how}", events_process=how == "process")
                      for how in ("process", "here"))
    assert a.accepted > 3_000 and a.dead_letter_total >= 5 and a.duplicates >= 1
    assert a.rows_written == b.rows_written and list(a.rows_written) == [t for t in TABLES if t in a.rows_written]
    assert (a.accepted, a.duplicates, a.dead_letters, a.late) == (b.accepted, b.duplicates, b.dead_letters, b.late)
    fa, fb = _files(tmp_path / "lake-process"), _files(tmp_path / "lake-here")
    assert any(name.startswith("events/") for name in fa)
    assert fa.keys() == fb.keys()
    assert [name for name in fa if fa[name] != fb[name]] == []


def test_a_failed_events_process_fails_the_run(tmp_path, monkeypatch):
    import chipledger.embedded as embedded

    events = tmp_path / "events.jsonl"
    write_events(events, seed=3, days=1)
    lake = tmp_path / "lake"
    lake.mkdir()

    def broken(*args):  # only the events process gathers events rows (it inherits this by the fork)
        raise OSError("the disk of the events table failed")

    monkeypatch.setattr(embedded.EventColumns, "add", broken)
    with pytest.raises(RunError, match="events table failed"):
        run_file(events, lake)
    staging = lake / "_staging"
    assert not (lake / "_lake.json").exists() and not (staging.exists() and any(staging.iterdir()))  # nothing left
    assert multiprocessing.active_children() == []  # nothing left running
    assert gc.isenabled() and gc.get_freeze_count() == 0  # the collector given back (chipledger.embedded.GcPause)


@pytest.mark.parametrize("applied", [0, 1, 4096, 4097])
def test_the_end_is_sent_once_whatever_the_count(tmp_path, monkeypatch, applied):
    """An empty batch is the end for the events process: `close` sends it once and never an empty batch before it
    (CI: a run that applied 0 events, or 4096·k, sent two; the process stopped at the first, and the second met a
    closed pipe now and then: "the process writing the lake's events table stopped (exit code 0)")."""
    from multiprocessing.connection import Connection

    events = tmp_path / "events.jsonl"
    write_events(events, seed=3, days=3)
    lines = events.read_bytes().splitlines()[:4200]
    first, _ = run_file(events, tmp_path / "first", events_process=False)  # (the demo has a few bad lines)
    bad = {n for ns in first.dead_letter_lines.values() for n in ns}
    lines = [line for n, line in enumerate(lines, 1) if n not in bad][:applied]
    events.write_bytes(b"".join(line + b"\n" for line in lines) + b"not json\n")
    sent = []
    send_bytes = Connection.send_bytes
    monkeypatch.setattr(Connection, "send_bytes", lambda self, buf, *a: (sent.append(len(buf)), send_bytes(self, buf, *a))[1])
    summary, _ = run_file(events, tmp_path / "lake")
    assert (summary.accepted, summary.dead_letter_total) == (applied, 1)
    assert summary.rows_written.get("events", 0) == summary.accepted
    assert sent and sent[-1] == 0 and sent.count(0) == 1, sent


def test_events_gathered_in_columns_are_the_files_of_their_rows(tmp_path):
    # the run writes `events` in columns (streams.rows.EventColumns, LakeWriter.add_batch); the Kafka sink and
    # earlier versions wrote rows (applied_event_row, LakeWriter.add): the files must be the same, byte for byte,
    # with days going back and forth, files cut at flush_rows and lines with an origin
    from analytics.lake import LakeWriter
    from schemas import Rejection, parse_event
    from streams.rows import EventColumns, applied_event_row

    path = tmp_path / "events.jsonl"
    write_events(path, seed=3, days=2)
    events = [e for e in map(parse_event, path.read_bytes().splitlines()) if not isinstance(e, Rejection)]
    by_rows, in_columns = LakeWriter(tmp_path / "rows", "r", flush_rows=700), LakeWriter(tmp_path / "cols", "r",
                                                                                         flush_rows=700)
    columns = EventColumns("file:events.jsonl")
    for i, e in enumerate(events):
        applied = e.at_s + (i % 4) * 30_000  # rows of two or three days interleaved
        origin = "cluster-a" if i % 37 == 0 else None
        by_rows.add("events", applied_event_row(e, e.at_s, applied, i % 3, "file:events.jsonl", 0, i + 1, origin))
        columns.applied(e, i + 1, e.at_s, applied, i % 3, origin)
        if len(columns) == 500:
            in_columns.add_batch("events", columns.batch())
    in_columns.add_batch("events", columns.batch())
    assert by_rows.close() == in_columns.close() == {"events": len(events)}
    fa, fb = _files(tmp_path / "rows"), _files(tmp_path / "cols")
    assert len(fa) >= 2 * 3 and fa.keys() == fb.keys()
    assert [name for name in fa if fa[name] != fb[name]] == []


def test_fact_rows_gathered_per_step_are_the_files_of_their_rows(tmp_path):
    # the run hands the fold's fact rows to its writer in columns every few thousand steps (streams.rows.StepOutputs,
    # LakeWriter.add_rows, split by day by Arrow); row by row (LakeWriter.add of each step's rows, then the close of
    # the books) gives the same files, byte for byte, files cut at flush_rows included
    from analytics.lake import LakeWriter
    from ledger import Fleet, FoldConfig
    from schemas import Rejection, parse_event
    from streams.rows import StepOutputs, close_rows, output_lists

    path = tmp_path / "events.jsonl"
    write_events(path, seed=5, days=3)
    lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    by_rows, in_columns = (LakeWriter(tmp_path / name, "r", flush_rows=900) for name in ("rows", "cols"))
    fleets = Fleet(FoldConfig()), Fleet(FoldConfig())
    outputs = StepOutputs(in_columns)
    for i, line in enumerate(lines):
        e = parse_event(line)
        if isinstance(e, Rejection):
            continue
        step, again = fleets[0].apply(e, line), fleets[1].apply(e, line)
        for table, rows in output_lists(step):
            for row in rows:
                by_rows.add(table, row)
        outputs.add(again)
        if i % 333 == 0:
            outputs.flush()
    for table, row in close_rows(*fleets[0].close(), {**fleets[0].policy_rows(), **fleets[0].close_facts()}):
        by_rows.add(table, row)
    outputs.close(*fleets[1].close(), {**fleets[1].policy_rows(), **fleets[1].close_facts()})
    written = by_rows.close()
    assert in_columns.close() == written and len(written) >= 6 and max(written.values()) > 900
    fa, fb = _files(tmp_path / "rows"), _files(tmp_path / "cols")
    assert len(fa) > 3 * len(written) and fa.keys() == fb.keys()
    assert [name for name in fa if fa[name] != fb[name]] == []


@pytest.mark.parametrize("times", [
    [5, 6, 7], [86_399, 86_400, 86_399, 3 * 86_400 + 1, 3 * 86_400 + 2, 86_400],  # days back and forth
    [-1, -86_400, -86_401, 0, 86_400 * 365], [0], []])
def test_day_runs_are_the_runs_of_floor_division(times):
    import pyarrow as pa

    from analytics.lake import TS, day_runs

    expected = []
    for i, t in enumerate(times):
        if expected and expected[-1][0] == t // 86400:
            expected[-1] = (expected[-1][0], expected[-1][1], expected[-1][2] + 1)
        else:
            expected.append((t // 86400, i, 1))
    assert day_runs(pa.array(times, pa.int64())) == expected
    assert day_runs(pa.array(times, pa.int64()).cast(TS)) == expected


def test_the_events_process_encodes_the_runs_files_and_its_failure_fails_the_run(tmp_path, monkeypatch):
    # with an events process, the run's own files (every table but events) are encoded there: the rows go beside
    # the file in Arrow's IPC format, which is gone once the file is written; a file that fails there fails the run
    import chipledger.embedded as embedded
    from analytics.lake import LakeWriter

    events = tmp_path / "events.jsonl"
    write_events(events, seed=3, days=2)
    encoded = []
    encode = embedded._EventsProcess.encode
    monkeypatch.setattr(embedded._EventsProcess, "encode",
                        lambda self, data, path: (encoded.append(path.parent.parent.name), encode(self, data, path)))
    summary, _ = run_file(events, tmp_path / "lake")
    assert set(encoded) == set(summary.rows_written) - {"events"} and len(encoded) > 10
    assert not list((tmp_path / "lake").rglob("*" + embedded.IPC_SUFFIX))

    write_file = LakeWriter.encode_file

    def failing(self, data, path):  # the events process's writer: its own events files pass, the run's fail
        if path.parent.parent.name != "events":
            raise OSError(f"no space left writing {path.name}")
        write_file(self, data, path)

    monkeypatch.setattr(LakeWriter, "encode_file", failing)
    lake = tmp_path / "lake2"
    with pytest.raises(RunError, match="no space left writing part-"):
        run_file(events, lake)
    assert not (lake / "_lake.json").exists() and not list(lake.rglob("*.parquet"))
    assert multiprocessing.active_children() == []
