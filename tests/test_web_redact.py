"""Decisions as a team member may read them (chipledger/web/redact.py): the names come from the decision's payload,
and the last check catches any hidden team name wherever it came from. Table-driven over sentences of the core's
shapes (ledger/policy.py `decide_preempt`, `decide_burst`)."""

from __future__ import annotations

import pytest

from chipledger.web.auth import Principal
from chipledger.web.redact import HIDDEN_JOB, HIDDEN_TEAM, View, named_in, words

HOSTILE = 'evil"><script>(.*)</script>'


def member(team: str, visibility: str = "team") -> Principal:
    return Principal(user="u", via="token", teams=frozenset({team}), roles=frozenset({"member"}),
                     visibility=visibility)


ADMIN = Principal(user="root", via="token", roles=frozenset({"admin"}))

RECLAIM = {
    "decision_id": "ev-1:reclaim:job-v1", "type": "decision.preempt", "rule": "reclaim",
    "beneficiary": {"job_id": "job-v1", "team": "vision"},
    "victims": [{"job_id": "ads-7", "team": "ads-ml", "chips": 8.0}, {"job_id": "r-3", "team": "recsys", "chips": 1}],
    # an equal class names a team that lost nothing (only in the numbers' keys)
    "numbers": {"fair_share_factor[ads-ml]": 0.1, "fair_share_factor[recsys]": 0.11,
                "fair_share_factor[ml]": 0.105, "victim_class[ml]": 0.0},
    "message": "reclaim: job job-v1 (4 chips) fits team vision's unused quota but only 0 chips are free; preempt 2 "
               "job(s) of borrowing team(s) ads-ml, recsys to free 9 chips (4 needed, 10 chip-s of work lost); teams "
               "ads-ml, ml, recsys treated as equal (F 0.100, 0.105, 0.110 differ by less than fair_share_tolerance "
               "0.05), victims with the least lost work taken from any of them; victims checkpoint by …",
}
TEAMS = frozenset({"vision", "ads-ml", "recsys", "ml", "speech", HOSTILE})


def test_the_payload_names_every_team_and_job_of_the_sentence():
    n = named_in(RECLAIM)
    assert n.teams == {"vision", "ads-ml", "recsys", "ml"}
    assert dict(n.jobs) == {"job-v1": "vision", "ads-7": "ads-ml", "r-3": "recsys"}


@pytest.mark.parametrize("team, visibility, shown, hidden", [
    # the beneficiary's member: the victims' teams (and the equal class's `ml`, not inside `ads-ml`) are hidden
    ("vision", "team", ["vision's", "job-v1", "borrowing team(s) another team, another team", "teams another team, "
                        "another team, another team treated"], ["ads-ml", "recsys", " ml"]),
    # a victim's member: the beneficiary's team and job id are hidden, their own name shown
    ("ads-ml", "team", ["ads-ml", "fits team another team's", f"job {HIDDEN_JOB} (4"], ["vision", "job-v1", "recsys"]),
    # visibility fleet: names shown (as on the fleet page), other teams' job ids not
    ("ads-ml", "fleet", ["vision's", "recsys", f"job {HIDDEN_JOB} (4"], ["job-v1"]),
])
def test_a_members_sentence(team, visibility, shown, hidden):
    v = View(member(team, visibility), TEAMS, b"k")
    text = v.message(RECLAIM, RECLAIM["message"])
    for s in shown:
        assert s in text, (s, text)
    for s in hidden:
        assert s not in text, (s, text)
    assert v.decision_id(RECLAIM["decision_id"], RECLAIM).startswith("hidden-")


def test_staff_read_the_ledgers_sentence_and_id():
    v = View(ADMIN, TEAMS, b"k")
    assert v.message(RECLAIM, RECLAIM["message"]) == RECLAIM["message"]
    assert v.decision_id(RECLAIM["decision_id"], RECLAIM) == RECLAIM["decision_id"]
    assert v.team("ads-ml") == "ads-ml"


def test_team_fields_are_null_when_hidden():
    assert View(member("ads-ml"), TEAMS, b"k").team("vision") is None
    assert View(member("ads-ml", "fleet"), TEAMS, b"k").team("vision") == "vision"
    assert View(member("ads-ml"), TEAMS, b"k").team("ads-ml") == "ads-ml"


def test_a_hostile_name_is_hidden_as_a_name_not_a_pattern():
    body = {"type": "decision.preempt", "rule": "reclaim", "beneficiary": {"job_id": "j", "team": HOSTILE},
            "victims": [{"job_id": "k", "team": "vision"}]}
    msg = f"reclaim: job j (1 chips) fits team {HOSTILE}'s unused quota; preempt 1 job(s) of team(s) vision"
    text = View(member("vision"), TEAMS, b"k").message(body, msg)
    assert HOSTILE not in text and "script" not in text and "another team's unused quota" in text


def test_the_last_check_catches_names_the_payload_does_not_give():
    """A scheduler's free-text message (Kueue's) in a job's `why`: no payload, but every hidden team of the lake is
    looked for."""
    v = View(member("vision"), TEAMS, b"k")
    assert v.text("couldn't assign flavors: borrowing from speech's ClusterQueue") == \
        f"couldn't assign flavors: borrowing from {HIDDEN_TEAM}'s ClusterQueue"
    assert v.text("speeches are fine") == "speeches are fine"  # a word is not a name


def test_a_sentence_that_cannot_be_made_safe_becomes_a_neutral_one():
    # the hidden team's name inside an id-like token the boundaries do not split: no redaction can be sure
    body = {"type": "decision.preempt", "rule": "reclaim", "beneficiary": {"job_id": "j", "team": "ads-ml"},
            "victims": [{"job_id": "k", "team": "vision"}]}
    text = View(member("vision"), TEAMS, b"k").message(body, "reclaim for xads-mlx: preempt 1 job(s)")
    assert "ads-ml" not in text and text.startswith("reclaim: 1 job(s) preempted")


def test_a_decision_id_carrying_a_hidden_name_is_an_alias_stable_per_key():
    body = {"type": "decision.burst", "team": "vision", "request_id": "burst-ads-ml-1"}
    v = View(member("vision"), TEAMS, b"k")
    did = "ev-9:burst:burst-ads-ml-1"
    assert v.decision_id(did, body) == v.alias(did) == View(member("vision"), TEAMS, b"k").decision_id(did, body)
    assert View(member("vision"), TEAMS, b"other").alias(did) != v.alias(did)
    assert v.decision_id("ev-9:burst:burst-1", {**body, "request_id": "burst-1"}) == "ev-9:burst:burst-1"


def test_an_issued_statement_is_read_in_its_own_escaping():
    """A statement's preemption table names the beneficiary's team, job and the decision: as a victim's member reads
    it, in every format's escaping (a hostile name is an HTML entity in html, a JSON string in json)."""
    import html
    import json

    body = {"type": "decision.preempt", "rule": "reclaim", "beneficiary": {"job_id": "job-77", "team": HOSTILE},
            "victims": [{"job_id": "mine-1", "team": "vision"}]}
    did = "ev-5:reclaim:job-77"
    v = View(member("vision"), TEAMS, b"k")
    rows = [("mine-1", did, HOSTILE, "job-77")]
    md = "\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)
    page = "".join(f"<td>{html.escape(x)}</td>" for x in rows[0])
    doc = json.dumps({"preemptions": [{"job_id": a, "decision_id": b, "beneficiary_team": c,
                                       "beneficiary_job_id": d} for a, b, c, d in rows]})
    for fmt, text in (("md", md), ("html", page), ("json", doc), ("csv", ",".join(rows[0]))):
        out = v.document(text, fmt, [(did, body)])
        for secret in (HOSTILE, html.escape(HOSTILE), json.dumps(HOSTILE)[1:-1], "job-77", did):
            assert secret not in out, (fmt, secret, out)
        assert "mine-1" in out and v.alias(did) in out and HIDDEN_TEAM in out, (fmt, out)
    assert json.loads(v.document(doc, "json", [(did, body)]))["preemptions"][0]["beneficiary_team"] == HIDDEN_TEAM
    assert View(ADMIN, TEAMS, b"k").document(md, "md", [(did, body)]) == md



@pytest.mark.parametrize("text, owners, want", [
    # another team's job id, wherever it stands in the sentence (its last punctuation off)
    ("waiting for ads-7 to finish", {"ads-7": {"ads-ml"}}, f"waiting for {HIDDEN_JOB} to finish"),
    ("behind ads-7.", {"ads-7": {"ads-ml"}}, f"behind {HIDDEN_JOB}."),
    ("behind (ads-7, r-3): 2 jobs", {"ads-7": {"ads-ml"}, "r-3": {"recsys"}}, f"behind ({HIDDEN_JOB}, {HIDDEN_JOB}): 2 jobs"),
    ("ns/train-1 holds the node", {"ns/train-1": {"ads-ml"}}, f"{HIDDEN_JOB} holds the node"),
    # the caller's own job stays, and an id their team has too (in another pool) tells them nothing of another's
    ("job-v1 is next", {"job-v1": {"vision"}}, "job-v1 is next"),
    ("after 42", {"42": {"vision", "ads-ml"}}, "after 42"),
    # an id inside a longer word is not that id (a job's other sentences may name ads-7 itself)
    ("preempted ads-7b", {"ads-7": {"ads-ml"}, "ads-7b": {"vision"}}, "preempted ads-7b"),
])
def test_a_schedulers_free_text_hides_other_teams_job_ids(text, owners, want):
    owners = {j: frozenset(t) for j, t in owners.items()}
    assert set(owners) & words([text])  # the ids are words the caller looks up
    assert View(member("vision", "fleet"), TEAMS, b"k").free_text(text, owners) == want
    assert View(ADMIN, TEAMS, b"k").free_text(text, owners) == text


def test_free_text_words_are_its_runs_without_blanks_quotes_brackets_or_separators():
    assert words(["waiting for 'job-1', (ns/j.2); x:3.", None]) == {
        "waiting", "for", "job-1", "ns/j.2", "x:3.", "x:3"}
