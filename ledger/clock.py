"""The clock and the closing of hours, and closing the books.

The rules:
- time advances only with the events' `occurred_at`; the pool clock is monotonic (evolve applies a late event at
  the clock and records its lateness);
- before an event is applied the clock is advanced to it, closing each hour it passes (the journal, the policy's
  balance and pending rows, the waits still open that began in it) and applying the grant and burst boundaries
  on the way in time order, so every interval is accrued at the rates that held during it;
- a stretch of hours that posts nothing is closed at once, not hour by hour: the cost of a jump of the clock
  follows the rows it writes, not the hours it spans;
- event ids are remembered for the dedup window of event time, and forgotten as the clock passes it;
- closing the books (`close_books`, `close_facts`) posts early what is known so far (the open hour's journal,
  each running job's allocation, the open waits, the free chips of this second) without changing what later
  events post in total.
"""

from __future__ import annotations

import heapq
from typing import Final, Optional

from ledger import costs, policy
from ledger.books import HOUR_S
from ledger.chips import _post_free_chips
from ledger.grants import _burst_off, _burst_on, _grant_off, _grant_on
from ledger.jobs import _accrue_job, _run_row
from ledger.state import ORIGIN_SEP, PoolState
from ledger.step import DEFAULT_CONFIG, OPEN, FoldConfig, Step, _rows
from ledger.waits import _post_open_waits, _wait_order, _wait_row


def _advance(state: PoolState, t: int, step: Step, config: FoldConfig = DEFAULT_CONFIG) -> None:
    """Move the pool clock to t, closing hours and applying grant and burst boundaries in time order."""
    books = state.books
    bounds = state.boundaries
    while True:
        hour_end = books.open_hour + 3600
        b = bounds[0][0] if bounds else None
        if b is not None and b < hour_end:
            if b > t:
                break
            instant, _, kind, ident, version = heapq.heappop(bounds)
            if kind == costs.PRICE_BOUNDARY:  # the books post at a price's start and end (ledger.costs)
                costs.price_boundary(state, instant, step)
            else:
                _BOUNDARY[kind](state, ident, version, instant)
        elif hour_end <= t:
            journal = _rows(step, "journal")
            first = len(journal)
            books.close_hour(journal)
            if state.price_versions:
                costs.price_postings(state, journal, first, hour_end, _rows(step, "costs"))
            costs.hour_closed(state, hour_end)  # the hour's least free chips (room for a run moved off-peak)
            policy.hour_closed(state, hour_end - HOUR_S, step, config)
            if state.pending_sizes:
                _post_open_waits(state, hour_end - HOUR_S, step)
            # a stretch of hours that post nothing is closed at once, not hour by hour: the cost of a jump of
            # the clock follows the rows it writes, not the hours it spans
            stop = t if b is None or b > t else b
            if stop - books.open_hour >= HOUR_S and _quiet(state, config):
                n = (stop - books.open_hour) // HOUR_S
                policy.quiet_hours_closed(state, books.open_hour, n, config)
                books.skip_hours(n)  # (no chips: no free chips in them, and no room; costs.hour_closed keeps none)
        else:
            break
    state.clock = t
    state.reset_until()


def _quiet(state: PoolState, config: FoldConfig) -> bool:
    """Whether closing an hour now writes no row: nothing accrues (every rate is 0) and no balance rows are due
    (no teams, or no policy rows). Pending jobs accrue to `pending`, so they make a pool not quiet."""
    if config.policy_rows and state.teams:
        return False
    for acc in state.books.accounts.values():
        if acc[0]:
            return False
    return True


def _forget_ids(state: PoolState, horizon: int) -> None:
    """Drop the remembered event ids applied before `horizon` (they are in arrival order, and so in clock order)."""
    order = state.dedup_order
    dedup = state.dedup
    popleft = order.popleft
    while order:
        eid = order[0]
        if dedup[eid][1] >= horizon:
            break
        popleft()
        del dedup[eid]
    if state.legacy_ids and (not order or ORIGIN_SEP in order[0]):  # the ids saved before origins came first: all gone
        state.legacy_ids = False


_BOUNDARY: Final = {"grant_on": _grant_on, "grant_off": _grant_off, "burst_on": _burst_on, "burst_off": _burst_off}


def close_books(state: PoolState, until: Optional[int] = None,
                config: FoldConfig = DEFAULT_CONFIG, costs_out: Optional[list] = None) -> tuple[list, list]:
    """Bring the books up to `until` (default: the pool clock) and post everything accrued so far: the open
    hour's journal so far and each running job's allocation so far. Returns (journal rows, job run rows); the
    cost rows of what it posted (ledger.costs) go to `costs_out` when given.

    Closing does not change what later events will post in total; it only posts earlier what is known."""
    step = Step()
    if until is not None and until > state.clock:
        _advance(state, until, step, config)
    t = state.clock
    journal = _rows(step, "journal")
    runs = []
    first = len(journal)
    state.books.flush(t, journal)
    if costs_out is not None:
        costs_out.extend(step.costs)  # priced at the price boundaries passed on the way to `until`
        costs.price_postings(state, journal, first, t, costs_out)
    for job in state.jobs.values():
        if job.status == "running":
            _accrue_job(job, t)
            amount = job.run_alloc_mchip_s - job.run_posted_mchip_s
            if amount:
                runs.append(_run_row(state, job, t, None, None, amount, 0))
                job.run_posted_mchip_s = job.run_alloc_mchip_s
    return journal, runs


def close_facts(state: PoolState) -> dict[str, list]:
    """The facts a close of the books posts at the pool clock: each wait still open (a later posting of the same
    wait supersedes it) and the free chips of the current second not posted yet. {"waits": rows, "free_chips":
    rows}."""
    t = state.clock
    pending = sorted((job for job in state.jobs.values() if job.status == "pending"), key=_wait_order)
    waits = [_wait_row(state, job, job.run_index, None, OPEN, t) for job in pending]
    step = Step()
    if state.fc_row is not None:
        _post_free_chips(state, step)
    return {"waits": waits, "free_chips": list(step.free_chips)}


def policy_rows(state: PoolState, config: FoldConfig = DEFAULT_CONFIG) -> tuple[list, list]:
    """Balance rows of every team and the reason of every pending job at the pool clock (read-only: what a
    close of the books adds to the hourly rows)."""
    balances: list = []
    pending: list = []
    policy.snapshot(state, state.clock, balances, pending, config)
    return balances, pending
