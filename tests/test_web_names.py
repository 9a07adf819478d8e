"""Team names and job ids as events may hold them (schemas.events.Name: 1 to 256 characters, no control characters),
in the portal's URLs: a member of each team signs in and follows the portal's own links to the team's home, queue,
bursts and statements and to its job; an admin follows the fleet page's link to each team. A team named `lab/queue`
beside a team `lab`, names with `.`, `..` and empty segments (which browsers and HTTP clients remove or merge), markup
and `&`. And a scheduler's free-text message that names another team's job (chipledger/web/redact.py `free_text`)."""

from __future__ import annotations

import html
import json
import re
from urllib.parse import urlsplit

import pytest
from markupsafe import escape

from typer.testing import CliRunner

from chipledger.cli import app as cli_app
from chipledger.web.auth import new_token
from store.repo import open_store
from tests.web_support import chipledger_run, client_of, make_events, make_portal, served, write_events

POOL = "us-west4-a/tpu-v5e"
# team -> its pending job's id; `lab` and `lab/queue` both exist: /teams/lab/queue is lab's queue
TEAMS = {"lab": "lab-j1", "lab/queue": "j/queue", "lab/bursts": "lab-bursts-1", "lab/statements": "lab-st-1",
         "../up": "ns/../j2", "a//b": "a//b-1", "./here": "./j3", "/lead": "lead-1", "trailing/": "trailing-1",
         "R&D <lab> 'x'": "rd-<1>&"}


@pytest.fixture(scope="module")
def env(demo_lake_of, tmp_path_factory):
    root = tmp_path_factory.mktemp("portal-names")
    demo_events = demo_lake_of(3, 7).parent / "events.jsonl"
    lines = make_events(demo_events, root / "base.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])["occurred_at"]
    ads_job = next(e["job_id"] for e in map(json.loads, lines) if e["type"] == "job.submitted" and e["team"] == "ads-ml")
    extra = []
    for i, (team, job) in enumerate(TEAMS.items()):
        extra.append({"event_id": f"names-grant-{i}", "type": "quota.granted", "occurred_at": last, "pool": POOL,
                      "source": "fleet-admin/quota-api", "grant_id": f"names-grant-{i}", "team": team, "chips": 1,
                      "effective_from": last})
        extra.append({"event_id": f"names-job-{i}", "type": "job.submitted", "occurred_at": last, "pool": POOL,
                      "source": "cluster-c/kueue", "job_id": job, "team": team, "chips": 1000})
    # the scheduler's own sentence on lab's job names another team's job (and lab's own)
    message = f"Kueue: waiting for {ads_job} (ads-ml) to finish; lab-j1 is next."
    extra.append({"event_id": "names-waiting", "type": "job.waiting", "occurred_at": last, "pool": POOL,
                  "source": "cluster-c/kueue", "job_id": "lab-j1", "reason": "Pending", "message": message})
    events = write_events(root / "events.jsonl", lines, extra)
    lake = root / "lake"
    store_url = f"sqlite:///{root / 'store.db'}"
    chipledger_run(events, lake, store_url)
    res = CliRunner().invoke(cli_app, ["statements", "--lake", str(lake), "--period", "2026-11-02..2026-11-02",
                                       "--store", store_url, "--out", str(root / "statements")])
    assert res.exit_code == 0, res.output
    st = open_store(store_url)
    tokens = {team: new_token(st, f"user{i}", team)[1] for i, team in enumerate(TEAMS)}
    tokens["root"] = new_token(st, "root", None)[1]
    tokens["alice"] = new_token(st, "alice", "vision")[1]
    portal = make_portal(st, lake, statements_dir=root / "statements")
    return {"portal": portal, "client": client_of(portal), "tokens": tokens, "ads_job": ads_job, "message": message}


@pytest.mark.parametrize("team, page, url", [
    ("vision", "", "/teams/vision"), ("vision", "queue", "/teams/vision/queue"),
    ("org/ml", "bursts", "/teams/org/ml/bursts"), ("R&D <x>", "", "/teams/R%26D%20%3Cx%3E"),
    ("queue", "", "/teams/queue"),  # one segment: no team's page has this path
    ("x/queue", "", "/team?name=x%2Fqueue"), ("x/queue", "queue", "/teams/x/queue/queue"),
    ("x/statements", "", "/team?name=x%2Fstatements"), ("..", "queue", "/team/queue?name=.."),
    ("a//b", "", "/team?name=a%2F%2Fb"), ("a/", "statements", "/team/statements?name=a%2F"),
    ("a?b#c%d", "", "/teams/a%3Fb%23c%25d"),
])
def test_team_urls(team, page, url):
    from chipledger.web.links import team_url

    assert team_url(team, page) == url


def test_job_and_statement_urls():
    from chipledger.web.links import job_url, statement_url

    assert job_url("ns/train-1") == "/jobs/ns/train-1" and job_url("ns/../j") == "/job?id=ns%2F..%2Fj"
    assert statement_url("org/ml@2026-11", "json") == "/api/v1/statements/org/ml@2026-11/json"
    assert statement_url("../up@2026-11", "md") == "/api/v1/statement-file?statement_id=..%2Fup%402026-11&fmt=md"


def _h(env, who: str) -> dict:
    return {"Authorization": f"Bearer {env['tokens'][who]}"}


def _signed_in(env, team: str):
    c = client_of(env["portal"])
    nonce = re.search(r'name="csrf" value="([^"]+)"', c.get("/login").text).group(1)
    assert c.post("/login", data={"token": env["tokens"][team], "csrf": nonce},
                  follow_redirects=False).status_code == 303
    return c


def _link(page: str, text: str) -> str:
    """The href of the link whose text is `text` (as the page escapes it), unescaped as a browser reads it."""
    m = re.search(r'<a href="([^"]*)">' + re.escape(str(escape(text))) + "</a>", page)
    assert m, text
    href = html.unescape(m.group(1))
    _survives(href)
    return href


def _survives(href: str) -> None:
    """What a browser and a proxy leave of the path is the path: no dot segment (`%2e` spelled too, which browsers
    also remove) and no empty segment (proxies merge slashes)."""
    path = urlsplit(href).path
    for seg in path.split("/")[1:]:
        assert seg.lower() not in ("", ".", "..", "%2e", "%2e%2e", ".%2e", "%2e."), href


def _team_shown(page: str, team: str) -> bool:
    return f'<span id="team">{escape(team)}</span>' in page


@pytest.mark.parametrize("team", list(TEAMS))
def test_a_member_follows_the_portals_links_to_every_page_of_their_team(env, team):
    c = _signed_in(env, team)
    home = c.get("/")  # the sign-in's landing: a redirect to the team's home
    assert home.status_code == 200 and _team_shown(home.text, team) and "Team <span" in home.text, team
    queue = c.get(_link(home.text, "1 job(s) pending"))
    assert queue.status_code == 200 and _team_shown(queue.text, team) and "Queue of" in queue.text, team
    job = c.get(_link(queue.text, TEAMS[team]))
    assert job.status_code == 200 and str(escape(TEAMS[team])) in job.text, (team, job.text[:300])
    back = c.get(_link(job.text, team)).text  # the job's team: its home
    assert _team_shown(back, team) and "Team <span" in back, team
    for what, title in (("bursts", "Bursts for"), ("statements", "Statements of")):
        r = c.get(_link(home.text, "ask for a burst" if what == "bursts" else "statements"))
        assert r.status_code == 200 and _team_shown(r.text, team) and title in r.text, (team, what)
    # its statement's files, by the statements page's download links
    statements = c.get(_link(home.text, "statements")).text
    got = c.get(_link(statements, "json"))
    assert got.status_code == 200 and json.loads(got.content)["team"] == team, team
    assert c.get(_link(statements, "html")).status_code == 200, team
    # the burst form posts to its own page (a dry run)
    bursts = c.get(_link(home.text, "ask for a burst")).text
    action = html.unescape(re.search(r'<form method="post" action="([^"]*)" id="burst-form">', bursts).group(1))
    _survives(action)
    csrf = re.search(r'<form method="post" action="[^"]*" id="burst-form">\s*<input type="hidden" name="csrf" '
                     r'value="([^"]+)"', bursts).group(1)
    r = c.post(action, data={"pool": POOL, "chips": "1", "window_start": "2026-11-04T08:00",
                             "window_end": "2026-11-04T09:00", "csrf": csrf})
    assert r.status_code == 200 and _team_shown(r.text, team) and 'id="dry"' in r.text, (team, r.text[-500:])


def test_an_admin_follows_the_fleet_pages_link_to_every_team(env):
    c = env["client"]
    fleet = c.get("/fleet", headers=_h(env, "root")).text
    for team in TEAMS:
        home = c.get(_link(fleet, team), headers=_h(env, "root"))
        assert home.status_code == 200 and _team_shown(home.text, team), team
    # a team the lake does not hold does not exist, for an admin too
    assert c.get("/teams/no-such-team", headers=_h(env, "root")).status_code == 404
    assert c.get("/team?name=lab%2Fnope", headers=_h(env, "root")).status_code == 404


def test_ordinary_names_keep_their_urls(env):
    c = env["client"]
    home = c.get("/teams/lab", headers=_h(env, "root")).text
    assert _link(home, "1 job(s) pending") == "/teams/lab/queue"
    assert _link(c.get("/teams/lab/queue", headers=_h(env, "root")).text, "lab-j1") == "/jobs/lab-j1"
    assert _link(c.get("/teams/org/ml", headers=_h(env, "root")).text, "1 job(s) pending") == "/teams/org/ml/queue"
    # /teams/lab/queue stays lab's queue; lab/queue's home is its query form
    assert "Queue of" in c.get("/teams/lab/queue", headers=_h(env, "root")).text
    assert _link(c.get("/fleet", headers=_h(env, "root")).text, "lab/queue") == "/team?name=lab%2Fqueue"


def test_the_api_reads_every_team_by_its_name(env):
    """A tool reads each team's routes by its name in the path (`/api/v1/teams/lab/queue/jobs` is team lab/queue's
    jobs, not lab's), and a team with a `.` or `..` segment by the query routes (its path would lose the segment)."""
    from urllib.parse import quote

    c = env["client"]
    for team, job in TEAMS.items():
        h = _h(env, team)
        q = c.get("/api/v1/queue", params={"team": team}, headers=h).json()["queue"]
        assert [e["job_id"] for e in q] == [job], team
        if any(seg in (".", "..") for seg in team.split("/")):
            continue  # the client removes its dot segments: the query routes only (a//b: a proxy would merge it)
        base = f"/api/v1/teams/{quote(team, safe='/')}"
        assert {b["team"] for b in c.get(f"{base}/balances", headers=h).json()["balances"]} == {team}, team
        assert [j["job_id"] for j in c.get(f"{base}/jobs", headers=h).json()["jobs"]] == [job], team
        assert c.get(f"{base}/costs", headers=h).json()["team"] == team
        assert c.get(f"{base}/budgets", headers=h).json()["team"] == team
        assert {x["team"] for x in c.get(f"{base}/statements", headers=h).json()["statements"]} == {team}, team
        assert c.get(f"{base}/bursts", headers=h).status_code == 200, team


def test_a_schedulers_message_does_not_show_another_teams_job_id_to_a_member(env):
    """visibility = fleet: a member sees other teams' names, never their job ids (docs/portal.md, "Who sees what"):
    the scheduler's sentence on their own job (a `job.waiting` message: the job's `why` and timeline, API and page)
    reads `(hidden)` for another team's job id; their own job's id stays; an admin reads it as written."""
    c = env["client"]
    ads_job, message = env["ads_job"], env["message"]
    member, admin = _h(env, "lab"), _h(env, "root")
    job = c.get("/api/v1/jobs/lab-j1", headers=member).json()
    assert job["why"]["scheduler_message"] == message.replace(ads_job, "(hidden)")
    assert [e["detail"] for e in job["timeline"] if e["type"] == "job.waiting"] == [
        "Pending: " + message.replace(ads_job, "(hidden)")]
    assert ads_job not in json.dumps(job)
    page = c.get("/jobs/lab-j1", headers=member).text
    assert str(escape(message.replace(ads_job, "(hidden)"))) in page and ads_job not in page
    job = c.get("/api/v1/jobs/lab-j1", headers=admin).json()
    assert job["why"]["scheduler_message"] == message
    assert str(escape(message)) in c.get("/jobs/lab-j1", headers=admin).text
    # the other team's member reads the message's job as theirs; lab's member may not open it
    assert c.get(f"/api/v1/jobs/{ads_job}", headers=member).status_code == 404


@pytest.fixture(scope="module")
def server(env):
    """The module's portal served on a free port (uvicorn in a thread), for headless Chromium."""
    with served(env["portal"]) as base:
        yield base


@pytest.mark.parametrize("team", ["../up", "./here", "lab/queue", "a//b", "R&D <lab> 'x'"])
def test_in_chromium_a_member_clicks_through_their_teams_pages(browser, server, env, team):
    """What a browser does to a path (dot segments removed, `%2e` too) is Chromium's own here: a member signs in and
    clicks the portal's links to the team's home, its queue and its job, and lands on each."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser.driver
    d.delete_all_cookies()
    d.get(server + "/login")
    d.find_element(By.ID, "token").send_keys(env["tokens"][team])
    d.find_element(By.ID, "signin").click()
    WebDriverWait(d, 15).until(lambda drv: not drv.current_url.endswith("/login"))
    assert d.find_element(By.ID, "team").text == team and d.find_element(By.TAG_NAME, "h1").text.startswith("Team")
    d.find_element(By.LINK_TEXT, "1 job(s) pending").click()
    assert d.find_element(By.ID, "team").text == team and d.find_element(By.TAG_NAME, "h1").text.startswith("Queue")
    d.find_element(By.LINK_TEXT, TEAMS[team]).click()
    assert d.find_element(By.ID, "job").text == TEAMS[team]
    d.find_element(By.CSS_SELECTOR, "dl.facts a").click()  # the job's team: its home
    assert d.find_element(By.ID, "team").text == team and d.find_element(By.TAG_NAME, "h1").text.startswith("Team")
