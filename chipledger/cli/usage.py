"""`chipledger usage` and `chipledger share`: the books shaped like `sreport cluster AccountUtilizationByUser` and
`sshare -l` (chipledger/reports/usage.py; docs/slurm.md, "Usage and shares")."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Optional

import typer

from chipledger.cli._common import (ConfigOpt, PoolOpt, _config, _connect, _fail, _instant, _lake_dir, _lake_read, app,
                                    console)
from chipledger.cli.output import FORMATS, render

TIME_FORMATS = ("seconds", "minutes", "hours", "percent")


def _hour(t: datetime) -> datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def _stamp(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    """sreport's and sshare's fixed-width text: a header, a dashed line, the rows."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def line(cells):
        return " ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), " ".join("-" * w for w in widths), *(line(r) for r in rows)]) + "\n"


def _write_cells(header: list[str], cells: list[list[str]], right: set[int], title, parsable: bool,
                 noheader: bool) -> None:
    """The text output of `usage` and `share`, as Slurm's tools write theirs: `|`-separated (--parsable), or the
    `title()` lines then an aligned table (`right`: the right-aligned columns), or bare rows (--noheader)."""
    out = console.file
    if parsable:
        if not noheader:
            out.write("|".join(header) + "\n")
        for c in cells:
            out.write("|".join(x.strip() for x in c) + "\n")
        return
    if not noheader:
        out.write(title())
        out.write(_table(header, cells, right))
    else:
        out.write("".join(" ".join(c) + "\n" for c in cells))


@app.command("usage")
def usage_cmd(
    lake: Optional[Path] = typer.Option(None, "--lake", help="lake folder (default [lake] path = ./lake)"),
    start: Optional[str] = typer.Option(None, "--start", "-S", help="start (ISO 8601, rounded down to the hour; "
                                                                     "default: 00:00 yesterday, as sreport)"),
    end: Optional[str] = typer.Option(None, "--end", "-E", help="end, excluded (ISO 8601, rounded down to the hour; "
                                                                 "default: 00:00 today)"),
    time_format: str = typer.Option("hours", "-t", "--time-format", help="seconds | minutes | hours | percent (of "
                                                                          "the capacity of the cluster and flavor)"),
    pool: Optional[str] = PoolOpt,
    account: Optional[str] = typer.Option(None, "--account", "-A", help="only this org or team"),
    user: Optional[str] = typer.Option(None, "--user", "-u", help="only this user's rows"),
    flavor: Optional[str] = typer.Option(None, "--flavor", help="only the pools of this flavor"),
    no_users: bool = typer.Option(False, "--no-users", help="accounts only (sreport cluster AccountUtilization...)"),
    parsable: bool = typer.Option(False, "--parsable", "-P", help="'|'-separated, as sreport -P"),
    noheader: bool = typer.Option(False, "--noheader", "-n", help="no header lines"),
    fmt: str = typer.Option("text", "--format", help="text (sreport's) | " + " | ".join(FORMATS)),
    config: Optional[Path] = ConfigOpt,
):
    """Chips used per cluster and flavor, org, team and user over [start, end), shaped like `sreport cluster
    AccountUtilizationByUser` (Account = org or team, Login = user, TRES Name = chip/<flavor>; flavors are never
    added up). Team rows are the books (in quota + borrowed + burst), user rows their runs' allocation."""
    from chipledger.reports.usage import usage

    if time_format not in TIME_FORMATS:
        _fail(f"-t must be one of {', '.join(TIME_FORMATS)}, got {time_format!r}", 2)
    if fmt not in ("text",) + FORMATS:
        _fail(f"--format must be text or one of {', '.join(FORMATS)}, got {fmt!r}", 2)
    cfg = _config(config)
    root = _lake_dir(lake, cfg)
    today = _hour(datetime.now(timezone.utc)).replace(hour=0)
    t0 = _hour(_instant(start, "--start") or today - timedelta(days=1))
    t1 = _hour(_instant(end, "--end") or today)
    if t1 <= t0:
        _fail(f"--end {_stamp(t1)} is not after --start {_stamp(t0)} (both rounded down to the hour)", 2)
    con = _connect(root, slo=cfg.slo)
    rows = _lake_read(lambda: usage(con, t0, t1, pool=pool, account=account, user=user, users=not no_users), root)
    if flavor is not None:
        rows = [r for r in rows if r.flavor == flavor]
    unit = time_format
    if fmt != "text":
        render(["cluster", "flavor", "account", "login", "tres_name", f"used_{unit}", "used_mchip_s"],
               [[r.cluster, r.flavor, r.account, r.login or None, f"chip/{r.flavor}", round(r.used(unit), 6),
                 r.used_mchip_s] for r in rows], fmt, console, limit=None)
        return

    def used(r) -> str:
        v = r.used(unit)
        return f"{v:.2f}%" if unit == "percent" else f"{round(v):d}"

    cells = [[r.cluster, (" " if "/" in r.account else "") + r.account, r.login, f"chip/{r.flavor}", used(r)]
             for r in rows]
    header = ["Cluster", "Account", "Login", "TRES Name", "Used"]

    def title() -> str:
        secs = int((t1 - t0).total_seconds())
        label = "TRES percentage of the capacity" if unit == "percent" else f"TRES {unit.capitalize()}"
        return ("-" * 80 + "\n" + f"Cluster/Account/User Utilization {_stamp(t0)} - {_stamp(t1 - timedelta(seconds=1))} "
                f"({secs} secs)\nUsage reported in {label}\n" + "-" * 80 + "\n")

    _write_cells(header, cells, {4}, title, parsable, noheader)


@app.command("share")
def share_cmd(
    lake: Optional[Path] = typer.Option(None, "--lake", help="lake folder (default [lake] path = ./lake)"),
    pool: Optional[str] = PoolOpt,
    at: Optional[str] = typer.Option(None, "--at", help="the last close of the books at or before this instant "
                                                        "(default: the latest)"),
    account: Optional[str] = typer.Option(None, "--account", "-A", help="only this org or team"),
    no_users: bool = typer.Option(False, "--no-users", help="accounts only"),
    parsable: bool = typer.Option(False, "--parsable", "-P", help="'|'-separated, as sshare -P"),
    noheader: bool = typer.Option(False, "--noheader", "-n", help="no header lines"),
    fmt: str = typer.Option("text", "--format", help="text (sshare's) | " + " | ".join(FORMATS)),
    config: Optional[Path] = ConfigOpt,
):
    """Fair share per pool as `sshare -l` shows it: the tree org → team → user with raw shares (nominal quota,
    chips), normalized shares, raw usage (decayed chip-seconds), normalized and effective usage and the fair-share
    factor F the ledger's core computed (0.5: using exactly its share)."""
    from chipledger.reports.usage import share

    if fmt not in ("text",) + FORMATS:
        _fail(f"--format must be text or one of {', '.join(FORMATS)}, got {fmt!r}", 2)
    cfg = _config(config)
    root = _lake_dir(lake, cfg)
    t = _instant(at, "--at")
    con = _connect(root, slo=cfg.slo)
    rows = _lake_read(lambda: share(con, pool=pool, at=t, account=account, users=not no_users), root)

    def num(v, spec):
        return "" if v is None else format(v, spec)

    if fmt != "text":
        render(["pool", "account", "user", "raw_shares", "norm_shares", "raw_usage_chip_s", "norm_usage",
                "effective_usage", "fair_share", "at"],
               [[r.pool, r.account, r.user or None, r.raw_shares, r.norm_shares, r.raw_usage_chip_s, r.norm_usage,
                 r.effective_usage, r.fair_share, r.at] for r in rows], fmt, console, limit=None)
        return
    header = ["Pool", "Account", "User", "RawShares", "NormShares", "RawUsage", "NormUsage", "EffectvUsage",
              "FairShare"]
    cells = []
    for r in rows:
        indent = (" " if "/" in r.account else "") + (" " if r.user else "")
        cells.append([r.pool, indent + (r.account if not r.user else r.account.rsplit("/", 1)[-1]), r.user,
                      "parent" if r.user else num(r.raw_shares, "g"), num(r.norm_shares, ".6f"),
                      f"{round(r.raw_usage_chip_s):d}", num(r.norm_usage, ".6f"), num(r.effective_usage, ".6f"),
                      num(r.fair_share, ".6f")])

    def title() -> str:
        when = sorted({_stamp(r.at) for r in rows})
        return (f"Fair share at the last close of each pool's books ({', '.join(when) or 'none'}); RawShares = "
                f"nominal chips, RawUsage = decayed chip-seconds (users: allocated, not decayed)\n")

    _write_cells(header, cells, {3, 4, 5, 6, 7, 8}, title, parsable, noheader)
