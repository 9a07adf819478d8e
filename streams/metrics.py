"""Prometheus metrics of the pools a process folds: the worker's `/metrics` (`chipledger worker --metrics-port`)
and `chipledger serve-metrics` over an embedded lake (chipledger/monitoring.py) use this one collector.

It owns no rule. It is fed, once per folded record, the lake rows the core wrote for it (`observe`: (pool,
{table: rows}) as streams/rows.py makes them) and adds them up into counters; at a scrape it reads the gauges
from the live `PoolState`s through the functions the store's balances are made with (ledger/store/repo.py) and
the core's read-only pending reasons (`ledger.fold.policy_rows`), so the gauges are the ledger's balances.

Naming follows Prometheus' conventions: the `chipledger_` prefix, base units (chips, not milli-chips; seconds;
chip-seconds), `_total` for counters, labels `pool`, `flavor`, `team` and a few closed sets (SLO, account,
reason, rule, verdict, dead-letter code), never a job id. The SLO counters (good and total events per SLO,
what the rules of `chipledger slo rules` rate) are made as /work/FACTS.md agrees:

| SLO | total | good |
|---|---|---|
| availability | registered chip-seconds (journal `capacity`) | available chip-seconds (`capacity` − `unavailable`) |
| goodput | allocated chip-seconds (job_runs) | allocated − lost chip-seconds |
| quota_honoured | waits that fitted their team's unused quota (`in_quota`) and ended | of which started within `sched_slo_s` |
| sched_latency | waits that ended in a start | of which within `sched_slo_s` |

The availability counters are the journal's postings so far (the core's running sum of them, `Books.totals`) plus
what the open hour accrued up to the pool clock (`Books.accrued`): without the open hour they would move once an
hour, and a 5-minute window would see nothing between two closes.

The hot path (`observe`) touches dicts only (no locks, no label lookups); everything is turned into metric
families when Prometheus scrapes (`collect`), which must run in the thread that folds (the worker's event loop;
`serve` is an aiohttp server in that loop).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Iterable, Mapping, Optional, Sequence

import orjson
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from analytics.lake import SCHEMAS

MILLI = 1000.0

#: the SLO counters: SLO -> (total metric, good metric, labels beside `pool`); the rules (chipledger/slo_rules.py)
#: and the dashboard read these names
SLO_COUNTERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "availability": ("chipledger_registered_chip_seconds_total", "chipledger_available_chip_seconds_total", ()),
    "quota_honoured": ("chipledger_in_quota_waits_total", "chipledger_in_quota_waits_honoured_total", ("team",)),
    "sched_latency": ("chipledger_started_waits_total", "chipledger_started_waits_within_slo_total", ("team",)),
    "goodput": ("chipledger_allocated_chip_seconds_total", "chipledger_useful_chip_seconds_total", ("team",)),
}

#: fold time buckets: powers of two nanoseconds, bucket k holds folds shorter than 2^(FOLD_MIN_BITS + k) ns
#: (1 µs … 1 s; a fold step takes microseconds, a close of an hour milliseconds), found with int.bit_length
FOLD_MIN_BITS = 10
FOLD_BUCKETS_N = 21


def _columns(table: str, names: Sequence[str], default: Sequence[int]) -> tuple[int, ...]:
    """The positions of columns in a lake table's rows (from analytics.lake.SCHEMAS; `default` is the agreed column
    order of a fact table the schemas do not declare yet)."""
    schema = SCHEMAS.get(table)
    if schema is None:
        return tuple(default)
    return tuple(schema.get_field_index(n) for n in names)


_JR = _columns("job_runs", ("team", "allocated_mchip_s", "lost_mchip_s"), (2, 10, 11))
_DL = _columns("deadletters", ("error_code",), (4,))
_DC = _columns("decisions", ("type", "rule", "body"), (1, 4, 6))
# the fact tables of /work/FACTS.md (the core writes them as lake rows)
_WT = _columns("waits", ("team", "began_at", "ended_at", "end", "in_quota"), (2, 7, 8, 9, 10))
_FC = _columns("free_chips", ("at", "free_milli", "free_whole_nodes_milli", "largest_startable_milli"),
               (1, 6, 7, 8))


#: lake tables the counters do not read (the events row: the pool state counts what it applied; the balances and
#: pending rows: the gauges read the states)
_NOT_COUNTED = frozenset({"events", "journal", "balances", "pending"})


class MetricsCollector:
    """Counters from the rows fed to `observe`; gauges from `states` (pool -> PoolState, read at each scrape).

    `fold_config` is the FoldConfig the pools are folded with (the pending reasons depend on it); `sched_slo_s`
    the scheduling-latency threshold of the wait SLOs ([slo] sched_slo_s); `lag` an optional callable giving the
    consumer lag per (topic, partition) at scrape time."""

    def __init__(self, states: Mapping, fold_config, sched_slo_s: int = 600,
                 lag: Optional[Callable[[], Mapping[tuple[str, int], int]]] = None, wall=time.time):
        self.states = states
        self.fold_config = fold_config
        self.sched_slo_s = sched_slo_s
        self.lag = lag
        self.wall = wall
        self.dead: dict = defaultdict(int)            # error code -> dead letters
        self.runs: dict = {}                          # (pool, team) -> [allocated, lost] mchip-s
        self.waits: dict = {}  # (pool, team) -> [in quota, honoured, started, within]
        self.decisions: dict = defaultdict(int)       # (pool, type, rule, verdict) -> decisions
        self.victims: dict = defaultdict(lambda: [0, 0.0])  # (pool, team, rule) -> [victims, lost work chip-s]
        self.free: dict = {}                          # pool -> latest free_chips row
        # staleness: the wall time of the scrape that first saw a pool's events count move (not a clock read per
        # event: the scrape interval is the resolution Prometheus has anyway)
        self.last_fold: dict = {}                     # pool -> wall time
        self._seen_counts: dict = {}                  # pool -> events applied at the last scrape
        self.fold_buckets = [0] * (FOLD_BUCKETS_N + 1)  # the last: longer than the largest bound
        self.fold_sum_ns = 0
        self._decisions_seen: list = []  # (pool, row) not yet aggregated: parsed at the next scrape
        # the events row of every record is not looked at: the pool's state counts what it applied
        self.handlers = {"job_runs": self._job_runs, "deadletters": self._deadletters,
                         "decisions": self._decisions, "waits": self._waits, "free_chips": self._free_chips}

    # --- the hot path --------------------------------------------------------------------------------------
    def observe(self, pool: Optional[str], tables: Mapping[str, Iterable[Sequence]]) -> None:
        """Add one folded record's lake rows ({table: rows})."""
        handlers = self.handlers
        for table, rows in tables.items():
            h = handlers.get(table)
            if h is not None:
                h(pool, rows)

    def folded(self, pool: str, outputs: Iterable[tuple[str, Mapping]], fold_ns: int) -> None:
        """The worker's hook: one record's outputs as the worker sends them ((topic, {"tables": …}) pairs) and how
        long its fold took, in nanoseconds (time.perf_counter_ns). Written for speed: it runs for every record."""
        k = fold_ns.bit_length() - FOLD_MIN_BITS
        self.fold_buckets[k if 0 <= k <= FOLD_BUCKETS_N else (0 if k < 0 else FOLD_BUCKETS_N)] += 1
        self.fold_sum_ns += fold_ns
        for _, item in outputs:
            tables = item["tables"]
            if len(tables) == 1 and "events" in tables:
                continue  # a record that put out only its events row: nothing to count
            for table, rows in tables.items():
                if table in _NOT_COUNTED:
                    continue
                if table == "free_chips":
                    self.free[pool] = rows[-1]
                elif table == "waits":
                    self._waits(pool, rows)
                elif table == "job_runs":
                    self._job_runs(pool, rows)
                else:
                    h = self.handlers.get(table)
                    if h is not None:
                        h(pool, rows)

    def _job_runs(self, pool, rows) -> None:
        it, ia, il = _JR
        runs = self.runs
        for r in rows:
            acc = runs.get((pool, r[it]))
            if acc is None:
                acc = runs[(pool, r[it])] = [0, 0]
            acc[0] += r[ia]
            acc[1] += r[il]

    def _deadletters(self, pool, rows) -> None:
        i = _DL[0]
        for r in rows:
            self.dead[(r[i],)] += 1

    def _decisions(self, pool, rows) -> None:
        self._decisions_seen.extend((pool, r) for r in rows)

    def _count_decisions(self) -> None:
        """Aggregate the decisions seen since the last scrape (their JSON is read here, not in the fold's path)."""
        seen, self._decisions_seen = self._decisions_seen, []
        it, ir, ib = _DC
        for pool, r in seen:
            body = orjson.loads(r[ib])
            kind = r[it].removeprefix("decision.")
            self.decisions[(pool, kind, r[ir], body.get("verdict") or "")] += 1
            for v in body.get("victims") or ():
                acc = self.victims[(pool, v.get("team") or "", r[ir])]
                acc[0] += 1
                acc[1] += float(v.get("lost_work_chip_s") or 0)

    def _waits(self, pool, rows) -> None:
        it, ib, ie, iend, iq = _WT
        for r in rows:
            end = r[iend]
            if end == "open":
                continue
            waits = self.waits
            acc = waits.get((pool, r[it]))
            if acc is None:
                acc = waits[(pool, r[it])] = [0, 0, 0, 0]
            if end == "started":
                within = r[ie] - r[ib] <= self.sched_slo_s
                acc[2] += 1
                acc[3] += within
                if r[iq]:
                    acc[0] += 1
                    acc[1] += within
            elif r[iq]:
                acc[0] += 1

    def _free_chips(self, pool, rows) -> None:
        for r in rows:
            self.free[pool] = r

    # --- the scrape -----------------------------------------------------------------------------------------
    def collect(self):
        yield from self.gauges()
        yield from self.counters()
        yield from self._health()

    def gauges(self):
        """The gauges of the pools and teams, from the live states."""
        from ledger.fold import policy_rows
        from ledger.store.repo import _pool_row, _team_rows

        P = ("pool", "flavor")
        T = ("pool", "flavor", "team")
        g = {name: GaugeMetricFamily(f"chipledger_{name}", doc, labels=labels) for name, doc, labels in (
            ("pool_info", "a pool folded here: its flavor and chips per node (value 1)", ("pool", "flavor", "chips_per_node")),
            ("pool_registered_chips", "chips registered in the pool", P),
            ("pool_healthy_chips", "registered chips available (healthy or degraded)", P),
            ("pool_down_chips", "registered chips down or in maintenance", P),
            ("pool_idle_chips", "available chips allocated to no job", P),
            ("pool_overcommitted_chips", "chips started beyond the free healthy chips (an anomaly)", P),
            ("pool_free_chips", "free healthy chips (free_chips fact)", P),
            ("pool_free_whole_node_chips", "free healthy chips on nodes with nothing allocated (free_chips fact)", P),
            ("pool_largest_startable_job_chips", "the largest job (chips) that could start now (free_chips fact)", P),
            ("pool_clock_timestamp_seconds", "the pool clock: event time of the last event applied", ("pool",)),
            ("team_nominal_chips", "the team's quota in effect", T),
            ("team_used_chips", "chips charged to the team now (its running jobs on available chips)", T),
            ("team_in_quota_chips", "of the used chips, within the team's nominal quota", T),
            ("team_borrowed_chips", "of the used chips, borrowed beyond quota", T),
            ("team_burst_chips", "of the used chips, on an approved burst", T),
            ("team_fair_share_factor", "F = 2^(-(U/sum U)/S), as of the last close of an hour (0.5: at its share)", T),
            ("team_borrowed_share", "borrowed chips / the pool's lendable chips", T),
            ("team_running_jobs", "the team's running jobs", T),
            ("team_pending_jobs", "the team's pending jobs", T),
            ("team_pending_chips", "chips of the team's pending jobs, by the reason they wait", T + ("reason",)),
            ("team_pending_jobs_over_slo", "pending jobs waiting longer than [slo] sched_slo_s now (the wait SLOs "
             "count a wait when it ends)", T),
        )}
        for name in sorted(self.states):
            s = self.states[name]
            pl = [name, s.flavor]
            pb = _pool_row(s)
            g["pool_info"].add_metric([name, s.flavor, str(s.chips_per_node)], 1)
            g["pool_registered_chips"].add_metric(pl, pb.capacity_milli / MILLI)
            g["pool_healthy_chips"].add_metric(pl, (pb.capacity_milli - pb.unavailable_milli) / MILLI)
            g["pool_down_chips"].add_metric(pl, pb.unavailable_milli / MILLI)
            g["pool_idle_chips"].add_metric(pl, pb.idle_milli / MILLI)
            g["pool_overcommitted_chips"].add_metric(pl, pb.overcommitted_milli / MILLI)
            g["pool_clock_timestamp_seconds"].add_metric([name], s.clock)
            free = self.free.get(name)
            if free is not None:
                for gauge, i in zip(("pool_free_chips", "pool_free_whole_node_chips",
                                     "pool_largest_startable_job_chips"), _FC[1:]):
                    if free[i] is not None:  # null while a run without a placement goes: not known then
                        g[gauge].add_metric(pl, free[i] / MILLI)
            for tb in _team_rows(s):
                tl = pl + [tb.team]
                g["team_nominal_chips"].add_metric(tl, tb.nominal_milli / MILLI)
                g["team_used_chips"].add_metric(tl, tb.used_milli / MILLI)
                g["team_in_quota_chips"].add_metric(tl, tb.in_quota_milli / MILLI)
                g["team_borrowed_chips"].add_metric(tl, tb.borrowed_milli / MILLI)
                g["team_burst_chips"].add_metric(tl, tb.burst_milli / MILLI)
                g["team_fair_share_factor"].add_metric(tl, tb.fair_share_factor)
                g["team_borrowed_share"].add_metric(tl, tb.borrowed_share)
                g["team_running_jobs"].add_metric(tl, tb.running_jobs)
                g["team_pending_jobs"].add_metric(tl, tb.pending_jobs)
            by_reason: dict = defaultdict(int)
            late: dict = defaultdict(int)
            for row in policy_rows(s, self.fold_config)[1]:
                by_reason[(row.team, row.reason)] += row.chips_milli
                if s.clock - row.waiting_since > self.sched_slo_s:
                    late[row.team] += 1
            for team in sorted(s.teams):
                g["team_pending_jobs_over_slo"].add_metric(pl + [team], late[team])
            for (team, reason), milli in sorted(by_reason.items()):
                g["team_pending_chips"].add_metric(pl + [team, reason], milli / MILLI)
        yield from g.values()

    def counters(self):
        """The counters: the SLOs' good and total events, events, dead letters, decisions, victims."""
        from ledger.books import CAPACITY, UNAVAILABLE

        avail_total = CounterMetricFamily(SLO_COUNTERS["availability"][0].removesuffix("_total"),
                                          "registered chip-seconds (availability SLO: total)", labels=("pool",))
        avail_good = CounterMetricFamily(SLO_COUNTERS["availability"][1].removesuffix("_total"),
                                         "available chip-seconds (availability SLO: good)", labels=("pool",))
        for name in sorted(self.states):
            s = self.states[name]
            books = s.books
            cap = books.totals.get((CAPACITY, None), 0) + books.accrued(CAPACITY, None, s.clock)
            unav = books.totals.get((UNAVAILABLE, None), 0) + books.accrued(UNAVAILABLE, None, s.clock)
            avail_total.add_metric([name], cap / MILLI)
            avail_good.add_metric([name], (cap - unav) / MILLI)
        yield avail_total
        yield avail_good

        def family(name, doc, labels, items):
            m = CounterMetricFamily(name.removesuffix("_total"), doc, labels=labels)
            for key, value in sorted(items, key=lambda kv: tuple(str(k) for k in kv[0])):
                m.add_metric([str(k) for k in key], value)
            return m

        yield family("chipledger_events_applied_total", "events applied (the pool's own count: since the pool "
                     "was configured)", ("pool",), [((p,), s.applied) for p, s in self.states.items()])
        yield family("chipledger_dead_letters_total", "input not applied, by dead-letter code", ("code",),
                     self.dead.items())
        runs = self.runs
        yield family(SLO_COUNTERS["goodput"][0], "allocated chip-seconds of ended runs (goodput SLO: total)",
                     ("pool", "team"), [(k, a / MILLI) for k, (a, _) in runs.items()])
        yield family(SLO_COUNTERS["goodput"][1], "allocated minus lost chip-seconds (goodput SLO: good)",
                     ("pool", "team"), [(k, (a - lost) / MILLI) for k, (a, lost) in runs.items()])
        yield family("chipledger_lost_chip_seconds_total", "allocated chip-seconds lost to preemptions and failures "
                     "(work since the last checkpoint)", ("pool", "team"),
                     [(k, lost / MILLI) for k, (_, lost) in runs.items()])
        w = self.waits
        for i, (slo, doc) in enumerate((("quota_honoured", "waits that fitted the team's unused quota and ended "
                                         "(quota honoured SLO: total)"),
                                        ("quota_honoured", "of those, started within [slo] sched_slo_s "
                                         "(quota honoured SLO: good)"),
                                        ("sched_latency", "waits that ended in a start (latency SLO: total)"),
                                        ("sched_latency", "of those, within [slo] sched_slo_s (latency SLO: good)"))):
            yield family(SLO_COUNTERS[slo][i % 2], doc, ("pool", "team"), [(k, v[i]) for k, v in w.items()])
        self._count_decisions()
        yield family("chipledger_decisions_total", "decisions, by type (preempt, burst), rule and verdict (bursts)",
                     ("pool", "type", "rule", "verdict"), self.decisions.items())
        yield family("chipledger_preemption_victims_total", "jobs named as victims of a preemption decision, by "
                     "their team", ("pool", "team", "rule"), [(k, v[0]) for k, v in self.victims.items()])
        yield family("chipledger_preemption_lost_work_chip_seconds_total", "work the victims stood to lose when "
                     "the decision was made (chip-seconds since their last checkpoint)", ("pool", "team", "rule"),
                     [(k, v[1]) for k, v in self.victims.items()])

    def _health(self):
        now = self.wall()
        for pool, state in self.states.items():
            n = state.applied
            if self._seen_counts.get(pool) != n:
                self._seen_counts[pool] = n
                self.last_fold[pool] = now
        last = GaugeMetricFamily("chipledger_pool_last_fold_timestamp_seconds",
                                 "wall-clock time of the first scrape that saw an event of the pool applied since "
                                 "the scrape before (staleness: time() minus this)", labels=("pool",))
        for pool, t in sorted(self.last_fold.items()):
            last.add_metric([pool], t)
        yield last
        h = HistogramMetricFamily("chipledger_fold_duration_seconds", "time to fold one input record")
        cum, buckets = 0, []
        for k, n in enumerate(self.fold_buckets):
            cum += n
            bound = "+Inf" if k == FOLD_BUCKETS_N else repr((1 << (FOLD_MIN_BITS + k)) / 1e9)
            buckets.append((bound, cum))
        h.add_metric([], buckets, self.fold_sum_ns / 1e9)
        yield h
        if self.lag is not None:
            lag = GaugeMetricFamily("chipledger_consumer_lag_records", "input records not yet received, per "
                                    "topic-partition (the broker's high watermark minus the next offset)",
                                    labels=("topic", "partition"))
            for (topic, part), n in sorted(self.lag().items()):
                lag.add_metric([topic, str(part)], n)
            yield lag


def registry_of(collector: MetricsCollector, process: bool = True) -> CollectorRegistry:
    """A registry with the collector (and the process' CPU and memory metrics, `process_*`)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    if process:
        ProcessCollector(registry=reg)
    return reg


def exposition(registry: CollectorRegistry) -> bytes:
    """The text format Prometheus scrapes."""
    return generate_latest(registry)


async def serve(registry: CollectorRegistry, host: str, port: int):
    """Serve `/metrics` on host:port from the running event loop (the scrape then runs between two folds, so it
    reads the states consistently). Returns the aiohttp runner (`await runner.cleanup()` stops it)."""
    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST

    async def metrics(request):
        return web.Response(body=exposition(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", lambda r: web.Response(text="chipledger metrics: /metrics\n"))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner


def bound_port(runner) -> int:
    """The port an aiohttp runner listens on (the one chosen when 0 was asked)."""
    for site in runner.sites:
        server = site._server  # noqa: SLF001 - aiohttp keeps the asyncio server here
        if server is not None and server.sockets:
            return server.sockets[0].getsockname()[1]
    raise RuntimeError("the metrics server is not listening")


__all__ = ["MetricsCollector", "SLO_COUNTERS", "registry_of", "exposition", "serve", "bound_port"]
