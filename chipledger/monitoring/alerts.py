"""`chipledger alerts`: the burn-rate alerts firing now (the `burn_alerts` view: the SRE workbook's
multi-window, multi-burn-rate rules; and the `budget_alerts` view: a team's cost budget burning, in the same shape
with slo `budget`, pool `*` and the team, unit and period), for people and for cron or a monitoring system.

`evaluate` is the whole decision (which alerts fire, at which instant, whether the lake can be trusted to
say so); printing and the exit status are the CLI's. A monitor must never read "all clear" from a lake
that cannot answer: no lake, a lake without events, an unknown pool or (with `max_age_s`) a lake whose newest
event is too old are errors (`AlertsError`), which the CLI reports with their own exit status.

Every alert carries the labels of the Prometheus rules of `chipledger slo rules`: the SLO, the pool, and the team for
the SLOs counted per team, so Alertmanager merges the same burn from both. An error budget already spent over its
window is a ticket (`budget_exhausted`) even when nothing burns fast right now.

Exit status: 0 when nothing fires, 1 when only ticket-level alerts fire, 2 when a page-level alert fires,
3 on any error (the lake cannot answer, a bad option).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Optional

import duckdb

EXIT_OK, EXIT_TICKET, EXIT_PAGE, EXIT_ERROR = 0, 1, 2, 3


class AlertsError(ValueError):
    """The lake cannot say which alerts fire (no events, unknown pool, stale); the message says why."""


@dataclass(frozen=True)
class Alert:
    severity: str       # page | ticket
    alert: str          # page_1h | page_6h | ticket_3d | budget_exhausted
    slo: str
    pool: str
    team: Optional[str]  # the team, for the SLOs counted per team (the Prometheus rules' labels); None: availability
    burn_rate: float    # the rule's threshold (× the budget rate)
    long_win: str
    long_burn: float
    short_win: str
    short_burn: float
    target: float
    evaluated_at: datetime
    # budget alerts (slo "budget"; analytics/cost_views.py): in which unit and period (the team above), its numbers
    unit: Optional[str] = None
    period: Optional[str] = None
    spent: Optional[float] = None
    budget: Optional[float] = None
    forecast_end: Optional[float] = None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["evaluated_at"] = _iso(self.evaluated_at)
        if self.slo != "budget":
            for k in ("unit", "period", "spent", "budget", "forecast_end"):
                del d[k]
        return d

    @property
    def who(self) -> str:
        return f"pool {self.pool}" + (f" team {self.team}" if self.team else "")

    def line(self) -> str:
        if self.slo == "budget":
            return (f"{self.severity.upper():6} {self.alert:13} team {self.team} ({self.unit}, this {self.period}): "
                    f"spent {self.spent:,.2f} of {self.budget:,.0f}, forecast {self.forecast_end:,.2f} at the "
                    f"period's end; burning {self.long_burn:.1f}× over the {self.long_win} and {self.short_burn:.1f}× "
                    f"over {self.short_win} (threshold {self.burn_rate:g}×)")
        head = f"{self.severity.upper():6} {self.alert:16} {self.slo:14} {self.who}: "
        if self.alert == "budget_exhausted":
            return (head + f"error budget spent: {100 * self.long_burn:.1f}% of the {self.long_win} budget consumed "
                           f"(target {100 * self.target:g}%)")
        return (head + f"burning {self.long_burn:.1f}× over {self.long_win} and {self.short_burn:.1f}× over "
                       f"{self.short_win} (threshold {self.burn_rate:g}×, target {100 * self.target:g}%)")


@dataclass(frozen=True)
class Evaluation:
    """What `evaluate` found: the firing alerts (pages first), the instant the windows end at, and the newest
    event of the pools looked at (and its age against the reference: --at, else the wall clock)."""

    alerts: list[Alert]
    evaluated_at: datetime
    newest_event_at: datetime
    age_s: int
    pools: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"evaluated_at": _iso(self.evaluated_at), "newest_event_at": _iso(self.newest_event_at),
                "newest_event_age_s": self.age_s, "pools": self.pools,
                "firing": [a.as_dict() for a in self.alerts]}


def _iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


_DURATION = re.compile(r"^\s*(\d+)\s*(s|m|h|d|w)?\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> int:
    """`90s`, `15m`, `2h`, `1d`, `1w` or plain seconds, as seconds."""
    m = _DURATION.match(text or "")
    if not m:
        raise AlertsError(f"--max-age {text!r} is not a duration (e.g. 90s, 15m, 2h, 1d)")
    return int(m.group(1)) * _UNIT_S[m.group(2) or "s"]


def known_pools(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """Each pool the lake holds events of, with its newest event (epoch seconds)."""
    return {pool: int(end_s) for pool, end_s in
            con.execute("SELECT pool, end_s FROM base_pool_end ORDER BY pool").fetchall()}


def _first_s(con: duckdb.DuckDBPyConnection, pool: Optional[str]) -> int:
    return int(con.execute("SELECT min(at_s) FROM base_event_rows WHERE $pool IS NULL OR pool = $pool",
                           {"pool": pool}).fetchone()[0])


def check_pool(pools, pool: Optional[str]) -> None:
    """An unknown --pool is an error naming the pools the lake knows (`report` uses the same rule)."""
    if pool is not None and pool not in pools:
        shown = ", ".join(sorted(pools)[:20]) + (f" (+{len(pools) - 20})" if len(pools) > 20 else "")
        raise AlertsError(f"unknown pool {pool!r}; the lake knows: {shown or 'none'}")


def check_team(teams, team: Optional[str]) -> None:
    """An unknown --team is an error naming the teams the lake knows (as `statements --team` says it): a typo
    never reads as "no job pending" (issue 35, item 3)."""
    if team is not None and team not in teams:
        teams = sorted(teams)
        shown = ", ".join(teams[:40]) + (f" (+{len(teams) - 40})" if len(teams) > 40 else "")
        raise AlertsError(f"unknown team {team!r}; the lake knows: {shown or 'none'}")


def evaluate(con: duckdb.DuckDBPyConnection, pool: Optional[str] = None, *, max_age_s: Optional[int] = None,
             at: Optional[datetime] = None, now: Optional[datetime] = None) -> Evaluation:
    """The firing alerts of `con` (analytics.views.connect, made with `as_of=at`), pages first, then by SLO and
    pool. Raises AlertsError when the lake has no events, `pool` is unknown, `at` is before its (every pool's)
    first event, or (with `max_age_s`) the newest event at or before `at` of the pool (of any pool) is older
    than `max_age_s` before `at`, or before `now` (default: the wall clock) when no instant was asked for."""
    pools = known_pools(con)
    if not pools:
        raise AlertsError("the lake has no events: nothing to evaluate (run `chipledger run` or the worker and "
                          "sink first)")
    check_pool(pools, pool)
    if at is not None:  # the newest event at or before the instant evaluated: what the lake knew then
        upto = {p: int(s) for p, s in con.execute(
            "SELECT pool, max(at_s) FROM base_event_rows WHERE at_s <= $at GROUP BY pool",
            {"at": int(at.timestamp())}).fetchall()}
        mine = [s for p, s in upto.items() if pool is None or p == pool]
        if not mine:
            raise AlertsError(f"no event{' of ' + pool if pool else ''} at or before --at {_iso(at)}: nothing to "
                              f"evaluate (the lake's first is at "
                              f"{_iso(datetime.fromtimestamp(_first_s(con, pool), timezone.utc))})")
        newest_s = max(mine)
    else:
        newest_s = pools[pool] if pool is not None else max(pools.values())
    reference = at or now or datetime.now(timezone.utc)
    age_s = max(0, int(reference.timestamp()) - newest_s)
    newest = datetime.fromtimestamp(newest_s, timezone.utc)
    if max_age_s is not None and age_s > max_age_s:
        raise AlertsError(f"stale: the newest event{' of ' + pool if pool else ''} is at {_iso(newest)}, "
                          f"{age_s:,} s before {_iso(reference)} ({'--at' if at else 'now'}), more than "
                          f"--max-age {max_age_s:,} s")
    (as_of_s,) = con.execute("SELECT as_of_s FROM calc_now").fetchone()
    rows = con.execute("""
        SELECT severity, alert, slo, pool, team, burn_rate, long_win, long_burn, short_win, short_burn, target,
               evaluated_at
        FROM burn_alerts WHERE firing AND ($pool IS NULL OR pool = $pool)
        ORDER BY severity = 'page' DESC, alert, slo, pool, team NULLS FIRST""", {"pool": pool}).fetchall()
    found = [Alert(*r) for r in rows]
    if pool is None:  # a team's budget is across pools: its alerts are not a pool's
        found += [Alert(*r) for r in con.execute("""
            SELECT severity, alert, slo, pool, team, burn_rate::DOUBLE, long_win, long_burn::DOUBLE, short_win,
                   coalesce(short_burn, 0)::DOUBLE, target::DOUBLE, evaluated_at, unit, period, spent::DOUBLE,
                   budget::DOUBLE, forecast_end::DOUBLE
            FROM budget_alerts WHERE firing ORDER BY team, unit, alert""").fetchall()]
        found.sort(key=lambda a: a.severity != "page")  # pages first (stable: each kind keeps its order)
    return Evaluation(found, datetime.fromtimestamp(int(as_of_s), timezone.utc), newest, age_s,
                      [pool] if pool is not None else sorted(pools))


def firing(con: duckdb.DuckDBPyConnection, pool: Optional[str] = None) -> list[Alert]:
    """The firing alerts alone (see `evaluate`)."""
    return evaluate(con, pool).alerts


def exit_status(alerts: list[Alert]) -> int:
    if any(a.severity == "page" for a in alerts):
        return EXIT_PAGE
    return EXIT_TICKET if alerts else EXIT_OK
