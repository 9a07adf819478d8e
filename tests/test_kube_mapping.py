"""The Kubernetes mapping without a cluster (chipledger/adapters/kube/mapping.py and the watcher's Mapper): objects as
the API server returns them (conditions as Kueue v0.17 writes them, captured from the live tests) → events."""

from __future__ import annotations

import json
from pathlib import Path

from chipledger.adapters.kube import mapping as m
from chipledger.adapters.kube.watch import Mapper, Watcher, _new_state

from tests.adapter_support import ListSink

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


def cq(name="team-a", nominal="8", gen=1, borrow=None, cohort="org"):
    res = {"name": "nvidia.com/gpu", "nominalQuota": nominal}
    if borrow is not None:
        res["borrowingLimit"] = borrow
    return {"metadata": {"name": name, "uid": f"uid-{name}", "generation": gen, "creationTimestamp": ts(2),
                         "managedFields": [{"time": ts(2 + 10 * (gen - 1)), "operation": "Update"}]},
            "spec": {"cohortName": cohort, "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
                {"name": "gpu", "resources": [res]}]}]}}


def lq(ns="ns-a", name="lq", cq_name="team-a"):
    return {"metadata": {"name": name, "namespace": ns}, "spec": {"clusterQueue": cq_name}}


def wl(conds=(), uid="w1", gpus=2, count=1, active=True, annotations=None, admitted_to="team-a", stats=None):
    c = [{"type": t, "status": s, "lastTransitionTime": ts(at), "reason": r, "message": msg}
         for t, s, at, r, msg in conds]
    status = {"conditions": c}
    if stats:
        status["schedulingStats"] = {"evictions": [{"reason": r, "underlyingCause": "", "count": n}
                                                   for r, n in stats.items()]}
    if any(t == "Admitted" and s == "True" for t, s, *_ in conds):
        status["admission"] = {"clusterQueue": admitted_to,
                               "podSetAssignments": [{"name": "main", "flavors": {"nvidia.com/gpu": "gpu"}}]}
    return {"metadata": {"name": "job-x-1", "namespace": "ns-a", "uid": uid, "creationTimestamp": ts(5),
                         "annotations": annotations or {},
                         "ownerReferences": [{"kind": "Job", "name": "x", "uid": f"job-{uid}", "controller": True}]},
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
    assert g["team"] == "org/team-a" and g["chips"] == 8  # in a cohort: <cohort>/<ClusterQueue> and "borrowing_limit" not in g
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


def pod(name, node_name, gpus=2, owner="job-w1", created=6, phase="Running"):
    return {"metadata": {"name": name, "uid": f"uid-{name}", "creationTimestamp": ts(created),
                         "labels": {m.POD_SELECTOR: "main"},
                         "ownerReferences": [{"kind": "Job", "uid": owner, "controller": True}]},
            "spec": {"nodeName": node_name, "containers": [{"name": "m", "resources": {
                "requests": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": phase}}


def test_a_cohort_is_the_teams_org_and_a_new_cohort_is_a_revoke_and_a_grant():
    st, mp = setup()
    assert [b["team"] for b in bodies(st) if b["type"] == "quota.granted"] == ["org/team-a"]
    mp.cluster_queue(cq(gen=2, cohort="org2"), "team-a", T0 + 20)
    revoke, grant = bodies(st)[-2:]
    assert revoke["type"] == "quota.revoked" and grant["type"] == "quota.granted" and grant["team"] == "org2/team-a"
    mp.cluster_queue(cq(name="solo", cohort=""), "solo", T0 + 20)
    assert st["pending"][-1]["body"]["team"] == "solo"  # no cohort: the ClusterQueue's name alone
    mp.workload(wl(), "w1", T0 + 5)
    assert [b for b in bodies(st) if b["type"] == "job.submitted"][0]["team"] == "org2/team-a"


def test_placement_from_the_pods_nodes(tmp_path: Path):
    sink = ListSink()
    now = [T0 + 20]
    w = Watcher("c1", tmp_path / "s.json", sink, settle_s=5, clock=lambda: now[0])
    items = {"resourceflavors": [flavor()], "nodes": [node("n0"), node("n1")], "clusterqueues": [cq()],
             "localqueues": [lq()],
             "workloads": [wl(ADMITTED, gpus=2, count=2), wl(ADMITTED, uid="w2", gpus=3)],
             # w1's two Pods: one on each Node; w2's Pod on n0 takes the chips after w1's there; a Pod of an
             # earlier run (created before the admission) does not count
             "pods": [pod("p1", "n0"), pod("p2", "n1"), pod("q1", "n0", gpus=3, owner="job-w2"),
                      pod("old", "n1", created=2)]}
    for kind, objs in items.items():
        w.listed(kind, objs, "10")
    w.flush()
    (s1,) = [e for e in sink.events if e["type"] == "job.started" and e["event_id"].split(":")[2] == "w1"]
    (s2,) = [e for e in sink.events if e["type"] == "job.started" and e["event_id"].split(":")[2] == "w2"]
    assert sorted(s1["chip_ids"]) == ["n0-gpu0", "n0-gpu1", "n1-gpu0", "n1-gpu1"]
    assert s2["chip_ids"] == ["n0-gpu2", "n0-gpu3", "n0-gpu4"]
    # w1 finishes: its chips are free for the next placement
    w.observe("workloads", wl(ADMITTED + [("Finished", "True", 21, "Succeeded", "")], gpus=2, count=2), "w1", T0 + 22)
    assert set(w.state["placed"]) == {"n0-gpu2", "n0-gpu3", "n0-gpu4"}
    from schemas.parse import parse_event
    for e in sink.events:
        parse_event(json.dumps(e))


def test_a_start_whose_pods_are_not_bound_goes_out_without_placement(tmp_path: Path):
    sink = ListSink()
    w = Watcher("c1", tmp_path / "s.json", sink, settle_s=5, clock=lambda: T0 + 20)
    items = {"resourceflavors": [flavor()], "nodes": [node()], "clusterqueues": [cq()], "localqueues": [lq()],
             "workloads": [wl(ADMITTED, gpus=2, count=2)], "pods": [pod("p1", "n0"), pod("p2", "")]}
    for kind, objs in items.items():
        w.listed(kind, objs, "10")
    w.flush()
    (s,) = [e for e in sink.events if e["type"] == "job.started"]
    assert "chip_ids" not in s and not w.state["placed"]


def test_deactivated_while_pending_is_cancelled_and_submitted_again_when_active():
    st, mp = setup()
    waiting = ("QuotaReserved", "False", 6, "Pending", "couldn't assign flavors")
    mp.workload(wl([waiting]), "w1", T0 + 6)
    ev = ("Evicted", "True", 9, "Deactivated", "The workload is deactivated")
    mp.workload(wl([waiting, ev], active=False), "w1", T0 + 10)
    mp.workload(wl([waiting, ev], active=False), "w1", T0 + 11)  # seen again: nothing new
    assert jobs(st) == [("job.submitted", "05"), ("job.waiting", "06"), ("job.finished", "09")]
    assert [b for b in bodies(st) if b["type"] == "job.finished"][0]["outcome"] == "cancelled"
    # reactivated: Kueue leaves Evicted=True (Deactivated) and writes no Requeued for a never-admitted Workload, so
    # the new submission is stamped when seen
    mp.workload(wl([waiting, ev]), "w1", T0 + 14)
    mp.workload(wl([("QuotaReserved", "True", 16, "QuotaReserved", ""), ("Admitted", "True", 16, "Admitted", ""),
                    ("Evicted", "False", 16, "QuotaReserved", "Previously: …")]), "w1", T0 + 16)
    # (Kueue's pending reason is given again to the new submission)
    assert jobs(st)[3:] == [("job.submitted", "14"), ("job.waiting", "14"), ("job.started", "16")]
    ids = [b["event_id"] for b in bodies(st)]
    assert len(ids) == len(set(ids))
    # deleted while inactive: already cancelled, nothing more
    st2, mp2 = setup()
    mp2.workload(wl([waiting]), "w1", T0 + 6)
    mp2.workload(wl([waiting, ev], active=False), "w1", T0 + 10)
    n = len(bodies(st2))
    mp2.workload(None, "w1", T0 + 12)
    assert len(bodies(st2)) == n


def test_a_first_look_at_a_workload_evicted_before_is_logged():
    st = _new_state("c1")
    said = []
    mp = Mapper("c1", st, m.DEFAULT_RESOURCES, log=said.append)
    mp.flavor(flavor(), "gpu", T0)
    mp.node(node(), "n0", T0)
    mp.cluster_queue(cq(), "team-a", T0)
    mp.local_queue(lq(), "ns-a/lq", T0)
    mp.workload(wl(ADMITTED, stats={"Preempted": 2}), "w1", T0 + 7)
    assert len(said) == 1 and "2 earlier eviction(s)" in said[0] and "Preempted" in said[0]


def test_a_short_jobs_placement_is_taken_when_its_pods_are_bound(tmp_path: Path):
    """A job shorter than the settle time: its Pods are done before its start is due; the placement seen while they
    were bound stays on the start."""
    sink = ListSink()
    now = [T0 + 7]
    w = Watcher("c1", tmp_path / "s.json", sink, settle_s=5, clock=lambda: now[0])
    for kind, objs in {"resourceflavors": [flavor()], "nodes": [node()], "clusterqueues": [cq()],
                       "localqueues": [lq()], "workloads": [], "pods": []}.items():
        w.listed(kind, objs, "10")
    w.observe("pods", pod("p1", "n0"), "uid-p1")  # seen bound before the admission
    w.observe("workloads", wl(ADMITTED), "w1")
    now[0] = T0 + 9
    w.observe("pods", pod("p1", "n0", phase="Succeeded"), "uid-p1")
    w.observe("workloads", wl(ADMITTED + [("Finished", "True", 8, "Succeeded", "")]), "w1")
    now[0] = T0 + 20
    w.flush()
    (s,) = [e for e in sink.events if e["type"] == "job.started"]
    assert s["chip_ids"] == ["n0-gpu0", "n0-gpu1"] and not w.state["placed"]
