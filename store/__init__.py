"""The store adapter: current state in SQL (SQLAlchemy 2.x; SQLite by default, PostgreSQL by URL).

It holds what is true now (balances per pool and team, grants held, the runs log, the decisions index, the statement runs) and the tracking table of
input positions, written in the same transaction as the effects. History stays in the event log and the lake.
"""

from store.models import (Base, DecisionIndex, GrantRow, PoolBalance, RunLog, StatementRun, TeamBalance,
                                 Tracking)
from store.repo import Store, open_store

__all__ = ["Base", "DecisionIndex", "GrantRow", "PoolBalance", "RunLog", "StatementRun", "TeamBalance", "Tracking",
           "Store", "open_store"]
