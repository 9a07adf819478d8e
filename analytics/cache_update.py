"""Bringing the analytics cache up to date with the files added to the lake since it was written.

The cache (analytics/views.py) keeps the tables that follow from the lake's files alone. A lake grows by new files:
the embedded run and the sink add Parquet files and never change one. So when the lake's files are a cache's files
plus some, the cache is copied and brought up to date from the added files alone, instead of computed again from
every file:

- per-row tables take the added rows (`base_placements`, `base_events`, numbered on from the cache's last),
  per-key sums are merged by key (`base_runs`, `base_journal`), and the jobs the added events touch are derived
  again from their last submission in the cache;
- the running sums (`calc_wait_levels`, `calc_fragmentation`) are computed again from a frontier per pool: the
  earliest instant any added row changes anything (a run's start, a run's end, a grant's or a chip's interval, the
  pool's last event before). Everything before it is the same as in the cache; the deltas before it are summed
  into one row, and the sums go on from there;
- the small tables (`base_pool_end`, `calc_chip_segments`) are computed again whole.

The result is the cache the whole computation writes, row for row (tests/test_analytics_cache_update.py checks
every cached table and every view, with the added files split at every day and inside days). When that cannot be
guaranteed the whole computation runs instead: a cache file changed or gone, events added that come before the
cache's last event of their pool (in the views' order: applied_at, topic, partition, offset), a chip moved to
another node or registered after the cache had it in use, two submissions of a job id in one second among the jobs
the added files touch, added rows without their key.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Optional

import duckdb

from analytics.lake import CACHE_DIR, TABLES, empty_view_sql, read_parquet_sql
from analytics.slo_views import (BEFORE_ALL_S, DUCKDB, duckdb_base_views, fragmentation_sql, job_run_totals_sql,
                                 journal_sql, run_nodes_sql, slo_views, wait_levels_sql, wait_spans_sql)

#: the cache's own tables besides the cached ones: the files it was computed from, and each pool's last event
FILES_TABLE = "cache_files"
FRONTIER_TABLE = "cache_frontier"
#: the row a reader takes a cache file as whole by (written last)
META_TABLE = "cache_meta"
#: a DuckDB file: its three header blocks, then total_blocks blocks of block_size
DUCKDB_HEADERS = 3 * 4096

Files = dict[str, tuple[int, int]]  # a lake's Parquet files: path relative to the lake -> (size, mtime_ns)


class NotIncremental(Exception):
    """The added files cannot be folded into the cache exactly; the tables are computed from every file."""


def lake_files(lake: Path) -> Files:
    """Every Parquet file of the lake's tables, with its size and modification time."""
    lake = Path(lake)
    out: Files = {}
    for table in TABLES:
        folder = lake / table
        if folder.exists():
            for p in sorted(folder.rglob("*.parquet")):
                st = p.stat()
                out[str(p.relative_to(lake))] = (st.st_size, st.st_mtime_ns)
    return out


def lake_files_unchanged(lake: Path, files: Files) -> bool:
    """True if each of these files is still there with the same size and modification time."""
    for p, sm in files.items():
        try:
            st = os.stat(Path(lake) / p)
        except OSError:
            return False
        if (st.st_size, st.st_mtime_ns) != sm:
            return False
    return True


def _event_key() -> str:
    """An event's place in the views' order (applied_at, topic, partition, offset) as one comparable value."""
    return """{'at_s': at_s, 'topic': topic, 'partition': "partition", 'offset': "offset"}"""


def frontier_sql(event_rows: str, first: bool = False) -> str:
    """Each pool's last event in the views' order as `k` (and with `first` its first as `k_first`); null when some
    event lacks a part of its place: such a pool is never updated, only computed whole."""
    whole = 'count(*) FILTER (WHERE at_s IS NULL OR topic IS NULL OR "partition" IS NULL OR "offset" IS NULL) = 0'
    k_first = f", CASE WHEN {whole} THEN min({_event_key()}) END AS k_first" if first else ""
    return f"""
        SELECT pool, CASE WHEN {whole} THEN max({_event_key()}) END AS k{k_first}
        FROM {event_rows} GROUP BY pool
    """


def parquet_source(lake: Path, table: str, paths: list[str]) -> str:
    """A query over exactly these files of a table (or none: no rows, the table's columns)."""
    return read_parquet_sql([Path(lake) / p for p in paths]) if paths else empty_view_sql(table)


def files_of(files: Files, table: str) -> list[str]:
    return sorted(p for p in files if Path(p).parts[0] == table)


def write_meta(con: duckdb.DuckDBPyConnection, schema: str, lake: Path, files: Files) -> None:
    """The cache's list of files and each pool's last event, in `schema` (the cache file being written)."""
    con.execute(f'CREATE OR REPLACE TABLE {schema}."{FILES_TABLE}" (path VARCHAR, size BIGINT, mtime_ns BIGINT)')
    insert_files(con, f'{schema}."{FILES_TABLE}"', files)
    rows = duckdb_base_views(event_log=f"({parquet_source(lake, 'events', files_of(files, 'events'))})")
    con.execute(f'CREATE OR REPLACE TABLE {schema}."{FRONTIER_TABLE}" AS '
                f'{frontier_sql("(" + rows["base_event_rows"] + ")")}')


def insert_files(con: duckdb.DuckDBPyConnection, table: str, files: Files) -> None:
    """The list of files as rows of `table` (one statement: a row each costs a millisecond)."""
    paths = sorted(files)
    con.execute(f"INSERT INTO {table} SELECT unnest($1), unnest($2), unnest($3)",
                [paths, [files[p][0] for p in paths], [files[p][1] for p in paths]])


def base_candidates(lake: Path, target: Path) -> list[Path]:
    """Cache files of the lake other than `target`, the newest first."""
    folder = Path(lake) / CACHE_DIR
    try:
        found = [(p.stat().st_mtime_ns, p) for p in folder.glob("analytics-*.duckdb") if p != target]
    except OSError:
        return []
    return [p for _, p in sorted(found, reverse=True)]


def added_files(con: duckdb.DuckDBPyConnection, schema: str, files: Files) -> Optional[Files]:
    """The files added since the cache attached as `schema` was written, or None if any of its files changed or
    went."""
    old = {p: (s, m) for p, s, m in con.execute(f'SELECT path, size, mtime_ns FROM {schema}."{FILES_TABLE}"').fetchall()}
    if any(files.get(p) != sm for p, sm in old.items()):
        return None
    return {p: sm for p, sm in files.items() if p not in old}


def update(base: Path, tmp: Path, lake: Path, files: Files, added: Files, key: str) -> None:
    """Copy the cache `base` to `tmp` and bring it up to date with the `added` files (whose whole lake is `files`,
    its key `key`). Raises NotIncremental when that cannot be done exactly (tmp is then the caller's to remove)."""
    shutil.copyfile(base, tmp)
    with duckdb.connect(str(tmp)) as u:
        u.execute("SET enable_progress_bar = false")
        u.execute("SET TimeZone = 'UTC'")
        u.execute("SET preserve_insertion_order = false")
        _views(u, lake, added)
        _apply(u)
        u.execute(f'UPDATE "{META_TABLE}" SET cache_key = ?, written_at = now()', [key])
        u.execute(f'DELETE FROM "{FILES_TABLE}"')
        insert_files(u, f'"{FILES_TABLE}"', files)
        u.execute(f"""
            CREATE TEMP TABLE inc_frontier AS
            SELECT pool, CASE WHEN bool_and(k IS NOT NULL) THEN max(k) END AS k
            FROM (SELECT pool, k FROM "{FRONTIER_TABLE}" UNION ALL SELECT pool, k FROM inc_added_frontier) y
            GROUP BY pool""")
        u.execute(f'DELETE FROM "{FRONTIER_TABLE}"')
        u.execute(f'INSERT INTO "{FRONTIER_TABLE}" SELECT * FROM inc_frontier')
        u.execute("CHECKPOINT")
    with duckdb.connect() as check:
        check.execute(f"ATTACH '{str(tmp).replace(chr(39), chr(39) * 2)}' AS written (READ_ONLY)")
        block_size, blocks = check.execute("SELECT block_size, total_blocks FROM pragma_database_size() "
                                           "WHERE database_name = 'written'").fetchone()
    # DuckDB cuts free blocks off the end of a file it changed but still counts them: the file is given back the
    # length its header says (the free blocks, never read), so that a reader tells a file cut short by its length
    if tmp.stat().st_size < DUCKDB_HEADERS + block_size * blocks:
        os.truncate(tmp, DUCKDB_HEADERS + block_size * blocks)


def _views(u: duckdb.DuckDBPyConnection, lake: Path, added: Files) -> None:
    """Temporary views over the added files (`add_*`) and the cache's own views the update reads."""
    for table, name in (("events", "add_event_log"), ("job_runs", "add_job_runs"), ("journal", "add_postings")):
        u.execute(f"CREATE TEMP VIEW {name} AS {parquet_source(lake, table, files_of(added, table))}")
    u.execute(f"CREATE TEMP VIEW add_run_totals AS {job_run_totals_sql('add_job_runs')}")
    u.execute(f"CREATE TEMP VIEW add_journal AS {journal_sql('add_postings')}")
    add = duckdb_base_views(run_totals="add_run_totals", event_log="add_event_log", event_rows="add_event_rows",
                            journal="add_journal")
    for name, as_name in (("base_event_rows", "add_event_rows"), ("base_runs", "add_runs"),
                          ("base_placements", "add_placements"), ("base_journal", "add_journal_rows")):
        u.execute(f'CREATE TEMP VIEW "{as_name}" AS {add[name]}')
    calc = slo_views(DUCKDB)
    for name in ("calc_pool_end", "calc_grants", "calc_wait_spans", "calc_chip_node"):
        u.execute(f'CREATE TEMP VIEW "{name}" AS {calc[name]}')


def _count(u: duckdb.DuckDBPyConnection, sql: str) -> int:
    return u.execute(f"SELECT count(*) FROM ({sql}) x").fetchone()[0]


def _apply(u: duckdb.DuckDBPyConnection) -> None:
    x = u.execute
    calc = slo_views(DUCKDB)

    # the added events must come after every event of their pool in the cache, in the views' order
    x(f"CREATE TEMP TABLE inc_added_frontier AS {frontier_sql('add_event_rows', first=True)}")
    if _count(u, f"""
            SELECT 1 FROM inc_added_frontier n LEFT JOIN "{FRONTIER_TABLE}" f ON f.pool = n.pool
            WHERE n.pool IS NULL OR n.k IS NULL OR (f.pool IS NOT NULL AND NOT coalesce(n.k_first > f.k, false))"""):
        raise NotIncremental("events added before the cache's last event of their pool")
    if _count(u, """SELECT 1 FROM add_job_runs
                    WHERE pool IS NULL OR job_id IS NULL OR submitted_at IS NULL OR run_index IS NULL
                    UNION ALL SELECT 1 FROM add_postings WHERE pool IS NULL OR hour IS NULL"""):
        raise NotIncremental("rows without their key added (runs: pool, job, submission, run; journal: pool, hour)")

    # the cache's small tables as they were (to tell what changed)
    x("CREATE TEMP TABLE old_pool_end AS SELECT * FROM base_pool_end")
    x(f"CREATE TEMP TABLE old_grants AS {calc['calc_grants']}")
    x("CREATE TEMP TABLE old_segments AS SELECT * FROM calc_chip_segments")
    x(f"CREATE TEMP TABLE old_chip_node AS {calc['calc_chip_node']}")

    # each pool's clock; the pools' own events, numbered on from the cache's last
    x("""CREATE TEMP TABLE inc_pool_end AS
         SELECT pool, max(end_s) AS end_s FROM (SELECT pool, end_s FROM base_pool_end
                                                UNION ALL SELECT pool, max(at_s) FROM add_event_rows GROUP BY pool) y
         GROUP BY pool""")
    x("DELETE FROM base_pool_end")
    x("INSERT INTO base_pool_end SELECT * FROM inc_pool_end")
    x("""INSERT INTO base_events
         SELECT n.pool, n.type, n.at_s, coalesce(m.last_seq, 0) + n.rn, n.chip_id, n.node, n.state, n.grant_id, n.team,
                n.chips_milli, n.effective_from_s, n.effective_until_s
         FROM (SELECT *, row_number() OVER (PARTITION BY pool ORDER BY at_s, topic, "partition", "offset") AS rn
               FROM add_event_rows WHERE type NOT LIKE 'job.%') n
         LEFT JOIN (SELECT pool, max(seq) AS last_seq FROM base_events GROUP BY pool) m ON m.pool = n.pool""")
    if _count(u, f"""SELECT 1 FROM old_chip_node o JOIN ({calc['calc_chip_node']}) n ON n.pool = o.pool
                     AND n.chip_id = o.chip_id WHERE n.node IS DISTINCT FROM o.node"""):
        raise NotIncremental("a chip registered again on another node")
    # a chip first registered now that the cache already placed runs on, or gave states to (the ledger refuses both)
    if _count(u, f"""
            WITH n AS (SELECT n.pool, n.chip_id FROM ({calc['calc_chip_node']}) n
                       ANTI JOIN old_chip_node o ON o.pool = n.pool AND o.chip_id = n.chip_id)
            SELECT 1 FROM n JOIN base_placements p ON p.pool = n.pool AND p.chip_id = n.chip_id
            UNION ALL SELECT 1 FROM n JOIN old_segments s ON s.pool = n.pool AND s.chip_id = n.chip_id"""):
        raise NotIncremental("a chip registered after the cache had it in use")

    # the journal: the hours the added postings fall in are summed again
    x("CREATE TEMP TABLE inc_hours AS SELECT DISTINCT pool, hour_s FROM add_journal_rows")
    x("""CREATE TEMP TABLE inc_journal AS
         SELECT pool, hour_s, account, team, sum(amount_mchip_s)::BIGINT AS amount_mchip_s FROM (
             SELECT o.pool, o.hour_s, o.account, o.team, o.amount_mchip_s
             FROM base_journal o JOIN inc_hours h ON h.pool = o.pool AND h.hour_s = o.hour_s
             UNION ALL SELECT pool, hour_s, account, team, amount_mchip_s FROM add_journal_rows) y
         GROUP BY pool, hour_s, account, team""")
    x("DELETE FROM base_journal o USING inc_hours h WHERE h.pool = o.pool AND h.hour_s = o.hour_s")
    x("INSERT INTO base_journal SELECT * FROM inc_journal")

    # runs: the added postings' sums merged into the cache's by run
    run_key = "{a}.pool = {b}.pool AND {a}.job_id = {b}.job_id AND {a}.submitted_s = {b}.submitted_s " \
              "AND {a}.run_index = {b}.run_index"
    x(f"""CREATE TEMP TABLE inc_runs AS
          SELECT n.pool, n.job_id, greatest(o.team, n.team) AS team, n.run_index,
                 greatest(o.chips_milli, n.chips_milli) AS chips_milli, greatest(o.priority, n.priority) AS priority,
                 n.submitted_s, least(o.started_s, n.started_s) AS started_s,
                 greatest(o.ended_s, n.ended_s) AS ended_s, greatest(o.end_reason, n.end_reason) AS end_reason,
                 (coalesce(o.allocated_mchip_s, 0) + n.allocated_mchip_s)::BIGINT AS allocated_mchip_s,
                 (coalesce(o.lost_mchip_s, 0) + n.lost_mchip_s)::BIGINT AS lost_mchip_s,
                 o.pool IS NULL AS is_new, o.started_s AS old_started_s, o.ended_s AS old_ended_s
          FROM add_runs n LEFT JOIN base_runs o ON {run_key.format(a='o', b='n')}""")
    x(f"DELETE FROM base_runs o USING inc_runs n WHERE {run_key.format(a='o', b='n')}")
    x("""INSERT INTO base_runs SELECT pool, job_id, team, run_index, chips_milli, priority, submitted_s, started_s,
                                      ended_s, end_reason, allocated_mchip_s, lost_mchip_s FROM inc_runs""")
    x("INSERT INTO base_placements SELECT * FROM add_placements")

    # jobs: every submission of a job id the added events or first runs touch, derived again
    x("""CREATE TEMP TABLE inc_sf AS
         SELECT pool, job_id, type, at_s, team, chips_milli, priority,
                lead(type) OVER w AS next_type, lead(at_s) OVER w AS next_s, row_number() OVER w AS rn
         FROM add_event_rows WHERE type IN ('job.submitted', 'job.finished')
         WINDOW w AS (PARTITION BY pool, job_id ORDER BY at_s, topic, "partition", "offset")""")
    x("""CREATE TEMP TABLE inc_job_ids AS
         SELECT DISTINCT pool, job_id FROM inc_sf UNION SELECT pool, job_id FROM inc_runs WHERE run_index = 1""")
    x("""CREATE TEMP TABLE inc_jobs_old AS
         SELECT o.* FROM base_jobs o JOIN inc_job_ids k ON k.pool = o.pool AND k.job_id = o.job_id""")
    first_run = ("LEFT JOIN base_runs r ON r.run_index = 1 AND r.pool = {j}.pool AND r.job_id = {j}.job_id "
                 "AND r.submitted_s = {s}")
    x(f"""CREATE TEMP TABLE inc_jobs AS
          WITH last AS (SELECT pool, job_id, max(submitted_s) AS last_s FROM inc_jobs_old GROUP BY pool, job_id)
          SELECT o.pool, o.job_id, o.team, o.chips_milli, o.priority, o.submitted_s,
                 coalesce(o.first_started_s, r.started_s) AS first_started_s,
                 CASE WHEN o.finished_s IS NULL AND o.submitted_s = l.last_s AND f.type = 'job.finished' THEN f.at_s
                      ELSE o.finished_s END AS finished_s
          FROM inc_jobs_old o JOIN last l ON l.pool = o.pool AND l.job_id = o.job_id
          LEFT JOIN inc_sf f ON f.rn = 1 AND f.pool = o.pool AND f.job_id = o.job_id
          {first_run.format(j='o', s='o.submitted_s')}
          UNION ALL
          SELECT s.pool, s.job_id, s.team, s.chips_milli, coalesce(s.priority, 0), s.at_s, r.started_s,
                 CASE WHEN s.next_type = 'job.finished' THEN s.next_s END
          FROM inc_sf s {first_run.format(j='s', s='s.at_s')}
          WHERE s.type = 'job.submitted'""")
    # a job id submitted twice in one second: which submission a start or a finish belongs to is the order of
    # events the cache no longer has (and the waits of such submissions are not told apart by their key)
    if _count(u, "SELECT 1 FROM inc_jobs GROUP BY pool, job_id, submitted_s HAVING count(*) > 1"):
        raise NotIncremental("a job submitted twice in one second")
    x("DELETE FROM base_jobs o USING inc_job_ids k WHERE k.pool = o.pool AND k.job_id = o.job_id")
    x("INSERT INTO base_jobs SELECT * FROM inc_jobs")

    # chips' intervals: small, computed again whole
    x("DELETE FROM calc_chip_segments")
    x(f"INSERT INTO calc_chip_segments {calc['calc_chip_segments']}")

    # a run's chips per node: the runs the added postings or placements touch, derived again
    rn_key = "{a}.pool = {b}.pool AND {a}.job_id = {b}.job_id AND {a}.started_s = {b}.started_s"
    x("""CREATE TEMP TABLE inc_rn_keys AS
         SELECT DISTINCT pool, job_id, started_s FROM inc_runs
         UNION SELECT DISTINCT pool, job_id, started_s FROM add_placements""")
    x(f"""CREATE TEMP TABLE inc_old_rn AS
          SELECT o.* FROM calc_run_nodes o JOIN inc_rn_keys k ON {rn_key.format(a='k', b='o')}""")
    x(f"""CREATE TEMP VIEW inc_placements AS
          SELECT p.* FROM base_placements p JOIN inc_rn_keys k ON {rn_key.format(a='k', b='p')}""")
    x(f"CREATE TEMP TABLE inc_rn AS {run_nodes_sql('inc_placements')}")
    x(f"DELETE FROM calc_run_nodes o USING inc_rn_keys k WHERE {rn_key.format(a='k', b='o')}")
    x("INSERT INTO calc_run_nodes SELECT * FROM inc_rn")

    # each pool's frontier: the earliest instant anything added changes (no earlier than its last event before)
    x(f"""CREATE TEMP TABLE inc_t AS
          WITH pools AS (SELECT pool FROM base_pool_end UNION SELECT DISTINCT pool FROM base_runs),
          changed AS (
              SELECT pool, end_s AS t FROM old_pool_end
              UNION ALL
              SELECT pool, CASE WHEN is_new OR old_started_s IS DISTINCT FROM started_s THEN started_s
                                WHEN old_ended_s IS DISTINCT FROM ended_s THEN least(old_ended_s, ended_s) END
              FROM inc_runs
              UNION ALL {_changed_at('old_grants', calc['calc_grants'], 'grant_id, team, chips_milli, from_s')}
              UNION ALL {_changed_at('old_segments', 'SELECT * FROM calc_chip_segments',
                                     'chip_id, from_s, registered, usable')}
              UNION ALL {_changed_at('inc_old_rn', 'SELECT * FROM inc_rn', 'node, job_id, started_s, chips',
                                     ends='ended_s')}
          )
          SELECT p.pool, CASE WHEN o.pool IS NULL THEN {BEFORE_ALL_S} ELSE min(c.t) END AS t
          FROM pools p LEFT JOIN old_pool_end o ON o.pool = p.pool LEFT JOIN changed c ON c.pool = p.pool
          WHERE p.pool IS NOT NULL
          GROUP BY p.pool, o.pool""")
    tail_from = u.execute("SELECT min(t) FROM inc_t").fetchone()[0]
    if tail_from is None:  # an empty lake
        return

    # scheduling waits: those at or after the frontier computed again; the ones before keep their levels, and those
    # of the jobs touched take their start and end again
    wait_key = "{a}.pool = {b}.pool AND {a}.job_id = {b}.job_id AND {a}.submitted_s = {b}.submitted_s"
    x("DELETE FROM calc_wait_levels w USING inc_t i WHERE w.pool = i.pool AND w.since_s >= i.t")
    x("""CREATE TEMP TABLE inc_aj AS SELECT DISTINCT pool, job_id, submitted_s FROM inc_jobs
         UNION SELECT DISTINCT pool, job_id, submitted_s FROM inc_runs""")
    x(f"CREATE TEMP TABLE inc_aj_jobs AS SELECT j.* FROM base_jobs j JOIN inc_aj k ON {wait_key.format(a='k', b='j')}")
    if _count(u, "SELECT 1 FROM inc_aj_jobs GROUP BY pool, job_id, submitted_s HAVING count(*) > 1"):
        raise NotIncremental("a job submitted twice in one second")  # its waits are not told apart by their key
    x(f"CREATE TEMP TABLE inc_aj_runs AS SELECT r.* FROM base_runs r JOIN inc_aj k ON {wait_key.format(a='k', b='r')}")
    x(f"""CREATE TEMP TABLE inc_refresh AS
          SELECT w.pool, w.job_id, w.team, w.chips_milli, w.priority, w.submitted_s, w.kind, w.after_run, w.since_s,
                 s.started_s, s.abandoned_s, w.nominal_milli, w.running_milli, w.in_quota, s.started_s - w.since_s
          FROM calc_wait_levels w JOIN ({wait_spans_sql('inc_aj_jobs', 'inc_aj_runs')}) s
               ON {wait_key.format(a='s', b='w')} AND s.after_run = w.after_run""")
    x(f"DELETE FROM calc_wait_levels w USING inc_aj k WHERE {wait_key.format(a='k', b='w')}")
    x("INSERT INTO calc_wait_levels SELECT * FROM inc_refresh")
    x(f"INSERT INTO calc_wait_levels {wait_levels_sql(tail_from=tail_from)}")

    # fragmentation: the steps at or after the frontier computed again from the nodes' sums before it; the step
    # before it ends where the next begins
    x("""CREATE TEMP TABLE inc_unplaced AS
         SELECT i.pool, coalesce(arg_max(f.unplaced_runs, f.from_s), 0) AS unplaced_runs
         FROM inc_t i LEFT JOIN calc_fragmentation f ON f.pool = i.pool AND f.from_s < i.t GROUP BY i.pool""")
    x("DELETE FROM calc_fragmentation f USING inc_t i WHERE f.pool = i.pool AND f.from_s >= i.t")
    x(f"CREATE TEMP TABLE inc_frag AS {fragmentation_sql(DUCKDB, tail=True)}")
    # the step before the frontier ends where the one summed at BEFORE_ALL_S ends: at the next step (even one
    # starting at or after the pool's end, which has no row of its own), or at the pool's end
    x(f"""UPDATE calc_fragmentation f SET until_s = n.until_s
          FROM (SELECT pool, max(from_s) AS last_s FROM calc_fragmentation GROUP BY pool) l
          JOIN inc_frag n ON n.pool = l.pool AND n.from_s = {BEFORE_ALL_S}
          WHERE f.pool = l.pool AND f.from_s = l.last_s""")
    x(f"INSERT INTO calc_fragmentation SELECT * FROM inc_frag WHERE from_s > {BEFORE_ALL_S}")


def _changed_at(old: str, new: str, same: str, ends: str = "until_s") -> str:
    """The instants at which rows of a small table changed, per pool: a row whose only change is its end changed at
    the earlier of its two ends; any other row at its start (`from_s`, or `started_s`)."""
    start = "started_s" if "started_s" in same else "from_s"
    return f"""
        SELECT pool, CASE WHEN count(*) = 2 AND sum(side) = 3 THEN min({ends}) ELSE min({start}) END
        FROM (SELECT 1 AS side, * FROM (SELECT * FROM {old} EXCEPT ALL SELECT * FROM ({new}) n1) a
              UNION ALL BY NAME
              SELECT 2 AS side, * FROM (SELECT * FROM ({new}) n2 EXCEPT ALL SELECT * FROM {old}) b) d
        GROUP BY pool, {same}"""


def tmp_beside(path: Path) -> Path:
    return path.with_name(f"{path.stem}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
