"""The fleet: pools of one chip flavor each, their nodes and chips, and where a job's chips can be placed.

- A pool is made from a template (zone, cluster, flavor, chips per node, nodes at scale 1); ``scale`` multiplies
  its nodes, and its failure, degradation, maintenance and sweep rates follow its size (faults.py and demand.py
  run those processes).
- A chip is healthy, degraded, down, in maintenance or retired; it takes jobs while healthy or degraded.
- Placement keeps, per pool, each chip's free milli-chips, the nodes bucketed by their wholly free chips and
  the shared chips bucketed by their free fraction: a single-node job takes chips of one node (best fit), a
  multi-node job whole free nodes, a fractional job (GPU pools: 1/8 chip steps) a shared chip first.
"""

from __future__ import annotations

import itertools


# chip states (internal); a chip is usable for placement while state < DOWN
HEALTHY, DEGRADED, DOWN, MAINT, RETIRED = range(5)
_STATE_NAMES = ("healthy", "degraded", "down", "maintenance")
_FRACTION_UNIT = 125  # fractional jobs are multiples of 1/8 chip, so a shared chip's free milli is too
# (zone, cluster, flavor, chip-id prefix, chips per node, nodes at scale 1, fractional jobs allowed)
_POOL_TEMPLATES = (
    ("us-east1-a", "cluster-a", "h100-80gb", "h100", "g", 8, 20, True),
    ("us-central1-c", "cluster-b", "a100-40gb", "a100", "g", 8, 24, True),
    ("us-west4-a", "cluster-c", "tpu-v5e", "v5e", "c", 4, 24, False),
    ("europe-west4-b", "cluster-d", "h200-141gb", "h200", "g", 8, 8, True),
    ("us-east5-a", "cluster-e", "tpu-v6e", "v6e", "c", 4, 24, False),
    ("asia-northeast1-a", "cluster-f", "l4-24gb", "l4", "g", 4, 12, True),
    ("us-south1-a", "cluster-g", "mi300x-192gb", "mi300x", "g", 8, 6, True),
    ("europe-west1-b", "cluster-h", "a100-80gb", "a100x", "g", 8, 28, True),
)
_SWEEPS_PER_POOL_DAY = 0.5
_FAIL_PER_CHIP_S = 1.0 / (60 * 86400)  # a chip goes down about every 60 days
_DEGRADE_PER_CHIP_S = 1.0 / (90 * 86400)
_MAINT_PER_NODE_S = 1.0 / (45 * 86400)  # each node gets planned maintenance about every 45 days


class _Pool:
    """One pool: its chips, nodes and placement buckets (this module), its queue (scheduler.py), its teams' quotas
    and use (demand.py), the rates of its processes."""

    __slots__ = (
        "idx", "name", "flavor", "sched_src", "health_src", "inv_src", "cpn", "gpu", "n_nodes",
        "n_chips", "chip_ids", "node_names", "state", "free", "jobs_on", "tokens",
        "node_free", "buckets", "partial", "free_whole", "queue", "pend_cls", "parked", "running", "use",
        "nominal",
        "blim", "grants", "reclaim_pending", "team_cum", "team_idx", "shape", "lam_mean", "day_idx", "day_mult",
        "fail_rate", "degrade_rate", "maint_rate", "sweep_rate", "max_whole", "burst",
    )


def _shift_node(p, n: int, d: int) -> None:
    """d chips of node n became wholly free (d > 0) or stopped being so (d < 0): move the node between
    free-count buckets."""
    nf = p.node_free[n]
    del p.buckets[nf][n]
    p.buckets[nf + d][n] = None
    p.node_free[n] = nf + d
    p.free_whole += d


def _shift_whole(p, c: int, d: int) -> None:
    """Chip c became wholly free (d=+1) or stopped being so (d=-1)."""
    _shift_node(p, c // p.cpn, d)


class _Fleet:
    """The fleet's part of the simulation (mixed into engine._Sim: ``self`` is the simulation): making the
    pools, and the placement structures."""

    def _make_pool(self, i: int) -> _Pool:
        rng = self.rng
        tpl = _POOL_TEMPLATES[i % len(_POOL_TEMPLATES)]
        zone, cluster, flavor, prefix, chip_letter, cpn, base_nodes, gpu = tpl
        k = i // len(_POOL_TEMPLATES)
        if k:
            zone, cluster = f"{zone}{k + 1}", f"{cluster}{k + 1}"
        p = _Pool()
        p.idx = i
        p.name = f"{zone}/{flavor}"
        p.flavor = flavor
        p.sched_src = f"{cluster}/kueue"
        p.health_src = f"{cluster}/node-health"
        p.inv_src = f"{cluster}/inventory"
        p.cpn = cpn
        p.gpu = gpu
        nodes1 = min(256 // cpn, max(32 // cpn, round(base_nodes * rng.uniform(0.75, 1.25))))
        p.n_nodes = max(2, round(nodes1 * self.scale))
        p.n_chips = p.n_nodes * cpn
        p.node_names = [f"{prefix}-n{n:03d}" for n in range(p.n_nodes)]
        p.chip_ids = [f"{p.node_names[c // cpn]}-{chip_letter}{c % cpn}" for c in range(p.n_chips)]
        p.state = [HEALTHY] * p.n_chips
        p.free = [1000] * p.n_chips
        p.jobs_on = [[] for _ in range(p.n_chips)]
        p.tokens = [0] * p.n_chips
        p.node_free = [cpn] * p.n_nodes
        p.buckets = [{} for _ in range(cpn + 1)]
        p.buckets[cpn] = dict.fromkeys(range(p.n_nodes))
        p.partial = [{} for _ in range(1000 // _FRACTION_UNIT)]
        p.free_whole = p.n_chips
        p.queue = {}  # job size (milli) -> heap of (-priority, seq, token, job)
        p.pend_cls = {}  # job size -> number of live entries in its queue
        p.parked = [{} for _ in range(self.n_teams)]  # team -> job size -> entries over the borrowing limit
        p.running = [{} for _ in range(self.n_teams)]
        p.use = [0] * self.n_teams
        p.nominal = [0] * self.n_teams
        p.blim = [None] * self.n_teams
        p.grants = {}
        p.reclaim_pending = False
        p.day_idx = -1
        p.day_mult = 1.0
        # job sizes are those of the scale-1 pool: scaling adds more jobs, not bigger ones
        max_whole = 1
        while max_whole * 2 <= min(nodes1 * cpn / 4, p.n_chips / 2):
            max_whole *= 2
        p.max_whole = max_whole
        p.fail_rate = p.n_chips * _FAIL_PER_CHIP_S * self.failure_scale
        p.degrade_rate = p.n_chips * _DEGRADE_PER_CHIP_S * self.failure_scale
        p.maint_rate = p.n_nodes * _MAINT_PER_NODE_S * self.failure_scale
        p.burst = [0] * self.n_teams  # team -> milli-chips of approved bursts whose window is open (follow mode)
        p.sweep_rate = _SWEEPS_PER_POOL_DAY * self.scale / 86400
        return p

    def _fits(self, p: _Pool, m: int) -> bool:
        if m < 1000:
            if p.free_whole:
                return True
            part = p.partial
            for i in range(m // _FRACTION_UNIT, len(part)):
                if part[i]:
                    return True
            return False
        k = m // 1000
        cpn = p.cpn
        if k < cpn:
            b = p.buckets
            for nf in range(k, cpn + 1):
                if b[nf]:
                    return True
            return False
        return len(p.buckets[cpn]) >= k // cpn

    def _place(self, p: _Pool, m: int):
        cpn = p.cpn
        b = p.buckets
        if m < 1000:
            part = p.partial
            for i in range(m // _FRACTION_UNIT, len(part)):
                if part[i]:
                    return [next(iter(part[i]))]
            for nf in range(1, cpn + 1):  # best fit: keep whole nodes whole
                if b[nf]:
                    n = next(iter(b[nf]))
                    base = n * cpn
                    for c in range(base, base + cpn):
                        if p.free[c] == 1000 and p.state[c] < DOWN:
                            return [c]
            return None
        k = m // 1000
        if k < cpn:
            for nf in range(k, cpn + 1):
                if b[nf]:
                    n = next(iter(b[nf]))
                    base = n * cpn
                    chips = []
                    free, state = p.free, p.state
                    for c in range(base, base + cpn):
                        if free[c] == 1000 and state[c] < DOWN:
                            chips.append(c)
                            if len(chips) == k:
                                return chips
            return None
        need = k // cpn
        if len(b[cpn]) < need:
            return None
        chips = []
        for n in list(itertools.islice(b[cpn], need)):
            chips.extend(range(n * cpn, n * cpn + cpn))
        return chips

    def _take(self, p: _Pool, c: int, m: int) -> None:
        f = p.free[c]
        if f == 1000:
            _shift_whole(p, c, -1)
        else:
            del p.partial[f // _FRACTION_UNIT][c]
        f -= m
        p.free[c] = f
        if f:
            p.partial[f // _FRACTION_UNIT][c] = None

    def _give(self, p: _Pool, c: int, m: int) -> None:
        f = p.free[c]
        g = f + m
        p.free[c] = g
        if p.state[c] < DOWN:
            if f:
                del p.partial[f // _FRACTION_UNIT][c]
            if g == 1000:
                _shift_whole(p, c, +1)
            else:
                p.partial[g // _FRACTION_UNIT][c] = None

    def _unusable(self, p: _Pool, c: int) -> None:
        f = p.free[c]
        if f == 1000:
            _shift_whole(p, c, -1)
        elif f:
            del p.partial[f // _FRACTION_UNIT][c]

    def _usable(self, p: _Pool, c: int) -> None:
        f = p.free[c]
        if f == 1000:
            _shift_whole(p, c, +1)
        elif f:
            p.partial[f // _FRACTION_UNIT][c] = None
