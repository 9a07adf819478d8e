"""What chips cost: the fold prices each journal posting at the price in effect over the interval it covers.

The rules (DESIGN §9; docs/statements.md "Cost"):
- a pool's prices are versions (`PoolState.price_versions`: every `price.set` applied, in the order applied). A
  version holds from its `effective_from` until its `effective_until` (None: for ever) or until the same price id
  is set again with a later `effective_from`, in its UTC hours of the week (None: every hour);
- at an instant, per `unit`, the price in effect is a version with hours of the week (a band) if one holds then,
  else one for every hour; among those the one set last (a base price set again does not override a peak band's):
  one price per unit, so a pool priced in `USD-cent` and in Slurm `billing` units gets one cost row per unit;
- each journal posting covers an interval in one UTC hour (hours close on the hour, and a close of the books posts
  what accrued so far). The fold also posts the journal at every price boundary (effective_from, effective_until,
  a price set now), so a posting's interval lies within one price and one hour-of-week band (bands are whole
  hours): its cost is exactly `amount_mchip_s × per_chip_hour` in units of 1/`COST_SCALE` of the price's unit
  (milli-chip-seconds × per chip-hour = 3,600,000 × the cost). No rounding anywhere, so the sum of a pool's
  cost rows does not depend on where the fold was paused; readers divide by `COST_SCALE` (analytics' `cost`);
- priced accounts: the teams' `in_quota`, `borrowed`, `burst` and the pool's `idle` and `unavailable`
  (`PRICED`); their costs add up to the cost of the pool's capacity (plus overcommitted chips). Idle and
  unavailable cost is the pool's, never allocated to a team. `entitled`, `pending`, `capacity` and
  `overcommitted` are not priced (they are not use, or would count chips twice);
- no price in effect → no cost row: a reader sees cost NULL (unknown), never zero.

This module owns the price versions, the boundaries they put in the pool's heap, the `costs` fact rows and the
teams' running cost per unit (`PoolState.cost_counts`, what /metrics' `chipledger_team_cost_total` serves).
"""

from __future__ import annotations

from typing import Final, NamedTuple, Optional

from ledger import prices
from ledger.books import BORROWED, BURST, HOUR_S, IDLE, IN_QUOTA, UNAVAILABLE
from ledger.state import PoolState
from ledger.step import Step, _rows

COST_SCALE: Final = 3_600_000  # cost_scaled / COST_SCALE = cost in the price's unit (mchip-s × per chip-hour)
PRICED: Final = frozenset({IN_QUOTA, BORROWED, BURST, IDLE, UNAVAILABLE})
WEEK_S: Final = 7 * 24 * HOUR_S
_MONDAY_OFFSET_S: Final = 3 * 24 * HOUR_S  # 1970-01-01 was a Thursday: hour of week 0 is Monday 00:00 UTC
PRICE_BOUNDARY: Final = "price"

# a version: [price_id, per_chip_hour, unit, effective_from, effective_until (None: open), hours (None: all), set_at]
_ID, _PER_CHIP_HOUR, _UNIT, _FROM, _UNTIL, _HOURS, _SET_AT = range(7)


class CostRow(NamedTuple):
    """A journal posting priced (fact `costs`): `amount_mchip_s` of `account` (team None: the pool's idle and
    unavailable) in `hour`, at `per_chip_hour` of `unit` (price `price_id`); `cost_scaled` = amount_mchip_s ×
    per_chip_hour, in 1/COST_SCALE of `unit`, exact."""
    pool: str
    hour: int
    account: str
    team: Optional[str]
    unit: str
    price_id: str
    per_chip_hour: int
    amount_mchip_s: int
    cost_scaled: int


def hour_of_week(t: int) -> int:
    """The UTC hour of the week of instant t (Monday 00:00 = 0 … Sunday 23:00 = 167)."""
    return ((t + _MONDAY_OFFSET_S) % WEEK_S) // HOUR_S


def in_effect(state: PoolState, t: int) -> dict[str, list]:
    """The price version in effect at instant t per unit: a banded one (hours of the week) before one for every
    hour, and among those the one set last."""
    how = hour_of_week(t)
    out: dict[str, list] = {}
    for v in state.price_versions:  # in the order set: a later one wins, but never a whole-week one over a band
        until = v[_UNTIL]
        if v[_FROM] <= t and (until is None or t < until) and (v[_HOURS] is None or how in v[_HOURS]):
            held = out.get(v[_UNIT])
            if held is None or held[_HOURS] is None or v[_HOURS] is not None:
                out[v[_UNIT]] = v
    return out


def price_postings(state: PoolState, journal: list, first: int, t: int, out: list) -> None:
    """Price the journal rows `journal[first:]`, posted for an interval that ends at instant t (within one hour
    and one price: the fold posts at every price boundary), into cost rows appended to `out`."""
    if not state.price_versions or first >= len(journal):
        return
    prices_now = in_effect(state, t - 1)  # the interval's last second: the whole interval had this price
    if not prices_now:
        return
    units = sorted(prices_now)
    counts = state.cost_counts
    for r in journal[first:]:
        account = r[2]
        if account in PRICED and r[4]:
            team = r[3]
            for unit in units:
                v = prices_now[unit]
                rate = v[_PER_CHIP_HOUR]
                cost = r[4] * rate
                out.append(CostRow(r[0], r[1], account, team, unit, v[_ID], rate, r[4], cost))
                if team is not None:  # the teams' use, counted for /metrics (PoolState.cost_counts)
                    key = (team, unit)
                    counts[key] = counts.get(key, 0) + cost


def _post_at(state: PoolState, t: int, step: Step) -> None:
    """Post the journal up to instant t and price what it posted (before the prices in effect change at t)."""
    journal = _rows(step, "journal")
    first = len(journal)
    state.books.flush(t, journal)
    price_postings(state, journal, first, t, _rows(step, "costs"))


def apply_price_set(state: PoolState, e, t: int, step: Step) -> None:
    """A `price.set` applied at t: post and price what accrued so far at the prices before it, record the fact
    row (ledger.prices) and the version, end the earlier version of the same id at the new one's start, and put
    the version's boundaries in the pool's heap (the books post there, so no posting straddles a price)."""
    _post_at(state, t, step)
    rows = _rows(step, "prices")
    prices.apply_price_set(state, e, t, rows)
    row = rows[-1]
    start = row.effective_from
    for v in state.price_versions:
        if v[_ID] == row.price_id and (v[_UNTIL] is None or v[_UNTIL] > start):
            v[_UNTIL] = start
    hours = None if row.hours_of_week is None else list(row.hours_of_week)
    versions = [v for v in state.price_versions if v[_UNTIL] is None or v[_UNTIL] > max(v[_FROM], t)]
    versions.append([row.price_id, row.per_chip_hour, row.unit, start, row.effective_until, hours, t])
    state.price_versions = versions
    if start > t:
        state.push_boundary(start, PRICE_BOUNDARY, row.price_id, 0)
    if row.effective_until is not None:
        state.push_boundary(row.effective_until, PRICE_BOUNDARY, row.price_id, 0)


def price_boundary(state: PoolState, instant: int, step: Step) -> None:
    """A price starts or ends at `instant` (the clock moving past it): post and price the journal up to it, then
    forget the versions that ended."""
    _post_at(state, instant, step)
    state.price_versions = [v for v in state.price_versions if v[_UNTIL] is None or v[_UNTIL] > instant]
