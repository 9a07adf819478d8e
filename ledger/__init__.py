"""The pure ledger core: `PoolState`, `evolve`, hourly books. No I/O, no wall clock, integers only.

Layers point one way: schemas <- ledger <- {store, streams, analytics, chipledger}.

`CORE` says whether the fold runs compiled (mypyc, built by `make`) or as plain Python (ledger/_compiled.py).
"""

from ledger._compiled import activate as _activate

CORE = _activate(__path__)  # before the core's modules are imported: the compiled ones, when they match

from ledger.books import ACCOUNTS, POOL_ACCOUNTS, TEAM_ACCOUNTS, JournalRow, hour_of
from ledger.fold import (
    DEFAULT_CONFIG, ChipStateRow, FoldConfig, FreeChipsRow, GrantIntervalRow, JobRunRow, ProgressRow, Step, WaitRow,
    check_invariants, close_books, close_facts, evolve, free_chips_values, policy_rows, split_use,
)
from ledger.fleet import Fleet
from ledger.state import Chip, Grant, Job, PoolState, Progress, Team

__all__ = [name for name in dir() if not name.startswith("_")]
