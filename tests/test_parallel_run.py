"""Pool-parallel runs (chipledger/parallel.py): `--jobs 2` gives the lake of `--jobs 1` (the same rows in every
table, the same summary, the `deadletters` files byte for byte), bad lines and lines without a pool included,
and an interrupted parallel run leaves nothing visible."""

from __future__ import annotations

import gc
import hashlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import duckdb
import orjson
import pytest

from analytics.commits import open_lake
from analytics.lake import TABLES
from chipledger.demo import write_events
from chipledger.embedded import run_file
from chipledger.parallel import deal_pools, route_lines
from streams import logline

pytestmark = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")


def _with_bad_lines(path):
    """The seeded fleet's file with a byte order mark, a duplicate, a conflicting duplicate, a late event, lines
    that are not events (no readable pool) and a pool written with an escape (only the full parse reads it)."""
    lines = path.read_bytes().splitlines()
    first = json.loads(lines[40])
    late = {**json.loads(lines[300]), "event_id": "late-1", "type": "pool.tick"}
    late = {k: late[k] for k in ("event_id", "type", "occurred_at", "pool", "source")}
    ahead = {**late, "event_id": "ahead-1", "occurred_at": "2027-06-01T00:00:00Z"}  # clock_ahead: judged per pool
    escaped = json.dumps({**late, "event_id": "esc-1"}, ensure_ascii=True).replace('"pool"', '"p\\u006fol"')
    bad = [b"not json", b'{"type": "job.started"}', lines[40], json.dumps({**first, "source": "x"}).encode(),
           json.dumps(late).encode(), b"", b"[1, 2]", escaped.encode(), b'{"pool": "nowhere", "type": "x"}',
           json.dumps(ahead).encode()]
    out = [b"\xef\xbb\xbf" + bad[0], lines[0]]
    for i, line in enumerate(lines[1:], 1):
        if i % 700 == 0:  # a line of a `log export` (its pool inside an escaped value, its origin applied)
            line = logline.wrap(line, None, "cluster-x")
        out.append(line)
        if i % 300 == 0:
            out.append(bad[(i // 300) % len(bad)])
    path.write_bytes(b"\n".join(out) + b"\n")


def lake_digests(lake) -> dict[str, str]:
    """Per committed table: its row count and the sha256 of its rows, sorted (what does not depend on files)."""
    snap = open_lake(lake, TABLES)
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    out = {}
    for t in TABLES:
        files = snap.table_files(t) or []
        rows = sorted(map(repr, con.execute(f"SELECT * FROM read_parquet({files!r})").fetchall())) if files else []
        out[t] = f"{len(rows)}:{hashlib.sha256(chr(10).join(rows).encode()).hexdigest()[:16]}"
    return out


def _files(lake, table):
    return {str(p.relative_to(lake)): p.read_bytes() for p in sorted((lake / table).rglob("*.parquet"))}


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("par") / "events.jsonl"
    write_events(path, seed=3, days=3)
    _with_bad_lines(path)
    return path


def test_two_jobs_write_the_lake_of_one(fleet_file, tmp_path):
    route, pools, counts, _ = route_lines(fleet_file, 1 << 20)
    assert len(pools) >= 2, pools
    (a, fa), (b, fb) = (run_file(fleet_file, tmp_path / f"lake-{j}", jobs=j) for j in (1, 2))
    assert a.accepted > 3_000 and a.dead_letter_total >= 8 and a.duplicates >= 1 and a.late >= 1
    assert a.dead_letters["clock_ahead"] >= 1
    con = duckdb.connect()
    assert con.execute(f"SELECT count(*) FROM read_parquet('{tmp_path}/lake-2/events/*/*.parquet') "
                       f"WHERE accepted_from = 'cluster-x'").fetchone()[0] >= 3
    da, db = a.as_dict(), b.as_dict()
    for d in (da, db):
        d.pop("seconds"), d.pop("lake")
    assert da == db
    assert lake_digests(tmp_path / "lake-1") == lake_digests(tmp_path / "lake-2")
    assert int(lake_digests(tmp_path / "lake-1")["run_costs"].split(":")[0]) > 100  # the demo's prices: runs priced
    assert _files(tmp_path / "lake-1", "deadletters") == _files(tmp_path / "lake-2", "deadletters")
    assert {p: s.to_dict() for p, s in fa.pools.items()} == {p: s.to_dict() for p, s in fb.pools.items()}
    assert list(fa.pools) == list(fb.pools)


def test_pools_are_dealt_by_size_whatever_their_order():
    assert deal_pools(["a", "b", "c", "d"], [10, 40, 30, 20], 2) == [0, 0, 1, 1]  # b (40) to 0, c (30) to 1, d (20) to 1, a (10) to 0
    assert deal_pools(["a", "b"], [5, 5], 2) == [0, 1]


def test_ctrl_c_during_a_parallel_run_leaves_nothing_visible(fleet_file, tmp_path):
    big = tmp_path / "big.jsonl"
    data = fleet_file.read_bytes()
    with open(big, "wb") as f:  # the file's pools renamed in copies: long enough to be interrupted while folding
        for c in range(6):
            f.write(data.replace(b'"pool": "', f'"pool": "c{c}-'.encode()).replace(b'"pool":"', f'"pool":"c{c}-'.encode()))
    lake = tmp_path / "lake"
    cmd = [sys.executable, "-c", "from chipledger.cli import app; app()", "run", "--events", str(big), "--lake", str(lake),
           "--store", f"sqlite:///{tmp_path / 's.db'}", "--jobs", "2"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=os.getcwd())
    deadline = time.monotonic() + 120
    while not any((lake / "_staging").glob("*/*/*/*.parquet")) if (lake / "_staging").exists() else True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole group
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert b"nothing of this run was committed" in err
    assert not (lake / "_lake.json").exists()
    staging = lake / "_staging"
    assert not (staging.exists() and any(staging.rglob("*.parquet")))


def test_lake_upgrade_with_two_jobs_folds_the_facts_of_one(fleet_file, tmp_path):
    from chipledger.refold import REFOLDABLE as FACT_TABLES, refold_facts  # the price facts (run_costs) too

    digests = []
    for j in (1, 2):
        lake = tmp_path / f"lake-{j}"
        run_file(fleet_file, lake, jobs=1)
        out = refold_facts(lake, tables=list(FACT_TABLES), jobs=j)
        assert out["events"] > 3_000 and not out["rejected"], out
        d = lake_digests(lake)
        digests.append((out, {t: d[t] for t in FACT_TABLES}))
    assert digests[0] == digests[1]
    run_file(fleet_file, tmp_path / "lake-run", jobs=2)
    assert digests[0][1] == {t: d for t, d in lake_digests(tmp_path / "lake-run").items() if t in FACT_TABLES}


def test_a_backtest_sweep_in_parallel_reports_what_one_process_does(fleet_file, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from chipledger.cli import app
    from chipledger.sim import backtest

    monkeypatch.setattr(backtest, "PART_MIN_BYTES", 64 << 10)  # the log is read in parts by processes too

    cfgs = []
    for i, grace in enumerate((60, 600, 3600)):
        c = tmp_path / f"c{i}.toml"
        c.write_text(f"[policy]\npreemption_grace_s = {grace}\n")
        cfgs += ["--config", str(c)]
    reports = []
    for j in (1, 2):
        res = CliRunner().invoke(app, ["backtest", "--events", str(fleet_file), *cfgs, "--jobs", str(j), "--json"])
        assert res.exit_code == 0, res.output
        r = json.loads(res.stdout)
        for c in r["configs"].values():
            assert c.pop("seconds") >= 0
        reports.append(r)
    assert list(reports[0]["configs"]) == ["defaults", "c0.toml", "c1.toml", "c2.toml"]
    assert reports[0] == reports[1]


def test_the_demand_read_in_parts_by_processes_is_the_demand_read_by_one(fleet_file, monkeypatch):
    """load_demand with jobs: the file's parts parsed by forked processes (parts made small here, so there are many:
    lines that are not events, blank lines and `log export` lines fall into every part), applied in file order."""
    from chipledger.sim import backtest

    monkeypatch.setattr(backtest, "PART_MIN_BYTES", 16 << 10)
    one = backtest.load_demand(fleet_file, jobs=1)
    assert len(backtest._file_parts(open(fleet_file, "rb"), 3)) > 6
    assert one.invalid >= 8 and one.first_invalid.startswith("line 1: ") and len(one.jobs) > 100
    for jobs in (2, 3):
        many = backtest.load_demand(fleet_file, jobs=jobs)
        assert many == one
        assert (list(many.pools), list(many.quotas), list(many.observed_wait), list(many.prices)) == \
            (list(one.pools), list(one.quotas), list(one.observed_wait), list(one.prices))
    assert backtest.load_demand(fleet_file, days=1, jobs=2) == backtest.load_demand(fleet_file, days=1, jobs=1)


def test_a_price_read_in_a_later_part_takes_effect_at_the_pool_clock_its_pool_reached(fleet_file, tmp_path, monkeypatch):
    """A price set late in the log (its event time long past) takes effect at the clock its pool had reached, as the
    fold does: read in parts, the pool's events of earlier parts (of types the demand does not use) still move it."""
    from chipledger.sim import backtest

    monkeypatch.setattr(backtest, "PART_MIN_BYTES", 16 << 10)
    lines = fleet_file.read_bytes().splitlines()
    pool = "us-east1-a/h100-80gb"
    late = orjson.dumps({"event_id": "price-late", "type": "price.set", "occurred_at": "2026-11-02T01:00:00Z",
                         "pool": pool, "source": "finance/demo", "unit": "USD-cent", "price_id": "late",
                         "per_chip_hour": 300})
    path = tmp_path / "late-price.jsonl"
    path.write_bytes(b"\n".join(lines + [late]) + b"\n")
    one = backtest.load_demand(path, jobs=1)
    (at, setting), = [(t, f) for t, f in one.prices[pool] if f["price_id"] == "late"]
    recs = [backtest._demand_record(raw) for raw in lines]
    clock = max(r[0] for r in recs if r is not None and r[0] != "invalid" and r[2] == pool)
    assert at == clock > backtest._demand_record(late)[0] and setting["per_chip_hour"] == 300
    assert backtest.load_demand(path, jobs=2) == one


def test_the_routing_reads_each_lines_pool_as_the_parse_does():
    """chipledger.parallel._pool_of: the quick read of a compact line, the pattern (spaces, a `log export` line)
    and the full parse (an escaped name, a pool in the type) give the pool the parsed event has; a line with no
    readable pool is None (this process's own)."""
    from chipledger.parallel import _pool_of
    from schemas import Rejection, parse_event

    base = {"event_id": "e1", "type": "pool.tick", "occurred_at": "2026-11-02T00:00:00Z", "pool": "p-1",
            "source": "s"}
    lines = [json.dumps(base, separators=(",", ":")).encode(), json.dumps(base).encode(),
             json.dumps({**base, "pool": "pool-9"}, separators=(",", ":")).encode(),
             json.dumps({**base, "type": "pool.configured", "flavor": "x", "chips_per_node": 8},
                        separators=(",", ":")).encode(),
             json.dumps({**base, "pool": "p\u00e9"}, separators=(",", ":"), ensure_ascii=False).encode(),
             json.dumps({**base, "pool": "a\"b"}, separators=(",", ":")).encode(),
             json.dumps(base, separators=(",", ":")).replace('"pool"', '"p\\u006fol"').encode(),
             b'{"pool":"x", "pool":"y"}', b'{"pool":"\xff"}', b"not json", b'{"type":"pool.tick"}']
    for raw in lines:
        event = parse_event(raw, 1 << 20)
        assert _pool_of(raw, 1 << 20) == (None if isinstance(event, Rejection) else event.pool), raw
    wrapped = logline.wrap(lines[0], None, "cluster-x")
    assert _pool_of(wrapped, 1 << 20) == "p-1"


class _Trap:
    """Garbage only the cyclic collector frees (it refers to itself); when a process other than `parent` frees it,
    that process leaves a file named by its pid in `seen`."""

    def __init__(self, seen, parent):
        self.seen, self.parent, self.me = seen, parent, self

    def __del__(self):
        if os.getpid() != self.parent:
            (self.seen / str(os.getpid())).write_text("collected what it came with")


def test_a_forked_process_never_collects_what_it_came_with(tmp_path):
    """CI: forked processes of `lake upgrade` and of a backtest (forked from the test suite's process, which had
    run other work) died of a segmentation fault collecting the parent's garbage (DuckDB connections and Arrow
    buffers among it, whose finalizers must not run in a copy). `forked_child` freezes what the process came with."""
    from chipledger.embedded import forked_child

    seen = tmp_path / "seen"
    seen.mkdir()
    ctx = multiprocessing.get_context("fork")

    def child(freeze):
        if freeze:
            forked_child()
        gc.collect()

    was = gc.isenabled()
    gc.disable()
    try:
        for freeze in (False, True):
            _Trap(seen, os.getpid())  # garbage at once (a cycle): the parent has not collected it when it forks
            p = ctx.Process(target=child, args=(freeze,))
            p.start()
            p.join()
            assert p.exitcode == 0
            assert len(list(seen.iterdir())) == 1, freeze  # without forked_child the child collected it; with, not
            gc.collect()
    finally:
        if was:
            gc.enable()


def test_every_forked_process_of_run_upgrade_and_backtest_freezes_what_it_came_with(fleet_file, tmp_path,
                                                                                     monkeypatch):
    """Where the commands fork (the fold processes and the events process of `run`, the parts of `lake upgrade`, a
    backtest's processes reading the log and simulating), the process calls `forked_child` first."""
    from typer.testing import CliRunner

    import chipledger.embedded as embedded
    from chipledger.cli import app
    from chipledger.refold import REFOLDABLE, refold_facts
    from chipledger.sim import backtest

    marks = tmp_path / "marks"
    marks.mkdir()
    real = embedded.forked_child
    monkeypatch.setattr(embedded, "forked_child",
                        lambda: ((marks / str(os.getpid())).write_text(sys._getframe(1).f_code.co_name), real())[1])
    monkeypatch.setattr(backtest, "PART_MIN_BYTES", 64 << 10)
    run_file(fleet_file, tmp_path / "one", jobs=1)  # the events process
    run_file(fleet_file, tmp_path / "two", jobs=2)  # two fold processes
    refold_facts(tmp_path / "one", tables=list(REFOLDABLE), jobs=2)
    c = tmp_path / "c.toml"
    c.write_text("[policy]\npreemption_grace_s = 60\n")
    res = CliRunner().invoke(app, ["backtest", "--events", str(fleet_file), "--config", str(c), "--jobs", "2",
                                   "--json"])
    assert res.exit_code == 0, res.output
    callers = sorted(p.read_text() for p in marks.iterdir())
    assert os.getpid() not in {int(p.name) for p in marks.iterdir()}
    assert {"_events_child", "_worker", "_part_child", "_backtest_worker"} <= set(callers), callers
    assert callers.count("_worker") == 2 and callers.count("_part_child") == 2
    assert callers.count("_backtest_worker") >= 2
