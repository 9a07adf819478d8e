"""A seeded fleet scenario whose capacity error budget burns: chipledger.sim.scenario's fleet (one pool), with an
outage injected (a share of the pool's chips down for some hours), for the monitoring tests."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from chipledger.sim.scenario import generate

START = datetime(2026, 11, 2, tzinfo=timezone.utc)


def _ts(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def outage_events(seed: int = 5, days: float = 4, outage_at_h: float = 62, outage_hours: float = 3,
                  share: float = 0.6) -> list[dict]:
    """The scenario's events with `share` of the first pool's chips down from hour `outage_at_h` (since START) for
    `outage_hours`, in non-decreasing event time."""
    events = list(generate(seed=seed, days=days, start=START, pools=1, teams=3, scale=0.3))
    pool = events[0]["pool"]
    chips = [e["chip_id"] for e in events if e["type"] == "chip.registered" and e["pool"] == pool]
    down_at = START + timedelta(hours=outage_at_h)
    up_at = down_at + timedelta(hours=outage_hours)
    injected = []
    for c in chips[: int(len(chips) * share)]:
        for at, state in ((down_at, "down"), (up_at, "healthy")):
            injected.append({"event_id": f"outage-{c}-{state}", "type": "chip.state_changed", "occurred_at": _ts(at),
                             "pool": pool, "source": "test/outage", "chip_id": c, "state": state,
                             "reason": "injected outage"})
    return sorted(events + injected, key=lambda e: e["occurred_at"])  # stable: the scenario's order kept
