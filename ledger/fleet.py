"""A fleet: the pools' states side by side, for folding a mixed log in one process (the embedded run,
tests, backtests). Each event goes to its own pool's state; pools never see each other's events."""

from __future__ import annotations

from typing import Any, Iterable, Optional

from ledger.fold import DEFAULT_CONFIG, FoldConfig, Step, close_books, close_facts, evolve, policy_rows
from ledger.state import PoolState


class Fleet:
    def __init__(self, config: FoldConfig = DEFAULT_CONFIG, pools: Optional[dict[str, PoolState]] = None):
        self.config = config
        self.pools: dict[str, PoolState] = dict(pools or {})
        self.close_costs: list = []  # the cost rows of the last `close` (ledger.costs), given out by close_facts

    def apply(self, event, raw: Any = None, origin: Optional[str] = None, appended_s: Optional[int] = None) -> Step:
        """Fold one event into its pool (`origin`, `appended_s`: as `evolve` takes them, from a log export)."""
        state = self.pools.get(event.pool)
        if origin is None and appended_s is None:
            new, step = evolve(state, event, self.config, raw)
        else:
            new, step = evolve(state, event, self.config, raw, origin=origin, appended_s=appended_s)
        if new is not state:  # a pool.configured created the pool
            self.pools[event.pool] = new
        return step

    def apply_all(self, events: Iterable) -> list[Step]:
        return [self.apply(e) for e in events]

    def close(self) -> tuple[list, list]:
        """Close every pool's books at its own clock (pools in name order, for a deterministic output)."""
        journal: list = []
        runs: list = []
        self.close_costs = []
        for name in sorted(self.pools):
            j, r = close_books(self.pools[name], costs_out=self.close_costs)
            journal.extend(j)
            runs.extend(r)
        return journal, runs

    def close_facts(self) -> dict[str, list]:
        """The facts a close of the books posts at each pool's clock (call after `close`): the waits still open and
        the free chips of the current second, and the cost rows of the journal `close` posted, {"waits": rows,
        "free_chips": rows, "costs": rows}, pools in name order."""
        out: dict[str, list] = {"waits": [], "free_chips": []}
        for name in sorted(self.pools):
            for table, rows in close_facts(self.pools[name]).items():
                out[table].extend(rows)
        if self.close_costs:
            out["costs"], self.close_costs = self.close_costs, []
        return out

    def policy_rows(self) -> dict[str, list]:
        """The balances of every team and the reason of every pending job at each pool's clock (read-only;
        call after `close`): {"balances": rows, "pending": rows}, pools in name order."""
        balances: list = []
        pending: list = []
        for name in sorted(self.pools):
            b, p = policy_rows(self.pools[name], self.config)
            balances.extend(b)
            pending.extend(p)
        return {"balances": balances, "pending": pending}

    def to_dict(self) -> dict:
        return {name: state.to_dict() for name, state in sorted(self.pools.items())}

    @classmethod
    def from_dict(cls, d: dict, config: FoldConfig = DEFAULT_CONFIG) -> "Fleet":
        return cls(config, {name: PoolState.from_dict(sd) for name, sd in d.items()})
