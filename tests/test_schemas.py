"""The wire contract (schemas/): every event type parses, chips become milli-chips exactly, bad input becomes
a Rejection with the code of highest precedence, and nothing in parsing ever raises."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from schemas import (
    EVENT_MODELS,
    INPUT_TOPICS,
    MILLI,
    TOPIC_CHIPS,
    TOPIC_JOBS,
    TOPIC_QUOTA,
    Rejection,
    RejectionCode as RC,
    epoch_s,
    from_milli,
    key_for,
    parse_event,
    parse_payload,
    to_milli,
    topic_for,
)

T0_ISO = "2026-11-02T08:00:00Z"
T0_S = 1_793_606_400  # 2026-11-02T08:00:00Z in epoch seconds

ENVELOPE = {"event_id": "ev-1", "occurred_at": T0_ISO, "pool": "us-east1-a/h100-80gb", "source": "cluster-a/kueue"}

# One valid wire body per event type (envelope added by `wire`).
BODIES = {
    "pool.configured": {"flavor": "h100-80gb", "chips_per_node": 8},
    "pool.tick": {},
    "chip.registered": {"chip_id": "node-1/gpu-0", "node": "node-1"},
    "chip.state_changed": {"chip_id": "node-1/gpu-0", "state": "down", "reason": "XID 79"},
    "chip.retired": {"chip_id": "node-1/gpu-0"},
    "quota.granted": {"grant_id": "g-1", "team": "ads", "chips": 16, "borrowing_limit": 4, "lending_limit": 0,
                      "effective_from": "2026-11-02T09:00:00Z", "effective_until": "2026-11-03T09:00:00+00:00"},
    "quota.revoked": {"grant_id": "g-1"},
    "burst.requested": {"request_id": "b-1", "team": "ads", "chips": 2.5,
                        "window_start": "2026-11-02T10:00:00Z", "window_end": "2026-11-02T12:00:00Z",
                        "reason": "launch"},
    "job.submitted": {"job_id": "j-1", "team": "ads", "chips": 0.5, "priority": 10, "preemptible": False,
                      "chips_per_node": 8, "user": "alice"},
    "job.started": {"job_id": "j-1", "chip_ids": ["node-1/gpu-0", "node-1/gpu-1"]},
    "job.checkpointed": {"job_id": "j-1", "units": 1200},
    "job.progress": {"job_id": "j-1", "units": 1250, "unit": "step"},
    "job.preempted": {"job_id": "j-1", "decision_id": "d-1", "held": True, "cause": "requeued",
                      "reason": "InCohortReclamation"},
    "job.released": {"job_id": "j-1"},
    "job.finished": {"job_id": "j-1", "outcome": "failed"},
    "job.waiting": {"job_id": "j-1", "reason": "Priority", "message": "waiting for 8 chips\nin cohort"},
    "price.set": {"price_id": "p-1", "per_chip_hour": 250, "unit": "USD-cent",
                  "effective_from": "2026-11-02T09:00:00Z", "effective_until": "2026-12-01T00:00:00Z",
                  "hours_of_week": [9, 10, 11]},
    "budget.set": {"budget_id": "b-1", "team": "ads", "period": "month", "amount": 5_000_000, "unit": "USD-cent",
                   "effective_from": "2026-11-01T00:00:00Z"},
}

# The fields an event type cannot do without (the envelope's are tested separately).
REQUIRED = {
    "pool.configured": ["flavor", "chips_per_node"],
    "pool.tick": [],
    "chip.registered": ["chip_id", "node"],
    "chip.state_changed": ["chip_id", "state"],
    "chip.retired": ["chip_id"],
    "quota.granted": ["grant_id", "team", "chips"],
    "quota.revoked": ["grant_id"],
    "burst.requested": ["request_id", "team", "chips", "window_start", "window_end"],
    "job.submitted": ["job_id", "team", "chips"],
    "job.started": ["job_id"],
    "job.checkpointed": ["job_id"],
    "job.progress": ["job_id", "units", "unit"],
    "job.preempted": ["job_id"],
    "job.released": ["job_id"],
    "job.finished": ["job_id", "outcome"],
    "job.waiting": ["job_id", "reason"],
    "price.set": ["price_id", "per_chip_hour", "unit"],
    "budget.set": ["budget_id", "team", "period", "amount", "unit"],
}


def wire(etype: str, **over) -> dict:
    d = {**ENVELOPE, "type": etype, **BODIES[etype]}
    d.update(over)
    return d


def without(d: dict, *keys) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def code_of(result):
    assert isinstance(result, Rejection), f"expected a rejection, got {result!r}"
    return result.code


def test_fixtures_cover_every_event_type():
    assert set(BODIES) == set(EVENT_MODELS) == set(REQUIRED)
    assert len(EVENT_MODELS) == 18  # job.waiting, price.set and budget.set: issue 31's contract


# --- valid input -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("etype", sorted(BODIES))
def test_every_event_type_parses_from_a_valid_wire_dict(etype):
    d = wire(etype)
    ev = parse_payload(d)
    assert type(ev) is EVENT_MODELS[etype]
    assert ev.type == etype and ev.event_id == "ev-1" and ev.pool == ENVELOPE["pool"]
    assert ev.schema_version == 1
    assert ev.at_s == T0_S
    # the bytes path gives the same model
    assert parse_event(orjson.dumps(d)) == ev
    assert parse_event(json.dumps(d)) == ev


@pytest.mark.parametrize("etype", sorted(BODIES))
def test_minimal_body_parses_and_optionals_default(etype):
    d = {**ENVELOPE, "type": etype, **{k: BODIES[etype][k] for k in REQUIRED[etype]}}
    ev = parse_payload(d)
    assert type(ev) is EVENT_MODELS[etype]


def test_defaults():
    ev = parse_payload({**ENVELOPE, "type": "job.submitted", "job_id": "j", "team": "t", "chips": 1})
    assert ev.priority == 0 and ev.preemptible is True and ev.chips_per_node is None
    g = parse_payload({**ENVELOPE, "type": "quota.granted", "grant_id": "g", "team": "t", "chips": 1})
    assert g.borrowing_limit is None and g.lending_limit is None
    assert g.effective_from is None and g.effective_until is None
    s = parse_payload({**ENVELOPE, "type": "job.started", "job_id": "j"})
    assert s.chip_ids is None


def test_events_are_frozen():
    ev = parse_payload(wire("job.checkpointed"))
    with pytest.raises(ValidationError):
        ev.job_id = "other"


# --- chips -> milli-chips --------------------------------------------------------------------------------

@pytest.mark.parametrize("chips, milli", [
    (0.5, 500), (1.001, 1001), (1, 1000), (16, 16_000), (0.001, 1), (0.1, 100), (2.675, 2675),
    (Decimal("3.125"), 3125), (1e3, 1_000_000), (1_000_000, 10**9),  # MAX_CHIPS: 1e9 milli-chips
])
def test_chips_to_milli(chips, milli):
    for etype in ("job.submitted", "quota.granted", "burst.requested"):
        ev = parse_payload(wire(etype, chips=chips))
        assert not isinstance(ev, Rejection), ev
        assert ev.chips_milli == milli
        assert isinstance(ev.chips_milli, int)


@pytest.mark.parametrize("chips", [
    0.0001, 1.0005, "0.0001", 0, 0.0, "0", -1, -0.5, True, False, "abc", "", None, [1], {"n": 1},
    "NaN", "Infinity", float("inf"), 1e30, 10**40, "1e30", "1000000000000000000000000000000.0001",
    1_000_000.001, 1_000_000_000, "0.5", "1_000",  # chips are JSON numbers, never strings
])
def test_bad_chips_are_schema_invalid(chips):
    for etype in ("job.submitted", "quota.granted", "burst.requested"):
        assert code_of(parse_payload(wire(etype, chips=chips))) == RC.schema_invalid


@pytest.mark.parametrize("field", ["borrowing_limit", "lending_limit"])
def test_chip_limits_allow_zero_but_not_negative_or_fine_grained(field):
    ev = parse_payload(wire("quota.granted", **{field: 0}))
    assert getattr(ev, field) == 0
    ev = parse_payload(wire("quota.granted", **{field: 2.5}))
    assert to_milli(getattr(ev, field)) == 2500
    for bad in (-1, 0.0001, True, "x"):
        assert code_of(parse_payload(wire("quota.granted", **{field: bad}))) == RC.schema_invalid


@pytest.mark.parametrize("etype, field, value", [
    ("job.submitted", "priority", True), ("job.submitted", "priority", 1.0), ("job.submitted", "priority", "5"),
    ("job.submitted", "preemptible", "yes"), ("job.submitted", "preemptible", 1),
    ("job.submitted", "chips_per_node", 8.0), ("pool.configured", "chips_per_node", True),
])
def test_ints_and_bools_are_strict(etype, field, value):
    assert code_of(parse_payload(wire(etype, **{field: value}))) == RC.schema_invalid


def test_milli_helpers():
    assert to_milli(Decimal("1.001")) == 1001
    assert from_milli(1500) == 1.5
    assert MILLI == 1000


# --- timestamps ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ts", [
    "2026-11-02T08:00:00",            # naive
    "2026-11-02 08:00:00",            # naive
    "2026-11-02",                     # a date, no time, no zone
    T0_S,                             # bare number
    float(T0_S),                      # bare number
    str(T0_S),                        # a number in a string is not RFC 3339 either
    "1793606400.5",
    True,
    None,
    "yesterday",
    "2026-13-02T08:00:00Z",
])
@pytest.mark.parametrize("field", ["occurred_at", "effective_from", "window_start"])
def test_bad_timestamps_are_schema_invalid(ts, field):
    etype = {"occurred_at": "pool.tick", "effective_from": "quota.granted", "window_start": "burst.requested"}[field]
    d = wire(etype, **{field: ts})
    if field == "effective_from":
        d.pop("effective_until")  # only the field under test may be wrong
    if ts is None and field == "effective_from":
        return  # None is the absent value of an optional field
    assert code_of(parse_payload(d)) == RC.schema_invalid


@pytest.mark.parametrize("ts, at_s", [
    ("2026-11-02T08:00:00Z", T0_S),
    ("2026-11-02T08:00:00+00:00", T0_S),
    ("2026-11-02T10:00:00+02:00", T0_S),
    ("2026-11-02T03:00:00-05:00", T0_S),
    ("2026-11-02T08:00:00.999999Z", T0_S),     # sub-second parts are floored
    ("2026-11-02T07:59:59.5Z", T0_S - 1),
    ("1970-01-01T00:00:00.5Z", 0),             # the first instant of the contract's range
    ("2099-12-31T23:59:59.9Z", 4102444799),    # its last second
])
def test_zoned_timestamps_and_epoch_seconds(ts, at_s):
    ev = parse_payload(wire("pool.tick", occurred_at=ts))
    assert ev.at_s == at_s
    assert epoch_s(ev.occurred_at) == at_s


# --- envelope and fields ---------------------------------------------------------------------------------

@pytest.mark.parametrize("etype", sorted(BODIES))
def test_extra_fields_are_rejected(etype):
    assert code_of(parse_payload(wire(etype, surprise=1))) == RC.schema_invalid
    assert code_of(parse_payload(wire(etype, priority_class="high") if etype != "job.submitted"
                                 else wire(etype, team_id="x"))) == RC.schema_invalid


@pytest.mark.parametrize("etype", sorted(BODIES))
@pytest.mark.parametrize("field", ["event_id", "occurred_at", "pool", "source"])
def test_missing_envelope_fields_are_schema_invalid(etype, field):
    assert code_of(parse_payload(without(wire(etype), field))) == RC.schema_invalid


@pytest.mark.parametrize("etype, field", [(t, f) for t, fs in sorted(REQUIRED.items()) for f in fs])
def test_missing_required_fields_are_schema_invalid(etype, field):
    assert code_of(parse_payload(without(wire(etype), field))) == RC.schema_invalid


@pytest.mark.parametrize("over", [
    {"event_id": ""}, {"event_id": "x" * 129}, {"event_id": 7}, {"pool": ""}, {"source": ""},
    {"pool": "p" * 257}, {"schema_version": 2}, {"schema_version": 0}, {"schema_version": "v1"},
])
def test_envelope_field_values(over):
    assert code_of(parse_payload(wire("pool.tick", **over))) == RC.schema_invalid


def test_envelope_limits_that_pass():
    assert parse_payload(wire("pool.tick", event_id="x" * 128)).event_id == "x" * 128
    assert parse_payload(wire("pool.tick", schema_version=1)).schema_version == 1


@pytest.mark.parametrize("etype, over", [
    ("pool.configured", {"chips_per_node": 0}),
    ("pool.configured", {"chips_per_node": 1.5}),
    ("pool.configured", {"chips_per_node": 4097}),
    ("chip.state_changed", {"state": "on-fire"}),
    ("chip.state_changed", {"reason": "r" * 1025}),
    ("job.finished", {"outcome": "timeout"}),
    ("job.submitted", {"priority": 1.5}),
    ("job.submitted", {"priority": 2**31}),
    ("job.submitted", {"chips_per_node": 0}),
    ("job.submitted", {"user": ""}),
    ("job.submitted", {"user": "u" * 257}),
    ("job.submitted", {"user": 1000}),
    ("job.started", {"chip_ids": []}),
    ("job.started", {"chip_ids": ["a", "b", "a"]}),
    ("job.started", {"chip_ids": "a"}),
    ("job.started", {"chip_ids": [""]}),
    ("job.checkpointed", {"job_id": ""}),
    ("job.checkpointed", {"units": -1}),
    ("job.progress", {"units": -1}),
    ("job.progress", {"units": 10**18 + 1}),
    ("job.progress", {"units": 2.5}),
    ("job.progress", {"units": "12"}),
    ("job.progress", {"unit": ""}),
    ("job.progress", {"unit": "u" * 65}),
    ("job.progress", {"unit": "st\x01ep"}),
])
def test_field_values_are_validated(etype, over):
    assert code_of(parse_payload(wire(etype, **over))) == RC.schema_invalid


def test_the_user_of_a_submission_is_optional():
    """`user` came later, optional (schema_version stays 1): a submission without it is as valid as before."""
    assert parse_payload(wire("job.submitted")).user == "alice"
    old = parse_payload(without(wire("job.submitted"), "user"))
    assert old.user is None and old.schema_version == 1
    assert "user" not in old.model_dump(exclude_none=True)


@pytest.mark.parametrize("state", ["healthy", "degraded", "down", "maintenance"])
def test_every_chip_state_parses(state):
    assert parse_payload(wire("chip.state_changed", state=state)).state == state


@pytest.mark.parametrize("outcome", ["succeeded", "failed", "cancelled"])
def test_every_outcome_parses(outcome):
    assert parse_payload(wire("job.finished", outcome=outcome)).outcome == outcome


def test_chip_ids_unique_and_ordered():
    ev = parse_payload(wire("job.started", chip_ids=["c2", "c1", "c3"]))
    assert ev.chip_ids == ["c2", "c1", "c3"]
    rej = parse_payload(wire("job.started", chip_ids=["c1", "c1"]))
    assert code_of(rej) == RC.schema_invalid and "repeat" in rej.detail


# --- windows ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("start, end, ok", [
    ("2026-11-02T09:00:00Z", "2026-11-02T09:00:01Z", True),
    ("2026-11-02T09:00:00Z", "2026-11-02T09:00:00Z", False),   # empty window
    ("2026-11-02T09:00:00Z", "2026-11-02T08:00:00Z", False),   # backwards
    ("2026-11-02T09:00:00Z", "2026-11-02T10:00:00+01:00", False),  # same instant in another zone
    ("2026-11-02T10:00:00+02:00", "2026-11-02T08:30:00Z", True),    # compared as instants
])
def test_window_ordering(start, end, ok):
    g = parse_payload(wire("quota.granted", effective_from=start, effective_until=end))
    b = parse_payload(wire("burst.requested", window_start=start, window_end=end))
    for result in (g, b):
        if ok:
            assert not isinstance(result, Rejection), result
        else:
            assert code_of(result) == RC.schema_invalid


def test_grant_window_may_be_open_on_either_side():
    only_from = parse_payload(without(wire("quota.granted"), "effective_until"))
    only_until = parse_payload(without(wire("quota.granted"), "effective_from"))
    assert only_from.effective_until is None and only_from.effective_from is not None
    assert only_until.effective_from is None and only_until.effective_until is not None
    # an until in the past of the event time is valid on the wire (the fold decides what it means)
    past = parse_payload(without(wire("quota.granted", effective_until="2026-11-01T00:00:00Z"), "effective_from"))
    assert not isinstance(past, Rejection)


# --- type, JSON ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [
    {**ENVELOPE, "type": "job.exploded", "job_id": "j"},
    {**ENVELOPE, "job_id": "j"},                         # missing type
    {**ENVELOPE, "type": None},
    {**ENVELOPE, "type": 3},
    {**ENVELOPE, "type": ["job.started"]},
    {**ENVELOPE, "type": "JOB.STARTED", "job_id": "j"},
    {**ENVELOPE, "type": "decision.preempt"},             # an output type is not an input
    {"type": "nope"},                                    # unknown_type outranks the missing envelope
    {},
])
def test_unknown_or_missing_type(d):
    assert code_of(parse_payload(d)) == RC.unknown_type
    assert code_of(parse_event(orjson.dumps(d))) == RC.unknown_type


@pytest.mark.parametrize("raw", [
    b"", b"{", b"not json", b"\xff\xfe", b"{'a': 1}", b'{"a": NaN}', "{", b"[1, 2]", b"1", b"null", b'"str"',
    b"true", b"[{}]", b"99999999999999999999999999",
])
def test_not_json_or_not_an_object(raw):
    assert code_of(parse_event(raw)) == RC.not_json


@pytest.mark.parametrize("obj", [[1], 1, None, "s", True, [ENVELOPE]])
def test_payload_not_an_object(obj):
    assert code_of(parse_payload(obj)) == RC.not_json


def test_parse_event_never_raises_on_wrong_input_types():
    for raw in (None, 12, object(), ["x"]):
        assert code_of(parse_event(raw)) == RC.not_json


def test_rejection_precedence_is_the_enum_order():
    # wrong_role, not_owner and clock_ahead: issue 31's contract
    order = [RC.bad_key, RC.bad_signature, RC.wrong_role, RC.not_owner, RC.too_large, RC.not_json, RC.too_deep, RC.unknown_type,
             RC.schema_invalid, RC.unknown_pool, RC.clock_ahead, RC.clock_jump, RC.too_late, RC.unknown_chip, RC.unknown_job, RC.unknown_grant,
             RC.illegal_transition, RC.progress_backwards, RC.over_limit, RC.duplicate_conflict]
    assert list(RC) == order
    assert [c.rank for c in order] == list(range(len(order)))
    assert min([RC.illegal_transition, RC.unknown_chip, RC.unknown_job], key=lambda c: c.rank) == RC.unknown_chip


def test_rejection_detail_is_short_and_names_the_field():
    rej = parse_payload(wire("job.submitted", chips=-1, priority="x", team="", job_id="", extra1=1, extra2=2))
    assert code_of(rej) == RC.schema_invalid
    assert len(rej.detail) <= 500
    assert rej.detail.startswith("job.submitted:")
    assert "chips" in rej.detail


# --- topics and keys -------------------------------------------------------------------------------------

@pytest.mark.parametrize("etype, topic", [
    ("pool.configured", TOPIC_QUOTA), ("pool.tick", TOPIC_QUOTA), ("quota.granted", TOPIC_QUOTA),
    ("quota.revoked", TOPIC_QUOTA), ("burst.requested", TOPIC_QUOTA),
    ("chip.registered", TOPIC_CHIPS), ("chip.state_changed", TOPIC_CHIPS), ("chip.retired", TOPIC_CHIPS),
    ("job.submitted", TOPIC_JOBS), ("job.started", TOPIC_JOBS), ("job.checkpointed", TOPIC_JOBS),
    ("job.progress", TOPIC_JOBS), ("job.preempted", TOPIC_JOBS), ("job.released", TOPIC_JOBS), ("job.finished", TOPIC_JOBS),
    ("job.waiting", TOPIC_JOBS), ("price.set", TOPIC_QUOTA), ("budget.set", TOPIC_QUOTA),
])
def test_topic_for(etype, topic):
    assert topic_for(etype) == topic
    assert topic in INPUT_TOPICS


def test_topic_for_covers_every_event_type_and_refuses_others():
    assert {topic_for(t) for t in EVENT_MODELS} == set(INPUT_TOPICS)
    for bad in ("decision.preempt", "nothing", ""):
        with pytest.raises(ValueError):
            topic_for(bad)


def test_key_for_is_the_pool_utf8():
    ev = parse_payload(wire("pool.tick", pool="europe-west4-b/tpu-v5e/é"))
    assert key_for(ev) == "europe-west4-b/tpu-v5e/é".encode("utf-8")
    # every event of a pool gets the same key, whatever its topic
    keys = {key_for(parse_payload(wire(t))) for t in EVENT_MODELS}
    assert keys == {ENVELOPE["pool"].encode()}


# --- JSON round trip -------------------------------------------------------------------------------------

ROUND_TRIP_VARIANTS = [wire(t) for t in sorted(BODIES)] + [
    wire("job.submitted", chips=1.001, priority=-(2**31)),
    wire("job.submitted", chips=0.125, occurred_at="2026-11-02T10:30:00.123456+02:00"),
    wire("quota.granted", chips=1_000_000, borrowing_limit=0.001, lending_limit=None),
    wire("burst.requested", chips=3, reason=None),
    wire("job.started", chip_ids=None),
    wire("chip.state_changed", reason="ünïcödé \"quoted\" \n newline"),
]


@pytest.mark.parametrize("d", ROUND_TRIP_VARIANTS, ids=lambda d: d["type"])
def test_json_round_trip(d):
    ev = parse_payload(d)
    assert not isinstance(ev, Rejection), ev
    text = ev.model_dump_json()
    again = parse_event(text)
    assert again == ev
    assert again.model_dump_json() == text  # and the canonical body is stable (fingerprints rely on it)
    assert getattr(again, "chips_milli", None) == getattr(ev, "chips_milli", None)
    assert again.at_s == ev.at_s
    # chips are numbers on the wire, not strings
    if "chips" in d:
        assert isinstance(orjson.loads(text)["chips"], (int, float))


# --- never raises, whatever the input ---------------------------------------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)


@st.composite
def _mutated_events(draw):
    d = wire(draw(st.sampled_from(sorted(BODIES))))
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(sorted(d) + ["extra", "chips", "occurred_at"]))
        if draw(st.booleans()):
            d[key] = draw(_json_values)
        else:
            d.pop(key, None)
    return d


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_mutated_events(), _json_values))
def test_parse_payload_never_raises(obj):
    result = parse_payload(obj)
    assert isinstance(result, Rejection) or type(result) in EVENT_MODELS.values()
    try:
        raw = json.dumps(obj).encode()
    except (TypeError, ValueError):
        return
    result = parse_event(raw)
    assert isinstance(result, Rejection) or type(result) in EVENT_MODELS.values()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_parse_event_never_raises_on_bytes(raw):
    result = parse_event(raw)
    assert isinstance(result, Rejection) or type(result) in EVENT_MODELS.values()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10**9), st.datetimes(min_value=datetime(1990, 1, 1), max_value=datetime(2099, 12, 31),
                                              timezones=st.sampled_from([timezone.utc, timezone(timedelta(hours=5, minutes=30)),
                                                                         timezone(timedelta(hours=-8))])))
def test_round_trip_any_chips_and_time(milli, when):
    d = wire("job.submitted", chips=Decimal(milli) / MILLI, occurred_at=when.isoformat())
    ev = parse_payload(d)
    assert not isinstance(ev, Rejection), ev
    assert ev.chips_milli == milli
    assert ev.at_s == int(when.timestamp() // 1)
    again = parse_event(ev.model_dump_json())
    assert again == ev and again.chips_milli == milli


# --- issue 31's contract: repeated keys, new fields, the role table --------------------------------------

def test_a_repeated_key_is_schema_invalid_whoever_wins():
    good = orjson.dumps(wire("job.finished"))
    assert not isinstance(parse_event(good), Rejection)
    for raw in (good[:-1] + b',"outcome":"succeeded"}',           # compact
                good[:-1] + b', "outcome" : "succeeded"}',        # spaced from its colon
                b'{"pool": "x/y", ' + good[1:]):                  # the first key repeated later
        rej = parse_event(raw)
        assert code_of(rej) == RC.schema_invalid and "more than once" in rej.detail, raw
    # a '":' inside a string value is not a key: still valid (the slow path reads it again and finds no repeat)
    tricky = orjson.dumps(wire("chip.state_changed", reason='said "x": y'))
    assert not isinstance(parse_event(tricky), Rejection)
    # json.dumps' spacing (", " and ": ") is no repeat either
    assert not isinstance(parse_event(json.dumps(wire("job.submitted"))), Rejection)


def test_new_optional_fields():
    p = parse_payload(wire("job.preempted"))
    assert p.cause == "requeued" and p.reason == "InCohortReclamation"
    assert parse_payload(without(wire("job.preempted"), "cause")).cause is None
    assert code_of(parse_payload(wire("job.preempted", cause="evicted"))) == RC.schema_invalid
    s = parse_payload(wire("job.submitted", expected_runtime_s=3600, namespace="team-a"))
    assert s.expected_runtime_s == 3600 and s.namespace == "team-a"
    for bad in (0, -1, 1.5, "3600", True):
        assert code_of(parse_payload(wire("job.submitted", expected_runtime_s=bad))) == RC.schema_invalid
    b = parse_payload(wire("burst.requested", requested_by="alice@example.com"))
    assert b.requested_by == "alice@example.com"


@pytest.mark.parametrize("etype, over", [
    ("price.set", {"per_chip_hour": -1}), ("price.set", {"per_chip_hour": 1.5}), ("price.set", {"unit": ""}),
    ("price.set", {"hours_of_week": [168]}), ("price.set", {"hours_of_week": [1, 1]}), ("price.set", {"hours_of_week": []}),
    ("price.set", {"effective_until": "2026-11-02T08:00:00Z"}),  # not after effective_from
    ("budget.set", {"period": "week"}), ("budget.set", {"amount": -5}),
    ("job.waiting", {"reason": ""}), ("job.waiting", {"reason": "a\tb"}),
])
def test_prices_budgets_and_waiting_reasons_are_checked(etype, over):
    assert code_of(parse_payload(wire(etype, **over))) == RC.schema_invalid


def test_role_table():
    from schemas.roles import Principal, check, pool_cluster
    assert pool_cluster("us-east1-a/h100-80gb") == "us-east1-a" and pool_cluster("solo") == "solo"
    admin = Principal("ops", frozenset({"admin"}), frozenset({"*"}))
    cluster = Principal("east", frozenset({"cluster"}), frozenset({"us-east1-a"}))
    adapter = Principal("slurm-east", frozenset({"cluster"}), frozenset({"us-east1-a"}), frozenset({"quota", "pools"}))
    portal = Principal("portal", frozenset({"portal"}), frozenset({"*"}))
    east, west = "us-east1-a/h100", "eu-west4/tpu"
    for t in ("pool.configured", "quota.granted", "quota.revoked", "price.set", "budget.set", "burst.requested",
              "pool.tick"):
        assert check(admin, t, west) is None
    for t in ("job.submitted", "chip.retired", "job.waiting"):
        assert check(admin, t, east).code == RC.wrong_role
        assert check(cluster, t, east) is None
        assert check(cluster, t, west).code == RC.not_owner
    for t in ("quota.granted", "pool.configured", "price.set", "budget.set", "burst.requested"):
        assert check(cluster, t, east).code == RC.wrong_role
        assert check(cluster, t, west).code == RC.wrong_role  # wrong_role first
    assert check(adapter, "quota.granted", east) is None and check(adapter, "pool.configured", east) is None
    assert check(adapter, "quota.granted", west).code == RC.not_owner
    assert check(adapter, "price.set", east).code == RC.wrong_role  # no --may prices
    assert check(portal, "burst.requested", east) is None
    assert check(portal, "job.submitted", east).code == RC.wrong_role
    with pytest.raises(ValueError):
        Principal("x", frozenset({"root"}), frozenset())


def test_json_schema_export_has_the_new_types_and_fields(tmp_path):
    from schemas.export import export_json_schemas
    written = {p.name for p in export_json_schemas(tmp_path)}
    assert {"job.waiting.schema.json", "price.set.schema.json", "budget.set.schema.json"} <= written
    preempted = json.loads((tmp_path / "job.preempted.schema.json").read_text())
    cause = preempted["properties"]["cause"]["anyOf"][0]
    assert cause["enum"] == ["preempted", "requeued", "failure"]
    submitted = json.loads((tmp_path / "job.submitted.schema.json").read_text())["properties"]
    assert submitted["expected_runtime_s"]["anyOf"][0]["minimum"] == 1 and "namespace" in submitted
    price = json.loads((tmp_path / "price.set.schema.json").read_text())
    assert set(price["required"]) >= {"price_id", "per_chip_hour", "unit"}
    assert price["additionalProperties"] is False
