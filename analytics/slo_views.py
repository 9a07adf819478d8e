"""SLO, error-budget, fragmentation and demand-shaping views (DESIGN §7), written once for two SQL engines.

The views are built in three layers:

- `base_*`: the lake tables with times as integer epoch seconds (`*_s`) and the fields the SLOs need pulled
  out of each event's canonical JSON. They are engine-specific: `duckdb_base_views()` defines them over the
  lake views; the benchmark loads the same rows into SQLite tables of the same names.
- `calc_*`: the computation (step functions made intervals, SLO classes, window sums), in SQL that runs
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

SLOS = ("availability", "quota_honoured", "sched_latency", "goodput", "throughput")

# the SRE workbook's multi-window, multi-burn-rate alerts: (alert, severity, long window, short window, burn rate)
BURN_RULES = (
    ("page_1h", "page", "1h", "5m", 14.4),
    ("page_6h", "page", "6h", "30m", 6.0),
    ("ticket_3d", "ticket", "3d", "6h", 1.0),
)
# and the budget itself: a ticket while the rolling window's budget is spent (burn >= 1 over the whole window,
# i.e. budget left < 0), so an exhausted budget is never silent when nothing burns fast right now (issue 35, item 6)
BUDGET_RULE = ("budget_exhausted", "ticket", "budget", "budget", 1.0)
# the labels every alert carries beside its rule: the pool, and the team for the SLOs counted per team (the
# Prometheus rules' series labels, streams/metrics.py SLO_COUNTERS): one label set for the CLI and Prometheus
TEAM_SLOS = ("quota_honoured", "sched_latency", "goodput", "throughput")
WINDOWS_S = {"5m": 300, "30m": 1800, "1h": 3600, "6h": 21600, "3d": 259200}

PEAK_FRACTION = 0.9  # an hour of the week is a pool peak when its demand is at least 90% of the pool's highest


@dataclass(frozen=True)
class SloParams:
    """Targets (fractions of good over total) and thresholds of the SLOs; the `[slo]` config section."""

    availability: float = 0.99     # share of registered chip-seconds on available chips
    quota_honoured: float = 0.95   # share of in-quota submissions started within sched_slo_s
    sched_latency: float = 0.9     # share of scheduling waits (first starts and restarts) within sched_slo_s
    goodput: float = 0.9           # share of allocated chip-seconds not lost to preemptions and failures
    throughput: float = 0.9        # share of judged running chip-seconds at or above throughput_fraction of the reference
    sched_slo_s: int = 600         # the scheduling-latency threshold, seconds
    window_days: int = 30          # the error budgets' rolling window, days
    # the throughput facts (the fold judges them: ledger.fold FoldConfig): an interval between two progress reports
    # is slow below this fraction of the job's reference rate, the median of its first stretch of healthy intervals
    # lasting throughput_reference_s and counting at least throughput_reference_reports intervals
    throughput_fraction: float = 0.8
    throughput_reference_s: int = 1800
    throughput_reference_reports: int = 3
    # the alerts' `runbook_url` annotation (Prometheus rules and `chipledger alerts --alertmanager`); `{slo}` and
    # `{alert}` are replaced by the SLO and the alert (page_1h, page_6h, ticket_3d); empty: no annotation
    runbook_url: str = ""

    def __post_init__(self):
        for name in SLOS:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v < 1):
                raise ValueError(f"[slo] {name} must be a target between 0 and 1 (exclusive), got {v!r}")
        if self.sched_slo_s <= 0:
            raise ValueError(f"[slo] sched_slo_s must be a positive number of seconds, got {self.sched_slo_s!r}")
        if self.window_days <= 0:
            raise ValueError(f"[slo] window_days must be a positive number of days, got {self.window_days!r}")
        from ledger.fold import FoldConfig  # the fold judges the throughput facts: its check is the one

        try:
            FoldConfig(**self.fold_kwargs())
        except (ValueError, TypeError) as err:
            raise ValueError(f"[slo] {err}") from None

    def fold_kwargs(self) -> dict:
        """The settings the fold uses to write the throughput facts and count the wait SLOs (FoldConfig's fields of
        the same names)."""
        return {"sched_slo_s": self.sched_slo_s,  # the wait SLOs' counters (PoolState.wait_counts)
                "throughput_fraction": float(self.throughput_fraction),
                "throughput_reference_s": self.throughput_reference_s,
                "throughput_reference_reports": self.throughput_reference_reports}

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
    """The lake's journal view (DuckDB) over the given postings."""
    return f"""
        SELECT pool, hour, account, team, sum(amount_mchip_s)::BIGINT AS amount_mchip_s,
               sum(amount_mchip_s) / 3.6e6 AS amount_chip_h
        FROM {postings} GROUP BY pool, hour, account, team
    """


def job_run_totals_sql(job_runs: str = "job_runs") -> str:
    """The lake's job_run_totals view (DuckDB) over the given postings (base_runs sums those of a run posted more than once). A run's
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


def duckdb_base_views() -> dict[str, str]:
    """The base layer over the lake views (DuckDB)."""
    event_log, event_rows = "base_event_log", "base_event_rows"
    key = "pool, job_id, submitted_at, run_index"
    return {
        # each run's totals (job_run_totals). A run posted once (its end) is that posting as it is; only the runs
        # with a posting of a close of the books (a run still going then: ended_at null) are summed, so the postings
        # are not grouped when no close posted them. Two runs under one key (a job id submitted, finished and
        # submitted again within one second) are listed apart, each at its own end (job_run_totals sums them)
        "base_runs": f"""
            WITH mid AS (SELECT {key} FROM job_runs WHERE ended_at IS NULL)
            SELECT pool, job_id, team, run_index, chips_milli, priority, epoch(submitted_at)::BIGINT AS submitted_s,
                   epoch(started_at)::BIGINT AS started_s, epoch(ended_at)::BIGINT AS ended_s, end_reason,
                   allocated_mchip_s, lost_mchip_s
            FROM (SELECT * FROM job_runs WHERE ended_at IS NOT NULL) ANTI JOIN mid USING ({key})
            UNION ALL
            SELECT pool, job_id, team, run_index, chips_milli, priority, epoch(submitted_at)::BIGINT,
                   epoch(started_at)::BIGINT, epoch(ended_at)::BIGINT, end_reason, allocated_mchip_s, lost_mchip_s
            FROM ({job_run_totals_sql(f"(SELECT * FROM job_runs SEMI JOIN mid USING ({key}))")})
        """,
        # every event with the fields the SLO views need, from the typed columns of the lake's events
        "base_event_rows": f"""
            SELECT pool, type, epoch(applied_at)::BIGINT AS at_s, topic, "partition", "offset", job_id, team,
                   chip_id, node, state, grant_id, chips_milli, priority,
                   epoch(effective_from)::BIGINT AS effective_from_s,
                   epoch(effective_until)::BIGINT AS effective_until_s, chip_ids
            FROM {event_log}
        """,
        # each pool's clock: its last event applied
        "base_pool_end": f"SELECT pool, max(at_s) AS end_s FROM {event_rows} GROUP BY pool",
        # the fold's facts: each wait (its last posting), with times in epoch seconds and its end split out
        "base_waits": """
            SELECT pool, job_id, team, chips_milli, priority, epoch(submitted_at)::BIGINT AS submitted_s, kind,
                   run_index AS after_run, epoch(began_at)::BIGINT AS since_s,
                   CASE WHEN "end" = 'started' THEN epoch(ended_at)::BIGINT END AS started_s,
                   CASE WHEN "end" = 'finished' THEN epoch(ended_at)::BIGINT END AS abandoned_s,
                   team_nominal_milli AS nominal_milli, team_used_milli AS running_milli,
                   CASE WHEN in_quota THEN 1 ELSE 0 END AS in_quota, CASE WHEN borrowing THEN 1 ELSE 0 END AS borrowing,
                   blocked_s, blocked_by
            FROM waits
        """,
        # and each change of a pool's free capacity
        "base_free_chips": """
            SELECT pool, epoch("at")::BIGINT AS at_s, registered_milli, healthy_milli, in_use_milli, down_milli,
                   free_milli, free_whole_nodes_milli, largest_startable_milli
            FROM free_chips
        """,
        # and each interval between two progress reports of a run (the throughput SLO; `slow` null: not judged)
        "base_progress": """
            SELECT pool, job_id, team, run_index, epoch(submitted_at)::BIGINT AS submitted_s, unit,
                   epoch(began_at)::BIGINT AS began_s, epoch(ended_at)::BIGINT AS ended_s, units_from, units_to,
                   chips_milli, charged_mchip_s, units_per_chip_s, reference_units_per_chip_s, slow, slow_s, healthy,
                   unhealthy_chips, held_chips
            FROM progress
        """,
        # each chip's registration and state from at_s on (seq orders a pool's rows of one second)
        "base_chip_states": """
            SELECT pool, chip_id, epoch("at")::BIGINT AS at_s, seq, CASE WHEN registered THEN 1 ELSE 0 END AS registered,
                   CASE WHEN available THEN 1 ELSE 0 END AS available
            FROM chip_state_changes
        """,
        # each posting of a grant's incarnation (`version`): when granted, and its end when it ended early
        "base_grant_postings": """
            SELECT pool, grant_id, team, version, chips_milli, epoch(effective_from)::BIGINT AS from_s,
                   epoch(effective_until)::BIGINT AS until_s
            FROM grant_postings
        """,
        # the journal's postings as they are (the views that read it sum them per hour themselves)
        "base_journal": """
            SELECT pool, epoch(hour)::BIGINT AS hour_s, account, team, amount_mchip_s FROM journal_postings
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
    # per window: the availability's chip-seconds of each step inside it, and the points in it, with the count of
    # rows in it (a window holds a row when it counts any: sums of nulls are null)
    availability_sums = ",\n".join(
        f"count(CASE WHEN from_s <= as_of_s AND until_s > as_of_s - {w} THEN 1 END) AS n_{k}, "
        f"sum(CASE WHEN from_s <= as_of_s AND until_s > as_of_s - {w} THEN healthy_milli * ({_overlap(d, w)}) END) "
        f"AS good_{k}, "
        f"sum(CASE WHEN from_s <= as_of_s AND until_s > as_of_s - {w} THEN registered_milli * ({_overlap(d, w)}) END) "
        f"AS total_{k}"
        for k, w in windows.items())
    point_sums = ",\n".join(
        f"count(CASE WHEN at_s <= as_of_s AND at_s > as_of_s - {w} THEN 1 END) AS n_{k}, "
        f"sum(CASE WHEN at_s <= as_of_s AND at_s > as_of_s - {w} THEN good END) AS good_{k}, "
        f"sum(CASE WHEN at_s <= as_of_s AND at_s > as_of_s - {w} THEN total END) AS total_{k}"
        for k, w in windows.items())
    # one window's column of calc_slo_sums, chosen by calc_windows' row (the sums are read once per query)
    def pick(col: str) -> str:
        return "CASE w.win " + " ".join(f"WHEN '{k}' THEN s.{col}_{k}" for k in windows) + " END"

    rules = "\nUNION ALL\n".join(
        f"SELECT '{a}' AS alert, '{sev}' AS severity, '{lw}' AS long_win, '{sw}' AS short_win, CAST({f} AS DOUBLE) AS burn_rate"
        for a, sev, lw, sw, f in BURN_RULES + (BUDGET_RULE,))
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
        # --- the pool's free capacity as a step function of time (the fold's free_chips): each row holds until the
        # pool's next one, the last until the pool's last event ---
        "calc_free_steps": """
            SELECT f.pool, f.at_s AS from_s,
                   coalesce(lead(f.at_s) OVER (PARTITION BY f.pool ORDER BY f.at_s), e.end_s) AS until_s,
                   f.registered_milli, f.healthy_milli, f.in_use_milli, f.down_milli, f.free_milli,
                   f.free_whole_nodes_milli, f.largest_startable_milli
            FROM base_free_chips f JOIN calc_pool_end e ON e.pool = f.pool
        """,
        # one row per incarnation of a grant, from the fold's grant_intervals: the interval it was granted for, cut
        # at the end it was given earlier (an amendment or a revocation), if any: the earlier end (min ignores
        # the null of an open end). An incarnation revoked before it took effect is left out
        "calc_grants": """
            SELECT * FROM (
                SELECT pool, grant_id, max(team) AS team, max(chips_milli) AS chips_milli, min(from_s) AS from_s,
                       min(until_s) AS until_s
                FROM base_grant_postings GROUP BY pool, grant_id, version
            ) g WHERE from_s IS NOT NULL AND (until_s IS NULL OR until_s > from_s)
        """,
        "calc_waits": """
            SELECT w.*, n.as_of_s, n.sched_slo_s,
                   CASE WHEN started_s IS NOT NULL AND wait_s <= sched_slo_s THEN 1
                        WHEN coalesce(started_s, abandoned_s, as_of_s) - since_s > sched_slo_s THEN 0 END AS good,
                   CASE WHEN started_s IS NOT NULL AND wait_s <= sched_slo_s THEN started_s
                        WHEN coalesce(started_s, abandoned_s, as_of_s) - since_s > sched_slo_s
                            THEN since_s + sched_slo_s END AS resolved_s
            FROM (SELECT *, started_s - since_s AS wait_s FROM base_waits) w CROSS JOIN calc_now n
        """,
        "sched_waits": f"""
            SELECT pool, team, job_id, {ts('submitted_s')} AS submitted_at, kind, after_run, priority,
                   chips_milli, CASE WHEN in_quota = 1 THEN 'in_quota' ELSE 'borrowing' END AS quota_class,
                   nominal_milli, running_milli, {ts('since_s')} AS waiting_since, {ts('started_s')} AS started_at,
                   wait_s, {ts('abandoned_s')} AS abandoned_at,
                   CASE good WHEN 1 THEN 'within' WHEN 0 THEN 'late' ELSE 'open' END AS slo_result,
                   blocked_s, blocked_by
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
        # each chip's registration and state as intervals [from_s, until_s), from the fold's chip_states: each row
        # holds until the chip's next one, the last until the pool's last event
        "calc_chip_segments": """
            SELECT c.pool, chip_id, at_s AS from_s,
                   coalesce(lead(at_s) OVER (PARTITION BY c.pool, chip_id ORDER BY at_s, seq), e.end_s) AS until_s,
                   registered, available AS usable
            FROM base_chip_states c JOIN calc_pool_end e ON e.pool = c.pool
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
            SELECT 'quota_honoured' AS slo, pool, team, resolved_s AS at_s, good, 1 AS total
            FROM calc_waits WHERE kind = 'first_start' AND in_quota = 1 AND good IS NOT NULL
            UNION ALL
            SELECT 'sched_latency', pool, team, resolved_s, good, 1 FROM calc_waits WHERE good IS NOT NULL
            UNION ALL
            SELECT 'goodput', pool, team, ended_s, allocated_mchip_s - lost_mchip_s, allocated_mchip_s
            FROM base_runs WHERE ended_s IS NOT NULL
            UNION ALL
            SELECT 'throughput', pool, team, ended_s, CASE WHEN slow THEN 0 ELSE charged_mchip_s END, charged_mchip_s
            FROM base_progress WHERE slow IS NOT NULL
        """,
        # throughput SLO per pool, team and UTC day (of the intervals' ends): of the chip-seconds of the judged
        # intervals, the share at or above [slo] throughput_fraction of the job's reference rate. Units are never
        # added across jobs: only chip-seconds and seconds are
        "slo_throughput": f"""
            SELECT pool, team, {d.date('ended_s - ended_s % 86400')} AS day,
                   count(DISTINCT job_id) AS jobs_reporting, count(*) AS intervals,
                   CAST(sum(charged_mchip_s) AS BIGINT) AS reported_mchip_s,
                   CAST(sum(CASE WHEN slow IS NULL THEN 0 ELSE charged_mchip_s END) AS BIGINT) AS judged_mchip_s,
                   CAST(sum(CASE WHEN slow IS NULL OR slow THEN 0 ELSE charged_mchip_s END) AS BIGINT) AS good_mchip_s,
                   CAST(sum(CASE WHEN slow THEN charged_mchip_s ELSE 0 END) AS BIGINT) AS slow_mchip_s,
                   CAST(sum(slow_s) AS BIGINT) AS slow_s,
                   sum(CASE WHEN slow IS NULL OR slow THEN 0 ELSE charged_mchip_s END) * 1.0
                     / nullif(sum(CASE WHEN slow IS NULL THEN 0 ELSE charged_mchip_s END), 0) AS attainment,
                   (SELECT target FROM slo_targets WHERE slo = 'throughput') AS target
            FROM base_progress
            GROUP BY pool, team, ended_s - ended_s % 86400
        """,
        # good and total in each window (as_of_s - len_s, as_of_s] (the error budget's, window_days, and the burn-rate
        # alerts'), per SLO, pool and team ('' for availability, a pool's SLO: the labels of the Prometheus rules),
        # in one pass over the data: a row per SLO, pool and team with something measured, in any window or none
        # (n_<win>: the rows in the window; 0: it holds nothing)
        "calc_slo_sums": f"""
            SELECT 'availability' AS slo, pool, '' AS team, {availability_sums}
            FROM calc_free_steps CROSS JOIN calc_now GROUP BY pool
            UNION ALL
            SELECT slo, pool, coalesce(team, '') AS team, {point_sums}
            FROM calc_sli_points CROSS JOIN calc_now GROUP BY slo, pool, coalesce(team, '')
        """,
        # every SLO, pool and team with something measured
        "calc_slo_keys": "SELECT slo, pool, team FROM calc_slo_sums",
        # the windows: the error budget's (window_days) and the burn-rate alerts'
        "calc_windows": window_rows,
        # good and total per SLO, pool and window (win: budget, 5m, 30m, 1h, 6h, 3d), where the window holds a row
        "calc_slo_window": f"""
            SELECT slo, pool, team, win, good, total FROM (
                SELECT s.slo, s.pool, s.team, w.win, {pick('n')} AS n, CAST({pick('good')} AS BIGINT) AS good,
                       CAST({pick('total')} AS BIGINT) AS total
                FROM calc_slo_sums s CROSS JOIN calc_windows w
            ) x WHERE n > 0
        """,
        "error_budget": f"""
            WITH p AS (
                SELECT k.slo, k.pool, CAST(sum(coalesce(w.good, 0)) AS BIGINT) AS good,
                       CAST(sum(coalesce(w.total, 0)) AS BIGINT) AS total
                FROM calc_slo_keys k LEFT JOIN calc_slo_window w ON w.slo = k.slo AND w.pool = k.pool
                                                               AND w.team = k.team AND w.win = 'budget'
                GROUP BY k.slo, k.pool
            ), w AS (
                SELECT slo, pool, good, total FROM p
                UNION ALL
                SELECT slo, NULL, CAST(sum(good) AS BIGINT), CAST(sum(total) AS BIGINT) FROM p GROUP BY slo
            )
            SELECT w.slo, w.pool, {ts(f'as_of_s - {budget_window}')} AS window_start, {ts('as_of_s')} AS window_end,
                   t.target, CASE WHEN w.slo IN ('availability', 'goodput', 'throughput') THEN 'mchip_s' ELSE 'waits' END
                       AS unit,
                   w.good, w.total, w.total - w.good AS bad, w.good * 1.0 / nullif(w.total, 0) AS sli,
                   1 - t.target AS budget, (1 - t.target) * w.total AS allowed_bad,
                   (w.total - w.good) * 1.0 / nullif(w.total, 0) / (1 - t.target) AS consumed,
                   1 - (w.total - w.good) * 1.0 / nullif(w.total, 0) / (1 - t.target) AS remaining
            FROM w JOIN slo_targets t ON t.slo = w.slo CROSS JOIN calc_now
        """,
        # burn rate = (bad / total in the window) / (1 - target); an alert fires when both windows burn at least
        # its rate; budget_exhausted when the budget window's burn is at least 1 (its budget left below 0). Per SLO,
        # pool and team (NULL for availability): the label set of the Prometheus rules (chipledger slo rules)
        "burn_alerts": f"""
            WITH rules AS ({rules}), burn AS (
                SELECT w.slo, w.pool, w.team, w.win, t.target,
                       (w.total - w.good) * 1.0 / nullif(w.total, 0) / (1 - t.target) AS burn
                FROM calc_slo_window w JOIN slo_targets t ON t.slo = w.slo
            ), keys AS (
                SELECT k.slo, k.pool, k.team, t.target FROM calc_slo_keys k JOIN slo_targets t ON t.slo = k.slo
            ), b AS (
                SELECT r.alert, r.severity, k.slo, k.pool, nullif(k.team, '') AS team, r.burn_rate,
                       CASE WHEN r.long_win = 'budget' THEN CAST(CAST((SELECT window_days FROM slo_settings) AS BIGINT) AS VARCHAR) || 'd'
                            ELSE r.long_win END AS long_win,
                       CASE WHEN r.short_win = 'budget' THEN CAST(CAST((SELECT window_days FROM slo_settings) AS BIGINT) AS VARCHAR) || 'd'
                            ELSE r.short_win END AS short_win, k.target,
                       (SELECT burn FROM burn x WHERE x.slo = k.slo AND x.pool = k.pool AND x.team = k.team
                                                  AND x.win = r.long_win) AS long_burn,
                       (SELECT burn FROM burn x WHERE x.slo = k.slo AND x.pool = k.pool AND x.team = k.team
                                                  AND x.win = r.short_win) AS short_burn
                FROM rules r CROSS JOIN keys k
            )
            SELECT b.*, coalesce(long_burn >= burn_rate AND short_burn >= burn_rate, false) AS firing,
                   {ts('as_of_s')} AS evaluated_at
            FROM b CROSS JOIN calc_now
        """,
        "fragmentation": f"""
            SELECT pool, {ts('from_s')} AS valid_from, {ts('until_s')} AS valid_until, until_s - from_s AS duration_s,
                   free_whole_nodes_milli IS NOT NULL AS placement_known, free_milli / 1000.0 AS free_chips,
                   free_whole_nodes_milli / 1000.0 AS whole_node_free_chips,
                   (free_milli - free_whole_nodes_milli) / 1000.0 AS fragmented_chips,
                   CASE WHEN free_milli > 0 THEN (free_milli - free_whole_nodes_milli) * 1.0 / free_milli END
                       AS fragmentation,
                   largest_startable_milli / 1000.0 AS largest_job_chips
            FROM calc_free_steps WHERE until_s > from_s
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
