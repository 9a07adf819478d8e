"""The analytics cache brought up to date from the files added to the lake (analytics/cache_update.py).

Checked: a cache written for part of a lake and brought up to date with the rest holds exactly the tables the whole
computation gives, and every view answers the same, with the added files split at every day and inside a day, on a
lake the ledger wrote (the demo) and on one with placements, preemptions and chips out of service (the analytics
benchmark's generator); what cannot be folded in exactly (events before the cache's last, a file of the cache
changed, a file changing under the update, a job id submitted twice in one second, a chip registered after it was
in use) is computed whole instead, with the same answers; an interrupted update leaves no file; `chipledger report`
on a grown lake prints what it prints on the lake without a cache.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from lake_rows import view_rows, write_rows  # tests/lake_rows.py
from typer.testing import CliRunner

import analytics.cache_update as cache_update
import analytics.views as views
from analytics.lake import CACHE_DIR
from analytics.views import CACHED, cache_is_whole, cache_path, connect, view_names
from chipledger.cli import app

ROOT = Path(__file__).resolve().parents[1]


def _answers(lake: Path, **kw) -> dict[str, list[str]]:
    con = connect(lake, materialize=True, **kw)
    try:
        return {name: view_rows(con, name) for name in sorted({*CACHED, *view_names()})}
    finally:
        con.close()


def _days(lake: Path) -> list[str]:
    return sorted(p.name.removeprefix("day=") for p in (lake / "events").iterdir())


def _cache_for_part(src: Path, dst: Path, day: str, share: float, *, late_first: bool = False) -> list[Path]:
    """Copy the lake to `dst` without the files after `day` and with the first `share` of each of `day`'s files
    (rows in the order written; with `late_first` the last share instead), write the cache of that part, then add
    the rest. Returns the files added."""
    held = dst.parent / f"{dst.name}-held"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(CACHE_DIR))
    for p in sorted(dst.rglob("*.parquet")):
        d, rel = p.parent.name.removeprefix("day="), p.relative_to(dst)
        if d > day:
            (held / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(p, held / rel)
        elif d == day and share < 1:
            t = pq.read_table(p, partitioning=None)
            k = int(t.num_rows * (1 - share if late_first else share))
            first, rest = (t.slice(k), t.slice(0, k)) if late_first else (t.slice(0, k), t.slice(k))
            p.unlink()
            pq.write_table(first, p.with_name(f"{p.stem}-a.parquet"))
            (held / rel).parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(rest, (held / rel).with_name(f"{p.stem}-b.parquet"))
    connect(dst, materialize=True).close()
    assert cache_is_whole(cache_path(dst))
    added = []
    for p in sorted(held.rglob("*.parquet")):
        q = dst / p.relative_to(held)
        q.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(p, q)
        added.append(q)
    return added


class _Spy:
    """Counts the updates and the whole computations written."""

    def __init__(self, monkeypatch):
        self.updates, self.writes = 0, 0
        real_update, real_write = views.update, views._write_cache

        def update(*a):
            self.updates += 1
            return real_update(*a)

        def write(*a):
            self.writes += 1
            return real_write(*a)

        monkeypatch.setattr(views, "update", update)
        monkeypatch.setattr(views, "_write_cache", write)


@pytest.fixture(scope="module")
def demo_lake(demo_lake_of) -> Path:
    return demo_lake_of(4, 5)


@pytest.fixture(scope="module")
def bench_lake(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("bench_analytics", ROOT / "bench" / "analytics.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path_factory.mktemp("update-bench")
    bench.generate(out, 100_000)
    return out / "lake"


@pytest.fixture(scope="module")
def demo_answers(demo_lake) -> dict:
    return _answers(demo_lake, cache=False)


@pytest.fixture(scope="module")
def bench_answers(bench_lake) -> dict:
    return _answers(bench_lake, cache=False)


def _check_update(src: Path, want: dict, tmp_path: Path, monkeypatch, day: str, share: float) -> None:
    lake = tmp_path / "lake"
    _cache_for_part(src, lake, day, share)
    spy = _Spy(monkeypatch)
    got = _answers(lake)
    assert (spy.updates, spy.writes) == (1, 0)  # brought up to date, not computed whole
    assert [n for n in want if got[n] != want[n]] == []
    assert list((lake / CACHE_DIR).iterdir()) == [cache_path(lake)]  # the older cache is removed


@pytest.mark.parametrize("part", [(0, 0.0), (0, 0.5), (1, 0.25), (1, 1.0), (2, 0.5), (3, 0.5), (4, 0.75)],
                         ids=lambda p: f"day{p[0]}-{p[1]}")
def test_an_updated_cache_is_the_whole_computation_on_a_ledger_lake(demo_lake, demo_answers, tmp_path, monkeypatch,
                                                                     part):
    days = _days(demo_lake)
    assert len(days) == 5
    _check_update(demo_lake, demo_answers, tmp_path, monkeypatch, days[part[0]], part[1])


@pytest.mark.parametrize("day", [0, 1, 2])
def test_an_updated_cache_is_the_whole_computation_with_placements_and_preemptions(bench_lake, bench_answers, tmp_path,
                                                                                   monkeypatch, day):
    days = _days(bench_lake)
    assert len(days) >= 4
    con = connect(bench_lake, cache=False)
    # what the fragmentation and restart waits need is there to be updated
    assert con.execute("SELECT count(*) FROM base_placements").fetchone()[0] > 0
    assert con.execute("SELECT count(*) FROM base_runs WHERE end_reason = 'preempted'").fetchone()[0] > 0
    assert con.execute("SELECT count(*) FROM calc_chip_segments WHERE usable = 0").fetchone()[0] > 0
    con.close()
    _check_update(bench_lake, bench_answers, tmp_path, monkeypatch, days[day], 1.0)


def test_the_cache_follows_a_lake_growing_file_by_file(demo_lake, demo_answers, tmp_path, monkeypatch):
    lake = tmp_path / "lake"
    added = _cache_for_part(demo_lake, lake, _days(demo_lake)[0], 0.5)
    held = tmp_path / "later"
    for p in added:  # take them away again, and add them back one at a time, a report after each
        (held / p.relative_to(lake)).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(p, held / p.relative_to(lake))
    spy = _Spy(monkeypatch)
    for p in added:
        shutil.move(held / p.relative_to(lake), p)
        connect(lake, materialize=True).close()
    assert (spy.updates, spy.writes) == (len(added), 0)
    got = _answers(lake)
    assert [n for n in demo_answers if got[n] != demo_answers[n]] == []


def test_events_added_before_the_caches_last_are_computed_whole(demo_lake, demo_answers, tmp_path, monkeypatch):
    lake = tmp_path / "lake"
    _cache_for_part(demo_lake, lake, _days(demo_lake)[2], 0.5, late_first=True)  # the later half was cached first
    spy = _Spy(monkeypatch)
    got = _answers(lake)
    assert (spy.updates, spy.writes) == (1, 1)  # tried, refused, computed whole
    assert [n for n in demo_answers if got[n] != demo_answers[n]] == []
    assert cache_is_whole(cache_path(lake))


def test_a_cached_file_changed_is_computed_whole(demo_lake, demo_answers, tmp_path, monkeypatch):
    lake = tmp_path / "lake"
    _cache_for_part(demo_lake, lake, _days(demo_lake)[2], 1.0)
    f = sorted((lake / "job_runs").rglob("*.parquet"))[0]
    os.utime(f, ns=(time.time_ns(), f.stat().st_mtime_ns + 1_000_000))  # rewritten, as far as anyone can tell
    spy = _Spy(monkeypatch)
    got = _answers(lake)
    assert (spy.updates, spy.writes) == (0, 1)
    assert [n for n in demo_answers if got[n] != demo_answers[n]] == []


def test_a_file_changing_under_the_update_is_not_published(demo_lake, demo_answers, tmp_path, monkeypatch):
    lake = tmp_path / "lake"
    added = _cache_for_part(demo_lake, lake, _days(demo_lake)[1], 1.0)
    real = cache_update.update

    def then_a_writer_rewrites(base, tmp, root, files, new, key):
        real(base, tmp, root, files, new, key)
        os.utime(added[0], ns=(time.time_ns(), added[0].stat().st_mtime_ns + 1_000_000))

    monkeypatch.setattr(views, "update", then_a_writer_rewrites)
    before = sorted((lake / CACHE_DIR).iterdir())
    got = _answers(lake)  # the update is not named the cache of a lake it may not match: computed whole
    assert [n for n in demo_answers if got[n] != demo_answers[n]] == []
    # and not written either (the lake changed while it was computed): the cache it started from is left
    assert sorted((lake / CACHE_DIR).iterdir()) == before
    monkeypatch.undo()
    got = _answers(lake)
    assert [n for n in demo_answers if got[n] != demo_answers[n]] == []
    assert sorted((lake / CACHE_DIR).iterdir()) == [cache_path(lake)]


@pytest.mark.parametrize("make_error", [KeyboardInterrupt, lambda: RuntimeError("boom"),
                                        lambda: OSError(28, "No space left")], ids=["interrupt", "bug", "disk-full"])
def test_an_interrupted_update_leaves_no_file(demo_lake, demo_answers, tmp_path, monkeypatch, make_error):
    lake = tmp_path / "lake"
    _cache_for_part(demo_lake, lake, _days(demo_lake)[1], 1.0)
    before = sorted((lake / CACHE_DIR).iterdir())
    error = make_error()

    def broken(u):
        u.execute("DELETE FROM base_runs")  # half done
        raise error

    monkeypatch.setattr(cache_update, "_apply", broken)
    if isinstance(error, OSError):  # computed whole instead
        got = _answers(lake)
        assert [n for n in demo_answers if got[n] != demo_answers[n]] == []
        assert sorted((lake / CACHE_DIR).iterdir()) == [cache_path(lake)]
    else:
        with pytest.raises(type(error)):
            connect(lake, materialize=True)
        assert sorted((lake / CACHE_DIR).iterdir()) == before  # the cache it started from, untouched


def test_report_on_a_grown_lake_prints_what_it_prints_without_a_cache(demo_lake, tmp_path):
    lake = tmp_path / "lake"
    _cache_for_part(demo_lake, lake, _days(demo_lake)[2], 0.5)
    fresh = tmp_path / "fresh"
    shutil.copytree(lake, fresh, ignore=shutil.ignore_patterns(CACHE_DIR))
    runner = CliRunner()
    grown = runner.invoke(app, ["report", "--lake", str(lake)])
    assert grown.exit_code == 0, grown.output
    uncached = runner.invoke(app, ["report", "--lake", str(fresh)])
    assert uncached.exit_code == 0, uncached.output
    assert grown.output == uncached.output.replace(str(fresh), str(lake))
    assert cache_is_whole(cache_path(lake))


# --- small lakes written row by row, for the edges a review found -------------------------------------------------
_n = itertools.count(1)
T0 = 1_800_000_000 - 1_800_000_000 % 86400 + 3600  # an hour into a UTC day


def _write(lake: Path, table: str, rows: list[dict]) -> None:
    write_rows(lake, table, rows, f"{next(_n):04d}")


def _ev(type_: str, at: int, **fields) -> dict:
    o = next(_n)
    return dict(event_id=f"e{o}", type=type_, pool="p1", source="test", occurred_at=at, applied_at=at, lateness_s=0,
                topic="t", partition=0, offset=o, body="{}", **fields)


def _run(job: str, submitted: int, started: int, ended: int) -> dict:
    return dict(pool="p1", job_id=job, team="a", run_index=1, chips_milli=1000, priority=0, submitted_at=submitted,
                started_at=started, ended_at=ended, end_reason="succeeded", allocated_mchip_s=1000 * (ended - started),
                lost_mchip_s=0, posted_at=ended)


def _updated_as_whole(lake: Path, monkeypatch) -> tuple[int, int]:
    """The updates and whole computations a connection to the lake makes (its every cached table and view equal to
    the whole computation's)."""
    spy = _Spy(monkeypatch)
    got, want = _answers(lake), _answers(lake, cache=False)
    assert [n for n in want if got[n] != want[n]] == []
    return spy.updates, spy.writes


def _setup(lake: Path, before: list[dict], runs: list[dict] = ()) -> None:
    _write(lake, "events", [_ev("chip.registered", T0, chip_id="c1", node="n1"),
                            _ev("quota.granted", T0, grant_id="g1", team="a", chips_milli=4000), *before])
    if runs:
        _write(lake, "job_runs", list(runs))
    connect(lake, materialize=True).close()
    assert cache_is_whole(cache_path(lake))


def test_a_job_id_submitted_twice_in_one_second_is_computed_whole(tmp_path, monkeypatch):
    lake = tmp_path / "lake"
    sub = dict(job_id="J", team="a", chips_milli=1000, priority=0)
    _setup(lake, [_ev("job.submitted", T0 + 10, **sub), _ev("job.finished", T0 + 10, job_id="J", outcome="cancelled"),
                  _ev("job.submitted", T0 + 10, **sub), _ev("job.finished", T0 + 20, job_id="J", outcome="cancelled"),
                  _ev("job.submitted", T0 + 30, **sub)])
    _write(lake, "events", [_ev("job.started", T0 + 50, job_id="J", chip_ids=["c1"]),
                            _ev("job.finished", T0 + 60, job_id="J", outcome="succeeded")])
    _write(lake, "job_runs", [_run("J", T0 + 30, T0 + 50, T0 + 60)])
    # which submission of that second the waits belong to is the order of events the cache no longer has
    assert _updated_as_whole(lake, monkeypatch) == (1, 1)


def test_a_job_id_submitted_twice_in_one_second_and_restarted_is_computed_whole(tmp_path, monkeypatch):
    lake = tmp_path / "lake"
    sub = dict(job_id="J", team="a", chips_milli=1000, priority=0)
    preempted = {**_run("J", T0 + 10, T0 + 20, T0 + 30), "end_reason": "preempted"}
    _setup(lake, [_ev("job.submitted", T0 + 10, **sub), _ev("job.finished", T0 + 10, job_id="J", outcome="cancelled"),
                  _ev("job.submitted", T0 + 10, **sub), _ev("job.started", T0 + 20, job_id="J", chip_ids=["c1"]),
                  _ev("job.preempted", T0 + 30, job_id="J")], [preempted])
    # only the restart's start and a posting of it at a close: no submission or finish of the job added
    _write(lake, "events", [_ev("job.started", T0 + 40, job_id="J", chip_ids=["c1"])])
    _write(lake, "job_runs", [{**_run("J", T0 + 10, T0 + 40, T0 + 45), "run_index": 2, "ended_at": None,
                               "end_reason": None}])
    assert _updated_as_whole(lake, monkeypatch) == (1, 1)


def test_the_step_before_the_frontier_ends_where_the_next_begins_even_past_the_pools_end(tmp_path, monkeypatch):
    lake = tmp_path / "lake"
    # the run's posting (ended at T0 + 100) is in the cache before the events that far are
    _setup(lake, [_ev("job.submitted", T0 + 10, job_id="J", team="a", chips_milli=1000, priority=0),
                  _ev("job.started", T0 + 20, job_id="J", chip_ids=["c1"]), _ev("pool.tick", T0 + 30)],
           [_run("J", T0 + 10, T0 + 20, T0 + 100)])
    _write(lake, "events", [_ev("pool.tick", T0 + 50)])
    assert _updated_as_whole(lake, monkeypatch) == (1, 0)


def test_a_chip_registered_after_the_cache_had_it_in_use_is_computed_whole(tmp_path, monkeypatch):
    lake = tmp_path / "lake"
    _setup(lake, [_ev("job.submitted", T0 + 10, job_id="J", team="a", chips_milli=1000, priority=0),
                  _ev("job.started", T0 + 20, job_id="J", chip_ids=["c2"]),
                  _ev("job.finished", T0 + 30, job_id="J", outcome="succeeded")],
           [_run("J", T0 + 10, T0 + 20, T0 + 30)])
    _write(lake, "events", [_ev("chip.registered", T0 + 50, chip_id="c2", node="n2")])
    # the ledger refuses a placement on a chip it does not know; a lake written otherwise is computed whole
    assert _updated_as_whole(lake, monkeypatch) == (1, 1)
