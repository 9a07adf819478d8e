"""`chipledger kube watch`: follow a Kubernetes cluster with Kueue and send what happens as chipledger events, once.

Resumable watches, one per kind (ResourceFlavors, Nodes, ClusterQueues, LocalQueues, Workloads, and the Pods of
Kueue's workloads for placement): list, then watch
from the list's resourceVersion with bookmarks; a `410 Gone` (the version was compacted away) lists again, and an
object the new list lacks is treated as deleted. Each object seen is read into a view (mapping.py) and compared
with the view kept in the state: the differences become events whose ids derive from the object's uid and the
transition's own time, so seeing an object again (a relist, a restart, a second watcher) makes the same ids.

Events wait in the state until their instant is at or before the *watermark* (now − `settle_s`: condition times
have one-second resolution and the watches of different kinds deliver in their own order), then go out in
(time, rank) order, with a `pool.tick` per pool at most every `tick_s` so the books close. The state file (JSON,
replaced atomically after every flush) is the cursor: per kind the resourceVersion processed, the views, the ids
sent, the events not sent yet. A watcher that dies between sending and saving sends the same events again with the
same ids and bodies: the ledger drops them as duplicates.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Optional

from chipledger.adapters import common
from chipledger.adapters.kube import mapping as m
from chipledger.adapters.kube.mapping import (RANK_CHIP, RANK_FREE, RANK_POOL, RANK_QUOTA, RANK_REGISTER, RANK_START,
                                              RANK_SUBMIT, RANK_TICK, RANK_WAIT, event_id, make_event)

STATE_VERSION = 1
KINDS = ("resourceflavors", "nodes", "clusterqueues", "localqueues", "workloads", "pods")
KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
SENT_HORIZON_S = 86_400  # ids of events this much older than the watermark are forgotten once their object is gone


class WatchError(RuntimeError):
    """A bad state file or option: says what to do."""


def _schema_fields() -> dict:
    from schemas.events import EVENT_MODELS

    return {t: set(model.model_fields) for t, model in EVENT_MODELS.items()}


JsonlSink = common.JsonlSink


class KafkaSink(common.KafkaSink):
    """Sends through LedgerProducer (validated, keyed by pool, idempotent, acks=all)."""

    error = WatchError
    retry_at = "flush"


Flushed = common.Sent


def _new_state(cluster: str) -> dict:
    return {"version": STATE_VERSION, "cluster": cluster, "rv": {}, "watermark": None, "last_tick": None,
            "sent": {}, "pending": [], "pools": {}, "flavors": {}, "nodes": {}, "cqs": {}, "grants": {}, "lqs": {},
            "jobs": {}, "unresolved": {}, "pods": {}, "placed": {}}


def load_state(path: Path, cluster: str) -> dict:
    st = common.read_state(path, cluster, STATE_VERSION, WatchError,
                           unreadable="move it away to start afresh (events already sent would be sent again with "
                                      "the same ids: the ledger drops duplicates)",
                           mismatch="give each cluster its own --state")
    if st is None:
        return _new_state(cluster)
    for k, v in _new_state(cluster).items():  # a state written before Pods were watched: they are listed afresh
        st.setdefault(k, v)
    return st


class Mapper:
    """The views kept in the state and the events their changes make (no I/O; `now` is the caller's)."""

    def __init__(self, cluster: str, state: dict, resources: Iterable[str], team_label: str = "",
                 log: Callable[[str], None] = lambda msg: None):
        self.cluster = cluster
        self.log = log
        self.source = f"{cluster}/kueue"
        self.st = state
        self.resources = tuple(resources)
        self.team_label = team_label
        self.fields = _schema_fields()

    # -- output --------------------------------------------------------------------------------------------------
    def _emit(self, at: int, rank: int, type: str, pool: str, eid: str, **fields) -> None:
        known = self.fields.get(type)
        if known is None:  # a type this contract does not have yet (job.waiting before the wave's contract)
            return
        fields = {k: v for k, v in fields.items() if k in known}
        e = make_event(at, rank, type, pool, self.source, eid, **fields)
        if eid in self.st["sent"] or any(p["body"]["event_id"] == eid for p in self.st["pending"][-64:]):
            return
        self.st["pending"].append({"at": e.at, "rank": e.rank, "body": e.body})

    def _job_emit(self, rec: dict, at: int, rank: int, type: str, what: str, **fields) -> int:
        """One job's event, never before its previous one, and after it within an instant (causal order)."""
        if type not in self.fields:  # not in this contract (job.waiting before the wave's contract): not sent
            return at
        last_at, last_rank = rec["last"]
        at = max(at, last_at)
        if at == last_at and rank <= last_rank:
            rank = last_rank + 1
        rec["last"] = [at, rank]
        if type in ("job.preempted", "job.finished"):  # the run ends: its chips are free for the next placement
            self.st["placed"] = {c: u for c, u in self.st["placed"].items() if u != rec["uid"]}
        self._emit(at, rank, type, rec["pool"], event_id(self.cluster, rec["uid"], what, at), job_id=rec["job"], **fields)
        return at

    # -- pools and chips -----------------------------------------------------------------------------------------
    def flavor(self, obj: Optional[dict], name: str, now: int) -> None:
        st = self.st
        if obj is None:
            st["flavors"].pop(name, None)  # the pool stays: its chips go with their nodes
        else:
            v = m.flavor_view(obj)
            st["flavors"][name] = v
            pool = m.pool_name(self.cluster, name)
            if pool not in st["pools"]:
                counts = Counter(sum(c for c, _ in n["view"]["chips"].values()) for n in st["nodes"].values()
                                 if m.flavor_of_node(n["view"], st["flavors"]) == name and n["view"]["chips"])
                per_node = counts.most_common(1)[0][0] if counts else 1
                at = v["created"] or now
                st["pools"][pool] = {"at": at, "flavor": name}
                self._emit(at, RANK_POOL, "pool.configured", pool, event_id(self.cluster, v["uid"], "configured"),
                           flavor=name, chips_per_node=max(1, min(per_node, 4096)))
        for name_, n in list(st["nodes"].items()):
            self._node_sync(name_, n["view"], now)
        for cq in list(st["cqs"].values()):
            self._grants_sync(cq, now)
        self._retry_unresolved(now)

    def node(self, obj: Optional[dict], name: str, now: int) -> None:
        if obj is None:
            rec = self.st["nodes"].get(name)
            if rec is not None:
                self._node_sync(name, None, now)
                self.st["nodes"].pop(name, None)
            return
        self._node_sync(name, m.node_view(obj, self.resources), now)

    def _node_sync(self, name: str, view: Optional[dict], now: int) -> None:
        st = self.st
        rec = st["nodes"].setdefault(name, {"view": view, "pool": None, "chips": {}})
        flavor = m.flavor_of_node(view, st["flavors"]) if view else None
        pool = m.pool_name(self.cluster, flavor) if flavor and view["chips"] else None
        if pool is not None and pool not in st["pools"]:
            pool = None
        old_pool, old = rec["pool"], rec["chips"]
        uid = (view or rec["view"] or {}).get("uid", name)
        new = {c: list(s) for c, s in m.chip_states(view).items()} if pool else {}
        for cid in sorted(old):
            if pool != old_pool or cid not in new:
                self._emit(now, RANK_CHIP, "chip.retired", old_pool, event_id(self.cluster, uid, cid, "retired", now),
                           chip_id=cid)
        for cid in sorted(new):
            state, reason = new[cid]
            reg_at = 0
            if pool != old_pool or cid not in old:
                # the chips of a node known from the start count from its creation (not before its pool); a chip
                # that appears later is stamped when seen
                reg_at = max(view["created"] or now, st["pools"][pool]["at"]) if old_pool is None and not old else now
                self._emit(reg_at, RANK_REGISTER, "chip.registered", pool,
                           event_id(self.cluster, uid, cid, "registered", reg_at), chip_id=cid, node=name)
                before = ["healthy", None]
            else:
                before = old[cid]
            if [state, reason] != list(before):
                # a Ready transition has its own time; a cordon or a changed allocatable is stamped when seen
                ready_change = (state == "down" and not view["ready"]) or \
                    (before[0] == "down" and str(before[1] or "").startswith("NotReady") and view["ready"])
                t = view["ready_at"] if ready_change and view["ready_at"] else now
                t = max(t, reg_at, rec.get("changed", 0))  # never before the node's previous change
                rec["changed"] = t
                self._emit(t, RANK_CHIP, "chip.state_changed", pool,
                           event_id(self.cluster, uid, cid, state, t), chip_id=cid, state=state, reason=reason)
        rec.update(view=view, pool=pool, chips=new)

    # -- quotas --------------------------------------------------------------------------------------------------
    def cluster_queue(self, obj: Optional[dict], name: str, now: int) -> None:
        st = self.st
        if obj is None:
            cq = st["cqs"].pop(name, None)
            if cq is not None:
                self._grants_sync({**cq, "quotas": {}}, now, deleted=True)
        else:
            cq = m.cq_view(obj, self.resources, self.team_label)
            st["cqs"][name] = cq
            self._grants_sync(cq, now)
        self._retry_unresolved(now)

    def _grants_sync(self, cq: dict, now: int, deleted: bool = False) -> None:
        st = self.st
        for fl in sorted(set(cq["quotas"]) | {k.split("|", 1)[1] for k in st["grants"] if k.split("|", 1)[0] == cq["uid"]}):
            key = f"{cq['uid']}|{fl}"
            old = st["grants"].get(key)
            q = cq["quotas"].get(fl)
            pool = m.pool_name(self.cluster, fl)
            if pool not in st["pools"]:
                continue
            want = None if q is None or not q["nominal"] else [q["nominal"], q["borrow"], q["lend"], cq["team"]]
            if old is not None and old["want"] == want:
                continue
            changed = cq["changed"] if cq["generation"] > 1 and cq["changed"] else (cq["created"] or now)
            at = now if deleted else max(changed, st["pools"][pool]["at"])
            if old is not None:
                self._emit(at, RANK_QUOTA, "quota.revoked", pool, old["grant_id"] + ":revoked", grant_id=old["grant_id"])
                del st["grants"][key]
            if want is not None:
                gid = event_id(self.cluster, cq["uid"], fl, f"g{cq['generation']}")
                self._emit(at, RANK_QUOTA, "quota.granted", pool, gid + ":granted", grant_id=gid, team=cq["team"],
                           chips=q["nominal"], borrowing_limit=q["borrow"], lending_limit=q["lend"])
                st["grants"][key] = {"grant_id": gid, "want": want}

    def local_queue(self, obj: Optional[dict], key: str, now: int) -> None:
        if obj is None:
            self.st["lqs"].pop(key, None)
        else:
            self.st["lqs"][key] = m.lq_view(obj)["cq"]
        self._retry_unresolved(now)

    # -- pods: placement -----------------------------------------------------------------------------------------
    def pod(self, obj: Optional[dict], uid: str, now: int) -> None:
        if obj is None:
            self.st["pods"].pop(uid, None)
            return
        v = m.pod_view(obj, self.resources)
        if v["chips"] > 0 and not v["gone"]:
            self.st["pods"][uid] = v
            if v["node"]:  # bound: the start of its job, not sent yet, gets its placement now (a short job's Pods
                # may be gone by the time the start is due)
                owners = set(v["owners"])
                for juid, rec in list(self.st["jobs"].items()):
                    if not rec.get("ignored") and rec["phase"] == "running" and owners.intersection(rec.get("owners") or ()):
                        self._place_pending(juid)
        else:
            self.st["pods"].pop(uid, None)

    def _place_pending(self, uid: str) -> None:
        """Put the placement on job `uid`'s start while that start waits to be sent (once: a start sent keeps what
        it had)."""
        rec = self.st["jobs"][uid]
        eid = event_id(self.cluster, uid, "started", rec["started"])
        for p in reversed(self.st["pending"]):
            if p["body"]["event_id"] == eid:
                if "chip_ids" not in p["body"]:
                    chips = self.placement(uid, rec["started"])
                    if chips:
                        p["body"]["chip_ids"] = chips
                return

    def placement(self, uid: str, started: int) -> Optional[list]:
        """The chips of job `uid`'s run started at `started` (mapping.place), recorded as held; None when not known
        (the job is not running that run any more, or its Pods are not all bound yet)."""
        st = self.st
        rec = st["jobs"].get(uid)
        if not rec or rec.get("ignored") or rec["phase"] != "running" or rec["started"] != started \
                or not rec.get("owners"):
            return None
        node_chips = {name: [c for c in m.chip_ids(n["view"]) if c in n["chips"]]
                      for name, n in st["nodes"].items() if n["pool"] == rec["pool"] and n["view"]}
        chips = m.place(rec["owners"], rec["chips"], started, st["pods"].values(), node_chips, st["placed"])
        if chips:
            for c in chips:
                st["placed"][c] = uid
        return chips

    # -- workloads -----------------------------------------------------------------------------------------------
    def _resolve(self, v: dict) -> Optional[tuple[str, str]]:
        """(team, pool) of a Workload: its ClusterQueue (admission's, else its LocalQueue's) and flavor (admission's,
        else the ClusterQueue's first flavor with an accelerator quota). None while something is not known yet."""
        st = self.st
        cq_name = v["cq"] or st["lqs"].get(f"{v['namespace']}/{v['queue']}")
        cq = st["cqs"].get(cq_name) if cq_name else None
        if cq is None:
            return None
        flavor = v["flavors"][0] if v["flavors"] else next(iter(cq["quotas"]), None)
        if flavor is None:
            return None
        pool = m.pool_name(self.cluster, flavor)
        if pool not in st["pools"]:
            return None
        return cq["team"], pool

    def _retry_unresolved(self, now: int) -> None:
        for uid, v in list(self.st["unresolved"].items()):
            if self._resolve(v) is not None:
                del self.st["unresolved"][uid]
                self._workload_sync(v, now)

    def workload(self, obj: Optional[dict], uid: str, now: int) -> None:
        st = self.st
        if obj is None:  # deleted
            st["unresolved"].pop(uid, None)
            rec = st["jobs"].get(uid)
            if rec is not None and not rec.get("ignored") and rec["phase"] not in ("done", "inactive"):
                self._job_emit(rec, now, RANK_FREE, "job.finished", "deleted", outcome="cancelled")
            st["jobs"].pop(uid, None)
            return
        v = m.workload_view(obj, self.resources)
        if uid in st["unresolved"] or (uid not in st["jobs"] and self._resolve(v) is None and v["chips"]):
            st["unresolved"][uid] = v
            self._retry_unresolved(now)
            return
        self._workload_sync(v, now)

    def _workload_sync(self, v: dict, now: int) -> None:
        st = self.st
        rec = st["jobs"].get(v["uid"])
        if rec is None:
            if not v["chips"]:
                st["jobs"][v["uid"]] = {"ignored": True}  # no accelerator: not the ledger's
                return
            team, pool = self._resolve(v)
            rec = {"uid": v["uid"], "job": f"{v['namespace']}/{v['name']}", "pool": pool, "team": team,
                   "phase": "pending", "started": None, "evicted": None, "waiting": "", "last": [0, 0],
                   "owners": v["owners"], "chips": v["chips"]}
            st["jobs"][v["uid"]] = rec
            at = max(v["created"] or now, st["pools"][pool]["at"])
            self._submit(rec, v, at, "submitted")
            if sum(v["evictions"].values()) and (v["conds"].get("Admitted") or [""])[0] == "True" \
                    and (v["conds"].get("Finished") or [""])[0] != "True":
                # a first look at a Workload evicted before: Kueue keeps the count (schedulingStats), not the times
                self.log(f"{rec['job']}: first seen admitted after {sum(v['evictions'].values())} earlier "
                         f"eviction(s) {json.dumps(v['evictions'], sort_keys=True)}: booked from its last admission")
        if rec.get("ignored") or rec["phase"] == "done":
            return
        if rec["phase"] == "inactive":  # cancelled when deactivated while pending: submitted again once active
            if not v["active"] or v["deleted"] is not None or (v["conds"].get("Finished") or [""])[0] == "True":
                return
            self._submit(rec, v, now, "resubmitted")
            rec.update(phase="pending", waiting="", started=None, evicted=None)
        c = v["conds"]
        adm, fin, ev, rq = c.get("Admitted"), c.get("Finished"), c.get("Evicted"), c.get("Requeued")
        admitted = bool(adm and adm[0] == "True")
        finished = bool(fin and fin[0] == "True")
        evicted = bool(ev and ev[0] == "True")
        ta = adm[1] if adm and adm[1] else now
        started = rec["started"]
        # Kueue evicts in two writes: Evicted=True (Admitted still True), then Admitted=False; a Workload admitted
        # again since the start booked was evicted in between (a relist missed it: Requeued keeps that eviction)
        if rec["phase"] == "running" and not finished and (
                (evicted and ev[1] is not None and ev[1] >= started) or not admitted or ta > started):
            if evicted and ev[1] is not None and ev[1] >= started:
                te, reason, message = ev[1], ev[2], ev[3]
            elif rq and rq[1] is not None and started <= rq[1] <= ta:
                te, reason, message = rq[1], rq[2], rq[3]
            else:
                te = ta if admitted else (adm[1] if adm and adm[1] else now)
                reason, message = (ev[2] if ev else ""), ""
            pre = c.get("Preempted")
            kueue_reason = pre[2] if pre and pre[0] == "True" and reason == m.PREEMPTION_REASON and pre[2] else reason
            decision = m.decision_in(message)
            if decision is None and v["decision"]:
                did, _, at_s = v["decision"].rpartition("@")
                if did and at_s.isdigit() and te >= int(at_s) - 1:
                    decision = did
            held = not v["active"]  # deactivated: not demand until it is active again
            rec["evicted"] = self._job_emit(rec, te, RANK_FREE, "job.preempted", "preempted", decision_id=decision,
                                            cause=m.cause_of(reason, decision), reason=(kueue_reason or None),
                                            held=True if held else None)
            rec["phase"] = "held" if held else "pending"
            rec["waiting"] = ""
        # back in the queue when Kueue says so: Requeued=True (reason Reactivated) at or after the eviction, at its
        # time (spec.active=true alone is the admin's write, seen a moment before or after Kueue's); or admitted
        # afresh (Admitted stays True for a moment while Kueue evicts: not a readmission while Evicted is True)
        requeued = bool(rq and rq[0] == "True" and rq[1] is not None and rq[1] >= (rec["evicted"] or 0))
        if rec["phase"] == "held" and ((v["active"] and requeued) or (admitted and not evicted)):
            t = rq[1] if requeued else ta
            if admitted and not evicted:
                t = min(t, ta)
            self._job_emit(rec, t, RANK_SUBMIT, "job.released", "released")
            rec["phase"] = "pending"
        # deactivated while pending (never admitted since): Kueue takes it out of its queue (Evicted=True, reason
        # Deactivated) and it is no demand; the contract holds only a running job (job.preempted with held), so it
        # is cancelled at that instant and submitted again when it is active again (docs/kube.md)
        if rec["phase"] == "pending" and not v["active"] and not finished and v["deleted"] is None \
                and not (admitted and not evicted):
            te = ev[1] if evicted and ev[2] == "Deactivated" and ev[1] is not None else now
            self._job_emit(rec, te, RANK_FREE, "job.finished", "deactivated", outcome="cancelled")
            rec["phase"] = "inactive"
            return
        if finished:
            outcome = "succeeded" if fin[2] == "Succeeded" else "failed"
            if rec["phase"] == "pending" and admitted and (started is None or ta > started) and ta <= (fin[1] or now):
                self._start(rec, ta)  # admitted and finished between two looks: it ran
            self._job_emit(rec, fin[1] or now, RANK_FREE, "job.finished", "finished", outcome=outcome)
            rec["phase"] = "done"
            return
        if v["deleted"] is not None:
            self._job_emit(rec, v["deleted"], RANK_FREE, "job.finished", "deleted", outcome="cancelled")
            rec["phase"] = "done"
            return
        # admitted again after an eviction (Evicted is False again only then), or for the first time
        fresh = admitted and not evicted and (started is None or ta > started or rec["evicted"] is not None)
        if rec["phase"] == "pending" and fresh:
            self._start(rec, ta)
        elif rec["phase"] == "pending":
            qr = c.get("QuotaReserved")
            # Kueue's pending reason, once per transition of QuotaReserved to False (at its time: the message
            # alone changes as others come and go, e.g. "3 more needed" → "1 more needed": not a new event)
            if qr and qr[0] == "False" and qr[1] is not None and (qr[2] or qr[3]):
                key = f"{qr[1]}:{qr[2]}"
                if key != rec["waiting"]:
                    rec["waiting"] = key
                    self._job_emit(rec, qr[1], RANK_WAIT, "job.waiting", f"waiting:{m.message_key(key)}",
                                   reason=(qr[2] or "Pending")[:64], message=qr[3][:1024] or None)

    def _submit(self, rec: dict, v: dict, at: int, what: str) -> None:
        self._job_emit(rec, at, RANK_SUBMIT, "job.submitted", what, team=rec["team"], chips=v["chips"],
                       priority=max(-2**31, min(2**31 - 1, v["priority"])), preemptible=True,
                       chips_per_node=v["chips_per_node"], namespace=v["namespace"] or None)

    def _start(self, rec: dict, ta: int) -> None:
        rec["started"] = self._job_emit(rec, ta, RANK_START, "job.started", "started")
        rec["phase"] = "running"
        rec["evicted"] = None
        self._place_pending(rec["uid"])  # (its Pods may have been seen bound before the admission)


class Watcher(common.ClusterState):
    """Feeds a Mapper from the API server's watches and flushes what is due to the sink (see the module's doc)."""

    def __init__(self, cluster: str, state_path: Path, sink, api=None, *, resources: Iterable[str] = m.DEFAULT_RESOURCES,
                 team_label: str = "", settle_s: int = 5, tick_s: int = 30, clock: Callable[[], float] = time.time,
                 log: Callable[[str], None] = lambda msg: None, metrics=None):
        super().__init__(cluster, state_path, lambda path: load_state(path, cluster), clock=clock, log=log)
        self.sink = sink
        self.api = api
        self.settle_s = settle_s
        self.tick_s = tick_s
        self.metrics = metrics
        self.mapper = Mapper(cluster, self.state, resources, team_label, log)
        self.source = self.mapper.source

    # -- input ---------------------------------------------------------------------------------------------------
    def observe(self, kind: str, obj: Optional[dict], key: str, now: Optional[int] = None) -> None:
        now = int(self.clock()) if now is None else now
        mp = self.mapper
        {"resourceflavors": mp.flavor, "nodes": mp.node, "clusterqueues": mp.cluster_queue,
         "localqueues": mp.local_queue, "workloads": mp.workload, "pods": mp.pod}[kind](obj, key, now)
        if self.metrics:
            self.metrics.seen(kind, now)

    def listed(self, kind: str, items: list, rv: str, now: Optional[int] = None) -> None:
        """A full list: every object observed, every object known but absent deleted, and the cursor moved."""
        now = int(self.clock()) if now is None else now
        present = set()
        for obj in sorted(items, key=lambda o: o["metadata"].get("creationTimestamp") or ""):
            k = key_of(kind, obj)
            present.add(k)
            self.observe(kind, obj, k, now)
        for k in sorted(set(self.known(kind)) - present):
            self.observe(kind, None, k, now)
        self.state["rv"][kind] = rv

    def known(self, kind: str) -> list[str]:
        st = self.state
        if kind == "workloads":
            return [u for u, r in st["jobs"].items()] + list(st["unresolved"])
        if kind == "pods":
            return list(st["pods"])
        return list({"resourceflavors": st["flavors"], "nodes": st["nodes"], "clusterqueues": st["cqs"],
                     "localqueues": st["lqs"]}[kind])

    # -- output --------------------------------------------------------------------------------------------------
    def flush(self, final: bool = False) -> Flushed:
        st = self.state
        now = int(self.clock())
        watermark = now - self.settle_s
        prev = st["watermark"]
        if prev is not None and watermark < prev:
            watermark = prev
        res = Flushed(watermark=watermark)
        due = sorted((p for p in st["pending"] if p["at"] <= watermark),
                     key=lambda p: (p["at"], p["rank"], p["body"]["pool"], p["body"]["event_id"]))
        unplaced = 0
        for p in due:
            b = p["body"]
            if b["type"] == "job.started" and "chip_ids" not in b:
                chips = self.mapper.placement(b["event_id"].split(":")[2], p["at"])
                if chips:
                    b["chip_ids"] = chips
                else:
                    unplaced += 1
            if prev is not None and p["at"] < prev:
                res.late += 1
                self.log(f"late: {p['body']['type']} {p['body'].get('job_id') or p['body'].get('chip_id') or ''} at "
                         f"{m.iso(p['at'])}, {prev - p['at']} s behind the watermark sent before")
            self.sink.send(p["body"])
            st["sent"][p["body"]["event_id"]] = p["at"]
            res.by_type[p["body"]["type"]] += 1
        if unplaced:
            self.log(f"{unplaced} start(s) sent without placement (their Pods not bound, or gone, when seen)")
        ids = {p["body"]["event_id"] for p in due}
        st["pending"] = [p for p in st["pending"] if p["body"]["event_id"] not in ids]
        if st["pools"] and (final or st["last_tick"] is None or watermark - st["last_tick"] >= self.tick_s) \
                and watermark != st["last_tick"]:
            for pool in sorted(st["pools"]):
                if st["pools"][pool]["at"] <= watermark:
                    self.sink.send(make_event(watermark, RANK_TICK, "pool.tick", pool, self.source,
                                              event_id(self.cluster, pool, "tick", watermark)).body)
                    res.by_type["pool.tick"] += 1
            st["last_tick"] = watermark
        self.sink.flush()
        res.sent = sum(res.by_type.values())
        st["watermark"] = watermark
        live = {r["uid"] for r in st["jobs"].values() if not r.get("ignored")}
        horizon = watermark - SENT_HORIZON_S
        st["sent"] = {k: t for k, t in st["sent"].items() if t >= horizon or k.split(":")[2] in live}
        self.save()
        if self.metrics:
            self.metrics.flushed(res, now)
        return res

    # -- the loop ------------------------------------------------------------------------------------------------
    def run(self, *, once: bool = False, interval_s: float = 1.0, stop: Optional[threading.Event] = None,
            watch_timeout_s: int = 60) -> None:
        """List (or resume) every kind, then follow the watches until `stop` is set; flush every `interval_s`.
        `once`: list every kind, flush, return (the cursor is saved: the next run watches from there)."""
        if once:
            for kind in KINDS:
                items, rv = self.api.list(kind)
                self.listed(kind, items, rv)
            self.flush()
            return
        stop = stop or threading.Event()
        q: queue.Queue = queue.Queue(maxsize=10_000)
        threads = [threading.Thread(target=self._follow, args=(kind, q, stop, watch_timeout_s), daemon=True,
                                    name=f"kube-watch-{kind}") for kind in KINDS]
        for t in threads:
            t.start()
        next_flush = time.monotonic() + interval_s
        try:
            while not stop.is_set():
                try:
                    item = q.get(timeout=max(0.0, next_flush - time.monotonic()))
                except queue.Empty:
                    item = None
                if item is not None:
                    self._apply(item)
                if time.monotonic() >= next_flush and all(k in self.state["rv"] for k in KINDS):
                    # (not before every kind was listed: the watermark would pass what the others still hold)
                    res = self.flush()
                    if res.sent:
                        self.log(f"sent {res.sent} {json.dumps(dict(res.by_type), sort_keys=True)}"
                                 + (f", late {res.late}" if res.late else ""))
                    next_flush = time.monotonic() + interval_s
        finally:
            stop.set()
            while True:  # what the threads delivered before they stopped is processed and saved
                try:
                    self._apply(q.get_nowait())
                except queue.Empty:
                    break
            if all(k in self.state["rv"] for k in KINDS):
                self.flush()
            for t in threads:
                t.join(timeout=5)

    def _apply(self, item) -> None:
        what, kind = item[0], item[1]
        if what == "list":
            self.listed(kind, item[2], item[3])
        elif what == "event":
            etype, obj, rv = item[2], item[3], item[4]
            self.observe(kind, None if etype == "DELETED" else obj, key_of(kind, obj))
            self.state["rv"][kind] = rv
        elif what == "bookmark":
            self.state["rv"][kind] = item[2]
        elif what == "relist":
            if self.metrics:
                self.metrics.relisted(kind)
            self.log(f"{kind}: {item[2]}: listing again")

    def _follow(self, kind: str, q: queue.Queue, stop: threading.Event, timeout_s: int) -> None:
        """One kind's list-then-watch loop (a thread): what it sees goes through `q` to the main thread, which alone
        touches the state; a 410 lists again."""
        from kubernetes.client.exceptions import ApiException

        rv = self.state["rv"].get(kind)
        while not stop.is_set():
            try:
                if rv is None:
                    items, rv = self.api.list(kind)
                    q.put(("list", kind, items, rv))
                for etype, obj in self.api.watch(kind, rv, timeout_s, stop):
                    if stop.is_set():
                        return
                    new_rv = obj.get("metadata", {}).get("resourceVersion") or rv
                    if etype == "BOOKMARK":
                        q.put(("bookmark", kind, new_rv))
                    elif etype in ("ADDED", "MODIFIED", "DELETED"):
                        q.put(("event", kind, etype, obj, new_rv))
                    rv = new_rv
            except ApiException as e:
                if e.status == 410:
                    q.put(("relist", kind, f"410 Gone ({e.reason})"))
                    rv = None
                    continue
                if self.metrics:
                    self.metrics.error(kind)
                self.log(f"{kind}: watch failed ({e.status} {e.reason}); retrying in 2 s")
                stop.wait(2)
            except Exception as e:  # noqa: BLE001 - a dropped connection: resume from the last version seen
                if stop.is_set():
                    return
                if self.metrics:
                    self.metrics.error(kind)
                self.log(f"{kind}: watch interrupted ({e!r}); resuming from {rv}")
                stop.wait(1)


def key_of(kind: str, obj: dict) -> str:
    md = obj["metadata"]
    if kind in ("workloads", "pods"):
        return md["uid"]
    if kind == "localqueues":
        return f"{md['namespace']}/{md['name']}"
    return md["name"]


class KubeApi:
    """The reads the watcher makes, through the official client (raw JSON: no model conversion)."""

    def __init__(self, api_client):
        from kubernetes import client

        self.client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    def _fn(self, kind: str):
        if kind == "nodes":
            return self.core.list_node, {}
        if kind == "pods":  # only the Pods of Kueue's workloads (Kueue labels them with their pod set)
            return self.core.list_pod_for_all_namespaces, {"label_selector": m.POD_SELECTOR}
        return self.custom.list_cluster_custom_object, {"group": KUEUE_GROUP, "version": KUEUE_VERSION, "plural": kind}

    def list(self, kind: str) -> tuple[list, str]:
        fn, kw = self._fn(kind)
        resp = fn(_preload_content=False, **kw)
        data = json.loads(resp.data)
        return data.get("items") or [], data["metadata"]["resourceVersion"]

    def watch(self, kind: str, rv: str, timeout_s: int, stop: threading.Event):
        from kubernetes import watch

        fn, kw = self._fn(kind)
        w = watch.Watch()
        # (the client raises ApiException(410) on an ERROR event with code 410 when a timeout is given)
        for ev in w.stream(fn, resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=timeout_s, **kw):
            if stop.is_set():
                w.stop()
                return
            yield ev.get("type"), ev.get("raw_object") or {}


class WatchMetrics:
    """The watcher's health on /metrics (prometheus_client, its own registry)."""

    def __init__(self, registry=None):
        from prometheus_client import CollectorRegistry, Counter as PCounter, Gauge

        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.last_event = Gauge("chipledger_kube_watch_last_event_timestamp_seconds",
                                "when the last watch event or list of each kind was processed", ["kind"], registry=r)
        self.relists = PCounter("chipledger_kube_watch_relists_total", "lists after a 410 Gone", ["kind"], registry=r)
        self.errors = PCounter("chipledger_kube_watch_errors_total", "watch failures (retried)", ["kind"], registry=r)
        self.sent = PCounter("chipledger_kube_watch_events_sent_total", "events sent", ["type"], registry=r)
        self.late = PCounter("chipledger_kube_watch_late_events_total", "events sent behind the watermark", registry=r)
        self.lag = Gauge("chipledger_kube_watch_lag_seconds", "wall clock minus the watermark at the last flush",
                         registry=r)
        self.last_flush = Gauge("chipledger_kube_watch_last_flush_timestamp_seconds", "when events were last flushed",
                                registry=r)

    def seen(self, kind: str, now: int) -> None:
        self.last_event.labels(kind).set(now)

    def relisted(self, kind: str) -> None:
        self.relists.labels(kind).inc()

    def error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def flushed(self, res: Flushed, now: int) -> None:
        for t, n in res.by_type.items():
            self.sent.labels(t).inc(n)
        self.late.inc(res.late)
        self.lag.set(now - res.watermark)
        self.last_flush.set(now)

    def serve(self, port: int, addr: str = "127.0.0.1"):
        from prometheus_client import start_http_server

        return start_http_server(port, addr=addr, registry=self.registry)
