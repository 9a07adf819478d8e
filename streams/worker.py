"""The Faust worker: folds the input topics with the ledger core and sends the outputs. Glue, no business rules.

One agent per input topic (quota, jobs, chips) only buffers records in a `streams.merge.Merger`; a drain loop
releases them per pool in merge order (see streams/merge.py and docs/streaming.md), folds them with
`ledger.evolve`, and for each batch:

sends every output at once (lake rows per input record on chipledger.journal, decisions on
chipledger.decisions, dead letters on chipledger.deadletter; all keyed by pool). Every `checkpoint_interval_ms`
it makes the records folded since the last checkpoint durable, in a task beside the drain (which folds on
meanwhile; one checkpoint at a time), from what it captured at once between two folds:

1. it waits until Kafka acknowledged every output sent (acks=all);
2. only then sends the changed pools' state as snapshots for the store, waits for them, and writes each
   `PoolState` (with the last offset handled per input topic-partition) to the Faust table `pool-state`
   (rocksdb via rocksdict, or memory), whose changelog Faust flushes before it commits input offsets
   (faust.transport.consumer.Consumer._commit_offsets: producer.flush(), then commit);
3. only then acknowledges the input records, so committed offsets never pass a record whose effects are not in
   Kafka.

After a crash, records up to the state's positions are skipped; records after them are folded again and their
outputs sent again with the same content (the sink drops them by origin, see streams/sink.py). A state
snapshot of each changed pool (for the store's balances) follows its rows on chipledger.journal.

A timer sends `pool.tick` for quiet pools (see `tick_event`): it only closes hours that are already past.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import time
import uuid
import weakref
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import orjson

from ledger.books import HOUR_S
from ledger.fold import DEFAULT_CONFIG, FoldConfig, evolve
from ledger.state import PoolState
from schemas import INPUT_TOPICS, Rejection, RejectionCode, parse_event
from schemas.topics import TOPIC_DEADLETTER, TOPIC_DECISIONS, TOPIC_JOURNAL, TOPIC_QUOTA
from streams.clients import KafkaConnection, as_connection
from streams.merge import HEADER_PRODUCER, HEADER_SEQ, TP, Merger, merge_key
from streams.rows import deadletter_row, step_rows

log = logging.getLogger(__name__)

TABLE_NAME = "pool-state"
TICK_SOURCE = "chipledger/worker"

SendFn = Callable[[str, bytes, bytes], Awaitable[Any]]  # (topic, key, value) -> awaitable delivery


@dataclass
class WorkerSettings:
    bootstrap: str = "127.0.0.1:9092"
    # address and credentials of every client of the worker (streams.clients); None: PLAINTEXT to `bootstrap`
    kafka: Optional[KafkaConnection] = None
    app_id: str = "chipledger-worker"
    data_dir: Path = Path(".chipledger-worker")
    table_store: str = "rocksdb"  # rocksdb | memory
    partitions: int = 3
    merge_idle_ms: int = 50       # how long a head waits for a caught-up topic-partition that has nothing
    tick_interval_s: int = 60     # 0: no ticks
    checkpoint_interval_ms: int = 500  # how often folded records are made durable (state written, inputs acked)
    drain_interval_ms: int = 10
    fetch_max_wait_ms: int = 20  # how long the broker may hold a fetch of the input topics (Faust fixes 1,500)
    freeze_gc: bool = False  # run_worker (its own process): gc.freeze() at each checkpoint, see PoolWorker._gc
    full_gc_interval_s: float = 600  # with freeze_gc: how often everything is collected (one longer pause)
    fold_config: FoldConfig = field(default_factory=lambda: DEFAULT_CONFIG)
    metrics_port: Optional[int] = None  # serve Prometheus /metrics (streams/metrics.py) on this port; 0: any free
    metrics_host: str = "127.0.0.1"
    sched_slo_s: int = 600  # [slo] sched_slo_s: the wait SLO counters of /metrics

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
    """A record waiting in the merge buffer: the Faust event (to ack) and what the fold needs of it."""

    event: Any
    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes
    timestamp_ms: int
    arrived: float


OUTPUT_ITEMS_MAX = 500  # input records' outputs per output record
CHECKPOINT_RECORDS_MAX = 50_000  # checkpoint early when this many folded records wait for it


def state_record(pool: str, state_json: bytes) -> bytes:
    """The value of a state snapshot record (for the store's balances), around the table value's JSON."""
    return b'{"kind":"state","pool":' + orjson.dumps(pool) + b',"state":' + state_json + b"}"


def rows_record(pool: str, items: list[dict]) -> bytes:
    """The value of an output record: for each of some input records of `pool`, in fold order, its origin
    (input topic, partition, offset) and the lake rows it produced per table."""
    return orjson.dumps({"kind": "rows", "pool": pool, "items": items})


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


class PoolWorker:
    """The worker's state outside Faust: the merge buffers, the live `PoolState`s and the drain.

    `load(pool, pending)` / `store(pool, json_bytes, pending)` read and write the table; `send(topic, key, value)`
    sends an output and returns an awaitable of its delivery; `caught_up(tp)` says whether everything up to the
    high watermark of `tp` was received. They are Faust's in the app, plain functions in unit tests."""

    def __init__(self, settings: WorkerSettings, *, load, store, send: SendFn, caught_up: Callable[[TP], bool],
                 clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.merger = Merger(INPUT_TOPICS)
        self.load, self.store, self.send, self.caught_up, self.clock = load, store, send, caught_up, clock
        self.pools: dict[str, PoolState] = {}  # live states of the pools seen since start
        self.last_applied: dict[str, float] = {}  # pool -> monotonic time of its last handled record
        self._touched: dict[str, Pending] = {}  # pools changed since the last checkpoint -> their last record
        self._unacked: list[Pending] = []  # folded since the last checkpoint
        self._inflight: list = []  # deliveries of the outputs sent since the last checkpoint
        self._last_checkpoint = 0.0
        self.received_next: dict[TP, int] = {}
        self.counts = {"received": 0, "applied": 0, "duplicates": 0, "dead_letters": 0, "skipped": 0,
                       "ticks": 0, "batches": 0, "checkpoints": 0, "full_collections": 0}
        self._lock = asyncio.Lock()
        self._ckpt: Optional[asyncio.Future] = None  # the checkpoint in progress
        self._last_full_gc = float("-inf")
        self.metrics = None  # a streams.metrics.MetricsCollector fed with every folded record (--metrics-port)

    # --- in ---------------------------------------------------------------------------------------------
    def receive(self, event) -> None:
        m = event.message
        tp = TP(m.topic, m.partition)
        self.received_next[tp] = m.offset + 1
        ts_ms = int(round((m.timestamp or 0) * 1000))
        key = m.key if isinstance(m.key, (bytes, type(None))) else str(m.key).encode()
        value = m.value if isinstance(m.value, bytes) else (m.value or b"")
        pool = (key or b"").decode("utf-8", "replace")
        p = Pending(event, m.topic, m.partition, m.offset, key or b"", value, ts_ms, self.clock())
        self.merger.push(pool, tp, merge_key(ts_ms, m.topic, m.offset, m.headers), p)
        self.counts["received"] += 1

    def ready(self, partition: int, now: float, oldest: float) -> set:
        """The input topic-partitions of `partition` that hold nothing more for now: caught up, and the oldest
        waiting record has waited `merge_idle_ms` (so a record produced just before it had time to arrive)."""
        if (now - oldest) * 1000 < self.settings.merge_idle_ms:
            return set()
        return {tp for tp in self.merger.tps(partition) if self.caught_up(tp)}

    # --- drain ------------------------------------------------------------------------------------------
    async def drain(self) -> int:
        """Fold what the merge releases and send its outputs (not waiting for them); start a checkpoint when one
        is due and none is in progress (`settle` waits for it). Returns the number of records folded."""
        async with self._lock:
            now = self.clock()
            released: list[tuple[str, list[Pending]]] = []
            for pool in self.merger.pools():
                oldest = min(p.arrived for p in self.merger.heads(pool))
                items = self.merger.release(pool, self.ready(self.merger.partition_of(pool), now, oldest))
                if items:
                    released.append((pool, items))
            out: dict[tuple[str, str], list] = {}  # (output topic, pool) -> items, in fold order
            n = 0
            for pool, items in released:
                for p in items:
                    t0 = time.perf_counter_ns()
                    outputs = self._fold(pool, p, self._touched)
                    if self.metrics is not None:
                        self.metrics.folded(pool, outputs, time.perf_counter_ns() - t0)
                    for topic, item in outputs:
                        out.setdefault((topic, pool), []).append(item)
                    self._unacked.append(p)
                    n += 1
            for (topic, pool), items in out.items():
                for i in range(0, len(items), OUTPUT_ITEMS_MAX):
                    self._inflight.append(await self.send(topic, pool.encode(),
                                                          rows_record(pool, items[i:i + OUTPUT_ITEMS_MAX])))
            if n:
                self.counts["batches"] += 1
            ckpt = self._ckpt
            if ckpt is not None and ckpt.done():
                self._ckpt = None
                ckpt.result()  # a checkpoint that failed stops the worker (its records are folded again)
            if self._ckpt is None and self._unacked and (
                    (now - self._last_checkpoint) * 1000 >= self.settings.checkpoint_interval_ms
                    or len(self._unacked) >= CHECKPOINT_RECORDS_MAX):
                self._ckpt = asyncio.ensure_future(self._checkpoint(*self._capture()))
                self._last_checkpoint = now
                if self.settings.freeze_gc:
                    self._gc(now)
            return n

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

    def _capture(self) -> tuple[list, dict, dict, list]:
        """What a checkpoint makes durable, taken at once between two folds: the deliveries of the outputs sent so
        far, the states of the pools they changed (as table values), and the input records folded."""
        inflight, self._inflight = self._inflight, []
        touched, self._touched = self._touched, {}
        values = {pool: orjson.dumps(self.pools[pool].to_dict()) for pool in touched}
        unacked, self._unacked = self._unacked, []
        return inflight, touched, values, unacked

    async def _checkpoint(self, inflight: list, touched: dict, values: dict, unacked: list) -> None:
        """Wait until Kafka acknowledged the outputs (acks=all); then send the states that include them as
        snapshots for the store and write them to the table; then acknowledge the input records.

        It runs beside the drain, which keeps folding and sending (one checkpoint at a time, in order): what it
        makes durable was captured at once by `_capture`, so records folded meanwhile wait for the next one."""
        if inflight:
            await asyncio.gather(*inflight)
        # the snapshot for the store first: a crash between it and the table write folds the records again and
        # sends the same state again, while the other order could leave the store behind the table for good
        snapshots = [await self.send(TOPIC_JOURNAL, pool.encode(), state_record(pool, value))
                     for pool, value in values.items()]
        if snapshots:
            await asyncio.gather(*snapshots)
        for pool, last in touched.items():
            self.store(pool, values[pool], last)  # a new value: the table's value is never mutated in place
        for p in unacked:
            p.event.ack()
        self.counts["checkpoints"] += 1

    def _fold(self, key_pool: str, p: Pending, touched: dict) -> list[tuple[str, dict]]:
        """Fold one record; returns its outputs as (output topic, item), item = {"origin", "tables"}."""
        origin = [p.topic, p.partition, p.offset]
        event = parse_event(p.value)
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
            self.counts["skipped"] += 1  # folded before a restart: its effects are in the state and in Kafka
            return []
        new, step = evolve(state, event, self.settings.fold_config, p.value)
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
        for table, row in step_rows(event, step, p.topic, p.partition, p.offset):
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

    def forget_partitions(self, partitions: set[int]) -> None:
        """Partitions revoked: drop their buffered records and live states (the new owner reads the table)."""
        gone = [p for p in self.pools if self.merger.partition_of(p) in partitions]
        for part in partitions:
            self.merger.drop_partition(part)
        for pool in gone:
            del self.pools[pool]
            self._touched.pop(pool, None)
        # folded but not checkpointed: the new owner folds them again (the sink drops the re-sent outputs)
        self._unacked = [p for p in self._unacked if p.partition not in partitions]
        for tp in [tp for tp in self.received_next if tp[1] in partitions]:
            del self.received_next[tp]


# -------------------------------------------------------------------------------------------------------------
# the Faust app
# -------------------------------------------------------------------------------------------------------------

CONSUMER_MAX_FETCH_BYTES = 8 << 20  # per partition and fetch (Faust's default, 1 MiB, makes more round trips)


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
        broker_commit_every=10_000,
        broker_commit_interval=0.5,
        consumer_max_fetch_size=CONSUMER_MAX_FETCH_BYTES,
        stream_buffer_maxsize=65_536,
        stream_wait_empty=False,  # records wait unacked in the merge buffers: a rebalance must not wait for them
        consumer_auto_offset_reset="earliest",
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
    """The Faust app with its agents, table, drain loop and tick timer. Returns (app, PoolWorker)."""
    import faust
    from faust.streams import _current_event

    settings.data_dir = Path(settings.data_dir)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    app = faust.App(settings.app_id, **faust_settings(settings))
    # bytes in, bytes out (faust picks the raw codec for bytes types): the value is PoolState.to_dict() as JSON
    table = app.Table(TABLE_NAME, partitions=settings.partitions, key_type=bytes, value_type=bytes)
    topics = {name: app.topic(name, key_type=bytes, value_type=bytes, key_serializer="raw",
                              value_serializer="raw") for name in INPUT_TOPICS}
    consumer_positions: dict[TP, int] = {}

    def in_context(p: Pending):
        # the rocksdb store picks the partition database from the current event: make it the pool's own record
        return _current_event.set(weakref.ref(p.event))

    def load(pool: str, p: Pending):
        token = in_context(p)
        try:
            raw = table.get(pool.encode())
        finally:
            _current_event.reset(token)
        if raw is None:
            return None
        if not isinstance(raw, (bytes, bytearray, memoryview, str)):
            raise TypeError(f"table {TABLE_NAME} holds a {type(raw).__name__} for {pool!r}, not JSON bytes")
        return orjson.loads(raw)

    def store(pool: str, value: bytes, p: Pending):
        token = in_context(p)
        try:
            table[pool.encode()] = value
        finally:
            _current_event.reset(token)

    async def send(topic: str, key: bytes, value: bytes):
        return await app.producer.send(topic, key, value, None, None, None)

    def caught_up(tp: TP) -> bool:
        try:
            hw = app.consumer.highwater(tp)
        except Exception:  # noqa: BLE001 - not assigned (yet) or no fetch answered: not caught up
            return False
        if hw is None:
            return False
        pos = worker.received_next.get(tp, consumer_positions.get(tp))
        return pos is not None and pos >= hw

    worker = PoolWorker(settings, load=load, store=store, send=send, caught_up=caught_up)
    app.chipledger = worker  # for tests and the CLI

    def make_agent(topic):
        async def agent(stream):
            async for event in stream.noack().events():
                worker.receive(event)
        agent.__name__ = agent.__qualname__ = f"buffer_{topic.get_topic_name().split('.')[-1]}"
        return app.agent(topic, name=agent.__name__)(agent)

    for t in topics.values():
        make_agent(t)

    if settings.metrics_port is not None:
        from streams.metrics import MetricsCollector, bound_port, registry_of, serve

        def lag() -> dict:
            out = {}
            for tp, nxt in worker.received_next.items():
                try:
                    hw = app.consumer.highwater(tp)
                except Exception:  # noqa: BLE001 - not assigned (any more): no lag to tell
                    continue
                if hw is not None:
                    out[(tp.topic, tp.partition)] = max(0, hw - nxt)
            return out

        worker.metrics = MetricsCollector(worker.pools, settings.fold_config, settings.sched_slo_s, lag=lag)

        @app.task
        async def metrics_server():
            runner = await serve(registry_of(worker.metrics), settings.metrics_host, settings.metrics_port)
            worker.metrics_port = bound_port(runner)
            log.warning("worker: /metrics on http://%s:%d/metrics", settings.metrics_host, worker.metrics_port)

    @app.task
    async def drain_loop():
        await app.producer.maybe_start()
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
                if worker.merger.buffered:
                    # positions of the partitions nothing was received from yet: where the consumer started
                    for tp in worker.merger.tps_buffered():
                        if tp not in worker.received_next and tp not in consumer_positions:
                            try:
                                pos = await app.consumer.position(tp)
                            except Exception:  # noqa: BLE001 - not assigned yet
                                pos = None
                            if pos is not None:
                                consumer_positions[tp] = pos
                await worker.drain()
            except Exception:
                log.exception("worker drain failed; stopping so that the inputs are folded again after a restart")
                raise
            await asyncio.sleep(interval)

    if settings.tick_interval_s > 0:
        ids = {"producer": uuid.uuid4().hex[:16], "seq": 0}

        @app.timer(interval=settings.tick_interval_s)
        async def ticks():
            from streams.producer import canonical_value, validate

            for tick in worker.due_ticks(worker.clock()):
                ids["seq"] += 1
                event = validate(tick)
                headers = [(HEADER_PRODUCER, ids["producer"].encode()), (HEADER_SEQ, str(ids["seq"]).encode())]
                await app.producer.send_and_wait(TOPIC_QUOTA, tick["pool"].encode(), canonical_value(event),
                                                 None, None, headers)
                worker.counts["ticks"] += 1
                worker.last_applied[tick["pool"]] = worker.clock()

    @app.on_partitions_revoked.connect
    async def on_revoked(app_, revoked, **kwargs):
        parts = {tp.partition for tp in revoked if tp.topic in INPUT_TOPICS}
        if parts:
            async with worker._lock:
                await worker.settle()  # the checkpoint in progress acknowledges its records while they are ours
                worker.forget_partitions(parts)
                for tp in list(consumer_positions):
                    if tp.partition in parts:
                        del consumer_positions[tp]

    return app, worker


def run_worker(settings: WorkerSettings, loglevel: str = "warning") -> None:
    """Run the worker until SIGTERM / SIGINT (blocking). Faust's Worker owns the event loop and the signals."""
    import faust

    settings.freeze_gc = True  # the process is the worker's alone: see PoolWorker._gc
    app, _ = make_app(settings)
    try:
        faust.Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()
    finally:
        gc.unfreeze()  # let the interpreter's exit clean up what was frozen
