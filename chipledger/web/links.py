"""The portal's URL of each team page and job page: every link a page holds and every redirect is built here, so that
the URL the portal gives is the one its routes read back as the same name.

Names come from events (schemas.events.Name: 1 to 256 characters, no control characters), so a team may be named
`org/ml`, `x/queue`, `..`, `a//b` or `R&D`. The path form, `/teams/TEAM` (`/teams/org/ml/queue` is team `org/ml`'s
queue), is kept for every name it reads back unchanged; two kinds of names it does not:

- a team whose name ends in `/queue`, `/bursts` or `/statements`: its home, `/teams/x/queue`, is team `x`'s queue
  (the name may hold any `/`, so a route cannot tell them apart);
- a name with an empty, `.` or `..` segment (`a//b`, `../x`): browsers and HTTP clients remove dot segments
  (`%2e%2e` too) and proxies merge slashes before the portal sees the path.

Those are linked by their query form, `/team?name=NAME` (and `/team/queue?name=NAME`, …; a job: `/job?id=JOB`; a
statement's file: `/api/v1/statement-file?statement_id=ID&fmt=FMT`), which reads back every name. Both forms serve the same pages; `%`-encoding is quote's (a `/` inside a query value is
encoded too)."""

from __future__ import annotations

from urllib.parse import quote

TEAM_PAGES = ("queue", "bursts", "statements")  # a team's pages under /teams/TEAM/ (its home: /teams/TEAM)


def path_safe(name: str) -> bool:
    """Whether `name` survives as a path: no empty, `.` or `..` segment (removed or merged before the portal sees it)."""
    return all(seg not in ("", ".", "..") for seg in name.split("/"))


def team_url(team: str, page: str = "") -> str:
    """The URL of `team`'s home (page "") or its `page` (one of TEAM_PAGES)."""
    assert page == "" or page in TEAM_PAGES, page
    if path_safe(team) and not (page == "" and team.endswith(tuple(f"/{x}" for x in TEAM_PAGES))):
        return f"/teams/{quote(team, safe='/')}" + (f"/{page}" if page else "")
    return "/team" + (f"/{page}" if page else "") + f"?name={quote(team, safe='')}"


def job_url(job_id: str) -> str:
    """The URL of a job's page."""
    if path_safe(job_id):
        return f"/jobs/{quote(job_id, safe='/')}"
    return f"/job?id={quote(job_id, safe='')}"


def statement_url(statement_id: str, fmt: str) -> str:
    """The URL of an issued statement's file (`TEAM@LABEL`, format `fmt`): the team's name may be any name."""
    if path_safe(statement_id):
        return f"/api/v1/statements/{quote(statement_id, safe='/@')}/{fmt}"
    return f"/api/v1/statement-file?statement_id={quote(statement_id, safe='')}&fmt={quote(fmt, safe='')}"
