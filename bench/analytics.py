"""Benchmark: the report views over a generated lake of ~10M job events, DuckDB against SQLite.

    .venv/bin/python bench/analytics.py --events 10000000 --out /tmp/chipledger-bench-analytics

A fold of 10M events takes minutes, so the lake is generated directly, and consistently: per node, jobs run
one after another on known chips (whole or part of the node), some preempted once or twice and restarted
after a wait, some checkpointed; the `events` (each event's canonical JSON body, placements included, and the
typed fields the lake writer takes from the parsed event, analytics.lake.EVENT_FIELDS: tests/test_lake_typed.py
checks them against the writers' code), `job_runs` and hourly `journal` tables are derived from the same job
timelines (the journal's split of a team's use into in_quota / borrowed is by the hour's mean use against its
nominal quota; the fold splits at every event, which the views do not depend on). A spare node per pool has
chips going down and back up.

The facts (`waits`, `free_chips`) are then written the way `chipledger lake upgrade` writes them: by folding the
generated events with the core (chipledger/refold.py), timed apart.

`--copies K` times the views over a lake of K copies of the generated lake instead, each copy's pools renamed
(`copy_lake`; 4K pools over the same days): the lake the fold of the K pool-renamed copies of the generated events
writes, made by DuckDB from the Parquet files in minutes where generating and folding 100M events would take hours
and, generated in one database, ~165 GiB of memory. `--events 10000000 --copies 10` is a lake of 100M events.

Timed, in one process (there is no analytics cache: the views aggregate the facts):
- DuckDB: `connect(lake, materialize=True)` (computes the intermediates several report views share, straight from
  the Parquet files, once: analytics.views.MATERIALIZED), then each report view computed in full (`CREATE TABLE …
  AS SELECT * FROM view`), then `chipledger report`'s queries (`build_report`) as a whole. Target: every view
  <= 2 s at 10M events, <= 20 s at 100M (2 s per 10M events above 10M). `--repeat N`: N passes (a new
  connection each), the minimum of each figure printed.
- SQLite (the in-run baseline): the same base rows copied in (not timed as part of the ratio), the same
  intermediates computed as tables with the same SQL (analytics.sqlite_mirror.materialize: DuckDB's connect does
  that work, so SQLite's time counts it too), then the same portable SQL views (analytics/slo_views.py), each
  computed the same way. Ratio = SQLite / DuckDB on the views both run (target >= 10x).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import duckdb
import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analytics.commits import adopt  # noqa: E402
from analytics.lake import DUCK_TYPES, EVENT_FIELDS, SCHEMAS  # noqa: E402
from analytics.sqlite_mirror import materialize, mirror  # noqa: E402
from analytics.views import MATERIALIZED, connect  # noqa: E402
from chipledger.refold import FACT_TABLES, refold_facts  # noqa: E402
from chipledger.reports.report import build_report  # noqa: E402

T0 = 1_767_225_600  # 2026-01-01T00:00:00Z
POOLS = ("us-east1-a/h100", "us-east1-b/h100", "eu-west4-a/tpu-v5e", "asia-ne1-a/a100")
TEAMS = tuple(f"team-{i:02d}" for i in range(12))
NODES_PER_POOL = 96
CHIPS_PER_NODE = 8
EVENTS_PER_JOB = 4.125  # submit, 1.25 starts, 0.25 preemptions, 0.625 checkpoints, finish (on average)

# the views `chipledger report` reads; the portable ones also run on SQLite
PORTABLE_VIEWS = ("error_budget", "burn_alerts", "slo_quota_honoured", "slo_sched_latency", "fragmentation",
                  "demand_shaping", "demand_peak_teams")
DUCKDB_ONLY_VIEWS = ("slo_capacity", "goodput")
_DUCK = {f.name: DUCK_TYPES[f.type] for f in SCHEMAS["events"]}


def generate(out: Path, events: int, seed: int = 5) -> dict:
    """Write the lake under `out/lake`; returns counts."""
    rng = np.random.default_rng(seed)
    nodes = len(POOLS) * NODES_PER_POOL
    jobs_per_node = max(1, int(events / EVENTS_PER_JOB / nodes))
    n_jobs = jobs_per_node * nodes
    # --- jobs and their runs, per node back to back ---
    node = np.repeat(np.arange(nodes), jobs_per_node)
    preemptions = rng.choice([0, 1, 2], size=n_jobs, p=[0.8, 0.15, 0.05])
    runs_per_job = preemptions + 1
    n_runs = int(runs_per_job.sum())
    run_job = np.repeat(np.arange(n_jobs), runs_per_job)
    first = np.ones(n_runs, dtype=bool)
    first[1:] = run_job[1:] != run_job[:-1]
    run_index = np.arange(n_runs) - np.repeat(np.flatnonzero(first), runs_per_job) + 1
    last = np.zeros(n_runs, dtype=bool)
    last[:-1] = first[1:]
    last[-1] = True
    dur = rng.integers(300, 5400, size=n_runs)                       # run length, s
    gap = np.where(first, rng.integers(0, 1200, size=n_runs),         # idle node before a job's first run
                   rng.integers(60, 1800, size=n_runs))               # restart wait after a preemption
    step = gap + dur
    run_node = node[run_job]
    node_first = np.ones(n_runs, dtype=bool)
    node_first[1:] = run_node[1:] != run_node[:-1]
    csum = np.cumsum(step)
    base = np.repeat(csum[node_first] - step[node_first], np.bincount(run_node, minlength=nodes))
    end = T0 + csum - base
    start = end - dur
    job_first_start = start[first]
    wait = rng.integers(0, 1500, size=n_jobs)
    submitted = np.maximum(T0, job_first_start - wait)
    chips = rng.choice([1, 2, 4, 8], size=n_jobs, p=[0.3, 0.3, 0.25, 0.15])
    team = rng.integers(0, len(TEAMS), size=n_jobs)
    priority = rng.choice([0, 5, 10], size=n_jobs)
    outcome = rng.choice(["succeeded", "failed", "cancelled"], size=n_jobs, p=[0.85, 0.1, 0.05])
    ckpt = np.where(rng.random(n_runs) < 0.5, start + dur // 2, -1)
    end_reason = np.where(last, outcome[run_job], "preempted")
    run_chips = chips[run_job]
    lost_from = np.where(ckpt >= 0, ckpt, start)
    lossy = (end_reason == "preempted") | (end_reason == "failed")
    lost = np.where(lossy, run_chips * 1000 * (end - lost_from), 0)
    pool_of_node = np.arange(nodes) // NODES_PER_POOL
    runs = pa.table({
        "pool": pa.array(np.array(POOLS)[pool_of_node[run_node]]),
        "node": run_node % NODES_PER_POOL, "job": run_job, "team": np.array(TEAMS)[team[run_job]],
        "chips": run_chips, "priority": priority[run_job], "submitted_s": submitted[run_job],
        "run_index": run_index, "start_s": start, "end_s": end, "end_reason": end_reason,
        "ckpt_s": pa.array(np.where(ckpt >= 0, ckpt, 0), mask=ckpt < 0),
        "allocated": run_chips * 1000 * dur, "lost": lost, "first": first, "last": last,
    })
    horizon = int(end.max()) + 3600
    # --- grants (nominal quota per team and pool; an amendment halfway) and a spare node's downtime ---
    g_rows = []
    for p in POOLS:
        share = NODES_PER_POOL * CHIPS_PER_NODE / len(TEAMS)
        for i, t in enumerate(TEAMS):
            g_rows.append((p, f"g-{t}", t, float(round(share * rng.uniform(0.7, 1.3))), T0))
            if i % 3 == 0:
                g_rows.append((p, f"g-{t}", t, float(round(share * rng.uniform(0.7, 1.3))), (T0 + horizon) // 2))
    grants = pa.table(dict(zip(("pool", "grant_id", "team", "chips", "at_s"), map(list, zip(*g_rows)))))
    d_rows = []
    for p in POOLS:
        t = T0 + int(rng.integers(3600, 86400))
        while t < horizon - 7200:
            length = int(rng.integers(600, 4 * 3600))
            d_rows.append((p, f"spare-c{int(rng.integers(0, CHIPS_PER_NODE))}", t, min(t + length, horizon - 60)))
            t += length + int(rng.integers(86400, 5 * 86400))
    down = pa.table(dict(zip(("pool", "chip", "from_s", "until_s"), map(list, zip(*d_rows)))))

    lake = out / "lake"
    if lake.exists():
        shutil.rmtree(lake)
    lake.mkdir(parents=True)
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    con.register("runs", runs)
    con.register("grants", grants)
    con.register("down", down)
    con.execute(f"CREATE TABLE horizon AS SELECT {horizon} AS end_s")
    con.execute(f"""CREATE TABLE chips AS
        SELECT p.pool, 'n' || n.i AS node, 'n' || n.i || '-c' || c.j AS chip FROM (SELECT unnest(?) AS pool) p,
               range({NODES_PER_POOL}) n(i), range({CHIPS_PER_NODE}) c(j)
        UNION ALL
        SELECT p.pool, 'spare', 'spare-c' || c.j FROM (SELECT unnest(?) AS pool) p, range({CHIPS_PER_NODE}) c(j)""",
                [list(POOLS), list(POOLS)])
    iso = "strftime(to_timestamp({}), '%Y-%m-%dT%H:%M:%SZ')"
    env = ("'event_id', eid, 'occurred_at', " + iso.format("at_s") +
           ", 'pool', pool, 'source', 'bench', 'schema_version', 1, 'type', type")
    def typed(**cols) -> str:
        """The typed event fields (analytics.lake.EVENT_FIELDS, in order), null where the type has none."""
        return ", ".join(f"{cols.pop(f, f'NULL::{_DUCK[f]}')} AS {f}" for f in EVENT_FIELDS)

    con.execute(f"""CREATE TABLE ev AS
        SELECT pool, at_s, kind, type, eid, json_object({env}, 'flavor', 'bench', 'chips_per_node', {CHIPS_PER_NODE})
               AS body, {typed()}
        FROM (SELECT unnest(?) AS pool, {T0} AS at_s, 0 AS kind, 'pool.configured' AS type, pool || ':cfg' AS eid)
        UNION ALL
        SELECT pool, {T0}, 1, 'chip.registered', pool || ':reg:' || chip,
               json_object({env}, 'chip_id', chip, 'node', node), {typed(chip_id="chip", node="node")}
        FROM (SELECT *, {T0} AS at_s, 'chip.registered' AS type, pool || ':reg:' || chip AS eid FROM chips)
        UNION ALL
        SELECT pool, at_s, 2, type, eid, json_object({env}, 'grant_id', grant_id, 'team', team, 'chips', chips),
               {typed(grant_id="grant_id", team="team", chips_milli="round(chips * 1000)::BIGINT")}
        FROM (SELECT *, 'quota.granted' AS type, pool || ':' || grant_id || ':' || at_s AS eid FROM grants)
        UNION ALL
        SELECT pool, at_s, 3, type, eid, json_object({env}, 'chip_id', chip, 'state', state),
               {typed(chip_id="chip", state="state")}
        FROM (SELECT *, 'chip.state_changed' AS type, pool || ':' || chip || ':' || at_s AS eid FROM (
                  SELECT pool, chip, from_s AS at_s, 'maintenance' AS state FROM down
                  UNION ALL SELECT pool, chip, until_s, 'healthy' FROM down))
        UNION ALL
        SELECT pool, at_s, 4, type, eid, json_object({env}, 'job_id', job_id, 'team', team, 'chips', chips,
                                                     'priority', priority, 'preemptible', true),
               {typed(job_id="job_id", team="team", chips_milli="(chips * 1000)::BIGINT",
                      priority="priority::BIGINT", preemptible="true")}
        FROM (SELECT pool, 'j' || job AS job_id, team, chips, priority, submitted_s AS at_s,
                     'job.submitted' AS type, pool || ':j' || job || ':sub' AS eid FROM runs WHERE first)
        UNION ALL
        SELECT pool, at_s, 6, type, eid, json_object({env}, 'job_id', job_id, 'chip_ids', chip_ids),
               {typed(job_id="job_id", chip_ids="chip_ids")}
        FROM (SELECT pool, 'j' || job AS job_id, start_s AS at_s, 'job.started' AS type,
                     pool || ':j' || job || ':start:' || run_index AS eid,
                     [('n' || node || '-c' || c) FOR c IN range(chips)] AS chip_ids FROM runs)
        UNION ALL
        SELECT pool, at_s, 5, type, eid, json_object({env}, 'job_id', job_id), {typed(job_id="job_id")}
        FROM (SELECT pool, 'j' || job AS job_id, ckpt_s AS at_s, 'job.checkpointed' AS type,
                     pool || ':j' || job || ':ckpt:' || run_index AS eid FROM runs WHERE ckpt_s IS NOT NULL)
        UNION ALL
        SELECT pool, at_s, 3, type, eid, json_object({env}, 'job_id', job_id), {typed(job_id="job_id")}
        FROM (SELECT pool, 'j' || job AS job_id, end_s AS at_s, 'job.preempted' AS type,
                     pool || ':j' || job || ':pre:' || run_index AS eid FROM runs WHERE NOT last)
        UNION ALL
        SELECT pool, at_s, 3, type, eid, json_object({env}, 'job_id', job_id, 'outcome', outcome),
               {typed(job_id="job_id", outcome="outcome")}
        FROM (SELECT pool, 'j' || job AS job_id, end_s AS at_s, 'job.finished' AS type, end_reason AS outcome,
                     pool || ':j' || job || ':fin' AS eid FROM runs WHERE last)
        UNION ALL
        SELECT pool, end_s, 9, 'pool.tick', pool || ':tick', json_object({env}), {typed()}
        FROM (SELECT unnest(?) AS pool, end_s, end_s AS at_s, 'pool.tick' AS type, pool || ':tick' AS eid FROM horizon)
    """, [list(POOLS), list(POOLS)])
    n_events = con.execute("SELECT count(*) FROM ev").fetchone()[0]
    con.execute(f"""COPY (
        SELECT eid AS event_id, type, pool, 'bench' AS source, to_timestamp(at_s) AS occurred_at,
               to_timestamp(at_s) AS applied_at, 0::BIGINT AS lateness_s, 'file:bench.jsonl' AS topic,
               0::INTEGER AS "partition", row_number() OVER (ORDER BY at_s, kind, eid)::BIGINT AS "offset", body,
               {", ".join(EVENT_FIELDS)}, strftime(to_timestamp(at_s), '%Y-%m-%d') AS day
        FROM ev) TO '{lake / "events"}' (FORMAT parquet, PARTITION_BY (day), COMPRESSION zstd)""")
    con.execute(f"""COPY (
        SELECT pool, 'j' || job AS job_id, team, run_index::INTEGER AS run_index, chips * 1000 AS chips_milli,
               priority::BIGINT AS priority, to_timestamp(submitted_s) AS submitted_at,
               to_timestamp(start_s) AS started_at, to_timestamp(end_s) AS ended_at, end_reason,
               allocated::BIGINT AS allocated_mchip_s, lost::BIGINT AS lost_mchip_s, to_timestamp(end_s) AS posted_at,
               strftime(to_timestamp(end_s), '%Y-%m-%d') AS day
        FROM runs) TO '{lake / "job_runs"}' (FORMAT parquet, PARTITION_BY (day), COMPRESSION zstd)""")
    # the journal: intervals cut at hour boundaries, summed per pool, hour, account and team
    cut = """SELECT pool, team, h AS hour_s,
                    (least(until_s, h + 3600) - greatest(from_s, h)) * rate AS amount
             FROM {src}, LATERAL (SELECT unnest(range(from_s - from_s % 3600, until_s, 3600)) AS h)"""
    con.execute(f"""CREATE TABLE use_h AS
        SELECT pool, team, hour_s, sum(amount)::BIGINT AS use FROM (
            {cut.format(src="(SELECT pool, team, start_s AS from_s, end_s AS until_s, chips * 1000 AS rate FROM runs)")}
        ) GROUP BY ALL""")
    con.execute(f"""CREATE TABLE pend_h AS
        SELECT pool, team, hour_s, sum(amount)::BIGINT AS pending FROM (
            {cut.format(src='''(SELECT pool, team, from_s, until_s, chips * 1000 AS rate FROM (
                SELECT pool, team, chips, submitted_s AS from_s, start_s AS until_s FROM runs WHERE first
                UNION ALL
                SELECT pool, team, chips, lag(end_s) OVER (PARTITION BY pool, job ORDER BY run_index), start_s
                FROM runs) WHERE from_s IS NOT NULL AND until_s > from_s)''')}
        ) GROUP BY ALL""")
    con.execute(f"""CREATE TABLE ent_h AS
        SELECT pool, team, hour_s, sum(amount)::BIGINT AS entitled FROM (
            {cut.format(src='''(SELECT pool, team, at_s AS from_s,
                                       coalesce(lead(at_s) OVER (PARTITION BY pool, grant_id ORDER BY at_s),
                                                (SELECT end_s FROM horizon)) AS until_s,
                                       (chips * 1000)::BIGINT AS rate FROM grants)''')}
        ) GROUP BY ALL""")
    con.execute(f"""CREATE TABLE down_h AS
        SELECT pool, hour_s, sum(amount)::BIGINT AS unavailable FROM (
            {cut.format(src="(SELECT pool, NULL AS team, from_s, until_s, 1000 AS rate FROM down)")}
        ) GROUP BY ALL""")
    n_chips = (NODES_PER_POOL + 1) * CHIPS_PER_NODE
    con.execute(f"""COPY (
        WITH hrs AS (SELECT pool, h AS hour_s FROM (SELECT unnest(?) AS pool),
                                                 range({T0}, (SELECT end_s FROM horizon), 3600) r(h)),
        cap AS (SELECT pool, hour_s, (least(hour_s + 3600, (SELECT end_s FROM horizon)) - hour_s)
                       * {n_chips * 1000} AS capacity FROM hrs),
        team_h AS (
            SELECT coalesce(u.pool, e.pool) AS pool, coalesce(u.team, e.team) AS team,
                   coalesce(u.hour_s, e.hour_s) AS hour_s, coalesce(use, 0) AS use, coalesce(entitled, 0) AS entitled
            FROM use_h u FULL JOIN ent_h e USING (pool, team, hour_s)),
        rows AS (
            SELECT pool, hour_s, 'capacity' AS account, NULL AS team, capacity AS amount FROM cap
            UNION ALL SELECT pool, hour_s, 'unavailable', NULL, unavailable FROM down_h
            UNION ALL SELECT c.pool, c.hour_s, 'idle', NULL,
                             c.capacity - coalesce(d.unavailable, 0) - coalesce(u.use, 0)
                      FROM cap c LEFT JOIN down_h d USING (pool, hour_s)
                      LEFT JOIN (SELECT pool, hour_s, sum(use) AS use FROM use_h GROUP BY ALL) u USING (pool, hour_s)
            UNION ALL SELECT pool, hour_s, 'in_quota', team, least(use, entitled) FROM team_h WHERE use > 0
            UNION ALL SELECT pool, hour_s, 'borrowed', team, use - least(use, entitled) FROM team_h
                      WHERE use > entitled
            UNION ALL SELECT pool, hour_s, 'entitled', team, entitled FROM team_h WHERE entitled > 0
            UNION ALL SELECT pool, hour_s, 'pending', team, pending FROM pend_h
        )
        SELECT pool, to_timestamp(hour_s) AS hour, account, team, amount::BIGINT AS amount_mchip_s,
               strftime(to_timestamp(hour_s), '%Y-%m-%d') AS day
        FROM rows) TO '{lake / "journal"}' (FORMAT parquet, PARTITION_BY (day), COMPRESSION zstd)""", [list(POOLS)])
    adopt(lake)  # the generated files become the lake's books, in one commit (the fact tables empty until folded)
    return {"events": n_events, "jobs": n_jobs, "runs": n_runs, "days": (horizon - T0) / 86400,
            "chips": n_chips * len(POOLS)}


#: the tables a lake of copies is made of, and what in a row names its pool besides the `pool` column (the
#: events' ids and bodies: an event's body is what the fold parses); a table not listed is refused (its rows may
#: name the pool or an event elsewhere: a decision's id holds its event's)
COPIED_TABLES = ("events", "job_runs", "journal", "waits", "free_chips", "chip_states", "grant_intervals", "progress")


def copy_suffix(copy: int) -> str:
    """The suffix of the pool ids of copy `copy` of a lake: '' for the first (the lake itself), '-c<copy>' after."""
    return f"-c{copy}" if copy else ""


def copy_lake(src: Path, dst: Path, copies: int) -> dict:
    """Write under `dst` a lake of `copies` copies of the lake `src`, each copy's pool ids renamed (copy_suffix: the
    first copy keeps them): every table, day by day in the same `day=` folders, with DuckDB's `COPY … TO` over the
    Parquet files (streaming: a day of a table at a time, never the lake in memory).

    It is the lake that folding the `copies` pool-renamed copies of `src`'s events would give, because the fold is
    per pool and deterministic (ledger.Fleet: a pool's state, its dedup window included, sees only its own events):
    each copy's events are `src`'s with the pool (column and body) and the event id (column and body) suffixed,
    and each of its facts is `src`'s with the pool suffixed (no fact row names a pool or an event elsewhere). In
    the log of copies the copies' events come in turn at each offset of `src` (`offset × copies + copy`), so each
    pool's events keep their order. tests/test_bench_copies.py folds a lake of copies again and compares.

    A body that does not spell its pool or its event id as `"pool":<json string>` / `"event_id":<json string>`
    (the canonical JSON the lake writers and the generator write) stops the copy with an error naming the row."""
    if copies < 1:
        raise ValueError(f"copies must be at least 1, got {copies}")
    if not any((src / "events").rglob("*.parquet")):
        raise ValueError(f"{src}: no lake with events to copy")
    tables = sorted(p.name for p in src.iterdir() if p.is_dir() and p.name in SCHEMAS)
    unknown = [t for t in tables if t not in COPIED_TABLES and any((src / t).rglob("*.parquet"))]
    if unknown:
        raise ValueError(f"{src}: cannot copy the tables {unknown}: their rows may name a pool or an event "
                         f"elsewhere than in `pool` (tables copied: {', '.join(COPIED_TABLES)})")
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    con.execute("SET preserve_insertion_order = false")
    con.execute("SET memory_limit = '4GB'")
    rows: dict[str, int] = {}
    for t in tables:
        (dst / t).mkdir()
        exprs = {f.name: f'"{f.name}"' for f in SCHEMAS[t]}
        exprs["pool"] = "pool || suffix"
        if t == "events":
            exprs["event_id"] = "event_id || suffix"
            exprs["offset"] = f'("offset" * {copies} + copy)::BIGINT'
            # the pool and the event id in the body, each spelled once: the body grows by the two suffixes exactly
            renamed = ("""replace(replace(body, '"pool":' || to_json(pool), '"pool":' || to_json(pool || suffix)),
                                  '"event_id":' || to_json(event_id), '"event_id":' || to_json(event_id || suffix))""")
            exprs["body"] = f"""CASE WHEN strlen({renamed}) = strlen(body) + 2 * strlen(suffix) THEN {renamed}
                                     ELSE error('event ' || event_id || ' of pool ' || pool || ': its body does not '
                                                || 'spell its pool and event id once as JSON: ' || body) END"""
        select = ", ".join(f"{e} AS \"{n}\"" for n, e in exprs.items())
        rows[t] = 0
        for day in sorted(p for p in (src / t).iterdir() if p.is_dir()):
            files = sorted(str(p) for p in day.glob("*.parquet"))
            if not files:
                continue
            (dst / t / day.name).mkdir()
            # a file per copy, as a lake of `copies` times the pools written apart would have: each compressed as
            # the lake's own (one file of every copy would compress the copies' repeated values away)
            for copy in range(copies):
                out = dst / t / day.name / f"part-copy{copy}of{copies}-0001.parquet"
                rows[t] += con.execute(f"""
                    COPY (SELECT {select} FROM read_parquet(?, hive_partitioning = false),
                                               (SELECT ?::BIGINT AS copy, ? AS suffix))
                    TO '{out}' (FORMAT parquet, COMPRESSION zstd)""", [files, copy, copy_suffix(copy)]).fetchone()[0]
    con.close()
    adopt(dst)  # the copies' files become the lake's books, in one commit (as `lake upgrade` adopts a lake)
    return rows


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def compute_views(con, views, execute, cpu: Optional[dict] = None) -> dict[str, float]:
    """Each view computed in full; returns the wall time of each, and puts its CPU time (all threads) in `cpu`."""
    times = {}
    for v in views:
        execute(con, f'DROP TABLE IF EXISTS "bench_{v}"')
        c0 = time.process_time()
        times[v], _ = timed(lambda: execute(con, f'CREATE TABLE "bench_{v}" AS SELECT * FROM "{v}"'))
        if cpu is not None:
            cpu[v] = time.process_time() - c0
    return times


#: connect(read_only=...) for the timed passes (--read-only: the tables through Arrow datasets, as `chipledger sql`)
READ_ONLY = False


def duckdb_once(lake: Path, config: Optional[dict] = None) -> tuple:
    """One DuckDB pass: connect(materialize=True), then every report view. Returns the connection and the figures."""
    cpu0 = time.process_time()
    connect_s, duck = timed(lambda: connect(lake, materialize=True, config=config, read_only=READ_ONLY))
    cpu_connect = time.process_time() - cpu0
    cpu: dict[str, float] = {}
    times = compute_views(duck, PORTABLE_VIEWS, lambda c, q: c.execute(q), cpu)
    cpu_portable = time.process_time() - cpu0
    times.update(compute_views(duck, DUCKDB_ONLY_VIEWS, lambda c, q: c.execute(q), cpu))
    return duck, {"connect_s": connect_s, "cpu_connect": cpu_connect, "cpu_portable": cpu_portable,
                  "cpu_views": time.process_time() - cpu0, "views": times, "views_cpu": cpu,
                  "portable_s": connect_s + sum(times[v] for v in PORTABLE_VIEWS)}


def profile_connect(lake: Path, top: int = 12, config: Optional[dict] = None) -> None:
    """One more pass, each statement of connect(materialize=True) and each report view timed in CPU (all threads):
    the largest printed, and the sum of the others (binding the views over the files)."""
    import analytics.views as views

    stats: list[tuple[float, str]] = []

    class Timed:
        def __init__(self, con):
            self.con = con

        def execute(self, sql, *args):
            c0 = time.process_time()
            out = self.con.execute(sql, *args)
            stats.append((time.process_time() - c0, " ".join(sql.split())[:60]))
            return out

        def __getattr__(self, name):
            return getattr(self.con, name)

    real = views.duckdb.connect
    views.duckdb = type("TimedDuckdb", (), {"connect": staticmethod(lambda *a, **k: Timed(real(*a, **k)))})
    try:
        con = views.connect(lake, materialize=True, config=config)
    finally:
        views.duckdb = duckdb
    for v in PORTABLE_VIEWS + DUCKDB_ONLY_VIEWS:
        con.execute(f'CREATE TABLE "bench_{v}" AS SELECT * FROM "{v}"')
    con.close()
    ranked = sorted(stats, reverse=True)
    print(f"  profile (one pass, CPU s): connect and views {sum(t for t, _ in stats):.2f} s, of which")
    for t, sql in ranked[:top]:
        print(f"    {t:6.3f}  {sql}")
    print(f"    {sum(t for t, _ in ranked[top:]):6.3f}  the other {len(ranked) - top} statements")


def run_engines(lake: Path, sqlite: bool, repeat: int = 1, config: Optional[dict] = None) -> dict:
    """Time the views on DuckDB (no cache: there is none) and on SQLite over the same base rows, `repeat` times
    each (a new DuckDB connection each time; SQLite's copy made once); print the minimum of each figure over the
    repeats (and of each total: the best pass, not a sum of bests); return them."""
    load0 = os.getloadavg()
    passes = []
    for _ in range(repeat):
        if passes:
            passes[-1][0].close()
        passes.append(duckdb_once(lake, config))
    duck = passes[-1][0]
    runs = [p for _, p in passes]
    best = {k: min(r[k] for r in runs) for k in ("connect_s", "cpu_connect", "cpu_portable", "cpu_views", "portable_s")}
    duck_times = {v: min(r["views"][v] for r in runs) for v in PORTABLE_VIEWS + DUCKDB_ONLY_VIEWS}
    duck_cpu = {v: min(r["views_cpu"][v] for r in runs) for v in PORTABLE_VIEWS + DUCKDB_ONLY_VIEWS}
    totals = [r["connect_s"] + sum(r["views"].values()) for r in runs]
    views_totals = [sum(r["views"].values()) for r in runs]
    report_cpu = time.process_time()
    report_s, _ = timed(lambda: build_report(duck))
    report_cpu = time.process_time() - report_cpu
    n = duck.execute("SELECT count(*) FROM base_event_rows").fetchone()[0]
    facts = duck.execute("SELECT (SELECT count(*) FROM wait_postings), (SELECT count(*) FROM free_chips)").fetchone()
    lite_times: dict[str, float] = {}
    copy_s = 0.0
    lite_cpu = 0.0
    lite_totals = []
    lite_mat: list[float] = []
    if sqlite:
        copy_s, lite = timed(lambda: mirror(duck, materialized=MATERIALIZED))
        lite_passes = []
        for _ in range(repeat):
            c0 = time.process_time()
            # the same intermediates DuckDB's connect computes, with the same SQL, timed as DuckDB's connect is
            mat_s, _ = timed(lambda: materialize(lite, MATERIALIZED))
            lite_passes.append(compute_views(lite, PORTABLE_VIEWS, lambda c, q: c.execute(q)))
            lite_totals.append((mat_s + sum(lite_passes[-1].values()), time.process_time() - c0))
            lite_mat.append(mat_s)
        lite_times = {v: min(p[v] for p in lite_passes) for v in PORTABLE_VIEWS}
        lite_cpu = min(c for _, c in lite_totals)
        lite.close()
    print(f"  {n:,} events; facts: {facts[0]:,} waits, {facts[1]:,} free_chips rows"
          + (f"; minimum of {repeat} passes" if repeat > 1 else ""))
    print(f"  {'view':<22}{'duckdb s':>10}{'(CPU s)':>10}{'sqlite s':>10}{'sqlite/duckdb':>15}")
    for v in PORTABLE_VIEWS + DUCKDB_ONLY_VIEWS:
        ls = lite_times.get(v)
        print(f"  {v:<22}{duck_times[v]:>10.2f}{duck_cpu[v]:>10.2f}{'' if ls is None else f'{ls:>10.2f}':>10}"
              f"{'' if ls is None else f'{ls / max(duck_times[v], 1e-3):>15.1f}'}")
    connect_s, views_total = best["connect_s"], min(views_totals)
    target = 2 * max(1.0, n / 10_000_000)  # the issue's: 2 s at 10M events, 20 s at 100M
    print(f"  duckdb: connect {connect_s:.2f} s + views {views_total:.2f} s = {min(totals):.2f} s (CPU, all threads: "
          f"{best['cpu_views']:.2f} s); slowest view {max(duck_times.values()):.2f} s (target <= {target:.0f} s at "
          f"{n:,} events: {'met' if max(duck_times.values()) <= target else 'NOT met'}); chipledger report's queries "
          f"after connect {report_s:.2f} s ({report_cpu:.2f} s CPU)")
    print("  load average (1, 5, 15 min): {:.1f} {:.1f} {:.1f} at the start, {:.1f} {:.1f} {:.1f} at the end"
          .format(*load0, *os.getloadavg()))
    out = {"events": n, "cpu_s": best["cpu_views"], "duck_connect_s": connect_s, "duck_views_s": views_total,
           "slowest_view_s": max(duck_times.values()), "report_s": report_s, "views": duck_times}
    if lite_times:
        # both engines compute the same intermediates (MATERIALIZED) with the same SQL, then the views over them: DuckDB's
        # connect + views against SQLite's intermediates + views (the copy of the base rows excluded)
        d = best["portable_s"]
        s_ = min(t for t, _ in lite_totals)
        print(f"  portable views: duckdb {d:.2f} s (connect included), sqlite {s_:.2f} s (its intermediates "
              f"{min(lite_mat):.2f} s): sqlite/duckdb = {s_ / d:.1f}x (copying the base rows into sqlite: "
              f"{copy_s:.1f} s, not counted)")
        # on a loaded machine wall time is mostly waiting for a core: the same in CPU time (DuckDB's of all threads)
        cpu_portable = best["cpu_portable"]
        print(f"  in CPU time: duckdb connect {best['cpu_connect']:.2f} s + portable views "
              f"{min(r['cpu_portable'] - r['cpu_connect'] for r in runs):.2f} s = {cpu_portable:.2f} s, sqlite "
              f"{lite_cpu:.2f} s: sqlite/duckdb = {lite_cpu / cpu_portable:.1f}x")
        if repeat > 1:  # the medians too: on a shared machine the minimum is one lucky pass
            med = statistics.median
            dw, dc = med(r["portable_s"] for r in runs), med(r["cpu_portable"] for r in runs)
            sw, sc = med(t for t, _ in lite_totals), med(c for _, c in lite_totals)
            print(f"  medians of {repeat} passes: duckdb {dw:.2f} s wall, {dc:.2f} s CPU; sqlite {sw:.2f} s wall, "
                  f"{sc:.2f} s CPU: sqlite/duckdb = {sw / dw:.1f}x wall, {sc / dc:.1f}x CPU")
        out.update(duck_portable_s=d, sqlite_s=s_, ratio=s_ / d, duck_portable_cpu_s=cpu_portable,
                   sqlite_cpu_s=lite_cpu, cpu_ratio=lite_cpu / cpu_portable)
    duck.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--out", type=Path, default=Path("/tmp/chipledger-bench-analytics"))
    ap.add_argument("--reuse", action="store_true", help="reuse the lakes of an earlier run with the same --out")
    ap.add_argument("--repeat", type=int, default=1,
                    help="time each engine this many times over the same lake and print the minimum of each figure")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed passes, one more: the CPU time of each statement of connect and of each view")
    ap.add_argument("--copies", type=int, default=1,
                    help="time the views over a lake of this many copies of the generated lake, each copy's pools "
                         "renamed (copy_lake: the lake the fold of the copied events would write), made from the "
                         "generated lake with DuckDB, not folded again: how a lake of 100M events is made here")
    ap.add_argument("--memory-limit", default="",
                    help="DuckDB's memory_limit for the views (e.g. 10GB; default: DuckDB's, 80%% of the memory), "
                         "spilling to a folder under --out")
    ap.add_argument("--sqlite-max-events", type=int, default=1_000_000,
                    help="run the SQLite baseline on the same rows up to this size; above it, on a lake of this "
                         "size generated the same way (SQLite needs hours for the fragmentation view at 10M); 0: none")
    ap.add_argument("--read-only", action="store_true",
                    help="read the committed files through Arrow datasets with DuckDB's file access off, as "
                         "`chipledger sql` does (analytics.views.connect(read_only=True)), instead of read_parquet")
    args = ap.parse_args()
    global READ_ONLY
    READ_ONLY = args.read_only

    def lake_of(n: int) -> Path:
        out = args.out / f"{n}"
        if args.reuse and (out / "lake" / "events").exists():
            print(f"reusing {out / 'lake'}")
        else:
            gen_s, counts = timed(lambda: generate(out, n))
            print(f"generated {counts['events']:,} events ({counts['jobs']:,} jobs, {counts['runs']:,} runs, "
                  f"{counts['chips']:,} chips, {counts['days']:.0f} days) in {gen_s:.1f} s")
            # the facts: the fold of the generated events (what `chipledger lake upgrade` does)
            fold_s, res = timed(lambda: refold_facts(out / "lake", tables=list(FACT_TABLES)))
            print(f"folded them for the facts in {fold_s:.1f} s: {res['rows']}"
                  + (f" (not applied: {res['rejected']})" if res["rejected"] else ""))
        du = sum(f.stat().st_size for f in (out / "lake").rglob("*.parquet")) / 2**20
        print(f"lake: {du:,.0f} MiB of Parquet")
        return out / "lake"

    def copies_of(lake: Path, k: int) -> Path:
        out = args.out / f"{args.events}x{k}" / "lake"
        if args.reuse and (out / "events").exists():
            print(f"reusing {out}")
        else:
            copy_s, rows = timed(lambda: copy_lake(lake, out, k))
            print(f"made {k} copies of {lake} (pools renamed) in {copy_s:.1f} s: {rows}")
        du = sum(f.stat().st_size for f in out.rglob("*.parquet")) / 2**20
        print(f"lake of copies: {du:,.0f} MiB of Parquet")
        return out

    same = args.events <= args.sqlite_max_events and args.copies == 1
    print(f"== {args.events:,} events" + (f" x {args.copies} copies" if args.copies > 1 else "")
          + (": DuckDB and SQLite" if same else ": DuckDB"))
    lake = lake_of(args.events)
    if args.copies > 1:
        lake = copies_of(lake, args.copies)
    config = None
    if args.memory_limit:
        config = {"memory_limit": args.memory_limit, "temp_directory": str(args.out / "duckdb-spill")}
        print(f"DuckDB memory_limit {args.memory_limit}, spilling to {config['temp_directory']}")
    run_engines(lake, sqlite=same, repeat=args.repeat, config=config)
    if args.profile:
        profile_connect(lake, config=config)
    # with --reuse, the views' (and SQLite's copy's) peak; else the generator's and the fold's too
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(f"peak resident memory of this process so far: {peak_gib:.2f} GiB")
    if not same and args.sqlite_max_events > 0:
        print(f"== the SQLite baseline: {args.sqlite_max_events:,} events, both engines on the same rows")
        run_engines(lake_of(args.sqlite_max_events), sqlite=True, repeat=args.repeat)


if __name__ == "__main__":
    main()
