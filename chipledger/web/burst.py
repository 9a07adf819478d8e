"""Burst requests from the portal: the dry run, the nearest windows that would be approved, and the request sent.

The dry run calls the core's own rule, `ledger.policy.burst_verdict`, over `BurstInputs` gathered from the facts the
fold wrote to the lake (never a second implementation of the rule):
- available chips: the pool's latest `free_chips` row (`healthy_milli`);
- other teams' guarded quota: `ledger.policy.guarded_milli` over their balances at the latest close of the books
  (`balance_log`) and the lending limits of their grants in effect (`grant_intervals`), summed as `team_limits` does;
- forecast demand: the hour-of-week profile the fold keeps (mean of running + pending chips per hour of the week,
  every hour closed since the pool's books opened at the hour of its first `pool.configured`, quiet ones as 0),
  rebuilt from the books' hourly postings (`journal`), and its peak over the window by `ledger.policy.hour_of_week`;
- other bursts: the approved and partial `decision.burst` rows whose window has not ended (the reservations the
  fold holds), overlapping the window;
- fair share: the team's factor at the latest close of the books (the core's, as written);
- the capacity error budget: the last 720 closed hours of `capacity` and `unavailable` postings.
The dry run is therefore "what the ledger would decide at its latest close of the books", which it says.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional

from ledger.books import HOUR_S
from ledger.policy import (BUDGET_HOURS, HOURS_OF_WEEK, BurstInputs, burst_verdict, hour_of_week)
from schemas.events import MILLI

MAX_WINDOW_SHIFTS_H = 14 * 24   # nearest windows: shifted by whole hours up to two weeks later
NEAREST = 3


@dataclass
class PoolFacts:
    pool: str
    t: int                          # the pool clock: its latest close of the books (epoch s)
    available_milli: int
    teams: dict[str, dict]          # team -> balance_log row (integers)
    lending_limits: dict[str, Optional[int]]
    profile: list[list[int]]        # [sum of hourly demand milli, hours seen] per hour of the week
    demand_now_milli: int
    budget_hours: list[tuple[int, int]]
    bursts: list[tuple[str, int, int, int]]  # (request id, granted milli, window start s, window end s)


def _s(ts) -> int:
    return int(ts.timestamp())


def pool_facts(snap, pool: str) -> Optional[PoolFacts]:
    p = snap.rows("SELECT * FROM portal_pools WHERE pool = ?", [pool])
    if not p or p[0]["books_closed_at"] is None:
        return None
    t = _s(p[0]["books_closed_at"])
    teams = {r["team"]: r for r in snap.rows("SELECT * FROM portal_balance_ints WHERE pool = ?", [pool])}
    limits: dict[str, Optional[int]] = {}
    seen: set[str] = set()
    for g in snap.rows("SELECT * FROM portal_grants WHERE pool = ?", [pool]):
        if g["effective_from"] is None:
            continue
        frm = _s(g["effective_from"])
        until = g["effective_until"]
        if frm > t or (until is not None and _s(until) <= t):
            continue
        team, ll = g["team"], g["lending_limit_milli"]
        if team not in seen:
            seen.add(team)
            limits[team] = ll
        else:
            cur = limits[team]
            limits[team] = None if cur is None or ll is None else cur + ll
    hours = {r["hour_s"]: r for r in snap.rows("SELECT * FROM portal_pool_hours WHERE pool = ? ORDER BY hour_s",
                                               [pool])}
    opened = snap.rows("SELECT opened_at FROM portal_pool_opened WHERE pool = ?", [pool])
    profile = [[0, 0] for _ in range(HOURS_OF_WEEK)]
    budget: list[tuple[int, int]] = []
    first = [min(hours)] if hours else []
    if opened and opened[0]["opened_at"] is not None:
        first.append(_s(opened[0]["opened_at"]) // HOUR_S * HOUR_S)  # the books open at the hour of pool.configured
    if first:
        h = min(first)
        while h + HOUR_S <= t:  # every closed hour since the books opened: those without a row (no demand, or no
            # team or chip yet) too, which the fold counts with zero demand
            r = hours.get(h)
            prof = profile[hour_of_week(h)]
            prof[0] += (r["demand_mchip_s"] // HOUR_S) if r else 0
            prof[1] += 1
            budget.append((r["capacity_mchip_s"], r["unavailable_mchip_s"]) if r else (0, 0))
            h += HOUR_S
    budget = budget[-BUDGET_HOURS:]
    # the reservations the fold holds at t: approved or cut, until their window ends (`burst_off` at its end)
    bursts = [(d["request_id"], round(d["chips_granted"] * MILLI), _s(d["window_start"]), _s(d["window_end"]))
              for d in snap.rows("SELECT request_id, chips_granted, window_start, window_end FROM portal_decisions "
                                 "WHERE pool = ? AND type = 'decision.burst' AND verdict IN ('approved', 'partial')",
                                 [pool])]
    bursts = [b for b in bursts if b[3] > t]
    demand_now = sum(r["used_milli"] + r["pending_milli"] for r in teams.values())
    return PoolFacts(pool, t, p[0]["healthy_milli"] or 0, teams, limits, profile, demand_now, budget, bursts)


def _guarded(row: dict, lending_limit: Optional[int]) -> int:
    # ledger.policy.guarded_milli over a Team; here over the team's balance row (the same two integers)
    if lending_limit is None:
        return 0
    unused = row["nominal_milli"] - row["used_milli"]
    return unused - lending_limit if unused > lending_limit else 0


def _forecast(f: PoolFacts, start: int, end: int) -> tuple[int, int]:
    # ledger.policy.forecast_demand_milli over the profile rebuilt from the books
    peak = known = 0
    h = start - start % HOUR_S
    for _ in range(HOURS_OF_WEEK):
        if h >= end:
            break
        s, n = f.profile[hour_of_week(h)]
        if n:
            known += 1
            d = s // n
        else:
            d = f.demand_now_milli
        peak = max(peak, d)
        h += HOUR_S
    return peak, known


def _budget(f: PoolFacts, target: float) -> tuple[float, float]:
    # ledger.policy.budget_state over the closed hours rebuilt from the books
    allowed = 1.0 - target
    reg = sum(h[0] for h in f.budget_hours)
    unav = sum(h[1] for h in f.budget_hours)
    if reg <= 0 or allowed <= 0:
        return 1.0, 0.0
    last = f.budget_hours[-1]
    return 1.0 - (unav / reg) / allowed, ((last[1] / last[0]) / allowed if last[0] else 0.0)


def inputs(f: PoolFacts, team: str, request_id: str, ws: int, we: int, target: float) -> BurstInputs:
    guarded = sum(_guarded(row, f.lending_limits.get(name)) if name in f.lending_limits else 0
                  for name, row in f.teams.items() if name != team)
    start = max(ws, f.t)
    peak, known = _forecast(f, start, we)
    reserved = sum(b[1] for b in f.bursts if b[2] < we and b[3] > start)
    fs = f.teams[team]["fair_share_factor"] if team in f.teams else 1.0
    left, burn = _budget(f, target)
    return BurstInputs(f.available_milli, guarded, peak, known, reserved, fs, left, burn,
                       any(b[0] == request_id for b in f.bursts))


def _utc(s: int) -> str:
    return datetime.fromtimestamp(s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def dry_run(snap, pool: str, team: str, chips: float, window_start: datetime, window_end: datetime,
            capacity_slo_target: float, request_id: str = "dry-run") -> Optional[dict]:
    """What the ledger would decide for this request at its latest close of the books, and the nearest windows
    of the same length (shifted by whole hours, up to two weeks later) that it would approve in full."""
    f = pool_facts(snap, pool)
    if f is None:
        return None
    asked = round(chips * MILLI)
    ws, we = _s(window_start), _s(window_end)
    inp = inputs(f, team, request_id, ws, we, capacity_slo_target)
    verdict, granted, numbers, why = burst_verdict(inp, asked, we, f.t)
    nearest = []
    length = we - ws
    first = max(ws, f.t - f.t % HOUR_S + HOUR_S)
    for k in range(0, MAX_WINDOW_SHIFTS_H + 1):
        s = first + k * HOUR_S
        if s == ws and verdict == "approved":
            continue
        v, g, _, _ = burst_verdict(inputs(f, team, request_id, s, s + length, capacity_slo_target), asked,
                                   s + length, f.t)
        if v == "approved":
            nearest.append({"window_start": _utc(s), "window_end": _utc(s + length)})
            if len(nearest) >= NEAREST:
                break
    return {"pool": pool, "team": team, "as_of": _utc(f.t), "verdict": verdict, "chips_requested": asked / MILLI,
            "chips_granted": granted / MILLI, "numbers": numbers,
            "message": f"{verdict}, {granted / MILLI:g} of {asked / MILLI:g} chips: {why}",
            "nearest_approved_windows": nearest}


def burst_event(pool: str, team: str, chips: float, window_start: datetime, window_end: datetime, reason: str,
                requested_by: str, request_id: str, event_id: str, now: datetime) -> dict:
    ev = {"event_id": event_id, "type": "burst.requested", "occurred_at": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
          "pool": pool, "source": "portal", "request_id": request_id, "team": team, "chips": chips,
          "window_start": window_start.strftime("%Y-%m-%dT%H:%M:%SZ"),
          "window_end": window_end.strftime("%Y-%m-%dT%H:%M:%SZ"), "requested_by": requested_by}
    if reason:
        ev["reason"] = reason
    return ev
