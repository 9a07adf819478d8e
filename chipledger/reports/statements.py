"""Periodic quota statements for teams (DESIGN §8): what a team was entitled to, what it used in quota,
borrowed and burst, what preemptions cost it and caused, whether the fleet kept its promises to it.

The figures come from the lake's views in a few set-based queries (every team at once), so a thousand teams
cost about what one does; rendering is per team. A statement is a pure function of the lake and the period:
it carries no wall-clock time, so issuing it again from the same lake (the same log positions, recorded in it)
writes byte-identical files. Every total is a sum of journal rows, so it reconciles with the journal to the
milli-chip-second; each pool the team used also gets the pool's own balance for the period
(Σ teams' use + idle + unavailable = capacity + overcommitted), checked before anything is written.

Formats: JSON (integer milli-chip-seconds, the reference), CSV (one row per pool and a total), Markdown and
HTML (summary table, then a chart of use against quota, then details; rendered with jinja2 templates, the
chart with matplotlib as SVG).
"""

from __future__ import annotations

import hashlib
import io
import re
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Iterable, Optional, Sequence
from urllib.parse import quote

import orjson

from analytics.slo_views import SloParams
from chipledger.reports.costs import team_costs

FORMATS = ("md", "html", "csv", "json")
FOLD_ROWS = 50  # rows of a long table (preemptions, fair share) shown in Markdown and HTML; the rest folded
# /2: `totals` is a list per flavor (was: every pool added up, across unlike chips) and `totals_by_flavor` is gone;
# `daily` rows are per flavor and day (were: all pools added up)
STATEMENT_SCHEMA = "chipledger.statement/2"
TOP_JOBS = 10
MCHIP_S_PER_CHIP_H = 3_600_000
TEAM_ACCOUNTS = ("entitled", "in_quota", "borrowed", "burst", "pending")
UTC = timezone.utc
# the SLO base tables and intermediates the statements read (sched_waits, error_budget), computed once per issue
STATEMENT_TABLES = ("base_runs", "base_pool_end", "base_waits", "calc_free_steps", "calc_waits",
                    "calc_slo_sums")


class StatementError(ValueError):
    """A statement cannot be issued as asked (bad period, unknown team, empty lake); the message says why."""


# ---------------------------------------------------------------------------------------------------------
# periods
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Period:
    """A statement period: [start, end) in UTC. `label` names it in file names and the store."""

    label: str
    kind: str  # month | week | custom
    start: datetime
    end: datetime

    def as_dict(self) -> dict:
        return {"label": self.label, "kind": self.kind, "start": _iso(self.start), "end": _iso(self.end)}


_MONTH = re.compile(r"^(\d{4})-(\d{2})$")
_WEEK = re.compile(r"^(\d{4})-W(\d{2})$")


def _day(text: str, what: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise StatementError(f"{what} {text!r} is not a date (YYYY-MM-DD)") from None


def parse_period(text: str) -> Period:
    """`2026-11` (a calendar month), `2026-W45` (an ISO week, Monday to Monday), or `FROM..TO` (dates, both
    days included), all in UTC."""
    text = text.strip()
    m = _MONTH.match(text)
    if m:
        year, month = int(m.group(1)), int(m.group(2))
        if not 1 <= month <= 12:
            raise StatementError(f"period {text!r}: month must be 01-12")
        start = datetime(year, month, 1, tzinfo=UTC)
        end = datetime(year + (month == 12), month % 12 + 1, 1, tzinfo=UTC)
        return Period(text, "month", start, end)
    m = _WEEK.match(text)
    if m:
        try:
            monday = date.fromisocalendar(int(m.group(1)), int(m.group(2)), 1)
        except ValueError:
            raise StatementError(f"period {text!r}: no such ISO week") from None
        start = datetime(monday.year, monday.month, monday.day, tzinfo=UTC)
        return Period(text, "week", start, start + timedelta(days=7))
    if ".." in text:
        a, b = text.split("..", 1)
        first, last = _day(a, "period start"), _day(b, "period end")
        if last < first:
            raise StatementError(f"period {text!r}: the end {last} is before the start {first}")
        start = datetime(first.year, first.month, first.day, tzinfo=UTC)
        end = datetime(last.year, last.month, last.day, tzinfo=UTC) + timedelta(days=1)
        return Period(f"{first}..{last}", "custom", start, end)
    raise StatementError(f"period {text!r} is not YYYY-MM, YYYY-Www or YYYY-MM-DD..YYYY-MM-DD")


def period_containing(kind: str, instant: datetime) -> Period:
    """The month or ISO week that contains `instant`."""
    if kind == "month":
        return parse_period(f"{instant.year:04d}-{instant.month:02d}")
    if kind == "week":
        year, week, _ = instant.date().isocalendar()
        return parse_period(f"{year:04d}-W{week:02d}")
    raise StatementError(f"--every must be week or month, not {kind!r}")


def closed_periods(kind: str, first: datetime, closed_through: datetime) -> list[Period]:
    """Every period of `kind` from the one containing `first` whose books are closed (end <= closed_through)."""
    out = []
    p = period_containing(kind, first)
    while p.end <= closed_through:
        out.append(p)
        p = period_containing(kind, p.end)
    return out


# ---------------------------------------------------------------------------------------------------------
# computing
# ---------------------------------------------------------------------------------------------------------

def _iso(t: Optional[datetime]) -> Optional[str]:
    if t is None:
        return None
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ratio(num: int, den: int) -> Optional[float]:
    return round(num / den, 6) if den else None


def _chip_h(mchip_s: int) -> float:
    return round(mchip_s / MCHIP_S_PER_CHIP_H, 3)


def _rows(con, sql: str, params: Sequence = ()) -> list[tuple]:
    return con.execute(sql, list(params)).fetchall()


def lake_positions(con) -> dict[str, int]:
    """The log positions the lake holds: the highest offset per input topic-partition, applied or dead-lettered."""
    rows = _rows(con, """
        SELECT topic, "partition", max("offset") FROM (
            SELECT topic, "partition", "offset" FROM event_log
            UNION ALL SELECT topic, "partition", "offset" FROM deadletters)
        GROUP BY ALL ORDER BY ALL""")
    return {f"{topic}/{partition}": int(offset) for topic, partition, offset in rows}


def books_closed_through(con) -> dict[str, datetime]:
    """Per pool, the instant its books are closed through: the pool clock when the books were closed at it
    (the embedded run's end), else the end of the last hour posted (the worker posts whole hours)."""
    rows = _rows(con, """
        WITH c AS (SELECT pool, max(applied_at) AS clock FROM event_log GROUP BY pool),
             h AS (SELECT pool, max(hour) + INTERVAL 1 HOUR AS hour_end FROM journal_postings GROUP BY pool)
        SELECT c.pool, least(c.clock, coalesce(h.hour_end, c.clock)) FROM c LEFT JOIN h USING (pool)
        ORDER BY 1""")
    return {pool: t.astimezone(UTC) for pool, t in rows}


def books_closed_through_files(lake: Path) -> dict[str, datetime]:
    import duckdb

    from analytics.lake import read_parquet_sql, table_files

    events, journal = table_files(lake, "events"), table_files(lake, "journal")
    if events is None:
        return {}
    con = duckdb.connect()
    try:
        con.execute(f"CREATE VIEW event_log AS SELECT pool, applied_at FROM ({read_parquet_sql(events)})")
        if journal is None:
            con.execute("CREATE VIEW journal_postings AS SELECT NULL::VARCHAR AS pool, NULL::TIMESTAMPTZ AS hour "
                        "WHERE false")
        else:
            con.execute(f"CREATE VIEW journal_postings AS SELECT pool, hour FROM ({read_parquet_sql(journal)})")
        return books_closed_through(con)
    finally:
        con.close()


def known_teams(con) -> list[str]:
    rows = _rows(con, """
        SELECT team FROM journal_postings WHERE team IS NOT NULL
        UNION SELECT team FROM job_runs UNION SELECT team FROM base_waits WHERE team IS NOT NULL ORDER BY 1""")
    return [r[0] for r in rows]


def _percentile(sorted_values: list[int], p: float) -> Optional[int]:
    """Nearest rank: the smallest value with at least p of the values at or below it (as slo_sched_latency)."""
    n = len(sorted_values)
    if not n:
        return None
    for i, v in enumerate(sorted_values, start=1):
        if i >= p * n:
            return v
    return sorted_values[-1]


def _empty_accounts() -> dict[str, int]:
    return {a: 0 for a in TEAM_ACCOUNTS}


def _account_block(acc: dict[str, int]) -> dict:
    used = acc["in_quota"] + acc["borrowed"] + acc["burst"]
    block = {
        "entitled_mchip_s": acc["entitled"], "in_quota_mchip_s": acc["in_quota"],
        "borrowed_mchip_s": acc["borrowed"], "burst_mchip_s": acc["burst"], "used_mchip_s": used,
        # in_quota = min(use, nominal) at every instant, so this is never negative
        "unused_entitlement_mchip_s": acc["entitled"] - acc["in_quota"],
        "pending_mchip_s": acc["pending"],
    }
    for k in list(block):
        block[k.replace("_mchip_s", "_chip_h")] = _chip_h(block[k])
    return block


def compute_statements(con, period: Period, *, teams: Optional[Iterable[str]] = None,
                       slo: Optional[SloParams] = None) -> list[dict]:
    """One statement (a JSON-ready dict) per team for `period`, from a connection made by
    `analytics.views.connect` (whose SLO settings should be `slo`). Raises StatementError when the lake has
    no books or an asked-for team is unknown, and AssertionError if a pool's books do not balance (a bug)."""
    slo = slo or SloParams()
    closed = books_closed_through(con)
    if not closed:
        raise StatementError("the lake has no applied events: run `chipledger run` (or the worker and sink) first")
    books_end = max(closed.values())
    if period.start >= books_end:  # nothing of it is in the books: an error, not a set of all-zero statements
        raise StatementError(f"period {period.label} starts at {_iso(period.start)}, after the books end "
                             f"({_iso(books_end)}): nothing to state yet (a period up to {books_end:%Y-%m-%d} "
                             f"is partial)")
    all_teams = known_teams(con)
    if teams is None:
        chosen = all_teams
    else:
        chosen = sorted(set(teams))
        unknown = [t for t in chosen if t not in set(all_teams)]
        if unknown:
            raise StatementError(f"unknown team(s) {', '.join(map(repr, unknown))}; the lake knows: "
                                 f"{', '.join(all_teams) or 'none'}")
    want = set(chosen)
    p = (period.start, period.end)
    positions = lake_positions(con)

    # the books of the period, read once: per team and pool, per account; per pool, per account
    # (reconciliation); per team and day
    con.execute("""CREATE OR REPLACE TEMP TABLE statement_journal AS
                   SELECT pool, hour, account, team, sum(amount_mchip_s)::BIGINT AS amount FROM journal_postings
                   WHERE hour >= ? AND hour < ? GROUP BY ALL""", list(p))
    accounts: dict[str, dict[str, dict[str, int]]] = {}
    for team, pool, account, amount in _rows(con, """
            SELECT team, pool, account, sum(amount)::BIGINT FROM statement_journal
            WHERE team IS NOT NULL GROUP BY ALL ORDER BY ALL"""):
        if team in want and account in TEAM_ACCOUNTS:
            accounts.setdefault(team, {}).setdefault(pool, _empty_accounts())[account] = int(amount)
    pool_books: dict[str, dict[str, int]] = {}
    for pool, account, amount in _rows(con, """
            SELECT pool, CASE WHEN team IS NULL THEN account ELSE 'team:' || account END, sum(amount)::BIGINT
            FROM statement_journal GROUP BY ALL ORDER BY ALL"""):
        pool_books.setdefault(pool, {})[account] = int(amount)
    pool_daily: dict[str, dict[str, dict[str, dict[str, int]]]] = {}  # team -> pool -> day -> account
    for team, pool, day, account, amount in _rows(con, """
            SELECT team, pool, CAST(date_trunc('day', hour) AS DATE), account, sum(amount)::BIGINT
            FROM statement_journal WHERE team IS NOT NULL AND account IN ('entitled', 'in_quota', 'borrowed', 'burst')
            GROUP BY ALL ORDER BY ALL"""):
        if team in want:
            pool_daily.setdefault(team, {}).setdefault(pool, {}).setdefault(day.isoformat(), {})[account] = int(amount)

    # preemptions suffered: runs of the team's jobs that ended preempted in the period, with the decision that
    # asked for it (when the cluster named one) and that decision's beneficiary
    suffered: dict[str, list[dict]] = {}
    for team, pool, job_id, ended_at, chips_milli, alloc, lost, decision_id, ben_team, ben_job in _rows(con, """
            WITH pe AS (  -- only the preemptions' bodies are parsed
                SELECT pool, json_extract_string(body, '$.job_id') AS job_id, applied_at,
                       any_value(json_extract_string(body, '$.decision_id')) AS decision_id
                FROM event_log WHERE type = 'job.preempted' GROUP BY ALL)
            SELECT r.team, r.pool, r.job_id, r.ended_at, r.chips_milli, r.allocated_mchip_s, r.lost_mchip_s,
                   pe.decision_id, d.body->>'$.beneficiary.team', d.body->>'$.beneficiary.job_id'
            FROM job_run_totals r
            LEFT JOIN pe ON pe.pool = r.pool AND pe.job_id = r.job_id AND pe.applied_at = r.ended_at
            LEFT JOIN decisions d ON d.decision_id = pe.decision_id
            WHERE r.end_reason = 'preempted' AND r.ended_at >= ? AND r.ended_at < ?
            ORDER BY r.team, r.ended_at, r.pool, r.job_id""", p):
        if team in want:
            suffered.setdefault(team, []).append({
                "job_id": job_id, "pool": pool, "at": _iso(ended_at), "chips": chips_milli / 1000,
                "allocated_mchip_s": int(alloc), "lost_work_mchip_s": int(lost), "decision_id": decision_id,
                "beneficiary_team": ben_team, "beneficiary_job_id": ben_job})
    # other interruptions (DESIGN §4's causes): runs requeued by an admin or interrupted by a failure in the period;
    # their work lost counts in goodput, but they are not preemptions
    interrupted: dict[str, dict[str, dict]] = {}
    for team, cause, runs, lost in _rows(con, """
            SELECT team, end_reason, count(*), sum(lost_mchip_s)::BIGINT FROM job_run_totals
            WHERE end_reason IN ('requeued', 'failure') AND ended_at >= ? AND ended_at < ?
            GROUP BY ALL ORDER BY ALL""", p):
        if team in want:
            interrupted.setdefault(team, {})[cause] = {"count": int(runs), "lost_work_mchip_s": int(lost or 0)}
    # preemptions caused: decisions the ledger issued for the team's jobs, with the work they cost, split into
    # the team's own jobs (the priority rule preempts within a team) and other teams' jobs
    caused: dict[str, list[dict]] = {}
    for team, decision_id, pool, at, rule, job_id, victims, own, lost_chip_s, own_lost_chip_s in _rows(con, """
            WITH v AS (SELECT dv.decision_id, count(*) AS n, count(*) FILTER (WHERE dv.team = d.team) AS own,
                              sum(dv.lost_work_chip_s) AS lost,
                              sum(dv.lost_work_chip_s) FILTER (WHERE dv.team = d.team) AS own_lost
                       FROM decision_victims dv JOIN decisions d USING (decision_id) GROUP BY dv.decision_id)
            SELECT d.team, d.decision_id, d.pool, d."at", d.rule, d.beneficiary_job_id, coalesce(v.n, 0),
                   coalesce(v.own, 0), coalesce(v.lost, 0), coalesce(v.own_lost, 0)
            FROM decisions d LEFT JOIN v USING (decision_id)
            WHERE d.type = 'decision.preempt' AND d."at" >= ? AND d."at" < ?
            ORDER BY d.team, d."at", d.decision_id""", p):
        if team in want:
            caused.setdefault(team, []).append({
                "decision_id": decision_id, "pool": pool, "at": _iso(at), "rule": rule, "job_id": job_id,
                "victims": int(victims), "own_victims": int(own), "others_victims": int(victims) - int(own),
                "lost_work_mchip_s": int(lost_chip_s) * 1000,
                "own_lost_work_mchip_s": int(own_lost_chip_s) * 1000,
                "others_lost_work_mchip_s": (int(lost_chip_s) - int(own_lost_chip_s)) * 1000})
    # goodput over the run postings of the period
    goodput = {team: (int(a), int(lost)) for team, a, lost in _rows(con, """
            SELECT team, sum(allocated_mchip_s)::BIGINT, sum(lost_mchip_s)::BIGINT FROM job_runs
            WHERE posted_at >= ? AND posted_at < ? GROUP BY team""", p)}
    throughput = _throughput_blocks(con, p, want, slo)
    # scheduling waits that began in the period (first starts and restarts), with their SLO result
    waits: dict[str, list[tuple]] = {}
    for team, kind, quota_class, wait_s, started, result, blocked_mchip_s in _rows(con, """
            SELECT team, kind, quota_class, wait_s, started_at IS NOT NULL, slo_result, blocked_s * chips_milli
            FROM sched_waits WHERE waiting_since >= ? AND waiting_since < ? ORDER BY team, wait_s""", p):
        if team in want:
            waits.setdefault(team, []).append((kind, quota_class, wait_s, started, result, blocked_mchip_s))
    # error budgets of the pools, evaluated at the connection's as_of (the period's end, or the books' end)
    budgets: dict[str, list[dict]] = {}
    for slo_name, pool, sli, target, consumed, remaining in _rows(con, """
            SELECT slo, pool, sli, target, consumed, remaining FROM error_budget WHERE pool IS NOT NULL
            ORDER BY pool, slo"""):
        budgets.setdefault(pool, []).append({
            "slo": slo_name, "sli": _round(sli), "target": target, "consumed": _round(consumed),
            "remaining": _round(remaining),
            "status": "no data" if remaining is None else ("exhausted" if remaining <= 0 else "ok")})
    # fair-share factor trend: per pool, the day's last value
    trend: dict[str, dict[str, list]] = {}
    for team, pool, day, factor, share in _rows(con, """
            SELECT team, pool, CAST(date_trunc('day', "at" - INTERVAL 1 SECOND) AS DATE) AS day,
                   arg_max(fair_share_factor, "at"), arg_max(borrowed_share, "at")
            FROM balances WHERE "at" > ? AND "at" <= ? GROUP BY ALL ORDER BY ALL""", p):
        if team in want:
            trend.setdefault(team, {}).setdefault(pool, []).append(
                {"day": day.isoformat(), "fair_share_factor": _round(factor), "borrowed_share": _round(share)})
    # top jobs by chip-seconds allocated in the period
    top: dict[str, list[dict]] = {}
    for team, pool, job_id, submitted_at, chips_milli, runs, alloc, lost, preempted in _rows(con, """
            WITH j AS (
                SELECT team, pool, job_id, submitted_at, any_value(chips_milli) AS chips_milli,
                       count(DISTINCT run_index) AS runs, sum(allocated_mchip_s)::BIGINT AS alloc,
                       sum(lost_mchip_s)::BIGINT AS lost,
                       count(DISTINCT run_index) FILTER (WHERE end_reason = 'preempted') AS preempted
                FROM job_runs WHERE posted_at >= ? AND posted_at < ? GROUP BY ALL)
            SELECT * FROM j QUALIFY row_number() OVER (PARTITION BY team ORDER BY alloc DESC, pool, job_id,
                                                       submitted_at) <= ?
            ORDER BY team, alloc DESC, pool, job_id, submitted_at""", (*p, TOP_JOBS)):
        if team in want:
            top.setdefault(team, []).append({
                "job_id": job_id, "pool": pool, "submitted_at": _iso(submitted_at), "chips": chips_milli / 1000,
                "runs": int(runs), "preemptions": int(preempted), "allocated_mchip_s": int(alloc),
                "allocated_chip_h": _chip_h(int(alloc)), "lost_work_mchip_s": int(lost)})

    reconciliation = {pool: _reconcile(pool, books) for pool, books in pool_books.items()}
    # chips of unlike flavors are never added up (an A100 chip-hour is not an H100's): totals per flavor
    flavors = dict(_rows(con, """SELECT pool, arg_max(body->>'$.flavor', applied_at) FROM events
                                 WHERE type = 'pool.configured' GROUP BY pool"""))
    costs = team_costs(con, period.start, period.end, want)
    fleet_closed = min(closed.values())
    out = []
    for team in chosen:
        team_pools = sorted(set(accounts.get(team, {})) | {s["pool"] for s in suffered.get(team, [])})
        pool_closed = [closed[pl] for pl in team_pools if pl in closed] or [fleet_closed]
        closed_through = min(pool_closed)
        per_pool = accounts.get(team, {})
        alloc, lost = goodput.get(team, (0, 0))
        out.append({
            "schema": STATEMENT_SCHEMA,
            "team": team,
            "period": period.as_dict(),
            "partial": closed_through < period.end,
            "books_closed_through": _iso(min(closed_through, period.end)),
            "computed_at_positions": positions,
            # chips of unlike flavors are never added up: one total per flavor (money totals: cost.totals, per unit)
            "totals": _flavor_totals(per_pool, team_pools, flavors),
            "cost": costs.get(team) or {"priced": False, "by_pool": [], "totals": [], "budgets": [], "peak": [],
                                        "peak_totals": []},
            "pools": [{"pool": pl, "flavor": flavors.get(pl), **_account_block(per_pool.get(pl, _empty_accounts())),
                       "daily": _daily_rows(pool_daily.get(team, {}).get(pl, {}))} for pl in team_pools],
            "daily": _flavor_daily(pool_daily.get(team, {}), flavors),
            "preemptions": {
                "suffered": _preemption_block(suffered.get(team, []), "jobs"),
                "caused": _caused_block(caused.get(team, [])),
            },
            "interruptions": {cause: interrupted.get(team, {}).get(cause, {"count": 0, "lost_work_mchip_s": 0})
                              for cause in ("requeued", "failure")},
            "goodput": {"allocated_mchip_s": alloc, "lost_mchip_s": lost, "goodput": _ratio(alloc - lost, alloc),
                        "target": slo.goodput, "met": None if not alloc else (alloc - lost) / alloc >= slo.goodput},
            "throughput": throughput.get(team) or _throughput_block(None, [], [], slo),
            "scheduling": _scheduling_block(waits.get(team, []), slo),
            "quota_honoured": _quota_block(waits.get(team, []), slo),
            "error_budgets": [{"pool": pl, **b} for pl in team_pools for b in budgets.get(pl, [])],
            "fair_share": [{"pool": pl, "days": days} for pl, days in sorted(trend.get(team, {}).items())],
            "top_jobs": top.get(team, []),
            "reconciliation": [reconciliation[pl] for pl in team_pools if pl in reconciliation],
        })
    return out


def _throughput_blocks(con, p: tuple, want: set, slo: SloParams) -> dict[str, dict]:
    """Per team, the throughput SLO of the progress intervals that ended in the period: chip time judged against
    each job's own reference rate, how much of it ran below [slo] throughput_fraction of it, on which unhealthy
    chips, and the jobs that ran slow longest (chip-seconds and seconds only: units are never added across jobs)."""
    totals = {team: row for team, *row in _rows(con, """
            SELECT team, count(DISTINCT (pool, job_id, submitted_at)),
                   coalesce(sum(charged_mchip_s) FILTER (WHERE slow IS NOT NULL), 0)::BIGINT,
                   coalesce(sum(charged_mchip_s) FILTER (WHERE slow), 0)::BIGINT, coalesce(sum(slow_s), 0)::BIGINT
            FROM progress WHERE ended_at >= ? AND ended_at < ? GROUP BY team""", p) if team in want}
    chips: dict[str, list] = {}
    for team, pool, chip, mchip_s in _rows(con, """
            SELECT team, pool, chip, sum(charged_mchip_s)::BIGINT FROM (
                SELECT team, pool, charged_mchip_s, unnest(string_split(unhealthy_chips, ',')) AS chip
                FROM progress WHERE slow AND unhealthy_chips <> '' AND ended_at >= ? AND ended_at < ?)
            GROUP BY ALL ORDER BY team, 4 DESC, pool, chip""", p):
        if team in want and len(chips.setdefault(team, [])) < TOP_JOBS:
            name, _, state = chip.rpartition(":")
            chips[team].append({"pool": pool, "chip_id": name, "state": state, "slow_mchip_s": int(mchip_s)})
    jobs: dict[str, list] = {}
    for team, pool, job_id, slow_mchip_s, slow_s, worst in _rows(con, """
            SELECT team, pool, job_id, sum(charged_mchip_s)::BIGINT, sum(slow_s)::BIGINT,
                   min(units_per_chip_s / reference_units_per_chip_s)
            FROM progress WHERE slow AND ended_at >= ? AND ended_at < ?
            GROUP BY team, pool, job_id, submitted_at ORDER BY team, 4 DESC, pool, job_id""", p):
        if team in want and len(jobs.setdefault(team, [])) < TOP_JOBS:
            jobs[team].append({"pool": pool, "job_id": job_id, "slow_mchip_s": int(slow_mchip_s),
                               "slow_s": int(slow_s), "slowest_fraction": _round(worst)})
    return {team: _throughput_block(row, chips.get(team, []), jobs.get(team, []), slo) for team, row in totals.items()}


def _throughput_block(row: Optional[list], chips: list, jobs: list, slo: SloParams) -> dict:
    n, judged, slow, slow_s = row if row is not None else (0, 0, 0, 0)
    judged, slow = int(judged), int(slow)
    attained = _ratio(judged - slow, judged)
    return {"jobs_reporting": int(n), "judged_mchip_s": judged, "slow_mchip_s": slow, "slow_chip_h": _chip_h(slow),
            "slow_s": int(slow_s), "attainment": attained, "target": slo.throughput,
            "fraction": slo.throughput_fraction, "met": None if attained is None else attained >= slo.throughput,
            "slow_on_chips": chips, "slow_jobs": jobs}


def _daily_rows(days: dict[str, dict[str, int]]) -> list[dict]:
    return [{"day": d, **{f"{a}_mchip_s": v.get(a, 0) for a in ("entitled", "in_quota", "borrowed", "burst")}}
            for d, v in sorted(days.items())]


def _flavor_daily(pool_days: dict[str, dict[str, dict[str, int]]], flavors: dict) -> list[dict]:
    """The team's accounts per flavor and UTC day (its pools of one flavor added up, never across flavors)."""
    by: dict[tuple[str, str], dict[str, int]] = {}
    for pl, days in pool_days.items():
        for day, acc in days.items():
            d = by.setdefault((flavors.get(pl) or pl, day), {})
            for a, v in acc.items():
                d[a] = d.get(a, 0) + v
    return [{"flavor": f, "day": day, **{f"{a}_mchip_s": v.get(a, 0) for a in ("entitled", "in_quota", "borrowed",
                                                                             "burst")}}
            for (f, day), v in sorted(by.items())]


def _flavor_totals(per_pool: dict, team_pools: list, flavors: dict) -> list[dict]:
    """The team's accounts summed per flavor (the pools' `pool.configured` flavor), never across flavors."""
    by: dict[str, tuple[list, dict]] = {}
    for pl in team_pools:
        pools, total = by.setdefault(flavors.get(pl) or pl, ([], _empty_accounts()))
        pools.append(pl)
        for k in TEAM_ACCOUNTS:
            total[k] += per_pool.get(pl, _empty_accounts())[k]
    return [{"flavor": f, "pools": pools, **_account_block(total)} for f, (pools, total) in sorted(by.items())]


def _round(x) -> Optional[float]:
    return None if x is None else round(float(x), 6)


def _preemption_block(items: list[dict], what: str) -> dict:
    return {"count": len(items), "lost_work_mchip_s": sum(i["lost_work_mchip_s"] for i in items),
            "lost_work_chip_h": _chip_h(sum(i["lost_work_mchip_s"] for i in items)), what: items}


def _caused_block(items: list[dict]) -> dict:
    block = _preemption_block(items, "decisions")
    for k in ("victims", "own_victims", "others_victims"):
        block[k] = sum(i[k] for i in items)
    for who in ("own", "others"):
        block[f"{who}_lost_work_mchip_s"] = sum(i[f"{who}_lost_work_mchip_s"] for i in items)
        block[f"{who}_lost_work_chip_h"] = _chip_h(block[f"{who}_lost_work_mchip_s"])
    return block


def _scheduling_block(waits: list[tuple], slo: SloParams) -> dict:
    started = sorted(w[2] for w in waits if w[3])
    decided = [w for w in waits if w[4] != "open"]
    within = sum(1 for w in decided if w[4] == "within")
    return {
        "waits": len(waits), "started": len(started),
        "first_starts": sum(1 for w in waits if w[0] == "first_start"),
        "restarts": sum(1 for w in waits if w[0] == "restart"),
        "p50_s": _percentile(started, 0.5), "p90_s": _percentile(started, 0.9),
        "p99_s": _percentile(started, 0.99), "sched_slo_s": slo.sched_slo_s,
        "within_slo": _ratio(within, len(decided)), "target": slo.sched_latency,
        "met": None if not decided else within / len(decided) >= slo.sched_latency,
        # head-of-line blocking (the fold's waits.blocked_s): waits that could have started and did not
        "hol_blocked_waits": sum(1 for w in waits if w[5]),
        "hol_blocked_chip_h": _chip_h(sum(w[5] or 0 for w in waits)),
    }


def _quota_block(waits: list[tuple], slo: SloParams) -> dict:
    mine = [w for w in waits if w[0] == "first_start" and w[1] == "in_quota"]
    honoured = sum(1 for w in mine if w[4] == "within")
    late = sum(1 for w in mine if w[4] == "late")
    return {"in_quota_submissions": len(mine), "honoured": honoured, "late": late,
            "open": len(mine) - honoured - late, "attainment": _ratio(honoured, honoured + late),
            "target": slo.quota_honoured,
            "met": None if not honoured + late else honoured / (honoured + late) >= slo.quota_honoured}


def _reconcile(pool: str, books: dict[str, int]) -> dict:
    """DESIGN §4: teams' use + idle + unavailable = capacity + overcommitted, over the period."""
    used = sum(books.get(f"team:{a}", 0) for a in ("in_quota", "borrowed", "burst"))
    row = {"pool": pool, "capacity_mchip_s": books.get("capacity", 0),
           "overcommitted_mchip_s": books.get("overcommitted", 0), "unavailable_mchip_s": books.get("unavailable", 0),
           "idle_mchip_s": books.get("idle", 0), "teams_used_mchip_s": used}
    left = used + row["idle_mchip_s"] + row["unavailable_mchip_s"]
    right = row["capacity_mchip_s"] + row["overcommitted_mchip_s"]
    if left != right:
        raise AssertionError(f"pool {pool}: the books do not balance over the period: use + idle + unavailable = "
                             f"{left} but capacity + overcommitted = {right} (milli-chip-seconds)")
    row["balanced"] = True
    return row


# ---------------------------------------------------------------------------------------------------------
# rendering: pure functions of a statement dict, so the same statement gives the same bytes
# ---------------------------------------------------------------------------------------------------------

STEM_MAX_BYTES = 200  # the longest stem kept as it is: stem + ".html" stays well under NAME_MAX (255 bytes)


def file_stem(team: str) -> str:
    """A file name for a team (team names may be paths such as org/team): percent-encoded, reversible, and
    never hidden (a leading dot is %2E). A name longer than STEM_MAX_BYTES encoded (a 256-character team, or
    30 CJK characters, 9 bytes each encoded) is cut and ends with `%~` and 16 hex digits of its sha256: a
    quoted name never holds `%~`, so a cut stem matches no other team's."""
    stem = quote(team, safe="-_.@+=") or "%00"
    if stem.startswith("."):
        stem = "%2E" + stem[1:]
    if len(stem) > STEM_MAX_BYTES:
        cut = stem[:STEM_MAX_BYTES - 18]
        if "%" in cut[-2:]:  # never split a %XX
            cut = cut[:cut.rindex("%")]
        stem = cut + "%~" + hashlib.sha256(team.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return stem


def render_json(st: dict) -> bytes:
    return orjson.dumps(st, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"


CSV_COLUMNS = ("period", "team", "pool", "partial", "books_closed_through", "entitled_mchip_s", "in_quota_mchip_s",
               "borrowed_mchip_s", "burst_mchip_s", "used_mchip_s", "unused_entitlement_mchip_s", "pending_mchip_s",
               "entitled_chip_h", "in_quota_chip_h", "borrowed_chip_h", "burst_chip_h", "used_chip_h",
               "unused_entitlement_chip_h")


def render_csv(st: dict) -> bytes:
    import csv

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    head = {"period": st["period"]["label"], "team": st["team"], "partial": str(st["partial"]).lower(),
            "books_closed_through": st["books_closed_through"]}
    # a total row per flavor: chips of unlike flavors are never added up
    for row in [*st["pools"], *({**t, "pool": f"(total {t['flavor']})"} for t in st["totals"])]:
        merged = {**head, **row}
        w.writerow([merged.get(c, "") for c in CSV_COLUMNS])
    return buf.getvalue().encode()


_SERIES = (("in_quota", "in quota", "#4c78a8"), ("borrowed", "borrowed", "#f58518"), ("burst", "burst", "#54a24b"))
_CHARTS: dict[int, tuple] = {}  # per number of panels, one figure per process whose artists are updated for
                                # each chart: building a figure costs more than drawing it, and a thousand
                                # statements draw a thousand charts


def _chart(panels: int):
    if panels not in _CHARTS:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure

        with matplotlib.rc_context({"font.size": 8}):
            fig = Figure(figsize=(7.5, 0.4 + 2.4 * panels), dpi=100)
            fig.subplots_adjust(left=0.08, right=0.99, top=1 - 0.25 / (0.4 + 2.4 * panels),
                                bottom=0.3 / (0.4 + 2.4 * panels), hspace=0.45)
            arts = []
            for ax in fig.subplots(panels, 1, squeeze=False)[:, 0]:
                patches = [ax.stairs([0.0], [0.0, 1.0], baseline=[0.0], fill=True, label=label, color=color)
                           for _, label, color in _SERIES]
                quota = ax.stairs([0.0], [0.0, 1.0], color="black", linewidth=1.2, label="quota (entitled)")
                ax.legend(loc="upper left", fontsize=7, ncols=4, frameon=False)
                ax.set_ylabel("chips (daily average)")
                empty = ax.text(0.5, 0.5, "no use and no quota in this period", ha="center", va="center",
                                transform=ax.transAxes)
                title = ax.set_title("", fontsize=8, loc="right")
                arts.append((ax, patches, quota, empty, title))
        _CHARTS[panels] = (fig, arts)
    return _CHARTS[panels]


def _chart_panels(st: dict) -> list[tuple[str, list[dict]]]:
    """One panel per pool the team used or held quota in (chips of two pools are different chips: an H100 day
    and a TPU-core day are never added), on the period's days."""
    panels = [(p["pool"], p["daily"]) for p in st["pools"] if p.get("daily")]
    return panels or [("", [])]


def chart_svg(st: dict) -> bytes:
    """Use against quota over the period, per pool: per day, average chips in quota, borrowed and burst
    (stacked steps) against the average chips the team was entitled to (a step line). Deterministic SVG (no
    date, fixed ids)."""
    import matplotlib

    per_day = 86_400_000  # milli-chip-seconds in one chip-day
    panels = _chart_panels(st)
    all_days = sorted({d["day"] for _, days in panels for d in days})
    n = len(all_days)
    xs = list(range(n))
    edges = [x - 0.5 for x in xs] + [n - 0.5]
    fig, arts = _chart(len(panels))
    with matplotlib.rc_context({"svg.hashsalt": "chipledger", "svg.fonttype": "none", "font.size": 8}):
        for (pool, days), (ax, patches, quota, empty, title) in zip(panels, arts):
            by_day = {d["day"]: d for d in days}
            rows = [by_day.get(day, {}) for day in all_days]
            bottom = [0.0] * n
            for (key, _, _), patch in zip(_SERIES, patches):
                upper = [b + r.get(f"{key}_mchip_s", 0) / per_day for b, r in zip(bottom, rows)]
                patch.set_data(upper or [0.0], edges if n else [0.0, 1.0], baseline=bottom or [0.0])
                bottom = upper
            entitled = [r.get("entitled_mchip_s", 0) / per_day for r in rows]
            quota.set_data(entitled or [0.0], edges if n else [0.0, 1.0], baseline=None)
            ax.set_xlim(-0.5, max(n, 1) - 0.5)
            ax.set_ylim(0, max([*bottom, *entitled, 1.0]) * 1.3)  # room for the legend above the steps
            step = max(1, -(-n // 10))  # at most ten day labels
            ax.set_xticks(xs[::step], [d[5:] for d in all_days][::step])
            empty.set_visible(not n)
            title.set_text(pool)
        buf = io.BytesIO()
        # the title is the page's heading; the file keeps it as metadata (a drawn title costs a fifth of the time)
        fig.savefig(buf, format="svg",
                    metadata={"Date": None, "Title": f"{st['team']}: use against quota, {st['period']['label']}"})
    return buf.getvalue()


# characters a Markdown viewer would read as markup (emphasis, code, links, raw HTML, entities, table cells)
_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|&~!#(){}])")


class _MdRaw(str):
    """A value the Markdown template writes as it is (a link target already encoded)."""


def _md_text(value) -> str:
    """Every value a Markdown statement writes, as literal text (CommonMark backslash escapes; a line break
    would end a table row): a team named `<img onerror=…>` or `[x](javascript:…)` stays text in any viewer."""
    if isinstance(value, _MdRaw):
        return value
    return _MD_SPECIAL.sub(r"\\\1", str(value).replace("\r", " ").replace("\n", " "))


def _jinja_env(markdown: bool = False):
    """HTML templates escape every value (autoescape on for every template, whatever its file name: the
    extension of statement.html.j2 is .j2); the Markdown template writes every value through `_md_text`."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("chipledger.reports", "templates"),
                             autoescape=not markdown, finalize=_md_text if markdown else None,
                             trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    env.filters["chip_h"] = lambda v: "" if v is None else f"{v / MCHIP_S_PER_CHIP_H:,.1f}"
    env.filters["pct"] = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"
    env.filters["secs"] = lambda v: "n/a" if v is None else f"{v:,} s"
    env.filters["yesno"] = lambda v: "n/a" if v is None else ("met" if v else "missed")
    env.filters["factor"] = lambda v: "n/a" if v is None else f"{v:.3f}"  # the fair-share factor is an estimate
    env.globals["FOLD_ROWS"] = FOLD_ROWS
    # the summary's one column when the team used no pool in the period (zeros)
    env.globals["NO_POOL_TOTALS"] = [{"flavor": "all", **_account_block(_empty_accounts())}]
    return env


_ENVS: dict[bool, object] = {}


def _env(markdown: bool = False):
    if markdown not in _ENVS:
        _ENVS[markdown] = _jinja_env(markdown)
    return _ENVS[markdown]


def render_markdown(st: dict, chart_file: str) -> bytes:
    return _env(markdown=True).get_template("statement.md.j2").render(st=st, chart_file=_MdRaw(chart_file)).encode()


def render_html(st: dict, chart: bytes) -> bytes:
    import markupsafe

    svg = chart.decode()
    svg = svg[svg.index("<svg"):]  # inline: drop the XML prolog and doctype
    # the chart is markup matplotlib wrote (its texts XML-escaped), the one value the page takes as it is
    return _env().get_template("statement.html.j2").render(st=st, chart_svg=markupsafe.Markup(svg)).encode()


def render_files(st: dict, formats: Sequence[str]) -> dict[str, bytes]:
    """The files of one statement, by name (relative to the period's folder)."""
    stem = file_stem(st["team"])
    files: dict[str, bytes] = {}
    chart = chart_svg(st) if ("md" in formats or "html" in formats) else None
    if "json" in formats:
        files[f"{stem}.json"] = render_json(st)
    if "csv" in formats:
        files[f"{stem}.csv"] = render_csv(st)
    if "md" in formats:
        # the link is a URL: the file name's own percent signs (org%2Fteam.svg) are encoded again, else a viewer
        # decodes the link to org/team.svg, a folder, and the image is broken
        files[f"{stem}.md"] = render_markdown(st, quote(f"{stem}.svg", safe="-_.~"))
        files[f"{stem}.svg"] = chart
    if "html" in formats:
        files[f"{stem}.html"] = render_html(st, chart)
    return files


def digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return "sha256:" + h.hexdigest()


def parse_formats(text: str) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(f.strip() for f in text.split(",") if f.strip()))
    bad = [f for f in chosen if f not in FORMATS]
    if bad or not chosen:
        raise StatementError(f"--format takes a comma-separated list of {', '.join(FORMATS)}; got {text!r}")
    return chosen


# ---------------------------------------------------------------------------------------------------------
# issuing
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Issued:
    period: Period
    team: str
    partial: bool
    files: list[Path]
    digest: str


def _render_one(args) -> tuple[str, dict[str, bytes]]:
    st, formats = args
    return st["team"], render_files(st, formats)


def issue(lake: Path, period: Period, out: Path, *, teams: Optional[Iterable[str]] = None,
          formats: Sequence[str] = FORMATS, slo: Optional[SloParams] = None, store=None,
          workers: int = 1, now: Optional[datetime] = None,
          duckdb_config: Optional[dict[str, str]] = None) -> list[Issued]:
    """Compute and write the statements of `period` into `out/<period label>/`, and record each in `store`
    (when given) with the log positions it was computed at. `duckdb_config`: DuckDB's settings for reading the
    lake ([lake] memory_limit, spill_dir)."""
    from analytics.views import connect

    # where the books end decides the instant the error budgets are evaluated at (the period's end, or the
    # books' end for a period still open): read it first, straight from the Parquet files (cheaper than the
    # views), then connect with it (the SLO intermediates are computed for that instant when connecting)
    closed = books_closed_through_files(Path(lake))
    as_of = min(period.end - timedelta(seconds=1), min(closed.values())) if closed else None
    con = connect(Path(lake), slo=slo, as_of=as_of, materialize=STATEMENT_TABLES, config=duckdb_config)
    try:
        statements = compute_statements(con, period, teams=teams, slo=slo)
    finally:
        con.close()
    folder = Path(out) / period.label
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [(st, tuple(formats)) for st in statements]
    if workers > 1 and len(jobs) > 8:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            rendered = pool.map(_render_one, jobs, chunksize=max(1, len(jobs) // (workers * 8)))
    else:
        rendered = [_render_one(j) for j in jobs]
    issued = []
    issued_at = now or datetime.now(UTC)
    for st, (team, files) in zip(statements, rendered):
        paths = []
        for name, data in files.items():
            path = folder / name
            path.write_bytes(data)
            paths.append(path)
        d = digest(files)
        issued.append(Issued(period, team, st["partial"], paths, d))
        if store is not None and not st["partial"]:
            store.record_statement(statement_id=f"{team}@{period.label}", team=team, period_start=period.start,
                                   period_end=period.end, positions=st["computed_at_positions"], output_digest=d,
                                   formats=formats, issued_at=issued_at)
    return issued


def issue_due(lake: Path, every: str, out: Path, store, *, teams: Optional[Iterable[str]] = None,
              formats: Sequence[str] = FORMATS, slo: Optional[SloParams] = None, workers: int = 1,
              now: Optional[datetime] = None, duckdb_config: Optional[dict[str, str]] = None) -> list[Issued]:
    """Issue, exactly once each, the statements of every closed `every` period (week or month) not yet
    recorded in the store: a period is closed when every pool's books are closed through its end."""
    from analytics.views import connect

    con = connect(Path(lake), config=duckdb_config)
    try:
        closed = books_closed_through(con)
        first = con.execute("SELECT min(hour) FROM journal_postings").fetchone()[0]
        team_list = sorted(set(teams)) if teams is not None else known_teams(con)
    finally:
        con.close()
    if not closed or first is None:
        return []
    done = {r.statement_id for r in store.statement_runs()}
    issued = []
    for period in closed_periods(every, first.astimezone(UTC), min(closed.values())):
        due = [t for t in team_list if f"{t}@{period.label}" not in done]
        if due:
            issued += issue(lake, period, out, teams=due, formats=formats, slo=slo, store=store, workers=workers,
                            now=now, duckdb_config=duckdb_config)
    return issued
