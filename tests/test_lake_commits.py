"""The lake's books are only what the ledger committed (issue 31 item 6, issue 35 items 1 and 2), at the level a user
meets it: the CLI (typer's CliRunner, or a real `chipledger run` process for Ctrl-C).

- a Parquet file dropped into a table's folder changes no view;
- a run interrupted by a real SIGINT (sent to its process group, as a terminal's Ctrl-C is) changes no view, says so
  in one line (exit 130), and running again needs no --overwrite for what never committed;
- `chipledger sql` is read-only: COPY … TO into the lake, reading another file, changing a setting are refused in one
  line, and nothing is written;
- a lake of an earlier layout (no manifest), a broken manifest, a missing table: every reader says in one line what to
  run, no traceback, non-zero exit; `lake upgrade` adopts the lake (and folds the missing fact tables again, `progress`
  included) and then the views answer as before.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from analytics.commits import MANIFEST, open_lake, read_manifest
from analytics.lake import SCHEMAS
from chipledger.cli import app
from chipledger.demo import write_events

ROOT = Path(__file__).resolve().parents[1]
HAND = ROOT / "tests" / "fixtures" / "hand.jsonl"
# what a reader sees: a few views, as JSON (the books, the runs, the facts and the events)
VIEWS = {
    "journal": "SELECT pool, hour, account, team, amount_mchip_s FROM journal ORDER BY ALL",
    "jobs": "SELECT job_id, pool, team, preemptions, allocated_mchip_s FROM jobs ORDER BY ALL",
    "waits": "SELECT pool, job_id, run_index, \"end\" FROM waits ORDER BY ALL",
    "events": "SELECT count(*) AS n, max(applied_at) AS last FROM events",
}


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def run(events: Path, lake: Path, *more):
    return cli("run", "--events", events, "--lake", lake, "--store", f"sqlite:///{lake.parent / 'store.db'}", *more)


def seen(lake: Path) -> dict:
    out = {}
    for name, q in VIEWS.items():
        res = cli("sql", q, "--lake", lake, "--format", "json")
        assert res.exit_code == 0, res.output
        out[name] = json.loads(res.stdout)
    return out


def one_line(res, code: int = 1, *words: str) -> str:
    """The command failed with `code` and said so in one line on stderr (no traceback), with `words` in it."""
    assert res.exit_code == code, (res.exit_code, res.output)
    err = res.stderr.strip()
    assert err.count("\n") == 0 and "Traceback" not in res.output, res.output
    for w in words:
        assert w in err, err
    return err


@pytest.fixture()
def lake(tmp_path) -> Path:
    lake = tmp_path / "lake"
    assert run(HAND, lake).exit_code == 0
    return lake


def test_a_file_dropped_into_the_lake_changes_no_view(lake):
    before = seen(lake)
    journal = open_lake(lake).table_files("journal")[0]
    # a forged journal file beside the committed one: 1,000,000 chip-hours for a made-up team
    forged = pa.Table.from_pylist([{"pool": "lab/a100", "hour": 1_793_577_600, "account": "in_quota", "team": "mallory",
                                    "amount_mchip_s": 3_600_000_000_000}], schema=SCHEMAS["journal"])
    pq.write_table(forged, Path(journal).with_name("part-forged-0001.parquet"))
    shutil.copy(journal, Path(journal).with_name("part-copy-0001.parquet"))  # and a copy of a real one
    for table in ("events", "job_runs", "waits"):
        f = open_lake(lake).table_files(table)[0]
        shutil.copy(f, Path(f).with_name("part-dropped-0001.parquet"))
    assert seen(lake) == before
    report = cli("report", "--lake", lake, "--json")
    assert report.exit_code == 0 and "mallory" not in report.stdout


def test_copy_to_the_lake_through_sql_is_refused_and_writes_nothing(lake):
    before = seen(lake)
    target = lake / "journal" / "day=2026-11-02" / "x.parquet"
    res = cli("sql", f"COPY (SELECT * FROM journal_postings) TO '{target}' (FORMAT parquet)", "--lake", lake)
    one_line(res, 1, "refused", "--allow-files")
    # over a committed file too (DuckDB may write a file it may read: the read-only connection reads none itself)
    committed = open_lake(lake).table_files("journal")[0]
    size = os.path.getsize(committed)
    res = cli("sql", f"COPY (SELECT 1 AS a) TO '{committed}' (FORMAT parquet, USE_TMP_FILE false)", "--lake", lake)
    one_line(res, 1, "refused")
    assert not target.exists() and os.path.getsize(committed) == size
    one_line(cli("sql", "SELECT * FROM read_csv('/etc/hostname')", "--lake", lake), 1, "refused")
    one_line(cli("sql", "SET enable_external_access = true", "--lake", lake), 1, "refused")
    one_line(cli("sql", f"ATTACH '{lake / 'x.db'}'", "--lake", lake), 1, "refused")
    # the shell too: each refused statement one line, the others answered, exit 1 for a script
    shell = CliRunner().invoke(app, ["sql", "--lake", str(lake), "--format", "csv"],
                               input=f"SELECT count(*) AS n FROM events;\nCOPY (SELECT 1) TO '{target}';\n")
    assert shell.exit_code == 1 and shell.stdout.strip().splitlines()[-1] == "20"
    assert "refused" in shell.stderr and not target.exists()
    assert seen(lake) == before
    # an explicit option gives DuckDB its file access back (and the views still read only committed files)
    out = lake.parent / "export.csv"
    ok = cli("sql", f"COPY (SELECT count(*) AS n FROM events) TO '{out}'", "--lake", lake, "--allow-files")
    assert ok.exit_code == 0, ok.output
    assert out.read_text().split() == ["n", "20"]


def _staged(lake: Path) -> bool:
    return any((lake / "_staging").rglob("*.parquet")) if (lake / "_staging").exists() else False


def _interrupted_run(events: Path, lake: Path, *more: str, sig=signal.SIGINT) -> subprocess.CompletedProcess:
    """`chipledger run` in a process of its own, sent SIGINT (to its process group: the events process too, as a
    terminal's Ctrl-C) once it has written files; its exit code and output."""
    cmd = [sys.executable, "-m", "chipledger.cli", "run", "--events", str(events), "--lake", str(lake), "--store",
           f"sqlite:///{lake.parent / 'store.db'}", *more]
    env = {**os.environ, "PYTHONWARNINGS": "ignore::RuntimeWarning"}  # a stale compiled core's warning is not ours
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env=env)
    deadline = time.monotonic() + 120
    while not _staged(lake) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted: make the file longer"
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(cmd, proc.returncode, out.decode(), err.decode())


@pytest.fixture(scope="module")
def long_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("long") / "events.jsonl"
    write_events(path, seed=11, days=60)
    return path


def test_ctrl_c_during_a_run_changes_no_view_says_so_and_a_run_again_needs_no_overwrite(tmp_path, long_file):
    lake = tmp_path / "lake"
    # a fresh lake: nothing of the interrupted run is visible, and running again needs no --overwrite
    res = _interrupted_run(long_file, lake)
    assert res.returncode == 130, (res.returncode, res.stdout, res.stderr)
    assert res.stderr.strip().count("\n") == 0 and "interrupted" in res.stderr and "Traceback" not in res.stderr
    assert "nothing of this run was committed" in res.stderr
    assert not _staged(lake)  # the staged files are gone too
    assert seen(lake)["events"] == [{"n": 0, "last": None}]
    assert json.loads(cli("alerts", "--lake", lake, "--json").stdout or "{}").get("alerts", []) == []
    again = run(HAND, lake)
    assert again.exit_code == 0, again.output
    before = seen(lake)
    assert before["events"][0]["n"] == 20
    # a lake with books: an interrupted `run --overwrite` leaves them as they were
    res = _interrupted_run(long_file, lake, "--overwrite")
    assert res.returncode == 130 and "interrupted" in res.stderr, res.stderr
    assert seen(lake) == before
    assert sorted(p.name for p in lake.rglob("*.parquet")) == sorted(
        Path(f).name for f in open_lake(lake).all_files())  # nothing of the interrupted run left in the tables


def _layout_one(lake: Path) -> None:
    """The lake as an earlier version wrote it: no manifest (and no `progress` folder: those versions lacked it)."""
    (lake / MANIFEST).unlink()
    shutil.rmtree(lake / "progress", ignore_errors=True)


READERS = [
    ("report",), ("why", "jb1"), ("sql", "SELECT 1"), ("pending",), ("statements", "--period", "2026-11"),
]


def _readers_say(lake: Path, *words: str) -> None:
    for args in READERS:
        res = cli(*args, "--lake", lake, *(("--out", lake.parent / "st") if args[0] == "statements" else ()))
        assert res.exit_code != 0, (args, res.output)
        one_line(res, res.exit_code, *words)
    one_line(cli("alerts", "--lake", lake), 3, *words)
    one_line(cli("lake", "compact", "--lake", lake), 1, *words)


def test_an_old_layout_lake_gives_one_line_and_lake_upgrade_adopts_it(lake):
    before = seen(lake)
    _layout_one(lake)
    (lake / "waits").rename(lake.parent / "waits-gone")  # and a fact table missing
    _readers_say(lake, "written before commits", f"chipledger lake upgrade --lake {lake}")
    # serve-metrics reads the lake too
    one_line(cli("serve-metrics", "--lake", lake, "--port", "0"), 1, "lake upgrade")
    up = cli("lake", "upgrade", "--lake", lake)
    assert up.exit_code == 0, up.output
    assert "adopted" in up.stderr and "waits" in up.stderr and "progress" in up.stderr
    m = read_manifest(lake)
    assert m["layout"] == 2 and m["tables"]["progress"] == [] and m["tables"]["waits"]
    assert seen(lake) == before
    again = cli("lake", "upgrade", "--lake", lake)
    assert again.exit_code == 0 and "nothing to upgrade" in again.stderr


def test_a_missing_table_or_a_broken_manifest_is_reported_not_answered(lake):
    before = seen(lake)
    m = read_manifest(lake)
    waits = m["tables"].pop("waits")
    (lake / MANIFEST).write_bytes(orjson.dumps(m))
    _readers_say(lake, "no `waits` table", "chipledger lake upgrade")
    up = cli("lake", "upgrade", "--lake", lake)
    assert up.exit_code == 0 and "folded" in up.stderr, up.output
    assert seen(lake) == before and waits
    # a manifest that is not JSON, one of a newer layout, a committed file gone
    (lake / MANIFEST).write_text("{")
    one_line(cli("sql", "SELECT 1", "--lake", lake), 1, "manifest", "broken")
    one_line(run(HAND, lake), 1, "broken", "--overwrite")
    m["layout"] = 3
    m["tables"]["waits"] = waits
    (lake / MANIFEST).write_bytes(orjson.dumps(m))
    one_line(cli("report", "--lake", lake), 1, "newer chipledger")
    m["layout"] = 2
    (lake / MANIFEST).write_bytes(orjson.dumps(m))
    os.remove(lake / waits[0])
    one_line(cli("why", "jb1", "--lake", lake), 1, "committed file", "is missing")


def test_lake_upgrade_folds_a_missing_progress_table(tmp_path):
    """A lake written before `progress` (and before commits): `lake upgrade` folds it (it said "nothing to upgrade")."""
    events = tmp_path / "events.jsonl"
    write_events(events, seed=5, days=2)
    lake = tmp_path / "lake"
    assert run(events, lake).exit_code == 0
    want = cli("sql", "SELECT count(*) AS n, sum(charged_mchip_s) AS c FROM progress", "--lake", lake, "-f", "json")
    assert json.loads(want.stdout)[0]["n"] > 0
    _layout_one(lake)
    up = cli("lake", "upgrade", "--lake", lake)
    assert up.exit_code == 0 and "progress" in up.stderr, up.output
    got = cli("sql", "SELECT count(*) AS n, sum(charged_mchip_s) AS c FROM progress", "--lake", lake, "-f", "json")
    assert got.stdout == want.stdout


def test_run_overwrite_replaces_the_books_in_one_commit_and_removes_the_old_files(lake):
    before = seen(lake)
    old = set(open_lake(lake).all_files())
    again = run(HAND, lake, "--overwrite")
    assert again.exit_code == 0, again.output
    new = set(open_lake(lake).all_files())
    assert not old & new and all("-c2-" in Path(f).name for f in new)  # no staged file had a committed file's name
    assert {str(p) for p in lake.rglob("*.parquet")} == new  # the replaced files are gone
    assert seen(lake) == before and read_manifest(lake)["commit"] == 2
    nothing = cli("lake", "compact", "--lake", lake)
    assert nothing.exit_code == 0 and "nothing to compact" in nothing.stderr


def test_a_run_killed_with_sigkill_leaves_the_lake_as_it_was_and_the_next_run_clears_its_files(tmp_path, long_file):
    lake = tmp_path / "lake"
    assert run(HAND, lake).exit_code == 0
    before = seen(lake)
    res = _interrupted_run(long_file, lake, "--overwrite", sig=signal.SIGKILL)
    assert res.returncode == -signal.SIGKILL
    assert _staged(lake)  # nothing could remove them
    assert seen(lake) == before
    # a fresh lake killed mid-run: running again needs no --overwrite, and the killed run's staged files go
    fresh = tmp_path / "fresh" / "lake"
    fresh.parent.mkdir()
    assert _interrupted_run(long_file, fresh, sig=signal.SIGKILL).returncode == -signal.SIGKILL
    assert seen(fresh)["events"] == [{"n": 0, "last": None}]
    again = run(HAND, fresh)
    assert again.exit_code == 0, again.output
    assert not _staged(fresh) and seen(fresh)["events"][0]["n"] == 20


def test_a_second_run_or_upgrade_while_a_run_writes_the_lake_is_refused_and_the_first_commits(tmp_path, long_file):
    """Two writers that replace tables on one lake: the second (`run`, `lake upgrade`) is refused in one line naming
    the first and its process, and removes none of its staged files; the first commits its whole run."""
    lake = tmp_path / "lake"
    assert run(HAND, lake).exit_code == 0
    cmd = [sys.executable, "-m", "chipledger.cli", "run", "--events", str(long_file), "--lake", str(lake), "--store",
           f"sqlite:///{tmp_path / 'first.db'}", "--overwrite", "--jobs", "1"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore::RuntimeWarning"}
    first = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 120
    while not _staged(lake) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, "the first run ended before the second began: make the file longer"
    err = one_line(run(HAND, lake, "--overwrite"), 1, f"lake {lake} is being written by chipledger run of "
                                                        f"{long_file.name} (pid {first.pid})")
    assert "wait for it to end" in err
    one_line(cli("lake", "upgrade", "--lake", lake), 1, "is being written by chipledger run")
    assert _staged(lake)  # the first run's files are still there
    out, errs = first.communicate(timeout=600)
    assert first.returncode == 0, errs.decode()[-2000:]
    assert seen(lake)["events"][0]["n"] > 20  # the first run's books, whole
    assert read_manifest(lake)["commit"] == 2
    # the lock went with the process: the lake is writable again
    again = run(HAND, lake, "--overwrite")
    assert again.exit_code == 0, again.output
