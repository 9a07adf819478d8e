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
        def row(self, token_id, query=True):
            return object()

    monkeypatch.setattr(Sessions, "MAX_SESSIONS", 50)
    sessions = Sessions(Tokens(), max_age_s=3600)
    cookies = [sessions.start("t") for _ in range(500)]
    assert len(sessions) <= 50
    assert sessions.lookup(cookies[-1]) is not None and sessions.lookup(cookies[0]) is None
    assert sessions.end(cookies[-1]) and sessions.lookup(cookies[-1]) is None


def test_unknown_token_ids_are_kept_apart_and_bounded(monkeypatch):
    """Token ids the store does not know are remembered (each would cost a store query again), in a table of their
    own: any number of them never pushes out the known tokens, and what is kept stays bounded."""
    from types import SimpleNamespace

    from chipledger.web.auth import NeedStore, TokenCache

    class Store:
        def __init__(self):
            self.queries = 0

        def token(self, token_id):
            self.queries += 1
            return SimpleNamespace(token_id=token_id, revoked_at=None) if token_id == "known" else None

    monkeypatch.setattr(TokenCache, "MAX_ENTRIES", 100)
    store = Store()
    tokens = TokenCache(store, ttl_s=3600)
    assert tokens.row("known") is not None
    for i in range(1000):
        assert tokens.row(f"made-up-{i}") is None
    assert tokens.row("made-up-999") is None and store.queries == 1001  # remembered
    assert len(tokens._unknown) <= 100 and tokens.row("known", query=False) is not None  # still kept
    try:
        tokens.row("never-seen", query=False)
        raise AssertionError("a lookup told not to query asked the store")
    except NeedStore:
        pass
    assert store.queries == 1001
