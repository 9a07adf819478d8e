"""The lake writer and the views on it: day partitions, bounded buffers, empty tables."""

from __future__ import annotations

import pytest

import pyarrow as pa

from analytics.lake import LakeError, LakeWriter, SCHEMAS, lake_has_data, rows_table
from analytics.views import connect, view_names

DAY = 86_400
T0 = 1_793_577_600  # 2026-11-02T00:00:00Z

from lake_support import commit_written  # noqa: E402  (tests/lake_support.py)


def journal_row(t, amount=1000):
    return ("p", t, "capacity", None, amount)


def test_rows_land_in_day_partitions_and_old_days_are_written_early(tmp_path):
    w = LakeWriter(tmp_path, "run1")
    for day in range(5):
        for h in range(24):
            w.add("journal", journal_row(T0 + day * DAY + h * 3600))
    # before close, every day older than the newest two is already written (the last one may still be in its
    # writing thread: wait() waits for it)
    w.wait()
    on_disk = sorted(p.parent.name for p in (tmp_path / "journal").rglob("*.parquet"))
    assert on_disk == ["day=2026-11-02", "day=2026-11-03", "day=2026-11-04"]
    assert w.close() == {"journal": 120}
    on_disk = sorted(p.parent.name for p in (tmp_path / "journal").rglob("*.parquet"))
    assert on_disk == [f"day=2026-11-0{d}" for d in range(2, 7)]
    commit_written(tmp_path)
    con = connect(tmp_path)
    assert con.execute("SELECT count(*), sum(amount_mchip_s) FROM journal_postings").fetchone() == (120, 120_000)
    assert con.execute("SELECT min(hour)::VARCHAR FROM journal").fetchone()[0].startswith("2026-11-02 00:00:00")


def test_late_rows_for_a_written_day_go_to_a_new_file(tmp_path):
    w = LakeWriter(tmp_path, "run1")
    w.add("journal", journal_row(T0))
    w.add("journal", journal_row(T0 + 3 * DAY))  # writes day 0
    w.add("journal", journal_row(T0 + 60))         # a lagging pool: day 0 again
    w.close()
    files = sorted(p.name for p in (tmp_path / "journal" / "day=2026-11-02").iterdir())
    assert files == ["part-run1-0001.parquet", "part-run1-0002.parquet"]
    commit_written(tmp_path)
    assert connect(tmp_path).execute("SELECT count(*) FROM journal_postings").fetchone()[0] == 3


def test_empty_lake_has_every_view(tmp_path):
    assert not lake_has_data(tmp_path)
    con = connect(tmp_path)
    for name in view_names():
        assert con.execute(f'SELECT count(*) FROM "{name}"').fetchone()[0] == 0, name
    cols = [d[0] for d in con.execute("SELECT * FROM jobs").description]
    assert cols == ["job_id", "pool", "team", "user", "chips", "chips_milli", "priority", "preemptible", "submitted_at",
                    "first_started_at",
                    "finished_at", "outcome", "preemptions", "allocated_mchip_s", "lost_mchip_s",
                    "requeues", "failures"]  # (requeues, failures: issue 35 item 4's causes)
    assert "error_code" in [d[0] for d in con.execute("SELECT * FROM deadletters").description]
    assert set(SCHEMAS) == {"events", "journal", "job_runs", "decisions", "balances", "pending", "waits", "free_chips",
                            "progress", "chip_states", "grant_intervals", "prices", "budgets", "costs", "run_costs",
                            "deadletters"}


def test_a_file_that_cannot_be_written_fails_the_close_not_silently(tmp_path):
    # the Parquet write runs in the writer's thread: its failure must still reach the caller
    (tmp_path / "journal" / "day=2026-11-02" / "part-run1-0001.parquet").mkdir(parents=True)  # a folder in its way
    w = LakeWriter(tmp_path, "run1")
    w.add("journal", journal_row(T0))
    with pytest.raises(LakeError, match="part-run1-0001.parquet"):
        w.close()


# a value of each column type of the lake, as a row holds it (timestamps as epoch seconds)
SAMPLE_VALUES = {pa.string(): "x\u00e9", pa.int64(): -(2 ** 40), pa.int32(): 7, pa.timestamp("s", tz="UTC"): T0,
                 pa.float64(): 0.25, pa.bool_(): True, pa.list_(pa.string()): ["a", "b"], pa.list_(pa.int32()): [1, 2]}


@pytest.mark.parametrize("table", sorted(SCHEMAS))
def test_rows_become_the_columns_of_the_tables_schema(table):
    schema = SCHEMAS[table]
    full = tuple(SAMPLE_VALUES[f.type] for f in schema)
    rows = [full, (None,) * len(schema), full]
    got = rows_table(table, rows)
    # built column by column, independently of the rows' conversion
    want = pa.Table.from_arrays([pa.array([v, None, v], type=f.type) for v, f in zip(full, schema)], schema=schema)
    assert got.schema == schema
    assert got.equals(want)
    assert got.column(0).to_pylist() == [full[0], None, full[0]]


def test_a_row_of_the_wrong_width_is_an_error_not_a_shorter_table(tmp_path):
    w = LakeWriter(tmp_path, "run1")
    w.add("journal", journal_row(T0))
    w.add("journal", journal_row(T0)[:4])
    with pytest.raises(LakeError, match="a journal row has 4 columns, expected 5"):
        w.close()
