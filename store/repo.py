"""Writing and reading the store. One transaction per save: balances, grants, run log and tracking together."""

from __future__ import annotations

import re

import json
from datetime import datetime, timezone
from typing import Callable, Iterable, Optional

from sqlalchemy import create_engine, delete, inspect, select, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, NoSuchModuleError
from sqlalchemy.orm import Session

from ledger.books import BORROWED, BURST, ENTITLED, IDLE, IN_QUOTA, OVERCOMMITTED
from ledger.policy import store_balances
from ledger.state import PoolState
from store.models import (ApiToken, Base, DecisionIndex, GrantRow, PoolBalance, PortalKey, PortalSession, RunLog,
                          StatementRun, TeamBalance, Tracking)


class StoreError(RuntimeError):
    pass


def _utc(epoch_s: Optional[int]) -> Optional[datetime]:
    return None if epoch_s is None else datetime.fromtimestamp(epoch_s, tz=timezone.utc)


# the PyPI package of each database driver SQLAlchemy's dialects import
DRIVER_PACKAGES = {"MySQLdb": "mysqlclient", "pymysql": "PyMySQL", "mysql": "mysql-connector-python",
                   "psycopg2": "psycopg2-binary", "psycopg": "'psycopg[binary]'", "asyncpg": "asyncpg",
                   "pg8000": "pg8000", "pyodbc": "pyodbc", "oracledb": "oracledb", "cx_Oracle": "cx_Oracle",
                   "aiomysql": "aiomysql", "aiosqlite": "aiosqlite"}


_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*):[^@\s]*@")


def mask_url(url: str) -> str:
    """A database URL as it may be printed: its password (if any) as `***` (issue 31: `run` and `sink` errors printed
    it). Works on URLs SQLAlchemy cannot parse too."""
    return _USERINFO.sub(lambda m: f"{m.group('head')}:***@", str(url))


def _hide(text: str, url: str) -> str:
    """`text` (a driver's message) with the URL's password, wherever it appears, as `***`."""
    try:
        password = make_url(url).password
    except ArgumentError:
        password = None
    text = mask_url(text)
    # a password long enough not to be a common word part, echoed by a driver outside a URL
    return text.replace(str(password), "***") if password and len(str(password)) >= 6 else text


def open_store(url: str) -> "Store":
    """Open (and create the tables of) the store at a SQLAlchemy URL, e.g. sqlite:///chipledger.db or
    postgresql://user@host/db (psycopg 3). Error messages never show the URL's password."""
    shown = mask_url(url)
    try:
        parsed = make_url(url)
    except ArgumentError as err:
        raise StoreError(f"not a database URL: {shown!r} ({_hide(str(err), url)})") from None
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    try:
        engine = create_engine(parsed)
    except ImportError as err:  # the dialect's driver is not installed: name the package that provides it
        module = (getattr(err, "name", None) or "").split(".")[0]
        package = DRIVER_PACKAGES.get(module, module or "its driver")
        raise StoreError(f"store {parsed.drivername}: the database driver is not installed (Python module "
                         f"{module or '?'}): pip install {package}") from None
    except NoSuchModuleError:
        raise StoreError(f"store {shown!r}: unknown database kind {parsed.drivername!r} (sqlite:///FILE or "
                         "postgresql://USER@HOST/DB)") from None
    try:
        Base.metadata.create_all(engine)
        upgrade_tables(engine)
    except Exception as err:  # an unreachable server or unwritable file: say so plainly
        raise StoreError(f"cannot open store {shown!r}: {_hide(str(err), url)}") from None
    return Store(engine)


def upgrade_tables(engine: Engine) -> list[str]:
    """Add the columns a store written by an earlier chipledger lacks (`create_all` makes missing tables, not
    missing columns). A column is added nullable, with its model default as the server default when it has a
    plain one; the tables that gain columns hold current state that the next save rewrites. Returns the columns
    added, as `table.column`."""
    added = []
    existing = inspect(engine)
    for table in Base.metadata.sorted_tables:
        if not existing.has_table(table.name):
            continue
        have = {c["name"] for c in existing.get_columns(table.name)}
        for col in table.columns:
            if col.name in have:
                continue
            ddl = f"ALTER TABLE {engine.dialect.identifier_preparer.format_table(table)} ADD COLUMN " \
                  f"{engine.dialect.identifier_preparer.format_column(col)} {col.type.compile(dialect=engine.dialect)}"
            default = col.default.arg if col.default is not None and col.default.is_scalar else None
            if isinstance(default, (int, float)) and not isinstance(default, bool):
                ddl += f" DEFAULT {default!r}"
            with engine.begin() as conn:
                conn.execute(text(ddl))
            added.append(f"{table.name}.{col.name}")
    return added


class Store:
    def describe(self, err: BaseException) -> str:
        """A database error of this store in one line, for a user (the driver's message, without the URL's
        password)."""
        text = str(getattr(err, "orig", None) or err).strip().splitlines()
        return _hide(text[0] if text else type(err).__name__, self.engine.url.render_as_string(hide_password=False))

    def __init__(self, engine: Engine):
        self.engine = engine

    def save(self, pools: Iterable[PoolState], run: Optional[dict] = None,
             tracking: Optional[list[tuple[str, str, int, int]]] = None, replace_all: bool = False,
             decisions: Iterable[tuple] = ()) -> None:
        """Replace the current balances and grants of these pools, index the decisions (rows of the lake's
        `decisions` table: decision_id, type, pool, at (epoch s), rule, message, body) and record the run and the
        input positions, in one transaction. With `replace_all`, pools not among these are removed and the
        decisions index is replaced (the state and the decisions are complete); otherwise decisions are merged by
        id (indexing the same decision again changes nothing)."""
        pools = list(pools)
        with Session(self.engine) as session, session.begin():
            if replace_all:
                names = [s.pool for s in pools]
                for model in (TeamBalance, GrantRow, PoolBalance):
                    session.execute(delete(model).where(model.pool.not_in(names)))
                session.execute(delete(DecisionIndex))
            for row in decisions:
                session.merge(_decision_row(row))
            for s in pools:
                session.execute(delete(TeamBalance).where(TeamBalance.pool == s.pool))
                session.execute(delete(GrantRow).where(GrantRow.pool == s.pool))
                session.merge(_pool_row(s))
                session.add_all(_team_rows(s))
                session.add_all(_grant_rows(s))
            if run is not None:
                session.merge(RunLog(**{**run, "summary_json": json.dumps(run.get("summary_json", {}),
                                                                             sort_keys=True)}))
            for consumer, topic, partition, offset in tracking or ():
                session.merge(Tracking(consumer=consumer, topic=topic, partition=partition, offset=offset))

    def pool_balances(self) -> list[PoolBalance]:
        with Session(self.engine) as session:
            return list(session.scalars(select(PoolBalance).order_by(PoolBalance.pool)))

    def team_balances(self, pool: Optional[str] = None) -> list[TeamBalance]:
        q = select(TeamBalance).order_by(TeamBalance.pool, TeamBalance.team)
        if pool is not None:
            q = q.where(TeamBalance.pool == pool)
        with Session(self.engine) as session:
            return list(session.scalars(q))

    def grants(self) -> list[GrantRow]:
        with Session(self.engine) as session:
            return list(session.scalars(select(GrantRow).order_by(GrantRow.pool, GrantRow.grant_id)))

    def runs(self) -> list[RunLog]:
        with Session(self.engine) as session:
            return list(session.scalars(select(RunLog).order_by(RunLog.started_at)))

    def decisions(self, pool: Optional[str] = None, since: Optional[datetime] = None,
                  until: Optional[datetime] = None) -> list[DecisionIndex]:
        """Indexed decisions in time order (then by id), optionally of one pool and within [since, until)."""
        q = select(DecisionIndex).order_by(DecisionIndex.at, DecisionIndex.decision_id)
        if pool is not None:
            q = q.where(DecisionIndex.pool == pool)
        if since is not None:
            q = q.where(DecisionIndex.at >= since)
        if until is not None:
            q = q.where(DecisionIndex.at < until)
        with Session(self.engine) as session:
            return list(session.scalars(q))

    def record_statement(self, *, statement_id: str, team: str, period_start: datetime, period_end: datetime,
                         positions: dict[str, int], output_digest: str, formats: Iterable[str],
                         issued_at: datetime) -> None:
        """Record (or re-record, by id) an issued statement with the log positions it was computed at."""
        if period_end <= period_start:
            raise ValueError(f"statement {statement_id!r}: period_end {period_end} is not after {period_start}")
        row = StatementRun(statement_id=statement_id, team=team, period_start=period_start, period_end=period_end,
                           positions_json=json.dumps(positions, sort_keys=True), output_digest=output_digest,
                           formats=",".join(formats), issued_at=issued_at)
        with Session(self.engine) as session, session.begin():
            session.merge(row)

    def statement_runs(self, team: Optional[str] = None) -> list[StatementRun]:
        q = select(StatementRun).order_by(StatementRun.issued_at, StatementRun.statement_id)
        if team is not None:
            q = q.where(StatementRun.team == team)
        with Session(self.engine) as session:
            return list(session.scalars(q))

    def add_token(self, row: ApiToken) -> None:
        with Session(self.engine) as session, session.begin():
            session.add(row)

    def tokens(self, user: Optional[str] = None, team: Optional[str] = None) -> list[ApiToken]:
        q = select(ApiToken).order_by(ApiToken.created_at, ApiToken.token_id)
        if user is not None:
            q = q.where(ApiToken.user == user)
        if team is not None:
            q = q.where(ApiToken.team == team)
        with Session(self.engine) as session:
            return list(session.scalars(q))

    def token(self, token_id: str) -> Optional[ApiToken]:
        with Session(self.engine) as session:
            return session.get(ApiToken, token_id)

    def revoke_token(self, token_id: str, at: datetime) -> bool:
        """Revoke a token (from `at` on); False when there is no such token or it was revoked already."""
        with Session(self.engine) as session, session.begin():
            row = session.get(ApiToken, token_id)
            if row is None or row.revoked_at is not None:
                return False
            row.revoked_at = at
            return True

    def start_session(self, row: PortalSession, keep_per_token: int) -> list[str]:
        """Record a portal session; in the same transaction, end the sessions whose time is over (at the new one's
        start) and the token's oldest beyond `keep_per_token` (the new one included). Returns the ids ended."""
        with Session(self.engine) as session, session.begin():
            ended = list(session.scalars(select(PortalSession.session_sha256).where(
                PortalSession.expires_at <= row.started_at)))
            mine = list(session.scalars(select(PortalSession.session_sha256).where(
                PortalSession.token_id == row.token_id, PortalSession.expires_at > row.started_at).order_by(
                PortalSession.started_at.desc(), PortalSession.session_sha256)))
            ended += mine[max(keep_per_token - 1, 0):]
            if ended:
                session.execute(delete(PortalSession).where(PortalSession.session_sha256.in_(ended)))
            session.add(row)
        return ended

    def portal_key(self, name: str, make: Callable[[], bytes]) -> bytes:
        """The portal's secret key `name`: the one kept here, else `make()`'s, kept (the first of two portals starting
        at once wins; the other reads it)."""
        for _ in range(2):
            with Session(self.engine) as session:
                row = session.get(PortalKey, name)
                if row is not None:
                    return bytes.fromhex(row.key_hex)
            try:
                with Session(self.engine) as session, session.begin():
                    session.add(PortalKey(name=name, key_hex=make().hex(), created_at=datetime.now(timezone.utc)))
            except IntegrityError:  # another portal kept its key first: read that one
                continue
        with Session(self.engine) as session:
            return bytes.fromhex(session.get(PortalKey, name).key_hex)

    def session(self, session_sha256: str) -> Optional[PortalSession]:
        with Session(self.engine) as session:
            return session.get(PortalSession, session_sha256)

    def end_session(self, session_sha256: str) -> bool:
        """Forget a portal session (signing out); False when there was none."""
        with Session(self.engine) as session, session.begin():
            return session.execute(delete(PortalSession).where(
                PortalSession.session_sha256 == session_sha256)).rowcount > 0

    def position(self, consumer: str, topic: str, partition: int) -> Optional[int]:
        with Session(self.engine) as session:
            row = session.get(Tracking, (consumer, topic, partition))
            return None if row is None else row.offset


def _pool_row(s: PoolState) -> PoolBalance:
    rate = s.books.rate
    return PoolBalance(
        pool=s.pool, flavor=s.flavor, chips_per_node=s.chips_per_node, clock=_utc(s.clock), chips=len(s.chips),
        capacity_milli=s.capacity_milli, unavailable_milli=s.unavailable_milli, idle_milli=rate(IDLE),
        overcommitted_milli=rate(OVERCOMMITTED),
        running_jobs=sum(t.running for t in s.teams.values()), pending_jobs=sum(t.pending for t in s.teams.values()),
        applied=s.applied, duplicates=s.duplicates, rejected=s.rejected, late_events=s.late_events,
        max_lateness_s=s.max_lateness_s,
    )


def _team_rows(s: PoolState) -> list[TeamBalance]:
    rate, totals = s.books.rate, s.books.totals
    shares = store_balances(s)
    return [
        TeamBalance(
            pool=s.pool, team=name, nominal_milli=t.nominal_milli, used_milli=t.use_milli,
            in_quota_milli=rate(IN_QUOTA, name), borrowed_milli=rate(BORROWED, name),
            burst_milli=rate(BURST, name), running_jobs=t.running, pending_jobs=t.pending,
            entitled_mchip_s=totals.get((ENTITLED, name), 0), in_quota_mchip_s=totals.get((IN_QUOTA, name), 0),
            borrowed_mchip_s=totals.get((BORROWED, name), 0), burst_mchip_s=totals.get((BURST, name), 0),
            **shares[name],
        )
        for name, t in sorted(s.teams.items())
    ]


def _grant_rows(s: PoolState) -> list[GrantRow]:
    return [
        GrantRow(pool=s.pool, grant_id=g.grant_id, team=g.team, chips_milli=g.chips_milli,
                 borrowing_limit_milli=g.borrowing_limit_milli, lending_limit_milli=g.lending_limit_milli,
                 effective_from=_utc(g.effective_from), effective_until=_utc(g.effective_until), active=g.active)
        for g in sorted(s.grants.values(), key=lambda g: g.grant_id)
    ]


def _decision_row(row: tuple) -> DecisionIndex:
    decision_id, type_, pool, at, rule, message, body = row
    d = json.loads(body)
    beneficiary = d.get("beneficiary") or {}
    return DecisionIndex(decision_id=decision_id, type=type_, pool=pool, at=_utc(at), rule=rule, message=message,
                         team=beneficiary.get("team", d.get("team")), job_id=beneficiary.get("job_id"),
                         verdict=d.get("verdict"), victims=len(d.get("victims") or ()), body=body)
