"""What a portal caller may see of the ledger's decisions: their sentences, fields and ids, per `[serve] visibility`.

The core writes each decision with a sentence that names teams and jobs (`reclaim: job J (4 chips) fits team
vision's unused quota …; preempt 1 job(s) of borrowing team(s) ads-ml …`). The core's sentences are not changed:
this module redacts them at the portal's boundary, per caller, from the decision's own payload, which names every
team and job the sentence does (`beneficiary`, `victims`, `team`, the `numbers` keys `…[TEAM]`). For a team member:

- another team's **name** is replaced by "another team" when `[serve] visibility = team` (with `fleet`, members see
  other teams' names and balances anyway, so their names stay);
- another team's **job id** is always replaced by "(hidden)" (as in the queue, where other teams' entries have no
  job id), and so is a decision's id when it could carry one (it is derived from the triggering event's id and the
  beneficiary's job id): such an id is shown as an alias, `hidden-…` (an HMAC under a key made at start, so the same
  decision has the same alias on every page of one portal process; the decisions route maps a cursor's alias back).

Statements (issued files: md, html, csv, json, svg) name the teams and jobs of the decisions that preempted the
team's jobs; a member downloads them through the same reading (`document`), over the decisions of the lake that name
their team.

A scheduler's **free text** (a `job.waiting` message, in a job's `why` and timeline) is the
scheduler's, not the ledger's: no payload says what it names. The job ids of the lake it holds (looked up by the
caller: wherever they stand, an id may hold blanks and commas) owned only by teams the caller may not read become "(hidden)" too (`free_text`), as in decisions.

Admins and SREs see everything as written. Whatever is shown is then checked against every team name of the lake
the caller may not see (not only the payload's): if one still appears (a name inside another, a free-text message
from a scheduler), it is replaced there too, and a sentence that would still name one is replaced by a neutral one
built from the decision's fields. So no hidden team name leaves the portal in a decision or a statement, whatever
the names are (the residual, an event id minted by another team's producer carrying their job id: docs/portal.md).
"""

from __future__ import annotations

import hashlib
import hmac
import html
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Iterable, Optional

from chipledger.web.auth import Principal

HIDDEN_TEAM = "another team"
HIDDEN_JOB = "(hidden)"
ALIAS_PREFIX = "hidden-"
_KEYED = re.compile(r"^[A-Za-z_]+\[(.+)\]$")  # numbers keys naming a team: fair_share_factor[TEAM], …
# a name stands alone when its neighbours are not characters names are made of (so `ml` is not found in `ads-ml`)
_BEFORE = r"(?<![\w\-/.@])"
_AFTER = r"(?![\w\-/@]|\.\w)"


@dataclass(frozen=True)
class Named:
    """The teams and jobs a decision names, from its payload: job id -> its team."""

    teams: frozenset[str]
    jobs: tuple[tuple[str, str], ...]


def named_in(body: dict) -> Named:
    teams: set[str] = set()
    jobs: dict[str, str] = {}
    if isinstance(body.get("team"), str):
        teams.add(body["team"])
    for who in [body.get("beneficiary") or {}, *(body.get("victims") or [])]:
        if isinstance(who, dict) and isinstance(who.get("team"), str):
            teams.add(who["team"])
            if isinstance(who.get("job_id"), str):
                jobs[who["job_id"]] = who["team"]
    for key in (body.get("numbers") or {}):
        m = _KEYED.match(key)
        if m:
            teams.add(m.group(1))
    return Named(frozenset(teams), tuple(sorted(jobs.items())))


# a word of free text that may be a job id: a run of anything but blanks, quotes, brackets and separators (job ids
# hold `-`, `/`, `.`, `:`, `@`, `_`), and the same without a sentence's last punctuation
_WORD = re.compile(r"[^\s\"'`()\[\]{}<>,;]+")


def words(texts: Iterable[Optional[str]]) -> set[str]:
    """The words of `texts` that may be job ids (what the caller looks up in the lake's jobs)."""
    out: set[str] = set()
    for text in texts:
        for m in _WORD.finditer(text or ""):
            w = m.group(0)
            out.add(w)
            out.add(w.rstrip(".:!?"))
    out.discard("")
    return out


def _pattern(names: Iterable[str]) -> Optional[re.Pattern]:
    names = sorted({n for n in names if n}, key=lambda n: (-len(n), n))  # the longest first: `a b` before `a`
    if not names:
        return None
    return re.compile(_BEFORE + "(?:" + "|".join(re.escape(n) for n in names) + ")" + _AFTER)


@dataclass
class View:
    """What one caller sees of decisions. `all_teams`: every team name of the lake (the last check's list)."""

    p: Principal
    all_teams: frozenset[str]
    key: bytes
    _hidden_all: Optional[re.Pattern] = field(default=None, init=False)

    def __post_init__(self):
        self._hidden_all = _pattern(t for t in self.all_teams if self.hides_team(t))

    @property
    def sees_all(self) -> bool:
        return self.p.is_staff

    def hides_team(self, team: str) -> bool:
        return not self.p.can_read_team(team) and not self.p.sees_fleet

    def hides_job_of(self, team: str) -> bool:
        return not self.p.can_read_team(team)

    def _hidden(self, named: Named) -> dict[str, str]:
        out = {t: HIDDEN_TEAM for t in named.teams if self.hides_team(t)}
        out.update({j: HIDDEN_JOB for j, t in named.jobs if self.hides_job_of(t)})
        return out

    def hides_anything(self, named: Named) -> bool:
        return bool(self._hidden(named))

    def team(self, team: Optional[str]) -> Optional[str]:
        """A team field: null when the caller may not see that team's name."""
        if team is None or self.sees_all or not self.hides_team(team):
            return team
        return None

    def text(self, text: Optional[str], named: Named = Named(frozenset(), ())) -> Optional[str]:
        """A sentence about `named`, as this caller may read it (None when it cannot be made safe)."""
        if text is None or self.sees_all:
            return text
        hidden = self._hidden(named)
        pat = _pattern(hidden)
        if pat is not None:
            text = pat.sub(lambda m: hidden[m.group(0)], text)
        if self._hidden_all is not None:  # the last check: any team name they may not see, wherever it came from
            text = self._hidden_all.sub(HIDDEN_TEAM, text)
        if hidden and self._leaks(text, named, hidden):
            return None  # still inside something (a name within a name): no sentence rather than a leak
        return text

    def _leaks(self, text: str, named: Named, hidden: dict[str, str]) -> bool:
        """Whether a hidden name is still in `text` anywhere, even inside a word. The names the caller may see are
        looked for too, the longest first at each place, so `ml` hidden is not found inside `ads-ml` shown, while
        `ads-ml` hidden is found inside `xads-mlx`. Job ids of 3 characters or fewer are not looked for inside
        words (`j` is in every `job`); they were replaced where they stand alone."""
        visible = {HIDDEN_TEAM, HIDDEN_JOB, *self.p.teams}
        visible |= {t for t in named.teams if t not in hidden}
        visible |= {j for j, _ in named.jobs if j not in hidden}
        if self.p.sees_fleet:
            visible |= self.all_teams
        looked_for = {h for h, rep in hidden.items() if rep == HIDDEN_TEAM or len(h) > 3}
        names = sorted(visible | looked_for, key=lambda n: (-len(n), n))
        scan = re.compile("|".join(re.escape(n) for n in names if n))
        return any(m.group(0) in looked_for and m.group(0) not in visible for m in scan.finditer(text))

    def free_text(self, text: Optional[str], owners: dict[str, frozenset[str]]) -> Optional[str]:
        """A scheduler's free text as this caller may read it. `owners`: job id -> the teams owning a job of that id
        (any pool), for the lake's job ids the text holds (anywhere: app.job_owners). An id is hidden when no team owning it is
        the caller's (an id their own job has too tells them nothing of another's); then the last check for hidden
        team names. None when it cannot be made safe."""
        if text is None or self.sees_all:
            return text
        jobs = []  # every id it names, with a team the caller reads when there is one (shown: the leak check's too)
        for j, teams in sorted(owners.items()):
            if teams and j in text:
                mine = [t for t in teams if self.p.can_read_team(t)]
                jobs.append((j, min(mine or teams)))
        return self.text(text, Named(frozenset(), tuple(jobs)))

    def message(self, body: dict, message: Optional[str]) -> Optional[str]:
        """A decision's sentence as this caller may read it: the core's, redacted; if that cannot be made safe, a
        neutral sentence from its fields."""
        named = named_in(body)
        out = self.text(message, named)
        if out is not None or message is None:
            return out
        if body.get("type") == "decision.burst":
            return (f"burst {body.get('verdict', '')}: {body.get('chips_granted', 0):g} chips granted "
                    f"(the ledger's sentence names teams you do not see)")
        return (f"{body.get('rule', 'decision')}: {len(body.get('victims') or [])} job(s) preempted "
                f"(the ledger's sentence names teams you do not see)")

    def alias(self, decision_id: str) -> str:
        return ALIAS_PREFIX + hmac.new(self.key, decision_id.encode(), hashlib.sha256).hexdigest()[:24]

    def decision_id(self, decision_id: str, body: dict) -> str:
        """The decision's id, or its alias when it might carry a name or job id the caller may not see."""
        if self.sees_all:
            return decision_id
        named = named_in(body)
        if self.hides_anything(named) or (self._hidden_all is not None and any(
                t in decision_id for t in self.all_teams if self.hides_team(t))):
            return self.alias(decision_id)
        return decision_id


    def document(self, text: str, fmt: str, decisions: Iterable[tuple[str, dict]]) -> str:
        """An issued file (a statement) as this caller may read it: the names and ids `decisions` ([(decision id,
        body)]) give that the caller may not see, replaced where they stand alone, in the file's own escaping (every
        spelling `_spellings` knows), then the last check for any hidden team name of the lake."""
        if self.sees_all:
            return text
        subs: dict[str, str] = {}
        for did, body in decisions:
            subs.update(self._hidden(named_in(body)))
            shown = self.decision_id(did, body)
            if shown != did:
                subs[did] = shown
        # each name as the file's format spells it (a replacement spelled the same way); the name as it is too
        subs = {sk: sv for k, v in subs.items() for sk, sv in zip(_spellings(k, fmt), _spellings(v, fmt))} | subs
        pat = _pattern(subs)
        if pat is not None:
            text = pat.sub(lambda m: subs[m.group(0)], text)
        if self._hidden_all is not None:
            names = [s for t in self.all_teams if self.hides_team(t) for s in {t, *_spellings(t, fmt)}]
            text = _pattern(names).sub(HIDDEN_TEAM, text)
        return text


def _spellings(text: str, fmt: str) -> tuple[str, ...]:
    """`text` as a statement of format `fmt` may write it (always the same number of spellings for a format, so a
    name's and its replacement's pair up): HTML and SVG entities, JSON strings, Markdown's backslash escapes
    (chipledger/reports/statements.py `_md_text`, the statements' own), CSV's doubled quotes."""
    if fmt in ("html", "svg"):
        return _html_strs(text)
    if fmt == "json":
        return (_json_str(text, True), _json_str(text, False))
    if fmt == "md":
        from chipledger.reports.statements import _md_text

        return (_md_text(text),)
    if fmt == "csv":
        return (text.replace('"', '""'),)
    return ()


def _html_strs(text: str) -> tuple[str, ...]:
    """`text` escaped as HTML writers do: html.escape (`&#x27;`, `&quot;`), MarkupSafe/Jinja2 (`&#39;`, `&#34;`),
    and with quotes left as they are (text outside attributes)."""
    import markupsafe

    return (html.escape(text, quote=True), str(markupsafe.escape(text)), html.escape(text, quote=False))


def _json_str(text: str, ascii_only: bool) -> str:
    """`text` inside a JSON string, its quotes off."""
    return json.dumps(text, ensure_ascii=ascii_only)[1:-1]


def new_key() -> bytes:
    return secrets.token_bytes(32)
