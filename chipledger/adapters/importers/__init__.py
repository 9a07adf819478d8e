"""Importers: real cluster traces and scheduler logs to chipledger event JSONL (see docs/importers.md).

Each importer streams its input and writes events through `TraceWriter`, which orders them by time, validates
every event against the wire contract, ends each pool with a `pool.tick`, and counts what was skipped and why.
"""

from chipledger.adapters.importers.base import ImportReport, TraceFormatError, TraceWriter, iso

__all__ = ["ImportReport", "TraceFormatError", "TraceWriter", "iso"]
