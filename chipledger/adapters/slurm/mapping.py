"""Slurm's records → chipledger events: the one mapping shared by `slurm watch` and `import sacct` (pure).

Inputs are plain records parsed from Slurm's own commands (chipledger/adapters/slurm/commands.py parses the JSON of
`sacct --json` / `sinfo --json` and the parsable text of `sacctmgr`; chipledger/adapters/importers/sacct.py parses
`sacct --parsable2` dumps into the same `Run`): no I/O and no clock here. Every event id derives from Slurm's
ids (cluster, job id, the run's Submit, what happened), so mapping the same records again gives the same
events, and a watcher that restarts sends nothing new (docs/slurm.md has the table).

- A job (`123`, array task `123_4`, het component `123+0`) is one ledger job; with `sacct -D` every run of a
  requeued job is its own record (same job id; Slurm resets Submit on requeue), chained here in Submit order.
- The first wait starts at `Eligible` (not Submit): a held job (`--hold`, `--begin`, a dependency) is not
  demand until Slurm makes it eligible, and a job cancelled while held (never eligible) writes nothing.
- A run Slurm sent back to the queue is `job.preempted` with `held`: Slurm holds a requeued job back until its
  next run's `Eligible` (End + cred_expire + 1 s), and `job.released` at that Eligible makes it demand again (the
  wait begins there). A next run that ended before it was eligible (cancelled while held) has no release: the
  job goes from held to `job.finished`, never pending. Both ids derive from the runs' Submit (stable).
- A run that ended PREEMPTED → `job.preempted` (the run's work is lost). A run that ended REQUEUED is an
  `scontrol requeue`: when its AdminComment carries the actuator's mark (`chipledger-preempt:<decision id>`,
  set by `slurm actuate` just before it requeues) it is that decision's `job.preempted`; otherwise it is an
  admin requeue, booked as `job.checkpointed` then `job.preempted` with `cause: requeued` at its End, so it loses
  no work and is not a preemption. Any other state of an earlier run (NODE_FAIL, BOOT_FAIL… with requeue) →
  `job.preempted` with `cause: failure`, its work lost (not a preemption either).
- The last record decides the outcome (`job.finished`), or the job is still pending/running.
- The team is the job's account, named by its place in Slurm's account hierarchy (`team_paths`): an account under
  a parent account other than `root` is `parent/account` (deeper: `a/b/account`), the `org/team` names the
  ledger's org views read (`balances_org`, `chipledger share`); a top-level account is its own name.
- The job's `User` (of its first run) is the submission's `user`: per-user books (`usage_by_user`) compare with
  `sreport cluster AccountUtilizationByUser`. Ids do not depend on it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional

from chipledger.adapters.common import Event, make_event as _ev

PREEMPT_MARK = "chipledger-preempt:"  # AdminComment prefix the actuator sets before it requeues a victim

OUTCOME = {"COMPLETED": "succeeded", "CANCELLED": "cancelled", "REVOKED": "cancelled",
           **dict.fromkeys(("FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                            "LAUNCH_FAILED", "RECONFIG_FAIL"), "failed")}
BACK_TO_QUEUE = frozenset(("PREEMPTED", "REQUEUED"))
ACTIVE = frozenset(("RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING", "STOPPED",
                    "POWER_UP_NODE", "UPDATE_DB", "RESIZING"))
PENDING = frozenset(("PENDING", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD"))
KNOWN_STATES = frozenset(OUTCOME) | BACK_TO_QUEUE | ACTIVE | PENDING

_PRIORITY_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Run:
    """One accounting record of a job (one run), times in epoch seconds (None: not set)."""

    job_id: str  # as Slurm prints it: 123, 123_4, 123+0
    account: str
    user: str  # the login the job runs as ('' when not known: `job.submitted` without `user`)
    partition: str
    submit: int
    eligible: Optional[int]
    start: Optional[int]  # None: never allocated
    end: Optional[int]
    state: str  # upper-case first word (CANCELLED by 0 → CANCELLED)
    gpus: int  # allocated GPUs (requested ones for a run never allocated)
    nodes: Optional[int]
    priority: int = 0
    admin_comment: str = ""
    gpu_type: str = ""  # from typed TRES (gres/gpu:a100=N), when present


@dataclass(frozen=True, slots=True)
class Node:
    """A node as the controller reports it: its GPUs, partitions and state words (base state and flags)."""

    name: str
    gpus: int
    gpu_type: str
    partitions: tuple[str, ...]
    states: tuple[str, ...]
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Assoc:
    """An association with a GPU limit: `GrpTRES=gres/gpu[:type]=N` (per type, or untyped under '')."""

    assoc_id: str
    account: str
    user: str
    partition: str
    gpus_by_type: tuple[tuple[str, int], ...]


@dataclass
class MapReport:
    """What the mapping left out or adjusted, by reason (for the watcher's log and the import report)."""

    skipped: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)


# ranks within one instant: inventory and quota first, then what frees chips, then new demand, then starts
RANK_POOL, RANK_REGISTER, RANK_CHIP, RANK_QUOTA, RANK_CHECKPOINT, RANK_FREE, RANK_SUBMIT, RANK_START, RANK_TICK = range(9)


def pool_name(cluster: str, partition: str) -> str:
    return f"{cluster}/{partition}"


def state_word(text: str) -> str:
    """`CANCELLED by 1234` → CANCELLED; `CANCELLED+` (cut column) → CANCELLED."""
    return text.strip().split(" ", 1)[0].rstrip("+").upper()


def chip_ids(node: Node) -> list[str]:
    return [f"{node.name}-gpu{i}" for i in range(node.gpus)]


def clamp_priority(p: int) -> int:
    return max(-_PRIORITY_MAX - 1, min(_PRIORITY_MAX, p))


def _id(cluster: str, *parts) -> str:
    return "slurm:" + ":".join((cluster,) + tuple(str(p) for p in parts))


def decision_of(admin_comment: str) -> Optional[str]:
    """The decision id in an AdminComment the actuator wrote (`chipledger-preempt:<id>`), else None."""
    c = (admin_comment or "").strip()
    if not c.startswith(PREEMPT_MARK):
        return None
    rest = c[len(PREEMPT_MARK):].split()[0] if c[len(PREEMPT_MARK):].strip() else ""
    return rest or None


def team_paths(parents: dict[str, str]) -> dict[str, str]:
    """account -> its team name: the account's ancestors below `root`, then itself, joined by '/' (Slurm's
    account hierarchy as the ledger's `org/team`). `parents`: account -> parent account (`sacctmgr show assoc`'s
    ParentName of the account associations)."""
    out = {}
    for account in parents:
        chain, seen, p = [account], {account}, parents.get(account)
        while p and p != "root" and p not in seen:
            chain.append(p)
            seen.add(p)
            p = parents.get(p)
        out[account] = "/".join(reversed(chain))
    return out


def job_events(cluster: str, source: str, runs: list[Run], report: MapReport, since: int = 0,
               pools: Optional[set] = None, *, eligible: bool = True,
               teams: Optional[dict[str, str]] = None) -> list[Event]:
    """The events of one job from all its runs (any order; chained by Submit). `since`: nothing earlier is
    written (times before it are moved to it). `pools`: the pools that exist (None: any); a job of another
    partition is skipped as `no_pool`. `teams`: account -> team name (`team_paths`; absent: the account).
    `eligible=False` (a sacct dump without the Eligible column): the first
    wait starts at Submit. Times out of order in the records (a Start before Submit or before the previous
    run's End, an End before Start) are moved later and counted in `report.notes`. This is the one walk over
    a job's runs: `slurm watch` and `import sacct` both call it."""
    runs = sorted(runs, key=lambda r: (r.submit, r.start if r.start is not None else 2**62))
    r0 = runs[0]
    job = r0.job_id
    pool = pool_name(cluster, r0.partition.split(",", 1)[0].strip())
    if r0.gpus <= 0:
        report.skipped["no_gpu"] += 1
        return []
    if pools is not None and pool not in pools:
        report.skipped["no_pool"] += 1
        return []
    first_wait = r0.eligible if eligible else r0.submit
    if first_wait is None:
        if r0.start is not None:
            first_wait = r0.start  # should not happen: a run that started was eligible
        elif len(runs) == 1 and r0.state in OUTCOME:
            report.skipped["cancelled_while_held"] += 1  # never eligible: never demand
            return []
        else:
            report.notes["held jobs (not eligible yet) not submitted"] += 1
            return []
    if len(runs) > 1:
        report.notes["requeued jobs whose runs were chained"] += 1
    key0 = r0.submit
    per_node = r0.gpus // r0.nodes if r0.nodes and r0.gpus % r0.nodes == 0 else None
    out: list[Event] = []
    cursor = max(first_wait, since)
    out.append(_ev(cursor, RANK_SUBMIT, "job.submitted", pool, source, _id(cluster, job, key0, "submitted"),
                   job_id=job, team=(teams or {}).get(r0.account, r0.account), chips=r0.gpus, priority=clamp_priority(r0.priority),
                   preemptible=True, chips_per_node=per_node, user=r0.user or None))
    running = False
    n = len(runs)
    for k, r in enumerate(runs):
        key = r.submit
        if not eligible and k > 0 and r.submit > cursor:  # without Eligible: a requeued run waits from its Submit
            cursor = r.submit
        if started(r) and r.state not in PENDING:
            if since <= r.start < cursor:
                report.notes["start before submit (or before the previous run's end) moved later"] += 1
            t = max(r.start, cursor)
            out.append(_ev(t, RANK_START, "job.started", pool, source, _id(cluster, job, key, "started"),
                           job_id=job))
            running, cursor = True, t
        if k < n - 1:  # an earlier run: Slurm requeued it
            if running:
                nxt = runs[k + 1]
                end = r.end if r.end is not None else nxt.submit
                t = max(end, cursor)
                out += _back_to_queue(cluster, source, pool, job, r, t, report, held=eligible)
                running, cursor = False, t
                if eligible:  # held until the next run's Eligible: then it is demand again
                    released = released_at(nxt)
                    if released is None:
                        report.notes["requeued runs never eligible (held, then ended): no demand"] += 1
                    else:
                        cursor = max(released, t)
                        out.append(_ev(cursor, RANK_SUBMIT, "job.released", pool, source,
                                       _id(cluster, job, nxt.submit, "released"), job_id=job))
            continue
        outcome = OUTCOME.get(r.state)
        if outcome is not None:
            if r.end is None:
                report.notes["jobs in a final state without an End time left active"] += 1
                continue
            if since <= r.end < cursor:
                report.notes["end before start moved later"] += 1
            if r.state == "CANCELLED" and running and decision_of(r.admin_comment):  # `slurm actuate --action cancel`
                out += _back_to_queue(cluster, source, pool, job, r, max(r.end, cursor), report)
            out.append(_ev(max(r.end, cursor), RANK_FREE, "job.finished", pool, source,
                           _id(cluster, job, key, "finished"), job_id=job, outcome=outcome))
        elif r.state in BACK_TO_QUEUE and running:
            # the last record ended PREEMPTED/REQUEUED and no next run is recorded (PreemptMode=CANCEL, or
            # the next record not written yet): back to the queue
            if r.end is None:
                report.notes["preempted jobs without an End time left running"] += 1
                continue
            out += _back_to_queue(cluster, source, pool, job, r, max(r.end, cursor), report, held=eligible)
            report.notes["jobs preempted and not requeued (yet), held until their next run is recorded"
                         if eligible else "jobs preempted and not requeued (yet), left pending"] += 1
        elif r.state in ACTIVE and not running:
            report.notes["active jobs without a Start time left pending"] += 1
    return _in_causal_order(out)


def _in_causal_order(events: list[Event]) -> list[Event]:
    """One job's events, in the order they happened, keep that order when sorted by (instant, rank): where one
    shares its instant with the job's previous event and would rank before it, its rank is raised above it. (The
    watcher sorts a poll's events by instant and rank, frees before takes across jobs; a job released, started and
    cancelled within one second must stay in that order, else the cancel comes first and the start is a dead
    letter.)"""
    out: list[Event] = []
    for e in events:
        if out and e.at == out[-1].at and e.rank <= out[-1].rank:
            e = Event(e.at, out[-1].rank + 1, e.body)
        out.append(e)
    return out


def started(run: Run) -> bool:
    """Whether the run started. A run cancelled before it was eligible (a requeued job cancelled in its hold-off)
    can have a Start in accounting, equal to its End (the cancel) and before its Eligible (measured on 22.05.8):
    Slurm starts no job before it is eligible, so such a Start is not one."""
    return run.start is not None and (run.eligible is None or run.start >= run.eligible)


def released_at(run: Run) -> Optional[int]:
    """When a requeued job's next run became eligible (`job.released`): its Eligible; None when it never was: no
    Eligible, or it ended (cancelled while held) at or before its Eligible."""
    e = run.eligible
    if e is None:
        return None
    if started(run):
        return e
    if run.end is not None and run.end <= e:
        return None
    return e


def _back_to_queue(cluster: str, source: str, pool: str, job: str, r: Run, t: int, report: MapReport,
                   held: bool = False) -> list[Event]:
    """A run Slurm sent back to the queue at `t`: preempted (PREEMPTED, or REQUEUED by the actuator: its
    decision id), or requeued by an admin (checkpointed first: no work lost). `held`: the job is held until its
    next run's Eligible (`job.released`): Slurm does not start a requeued job before then."""
    out = []
    key = r.submit
    decision = decision_of(r.admin_comment) if r.state in ("REQUEUED", "CANCELLED") else None
    if r.state == "REQUEUED" and decision is None:
        out.append(_ev(t, RANK_CHECKPOINT, "job.checkpointed", pool, source,
                       _id(cluster, job, key, "requeued-checkpoint"), job_id=job))
        report.notes["admin requeues (no work lost)"] += 1
    out.append(_ev(t, RANK_FREE, "job.preempted", pool, source, _id(cluster, job, key, r.state.lower()),
                   job_id=job, decision_id=decision, cause=cause_of(r.state, decision),
                   held=True if held else None))
    return out


def cause_of(state: str, decision: Optional[str]) -> Optional[str]:
    """The `cause` of the job.preempted of a run that ended in `state` (DESIGN §4; None: preempted, the default):
    PREEMPTED, or anything the actuator did for a decision, is a preemption; REQUEUED without the actuator's mark
    is an admin's `scontrol requeue`; any other state of a run Slurm requeued (NODE_FAIL, BOOT_FAIL…) a failure."""
    if decision is not None or state == "PREEMPTED":
        return None
    return "requeued" if state == "REQUEUED" else "failure"


def node_state_events(cluster: str, source: str, pools: dict, events: Iterable[tuple], since: int = 0,
                      maintenance: Iterable[tuple] = ()) -> list[Event]:
    """Chip states from what slurmdbd recorded, to the second, for each node:

    - `events`: node events (`sacctmgr show event event=node`: a node DOWN, DRAIN, FAIL… from its start to its
      end, exactly the periods sreport counts as Down) as (node, start, end or None, state, reason);
    - `maintenance`: maintenance reservations (`sacctmgr show reservation`, flag MAINT without IGNORE_JOBS: the
      periods sreport counts as PLND Down) as (node, start, end or None, reservation name).

    Per node, at every start and end: `down` while a node event is open, else `maintenance` while a maintenance
    reservation covers the node, else `healthy`; a `chip.state_changed` for each of its GPUs whenever that state
    (or its reason) changes. Periods before `since` are cut there."""
    chips_of = {n.name: (spec.pool, chip_ids(n)) for spec in pools.values() for n in spec.nodes}
    by_node: dict[str, list] = {}
    for node, start, end, state, reason in events:
        if node in chips_of and (end is None or end > since):
            by_node.setdefault(node, []).append((max(start, since), end, 0, (f"{state}: {reason}" if reason else state)))
    for node, start, end, name in maintenance:
        if node in chips_of and (end is None or end > since) and (end is None or end > start):
            by_node.setdefault(node, []).append((max(start, since), end, 1, f"MAINT reservation {name}"))
    out = []
    for node, periods in sorted(by_node.items()):
        pool, chips = chips_of[node]
        instants = sorted({p[0] for p in periods} | {p[1] for p in periods if p[1] is not None})
        have = ("healthy", None)
        for t in instants:
            open_ = [p for p in periods if p[0] <= t and (p[1] is None or p[1] > t)]
            if open_:
                kind = min(p[2] for p in open_)  # a node down in a maintenance reservation is down
                latest = max((p for p in open_ if p[2] == kind), key=lambda p: p[0])
                want = ("down" if kind == 0 else "maintenance", latest[3][:200])
            else:
                want = ("healthy", None)
            if want == have:
                continue
            for c in chips:
                out.append(_ev(t, RANK_CHIP, "chip.state_changed", pool, source, _id(cluster, c, want[0], t),
                               chip_id=c, state=want[0], reason=want[1]))
            have = want
    return out


def hostnames(expr: str) -> list[str]:
    """Slurm's hostlist syntax, as `scontrol show hostnames` expands it: `n1,n[3-4]`, `gpu[01-02,7]x` →
    each name (zero padding kept)."""
    out: list[str] = []
    for m in re.finditer(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*)", expr or ""):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if ranges is None:
            if prefix + suffix:
                out.append(prefix + suffix)
            continue
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            hi = hi or lo
            if not (lo.isdigit() and hi.isdigit()):
                continue
            out += [f"{prefix}{i:0{len(lo)}d}{suffix}" for i in range(int(lo), int(hi) + 1)]
    return out


def runs_by_job(runs: Iterable[Run]) -> dict[str, list[Run]]:
    jobs: dict[str, list[Run]] = {}
    for r in runs:
        jobs.setdefault(r.job_id, []).append(r)
    return jobs


@dataclass(frozen=True, slots=True)
class PoolSpec:
    pool: str
    flavor: str
    chips_per_node: int
    nodes: tuple[Node, ...]


def pools_of(cluster: str, nodes: Iterable[Node]) -> dict[str, PoolSpec]:
    """Pools from the nodes: one per partition that has GPU nodes; a node in several partitions belongs to
    the first one listing it (its chips are counted once). Flavor = the GPU type of the partition's nodes
    (the most common; `gpu` when untyped); chips_per_node = the most common GPU count."""
    members: dict[str, list[Node]] = {}
    for n in nodes:
        if n.gpus <= 0 or not n.partitions:
            continue
        members.setdefault(n.partitions[0], []).append(n)
    out = {}
    for part, ns in sorted(members.items()):
        types = Counter(n.gpu_type or "gpu" for n in ns)
        counts = Counter(n.gpus for n in ns)
        flavor = max(types.items(), key=lambda kv: (kv[1], kv[0]))[0]
        per_node = max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
        pool = pool_name(cluster, part)
        out[pool] = PoolSpec(pool, flavor, per_node, tuple(sorted(ns, key=lambda n: n.name)))
    return out


def inventory_events(cluster: str, source: str, pools: dict[str, PoolSpec], at: int) -> list[Event]:
    """`pool.configured` and one `chip.registered` per GPU at `at` (the instant the cluster registered them)."""
    out = []
    for spec in pools.values():
        out.append(_ev(at, RANK_POOL, "pool.configured", spec.pool, source, _id(cluster, spec.pool, "configured"),
                       flavor=spec.flavor, chips_per_node=spec.chips_per_node))
        for node in spec.nodes:
            for chip in chip_ids(node):
                out.append(_ev(at, RANK_REGISTER, "chip.registered", spec.pool, source,
                               _id(cluster, chip, "registered"), chip_id=chip, node=node.name))
    return out


def grants_of(cluster: str, pools: dict[str, PoolSpec], assocs: Iterable[Assoc],
              report: Optional[MapReport] = None, teams: Optional[dict[str, str]] = None
              ) -> dict[tuple[str, str, str], int]:
    """(assoc id, pool, team) → chips: a typed limit `gres/gpu:TYPE=N` is a grant in every pool of flavor TYPE;
    an untyped `gres/gpu=N` is a grant in the association's partition's pool, or in the only pool of a cluster
    with one; on a cluster of several pools an untyped limit of an association without partition is noted and
    not mapped (Slurm caps the sum over all GPU types; the ledger's quota is per pool). A user's limit is
    inside its account's: only account associations (no user) become grants. `teams`: account -> team name
    (`team_paths`)."""
    teams = teams or {}
    by_flavor: dict[str, list[str]] = {}
    for spec in pools.values():
        by_flavor.setdefault(spec.flavor, []).append(spec.pool)
    out: dict[tuple[str, str, str], int] = {}
    for a in assocs:
        if a.user:
            continue
        for gtype, n in a.gpus_by_type:
            if gtype:
                targets = by_flavor.get(gtype, [])
            elif a.partition:
                p = pool_name(cluster, a.partition)
                targets = [p] if p in pools else []
            elif len(pools) == 1:
                targets = list(pools)
            else:
                if report is not None:
                    report.notes["untyped gres/gpu limits on a cluster of several pools, not mapped"] += 1
                targets = []
            for p in targets:
                out[(a.assoc_id, p, teams.get(a.account, a.account))] = n
    return out


_GPU_TRES = re.compile(r"gres/gpu(?::([^=,]+))?=(\d+)", re.IGNORECASE)


def gpu_limits(tres: str) -> tuple[tuple[str, int], ...]:
    """`cpu=10,gres/gpu:a100=8,gres/gpu=12` → (('', 12), ('a100', 8)). When typed limits exist the untyped
    one is dropped (it caps the sum; the typed ones say which pool)."""
    typed, untyped = [], []
    for m in _GPU_TRES.finditer(tres or ""):
        (typed if m.group(1) else untyped).append((m.group(1) or "", int(m.group(2))))
    return tuple(sorted(typed)) if typed else tuple(untyped)


def gpus_of_tres(items: Iterable[tuple[str, int]]) -> tuple[int, str]:
    """(GPUs, type) from (name, count) TRES items such as ('gres/gpu', 2), ('gres/gpu:a100', 2): the untyped
    count is the total; typed counts are summed only when it is absent."""
    total = None
    typed = 0
    gtype = ""
    for name, count in items:
        name = name.lower()
        if name == "gres/gpu":
            total = count
        elif name.startswith("gres/gpu:"):
            typed += count
            gtype = gtype or name.split(":", 1)[1]
    return (total if total is not None else typed), gtype


def gres_gpus(gres: str) -> tuple[int, str]:
    """`gpu:a100:8(S:0-1)`, `gpu:8`, `gpu:a100:4,gpu:h100:4` → (GPUs, first type)."""
    total, gtype = 0, ""
    for item in (gres or "").split(","):
        item = item.split("(", 1)[0].strip()
        parts = item.split(":")
        if not parts or parts[0] != "gpu":
            continue
        if len(parts) == 2 and parts[1].isdigit():
            total += int(parts[1])
        elif len(parts) >= 3 and parts[-1].isdigit():
            total += int(parts[-1])
            gtype = gtype or parts[1]
        elif len(parts) == 2:
            total += 1
            gtype = gtype or parts[1]
    return total, gtype


# --- prices and budgets from Slurm's billing (issue 36; DESIGN §3 `--may prices`) ---------------------------------
#: the units of the prices and budgets mapped from Slurm: its billing TRES-minutes (TRESBillingWeights ×
#: minutes, what GrpTRESMins=billing=N caps) and GPU-minutes (GrpTRESMins=gres/gpu=N)
BILLING_UNIT = "slurm-billing-min"
CHIP_MIN_UNIT = "chip-min"
_WEIGHT = re.compile(r"gres/gpu(?::([^=,]+))?=([0-9.]+)", re.IGNORECASE)
_MINS = re.compile(r"(gres/gpu(?::([^=,]+))?|billing)=(\d+)", re.IGNORECASE)


def gpu_billing_weights(weights: str) -> dict[str, float]:
    """`TRESBillingWeights=CPU=1.0,Mem=0.25G,GRES/gpu=2.0,GRES/gpu:a100=3` → {'': 2.0, 'a100': 3.0}: the billing
    weight of a GPU (per type; '' untyped)."""
    return {(m.group(1) or "").lower(): float(m.group(2)) for m in _WEIGHT.finditer(weights or "")}


def billing_prices(cluster: str, pools: dict[str, PoolSpec], weights_by_partition: dict[str, str]) -> dict[str, int]:
    """pool → price per chip-hour in Slurm billing-minutes (the GPU's weight × 60, rounded): a partition's
    `TRESBillingWeights` price its pool's GPUs (a typed weight of the pool's flavor first, else the untyped one).
    Slurm bills a job the largest or the sum of its TRES' weights (PriorityFlags=MAX_TRES): the ledger prices the
    chips alone."""
    out: dict[str, int] = {}
    for partition, text in sorted(weights_by_partition.items()):
        pool = pool_name(cluster, partition)
        spec = pools.get(pool)
        if spec is None:
            continue
        w = gpu_billing_weights(text)
        weight = w.get(spec.flavor.lower(), w.get(""))
        if weight is not None and weight > 0:
            out[pool] = round(weight * 60)
    return out


def tres_mins_limits(text: str) -> tuple[tuple[str, str, int], ...]:
    """`GrpTRESMins=billing=100000,gres/gpu:a100=60000` → (('billing', '', 100000), ('gpu', 'a100', 60000))."""
    out = []
    for m in _MINS.finditer(text or ""):
        if m.group(1).lower() == "billing":
            out.append(("billing", "", int(m.group(3))))
        else:
            out.append(("gpu", (m.group(2) or "").lower(), int(m.group(3))))
    return tuple(sorted(out))


def budgets_of(cluster: str, pools: dict[str, PoolSpec], assoc_mins: Iterable[tuple[str, str, str, str, str]],
               report: Optional[MapReport] = None,
               teams: Optional[dict[str, str]] = None) -> dict[tuple[str, str, str, str], int]:
    """(assoc id, pool, team, unit) → amount from account associations' `GrpTRESMins` (assoc id, account, user,
    partition, GrpTRESMins text): `gres/gpu[:TYPE]=N` GPU-minutes is a budget of N chip-minutes in the pools it
    maps to (as `grants_of` maps GrpTRES), `billing=N` a budget of N billing-minutes in the association's partition's
    pool (or the only pool). Slurm's GrpTRESMins is a cap over the usage decayed by PriorityDecayHalfLife and reset
    by PriorityUsageResetPeriod; the ledger's budget is per UTC month (the period an admin states; documented).
    `teams`: account -> team name (`team_paths`), as the grants and jobs name the team, so the budget is the team's."""
    teams = teams or {}
    by_flavor: dict[str, list[str]] = {}
    for spec in pools.values():
        by_flavor.setdefault(spec.flavor.lower(), []).append(spec.pool)
    out: dict[tuple[str, str, str, str], int] = {}
    for assoc_id, account, user, partition, text in assoc_mins:
        if user:
            continue
        for kind, gtype, n in tres_mins_limits(text):
            if kind == "gpu" and gtype:
                targets = by_flavor.get(gtype, [])
            elif partition:
                p = pool_name(cluster, partition)
                targets = [p] if p in pools else []
            elif len(pools) == 1:
                targets = list(pools)
            else:
                if report is not None:
                    report.notes["GrpTRESMins without a GPU type or partition on a cluster of several pools, "
                                 "not mapped"] += 1
                targets = []
            unit = BILLING_UNIT if kind == "billing" else CHIP_MIN_UNIT
            for p in targets:
                out[(assoc_id, p, teams.get(account, account), unit)] = n
    return out
