"""`chipledger kube actuate`: apply the ledger's `decision.preempt` to the victim Workloads, once per decision.

For each decision of a pool of this cluster (`<cluster>/<flavor>`), for each victim (`job_id` = the Workload's
`<namespace>/<name>`, as `kube watch` sends it) still admitted:
1. annotate the Workload `chipledger.io/preempt-decision: <decision id>@<epoch s>` (the record on the object);
2. set its `Evicted` condition to True with reason `Preempted` and a message that begins `chipledger decision <id>:`,
   through the Workload's status subresource, with the resourceVersion read (a concurrent change retries).
That is what Kueue's own preemptor writes: Kueue's workload controller then stops the job (suspends it; its Pods
go), releases the quota reservation and puts the Workload back in its queue, active, to be admitted again, so
the victim resumes later by itself. `kube watch` sees the eviction and sends `job.preempted` with the decision's
id (from the message, or from the annotation), so the ledger books it as this decision's preemption.

A victim no longer admitted (finished, already evicted, deleted) is logged and skipped, not an error. The state file
(JSON, replaced atomically) lists the decision ids applied: a decision is applied once, even when read again.
"""

from __future__ import annotations

import time
from typing import Optional

from chipledger.adapters import common
from chipledger.adapters.kube.mapping import DECISION_ANNOTATION, DECISION_MARK, PREEMPTION_REASON
from chipledger.adapters.kube.watch import KUEUE_GROUP, KUEUE_VERSION
# where decisions come from is the same for every actuator: a JSONL file, a lake, the decisions topic
from chipledger.adapters.slurm.actuate import decisions_from_jsonl, decisions_from_kafka, decisions_from_lake  # noqa: F401

STATE_VERSION = 1


class ActuateError(RuntimeError):
    pass


Outcome = common.Outcome


def _admitted(wl: dict) -> bool:
    conds = {c.get("type"): c for c in ((wl.get("status") or {}).get("conditions") or [])}
    adm, fin, ev = conds.get("Admitted"), conds.get("Finished"), conds.get("Evicted")
    return bool(adm and adm.get("status") == "True") and not (fin and fin.get("status") == "True") \
        and not (ev and ev.get("status") == "True")


class KubeOps:
    """The reads and writes the actuator makes (replaceable in unit tests)."""

    def __init__(self, api_client):
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)

    def get(self, namespace: str, name: str) -> Optional[dict]:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.custom.get_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def annotate(self, namespace: str, name: str, value: str) -> None:
        self.custom.patch_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", name,
                                                   {"metadata": {"annotations": {DECISION_ANNOTATION: value}}})

    def evict(self, wl: dict, message: str, now: int) -> None:
        """Evicted=True (reason Preempted) on the status subresource, guarded by the resourceVersion read."""
        md = wl["metadata"]
        conds = [c for c in ((wl.get("status") or {}).get("conditions") or []) if c.get("type") != "Evicted"]
        conds.append({"type": "Evicted", "status": "True", "reason": PREEMPTION_REASON, "message": message[:32768],
                      "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                      "observedGeneration": md.get("generation", 1)})
        body = {"metadata": {"resourceVersion": md["resourceVersion"]}, "status": {"conditions": conds}}
        # a merge patch (the conditions list replaced whole) that names the resourceVersion: a conflict (409) if
        # Kueue changed the Workload since it was read
        self.custom.patch_namespaced_custom_object_status(KUEUE_GROUP, KUEUE_VERSION, md["namespace"], "workloads",
                                                          md["name"], body)


class Actuator(common.DecisionActuator):
    error = ActuateError
    state_version = STATE_VERSION

    def _victim(self, decision: dict, did: str, v: dict, out: Outcome) -> None:
        from kubernetes.client.exceptions import ApiException

        beneficiary = (decision.get("beneficiary") or {}).get("job_id")
        why = (f"{DECISION_MARK}{did}: {decision.get('rule', 'preempt')} for {beneficiary}; "
               f"{decision.get('message', '')}")
        job = str(v.get("job_id", ""))
        ns, _, name = job.partition("/")
        if not ns or not name:
            out.gone.append((job, "not a Workload id (namespace/name)"))
            self.log(f"{did}: victim {job} is not a Workload of kube watch (namespace/name): skipped")
            return
        for attempt in range(5):
            wl = self.ops.get(ns, name)
            if wl is None or not _admitted(wl):
                what = "gone" if wl is None else "not admitted (finished or evicted already)"
                out.gone.append((job, what))
                self.log(f"{did}: victim {job} is {what}: nothing to do")
                break
            if self.dry_run:
                out.applied.append((job, "would evict"))
                self.log(f"{did}: would evict {job} ({v.get('team')}, {v.get('chips')} chips) for {beneficiary} "
                         f"(dry run)")
                break
            now = int(self.clock())
            try:
                self.ops.annotate(ns, name, f"{did}@{now}")
                wl = self.ops.get(ns, name) or wl
                self.ops.evict(wl, why, now)
            except ApiException as e:
                if e.status == 409 and attempt < 4:  # changed under us (Kueue writes status too): read again
                    continue
                if e.status == 404:
                    out.gone.append((job, "gone"))
                    break
                raise
            out.applied.append((job, "evict"))
            self.log(f"{did}: evicted {job} ({v.get('team')}, {v.get('chips')} chips) for {beneficiary}")
            break


class ActuateMetrics:
    """The actuator's health on /metrics."""

    def __init__(self, registry=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter("chipledger_kube_actuate_decisions_total", "decisions read, by outcome", ["outcome"],
                                 registry=r)
        self.victims = Counter("chipledger_kube_actuate_victims_total", "victims, by what was done", ["action"],
                               registry=r)
        self.last = Gauge("chipledger_kube_actuate_last_decision_timestamp_seconds", "when a decision was last read",
                          registry=r)

    def applied(self, out: Outcome, now: int) -> None:
        self.decisions.labels("skipped" if out.skipped else "applied").inc()
        for _, a in out.applied:
            self.victims.labels(a.replace(" ", "_")).inc()
        for _ in out.gone:
            self.victims.labels("gone").inc()
        self.last.set(now)

    def serve(self, port: int, addr: str = "127.0.0.1"):
        from prometheus_client import start_http_server

        return start_http_server(port, addr=addr, registry=self.registry)
