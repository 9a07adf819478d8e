"""The facts the fold writes (DESIGN §4 "Facts", docs/analytics.md): `waits`, `free_chips`, `chip_states` and
`grant_intervals`, hand-computed.

Pool of 8 chips on two nodes of 4 (n1: c1–c4, n2: c5–c8); team a holds 4 chips of quota, team b 2. Times are
offsets from T0 (tests/test_evolve.py); chips in milli-chips.
"""

from __future__ import annotations

import json

import pytest

from ledger import Fleet, FreeChipsRow, PoolState, WaitRow, close_facts, evolve, free_chips_values

from tests.test_evolve import (
    CFG, POOL, T0, chip, chip_state, configured, finish, grant, preempt, retire, revoke, start, submit, tick,
)

N1 = ["c1", "c2", "c3", "c4"]
N2 = ["c5", "c6", "c7", "c8"]

from lake_support import commit_written  # noqa: E402  (tests/lake_support.py)


def _scenario():
    return [configured(), *[chip(c, node="n1") for c in N1], *[chip(c, node="n2") for c in N2],
            grant("ga", "a", 4), grant("gb", "b", 2),
            submit("j1", "a", 4, at=10),                 # fits a's 4 unused chips
            start("j1", at=20, chip_ids=N1),             # n1 full
            submit("j2", "a", 2, at=30),                 # a uses its 4: does not fit, not borrowing yet
            start("j2", at=40, chip_ids=["c5", "c6"]),   # a uses 6 > 4: borrowing
            submit("j3", "b", 1, at=50),                 # fits b's 2
            submit("j4", "a", 1, at=50),                 # a is borrowing
            chip_state("c7", "down", at=60),
            chip_state("c8", "down", at=60), chip_state("c8", "healthy", at=60),  # undone in the same second
            preempt("j1", at=70),                        # its own run ended: a uses 2 of 4, j1 (4) does not fit
            finish("j3", "cancelled", at=80),            # ended while pending
            tick(90)]


def _fold(events):
    fleet = Fleet(CFG)
    waits, free = [], []
    for e in events:
        step = fleet.apply(e)
        assert step.applied, (e, step)
        waits += step.waits
        free += step.free_chips
    return fleet, waits, free


def _w(job, team, run, kind, chips, began, ended, end, in_quota, borrowing, nominal, used, posted, blocked=0, by="",
       prio=0):
    return WaitRow(POOL, job, team, run, kind, prio, chips, T0 + (10 if job == "j1" else 30 if job == "j2" else 50),
                   T0 + began, None if ended is None else T0 + ended, end, in_quota, borrowing, nominal, used, blocked,
                   by, T0 + posted)


def _f(at, registered, healthy, in_use, down, free, whole, largest):
    return FreeChipsRow(POOL, T0 + at, registered, healthy, in_use, down, free, whole, largest)


def test_waits_exact():
    fleet, waits, _ = _fold(_scenario())
    assert waits == [
        # each could start at once (j2 by borrowing: 4 chips free, nothing unlent); j3 not while c8 was down within
        # second 60 (no free chip)
        _w("j1", "a", 0, "first_start", 4000, 10, 20, "started", True, False, 4000, 0, 20, blocked=10),
        _w("j2", "a", 0, "first_start", 2000, 30, 40, "started", False, False, 4000, 4000, 40, blocked=10),
        _w("j3", "b", 0, "first_start", 1000, 50, 80, "finished", True, False, 2000, 0, 80, blocked=30),
    ]
    # a close of the books posts the waits still open (j4, and j1's wait for its restart), oldest first
    fleet.close()
    assert fleet.close_facts()["waits"] == [
        _w("j4", "a", 0, "first_start", 1000, 50, None, "open", False, True, 4000, 6000, 90, blocked=40),
        _w("j1", "a", 1, "restart", 4000, 70, None, "open", False, False, 4000, 2000, 90, blocked=20),
    ]


def test_free_chips_exact_one_row_per_second_the_last():
    fleet, _, free = _fold(_scenario())
    assert free == [
        _f(0, 8000, 8000, 0, 0, 8000, 8000, 8000),      # posted at the first event of a later second
        _f(20, 8000, 8000, 4000, 0, 4000, 4000, 4000),  # n2 whole; n1 full
        _f(40, 8000, 8000, 6000, 0, 2000, 0, 2000),     # no whole node; 2 free on n2
        _f(60, 8000, 7000, 6000, 1000, 1000, 0, 1000),  # c8 down and up again within the second: the last state
        _f(70, 8000, 7000, 2000, 1000, 5000, 4000, 4000),  # n1 whole again
    ]
    fleet.close()
    assert fleet.close_facts()["free_chips"] == []  # the last change was posted at 80 (j3 changed nothing)


def test_a_change_undone_within_its_second_posts_nothing_and_the_close_posts_the_open_second():
    events = [configured(), chip("c1"), chip("c2"), submit("j", "a", 1, at=5),
              start("j", at=10, chip_ids=["c1"]), finish("j", at=10)]  # back to what was posted for 0
    state = None
    free = []
    for e in events:
        state, step = evolve(state, e, CFG)
        free += step.free_chips
    assert free == [_f(0, 2000, 2000, 0, 0, 2000, 2000, 2000)] and state.fc_row is None
    state, step = evolve(state, chip_state("c2", "maintenance", at=20), CFG)
    assert step.free_chips == [] and state.fc_row is not None  # not final until the second is over
    assert close_facts(state)["free_chips"] == [_f(20, 2000, 1000, 0, 1000, 1000, 0, 1000)]
    assert close_facts(state)["free_chips"] == []  # posted once


@pytest.mark.parametrize("events, expected", [
    # a run without a placement: which chips are free is not known (node figures None), the counts are
    ([start("u", at=2)], (4000, 4000, 1000, 0, 3000, None, None)),
    # a fractional share keeps its chip from being free; the milli-chips count
    ([start("u", at=2, chip_ids=["c1", "c2"])], (4000, 4000, 1000, 0, 3000, 2000, 2000)),
    # a degraded chip is available; a down chip under a job stops its charge
    ([chip_state("c4", "degraded", at=1), start("u", at=2, chip_ids=["c1", "c2"]), chip_state("c1", "down", at=3)],
     (4000, 3000, 500, 1000, 2500, 2000, 2000)),
    # a retired chip leaves its node; its node may become whole again
    ([start("u", at=2, chip_ids=["c3"]), retire("c3", at=3)], (3000, 3000, 0, 0, 3000, 3000, 3000)),
    # overcommitted: nothing free
    ([chip_state("c1", "down", at=1), chip_state("c2", "down", at=1), chip_state("c3", "down", at=1),
      start("u", at=2)], (4000, 1000, 1000, 3000, 0, None, None)),
])
def test_free_chips_values(events, expected):
    base = [configured(), chip("c1", node="n1"), chip("c2", node="n1"), chip("c3", node="n2"),
            chip("c4", node="n2"), submit("u", "a", 1, at=1)]
    state = None
    for e in base + events:
        state, step = evolve(state, e, CFG)
        assert step.applied, (e, step)
    assert free_chips_values(state) == expected
    # the same figures after the state is saved and restored (the node counts are derived, rebuilt)
    again = PoolState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert free_chips_values(again) == expected


def test_a_saved_state_carries_the_open_second_and_the_wait():
    events = _scenario()
    cut = events.index(next(e for e in events if e.type == "chip.state_changed"))
    whole, w_once, f_once = _fold(events)
    first, w_a, f_a = _fold(events[:cut + 1])
    carried = Fleet.from_dict(json.loads(json.dumps(first.to_dict())), CFG)
    waits, free = list(w_a), list(f_a)
    for e in events[cut + 1:]:
        step = carried.apply(e)
        waits += step.waits
        free += step.free_chips
    assert (waits, free) == (w_once, f_once)
    whole.close()
    carried.close()
    assert whole.close_facts() == carried.close_facts()


def test_a_wait_still_open_when_its_hour_closes_is_posted_open_once():
    """The worker never closes the books early: a wait that began in an hour and is still open when it closes is
    posted open then (not again at later hours), and its end later supersedes it."""
    events = [configured(), chip("c1"), grant("ga", "a", 1), submit("j", "a", 1, at=100), submit("k", "a", 2, at=200),
              tick(3600 + 5), tick(7200 + 5), start("j", at=7300, chip_ids=["c1"])]
    _, waits, _ = _fold(events)
    assert [(w.job_id, w.end, w.posted_at - T0, w.in_quota, w.ended_at) for w in waits] == [
        ("j", "open", 3600, True, None), ("k", "open", 3600, False, None), ("j", "started", 7300, True, T0 + 7300)]


def _hol_events():
    cells = ["c1", "c2", "c3", "c4"]
    return [configured(), *[chip(c, node="n1") for c in cells], grant("ga", "a", 4), grant("gb", "b", 4),
            submit("r", "b", 2, at=10), start("r", at=10, chip_ids=["c1", "c2"]),  # 2 chips free
            submit("big", "a", 4, at=20, priority=10),   # fits a's quota, not the free chips: heads the queue
            submit("small", "a", 1, at=30),              # could start (quota, 2 free) but waits behind big
            start("small", at=100, chip_ids=["c3"]),     # blocked 70 s by big
            finish("r", at=200),                         # 3 free: big still cannot start
            finish("small", at=300),                     # 4 free: big could start, nothing ahead of it
            start("big", at=360, chip_ids=cells),        # blocked 60 s, by nobody
            tick(400)]


def test_head_of_line_blocking_exact():
    _, waits, _ = _fold(_hol_events())
    got = {(w.job_id, w.run_index): (w.blocked_s, w.blocked_by) for w in waits}
    assert got == {("r", 0): (0, ""), ("small", 0): (70, "big"), ("big", 0): (60, "")}


def test_head_of_line_blocking_while_open_and_carried():
    events = _hol_events()
    cut = 10  # after small was submitted: small is accruing
    first, w_a, _ = _fold(events[:cut + 1])
    assert events[cut].job_id == "small"
    first.close()
    [open_small] = [w for w in first.close_facts()["waits"] if w.job_id == "small"]
    assert (open_small.end, open_small.blocked_s, open_small.blocked_by) == ("open", 0, "")  # at 30: none yet
    carried = Fleet.from_dict(json.loads(json.dumps(first.to_dict())), CFG)
    waits = list(w_a)
    for e in events[cut + 1:]:
        waits += carried.apply(e).waits
    _, once, _ = _fold(events)
    assert waits == once


def test_hol_blocking_view(tmp_path):
    from analytics.views import connect
    from chipledger.embedded import run_file

    f = tmp_path / "events.jsonl"
    f.write_text("".join(e.model_dump_json() + "\n" for e in _hol_events()))
    summary, _ = run_file(f, tmp_path / "lake")
    assert summary.accepted == len(_hol_events())
    rows = connect(tmp_path / "lake").execute(
        "SELECT pool, team, waits_blocked, jobs_affected, blocked_s, blocked_mchip_s, top_blockers FROM hol_blocking"
    ).fetchall()
    # small: 70 s x 1 chip; big: 60 s x 4 chips
    assert rows == [(POOL, "a", 2, 2, 130, 70 * 1000 + 60 * 4000, "big")]


def test_waits_view_keeps_each_waits_last_posting(tmp_path):
    """`waits` over the postings as stored (several files, in any order): every posting of an end as it is, and of
    the open postings the latest of each wait with no end posted; two waits under one key (a job id submitted,
    cancelled while pending and submitted again in the same second) both listed."""
    from analytics.lake import LakeWriter
    from analytics.views import connect

    def w(job, run, began, end, posted, ended=None, sub=0):
        return WaitRow(POOL, job, "a", run, "first_start" if run == 0 else "restart", 0, 1000, T0 + sub,
                       T0 + began, None if ended is None else T0 + ended, end, True, False, 1000, 0, 0, "", T0 + posted)

    later = [w("a", 0, 0, "started", 7300, ended=7300), w("b", 0, 0, "open", 7200), w("r", 1, 4000, "open", 7200),
             w("d", 0, 5, "started", 5, ended=5, sub=5)]
    earlier = [w("a", 0, 0, "open", 3600), w("a", 0, 0, "open", 7200), w("b", 0, 0, "open", 3600),
               w("c", 0, 0, "started", 100, ended=100), w("d", 0, 5, "finished", 5, ended=5, sub=5),
               w("r", 0, 0, "started", 10, ended=10)]
    for run_id, rows in (("2", later), ("1", earlier)):  # the later postings in the file written first
        writer = LakeWriter(tmp_path / "lake", run_id)
        writer.extend("waits", rows)
        writer.close()
    commit_written(tmp_path / "lake")
    got = connect(tmp_path / "lake").execute(
        'SELECT job_id, run_index, "end", epoch(posted_at)::BIGINT - ? FROM waits ORDER BY ALL', [T0]).fetchall()
    assert got == [("a", 0, "started", 7300), ("b", 0, "open", 7200), ("c", 0, "started", 100),
                   ("d", 0, "finished", 5), ("d", 0, "started", 5), ("r", 0, "started", 10), ("r", 1, "open", 7200)]


def test_a_connection_reads_the_files_of_the_commit_there_at_connect(tmp_path):
    """Every connection (materializing or not) is a snapshot of the lake's latest commit at connect: its views read
    the files that commit names; a file written later is read from the commit that names it on, by a new connection,
    and a file no commit names never (analytics/commits.py)."""
    from analytics.lake import LakeWriter, table_files
    from analytics.views import connect

    def write(run_id, job):
        writer = LakeWriter(tmp_path / "lake", run_id)
        writer.extend("waits", [WaitRow(POOL, job, "a", 0, "first_start", 0, 1000, T0, T0, T0 + 5, "started", True,
                                        False, 1000, 0, 0, "", T0 + 5)])
        writer.close()

    write("1", "x")
    commit_written(tmp_path / "lake")
    assert table_files(tmp_path / "lake", "waits", listed=True) == [
        str(p) for p in sorted((tmp_path / "lake" / "waits").rglob("*.parquet"))]
    assert table_files(tmp_path / "lake", "free_chips", listed=True) is None
    snapshot, live = connect(tmp_path / "lake", materialize=True), connect(tmp_path / "lake")
    write("2", "y")
    assert snapshot.execute("SELECT job_id FROM waits").fetchall() == [("x",)]
    assert live.execute("SELECT job_id FROM waits ORDER BY 1").fetchall() == [("x",)]
    assert connect(tmp_path / "lake").execute("SELECT job_id FROM waits ORDER BY 1").fetchall() == [("x",)]
    commit_written(tmp_path / "lake")
    assert connect(tmp_path / "lake").execute("SELECT job_id FROM waits ORDER BY 1").fetchall() == [("x",), ("y",)]


def test_a_chip_registered_makes_a_waiting_job_startable():
    """Capacity added (a chip registered) is looked at like chips freed: the job could start from then on."""
    events = [configured(), chip("c1"), grant("ga", "a", 2), submit("j", "a", 2, at=10), chip("c2", at=40),
              start("j", at=100, chip_ids=["c1", "c2"])]
    _, waits, _ = _fold(events)
    assert [(w.job_id, w.blocked_s) for w in waits] == [("j", 60)]


def test_hol_blocking_can_be_switched_off():
    from ledger import FoldConfig

    fleet = Fleet(FoldConfig(check_invariants=True, hol_blocking=False))
    waits = [w for e in _hol_events() for w in fleet.apply(e).waits]
    assert {(w.job_id, w.blocked_s, w.blocked_by) for w in waits} == {("r", 0, ""), ("small", 0, ""), ("big", 0, "")}


def test_hol_blocking_from_the_config(tmp_path):
    from chipledger.config import fold_config, load_config

    assert fold_config(load_config(None, env={})).hol_blocking is True
    assert fold_config(load_config(None, env={"CHIPLEDGER_LEDGER_HOL_BLOCKING": "false"})).hol_blocking is False


def test_hol_a_job_asking_for_whole_nodes_could_start_when_a_node_is_free():
    """A job of 4 chips at 4 per node needs a node with every chip free: free chips on two half-free nodes do not
    make it startable; the node freed whole does (the head-of-line index keeps this per chips per node)."""
    events = [configured(), *[chip(c, node="n1") for c in N1], *[chip(c, node="n2") for c in N2],
              grant("ga", "a", 8),
              submit("r1", "a", 2, at=0), start("r1", at=0, chip_ids=["c1", "c2"]),
              submit("r2", "a", 2, at=0), start("r2", at=0, chip_ids=["c5", "c6"]),   # 4 free, on no whole node
              submit("w", "a", 4, at=10, chips_per_node=4),
              submit("s", "a", 1, at=20),                                           # could start at once
              start("s", at=30, chip_ids=["c3"]),
              finish("r2", at=100),                                                 # n2 whole: w could start
              start("w", at=160, chip_ids=N2), tick(200)]
    _, waits, _ = _fold(events)
    got = {w.job_id: (w.blocked_s, w.blocked_by) for w in waits if w.end == "started"}
    assert got == {"r1": (0, ""), "r2": (0, ""), "s": (10, "w"), "w": (60, "")}


def test_chip_states_one_row_per_chip_event():
    """Each chip event posts the chip's registration and state from then on; `seq` (the pool's events applied
    before) orders the rows of one second."""
    from ledger import ChipStateRow

    events = [configured(), chip("c1", node="n1"), chip("c2", node="n2", at=5),
              chip_state("c1", "degraded", at=10), chip_state("c1", "down", at=10), chip_state("c1", "healthy", at=20),
              retire("c2", at=30), chip("c2", node="n3", at=40), tick(50)]
    fleet = Fleet(CFG)
    rows = [r for e in events for r in fleet.apply(e).chip_states]
    assert rows == [
        ChipStateRow(POOL, "c1", "n1", T0, 1, "healthy", True, True),
        ChipStateRow(POOL, "c2", "n2", T0 + 5, 2, "healthy", True, True),
        ChipStateRow(POOL, "c1", "n1", T0 + 10, 3, "degraded", True, True),
        ChipStateRow(POOL, "c1", "n1", T0 + 10, 4, "down", True, False),
        ChipStateRow(POOL, "c1", "n1", T0 + 20, 5, "healthy", True, True),
        ChipStateRow(POOL, "c2", "n2", T0 + 30, 6, "retired", False, False),
        ChipStateRow(POOL, "c2", "n3", T0 + 40, 7, "healthy", True, True),
    ]


def test_grant_intervals_posted_when_granted_and_when_ended_early():
    """A held grant is posted when granted (from max(granted, effective_from), to the end it asked for); an
    amendment or a revocation posts its earlier end; a grant already over when granted is never posted."""
    from ledger import GrantIntervalRow

    def at(s):
        return T0 + s

    events = [configured(), chip("c1"),
              grant("g1", "a", 2, at=10),                                             # open-ended, from 10
              grant("g2", "b", 1, at=10, effective_from=100, effective_until=200),
              grant("g1", "a", 4, at=50, borrowing_limit=1),                          # amends g1 at 50
              grant("g3", "b", 1, at=60, effective_from=0, effective_until=30),       # over: not held nor posted
              grant("g4", "c", 1, at=80, effective_from=500),
              revoke("g4", at=90),                                                    # before it took effect
              tick(400)]
    fleet = Fleet(CFG)
    rows = [r for e in events for r in fleet.apply(e).grant_intervals]
    v = [r.version for r in rows]
    assert rows == [
        GrantIntervalRow(POOL, "g1", "a", v[0], 2000, None, None, at(10), at(10), None, False, at(10)),
        GrantIntervalRow(POOL, "g2", "b", v[1], 1000, None, None, at(10), at(100), at(200), False, at(10)),
        GrantIntervalRow(POOL, "g1", "a", v[0], 2000, None, None, None, None, at(50), True, at(50)),
        GrantIntervalRow(POOL, "g1", "a", v[3], 4000, 1000, None, at(50), at(50), None, False, at(50)),
        GrantIntervalRow(POOL, "g4", "c", v[4], 1000, None, None, at(80), at(500), None, False, at(80)),
        GrantIntervalRow(POOL, "g4", "c", v[4], 1000, None, None, None, None, at(90), True, at(90)),
    ]
    assert len(set(v[0:2] + v[3:5])) == 4  # each incarnation its own version


def test_chip_states_and_grant_intervals_views_from_the_facts(tmp_path):
    """The views `chip_states` (intervals, the last until the pool's last event) and `grant_intervals` (an
    incarnation's interval cut at its earlier end; one revoked before it took effect left out) aggregate the facts."""
    from analytics.views import connect
    from chipledger.embedded import run_file

    events = [configured(), chip("c1"), grant("g1", "a", 2, at=0), grant("g2", "b", 1, at=5, effective_from=50),
              chip_state("c1", "down", at=10), grant("g1", "a", 3, at=20), chip_state("c1", "healthy", at=30),
              revoke("g2", at=40), tick(60)]
    f = tmp_path / "events.jsonl"
    f.write_text("".join(e.model_dump_json() + "\n" for e in events))
    summary, _ = run_file(f, tmp_path / "lake")
    assert summary.accepted == len(events)
    con = connect(tmp_path / "lake")
    states = con.execute("SELECT epoch(valid_from)::BIGINT - $t0, epoch(valid_until)::BIGINT - $t0, duration_s, "
                         "registered, available "
                         "FROM chip_states ORDER BY valid_from", {"t0": T0}).fetchall()
    assert states == [(0, 10, 10, True, True), (10, 30, 20, True, False), (30, 60, 30, True, True)]
    grants = con.execute("SELECT grant_id, chips_milli, epoch(effective_from)::BIGINT - $t0, "
                         "epoch(effective_until)::BIGINT - $t0 "
                         "FROM grant_intervals ORDER BY effective_from", {"t0": T0}).fetchall()
    assert grants == [("g1", 2000, 0, 20), ("g1", 3000, 20, None)]


def test_base_runs_sums_only_the_runs_posted_more_than_once(tmp_path):
    """base_runs (the goodput SLI's runs, `chipledger report`'s goodput): a run posted once (its end) as it is; a run
    posted at a close of the books (ended_at null) and again at its end, summed (in files written in any order); a
    run still going, its postings so far with no end; two runs under one key (a job id submitted, finished and
    submitted again within one second) each at its own end. job_run_totals sums each key's postings."""
    from analytics.lake import LakeWriter
    from analytics.views import connect
    from ledger.fold import JobRunRow

    def r(job, run, started, ended, reason, alloc, lost, posted, chips=1000):
        return JobRunRow(POOL, job, "a", run, chips, 0, T0, T0 + started, None if ended is None else T0 + ended,
                         reason, alloc, lost, T0 + posted)

    later = [r("closed", 1, 10, 500, "succeeded", 400_000, 0, 500), r("going", 1, 0, None, None, 50_000, 0, 7200),
             r("twice", 1, 0, 5, "cancelled", 5_000, 0, 5)]
    earlier = [r("once", 1, 0, 100, "preempted", 100_000, 60_000, 100),
               r("closed", 1, 10, None, None, 90_000, 0, 100), r("going", 1, 0, None, None, 100_000, 0, 100),
               r("twice", 1, 0, 9, "failed", 8_000, 8_000, 9, chips=2000)]
    for run_id, rows in (("2", later), ("1", earlier)):  # the later postings in the file written first
        writer = LakeWriter(tmp_path / "lake", run_id)
        writer.extend("job_runs", rows)
        writer.close()
    commit_written(tmp_path / "lake")
    con = connect(tmp_path / "lake")
    got = con.execute("SELECT job_id, chips_milli, started_s - ?, ended_s - ?, end_reason, allocated_mchip_s, "
                      "lost_mchip_s FROM base_runs ORDER BY ALL", [T0, T0]).fetchall()
    assert got == [("closed", 1000, 10, 500, "succeeded", 490_000, 0), ("going", 1000, 0, None, None, 150_000, 0),
                   ("once", 1000, 0, 100, "preempted", 100_000, 60_000),
                   ("twice", 1000, 0, 5, "cancelled", 5_000, 0), ("twice", 2000, 0, 9, "failed", 8_000, 8_000)]
    totals = con.execute("SELECT job_id, allocated_mchip_s, lost_mchip_s FROM job_run_totals ORDER BY ALL").fetchall()
    assert totals == [("closed", 490_000, 0), ("going", 150_000, 0), ("once", 100_000, 60_000),
                      ("twice", 13_000, 8_000)]
