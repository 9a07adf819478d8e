"""Sessions kept in the store (chipledger/web/auth.py `Sessions`), as an attacker and an operator meet them: a
session a portal wrote before a restart ends by the `[serve] session_hours` of the portal that reads it."""

import hashlib
import json
from datetime import datetime, timedelta, timezone

from markupsafe import escape

from store.models import PortalSession
from web_support import client_of, env, portal_config, portal_like  # noqa: F401 (env: the module's fixture)


def _stored_session(env, cookie: str, started: datetime, hours: float) -> None:
    env["store"].start_session(PortalSession(
        session_sha256=hashlib.sha256(cookie.encode()).hexdigest(), token_id=env["tokens"]["alice"][0],
        started_at=started, expires_at=started + timedelta(hours=hours)), keep_per_token=16)


def test_lowering_session_hours_ends_the_sessions_started_before_the_restart(env):
    """An operator lowers `[serve] session_hours` (24 -> 1) and restarts the portal: a session signed in 2 hours
    before, under the old setting, is over (before sessions were kept in the store, a restart ended it anyway); a
    session signed in 10 minutes before still holds."""
    now = datetime.now(timezone.utc)
    old, recent = "cls_" + "a" * 43, "cls_" + "b" * 43
    _stored_session(env, old, now - timedelta(hours=2), 24)
    _stored_session(env, recent, now - timedelta(minutes=10), 24)
    restarted = portal_like(env, cfg=portal_config(session_hours=1))
    for cookie, status in ((old, 401), (recent, 200)):
        c = client_of(restarted)
        c.cookies.set("clp_session", cookie)
        assert c.get("/api/v1/whoami").status_code == status, cookie
        page = c.get("/teams/vision", follow_redirects=False)
        assert page.status_code == (200 if status == 200 else 303), cookie


def test_made_up_cookies_and_tokens_ask_the_store_no_more_than_the_address_may_ask(env):
    """An anonymous caller sends made-up session cookies (and made-up tokens), each one never seen: each costs the
    portal a store query to learn it is nobody's. Beyond its address's `[serve] requests_per_minute` the caller is
    refused (429), and the store is not asked any more: the queries are bounded by the limit, not by how fast the
    caller sends. A user whose token the portal has seen is not affected, at that address too (their own bucket); a
    user at another address is not either."""
    portal = portal_like(env, cfg=portal_config(requests_per_minute=5))
    store = portal.store
    asked = []
    for name in ("session", "token"):  # the real store's lookups, counted
        real = getattr(store, name)
        setattr(store, name, lambda key, real=real, name=name: asked.append(name) or real(key))
    try:
        c = client_of(portal)
        b = client_of(portal)  # the same address, without cookies: the bearer tokens' requests
        eve = {"Authorization": f"Bearer {env['tokens']['eve'][1]}"}
        assert b.get("/api/v1/whoami", headers=eve).status_code == 200
        asked.clear()
        statuses = []
        for i in range(40):
            c.cookies.set("clp_session", f"cls_madeup{i:040d}")
            statuses.append(c.get("/api/v1/whoami").status_code)
            statuses.append(b.get("/api/v1/whoami", headers={"Authorization": f"Bearer clp_{i:012x}_x"}).status_code)
        assert statuses[:5] == [401] * 5 and set(statuses[5:]) == {429}
        assert len(asked) <= 5, asked
        assert b.get("/api/v1/whoami", headers=eve).status_code == 200
    finally:
        for name in ("session", "token"):
            del store.__dict__[name]
    from fastapi.testclient import TestClient

    from chipledger.web.app import build_app

    alice = TestClient(build_app(portal), client=("10.0.0.7", 50000))
    assert alice.get("/api/v1/whoami", headers={"Authorization": f"Bearer {env['tokens']['alice'][1]}"}).status_code \
        == 200


def test_a_schedulers_message_hides_another_teams_job_id_that_holds_blanks_or_quotes(env, tmp_path):
    """Job ids may hold blanks, quotes, brackets and commas (schemas.events.Name: no control characters): a
    scheduler's message on a vision job that names ads-ml's job `ads ranker 7` (or `ads'7`, `ads,8`) shows a vision
    member `(hidden)` for it, in the job's `why` and timeline, API and page, as for an id without such characters;
    and an id inside a run of characters no id boundary splits (`job=adsq-9`, `«adsq-10»`) too."""
    from web_support import lake_with, last_instant

    at, pool = last_instant(env), "us-west4-a/tpu-v5e"
    hidden = ["ads ranker 7", "ads'7", "ads,8", "adsq-9", "adsq-10"]
    extra = [{"event_id": f"rv-ads-{i}", "type": "job.submitted", "occurred_at": at, "pool": pool,
              "source": "cluster-c/kueue", "job_id": j, "team": "ads-ml", "chips": 1000}
             for i, j in enumerate(hidden)]
    extra.append({"event_id": "rv-vis", "type": "job.submitted", "occurred_at": at, "pool": pool,
                  "source": "cluster-c/kueue", "job_id": "vision-rv-1", "team": "vision", "chips": 1000})
    message = ("Kueue: waiting for ads ranker 7 to finish, then ads'7 and ads,8, job=adsq-9, «adsq-10»; "
               "vision-rv-1 is next.")
    extra.append({"event_id": "rv-waiting", "type": "job.waiting", "occurred_at": at, "pool": pool,
                  "source": "cluster-c/kueue", "job_id": "vision-rv-1", "reason": "Pending", "message": message})
    c = client_of(portal_like(env, lake=lake_with(env, tmp_path, extra)))
    alice = {"Authorization": f"Bearer {env['tokens']['alice'][1]}"}
    job = c.get("/api/v1/jobs/vision-rv-1", headers=alice).json()
    page = c.get("/jobs/vision-rv-1", headers=alice).text
    for j in hidden:
        assert j not in json.dumps(job["why"]) and j not in json.dumps(job["timeline"]), j
        assert str(escape(j)) not in page, j
    assert "vision-rv-1 is next" in job["why"]["scheduler_message"]
    root = c.get("/api/v1/jobs/vision-rv-1", headers={"Authorization": f"Bearer {env['tokens']['root'][1]}"}).json()
    assert root["why"]["scheduler_message"] == message


def test_a_session_signed_out_while_another_request_reads_it_from_the_store_stays_ended(env):
    """Sign-out on one replica while a request with a copy of the same cookie is in the middle of its store lookup:
    that request read the row before sign-out deleted it, and must not put the session back in the portal's memory
    (a copy replayed right after would be accepted until the next check)."""
    import threading

    from chipledger.web.auth import Sessions

    portal = portal_like(env)
    sessions: Sessions = portal.sessions
    sessions.ttl_s = 60.0  # (a replica trusts what it keeps this long; the tests' portals ask the store each time)
    cookie = sessions.start(env["tokens"]["alice"][0])
    sid = sessions._id(cookie)
    sessions._forget(sid)  # (as after a restart: the session is in the store only)
    store, real = sessions.store, sessions.store.session
    read, signed_out = threading.Event(), threading.Event()

    def slow_session(key):  # the real store's row, then the answer held until sign-out is over
        row = real(key)
        read.set()
        signed_out.wait(10)
        return row

    store.session = slow_session
    try:
        seen = []
        t = threading.Thread(target=lambda: seen.append(sessions.lookup(cookie)))
        t.start()
        assert read.wait(10)
        assert sessions.end(cookie)
        signed_out.set()
        t.join(10)
    finally:
        store.session = real
    assert sessions.lookup(cookie) is None
    c = client_of(portal)
    c.cookies.set("clp_session", cookie)
    assert c.get("/api/v1/whoami").status_code == 401


def test_a_form_rendered_before_a_restart_is_accepted_after_it_and_by_another_replica(env):
    """The forms' CSRF key and the aliases' key are kept in the store (`portal_keys`): a bursts page rendered by one
    portal, then posted to a restarted portal (or another replica on the same store), is accepted; a forged token is
    still refused; both show another team's hidden decision ids under the same aliases."""
    import re

    from web_support import signed_in

    c = signed_in(env)
    page = c.get("/teams/vision/bursts")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    form = {"pool": "a100", "chips": "2", "window_start": "2026-11-04T10:00", "window_end": "2026-11-04T12:00",
            "action": "dry-run"}
    restarted = portal_like(env)
    assert restarted.csrf.key == env["portal"].csrf.key and restarted.alias_key == env["portal"].alias_key
    other = client_of(restarted)
    other.cookies.set("clp_session", c.cookies.get("clp_session"))
    assert other.post("/teams/vision/bursts", data={**form, "csrf": "forged"}).status_code == 403
    accepted = other.post("/teams/vision/bursts", data={**form, "csrf": csrf})
    assert accepted.status_code in (200, 400) and "CSRF token is missing or wrong" not in accepted.text
    # a portal without a store makes its own keys
    from web_support import make_portal

    alone = make_portal(None, env["portal"].reader)
    assert alone.csrf.key != env["portal"].csrf.key and len(alone.alias_key) == 32


def test_a_store_that_fails_is_a_503_that_says_so(env, tmp_path):
    """The store failing under a request (here its sessions table gone; a database down in production): the caller
    gets 503 saying the store is not answering, with Retry-After and the security headers, on a page and on the API,
    not a bare 500; what the driver said stays in the server's log."""
    import shutil

    import sqlalchemy as sa

    from store.repo import open_store

    db = tmp_path / "copy.db"
    shutil.copy(env["store"].engine.url.database, db)
    store = open_store(f"sqlite:///{db}")
    portal = portal_like(env)
    portal.store = portal.sessions.store = portal.tokens.store = store
    with store.engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE portal_sessions"))
    from fastapi.testclient import TestClient

    from chipledger.web.app import build_app

    c = TestClient(build_app(portal), raise_server_exceptions=False)  # (as a server: the error logged, not raised)
    c.cookies.set("clp_session", "cls_" + "z" * 43)  # never seen: looked up in the store
    for path in ("/api/v1/whoami", "/teams/vision"):
        r = c.get(path, follow_redirects=False)
        assert r.status_code == 503, (path, r.status_code)
        assert "store is not answering" in r.text and "portal_sessions" not in r.text
        assert r.headers["retry-after"] == "5" and "default-src" in r.headers["content-security-policy"]
