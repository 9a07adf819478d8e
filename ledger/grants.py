"""Grants and bursts: quota.granted, quota.revoked, burst.requested, their boundaries in time, and the fact
`grant_intervals`.

The rules:
- a grant gives its team nominal quota from max(granted, effective_from) until its effective_until or its
  revocation; a grant whose effective_until the clock passes has ended by then, also for the checks of later
  events (`_held_grant`);
- a re-grant under the same id amends the grant: the earlier incarnation ends at once and the new one (a new
  version, unique in the pool) takes effect; a grant id belongs to one team;
- the grants held in a pool total at most the pool bound (MAX_POOL_CHIPS);
- a burst request is decided at once by the policy (ledger/policy.py decide_burst); an approved or cut burst is
  a reservation for its window, adding burst quota to its team in it; a request id is decided once;
- a grant's or a burst's start and end in the future are boundaries the clock applies in time order
  (ledger/clock.py); each change re-tallies the team (ledger/rates.py) and makes the policy look at every queue.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from schemas.codes import Rejection, RejectionCode as RC
from schemas.events import MAX_POOL_CHIPS, MAX_POOL_MILLI, epoch_s

from ledger import policy
from ledger.rates import _retally_team
from ledger.state import Grant, PoolState
from ledger.step import DEFAULT_CONFIG, MILLI, Step, _chips_text, _new_tuple, _rows


class GrantIntervalRow(NamedTuple):
    """A fact (lake table `grant_intervals`): one incarnation of a grant (a `quota.granted` the pool holds), in
    effect from `effective_from` until `effective_until` (None: until revoked). Posted when granted, with the end
    it was granted for; when it ends earlier (amended by a re-grant of its id, or revoked) its end is posted
    (`ended` true, `granted_at` and `effective_from` None): the earlier end holds (before the incarnation took
    effect, it never was)."""

    pool: str
    grant_id: str
    team: str
    version: int          # the incarnation: unique in the pool (a re-grant of the id is a new one)
    chips_milli: int
    borrowing_limit_milli: Optional[int]
    lending_limit_milli: Optional[int]
    granted_at: Optional[int]
    effective_from: Optional[int]   # max(granted_at, the grant's effective_from)
    effective_until: Optional[int]
    ended: bool
    posted_at: int


def _held_grant(s: PoolState, e) -> Optional[Grant]:
    """The grant `e.grant_id` as it will be held when `e` is applied: a grant whose `effective_until` the
    clock passes on the way to `e` has ended by then. Checks run before the clock advances (a rejected event
    must not move it), so without this the verdict would depend on whether some other event came between."""
    g = s.grants.get(e.grant_id)
    t = max(e.at_s, s.clock)
    if g is not None and g.effective_until is not None and g.effective_until <= t:
        return None
    return g


def _check_quota_granted(s: PoolState, e):
    g = _held_grant(s, e)
    if g is not None and g.team != e.team:
        return Rejection(RC.illegal_transition,
                         f"grant {e.grant_id!r} belongs to team {g.team!r}, not {e.team!r}; revoke it and grant anew")
    own = s.grants.get(e.grant_id)
    held = s.held_milli - (own.chips_milli if own is not None else 0)  # a re-grant replaces its own amount
    if held + e.chips_milli > MAX_POOL_MILLI:
        return Rejection(RC.over_limit, f"the grants held in pool {s.pool!r} would total {_chips_text(held + e.chips_milli)} "
                         f"chips, over the pool bound of {MAX_POOL_CHIPS:,} (docs/events.md, Limits)")
    return None


def _check_quota_revoked(s: PoolState, e):
    if _held_grant(s, e) is None:
        return Rejection(RC.unknown_grant, f"grant {e.grant_id!r} is not held in pool {s.pool!r}")
    return None


def _apply_quota_granted(s: PoolState, e, t, step, config=DEFAULT_CONFIG):
    old = s.grants.pop(e.grant_id, None)
    if old is not None:
        s.held_milli -= old.chips_milli
        _post_grant_end(s, old, t, step)
    if old is not None:  # a re-grant under the same id amends the grant
        _deactivate(s, old, t)
    # versions are unique in the pool, not per grant: a grant id revoked and granted anew must not match the
    # boundaries still queued for its earlier incarnation
    s.seq += 1
    version = s.seq
    g = Grant(e.grant_id, e.team, e.chips_milli, _milli_or_none(e.borrowing_limit),
              _milli_or_none(e.lending_limit), _ts(e.effective_from), _ts(e.effective_until), version)
    s.team(e.team)
    if g.effective_until is not None and g.effective_until <= t:
        return  # already over: nothing to hold
    s.grants[g.grant_id] = g
    s.held_milli += g.chips_milli
    _post_grant(s, g, t, step)
    if g.effective_from is None or g.effective_from <= t:
        _grant_on(s, g.grant_id, version, t)
    else:
        s.push_boundary(g.effective_from, "grant_on", g.grant_id, version)
    if g.effective_until is not None:
        s.push_boundary(g.effective_until, "grant_off", g.grant_id, version)


def _apply_quota_revoked(s: PoolState, e, t, step, config=DEFAULT_CONFIG):
    g = s.grants.pop(e.grant_id)  # the check saw it held at t
    s.held_milli -= g.chips_milli
    _post_grant_end(s, g, t, step)
    _deactivate(s, g, t)


def _deactivate(s: PoolState, g: Grant, t: int) -> None:
    if g.active:
        g.active = False
        team = s.teams[g.team]
        team.nominal_milli -= g.chips_milli
        _retally_team(s, team, t)
        s.other_epoch += 1
        s.quota_epoch += 1


def _grant_on(state: PoolState, grant_id: str, version: int, t: int) -> None:
    g = state.grants.get(grant_id)
    if g is None or g.version != version or g.active:
        return
    if g.effective_until is not None and g.effective_until <= t:
        return
    g.active = True
    team = state.team(g.team)
    team.nominal_milli += g.chips_milli
    _retally_team(state, team, t)
    state.policy_full = True
    state.other_epoch += 1
    state.quota_epoch += 1


def _grant_off(state: PoolState, grant_id: str, version: int, t: int) -> None:
    g = state.grants.get(grant_id)
    if g is None or g.version != version:
        return
    _deactivate(state, g, t)
    del state.grants[grant_id]
    state.held_milli -= g.chips_milli
    state.policy_full = True
    state.other_epoch += 1
    state.quota_epoch += 1


def _post_grant(s: PoolState, g: Grant, t: int, step: Step) -> None:
    """A grant the pool holds from t, in effect from max(t, effective_from) until its effective_until (fact
    `grant_intervals`). Never empty: a grant is held only while its effective_until is ahead of the clock, and
    the schema has it after effective_from."""
    start = t if g.effective_from is None or g.effective_from < t else g.effective_from
    _rows(step, "grant_intervals").append(_grant_row(s, g, t, start, g.effective_until, False, t))


def _post_grant_end(s: PoolState, g: Grant, t: int, step: Step) -> None:
    """A grant held until t (revoked, or amended by a re-grant of its id) ends at t, before the end it was granted
    for (a grant's effective_until passes before any event at or after it): the end of its incarnation."""
    _rows(step, "grant_intervals").append(_grant_row(s, g, None, None, t, True, t))


def _grant_row(s: PoolState, g: Grant, granted: Optional[int], start: Optional[int], until: Optional[int],
               ended: bool, t: int) -> GrantIntervalRow:
    return _new_tuple(GrantIntervalRow, (s.pool, g.grant_id, g.team, g.version, g.chips_milli,
                                         g.borrowing_limit_milli, g.lending_limit_milli, granted, start, until,
                                         ended, t))


def _ts(ts) -> Optional[int]:
    return None if ts is None else epoch_s(ts)


def _milli_or_none(chips) -> Optional[int]:
    return None if chips is None else int(chips * MILLI)


def _apply_burst_requested(s: PoolState, e, t, step, config=DEFAULT_CONFIG):
    """Decide the request now; an approved or cut burst is a reservation for its window (burst_on/off)."""
    s.team(e.team)
    decision, reservation = policy.decide_burst(s, e, t, config)
    _rows(step, "decisions").append(policy.decision_row(decision, t))
    policy.count_decision(s, "burst", decision.rule, decision.verdict)
    if reservation is not None and e.request_id not in s.bursts:  # a request id is decided once
        s.bursts[e.request_id] = reservation
        start, end = reservation[2], reservation[3]
        if start <= t:
            _burst_on(s, e.request_id, 0, t)
        else:
            s.push_boundary(start, "burst_on", e.request_id)
        s.push_boundary(end, "burst_off", e.request_id)


def _burst_on(state: PoolState, request_id: str, version: int, t: int) -> None:
    b = state.bursts.get(request_id)
    if b is None or b[4]:
        return
    b[4] = True
    team = state.teams[b[0]]
    team.burst_milli += b[1]
    _retally_team(state, team, t)
    state.policy_full = True
    state.other_epoch += 1
    state.quota_epoch += 1


def _burst_off(state: PoolState, request_id: str, version: int, t: int) -> None:
    b = state.bursts.pop(request_id, None)
    if b is None or not b[4]:
        return
    team = state.teams[b[0]]
    team.burst_milli -= b[1]
    _retally_team(state, team, t)
    state.policy_full = True
    state.other_epoch += 1
    state.quota_epoch += 1
