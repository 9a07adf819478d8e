"""What a team's use cost, its budgets and its peak share, for statements, the report and the portal
(docs/statements.md "Cost"; DESIGN §9).

Everything here sums the fold's facts through analytics' views: `cost_postings` (each journal posting priced by
the fold, ledger/costs.py), `budget` (analytics/cost_views.py) and the journal's `idle` account. Costs are exact
integers in 1/3,600,000 of the price's unit (`*_scaled`) with the same in the unit for people. Totals are per
unit only: money or billing units are the only totals across pools of unlike chips; chip-hours are shown per pool
(or per flavor) and never added across flavors. Where no price held, there is no cost (None), never zero.

Peak use and the off-peak comparison come from the fold's `run_costs` facts (ledger/costs.py `run_ended`): each run
that ended in the period, per pool and unit, with its chip time in peak seconds, its cost as run and its cost had it
started at the nearest off-peak start with room. Nothing of it is re-derived here: the runs' figures are summed. The
comparison ("started off-peak, the same runs would have cost X instead of Y") is over the runs whose both costs are
known; the runs without an off-peak start with room are counted, never priced at 0.

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
    periods overlapping [start, end), and, of its runs that ended in [start, end), the use in peak seconds and what
    the same runs would have cost started off-peak (`peak[]` per pool and unit, `peak_totals[]` per unit). Teams
    without any priced use or budget get `{"priced": False, ...}` with empty lists."""
    want = None if teams is None else set(teams)
    out: dict[str, dict] = {}

    def block(team: str) -> dict:
        if team not in out:
            out[team] = {"priced": False, "by_pool": [], "totals": [], "budgets": [], "peak": [], "peak_totals": []}
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

    for (team, pool, flavor, unit, runs, used, peak, known, cost_all, compared, cost_cmp, off_cmp,
         no_room) in con.execute("""
            SELECT r.team, r.pool, f.flavor, r.unit, count(*), sum(r.allocated_mchip_s)::BIGINT,
                   sum(r.peak_mchip_s)::BIGINT, count(r.cost_scaled), sum(r.cost_scaled::HUGEINT),
                   count(r.off_peak_cost_scaled) FILTER (WHERE r.cost_scaled IS NOT NULL),
                   sum(r.cost_scaled::HUGEINT) FILTER (WHERE r.off_peak_cost_scaled IS NOT NULL),
                   sum(r.off_peak_cost_scaled::HUGEINT) FILTER (WHERE r.cost_scaled IS NOT NULL),
                   count(*) FILTER (WHERE r.off_peak_cost_scaled IS NULL)
            FROM run_costs r LEFT JOIN pool_flavors f ON f.pool = r.pool
            WHERE r.unit IS NOT NULL AND r.ended_at >= $s AND r.ended_at < $e
            GROUP BY ALL ORDER BY ALL""", {"s": start, "e": end}).fetchall():
        if want is not None and team not in want:
            continue
        b = block(team)
        peak_rows = b["peak"]
        peak_rows.append({
            "pool": pool, "flavor": flavor, "unit": unit, "runs": int(runs), "used_mchip_s": int(used),
            "peak_mchip_s": int(peak), "peak_chip_h": int(peak) / 3.6e6,
            "peak_share": None if not used else round(int(peak) / int(used), 6),
            "runs_cost_known": int(known), "cost_scaled": None if cost_all is None else int(cost_all),
            "cost": _amount(cost_all),
            # the runs whose cost and off-peak cost are both known: the comparison is over these runs only
            "runs_compared": int(compared),
            "as_run_cost_scaled": None if not compared else int(cost_cmp), "as_run_cost": _amount(cost_cmp),
            "off_peak_cost_scaled": None if not compared else int(off_cmp), "off_peak_cost": _amount(off_cmp),
            "saving": None if not compared else _amount(int(cost_cmp) - int(off_cmp)),
            "runs_no_off_peak_start": int(no_room)})
    for b in out.values():  # per unit: money (or billing units) is the only total across pools of unlike chips
        units_peak: dict[str, list[int]] = {}
        for p in b["peak"]:
            if p["runs_compared"]:
                t = units_peak.setdefault(p["unit"], [0, 0, 0])
                t[0] += p["runs_compared"]
                t[1] += p["as_run_cost_scaled"]
                t[2] += p["off_peak_cost_scaled"]
        b["peak_totals"] = [{"unit": u, "runs_compared": n, "as_run_cost_scaled": c, "as_run_cost": _amount(c),
                             "off_peak_cost_scaled": o, "off_peak_cost": _amount(o), "saving": _amount(c - o)}
                            for u, (n, c, o) in sorted(units_peak.items())]
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
