"""The merge of a pool's three input sub-streams into one deterministic fold order (no Kafka here: pure).

A pool's events arrive on three topics (quota, jobs, chips), each ordered only within its partition. The worker
buffers each record under its pool (the message key) and input topic-partition, and releases them in the order
of one key, `merge_key`:

- a record from the producer SDK carries the headers `chipledger-producer` and `chipledger-seq`; its key is
  (record timestamp, producer id, seq). For one producer, timestamps never go back and seq counts sends, so
  merge order = send order (= file order for `chipledger emit`);
- a record without them (a foreign producer) has the key (record timestamp, "", topic rank, offset).

Release rule (timestamp synchronisation, as Kafka Streams does it): the smallest head of a pool is released
only when every input topic-partition of the pool's partition either has a buffered record of that pool, or is
*ready*: caught up (everything up to its high watermark was received) and idle for `merge_idle_ms`. The worker
decides readiness (it knows the consumer's positions and the clock); this module only applies the rule.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable, NamedTuple, Optional

from schemas.topics import INPUT_TOPICS

HEADER_PRODUCER = "chipledger-producer"
HEADER_SEQ = "chipledger-seq"

TOPIC_RANK = {t: i for i, t in enumerate(INPUT_TOPICS)}


class TP(NamedTuple):
    topic: str
    partition: int


MergeKey = tuple[int, str, int, int]


def merge_key(timestamp_ms: int, topic: str, offset: int, headers: Optional[Iterable[tuple[str, bytes]]]) -> MergeKey:
    """The merge order key of one input record (see the module docstring)."""
    producer = seq = None
    for name, value in headers or ():
        if name == HEADER_PRODUCER:
            producer = value
        elif name == HEADER_SEQ:
            seq = value
    if producer and seq is not None:
        try:
            n = int(seq)
        except ValueError:
            n = None
        if n is not None:
            pid = producer.decode("utf-8", "replace") if isinstance(producer, (bytes, bytearray)) else str(producer)
            return (timestamp_ms, pid, n, offset)
    return (timestamp_ms, "", TOPIC_RANK.get(topic, len(TOPIC_RANK)), offset)


class Merger:
    """Buffers of input records per pool and input topic-partition, released in merge order.

    `push` adds a record (records of one topic-partition arrive in offset order); `release(pool, ready)` pops
    the records of `pool` that may be folded now, given the set of topic-partitions that are ready (caught up
    and idle). `partitions_of(tp)` are the co-partitioned input topic-partitions of a partition number."""

    def __init__(self, input_topics: Iterable[str] = INPUT_TOPICS):
        self.input_topics = tuple(input_topics)
        self._buf: dict[str, dict[TP, deque]] = {}  # pool -> tp -> deque[(key, item)]
        self._partition: dict[str, int] = {}  # pool -> its partition number
        self.buffered = 0

    def tps(self, partition: int) -> tuple[TP, ...]:
        return tuple(TP(t, partition) for t in self.input_topics)

    def push(self, pool: str, tp: TP, key: MergeKey, item: Any) -> None:
        if tp.topic not in self.input_topics:
            raise ValueError(f"{tp.topic} is not an input topic")
        known = self._partition.setdefault(pool, tp.partition)
        if known != tp.partition:  # keyed by pool with equal partition counts: cannot happen unless misconfigured
            raise ValueError(f"pool {pool!r} arrived on partition {tp.partition} and {known}: input topics are "
                             "not co-partitioned (equal partition counts and the default partitioner)")
        self._buf.setdefault(pool, {}).setdefault(tp, deque()).append((key, item))
        self.buffered += 1

    def pools(self) -> list[str]:
        """Pools with buffered records."""
        return list(self._buf)

    def pools_on(self, partition: int) -> list[str]:
        return [p for p in self._buf if self._partition[p] == partition]

    def partition_of(self, pool: str) -> Optional[int]:
        """The partition a pool's records arrive on (None before its first record)."""
        return self._partition.get(pool)

    def heads(self, pool: str) -> list[Any]:
        """The items at the head of each of the pool's buffers."""
        return [q[0][1] for q in self._buf.get(pool, {}).values() if q]

    def tps_buffered(self) -> set[TP]:
        """Every input topic-partition of the partitions that hold buffered records."""
        return {tp for pool in self._buf for tp in self.tps(self._partition[pool])}

    def release(self, pool: str, ready) -> list[Any]:
        """Pop and return, in merge order, the records of `pool` the rule allows now. `ready` is a container of
        the topic-partitions that are caught up and idle."""
        bufs = self._buf.get(pool)
        if not bufs:
            return []
        tps = self.tps(self._partition[pool])
        out = []
        while True:
            best = None
            for tp in tps:
                q = bufs.get(tp)
                if q:
                    if best is None or q[0][0] < best[0][0]:
                        best = q
                elif tp not in ready:
                    best = None  # a topic-partition that may still bring an earlier record of this pool: wait
                    break
            if best is None:
                break
            out.append(best.popleft()[1])
        self.buffered -= len(out)
        if not any(bufs.values()):
            del self._buf[pool]
        return out

    def drop_partition(self, partition: int) -> int:
        """Forget the buffered records of a partition (revoked from this worker); returns how many."""
        n = 0
        for pool in self.pools_on(partition):
            n += sum(len(q) for q in self._buf.pop(pool).values())
        for pool in [p for p, part in self._partition.items() if part == partition]:
            del self._partition[pool]
        self.buffered -= n
        return n
