"""Kubernetes and Kueue objects → chipledger events: the one mapping `kube watch` uses (pure: no I/O, no clock).

Inputs are the objects as the API server returns them (plain dicts, `ApiClient.sanitize_for_serialization` of
the typed ones). Each function reads one object into a small *view* (the fields the ledger needs, JSON-safe: the
watcher keeps views in its state file) or turns a view change into events. Every event id derives from
Kubernetes' own: the object's uid and the transition with its time (`kube:<cluster>:<uid>:<what>:<epoch s>`), so
mapping the same object again, after a relist or a restart, gives the same ids. docs/kube.md has the table.

- ResourceFlavor → pool `<cluster>/<flavor>`; its `nodeLabels` select the Nodes whose chips it holds.
- Node → one chip per unit of capacity of each accelerator resource (`[kube] resources`), `<node>-<kind><i>`
  (`nvidia.com/gpu` → `gpu`); NotReady → down, cordoned → maintenance, allocatable below capacity → that many
  (the last) down, deleted → retired.
- ClusterQueue → per flavor, a grant of its nominal quota of the accelerator resources to team = the
  ClusterQueue's name (or its label `[kube] team_label`), with its borrowing and lending limits; in a cohort, the
  team is `<cohort>/<that name>` (the project's `org/team` convention: the `balances_org` view reads the org).
- Workload → job lifecycle (`WorkloadState.step`); its Pods' Nodes → the placement of its start (`place`).
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from decimal import ROUND_CEILING, Decimal
from typing import Iterable, Optional

from chipledger.adapters.common import Event, make_event  # noqa: F401 (the events this mapping makes)

DEFAULT_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu", "google.com/tpu")
DECISION_ANNOTATION = "chipledger.io/preempt-decision"  # set by `kube actuate` on the victim Workload
DECISION_MARK = "chipledger decision "  # how `kube actuate` begins the Evicted condition's message

# ranks within one instant: inventory and quota first, then what frees chips, then new demand, then starts
RANK_POOL, RANK_REGISTER, RANK_CHIP, RANK_QUOTA, RANK_FREE, RANK_SUBMIT, RANK_WAIT, RANK_START, RANK_TICK = range(9)

# Kueue's eviction reasons (Evicted condition) → the ledger's interruption cause (DESIGN §4)
FAILURE_REASONS = frozenset(("PodsReadyTimeout", "NodeFailures"))
PREEMPTION_REASON = "Preempted"


def epoch(ts) -> Optional[int]:
    """An RFC 3339 time (text or datetime) as epoch seconds; None stays None."""
    if ts is None:
        return None
    if isinstance(ts, datetime):
        return int(ts.timestamp())
    return int(datetime.fromisoformat(str(ts).replace("Z", "+00:00")).timestamp())


def iso(t: int) -> str:
    """Epoch seconds as RFC 3339 UTC text."""
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_id(cluster: str, *parts) -> str:
    return "kube:" + ":".join((cluster,) + tuple(str(p) for p in parts))


def quantity(text) -> Decimal:
    """A Kubernetes quantity (`8`, `500m`, `1k`) as a Decimal."""
    from kubernetes.utils import parse_quantity

    return Decimal(parse_quantity(str(text)))


def chips_text(q: Decimal):
    """Chips as the wire wants them: an int when whole, else a number of at most 3 decimals (rounded up)."""
    q = q.quantize(Decimal("0.001"), rounding=ROUND_CEILING)
    return int(q) if q == q.to_integral_value() else float(q)


def short(resource: str) -> str:
    """`nvidia.com/gpu` → `gpu` (the chip id's kind)."""
    return resource.rsplit("/", 1)[-1]


def pool_name(cluster: str, flavor: str) -> str:
    return f"{cluster}/{flavor}"


def _conds(obj: dict) -> dict:
    return {c.get("type"): c for c in ((obj.get("status") or {}).get("conditions") or [])}


# -- views -------------------------------------------------------------------------------------------------------

def flavor_view(obj: dict) -> dict:
    m = obj["metadata"]
    return {"name": m["name"], "uid": m["uid"], "created": epoch(m.get("creationTimestamp")),
            "labels": dict((obj.get("spec") or {}).get("nodeLabels") or {})}


def node_view(obj: dict, resources: Iterable[str]) -> dict:
    m, spec, status = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
    cap, alloc = status.get("capacity") or {}, status.get("allocatable") or {}
    chips = {}
    for r in resources:
        if r in cap or r in alloc:
            c = int(quantity(cap.get(r, alloc.get(r, 0))))
            a = int(quantity(alloc.get(r, cap.get(r, 0))))
            if c > 0:
                chips[r] = [c, max(0, min(a, c))]
    ready = _conds(obj).get("Ready") or {}
    return {"name": m["name"], "uid": m["uid"], "created": epoch(m.get("creationTimestamp")),
            "labels": dict(m.get("labels") or {}), "chips": chips,
            "ready": ready.get("status") == "True", "ready_at": epoch(ready.get("lastTransitionTime")),
            "ready_reason": ready.get("reason") or "", "cordoned": bool(spec.get("unschedulable"))}


def cq_view(obj: dict, resources: Iterable[str], team_label: str = "") -> dict:
    """A ClusterQueue: its accelerator quotas per flavor, in chips (None: no limit)."""
    m, spec = obj["metadata"], obj.get("spec") or {}
    res = set(resources)
    quotas = {}
    for group in spec.get("resourceGroups") or []:
        for fl in group.get("flavors") or []:
            for r in fl.get("resources") or []:
                if r.get("name") in res:
                    q = quotas.setdefault(fl["name"], {"nominal": Decimal(0), "borrow": None, "lend": None})
                    q["nominal"] += quantity(r.get("nominalQuota", 0))
                    for key, field in (("borrow", "borrowingLimit"), ("lend", "lendingLimit")):
                        if r.get(field) is not None:
                            q[key] = (q[key] or Decimal(0)) + quantity(r[field])
    changed = [epoch(f.get("time")) for f in (m.get("managedFields") or []) if not f.get("subresource") and f.get("time")]
    team = ((m.get("labels") or {}).get(team_label) if team_label else None) or m["name"]
    cohort = spec.get("cohortName") or spec.get("cohort") or ""
    return {"name": m["name"], "uid": m["uid"], "generation": int(m.get("generation") or 1),
            "created": epoch(m.get("creationTimestamp")), "changed": max(changed) if changed else None,
            "team": team_of(team, cohort), "cohort": cohort,
            "quotas": {f: {k: (None if v is None else chips_text(v)) for k, v in q.items()} for f, q in quotas.items()}}


def team_of(name: str, cohort: str) -> str:
    """The ledger's team of a ClusterQueue: `<cohort>/<name>` in a cohort (the org is the cohort: the project's
    `org/team` convention, as Slurm's parent accounts), else its name."""
    return f"{cohort}/{name}" if cohort else name


def lq_view(obj: dict) -> dict:
    m = obj["metadata"]
    return {"key": f"{m['namespace']}/{m['name']}", "cq": (obj.get("spec") or {}).get("clusterQueue") or ""}


def _pod_chips(template: dict, resources: set) -> dict:
    out: dict = {}
    spec = template.get("spec") or {}
    for c in (spec.get("containers") or []):
        rr = c.get("resources") or {}
        for r in resources:
            v = (rr.get("requests") or {}).get(r, (rr.get("limits") or {}).get(r))
            if v is not None:
                out[r] = out.get(r, Decimal(0)) + quantity(v)
    return out


def workload_view(obj: dict, resources: Iterable[str]) -> dict:
    """What the ledger needs of a Workload: identity, demand, queue, admission and the conditions' times."""
    m, spec, status = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
    res = set(resources)
    total, per_pod, pods = Decimal(0), None, 0
    for ps in spec.get("podSets") or []:
        count = int(ps.get("count", 1))
        chips = sum(_pod_chips(ps.get("template") or {}, res).values(), Decimal(0))
        if chips > 0:
            total += chips * count
            pods += count
            per_pod = chips if per_pod in (None, chips) else Decimal(-1)
    adm = status.get("admission") or {}
    flavors = sorted({f for psa in (adm.get("podSetAssignments") or []) for r, f in (psa.get("flavors") or {}).items()
                      if r in res})
    conds = {}
    for t, c in _conds(obj).items():
        conds[t] = [c.get("status"), epoch(c.get("lastTransitionTime")), c.get("reason") or "", c.get("message") or ""]
    return {"uid": m["uid"], "name": m["name"], "namespace": m.get("namespace") or "",
            "created": epoch(m.get("creationTimestamp")), "deleted": epoch(m.get("deletionTimestamp")),
            "queue": spec.get("queueName") or "", "priority": int(spec.get("priority") or 0),
            "active": spec.get("active", True) is not False,
            "chips": chips_text(total) if total > 0 else 0,
            "chips_per_node": int(per_pod) if per_pod is not None and per_pod > 0 and per_pod == int(per_pod) and pods > 1 else None,
            "cq": adm.get("clusterQueue") or "", "flavors": flavors, "conds": conds,
            "decision": (m.get("annotations") or {}).get(DECISION_ANNOTATION) or "",
            "owners": sorted({o["uid"] for o in (m.get("ownerReferences") or []) if o.get("uid")}),
            "evictions": {e.get("reason") or "": int(e.get("count") or 0)
                          for e in ((status.get("schedulingStats") or {}).get("evictions") or [])}}


POD_SELECTOR = "kueue.x-k8s.io/podset"  # the label Kueue puts on the Pods of the workloads it admits


def pod_view(obj: dict, resources: Iterable[str]) -> dict:
    """A Pod of a Kueue workload: its Node once bound, the accelerators it asks (whole chips, rounded up), and the
    uids that tie it to its Workload (its controller owner's: a Job's Workload is owned by that Job; and its own: a
    plain Pod's or a pod group's Workload is owned by the Pods)."""
    m, spec, status = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
    chips = sum(_pod_chips({"spec": spec}, set(resources)).values(), Decimal(0))
    owners = {o["uid"] for o in (m.get("ownerReferences") or []) if o.get("controller") and o.get("uid")}
    return {"uid": m["uid"], "node": spec.get("nodeName") or "", "created": epoch(m.get("creationTimestamp")),
            "owners": sorted(owners | {m["uid"]}), "chips": int(chips.to_integral_value(ROUND_CEILING)),
            "gone": bool(m.get("deletionTimestamp")) or status.get("phase") in ("Succeeded", "Failed")}


def place(job_owners: list, job_chips, started: int, pods: Iterable[dict], node_chips: dict, taken) -> Optional[list]:
    """The chips of a started job, from its Pods' Nodes: each bound Pod of this run (created at or after the start,
    not gone) takes the first chips of its Node (`chip_ids` order) that no other placed job holds, as many as it asks.
    Kubernetes does not say which device of a Node a Pod holds, so the chip names within a Node are the watcher's
    choice; the Node is the Pod's. None unless every Pod is bound and the chips cover the job (the start then goes
    out without placement). `node_chips`: node → its chip ids in the job's pool; `taken`: chip ids held."""
    owners = set(job_owners)
    mine = sorted((p for p in pods if owners.intersection(p["owners"]) and not p["gone"] and p["chips"] > 0
                   and (p["created"] or 0) >= started), key=lambda p: p["uid"])
    need = Decimal(str(job_chips)).to_integral_value(ROUND_CEILING)
    if not mine or sum(p["chips"] for p in mine) < need:
        return None
    out: list = []
    for p in mine:
        if not p["node"] or p["node"] not in node_chips:
            return None
        free = [c for c in node_chips[p["node"]] if c not in taken and c not in out]
        if len(free) < p["chips"]:
            return None
        out.extend(free[: p["chips"]])
    return out


# -- inventory -----------------------------------------------------------------------------------------------------

def flavor_of_node(node: dict, flavors: dict) -> Optional[str]:
    """The flavor whose nodeLabels the node carries: the most specific (most labels), then by name. A flavor without
    labels matches any node (Kueue's meaning), so it is the last resort."""
    best = None
    for name in sorted(flavors):
        labels = flavors[name]["labels"]
        if all(node["labels"].get(k) == v for k, v in labels.items()):
            if best is None or len(labels) > len(flavors[best]["labels"]):
                best = name
    return best


def chip_ids(node: dict) -> list[str]:
    return [f"{node['name']}-{short(r)}{i}" for r, (cap, _) in sorted(node["chips"].items()) for i in range(cap)]


def chip_states(node: dict) -> dict:
    """chip id → (state, reason) of a node's chips: NotReady → down, cordoned → maintenance, allocatable below
    capacity → the last (capacity − allocatable) chips of that resource down."""
    out = {}
    for r, (cap, alloc) in sorted(node["chips"].items()):
        for i in range(cap):
            cid = f"{node['name']}-{short(r)}{i}"
            if not node["ready"]:
                out[cid] = ("down", f"NotReady: {node['ready_reason']}" if node["ready_reason"] else "NotReady")
            elif node["cordoned"]:
                out[cid] = ("maintenance", "cordoned (spec.unschedulable)")
            elif i >= alloc:
                out[cid] = ("down", f"allocatable {r} {alloc} of {cap}")
            else:
                out[cid] = ("healthy", None)
    return out


# -- workloads -----------------------------------------------------------------------------------------------------

def cause_of(reason: str, decision: Optional[str]) -> str:
    """The interruption cause (DESIGN §4) of an eviction: a decision's id makes it a preemption whatever Kueue called
    it; Kueue's own preemption is one; a node or pods-ready failure is a failure; anything else (an admin's
    deactivation, a stopped queue, an admission check) is a requeue."""
    if decision or reason == PREEMPTION_REASON:
        return "preempted"
    if reason in FAILURE_REASONS:
        return "failure"
    return "requeued"


def decision_in(message: str) -> Optional[str]:
    """The decision id `kube actuate` wrote at the start of the Evicted condition's message, if any."""
    message = message.removeprefix("Previously: ")  # Kueue's Evicted=False after the Workload is admitted again
    if message.startswith(DECISION_MARK):
        rest = message[len(DECISION_MARK):].split()
        return rest[0].rstrip(":") or None if rest else None  # (ids contain ':'; the id is followed by ': ')
    return None


def message_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]
