"""`chipledger usage` (sreport cluster AccountUtilizationByUser's shape) and `chipledger share` (sshare -l's) on a
hand-made lake whose numbers are worked out below; the same against the real sreport and sshare is in
tests/test_slurm_live.py.

One pool `lab/a100` of 4 chips from 00:00 to 03:00: research/vision holds 2 chips of quota, research/nlp 1, speech
none. alice (vision) runs 2 chips 00:00–02:00, bob (vision) 1 chip 01:00–03:00, carol (nlp) 1 chip 00:30–01:30,
dave (speech) 1 chip 02:00–03:00."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from chipledger.cli import app
from chipledger.embedded import run_file

POOL = "lab/a100"


def _events() -> list[dict]:
    out = []

    def ev(at, type_, **kw):
        out.append({"event_id": f"e{len(out)}", "type": type_, "occurred_at": f"2026-11-02T{at}Z", "pool": POOL,
                    "source": "lab/test", **kw})

    ev("00:00:00", "pool.configured", flavor="a100-40gb", chips_per_node=4)
    for i in range(4):
        ev("00:00:00", "chip.registered", chip_id=f"c{i}", node="n0")
    ev("00:00:00", "quota.granted", grant_id="g-v", team="research/vision", chips=2)
    ev("00:00:00", "quota.granted", grant_id="g-n", team="research/nlp", chips=1)
    ev("00:00:00", "job.submitted", job_id="a", team="research/vision", chips=2, priority=1, user="alice")
    ev("00:00:00", "job.started", job_id="a")
    ev("00:30:00", "job.submitted", job_id="c", team="research/nlp", chips=1, priority=1, user="carol")
    ev("00:30:00", "job.started", job_id="c")
    ev("01:00:00", "job.submitted", job_id="b", team="research/vision", chips=1, priority=1, user="bob")
    ev("01:00:00", "job.started", job_id="b")
    ev("01:30:00", "job.finished", job_id="c", outcome="succeeded")
    ev("02:00:00", "job.finished", job_id="a", outcome="succeeded")
    ev("02:00:00", "job.submitted", job_id="d", team="speech", chips=1, priority=1, user="dave")
    ev("02:00:00", "job.started", job_id="d")
    ev("03:00:00", "job.finished", job_id="b", outcome="succeeded")
    ev("03:00:00", "job.finished", job_id="d", outcome="succeeded")
    return out


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    root = tmp_path_factory.mktemp("usage")
    (root / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _events()))
    summary, _ = run_file(root / "events.jsonl", root / "lake")
    assert not summary.dead_letters
    return root / "lake"


def _cli(*args) -> str:
    r = CliRunner().invoke(app, [*args])
    assert r.exit_code == 0, r.output
    return r.stdout


def test_usage_is_sreports_account_utilization_by_user(lake):
    out = _cli("usage", "--lake", str(lake), "-S", "2026-11-02T00:00:00Z", "-E", "2026-11-02T03:00:00Z",
               "-t", "seconds", "-P")
    rows = [x.split("|") for x in out.splitlines()]
    assert rows[0] == ["Cluster", "Account", "Login", "TRES Name", "Used"]
    got = {(a, u): int(v) for c, a, u, t, v in rows[1:] if c == "lab" and t == "chip/a100-40gb"}
    assert got == {("research", ""): 2 * 7200 + 7200 + 3600,  # vision 2×2h + 1×2h, nlp 1×1h
                   ("research/nlp", ""): 3600, ("research/nlp", "carol"): 3600,
                   ("research/vision", ""): 2 * 7200 + 7200, ("research/vision", "alice"): 2 * 7200,
                   ("research/vision", "bob"): 7200,
                   ("speech", ""): 3600, ("speech", "dave"): 3600}
    # the order of sreport: an account, its users, its sub-accounts after
    assert [(a, u) for _, a, u, _, _ in rows[1:]] == [
        ("research", ""), ("research/nlp", ""), ("research/nlp", "carol"), ("research/vision", ""),
        ("research/vision", "alice"), ("research/vision", "bob"), ("speech", ""), ("speech", "dave")]
    # one hour (01:00–02:00), in minutes and in percent of the pool's 4 chip-hours
    out = _cli("usage", "--lake", str(lake), "-S", "2026-11-02T01:00:00Z", "-E", "2026-11-02T02:00:00Z", "-t",
               "minutes", "-P", "-n", "--no-users")
    assert {a: v for _, a, _, _, v in (x.split("|") for x in out.splitlines())} == {
        "research": "210", "research/nlp": "30", "research/vision": "180"}
    out = _cli("usage", "--lake", str(lake), "-S", "2026-11-02T01:00:00Z", "-E", "2026-11-02T02:00:00Z", "-t",
               "percent", "-P", "-n", "-A", "research/vision")
    assert [x.split("|")[1:] for x in out.splitlines()] == [
        ["research/vision", "", "chip/a100-40gb", "75.00%"], ["research/vision", "alice", "chip/a100-40gb", "50.00%"],
        ["research/vision", "bob", "chip/a100-40gb", "25.00%"]]
    assert _cli("usage", "--lake", str(lake), "-S", "2026-11-02", "-E", "2026-11-02T03:00:00Z", "--flavor", "h100",
                "-P", "-n") == ""
    text = _cli("usage", "--lake", str(lake), "-S", "2026-11-02", "-E", "2026-11-02T03:00:00Z")
    assert "Cluster/Account/User Utilization 2026-11-02T00:00:00 - 2026-11-02T02:59:59 (10800 secs)" in text
    assert "Usage reported in TRES Hours" in text
    r = CliRunner().invoke(app, ["usage", "--lake", str(lake), "-S", "2026-11-02T03:00:00Z", "-E", "2026-11-02"])
    assert r.exit_code == 2 and "not after" in r.output


def test_share_is_sshare_l_with_the_cores_fair_share(lake):
    out = _cli("share", "--lake", str(lake), "--format", "json")
    rows = {(r["account"], r["user"]): r for r in json.loads(out)}
    assert set(rows) == {("research", None), ("research/nlp", None), ("research/nlp", "carol"),
                         ("research/vision", None), ("research/vision", "alice"), ("research/vision", "bob"),
                         ("speech", None), ("speech", "dave")}
    v, n, s, org = (rows[(a, None)] for a in ("research/vision", "research/nlp", "speech", "research"))
    assert (v["raw_shares"], n["raw_shares"], s["raw_shares"], org["raw_shares"]) == (2, 1, 0, 3)
    assert v["norm_shares"] == pytest.approx(2 / 3) and s["norm_shares"] == 0
    total = v["raw_usage_chip_s"] + n["raw_usage_chip_s"] + s["raw_usage_chip_s"]
    assert v["norm_usage"] == pytest.approx(v["raw_usage_chip_s"] / total)
    assert org["raw_usage_chip_s"] == pytest.approx(v["raw_usage_chip_s"] + n["raw_usage_chip_s"])
    assert org["fair_share"] is None and rows[("research/vision", "alice")]["raw_usage_chip_s"] == 2 * 7200
    # decayed (7-day half-life) a little below what they used
    assert 0.99 * 21600 < v["raw_usage_chip_s"] < 21600
    # the factor is the core's (the balances view at the same instant)
    bal = json.loads(_cli("sql", "--lake", str(lake), "--format", "json",
                          "SELECT team, fair_share_factor FROM balances WHERE \"at\" = (SELECT max(\"at\") FROM balances)"))
    assert {r["team"]: r["fair_share_factor"] for r in bal} == {
        a: rows[(a, None)]["fair_share"] for a in ("research/vision", "research/nlp", "speech")}
    text = _cli("share", "--lake", str(lake))
    assert "RawShares" in text and "FairShare" in text and "parent" in text
