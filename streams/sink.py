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
4. the lake's commit (analytics/commits.py `publish`): the staged files are moved into the tables' folders and one
   manifest swap names them, with the batch number as the lake's mark `sink:<name>`. Until then no reader sees them.

The store is the truth of what was consumed; the lake's mark says which of those batches it has committed. After a
crash between them (store at batch N, lake's mark N-1), the sink's start commits batch N from its staged folder
(the folder keeps the list of its files, so a commit cut short after moving some of them finishes); a staged batch
the lake's mark already covers is removed; a staged batch beyond the store's number is deleted (its records are
read again from the stored positions). So a batch is in the lake exactly when the store has it, a replayed message
changes nothing, and a re-sent one neither.

Before an item counts, its origin must be a position the worker can have folded (`check_origin`): an input
or log topic, a partition the item's pool hashes to (Kafka's default partitioner, as the producers key by pool),
an offset below that partition's end, and an output record keyed by the same pool (a dead letter of the
sequencer, `"stage": "sequencer"`, is of a record on no pool's partition, so only its topic and offset are
checked). Any other item is written
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

from analytics.commits import LakeLayoutError, lake_layout, mark as lake_mark, publish, LAYOUT_VERSION
from analytics.lake import DAY_COLUMN, EARLIER_EVENT_WIDTHS, SCHEMAS, LakeWriter, complete_event_row
from ledger.state import PoolState
from schemas import INPUT_TOPICS, OUTPUT_TOPICS, Rejection, RejectionCode
from schemas import topics as _topics
from schemas.topics import TOPIC_DEADLETTER, TOPIC_DECISIONS, TOPIC_JOURNAL
from streams.clients import as_connection
from streams.rows import deadletter_row

PARTS = 4096  # a mark is input offset * PARTS + part (an item split in parts, see streams.worker.pack_records)
WHOLE = PARTS - 1
_DAY_IDX = {t: SCHEMAS[t].get_field_index(DAY_COLUMN[t]) for t in SCHEMAS}
_WIDTH = {t: len(SCHEMAS[t]) for t in SCHEMAS}


class Malformed(ValueError):
    """An output record the sink cannot write (forged, truncated, of another program): dead-lettered."""


def parse_output(raw: bytes) -> tuple[str, str, Optional[str], object]:
    """(kind, pool, stage, items or state) of an output record, or `Malformed` saying what is wrong. Items are
    checked for shape: origin [topic, partition, offset], optional part [i, n], tables of known names whose rows
    have the table's width and an integer day column (the values' types are checked when written)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise Malformed(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise Malformed("not a JSON object")
    kind, pool, stage = value.get("kind"), value.get("pool"), value.get("stage")
    if not isinstance(pool, str):
        raise Malformed("no string `pool`")
    if kind == "state":
        st = value.get("state")
        if not isinstance(st, dict):
            raise Malformed("a state record without a `state` object")
        try:
            PoolState.from_dict(st)
        except Exception as exc:  # noqa: BLE001 - whatever a forged state breaks
            raise Malformed(f"a state that does not load: {type(exc).__name__}: {str(exc)[:200]}") from None
        return kind, pool, None, st
    if kind != "rows":
        raise Malformed(f"`kind` is {str(kind)[:40]!r}, not 'rows' or 'state'")
    if stage is not None and not isinstance(stage, str):
        raise Malformed("`stage` is not a string")
    items = value.get("items")
    if not isinstance(items, list):
        raise Malformed("a rows record without an `items` list")
    return kind, pool, stage, items


def item_problem(item) -> Optional[str]:
    """What is wrong with the shape of one item, or None: origin [topic, partition, offset], optional part
    [i, n], tables of known names whose rows have the table's width and an integer day column (the values'
    types are checked when written)."""
    if not isinstance(item, dict):
        return "the item is not an object"
    o = item.get("origin")
    if not (isinstance(o, list) and len(o) == 3 and isinstance(o[0], str)
            and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**62 // PARTS for x in o[1:])):
        return f"origin {str(o)[:80]!r} is not [input topic, partition, offset]"
    part = item.get("part")
    if part is not None and not (isinstance(part, list) and len(part) == 2
                                 and all(isinstance(x, int) and not isinstance(x, bool) for x in part)
                                 and 0 <= part[0] < part[1] <= WHOLE):
        return "the item's `part` is not [i, n] with 0 <= i < n < 4096"
    tables = item.get("tables")
    if not isinstance(tables, dict):
        return "the item has no tables of rows"
    for table, rows in tables.items():
        if table not in SCHEMAS or not isinstance(rows, list):
            return f"unknown table {str(table)[:40]!r}"
        width = _WIDTH[table]
        for row in rows:
            if not isinstance(row, list) or not (len(row) == width or (
                    table == "events" and len(row) in EARLIER_EVENT_WIDTHS)):
                return f"a {table} row of the wrong width"
            day = row[_DAY_IDX[table]]
            if not isinstance(day, int) or isinstance(day, bool):
                return f"a {table} row whose {DAY_COLUMN[table]} is not an integer"
    return None


def check_types(items) -> None:
    """Raise `Malformed` when a row's values do not convert to its table's column types."""
    import pyarrow as pa

    for item in items:
        for table, rows in item["tables"].items():
            if table == "events":
                rows = [complete_event_row(tuple(r)) if len(r) in EARLIER_EVENT_WIDTHS else r for r in rows]
            for col, f in zip(zip(*rows), SCHEMAS[table]):
                try:
                    pa.array(col, type=f.type)
                except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                    raise Malformed(f"{table}.{f.name}: {type(exc).__name__}: {str(exc)[:200]}") from None

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


def check_origin(origins, pool: str, origin, out_key=None, any_partition: bool = False) -> Optional[str]:
    """Why an item of `pool` with `origin` cannot come from the worker, or None when it can. `origins` answers
    `partitions(topic)` and `end_offset(topic, partition, at_least)` (KafkaOrigins), or is None (no broker:
    only what the record itself shows is checked)."""
    if not (isinstance(origin, (list, tuple)) and len(origin) == 3 and isinstance(origin[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in origin[1:])):
        return f"origin {str(origin)[:80]!r} is not [input topic, partition, offset]"
    topic, partition, offset = origin
    if topic not in ORIGIN_TOPICS:
        return f"origin topic {topic[:80]!r} is not an input or log topic ({', '.join(ORIGIN_TOPICS)})"
    if any_partition:  # a sequencer dead letter: a record with no key, or on a partition not its pool's
        if origins is None:
            return None
        n = origins.partitions(topic)
        if n is None or partition >= n:
            return f"origin {topic}[{partition}] does not exist"
        end = origins.end_offset(topic, partition, offset)
        if end is None or offset >= end:
            return f"offset {offset} is beyond the end of {topic}[{partition}] (next offset {end})"
        return None
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
    short = _SHORT.get(out_topic.split("#")[0], out_topic) + (".seq" if out_topic.endswith("#sequencer") else "")
    name = f"{sink}@{short}:p/{pool}"
    if len(name) > 200:
        name = f"{sink}@{short}:p/#" + hashlib.blake2b(pool.encode(), digest_size=16).hexdigest()
    return name


@dataclass
class SinkStats:
    records: int = 0
    resent_dropped: int = 0
    rows: Counter = field(default_factory=Counter)
    snapshots: int = 0
    batches: int = 0
    malformed: int = 0  # records that are not output records (dead-lettered by the sink)
    forged: int = 0  # items whose origin the worker cannot have written (dead-lettered as forged_origin)

    def as_dict(self) -> dict:
        return {"records": self.records, "resent_dropped": self.resent_dropped, "rows": dict(sorted(self.rows.items())),
                "snapshots": self.snapshots, "batches": self.batches, "malformed": self.malformed,
                "forged": self.forged}


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
        layout = lake_layout(self.lake)
        if layout not in (None, LAYOUT_VERSION):  # commits to a lake of another layout would hide its files
            raise LakeLayoutError(f"lake {self.lake} has layout {layout} (this sink writes layout {LAYOUT_VERSION}): "
                                  f"run `chipledger lake upgrade --lake {self.lake}`")
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

    @property
    def lake_mark(self) -> str:
        """The lake's mark of the last batch this sink committed (analytics.commits.mark)."""
        return f"sink:{self.name}"

    # --- start ------------------------------------------------------------------------------------------
    def recover(self) -> None:
        """Commit to the lake the staged batches the store has and the lake does not (a crash between the store's
        transaction and the lake's commit); remove those the lake has and those the store never got. A last batch
        without rows (no staged folder) commits its mark."""
        committed = lake_mark(self.lake, self.lake_mark) or 0
        if self.staging.exists():
            for d in sorted(self.staging.iterdir(), key=lambda d: (not d.name.isdigit(),
                                                                   int(d.name) if d.name.isdigit() else 0)):
                if d.is_dir() and d.name.isdigit() and committed < int(d.name) <= self._batch:
                    log.warning("sink %s: batch %s is in the store but not in the lake (a crash between them): "
                                "committing it now", self.name, d.name)
                    self._publish(d)
                else:
                    shutil.rmtree(d, ignore_errors=True)
        if committed < self._batch and (lake_mark(self.lake, self.lake_mark) or 0) < self._batch:
            self._publish(self.staging / str(self._batch))

    def _connect(self):
        from kafka import TopicPartition

        from streams.topics import KafkaSetupError, kafka_consumer

        consumer = kafka_consumer(self.connection, client_id=f"chipledger-{self.name}", timeout_s=self.timeout_s,
                                  max_poll_records=self.max_records, fetch_max_bytes=64 << 20,
                                  max_partition_fetch_bytes=16 << 20)
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
        """Write one batch of output records (kafka-python ConsumerRecords, in offset order per partition). A
        record that is not a chipledger output record is written as a dead letter of the sink (its raw bytes,
        the output topic, partition and offset, and what is wrong) and the batch goes on."""
        if not records:
            return 0
        marks, stats = dict(self._marks), SinkStats(self.stats.records, self.stats.resent_dropped,
                                                    Counter(self.stats.rows), self.stats.snapshots,
                                                    self.stats.batches, self.stats.malformed, self.stats.forged)
        try:
            return self._handle(records, check=False)
        except (TypeError, ValueError, OverflowError, KeyError, IndexError) as exc:
            # a value of the wrong type made it past the shape checks: write the batch again, each record's
            # values checked first (slower, and only then)
            log.warning("sink: batch %d failed to write (%s: %s); writing it again with every record checked",
                        self._batch, type(exc).__name__, str(exc)[:200])
            shutil.rmtree(self.staging / str(self._batch), ignore_errors=True)
            self._batch -= 1
            self._marks, self.stats = marks, stats
            return self._handle(records, check=True)

    def _malformed(self, writer, rec, why: str) -> None:
        log.warning("sink: %s[%d]@%d is not a chipledger output record (%s): dead-lettered", rec.topic,
                    rec.partition, rec.offset, why)
        raw = rec.value if isinstance(rec.value, bytes) else bytes(rec.value or b"")
        row = deadletter_row(raw, Rejection(RejectionCode.schema_invalid,
                                            f"sink: not a chipledger output record: {why}"[:500]),
                             rec.topic, rec.partition, rec.offset, int((getattr(rec, "timestamp", 0) or 0) // 1000))
        writer.add("deadletters", row)
        self.stats.rows["deadletters"] += 1
        self.stats.malformed += 1

    def _handle(self, records: list, check: bool) -> int:
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
                kind, pool, out_stage, payload = parse_output(rec.value if rec.value is not None else b"")
                if check and kind == "rows":
                    check_types([it for it in payload if item_problem(it) is None])
            except Malformed as exc:
                self._malformed(writer, rec, str(exc))
                continue
            if kind == "state":
                snapshots[pool] = payload
                continue
            mark_topic = f"{rec.topic}#{out_stage}" if out_stage else rec.topic
            for item in payload:
                why = item_problem(item) or check_origin(self.origins, pool, item["origin"],
                                                         getattr(rec, "key", None),
                                                         any_partition=out_stage == "sequencer")
                if why is not None:
                    self._forged(writer, rec, pool, item, why)
                    continue
                in_topic, in_part, in_offset = item["origin"]
                key = (mark_topic, pool, in_topic, in_part)
                part = item.get("part")
                at = in_offset * PARTS + (WHOLE if part is None else part[0])
                if at <= self._mark(key):
                    self.stats.resent_dropped += 1
                    continue
                self._marks[key] = marks[key] = at
                for table, rows in item["tables"].items():
                    for row in rows:
                        if table == "events" and len(row) in EARLIER_EVENT_WIDTHS:
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
        """The lake's commit of a batch the store has: its staged files join their tables in one manifest swap, with
        the batch number as the lake's mark (idempotent: a file moved already is not moved again). A batch that wrote
        no rows (only state snapshots, or resent records dropped) has no staged folder and still commits its mark, so
        the lake's mark is always the store's last batch."""
        batch = int(stage.name)
        publish(self.lake, stage, by=f"sink {self.name} batch {batch}", marks={self.lake_mark: batch})

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
