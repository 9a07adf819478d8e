"""A real Kubernetes control plane with Kueue for the test session (scripts/kube.sh), and helpers to drive it.

`scripts/kube.sh start` is idempotent: a cluster already running (`make test` runs `kube.sh ensure` first) is
reused, else it is started here and stopped at the end of the session. The binaries are never built inside pytest
(about 11 min from bare): without them the tests are skipped loudly, or fail with CHIPLEDGER_REQUIRE_KUBE=1 (CI).

The helpers create uniquely named objects (cluster-scoped Kueue objects are shared by every test of the session),
kwok Nodes with GPUs, and Jobs whose Pods kwok completes after a delay (annotation
pod-complete.stage.kwok.x-k8s.io/delay) or fails (a second delay annotation kwok honours: see `job`).
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

REQUIRE_ENV = "CHIPLEDGER_REQUIRE_KUBE"
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kube.sh"
RBAC = Path(__file__).resolve().parents[1] / "deploy" / "kube" / "rbac.yaml"
G, V = "kueue.x-k8s.io", "v1beta2"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kueue")


class KubeUnavailable(RuntimeError):
    pass


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def cache_dir() -> Path:
    return Path(os.environ.get("CHIPLEDGER_KUBE_CACHE", Path.home() / ".cache" / "chipledger" / "kube"))


def state_dir() -> Path:
    return Path(os.environ.get("CHIPLEDGER_KUBE_DIR", f"/tmp/chipledger-kube-{os.getuid()}"))


def read_env(path: Path) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            k, v = line.removeprefix("export ").split("=", 1)
            out[k] = v
    return out


class Cluster:
    def __init__(self):
        missing = [b for b in BINARIES if not (cache_dir() / "bin" / b).exists()]
        if missing:
            raise KubeUnavailable(f"the control plane is not built (missing {', '.join(missing)} in "
                                  f"{cache_dir() / 'bin'}): run `bash scripts/kube.sh ensure` (about 11 min, once per machine)")
        if os.geteuid() != 0:
            raise KubeUnavailable("Kueue needs its metrics certificate in /etc/kueue (scripts/kube.sh): run as root")
        self.started_here = False
        self.env: dict = {}

    def start(self) -> None:
        import sys

        running = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True).returncode == 0
        if not running:
            t0 = time.monotonic()
            p = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=400,
                               env={**os.environ, "PYTHON": sys.executable})
            if p.returncode != 0:
                raise RuntimeError(f"scripts/kube.sh start failed:\n{p.stderr[-4000:]}\n{p.stdout[-2000:]}")
            self.started_here = True
            print(f"\nkube: control plane started in {time.monotonic() - t0:.1f} s")
        self.env = read_env(state_dir() / "env")
        from kubernetes import client, config

        self.admin = config.new_client_from_config(self.env["KUBECONFIG"])
        self.core = client.CoreV1Api(self.admin)
        self.batch = client.BatchV1Api(self.admin)
        self.custom = client.CustomObjectsApi(self.admin)
        self.rbac = client.RbacAuthorizationV1Api(self.admin)

    def stop(self) -> None:
        if self.started_here:
            subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, text=True, timeout=120)

    # -- RBAC: the adapters' roles, bound to the unprivileged users kube.sh made tokens for -----------------------
    def bind_roles(self) -> dict:
        """Apply deploy/kube/rbac.yaml's ClusterRoles; bind them to users chipledger:kube-watch / kube-actuate;
        return their kubeconfig paths."""
        import yaml

        from kubernetes.client.exceptions import ApiException

        for doc in yaml.safe_load_all(RBAC.read_text()):
            if doc and doc["kind"] == "ClusterRole":
                try:
                    self.rbac.create_cluster_role(doc)
                except ApiException as e:
                    if e.status != 409:
                        raise
                    self.rbac.replace_cluster_role(doc["metadata"]["name"], doc)  # (a cluster kept from before)
        for comp in ("watch", "actuate"):
            body = {"metadata": {"name": f"chipledger-kube-{comp}-test"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                "name": f"chipledger-kube-{comp}"},
                    "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                  "name": f"chipledger:kube-{comp}"}]}
            try:
                self.rbac.create_cluster_role_binding(body)
            except ApiException as e:
                if e.status != 409:
                    raise
        return {"watch": self.env["CHIPLEDGER_KUBE_WATCH_KUBECONFIG"],
                "actuate": self.env["CHIPLEDGER_KUBE_ACTUATE_KUBECONFIG"]}

    def client_of(self, kubeconfig: str):
        from kubernetes import config

        return config.new_client_from_config(kubeconfig)

    # -- objects ------------------------------------------------------------------------------------------------
    def node(self, name: str, gpus: int, labels: dict) -> None:
        node = {"metadata": {"name": name, "labels": labels, "annotations": {"kwok.x-k8s.io/node": "fake"}},
                "status": {"capacity": {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(gpus)},
                           "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110",
                                           "nvidia.com/gpu": str(gpus)}}}
        self.core.create_node(node)
        self.core.patch_node_status(name, {"status": node["status"]})

    def flavor(self, name: str, labels: dict) -> None:
        self.custom.create_cluster_custom_object(G, V, "resourceflavors", {
            "apiVersion": f"{G}/{V}", "kind": "ResourceFlavor", "metadata": {"name": name},
            "spec": {"nodeLabels": labels}})

    def cluster_queue(self, name: str, cohort: str, flavor: str, gpus: int, borrowing_limit=None,
                      reclaim: bool = True) -> None:
        gpu = {"name": "nvidia.com/gpu", "nominalQuota": str(gpus)}
        if borrowing_limit is not None:
            gpu["borrowingLimit"] = str(borrowing_limit)
        self.custom.create_cluster_custom_object(G, V, "clusterqueues", {
            "apiVersion": f"{G}/{V}", "kind": "ClusterQueue", "metadata": {"name": name},
            "spec": {"namespaceSelector": {}, "cohortName": cohort,
                     "preemption": {"withinClusterQueue": "LowerPriority",
                                    "reclaimWithinCohort": "Any" if reclaim else "Never"},
                     "resourceGroups": [{"coveredResources": ["cpu", "nvidia.com/gpu"], "flavors": [{
                         "name": flavor, "resources": [{"name": "cpu", "nominalQuota": "100"}, gpu]}]}]}})

    def namespace(self, name: str) -> None:
        self.core.create_namespace({"metadata": {"name": name}})

    def local_queue(self, ns: str, name: str, cq: str) -> None:
        self.custom.create_namespaced_custom_object(G, V, ns, "localqueues", {
            "apiVersion": f"{G}/{V}", "kind": "LocalQueue", "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterQueue": cq}})

    def priority_class(self, name: str, value: int) -> None:
        self.custom.create_cluster_custom_object(G, V, "workloadpriorityclasses", {
            "apiVersion": f"{G}/{V}", "kind": "WorkloadPriorityClass", "metadata": {"name": name}, "value": value})

    def job(self, ns: str, name: str, queue: str, gpus: int, *, priority: str = "", run_s=None, pods: int = 1,
            fail: bool = False) -> None:
        """A Job of `pods` Pods of `gpus` GPUs each; kwok completes each Pod `run_s` seconds after it runs (never,
        when None: it runs until evicted or deleted). `fail`: the container exits 1 then (the Job fails)."""
        ann = {}
        if run_s is not None:
            ann["pod-complete.stage.kwok.x-k8s.io/delay"] = f"{run_s}s"
        labels = {"kueue.x-k8s.io/queue-name": queue}
        if priority:
            labels["kueue.x-k8s.io/priority-class"] = priority
        if fail:
            ann["chipledger.test/fail"] = "true"
        self.batch.create_namespaced_job(ns, {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"suspend": True, "parallelism": pods, "completions": pods, "backoffLimit": 0,
                     "template": {"metadata": {"annotations": ann}, "spec": {
                         "restartPolicy": "Never", "containers": [{
                             "name": "main", "image": "registry.k8s.io/pause:3.10",
                             "resources": {"requests": {"cpu": "100m", "nvidia.com/gpu": str(gpus)},
                                           "limits": {"nvidia.com/gpu": str(gpus)}}}]}}}})

    def workload_of(self, ns: str, job: str):
        for wl in self.custom.list_namespaced_custom_object(G, V, ns, "workloads")["items"]:
            if any(o["name"] == job for o in wl["metadata"].get("ownerReferences", [])):
                return wl
        return None

    def cond(self, wl, typ: str):
        for c in (wl or {}).get("status", {}).get("conditions", []):
            if c["type"] == typ:
                return c
        return None

    def is_true(self, ns: str, job: str, typ: str) -> bool:
        c = self.cond(self.workload_of(ns, job), typ)
        return bool(c and c["status"] == "True")

    def wait(self, predicate, timeout: float = 60, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = predicate()
            if r:
                return r
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"
