"""Lake rows of what the ledger did: the one place that turns a fold `Step` (with its event and input position)
into rows per lake table. The embedded run writes them to Parquet directly; the Kafka worker sends them to the
output topics and the sink writes them. Both paths call these functions, so an output the core adds later (a
new list on `Step` named like a lake table) flows through both without touching either.

Rows are tuples in the column order of `analytics.lake.SCHEMAS[table]`, timestamps as epoch seconds, so they
are JSON-ready for Kafka as they are.
"""

from __future__ import annotations

import base64
from array import array
from typing import Optional

import orjson
import pyarrow as pa

from analytics.lake import EVENT_FIELDS, SCHEMAS, event_fields
from ledger.fold import Step
from schemas import Rejection

#: Step attributes that are lists of lake rows: every lake table the Step carries (the events row and dead
#: letters are made here, from the event and the position, not by the core).
STEP_TABLES: tuple[str, ...] = tuple(t for t in SCHEMAS if t not in ("events", "deadletters")
                                     and t in Step.TABLES)


def canonical_json(e) -> str:
    """The event's canonical JSON: `e.model_dump_json(exclude_none=True)`, by the model's serializer directly
    (the same bytes without pydantic's per-call Python wrapper: this runs once per event)."""
    return e.__pydantic_serializer__.to_json(e, exclude_none=True).decode()


def event_row(e, step, topic: str, partition: int, offset: int, accepted_from: Optional[str] = None) -> tuple:
    """The lake row of an applied event (column order of analytics.lake.SCHEMAS['events']). The body is the
    event's canonical JSON: exactly what was folded, whatever the spelling of the message;
    the typed fields after it are taken from the same parsed event."""
    return applied_event_row(e, step.occurred_s, step.applied_at, step.lateness_s, topic, partition, offset,
                             accepted_from)


def applied_event_row(e, occurred_s: int, applied_at: int, lateness_s: int, topic: str, partition: int,
                      offset: int, accepted_from: Optional[str] = None) -> tuple:
    """`event_row` given what the fold's step said about the event: when it occurred, when it was applied, how
    late (the embedded run's events process has these numbers, not the step). `accepted_from`: the cluster the
    event was accepted from (the last column; event_fields leaves it null, the event does not say it)."""
    row = (e.event_id, e.type, e.pool, e.source, occurred_s, applied_at, lateness_s,
           topic, partition, offset, canonical_json(e), *event_fields(e))
    return row if accepted_from is None else row[:-1] + (accepted_from,)


# the columns of an events row that EventColumns takes from the event itself (the others: numbers, constants)
_EVENT_OWN = ("event_id", "type", "pool", "source", "body", *EVENT_FIELDS)
_EVENT_OWN_TYPE = pa.struct([SCHEMAS["events"].field(name) for name in _EVENT_OWN])
_EVENT_NUMBERS = ("offset", "occurred_at", "applied_at", "lateness_s")  # EventColumns.numbers, per event


class EventColumns:
    """The `events` rows of one input (one topic and partition) gathered in columns as events are applied, for
    analytics.lake.LakeWriter.add_batch: the columns `applied_event_row` would give, without a row per event.

    Per event, `add` keeps the values only the event has (its ids, its canonical JSON, its typed fields: one tuple,
    which Arrow turns into columns in one conversion) and the line's origin where it has one; the caller appends
    the event's four numbers to `numbers` (line number or offset, event time, applied time, lateness, as
    int64s: the embedded run's events process receives exactly that array from the run). `batch()` makes the
    record batch: the numbers become columns straight from that array's memory, the topic and partition constant
    columns."""

    def __init__(self, topic: str, partition: int = 0):
        self.topic, self.partition = topic, partition
        self.numbers = array("q")
        self._own: list[tuple] = []
        self._origins: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._own)

    def add(self, e, origin: Optional[str] = None) -> None:
        if origin is not None:
            self._origins[len(self._own)] = origin
        self._own.append((e.event_id, e.type, e.pool, e.source, canonical_json(e), *event_fields(e)))

    def applied(self, e, offset: int, occurred_s: int, applied_at: int, lateness_s: int,
                origin: Optional[str] = None) -> None:
        """`add` with the event's numbers."""
        self.numbers.extend((offset, occurred_s, applied_at, lateness_s))
        self.add(e, origin)

    def batch(self) -> pa.RecordBatch:
        """The rows gathered so far, in the columns of SCHEMAS['events'] (then none are held)."""
        n = len(self._own)
        if len(self.numbers) != 4 * n:
            raise ValueError(f"{len(self.numbers)} numbers for {n} events: expected 4 an event")
        own = pa.array(self._own, type=_EVENT_OWN_TYPE)
        columns = {name: own.field(i) for i, name in enumerate(_EVENT_OWN)}
        schema = SCHEMAS["events"]
        for i, name in enumerate(_EVENT_NUMBERS):
            values = self.numbers[i::4]  # an array of int64s: Arrow reads its memory as it is
            columns[name] = pa.Array.from_buffers(schema.field(name).type, n, [None, pa.py_buffer(values)])
        columns["topic"] = pa.repeat(pa.scalar(self.topic, pa.string()), n)
        columns["partition"] = pa.repeat(pa.scalar(self.partition, pa.int32()), n)
        if self._origins:
            columns["accepted_from"] = pa.array([self._origins.get(i) for i in range(n)], pa.string())
        batch = pa.RecordBatch.from_arrays([columns[name] for name in schema.names], schema=schema)
        self.numbers, self._own, self._origins = array("q"), [], {}
        return batch


def deadletter_row(raw: bytes, rejection: Rejection, topic: str, partition: int, offset: int, seen_at: int,
                   event=None) -> tuple:
    """The lake row of a dead letter. Identity fields come from the event when it parsed, else best effort."""
    event_id = event_type = pool = None
    if event is not None:
        event_id, event_type, pool = event.event_id, event.type, event.pool
    else:
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            event_id, event_type, pool = (v if isinstance(v, str) else None
                                          for v in (obj.get("event_id"), obj.get("type"), obj.get("pool")))
    return (topic, partition, offset, seen_at, rejection.code.value, rejection.detail, event_id, event_type, pool,
            base64.b64encode(raw).decode("ascii"))


def step_rows(event, step: Step, topic: str, partition: int, offset: int,
              accepted_from: Optional[str] = None) -> list[tuple[str, tuple]]:
    """(table, row) pairs of an applied step, in the order they are written: the event, then each output list
    of the step in lake table order (journal, job_runs, decisions, and whatever the core adds)."""
    out = [("events", event_row(event, step, topic, partition, offset, accepted_from))]
    for table, rows in output_lists(step):
        out.extend([(table, row) for row in rows])
    return out


def output_lists(step: Step) -> list[tuple[str, list]]:
    """(table, rows) of each output list of the step that has rows (every table but `events`), in lake table
    order."""
    made = step.__dict__  # the output lists the fold gave rows (the others are Step's shared empty default)
    if not made:
        return []
    return [(table, rows) for table in STEP_TABLES if (rows := made.get(table))]


_STEP_TABLE_SET = frozenset(STEP_TABLES)


class StepOutputs:
    """The fact tables' rows of applied steps, for a LakeWriter that takes them in columns: per step, `add` keeps
    the output lists the fold made (one append); every `flush` (the run's caller decides when: every
    chipledger.embedded.EVENTS_BATCH events) each table's rows become Arrow columns in one conversion and are
    split by day by Arrow (LakeWriter.add_rows), so no Python pass walks the rows one by one (LakeWriter.extend of
    each step's lists did, per row). A table's rows keep their order, so the files are those `add` of each row
    writes."""

    def __init__(self, writer):
        self.writer = writer
        # per step with outputs, the lists the fold made (and fields that differ): `add`, or a caller's own
        # `made.append(step.__dict__)` where the step's __dict__ is not empty (one call less per event)
        self.made: list[dict] = []

    def add(self, step: Step) -> None:
        made = step.__dict__
        if made:
            self.made.append(made)

    def _tables(self) -> dict[str, list]:
        tables: dict[str, list] = {}
        for made in self.made:
            for table, rows in made.items():  # in the order the fold made them
                if table in _STEP_TABLE_SET and rows:
                    got = tables.get(table)
                    if got is None:
                        tables[table] = list(rows)
                    else:
                        got += rows
        self.made.clear()
        return tables

    def flush(self) -> None:
        """Hand the rows gathered so far to the writer."""
        for table, rows in self._tables().items():
            self.writer.add_rows(table, rows)

    def close(self, journal: list, job_runs: list, others: Optional[dict[str, list]] = None) -> None:
        """Hand on what is left and then the rows of the close of the books (`close_rows`' arguments): a table's
        closing rows after its steps' rows, as `close_rows` into `add` writes them."""
        tables = self._tables()
        for table, row in close_rows(journal, job_runs, others):
            tables.setdefault(table, []).append(row)
        for table, rows in tables.items():
            self.writer.add_rows(table, rows)


def close_rows(journal: list, job_runs: list, others: Optional[dict[str, list]] = None) -> list[tuple[str, tuple]]:
    """(table, row) pairs of a close of the books (`close_books` / `Fleet.close`)."""
    out = [("journal", r) for r in journal] + [("job_runs", r) for r in job_runs]
    for table, rows in (others or {}).items():
        out.extend((table, r) for r in rows)
    return out
