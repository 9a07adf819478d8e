"""The README as a front page (issue 35, item 13): its first lines give the two commands, its first screen says
what chipledger does, and every command of its five-minute tour works as written on `make demo`'s lake, from the
folder the demo ran in (no --lake: item 10)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from typer.testing import CliRunner

from chipledger.cli import app

README = Path(__file__).resolve().parents[1] / "README.md"


def _tour_commands(text: str) -> list[list[str]]:
    tour = text.split("## A five-minute tour", 1)[1].split("\n## ", 1)[0]
    cmds = []
    for block in re.findall(r"```sh\n(.*?)```", tour, re.S):
        for line in block.splitlines():
            if line.startswith("chipledger "):
                cmds.append(shlex.split(line, comments=True)[1:])
    return cmds


def test_the_readme_opens_with_the_two_commands_and_what_it_does():
    text = README.read_text()
    first = text.splitlines()[:8]
    assert any(line.startswith("make demo") for line in first) and any(line.startswith("make test") for line in first)
    front = text.split("## Benchmarks", 1)[0]
    assert len(front.splitlines()) < 120, "the front page grew: put the details in docs/"
    for page in re.findall(r"\]\((docs/[^)#]+)", front):
        assert (README.parent / page).is_file(), page
    for stale in ("lake cache", "about 30 s", "instructions per event"):
        assert stale not in front, stale


def test_every_command_of_the_tour_works_on_the_demo_lake(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    res = runner.invoke(app, ["demo"])
    assert res.exit_code == 0, res.output
    cmds = _tour_commands(README.read_text())
    assert len(cmds) >= 8
    for args in cmds:
        res = runner.invoke(app, args, input="")
        # alerts: 0 none firing, 1 tickets (the demo's scheduling latency is over its budget)
        assert res.exit_code == 0 or (args[0] == "alerts" and res.exit_code == 1), (args, res.output)
        assert "error" not in res.stderr.lower(), (args, res.stderr)
