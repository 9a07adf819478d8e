"""DuckDB views over the lake, with stable names and documented columns (see docs/analytics.md).

`connect(lake)` opens an in-memory DuckDB database whose views read the lake's committed Parquet files (the files
the manifest of its latest commit names: analytics/commits.py; never a glob over the folders). A table with no
files yet is an empty view of the same columns, so queries work on a fresh lake. `connect(lake, read_only=True)`
(`chipledger sql`) reads them through Arrow datasets and turns DuckDB's own file access off: no statement can
read or write a file, the lake's included.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Collection, Optional, Union

import duckdb

from analytics.commits import open_lake
from analytics.cost_views import COST_RAW_VIEW_NAMES, COST_VIEWS
from analytics.lake import EVENT_FIELDS, SCHEMAS, empty_view_sql, read_parquet_sql
from analytics.policy_views import POLICY_RAW_VIEW_NAMES, POLICY_VIEWS
from analytics.slo_views import (DUCKDB, SloParams, duckdb_base_views, job_run_totals_sql, journal_sql,
                                 settings_rows, slo_views)


# Views derived from the raw tables. Amounts stay integer milli-chip-seconds; `*_chip_h` columns are for people.
DERIVED_VIEWS = {
    # every applied event, with the typed fields of its type (written by the lake writer from the parsed event)
    "events": """
        SELECT event_id, type, pool, source, occurred_at, applied_at, lateness_s, team, "user", job_id, chip_id, grant_id,
               request_id, chips_milli, priority, preemptible, state, outcome, topic, "partition", "offset", body
        FROM base_event_log
    """,
    # the books: postings summed per (pool, hour, account, team)
    "journal": journal_sql(),
    # a fact of the fold: each wait of a job to be started, its last posting. The fold posts a wait's end once, and
    # a wait still open at a close of the books with end 'open' (superseded by the posting of its end): so every
    # posting of an end is a wait's last, and of the open postings only the latest of a wait that has no end yet
    # (a join of the open postings alone, not a window over every posting). The postings are read once (`p`, kept
    # in memory for the query): reading the files twice, once for the ends and once for the open postings, cost
    # more than the join. The join's hash table holds the open postings' keys (`o`: the ends among them are `m`),
    # not the ends' (4–5 times as many): 45 → 33 s CPU at 100M events, where it spills
    "waits": """
        WITH p AS MATERIALIZED (SELECT * FROM wait_postings),
        o AS (SELECT * FROM p WHERE "end" = 'open'),
        m AS (SELECT * FROM (SELECT pool, job_id, submitted_at, run_index FROM p WHERE "end" <> 'open')
              SEMI JOIN o USING (pool, job_id, submitted_at, run_index))
        SELECT * FROM p WHERE "end" <> 'open'
        UNION ALL
        SELECT * FROM (SELECT o.* FROM o ANTI JOIN m USING (pool, job_id, submitted_at, run_index))
        QUALIFY row_number() OVER (PARTITION BY pool, job_id, submitted_at, run_index ORDER BY posted_at DESC) = 1
    """,
    # one row per run of a job (postings of a run still going at a close are summed with its end); a job id
    # reused after the job finished is another job: runs are told apart by their submission time
    "job_run_totals": job_run_totals_sql(),
    # one row per job (per submission: a job id reused after the job finished starts a new job), from its
    # events and its runs
    "jobs": """
        WITH e AS (
            SELECT *, sum(CASE WHEN type = 'job.submitted' THEN 1 ELSE 0 END)
                        OVER (PARTITION BY pool, job_id ORDER BY applied_at, topic, "partition", "offset"
                              ROWS UNBOUNDED PRECEDING) AS submission
            FROM events WHERE job_id IS NOT NULL
        ), sub AS (
            SELECT pool, job_id, submission, team, "user", chips_milli, priority, preemptible,
                   applied_at AS submitted_at
            FROM e WHERE type = 'job.submitted'
        ), ev AS (
            SELECT pool, job_id, submission,
                   min(applied_at) FILTER (WHERE type = 'job.started') AS first_started_at,
                   max(applied_at) FILTER (WHERE type = 'job.finished') AS finished_at,
                   arg_max(outcome, applied_at) FILTER (WHERE type = 'job.finished') AS outcome
            FROM e GROUP BY pool, job_id, submission
        ), runs AS (
            -- interruptions by the core's cause (DESIGN §4): the runs' end_reason; only `preempted` is a preemption
            SELECT pool, job_id, submitted_at, sum(allocated_mchip_s)::BIGINT AS allocated_mchip_s,
                   sum(lost_mchip_s)::BIGINT AS lost_mchip_s,
                   count(DISTINCT run_index) FILTER (WHERE end_reason = 'preempted') AS preemptions,
                   count(DISTINCT run_index) FILTER (WHERE end_reason = 'requeued') AS requeues,
                   count(DISTINCT run_index) FILTER (WHERE end_reason = 'failure') AS failures
            FROM job_runs GROUP BY pool, job_id, submitted_at
        )
        SELECT sub.job_id, sub.pool, sub.team, sub."user", sub.chips_milli / 1000.0 AS chips, sub.chips_milli,
               coalesce(sub.priority, 0) AS priority, coalesce(sub.preemptible, true) AS preemptible,
               sub.submitted_at, ev.first_started_at, ev.finished_at, ev.outcome,
               coalesce(runs.preemptions, 0)::BIGINT AS preemptions,
               coalesce(runs.allocated_mchip_s, 0)::BIGINT AS allocated_mchip_s,
               coalesce(runs.lost_mchip_s, 0)::BIGINT AS lost_mchip_s,
               coalesce(runs.requeues, 0)::BIGINT AS requeues,
               coalesce(runs.failures, 0)::BIGINT AS failures
        FROM sub LEFT JOIN ev USING (pool, job_id, submission)
                 LEFT JOIN runs ON runs.pool = sub.pool AND runs.job_id = sub.job_id
                               AND runs.submitted_at = sub.submitted_at
    """,
    # chip-seconds allocated per pool, team and user: the runs' allocation (`job_runs`, the core's) summed by the
    # `user` of the job's submission (its key: pool, job id, submission time, as in `jobs`); null user: not given
    "usage_by_user": """
        WITH sub AS (
            SELECT pool, job_id, applied_at AS submitted_at, arg_max("user", "offset") AS "user"
            FROM events WHERE type = 'job.submitted' GROUP BY ALL
        )
        SELECT r.pool, r.team, sub."user", count(DISTINCT (r.job_id, r.submitted_at)) AS jobs,
               count(DISTINCT (r.job_id, r.submitted_at, r.run_index)) AS runs,
               sum(r.allocated_mchip_s)::BIGINT AS allocated_mchip_s, sum(r.lost_mchip_s)::BIGINT AS lost_mchip_s,
               sum(r.allocated_mchip_s) / 3.6e6 AS allocated_chip_h
        FROM job_runs r LEFT JOIN sub ON sub.pool = r.pool AND sub.job_id = r.job_id AND sub.submitted_at = r.submitted_at
        GROUP BY r.pool, r.team, sub."user"
    """,
    # capacity SLO: of the chip-seconds registered, the share available (healthy or degraded), per UTC day
    "slo_capacity": """
        SELECT CAST(date_trunc('day', hour) AS DATE) AS day, pool,
               sum(amount_mchip_s) FILTER (WHERE account = 'capacity')::BIGINT AS registered_mchip_s,
               (coalesce(sum(amount_mchip_s) FILTER (WHERE account = 'capacity'), 0)
                - coalesce(sum(amount_mchip_s) FILTER (WHERE account = 'unavailable'), 0))::BIGINT
                   AS healthy_mchip_s,
               ((coalesce(sum(amount_mchip_s) FILTER (WHERE account = 'capacity'), 0)
                 - coalesce(sum(amount_mchip_s) FILTER (WHERE account = 'unavailable'), 0))
                / nullif(sum(amount_mchip_s) FILTER (WHERE account = 'capacity'), 0)) AS availability
        FROM journal WHERE team IS NULL
        GROUP BY ALL
    """,
    # quota against capacity per pool and hour (quotas may be oversubscribed: ratio > 1)
    "oversubscription": """
        SELECT pool, hour,
               coalesce(sum(amount_mchip_s) FILTER (WHERE account = 'entitled'), 0)::BIGINT AS entitled_mchip_s,
               coalesce(sum(amount_mchip_s) FILTER (WHERE account = 'capacity'), 0)::BIGINT AS capacity_mchip_s,
               coalesce(sum(amount_mchip_s) FILTER (WHERE account = 'entitled'), 0)
                 / nullif(sum(amount_mchip_s) FILTER (WHERE account = 'capacity'), 0) AS ratio
        FROM journal GROUP BY pool, hour
    """,
    # goodput = (allocated - lost) / allocated, per job, per team and per pool (`level` says which), from the
    # runs (a job that never ran has nothing allocated: no goodput). The teams' sums are summed from the jobs', the
    # pools' from the teams' (the same integers as grouping sets over the runs, one pass over them instead of three)
    "goodput": """
        WITH j AS (
            SELECT pool, team, job_id, sum(allocated_mchip_s) AS a, sum(lost_mchip_s) AS l
            FROM job_runs GROUP BY pool, team, job_id, submitted_at
        ), t AS (
            SELECT pool, team, sum(a) AS a, sum(l) AS l FROM j GROUP BY pool, team
        )
        SELECT level, pool, team, job_id, a::BIGINT AS allocated_mchip_s, l::BIGINT AS lost_mchip_s,
               (a - l) / nullif(a, 0) AS goodput
        FROM (SELECT 'job' AS level, pool, team, job_id, a, l FROM j
              UNION ALL SELECT 'team', pool, team, NULL, a, l FROM t
              UNION ALL SELECT 'pool', pool, NULL, NULL, sum(a), sum(l) FROM t GROUP BY pool)
    """,
    # throughput per run of a job, from the fold's `progress` facts (docs/analytics.md, "throughput"): its rate over
    # the intervals reported, its reference rate, the chip-seconds and seconds below [slo] throughput_fraction of it,
    # when, how slow at worst, and the chips it held then (those not healthy: the likely cause; all of them). Units
    # are the job's own (`unit`): never added across jobs
    "throughput": """
        WITH r AS (
            SELECT pool, job_id, submitted_at, run_index, any_value(team) AS team, any_value(unit) AS unit,
                   min(began_at) AS first_report_at, max(ended_at) AS last_report_at, count(*) AS intervals,
                   count(slow) AS judged_intervals, max(units_to) - min(units_from) AS units,
                   sum(charged_mchip_s)::BIGINT AS reported_mchip_s,
                   (max(units_to) - min(units_from)) * 1000.0 / nullif(sum(charged_mchip_s), 0) AS units_per_chip_s,
                   max(reference_units_per_chip_s) AS reference_units_per_chip_s,
                   coalesce(sum(charged_mchip_s) FILTER (WHERE slow IS NOT NULL), 0)::BIGINT AS judged_mchip_s,
                   coalesce(sum(charged_mchip_s) FILTER (WHERE slow), 0)::BIGINT AS slow_mchip_s,
                   sum(slow_s)::BIGINT AS slow_s,
                   min(began_at) FILTER (WHERE slow) AS first_slow_at, max(ended_at) FILTER (WHERE slow) AS last_slow_at,
                   min(units_per_chip_s / reference_units_per_chip_s) FILTER (WHERE slow) AS slowest_fraction
            FROM progress GROUP BY pool, job_id, submitted_at, run_index
        ), c AS (
            SELECT pool, job_id, submitted_at, run_index,
                   array_to_string(list_sort(list_distinct(list(u) FILTER (WHERE u IS NOT NULL))), ',')
                       AS unhealthy_chips_while_slow,
                   array_to_string(list_sort(list_distinct(list(h) FILTER (WHERE h IS NOT NULL))), ',')
                       AS chips_held_while_slow
            FROM (SELECT pool, job_id, submitted_at, run_index,
                         unnest(CASE WHEN unhealthy_chips = '' THEN [NULL] ELSE string_split(unhealthy_chips, ',') END) AS u,
                         NULL AS h
                  FROM progress WHERE slow
                  UNION ALL
                  SELECT pool, job_id, submitted_at, run_index, NULL,
                         unnest(CASE WHEN held_chips = '' THEN [NULL] ELSE string_split(held_chips, ',') END)
                  FROM progress WHERE slow)
            GROUP BY pool, job_id, submitted_at, run_index
        )
        SELECT r.pool, r.team, r.job_id, r.submitted_at, r.run_index, r.unit, r.first_report_at, r.last_report_at,
               r.intervals, r.judged_intervals, r.units, r.reported_mchip_s, r.units_per_chip_s,
               r.reference_units_per_chip_s, r.judged_mchip_s, r.slow_mchip_s, r.slow_s,
               (r.judged_mchip_s - r.slow_mchip_s) * 1.0 / nullif(r.judged_mchip_s, 0) AS attainment,
               r.first_slow_at, r.last_slow_at, r.slowest_fraction,
               coalesce(c.unhealthy_chips_while_slow, '') AS unhealthy_chips_while_slow,
               coalesce(c.chips_held_while_slow, '') AS chips_held_while_slow
        FROM r LEFT JOIN c USING (pool, job_id, submitted_at, run_index)
    """,
    # demand per pool, team and hour: chips running (charged) plus chips of jobs waiting to start
    "demand_hourly": """
        SELECT pool, team, hour,
               coalesce(sum(amount_mchip_s) FILTER (WHERE account IN ('in_quota', 'borrowed', 'burst')), 0)::BIGINT
                   AS running_mchip_s,
               coalesce(sum(amount_mchip_s) FILTER (WHERE account = 'pending'), 0)::BIGINT AS pending_mchip_s,
               coalesce(sum(amount_mchip_s) FILTER (WHERE account IN ('in_quota', 'borrowed', 'burst', 'pending')),
                        0)::BIGINT AS demand_mchip_s
        FROM journal WHERE team IS NOT NULL
        GROUP BY pool, team, hour
    """,
}


# views over the SLO layer's intermediates (analytics/slo_views.py), defined after them
WAIT_VIEWS = {
    # head-of-line blocking per pool and team, from the waits (calc_waits: computed once by a materializing
    # connection, which `chipledger report` is): the chip-seconds its jobs could have started and did not
    # (blocked_s × chips), the waits and jobs that were, and the waiting jobs ahead of them that held the chips most
    # (each listed blocker is given the blocked chip-seconds of every wait that lists it)
    "hol_blocking": """
        WITH w AS (
            SELECT pool, team, job_id, submitted_s, blocked_s, blocked_s * chips_milli AS blocked_mchip_s, blocked_by
            FROM calc_waits WHERE blocked_s > 0
        ), b AS (
            SELECT pool, team, blocker, sum(blocked_mchip_s) AS mchip_s FROM (
                SELECT pool, team, blocked_mchip_s, unnest(string_split(blocked_by, ',')) AS blocker
                FROM w WHERE blocked_by <> '')
            GROUP BY ALL
        ), top AS (
            SELECT pool, team, string_agg(blocker, ',' ORDER BY mchip_s DESC, blocker) AS top_blockers FROM (
                SELECT *, row_number() OVER (PARTITION BY pool, team ORDER BY mchip_s DESC, blocker) AS rk FROM b)
            WHERE rk <= 3 GROUP BY pool, team
        )
        SELECT w.pool, w.team, count(*) AS waits_blocked, count(DISTINCT (w.job_id, w.submitted_s)) AS jobs_affected,
               sum(w.blocked_s)::BIGINT AS blocked_s, sum(w.blocked_mchip_s)::BIGINT AS blocked_mchip_s,
               sum(w.blocked_mchip_s) / 3.6e6 AS blocked_chip_h, coalesce(any_value(top.top_blockers), '') AS top_blockers
        FROM w LEFT JOIN top ON top.pool = w.pool AND top.team = w.team
        GROUP BY w.pool, w.team
    """,
}


# what `connect(materialize=True)` computes once, as tables: the intermediate results that several report views
# (and `chipledger report`'s own queries) read, straight from the lake's files. The base tables under them stay
# views, read once by the intermediate that needs them (the columns it needs), not copied into memory first:
# each pool's clock (base_pool_end, read by several), the free-capacity step function, the waits with their SLO
# class (calc_waits), the error budgets' and burn rates' window sums per SLO and pool (calc_slo_sums: the SLI points
# under them are read once, by it, and not kept), the demand slots. The settings (slo_settings, slo_targets) are
# those given to `connect`: a table computed from them does not follow a later change of them (connect again;
# without `materialize` every view follows them)
MATERIALIZED = frozenset({"base_pool_end", "calc_free_steps", "calc_waits", "calc_slo_sums", "calc_demand_slots"})

_TYPED_COLUMNS = ", ".join(f'"{f}"' for f in EVENT_FIELDS)  # quoted: `user` is a keyword in SQL
_RAW_VIEW_NAMES = {"journal": "journal_postings", "events": "event_log", "waits": "wait_postings",
                   "chip_states": "chip_state_changes", "grant_intervals": "grant_postings", **POLICY_RAW_VIEW_NAMES,
                   **COST_RAW_VIEW_NAMES}


def connect(lake: Path, database: str = ":memory:", *, slo: Optional[SloParams] = None,
            as_of: Optional[datetime] = None, materialize: Union[bool, Collection[str]] = False,
            config: Optional[dict[str, str]] = None, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with every lake view defined. Times are shown in UTC.

    `slo` sets the targets and thresholds the SLO views use (tables `slo_targets`, `slo_settings`; defaults
    when None); `as_of` is the instant error budgets and burn rates are evaluated at (default: the latest event
    applied). With `materialize`, the intermediate results several SLO views share are computed once from the
    Parquet files, into memory (`MATERIALIZED`): the connection costs more up front and each SLO view less
    (`chipledger report` queries them all). A collection of names materializes just those base tables and
    intermediates (what a caller reading a few views needs). `config`: DuckDB settings given when the database is
    opened, before anything is computed (`memory_limit` and `temp_directory`, for a lake whose intermediates outgrow
    the memory: DuckDB then spills them to that folder).

    The lake is checked first (analytics.commits.open_lake: a lake of another layout, or missing a table, raises a
    LakeLayoutError saying what to run), and the views read the files of its latest commit: a connection is a
    snapshot of one commit (connect again to see later ones). `read_only`: the tables are read through Arrow datasets
    over those files and DuckDB's external access is off and its configuration locked, so no statement can read or
    write a file (COPY … TO, read_csv, ATTACH, INSTALL are refused), the lake's own files included.

    Every view is an aggregation of the lake's rows and the fold's facts (`waits`, `free_chips`, `chip_states`,
    `grant_intervals`): nothing of the core's state is rebuilt in SQL, so no view needs a cache (docs/analytics.md,
    docs/benchmarks.md)."""
    snapshot = open_lake(lake)
    con = duckdb.connect(database, config=config or {})
    con.execute("SET enable_progress_bar = false")  # DuckDB would draw it in stdout, amid csv or json
    con.execute("SET TimeZone = 'UTC'")
    con.execute("SET parquet_metadata_cache = true")  # views over views bind the same files many times
    con.execute("SET preserve_insertion_order = false")
    for table in SCHEMAS:
        name = _RAW_VIEW_NAMES.get(table, table)
        files = snapshot.table_files(table)
        if files is None:
            sql = empty_view_sql(table)
        elif read_only:
            import pyarrow.dataset as pads

            con.register(f"_committed_{table}", pads.dataset(files, schema=SCHEMAS[table], format="parquet"))
            sql = f'SELECT * FROM "_committed_{table}"'
        else:
            # every committed file has every column (a file of an earlier layout is upgraded before a commit names it)
            sql = read_parquet_sql(files)
        if table == "events":
            # the table as stored (typed fields included) for the views; event_log without the typed fields
            con.execute(f'CREATE OR REPLACE VIEW "base_event_log" AS {sql}')
            sql = f"SELECT * EXCLUDE ({_TYPED_COLUMNS}) FROM base_event_log"
        con.execute(f'CREATE OR REPLACE VIEW "{name}" AS {sql}')
    for name, sql in DERIVED_VIEWS.items():
        con.execute(f'CREATE OR REPLACE VIEW "{name}" AS {sql}')
    targets, settings = settings_rows(slo or SloParams(), None if as_of is None else int(as_of.timestamp()))
    con.execute("CREATE OR REPLACE TABLE slo_targets (slo VARCHAR PRIMARY KEY, target DOUBLE NOT NULL)")
    con.executemany("INSERT INTO slo_targets VALUES (?, ?)", targets)
    con.execute("CREATE OR REPLACE TABLE slo_settings (sched_slo_s BIGINT NOT NULL, window_days BIGINT NOT NULL, "
                "as_of_s BIGINT)")
    con.execute("INSERT INTO slo_settings VALUES (?, ?, ?)", settings)
    base = duckdb_base_views()
    if materialize is True:
        tables = set(MATERIALIZED)
    else:
        tables = set(materialize or ())
    for name, sql in (*base.items(), *slo_views(DUCKDB).items()):
        kind = "TABLE" if name in tables else "VIEW"
        con.execute(f'CREATE OR REPLACE {kind} "{name}" AS {sql}')
    for name, sql in (*WAIT_VIEWS.items(), *POLICY_VIEWS.items(), *COST_VIEWS.items()):
        con.execute(f'CREATE OR REPLACE VIEW "{name}" AS {sql}')
    if read_only:
        # last: once off, DuckDB's file access cannot be turned on again, and the lock keeps every setting
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    return con


MEMORY_HINT = ("raise [lake] memory_limit, or set [lake] spill_dir to a folder with room to spill to: "
               "docs/analytics.md, \"A lake larger than the memory\"")


def duckdb_error_line(e: Exception) -> tuple[str, bool]:
    """A DuckDB error as one line, and whether DuckDB ran out of memory (its own exception, or a commit that could
    not allocate a block): then the line says what to set instead of DuckDB's own advice (SET …)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, duckdb.OutOfMemoryException) or "could not allocate" in str(e):
        return f"{first} ({MEMORY_HINT})", True
    return first, False


READ_ONLY_HINT = "pass --allow-files to let DuckDB read and write files beside the lake's views"


def refusal_line(e: Exception) -> Optional[str]:
    """The one line saying why a read-only connection (`connect(read_only=True)`) refused a statement, or None when
    `e` is not such a refusal: a file read or written (COPY … TO, read_csv, ATTACH, INSTALL, …), or a setting."""
    text = str(e)
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    if isinstance(e, duckdb.PermissionException) or "disabled by configuration" in text:
        return (f"refused: `chipledger sql` reads the lake's committed files and no other file, and writes none "
                f"({first}); {READ_ONLY_HINT}")
    if "configuration has been locked" in text:
        return f"refused: `chipledger sql` does not change DuckDB's settings ({first}); {READ_ONLY_HINT}"
    return None


def unreadable_file(e: Exception) -> bool:
    """Whether a read-only connection's error is a committed file Arrow could not read (damaged, truncated)."""
    return "registered as '_committed_" in str(e)


def view_names() -> list[str]:
    return sorted({*(_RAW_VIEW_NAMES.get(t, t) for t in SCHEMAS), "base_event_log", *DERIVED_VIEWS,
                   *duckdb_base_views(), *slo_views(DUCKDB), *WAIT_VIEWS, *POLICY_VIEWS, *COST_VIEWS})
