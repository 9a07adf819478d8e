"""The Alibaba GPU cluster trace v2023 ("openb", Weng et al., ATC 2023) as chipledger events.

Owns the mapping from the trace's two CSV files to the wire contract (docs/importers.md, "Alibaba GPU v2023"):

- `openb_node_list_gpu_node.csv`: each GPU model is one pool `alibaba-openb/<model lowercased>`; a
  `pool.configured` (flavor = the model, `chips_per_node` = the most common GPU count of its nodes) and a
  `chip.registered` per GPU (`<sn>-g<i>`) at trace second 0. Nodes without GPUs or model are not pools.
- `openb_pod_list_default.csv`: each pod with GPUs is one job (id = pod name). `creation_time` →
  `job.submitted`, `scheduled_time` → `job.started` (no chip ids: the trace has no placement),
  `deletion_time` → `job.finished` (outcome from `pod_phase`; see `_finish`). CPU-only pods are skipped.

Trace seconds are offsets from an unpublished origin; they map onto `start + seconds` (default
`DEFAULT_START`). The trace says neither who owns a pod nor which GPU model it ran on, so the team is one per
QoS class (`qos/ls`, ...) and the pool is chosen by a weighted hash of the pod name (see `_PoolChooser`).
"""

from __future__ import annotations

import csv
import hashlib
from bisect import bisect_right
from collections import Counter
from datetime import datetime, timezone
from decimal import Decimal
from itertools import accumulate
from pathlib import Path
from typing import Iterator, Optional

from chipledger.adapters.importers.base import ImportReport, TraceFormatError, TraceWriter, epoch

DEFAULT_START = datetime(2023, 1, 1, tzinfo=timezone.utc)
"""Where trace second 0 lands. The release gives only relative seconds; 2023-01-01 is a documented stand-in
near the trace's publication (ATC 2023), so dates read as plausible while durations stay exact."""

NODE_FILE = "openb_node_list_gpu_node.csv"
POD_FILE = "openb_pod_list_default.csv"
SOURCE = "alibaba-openb"
POOL_PREFIX = "alibaba-openb/"
NODE_COLUMNS = ("sn", "gpu", "model")
POD_COLUMNS = ("name", "num_gpu", "gpu_milli", "qos", "pod_phase", "creation_time", "scheduled_time",
               "deletion_time")

# QoS class → (team, priority, preemptible). The trace has no user or team column; the QoS class is the only
# ownership-like grouping it has, and it orders priority the way Kubernetes QoS does.
QOS = {
    "Guaranteed": ("qos/guaranteed", 300, False),
    "LS": ("qos/ls", 200, False),
    "Burstable": ("qos/burstable", 100, False),
    "BE": ("qos/be", 0, True),
}
PHASES = ("Succeeded", "Failed", "Running", "Pending")
_OUTCOME = {"Succeeded": "succeeded", "Failed": "failed", "Running": "cancelled", "Pending": "cancelled"}
MILLI = 1000


def import_alibaba_openb(src_dir: Path, out: Path, start: datetime = DEFAULT_START) -> ImportReport:
    """Convert the openb trace in `src_dir` to event JSONL at `out`; returns what was read, written and skipped.

    `report.rows_read` counts pod rows (one per pod); node rows are counted in a note, and node rows left out
    are counted in `report.skipped` under `node_*` reasons. Raises TraceFormatError when a file is missing or
    lacks a needed column, or there is no GPU node."""
    src_dir, out = Path(src_dir), Path(out)
    node_path, pod_path = src_dir / NODE_FILE, src_dir / POD_FILE
    for p in (node_path, pod_path):
        if not p.is_file():
            raise TraceFormatError(f"{p} not found: the openb trace folder needs {NODE_FILE} and {POD_FILE}")
    t0 = epoch(start)
    report = ImportReport(source=str(src_dir), output=str(out))
    pools = _read_nodes(node_path, report)
    end_s, in_order = _scan_pods(pod_path)
    end = t0 + end_s

    writer = TraceWriter(out, report, SOURCE, "openb")
    for pool in pools.values():
        writer.emit(t0, "pool.configured", pool.name, flavor=pool.model, chips_per_node=pool.chips_per_node)
        for sn, gpus in pool.nodes:
            for i in range(gpus):
                writer.emit(t0, "chip.registered", pool.name, chip_id=f"{sn}-g{i}", node=sn)
    chooser = _PoolChooser(pools.values())
    stats: Counter = Counter()
    jobs: set[str] = set()
    for row in (_read_rows(pod_path) if in_order else _sorted_rows(pod_path)):
        report.rows_read += 1
        job = _parse_pod(row, stats)
        if isinstance(job, str):
            report.skipped[job] += 1
            continue
        name, chips_milli, num_gpu, qos, phase, created, scheduled, deleted = job
        if name in jobs:
            report.skipped["duplicate_pod"] += 1
            continue
        pool = chooser.choose(name, num_gpu)
        if pool is None:
            report.skipped["no_pool_fits"] += 1
            continue
        jobs.add(name)
        writer.advance(t0 + created)  # rows come in creation order: nothing later can be due before it
        team, priority, preemptible = QOS[qos]
        writer.emit(t0 + created, "job.submitted", pool, job_id=name, team=team, chips=_chips(chips_milli),
                    priority=priority, preemptible=preemptible)
        stats[f"jobs in {pool}"] += 1
        started = scheduled is not None and phase != "Pending"
        if started:
            writer.emit(t0 + scheduled, "job.started", pool, job_id=name)
        outcome = _finish(phase, deleted, end_s)
        if outcome is not None:
            writer.emit(t0 + deleted, "job.finished", pool, job_id=name, outcome=outcome)
            stats[f"{phase} pods: finished {outcome}"] += 1
        else:
            stats[f"{phase} pods: still {'running' if started else 'pending'} at the end"] += 1
    writer.close(end)
    report.notes.append(f"trace second 0 = {start.isoformat()}; trace end = second {end_s} = {report.last_at}")
    report.notes.append(f"{POD_FILE} is {'sorted' if in_order else 'NOT sorted (sorted in memory)'} by creation_time")
    report.notes.append("teams are QoS classes (the trace has no user column); pods are spread over pools by a "
                        "hash of the pod name weighted by the GPUs that fit them (the trace has no placement)")
    for key in sorted(stats):
        report.notes.append(f"{key}: {stats[key]:,}")
    return report


# ---------------------------------------------------------------------------------------------------------
# nodes → pools
# ---------------------------------------------------------------------------------------------------------

class _Pool:
    def __init__(self, model: str):
        self.model = model
        self.name = POOL_PREFIX + model.lower()
        self.nodes: list[tuple[str, int]] = []

    @property
    def gpus(self) -> int:
        return sum(g for _, g in self.nodes)

    @property
    def chips_per_node(self) -> int:
        # the most common GPU count; a tie goes to the larger count
        counts = Counter(g for _, g in self.nodes)
        return max(counts, key=lambda g: (counts[g], g))

    def gpus_fitting(self, num_gpu: int) -> int:
        """GPUs on the nodes that can hold a pod asking `num_gpu` whole GPUs (a pod runs on one node)."""
        return sum(g for _, g in self.nodes if g >= num_gpu)


def _read_nodes(path: Path, report: ImportReport) -> dict[str, _Pool]:
    pools: dict[str, _Pool] = {}
    seen: set[str] = set()
    rows = 0
    for row in _read_rows(path, NODE_COLUMNS):
        rows += 1
        sn, model = (row.get("sn") or "").strip(), (row.get("model") or "").strip()
        gpus = _int(row.get("gpu"))
        if not sn or gpus is None:
            report.skipped["node_bad_row"] += 1
        elif gpus == 0 or not model:
            report.skipped["node_without_gpu"] += 1
        elif sn in seen:
            report.skipped["node_duplicate"] += 1
        else:
            seen.add(sn)
            pools.setdefault(model, _Pool(model)).nodes.append((sn, gpus))
    report.notes.append(f"{NODE_FILE}: {rows:,} node rows, {sum(len(p.nodes) for p in pools.values()):,} GPU nodes, "
                        f"{sum(p.gpus for p in pools.values()):,} GPUs")
    if not pools:
        raise TraceFormatError(f"{path}: no GPU node (a row with gpu > 0 and a model)")
    names = Counter(p.name for p in pools.values())
    clash = [n for n, k in names.items() if k > 1]
    if clash:
        raise TraceFormatError(f"{path}: GPU models differ only in case, so their pools clash: {', '.join(clash)}")
    return {m: pools[m] for m in sorted(pools, key=lambda m: pools[m].name)}


class _PoolChooser:
    """Which pool a pod is charged to: a weighted hash of the pod name.

    The trace does not say which GPU model a pod ran on. Each pod asking k whole GPUs (k = 1 for a share) may
    go to any pool with a node of at least k GPUs; among those, the pool is picked by blake2b(pod name)
    modulo the total of those pools' fitting GPUs, so a pool's expected share of pods is its share of the
    capacity that can hold them. The choice depends on the pod name alone: it is the same on every run,
    whatever the row order or `start`."""

    def __init__(self, pools):
        self.pools = list(pools)
        self._cache: dict[int, Optional[tuple[list[str], list[int]]]] = {}

    def _table(self, num_gpu: int):
        if num_gpu not in self._cache:
            fits = [(p.name, p.gpus_fitting(num_gpu)) for p in self.pools]
            fits = [(n, w) for n, w in fits if w > 0]
            self._cache[num_gpu] = ([n for n, _ in fits], list(accumulate(w for _, w in fits))) if fits else None
        return self._cache[num_gpu]

    def choose(self, pod: str, num_gpu: int) -> Optional[str]:
        table = self._table(max(num_gpu, 1))
        if table is None:
            return None
        names, cumulative = table
        h = int.from_bytes(hashlib.blake2b(pod.encode(), digest_size=8).digest(), "big") % cumulative[-1]
        return names[bisect_right(cumulative, h)]


# ---------------------------------------------------------------------------------------------------------
# pods → jobs
# ---------------------------------------------------------------------------------------------------------

def _finish(phase: str, deleted: Optional[int], end_s: int) -> Optional[str]:
    """The outcome of a pod's `job.finished`, or None when the job stays open at the end of the trace.

    Every pod in the release has a deletion_time; those of 34 Running pods equal the trace's last timestamp,
    i.e. the pods were still up when the trace was cut. So a Running or Pending pod deleted at or after the
    end stays running or pending; one deleted earlier was stopped/evicted (Running) or withdrawn before it was
    placed (Pending): cancelled. Succeeded and Failed pods finish at their deletion time whatever it is."""
    if deleted is None:
        return None
    if phase in ("Running", "Pending") and deleted >= end_s:
        return None
    return _OUTCOME[phase]


def _parse_pod(row: dict, stats: Counter):
    """(name, chips_milli, num_gpu, qos, phase, created, scheduled, deleted) or a skip reason."""
    name = (row.get("name") or "").strip()
    if not name:
        return "missing_name"
    num_gpu = _int(row.get("num_gpu"))
    if num_gpu is None:
        return "bad_num_gpu"
    if num_gpu == 0:
        return "cpu_only"
    chips_milli = num_gpu * MILLI
    if num_gpu == 1:
        gpu_milli = _int(row.get("gpu_milli"))
        if gpu_milli is None or gpu_milli == 0:
            return "bad_gpu_milli"
        chips_milli = min(gpu_milli, MILLI)
    qos = (row.get("qos") or "").strip()
    if qos not in QOS:
        return "unknown_qos"
    phase = (row.get("pod_phase") or "").strip()
    if phase not in PHASES:
        return "unknown_phase"
    created = _int(row.get("creation_time"))
    if created is None:
        return "bad_creation_time"
    scheduled = _int(row.get("scheduled_time"), empty=True)
    if scheduled is False:
        return "bad_scheduled_time"
    deleted = _int(row.get("deletion_time"), empty=True)
    if deleted is False:
        return "bad_deletion_time"
    if (scheduled is not None and scheduled < created) or \
            (deleted is not None and deleted < max(created, scheduled or 0)):
        return "times_out_of_order"
    if phase == "Pending" and scheduled is not None:
        stats["Pending with a scheduled_time (not started)"] += 1
    return name, chips_milli, num_gpu, qos, phase, created, scheduled, deleted


def _chips(milli: int):
    return milli // MILLI if milli % MILLI == 0 else float(Decimal(milli) / MILLI)


def _int(text, empty: bool = False):
    """A non-negative integer field. Empty: None when `empty` allows it. Garbled or negative: None, or False
    when `empty` is set (so that an empty field and a bad one can be told apart)."""
    bad = False if empty else None
    if text is None or not text.strip():
        return None
    text = text.strip()
    try:
        v = int(text)
    except ValueError:
        try:
            f = float(text)
        except ValueError:
            return bad
        if not f.is_integer():
            return bad
        v = int(f)
    return v if v >= 0 else bad


def _read_rows(path: Path, columns=POD_COLUMNS) -> Iterator[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceFormatError(f"{path}: missing column(s) {', '.join(missing)}; "
                                   f"found {', '.join(reader.fieldnames or []) or 'no header'}")
        yield from reader


def _scan_pods(path: Path) -> tuple[int, bool]:
    """First pass: the trace's last timestamp (any time column of any row) and whether rows are in
    creation_time order. The end decides which pods are still up when the trace was cut (`_finish`)."""
    end, last, in_order = 0, -1, True
    for row in _read_rows(path):
        created = _int(row.get("creation_time"))
        if created is not None:
            if created < last:
                in_order = False
            last = created
        for col in ("creation_time", "scheduled_time", "deletion_time"):
            v = _int(row.get(col))
            if v is not None:
                end = max(end, v)
    return end, in_order


def _sorted_rows(path: Path) -> list[dict]:
    """All rows in creation_time order (stable; rows without a readable creation_time first, to be skipped).
    Only for an unsorted file: the default list (8,152 rows) is small enough to hold."""
    rows = list(_read_rows(path))
    def key(row):
        created = _int(row.get("creation_time"))
        return -1 if created is None else created

    return sorted(rows, key=key)
