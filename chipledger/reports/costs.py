"""What a team's use cost, its budgets and its peak share, for statements, the report and the portal
(docs/statements.md "Cost"; DESIGN §9).

Everything here sums the fold's facts through analytics' views: `cost_postings` (each journal posting priced by
the fold, ledger/costs.py), `budget` (analytics/cost_views.py) and the journal's `idle` account. Costs are exact
integers in 1/3,600,000 of the price's unit (`*_scaled`) with the same in the unit for people. Totals are per
unit only: money or billing units are the only totals across pools of unlike chips; chip-hours are shown per pool
(or per flavor) and never added across flavors. Where no price held, there is no cost (None), never zero.

Peak use: a team's use in a peak hour of a pool: an hour in which a banded price (a `price.set` with hours of the
week) above the pool's cheapest price of the period held. The off-peak counterfactual moves each peak hour's use of
the team to the nearest off-peak hour of the same pool (earlier first on a tie) whose idle chip-seconds (the fold's
postings) had room for all of it, at that hour's price; use with no such hour stays at its peak cost
(`off_peak_had_room` false when some did). Hours are the journal's: a run is moved by the hour, not by its start.

`team_costs(con, start, end, teams)` is the function the portal calls for a team page.
"""

from __future__ import annotations

from datetime import datetime
from typing import Iterable, Optional

COST_SCALE = 3_600_000
USE_ACCOUNTS = ("in_quota", "borrowed", "burst")


def _amount(scaled) -> Optional[float]:
    return None if scaled is None else round(int(scaled) / COST_SCALE, 6)


def team_costs(con, start: datetime, end: datetime, teams: Optional[Iterable[str]] = None) -> dict[str, dict]:
    """Per team: cost per pool and flavor and unit (in quota, borrowed, burst), totals per unit, the budgets of the
    periods overlapping [start, end), and the use in peak bands with its off-peak counterfactual. Teams without
    any priced use or budget get `{"priced": False, ...}` with empty lists."""
    want = None if teams is None else set(teams)
    out: dict[str, dict] = {}

    def block(team: str) -> dict:
        if team not in out:
            out[team] = {"priced": False, "by_pool": [], "totals": [], "budgets": [], "peak": []}
        return out[team]

    rows = con.execute("""
        SELECT c.team, c.pool, f.flavor, c.unit,
               sum(c.cost_scaled::HUGEINT) FILTER (WHERE c.account = 'in_quota') AS in_quota,
               sum(c.cost_scaled::HUGEINT) FILTER (WHERE c.account = 'borrowed') AS borrowed,
               sum(c.cost_scaled::HUGEINT) FILTER (WHERE c.account = 'burst') AS burst,
               sum(c.cost_scaled::HUGEINT) AS total, sum(c.amount_mchip_s)::BIGINT AS priced_mchip_s
        FROM cost_postings c LEFT JOIN pool_flavors f ON f.pool = c.pool
        WHERE c.team IS NOT NULL AND c.hour >= ? AND c.hour < ? GROUP BY ALL ORDER BY ALL""", [start, end]).fetchall()
    for team, pool, flavor, unit, iq, bo, bu, total, priced in rows:
        if want is not None and team not in want:
            continue
        b = block(team)
        b["priced"] = True
        b["by_pool"].append({"pool": pool, "flavor": flavor, "unit": unit, "priced_mchip_s": int(priced),
                             "in_quota_scaled": int(iq or 0), "borrowed_scaled": int(bo or 0),
                             "burst_scaled": int(bu or 0), "total_scaled": int(total),
                             "in_quota": _amount(iq or 0), "borrowed": _amount(bo or 0), "burst": _amount(bu or 0),
                             "total": _amount(total)})
    for b in out.values():
        units: dict[str, int] = {}
        for r in b["by_pool"]:
            units[r["unit"]] = units.get(r["unit"], 0) + r["total_scaled"]
        b["totals"] = [{"unit": u, "total_scaled": v, "total": _amount(v)} for u, v in sorted(units.items())]

    for team, period, period_start, period_end, unit, budget, spent, left, forecast, pools in con.execute("""
            SELECT team, period, period_start, period_end, unit, budget, spent, "left", forecast_end, pools
            FROM budget WHERE period_start < ? AND period_end > ? ORDER BY ALL""", [end, start]).fetchall():
        if want is not None and team not in want:
            continue
        block(team)["budgets"].append({
            "period": period, "period_start": period_start.isoformat().replace("+00:00", "Z"),
            "period_end": period_end.isoformat().replace("+00:00", "Z"), "unit": unit, "budget": int(budget),
            "pools": int(pools), "spent": round(float(spent), 6), "left": round(float(left), 6),
            "used_share": None if not budget else round(float(spent) / float(budget), 6),
            "forecast_end": None if forecast is None else round(float(forecast), 6)})

    for team, pool, unit, peak_mchip_s, peak_scaled, off_scaled, moved_mchip_s in con.execute("""
            WITH c AS (SELECT * FROM cost_postings WHERE hour >= $s AND hour < $e),
            banded AS (SELECT DISTINCT pool, price_id FROM prices WHERE hours_of_week IS NOT NULL),
            low AS (SELECT pool, unit, min(per_chip_hour) AS cheapest FROM c GROUP BY ALL),
            -- the pool's hours, each with its highest price and its idle chip-seconds; an hour is peak when a
            -- banded price above the pool's cheapest of the period held in it
            slots AS (
                SELECT c.pool, c.unit, c.hour, max(c.per_chip_hour) AS price,
                       sum(c.amount_mchip_s) FILTER (WHERE c.account = 'idle') AS idle_mchip_s,
                       bool_or(b.price_id IS NOT NULL AND c.per_chip_hour > low.cheapest) AS peak
                FROM c JOIN low USING (pool, unit) LEFT JOIN banded b USING (pool, price_id) GROUP BY ALL
            ), use AS (
                SELECT c.team, c.pool, c.unit, c.hour, sum(c.amount_mchip_s)::BIGINT AS use_mchip_s,
                       sum(c.cost_scaled::HUGEINT) AS cost_scaled
                FROM c JOIN slots s USING (pool, unit, hour)
                WHERE s.peak AND c.team IS NOT NULL AND c.account IN ('in_quota', 'borrowed', 'burst')
                GROUP BY ALL
            ), moved AS (
                -- the nearest off-peak hour of the pool (earlier first on a tie) whose idle chips had room for it
                SELECT u.*, (SELECT s.price FROM slots s WHERE s.pool = u.pool AND s.unit = u.unit AND NOT s.peak
                                AND coalesce(s.idle_mchip_s, 0) >= u.use_mchip_s
                             ORDER BY abs(epoch(s.hour) - epoch(u.hour)), s.hour LIMIT 1) AS off_price
                FROM use u
            )
            SELECT team, pool, unit, sum(use_mchip_s)::BIGINT, sum(cost_scaled),
                   sum(CASE WHEN off_price IS NULL THEN cost_scaled ELSE use_mchip_s::HUGEINT * off_price END),
                   coalesce(sum(use_mchip_s) FILTER (WHERE off_price IS NOT NULL), 0)::BIGINT
            FROM moved GROUP BY ALL ORDER BY ALL""", {"s": start, "e": end}).fetchall():
        if want is not None and team not in want:
            continue
        block(team)["peak"].append({
            "pool": pool, "unit": unit, "peak_mchip_s": int(peak_mchip_s), "peak_chip_h": int(peak_mchip_s) / 3.6e6,
            "peak_cost_scaled": int(peak_scaled), "peak_cost": _amount(peak_scaled),
            "off_peak_cost_scaled": int(off_scaled), "off_peak_cost": _amount(off_scaled),
            "saving": _amount(int(peak_scaled) - int(off_scaled)), "moved_mchip_s": int(moved_mchip_s),
            "off_peak_had_room": int(moved_mchip_s) == int(peak_mchip_s)})
    for team, b in out.items():
        if b["peak"]:
            used = {}
            for r in b["by_pool"]:
                used[(r["pool"], r["unit"])] = r["priced_mchip_s"]
            for p in b["peak"]:
                u = used.get((p["pool"], p["unit"]))
                p["peak_share"] = None if not u else round(p["peak_mchip_s"] / u, 6)
    return out


def pool_costs(con, start: Optional[datetime] = None, end: Optional[datetime] = None) -> list[dict]:
    """Per pool and unit: the cost of the teams' use, of idle and of unavailable chips (the pool's, not allocated
    to teams) in [start, end) (default: everything)."""
    rows = con.execute("""
        SELECT c.pool, f.flavor, c.unit,
               sum(c.cost_scaled::HUGEINT) FILTER (WHERE c.account IN ('in_quota', 'borrowed', 'burst')) AS used,
               sum(c.cost_scaled::HUGEINT) FILTER (WHERE c.account = 'idle') AS idle,
               sum(c.cost_scaled::HUGEINT) FILTER (WHERE c.account = 'unavailable') AS unavailable,
               sum(c.cost_scaled::HUGEINT) AS total
        FROM cost_postings c LEFT JOIN pool_flavors f ON f.pool = c.pool
        WHERE ($s IS NULL OR c.hour >= $s) AND ($e IS NULL OR c.hour < $e)
        GROUP BY ALL ORDER BY ALL""", {"s": start, "e": end}).fetchall()
    return [{"pool": p, "flavor": f, "unit": u, "used": _amount(a or 0), "idle": _amount(i or 0),
             "unavailable": _amount(n or 0), "total": _amount(t)} for p, f, u, a, i, n, t in rows]
