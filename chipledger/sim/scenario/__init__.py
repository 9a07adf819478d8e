"""Seeded, streaming generator of a realistic accelerator-fleet scenario, as wire-format event dicts.

This package owns synthetic input: a fleet of pools (one chip flavor each), the chips in them, quota grants,
burst requests and a job workload that a cluster scheduler places on the chips, all written as the event
dicts of DESIGN §3. It is stdlib only, so it can feed tests, benchmarks and demos without the project's
dependencies, and so that it stays an *independent* model of a cluster: nothing here imports the ledger.

A discrete-event simulation over one heap of future events (engine.py), in parts a reader can take one at a
time, each with its rules in its docstring:

- fleet.py: the pools, their nodes and chips, and where a job's chips can be placed;
- demand.py: the teams' demand: quotas and their changes, burst requests, arrivals, sweeps, cancellations;
- scheduler.py: the scheduler's actions: the queue, the scheduling passes, runs, checkpoints and progress
  reports, preemption and reclaim, and acting on the ledger's decisions (``follow``);
- faults.py: chips failing, degrading, in maintenance, retired, and what that does to the jobs on them;
- hostile.py: deliberately bad lines interleaved with a scenario (:func:`corrupt`);
- wire.py: the wire text (times, chips, compact JSON lines).

Realised utilisation is ~65-75% of capacity (the offered load ~90%, less fragmentation, cancellations and
failures): queues form at weekday peaks and drain at night.

- With ``follow`` (a callable given each event as it is emitted, returning the ledger's decisions as dicts:
  what a cluster's actuator receives from ``chipledger.decisions``), the cluster acts on the ledger instead of
  deciding itself. The package still imports nothing of the ledger: the caller folds (chipledger.demo does).
- With ``progress``, the training jobs (placed, checkpointing) report their cumulative steps, slowed by
  degraded chips, so the ledger's throughput SLO finds the slow chips; the rest of the scenario is the same
  with or without it.

``scale`` multiplies the job arrival rates *and* the pool sizes together (chips, failure and maintenance
processes follow the chip count), so a scaled scenario has the same utilisation and job shapes, just more
of everything. Scaling arrivals without capacity would only grow the queues until impatient users cancel.

Public API: :func:`generate`, :func:`write_jsonl`, :func:`iter_jsonl`, :func:`corrupt`, :data:`BAD_KINDS`.
``python -m chipledger.sim.scenario --help`` writes a scenario to JSONL and reports the generation speed.
"""

from __future__ import annotations

from datetime import datetime
from typing import Iterator

from chipledger.sim.scenario.engine import _Sim
from chipledger.sim.scenario.hostile import BAD_KINDS, corrupt
from chipledger.sim.scenario.wire import UTC, iter_jsonl, write_jsonl

__all__ = ["generate", "write_jsonl", "iter_jsonl", "corrupt", "BAD_KINDS", "UTC"]


def generate(seed: int = 7, days: float = 14, start: datetime = datetime(2026, 11, 2, tzinfo=UTC),
             pools: int = 3, teams: int = 10, scale: float = 1.0, *, follow=None, load: float | None = None,
             failure_scale: float = 1.0, progress: bool = False) -> Iterator[dict]:
    """Yield a fleet scenario as wire-format event dicts (DESIGN §3), in non-decreasing ``occurred_at``.

    Deterministic: the same arguments give the same events. Streaming: memory follows the number of chips
    and active jobs, not ``days``. ``scale`` multiplies job arrival rates and pool sizes together.
    Each pool starts with ``pool.configured`` and its ``chip.registered`` events and ends with ``pool.tick``
    at ``start + days``; jobs still running or pending then are left open.

    ``follow(event) -> [decision dicts]``: the cluster acts on the ledger's decisions (see the module's
    docstring). ``load``: the offered load as a fraction of capacity (default ~0.92); ``failure_scale``
    multiplies the rates of chip failures, degradations and maintenance. ``progress``: training jobs report their
    steps (job.progress, job.checkpointed with units), slowed by degraded chips.
    """
    return _Sim(seed, days, start, pools, teams, scale, follow, load, failure_scale, progress).run()
