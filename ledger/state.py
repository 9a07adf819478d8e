"""PoolState: everything the ledger knows about one pool, and nothing about its history.

Memory grows with the pool's chips, active jobs, grants and the dedup window, never with the number of
events folded: finished jobs are forgotten (their history lives in the event log and the lake).
`to_dict`/`from_dict` give a JSON-ready form, for Faust tables and for carrying a fold over between runs.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from zlib import adler32, crc32

from mypy_extensions import mypyc_attr

from ledger.books import HOUR_S, Books

AVAILABLE_STATES = frozenset({"healthy", "degraded"})  # down and maintenance chips are unavailable


def _read_only(*args, **kwargs):
    raise TypeError("a Step's empty output list is shared and read-only")


@mypyc_attr(native_class=False)
class _NoRows(list):
    """The output list of a `Step` that put out nothing: one shared, empty, read-only list (equal to []), so that
    a step costs no list until it has a row. The fold gives a step its own list before adding rows."""

    __slots__ = ()

    # a module-level function, one assignment a line: the compiled core (mypyc) takes neither a method's name
    # nor a chained assignment in a class body
    append = _read_only
    extend = _read_only
    insert = _read_only
    pop = _read_only
    remove = _read_only
    clear = _read_only
    sort = _read_only
    reverse = _read_only
    __setitem__ = _read_only
    __delitem__ = _read_only
    __iadd__ = _read_only
    __imul__ = _read_only


NO_ROWS = _NoRows()


def fingerprint(body: Any) -> int:  # any bytes-like value (bytes, bytearray, memoryview)
    """A stable 64-bit digest of a message body (the same on every process and replay): duplicates with the
    same event id are identical when their digests are."""
    return crc32(body) << 32 | adler32(body)


def digest_of(body: Any) -> int:
    """What the dedup window compares: a body's digest, or the digest itself when the window already holds it
    (it keeps an accepted event's raw bytes and digests them only when needed)."""
    return body if body.__class__ is int else fingerprint(body)


class Chip:
    """One chip: its node, its state and the jobs placed on it (job_id -> milli-chips of this chip)."""

    __slots__ = ("node", "state", "jobs", "available")

    def __init__(self, node: str, state: str = "healthy", jobs: Optional[dict[str, int]] = None):
        self.node = node
        self.jobs: dict[str, int] = {} if jobs is None else jobs
        self.set_state(state)

    def set_state(self, state: str) -> None:
        self.state = state
        self.available = state in AVAILABLE_STATES  # kept as a field: it is read for every placed share

    def __eq__(self, other) -> bool:
        return isinstance(other, Chip) and (self.node, self.state, self.jobs) == (other.node, other.state, other.jobs)

    def __repr__(self) -> str:
        return f"Chip(node={self.node!r}, state={self.state!r}, jobs={self.jobs!r})"


@dataclass(slots=True)
class Grant:
    grant_id: str
    team: str
    chips_milli: int
    borrowing_limit_milli: Optional[int]
    lending_limit_milli: Optional[int]
    effective_from: Optional[int]
    effective_until: Optional[int]
    version: int  # unique in the pool, new at every grant or re-grant, so stale boundaries are ignored
    active: bool = False


@dataclass(slots=True)
class Team:
    name: str
    nominal_milli: int = 0  # sum of the team's grants in effect
    use_milli: int = 0      # milli-chips charged now: its running jobs on available chips
    burst_milli: int = 0    # approved burst reservations active now
    running: int = 0
    pending: int = 0
    pending_milli: int = 0  # chips of its pending jobs (demand waiting), milli-chips
    # fair share (ledger.policy): decayed usage as of the last close of an hour, and the team's used total
    # (in_quota + borrowed + burst postings) and demand total (used + pending) at that close
    decayed_usage_mchip_s: int = 0
    usage_mark_mchip_s: int = 0
    demand_mark_mchip_s: int = 0


@dataclass(slots=True)
class Job:
    job_id: str
    team: str
    chips_milli: int
    priority: int
    preemptible: bool
    chips_per_node: Optional[int]
    submitted_at: int
    status: str = "pending"  # pending | running | held (not eligible yet: no demand, no wait); finished jobs leave
    first_started_at: Optional[int] = None
    run_index: int = 0        # how many times it has started
    run_started_at: int = 0   # start of the current (or last) run
    last_safe_at: int = 0     # last checkpoint, or the start of this run
    preemptions: int = 0
    placement: Optional[dict[str, int]] = None  # chip_id -> milli-chips, when the cluster said where
    charged_milli: int = 0    # what the team is charged now (shares on unavailable chips are not charged)
    since: int = 0            # instant the current charge applies from
    run_alloc_mchip_s: int = 0  # allocated in this run up to `since`
    run_posted_mchip_s: int = 0  # of which already posted to job_runs by a close of the books
    alloc_at_safe_mchip_s: int = 0  # run allocation at the last checkpoint (work up to there is safe)
    waiting_since: int = 0    # when it last became pending (submission or preemption)
    preempted_at: list = field(default_factory=list)  # instants of its last preemptions (anti-thrash), oldest first
    # the current wait (fact `waits`): its team's nominal quota and use when it began
    wait_nominal_milli: int = 0
    wait_used_milli: int = 0
    # head-of-line blocking of the current wait: seconds it could have started and did not (up to hol_from), the
    # instant it has been able to since (-1: it cannot now), the waiting jobs ahead of it that cannot start (at
    # most 3, in queue order) and the seconds each was ahead of it while it could have started
    hol_s: int = 0
    hol_from: int = -1
    hol_ahead: list = field(default_factory=list)
    hol_blockers: dict = field(default_factory=dict)
    progress: Optional["Progress"] = None  # its progress reports (throughput), from its first one on
    # jobs preempted for this one (it was their decision's beneficiary) -> until when this job is protected from
    # being preempted for them (decision time + preemption_window_s): a decision never undoes the one before it
    # (no cycle: A taken from for B, then B for A). Saved apart from the job's list (PoolState.to_dict
    # "displaced"), so states saved before it still load
    displaced: dict = field(default_factory=dict)


@dataclass(slots=True)
class Progress:
    """What the fold keeps of a job's progress reports (fact `progress`, ledger.fold): the unit's name, the count
    last reported and the run it was reported in, the start of the open interval (instant, count, the run's
    allocation then), the count at the last checkpoint (a restart continues from it), the reference rate (units
    per chip-second; -1: not known yet) with the healthy stretch gathered for it (rates, seconds), and the chips
    held that were not healthy at some instant of the open interval (chip id -> worst state)."""

    unit: str = ""
    run: int = 0
    units: int = 0
    at: int = 0
    units_from: int = 0
    alloc_mchip_s: int = 0
    safe: int = 0
    ref_rate: float = -1.0
    ref_rates: list = field(default_factory=list)
    ref_s: int = 0
    unhealthy: dict = field(default_factory=dict)


@dataclass(slots=True)
class PoolState:
    pool: str
    flavor: str
    chips_per_node: int
    clock: int
    books: Books
    chips: dict[str, Chip] = field(default_factory=dict)
    jobs: dict[str, Job] = field(default_factory=dict)
    grants: dict[str, Grant] = field(default_factory=dict)
    teams: dict[str, Team] = field(default_factory=dict)
    boundaries: list = field(default_factory=list)  # heap of (instant, seq, kind, id, version)
    seq: int = 0
    capacity_milli: int = 0
    unavailable_milli: int = 0
    charged_milli: int = 0  # sum of team use
    # dedup window: event_id -> (fingerprint, event time); order of arrival for expiry
    dedup: dict[str, tuple[Any, int]] = field(default_factory=dict)
    dedup_order: deque = field(default_factory=deque)
    # counters
    applied: int = 0
    duplicates: int = 0
    rejected: int = 0
    late_events: int = 0
    max_lateness_s: int = 0
    # last offset handled per input topic-partition ("topic:partition" -> offset), set by the stream edge: a
    # record at or below it was folded into this state already and is skipped after a restart
    positions: dict[str, int] = field(default_factory=dict)
    # --- policy (ledger.policy) ---
    # approved burst reservations: request_id -> [team, chips_milli, window_start, window_end, active]
    bursts: dict = field(default_factory=dict)
    # preemption decisions in flight, per beneficiary job:
    # [decision_id, rule, issued_at, [victim job ids not yet gone], expires_at, acted on]
    inflight: dict = field(default_factory=dict)
    ignored: dict = field(default_factory=dict)  # beneficiary -> its decisions in a row that timed out unacted
    marked: dict = field(default_factory=dict)       # victim job id -> beneficiary job id (in flight)
    short_since: dict = field(default_factory=dict)  # pending job -> instant it was first seen short of chips
    wakes: dict = field(default_factory=dict)  # pending job -> instant to look at it again (grace end, timeout…)
    policy_due: int = 1 << 62  # the earliest of `wakes`
    policy_full: bool = False  # a grant or burst boundary passed: look at every queue at the next event
    # hour-of-week demand profile (Monday 00 UTC = 0): [sum of hourly mean demand milli-chips, hours seen]
    profile: list = field(default_factory=lambda: [[0, 0] for _ in range(168)])
    # capacity error budget: the last 720 closed hours as [registered mchip-s, unavailable mchip-s]
    budget_hours: deque = field(default_factory=deque)
    pool_marks: list = field(default_factory=lambda: [0, 0])  # capacity, unavailable totals at the last close
    # indexes (derived, not serialized): active jobs per team by status, and pending job sizes
    waiting: dict = field(default_factory=dict)       # team -> {job_id: Job} pending
    running_jobs: dict = field(default_factory=dict)  # team -> {job_id: Job} running
    pending_sizes: dict = field(default_factory=dict)  # chips_milli -> pending jobs of that size
    heads: dict = field(default_factory=dict)         # team -> cached queue head (cleared when its queue changes)
    # change counters and the memo of pending jobs found without victims (ledger.policy.evaluate); derived:
    # after a restore they start afresh, which only means one more look
    run_epoch: int = 0     # any job started or stopped, any chip's availability changed
    team_epoch: dict = field(default_factory=dict)  # team -> its jobs started or stopped
    other_epoch: int = 0   # quota, bursts or decisions in flight changed
    quota_epoch: int = 0   # grants or bursts changed (the cached team limits are stale)
    blocked: dict = field(default_factory=dict)     # job id -> (signature, wake)
    prio_chips: dict = field(default_factory=dict)  # team -> {priority: chips of its preemptible running jobs}
    heads_k: int = 0  # how many jobs the cached queue heads hold (FoldConfig.candidates_per_team)
    inflight_next: int = 0  # earliest timeout of a decision in flight (0: not known, look)
    down: set = field(default_factory=set)  # ids of the chips not available (derived from `chips`)
    # the pool clock's next stop, min(end of the open hour, first grant or burst boundary): an event before it
    # needs no advance of the clock (derived, kept by the fold and push_boundary)
    until: int = 0
    active_milli: int = 0  # chips of the pool's jobs, pending or running (bounded: schemas.events.MAX_POOL_MILLI)
    held_milli: int = 0    # chips of the grants it holds, in effect or to come (bounded likewise)
    limits_cache: Optional[tuple] = None  # (quota_epoch, team_limits, teams with a lending limit) of the last evaluation
    # --- facts (free_chips) ---
    # the free_chips row of the current second not posted yet (posted at the first event of a later second, or at
    # a close of the books: at most one row per pool per second, the last), and the values of the last row posted
    fc_row: Optional[tuple] = None
    fc_posted: Optional[tuple] = None
    fc_due: int = 1 << 62  # fc_row's second + 1 (never while there is none)
    # derived from `chips` and `jobs` (rebuilt by reindex): per node [chips registered, chips free (available,
    # nothing placed)], how many nodes have each count of free chips, the chips of wholly free nodes, and the
    # running jobs without a placement (while there are any, which chips are free is not known)
    nodes: dict = field(default_factory=dict)
    node_free_counts: dict = field(default_factory=dict)
    whole_free_milli: int = 0
    unplaced_runs: int = 0
    queue_changes: int = 0  # jobs joined or left a queue (derived; with run_epoch and other_epoch: when to look again)
    hol_sig: Optional[tuple] = None  # those counters at the last look at head-of-line blocking (derived)
    hol_any: bool = True  # some pending job could start at the last look (derived: after a restore, look)
    # the head-of-line index (ledger.fold._hol; derived, built at the first look, None until then and after a
    # restore): pending jobs per (team, chips per node) sorted by (chips, job id), every pending job's queue key
    # sorted, the most chips each group could start with at the last look, the jobs that could start then, the
    # jobs queued since, the decisions in flight then and the first three jobs that could not start then
    hol_groups: Optional[dict] = None
    hol_order: list = field(default_factory=list)
    hol_max: dict = field(default_factory=dict)
    hol_able: dict = field(default_factory=dict)
    hol_new: dict = field(default_factory=dict)
    hol_inflight: set = field(default_factory=set)
    hol_first: Optional[list] = None
    # --- monotonic counters (DESIGN §4 "Facts": good and total events per SLO, what Prometheus rates; /metrics
    # reads them at a scrape, streams/metrics.py). Updated where the fold writes the rows they count, never reset,
    # carried by to_dict/from_dict: a restarted worker continues them. Integers; milli-chip-seconds.
    # team -> [waits ended that fitted its unused quota, of which started within sched_slo_s, waits ended in a
    # start, of which within sched_slo_s] (from the `waits` rows the fold posts as a wait ends)
    wait_counts: dict = field(default_factory=dict)
    # team -> [allocated, lost] mchip-s of the runs that ended (a run's whole allocation, its `job_runs` rows)
    run_counts: dict = field(default_factory=dict)
    # team -> [charged mchip-s of the judged `progress` intervals, of which not slow]
    progress_counts: dict = field(default_factory=dict)
    # (type without "decision.", rule, verdict or "") -> decisions written
    decision_counts: dict = field(default_factory=dict)
    # (victim's team, rule) -> [victims named by preemption decisions, their lost work in chip-seconds]
    victim_counts: dict = field(default_factory=dict)
    # rejection code -> events of this pool the fold rejected (dead letters; those made before a pool is known,
    # or by the stream edge, are counted where they are made)
    rejection_counts: dict = field(default_factory=dict)

    def __post_init__(self):
        self.reset_until()

    def team(self, name: str) -> Team:
        t = self.teams.get(name)
        if t is None:
            t = self.teams[name] = Team(name)
        return t

    def push_boundary(self, instant: int, kind: str, ident: str, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.boundaries, (instant, self.seq, kind, ident, version))
        if instant < self.until:
            self.until = instant

    def reset_until(self) -> None:
        hour_end = self.books.open_hour + HOUR_S
        b = self.boundaries
        self.until = hour_end if not b or b[0][0] >= hour_end else b[0][0]

    # --- serialization -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        self.books.settle_idle(self.clock)
        return {
            "pool": self.pool, "flavor": self.flavor, "chips_per_node": self.chips_per_node,
            "clock": self.clock, "books": self.books.to_dict(),
            "chips": {k: [c.node, c.state, dict(c.jobs)] for k, c in self.chips.items()},
            "jobs": {k: _job_list(j) for k, j in self.jobs.items()},
            "displaced": {k: dict(j.displaced) for k, j in self.jobs.items() if j.displaced},
            "grants": {k: _slots_list(g) for k, g in self.grants.items()},
            "teams": {k: _slots_list(t) for k, t in self.teams.items()},
            "boundaries": [list(b) for b in self.boundaries], "seq": self.seq,
            "capacity_milli": self.capacity_milli, "unavailable_milli": self.unavailable_milli,
            "charged_milli": self.charged_milli,
            "dedup": self._dedup_list(),
            "applied": self.applied, "duplicates": self.duplicates, "rejected": self.rejected,
            "late_events": self.late_events, "max_lateness_s": self.max_lateness_s,
            "positions": dict(self.positions),
            "bursts": {k: list(v) for k, v in self.bursts.items()},
            "inflight": {k: [v[0], v[1], v[2], list(v[3]), v[4], v[5]] for k, v in self.inflight.items()},
            "ignored": dict(self.ignored),
            "marked": dict(self.marked), "short_since": dict(self.short_since), "policy_due": self.policy_due,
            "wakes": dict(self.wakes), "policy_full": self.policy_full,
            "profile": [list(p) for p in self.profile], "budget_hours": [list(h) for h in self.budget_hours],
            "pool_marks": list(self.pool_marks),
            "fc_row": None if self.fc_row is None else list(self.fc_row),
            "fc_posted": None if self.fc_posted is None else list(self.fc_posted),
            "counters": self.counters_dict(),
        }

    def counters_dict(self) -> dict:
        """The monotonic counters, JSON-ready (tuple keys as lists)."""
        return {
            "waits": {k: list(v) for k, v in self.wait_counts.items()},
            "runs": {k: list(v) for k, v in self.run_counts.items()},
            "progress": {k: list(v) for k, v in self.progress_counts.items()},
            "decisions": [[k[0], k[1], k[2], n] for k, n in self.decision_counts.items()],
            "victims": [[k[0], k[1], v[0], v[1]] for k, v in self.victim_counts.items()],
            "rejections": dict(self.rejection_counts),
        }

    def _dedup_list(self) -> list:
        """[[event id, digest, event time]] in arrival order. The fold keeps an accepted event's raw bytes in the
        window and digests them lazily; saving digests them (and keeps the digest instead)."""
        dedup = self.dedup
        out = []
        for eid in self.dedup_order:
            body, at = dedup[eid]
            if body.__class__ is not int:
                body = digest_of(body)
                dedup[eid] = (body, at)
            out.append([eid, body, at])
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "PoolState":
        s = cls(pool=d["pool"], flavor=d["flavor"], chips_per_node=d["chips_per_node"], clock=d["clock"],
                books=Books.from_dict(d["pool"], d["books"]))
        s.chips = {k: Chip(node, state, dict(jobs)) for k, (node, state, jobs) in d["chips"].items()}
        s.jobs = {k: _job_of(v) for k, v in d["jobs"].items()}
        for k, displaced in (d.get("displaced") or {}).items():  # absent in states saved before it
            s.jobs[k].displaced = dict(displaced)
        for j in s.jobs.values():
            if j.placement is not None:
                j.placement = dict(j.placement)
            j.preempted_at = list(j.preempted_at)
            j.hol_ahead = list(j.hol_ahead)
            j.hol_blockers = dict(j.hol_blockers)
        s.grants = {k: Grant(*v) for k, v in d["grants"].items()}
        s.teams = {k: Team(*v) for k, v in d["teams"].items()}
        s.boundaries = [tuple(b) for b in d["boundaries"]]
        heapq.heapify(s.boundaries)
        s.seq = d["seq"]
        s.capacity_milli, s.unavailable_milli = d["capacity_milli"], d["unavailable_milli"]
        s.charged_milli = d["charged_milli"]
        for eid, fp, at in d["dedup"]:
            s.dedup[eid] = (fp, at)
            s.dedup_order.append(eid)
        s.applied, s.duplicates, s.rejected = d["applied"], d["duplicates"], d["rejected"]
        s.late_events, s.max_lateness_s = d["late_events"], d["max_lateness_s"]
        s.positions = dict(d.get("positions") or {})
        if "bursts" in d:  # states saved before the policy layer have none of this
            s.bursts = {k: list(v) for k, v in d["bursts"].items()}
            s.inflight = {k: [v[0], v[1], v[2], list(v[3]), v[4], v[5]] for k, v in d["inflight"].items()}
            s.ignored = dict(d.get("ignored") or {})
            s.marked, s.short_since = dict(d["marked"]), dict(d["short_since"])
            s.policy_due = d["policy_due"]
            s.wakes = dict(d.get("wakes") or {})
            s.policy_full = d.get("policy_full", False)
            s.profile = [list(p) for p in d["profile"]]
            s.budget_hours = deque(list(h) for h in d["budget_hours"])
            s.pool_marks = list(d["pool_marks"])
        if d.get("fc_row") is not None:
            s.fc_row = tuple(d["fc_row"])
            s.fc_due = s.fc_row[1] + 1
        if d.get("fc_posted") is not None:
            s.fc_posted = tuple(d["fc_posted"])
        c = d.get("counters")
        if c is not None:  # a state saved before the counters existed starts them at zero
            s.wait_counts = {k: list(v) for k, v in c["waits"].items()}
            s.run_counts = {k: list(v) for k, v in c["runs"].items()}
            s.progress_counts = {k: list(v) for k, v in c["progress"].items()}
            s.decision_counts = {(k[0], k[1], k[2]): k[3] for k in c["decisions"]}
            s.victim_counts = {(k[0], k[1]): [k[2], k[3]] for k in c["victims"]}
            s.rejection_counts = dict(c["rejections"])
        s.reindex()
        s.reset_until()
        return s

    def reindex(self) -> None:
        """Rebuild the derived job indexes from `jobs`."""
        self.waiting, self.running_jobs, self.pending_sizes, self.heads = {}, {}, {}, {}
        self.hol_groups = None  # rebuilt at the next look
        self.prio_chips = {}
        self.down = {k for k, c in self.chips.items() if not c.available}
        self.active_milli = sum(j.chips_milli for j in self.jobs.values())
        self.held_milli = sum(g.chips_milli for g in self.grants.values())
        self.nodes, self.node_free_counts, self.whole_free_milli = {}, {}, 0
        for c in self.chips.values():
            n = self.nodes.get(c.node)
            if n is None:
                n = self.nodes[c.node] = [0, 0]
            n[0] += 1
            if c.available and not c.jobs:
                n[1] += 1
        for reg, free in self.nodes.values():
            self.node_free_counts[free] = self.node_free_counts.get(free, 0) + 1
            if free == reg:
                self.whole_free_milli += reg * 1000
        self.unplaced_runs = sum(1 for j in self.jobs.values() if j.status == "running" and j.placement is None)
        for j in self.jobs.values():
            if j.status == "pending":
                self.waiting.setdefault(j.team, {})[j.job_id] = j
                self.pending_sizes[j.chips_milli] = self.pending_sizes.get(j.chips_milli, 0) + 1
            elif j.status == "running":
                self.running_jobs.setdefault(j.team, {})[j.job_id] = j
                if j.preemptible:
                    pc = self.prio_chips.setdefault(j.team, {})
                    pc[j.priority] = pc.get(j.priority, 0) + j.chips_milli

    def copy(self) -> "PoolState":
        """An independent snapshot (the fold updates a state in place)."""
        return PoolState.from_dict(self.to_dict())


def _slots_list(obj) -> list:
    return [getattr(obj, f.name) for f in fields(obj)]


_PLACEMENT = [f.name for f in fields(Job)].index("placement")
_PREEMPTED_AT = [f.name for f in fields(Job)].index("preempted_at")
_HOL_AHEAD = [f.name for f in fields(Job)].index("hol_ahead")
_HOL_BLOCKERS = [f.name for f in fields(Job)].index("hol_blockers")
_PROGRESS = [f.name for f in fields(Job)].index("progress")  # the last field of the saved list (displaced is saved apart)


def _job_list(job: Job) -> list:
    v = _slots_list(job)[:_PROGRESS + 1]
    if v[_PLACEMENT] is not None:  # a copy: a snapshot must not change as the fold goes on
        v[_PLACEMENT] = dict(v[_PLACEMENT])
    v[_PREEMPTED_AT] = list(v[_PREEMPTED_AT])
    v[_HOL_AHEAD] = list(v[_HOL_AHEAD])
    v[_HOL_BLOCKERS] = dict(v[_HOL_BLOCKERS])
    pr = v[_PROGRESS]
    if pr is None:  # never reported progress: left out (a saved state of a log without progress is the same as
        return v[:_PROGRESS]  # before progress existed)
    pv = _slots_list(pr)
    pv[-3] = list(pr.ref_rates)
    pv[-1] = dict(pr.unhealthy)
    v[_PROGRESS] = pv
    return v


def _job_of(v: list) -> Job:
    """A job from its saved list (without `progress` when it never reported any)."""
    if len(v) > _PROGRESS and v[_PROGRESS] is not None:
        pv = list(v[_PROGRESS])
        pv[-3] = list(pv[-3])
        pv[-1] = dict(pv[-1])
        v = [*v[:_PROGRESS], Progress(*pv)]
    return Job(*v)
