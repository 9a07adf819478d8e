"""The typed event fields of the lake's `events` table: written from the parsed event by the shared lake-row code
(embedded run and Kafka sink alike), completed from the body for rows of an earlier worker, refused with a clear
error in files of an earlier version, and written the same way by the benchmark's generator."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from analytics.lake import (EVENT_FIELDS, LEGACY_EVENT_COLUMNS, SCHEMAS, LakeError, check_events_files,
                            complete_event_row, event_fields)
from analytics.views import connect
from chipledger.cli import app
from store import open_store
from schemas import parse_payload
from streams.sink import Sink
from streams.worker import rows_record

ROOT = Path(__file__).resolve().parents[1]
T = "2026-11-02T00:00:00Z"
T_S = 1_793_577_600
ENV = {"occurred_at": T, "pool": "lab/a100", "source": "lab/kueue"}
# the typed fields, timestamps as epoch seconds
COLS = ", ".join(f'epoch("{f}")::BIGINT' if f.startswith("effective_") else f'"{f}"' for f in EVENT_FIELDS)
NONE15 = (None,) * 15  # the fields an event's own type can have
NONE_TYPED = NONE15 + (None,)  # ... and accepted_from (who vouched for it: null in a plain run)


def ev(**kw):
    e = parse_payload({"event_id": "e1", **ENV, **kw})
    assert not hasattr(e, "code"), e
    return e


def test_the_typed_fields_follow_the_body():
    assert EVENT_FIELDS == ("job_id", "team", "chip_id", "node", "state", "grant_id", "request_id", "chips_milli",
                            "priority", "preemptible", "outcome", "effective_from", "effective_until", "chip_ids",
                            "user", "accepted_from")
    assert SCHEMAS["events"].names[:LEGACY_EVENT_COLUMNS][-1] == "body"


@pytest.mark.parametrize("payload, want", [
    ({"type": "pool.tick"}, NONE15),
    ({"type": "chip.registered", "chip_id": "c0", "node": "n0"},
     (None, None, "c0", "n0", None, None, None, None, None, None, None, None, None, None, None)),
    ({"type": "chip.state_changed", "chip_id": "c1", "state": "down", "reason": "XID 79"},
     (None, None, "c1", None, "down", None, None, None, None, None, None, None, None, None, None)),
    # chips 2.5 = 2500 milli-chips; the window in epoch seconds
    ({"type": "quota.granted", "grant_id": "g", "team": "a", "chips": 2.5, "effective_from": "2026-11-02T01:00:00Z",
      "effective_until": "2026-11-03T00:00:00+01:00"},
     (None, "a", None, None, None, "g", None, 2500, None, None, None, T_S + 3600, T_S + 23 * 3600, None, None)),
    ({"type": "burst.requested", "request_id": "r1", "team": "b", "chips": 4, "window_start": T,
      "window_end": "2026-11-02T02:00:00Z"},
     (None, "b", None, None, None, None, "r1", 4000, None, None, None, None, None, None, None)),
    # defaults of a submission are its values (priority 0, preemptible)
    ({"type": "job.submitted", "job_id": "j", "team": "a", "chips": 0.125},
     ("j", "a", None, None, None, None, None, 125, 0, True, None, None, None, None, None)),
    ({"type": "job.submitted", "job_id": "j", "team": "a", "chips": 1, "user": "alice"},
     ("j", "a", None, None, None, None, None, 1000, 0, True, None, None, None, None, "alice")),
    ({"type": "job.started", "job_id": "j", "chip_ids": ["c2", "c0"]},
     ("j", None, None, None, None, None, None, None, None, None, None, None, None, ["c2", "c0"], None)),
    ({"type": "job.started", "job_id": "j"}, ("j",) + (None,) * 14),
    ({"type": "job.finished", "job_id": "j", "outcome": "failed"},
     ("j", None, None, None, None, None, None, None, None, None, "failed", None, None, None, None)),
])
def test_event_fields(payload, want):
    assert event_fields(ev(**payload)) == want + (None,)  # accepted_from: not the event's to say


def test_an_embedded_run_writes_the_typed_fields(tmp_path):
    """tests/fixtures/hand.jsonl (see test_cli.py): every applied event's fields, by hand."""
    res = CliRunner().invoke(app, ["run", "--events", str(ROOT / "tests/fixtures/hand.jsonl"), "--lake",
                                   str(tmp_path / "lake"), "--store", f"sqlite:///{tmp_path / 'l.db'}", "--json"])
    assert res.exit_code == 0, res.output
    con = connect(tmp_path / "lake")
    rows = con.execute(f'SELECT event_id, {COLS} FROM base_event_log ORDER BY "offset"').fetchall()
    n = None
    want = [
        ("h-001",) + NONE15,
        *[(f"h-00{i + 2}", n, n, f"c{i}", "n0", n, n, n, n, n, n, n, n, n, n, n) for i in range(4)],
        ("h-006", n, "a", n, n, n, "g-a", n, 2000, n, n, n, n, n, n, n),
        ("h-007", n, "b", n, n, n, "g-b", n, 1000, n, n, n, T_S + 3600, n, n, n),  # effective_from 01:00
        ("h-008", "ja1", "a", n, n, n, n, n, 3000, 10, True, n, n, n, n, n),  # submitted without a user
        ("h-009", "ja1", n, n, n, n, n, n, n, n, n, n, n, n, ["c0", "c1", "c2"], n),
        ("h-010", "jb1", "b", n, n, n, n, n, 1000, 5, False, n, n, n, n, n),
        ("h-015", "jb1", n, n, n, n, n, n, n, n, n, n, n, n, n, n),  # started without a placement
        ("h-016", n, n, "c1", n, "down", n, n, n, n, n, n, n, n, n, n),
        ("h-017", "ja1") + (n,) * 14,
        ("h-018", "ja1") + (n,) * 14,
        ("h-019", "ja1", n, n, n, n, n, n, n, n, n, n, n, n, ["c0", "c2", "c3"], n),
        ("h-020", n, n, "c1", n, "healthy", n, n, n, n, n, n, n, n, n, n),
        ("h-021", "ja1") + (n,) * 14,
        ("h-022", "jb1", n, n, n, n, n, n, n, n, n, "succeeded", n, n, n, n),
        ("h-023", "ja1", n, n, n, n, n, n, n, n, n, "failed", n, n, n, n),
        ("h-024",) + NONE15,
    ]
    assert rows == [r + (None,) for r in want]  # a plain file: no principal vouched for any (accepted_from null)
    # the events view shows them under the same names; event_log is the table without them
    assert con.execute("SELECT team, chips_milli, priority, preemptible FROM events WHERE event_id = 'h-010'"
                       ).fetchone() == ("b", 1000, 5, False)
    assert not set(EVENT_FIELDS) & {d[0] for d in con.execute("SELECT * FROM event_log").description}


def test_a_row_of_an_earlier_worker_is_completed_from_its_body():
    body = json.dumps({"event_id": "e1", "type": "job.submitted", **ENV, "job_id": "j", "team": "a", "chips": 2})
    row = ("e1", "job.submitted", "lab/a100", "lab/kueue", T_S, T_S, 0, "t", 0, 7, body)
    assert complete_event_row(row) == row + ("j", "a", None, None, None, None, None, 2000, 0, True, None, None,
                                             None, None, None, None)
    # a body that is not an event (not JSON, or no type) leaves the fields null; a row of another shape is refused
    assert complete_event_row(row[:-1] + ("{}",))[LEGACY_EVENT_COLUMNS:] == NONE_TYPED
    assert complete_event_row(row[:-1] + ("not json",))[LEGACY_EVENT_COLUMNS:] == NONE_TYPED
    with pytest.raises(LakeError, match="expected 27 .or 11 or 25 or 26"):
        complete_event_row(row[:5])
    # a row of the first typed layout (25 columns, before `user`): the later field from the body
    with_user = json.dumps({**json.loads(body), "user": "alice"})
    typed = complete_event_row(row[:-1] + (with_user,))[:25]
    assert complete_event_row(typed) == typed + ("alice", None)
    assert complete_event_row(complete_event_row(row)[:25]) == complete_event_row(row)


def _through_a_sink(tmp_path, rows):
    """A connection to the lake a sink wrote from one output item carrying these `events` rows."""
    item = {"origin": ["chipledger.jobs", 0, 0], "tables": {"events": rows}}
    sink = Sink(tmp_path / "lake", open_store(f"sqlite:///{tmp_path / 'store.db'}"), name="sink",
                consumer=object())
    sink.handle([SimpleNamespace(topic="chipledger.journal", partition=0, offset=0,
                                 value=rows_record("lab/a100", [item]))])
    return connect(tmp_path / "lake")


def test_the_sink_completes_rows_of_an_earlier_worker(tmp_path):
    body = json.dumps({"event_id": "e1", "type": "job.finished", **ENV, "job_id": "j", "outcome": "cancelled"})
    con = _through_a_sink(tmp_path, [["e1", "job.finished", "lab/a100", "src", T_S, T_S, 0, "chipledger.jobs", 0, 0,
                                      body]])
    assert con.execute("SELECT job_id, outcome, team FROM events").fetchall() == [("j", "cancelled", None)]


def test_the_sink_completes_rows_of_a_worker_before_the_user_field(tmp_path):
    """A worker of the first typed layout sends 25 columns (no `user`): the sink takes it from the body (null:
    that worker's parser refused the field)."""
    body = json.dumps({"event_id": "e1", "type": "job.submitted", **ENV, "job_id": "j", "team": "a", "chips": 2})
    row = ["e1", "job.submitted", "lab/a100", "src", T_S, T_S, 0, "chipledger.jobs", 0, 0, body,
           "j", "a", None, None, None, None, None, 2000, 0, True, None, None, None, None]
    con = _through_a_sink(tmp_path, [row])
    assert con.execute('SELECT job_id, team, "user" FROM events').fetchall() == [("j", "a", None)]


def test_events_files_before_the_user_field_are_upgraded_with_the_lake(tmp_path):
    """Files of the first typed layout (25 columns, written before `user`) are in lakes written before commits: every
    reader says in one line to run `lake upgrade`, which adopts the lake and adds the column (from the bodies) in
    place, alone or beside files with it."""
    from analytics.commits import MANIFEST

    lines = (ROOT / "tests/fixtures/hand.jsonl").read_text().splitlines()
    with_user = [json.dumps({**json.loads(x), "user": "alice"}) if '"job.submitted"' in x else x for x in lines]
    fixture = tmp_path / "users.jsonl"
    fixture.write_text("\n".join(with_user) + "\n")
    lake = tmp_path / "lake"
    res = CliRunner().invoke(app, ["run", "--events", str(fixture), "--lake", str(lake), "--store",
                                   f"sqlite:///{tmp_path / 's.db'}"])
    assert res.exit_code == 0, res.output
    query = 'SELECT event_id, team, "user" FROM events WHERE type = \'job.submitted\' ORDER BY event_id'
    assert connect(lake).execute(query).fetchall() == [("h-008", "a", "alice"), ("h-010", "b", "alice")]
    want_all = connect(lake).execute('SELECT * EXCLUDE ("user") FROM events ORDER BY "offset"').fetchall()
    (only,) = (lake / "events").rglob("*.parquet")
    t = pq.read_table(only, partitioning=None)
    # as the earlier version wrote the lake: no manifest, the rows up to h-009 as the first typed layout wrote them
    # (no `user`), the rest as now
    (lake / MANIFEST).unlink()
    old, new = t.slice(0, 9), t.slice(9)
    assert old.column("event_id").to_pylist()[-2:] == ["h-008", "h-009"]
    files = [only.with_name("part-old-0001.parquet"), only]
    pq.write_table(old.select(t.schema.names[:25]), files[0])
    pq.write_table(new, files[1])
    with pytest.raises(LakeError, match="chipledger lake upgrade"):
        connect(lake)
    refused = CliRunner().invoke(app, ["sql", "SELECT 1", "--lake", str(lake)])
    assert refused.exit_code == 1 and refused.stderr.count("\n") == 1 and "lake upgrade" in refused.stderr

    up = CliRunner().invoke(app, ["lake", "upgrade", "--lake", str(lake)])
    assert up.exit_code == 0, up.output
    assert sorted(up.stdout.split()) == [str(files[0])]
    assert all(pq.read_metadata(f).num_columns == len(SCHEMAS["events"]) for f in files)
    assert connect(lake).execute('SELECT * EXCLUDE ("user") FROM events ORDER BY "offset"').fetchall() == want_all
    # from the bodies: these were written with a user (a real file of the earlier layout never has one)
    assert connect(lake).execute(query).fetchall() == [("h-008", "a", "alice"), ("h-010", "b", "alice")]


def test_events_files_of_an_earlier_version_are_refused_clearly(tmp_path):
    legacy = pa.schema(list(SCHEMAS["events"])[:LEGACY_EVENT_COLUMNS])
    out = tmp_path / "events" / "day=2026-11-02"
    out.mkdir(parents=True)
    row = ["e1", "pool.tick", "p", "s", T_S, T_S, 0, "t", 0, 0, "{}"]
    pq.write_table(pa.Table.from_arrays([pa.array([v], type=f.type) for v, f in zip(row, legacy)], schema=legacy),
                   out / "part-old-0001.parquet")
    with pytest.raises(LakeError, match=r"part-old-0001.parquet: an events file with 11 columns, expected 27 .*"
                                        r"chipledger lake upgrade --lake .*chipledger run --overwrite"):
        check_events_files(tmp_path)
    with pytest.raises(LakeError, match="written before commits.*chipledger lake upgrade"):
        connect(tmp_path)


def test_lake_upgrade_gives_files_of_an_earlier_version_their_typed_fields_in_place(tmp_path):
    runner = CliRunner()
    lake = tmp_path / "lake"
    fixture = ROOT / "tests" / "fixtures" / "hand.jsonl"
    assert runner.invoke(app, ["run", "--events", str(fixture), "--lake", str(lake),
                               "--store", f"sqlite:///{tmp_path / 's.db'}"]).exit_code == 0
    query = "SELECT * FROM events ORDER BY \"offset\""
    want = connect(lake).execute(query).fetchall()
    typed_want = connect(lake).execute(f"SELECT {COLS} FROM base_event_log ORDER BY \"offset\"").fetchall()
    files = sorted((lake / "events").rglob("*.parquet"))
    assert files and any(v != NONE_TYPED for v in typed_want)
    from analytics.commits import MANIFEST

    (lake / MANIFEST).unlink()  # as an earlier version wrote the lake: no manifest
    for f in files:  # as an earlier version wrote them: no typed fields
        t = pq.read_table(f, partitioning=None)
        pq.write_table(t.select(t.schema.names[:LEGACY_EVENT_COLUMNS]), f)
    with pytest.raises(LakeError, match="chipledger lake upgrade"):
        connect(lake)

    up = runner.invoke(app, ["lake", "upgrade", "--lake", str(lake)])
    assert up.exit_code == 0, up.output
    assert sorted(up.stdout.split()) == sorted(str(f) for f in files)
    assert f"{len(files)} events file(s) upgraded" in up.stderr
    assert sorted((lake / "events").rglob("*")) == sorted(
        {*files, *(f.parent for f in files)})  # rewritten in place, nothing left beside them
    assert connect(lake).execute(query).fetchall() == want
    assert connect(lake).execute(f"SELECT {COLS} FROM base_event_log ORDER BY \"offset\"").fetchall() == typed_want

    again = runner.invoke(app, ["lake", "upgrade", "--lake", str(lake)])
    assert again.exit_code == 0 and again.stdout == "" and "nothing to upgrade" in again.stderr
    missing = runner.invoke(app, ["lake", "upgrade", "--lake", str(tmp_path / "nowhere")])
    assert missing.exit_code == 1 and "no lake at" in missing.stderr  # docs/cli.md, "Exit codes"


def _bench():
    from tests.bench_support import bench_module

    return bench_module("analytics")


def test_the_benchmark_generator_writes_the_typed_fields_as_the_writers_do(tmp_path):
    """Every event the generator writes: its typed fields equal what the lake writer takes from the event its
    body parses to (analytics.lake.event_fields, which the embedded run and the Kafka path both use)."""
    counts = _bench().generate(tmp_path, 20_000)
    con = connect(tmp_path / "lake")
    rows = con.execute(f"SELECT body, {COLS} FROM base_event_log").fetchall()
    assert len(rows) == counts["events"] > 10_000
    types = set()
    for body, *fields in rows:
        e = parse_payload(orjson.loads(body))
        assert not hasattr(e, "code"), (body, e)
        assert tuple(fields) == event_fields(e), body
        types.add(e.type)
    assert types >= {"pool.configured", "chip.registered", "chip.state_changed", "quota.granted", "job.submitted",
                     "job.started", "job.checkpointed", "job.preempted", "job.finished", "pool.tick"}


def test_the_benchmark_profile_prints_each_statement_of_connect(tmp_path, capsys):
    """bench/analytics.py --profile: the CPU time of connect's statements (the materialized intermediates by name)
    and of each report view, largest first, the rest summed; the module's duckdb is given back afterwards."""
    bench = _bench()
    bench.generate(tmp_path, 5_000)
    bench.profile_connect(tmp_path / "lake", top=5)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("  profile (one pass, CPU s): connect and views ")
    timed = [float(line.split()[0]) for line in out[1:6]]
    assert timed == sorted(timed, reverse=True) and len(out) == 7
    assert "the other" in out[6] and int(out[6].split()[3]) > 60
    assert any('TABLE "calc_' in line or 'TABLE "bench_' in line for line in out[1:6])
    import analytics.views as views
    import duckdb
    assert views.duckdb is duckdb
