"""The sequencer's rule: the one order of a pool's events, decided once (no Kafka here: pure).

A pool's events arrive on three input topics (quota, jobs, chips), each ordered only within its partition. The
sequencer buffers each record under its pool (the message key) and input topic-partition, and releases the
heads of those buffers into `chipledger.log` in an order that depends only on what the records say, never on
when they arrived or on their record timestamps:

- the producer SDK stamps every record with `chipledger-producer` (an id per producer instance),
  `chipledger-seq` (1, 2, … per instance, in send order) and `chipledger-prev`: the seq of the same producer's
  previous record **of the same pool** (0 for its first one). A head is released when its predecessor is
  in the log already (the pool's state holds the last seq released per producer), so the sequencer knows
  exactly what it still waits for: for one producer, log order = send order, whatever the timing;
- a record without these headers (a foreign producer) is released as soon as it is at the head of its buffer:
  it keeps its place within its topic-partition (offset order), and among the three topics it is placed where
  the sequencer read it;
- a head waiting for a predecessor that does not come (its producer died between the two sends, or it was
  sent without our headers) is released after `wait_ms` once every input topic-partition of the pool's
  partition is caught up (everything up to its high watermark was read): a logged, *forced* release. A
  predecessor arriving after that is released when it arrives (it is then a late event for the fold);
- a waiting head that holds back records of *another* producer behind it on its topic-partition is released
  (forced, the input topics caught up) after `block_ms` (default 2 s) instead: a missing or forged predecessor
  delays its own producer's records for `wait_ms` at most, and the others' for `block_ms` at most (issue 31).
  Offsets stay in order per input topic-partition (the fold, the sink and `log export` skip what was logged
  twice by that order), so the held record itself goes then; only its own producer's order can suffer;
- when several heads may go, the one of the lowest topic rank (quota < jobs < chips) goes first.

Heads are released in offset order per input topic-partition, so "the last offset released per input
topic-partition" (`SeqState.positions`) says exactly which records are in the log already: after a restart,
records at or below it are dropped instead of being sequenced twice.
"""

from __future__ import annotations

import functools
import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Optional

from schemas.topics import INPUT_TOPICS

HEADER_PRODUCER = "chipledger-producer"
HEADER_SEQ = "chipledger-seq"
HEADER_PREV = "chipledger-prev"
#: headers of a log record: its input record's origin ("topic:partition:offset") and record timestamp (ms)
HEADER_ORIGIN = "chipledger-origin"
HEADER_TIMESTAMP = "chipledger-ts"

TOPIC_RANK = {t: i for i, t in enumerate(INPUT_TOPICS)}
PRODUCERS_KEPT = 1024  # per pool: the producers whose last seq is remembered (most recent first)


class TP(NamedTuple):
    topic: str
    partition: int


class Stamp(NamedTuple):
    """What the SDK's headers say about a record (None for a foreign record)."""

    producer: str
    seq: int
    prev: int


MAX_PRODUCER_BYTES = 128  # the SDK's producer ids are 16 hex digits; a longer one is not a stamp (kept per pool)


def stamp_of(headers: Optional[Iterable[tuple[str, bytes]]]) -> Optional[Stamp]:
    """The record's stamp from its headers, or None when they are missing or malformed."""
    producer = seq = prev = None
    for name, value in headers or ():
        if name == HEADER_PRODUCER:
            producer = value
        elif name == HEADER_SEQ:
            seq = value
        elif name == HEADER_PREV:
            prev = value
    if not producer or seq is None or prev is None or len(producer) > MAX_PRODUCER_BYTES:
        return None
    try:
        s, p = int(seq), int(prev)
    except (TypeError, ValueError):
        return None
    if s < 1 or p < 0 or p >= s:
        return None
    pid = producer.decode("utf-8", "replace") if isinstance(producer, (bytes, bytearray)) else str(producer)
    return Stamp(pid, s, p)


@dataclass
class SeqState:
    """A pool's sequencer state (kept in the Faust table `sequencer-state`): the last seq released per
    producer (at most PRODUCERS_KEPT, most recent last) and the last offset released per input topic-partition."""

    last: dict[str, int] = field(default_factory=dict)
    positions: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"last": self.last, "positions": self.positions}

    @classmethod
    def from_dict(cls, d: dict) -> "SeqState":
        return cls(dict(d.get("last") or {}), dict(d.get("positions") or {}))

    def released(self, tp: TP, offset: int, stamp: Optional[Stamp]) -> None:
        self.positions[f"{tp.topic}:{tp.partition}"] = offset
        if stamp is not None:
            # the highest seq released: a record released `late` (below it) must not lower it, or its producer's
            # next record (whose predecessor is that highest one) would wait again and go `forced` again
            last = self.last.pop(stamp.producer, 0)
            self.last[stamp.producer] = max(stamp.seq, last)
            if len(self.last) > PRODUCERS_KEPT:
                del self.last[next(iter(self.last))]

    def logged(self, tp: TP, offset: int) -> bool:
        return self.positions.get(f"{tp.topic}:{tp.partition}", -1) >= offset


class Held(NamedTuple):
    offset: int
    stamp: Optional[Stamp]
    arrived: float
    item: Any


class Release(NamedTuple):
    """One released record: its item, and why it went when it is not the plain rule: "forced" (its predecessor
    never came), "late" (its successor was forced past it) or "logged" (in the log already: drop, don't send)."""

    item: Any
    tp: TP
    offset: int
    note: Optional[str] = None


class Sequencer:
    """Buffers of input records per pool and input topic-partition, released by the rule of the module doc.

    `push(pool, tp, offset, stamp, arrived, item)` adds a record (per topic-partition in offset order);
    `release(pool, state, now, caught_up)` pops what may go now, in log order, and updates `state`."""

    def __init__(self, input_topics: Iterable[str] = INPUT_TOPICS, wait_ms: int = 60_000, block_ms: int = 2_000):
        self.input_topics = tuple(input_topics)
        self.wait_ms = wait_ms
        self.block_ms = min(block_ms, wait_ms)
        self._buf: dict[str, dict[TP, deque]] = {}
        self._partition: dict[str, int] = {}
        self.buffered = 0

    def tps(self, partition: int) -> tuple[TP, ...]:
        return tuple(TP(t, partition) for t in self.input_topics)

    def push(self, pool: str, tp: TP, offset: int, stamp: Optional[Stamp], arrived: float, item: Any) -> None:
        """Buffer a record. The caller dead-letters records of a pool on the wrong partition before this."""
        if tp.topic not in self.input_topics:
            raise ValueError(f"{tp.topic} is not an input topic")
        self._partition.setdefault(pool, tp.partition)
        self._buf.setdefault(pool, {}).setdefault(tp, deque()).append(Held(offset, stamp, arrived, item))
        self.buffered += 1

    def pools(self) -> list[str]:
        return list(self._buf)

    def partition_of(self, pool: str) -> Optional[int]:
        return self._partition.get(pool)

    def tps_buffered(self) -> set[TP]:
        return {tp for pool in self._buf for tp in self.tps(self._partition[pool])}

    @staticmethod
    def _may_go(h: Held, state: SeqState) -> Optional[str]:
        """"ok" / "late" when the head may go by the rule, None when it waits for its predecessor."""
        s = h.stamp
        if s is None:
            return "ok"
        last = state.last.get(s.producer)
        if last is None:
            return "ok" if s.prev == 0 else None
        if s.prev == last:
            return "ok"
        if s.seq <= last:
            return "late"  # its successor was forced past it
        return None

    def release(self, pool: str, state: SeqState, now: float, caught_up=lambda tp: True) -> list[Release]:
        bufs = self._buf.get(pool)
        if not bufs:
            return []
        tps = self.tps(self._partition[pool])
        out: list[Release] = []
        while True:
            go = None
            waiting = None
            for tp in tps:
                q = bufs.get(tp)
                if not q:
                    continue
                h = q[0]
                if state.logged(tp, h.offset):
                    go = (tp, "logged")
                    break
                why = self._may_go(h, state)
                if why is not None:
                    go = (tp, None if why == "ok" else why)
                    break
                waited_ms = (now - h.arrived) * 1000
                # a head waits for its predecessor up to wait_ms; when it holds back another producer's records
                # behind it on its topic-partition, only up to block_ms: a missing or forged predecessor delays
                # its own producer's records, the others' by block_ms at most (issue 31)
                if waited_ms >= self.wait_ms or (waited_ms >= self.block_ms and _blocks_others(q)):
                    if waiting is None or h.arrived < bufs[waiting][0].arrived:
                        waiting = tp
            if go is None and waiting is not None and all(caught_up(tp) for tp in tps):
                go = (waiting, "forced")
            if go is None:
                break
            tp, note = go
            h = bufs[tp].popleft()
            if note != "logged":
                state.released(tp, h.offset, h.stamp)
            out.append(Release(h.item, tp, h.offset, note))
        self.buffered -= len(out)
        if not any(bufs.values()):
            del self._buf[pool]
        return out

    def drop_partition(self, partition: int) -> int:
        """Forget the buffered records of a partition (revoked from this worker); returns how many."""
        n = 0
        for pool in [p for p in self._buf if self._partition[p] == partition]:
            n += sum(len(q) for q in self._buf.pop(pool).values())
        for pool in [p for p, part in self._partition.items() if part == partition]:
            del self._partition[pool]
        self.buffered -= n
        return n


BLOCK_SCAN = 64  # records behind a waiting head looked at for another producer's


def _blocks_others(q: deque) -> bool:
    """Whether a record of another producer (or an unstamped one) waits behind the head of `q`."""
    head = q[0].stamp
    for i, h in enumerate(q):
        if i == 0:
            continue
        if i > BLOCK_SCAN:
            return True  # a long queue behind one head: not all of it is the head's own producer's
        if h.stamp is None or head is None or h.stamp.producer != head.producer:
            return True
    return False


@functools.lru_cache(maxsize=65_536)  # pure-Python murmur2: once per key and partition count, not per record
def key_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner (murmur2, as Java's and every SDK's) gives a key."""
    from kafka.partitioner.default import murmur2

    return (murmur2(key) & 0x7FFFFFFF) % partitions


class AckGate:
    """Acknowledges a topic-partition's records in offset order only: a record is acked once it and every record
    received before it on its topic-partition are done. (Faust commits the first run of consecutive acked
    offsets even when an earlier record is still unacked: faust-streaming 0.15.3 `Consumer._new_offset` checks
    the head against the committed offset with an off-by-one, and not at all before the first commit; a record
    held in a buffer while later ones were acked was skipped after a crash.)"""

    def __init__(self):
        self._order: dict[TP, deque] = {}
        self._done: dict[TP, set] = {}

    def received(self, tp: TP, offset: int, event) -> None:
        self._order.setdefault(tp, deque()).append((offset, event))

    def done(self, tp: TP, offset: int) -> list:
        """Mark a record done; returns the events that may be acked now, in offset order."""
        self._done.setdefault(tp, set()).add(offset)
        q, d = self._order.get(tp), self._done[tp]
        out = []
        while q and q[0][0] in d:
            off, ev = q.popleft()
            d.discard(off)
            out.append(ev)
        return out

    def drop_partition(self, partition: int) -> None:
        for tp in [tp for tp in self._order if tp.partition == partition]:
            del self._order[tp]
            self._done.pop(tp, None)


STALL_READ_MAX = 2000  # records read directly at once for a partition not read to its end


class Intake:
    """Every record of each consumed topic-partition, in offset order, none left out.

    Faust's stream does not hand every record it fetched to the agent: a record it dequeues while the consumer's
    generation changed or its flow control is suspended (around a rebalance) is skipped **and acknowledged**
    (faust-streaming 0.15.3 `Stream._py_aiter` / `_c_aiter`: `value = skipped_value` ... `event.ack()`, also on a
    `noack()` stream), and its read offset keeps the record from being delivered again in that generation. The
    input and log topics are plain (no transactions, no compaction): their offsets have no gaps. So a stage sees a
    skipped record as a hole in the offsets it received (or, at the start of an assignment, between the committed
    offset and its first record, or at the end, as a partition not read to its high watermark), holds the records
    after the hole, and reads the hole's records from Kafka itself (`missing` says which, `fill` takes them).

    `arrive(tp, offset, item)` returns the items that may be handled now, in offset order (a record below `next` is
    one the caller has: delivered again, dropped). With `check_start`, the first records of a topic-partition are
    held until `start(tp, offset)` says where the consumer started (the committed offset)."""

    def __init__(self, check_start: bool = False):
        self.check_start = check_start
        self.next: dict[TP, int] = {}  # the next offset expected per topic-partition
        self._held: dict[TP, list[tuple[int, Any]]] = {}  # records after a hole, in offset order
        self._lo: dict[TP, int] = {}  # the first offset of an open hole
        self._until: dict[TP, int] = {}  # the end of a hole with nothing after it (a partition not read to its end)
        self._unstarted: set[TP] = set()  # first records held until `start`

    def arrive(self, tp: TP, offset: int, item: Any) -> list:
        nxt = self.next.get(tp)
        if nxt is None:
            self.next[tp] = offset + 1
            if self.check_start:
                self._unstarted.add(tp)
                self._held.setdefault(tp, []).append((offset, item))
                return []
            return [item]
        if offset < nxt:
            raise ValueError(f"{tp}: offset {offset} delivered again (the caller drops what it has)")
        if offset > nxt and tp not in self._lo and tp not in self._unstarted:
            self._lo[tp] = nxt  # a hole: [nxt, offset) were never handed to us
        self.next[tp] = offset + 1
        if tp in self._lo or tp in self._unstarted:
            self._held.setdefault(tp, []).append((offset, item))
            self._until.pop(tp, None)
            return []
        return [item]

    def expect(self, tp: TP) -> None:
        """`tp` was assigned: its start is asked for (`unstarted`) even if Faust never hands over a record of it.
        Faust may skip every record it fetches of a partition around a rebalance; when no record comes after them
        (the producers are done), nothing else would tell that the partition has records this stage never saw."""
        if self.check_start and tp not in self.next:
            self._unstarted.add(tp)

    def start(self, tp: TP, offset: int) -> list:
        """Where the consumer started reading `tp` (its committed offset, or the partition's first offset): a hole
        before the first record received, or between the records held meanwhile, is read directly; returns the held
        records that may be handled now. A partition with no record received yet (`expect`) continues from `offset`:
        if it stays behind its end, it is read directly (`stalled`)."""
        if tp not in self._unstarted:
            return []
        self._unstarted.discard(tp)
        held = self._held.get(tp)
        if not held:
            if tp not in self.next:
                self.next[tp] = offset
            return []
        self._lo[tp] = min(offset, held[0][0])
        return self.fill(tp, [])

    def unstarted(self) -> set[TP]:
        return set(self._unstarted)

    def held_offsets(self, tp: TP) -> set[int]:
        return {o for o, _ in self._held.get(tp, ())}

    def holds(self, tp: TP) -> bool:
        """Whether records of `tp` are held (a hole open, or its start not known yet)."""
        return tp in self._lo or tp in self._unstarted

    def stalled(self, tp: TP, end: int) -> None:
        """`tp` has records up to `end` (its high watermark) that did not come: read them directly."""
        nxt = self.next.get(tp)
        if nxt is not None and nxt < end and tp not in self._lo and tp not in self._unstarted:
            self._lo[tp] = nxt
            self._until[tp] = min(end, nxt + STALL_READ_MAX)

    def missing(self) -> dict[TP, tuple[int, int]]:
        """The range [lo, hi) of offsets to read directly, per topic-partition with a hole."""
        out = {}
        for tp, lo in self._lo.items():
            held = self._held.get(tp)
            out[tp] = (lo, max(held[-1][0] if held else lo, self._until.get(tp, lo)))
        return out  # an empty range: what was missing came meanwhile (`fill(tp, [])` closes the hole)

    def fill(self, tp: TP, records: Iterable[tuple[int, Any]]) -> list:
        """Records read directly for a hole of `tp` (offset, item): returns everything that may be handled now, in
        offset order, once the hole is complete (else keeps what came and waits for the rest)."""
        lo = self._lo.get(tp)
        if lo is None:
            return []
        have = dict(records)
        for off, item in self._held.get(tp, ()):
            have[off] = item  # the record Faust delivered, where it did
        end = max(have, default=lo - 1) + 1
        gaps = [o for o in range(lo, end) if o not in have]
        if gaps:
            self._held[tp] = sorted(have.items(), key=lambda h: h[0])  # all from the hole's start on
            self._lo[tp] = gaps[0]  # what came is kept; the rest is read again from the first still missing
            return []
        del self._lo[tp]
        self._until.pop(tp, None)
        first = min(have, default=lo)  # held records before `lo` (an earlier fill kept them) go first
        self._held[tp] = [(o, have[o]) for o in range(min(first, lo), end)]
        self.next[tp] = max(self.next.get(tp, end), end)
        return self._release(tp)

    def gone(self, tp: TP, first: int) -> tuple[int, list]:
        """The partition's records below offset `first` are no longer in Kafka (retention ran, or records were
        deleted): an open hole below it can never be read, so it is closed there. Returns how many offsets were
        given up, and what may be handled now (as `fill`)."""
        lo = self._lo.get(tp)
        if lo is None or lo >= first:
            return 0, []
        self._lo[tp] = first
        return first - lo, self.fill(tp, [])

    def _release(self, tp: TP) -> list:
        held = self._held.pop(tp, [])
        return [item for _, item in held]

    def forget(self, partitions: set[int]) -> None:
        """Partitions revoked: forget their topic-partitions."""
        for d in (self.next, self._held, self._lo, self._until):
            for tp in [tp for tp in d if tp.partition in partitions]:
                del d[tp]
        self._unstarted = {tp for tp in self._unstarted if tp.partition not in partitions}


# --- log records: several input records of one pool in one Kafka record ---------------------------------------

HEADER_BATCH = "chipledger-batch"  # on a log record whose value is a batch (below); its value: the format, b"1" or b"2"
_ENTRY = struct.Struct(">BIqqI")  # format 1: topic rank, partition, offset, record timestamp ms, length of the bytes
#: format 2 (issue 31): also the broker's append time in ms (-1: the input topic keeps producer times) and who the
#: record was accepted from (the principal and the cluster, `origin`; empty when the worker trusts every record)
_ENTRY2 = struct.Struct(">BIqqqHHI")
LOG_BATCH_BYTES = 512 * 1024  # a batch is closed at this size (one larger record is a batch of its own)
LOG_BATCH_RECORDS = 1000
BATCH_FORMAT = b"2"


class Entry(NamedTuple):
    """One input record in a log record: its origin, record timestamp and bytes (exactly as received), the broker's
    append time (LogAppendTime, -1 when unknown) and who it was accepted from."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    value: bytes
    appended_ms: int = -1
    principal: str = ""
    origin: str = ""


def pack_batch(entries: Iterable[Entry]) -> bytes:
    """The value of a log record holding `entries` (in log order), format 2: for each, a fixed header, the
    principal and origin (UTF-8) and its bytes."""
    out = []
    for e in entries:
        who, where = e.principal.encode(), e.origin.encode()
        out.append(_ENTRY2.pack(TOPIC_RANK[e.topic], e.partition, e.offset, e.timestamp_ms, e.appended_ms,
                                len(who), len(where), len(e.value)))
        out += [who, where, e.value]
    return b"".join(out)


def unpack_batch(value: bytes, fmt: bytes = BATCH_FORMAT) -> list[Entry]:
    """The entries of a log record's value of format `fmt` (the HEADER_BATCH value; ValueError when it is not a
    batch this module wrote)."""
    out, i, n = [], 0, len(value)
    view = memoryview(value)
    if fmt == b"1":
        while i < n:
            if i + _ENTRY.size > n:
                raise ValueError("a truncated log batch")
            rank, part, off, ts, length = _ENTRY.unpack_from(view, i)
            i += _ENTRY.size
            if rank >= len(INPUT_TOPICS) or i + length > n:
                raise ValueError("a malformed log batch")
            out.append(Entry(INPUT_TOPICS[rank], part, off, ts, bytes(view[i:i + length])))
            i += length
        return out
    if fmt != b"2":
        raise ValueError(f"unknown log batch format {bytes(fmt)[:8]!r}")
    while i < n:
        if i + _ENTRY2.size > n:
            raise ValueError("a truncated log batch")
        rank, part, off, ts, appended, lwho, lwhere, length = _ENTRY2.unpack_from(view, i)
        i += _ENTRY2.size
        if rank >= len(INPUT_TOPICS) or i + lwho + lwhere + length > n:
            raise ValueError("a malformed log batch")
        who = bytes(view[i:i + lwho]).decode("utf-8", "replace")
        i += lwho
        where = bytes(view[i:i + lwhere]).decode("utf-8", "replace")
        i += lwhere
        out.append(Entry(INPUT_TOPICS[rank], part, off, ts, bytes(view[i:i + length]), appended, who, where))
        i += length
    return out


def batch_format(headers) -> Optional[bytes]:
    """The batch format of a log record (its HEADER_BATCH value), None when it is not a batch."""
    for name, value in headers or ():
        if name == HEADER_BATCH:
            return bytes(value) if value else b"1"
    return None


def batches(entries: list[Entry], max_bytes: int = LOG_BATCH_BYTES, max_records: int = LOG_BATCH_RECORDS):
    """`entries` cut into consecutive groups of at most `max_records` and about `max_bytes`."""
    cur, size = [], 0
    for e in entries:
        if cur and (size + len(e.value) > max_bytes or len(cur) >= max_records):
            yield cur
            cur, size = [], 0
        cur.append(e)
        size += len(e.value) + _ENTRY2.size + len(e.principal) + len(e.origin)
    if cur:
        yield cur
