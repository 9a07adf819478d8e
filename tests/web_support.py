"""A lake for the portal's tests: the demo's first events (so the books end with jobs pending), a team with a
hostile name, expected runtimes on some jobs; a store with tokens; a Portal over them (chipledger/web/).

`env` is the portal's tests' module fixture (a module that imports it gets its own lake and portal); the helpers
build the portals those tests vary (other `[serve]` options, another lake) and sign callers in."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import re
from pathlib import Path
from typing import Iterable, Optional

import pytest

from chipledger.config import Config, ServeConfig

HOSTILE_TEAM = 'evil"><script>alert(1)</script>'
PATH_TEAM = "org/ml"  # team names may be paths
EVENTS_KEPT = 4000


def make_events(demo_events: Path, out: Path) -> Path:
    lines = demo_events.read_text().splitlines()[:EVENTS_KEPT]
    last = json.loads(lines[-1])
    pool = "us-west4-a/tpu-v5e"
    extra = [
        {"event_id": "hostile-grant", "type": "quota.granted", "occurred_at": last["occurred_at"], "pool": pool,
         "source": "fleet-admin/quota-api", "grant_id": "hostile-grant", "team": HOSTILE_TEAM, "chips": 1,
         "effective_from": last["occurred_at"]},
        {"event_id": "hostile-job", "type": "job.submitted", "occurred_at": last["occurred_at"], "pool": pool,
         "source": "cluster-c/kueue", "job_id": "job-<b>hostile</b>", "team": HOSTILE_TEAM, "chips": 1000,
         "expected_runtime_s": 3600},
        {"event_id": "path-grant", "type": "quota.granted", "occurred_at": last["occurred_at"], "pool": pool,
         "source": "fleet-admin/quota-api", "grant_id": "path-grant", "team": PATH_TEAM, "chips": 1,
         "effective_from": last["occurred_at"]},
        {"event_id": "path-job", "type": "job.submitted", "occurred_at": last["occurred_at"], "pool": pool,
         "source": "cluster-c/kueue", "job_id": "job-org-ml-1", "team": PATH_TEAM, "chips": 1000},
    ]
    return write_events(out, lines, extra)


def write_events(out: Path, lines: list[str], extra: Iterable[dict] = ()) -> Path:
    """`lines` (JSONL) then the events `extra`, one a line, written to `out`."""
    out.write_text("\n".join(lines + [json.dumps(e) for e in extra]) + "\n")
    return out


def chipledger_run(events: Path, lake: Path, store_url: Optional[str] = None, *args: str) -> None:
    """`chipledger run` of `events` into `lake` (with the store at `store_url`, when given), as a user runs it;
    it must succeed."""
    from typer.testing import CliRunner

    from chipledger.cli import app as cli_app

    cmd = ["run", "--events", str(events), "--lake", str(lake)] + (["--store", store_url] if store_url else [])
    res = CliRunner().invoke(cli_app, [*cmd, *args])
    assert res.exit_code == 0, res.output


def run_lake(demo_lake: Path, root: Path) -> tuple[Path, Path, str]:
    """`chipledger run` of make_events' events (beside `demo_lake`) into `root`/lake with a SQLite store in `root`:
    (events file, lake, store URL)."""
    events = make_events(demo_lake.parent / "events.jsonl", root / "events.jsonl")
    lake = root / "lake"
    store_url = f"sqlite:///{root / 'store.db'}"
    chipledger_run(events, lake, store_url)
    return events, lake, store_url


def portal_config(**serve) -> Config:
    # every request is counted (the limiter runs) but the tests' hundreds of requests a minute are not refused: the
    # limit itself is tested with its own portals
    base = {"members": "root=*:admin, group:oncall=*:sre, carol=vision:admin", "trusted_proxies": "testclient",
            "requests_per_minute": 1_000_000}
    base.update(serve)
    return dataclasses.replace(Config(), serve=ServeConfig(**base))


def make_portal(store, lake, cfg: Optional[Config] = None, **fields):
    """A Portal over `lake` (a LakeReader, or a lake's path) and `store`, configured by `cfg` (portal_config() when
    None), its tokens looked up at every request (a revocation holds at once); `fields`: the Portal's others."""
    from chipledger.web.app import Portal
    from chipledger.web.auth import TokenCache
    from chipledger.web.lake import LakeReader

    reader = lake if isinstance(lake, LakeReader) else LakeReader(lake)
    return Portal(cfg=cfg or portal_config(), reader=reader, store=store, tokens=TokenCache(store, ttl_s=0), **fields)


def client_of(portal):
    """A test client of `portal`'s application."""
    from fastapi.testclient import TestClient

    from chipledger.web.app import build_app

    return TestClient(build_app(portal))


def portal_like(env, lake=None, cfg: Optional[Config] = None, **fields):
    """`env`'s portal (its store, and its lake unless `lake` is given) as another Portal: `cfg`, `fields` as in
    make_portal."""
    return make_portal(env["store"], env["portal"].reader if lake is None else lake, cfg, **fields)


def lake_with(env, root: Path, extra: Iterable[dict]) -> Path:
    """`env`'s events then `extra`, run into `root`/lake with a SQLite store of its own: the lake."""
    events = write_events(root / "events.jsonl", env["events"].read_text().splitlines(), extra)
    lake = root / "lake"
    chipledger_run(events, lake, f"sqlite:///{root / 'store.db'}")
    return lake


def last_instant(env) -> str:
    """When `env`'s last event occurred (as written in it)."""
    return json.loads(env["events"].read_text().splitlines()[-1])["occurred_at"]


@pytest.fixture(scope="module")
def env(demo_lake_of, tmp_path_factory):
    """The portal's lake (run_lake), its statements, a store with a token for alice (vision), eve (ads-ml), root,
    carol and dave (no team), a Portal over them and its test client."""
    from typer.testing import CliRunner

    from chipledger.cli import app as cli_app
    from chipledger.web.auth import new_token
    from store.repo import open_store

    root = tmp_path_factory.mktemp("portal")
    events, lake, store_url = run_lake(demo_lake_of(3, 7), root)
    res = CliRunner().invoke(cli_app, ["statements", "--lake", str(lake), "--period", "2026-11-02..2026-11-02",
                                       "--store", store_url, "--out", str(root / "statements")])
    assert res.exit_code == 0, res.output
    st = open_store(store_url)
    tokens = {}
    for user, team in (("alice", "vision"), ("eve", "ads-ml"), ("root", None), ("carol", None), ("dave", None)):
        tokens[user] = new_token(st, user, team)
    portal = make_portal(st, lake, statements_dir=root / "statements")
    client = client_of(portal)
    yield {"lake": lake, "events": events, "store": st, "store_url": store_url, "tokens": tokens, "portal": portal,
           "client": client, "root": root}


def headers(env, user: str) -> dict:
    """How `user` authenticates: anon not at all, sre through the trusted proxy (in the oncall group), the others
    with their bearer token."""
    if user == "anon":
        return {}
    if user == "sre":
        return {"X-Forwarded-User": "sam", "X-Forwarded-Groups": "oncall,users"}
    return {"Authorization": f"Bearer {env['tokens'][user][1]}"}


def signed_in(env, user: str = "alice", token: Optional[str] = None):
    """A test client signed in at /login (a session cookie, HttpOnly and SameSite=Strict) with `user`'s token, or
    `token`."""
    c = client_of(env["portal"])
    page = c.get("/login")
    nonce = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    r = c.post("/login", data={"token": token or env["tokens"][user][1], "csrf": nonce}, follow_redirects=False)
    assert r.status_code == 303
    assert "httponly" in r.headers["set-cookie"].lower() and "samesite=strict" in r.headers["set-cookie"].lower()
    return c


def sql(env, query: str, lake=None) -> list[dict]:
    """`chipledger sql` of `query` on `env`'s lake (or `lake`), its JSON rows."""
    from typer.testing import CliRunner

    from chipledger.cli import app as cli_app

    res = CliRunner().invoke(cli_app, ["sql", "--lake", str(lake or env["lake"]), "--format", "json", query])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def decision_views(env, visibility: str):
    """A test client of `env`'s portal (its statements too) with `[serve] visibility` = `visibility`."""
    p = env["portal"]
    return client_of(portal_like(env, cfg=portal_config(visibility=visibility), statements_dir=p.statements_dir))


def decision_ids_page_by_page(client, headers: dict, limit: int = 1) -> list[str]:
    """The decision ids /api/v1/decisions gives `client` (as `headers`), `limit` a page, following its cursors."""
    seen, cursor = [], None
    while True:
        body = client.get(f"/api/v1/decisions?limit={limit}" + (f"&cursor={cursor}" if cursor else ""),
                          headers=headers).json()
        seen += [d["decision_id"] for d in body["decisions"]]
        cursor = body["next_cursor"]
        if not cursor:
            return seen


def forged_cursor(key) -> str:
    """A cursor made by the caller: `key` as JSON in unpadded URL-safe base64, the form of the portal's own."""
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode().rstrip("=")


@contextlib.contextmanager
def served(portal):
    """The portal served by uvicorn in a thread on a free port of 127.0.0.1 (for headless Chromium): yields its
    base URL, stops it after."""
    import socket
    import threading
    import time

    import uvicorn

    from chipledger.web.app import build_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(build_app(portal), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    for _ in range(100):
        if srv.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(timeout=5)
