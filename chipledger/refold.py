"""`chipledger lake upgrade`, second half: the fact tables of a lake written before the fold wrote them.

The lake's `events` are every event the fold applied, in the order it applied them (applied_at, then topic,
partition and offset: the order the views use). Folding them again with the same core gives the facts it would
have written then (`waits`, `free_chips`, `progress`, `chip_states`, `grant_intervals`); only the fact tables missing
from the lake are written (or those asked for), staged beside the lake and committed together in one manifest swap
(analytics/commits.py), so an interrupted upgrade leaves nothing half visible and can be run again. The other tables
are left as they are.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Optional

import duckdb
import orjson

from analytics.commits import missing_tables, open_lake, publish, staging_dir
from analytics.lake import SCHEMAS, LakeWriter, read_parquet_sql
from ledger import Fleet, FoldConfig
from schemas import Rejection
from schemas.parse import parse_payload

#: the lake tables the fold writes as facts (a lake without them is upgraded by folding its events again)
FACT_TABLES = ("waits", "free_chips", "progress", "chip_states", "grant_intervals")
#: and the price facts (ledger/prices.py, ledger/costs.py): a lake written before them is upgraded the same way
REFOLDABLE = FACT_TABLES + ("prices", "budgets", "costs")


def missing_fact_tables(lake: Path) -> list[str]:
    """The fact tables a committed lake with events does not have (its manifest names no such table: an earlier
    version did not write it). A table the fold wrote no row of (a lake without grants has no grant_intervals) is
    an empty table after an upgrade (`refold_facts`), and is not folded again at every upgrade."""
    lake = Path(lake)
    missing = [t for t in missing_tables(lake) if t in REFOLDABLE]
    if not missing or not open_lake(lake, ("events",)).table_files("events"):
        return []
    return missing


def refold_facts(lake: Path, fold_config: FoldConfig = FoldConfig(), batch: int = 50_000,
                 tables: Optional[list[str]] = None) -> dict:
    """Fold the committed lake's events again and commit the fact tables `tables` (default: the missing ones) in one
    commit, replacing those tables. Returns {"events": n, "rejected": n, "rows": {table: n}}. Rejections can only
    come from a lake whose events another core folded differently; they are counted, not written."""
    lake = Path(lake)
    tables = missing_fact_tables(lake) if tables is None else tables
    out = {"events": 0, "rejected": Counter(), "rows": {t: 0 for t in tables}}
    if not tables:
        return out
    snap = open_lake(lake, ("events",))
    stage = staging_dir(lake, "upgrade")
    shutil.rmtree(stage, ignore_errors=True)
    writer = LakeWriter(stage, f"upgrade-{snap.commit + 1:08d}")
    fleet = Fleet(fold_config)
    days: dict[str, list[str]] = {}
    for f in snap.table_files("events") or ():
        days.setdefault(Path(f).parent.name, []).append(f)
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    try:
        for day in sorted(days):  # the files are by day of applied_at: in time order, one day sorted at a time
            cur = con.execute(f'SELECT body FROM ({read_parquet_sql(days[day])}) '
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
        publish(lake, stage, by=f"lake upgrade: {', '.join(tables)} folded again", replace=tables)
    finally:
        con.close()
        shutil.rmtree(stage, ignore_errors=True)
    out["rejected"] = dict(out["rejected"])
    return out


assert all(t in SCHEMAS for t in FACT_TABLES)
