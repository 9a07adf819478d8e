"""The portal (`chipledger serve`, chipledger/web/): the read API and its OpenAPI document, who sees what (an
authorization matrix over every route), CSRF, escaping, limits, the lake snapshot swap, the burst dry run against the
core's own inputs, the start estimate."""

from __future__ import annotations

import base64
import json
import re
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from chipledger.cli import app as cli_app
from chipledger.web.app import Portal, build_app
from chipledger.web.auth import TokenCache, new_token
from chipledger.web.estimate import Running, Waiting, estimate_start
from chipledger.web.lake import LakeReader
from tests.web_support import (  # noqa: F401 (env: the module's lake and portal)
    HOSTILE_TEAM, PATH_TEAM, chipledger_run, client_of, decision_ids_page_by_page, env, forged_cursor, lake_with,
    last_instant, portal_config, portal_like, write_events,
)
# the shared set-up under the names this module's tests use
from tests.web_support import decision_views as _decision_views, headers as _h, signed_in as _signed_in, sql as _sql

POOL = "us-west4-a/tpu-v5e"


def _vision_job(env):
    return env["portal"].reader.snapshot.rows(
        "SELECT job_id FROM portal_jobs WHERE team = 'vision' ORDER BY preemptions DESC, job_id LIMIT 1")[0]["job_id"]


def _window():
    return {"window_start": "2026-11-04T08:00:00Z", "window_end": "2026-11-04T12:00:00Z"}


STATEMENT = "vision@2026-11-02..2026-11-02"


# one request per route of the OpenAPI document: (method, path, body)
def api_requests(env) -> dict[str, tuple[str, str, dict | None]]:
    job = _vision_job(env)
    burst = {"pool": POOL, "team": "vision", "chips": 4, **_window()}
    return {
        "/api/v1/whoami": ("GET", "/api/v1/whoami", None),
        "/api/v1/pools": ("GET", "/api/v1/pools", None),
        "/api/v1/teams": ("GET", "/api/v1/teams", None),
        "/api/v1/teams/{team}/balances": ("GET", "/api/v1/teams/vision/balances", None),
        "/api/v1/queue": ("GET", "/api/v1/queue?team=vision", None),
        "/api/v1/jobs/{job_id}": ("GET", f"/api/v1/jobs/{job}", None),
        "/api/v1/decisions": ("GET", "/api/v1/decisions?team=vision", None),
        "/api/v1/slos": ("GET", "/api/v1/slos", None),
        "/api/v1/head-of-line": ("GET", "/api/v1/head-of-line", None),
        "/api/v1/teams/{team}/statements": ("GET", "/api/v1/teams/vision/statements", None),
        "/api/v1/statements/{statement_id}/{fmt}": ("GET", f"/api/v1/statements/{STATEMENT}/json", None),
        "/api/v1/statement-file": ("GET", f"/api/v1/statement-file?statement_id={STATEMENT}&fmt=json", None),
        "/api/v1/teams/{team}/jobs": ("GET", "/api/v1/teams/vision/jobs?limit=5", None),
        "/api/v1/teams/{team}/bursts": ("GET", "/api/v1/teams/vision/bursts", None),
        "/api/v1/bursts/dry-run": ("POST", "/api/v1/bursts/dry-run", burst),
        "/api/v1/bursts": ("POST", "/api/v1/bursts", burst),
        "/api/v1/snapshots": ("GET", "/api/v1/snapshots?once=true", None),
        "/api/v1/teams/{team}/costs": ("GET", "/api/v1/teams/vision/costs", None),
        "/api/v1/teams/{team}/budgets": ("GET", "/api/v1/teams/vision/budgets", None),
        "/api/v1/pool-costs": ("GET", "/api/v1/pool-costs", None),
    }


# what each role gets for each route about team vision (alice: vision's member; eve: ads-ml's; root: admin;
# sre: an SRE through the proxy; carol: vision's admin by config; dave: a token without a team or role)
OK = 200
FLEET = {"/api/v1/snapshots", "/api/v1/pools", "/api/v1/pool-costs", "/api/v1/teams", "/api/v1/slos",
         "/api/v1/head-of-line", "/api/v1/whoami"}
EXPECTED_SPECIAL = {
    # no Kafka in this portal: 503 for everyone who may send
    "/api/v1/bursts": 503,
}


def expected(route: str, user: str) -> int:
    if user == "anon":
        return 401
    if route in FLEET:
        return OK
    may_read = user in ("alice", "root", "sre", "carol")
    may_burst = user in ("alice", "root", "carol")
    if route in ("/api/v1/bursts/dry-run", "/api/v1/bursts"):
        if not may_burst:
            return 404
        return EXPECTED_SPECIAL.get(route, OK)
    if not may_read:
        return 404
    return EXPECTED_SPECIAL.get(route, OK)


def test_openapi_document_validates_and_every_route_is_exercised(env):
    from openapi_spec_validator import validate

    spec = env["client"].get("/api/v1/openapi.json").json()
    validate(spec)
    documented = set(spec["paths"])
    assert documented == set(api_requests(env)), "every route of the OpenAPI document has a request in this test"
    # and every API route of the application is in the document
    def paths(routes):
        for r in routes:
            inner = getattr(r, "original_router", None) or (r if hasattr(r, "routes") and r is not routes else None)
            if inner is not None and hasattr(inner, "routes"):
                yield from paths(inner.routes)
            elif getattr(r, "path_format", None):
                yield r.path_format

    app_routes = {p for p in paths(env["client"].app.routes) if p.startswith("/api/v1/")}
    assert app_routes - {"/api/v1/openapi.json"} == documented


@pytest.mark.parametrize("user", ["anon", "eve", "alice", "carol", "root", "sre", "dave"])
def test_authorization_matrix_api(env, user):
    c = env["client"]
    got = {}
    for route, (method, path, body) in api_requests(env).items():
        r = c.request(method, path, json=body, headers=_h(env, user))
        got[route] = r.status_code
    want = {route: expected(route, user) for route in got}
    assert got == want


PAGES = ["/teams/vision", "/teams/vision/queue", "/teams/vision/statements", "/teams/vision/bursts", "JOB", "/fleet"]


@pytest.mark.parametrize("user", ["anon", "eve", "alice", "root", "sre"])
def test_authorization_matrix_pages(env, user):
    c = env["client"]
    job = _vision_job(env)
    for page in PAGES:
        path = f"/jobs/{job}" if page == "JOB" else page
        r = c.get(path, headers=_h(env, user), follow_redirects=False)
        if user == "anon":
            assert (r.status_code, r.headers.get("location")) == (303, "/login"), path
        elif user == "eve" and page != "/fleet":
            assert r.status_code == 404, path  # another team's pages and jobs do not exist for her
        else:
            assert r.status_code == 200, path
        assert "default-src 'none'" in r.headers["content-security-policy"]
        assert "<script" not in r.text.lower() or HOSTILE_TEAM not in r.text


def test_other_teams_job_is_404_and_queue_hides_names(env):
    c = env["client"]
    job = _vision_job(env)
    assert c.get(f"/api/v1/jobs/{job}", headers=_h(env, "eve")).status_code == 404
    assert c.get(f"/api/v1/jobs/{job}", headers=_h(env, "alice")).status_code == 200
    q = c.get("/api/v1/queue", headers=_h(env, "eve")).json()["queue"]
    assert all(e["job_id"] is None for e in q if e["team"] != "ads-ml")
    assert all(e["message"] is None for e in q if e["team"] != "ads-ml")


def test_visibility_team_hides_fleet(env):
    c = client_of(portal_like(env, cfg=portal_config(visibility="team")))
    assert [t["team"] for t in c.get("/api/v1/teams", headers=_h(env, "alice")).json()["teams"]] == ["vision"]
    assert c.get("/fleet", headers=_h(env, "alice")).status_code == 404
    assert all(e["team"] in ("vision", None) for e in c.get("/api/v1/queue", headers=_h(env, "alice")).json()["queue"])
    assert {h["team"] for h in c.get("/api/v1/head-of-line", headers=_h(env, "alice")).json()["head_of_line"]} <= \
        {"vision"}
    assert c.get("/fleet", headers=_h(env, "root")).status_code == 200
    assert c.get("/api/v1/pool-costs", headers=_h(env, "alice")).status_code == 404
    assert c.get("/api/v1/pool-costs", headers=_h(env, "root")).status_code == 200
    assert c.get("/api/v1/pool-costs", headers=_h(env, "sre")).status_code == 200


def test_proxy_header_only_from_trusted_addresses(env):
    p = env["portal"]
    hdr = {"X-Forwarded-User": "root"}
    assert env["client"].get("/api/v1/whoami", headers=hdr).json()["roles"] == ["admin"]
    untrusted = Portal(cfg=portal_config(trusted_proxies="10.0.0.1"), reader=p.reader, store=p.store)
    assert TestClient(build_app(untrusted)).get("/api/v1/whoami", headers=hdr).status_code == 401


def test_revoked_token_is_refused(env):
    st = env["store"]
    token_id, token = new_token(st, "mallory", "vision")
    c = env["client"]
    h = {"Authorization": f"Bearer {token}"}
    assert c.get("/api/v1/whoami", headers=h).status_code == 200
    assert st.revoke_token(token_id, datetime.now(timezone.utc))
    assert c.get("/api/v1/whoami", headers=h).status_code == 401
    assert c.get("/api/v1/whoami", headers={"Authorization": f"Bearer {token}x"}).status_code == 401
    assert c.get("/api/v1/whoami", headers={"Authorization": "Bearer clp_nope"}).status_code == 401


def test_token_cli(env):
    url = env["store_url"]
    res = CliRunner().invoke(cli_app, ["serve", "tokens", "create", "--user", "zoe", "--team", "vision", "--store", url])
    assert res.exit_code == 0, res.output
    token = res.stdout.strip().splitlines()[-1]
    assert token.startswith("clp_")
    token_id = token[4:].split("_")[0]
    listed = CliRunner().invoke(cli_app, ["serve", "tokens", "list", "--store", url, "--user", "zoe"])
    assert token_id in listed.stdout and token[20:] not in listed.stdout
    assert all(token not in (r.secret_sha256 or "") for r in env["store"].tokens())
    assert CliRunner().invoke(cli_app, ["serve", "tokens", "revoke", token_id, "--store", url]).exit_code == 0
    assert CliRunner().invoke(cli_app, ["serve", "tokens", "revoke", token_id, "--store", url]).exit_code == 1
    # names as events may hold them (markup and `&` too: every name is escaped where it is shown), no control characters
    assert CliRunner().invoke(cli_app, ["serve", "tokens", "create", "--user", "a\x1bb", "--store", url]).exit_code == 2
    assert CliRunner().invoke(cli_app, ["serve", "tokens", "create", "--user", "x", "--team", "R&D <lab>", "--store",
                                        url]).exit_code == 0


def test_login_and_csrf(env):
    c = client_of(env["portal"])
    c.get("/login")
    # a forged login form (wrong nonce) is refused
    assert c.post("/login", data={"token": env["tokens"]["alice"][1], "csrf": "forged"}).status_code == 403
    c = _signed_in(env)
    home = c.get("/teams/vision")
    assert home.status_code == 200 and 'id="team">vision<' in home.text
    form = {"pool": POOL, "chips": "4", "window_start": "2026-11-04T08:00", "window_end": "2026-11-04T12:00",
            "action": "dry-run"}
    assert c.post("/teams/vision/bursts", data={**form, "csrf": "forged"}).status_code == 403
    page = c.get("/teams/vision/bursts")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    ok = c.post("/teams/vision/bursts", data={**form, "csrf": csrf})
    assert ok.status_code == 200 and 'id="verdict"' in ok.text
    assert 'id="nokafka"' in ok.text  # no Kafka here: the form says so
    # the session cookie is no API credential for writes without the CSRF header
    assert c.post("/api/v1/bursts", json={"pool": POOL, "team": "vision", "chips": 4, **_window()}).status_code == 403


def test_malformed_and_huge_inputs(env):
    c = env["client"]
    h = _h(env, "alice")
    assert c.post("/api/v1/bursts/dry-run", content=b"x" * (64 << 10), headers={**h, "content-type":
                                                                                "application/json"}).status_code == 413
    assert c.post("/api/v1/bursts/dry-run", content=b"{not json", headers={**h, "content-type":
                                                                          "application/json"}).status_code == 422
    bad = {"pool": POOL, "team": "vision", "chips": -1, **_window()}
    assert c.post("/api/v1/bursts/dry-run", json=bad, headers=h).status_code == 422
    back = {"pool": POOL, "team": "vision", "chips": 2, "window_start": "2026-11-04T12:00:00Z",
            "window_end": "2026-11-04T08:00:00Z"}
    assert c.post("/api/v1/bursts/dry-run", json=back, headers=h).status_code == 422
    sc = _signed_in(env)
    csrf = re.search(r'name="csrf" value="([^"]+)"', sc.get("/teams/vision/bursts").text).group(1)
    r = sc.post("/teams/vision/bursts", data={"pool": POOL, "chips": "4", "window_start": "yesterday",
                                              "window_end": "2026-11-04T12:00", "csrf": csrf})
    assert r.status_code == 400 and "not a date" in r.text
    assert c.get("/api/v1/decisions?cursor=%%%", headers=_h(env, "root")).status_code == 400
    assert c.get("/api/v1/teams/%3Cscript%3E/balances", headers=_h(env, "root")).status_code == 404


def test_hostile_names_are_escaped(env):
    c = env["client"]
    page = c.get("/fleet", headers=_h(env, "root"))
    assert page.status_code == 200
    assert HOSTILE_TEAM not in page.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
    q = c.get(f"/api/v1/queue?pool={POOL}", headers=_h(env, "root")).json()["queue"]
    assert any(e["team"] == HOSTILE_TEAM for e in q)  # JSON carries the name as it is


def test_statements_list_and_download(env):
    c = env["client"]
    listed = c.get("/api/v1/teams/vision/statements", headers=_h(env, "alice")).json()["statements"]
    assert [x["statement_id"] for x in listed] == [STATEMENT]
    body = c.get(listed[0]["downloads"]["json"], headers=_h(env, "alice"))
    assert body.status_code == 200 and json.loads(body.content)["team"] == "vision"
    assert "attachment" in body.headers["content-disposition"]
    assert c.get(listed[0]["downloads"]["json"], headers=_h(env, "eve")).status_code == 404
    for bad in ("vision@..%2F..%2Fetc/json", "vision@2026-11-02..2026-11-02/exe", "vision@2026-11-03..2026-11-03/json"):
        assert c.get(f"/api/v1/statements/{bad}", headers=_h(env, "root")).status_code == 404, bad
    other = "/api/v1/statements/ads-ml@2026-11-02..2026-11-02/json"  # another team's statement
    assert c.get(other, headers=_h(env, "alice")).status_code == 404
    assert c.get(other, headers=_h(env, "eve")).status_code == 200
    page = c.get("/teams/vision/statements", headers=_h(env, "alice"))
    assert f"/api/v1/statements/{STATEMENT}/html" in page.text


def test_team_jobs_paged(env):
    c = env["client"]
    h = _h(env, "alice")
    first = c.get("/api/v1/teams/vision/jobs?limit=3", headers=h).json()
    second = c.get(f"/api/v1/teams/vision/jobs?limit=3&cursor={first['next_cursor']}", headers=h).json()
    ids = [j["job_id"] for j in first["jobs"] + second["jobs"]]
    assert len(ids) == 6 == len(set(ids)) and all(j["team"] == "vision" for j in first["jobs"])
    assert first["jobs"][0]["submitted_at"] >= second["jobs"][-1]["submitted_at"]


def test_team_names_that_are_paths(env):
    st = env["store"]
    _, token = new_token(st, "olga", PATH_TEAM)
    h = {"Authorization": f"Bearer {token}"}
    c = env["client"]
    home = c.get("/", headers=h, follow_redirects=True)
    assert home.status_code == 200 and f'id="team">{PATH_TEAM}<' in home.text
    assert c.get(f"/teams/{PATH_TEAM}/queue", headers=h).status_code == 200
    assert c.get(f"/teams/{PATH_TEAM}/bursts", headers=h).status_code == 200
    assert [b["team"] for b in c.get(f"/api/v1/teams/{PATH_TEAM}/balances", headers=h).json()["balances"]] == \
        [PATH_TEAM]
    assert [j["job_id"] for j in c.get(f"/api/v1/teams/{PATH_TEAM}/jobs", headers=h).json()["jobs"]] == ["job-org-ml-1"]
    assert c.get(f"/api/v1/teams/{PATH_TEAM}/balances", headers=_h(env, "alice")).status_code == 404
    assert c.get("/teams/org", headers=h).status_code == 404  # a prefix of the name is another team


def test_burst_submit_is_signed_as_the_portal_principal(env):
    """`serve --user portal --password-file …` gives the producer a connection with the portal's signing key: the
    request goes out as `burst.requested` with `requested_by`, signed as `portal` (streams/principals.py)."""
    from streams.clients import KafkaConnection
    from streams.principals import HEADER_PRINCIPAL, HEADER_SIG, new_key, sign
    from streams.producer import LedgerProducer

    sent = []

    class Fake:
        def send(self, topic, value=None, key=None, headers=None, timestamp_ms=None):
            sent.append((topic, key, value, headers))

            class Done:
                def get(self, timeout=None):
                    return None
            return Done()

        def flush(self, timeout=None):
            pass

        def close(self, timeout=None):
            pass

    key = new_key()
    conn = KafkaConnection(bootstrap="unused:9092", username="portal", signing_key=key.hex())
    c = client_of(portal_like(env, producer_factory=lambda: LedgerProducer(conn, client=Fake())))
    r = c.post("/api/v1/bursts", json={"pool": POOL, "team": "vision", "chips": 4, **_window(), "reason": "eval"},
               headers=_h(env, "alice"))
    assert r.status_code == 202, r.text
    (topic, k, value, headers), = sent
    body = json.loads(value)
    assert topic == "chipledger.quota" and body["type"] == "burst.requested" and body["requested_by"] == "alice"
    assert body["team"] == "vision" and body["request_id"] == r.json()["request_id"]
    h = dict(headers)
    assert h[HEADER_PRINCIPAL] == b"portal"
    assert h[HEADER_SIG] == sign(key, k, value, [x for x in headers if x[0] not in (HEADER_PRINCIPAL, HEADER_SIG)])
    pending = c.get("/api/v1/teams/vision/bursts", headers=_h(env, "alice")).json()["bursts"]
    assert [b["status"] for b in pending if b["request_id"] == body["request_id"]] == ["pending"]
    # another team's member cannot send for vision; the rate limit holds
    assert c.post("/api/v1/bursts", json={"pool": POOL, "team": "vision", "chips": 4, **_window()},
                  headers=_h(env, "eve")).status_code == 404


def test_snapshot_events(env):
    r = env["client"].get("/api/v1/snapshots?once=true", headers=_h(env, "alice"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    event, data = r.text.strip().splitlines()
    assert event == "event: snapshot" and json.loads(data[len("data: "):])["snapshot"] >= 1


def test_signing_out_ends_the_session_on_the_server(env):
    """Sign in, copy the cookie, sign out, replay the cookie: refused (pages send you to /login, the API says 401).
    The cookie is a session id, never the token."""
    c = _signed_in(env)
    cookie = c.cookies.get("clp_session")
    assert cookie and cookie != env["tokens"]["alice"][1] and env["tokens"]["alice"][1] not in cookie
    replay = TestClient(c.app)
    replay.cookies.set("clp_session", cookie)
    assert replay.get("/teams/vision", follow_redirects=False).status_code == 200  # the copy works while signed in
    home = c.get("/teams/vision")
    csrf = re.search(r'action="/logout".*?name="csrf" value="([^"]+)"', home.text, re.S).group(1)
    assert c.post("/logout", data={"csrf": "forged"}, follow_redirects=False).status_code == 403
    out = c.post("/logout", data={"csrf": csrf}, follow_redirects=False)
    assert (out.status_code, out.headers["location"]) == (303, "/login")
    r = replay.get("/teams/vision", follow_redirects=False)
    assert (r.status_code, r.headers.get("location")) == (303, "/login")
    assert replay.get("/api/v1/whoami").status_code == 401
    assert replay.get(f"/jobs/{_vision_job(env)}", follow_redirects=False).status_code == 303
    # its CSRF token died with it: a new session of the same token has new ones
    again = _signed_in(env)
    assert csrf not in again.get("/teams/vision/bursts").text
    # the API token itself still works (signing out of a browser does not revoke it)
    assert env["client"].get("/api/v1/whoami", headers=_h(env, "alice")).status_code == 200


def test_a_session_ends_when_its_token_is_revoked(env):
    token_id, token = new_token(env["store"], "mallory", "vision")
    c = _signed_in(env, token=token)
    assert c.get("/api/v1/whoami").json()["via"] == "session"
    assert env["store"].revoke_token(token_id, datetime.now(timezone.utc))
    assert c.get("/api/v1/whoami").status_code == 401
    assert c.get("/teams/vision", follow_redirects=False).headers.get("location") == "/login"
    # and the raw token in the cookie (what the cookie held before sessions) is no session
    raw = TestClient(c.app)
    raw.cookies.set("clp_session", env["tokens"]["alice"][1])
    assert raw.get("/api/v1/whoami").status_code == 401


def test_a_restart_signs_nobody_out_and_signing_out_ends_the_session_everywhere(env):
    """Sessions are kept in the store the tokens use (`portal_sessions`: the SHA-256 of the cookie, never the cookie):
    a portal started again on the same store (a restart, or another replica) takes the cookie of a session signed in
    before; signing out there ends it on the first portal too; a session whose time is over is refused, and one
    written by another replica is taken."""
    import hashlib
    from datetime import timedelta

    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from store.models import PortalSession

    c = _signed_in(env)
    cookie = c.cookies.get("clp_session")
    sha = hashlib.sha256(cookie.encode()).hexdigest()
    with Session(env["store"].engine) as db:
        rows = [(r.session_sha256, r.token_id) for r in db.scalars(select(PortalSession))]
    assert (sha, env["tokens"]["alice"][0]) in rows and all(cookie not in str(r) for r in rows)
    restarted = client_of(portal_like(env))  # a new process's Portal: its own memory, CSRF key and aliases
    restarted.cookies.set("clp_session", cookie)
    who = restarted.get("/api/v1/whoami")
    assert who.status_code == 200 and (who.json()["user"], who.json()["via"]) == ("alice", "session")
    home = restarted.get("/teams/vision", follow_redirects=False)
    assert home.status_code == 200
    csrf = re.search(r'action="/logout".*?name="csrf" value="([^"]+)"', home.text, re.S).group(1)
    assert restarted.post("/logout", data={"csrf": csrf}, follow_redirects=False).status_code == 303
    assert c.get("/api/v1/whoami").status_code == 401  # signed out there: ended here too
    assert env["store"].session(sha) is None
    # sessions another replica wrote: one whose time is over is refused, a live one is taken
    now = datetime.now(timezone.utc)
    for cookie, ends, status in (("cls_" + "o" * 43, now - timedelta(seconds=1), 401),
                                 ("cls_" + "l" * 43, now + timedelta(hours=1), 200)):
        env["store"].start_session(PortalSession(
            session_sha256=hashlib.sha256(cookie.encode()).hexdigest(), token_id=env["tokens"]["alice"][0],
            started_at=ends - timedelta(hours=12), expires_at=ends), keep_per_token=16)
        other = client_of(portal_like(env))
        other.cookies.set("clp_session", cookie)
        assert other.get("/api/v1/whoami").status_code == status, ends


def _limited_portal(env, per_minute: int) -> TestClient:
    return client_of(portal_like(env, cfg=portal_config(requests_per_minute=per_minute)))


def test_every_request_is_rate_limited_per_principal(env):
    """`[serve] requests_per_minute`: a caller's requests beyond it are 429 with Retry-After and a sentence (JSON for
    the API, a page for pages); another user, and /healthz, are not affected; anonymous callers are counted per
    address."""
    c = _limited_portal(env, 5)
    alice, eve = _h(env, "alice"), _h(env, "eve")
    got = [c.get(path, headers=alice).status_code for path in
           ("/api/v1/whoami", "/api/v1/pools", "/teams/vision", "/api/v1/queue", "/api/v1/teams")]
    assert got == [200] * 5
    r = c.get("/api/v1/whoami", headers=alice)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["detail"].startswith("too many requests") and r.json()["retry_after_s"] >= 1
    page = c.get("/teams/vision", headers=alice)
    assert page.status_code == 429 and page.headers["content-type"].startswith("text/html")
    assert "too many requests" in page.text and int(page.headers["retry-after"]) >= 1
    assert "default-src 'none'" in page.headers["content-security-policy"]
    # another user is not affected, nor alice's other way in (a second token of hers shares her bucket)
    assert c.get("/api/v1/whoami", headers=eve).status_code == 200
    _, alice2 = new_token(env["store"], "alice", "vision")
    assert c.get("/api/v1/whoami", headers={"Authorization": f"Bearer {alice2}"}).status_code == 429
    assert c.get("/healthz").status_code == 200
    # anonymous callers: per client address, their 401s and login pages counted too
    anon = [c.get("/api/v1/pools").status_code for _ in range(6)]
    assert anon == [401] * 5 + [429]
    assert c.get("/login").status_code == 429
    assert c.get("/api/v1/whoami", headers=eve).status_code == 200  # eve still has hers


def test_a_rate_limit_of_zero_is_no_limit(env):
    c = _limited_portal(env, 0)
    assert {c.get("/api/v1/whoami", headers=_h(env, "alice")).status_code for _ in range(300)} == {200}
    from chipledger.config import ServeConfig, load_config

    with pytest.raises(ValueError, match="requests_per_minute"):
        ServeConfig(requests_per_minute=-1)
    toml = env["root"] / "limits.toml"
    toml.write_text("[serve]\nrequests_per_minute = 0\nsession_hours = 2\n")
    assert (load_config(toml, env={}).serve.requests_per_minute, load_config(toml, env={}).serve.session_hours) == (0, 2)
    assert load_config(toml, env={"CHIPLEDGER_SERVE_REQUESTS_PER_MINUTE": "30"}).serve.requests_per_minute == 30


def test_burst_writes_and_dry_runs_beyond_their_limit_say_when_to_retry(env):
    c = client_of(portal_like(env, cfg=portal_config(writes_per_minute=1)))
    body = {"pool": POOL, "team": "vision", "chips": 4, **_window()}
    got = [c.post("/api/v1/bursts/dry-run", json=body, headers=_h(env, "alice")) for _ in range(7)]
    assert [r.status_code for r in got] == [200] * 6 + [429]  # dry runs: six times the writes
    assert int(got[-1].headers["retry-after"]) >= 1 and "dry runs" in got[-1].json()["detail"]
    assert c.post("/api/v1/bursts/dry-run", json=body, headers=_h(env, "root")).status_code == 200


def test_write_rate_limit(env):
    from chipledger.web.auth import RateLimiter

    lim = RateLimiter(3)
    assert [lim.allow("u") for _ in range(4)] == [True, True, True, False]
    assert lim.allow("v")
    assert lim.wait_s("u") == 20  # one request every 60/3 s: the next in 20 s
    assert RateLimiter(0).wait_s("u") == 0


def test_pagination_is_stable(env):
    c = env["client"]
    h = _h(env, "root")
    seen = decision_ids_page_by_page(c, h, limit=2)
    everything = c.get("/api/v1/decisions?limit=1000", headers=h).json()["decisions"]
    assert seen == [d["decision_id"] for d in everything] and len(seen) == len(set(seen))
    bal = c.get("/api/v1/teams/vision/balances?since=2026-11-01T00:00:00Z&limit=3", headers=h).json()
    nxt = c.get(f"/api/v1/teams/vision/balances?since=2026-11-01T00:00:00Z&limit=3&cursor={bal['next_cursor']}",
                headers=h).json()
    assert (bal["balances"][-1]["at"], bal["balances"][-1]["pool"]) < (nxt["balances"][0]["at"],
                                                                         nxt["balances"][0]["pool"])


def test_numbers_equal_chipledger_sql(env):
    c = env["client"]
    api = c.get("/api/v1/teams/vision/balances", headers=_h(env, "alice")).json()["balances"]
    res = CliRunner().invoke(cli_app, ["sql", "--lake", str(env["lake"]), "--format", "json",
                                       "SELECT pool, nominal_chips, used_chips, fair_share_factor FROM balances "
                                       "WHERE team = 'vision' AND \"at\" = (SELECT max(\"at\") FROM balance_log b "
                                       "WHERE b.pool = balances.pool) ORDER BY pool"])
    assert res.exit_code == 0, res.output
    sql = json.loads(res.stdout)
    assert [(b["pool"], b["nominal_chips"], b["used_chips"], b["fair_share_factor"]) for b in api] == \
        [(r["pool"], r["nominal_chips"], r["used_chips"], r["fair_share_factor"]) for r in sql]


def test_snapshot_swaps_whole_when_the_lake_changes(env, tmp_path):
    lake = tmp_path / "lake"
    shutil.copytree(env["lake"], lake)
    reader = LakeReader(lake)
    first = reader.snapshot
    assert reader.refresh() is first  # nothing changed: the same snapshot
    more = write_events(tmp_path / "more.jsonl", env["events"].read_text().splitlines()[:EVENTS_MORE])
    chipledger_run(more, lake, f"sqlite:///{tmp_path / 's.db'}", "--overwrite")
    held = first.rows("SELECT count(*) AS n FROM portal_jobs")[0]["n"]
    second = reader.refresh()
    assert second is not first and second.version == first.version + 1
    # a request that started on the first snapshot still reads it, whole
    assert first.rows("SELECT count(*) AS n FROM portal_jobs")[0]["n"] == held
    assert second.rows("SELECT count(*) AS n FROM portal_jobs")[0]["n"] != held


EVENTS_MORE = 2500


def test_a_swap_brings_the_answers_asked_of_the_previous_snapshot_computed_on_the_new_one(env, tmp_path, monkeypatch):
    """After a swap the first requests read answers the refresh computed (`Snapshot.rewarm`), not compute them while
    the clients wait (p99 of 0.9–2.6 s on the pages right after a swap at 1M events): the keys asked of the previous
    snapshot are computed again on the new one before it is swapped in, from the new snapshot's tables."""
    import chipledger.web.app as web_app

    lake = tmp_path / "lake"
    shutil.copytree(env["lake"], lake)
    portal = portal_like(env, lake=lake)
    client = client_of(portal)
    job_id = _vision_job(env)
    count = "SELECT count(*) AS n FROM portal_jobs"
    first = portal.reader.snapshot
    assert client.get(f"/api/v1/jobs/{job_id}", headers=_h(env, "alice")).status_code == 200
    held = first.cached_rows(count)
    more = write_events(tmp_path / "more.jsonl", env["events"].read_text().splitlines()[:EVENTS_MORE])
    chipledger_run(more, lake, f"sqlite:///{tmp_path / 's.db'}", "--overwrite")
    second = portal.reader.refresh()
    assert second is not first and second.rewarmed >= 2
    calls = []
    real = web_app._job_compute
    monkeypatch.setattr(web_app, "_job_compute", lambda s, j, pool: calls.append(j) or real(s, j, pool))
    after = client.get(f"/api/v1/jobs/{job_id}", headers=_h(env, "root"))  # staff: the job as computed, unredacted
    assert calls == []  # computed by the refresh
    # and computed on the new snapshot: the same answer as computing it there now, the new lake's count
    pools = second.rows("SELECT pool FROM portal_jobs WHERE job_id = ? ORDER BY submitted_at DESC, pool", [job_id])
    fresh = real(second, job_id, pools[0]["pool"]) if pools else None
    assert (after.status_code == 200) == (fresh is not None)
    if fresh is not None:
        assert after.json() == json.loads(fresh[0].model_dump_json())
    assert second.cached_rows(count) == second.rows(count) != held


def test_concurrent_requests_for_one_answer_compute_it_once(env):
    """Eight clients asking for the same page of a new snapshot computed it eight times at once: the others now wait
    for the first's answer. A computation that fails is not kept: the next request computes again."""
    import threading

    snap = env["portal"].reader.snapshot
    calls, gate = [], threading.Event()

    def slow(s):
        calls.append(1)
        gate.wait(5)
        return "answer"

    got = []
    ts = [threading.Thread(target=lambda: got.append(snap.memo(("test-once",), slow))) for _ in range(6)]
    for t in ts:
        t.start()
    time.sleep(0.3)
    gate.set()
    for t in ts:
        t.join()
    assert got == ["answer"] * 6 and calls == [1]

    def broken(s):
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        snap.memo(("test-broken",), broken)
    assert snap.memo(("test-broken",), lambda s: "later") == "later"


def test_burst_dry_run_uses_the_cores_inputs(env):
    """The dry run's inputs, gathered from the lake's facts, equal what the fold's own `burst_inputs` gathers from its
    state at the same instant (the end of the run), and the verdict is the core's `burst_verdict`."""
    from chipledger.web import burst as web_burst
    from ledger.fleet import Fleet
    from ledger.fold import FoldConfig
    from ledger.policy import burst_inputs, burst_verdict
    from schemas import parse_event

    fleet = Fleet(FoldConfig())
    for line in env["events"].read_text().splitlines():
        ev = parse_event(line.encode())
        if hasattr(ev, "pool"):  # a line the run dead-letters is skipped here too
            fleet.apply(ev, line.encode())
    fleet.close()
    state = fleet.pools[POOL]
    facts = web_burst.pool_facts(env["portal"].reader.snapshot, POOL)
    cfg = FoldConfig()
    for team in ("vision", "ads-ml"):
        for ws, we in ((facts.t + 3600, facts.t + 5 * 3600), (facts.t + 86400, facts.t + 86400 + 7200)):
            core = burst_inputs(state, team, "dry-run", ws, we, facts.t, cfg)
            ours = web_burst.inputs(facts, team, "dry-run", ws, we, cfg.capacity_slo_target)
            assert ours._replace(fair_share_factor=round(ours.fair_share_factor, 9)) == \
                core._replace(fair_share_factor=round(core.fair_share_factor, 9)), (team, ws)
            assert burst_verdict(ours, 8000, we, facts.t)[:2] == burst_verdict(core, 8000, we, facts.t)[:2]


def test_dry_run_offers_nearest_windows(env):
    c = env["client"]
    body = {"pool": POOL, "team": "vision", "chips": 4, **_window()}
    out = c.post("/api/v1/bursts/dry-run", json=body, headers=_h(env, "alice")).json()
    assert out["verdict"] in ("approved", "partial", "denied")
    assert set(out["numbers"]) >= {"forecast_idle_chips", "fair_share_factor", "error_budget_left"}
    for w in out["nearest_approved_windows"]:
        assert w["window_end"] > w["window_start"]


def test_estimate_start():
    running = [Running(4000, 1000), Running(4000, 2000), Running(2000, None)]
    job = Waiting("j", 6000, 100)
    e = estimate_start(0, 2000, running, [], job, 16000)
    assert e.start_s == 1000 and "1 without an expected end" in e.basis
    ahead = [Waiting("a", 4000, 500)]
    e = estimate_start(0, 2000, running, ahead, job, 16000)
    # a takes the chips freed at 1000 (2 + 4 free → 2 left), j needs 6: at 1500 a ends (6 free)
    assert e.start_s == 1500
    assert estimate_start(0, 0, [], [], job, 4000).start_s is None
    assert estimate_start(0, 0, [Running(8000, None)], [], job, 8000).start_s is None


# ----------------------------------------------------------------------------------------------------------------
# review-portal: defects found by a hostile review (each test failed before its fix)
# ----------------------------------------------------------------------------------------------------------------

def test_estimate_basis_never_names_another_teams_job():
    """[medium] A queue entry's `estimate_basis` read 'no estimate: job X ahead of it has no expected runtime', X
    the job id of whoever is ahead in the pool: another team's job id, which the API otherwise hides (job_id null,
    and with visibility = team not even the team)."""
    ahead = [Waiting("secret-job-of-ads-ml", 1000, 600), Waiting("other-teams-secret", 1000, None)]
    est = estimate_start(0, 0, [Running(2000, 100)], ahead, Waiting("mine", 1000, 60), 8000)
    assert est.start_s is None
    assert "secret" not in est.basis and "2nd" in est.basis, est.basis


def test_chunked_body_is_limited_too(env):
    """[medium, DoS] The body limit read only Content-Length: a chunked body (no Content-Length) of any size was
    read whole (forms and JSON)."""
    client = env["client"]

    def chunks():
        for _ in range(64):
            yield b"x" * 4096

    r = client.post("/api/v1/bursts/dry-run", content=chunks(),
                    headers={**_h(env, "alice"), "Content-Type": "application/json"})
    assert r.status_code == 413
    r = client.post("/login", content=chunks(), headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 413


def test_unknown_token_ids_are_not_remembered(env):
    """[medium, DoS] Every unknown token id an anonymous caller sent was cached forever (a dict growing without
    bound)."""
    cache = TokenCache(env["store"], ttl_s=60)
    for i in range(2000):
        cache.lookup(f"clp_{i:012x}_secret")
    assert len(cache._cache) <= 1024


def test_cookie_session_cannot_skip_csrf_with_another_authorization_scheme(env):
    """[low] POST /api/v1/bursts with the session cookie and any non-Bearer Authorization header (e.g. Basic)
    skipped the CSRF check."""
    client = _signed_in(env)
    r = client.post("/api/v1/bursts", json={"pool": POOL, "team": "vision", "chips": 4, **_window()},
                    headers={"Authorization": "Basic Zm9vOmJhcg=="})
    assert r.status_code == 403, r.text


def test_job_page_why_is_of_that_job_not_another_teams_namesake(env, tmp_path):
    """[high] Job ids are a scheduler's names, unique only within a pool: the job page read its row (the latest
    submission of that id) but its `why` from `reports.why.explain(job_id)`, which prefers any *pending* job of that
    id: a member whose job shares its id with another team's pending job in another pool read that team's pool,
    team, reason, Kueue message, queue position and decisions."""
    last = last_instant(env)
    later = last[:-3] + "59Z"
    h100 = "us-east1-a/h100-80gb"
    extra = [
        {"event_id": "dup-ads", "type": "job.submitted", "occurred_at": last, "pool": h100, "source": "cluster-a/kueue",
         "job_id": "train-1", "team": "ads-ml", "chips": 4096, "priority": 1000},
        {"event_id": "dup-vision", "type": "job.submitted", "occurred_at": later, "pool": POOL,
         "source": "cluster-c/kueue", "job_id": "train-1", "team": "vision", "chips": 1},
        {"event_id": "dup-vision-end", "type": "job.finished", "occurred_at": later, "pool": POOL,
         "source": "cluster-c/kueue", "job_id": "train-1", "outcome": "cancelled"},
    ]
    portal = portal_like(env, lake=lake_with(env, tmp_path, extra))
    snap = portal.reader.snapshot
    assert {r["team"] for r in snap.rows("SELECT team FROM pending WHERE job_id = 'train-1'")} == {"ads-ml"}
    client = client_of(portal)
    r = client.get("/api/v1/jobs/train-1", headers=_h(env, "alice"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["team"] == "vision" and body["pool"] == POOL
    why = json.dumps(body["why"]) + json.dumps(body["timeline"])
    assert "ads-ml" not in why and h100 not in why, body["why"]
    assert body["why"].get("team") in (None, "vision")
    page = client.get("/jobs/train-1", headers=_h(env, "alice"))
    assert page.status_code == 200 and "ads-ml" not in page.text and h100 not in page.text


def test_head_of_line_blockers_are_not_other_teams_job_ids(env):
    """[medium] `top_blockers` of a team's head-of-line row (API /api/v1/head-of-line and the queue page) listed the
    jobs that blocked its jobs: mostly other teams' jobs ahead in the queue, by id, whatever `[serve] visibility`
    (and /api/v1/jobs/{id} of each is 404 to the member)."""
    snap = env["portal"].reader.snapshot
    team_of = {r["job_id"]: r["team"] for r in snap.rows("SELECT job_id, team FROM portal_jobs")}
    client = env["client"]
    seen = 0
    # an admin's answer asked first (answers are kept with the snapshot per view): never what a member is given
    assert client.get("/api/v1/head-of-line", headers=_h(env, "root")).status_code == 200
    for user, team in (("alice", "vision"), ("eve", "ads-ml")):
        r = client.get("/api/v1/head-of-line", headers=_h(env, user))
        assert r.status_code == 200
        for row in r.json()["head_of_line"]:
            for b in (row["top_blockers"] or "").split(","):
                if b in team_of:
                    seen += 1
                    assert team_of[b] == team, (user, row)
        page = client.get(f"/teams/{team}/queue", headers=_h(env, user))
        assert page.status_code == 200
        for job_id, owner in team_of.items():
            if owner != team and job_id.startswith("job-"):
                assert f">{job_id}" not in page.text and f",{job_id}" not in page.text, (user, job_id)
    staff = client.get("/api/v1/head-of-line", headers=_h(env, "root")).json()["head_of_line"]
    assert any(row["top_blockers"] for row in staff)  # admins still see them all


def test_many_distinct_lookups_do_not_evict_the_warmed_queue(env, monkeypatch):
    """[medium, DoS] The snapshot's memo was cleared whole when 4096 answers were kept: any signed-in caller asking
    for 4096 distinct job ids (cheap 404s) also dropped the queue with its estimates, which the refresh computes once
    (seconds on a large lake), so every following queue read recomputed it."""
    import chipledger.web.app as web_app

    portal = env["portal"]
    snap = portal.reader.snapshot
    web_app.queue_all(snap)
    calls = []
    real = web_app._queue_compute
    monkeypatch.setattr(web_app, "_queue_compute", lambda s: calls.append(1) or real(s))
    for i in range(snap.MEMO_MAX + 10):
        snap.memo(("job", f"no-such-job-{i}"), lambda s: None)
    assert env["client"].get("/api/v1/queue", headers=_h(env, "alice")).status_code == 200
    assert calls == []


def test_event_stream_ends_when_its_token_is_revoked(env):
    """[low] GET /api/v1/snapshots (server-sent events) checked the token once: a stream opened before its token was
    revoked went on telling the lake's snapshots for ever."""
    import threading

    st = env["store"]
    token_id, token = new_token(st, "mallory", "vision")
    done = threading.Event()
    events = []

    def read():
        with env["client"].stream("GET", "/api/v1/snapshots", headers={"Authorization": f"Bearer {token}"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                events.append(line)
                if line.startswith("event:") and len([x for x in events if x.startswith("event:")]) == 1:
                    st.revoke_token(token_id, datetime.now(timezone.utc))
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(15), "the stream went on after its token was revoked"
    assert any(x.startswith("event: snapshot") for x in events)


def test_forged_cursors_are_400_not_500(env):
    """[low] A cursor is base64 JSON the caller can forge: one whose instant was not a time, or whose parts were not
    strings (a dict: unhashable as the memo's key), was a 500 Internal Server Error."""
    client = env["client"]
    for key in (["not a time", "x"], [{"a": 1}, [1, 2]], ["2026-11-02T00:00:00Z"], [1, 2], "x"):
        for path in ("/api/v1/teams/vision/jobs", "/api/v1/decisions",
                     "/api/v1/teams/vision/balances?since=2026-11-01T00:00:00Z"):
            sep = "&" if "?" in path else "?"
            r = client.get(f"{path}{sep}cursor={forged_cursor(key)}", headers=_h(env, "alice"))
            assert r.status_code == 400, (path, key, r.status_code)


def test_event_streams_per_caller_are_bounded(env):
    """[medium, DoS] GET /api/v1/snapshots (an endless stream) could be opened any number of times by one signed-in
    caller, each holding a connection and a task for ever; a caller now has at most MAX_STREAMS_PER_CALLER open."""
    from contextlib import ExitStack

    from chipledger.web.app import MAX_STREAMS_PER_CALLER

    client = env["client"]
    with ExitStack() as stack:
        for _ in range(MAX_STREAMS_PER_CALLER):
            r = stack.enter_context(client.stream("GET", "/api/v1/snapshots", headers=_h(env, "eve")))
            assert r.status_code == 200
        r = client.get("/api/v1/snapshots?once=true", headers=_h(env, "eve"))
        assert r.status_code == 429
        assert client.get("/api/v1/snapshots?once=true", headers=_h(env, "alice")).status_code == 200
    import time

    for _ in range(50):  # closed streams give their places back (as the server notices the disconnect)
        if client.get("/api/v1/snapshots?once=true", headers=_h(env, "eve")).status_code == 200:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("closed streams were still counted")


def test_a_page_read_during_a_refresh_names_and_uses_one_snapshot(env):
    """[low] A page read its data from the snapshot it took, but its footer named whatever snapshot was current when
    it rendered, and the burst form's dry run took the snapshot again: a refresh swapping in between made one page
    of two snapshots (half an update). Each page now reads and names one snapshot."""
    import dataclasses as dc

    portal = env["portal"]
    reader = portal.reader
    old = reader.snapshot
    newer = dc.replace(old, version=old.version + 1000, _memo={}, _pinned={})

    class Swapping:  # the refresh swaps `newer` in right after a route took its snapshot
        def __init__(self):
            self._snap = old
            self.last_error = None
            self.warm = None

        @property
        def snapshot(self):
            s, self._snap = self._snap, newer
            return s

    client = env["client"]
    for path in ("/teams/vision", "/teams/vision/queue", "/teams/vision/bursts", "/fleet", f"/jobs/{_vision_job(env)}"):
        portal.reader = Swapping()
        try:
            r = client.get(path, headers=_h(env, "alice"))
        finally:
            portal.reader = reader
        assert r.status_code == 200, path
        assert f"lake snapshot {old.version}," in r.text, path
    csrf = re.search(r'name="csrf" value="([^"]+)"', client.get("/teams/vision/bursts", headers=_h(env, "alice")).text)
    seen = []
    import chipledger.web.burst as burst_mod

    real = burst_mod.dry_run
    portal.reader = Swapping()
    try:
        burst_mod.dry_run = lambda snap, *a, **k: seen.append(snap) or real(old, *a, **k)
        r = client.post("/teams/vision/bursts", headers=_h(env, "alice"),
                        data={"pool": POOL, "chips": "4", "window_start": "2026-11-04T08:00",
                              "window_end": "2026-11-04T12:00", "action": "dry-run", "csrf": csrf.group(1)})
    finally:
        burst_mod.dry_run = real
        portal.reader = reader
    assert r.status_code == 200, r.text[:500]
    assert seen == [old] and f"lake snapshot {old.version}," in r.text


def test_any_name_the_ledger_accepts_has_its_pages(env):
    """[medium] Routes checked names against ASCII [A-Za-z0-9._/:@-]{1,128}, narrower than the events' names (1-256
    characters, any letters): the members of a team named with a space, an accent or more than 128 characters got 404
    on every page of their team and could not ask for a burst, and `serve tokens create --team` refused to make them
    a token; a job id with a slash (a Kubernetes namespace/name) could not be addressed at all. (Markup
    characters and `&`, refused here then, are names too: tests/test_web_names.py.)"""
    from urllib.parse import quote as q

    c = env["client"]
    for team in ("équipe ml", "x" * 200, "研究/视觉"):
        res = CliRunner().invoke(cli_app, ["serve", "tokens", "create", "--user", "zoé", "--team", team,
                                           "--store", env["store_url"]])
        assert res.exit_code == 0, res.output
        h = {"Authorization": f"Bearer {res.stdout.strip().splitlines()[-1]}"}
        assert c.get(f"/api/v1/teams/{q(team, safe='/')}/balances", headers=h).status_code == 200, team
        assert c.get(f"/teams/{q(team, safe='/')}/queue", headers=h).status_code == 200, team
        r = c.post("/api/v1/bursts/dry-run", headers=h, json={"pool": POOL, "team": team, "chips": 1, **_window()})
        assert r.status_code == 200, (team, r.text)
        assert c.get(f"/api/v1/teams/{q(team, safe='/')}/balances", headers=_h(env, "alice")).status_code == 404
    r = c.get("/api/v1/jobs/research%2Ftrain-1", headers=_h(env, "alice"))
    assert r.status_code == 404 and r.json()["detail"] == "no such job"  # the route's answer, not "Not Found"
    assert c.get("/api/v1/teams/vision%0A/balances", headers=_h(env, "root")).status_code == 404
    assert c.get("/api/v1/teams/%3Cscript%3E/balances", headers=_h(env, "root")).status_code == 404


def test_a_team_admin_is_not_a_fleet_admin(env):
    """[high] `[serve] members` `carol=vision:admin` (an admin of one team) gave carol the role `admin` outright:
    she read every team's balances, jobs, statements and bursts and could ask for bursts for any team, as if she
    were `carol=*:admin`."""
    client = env["client"]
    h = _h(env, "carol")
    assert client.get("/api/v1/teams/vision/balances", headers=h).status_code == 200
    assert client.get("/api/v1/teams/ads-ml/balances", headers=h).status_code == 404
    assert client.get("/teams/ads-ml", headers=h).status_code == 404
    r = client.post("/api/v1/bursts/dry-run", headers=h, json={"pool": POOL, "team": "ads-ml", "chips": 1, **_window()})
    assert r.status_code == 404
    assert client.get("/api/v1/teams/ads-ml/balances", headers=_h(env, "root")).status_code == 200


def test_costs_and_budgets_equal_chipledger_sql(env):
    c = env["client"]
    costs = c.get("/api/v1/teams/vision/costs", headers=_h(env, "alice")).json()
    assert costs["priced"], "the demo has prices"
    start, end = costs["period_start"], costs["period_end"]
    want = _sql(env, f"""
        SELECT c.pool, c.unit, round(sum(c.cost_scaled::HUGEINT) / 3600000.0, 6) AS total,
               round(sum(c.cost_scaled::HUGEINT) FILTER (WHERE c.account = 'borrowed') / 3600000.0, 6) AS borrowed
        FROM cost_postings c WHERE c.team = 'vision' AND c.hour >= '{start}'::TIMESTAMPTZ
             AND c.hour < '{end}'::TIMESTAMPTZ GROUP BY ALL ORDER BY ALL""")
    assert [(r["pool"], r["unit"], r["total_units"], r["borrowed_units"]) for r in costs["by_pool"]] == \
        [(r["pool"], r["unit"], r["total"], r["borrowed"] or 0) for r in want]
    # totals per unit only: one row per unit, each the sum of that unit's pools
    units = {r["unit"] for r in want}
    assert sorted(t["unit"] for t in costs["totals"]) == sorted(units)
    for t in costs["totals"]:
        assert t["total_units"] == pytest.approx(sum(r["total"] for r in want if r["unit"] == t["unit"]), abs=1e-5)

    budgets = c.get("/api/v1/teams/vision/budgets", headers=_h(env, "alice")).json()["budgets"]
    want = _sql(env, f"""
        SELECT period, unit, budget, round(spent, 6) AS spent, round("left", 6) AS "left",
               round(forecast_end, 6) AS forecast_end FROM budget
        WHERE team = 'vision' AND period_start < '{end}'::TIMESTAMPTZ AND period_end > '{start}'::TIMESTAMPTZ
        ORDER BY ALL""")
    assert want, "the demo has budgets"
    assert [(b["period"], b["unit"], b["budget_units"], b["spent_units"], b["left_units"], b["forecast_end_units"])
            for b in budgets] == [(r["period"], r["unit"], r["budget"], r["spent"], r["left"], r["forecast_end"])
                                  for r in want]
    assert all(b["sentence"].startswith("Of your ") for b in budgets)

    pools = c.get("/api/v1/pool-costs", headers=_h(env, "root")).json()["pool_costs"]
    want = _sql(env, f"""
        SELECT pool, unit,
               round(coalesce(sum(cost_scaled::HUGEINT) FILTER (WHERE account = 'idle'), 0) / 3600000.0, 6) AS idle
        FROM cost_postings WHERE hour >= '{start}'::TIMESTAMPTZ AND hour < '{end}'::TIMESTAMPTZ
        GROUP BY ALL ORDER BY ALL""")
    assert [(r["pool"], r["unit"], r["idle_units"]) for r in pools] == [(r["pool"], r["unit"], r["idle"]) for r in want]

    # the pages show the same numbers, and no sum across units
    home = c.get("/teams/vision", headers=_h(env, "alice")).text
    assert 'id="costs"' in home and "no price set" not in home
    for t in costs["totals"]:
        assert f"{t['total_units']:,.2f}" in home
    for b in budgets:
        assert f"{b['left_units']:,.2f}" in home
    fleet = c.get("/fleet", headers=_h(env, "root")).text
    assert 'id="pool-costs"' in fleet
    for r in pools:
        assert f"{r['idle_units']:,.2f}" in fleet


def test_a_lake_without_prices_shows_no_cost(env, tmp_path):
    events = tmp_path / "events.jsonl"
    events.write_text("".join(line + "\n" for line in env["events"].read_text().splitlines()
                              if '"type":"price.set"' not in line.replace(" ", "")
                              and '"type":"budget.set"' not in line.replace(" ", "")))
    lake = tmp_path / "lake"
    chipledger_run(events, lake)
    c = client_of(portal_like(env, lake=lake))
    costs = c.get("/api/v1/teams/vision/costs", headers=_h(env, "alice")).json()
    assert (costs["priced"], costs["by_pool"], costs["totals"]) == (False, [], [])
    assert c.get("/api/v1/teams/vision/budgets", headers=_h(env, "alice")).json()["budgets"] == []
    assert c.get("/api/v1/pool-costs", headers=_h(env, "root")).json()["pool_costs"] == []
    home = c.get("/teams/vision", headers=_h(env, "alice")).text
    assert "no price set" in home and 'id="costs"' not in home
    assert "no price set" in c.get("/fleet", headers=_h(env, "root")).text


MEMBERS = {"alice": "vision", "eve": "ads-ml"}


def _what_a_member_reads_of_decisions(env, c, user: str) -> list[tuple[str, str]]:
    """Every response a member gets that shows decisions involving their team: the decisions (whole, and page by
    page: the cursors too), the API and page of each of their jobs a decision names, their queue, home and bursts."""
    team = MEMBERS[user]
    h = _h(env, user)
    out = []
    r = c.get("/api/v1/decisions?limit=1000", headers=h)
    assert r.status_code == 200
    out.append(("decisions", r.text))
    cursor = None
    while True:
        r = c.get("/api/v1/decisions?limit=1" + (f"&cursor={cursor}" if cursor else ""), headers=h).json()
        cursor = r["next_cursor"]
        if not cursor:
            break
        out.append(("cursor", base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()))
    jobs = _sql(env, "SELECT job_id FROM decision_victims WHERE team = '%s' UNION "
                     "SELECT beneficiary_job_id FROM decisions WHERE team = '%s' AND beneficiary_job_id IS NOT NULL"
                % (team, team))
    assert jobs, "the lake has decisions naming this team"
    for j in jobs:
        for path in (f"/api/v1/jobs/{j['job_id']}", f"/jobs/{j['job_id']}"):
            r = c.get(path, headers=h)
            assert r.status_code == 200, path
            out.append((path, r.text))
    for path in (f"/api/v1/queue?team={team}", f"/teams/{team}/queue", f"/teams/{team}",
                 f"/api/v1/teams/{team}/bursts", f"/teams/{team}/bursts", f"/teams/{team}/statements"):
        r = c.get(path, headers=h)
        assert r.status_code == 200, path
        out.append((path, r.text))
    # their statements, every format (a statement lists who preempted their jobs)
    issued = c.get(f"/api/v1/teams/{team}/statements", headers=h).json()["statements"]
    assert issued and {"json", "md", "html", "csv"} <= set(issued[0]["formats"])
    for st in issued:
        for fmt, url in st["downloads"].items():
            r = c.get(url, headers=h)
            assert r.status_code == 200, url
            out.append((url, r.text))
    return out


@pytest.mark.parametrize("user", sorted(MEMBERS))
def test_a_member_never_reads_another_teams_name_in_decisions_with_visibility_team(env, user):
    """The ledger's sentences name every team a decision touches (`… fits team vision's unused quota …; preempt 1
    job(s) of borrowing team(s) ads-ml …`). With `[serve] visibility = team`, the beneficiary's team (alice) and the
    victims' (eve) read each other as "another team", in every field, page and cursor; the other's job ids and the
    decision's id (it carries the beneficiary's job id) as `(hidden)` and an alias. An admin reads it all as written."""
    import html

    c = _decision_views(env, "team")
    others = {r["team"] for r in _sql(env, "SELECT team FROM jobs UNION SELECT team FROM balance_log")} - \
        {MEMBERS[user]}
    involved = _sql(env, "SELECT d.decision_id, d.team, d.beneficiary_job_id, v.job_id AS victim, v.team AS vteam "
                         "FROM decisions d JOIN decision_victims v USING (decision_id) WHERE d.team <> v.team")
    assert any(MEMBERS[user] in (r["team"], r["vteam"]) for r in involved), "a decision between two teams"
    hidden_jobs = {r["beneficiary_job_id"] for r in involved if r["team"] != MEMBERS[user]} | \
        {r["victim"] for r in involved if r["vteam"] != MEMBERS[user]}
    hidden_ids = {r["decision_id"] for r in involved}
    for where, text in _what_a_member_reads_of_decisions(env, c, user):
        for secret in sorted(others | hidden_jobs | hidden_ids):
            assert secret not in text and html.escape(secret) not in text, (where, secret)
    decisions = c.get("/api/v1/decisions?limit=1000", headers=_h(env, user)).json()["decisions"]
    mixed = [d for d in decisions if d["decision_id"].startswith("hidden-")]
    assert mixed and all("another team" in d["message"] for d in mixed)
    # the control: an admin reads the ledger's own sentence, every name in it, and the statement as issued
    staff = c.get("/api/v1/decisions?limit=1000", headers=_h(env, "root")).text
    assert all(i in staff for i in hidden_ids) and "ads-ml" in staff and "vision" in staff
    issued = c.get("/api/v1/statements/ads-ml@2026-11-02..2026-11-02/md", headers=_h(env, "root")).text
    assert "vision" in issued and any(i in issued for i in hidden_ids)


def test_with_visibility_fleet_a_member_reads_team_names_but_not_other_teams_job_ids(env):
    c = _decision_views(env, "fleet")
    involved = _sql(env, "SELECT d.decision_id, d.team, d.beneficiary_job_id, v.team AS vteam "
                         "FROM decisions d JOIN decision_victims v USING (decision_id) WHERE d.team <> v.team")
    victim_side = [r for r in involved if r["vteam"] == "ads-ml"]
    assert victim_side
    texts = _what_a_member_reads_of_decisions(env, c, "eve")
    everything = "\n".join(t for _, t in texts)
    for r in victim_side:
        assert r["beneficiary_job_id"] not in everything and r["decision_id"] not in everything
        assert r["team"] in everything  # the team's name: visibility fleet shows it
    # the alias is one per decision: the job page's "preempted by decision …" and the decisions list agree
    listed = {d["decision_id"] for d in c.get("/api/v1/decisions?limit=1000", headers=_h(env, "eve")).json()
              ["decisions"]}
    shown = set(re.findall(r"hidden-[0-9a-f]{24}", everything))
    assert shown and shown <= listed


def test_decision_cursors_page_through_aliases(env):
    c = _decision_views(env, "team")
    h = _h(env, "eve")
    everything = [d["decision_id"] for d in c.get("/api/v1/decisions?limit=1000", headers=h).json()["decisions"]]
    seen = decision_ids_page_by_page(c, h)
    assert seen == everything and any(s.startswith("hidden-") for s in seen)
    forged = forged_cursor(["2026-11-02T15:52:53Z", "hidden-" + "0" * 24])
    assert c.get(f"/api/v1/decisions?cursor={forged}", headers=h).status_code == 400


def test_with_visibility_team_no_route_or_page_names_another_team_to_a_member(env):
    """The authorization matrix's routes and pages, as vision's member with `[serve] visibility = team`: not one
    response (whatever its status) has another team's name in it, raw or HTML-escaped."""
    import html

    c = _decision_views(env, "team")
    others = {r["team"] for r in _sql(env, "SELECT team FROM jobs UNION SELECT team FROM balance_log")} - {"vision"}
    assert len(others) >= 5
    seen = []
    for route, (method, path, body) in api_requests(env).items():
        seen.append((route, c.request(method, path, json=body, headers=_h(env, "alice"))))
    for page in PAGES:
        path = f"/jobs/{_vision_job(env)}" if page == "JOB" else page
        seen.append((path, c.get(path, headers=_h(env, "alice"))))
    assert sum(r.status_code == 200 for _, r in seen) >= len(seen) - 3  # the fleet page, pool costs, no Kafka
    leaks = [(where, t) for where, r in seen for t in others if t in r.text or html.escape(t) in r.text]
    assert leaks == []


def test_home_page_lists_the_fleet_slos_and_those_of_the_teams_pools(env):
    """The home page's SLO table: the fleet's rows and the rows of each pool the team has a balance in, as the API
    gives them (the template tests a set of the team's pools instead of filtering the balances once per row). A team
    with balances in two of the three pools, so the third pool's rows must be left out."""
    c = env["client"]
    team = "recsys"
    balances = c.get(f"/api/v1/teams/{team}/balances", headers=_h(env, "root")).json()["balances"]
    mine = {b["pool"] for b in balances}
    slos = c.get("/api/v1/slos", headers=_h(env, "root")).json()["slos"]
    assert 0 < len(mine) < len({r["pool"] for r in slos if r["pool"]})
    want = [(r["slo"], r["pool"] or "fleet") for r in slos if r["pool"] is None or r["pool"] in mine]
    assert any(p != "fleet" for _, p in want) and len(want) < len(slos)
    home = c.get(f"/teams/{team}", headers=_h(env, "root"))
    assert home.status_code == 200
    table = home.text[home.text.index('<table id="slos">'):]
    table = table[:table.index("</table>")]
    assert re.findall(r"<tr><td>([^<]*)</td><td>([^<]*)</td>", table) == want


def test_a_decisions_page_kept_for_one_caller_is_never_served_to_another_who_may_read_less(env, monkeypatch):
    """The decisions page is kept with the snapshot per view (staff, the caller's teams, whether they see the fleet's
    names): an admin's page, asked first, is not what a member then reads, nor one member's what another's reads; the
    same view asking again is served the kept page."""
    import html

    import chipledger.web.app as web_app

    c = _decision_views(env, "team")
    url = "/api/v1/decisions?limit=1000"
    staff = c.get(url, headers=_h(env, "root"))
    assert staff.status_code == 200 and "ads-ml" in staff.text and "vision" in staff.text
    for user, team in MEMBERS.items():
        others = {r["team"] for r in _sql(env, "SELECT team FROM jobs UNION SELECT team FROM balance_log")} - {team}
        got = c.get(url, headers=_h(env, user))
        assert got.status_code == 200
        assert not [t for t in others if t in got.text or html.escape(t) in got.text], user
    calls = []
    real = web_app.View.decision_id
    monkeypatch.setattr(web_app.View, "decision_id", lambda self, *a: calls.append(1) or real(self, *a))
    again = c.get(url, headers=_h(env, "alice"))
    assert again.status_code == 200 and calls == []  # kept: not redacted again
