"""The portal's kept answers (chipledger/web/app.py `kept_json`, the home page's content): what a read route computed
for one caller is kept with the snapshot and read again by the next request, per view (`Principal.view_key`). These
tests check that a kept answer is never another caller's: each caller reads, from a portal where others asked first,
exactly what a portal with nothing kept answers them. And the security headers, now set by a plain ASGI middleware,
on every kind of response."""

from __future__ import annotations

import dataclasses
import re

import pytest
from fastapi.testclient import TestClient

from chipledger.web.app import Portal, build_app
from chipledger.web.auth import TokenCache, new_token, principal_for
from chipledger.web.lake import LakeReader
from chipledger.web.redact import new_key
from store.repo import open_store
from tests.web_support import PATH_TEAM, portal_config, run_lake

# root: admin (portal_config's members); olga's team has a job pending (web_support's lake), vision and ads-ml none
USERS = {"alice": "vision", "eve": "ads-ml", "olga": PATH_TEAM, "root": None}


@pytest.fixture(scope="module")
def env(demo_lake_of, tmp_path_factory):
    root = tmp_path_factory.mktemp("portal-kept")
    _, lake, store_url = run_lake(demo_lake_of(3, 7), root)
    st = open_store(store_url)
    tokens = {user: new_token(st, user, team)[1] for user, team in USERS.items()}
    return {"lake": lake, "store": st, "store_url": store_url, "tokens": tokens, "key": new_key()}


def _portal(env, visibility: str = "fleet") -> Portal:
    """A portal with a snapshot of its own (nothing kept yet), the same alias key as every other of the module's (so
    hidden ids have the same aliases in all of them)."""
    reader = LakeReader(env["lake"])
    return Portal(cfg=portal_config(visibility=visibility), reader=reader, store=env["store"],
                  tokens=TokenCache(env["store"], ttl_s=0), alias_key=env["key"])


def _h(env, user: str) -> dict:
    return {"Authorization": f"Bearer {env['tokens'][user]}"}


def _routes(portal: Portal) -> list[str]:
    s = portal.reader.snapshot
    vision_job = s.rows("SELECT job_id FROM portal_jobs WHERE team = 'vision' ORDER BY preemptions DESC, job_id "
                        "LIMIT 1")[0]["job_id"]
    ads_job = s.rows("SELECT job_id FROM portal_jobs WHERE team = 'ads-ml' ORDER BY preemptions DESC, job_id "
                     "LIMIT 1")[0]["job_id"]
    return ["/api/v1/pools", "/api/v1/teams/vision/balances", "/api/v1/teams/ads-ml/balances", "/api/v1/queue",
            "/api/v1/queue?team=vision", f"/api/v1/jobs/{vision_job}", f"/api/v1/jobs/{ads_job}",
            "/api/v1/decisions?limit=100", "/api/v1/decisions?limit=5", "/api/v1/slos", "/api/v1/head-of-line"]


@pytest.mark.parametrize("visibility", ["fleet", "team"])
def test_a_kept_answer_is_never_another_callers(env, visibility):
    """Admin and three teams' members ask every kept route of one portal, in turn and twice over; each
    answer equals what a fresh portal (nothing kept) answers that caller alone, and the views differ where the
    callers may read different things."""
    shared = _portal(env, visibility)
    c = TestClient(build_app(shared))
    routes = _routes(shared)
    got: dict[tuple[str, str], tuple[int, str]] = {}
    for _ in range(2):
        for user in ("root", "alice", "eve", "olga"):
            for path in routes:
                r = c.get(path, headers=_h(env, user))
                answer = (r.status_code, r.text)
                assert got.setdefault((user, path), answer) == answer, (user, path)  # the second read: the same
    for user in ("alice", "eve", "olga"):
        alone = TestClient(build_app(_portal(env, visibility)))
        for path in routes:
            r = alone.get(path, headers=_h(env, user))
            assert got[user, path] == (r.status_code, r.text), (visibility, user, path)
    # the views differ: otherwise this test could not tell one caller's answer from another's
    assert got["eve", routes[5]][0] == 404 and got["alice", routes[5]][0] == 200  # vision's job
    assert got["alice", routes[6]][0] == 404 and got["root", routes[6]][0] == 200  # ads-ml's job
    assert '"job-org-ml-1"' in got["olga", "/api/v1/queue"][1] and '"job-org-ml-1"' in got["root", "/api/v1/queue"][1]
    assert '"job-org-ml-1"' not in got["alice", "/api/v1/queue"][1]
    assert '"job-org-ml-1"' not in got["eve", "/api/v1/queue"][1]
    assert got["eve", "/api/v1/teams/vision/balances"][0] == 404
    # kept, per view: the snapshot holds each caller's answer under their view
    s = shared.reader.snapshot
    cfg = shared.cfg.serve
    for user, team in USERS.items():
        p = principal_for(cfg, user, [], "token", token_team=team)
        assert s.kept((shared.alias_key, "json", "queue", p.view_key, None, None)) is not None, user


def test_view_key_tells_apart_callers_who_may_read_differently():
    cfg = portal_config().serve
    team_cfg = dataclasses.replace(cfg, visibility="team")
    alice = principal_for(cfg, "alice", [], "token", token_team="vision")
    alice2 = principal_for(cfg, "alice2", [], "session", token_team="vision")
    eve = principal_for(cfg, "eve", [], "token", token_team="ads-ml")
    both = principal_for(cfg, "bob", [], "token", token_team="vision")
    both = dataclasses.replace(both, teams=frozenset({"vision", "ads-ml"}))
    root = principal_for(cfg, "root", [], "token")
    alice_team = principal_for(team_cfg, "alice", [], "token", token_team="vision")
    assert alice.view_key == alice2.view_key  # two members of one team read the same
    keys = [alice.view_key, eve.view_key, both.view_key, root.view_key, alice_team.view_key]
    assert len(set(keys)) == len(keys)


def _main(html: str) -> str:
    return re.search(r"<main>(.*)</main>", html, re.S).group(1)


def _signed_in(env, app, user: str, path: str) -> tuple[TestClient, str]:
    c = TestClient(app)
    nonce = re.search(r'name="csrf" value="([^"]+)"', c.get("/login").text).group(1)
    assert c.post("/login", data={"token": env["tokens"][user], "csrf": nonce},
                  follow_redirects=False).status_code == 303
    page = c.get(path)
    assert page.status_code == 200
    return c, page.text


@pytest.mark.parametrize("page", ["", "/queue"])
def test_a_team_pages_content_is_kept_but_each_session_gets_its_own_csrf_token(env, page):
    """The home and queue pages' content is kept per team and view; the sign-out form around it is each session's.
    An admin reads the pages first (their view shows every team's blocker ids on the queue page)."""
    portal = _portal(env)
    app = build_app(portal)
    for team in ("ads-ml", "vision"):  # another team's page kept first: the key is the team's too
        assert TestClient(app).get(f"/teams/{team}{page}", headers=_h(env, "root")).status_code == 200
    one, first = _signed_in(env, app, "alice", f"/teams/vision{page}")
    two, second = _signed_in(env, app, "alice", f"/teams/vision{page}")
    fresh = _signed_in(env, build_app(_portal(env)), "alice", f"/teams/vision{page}")[1]
    assert _main(first) == _main(second) == _main(fresh)
    assert (re.search(r'<span id="team">([^<]*)</span>', _main(first)).group(1)) == "vision"
    assert ('id="balances"' in _main(first) and 'id="slos"' in _main(first)) if page == "" else \
        ('id="queue"' in _main(first) and 'id="hol"' in _main(first))
    token = re.compile(r'name="csrf" value="([^"]+)"')
    t1, t2 = token.search(first).group(1), token.search(second).group(1)
    assert t1 != t2
    assert two.post("/logout", data={"csrf": t1}, follow_redirects=False).status_code == 403  # the other session's
    assert two.post("/logout", data={"csrf": t2}, follow_redirects=False).status_code == 303
    # eve may not read vision's pages, kept or not
    assert TestClient(app).get(f"/teams/vision{page}", headers=_h(env, "eve")).status_code == 404


def test_security_headers_on_every_kind_of_response(env):
    portal = _portal(env)
    c = TestClient(build_app(portal))
    h = _h(env, "alice")
    answers = {
        "kept JSON": c.get("/api/v1/pools", headers=h),
        "page": c.get("/teams/vision", headers=h),
        "404": c.get("/api/v1/jobs/no-such-job", headers=h),
        "401": c.get("/api/v1/pools"),
        "413": c.post("/api/v1/bursts/dry-run", content=b"x" * (17 << 10), headers={**h, "content-type":
                                                                                       "application/json"}),
        "static": c.get("/static/portal.css"),
    }
    assert [k for k, r in answers.items() if r.status_code != {"kept JSON": 200, "page": 200, "404": 404,
                                                                "401": 401, "413": 413, "static": 200}[k]] == []
    for what, r in answers.items():
        assert "default-src 'none'" in r.headers["content-security-policy"], what
        assert r.headers["x-content-type-options"] == "nosniff", what
        assert r.headers["x-frame-options"] == "DENY", what
        assert r.headers["referrer-policy"] == "no-referrer", what
    assert answers["kept JSON"].headers["cache-control"] == "no-store"
    assert answers["kept JSON"].headers["content-type"] == "application/json"
    assert answers["static"].headers["cache-control"] == "max-age=300"  # a route's own is kept
    limited = Portal(cfg=portal_config(requests_per_minute=1), reader=portal.reader, store=env["store"],
                     tokens=TokenCache(env["store"], ttl_s=0))
    lc = TestClient(build_app(limited))
    codes = [lc.get("/api/v1/pools", headers=h) for _ in range(2)]
    assert [r.status_code for r in codes] == [200, 429]
    assert "default-src 'none'" in codes[1].headers["content-security-policy"]
    assert codes[1].headers["cache-control"] == "no-store"


def test_head_of_line_blockers_owners_table_equals_a_lookup_per_job(env):
    """The refresh's table of the head-of-line blockers' owners (what a member's rows are redacted by) names the same
    team for each blocker as a lookup of that job in its pool, and every blocker that has an owner."""
    from chipledger.web.app import hol_owners

    s = _portal(env).reader.snapshot
    owners = hol_owners(s)
    looked = 0
    for row in s.rows("SELECT pool, top_blockers FROM portal_hol"):
        for job_id in (row["top_blockers"] or "").split(","):
            if not job_id:
                continue
            found = s.rows("SELECT team FROM portal_job_owners WHERE pool = ? AND job_id = ?", [row["pool"], job_id])
            assert owners.get((row["pool"], job_id)) == (found[0]["team"] if found else None), (row, job_id)
            looked += 1
    assert looked > 0


def test_chipledger_serve_warms_its_first_snapshot_before_any_request(env, monkeypatch):
    """`chipledger serve` builds the first snapshot before it listens: it is warmed like every later one (the queue
    with its estimates, the head-of-line blockers' owners, the lake's team names), so the first queue read after the
    start is a lookup, not the request's computation. The command runs as a user runs it; only the listening loop
    (uvicorn.run) is replaced by one that keeps the application, and no request is made until the snapshot is
    looked at."""
    import json

    import uvicorn
    from typer.testing import CliRunner

    from chipledger.cli import app as cli_app

    served = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(app))
    res = CliRunner().invoke(cli_app, ["serve", "--lake", str(env["lake"]), "--store", env["store_url"]])
    assert res.exit_code == 0, res.output
    [app] = served
    portal = app.state.portal
    try:
        s = portal.reader._snap
        assert s is not None and s.version == 1 and s.warm_s is not None
        for key in ("queue", "hol_owners", "all_teams"):  # what `warm` computes, kept before any request
            assert s.kept(key) is not None, key
        c = TestClient(app)
        health = c.get("/healthz").json()
        assert health["snapshot"] == 1 and health["warm_s"] is not None
        queue = c.get("/api/v1/queue", headers=_h(env, "olga")).json()
        assert queue["snapshot"] == 1 and "job-org-ml-1" in json.dumps(queue)
        assert portal.reader._snap is s
    finally:
        portal.reader.stop()


def test_a_decisions_cursor_is_kept_once_however_it_is_spelled(env):
    """The decisions route keeps its answer per cursor as parsed: spellings of one cursor (base64 padded or not, the
    JSON's spaces, the instant's zero padding) are one kept answer, and the same page; a cursor this API did not give
    out is still 400, and nothing is kept for it."""
    import base64
    import json

    portal = _portal(env)
    c = TestClient(build_app(portal))
    h = _h(env, "root")
    first = c.get("/api/v1/decisions?limit=2", headers=h).json()
    cursor = first["next_cursor"]
    at, did = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    day = at[:8] + str(int(at[8:10])) + at[10:]  # 2026-11-02T… -> 2026-11-2T…: strptime reads both
    spellings = [cursor, base64.urlsafe_b64encode(json.dumps([at, did], indent=1).encode()).decode(),
                 base64.urlsafe_b64encode(json.dumps([at, did], separators=(",", ":")).encode()).decode(),
                 base64.urlsafe_b64encode(json.dumps([day, did]).encode()).decode().rstrip("=")]
    assert len(set(spellings)) == 4 and at[8] == "0"
    pages = {c.get("/api/v1/decisions", params={"limit": 2, "cursor": x}, headers=h).text for x in spellings}
    assert len(pages) == 1 and json.loads(pages.pop())["decisions"][0]["decision_id"] != first["decisions"][-1][
        "decision_id"]
    s = portal.reader.snapshot

    def kept_decisions() -> list:
        return [k for k in list(s._memo) if isinstance(k, tuple) and k[1:3] == ("json", "decisions")]

    assert len(kept_decisions()) == 2  # the first page and the second, once
    for bad in ("%%%", base64.urlsafe_b64encode(b'["x", "y"]').decode(), "bm90IGpzb24"):
        r = c.get("/api/v1/decisions", params={"limit": 2, "cursor": bad}, headers=h)
        assert r.status_code == 400 and r.json()["detail"] == "cursor is not one this API gave out", bad
    assert len(kept_decisions()) == 2
