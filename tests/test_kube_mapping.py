"""The Kubernetes mapping without a cluster (chipledger/adapters/kube/mapping.py and the watcher's Mapper): objects as
the API server returns them (conditions as Kueue v0.17 writes them, captured from the live tests) → events."""

from __future__ import annotations

import json
from pathlib import Path

from chipledger.adapters.kube import mapping as m
from chipledger.adapters.kube.watch import Mapper, Watcher, _new_state

T0 = 1_796_439_960  # a whole minute; times below are offsets from it


def ts(dt: int) -> str:
    return m.iso(T0 + dt)


def flavor(name="gpu", labels=None):
    return {"metadata": {"name": name, "uid": f"uid-{name}", "creationTimestamp": ts(0)},
            "spec": {"nodeLabels": labels or {"pool": "x"}}}


def node(name="n0", gpus=8, ready=True, cordoned=False, allocatable=None, ready_at=1):
    return {"metadata": {"name": name, "uid": f"uid-{name}", "creationTimestamp": ts(1), "labels": {"pool": "x"}},
            "spec": {"unschedulable": cordoned},
            "status": {"capacity": {"nvidia.com/gpu": str(gpus)},
                       "allocatable": {"nvidia.com/gpu": str(gpus if allocatable is None else allocatable)},
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                       "reason": "KubeletReady" if ready else "KubeletDown",
                                       "lastTransitionTime": ts(ready_at)}]}}


def cq(name="team-a", nominal="8", gen=1, borrow=None):
    res = {"name": "nvidia.com/gpu", "nominalQuota": nominal}
    if borrow is not None:
        res["borrowingLimit"] = borrow
    return {"metadata": {"name": name, "uid": f"uid-{name}", "generation": gen, "creationTimestamp": ts(2),
                         "managedFields": [{"time": ts(2 + 10 * (gen - 1)), "operation": "Update"}]},
            "spec": {"cohortName": "org", "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
                {"name": "gpu", "resources": [res]}]}]}}


def lq(ns="ns-a", name="lq", cq_name="team-a"):
    return {"metadata": {"name": name, "namespace": ns}, "spec": {"clusterQueue": cq_name}}


def wl(conds=(), uid="w1", gpus=2, count=1, active=True, annotations=None, admitted_to="team-a"):
    c = [{"type": t, "status": s, "lastTransitionTime": ts(at), "reason": r, "message": msg}
         for t, s, at, r, msg in conds]
    status = {"conditions": c}
    if any(t == "Admitted" and s == "True" for t, s, *_ in conds):
        status["admission"] = {"clusterQueue": admitted_to,
                               "podSetAssignments": [{"name": "main", "flavors": {"nvidia.com/gpu": "gpu"}}]}
    return {"metadata": {"name": "job-x-1", "namespace": "ns-a", "uid": uid, "creationTimestamp": ts(5),
                         "annotations": annotations or {}},
            "spec": {"queueName": "lq", "priority": 10, "active": active, "podSets": [{"name": "main", "count": count,
                     "template": {"spec": {"containers": [{"name": "m", "resources": {
                         "requests": {"nvidia.com/gpu": str(gpus)}}}]}}}]},
            "status": status}


def setup():
    st = _new_state("c1")
    mp = Mapper("c1", st, m.DEFAULT_RESOURCES)
    mp.flavor(flavor(), "gpu", T0)
    mp.node(node(), "n0", T0)
    mp.cluster_queue(cq(), "team-a", T0)
    mp.local_queue(lq(), "ns-a/lq", T0)
    return st, mp


def bodies(st):
    return [p["body"] for p in sorted(st["pending"], key=lambda p: (p["at"], p["rank"]))]


def jobs(st):
    return [(b["type"], b["occurred_at"][-3:-1]) for b in bodies(st) if b["type"].startswith("job.")]


ADMITTED = [("QuotaReserved", "True", 6, "QuotaReserved", ""), ("Admitted", "True", 6, "Admitted", "")]


def test_inventory_and_quota():
    st, _ = setup()
    types = [b["type"] for b in bodies(st)]
    assert types == ["pool.configured"] + ["chip.registered"] * 8 + ["quota.granted"]
    p = bodies(st)[0]
    assert p["pool"] == "c1/gpu" and p["flavor"] == "gpu" and p["source"] == "c1/kueue"
    g = bodies(st)[-1]
    assert g["team"] == "team-a" and g["chips"] == 8 and "borrowing_limit" not in g
    assert bodies(st)[1]["chip_id"] == "n0-gpu0" and bodies(st)[1]["node"] == "n0"


def test_a_quota_change_is_a_revoke_and_a_grant():
    st, mp = setup()
    mp.cluster_queue(cq(nominal="4", gen=2, borrow="2"), "team-a", T0 + 20)
    revoke, grant = bodies(st)[-2:]
    assert revoke["type"] == "quota.revoked" and revoke["grant_id"] == bodies(st)[-3]["grant_id"]
    assert grant["chips"] == 4 and grant["borrowing_limit"] == 2 and grant["occurred_at"] == ts(12)


def test_node_states():
    st, mp = setup()
    mp.node(node(ready=False, ready_at=30), "n0", T0 + 31)
    downs = [b for b in bodies(st) if b["type"] == "chip.state_changed"]
    assert len(downs) == 8 and {b["state"] for b in downs} == {"down"}
    assert downs[0]["reason"] == "NotReady: KubeletDown" and downs[0]["occurred_at"] == ts(30)
    st["pending"].clear()
    mp.node(node(ready=True, ready_at=35, cordoned=True), "n0", T0 + 36)
    assert {b["state"] for b in bodies(st)} == {"maintenance"}
    st["pending"].clear()
    mp.node(node(allocatable=6, ready_at=35), "n0", T0 + 40)
    got = {b["chip_id"]: b["state"] for b in bodies(st)}
    assert got["n0-gpu7"] == "down" and got["n0-gpu6"] == "down" and got["n0-gpu0"] == "healthy"
    st["pending"].clear()
    mp.node(None, "n0", T0 + 50)
    assert [b["type"] for b in bodies(st)] == ["chip.retired"] * 8


def test_kueues_preemption_then_readmission():
    st, mp = setup()
    st["pending"].clear()
    mp.workload(wl(), "w1", T0 + 5)
    mp.workload(wl(ADMITTED), "w1", T0 + 6)
    # Kueue evicts in two writes: Evicted=True while Admitted is still True, then Admitted=False
    ev = ("Evicted", "True", 9, "Preempted", "Preempted to accommodate a workload …")
    pre = ("Preempted", "True", 9, "InCohortReclamation", "…")
    mp.workload(wl(ADMITTED + [ev, pre]), "w1", T0 + 9)
    mp.workload(wl([("QuotaReserved", "False", 9, "Pending", "couldn't assign flavors"),
                    ("Admitted", "False", 9, "NoReservation", ""), ev, pre,
                    ("Requeued", "True", 9, "Preempted", "…")]), "w1", T0 + 9)
    mp.workload(wl([("QuotaReserved", "True", 12, "QuotaReserved", ""), ("Admitted", "True", 12, "Admitted", ""),
                    ("Evicted", "False", 12, "QuotaReserved", "Previously: …"),
                    ("Finished", "True", 15, "Succeeded", "")]), "w1", T0 + 15)
    assert jobs(st) == [("job.submitted", "05"), ("job.started", "06"), ("job.preempted", "09"),
                        ("job.waiting", "09"), ("job.started", "12"), ("job.finished", "15")]
    b = {x["type"]: x for x in bodies(st)}
    assert b["job.preempted"]["reason"] == "InCohortReclamation" and b["job.preempted"]["cause"] == "preempted"
    assert b["job.submitted"]["job_id"] == "ns-a/job-x-1" and b["job.submitted"]["namespace"] == "ns-a"
    assert b["job.submitted"]["priority"] == 10 and b["job.submitted"]["chips"] == 2
    assert b["job.waiting"]["reason"] == "Pending" and b["job.waiting"]["message"] == "couldn't assign flavors"


def test_a_relist_that_missed_the_eviction_uses_requeued():
    st, mp = setup()
    mp.workload(wl(ADMITTED), "w1", T0 + 6)
    mp.workload(wl([("Admitted", "True", 12, "Admitted", ""), ("Evicted", "False", 12, "QuotaReserved", ""),
                    ("Requeued", "True", 9, "Preempted", "chipledger decision d-1: reclaim for x")]), "w1", T0 + 13)
    assert jobs(st)[1:] == [("job.started", "06"), ("job.preempted", "09"), ("job.started", "12")]
    pre = [x for x in bodies(st) if x["type"] == "job.preempted"][0]
    assert pre["decision_id"] == "d-1" and pre["cause"] == "preempted"


def test_deactivation_is_a_requeue_held_until_reactivated():
    st, mp = setup()
    mp.workload(wl(ADMITTED), "w1", T0 + 6)
    ev = ("Evicted", "True", 9, "Deactivated", "The workload is deactivated")
    mp.workload(wl(ADMITTED + [ev], active=False), "w1", T0 + 9)
    # the admin's spec.active=true, seen before Kueue's Requeued=True (Reactivated): not released yet
    mp.workload(wl([("Admitted", "False", 9, "NoReservation", ""), ev, ("Requeued", "False", 9, "Deactivated", "")]),
                "w1", T0 + 15)
    assert [t for t, _ in jobs(st)][-1] == "job.preempted"
    mp.workload(wl([("Admitted", "False", 9, "NoReservation", ""), ev,
                    ("Requeued", "True", 14, "Reactivated", "")]), "w1", T0 + 14)
    assert jobs(st)[1:] == [("job.started", "06"), ("job.preempted", "09"), ("job.released", "14")]
    pre = [x for x in bodies(st) if x["type"] == "job.preempted"][0]
    assert pre["cause"] == "requeued" and pre["held"] is True and pre["reason"] == "Deactivated"


def test_the_actuators_eviction_carries_the_decision():
    st, mp = setup()
    mp.workload(wl(ADMITTED), "w1", T0 + 6)
    ev = ("Evicted", "True", 9, "Preempted", "chipledger decision kube:c1:c1/gpu:tick:179:reclaim:ns/j: reclaim")
    mp.workload(wl(ADMITTED + [ev]), "w1", T0 + 9)
    pre = [x for x in bodies(st) if x["type"] == "job.preempted"][0]
    assert pre["decision_id"] == "kube:c1:c1/gpu:tick:179:reclaim:ns/j" and pre["cause"] == "preempted"
    assert pre["reason"] == "Preempted"


def test_failure_cancel_and_no_accelerator():
    st, mp = setup()
    mp.workload(wl(ADMITTED + [("Finished", "True", 8, "Failed", "deadline")]), "w1", T0 + 8)
    mp.workload(wl(uid="w2"), "w2", T0 + 9)
    mp.workload(None, "w2", T0 + 11)
    mp.workload(wl(uid="w3", gpus=0), "w3", T0 + 9)
    out = [(b["type"], b.get("outcome")) for b in bodies(st) if b["type"] in ("job.finished",)]
    assert out == [("job.finished", "failed"), ("job.finished", "cancelled")]
    assert st["jobs"]["w3"] == {"ignored": True}


def test_a_workload_before_its_queue_waits_until_it_is_known():
    st = _new_state("c1")
    mp = Mapper("c1", st, m.DEFAULT_RESOURCES)
    mp.workload(wl(), "w1", T0 + 5)
    assert not bodies(st) and "w1" in st["unresolved"]
    mp.flavor(flavor(), "gpu", T0 + 6)
    mp.cluster_queue(cq(), "team-a", T0 + 6)
    mp.local_queue(lq(), "ns-a/lq", T0 + 6)
    assert "w1" not in st["unresolved"] and [b["type"] for b in bodies(st)][-1] == "job.submitted"


class ListSink:
    def __init__(self):
        self.events = []

    def send(self, body):
        self.events.append(body)

    def flush(self):
        pass


def test_flush_waits_for_the_watermark_and_a_relist_sends_nothing_twice(tmp_path: Path):
    sink = ListSink()
    now = [T0 + 20]
    w = Watcher("c1", tmp_path / "s.json", sink, settle_s=5, tick_s=30, clock=lambda: now[0])
    items = {"resourceflavors": [flavor()], "nodes": [node()], "clusterqueues": [cq()], "localqueues": [lq()],
             "workloads": [wl(ADMITTED + [("Finished", "True", 18, "Succeeded", "")])]}
    for kind, objs in items.items():
        w.listed(kind, objs, "10")
    res = w.flush()
    assert res.watermark == T0 + 15 and "job.finished" not in res.by_type and res.by_type["pool.tick"] == 1
    now[0] = T0 + 30
    w.flush()
    assert [e["type"] for e in sink.events if e["type"].startswith("job.")] == ["job.submitted", "job.started",
                                                                                "job.finished"]
    n = len(sink.events)
    w2 = Watcher("c1", tmp_path / "s.json", sink, settle_s=5, tick_s=30, clock=lambda: now[0])  # restarted
    for kind, objs in items.items():
        w2.listed(kind, objs, "11")
    w2.flush()
    assert len(sink.events) == n  # nothing new (not even a tick: the watermark did not move)
    assert json.loads((tmp_path / "s.json").read_text())["rv"]["workloads"] == "11"
    items["workloads"] = []
    w2.listed("workloads", [], "12")  # the Workload deleted after it finished: nothing to send
    assert not w2.state["pending"] and not w2.state["jobs"]


def test_events_validate_against_the_contract():
    from schemas.parse import parse_event

    st, mp = setup()
    mp.workload(wl(ADMITTED), "w1", T0 + 6)
    mp.node(node(ready=False, ready_at=30), "n0", T0 + 31)
    for b in bodies(st):
        parse_event(json.dumps(b))
