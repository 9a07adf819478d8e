"""The portal as a hostile caller meets it: a member of one team trying to learn another team's names, job ids or
decisions through a route's parameters, a forged cursor, or the portal's limits (chipledger/web/)."""

from __future__ import annotations

import base64
import json

from tests.test_web import _decision_views, _h, _sql, env  # noqa: F401 (env: the module's lake and portal)


def _cursor(key: list) -> str:
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode().rstrip("=")


def test_a_forged_decision_cursor_is_no_oracle_for_a_hidden_decision_id(env):
    """The decisions are paged by (at, decision id). A member reads a decision that names another team's job under
    an alias; a cursor at its instant with a raw id they made up would tell them, by whether the decision comes
    after it, whether its real id sorts after theirs: a binary search spells out the id (and the other team's job
    id inside it) in a few hundred requests. A member's cursor must be a row as they were shown it."""
    c = _decision_views(env, "fleet")
    h = _h(env, "eve")
    shown = c.get("/api/v1/decisions?limit=1000", headers=h).json()["decisions"]
    hidden = [d for d in shown if d["decision_id"].startswith("hidden-")]
    assert hidden, "a decision naming another team's job"
    d = hidden[0]
    real = _sql(env, "SELECT decision_id FROM decisions WHERE \"at\" = '%s'::TIMESTAMPTZ AND team <> 'ads-ml'"
                % d["at"])[0]["decision_id"]
    for probe in ("", real[:-1], real[:-1] + "~", "~"):
        r = c.get(f"/api/v1/decisions?limit=1000&cursor={_cursor([d['at'], probe])}", headers=h)
        assert r.status_code == 400, (probe, r.text)
    # the cursors it gives out still page through (aliases and ids shown as written), and staff may pass raw ids
    cursor, seen = None, []
    while True:
        body = c.get("/api/v1/decisions?limit=1" + (f"&cursor={cursor}" if cursor else ""), headers=h).json()
        seen += [x["decision_id"] for x in body["decisions"]]
        cursor = body["next_cursor"]
        if not cursor:
            break
    assert seen == [x["decision_id"] for x in shown]
    r = c.get(f"/api/v1/decisions?limit=1000&cursor={_cursor([d['at'], real[:-1]])}", headers=_h(env, "root"))
    assert r.status_code == 200 and real in r.text
