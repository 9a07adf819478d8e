"""Who may say what (DESIGN §3, "Roles"): the one table of event types per role, and the check of a principal
against an event's type and pool.

A principal holds roles and speaks for clusters; a pool is `CLUSTER/NAME` and belongs to its cluster. The edge
that knows a record's principal from something the producer cannot forge (the Kafka worker, from a verified
signature) calls `check` before the fold: a type none of the principal's roles may send is `wrong_role`, a pool
outside its clusters `not_owner` (in that order). Admins speak for every cluster (`clusters = {"*"}`). A cluster
may name any team: teams come from its scheduler's accounts (docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from schemas.codes import Rejection, RejectionCode
from schemas.events import EVENT_MODELS

ALL_CLUSTERS = "*"

_QUOTA = frozenset({"quota.granted", "quota.revoked"})
_PRICES = frozenset({"price.set", "budget.set"})
_CHIPS_AND_JOBS = frozenset(t for t in EVENT_MODELS if t.startswith(("chip.", "job.")))

#: role -> the event types it may send
ROLES: dict[str, frozenset[str]] = {
    "admin": frozenset({"pool.configured", "burst.requested", "pool.tick"}) | _QUOTA | _PRICES,
    "cluster": _CHIPS_AND_JOBS | {"pool.tick"},
    "portal": frozenset({"burst.requested"}),  # for the signed-in member's team, with requested_by (the portal checks the team)
    # the worker sends the pool.tick of quiet pools (signed with its own key, streams/worker.py); the sink and
    # readers send no input event
    "worker": frozenset({"pool.tick"}),
    "reader": frozenset(),
}

#: a `cluster` principal's extra rights (`kafka users add … --role cluster --may quota`): an adapter that mirrors its
#: scheduler's inventory, quotas or billing weights (Slurm associations, Kueue ClusterQueues)
MAY: dict[str, frozenset[str]] = {
    "pools": frozenset({"pool.configured"}),
    "quota": _QUOTA,
    "prices": _PRICES,
}


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated producer: its name, roles (keys of ROLES), the clusters it speaks for (`*`: every
    cluster, for admins) and a cluster principal's extra rights (keys of MAY)."""

    name: str
    roles: frozenset[str]
    clusters: frozenset[str]
    may: frozenset[str] = frozenset()

    def __post_init__(self):
        unknown = set(self.roles) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown role(s) {', '.join(sorted(unknown))}: known roles are {', '.join(ROLES)}")
        unknown = set(self.may) - set(MAY)
        if unknown:
            raise ValueError(f"unknown right(s) {', '.join(sorted(unknown))} for --may: known are {', '.join(MAY)}")

    def types(self) -> frozenset[str]:
        """Every event type this principal may send (to its own clusters' pools)."""
        out: frozenset[str] = frozenset()
        for role in self.roles:
            out |= ROLES[role]
        if "cluster" in self.roles:
            for right in self.may:
                out |= MAY[right]
        return out


def pool_cluster(pool: str) -> str:
    """The cluster a pool belongs to: the text before the first '/' (a pool without one is its own cluster)."""
    return pool.split("/", 1)[0]


def check(principal: Principal, event_type: str, pool: str) -> Optional[Rejection]:
    """None when `principal` may send an event of `event_type` about `pool`; else `wrong_role` (the type is not
    one of its roles') or, that being fine, `not_owner` (the pool's cluster is not one it speaks for)."""
    if event_type not in principal.types():
        roles = ", ".join(sorted(principal.roles)) or "none"
        return Rejection(RejectionCode.wrong_role,
                         f"principal {principal.name!r} (roles: {roles}) may not send {event_type[:64]!r}")
    if ALL_CLUSTERS not in principal.clusters:
        cluster = pool_cluster(pool)
        if cluster not in principal.clusters:
            return Rejection(RejectionCode.not_owner,
                             f"principal {principal.name!r} speaks for cluster(s) "
                             f"{', '.join(sorted(principal.clusters)) or 'none'}, not {cluster[:64]!r} "
                             f"(pool {pool[:128]!r})")
    return None
