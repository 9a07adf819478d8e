"""Who is asking, and what they may see: API tokens, a trusted proxy's user header, roles from `[serve]` config.

- A token is `clp_<id>_<secret>`; the store keeps its id, user, team and the SHA-256 of the secret (`ApiToken`),
  never the secret. It is sent as `Authorization: Bearer …` (the API).
- Signing in on /login with a token starts a **session** (`Sessions`): the `clp_session` cookie (HttpOnly,
  SameSite=Strict) holds a fresh random session id, never the token. Signing out ends the session here, on the
  server: the cookie replayed afterwards is refused. A session also ends when its token is revoked, after
  `[serve] session_hours`; it outlives a restart (sessions are kept in the store, hashed: `Sessions`).
- Behind an authenticating proxy, a request *from one of `[serve] trusted_proxies`* names its user in
  `[serve] user_header` (and groups in `groups_header`); the same headers from anyone else are ignored.
- Roles come from `[serve] members` (`NAME=TEAM:ROLE`, NAME a user or `group:G`): member of a team, admin or sre
  (TEAM `*`). A token's team makes its user a member of that team too.

What each role may do is decided in one place, `Principal` (`can_read_team`, `can_request_burst`, `sees_fleet`):
routes ask it, and a team they may not read is answered 404 as if it did not exist.

Every request is rate limited (`RateLimiter`, a token bucket per key): per principal (`Principal.limit_key`: the
user), else per client address; writes and dry runs have their own, smaller buckets.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Optional

from chipledger.config import ServeConfig

TOKEN_PREFIX = "clp_"


def hash_secret(secret: str) -> str:
    # tokens are 256-bit random: a plain SHA-256 is enough (no password stretching needed for such entropy)
    return hashlib.sha256(secret.encode()).hexdigest()


def new_token(store, user: str, team: Optional[str]) -> tuple[str, str]:
    """Create a token for `user` (acting for `team`); returns (token id, the token: shown once)."""
    from store.models import ApiToken

    token_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    store.add_token(ApiToken(token_id=token_id, user=user, team=team, secret_sha256=hash_secret(secret),
                             created_at=datetime.now(timezone.utc)))
    return token_id, f"{TOKEN_PREFIX}{token_id}_{secret}"


@dataclass(frozen=True)
class Principal:
    user: str
    via: str                                   # token | proxy
    teams: frozenset[str] = frozenset()        # teams they are a member of
    roles: frozenset[str] = frozenset()        # member, admin, sre
    visibility: str = "fleet"
    token_id: Optional[str] = None
    session_id: Optional[str] = None           # the signed-in session's id hash (via = session)

    @property
    def is_admin(self) -> bool:
        return "admin" in self.roles

    @property
    def is_staff(self) -> bool:                # admins and SREs see every team
        return bool(self.roles & {"admin", "sre"})

    def can_read_team(self, team: str) -> bool:
        return self.is_staff or team in self.teams

    def can_request_burst(self, team: str) -> bool:
        return self.is_admin or team in self.teams

    @property
    def sees_fleet(self) -> bool:
        """Other teams' balances and names, the fleet page: staff always, members when visibility is fleet."""
        return self.is_staff or self.visibility == "fleet"

    @property
    def view_key(self) -> tuple:
        """All that what a caller may read depends on (`can_read_team`, `sees_fleet`, the redaction of chipledger.web.
        redact): an answer kept per view is keyed by it, so one caller's is never given to another who may read less."""
        return (self.is_staff, self.teams, self.sees_fleet)

    @property
    def home_team(self) -> Optional[str]:
        return min(self.teams) if self.teams else None

    def session_key(self) -> str:
        """What the CSRF tokens and the open event streams are bound to: a session (a new sign-in, new CSRF
        tokens), else the token, else the proxy's user."""
        return f"{self.via}:{self.session_id or self.token_id or self.user}"

    @property
    def limit_key(self) -> str:
        """Whose bucket a request takes from: the user, however they authenticated (two tokens or sessions of one
        user share it)."""
        return f"user:{self.user}"


def principal_for(cfg: ServeConfig, user: str, groups: list[str], via: str, token_team: Optional[str] = None,
                  token_id: Optional[str] = None, session_id: Optional[str] = None) -> Principal:
    members = cfg.memberships()
    teams: set[str] = set()
    roles: set[str] = set()
    # users and groups share `members`' namespace: a user's own name never counts as a group's (a user named
    # `group:oncall` is not in the oncall group; only the groups header says who is)
    own = [] if user.startswith("group:") else [user]
    for name in [*own, *(f"group:{g}" for g in groups)]:
        for team, role in members.get(name, ()):
            if team == "*":
                roles.add(role)     # admin or sre of the fleet (a member of every team: as good as an sre)
            else:
                # of one team, whatever the role: a member of it; never an admin or SRE of the fleet (`admin` and
                # `sre` roles make `is_staff`, which reads every team)
                teams.add(team)
                roles.add("member")
    if token_team:
        teams.add(token_team)
        roles.add("member")
    return Principal(user=user, via=via, teams=frozenset(teams), roles=frozenset(roles), visibility=cfg.visibility,
                     token_id=token_id, session_id=session_id)


class NeedStore(Exception):
    """Raised instead of a store query by a lookup told not to query (`query=False`). `known`: the token or session
    was found before (kept, only for longer than `ttl_s`), not one never seen (which anyone may make up)."""

    def __init__(self, key: str, known: bool = False):
        super().__init__(key)
        self.known = known


class TokenCache:
    """Tokens looked up in the store, kept for a few seconds (a revoked token stops working within `ttl_s`)."""

    MAX_ENTRIES = 1024

    def __init__(self, store, ttl_s: float = 2.0):
        self.store = store
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, object]] = {}
        self._unknown: dict[str, tuple[float, None]] = {}  # ids the store does not know, as long as known ones

    def lookup(self, token: str, query: bool = True):
        """The token's row when the token is valid and not revoked, else None. `query` False: raises NeedStore
        instead of asking the store (the event loop's callers: a store query blocks every request)."""
        if not token.startswith(TOKEN_PREFIX) or self.store is None:
            return None
        token_id, sep, secret = token[len(TOKEN_PREFIX):].partition("_")
        if not sep or not token_id or not secret or len(token) > 200:
            return None
        row = self.row(token_id, query)
        if row is None or not hmac.compare_digest(row.secret_sha256, hash_secret(secret)):
            return None
        return row

    def row(self, token_id: str, query: bool = True):
        """The token's row by its id when it is not revoked (a session holds the id of the token it was started
        with, not its secret), else None. `query` False: raises NeedStore when the answer is not kept."""
        if self.store is None:
            return None
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(token_id) or self._unknown.get(token_id)
        if hit is not None and now - hit[0] < self.ttl_s:
            row = hit[1]
        elif not query:
            raise NeedStore(token_id, known=hit is not None and hit[1] is not None)
        else:
            row = self.store.token(token_id)
            with self._lock:
                # unknown ids apart, in a table of their own: anyone may send any number of them, and filling it
                # forgets only them (each then costs a query again), never the known tokens
                kept = self._cache if row is not None else self._unknown
                (self._unknown if row is not None else self._cache).pop(token_id, None)
                if len(kept) >= self.MAX_ENTRIES:
                    kept.clear()
                kept[token_id] = (now, row)
        if row is None or row.revoked_at is not None:
            return None
        return row

    def forget(self, token_id: str) -> None:
        with self._lock:
            self._cache.pop(token_id, None)
            self._unknown.pop(token_id, None)


class RateLimiter:
    """A token bucket per key: `per_minute` requests, refilled continuously (a caller may spend a minute's worth at
    once, then one every 60/per_minute s). `per_minute` 0: no limit."""

    MAX_KEYS = 100_000  # beyond it, the buckets that have refilled (as good as new) are forgotten

    def __init__(self, per_minute: int):
        self.per_minute = per_minute
        self.rate = per_minute / 60.0
        self.burst = float(per_minute)
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}

    def allow(self, key: str) -> bool:
        return self.wait_s(key) == 0

    def wait_s(self, key: str, take: bool = True) -> int:
        """Take one request from `key`'s bucket: 0 when allowed, else the whole seconds until one is (Retry-After).
        `take` False: only whether one would be allowed (nothing taken)."""
        if self.per_minute <= 0:
            return 0
        now = time.monotonic()
        with self._lock:
            level, at = self._buckets.get(key, (self.burst, now))
            level = min(self.burst, level + (now - at) * self.rate)
            if level < 1.0:
                self._buckets[key] = (level, now)
                return max(1, math.ceil((1.0 - level) / self.rate))
            if not take:
                return 0
            if key not in self._buckets and len(self._buckets) >= self.MAX_KEYS:
                self._prune(now)
            self._buckets[key] = (level - 1.0, now)
            return 0

    def _prune(self, now: float) -> None:
        full = [k for k, (lv, at) in self._buckets.items() if lv + (now - at) * self.rate >= self.burst]
        for k in full:
            del self._buckets[k]
        if len(self._buckets) >= self.MAX_KEYS:  # none full: the fullest half goes (the nearest to a fresh bucket),
            # never the emptiest, so a flood of new keys cannot refill a busy caller's bucket by pushing it out
            def level(k):
                lv, at = self._buckets[k]
                return lv + (now - at) * self.rate
            for k in sorted(self._buckets, key=level, reverse=True)[: self.MAX_KEYS // 2]:
                del self._buckets[k]


SESSION_PREFIX = "cls_"


@dataclass
class _Session:
    token_id: str
    expires: float          # time.time() when it ends
    checked: float          # time.monotonic() when the store last said it holds (a store's sessions)


class Sessions:
    """Signed-in browser sessions: the cookie holds `cls_<random>`; what is kept is the SHA-256 of it, the token it
    was started with and when it ends, in the store the tokens use (`portal_sessions`: a restart, or another
    replica on the same store, signs nobody out) and, for the requests, in memory. `end` (sign-out) forgets it in
    both: a copy of the cookie replayed afterwards finds nothing (on another replica, within `ttl_s`, as a revoked
    token). A session is refused too once its token is revoked (checked at each request through the `TokenCache`)
    or after `max_age_s`. One token holds at most `MAX_PER_TOKEN` sessions (signing in once more ends its oldest), so
    signing in over and over with one token cannot push everyone else out. Without a store (`store` None), the
    memory is all there is: a restart signs everyone out."""

    MAX_SESSIONS = 100_000  # kept in memory; beyond it the oldest are forgotten there (a store still holds them)
    MAX_PER_TOKEN = 16

    def __init__(self, tokens: "TokenCache", max_age_s: float, store=None, ttl_s: Optional[float] = None):
        self.tokens = tokens
        self.max_age_s = max_age_s
        self.store = store
        self.ttl_s = getattr(tokens, "ttl_s", 2.0) if ttl_s is None else ttl_s
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._by_token: dict[str, list[str]] = {}   # a token's session ids, oldest first (some may have ended)
        self._unknown: dict[str, float] = {}        # ids the store does not hold, when it said so (a query each)

    @staticmethod
    def _id(cookie: str) -> str:
        return hashlib.sha256(cookie.encode()).hexdigest()

    def start(self, token_id: str) -> str:
        """A new session for the token `token_id`; returns the cookie's value."""
        cookie = SESSION_PREFIX + secrets.token_urlsafe(32)
        sid = self._id(cookie)
        wall = time.time()
        ended: list[str] = []
        if self.store is not None:
            from store.models import PortalSession

            at = datetime.fromtimestamp(wall, timezone.utc)
            ended = self.store.start_session(PortalSession(
                session_sha256=sid, token_id=token_id, started_at=at,
                expires_at=datetime.fromtimestamp(wall + self.max_age_s, timezone.utc)), self.MAX_PER_TOKEN)
        with self._lock:
            for k in ended:
                self._sessions.pop(k, None)
            self._keep(sid, _Session(token_id, wall + self.max_age_s, time.monotonic()))
        return cookie

    def _keep(self, sid: str, s: _Session) -> None:
        """Keep `s` in memory (under the lock): the token's oldest beyond MAX_PER_TOKEN end, and the memory stays
        within MAX_SESSIONS (the ended first, then the oldest)."""
        mine = [k for k in self._by_token.get(s.token_id, ()) if k in self._sessions and k != sid]
        while len(mine) >= self.MAX_PER_TOKEN:  # this token's oldest session ends (not someone else's)
            del self._sessions[mine.pop(0)]
        if len(self._sessions) >= self.MAX_SESSIONS:
            now = time.time()
            for k in [k for k, v in self._sessions.items() if v.expires <= now]:
                del self._sessions[k]
            if len(self._sessions) >= self.MAX_SESSIONS:  # the oldest go first
                for k in sorted(self._sessions, key=lambda k: self._sessions[k].expires)[: self.MAX_SESSIONS // 10]:
                    del self._sessions[k]
            self._by_token = {t: [k for k in ks if k in self._sessions] for t, ks in self._by_token.items()}
            self._by_token = {t: ks for t, ks in self._by_token.items() if ks}
            mine = [k for k in mine if k in self._sessions]
        self._sessions[sid] = s
        self._by_token[s.token_id] = mine + [sid]

    def lookup(self, cookie: str, query: bool = True):
        """(session id, the token's row) of a live session, else None. `query` False: raises NeedStore instead of
        asking the store (as TokenCache.row)."""
        if not cookie.startswith(SESSION_PREFIX) or len(cookie) > 100:
            return None
        sid = self._id(cookie)
        mono = time.monotonic()
        with self._lock:
            s = self._sessions.get(sid)
            unknown_at = self._unknown.get(sid)
        if s is None and unknown_at is not None and mono - unknown_at < self.ttl_s:
            return None
        if self.store is not None and (s is None or mono - s.checked >= self.ttl_s):
            # not kept, or kept longer than a token is: the store says whether it still holds (signed out on
            # another replica, started before a restart)
            if not query:
                raise NeedStore(sid, known=s is not None)
            asked = time.monotonic()
            row = self.store.session(sid)
            with self._lock:
                ended = self._unknown.get(sid)
                if row is not None and ended is not None and ended >= asked:
                    row = None  # signed out while the store answered (`end`): the row read before is not kept
                if row is None:
                    self._gone(sid, mono)
                    s = None
                else:
                    self._unknown.pop(sid, None)
                    # ends by this portal's session_hours too: a session written under a longer setting (before
                    # a restart that lowered it, or by another replica) is over when this one's time is
                    s = _Session(row.token_id, min(row.expires_at.timestamp(),
                                                   row.started_at.timestamp() + self.max_age_s), mono)
                    self._keep(sid, s)
        if s is None:
            return None
        if time.time() >= s.expires:
            self._forget(sid)  # (the store's row is refused as expired, and deleted at a later sign-in)
            return None
        row = self.tokens.row(s.token_id, query)
        if row is None:  # its token revoked: the session ends with it (the store's row is refused the same way)
            self._forget(sid)
            return None
        return sid, row

    def _forget(self, sid: str) -> None:
        with self._lock:
            self._sessions.pop(sid, None)

    def end(self, cookie: str) -> bool:
        sid = self._id(cookie)
        with self._lock:
            here = self._sessions.pop(sid, None) is not None
        stored = self.store.end_session(sid) if self.store is not None else False
        with self._lock:  # a lookup that read the store's row before it went must not keep it (see `lookup`)
            self._gone(sid, time.monotonic())
        return here or stored

    def _gone(self, sid: str, at: float) -> None:
        """(Under the lock.) `sid` is no session since `at`: forgotten, and remembered as unknown (a query saved)."""
        self._sessions.pop(sid, None)
        if len(self._unknown) >= self.MAX_SESSIONS:
            self._unknown.clear()
        self._unknown[sid] = at

    def __len__(self) -> int:
        return len(self._sessions)


@dataclass
class Csrf:
    """CSRF tokens for the pages' forms: an HMAC of the signed-in session under a key made at start."""

    key: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    def token(self, session_key: str) -> str:
        return hmac.new(self.key, session_key.encode(), hashlib.sha256).hexdigest()

    def check(self, session_key: str, given: Optional[str]) -> bool:
        return bool(given) and hmac.compare_digest(self.token(session_key), given or "")
