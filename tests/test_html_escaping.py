"""Every page chipledger writes shows hostile names as text and runs none of them: a lake whose teams and pool
are named like HTML (an <img onerror>, a <script>, an <svg onload>), through the real CLI (`run`, `statements`,
`report --out`), each page opened in headless Chromium (tests/browser.py; skipped loudly without it, a failure
with CHIPLEDGER_REQUIRE_CHROMIUM=1). A script that ran would set window.__pwned, change document.title or open
an alert."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chipledger.cli import app
from chipledger.reports.statements import file_stem

TEAM_IMG = """<img src=x onerror="window.__pwned='img';document.title='pwned'">"""
TEAM_SCRIPT = """</title></style><script>window.__pwned='script';alert('pwned')</script>"""
TEAM_MD = """[click](javascript:window.__pwned='md') *x* <b onmouseover=alert(1)>|"""
POOL = """lab/<svg onload="window.__pwned='pool';document.title='pwned'">"""
HOSTILE = (TEAM_IMG, TEAM_SCRIPT, TEAM_MD, POOL)
runner = CliRunner()


def ev(i: int, typ: str, at: str, **fields) -> dict:
    return {"event_id": f"e{i:03d}", "type": typ, "occurred_at": at, "pool": POOL, "source": "test", **fields}


def hostile_events() -> list[dict]:
    d1, d2 = "2026-11-02T", "2026-11-03T"
    out = [ev(1, "pool.configured", d1 + "00:00:00Z", flavor="a100", chips_per_node=2)]
    out += [ev(2 + n, "chip.registered", d1 + "00:00:00Z", chip_id=f"c{n}", node=f"n{n // 2}") for n in range(4)]
    out += [
        ev(10, "quota.granted", d1 + "00:00:00Z", grant_id="g1", team=TEAM_IMG, chips=1),
        ev(11, "quota.granted", d1 + "00:00:00Z", grant_id="g2", team=TEAM_SCRIPT, chips=1),
        ev(12, "quota.granted", d1 + "00:00:00Z", grant_id="g3", team=TEAM_MD, chips=1),
        ev(13, "job.submitted", d1 + "01:00:00Z", job_id="<i>j1</i>", team=TEAM_IMG, chips=3, priority=1),
        ev(14, "job.started", d1 + "01:05:00Z", job_id="<i>j1</i>"),
        ev(15, "job.submitted", d1 + "02:00:00Z", job_id="j2", team=TEAM_SCRIPT, chips=1, priority=5),
        ev(16, "job.started", d1 + "02:20:00Z", job_id="j2"),
        ev(17, "job.finished", d1 + "20:00:00Z", job_id="<i>j1</i>", outcome="succeeded"),
        ev(18, "pool.tick", d2 + "00:00:00Z"),
    ]
    return out


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    src = tmp / "events.jsonl"
    src.write_text("".join(json.dumps(e) + "\n" for e in hostile_events()))
    lake, store = tmp / "lake", f"sqlite:///{tmp / 'store.db'}"
    r = runner.invoke(app, ["run", "--events", str(src), "--lake", str(lake), "--store", store])
    assert r.exit_code == 0, r.output
    out = tmp / "statements"
    r = runner.invoke(app, ["statements", "--lake", str(lake), "--store", store, "--out", str(out),
                            "--period", "2026-11-02..2026-11-02", "--format", "md,html,json"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["report", "--lake", str(lake), "--out", str(tmp / "report")])
    assert r.exit_code == 0, r.output
    return tmp, out / "2026-11-02..2026-11-02", tmp / "report"


def assert_no_script_ran(browser, path: Path, *shown: str) -> str:
    driver = browser.open(path)
    alert = browser.alert_text()
    assert alert is None, f"{path.name}: an alert opened: {alert!r}"
    assert driver.execute_script("return window.__pwned === undefined"), \
        f"{path.name}: a script ran: {driver.execute_script('return window.__pwned')!r}"
    title = driver.title
    assert title != "pwned", f"{path.name}: a script set the title"
    text = driver.execute_script("return document.documentElement.textContent")
    for name in shown:
        assert name in text, f"{path.name}: {name!r} is not shown as text"
    return title


def test_statement_pages_show_hostile_names_as_text(pages, browser):
    _, folder, _ = pages
    for team in (TEAM_IMG, TEAM_SCRIPT, TEAM_MD):
        title = assert_no_script_ran(browser, folder / f"{file_stem(team)}.html", team, POOL)
        assert title == f"Quota statement: {team}, 2026-11-02..2026-11-02"
    # the job id of the team's top job, from the lake, is text too
    assert_no_script_ran(browser, folder / f"{file_stem(TEAM_IMG)}.html", "<i>j1</i>")


def test_statement_charts_opened_on_their_own_run_nothing(pages, browser):
    _, folder, _ = pages
    for team in (TEAM_IMG, TEAM_SCRIPT, TEAM_MD):
        svg = folder / f"{file_stem(team)}.svg"
        assert_no_script_ran(browser, svg)


def test_markdown_statements_rendered_to_html_run_nothing(pages, browser, tmp_path):
    """A Markdown viewer turns the statement into HTML, raw HTML included (CommonMark): names must be text there
    too, links included (a `[x](javascript:…)` in a name is no link)."""
    from markdown_it import MarkdownIt  # rich's Markdown parser (CommonMark)

    _, folder, _ = pages
    md = MarkdownIt("commonmark").enable("table")
    for team in (TEAM_IMG, TEAM_SCRIPT, TEAM_MD):
        text = (folder / f"{file_stem(team)}.md").read_text()
        html = md.render(text)
        assert "<a " not in html
        page = tmp_path / f"{file_stem(team)}.html"
        page.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>md</title></head>"
                        f"<body>{html}</body></html>")
        assert_no_script_ran(browser, page, team, POOL)


def test_report_page_shows_hostile_names_as_text(pages, browser):
    _, _, report = pages
    title = assert_no_script_ran(browser, report / "report.html", TEAM_IMG, TEAM_SCRIPT, POOL)
    assert title.startswith("SLO report")


def test_report_for_a_hostile_pool_names_it_as_text(pages, browser, tmp_path):
    tmp, _, _ = pages
    r = runner.invoke(app, ["report", "--lake", str(tmp / "lake"), "--pool", POOL, "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    title = assert_no_script_ran(browser, tmp_path / "report.html", POOL, TEAM_IMG)
    assert title == f"SLO report — {POOL}"


def test_no_page_holds_a_hostile_name_as_markup(pages):
    """Without a browser too: no page written holds a name as raw markup."""
    _, folder, report = pages
    files = [*folder.glob("*.html"), *folder.glob("*.svg"), report / "report.html"]
    assert len(files) == 7
    for path in files:
        text = path.read_text()
        for name in HOSTILE:
            assert name not in text, f"{path.name} holds {name!r} unescaped"


def test_markdown_statements_link_their_chart_for_any_team_name(tmp_path, browser):
    """A team named org/team (and one with spaces and parentheses) gets files org%2Fteam.md and .svg; the
    Markdown links the chart so that a viewer resolves it to that file (not to org/team.svg, a folder)."""
    from markdown_it import MarkdownIt

    teams = ("org/team", "org/ml (vision) team")
    events = [ev(1, "pool.configured", "2026-11-02T00:00:00Z", flavor="a100", chips_per_node=2),
              ev(2, "chip.registered", "2026-11-02T00:00:00Z", chip_id="c0", node="n0")]
    events += [ev(10 + i, "quota.granted", "2026-11-02T00:00:00Z", grant_id=f"g{i}", team=t, chips=1)
               for i, t in enumerate(teams)]
    events.append(ev(20, "pool.tick", "2026-11-03T00:00:00Z"))
    src = tmp_path / "events.jsonl"
    src.write_text("".join(json.dumps(e) + "\n" for e in events))
    lake, store = tmp_path / "lake", f"sqlite:///{tmp_path / 's.db'}"
    assert runner.invoke(app, ["run", "--events", str(src), "--lake", str(lake), "--store", store]).exit_code == 0
    out = tmp_path / "st"
    r = runner.invoke(app, ["statements", "--lake", str(lake), "--store", store, "--out", str(out),
                            "--period", "2026-11-02..2026-11-02", "--format", "md"])
    assert r.exit_code == 0, r.output
    folder = out / "2026-11-02..2026-11-02"
    md = MarkdownIt("commonmark")
    for team in teams:
        stem = file_stem(team)
        assert (folder / f"{stem}.svg").is_file()
        page = folder / f"{stem}.md.html"  # the Markdown as a viewer shows it, beside the files
        page.write_text(f"<!DOCTYPE html><html><body>{md.render((folder / f'{stem}.md').read_text())}</body></html>")
        driver = browser.open(page)
        loaded = driver.execute_script(
            "const i = document.querySelector('img'); return i && i.complete && i.naturalWidth > 0")
        assert loaded, (team, driver.execute_script("return document.querySelector('img').src"))
