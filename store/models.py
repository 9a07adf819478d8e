"""Tables of the store. Amounts are integer milli-chips (rates) and milli-chip-seconds (totals)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Optional

from sqlalchemy import BigInteger, DateTime, Float, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


class UTCDateTime(TypeDecorator):
    """An instant: zone-aware in, stored in UTC, zone-aware UTC out, on every backend. (A bare
    DateTime(timezone=True) gives naive datetimes back on SQLite, which keeps no zone and stores an aware
    value's wall time as is; PostgreSQL gives them back in the session's TimeZone.) Naive values are refused."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: the store needs zone-aware instants")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    pass


class PoolBalance(Base):
    """One row per pool: its clock and the rates of its pool accounts now, with event counters."""

    __tablename__ = "pool_balances"
    pool: Mapped[str] = mapped_column(String(256), primary_key=True)
    flavor: Mapped[str] = mapped_column(String(256))
    chips_per_node: Mapped[int] = mapped_column(Integer)
    clock: Mapped[datetime] = mapped_column(UTCDateTime())
    chips: Mapped[int] = mapped_column(Integer)
    capacity_milli: Mapped[int] = mapped_column(BigInteger)
    unavailable_milli: Mapped[int] = mapped_column(BigInteger)
    idle_milli: Mapped[int] = mapped_column(BigInteger)
    overcommitted_milli: Mapped[int] = mapped_column(BigInteger)
    running_jobs: Mapped[int] = mapped_column(Integer)
    pending_jobs: Mapped[int] = mapped_column(Integer)
    applied: Mapped[int] = mapped_column(BigInteger)
    duplicates: Mapped[int] = mapped_column(BigInteger)
    rejected: Mapped[int] = mapped_column(BigInteger)
    late_events: Mapped[int] = mapped_column(BigInteger)
    max_lateness_s: Mapped[int] = mapped_column(BigInteger)


class TeamBalance(Base):
    """One row per pool and team: quota and use now (milli-chips) and totals posted so far (mchip-s)."""

    __tablename__ = "team_balances"
    pool: Mapped[str] = mapped_column(String(256), primary_key=True)
    team: Mapped[str] = mapped_column(String(256), primary_key=True)
    nominal_milli: Mapped[int] = mapped_column(BigInteger)
    used_milli: Mapped[int] = mapped_column(BigInteger)
    in_quota_milli: Mapped[int] = mapped_column(BigInteger)
    borrowed_milli: Mapped[int] = mapped_column(BigInteger)
    burst_milli: Mapped[int] = mapped_column(BigInteger)
    running_jobs: Mapped[int] = mapped_column(Integer)
    pending_jobs: Mapped[int] = mapped_column(Integer)
    entitled_mchip_s: Mapped[int] = mapped_column(BigInteger)
    in_quota_mchip_s: Mapped[int] = mapped_column(BigInteger)
    borrowed_mchip_s: Mapped[int] = mapped_column(BigInteger)
    burst_mchip_s: Mapped[int] = mapped_column(BigInteger)
    # fair share (ledger.policy): decayed usage and factor as of the last close of an hour, borrowed share now
    decayed_usage_mchip_s: Mapped[int] = mapped_column(BigInteger, default=0)
    fair_share_factor: Mapped[float] = mapped_column(Float, default=1.0)
    borrowed_share: Mapped[float] = mapped_column(Float, default=0.0)


class GrantRow(Base):
    """Grants held: in effect now (`active`) or starting later."""

    __tablename__ = "grants"
    pool: Mapped[str] = mapped_column(String(256), primary_key=True)
    grant_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    team: Mapped[str] = mapped_column(String(256))
    chips_milli: Mapped[int] = mapped_column(BigInteger)
    borrowing_limit_milli: Mapped[Optional[int]] = mapped_column(BigInteger, nullable=True)
    lending_limit_milli: Mapped[Optional[int]] = mapped_column(BigInteger, nullable=True)
    effective_from: Mapped[Optional[datetime]] = mapped_column(UTCDateTime(), nullable=True)
    effective_until: Mapped[Optional[datetime]] = mapped_column(UTCDateTime(), nullable=True)
    active: Mapped[bool]


class RunLog(Base):
    """One row per embedded run or sink session: what was read and what came of it."""

    __tablename__ = "runs"
    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    source: Mapped[str] = mapped_column(Text)
    lake: Mapped[str] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime] = mapped_column(UTCDateTime())
    lines: Mapped[int] = mapped_column(BigInteger)
    accepted: Mapped[int] = mapped_column(BigInteger)
    duplicates: Mapped[int] = mapped_column(BigInteger)
    dead_letters: Mapped[int] = mapped_column(BigInteger)
    summary_json: Mapped[str] = mapped_column(Text)


class Tracking(Base):
    """The last input position whose effects are in the store, per consumer (exactly-once downstream)."""

    __tablename__ = "tracking"
    consumer: Mapped[str] = mapped_column(String(256), primary_key=True)
    topic: Mapped[str] = mapped_column(String(1024), primary_key=True)
    partition: Mapped[int] = mapped_column(Integer, primary_key=True)
    offset: Mapped[int] = mapped_column(BigInteger)


class DecisionIndex(Base):
    """One row per decision the ledger emitted (preemptions and burst verdicts), to find them without the lake:
    by pool, time, rule, team or job. `body` is the decision's full JSON as written to the lake."""

    __tablename__ = "decisions"
    decision_id: Mapped[str] = mapped_column(String(512), primary_key=True)
    type: Mapped[str] = mapped_column(String(64))
    pool: Mapped[str] = mapped_column(String(256), index=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    rule: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text)
    team: Mapped[Optional[str]] = mapped_column(String(256), nullable=True)    # beneficiary's team or burst team
    job_id: Mapped[Optional[str]] = mapped_column(String(256), nullable=True)  # the beneficiary job
    verdict: Mapped[Optional[str]] = mapped_column(String(32), nullable=True)  # bursts: approved/partial/denied
    victims: Mapped[int] = mapped_column(Integer)                              # preemptions: jobs preempted
    body: Mapped[str] = mapped_column(Text)


class StatementRun(Base):
    """One row per statement issued: for whom and which period, the log positions it was computed at (so it
    can be reproduced exactly) and the digest of what was written."""

    __tablename__ = "statement_runs"
    statement_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    team: Mapped[str] = mapped_column(String(256), index=True)
    period_start: Mapped[datetime] = mapped_column(UTCDateTime())
    period_end: Mapped[datetime] = mapped_column(UTCDateTime())
    positions_json: Mapped[str] = mapped_column(Text)      # {"topic/partition": offset, ...} it was computed at
    output_digest: Mapped[str] = mapped_column(String(128))  # e.g. "sha256:…" of the files written
    formats: Mapped[str] = mapped_column(String(128))      # e.g. "md,html,csv,json"
    issued_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ApiToken(Base):
    """One row per API token of the portal (`chipledger serve tokens`): whose it is, the team it acts for, and the
    SHA-256 of its secret (the secret itself is shown once, at creation, and never stored)."""

    __tablename__ = "api_tokens"
    token_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user: Mapped[str] = mapped_column(String(256), index=True)
    team: Mapped[Optional[str]] = mapped_column(String(256), nullable=True)
    secret_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[Optional[datetime]] = mapped_column(UTCDateTime(), nullable=True)


class PortalSession(Base):
    """One row per signed-in browser session of the portal (chipledger/web/auth.py `Sessions`): the SHA-256 of the
    cookie's session id (the cookie itself is never stored), the token it was started with, and when it ends. Kept
    here so that a restart, or another replica on the same store, does not sign anyone out; signing out deletes it."""

    __tablename__ = "portal_sessions"
    session_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_id: Mapped[str] = mapped_column(String(64), index=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)


class PortalKey(Base):
    """A secret key of the portal (chipledger/web/app.py `Portal`): the CSRF tokens' and the hidden decision ids'
    aliases' HMAC keys, made once by the first portal on this store and read by every later one, so a restart keeps
    a page's form valid and replicas on one store give the same tokens and aliases."""

    __tablename__ = "portal_keys"
    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    key_hex: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
