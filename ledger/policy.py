"""The policy layer of the core: fair share, burst admission, preemption decisions and why a job waits.

Pure like the fold (no I/O, no clock, no logging); it reads a `PoolState` the fold keeps up to date and
returns decisions as values. The rules are those of DESIGN §4, written out with every tie-breaker in
docs/policy.md.

Costs on the fold's common path, by design:
- decayed usage is not touched per event: at each close of an hour every team's usage is decayed by one hour
  and the hour's use (in_quota + borrowed + burst postings, from the books' totals) is added; in between,
  the current value is computed on demand (`decayed_usage`);
- preemption is evaluated only after an event that can create a shortage (a job waiting, chips lost, quota
  or bursts changed) while some pending job is larger than the free chips, or when an instant it asked to be
  woken at (a grace period ending, a decision timing out, a victim's protection ending) has passed.
"""

from __future__ import annotations

import orjson
from datetime import datetime, timezone
from typing import Any, Iterator, NamedTuple, Optional

from schemas.events import MILLI, epoch_s
from schemas.outputs import DecisionBurst, DecisionPreempt

from ledger.books import BORROWED, BURST, CAPACITY, HOUR_S, IN_QUOTA, PENDING, UNAVAILABLE, hour_of
from ledger.state import Job, PoolState, Team

NEVER = 1 << 62
BUDGET_HOURS = 720  # the capacity error budget's rolling window: 30 days
HOURS_OF_WEEK = 168
FAST_BURN = 14.4    # SRE workbook page threshold: the last hour burning the 30-day budget this fast denies bursts

# reasons a job is pending (docs/policy.md)
READY = "ready"
WOULD_BORROW = "would_borrow"
NOT_ON_WHOLE_NODES = "not_on_whole_nodes"
WAITING_GRACE = "waiting_grace"
PREEMPTION_IN_FLIGHT = "preemption_in_flight"
WAITING_FOR_CHIPS = "waiting_for_chips"
OVER_BORROWING_LIMIT = "over_borrowing_limit"
NOTHING_TO_LEND = "nothing_to_lend"
REASONS = (READY, WOULD_BORROW, NOT_ON_WHOLE_NODES, WAITING_GRACE, PREEMPTION_IN_FLIGHT, WAITING_FOR_CHIPS,
           OVER_BORROWING_LIMIT, NOTHING_TO_LEND)


class BalanceRow(NamedTuple):
    """A team's balance at an instant (lake table `balances`): integers, and the fair-share factor the core
    computes from them (the view derives only chips and the borrowed share)."""

    pool: str
    team: str
    at: int
    nominal_milli: int
    used_milli: int
    borrowed_milli: int
    burst_milli: int
    pending_milli: int
    decayed_usage_mchip_s: int
    lendable_milli: int  # the pool's lendable chips at `at` (borrowed_share = borrowed / lendable)
    fair_share_factor: float  # F at `at` (fair_share_factor over the pool's teams)


class PendingRow(NamedTuple):
    """Why a job is pending at an instant (lake table `pending`)."""

    pool: str
    job_id: str
    team: str
    at: int
    chips_milli: int
    priority: int
    waiting_since: int
    reason: str
    message: str


class DecisionRow(NamedTuple):
    """A decision as a lake row (table `decisions`); `body` is the decision's JSON, what the Kafka worker sends
    to chipledger.decisions (`decision_of` turns it back into the model)."""

    decision_id: str
    type: str
    pool: str
    at: int
    rule: str
    message: str
    body: str


def decision_row(d, t: int) -> DecisionRow:
    return DecisionRow(d.decision_id, d.type, d.pool, t, d.rule, d.message, d.model_dump_json())


def decision_of(row):
    """The DecisionPreempt / DecisionBurst of a decisions row."""
    return (DecisionPreempt if row[1] == "decision.preempt" else DecisionBurst).model_validate_json(row[6])


def _chips(milli: int) -> str:
    return f"{milli / MILLI:g}"


def _ts(t: int) -> datetime:
    return datetime.fromtimestamp(t, tz=timezone.utc)


def _civil(t: int) -> Optional[tuple[int, int, int, int, int, int]]:
    """(year, month, day, hour, minute, second) of epoch second t in UTC, by integer arithmetic (H. Hinnant's
    days-from-civil inverse): what `datetime.strftime` gives, without building a datetime for every row.
    None outside the years 1000-9999, where strftime's %Y would not print four digits."""
    days, sec = divmod(t, 86400)
    z = days + 719468
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    d = doy - (153 * mp + 2) // 5 + 1
    m = mp + 3 if mp < 10 else mp - 9
    y = yoe + era * 400 + (1 if m <= 2 else 0)
    if not 1000 <= y <= 9999:
        return None
    hh, rem = divmod(sec, 3600)
    mm, ss = divmod(rem, 60)
    return y, m, d, hh, mm, ss


def _iso(t: int) -> str:
    """RFC 3339 UTC, as pydantic writes an aware datetime: 2026-11-02T08:34:20Z."""
    c = _civil(t)
    if c is None:
        return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return "%04d-%02d-%02dT%02d:%02d:%02dZ" % c


def _utc(t: int) -> str:
    """`f"{_ts(t):%Y-%m-%d %H:%M:%S}"`: the instants in reasons and messages."""
    c = _civil(t)
    if c is None:
        return f"{_ts(t):%Y-%m-%d %H:%M:%S}"
    return "%04d-%02d-%02d %02d:%02d:%02d" % c


# ---------------------------------------------------------------------------------------------------------
# fair share
# ---------------------------------------------------------------------------------------------------------

def _used_total(state: PoolState, team: str, t: int) -> int:
    """Everything the team has used up to t (posted plus accrued in the open hour), mchip-s."""
    books = state.books
    total = 0
    for acc_name in (IN_QUOTA, BORROWED, BURST):
        key = (acc_name, team)
        total += books.totals.get(key, 0)
        acc = books.accounts.get(key)
        if acc is not None:
            total += acc[2] + acc[0] * (t - acc[1])
    return total


def decayed_usage(state: PoolState, team: Team, t: int, half_life_s: int) -> int:
    """U(t) = U(h)·2^(-(t-h)/H) + used since h, h the last close of an hour (DESIGN §4)."""
    h = state.books.open_hour
    u = team.decayed_usage_mchip_s
    if u and t > h:
        u = round(u * 2.0 ** (-(t - h) / half_life_s))
    return u + _used_total(state, team.name, t) - team.usage_mark_mchip_s


def decayed_usages(state: PoolState, t: int, half_life_s: int) -> dict[str, int]:
    """`decayed_usage` of every team at t (written out: the decay factor is the same for all of them)."""
    books = state.books
    h = books.open_hour
    decay = 2.0 ** (-(t - h) / half_life_s) if t > h else None
    totals = books.totals
    accounts = books.accounts
    handles = books._handles
    usage = {}
    for name, tm in state.teams.items():
        u = tm.decayed_usage_mchip_s
        if u and decay is not None:
            u = round(u * decay)
        u += (totals.get((IN_QUOTA, name), 0) + totals.get((BORROWED, name), 0) + totals.get((BURST, name), 0)
              - tm.usage_mark_mchip_s)
        hd = handles.get(name)
        if hd is not None:
            a = hd[0]
            u += a[2] + a[0] * (t - a[1])
            a = hd[1]
            u += a[2] + a[0] * (t - a[1])
            a = hd[2]
            u += a[2] + a[0] * (t - a[1])
        else:
            for acc_name in (IN_QUOTA, BORROWED, BURST):
                acc = accounts.get((acc_name, name))
                if acc is not None:
                    u += acc[2] + acc[0] * (t - acc[1])
        usage[name] = u
    return usage


def fair_share_factor(usage: int, total_usage: int, nominal_milli: int, total_nominal_milli: int) -> float:
    """F = 2^(-(U/ΣU)/S) with S = nominal / Σ nominal: 1 for a team with no usage (or none in the pool), 0 for a
    team with usage and no quota."""
    if total_usage <= 0 or usage <= 0:
        return 1.0
    if nominal_milli <= 0 or total_nominal_milli <= 0:
        return 0.0
    return 2.0 ** (-(usage / total_usage) / (nominal_milli / total_nominal_milli))


def fair_shares(state: PoolState, t: int, half_life_s: int) -> dict[str, tuple[int, float]]:
    """Per team: (decayed usage mchip-s, fair-share factor F = 2^(-(U/ΣU)/S), S = nominal / Σ nominal).
    F is 1 with no usage in the pool; a team with no quota has F 0 once it used anything."""
    usage = decayed_usages(state, t, half_life_s)
    teams = state.teams
    total_u = sum(usage.values())
    total_n = sum(tm.nominal_milli for tm in teams.values())
    out = {}
    for name, tm in teams.items():
        u = usage[name]
        f = fair_share_factor(u, total_u, tm.nominal_milli, total_n)
        out[name] = (u, f)
    return out


def team_limits(state: PoolState) -> dict[str, tuple[Optional[int], Optional[int]]]:
    """Per team with grants in effect: (borrowing limit, lending limit) in milli-chips, the sums over its
    grants; None (unlimited / lend all) as soon as one grant in effect has no limit."""
    out: dict[str, list] = {}
    for g in state.grants.values():
        if not g.active:
            continue
        cur = out.get(g.team)
        if cur is None:
            out[g.team] = [g.borrowing_limit_milli, g.lending_limit_milli]
        else:
            cur[0] = None if cur[0] is None or g.borrowing_limit_milli is None else cur[0] + g.borrowing_limit_milli
            cur[1] = None if cur[1] is None or g.lending_limit_milli is None else cur[1] + g.lending_limit_milli
    return {k: (v[0], v[1]) for k, v in out.items()}


def guarded_milli(team: Team, lending_limit: Optional[int]) -> int:
    """The part of a team's unused quota it does not lend (above its lending limit)."""
    if lending_limit is None:
        return 0
    unused = team.nominal_milli - team.use_milli
    return unused - lending_limit if unused > lending_limit else 0


def lendable_milli(state: PoolState, limits) -> int:
    """What the pool can lend: the lendable part of every team's quota, plus capacity no quota covers."""
    available = state.capacity_milli - state.unavailable_milli
    total_n = 0
    lendable = 0
    for name, tm in state.teams.items():
        n = tm.nominal_milli
        total_n += n
        llim = limits.get(name, (None, None))[1]
        lendable += n if llim is None else min(n, llim)
    return lendable + max(0, available - total_n)


def free_milli(state: PoolState) -> int:
    free = state.capacity_milli - state.unavailable_milli - state.charged_milli
    return free if free > 0 else 0


def borrowed_of(team: Team) -> tuple[int, int]:
    """(ordinary borrowed, burst in use) of a team now."""
    over = team.use_milli - team.nominal_milli
    if over <= 0:
        return 0, 0
    burst = over if over < team.burst_milli else team.burst_milli
    return over - burst, burst


# ---------------------------------------------------------------------------------------------------------
# the close of an hour: decay, demand profile, error budget, balances and pending reasons
# ---------------------------------------------------------------------------------------------------------

def hour_of_week(t: int) -> int:
    """Monday 00:00 UTC is 0 (1970-01-01 was a Thursday)."""
    return ((t // 86400 + 3) % 7) * 24 + (t % 86400) // 3600


def hour_closed(state: PoolState, hour_start: int, step, config) -> None:
    """Called by the fold right after the books posted the hour [hour_start, hour_start + 1h)."""
    end = hour_start + HOUR_S
    decay = 2.0 ** (-HOUR_S / config.decay_half_life_s)
    totals = state.books.totals
    demand = 0
    for name, tm in state.teams.items():
        used = totals.get((IN_QUOTA, name), 0) + totals.get((BORROWED, name), 0) + totals.get((BURST, name), 0)
        dem = used + totals.get((PENDING, name), 0)
        tm.decayed_usage_mchip_s = round(tm.decayed_usage_mchip_s * decay) + used - tm.usage_mark_mchip_s
        demand += dem - tm.demand_mark_mchip_s
        tm.usage_mark_mchip_s = used
        tm.demand_mark_mchip_s = dem
    prof = state.profile[hour_of_week(hour_start)]
    prof[0] += demand // HOUR_S
    prof[1] += 1
    cap = totals.get((CAPACITY, None), 0)
    unav = totals.get((UNAVAILABLE, None), 0)
    marks = state.pool_marks
    state.budget_hours.append([cap - marks[0], unav - marks[1]])
    marks[0], marks[1] = cap, unav
    if len(state.budget_hours) > BUDGET_HOURS:
        state.budget_hours.popleft()
    if config.policy_rows:
        snapshot(state, end, step.rows("balances"), step.rows("pending"), config)


def quiet_hours_closed(state: PoolState, first_start: int, n: int, config) -> None:
    """The effect of `hour_closed` on n hours from `first_start` in which nothing accrued and no rows are
    written (the fold's `_quiet`): usage decays, each hour of the week counts the hours seen (with zero
    demand), the error budget's window gets empty hours. The cost follows the 168 hours of a week and the 720
    of the budget, not n: a team's decay stops at its fixed point (a usage that rounds to itself), which comes
    within a few thousand hours whatever the gap."""
    decay = 2.0 ** (-HOUR_S / config.decay_half_life_s)
    for tm in state.teams.values():
        u = tm.decayed_usage_mchip_s
        for _ in range(n):
            v = round(u * decay)
            if v == u:
                break
            u = v
        tm.decayed_usage_mchip_s = u
    weeks, rest = divmod(n, HOURS_OF_WEEK)
    w0 = hour_of_week(first_start)
    prof = state.profile
    for i in range(min(n, HOURS_OF_WEEK)):
        prof[(w0 + i) % HOURS_OF_WEEK][1] += weeks + (1 if i < rest else 0)
    hours = state.budget_hours
    for _ in range(min(n, BUDGET_HOURS)):
        hours.append([0, 0])
    while len(hours) > BUDGET_HOURS:
        hours.popleft()


def snapshot(state: PoolState, t: int, balances: list, pending: list, config) -> None:
    """Balance rows of every team and the reason of every pending job, as of t (read-only)."""
    limits = team_limits(state)
    lendable = lendable_milli(state, limits)
    usage = decayed_usages(state, t, config.decay_half_life_s)
    total_u = sum(usage.values())
    total_n = sum(tm.nominal_milli for tm in state.teams.values())
    pool = state.pool
    for name in sorted(state.teams):
        tm = state.teams[name]
        borrowed, burst = borrowed_of(tm)
        u = usage[name]
        balances.append(_new_tuple(BalanceRow, (pool, name, t, tm.nominal_milli, tm.use_milli, borrowed, burst,
                                                tm.pending_milli, u, lendable,
                                                fair_share_factor(u, total_u, tm.nominal_milli, total_n))))
    if not state.pending_sizes:
        return
    ctx = _Context(state, limits)
    inflight = state.inflight
    short_since = state.short_since
    for team in sorted(state.waiting):
        # a job with no decision in flight and no grace running has a reason that depends only on its team,
        # chips and chips per node: computed once per kind of job
        memo: dict = {}
        for job in sorted(state.waiting[team].values(), key=_waiting_key):
            jid = job.job_id
            why: Any
            if jid in inflight or jid in short_since:
                why = pending_reason(state, job, t, config, ctx)
            else:
                shape = (job.chips_milli, job.chips_per_node)
                why = memo.get(shape)
                if why is None:
                    why = memo[shape] = pending_reason(state, job, t, config, ctx)
            pending.append(_new_tuple(PendingRow, (pool, jid, team, t, job.chips_milli, job.priority,
                                                   job.waiting_since, why[0], why[1])))


def _waiting_key(job: Job):
    return (job.waiting_since, job.job_id)


_new_tuple = tuple.__new__  # a NamedTuple row without its Python-level __new__


class _Context:
    """Pool-wide numbers shared by the reasons of many jobs at one instant."""

    def __init__(self, state: PoolState, limits: dict[str, tuple[Optional[int], Optional[int]]],
                 lenders: Optional[list[tuple[str, int]]] = None):
        self.limits = limits
        self.free, self.promised = unpromised_free(state)  # as the rules count them (evaluate)
        # only a team with a lending limit keeps unused quota from others (guarded_milli is 0 for the rest)
        if lenders is None:
            lenders = [(n, v[1]) for n, v in limits.items() if v[1] is not None]
        teams = state.teams
        guarded: dict[str, int] = {}
        total = 0
        for name, llim in lenders:
            g = guarded[name] = guarded_milli(teams[name], llim)
            total += g
        self.guarded = guarded
        self.guarded_total = total
        self._node_free: Optional[dict[str, int]] = None
        self._state = state

    def node_free(self) -> dict[str, int]:
        """Free available chips per node (chips with no job placed on them)."""
        if self._node_free is None:
            nf: dict[str, int] = {}
            for chip in self._state.chips.values():
                if chip.available and not chip.jobs:
                    nf[chip.node] = nf.get(chip.node, 0) + 1
            self._node_free = nf
        return self._node_free


def whole_nodes_milli(state: PoolState, cpn: int) -> int:
    """The most chips a job asking for `cpn` chips per node could be placed on now: `cpn` per node on the nodes'
    free chips (available, nothing placed; counted by the fold per count of free chips). A job needs
    ceil(chips / cpn) such node slots, which is to say at most this many chips."""
    return sum(c * (k // cpn) for k, c in state.node_free_counts.items()) * cpn * MILLI


def _on_whole_nodes(job: Job, ctx: _Context) -> bool:
    """Whether the free chips can hold the job at its chips per node (True for jobs that do not ask)."""
    cpn = job.chips_per_node
    return cpn is None or job.chips_milli <= whole_nodes_milli(ctx._state, cpn)


STARTABLE = (READY, WOULD_BORROW)  # the reasons of a job that could start now (head-of-line blocking: ledger.hol)


def cached_limits(state: PoolState) -> tuple[dict, list]:
    """(team_limits, [(team, lending limit)] of the teams with one), kept until grants or bursts change."""
    cached = state.limits_cache
    if cached is not None and cached[0] == state.quota_epoch:
        return cached[1], cached[2]
    limits = team_limits(state)
    lenders = [(n, v[1]) for n, v in limits.items() if v[1] is not None]
    state.limits_cache = (state.quota_epoch, limits, lenders)
    return limits, lenders


def hol_context(state: PoolState) -> _Context:
    limits, lenders = cached_limits(state)
    return _Context(state, limits, lenders)


def startable_milli(state: PoolState, tm: Team, ctx: _Context) -> int:
    """The most chips a pending job of team `tm` (no decision in flight for it) could start with now, whole
    nodes aside: a job of at most this many chips could start. Within its unused quota it needs free chips; beyond
    it, room under its borrowing limit and free chips other teams do not guard. (The two ranges meet: when the
    second reaches beyond the unused quota, the free chips cover all of the first.)"""
    free = ctx.free
    unused = unused_quota(state, tm)
    beyond = free - (ctx.guarded_total - ctx.guarded.get(tm.name, 0)) if ctx.guarded_total else free
    lim = ctx.limits.get(tm.name)
    blim = None if lim is None else lim[0]
    if blim is not None:
        over = tm.use_milli - tm.nominal_milli  # borrowed_of, written out: the team's ordinary borrowing now
        borrowed = (over - (over if over < tm.burst_milli else tm.burst_milli)) if over > 0 else 0
        room = blim - borrowed + (unused if unused > 0 else 0)
        if room < beyond:
            beyond = room
    if beyond > unused:
        return beyond
    return unused if unused < free else free


def could_start(state: PoolState, job: Job, ctx: _Context) -> bool:
    """Whether the pending job could start now: `pending_reason` is one of STARTABLE (the same tests without the
    sentences; check_invariants asserts that both agree)."""
    if job.job_id in state.inflight:
        return False
    if job.chips_milli > startable_milli(state, state.teams[job.team], ctx):
        return False
    return _on_whole_nodes(job, ctx)


def pending_reason(state: PoolState, job: Job, t: int, config, ctx: Optional[_Context] = None) -> tuple[str, str]:
    """The current reason a pending job waits, as (code, sentence)."""
    if ctx is None:
        ctx = _Context(state, team_limits(state))
    tm = state.teams[job.team]
    chips = job.chips_milli
    free = ctx.free
    fl = state.inflight.get(job.job_id)
    if fl is not None and fl[4] <= t:
        return PREEMPTION_IN_FLIGHT, (f"decision {fl[0]} ({fl[1]}) was not acted on and timed out at "
                                      f"{_utc(fl[4])} UTC; the "
                                      f"decision is made anew at the pool's next event")
    if fl is not None:
        return PREEMPTION_IN_FLIGHT, (f"decision {fl[0]} ({fl[1]}) asked the cluster at {_utc(fl[2])} "
                                      f"UTC to make room for it; {len(fl[3])} of its victims not preempted yet")
    unused = unused_quota(state, tm)
    # chips promised to decisions in flight are counted as the rules count them, and said
    promised = f" ({_chips(ctx.promised)} more promised to decisions in flight)" if ctx.promised else ""
    if chips <= unused:
        if chips <= free:
            if not _on_whole_nodes(job, ctx):
                return NOT_ON_WHOLE_NODES, (f"fits its quota and {_chips(free)} chips are free, but not "
                                            f"{job.chips_per_node} per node on enough whole nodes")
            return READY, (f"fits its team's unused quota ({_chips(unused)} chips) and {_chips(free)} chips are "
                           f"free: waiting for the cluster to start it")
        since = state.short_since.get(job.job_id)
        if since is not None and t < since + config.preemption_grace_s:
            return WAITING_GRACE, (f"fits its team's unused quota but only {_chips(free)} of {_chips(chips)} chips "
                                   f"are free{promised}; waiting out the preemption grace until "
                                   f"{_utc(since + config.preemption_grace_s)} UTC")
        return WAITING_FOR_CHIPS, (f"fits its team's unused quota but only {_chips(free)} of {_chips(chips)} chips "
                                   f"are free{promised} and no borrowed job can be preempted now (none borrowing, "
                                   f"or all protected)")
    borrow = chips - max(unused, 0)
    blim = ctx.limits.get(job.team, (None, None))[0]
    borrowed, _ = borrowed_of(tm)
    if blim is not None and borrowed + borrow > blim:
        return OVER_BORROWING_LIMIT, (f"would borrow {_chips(borrow)} chips but team {job.team} already borrows "
                                      f"{_chips(borrowed)} of its limit {_chips(blim)}")
    avail = free - (ctx.guarded_total - ctx.guarded.get(job.team, 0))
    if chips > avail:
        return NOTHING_TO_LEND, (f"would borrow {_chips(borrow)} chips but only {_chips(max(avail, 0))} chips are "
                                 f"free to lend (free {_chips(free)}{promised}, less other teams' unlent quota)")
    if not _on_whole_nodes(job, ctx):
        return NOT_ON_WHOLE_NODES, (f"would borrow {_chips(borrow)} chips and {_chips(free)} are free, but not "
                                    f"{job.chips_per_node} per node on enough whole nodes")
    return WOULD_BORROW, (f"would borrow {_chips(borrow)} chips beyond its quota; they are free: waiting for the "
                          f"cluster to start it")


# ---------------------------------------------------------------------------------------------------------
# preemption
# ---------------------------------------------------------------------------------------------------------

def lost_work_mchip_s(job: Job, t: int) -> int:
    """Work since the job's last checkpoint (or start), what a preemption now would throw away."""
    return job.run_alloc_mchip_s + job.charged_milli * (t - job.since) - job.alloc_at_safe_mchip_s


def protected_until(job: Job, t: int, config) -> int:
    """The instant a running job may be chosen as a victim: t or earlier when it may now, NEVER when it may
    not at all (non-preemptible). Protections: min_runtime_s since it started, and at most max_preemptions
    within preemption_window_s (it may be chosen again when the oldest counted preemption leaves the window)."""
    if not job.preemptible:
        return NEVER
    until = job.run_started_at + config.min_runtime_s
    recent = job.preempted_at
    if len(recent) >= config.max_preemptions:
        oldest = recent[-config.max_preemptions]
        until = max(until, oldest + config.preemption_window_s)
    return until


def promised_free(state: PoolState, free: int) -> int:
    """The free chips held for beneficiaries of decisions in flight (at most `free`): a beneficiary still
    pending takes its chips from its victims not yet gone and, for the rest, from the free chips (its
    decision's need was its chips less the free chips then)."""
    jobs = state.jobs
    held = 0
    for ben_id, fl in state.inflight.items():
        ben = jobs.get(ben_id)
        if ben is None or ben.status != "pending":
            continue
        rest = ben.chips_milli
        for vid in fl[3]:
            v = jobs.get(vid)
            if v is not None and v.status == "running":
                rest -= v.chips_milli
        if rest > 0:
            held += rest
    return held if held < free else free


def unpromised_free(state: PoolState) -> tuple[int, int]:
    """(free chips a pending job may count on, free chips promised to decisions in flight): the free chips less
    those their beneficiaries will take."""
    free = free_milli(state)
    held = promised_free(state, free) if state.inflight and free else 0
    return free - held, held


def unused_quota(state: PoolState, team: Team) -> int:
    """The team's unused quota a pending job of it may count on: less what its beneficiaries of decisions in
    flight will take."""
    unused = team.nominal_milli - team.use_milli
    if state.inflight:
        unused -= promised_quota(state, team.name)
    return unused


def promised_quota(state: PoolState, team_name: str) -> int:
    """The team's quota promised to its jobs that decisions in flight make room for (not unused for another
    of its jobs)."""
    jobs = state.jobs
    held = 0
    for b in state.inflight:
        bj = jobs.get(b)
        if bj is not None and bj.team == team_name:
            held += bj.chips_milli
    return held


def queue_key(job: Job):
    """Order of a team's queue: highest priority, then longest waiting, then job id."""
    return (-job.priority, job.waiting_since, job.job_id)


def _queue_head(queue: dict, k: int) -> list:
    """The first k jobs of a team's queue in queue order (`heapq.nsmallest(k, ...)`; a sort is faster on
    queues of tens of jobs, and keys are unique, so both give the same list)."""
    return sorted(queue.values(), key=queue_key)[:k]


def evaluate(state: PoolState, trigger_id: str, t: int, step, config, only=None) -> None:
    """Look for pending jobs that a rule entitles to chips held by others, and emit decisions.

    Without `only`, the head of every team's queue is looked at (after a change of capacity, quota or bursts,
    and at each tick). With `only` (job ids), just those jobs, if they head their team's queue: a job that just
    joined a queue (the only new demand), or jobs whose wake-up instant (grace end, a decision timing out, a
    victim's protection ending) has come. Each job looked at leaves a wake-up instant in `state.wakes` when
    time alone can change its case; `state.policy_due` is the earliest."""
    inflight = state.inflight
    wakes = state.wakes
    if inflight and t >= state.inflight_next:
        for ben in [b for b, fl in inflight.items() if fl[4] <= t]:
            fl = inflight[ben]
            if fl[5]:
                state.ignored.pop(ben, None)
            else:  # nothing was done for it: the next decision for this job waits twice as long (up to 16x)
                state.ignored[ben] = state.ignored.get(ben, 0) + 1
            _drop_inflight(state, ben)
        state.inflight_next = min((fl[4] for fl in inflight.values()), default=NEVER)
    # free chips that decisions in flight count on for their beneficiaries are not free for another job: two
    # decisions never count the same free chips (as two jobs never claim the same unused quota)
    free, held = unpromised_free(state)
    limits, lenders = cached_limits(state)
    k = state.heads_k = config.candidates_per_team
    if only is None:
        work: list = []
        for team_name in sorted(state.waiting):
            queue = state.waiting[team_name]
            if queue:
                heads = state.heads.get(team_name)
                if heads is None:
                    heads = state.heads[team_name] = _queue_head(queue, k)
                work.extend(heads)
    else:
        work = []
        for jid in sorted(only):
            job = state.jobs.get(jid)
            if job is None or job.status != "pending":
                wakes.pop(jid, None)
                continue
            heads = state.heads.get(job.team)
            if heads is None:
                heads = state.heads[job.team] = _queue_head(state.waiting[job.team], k)
            for h in heads:
                if h is job:  # identity: Job's dataclass __eq__ compares every field
                    work.append(job)
                    break
            else:
                wakes.pop(jid, None)  # no longer a head: looked at again when it is one
                state.short_since.pop(jid, None)
    fs = None
    guarded = None
    seen = set()
    for job in work:
        jid = job.job_id
        seen.add(jid)
        wakes.pop(jid, None)
        fl = inflight.get(jid)
        if fl is not None:  # still short: a re-issue after a timeout needs no new grace
            wakes[jid] = fl[4]
            continue
        team_name = job.team
        tm = state.teams[team_name]
        chips = job.chips_milli
        unused = unused_quota(state, tm)
        if chips <= unused:
            if chips <= free:
                state.short_since.pop(jid, None)
                continue  # it can start as it is
            rule = "reclaim"
            need = chips - free
        else:
            lim = limits.get(team_name)
            blim = None if lim is None else lim[0]
            borrow = chips - unused if unused > 0 else chips
            if guarded is None:  # only teams with a lending limit keep unused quota from others
                guarded = {}
                guarded_total = 0
                teams = state.teams
                for n, llim in lenders:  # guarded_milli, written out
                    lender = teams[n]
                    g = lender.nominal_milli - lender.use_milli - llim
                    g = g if g > 0 else 0
                    guarded[n] = g
                    guarded_total += g
            avail = free - (guarded_total - guarded.get(team_name, 0))
            if blim is None:
                need = chips - avail
                if need < 0:
                    need = 0
            else:  # borrowed_of, written out: the team's ordinary borrowing now
                over = tm.use_milli - tm.nominal_milli
                borrowed = (over - (over if over < tm.burst_milli else tm.burst_milli)) if over > 0 else 0
                need = max(chips - avail, borrowed + borrow - blim)
            if need <= 0:
                state.short_since.pop(jid, None)
                continue
            rule = "priority"
        since = state.short_since.setdefault(jid, t)
        if t < since + config.preemption_grace_s:
            wakes[jid] = since + config.preemption_grace_s
            continue
        if rule == "priority":
            below = 0
            prio = job.priority
            for p, c in state.prio_chips.get(team_name, _NONE).items():
                if p < prio:
                    below += c
            if below < need:
                continue  # even every lower-priority preemptible job of the team would not be enough
        # a job found without victims is looked at again only when what could give it some changed:
        # jobs started or stopped (its team's, or any team's for a reclaim), quota, bursts, chips,
        # decisions in flight, or a victim's protection ended (its wake)
        sig = (rule, need, state.other_epoch,
               state.run_epoch if rule == "reclaim" else state.team_epoch.get(team_name, 0))
        memo = state.blocked.get(jid)
        if memo is not None and memo[0] == sig and t < memo[1]:
            if memo[1] < NEVER:
                wakes[jid] = memo[1]
            continue
        if fs is None:
            fs = fair_shares(state, t, config.decay_half_life_s)
        if rule == "reclaim":
            chosen, wake, plan = _reclaim_victims(state, job, need, t, fs, config)
        else:
            chosen, wake, plan = _priority_victims(state, job, need, t, fs, config)
        if not chosen:
            state.blocked[jid] = (sig, wake)
            if wake < NEVER:
                wakes[jid] = wake
            continue
        state.blocked.pop(jid, None)
        wakes[jid] = _emit(state, trigger_id, rule, job, chosen, need, free, held, t, fs, plan, step, config)
        rest = chips - sum(c[1].chips_milli for c in chosen)  # what the beneficiary takes from the free chips
        if rest > 0:
            rest = rest if rest < free else free
            free -= rest
            held += rest
    if only is None:  # jobs no longer at a queue's head are not waited for
        for jid in [j for j in state.short_since if j not in seen]:
            del state.short_since[jid]
        for jid in [j for j in wakes if j not in seen]:
            del wakes[jid]
    if only is None or state.policy_due <= t or len(wakes) < 64:
        state.policy_due = min(wakes.values()) if wakes else NEVER
    else:  # the wakes looked at were all due (<= t) or new; the others' minimum is still policy_due
        state.policy_due = min(state.policy_due, *(wakes[j] for j in seen if j in wakes))


def victim_classes(teams, fs, tolerance: float) -> list[list[str]]:
    """The victim classes of the goodput order: teams by lowest F first (then name); a class starts at its
    lowest-F team and holds every next team whose F is less than `tolerance` above that one (DESIGN §4:
    F is an estimate, so teams this close count as equal). Tolerance 0: one class per distinct F."""
    ordered = sorted(teams, key=lambda n: (fs[n][1], n))
    out: list[list[str]] = []
    anchor = 0.0
    for name in ordered:
        f = fs[name][1]
        if out and (f == anchor or f - anchor < tolerance):
            out[-1].append(name)
        else:
            out.append([name])
            anchor = f
    return out


class _Candidates:
    """Running jobs of some teams that may be preempted now, as groups in victim order (built lazily), and the
    earliest instant a protected one becomes eligible (`wake`, complete once every group was built).

    A candidate is (key, job, lost work, cost): cost = lost work + the victim's chips × restart_cost_s, what
    the victim choice weighs; key orders a group by lowest priority, then least cost, then most recently
    started, then job id (the naive order: lowest priority, most recently started)."""

    def __init__(self, state: PoolState, teams, t: int, fs, config, pred=None, ben_id: str = ""):
        self.state, self.t, self.fs, self.config, self.pred = state, t, fs, config, pred
        self.ben_id = ben_id  # a job that displaced this beneficiary recently is protected from it (Job.displaced)
        self.wake = NEVER
        if config.victim_order == "naive":
            self.plan = [list(teams)]
        else:  # victim classes: teams whose F differ by less than the tolerance, lowest F first
            self.plan = victim_classes(teams, fs, config.fair_share_tolerance)

    def __iter__(self) -> Iterator[list]:
        """Per victim class, per priority (lowest first): the candidates, sorted by key. Built lazily: a class
        may hold thousands of running jobs, and the lowest priority usually covers the need."""
        # protected_until, lost_work_mchip_s and the order key written out: this loop runs over every running
        # job of the candidate teams for each decision
        state, t, config, pred, ben_id = self.state, self.t, self.config, self.pred, self.ben_id
        naive = config.victim_order == "naive"
        min_runtime = config.min_runtime_s
        max_pre = config.max_preemptions
        window = config.preemption_window_s
        restart = config.restart_cost_s
        marked = state.marked
        running = state.running_jobs
        prio_chips = state.prio_chips
        job: Job  # typed: the compiled core reads a candidate's fields natively (they come out of untyped dicts)
        for names in self.plan:
            prios: set[int] = set()  # the priorities of the class's preemptible running jobs (the fold keeps them per team)
            for name in names:
                prios.update(prio_chips.get(name, _NONE))
            for prio in sorted(prios):
                out: list = []
                for name in names:
                    for job in running.get(name, _NONE).values():
                        if job.priority != prio or not job.preemptible or job.job_id in marked or (
                                pred is not None and not pred(job)):
                            continue  # a non-preemptible job is protected for ever: no wake for it
                        until = job.run_started_at + min_runtime
                        recent = job.preempted_at
                        if len(recent) >= max_pre:
                            w = recent[-max_pre] + window
                            if w > until:
                                until = w
                        displaced = job.displaced
                        if displaced and ben_id in displaced and displaced[ben_id] > until:
                            until = displaced[ben_id]  # it was given the chips taken from the beneficiary
                        if until > t:
                            if until < self.wake:
                                self.wake = until
                            continue
                        lost = job.run_alloc_mchip_s + job.charged_milli * (t - job.since) - job.alloc_at_safe_mchip_s
                        cost = lost + job.chips_milli * restart
                        if naive:
                            out.append(((prio, -job.run_started_at, job.job_id), job, lost, cost))
                        else:
                            out.append(((prio, cost, -job.run_started_at, job.job_id), job, lost, cost))
                if out:
                    out.sort(key=_first)
                    yield out


_NONE: dict = {}
EXACT_CELLS = 20_000  # the exact least-cost set is searched when candidates × needed units stay below this


def _first(c):
    return c[0]


def _least_cost_set(level: list, need: int, left: dict) -> Optional[list]:
    """The set of candidates of `level` (one priority within a victim class) that frees at least `need` with
    the least total cost (lost work + restart cost): a knapsack over chips in units of their greatest common
    divisor, exact. None when that is not cheap (too many cells), when `level` cannot free `need`, or when
    the set takes more from a team than its room allows (a team gives while it still has room: all of its
    victims but the largest fit in its room), so that the caller falls back to greedy-then-drop."""
    from math import gcd

    g = 0
    total = 0
    for c in level:
        g = gcd(g, c[1].chips_milli)
        total += c[1].chips_milli
    if total < need or g <= 0:
        return None
    units = -(-need // g)
    # a least-cost cover never holds more than ceil(units / w) candidates of size w (one fewer would still
    # cover): only the cheapest that many of each size can be in it (level is in key order: cost first)
    kept: dict[int, int] = {}
    pruned = []
    for c in level:
        w = c[1].chips_milli // g
        k = kept.get(w, 0)
        if k < -(-units // w):
            kept[w] = k + 1
            pruned.append(c)
    level = pruned
    n = len(level)
    if n * (units + 1) > EXACT_CELLS:
        return None
    inf: int = NEVER
    # best[i][u]: least cost covering u units with candidates i.. (u capped at 0). Typed: the compiled core then
    # reads and adds the cells as machine integers (this loop runs n × (units + 1) times per search)
    best: list[list[int]] = [[inf] * (units + 1) for _ in range(n + 1)]
    took: list[list[bool]] = [[False] * (units + 1) for _ in range(n)]
    best[n][0] = 0
    job: Job
    row: list[int]
    nxt: list[int]
    tk: list[bool]
    for i in range(n - 1, -1, -1):
        job = level[i][1]
        wi: int = job.chips_milli // g
        cost: int = level[i][3]
        row, nxt, tk = best[i], best[i + 1], took[i]
        for u in range(units + 1):
            skip = nxt[u]
            r = u - wi
            take = nxt[r if r > 0 else 0]
            take = take + cost if take < inf else inf
            if take <= skip and take < inf:  # ties: take it, so the better-keyed candidate is preferred
                row[u] = take
                tk[u] = True
            else:
                row[u] = skip
    if best[0][units] >= inf:
        return None
    picked = []
    u = units
    for i in range(n):
        if u <= 0:
            break
        if not took[i][u]:
            continue
        picked.append(level[i])
        u -= level[i][1].chips_milli // g
        if u < 0:
            u = 0
    per_team: dict[str, list] = {}
    for c in picked:
        per_team.setdefault(c[1].team, []).append(c[1].chips_milli)
    for team, chips in per_team.items():
        if sum(chips) - max(chips) >= left.get(team, 0):
            return None
    return picked


def _select(groups, need: int, room: dict[str, int], exact: bool = True) -> list:
    """Victims in victim order: groups (victim classes) in order; within a group, priorities lowest first, each
    taken whole while it cannot cover what is still needed; at the priority that covers it, the set with the
    least cost (`_least_cost_set`, exact where cheap, else greedy in key order while the victim's team still has
    room). Then the victims no longer needed are dropped (the one losing the most work first), so that no
    victim could be spared: what is freed exceeds the need by less than the smallest victim.

    `groups` yields lists of candidates (key, job, lost, cost), each list sorted, the lists in victim order (a
    list is one priority of one victim class); later groups are not even built once enough is chosen.
    `exact` False (the naive order) is pure greedy."""
    chosen = []
    freed = 0
    left = dict(room)
    for group in groups:
        i = 0
        n = len(group)
        while i < n and freed < need:
            if exact:
                p = group[i][1].priority
                j = i
                while j < n and group[j][1].priority == p:
                    j += 1
                level = [c for c in group[i:j] if left.get(c[1].team, 0) > 0]
                i = j
                pick = _least_cost_set(level, need - freed, left) if level else None
                if pick is not None:
                    for c in pick:
                        chosen.append(c)
                        freed += c[1].chips_milli
                        left[c[1].team] -= c[1].chips_milli
                    break
            else:
                level = group[i:]
                i = n
            for c in level:
                job = c[1]
                if left.get(job.team, 0) <= 0:
                    continue
                chosen.append(c)
                freed += job.chips_milli
                left[job.team] -= job.chips_milli
                if freed >= need:
                    break
        if freed >= need:
            break
    if freed < need:
        return []
    w = 3 if exact else 2  # the naive order drops by lost work alone
    while True:  # drop the victims no longer needed, the costliest first (ties: latest chosen)
        drop = None
        for i, c in enumerate(chosen):
            if freed - c[1].chips_milli >= need and (drop is None or c[w] >= chosen[drop][w]):
                drop = i
        if drop is None:
            return chosen
        freed -= chosen[drop][1].chips_milli
        del chosen[drop]


def _reclaim_victims(state: PoolState, ben: Job, need: int, t: int, fs, config) -> tuple[list, int, list]:
    """Jobs of borrowing teams: ordinary borrowing first; burst reservations only if that is not enough.
    Returns (victims, wake, victim classes looked at)."""
    ordinary: dict[str, int] = {}
    with_burst: dict[str, int] = {}
    promised: dict[str, int] = {}  # chips of a team already named as victims in decisions in flight
    for vid in state.marked:
        v = state.jobs.get(vid)
        if v is not None:
            promised[v.team] = promised.get(v.team, 0) + v.chips_milli
    for name, tm in state.teams.items():
        if name == ben.team:
            continue
        b, u = borrowed_of(tm)
        b -= promised.get(name, 0)
        if b < 0:
            u += b
            b = 0
        if b > 0:
            ordinary[name] = b
        if b + u > 0:
            with_burst[name] = b + u
    if not with_burst:
        return [], NEVER, []
    exact = config.victim_order != "naive"
    chosen = []
    if ordinary:
        cands = _Candidates(state, sorted(ordinary), t, fs, config, ben_id=ben.job_id)
        chosen = _select(cands, need, ordinary, exact)
        if chosen:
            return chosen, NEVER, cands.plan
    cands = _Candidates(state, sorted(with_burst), t, fs, config, ben_id=ben.job_id)
    chosen = _select(cands, need, with_burst, exact)
    return chosen, (NEVER if chosen else cands.wake), cands.plan


def _priority_victims(state: PoolState, ben: Job, need: int, t: int, fs, config) -> tuple[list, int, list]:
    """Lower-priority jobs of the beneficiary's own team."""
    cands = _Candidates(state, [ben.team], t, fs, config, pred=lambda j: j.priority < ben.priority,
                        ben_id=ben.job_id)
    chosen = _select(cands, need, {ben.team: NEVER}, config.victim_order != "naive")
    return chosen, (NEVER if chosen else cands.wake), cands.plan


def _emit(state: PoolState, trigger_id: str, rule: str, ben: Job, chosen: list, need: int, free: int, held: int,
          t: int, fs, plan, step, config) -> int:
    decision_id = f"{trigger_id}:{rule}:{ben.job_id}"
    victims = []
    freed = 0
    restart = 0
    for _, job, lost, cost in chosen:
        freed += job.chips_milli
        restart += cost - lost
        # the decision's JSON is built directly (schemas.outputs.DecisionPreempt is its contract; the tests
        # read every decision back through it): this runs for every decision
        victims.append({"job_id": job.job_id, "team": job.team, "chips": job.chips_milli / MILLI,
                        "lost_work_chip_s": lost // MILLI,
                        "preemption_count": sum(1 for p in job.preempted_at if p > t - config.preemption_window_s)})
        state.marked[job.job_id] = ben.job_id
    # the victims may not take the chips back from this job for a preemption window (no cycle)
    displaced = {k: u for k, u in ben.displaced.items() if u > t} if ben.displaced else {}
    for v in victims:
        displaced[v["job_id"]] = t + config.preemption_window_s
    ben.displaced = displaced
    tm = state.teams[ben.team]
    numbers = {
        "need_chips": need / MILLI, "free_chips": free / MILLI, "freed_chips": freed / MILLI,
        "beneficiary_chips": ben.chips_milli / MILLI, "beneficiary_priority": float(ben.priority),
        "team_nominal_chips": tm.nominal_milli / MILLI, "team_used_chips": tm.use_milli / MILLI,
        "team_fair_share_factor": round(fs[ben.team][1], 6),
        "lost_work_chip_s": float(sum(v["lost_work_chip_s"] for v in victims)),
        "waited_s": float(t - ben.waiting_since),
    }
    if held:
        numbers["promised_chips"] = held / MILLI
    victim_teams = sorted({v["team"] for v in victims})
    # the victim classes the victims came from: teams in one class were treated as equal (F within the tolerance)
    equal: list[list[str]] = []
    if rule == "reclaim" and config.victim_order != "naive":
        tol = config.fair_share_tolerance
        numbers["fair_share_tolerance"] = tol if tol < 1e300 else 1e300
        numbers["restart_cost_chip_s"] = float(restart // MILLI)
        vt = set(victim_teams)
        for k, cls in enumerate(plan):
            if vt.intersection(cls):
                if len(cls) > 1:
                    equal.append(cls)
                for name in cls:
                    numbers[f"victim_class[{name}]"] = float(k)
    shown = sorted(set(victim_teams).union(*equal)) if equal else victim_teams
    for name in shown:
        b, u = borrowed_of(state.teams[name])
        numbers[f"fair_share_factor[{name}]"] = round(fs[name][1], 6)
        numbers[f"borrowed_chips[{name}]"] = b / MILLI
        if u:
            numbers[f"burst_chips[{name}]"] = u / MILLI
    lost = int(numbers["lost_work_chip_s"])
    promised = f", {_chips(held)} more promised to decisions in flight" if held else ""
    if rule == "reclaim":
        if equal:
            tol = config.fair_share_tolerance
            tol_s = f"{tol:g}" if tol < 1e300 else "infinite"
            eq = "; ".join(f"teams {', '.join(cls)} treated as equal (F " +
                           ", ".join(f"{fs[n][1]:.3f}" for n in cls) +
                           f" differ by less than fair_share_tolerance {tol_s}), victims with the least lost "
                           f"work taken from any of them" for cls in equal)
            eq = f"; {eq}"
        else:
            eq = ""
        message = (f"reclaim: job {ben.job_id} ({_chips(ben.chips_milli)} chips) fits team {ben.team}'s unused "
                   f"quota but only {_chips(free)} chips are free{promised}; preempt {len(victims)} job(s) of "
                   f"borrowing team(s) {', '.join(victim_teams)} to free {_chips(freed)} chips "
                   f"({_chips(need)} needed, {lost} chip-s of work lost){eq}; victims checkpoint by "
                   f"{_utc(t + config.checkpoint_grace_s)} UTC")
    else:
        message = (f"priority: job {ben.job_id} (priority {ben.priority}, {_chips(ben.chips_milli)} chips) of "
                   f"team {ben.team}, at its quota and unable to borrow, preempts {len(victims)} lower-priority "
                   f"job(s) of its team to free {_chips(freed)} chips ({_chips(need)} needed{promised}, {lost} "
                   f"chip-s of work lost); victims checkpoint by {_utc(t + config.checkpoint_grace_s)} UTC")
    expires = t + config.decision_timeout_s * 2 ** min(state.ignored.get(ben.job_id, 0), 4)
    state.inflight[ben.job_id] = [decision_id, rule, t, [v["job_id"] for v in victims], expires, False]
    state.inflight_next = min(state.inflight_next, expires)
    state.other_epoch += 1
    body = {"decision_id": decision_id, "type": "decision.preempt", "pool": state.pool, "at": _iso(t),
            "rule": rule, "beneficiary": {"job_id": ben.job_id, "team": ben.team}, "victims": victims,
            "checkpoint_by": _iso(t + config.checkpoint_grace_s), "numbers": numbers, "message": message}
    step.rows("decisions").append(DecisionRow(decision_id, "decision.preempt", state.pool, t, rule, message,
                                      orjson.dumps(body).decode()))
    count_decision(state, "preempt", rule, "")
    vc = state.victim_counts
    for v in victims:
        key = (v["team"], rule)
        acc = vc.get(key)
        if acc is None:
            acc = vc[key] = [0, 0]
        acc[0] += 1
        acc[1] += v["lost_work_chip_s"]
    return expires


def count_decision(state: PoolState, kind: str, rule: str, verdict: str) -> None:
    """A decision written: counted by (type, rule, verdict) in the pool's state (PoolState.decision_counts)."""
    key = (kind, rule, verdict)
    dc = state.decision_counts
    dc[key] = dc.get(key, 0) + 1


def _drop_inflight(state: PoolState, ben_id: str) -> None:
    fl = state.inflight.pop(ben_id, None)
    if fl is not None:
        state.other_epoch += 1
        for v in fl[3]:
            if state.marked.get(v) == ben_id:
                del state.marked[v]


def job_left_queue(state: PoolState, job_id: str) -> None:
    """The job started or finished: a decision made for it is settled; it no longer waits out a grace."""
    state.short_since.pop(job_id, None)
    state.blocked.pop(job_id, None)
    state.ignored.pop(job_id, None)
    if state.wakes.pop(job_id, None) is not None:
        state.policy_due = min(state.wakes.values()) if state.wakes else NEVER
    if job_id in state.inflight:
        _drop_inflight(state, job_id)


def victim_gone(state: PoolState, job_id: str) -> None:
    """A job marked as a victim was preempted or finished: it no longer holds the chips it was marked for."""
    ben = state.marked.pop(job_id, None)
    if ben is not None:
        state.other_epoch += 1
        fl = state.inflight.get(ben)
        if fl is not None and job_id in fl[3]:
            fl[3].remove(job_id)
            fl[5] = True  # something happened


# ---------------------------------------------------------------------------------------------------------
# bursts
# ---------------------------------------------------------------------------------------------------------

def budget_state(state: PoolState, target: float) -> tuple[float, float]:
    """(capacity error budget left as a fraction of the budget over the last 30 days, burn rate of the last
    closed hour). Budget = (1 - target) × registered chip-s; consumed = unavailable chip-s."""
    allowed = 1.0 - target
    reg = sum(h[0] for h in state.budget_hours)
    unav = sum(h[1] for h in state.budget_hours)
    if reg <= 0 or allowed <= 0:
        return 1.0, 0.0
    left = 1.0 - (unav / reg) / allowed
    last = state.budget_hours[-1]
    burn = (last[1] / last[0]) / allowed if last[0] else 0.0
    return left, burn


def forecast_demand_milli(state: PoolState, start: int, end: int) -> tuple[int, int]:
    """The peak of the hour-of-week demand profile over [start, end) (at most a week of hours is looked at),
    and how many of those hours had history; an hour with none uses the demand now (running + pending)."""
    now = state.charged_milli + sum(tm.pending_milli for tm in state.teams.values())
    peak = 0
    known = 0
    h = hour_of(start)
    for _ in range(HOURS_OF_WEEK):
        if h >= end:
            break
        s, n = state.profile[hour_of_week(h)]
        if n:
            known += 1
            d = s // n
        else:
            d = now
        peak = max(peak, d)
        h += HOUR_S
    return peak, known


class BurstInputs(NamedTuple):
    """What a burst verdict is computed from (docs/policy.md, "Bursts"): gathered from a PoolState by the fold
    (`burst_inputs`), or from the facts the fold wrote to the lake by the portal's dry run (chipledger/web/burst.py);
    both then call the one rule, `burst_verdict`."""
    available_milli: int          # chips available now (registered, healthy or degraded)
    guarded_others_milli: int     # other teams' unused quota they do not lend
    forecast_peak_milli: int      # the peak of the hour-of-week demand profile over the window
    forecast_hours_known: int     # hours of that window with history
    other_bursts_milli: int       # chips of other bursts reserved over the window
    fair_share_factor: float      # the team's F
    budget_left: float            # the capacity error budget left (fraction)
    budget_burn: float            # its burn rate over the last closed hour
    holds_reservation: bool       # the request id already holds a reservation


def burst_inputs(state: PoolState, team: str, request_id: str, window_start_s: int, window_end_s: int, t: int,
                 config) -> BurstInputs:
    """The inputs of a burst verdict, from the pool's state at t."""
    limits = team_limits(state)
    available = state.capacity_milli - state.unavailable_milli
    guarded_others = sum(guarded_milli(tm, limits.get(n, (None, None))[1])
                         for n, tm in state.teams.items() if n != team)
    start = max(window_start_s, t)
    peak, known = forecast_demand_milli(state, start, window_end_s)
    reserved = sum(b[1] for b in state.bursts.values() if b[2] < window_end_s and b[3] > start)
    fs = fair_shares(state, t, config.decay_half_life_s)
    f = fs[team][1] if team in fs else 1.0
    left, burn = budget_state(state, config.capacity_slo_target)
    return BurstInputs(available, guarded_others, peak, known, reserved, f, left, burn, request_id in state.bursts)


def burst_verdict(inp: BurstInputs, asked: int, window_end_s: int, t: int) -> tuple[str, int, dict, str]:
    """The burst rule, pure over its inputs: (verdict, chips granted in milli, the numbers it used, why)."""
    available, guarded_others, peak, known, reserved, f, left, burn, holds = inp
    idle = available - guarded_others - peak - reserved
    share = 1.0 if f >= 0.5 else 2.0 * f
    allowed = int(max(idle, 0) * share) // MILLI * MILLI  # whole chips
    numbers = {"requested_chips": asked / MILLI, "available_chips": available / MILLI,
               "others_guaranteed_chips": guarded_others / MILLI, "forecast_demand_chips": peak / MILLI,
               "forecast_hours_with_history": float(known), "other_bursts_chips": reserved / MILLI,
               "forecast_idle_chips": idle / MILLI, "fair_share_factor": round(f, 6),
               "fair_share_allowance": round(share, 6), "error_budget_left": round(left, 6),
               "error_budget_burn_rate": round(burn, 6)}
    if window_end_s <= t:
        granted, why = 0, "its window is already over"
    elif holds:
        granted, why = 0, "this request id already holds a reservation"
    elif left <= 0 or burn >= FAST_BURN:
        granted, why = 0, (f"the pool's capacity error budget is burning ({left:.0%} left, last hour at "
                           f"{burn:.1f}x)")
    else:
        granted = min(asked, allowed)
        why = (f"forecast idle {_chips(max(idle, 0))} chips in the window (available {_chips(available)}, less "
               f"{_chips(guarded_others)} others' unlent quota, {_chips(peak)} peak forecast demand, "
               f"{_chips(reserved)} other bursts), team F={f:.2f} allows {share:.0%} of it")
    verdict = "approved" if granted >= asked else ("partial" if granted > 0 else "denied")
    return verdict, granted, numbers, why


def decide_burst(state: PoolState, e, t: int, config) -> tuple[DecisionBurst, Optional[list]]:
    """Approve, cut or deny a burst request. Returns the decision and, when chips are granted, the
    reservation [team, chips_milli, window_start, window_end, active]."""
    ws, we = e.window_start, e.window_end
    ws_s = epoch_s(ws)
    we_s = epoch_s(we)
    asked = e.chips_milli
    team = e.team
    inp = burst_inputs(state, team, e.request_id, ws_s, we_s, t, config)
    verdict, granted, numbers, why = burst_verdict(inp, asked, we_s, t)
    message = f"burst {e.request_id} of team {team}: {verdict}, {_chips(granted)} of {_chips(asked)} chips: {why}"
    d = DecisionBurst(decision_id=f"{e.event_id}:burst:{e.request_id}", pool=state.pool, at=_ts(t),
                      request_id=e.request_id, team=team, verdict=verdict, chips_granted=granted / MILLI,
                      window_start=ws, window_end=we, rule="burst_forecast", numbers=numbers, message=message)
    return d, ([team, granted, ws_s, we_s, False] if granted > 0 else None)


def store_balances(state: PoolState) -> dict[str, dict]:
    """Per team, for the store: decayed usage and F as of the last close of an hour (the store is written
    without the fold's configuration, and those need no half-life), and the borrowed share now."""
    limits = team_limits(state)
    lendable = lendable_milli(state, limits)
    total_u = sum(tm.decayed_usage_mchip_s for tm in state.teams.values())
    total_n = sum(tm.nominal_milli for tm in state.teams.values())
    out = {}
    for name, tm in state.teams.items():
        u = tm.decayed_usage_mchip_s
        f = fair_share_factor(u, total_u, tm.nominal_milli, total_n)
        b, _ = borrowed_of(tm)
        out[name] = {"decayed_usage_mchip_s": u, "fair_share_factor": f,
                     "borrowed_share": (b / lendable) if lendable > 0 else 0.0}
    return out


def current_balances(state: PoolState, t: int, config) -> dict[str, dict]:
    """Per team: decayed usage, F and borrowed share at t (t at or after the last close of an hour)."""
    limits = team_limits(state)
    lendable = lendable_milli(state, limits)
    fs = fair_shares(state, t, config.decay_half_life_s)
    out = {}
    for name, tm in state.teams.items():
        b, _ = borrowed_of(tm)
        out[name] = {"decayed_usage_mchip_s": fs[name][0], "fair_share_factor": fs[name][1],
                     "borrowed_share": (b / lendable) if lendable > 0 else 0.0}
    return out

