"""Prometheus metrics of the pools a process folds: the worker's `/metrics` (`chipledger worker --metrics-port`)
and `chipledger serve-metrics` over an embedded lake (chipledger/monitoring/server.py) use this one collector.

It owns no rule and does nothing while the pools fold. At a scrape it reads everything from the live `PoolState`s:
the counters the core keeps there (DESIGN §4 "Facts": monotonic counters of good and total events per SLO,
decisions, victims, dead letters, events applied; ledger/state.py, updated where the fold writes the rows they
count, carried by the state's snapshot so a restarted worker continues them) and the gauges, through the
functions the store's balances are made with (store/repo.py) and the core's read-only pending reasons
(`ledger.fold.policy_rows`), so the gauges are the ledger's balances. What the fold of the pools does not see is
handed in by its caller, never per record: dead letters made before a pool state (not JSON, not valid, a pool
never configured, a key that is not the event's pool: `dead_letter`) and the fold time of each drain
(`fold_batch`).

Naming follows Prometheus' conventions: the `chipledger_` prefix, base units (chips, not milli-chips; seconds;
chip-seconds), `_total` for counters, labels `pool`, `flavor`, `team` and a few closed sets (SLO, account,
reason, rule, verdict, dead-letter code), never a job id. The SLO counters (good and total events per SLO,
what the rules of `chipledger slo rules` rate) are, as /work/FACTS.md agrees:

| SLO | total | good |
|---|---|---|
| availability | registered chip-seconds (journal `capacity`) | available chip-seconds (`capacity` − `unavailable`) |
| goodput | allocated chip-seconds of ended runs (a run's whole allocation, as it ends) | allocated − lost chip-seconds |
| quota_honoured | waits that fitted their team's unused quota (`in_quota`) and ended | of which started within `sched_slo_s` |
| sched_latency | waits that ended in a start | of which within `sched_slo_s` |
| throughput | charged chip-seconds of the judged progress intervals (`progress`, `slow` not null) | of which not slow |

The availability counters are the journal's postings so far (the core's running sum of them, `Books.totals`) plus
what the open hour accrued up to the pool clock (`Books.accrued`): without the open hour they would move once an
hour, and a 5-minute window would see nothing between two closes.

Cost (DESIGN §9): `chipledger_team_cost_total{pool, team, unit}` is the core's running sum of the `costs` rows it
posts for the teams (PoolState.cost_counts: the hours closed and the price boundaries passed, like the lake's cost
rows; the open hour's use is priced when it is posted), `chipledger_team_budget_rate{team, unit, period}` the
budgets the pools hold per second of the current period; the worker and serve-metrics serve both from here.

`collect` must run in the thread that folds (the worker's event loop; `serve` is an aiohttp server in that loop),
so that it reads the states between two folds.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Mapping, Optional

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

MILLI = 1000.0

#: the SLO counters: SLO -> (total metric, good metric, labels beside `pool`); the rules (chipledger/monitoring/slo_rules.py)
#: and the dashboard read these names
SLO_COUNTERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "availability": ("chipledger_registered_chip_seconds_total", "chipledger_available_chip_seconds_total", ()),
    "quota_honoured": ("chipledger_in_quota_waits_total", "chipledger_in_quota_waits_honoured_total", ("team",)),
    "sched_latency": ("chipledger_started_waits_total", "chipledger_started_waits_within_slo_total", ("team",)),
    "goodput": ("chipledger_allocated_chip_seconds_total", "chipledger_useful_chip_seconds_total", ("team",)),
    "throughput": ("chipledger_progress_judged_chip_seconds_total", "chipledger_progress_at_rate_chip_seconds_total",
                   ("team",)),
}

#: fold time buckets: powers of two nanoseconds, bucket k holds records folded in less than 2^(FOLD_MIN_BITS + k)
#: ns each (1 µs … 1 s; a fold step takes microseconds, a close of an hour milliseconds), found with int.bit_length
FOLD_MIN_BITS = 10
FOLD_BUCKETS_N = 21


class MetricsCollector:
    """Counters and gauges read from `states` (pool -> PoolState) at each scrape.

    `fold_config` is the FoldConfig the pools are folded with (the pending reasons depend on it; its `sched_slo_s`
    is the threshold of the pending-over-SLO gauge); `lag` an optional callable giving the consumer lag per (topic,
    partition) at scrape time. `states_dead_letters`: whether the states' own rejection counters are dead letters
    of this process (the worker: yes; serve-metrics, which folds only the events a run applied and reads the dead
    letters from the lake's rows: no)."""

    def __init__(self, states: Mapping, fold_config,
                 lag: Optional[Callable[[], Mapping[tuple[str, int], int]]] = None, wall=time.time,
                 states_dead_letters: bool = True):
        self.states = states
        self.fold_config = fold_config
        self.lag = lag
        self.wall = wall
        self.states_dead_letters = states_dead_letters
        self.dead: dict = defaultdict(int)  # error code -> dead letters made outside a pool state (`dead_letter`)
        # staleness: the wall time of the scrape that first saw a pool's events count move (not a clock read per
        # event: the scrape interval is the resolution Prometheus has anyway)
        self.last_fold: dict = {}                     # pool -> wall time
        self._seen_counts: dict = {}                  # pool -> events applied at the last scrape
        self.fold_buckets = [0] * (FOLD_BUCKETS_N + 1)  # the last: longer than the largest bound
        self.fold_sum_ns = 0

    # --- what the folding caller hands in (never per record) ------------------------------------------------
    def fold_batch(self, records: int, fold_ns: int) -> None:
        """A drain folded `records` input records in `fold_ns` nanoseconds (two clock reads around the drain's
        fold loop): each record is counted in the histogram at the batch's mean time per record."""
        if records <= 0:
            return
        k = (fold_ns // records).bit_length() - FOLD_MIN_BITS
        self.fold_buckets[k if 0 <= k <= FOLD_BUCKETS_N else (0 if k < 0 else FOLD_BUCKETS_N)] += records
        self.fold_sum_ns += fold_ns

    def dead_letter(self, code: str, n: int = 1) -> None:
        """`n` dead letters of `code` that no pool state counted (bad input caught before the fold, a pool never
        configured; serve-metrics: the lake's `deadletters` rows)."""
        self.dead[code] += n

    # --- the scrape -----------------------------------------------------------------------------------------
    def collect(self):
        yield from self.gauges()
        yield from self.counters()
        yield from self.costs()
        yield from self._health()

    def gauges(self):
        """The gauges of the pools and teams, from the live states."""
        from ledger.fold import HELD, policy_rows
        from store.repo import _pool_row, _team_rows

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
            ("team_held_jobs", "the team's held jobs: back in the queue but not eligible yet (job.preempted with "
             "held, until job.released; e.g. Slurm's requeue-hold): neither running nor pending", T),
            ("team_pending_chips", "chips of the team's pending jobs, by the reason they wait", T + ("reason",)),
            ("team_pending_jobs_over_slo", "pending jobs waiting longer than [slo] sched_slo_s now (the wait SLOs "
             "count a wait when it ends)", T),
        )}
        sched_slo_s = self.fold_config.sched_slo_s
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
            free = s.fc_posted  # the values of the latest free_chips row the fold posted (registered … largest)
            if free is not None:
                for gauge, i in (("pool_free_chips", 4), ("pool_free_whole_node_chips", 5),
                                 ("pool_largest_startable_job_chips", 6)):
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
            held: dict = defaultdict(int)
            for job in s.jobs.values():
                if job.status == HELD:
                    held[job.team] += 1
            for team in sorted(s.teams):
                g["team_held_jobs"].add_metric(pl + [team], held[team])
            by_reason: dict = defaultdict(int)
            late: dict = defaultdict(int)
            for row in policy_rows(s, self.fold_config)[1]:
                by_reason[(row.team, row.reason)] += row.chips_milli
                if s.clock - row.waiting_since > sched_slo_s:
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

        states = sorted(self.states.items())
        yield family("chipledger_events_applied_total", "events applied (the pool's own count: since the pool "
                     "was configured)", ("pool",), [((p,), s.applied) for p, s in states])
        dead = defaultdict(int, self.dead)
        if self.states_dead_letters:
            for _, s in states:
                for code, n in s.rejection_counts.items():
                    dead[code] += n
        yield family("chipledger_dead_letters_total", "input not applied, by dead-letter code", ("code",),
                     [((code,), n) for code, n in dead.items()])
        runs = [((p, team), v) for p, s in states for team, v in s.run_counts.items()]
        yield family(SLO_COUNTERS["goodput"][0], "allocated chip-seconds of ended runs (goodput SLO: total)",
                     ("pool", "team"), [(k, a / MILLI) for k, (a, _) in runs])
        yield family(SLO_COUNTERS["goodput"][1], "allocated minus lost chip-seconds (goodput SLO: good)",
                     ("pool", "team"), [(k, (a - lost) / MILLI) for k, (a, lost) in runs])
        yield family("chipledger_lost_chip_seconds_total", "allocated chip-seconds lost to preemptions and failures "
                     "(work since the last checkpoint)", ("pool", "team"),
                     [(k, lost / MILLI) for k, (_, lost) in runs])
        pg = [((p, team), v) for p, s in states for team, v in s.progress_counts.items()]
        yield family(SLO_COUNTERS["throughput"][0], "chip-seconds of the progress intervals judged against their "
                     "job's reference rate (throughput SLO: total)", ("pool", "team"),
                     [(k, v[0] / MILLI) for k, v in pg])
        yield family(SLO_COUNTERS["throughput"][1], "of those, at or above [slo] throughput_fraction of it "
                     "(throughput SLO: good)", ("pool", "team"), [(k, v[1] / MILLI) for k, v in pg])
        w = [((p, team), v) for p, s in states for team, v in s.wait_counts.items()]
        for i, (slo, doc) in enumerate((("quota_honoured", "waits that fitted the team's unused quota and ended "
                                         "(quota honoured SLO: total)"),
                                        ("quota_honoured", "of those, started within [slo] sched_slo_s "
                                         "(quota honoured SLO: good)"),
                                        ("sched_latency", "waits that ended in a start (latency SLO: total)"),
                                        ("sched_latency", "of those, within [slo] sched_slo_s (latency SLO: good)"))):
            yield family(SLO_COUNTERS[slo][i % 2], doc, ("pool", "team"), [(k, v[i]) for k, v in w])
        yield family("chipledger_decisions_total", "decisions, by type (preempt, burst), rule and verdict (bursts)",
                     ("pool", "type", "rule", "verdict"),
                     [((p, *k), n) for p, s in states for k, n in s.decision_counts.items()])
        victims = [((p, *k), v) for p, s in states for k, v in s.victim_counts.items()]
        yield family("chipledger_preemption_victims_total", "jobs named as victims of a preemption decision, by "
                     "their team", ("pool", "team", "rule"), [(k, v[0]) for k, v in victims])
        yield family("chipledger_preemption_lost_work_chip_seconds_total", "work the victims stood to lose when "
                     "the decision was made (chip-seconds since their last checkpoint)", ("pool", "team", "rule"),
                     [(k, float(v[1])) for k, v in victims])

    def costs(self):
        """`chipledger_team_cost_total{pool, team, unit}`: the team's in-quota, borrowed and burst use priced so far
        (the core's counter of the `costs` rows it posts, PoolState.cost_counts), in the price's unit; and
        `chipledger_team_budget_rate{team, unit, period}`: the team's budgets of these pools summed, per second of the
        period (UTC month or quarter) holding the newest pool clock. The series of `chipledger slo rules`' budget
        burn rules; a pool without a price has no cost series (unknown, not zero)."""
        from ledger.costs import COST_SCALE

        cost = CounterMetricFamily("chipledger_team_cost", "the team's in-quota, borrowed and burst use priced by "
                                   "the fold (ledger/costs.py), in the price's unit", labels=("pool", "team", "unit"))
        for pool in sorted(self.states):
            for (team, unit), scaled in sorted(self.states[pool].cost_counts.items()):
                cost.add_metric([pool, team, unit], scaled / COST_SCALE)
        yield cost
        rate = GaugeMetricFamily("chipledger_team_budget_rate", "the team's budget summed over pools, per second of "
                                 "the current period (month or quarter, UTC)", labels=("team", "unit", "period"))
        now = max((st.clock for st in self.states.values()), default=0)
        sums: dict[tuple[str, str, str], float] = {}
        for pool in sorted(self.states):
            for team, period, amount, unit, effective_from, _set_at in self.states[pool].budgets.values():
                start, end = period_bounds(period, now)
                if effective_from < end:
                    key = (team, unit, period)
                    sums[key] = sums.get(key, 0.0) + amount / (end - start)
        for key, v in sorted(sums.items()):
            rate.add_metric(list(key), v)
        yield rate

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
        h = HistogramMetricFamily("chipledger_fold_duration_seconds", "time to fold one input record (each drain's "
                                  "fold time spread evenly over its records)")
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


def period_bounds(period: str, t: int) -> tuple[int, int]:
    """The UTC month or quarter holding instant t, as epoch seconds [start, end)."""
    from datetime import datetime, timezone

    d = datetime.fromtimestamp(t, timezone.utc)
    first = d.month if period == "month" else d.month - (d.month - 1) % 3
    start = datetime(d.year, first, 1, tzinfo=timezone.utc)
    n = first + (1 if period == "month" else 3)
    end = datetime(d.year + (n - 1) // 12, (n - 1) % 12 + 1, 1, tzinfo=timezone.utc)
    return int(start.timestamp()), int(end.timestamp())


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


__all__ = ["MetricsCollector", "SLO_COUNTERS", "period_bounds", "registry_of", "exposition", "serve", "bound_port"]
