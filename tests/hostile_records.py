"""Hostile records: inputs a hostile or broken producer sends, each with the rejection it must get.

Shared by the core tests (schemas, fold), the `chipledger run` test and the Kafka tests (live and backlog), so
every path is held to the same list (issue 15, "No poison pill"; docs/events.md lists the limits and codes).

`HOSTILE` is the list: a name, the raw message value, the expected outcome (a `RejectionCode` value, `VALID`
for a record that must be applied, `DUPLICATE` for one that must be dropped as a duplicate without a dead
letter), and for Kafka the message key (`NO_KEY` for none). Records marked `kafka_only` are only hostile on
Kafka (their value is a valid event; the key is wrong): a file run applies them, so the file helpers leave
them out unless asked.

The records depend on where they stand in time, so they come with a small valid fleet around them:
`fleet_lines()` gives PREFIX (two pools set up, a few jobs, hours closed), then HOSTILE in list order, then
SUFFIX (valid events after the hostile ones, so a test sees the pool go on). `write_fleet(path)` writes it
as JSONL; `valid_only(lines)` is what a run of only the valid events reads.

Timeline: pool A (`hostile/h100`, 8 chips) starts at T0; `gap_tick_34d` moves its clock 34 days on (valid:
its hours are closed), and the records after it are judged against that clock (too late, too far ahead).
Pool B (`hostile/big`, 4 chips) carries the largest job the contract allows, running 115 days.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Optional, Union

import orjson

VALID = "valid"          # applied (a step with no rejection, not a duplicate)
DUPLICATE = "duplicate"  # dropped as a duplicate: counted, no dead letter
NO_KEY = b""             # `key` of a record sent without a key (Kafka only); b"" is never a pool's key

POOL_A = "hostile/h100"
POOL_B = "hostile/big"
SOURCE = "tests/hostile"
T0 = datetime(2026, 11, 2, tzinfo=timezone.utc)
GAP = timedelta(days=34)
T_GAP = T0 + GAP  # pool A's clock after gap_tick_34d
BIG_RUN = timedelta(days=115)


def ts(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def ev(etype: str, event_id: str, pool: str, at: Union[datetime, str], **fields) -> dict:
    return {"event_id": event_id, "type": etype, "occurred_at": at if isinstance(at, str) else ts(at),
            "pool": pool, "source": SOURCE, **fields}


def dumps(obj: dict) -> bytes:
    return orjson.dumps(obj)


@dataclass(frozen=True)
class Line:
    """One record of a test fleet: its raw value, the expected outcome, and (for Kafka) key and topic."""

    raw: bytes
    expect: str            # VALID, DUPLICATE or a RejectionCode value
    name: Optional[str] = None  # the hostile record's name; None for the fleet's own valid events
    key: Optional[bytes] = None  # Kafka message key; None: the pool of the event (NO_KEY: no key at all)
    topic: str = "chipledger.jobs"
    kafka_only: bool = False
    why: str = ""


def _topic(etype: object) -> str:
    from schemas.topics import topic_for

    try:
        return topic_for(etype) if isinstance(etype, str) else "chipledger.jobs"
    except ValueError:
        return "chipledger.jobs"


def _line(obj_or_raw: Union[dict, bytes], expect: str = VALID, name: Optional[str] = None, *,
          key: Optional[bytes] = None, topic: Optional[str] = None, kafka_only: bool = False, why: str = "") -> Line:
    if isinstance(obj_or_raw, dict):
        raw = dumps(obj_or_raw)
        etype = obj_or_raw.get("type")
        pool = obj_or_raw.get("pool")
    else:
        raw = obj_or_raw
        etype = pool = None
    assert b"\n" not in raw and b"\r" not in raw, name  # one record, one JSONL line
    if key is None and isinstance(pool, str):
        key = pool.encode("utf-8")
    return Line(raw, expect, name, key, topic or _topic(etype), kafka_only, why)


# --- the valid fleet around the hostile records ---------------------------------------------------------

def _prefix() -> list[Line]:
    m = timedelta(minutes=1)
    out = [
        _line(ev("pool.configured", "a-cfg", POOL_A, T0, flavor="h100-80gb", chips_per_node=4)),
        _line(ev("pool.configured", "b-cfg", POOL_B, T0, flavor="h100-80gb", chips_per_node=4)),
    ]
    for n in (1, 2):
        for c in range(4):
            out.append(_line(ev("chip.registered", f"a-reg-{n}-{c}", POOL_A, T0, chip_id=f"a-n{n}-c{c}",
                                node=f"a-n{n}")))
    for c in range(4):
        out.append(_line(ev("chip.registered", f"b-reg-{c}", POOL_B, T0, chip_id=f"b-n1-c{c}", node="b-n1")))
    out += [
        _line(ev("quota.granted", "a-g-a", POOL_A, T0, grant_id="g-a", team="team-a", chips=4)),
        _line(ev("quota.granted", "a-g-b", POOL_A, T0, grant_id="g-b", team="team-b", chips=4)),
        _line(ev("quota.granted", "b-g-c", POOL_B, T0, grant_id="g-c", team="team-c", chips=4)),
        _line(ev("job.submitted", "a-j1-sub", POOL_A, T0 + 10 * m, job_id="j1", team="team-a", chips=2)),
        _line(ev("job.started", "a-j1-start", POOL_A, T0 + 15 * m, job_id="j1", chip_ids=["a-n1-c0", "a-n1-c1"])),
        _line(ev("job.submitted", "a-j2-sub", POOL_A, T0 + 20 * m, job_id="j2", team="team-b", chips=4)),
        _line(ev("job.started", "a-j2-start", POOL_A, T0 + 30 * m, job_id="j2")),
        _line(ev("job.checkpointed", "a-j1-ckpt", POOL_A, T0 + 60 * m, job_id="j1")),
        _line(ev("job.finished", "a-j1-fin", POOL_A, T0 + 120 * m, job_id="j1", outcome="succeeded")),
        _line(ev("pool.tick", "a-tick-3h", POOL_A, T0 + 180 * m)),
        _line(ev("pool.tick", "b-tick-3h", POOL_B, T0 + 180 * m)),
    ]
    return out


def _suffix() -> list[Line]:
    h = timedelta(hours=1)
    return [
        _line(ev("job.finished", "a-j2-fin", POOL_A, T_GAP + h, job_id="j2", outcome="succeeded")),
        _line(ev("job.submitted", "a-j3-sub", POOL_A, T_GAP + h, job_id="j3", team="team-a", chips=1)),
        _line(ev("job.started", "a-j3-start", POOL_A, T_GAP + 2 * h, job_id="j3", chip_ids=["a-n2-c0"])),
        _line(ev("job.finished", "a-j3-fin", POOL_A, T_GAP + 3 * h, job_id="j3", outcome="failed")),
        _line(ev("pool.tick", "a-tick-end", POOL_A, T_GAP + 4 * h)),
        _line(ev("pool.tick", "b-tick-end", POOL_B, T0 + BIG_RUN + h)),
    ]


# --- the hostile records --------------------------------------------------------------------------------

def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _hostile() -> list[Line]:
    h = timedelta(hours=1)
    gap_tick = ev("pool.tick", "a-tick-gap", POOL_A, T_GAP)
    envelope = b'"event_id":"deep","occurred_at":"%s","pool":"%s","source":"%s"' % (
        ts(T_GAP).encode(), POOL_A.encode(), SOURCE.encode())
    return [
        _line(gap_tick, VALID, "gap_tick_34d",
              why="a pool.tick 34 days after the pool's previous event: valid, its 816 hours are closed"),
        _line(gap_tick, DUPLICATE, "duplicate_identical", why="the same bytes again: a duplicate, no dead letter"),
        _line({**gap_tick, "source": "tests/other"}, "duplicate_conflict", "duplicate_conflict",
              why="a known event id with a different body"),
        _line(ev("pool.tick", "a-late-2h", POOL_A, T_GAP - 2 * h), VALID, "late_within_window",
              why="2 hours late, inside the one-day dedup window: applied at the clock, lateness recorded"),
        _line(ev("chip.state_changed", "a-huge", POOL_A, T_GAP, chip_id="a-n1-c0", state="down",
                 reason="x" * 900_000), "too_large", "too_large_900kb",
              why="a 900 KB message: over [ledger] max_event_bytes"),
        _line(b'{"type":' + b'"' + b"y" * 5_000_000 + b'",' + envelope + b"}", "too_large", "huge_type_5mb",
              why="a 5 MB type string: over the size limit before anything is parsed"),
        _line(b'{"type":"' + b"z" * 400_000 + b'",' + envelope + b"}", "unknown_type", "huge_unknown_type",
              why="a 400 KB unknown type, under the size limit: unknown_type with a capped detail"),
        _line(b'{"type":' + _nested(990) + b"," + envelope + b"}", "too_deep", "deep_type_990",
              why="a type nested 990 deep (a RecursionError in parse_event before)"),
        _line(b'{"type":"pool.tick",' + envelope + b',"x":' + _nested(5000) + b"}", "too_deep", "deep_field_5000",
              why="an extra field nested 5000 deep: beyond the JSON parser's own depth limit"),
        _line(b'{"type":"pool.tick",' + envelope + b',"x":' + _nested(40) + b"}", "too_deep", "deep_field_40",
              why="an extra field nested 40 deep: deeper than any event can be"),
        _line(_nested(500), "not_json", "deep_top_level_array",
              why="a top-level array nested 500 deep: not one JSON object (checked before the depth)"),
        _line(ev("pool.tick", "a-year-9999", POOL_A, "9999-12-31T23:59:59Z"), "schema_invalid", "tick_year_9999",
              why="a pool.tick in year 9999: outside the contract's time range"),
        _line(ev("pool.tick", "a-2y-ahead", POOL_A, T_GAP + timedelta(days=2 * 365)), "clock_jump",
              "tick_2_years_ahead", why="further ahead of the pool clock than [ledger] max_clock_jump_s"),
        _line(ev("pool.tick", "a-too-late", POOL_A, T0 + 4 * h), "too_late", "too_late_tick",
              why="older than the dedup window: it cannot be told from a duplicate"),
        _line(ev("job.finished", "a-j2-fin-late", POOL_A, T0 + 5 * h, job_id="j2", outcome="succeeded"),
              "too_late", "too_late_job_finished", why="a job.finished 33 days late: a dead letter, not applied"),
        _line(ev("job.submitted", "b-billion", POOL_B, T0 + 4 * h, job_id="billion", team="team-c",
                 chips=1_000_000_000), "schema_invalid", "billion_chip_job",
              why="1e9 chips: over the contract's chip bound (chips x duration would overflow int64)"),
        _line(ev("job.submitted", "b-max-sub", POOL_B, T0 + 4 * h, job_id="max", team="team-c", chips=1_000_000),
              VALID, "max_chip_job_submitted", why="the largest job the contract allows"),
        _line(ev("job.started", "b-max-start", POOL_B, T0 + 4 * h, job_id="max"), VALID, "max_chip_job_started",
              why="it starts (overcommitted: the cluster is the authority)"),
        _line(ev("job.submitted", "b-one-sub", POOL_B, T0 + 5 * h, job_id="one", team="team-c", chips=1),
              "over_limit", "pool_total_over_limit",
              why="the chips of the pool's active jobs would pass the pool bound (1,000,000 chips)"),
        _line(ev("job.finished", "b-max-fin", POOL_B, T0 + 4 * h + BIG_RUN, job_id="max", outcome="succeeded"),
              VALID, "max_chip_job_115_days",
              why="1e6 chips for 115 days: 9.9e15 mchip-s in job_runs, well inside int64"),
        _line(ev("job.submitted", "a-nul", POOL_A, T_GAP, job_id="jn", team="team\x00a", chips=1),
              "schema_invalid", "nul_in_team", why="a NUL in a team id (it broke the PostgreSQL store)"),
        _line(ev("pool.tick", "a-esc-\x1b[31m", POOL_A, T_GAP), "schema_invalid", "control_in_event_id"),
        _line(ev("job.submitted", "a-del", POOL_A, T_GAP, job_id="j\x7fx", team="team-a", chips=1),
              "schema_invalid", "del_in_job_id"),
        _line(ev("chip.registered", "a-c1", POOL_A, T_GAP, chip_id="a-n3-c0", node="a-n3\x85"),
              "schema_invalid", "c1_control_in_node"),
        _line(ev("pool.tick", "p-nul", POOL_A + "\x00", T_GAP), "schema_invalid", "nul_in_pool"),
        _line(ev("chip.state_changed", "a-reason-nul", POOL_A, T_GAP, chip_id="a-n1-c0", state="down",
                 reason="fan\x00failed"), "schema_invalid", "nul_in_reason"),
        _line(b'{"type":"pool.tick","event_id":"\xff\xfe",' + envelope[len(b'"event_id":"deep",'):] + b"}",
              "not_json", "bad_utf8"),
        _line(b'{"type":"pool.tick",' + envelope + b',"x":NaN}', "not_json", "nan_literal"),
        _line(b'"just a string"', "not_json", "json_string"),
        _line(b"{}", "unknown_type", "empty_object"),
        _line(b'{"type":"job.submitted",' + envelope.replace(b'"deep"', b'"a-bigint"') +
              b',"job_id":"jb","team":"team-a","chips":123456789012345678901234567890}',
              "schema_invalid", "huge_integer_chips"),
        _line(ev("pool.tick", "a-key-none", POOL_A, T_GAP + h), "bad_key", "no_key", key=NO_KEY, kafka_only=True,
              why="a record without a key (Kafka only: in a file it is a valid event)"),
        _line(ev("pool.tick", "a-key-wrong", POOL_A, T_GAP + h), "bad_key", "wrong_key",
              key=POOL_B.encode(), kafka_only=True,
              why="a pool's event under another pool's key / partition (Kafka only)"),
    ]


HOSTILE: list[Line] = _hostile()
BY_NAME: dict[str, Line] = {ln.name: ln for ln in HOSTILE if ln.name}
PREFIX: list[Line] = _prefix()
SUFFIX: list[Line] = _suffix()


def fleet_lines(kafka: bool = False) -> list[Line]:
    """PREFIX, HOSTILE (without the Kafka-only records unless `kafka`), SUFFIX."""
    return PREFIX + [ln for ln in HOSTILE if kafka or not ln.kafka_only] + SUFFIX


def valid_only(lines: list[Line]) -> list[Line]:
    return [ln for ln in lines if ln.expect == VALID]


def write_lines(path: Union[str, Path], lines: list[Line]) -> Path:
    path = Path(path)
    path.write_bytes(b"".join(ln.raw + b"\n" for ln in lines))
    return path


def write_fleet(path: Union[str, Path], kafka: bool = False) -> list[Line]:
    """Write the fleet with its hostile records as JSONL (line n is lines[n-1]); returns the lines."""
    lines = fleet_lines(kafka)
    write_lines(path, lines)
    return lines
