"""The sequencer's rule (streams.sequencer): each producer's send order whatever the arrival order, a bounded wait
for a predecessor that never comes, foreign records, no record sequenced twice after a restart, acks in order."""

from __future__ import annotations

import random

from streams.sequencer import (HEADER_PREV, HEADER_PRODUCER, HEADER_SEQ, TP, AckGate, SeqState, Sequencer,
                               Stamp, stamp_of)

Q, J, C = (TP("chipledger.quota", 0), TP("chipledger.jobs", 0), TP("chipledger.chips", 0))


def test_stamps_from_headers():
    h = [(HEADER_PRODUCER, b"p1"), (HEADER_SEQ, b"7"), (HEADER_PREV, b"3")]
    assert stamp_of(h) == Stamp("p1", 7, 3)
    assert stamp_of(None) is None and stamp_of([(HEADER_PRODUCER, b"p1"), (HEADER_SEQ, b"7")]) is None
    assert stamp_of([(HEADER_PRODUCER, b"p"), (HEADER_SEQ, b"x"), (HEADER_PREV, b"1")]) is None
    assert stamp_of([(HEADER_PRODUCER, b"p"), (HEADER_SEQ, b"3"), (HEADER_PREV, b"3")]) is None  # prev < seq
    # a producer id longer than any the SDK makes is no stamp (the sequencer keeps the last seq per producer id)
    assert stamp_of([(HEADER_PRODUCER, b"p" * 129), (HEADER_SEQ, b"3"), (HEADER_PREV, b"2")]) is None
    assert stamp_of([(HEADER_PRODUCER, b"p" * 128), (HEADER_SEQ, b"3"), (HEADER_PREV, b"2")]) is not None


def _sends(n, rng, pools=("a", "b")):
    """One producer's sends: (pool, tp, seq, prev), prev per pool as the SDK stamps it."""
    last, out = {}, []
    for seq in range(1, n + 1):
        pool = rng.choice(pools)
        out.append((pool, rng.choice((Q, J, C)), seq, last.get(pool, 0)))
        last[pool] = seq
    return out


def test_one_producers_send_order_whatever_the_arrival_order():
    for seed in range(20):
        rng = random.Random(seed)
        sends = _sends(60, rng)
        offsets = {}
        recs = []
        for pool, tp, seq, prev in sends:
            offsets[tp] = offsets.get(tp, -1) + 1
            recs.append((pool, tp, offsets[tp], Stamp("p", seq, prev)))
        # arrival: per topic-partition in offset order, interleaved at random across them
        queues = {tp: [r for r in recs if r[1] == tp] for tp in (Q, J, C)}
        s, states, got = Sequencer(), {"a": SeqState(), "b": SeqState()}, {"a": [], "b": []}
        while any(queues.values()):
            tp = rng.choice([t for t in queues if queues[t]])
            pool, tp, off, st = queues[tp].pop(0)
            s.push(pool, tp, off, st, 0.0, st.seq)
            if rng.random() < 0.5:
                for p in ("a", "b"):
                    got[p] += [r.item for r in s.release(p, states[p], 0.0, lambda tp: False)]
        for p in ("a", "b"):
            got[p] += [r.item for r in s.release(p, states[p], 0.0, lambda tp: False)]
            assert got[p] == [seq for pool, _, seq, _ in sends if pool == p]
        assert s.buffered == 0


def test_a_predecessor_that_never_comes_is_waited_for_then_released_as_forced_and_late_after():
    s, st = Sequencer(wait_ms=1000), SeqState()
    s.push("a", Q, 0, Stamp("p", 1, 0), 0.0, "first")
    s.push("a", J, 0, Stamp("p", 3, 2), 0.0, "third")  # seq 2 (chips) is not there yet
    assert [r.item for r in s.release("a", st, 0.5)] == ["first"]
    assert s.release("a", st, 5.0, caught_up=lambda tp: tp != C) == []  # chips still has records to read
    assert s.release("a", st, 0.9) == []  # waited 900 ms of 1000
    (r,) = s.release("a", st, 1.0)
    assert (r.item, r.note) == ("third", "forced") and st.last == {"p": 3}
    s.push("a", C, 0, Stamp("p", 2, 1), 2.0, "second")
    (r,) = s.release("a", st, 2.0)
    assert (r.item, r.note) == ("second", "late")
    # the late record does not lower the last seq: the producer's next record (after 3) goes at once, not forced
    assert st.last == {"p": 3}
    s.push("a", J, 1, Stamp("p", 4, 3), 2.0, "fourth")
    assert [(r.item, r.note) for r in s.release("a", st, 2.0, caught_up=lambda tp: False)] == [("fourth", None)]


def test_foreign_records_go_in_offset_order_as_read_and_timestamps_play_no_part():
    s, st = Sequencer(), SeqState()
    s.push("a", J, 0, None, 0.0, "j0")
    s.push("a", Q, 0, None, 0.0, "q0")
    s.push("a", J, 1, None, 0.0, "j1")
    # quota (rank 0) first among the heads that may go, then each topic-partition in offset order
    assert [r.item for r in s.release("a", st, 0.0)] == ["q0", "j0", "j1"]


def test_after_a_restart_records_in_the_log_already_are_dropped_not_sequenced_again():
    s, st = Sequencer(), SeqState()
    for off, seq in enumerate((1, 2, 3)):
        s.push("a", J, off, Stamp("p", seq, seq - 1), 0.0, seq)
    assert [r.item for r in s.release("a", st, 0.0)] == [1, 2, 3]
    saved = SeqState.from_dict(st.to_dict())
    s2 = Sequencer()
    for off, seq in enumerate((1, 2, 3, 4)):  # read again from an older committed offset, plus a new one
        s2.push("a", J, off, Stamp("p", seq, seq - 1), 0.0, seq)
    out = s2.release("a", saved, 0.0)
    assert [(r.item, r.note) for r in out] == [(1, "logged"), (2, "logged"), (3, "logged"), (4, None)]


def test_two_producers_of_one_pool_each_keep_their_order():
    s, st = Sequencer(), SeqState()
    s.push("a", J, 0, Stamp("p", 2, 1), 0.0, "p2")  # waits for p1 (on quota)
    s.push("a", J, 1, Stamp("q", 1, 0), 0.0, "q1")  # behind p2 on the same topic-partition
    assert s.release("a", st, 0.0) == []
    s.push("a", Q, 0, Stamp("p", 1, 0), 0.0, "p1")
    assert [r.item for r in s.release("a", st, 0.0)] == ["p1", "p2", "q1"]


def test_the_ack_gate_acks_a_topic_partition_in_offset_order_only():
    g = AckGate()
    for off in range(4):
        g.received(J, off, off)
    assert g.done(J, 1) == [] and g.done(J, 2) == []  # offset 0 is still held (in a buffer)
    assert g.done(J, 0) == [0, 1, 2]
    assert g.done(J, 3) == [3]


def test_the_intake_holds_records_after_a_hole_until_the_holes_records_are_read():
    from streams.sequencer import Intake

    it = Intake()
    assert it.arrive(J, 0, "j0") == ["j0"] and it.arrive(J, 1, "j1") == ["j1"]
    assert it.arrive(J, 3, "j3") == [] and it.arrive(J, 5, "j5") == []  # 2 and 4 never handed over
    assert it.missing() == {J: (2, 5)} and it.holds(J) and not it.holds(Q)
    assert it.fill(J, [(2, "j2*")]) == [] and it.missing() == {J: (4, 5)}  # 4 still missing: wait
    assert it.fill(J, [(3, "j3*"), (4, "j4*")]) == ["j2*", "j3", "j4*", "j5"]  # handed-over records are kept
    assert it.arrive(J, 6, "j6") == ["j6"] and not it.missing()


def test_the_intake_checks_the_start_and_a_partition_not_read_to_its_end():
    from streams.sequencer import Intake

    it = Intake(check_start=True)
    assert it.arrive(J, 7, "j7") == [] and it.unstarted() == {J}
    assert it.start(J, 5) == [] and it.missing() == {J: (5, 7)}  # committed at 5: 5 and 6 were skipped
    assert it.fill(J, [(5, "j5"), (6, "j6")]) == ["j5", "j6", "j7"]
    assert it.arrive(Q, 0, "q0") == [] and it.start(Q, 0) == ["q0"]  # started where it was committed
    it.stalled(Q, 3)  # the end is at 3, nothing came after q0
    assert it.missing() == {Q: (1, 3)} and it.fill(Q, [(1, "q1"), (2, "q2")]) == ["q1", "q2"]
    assert it.next[Q] == 3  # Faust handing them over after all is a delivery again: the stage drops it


def test_the_intake_watches_an_assigned_partition_no_record_of_which_was_handed_over():
    """Faust may skip every record of a newly assigned partition; with `expect` the partition's start is asked for
    all the same, and once it is known a partition behind its end is read from there."""
    from streams.sequencer import Intake

    it = Intake(check_start=True)
    it.expect(Q)
    assert it.unstarted() == {Q} and it.holds(Q) and it.missing() == {}
    assert it.start(Q, 4) == [] and it.next[Q] == 4 and not it.holds(Q)  # committed at 4, nothing handed over
    it.stalled(Q, 6)
    assert it.missing() == {Q: (4, 6)} and it.fill(Q, [(4, "q4"), (5, "q5")]) == ["q4", "q5"]
    it.expect(Q)  # assigned again while it has records: nothing changes
    assert not it.unstarted() and it.next[Q] == 6
    it.expect(J)  # a record comes before the start is known: held as before
    assert it.arrive(J, 2, "j2") == [] and it.start(J, 2) == ["j2"] and it.next[J] == 3
    assert Intake().expect(J) is None and not Intake().unstarted()  # without start checks: nothing to ask


def test_the_intake_forgets_the_partitions_revoked():
    from streams.sequencer import Intake

    it = Intake()
    it.arrive(J, 0, "j0")
    assert it.arrive(J, 4, "j4") == [] and it.missing() == {J: (1, 4)}
    it.forget({0})  # revoked: the next owner reads from the committed offset
    assert not it.missing() and J not in it.next and it.arrive(J, 1, "j1") == ["j1"]


def test_the_intake_finds_a_hole_among_the_records_held_before_the_start_is_known():
    from streams.sequencer import Intake

    it = Intake(check_start=True)
    assert it.arrive(J, 4, "j4") == [] and it.arrive(J, 6, "j6") == []  # 5 skipped while the start was asked
    assert it.start(J, 4) == [] and it.missing() == {J: (5, 6)}
    assert it.fill(J, [(5, "j5")]) == ["j4", "j5", "j6"]


def test_the_intake_keeps_what_each_partial_read_brought():
    from streams.sequencer import Intake

    it = Intake()
    it.arrive(J, 0, "j0")
    assert it.arrive(J, 9, "j9") == []  # 1..8 missing
    assert it.fill(J, [(1, "j1"), (2, "j2")]) == [] and it.missing() == {J: (3, 9)}
    assert it.fill(J, [(3, "j3"), (5, "j5")]) == [] and it.missing() == {J: (4, 9)}
    assert it.fill(J, [(4, "j4"), (6, "j6"), (7, "j7"), (8, "j8")]) == [f"j{i}" for i in range(1, 10)]


def test_intake_closes_a_hole_at_the_partitions_first_offset_when_what_is_below_it_is_gone():
    from streams.sequencer import Intake

    it = Intake(check_start=True)
    tp = TP("chipledger.jobs", 0)
    assert it.arrive(tp, 5, "e5") == [] and it.arrive(tp, 6, "e6") == []  # Faust started at the first offset, 5
    assert it.start(tp, 2) == []  # the committed offset is older: a hole 2..4
    assert it.missing()[tp][0] == 2
    assert it.fill(tp, []) == []  # nothing read: retention removed them
    assert it.gone(tp, 5) == (3, ["e5", "e6"]) and not it.holds(tp) and it.next[tp] == 7
    assert it.gone(tp, 9) == (0, [])  # no hole open: nothing to give up
    assert it.arrive(tp, 7, "e7") == ["e7"]
