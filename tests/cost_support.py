"""What the cost tests share (tests/test_costs.py, tests/test_run_costs.py): a log folded with its cost facts
collected, the log as a file a user runs, and the `lake upgrade` of a lake written before a cost table existed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ledger import Fleet

from tests.test_evolve import CFG


def fold_costs(events, pause_at=None) -> tuple[list, list]:
    """(run cost rows, cost rows) the fold of `events` posts, each event applied; with `pause_at`, the books are
    closed after that event and the fold restarts from the saved state."""
    fleet = Fleet(CFG)
    run_costs: list = []
    costs: list = []
    for i, e in enumerate(events):
        step = fleet.apply(e)
        assert step.applied, (e, step.rejection)
        run_costs += step.run_costs
        costs += step.costs
        if pause_at is not None and i == pause_at:  # a close of the books mid-run, then a restart from the state
            fleet.close()
            costs += fleet.close_facts().get("costs", [])
            fleet = Fleet.from_dict(fleet.to_dict(), CFG)
    fleet.close()
    costs += fleet.close_facts().get("costs", [])
    return run_costs, costs


def write_log(path: Path, events) -> Path:
    """`events` as a JSONL file at `path`, as `chipledger run` reads them."""
    path.write_text("".join(e.model_dump_json() + "\n" for e in events))
    return path


def upgrade_a_lake_without(lake: Path, table: str, query: str) -> tuple[list, str]:
    """`lake` as written before `table` existed (its manifest without it): readers must say to run `lake upgrade`,
    which must fold the events again and commit it, `query` then answering as before. (`query`'s rows, the
    upgrade's output)."""
    from typer.testing import CliRunner

    from analytics.commits import LakeLayoutError
    from analytics.views import connect
    from chipledger.cli import app

    want = connect(lake).execute(query).fetchall()
    manifest = lake / "_lake.json"
    m = json.loads(manifest.read_text())
    del m["tables"][table]
    manifest.write_text(json.dumps(m))
    with pytest.raises(LakeLayoutError, match="lake upgrade"):
        connect(lake)
    r = CliRunner().invoke(app, ["lake", "upgrade", "--lake", str(lake)])
    assert r.exit_code == 0, r.output
    assert connect(lake).execute(query).fetchall() == want
    return want, r.output
