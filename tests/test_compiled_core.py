"""The compiled ledger core (mypyc, ledger/_compiled.py): used only when built from the sources on disk, and it
folds exactly like the plain Python core.

CI sets CHIPLEDGER_REQUIRE_COMPILED=1 (`make` then fails without a compiled core, and so do these tests);
elsewhere the tests that need a build skip loudly when there is none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

import ledger
from ledger import _compiled
from chipledger.demo import write_events

REQUIRE = bool(os.environ.get("CHIPLEDGER_REQUIRE_COMPILED"))
CHIPLEDGER = str(Path(sys.executable).with_name("chipledger"))
TABLES = ("journal", "job_runs", "decisions", "balances", "pending", "waits", "free_chips", "chip_states",
          "grant_intervals", "deadletters", "events")


def _need_compiled():
    if ledger.CORE != "compiled":
        msg = f"the ledger core is not compiled here: {ledger.CORE}"
        if REQUIRE:
            pytest.fail(f"{msg} (CHIPLEDGER_REQUIRE_COMPILED=1)", pytrace=False)
        pytest.skip(f"SKIPPED LOUDLY: {msg}")


def test_the_core_runs_compiled_when_built():
    _need_compiled()
    import ledger.fold
    import ledger.policy

    for mod in (ledger.fold, ledger.policy):
        assert Path(mod.__file__).suffix == ".so", mod.__file__
        assert Path(mod.__file__).parent == _compiled.core_dir() / "ledger"


def _lake_rows(lake: Path) -> dict[str, list]:
    con = duckdb.connect()
    out = {}
    for table in TABLES:
        files = sorted(str(p) for p in (lake / table).rglob("*.parquet"))
        assert files, f"no {table} files in {lake}"
        rel = con.read_parquet(files, union_by_name=True)  # noqa: F841 (read by name in the query)
        out[table] = sorted(map(repr, con.execute("SELECT * FROM rel").fetchall()))
    return out


def test_compiled_and_plain_python_runs_write_the_same_lake(tmp_path):
    """The user's `chipledger run` on a seeded fleet with bad lines, once compiled and once as plain Python:
    every lake table holds the same rows, and the summary says which core ran."""
    _need_compiled()
    events = tmp_path / "events.jsonl"
    write_events(events, seed=5, days=4)
    lakes, summaries = {}, {}
    for mode in ("compiled", "python"):
        env = {k: v for k, v in os.environ.items() if k != "CHIPLEDGER_PURE_PYTHON"}
        if mode == "python":
            env["CHIPLEDGER_PURE_PYTHON"] = "1"
        lakes[mode] = tmp_path / f"lake-{mode}"
        proc = subprocess.run([CHIPLEDGER, "run", "--events", str(events), "--lake", str(lakes[mode]),
                               "--store", f"sqlite:///{tmp_path / mode}.db", "--json"],
                              env=env, capture_output=True, text=True, cwd=tmp_path, timeout=600)
        assert proc.returncode == 0, proc.stderr
        summaries[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summaries["compiled"]["core"] == "compiled"
    assert summaries["python"]["core"].startswith("python (CHIPLEDGER_PURE_PYTHON")
    assert summaries["compiled"]["dead_letters"] and summaries["compiled"]["accepted"] > 5_000  # the demo fleet (load 0.45)
    for key in ("lines", "accepted", "duplicates", "late", "dead_letters", "rows_written"):
        assert summaries["compiled"][key] == summaries["python"][key], key
    a, b = _lake_rows(lakes["compiled"]), _lake_rows(lakes["python"])
    assert summaries["compiled"]["rows_written"]["decisions"] > 0  # the policy ran, not only the books
    for table in TABLES:
        assert a[table] == b[table], table


# --- the loader: a build is used only for the sources and interpreter it was made from (no compiler needed) ---

def _manifest(where: Path, **over) -> None:
    m = {"sources": _compiled.sources_digest(), "tag": _compiled.build_tag(), "modules": list(_compiled.MODULES)}
    m.update(over)
    where.mkdir(parents=True, exist_ok=True)
    (where / _compiled.MANIFEST).write_text(json.dumps(m))


def test_a_matching_build_goes_first_on_the_package_path(tmp_path, monkeypatch):
    monkeypatch.delenv("CHIPLEDGER_PURE_PYTHON", raising=False)
    monkeypatch.setenv("CHIPLEDGER_CORE_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    _manifest(tmp_path)
    path = ["/src/ledger"]
    assert _compiled.activate(path) == "compiled"
    assert path == [str(tmp_path / "ledger"), "/src/ledger"]
    assert str(tmp_path) in sys.path


def test_a_build_from_other_sources_is_not_used(tmp_path, monkeypatch):
    monkeypatch.delenv("CHIPLEDGER_PURE_PYTHON", raising=False)
    monkeypatch.setenv("CHIPLEDGER_CORE_DIR", str(tmp_path))
    _manifest(tmp_path, sources="0" * 64)  # a developer edited ledger/fold.py after the build
    path = ["/src/ledger"]
    with pytest.warns(RuntimeWarning, match="built from other sources"):
        core = _compiled.activate(path)
    assert core == "python (the compiled core is out of date: run `make` to rebuild it)"
    assert path == ["/src/ledger"]


def test_no_build_another_interpreter_or_opting_out_means_plain_python(tmp_path, monkeypatch):
    monkeypatch.delenv("CHIPLEDGER_PURE_PYTHON", raising=False)
    monkeypatch.setenv("CHIPLEDGER_CORE_DIR", str(tmp_path / "none"))
    path = ["/src/ledger"]
    assert _compiled.activate(path).startswith("python (no compiled core in")
    monkeypatch.setenv("CHIPLEDGER_CORE_DIR", str(tmp_path))
    _manifest(tmp_path, tag="cpython-39-linux")
    assert "is for cpython-39-linux" in _compiled.activate(path)
    _manifest(tmp_path)
    monkeypatch.setenv("CHIPLEDGER_PURE_PYTHON", "1")
    assert _compiled.activate(path) == "python (CHIPLEDGER_PURE_PYTHON is set)"
    assert path == ["/src/ledger"]


def test_the_digest_covers_every_compiled_source(tmp_path):
    for name in _compiled.MODULES:
        (tmp_path / f"{name}.py").write_text(f"# {name}\n")
    before = _compiled.sources_digest(tmp_path)
    (tmp_path / "policy.py").write_text("# policy, edited\n")
    assert _compiled.sources_digest(tmp_path) != before
