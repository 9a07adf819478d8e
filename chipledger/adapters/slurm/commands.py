"""Slurm's own commands, run and parsed: the only place chipledger talks to Slurm.

JSON where Slurm 22.05 has it (`sacct --json`, `sinfo --json`), parsable text otherwise (`sacctmgr -P`,
`scontrol show config`). Every command runs with TZ=UTC and SLURM_TIME_FORMAT=standard, so the few text times
read back are UTC. A command that fails raises `SlurmError` with its stderr (the watcher logs it and retries
at the next poll; the CLI prints it without a traceback).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from datetime import datetime, timezone
from typing import Optional, Sequence

from chipledger.adapters.slurm.mapping import (Assoc, Node, Run, clamp_priority, gpu_limits, gpus_of_tres, gres_gpus,
                                      state_word)

TIMEOUT_S = 120


class SlurmError(RuntimeError):
    """A Slurm command is missing, failed, or printed something that is not what it should print."""


def _env() -> dict:
    env = dict(os.environ)
    env["TZ"] = "UTC"
    env["SLURM_TIME_FORMAT"] = "standard"
    return env


def run(args: Sequence[str], timeout: float = TIMEOUT_S) -> str:
    if shutil.which(args[0]) is None:
        raise SlurmError(f"{args[0]} not found on PATH: install Slurm's client commands (Debian: slurm-client) "
                         f"and point SLURM_CONF at the cluster's slurm.conf")
    try:
        p = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=_env())
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(args)}` did not answer within {timeout:g}s") from None
    if p.returncode != 0:
        raise SlurmError(f"`{' '.join(args)}` failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()[:500]}")
    return p.stdout


def _json(args: Sequence[str]) -> dict:
    out = run(args)
    try:
        doc = json.loads(out)
    except json.JSONDecodeError as e:
        raise SlurmError(f"`{' '.join(args)}` did not print JSON ({e}); Slurm 22.05 or newer is needed") from None
    errors = [e for e in doc.get("errors") or () if not (isinstance(e, dict) and e.get("error_number") == 9003)]
    if errors:  # 9003 "Nothing found": an empty answer, not a failure
        raise SlurmError(f"`{' '.join(args)}` reported errors: {errors}")
    return doc


def utc_text(epoch_s: int) -> str:
    return datetime.fromtimestamp(epoch_s, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


def parse_utc(text: str) -> Optional[int]:
    s = (text or "").strip()
    if not s or s.lower() in ("unknown", "none", "n/a", "invalid"):
        return None
    if s.isdigit():
        return int(s)
    return int(datetime.fromisoformat(s).replace(tzinfo=timezone.utc).timestamp())


def cluster_name() -> str:
    for line in run(["scontrol", "show", "config"]).splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "ClusterName":
            return value.strip()
    raise SlurmError("`scontrol show config` has no ClusterName")


def _time(value) -> Optional[int]:
    if isinstance(value, dict):  # newer data_parser versions: {"set": true, "number": N}
        if not value.get("set", True):
            return None
        value = value.get("number")
    if isinstance(value, int) and value > 0:
        return value
    return None


def _tres_items(items) -> list[tuple[str, int]]:
    out = []
    for x in items or ():
        t, name, count = x.get("type"), x.get("name"), x.get("count")
        if not isinstance(count, int):
            continue
        out.append((f"{t}/{name}" if name else str(t), count))
    return out


def _task_ids(spec: str) -> list[str]:
    """`[1-3,7]` / `1-3%2` → task ids (a pending array's tasks not split off yet)."""
    body = spec.strip().strip("[]").split("%", 1)[0]
    ids: list[str] = []
    for item in body.split(","):
        lo, _, rest = item.partition("-")
        if not lo.strip().isdigit():
            continue
        hi, _, step = rest.partition(":")
        a = int(lo)
        b = int(hi) if hi.strip().isdigit() else a
        st = int(step) if step.strip().isdigit() else 1
        ids.extend(str(i) for i in range(a, b + 1, max(st, 1)))
        if len(ids) > 10_000:
            break
    return ids


def runs_from_sacct_json(doc: dict) -> list[Run]:
    """The `Run`s of `sacct --json` (22.05's openapi v0.0.38 layout)."""
    out: list[Run] = []
    for j in doc.get("jobs", ()):
        arr = j.get("array") or {}
        het = j.get("het") or {}
        base = [str(j.get("job_id"))]
        if arr.get("task_id") is not None:
            base = [f"{arr.get('job_id')}_{arr.get('task_id')}"]
        elif isinstance(arr.get("task"), str) and arr.get("task"):
            base = [f"{arr.get('job_id') or j.get('job_id')}_{t}" for t in _task_ids(arr["task"])]
        elif het.get("job_offset") is not None:
            base = [f"{het.get('job_id')}+{het.get('job_offset')}"]
        t = j.get("time") or {}
        state = state_word(str((j.get("state") or {}).get("current", "")))
        alloc = _tres_items((j.get("tres") or {}).get("allocated"))
        gpus, gtype = gpus_of_tres(alloc)
        nodes = dict(alloc).get("node")
        start = _time(t.get("start"))
        if gpus <= 0 and start is None:
            req = _tres_items((j.get("tres") or {}).get("requested"))
            gpus, gtype = gpus_of_tres(req)
            nodes = dict(req).get("node")
        comment = j.get("comment") or {}
        prio = j.get("priority")
        prio = _time(prio) if isinstance(prio, dict) else prio
        for job_id in base:
            out.append(Run(job_id=job_id, account=str(j.get("account") or ""), user=str(j.get("user") or ""),
                           partition=str(j.get("partition") or ""), submit=_time(t.get("submission")) or 0,
                           eligible=_time(t.get("eligible")), start=start, end=_time(t.get("end")), state=state,
                           gpus=gpus, nodes=nodes, priority=clamp_priority(prio if isinstance(prio, int) else 0),
                           admin_comment=str(comment.get("administrator") or ""), gpu_type=gtype))
    return out


def sacct_runs(since: int, until: Optional[int] = None) -> list[Run]:
    """Every run (`-D`) of every user's jobs (`-a`), allocations only (`-X`), active at or after `since`. Without
    `until` the window ends a day ahead: sacct leaves out a run whose Eligible is after the window's end, and a
    requeued job's next run is eligible only after its hold-off (measured on 22.05: with the default end, `now`,
    a run cancelled while held is listed only once its Eligible has passed, after its cancel)."""
    args = ["sacct", "-a", "-D", "-X", "--json", "-S", utc_text(since), "-E",
            "now+1days" if until is None else utc_text(until)]
    return runs_from_sacct_json(_json(args))


def queue_from_squeue_json(doc: dict) -> list[tuple[str, str, Optional[int], Optional[int], Optional[int]]]:
    """(job id as printed, state, eligible, start, end) of the jobs the controller holds (`squeue --json`)."""
    out = []
    for j in doc.get("jobs", ()):
        if j.get("array_task_id") is not None and j.get("array_job_id"):
            job_id = f"{j['array_job_id']}_{j['array_task_id']}"
        elif j.get("het_job_id"):
            job_id = f"{j['het_job_id']}+{j.get('het_job_offset') or 0}"
        else:
            job_id = str(j.get("job_id"))
        state = state_word(str(j.get("job_state", "")))
        out.append((job_id, state, _time(j.get("eligible_time")), _time(j.get("start_time")),
                    _time(j.get("end_time"))))
    return out


def queue() -> list[tuple[str, str, Optional[int], Optional[int], Optional[int]]]:
    return queue_from_squeue_json(_json(["squeue", "-a", "--json"]))


def nodes_from_sinfo_json(doc: dict) -> list[Node]:
    out = []
    for n in doc.get("nodes", ()):
        gpus, gtype = gres_gpus(str(n.get("gres") or ""))
        state = n.get("state")
        states = [state] if isinstance(state, str) else list(state or ())
        states += list(n.get("state_flags") or ())
        out.append(Node(name=str(n.get("name")), gpus=gpus, gpu_type=gtype,
                        partitions=tuple(n.get("partitions") or ()), states=tuple(s.upper() for s in states),
                        reason=str(n.get("reason") or "")))
    return out


def _field(line: str, key: str) -> str:
    m = re.search(rf"(?:^|\s){key}=(\S*)", line)
    return m.group(1) if m else ""


def nodes_from_scontrol_text(text: str) -> list[Node]:
    """Nodes from `scontrol show node -o` (one line a node; 22.05 has no --json for scontrol)."""
    out = []
    for line in text.splitlines():
        name = _field(line, "NodeName")
        if not name:
            continue
        gpus, gtype = gres_gpus(_field(line, "Gres"))
        states = tuple(w for w in _field(line, "State").upper().split("+") if w)
        parts = tuple(p for p in _field(line, "Partitions").split(",") if p)
        m = re.search(r"(?:^|\s)Reason=(.*?)(?:\s\[[^\]]*\])?\s*$", line)
        out.append(Node(name=name, gpus=gpus, gpu_type=gtype, partitions=parts, states=states,
                        reason=m.group(1).strip() if m else ""))
    return out


def with_future(listed: list[Node], future: list[Node]) -> list[Node]:
    """The nodes sinfo lists, and the FUTURE ones it does not (from `scontrol -F -o show node`): Slurm 22.05
    keeps a node set to FUTURE in the cluster's TRES and records it as DOWN in slurmdbd (sreport counts it as
    Down), while sinfo stops listing it. Kept in the inventory, its GPUs are `down` for that node event, not
    retired (docs/slurm.md, the mapping)."""
    names = {n.name for n in listed}
    return listed + [n for n in future if n.name not in names and "FUTURE" in n.states]


def nodes() -> list[Node]:
    return with_future(nodes_from_sinfo_json(_json(["sinfo", "--json"])),
                       nodes_from_scontrol_text(run(["scontrol", "-F", "-o", "show", "node"])))


ASSOC_FORMAT = "id,account,user,partition,grptres"


def assocs_from_text(text: str) -> list[Assoc]:
    """`sacctmgr -P show assoc format=id,account,user,partition,grptres` (with or without its header line)."""
    out = []
    lines = [ln for ln in text.splitlines() if ln.strip()]
    cols = ["id", "account", "user", "partition", "grptres"]
    if lines and "account" in lines[0].lower() and "|" in lines[0] and not lines[0].split("|")[0].strip().isdigit():
        cols = [c.strip().lower() for c in lines[0].split("|")]
        lines = lines[1:]
    for ln in lines:
        f = dict(zip(cols, ln.split("|")))
        limits = gpu_limits(f.get("grptres", ""))
        if not limits:
            continue
        out.append(Assoc(assoc_id=f.get("id", "").strip() or f.get("account", "").strip(),
                         account=f.get("account", "").strip(), user=f.get("user", "").strip(),
                         partition=f.get("partition", "").strip(), gpus_by_type=limits))
    return out


PARENT_FORMAT = "account,user,parentname"


def account_parents_from_text(text: str) -> dict[str, str]:
    """account -> its parent account, from `sacctmgr -P show assoc format=account,user,parentname` (with or
    without its header line): the account associations' ParentName (`root` for a top-level account)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    cols = ["account", "user", "parentname"]
    if lines and "account" in lines[0].lower() and "par" in lines[0].lower():
        cols = [c.strip().lower().replace(" ", "") for c in lines[0].split("|")]
        cols = ["parentname" if c in ("parname", "parentname") else c for c in cols]
        lines = lines[1:]
    out = {}
    for ln in lines:
        f = dict(zip(cols, ln.split("|")))
        account, user, parent = (f.get(k, "").strip() for k in ("account", "user", "parentname"))
        if account and not user and parent:
            out[account] = parent
    return out


def account_parents(cluster: str) -> dict[str, str]:
    return account_parents_from_text(run(["sacctmgr", "-n", "-P", "show", "assoc", f"cluster={cluster}",
                                          f"format={PARENT_FORMAT}"]))


def assocs(cluster: str) -> list[Assoc]:
    return assocs_from_text(run(["sacctmgr", "-n", "-P", "show", "assoc", f"cluster={cluster}",
                                 f"format={ASSOC_FORMAT}"]))


def cluster_registered_at(cluster: str) -> Optional[int]:
    """When the controller first registered the cluster's TRES with slurmdbd (`sacctmgr show event
    event=cluster`): the instant from which sreport counts its capacity."""
    text = run(["sacctmgr", "-n", "-P", "show", "event", "all_time", "event=cluster", f"clusters={cluster}",
                "format=start"])
    times = [t for t in (parse_utc(x) for x in text.split()) if t is not None]
    return min(times) if times else None


def node_events_from_text(text: str) -> list[tuple[str, int, Optional[int], str, str]]:
    """(node, start, end or None, state, reason) from `sacctmgr -n -P show event event=node
    format=nodename,start,end,state,reason`."""
    out = []
    for line in text.splitlines():
        f = line.split("|")
        if len(f) < 4 or not f[0].strip():
            continue
        start = parse_utc(f[1])
        if start is None:
            continue
        out.append((f[0].strip(), start, parse_utc(f[2]), f[3].strip().upper(), f[4].strip() if len(f) > 4 else ""))
    return out


def node_events(cluster: str, since: int) -> list[tuple[str, int, Optional[int], str, str]]:
    """Node down/drain periods slurmdbd recorded (the ones sreport counts as Down), open at or after `since`."""
    return node_events_from_text(run(["sacctmgr", "-n", "-P", "show", "event", "event=node", f"clusters={cluster}",
                                      f"start={utc_text(since)}", "format=nodename,start,end,state,reason"]))


def reservations_from_text(text: str) -> list[tuple[str, int, Optional[int], str]]:
    """Maintenance periods (node, start, end or None, reservation name) from `sacctmgr -n -P show reservation
    format=name,nodenames,start,end,flags`: the reservations flagged MAINT and not IGNORE_JOBS (those sreport
    counts as PLND Down), one row per node of each."""
    from chipledger.adapters.slurm.mapping import hostnames

    out = []
    for line in text.splitlines():
        f = line.split("|")
        if len(f) < 5 or not f[0].strip() or f[0].strip().lower() == "name":
            continue
        flags = {x.strip().upper() for x in f[4].split(",")}
        if "MAINT" not in flags or "IGNORE_JOBS" in flags:
            continue
        start = parse_utc(f[2])
        if start is None:
            continue
        end = parse_utc(f[3])
        out += [(node, start, end, f[0].strip()) for node in hostnames(f[1].strip())]
    return out


def reservations(cluster: str, since: int) -> list[tuple[str, int, Optional[int], str]]:
    """Maintenance reservations slurmdbd recorded (sreport's PLND Down), with their exact start and end."""
    return reservations_from_text(run(["sacctmgr", "-n", "-P", "show", "reservation", f"clusters={cluster}",
                                       f"start={utc_text(since)}", "format=name,nodenames,start,end,flags"]))


def requeue(job_id: str) -> None:
    run(["scontrol", "requeue", job_id])


def cancel(job_id: str) -> None:
    run(["scancel", job_id])


def mark(job_id: str, comment: str) -> None:
    run(["scontrol", "update", f"jobid={job_id}", f"AdminComment={comment}"])


def job_state(job_id: str) -> Optional[str]:
    """The job's state in the controller (`squeue`), None when it is no longer there."""
    try:
        out = run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    except SlurmError as e:
        if "Invalid job id" in str(e):
            return None
        raise
    s = out.strip().split()
    return s[0].upper() if s else None


# --- billing weights and TRES-minute budgets (`slurm watch --prices`) ----------------------------------------------
ASSOC_MINS_FORMAT = "id,account,user,partition,grptresmins"


def partition_billing_from_text(text: str) -> dict[str, str]:
    """`scontrol show partition -o` → {partition: its TRESBillingWeights text} (partitions that set them)."""
    out = {}
    for line in text.splitlines():
        name = _field(line, "PartitionName")
        weights = _field(line, "TRESBillingWeights")
        if name and weights and weights != "(null)":
            out[name] = weights
    return out


def partition_billing() -> dict[str, str]:
    return partition_billing_from_text(run(["scontrol", "show", "partition", "-o"]))


def assoc_mins_from_text(text: str) -> list[tuple[str, str, str, str, str]]:
    """`sacctmgr -P show assoc format=id,account,user,partition,grptresmins` → (id, account, user, partition,
    GrpTRESMins) of the associations that set a GPU or billing limit."""
    out = []
    lines = [ln for ln in text.splitlines() if ln.strip()]
    cols = ASSOC_MINS_FORMAT.split(",")
    if lines and "account" in lines[0].lower() and not lines[0].split("|")[0].strip().isdigit():
        cols = [c.strip().lower() for c in lines[0].split("|")]
        lines = lines[1:]
    for ln in lines:
        f = dict(zip(cols, ln.split("|")))
        mins = f.get("grptresmins", "").strip()
        if "gpu" not in mins.lower() and "billing" not in mins.lower():
            continue
        out.append((f.get("id", "").strip() or f.get("account", "").strip(), f.get("account", "").strip(),
                    f.get("user", "").strip(), f.get("partition", "").strip(), mins))
    return out


def assoc_mins(cluster: str) -> list[tuple[str, str, str, str, str]]:
    return assoc_mins_from_text(run(["sacctmgr", "-n", "-P", "show", "assoc", f"cluster={cluster}",
                                     f"format={ASSOC_MINS_FORMAT}"]))
