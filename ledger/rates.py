"""What each account accrues at: after any change of a team's use, quota or bursts, or of the pool's chips,
the rates of the books' accounts follow (ledger/books.py accrues them over time).

The rules:
- a team's use splits (DESIGN §4) into in quota (up to its nominal quota: the grants in effect), burst (beyond
  it, up to its approved bursts in effect) and borrowed (the rest); its entitlement is its nominal quota;
- a running job is charged its chips' shares on available chips (a share on a down chip is charged to nobody);
- the pool's capacity is its registered chips, unavailable those down or in maintenance, overcommitted what is
  charged beyond the available chips; idle is derived from the others when the books post (`Books._post`);
- a team's pending account accrues the chips of its jobs waiting to start.
"""

from __future__ import annotations

from ledger.books import set_rate
from ledger.state import Job, PoolState, Team


def split_use(use_milli: int, nominal_milli: int, burst_milli: int) -> tuple[int, int, int]:
    """The team split of DESIGN §4: (in_quota, borrowed, burst)."""
    in_quota = use_milli if use_milli < nominal_milli else nominal_milli
    over = use_milli - in_quota
    burst = over if over < burst_milli else burst_milli
    return in_quota, over - burst, burst


def _retally_team(state: PoolState, team: Team, t: int) -> None:
    """The team's split and entitlement after its use, quota or bursts changed."""
    iq, bo, bu, en, _ = state.books.team_accounts(team.name)
    in_quota, borrowed, burst = split_use(team.use_milli, team.nominal_milli, team.burst_milli)
    set_rate(iq, in_quota, t)
    set_rate(bo, borrowed, t)
    set_rate(bu, burst, t)
    set_rate(en, team.nominal_milli, t)


def _retally_pool(state: PoolState, t: int) -> None:
    """The pool's buckets after its chips or the charged total changed (idle is derived by the books)."""
    cap, unav, _, over = state.books.pool_accounts()
    available = state.capacity_milli - state.unavailable_milli
    charged = state.charged_milli
    set_rate(cap, state.capacity_milli, t)
    set_rate(unav, state.unavailable_milli, t)
    set_rate(over, charged - available if charged > available else 0, t)


def _charge(state: PoolState, job: Job, new_charge: int, t: int) -> None:
    """Change what a running job is charged from instant t on; the team's split and the pool's overcommitted
    bucket follow (capacity, unavailable and entitlement do not change with a charge)."""
    delta = new_charge - job.charged_milli
    if not delta:
        return
    job.run_alloc_mchip_s += job.charged_milli * (t - job.since)
    job.since = t
    job.charge_changes.append([t, job.charged_milli])  # the run's pieces, priced as it ends (ledger.costs)
    job.charged_milli = new_charge
    _use(state, state.teams[job.team], delta, t)


def _use(state: PoolState, team: Team, delta: int, t: int) -> None:
    """The team's use changes by `delta` milli-chips at t: its in-quota / borrowed / burst split and the pool's
    overcommitted bucket follow; the pool's idle bucket is derived from the others when the books post
    (`Books._post`). (core: written out) split_use and set_rate: this runs at every start and end of a run."""
    use = team.use_milli = team.use_milli + delta
    charged = state.charged_milli = state.charged_milli + delta
    books = state.books
    h = books._handles.get(team.name)
    if h is None:
        h = books.team_accounts(team.name)
    nominal = team.nominal_milli
    acc = h[0]
    if use <= nominal:  # the common case: all in quota, nothing borrowed, no burst in use
        if acc[0] != use:
            acc[2] += acc[0] * (t - acc[1])
            acc[1] = t
            acc[0] = use
        acc = h[1]
        if acc[0]:
            acc[2] += acc[0] * (t - acc[1])
            acc[1] = t
            acc[0] = 0
        acc = h[2]
        if acc[0]:
            acc[2] += acc[0] * (t - acc[1])
            acc[1] = t
            acc[0] = 0
    else:
        if acc[0] != nominal:
            acc[2] += acc[0] * (t - acc[1])
            acc[1] = t
            acc[0] = nominal
        over = use - nominal
        burst = team.burst_milli
        if over < burst:
            burst = over
        rate = over - burst
        acc = h[1]
        if acc[0] != rate:
            acc[2] += acc[0] * (t - acc[1])
            acc[1] = t
            acc[0] = rate
        acc = h[2]
        if acc[0] != burst:
            acc[2] += acc[0] * (t - acc[1])
            acc[1] = t
            acc[0] = burst
    h = books._handles.get(None)
    if h is None:
        h = books.pool_accounts()
    acc = h[3]  # overcommitted: what is charged beyond the available chips (rare)
    free = state.capacity_milli - state.unavailable_milli - charged
    if free < 0:
        if acc[0] != -free:
            acc[2] += acc[0] * (t - acc[1])
            acc[1] = t
            acc[0] = -free
    elif acc[0]:
        acc[2] += acc[0] * (t - acc[1])
        acc[1] = t
        acc[0] = 0


def _pending_demand(state: PoolState, name: str, jobs: int, milli: int, t: int) -> None:
    """Change a team's pending jobs and chips, and the rate of its `pending` account, at t."""
    team = state.teams[name]
    team.pending += jobs
    rate = team.pending_milli = team.pending_milli + milli
    h = state.books._handles.get(name)
    if h is None:
        h = state.books.team_accounts(name)
    set_rate(h[4], rate, t)
