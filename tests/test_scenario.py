"""Tests of the synthetic fleet scenario (chipledger.sim.scenario): determinism, ordering, the wire contract of
DESIGN §3, legal job lifecycles, placements that respect chip state and capacity, and the bad lines that
corrupt() inserts.

The checker below is written independently of the generator: it replays the events and keeps its own
model of pools, chips, grants and jobs.
"""

from __future__ import annotations

import json
import re
import time
import tracemalloc
from collections import Counter, defaultdict
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest

from chipledger.sim.scenario import BAD_KINDS, corrupt, generate, iter_jsonl, write_jsonl

UTC = timezone.utc
START = datetime(2026, 11, 2, tzinfo=UTC)

ENVELOPE = {"event_id", "type", "occurred_at", "pool", "source"}
# type -> (required fields, optional fields)
FIELDS = {
    "pool.configured": ({"flavor", "chips_per_node"}, set()),
    "pool.tick": (set(), set()),
    "chip.registered": ({"chip_id", "node"}, set()),
    "chip.state_changed": ({"chip_id", "state"}, {"reason"}),
    "chip.retired": ({"chip_id"}, set()),
    "quota.granted": ({"grant_id", "team", "chips"},
                      {"borrowing_limit", "lending_limit", "effective_from", "effective_until"}),
    "quota.revoked": ({"grant_id"}, set()),
    "burst.requested": ({"request_id", "team", "chips", "window_start", "window_end"}, {"reason"}),
    "job.submitted": ({"job_id", "team", "chips", "priority", "preemptible"}, {"chips_per_node"}),
    "job.started": ({"job_id"}, {"chip_ids"}),
    "job.checkpointed": ({"job_id"}, set()),
    "job.preempted": ({"job_id"}, {"decision_id"}),
    "job.finished": ({"job_id", "outcome"}, set()),
}
TS_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
STATES = {"healthy", "degraded", "down", "maintenance"}


def ts(s: str) -> datetime:
    assert TS_RE.match(s), s
    return datetime.fromisoformat(s)


def milli(chips) -> int:
    assert isinstance(chips, (int, float)) and not isinstance(chips, bool), chips
    d = Decimal(str(chips))
    assert d == d.quantize(Decimal("0.001")), f"more than 3 decimals: {chips}"
    return int(d * 1000)


class Checker:
    """Replays a scenario and asserts the contract and the cluster's invariants after every event."""

    def __init__(self) -> None:
        self.last_at = ""
        self.event_ids: set[str] = set()
        self.pools: dict[str, dict] = {}
        self.last_type: dict[str, str] = {}
        self.jobs: dict[str, dict] = {}
        self.grants: dict[str, str] = {}
        self.revoked: set[str] = set()
        self.alloc: dict[tuple[str, str], int] = defaultdict(int)  # (pool, chip) -> milli in use
        self.counts: Counter = Counter()
        self.outcomes: Counter = Counter()
        self.states: Counter = Counter()
        self.placed_starts = 0

    def feed(self, ev: dict) -> None:
        typ = ev["type"]
        self.counts[typ] += 1
        # envelope and exact field set (the contract rejects unknown fields)
        assert typ in FIELDS, ev
        required, optional = FIELDS[typ]
        keys = set(ev)
        assert ENVELOPE | required <= keys, ev
        assert keys <= ENVELOPE | required | optional, ev
        assert isinstance(ev["event_id"], str) and 1 <= len(ev["event_id"]) <= 128
        assert ev["event_id"] not in self.event_ids, f"duplicate event id {ev['event_id']}"
        self.event_ids.add(ev["event_id"])
        assert ev["occurred_at"] >= self.last_at, f"time went backwards at {ev}"
        ts(ev["occurred_at"])
        self.last_at = ev["occurred_at"]
        pool = ev["pool"]
        assert isinstance(ev["source"], str) and ev["source"]
        if typ == "pool.configured":
            assert pool not in self.pools, f"pool configured twice: {pool}"
            assert isinstance(ev["chips_per_node"], int) and ev["chips_per_node"] >= 1
            self.pools[pool] = {"cpn": ev["chips_per_node"], "chips": {}, "retired": set(), "ticked": False}
            self.last_type[pool] = typ
            return
        assert pool in self.pools, f"first event of {pool} is not pool.configured: {ev}"
        p = self.pools[pool]
        assert not p["ticked"], f"event after the closing pool.tick: {ev}"
        self.last_type[pool] = typ
        getattr(self, "on_" + typ.replace(".", "_"))(ev, p)

    # --- pools and chips
    def on_pool_tick(self, ev, p):
        p["ticked"] = True

    def on_chip_registered(self, ev, p):
        assert ev["chip_id"] not in p["chips"], ev
        p["chips"][ev["chip_id"]] = "healthy"

    def on_chip_state_changed(self, ev, p):
        cid = ev["chip_id"]
        assert cid in p["chips"], f"state of an unregistered chip: {ev}"
        assert cid not in p["retired"], f"state of a retired chip: {ev}"
        assert ev["state"] in STATES, ev
        p["chips"][cid] = ev["state"]
        self.states[ev["state"]] += 1

    def on_chip_retired(self, ev, p):
        cid = ev["chip_id"]
        assert cid in p["chips"] and cid not in p["retired"], ev
        p["retired"].add(cid)

    # --- quota and bursts
    def on_quota_granted(self, ev, p):
        assert ev["grant_id"] not in self.grants, ev
        self.grants[ev["grant_id"]] = ev["pool"]
        assert milli(ev["chips"]) > 0
        for k in ("borrowing_limit", "lending_limit"):
            if k in ev:
                assert milli(ev[k]) >= 0
        if "effective_from" in ev and "effective_until" in ev:
            assert ts(ev["effective_until"]) > ts(ev["effective_from"])

    def on_quota_revoked(self, ev, p):
        gid = ev["grant_id"]
        assert self.grants.get(gid) == ev["pool"], f"revoking an unknown grant: {ev}"
        assert gid not in self.revoked
        self.revoked.add(gid)

    def on_burst_requested(self, ev, p):
        assert milli(ev["chips"]) > 0
        assert ts(ev["window_end"]) > ts(ev["window_start"])

    # --- jobs: submitted -> started -> (checkpointed)* -> (preempted -> started)* -> finished,
    #     or submitted/preempted (pending) -> finished(cancelled)
    def _job(self, ev, *states):
        j = self.jobs.get(ev["job_id"])
        assert j is not None, f"event for a job never submitted: {ev}"
        assert j["pool"] == ev["pool"], f"job changed pool: {ev}"
        assert j["state"] in states, f"illegal transition {j['state']} -> {ev['type']}: {ev}"
        return j

    def on_job_submitted(self, ev, p):
        assert ev["job_id"] not in self.jobs, f"job id reused: {ev}"
        m = milli(ev["chips"])
        assert m > 0
        assert isinstance(ev["priority"], int) and not isinstance(ev["priority"], bool)
        assert isinstance(ev["preemptible"], bool)
        if "chips_per_node" in ev:
            assert ev["chips_per_node"] == p["cpn"]
        self.jobs[ev["job_id"]] = {"pool": ev["pool"], "state": "pending", "milli": m, "chips": None,
                                   "starts": 0, "preemptible": ev["preemptible"]}

    def on_job_started(self, ev, p):
        j = self._job(ev, "pending")
        j["state"] = "running"
        j["starts"] += 1
        ids = ev.get("chip_ids")
        if ids is None:
            j["chips"] = None
            return
        self.placed_starts += 1
        assert isinstance(ids, list) and ids and len(set(ids)) == len(ids), ev
        m = j["milli"]
        if m >= 1000:
            assert m % 1000 == 0 and len(ids) == m // 1000, f"whole-chip job on {len(ids)} chips: {ev}"
            share = 1000
        else:
            assert len(ids) == 1, ev
            share = m
        for cid in ids:
            assert cid in p["chips"], f"placed on an unregistered chip: {ev}"
            assert cid not in p["retired"], f"placed on a retired chip: {ev}"
            assert p["chips"][cid] in ("healthy", "degraded"), f"placed on a {p['chips'][cid]} chip: {ev}"
            key = (ev["pool"], cid)
            self.alloc[key] += share
            assert self.alloc[key] <= 1000, f"chip {cid} over-allocated ({self.alloc[key]} milli): {ev}"
        j["chips"] = (ids, share)

    def _release(self, ev, j):
        if j["chips"]:
            ids, share = j["chips"]
            for cid in ids:
                self.alloc[(ev["pool"], cid)] -= share
                assert self.alloc[(ev["pool"], cid)] >= 0
        j["chips"] = None

    def on_job_checkpointed(self, ev, p):
        self._job(ev, "running")

    def on_job_preempted(self, ev, p):
        j = self._job(ev, "running")
        self._release(ev, j)
        j["state"] = "pending"

    def on_job_finished(self, ev, p):
        assert ev["outcome"] in ("succeeded", "failed", "cancelled"), ev
        j = self._job(ev, "running", "pending")
        if j["state"] == "pending":
            assert ev["outcome"] == "cancelled", f"a pending job can only be cancelled: {ev}"
        self._release(ev, j)
        j["state"] = "finished"
        self.outcomes[ev["outcome"]] += 1

    def close(self, end: datetime) -> None:
        for pool, p in self.pools.items():
            assert p["ticked"] and self.last_type[pool] == "pool.tick", f"{pool} does not end with pool.tick"
        assert self.last_at == end.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def check(events, end: datetime) -> Checker:
    c = Checker()
    for ev in events:
        c.feed(ev)
    c.close(end)
    return c


@pytest.fixture(scope="module")
def default_events():
    return list(generate())


@pytest.fixture(scope="module")
def default_check(default_events):
    return check(default_events, START + timedelta(days=14))


# ---------------------------------------------------------------------- generator


def test_same_seed_same_lines_other_seed_other_lines():
    a = list(iter_jsonl(generate(seed=3, days=2)))
    b = list(iter_jsonl(generate(seed=3, days=2)))
    c = list(iter_jsonl(generate(seed=4, days=2)))
    assert a == b
    assert a != c
    assert len(a) > 1000


def test_default_scenario_obeys_the_contract_and_the_cluster_invariants(default_check):
    c = default_check
    # every kind of event shows up
    assert set(c.counts) == set(FIELDS)
    assert c.counts["pool.configured"] == c.counts["pool.tick"] == 3
    assert set(c.states) == STATES
    assert 1 <= c.counts["chip.retired"] <= 2
    assert c.counts["quota.revoked"] >= 1
    assert 1 <= c.counts["burst.requested"] <= 20
    assert c.counts["job.preempted"] > 0 and c.counts["job.checkpointed"] > 0
    # most starts carry their placement
    assert c.placed_starts > 0.9 * c.counts["job.started"]


def test_event_count_in_the_expected_range(default_events):
    assert 20_000 <= len(default_events) <= 80_000


def test_pools_sizes_and_quota_cover_80_to_110_percent_of_capacity():
    for seed in (1, 2, 3):
        chips = Counter()
        quota = Counter()
        for ev in generate(seed=seed, days=1):
            if ev["type"] == "chip.registered":
                chips[ev["pool"]] += 1
            elif ev["type"] == "quota.granted" and ev["occurred_at"] == "2026-11-02T00:00:00Z":
                quota[ev["pool"]] += milli(ev["chips"])
        assert len(chips) == 3
        for pool, n in chips.items():
            assert 32 <= n <= 256, (pool, n)
            # integer rounding of each team's share can move the sum a little
            assert 0.75 * n * 1000 <= quota[pool] <= 1.15 * n * 1000, (pool, n, quota[pool])


def test_job_mix_is_realistic(default_events, default_check):
    subs = [e for e in default_events if e["type"] == "job.submitted"]
    frac = sum(1 for e in subs if e["chips"] < 1) / len(subs)
    assert 0.04 <= frac <= 0.20, frac
    powers_of_two = {2**k for k in range(12)}
    assert all(e["chips"] in (0.125, 0.25, 0.5) or e["chips"] in powers_of_two for e in subs)
    assert {e["priority"] for e in subs} == {0, 100, 1000}
    failed = default_check.outcomes["failed"] / len(subs)
    assert 0.03 <= failed <= 0.12, failed
    assert default_check.outcomes["cancelled"] > 0
    # a team submits a sweep: many jobs in the same second
    per_second = Counter((e["occurred_at"], e["team"]) for e in subs)
    assert max(per_second.values()) >= 20


def test_diurnal_demand(default_events):
    afternoon, night, weekend = 0, 0, 0
    for e in default_events:
        if e["type"] != "job.submitted":
            continue
        at = datetime.fromisoformat(e["occurred_at"])
        if at.weekday() >= 5:
            weekend += 1
        elif 12 <= at.hour < 18:
            afternoon += 1
        elif 0 <= at.hour < 6:
            night += 1
    # submissions per hour: 14 days from a Monday = 10 weekdays and 4 weekend days
    afternoon, night, weekend = afternoon / 60, night / 60, weekend / 96
    assert afternoon > 2 * night, (afternoon, night)
    assert afternoon > 2 * weekend, (afternoon, weekend)


def test_scale_and_other_shapes_keep_the_invariants():
    # more pools than templates, more teams than names, a non-midnight start, scale and short days
    start = datetime(2027, 3, 5, 13, 30, 7, tzinfo=UTC)
    c = check(generate(seed=11, days=1.5, start=start, pools=9, teams=18, scale=0.5),
              start + timedelta(days=1.5))
    assert c.counts["pool.configured"] == 9
    c = check(generate(seed=5, days=2, scale=3), START + timedelta(days=2))
    assert c.counts["job.submitted"] > 3000
    # a start in another zone, one pool, one team
    start = datetime(2026, 11, 2, 5, 0, 0, tzinfo=timezone(timedelta(hours=2)))
    c = check(generate(seed=0, days=3, start=start, pools=1, teams=1), start + timedelta(days=3))
    assert c.counts["job.finished"] > 0


def test_generation_is_lazy_and_memory_does_not_grow_with_days():
    t = time.perf_counter()
    gen = generate(days=100_000)
    first = next(gen)
    assert first["type"] == "pool.configured"
    assert time.perf_counter() - t < 5

    def peak(days):
        tracemalloc.start()
        try:
            n = sum(1 for _ in generate(seed=2, days=days, pools=2, teams=6, scale=0.5))
            return n, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    n_short, short = peak(4)
    n_long, long_ = peak(20)
    assert n_long > 3 * n_short
    assert long_ < 2 * short, (short, long_)


def test_write_jsonl_round_trips(tmp_path):
    events = list(generate(seed=9, days=0.5))
    path = tmp_path / "s.jsonl"
    assert write_jsonl(iter(events), path) == len(events)
    lines = path.read_text().splitlines()
    assert [json.loads(s) for s in lines] == events
    assert all(", " not in s and '": ' not in s for s in lines[:50])  # compact separators


# ---------------------------------------------------------------------- corrupt()


def classify(text: str, seen: dict[str, str], pools: set, chips: set, jobs: dict) -> str:
    """What is wrong with an inserted line, judged from the stream before it."""
    try:
        ev = json.loads(text)
    except ValueError:
        return "not_json"
    eid = ev.get("event_id")
    if eid in seen:
        return "duplicate" if seen[eid] == text else "duplicate_conflict"
    typ = ev.get("type")
    if typ not in FIELDS:
        return "unknown_type"
    required, optional = FIELDS[typ]
    if not (ENVELOPE | required) <= set(ev):
        return "missing_field"
    if not set(ev) <= ENVELOPE | required | optional:
        return "extra_field"
    if not TS_RE.match(ev["occurred_at"]) and datetime.fromisoformat(ev["occurred_at"]).tzinfo is None:
        return "naive_timestamp"
    if "chips" in ev and ev["chips"] == 0:
        return "zero_chips"
    if "chips" in ev and ev["chips"] < 0:
        return "negative_chips"
    if ev["pool"] not in pools:
        return "unknown_pool"
    if typ == "job.started" and ev["job_id"] not in jobs:
        return "unknown_job"
    if typ == "chip.state_changed" and (ev["pool"], ev["chip_id"]) not in chips:
        return "unknown_chip"
    if typ == "job.checkpointed" and jobs.get(ev["job_id"]) == "pending":
        return "illegal_transition"
    return "valid"


def test_corrupt_inserts_every_bad_kind():
    original = [s + "\n" for s in iter_jsonl(generate(seed=5, days=2))]
    labels: list = []
    out = list(corrupt(iter(original), seed=1, every=40, labels=labels))
    assert len(out) > len(original)
    inserted = len(out) - len(original)
    assert abs(inserted - len(original) / 40) <= 0.2 * len(original) / 40 + 2

    seen: dict[str, str] = {}
    pools, chips, jobs = set(), set(), {}
    found = Counter()
    fresh_ids: list[str] = []
    i = 0  # next original line
    prev_at = None
    label_of = dict(labels)
    for k, line in enumerate(out):
        assert line.endswith("\n")
        text = line[:-1]
        if i < len(original) and line == original[i]:
            i += 1
            ev = json.loads(text)
            seen[ev["event_id"]] = text
            prev_at = ev["occurred_at"]
            typ = ev["type"]
            if typ == "pool.configured":
                pools.add(ev["pool"])
            elif typ == "chip.registered":
                chips.add((ev["pool"], ev["chip_id"]))
            elif typ in ("job.submitted", "job.preempted"):
                jobs[ev["job_id"]] = "pending"
            elif typ == "job.started":
                jobs[ev["job_id"]] = "running"
            elif typ == "job.finished":
                jobs[ev["job_id"]] = "finished"
            continue
        kind = classify(text, seen, pools, chips, jobs)
        assert kind in BAD_KINDS, (kind, text)
        assert label_of.get(k) == kind, (k, label_of.get(k), kind, text)
        found[kind] += 1
        # an inserted line carries the time of the line before it
        if kind == "not_json":
            assert prev_at in text
        elif kind == "naive_timestamp":
            assert json.loads(text)["occurred_at"] == prev_at[:-1]
        else:
            assert json.loads(text)["occurred_at"] == prev_at
        if kind not in ("duplicate", "duplicate_conflict"):
            m = re.search(r'"event_id":"([^"]+)"', text)
            assert m, text
            fresh_ids.append(m.group(1))
    assert i == len(original), "corrupt() must pass every original line through, in order"
    assert set(found) == set(BAD_KINDS), found
    assert len(set(fresh_ids)) == len(fresh_ids)
    assert not set(fresh_ids) & set(seen)
    # deterministic by seed
    assert list(corrupt(iter(original), seed=1, every=40)) == out
    assert list(corrupt(iter(original), seed=2, every=40)) != out
