"""Writing lake files row by row, for tests that build small lakes by hand, and reading back what views answer."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from analytics.lake import DAY_COLUMN, SCHEMAS


def write_rows(lake: Path, table: str, rows: list[dict], name: str) -> Path:
    """One Parquet file of `table`, `part-NAME.parquet`, in the day of its first row (dicts by column, missing ones
    null; times as epoch seconds)."""
    def value(f, v):
        return datetime.fromtimestamp(v, tz=timezone.utc) if v is not None and pa.types.is_timestamp(f.type) else v
    schema = SCHEMAS[table]
    t = pa.Table.from_pydict({f.name: pa.array([value(f, r.get(f.name)) for r in rows], type=f.type) for f in schema},
                             schema=schema)
    folder = lake / table / f"day={datetime.fromtimestamp(rows[0][DAY_COLUMN[table]], tz=timezone.utc):%Y-%m-%d}"
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(t, folder / f"part-{name}.parquet")
    return folder / f"part-{name}.parquet"


def view_rows(con, name: str) -> list[str]:
    """A table's or view's rows, sorted, floats to 10 significant digits (a parallel sum's last bits vary between
    runs): two connections' answers compare equal when they are the same rows."""
    def norm(v):
        return float(f"{v:.10g}") if isinstance(v, float) else v
    return sorted(repr(tuple(map(norm, r))) for r in con.execute(f'SELECT * FROM "{name}"').fetchall())
