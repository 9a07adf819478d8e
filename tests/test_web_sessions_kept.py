"""Sessions kept in the store (chipledger/web/auth.py `Sessions`), as an attacker and an operator meet them: a
session a portal wrote before a restart ends by the `[serve] session_hours` of the portal that reads it."""

import hashlib
from datetime import datetime, timedelta, timezone

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
