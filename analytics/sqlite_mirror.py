"""The SLO views on SQLite: the same base rows copied out of DuckDB, the same portable SQL on top.

Used by bench/analytics.py as the in-run baseline (the same SQL over the same rows on another engine) and by
the tests to check that the portable layer of analytics/slo_views.py really is portable. Times stay integer
epoch seconds on SQLite (`Dialect.ts` is the identity there).
"""

from __future__ import annotations

import sqlite3
from typing import Collection

import duckdb

from analytics.slo_views import SQLITE, duckdb_base_views, slo_views

# base_event_rows holds lists (placements), which SQLite cannot; the portable views do not read it
BASE_TABLES = tuple(v for v in duckdb_base_views() if v != "base_event_rows") + ("slo_targets", "slo_settings")

# indexes SQLite needs for the joins of the portable views (DuckDB hashes them instead)
_INDEXES = (
    "CREATE INDEX base_chip_states_chip ON base_chip_states (pool, chip_id, at_s, seq)",
    "CREATE INDEX base_free_chips_at ON base_free_chips (pool, at_s)",
)


def mirror(duck: duckdb.DuckDBPyConnection, path: str = ":memory:", batch: int = 200_000,
           materialized: Collection[str] = ()) -> sqlite3.Connection:
    """A SQLite database holding the base tables of `duck` (a connection from analytics.views.connect) and
    the portable SLO views over them, but for those named in `materialized` (analytics.views.MATERIALIZED): those
    are tables that `materialize` computes, as `connect(materialize=True)` does on DuckDB."""
    con = sqlite3.connect(path)
    for table in BASE_TABLES:
        cur = duck.execute(f'SELECT * FROM "{table}"')
        cols = [c[0] for c in cur.description]
        con.execute(f'CREATE TABLE "{table}" ({", ".join(cols)})')
        insert = f'INSERT INTO "{table}" VALUES ({", ".join("?" * len(cols))})'
        while True:
            rows = cur.fetchmany(batch)
            if not rows:
                break
            con.executemany(insert, rows)
    for sql in _INDEXES:
        con.execute(sql)
    for name, sql in slo_views(SQLITE).items():
        if name not in materialized:
            con.execute(f'CREATE VIEW "{name}" AS {sql}')
    con.commit()
    return con


def materialize(con: sqlite3.Connection, names: Collection[str]) -> None:
    """Compute the intermediates `names` as tables, in definition order (again, if they exist): the same SQL and
    the same intermediates kept as DuckDB's materializing connection, so that the two engines do the same work."""
    for name, sql in slo_views(SQLITE).items():
        if name in names:
            con.execute(f'DROP TABLE IF EXISTS "{name}"')
            con.execute(f'CREATE TABLE "{name}" AS {sql}')
    con.commit()
