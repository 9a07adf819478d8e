"""The worker's Faust app through agent.test_context() (memory table, no broker): the three agents buffer what
they receive and the drain folds it into the real Faust table (JSON bytes of PoolState.to_dict())."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from schemas import topic_for
from streams.merge import HEADER_PRODUCER, HEADER_SEQ
from streams.producer import canonical_value, validate
from streams.worker import TABLE_NAME, WorkerSettings, make_app

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
                                          checkpoint_interval_ms=0, merge_idle_ms=0))
    sent = []

    async def send(topic, key, value):
        sent.append((topic, key, orjson.loads(value)))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    worker.send = send
    worker.caught_up = lambda tp: True
    table = app.tables[TABLE_NAME]
    agents = {a.channel.get_topic_name(): a for a in app.agents.values()}
    assert sorted(agents) == ["chipledger.chips", "chipledger.jobs", "chipledger.quota"]

    async def run():
        acked = []
        async with agents["chipledger.quota"].test_context() as q, \
                agents["chipledger.jobs"].test_context() as j, \
                agents["chipledger.chips"].test_context() as c:
            by_topic = {"chipledger.quota": q, "chipledger.jobs": j, "chipledger.chips": c}
            for seq, (topic, key, value, _) in enumerate(_events(), 1):
                ev = await by_topic[topic].put(value, key=key, partition=0, timestamp=1000.0,
                                               headers=[(HEADER_PRODUCER, b"p"), (HEADER_SEQ, str(seq).encode())])
                ev.ack = lambda ev=ev: acked.append(ev.message.offset)
            assert worker.merger.buffered == len(_events())
            done = await worker.drain()
            await worker.settle()
            return done, acked

    done, acked = asyncio.run(run())
    assert done == len(_events()) and len(acked) == done
    state = orjson.loads(table.data[b"lab/a100"])
    assert state["pool"] == "lab/a100" and state["applied"] == worker.counts["applied"] > 0
    rows = [r for _, _, v in sent if v["kind"] == "rows" for it in v["items"] for r in it["tables"].get("events", [])]
    assert len(rows) == worker.counts["applied"]
    assert [v["pool"] for _, _, v in sent if v["kind"] == "state"] == ["lab/a100"]
