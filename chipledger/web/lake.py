"""The portal's view of the lake: one warm DuckDB database per snapshot of the lake, refreshed in the background.

A `Snapshot` is `analytics.views.connect(lake, materialize=True)` (the one way into the lake: it lists the files
the lake's commits name) plus the portal's own tables, computed once when the snapshot is built: the queue, the
balances now, the jobs, the decisions, the error budgets, head-of-line blocking (`PORTAL_TABLES`). What a view takes
seconds to compute is computed there, not per request. Requests read a snapshot through their own cursor; what a
request computes from a snapshot is kept with it (`Snapshot.memo`, one computation per answer however many requests
ask at once).

`LakeReader` holds the current snapshot and a thread that looks at the lake every `refresh_s`; when the lake has a
new commit, a new snapshot is built beside the current one (DuckDB on all cores but one: the requests keep one), the answers asked
of the current one are computed on it (`Snapshot.rewarm`), and it is swapped in whole: a request sees the old snapshot
or the new one, never half of each, never waits for a refresh, and after a swap reads answers rather than computes
them. The build is not incremental: it reads the whole lake (docs/portal.md, "Fast while the lake grows").
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import duckdb

log = logging.getLogger("chipledger.web")
_MISSING = object()

# the portal's tables, computed at each refresh from the lake's views (name -> SQL)
PORTAL_TABLES = {
    # each pool's latest close of the books, its capacity then, its teams
    "portal_pools": """
        WITH f AS (SELECT pool, arg_max(registered_milli, "at") AS registered_milli,
                          arg_max(healthy_milli, "at") AS healthy_milli, arg_max(in_use_milli, "at") AS in_use_milli,
                          arg_max(free_milli, "at") AS free_milli, max("at") AS free_at
                   FROM free_chips GROUP BY pool),
             b AS (SELECT pool, max("at") AS "at", count(DISTINCT team) AS teams FROM balance_log GROUP BY pool)
        SELECT coalesce(b.pool, f.pool) AS pool, b."at" AS books_closed_at, coalesce(b.teams, 0) AS teams,
               f.registered_milli, f.healthy_milli, f.in_use_milli, f.free_milli
        FROM b FULL JOIN f USING (pool)
    """,
    # each team's balance at its pool's latest close of the books
    "portal_balances_now": """
        SELECT b.* FROM balances b
        JOIN (SELECT pool, max("at") AS "at" FROM balance_log GROUP BY pool) l USING (pool, "at")
    """,
    "portal_queue": """
        SELECT pool, team, job_id, priority, chips, waiting_since, waited_s, reason, message, "at",
               row_number() OVER (PARTITION BY pool ORDER BY priority DESC, waiting_since, job_id) AS position,
               count(*) OVER (PARTITION BY pool) AS queue_length,
               row_number() OVER (PARTITION BY pool, team ORDER BY priority DESC, waiting_since, job_id)
                   AS team_position
        FROM pending
    """,
    # each job's team by its latest submission in its pool (the head-of-line blockers' owners; `jobs` is a table then)
    "portal_job_owners": "SELECT pool, job_id, arg_max(team, submitted_at) AS team FROM jobs GROUP BY pool, job_id",
    "portal_decisions": "SELECT * EXCLUDE (body), body::VARCHAR AS body FROM decisions",
    "portal_error_budget": "SELECT * FROM error_budget",
    "portal_hol": "SELECT * FROM hol_blocking",
    # the owners of the head-of-line rows' top blockers (a member is shown only their own teams' job ids): one join
    # here, where a lookup per row at the first request after a swap scanned the pool's jobs each time (3.5 s for a
    # member's page at 10M events, at load 10)
    "portal_hol_owners": """
        SELECT DISTINCT b.pool, b.job_id, o.team
        FROM (SELECT pool, unnest(string_split(top_blockers, ',')) AS job_id FROM portal_hol) b
        JOIN portal_job_owners o ON o.pool = b.pool AND o.job_id = b.job_id
    """,
    # the last event of each job (its status), and what the estimate of a start reads: the runs' lengths
    "portal_job_last": """
        SELECT pool, job_id, arg_max(type, (applied_at, "offset")) AS last_type,
               arg_max(body->>'$.held', (applied_at, "offset")) AS held,
               max(applied_at) AS last_at
        FROM events WHERE job_id IS NOT NULL GROUP BY pool, job_id
    """,
    "portal_expected": """
        SELECT pool, job_id, applied_at AS submitted_at,
               TRY_CAST(body->>'$.expected_runtime_s' AS BIGINT) AS expected_runtime_s,
               TRY_CAST(body->>'$.time_limit_s' AS BIGINT) AS time_limit_s
        FROM events WHERE type = 'job.submitted'
    """,
    "portal_runs": """
        SELECT pool, team, job_id, run_index, chips_milli, submitted_at, started_at, ended_at, end_reason,
               allocated_mchip_s, lost_mchip_s FROM job_runs
    """,
    # per pool and closed hour (the burst rule's inputs): demand (running + pending chip-s of the teams), capacity and
    # unavailable chip-s, as the fold's books posted them
    "portal_pool_hours": """
        SELECT pool, epoch(hour)::BIGINT AS hour_s,
               coalesce(sum(amount_mchip_s) FILTER (WHERE team IS NOT NULL
                        AND account IN ('in_quota', 'borrowed', 'burst', 'pending')), 0)::BIGINT AS demand_mchip_s,
               coalesce(sum(amount_mchip_s) FILTER (WHERE team IS NULL AND account = 'capacity'), 0)::BIGINT
                   AS capacity_mchip_s,
               coalesce(sum(amount_mchip_s) FILTER (WHERE team IS NULL AND account = 'unavailable'), 0)::BIGINT
                   AS unavailable_mchip_s
        FROM journal GROUP BY pool, hour
    """,
    # when each pool's books opened (the hour of its first `pool.configured`): the fold closes every hour from there,
    # those before any team or chip too (with no row), and counts them in the burst rule's demand profile
    "portal_pool_opened": """
        SELECT pool, min(applied_at) AS opened_at FROM events WHERE type = 'pool.configured' GROUP BY pool
    """,
    "portal_balance_ints": """
        SELECT b.* FROM balance_log b
        JOIN (SELECT pool, max("at") AS "at" FROM balance_log GROUP BY pool) l USING (pool, "at")
    """,
    # each grant's latest incarnation: when it took effect and when it ends (an early end is its own posting)
    "portal_grants": """
        WITH v AS (SELECT *, max(version) OVER (PARTITION BY pool, grant_id) AS top FROM grant_postings)
        SELECT pool, grant_id, any_value(team) AS team, version,
               max(effective_from) FILTER (WHERE NOT ended) AS effective_from,
               coalesce(min(effective_until) FILTER (WHERE ended), max(effective_until) FILTER (WHERE NOT ended))
                   AS effective_until,
               any_value(lending_limit_milli) FILTER (WHERE NOT ended) AS lending_limit_milli
        FROM v WHERE version = top GROUP BY pool, grant_id, version
    """,
    "portal_bursts": """
        SELECT e.pool, e.team, e.request_id, e.event_id, e.applied_at AS requested_at, e.chips_milli,
               e.body->>'$.requested_by' AS requested_by,
               TRY_CAST(e.body->>'$.window_start' AS TIMESTAMPTZ) AS window_start,
               TRY_CAST(e.body->>'$.window_end' AS TIMESTAMPTZ) AS window_end
        FROM events e WHERE e.type = 'burst.requested'
    """,
}


# views a request reads (the job page's `why`, the decisions) made tables at refresh, under their own names (DuckDB
# binds a view's names when it is queried: views over them then read the tables). `events` last, and only its job
# events: the views that need every event are tables by then. Indexed by job id for the job page's point lookups.
MATERIALIZED_VIEWS = ("pending_history", "pending", "decisions", "decision_victims", "progress", "throughput")
JOB_EVENTS_SQL = "SELECT * FROM events WHERE job_id IS NOT NULL"
INDEXES = (("jobs", "job_id"), ("pending_history", "job_id"), ("progress", "job_id"), ("throughput", "job_id"),
           ("events", "job_id"), ("portal_runs", "job_id"), ("decision_victims", "job_id"),
           ("decisions", "beneficiary_job_id"), ("portal_job_owners", "job_id"))


def _materialize(con, name: str, sql: str) -> None:
    con.execute(f'CREATE TABLE "portal_m_{name}" AS {sql}')
    con.execute(f'DROP VIEW "{name}"')
    con.execute(f'ALTER TABLE "portal_m_{name}" RENAME TO "{name}"')


def lake_signature(lake: Path) -> str:
    """What changes when the lake's books change: its commit (analytics.commits: a table's files are those the
    lake's manifest names, swapped atomically by each commit), as the one reader's check reads it."""
    from analytics.commits import read_manifest

    m = read_manifest(lake)
    if m is None:
        return "no commit"
    h = hashlib.sha256(json.dumps({"commit": m.get("commit"), "tables": m.get("tables")}, sort_keys=True).encode())
    return f"{m.get('commit')}:{h.hexdigest()[:16]}"


@dataclass
class Snapshot:
    con: duckdb.DuckDBPyConnection
    signature: str
    built_at: float
    build_s: float
    version: int
    # answers computed from this snapshot, by key: a snapshot never changes, so neither do they (bounded; the next
    # snapshot starts with the keys asked for of this one computed again: `rewarm`)
    _memo: dict = field(default_factory=dict)
    _pinned: dict = field(default_factory=dict)
    # the bytes of the kept answers that are text
    _memo_bytes: int = 0
    # what `rewarm` recomputes: the keys of found answers (not a made-up job id's "no such job" or its empty list of
    # submissions), the latest asked for last
    _recipes: dict = field(default_factory=dict)
    # keys being computed, and the event their computation sets: a second request for one waits for the first's
    # answer instead of computing it again (8 clients asking for the same page after a swap computed it 8 times)
    _inflight: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # costs and budgets of the current UTC month, computed at the build (chipledger/web/costs.py)
    costs: dict = field(default_factory=dict)
    # seconds the refresh took to compute the previous snapshot's answers on this one, and how many
    rewarm_s: float = 0.0
    rewarmed: int = 0
    # seconds the refresh's warm step (LakeReader.warm: the queue's estimates …) took on it; None: not warmed
    warm_s: Optional[float] = None

    MEMO_MAX = 4096
    MEMO_MAX_BYTES = 256 << 20  # of the kept answers that are text (JSON bytes, rendered pages)
    REWARM_MAX = 256

    def _peek(self, key):
        hit = self._pinned.get(key, _MISSING)
        return self._memo.get(key, _MISSING) if hit is _MISSING else hit

    def _lookup(self, key):
        """The kept answer (a hit counts as asked again: `_touch`); never under the lock."""
        hit = self._pinned.get(key, _MISSING)
        if hit is not _MISSING:
            return hit
        hit = self._memo.get(key, _MISSING)
        if hit is not _MISSING:
            self._touch(key)
        return hit

    def _touch(self, key) -> None:
        """A kept answer asked for again becomes the latest, in the memo (the oldest go first when it is full, so one
        caller asking for many distinct keys pushes out the answers nobody asks for again, not all of them at once)
        and among what the next snapshot computes before its swap (`rewarm`)."""
        with self._lock:
            value = self._memo.pop(key, _MISSING)
            if value is _MISSING:
                return
            self._memo[key] = value
            compute = self._recipes.pop(key, None)
            if compute is not None:
                self._recipes[key] = compute

    def _keep(self, key, value, compute) -> None:
        """Keep `value` (under the lock): the oldest answers go first while the memo is over its bounds."""
        size = len(value) if isinstance(value, (bytes, str)) else 0
        while self._memo and (len(self._memo) >= self.MEMO_MAX or self._memo_bytes + size > self.MEMO_MAX_BYTES):
            old = next(iter(self._memo))
            gone = self._memo.pop(old)
            self._memo_bytes -= len(gone) if isinstance(gone, (bytes, str)) else 0
        self._memo[key] = value
        self._memo_bytes += size
        if value is not None and not (isinstance(value, (list, tuple)) and not value):  # (nothing found: not kept
            self._recipes.pop(key, None)                                                  # for the next snapshot)
            self._recipes[key] = compute
            if len(self._recipes) > self.REWARM_MAX:
                del self._recipes[next(iter(self._recipes))]

    def kept(self, key, default=None):
        """The answer kept for `key`, else `default` (a lookup: never computes, never waits)."""
        hit = self._lookup(key)
        return default if hit is _MISSING else hit

    def memo(self, key, compute: Callable[["Snapshot"], object], pin: bool = False):
        """`compute(snapshot)`'s answer, kept with the snapshot. Pinned answers (what the refresh warmed: the queue
        with its estimates) survive the bound: requests for many distinct keys (job ids, cursors) clear only the
        others, so they cannot make every request recompute what the refresh computed once. `compute` takes the
        snapshot (it names no snapshot of its own), so the refresh can compute the same key on the next snapshot
        before it is swapped in (`rewarm`)."""
        hit = self._lookup(key)
        if hit is not _MISSING:
            return hit
        with self._lock:
            hit = self._peek(key)
            if hit is not _MISSING:
                return hit
            done = self._inflight.get(key)
            mine = done is None
            if mine:
                done = self._inflight[key] = threading.Event()
        if not mine:
            done.wait()
            hit = self._lookup(key)
            if hit is not _MISSING:
                return hit
            return compute(self)  # the first computation failed: this request computes (and fails) on its own
        try:
            value = compute(self)
            with self._lock:
                if pin:
                    self._pinned[key] = value
                else:
                    self._keep(key, value, compute)
            return value
        finally:
            with self._lock:
                self._inflight.pop(key, None)
            done.set()

    def rewarm(self, previous: "Snapshot") -> None:
        """Compute on this snapshot the answers last computed on `previous` (at most REWARM_MAX, the latest),
        before this one is swapped in: the first requests after a swap read answers, not compute them."""
        t0 = time.monotonic()
        with previous._lock:
            recipes = list(previous._recipes.items())
        for key, compute in recipes:
            try:
                self.memo(key, compute)
            except Exception as e:  # a key the new snapshot cannot answer: the request that asks will say why
                log.debug("rewarm of %r failed: %s", key, e)
                continue
            self.rewarmed += 1
        self.rewarm_s = time.monotonic() - t0

    def cached_rows(self, sql: str, params=None) -> list[dict]:
        """`rows`, kept with the snapshot (for the small, principal-independent reads of the routes)."""
        if isinstance(params, dict):
            key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))
        else:
            key = tuple(params or ())
        return self.memo(("sql", sql, key), lambda s: s.rows(sql, params))

    def cursor(self) -> duckdb.DuckDBPyConnection:
        return self.con.cursor()

    def rows(self, sql: str, params=None) -> list[dict]:
        cur = self.con.cursor()
        try:
            res = cur.execute(sql, params or [])
            cols = [c[0] for c in res.description]
            return [dict(zip(cols, r)) for r in res.fetchall()]
        finally:
            cur.close()


def build_snapshot(lake: Path, version: int, slo=None, duckdb_config=None,
                   build_threads: Optional[int] = None) -> Snapshot:
    from analytics.views import connect

    t0 = time.monotonic()
    sig = lake_signature(lake)
    con = connect(lake, materialize=True, slo=slo, config=duckdb_config)
    # the build leaves a core to the requests (DuckDB would take them all, and the requests' threads wait for one)
    con.execute(f"SET threads = {max(1, build_threads if build_threads else (os.cpu_count() or 2) - 1)}")
    # `jobs` first, once: the portal's tables read it (it took as long as every other portal table together)
    _materialize(con, "jobs", 'SELECT * FROM "jobs"')
    con.execute('CREATE VIEW "portal_jobs" AS SELECT * FROM jobs')
    for name, sql in PORTAL_TABLES.items():
        con.execute(f'CREATE OR REPLACE TABLE "{name}" AS {sql}')
    from chipledger.web.costs import snapshot_costs

    costs = snapshot_costs(con)  # before `events` is cut to the job events
    for name in MATERIALIZED_VIEWS:
        _materialize(con, name, f'SELECT * FROM "{name}"')
    _materialize(con, "events", JOB_EVENTS_SQL)
    for table, column in INDEXES:
        con.execute(f'CREATE INDEX "portal_ix_{table}" ON "{table}" ("{column}")')
    return Snapshot(con=con, signature=sig, built_at=time.time(), build_s=time.monotonic() - t0, version=version,
                    costs=costs)


class LakeReader:
    """The current snapshot of the lake, rebuilt in the background when the lake changes (see the module)."""

    def __init__(self, lake: Path, refresh_s: float = 5.0, slo=None, duckdb_config=None,
                 on_swap: Optional[Callable[[Snapshot], None]] = None,
                 warm: Optional[Callable[[Snapshot], None]] = None):
        self.lake = Path(lake)
        self.refresh_s = refresh_s
        self.slo = slo
        self.duckdb_config = duckdb_config
        self.on_swap = on_swap
        self.warm = warm            # computes what requests read most (the queue with its estimates) before the swap
        self._snap: Optional[Snapshot] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.refreshes = 0
        self.last_error: Optional[str] = None

    @property
    def snapshot(self) -> Snapshot:
        snap = self._snap
        if snap is None:
            snap = self.refresh(force=True)
        return snap

    def refresh(self, force: bool = False) -> Snapshot:
        """Build a new snapshot when the lake changed (or `force`), and swap it in whole."""
        old = self._snap
        if not force and old is not None and lake_signature(self.lake) == old.signature:
            return old
        new = build_snapshot(self.lake, (old.version + 1) if old else 1, self.slo, self.duckdb_config)
        self._warm(new)
        if old is not None:
            new.rewarm(old)
        self._snap = new  # one reference assignment: requests hold the snapshot they started with
        self.refreshes += 1
        if self.on_swap is not None:
            self.on_swap(new)
        # the old connection is closed by the garbage collector once the last request holding it is done
        return new

    def _warm(self, snap: Snapshot) -> None:
        if self.warm is not None:
            t0 = time.monotonic()
            self.warm(snap)
            snap.warm_s = time.monotonic() - t0

    def warm_current(self) -> None:
        """Run the warm step on the current snapshot (one built before the step was given)."""
        if self._snap is not None:
            self._warm(self._snap)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="chipledger-lake-refresh", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.refresh()
                self.last_error = None
            except Exception as e:  # a lake mid-write or unreadable: keep serving the last good snapshot
                self.last_error = str(e).splitlines()[0] if str(e) else type(e).__name__
                log.warning("lake refresh failed, serving the previous snapshot: %s", self.last_error)
