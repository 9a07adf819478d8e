"""Reading a lake table back as rows (tuples in the column order of analytics.lake.SCHEMAS, timestamps as
epoch seconds), for the few consumers that need the rows themselves rather than SQL over them: the store's
decisions index after an embedded run."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from analytics.lake import SCHEMAS


def read_rows(root: Path, table: str) -> Iterator[tuple]:
    """Every row of `table` in the lake at `root`, file by file (its committed files in name order, i.e. by
    day)."""
    from analytics.commits import open_lake

    schema = SCHEMAS[table]
    for path in open_lake(root, (table,)).table_files(table) or ():
        t = pq.read_table(path, schema=schema)
        cols = []
        for f in schema:
            col = t.column(f.name)
            if pa.types.is_timestamp(f.type):
                col = col.cast(pa.int64())  # seconds since the epoch (the lake's unit is seconds)
            cols.append(col.to_pylist())
        yield from zip(*cols)
