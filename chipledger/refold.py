"""`chipledger lake upgrade`, second half: the fact tables of a lake written before the fold wrote them.

The lake's `events` are every event the fold applied, in the order it applied them (applied_at, then topic,
partition and offset: the order the views use). Folding them again with the same core gives the facts it would
have written then (`waits`, `free_chips`, `progress`, `chip_states`, `grant_intervals`); only the fact tables missing
from the lake are written (or those asked for), staged beside the lake and committed together in one manifest swap
(analytics/commits.py), so an interrupted upgrade leaves nothing half visible and can be run again. The other tables
are left as they are.
"""

from __future__ import annotations

import multiprocessing
import shutil
import signal
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
REFOLDABLE = FACT_TABLES + ("prices", "budgets", "costs", "run_costs")


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
                 tables: Optional[list[str]] = None, jobs: int = 1) -> dict:
    """Fold the committed lake's events again and commit the fact tables `tables` (default: the missing ones) in one
    commit, replacing those tables. Returns {"events": n, "rejected": n, "rows": {table: n}}. Rejections can only
    come from a lake whose events another core folded differently; they are counted, not written. With `jobs` > 1
    (where processes can fork) that many processes fold disjoint sets of pools (dealt by their numbers of events,
    chipledger.parallel.deal_pools), each reading only its pools' events in the same order: the tables get the same
    rows as with one (in other files), still in one commit."""
    lake = Path(lake)
    tables = missing_fact_tables(lake) if tables is None else tables
    out = {"events": 0, "rejected": Counter(), "rows": {t: 0 for t in tables}}
    if not tables:
        return out
    snap = open_lake(lake, ("events",))
    stage = staging_dir(lake, "upgrade")
    shutil.rmtree(stage, ignore_errors=True)
    names = f"upgrade-{snap.commit + 1:08d}"
    days: dict[str, list[str]] = {}
    for f in snap.table_files("events") or ():
        days.setdefault(Path(f).parent.name, []).append(f)
    try:
        groups = _pool_groups(days, jobs) if jobs > 1 and "fork" in multiprocessing.get_all_start_methods() else [None]
        if len(groups) == 1:
            parts = [_refold_part(days, None, stage, names, fold_config, tables, batch)]
        else:
            parts = _in_processes(days, groups, stage, names, fold_config, tables, batch)
        for part in parts:
            out["events"] += part["events"]
            out["rejected"].update(part["rejected"])
            for t in tables:
                out["rows"][t] += part["written"].get(t, 0)
        publish(lake, stage, by=f"lake upgrade: {', '.join(tables)} folded again", replace=tables)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    out["rejected"] = dict(out["rejected"])
    return out


def _pool_groups(days: dict[str, list[str]], jobs: int) -> list:
    """The pools of the lake's events dealt to at most `jobs` processes ([None]: one process, every pool)."""
    from chipledger.parallel import deal_pools

    files = [f for fs in days.values() for f in fs]
    if not files:
        return [None]
    con = duckdb.connect()
    try:
        counts = dict(con.execute(f"SELECT pool, count(*) FROM ({read_parquet_sql(files)}) GROUP BY pool").fetchall())
    finally:
        con.close()
    pools = sorted(counts, key=lambda p: (p is None, p or ""))
    jobs = min(jobs, len(pools))
    if jobs < 2:
        return [None]
    owner = deal_pools([p or "" for p in pools], [counts[p] for p in pools], jobs)
    return [[p for p, o in zip(pools, owner) if o == k] for k in range(jobs)]


def _refold_part(days: dict[str, list[str]], pools: Optional[list], stage: Path, names: str, fold_config: FoldConfig,
                 tables: list[str], batch: int) -> dict:
    """Fold the events of `pools` (None: all) in the lake's order and write the facts `tables` into `stage`."""
    writer = LakeWriter(stage, names)
    fleet = Fleet(fold_config)
    out = {"events": 0, "rejected": Counter()}
    where = ""
    if pools is not None:
        quoted = ", ".join("'" + p.replace("'", "''") + "'" for p in pools if p is not None)
        where = f"WHERE pool IN ({quoted})" + (" OR pool IS NULL" if None in pools else "")
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    try:
        for day in sorted(days):  # the files are by day of applied_at: in time order, one day sorted at a time
            cur = con.execute(f'SELECT body FROM ({read_parquet_sql(days[day])}) {where} '
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
        out["written"] = writer.close()
    except BaseException:
        try:
            writer.wait()
        except Exception:  # noqa: BLE001 - the staged folder goes anyway
            pass
        raise
    finally:
        con.close()
    return out


def _in_processes(days, groups: list, stage: Path, names: str, fold_config: FoldConfig, tables: list[str],
                  batch: int) -> list[dict]:
    """`_refold_part` for each group of pools in a forked process of its own (files named `<names>-j<k>-…`)."""
    from chipledger.parallel import collect, end_processes

    ctx = multiprocessing.get_context("fork")
    procs, conns = [], []
    try:
        for k, pools in enumerate(groups):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_part_child, name=f"chipledger-refold-{k}", daemon=True,
                            args=(days, pools, stage, f"{names}-j{k}", fold_config, tables, batch, child_end))
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        parts = collect(procs, conns, "refold", OSError)
        return [parts[k] for k in sorted(parts)]
    finally:
        end_processes(procs, conns)


def _part_child(days, pools, stage, names, fold_config, tables, batch, conn) -> None:
    from chipledger.embedded import forked_child

    forked_child()  # what came with the fork is not this process's garbage
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the upgrade's process's to handle (it ends this one)
    try:
        conn.send(("ok", _refold_part(days, pools, stage, names, fold_config, tables, batch)))
    except Exception as exc:  # told to the upgrade, which fails with it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


assert all(t in SCHEMAS for t in FACT_TABLES)
