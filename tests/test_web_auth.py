"""The portal's rate limiter and sessions (chipledger/web/auth.py) on their own: what they keep stays bounded
whatever callers send. Their behaviour over HTTP is in tests/test_web.py (429s, sign-out, revocation)."""

from __future__ import annotations


def test_the_rate_limiters_and_sessions_memory_is_bounded(monkeypatch):
    """Anyone may send requests from any number of addresses, and sign in any number of times: the buckets and the
    sessions kept stay bounded, and what is forgotten is what was as good as new (a full bucket) or the oldest."""
    from chipledger.web.auth import RateLimiter, Sessions

    monkeypatch.setattr(RateLimiter, "MAX_KEYS", 100)
    lim = RateLimiter(60)
    for _ in range(60):
        lim.allow("busy")
    for i in range(1000):
        lim.allow(f"addr:{i}")
    assert len(lim._buckets) <= 100
    assert lim.wait_s("busy") > 0  # the busy caller's empty bucket was not forgotten (that would refill it)

    class Tokens:
        def row(self, token_id):
            return object()

    monkeypatch.setattr(Sessions, "MAX_SESSIONS", 50)
    sessions = Sessions(Tokens(), max_age_s=3600)
    cookies = [sessions.start("t") for _ in range(500)]
    assert len(sessions) <= 50
    assert sessions.lookup(cookies[-1]) is not None and sessions.lookup(cookies[0]) is None
    assert sessions.end(cookies[-1]) and sessions.lookup(cookies[-1]) is None
