"""Statement file names made from team names (review of issue 17): whatever the team is called (a name of the
contract's 256 characters, non-ASCII, a leading dot), `chipledger statements` writes every team's files
without a traceback, each name under the file system's 255-byte limit, none hidden, and a Markdown
statement's chart link resolves to the chart file written beside it (a viewer percent-decodes the link once)."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import unquote

from typer.testing import CliRunner

from chipledger.cli import app
from chipledger.reports.statements import file_stem

runner = CliRunner()
POOL = "names/a100"
TEAMS = ("<" * 256, "é" * 200, "研究" * 60, "a" * 256, "a" * 255 + "b", ".", "..", ".hidden", "ads ml", "org/team",
         "100%", "x(1)")


def ev(i: int, typ: str, at: str, **fields) -> dict:
    return {"event_id": f"e{i:03d}", "type": typ, "occurred_at": at, "pool": POOL, "source": "test", **fields}


def events() -> list[dict]:
    d = "2026-11-02T"
    out = [ev(1, "pool.configured", d + "00:00:00Z", flavor="a100", chips_per_node=2)]
    out += [ev(2 + n, "chip.registered", d + "00:00:00Z", chip_id=f"c{n}", node=f"n{n // 2}") for n in range(4)]
    out += [ev(10 + i, "quota.granted", d + "00:00:00Z", grant_id=f"g{i}", team=t, chips=0.1)
            for i, t in enumerate(TEAMS)]
    out.append(ev(99, "pool.tick", "2026-11-03T00:00:00Z"))
    return out


def test_file_stems_are_short_visible_and_distinct():
    stems = [file_stem(t) for t in TEAMS]
    assert len(set(stems)) == len(TEAMS)
    for s in stems:
        assert len(f"{s}.html".encode()) <= 255 and not s.startswith(".") and "/" not in s
    assert file_stem("org/team") == "org%2Fteam"  # short names stay as they were (docs/statements.md)


def test_statements_of_long_and_odd_team_names(tmp_path):
    src = tmp_path / "events.jsonl"
    src.write_text("".join(json.dumps(e) + "\n" for e in events()))
    lake, store = tmp_path / "lake", f"sqlite:///{tmp_path / 'store.db'}"
    r = runner.invoke(app, ["run", "--events", str(src), "--lake", str(lake), "--store", store])
    assert r.exit_code == 0, r.output
    out = tmp_path / "st"
    r = runner.invoke(app, ["statements", "--lake", str(lake), "--store", store, "--out", str(out),
                            "--period", "2026-11-02..2026-11-02", "--format", "md,html,json,csv"])
    assert r.exit_code == 0, r.output
    folder = out / "2026-11-02..2026-11-02"
    names = sorted(p.name for p in folder.iterdir())
    assert len(names) == 5 * len(TEAMS)
    teams = set()
    for team in TEAMS:
        stem = file_stem(team)
        st = json.loads((folder / f"{stem}.json").read_text())
        teams.add(st["team"])
        md = (folder / f"{stem}.md").read_text()
        link = md.split("![use against quota](", 1)[1].split(")", 1)[0]
        assert (folder / unquote(link)).is_file(), f"{team!r}: the chart link {link!r} resolves to no file"
    assert teams == set(TEAMS)
