"""The fold's cheaper paths (docs/benchmarks-history.md, third speed pass) give what the plain ones gave: raw bytes
kept in the dedup window and digested lazily, the pool's idle account derived from the others, a Step's shared empty
output lists, the clock's next stop, the memo of a job's milli-chips."""

from __future__ import annotations

import json

import pytest

from ledger import Fleet, FoldConfig, PoolState, close_books, evolve
from ledger.books import CAPACITY, IDLE, IN_QUOTA, OVERCOMMITTED, UNAVAILABLE
from ledger.state import NO_ROWS, dedup_key, fingerprint, origin_of
from schemas import RejectionCode as RC

from tests.test_evolve import CFG, H, POOL, T0, chip, chip_state, configured, finish, grant, start, submit, tick

_BODY = b'{"any": "bytes"}'


def _raw(e) -> bytes:
    return e.model_dump_json().encode()


def _pool(events, config=CFG) -> tuple[PoolState, list]:
    state, steps = None, []
    for e in events:
        state, step = evolve(state, e, config, _raw(e))
        steps.append(step)
    return state, steps


def test_the_window_keeps_raw_bytes_and_saves_their_digests():
    events = [configured(), chip("c1"), submit("j1", "a", 1, at=10), tick(20)]  # a tick has no check of its own
    state, _ = _pool(events)
    last = events[-1]
    assert state.dedup[dedup_key(origin_of(last.source), last.event_id)][0] == _raw(last)  # kept as received: digested only if the id comes again
    saved = state.to_dict()["dedup"]
    assert [row[1] for row in saved] == [fingerprint(_raw(e)) for e in events]
    assert all(isinstance(row[1], int) for row in saved)
    # after a save and restore, the same bytes are still a duplicate and other bytes a conflict
    again = PoolState.from_dict(json.loads(json.dumps(state.to_dict())))
    again, step = evolve(again, last, CFG, _raw(last))
    assert step.duplicate and again.duplicates == 1
    again, step = evolve(again, last, CFG, _raw(last) + b" ")
    assert step.rejection is not None and step.rejection.code == RC.duplicate_conflict


def test_a_duplicate_is_told_by_its_bytes_before_any_save():
    e = tick(10)
    state, _ = _pool([configured(), chip("c1"), e])
    state, step = evolve(state, e, CFG, _raw(e))
    assert step.duplicate
    state, step = evolve(state, e, CFG, bytearray(_raw(e)))  # not bytes: digested at once, same digest
    assert step.duplicate
    state, step = evolve(state, e, CFG, _BODY)
    assert step.rejection.code == RC.duplicate_conflict


def _idle_now(state: PoolState) -> int:
    free = state.capacity_milli - state.unavailable_milli - state.charged_milli
    return free if free > 0 else 0


def test_idle_is_derived_exactly_mid_hour_and_at_the_close():
    events = [configured(), chip("c1"), chip("c2"), chip("c3"), grant("g", "a", 1),
              submit("j1", "a", 2, at=100), start("j1", at=200, chip_ids=["c1", "c2"]),
              chip_state("c3", "down", at=900), submit("j2", "a", 2, at=1000),
              start("j2", at=1200),  # no placement: overcommitted (2 + 2 charged on 2 available chips)
              finish("j1", at=1800), chip_state("c3", "healthy", at=2400), finish("j2", at=3000)]
    state, steps = None, []
    for e in events:
        state, step = evolve(state, e, CFG)
        steps.append(step)
        assert state.books.rate(IDLE) == _idle_now(state)  # read mid-hour: derived from the others
    state, step = evolve(state, tick(H + 60), CFG)
    rows = {(r.account, r.team): r.amount_mchip_s for r in step.journal if r.hour == state.books.open_hour - H}
    # by hand: 3 chips for the hour; c3 down 900..2400; j1 2 chips 200..1800; j2 2 chips 1200..3000
    charged = 2000 * (1800 - 200) + 2000 * (3000 - 1200)
    assert rows[(CAPACITY, None)] == 3000 * H
    assert rows[(UNAVAILABLE, None)] == 1000 * 1500
    # 1200..1800: 4 chips charged on 2 available, 2 overcommitted
    assert rows[(OVERCOMMITTED, None)] == 2000 * 600
    assert rows[(IDLE, None)] == 3000 * H - 1000 * 1500 - charged + 2000 * 600
    assert rows[(IN_QUOTA, "a")] == 1000 * (3000 - 200)


def test_a_state_saved_mid_hour_posts_the_same_idle():
    events = [configured(), chip("c1"), chip("c2"), submit("j1", "a", 1, at=100), start("j1", at=200),
              submit("j2", "a", 1, at=300), start("j2", at=900), finish("j1", at=1500)]
    once, _ = _pool(events + [tick(H + 1)])
    split, _ = _pool(events)
    saved = split.to_dict()
    assert saved["books"]["accounts"]  # the idle account in it is brought up to the clock
    split = PoolState.from_dict(json.loads(json.dumps(saved)))
    split, step = evolve(split, tick(H + 1), CFG)
    j_once = close_books(once)
    j_split = close_books(split)
    assert once.books.totals == split.books.totals
    assert j_once == j_split


def test_an_empty_step_shares_one_read_only_list():
    fleet = Fleet(CFG)
    step = fleet.apply(configured())
    assert step.journal == [] and step.job_runs == [] and step.decisions == [] and step.pending == []
    assert step.journal is NO_ROWS
    with pytest.raises(TypeError):
        step.journal.append(("x",))
    assert NO_ROWS == []  # nothing was added to the shared list


def test_events_at_the_clocks_next_stop_close_the_hour_and_apply_boundaries():
    # a grant starting mid-hour: an event just before it does not advance past it, one at it does
    fleet = Fleet(CFG)
    for e in [configured(), chip("c1"), grant("g", "a", 1, at=10, effective_from=600)]:
        fleet.apply(e)
    s = fleet.pools[POOL]
    assert s.books.open_hour == T0 and s.until == T0 + 600
    fleet.apply(tick(599))
    assert s.teams["a"].nominal_milli == 0
    fleet.apply(tick(600))
    assert s.teams["a"].nominal_milli == 1000
    assert s.until == s.books.open_hour + H
    restored = PoolState.from_dict(s.to_dict())
    assert restored.until == s.until


def test_job_sizes_with_the_same_value_share_milli_chips():
    fleet = Fleet(FoldConfig(check_invariants=True))
    for e in [configured(), chip("c1"), submit("j1", "a", 1, at=1), submit("j2", "a", 1.0, at=2),
              submit("j3", "a", 1.25, at=3), submit("j4", "a", 0.5, at=4)]:
        fleet.apply(e)
    jobs = fleet.pools[POOL].jobs
    assert [jobs[j].chips_milli for j in ("j1", "j2", "j3", "j4")] == [1000, 1000, 1250, 500]
