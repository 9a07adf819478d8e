"""`chipledger slurm watch`: poll a live Slurm and send what happened as chipledger events, exactly once.

Each poll reads the controller's nodes (`sinfo --json`), the associations' GPU limits (`sacctmgr show assoc`),
every run of every job active since the start (`sacct -a -D -X --json`), and the nodes' down periods and
maintenance reservations slurmdbd recorded with their exact start and end (`sacctmgr show event event=node`,
`sacctmgr show reservation`: what sreport counts as Down and PLND Down), maps them with
chipledger/adapters/slurm/mapping.py, and sends the events not sent before whose instant is at or before the
*watermark* (now − `settle_s`: accounting records reach slurmdbd a moment after they happen, so an instant is
only final once it is a little in the past). Events go out in (time, rank) order, followed by one `pool.tick`
per pool at the watermark so the books close.

The state file (JSON, replaced atomically after every poll) is the cursor: the watermark reached, the ids
sent (pruned once they are older than the look-back and Slurm no longer lists them), the inventory, chip
states and grants seen. Events from accounting are recomputed from Slurm at every poll and carry ids derived
from Slurm's own, so a repeated poll or a restarted watcher sends nothing new; changes only the controller
knows (a node added, a limit changed) are stamped with the watermark of the poll that saw them (so they are
at most `settle_s` plus one interval late) and kept in the state until sent. The watermark is also held
just before any instant the controller's queue (`squeue --json`) shows but accounting does not list yet. If the watcher dies between sending and saving, the next poll sends the same events again with the same
ids and bodies: the ledger drops them as duplicates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from chipledger.adapters import common
from chipledger.adapters.slurm import commands
from chipledger.adapters.slurm.mapping import (ACTIVE, BACK_TO_QUEUE, OUTCOME, RANK_CHIP, RANK_REGISTER, RANK_QUOTA, RANK_TICK, Event, MapReport, PoolSpec, chip_ids,
                                      BILLING_UNIT, CHIP_MIN_UNIT, billing_prices, budgets_of,
                                      grants_of, inventory_events, job_events, node_state_events, team_paths,
                                      pools_of, runs_by_job,
                                      _ev, _id)

STATE_VERSION = 1
LOOKBACK_S = 86_400  # sacct is asked for jobs active in the last day (or since the start, if later)


class WatchError(RuntimeError):
    """A bad state file or option: says what to do."""


@dataclass
class Slurm:
    """The reads a poll makes (replaceable in unit tests by captured outputs)."""

    nodes: Callable = commands.nodes
    assocs: Callable = commands.assocs
    runs: Callable = commands.sacct_runs
    queue: Callable = commands.queue
    registered_at: Callable = commands.cluster_registered_at
    node_events: Callable = commands.node_events
    reservations: Callable = commands.reservations
    account_parents: Callable = commands.account_parents
    billing: Callable = commands.partition_billing   # read only with prices=True (`slurm watch --prices`)
    assoc_mins: Callable = commands.assoc_mins


@dataclass
class PollResult(common.Sent):
    notes: dict = field(default_factory=dict)


JsonlSink = common.JsonlSink


class KafkaSink(common.KafkaSink):
    __doc__ = common.KafkaSink.__doc__
    error = commands.SlurmError
    retry_at = "poll"


def _new_state(cluster: str, since: int) -> dict:
    return {"version": STATE_VERSION, "cluster": cluster, "since": since, "watermark": None, "sent": {},
            "inventory_at": None, "pools": {}, "chips": {}, "grants": {}, "pending": []}


def load_state(path: Path, cluster: str, since: Optional[int]) -> dict:
    st = common.read_state(path, cluster, STATE_VERSION, WatchError,
                           unreadable="move it away to start afresh (events already sent would then be sent again: "
                                      "the ledger drops duplicates)",
                           mismatch="give each cluster its own --state")
    if st is not None:
        return st
    if since is None:
        raise WatchError("no state file yet: give --since (an instant, or `cluster`) for the first poll")
    return _new_state(cluster, since)


class Watcher(common.ClusterState):
    def __init__(self, cluster: str, state_path: Path, sink, *, since: Optional[int] = None, settle_s: int = 5,
                 slurm: Optional[Slurm] = None, clock: Callable[[], float] = time.time, log=None,
                 prices: bool = False):
        super().__init__(cluster, state_path, lambda path: load_state(path, cluster, since), clock=clock,
                         log=log or (lambda msg: None))
        # mirror TRESBillingWeights and GrpTRESMins as price.set and budget.set (the principal needs `--may prices`)
        self.prices = prices
        self.source = f"{cluster}/slurm"
        self.sink = sink
        self.settle_s = settle_s
        self.slurm = slurm or Slurm()

    # -- one poll ---------------------------------------------------------------------------------------
    def poll(self, until: Optional[int] = None) -> PollResult:
        st = self.state
        now = int(self.clock())
        watermark = now - self.settle_s
        if until is not None:
            watermark = min(watermark, until)
        prev = st["watermark"]
        if prev is not None and watermark < prev:
            watermark = prev  # the wall clock stepped back: never emit behind what was sent
        report = MapReport()
        since = st["since"]
        lookback = max(since, (prev if prev is not None else since) - LOOKBACK_S)
        queued = self.slurm.queue()  # before sacct: what the controller knows must be in accounting by then
        runs = self.slurm.runs(lookback)
        watermark = min(watermark, _not_in_accounting_yet(queued, runs, now))
        if prev is not None and watermark < prev:
            watermark = prev
        nodes = self.slurm.nodes()
        pools = pools_of(self.cluster, nodes)
        # a change only the controller shows (a node added, a limit changed) is stamped with this poll's
        # watermark: the instant up to which this poll sends, so it goes out now and in order
        observed_at = max(watermark, since) if prev is not None else None
        self._inventory(pools, observed_at)
        teams = team_paths(self.slurm.account_parents(self.cluster))  # accounts under parents: org/team
        self._grants(pools, observed_at, report, teams)
        if self.prices:
            self._prices(pools, observed_at, report, teams)
        candidates = [Event(x["at"], x["rank"], x["body"]) for x in st["pending"]]
        if st["inventory_at"] is not None:
            candidates += node_state_events(self.cluster, self.source, pools,
                                            self.slurm.node_events(self.cluster, lookback), st["inventory_at"],
                                            self.slurm.reservations(self.cluster, lookback))
        known = set(st["pools"])
        submitted_jobs = {k.split(":", 3)[2] for k in st["sent"] if k.endswith(":submitted")}
        for job_id, job_runs in runs_by_job(runs).items():
            evs = job_events(self.cluster, self.source, job_runs, report, since=since, pools=known, teams=teams)
            if evs and evs[0].body["type"] == "job.submitted" and evs[0].body["event_id"] not in st["sent"] \
                    and job_id in submitted_jobs:
                evs = evs[1:]  # its first run left the look-back: submitted already, under the older run's id
            candidates += evs
        sent = st["sent"]
        todo = [e for e in candidates if e.at <= watermark and e.body["event_id"] not in sent]
        todo.sort(key=lambda e: (e.at, e.rank, e.body["pool"], e.body["event_id"]))
        res = PollResult(watermark=watermark, notes={**report.skipped, **report.notes})
        for e in todo:
            if prev is not None and e.at < prev:
                res.late += 1
            self.sink.send(e.body)
            sent[e.body["event_id"]] = e.at
            res.by_type[e.body["type"]] = res.by_type.get(e.body["type"], 0) + 1
        if prev is None or watermark > prev:
            for pool in sorted(st["pools"]):
                if st["inventory_at"] is not None and watermark >= st["inventory_at"]:
                    self.sink.send(_ev(watermark, RANK_TICK, "pool.tick", pool, self.source,
                                       _id(self.cluster, pool, "tick", watermark)).body)
                    res.by_type["pool.tick"] = res.by_type.get("pool.tick", 0) + 1
        self.sink.flush()
        res.sent = sum(res.by_type.values())
        st["watermark"] = watermark
        st["pending"] = [p for p in st["pending"] if p["body"]["event_id"] not in sent]
        live = {e.body["event_id"] for e in candidates}
        horizon = watermark - LOOKBACK_S - 3600
        st["sent"] = {k: t for k, t in sent.items() if t >= horizon or k in live}
        self.save()
        return res

    # -- what only the controller knows, stamped with the poll that saw it --------------------------------
    def _pending(self, at: int, rank: int, type: str, pool: str, event_id: str, **fields) -> None:
        e = _ev(at, rank, type, pool, self.source, event_id, **fields)
        self.state["pending"].append({"at": e.at, "rank": e.rank, "body": e.body})

    def _inventory(self, pools: dict[str, PoolSpec], observed_at: Optional[int]) -> None:
        st = self.state
        if st["inventory_at"] is None:  # the first poll: the cluster's chips from when Slurm counts them
            reg = self.slurm.registered_at(self.cluster)
            at = max(st["since"], reg) if reg is not None else st["since"]
            st["inventory_at"] = at
            for e in inventory_events(self.cluster, self.source, pools, at):
                st["pending"].append({"at": e.at, "rank": e.rank, "body": e.body})
            st["pools"] = {p: sorted(c for n in s.nodes for c in chip_ids(n)) for p, s in pools.items()}
        else:
            at = observed_at
            for p, spec in pools.items():
                have = set(st["pools"].get(p, []))
                if p not in st["pools"]:
                    self._pending(at, 0, "pool.configured", p, _id(self.cluster, p, "configured"),
                                  flavor=spec.flavor, chips_per_node=spec.chips_per_node)
                for n in spec.nodes:
                    for c in chip_ids(n):
                        if c not in have:
                            self._pending(at, RANK_REGISTER, "chip.registered", p, _id(self.cluster, c, "registered", at),
                                          chip_id=c, node=n.name)
                now_chips = sorted(c for n in spec.nodes for c in chip_ids(n))
                for c in sorted(have - set(now_chips)):
                    self._pending(at, RANK_CHIP, "chip.retired", p, _id(self.cluster, c, "retired", at), chip_id=c)
                st["pools"][p] = now_chips

    def _grants(self, pools: dict[str, PoolSpec], observed_at: Optional[int], report: MapReport,
                teams: Optional[dict] = None) -> None:
        st = self.state
        at = observed_at if observed_at is not None else st["inventory_at"]
        want = {f"{a}|{p}|{t}": n for (a, p, t), n in grants_of(self.cluster, pools, self.slurm.assocs(self.cluster),
                                                                 report, teams).items()}
        have = st["grants"]
        for key in sorted(set(have) | set(want)):
            old = have.get(key)
            new = want.get(key)
            if old is not None and (new is None or new != old["chips"]):
                self._pending(at, RANK_QUOTA, "quota.revoked", old["pool"], old["grant_id"] + ":revoked",
                              grant_id=old["grant_id"])
                del have[key]
            if new is not None and (old is None or new != old["chips"]):
                assoc, pool, team = key.split("|", 2)
                version = (old["version"] + 1) if old else 1
                gid = _id(self.cluster, f"assoc{assoc}", pool, f"v{version}")
                self._pending(at, RANK_QUOTA, "quota.granted", pool, gid + ":granted", grant_id=gid, team=team,
                              chips=new)
                have[key] = {"grant_id": gid, "pool": pool, "chips": new, "version": version}


    def _prices(self, pools: dict[str, PoolSpec], observed_at: Optional[int], report: MapReport,
                teams: Optional[dict[str, str]] = None) -> None:
        """Mirror the partitions' GPU billing weights as prices (Slurm billing-minutes per chip-hour) and the
        associations' GrpTRESMins as monthly budgets; a change is a new setting of the same id from now on (prices
        apply forward). A pool with a GPU-minute budget also gets a price of 60 chip-minutes per chip-hour, so its
        use is counted in the budget's unit."""
        st = self.state
        at = observed_at if observed_at is not None else st["inventory_at"]
        have_p = st.setdefault("prices", {})
        have_b = st.setdefault("budgets", {})
        budgets = budgets_of(self.cluster, pools, self.slurm.assoc_mins(self.cluster), report, teams)
        weights = billing_prices(self.cluster, pools, self.slurm.billing())
        want_p = {f"{p}|{BILLING_UNIT}": v for p, v in weights.items()}
        want_p.update({f"{p}|{CHIP_MIN_UNIT}": 60 for (_a, p, _t, unit) in budgets if unit == CHIP_MIN_UNIT})
        for key, per_chip_hour in sorted(want_p.items()):
            if have_p.get(key) != per_chip_hour:
                pool, unit = key.split("|", 1)
                pid = _id(self.cluster, "price", unit)
                self._pending(at, RANK_QUOTA, "price.set", pool, _id(self.cluster, pool, "price", unit, at),
                              price_id=pid, per_chip_hour=per_chip_hour, unit=unit)
                have_p[key] = per_chip_hour
        for (assoc, pool, team, unit), amount in sorted(budgets.items()):
            key = f"{assoc}|{pool}|{team}|{unit}"
            if have_b.get(key) != amount:
                bid = _id(self.cluster, f"assoc{assoc}", "budget", unit)
                self._pending(at, RANK_QUOTA, "budget.set", pool, _id(self.cluster, pool, bid, at), budget_id=bid,
                              team=team, period="month", amount=amount, unit=unit)
                have_b[key] = amount


def _not_in_accounting_yet(queued, runs, now: int) -> int:
    """The watermark the controller's queue allows: an instant the controller already knows (a job eligible,
    started or ended) that accounting does not show yet holds the watermark just before it (slurmctld sends its
    records to slurmdbd a moment later, more under load)."""
    by_job: dict[str, list] = {}
    for r in runs:
        by_job.setdefault(r.job_id, []).append(r)
    hold = now
    for job_id, state, eligible, start, end in queued:
        known = by_job.get(job_id, [])
        if state in OUTCOME or state in BACK_TO_QUEUE:
            if eligible is None:  # cancelled while held: accounting may never list it, and it is no demand
                continue
            if end is not None and end <= now and not any(r.end == end for r in known):
                hold = min(hold, end - 1)
        elif state in ACTIVE and start is not None and start <= now:
            if not any(r.start == start for r in known):
                hold = min(hold, start - 1)
        elif eligible is not None and eligible <= now and not any(r.eligible == eligible for r in known):
            # a job eligible (a first submission, or a requeued run's Eligible: its `job.released`) whose run
            # accounting does not list yet
            hold = min(hold, eligible - 1)
    return hold


def parse_since(text: Optional[str], cluster: str, registered_at=commands.cluster_registered_at,
                clock=time.time) -> Optional[int]:
    """`--since`: `now`, `cluster` (when the cluster registered with slurmdbd), epoch seconds or ISO 8601."""
    if text is None:
        return None
    t = text.strip().lower()
    if t == "now":
        return int(clock())
    if t == "cluster":
        at = registered_at(cluster)
        if at is None:
            raise WatchError(f"slurmdbd has no registration event for cluster {cluster!r}")
        return at
    if t.isdigit():
        return int(t)
    from datetime import datetime, timezone
    try:
        dt = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise WatchError(f"--since {text!r}: give now, cluster, epoch seconds or an ISO 8601 instant") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp())
