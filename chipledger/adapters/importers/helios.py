"""SenseTime Helios traces (Hu et al., SC '21; HeliosData, CC BY 4.0) → chipledger events.

A Helios cluster folder holds a daily per-VC GPU quota file and, when available, a Slurm job log:

- `cluster_gpu_number.csv` (or `<Cluster>_gpu_number.csv`): `date`, one column per virtual cluster (VC), `total`.
  Each VC is a team of one pool, `helios-<cluster>/gpu`. Each run of consecutive days with the same positive
  value becomes one time-bounded `quota.granted` (`grant_id` `<vc>-<yyyymmdd>` of the run's first day,
  effective from that day's midnight to the midnight after the run), emitted at its `effective_from`. Zero
  days get no grant. `total` is not a team: it is checked against the row sum (mismatches go to the notes).
  Helios lists no nodes, so capacity is `ceil(max(total) / 8)` nodes of 8 GPUs (`n<i>-g<j>`), registered at
  the first date and constant over the trace.
- `cluster_log.csv` (or `<Cluster>_log.csv`), optional: `job_id, user, vc, gpu_num, cpu_num, node_num, state,
  submit_time, start_time, end_time, duration, queue` with times `YYYY-MM-DD HH:MM:SS`. GPU jobs become
  `job.submitted` (team = vc, chips = gpu_num), `job.started` (no placement: Helios has none) and
  `job.finished` (outcome from `state`). CPU-only jobs and garbled rows are skipped with a reason.

Times carry no zone in Helios; they are read in `tz` (default UTC; the clusters are in China, so
`Asia/Shanghai` is the other plausible reading). Quota days start at midnight in the same zone.

The log is streamed: events are released up to (latest submit seen − `reorder_window_s`), so a log that is
sorted by submit time, or nearly so (Slurm job ids follow submission; the Helios artifact re-sorts the log by
`submit_time` before simulating), streams with memory proportional to the jobs in flight. Rows up to
`reorder_window_s` (default one day) behind the latest submit are put back in order; a row further behind
can no longer be placed (later events are written) and is skipped as `out_of_order`, counted, with a note.
"""

from __future__ import annotations

import csv
import math
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Optional
from zoneinfo import ZoneInfo

from chipledger.adapters.importers.base import ImportReport, TraceFormatError, TraceWriter, epoch, iso

CHIPS_PER_NODE = 8  # Helios nodes have 8 GPUs each (SC '21 §2)
DAY_S = 86400
DEFAULT_REORDER_WINDOW_S = DAY_S

QUOTA_NAME = "cluster_gpu_number.csv"
LOG_NAME = "cluster_log.csv"

OUTCOMES = {
    "COMPLETED": "succeeded",
    "FAILED": "failed", "NODE_FAIL": "failed", "TIMEOUT": "failed",
    # terminal failure states of Slurm that Helios does not list but a newer export might carry
    "OUT_OF_MEMORY": "failed", "BOOT_FAIL": "failed", "DEADLINE": "failed",
    "CANCELLED": "cancelled",
}
LOG_REQUIRED = ("job_id", "vc", "gpu_num", "state", "submit_time", "start_time", "end_time")
NO_TIME = {"", "none", "unknown", "nat", "nan", "null"}


# ---------------------------------------------------------------------------------------------------------
# locating the files
# ---------------------------------------------------------------------------------------------------------

def _find(src_dir: Path, generic: str, suffix: str, cluster: Optional[str]) -> Optional[Path]:
    """`cluster_<suffix>` or `<Cluster>_<suffix>` in src_dir (case-insensitive cluster prefix)."""
    p = src_dir / generic
    if p.is_file():
        return p
    cands = sorted(q for q in src_dir.glob(f"*_{suffix}") if q.is_file())
    if cluster is not None:
        cands = [q for q in cands if q.name[: -len(suffix) - 1].lower() == cluster.lower()] or cands
    if len(cands) > 1:
        raise TraceFormatError(f"{src_dir}: several *_{suffix} files ({', '.join(q.name for q in cands)}); "
                               f"pass the cluster name to choose one")
    return cands[0] if cands else None


def _cluster_name(src_dir: Path, quota_file: Path, cluster: Optional[str]) -> str:
    if cluster:
        return cluster
    prefix = quota_file.name[: -len("_gpu_number.csv")]
    if prefix and prefix.lower() != "cluster":
        return prefix  # Earth_vcs/Earth_gpu_number.csv → Earth
    return src_dir.resolve().name  # data/Venus/cluster_gpu_number.csv → Venus


# ---------------------------------------------------------------------------------------------------------
# times
# ---------------------------------------------------------------------------------------------------------

class _Clock:
    """Naive Helios times in one zone → epoch seconds, memoized per local hour (fast on millions of rows)."""

    def __init__(self, tz: str):
        try:
            self.zone = timezone.utc if tz.upper() in ("UTC", "Z") else ZoneInfo(tz)
        except Exception as e:  # ZoneInfoNotFoundError, ValueError on odd keys
            raise ValueError(f"unknown time zone {tz!r}") from e
        self._hours: dict[str, int] = {}

    def midnight(self, d: date) -> int:
        return epoch(datetime(d.year, d.month, d.day, tzinfo=self.zone))

    def parse(self, s: str) -> Optional[int]:
        """`YYYY-MM-DD HH:MM:SS` (or with `T`, fractional seconds floored) → epoch s; None if unreadable."""
        s = s.strip()
        if len(s) < 19 or s[4] != "-" or s[7] != "-" or s[10] not in " T" or s[13] != ":" or s[16] != ":":
            return None
        if len(s) > 19 and not (s[19] == "." and s[20:].isdigit()):
            return None
        key = s[:13]
        base = self._hours.get(key)
        if base is None:
            try:
                dt = datetime(int(s[0:4]), int(s[5:7]), int(s[8:10]), int(s[11:13]), tzinfo=self.zone)
            except ValueError:
                return None
            base = epoch(dt)
            if len(self._hours) > 200_000:
                self._hours.clear()
            self._hours[key] = base
        mm, ss = s[14:16], s[17:19]
        if not (mm.isdigit() and ss.isdigit()) or int(mm) > 59 or int(ss) > 59:
            return None
        return base + int(mm) * 60 + int(ss)


def _whole(s: str) -> Optional[int]:
    """A non-negative whole number written as `8` or `8.0`; None otherwise."""
    s = s.strip()
    if s.isdigit():
        return int(s)
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    if not d.is_finite() or d < 0 or d != d.to_integral_value():
        return None
    return int(d)


# ---------------------------------------------------------------------------------------------------------
# the quota file
# ---------------------------------------------------------------------------------------------------------

def _read_quota(path: Path) -> tuple[list[str], list[tuple[date, list[int], int]]]:
    """(VC names, [(day, values per VC, total)]), strictly increasing days. Any defect is a TraceFormatError:
    the quota file is the entitlement itself, and a silently dropped day would change every statement."""
    try:
        f = open(path, newline="", encoding="utf-8-sig")
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read: {e}") from e
    with f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            raise TraceFormatError(f"{path}: empty file (expected a header: date, <vc>…, total)")
        header = [h.strip() for h in header]
        if header[0] != "date" or "total" not in header:
            raise TraceFormatError(f"{path}: header must start with 'date' and contain 'total', got {header[:4]}…")
        ti = header.index("total")
        vcs = [h for i, h in enumerate(header) if i not in (0, ti)]
        vc_idx = [i for i in range(1, len(header)) if i != ti]
        if not vcs:
            raise TraceFormatError(f"{path}: no VC columns between 'date' and 'total'")
        if any(not v for v in vcs) or len(set(vcs)) != len(vcs):
            raise TraceFormatError(f"{path}: VC column names must be non-empty and distinct")
        rows = []
        prev = None
        for line, row in enumerate(reader, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise TraceFormatError(f"{path}:{line}: {len(row)} fields, expected {len(header)}")
            try:
                day = date.fromisoformat(row[0].strip()[:10])
            except ValueError:
                raise TraceFormatError(f"{path}:{line}: date {row[0]!r} is not YYYY-MM-DD") from None
            if prev is not None and day <= prev:
                raise TraceFormatError(f"{path}:{line}: date {day} does not follow {prev}")
            values = [_whole(row[i]) for i in vc_idx]
            total = _whole(row[ti])
            if total is None or any(v is None for v in values):
                bad = [header[i] for i in (*vc_idx, ti) if _whole(row[i]) is None]
                raise TraceFormatError(f"{path}:{line}: not a whole number of GPUs in {', '.join(bad)}")
            rows.append((day, values, total))
            prev = day
    if not rows:
        raise TraceFormatError(f"{path}: no dates")
    return vcs, rows


def _runs(days: list[date], values: list[int]):
    """(first day, last day, value) for each run of consecutive calendar days with the same value > 0."""
    start = None
    for i, (d, v) in enumerate(zip(days, values)):
        if start is not None and (v != values[start] or d != days[i - 1] + timedelta(days=1)):
            if values[start] > 0:
                yield days[start], days[i - 1], values[start]
            start = None
        if start is None:
            start = i
    if start is not None and values[start] > 0:
        yield days[start], days[-1], values[start]


# ---------------------------------------------------------------------------------------------------------
# the importer
# ---------------------------------------------------------------------------------------------------------

def import_helios(src_dir: Path, out: Path, cluster: str | None = None, *, tz: str = "UTC",
                  reorder_window_s: int = DEFAULT_REORDER_WINDOW_S) -> ImportReport:
    """Import one Helios cluster folder into event JSONL at `out` (see the module doc for the mapping)."""
    src_dir, out = Path(src_dir), Path(out)
    if not src_dir.is_dir():
        raise TraceFormatError(f"{src_dir} is not a folder (expected a Helios cluster folder with {QUOTA_NAME})")
    quota_path = _find(src_dir, QUOTA_NAME, "gpu_number.csv", cluster)
    if quota_path is None:
        raise TraceFormatError(f"{src_dir}: no {QUOTA_NAME} (or <Cluster>_gpu_number.csv)")
    name = _cluster_name(src_dir, quota_path, cluster)
    slug = name.strip().lower().replace(" ", "-")
    if not slug:
        raise TraceFormatError("empty cluster name")
    pool, source = f"helios-{slug}/gpu", f"helios-{slug}/slurm"
    clock = _Clock(tz)
    vcs, rows = _read_quota(quota_path)
    log_path = _find(src_dir, LOG_NAME, "log.csv", cluster)
    if log_path is not None:
        _log_columns(log_path)  # a log we cannot read fails before anything is written

    report = ImportReport(source=str(src_dir), output=str(out))
    report.rows_read = len(rows)
    writer = TraceWriter(out, report, source=source, id_prefix=f"helios-{slug}")
    days = [r[0] for r in rows]
    first_day, last_day = days[0], days[-1]
    t0 = clock.midnight(first_day)
    books_end = clock.midnight(last_day + timedelta(days=1))

    # capacity: constant, from the largest total
    max_total = max(r[2] for r in rows)
    nodes = math.ceil(max_total / CHIPS_PER_NODE)
    writer.emit(t0, "pool.configured", pool, flavor="gpu", chips_per_node=CHIPS_PER_NODE)
    for i in range(nodes):
        for j in range(CHIPS_PER_NODE):
            writer.emit(t0, "chip.registered", pool, chip_id=f"n{i}-g{j}", node=f"n{i}")

    # quotas: time-bounded grants, emitted at their effective_from
    grants = 0
    teams = set()
    for k, vc in enumerate(vcs):
        for a, b, chips in _runs(days, [r[1][k] for r in rows]):
            start, until = clock.midnight(a), clock.midnight(b + timedelta(days=1))
            writer.emit(start, "quota.granted", pool, grant_id=f"{vc}-{a:%Y%m%d}", team=vc, chips=chips,
                        effective_from=iso(start), effective_until=iso(until))
            grants += 1
            teams.add(vc)
    mismatched = [(d, t, sum(v)) for d, v, t in rows if sum(v) != t]
    gaps = sum(1 for x, y in zip(days, days[1:]) if y != x + timedelta(days=1))
    report.notes.append(
        f"quota: {quota_path.name}, {len(rows)} days {first_day} … {last_day}, {len(vcs)} VC columns, "
        f"{len(teams)} with quota → {grants} time-bounded grants; capacity {nodes} nodes × {CHIPS_PER_NODE} = "
        f"{nodes * CHIPS_PER_NODE} GPUs (max total {max_total}; Helios lists no nodes)")
    if mismatched:
        d, t, s = mismatched[0]
        report.notes.append(f"quota: total ≠ sum of VC columns on {len(mismatched)} day(s), first {d}: "
                            f"total {t}, sum {s} (grants follow the VC columns)")
    else:
        report.notes.append("quota: total = sum of VC columns on every day")
    if gaps:
        report.notes.append(f"quota: {gaps} gap(s) between dates; missing days carry no grant")
    oversub = sum(1 for _, v, _ in rows if sum(v) > nodes * CHIPS_PER_NODE)
    if oversub:
        report.notes.append(f"quota: Σ VC quota exceeds capacity on {oversub} day(s)")

    end = books_end
    if log_path is None:
        report.notes.append(f"jobs: no {LOG_NAME} in {src_dir} (quota only)")
    else:
        last = _import_log(log_path, writer, report, pool, clock, t0, set(vcs), reorder_window_s)
        end = max(end, last)
    report.notes.append(f"times: naive Helios times and quota days read as {tz}")
    writer.close(end)
    return report


def _log_columns(path: Path) -> tuple[dict[str, int], int]:
    """(index of each required column, number of columns) of the job log's header; a TraceFormatError when a
    required column is missing."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            header = next(csv.reader(f), None)
    except (OSError, csv.Error, UnicodeDecodeError) as e:
        raise TraceFormatError(f"{path}: cannot read the header: {e}") from e
    if not header:
        raise TraceFormatError(f"{path}: empty file (expected a header with {', '.join(LOG_REQUIRED)})")
    header = [h.strip() for h in header]
    missing = [c for c in LOG_REQUIRED if c not in header]
    if missing:
        raise TraceFormatError(f"{path}: missing column(s) {', '.join(missing)}; header is {', '.join(header)}")
    return {c: header.index(c) for c in LOG_REQUIRED}, len(header)


def _import_log(path: Path, writer: TraceWriter, report: ImportReport, pool: str, clock: _Clock, t0: int,
                quota_vcs: set, window: int) -> int:
    """Stream the job log into `writer`; returns the latest event time scheduled."""
    skipped = report.skipped
    try:
        f = open(path, newline="", encoding="utf-8-sig")
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read: {e}") from e
    seen: set = set()
    latest = t0
    high = None  # latest submit seen
    flushed = t0  # everything at or before this is written (or may be)
    rows = jobs = unsorted = 0
    no_quota = set()
    no_quota_jobs = 0
    ix, ncol = _log_columns(path)
    with f:
        reader = csv.reader(f)
        next(reader, None)  # the header, checked above
        i_id, i_vc, i_gpu, i_state = ix["job_id"], ix["vc"], ix["gpu_num"], ix["state"]
        i_sub, i_sta, i_end = ix["submit_time"], ix["start_time"], ix["end_time"]
        while True:
            try:
                row = next(reader)
            except StopIteration:
                break
            except csv.Error:  # e.g. a NUL byte or a runaway quote: that row is garbled, the rest is not
                rows += 1
                skipped["malformed_row"] += 1
                continue
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            rows += 1
            if len(row) != ncol:
                skipped["malformed_row"] += 1
                continue
            gpus = _whole(row[i_gpu])
            if gpus is None:
                skipped["bad_gpu_num"] += 1
                continue
            if gpus == 0:
                skipped["cpu_only"] += 1
                continue
            job_id, vc = row[i_id].strip(), row[i_vc].strip()
            if not job_id or len(job_id) > 256:
                skipped["bad_job_id"] += 1
                continue
            if not vc or len(vc) > 256:
                skipped["missing_vc"] += 1
                continue
            state = row[i_state].strip().upper()
            outcome = OUTCOMES.get(state.split(" ", 1)[0])  # sacct writes "CANCELLED by <uid>"
            if outcome is None:
                skipped["unknown_state"] += 1
                continue
            submit = clock.parse(row[i_sub])
            end = clock.parse(row[i_end])
            raw_start = row[i_sta].strip()
            start = None if raw_start.lower() in NO_TIME else clock.parse(raw_start)
            if submit is None or end is None or (start is None and raw_start.lower() not in NO_TIME):
                skipped["bad_time"] += 1
                continue
            if (start is not None and not submit <= start <= end) or end < submit:
                skipped["time_order"] += 1
                continue
            if submit < t0:
                skipped["before_quota_start"] += 1
                continue
            if submit < flushed:
                skipped["out_of_order"] += 1
                continue
            key = int(job_id) if job_id.isdigit() else job_id  # ints: a third of the memory on big logs
            if key in seen:
                skipped["duplicate_job_id"] += 1
                continue
            seen.add(key)
            if high is not None and submit < high:
                unsorted += 1
            if high is None or submit > high:
                high = submit
                if high - window > flushed:
                    flushed = high - window
                    writer.advance(flushed)
            # a job cancelled in the queue has no start, or (sacct) a start equal to its end
            if start is not None and outcome == "cancelled" and start == end:
                start = None
            writer.emit(submit, "job.submitted", pool, job_id=job_id, team=vc, chips=gpus, priority=0,
                        preemptible=True)
            if start is not None:
                writer.emit(start, "job.started", pool, job_id=job_id)
            writer.emit(end, "job.finished", pool, job_id=job_id, outcome=outcome)
            if end > latest:
                latest = end
            jobs += 1
            if vc not in quota_vcs:
                no_quota.add(vc)
                no_quota_jobs += 1
    report.rows_read += rows
    report.notes.append(f"jobs: {path.name}, {rows} rows → {jobs} GPU jobs "
                        f"({sum(skipped.values())} rows skipped)")
    if unsorted:
        report.notes.append(f"jobs: {unsorted} row(s) submitted earlier than a row before them "
                            f"(reordered within a {window} s window)")
    if skipped.get("out_of_order"):
        report.notes.append(f"jobs: {skipped['out_of_order']} row(s) more than {window} s out of submit order "
                            f"were skipped (sort the log by submit_time, or raise reorder_window_s)")
    if no_quota:
        report.notes.append(f"jobs: {no_quota_jobs} job(s) in {len(no_quota)} VC(s) without a quota column "
                            f"(they only borrow): {', '.join(sorted(no_quota)[:10])}")
    return latest
