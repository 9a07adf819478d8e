"""The worker's Faust app through agent.test_context() (memory tables, no broker): the three input agents buffer
what they receive, the sequencer's drain writes it to the log in send order, the log agent's records are folded
into the real Faust table (JSON bytes of PoolState.to_dict())."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import orjson

from schemas import topic_for
from streams.sequencer import HEADER_PREV, HEADER_PRODUCER, HEADER_SEQ, key_partition, unpack_batch
from streams.producer import canonical_value, validate
from streams.worker import SEQ_TABLE_NAME, TABLE_NAME, WorkerSettings, ack_events, make_app

FIXTURE = Path(__file__).parent / "fixtures" / "hand.jsonl"


def _events():
    out = []
    for i, line in enumerate(FIXTURE.read_bytes().splitlines(), 1):
        if i in (13, 14, 15):
            continue
        e = validate(line)
        out.append((topic_for(e.type), e.pool.encode(), canonical_value(e), i))
    return out


def test_agents_buffer_and_the_drain_folds_into_the_faust_table(tmp_path):
    app, worker = make_app(WorkerSettings(table_store="memory", data_dir=tmp_path / "w", tick_interval_s=0,
                                          checkpoint_interval_ms=0))
    sent = []

    async def send(topic, key, value, headers=None):
        sent.append((topic, key, value if topic == "chipledger.log" else orjson.loads(value), headers))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    worker.send = app.sequencer.send = send
    app.sequencer.caught_up = lambda tp: True

    async def start_offsets(tps):  # no broker: where the group's consumer starts (nothing committed: offset 0)
        return {tp: 0 for tp in tps}

    for stage in (app.sequencer, worker):
        stage.start_offsets = start_offsets
        stage.commit = ack_events  # no broker: each record's ack shows its offset would be committed
        stage.fetch = stage.end_of = None  # and nothing to read directly (test_worker.py covers holes)
    table = app.tables[TABLE_NAME]
    agents = {a.channel.get_topic_name(): a for a in app.agents.values()}
    assert sorted(agents) == ["chipledger.chips", "chipledger.jobs", "chipledger.log", "chipledger.quota"]

    async def kafka_delivers_the_changelog():
        # no broker here: what Faust's send buffer holds (the tables' changelog writes) is acknowledged at once;
        # the checkpoints ack their inputs only after that (streams.worker.durable)
        while True:
            fut = await app.producer.buffer.pending.get()
            fut.set_result(None)
            changelog.append(fut.message.channel.get_topic_name())

    changelog: list = []
    offsets: Counter = Counter()

    def next_offset(topic, key):
        tp = (topic, key_partition(key, 3))
        offsets[tp] += 1
        return offsets[tp] - 1

    async def run():
        deliverer = asyncio.ensure_future(kafka_delivers_the_changelog())
        acked = []
        async with agents["chipledger.quota"].test_context() as q, \
                agents["chipledger.jobs"].test_context() as j, \
                agents["chipledger.chips"].test_context() as c:
            by_topic = {"chipledger.quota": q, "chipledger.jobs": j, "chipledger.chips": c}
            # sent in reverse topic order per record: the sequencer still logs them in send order
            evs = _events()
            puts = []
            last: dict = {}  # the SDK's chipledger-prev: this producer's previous seq of the same pool
            for seq, (topic, key, value, _) in enumerate(evs, 1):
                prev = str(last.get(key, 0)).encode()
                last[key] = seq
                puts.append((topic, key, value, [(HEADER_PRODUCER, b"p"), (HEADER_SEQ, str(seq).encode()),
                                                 (HEADER_PREV, prev)]))
            for topic in ("chipledger.chips", "chipledger.jobs", "chipledger.quota"):
                for t, key, value, headers in puts:
                    if t == topic:
                        by_topic[t].sent_offset = next_offset(t, key)  # Kafka's offsets: contiguous per partition
                        ev = await by_topic[t].put(value, key=key, partition=key_partition(key, 3), timestamp=1000.0,
                                                   headers=headers)
                        ev.ack = lambda ev=ev: acked.append(ev.message.offset)
            # held until the drain knows where the consumer started (none missing before the first record)
            assert app.sequencer.seq.buffered == 0 and app.sequencer.intake.unstarted()
            assert await app.sequencer.drain() == len(evs)
            await app.sequencer.settle()
            logged = [(k, v, h) for t, k, v, h in sent if t == "chipledger.log"]
            entries = [(k, e.value) for k, v, _ in logged for e in unpack_batch(v)]
            for pool in {k for _, k, _, _ in evs}:  # each pool's events in send order
                assert [v for k, v in entries if k == pool] == [value for _, k, value, _ in evs if k == pool]
            assert len(entries) == len(evs) and len(logged) < len(evs)  # batches of several
        async with agents["chipledger.log"].test_context() as lg:
            for key, value, headers in logged:
                lg.sent_offset = next_offset("chipledger.log", key)
                ev = await lg.put(value, key=key, partition=key_partition(key, 3), timestamp=1000.0, headers=headers)
                ev.ack = lambda ev=ev: acked.append(("log", ev.message.offset))
            done = await worker.drain()
            await worker.settle()
            deliverer.cancel()
            return done, acked, len(logged)

    done, acked, n_logged = asyncio.run(run())
    assert done == len(_events()) and len(acked) == done + n_logged  # inputs, and each log record once
    assert sorted(set(changelog)) == sorted(f"{app.conf.id}-{name}-changelog" for name in (TABLE_NAME, SEQ_TABLE_NAME))
    state = orjson.loads(table.data[b"lab/a100"])
    assert state["pool"] == "lab/a100" and state["applied"] == worker.counts["applied"] > 0
    out = [v for t, _, v, _ in sent if t != "chipledger.log"]
    rows = [r for v in out if v["kind"] == "rows" for it in v["items"] for r in it["tables"].get("events", [])]
    assert len(rows) == worker.counts["applied"]
    assert [v["pool"] for v in out if v["kind"] == "state"] == ["lab/a100"]


def test_the_app_refreshes_its_consumers_metadata_every_few_seconds(tmp_path):
    """A group leader that assigned the partitions while a restarted broker did not list the topics yet gives every
    member nothing, and rejoins only when its metadata shows the topics: Faust's default refresh (5 min) idled the
    failover test's workers for 300 s after a broker restart."""
    from streams.worker import METADATA_MAX_AGE_MS

    app, _ = make_app(WorkerSettings(table_store="memory", data_dir=tmp_path / "w", tick_interval_s=0))
    assert app.conf.consumer_metadata_max_age_ms == METADATA_MAX_AGE_MS <= 10_000
