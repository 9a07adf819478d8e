"""The portal's burst dry run decides over the core's own inputs (chipledger/web/burst.py).

The fold decides a burst over `ledger.policy.burst_inputs(state, …)`; the portal rebuilds the same `BurstInputs` from
the facts the fold wrote to the lake (balances, grants, free chips, the journal's hourly postings for the demand
profile and the error budget, the burst decisions). Here a seeded log with several teams, grants (a lending limit,
none, zero, two grants of one team, one that ends, one revoked, one not yet in effect), bursts (approved, cut, denied,
overlapping), chips down, hours without demand, and a pool whose first hours have no team at all (hours the fold
closes without a row), is folded by the core in this process and run into a lake by `chipledger run`; at the latest
close of the books of each pool, the portal's inputs must equal the core's, field by field, for every team and for
windows before, across and after the clock, over other bursts and longer than a week. The log is cut at several
places (a pool clock in the quiet stretch, early, the end) and each cut is checked."""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chipledger.cli import app as cli_app
from chipledger.web import burst as web_burst
from chipledger.web.lake import LakeReader

BASE = datetime(2026, 11, 2, tzinfo=timezone.utc)  # a Monday
P1, P2 = "c1/a100", "c2/h100"
SEED = 20261205


def _ts(h: float) -> str:
    return (BASE + timedelta(seconds=round(h * 3600))).strftime("%Y-%m-%dT%H:%M:%SZ")


def scenario(seed: int = SEED) -> list[tuple[float, dict]]:
    """(hour, event) in the order they happen."""
    rnd = random.Random(seed)
    out: list[tuple[float, dict]] = []
    n = 0

    def ev(h: float, pool: str, kind: str, **fields) -> None:
        nonlocal n
        n += 1
        out.append((h, {"event_id": f"e{n:05d}", "type": kind, "occurred_at": _ts(h), "pool": pool,
                        "source": "test/scenario", **fields}))

    # P1: configured at 00:17, its chips and teams only at 03:40: the fold closes hours 0-2 with no row anywhere
    ev(0.29, P1, "pool.configured", flavor="a100", chips_per_node=8)
    ev(0.0, P2, "pool.configured", flavor="h100", chips_per_node=4)
    for node in range(2):
        for g in range(4):
            ev(0.0, P2, "chip.registered", chip_id=f"h{node}-{g}", node=f"h{node}")
    for node in range(2):
        for g in range(8):
            ev(3.67, P1, "chip.registered", chip_id=f"a{node}-{g}", node=f"a{node}")
    grants = [
        (3.67, P1, "g-alpha", "alpha", 6, {"lending_limit": 2}),
        (3.67, P1, "g-alpha-2", "alpha", 1, {"lending_limit": 1}),
        (3.67, P1, "g-beta", "beta", 4, {}),
        (3.67, P1, "g-gamma", "gamma", 3, {"lending_limit": 0, "effective_until": _ts(44.0)}),
        (3.67, P1, "g-delta", "delta", 2, {"lending_limit": 1}),
        (3.67, P1, "g-eps", "epsilon", 2, {"lending_limit": 0, "effective_from": _ts(400.0)}),
        (0.0, P2, "h-alpha", "alpha", 4, {"lending_limit": 1}),
        (0.0, P2, "h-beta", "beta", 3, {"lending_limit": 3}),
    ]
    for h, pool, gid, team, chips, extra in grants:
        ev(h, pool, "quota.granted", grant_id=gid, team=team, chips=chips, **extra)
    ev(30.5, P1, "quota.revoked", grant_id="g-delta")
    # chips down for a few hours (the capacity error budget)
    ev(100.2, P1, "chip.state_changed", chip_id="a1-3", state="down", reason="xid 79")
    ev(100.2, P1, "chip.state_changed", chip_id="a1-4", state="degraded", reason="ecc")
    ev(100.3, P1, "chip.state_changed", chip_id="a1-3", state="healthy")
    ev(26.0, P2, "chip.state_changed", chip_id="h1-0", state="maintenance")
    ev(26.1, P2, "chip.state_changed", chip_id="h1-0", state="healthy")
    # jobs: busy from hour 4 to 40, nothing from 40 to 80 (hours without demand), busy again to 110
    capacity = {P1: 16, P2: 8}
    busy: dict[str, list[tuple[float, float, int]]] = {P1: [], P2: []}
    teams = {P1: ["alpha", "beta", "gamma", "delta", "omega"], P2: ["alpha", "beta", "omega"]}
    j = 0
    for lo, hi in ((4.0, 40.0), (80.0, 110.0)):
        for pool in (P1, P2):
            h = lo
            while True:
                h += rnd.uniform(0.2, 1.5)
                if h >= hi:
                    break
                j += 1
                job = f"{pool[:2]}-job-{j}"
                chips = rnd.choice([1, 1, 2, 2, 4, 8])
                team = rnd.choice(teams[pool])
                ev(h, pool, "job.submitted", job_id=job, team=team, chips=chips, priority=rnd.choice([0, 10, 100]))
                start = h + rnd.uniform(0.01, 0.5)
                dur = rnd.uniform(0.2, 6.0)
                used = sum(c for s, e, c in busy[pool] if s < start + dur and e > start)
                if used + chips > capacity[pool] or rnd.random() < 0.1:
                    gone = start + rnd.uniform(0.5, 4.0)
                    if rnd.random() < 0.8 and gone < hi:
                        ev(gone, pool, "job.finished", job_id=job, outcome="cancelled")
                    continue  # never starts: pending (demand) until cancelled or the end
                busy[pool].append((start, start + dur, chips))
                ev(start, pool, "job.started", job_id=job)
                if start + dur < hi + 2:
                    ev(start + dur, pool, "job.finished", job_id=job, outcome=rnd.choice(["succeeded", "failed"]))
    # bursts: windows ahead, overlapping each other, one already over, one far larger than the pool, a request id sent
    # twice
    bursts = [
        (12.0, P1, "b-1", "beta", 3, 30.0, 34.0),
        (12.5, P1, "b-2", "alpha", 8, 31.0, 36.0),
        (13.0, P1, "b-3", "gamma", 2, 5.0, 9.0),
        (50.0, P1, "b-4", "delta", 40, 120.0, 130.0),
        (90.0, P1, "b-5", "omega", 2, 112.0, 118.0),
        (91.0, P1, "b-6", "beta", 4, 114.0, 300.0),
        (92.0, P2, "b-7", "alpha", 2, 111.0, 113.0),
        (13.5, P1, "b-1", "beta", 2, 30.0, 34.0),      # the same request id again: decided once, then denied
        (82.0, P1, "b-1", "beta", 2, 100.0, 105.0),    # and again once its first window is over: a new reservation
        (95.0, P2, "b-8", "beta", 6, 112.0, 116.0),
    ]
    for h, pool, rid, team, chips, ws, we in bursts:
        ev(h, pool, "burst.requested", request_id=rid, team=team, chips=chips, window_start=_ts(ws),
           window_end=_ts(we))
    out.sort(key=lambda x: x[0])  # stable: events of one instant keep their order
    return out


def _lines(events: list[tuple[float, dict]], until_h: float) -> list[str]:
    kept = [json.dumps(e) for h, e in events if h <= until_h]
    for pool in (P1, P2):  # each pool's clock moves to the cut, as the worker's timer does
        kept.append(json.dumps({"event_id": f"tick-{pool}-{until_h}", "type": "pool.tick", "occurred_at": _ts(until_h),
                                "pool": pool, "source": "test/timer"}))
    return kept


def _core_states(lines: list[str]):
    from ledger.fleet import Fleet
    from ledger.fold import FoldConfig
    from schemas import parse_event

    fleet = Fleet(FoldConfig())
    for line in lines:
        fleet.apply(parse_event(line.encode()), line.encode())
    fleet.close()
    return fleet.pools


@pytest.fixture(scope="module")
def events():
    return scenario()


@pytest.mark.parametrize("until_h", [20.5, 61.25, 116.6])
def test_the_dry_runs_inputs_are_the_cores_at_the_latest_close_of_the_books(events, until_h, tmp_path):
    from ledger.fold import FoldConfig
    from ledger.policy import burst_inputs, burst_verdict

    lines = _lines(events, until_h)
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    lake = tmp_path / "lake"
    res = CliRunner().invoke(cli_app, ["run", "--events", str(path), "--lake", str(lake),
                                       "--store", f"sqlite:///{tmp_path / 'store.db'}"])
    assert res.exit_code == 0, res.output
    states = _core_states(lines)
    snap = LakeReader(lake).snapshot
    cfg = FoldConfig()
    verdicts = {r["verdict"] for r in snap.rows("SELECT verdict FROM portal_decisions WHERE type = 'decision.burst'")}
    if until_h > 100:  # the log's bursts were approved, cut and denied (the inputs below are checked over all that)
        assert verdicts == {"approved", "partial", "denied"}
    for pool in (P1, P2):
        state = states[pool]
        facts = web_burst.pool_facts(snap, pool)
        assert facts is not None and facts.t == state.clock, pool  # the lake's latest close is the core's clock
        t = facts.t
        windows = [(t + 3600, t + 5 * 3600), (t - 7200, t + 7200), (t - 5 * 3600, t - 3600),
                   (t + 86400 + 1800, t + 86400 + 9 * 3600), (t + 10 * 86400, t + 10 * 86400 + 200 * 3600)]
        windows += [(round((BASE + timedelta(hours=a)).timestamp()), round((BASE + timedelta(hours=b)).timestamp()))
                    for a, b in ((112.0, 118.0), (31.0, 36.0))]  # over the bursts of the log
        teams = sorted(state.teams) + ["newcomer"]
        assert len(teams) >= 3
        for team in teams:
            for ws, we in windows:
                for rid in ("dry-run", "b-1", "b-7"):
                    core = burst_inputs(state, team, rid, ws, we, t, cfg)
                    ours = web_burst.inputs(facts, team, rid, ws, we, cfg.capacity_slo_target)
                    assert ours._asdict() == core._asdict(), (pool, team, ws - t, we - t, rid)
                    assert burst_verdict(ours, 3000, we, t) == burst_verdict(core, 3000, we, t)


def test_the_scenario_has_what_it_says(events):
    """The log holds what the equivalence is claimed over (a test of the test's input)."""
    kinds = [e["type"] for _, e in events]
    assert {"quota.revoked", "burst.requested", "chip.state_changed", "job.finished"} <= set(kinds)
    hours = sorted(h for h, e in events if e["type"].startswith("job."))
    assert any(b - a > 30 for a, b in zip(hours, hours[1:])), "a stretch without demand"
    assert len({e["team"] for _, e in events if e["type"] == "job.submitted"}) >= 4
