"""The portal as a hostile caller meets it: a member of one team trying to learn another team's names, job ids or
decisions through a route's parameters, a forged cursor, or the portal's limits (chipledger/web/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.web_support import (  # noqa: F401 (env: the module's lake and portal)
    chipledger_run, client_of, decision_ids_page_by_page, decision_views, env, forged_cursor, headers, lake_with,
    last_instant, make_portal, portal_config, portal_like, signed_in, sql,
)


def test_a_forged_decision_cursor_is_no_oracle_for_a_hidden_decision_id(env):
    """The decisions are paged by (at, decision id). A member reads a decision that names another team's job under
    an alias; a cursor at its instant with a raw id they made up would tell them, by whether the decision comes
    after it, whether its real id sorts after theirs: a binary search spells out the id (and the other team's job
    id inside it) in a few hundred requests. A member's cursor must be a row as they were shown it."""
    c = decision_views(env, "fleet")
    h = headers(env, "eve")
    shown = c.get("/api/v1/decisions?limit=1000", headers=h).json()["decisions"]
    hidden = [d for d in shown if d["decision_id"].startswith("hidden-")]
    assert hidden, "a decision naming another team's job"
    d = hidden[0]
    real = sql(env, "SELECT decision_id FROM decisions WHERE \"at\" = '%s'::TIMESTAMPTZ AND team <> 'ads-ml'"
                % d["at"])[0]["decision_id"]
    for probe in ("", real[:-1], real[:-1] + "~", "~"):
        r = c.get(f"/api/v1/decisions?limit=1000&cursor={forged_cursor([d['at'], probe])}", headers=h)
        assert r.status_code == 400, (probe, r.text)
    # the cursors it gives out still page through (aliases and ids shown as written), and staff may pass raw ids
    assert decision_ids_page_by_page(c, h) == [x["decision_id"] for x in shown]
    r = c.get(f"/api/v1/decisions?limit=1000&cursor={forged_cursor([d['at'], real[:-1]])}",
              headers=headers(env, "root"))
    assert r.status_code == 200 and real in r.text


def test_signing_in_over_and_over_with_one_token_does_not_sign_everyone_else_out(env, monkeypatch):
    """Sessions live in the portal's memory, bounded: when full, the oldest were forgotten. A member signing in
    again and again with their one token (each sign-in a new session) filled the table and pushed everyone else's
    sessions out: signed every other user out. A token now holds at most MAX_PER_TOKEN sessions (its own oldest end)."""
    from chipledger.web.auth import Sessions

    monkeypatch.setattr(Sessions, "MAX_SESSIONS", 40)
    alice = signed_in(env, "alice")
    assert alice.get("/api/v1/whoami").json()["user"] == "alice"
    flood = client_of(env["portal"])
    eves = []
    for _ in range(3 * Sessions.MAX_SESSIONS):
        page = flood.get("/login")
        nonce = page.text.split('name="csrf" value="')[1].split('"')[0]
        r = flood.post("/login", data={"token": env["tokens"]["eve"][1], "csrf": nonce}, follow_redirects=False)
        assert r.status_code == 303
        eves.append(r.cookies.get("clp_session") or flood.cookies.get("clp_session"))
        flood.cookies.clear()  # as a script would: a fresh sign-in each time, none signed out
    assert alice.get("/api/v1/whoami").status_code == 200, "alice was signed out by eve's sign-ins"
    live = [e for e in eves if env["portal"].sessions.lookup(e) is not None]
    assert live == eves[-Sessions.MAX_PER_TOKEN:]  # eve keeps her latest sessions


def test_a_members_job_is_theirs_whatever_another_team_names_its_jobs(env, tmp_path):
    """Job ids are unique only within a pool (two Slurm clusters both number from 1). The job page read the latest
    submission of an id, whoever's: a member whose job shared its id with another team's later job got 404 for their
    own job (and so learned that another team has a job of that name). Each caller reads the latest of that id they
    may read; another team's namesake stays invisible."""
    last = last_instant(env)
    later = last[:-3] + "59Z"
    extra = [
        {"event_id": "dup-ads", "type": "job.submitted", "occurred_at": last, "pool": "us-east1-a/h100-80gb",
         "source": "cluster-a/kueue", "job_id": "42", "team": "ads-ml", "chips": 4},
        {"event_id": "dup-vision", "type": "job.submitted", "occurred_at": later, "pool": "us-west4-a/tpu-v5e",
         "source": "cluster-c/kueue", "job_id": "42", "team": "vision", "chips": 1},
    ]
    client = client_of(portal_like(env, lake=lake_with(env, tmp_path, extra)))
    for user, team, pool in (("eve", "ads-ml", "us-east1-a/h100-80gb"), ("alice", "vision", "us-west4-a/tpu-v5e")):
        r = client.get("/api/v1/jobs/42", headers=headers(env, user))
        assert r.status_code == 200, (user, r.text)
        assert (r.json()["team"], r.json()["pool"]) == (team, pool)
        other = "vision" if team == "ads-ml" else "ads-ml"
        assert other not in json.dumps(r.json())
        page = client.get("/jobs/42", headers=headers(env, user))
        assert page.status_code == 200 and pool in page.text and other not in page.text
    assert client.get("/api/v1/jobs/42", headers=headers(env, "root")).json()["team"] == "vision"  # staff: the latest


def test_event_streams_are_bounded_per_user_not_per_session(env):
    """GET /api/v1/snapshots holds a connection and a task for as long as the client keeps it: a caller has at most
    MAX_STREAMS_PER_CALLER. They were counted per session (and per token), so a user signing in again had that many
    more, without end: they are counted per user, however they authenticate."""
    from contextlib import ExitStack

    from chipledger.web.app import MAX_STREAMS_PER_CALLER

    client = env["client"]
    sessions = [signed_in(env, "eve") for _ in range(2)]
    with ExitStack() as stack:
        for i in range(MAX_STREAMS_PER_CALLER):
            r = stack.enter_context(client.stream("GET", "/api/v1/snapshots", headers=headers(env, "eve")) if i % 2 else
                                    sessions[0].stream("GET", "/api/v1/snapshots"))
            assert r.status_code == 200
        assert sessions[1].get("/api/v1/snapshots?once=true").status_code == 429
        assert client.get("/api/v1/snapshots?once=true", headers=headers(env, "eve")).status_code == 429
        assert client.get("/api/v1/snapshots?once=true", headers=headers(env, "alice")).status_code == 200


def test_a_decision_cursor_cannot_tell_whether_another_teams_decision_exists(env):
    """A cursor naming a decision the member may not read (another team's burst, whose id they might guess) is
    refused like one naming nothing: a cursor is no test of another team's decisions."""
    c = decision_views(env, "fleet")
    other = sql(env, "SELECT decision_id, \"at\" FROM decisions WHERE type = 'decision.burst' AND team <> 'vision' "
                      "AND decision_id NOT IN "
                      "(SELECT decision_id FROM decision_victims WHERE team = 'vision') ORDER BY \"at\" LIMIT 1")[0]
    at = other["at"]  # as the API writes instants (ISO, UTC)
    r = c.get(f"/api/v1/decisions?cursor={forged_cursor([at, other['decision_id']])}", headers=headers(env, "alice"))
    assert r.status_code == 400, r.text
    r = c.get(f"/api/v1/decisions?cursor={forged_cursor([at, other['decision_id']])}", headers=headers(env, "root"))
    assert r.status_code == 200


def test_a_preemption_naming_a_decision_the_lake_lacks_shows_no_raw_decision_id(env, tmp_path):
    """A job's timeline shows `job.preempted` "by decision ID". The id was replaced by its alias only when the
    decision's row was in the lake (its payload says whose jobs it names); a preemption whose decision the lake does
    not hold (a scheduler's own, or one not yet written) showed the raw id, which carries the beneficiary's job id,
    another team's. A member reads such an id as an alias."""
    last = last_instant(env)
    running = env["portal"].reader.snapshot.rows(
        "SELECT j.pool, j.job_id FROM portal_jobs j JOIN portal_job_last l USING (pool, job_id) "
        "WHERE j.team = 'vision' AND l.last_type = 'job.started' ORDER BY j.job_id LIMIT 1")[0]
    secret = "ev-elsewhere:reclaim:ads-ml-job-77"
    extra = [{"event_id": "pre-x", "type": "job.preempted", "occurred_at": last, "pool": running["pool"],
              "source": "cluster-c/kueue", "job_id": running["job_id"], "decision_id": secret}]
    client = client_of(portal_like(env, lake=lake_with(env, tmp_path, extra)))
    staff = client.get(f"/api/v1/jobs/{running['job_id']}", headers=headers(env, "root")).text
    assert secret in staff  # the control: the preemption is in the timeline
    for path in (f"/api/v1/jobs/{running['job_id']}", f"/jobs/{running['job_id']}"):
        r = client.get(path, headers=headers(env, "alice"))
        assert r.status_code == 200 and "ads-ml-job-77" not in r.text and "preempted by decision hidden-" in r.text


def test_a_user_named_like_a_group_does_not_get_the_groups_role(env):
    """`[serve] members` names users and groups (`group:G`) in one namespace: a user whose name (from the proxy's
    header or a token) was `group:oncall` got the roles of everyone in the oncall group (SRE: every team). Only the
    groups header makes a caller a member of a group."""
    c = env["client"]
    me = c.get("/api/v1/whoami", headers={"X-Forwarded-User": "group:oncall"}).json()
    assert me["user"] == "group:oncall" and me["roles"] == [] and me["teams"] == []
    assert c.get("/api/v1/teams/ads-ml/jobs", headers={"X-Forwarded-User": "group:oncall"}).status_code == 404
    # the control: in the group, through the groups header
    me = c.get("/api/v1/whoami", headers={"X-Forwarded-User": "sam", "X-Forwarded-Groups": "oncall"}).json()
    assert me["roles"] == ["sre"]


def test_chipledger_serve_believes_no_forwarded_address(env, tmp_path):
    """`chipledger serve` over real HTTP: the client address is the connection's. Were uvicorn's proxy headers on
    (its default trusts X-Forwarded-For from 127.0.0.1), anyone on the host could say they are the trusted proxy
    and name any user, and an anonymous caller could spread their requests over made-up addresses past the rate
    limit."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "chipledger.toml"
    cfg.write_text('[serve]\nrequests_per_minute = 5\ntrusted_proxies = "10.9.9.9"\nmembers = "root=*:admin"\n')
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "chipledger.cli", "serve", "--lake", str(env["lake"]), "--store",
                             env["store_url"], "--port", str(port), "--config", str(cfg)], stdout=log, stderr=log,
                            cwd=Path(__file__).resolve().parent.parent,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})

    def get(path, headers):
        try:
            with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers),
                                        timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    try:
        for _ in range(300):
            try:
                if get("/healthz", {}) == 200:
                    break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError((tmp_path / "serve.log").read_text())
        spoof = {"X-Forwarded-For": "10.9.9.9", "X-Real-IP": "10.9.9.9", "Forwarded": "for=10.9.9.9",
                 "X-Forwarded-User": "root"}
        assert get("/api/v1/whoami", spoof) == 401
        codes = [get("/api/v1/pools", {"X-Forwarded-For": f"203.0.113.{i}", "Forwarded": f"for=203.0.113.{i}"})
                 for i in range(8)]
        assert codes.count(429) >= 3, codes  # 5 a minute per address (one already spent): the rest are refused
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def _statement_as_a_member(env, tmp_path, name: str, visibility: str = "team",
                           job_ids=lambda text: text) -> tuple[str, dict[str, str]]:
    """vision renamed `name` (it preempts ads-ml's jobs in the demo), job ids rewritten by `job_ids`, statements
    issued: (ads-ml's JSON statement as issued, eve's download of each format with `[serve] visibility`)."""
    from typer.testing import CliRunner

    from chipledger.cli import app as cli_app
    from chipledger.web.auth import new_token
    from store.repo import open_store

    tmp_path.mkdir(parents=True, exist_ok=True)
    events = tmp_path / "events.jsonl"
    events.write_text(job_ids(env["events"].read_text().replace('"team":"vision"', f'"team":{json.dumps(name)}')),
                      encoding="utf-8")
    lake, store_url = tmp_path / "lake", f"sqlite:///{tmp_path / 'store.db'}"
    chipledger_run(events, lake, store_url)
    res = CliRunner().invoke(cli_app, ["statements", "--lake", str(lake), "--period", "2026-11-02..2026-11-02",
                                       "--store", store_url, "--out", str(tmp_path / "statements")])
    assert res.exit_code == 0, res.output
    st = open_store(store_url)
    _, token = new_token(st, "eve", "ads-ml")
    client = client_of(make_portal(st, lake, portal_config(visibility=visibility),
                                   statements_dir=tmp_path / "statements"))
    url = "/api/v1/statements/ads-ml@2026-11-02..2026-11-02/"
    issued = client.get(url + "json", headers={"X-Forwarded-User": "root"}).content.decode()
    read = {}
    for fmt in ("json", "md", "html", "csv", "svg"):
        r = client.get(url + fmt, headers={"Authorization": f"Bearer {token}"})
        if r.status_code != 404:
            assert r.status_code == 200
            read[fmt] = r.content.decode()
    return issued, read


def test_a_team_name_with_a_quote_is_redacted_in_an_html_statement_too(env, tmp_path):
    """In HTML, names were looked for as `html.escape` writes them (`'` as `&#x27;`, `"` as `&quot;`), but the
    statements' templates escape with MarkupSafe (`&#39;`, `&#34;`): another team named `vision's lab` stayed in
    the victims' HTML statement with visibility = team. Every usual spelling is looked for."""
    import html

    name = "vision's \"lab\""
    issued, read = _statement_as_a_member(env, tmp_path, name)
    assert json.dumps(name)[1:-1] in issued  # the control: the statement as issued names the team
    assert "html" in read
    for fmt, text in read.items():
        for spelling in {name, html.escape(name), html.escape(name, quote=False), "vision&#39;s", "vision&#x27;s",
                         json.dumps(name)[1:-1]}:
            assert spelling not in text, (fmt, spelling)


def test_a_non_ascii_team_name_is_redacted_in_a_json_statement_too(env, tmp_path):
    """A member's statement download is redacted in the file's own escaping: in JSON, names were looked for as
    `json.dumps` writes them (non-ASCII as \\u escapes), but statements are written with the characters as they
    are (UTF-8): with `[serve] visibility = team`, another team named `visión` read the victims its name in their
    JSON statement. Both spellings are looked for."""
    name = "visión"
    issued, read = _statement_as_a_member(env, tmp_path, name)
    assert name in issued  # the control: the statement as issued names the team that preempted ads-ml's jobs
    for fmt, text in read.items():
        assert name not in text and "visi\\u00f3n" not in text and "visi&oacute;n" not in text, fmt


def test_names_and_job_ids_with_markdown_or_csv_characters_are_redacted_in_statements_too(env, tmp_path):
    """Markdown statements write every value with CommonMark backslash escapes (`vision_lab` as `vision\\_lab`)
    and CSV doubles a quote: a name or job id with such a character (an underscore: `train_run_42`) was looked
    for only as it is, and stayed in the member's file: another team's name with visibility = team, and another
    team's job id whatever the visibility."""
    import re

    name = 'vision_lab (prod) "x"'
    ids = lambda text: text.replace("job-", "job_")  # noqa: E731  (job ids, and the decision ids made of them)
    issued, read = _statement_as_a_member(env, tmp_path / "team", name, "team", ids)
    assert json.dumps(name)[1:-1] in issued
    for fmt, text in read.items():
        for spelling in (name, "vision\\_lab", "vision_lab", 'vision_lab (prod) ""x""'):
            assert spelling not in text, (fmt, spelling)
    issued, read = _statement_as_a_member(env, tmp_path / "fleet", "vision", "fleet", ids)
    own = {r["job_id"].replace("job-", "job_") for r in sql(env, "SELECT job_id FROM jobs WHERE team = 'ads-ml'")}
    theirs = set(re.findall(r"job_[0-9]+", issued)) - own
    assert theirs, "the statement names jobs of the team that preempted ads-ml's"
    for fmt, text in read.items():
        for job in theirs:
            assert job not in text and job.replace("_", "\\_") not in text, (fmt, job)


def test_healthz_says_a_refresh_fails_without_naming_the_lakes_files(env, tmp_path):
    """/healthz answers anyone (probes): when the lake cannot be read it says the refresh fails, and not the error's
    message, which names the lake's folders and files (the server's log has it)."""
    import shutil
    import time

    from analytics.commits import manifest_path
    from chipledger.web.lake import LakeReader

    lake = tmp_path / "lake"
    shutil.copytree(env["portal"].reader.lake, lake)
    reader = LakeReader(lake, refresh_s=0.05)
    c = client_of(make_portal(env["store"], reader))
    reader.snapshot  # (built before the lake breaks)
    assert c.get("/healthz").json()["refresh_failing"] is False
    part = next(iter(sorted((lake / "events").rglob("*.parquet"))))
    part.write_bytes(b"not parquet" * 100)
    manifest = manifest_path(lake)  # a new commit that names it (what a reader looks at to refresh)
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "commit": 99}))
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while reader.last_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reader.last_error is not None and str(tmp_path) in reader.last_error  # (the message names the file)
        res = c.get("/healthz")
    finally:
        reader.stop()
    assert res.status_code == 200 and res.json()["refresh_failing"] is True
    assert str(tmp_path) not in res.text and "parquet" not in res.text


class _StoreSpy:
    """The test's store, recording each token lookup and whether it ran on an event loop; `down`: lookups fail."""

    def __init__(self, store, down: bool = False):
        self._store, self.down, self.lookups = store, down, []

    def token(self, token_id):
        import asyncio

        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        self.lookups.append((token_id, on_loop))
        if self.down:
            raise ConnectionError("the store is down")
        return self._store.token(token_id)

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.mark.parametrize("per_minute", [600, 0])
def test_a_token_lookup_never_holds_the_event_loop_and_unknown_ids_are_remembered(env, per_minute):
    """Review: the routes and the rate limit run on the event loop; a token its cache did not keep was looked up in
    the store there, so anyone sending made-up token ids held every request (kept answers too) for a store query
    each. The store is asked in the thread pool, and an id it does not know is remembered like a known one."""
    from chipledger.web.app import Portal
    from chipledger.web.auth import TokenCache

    spy = _StoreSpy(env["store"])
    portal = Portal(cfg=portal_config(requests_per_minute=per_minute), reader=env["portal"].reader, store=spy,
                    tokens=TokenCache(spy, ttl_s=60))
    c = client_of(portal)
    bogus = {"Authorization": "Bearer clp_nosuchtokenid_secret"}
    assert [c.get("/api/v1/pools", headers=bogus).status_code for _ in range(3)] == [401] * 3
    assert c.get("/api/v1/pools", headers=headers(env, "alice")).status_code == 200
    assert c.get("/api/v1/slos", headers=headers(env, "alice")).status_code == 200
    assert spy.lookups and not [t for t, on_loop in spy.lookups if on_loop]
    assert [t for t, _ in spy.lookups].count("nosuchtokenid") == 1  # then remembered as unknown
    assert len(spy.lookups) == 2  # alice's token once, kept for the second request


def test_a_failure_inside_is_a_500_with_the_security_headers(env):
    """Review: an unexpected failure (here the store down) was answered by Starlette's outermost handler, whose
    500 carried none of the security headers."""
    from fastapi.testclient import TestClient

    from chipledger.web.app import Portal, build_app
    from chipledger.web.auth import TokenCache

    spy = _StoreSpy(env["store"], down=True)
    portal = Portal(cfg=portal_config(), reader=env["portal"].reader, store=spy, tokens=TokenCache(spy, ttl_s=0))
    c = TestClient(build_app(portal), raise_server_exceptions=False)
    for path in ("/api/v1/pools", "/teams/vision"):
        r = c.get(path, headers=headers(env, "alice"))
        assert r.status_code == 500 and "the store is down" not in r.text, path
        assert "default-src 'none'" in r.headers["content-security-policy"], path
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["cache-control"] == "no-store", path
    assert spy.lookups


def test_made_up_job_ids_neither_empty_the_kept_answers_nor_take_the_next_snapshots_rewarm(env):
    """Review: the kept answers were emptied at once when 4096 keys were kept, and every made-up job id kept two (its
    404 and its empty list of submissions): 2,041 requests for junk ids emptied them all (the home page's content
    too), and the refresh then computed the 256 junk ids on the next snapshot instead of the pages people read."""
    from chipledger.web.lake import Snapshot

    portal = portal_like(env)
    c = client_of(portal)
    h = headers(env, "alice")
    s = portal.reader.snapshot
    assert c.get("/teams/vision", headers=h).status_code == 200
    home = [k for k in s._memo if k[:2] == ("page", "home_main.html")]
    assert home
    for i in range(Snapshot.MEMO_MAX + 100):
        if i % 200 == 0:  # people keep reading the home page
            assert c.get("/teams/vision", headers=h).status_code == 200
        assert c.get(f"/api/v1/jobs/junk-{i}", headers=h).status_code == 404
    assert all(k in s._memo for k in home) and len(s._memo) <= Snapshot.MEMO_MAX
    assert not [k for k in s._recipes if any("junk-" in str(part) for part in k)]
    assert any(k[:2] == ("page", "home_main.html") for k in s._recipes)
