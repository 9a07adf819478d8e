"""The Faust worker: a sequencer and a fold, in one app. Glue, no business rules.

1. **Sequencer** (`SequencerStage`). One agent per input topic (quota, jobs, chips) buffers records in a
   `streams.sequencer.Sequencer`; the drain releases them per pool in the one order of streams/sequencer.py
   (each producer's own send order, from the `chipledger-prev` header) and writes them, byte for byte, to
   `chipledger.log` (keyed by pool, the input origin and record timestamp in headers). A record with no key,
   a key that is not its event's pool, or a pool on the wrong partition is a dead letter instead.
2. **Fold** (`PoolWorker`). One agent reads `chipledger.log`; the drain folds its records in log order with
   `ledger.evolve` and sends the outputs (lake rows per input record on chipledger.journal, decisions on
   chipledger.decisions, dead letters on chipledger.deadletter; all keyed by pool, each record below
   `OUTPUT_RECORD_BYTES`).

Both stages make their work durable the same way, every `checkpoint_interval_ms`, in a task beside the drain
(which goes on meanwhile; one checkpoint at a time per stage), from what it captured at once between two drains:

1. wait until Kafka acknowledged everything sent (acks=all): log records, outputs;
2. the fold only: send the changed pools' state as snapshots for the store and wait for them;
3. write each changed pool's state to the stage's Faust table (`sequencer-state`: last seq per producer and
   last offset per input topic-partition; `pool-state`: the `PoolState`) and wait until Kafka acknowledged
   those changelog writes (`durable`: Faust's own flush before a commit waits at most 0.1 s for them);
4. only then acknowledge the records, per topic-partition in offset order (`AckGate`), so a committed offset
   never passes a record whose effects are not in Kafka.

After a crash, the sequencer drops the records its state says are in the log; a record logged but not yet in
the state is logged again, and the fold skips it (its input origin is at or below the pool's positions), as it
skips the log records it folded before the crash. Outputs sent again have the same content (the fold is
deterministic; the sink drops them by origin, see streams/sink.py).

A timer sends `pool.tick` for quiet pools (see `tick_event`): it only closes hours that are already past.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import inspect
import logging
import time
import uuid
import weakref
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import orjson
from aiokafka.errors import KafkaError

from ledger.books import HOUR_S
from ledger.fold import DEFAULT_CONFIG, FoldConfig, evolve
from ledger.state import PoolState
from schemas import INPUT_TOPICS, Rejection, RejectionCode, parse_event
from schemas.parse import DEFAULT_MAX_EVENT_BYTES, size_rejection
from schemas.topics import TOPIC_DEADLETTER, TOPIC_DECISIONS, TOPIC_JOURNAL, TOPIC_LOG, TOPIC_QUOTA
from streams.clients import KafkaConnection, as_connection
from streams.rows import deadletter_row, step_rows
from streams.sequencer import (BATCH_FORMAT, HEADER_BATCH, HEADER_ORIGIN, HEADER_PREV, HEADER_PRODUCER, HEADER_SEQ,
                               HEADER_TIMESTAMP, TP, AckGate, Entry, Intake, SeqState, Sequencer, Stamp, batch_format,
                               batches, key_partition, pack_batch, stamp_of, unpack_batch)

log = logging.getLogger(__name__)

TABLE_NAME = "pool-state"
SEQ_TABLE_NAME = "sequencer-state"
TICK_SOURCE = "chipledger/worker"
BAD_KEY = getattr(RejectionCode, "bad_key", RejectionCode.schema_invalid)
BAD_SIGNATURE = RejectionCode.bad_signature

SendFn = Callable[..., Awaitable[Any]]  # (topic, key, value, headers=None) -> awaitable delivery


@dataclass
class WorkerSettings:
    bootstrap: str = "127.0.0.1:9092"
    # address and credentials of every client of the worker (streams.clients); None: PLAINTEXT to `bootstrap`
    kafka: Optional[KafkaConnection] = None
    app_id: str = "chipledger-worker"
    data_dir: Path = Path(".chipledger-worker")
    table_store: str = "rocksdb"  # rocksdb | memory
    partitions: int = 3
    sequencer_wait_ms: int = 60_000  # how long a record waits for its predecessor once its topics are caught up
    sequencer_block_ms: int = 2_000  # ... and how long when it holds back another producer's records behind it
    # the principals registry (streams/principals.py): every input record must be signed by one of them and be
    # theirs to send (schemas/roles.py); None: every record is trusted (a plain broker, tests)
    principals: Any = None
    principals_reload_s: float = 1.0  # how often the registry file is looked at for changes (revocation)
    tick_interval_s: int = 60     # 0: no ticks
    checkpoint_interval_ms: int = 500  # how often handled records are made durable (state written, inputs acked)
    drain_interval_ms: int = 10
    fetch_max_wait_ms: int = 20  # how long the broker may hold a fetch of the input topics (Faust fixes 1,500)
    session_timeout_s: float = 6.0  # a killed worker's partitions are reassigned after this (Kafka's minimum: 6)
    heartbeat_interval_s: float = 1.0
    freeze_gc: bool = False  # run_worker (its own process): gc.freeze() at each checkpoint, see PoolWorker._gc
    full_gc_interval_s: float = 600  # with freeze_gc: how often everything is collected (one longer pause)
    fold_config: FoldConfig = field(default_factory=lambda: DEFAULT_CONFIG)
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES  # [ledger] max_event_bytes: a longer value is too_large
    metrics_port: Optional[int] = None  # serve Prometheus /metrics (streams/metrics.py) on this port; 0: any free
    metrics_host: str = "127.0.0.1"
    log_stalls_ms: int = 0  # log each event-loop stall longer than this, with what held the loop (streams/stalls.py)

    def connection(self) -> KafkaConnection:
        """The Kafka connection of every client of the worker (Faust's consumer and producer, its admin)."""
        return self.kafka if self.kafka is not None else as_connection(self.bootstrap)

    def store_url(self) -> str:
        if self.table_store == "memory":
            return "memory://"
        if self.table_store == "rocksdb":
            return "rocksdb://"
        raise ValueError(f"table store must be rocksdb or memory, got {self.table_store!r}")


@dataclass
class Pending:
    """A record the fold handles: the Faust event of its log record (to ack), its input origin and bytes."""

    event: Any
    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes
    timestamp_ms: int
    arrived: float
    last_of_record: bool = True  # the last input record of its log record: acks the log record
    # what the log record says of the input record (the Kafka edge fills them; None: not known): the cluster of the
    # verified principal it was accepted from (ids are deduplicated per origin; None: the event's `source` stands
    # in) and its broker append time in epoch seconds (LogAppendTime: an event further ahead is `clock_ahead`)
    origin_cluster: Optional[str] = None
    appended_s: Optional[int] = None


#: the largest output record the worker writes (the broker's default max.message.bytes is 1 MiB; room is left
#: for the record's framing). A longer item (a long gap closes many hours) is split into parts.
OUTPUT_RECORD_BYTES = 900_000
CHECKPOINT_RECORDS_MAX = 50_000  # checkpoint early when this many handled records wait for it
DRAIN_SLICE_NS = 20_000_000  # the fold sends what it folded and lets the loop run after this much folding (a backlog)


#: a table value longer than this is written in parts (Faust's changelog topics keep the broker's default limit of
#: 1 MiB per record, and a busy pool's state, most of it the dedup window's day of event ids, outgrows it)
TABLE_PART_BYTES = 800_000
PARTS_PREFIX = b"\x00parts "  # a head value: where a pool's parted value is (a state's JSON starts with "{")
MAX_KEY_BYTES = 1024  # a pool id: at most 256 characters (schemas), 4 bytes each at most in UTF-8
MAX_PARTS = 10_000  # 8 GB: a head saying more is not one the worker wrote


def part_key(pool: str, version: str, i: int) -> bytes:
    """The table key of part `i` of a pool's parted value. No pool's key is one: the fold's table is keyed by
    schema-valid pool ids (no control characters); the sequencer's is keyed by input keys (which may hold a NUL,
    dead-lettered by the fold as `chipledger run` does) but its values, at most PRODUCERS_KEPT producer ids of
    at most 128 bytes, stay far below TABLE_PART_BYTES, so they are never parted."""
    return pool.encode() + b"\x00part\x00" + version.encode() + b":" + str(i).encode()


def head_of(raw) -> Optional[dict]:
    """The head in a table value (None: a plain value or none), checked: a head that does not say where a whole
    value is raises."""
    if raw is None:
        return None
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise TypeError(f"a table value is a {type(raw).__name__}, not JSON bytes")
    raw = bytes(raw)
    if not raw.startswith(PARTS_PREFIX):
        return None
    try:
        head = orjson.loads(raw[len(PARTS_PREFIX):])
        ok = (isinstance(head, dict) and isinstance(head.get("version"), str) and len(head["version"]) <= 64
              and all(isinstance(head.get(k), int) and not isinstance(head.get(k), bool)
                      for k in ("n", "parts", "bytes", "crc32"))
              and 0 < head["parts"] <= MAX_PARTS and 0 < head["bytes"] <= head["parts"] * TABLE_PART_BYTES)
    except orjson.JSONDecodeError:
        ok = False
    if not ok:
        raise RuntimeError(f"a table value starts as a head of parts and is not one: {raw[:200]!r}")
    return head


async def write_parted(t, pool: str, value: bytes, settle: Callable[[], Awaitable[bool]]) -> None:
    """Write a pool's value to the table `t`: as it is when short, else in parts under new keys and then a head
    under the pool's key naming them. `settle()` waits until Kafka acknowledged the writes made so far (raising
    if one failed) and says whether to go on (False: a rebalance began; the checkpoint then acks nothing): the
    head is written only once its parts are in the changelog, and the previous value's parts are deleted only
    once the new value is. A crash or a refused write at any point leaves the previous value whole (the broker
    refuses a part over its record limit but may take the head after it: never sent then)."""
    key = pool.encode()
    previous = head_of(t.get(key))
    if len(value) <= TABLE_PART_BYTES:
        t[key] = value
    else:
        n = -(-len(value) // TABLE_PART_BYTES)
        count = (previous or {}).get("n", 0) + 1
        version = f"{count}-{uuid.uuid4().hex[:8]}"
        for i in range(n):
            t[part_key(pool, version, i)] = value[i * TABLE_PART_BYTES:(i + 1) * TABLE_PART_BYTES]
        if not await settle():
            return
        t[key] = PARTS_PREFIX + orjson.dumps({"version": version, "n": count, "parts": n, "bytes": len(value),
                                              "crc32": zlib.crc32(value)})
    if previous is not None:
        if not await settle():
            return
        for i in range(previous["parts"]):
            try:
                del t[part_key(pool, previous["version"], i)]
            except KeyError:  # gone already
                pass


def read_parted(t, pool: str) -> tuple[Optional[bytes], Optional[dict]]:
    """A pool's value in the table `t` (None: none) and its head (None: a plain value); see `write_parted`."""
    raw = t.get(pool.encode())
    head = head_of(raw)
    if head is None:
        return (None if raw is None else bytes(raw)), None
    parts = [t.get(part_key(pool, head["version"], i)) for i in range(head["parts"])]
    if any(p is None for p in parts):
        raise RuntimeError(f"the table's value of pool {pool!r} is in {head['parts']} parts (version "
                           f"{head['version']}) and part {[p is None for p in parts].index(True)} is missing")
    whole = b"".join(bytes(p) for p in parts)
    if len(whole) != head["bytes"] or zlib.crc32(whole) != head["crc32"]:
        raise RuntimeError(f"the table's value of pool {pool!r} (version {head['version']}) does not match its "
                           f"head: {len(whole)} bytes, {head['bytes']} expected")
    return whole, head


def state_values(state: PoolState) -> tuple[bytes, bytes]:
    """A pool state's table value (the whole state as JSON) and its snapshot for the store: the same without the
    dedup window's event ids (the store keeps balances and grants; the window is most of a busy pool's state)."""
    d = state.to_dict()
    value = orjson.dumps(d)
    d["dedup"] = []
    return value, orjson.dumps(d)


def state_record(pool: str, state_json: bytes) -> bytes:
    """The value of a state snapshot record (for the store's balances), around the table value's JSON."""
    return b'{"kind":"state","pool":' + orjson.dumps(pool) + b',"state":' + state_json + b"}"


def rows_record(pool: str, items: list[dict], stage: Optional[str] = None) -> bytes:
    """The value of an output record: for each of some input records of `pool`, in fold order, its origin
    (input topic, partition, offset) and the lake rows it produced per table."""
    head = {"kind": "rows", "pool": pool}
    if stage:
        head["stage"] = stage
    return orjson.dumps({**head, "items": items})


def _item_parts(item: dict, limit: int) -> list[bytes]:
    """An item as JSON, or, when longer than `limit`, as parts that each carry some of its rows:
    {"origin", "part": [i, n], "tables": {...}} (the sink writes each part once, see streams/sink.py)."""
    whole = orjson.dumps(item)
    if len(whole) <= limit:
        return [whole]
    rows = [(t, r, len(orjson.dumps(r)) + 1) for t, rs in item["tables"].items() for r in rs]
    groups: list[dict[str, list]] = []
    cur: dict[str, list] = {}
    size = 0
    for t, r, n in rows:
        if cur and size + n + len(t) + 8 > limit:
            groups.append(cur)
            cur, size = {}, 0
        cur.setdefault(t, []).append(r)
        size += n + len(t) + 8
    if cur:
        groups.append(cur)
    return [orjson.dumps({"origin": item["origin"], "part": [i, len(groups)], "tables": g})
            for i, g in enumerate(groups)]


def pack_records(pool: str, items: list[dict], limit: int = OUTPUT_RECORD_BYTES,
                 stage: Optional[str] = None) -> list[bytes]:
    """Output record values for `items` (in order), each at most about `limit` bytes: items are grouped while
    they fit, and an item longer than that is split across records by `_item_parts`. One row longer than the
    limit (a dead letter of a huge input) is a record of its own (the output topics accept 8 MiB records)."""
    head = b'{"kind":"rows","pool":' + orjson.dumps(pool) + (b',"stage":' + orjson.dumps(stage) if stage else b"") \
        + b',"items":['
    out: list[bytes] = []
    cur: list[bytes] = []
    size = len(head) + 2
    for item in items:
        for part in _item_parts(item, limit - len(head) - 2):
            if cur and size + len(part) + 1 > limit:
                out.append(head + b",".join(cur) + b"]}")
                cur, size = [], len(head) + 2
            cur.append(part)
            size += len(part) + 1
    if cur:
        out.append(head + b",".join(cur) + b"]}")
    return out


def tick_event(pool: str, clock_s: int, elapsed_s: float) -> Optional[dict]:
    """The `pool.tick` the timer sends for a pool quiet for `elapsed_s` wall seconds, or None.

    Its event time is the pool clock plus the wall time elapsed since the pool's last event, floored to the
    hour: a tick closes only hours that are already past, so it never moves a pool clock beyond where real
    events could still land in order. The event id is derived from the pool and that hour, so ticks sent twice
    (two workers, a restart) are identical duplicates."""
    target = clock_s + int(elapsed_s)
    hour = target - target % HOUR_S
    if hour <= clock_s:
        return None
    digest = hashlib.blake2b(pool.encode(), digest_size=8).hexdigest()
    return {"event_id": f"tick-{digest}-{hour}", "type": "pool.tick",
            "occurred_at": datetime.fromtimestamp(hour, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "pool": pool, "source": TICK_SOURCE}


STALL_S = 2.0  # a topic-partition behind its high watermark with nothing arriving for this long is read directly


async def ack_events(events: list) -> None:
    """The default commit of a stage (unit tests): ack each event (Faust commits the acked offsets)."""
    for ev in events:
        ev.ack()


class Fetched:
    """A record a stage read directly from Kafka (Faust skipped it, see `streams.sequencer.Intake`), shaped like the
    Faust event it replaces: `message` (topic, partition, offset, key, value, timestamp in s, headers)."""

    __slots__ = ("message", "__weakref__")

    def __init__(self, topic, partition, offset, key, value, timestamp_s, headers, timestamp_type=0):
        from types import SimpleNamespace

        self.message = SimpleNamespace(topic=topic, partition=partition, offset=offset, key=key, value=value,
                                       timestamp=timestamp_s, headers=list(headers or ()),
                                       timestamp_type=timestamp_type)

    def ack(self) -> None:  # committed by offset (the stage's `commit`), like every other record
        pass


def _in_order(received_next: dict, tp: TP, offset: int) -> None:
    """A stage handles each topic-partition's records one after the other with none left out (`Intake`); anything
    else is a defect that would lose or reorder records: stop (the records are read again after a restart)."""
    want = received_next.get(tp)
    if want is not None and offset != want:
        raise RuntimeError(f"{tp.topic}[{tp.partition}]: handled offset {offset} after {want - 1}")


class Continuity:
    """What both stages do with `Intake`: records in offset order per topic-partition, a hole (records Faust
    skipped) read directly with `fetch(tp, lo, hi)`, the first records of an assignment checked against where the
    consumer started (`start_offsets(tps)`), a partition behind its end (`end_of(tp)`) for `STALL_S` read too."""

    def _init_continuity(self, fetch, start_offsets, end_of, first_of=None) -> None:
        self.fetch, self.start_offsets, self.end_of = fetch, start_offsets, end_of
        self.first_of = first_of  # async (tp) -> the partition's first offset in Kafka (None: not known now)
        self.intake = Intake(check_start=start_offsets is not None)
        self._arrived_at: dict[TP, float] = {}
        self._hole_turn = 0
        self.counts.setdefault("read_directly", 0)
        self.counts.setdefault("gone", 0)

    def assigned(self, tps) -> None:
        """Topic-partitions of this stage assigned to the worker: each is watched from now on, records or not (a
        partition whose every record Faust skipped is read directly once it stays behind its end for STALL_S)."""
        now = self.clock()
        for tp in tps:
            if tp not in self.intake.next:
                self.intake.expect(tp)
                self._arrived_at[tp] = now

    def _arrive(self, tp: TP, offset: int, event) -> list:
        self._arrived_at[tp] = self.clock()
        return self.intake.arrive(tp, offset, event)

    async def _fill_holes(self) -> None:
        """Check where the consumer started on new partitions, open holes for stalled ones, read the holes' records
        and handle what may go, each partition's records **at once** after its read (before the next await: a record
        Faust delivers meanwhile comes after them; handled later, it went first, and the sequencer then dropped the
        earlier one as logged). Nothing while Faust rebalances: until its recovery of the tables is complete, a record
        handled here would meet a pool's state that is not restored yet (Faust delivers nothing then either); each
        partition's stall clock starts again when it is done."""
        if self.halted():
            now = self.clock()
            for tp in self._arrived_at:
                self._arrived_at[tp] = now
            return
        # the drain holds its stage's lock, which a rebalance waits for (rebalance timeout 12 s): after READ_TIMEOUT_S
        # it starts no other call to Kafka (each waits at most that long), and it reads one hole at least
        budget = time.monotonic() + READ_TIMEOUT_S
        if self.start_offsets is not None:
            tps = sorted(self.intake.unstarted())  # in a fixed order: the holes they open are read in it
            if tps:
                starts = await self.start_offsets(tps)
                if self.halted():
                    return
                for tp in tps:
                    if starts.get(tp) is not None:
                        for ev in self.intake.start(tp, starts[tp]):
                            self._handle(ev)
        if self.end_of is not None:
            now = self.clock()
            for tp, nxt in list(self.intake.next.items()):
                if now - self._arrived_at.get(tp, now) >= STALL_S:
                    end = self.end_of(tp)
                    if end is not None and end > nxt:
                        self.intake.stalled(tp, end)
                        self._arrived_at[tp] = now  # once per STALL_S
        if self.fetch is None:
            return
        holes = list(self.intake.missing().items())
        if holes:  # each drain begins at the next hole: one partition Kafka is slow to answer for starves no other
            k = self._hole_turn % len(holes)
            holes = holes[k:] + holes[:k]
            self._hole_turn += 1
        reads = 0
        for tp, (lo, hi) in holes:
            if hi > lo and reads and time.monotonic() >= budget:
                break  # the other holes at the next drain
            reads += hi > lo
            records = await self.fetch(tp, lo, hi) if hi > lo else []
            if self.halted():
                return  # a rebalance began: what was read is read again by the partition's next owner
            had = self.intake.held_offsets(tp)
            n = sum(1 for r in records if r.message.offset not in had)
            if n:
                log.warning("worker: %s[%d]: %d record(s) at offsets %d..%d were not handed over by Faust's consumer "
                            "(skipped around a rebalance); read directly", tp.topic, tp.partition, n, lo, hi - 1)
            self.counts["read_directly"] += n
            for ev in self.intake.fill(tp, [(r.message.offset, r) for r in records]):
                self._handle(ev)
            if (hi > lo and self.first_of is not None and time.monotonic() < budget
                    and not any(r.message.offset == lo for r in records)):
                # the hole's first record did not come: it may be gone (retention, deleted records), and
                # then it never will; the hole is closed at the partition's first offset, loudly
                first = await self.first_of(tp)
                if self.halted():
                    return
                if first is not None:
                    n_gone, ready = self.intake.gone(tp, first)
                    if n_gone:
                        log.error("worker: %s[%d]: %d record(s) at offsets %d..%d are no longer in Kafka "
                                  "(retention or deleted records) and were never handled: skipped", tp.topic,
                                  tp.partition, n_gone, lo, first - 1)
                        self.counts["gone"] += n_gone
                    for ev in ready:
                        self._handle(ev)


def _key_bytes(key) -> Optional[bytes]:
    if key is None or isinstance(key, bytes):
        return key
    return key.encode() if isinstance(key, str) else bytes(key)


class SequencerStage(Continuity):
    """The sequencer outside Faust: buffers, the per-pool `SeqState`, the log writes and their checkpoint.

    `load(pool, event)` / `store(pool, json_bytes, event)` read and write the `sequencer-state` table;
    `send(topic, key, value, headers)` sends and returns an awaitable delivery; `caught_up(tp)` says whether
    everything up to the high watermark of `tp` was received."""

    def __init__(self, settings: WorkerSettings, *, load, store, send: SendFn, caught_up: Callable[[TP], bool],
                 clock: Callable[[], float] = time.monotonic, commit=ack_events, fetch=None, start_offsets=None,
                 end_of=None, first_of=None):
        self.settings = settings
        self.commit = commit  # async (events) -> None: commit the offsets of these records (in order per partition)
        self.seq = Sequencer(INPUT_TOPICS, wait_ms=settings.sequencer_wait_ms, block_ms=settings.sequencer_block_ms)
        self.registry = settings.principals
        self._registry_checked = float("-inf")
        self.load, self.store, self.send, self.caught_up, self.clock = load, store, send, caught_up, clock
        self.states: dict[str, SeqState] = {}
        self.gate = AckGate()
        self.received_next: dict[TP, int] = {}
        self._touched: dict[str, Any] = {}  # pool -> its last event (table context)
        self._done: list[tuple[TP, int]] = []  # handled since the last checkpoint
        self._inflight: list = []
        self._last_checkpoint = 0.0
        self._ckpt: Optional[asyncio.Future] = None
        self._captured: tuple[list, dict, list] = ([], {}, [])  # what the last checkpoint started took (carry_back)
        self.halted: Callable[[], bool] = lambda: False  # the app: Faust is rebalancing
        self.lock = asyncio.Lock()
        self._pending_dead: list = []  # (pool, tp, offset, item): sequencer dead letters not sent yet
        self.counts = {"received": 0, "logged": 0, "log_records": 0, "dropped_logged": 0, "forced": 0, "late": 0,
                       "dead_letters": 0, "refused": 0, "checkpoints": 0, "delivered_again": 0}
        self._init_continuity(fetch, start_offsets, end_of, first_of)

    def receive(self, event) -> None:
        """A record Faust delivered: handled in offset order, after the records of a hole before it (`Intake`)."""
        m = event.message
        tp = TP(m.topic, m.partition)
        if m.offset < self.intake.next.get(tp, -1):
            self.counts["delivered_again"] += 1  # Faust's seek to the committed offset: a record this stage has
            return                               # (handled, or held after a hole); handled once, committed once
        for ev in self._arrive(tp, m.offset, event):
            self._handle(ev)

    def _handle(self, event) -> None:
        m = event.message
        tp = TP(m.topic, m.partition)
        _in_order(self.received_next, tp, m.offset)
        self.received_next[tp] = m.offset + 1
        self.gate.received(tp, m.offset, event)
        self.counts["received"] += 1
        key = _key_bytes(m.key)
        value = m.value if isinstance(m.value, bytes) else (m.value or b"")
        ts_ms = int(round((m.timestamp or 0) * 1000))
        # the broker's clock, not the producer's, when the topic has message.timestamp.type=LogAppendTime
        appended_ms = ts_ms if getattr(m, "timestamp_type", 0) == 1 else -1
        why = self._bad_key(key, value, m.partition)
        if why is not None:
            self._dead(tp, m.offset, key, value, ts_ms, Rejection(BAD_KEY, why))
            return
        headers = list(m.headers or ())
        stamp = stamp_of(headers)
        principal = origin = ""
        if self.registry is not None:
            verdict = self.registry.verify(key, value, headers)
            if isinstance(verdict, Rejection) and verdict.code == BAD_SIGNATURE and self.registry.reload():
                # a principal added (or a key rotated) a moment ago: its first records come before the drain's look
                verdict = self.registry.verify(key, value, headers)
            if isinstance(verdict, Rejection):  # unsigned, badly signed, wrong_role, not_owner: never logged
                self.counts["refused"] += 1
                self._dead(tp, m.offset, key, value, ts_ms, verdict)
                return
            principal, origin = verdict.principal, verdict.origin
            if stamp is not None:  # producer ids are the principal's own: no one else can take a place in its order
                # (its slashes escaped: principal `a` with producer `b/c` is not principal `a/b` with `c`)
                who = principal.replace("%", "%25").replace("/", "%2F")
                stamp = Stamp(f"{who}/{stamp.producer}", stamp.seq, stamp.prev)
        self.seq.push(key.decode("utf-8"), tp, m.offset, stamp, self.clock(),
                      (event, key, value, ts_ms, headers, appended_ms, principal, origin))

    def _bad_key(self, key: Optional[bytes], value: bytes, partition: int) -> Optional[str]:
        """Why a record cannot be sequenced under its key, or None. (A body that does not parse is logged: the
        fold dead-letters it as `chipledger run` would.)"""
        if not key:
            return "the record has no message key (producers key by pool)"
        if len(key) > MAX_KEY_BYTES:
            return (f"the message key is {len(key):,} bytes long; a pool id is at most 256 characters "
                    f"({MAX_KEY_BYTES:,} bytes: producers key by pool)")
        try:
            pool = key.decode("utf-8")
        except UnicodeDecodeError:
            return "the message key is not UTF-8 (producers key by pool)"
        want = key_partition(key, self.settings.partitions)
        if want != partition:
            return (f"pool {pool[:200]!r} arrived on partition {partition}, its key's partition is {want} "
                    "(producers must use the default partitioner)")
        try:
            body = orjson.loads(value)
        except orjson.JSONDecodeError:
            return None
        if isinstance(body, dict) and isinstance(body.get("pool"), str) and body["pool"] != pool:
            return f"message key {pool[:200]!r} is not the event's pool {body['pool'][:200]!r} (producers key by pool)"
        return None

    def _dead(self, tp: TP, offset: int, key: Optional[bytes], value: bytes, ts_ms: int, rejection: Rejection) -> None:
        row = deadletter_row(value, rejection, tp.topic, tp.partition, offset, ts_ms // 1000)
        pool = (key or b"").decode("utf-8", "replace")
        item = {"origin": [tp.topic, tp.partition, offset], "tables": {"deadletters": [list(row)]}}
        self._pending_dead.append((pool, tp, offset, item))
        self.counts["dead_letters"] += 1

    def _state(self, pool: str, event) -> SeqState:
        st = self.states.get(pool)
        if st is None:
            d = self.load(pool, event)
            st = self.states[pool] = SeqState.from_dict(d) if d is not None else SeqState()
        return st

    async def drain(self) -> int:
        """Send the dead letters and release what the rule allows into the log; start a checkpoint when due."""
        async with self.lock:
            return await self._drain()

    async def _drain(self) -> int:
        await self._fill_holes()
        now = self.clock()
        if self.registry is not None and now - self._registry_checked >= self.settings.principals_reload_s:
            self._registry_checked = now
            if self.registry.reload():  # `kafka users add/remove`: from the next record on
                log.warning("worker: principals registry %s read: %d principal(s)", self.registry.path,
                            len(self.registry.entries))
        n = 0
        if self._pending_dead:
            dead, self._pending_dead = self._pending_dead, []
            by_pool: dict[str, list] = {}
            for pool, tp, offset, item in dead:
                by_pool.setdefault(pool, []).append(item)
                self._done.append((tp, offset))
            for pool, items in by_pool.items():
                for value in pack_records(pool, items, stage="sequencer"):
                    self._inflight.append(await self.send(TOPIC_DEADLETTER, pool.encode(), value))
        for pool in self.seq.pools():
            first = self.seq._buf[pool]
            event0 = next(q[0].item[0] for q in first.values() if q)
            state = self._state(pool, event0)
            entries: list[Entry] = []
            key = None
            for r in self.seq.release(pool, state, now, self.caught_up):
                event, key, value, ts_ms, headers, appended_ms, principal, origin = r.item
                self._done.append((r.tp, r.offset))
                n += 1
                if r.note == "logged":
                    self.counts["dropped_logged"] += 1
                    # its seq is in the live state, maybe not yet in the table (a checkpoint stopped by a rebalance
                    # wrote nothing): the checkpoint that acks it writes the state first
                    self._touched[pool] = event
                    continue
                if r.note in ("forced", "late"):
                    self.counts[r.note] += 1
                    stamp = stamp_of(headers)
                    log.warning("sequencer: %s[%d]@%d of pool %r (producer %s, seq %s, previous %s) released %s (%s)",
                                r.tp.topic, r.tp.partition, r.offset, pool, *(stamp or ("-", "-", "-")), r.note,
                                f"waited {self.settings.sequencer_wait_ms} ms for the previous record, the input "
                                "topics caught up" if r.note == "forced" else "after its successor was forced")
                entries.append(Entry(r.tp.topic, r.tp.partition, r.offset, ts_ms, value, appended_ms, principal, origin))
                self._touched[pool] = event
                self.counts["logged"] += 1
            # several records of the pool per log record: the fold's per-record cost of Faust is paid per batch
            for group in batches(entries):
                self._inflight.append(await self.send(TOPIC_LOG, key, pack_batch(group), [(HEADER_BATCH, BATCH_FORMAT)]))
                self.counts["log_records"] += 1
        ckpt = self._ckpt
        if ckpt is not None and ckpt.done():
            self._ckpt = None
            ckpt.result()
        if self._ckpt is None and self._done and (
                (now - self._last_checkpoint) * 1000 >= self.settings.checkpoint_interval_ms
                or len(self._done) >= CHECKPOINT_RECORDS_MAX):
            inflight, self._inflight = self._inflight, []
            touched, self._touched = self._touched, {}
            values = {pool: orjson.dumps(self.states[pool].to_dict()) for pool in touched}
            done, self._done = self._done, []
            self._captured = (inflight, touched, done)
            self._ckpt = asyncio.ensure_future(self._checkpoint(inflight, touched, values, done))
            self._last_checkpoint = now
        return n

    async def _checkpoint(self, inflight, touched, values, done) -> None:
        if inflight:
            await asyncio.shield(asyncio.gather(*inflight))  # a rebalance's cancel must not cancel deliveries
        if self.halted():  # a rebalance began meanwhile: write and ack nothing (see abandon_checkpoint)
            return carry_back(self)
        written = [await stored(self.store(pool, values[pool], event)) for pool, event in touched.items()]
        await durable(written)
        if self.halted():  # a rebalance began while the table writes went out: ack nothing
            return carry_back(self)
        acks = [ev for tp, offset in done for ev in self.gate.done(tp, offset)]
        if acks:
            await self.commit(acks)
        self.counts["checkpoints"] += 1

    async def settle(self) -> None:
        ckpt, self._ckpt = self._ckpt, None
        if ckpt is not None:
            await ckpt

    async def abandon(self) -> None:
        """Stop the checkpoint in progress before it writes the table or acks (see `abandon_checkpoint`)."""
        self._ckpt = await abandon_checkpoint(self._ckpt)
        carry_back(self)

    def live_pools(self) -> dict:
        return self.states

    def acks_pending(self) -> list:
        return self._done

    def forget_partitions(self, partitions: set[int]) -> None:
        self.intake.forget(partitions)
        for part in partitions:
            self.seq.drop_partition(part)
            self.gate.drop_partition(part)
        for pool in [p for p in self.states if key_partition(p.encode(), self.settings.partitions) in partitions]:
            del self.states[pool]
            self._touched.pop(pool, None)
        self._done = [(tp, o) for tp, o in self._done if tp.partition not in partitions]
        self._pending_dead = [d for d in self._pending_dead if d[1].partition not in partitions]
        for tp in [tp for tp in self.received_next if tp.partition in partitions]:
            del self.received_next[tp]


DURABLE_TIMEOUT_S = 120.0  # longer than a producer retries through a broker restart (delivery timeout)


async def stored(written):
    """What a stage's `store` returned: the changelog deliveries of a table write (`make_app`'s store is a
    coroutine: a long value waits for its parts before it writes their head)."""
    return await written if inspect.isawaitable(written) else written


async def durable(written: list) -> None:
    """Wait until the table writes of a checkpoint are in Kafka (`store` returns the changelog deliveries, or
    None when the table is not Kafka's), before the checkpoint acks its inputs.

    Acks must never run ahead of the table: Faust commits the acked offsets after `producer.flush()`, which waits
    at most 0.1 s for its send buffer (faust-streaming 0.15 `ProducerBuffer.flush_atmost`) and so may commit
    offsets whose table values are still in that buffer. A worker killed then (kill -9) loses those values while
    the offsets stay committed: the next owner takes over from an older state, its sequencer waits for a record
    it never reads again (released "forced" after `sequencer_wait_ms`) and its fold skips records for good."""
    pending = [f for w in written if w for f in w]
    if pending:
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.gather(*pending)), DURABLE_TIMEOUT_S)
        except asyncio.TimeoutError:
            # never ack what may not be in Kafka, and never wait silently: the drain stops the worker on this
            # (its supervisor restarts it; the records are read again from the committed offsets)
            raise RuntimeError(f"the table's changelog writes were not acknowledged by Kafka within "
                               f"{DURABLE_TIMEOUT_S:.0f} s") from None


def carry_back(stage) -> None:
    """What a checkpoint stopped by a rebalance (cancelled by `abandon`, or returning on `halted`) took goes back to
    the next checkpoint: the deliveries it had not seen acknowledged, the pools whose states it did not write, the
    records it did not commit. A partition that is not revoked keeps its pools' live states, holding records no
    table write holds yet (a record Faust delivers again is dropped: the stage has it). So the next checkpoint
    writes those pools' states and waits for those outputs before it commits anything; else offsets were committed
    over an older table state, and a kill -9 made the next owner skip records for good. Pools of revoked
    partitions are dropped after this (`forget_partitions`; aiokafka's eager rebalances revoke them all), and a
    pool no longer live is not carried."""
    inflight, touched, acks = stage._captured
    stage._captured = ([], {}, [])
    stage._inflight[:0] = inflight
    live = stage.live_pools()
    for pool, last in touched.items():
        if pool in live:
            stage._touched.setdefault(pool, last)
    stage.acks_pending()[:0] = acks


async def abandon_checkpoint(ckpt: Optional[asyncio.Future]) -> None:
    """Cancel a checkpoint when partitions are revoked, instead of finishing it. A checkpoint finished then would
    write table values and ack records after Faust flushed its producer for the rebalance: the new owner could
    restore the table before those changelog writes arrive, while the acks were committed, and take over from a
    state older than the committed offsets (a record never folded, a predecessor the sequencer never sees).
    Cancelled at one of its waits, it wrote nothing: the new owner reads its records again (outputs sent again
    are dropped by the sink, records logged again are skipped by the fold)."""
    if ckpt is not None and not ckpt.done():
        ckpt.cancel()
        try:
            await ckpt
        except asyncio.CancelledError:
            pass
    elif ckpt is not None and not ckpt.cancelled() and ckpt.exception() is not None:
        log.warning("worker: the last checkpoint failed: %r", ckpt.exception())
    return None


def _origin(headers) -> Optional[tuple[str, int, int, int]]:
    """(input topic, partition, offset, record timestamp ms) from a log record's headers."""
    origin = ts = None
    for name, value in headers or ():
        if name == HEADER_ORIGIN:
            origin = value
        elif name == HEADER_TIMESTAMP:
            ts = value
    try:
        topic, part, off = origin.decode().rsplit(":", 2)
        return topic, int(part), int(off), int(ts or 0)
    except (AttributeError, ValueError, UnicodeDecodeError):
        return None


class PoolWorker(Continuity):
    """The fold outside Faust: the records read from `chipledger.log`, the live `PoolState`s and the drain.

    `load(pool, pending)` / `store(pool, json_bytes, pending)` read and write the table; `send(topic, key, value)`
    sends an output and returns an awaitable of its delivery. They are Faust's in the app, plain functions in
    unit tests. `fold_one` is the fold of one record: everything a record does goes through it."""

    def __init__(self, settings: WorkerSettings, *, load, store, send: SendFn,
                 clock: Callable[[], float] = time.monotonic, caught_up=None, commit=ack_events, fetch=None,
                 start_offsets=None, end_of=None, first_of=None):
        self.settings = settings
        self.commit = commit  # async (events) -> None: commit the offsets of these log records
        self.queue: list[Pending] = []  # read from the log, not folded yet (log order per partition)
        self.load, self.store, self.send, self.clock = load, store, send, clock
        self.pools: dict[str, PoolState] = {}  # live states of the pools seen since start
        self.last_applied: dict[str, float] = {}  # pool -> monotonic time of its last handled record
        self._touched: dict[str, Pending] = {}  # pools changed since the last checkpoint -> their last record
        self._unacked: list[Pending] = []  # folded since the last checkpoint
        self._inflight: list = []  # deliveries of the outputs sent since the last checkpoint
        self._last_checkpoint = 0.0
        self.received_next: dict[TP, int] = {}
        self.counts = {"received": 0, "not_sequenced": 0, "applied": 0, "duplicates": 0, "dead_letters": 0, "skipped": 0,
                       "ticks": 0, "batches": 0, "checkpoints": 0, "full_collections": 0, "delivered_again": 0}
        self._lock = asyncio.Lock()
        self._ckpt: Optional[asyncio.Future] = None  # the checkpoint in progress
        self._captured: tuple[list, dict, list] = ([], {}, [])  # what the last checkpoint started took (carry_back)
        self.halted: Callable[[], bool] = lambda: False  # the app: Faust is rebalancing
        self._last_full_gc = float("-inf")
        # a streams.metrics.MetricsCollector (--metrics-port): it reads the states at a scrape; the worker hands it
        # each drain's fold time and the dead letters no pool state counts
        self.metrics = None
        self._init_continuity(fetch, start_offsets, end_of, first_of)

    # --- in ---------------------------------------------------------------------------------------------
    def receive(self, event) -> None:
        """A record of `chipledger.log`: the input record's bytes, key and origin (headers)."""
        m = event.message
        ltp = TP(m.topic, m.partition)
        if m.offset < self.intake.next.get(ltp, -1):  # delivered again (see SequencerStage.receive): it has it
            self.counts["delivered_again"] += 1
            return
        for ev in self._arrive(ltp, m.offset, event):  # in offset order, a hole's records read directly first
            self._handle(ev)

    def _handle(self, event) -> None:
        m = event.message
        ltp = TP(m.topic, m.partition)
        _in_order(self.received_next, ltp, m.offset)
        self.received_next[ltp] = m.offset + 1
        key = _key_bytes(m.key) or b""
        value = m.value if isinstance(m.value, bytes) else (m.value or b"")
        fmt = batch_format(m.headers)
        if fmt is not None:
            try:
                entries = unpack_batch(value, fmt)
            except ValueError:
                entries = None
            if entries:
                now = self.clock()
                for i, e in enumerate(entries):
                    self.queue.append(Pending(event, e.topic, e.partition, e.offset, key, e.value, e.timestamp_ms,
                                              now, i == len(entries) - 1, e.origin or None,
                                              e.appended_ms // 1000 if e.appended_ms >= 0 else None))
                self.counts["received"] += len(entries)
                return
        origin = _origin(m.headers)
        if origin is None:  # not written by the sequencer: folded under the log position itself
            self.counts["not_sequenced"] += 1
            origin = (m.topic, m.partition, m.offset, int(round((m.timestamp or 0) * 1000)))
        topic, part, off, ts_ms = origin
        self.queue.append(Pending(event, topic, part, off, key, value, ts_ms, self.clock()))
        self.counts["received"] += 1

    # --- drain ------------------------------------------------------------------------------------------
    async def drain(self) -> int:
        """Fold what the merge releases and send its outputs (not waiting for them); start a checkpoint when one
        is due and none is in progress (`settle` waits for it). Returns the number of records folded."""
        async with self._lock:
            await self._fill_holes()
            now = self.clock()
            todo, self.queue = self.queue, []
            n = 0
            # in slices of DRAIN_SLICE_NS of folding: each slice's outputs are sent, and the loop runs (the
            # producer sends them, Faust delivers) before the next slice; a backlog folded in one piece held its
            # first record's outputs (and the sequencer's log records) until the last record was folded
            at = 0
            while at < len(todo):
                out: dict[tuple[str, str], list] = {}  # (output topic, pool) -> items, in fold order
                t0 = time.perf_counter_ns()
                stop = t0 + DRAIN_SLICE_NS
                k = at
                while k < len(todo):
                    p = todo[k]
                    k += 1
                    pool = p.key.decode("utf-8", "replace")
                    for topic, item in self.fold_one(pool, p):
                        out.setdefault((topic, pool), []).append(item)
                    self._unacked.append(p)
                    if time.perf_counter_ns() >= stop:
                        break
                if self.metrics is not None:  # the fold time histogram: one slice, two clock reads
                    self.metrics.fold_batch(k - at, time.perf_counter_ns() - t0)
                n += k - at
                at = k
                for (topic, pool), items in out.items():
                    for value in pack_records(pool, items):
                        self._inflight.append(await self.send(topic, pool.encode(), value))
                if at < len(todo):
                    await asyncio.sleep(0)
            if n:
                self.counts["batches"] += 1
            ckpt = self._ckpt
            if ckpt is not None and ckpt.done():
                self._ckpt = None
                ckpt.result()  # a checkpoint that failed stops the worker (its records are folded again)
            if self._ckpt is None and self._unacked and (
                    (now - self._last_checkpoint) * 1000 >= self.settings.checkpoint_interval_ms
                    or len(self._unacked) >= CHECKPOINT_RECORDS_MAX):
                captured = self._capture()
                self._captured = (captured[0], captured[1], captured[3])
                self._ckpt = asyncio.ensure_future(self._checkpoint(*captured))
                self._last_checkpoint = now
                if self.settings.freeze_gc:
                    self._gc(now)
            return n

    def collect_at_start(self) -> None:
        """The first full collection, at the worker's start (after its tables are recovered, before its first
        record): left to the first checkpoint, it paused the loop for 60-150 ms among the first records folded."""
        if self.settings.freeze_gc:
            self._gc(self.clock())

    def _gc(self, now: float) -> None:
        """Keep Python's full collections out of the drain's way: the states, Faust and the buffers are many
        long-lived objects, and a full collection scans them all (60-200 ms pauses, every few seconds at 2,000
        events/s). So what lives at a checkpoint is frozen (left out of collections; what dies is still freed by
        its reference count), and only every `full_gc_interval_s` is everything unfrozen and collected (one
        pause), which also frees cyclic garbage that was frozen meanwhile."""
        if now - self._last_full_gc >= self.settings.full_gc_interval_s:
            gc.unfreeze()
            gc.collect()
            self._last_full_gc = now
            self.counts["full_collections"] += 1
        gc.freeze()

    async def settle(self) -> None:
        """Wait for the checkpoint in progress, if any (and raise what it raised)."""
        ckpt, self._ckpt = self._ckpt, None
        if ckpt is not None:
            await ckpt

    async def abandon(self) -> None:
        """Stop the checkpoint in progress before it writes the table or acks (see `abandon_checkpoint`)."""
        self._ckpt = await abandon_checkpoint(self._ckpt)
        carry_back(self)

    def _capture(self) -> tuple[list, dict, dict, list]:
        """What a checkpoint makes durable, taken at once between two folds: the deliveries of the outputs sent so
        far, the states of the pools they changed (as table values), and the input records folded."""
        inflight, self._inflight = self._inflight, []
        touched, self._touched = self._touched, {}
        values = {pool: state_values(self.pools[pool]) for pool in touched}
        unacked, self._unacked = self._unacked, []
        return inflight, touched, values, unacked

    async def _checkpoint(self, inflight: list, touched: dict, values: dict, unacked: list) -> None:
        """Wait until Kafka acknowledged the outputs (acks=all); then send the states that include them as
        snapshots for the store and write them to the table; then acknowledge the input records.

        It runs beside the drain, which keeps folding and sending (one checkpoint at a time, in order): what it
        makes durable was captured at once by `_capture`, so records folded meanwhile wait for the next one."""
        if inflight:
            await asyncio.shield(asyncio.gather(*inflight))  # a rebalance's cancel must not cancel deliveries
        # the snapshot for the store first: a crash between it and the table write folds the records again and
        # sends the same state again, while the other order could leave the store behind the table for good
        snapshots = [await self.send(TOPIC_JOURNAL, pool.encode(), state_record(pool, snapshot))
                     for pool, (_, snapshot) in values.items()]
        if snapshots:
            await asyncio.gather(*snapshots)
        if self.halted():  # a rebalance began meanwhile: write and ack nothing (see abandon_checkpoint)
            return carry_back(self)
        # a new value: the table's value is never mutated in place
        written = [await stored(self.store(pool, values[pool][0], last)) for pool, last in touched.items()]
        await durable(written)
        if self.halted():  # a rebalance began while the table writes went out: ack nothing
            return carry_back(self)
        acks = [p.event for p in unacked if p.last_of_record]
        if acks:
            await self.commit(acks)
        self.counts["checkpoints"] += 1

    def fold_one(self, key_pool: str, p: Pending) -> list[tuple[str, dict]]:
        """Fold one log record; returns its outputs as (output topic, item), item = {"origin", "tables"}."""
        touched = self._touched
        origin = [p.topic, p.partition, p.offset]
        limit = self.settings.max_event_bytes
        if len(p.value) > limit:
            # the dead letter of `chipledger run`: the first max_event_bytes bytes, the whole message's size and sha256
            rej = size_rejection(len(p.value), limit, hashlib.sha256(p.value).hexdigest())
            head = Pending(p.event, p.topic, p.partition, p.offset, p.key, p.value[:limit], p.timestamp_ms, p.arrived)
            return [self._dead(head, rej, None, self.pools.get(key_pool), origin)]
        event = parse_event(p.value, limit)
        if isinstance(event, Rejection):
            return [self._dead(p, event, None, None, origin)]
        if event.pool != key_pool:
            rej = Rejection(RejectionCode.schema_invalid,
                            f"message key {key_pool!r} is not the event's pool {event.pool!r} (producers key by pool)")
            return [self._dead(p, rej, event, None, origin)]
        state = self.pools.get(key_pool)
        if state is None:
            d = self.load(key_pool, p)
            if d is not None:
                state = self.pools[key_pool] = PoolState.from_dict(d)
        tpk = f"{p.topic}:{p.partition}"
        if state is not None and state.positions.get(tpk, -1) >= p.offset:
            self.counts["skipped"] += 1  # folded before: its effects are in the live state and were sent
            # ... but maybe not yet in the table: a checkpoint stopped by a rebalance wrote nothing, and the live
            # state of a pool whose partition stayed here is kept. The checkpoint that acks the record writes the
            # state first (else the offset is committed while the table holds an older state: a kill -9 then
            # makes the next owner skip the record for good, an event lost)
            touched[key_pool] = p
            return []
        new, step = evolve(state, event, self.settings.fold_config, p.value, origin=p.origin_cluster,
                           appended_s=p.appended_s)
        self.last_applied[key_pool] = self.clock()
        if new is not None:
            new.positions[tpk] = p.offset
            self.pools[key_pool] = new
            touched[key_pool] = p
        if step.rejection is not None:
            return [self._dead(p, step.rejection, event, new, origin)]
        if step.duplicate:
            self.counts["duplicates"] += 1
            return []
        self.counts["applied"] += 1
        tables: dict[str, list] = {}
        for table, row in step_rows(event, step, p.topic, p.partition, p.offset, p.origin_cluster):
            tables.setdefault(table, []).append(list(row))
        decisions = tables.pop("decisions", None)
        out = [(TOPIC_JOURNAL, {"origin": origin, "tables": tables})]
        if decisions:
            out.append((TOPIC_DECISIONS, {"origin": origin, "tables": {"decisions": decisions}}))
        return out

    def _dead(self, p: Pending, rejection: Rejection, event, state: Optional[PoolState], origin):
        # seen_at: the pool clock when the pool is known, else the record's timestamp (there is no pool time)
        seen_at = state.clock if state is not None else p.timestamp_ms // 1000
        row = deadletter_row(p.value, rejection, p.topic, p.partition, p.offset, seen_at, event)
        self.counts["dead_letters"] += 1
        if state is None and self.metrics is not None:  # the fold counts what it rejects in the pool's state
            self.metrics.dead_letter(rejection.code.value)
        return (TOPIC_DEADLETTER, {"origin": origin, "tables": {"deadletters": [list(row)]}})

    # --- ticks ------------------------------------------------------------------------------------------
    def due_ticks(self, now: float) -> list[dict]:
        """Ticks for the pools quiet for at least tick_interval_s, that would close at least one hour."""
        out = []
        for pool, state in sorted(self.pools.items()):
            elapsed = now - self.last_applied.get(pool, now)
            if elapsed >= self.settings.tick_interval_s:
                tick = tick_event(pool, state.clock, elapsed)
                if tick is not None:
                    out.append(tick)
        return out

    def live_pools(self) -> dict:
        return self.pools

    def acks_pending(self) -> list:
        return self._unacked

    def forget_partitions(self, partitions: set[int]) -> None:
        """Partitions revoked: drop their queued records and live states (the new owner reads the table)."""
        gone = [p for p in self.pools if key_partition(p.encode(), self.settings.partitions) in partitions]
        self.queue = [p for p in self.queue if p.event.message.partition not in partitions]
        for pool in gone:
            del self.pools[pool]
            self._touched.pop(pool, None)
        # folded but not checkpointed: the new owner folds them again (the sink drops the re-sent outputs)
        self._unacked = [p for p in self._unacked if p.event.message.partition not in partitions]
        for tp in [tp for tp in self.received_next if tp[1] in partitions]:
            del self.received_next[tp]
        self.intake.forget(partitions)


# -------------------------------------------------------------------------------------------------------------
# the Faust app
# -------------------------------------------------------------------------------------------------------------

CONSUMER_MAX_FETCH_BYTES = 8 << 20  # per partition and fetch (Faust's default, 1 MiB, makes more round trips)
MAX_REQUEST_BYTES = 8 << 20  # a log record (an input up to the broker's limit + headers) or a dead letter of one


METADATA_MAX_AGE_MS = 10_000  # the Faust consumer's metadata refresh at the latest (see faust_settings)
START_TIMEOUT_S = 1.0  # the longest the direct reader waits for one partition's start (its first + committed offset)
READ_TIMEOUT_S = 5.0  # the longest a direct read waits, and after which a drain starts no other read (rebalance timeout: 12 s)


class DirectReader:
    """Reads records of the worker's input and log topics from Kafka itself, outside Faust's consumer: the records
    Faust skipped (`streams.sequencer.Intake`), and where the group's consumer started on a partition (its committed
    offset, or the partition's first offset when none is committed). Two aiokafka consumers with the worker's
    connection: one without a group, assigned by hand, reads records and first offsets; one with the worker's group
    id, never assigned, never joining the group and never committing, only asks for committed offsets.

    A consumer that failed is dropped and made anew at the next call: aiokafka 0.14's group coordination routine
    dies on an assertion when the assignment changes while it waits for a coordinator (the broker restarting), and
    every call of that consumer then fails with "Unexpected error during coordination" (the failover test: a worker
    read nothing for minutes after a broker restart, and the round stalled). So the reads use a consumer with no
    group, and any consumer that fails or times out is replaced."""

    def __init__(self, settings: WorkerSettings):
        self.settings = settings
        self._consumers: dict[bool, Any] = {}  # grouped? -> consumer
        self._lock = asyncio.Lock()
        self._timeouts = 0  # calls timed out in a row
        self._closed = False

    async def _client(self, grouped: bool = False):
        if self._closed:
            raise KafkaError("the worker is stopping: no more direct reads")
        c = self._consumers.get(grouped)
        if c is None:
            from aiokafka import AIOKafkaConsumer

            c = AIOKafkaConsumer(group_id=self.settings.app_id if grouped else None, enable_auto_commit=False,
                                 auto_offset_reset="earliest", max_partition_fetch_bytes=CONSUMER_MAX_FETCH_BYTES,
                                 fetch_max_bytes=CONSUMER_MAX_FETCH_BYTES, **self.settings.connection().aiokafka())
            try:
                await c.start()
            except BaseException:
                await _stop_quietly(c)
                raise
            self._consumers[grouped] = c
        return c

    async def _failed(self, exc: BaseException) -> None:
        """After a failed call: a consumer that failed (a KafkaError), or timed out three times in a row, is made
        anew at the next call (a plain timeout alone, Kafka being slow, keeps the connections)."""
        if isinstance(exc, asyncio.TimeoutError):
            self._timeouts += 1
            if self._timeouts < 3:
                return
        self._timeouts = 0
        consumers, self._consumers = list(self._consumers.values()), {}
        for c in consumers:
            await _stop_quietly(c)
        log.info("worker: the direct reader's consumers are made anew after %r", exc)

    async def start_offsets(self, tps) -> dict:
        """{tp: offset} for the partitions Kafka answered for within READ_TIMEOUT_S, one at a time (a partition
        without a leader keeps no other from starting); the stage asks again for the rest at its next drain (a drain
        must not hold its stage's lock long, a rebalance waits for it)."""
        out: dict = {}
        async with self._lock:
            deadline = time.monotonic() + READ_TIMEOUT_S
            for tp in tps:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    out[tp] = await asyncio.wait_for(self._start_offset(tp), min(left, START_TIMEOUT_S))
                    self._timeouts = 0
                except (asyncio.TimeoutError, KafkaError) as exc:
                    log.warning("worker: where the consumer started on %s[%d] is not known yet: %r", tp.topic,
                                tp.partition, exc)
                    await self._failed(exc)
        return out

    async def _start_offset(self, tp: TP) -> Optional[int]:
        from aiokafka import TopicPartition

        reader, group = await self._client(), await self._client(grouped=True)
        ktp = TopicPartition(tp.topic, tp.partition)
        start = (await reader.beginning_offsets([ktp])).get(ktp)
        committed = await group.committed(ktp)
        if committed is not None and (start is None or committed > start):
            start = committed  # a committed offset below the first one: those records are gone (retention)
        return start

    async def first_offset(self, tp: TP) -> Optional[int]:
        """The partition's first offset in Kafka (what retention or deleted records left); None when Kafka does not
        answer within READ_TIMEOUT_S."""
        from aiokafka import TopicPartition

        ktp = TopicPartition(tp.topic, tp.partition)
        async with self._lock:
            try:
                async def first():
                    return (await (await self._client()).beginning_offsets([ktp])).get(ktp)
                got = await asyncio.wait_for(first(), READ_TIMEOUT_S)
                self._timeouts = 0
                return got
            except (asyncio.TimeoutError, KafkaError) as exc:
                log.warning("worker: the first offset of %s[%d] is not known yet: %r", tp.topic, tp.partition, exc)
                await self._failed(exc)
                return None

    async def read(self, tp: TP, lo: int, hi: int) -> list:
        """The records of `tp` at offsets lo..hi-1 (those the partition still holds), as `Fetched` events; what came
        within READ_TIMEOUT_S (the stage reads the rest at its next drain)."""
        out: list = []
        async with self._lock:
            try:
                await asyncio.wait_for(self._read(tp, lo, hi, out), READ_TIMEOUT_S)
                self._timeouts = 0
            except (asyncio.TimeoutError, KafkaError) as exc:
                log.warning("worker: reading %s[%d] %d..%d directly: %r (read %d)", tp.topic, tp.partition, lo,
                            hi - 1, exc, len(out))
                await self._failed(exc)
        return out

    async def _read(self, tp: TP, lo: int, hi: int, out: list) -> None:
        from aiokafka import TopicPartition

        c = await self._client()
        ktp = TopicPartition(tp.topic, tp.partition)
        c.assign([ktp])
        c.seek(ktp, lo)
        try:
            while True:
                got = await c.getmany(ktp, timeout_ms=500)
                for r in got.get(ktp, ()):
                    if lo <= r.offset < hi:
                        out.append(Fetched(r.topic, r.partition, r.offset, r.key, r.value, r.timestamp / 1000,
                                           r.headers, r.timestamp_type))
                if (out and out[-1].message.offset >= hi - 1) or await c.position(ktp) >= hi:
                    return
        finally:
            c.pause(ktp)  # no prefetching between reads (up to 8 MiB per partition)

    async def close(self) -> None:
        """At the worker's stop: no read after it (a drain still running gets nothing), each consumer stopped."""
        async with self._lock:
            self._closed = True
            consumers, self._consumers = list(self._consumers.values()), {}
            for c in consumers:
                await _stop_quietly(c)


async def _quietly(call, what: str) -> bool:
    """Await `call` (at most READ_TIMEOUT_S) on a consumer that failed; True when it completed. Its errors are logged,
    not raised: aiokafka 0.14 can raise the CancelledError of its own fetch task here, which is not the caller's
    (a cancellation of the caller itself goes on)."""
    try:
        await asyncio.wait_for(call, READ_TIMEOUT_S)
        return True
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the caller is being cancelled
        log.info("worker: %s: %r", what, exc)
    except Exception as exc:  # noqa: BLE001 - a consumer that failed: what matters is that it is gone
        log.info("worker: %s: %r", what, exc)
    return False


async def _stop_quietly(c) -> None:
    """Stop a consumer that failed. aiokafka 0.14's `stop()` can give up (`Fetcher.close` cancels and awaits a fetch
    in flight) before it closes the client: the client is then closed here, or its connections and metadata task
    would outlive the consumer."""
    if not await _quietly(c.stop(), "stopping a failed consumer"):
        client = getattr(c, "_client", None)
        if client is not None:
            await _quietly(client.close(), "closing a failed consumer's client")


def faust_settings(settings: WorkerSettings) -> dict:
    """The `faust.App` settings of the worker (bench/stream.py measures a no-op app with the same ones)."""
    conn = settings.connection()
    return dict(
        broker=conn.faust_broker(),
        broker_credentials=conn.faust_credentials(),
        store=settings.store_url(),
        datadir=str(settings.data_dir),
        topic_partitions=settings.partitions,
        topic_replication_factor=1,
        topic_allow_declare=True,
        producer_acks=-1,
        producer_linger_ms=1,
        producer_max_request_size=MAX_REQUEST_BYTES,
        broker_session_timeout=settings.session_timeout_s,
        broker_heartbeat_interval=settings.heartbeat_interval_s,
        broker_rebalance_timeout=max(10.0, 2 * settings.session_timeout_s),
        broker_commit_every=10_000,
        broker_commit_interval=0.5,
        consumer_max_fetch_size=CONSUMER_MAX_FETCH_BYTES,
        stream_buffer_maxsize=65_536,
        stream_wait_empty=False,  # records wait unacked in the merge buffers: a rebalance must not wait for them
        consumer_auto_offset_reset="earliest",
        # a group leader that assigned partitions while a restarted broker did not list the topics yet ("Ignoring
        # missing topic", every member assigned nothing) rejoins when its metadata shows them: at the next refresh,
        # which nothing else asks for then (the failover test idled 300 s after a broker restart; default 5 min)
        consumer_metadata_max_age_ms=METADATA_MAX_AGE_MS,
        web_enabled=False,
        table_standby_replicas=0,
        key_serializer="raw",
        value_serializer="raw",
    )


def set_fetch_max_wait(app, ms: int) -> Optional[bool]:
    """Make the input consumer's fetches wait at most `ms` at the broker. Faust creates aiokafka's consumer with
    fetch_max_wait_ms=1500 and no setting for it; aiokafka has one fetch in flight per broker, so a fetch held for
    partitions with nothing new delays what arrives meanwhile on the others by up to that much. Returns True when
    it changed the value, False when it was set already, None while the consumer is not started (or Faust's
    internals differ from faust-streaming 0.15's)."""
    fetcher = getattr(getattr(getattr(app.consumer, "_thread", None), "_consumer", None), "_fetcher", None)
    if fetcher is None or not hasattr(fetcher, "_fetch_max_wait_ms"):
        return None
    if fetcher._fetch_max_wait_ms == ms:
        return False
    fetcher._fetch_max_wait_ms = ms
    return True


def make_app(settings: WorkerSettings):
    """The Faust app with its agents (three input buffers for the sequencer, one log reader for the fold), two
    tables, the drain loop and the tick timer. Returns (app, PoolWorker); the sequencer is `app.sequencer`."""
    import faust
    from faust.streams import _current_event

    settings.data_dir = Path(settings.data_dir)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    app = faust.App(settings.app_id, **faust_settings(settings))
    # bytes in, bytes out (faust picks the raw codec for bytes types): the value is PoolState.to_dict() as JSON
    table = app.Table(TABLE_NAME, partitions=settings.partitions, key_type=bytes, value_type=bytes)
    seq_table = app.Table(SEQ_TABLE_NAME, partitions=settings.partitions, key_type=bytes, value_type=bytes)
    raw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    # acks off: the stages commit their offsets themselves (`commit` below), never Faust: its stream acks records it
    # skips around a rebalance without handing them over (see streams.sequencer.Intake)
    topics = {name: app.topic(name, acks=False, **raw) for name in INPUT_TOPICS}
    log_topic = app.topic(TOPIC_LOG, acks=False, **raw)
    consumer_positions: dict[TP, int] = {}

    def in_context(event):
        # the rocksdb store picks the partition database from the current event: make it the pool's own record
        return _current_event.set(weakref.ref(event))

    class InContext:
        """The table `t` as the pool's record `event` sees it: each read and write in that record's context (the
        rocksdb store and the changelog partition follow the current event)."""

        def __init__(self, t, event):
            self.t, self.event = t, event

        def _in(self, fn, *args):
            token = in_context(self.event)
            try:
                return fn(*args)
            finally:
                _current_event.reset(token)

        def get(self, key):
            return self._in(self.t.get, key)

        def __setitem__(self, key, value):
            self._in(self.t.__setitem__, key, value)

        def __delitem__(self, key):
            self._in(self.t.__delitem__, key)

    def table_get(t, name, pool: str, event):
        try:
            value, _ = read_parted(InContext(t, event), pool)
        except TypeError as exc:
            raise TypeError(f"table {name}, pool {pool!r}: {exc}") from None
        return None if value is None else orjson.loads(value)

    def sent_of(t) -> list:
        sent, changelog_sent[id(t)] = changelog_sent[id(t)], []
        return sent

    async def table_set(t, pool: str, value: bytes, event) -> list:
        """Write the pool's value (in parts when long: `write_parted`, which waits for the parts before the head);
        returns the changelog deliveries of the last writes (see `durable`)."""
        async def settle() -> bool:
            await durable([sent_of(t)])
            return not getattr(app, "rebalancing", False)

        await write_parted(InContext(t, event), pool, value, settle)
        return sent_of(t)

    changelog_sent: dict = {}

    def capture_changelog(t) -> None:
        """Keep the delivery of each changelog write of `t` (Faust's `Table.__setitem__` drops it)."""
        changelog_sent[id(t)] = []
        send_changelog = t.send_changelog

        def send_and_keep(*args, **kwargs):
            fut = send_changelog(*args, **kwargs)
            changelog_sent[id(t)].append(fut)
            return fut
        t.send_changelog = send_and_keep

    capture_changelog(table)
    capture_changelog(seq_table)

    async def send(topic: str, key: bytes, value: bytes, headers=None):
        return await app.producer.send(topic, key, value, None, None, headers)

    def caught_up(tp: TP) -> bool:
        try:
            hw = app.consumer.highwater(tp)
        except Exception:  # noqa: BLE001 - not assigned (yet) or no fetch answered: not caught up
            return False
        if hw is None:
            return False
        if sequencer.intake.holds(tp):  # records of it wait for a hole before them to be read
            return False
        pos = sequencer.received_next.get(tp, consumer_positions.get(tp))
        return pos is not None and pos >= hw

    async def commit(events: list) -> None:
        """Commit the offsets after these records (each stage hands them over in offset order per partition, with
        no offset left out: `Intake`, `AckGate`), through Faust's consumer (its group generation)."""
        from faust.types import TP as FaustTP

        offsets: dict = {}
        for ev in events:
            m = ev.message
            tp = FaustTP(m.topic, m.partition)
            offsets[tp] = max(offsets.get(tp, 0), m.offset + 1)
        await app.consumer._commit_offsets(offsets)

    def end_of(tp: TP) -> Optional[int]:
        try:
            return app.consumer.highwater(tp)
        except Exception:  # noqa: BLE001 - not assigned (any more)
            return None

    reader = DirectReader(settings)
    direct = dict(commit=commit, fetch=reader.read, start_offsets=reader.start_offsets, end_of=end_of,
                  first_of=reader.first_offset)
    sequencer = SequencerStage(settings, load=lambda pool, ev: table_get(seq_table, SEQ_TABLE_NAME, pool, ev),
                               store=lambda pool, v, ev: table_set(seq_table, pool, v, ev), send=send,
                               caught_up=caught_up, **direct)
    worker = PoolWorker(settings, load=lambda pool, p: table_get(table, TABLE_NAME, pool, p.event),
                        store=lambda pool, v, p: table_set(table, pool, v, p.event), send=send, **direct)

    @app.on_before_shutdown.connect
    async def close_reader(app_, **kwargs):
        await reader.close()
    app.chipledger = worker  # for tests and the CLI
    app.sequencer = sequencer
    worker.halted = sequencer.halted = lambda: bool(getattr(app, "rebalancing", False))

    def make_agent(topic, name, handler):
        async def agent(stream):
            async for event in stream.noack().events():
                handler(event)
        agent.__name__ = agent.__qualname__ = name
        return app.agent(topic, name=name)(agent)

    for t in topics.values():
        make_agent(t, f"sequence_{t.get_topic_name().split('.')[-1]}", sequencer.receive)
    make_agent(log_topic, "fold_log", worker.receive)

    if settings.metrics_port is not None:
        from streams.metrics import MetricsCollector, bound_port, registry_of, serve

        def lag() -> dict:
            out = {}  # the inputs the sequencer reads and the log the fold reads
            for tp, nxt in [*sequencer.received_next.items(), *worker.received_next.items()]:
                try:
                    hw = app.consumer.highwater(tp)
                except Exception:  # noqa: BLE001 - not assigned (any more): no lag to tell
                    continue
                if hw is not None:
                    out[(tp.topic, tp.partition)] = max(0, hw - nxt)
            return out

        worker.metrics = MetricsCollector(worker.pools, settings.fold_config, lag=lag)

        @app.task
        async def metrics_server():
            runner = await serve(registry_of(worker.metrics), settings.metrics_host, settings.metrics_port)
            worker.metrics_port = bound_port(runner)
            log.warning("worker: /metrics on http://%s:%d/metrics", settings.metrics_host, worker.metrics_port)

    if settings.log_stalls_ms > 0:
        from streams.stalls import StallWatch

        @app.task
        async def watch_stalls():
            StallWatch(settings.log_stalls_ms).start()

    @app.task
    async def drain_loop():
        await app.producer.maybe_start()
        worker.collect_at_start()
        interval = settings.drain_interval_ms / 1000
        started = time.monotonic()
        fetch_wait_said = False
        while not app.should_stop:
            changed = set_fetch_max_wait(app, settings.fetch_max_wait_ms)  # again after a consumer restart
            if changed:
                log.info("worker: input fetches wait at most %d ms at the broker", settings.fetch_max_wait_ms)
            elif changed is None and not fetch_wait_said and time.monotonic() - started > 60:
                fetch_wait_said = True
                log.warning("worker: cannot set the input consumer's fetch wait (Faust's consumer is not started, "
                            "or its internals changed); fetches may wait up to 1.5 s")
            try:
                if sequencer.seq.buffered:
                    # positions of the partitions nothing was received from yet: where the consumer started
                    for tp in sequencer.seq.tps_buffered():
                        if tp not in sequencer.received_next and tp not in consumer_positions:
                            try:
                                pos = await app.consumer.position(tp)
                            except Exception:  # noqa: BLE001 - not assigned yet
                                pos = None
                            if pos is not None:
                                consumer_positions[tp] = pos
                await sequencer.drain()
                await worker.drain()
            except Exception:
                log.exception("worker drain failed; stopping so that the inputs are folded again after a restart")
                raise
            await asyncio.sleep(interval)

    if settings.tick_interval_s > 0:
        ids = {"producer": uuid.uuid4().hex[:16], "seq": 0, "prev": {}}

        @app.timer(interval=settings.tick_interval_s)
        async def ticks():
            from streams.producer import canonical_value, validate

            for tick in worker.due_ticks(worker.clock()):
                ids["seq"] += 1
                event = validate(tick)
                key = tick["pool"].encode()
                headers = [(HEADER_PRODUCER, ids["producer"].encode()), (HEADER_SEQ, str(ids["seq"]).encode()),
                           (HEADER_PREV, str(ids["prev"].get(key, 0)).encode())]
                value = canonical_value(event)
                if settings.principals is not None:  # signed like every input: the worker's own registry entry
                    from streams.principals import HEADER_PRINCIPAL, HEADER_SIG, sign

                    me = settings.connection().username or ""
                    entry = settings.principals.entries.get(me)
                    if entry is not None:
                        headers += [(HEADER_PRINCIPAL, me.encode()), (HEADER_SIG, sign(entry.key, key, value, headers))]
                await app.producer.send_and_wait(TOPIC_QUOTA, key, value, None, None, headers)
                ids["prev"][key] = ids["seq"]
                worker.counts["ticks"] += 1
                worker.last_applied[tick["pool"]] = worker.clock()

    @app.on_partitions_assigned.connect
    async def on_assigned(app_, assigned, **kwargs):
        seq_tps = [TP(tp.topic, tp.partition) for tp in assigned if tp.topic in INPUT_TOPICS]
        log_tps = [TP(tp.topic, tp.partition) for tp in assigned if tp.topic == TOPIC_LOG]
        if seq_tps:
            async with sequencer.lock:
                sequencer.assigned(seq_tps)
        if log_tps:
            async with worker._lock:
                worker.assigned(log_tps)

    @app.on_partitions_revoked.connect
    async def on_revoked(app_, revoked, **kwargs):
        seq_parts = {tp.partition for tp in revoked if tp.topic in INPUT_TOPICS}
        log_parts = {tp.partition for tp in revoked if tp.topic == TOPIC_LOG}
        if seq_parts:
            async with sequencer.lock:
                await sequencer.abandon()  # not finished after Faust's flush: see abandon_checkpoint
                sequencer.forget_partitions(seq_parts)
            for tp in list(consumer_positions):
                if tp.partition in seq_parts:
                    del consumer_positions[tp]
        if log_parts:
            async with worker._lock:
                await worker.abandon()
                worker.forget_partitions(log_parts)

    return app, worker


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def run_worker(settings: WorkerSettings, loglevel: str = "warning") -> None:
    """Run the worker until SIGTERM / SIGINT (blocking). Faust's Worker owns the event loop and the signals."""
    import faust

    settings.freeze_gc = True  # the process is the worker's alone: see PoolWorker._gc
    app, _ = make_app(settings)
    try:
        w = faust.Worker(app, loglevel=loglevel, quiet=True)
        if not _isatty(w.stdout):
            # Faust's startup spinner writes cursor hide/show codes (ESC[?25l, ESC[?25h) and backspaces to stdout
            # whether or not it is a terminal: into a log file they are noise (issue 35 item 12)
            w.spinner = None
        w.execute_from_commandline()
    finally:
        gc.unfreeze()  # let the interpreter's exit clean up what was frozen
