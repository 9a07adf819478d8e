"""What the portal shows of costs and budgets (docs/portal.md "Cost and budget"), computed once per lake snapshot.

`snapshot_costs(con)` runs at each snapshot build (chipledger/web/lake.py), never per request: the period is the UTC
month holding the lake's evaluation instant (analytics' `calc_now`, the instant the `budget` view forecasts from);
per team it is chipledger.reports.costs.team_costs over that month (cost per pool and flavor, totals per unit only:
never a sum of unlike chips or of unlike units; the budgets of the periods overlapping the month with spent, left
and the forecast of the period's end), per pool `pool_costs` (use, idle, unavailable). Where no price held there is
no row: the pages say "no price set", never 0.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Optional


def _month(as_of: datetime) -> tuple[datetime, datetime]:
    start = as_of.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return start, end


def snapshot_costs(con) -> dict:
    """{"as_of", "period_start", "period_end", "teams": {team: team_costs block}, "pools": [pool_costs rows]}."""
    from chipledger.reports.costs import pool_costs, team_costs

    row = con.execute("SELECT as_of_s FROM calc_now").fetchone()
    if row is None or row[0] is None:
        return {"as_of": None, "period_start": None, "period_end": None, "teams": {}, "pools": []}
    as_of = datetime.fromtimestamp(int(row[0]), timezone.utc)
    start, end = _month(as_of)
    return {"as_of": as_of, "period_start": start, "period_end": end, "teams": team_costs(con, start, end),
            "pools": pool_costs(con, start, end)}


def _n(v: Optional[float]) -> str:
    return "–" if v is None else f"{v:,.2f}"


def budget_sentence(b: dict) -> str:
    """One plain sentence on a budget: how much is spent and left, and where the period ends at the current rate."""
    unit, budget, spent, left, fc = b["unit"], b["budget"], b["spent"], b["left"], b.get("forecast_end")
    head = f"Of your {b['period']}ly budget of {budget:,} {unit}, you have spent {_n(spent)}"
    if left < 0:
        head += f" and are {_n(-left)} {unit} over it"
    else:
        head += f" and have {_n(left)} left"
    if fc is None:
        return head + "."
    if fc > budget:
        return head + (f"; at the current rate the {b['period']} ends at {_n(fc)} {unit}, "
                       f"{_n(fc - budget)} over the budget.")
    return head + f"; at the current rate the {b['period']} ends at {_n(fc)} {unit}, within the budget."
