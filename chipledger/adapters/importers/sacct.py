"""Slurm accounting (`sacct --parsable2`) to chipledger events: one pool per partition, one job per job record.

Input: the output of, for example,

    TZ=UTC sacct -a -D -X --parsable2 -S 2024-03-01 -E 2024-04-01 \\
        --format=JobID,Account,User,Partition,Submit,Eligible,Start,End,State,AllocTRES,ReqTRES,Priority,AdminComment

(`|`-separated, one header line; `--parsable` with its trailing `|` is read too). Required columns: JobID,
Account, Partition, Submit, Start, End, State, AllocTRES. Optional: ReqTRES (the GPUs of jobs that never got an
allocation: pending, or cancelled while pending; without it such jobs are skipped as `no_tres`), Priority,
Cluster (pools become `slurm/<cluster>/<partition>`), Eligible, AdminComment, User (each job's `user`, for per-user
books); QOS and any other column are read and ignored.

Mapping (docs/importers.md has the full table): Account → team; Partition → pool `slurm/<partition>`
(`pool.configured` with flavor = partition and the `chips_per_node` argument); GPUs in the TRES (`gres/gpu=N`, or
the sum of typed `gres/gpu:<type>=N` when the untyped count is absent) → chips. Slurm accounting has no chip
inventory, so no chip is registered: the pools have no capacity and every running chip shows as `overcommitted`.

Times are wall-clock times of the zone `tz` (sacct prints in the local time of the process that ran it; run it
with `TZ=UTC` to avoid the question). An ambiguous time in the repeated hour of a DST change is read as its first
occurrence; a time in the skipped hour is read with the offset before the change.

Requeues: with `-D/--duplicates` every run of a requeued job is its own record with the same JobID (earlier ones
end REQUEUED, PREEMPTED, NODE_FAIL…; a requeue resets Submit). The records of a JobID are chained into one job:
submitted once (at the first record's Eligible when the column is there, else its Submit), started at each
run's Start, and every run but the last goes back to the queue, as `slurm watch` books it: the records become
`Run`s and go through the watcher's own walk, chipledger/adapters/slurm/mapping.job_events (one rule, one place): PREEMPTED → `job.preempted`; REQUEUED with the actuator's AdminComment →
`job.preempted` with its decision id; REQUEUED otherwise (an admin's `scontrol requeue`) → `job.checkpointed`
then `job.preempted` with `cause: requeued`, so no work is lost and it is not a preemption; NODE_FAIL and other
requeued states → `cause: failure`; with the Eligible column each of those is held (`held`) until the next
record's Eligible (`job.released`): Slurm's hold-off after a requeue is not demand. The last record decides the
outcome. A dump without any JobID of
several records may have been made without -D: the report says so loudly. With `cluster` and `nodes` (a
`sinfo --json` dump) the pools are named and filled as `slurm watch` does; `assoc` adds the GPU quotas.

Ordering: two passes over the file. The first validates and counts rows, finds JobIDs with several records and
measures how far Submit ever goes back in file order (the reorder window W). The second emits each job's events
into the writer's heap and advances it to (latest Submit so far − W): no later row can have an event earlier
than that, so events are written in time order with memory bounded by the jobs in flight plus W.
"""

from __future__ import annotations

import hashlib
import heapq
import re
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Optional
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from chipledger.adapters.importers.base import ImportReport, TraceFormatError, TraceWriter
from chipledger.adapters.slurm.mapping import (KNOWN_STATES, PENDING, Assoc, MapReport, Node, Run, chip_ids, grants_of,
                                      job_events, pool_name, pools_of)

SOURCE = "slurm/sacct"
REQUIRED = ("JobID", "Account", "Partition", "Submit", "Start", "End", "State", "AllocTRES")
OPTIONAL = ("ReqTRES", "Priority", "Cluster", "Eligible", "AdminComment", "User")
MAX_ARRAY_EXPAND = 10_000  # pending array tasks listed as one record (`123_[5-10]`) are expanded up to this
_PRIORITY_MAX = 2**31 - 1

# sacct's short state names; what each state means is in chipledger/adapters/slurm/mapping.py, as for `slurm watch`
_SHORT = {"CD": "COMPLETED", "CA": "CANCELLED", "F": "FAILED", "TO": "TIMEOUT", "NF": "NODE_FAIL",
          "OOM": "OUT_OF_MEMORY", "BF": "BOOT_FAIL", "DL": "DEADLINE", "PR": "PREEMPTED", "RQ": "REQUEUED",
          "R": "RUNNING", "S": "SUSPENDED", "CG": "COMPLETING", "CF": "CONFIGURING", "RS": "RESIZING",
          "PD": "PENDING", "RV": "REVOKED", "SE": "SPECIAL_EXIT", "RH": "REQUEUE_HOLD", "RF": "REQUEUE_FED",
          "SO": "STAGE_OUT", "ST": "STOPPED"}
_LEFT_OUT = {"cancelled_while_held": "jobs cancelled while held (never eligible) left out"}
_ENVELOPE = frozenset(("event_id", "type", "occurred_at", "pool", "source"))  # the writer sets these itself

_ABSENT_TIME = frozenset(("", "unknown", "none", "n/a", "invalid"))
_JOB_ID = re.compile(r"(\d+)(?:_(\d+|\[([0-9,\-:%]*)\]))?(\+\d+)?")
_ARRAY_ITEM = re.compile(r"(\d+)(?:-(\d+)(?::(\d+))?)?")


class _Skip(Exception):
    """A row left out, with the reason counted in the report."""

    def __init__(self, reason: str):
        self.reason = reason


@dataclass(slots=True)
class _Record:
    """One job record of the input (an array range contributes one per task), times in epoch seconds."""

    line_no: int
    job_id: str
    team: str
    pool: str  # pool_name(prefix, flavor)
    flavor: str  # the partition (the first of a multi-partition pending job)
    prefix: str  # what the pool is named under: the cluster (--cluster), else `slurm` or `slurm/<Cluster column>`
    submit: int
    start: Optional[int]  # None: never allocated (pending, or ended before it started)
    end: Optional[int]
    state: str
    chips: int
    nodes: Optional[int]
    priority: int
    multi_partition: bool
    eligible: Optional[int] = None  # None: not set (held, never eligible) or no Eligible column
    admin_comment: str = ""
    user: str = ""  # '' without a User column


class _Clock:
    """sacct timestamps (`2024-03-01T12:00:00` in zone `tz`, or all digits: epoch seconds) → epoch seconds."""

    def __init__(self, tz: str):
        try:
            self.zone = timezone.utc if tz.upper() == "UTC" else ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError) as e:
            raise TraceFormatError(f"unknown time zone {tz!r}: give an IANA zone name such as "
                                   f"'Europe/Berlin' or 'UTC'") from e
        self._cache: dict[str, Optional[int]] = {}

    def __call__(self, text: str) -> Optional[int]:
        """None when sacct says the time is not set (`Unknown`, `None`, empty); _Skip('bad_time') if garbled."""
        got = self._cache.get(text, -1)
        if got != -1:
            return got
        s = text.strip()
        if s.lower() in _ABSENT_TIME:
            value = None
        elif s.isdigit():
            value = int(s)
        else:
            try:
                dt = datetime.fromisoformat(s)
            except ValueError:
                raise _Skip("bad_time") from None
            if dt.tzinfo is None:
                dt = dt.replace(tzinfo=self.zone)  # fold=0: the first of a repeated hour
            value = int(dt.timestamp())
        if len(self._cache) > 200_000:
            self._cache.clear()
        self._cache[text] = value
        return value


def _count(value: str) -> int:
    v = value.strip()
    if not v.isdigit():
        raise _Skip("bad_tres")
    return int(v)


def _gpus(tres: str) -> tuple[int, Optional[int]]:
    """(GPUs, nodes) of a TRES string like `billing=8,cpu=8,gres/gpu=2,mem=64G,node=1`. The untyped `gres/gpu`
    count is the total; typed counts (`gres/gpu:a100=4`) are summed only when it is absent (Slurm records both
    when both are in AccountingStorageTRES)."""
    total = None
    typed = 0
    nodes = None
    for item in tres.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise _Skip("bad_tres")
        key = key.strip().lower()
        if key == "gres/gpu":
            total = _count(value)
        elif key.startswith("gres/gpu:"):
            typed += _count(value)
        elif key == "node":
            v = value.strip()
            nodes = int(v) if v.isdigit() and int(v) > 0 else None
    return (total if total is not None else typed), nodes


def _array_tasks(spec: str) -> list[int]:
    """Task ids of a pending array range as sacct prints it: `5-10`, `1,3,7-9`, `0-15:4`, `5-10%2` (throttle)."""
    body = spec.split("%", 1)[0]
    tasks: list[int] = []
    for item in body.split(","):
        m = _ARRAY_ITEM.fullmatch(item)
        if m is None:
            raise _Skip("bad_job_id")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        step = int(m.group(3)) if m.group(3) is not None else 1
        if hi < lo or step < 1:
            raise _Skip("bad_job_id")
        if len(tasks) + (hi - lo) // step + 1 > MAX_ARRAY_EXPAND:
            raise _Skip("array_too_large")
        tasks.extend(range(lo, hi + 1, step))
    return tasks


def _state(text: str) -> str:
    word = text.strip().split(" ", 1)[0].rstrip("+").upper()
    word = _SHORT.get(word, word)
    if word not in KNOWN_STATES:
        raise _Skip("unknown_state")
    return word


class _Columns:
    def __init__(self, header: str, path: Path):
        names = header.rstrip("\r\n").split("|")
        self.trailing = len(names) > 1 and names[-1] == ""  # `--parsable` ends every line with `|`
        if self.trailing:
            names = names[:-1]
        self.header = header.rstrip("\r\n")
        if len(names) < 2:
            raise TraceFormatError(f"{path}: the first line is not a `sacct --parsable2` header (no `|` between "
                                   f"columns): run sacct with --parsable2 and without --noheader")
        index = {n.strip().lower(): i for i, n in enumerate(names)}
        missing = [c for c in REQUIRED if c.lower() not in index]
        if missing:
            hint = (" (the first line looks like data: run sacct without -n/--noheader)"
                    if names[0].strip()[:1].isdigit() else "")
            raise TraceFormatError(f"{path}: missing sacct column(s) {', '.join(missing)}{hint}; run e.g. "
                                   f"sacct -a -D -X --parsable2 --format={','.join(REQUIRED + OPTIONAL)}")
        self.n = len(names)
        self.at = {c: index[c.lower()] for c in REQUIRED}
        self.opt = {c: index.get(c.lower()) for c in OPTIONAL}


class _Parser:
    def __init__(self, cols: _Columns, clock: _Clock, cluster: Optional[str] = None):
        self.cols = cols
        self.clock = clock
        self.cluster = cluster  # --cluster: pools `<cluster>/<partition>`, as `slurm watch` names them

    def records(self, line_no: int, line: str) -> list[_Record]:
        """The job records of one data line, or _Skip with the reason it is left out."""
        fields = line.split("|")
        cols = self.cols
        if cols.trailing and fields and fields[-1] == "":
            fields.pop()
        if len(fields) != cols.n:
            raise _Skip("bad_row")
        at = cols.at
        raw_id = fields[at["JobID"]].strip()
        if "." in raw_id:
            raise _Skip("step")
        m = _JOB_ID.fullmatch(raw_id)
        if m is None:
            raise _Skip("bad_job_id" if raw_id else "bad_row")
        team = fields[at["Account"]].strip()
        if not team:
            raise _Skip("no_account")
        partition = fields[at["Partition"]].strip()
        if not partition:
            raise _Skip("no_partition")
        state = _state(fields[at["State"]])
        clock = self.clock
        submit = clock(fields[at["Submit"]])
        start = clock(fields[at["Start"]])
        end = clock(fields[at["End"]])
        if submit is None:
            raise _Skip("bad_time")
        alloc = fields[at["AllocTRES"]].strip()
        if alloc:
            chips, nodes = _gpus(alloc)
        else:  # no allocation: the job never ran (pending, or ended while pending); sacct sets Start=End then
            start = None
            req_at = cols.opt["ReqTRES"]
            req = fields[req_at].strip() if req_at is not None else ""
            if not req:
                raise _Skip("no_tres")
            chips, nodes = _gpus(req)
        if chips <= 0:
            raise _Skip("no_gpu")
        if state in PENDING:
            start = end = None
        multi = "," in partition
        if multi:  # a pending job submitted to several partitions lists them all until it starts
            partition = partition.split(",", 1)[0].strip()
        cl_at = cols.opt["Cluster"]
        cluster = fields[cl_at].strip() if cl_at is not None else ""
        prefix = self.cluster or (f"slurm/{cluster}" if cluster else "slurm")
        pool = pool_name(prefix, partition)
        el_at = cols.opt["Eligible"]
        eligible = clock(fields[el_at]) if el_at is not None else None
        ac_at = cols.opt["AdminComment"]
        comment = fields[ac_at].strip() if ac_at is not None else ""
        us_at = cols.opt["User"]
        user = fields[us_at].strip() if us_at is not None else ""
        pr_at = cols.opt["Priority"]
        priority = 0
        if pr_at is not None:
            p = fields[pr_at].strip()
            if p.lstrip("-").isdigit():
                priority = max(-_PRIORITY_MAX - 1, min(_PRIORITY_MAX, int(p)))
        if m.group(3) is not None:  # `123_[5-10]`: pending tasks not yet split off
            base = m.group(1)
            ids = [f"{base}_{t}{m.group(4) or ''}" for t in _array_tasks(m.group(3))]
            if not ids:
                raise _Skip("bad_job_id")
        else:
            ids = [raw_id]
        return [_Record(line_no, job_id, team, pool, partition, prefix, submit, start, end, state, chips, nodes,
                        priority, multi, eligible, comment, user) for job_id in ids]


def _lines(path: Path, digest=None) -> Iterator[tuple[int, str]]:
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if digest is not None:
                digest.update(raw)
            yield line_no, raw.decode("utf-8", errors="replace").rstrip("\r\n")


def _open(path: Path, clock: _Clock, cluster: Optional[str] = None) -> tuple[_Parser, Iterator[tuple[int, str]], object]:
    digest = hashlib.blake2b(digest_size=6)
    lines = _lines(path, digest)
    for _, header in lines:
        if header.strip():
            return _Parser(_Columns(header, path), clock, cluster), lines, digest
    raise TraceFormatError(f"{path}: empty file (expected a `sacct --parsable2` header line)")


class _Plan:
    """What the first pass learns: which JobIDs have several records, the reorder window, pool start times."""

    def __init__(self):
        self.records_of: dict[str, int] = {}  # JobID → number of records, only for JobIDs with more than one
        self.window_s = 0
        self.pool_first: dict[str, tuple[int, str]] = {}  # pool → (earliest Submit, flavor)
        self.last_time: Optional[int] = None
        self.eligible_column = False
        self.user_column = False


def _first_pass(path: Path, clock: _Clock, report: ImportReport, cluster: Optional[str] = None) -> tuple[_Plan, str]:
    parser, lines, digest = _open(path, clock, cluster)
    plan = _Plan()
    plan.eligible_column = parser.cols.opt["Eligible"] is not None
    plan.user_column = parser.cols.opt["User"] is not None
    header = parser.cols.header
    seen: set[int] = set()  # hashes of JobIDs: 8 bytes of key per job, not the whole id
    records_of = plan.records_of
    high = None
    last = None
    for line_no, line in lines:
        if not line.strip():
            continue
        if line == header:  # files concatenated from several sacct runs repeat the header
            continue
        report.rows_read += 1
        try:
            recs = parser.records(line_no, line)
        except _Skip as s:
            report.skipped[s.reason] += 1
            continue
        r0 = recs[0]
        if high is None or r0.submit > high:
            high = r0.submit
        elif high - r0.submit > plan.window_s:
            plan.window_s = high - r0.submit
        first = plan.pool_first.get(r0.pool)
        if first is None or r0.submit < first[0]:
            plan.pool_first[r0.pool] = (r0.submit, r0.flavor)
        for t in (r0.submit, r0.start, r0.end):
            if t is not None and (last is None or t > last):
                last = t
        for r in recs:
            h = hash(r.job_id)
            if h in seen:
                records_of[r.job_id] = records_of.get(r.job_id, 1) + 1
            else:
                seen.add(h)
    plan.last_time = last
    return plan, digest.hexdigest()


class _Emitter:
    """Hands the records of one job (one, or several runs of a requeued job) to the mapping `slurm watch` uses
    (chipledger/adapters/slurm/mapping.job_events: the one walk over a job's runs) and schedules its events."""

    def __init__(self, writer: TraceWriter, adjust: Counter, eligible_column: bool = False,
                 teams: Optional[dict] = None):
        self.w = writer
        self.teams = teams  # account -> team name (the account hierarchy of the --assoc dump, when it has it)
        self.adjust = adjust
        self.eligible_column = eligible_column
        self.mapped = MapReport()  # what the mapping adjusted or left out, merged into the notes at the end

    def job(self, records: list[_Record]) -> None:
        records.sort(key=lambda r: (r.submit, r.start if r.start is not None else float("inf"), r.line_no))
        r0 = records[0]
        runs = [Run(r.job_id, r.team, r.user, r.flavor, r.submit, r.eligible, r.start, r.end, r.state, r.chips,
                    r.nodes, r.priority, r.admin_comment) for r in records]
        events = job_events(r0.prefix, SOURCE, runs, self.mapped, eligible=self.eligible_column, teams=self.teams)
        if not events:
            return
        if r0.multi_partition:
            self.adjust["pool of a multi-partition pending job taken from its first partition"] += 1
        for r in records[1:]:
            if r.pool != r0.pool:
                self.adjust["requeued runs in another partition kept in the first run's pool"] += 1
        emit = self.w.emit
        for e in events:
            fields = {k: v for k, v in e.body.items() if k not in _ENVELOPE}
            emit(e.at, e.body["type"], e.body["pool"], **fields)

    def notes(self) -> None:
        """The mapping's counts, into the import's notes."""
        for reason, n in self.mapped.skipped.items():
            self.adjust[_LEFT_OUT.get(reason, f"jobs left out ({reason})")] += n
        self.adjust.update(self.mapped.notes)


def load_nodes(path: Path) -> list[Node]:
    """Nodes from a dump of `sinfo --json`, or of `scontrol show node -o` (text, one line a node)."""
    import json

    from chipledger.adapters.slurm.commands import nodes_from_scontrol_text, nodes_from_sinfo_json

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise TraceFormatError(f"{path}: {e}") from None
    if text.lstrip().startswith("NodeName="):
        return nodes_from_scontrol_text(text)
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise TraceFormatError(f"{path}: neither a `sinfo --json` nor a `scontrol show node -o` dump ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        raise TraceFormatError(f"{path}: no \"nodes\" list: dump it with `sinfo --json > {Path(path).name}`")
    return nodes_from_sinfo_json(doc)


def _read(path: Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise TraceFormatError(f"{path}: {e}") from None


def load_team_paths(path: Path) -> dict[str, str]:
    """account -> team name (`org/team`) from an assoc dump with a header naming a ParentName column (`sacctmgr -P
    show assoc format=id,account,user,partition,grptres,parentname`); empty without one (teams = accounts)."""
    from chipledger.adapters.slurm.commands import account_parents_from_text
    from chipledger.adapters.slurm.mapping import team_paths

    text = Path(path).read_text()
    head = text.split("\n", 1)[0].lower()
    if "par" not in head or "account" not in head:
        return {}
    return team_paths(account_parents_from_text(text))


def load_assocs(path: Path) -> list[Assoc]:
    """Associations from `sacctmgr -P show assoc format=id,account,user,partition,grptres` (header optional)."""
    from chipledger.adapters.slurm.commands import assocs_from_text

    try:
        return assocs_from_text(Path(path).read_text())
    except OSError as e:
        raise TraceFormatError(f"{path}: {e}") from None


def import_sacct(path: Path, out: Path, tz: str = "UTC", chips_per_node: int = 8, *, cluster: Optional[str] = None,
                 nodes: Optional[Path] = None, assoc: Optional[Path] = None,
                 inventory_at: Optional[int] = None, node_events: Optional[Path] = None,
                 reservations: Optional[Path] = None) -> ImportReport:
    """Import `sacct --parsable2` output into event JSONL at `out` (see the module docstring for the mapping).

    `tz`: the IANA zone the timestamps are in (the TZ of the sacct process). `chips_per_node`: GPUs per node,
    written on each pool's `pool.configured` when there is no inventory. `cluster`: pools are named
    `<cluster>/<partition>` as `slurm watch` names them. `nodes`: a `sinfo --json` dump: the pools' chips are
    registered at `inventory_at` (default: the first Submit; sreport counts from when the cluster registered,
    `sacctmgr show event event=cluster`). `assoc`: a `sacctmgr show assoc` dump: GrpTRES gres/gpu limits of
    accounts become quota grants at the same instant. `node_events`: a `sacctmgr -n -P show event event=node
    format=nodename,start,end,state,reason` dump: the nodes' down/drain periods, as chip states. `reservations`: a
    `sacctmgr -n -P show reservation format=name,nodenames,start,end,flags` dump: maintenance reservations (MAINT),
    as chip states `maintenance` from their start to their end."""
    path, out = Path(path), Path(out)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    if not 1 <= chips_per_node <= 4096:
        raise TraceFormatError(f"chips_per_node must be between 1 and 4096, got {chips_per_node}")
    if (nodes is not None or assoc is not None) and not cluster:
        raise TraceFormatError("--nodes and --assoc need --cluster (the pools are named <cluster>/<partition>)")
    node_list = load_nodes(nodes) if nodes is not None else None
    assoc_list = load_assocs(assoc) if assoc is not None else None
    teams = load_team_paths(assoc) if assoc is not None else None
    clock = _Clock(tz)
    report = ImportReport(source=str(path), output=str(out))
    plan, digest = _first_pass(path, clock, report, cluster)
    extra = f"|{cluster}|{inventory_at}|{nodes is not None}|{assoc is not None}" if cluster else ""
    if reservations is not None:
        extra += "|reservations"
    prefix = f"sacct-{hashlib.blake2b(f'{digest}|{tz}|{chips_per_node}{extra}'.encode(), digest_size=5).hexdigest()}"

    writer = TraceWriter(out, report, SOURCE, prefix)
    adjust: Counter = Counter()
    emitter = _Emitter(writer, adjust, plan.eligible_column, teams)
    first_all = min((f for f, _ in plan.pool_first.values()), default=None)
    inv_at = inventory_at if inventory_at is not None else first_all
    specs = pools_of(cluster, node_list) if node_list is not None else {}
    if node_list is not None and inv_at is not None:
        for spec in specs.values():
            writer.emit(inv_at, "pool.configured", spec.pool, flavor=spec.flavor, chips_per_node=spec.chips_per_node)
            for n in spec.nodes:
                for c in chip_ids(n):
                    writer.emit(inv_at, "chip.registered", spec.pool, chip_id=c, node=n.name)
        if assoc_list is not None:
            for (assoc_id, pool, team), chips in sorted(grants_of(cluster, specs, assoc_list, teams=teams).items()):
                writer.emit(inv_at, "quota.granted", pool, grant_id=f"slurm:{cluster}:assoc{assoc_id}:{pool}:v1",
                            team=team, chips=chips)
        if node_events is not None or reservations is not None:
            from chipledger.adapters.slurm.commands import node_events_from_text, reservations_from_text
            from chipledger.adapters.slurm.mapping import node_state_events

            down = node_events_from_text(_read(node_events)) if node_events is not None else []
            maint = reservations_from_text(_read(reservations)) if reservations is not None else []
            for e in node_state_events(cluster, SOURCE, specs, down, since=inv_at, maintenance=maint):
                b = e.body
                writer.emit(e.at, "chip.state_changed", b["pool"], chip_id=b["chip_id"], state=b["state"],
                            reason=b.get("reason"))
    elif assoc_list is not None or node_events is not None or reservations is not None:
        raise TraceFormatError("--assoc, --node-events and --reservations need --nodes: they apply to the pools "
                               "the nodes make")
    for pool, (first, flavor) in sorted(plan.pool_first.items(), key=lambda kv: (kv[1][0], kv[0])):
        if pool in specs:
            if first < inv_at:
                adjust["jobs submitted before the inventory instant (their chips show as overcommitted)"] += 1
            continue
        writer.emit(first, "pool.configured", pool, flavor=flavor, chips_per_node=chips_per_node)
    parser, lines, _ = _open(path, clock, cluster)
    header = parser.cols.header
    window = plan.window_s
    records_of = plan.records_of
    waiting: dict[str, list[_Record]] = {}  # runs of requeued jobs, until all of a JobID's records are read
    waiting_min: list[tuple[int, str]] = []  # (Submit, JobID) of every waiting record, lazily cleaned
    high = None
    for line_no, line in lines:
        if not line.strip() or line == header:
            continue
        try:
            recs = parser.records(line_no, line)
        except _Skip:
            continue  # counted by the first pass
        for r in recs:
            n = records_of.get(r.job_id)
            if n is None:
                emitter.job([r])
                continue
            runs = waiting.setdefault(r.job_id, [])
            heapq.heappush(waiting_min, (r.submit, r.job_id))
            runs.append(r)
            if len(runs) == n:
                emitter.job(waiting.pop(r.job_id))
        submit = recs[0].submit
        if high is None or submit > high:
            high = submit
        now = high - window
        while waiting_min and waiting_min[0][1] not in waiting:
            heapq.heappop(waiting_min)
        if waiting_min and waiting_min[0][0] < now:  # a waiting job's events are not in the heap yet
            now = waiting_min[0][0]
        writer.advance(now)
    for runs in waiting.values():  # only if two JobIDs shared a hash in the first pass
        emitter.job(runs)
    writer.close(plan.last_time)
    emitter.notes()

    bare = [p for p in report.pools if p not in specs]
    if bare:
        report.notes.append(f"{len(bare)} pool(s) without chips: sacct has no chip inventory, so running "
                            f"jobs' chips show as overcommitted (give --nodes, a `sinfo --json` dump; times "
                            f"read in {tz})")
    if report.rows_read and not plan.records_of:
        report.notes.append("WARNING: no job has several records: if this dump was made without -D "
                            "(--duplicates), every requeued job's earlier runs and every preemption are missing "
                            "and the GPU-seconds are short; dump with `sacct -a -D -X --parsable2 ...`")
    if report.rows_read and not plan.eligible_column:
        report.notes.append("WARNING: no Eligible column: waits are counted from Submit, so held jobs (and "
                            "jobs cancelled while held) count as pending demand; add Eligible to --format")
    if report.rows_read and not plan.user_column:
        report.notes.append("no User column: jobs are submitted without a user (usage_by_user has none); add User "
                            "to --format for per-user books")
    if window:
        report.notes.append(f"input not in Submit order: events held back up to {window} s to keep time order")
    for what, n in sorted(adjust.items()):
        report.notes.append(f"{what}: {n}")
    if report.rows_read and report.skipped.get("bad_time", 0) == report.rows_read:
        report.notes.append("no timestamp could be read: unset SLURM_TIME_FORMAT (or set it to `standard`)")
    return report


__all__ = ["import_sacct"]
