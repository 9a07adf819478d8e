"""DuckDB views over the lake, with stable names and documented columns (see docs/analytics.md).

`connect(lake)` opens an in-memory DuckDB database whose views read the lake's Parquet files. A table with no
files yet is an empty view of the same columns, so queries work on a fresh lake.
"""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Collection, Optional, Union

import duckdb

from analytics.cache_update import DUCKDB_HEADERS as _DUCKDB_HEADERS, META_TABLE as _META
from analytics.cache_update import (FILES_TABLE, FRONTIER_TABLE, Files, NotIncremental, added_files, base_candidates,
                                    lake_files, lake_files_unchanged, tmp_beside, update, write_meta)
from analytics.lake import (CACHE_DIR, EVENT_FIELDS, SCHEMAS, TABLES, check_events_files, empty_view_sql,
                           read_parquet_sql, table_files)
from analytics.policy_views import POLICY_RAW_VIEW_NAMES, POLICY_VIEWS
from analytics.slo_views import (DUCKDB, SloParams, duckdb_base_views, job_run_totals_sql, journal_sql,
                                 settings_rows, slo_views)


# Views derived from the raw tables. Amounts stay integer milli-chip-seconds; `*_chip_h` columns are for people.
DERIVED_VIEWS = {
    # every applied event, with the typed fields of its type (written by the lake writer from the parsed event)
    "events": """
        SELECT event_id, type, pool, source, occurred_at, applied_at, lateness_s, team, job_id, chip_id, grant_id,
               request_id, chips_milli, priority, preemptible, state, outcome, topic, "partition", "offset", body
        FROM base_event_log
    """,
    # the books: postings summed per (pool, hour, account, team)
    "journal": journal_sql(),
    # a fact of the fold: each wait of a job to be started, its last posting (a wait still open at a close of the
    # books is posted with end 'open' and superseded by the posting of its end)
    "waits": """
        SELECT * FROM wait_postings
        QUALIFY row_number() OVER (PARTITION BY pool, job_id, submitted_at, run_index
                                   ORDER BY ("end" <> 'open') DESC, posted_at DESC) = 1
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
            SELECT pool, job_id, submission, team, chips_milli, priority, preemptible,
                   applied_at AS submitted_at
            FROM e WHERE type = 'job.submitted'
        ), ev AS (
            SELECT pool, job_id, submission,
                   min(applied_at) FILTER (WHERE type = 'job.started') AS first_started_at,
                   max(applied_at) FILTER (WHERE type = 'job.finished') AS finished_at,
                   arg_max(outcome, applied_at) FILTER (WHERE type = 'job.finished') AS outcome,
                   count(*) FILTER (WHERE type = 'job.preempted') AS preemptions
            FROM e GROUP BY pool, job_id, submission
        ), runs AS (
            SELECT pool, job_id, submitted_at, sum(allocated_mchip_s)::BIGINT AS allocated_mchip_s,
                   sum(lost_mchip_s)::BIGINT AS lost_mchip_s
            FROM job_runs GROUP BY pool, job_id, submitted_at
        )
        SELECT sub.job_id, sub.pool, sub.team, sub.chips_milli / 1000.0 AS chips, sub.chips_milli,
               coalesce(sub.priority, 0) AS priority, coalesce(sub.preemptible, true) AS preemptible,
               sub.submitted_at, ev.first_started_at, ev.finished_at, ev.outcome,
               coalesce(ev.preemptions, 0)::BIGINT AS preemptions,
               coalesce(runs.allocated_mchip_s, 0)::BIGINT AS allocated_mchip_s,
               coalesce(runs.lost_mchip_s, 0)::BIGINT AS lost_mchip_s
        FROM sub LEFT JOIN ev USING (pool, job_id, submission)
                 LEFT JOIN runs ON runs.pool = sub.pool AND runs.job_id = sub.job_id
                               AND runs.submitted_at = sub.submitted_at
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
    # runs (a job that never ran has nothing allocated: no goodput)
    "goodput": """
        SELECT CASE WHEN GROUPING(team) = 1 THEN 'pool' WHEN GROUPING(job_id) = 1 THEN 'team' ELSE 'job' END
                   AS level,
               pool, team, job_id,
               sum(allocated_mchip_s)::BIGINT AS allocated_mchip_s, sum(lost_mchip_s)::BIGINT AS lost_mchip_s,
               (sum(allocated_mchip_s) - sum(lost_mchip_s)) / nullif(sum(allocated_mchip_s), 0) AS goodput
        FROM job_runs
        GROUP BY GROUPING SETS ((pool), (pool, team), (pool, team, job_id, submitted_at))
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


# the intermediate SLO results that several views read: tables, computed once, when `connect(materialize=True)`.
# The ones that depend on the settings (calc_waits, calc_sli_points, calc_slo_window: cheap over these) stay views,
# which measured faster than tables for the report views and `chipledger report` alike (docs/benchmarks.md)
MATERIALIZED_CALC = frozenset({"calc_wait_levels", "calc_chip_segments", "calc_run_nodes", "calc_fragmentation"})

# base tables left as views even with `materialize=True`: every event's row is cheaper to read again from Parquet
# (a few columns, filtered by type) by the few base tables that need it than to copy into memory
LAZY_BASE = frozenset({"base_event_rows"})

# the materialized tables whose rows follow from the lake's files alone (not from the [slo] settings or the
# instant evaluated at): what the analytics cache keeps between connections (tests/test_analytics_cache.py checks
# that none of them reads the settings)
CACHED = frozenset((set(duckdb_base_views()) - LAZY_BASE) | MATERIALIZED_CALC)
CACHE_FORMAT = 2

_RAW_VIEW_NAMES = {"journal": "journal_postings", "events": "event_log", "waits": "wait_postings",
                   **POLICY_RAW_VIEW_NAMES}


def connect(lake: Path, database: str = ":memory:", *, slo: Optional[SloParams] = None,
            as_of: Optional[datetime] = None, materialize: Union[bool, Collection[str]] = False,
            cache: bool = True) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with every lake view defined. Times are shown in UTC.

    `slo` sets the targets and thresholds the SLO views use (tables `slo_targets`, `slo_settings`; defaults
    when None); `as_of` is the instant error budgets and burn rates are evaluated at (default: the latest event
    applied). With `materialize`, the base tables of the SLO views are read from the Parquet files once, into
    memory, and the intermediate results several SLO views share are computed once (`MATERIALIZED_CALC`): the
    connection costs more up front and each SLO view less (`chipledger report` queries them all). A collection of
    names materializes just those base tables and intermediates (what a caller reading a few views needs).

    With `cache` (the default), the tables of `CACHED` (the materialized ones that depend on the lake's files
    alone, not on the settings) are kept in a DuckDB file in the lake, `_cache/analytics-KEY.duckdb`, KEY a digest
    of every Parquet file's path, size and modification time, of the views' SQL and of DuckDB's version. A
    connection that finds the file for the lake as it is now reads those tables from it instead of computing
    them; a `materialize=True` connection that does not computes them and writes the file, if the lake's files
    did not change meanwhile (a lake it cannot write to is just not cached). A file added, removed, or rewritten
    (new size or modification time, as any writer leaves) makes a new key, so the cache is not read for a lake
    that changed; a file cut short, without its meta row or with an uncheckpointed `.wal` beside it is not
    read, and the tables are computed again (a file damaged inside makes queries fail with DuckDB's checksum
    error: deleting `_cache` is always safe). The views that depend on the settings are
    computed by each query. The cached tables are a snapshot: a connection kept open while the lake grows
    answers them as of its opening, while the raw views (`events`, `journal`, ...) read the files as they are."""
    con = duckdb.connect(database)
    con.execute("SET enable_progress_bar = false")  # DuckDB would draw it in stdout, amid csv or json
    con.execute("SET TimeZone = 'UTC'")
    con.execute("SET parquet_metadata_cache = true")  # views over views bind the same files many times
    con.execute("SET preserve_insertion_order = false")
    for table in SCHEMAS:
        name = _RAW_VIEW_NAMES.get(table, table)
        glob = table_files(lake, table)
        if glob is None:
            sql = empty_view_sql(table)
        else:
            if table == "events":
                check_events_files(lake)
            sql = read_parquet_sql(glob)
        if table == "events":
            # the table as stored (typed fields included) for the views; event_log without the typed fields
            con.execute(f'CREATE OR REPLACE VIEW "base_event_log" AS {sql}')
            sql = f'SELECT * EXCLUDE ({", ".join(EVENT_FIELDS)}) FROM base_event_log'
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
        tables = (set(base) - LAZY_BASE) | MATERIALIZED_CALC
    else:
        tables = set(materialize or ())
    files = lake_files(lake) if cache else None
    cache_file = _cache_file(lake, files) if files else None
    cached = CACHED if cache_file is not None and _attach_cache(con, cache_file) else frozenset()
    if cache_file is not None and not cached and _update_cache(lake, files, cache_file):
        cached = CACHED if _attach_cache(con, cache_file) else frozenset()
        _clean_beside(cache_file)  # once attached: another connection's clean-up cannot take it from this one
    for name, sql in (*base.items(), *slo_views(DUCKDB).items()):
        if name in cached:  # read from the cache even when not asked to materialize: no cheaper way
            con.execute(f'CREATE OR REPLACE VIEW "{name}" AS SELECT * FROM lake_cache."{name}"')
            continue
        kind = "TABLE" if name in tables else "VIEW"
        con.execute(f'CREATE OR REPLACE {kind} "{name}" AS {sql}')
    for name, sql in POLICY_VIEWS.items():
        con.execute(f'CREATE OR REPLACE VIEW "{name}" AS {sql}')
    # written only if the lake's files are still the ones the key was taken from (a live writer's lake is not
    # cached under a key its rows do not match)
    if cache_file is not None and not cached and CACHED <= tables and cache_path(lake) == cache_file:
        _write_cache(con, cache_file, lake, files)
    return con


def _quote(path: Path) -> str:
    return str(path).replace("'", "''")


def cache_path(lake: Path) -> Optional[Path]:
    """The analytics cache file for the lake as its files are now, or None for a lake with no files."""
    files = lake_files(lake)
    return _cache_file(lake, files) if files else None


def _code_key() -> str:
    """A digest of what the cached tables' rows follow from besides the files: the views' SQL, the raw views'
    template and columns, the cached names, the cache's format and DuckDB's version."""
    h = hashlib.sha256(f"chipledger analytics cache {CACHE_FORMAT} duckdb {duckdb.__version__}\n".encode())
    h.update(f"cached {sorted(CACHED)}\nlazy {sorted(LAZY_BASE)}\nraw {read_parquet_sql('GLOB')}\n".encode())
    for name, sql in sorted({**DERIVED_VIEWS, **duckdb_base_views(), **slo_views(DUCKDB)}.items()):
        h.update(f"{name}\n{sql}\n".encode())
    for table in TABLES:
        h.update(f"{table} {SCHEMAS[table]}\n{empty_view_sql(table)}\n".encode())
    return h.hexdigest()


def _cache_file(lake: Path, files: Files) -> Path:
    h = hashlib.sha256(_code_key().encode())
    for p, (size, mtime_ns) in sorted(files.items()):
        h.update(f"{p} {size} {mtime_ns}\n".encode())
    return Path(lake) / CACHE_DIR / f"analytics-{h.hexdigest()[:24]}.duckdb"


def _key(path: Path) -> str:
    return path.stem.removeprefix("analytics-")


def _attach_cache(con: duckdb.DuckDBPyConnection, path: Path, key: Optional[str] = None) -> bool:
    """Attach the cache file as `lake_cache` if it is a whole cache for `key` (default: the one its name
    carries): as long as DuckDB's blocks say, every CACHED table and the meta row written last, and no
    uncheckpointed change beside it (`.wal`: someone opened it read-write). A file cut short, another version's
    or a stranger's is detached and computed again; so is one swapped for another while it was checked. Never
    raises (an unreadable `_cache` folder is just no cache)."""
    if os.path.lexists(f"{path}.wal"):
        return False
    try:
        before = _identity(path)
    except OSError:  # missing, or a folder it may not search
        return False
    size = before[2]
    try:
        con.execute(f"ATTACH '{_quote(path)}' AS lake_cache (READ_ONLY)")
    except duckdb.Error:  # not a DuckDB file this version reads
        return False
    try:
        # a file cut short (a copy stopped early) ends before its last block
        block_size, blocks = con.execute("SELECT block_size, total_blocks FROM pragma_database_size() "
                                         "WHERE database_name = 'lake_cache'").fetchone()
        if size >= _DUCKDB_HEADERS + block_size * blocks:
            names = {r[0] for r in con.execute(
                "SELECT table_name FROM duckdb_tables() WHERE database_name = 'lake_cache'").fetchall()}
            if names == CACHED | {_META, FILES_TABLE, FRONTIER_TABLE}:
                row = con.execute(f'SELECT cache_key, tables FROM lake_cache."{_META}"').fetchone()
                if row == (key or _key(path), len(CACHED)) and _identity(path) == before:
                    return True
    except (duckdb.Error, OSError):
        pass
    con.execute("DETACH lake_cache")
    return False


def _identity(path: Path) -> tuple:
    """Device, inode, size, mtime: the same file, unchanged (not the access time, which reading moves)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def cache_is_whole(path: Path) -> bool:
    """True if `path` is a cache file a connection would read (`chipledger lake cache` asks before writing)."""
    with duckdb.connect() as con:
        return _attach_cache(con, path)


_STALE_TMP_S = 3600


class CacheLayoutWarning(UserWarning):
    """A cache file just written fails the check a reader makes (a DuckDB whose file layout this chipledger does
    not know): the lake is not cached, and every report computes its tables."""


def _write_cache(con: duckdb.DuckDBPyConnection, path: Path, lake: Path, files: Files) -> None:
    """Copy the CACHED tables, computed from `files`, into `path` (a new file, checked as a reader would, renamed
    into place; older cache files and temporary files over an hour old are removed). Never leaves a file of its own
    half-written: an error or interrupt removes it (an OSError or DuckDB error, a read-only lake or a full disk, is
    swallowed; the connection works, uncached)."""
    tmp = tmp_beside(path)
    attached = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        con.execute(f"ATTACH '{_quote(tmp)}' AS cache_out")
        attached = True
        for name in sorted(CACHED):
            con.execute(f'CREATE TABLE cache_out."{name}" AS SELECT * FROM "{name}"')
        write_meta(con, "cache_out", lake, files)
        # last: a reader takes the file as whole only with this row (a copy cut short lacks it)
        con.execute(f'CREATE TABLE cache_out."{_META}" AS SELECT ? AS cache_key, ? AS tables, ? AS code_key, '
                    f'now() AS written_at', [_key(path), len(CACHED), _code_key()])
        con.execute("DETACH cache_out")
        attached = False
        _publish(tmp, path)
    except BaseException as e:  # a read-only lake, a full disk, an interrupt: no file left half-written
        if attached:
            try:
                con.execute("DETACH cache_out")
            except duckdb.Error:
                pass
        _discard(tmp)
        if isinstance(e, (OSError, duckdb.Error)):  # the connection works, uncached
            return
        raise
    _clean_beside(path)


def _update_cache(lake: Path, files: Files, path: Path) -> bool:
    """Write `path` from an older cache of the lake and the files added since (analytics/cache_update.py), if there
    is one the lake only grew from; True if `path` is now the lake's cache. Like a write, never leaves a file of
    its own half-written, and an OSError or DuckDB error is just no update (the tables are computed)."""
    code = _code_key()
    for base in base_candidates(lake, path):
        added = _grown_from(base, code, files)
        if added is not None:
            break
    else:
        return False
    tmp = tmp_beside(path)
    try:
        update(base, tmp, lake, files, added, _key(path))
        # the files read are still the ones the key was taken from (others may have been added meanwhile)
        return lake_files_unchanged(lake, files) and _publish(tmp, path)
    except BaseException as e:
        if isinstance(e, (OSError, duckdb.Error, NotIncremental)):
            return False
        raise
    finally:
        _discard(tmp)  # renamed, if published


def _grown_from(base: Path, code: str, files: Files) -> Optional[Files]:
    """The files added to the lake since the cache `base` was written, or None if it is not whole, is another
    version's, or any of its files changed or went."""
    with duckdb.connect() as check:
        if not _attach_cache(check, base):
            return None
        try:
            if check.execute(f'SELECT code_key FROM lake_cache."{_META}"').fetchone()[0] != code:
                return None
            return added_files(check, "lake_cache", files)
        except duckdb.Error:
            return None


def _publish(tmp: Path, path: Path) -> bool:
    """Name the cache file written as `tmp` `path`, once on disk and checked as a reader would check it."""
    with open(tmp, "rb") as f:  # on disk before it is named as the cache
        os.fsync(f.fileno())
    with duckdb.connect() as check:
        whole = _attach_cache(check, tmp, _key(path))
    if not whole:
        warnings.warn(f"the analytics cache just written fails the check its readers make (DuckDB "
                      f"{duckdb.__version__}'s file layout?): {path.parent} is not cached", CacheLayoutWarning,
                      stacklevel=4)
        _remove(tmp)
        return False
    _remove(Path(f"{path}.wal"))  # a change someone left on a cache of this key would be replayed onto ours
    os.replace(tmp, path)
    return True


def _discard(tmp: Path) -> None:
    _remove(tmp)
    _remove(tmp.with_name(tmp.name + ".wal"))


def _clean_beside(path: Path) -> None:
    """Remove older caches and their .wal files; another writer's temporary files only once they are stale."""
    try:
        stale = time.time() - _STALE_TMP_S
        for old in path.parent.glob("analytics-*"):
            if old != path and (".tmp" not in old.name or _older_than(old, stale)):
                _remove(old)
    except OSError:  # the folder went (`run --overwrite`) or may not be listed: the cache is written
        pass


def _remove(p: Path) -> None:
    try:
        p.unlink(missing_ok=True)
    except OSError:  # another process's to remove, or a folder in its place
        pass


def _older_than(p: Path, t: float) -> bool:
    try:
        return p.stat().st_mtime < t
    except OSError:
        return False


def view_names() -> list[str]:
    return sorted({*(_RAW_VIEW_NAMES.get(t, t) for t in SCHEMAS), "base_event_log", *DERIVED_VIEWS,
                   *duckdb_base_views(), *slo_views(DUCKDB), *POLICY_VIEWS})
