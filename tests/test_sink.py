"""The sink without a broker: output records in, lake + store out; re-sent items dropped by origin, replays
change nothing, and a crash between the store commit and the move into the lake is finished at the next start."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import orjson

from analytics.views import connect
from store import open_store
from streams.sink import PARTS, WHOLE, Sink, mark_consumer
from streams.worker import pack_records, rows_record, state_record

J, D, DL = "chipledger.journal", "chipledger.decisions", "chipledger.deadletter"
POOL = "lab/a100"
H = 1_793_577_600  # 2026-11-02T00:00:00Z


def rec(topic, offset, value, partition=0):
    return SimpleNamespace(topic=topic, partition=partition, offset=offset, value=value)


def journal_item(in_offset, hour, amount, topic="chipledger.jobs"):
    return {"origin": [topic, 0, in_offset],
            "tables": {"journal": [[POOL, hour, "idle", None, amount]],
                       "events": [[f"e{in_offset}", "pool.tick", POOL, "src", hour, hour, 0, topic, 0, in_offset, "{}"]]}}


def make(tmp_path: Path, name="sink") -> Sink:
    return Sink(tmp_path / "lake", open_store(f"sqlite:///{tmp_path / 'store.db'}"), name=name, consumer=object())


def journal(tmp_path):
    return connect(tmp_path / "lake").execute(
        "SELECT hour, account, amount_mchip_s FROM journal ORDER BY hour").fetchall()


def test_resent_items_are_dropped_by_origin_and_marks_survive_a_restart(tmp_path):
    sink = make(tmp_path)
    first = rows_record(POOL, [journal_item(0, H, 1000), journal_item(1, H + 3600, 2000)])
    assert sink.handle([rec(J, 0, first)]) == 1
    # the worker crashed after sending item 1 and folds it again (same content, new output offset), then goes on
    again = rows_record(POOL, [journal_item(1, H + 3600, 2000), journal_item(2, H + 7200, 3000)])
    sink.handle([rec(J, 1, again)])
    assert sink.stats.resent_dropped == 1 and sink.stats.rows["journal"] == 3
    rows = journal(tmp_path)
    assert [(r[0].timestamp(), r[2]) for r in rows] == [(H, 1000), (H + 3600, 2000), (H + 7200, 3000)]
    store = sink.store
    assert store.position("sink", J, 0) == 1
    # a mark is input offset * PARTS + part (WHOLE: the item was not split)
    assert store.position(mark_consumer("sink", J, POOL), "chipledger.jobs", 0) == 2 * PARTS + WHOLE
    # a new sink (restart) knows the marks from the store: a late re-send of item 0 is dropped too
    later = make(tmp_path)
    later.handle([rec(J, 2, rows_record(POOL, [journal_item(0, H, 1000)]))])
    assert later.stats.resent_dropped == 1 and len(journal(tmp_path)) == 3
    # marks are per input topic-partition: offset 0 of another input topic is new
    later.handle([rec(J, 3, rows_record(POOL, [journal_item(0, H + 10800, 7, topic="chipledger.quota")]))])
    assert len(journal(tmp_path)) == 4


def test_state_snapshots_become_balances_and_decisions_are_indexed(tmp_path):
    from ledger import Fleet
    from schemas import parse_event

    fixture = Path(__file__).parent / "fixtures" / "hand.jsonl"
    fleet = Fleet()
    for line in fixture.read_bytes().splitlines():
        e = parse_event(line)
        if not hasattr(e, "code"):
            fleet.apply(e, line)
    state = fleet.pools[POOL]
    sink = make(tmp_path)
    decision = ["d-1", "decision.burst", POOL, H, "burst", "approved 2 chips", orjson.dumps({"x": 1}).decode()]
    sink.handle([rec(D, 0, rows_record(POOL, [{"origin": ["chipledger.quota", 0, 5],
                                               "tables": {"decisions": [decision]}}])),
                 rec(J, 0, state_record(POOL, orjson.dumps(state.to_dict())))])
    teams = {t.team: t.nominal_milli for t in sink.store.team_balances()}
    assert teams == {name: t.nominal_milli for name, t in state.teams.items()} and teams
    assert [b.applied for b in sink.store.pool_balances()] == [state.applied]
    assert [d.decision_id for d in sink.store.decisions()] == ["d-1"]
    assert connect(tmp_path / "lake").execute("SELECT decision_id, rule FROM decision_log").fetchall() == [("d-1", "burst")]


def test_a_batch_staged_but_not_committed_is_discarded_and_a_committed_one_is_published(tmp_path, monkeypatch):
    import pytest

    import streams.sink as sink_mod
    from analytics.commits import mark, read_manifest

    sink = make(tmp_path)
    sink.handle([rec(J, 0, rows_record(POOL, [journal_item(0, H, 1000)]))])
    assert mark(tmp_path / "lake", "sink:sink") == 1
    # a crash between the store's transaction of batch 2 and the lake's commit of it: the store has it, the lake not
    real = sink_mod.publish

    def crash(lake, stage, **kw):
        # cut short after moving one of the staged files into the table's folder (a commit half done)
        f = next(stage.rglob("*.parquet"))
        from analytics.commits import staged_files
        staged_files(stage)
        dest = lake / f.relative_to(stage)
        dest.parent.mkdir(parents=True, exist_ok=True)
        f.replace(dest)
        raise KeyboardInterrupt

    monkeypatch.setattr(sink_mod, "publish", crash)
    with pytest.raises(KeyboardInterrupt):
        sink.handle([rec(J, 1, rows_record(POOL, [journal_item(1, H + 3600, 2000)]))])
    monkeypatch.setattr(sink_mod, "publish", real)
    assert sink.store.position("sink:batch", "lake", 0) == 2 and mark(tmp_path / "lake", "sink:sink") == 1
    assert [r[2] for r in journal(tmp_path)] == [1000]  # the moved file is not committed: not read
    staging = tmp_path / "lake" / "_staging" / "sink"
    # and a batch 3 that was written but never reached the store
    (staging / "3" / "journal").mkdir(parents=True)
    (staging / "3" / "journal" / "junk.parquet").write_bytes(b"not committed")
    make(tmp_path)  # start-up recovery: batch 2 committed, batch 3 discarded
    assert not staging.exists() or not any(staging.iterdir())
    assert mark(tmp_path / "lake", "sink:sink") == 2
    assert [r[2] for r in journal(tmp_path)] == [1000, 2000]
    commits = read_manifest(tmp_path / "lake")["commit"]
    make(tmp_path)  # nothing more to do: no commit
    assert read_manifest(tmp_path / "lake")["commit"] == commits


def test_a_file_dropped_into_the_lake_beside_the_sinks_files_is_not_read(tmp_path):
    import shutil

    sink = make(tmp_path)
    sink.handle([rec(J, 0, rows_record(POOL, [journal_item(0, H, 1000)]))])
    f = next((tmp_path / "lake" / "journal").rglob("*.parquet"))
    shutil.copy(f, f.with_name("part-forged-0001.parquet"))
    assert [r[2] for r in journal(tmp_path)] == [1000]
    sink.handle([rec(J, 1, rows_record(POOL, [journal_item(1, H + 3600, 5)]))])  # nor after the next commit
    assert sorted(r[2] for r in journal(tmp_path)) == [5, 1000]


def test_compaction_is_one_more_commit_and_changes_no_view(tmp_path):
    from analytics.commits import compact, open_lake

    sink = make(tmp_path)
    for i in range(4):
        sink.handle([rec(J, i, rows_record(POOL, [journal_item(i, H + i, 1000 + i)]))])
    before = journal(tmp_path)
    snap = open_lake(tmp_path / "lake")
    assert len(snap.table_files("journal")) == 4
    con = connect(tmp_path / "lake")  # a reader opened before the compaction keeps reading its files
    replaced = compact(tmp_path / "lake")
    assert replaced["journal"] == 4 and replaced["events"] == 4
    after = open_lake(tmp_path / "lake")
    assert after.commit == snap.commit + 1 and len(after.table_files("journal")) == 1
    assert journal(tmp_path) == before
    assert con.execute("SELECT count(*) FROM journal_postings").fetchone()[0] == 4
    sink.handle([rec(J, 4, rows_record(POOL, [journal_item(4, H + 4, 7)]))])  # the sink goes on after it
    assert len(journal(tmp_path)) == 5


def test_a_record_that_is_not_an_output_is_a_dead_letter_of_the_sink_and_the_sink_goes_on(tmp_path):
    import base64

    sink = make(tmp_path)
    bad = [b"garbage", b'{"kind":"rows"}', b'{"kind":"rows","pool":"p","items":[{"origin":["t",0,1],'
                                            b'"tables":{"journal":[[1,2]]}}]}', b'{"kind":"state","pool":"p"}']
    good = rows_record(POOL, [{"origin": ["chipledger.jobs", 0, 9], "tables": {"deadletters": [
        ["chipledger.jobs", 0, 9, H, "not_json", "x", None, None, POOL, "AA=="]]}}])
    sink.handle([rec(DL, i, v) for i, v in enumerate(bad)] + [rec(DL, len(bad), good)])
    # three are not output records (their raw bytes kept); one has an item of the wrong shape (forged_origin)
    assert (sink.stats.malformed, sink.stats.forged) == (3, 1) and sink.stats.rows["deadletters"] == len(bad) + 1
    assert sink.store.position("sink", DL, 0) == len(bad)
    rows = connect(tmp_path / "lake").execute(
        "SELECT topic, \"offset\", detail, raw_b64 FROM deadletters WHERE detail LIKE 'sink:%' ORDER BY 2").fetchall()
    assert [(t, o, base64.b64decode(r)) for t, o, _, r in rows] == [(DL, i, v) for i, v in enumerate(bad) if i != 2]
    assert "no string `pool`" in rows[1][2]
    # a value of the wrong type in a row: the batch is written again with every record checked
    typed = rows_record(POOL, [{"origin": ["chipledger.jobs", 0, 10], "tables": {"journal": [
        [POOL, H, "idle", None, "not a number"]]}}])
    sink.handle([rec(J, 0, typed), rec(J, 1, rows_record(POOL, [journal_item(11, H, 5)]))])
    assert sink.stats.malformed == 4 and [r[2] for r in journal(tmp_path)] == [5]


def test_an_item_split_in_parts_is_written_once_part_by_part(tmp_path):
    rows = [[POOL, H + 3600 * i, "idle", None, 1000 + i] for i in range(3000)]
    item = {"origin": ["chipledger.quota", 0, 4], "tables": {"journal": rows}}
    records = pack_records(POOL, [item], limit=20_000)
    assert len(records) > 5 and all(len(r) <= 20_000 for r in records)
    sink = make(tmp_path)
    sink.handle([rec(J, i, v) for i, v in enumerate(records[:3])])
    # the worker crashed and sends all parts again: the parts written are dropped, the rest written once
    sink.handle([rec(J, 3 + i, v) for i, v in enumerate(records)])
    assert sorted(r[2] for r in journal(tmp_path)) == [1000 + i for i in range(3000)]


class FakeOrigins:
    """Origin topics of 3 partitions whose ends are given; counts the end-offset look-ups."""

    def __init__(self, ends):
        self.ends, self.lookups = dict(ends), 0

    def partitions(self, topic):
        return 3 if topic.startswith("chipledger.") else None

    def end_offset(self, topic, partition, at_least):
        self.lookups += 1
        return self.ends.get((topic, partition), 0)


def test_forged_origins_are_dead_lettered_and_move_no_mark(tmp_path):
    from streams.sink import FORGED_ORIGIN, check_origin, partition_for

    part = partition_for(POOL, 3)
    ends = {("chipledger.jobs", part): 10}
    sink = Sink(tmp_path / "lake", open_store(f"sqlite:///{tmp_path / 'store.db'}"), consumer=object(),
                origins=FakeOrigins(ends))

    def item(offset, topic="chipledger.jobs", partition=part, hour=H):
        it = journal_item(offset, hour, 1000 + offset, topic)
        it["origin"] = [topic, partition, offset]
        return it

    forged = [item(10**12), item(3, partition=(part + 1) % 3), item(2, topic="chipledger.journal"),
              {"origin": ["chipledger.jobs", part, -1], "tables": {}}, {"origin": "x"}]
    real = [item(o, hour=H + 3600 * o) for o in range(5)]
    sink.handle([rec(J, 0, rows_record(POOL, forged[:1])), rec(J, 1, rows_record(POOL, real[:2])),
                 rec(J, 2, rows_record(POOL, forged[1:])), rec(J, 3, rows_record(POOL, real[2:]))])
    assert sink.stats.forged == len(forged) and sink.stats.resent_dropped == 0
    assert [r[2] for r in journal(tmp_path)] == [1000 + o for o in range(5)]  # every real row written
    dl = connect(tmp_path / "lake").execute(
        "SELECT \"offset\", error_code, detail FROM deadletters ORDER BY \"offset\", detail").fetchall()
    assert {code for _, code, _ in dl} == {FORGED_ORIGIN} and len(dl) == len(forged)
    assert any("beyond the end of chipledger.jobs" in d for _, _, d in dl)
    assert any("is on partition" in d for _, _, d in dl) and any("not an input or log topic" in d for _, _, d in dl)
    assert sink.store.position(mark_consumer("sink", J, POOL), "chipledger.jobs", part) == 4 * PARTS + WHOLE
    # an output record keyed by another pool than it names is refused too
    assert "key" in check_origin(None, POOL, ["chipledger.jobs", part, 1], b"other/pool")
    assert check_origin(None, POOL, ["chipledger.log", 0, 1], POOL.encode()) is None


def test_the_sink_refuses_a_lake_written_before_commits_in_one_line(tmp_path):
    import pytest

    from analytics.commits import LakeLayoutError
    from analytics.lake import LakeWriter

    w = LakeWriter(tmp_path / "lake", "old")
    w.add("journal", (POOL, H, "idle", None, 5))
    w.close()  # a file in a table's folder and no manifest: layout 1
    with pytest.raises(LakeLayoutError, match=r"layout 1 .*chipledger lake upgrade --lake"):
        make(tmp_path)


def test_retired_files_are_deleted_after_their_grace(tmp_path, monkeypatch):
    import analytics.commits as commits

    sink = make(tmp_path)
    for i in range(2):
        sink.handle([rec(J, i, rows_record(POOL, [journal_item(i, H + 3600 * i, 10 + i)]))])
    old = set(commits.open_lake(tmp_path / "lake").all_files())
    commits.compact(tmp_path / "lake")
    assert all(Path(f).exists() for f in old)  # a reader that opened the lake before still finds them
    monkeypatch.setattr(commits, "RETIRE_GRACE_S", 0)
    assert commits.purge_retired(tmp_path / "lake") == len(old)
    assert not any(Path(f).exists() for f in old) and [r[2] for r in journal(tmp_path)] == [10, 11]


def test_a_batch_without_rows_still_moves_the_lakes_mark_to_the_stores_batch(tmp_path, monkeypatch):
    """A batch of state snapshots only (or of re-sent items, all dropped) stages no files; its commit still sets the
    lake's mark, so the lake's mark is always the store's last batch, also after a crash before that commit."""
    from analytics.commits import mark

    sink = make(tmp_path)
    sink.handle([rec(J, 0, rows_record(POOL, [journal_item(0, H, 1000)]))])
    sink.handle([rec(J, 1, rows_record(POOL, [journal_item(0, H, 1000)]))])  # re-sent: dropped, no rows
    assert sink.stats.resent_dropped == 1
    assert not any(sink.staging.glob("*/*.parquet"))
    assert sink.store.position("sink:batch", "lake", 0) == 2 == mark(tmp_path / "lake", "sink:sink")
    # a crash after the store's transaction of an empty batch and before its commit: the next start commits the mark
    monkeypatch.setattr(Sink, "_publish", lambda self, stage: None)
    sink.handle([rec(J, 2, rows_record(POOL, [journal_item(0, H, 1000)]))])
    monkeypatch.undo()
    assert mark(tmp_path / "lake", "sink:sink") == 2
    make(tmp_path)
    assert mark(tmp_path / "lake", "sink:sink") == 3 == make(tmp_path).store.position("sink:batch", "lake", 0)
    assert len(journal(tmp_path)) == 1
