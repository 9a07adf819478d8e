"""`chipledger serve-metrics --lake LAKE`: the worker's `/metrics` for an embedded lake.

The lake's `events` table is the log as applied (each event's canonical JSON, in the order `applied_at, topic,
partition, offset`, the views' order): folding it again with the ledger core gives the pools' states as the run
had them, with the counters the core keeps in them, so the collector (streams/metrics.py) reads the same states
the worker's does. Dead letters are not in the log: their counter is fed from the lake's `deadletters` rows. The
fold uses the configuration's [ledger], [policy] and [slo] (sched_slo_s), as `chipledger run` does.

The port is bound before the lake is folded (a large lake takes minutes): while the first fold runs, /metrics
answers with `chipledger_metrics_loading 1` alone (and the process is `up` for Prometheus), then with every series
and `chipledger_metrics_loading 0`. The first fold runs in a worker thread; the scrapes read nothing of the states
until it is over, and every later fold runs in the server's own loop, between two scrapes.

The lake is followed: at each poll the files committed since (what the sink or a day rolling over commits: only
committed files, analytics/commits.py) are folded on; a file that disappeared or changed (`chipledger run --overwrite`) makes the whole lake be folded again (the
counters restart, which Prometheus' `rate` treats as a counter reset).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Optional

import pyarrow.compute as pc
import pyarrow.parquet as pq

from analytics.commits import open_lake
from ledger import Fleet
from schemas import Rejection, parse_event
from streams.metrics import MetricsCollector, bound_port, registry_of, serve

log = logging.getLogger(__name__)

_EVENT_COLUMNS = ["pool", "applied_at", "topic", "partition", "offset", "body"]


class LakeMetrics:
    """A fleet folded from a lake's `events` rows and the collector it feeds; `poll()` folds the files added."""

    def __init__(self, lake: Path, fold_config):
        self.lake = Path(lake)
        self.fold_config = fold_config
        self.skipped = 0  # event rows that did not fold again (not valid, or rejected: a lake from another config)
        self._reset()

    def _reset(self) -> None:
        self.fleet = Fleet(self.fold_config)
        # the dead letters are the lake's rows (the events folded again are the applied ones)
        self.collector = MetricsCollector(self.fleet.pools, self.fold_config, states_dead_letters=False)
        self.seen: dict[Path, tuple[int, int]] = {}  # file -> (size, mtime_ns) folded

    loading = False  # the first fold is running (in another thread): the states must not be read

    def collect(self):  # the registry's collector: the current one (a rebuild makes a new one)
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily("chipledger_metrics_loading", "1 while serve-metrics folds the lake for the first "
                                "time (no other series is served then), else 0", value=1 if self.loading else 0)
        if not self.loading:
            yield from self.collector.collect()  # the worker's series, cost and budgets included

    def _files(self, table: str) -> dict[Path, tuple[int, int]]:
        out = {}
        for p in map(Path, open_lake(self.lake, (table,), check_files=False).table_files(table) or ()):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            out[p] = (st.st_size, st.st_mtime_ns)
        return out

    def poll(self) -> int:
        """Fold the events of the files added since the last poll (everything again when a folded file changed or
        disappeared); returns the number of events folded."""
        events, dead = self._files("events"), self._files("deadletters")
        now = {**events, **dead}
        if any(now.get(p) != sig for p, sig in self.seen.items()):
            log.info("serve-metrics: files of %s changed or disappeared: folding the whole lake again", self.lake)
            self._reset()
        new_events = [p for p in events if p not in self.seen]
        new_dead = [p for p in dead if p not in self.seen]
        # every added events file is read before any is folded (one caught mid-write raises here, and nothing is
        # marked seen: the next poll reads them all again); the fold itself reads no file
        n = self._fold([pq.read_table(p, columns=_EVENT_COLUMNS, partitioning=None) for p in new_events])
        for p in new_events:
            self.seen[p] = now[p]
        for p in new_dead:
            t = pq.read_table(p, columns=["error_code"], partitioning=None)
            for c in t.column(0).to_pylist():
                self.collector.dead_letter(c)
            self.seen[p] = now[p]
        return n

    def _fold(self, tables: list) -> int:
        if not tables:
            return 0
        import pyarrow as pa

        t = pa.concat_tables(tables)
        t = t.set_column(1, "applied_at", pc.cast(t.column("applied_at"), pa.int64()))
        t = t.sort_by([("applied_at", "ascending"), ("topic", "ascending"), ("partition", "ascending"),
                       ("offset", "ascending")])
        cols = [t.column(c).to_pylist() for c in _EVENT_COLUMNS]
        apply = self.fleet.apply
        n = 0
        for pool, _, topic, partition, offset, body in zip(*cols):
            event = parse_event(body.encode())
            if isinstance(event, Rejection):
                self.skipped += 1
                continue
            step = apply(event)
            if not step.applied:
                self.skipped += 1
                continue
            n += 1
        if self.skipped:
            log.warning("serve-metrics: %d event rows of %s did not fold again (a lake written with another "
                        "[policy] or [ledger] configuration?)", self.skipped, self.lake)
        return n


async def run_server(lake_metrics: LakeMetrics, host: str, port: int, poll_s: float,
                     started=None, stop: Optional[asyncio.Event] = None, loaded=None) -> None:
    """Serve /metrics, fold the lake (in a worker thread, the port answering meanwhile with
    `chipledger_metrics_loading 1`; `loaded(events folded)` after), then poll the lake every `poll_s` seconds until
    `stop` is set (or forever). An error of the first fold is raised (the lake cannot be read)."""
    runner = await serve(registry_of(lake_metrics), host, port)
    if started is not None:
        started(bound_port(runner))
    stop = stop or asyncio.Event()
    try:
        lake_metrics.loading = True
        try:
            n = await asyncio.to_thread(lake_metrics.poll)
        finally:
            lake_metrics.loading = False
        if loaded is not None:
            loaded(n)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), poll_s)
            except asyncio.TimeoutError:
                pass
            if not stop.is_set():
                try:
                    lake_metrics.poll()
                except Exception as e:  # noqa: BLE001 - a file caught mid-write: not marked seen, read next time
                    log.warning("serve-metrics: reading %s failed, trying again at the next poll: %s",
                                lake_metrics.lake, e)
    finally:
        await runner.cleanup()
