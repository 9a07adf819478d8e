"""The analytics cache (analytics/views.py): the materialized tables that depend on the lake's files alone, kept in
`LAKE/_cache/analytics-KEY.duckdb` between connections. Checked: what it keeps never reads the settings; a cached
connection answers every view exactly as an uncached one (also with other settings and another instant); a change
to the lake's files is never answered from the old cache; a cache cut short, not written whole or left with
changes beside it, an interrupted write or an unwritable lake costs speed, not answers;
`chipledger report` and `chipledger lake cache` write it and a second report reads it; `chipledger run --overwrite` removes it."""

from __future__ import annotations

import os
import re
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from lake_rows import view_rows  # tests/lake_rows.py
from typer.testing import CliRunner

from analytics.cache_update import lake_files
from analytics.lake import CACHE_DIR
from analytics.slo_views import DUCKDB, SloParams, duckdb_base_views, slo_views
import analytics.views as views
from analytics.views import CACHED, DERIVED_VIEWS, cache_is_whole, cache_path, connect, view_names
from chipledger.cli import app


def _attached(con) -> bool:
    return con.execute("SELECT count(*) FROM duckdb_databases() WHERE database_name = 'lake_cache'").fetchone()[0] == 1


@pytest.fixture(scope="module")
def demo_lake(demo_lake_of) -> Path:
    return demo_lake_of(3, 3)


@pytest.fixture
def lake(demo_lake, tmp_path) -> Path:
    """A copy of the demo lake without a cache, for one test to change."""
    dst = tmp_path / "lake"
    shutil.copytree(demo_lake, dst, ignore=shutil.ignore_patterns(CACHE_DIR))
    return dst


def test_what_is_cached_never_reads_the_settings():
    sql = {**DERIVED_VIEWS, **duckdb_base_views(), **slo_views(DUCKDB)}
    names = set(sql) | {"slo_settings", "slo_targets"}

    def reads(name: str, seen: set) -> set:
        for other in names - {name} - seen:
            if re.search(rf"\b{other}\b", sql.get(name, "")):
                seen.add(other)
                reads(other, seen)
        return seen

    assert CACHED and CACHED <= set(sql)
    for name in CACHED:
        assert not reads(name, set()) & {"slo_settings", "slo_targets", "calc_now"}, name
    assert reads("calc_waits", set()) >= {"calc_wait_levels", "calc_now"}  # the check above can fail


def test_a_cached_connection_answers_every_view_as_an_uncached_one(lake):
    assert cache_path(lake) is not None and not cache_path(lake).exists()
    cold = connect(lake, materialize=True)
    assert not _attached(cold) and cache_path(lake).exists()
    warm = connect(lake, materialize=True)
    plain = connect(lake, cache=False)
    assert _attached(warm) and not _attached(plain)
    assert list((lake / CACHE_DIR).iterdir()) == [cache_path(lake)]
    assert warm.execute("SELECT count(*) FROM base_runs").fetchone()[0] > 0
    for name in view_names():
        assert view_rows(warm, name) == view_rows(plain, name) == view_rows(cold, name), name


def test_other_settings_and_instants_are_answered_from_the_same_cache(lake):
    connect(lake, materialize=True)
    params = SloParams(sched_latency=0.5, sched_slo_s=60, window_days=1)
    first_day = datetime(2026, 11, 3, tzinfo=timezone.utc)
    for kw in ({"slo": params}, {"as_of": first_day}, {"slo": params, "as_of": first_day}):
        warm = connect(lake, materialize=True, **kw)
        plain = connect(lake, cache=False, **kw)
        assert _attached(warm)
        for name in ("calc_waits", "sched_waits", "slo_sched_latency", "slo_quota_honoured", "error_budget",
                     "burn_alerts"):
            assert view_rows(warm, name) == view_rows(plain, name), (kw, name)
    assert view_rows(connect(lake, slo=params), "calc_waits") != view_rows(connect(lake), "calc_waits")


def test_a_changed_lake_is_never_answered_from_the_old_cache(lake):
    connect(lake, materialize=True)
    old = cache_path(lake)
    runs = sorted((lake / "job_runs").rglob("*.parquet"))
    gone = pq.read_table(runs[-1]).num_rows
    runs[-1].unlink()  # the lake lost a file: the old key no longer matches
    assert cache_path(lake) != old
    con = connect(lake)
    assert not _attached(con)
    assert con.execute("SELECT count(*) FROM base_runs").fetchone()[0] == \
        connect(lake, cache=False).execute("SELECT count(*) FROM base_runs").fetchone()[0]
    assert gone > 0
    connect(lake, materialize=True)  # writes the new key's file and removes the old one
    assert not old.exists() and cache_path(lake).exists()
    assert _attached(connect(lake))


def test_a_broken_cache_file_is_computed_again(lake):
    path = cache_path(lake)
    path.parent.mkdir()
    path.write_bytes(b"not a duckdb file")
    con = connect(lake, materialize=True)
    assert not _attached(con)
    assert view_rows(con, "slo_capacity") == view_rows(connect(lake, cache=False), "slo_capacity")
    assert _attached(connect(lake))  # the materializing connection replaced it


def test_a_cache_file_cut_short_is_computed_again(lake):
    connect(lake, materialize=True)
    path = cache_path(lake)
    whole = path.read_bytes()
    assert cache_is_whole(path)
    for size in (len(whole) // 2, len(whole) - 4096, 4096):
        path.write_bytes(whole[:size])
        assert not cache_is_whole(path), size
        con = connect(lake)
        assert not _attached(con)
        assert view_rows(con, "slo_capacity") == view_rows(connect(lake, cache=False), "slo_capacity")
    connect(lake, materialize=True)
    assert cache_is_whole(path) and _attached(connect(lake))


def test_a_cache_file_without_its_meta_row_is_not_read(lake, tmp_path):
    """A file with every table but not the row written last (what a copy stopped just before the end leaves),
    or with another key's row, is not the cache."""
    import duckdb
    connect(lake, materialize=True)
    path = cache_path(lake)
    for sql in ("DROP TABLE c.cache_meta", "UPDATE c.cache_meta SET cache_key = 'another'"):
        shutil.copy(path, tmp_path / "whole.duckdb")
        with duckdb.connect() as con:
            con.execute(f"ATTACH '{path}' AS c")
            con.execute(sql)
        assert not cache_is_whole(path) and not _attached(connect(lake)), sql
        shutil.copy(tmp_path / "whole.duckdb", path)
        assert cache_is_whole(path)


class _Interrupting:
    """A connection that raises `error` on the third table copied into the cache (the rest is the real one)."""

    def __init__(self, con, error):
        self.con, self.error, self.copies = con, error, 0

    def execute(self, sql, *args):
        if sql.startswith("CREATE TABLE cache_out."):
            self.copies += 1
            if self.copies == 3:
                raise self.error
        return self.con.execute(sql, *args)


# made per test: a raised exception keeps its traceback, whose frames hold the connection; a parameter object
# would keep it alive to the end of the session
@pytest.mark.parametrize("make_error", [KeyboardInterrupt, lambda: RuntimeError("boom"),
                                        lambda: OSError(28, "No space left")], ids=["interrupt", "bug", "disk-full"])
def test_an_interrupted_write_leaves_no_file(lake, make_error):
    error = make_error()
    con = connect(lake, materialize=True, cache=False)
    path = cache_path(lake)
    path.parent.mkdir()
    wrapped = _Interrupting(con, error)
    if isinstance(error, OSError):
        views._write_cache(wrapped, path, lake, lake_files(lake))  # a full disk: uncached, no error
    else:
        with pytest.raises(type(error)):
            views._write_cache(wrapped, path, lake, lake_files(lake))
    assert wrapped.copies == 3 and list(path.parent.iterdir()) == []
    con.execute("SELECT 1")  # the connection still works
    views._write_cache(con, path, lake, lake_files(lake))
    assert cache_is_whole(path)


def _a_writer_touches(lake: Path, table: str, monkeypatch, at_call: int) -> list:
    """Make the `at_call`-th look at the lake's key first rewrite one of `table`'s files (a new modification
    time, as a run appending to it leaves): the lake changes between two looks. Returns the looks made."""
    real, calls = views.lake_files, []

    def look(root):
        calls.append(root)
        if len(calls) == at_call:
            f = sorted((lake / table).rglob("*.parquet"))[0]
            os.utime(f, ns=(time.time_ns(), f.stat().st_mtime_ns + 1_000_000))
        return real(root)

    monkeypatch.setattr(views, "lake_files", look)
    return calls


def test_a_lake_that_changes_while_materializing_is_not_cached(lake, monkeypatch):
    # the second look is after the tables were computed, before the write
    calls = _a_writer_touches(lake, "journal", monkeypatch, at_call=2)
    connect(lake, materialize=True)
    assert len(calls) == 2 and not (lake / CACHE_DIR).exists()
    monkeypatch.undo()
    connect(lake, materialize=True)
    assert cache_is_whole(cache_path(lake))


def test_stale_temporary_files_are_removed_by_the_next_write(lake):
    folder = lake / CACHE_DIR
    folder.mkdir()
    stale, fresh = folder / "analytics-0123.99-dead.tmp", folder / "analytics-0123.98-beef.tmp"
    for p in (stale, fresh):
        p.write_bytes(b"left by a killed process")
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    connect(lake, materialize=True)
    assert sorted(folder.iterdir()) == sorted([fresh, cache_path(lake)])  # a fresh one may be another's write


def test_a_lake_it_cannot_write_to_is_just_not_cached(lake):
    (lake / CACHE_DIR).write_text("a file where the cache folder goes")  # mkdir fails, as on a read-only lake
    con = connect(lake, materialize=True)
    assert view_rows(con, "error_budget") == view_rows(connect(lake, cache=False), "error_budget")
    assert (lake / CACHE_DIR).is_file() and not [p for p in lake.rglob("*") if ".tmp" in p.name]


def test_report_writes_the_cache_and_the_next_report_reads_it(lake, tmp_path):
    runner = CliRunner()
    first = runner.invoke(app, ["report", "--lake", str(lake)])
    assert first.exit_code == 0, first.output
    path = cache_path(lake)
    assert path.exists()
    stamp = path.stat().st_mtime_ns
    second = runner.invoke(app, ["report", "--lake", str(lake)])
    assert second.exit_code == 0, second.output
    assert second.output == first.output and path.stat().st_mtime_ns == stamp  # read, not written again


def test_run_overwrite_removes_the_cache(tmp_path):
    runner = CliRunner()
    out = tmp_path / "demo"
    assert runner.invoke(app, ["demo", "--days", "1", "--seed", "5", "--out", str(out)]).exit_code == 0
    lake = out / "lake"
    connect(lake, materialize=True)
    assert (lake / CACHE_DIR).exists()
    res = runner.invoke(app, ["run", "--events", str(out / "events.jsonl"), "--lake", str(lake), "--overwrite",
                              "--store", f"sqlite:///{tmp_path / 'store.db'}"])
    assert res.exit_code == 0, res.output
    assert not (lake / CACHE_DIR).exists()


def test_lake_cache_command(lake, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["lake", "cache", "--lake", str(lake)])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == str(cache_path(lake)) and cache_path(lake).exists()
    assert "cached" in res.stderr
    again = runner.invoke(app, ["lake", "cache", "--lake", str(lake)])
    assert again.exit_code == 0 and "already cached" in again.stderr
    whole = cache_path(lake).read_bytes()
    cache_path(lake).write_bytes(whole[:len(whole) // 2])  # a copy cut short is not "already cached"
    res = runner.invoke(app, ["lake", "cache", "--lake", str(lake)])
    assert res.exit_code == 0 and "already" not in res.stderr and cache_is_whole(cache_path(lake))
    empty = tmp_path / "empty"
    empty.mkdir()
    res = runner.invoke(app, ["lake", "cache", "--lake", str(empty)])
    assert res.exit_code == 1 and "no files" in res.output
    res = runner.invoke(app, ["lake", "cache", "--lake", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "no lake" in res.output


def test_lake_cache_says_when_the_lake_changed_while_it_worked(lake, monkeypatch):
    _a_writer_touches(lake, "events", monkeypatch, at_call=2)  # the command's look, then connect's
    res = CliRunner().invoke(app, ["lake", "cache", "--lake", str(lake)])
    assert res.exit_code == 1 and "changed while caching" in res.output


def test_a_change_left_beside_the_cache_is_not_read_and_the_next_write_removes_it(lake):
    """Someone opened the cache read-write, deleted rows and was killed: DuckDB would replay the `.wal` onto the
    file at attach. The cache is not read while it is there; the next write drops it."""
    import duckdb
    connect(lake, materialize=True)
    path = cache_path(lake)
    runs = view_rows(connect(lake, cache=False), "base_runs")
    with duckdb.connect() as con:
        con.execute("SET checkpoint_threshold = '1TB'")
        con.execute(f"ATTACH '{path}' AS c")
        con.execute("SET checkpoint_threshold = '1TB'")
        con.execute("DELETE FROM c.base_runs")
        shutil.copy(path, path.with_name("file.copy"))
        shutil.copy(f"{path}.wal", path.with_name("wal.copy"))  # as a kill -9 leaves them: not checkpointed
    shutil.copy(path.with_name("file.copy"), path)
    shutil.copy(path.with_name("wal.copy"), f"{path}.wal")
    for f in ("file.copy", "wal.copy"):
        path.with_name(f).unlink()
    assert not cache_is_whole(path)
    con = connect(lake, materialize=True)
    assert not _attached(con) and view_rows(con, "base_runs") == runs
    assert cache_is_whole(path) and not Path(f"{path}.wal").exists()
    assert view_rows(connect(lake), "base_runs") == runs and _attached(connect(lake))


def test_the_folder_going_away_under_the_write_is_no_error(lake, monkeypatch):
    real = views.os.replace

    def then_run_overwrite_clears_the_lake(src, dst):
        real(src, dst)
        shutil.rmtree(Path(dst).parent)

    monkeypatch.setattr(views.os, "replace", then_run_overwrite_clears_the_lake)
    con = connect(lake, materialize=True)
    assert view_rows(con, "slo_capacity") == view_rows(connect(lake, cache=False), "slo_capacity")
    assert not (lake / CACHE_DIR).exists()


def test_a_cache_folder_it_may_not_read_is_no_cache(lake, monkeypatch):
    connect(lake, materialize=True)
    real = views.os.stat

    def denied(p, *a, **kw):  # what a `_cache` of mode 0700 owned by another user gives (root may read all)
        if CACHE_DIR in Path(p).parts:
            raise PermissionError(13, "Permission denied", str(p))
        return real(p, *a, **kw)

    monkeypatch.setattr(views.os, "stat", denied)
    con = connect(lake)
    assert not _attached(con)
    assert view_rows(con, "error_budget") == view_rows(connect(lake, cache=False), "error_budget")


def test_a_file_layout_the_check_does_not_know_is_said_not_cached(lake, monkeypatch):
    """If a DuckDB wrote files the readers' check rejects, every report would compute and write the cache again
    and never read it: the write checks its own file first, warns and keeps nothing."""
    monkeypatch.setattr(views, "_DUCKDB_HEADERS", views._DUCKDB_HEADERS + 1)
    with pytest.warns(views.CacheLayoutWarning, match="fails the check its readers make"):
        con = connect(lake, materialize=True)
    assert view_rows(con, "goodput") == view_rows(connect(lake, cache=False), "goodput")
    assert list((lake / CACHE_DIR).iterdir()) == []
    with pytest.warns(views.CacheLayoutWarning):
        res = CliRunner().invoke(app, ["lake", "cache", "--lake", str(lake)])
    assert res.exit_code == 1 and "could not write" in res.output
