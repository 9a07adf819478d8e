"""Hourly books: exact integer accrual of milli-chip-seconds into accounts, closed per UTC hour.

Between two events of a pool every rate is constant, so an account only needs its current rate (milli-chips),
the instant that rate has applied since, and what it has accrued in the open hour. Accrual is lazy: an
account is brought up to date only when its rate changes or the hour closes, which keeps the cost of an event
proportional to the accounts it touches, not to the size of the pool.

Journal postings are deltas: a close of the books in the middle of an hour (`flush`) posts what accrued so
far, and the rest of that hour is posted later. Summing postings by (pool, hour, account, team) gives the
books; the sums do not depend on where the fold was paused.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

HOUR_S = 3600

# Account names (DESIGN §4). Pool accounts have team None.
CAPACITY = "capacity"
UNAVAILABLE = "unavailable"
IDLE = "idle"
OVERCOMMITTED = "overcommitted"
IN_QUOTA = "in_quota"
BORROWED = "borrowed"
BURST = "burst"
ENTITLED = "entitled"
PENDING = "pending"  # chips of the team's jobs waiting to start: demand not met (not part of conservation)

POOL_ACCOUNTS = (CAPACITY, UNAVAILABLE, IDLE, OVERCOMMITTED)
TEAM_ACCOUNTS = (IN_QUOTA, BORROWED, BURST, ENTITLED, PENDING)
ACCOUNTS = POOL_ACCOUNTS + TEAM_ACCOUNTS


class JournalRow(NamedTuple):
    pool: str
    hour: int  # start of the UTC hour, epoch seconds
    account: str
    team: Optional[str]
    amount_mchip_s: int


_new_tuple = tuple.__new__  # a NamedTuple row without its Python-level __new__


def hour_of(t: int) -> int:
    return t - t % HOUR_S


_IDLE_KEY = (IDLE, None)
# idle = capacity - unavailable + overcommitted - the teams' in_quota, borrowed and burst, at every instant
# (conservation); the books derive the idle account from the others rather than re-rating it at every charge
_USED = frozenset({IN_QUOTA, BORROWED, BURST})
_POOL_SIGNS = (((CAPACITY, None), 1), ((UNAVAILABLE, None), -1), ((OVERCOMMITTED, None), 1))


class Books:
    """The accounts of one pool. `accounts[(account, team)] = [rate_milli, since_s, open_amount_mchip_s]`.

    Accounts are created on first use and kept (a handful per team), so the fold can hold on to an account's
    list and update it in place: `team_accounts` and `pool_accounts` give those handles.

    The pool's `idle` account is not rated by the fold: whenever it is read (`rate`, a post, `settle_idle`) it
    is derived from the others, idle = capacity - unavailable + overcommitted - the teams' in_quota, borrowed
    and burst (conservation holds at every instant, so the integrals over an hour agree exactly). Its stored
    list is brought up to date only then."""

    __slots__ = ("pool", "open_hour", "accounts", "totals", "_handles", "_used")

    def __init__(self, pool: str, open_hour: int):
        self.pool = pool
        self.open_hour = open_hour
        self.accounts: dict[tuple[str, Optional[str]], list[int]] = {}
        self.totals: dict[tuple[str, Optional[str]], int] = {}  # everything posted so far, per account
        self._handles: dict[Optional[str], tuple[list[int], ...]] = {}
        self._used: list[list[int]] = []  # the teams' in_quota, borrowed and burst accounts (idle is derived)

    def rate(self, account: str, team: Optional[str] = None) -> int:
        acc = self.accounts.get((account, team))
        if acc and account == IDLE and team is None:
            return self._idle(0)[0]
        return acc[0] if acc else 0

    def _idle(self, t: int) -> tuple[int, int]:
        """(rate now, amount accrued since the last post up to t) of the idle account, derived."""
        rate = amount = 0
        for acc in self._used:
            r = acc[0]
            rate -= r
            amount -= acc[2] + r * (t - acc[1])
        accounts = self.accounts
        for key, sign in _POOL_SIGNS:
            acc2 = accounts.get(key)
            if acc2 is not None:
                rate += sign * acc2[0]
                amount += sign * (acc2[2] + acc2[0] * (t - acc2[1]))
        return rate, amount

    def accrued(self, account: str, team: Optional[str], t: int) -> int:
        """What the account accrued in the open hour up to instant t and has not posted yet (read-only): the
        journal's postings so far (`totals`) plus this are the account's total up to t."""
        if account == IDLE and team is None:
            return self._idle(t)[1]
        acc = self.accounts.get((account, team))
        return 0 if acc is None else acc[2] + acc[0] * (t - acc[1])

    def settle_idle(self, t: int) -> None:
        """Bring the stored idle account up to instant t (before the accounts are read as they are)."""
        acc = self.accounts.get(_IDLE_KEY)
        if acc is not None:
            acc[0], acc[2] = self._idle(t)
            acc[1] = t

    def account(self, key: tuple[str, Optional[str]]) -> list[int]:
        acc = self.accounts.get(key)
        if acc is None:
            acc = self.accounts[key] = [0, self.open_hour, 0]
            if key[0] in _USED and key[1] is not None:
                self._used.append(acc)
        return acc

    def team_accounts(self, team: str) -> tuple[list[int], ...]:
        """(in_quota, borrowed, burst, entitled, pending) of a team."""
        h = self._handles.get(team)
        if h is None:
            h = self._handles[team] = tuple(self.account((a, team)) for a in TEAM_ACCOUNTS)
        return h

    def pool_accounts(self) -> tuple[list[int], ...]:
        """(capacity, unavailable, idle, overcommitted) of the pool."""
        h = self._handles.get(None)
        if h is None:
            h = self._handles[None] = tuple(self.account((a, None)) for a in POOL_ACCOUNTS)
        return h

    def close_hour(self, out: list) -> None:
        """Post the open hour in full and open the next one."""
        end = self.open_hour + HOUR_S
        self._post(end, out)
        self.open_hour = end

    def skip_hours(self, n: int) -> None:
        """Open the hour n hours on, over a stretch where nothing accrues (every rate 0, the open hour just
        closed): those hours would post nothing, so none of them is visited."""
        t = self.open_hour = self.open_hour + n * HOUR_S
        for acc in self.accounts.values():
            acc[1] = t

    def flush(self, t: int, out: list) -> None:
        """Post what accrued in the open hour up to instant t (a partial close of the books)."""
        self._post(t, out)

    def _post(self, t: int, out: list) -> None:
        self.settle_idle(t)
        hour = self.open_hour
        pool = self.pool
        totals = self.totals
        append = out.append
        for key, acc in self.accounts.items():
            amount = acc[2] + acc[0] * (t - acc[1])
            acc[1] = t
            acc[2] = 0
            if amount:
                append(_new_tuple(JournalRow, (pool, hour, key[0], key[1], amount)))
                totals[key] = totals.get(key, 0) + amount

    def to_dict(self) -> dict:
        return {
            "open_hour": self.open_hour,
            "accounts": [[k[0], k[1], *v] for k, v in self.accounts.items()],
            "totals": [[k[0], k[1], v] for k, v in self.totals.items()],
        }

    @classmethod
    def from_dict(cls, pool: str, d: dict) -> "Books":
        b = cls(pool, d["open_hour"])
        b.accounts = {(a, t): [r, s, amt] for a, t, r, s, amt in d["accounts"]}
        b._used = [acc for k, acc in b.accounts.items() if k[0] in _USED and k[1] is not None]
        b.totals = {(a, t): v for a, t, v in d["totals"]}
        return b


def set_rate(acc: list[int], rate: int, t: int) -> None:
    """Bring an account up to instant t at its old rate, then switch it to `rate`."""
    if acc[0] != rate:
        acc[2] += acc[0] * (t - acc[1])
        acc[1] = t
        acc[0] = rate
