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

Each run of a priced pool is priced as it ends (`run_ended`, fact `run_costs`; docs/policy.md "Peak and off-peak, per
run"): its cost as run, its chip time in peak seconds, and its cost had it started at the nearest off-peak hour before
it that had room for its chips (the least free chips per hour, `hour_closed`); unknown is None, never 0. For that the
pool keeps the versions that ended while a run may still need them, and the least free chips of its last
FREE_HOURS_KEPT closed hours.

This module owns the price versions, the boundaries they put in the pool's heap, the `costs` and `run_costs` fact
rows and what they are computed from, and the teams' running cost per unit (`PoolState.cost_counts`, what /metrics'
`chipledger_team_cost_total` serves).
"""

from __future__ import annotations

from bisect import bisect_right
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
    _keep_versions(state, t)  # (and empties the memo of rates: the versions change)
    state.price_versions.append([row.price_id, row.per_chip_hour, row.unit, start, row.effective_until, hours, t])
    if start > t:
        state.push_boundary(start, PRICE_BOUNDARY, row.price_id, 0)
    if row.effective_until is not None:
        state.push_boundary(row.effective_until, PRICE_BOUNDARY, row.price_id, 0)


def price_boundary(state: PoolState, instant: int, step: Step) -> None:
    """A price starts or ends at `instant` (the clock moving past it): post and price the journal up to it, then
    forget the versions that ended."""
    _post_at(state, instant, step)
    _keep_versions(state, instant)


# --- what each run cost, and what it would have cost started off-peak (fact `run_costs`) ------------------------

OFF_PEAK_HORIZON_S: Final = WEEK_S  # how far before a run's start its off-peak start is looked for (every band once)
FREE_HOURS_KEPT: Final = 2 * WEEK_S // HOUR_S  # closed hours whose least free chips a priced pool keeps


class RunCostRow(NamedTuple):
    """A run of a job priced as it ends (fact `run_costs`), one row per unit a price in which held at some second of
    the run (a run no price held for: one row with `unit` None). Amounts follow what the run was charged (its chips on
    available chips), piece by piece; costs in 1/COST_SCALE of `unit`, exact:
    - `cost_scaled`: at the prices that held while it ran; None when some second of it had no price in `unit`;
    - `peak_mchip_s`: its charged milli-chip-seconds in peak seconds (`rates_at`);
    - `off_peak_at`, `off_peak_cost_scaled`: its start moved to the nearest off-peak start that had room
      (`run_ended`), and the same charges from there at the prices that held then; both None when none had."""
    pool: str
    job_id: str
    team: str
    run_index: int
    chips_milli: int
    started_at: int
    ended_at: int
    end_reason: str
    unit: Optional[str]
    allocated_mchip_s: int
    peak_mchip_s: int
    cost_scaled: Optional[int]
    off_peak_at: Optional[int]
    off_peak_cost_scaled: Optional[int]


def rates_at(versions: list, t: int) -> dict[str, tuple[int, bool]]:
    """Per unit, the price per chip-hour in effect at instant t (as `in_effect`) and whether t is a peak second: the
    price in effect is a band (a version with hours of the week) dearer than the cheapest version of the unit in
    effect at t (in any hour of the week). Versions that ended are history: kept while a run may need them."""
    how = hour_of_week(t)
    held: dict[str, list] = {}
    cheapest: dict[str, int] = {}
    for v in versions:
        until = v[_UNTIL]
        if v[_FROM] <= t and (until is None or t < until):
            unit = v[_UNIT]
            rate = v[_PER_CHIP_HOUR]
            low = cheapest.get(unit)
            if low is None or rate < low:
                cheapest[unit] = rate
            if v[_HOURS] is None or how in v[_HOURS]:
                h = held.get(unit)
                if h is None or h[_HOURS] is None or v[_HOURS] is not None:
                    held[unit] = v
    return {u: (v[_PER_CHIP_HOUR], v[_HOURS] is not None and v[_PER_CHIP_HOUR] > cheapest[u]) for u, v in held.items()}


def _rates_memo(state: PoolState, t: int) -> dict[str, tuple[int, bool]]:
    """`rates_at` of the pool's versions at t, memoized (core: memo) until a price is set or versions are forgotten."""
    memo = state.rates_memo
    r = memo.get(t)
    if r is None:
        if len(memo) >= 8192:
            memo.clear()
        r = memo[t] = rates_at(state.price_versions, t)
    return r


class _Prices:
    """The prices from `lo` on as running integrals per unit, exact: at each cut (every hour, every version's start
    and end) the price-seconds, the peak seconds and the unpriced seconds since lo, so a stretch's cost is a
    difference of two look-ups. Extended forward as runs end (`extend`: only up to the pool clock, where the prices
    are final); kept per pool (PoolState.price_line, derived: dropped when versions change, rebuilt on demand)."""

    def __init__(self, state: PoolState, lo: int, hi: int):
        self.lo = lo
        self.hi = lo
        self.cuts: list[int] = [lo]
        self.rates: list[dict[str, tuple[int, bool]]] = [_rates_memo(state, lo)]
        self.units: list[str] = []
        # per unit, from lo to each cut: price-seconds, peak seconds, unpriced seconds (three flat lists)
        self.price_s: dict[str, list[int]] = {}
        self.peak_s: dict[str, list[int]] = {}
        self.unpriced_s: dict[str, list[int]] = {}
        for u in sorted(self.rates[0]):
            self._new_unit(u)
        self.extend(state, hi)

    def _new_unit(self, u: str) -> None:
        """A unit first priced at the last cut: unpriced from lo until it."""
        self.units = sorted([*self.units, u])
        n = len(self.cuts)
        self.price_s[u] = [0] * n
        self.peak_s[u] = [0] * n
        self.unpriced_s[u] = [x - self.lo for x in self.cuts]

    def extend(self, state: PoolState, hi: int) -> None:
        """Know the prices up to hi (at most the pool clock)."""
        if hi <= self.hi:
            return
        cuts = self.cuts
        last = cuts[-1]  # the cuts after it, up to hi (those before the last hi were not known then: at most hi)
        new = set(range(last - last % HOUR_S + HOUR_S, hi, HOUR_S))
        for v in state.price_versions:
            for x in (v[_FROM], v[_UNTIL]):
                if x is not None and last < x < hi:
                    new.add(x)
        for x in sorted(new):
            if x <= cuts[-1]:
                continue
            prev = cuts[-1]
            r_prev = self.rates[-1]
            length = x - prev
            r = _rates_memo(state, x)
            cuts.append(x)
            self.rates.append(r)
            for u in self.units:
                ps = self.price_s[u]
                ks = self.peak_s[u]
                qs = self.unpriced_s[u]
                rate = r_prev.get(u)
                if rate is None:
                    ps.append(ps[-1])
                    ks.append(ks[-1])
                    qs.append(qs[-1] + length)
                else:
                    ps.append(ps[-1] + rate[0] * length)
                    ks.append(ks[-1] + (length if rate[1] else 0))
                    qs.append(qs[-1])
            for u in r:
                if u not in self.price_s:
                    self._new_unit(u)
        self.hi = hi

    def upto(self, unit: str, t: int) -> tuple[int, int, int]:
        """(price-seconds, peak seconds, unpriced seconds) of `unit` from lo to t."""
        i = bisect_right(self.cuts, t) - 1
        ps = self.price_s.get(unit)
        if ps is None:
            return 0, 0, t - self.cuts[0]
        x = self.cuts[i]
        r = self.rates[i].get(unit)
        if r is None:
            return ps[i], self.peak_s[unit][i], self.unpriced_s[unit][i] + t - x
        return ps[i] + r[0] * (t - x), self.peak_s[unit][i] + (t - x if r[1] else 0), self.unpriced_s[unit][i]

    def unpriced(self, unit: str, a: int, b: int) -> int:
        """Seconds of [a, b) without a price in `unit`."""
        return self.upto(unit, b)[2] - self.upto(unit, a)[2]

    def at(self, unit: str, t: int) -> Optional[tuple[int, bool]]:
        return self.rates[bisect_right(self.cuts, t) - 1].get(unit)


#: how far back the search for an off-peak start reads the free chips at a time (most runs find one within hours: the
#: whole horizon is read only when none did)
_SEARCH_STAGES: Final = (6 * HOUR_S, 2 * 24 * HOUR_S, OFF_PEAK_HORIZON_S)


def _price_line(state: PoolState, lo: int, hi: int) -> _Prices:
    """The pool's prices known from lo (or earlier) up to hi: its line extended, or a new one from a week before lo
    when it does not go back so far (or reaches back more than four weeks: rebuilt, so it stays bounded)."""
    line = state.price_line
    if line is None or line.lo > lo or line.lo < lo - 4 * OFF_PEAK_HORIZON_S:
        line = state.price_line = _Prices(state, lo - OFF_PEAK_HORIZON_S, hi)
    else:
        line.extend(state, hi)
    return line


def _pieces(job, started: int, ended: int, final_charge: int) -> list[tuple[int, int, int]]:
    """The run's (from, until, charge) pieces: its charge changed only as chips under it went down or up."""
    out = []
    a = started
    for t, before in job.charge_changes:
        if t > a:
            out.append((a, t, before))
        a = t
    if ended > a:
        out.append((a, ended, final_charge))
    return out


def _room(state: PoolState, need: int, credit: int, started: int, ended: int, lo: int) -> tuple[int, list[int]]:
    """Hours from hour_of(lo) to the open hour: (first hour, running count of hours without room for `need`
    milli-chips). An hour had room when its least free chips (plus `credit`, the run's own least charge, in the hours
    it ran whole) were at least `need`; an hour the pool kept no figure for had none."""
    first = lo - lo % HOUR_S
    now_hour = state.books.open_hour
    bad = [0]
    h = first
    while h <= now_hour:
        free: Optional[int] = state.free_min_milli if h == now_hour else state.free_hours.get(h)
        ok = False
        if free is not None:
            if started <= h and (h == now_hour or h + HOUR_S <= ended):
                free += credit
            ok = free >= need
        bad.append(bad[-1] + (0 if ok else 1))
        h += HOUR_S
    return first, bad


def run_ended(state: PoolState, job, t: int, reason: str, final_charge: int, out: list) -> None:
    """A run of a priced pool ended at t: its `run_costs` rows (RunCostRow), one per unit.

    The off-peak start: the run's own start when that second was priced and not peak; else the latest whole hour
    before it, at most OFF_PEAK_HORIZON_S before, whose first second was priced and not peak, from which the run's
    pieces, moved as a whole, were priced in every second and the pool had room for the run's chips in every hour they
    cover (the hour's least free chips, plus the run's own least charge in the hours it ran whole: those chips would
    have been free). Only hours already past count (the run ended now; later hours are not known), so the search goes
    back from the start, never forward. The free chips are read back in stages (_SEARCH_STAGES), the prices from the
    pool's running line (`_price_line`): the result is the same as reading the whole horizon at once."""
    started = job.run_started_at
    pieces = _pieces(job, started, t, final_charge)
    alloc = 0
    for a, b, c in pieces:
        alloc += c * (b - a)
    at_start = _rates_memo(state, started)
    own = _price_line(state, started - OFF_PEAK_HORIZON_S, t if t > started else started + 1)
    units = [u for u in own.units if own.unpriced(u, started, t) < t - started or (t == started and u in at_start)]
    head = (state.pool, job.job_id, job.team, job.run_index, job.chips_milli, started, t, reason)
    if not units:
        out.append(RunCostRow(*head, None, alloc, 0, None, None, None))
        return
    credit = min([final_charge, *(c[1] for c in job.charge_changes)])
    stages: list = []  # per stage of the search: (first hour, running count of hours without room)
    span = t - started
    top = started - started % HOUR_S  # the latest whole hour before the start
    if top == started:
        top -= HOUR_S
    for u in units:
        cost = 0
        peak = 0
        unpriced = 0
        for a, b, c in pieces:
            pa, ka, na = own.upto(u, a)
            pb, kb, nb = own.upto(u, b)
            cost += c * (pb - pa)
            peak += c * (kb - ka)
            unpriced += nb - na
        run_cost: Optional[int] = None if unpriced else cost
        first = at_start.get(u)
        off_at: Optional[int] = None
        off_cost: Optional[int] = None
        if first is not None and not first[1]:
            off_at, off_cost = started, run_cost
        else:
            h = top
            for k, back in enumerate(_SEARCH_STAGES):
                lo = started - back
                if k == len(stages):
                    stages.append(_room(state, job.chips_milli, credit, started, t, lo))
                first_hour, bad = stages[k]
                while h >= lo:
                    r = own.at(u, h)
                    if r is not None and not r[1] and not own.unpriced(u, h, h + span):
                        i = (h - first_hour) // HOUR_S
                        j = (h + span - 1 - first_hour) // HOUR_S + 1 if span else i
                        if bad[j] == bad[i]:
                            moved = 0
                            for a, b, c in pieces:
                                moved += c * (own.upto(u, b + h - started)[0] - own.upto(u, a + h - started)[0])
                            off_at, off_cost = h, moved
                            break
                    h -= HOUR_S
                if off_at is not None:
                    break
        out.append(RunCostRow(*head, u, alloc, peak, run_cost, off_at, off_cost))


def hour_closed(state: PoolState, hour_end: int) -> None:
    """An hour closed: a priced pool keeps its least free chips (the last FREE_HOURS_KEPT hours); the next hour's
    least free chips start at the free chips now."""
    if state.prices:
        kept = state.free_hours
        kept[hour_end - HOUR_S] = state.free_min_milli
        oldest = hour_end - FREE_HOURS_KEPT * HOUR_S
        while kept:  # kept in time order (as closed, and as saved)
            h = next(iter(kept))
            if h >= oldest:
                break
            del kept[h]
    state.free_min_milli = state.capacity_milli - state.unavailable_milli - state.charged_milli


def _keep_versions(state: PoolState, t: int) -> None:
    """Forget the price versions no run can need any more: those that ended before the earliest start of a running
    job (or now) less OFF_PEAK_HORIZON_S, and those that never held (ended before they began)."""
    since = t
    for job in state.jobs.values():
        if job.status == "running" and job.run_started_at < since:
            since = job.run_started_at
    cutoff = since - OFF_PEAK_HORIZON_S
    state.price_versions = [v for v in state.price_versions
                            if v[_UNTIL] is None or (v[_UNTIL] > v[_FROM] and v[_UNTIL] > cutoff)]
    state.rates_memo = {}
    state.price_line = None
