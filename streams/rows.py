"""Lake rows of what the ledger did: the one place that turns a fold `Step` (with its event and input position)
into rows per lake table. The embedded run writes them to Parquet directly; the Kafka worker sends them to the
output topics and the sink writes them. Both paths call these functions, so an output the core adds later (a
new list on `Step` named like a lake table) flows through both without touching either.

Rows are tuples in the column order of `analytics.lake.SCHEMAS[table]`, timestamps as epoch seconds, so they
are JSON-ready for Kafka as they are.
"""

from __future__ import annotations

import base64
from typing import Optional

import orjson

from analytics.lake import SCHEMAS, event_fields
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


def extend_outputs(step: Step, extend) -> None:
    """`extend(table, rows)` for each output list of the step that has rows, in the order the fold made them: for
    a writer that buffers each table apart (analytics.lake.LakeWriter), where the order between tables changes
    nothing, without `output_lists`' walk over every table (this runs once per event in a run)."""
    for table, rows in step.__dict__.items():  # the lists the fold made, and any field that differs (lateness_s)
        if table in _STEP_TABLE_SET and rows:
            extend(table, rows)


def close_rows(journal: list, job_runs: list, others: Optional[dict[str, list]] = None) -> list[tuple[str, tuple]]:
    """(table, row) pairs of a close of the books (`close_books` / `Fleet.close`)."""
    out = [("journal", r) for r in journal] + [("job_runs", r) for r in job_runs]
    for table, rows in (others or {}).items():
        out.extend((table, r) for r in rows)
    return out
