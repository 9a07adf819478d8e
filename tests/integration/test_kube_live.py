"""`chipledger kube watch` and `kube actuate` against a real kube-apiserver with Kueue and kwok (tests/kube_support.py).

One workload of real Jobs runs once for the module (about a minute) in one cohort of four ClusterQueues (teams) on
one ResourceFlavor of two kwok Nodes with 8 GPUs each: a team borrowing, Kueue reclaiming its quota
(InCohortReclamation), a priority preemption inside a ClusterQueue (InClusterQueue), an admin's deactivation and
reactivation, a Job that fails, a pending Job deactivated, reactivated and deleted, a Node cordoned and a Node
NotReady for a moment (while no job runs on them), and a reclaim decided by the ledger (the reclaiming ClusterQueue
has Kueue's own reclaim off) applied by `kube actuate`. Each ClusterQueue is team `<cohort>/<name>`.
The watcher runs with the least-privilege ClusterRole of deploy/kube/rbac.yaml (a token bound to it, not admin), is
stopped and restarted mid-run (resuming its watches), and restarted once more with its cursor set to a version
the API server no longer serves (a forced `410 Gone`: it lists again). Then:
- the books folded from what the watcher sent equal, per team, the chip-seconds computed from the Workloads' own
  condition times (admitted → evicted or finished), to the second; nothing is late or a dead letter;
- the ledger's waits per ClusterQueue match Kueue's kueue_admission_wait_time_seconds: the count exactly, the sum
  within one second per admission;
- every event id is sent once; a fresh `--once` on the final cursor sends nothing but ticks;
- the ledger's reclaim evicts the real victim through `kube actuate`; Kueue requeues and readmits it; its
  `job.preempted` carries the decision's id;
- each start carries the chips of its Pods' Nodes; the pending Job deactivated is no demand while inactive.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pipeline_support
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kafka_support

from tests.kube_support import G, V, unique  # noqa: E402

CLUSTER = "kt"
SETTLE_S = 5  # a condition's time can precede its write by seconds (Kueue copies the Job's finish time)


def _events(path: Path) -> list[dict]:
    text = path.read_text()
    return [json.loads(x) for x in text[: text.rfind("\n") + 1].splitlines() if x.strip()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class History:
    """The test's own record of every Workload's conditions, from a watch of its own (admin): the oracle."""

    def __init__(self, kube):
        self.kube = kube
        self.seen: dict = defaultdict(set)  # uid -> {(type, status, ltt epoch, reason)}
        self.meta: dict = {}  # uid -> (namespace, name, chips, cluster queue)
        self.lag_s = 0.0  # the longest delay between a condition's time and its arrival
        self.t0 = int(time.time())
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        from kubernetes import watch

        from chipledger.adapters.kube.mapping import epoch

        rv = None
        while not self.stop.is_set():
            try:
                w = watch.Watch()
                kw = {"resource_version": rv} if rv else {}
                for ev in w.stream(self.kube.custom.list_cluster_custom_object, group=G, version=V, plural="workloads",
                                   timeout_seconds=3600, deserialize=False, **kw):  # one stream: never 410
                    o = ev["object"]
                    if ev["type"] == "ERROR":
                        rv = None
                        break
                    rv = o["metadata"]["resourceVersion"]
                    uid = o["metadata"]["uid"]
                    gpus = 0
                    for ps in o["spec"]["podSets"]:
                        for c in ps["template"]["spec"]["containers"]:
                            gpus += int(c["resources"]["requests"].get("nvidia.com/gpu", 0)) * ps.get("count", 1)
                    cq = (o.get("status", {}).get("admission") or {}).get("clusterQueue")
                    old = self.meta.get(uid)
                    self.meta[uid] = (o["metadata"]["namespace"], o["metadata"]["name"], gpus, cq or (old and old[3]))
                    for c in o.get("status", {}).get("conditions", []):
                        key = (c["type"], c["status"], epoch(c["lastTransitionTime"]), c.get("reason"))
                        if key not in self.seen[uid] and key[2] >= self.t0:
                            self.lag_s = max(self.lag_s, time.time() - key[2] - 1)
                        self.seen[uid].add(key)
            except Exception:  # noqa: BLE001 - reconnect
                time.sleep(0.2)

    def chip_seconds(self) -> Counter:
        """GPU-seconds per ClusterQueue: each admission (Admitted=True's time) to the next eviction (Evicted=True) or
        finish (Finished=True)."""
        out: Counter = Counter()
        for uid, conds in self.seen.items():
            _, _, gpus, cq = self.meta[uid]
            starts = sorted({t for ty, st, t, _ in conds if ty == "Admitted" and st == "True"})
            ends = sorted({t for ty, st, t, _ in conds if (ty, st) in (("Evicted", "True"), ("Finished", "True"))})
            # in order, each end once: an eviction and the next admission can share a second
            for s in starts:
                assert ends and ends[0] >= s, (uid, sorted(conds))
                out[cq] += gpus * (ends.pop(0) - s)
        return out


def _kueue_wait_metrics(kube) -> dict:
    """{cluster_queue: (count, sum)} of kueue_admission_wait_time_seconds from Kueue's own /metrics."""
    import requests

    text = requests.get(kube.env["KUEUE_METRICS_URL"], headers={"Authorization": f"Bearer {kube.env['K8S_TOKEN']}"},
                        verify=kube.env["K8S_CA"], timeout=10).text
    out: dict = defaultdict(lambda: [0, 0.0])
    for line in text.splitlines():
        m = re.match(r'kueue_admission_wait_time_seconds_(count|sum)\{([^}]*)\} (\S+)', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            i = 0 if m.group(1) == "count" else 1
            out[labels["cluster_queue"]][i] += float(m.group(3))
    return {k: (int(v[0]), v[1]) for k, v in out.items()}


def _compact_etcd() -> None:
    import base64

    import requests

    etcd = "http://127.0.0.1:19701/v3/kv"
    rev = requests.post(f"{etcd}/range", json={"key": base64.b64encode(b"/").decode()}, timeout=10).json()
    requests.post(f"{etcd}/compaction", json={"revision": rev["header"]["revision"], "physical": True},
                  timeout=30).raise_for_status()


class TeeSink:
    """Kafka (as `kube watch --emit kafka` sends), and a list of what was sent."""

    def __init__(self, bootstrap: str):
        from chipledger.adapters.kube.watch import KafkaSink
        from streams.producer import LedgerProducer

        self.kafka = KafkaSink(LedgerProducer(bootstrap))
        self.sent: list = []

    def send(self, body):
        self.kafka.send(body)
        self.sent.append(body)

    def flush(self):
        self.kafka.flush()

    def close(self):
        self.kafka.close()


class Running:
    """A Watcher in a thread, as `chipledger kube watch` runs it."""

    def __init__(self, client, state: Path, out, metrics=None):
        from chipledger.adapters.kube.watch import JsonlSink, KubeApi, Watcher

        self.sink = JsonlSink(out) if isinstance(out, Path) else out
        self.watcher = Watcher(CLUSTER, state, self.sink, KubeApi(client), settle_s=SETTLE_S, tick_s=1,
                               metrics=metrics, log=lambda msg: print(f"{time.strftime('%H:%M:%S')} watch: {msg}"))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.watcher.run, kwargs={"interval_s": 0.3, "stop": self.stop,
                                                                        "watch_timeout_s": 20}, daemon=True)
        self.thread.start()

    def close(self):
        time.sleep(1.5)  # (what is not past the watermark yet stays in the state: the next watcher sends it)
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        self.sink.close()


def _fold(events: Path, lake: Path):
    from chipledger.embedded import run_file
    from ledger.fold import FoldConfig

    summary, _ = run_file(events, lake, fold_config=FoldConfig(preemption_grace_s=1, min_runtime_s=1), overwrite=True)
    assert not summary.dead_letters and summary.late == 0, summary
    return summary


@pytest.fixture(scope="module")
def kafka(tmp_path_factory):
    from kafka_support import module_broker

    with module_broker(tmp_path_factory, partitions=2) as k:
        yield k["bootstrap"]


@pytest.fixture(scope="module")
def workload(kube, tmp_path_factory, request):
    from chipledger.adapters.kube.actuate import Actuator, KubeOps
    from chipledger.adapters.kube.watch import WatchMetrics
    from chipledger.adapters.kube.actuate import decisions_from_lake

    d = tmp_path_factory.mktemp("kube-watch")
    state, out = d / "watch.state", d / "watch.jsonl"
    k = kube
    roles = k.bind_roles()
    watch_client, actuate_client = k.client_of(roles["watch"]), k.client_of(roles["actuate"])
    s = unique("t")
    names = {"flavor": f"gpu-{s}", "cohort": f"org-{s}", **{t: f"{t}-{s}" for t in "abcd"}}
    history = History(k)
    k.flavor(names["flavor"], {"chipledger.test/pool": s})
    nodes = [f"n{i}-{s}" for i in range(2)]
    for n in nodes:
        k.node(n, 8, {"chipledger.test/pool": s})
    # one cohort, 16 GPUs of nominal quota: a 6, b 4 (may not borrow), c 2, d 4 (Kueue's own reclaim off: the
    # ledger decides d's reclaims, `kube actuate` applies them)
    k.cluster_queue(names["a"], names["cohort"], names["flavor"], 6)
    k.cluster_queue(names["b"], names["cohort"], names["flavor"], 4, borrowing_limit=0)
    k.cluster_queue(names["c"], names["cohort"], names["flavor"], 2)
    k.cluster_queue(names["d"], names["cohort"], names["flavor"], 4, reclaim=False)
    ns = {t: names[t] for t in "abcd"}
    for t in "abcd":
        k.namespace(ns[t])
        k.local_queue(ns[t], "lq", names[t])
    low, high = f"low-{s}", f"high-{s}"
    k.priority_class(low, 10)
    k.priority_class(high, 1000)
    k.wait(lambda: all(k.cond(k.custom.get_cluster_custom_object(G, V, "clusterqueues", names[t]), "Active")
                       for t in "abcd"), what="ClusterQueues active")
    metrics = WatchMetrics()
    mport = _free_port()
    metrics.serve(mport)
    w = Running(watch_client, state, out, metrics)
    try:  # the Kafka path too, when a broker can run here: a second watcher sends to Kafka all along
        bootstrap = request.getfixturevalue("kafka")
        kafka_skip = ""
    except pytest.skip.Exception as e:
        bootstrap, kafka_skip = None, str(e)
    if bootstrap:
        from pipeline_support import WorkerProcess

        worker = WorkerProcess(bootstrap, d / "worker", d / "worker.log", "--tick-interval", "0", "--table-store",
                               "memory", app_id=f"kube-{s}").start()
        tee = TeeSink(bootstrap)
        wk = Running(watch_client, d / "kafka-watch.state", tee)
    admitted = lambda t, job: k.is_true(ns[t], job, "Admitted")  # noqa: E731
    finished = lambda t, job: k.is_true(ns[t], job, "Finished")  # noqa: E731

    # 1. c borrows 10 GPUs (12 used); a's 6 take their quota back: Kueue evicts c1 (InCohortReclamation)
    k.job(ns["c"], "c1", "lq", 6, pods=2, run_s=4)
    k.wait(lambda: admitted("c", "c1"), what="c1 admitted (borrowing)")
    time.sleep(1.1)
    k.job(ns["a"], "a1", "lq", 6, run_s=2)
    k.wait(lambda: admitted("a", "a1"), what="a1 admitted after Kueue's reclaim")
    # c1 runs again once a1 is done; it must be done too before others reclaim from c: Kueue measures a requeued
    # Workload's wait from its Requeued condition, which a second eviction does not move (docs/kube.md)
    k.wait(lambda: finished("c", "c1"), timeout=60, what="c1 finished")
    # 2. the watcher restarts: stopped here, a priority preemption happens while it is down, a new one resumes
    w.close()
    k.job(ns["b"], "b1", "lq", 4, priority=low, run_s=5)
    k.wait(lambda: admitted("b", "b1"), what="b1 admitted")
    time.sleep(1.1)
    k.job(ns["b"], "b2", "lq", 4, priority=high, run_s=2)
    k.wait(lambda: admitted("b", "b2"), what="b2 admitted (b1 preempted)")
    w = Running(watch_client, state, out, metrics)
    # 3. an admin deactivates a running job, then reactivates it; a job fails; a pending job is deleted
    k.job(ns["a"], "a2", "lq", 2, run_s=3)
    k.wait(lambda: admitted("a", "a2"), what="a2 admitted")
    time.sleep(1.1)
    wl = k.workload_of(ns["a"], "a2")
    k.custom.patch_namespaced_custom_object(G, V, ns["a"], "workloads", wl["metadata"]["name"], {"spec": {"active": False}})
    k.wait(lambda: k.is_true(ns["a"], "a2", "Evicted"), what="a2 deactivated")
    time.sleep(1.1)
    k.custom.patch_namespaced_custom_object(G, V, ns["a"], "workloads", wl["metadata"]["name"], {"spec": {"active": True}})
    k.batch.create_namespaced_job(ns["a"], {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "fails", "labels": {"kueue.x-k8s.io/queue-name": "lq"}},
        "spec": {"suspend": True, "activeDeadlineSeconds": 2, "backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never", "containers": [{"name": "m", "image": "registry.k8s.io/pause:3.10", "resources": {
                "requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}}]}}}})
    k.job(ns["c"], "c2", "lq", 9, pods=2, run_s=1)  # more than the cohort has (18 > 16): pending for good
    k.wait(lambda: (k.cond(k.workload_of(ns["c"], "c2"), "QuotaReserved") or {}).get("status") == "False",
           what="c2 pending")
    time.sleep(1.1)
    # deactivated while pending (cancelled in the ledger: no demand), active again (submitted again), then deleted
    c2 = k.workload_of(ns["c"], "c2")["metadata"]["name"]
    k.custom.patch_namespaced_custom_object(G, V, ns["c"], "workloads", c2, {"spec": {"active": False}})
    k.wait(lambda: k.is_true(ns["c"], "c2", "Evicted"), what="c2 deactivated")
    time.sleep(1.1)
    k.custom.patch_namespaced_custom_object(G, V, ns["c"], "workloads", c2, {"spec": {"active": True}})
    time.sleep(1.1)
    k.batch.delete_namespaced_job("c2", ns["c"], propagation_policy="Background")
    k.wait(lambda: all(finished(t, j) for t, j in (("a", "a1"), ("b", "b1"), ("b", "b2"), ("c", "c1"), ("a", "a2"),
                                                   ("a", "fails"))), timeout=60, what="phase 1-3 jobs finished")
    # 4. a node cordoned and another NotReady for a moment (kwok sets Ready once; nothing heartbeats conditions),
    # while no job runs on them: with placement known, a job on an unavailable chip is not charged for it (the
    # books would then differ from the Workloads' condition times by design)
    k.core.patch_node(nodes[0], {"spec": {"unschedulable": True}})
    ready = lambda status, reason: {"status": {"conditions": [{  # noqa: E731
        "type": "Ready", "status": status, "reason": reason, "message": "set by the test",
        "lastHeartbeatTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]}}
    k.core.patch_node_status(nodes[1], ready("False", "KubeletDown"))
    time.sleep(1.5)
    k.core.patch_node(nodes[0], {"spec": {"unschedulable": False}})
    k.core.patch_node_status(nodes[1], ready("True", "KubeletReady"))
    # 5. a forced 410 Gone: the cursor points at a version the API server no longer serves; meanwhile c borrows
    w.close()
    st = json.loads(state.read_text())
    st["rv"] = {kind: "1" for kind in st["rv"]}
    state.write_text(json.dumps(st))
    _compact_etcd()  # version 1 is gone for good: the API server answers 410 Gone
    k.job(ns["c"], "c3", "lq", 8, run_s=10)  # borrows 6 (c's quota is 2)
    k.wait(lambda: admitted("c", "c3"), what="c3 admitted (borrowing)")
    w = Running(watch_client, state, out, metrics)
    # 6. the ledger's reclaim: a fills its quota, d's job fits d's unused quota but not the free GPUs, and Kueue
    # (reclaim off for d) leaves it pending; the ledger decides to preempt the borrower, `kube actuate` evicts it
    k.job(ns["a"], "a3", "lq", 6, run_s=8)
    k.wait(lambda: admitted("a", "a3"), what="a3 admitted")
    time.sleep(1.1)
    k.job(ns["d"], "d1", "lq", 4, run_s=2)
    decisions, deadline = [], time.monotonic() + 60
    while not decisions:
        assert time.monotonic() < deadline, "the ledger made no reclaim decision"
        time.sleep(1)
        shutil.copy(out, d / "decide.jsonl")
        _fold(d / "decide.jsonl", d / "decide-lake")
        decisions = decisions_from_lake(d / "decide-lake")
    act_state = d / "actuate.state"
    actuated = Actuator(CLUSTER, act_state, KubeOps(actuate_client)).apply_all(decisions)
    again = Actuator(CLUSTER, act_state, KubeOps(actuate_client)).apply_all(decisions)
    k.wait(lambda: admitted("d", "d1"), what="d1 admitted after the actuated reclaim")
    k.wait(lambda: all(finished(t, j) for t, j in (("c", "c3"), ("a", "a3"), ("d", "d1"))), timeout=90,
           what="all jobs finished")
    time.sleep(SETTLE_S + 1)  # everything is past the watermark: the last flush sends it
    w.close()
    import requests

    metrics_text = requests.get(f"http://127.0.0.1:{mport}/metrics", timeout=5).text
    history.stop.set()
    _fold(out, d / "lake")
    kafka_lake = None
    if bootstrap:
        from pipeline_support import pump
        from store import open_store
        from streams.sink import Sink

        wk.close()
        sink = Sink(d / "kafka-lake", open_store(f"sqlite:///{d / 'sink.db'}"), bootstrap=bootstrap, name="sink",
                    batch_ms=300)
        try:
            pump(sink, lambda: sink.stats.rows["events"] >= len(tee.sent), 120, worker)
        finally:
            worker.stop()
            sink.close()
        assert "Traceback" not in (d / "worker.log").read_text()
        kafka_lake = d / "kafka-lake"
    pods = {(p.metadata.namespace, p.metadata.name): p.spec.node_name
            for t in "abcd" for p in k.core.list_namespaced_pod(ns[t]).items}
    return {"dir": d, "out": out, "nodes": nodes, "pods": pods, "state": state, "names": names, "ns": ns, "history": history, "k": k,
            "decisions": decisions, "actuated": actuated, "again": again, "metrics": metrics_text,
            "watch_client": watch_client, "roles": roles, "kafka_lake": kafka_lake, "kafka_skip": kafka_skip,
            "kafka_sent": tee.sent if bootstrap else []}


def _books(lake: Path) -> dict:
    from analytics.views import connect

    rows = connect(lake).execute("SELECT team, sum(amount_mchip_s) FROM journal "
                                 "WHERE account IN ('in_quota', 'borrowed', 'burst') GROUP BY ALL").fetchall()
    return {team: int(amount) // 1000 for team, amount in rows if amount}


def _team(workload, cq: str) -> str:
    """The ledger's team of a ClusterQueue of the test's cohort: `<cohort>/<ClusterQueue>`."""
    return f"{workload['names']['cohort']}/{cq}"


def test_books_equal_the_workloads_condition_times(workload):
    # per team (the cluster may hold other tests' objects too); each ClusterQueue is team <cohort>/<name>
    teams = {_team(workload, workload["names"][t]) for t in "abcd"}
    expected = {_team(workload, cq): n for cq, n in workload["history"].chip_seconds().items()
                if n and _team(workload, cq) in teams}
    books = {team: n for team, n in _books(workload["dir"] / "lake").items() if team in teams}
    print(f"\nlongest delay from a condition's time to its arrival: {workload['history'].lag_s:.1f} s (settle {SETTLE_S} s)")
    print(f"GPU-seconds per team: from the Workloads' conditions {dict(sorted(expected.items()))}, "
          f"ledger {dict(sorted(books.items()))}")
    assert books == expected
    assert set(books) == teams


def test_scheduling_latency_matches_kueues_admission_wait(workload):
    teams = {workload["names"][t] for t in "abcd"}
    kueue = {cq: v for cq, v in _kueue_wait_metrics(workload["k"]).items() if cq in teams}
    from analytics.views import connect

    rows = connect(workload["dir"] / "lake").execute(
        "SELECT team, count(*), sum(epoch(ended_at) - epoch(began_at)) FROM waits WHERE \"end\" = 'started' "
        "GROUP BY ALL").fetchall()
    ledger = {team.split("/", 1)[1]: (n, int(total)) for team, n, total in rows
              if "/" in team and team.split("/", 1)[1] in teams}
    print(f"\nadmissions and their wait (s) per ClusterQueue: Kueue {kueue}, ledger {ledger}")
    for t in "abcd":
        cq = workload["names"][t]
        n_k, sum_k = kueue[cq]
        n_l, sum_l = ledger[cq]
        assert n_l == n_k, (cq, ledger[cq], kueue[cq])
        # within a second per admission (condition times are whole seconds, Kueue's histogram is not), and one
        # more for the truncation at both ends of a wait (measured: 1.16 s apart for a single admission)
        assert abs(sum_l - sum_k) <= n_k + 1, (cq, ledger[cq], kueue[cq])


def test_each_event_once_and_a_fresh_look_adds_nothing(workload, tmp_path):
    from chipledger.adapters.kube.watch import JsonlSink, KubeApi, Watcher

    evs = _events(workload["out"])
    ids = [e["event_id"] for e in evs]
    assert len(ids) == len(set(ids))
    again = tmp_path / "again.jsonl"
    st = tmp_path / "watch.state"
    shutil.copy(workload["state"], st)
    sink = JsonlSink(again)
    Watcher(CLUSTER, st, sink, KubeApi(workload["watch_client"]), settle_s=0).run(once=True)
    sink.close()
    assert {e["type"] for e in _events(again)} <= {"pool.tick"}
    assert re.search(r'chipledger_kube_watch_relists_total\{kind="workloads"\} [1-9]', workload["metrics"])
    assert "chipledger_kube_watch_last_event_timestamp_seconds{kind=\"workloads\"}" in workload["metrics"]


def test_watch_maps_what_kueue_did(workload):
    ns = workload["ns"]
    by_job = defaultdict(list)
    waiting = defaultdict(list)
    for e in _events(workload["out"]):
        if e["type"] == "job.waiting":
            waiting[e["job_id"].split("/")[0] + "/" + e["job_id"].split("/")[1].split("-")[1]].append(e)
        elif "job_id" in e:
            by_job[e["job_id"].split("/")[0] + "/" + e["job_id"].split("/")[1].split("-")[1]].append(e)
    types = lambda ns_, job: [e["type"] for e in by_job[f"{ns_}/{job}"]]  # noqa: E731
    c1 = by_job[f"{ns['c']}/c1"]
    assert [e["type"] for e in c1] == ["job.submitted", "job.started", "job.preempted", "job.started",
                                       "job.finished"]
    pre = c1[2]
    assert pre["reason"] == "InCohortReclamation" and pre["cause"] == "preempted" and "decision_id" not in pre
    assert c1[0]["namespace"] == ns["c"] and c1[0]["team"] == _team(workload, workload["names"]["c"])
    assert c1[0]["chips"] == 12
    assert waiting[f"{ns['c']}/c1"], "c1 waited after Kueue's reclaim: Kueue's reason kept"
    b1 = by_job[f"{ns['b']}/b1"]
    assert [e["type"] for e in b1] == ["job.submitted", "job.started", "job.preempted", "job.started",
                                       "job.finished"]
    assert b1[2]["reason"] == "InClusterQueue" and b1[2]["cause"] == "preempted"
    a2 = by_job[f"{ns['a']}/a2"]
    assert [e["type"] for e in a2] == ["job.submitted", "job.started", "job.preempted", "job.released",
                                       "job.started", "job.finished"]
    assert a2[2]["held"] is True and a2[2]["cause"] == "requeued" and a2[2]["reason"] == "Deactivated"
    fails = by_job[f"{ns['a']}/fails"]
    assert [e["type"] for e in fails][-1] == "job.finished" and fails[-1]["outcome"] == "failed"
    c2 = by_job[f"{ns['c']}/c2"]
    # deactivated while pending: cancelled (no demand); active again: submitted again; deleted while pending
    assert types(ns["c"], "c2") == ["job.submitted", "job.finished", "job.submitted", "job.finished"]
    assert [e.get("outcome") for e in c2] == [None, "cancelled", None, "cancelled"]
    assert c2[1]["event_id"].split(":")[3] == "deactivated" and c2[3]["event_id"].split(":")[3] == "deleted"
    assert waiting[f"{ns['c']}/c2"]  # with Kueue's own reason and message
    assert all(w["reason"] == "Pending" and "insufficient quota" in w["message"] for w in waiting[f"{ns['c']}/c2"])
    assert all(e["source"] == f"{CLUSTER}/kueue" for e in _events(workload["out"]))
    chip_states = Counter((e["state"], (e.get("reason") or "").split(":")[0]) for e in _events(workload["out"])
                          if e["type"] == "chip.state_changed")
    assert chip_states[("maintenance", "cordoned (spec.unschedulable)")] == 8
    assert chip_states[("down", "NotReady")] == 8 and chip_states[("healthy", "")] == 16


def test_actuate_evicts_the_ledgers_victim_and_kueue_requeues_it(workload):
    ns = workload["ns"]
    (decision,) = workload["decisions"]
    assert decision["rule"] == "reclaim" and decision["pool"] == f"{CLUSTER}/{workload['names']['flavor']}"
    (victim,) = decision["victims"]
    assert victim["job_id"].startswith(f"{ns['c']}/job-c3-")
    (done,) = workload["actuated"]
    assert done.applied == [(victim["job_id"], "evict")] and not done.skipped
    assert [o.skipped for o in workload["again"]] == ["applied before"]
    evs = [e for e in _events(workload["out"]) if e.get("job_id") == victim["job_id"] and e["type"] != "job.waiting"]
    assert [(e["type"], e.get("decision_id")) for e in evs] == [
        ("job.submitted", None), ("job.started", None), ("job.preempted", decision["decision_id"]),
        ("job.started", None), ("job.finished", None)]
    pre = evs[2]
    assert pre["cause"] == "preempted" and pre["reason"] == "Preempted"
    wl = workload["k"].custom.get_namespaced_custom_object(G, V, ns["c"], "workloads", victim["job_id"].split("/")[1])
    assert wl["metadata"]["annotations"]["chipledger.io/preempt-decision"].startswith(decision["decision_id"] + "@")


def test_the_watchers_role_cannot_write(workload):
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as e:
        client.CustomObjectsApi(workload["watch_client"]).patch_namespaced_custom_object(
            G, V, workload["ns"]["a"], "localqueues", "lq", {"metadata": {"labels": {"x": "y"}}})
    assert e.value.status == 403


def test_the_kafka_path_gives_the_same_books(workload):
    """watcher → Kafka (LedgerProducer) → worker → sink → lake: every event sent is in the sink's lake once, and the
    teams' chip-seconds of the worker's job runs (the journal's hours close only at the hour) equal the Workloads'
    own."""
    if workload["kafka_lake"] is None:
        pytest.skip(workload["kafka_skip"])
    from analytics.views import connect

    teams = {_team(workload, workload["names"][t]) for t in "abcd"}
    con = connect(workload["kafka_lake"])
    logged = [r[0] for r in con.execute("SELECT event_id FROM base_event_log").fetchall()]
    assert sorted(logged) == sorted(e["event_id"] for e in workload["kafka_sent"])
    assert con.execute("SELECT count(*) FROM deadletters").fetchone()[0] == 0
    rows = con.execute("SELECT team, sum(allocated_mchip_s) FROM job_runs GROUP BY ALL").fetchall()
    books = {team: int(n) // 1000 for team, n in rows if team in teams and n}
    expected = {_team(workload, cq): n for cq, n in workload["history"].chip_seconds().items()
                if n and _team(workload, cq) in teams}
    print(f"\nGPU-seconds per team through Kafka: {dict(sorted(books.items()))}")
    assert books == expected
    ids = [e["event_id"] for e in workload["kafka_sent"]]
    assert len(ids) == len(set(ids))
    # two watchers (this one ran throughout; the JSONL one was stopped, resumed and relisted after a 410) made the
    # same job events, ids and all: watching twice sends nothing twice
    pool = f"{CLUSTER}/{workload['names']['flavor']}"
    jobs_of = lambda evs: {e["event_id"] for e in evs if e["pool"] == pool and e["type"].startswith("job.")}  # noqa: E731
    assert jobs_of(workload["kafka_sent"]) == jobs_of(_events(workload["out"]))


def test_the_command_line(workload, tmp_path):
    """`chipledger kube watch --once` and `kube actuate --dry-run` as a platform engineer runs them, with the
    adapters' own kubeconfigs (the tokens bound to deploy/kube/rbac.yaml's ClusterRoles)."""
    from typer.testing import CliRunner

    from chipledger.cli import app

    st = tmp_path / "watch.state"
    shutil.copy(workload["state"], st)
    res = CliRunner().invoke(app, ["kube", "watch", "--once", "--kubeconfig", workload["roles"]["watch"],
                                   "--cluster", CLUSTER, "--state", str(st), "--out", str(tmp_path / "e.jsonl"),
                                   "--settle", "0"])
    assert res.exit_code == 0, res.output
    assert {e["type"] for e in _events(tmp_path / "e.jsonl")} <= {"pool.tick"}
    decisions = tmp_path / "decisions.jsonl"
    decisions.write_text("".join(json.dumps(d) + "\n" for d in workload["decisions"]))
    res = CliRunner().invoke(app, ["kube", "actuate", "--kubeconfig", workload["roles"]["actuate"], "--cluster",
                                   CLUSTER, "--decisions", str(decisions), "--dry-run", "--state",
                                   str(tmp_path / "a.state")])
    assert res.exit_code == 0, res.output
    assert "decisions 1 applied 0 gone 1 skipped 0 (dry run)" in res.stdout  # the victim has finished since


def test_starts_carry_the_placement_of_their_pods(workload):
    """Each start names chips on the Nodes its Pods were bound to (the chip names within a Node are the watcher's:
    Kubernetes does not say which device a Pod holds), as many as the job asks."""
    pool = f"{CLUSTER}/{workload['names']['flavor']}"
    evs = [e for e in _events(workload["out"]) if e["pool"] == pool]
    chips = {e["job_id"]: e["chips"] for e in evs if e["type"] == "job.submitted"}
    starts = [e for e in evs if e["type"] == "job.started"]
    placed = [e for e in starts if e.get("chip_ids")]
    print(f"\nstarts with placement: {len(placed)} of {len(starts)}")
    # all but b1's first run: it started and was preempted while the watcher was stopped (its Pods were gone when
    # the watcher came back), so that start goes out without placement
    unplaced = [e["job_id"].split("/")[1].split("-")[1] for e in starts if not e.get("chip_ids")]
    assert unplaced in ([], ["b1"]), unplaced
    assert len(placed) >= 10
    for e in placed:
        assert len(e["chip_ids"]) == chips[e["job_id"]], e
        assert {c.rsplit("-gpu", 1)[0] for c in e["chip_ids"]} <= set(workload["nodes"]), e
    # a finished Job keeps its Pods: its last start names their Nodes
    last = {e["job_id"]: e for e in placed}
    for (namespace, pod), node in workload["pods"].items():
        job = next((j for j in last if j.startswith(f"{namespace}/job-{pod.rsplit('-', 1)[0]}-")), None)
        if job is not None and node:
            assert any(c.startswith(node + "-") for c in last[job]["chip_ids"]), (pod, node, last[job])


def test_a_pending_workload_deactivated_is_no_demand_until_active_again(workload):
    """c2, pending, deactivated then active again then deleted: its waits stop at the deactivation (cancelled) and
    start again at the resubmission; nothing waits in between."""
    from analytics.views import connect

    ns = workload["ns"]
    evs = [e for e in _events(workload["out"]) if e.get("job_id", "").startswith(f"{ns['c']}/job-c2-")
           and e["type"] != "job.waiting"]
    sub1, cancelled, sub2, deleted = evs
    rows = connect(workload["dir"] / "lake").execute(
        "SELECT began_at, ended_at, \"end\" FROM waits WHERE job_id = ? ORDER BY began_at",
        [evs[0]["job_id"]]).fetchall()
    iso = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    assert [(iso(b), iso(e)) for b, e, _ in rows] == [(sub1["occurred_at"], cancelled["occurred_at"]),
                                                       (sub2["occurred_at"], deleted["occurred_at"])], rows
    assert all(end not in ("started", "open") for _, _, end in rows)
    assert cancelled["occurred_at"] < sub2["occurred_at"]
