"""What the live adapters (`slurm/`, `kube/`) share: the state file each keeps (JSON, replaced atomically, bound to
one cluster) and what every watcher and actuator holds around it (`ClusterState`), what every actuator does around
its scheduler's own act (`DecisionActuator`: once per decision, its own cluster's only), the events the mappings
make (`Event`, `make_event`), the sinks a watcher sends them to and what one of its flushes sent (`Sent`)."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

from chipledger.adapters.importers.base import iso


@dataclass(frozen=True, slots=True)
class Event:
    """One event to send: its instant, an order within the instant (frees before takes), and its wire fields."""

    at: int
    rank: int
    body: dict


def make_event(at: int, rank: int, type: str, pool: str, source: str, event_id: str, **fields) -> Event:
    """The event `event_id` of `type` at `at` (epoch seconds) in `pool` from `source`; fields that are None are
    left out of its body."""
    body = {"event_id": event_id, "type": type, "occurred_at": iso(at), "pool": pool, "source": source,
            **{k: v for k, v in fields.items() if v is not None}}
    return Event(at, rank, body)


def read_state(path: Path, cluster: str, version: int, error: type[Exception], *, unreadable: str,
               mismatch: Optional[str] = None) -> Optional[dict]:
    """The state file at `path`, or None when there is none yet. Raises `error` when it is unreadable (`unreadable`
    says what to do) or belongs to another cluster or version (`mismatch`, when given, says what to do and the
    message names the file's version too)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        st = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"state file {path} is unreadable ({e}); {unreadable}")
    if st.get("version") != version or st.get("cluster") != cluster:
        if mismatch is None:
            raise error(f"state file {path} belongs to cluster {st.get('cluster')!r}, not {cluster!r}")
        raise error(f"state file {path} belongs to cluster {st.get('cluster')!r} (version {st.get('version')}), "
                    f"not {cluster!r}: {mismatch}")
    return st


def save_state(path: Path, st: dict) -> None:
    """Writes the state file atomically (a temporary file beside it, then renamed over it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(st, separators=(",", ":"), sort_keys=True))
    os.replace(tmp, path)


class ClusterState:
    """What every watcher and actuator holds: its cluster, the state file it resumes from and the state `load` read
    from it, the clock it stamps with and where it logs."""

    def __init__(self, cluster: str, state_path: Path, load: Callable[[Path], dict], *,
                 clock: Callable[[], float] = time.time, log: Callable[[str], None] = lambda m: None):
        self.cluster = cluster
        self.state_path = Path(state_path)
        self.clock = clock
        self.log = log
        self.state = load(self.state_path)

    def save(self) -> None:
        """Writes the state to its file (atomically)."""
        save_state(self.state_path, self.state)


def load_applied(path: Path, cluster: str, version: int, error: type[Exception]) -> dict:
    """An actuator's state: the decisions applied (`applied`: id -> when, pool, victims), a new one when there is
    no file yet."""
    st = read_state(path, cluster, version, error,
                    unreadable="without it decisions already applied would be applied again: repair it or start "
                               "with a new one deliberately")
    return st if st is not None else {"version": version, "cluster": cluster, "applied": {}}


def record_applied(path: Path, st: dict, decision_id: str, pool: str, victims: list, at: int) -> None:
    """Records a decision as applied (with the victims acted on) and saves the state file."""
    st["applied"][decision_id] = {"at": at, "pool": pool, "victims": victims}
    save_state(path, st)


def skip_decision(decision: dict, cluster: str, applied: dict) -> str:
    """Why an actuator of `cluster` leaves this decision alone ("" when it is to be applied): not a preemption,
    a pool of another cluster, or applied before (its id in the state's `applied`)."""
    if decision.get("type") != "decision.preempt":
        return "not a decision.preempt"
    pool = str(decision.get("pool", ""))
    if not pool.startswith(f"{cluster}/"):
        return f"pool {pool} is not of cluster {cluster}"
    if str(decision.get("decision_id", "")) in applied:
        return "applied before"
    return ""


@dataclass
class Outcome:
    """What an actuator did with one decision."""

    decision_id: str
    pool: str
    applied: list = field(default_factory=list)  # (job_id, action)
    gone: list = field(default_factory=list)  # (job_id, why or state)
    skipped: str = ""  # why the whole decision was skipped: other cluster, done before, not a preemption


class DecisionActuator(ClusterState):
    """What every actuator does around its scheduler's own act on a victim (`_victim`, per adapter): a decision of
    another cluster, not a preemption, or applied before is skipped; its victims are acted on one by one; it is
    recorded as applied (with the victims acted on) in the state file only after all of them were handled, so a
    decision is applied once even when it is read again. `_begin` may check the decision first (raising the
    adapter's error)."""

    state_version = 1
    error: type[Exception] = RuntimeError

    def __init__(self, cluster: str, state_path: Path, ops, *, dry_run: bool = False,
                 log: Callable[[str], None] = lambda m: None, clock: Callable[[], float] = time.time, metrics=None):
        super().__init__(cluster, state_path, lambda path: load_applied(path, cluster, self.state_version, self.error),
                         clock=clock, log=log)
        self.prefix = f"{cluster}/"
        self.ops = ops
        self.dry_run = dry_run
        self.metrics = metrics

    def _begin(self, decision: dict, did: str) -> None:
        """Checks before any victim is touched (none by default)."""

    def _victim(self, decision: dict, did: str, victim: dict, out: Outcome) -> None:
        raise NotImplementedError

    def apply(self, decision: dict) -> Outcome:
        did = str(decision.get("decision_id", ""))
        pool = str(decision.get("pool", ""))
        out = Outcome(did, pool)
        out.skipped = skip_decision(decision, self.cluster, self.state["applied"])
        if out.skipped:
            return out
        self._begin(decision, did)
        for v in decision.get("victims") or ():
            self._victim(decision, did, v, out)
        if not self.dry_run:
            record_applied(self.state_path, self.state, did, pool, [j for j, _ in out.applied], int(self.clock()))
        if self.metrics:
            self.metrics.applied(out, int(self.clock()))
        return out

    def apply_all(self, decisions: Iterable[dict]) -> list[Outcome]:
        return [self.apply(d) for d in decisions]


@dataclass
class Sent:
    """What a watcher's flush (kube) or poll (slurm) sent: how many events (`sent`, the ticks too), how many of them
    behind the watermark sent before (`late`), the watermark reached, the count of each type."""

    sent: int = 0
    late: int = 0
    watermark: int = 0
    by_type: Counter = field(default_factory=Counter)


class JsonlSink:
    """Appends events to a JSONL file (flushed and fsynced at the end of each flush or poll)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def send(self, body: dict) -> None:
        self._f.write(json.dumps(body, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


class KafkaSink:
    """Sends through LedgerProducer (validated, keyed by pool, idempotent, acks=all; its configuration,
    including credentials, is the one every chipledger producer uses). A subclass names the error it raises
    when events are not acknowledged, and when they are sent again (`retry_at`)."""

    error: type[Exception] = RuntimeError
    retry_at = "flush"

    def __init__(self, producer):
        self.producer = producer
        self._futures: list = []

    def send(self, body: dict) -> None:
        self._futures.append(self.producer.send(body))

    def flush(self) -> None:
        self.producer.flush(120)
        failed = [f for f in self._futures if getattr(f, "failed", lambda: False)()]
        self._futures = []
        if failed:
            raise self.error(f"{len(failed)} event(s) not acknowledged by Kafka; they are sent again "
                             f"at the next {self.retry_at}")

    def close(self) -> None:
        self.producer.close()
