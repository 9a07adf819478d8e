"""Prices and budgets in the fold (`price.set`, `budget.set`; DESIGN §3, §9): what the pool holds and the fact rows.

A pool keeps every price and budget it was given (`PoolState.prices`, `PoolState.budgets`, by id; a later setting
of an id replaces it) and writes each setting as a fact row (lake tables `prices`, `budgets`), so analytics and the
cost accrual read them without parsing events. Integers in the declared unit; this module accrues no cost. Prices
apply forward: a price whose `effective_from` is before the pool clock is `illegal_transition`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from schemas.codes import Rejection, RejectionCode as RC
from schemas.events import epoch_s

from ledger.state import PoolState


class PriceRow(NamedTuple):
    """A price set in a pool (fact `prices`): in effect from `effective_from` (the instant it was applied when
    none was given) until `effective_until` (None: until replaced), in the listed UTC hours of the week (None:
    every hour). A later row of the same pool and price id replaces it from its own effective_from."""
    pool: str
    price_id: str
    per_chip_hour: int
    unit: str
    effective_from: int
    effective_until: Optional[int]
    hours_of_week: Optional[list]
    set_at: int


class BudgetRow(NamedTuple):
    """A team's budget per period set in a pool (fact `budgets`), in effect from `effective_from`."""
    pool: str
    budget_id: str
    team: str
    period: str
    amount: int
    unit: str
    effective_from: int
    set_at: int


def _ts(ts) -> Optional[int]:
    return None if ts is None else epoch_s(ts)


def check_price_set(s: PoolState, e) -> Optional[Rejection]:
    start = _ts(e.effective_from)
    if start is not None and start < s.clock:
        return Rejection(RC.illegal_transition, f"price {e.price_id!r}: effective_from is {s.clock - start} s before "
                         f"the pool clock; prices apply forward (set a new price from now on)")
    until = _ts(e.effective_until)
    if until is not None and until <= s.clock:
        return Rejection(RC.illegal_transition, f"price {e.price_id!r}: effective_until is not after the pool clock")
    return None


def apply_price_set(s: PoolState, e, t: int, rows: list) -> None:
    start = _ts(e.effective_from)
    if start is None or start < t:
        start = t
    hours: Any = None if e.hours_of_week is None else sorted(e.hours_of_week)
    row = PriceRow(s.pool, e.price_id, e.per_chip_hour, e.unit, start, _ts(e.effective_until), hours, t)
    s.prices[e.price_id] = list(row[2:])
    rows.append(row)


def apply_budget_set(s: PoolState, e, t: int, rows: list) -> None:
    start = _ts(e.effective_from)
    if start is None:
        start = t
    row = BudgetRow(s.pool, e.budget_id, e.team, e.period, e.amount, e.unit, start, t)
    s.budgets[e.budget_id] = list(row[2:])
    rows.append(row)
