"""Edge cases where the lake, the views or the store could disagree with what the ledger folded."""

from __future__ import annotations

import json
import sqlite3

from analytics.views import connect
from chipledger.embedded import run_file
from ledger import Fleet
from store import open_store
from schemas import parse_payload

POOL = "lab/a100"


def ev(eid, etype, hhmm, pool=POOL, **fields):
    return {"event_id": eid, "type": etype, "occurred_at": f"2026-11-02T{hhmm}:00Z", "pool": pool,
            "source": "test", **fields}


def setup_lines(pool=POOL):
    return [ev(f"{pool}-c", "pool.configured", "00:00", pool=pool, flavor="a100", chips_per_node=2),
            ev(f"{pool}-r0", "chip.registered", "00:00", pool=pool, chip_id="c0", node="n0"),
            ev(f"{pool}-r1", "chip.registered", "00:00", pool=pool, chip_id="c1", node="n0")]


def write(path, items):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in items))
    return path


def fold(tmp_path, items, name="e.jsonl", **kw):
    summary, fleet = run_file(write(tmp_path / name, items), tmp_path / "lake", overwrite=True, **kw)
    return summary, connect(tmp_path / "lake")


def test_defaults_left_out_of_the_message_show_in_the_views(tmp_path):
    _, con = fold(tmp_path, setup_lines() + [ev("s", "job.submitted", "01:00", job_id="A", team="a", chips=1)])
    assert con.execute("SELECT priority, preemptible FROM jobs").fetchall() == [(0, True)]


def test_a_job_id_reused_after_the_job_finished_is_another_job(tmp_path):
    items = setup_lines() + [
        ev("s1", "job.submitted", "01:00", job_id="A", team="a", chips=1),
        ev("b1", "job.started", "01:00", job_id="A"),
        ev("p1", "job.preempted", "01:10", job_id="A"),
        ev("f1", "job.finished", "01:20", job_id="A", outcome="cancelled"),
        ev("s2", "job.submitted", "02:00", job_id="A", team="b", chips=1),
        ev("b2", "job.started", "02:00", job_id="A"),
        ev("f2", "job.finished", "02:20", job_id="A", outcome="succeeded"),
    ]
    _, con = fold(tmp_path, items)
    rows = con.execute("SELECT team, outcome, preemptions, allocated_mchip_s, first_started_at::VARCHAR "
                       "FROM jobs ORDER BY submitted_at").fetchall()
    assert [r[:4] for r in rows] == [("a", "cancelled", 1, 600_000), ("b", "succeeded", 0, 1_200_000)]
    assert rows[1][4].startswith("2026-11-02 02:00:00")
    runs = con.execute("SELECT team, run_index, allocated_mchip_s FROM job_run_totals ORDER BY submitted_at").fetchall()
    assert runs == [("a", 1, 600_000), ("b", 1, 1_200_000)]


def test_a_repeated_json_key_is_a_dead_letter(tmp_path):
    # issue 31 (item 8) changed this: a repeated key was read as the ledger's parser read it (the last one winning);
    # parsers disagree on which copy wins, so the contract now takes neither (schema_invalid)
    sub = json.dumps(ev("s", "job.submitted", "01:00", job_id="X", team="a", chips=1))
    sub = sub[:-1] + ', "job_id": "C"}'
    items = setup_lines() + [sub, ev("b", "job.started", "01:00", job_id="C"),
                             ev("f", "job.finished", "01:30", job_id="C", outcome="succeeded")]
    summary, con = fold(tmp_path, items)
    assert summary.dead_letters == {"schema_invalid": 1, "unknown_job": 2}
    assert con.execute("SELECT count(*) FROM jobs").fetchone()[0] == 0
    (detail,) = con.execute("SELECT detail FROM deadletters WHERE error_code = 'schema_invalid'").fetchone()
    assert "'job_id' appears more than once" in detail


def test_dead_letters_before_any_event_get_the_first_event_time(tmp_path):
    summary, con = fold(tmp_path, ["oops", ev("t", "pool.tick", "03:00", pool="nowhere")] + setup_lines())
    assert summary.dead_letters == {"not_json": 1, "unknown_pool": 1}
    seen = con.execute("SELECT seen_at::VARCHAR FROM deadletters").fetchall()
    assert [s[0][:19] for s in seen] == ["2026-11-02 00:00:00"] * 2


def test_a_new_run_replaces_the_pools_of_the_previous_one_in_the_store(tmp_path):
    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    old = setup_lines("old/pool") + [ev("g", "quota.granted", "00:00", pool="old/pool", grant_id="g", team="a",
                                        chips=1)]
    run_file(write(tmp_path / "a.jsonl", old), tmp_path / "lake", overwrite=True, store=store)
    run_file(write(tmp_path / "b.jsonl", setup_lines("new/pool")), tmp_path / "lake", overwrite=True, store=store)
    con = sqlite3.connect(tmp_path / "s.db")
    for table in ("pool_balances", "team_balances", "grants"):
        assert {r[0] for r in con.execute(f"SELECT pool FROM {table}")} <= {"new/pool"}, table
    assert [p.pool for p in store.pool_balances()] == ["new/pool"]


def test_a_snapshot_does_not_change_as_the_fold_goes_on():
    fleet = Fleet()
    for d in setup_lines() + [ev("s", "job.submitted", "01:00", job_id="j", team="a", chips=2),
                              ev("b", "job.started", "01:00", job_id="j", chip_ids=["c0", "c1"])]:
        fleet.apply(parse_payload(d))
    snapshot = fleet.pools[POOL].to_dict()
    frozen = json.dumps(snapshot, sort_keys=True)
    fleet.apply(parse_payload(ev("f", "job.finished", "02:00", job_id="j", outcome="succeeded")))
    assert json.dumps(snapshot, sort_keys=True) == frozen


def test_a_chip_down_under_a_running_job_is_not_free_twice(tmp_path):
    # nodes n0 (c0 c1) and n1 (c2 c3); a job on n0 01:00-02:00; c0 down 01:30-02:30 (while allocated, then not)
    items = [ev("c", "pool.configured", "00:00", flavor="a100", chips_per_node=2)]
    items += [ev(f"r{i}", "chip.registered", "00:00", chip_id=f"c{i}", node=f"n{i // 2}") for i in range(4)]
    items += [ev("s", "job.submitted", "01:00", job_id="J", team="a", chips=2),
              ev("b", "job.started", "01:00", job_id="J", chip_ids=["c0", "c1"]),
              ev("d", "chip.state_changed", "01:30", chip_id="c0", state="down"),
              ev("f", "job.finished", "02:00", job_id="J", outcome="succeeded"),
              ev("u", "chip.state_changed", "02:30", chip_id="c0", state="healthy"),
              ev("t", "pool.tick", "03:00")]
    _, con = fold(tmp_path, items)
    rows = con.execute("SELECT strftime(valid_from, '%H:%M'), free_chips, whole_node_free_chips, fragmentation "
                       "FROM fragmentation ORDER BY valid_from").fetchall()
    assert rows == [("00:00", 4, 4, 0.0), ("01:00", 2, 2, 0.0), ("01:30", 2, 2, 0.0),
                    ("02:00", 3, 2, 1 / 3),  # c1 free, c0 down: n0 not whole
                    ("02:30", 4, 4, 0.0)]


def test_no_progress_bar_in_the_output_of_a_long_query(tmp_path):
    # DuckDB draws one on stdout for queries over 2 s, amid `chipledger sql --format csv` output (seen at 10M events)
    _, con = fold(tmp_path, setup_lines())
    assert con.execute("SELECT current_setting('enable_progress_bar')").fetchone() == (False,)


def test_duckdb_settings_given_to_connect_apply_before_the_intermediates_are_computed(tmp_path):
    """connect(config=…): the memory limit and spill folder a lake larger than the memory needs (bench/analytics.py
    --memory-limit at 100M events) are DuckDB's from the start, and the views answer the same."""
    fold(tmp_path, setup_lines() + [ev("s", "job.submitted", "01:00", job_id="A", team="a", chips=1),
                                    ev("b", "job.started", "01:05", job_id="A", chip_ids=["c0"])])
    spill = tmp_path / "spill"
    limited = connect(tmp_path / "lake", materialize=True,
                      config={"memory_limit": "64MB", "temp_directory": str(spill)})
    assert limited.execute("SELECT current_setting('memory_limit'), current_setting('temp_directory')").fetchone() \
        == ("61.0 MiB", str(spill))
    plain = connect(tmp_path / "lake", materialize=True)
    for view in ("calc_waits", "calc_free_steps", "fragmentation", "sched_waits"):
        rows = plain.execute(f"SELECT * FROM {view} ORDER BY ALL").fetchall()
        assert rows and limited.execute(f"SELECT * FROM {view} ORDER BY ALL").fetchall() == rows, view
