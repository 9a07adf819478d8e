"""`chipledger slurm actuate`: apply the ledger's `decision.preempt` to the victims in Slurm, once per decision.

For each decision of a pool of this cluster (`<cluster>/<partition>`), for each victim job still running:
`scontrol update jobid=J AdminComment=chipledger-preempt:<decision id>`, then `scontrol requeue J` (default)
or `scancel J` (`action="cancel"`). The AdminComment is how the requeue comes back through `slurm watch` as
that decision's `job.preempted`: Slurm keeps it on the run's accounting record, so it survives restarts of
either program, and an admin sees it in `scontrol show job` / `sacct -o AdminComment`. A victim that is no
longer running (finished, already requeued, unknown to Slurm) is logged and skipped, not an error.

The state file (JSON, replaced atomically) lists the decision ids applied: a decision is applied once, even
if it is read again (the same decision from Kafka after a restart, or the whole lake read anew). A decision is
recorded only after all its victims were handled; if the controller fails in between, the next attempt finds
the victims already requeued (no longer running) and skips them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from chipledger.adapters import common
from chipledger.adapters.slurm import commands
from chipledger.adapters.slurm.mapping import PREEMPT_MARK

STATE_VERSION = 1
_RUNNING = frozenset(("RUNNING", "CONFIGURING", "SUSPENDED"))


class ActuateError(RuntimeError):
    pass


@dataclass
class Ops:
    """The Slurm commands the actuator runs (replaceable in unit tests)."""

    job_state: Callable[[str], Optional[str]] = commands.job_state
    mark: Callable[[str, str], None] = commands.mark
    requeue: Callable[[str], None] = commands.requeue
    cancel: Callable[[str], None] = commands.cancel


Outcome = common.Outcome


class Actuator(common.DecisionActuator):
    error = ActuateError
    state_version = STATE_VERSION

    def __init__(self, cluster: str, state_path: Path, *, action: str = "requeue", dry_run: bool = False,
                 ops: Optional[Ops] = None, log: Callable[[str], None] = lambda m: None,
                 clock: Callable[[], float] = time.time):
        if action not in ("requeue", "cancel"):
            raise ActuateError(f"action must be requeue or cancel, got {action!r}")
        self.action = action
        super().__init__(cluster, state_path, ops or Ops(), dry_run=dry_run, log=log, clock=clock)

    def _begin(self, decision: dict, did: str) -> None:
        if len(f"{PREEMPT_MARK}{did}") > 1000:
            raise ActuateError(f"decision id too long for an AdminComment: {did[:80]}…")

    def _victim(self, decision: dict, did: str, v: dict, out: Outcome) -> None:
        job = str(v.get("job_id", ""))
        state = self.ops.job_state(job)
        if state not in _RUNNING:
            out.gone.append((job, state))
            self.log(f"{did}: victim {job} is {'gone' if state is None else state.lower()}: nothing to do")
            return
        if self.dry_run:
            out.applied.append((job, f"would {self.action}"))
            self.log(f"{did}: would {self.action} {job} (dry run)")
            return
        self.ops.mark(job, f"{PREEMPT_MARK}{did}")
        try:
            (self.ops.requeue if self.action == "requeue" else self.ops.cancel)(job)
        except commands.SlurmError as e:
            if self.ops.job_state(job) not in _RUNNING:  # it ended in between: gone, not an error
                out.gone.append((job, None))
                self.log(f"{did}: victim {job} ended before the {self.action}: {e}")
                return
            raise
        out.applied.append((job, self.action))
        self.log(f"{did}: {self.action} {job} ({v.get('team')}, {v.get('chips')} GPUs) for "
                 f"{(decision.get('beneficiary') or {}).get('job_id')}")


def decisions_from_jsonl(path: Path) -> Iterator[dict]:
    """Decisions from a JSONL file (one decision object a line; other lines, e.g. events, are skipped)."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ActuateError(f"{path}:{n}: not JSON ({e})") from None
            if isinstance(d, dict) and str(d.get("type", "")).startswith("decision."):
                yield d


def decisions_from_lake(lake: Path) -> list[dict]:
    """The `decision.preempt` rows of a lake's `decisions` table (embedded runs), in decision order."""
    import duckdb

    from analytics.lake import LakeError, read_parquet_sql, table_files

    try:
        files = table_files(Path(lake), "decisions")  # the committed files (the lake's layout checked)
    except LakeError as e:
        raise ActuateError(str(e)) from None
    if files is None:
        return []
    con = duckdb.connect()
    rows = con.execute(f"SELECT body FROM ({read_parquet_sql(files)}) WHERE type = 'decision.preempt' "
                       f'ORDER BY "at", decision_id').fetchall()
    return [json.loads(b) for (b,) in rows]


def default_group(cluster: str, user: Optional[str] = None) -> str:
    """The actuator's consumer group: `<user>.slurm-actuate-<cluster>` when it authenticates (a reader owns the
    groups starting with `<user>.`: docs/security.md), else `chipledger-slurm-actuate-<cluster>`."""
    return f"{user}.slurm-actuate-{cluster}" if user else f"chipledger-slurm-actuate-{cluster}"


def decisions_from_kafka(bootstrap, cluster: str, *, timeout_s: float = 5.0, group: Optional[str] = None,
                         follow: bool = False, **overrides) -> Iterator[tuple[dict, Callable[[], None]]]:
    """(decision, commit) from `chipledger.decisions`, in a consumer group of this cluster's actuator; call
    commit after applying (the state file makes a re-read after a crash harmless anyway). `bootstrap`: an
    address, or a connection object with `kafka_python()` (address and credentials)."""
    from kafka import KafkaConsumer

    from schemas.topics import TOPIC_DECISIONS

    conn = bootstrap.kafka_python() if hasattr(bootstrap, "kafka_python") else {"bootstrap_servers": bootstrap}
    consumer = KafkaConsumer(TOPIC_DECISIONS, **conn,
                             group_id=group or default_group(cluster, getattr(bootstrap, "username", None)),
                             enable_auto_commit=False,
                             auto_offset_reset="earliest", consumer_timeout_ms=int(timeout_s * 1000), **overrides)
    try:
        while True:
            got = False
            for msg in consumer:
                got = True
                try:
                    d = json.loads(msg.value)
                except (ValueError, TypeError):
                    continue
                if isinstance(d, dict):
                    yield d, consumer.commit
            if not follow and not got:
                return
    finally:
        consumer.close()
