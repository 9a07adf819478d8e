"""`chipledger run` on the files people actually have (issue 17, item 8): a UTF-8 BOM at the start (what
Windows tools write), an empty file, dead letters with their line numbers, and --strict for CI."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from chipledger.cli import app
from test_slo_views import slo_events


def run(tmp_path, data: bytes, *args):
    src = tmp_path / "events.jsonl"
    src.write_bytes(data)
    return CliRunner().invoke(app, ["run", "--events", str(src), "--lake", str(tmp_path / "lake"),
                                    "--store", f"sqlite:///{tmp_path / 's.db'}", *args])


def lines() -> list[bytes]:
    return [json.dumps(e).encode() + b"\n" for e in slo_events()]


def test_a_leading_bom_loses_nothing(tmp_path):
    res = run(tmp_path, b"\xef\xbb\xbf" + b"".join(lines()), "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["dead_letters"] == {} and summary["accepted"] == len(slo_events())


def test_an_empty_file_says_so(tmp_path):
    for data in (b"", b"\n\n"):
        res = run(tmp_path, data)
        assert res.exit_code == 0 and "has no events" in res.stderr and "nothing was folded" in res.stderr
    res = run(tmp_path, b"", "--strict")
    assert res.exit_code == 1 and "has no events" in res.stderr


def test_dead_letters_name_their_lines_and_strict_fails(tmp_path, monkeypatch):
    from chipledger import cli

    monkeypatch.setattr(cli.console, "width", 200)
    good = lines()
    data = good[:3] + [b"{not json\n"] + good[3:5] + [b'{"type": "job.teleported"}\n'] + good[5:]
    res = run(tmp_path, b"".join(data))
    assert res.exit_code == 0, res.output
    assert "not_json (line 4)" in res.stdout and "unknown_type (line 7)" in res.stdout
    res = run(tmp_path, b"".join(data), "--strict", "--overwrite", "--json")
    assert res.exit_code == 1
    assert json.loads(res.stdout)["dead_letter_lines"] == {"not_json": [4], "unknown_type": [7]}
    assert "--strict: 2 line(s) became dead letters (lines 4, 7)" in res.stderr
    assert run(tmp_path, b"".join(good), "--strict", "--overwrite").exit_code == 0


def test_a_store_that_fails_after_the_commit_is_one_line_and_keeps_its_state(tmp_path):
    """The lake commits first, then the store records the run in one transaction: a store that fails there (here the
    database refuses the run's row; a full disk in a reviewer's run) is one error line saying the lake is committed
    and the store is as it was, not a traceback."""
    import sqlalchemy as sa

    from store.repo import open_store

    res = run(tmp_path, b"".join(lines()))
    assert res.exit_code == 0, res.output
    st = open_store(f"sqlite:///{tmp_path / 's.db'}")
    with st.engine.begin() as conn:
        runs_before = conn.execute(sa.text("SELECT count(*) FROM runs")).scalar()
        for what in ("INSERT", "UPDATE"):  # (the run's row: a new one, or the same run id within a second)
            conn.execute(sa.text(f"CREATE TRIGGER full_{what} BEFORE {what} ON runs BEGIN SELECT RAISE(ABORT, "
                                 f"'database or disk is full'); END"))
        balances_before = conn.execute(sa.text("SELECT count(*) FROM pool_balances")).scalar()
    res = run(tmp_path, b"".join(lines()), "--overwrite")
    assert res.exit_code == 1
    err = res.stderr.strip()
    assert "\n" not in err and "Traceback" not in res.output, res.output
    assert "is committed (commit 2), but the store could not record the run: database or disk is full" in err, err
    with st.engine.begin() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM runs")).scalar() == runs_before
        assert conn.execute(sa.text("SELECT count(*) FROM pool_balances")).scalar() == balances_before > 0
