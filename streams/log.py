"""`chipledger log export`: the sequenced log (`chipledger.log`) as a JSONL file, in log order.

The fold reads only `chipledger.log`, so the books are a pure function of it: `chipledger run` on an export
gives the lake tables the sink wrote from the worker's outputs (the same events, journal, job runs, decisions
and fold dead letters). The export reads each log partition from its start to the end offset it had when the
export began, keeps the records of `pool` (all pools when None), and drops what the fold drops as well: a
record whose input origin (topic, partition, offset) is at or below one already exported for its pool (the
sequencer logs a record again when it crashed between writing it and saving its state).

A record's value is written as it is, one per line; a record the worker logged with its broker append time and
the cluster it was accepted from is written as a log line (streams/logline.py) that carries them, so `chipledger
run` on the export applies the same checks (`clock_ahead`, ids per cluster) and gives the same books. Two kinds of value cannot be one JSONL line: an empty value
and one that holds a newline byte (no SDK producer sends either: they are foreign garbage, dead-lettered as
`not_json` by the fold). They are left out of the file and counted in `ExportReport.unexportable`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Optional

from schemas.topics import TOPIC_LOG
from streams.sequencer import HEADER_ORIGIN, batch_format, key_partition, unpack_batch
from streams.logline import wrap


@dataclass
class ExportReport:
    records: int = 0  # log records read (of the pools exported)
    written: int = 0
    duplicates: int = 0  # logged twice, written once
    unexportable: int = 0
    pools: set = field(default_factory=set)
    seen: dict = field(default_factory=dict, repr=False)  # (pool key, input topic, partition) -> last offset


def _origin(headers) -> Optional[tuple[str, int, int]]:
    for name, value in headers or ():
        if name == HEADER_ORIGIN:
            try:
                topic, part, off = value.decode().rsplit(":", 2)
                return topic, int(part), int(off)
            except (ValueError, UnicodeDecodeError):
                return None
    return None


class _Rec:
    __slots__ = ("key", "value", "headers", "entry")

    def __init__(self, key, value, headers, entry=None):
        self.key, self.value, self.headers, self.entry = key, value, headers, entry


def export_records(records, out: BinaryIO, pool: Optional[str] = None,
                   report: Optional[ExportReport] = None) -> ExportReport:
    """Write the input records of `records` (log records of one partition, or several partitions one after the
    other, each in offset order: objects with .key, .value, .headers; a batch of several input records is
    written entry by entry) as JSONL, by the rules of the module doc."""
    report = report or ExportReport()
    seen = report.seen
    want = pool.encode() if pool is not None else None
    for rec in records:
        key = rec.key or b""
        if want is not None and key != want:
            continue
        fmt = batch_format(rec.headers)
        if fmt is not None:
            try:
                entries = unpack_batch(rec.value or b"", fmt)
            except ValueError:
                entries = []
            if entries:
                export_records([_Rec(key, e.value, [(HEADER_ORIGIN, f"{e.topic}:{e.partition}:{e.offset}".encode())],
                                     e) for e in entries], out, pool, report)
                continue
        report.records += 1
        origin = _origin(rec.headers)
        if origin is not None:
            k = (key, origin[0], origin[1])
            if seen.get(k, -1) >= origin[2]:
                report.duplicates += 1
                continue
            seen[k] = origin[2]
        value = rec.value or b""
        if not value or b"\n" in value or b"\r" in value:
            report.unexportable += 1
            continue
        e = getattr(rec, "entry", None)
        if e is not None and (e.appended_ms >= 0 or e.origin):
            value = wrap(value, e.appended_ms if e.appended_ms >= 0 else None, e.origin or None)
        out.write(value + b"\n")
        report.written += 1
        report.pools.add(key.decode("utf-8", "replace"))
    return report


def export_log(bootstrap: str, path: Path, pool: Optional[str] = None, timeout_s: float = 30,
               consumer=None) -> ExportReport:
    """Export the log at `bootstrap` (its partition of `pool`, or all) to `path`. Raises KafkaSetupError when
    no broker answers or the log topic does not exist."""
    from kafka import TopicPartition

    from streams.topics import KafkaSetupError, kafka_consumer

    c = consumer or kafka_consumer(bootstrap, client_id="chipledger-log-export", timeout_s=timeout_s)
    try:
        parts = c.partitions_for_topic(TOPIC_LOG)
        if not parts:
            raise KafkaSetupError(f"topic {TOPIC_LOG} does not exist at {bootstrap}: create the topics with "
                                  "`chipledger topics create`")
        chosen = sorted(parts) if pool is None else [key_partition(pool.encode(), len(parts))]
        tps = [TopicPartition(TOPIC_LOG, p) for p in chosen]
        c.assign(tps)
        ends = c.end_offsets(tps)
        report = ExportReport()
        tmp = Path(str(path) + ".part")
        with open(tmp, "wb") as out:
            for tp in tps:
                c.seek_to_beginning(tp)
                end = ends[tp]
                c.pause(*[t for t in tps if t != tp])
                c.resume(tp)
                while c.position(tp) < end:
                    got = c.poll(timeout_ms=int(timeout_s * 1000), max_records=10_000)
                    recs = [r for r in got.get(tp, []) if r.offset < end]
                    if not got:
                        raise KafkaSetupError(f"reading {TOPIC_LOG}[{tp.partition}] stopped at offset "
                                              f"{c.position(tp)} of {end} (no answer within {timeout_s:g}s)")
                    export_records(recs, out, pool, report)
        tmp.replace(path)
        return report
    finally:
        if consumer is None:
            c.close()
