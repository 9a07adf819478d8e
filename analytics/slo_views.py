"""SLO, error-budget, fragmentation and demand-shaping views (DESIGN §7), written once for two SQL engines.

The views are built in three layers:

- `base_*`: the lake tables with times as integer epoch seconds (`*_s`) and the fields the SLOs need pulled
  out of each event's canonical JSON. They are engine-specific: `duckdb_base_views()` defines them over the
  lake views; the benchmark loads the same rows into SQLite tables of the same names.
- `calc_*`: the computation (quota in effect, scheduling waits, chip states, window sums), in SQL that runs
  unchanged on DuckDB and SQLite (window functions, CASE, integer epoch arithmetic; no engine-only function),
  so the benchmark compares the same SQL on both.
- the user views (`slo_quota_honoured`, `slo_sched_latency`, `fragmentation`, `error_budget`, `burn_alerts`,
  `demand_shaping`, `demand_peak_teams`, `sched_waits`, `chip_states`, `grant_intervals`), the same SQL
  again, with times shown as timestamps (`Dialect.ts`).

Targets and thresholds come from two small tables that `analytics.views.connect` creates from `[slo]`
(`slo_targets (slo, target)`, `slo_settings (sched_slo_s, window_days, as_of_s)`), so the same views answer
for whatever targets are configured. Definitions and units: docs/analytics.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SLOS = ("availability", "quota_honoured", "sched_latency", "goodput")

# the SRE workbook's multi-window, multi-burn-rate alerts: (alert, severity, long window, short window, burn rate)
BURN_RULES = (
    ("page_1h", "page", "1h", "5m", 14.4),
    ("page_6h", "page", "6h", "30m", 6.0),
    ("ticket_3d", "ticket", "3d", "6h", 1.0),
)
WINDOWS_S = {"5m": 300, "30m": 1800, "1h": 3600, "6h": 21600, "3d": 259200}

PEAK_FRACTION = 0.9  # an hour of the week is a pool peak when its demand is at least 90% of the pool's highest


@dataclass(frozen=True)
class SloParams:
    """Targets (fractions of good over total) and thresholds of the SLOs; the `[slo]` config section."""

    availability: float = 0.99     # share of registered chip-seconds on available chips
    quota_honoured: float = 0.95   # share of in-quota submissions started within sched_slo_s
    sched_latency: float = 0.9     # share of scheduling waits (first starts and restarts) within sched_slo_s
    goodput: float = 0.9           # share of allocated chip-seconds not lost to preemptions and failures
    sched_slo_s: int = 600         # the scheduling-latency threshold, seconds
    window_days: int = 30          # the error budgets' rolling window, days

    def __post_init__(self):
        for name in SLOS:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v < 1):
                raise ValueError(f"[slo] {name} must be a target between 0 and 1 (exclusive), got {v!r}")
        if self.sched_slo_s <= 0:
            raise ValueError(f"[slo] sched_slo_s must be a positive number of seconds, got {self.sched_slo_s!r}")
        if self.window_days <= 0:
            raise ValueError(f"[slo] window_days must be a positive number of days, got {self.window_days!r}")

    def targets(self) -> list[tuple[str, float]]:
        return [(name, float(getattr(self, name))) for name in SLOS]


@dataclass(frozen=True)
class Dialect:
    name: str  # "duckdb" or "sqlite"

    def ts(self, x: str) -> str:
        """An epoch-second expression shown as a timestamp (SQLite keeps the integer)."""
        return f"to_timestamp({x})" if self.name == "duckdb" else x

    def date(self, x: str) -> str:
        return f"CAST(to_timestamp({x}) AS DATE)" if self.name == "duckdb" else f"date({x}, 'unixepoch')"

    def greatest(self, a: str, b: str) -> str:  # arguments must not be NULL (the engines differ on NULL)
        return f"greatest({a}, {b})" if self.name == "duckdb" else f"max({a}, {b})"

    def least(self, a: str, b: str) -> str:
        return f"least({a}, {b})" if self.name == "duckdb" else f"min({a}, {b})"


DUCKDB = Dialect("duckdb")
SQLITE = Dialect("sqlite")


def journal_sql(postings: str = "journal_postings") -> str:
    """The lake's journal view (DuckDB) over the given postings (an update of the analytics cache reads the files added since)."""
    return f"""
        SELECT pool, hour, account, team, sum(amount_mchip_s)::BIGINT AS amount_mchip_s,
               sum(amount_mchip_s) / 3.6e6 AS amount_chip_h
        FROM {postings} GROUP BY pool, hour, account, team
    """


def job_run_totals_sql(job_runs: str = "job_runs") -> str:
    """The lake's job_run_totals view (DuckDB) over the given postings (an update of the analytics cache reads the files added since). A run's
    postings agree on its team, chips, priority and start; max() and min() pick the same one when two runs share a
    key (a job id submitted, finished and submitted again within one second), whatever the order of the rows."""
    return f"""
        SELECT pool, job_id, submitted_at, run_index, max(team) AS team,
               max(chips_milli) AS chips_milli, max(priority) AS priority,
               min(started_at) AS started_at, max(ended_at) AS ended_at,
               max(end_reason) AS end_reason, sum(allocated_mchip_s)::BIGINT AS allocated_mchip_s,
               sum(lost_mchip_s)::BIGINT AS lost_mchip_s
        FROM {job_runs} GROUP BY pool, job_id, submitted_at, run_index
    """


def duckdb_base_views(run_totals: str = "job_run_totals", event_log: str = "base_event_log",
                      event_rows: str = "base_event_rows", journal: str = "journal") -> dict[str, str]:
    """The base layer over the lake views (DuckDB); an update of the analytics cache gives the views over the files
    added since (analytics/cache_update.py)."""
    return {
        "base_runs": f"""
            SELECT pool, job_id, team, run_index, chips_milli, priority, epoch(submitted_at)::BIGINT AS submitted_s,
                   epoch(started_at)::BIGINT AS started_s, epoch(ended_at)::BIGINT AS ended_s, end_reason,
                   allocated_mchip_s, lost_mchip_s
            FROM {run_totals}
        """,
        # every event with the fields the SLO views need, from the typed columns of the lake's events
        "base_event_rows": f"""
            SELECT pool, type, epoch(applied_at)::BIGINT AS at_s, topic, "partition", "offset", job_id, team,
                   chip_id, node, state, grant_id, chips_milli, priority,
                   epoch(effective_from)::BIGINT AS effective_from_s,
                   epoch(effective_until)::BIGINT AS effective_until_s, chip_ids
            FROM {event_log}
        """,
        # the pools' own events (chips, quotas; not jobs', which the SLO views read from base_jobs, base_runs and
        # base_placements) in the order they were applied
        "base_events": f"""
            SELECT pool, type, at_s,
                   row_number() OVER (PARTITION BY pool ORDER BY at_s, topic, "partition", "offset") AS seq,
                   chip_id, node, state, grant_id, team, chips_milli, effective_from_s, effective_until_s
            FROM {event_rows} WHERE type NOT LIKE 'job.%'
        """,
        # each pool's clock: its last event applied
        "base_pool_end": f"SELECT pool, max(at_s) AS end_s FROM {event_rows} GROUP BY pool",
        # one row per submission: a job id submitted again after its job finished is another job; the event
        # after a submission of the same id is its finish (if any)
        "base_jobs": f"""
            WITH s AS (
                SELECT *, lead(type) OVER w AS next_type, lead(at_s) OVER w AS next_s
                FROM {event_rows} WHERE type IN ('job.submitted', 'job.finished')
                WINDOW w AS (PARTITION BY pool, job_id ORDER BY at_s, topic, "partition", "offset")
            )
            SELECT s.pool, s.job_id, s.team, s.chips_milli, coalesce(s.priority, 0) AS priority,
                   s.at_s AS submitted_s, r.started_s AS first_started_s,
                   CASE WHEN s.next_type = 'job.finished' THEN s.next_s END AS finished_s
            FROM s LEFT JOIN base_runs r ON r.run_index = 1 AND r.pool = s.pool AND r.job_id = s.job_id
                                        AND r.submitted_s = s.at_s
            WHERE s.type = 'job.submitted'
        """,
        "base_placements": f"""
            SELECT pool, job_id, at_s AS started_s, unnest(chip_ids) AS chip_id
            FROM {event_rows} WHERE type = 'job.started' AND chip_ids IS NOT NULL
        """,
        "base_journal": f"""
            SELECT pool, epoch(hour)::BIGINT AS hour_s, account, team, amount_mchip_s FROM {journal}
        """,
    }


def _overlap(d: Dialect, window: str) -> str:
    """Seconds of [from_s, until_s) inside (as_of_s - window, as_of_s]."""
    lo = d.greatest("from_s", f"as_of_s - {window}")
    hi = d.least("until_s", "as_of_s")
    return f"CASE WHEN {hi} > {lo} THEN {hi} - {lo} ELSE 0 END"


def slo_views(d: Dialect) -> dict[str, str]:
    """The calc and user views, in definition order (later views use earlier ones)."""
    ts = d.ts
    budget_window = "(SELECT window_days FROM slo_settings) * 86400"
    windows = {"budget": budget_window, **{k: str(v) for k, v in WINDOWS_S.items()}}
    window_rows = "\nUNION ALL\n".join(f"SELECT '{k}' AS win, {w} AS len_s FROM calc_now"
                                       for k, w in windows.items())
    rules = "\nUNION ALL\n".join(
        f"SELECT '{a}' AS alert, '{sev}' AS severity, '{lw}' AS long_win, '{sw}' AS short_win, CAST({f} AS DOUBLE) AS burn_rate"
        for a, sev, lw, sw, f in BURN_RULES)
    hour_of_week = "CAST(((hour_s + 259200) % 604800) / 3600 AS INTEGER)"  # 1970-01-01 was a Thursday: +3 days
    return {
        # the instant the windows end at: [slo] as_of, else the latest event applied
        # (no row on a lake without events: nothing to evaluate)
        "calc_now": """
            SELECT coalesce((SELECT as_of_s FROM slo_settings), last_s) AS as_of_s,
                   (SELECT sched_slo_s FROM slo_settings) AS sched_slo_s
            FROM (SELECT max(end_s) AS last_s FROM base_pool_end) x WHERE last_s IS NOT NULL
        """,
        "calc_pool_end": "SELECT pool, end_s FROM base_pool_end",
        # one row per incarnation of a grant (a quota.granted event): in effect from max(granted, effective_from)
        # until the next grant or revocation of the same id, or effective_until, whichever comes first
        "calc_grants": f"""
            WITH g AS (
                SELECT pool, grant_id, team, type, chips_milli, at_s, effective_from_s, effective_until_s,
                       lead(at_s) OVER (PARTITION BY pool, grant_id ORDER BY at_s, seq) AS next_s
                FROM base_events WHERE type IN ('quota.granted', 'quota.revoked')
            ), b AS (
                SELECT pool, grant_id, team, chips_milli,
                       {d.greatest('at_s', 'coalesce(effective_from_s, at_s)')} AS from_s,
                       CASE WHEN next_s IS NULL THEN effective_until_s
                            WHEN effective_until_s IS NULL THEN next_s
                            ELSE {d.least('next_s', 'coalesce(effective_until_s, next_s)')} END AS until_s
                FROM g WHERE type = 'quota.granted'
            )
            SELECT * FROM b WHERE until_s IS NULL OR until_s > from_s
        """,
        # every wait to be scheduled: a submission until the first start, a preemption until the restart
        "calc_wait_spans": wait_spans_sql(),
        # the team's nominal quota and running chips at each wait's start, by running sums over one stream per
        # pool and team. At one instant: grant changes and run ends (0) come before the wait (1), run starts
        # after it (2): a grant starting at the instant counts, a job that ended or starts at it does not.
        "calc_wait_levels": wait_levels_sql(),
        "calc_waits": """
            SELECT w.*, n.as_of_s, n.sched_slo_s,
                   CASE WHEN started_s IS NOT NULL AND wait_s <= sched_slo_s THEN 1
                        WHEN coalesce(started_s, abandoned_s, as_of_s) - since_s > sched_slo_s THEN 0 END AS good,
                   CASE WHEN started_s IS NOT NULL AND wait_s <= sched_slo_s THEN started_s
                        WHEN coalesce(started_s, abandoned_s, as_of_s) - since_s > sched_slo_s
                            THEN since_s + sched_slo_s END AS resolved_s
            FROM calc_wait_levels w CROSS JOIN calc_now n
        """,
        "sched_waits": f"""
            SELECT pool, team, job_id, {ts('submitted_s')} AS submitted_at, kind, after_run, priority,
                   chips_milli, CASE WHEN in_quota = 1 THEN 'in_quota' ELSE 'borrowing' END AS quota_class,
                   nominal_milli, running_milli, {ts('since_s')} AS waiting_since, {ts('started_s')} AS started_at,
                   wait_s, {ts('abandoned_s')} AS abandoned_at,
                   CASE good WHEN 1 THEN 'within' WHEN 0 THEN 'late' ELSE 'open' END AS slo_result
            FROM calc_waits
        """,
        "slo_quota_honoured": f"""
            SELECT pool, team, {d.date('submitted_s - submitted_s % 86400')} AS day,
                   count(*) AS in_quota_submissions,
                   CAST(sum(CASE WHEN good = 1 THEN 1 ELSE 0 END) AS BIGINT) AS honoured,
                   CAST(sum(CASE WHEN good = 0 THEN 1 ELSE 0 END) AS BIGINT) AS late,
                   CAST(sum(CASE WHEN good IS NULL THEN 1 ELSE 0 END) AS BIGINT) AS open,
                   sum(CASE WHEN good = 1 THEN 1 ELSE 0 END) * 1.0
                     / nullif(sum(CASE WHEN good IS NOT NULL THEN 1 ELSE 0 END), 0) AS attainment,
                   (SELECT target FROM slo_targets WHERE slo = 'quota_honoured') AS target,
                   max(sched_slo_s) AS sched_slo_s
            FROM calc_waits WHERE kind = 'first_start' AND in_quota = 1
            GROUP BY pool, team, submitted_s - submitted_s % 86400
        """,
        # nearest-rank percentiles: the smallest wait with at least p of the waits at or below it
        "slo_sched_latency": sched_latency_sql(),
        # each chip's registration and state as intervals [from_s, until_s); the last one ends at the pool's end
        "calc_chip_segments": f"""
            WITH h AS (
                SELECT pool, chip_id, at_s, type, state,
                       lead(at_s) OVER (PARTITION BY pool, chip_id ORDER BY at_s, seq) AS next_s
                FROM base_events WHERE type IN ('chip.registered', 'chip.state_changed', 'chip.retired')
            )
            SELECT h.pool, chip_id, at_s AS from_s, coalesce(next_s, e.end_s) AS until_s,
                   CASE WHEN type = 'chip.retired' THEN 0 ELSE 1 END AS registered,
                   CASE WHEN type = 'chip.registered' THEN 1
                        WHEN type = 'chip.state_changed' AND state IN ('healthy', 'degraded') THEN 1
                        ELSE 0 END AS usable
            FROM h JOIN calc_pool_end e ON e.pool = h.pool
        """,
        "chip_states": f"""
            SELECT pool, chip_id, {ts('from_s')} AS valid_from, {ts('until_s')} AS valid_until,
                   until_s - from_s AS duration_s, registered = 1 AS registered, usable = 1 AS available
            FROM calc_chip_segments
        """,
        "grant_intervals": f"""
            SELECT pool, grant_id, team, chips_milli, {ts('from_s')} AS effective_from,
                   {ts('until_s')} AS effective_until
            FROM calc_grants
        """,
        # what each SLO counts as good out of total, at the instant it became known (not availability, which is
        # continuous: see calc_slo_window)
        "calc_sli_points": """
            SELECT 'quota_honoured' AS slo, pool, resolved_s AS at_s, good, 1 AS total
            FROM calc_waits WHERE kind = 'first_start' AND in_quota = 1 AND good IS NOT NULL
            UNION ALL
            SELECT 'sched_latency', pool, resolved_s, good, 1 FROM calc_waits WHERE good IS NOT NULL
            UNION ALL
            SELECT 'goodput', pool, ended_s, allocated_mchip_s - lost_mchip_s, allocated_mchip_s
            FROM base_runs WHERE ended_s IS NOT NULL
        """,
        # every SLO and pool with something measured, in any window or none
        "calc_slo_keys": """
            SELECT DISTINCT 'availability' AS slo, pool FROM calc_chip_segments
            UNION
            SELECT DISTINCT slo, pool FROM calc_sli_points
        """,
        # the windows: the error budget's (window_days) and the burn-rate alerts'
        "calc_windows": window_rows,
        # good and total in each window (as_of_s - len_s, as_of_s], per SLO and pool, in one pass over the data
        "calc_slo_window": f"""
            SELECT 'availability' AS slo, pool, win,
                   CAST(sum(usable * 1000 * ({_overlap(d, 'len_s')})) AS BIGINT) AS good,
                   CAST(sum(registered * 1000 * ({_overlap(d, 'len_s')})) AS BIGINT) AS total
            FROM calc_chip_segments CROSS JOIN calc_now CROSS JOIN calc_windows
            WHERE from_s <= as_of_s AND until_s > as_of_s - len_s
            GROUP BY pool, win
            UNION ALL
            SELECT slo, pool, win, CAST(sum(good) AS BIGINT), CAST(sum(total) AS BIGINT)
            FROM calc_sli_points CROSS JOIN calc_now CROSS JOIN calc_windows
            WHERE at_s <= as_of_s AND at_s > as_of_s - len_s
            GROUP BY slo, pool, win
        """,
        "error_budget": f"""
            WITH p AS (
                SELECT k.slo, k.pool, coalesce(w.good, 0) AS good, coalesce(w.total, 0) AS total
                FROM calc_slo_keys k LEFT JOIN calc_slo_window w ON w.slo = k.slo AND w.pool = k.pool
                                                               AND w.win = 'budget'
            ), w AS (
                SELECT slo, pool, good, total FROM p
                UNION ALL
                SELECT slo, NULL, CAST(sum(good) AS BIGINT), CAST(sum(total) AS BIGINT) FROM p GROUP BY slo
            )
            SELECT w.slo, w.pool, {ts(f'as_of_s - {budget_window}')} AS window_start, {ts('as_of_s')} AS window_end,
                   t.target, CASE WHEN w.slo IN ('availability', 'goodput') THEN 'mchip_s' ELSE 'waits' END AS unit,
                   w.good, w.total, w.total - w.good AS bad, w.good * 1.0 / nullif(w.total, 0) AS sli,
                   1 - t.target AS budget, (1 - t.target) * w.total AS allowed_bad,
                   (w.total - w.good) * 1.0 / nullif(w.total, 0) / (1 - t.target) AS consumed,
                   1 - (w.total - w.good) * 1.0 / nullif(w.total, 0) / (1 - t.target) AS remaining
            FROM w JOIN slo_targets t ON t.slo = w.slo CROSS JOIN calc_now
        """,
        # burn rate = (bad / total in the window) / (1 - target); an alert fires when both windows burn at least
        # its rate
        "burn_alerts": f"""
            WITH rules AS ({rules}), burn AS (
                SELECT w.slo, w.pool, w.win, t.target,
                       (w.total - w.good) * 1.0 / nullif(w.total, 0) / (1 - t.target) AS burn
                FROM calc_slo_window w JOIN slo_targets t ON t.slo = w.slo WHERE w.win <> 'budget'
            ), keys AS (
                SELECT k.slo, k.pool, t.target FROM calc_slo_keys k JOIN slo_targets t ON t.slo = k.slo
            ), b AS (
                SELECT r.alert, r.severity, k.slo, k.pool, r.burn_rate, r.long_win, r.short_win, k.target,
                       (SELECT burn FROM burn x WHERE x.slo = k.slo AND x.pool = k.pool AND x.win = r.long_win)
                           AS long_burn,
                       (SELECT burn FROM burn x WHERE x.slo = k.slo AND x.pool = k.pool AND x.win = r.short_win)
                           AS short_burn
                FROM rules r CROSS JOIN keys k
            )
            SELECT b.*, coalesce(long_burn >= burn_rate AND short_burn >= burn_rate, false) AS firing,
                   {ts('as_of_s')} AS evaluated_at
            FROM b CROSS JOIN calc_now
        """,
        # --- fragmentation: free usable chips, by node, as a step function of time ---
        "calc_chip_node": "SELECT pool, chip_id, max(node) AS node FROM base_events "
                          "WHERE type = 'chip.registered' GROUP BY pool, chip_id",
        # a placed run's chips per node (runs rarely span nodes: far fewer rows than chips); the placements are
        # counted per node before they meet the runs
        "calc_run_nodes": run_nodes_sql(),
        # free chips of a node = usable − allocated + allocated-while-unusable (a chip counts once as not free),
        # each term a running sum of deltas: per chip only for health, per run and node for allocations
        "calc_fragmentation": fragmentation_sql(d),
        "fragmentation": f"""
            SELECT pool, {ts('from_s')} AS valid_from, {ts('until_s')} AS valid_until, until_s - from_s AS duration_s,
                   unplaced_runs = 0 AS placement_known, free_chips, whole_node_free_chips,
                   free_chips - whole_node_free_chips AS fragmented_chips,
                   CASE WHEN unplaced_runs = 0 AND free_chips > 0
                        THEN (free_chips - whole_node_free_chips) * 1.0 / free_chips END AS fragmentation,
                   CASE WHEN unplaced_runs = 0 THEN whole_node_free_chips END AS largest_job_chips
            FROM calc_fragmentation
        """,
        # --- demand shaping: hour-of-week profiles of demand (running + pending chips) from the journal ---
        "calc_demand_slots": f"""
            WITH ph AS (
                SELECT pool, hour_s,
                       sum(CASE WHEN account = 'idle' THEN amount_mchip_s ELSE 0 END) AS idle,
                       sum(CASE WHEN account = 'capacity' THEN amount_mchip_s ELSE 0 END) AS capacity
                FROM base_journal WHERE team IS NULL GROUP BY pool, hour_s
            ), th AS (
                SELECT pool, team, hour_s,
                       sum(CASE WHEN account IN ('in_quota', 'borrowed', 'burst') THEN amount_mchip_s ELSE 0 END)
                           AS running,
                       sum(CASE WHEN account = 'pending' THEN amount_mchip_s ELSE 0 END) AS pending
                FROM base_journal WHERE team IS NOT NULL GROUP BY pool, team, hour_s
            ), slots AS (
                SELECT pool, {hour_of_week} AS how, count(*) AS hours, sum(idle) AS idle, sum(capacity) AS capacity
                FROM ph GROUP BY pool, {hour_of_week}
            ), team_slots AS (
                SELECT pool, team, {hour_of_week} AS how, sum(running) AS running, sum(pending) AS pending
                FROM th GROUP BY pool, team, {hour_of_week}
            ), pool_slots AS (
                SELECT s.pool, s.how, s.hours, s.idle, s.capacity, coalesce(sum(t.running), 0) AS running,
                       coalesce(sum(t.pending), 0) AS pending
                FROM slots s LEFT JOIN team_slots t ON t.pool = s.pool AND t.how = s.how
                GROUP BY s.pool, s.how, s.hours, s.idle, s.capacity
            )
            SELECT p.pool, NULL AS team, p.how, p.hours, p.running, p.pending, p.idle, p.capacity,
                   p.running + p.pending AS pool_demand
            FROM pool_slots p
            UNION ALL
            SELECT t.pool, t.team, t.how, p.hours, t.running, t.pending, NULL, NULL, p.running + p.pending
            FROM team_slots t JOIN pool_slots p ON p.pool = t.pool AND p.how = t.how
        """,
        "demand_shaping": f"""
            WITH s AS (
                SELECT pool, team, how, hours, (running + pending) / (hours * 3600000.0) AS demand_chips,
                       running / (hours * 3600000.0) AS running_chips, pending / (hours * 3600000.0) AS pending_chips,
                       idle / (hours * 3600000.0) AS idle_chips, capacity / (hours * 3600000.0) AS capacity_chips,
                       pool_demand / (hours * 3600000.0) AS pool_demand_chips,
                       (running + pending) * 1.0 / nullif(pool_demand, 0) AS share_of_pool,
                       pending * 1.0 / nullif(running + pending, 0) AS pending_share
                FROM calc_demand_slots
            ), prof AS (
                SELECT pool, coalesce(team, '') AS tkey, max(demand_chips) AS peak, avg(demand_chips) AS mean
                FROM s GROUP BY pool, coalesce(team, '')
            ), pk AS (
                SELECT pool, max(pool_demand_chips) AS pool_peak, avg(pool_demand_chips) AS pool_mean
                FROM s WHERE team IS NULL GROUP BY pool
            )
            SELECT s.pool, s.team, s.how AS hour_of_week, CAST((s.how - s.how % 24) / 24 AS INTEGER) AS day_of_week, s.how % 24 AS hour_of_day,
                   s.hours AS hours_observed, s.demand_chips, s.running_chips, s.pending_chips, s.pending_share,
                   s.idle_chips, s.capacity_chips, s.share_of_pool,
                   prof.peak / nullif(prof.mean, 0) AS peak_to_average,
                   pk.pool_peak > 0 AND s.pool_demand_chips >= {PEAK_FRACTION} * pk.pool_peak AS pool_peak,
                   CASE WHEN s.team IS NULL THEN s.pool_demand_chips <= pk.pool_mean AND s.idle_chips > 0 END
                       AS offpeak_idle
            FROM s JOIN prof ON prof.pool = s.pool AND prof.tkey = coalesce(s.team, '')
                   JOIN pk ON pk.pool = s.pool
        """,
        # which teams' demand makes the pool's peak hours
        "demand_peak_teams": """
            WITH t AS (
                SELECT pool, team, sum(demand_chips * hours_observed) AS peak_demand_chip_h
                FROM demand_shaping WHERE team IS NOT NULL AND pool_peak GROUP BY pool, team
            )
            SELECT pool, team, peak_demand_chip_h,
                   peak_demand_chip_h / sum(peak_demand_chip_h) OVER (PARTITION BY pool) AS share_of_peak,
                   row_number() OVER (PARTITION BY pool ORDER BY peak_demand_chip_h DESC, team) AS rank
            FROM t
        """,
    }


# the instant before every other in the running sums of an update from a frontier (analytics/cache_update.py): the
# deltas before a pool's frontier are summed into one row there
BEFORE_ALL_S = -(2 ** 62)


def wait_spans_sql(jobs: str = "base_jobs", runs: str = "base_runs") -> str:
    """calc_wait_spans over the given jobs and runs (an update reads those of the jobs it touches)."""
    return f"""
        WITH nxt AS (  -- a preempted run and the start of the run after it (a join: few runs are preempted)
            SELECT p.pool, p.job_id, p.submitted_s, p.run_index, p.ended_s, p.end_reason,
                   n.started_s AS next_start_s
            FROM {runs} p LEFT JOIN {runs} n ON n.pool = p.pool AND n.job_id = p.job_id
                                            AND n.submitted_s = p.submitted_s AND n.run_index = p.run_index + 1
            WHERE p.end_reason = 'preempted'
        )
        SELECT j.pool, j.job_id, j.team, j.chips_milli, j.priority, j.submitted_s, 'first_start' AS kind,
               0 AS after_run, j.submitted_s AS since_s, j.first_started_s AS started_s,
               CASE WHEN j.first_started_s IS NULL THEN j.finished_s END AS abandoned_s
        FROM {jobs} j
        UNION ALL
        SELECT j.pool, j.job_id, j.team, j.chips_milli, j.priority, j.submitted_s, 'restart' AS kind,
               n.run_index AS after_run, n.ended_s AS since_s, n.next_start_s AS started_s,
               CASE WHEN n.next_start_s IS NULL THEN j.finished_s END AS abandoned_s
        FROM nxt n JOIN {jobs} j ON j.pool = n.pool AND j.job_id = n.job_id AND j.submitted_s = n.submitted_s
        WHERE n.end_reason = 'preempted'
    """


def _wait_stream(waits: bool = True) -> str:
    """The deltas of each team's nominal quota and running chips (ord 0: grant changes and run ends, 2: run starts)
    and, with `waits`, the waits (ord 1), which carry their columns through the running sums (no join back; the
    kind follows from after_run)."""
    out = """
        SELECT pool, team, from_s AS t, 0 AS ord, chips_milli AS d_nom, 0 AS d_run,
               NULL AS job_id, NULL AS chips_milli, NULL AS priority, NULL AS submitted_s,
               NULL AS after_run, NULL AS started_s, NULL AS abandoned_s FROM calc_grants
        UNION ALL
        SELECT pool, team, until_s, 0, -chips_milli, 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL
        FROM calc_grants WHERE until_s IS NOT NULL
        UNION ALL
        SELECT pool, team, started_s, 2, 0, chips_milli, NULL, NULL, NULL, NULL, NULL, NULL, NULL
        FROM base_runs
        UNION ALL
        SELECT pool, team, ended_s, 0, 0, -chips_milli, NULL, NULL, NULL, NULL, NULL, NULL, NULL
        FROM base_runs WHERE ended_s IS NOT NULL"""
    if waits:
        out += """
        UNION ALL
        SELECT pool, team, since_s, 1, 0, 0, job_id, chips_milli, priority, submitted_s, after_run,
               started_s, abandoned_s
        FROM calc_wait_spans"""
    return out


def wait_levels_sql(tail_from: Optional[int] = None) -> str:
    """calc_wait_levels. With `tail_from` (an update from a frontier: analytics/cache_update.py), only the waits at or
    after their pool's frontier (table `inc_t (pool, t)`; `tail_from` is the earliest), each team's deltas before it
    summed into one row at BEFORE_ALL_S."""
    if tail_from is None:
        stream = _wait_stream()
    else:
        stream = f"""
            SELECT s.* FROM ({_wait_stream()}) s JOIN inc_t i ON i.pool = s.pool
            WHERE s.t >= {int(tail_from)} AND s.t >= i.t
            UNION ALL
            SELECT s.pool, s.team, {BEFORE_ALL_S}, -1, sum(s.d_nom), sum(s.d_run), NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL
            FROM ({_wait_stream(waits=False)}) s JOIN inc_t i ON i.pool = s.pool
            WHERE s.t < i.t GROUP BY s.pool, s.team"""
    return f"""
        WITH stream AS ({stream}
        ), levels AS (
            SELECT pool, team, t, ord, job_id, chips_milli, priority, submitted_s, after_run, started_s,
                   abandoned_s, sum(d_nom) OVER w AS nominal_milli, sum(d_run) OVER w AS running_milli
            FROM stream
            WINDOW w AS (PARTITION BY pool, team ORDER BY t, ord ROWS UNBOUNDED PRECEDING)
        ), w AS (
            SELECT l.pool, l.job_id, l.team, l.chips_milli, l.priority, l.submitted_s,
                   CASE WHEN l.after_run = 0 THEN 'first_start' ELSE 'restart' END AS kind, l.after_run,
                   l.t AS since_s, l.started_s, l.abandoned_s,
                   CAST(l.nominal_milli AS BIGINT) AS nominal_milli,
                   CAST(l.running_milli AS BIGINT) AS running_milli,
                   CASE WHEN l.chips_milli <= l.nominal_milli - l.running_milli THEN 1 ELSE 0 END AS in_quota,
                   l.started_s - l.t AS wait_s
            FROM levels l
            WHERE l.ord = 1
        )
        SELECT * FROM w
    """


def run_nodes_sql(placements: str = "base_placements") -> str:
    """calc_run_nodes over the given placements (an update reads those of the runs it touches)."""
    return f"""
        WITH pn AS (
            SELECT p.pool, n.node, p.job_id, p.started_s, count(*) AS chips
            FROM {placements} p JOIN calc_chip_node n ON n.pool = p.pool AND n.chip_id = p.chip_id
            GROUP BY p.pool, n.node, p.job_id, p.started_s
        )
        SELECT pn.pool, pn.node, pn.job_id, pn.started_s, r.ended_s, pn.chips
        FROM pn JOIN base_runs r ON r.pool = pn.pool AND r.job_id = pn.job_id AND r.started_s = pn.started_s
    """


def fragmentation_sql(d: Dialect, tail: bool = False) -> str:
    """calc_fragmentation. With `tail` (an update from a frontier: analytics/cache_update.py), only the steps at or
    after their pool's frontier (table `inc_t (pool, t)`), and one at BEFORE_ALL_S, where each node's deltas before
    the frontier are summed (the runs not placed then come from `inc_unplaced (pool, unplaced_runs)`); that step ends
    where the step before the frontier ends."""
    if tail:
        node_group = (f"y JOIN inc_t i ON i.pool = y.pool "
                      f"GROUP BY y.pool, y.node, CASE WHEN y.t >= i.t THEN y.t ELSE {BEFORE_ALL_S} END")
        node_cols = f"y.pool, y.node, CASE WHEN y.t >= i.t THEN y.t ELSE {BEFORE_ALL_S} END AS t"
        runs = "base_runs r JOIN inc_t i ON i.pool = r.pool WHERE (r.started_s >= i.t OR r.ended_s >= i.t) AND"
        since = ", i.t AS since_t"
        unplaced = f"""
                SELECT pool, started_s AS t, 1 AS d FROM unplaced_runs WHERE started_s >= since_t
                UNION ALL SELECT pool, ended_s, -1 FROM unplaced_runs WHERE ended_s >= since_t
                UNION ALL SELECT pool, {BEFORE_ALL_S}, unplaced_runs FROM inc_unplaced"""
    else:
        node_group, node_cols = "y GROUP BY pool, node, t", "pool, node, t"
        runs, since = "base_runs r WHERE", ""
        unplaced = """
                SELECT pool, started_s AS t, 1 AS d FROM unplaced_runs
                UNION ALL SELECT pool, ended_s, -1 FROM unplaced_runs WHERE ended_s IS NOT NULL"""
    return f"""
        WITH seg AS (  -- of a chip's changes in one second the last is the one that lasts: ordered last
            SELECT pool, chip_id, from_s AS t,
                   registered - lag(registered, 1, 0) OVER c AS d_reg,
                   registered * usable - lag(registered * usable, 1, 0) OVER c AS d_use
            FROM calc_chip_segments WINDOW c AS (PARTITION BY pool, chip_id ORDER BY from_s, until_s)
        ), alloc_unusable AS (  -- from the (few) unusable segments to the placements on their chips
            SELECT p.pool, p.chip_id, {d.greatest('p.started_s', 'u.from_s')} AS a,
                   {d.least('coalesce(r.ended_s, u.until_s)', 'u.until_s')} AS b
            FROM calc_chip_segments u
            JOIN base_placements p ON p.pool = u.pool AND p.chip_id = u.chip_id AND p.started_s < u.until_s
            JOIN base_runs r ON r.pool = p.pool AND r.job_id = p.job_id AND r.started_s = p.started_s
            WHERE u.registered * u.usable = 0 AND (r.ended_s IS NULL OR r.ended_s > u.from_s)
        ), node_pts AS (
            SELECT {node_cols}, CAST(sum(d_reg) AS BIGINT) AS d_reg, CAST(sum(d_free) AS BIGINT) AS d_free FROM (
                SELECT s.pool, n.node, s.t, s.d_reg, s.d_use AS d_free
                FROM seg s JOIN calc_chip_node n ON n.pool = s.pool AND n.chip_id = s.chip_id
                UNION ALL SELECT pool, node, started_s, 0, -chips FROM calc_run_nodes
                UNION ALL SELECT pool, node, ended_s, 0, chips FROM calc_run_nodes WHERE ended_s IS NOT NULL
                UNION ALL SELECT x.pool, n.node, x.a, 0, 1
                          FROM alloc_unusable x JOIN calc_chip_node n ON n.pool = x.pool AND n.chip_id = x.chip_id
                          WHERE x.b > x.a
                UNION ALL SELECT x.pool, n.node, x.b, 0, -1
                          FROM alloc_unusable x JOIN calc_chip_node n ON n.pool = x.pool AND n.chip_id = x.chip_id
                          WHERE x.b > x.a
            ) {node_group}
        ), node_off AS (  -- each node's offset in its pool's sums: the totals of the nodes before it
            SELECT pool, node, sum(r) OVER o - r AS r0, sum(f) OVER o - f AS f0
            FROM (SELECT pool, node, sum(d_reg) AS r, sum(d_free) AS f FROM node_pts GROUP BY pool, node) x
            WINDOW o AS (PARTITION BY pool ORDER BY node ROWS UNBOUNDED PRECEDING)
        ), node AS (  -- a node's running sums: its pool's, ordered by node then time, less the node's offset
            -- (one window per pool: DuckDB runs it several times faster than one per pool and node)
            SELECT p.pool, p.node, p.t, p.d_reg, p.d_free, sum(p.d_reg) OVER n - o.r0 AS n_reg,
                   sum(p.d_free) OVER n - o.f0 AS n_free
            FROM node_pts p JOIN node_off o ON o.pool = p.pool AND o.node = p.node
            WINDOW n AS (PARTITION BY p.pool ORDER BY p.node, p.t ROWS UNBOUNDED PRECEDING)
        ), node_d AS (  -- a node's whole-free chips now minus just before t (its sums less this instant's deltas)
            SELECT pool, t, d_free,
                   CASE WHEN n_reg > 0 AND n_free = n_reg THEN n_reg ELSE 0 END
                   - CASE WHEN n_reg - d_reg > 0 AND n_free - d_free = n_reg - d_reg THEN n_reg - d_reg ELSE 0 END
                       AS d_whole
            FROM node
        ), unplaced_runs AS (
            SELECT r.pool, r.started_s, r.ended_s{since}
            FROM {runs} NOT EXISTS (SELECT 1 FROM calc_run_nodes p WHERE p.pool = r.pool AND p.job_id = r.job_id
                                                                 AND p.started_s = r.started_s)
        ), unplaced AS ({unplaced}
        ), pool_pts AS (
            SELECT pool, t, CAST(sum(d_free) AS BIGINT) AS d_free, CAST(sum(d_whole) AS BIGINT) AS d_whole,
                   CAST(sum(d_unplaced) AS BIGINT) AS d_unplaced FROM (
                SELECT pool, t, d_free, d_whole, 0 AS d_unplaced FROM node_d
                UNION ALL SELECT pool, t, 0, 0, d FROM unplaced
            ) x GROUP BY pool, t
        ), pool_state AS (
            SELECT pool, t, sum(d_free) OVER p AS free_chips, sum(d_whole) OVER p AS whole_node_free_chips,
                   sum(d_unplaced) OVER p AS unplaced_runs,
                   lead(t) OVER (PARTITION BY pool ORDER BY t) AS next_t
            FROM pool_pts WINDOW p AS (PARTITION BY pool ORDER BY t ROWS UNBOUNDED PRECEDING)
        )
        SELECT s.pool, s.t AS from_s, coalesce(s.next_t, e.end_s) AS until_s,
               CAST(s.free_chips AS BIGINT) AS free_chips,
               CAST(s.whole_node_free_chips AS BIGINT) AS whole_node_free_chips,
               CAST(s.unplaced_runs AS BIGINT) AS unplaced_runs
        FROM pool_state s JOIN calc_pool_end e ON e.pool = s.pool
        WHERE coalesce(s.next_t, e.end_s) > s.t
    """


def sched_latency_sql(where: str = "true") -> str:
    """Scheduling-latency percentiles over the started waits of calc_waits that satisfy `where` (the view uses
    them all; `chipledger report` restricts them to a pool and a period). Nearest-rank percentiles: the smallest
    wait with at least p of the waits at or below it. The waits are counted per distinct wait first (integer
    seconds: far fewer values than waits), and the ranks are running sums of those counts."""
    return f"""
        WITH h AS (
            SELECT pool, priority, in_quota, wait_s, count(*) AS c,
                   sum(CASE WHEN kind = 'first_start' THEN 1 ELSE 0 END) AS first_starts,
                   sum(CASE WHEN wait_s <= sched_slo_s THEN 1 ELSE 0 END) AS within
            FROM calc_waits WHERE started_s IS NOT NULL AND ({where})
            GROUP BY pool, priority, in_quota, wait_s
        ), r AS (
            SELECT *, sum(c) OVER (PARTITION BY pool, priority, in_quota ORDER BY wait_s
                                   ROWS UNBOUNDED PRECEDING) AS upto,
                      sum(c) OVER (PARTITION BY pool, priority, in_quota) AS n
            FROM h
        )
        SELECT pool, priority, CASE WHEN in_quota = 1 THEN 'in_quota' ELSE 'borrowing' END AS quota_class,
               CAST(sum(c) AS BIGINT) AS waits, CAST(sum(first_starts) AS BIGINT) AS first_starts,
               CAST(sum(c - first_starts) AS BIGINT) AS restarts,
               min(CASE WHEN upto >= 0.5 * n THEN wait_s END) AS p50_s,
               min(CASE WHEN upto >= 0.9 * n THEN wait_s END) AS p90_s,
               min(CASE WHEN upto >= 0.99 * n THEN wait_s END) AS p99_s,
               max(wait_s) AS max_s,
               sum(within) * 1.0 / sum(c) AS within_slo
        FROM r GROUP BY pool, priority, in_quota
    """


def settings_rows(params: SloParams, as_of_s: Optional[int] = None) -> tuple[list, tuple]:
    """Rows of slo_targets and the one row of slo_settings."""
    return params.targets(), (params.sched_slo_s, params.window_days, as_of_s)
