"""The merge of a pool's three input topics (streams.merge): keys, heads and the release rule."""

from __future__ import annotations

import pytest

from streams.merge import TP, Merger, merge_key
from streams.producer import HEADER_PRODUCER, HEADER_SEQ

Q, J, C = "chipledger.quota", "chipledger.jobs", "chipledger.chips"


def sdk(ts, pid, seq):
    return [(HEADER_PRODUCER, pid.encode()), (HEADER_SEQ, str(seq).encode())]


def test_keys_of_sdk_and_foreign_records():
    assert merge_key(1000, J, 7, sdk(1000, "p1", 12)) == (1000, "p1", 12, 7)
    # foreign: topic rank (quota 0, jobs 1, chips 2) then offset
    assert merge_key(1000, C, 3, None) == (1000, "", 2, 3)
    assert merge_key(1000, Q, 9, [("other", b"x")]) == (1000, "", 0, 9)
    # a malformed seq header falls back to the foreign key
    assert merge_key(5, J, 1, [(HEADER_PRODUCER, b"p"), (HEADER_SEQ, b"x")]) == (5, "", 1, 1)
    # seq is compared as a number, not as text
    assert merge_key(1, J, 0, sdk(1, "p", 9)) < merge_key(1, J, 0, sdk(1, "p", 10))


def test_send_order_of_one_producer_is_the_merge_order_across_topics():
    m = Merger()
    sends = [(Q, 1), (C, 2), (C, 3), (J, 4), (Q, 5), (J, 6), (J, 7), (C, 8)]  # (topic, seq), same millisecond
    offsets = {Q: 0, J: 0, C: 0}
    # per topic, records arrive in offset order; push topic by topic (jobs first) to scramble arrival
    for topic in (J, C, Q):
        for t, seq in sends:
            if t == topic:
                m.push("pool-a", TP(t, 0), merge_key(1000, t, offsets[t], sdk(1000, "p", seq)), seq)
                offsets[t] += 1
    assert m.buffered == 8
    # nothing is ready: the first released record must have every topic-partition present ...
    out = m.release("pool-a", ready=set())
    # ... heads are quota#1, chips#2, jobs#4: all present, so release goes on until a topic runs dry
    assert out == [1, 2, 3, 4, 5]  # after quota#5, quota is empty and not ready: jobs#6 waits
    assert m.buffered == 3
    assert m.release("pool-a", ready={TP(Q, 0)}) == [6, 7]  # then jobs is empty and not ready
    assert m.release("pool-a", ready={TP(Q, 0), TP(J, 0)}) == [8]
    assert m.pools() == [] and m.buffered == 0


def test_a_topic_partition_that_may_still_bring_an_earlier_record_blocks_release():
    m = Merger()
    m.push("p", TP(J, 2), merge_key(2000, J, 0, None), "job@2000")
    assert m.release("p", ready={TP(Q, 2)}) == []  # chips partition 2 neither has a record nor is ready
    m.push("p", TP(C, 2), merge_key(1500, C, 0, None), "chip@1500")
    assert m.release("p", ready={TP(Q, 2)}) == ["chip@1500"]  # jobs' head waits for chips again
    assert m.release("p", ready={TP(Q, 2), TP(C, 2)}) == ["job@2000"]


def test_timestamps_order_records_of_different_producers_and_pools_are_independent():
    m = Merger()
    m.push("a", TP(Q, 0), merge_key(3000, Q, 0, sdk(0, "p1", 1)), "a-q")
    m.push("a", TP(J, 0), merge_key(1000, J, 0, sdk(0, "p2", 50)), "a-j")
    m.push("b", TP(C, 1), merge_key(500, C, 0, None), "b-c")
    every = {TP(t, p) for t in (Q, J, C) for p in (0, 1)}
    assert m.release("a", ready=every) == ["a-j", "a-q"]
    assert sorted(m.pools()) == ["b"]
    assert m.pools_on(1) == ["b"] and m.pools_on(0) == []
    assert m.release("b", ready=every) == ["b-c"]


def test_foreign_records_in_one_millisecond_go_quota_jobs_chips_then_offset():
    m = Merger()
    m.push("p", TP(C, 0), merge_key(7, C, 0, None), "c0")
    m.push("p", TP(J, 0), merge_key(7, J, 4, None), "j4")
    m.push("p", TP(J, 0), merge_key(7, J, 5, None), "j5")
    m.push("p", TP(Q, 0), merge_key(7, Q, 9, None), "q9")
    assert m.release("p", ready={TP(t, 0) for t in (Q, J, C)}) == ["q9", "j4", "j5", "c0"]


def test_misuse_is_refused_and_revoked_partitions_are_dropped():
    m = Merger()
    with pytest.raises(ValueError, match="not an input topic"):
        m.push("p", TP("chipledger.journal", 0), (0, "", 0, 0), "x")
    m.push("p", TP(Q, 0), (0, "", 0, 0), "x")
    with pytest.raises(ValueError, match="not co-partitioned"):
        m.push("p", TP(J, 1), (0, "", 1, 0), "y")
    m.push("r", TP(J, 1), (0, "", 1, 0), "y")
    assert m.drop_partition(0) == 1 and m.pools() == ["r"] and m.buffered == 1
