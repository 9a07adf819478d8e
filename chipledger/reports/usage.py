"""`chipledger usage` and `chipledger share`: the books in the shapes Slurm admins read, `sreport cluster
AccountUtilizationByUser` and `sshare -l`, from the lake's views (no rule of the core computed again here).

Organisations: a team named as a path (`org/team`, what `slurm watch` writes for an account under a parent account,
docs/slurm.md) belongs to the org of its first part, as the `balances_org` view counts it; a team without `/` is its
own org and has no org row.

`usage` (per cluster, flavor, org, team and user, over [start, end)):
- team rows: the journal's `in_quota + borrowed + burst` of the team (the chip-seconds charged to it: its running
  jobs on available chips), by hour, so start and end are whole hours (sreport's are too);
- org rows: the sum of their teams' rows;
- user rows: the allocation of the team's runs submitted by the user (`job.submitted`'s `user`), a run's chips ×
  its seconds inside the window (the `job_runs` facts: started_at, ended_at, chips; a run still going counts up
  to its pool's last event);
- chips of different flavors are never added: one row per flavor (`TRES Name` in sreport's shape is
  `chip/<flavor>`); `percent` is of the capacity (journal `capacity`) of the same cluster and flavor.

`share` (per pool, as the ledger's fair share is per pool; at the latest close of the pool's books, or the last one
at or before `at`): the `balances` facts the fold wrote: RawShares = the team's nominal quota (chips), NormShares =
its share S of the pool's nominal quota, RawUsage = its decayed usage U (chip-seconds, half-life `[ledger]
decay_half_life_s`), NormUsage = U / ΣU, EffectvUsage = NormUsage (the ledger's fair share is flat: teams share
the pool), FairShare = the core's F = 2^(-(U/ΣU)/S). Org rows sum their teams' shares and usage (no factor of
their own); user rows show the user's allocated chip-seconds in the pool up to that instant (not decayed: the core
keeps no per-user usage).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Optional

import duckdb

UNITS = {"seconds": 1, "minutes": 60, "hours": 3600}
USED = ("in_quota", "borrowed", "burst")
# the user of each submission of a job (its last job.submitted's): the first CTE of the by-user queries
_SUBMITTERS = """
            WITH sub AS (
                SELECT pool, job_id, applied_at AS submitted_at, arg_max("user", "offset") AS "user"
                FROM events WHERE type = 'job.submitted' GROUP BY ALL
            )"""


def org_of(team: str) -> Optional[str]:
    """The org of a team named `org/team` (the first part), None for a team without `/`."""
    return team.split("/", 1)[0] if "/" in team else None


@dataclass(frozen=True)
class UsageRow:
    cluster: str
    flavor: str
    account: str      # the org, or the team (org/team)
    login: str        # '' for account rows
    used_mchip_s: int
    capacity_mchip_s: int  # of the cluster's pools of this flavor, over the window

    def used(self, unit: str) -> float:
        if unit == "percent":
            return 100.0 * self.used_mchip_s / self.capacity_mchip_s if self.capacity_mchip_s else 0.0
        return self.used_mchip_s / 1000 / UNITS[unit]


def _cluster(pool: str) -> str:
    return pool.split("/", 1)[0]


def flavors(con: duckdb.DuckDBPyConnection) -> dict[str, str]:
    """pool -> its flavor (its latest `pool.configured`)."""
    return dict(con.execute("SELECT pool, arg_max(body->>'$.flavor', applied_at) FROM events "
                            "WHERE type = 'pool.configured' GROUP BY pool").fetchall())


def usage(con: duckdb.DuckDBPyConnection, start: datetime, end: datetime, *, pool: Optional[str] = None,
          account: Optional[str] = None, user: Optional[str] = None, users: bool = True) -> list[UsageRow]:
    """sreport's AccountUtilizationByUser rows over [start, end): per (cluster, flavor), each org, its teams and
    their users, sorted as sreport sorts (an account, then its users; sub-accounts after)."""
    p = {"start": start, "end": end, "pool": pool}
    fl = flavors(con)
    books = con.execute(f"""
        SELECT pool, account, team, sum(amount_mchip_s)::BIGINT FROM journal
        WHERE hour >= $start AND hour < $end AND ($pool IS NULL OR pool = $pool)
          AND (account = 'capacity' AND team IS NULL OR account IN {USED} AND team IS NOT NULL)
        GROUP BY ALL""", p).fetchall()
    cap: dict = {}
    team_used: dict = {}
    for pl, acct, team, amount in books:
        key = (_cluster(pl), fl.get(pl, "?"))
        if acct == "capacity":
            cap[key] = cap.get(key, 0) + amount
        else:
            team_used[(*key, team)] = team_used.get((*key, team), 0) + amount
    user_used: dict = {}
    if users:
        rows = con.execute(_SUBMITTERS + """, runs AS (
                SELECT r.pool, r.team, sub."user", r.chips_milli, r.started_at,
                       coalesce(r.ended_at, to_timestamp(e.end_s)) AS ended_at
                FROM job_run_totals r
                LEFT JOIN sub ON sub.pool = r.pool AND sub.job_id = r.job_id AND sub.submitted_at = r.submitted_at
                JOIN base_pool_end e ON e.pool = r.pool
                WHERE r.started_at IS NOT NULL AND ($pool IS NULL OR r.pool = $pool)
            )
            SELECT pool, team, coalesce("user", ''),
                   sum(chips_milli * greatest(0, date_diff('second', greatest(started_at, $start),
                                                          least(ended_at, $end))))::BIGINT
            FROM runs GROUP BY ALL""", p).fetchall()
        for pl, team, login, amount in rows:
            if amount and login:  # runs submitted without a user count in their team's row only
                k = (_cluster(pl), fl.get(pl, "?"), team, login)
                user_used[k] = user_used.get(k, 0) + amount
    out: list[UsageRow] = []
    keys = sorted(set(cap) | {k[:2] for k in team_used})
    for cluster, flavor in keys:
        c = cap.get((cluster, flavor), 0)
        teams = {k[2]: v for k, v in team_used.items() if k[:2] == (cluster, flavor)}
        for k in user_used:
            if k[:2] == (cluster, flavor):
                teams.setdefault(k[2], 0)
        orgs: dict = {}
        for team, v in teams.items():
            o = org_of(team)
            if o is not None:
                orgs[o] = orgs.get(o, 0) + v
        names = sorted(set(teams) | set(orgs), key=lambda n: (org_of(n) or n, n != (org_of(n) or n), n))
        for name in names:
            if name in orgs and name not in teams:
                if (account is None or account == name) and user is None:
                    out.append(UsageRow(cluster, flavor, name, "", orgs[name], c))
                continue
            if account is not None and account not in (name, org_of(name)):
                continue
            if user is None:
                out.append(UsageRow(cluster, flavor, name, "", teams[name], c))
            for (cl, fv, team, login), v in sorted(user_used.items()):
                if (cl, fv, team) == (cluster, flavor, name) and (user is None or login == user):
                    out.append(UsageRow(cluster, flavor, name, login, v, c))
    return out


@dataclass(frozen=True)
class ShareRow:
    pool: str
    account: str            # org, or team
    user: str               # '' for account rows
    raw_shares: Optional[float]   # nominal chips (org: the sum); None for users
    norm_shares: Optional[float]
    raw_usage_chip_s: float       # decayed usage (teams, orgs); allocated chip-seconds (users)
    norm_usage: Optional[float]
    effective_usage: Optional[float]
    fair_share: Optional[float]   # the core's F (teams only)
    at: datetime


def share(con: duckdb.DuckDBPyConnection, *, pool: Optional[str] = None, at: Optional[datetime] = None,
          account: Optional[str] = None, users: bool = True) -> list[ShareRow]:
    """sshare -l's rows per pool: orgs, their teams, the teams' users (see the module's docstring)."""
    p = {"pool": pool, "at": at}
    balances = con.execute("""
        WITH latest AS (
            SELECT pool, max("at") AS "at" FROM balances
            WHERE ($pool IS NULL OR pool = $pool) AND ($at IS NULL OR "at" <= $at) GROUP BY pool
        )
        SELECT b.pool, b.team, b."at", b.nominal_chips, b.decayed_usage_mchip_s, b.fair_share_factor
        FROM balances b JOIN latest USING (pool, "at")
        -- a close of an hour and the end of a run at one instant: two rows; the later has the larger usage
        QUALIFY row_number() OVER (PARTITION BY b.pool, b.team ORDER BY b.decayed_usage_mchip_s DESC,
                                                                         b.fair_share_factor) = 1
        ORDER BY b.pool, b.team""", p).fetchall()
    by_user: dict = {}
    if users:
        rows = con.execute(_SUBMITTERS + """, latest AS (
                SELECT pool, max("at") AS "at" FROM balances
                WHERE ($pool IS NULL OR pool = $pool) AND ($at IS NULL OR "at" <= $at) GROUP BY pool
            )
            SELECT r.pool, r.team, coalesce(sub."user", ''),
                   sum(r.chips_milli * greatest(0, date_diff('second', r.started_at,
                                                             least(coalesce(r.ended_at, l."at"), l."at"))))::BIGINT
            FROM job_run_totals r JOIN latest l ON l.pool = r.pool
            LEFT JOIN sub ON sub.pool = r.pool AND sub.job_id = r.job_id AND sub.submitted_at = r.submitted_at
            WHERE r.started_at IS NOT NULL AND r.started_at < l."at"
            GROUP BY ALL""", p).fetchall()
        for pl, team, login, amount in rows:
            if amount and login:
                by_user[(pl, team, login)] = amount
    out: list[ShareRow] = []
    pools = sorted({r[0] for r in balances})
    for pl in pools:
        rows = [r for r in balances if r[0] == pl]
        when = rows[0][2]
        total_nominal = sum(r[3] for r in rows)
        total_usage = sum(r[4] for r in rows)

        def norm(v, total):
            return v / total if total else 0.0

        orgs: dict = {}
        for _, team, _, nominal, usage_m, _ in rows:
            o = org_of(team)
            if o is not None:
                n, u = orgs.get(o, (0.0, 0))
                orgs[o] = (n + nominal, u + usage_m)
        teams = {r[1]: r for r in rows}
        names = sorted(set(teams) | set(orgs), key=lambda n: (org_of(n) or n, n != (org_of(n) or n), n))
        for name in names:
            if account is not None and account not in (name, org_of(name)):
                continue
            if name in orgs and name not in teams:
                n, u = orgs[name]
                out.append(ShareRow(pl, name, "", n, norm(n, total_nominal), u / 1000, norm(u, total_usage),
                                    norm(u, total_usage), None, when))
                continue
            _, team, _, nominal, usage_m, factor = teams[name]
            out.append(ShareRow(pl, team, "", nominal, norm(nominal, total_nominal), usage_m / 1000,
                                norm(usage_m, total_usage), norm(usage_m, total_usage), factor, when))
            for (upl, uteam, login), v in sorted(by_user.items()):
                if (upl, uteam) == (pl, team):
                    out.append(ShareRow(pl, team, login, None, None, v / 1000, None, None, None, when))
    return out
