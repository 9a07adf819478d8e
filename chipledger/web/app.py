"""The portal's ASGI application: the JSON read API under /api/v1 (OpenAPI at /api/v1/openapi.json) and the
server-rendered pages, over one `LakeReader` (chipledger/web/lake.py) and the store.

Who sees what is decided by `chipledger.web.auth.Principal`; every route asks it. A team the caller may not read,
and a job of such a team, is 404 (it does not exist for them). Pages carry no JavaScript: a strict
Content-Security-Policy (`default-src 'none'`, the stylesheet from 'self'), and they refresh with a
`<meta http-equiv=refresh>` poll.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from fastapi import APIRouter, Depends, FastAPI, Form, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from markupsafe import Markup
from pydantic import BaseModel, Field
from sqlalchemy.exc import DBAPIError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders

from chipledger.config import Config
from chipledger.web import burst as burst_mod
from chipledger.web.auth import Csrf, NeedStore, Principal, RateLimiter, Sessions, TokenCache, principal_for
from chipledger.web.estimate import Running, Waiting, estimate_start
from chipledger.web.lake import _MISSING, LakeReader, Snapshot
from chipledger.web.links import job_url, statement_url, team_url
from chipledger.web.redact import View, new_key

HERE = Path(__file__).parent
SESSION_COOKIE = "clp_session"
LOGIN_CSRF_COOKIE = "clp_login"
CSP = ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; "
       "base-uri 'none'")
MAX_BODY_BYTES = 16 << 10
# a name in a URL: what events' names may be (schemas.events.Name: 1 to 256 characters, no control characters), so
# every team and job the lake holds can be addressed (`R&D`, `o'brien-lab`, a hostile `<script>` name: every name is
# escaped where it is shown, and a team a caller reads must be theirs, or, for staff, one the lake holds)
NAME_RE = re.compile(r"^[^\x00-\x1f\x7f-\x9f]{1,256}$")
PAGE_REFRESH_S = 60
MAX_STREAMS_PER_CALLER = 8  # open /api/v1/snapshots streams per caller: each holds a connection and a task
UNLIMITED_PATHS = frozenset({"/healthz", "/static/portal.css"})  # not rate limited (probes; every page's stylesheet)


@dataclass
class Portal:
    """What the routes share: configuration, the lake, the store, Kafka, auth helpers."""

    cfg: Config
    reader: LakeReader
    store: Any = None
    producer_factory: Optional[Callable[[], Any]] = None    # None: no Kafka; burst requests are refused
    tokens: TokenCache = None
    dry_limiter: RateLimiter = None
    csrf: Csrf = None                                       # (None: its key kept in the store, else made now)
    limiter: RateLimiter = None
    requests: RateLimiter = None                            # every request, per user else per client address
    sessions: Sessions = None                               # signed-in browser sessions (/login, /logout)
    statements_dir: Optional[Path] = None
    accuracy: Optional[dict] = None                         # the start estimate's measured accuracy (docs/portal.md)
    sent: list = field(default_factory=list)                # burst requests this process sent (pending until decided)
    streams: dict = field(default_factory=dict)             # open event streams per caller (per user)
    alias_key: bytes = None                                 # decision ids a member may not read are shown as aliases
    #                                                         (None: the key kept in the store, else made now)
    _producer: Any = None

    def __post_init__(self):
        # the secret keys of the forms' CSRF tokens and of the aliases, kept in the store when there is one: a
        # restart keeps a page's form valid, replicas on one store agree (docs/portal.md)
        keep = self.store.portal_key if self.store is not None else (lambda name, make: make())
        if self.csrf is None:
            self.csrf = Csrf(keep("csrf", new_key))
        if self.alias_key is None:
            self.alias_key = keep("aliases", new_key)
        if self.tokens is None:
            self.tokens = TokenCache(self.store)
        if self.limiter is None:
            self.limiter = RateLimiter(self.cfg.serve.writes_per_minute)
        if self.dry_limiter is None:  # a dry run writes nothing but costs a few hundred verdicts: 6x the writes
            self.dry_limiter = RateLimiter(6 * self.cfg.serve.writes_per_minute)
        if self.requests is None:
            self.requests = RateLimiter(self.cfg.serve.requests_per_minute)
        if self.sessions is None:
            # kept in the store the tokens use (a restart signs nobody out); in memory only without one
            self.sessions = Sessions(self.tokens, self.cfg.serve.session_hours * 3600, store=self.store)
        if self.reader is not None and self.reader.warm is None:
            self.reader.warm = warm  # the queue's estimates (…) are computed at each refresh, not per request
            if self.reader._snap is not None and self.reader._snap.warm_s is None:
                self.reader.warm_current()  # a snapshot built before the step was given: warmed now, before serving

    def producer(self):
        if self.producer_factory is None:
            return None
        if self._producer is None:
            self._producer = self.producer_factory()
        return self._producer


# --------------------------------------------------------------------------------------------------------------
# response models (units in the field names)
# --------------------------------------------------------------------------------------------------------------

class Page(BaseModel):
    next_cursor: Optional[str] = Field(None, description="pass as `cursor` for the next page; null: last page")
    snapshot: int = Field(description="the lake snapshot the page was read from")


class PoolOut(BaseModel):
    pool: str
    books_closed_at: Optional[datetime]
    teams: int
    registered_chips: Optional[float]
    healthy_chips: Optional[float]
    in_use_chips: Optional[float]
    free_chips: Optional[float]


class PoolsOut(BaseModel):
    pools: list[PoolOut]
    snapshot: int


class TeamOut(BaseModel):
    team: str
    pools: list[str]


class TeamsOut(BaseModel):
    teams: list[TeamOut]


class BalanceOut(BaseModel):
    pool: str
    team: str
    at: datetime
    nominal_chips: float
    used_chips: float
    borrowed_chips: float
    burst_chips: float
    pending_chips: float
    decayed_usage_mchip_s: int
    fair_share_factor: float
    borrowed_share: float
    lendable_chips: float


class BalancesOut(Page):
    balances: list[BalanceOut]


class QueueEntry(BaseModel):
    pool: str
    team: Optional[str] = Field(None, description="null when the caller may not see other teams' names")
    job_id: Optional[str] = Field(None, description="null for another team's job")
    position: int
    queue_length: int
    team_position: int
    priority: int
    chips: float
    waiting_since: Optional[datetime]
    waited_s: Optional[int]
    reason: str
    message: Optional[str]
    as_of: datetime
    estimated_start_at: Optional[datetime] = Field(None, description="an estimate with its basis, never a promise")
    estimate_basis: Optional[str] = None


class QueueOut(BaseModel):
    queue: list[QueueEntry]
    snapshot: int


class TimelineEntry(BaseModel):
    at: datetime
    type: str
    detail: str


class JobOut(BaseModel):
    job_id: str
    pool: str
    team: str
    user: Optional[str]
    chips: float
    priority: int
    status: str
    submitted_at: datetime
    first_started_at: Optional[datetime]
    finished_at: Optional[datetime]
    outcome: Optional[str]
    preemptions: int
    allocated_mchip_s: int
    lost_mchip_s: int
    timeline: list[TimelineEntry]
    why: dict


class JobSummary(BaseModel):
    job_id: str
    pool: str
    team: str
    user: Optional[str]
    chips: float
    priority: int
    submitted_at: datetime
    first_started_at: Optional[datetime]
    finished_at: Optional[datetime]
    outcome: Optional[str]
    preemptions: int
    allocated_mchip_s: int
    lost_mchip_s: int


class JobsOut(Page):
    jobs: list[JobSummary]


class DecisionOut(BaseModel):
    decision_id: str = Field(description="the ledger's id, or `hidden-…` (an alias) when it could name what the "
                                         "caller may not see")
    type: str
    pool: str
    at: datetime
    rule: str
    team: Optional[str] = Field(description="the team the decision is for; null when the caller may not see its name "
                                            "(`[serve] visibility = team`)")
    message: str = Field(description="the ledger's sentence; for a team member, other teams' job ids read "
                                     "`(hidden)` and, with visibility `team`, their names `another team`")
    verdict: Optional[str]
    request_id: Optional[str]


class DecisionsOut(Page):
    decisions: list[DecisionOut]


class SloOut(BaseModel):
    slo: str
    pool: Optional[str]
    target: float
    unit: str
    good: int
    total: int
    sli: Optional[float]
    budget_consumed: Optional[float]
    budget_remaining: Optional[float]
    window_start: Optional[datetime]
    window_end: Optional[datetime]


class SlosOut(BaseModel):
    slos: list[SloOut]
    snapshot: int


class HolOut(BaseModel):
    pool: str
    team: Optional[str]
    waits_blocked: int
    jobs_affected: int
    blocked_s: int
    blocked_mchip_s: int
    top_blockers: Optional[str]


class HolsOut(BaseModel):
    head_of_line: list[HolOut]
    snapshot: int


class StatementOut(BaseModel):
    statement_id: str
    team: str
    period_start: datetime
    period_end: datetime
    issued_at: datetime
    formats: list[str]
    downloads: dict[str, str]


class StatementsOut(BaseModel):
    statements: list[StatementOut]


class BurstIn(BaseModel):
    pool: str = Field(max_length=256)
    team: str = Field(max_length=256)
    chips: float = Field(gt=0, le=1_000_000)
    window_start: datetime
    window_end: datetime
    reason: str = Field("", max_length=500)


class DryRunOut(BaseModel):
    pool: str
    team: str
    as_of: str
    verdict: str
    chips_requested: float
    chips_granted: float
    numbers: dict[str, float]
    message: str
    nearest_approved_windows: list[dict[str, str]]


class BurstOut(BaseModel):
    request_id: str
    pool: str
    team: str
    chips: float
    requested_by: Optional[str]
    requested_at: Optional[datetime]
    window_start: Optional[datetime]
    window_end: Optional[datetime]
    status: str = Field(description="pending (sent, no decision in the lake yet) | approved | partial | denied")
    chips_granted: Optional[float]
    message: Optional[str]


class BurstsOut(BaseModel):
    bursts: list[BurstOut]
    kafka: bool


class SubmittedOut(BaseModel):
    request_id: str
    event_id: str
    status: str


class CostRowOut(BaseModel):
    pool: str
    flavor: Optional[str]
    unit: str = Field(description="the price's unit (a currency's minor unit, or billing units)")
    priced_chip_h: float
    in_quota_units: float
    borrowed_units: float
    burst_units: float
    total_units: float


class CostTotalOut(BaseModel):
    unit: str
    total_units: float = Field(description="per unit only: never a sum of unlike units")


class TeamCostsOut(BaseModel):
    team: str
    period_start: Optional[datetime]
    period_end: Optional[datetime]
    as_of: Optional[datetime]
    priced: bool = Field(description="false: no price set for this team's use in the period (no cost, not 0)")
    by_pool: list[CostRowOut]
    totals: list[CostTotalOut]
    snapshot: int


class BudgetOut(BaseModel):
    period: str
    period_start: datetime
    period_end: datetime
    unit: str
    pools: int
    budget_units: float
    spent_units: float
    left_units: float
    used_share: Optional[float]
    forecast_end_units: Optional[float] = Field(description="spend at the period's end at the current rate")
    sentence: str


class TeamBudgetsOut(BaseModel):
    team: str
    as_of: Optional[datetime]
    budgets: list[BudgetOut]
    snapshot: int


class PoolCostOut(BaseModel):
    pool: str
    flavor: Optional[str]
    unit: str
    used_units: float
    idle_units: float
    unavailable_units: float
    total_units: float


class PoolCostsOut(BaseModel):
    period_start: Optional[datetime]
    period_end: Optional[datetime]
    pool_costs: list[PoolCostOut]
    snapshot: int


class WhoAmI(BaseModel):
    user: str
    via: str
    teams: list[str]
    roles: list[str]
    visibility: str


# --------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------

def _cursor_encode(key: list) -> str:
    return base64.urlsafe_b64encode(json.dumps(key, default=str).encode()).decode().rstrip("=")


def _cursor_decode(cursor: Optional[str]) -> Optional[list]:
    if not cursor:
        return None
    try:
        pad = "=" * (-len(cursor) % 4)
        key = json.loads(base64.urlsafe_b64decode(cursor + pad))
        # every cursor this API gives out is [an instant (ISO, UTC), a name]: anything else is refused here, not
        # handed to the database (a 500) or to the snapshot's memo as its key (unhashable lists and dicts)
        if not isinstance(key, list) or len(key) != 2 or not all(isinstance(k, str) for k in key):
            raise ValueError
        at = datetime.strptime(key[0], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
        if len(key[1]) > 256:
            raise ValueError
        return [_iso(at), key[1]]
    except Exception:
        raise HTTPException(400, "cursor is not one this API gave out") from None


def _chips(milli) -> Optional[float]:
    return None if milli is None else milli / 1000


def _keyset_page(read, sql: str, params: dict, cursor, limit: int, at: str, key: str,
                 resolve: Optional[Callable[[list], list]] = None, shown: Optional[Callable[[dict], str]] = None):
    """One page of a keyset-paged query: `sql` filters on `($k_at, $k_id)` (the cursor's instant and id, NULL on the
    first page) and ends with `LIMIT $n`; `read` is the snapshot's rows or cached_rows. Returns the page's rows and
    the next page's cursor (the last row's `at` and `key`; None on the last page). `shown(row)` is the key as the
    caller may see it (an alias), which `resolve(cursor key)` maps back. `cursor`: as sent (a string), or as
    `_cursor_decode` parsed it (a list)."""
    k = cursor if isinstance(cursor, list) else _cursor_decode(cursor)
    if k and resolve is not None:
        k = resolve(k)
    rows = read(sql, {**params, "k_at": k[0] if k else None, "k_id": k[1] if k else None, "n": limit + 1})
    if len(rows) > limit:
        last = rows[limit - 1]
        nxt = _cursor_encode([_iso(last[at]), shown(last) if shown else last[key]])
    else:
        nxt = None
    return rows[:limit], nxt


def _iso(ts) -> Optional[str]:
    return None if ts is None else ts.strftime("%Y-%m-%dT%H:%M:%SZ")


def _check_name(value: str, what: str) -> str:
    if not NAME_RE.match(value or ""):
        raise HTTPException(422, f"{what} is not a valid name")
    return value


_UNKNOWN = object()


class Identity:
    """The dependency that turns a request into a Principal (or None)."""

    def __init__(self, portal: Portal):
        self.portal = portal

    def __call__(self, request: Request, fresh: bool = False) -> Optional[Principal]:
        """The request's principal, worked out once per request (the rate limit needs it before the route does);
        `fresh`: again (a long-lived event stream checks that its token or session still holds). May ask the store:
        from the event loop, `await Identity.of(request)` instead."""
        if not fresh:
            known = request.scope.get("chipledger.principal", _UNKNOWN)
            if known is not _UNKNOWN:
                return known
        p = self._resolve(request)
        request.scope["chipledger.principal"] = p
        return p

    async def of(self, request: Request, fresh: bool = False) -> Optional[Principal]:
        """As calling it, from the event loop: what the token cache keeps is read here; a token or session it does
        not keep is looked up in the store in the thread pool, never on the loop (a query there would hold every
        request, kept answers too, and anyone may send a token id nobody has)."""
        if not fresh:
            known = request.scope.get("chipledger.principal", _UNKNOWN)
            if known is not _UNKNOWN:
                return known
        try:
            p = self._resolve(request, query=False)
        except NeedStore:
            p = await run_in_threadpool(self._resolve, request)
        request.scope["chipledger.principal"] = p
        return p

    def _resolve(self, request: Request, query: bool = True) -> Optional[Principal]:
        cfg = self.portal.cfg.serve
        client = request.client.host if request.client else ""
        if client in cfg.proxies():
            user = request.headers.get(cfg.user_header)
            if user:
                groups = [g.strip() for g in request.headers.get(cfg.groups_header, "").split(",") if g.strip()]
                return principal_for(cfg, user.strip()[:128], groups, "proxy")
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            row = self.portal.tokens.lookup(auth[7:].strip(), query)
            if row is not None:
                return principal_for(cfg, row.user, [], "token", token_team=row.team, token_id=row.token_id)
            return None
        cookie = request.cookies.get(SESSION_COOKIE)
        if cookie:  # a browser's session (/login): its id, never the token (signing out ends it here)
            live = self.portal.sessions.lookup(cookie, query)
            if live is not None:
                sid, row = live
                return principal_for(cfg, row.user, [], "session", token_team=row.team, token_id=row.token_id,
                                     session_id=sid)
        return None


class BodyLimit:
    """ASGI middleware: a request body larger than MAX_BODY_BYTES is refused with 413, whether it says its length
    (Content-Length, checked up front in `security`) or is sent in chunks (counted here as it is read)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > MAX_BODY_BYTES:
                    raise HTTPException(413, "request body too large")
            return message

        await self.app(scope, limited, send)


STORE_DOWN = "the portal's store is not answering: try again in a few seconds"


class Security:
    """ASGI middleware: `checks(request)` may answer first (a body too large, too many requests); every response,
    a route's or the check's, gets the security headers (a strict Content-Security-Policy, nosniff, no referrer,
    no framing) and `Cache-Control: no-store` unless the route set its own."""

    HEADERS = (("Content-Security-Policy", CSP), ("X-Content-Type-Options", "nosniff"),
               ("Referrer-Policy", "no-referrer"), ("X-Frame-Options", "DENY"))

    def __init__(self, app, checks: Callable[[Request], Awaitable[Any]]):
        self.app = app
        self.checks = checks

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        started = False

        async def headed(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                h = MutableHeaders(scope=message)
                for name, value in self.HEADERS:
                    h[name] = value
                if "cache-control" not in h:
                    h["Cache-Control"] = "no-store"
            await send(message)

        try:
            refused = await self.checks(Request(scope, receive))
            if refused is not None:
                return await refused(scope, receive, headed)
            await self.app(scope, receive, headed)
        except Exception as exc:
            # a failure inside (the store down, a bug): answered here, with the headers, rather than by Starlette's
            # outermost error handler without them; raised on, so the server logs it. The store failing is a 503 that
            # says so (a caller may try again; the log has the driver's message), anything else a 500
            if not started:
                api = scope.get("path", "").startswith("/api/")
                status, text = ((503, STORE_DOWN) if isinstance(exc, DBAPIError) else (500, "internal error"))
                extra = {"Retry-After": "5"} if status == 503 else None
                await (JSONResponse({"detail": text}, status_code=status, headers=extra) if api else
                       Response(text, status_code=status, media_type="text/plain", headers=extra))(
                    scope, receive, headed)
            raise


def build_app(portal: Portal) -> FastAPI:
    app = FastAPI(title="chipledger portal API", version="1", docs_url=None, redoc_url=None,
                  openapi_url="/api/v1/openapi.json",
                  description="Read API of chipledger (docs/portal.md): quota, queues, jobs, SLOs, statements, "
                              "bursts. Authenticate with `Authorization: Bearer <token>` (`chipledger serve tokens "
                              "create`).")
    app.state.portal = portal
    identity = Identity(portal)
    templates = Jinja2Templates(directory=str(HERE / "templates"))  # autoescape on for .html
    templates.env.filters["chips"] = lambda v: "–" if v is None else f"{v:,.1f}"
    templates.env.filters["pct"] = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"
    templates.env.filters["ts"] = lambda v: "–" if v is None else (v if isinstance(v, str) else _iso(v))
    templates.env.filters["dur"] = _duration
    templates.env.filters["money"] = lambda v: "–" if v is None else f"{v:,.2f}"
    templates.env.filters["epoch"] = lambda v: datetime.fromtimestamp(v, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    templates.env.globals.update(team_url=team_url, job_url=job_url)  # every link to a team's or a job's page

    app.add_middleware(BodyLimit)  # a body sent in chunks, without a Content-Length

    async def _checks(request: Request):
        """A response that refuses the request before any route (413, 429), or None."""
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return JSONResponse({"detail": "request body too large"}, status_code=413)
        wait = await _rate_limited(request)
        return None if wait == 0 else _too_many(request, wait)

    # outermost (added last): the size and rate checks, and the headers of every response (a plain ASGI middleware,
    # not Starlette's BaseHTTPMiddleware: that one runs each request through a task group and memory streams of its
    # own, a cost every route paid, the static file too)
    app.add_middleware(Security, checks=_checks)

    async def _rate_limited(request: Request) -> int:
        """Seconds to wait when this request is beyond its caller's `[serve] requests_per_minute`, else 0. The
        caller is the principal (the user) when the request names one, else its client address. /healthz (probes)
        and the stylesheet (loaded with every page) are not counted."""
        if portal.requests.per_minute <= 0 or request.url.path in UNLIMITED_PATHS:
            return 0
        addr = "addr:" + (request.client.host if request.client else "")
        try:
            p = identity._resolve(request, query=False)
        except NeedStore as e:
            # a token or session never seen is looked up in the store only while its address may still make an
            # anonymous request: made-up tokens and cookies (each a query that finds nobody) are charged to the
            # address, and once it is refused they cost no query either. One seen before (kept, for longer than the
            # cache's seconds) is looked up whatever its address's bucket holds: its user has a bucket of their own
            wait = 0 if e.known else portal.requests.wait_s(addr, take=False)
            if wait:
                return wait
            p = await run_in_threadpool(identity._resolve, request)
        request.scope["chipledger.principal"] = p
        return portal.requests.wait_s(p.limit_key if p is not None else addr)

    def _too_many(request: Request, wait: int):
        detail = (f"too many requests: at most {portal.requests.per_minute} a minute per user (or address); "
                  f"try again in {wait} s")
        headers = {"Retry-After": str(wait)}
        if request.url.path.startswith("/api/"):
            return JSONResponse({"detail": detail, "retry_after_s": wait}, status_code=429, headers=headers)
        r = templates.TemplateResponse(request, "error.html", {"request": request, "me": None, "csrf": None,
                                                               "refresh_s": PAGE_REFRESH_S, "snapshot": None,
                                                               "message": detail}, status_code=429)
        r.headers.update(headers)
        return r

    async def who(request: Request) -> Principal:
        # on the event loop (no trip through the thread pool): the principal is known already when the rate limit
        # worked it out, else it is a token's row kept for seconds (TokenCache); a store query goes to the pool
        p = await identity.of(request)
        if p is None:
            raise HTTPException(401, "sign in: Authorization: Bearer <token>", headers={"WWW-Authenticate": "Bearer"})
        return p

    def snap() -> Snapshot:
        return portal.reader.snapshot

    async def current() -> Snapshot:
        """The current snapshot, from the event loop (the first one, before any was built, is built in the thread
        pool: the serving command builds it before it listens)."""
        s = portal.reader._snap
        return s if s is not None else await run_in_threadpool(lambda: portal.reader.snapshot)

    async def kept_json(s: Snapshot, key, compute: Callable[[Snapshot], Optional[BaseModel]]) -> Optional[Response]:
        """`compute(s)`'s answer as JSON, kept with the snapshot (computed again on the next one at its swap): when
        kept, the request is a lookup on the event loop; else it is computed in the thread pool, once however many
        ask (Snapshot.memo). None when `compute` says there is no such thing (a 404 for the route to raise). A
        principal's answer is keyed by `Principal.view_key` (with the route's parameters): never another's. The
        portal's alias key too: the hidden ids' aliases are its (two portals may read one snapshot, as tests do)."""
        key = (portal.alias_key, *key)
        body = s.kept(key, _MISSING)
        if body is _MISSING:
            body = await run_in_threadpool(
                s.memo, key, lambda s: None if (m := compute(s)) is None else m.model_dump_json().encode())
        return None if body is None else Response(body, media_type="application/json")

    def team_or_404(p: Principal, team: str) -> str:
        """`team` when the caller may read it: one of their teams, or (staff) a team the lake holds; else 404."""
        if not NAME_RE.match(team or "") or not p.can_read_team(team) or (
                team not in p.teams and team not in _all_teams(portal.reader.snapshot)):
            raise HTTPException(404, "no such team")
        return team

    api = APIRouter(prefix="/api/v1")

    # ---------------------------------------------------------------------------------- read API
    @api.get("/whoami", response_model=WhoAmI, tags=["identity"])
    def whoami(p: Principal = Depends(who)):
        return WhoAmI(user=p.user, via=p.via, teams=sorted(p.teams), roles=sorted(p.roles), visibility=p.visibility)

    @api.get("/pools", response_model=PoolsOut, tags=["fleet"])
    async def pools(p: Principal = Depends(who)):
        return await kept_json(await current(), ("json", "pools"), lambda s: PoolsOut(
            snapshot=s.version, pools=[_pool_out(r) for r in s.rows("SELECT * FROM portal_pools ORDER BY pool")]))

    @api.get("/teams", response_model=TeamsOut, tags=["teams"])
    def teams(p: Principal = Depends(who)):
        s = snap()
        rows = s.cached_rows("SELECT team, list(DISTINCT pool ORDER BY pool) AS pools FROM portal_balances_now "
                      "GROUP BY team ORDER BY team")
        seen = {r["team"]: r["pools"] for r in rows}
        names = list(seen) if p.sees_fleet else sorted(p.teams)
        return TeamsOut(teams=[TeamOut(team=t, pools=seen.get(t, [])) for t in names])

    @api.get("/teams/{team:path}/balances", response_model=BalancesOut, tags=["teams"])
    async def balances(team: str, pool: Optional[str] = None,
                       since: Optional[datetime] = Query(None, description="history from this instant (omit: now)"),
                       until: Optional[datetime] = None, limit: int = Query(500, ge=1, le=5000),
                       cursor: Optional[str] = None, p: Principal = Depends(who)):
        team_or_404(p, team)
        s = await current()
        if since is None and until is None:  # now: the same for every caller who may read the team
            return await kept_json(s, ("json", "balances", team, pool), lambda s: BalancesOut(
                balances=[BalanceOut(**r) for r in s.rows(
                    "SELECT * FROM portal_balances_now WHERE team = ? AND (? IS NULL OR pool = ?) ORDER BY pool",
                    [team, pool, pool])], snapshot=s.version))
        return await run_in_threadpool(_balances_history, s, team, pool, since, until, limit, cursor)

    def _balances_history(s: Snapshot, team: str, pool: Optional[str], since: Optional[datetime],
                          until: Optional[datetime], limit: int, cursor: Optional[str]) -> BalancesOut:
        rows, nxt = _keyset_page(
            s.rows,
            'SELECT * FROM balances WHERE team = $team AND ($pool IS NULL OR pool = $pool) '
            'AND ($since IS NULL OR "at" >= $since) AND ($until IS NULL OR "at" < $until) '
            'AND ($k_at IS NULL OR ("at", pool) > ($k_at::TIMESTAMPTZ, $k_id)) ORDER BY "at", pool LIMIT $n',
            {"team": team, "pool": pool, "since": since, "until": until}, cursor, limit, "at", "pool")
        return BalancesOut(balances=[BalanceOut(**r) for r in rows], next_cursor=nxt, snapshot=s.version)

    @api.get("/queue", response_model=QueueOut, tags=["queue"])
    async def queue(pool: Optional[str] = None, team: Optional[str] = None, p: Principal = Depends(who)):
        if team is not None:
            team_or_404(p, team)
        return await kept_json(await current(), ("json", "queue", p.view_key, pool, team), lambda s: QueueOut(
            queue=_queue(portal, s, p, pool, team), snapshot=s.version))

    @api.get("/jobs/{job_id:path}", response_model=JobOut, tags=["jobs"])
    async def job(job_id: str, p: Principal = Depends(who)):
        if not NAME_RE.match(job_id or ""):
            raise HTTPException(404, "no such job")
        out = await kept_json(await current(), ("json", "job", p.view_key, job_id),
                              lambda s: _job(portal, s, p, job_id))
        if out is None:
            raise HTTPException(404, "no such job")
        return out

    @api.get("/teams/{team:path}/jobs", response_model=JobsOut, tags=["jobs"])
    def team_jobs(team: str, pool: Optional[str] = None, limit: int = Query(100, ge=1, le=1000),
                  cursor: Optional[str] = None, p: Principal = Depends(who)):
        """The team's jobs, latest submission first, paged."""
        team_or_404(p, team)
        s = snap()
        rows, nxt = _keyset_page(
            s.cached_rows,
            "SELECT job_id, pool, team, \"user\", chips, priority, submitted_at, first_started_at, finished_at, outcome, "
            "preemptions, allocated_mchip_s, lost_mchip_s FROM jobs WHERE team = $team AND ($pool IS NULL OR pool = $pool) "
            "AND ($k_at IS NULL OR (submitted_at, job_id) < ($k_at::TIMESTAMPTZ, $k_id)) "
            "ORDER BY submitted_at DESC, job_id DESC LIMIT $n",
            {"team": team, "pool": pool}, cursor, limit, "submitted_at", "job_id")
        return JobsOut(jobs=[JobSummary(**r) for r in rows], next_cursor=nxt, snapshot=s.version)

    @api.get("/decisions", response_model=DecisionsOut, tags=["decisions"])
    async def decisions(pool: Optional[str] = None, team: Optional[str] = None,
                        limit: int = Query(100, ge=1, le=1000), cursor: Optional[str] = None,
                        p: Principal = Depends(who)):
        if team is not None:
            team_or_404(p, team)
        elif not p.is_staff:
            if not p.teams:
                raise HTTPException(404, "no such team")
        # the page as this caller may read it, kept with the snapshot (computed again on the next one at its swap): the
        # key holds everything the redaction depends on (staff, their teams, whether they see the fleet's names), and
        # the cursor as parsed (a 400 here when it is not one this API gave out): its spellings are one key
        k = _cursor_decode(cursor)
        key = ("json", "decisions", p.view_key, pool, team, limit, None if k is None else tuple(k))
        return await kept_json(await current(), key, lambda s: _decisions_page(s, p, pool, team, limit, k))

    def _decisions_page(s: Snapshot, p: Principal, pool: Optional[str], team: Optional[str], limit: int,
                        cursor: Optional[list]) -> DecisionsOut:
        teams_filter = None if (team is None and p.is_staff) else ([team] if team else sorted(p.teams))
        view = _view(portal, s, p)
        bodies: dict[str, dict] = {}

        def body(r: dict) -> dict:
            if r["decision_id"] not in bodies:
                bodies[r["decision_id"]] = json.loads(r["body"] or "{}")
            return bodies[r["decision_id"]]

        def resolve(k: list) -> list:
            if p.is_staff:
                return k
            # a member's cursor must be a row as they were shown it (an alias, or an id shown as written): a forged
            # raw id would make the keyset's order an oracle, letting them binary-search a hidden decision's id
            # (only among the decisions they may read: nor may a cursor tell whether another team's decision exists)
            for r in s.rows(
                    'SELECT decision_id, body FROM portal_decisions WHERE "at" = ?::TIMESTAMPTZ AND (list_contains(?, '
                    'team) OR decision_id IN (SELECT decision_id FROM decision_victims WHERE list_contains(?, team)))',
                    [k[0], teams_filter, teams_filter]):
                if view.decision_id(r["decision_id"], body(r)) == k[1]:
                    return [k[0], r["decision_id"]]
            raise HTTPException(400, "cursor is not one this API gave out")

        rows, nxt = _keyset_page(
            s.cached_rows,
            'SELECT decision_id, type, pool, "at", rule, team, message, verdict, request_id, body FROM portal_decisions '
            'WHERE ($pool IS NULL OR pool = $pool) AND ($teams IS NULL OR list_contains($teams, team) '
            "OR decision_id IN (SELECT decision_id FROM decision_victims WHERE list_contains($teams, team))) "
            'AND ($k_at IS NULL OR ("at", decision_id) > ($k_at::TIMESTAMPTZ, $k_id)) '
            'ORDER BY "at", decision_id LIMIT $n',
            {"pool": pool, "teams": teams_filter}, cursor, limit, "at", "decision_id", resolve=resolve,
            shown=lambda r: view.decision_id(r["decision_id"], body(r)))
        return DecisionsOut(decisions=[DecisionOut(
            decision_id=view.decision_id(r["decision_id"], body(r)), type=r["type"], pool=r["pool"], at=r["at"],
            rule=r["rule"], team=view.team(r["team"]), message=view.message(body(r), r["message"]) or "",
            verdict=r["verdict"], request_id=r["request_id"]) for r in rows], next_cursor=nxt, snapshot=s.version)

    @api.get("/slos", response_model=SlosOut, tags=["slo"])
    async def slos(pool: Optional[str] = None, p: Principal = Depends(who)):
        return await kept_json(await current(), ("json", "slos", pool), lambda s: SlosOut(
            slos=_slos(s, pool), snapshot=s.version))

    @api.get("/head-of-line", response_model=HolsOut, tags=["queue"])
    async def head_of_line(pool: Optional[str] = None, p: Principal = Depends(who)):
        # kept with the snapshot per view, as the decisions are (what is shown depends on nothing else of the caller)
        return await kept_json(await current(), ("json", "hol", p.view_key, pool), lambda s: _hol_page(s, p, pool))

    def _hol_page(s: Snapshot, p: Principal, pool: Optional[str]) -> HolsOut:
        rows = s.cached_rows("SELECT * FROM portal_hol WHERE ($1 IS NULL OR pool = $1) ORDER BY pool, team", [pool])
        out = []
        for r in rows:
            mine = p.can_read_team(r["team"])
            if not mine and not p.sees_fleet:
                continue  # visibility = team: only the caller's teams
            out.append(HolOut(pool=r["pool"], team=r["team"], waits_blocked=r["waits_blocked"],
                              jobs_affected=r["jobs_affected"], blocked_s=r["blocked_s"],
                              blocked_mchip_s=r["blocked_mchip_s"],
                              top_blockers=_blockers(s, p, r) if mine else None))  # other teams' job ids: not theirs
        return HolsOut(head_of_line=out, snapshot=s.version)

    @api.get("/teams/{team:path}/costs", response_model=TeamCostsOut, tags=["costs"])
    def team_costs(team: str, p: Principal = Depends(who)):
        """The team's cost this period (the UTC month of the lake's latest instant), per pool and flavor, totals
        per unit. Computed at each snapshot refresh."""
        team_or_404(p, team)
        s = snap()
        return _team_costs_out(s, team)

    @api.get("/teams/{team:path}/budgets", response_model=TeamBudgetsOut, tags=["costs"])
    def team_budgets(team: str, p: Principal = Depends(who)):
        """The team's budgets of the periods overlapping this month: budget, spent, left, forecast of the end."""
        team_or_404(p, team)
        s = snap()
        return _team_budgets_out(s, team)

    @api.get("/pool-costs", response_model=PoolCostsOut, tags=["costs"])
    def pool_costs_route(p: Principal = Depends(who)):
        """Per pool and unit this period: the cost of the teams' use, of idle and of unavailable chips (fleet
        aggregates: per `[serve] visibility`)."""
        if not p.sees_fleet:
            raise HTTPException(404, "no such resource")
        s = snap()
        c = s.costs or {}
        return PoolCostsOut(period_start=c.get("period_start"), period_end=c.get("period_end"), snapshot=s.version,
                            pool_costs=[_pool_cost_out(r) for r in c.get("pools", [])])

    @api.get("/teams/{team:path}/statements", response_model=StatementsOut, tags=["statements"])
    def statements(team: str, p: Principal = Depends(who)):
        team_or_404(p, team)
        return StatementsOut(statements=_statements(portal, team))

    @api.get("/statements/{statement_id:path}/{fmt}", tags=["statements"],
             responses={200: {"content": {"application/octet-stream": {}}}})
    def statement_file(statement_id: str, fmt: str, p: Principal = Depends(who)):
        return _statement_file(statement_id, fmt, p)

    @api.get("/statement-file", tags=["statements"], responses={200: {"content": {"application/octet-stream": {}}}})
    def statement_file_q(statement_id: str = Query(..., max_length=400), fmt: str = Query(..., max_length=8),
                         p: Principal = Depends(who)):
        """An issued statement's file, the statement named in the query: for a team whose name has an empty, `.` or
        `..` segment (browsers and HTTP clients remove dot segments from a path; the statements' `downloads` give
        this form for them)."""
        return _statement_file(statement_id, fmt, p)

    def _statement_file(statement_id: str, fmt: str, p: Principal):
        path = _statement_path(portal, p, statement_id, fmt)
        media = {"html": "text/html", "md": "text/markdown", "csv": "text/csv", "json": "application/json",
                 "svg": "image/svg+xml"}[fmt]
        headers = {"Content-Disposition": f'attachment; filename="{path.name}"'}
        if p.is_staff:
            return FileResponse(path, media_type=media, filename=path.name, headers=headers)
        # a member reads it as they read decisions: the statement names who preempted their jobs
        from fastapi.responses import Response

        s = snap()
        team = statement_id.rpartition("@")[0]
        decisions = [(r["decision_id"], json.loads(r["body"] or "{}")) for r in s.cached_rows(
            "SELECT decision_id, body FROM portal_decisions WHERE team = ? OR decision_id IN "
            "(SELECT decision_id FROM decision_victims WHERE team = ?)", [team, team])]
        text = _view(portal, s, p).document(path.read_text(encoding="utf-8"), fmt, decisions)
        return Response(text.encode("utf-8"), media_type=media, headers=headers)

    @api.get("/teams/{team:path}/bursts", response_model=BurstsOut, tags=["bursts"])
    def bursts(team: str, p: Principal = Depends(who)):
        team_or_404(p, team)
        return BurstsOut(bursts=_bursts(portal, snap(), team), kafka=portal.producer_factory is not None)

    @api.post("/bursts/dry-run", response_model=DryRunOut, tags=["bursts"])
    def burst_dry_run(req: BurstIn, p: Principal = Depends(who)):
        _burst_allowed(p, req)
        out = _dry_run(portal, req, p.user)
        return DryRunOut(**out)

    @api.post("/bursts", response_model=SubmittedOut, status_code=202, tags=["bursts"])
    def burst_submit(req: BurstIn, request: Request, p: Principal = Depends(who)):
        _burst_allowed(p, req)
        if p.via != "token" or not request.headers.get("authorization", "").lower().startswith("bearer "):
            # a browser's ambient credentials (the proxy's header, the session cookie) need the form's CSRF token
            if not portal.csrf.check(p.session_key(), request.headers.get("x-csrf-token")):
                raise HTTPException(403, "CSRF token missing or wrong")
        return _submit(portal, p, req)

    @api.get("/snapshots", tags=["fleet"], responses={200: {"content": {"text/event-stream": {}}}})
    async def snapshots(request: Request, once: bool = Query(False, description="send the current snapshot and end"),
                        p: Principal = Depends(who)):
        """Server-sent events: `event: snapshot` with the lake snapshot's number and when it was read, now and each
        time a new snapshot is swapped in (the books closed again): a client refreshes what it shows then."""
        import asyncio

        from fastapi.responses import StreamingResponse

        key = p.limit_key  # per user, however they authenticate (a new sign-in is not a new allowance)
        if portal.streams.get(key, 0) >= MAX_STREAMS_PER_CALLER:
            raise HTTPException(429, f"at most {MAX_STREAMS_PER_CALLER} event streams at once per caller")
        portal.streams[key] = portal.streams.get(key, 0) + 1

        async def stream():
            try:
                async for chunk in events():
                    yield chunk
            finally:
                left = portal.streams.get(key, 1) - 1
                if left > 0:
                    portal.streams[key] = left
                else:
                    portal.streams.pop(key, None)

        async def events():
            last = None
            while True:
                snap = portal.reader._snap
                if snap is not None and snap.version != last:
                    last = snap.version
                    data = json.dumps({"snapshot": snap.version, "read_at": _epoch_iso(snap.built_at)})
                    yield f"event: snapshot\ndata: {data}\n\n"
                    if once:
                        return
                if await request.is_disconnected():
                    return
                if await identity.of(request, fresh=True) is None:  # its token revoked (or its session gone): it ends too
                    return
                await asyncio.sleep(1.0)

        if portal.reader._snap is None:
            portal.reader.snapshot  # the first snapshot, before the stream starts
        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    app.include_router(api)

    # ---------------------------------------------------------------------------------- pages
    def page_user(request: Request) -> Optional[Principal]:
        return identity(request)

    def render(request: Request, name: str, p: Optional[Principal], status: int = 200, **ctx):
        # the footer names the snapshot the page was read from (a route passes its own: a refresh may have swapped
        # in a newer one meanwhile)
        ctx.setdefault("snapshot", portal.reader._snap)
        ctx.update(request=request, me=p, csrf=portal.csrf.token(p.session_key()) if p else None,
                   refresh_s=PAGE_REFRESH_S)
        return templates.TemplateResponse(request, name, ctx, status_code=status)

    def signin_redirect():
        return RedirectResponse("/login", status_code=303)

    @app.get("/healthz", include_in_schema=False)
    def healthz():
        s = portal.reader._snap  # (anonymous: whether the refresh fails, not why: its message names the lake's
        # files, and the server's log has it)
        return {"ok": True, "snapshot": s.version if s else None, "refresh_failing": portal.reader.last_error is not None,
                "build_s": round(s.build_s, 2) if s else None, "rewarm_s": round(s.rewarm_s, 2) if s else None,
                "warm_s": round(s.warm_s, 2) if s and s.warm_s is not None else None}

    @app.get("/static/portal.css", include_in_schema=False)
    def css():
        return FileResponse(HERE / "static" / "portal.css", media_type="text/css",
                            headers={"Cache-Control": "max-age=300"})

    @app.get("/login", include_in_schema=False, response_class=HTMLResponse)
    def login_form(request: Request):
        nonce = secrets.token_urlsafe(16)
        r = render(request, "login.html", None, login_csrf=nonce, error=None)
        r.set_cookie(LOGIN_CSRF_COOKIE, nonce, httponly=True, samesite="strict",
                     secure=portal.cfg.serve.secure_cookies)
        return r

    @app.post("/login", include_in_schema=False)
    def login(request: Request, token: str = Form(max_length=200), csrf: str = Form(max_length=100)):
        cookie = request.cookies.get(LOGIN_CSRF_COOKIE, "")
        if not cookie or not secrets.compare_digest(cookie, csrf):
            return render(request, "login.html", None, 403, login_csrf=cookie, error="the form expired: try again")
        row = portal.tokens.lookup(token.strip())
        if row is None:
            return render(request, "login.html", None, 401, login_csrf=cookie, error="that token is not valid")
        r = RedirectResponse("/", status_code=303)
        old = request.cookies.get(SESSION_COOKIE)
        if old:
            portal.sessions.end(old)  # signing in again replaces the session (its CSRF tokens with it)
        r.set_cookie(SESSION_COOKIE, portal.sessions.start(row.token_id), httponly=True, samesite="strict",
                     secure=portal.cfg.serve.secure_cookies, max_age=int(portal.cfg.serve.session_hours * 3600))
        r.delete_cookie(LOGIN_CSRF_COOKIE)
        return r

    @app.post("/logout", include_in_schema=False)
    def logout(request: Request, csrf: str = Form("", max_length=100)):
        p = page_user(request)
        if p is not None and not portal.csrf.check(p.session_key(), csrf):
            raise HTTPException(403, "CSRF token missing or wrong")
        cookie = request.cookies.get(SESSION_COOKIE)
        if cookie:
            portal.sessions.end(cookie)  # the session ends here: the cookie, replayed, is refused
        r = RedirectResponse("/login", status_code=303)
        r.delete_cookie(SESSION_COOKIE)
        return r

    @app.get("/", include_in_schema=False)
    def index(request: Request):
        p = page_user(request)
        if p is None:
            return signin_redirect()
        if p.home_team:
            return RedirectResponse(team_url(p.home_team), status_code=303)
        return RedirectResponse("/fleet", status_code=303)

    def team_home(request: Request, team: str):
        p = page_user(request)
        if p is None:
            return signin_redirect()
        team_or_404(p, team)
        s = snap()
        return render(request, "home.html", p, snapshot=s, team=team,
                      main=kept_content(s, p, "home_main.html", team, lambda s: _home_context(s, p, team)))

    def kept_content(s: Snapshot, p: Principal, template: str, team: str, context: Callable[[Snapshot], dict]) -> Markup:
        """A team page's content (`template` rendered with `context(s)`), kept with the snapshot per team and view:
        its rendering was most of the page's time (the home page: 40 kB of tables at 10M events, 5 ms per request);
        what is the session's (the sign-out form's CSRF token) is rendered per request around it."""
        return s.memo(("page", template, p.view_key, team),
                      lambda s: Markup(templates.get_template(template).render(**context(s))))

    def _home_context(s: Snapshot, p: Principal, team: str) -> dict:
        bal, pools = s.memo(("home", team), lambda s: (
            s.rows("SELECT * FROM portal_balances_now WHERE team = ? ORDER BY pool", [team]),
            {r["pool"]: r for r in s.rows("SELECT * FROM portal_pools")}))
        q = _queue(portal, s, p, None, team)
        recent = s.memo(("recent", team), lambda s: s.rows(
            "SELECT job_id, pool, chips, submitted_at, first_started_at, finished_at, outcome, preemptions FROM jobs "
            "WHERE team = ? ORDER BY submitted_at DESC, job_id DESC LIMIT 15", [team]))
        return dict(team=team, balances=bal, pools=pools, recent=recent, team_pools={b["pool"] for b in bal},
                    slos=_slos(s, None), queue_len=len(q), fair_share=_fair_share_sentence,
                    costs=_team_costs_out(s, team), budgets=_team_budgets_out(s, team))

    @app.get("/teams/{team:path}/queue", include_in_schema=False, response_class=HTMLResponse)
    def team_queue(request: Request, team: str):
        p = page_user(request)
        if p is None:
            return signin_redirect()
        team_or_404(p, team)
        s = snap()
        return render(request, "queue.html", p, snapshot=s, team=team, main=kept_content(
            s, p, "queue_main.html", team, lambda s: dict(
                team=team, queue=_queue(portal, s, p, None, team), accuracy=portal.accuracy,
                hol=[{**r, "top_blockers": _blockers(s, p, r)}
                     for r in s.cached_rows("SELECT * FROM portal_hol WHERE team = ? ORDER BY pool", [team])])))

    @app.get("/jobs/{job_id:path}", include_in_schema=False, response_class=HTMLResponse)
    def job_page(request: Request, job_id: str):
        p = page_user(request)
        if p is None:
            return signin_redirect()
        s = snap()
        out = _job(portal, s, p, job_id)
        if out is None:
            return render(request, "error.html", p, 404, message="no such job")
        return render(request, "job.html", p, snapshot=s, job=out)

    @app.get("/teams/{team:path}/statements", include_in_schema=False, response_class=HTMLResponse)
    def statements_page(request: Request, team: str):
        p = page_user(request)
        if p is None:
            return signin_redirect()
        team_or_404(p, team)
        return render(request, "statements.html", p, team=team, statements=_statements(portal, team))

    @app.get("/teams/{team:path}/bursts", include_in_schema=False, response_class=HTMLResponse)
    def bursts_page(request: Request, team: str):
        p = page_user(request)
        if p is None:
            return signin_redirect()
        team_or_404(p, team)
        s = snap()
        return render(request, "bursts.html", p, snapshot=s, team=team, bursts=_bursts(portal, s, team),
                      pools=[r["pool"] for r in s.cached_rows("SELECT pool FROM portal_pools ORDER BY pool")],
                      kafka=portal.producer_factory is not None, dry=None, form=None, error=None, sent=None)

    @app.post("/teams/{team:path}/bursts", include_in_schema=False, response_class=HTMLResponse)
    def bursts_post(request: Request, team: str, pool: str = Form(max_length=256), chips: float = Form(),
                    window_start: str = Form(max_length=40), window_end: str = Form(max_length=40),
                    reason: str = Form("", max_length=500), action: str = Form("dry-run", max_length=10),
                    csrf: str = Form("", max_length=100)):
        p = page_user(request)
        if p is None:
            return signin_redirect()
        team_or_404(p, team)
        if not portal.csrf.check(p.session_key(), csrf):
            return render(request, "error.html", p, 403, message="the form's CSRF token is missing or wrong")
        s = snap()
        form = {"pool": pool, "chips": chips, "window_start": window_start, "window_end": window_end,
                "reason": reason}
        ctx = dict(team=team, pools=[r["pool"] for r in s.cached_rows("SELECT pool FROM portal_pools ORDER BY pool")],
                   kafka=portal.producer_factory is not None, form=form, dry=None, error=None, sent=None)
        try:
            req = BurstIn(pool=pool, team=team, chips=chips, window_start=_parse_when(window_start),
                          window_end=_parse_when(window_end), reason=reason)
            _burst_allowed(p, req)
            if action == "submit":
                ctx["sent"] = _submit(portal, p, req)
            else:
                ctx["dry"] = _dry_run(portal, req, p.user, s)
        except HTTPException as e:
            ctx["error"] = e.detail
        except ValueError as e:
            ctx["error"] = str(e).splitlines()[0]
        ctx["bursts"] = _bursts(portal, s, team)
        return render(request, "bursts.html", p, 200 if ctx["error"] is None else 400, snapshot=s, **ctx)

    # a team's home last: `{team:path}` (team names may be paths, `org/team`) would take the pages above
    app.get("/teams/{team:path}", include_in_schema=False, response_class=HTMLResponse)(team_home)

    # the same pages by their query form (chipledger/web/links.py): a team whose home's path is another team's page
    # (`x/queue`), a name with an empty, `.` or `..` segment; the portal links them so (`team_url`, `job_url`)
    def by_name(page):
        def page_of(request: Request, name: str = Query(..., max_length=256)):
            return page(request, name)
        return page_of

    for suffix, page in (("", team_home), ("/queue", team_queue), ("/statements", statements_page),
                         ("/bursts", bursts_page)):
        app.get("/team" + suffix, include_in_schema=False, response_class=HTMLResponse)(by_name(page))

    @app.post("/team/bursts", include_in_schema=False, response_class=HTMLResponse)
    def bursts_post_q(request: Request, name: str = Query(..., max_length=256), pool: str = Form(max_length=256),
                      chips: float = Form(), window_start: str = Form(max_length=40), window_end: str = Form(max_length=40),
                      reason: str = Form("", max_length=500), action: str = Form("dry-run", max_length=10),
                      csrf: str = Form("", max_length=100)):
        return bursts_post(request, name, pool, chips, window_start, window_end, reason, action, csrf)

    @app.get("/job", include_in_schema=False, response_class=HTMLResponse)
    def job_page_q(request: Request, id: str = Query(..., max_length=256)):
        return job_page(request, id)

    @app.get("/fleet", include_in_schema=False, response_class=HTMLResponse)
    def fleet(request: Request):
        p = page_user(request)
        if p is None:
            return signin_redirect()
        if not p.sees_fleet:
            return render(request, "error.html", p, 404, message="the fleet page is for admins and SREs here")
        s = snap()
        return render(request, "fleet.html", p, snapshot=s,
                      pools=s.cached_rows("SELECT * FROM portal_pools ORDER BY pool"),
                      balances=s.cached_rows("SELECT * FROM portal_balances_now ORDER BY pool, team"),
                      slos=_slos(s, None), hol=s.cached_rows("SELECT * FROM portal_hol ORDER BY blocked_mchip_s DESC LIMIT 10"),
                      queue=_queue(portal, s, p, None, None)[:50],
                      cost_period=(s.costs or {}).get("period_start"),
                      pool_costs=[_pool_cost_out(r) for r in (s.costs or {}).get("pools", [])])

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        if request.url.path.startswith("/api/") or exc.status_code not in (403, 404):
            return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
        p = await identity.of(request)
        return render(request, "error.html", p, exc.status_code, message=str(exc.detail))

    # burst helpers (closures over portal)
    def _burst_allowed(p: Principal, req: BurstIn) -> None:
        _check_name(req.pool, "pool")
        _check_name(req.team, "team")
        if not p.can_request_burst(req.team):
            raise HTTPException(404, "no such team")
        if req.window_end <= req.window_start:
            raise HTTPException(422, "window_end must be after window_start")

    return app


# --------------------------------------------------------------------------------------------------------------
# reads
# --------------------------------------------------------------------------------------------------------------

def _epoch_iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _duration(s) -> str:
    if s is None:
        return "–"
    d, r = divmod(int(s), 86400)
    h, r = divmod(r, 3600)
    m, sec = divmod(r, 60)
    return " ".join(f"{v}{u}" for v, u in ((d, "d"), (h, "h"), (m, "m"), (sec, "s")) if v) or "0s"


def _fair_share_sentence(f: Optional[float]) -> str:
    if f is None:
        return "no fair-share factor recorded yet"
    if f >= 0.9:
        return (f"F = {f:.2f}: your team used little of the pool lately; your jobs go ahead of heavier users' and a "
                f"burst may take all the forecast idle chips")
    if f >= 0.5:
        return (f"F = {f:.2f}: your recent use is about your share; a burst may take all the forecast idle chips, "
                f"and your borrowed jobs are preempted only after heavier users'")
    return (f"F = {f:.2f}: your team used more than its share lately (it recovers as usage decays); a burst may "
            f"take only {2 * f:.0%} of the forecast idle chips, and your borrowed jobs are preempted first")


def _team_costs_out(s: Snapshot, team: str) -> TeamCostsOut:
    c = s.costs or {}
    b = c.get("teams", {}).get(team) or {"priced": False, "by_pool": [], "totals": []}
    return TeamCostsOut(
        team=team, period_start=c.get("period_start"), period_end=c.get("period_end"), as_of=c.get("as_of"),
        priced=bool(b["priced"]), snapshot=s.version,
        by_pool=[CostRowOut(pool=r["pool"], flavor=r["flavor"], unit=r["unit"],
                            priced_chip_h=round(r["priced_mchip_s"] / 3.6e6, 6), in_quota_units=r["in_quota"],
                            borrowed_units=r["borrowed"], burst_units=r["burst"], total_units=r["total"])
                 for r in b["by_pool"]],
        totals=[CostTotalOut(unit=t["unit"], total_units=t["total"]) for t in b["totals"]])


def _team_budgets_out(s: Snapshot, team: str) -> TeamBudgetsOut:
    from chipledger.web.costs import budget_sentence

    c = s.costs or {}
    b = c.get("teams", {}).get(team) or {"budgets": []}
    return TeamBudgetsOut(team=team, as_of=c.get("as_of"), snapshot=s.version, budgets=[
        BudgetOut(period=g["period"], period_start=g["period_start"], period_end=g["period_end"], unit=g["unit"],
                  pools=g["pools"], budget_units=g["budget"], spent_units=g["spent"], left_units=g["left"],
                  used_share=g["used_share"], forecast_end_units=g["forecast_end"], sentence=budget_sentence(g))
        for g in b["budgets"]])


def _pool_cost_out(r: dict) -> PoolCostOut:
    return PoolCostOut(pool=r["pool"], flavor=r["flavor"], unit=r["unit"], used_units=r["used"],
                       idle_units=r["idle"], unavailable_units=r["unavailable"], total_units=r["total"])


def _pool_out(r: dict) -> PoolOut:
    return PoolOut(pool=r["pool"], books_closed_at=r["books_closed_at"], teams=r["teams"],
                   registered_chips=_chips(r["registered_milli"]), healthy_chips=_chips(r["healthy_milli"]),
                   in_use_chips=_chips(r["in_use_milli"]), free_chips=_chips(r["free_milli"]))


def _slos(s: Snapshot, pool: Optional[str]) -> list[SloOut]:
    return s.memo(("slos", pool), lambda s: _slos_compute(s, pool))


def _slos_compute(s: Snapshot, pool: Optional[str]) -> list[SloOut]:
    rows = s.rows("SELECT * FROM portal_error_budget WHERE ($1 IS NULL OR pool = $1) ORDER BY slo, pool NULLS FIRST",
                  [pool])
    return [SloOut(slo=r["slo"], pool=r["pool"], target=r["target"], unit=r["unit"], good=int(r["good"] or 0),
                   total=int(r["total"] or 0), sli=r["sli"], budget_consumed=r["consumed"],
                   budget_remaining=r["remaining"], window_start=r["window_start"], window_end=r["window_end"])
            for r in rows]


def _runtime_model(s: Snapshot) -> tuple[dict, dict, dict]:
    """Expected runtimes: per job (the producer's), medians per (pool, team, chips) and per pool of finished runs."""
    expected = {(r["pool"], r["job_id"]): r["expected_runtime_s"] for r in s.rows(
        "SELECT pool, job_id, arg_max(expected_runtime_s, submitted_at) AS expected_runtime_s FROM portal_expected "
        "WHERE expected_runtime_s IS NOT NULL GROUP BY ALL")}
    by_size = {}
    by_pool = {}
    for r in s.rows("SELECT pool, team, chips_milli, median(epoch(ended_at) - epoch(started_at))::BIGINT AS m "
                    "FROM portal_runs WHERE end_reason = 'finished' AND ended_at IS NOT NULL GROUP BY ALL"):
        by_size[(r["pool"], r["team"], r["chips_milli"])] = r["m"]
    for r in s.rows("SELECT pool, median(epoch(ended_at) - epoch(started_at))::BIGINT AS m FROM portal_runs "
                    "WHERE end_reason = 'finished' AND ended_at IS NOT NULL GROUP BY ALL"):
        by_pool[r["pool"]] = r["m"]
    return expected, by_size, by_pool


def queue_all(s: Snapshot) -> list[QueueEntry]:
    """Every pending job with its estimated start, computed once per snapshot (at its refresh: `LakeReader.warm`)."""
    return s.memo("queue", _queue_compute, pin=True)


def _queue(portal: Portal, s: Snapshot, p: Principal, pool: Optional[str], team: Optional[str]) -> list[QueueEntry]:
    out = []
    for e in queue_all(s):
        if pool is not None and e.pool != pool:
            continue
        if team is not None and e.team != team:
            continue
        mine = p.can_read_team(e.team)
        if not mine and not p.sees_fleet:
            continue
        if not mine:
            e = e.model_copy(update={"job_id": None, "message": None})
        out.append(e)
    return out


def job_owners(s: Snapshot, texts) -> dict[str, frozenset[str]]:
    """Job id -> the teams owning a job of that id (any pool), for each job id of the lake that `texts` (free text)
    hold anywhere: not only their words (an id may hold blanks, quotes and commas, `ads ranker 7`, and stand in a run
    no word boundary splits, `job=ads-7`); whether it stands alone there is redact.View's to say."""
    texts = [t for t in texts if t]
    if not texts:
        return {}
    # the texts joined by a control character, which no job id holds (schemas.events.Name)
    return {r["job_id"]: frozenset(r["teams"]) for r in s.rows(
        "SELECT job_id, list(DISTINCT team) AS teams FROM portal_job_owners WHERE contains(?, job_id) "
        "GROUP BY job_id", ["\n".join(texts)])}


def _queue_compute(s: Snapshot) -> list[QueueEntry]:
    rows = s.rows("SELECT * FROM portal_queue ORDER BY pool, position")
    if not rows:
        return []
    expected, by_size, by_pool = _runtime_model(s)

    def runtime(pl, tm, job_id, chips_milli):
        return expected.get((pl, job_id)) or by_size.get((pl, tm, chips_milli)) or by_pool.get(pl)

    pools = {r["pool"]: r for r in s.rows("SELECT * FROM portal_pools")}
    running_by_pool: dict[str, list[Running]] = {}
    for r in s.rows(
            "SELECT j.pool, j.team, j.job_id, j.chips_milli, l.last_at, "
            "(SELECT max(started_at) FROM portal_runs x WHERE x.pool = j.pool AND x.job_id = j.job_id) AS started_at "
            "FROM portal_jobs j JOIN portal_job_last l USING (pool, job_id) "
            "WHERE l.last_type IN ('job.started', 'job.progress', 'job.checkpointed') AND j.finished_at IS NULL"):
        rt = runtime(r["pool"], r["team"], r["job_id"], r["chips_milli"])
        start = r["started_at"] or r["last_at"]
        end = int(start.timestamp()) + rt if (rt and start) else None
        running_by_pool.setdefault(r["pool"], []).append(Running(r["chips_milli"], end))
    out = []
    ahead_by_pool: dict[str, list[Waiting]] = {}
    for r in rows:
        pl = r["pool"]
        chips_milli = round(r["chips"] * 1000)
        w = Waiting(r["job_id"], chips_milli, runtime(pl, r["team"], r["job_id"], chips_milli))
        ahead = ahead_by_pool.setdefault(pl, [])
        info = pools.get(pl, {})
        est = estimate_start(int(r["at"].timestamp()), info.get("free_milli") or 0, running_by_pool.get(pl, []),
                             list(ahead), w, info.get("healthy_milli") or 0)
        out.append(QueueEntry(
            pool=pl, team=r["team"], job_id=r["job_id"], position=r["position"], queue_length=r["queue_length"],
            team_position=r["team_position"], priority=r["priority"], chips=r["chips"],
            waiting_since=r["waiting_since"], waited_s=None if r["waited_s"] is None else int(r["waited_s"]),
            reason=r["reason"], message=r["message"], as_of=r["at"],
            estimated_start_at=None if est.start_s is None else datetime.fromtimestamp(est.start_s, timezone.utc),
            estimate_basis=est.basis))
        ahead.append(w)
    return out


def _blockers(s: Snapshot, p: Principal, row: dict) -> str:
    """A head-of-line row's top blockers as the caller may see them: the jobs that blocked a team's jobs are mostly
    other teams' (the jobs ahead in the pool's queue), and other teams' job ids are not shown to members."""
    ids = [x for x in (row.get("top_blockers") or "").split(",") if x]
    if not ids or p.is_staff:
        return ",".join(ids)
    # the blockers' owners, from the table the refresh built (a scan of the pool's jobs per request took 13 s at 10M
    # events on the first read of a snapshot; a lookup per row of those scans, 3.5 s)
    owners = hol_owners(s)
    pool = row["pool"]
    shown = [x for x in ids if (t := owners.get((pool, x))) is not None and p.can_read_team(t)]
    hidden = len(ids) - len(shown)
    return ",".join(shown + ([f"{hidden} job(s) of other teams"] if hidden else []))


def hol_owners(s: Snapshot) -> dict[tuple[str, str], str]:
    """(pool, job id) -> team, of every job named among the head-of-line rows' top blockers (computed at refresh:
    `warm`)."""
    return s.memo("hol_owners", lambda s: {(r["pool"], r["job_id"]): r["team"] for r in s.rows(
        "SELECT pool, job_id, team FROM portal_hol_owners")}, pin=True)


def warm(s: Snapshot) -> None:
    """What the refresh computes on a new snapshot before it is swapped in: the queue with its estimates, the head-of-
    line blockers' owners (every request that shows either reads them), the lake's team names (a staff caller's team
    is checked against them, and a member's decisions)."""
    queue_all(s)
    hol_owners(s)
    _all_teams(s)


def _all_teams(s: Snapshot) -> frozenset[str]:
    """Every team name of the lake (what a caller's decisions are checked against, last)."""
    return s.memo("all_teams", lambda s: frozenset(r["team"] for r in s.rows(
        "SELECT team FROM portal_jobs UNION SELECT team FROM balance_log UNION SELECT team FROM portal_grants "
        "UNION SELECT team FROM decision_victims UNION SELECT team FROM portal_decisions") if r["team"]), pin=True)


def _view(portal: Portal, s: Snapshot, p: Principal) -> View:
    return View(p, _all_teams(s), portal.alias_key)


def _job(portal: Portal, s: Snapshot, p: Principal, job_id: str) -> Optional[JobOut]:
    if not NAME_RE.match(job_id or ""):
        return None
    # job ids are unique only within a pool: the latest submission of this id that the caller may read (another
    # team's namesake neither shadows their job nor is shown)
    subs = s.memo(("job_subs", job_id), lambda s: s.rows(
        "SELECT pool, team, submitted_at FROM portal_jobs WHERE job_id = ? ORDER BY submitted_at DESC, pool",
        [job_id]))
    pick = next((r for r in subs if p.can_read_team(r["team"])), None)
    if pick is None:
        return None
    got = s.memo(("job", job_id, pick["pool"]), lambda s: _job_compute(s, job_id, pick["pool"]))
    if got is None or not p.can_read_team(got[0].team):
        return None
    out, refs, bodies = got
    if p.is_staff:
        return out
    # the job ids its free text (a scheduler's messages) names, and whose they are: once per job, for every view
    owners = s.memo(("job_named", job_id, pick["pool"]), lambda s: _job_named(s, job_id, pick["pool"]))
    # the decisions in its timeline (a preemption's sentence names the other teams) as this caller may read them
    view = _view(portal, s, p)
    shown_ids = {did: view.decision_id(did, body) for did, body in bodies.items()}
    # a preemption naming a decision the lake does not hold (a scheduler's, or not written yet): no payload says
    # whose job its id carries, so it is shown as an alias
    shown_ids.update({ref: view.alias(ref) for ref in refs if ref and ref not in bodies})

    def ids_shown(text: str) -> str:  # "preempted by decision ID …": the id as this caller sees it
        for did, shown in shown_ids.items():
            if shown != did:
                text = text.replace(did, shown)
        return text

    timeline = []
    for entry, ref in zip(out.timeline, refs):
        if ref is not None and entry.type.startswith("decision"):
            entry = entry.model_copy(update={"detail": view.message(bodies.get(ref, {}), entry.detail) or ""})
        else:
            entry = entry.model_copy(update={"detail": view.free_text(ids_shown(entry.detail), owners) or ""})
        timeline.append(entry)

    def why_value(v):  # its sentences (a scheduler's message is free text): the last check for hidden names
        if isinstance(v, str):
            return view.free_text(ids_shown(v), owners)
        if isinstance(v, (list, tuple)):
            return type(v)(why_value(x) for x in v)
        return v

    return out.model_copy(update={"timeline": timeline, "why": {k: why_value(v) for k, v in out.why.items()}})


def _job_named(s: Snapshot, job_id: str, pool: str) -> dict[str, frozenset[str]]:
    """The job ids the free text of the job's timeline and `why` names, and whose they are (`job_owners`)."""
    got = s.memo(("job", job_id, pool), lambda s: _job_compute(s, job_id, pool))
    if got is None:
        return {}
    out = got[0]
    return job_owners(s, [*(e.detail for e in out.timeline), *_strings(out.why)])


def _strings(v) -> list[str]:
    """The strings in `v` (a `why`: strings, numbers, lists of them)."""
    if isinstance(v, str):
        return [v]
    if isinstance(v, dict):
        v = list(v.values())
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in _strings(item)]
    return []


def _job_compute(s: Snapshot, job_id: str, pool: str) -> Optional[tuple[JobOut, list, dict]]:
    """The job of that id in `pool` (what staff see), the decision id behind each timeline entry (or None), and
    those decisions' bodies."""
    rows = s.rows("SELECT * FROM portal_jobs WHERE job_id = ? AND pool = ? ORDER BY submitted_at DESC LIMIT 1",
                  [job_id, pool])
    if not rows:
        return None
    j = rows[0]
    from chipledger.reports.why import explain

    cur = s.cursor()
    try:
        ex = explain(cur, job_id)
    finally:
        cur.close()
    if (ex.pool, ex.team) != (j["pool"], j["team"]):
        # `explain` found a namesake (job ids are unique only within a pool: it prefers a pending job of that id,
        # maybe another team's in another pool): none of it is this job's, so none of it is shown
        from chipledger.reports.why import Explanation

        last = s.rows("SELECT last_type FROM portal_job_last WHERE pool = ? AND job_id = ?", [j["pool"], job_id])
        kind = last[0]["last_type"] if last else ""
        status = ("finished" if j["finished_at"] is not None else
                  {"job.submitted": "pending", "job.preempted": "pending", "job.released": "pending",
                   "job.waiting": "pending"}.get(kind, "running" if kind else "unknown"))
        ex = Explanation(job_id, True, pool=j["pool"], team=j["team"], status=status)
    timeline = []  # (entry, the decision it shows or names)
    for r in s.rows("SELECT applied_at, type, body FROM events WHERE job_id = ? AND pool = ? AND applied_at >= ? "
                    "ORDER BY applied_at, \"offset\"", [job_id, j["pool"], j["submitted_at"]]):
        ref = None
        if r["type"] == "job.preempted":
            try:
                ref = json.loads(r["body"]).get("decision_id")
            except Exception:
                ref = None
        timeline.append((TimelineEntry(at=r["applied_at"], type=r["type"], detail=_event_detail(r["type"], r["body"])),
                         ref))
    for at, did, role, message in ex.decisions:
        timeline.append((TimelineEntry(at=datetime.strptime(at, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc),
                                       type=f"decision ({role})", detail=message), did))
    for r in s.rows("SELECT run_index, started_at, ended_at, end_reason, lost_mchip_s FROM portal_runs "
                    "WHERE job_id = ? AND pool = ? AND submitted_at = ? AND lost_mchip_s > 0",
                    [job_id, j["pool"], j["submitted_at"]]):
        timeline.append((TimelineEntry(at=r["ended_at"] or r["started_at"], type="lost work",
                                       detail=f"run {r['run_index']} lost {r['lost_mchip_s'] / 3.6e6:.2f} chip-hours of "
                                              f"work since its last checkpoint ({r['end_reason']})"), None))
    timeline.sort(key=lambda e: e[0].at)
    refs = [ref for _, ref in timeline]
    ids = sorted({ref for ref in refs if ref})
    bodies = {r["decision_id"]: json.loads(r["body"] or "{}") for r in s.rows(
        "SELECT decision_id, body FROM portal_decisions WHERE list_contains(?, decision_id)", [ids])} if ids else {}
    out = JobOut(job_id=j["job_id"], pool=j["pool"], team=j["team"], user=j["user"], chips=j["chips"],
                  priority=j["priority"], status=ex.status or "unknown", submitted_at=j["submitted_at"],
                  first_started_at=j["first_started_at"], finished_at=j["finished_at"], outcome=j["outcome"],
                  preemptions=j["preemptions"], allocated_mchip_s=j["allocated_mchip_s"],
                  lost_mchip_s=j["lost_mchip_s"], timeline=[e for e, _ in timeline],
                  why={k: v for k, v in ex.as_dict().items() if k not in ("history", "decisions")})
    return out, refs, bodies


def _event_detail(kind: str, body: str) -> str:
    try:
        b = json.loads(body)
    except Exception:
        return ""
    if kind == "job.submitted":
        extra = f", expected to run {_duration(b['expected_runtime_s'])}" if b.get("expected_runtime_s") else ""
        return f"{b.get('chips')} chips, priority {b.get('priority', 0)}{extra}"
    if kind == "job.preempted":
        by = f" by decision {b['decision_id']}" if b.get("decision_id") else ""
        return f"preempted{by}" + (f" ({b['reason']})" if b.get("reason") else "")
    if kind == "job.finished":
        return f"outcome {b.get('outcome')}"
    if kind == "job.waiting":
        return f"{b.get('reason')}: {b.get('message', '')}"
    if kind == "job.started":
        return f"on {len(b['chip_ids'])} chips" if b.get("chip_ids") else "started"
    return ""


def _statements(portal: Portal, team: str) -> list[StatementOut]:
    if portal.store is None:
        return []
    out = []
    for r in portal.store.statement_runs(team):
        fmts = [f for f in r.formats.split(",") if f]
        out.append(StatementOut(statement_id=r.statement_id, team=r.team, period_start=r.period_start,
                                period_end=r.period_end, issued_at=r.issued_at, formats=fmts,
                                downloads={f: statement_url(r.statement_id, f) for f in fmts}))
    return out


def _statement_path(portal: Portal, p: Principal, statement_id: str, fmt: str) -> Path:
    from chipledger.reports.statements import file_stem

    if fmt not in ("html", "md", "csv", "json", "svg") or portal.store is None or portal.statements_dir is None:
        raise HTTPException(404, "no such statement")
    team, sep, label = statement_id.rpartition("@")
    if not sep or not re.fullmatch(r"[0-9A-Za-z.\-]{1,40}", label) or not p.can_read_team(team):
        raise HTTPException(404, "no such statement")
    if not any(r.statement_id == statement_id for r in portal.store.statement_runs(team)):
        raise HTTPException(404, "no such statement")
    base = portal.statements_dir.resolve()
    path = (base / label / f"{file_stem(team)}.{fmt}").resolve()
    if base not in path.parents or not path.is_file():
        raise HTTPException(404, "no such statement file")
    return path


def _bursts(portal: Portal, s: Snapshot, team: str) -> list[BurstOut]:
    decided = {r["request_id"]: r for r in s.cached_rows(
        "SELECT request_id, verdict, message, body FROM portal_decisions WHERE type = 'decision.burst' AND team = ?",
        [team])}
    out = []
    for r in s.cached_rows("SELECT * FROM portal_bursts WHERE team = ? ORDER BY requested_at DESC", [team]):
        d = decided.get(r["request_id"])
        granted = json.loads(d["body"]).get("chips_granted") if d else None
        out.append(BurstOut(request_id=r["request_id"], pool=r["pool"], team=r["team"], chips=r["chips_milli"] / 1000,
                            requested_by=r["requested_by"], requested_at=r["requested_at"],
                            window_start=r["window_start"], window_end=r["window_end"],
                            status=d["verdict"] if d else "pending", chips_granted=granted,
                            message=d["message"] if d else None))
    known = {b.request_id for b in out}
    for sent in portal_sent(portal, team):
        if sent["request_id"] not in known:
            out.insert(0, BurstOut(status="pending", chips_granted=None, message="sent; the ledger has not "
                                   "decided it yet (the page refreshes)", requested_at=None, **{
                                       k: sent[k] for k in ("request_id", "pool", "team", "chips", "requested_by",
                                                            "window_start", "window_end")}))
    return out


def portal_sent(portal: Portal, team: str) -> list[dict]:
    return [x for x in portal.sent if x["team"] == team]


def _dry_run(portal: Portal, req: BurstIn, user: str, s: Optional[Snapshot] = None) -> dict:
    wait = portal.dry_limiter.wait_s(user)
    if wait:
        raise HTTPException(429, f"too many dry runs: try again in {wait} s", headers={"Retry-After": str(wait)})
    out = burst_mod.dry_run(s or portal.reader.snapshot, req.pool, req.team, req.chips, req.window_start, req.window_end,
                            portal.cfg.slo.availability)
    if out is None:
        raise HTTPException(404, "no such pool (or its books have not closed yet)")
    return out


def _submit(portal: Portal, p: Principal, req: BurstIn) -> SubmittedOut:
    if portal.producer_factory is None:
        raise HTTPException(503, "burst requests need the Kafka pipeline, and this portal has none configured "
                                 "(start it with --bootstrap); the dry run works without it")
    wait = portal.limiter.wait_s(p.user)
    if wait:
        raise HTTPException(429, f"too many burst requests: try again in {wait} s",
                            headers={"Retry-After": str(wait)})
    now = datetime.now(timezone.utc)
    request_id = f"portal-{now:%Y%m%d%H%M%S}-{uuid.uuid4().hex[:8]}"
    event_id = f"{request_id}:requested"
    ev = burst_mod.burst_event(req.pool, req.team, req.chips, req.window_start, req.window_end, req.reason,
                               p.user, request_id, event_id, now)
    from streams.producer import InvalidEvent

    try:
        fut = portal.producer().send(ev)
        portal.producer().flush(10)
        if hasattr(fut, "get"):
            fut.get(timeout=10)
    except InvalidEvent as e:
        raise HTTPException(422, f"the request is not a valid burst.requested: {e}") from None
    except Exception as e:
        raise HTTPException(503, f"could not send the request to Kafka: {str(e).splitlines()[0] if str(e) else e}")
    del portal.sent[:-999]  # the requests this process sent, until the lake has them (bounded)
    portal.sent.append({"request_id": request_id, "pool": req.pool, "team": req.team,
                                             "chips": req.chips, "requested_by": p.user,
                                             "window_start": req.window_start, "window_end": req.window_end})
    return SubmittedOut(request_id=request_id, event_id=event_id, status="pending")


def _parse_when(text: str) -> datetime:
    text = (text or "").strip()
    try:
        d = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is not a date and time (YYYY-MM-DDTHH:MM, UTC)") from None
    return d if d.tzinfo else d.replace(tzinfo=timezone.utc)
