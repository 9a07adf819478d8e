"""The sink (`chipledger sink`): consumes the worker's output topics and writes the lake and the store, exactly once.

Each poll is one batch:

1. an output record carries, for some input records of one pool, each one's lake rows (events, journal,
   job_runs, balances, …; decisions; dead letters) with its *origin* (input topic, partition, offset). A pool's
   input records of one topic-partition are folded in offset order, so the sink keeps, per (output topic, pool,
   input topic-partition), the last input offset it wrote: an item at or below this mark is a re-send after a
   worker crash (same content, new output offset), and is dropped;
2. the batch's rows are written as Parquet into a staging folder `<lake>/_staging/<sink>/<batch>`;
3. one store transaction: the pools' balances (from the latest state snapshot of each pool in the batch), the
   decisions index, the output positions read `(sink, topic, partition, offset)`, the marks (as tracking rows
   `(sink@topic/pool, input topic, input partition, input offset)`) and the batch number;
4. the staged files are moved into the lake.

After a crash: batches whose number the store has are moved into place (step 4 was cut short), later ones are
deleted (their records are read again from the stored positions). So a replayed message changes nothing, and a
re-sent one neither.

Before an item counts, its origin must be a position the worker can have folded (`check_origin`): an input
or log topic, a partition the item's pool hashes to (Kafka's default partitioner, as the producers key by pool),
an offset below that partition's end, and an output record keyed by the same pool. Any other item is written
as a dead letter of its own (`forged_origin`, the output record's position, the item's bytes) and moves no
mark, so no record can make the sink drop the rows the worker sends after it. On a secure broker only the
worker can write the output topics (docs/security.md); this check holds without authentication too.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import orjson

from analytics.lake import LEGACY_EVENT_COLUMNS, LakeWriter, complete_event_row
from ledger.state import PoolState
from schemas import INPUT_TOPICS, OUTPUT_TOPICS
from schemas import topics as _topics
from schemas.topics import TOPIC_DEADLETTER, TOPIC_DECISIONS, TOPIC_JOURNAL
from streams.clients import as_connection

log = logging.getLogger(__name__)

_SHORT = {TOPIC_JOURNAL: "journal", TOPIC_DECISIONS: "decisions", TOPIC_DEADLETTER: "deadletter"}

#: the topics an item's origin may name: the inputs, and the sequenced log (streams/worker.py's sequencer)
ORIGIN_TOPICS = tuple(INPUT_TOPICS) + (getattr(_topics, "TOPIC_LOG", "chipledger.log"),)
#: the dead-letter code of an output item whose origin the worker cannot have written
FORGED_ORIGIN = "forged_origin"


@functools.lru_cache(maxsize=65_536)  # pure-Python murmur2: once per pool and partition count, not per item
def partition_for(pool: str, partitions: int) -> int:
    """The partition Kafka's default partitioner (murmur2, as kafka-python, aiokafka and Java use) gives `pool`."""
    from kafka.partitioner.default import murmur2

    return (murmur2(pool.encode("utf-8")) & 0x7FFFFFFF) % partitions


class KafkaOrigins:
    """What the sink asks the broker about origin topics: their partition counts and end offsets. The end
    offsets are cached and fetched again only when an item claims an offset at or beyond the cached end."""

    def __init__(self, consumer):
        self.consumer = consumer
        self._parts: dict[str, Optional[int]] = {}
        self._ends: dict[tuple[str, int], int] = {}

    def partitions(self, topic: str) -> Optional[int]:
        if topic not in self._parts:
            parts = self.consumer.partitions_for_topic(topic)
            if not parts:
                return None  # not cached: the topic may be created later
            self._parts[topic] = len(parts)
        return self._parts[topic]

    def end_offset(self, topic: str, partition: int, at_least: int) -> Optional[int]:
        end = self._ends.get((topic, partition))
        if end is None or end <= at_least:
            from kafka import TopicPartition

            tp = TopicPartition(topic, partition)
            end = self.consumer.end_offsets([tp]).get(tp)
            if end is None:
                return None
            self._ends[(topic, partition)] = end
        return end


def check_origin(origins, pool: str, origin, out_key=None) -> Optional[str]:
    """Why an item of `pool` with `origin` cannot come from the worker, or None when it can. `origins` answers
    `partitions(topic)` and `end_offset(topic, partition, at_least)` (KafkaOrigins), or is None (no broker:
    only what the record itself shows is checked)."""
    if not (isinstance(origin, (list, tuple)) and len(origin) == 3 and isinstance(origin[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in origin[1:])):
        return f"origin {str(origin)[:80]!r} is not [input topic, partition, offset]"
    topic, partition, offset = origin
    if topic not in ORIGIN_TOPICS:
        return f"origin topic {topic[:80]!r} is not an input or log topic ({', '.join(ORIGIN_TOPICS)})"
    if not isinstance(pool, str) or not pool:
        return "the record names no pool"
    if out_key is not None and out_key != pool.encode("utf-8"):
        return f"the output record's key is not its pool {pool[:80]!r}"
    if origins is None:
        return None
    n = origins.partitions(topic)
    if n is None:
        return f"origin topic {topic} does not exist"
    if partition >= n or partition_for(pool, n) != partition:
        return (f"pool {pool[:80]!r} is on partition {partition_for(pool, n)} of {topic}, not on partition "
                f"{partition} (producers key by pool)")
    end = origins.end_offset(topic, partition, offset)
    if end is None or offset >= end:
        return f"offset {offset} is beyond the end of {topic}[{partition}] (next offset {end})"
    return None


def mark_consumer(sink: str, out_topic: str, pool: str) -> str:
    """The tracking `consumer` of a mark (kept under the store's 256 characters: long pools are hashed)."""
    name = f"{sink}@{_SHORT.get(out_topic, out_topic)}/{pool}"
    if len(name) > 200:
        name = f"{sink}@{_SHORT.get(out_topic, out_topic)}/#" + hashlib.blake2b(pool.encode(), digest_size=16).hexdigest()
    return name


@dataclass
class SinkStats:
    records: int = 0
    resent_dropped: int = 0
    rows: Counter = field(default_factory=Counter)
    snapshots: int = 0
    batches: int = 0
    forged: int = 0  # items whose origin the worker cannot have written (dead-lettered as forged_origin)

    def as_dict(self) -> dict:
        return {"records": self.records, "resent_dropped": self.resent_dropped, "rows": dict(sorted(self.rows.items())),
                "snapshots": self.snapshots, "batches": self.batches, "forged": self.forged}


class Sink:
    """Output topics -> lake + store. `consumer` is a kafka-python KafkaConsumer (made from `bootstrap`, a
    `streams.clients.KafkaConnection` or a PLAINTEXT address, if None)."""

    def __init__(self, lake: Path, store, *, bootstrap=None, name: str = "sink",
                 max_records: int = 50_000, batch_ms: int = 2000, timeout_s: float = 10, consumer=None,
                 origins=None):
        self.lake = Path(lake)
        self.store = store
        self.name = name
        self.connection = as_connection(bootstrap) if consumer is None else None
        self.bootstrap = self.connection.bootstrap if self.connection is not None else bootstrap
        self.max_records = max_records
        self.batch_ms = batch_ms
        self.timeout_s = timeout_s
        self.staging = self.lake / "_staging" / name
        self.stats = SinkStats()
        self._marks: dict[tuple[str, str, str, int], int] = {}
        self._batch = self.store.position(self._batch_consumer, "lake", 0) or 0
        self.recover()
        self.consumer = consumer if consumer is not None else self._connect()
        # origin checks against the broker: the sink's own consumer unless given (tests without a broker)
        self.origins = origins if origins is not None else (KafkaOrigins(self.consumer) if consumer is None else None)

    @property
    def _batch_consumer(self) -> str:
        return f"{self.name}:batch"

    # --- start ------------------------------------------------------------------------------------------
    def recover(self) -> None:
        """Finish the last committed batch's move into the lake; delete staged batches the store never got."""
        if not self.staging.exists():
            return
        for d in sorted(self.staging.iterdir()):
            if d.is_dir() and d.name.isdigit() and int(d.name) <= self._batch:
                self._publish(d)
            else:
                shutil.rmtree(d, ignore_errors=True)

    def _connect(self):
        from kafka import KafkaConsumer, TopicPartition
        from kafka.errors import KafkaError

        from streams.topics import KafkaSetupError, describe_error

        try:
            consumer = KafkaConsumer(**self.connection.kafka_python(), enable_auto_commit=False, group_id=None,
                                     bootstrap_timeout_ms=max(1, int(self.timeout_s * 1000)),
                                     client_id=f"chipledger-{self.name}", max_poll_records=self.max_records,
                                     fetch_max_bytes=64 << 20, max_partition_fetch_bytes=16 << 20)
        except KafkaError as exc:
            raise KafkaSetupError(f"no Kafka broker answered at {self.connection} within {self.timeout_s:g}s "
                                  f"({describe_error(exc)}); start one "
                                  "(`chipledger kafka up`) or pass --bootstrap HOST:PORT") from None
        tps = []
        for topic in OUTPUT_TOPICS:
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                consumer.close()
                raise KafkaSetupError(f"topic {topic} does not exist at {self.bootstrap}: create the topics with "
                                      "`chipledger topics create`")
            tps.extend(TopicPartition(topic, p) for p in sorted(parts))
        consumer.assign(tps)
        for tp in tps:
            done = self.store.position(self.name, tp.topic, tp.partition)
            if done is None:
                consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, done + 1)
        return consumer

    # --- batches ----------------------------------------------------------------------------------------
    def _mark(self, key: tuple[str, str, str, int]) -> int:
        m = self._marks.get(key)
        if m is None:
            out_topic, pool, in_topic, in_part = key
            stored = self.store.position(mark_consumer(self.name, out_topic, pool), in_topic, in_part)
            m = self._marks[key] = -1 if stored is None else stored
        return m

    def handle(self, records: list) -> int:
        """Write one batch of output records (kafka-python ConsumerRecords, in offset order per partition)."""
        if not records:
            return 0
        self._batch += 1
        stage = self.staging / str(self._batch)
        writer = LakeWriter(stage, f"{self.name}-{self._batch:08d}")
        positions: dict[tuple[str, int], int] = {}
        marks: dict[tuple[str, str, str, int], int] = {}
        snapshots: dict[str, dict] = {}
        decisions: list[tuple] = []
        for rec in records:
            positions[(rec.topic, rec.partition)] = rec.offset
            self.stats.records += 1
            try:
                value = orjson.loads(rec.value)
                kind = value["kind"]
            except (orjson.JSONDecodeError, TypeError, KeyError):
                log.warning("sink: %s[%d]@%d is not a chipledger output record; skipped", rec.topic, rec.partition,
                            rec.offset)
                continue
            if kind == "state":
                snapshots[value["pool"]] = value["state"]
                continue
            pool = value.get("pool")
            items = value.get("items")
            for item in items if isinstance(items, list) else [items]:
                why = check_origin(self.origins, pool, item.get("origin") if isinstance(item, dict) else None,
                                   getattr(rec, "key", None))
                if why is None and not (isinstance(item.get("tables"), dict)
                                        and all(isinstance(r, list) for r in item["tables"].values())):
                    why = "the item has no tables of rows"
                if why is not None:
                    self._forged(writer, rec, pool, item, why)
                    continue
                in_topic, in_part, in_offset = item["origin"]
                key = (rec.topic, pool, in_topic, in_part)
                if in_offset <= self._mark(key):
                    self.stats.resent_dropped += 1
                    continue
                self._marks[key] = marks[key] = in_offset
                for table, rows in item["tables"].items():
                    for row in rows:
                        if table == "events" and len(row) == LEGACY_EVENT_COLUMNS:
                            row = complete_event_row(row)  # from a worker of an earlier version
                        writer.add(table, tuple(row))
                    self.stats.rows[table] += len(rows)
                    if table == "decisions":
                        decisions.extend(tuple(r) for r in rows)
        writer.close()
        tracking = [(self.name, t, p, o) for (t, p), o in sorted(positions.items())]
        tracking += [(mark_consumer(self.name, ot, pool), it, ip, o) for (ot, pool, it, ip), o in sorted(marks.items())]
        tracking.append((self._batch_consumer, "lake", 0, self._batch))
        pools = [PoolState.from_dict(s) for _, s in sorted(snapshots.items())]
        self.store.save(pools, tracking=tracking, decisions=decisions)
        self.stats.snapshots += len(pools)
        self.stats.batches += 1
        self._publish(stage)
        return len(records)

    def _forged(self, writer, rec, pool, item, why: str) -> None:
        """An item the worker cannot have sent: a dead letter of its own, with the output record's position."""
        import base64

        self.stats.forged += 1
        self.stats.rows["deadletters"] += 1
        raw = orjson.dumps(item, default=str)
        seen_at = int(getattr(rec, "timestamp", 0) or 0) // 1000
        log.warning("sink: %s[%d]@%d: an item the worker cannot have written: %s", rec.topic, rec.partition,
                    rec.offset, why)
        writer.add("deadletters", (rec.topic, rec.partition, rec.offset, seen_at, FORGED_ORIGIN, why, None, None,
                                   pool if isinstance(pool, str) else None, base64.b64encode(raw).decode("ascii")))

    def _publish(self, stage: Path) -> None:
        """Move a committed batch's files from staging into the lake (idempotent: a file moved already is gone)."""
        if stage.exists():
            for f in sorted(stage.rglob("*.parquet")):
                dest = self.lake / f.relative_to(stage)
                dest.parent.mkdir(parents=True, exist_ok=True)
                f.replace(dest)
            shutil.rmtree(stage, ignore_errors=True)

    def poll_once(self, timeout_ms: int = 200, batch_ms: Optional[int] = None) -> int:
        """Read for up to `batch_ms` (default: the sink's) or `max_records` records and write what came as one
        batch: each batch writes one Parquet file per table and day, so longer batches mean fewer files."""
        batch_ms = self.batch_ms if batch_ms is None else batch_ms
        by_tp: dict = {}
        n = 0
        deadline = time.monotonic() + batch_ms / 1000
        while n < self.max_records:
            got = self.consumer.poll(timeout_ms=timeout_ms if not n else 50, max_records=self.max_records - n)
            for tp, recs in got.items():
                by_tp.setdefault(tp, []).extend(recs)
                n += len(recs)
            if not got or time.monotonic() >= deadline:
                break
        records = [r for tp in sorted(by_tp, key=lambda tp: (tp.topic, tp.partition)) for r in by_tp[tp]]
        return self.handle(records)

    def run(self, *, idle_exit_s: Optional[float] = None, stop: Optional[Callable[[], bool]] = None) -> SinkStats:
        """Consume until `stop()` is true, or until nothing came for `idle_exit_s` seconds (when given)."""
        last = time.monotonic()
        while stop is None or not stop():
            if self.poll_once():
                last = time.monotonic()
            elif idle_exit_s is not None and time.monotonic() - last >= idle_exit_s:
                break
        return self.stats

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None
