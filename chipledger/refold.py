"""`chipledger lake upgrade`, second half: the fact tables of a lake written before the fold wrote them.

The lake's `events` are every event the fold applied, in the order it applied them (applied_at, then topic,
partition and offset: the order the views use). Folding them again with the same core gives the facts it would
have written then (`waits`, `free_chips`); only the fact tables missing from the lake are written, beside the
lake first and moved into place table by table, so an interrupted upgrade leaves no half table and can be run
again. The other tables are left as they are.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Optional

import duckdb
import orjson

from analytics.lake import SCHEMAS, LakeWriter, read_parquet_sql
from ledger import Fleet, FoldConfig
from schemas import Rejection
from schemas.parse import parse_payload

#: the lake tables the fold writes as facts (a lake without them is upgraded by folding its events again)
FACT_TABLES = ("waits", "free_chips", "chip_states", "grant_intervals")


def missing_fact_tables(lake: Path) -> list[str]:
    """The fact tables a lake with events has no folder of. A folder, not files: a table the fold wrote no row of
    (a lake without grants has no grant_intervals) is an empty folder after an upgrade (`refold_facts`), and is
    not folded again at every upgrade."""
    lake = Path(lake)
    if not any((lake / "events").rglob("*.parquet")):
        return []
    return [t for t in FACT_TABLES if not (lake / t).is_dir()]


def refold_facts(lake: Path, fold_config: FoldConfig = FoldConfig(), batch: int = 50_000,
                 tables: Optional[list[str]] = None) -> dict:
    """Fold the lake's events again and write the fact tables `tables` (default: the missing ones). Returns
    {"events": n, "rejected": n, "rows": {table: n}}. Rejections can only come from a lake whose events another
    core folded differently; they are counted, not written."""
    lake = Path(lake)
    tables = missing_fact_tables(lake) if tables is None else tables
    out = {"events": 0, "rejected": Counter(), "rows": {t: 0 for t in tables}}
    if not tables:
        return out
    tmp = lake / ".upgrading"
    shutil.rmtree(tmp, ignore_errors=True)
    writer = LakeWriter(tmp, "upgrade")
    fleet = Fleet(fold_config)
    days = sorted(p for p in (lake / "events").iterdir() if p.is_dir() and any(p.glob("*.parquet")))
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    try:
        for day in days:  # the files are by day of applied_at: in time order, one day sorted at a time
            cur = con.execute(f'SELECT body FROM ({read_parquet_sql(str(day / "*.parquet"))}) '
                              f'ORDER BY applied_at, topic, "partition", "offset"')
            while rows := cur.fetchmany(batch):
                for (body,) in rows:
                    event = parse_payload(orjson.loads(body))
                    if isinstance(event, Rejection):
                        out["rejected"][event.code.value] += 1
                        continue
                    step = fleet.apply(event)
                    out["events"] += 1
                    if not step.applied:
                        out["rejected"]["duplicate" if step.duplicate else step.rejection.code.value] += 1
                        continue
                    for t in tables:
                        rows_t = getattr(step, t)
                        if rows_t:
                            writer.extend(t, rows_t)
        fleet.close()
        for t, rows_t in fleet.close_facts().items():
            if t in tables:
                writer.extend(t, rows_t)
        written = writer.close()
        for t in tables:
            out["rows"][t] = written.get(t, 0)
            if (tmp / t).exists():
                shutil.rmtree(lake / t, ignore_errors=True)
                (tmp / t).rename(lake / t)
            else:  # nothing to write (a lake without chips or jobs): an empty folder says it was folded
                (lake / t).mkdir(exist_ok=True)
    finally:
        con.close()
        shutil.rmtree(tmp, ignore_errors=True)
    out["rejected"] = dict(out["rejected"])
    return out


assert all(t in SCHEMAS for t in FACT_TABLES)
