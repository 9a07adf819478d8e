"""bench/analytics.py --copies: a lake of K copies of a generated lake, each copy's pools renamed, is the lake the
fold of the K pool-renamed copies of its events writes (the facts folded again from the copied events are the
copied facts), and every report view over it is K renamed copies of the view over the lake copied."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analytics.lake import SCHEMAS, read_parquet_sql
from analytics.views import connect
from analytics.commits import adopt
from chipledger.refold import FACT_TABLES, refold_facts

from tests.bench_support import bench_module

K = 3


def _bench():
    return bench_module("analytics")


@pytest.fixture(scope="module")
def lakes(tmp_path_factory):
    """A generated lake with its facts folded (as the benchmark makes it), and K copies of it."""
    bench = _bench()
    root = tmp_path_factory.mktemp("copies")
    bench.generate(root / "one", 12_000)
    refold_facts(root / "one" / "lake", tables=list(FACT_TABLES))
    rows = bench.copy_lake(root / "one" / "lake", root / "k" / "lake", K)
    return bench, root / "one" / "lake", root / "k" / "lake", rows


#: the fact tables the generated lake has rows of (its jobs report no progress: `progress` stays empty)
FOLDED = tuple(t for t in FACT_TABLES if t != "progress")


def _table(lake: Path, table: str) -> str:
    return read_parquet_sql(str(lake / table / "**" / "*.parquet"))


def test_every_table_is_copied_k_times_in_the_same_layout(lakes):
    bench, one, k, rows = lakes
    con = duckdb.connect()
    for t in ("events", "job_runs", "journal", *FOLDED):
        n = con.execute(f"SELECT count(*) FROM ({_table(one, t)})").fetchone()[0]
        assert n > 0 and rows[t] == K * n, t
        # the same day folders, each with a file per copy of the lake's schema
        days = sorted(p.name for p in (one / t).iterdir())
        assert sorted(p.name for p in (k / t).iterdir()) == days
        for day in days:
            files = sorted((k / t / day).glob("*.parquet"))
            assert [f.name for f in files] == [f"part-copy{c}of{K}-0001.parquet" for c in range(K)]
            assert all(pq.read_schema(f).names == SCHEMAS[t].names for f in files)
        # each copy is the lake's rows with the pool renamed
        pools = con.execute(f"SELECT DISTINCT pool FROM ({_table(one, t)})").fetchall()
        want = {p + bench.copy_suffix(c) for (p,) in pools for c in range(K)}
        assert {p for (p,) in con.execute(f"SELECT DISTINCT pool FROM ({_table(k, t)})").fetchall()} == want
    # events: the ids and the bodies' pool and id renamed, the copies in turn at each offset
    bad = con.execute(f"""SELECT count(*) FROM ({_table(k, 'events')})
        WHERE json_extract_string(body, '$.pool') <> pool OR json_extract_string(body, '$.event_id') <> event_id
           OR NOT ends_with(event_id, coalesce(nullif(regexp_extract(pool, '(-c[0-9]+)$'), ''), ''))""").fetchone()[0]
    assert bad == 0
    offsets = con.execute(f'SELECT count(DISTINCT "offset"), count(*) FROM ({_table(k, "events")})').fetchone()
    assert offsets[0] == offsets[1]
    # the bodies of copy c are the lake's with the two fields renamed, nothing else
    same = con.execute(f"""
        SELECT count(*) FROM ({_table(one, 'events')}) o JOIN ({_table(k, 'events')}) c
            ON c.event_id = o.event_id || '-c2' AND c."offset" = o."offset" * {K} + 2
        WHERE json(c.body) = json(replace(replace(o.body, '"pool":"' || o.pool || '"', '"pool":"' || o.pool || '-c2"'),
                                          '"event_id":"' || o.event_id || '"', '"event_id":"' || o.event_id || '-c2"'))
    """).fetchone()[0]
    assert same == rows["events"] // K


def test_the_copies_are_what_the_fold_of_the_copied_events_writes(lakes, tmp_path):
    """Fold the copied events again (chipledger lake upgrade's refold) and compare every fact table, EXCEPT ALL both
    ways, with the copied facts."""
    _, _, k, _ = lakes
    again = tmp_path / "lake"
    again.mkdir()
    shutil.copytree(k / "events", again / "events")
    adopt(again, refoldable=FACT_TABLES)  # a lake of its events alone, committed (as `lake upgrade` adopts one)
    res = refold_facts(again, tables=list(FACT_TABLES))
    assert res["rejected"] == {} and res["events"] > 0
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    for t in FOLDED:
        a, b = _table(again, t), _table(k, t)
        assert res["rows"][t] == con.execute(f"SELECT count(*) FROM ({b})").fetchone()[0] > 0, t
        for x, y in ((a, b), (b, a)):
            assert con.execute(f"SELECT count(*) FROM (({x}) EXCEPT ALL ({y}))").fetchone()[0] == 0, t


def _rows(con, view: str) -> tuple[list[str], list[tuple]]:
    cur = con.execute(f'SELECT * FROM "{view}"')
    return [d[0] for d in cur.description], cur.fetchall()


def _key(row: tuple) -> tuple:
    return tuple((x is None, "" if x is None else str(x) if not isinstance(x, float) else f"{x:.6e}") for x in row)


def _same(a: list[tuple], b: list[tuple], view: str) -> None:
    """The same rows in any order; doubles to 1e-12 (DuckDB sums floats in the order its threads finish)."""
    assert len(a) == len(b), view
    for x, y in zip(sorted(a, key=_key), sorted(b, key=_key)):
        for u, v in zip(x, y):
            if isinstance(u, float) and isinstance(v, float):
                close = math.isclose(u, v, rel_tol=1e-12, abs_tol=1e-12)
                assert close or (math.isnan(u) and math.isnan(v)), (view, x, y)
            else:
                assert u == v, (view, x, y)


@pytest.mark.parametrize("view", ["error_budget", "burn_alerts", "slo_quota_honoured", "slo_sched_latency",
                                  "fragmentation", "demand_shaping", "demand_peak_teams", "slo_capacity", "goodput",
                                  "hol_blocking", "sched_waits"])
def test_each_report_view_of_the_copies_is_k_renamed_copies_of_the_lakes(lakes, view):
    bench, one, k, _ = lakes
    cols, orig = _rows(connect(one, materialize=True), view)
    _, copied = _rows(connect(k, materialize=True), view)
    p = cols.index("pool")
    per_pool = [r for r in orig if r[p] is not None]
    assert per_pool, view
    want = [(*r[:p], r[p] + bench.copy_suffix(c), *r[p + 1:]) for c in range(K) for r in per_pool]
    _same([r for r in copied if r[p] is not None], want, view)
    if view == "error_budget":  # the all-pools rows: K times the counts, the same ratios
        whole = {r[0]: r for r in orig if r[p] is None}
        for r in (r for r in copied if r[p] is None):
            o = whole.pop(r[0])
            for c in ("good", "total", "bad", "allowed_bad"):
                i = cols.index(c)
                assert r[i] == pytest.approx(K * o[i], rel=1e-12)
            for c in ("sli", "consumed", "remaining"):
                i = cols.index(c)
                assert r[i] == pytest.approx(o[i], rel=1e-12) if o[i] is not None else r[i] is None
        assert whole == {}
    else:  # every row is a pool's
        assert len(per_pool) == len(orig) and len(copied) == K * len(orig), view


def test_a_lake_of_copies_refuses_a_body_it_cannot_rename(tmp_path):
    """An events body that does not spell its pool as canonical JSON stops the copy with an error naming the event."""
    bench = _bench()
    src = tmp_path / "src"
    day = src / "events" / "day=2026-01-01"
    day.mkdir(parents=True)
    row = {f.name: None for f in SCHEMAS["events"]}
    row.update(event_id="e1", type="pool.tick", pool="p", source="s", lateness_s=0, topic="t", partition=0, offset=1,
               body='{"event_id": "e1", "pool": "p", "type": "pool.tick"}')
    pq.write_table(pa.Table.from_pylist([row], schema=SCHEMAS["events"]), day / "part-x-0001.parquet")
    with pytest.raises(duckdb.Error, match="event e1 of pool p: its body does not spell"):
        bench.copy_lake(src, tmp_path / "dst", 2)
    decisions = src / "decisions" / "day=2026-01-01"
    decisions.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([], schema=SCHEMAS["decisions"]), decisions / "x.parquet")
    with pytest.raises(ValueError, match=r"cannot copy the tables \['decisions'\]"):
        bench.copy_lake(src, tmp_path / "dst", 2)
