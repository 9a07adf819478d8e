"""No poison pill (issue 15), the core and contract half: every hostile record is a rejection value with its
code, never an exception, in the parser, the fold and `chipledger run`.

The records are tests/hostile_records.py (shared with the Kafka tests). Here: each record at the parser and
in the fold (table-driven, conservation checked after every event), the limits at their edges (clock jump,
dedup window, pool totals, int64), the quiet stretch closed at once, and the CLI: the file of hostile lines
through `chipledger run` exits normally, every hostile line is a dead letter with its code and raw bytes, and
the books of the valid events equal a run of only the valid lines; the same file sent twice adds nothing.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import hostile_records as H
from analytics.lake_rows import read_rows
from chipledger.embedded import _lines, run_file
from ledger import Fleet, FoldConfig, evolve
from ledger.books import HOUR_S, hour_of
from ledger.policy import BUDGET_HOURS, HOURS_OF_WEEK
from ledger.state import Chip
from schemas import Rejection, RejectionCode as RC, parse_event, parse_payload
from schemas.codes import MAX_DETAIL
from schemas.events import MAX_CHIPS, MAX_POOL_MILLI, MAX_TIME, MILLI, MIN_TIME, epoch_s
from schemas.parse import DEFAULT_MAX_EVENT_BYTES, MAX_DEPTH, too_deep

PARSE_CODES = {RC.too_large.value, RC.not_json.value, RC.too_deep.value, RC.unknown_type.value,
               RC.schema_invalid.value}
CFG = FoldConfig(check_invariants=True)
ROOT = Path(__file__).resolve().parent.parent
INT64_MAX = 2**63 - 1


def outcome(step) -> str:
    if step.rejection is not None:
        return step.rejection.code.value
    return H.DUPLICATE if step.duplicate else H.VALID


def fold_lines(lines, config=CFG) -> list[str]:
    """The outcome of each line folded in order, as the embedded run does (parse, then the fold)."""
    fleet = Fleet(config)
    out = []
    for ln in lines:
        ev = parse_event(ln.raw)
        out.append(ev.code.value if isinstance(ev, Rejection) else outcome(fleet.apply(ev, ln.raw)))
    return out


# --- the parser ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("line", [ln for ln in H.HOSTILE if ln.expect in PARSE_CODES], ids=lambda ln: ln.name)
def test_parser_gives_the_code(line):
    rej = parse_event(line.raw)
    assert isinstance(rej, Rejection) and rej.code.value == line.expect, rej
    assert len(rej.detail) <= MAX_DETAIL


@pytest.mark.parametrize("line", H.HOSTILE, ids=lambda ln: ln.name)
def test_parser_never_raises_even_deep_in_a_stack(line):
    """The worker parses deep inside Faust and aiokafka frames: the 990-deep type raised RecursionError there."""
    def at_depth(n):
        return at_depth(n - 1) if n else parse_event(line.raw)

    limit = sys.getrecursionlimit()
    result = at_depth(limit - 120)
    assert isinstance(result, Rejection) or result.type


def test_depth_is_looked_at_iteratively_and_stops_early():
    deep = []
    cur = deep
    for _ in range(100_000):  # far deeper than the interpreter's recursion limit
        nxt: list = []
        cur.append(nxt)
        cur = nxt
    assert too_deep(deep)
    assert not too_deep({"a": [1, {"b": [2]}]})
    assert too_deep([[]] * 3, limit=1) and not too_deep([[]] * 3, limit=2)
    nested = {"x": 1}
    for _ in range(MAX_DEPTH - 1):
        nested = {"x": nested}
    assert not too_deep(nested) and too_deep({"x": nested})


def test_size_limit_is_checked_before_parsing_and_configurable():
    small = H.BY_NAME["gap_tick_34d"].raw
    assert parse_event(small, max_bytes=len(small)).type == "pool.tick"
    rej = parse_event(small, max_bytes=len(small) - 1)
    assert rej.code == RC.too_large and f"{len(small):,} bytes" in rej.detail
    assert parse_event(small.decode(), max_bytes=len(small) - 1).code == RC.too_large  # str: counted in UTF-8 bytes
    assert parse_event(b"x" * (DEFAULT_MAX_EVENT_BYTES + 1)).code == RC.too_large
    assert parse_event(b"x" * DEFAULT_MAX_EVENT_BYTES).code == RC.not_json


def test_unknown_type_detail_never_repeats_the_value():
    for kind in ("z" * 5_000_000, ["a"] * 1000, {"k": "v" * 10_000}, 10**30, None):
        rej = parse_payload({"type": kind})
        assert rej.code == RC.unknown_type and len(rej.detail) <= MAX_DETAIL, rej.detail[:80]
    assert len(Rejection(RC.schema_invalid, "x" * 10_000).detail) == MAX_DETAIL  # whoever writes a detail


@pytest.mark.parametrize("field", ["event_id", "pool", "source"])
@pytest.mark.parametrize("char", ["\x00", "\x07", "\x1b", "\n", "\t", "\x7f", "\x85", "\x9f"])
def test_ids_reject_control_characters(field, char):
    d = {"event_id": "e1", "type": "job.submitted", "occurred_at": "2026-11-02T00:00:00Z", "pool": "p",
         "source": "s", "job_id": "j", "team": "t", "chips": 1}
    d[field] = f"a{char}b"
    rej = parse_payload(d)
    assert rej.code == RC.schema_invalid and "control characters" in rej.detail
    for name in ("job_id", "team", "user"):
        assert parse_payload({**d, field: "ok", name: f"x{char}"}).code == RC.schema_invalid
    assert parse_payload({**d, field: "ok/ü ラボ \"quoted\" 🚀"}).type == "job.submitted"  # not ASCII-only


def test_free_text_keeps_line_breaks_but_no_nul():
    d = {"event_id": "e1", "type": "chip.state_changed", "occurred_at": "2026-11-02T00:00:00Z", "pool": "p",
         "source": "s", "chip_id": "c", "state": "down"}
    assert parse_payload({**d, "reason": "fan failed\n\tat 03:00\r\n"}).reason.startswith("fan")
    for bad in ("a\x00", "a\x1b[31m", "a\x0b"):
        assert parse_payload({**d, "reason": bad}).code == RC.schema_invalid


def test_event_times_are_bounded():
    d = {"event_id": "e1", "type": "pool.tick", "pool": "p", "source": "s"}
    assert parse_payload({**d, "occurred_at": "1970-01-01T00:00:00Z"}).at_s == 0
    assert parse_payload({**d, "occurred_at": "2099-12-31T23:59:59Z"}).at_s == epoch_s(MAX_TIME) - 1
    for bad in ("1969-12-31T23:59:59Z", "2100-01-01T00:00:00Z", "9999-12-31T23:59:59Z",
                "1970-01-01T05:00:00+06:00"):
        rej = parse_payload({**d, "occurred_at": bad})
        assert rej.code == RC.schema_invalid and "before 2100-01-01" in rej.detail, bad
    # a grant or burst window may reach further: nothing is multiplied by it, the clock never gets there
    g = parse_payload({**d, "type": "quota.granted", "occurred_at": "2026-11-02T00:00:00Z", "grant_id": "g",
                       "team": "t", "chips": 1, "effective_until": "9999-12-31T00:00:00Z"})
    assert g.type == "quota.granted"


def test_bounds_keep_every_sum_inside_int64():
    """What the bounds guarantee (schemas/events.py): any rate is at most MAX_POOL_MILLI, a pool lives at most
    MAX_TIME - MIN_TIME seconds, and the largest sum the fold keeps is a team's used + pending demand."""
    life_s = epoch_s(MAX_TIME) - epoch_s(MIN_TIME)
    assert MAX_CHIPS * MILLI <= MAX_POOL_MILLI
    assert 2 * MAX_POOL_MILLI * life_s < INT64_MAX
    assert parse_payload({"event_id": "e", "type": "job.submitted", "occurred_at": "2026-11-02T00:00:00Z",
                          "pool": "p", "source": "s", "job_id": "j", "team": "t",
                          "chips": MAX_CHIPS + 0.001}).code == RC.schema_invalid


# --- the fold --------------------------------------------------------------------------------------------

def test_every_record_of_the_fleet_gets_its_outcome():
    lines = H.fleet_lines()
    got = fold_lines(lines)
    wrong = [(ln.name, ln.expect, g) for ln, g in zip(lines, got) if g != ln.expect]
    assert not wrong
    assert set(got) >= {H.VALID, H.DUPLICATE, "too_large", "not_json", "too_deep", "unknown_type",
                        "schema_invalid", "clock_jump", "too_late", "over_limit", "duplicate_conflict"}


def test_kafka_only_records_are_valid_events_in_a_file():
    kafka_only = [ln for ln in H.HOSTILE if ln.kafka_only]
    assert {ln.name for ln in kafka_only} == {"no_key", "wrong_key"}
    assert all(ln.expect == RC.bad_key.value and parse_event(ln.raw).type for ln in kafka_only)
    assert H.fleet_lines(kafka=True)[len(H.PREFIX):-len(H.SUFFIX)] == H.HOSTILE


def _tick(eid: str, at: int, pool: str = "p"):
    from datetime import datetime, timezone

    ts = datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return parse_payload({"event_id": eid, "type": "pool.tick", "occurred_at": ts, "pool": pool, "source": "s"})


def _configured(at: int, pool: str = "p"):
    e = _tick("cfg", at, pool).model_dump()
    return parse_payload({**e, "type": "pool.configured", "occurred_at": e["occurred_at"].isoformat(),
                          "flavor": "f", "chips_per_node": 4})


T = 1_793_577_600  # 2026-11-02T00:00:00Z


def test_clock_jump_at_its_edge():
    cfg = FoldConfig(check_invariants=True, max_clock_jump_s=7200)
    s, _ = evolve(None, _configured(T), cfg)
    s, step = evolve(s, _tick("over", T + 7201), cfg)
    assert step.rejection.code == RC.clock_jump and s.clock == T and "max_clock_jump_s" in step.rejection.detail
    assert step.journal == [] and s.rejected == 1
    s, step = evolve(s, _tick("edge", T + 7200), cfg)
    assert step.applied and s.clock == T + 7200
    assert FoldConfig().max_clock_jump_s == 400 * 86400
    with pytest.raises(ValueError):
        FoldConfig(max_clock_jump_s=0)


def test_too_late_at_the_edge_of_the_dedup_window():
    cfg = FoldConfig(check_invariants=True, dedup_window_s=3600)
    s, _ = evolve(None, _configured(T), cfg)
    s, _ = evolve(s, _tick("early", T + 60), cfg)
    s, _ = evolve(s, _tick("now", T + 3 * HOUR_S), cfg)  # the id `early` is forgotten by now
    s, step = evolve(s, _tick("edge", T + 2 * HOUR_S), cfg)
    assert step.applied and step.lateness_s == HOUR_S  # exactly the window: still told from a duplicate
    s, step = evolve(s, _tick("early", T + 60), cfg)  # the same bytes as a forgotten event: not applied again
    assert step.rejection.code == RC.too_late and "new event_id" in step.rejection.detail
    assert step.applied_at is None and not [k for k in s.dedup if k.endswith("\x1fearly")]  # (ids kept per origin)
    s, step = evolve(s, _tick("now", T + 3 * HOUR_S), cfg)  # a duplicate stays a duplicate, never too_late
    assert step.duplicate
    # re-injected on purpose (docs/events.md): a new event id and a time at or after the pool clock
    s, step = evolve(s, _tick("early:reinjected", s.clock), cfg)
    assert step.applied


def test_over_limit_pool_totals():
    s, _ = evolve(None, _configured(T), CFG)

    def grant(eid, gid, chips):
        return parse_payload({"event_id": eid, "type": "quota.granted", "occurred_at": "2026-11-02T00:00:00Z",
                              "pool": "p", "source": "s", "grant_id": gid, "team": "t", "chips": chips})

    s, step = evolve(s, grant("g1", "g1", MAX_CHIPS), CFG)
    assert step.applied
    s, step = evolve(s, grant("g2", "g2", 0.001), CFG)
    assert step.rejection.code == RC.over_limit
    s, step = evolve(s, grant("g1b", "g1", 1), CFG)  # a re-grant replaces its own amount
    assert step.applied
    # registered chips: a pool of MAX_POOL_CHIPS chips takes no more (the same chip object, to stay small)
    chip = Chip("n")
    s.chips = dict.fromkeys((f"c{i}" for i in range(MAX_POOL_MILLI // MILLI)), chip)
    reg = parse_payload({"event_id": "r", "type": "chip.registered", "occurred_at": "2026-11-02T00:00:00Z",
                         "pool": "p", "source": "s", "chip_id": "one-more", "node": "n"})
    s, step = evolve(s, reg, FoldConfig())
    assert step.rejection.code == RC.over_limit
    again = parse_payload({**reg.model_dump(mode="json"), "chip_id": "c0"})
    assert evolve(s, again, FoldConfig())[1].rejection.code == RC.illegal_transition  # precedence


def _empty_pool_jump(days: int, hourly: bool, policy_rows: bool = True, team_usage: int = 0):
    cfg = FoldConfig(check_invariants=True, policy_rows=policy_rows)
    s, _ = evolve(None, _configured(T), cfg)
    if team_usage:
        s.team("t").decayed_usage_mchip_s = team_usage
    end = T + days * 86400
    steps = []
    at = T
    while at < end:
        at = min(end, at + HOUR_S) if hourly else end
        s, step = evolve(s, _tick(f"t{at}", at), cfg)
        assert step.applied
        steps.append(step)
    return s, steps


@pytest.mark.parametrize("policy_rows, usage", [(True, 0), (False, 0), (False, 10**17), (False, 3)])
def test_a_quiet_stretch_is_closed_at_once_like_hour_by_hour(policy_rows, usage):
    """A pool where nothing accrues writes no rows: a 399-day jump closes its 9,576 hours at once, with the same
    state (decay, hour-of-week profile, error budget hours) as a tick every hour."""
    at_once, steps = _empty_pool_jump(399, hourly=False, policy_rows=policy_rows, team_usage=usage)
    hourly, _ = _empty_pool_jump(399, hourly=True, policy_rows=policy_rows, team_usage=usage)
    assert all(not getattr(st, t) for st in steps for t in ("journal", "balances", "pending"))
    assert at_once.books.open_hour == hour_of(T + 399 * 86400) == hourly.books.open_hour
    keys = ("profile", "budget_hours", "teams", "books", "clock")
    assert {k: at_once.to_dict()[k] for k in keys} == {k: hourly.to_dict()[k] for k in keys}
    assert sum(n for _, n in at_once.profile) == 399 * 24 and len(at_once.budget_hours) == BUDGET_HOURS
    assert len(at_once.profile) == HOURS_OF_WEEK


def test_a_quiet_stretch_stops_at_a_grant_boundary():
    s, _ = evolve(None, _configured(T), CFG)
    g = parse_payload({"event_id": "g", "type": "quota.granted", "occurred_at": "2026-11-02T00:00:00Z",
                       "pool": "p", "source": "s", "grant_id": "g", "team": "t", "chips": 2,
                       "effective_from": "2026-12-01T00:30:00Z"})
    s, _ = evolve(s, g, FoldConfig(check_invariants=True, policy_rows=False))
    s, step = evolve(s, _tick("far", T + 60 * 86400), FoldConfig(check_invariants=True, policy_rows=False))
    entitled = {r.hour: r.amount_mchip_s for r in step.journal if r.account == "entitled"}
    start = epoch_s(parse_payload(g.model_dump(mode="json")).effective_from)
    assert min(entitled) == hour_of(start) and entitled[hour_of(start)] == 2000 * 1800
    assert sum(entitled.values()) == 2000 * (T + 60 * 86400 - start)


# --- chipledger run --------------------------------------------------------------------------------------

def test_long_lines_are_read_in_bounded_pieces():
    data = b"ab\n" + b"x" * 10 + b"\r\n" + b"y" * 11 + b"\n" + b"z" * 25 + b"\r\n" + b"w" * 12
    got = list(_lines(io.BufferedReader(io.BytesIO(data), buffer_size=8), 10))
    assert [(ln, n) for ln, n, _ in got] == [(b"ab\n", 3), (b"x" * 10 + b"\r\n", 12), (b"y" * 10, 12),
                                            (b"z" * 10, 27), (b"w" * 10, 12)]
    assert [r and r.code for _, _, r in got] == [None, None, RC.too_large, RC.too_large, RC.too_large]
    assert "25 bytes" in got[3][2].detail and "11 bytes" in got[2][2].detail and "12 bytes" in got[4][2].detail


def _cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", "from chipledger.cli import main; main()", *args], cwd=cwd,
                          env=env, capture_output=True, timeout=300)


def books(lake: Path) -> dict:
    """The books of a lake, independent of line numbers: journal sums, job runs, decisions, balances, pending."""
    journal: Counter = Counter()
    for r in read_rows(lake, "journal"):
        journal[r[:4]] += r[4]
    out = {"journal": dict(journal)}
    for table in ("job_runs", "decisions", "balances", "pending"):
        out[table] = sorted(map(repr, read_rows(lake, table)))
    return out


def test_chipledger_run_on_hostile_lines(tmp_path):
    lines = H.write_fleet(tmp_path / "hostile.jsonl")
    H.write_lines(tmp_path / "valid.jsonl", H.valid_only(lines))
    res = _cli("run", "--events", "hostile.jsonl", "--lake", "lake", "--store", "sqlite:///h.db", "--json",
               cwd=tmp_path)
    assert res.returncode == 0 and b"Traceback" not in res.stderr, res.stderr.decode()[-2000:]
    summary = json.loads(res.stdout)
    expected = Counter(ln.expect for ln in lines)
    assert summary["accepted"] == expected[H.VALID] and summary["duplicates"] == expected[H.DUPLICATE]
    dead = {r[2]: r for r in read_rows(tmp_path / "lake", "deadletters")}
    for n, ln in enumerate(lines, start=1):
        if ln.expect in (H.VALID, H.DUPLICATE):
            assert n not in dead, (ln.name, dead[n][4:6])
            continue
        row = dead[n]
        assert row[4] == ln.expect, (ln.name, row[4], row[5])
        assert len(row[5]) <= MAX_DETAIL
        raw = base64.b64decode(row[9])
        if ln.expect == "too_large":  # the head is kept, the detail names the whole
            assert raw == ln.raw[:DEFAULT_MAX_EVENT_BYTES] and f"{len(ln.raw):,} bytes" in row[5]
        else:
            assert raw == ln.raw, ln.name
    assert summary["dead_letters"] == dict(Counter(r[4] for r in dead.values()))

    res = _cli("run", "--events", "valid.jsonl", "--lake", "lake-valid", "--store", "sqlite:///v.db", "--json",
               cwd=tmp_path)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert json.loads(res.stdout)["dead_letters"] == {}
    assert books(tmp_path / "lake") == books(tmp_path / "lake-valid")
    runs = [r for r in read_rows(tmp_path / "lake", "job_runs") if r[1] == "max"]
    assert sum(r[10] for r in runs) == MAX_CHIPS * MILLI * int(H.BIG_RUN.total_seconds())  # in the lake, int64


def test_max_event_bytes_is_configured_for_chipledger_run(tmp_path):
    line = H.BY_NAME["gap_tick_34d"].raw
    H.write_lines(tmp_path / "f.jsonl", H.PREFIX + [H.BY_NAME["gap_tick_34d"]])
    env_run = subprocess.run(
        [sys.executable, "-c", "from chipledger.cli import main; main()", "run", "--events", "f.jsonl", "--lake",
         "lake", "--store", "sqlite:///s.db", "--json"], cwd=tmp_path, capture_output=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CHIPLEDGER_LEDGER_MAX_EVENT_BYTES": str(max(1024, len(line)))})
    assert env_run.returncode == 0 and json.loads(env_run.stdout)["dead_letters"] == {}
    (tmp_path / "chipledger.toml").write_text("[ledger]\nmax_event_bytes = 100\n")
    res = _cli("run", "--events", "f.jsonl", "--lake", "lake2", "--store", "sqlite:///s.db", cwd=tmp_path)
    assert res.returncode != 0 and b"max_event_bytes must be between 1024" in res.stderr
    assert b"Traceback" not in res.stderr


def test_the_same_file_twice_adds_nothing(tmp_path):
    """Re-sending a whole file: the last day's events are duplicates, everything older is too_late; the books,
    the job runs and the jobs view are those of one copy (before: 13,089 jobs rows for 6,691 jobs)."""
    from chipledger.sim.scenario import generate, write_jsonl

    once = tmp_path / "once.jsonl"
    write_jsonl(generate(seed=3, days=3), once)
    twice = tmp_path / "twice.jsonl"
    twice.write_bytes(once.read_bytes() * 2)
    s1, _ = run_file(once, tmp_path / "lake1")
    s2, _ = run_file(twice, tmp_path / "lake2")
    assert s2.accepted == s1.accepted and s2.late == s1.late
    assert s2.dead_letters["too_late"] + s2.duplicates - s1.duplicates == s1.lines - s1.blank - s1.dead_letter_total
    assert set(s2.dead_letters) - set(s1.dead_letters) == {"too_late"}
    assert books(tmp_path / "lake1") == books(tmp_path / "lake2")
    from analytics.views import connect

    counts = []
    for lake in ("lake1", "lake2"):
        con = connect(tmp_path / lake)
        counts.append(con.execute("select count(*), count(distinct job_id) from jobs").fetchone())
    assert counts[0] == counts[1] and counts[0][0] == counts[0][1]
