"""Chips and nodes: chip.registered, chip.state_changed, chip.retired, and the facts `chip_states` and
`free_chips`.

The rules:
- a chip registers once (at most MAX_POOL_CHIPS in a pool) and counts in the pool's capacity until retired;
- a chip is available when healthy or degraded; down or in maintenance it is unavailable, and the shares of the
  jobs on it are charged to nobody until it is available again (a retired chip is charged to nobody);
- a node's free chips are those available with nothing placed on them: the counts of nodes by free chips and
  the chips on whole free nodes follow every change (they say what a job asking for chips per node can start);
- a chip event posts the chip's registration and state from then on (`chip_states`); the pool's free capacity
  is posted when it changes, at most one row per pool and second (the last: `free_chips`);
- a chip with jobs on it that becomes unhealthy is noted by each job reporting progress, for its open interval
  (its worst state: ledger/progress.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from schemas.codes import Rejection, RejectionCode as RC
from schemas.events import MAX_POOL_CHIPS

from ledger.rates import _charge, _retally_pool
from ledger.state import Chip, PoolState
from ledger.step import DEFAULT_CONFIG, MILLI, NEVER, Step, _new_tuple, _rows


class FreeChipsRow(NamedTuple):
    """A fact (lake table `free_chips`): a pool's free capacity from `at` on, posted when it changes (at most one
    row per pool and second: the last). The node figures are None while a run without a placement is going."""

    pool: str
    at: int
    registered_milli: int
    healthy_milli: int       # healthy or degraded
    in_use_milli: int        # charged to running jobs (shares on available chips)
    down_milli: int          # down or in maintenance
    free_milli: int          # healthy - in use (0 when overcommitted)
    free_whole_nodes_milli: Optional[int]   # free chips on nodes with nothing placed and every chip available
    largest_startable_milli: Optional[int]  # max(free_whole_nodes, the most free chips on one node)


class ChipStateRow(NamedTuple):
    """A fact (lake table `chip_states`): a chip's registration and state from `at` on, posted at each chip event
    (registered, state changed, retired). `seq` orders a pool's rows of one second: the pool's events applied
    before this one."""

    pool: str
    chip_id: str
    node: str
    at: int
    seq: int
    state: str        # healthy | degraded | down | maintenance | retired
    registered: bool
    available: bool   # registered and healthy or degraded: its chip-seconds count as healthy


def _check_chip_registered(s: PoolState, d: dict):
    if d["chip_id"] in s.chips:
        return Rejection(RC.illegal_transition, f"chip {d['chip_id']!r} is already registered")
    if len(s.chips) >= MAX_POOL_CHIPS:
        return Rejection(RC.over_limit, f"pool {s.pool!r} already has {MAX_POOL_CHIPS:,} chips, the most a pool may "
                         f"register (docs/events.md, Limits)")
    return None


def _check_chip_known(s: PoolState, d: dict):
    if d["chip_id"] not in s.chips:
        return Rejection(RC.unknown_chip, f"chip {d['chip_id']!r} is not registered in pool {s.pool!r}")
    return None


def _apply_chip_registered(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    chip_id = d["chip_id"]
    node = d["node"]
    chip = s.chips[chip_id] = Chip(node)
    s.capacity_milli += MILLI
    _node_change(s, node, 1, 1)
    _retally_pool(s, t)
    _post_chip_state(s, chip_id, chip, t, step)


def _apply_chip_state_changed(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    chip_id = d["chip_id"]
    state = d["state"]
    chip = s.chips[chip_id]
    was = chip.available
    chip.set_state(state)
    if chip.jobs and state != "healthy":  # the throughput fact notes the chips a job held that were not healthy
        _chip_unhealthy(s, chip, chip_id)
    _post_chip_state(s, chip_id, chip, t, step)
    now = chip.available
    if was == now:
        return
    if now:
        s.down.discard(chip_id)
        s.unavailable_milli -= MILLI
    else:
        s.down.add(chip_id)
        s.unavailable_milli += MILLI
    s.run_epoch += 1
    s.other_epoch += 1
    if not chip.jobs:
        _node_change(s, chip.node, 0, 1 if now else -1)
    for job_id, share in chip.jobs.items():
        job = s.jobs[job_id]
        _charge(s, job, job.charged_milli + (share if now else -share), t)
    _retally_pool(s, t)


def _apply_chip_retired(s: PoolState, d: dict, t, step, config=DEFAULT_CONFIG):
    chip_id = d["chip_id"]
    chip = s.chips.pop(chip_id)
    _post_chip_state(s, chip_id, None, t, step, chip.node)
    s.capacity_milli -= MILLI
    _node_change(s, chip.node, -1, -1 if chip.available and not chip.jobs else 0)
    s.run_epoch += 1
    s.other_epoch += 1
    if not chip.available:
        s.down.discard(chip_id)
        s.unavailable_milli -= MILLI
    else:
        for job_id, share in chip.jobs.items():  # a retired chip is charged to nobody
            job = s.jobs[job_id]
            _charge(s, job, job.charged_milli - share, t)
    _retally_pool(s, t)


def _post_chip_state(s: PoolState, chip_id: str, chip: Optional[Chip], t: int, step: Step, node: str = "") -> None:
    """The chip's registration and state from t on (fact `chip_states`); `chip` None: retired from `node`."""
    if chip is None:
        row = (s.pool, chip_id, node, t, s.applied, "retired", False, False)
    else:
        row = (s.pool, chip_id, chip.node, t, s.applied, chip.state, True, chip.available)
    _rows(step, "chip_states").append(_new_tuple(ChipStateRow, row))


def free_chips_values(s: PoolState) -> tuple[int, int, int, int, int, Optional[int], Optional[int]]:
    """(registered, healthy, in use, down, free, free on whole nodes, largest startable), milli-chips, now."""
    healthy = s.capacity_milli - s.unavailable_milli
    in_use = s.charged_milli
    free = healthy - in_use
    if free < 0:
        free = 0
    whole: Optional[int] = None
    largest: Optional[int] = None
    if not s.unplaced_runs:
        w = s.whole_free_milli
        counts = s.node_free_counts
        most = max(counts) * MILLI if counts else 0
        whole = w
        largest = w if w > most else most
    return (s.capacity_milli, healthy, in_use, s.unavailable_milli, free, whole, largest)


def _free_chips_changed(s: PoolState, t: int) -> None:
    """After an event that may change the free capacity: the row of this second, if it differs from the last posted."""
    v = free_chips_values(s)
    free = v[1] - v[2]  # not floored at 0: the least free chips of the hour (ledger.costs, room for a run moved)
    if free < s.free_min_milli:
        s.free_min_milli = free
    row = s.fc_row
    if row is not None:  # a row of this second (one of an earlier second was posted before the event)
        if v == s.fc_posted:
            s.fc_row = None
            s.fc_due = NEVER
        else:
            s.fc_row = _new_tuple(FreeChipsRow, (s.pool, t, v[0], v[1], v[2], v[3], v[4], v[5], v[6]))
    elif v != s.fc_posted:
        s.fc_row = _new_tuple(FreeChipsRow, (s.pool, t, v[0], v[1], v[2], v[3], v[4], v[5], v[6]))
        s.fc_due = t + 1


def _post_free_chips(s: PoolState, step: Step) -> None:
    row: Any = s.fc_row
    if row.__class__ is not FreeChipsRow:  # restored from a saved state as a plain tuple
        row = _new_tuple(FreeChipsRow, tuple(row))
    _rows(step, "free_chips").append(row)
    s.fc_posted = tuple(row[2:])
    s.fc_row = None
    s.fc_due = NEVER


def _node_change(s: PoolState, node: str, d_reg: int, d_free: int) -> None:
    """A node's registered and free chips change: the counts of nodes by free chips and the whole free chips follow."""
    nodes: dict[str, list[int]] = s.nodes  # (core: typed)
    counts: dict[int, int] = s.node_free_counts
    n = nodes.get(node)
    if n is None:
        n = nodes[node] = [0, 0]
    else:
        reg, free = n[0], n[1]
        c = counts[free] - 1
        if c:
            counts[free] = c
        else:
            del counts[free]
        if free == reg:
            s.whole_free_milli -= reg * MILLI
    reg = n[0] = n[0] + d_reg
    free = n[1] = n[1] + d_free
    if reg <= 0:
        del nodes[node]
        return
    counts[free] = counts.get(free, 0) + 1
    if free == reg:
        s.whole_free_milli += reg * MILLI


_STATE_RANK = {"degraded": 1, "maintenance": 2, "down": 3}  # the worst state an unhealthy chip had is kept


def _chip_unhealthy(s: PoolState, chip: Chip, chip_id: str) -> None:
    """A chip with jobs on it became degraded, down or in maintenance: each job reporting progress in its run
    notes it for its open interval (its worst state)."""
    state = chip.state
    jobs = s.jobs
    for job_id in chip.jobs:
        job = jobs[job_id]
        pr = job.progress
        if pr is not None and pr.run == job.run_index:
            bad = pr.unhealthy
            had = bad.get(chip_id)
            if had is None or _STATE_RANK[had] < _STATE_RANK[state]:
                bad[chip_id] = state
