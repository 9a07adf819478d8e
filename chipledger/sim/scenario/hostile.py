"""Hostile lines: deliberately bad input interleaved with a scenario, one kind of each of BAD_KINDS in turn.

Used by the tests and the demo to show that every bad line is a dead letter with its code, and that nothing a
bad line says changes the books.
"""

from __future__ import annotations

import json
import random
from collections import deque
from typing import Iterable, Iterator

from chipledger.sim.scenario.wire import _ENCODE


BAD_KINDS = (
    "not_json", "unknown_type", "missing_field", "extra_field", "naive_timestamp", "zero_chips",
    "negative_chips", "unknown_job", "unknown_chip", "unknown_pool", "illegal_transition", "duplicate",
    "duplicate_conflict",
)


def corrupt(lines: Iterable[str], seed: int, every: int = 500, labels: list | None = None) -> Iterator[str]:
    """Pass ``lines`` through, inserting about one deliberately bad line per ``every`` lines.

    Bad kinds cycle through :data:`BAD_KINDS`. Every bad line has a fresh, unique ``event_id``
    (``bad-<seed>-<n>-<kind>``) except the two duplicate kinds, which reuse the id of an earlier line of the
    same ``occurred_at``. Inserted lines carry the ``occurred_at`` of the line before them and end with a
    newline when the input lines do. If ``labels`` is a list, ``(output_index, kind)`` is appended to it for
    each inserted line. A kind that cannot be made yet (no pending job for ``illegal_transition``) is tried
    again after the next line.
    """
    if every < 1:
        raise ValueError("every must be >= 1")
    rng = random.Random(seed)
    enc = _ENCODE
    ring: deque = deque(maxlen=64)  # recent good input lines: (text, event)
    pending: dict[str, str] = {}  # job id -> pool, for jobs pending now
    teams: list[str] = []
    kind_i = 0
    n_bad = 0
    out_i = 0
    jitter = max(0, every // 5)
    gap = max(1, every + rng.randint(-jitter, jitter))
    since = 0
    prev = None
    for line in lines:
        yield line
        out_i += 1
        since += 1
        nl = "\n" if line.endswith("\n") else ""
        text = line.rstrip("\r\n")
        try:
            ev = json.loads(text)
        except ValueError:
            ev = None
        if isinstance(ev, dict) and isinstance(ev.get("occurred_at"), str) and "pool" in ev:
            prev = ev
            ring.append((text, ev))
            typ = ev.get("type")
            jid = ev.get("job_id")
            if typ == "job.submitted":
                pending[jid] = ev["pool"]
                if ev.get("team") not in teams and len(teams) < 64:
                    teams.append(ev.get("team"))
            elif typ == "job.preempted":
                pending[jid] = ev["pool"]
            elif typ in ("job.started", "job.finished"):
                pending.pop(jid, None)
        if since < gap or prev is None:
            continue
        kind = BAD_KINDS[kind_i % len(BAD_KINDS)]
        bad = _make_bad(kind, rng, seed, n_bad, prev, ring, pending, teams, enc)
        if bad is None:
            continue
        yield bad + nl
        if labels is not None:
            labels.append((out_i, kind))
        out_i += 1
        n_bad += 1
        kind_i += 1
        since = 0
        gap = max(1, every + rng.randint(-jitter, jitter))


def _make_bad(kind, rng, seed, n, prev, ring, pending, teams, enc):
    at = prev["occurred_at"]
    pool = prev["pool"]
    source = prev.get("source", "chaos/corrupt")
    eid = f"bad-{seed}-{n:06d}-{kind}"
    team = teams[rng.randrange(len(teams))] if teams else "vision"
    ghost = f"job-bad-{seed}-{n:06d}"

    def env(typ, **fields):
        ev = {"event_id": eid, "type": typ, "occurred_at": at, "pool": pool, "source": source}
        ev.update(fields)
        return ev

    def submitted(**over):
        f = {"job_id": ghost, "team": team, "chips": 1, "priority": 100, "preemptible": True}
        f.update(over)
        return env("job.submitted", **f)

    if kind == "not_json":
        text = enc(submitted())
        return text[: max(12, len(text) * 2 // 3)]
    if kind == "unknown_type":
        return enc(env("job.teleported", job_id=ghost))
    if kind == "missing_field":
        ev = submitted()
        del ev["team"]
        return enc(ev)
    if kind == "extra_field":
        return enc(submitted(queue_name="default"))
    if kind == "naive_timestamp":
        ev = env("pool.tick")
        naive = at[:-1] if at.endswith("Z") else at[:19]
        ev["occurred_at"] = naive
        return enc(ev)
    if kind == "zero_chips":
        return enc(submitted(chips=0))
    if kind == "negative_chips":
        return enc(env("quota.granted", grant_id=f"grant-bad-{seed}-{n:06d}", team=team, chips=-8))
    if kind == "unknown_job":
        return enc(env("job.started", job_id=f"job-ghost-{seed}-{n:06d}"))
    if kind == "unknown_chip":
        return enc(env("chip.state_changed", chip_id=f"ghost-chip-{seed}-{n:06d}", state="down",
                       reason="xid 79: GPU has fallen off the bus"))
    if kind == "unknown_pool":
        ev = submitted()
        ev["pool"] = "nowhere-1z/ghost-accel"
        return enc(ev)
    if kind == "illegal_transition":
        if not pending:
            return None
        jid = next(reversed(pending))
        ev = env("job.checkpointed", job_id=jid)
        ev["pool"] = pending[jid]
        return enc(ev)
    same = [(t, e) for t, e in ring if e.get("occurred_at") == at]
    text, ev = same[rng.randrange(len(same))]
    if kind == "duplicate":
        return text
    # duplicate_conflict: same event_id, a different body
    ev = dict(ev)
    if isinstance(ev.get("chips"), (int, float)) and not isinstance(ev.get("chips"), bool):
        ev["chips"] = ev["chips"] * 2
    elif ev.get("type") == "job.finished":
        ev["outcome"] = "failed" if ev.get("outcome") != "failed" else "succeeded"
    elif ev.get("type") == "chip.state_changed":
        ev["state"] = "down" if ev.get("state") != "down" else "healthy"
    else:
        ev["source"] = f"{ev.get('source', 'unknown')}/replayed"
    return enc(ev)
