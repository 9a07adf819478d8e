"""The lake: append-only Parquet files by table and day (`<lake>/<table>/day=YYYY-MM-DD/part-*.parquet`).

Each table has one Arrow schema, declared here, so the writers (embedded run, Kafka sink) and the DuckDB views
agree on names, types and units. Rows are buffered and written in row groups so memory stays bounded
whatever the length of the log.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Optional

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas.events import epoch_s, to_milli
from schemas.codes import Rejection
from schemas.parse import parse_payload

TS = pa.timestamp("s", tz="UTC")

SCHEMAS: dict[str, pa.Schema] = {
    "events": pa.schema([
        ("event_id", pa.string()), ("type", pa.string()), ("pool", pa.string()), ("source", pa.string()),
        ("occurred_at", TS), ("applied_at", TS), ("lateness_s", pa.int64()),
        ("topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()),
        # the event as applied: its canonical JSON (what the ledger folded, whatever the spelling of the
        # message)
        ("body", pa.string()),
        # the fields of the event's type the views read, typed (written from the parsed event, null where the
        # type has no such field), so no query parses the JSON bodies: see EVENT_FIELDS
        ("job_id", pa.string()), ("team", pa.string()), ("chip_id", pa.string()), ("node", pa.string()),
        ("state", pa.string()), ("grant_id", pa.string()), ("request_id", pa.string()),
        ("chips_milli", pa.int64()), ("priority", pa.int64()), ("preemptible", pa.bool_()),
        ("outcome", pa.string()), ("effective_from", TS), ("effective_until", TS),
        ("chip_ids", pa.list_(pa.string())),
        # added later (LATER_EVENT_FIELDS): files and rows of earlier versions end before it
        ("user", pa.string()),
        # the cluster the event was accepted from (the Kafka worker: its signed principal's, `*` for a principal of
        # every cluster; `run` on a log export: the export line's); null when no principal vouched for it (a plain
        # file, a worker without a principals registry). For audit: docs/security.md
        ("accepted_from", pa.string()),
    ]),
    "journal": pa.schema([
        ("pool", pa.string()), ("hour", TS), ("account", pa.string()), ("team", pa.string()),
        ("amount_mchip_s", pa.int64()),
    ]),
    "job_runs": pa.schema([
        ("pool", pa.string()), ("job_id", pa.string()), ("team", pa.string()), ("run_index", pa.int32()),
        ("chips_milli", pa.int64()), ("priority", pa.int64()), ("submitted_at", TS), ("started_at", TS),
        ("ended_at", TS), ("end_reason", pa.string()), ("allocated_mchip_s", pa.int64()),
        ("lost_mchip_s", pa.int64()), ("posted_at", TS),
    ]),
    "decisions": pa.schema([
        ("decision_id", pa.string()), ("type", pa.string()), ("pool", pa.string()), ("at", TS),
        ("rule", pa.string()), ("message", pa.string()), ("body", pa.string()),
    ]),
    # policy (ledger.policy): each team's balance when an hour closes and at a close of the books
    # (lendable_milli is the pool's; the fair-share factor is the core's; the view derives the borrowed share)
    "balances": pa.schema([
        ("pool", pa.string()), ("team", pa.string()), ("at", TS), ("nominal_milli", pa.int64()),
        ("used_milli", pa.int64()), ("borrowed_milli", pa.int64()), ("burst_milli", pa.int64()),
        ("pending_milli", pa.int64()), ("decayed_usage_mchip_s", pa.int64()), ("lendable_milli", pa.int64()),
        ("fair_share_factor", pa.float64()),
    ]),
    # why each pending job waits, at the same instants
    "pending": pa.schema([
        ("pool", pa.string()), ("job_id", pa.string()), ("team", pa.string()), ("at", TS),
        ("chips_milli", pa.int64()), ("priority", pa.int64()), ("waiting_since", TS), ("reason", pa.string()),
        ("message", pa.string()),
    ]),
    # facts (ledger.waits WaitRow, ledger.chips FreeChipsRow; docs/analytics.md): each wait of a job to be started,
    # posted when it ends and, still open, at a close of the books (superseded by a later posting of the same wait)
    "waits": pa.schema([
        ("pool", pa.string()), ("job_id", pa.string()), ("team", pa.string()), ("run_index", pa.int32()),
        ("kind", pa.string()), ("priority", pa.int64()), ("chips_milli", pa.int64()), ("submitted_at", TS),
        ("began_at", TS), ("ended_at", TS), ("end", pa.string()), ("in_quota", pa.bool_()),
        ("borrowing", pa.bool_()), ("team_nominal_milli", pa.int64()), ("team_used_milli", pa.int64()),
        ("blocked_s", pa.int64()), ("blocked_by", pa.string()), ("posted_at", TS),
    ]),
    # each change of a pool's free capacity (at most one row per pool and second: the last)
    "free_chips": pa.schema([
        ("pool", pa.string()), ("at", TS), ("registered_milli", pa.int64()), ("healthy_milli", pa.int64()),
        ("in_use_milli", pa.int64()), ("down_milli", pa.int64()), ("free_milli", pa.int64()),
        ("free_whole_nodes_milli", pa.int64()), ("largest_startable_milli", pa.int64()),
    ]),
    # each interval between two progress reports of a run of a job, posted at the second (ledger.progress ProgressRow):
    # the throughput SLO's facts
    "progress": pa.schema([
        ("pool", pa.string()), ("job_id", pa.string()), ("team", pa.string()), ("run_index", pa.int32()),
        ("submitted_at", TS), ("unit", pa.string()), ("began_at", TS), ("ended_at", TS), ("units_from", pa.int64()),
        ("units_to", pa.int64()), ("chips_milli", pa.int64()), ("charged_mchip_s", pa.int64()),
        ("units_per_chip_s", pa.float64()), ("reference_units_per_chip_s", pa.float64()), ("slow", pa.bool_()),
        ("slow_s", pa.int64()), ("healthy", pa.bool_()), ("unhealthy_chips", pa.string()),
        ("held_chips", pa.string()), ("posted_at", TS),
    ]),
    # each chip event's result: the chip's registration and state from `at` on (seq orders a pool's rows of a second)
    "chip_states": pa.schema([
        ("pool", pa.string()), ("chip_id", pa.string()), ("node", pa.string()), ("at", TS), ("seq", pa.int64()),
        ("state", pa.string()), ("registered", pa.bool_()), ("available", pa.bool_()),
    ]),
    # each incarnation of a grant, posted when granted and, ended early (amended, revoked), its end
    "grant_intervals": pa.schema([
        ("pool", pa.string()), ("grant_id", pa.string()), ("team", pa.string()), ("version", pa.int64()),
        ("chips_milli", pa.int64()), ("borrowing_limit_milli", pa.int64()), ("lending_limit_milli", pa.int64()),
        ("granted_at", TS), ("effective_from", TS), ("effective_until", TS), ("ended", pa.bool_()),
        ("posted_at", TS),
    ]),
    # prices and budgets as set (ledger.prices PriceRow, BudgetRow): one row per price.set / budget.set applied
    "prices": pa.schema([
        ("pool", pa.string()), ("price_id", pa.string()), ("per_chip_hour", pa.int64()), ("unit", pa.string()),
        ("effective_from", TS), ("effective_until", TS), ("hours_of_week", pa.list_(pa.int32())), ("set_at", TS),
    ]),
    "budgets": pa.schema([
        ("pool", pa.string()), ("budget_id", pa.string()), ("team", pa.string()), ("period", pa.string()),
        ("amount", pa.int64()), ("unit", pa.string()), ("effective_from", TS), ("set_at", TS),
    ]),
    # each journal posting priced (ledger.costs CostRow): cost = cost_scaled / 3,600,000 in `unit`, exact; no
    # row where no price held (cost unknown, never zero)
    "costs": pa.schema([
        ("pool", pa.string()), ("hour", TS), ("account", pa.string()), ("team", pa.string()), ("unit", pa.string()),
        ("price_id", pa.string()), ("per_chip_hour", pa.int64()), ("amount_mchip_s", pa.int64()),
        ("cost_scaled", pa.int64()),
    ]),
    # each run of a job in a priced pool as it ends (ledger.costs RunCostRow), per unit: its cost as run, its chip time
    # in peak seconds, and its cost had it started at the nearest off-peak start with room; costs in 1/3,600,000 of
    # `unit`, null when unknown (a second without a price; no off-peak start with room), never zero for unknown
    "run_costs": pa.schema([
        ("pool", pa.string()), ("job_id", pa.string()), ("team", pa.string()), ("run_index", pa.int32()),
        ("chips_milli", pa.int64()), ("started_at", TS), ("ended_at", TS), ("end_reason", pa.string()),
        ("unit", pa.string()), ("allocated_mchip_s", pa.int64()), ("peak_mchip_s", pa.int64()),
        ("cost_scaled", pa.int64()), ("off_peak_at", TS), ("off_peak_cost_scaled", pa.int64()),
    ]),
    "deadletters": pa.schema([
        ("topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()), ("seen_at", TS),
        ("error_code", pa.string()), ("detail", pa.string()), ("event_id", pa.string()),
        ("event_type", pa.string()), ("pool", pa.string()), ("raw_b64", pa.string()),
    ]),
}

# the DuckDB type of each column type
DUCK_TYPES = {
    pa.string(): "VARCHAR", pa.int64(): "BIGINT", pa.int32(): "INTEGER",
    pa.timestamp("s", tz="UTC"): "TIMESTAMPTZ", pa.float64(): "DOUBLE", pa.bool_(): "BOOLEAN",
    pa.list_(pa.string()): "VARCHAR[]", pa.list_(pa.int32()): "INTEGER[]",
}


def empty_view_sql(table: str) -> str:
    """A query with the table's columns and no rows (a table with no files yet)."""
    cols = ", ".join(f"NULL::{DUCK_TYPES[f.type]} AS \"{f.name}\"" for f in SCHEMAS[table])
    return f"SELECT {cols} WHERE false"


def read_parquet_sql(files, union_by_name: bool = False) -> str:
    """A query over a table's files, given as a glob or a list of paths (in `day=` folders; the day left out).
    `union_by_name`: the files may lack columns of later versions (null there; see `events_view_sql`)."""
    def quoted(p) -> str:
        return "'" + str(p).replace("'", "''") + "'"
    source = quoted(files) if isinstance(files, str) else "[" + ", ".join(map(quoted, files)) + "]"
    by_name = "true" if union_by_name else "false"
    return f"SELECT * EXCLUDE (day) FROM read_parquet({source}, hive_partitioning = true, union_by_name = {by_name})"


# the column that decides a row's day partition
DAY_COLUMN = {"events": "applied_at", "journal": "hour", "job_runs": "posted_at", "decisions": "at",
              "balances": "at", "pending": "at", "waits": "posted_at", "free_chips": "at", "progress": "posted_at",
              "chip_states": "at", "grant_intervals": "posted_at", "prices": "set_at",
              "budgets": "set_at", "costs": "hour", "run_costs": "ended_at", "deadletters": "seen_at"}

TABLES = tuple(SCHEMAS)
# the analytics cache's folder in the lake (analytics/views.py): derived, removed with the lake's tables
CACHE_DIR = "_cache"

#: the typed event fields of the `events` table, after `body`, in column order
EVENT_FIELDS: tuple[str, ...] = tuple(SCHEMAS["events"].names[SCHEMAS["events"].get_field_index("body") + 1:])


#: an events row as written before the typed fields existed (up to `body`)
LEGACY_EVENT_COLUMNS = len(SCHEMAS["events"]) - len(EVENT_FIELDS)

#: typed fields added after the first typed layout, oldest first (optional fields the contract gained later, with
#: schema_version unchanged): an events file or row of an earlier version ends before one of them. No earlier
#: version can have written such a field (its parser refused unknown fields), so those files are read with it null
#: (no upgrade needed: `events_view_sql`), and rows of an earlier worker are completed from their body
LATER_EVENT_FIELDS: tuple[str, ...] = ("user", "accepted_from")
#: the width of an events file or row of the first typed layout (before LATER_EVENT_FIELDS)
FIRST_TYPED_EVENT_COLUMNS = len(SCHEMAS["events"]) - len(LATER_EVENT_FIELDS)
#: the widths of events rows an earlier worker sends: without the typed fields, then without each later one
EARLIER_EVENT_WIDTHS = frozenset({LEGACY_EVENT_COLUMNS,
                                  *range(FIRST_TYPED_EVENT_COLUMNS, len(SCHEMAS["events"]))})


# where each typed field comes from: the event's own field of that name, converted for the lake (chips as integer
# milli-chips, timestamps as epoch seconds, the placement as a list)
_FIELD_SOURCES: dict[str, tuple[str, str]] = {
    "chips_milli": ("chips", "to_milli"), "effective_from": ("effective_from", "epoch_s"),
    "effective_until": ("effective_until", "epoch_s"), "chip_ids": ("chip_ids", "list"),
}


def _fields_of(cls) -> Callable[[dict], tuple]:
    """A function from an event's `__dict__` to its typed fields, made once per event class: it reads only the
    fields the class has (most have two or three of the fifteen) and puts constant nulls for the others, so the
    embedded run pays a tuple per event, not fifteen look-ups."""
    parts = []
    for column in EVENT_FIELDS:
        name, convert = _FIELD_SOURCES.get(column, (column, ""))
        if name not in cls.model_fields:
            parts.append("None")
        elif convert:
            parts.append(f"(None if d[{name!r}] is None else {convert}(d[{name!r}]))")
        else:
            parts.append(f"d[{name!r}]")
    return eval(f"lambda d: ({', '.join(parts)},)", {"to_milli": to_milli, "epoch_s": epoch_s, "list": list})


_FIELDS_BY_CLASS: dict[type, Callable[[dict], tuple]] = {}


def event_fields(e) -> tuple:
    """The typed fields of a parsed event, in the order of EVENT_FIELDS (null where its type has no such
    field): chips as integer milli-chips, timestamps as epoch seconds, the placement as a list."""
    fields = _FIELDS_BY_CLASS.get(type(e))
    if fields is None:
        fields = _FIELDS_BY_CLASS[type(e)] = _fields_of(type(e))
    return fields(e.__dict__)


def complete_event_row(row: tuple) -> tuple:
    """An events row sent by a worker of an earlier version (without the typed fields, or without the later ones)
    with the fields it lacks taken from its body, the event's canonical JSON; a body that is not a valid event
    leaves them null."""
    if len(row) not in EARLIER_EVENT_WIDTHS:
        widths = " or ".join(str(w) for w in sorted(EARLIER_EVENT_WIDTHS))
        raise LakeError(f"an events row has {len(row)} columns; expected {len(SCHEMAS['events'])} "
                        f"(or {widths}, as earlier versions wrote them)")
    return (*row, *body_fields(row[LEGACY_EVENT_COLUMNS - 1])[len(row) - LEGACY_EVENT_COLUMNS:])


def body_fields(body) -> tuple:
    """The typed fields of an event given as its canonical JSON; all null when it is not a valid event."""
    try:
        event = parse_payload(orjson.loads(body))
    except (orjson.JSONDecodeError, TypeError):
        event = None
    if event is None or isinstance(event, Rejection):
        return (None,) * len(EVENT_FIELDS)
    return event_fields(event)


_DAYS: dict[int, str] = {}


def day_of(epoch_s: int) -> str:
    """The UTC day of an instant, as YYYY-MM-DD (memoized: rows arrive in time order)."""
    d = epoch_s // 86400
    s = _DAYS.get(d)
    if s is None:
        s = _DAYS[d] = datetime.fromtimestamp(d * 86400, tz=timezone.utc).strftime("%Y-%m-%d")
    return s


class LakeError(RuntimeError):
    pass


# each table's row type: a struct of its columns (rows_table)
_ROW_TYPES: dict[str, pa.StructType] = {t: pa.struct(list(s)) for t, s in SCHEMAS.items()}


def rows_table(table: str, rows: list) -> pa.Table:
    """The Arrow table of `rows` (tuples in the column order of SCHEMAS[table], timestamps as epoch seconds).

    Arrow turns the tuples into columns itself (one conversion to a struct array, whose fields are the columns):
    no Python pass regroups them. Measured on the rows of a 300k-event run (docs/benchmarks-history.md): the
    `events` rows 2.5x faster than a `zip(*rows)` and a `pa.array` per column (0.62 -> 0.24 s per 250k rows), the
    fact tables up to 2.4x (30% fewer instructions over all tables). A row of the wrong width is an error here
    (`zip` cut every column to the shortest)."""
    return pa.Table.from_batches([rows_batch(table, rows)], schema=SCHEMAS[table])


def rows_batch(table: str, rows: list) -> pa.RecordBatch:
    """`rows_table`'s rows as one record batch (LakeWriter.add_rows)."""
    try:
        column = pa.array(rows, type=_ROW_TYPES[table])
    except pa.ArrowInvalid as e:
        if "Tuple size" not in str(e):
            raise
        widths = sorted({len(r) for r in rows} - {len(SCHEMAS[table])})
        raise LakeError(f"a {table} row has {widths[0]} columns, expected {len(SCHEMAS[table])}") from None
    return pa.RecordBatch.from_struct_array(column)


def day_runs(column: pa.Array) -> list[tuple[int, int, int]]:
    """(day number since the epoch, first row, rows) of each run of rows of one UTC day in a column of epoch
    seconds (int64 or timestamps in seconds), in order: found by Arrow, with no Python pass over the rows (a
    batch is nearly always of one day, or two)."""
    secs = column.view(pa.int64()) if pa.types.is_timestamp(column.type) else column
    n = len(secs)
    if not n:
        return []
    if secs.null_count:
        raise LakeError("a row without its day's time (null)")
    low, high = (v.as_py() for v in pc.min_max(secs).values())
    if low // 86400 == high // 86400:  # one day
        return [(low // 86400, 0, n)]
    # floor division by a day: Arrow's integer division truncates, so shift by whole days to stay non-negative
    shift = -(low // 86400) * 86400 if low < 0 else 0
    days = pc.divide(pc.add(secs, shift) if shift else secs, 86400)
    starts = [0, *(i + 1 for i in pc.indices_nonzero(pc.not_equal(days[1:], days[:-1])).to_pylist()), n]
    first = days.to_numpy()
    return [(int(first[a]) - shift // 86400, a, b - a) for a, b in zip(starts, starts[1:])]


# files a LakeWriter may have in its writing threads at once (each at most `flush_rows` rows, as Arrow columns)
WRITES_IN_FLIGHT = 2


class LakeWriter:
    """Buffers rows (tuples in schema column order, timestamps as epoch seconds) and writes Parquet files.

    Files are named `part-<run_id>-<seq>.parquet` so two runs never overwrite each other; `run_id` is chosen
    by the caller (deterministic for the embedded run, so the same input gives the same file names).

    Rows come one by one (`add`, `extend`: tuples, which Arrow turns into columns when a file is written:
    `rows_table`) or already in columns (`add_batch`: Arrow record batches, e.g. the `events` table's
    streams.rows.EventColumns); the files are the same either way.

    A file's rows become Arrow columns in the caller's thread, then the Parquet encoding and compression (which
    Arrow does without holding the GIL) run in a thread of their own while the caller goes on, at most
    WRITES_IN_FLIGHT files at a time (a further file waits for the oldest), so memory stays bounded.
    What the files hold does not depend on it (names and contents are fixed before the thread starts); a write
    that failed raises at the next write or at `close`."""

    def __init__(self, root: Path, run_id: str, flush_rows: int = 250_000,
                 encode: Optional[Callable[[pa.Table, Path], None]] = None):
        """`encode(data, path)`: where each file's rows go to be encoded and written, when not to this writer's
        own threads (`encode_file`): the embedded run hands its files to its events process, so their Parquet
        encoding runs beside the fold instead of in its threads (which took the run's process ~0.6 s of 8.5 at
        300k events: their Python parts hold its GIL)."""
        self.root = Path(root)
        self._encode = encode
        self.run_id = run_id
        self.flush_rows = flush_rows
        self._rows: dict[tuple[str, int], list] = {}  # (table, day number since the epoch) -> rows
        # each table's latest buffer, (its day's first second, the next day's, rows, the index of the table's day
        # column): rows come in (nearly) time order, so most rows go there
        self._latest: dict[str, tuple[int, int, list, int]] = {}
        self._day_idx = {t: SCHEMAS[t].get_field_index(DAY_COLUMN[t]) for t in SCHEMAS}
        self._seq: dict[tuple[str, int], int] = defaultdict(int)
        self.written: dict[str, int] = defaultdict(int)
        self._writing: list[threading.Thread] = []  # the files being written, oldest first
        self._failed: Optional[BaseException] = None
        # tables given in columns (add_batch): (table, day) -> rows buffered, whose buffer in _rows holds batches
        self._counts: dict[tuple[str, int], int] = {}
        self._batched: set[str] = set()

    def add(self, table: str, row: tuple) -> None:
        t = row[self._day_idx[table]]
        latest = self._latest.get(table)
        if latest is not None and latest[0] <= t < latest[1]:
            buf = latest[2]
        else:
            if table in self._batched:
                raise LakeError(f"{table}: rows were added in columns (add_batch); add cannot follow them")
            day = t // 86400
            key = (table, day)
            buf = self._rows.get(key)
            if buf is None:
                buf = self._rows[key] = []
                # a new day means older days of this table are done; write them so memory holds about two
                # days, not the whole history
                stale = [k for k in self._rows if k[0] == table and k[1] < day - 1]
                for k in stale:
                    self._write(k)
            self._latest[table] = (day * 86400, (day + 1) * 86400, buf, self._day_idx[table])
        buf.append(row)
        if len(buf) >= self.flush_rows:
            self._write((table, t // 86400))

    def extend(self, table: str, rows: list) -> None:
        """`add` each row of a list (the rows of one table). When all are of the day of the table's latest buffer
        and fit in it (nearly always: a fold step's rows are of its second), the list goes there in one
        `list.extend`; else row by row."""
        latest = self._latest.get(table)
        if latest is not None:
            lo, hi, buf, idx = latest
            if len(buf) + len(rows) < self.flush_rows:
                for row in rows:
                    if not lo <= row[idx] < hi:
                        break
                else:
                    buf.extend(rows)
                    return
        for row in rows:
            self.add(table, row)

    def add_batch(self, table: str, batch: pa.RecordBatch) -> None:
        """Add rows given in columns (a batch with the table's schema), in order: the files are those `add` of each
        row would write (the same rows, days and file boundaries). A table is given either way, not both."""
        if batch.schema != SCHEMAS[table]:
            raise LakeError(f"a batch of {table} rows with columns {batch.schema.names} and types "
                            f"{[str(t) for t in batch.schema.types]}: not the table's schema")
        if table in self._latest or any(k[0] == table for k in self._rows if k not in self._counts):
            raise LakeError(f"{table}: rows were added one by one; add_batch cannot follow them")
        self._batched.add(table)
        for day, start, n in day_runs(batch.column(self._day_idx[table])):  # nearly always the whole batch
            self._add_run(table, day, batch.slice(start, n))

    def add_rows(self, table: str, rows: list) -> None:
        """`add` each row of a list, the rows made columns in one conversion (`rows_batch`) and handed on as
        `add_batch` does: the same files. A table is given this way (or `add_batch`), or by `add`, not both."""
        if rows:
            self.add_batch(table, rows_batch(table, rows))

    def _add_run(self, table: str, day: int, rows: pa.RecordBatch) -> None:
        key = (table, day)
        buf = self._rows.get(key)
        if buf is None:
            buf = self._rows[key] = []
            self._counts[key] = 0
            for k in [k for k in self._rows if k[0] == table and k[1] < day - 1]:  # as in `add`
                self._write(k)
        while rows.num_rows:
            take = min(rows.num_rows, self.flush_rows - self._counts[key])
            buf.append(rows.slice(0, take))
            self._counts[key] += take
            rows = rows.slice(take)
            if self._counts[key] >= self.flush_rows:
                self._write(key)
                if rows.num_rows:
                    buf = self._rows[key] = []
                    self._counts[key] = 0

    def close(self) -> dict[str, int]:
        try:
            for key in sorted(self._rows):
                self._write(key)
        finally:
            self.wait()
        return dict(self.written)

    def _write(self, key: tuple[str, int]) -> None:
        rows = self._rows.pop(key, None)
        latest = self._latest.get(key[0])
        if latest is not None and latest[2] is rows:
            del self._latest[key[0]]
        if not rows:
            return
        table, day = key[0], day_of(key[1] * 86400)
        if key in self._counts:  # batches (add_batch): one chunk per column, as `rows_table` makes them
            del self._counts[key]
            data = pa.Table.from_batches(rows, schema=SCHEMAS[table]).combine_chunks()
        else:
            data = rows_table(table, rows)
        out = self.root / table / f"day={day}"
        out.mkdir(parents=True, exist_ok=True)
        self._seq[key] += 1
        path = out / f"part-{self.run_id}-{self._seq[key]:04d}.parquet"
        self.written[table] += data.num_rows
        del rows
        if self._encode is not None:
            self._encode(data, path)
        else:
            self.encode_file(data, path)

    def encode_file(self, data: pa.Table, path: Path) -> None:
        """Write `data` as the Parquet file `path` in a thread of this writer's (at most WRITES_IN_FLIGHT at a
        time; `wait` and `close` wait for them)."""
        while len(self._writing) >= WRITES_IN_FLIGHT:
            self._join_oldest()
        thread = threading.Thread(target=self._write_file, args=(data, path), name="lake-writer")
        thread.start()
        self._writing.append(thread)

    def _write_file(self, data: pa.Table, path: Path) -> None:
        try:
            pq.write_table(data, path, compression="zstd")
        except BaseException as exc:  # raised in the caller's thread by wait
            self._failed = exc

    def wait(self) -> None:
        """Wait for the files being written, if any (raising a LakeError when a write failed)."""
        while self._writing:
            self._join_oldest()

    def _join_oldest(self) -> None:
        self._writing.pop(0).join()
        if self._failed is not None:
            exc, self._failed = self._failed, None
            raise LakeError(f"writing a lake file failed: {exc}") from exc


def lake_has_data(root: Path) -> bool:
    """Whether the lake holds books: committed files (or the files of a lake written before commits)."""
    from analytics.commits import committed_rows_exist

    return committed_rows_exist(root)


def clear_lake(root: Path) -> None:
    """Remove the lake's tables, manifest and staged files (only what this project writes)."""
    from analytics.commits import MANIFEST, STAGING

    root = Path(root)
    for t in (*TABLES, CACHE_DIR, STAGING):
        if (root / t).exists():
            shutil.rmtree(root / t)
    (root / MANIFEST).unlink(missing_ok=True)


def table_files(root: Path, table: str, listed: bool = True) -> Optional[list[str]]:
    """The table's committed files (analytics.commits.open_lake: the lake's layout is checked first), or None when
    it has none. (`listed` is kept for callers of an earlier version: a table is always its listed files now.)"""
    from analytics.commits import open_lake

    return open_lake(root, (table,)).table_files(table)


def check_events_files(root: Path) -> frozenset:
    """Raise a LakeError naming the first `events` file written without the typed fields (by an earlier
    version of chipledger): the views read them, and the file's rows are still there to be written again.
    Returns the widths (numbers of columns) of the files: files of the first typed layout, without the later
    fields (LATER_EVENT_FIELDS), are read as they are (`events_view_sql`)."""
    want = len(SCHEMAS["events"])
    widths = set()
    for path in sorted((Path(root) / "events").rglob("*.parquet")):
        n = pq.read_metadata(path).num_columns
        if not FIRST_TYPED_EVENT_COLUMNS <= n <= want:
            raise LakeError(f"{path}: an events file with {n} columns, expected {want} (written by an earlier "
                            f"version, without the typed event fields); add them with `chipledger lake upgrade "
                            f"--lake {root}` (or write the lake again with `chipledger run --overwrite`)")
        widths.add(n)
    return frozenset(widths)


def events_view_sql(files, widths: frozenset) -> str:
    """The query over the `events` files, whose `widths` check_events_files returned: as every other table when
    all have every column (the common case: nothing more to read); else by name, a later field null in the
    files written before it (and, when no file has it yet, a null column of its type)."""
    full = len(SCHEMAS["events"])
    if min(widths, default=full) == full:
        return read_parquet_sql(files)
    sql = read_parquet_sql(files, union_by_name=True)
    absent = list(SCHEMAS["events"])[max(widths):]
    if absent:
        nulls = ", ".join(f'NULL::{DUCK_TYPES[f.type]} AS "{f.name}"' for f in absent)
        sql = f"SELECT *, {nulls} FROM ({sql})"
    return sql


def upgrade_events_files(root: Path, files: Optional[Iterable] = None) -> list[Path]:
    """Give the `events` files written by an earlier version (without the typed fields, or without the later ones)
    the fields they lack, taken from each row's body, and return them. Each file is written anew beside itself and
    renamed over itself, so a reader sees the old file or the new one, never both, and an interrupted upgrade can
    simply be run again. `files`: those to look at (a committed lake's: analytics.commits); default every events
    file in the folder (a lake written before commits)."""
    schema = SCHEMAS["events"]
    done = []
    for path in sorted(Path(p) for p in (files if files is not None else (Path(root) / "events").rglob("*.parquet"))):
        n = pq.read_metadata(path).num_columns
        if n == len(schema):
            continue
        old = pq.read_table(path, partitioning=None)
        if n not in EARLIER_EVENT_WIDTHS or old.schema.names != schema.names[:n]:
            raise LakeError(f"{path}: not an events file of chipledger (columns {old.schema.names})")
        lacking = schema.names[n:]
        fields = [body_fields(b)[n - LEGACY_EVENT_COLUMNS:] for b in old.column("body").to_pylist()]
        columns = list(zip(*fields)) if fields else [()] * len(lacking)
        typed = [pa.array(list(col), type=schema.field(name).type) for col, name in zip(columns, lacking)]
        new = pa.Table.from_arrays([*old.cast(pa.schema(list(schema)[:n])).columns, *typed], schema=schema)
        tmp = path.with_name(f".{path.name}.upgrading")  # not *.parquet: no reader globs it
        pq.write_table(new, tmp, compression="zstd")
        os.replace(tmp, path)
        done.append(path)
    return done

