"""The writing side shared by all importers: time order, validation, closing ticks, counts.

Traces list jobs by submission, but a job's start and end come later; `TraceWriter.emit` takes events at any
future time and holds them in a heap until the importer says the input has reached that time
(`advance`), so an input sorted by submission streams with memory proportional to the jobs in flight.
"""

from __future__ import annotations

import heapq
import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from schemas import Rejection, parse_payload

_ISO_CACHE: dict[int, str] = {}


def iso(epoch_s: int) -> str:
    """Epoch seconds as RFC 3339 UTC text (`2020-04-01T00:00:00Z`)."""
    s = _ISO_CACHE.get(epoch_s)
    if s is None:
        if len(_ISO_CACHE) > 100_000:
            _ISO_CACHE.clear()
        s = _ISO_CACHE[epoch_s] = datetime.fromtimestamp(epoch_s, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return s


def epoch(dt: datetime) -> int:
    """A datetime as epoch seconds; a naive one is taken as UTC (traces often carry no zone)."""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp())


@dataclass
class ImportReport:
    """What an import read and wrote. `skipped` counts input rows left out, by reason."""

    source: str
    output: str
    rows_read: int = 0
    events: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    pools: list = field(default_factory=list)
    first_at: Optional[str] = None
    last_at: Optional[str] = None
    notes: list = field(default_factory=list)

    @property
    def events_written(self) -> int:
        return sum(self.events.values())

    def as_dict(self) -> dict:
        return {"source": self.source, "output": self.output, "rows_read": self.rows_read,
                "events_written": self.events_written, "events": dict(sorted(self.events.items())),
                "skipped": dict(sorted(self.skipped.items())), "pools": self.pools,
                "first_at": self.first_at, "last_at": self.last_at, "notes": self.notes}


class TraceFormatError(ValueError):
    """The input is not in the expected format (missing columns, unreadable file): says what and where."""


class TraceWriter:
    """Writes wire-format events to a JSONL file in non-decreasing time order.

    `emit(at, type, pool, **fields)` schedules an event; `advance(now)` writes every scheduled event at or
    before `now`; `close(end)` writes the rest and one `pool.tick` per pool at `end` (default: the last event
    time), so the books close. Ties keep emission order. Every event is validated before it is written; an
    invalid one is a bug in the importer and raises."""

    def __init__(self, out: Path, report: ImportReport, source: str, id_prefix: str):
        self.path = Path(out)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w", encoding="utf-8")
        self.report = report
        self.source = source
        self.prefix = id_prefix
        self._heap: list = []
        self._seq = 0
        self._n = 0
        self._last = None
        self._pools: dict[str, None] = {}

    def emit(self, at: int, type: str, pool: str, **fields) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, type, pool, fields))

    def advance(self, now: int) -> None:
        heap = self._heap
        while heap and heap[0][0] <= now:
            self._write(*heapq.heappop(heap))

    def close(self, end: Optional[int] = None) -> ImportReport:
        while self._heap:
            self._write(*heapq.heappop(self._heap))
        if self._pools:
            end = max(end if end is not None else self._last, self._last)
            for pool in self._pools:
                self._seq += 1
                self._write(end, self._seq, "pool.tick", pool, {})
        self._f.close()
        self.report.pools = list(self._pools)
        return self.report

    def _write(self, at: int, seq: int, type: str, pool: str, fields: dict) -> None:
        if self._last is not None and at < self._last:
            raise AssertionError(f"importer wrote {type} at {iso(at)} after {iso(self._last)}")
        self._n += 1
        ev = {"event_id": f"{self.prefix}-{self._n:08d}", "type": type, "occurred_at": iso(at), "pool": pool,
              "source": self.source, **{k: v for k, v in fields.items() if v is not None}}
        checked = parse_payload(ev)
        if isinstance(checked, Rejection):
            raise AssertionError(f"importer produced an invalid event: {checked.code.value}: {checked.detail}: {ev}")
        self._f.write(json.dumps(ev, separators=(",", ":")) + "\n")
        self._pools.setdefault(pool, None)
        self._last = at
        r = self.report
        r.events[type] += 1
        if r.first_at is None:
            r.first_at = ev["occurred_at"]
        r.last_at = ev["occurred_at"]
