"""/metrics (streams/metrics.py): its counters (kept by the core in the pool states) are the sums of the lake's
rows, its gauges the store's balances; names and labels follow Prometheus' conventions and pass `promtool check
metrics`; serve-metrics follows a lake that grows; the worker's collector reads the same states, and a restarted
worker continues its counters."""

from __future__ import annotations

import shutil
from collections import Counter, defaultdict
from pathlib import Path

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from analytics.lake_rows import read_rows
from analytics.slo_views import SloParams
from chipledger.cli import app
from chipledger.embedded import run_file
from chipledger.monitoring.server import LakeMetrics
from chipledger.sim.scenario import write_jsonl
from ledger import FoldConfig
from store import open_store
from streams.metrics import MetricsCollector, exposition, registry_of
from tests.monitoring_scenario import outage_events
from tests.prom_support import promtool

FIXTURE = Path(__file__).parent / "fixtures" / "hand.jsonl"
FOLD = FoldConfig(capacity_slo_target=SloParams().availability)


def samples(text: str) -> dict:
    """{(sample name, sorted labels): value} of an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def by(samp: dict, name: str, *labels: str) -> dict:
    out = {}
    for (n, lab), v in samp.items():
        if n == name:
            d = dict(lab)
            out[tuple(d.get(x, "") for x in labels)] = v
    return out


@pytest.fixture(scope="module")
def scenario_lake(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    events = root / "events.jsonl"
    write_jsonl(outage_events(days=3, outage_at_h=40), events)
    with events.open("ab") as f:
        f.write(b"not json\n")
    store = open_store(f"sqlite:///{root / 'store.db'}")
    run_file(events, root / "lake", fold_config=FOLD, store=store)
    return root / "lake", store


def test_counters_are_the_lake_sums_and_gauges_the_store_balances(scenario_lake):
    lake, store = scenario_lake
    lm = LakeMetrics(lake, FOLD)
    assert lm.poll() > 0 and lm.skipped == 0
    s = samples(exposition(registry_of(lm)).decode())
    # availability: registered and available chip-seconds = the journal's capacity and capacity - unavailable
    cap, unav = Counter(), Counter()
    for pool, hour, account, team, amount in read_rows(lake, "journal"):
        if account == "capacity":
            cap[pool] += amount
        elif account == "unavailable":
            unav[pool] += amount
    assert by(s, "chipledger_registered_chip_seconds_total", "pool") == {(p,): v / 1000 for p, v in cap.items()}
    assert by(s, "chipledger_available_chip_seconds_total", "pool") == {(p,): (v - unav[p]) / 1000
                                                                        for p, v in cap.items()}
    # goodput: allocated and allocated - lost of the runs that ended (the run's close postings are not yet ended)
    alloc, lost = Counter(), Counter()
    for r in read_rows(lake, "job_runs"):
        if r[8] is not None:
            alloc[(r[0], r[2])] += r[10]
            lost[(r[0], r[2])] += r[11]
    assert by(s, "chipledger_allocated_chip_seconds_total", "pool", "team") == {k: v / 1000 for k, v in alloc.items()}
    assert by(s, "chipledger_useful_chip_seconds_total", "pool", "team") == {
        k: (v - lost[k]) / 1000 for k, v in alloc.items()}
    assert sum(lost.values()) > 0
    # the wait SLOs: the core's waits facts that ended (FACTS.md)
    from analytics.lake import SCHEMAS

    w = {n: i for i, n in enumerate(SCHEMAS["waits"].names)}
    quota, honoured, started, within = Counter(), Counter(), Counter(), Counter()
    for r in read_rows(lake, "waits"):
        if r[w["end"]] == "open":
            continue
        key = (r[w["pool"]], r[w["team"]])
        ok = r[w["end"]] == "started" and r[w["ended_at"]] - r[w["began_at"]] <= 600
        if r[w["in_quota"]]:
            quota[key] += 1
            honoured[key] += ok
        if r[w["end"]] == "started":
            started[key] += 1
            within[key] += ok
    keys = set(quota) | set(started)
    assert sum(quota.values()) > 0 and sum(within.values()) < sum(started.values())
    for name, want in (("chipledger_in_quota_waits_total", quota), ("chipledger_in_quota_waits_honoured_total", honoured),
                       ("chipledger_started_waits_total", started),
                       ("chipledger_started_waits_within_slo_total", within)):
        assert by(s, name, "pool", "team") == {k: want[k] for k in keys}, name
    free = [r for r in read_rows(lake, "free_chips")]
    assert free
    last = max(free, key=lambda r: r[1])
    assert by(s, "chipledger_pool_free_chips", "pool") == {(last[0],): last[6] / 1000}
    events = Counter((r[2],) for r in read_rows(lake, "events"))
    assert by(s, "chipledger_events_applied_total", "pool") == dict(events)
    dead = Counter((r[4],) for r in read_rows(lake, "deadletters"))
    assert by(s, "chipledger_dead_letters_total", "code") == dict(dead) and dead[("not_json",)] == 1
    dec = Counter()
    for r in read_rows(lake, "decisions"):
        dec[(r[2], r[1].removeprefix("decision."), r[4])] += 1
    got = Counter()
    for (pool, typ, rule, _verdict), v in by(s, "chipledger_decisions_total", "pool", "type", "rule", "verdict").items():
        got[(pool, typ, rule)] += v
    assert got == dec and dec
    # gauges: the balances the store holds after the run
    teams = {(t.pool, t.team): t for t in store.team_balances()}
    for name, attr, scale in (("team_nominal_chips", "nominal_milli", 1000), ("team_used_chips", "used_milli", 1000),
                              ("team_in_quota_chips", "in_quota_milli", 1000),
                              ("team_borrowed_chips", "borrowed_milli", 1000),
                              ("team_burst_chips", "burst_milli", 1000), ("team_running_jobs", "running_jobs", 1),
                              ("team_pending_jobs", "pending_jobs", 1),
                              ("team_fair_share_factor", "fair_share_factor", 1),
                              ("team_borrowed_share", "borrowed_share", 1)):
        assert by(s, f"chipledger_{name}", "pool", "team") == {k: getattr(t, attr) / scale for k, t in teams.items()}, name
    pools = {p.pool: p for p in store.pool_balances()}
    assert by(s, "chipledger_pool_registered_chips", "pool") == {(p,): b.capacity_milli / 1000 for p, b in pools.items()}
    assert by(s, "chipledger_pool_down_chips", "pool") == {(p,): b.unavailable_milli / 1000 for p, b in pools.items()}
    assert by(s, "chipledger_pool_idle_chips", "pool") == {(p,): b.idle_milli / 1000 for p, b in pools.items()}
    assert by(s, "chipledger_pool_clock_timestamp_seconds", "pool") == {
        (p,): b.clock.timestamp() for p, b in pools.items()}
    # pending chips by reason: the lake's pending rows at the close of the books (a close at an hour's end writes
    # the rows of that instant twice: once as the hour closes, once as the books close)
    pend = defaultdict(int)
    rows = set(read_rows(lake, "pending"))
    last = max(r[3] for r in rows)
    for r in rows:
        if r[3] == last:
            pend[(r[0], r[2], r[7])] += r[4]
    assert by(s, "chipledger_team_pending_chips", "pool", "team", "reason") == {k: v / 1000 for k, v in pend.items()}
    late = Counter((r[0], r[2]) for r in rows if r[3] == last and r[3] - r[6] > 600)
    assert by(s, "chipledger_team_pending_jobs_over_slo", "pool", "team") == {k: late[k] for k in teams}
    assert sum(late.values()) > 0


def test_names_follow_prometheus_conventions_and_promtool_check_metrics_passes(scenario_lake):
    lake, _ = scenario_lake
    lm = LakeMetrics(lake, FOLD)
    lm.poll()
    text = exposition(registry_of(lm)).decode()
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("process_"):
            continue
        assert fam.name.startswith("chipledger_"), fam.name
        for smp in fam.samples:
            assert not {"job_id", "job", "chip_id", "node"} & set(smp.labels), smp
            if fam.type == "counter":
                assert smp.name.endswith(("_total", "_created")), smp.name
        assert "milli" not in fam.name, fam.name  # base units: chips, seconds
    res = promtool("check", "metrics", stdin=text.encode())
    assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()
    assert res.stdout.strip() == b"" and res.stderr.strip() == b"", res.stdout + res.stderr  # no lint finding


def test_serve_metrics_follows_files_added_to_the_lake_and_refolds_when_one_changes(scenario_lake, tmp_path):
    """serve-metrics folds on the files each commit adds (a sink's batch, a day rolling over); a file only dropped into
    the lake is not folded."""
    from lake_support import commit_written

    lake, _ = scenario_lake
    grown = tmp_path / "lake"
    days = sorted(p.name for p in (lake / "events").iterdir())
    assert len(days) >= 3

    def copy_day(day):
        for table in ("events", "deadletters"):
            src = lake / table / day
            if src.exists():
                shutil.copytree(src, grown / table / day)
        commit_written(grown)

    copy_day(days[0])
    lm = LakeMetrics(grown, FOLD)
    n1 = lm.poll()
    s1 = samples(exposition(registry_of(lm, process=False)).decode())
    assert lm.poll() == 0  # nothing added
    shutil.copytree(lake / "events" / days[1], grown / "events" / days[1])
    assert lm.poll() == 0  # nothing committed
    shutil.rmtree(grown / "events" / days[1])
    for d in days[1:]:
        copy_day(d)
    n2 = lm.poll()
    s2 = samples(exposition(registry_of(lm, process=False)).decode())
    whole = LakeMetrics(lake, FOLD)
    assert n1 + n2 == whole.poll()
    assert {k: v for k, v in s2.items() if "fold" not in k[0]} == {
        k: v for k, v in samples(exposition(registry_of(whole, process=False)).decode()).items() if "fold" not in k[0]}
    reg = "chipledger_registered_chip_seconds_total"
    assert all(s2[k] > v for k, v in s1.items() if k[0] == reg)
    # a file rewritten: everything is folded again (and gives the same)
    first = sorted((grown / "events").rglob("*.parquet"))[0]
    first.write_bytes(first.read_bytes())
    import os
    os.utime(first, ns=(1, 1))
    assert lm.poll() == n1 + n2


def test_the_worker_reads_the_same_counters_and_gauges(tmp_path):
    from tests.test_worker import Harness, _valid_lines

    h = Harness()
    h.worker.metrics = MetricsCollector(h.worker.pools, h.worker.settings.fold_config)
    lines = _valid_lines()
    for ev in h.feed(lines):
        h.worker.receive(ev)
    assert h.drain() > 0
    worker = samples(exposition(registry_of(h.worker.metrics, process=False)).decode())
    run_file(FIXTURE, tmp_path / "lake")
    lm = LakeMetrics(tmp_path / "lake", FoldConfig())
    lm.poll()
    lake = samples(exposition(registry_of(lm, process=False)).decode())

    def core(s):  # what both fold the same way
        return {k: v for k, v in s.items() if not k[0].startswith(("chipledger_fold_", "chipledger_dead_",
                                                                    "chipledger_pool_last_fold",
                                                                    "chipledger_metrics_loading"))}

    assert core(worker) == core(lake)
    # the fold time: one observation per record folded, made once per drain
    fold = by(worker, "chipledger_fold_duration_seconds_count")
    assert fold[()] == h.worker.counts["applied"] + h.worker.counts["dead_letters"] + h.worker.counts["duplicates"]
    assert by(worker, "chipledger_fold_duration_seconds_sum")[()] > 0
    # dead letters: the fixture's semantic rejections (counted by the pool state) and those of a pool never
    # configured (counted by the worker): the lake's deadletters rows but for the lines not valid (not fed here)
    dead = Counter((r[4],) for r in read_rows(tmp_path / "lake", "deadletters"))
    invalid = {("not_json",): 1, ("schema_invalid",): 1, ("unknown_type",): 1}
    assert {k: n for k, n in invalid.items() if dead[k] == n} == invalid
    got = by(worker, "chipledger_dead_letters_total", "code")
    assert got == {k: n for k, n in dead.items() if k not in invalid} and got[("unknown_pool",)] >= 1
    assert set(by(worker, "chipledger_pool_last_fold_timestamp_seconds", "pool")) == {("lab/a100",)}
    # bytes that are not JSON: counted by the worker (no pool state sees them)
    # the log's next record (an offset further on would be a hole the worker reads directly first)
    h.worker.receive(h.log_record(len(lines), "chipledger.jobs", 0, 10_000, b"lab/a100", b"{not json"))
    assert h.drain() == 1
    again = samples(exposition(registry_of(h.worker.metrics, process=False)).decode())
    assert by(again, "chipledger_dead_letters_total", "code") == {**got, ("not_json",): 1}
    assert by(again, "chipledger_fold_duration_seconds_count")[()] == fold[()] + 1


def _counters(s: dict) -> dict:
    """The counters of an exposition, as tests/metrics_oracle.py gives them."""
    from tests.metrics_oracle import rows_counters  # noqa: F401 - the shape: {name: {label values: value}}
    from tests.test_counters import _LABELS

    return {name: by(s, name, *labels) for name, labels in _LABELS.items()}


def test_a_restarted_worker_continues_its_counters_and_they_equal_the_embedded_runs_lake(tmp_path):
    """Half of a seeded scenario (with preemptions, bursts and rejected events) through one worker; a restart from
    its table (a new process: a new collector) and the whole scenario again (the first half is skipped by the
    state's positions): /metrics continues the counters, and they are what the embedded run of the same events
    wrote to its lake (the counters added up from the lake's rows, tests/metrics_oracle.py)."""
    import json

    from tests.metrics_oracle import lake_counters
    from tests.test_worker import Harness

    events = outage_events(days=2, outage_at_h=20)
    fin = next(e for e in events if e["type"] == "job.finished")
    events.insert(events.index(fin) + 1, {**fin, "event_id": "never-submitted", "job_id": "nobody"})
    lines = [json.dumps(e).encode() for e in events]
    half = len(lines) // 2

    first = Harness()
    first.worker.metrics = MetricsCollector(first.worker.pools, first.worker.settings.fold_config)
    for ev in first.feed(lines)[:half]:
        first.worker.receive(ev)
    first.drain()
    before = _counters(samples(exposition(registry_of(first.worker.metrics, process=False)).decode()))

    again = Harness(table=dict(first.table))  # the restart: the table as the first worker's checkpoint left it
    again.worker.metrics = MetricsCollector(again.worker.pools, again.worker.settings.fold_config)
    for ev in again.feed(lines):
        again.worker.receive(ev)
    again.drain()
    assert again.worker.counts["skipped"] == half
    after = _counters(samples(exposition(registry_of(again.worker.metrics, process=False)).decode()))
    for name, values in before.items():  # nothing went back to zero
        for k, v in values.items():
            assert after[name][k] >= v, (name, k)
    assert after["chipledger_events_applied_total"] != before["chipledger_events_applied_total"]

    src = tmp_path / "events.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    run_file(src, tmp_path / "lake", fold_config=again.worker.settings.fold_config)
    want = lake_counters(tmp_path / "lake")
    assert want["chipledger_decisions_total"] and sum(want["chipledger_lost_chip_seconds_total"].values()) > 0
    assert want["chipledger_dead_letters_total"] == {("unknown_job",): 1}
    for name, values in after.items():
        assert values == pytest.approx(want.get(name, {})), name


def test_serve_metrics_and_alerts_say_clearly_what_is_wrong(tmp_path):
    r = CliRunner().invoke(app, ["serve-metrics", "--lake", str(tmp_path / "missing")])
    assert r.exit_code == 1 and "does not exist" in r.output and "Traceback" not in r.output
    run_file(FIXTURE, tmp_path / "lake")
    port = __import__("tests.prom_support", fromlist=["free_port"]).free_port()  # nothing listens there
    r = CliRunner().invoke(app, ["alerts", "--lake", str(tmp_path / "lake"), "--at", "2026-11-02T03:00:00Z",
                                 "--alertmanager", f"http://127.0.0.1:{port}"])
    assert "Traceback" not in r.output
    if "cannot reach Alertmanager" not in r.output:  # nothing fired: nothing to send
        assert r.exit_code in (0, 1, 2) and "sent" not in r.output
    else:
        assert r.exit_code == 3
    r = CliRunner().invoke(app, ["alerts", "--lake", str(tmp_path / "lake"), "--alertmanager", "ftp://x"])
    assert "Traceback" not in r.output


def test_alertmanager_payload_has_the_labels_of_the_prometheus_rules():
    from datetime import datetime, timezone

    from chipledger.monitoring.alertmanager import AlertmanagerError, payload, send
    from chipledger.monitoring.alerts import Alert

    a = Alert("page", "page_1h", "availability", "lab/a100", None, 14.4, "1h", 30.0, "5m", 40.0, 0.99,
              datetime(2026, 11, 2, 3, tzinfo=timezone.utc))
    (item,) = payload([a])
    assert item["labels"] == {"alertname": "ChipledgerErrorBudgetBurn", "severity": "page", "slo": "availability",
                              "pool": "lab/a100", "alert": "page_1h", "long_window": "1h", "short_window": "5m"}
    assert item["startsAt"] == "2026-11-02T03:00:00Z"
    assert "lab/a100" in item["annotations"]["summary"] and "chipledger report --pool lab/a100" in item["annotations"]["look_at"]
    with pytest.raises(AlertmanagerError, match="not an http"):
        send("ftp://x", [a])
    assert send("http://127.0.0.1:1", []) == 0  # nothing to send: no request


def test_wait_and_free_chip_facts_make_the_wait_slo_counters_and_the_fragmentation_gauges():
    """The waits of tests/test_counters.py, folded: what /metrics shows of them, and the free chips of the pool's
    latest free_chips fact."""
    from ledger import Fleet
    from tests.test_counters import _waits_scenario
    from tests.test_evolve import POOL as pool, T0, chip_state, tick

    fleet = Fleet(FoldConfig(sched_slo_s=600))
    col = MetricsCollector(fleet.pools, fleet.config)
    free = []
    for e in [*_waits_scenario(), chip_state("c8", "down", at=710)]:
        step = fleet.apply(e)
        assert step.applied
        free += step.free_chips
    s = samples(exposition(registry_of(col, process=False)).decode())
    assert by(s, "chipledger_in_quota_waits_total", "pool", "team") == {(pool, "a"): 3, (pool, "b"): 0}
    assert by(s, "chipledger_in_quota_waits_honoured_total", "pool", "team") == {(pool, "a"): 1, (pool, "b"): 0}
    assert by(s, "chipledger_started_waits_total", "pool", "team") == {(pool, "a"): 2, (pool, "b"): 1}
    assert by(s, "chipledger_started_waits_within_slo_total", "pool", "team") == {(pool, "a"): 1, (pool, "b"): 1}
    # the latest free_chips row posted (the one of second 710 is posted by the next event of a later second)
    last = free[-1]
    assert last.at < T0 + 710 and by(s, "chipledger_pool_free_chips", "pool") == {(pool,): last.free_milli / 1000}
    assert "chipledger_pool_free_whole_node_chips" not in {k[0] for k in s}  # runs without a placement: not known
    fleet.apply(tick(720))
    s = samples(exposition(registry_of(col, process=False)).decode())
    assert by(s, "chipledger_pool_free_chips", "pool") == {(pool,): 4.0}  # 8 - 1 down - 3 running


def test_a_scrape_changes_nothing_the_fold_does():
    import json

    from ledger import Fleet
    from schemas import parse_event

    events = [parse_event(json.dumps(e).encode()) for e in outage_events(days=1, outage_at_h=10, outage_hours=2)]

    def fold(scrape_every):
        fleet = Fleet(FOLD)
        reg = registry_of(MetricsCollector(fleet.pools, FOLD), process=False)
        rows = []
        for i, e in enumerate(events):
            step = fleet.apply(e)
            rows.append(list(step_rows(e, step, "t", 0, i)) if step.applied else step.rejection)
            if scrape_every and i % scrape_every == 0:
                exposition(reg)
        return rows, orjson.dumps(fleet.to_dict())

    from streams.rows import step_rows

    assert fold(0) == fold(7)


def test_serve_metrics_retries_a_file_caught_mid_write_without_counting_twice(scenario_lake, tmp_path):
    from lake_support import commit_written

    lake, _ = scenario_lake
    grown = tmp_path / "lake"
    shutil.copytree(lake / "events", grown / "events")
    commit_written(grown)
    whole = LakeMetrics(lake, FOLD)
    n = whole.poll()
    last = sorted((grown / "events").rglob("*.parquet"))[-1]
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])  # a writer halfway through
    lm = LakeMetrics(grown, FOLD)
    with pytest.raises(Exception):
        lm.poll()
    last.write_bytes(data)
    assert lm.poll() == n
    reg = "chipledger_registered_chip_seconds_total"
    assert by(samples(exposition(registry_of(lm, process=False)).decode()), reg, "pool") == by(
        samples(exposition(registry_of(whole, process=False)).decode()), reg, "pool")


def test_progress_facts_make_the_throughput_slo_counters():
    """The hand-computed log of tests/test_throughput.py, folded; the collector reads the pool's counters:
    judged chip-seconds are the total, those not slow the good (the same numbers as the throughput error budget)."""
    from ledger import Fleet
    from tests.test_throughput import CFG, SCENARIO, pool as hand_pool

    fleet = Fleet(CFG)
    col = MetricsCollector(fleet.pools, CFG)
    for e in [*hand_pool(), *(e for e, _ in SCENARIO)]:
        fleet.apply(e)
    s = samples(exposition(registry_of(col, process=False)).decode())
    pool = "us-east1-a/h100"
    assert by(s, "chipledger_progress_judged_chip_seconds_total", "pool", "team") == {(pool, "a"): 2150.0}
    assert by(s, "chipledger_progress_at_rate_chip_seconds_total", "pool", "team") == {(pool, "a"): 1350.0}
