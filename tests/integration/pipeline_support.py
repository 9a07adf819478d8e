"""What the pipeline tests share: a worker subprocess, pumping the sink, comparing a lake with the embedded run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """`chipledger worker` in a subprocess (its own process group, so kill -9 takes Faust's threads with it)."""

    #: the fixtures are dated around 2026-11 and 2026-12 (tests/hostile_records.py's T_GAP: 2026-12-06): judged
    #: against today's broker append times, those after today would be `clock_ahead` on Kafka while `chipledger run` on
    #: the same file applies them. So the pipeline tests' workers allow ten years of skew; the tests of clock_ahead
    #: itself (test_kafka_trust.py) pass clock_skew_s=None for the default (300 s).
    FIXTURE_SKEW_S = 10 * 365 * 86400

    def __init__(self, bootstrap: str, data_dir: Path, log: Path, *args: str, app_id: str = "it-worker",
                 clock_skew_s: int | None = FIXTURE_SKEW_S):
        self.cmd = [sys.executable, "-m", "chipledger.cli", "worker", "--bootstrap", bootstrap, "--data-dir",
                    str(data_dir), "--app-id", app_id, "--loglevel", "warning", *args]
        self.log = log
        self.proc = None
        self.env = {} if clock_skew_s is None else {"CHIPLEDGER_LEDGER_MAX_CLOCK_SKEW_S": str(clock_skew_s)}

    def start(self) -> "WorkerProcess":
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                     env={**os.environ, **self.env, "PYTHONUNBUFFERED": "1"})
        out.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill9()

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def pump(sink, done: Callable[[], bool], timeout_s: float, worker: WorkerProcess | None = None) -> None:
    """Run the sink until `done()` (checked after every poll), failing after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"sink did not reach the expected state in {timeout_s}s: {sink.stats.as_dict()}"
                                 + (f"\nworker log:\n{worker.tail()}" if worker else ""))
        if worker is not None and worker.proc is not None and not worker.alive():
            raise AssertionError(f"worker exited with {worker.proc.returncode}:\n{worker.tail()}")
        sink.poll_once(timeout_ms=200)


def lake_tables(lake: Path) -> dict[str, list]:
    """The rows of the lake's tables that both paths write, without the columns that name the input position
    (a file line vs a topic offset) or say when a dead letter was seen."""
    from analytics.lake import EVENT_FIELDS
    from analytics.views import connect

    con = connect(lake)
    q = {
        # (not accepted_from: who vouched for an event is the Kafka edge's, a plain file's run has none)
        "events": "SELECT event_id, type, pool, source, occurred_at, applied_at, lateness_s, body, "
                  + ", ".join(f'"{f}"' for f in EVENT_FIELDS if f != "accepted_from") + " FROM base_event_log",
        "journal": "SELECT pool, hour, account, team, amount_mchip_s FROM journal WHERE amount_mchip_s <> 0",
        "job_runs": "SELECT * FROM job_runs",
        "decisions": "SELECT decision_id, type, pool, \"at\", rule, message, body FROM decision_log",
        "deadletters": "SELECT error_code, detail, event_id, event_type, pool FROM deadletters",
        "waits": "SELECT * FROM wait_postings",
        "free_chips": "SELECT * FROM free_chips",
        "progress": "SELECT * FROM progress",
        "chip_states": "SELECT * FROM chip_state_changes",
        "grant_intervals": "SELECT * FROM grant_postings",
    }
    out = {}
    for name, sql in q.items():
        try:
            out[name] = Counter(tuple(tuple(v) if isinstance(v, list) else v for v in r)  # placements: lists
                                for r in con.execute(sql).fetchall())
        except Exception as exc:  # noqa: BLE001 - name the query that failed
            raise AssertionError(f"{name}: {exc}") from exc
    return out


def strip_prefix(tables: dict, prefix: str) -> dict:
    """The rows (Counters of `lake_tables`) whose values name a pool of `prefix`, with the prefix taken out of
    every string: one run's books in a broker several runs share, comparable with `chipledger run`'s."""
    out = {}
    for name, rows in tables.items():
        c = Counter()
        for row, n in rows.items():
            if any(isinstance(v, str) and prefix in v for v in row):
                c[tuple(v.replace(prefix, "") if isinstance(v, str) else v for v in row)] += n
        out[name] = c
    return out


def pipeline_positions(bootstrap: str, group: str, sink=None) -> str:
    """Where each partition stands when a pipeline test stalls: end offset, the workers' committed offset
    (group `group`) and the sink's next position, one line per partition that is behind (for the failure
    message: which stage stopped, and on which partition)."""
    from kafka import KafkaConsumer, TopicPartition

    from streams.topics import ALL_TOPICS

    lines = []
    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                      client_id="stall-report", bootstrap_timeout_ms=10_000)
    try:
        tps = [TopicPartition(t, p) for t in ALL_TOPICS for p in sorted(c.partitions_for_topic(t) or ())]
        ends = c.end_offsets(tps)
        for tp in tps:
            committed = c.committed(tp)
            sink_at = None
            if sink is not None and sink.consumer is not None and tp in sink.consumer.assignment():
                sink_at = sink.consumer.position(tp)
            behind = (committed is not None and committed < ends[tp]) or (sink_at is not None and sink_at < ends[tp])
            if behind or committed is None and ends[tp] and sink_at is None:
                lines.append(f"{tp.topic}[{tp.partition}]: end {ends[tp]}, group {group} committed {committed}, "
                             f"sink at {sink_at}")
    except Exception as exc:  # noqa: BLE001 - a report of a failure must not hide it
        lines.append(f"(positions not read: {type(exc).__name__}: {exc})")
    finally:
        c.close()
    return "\n".join(lines) or "every partition read to its end"
