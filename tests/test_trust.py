"""Issue 31, the core's side of "Trust boundaries": no producer's clock or id can freeze or rewrite a pool.

- clock_ahead: an event further ahead of its append time than [ledger] max_clock_skew_s is a dead letter and
  never moves a pool clock (the Kafka path and `run` on a `log export`, whose lines carry the append time);
- a plain file has no append time: an event that would move its pool's clock far is judged by the file's own
  later lines of that pool (chipledger.embedded), so one line far ahead cannot make later honest lines too_late,
  while honest gaps and importers' closing ticks still work;
- ids are deduplicated per (origin, event_id): another cluster cannot squat a real event's id.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import orjson
import pytest

from analytics.lake_rows import read_rows
from chipledger.embedded import run_file
from ledger import FoldConfig, PoolState, evolve
from ledger.fold import close_books
from ledger.state import dedup_key
from schemas import RejectionCode as RC, parse_event
from streams import logline

T0 = datetime(2026, 11, 2, 8, 0, tzinfo=timezone.utc)
POOL = "us-east1-a/h100"
CFG = FoldConfig(check_invariants=True)


def iso(dt: datetime) -> str:
    return dt.strftime("%Y-%m-%dT%H:%M:%SZ")


def line(eid, etype, at: datetime, source="us-east1-a/slurm", pool=POOL, **fields) -> dict:
    return {"event_id": eid, "type": etype, "occurred_at": iso(at), "pool": pool, "source": source, **fields}


def repro(bad: bool = True, ahead=timedelta(days=399)) -> list[dict]:
    """Issue 31's reproduction: a 1-chip job that ran 1 hour, and one event 399 days ahead (within
    max_clock_jump_s) from a producer whose clock is wrong; without the defence the job is charged ~9,576 chip-hours
    and its job.finished is too_late."""
    h = timedelta(hours=1)
    out = [
        line("cfg", "pool.configured", T0, flavor="h100", chips_per_node=8),
        line("c0", "chip.registered", T0, chip_id="c0", node="n0"),
        line("g1", "quota.granted", T0, source="fleet-admin/quota", grant_id="g1", team="ads", chips=1),
        line("s1", "job.submitted", T0, job_id="j1", team="ads", chips=1),
        line("st1", "job.started", T0, job_id="j1"),
        line("bad", "pool.tick", T0 + ahead, source="us-east1-a/node-agent"),
        line("f1", "job.finished", T0 + h, job_id="j1", outcome="succeeded"),
        line("end", "pool.tick", T0 + h),
    ]
    return out if bad else [e for e in out if e["event_id"] != "bad"]


def books_of(state: PoolState) -> tuple:
    journal, runs = close_books(state, config=CFG)
    return sorted(journal), sorted(runs)


def fold(lines, appended=None):
    state, steps = None, []
    for i, d in enumerate(lines):
        raw = orjson.dumps(d)
        kw = {} if appended is None else {"appended_s": appended[i]}
        state, step = evolve(state, parse_event(raw), CFG, raw, **kw)
        steps.append(step)
    return state, steps


def true_times(lines) -> list[int]:
    """The append time a broker would give each line: its honest time (the bad line was sent at T0 + 1 h)."""
    return [int((T0 + timedelta(hours=1)).timestamp()) if d["event_id"] == "bad"
            else int(datetime.fromisoformat(d["occurred_at"]).timestamp()) for d in lines]


# --- the append time (Kafka, and `run` on a log export) --------------------------------------------------

def test_without_a_bound_one_event_far_ahead_freezes_the_pool():
    """What issue 31 saw (today's default when no append time is known and nothing else checks)."""
    state, steps = fold(repro())
    assert steps[5].applied and steps[6].rejection.code == RC.too_late  # the job.finished is lost
    runs = [r for r in books_of(state)[1] if r.job_id == "j1"]
    charged_h = sum(r.allocated_mchip_s for s in steps for r in s.job_runs) + sum(r.allocated_mchip_s for r in runs)
    assert charged_h / 1000 / 3600 > 9_500


def test_clock_ahead_of_the_append_time_is_a_dead_letter_and_the_books_are_as_without_it():
    lines = repro()
    state, steps = fold(lines, true_times(lines))
    bad = steps[5]
    assert bad.rejection.code == RC.clock_ahead and "max_clock_skew_s" in bad.rejection.detail
    assert all(s.applied for i, s in enumerate(steps) if i != 5)
    clean, _ = fold(repro(bad=False))
    assert books_of(state) == books_of(clean)
    assert state.clock == clean.clock and state.rejection_counts == {"clock_ahead": 1}


def test_clock_ahead_never_moves_or_starts_a_clock_and_the_skew_is_allowed():
    at = int(T0.timestamp())
    cfg_line = line("cfg", "pool.configured", T0 + timedelta(days=30), flavor="h100", chips_per_node=8)
    state, step = evolve(None, parse_event(orjson.dumps(cfg_line)), CFG, appended_s=at)
    assert state is None and step.rejection.code == RC.clock_ahead  # a pool never starts in the future
    state, _ = evolve(None, parse_event(orjson.dumps(line("cfg", "pool.configured", T0, flavor="h", chips_per_node=8))),
                      CFG, appended_s=at)
    ok = line("t1", "pool.tick", T0 + timedelta(seconds=300))  # exactly the skew: allowed
    state, step = evolve(state, parse_event(orjson.dumps(ok)), CFG, appended_s=at)
    assert step.applied and state.clock == at + 300
    ahead = line("t2", "pool.tick", T0 + timedelta(seconds=901))
    state, step = evolve(state, parse_event(orjson.dumps(ahead)), CFG, appended_s=at + 600)
    assert step.rejection.code == RC.clock_ahead and state.clock == at + 300
    # a tick within the bound keeps working, from any producer
    state, step = evolve(state, parse_event(orjson.dumps(line("t3", "pool.tick", T0 + timedelta(seconds=900),
                                                              source="chipledger/worker"))), CFG, appended_s=at + 600)
    assert step.applied and state.clock == at + 900
    # the skew is configurable
    with pytest.raises(ValueError):
        FoldConfig(max_clock_skew_s=-1)


# --- ids per origin ------------------------------------------------------------------------------------------

def test_a_squatted_id_does_not_turn_the_real_event_into_a_conflict():
    lines = repro(bad=False)
    # another cluster sends first an event with the id of the real job.finished
    squat = line("f1", "pool.tick", T0 + timedelta(minutes=30), source="eu-west4/rogue")
    lines.insert(5, squat)
    state, steps = fold(lines)
    assert steps[5].applied  # (a tick of its own: applied under its origin's id)
    assert steps[6].applied and not steps[6].duplicate  # the real job.finished
    assert "j1" not in state.jobs
    assert dedup_key("us-east1-a", "f1") in state.dedup and dedup_key("eu-west4", "f1") in state.dedup
    # given by the edge (Kafka: the verified principal's cluster), the origin decides, not the source
    state, steps = None, []
    for d in repro(bad=False)[:5]:
        raw = orjson.dumps(d)
        state, step = evolve(state, parse_event(raw), CFG, raw, origin="us-east1-a")
    raw = orjson.dumps(line("f1", "pool.tick", T0 + timedelta(minutes=30), source="us-east1-a/slurm"))
    state, step = evolve(state, parse_event(raw), CFG, raw, origin="eu-west4")
    assert step.applied
    real = orjson.dumps(repro(bad=False)[5])
    state, step = evolve(state, parse_event(real), CFG, real, origin="us-east1-a")
    assert step.applied and "j1" not in state.jobs


def test_one_clusters_replicas_still_never_count_an_event_twice():
    lines = repro(bad=False)
    state, steps = fold(lines + [lines[5]])  # the same job.finished again, byte for byte
    assert steps[-1].duplicate
    other_body = dict(lines[6], occurred_at=iso(T0 + timedelta(hours=2)), source="us-east1-a/other-replica")
    state, step = evolve(state, parse_event(orjson.dumps(other_body)), CFG, orjson.dumps(other_body))
    assert step.rejection.code == RC.duplicate_conflict  # same origin, same id, another body


def test_a_state_saved_before_origins_keeps_its_ids():
    lines = repro(bad=False)
    state, _ = fold(lines[:5])
    saved = json.loads(json.dumps(state.to_dict()))
    saved["dedup"] = [[k.split("\x1f", 1)[1], fp, at] for k, fp, at in saved["dedup"]]  # as an older worker saved it
    old = PoolState.from_dict(saved)
    assert old.legacy_ids
    raw = orjson.dumps(lines[4])
    old, step = evolve(old, parse_event(raw), CFG, raw)
    assert step.duplicate  # a re-delivery right after the upgrade is still a duplicate
    raw = orjson.dumps(line("later", "pool.tick", T0 + timedelta(days=2)))
    old, _ = evolve(old, parse_event(raw), CFG, raw)
    assert not old.legacy_ids  # the old ids left the window


# --- files: `chipledger run` --------------------------------------------------------------------------------

def write(path: Path, lines) -> Path:
    path.write_bytes(b"".join((l if isinstance(l, bytes) else orjson.dumps(l)) + b"\n" for l in lines))
    return path


BOOK_TABLES = ("journal", "job_runs", "waits", "balances", "grant_intervals")


def lake_books(lake: Path) -> dict:
    return {t: sorted(read_rows(lake, t), key=repr) for t in BOOK_TABLES}


@pytest.mark.parametrize("ahead", [timedelta(days=399), timedelta(days=2)])  # a clock two days fast, too
def test_run_on_a_plain_file_rejects_the_line_far_ahead_and_the_books_equal_a_run_without_it(tmp_path, ahead):
    bad, _ = run_file(write(tmp_path / "bad.jsonl", repro(ahead=ahead)), tmp_path / "lake-bad", events_process=False)
    good, _ = run_file(write(tmp_path / "good.jsonl", repro(bad=False)), tmp_path / "lake-good", events_process=False)
    assert bad.dead_letters == {"clock_ahead": 1} and bad.accepted == good.accepted == 7
    assert lake_books(tmp_path / "lake-bad") == lake_books(tmp_path / "lake-good")
    (row,) = read_rows(tmp_path / "lake-bad", "deadletters")
    assert row[4] == "clock_ahead" and row[6] == "bad"


def test_a_plain_file_tolerates_what_the_dedup_window_tolerates(tmp_path):
    """A file's later lines may be late by up to the dedup window, so an event up to that far ahead of them is
    folded (the later lines are applied late, never too_late)."""
    summary, _ = run_file(write(tmp_path / "f.jsonl", repro(ahead=timedelta(hours=20))), tmp_path / "lake",
                          events_process=False)
    assert not summary.dead_letters and summary.accepted == 8 and summary.late == 2


def test_run_on_a_plain_file_keeps_honest_gaps_and_closing_ticks(tmp_path):
    lines = repro(bad=False)[:5] + [
        line("f1", "job.finished", T0 + timedelta(hours=1), job_id="j1", outcome="succeeded"),
        # two quiet days, then work again (an honest gap: the lines after it vouch for it)
        line("s2", "job.submitted", T0 + timedelta(days=2), job_id="j2", team="ads", chips=1),
        line("st2", "job.started", T0 + timedelta(days=2), job_id="j2"),
        line("f2", "job.finished", T0 + timedelta(days=2, hours=1), job_id="j2", outcome="succeeded"),
        # an importer's closing tick, long after the pool's last event: nothing after it, so it is applied
        line("end", "pool.tick", T0 + timedelta(days=5), source="chipledger/importer"),
    ]
    summary, fleet = run_file(write(tmp_path / "gaps.jsonl", lines), tmp_path / "lake", events_process=False)
    assert summary.accepted == len(lines) and not summary.dead_letters
    assert fleet.pools[POOL].clock == int((T0 + timedelta(days=5)).timestamp())


def test_a_pool_configured_far_ahead_cannot_start_a_pool_in_the_future(tmp_path):
    lines = repro(bad=False)
    first = dict(lines[0], occurred_at=iso(T0 + timedelta(days=100)), event_id="cfg-early")
    summary, fleet = run_file(write(tmp_path / "f.jsonl", [first] + lines), tmp_path / "lake", events_process=False)
    assert summary.dead_letters == {"clock_ahead": 1} and summary.accepted == len(lines)


def test_run_on_a_log_export_applies_the_append_time_and_the_origin(tmp_path):
    lines = repro()
    times = true_times(lines)
    wrapped = [logline.wrap(orjson.dumps(d), t * 1000 + 250, "us-east1-a" if d["source"].startswith("us-east1-a")
                            else None) for d, t in zip(lines, times)]
    # plain lines are still read (a file mixing both is allowed), and a broken export line is a dead letter
    summary, _ = run_file(write(tmp_path / "export.jsonl", wrapped + [b'{"log":1,"appended_at":"x","value":"{}"}']),
                          tmp_path / "lake", events_process=False)
    assert summary.dead_letters == {"clock_ahead": 1, "schema_invalid": 1} and summary.accepted == 7
    good, _ = run_file(write(tmp_path / "good.jsonl", repro(bad=False)), tmp_path / "lake-good", events_process=False)
    assert lake_books(tmp_path / "lake") == lake_books(tmp_path / "lake-good")
    # the events process reads the export lines as the run does
    again, _ = run_file(write(tmp_path / "export2.jsonl", wrapped), tmp_path / "lake2", events_process=True)
    assert again.accepted == 7 and len(list(read_rows(tmp_path / "lake2", "events"))) == 7


def test_export_lines_round_trip():
    for value in (b'{"a":1}', "é\n\u2028".encode(), b"\xff\xfe not utf-8", b""):
        for appended_ms, origin in ((1_793_606_400_123, "c1"), (None, None)):
            out = logline.wrap(value, appended_ms, origin)
            assert logline.is_wrapped(out) and b"\n" not in out
            assert logline.unwrap(out) == (value, origin, None if appended_ms is None else 1_793_606_400)
    for bad in (b'{"log":1,"value":1}', b'{"log":1,"origin":"a/b","value":"x"}', b'{"log":1,"value":"x","extra":1}',
                b'{"log":1,"value":"x","value_b64":"eA=="}', b'{"log":1,'):
        assert logline.unwrap(bad).code == RC.schema_invalid


def test_a_plain_files_fast_source_cannot_vouch_for_itself(tmp_path):
    """Review (high): the lines after an event far ahead vouched for it whatever their source, so a source whose
    clock runs two days fast (issue 31's accident), or two lines far ahead instead of one, still froze the pool:
    each fast line vouched for the one before it and the honest lines after them were too_late."""
    fast = timedelta(days=2)
    good = repro(bad=False)
    agent = [line(f"tick{i}", "pool.tick", T0 + fast + timedelta(minutes=i), source="us-east1-a/node-agent")
             for i in range(3)]
    lines = good[:5] + agent[:2] + [good[5]] + agent[2:] + [good[6]]
    bad, _ = run_file(write(tmp_path / "bad.jsonl", lines), tmp_path / "lake-bad", events_process=False)
    ok, _ = run_file(write(tmp_path / "good.jsonl", good), tmp_path / "lake-good", events_process=False)
    assert bad.dead_letters == {"clock_ahead": 3} and bad.accepted == ok.accepted == 7
    assert lake_books(tmp_path / "lake-bad") == lake_books(tmp_path / "lake-good")


def test_a_log_export_line_without_an_append_time_is_judged_like_a_plain_line(tmp_path):
    """Review (low): an export line whose appended_at is null (a log written before the append time was kept, or a
    line written by hand) skipped both checks, the append time's and the plain file's: one such line far ahead froze
    the pool in `run`. Without an append time it is judged by the file's later lines, like a plain line."""
    lines = [logline.wrap(orjson.dumps(d), None, None) for d in repro()]
    bad, _ = run_file(write(tmp_path / "export.jsonl", lines), tmp_path / "lake", events_process=False)
    good, _ = run_file(write(tmp_path / "good.jsonl", repro(bad=False)), tmp_path / "lake-good", events_process=False)
    assert bad.dead_letters == {"clock_ahead": 1} and bad.accepted == 7
    assert lake_books(tmp_path / "lake") == lake_books(tmp_path / "lake-good")
