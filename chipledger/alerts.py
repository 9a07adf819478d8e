"""`chipledger alerts`: the burn-rate alerts firing now (the `burn_alerts` view: the SRE workbook's
multi-window, multi-burn-rate rules), for people and for cron or a monitoring system.

Exit status: 0 when nothing fires, 1 when only ticket-level alerts fire, 2 when a page-level alert fires.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Optional

import duckdb

EXIT_OK, EXIT_TICKET, EXIT_PAGE = 0, 1, 2


@dataclass(frozen=True)
class Alert:
    severity: str       # page | ticket
    alert: str          # page_1h | page_6h | ticket_3d
    slo: str
    pool: str
    burn_rate: float    # the rule's threshold (× the budget rate)
    long_win: str
    long_burn: float
    short_win: str
    short_burn: float
    target: float
    evaluated_at: datetime

    def as_dict(self) -> dict:
        d = asdict(self)
        d["evaluated_at"] = self.evaluated_at.isoformat().replace("+00:00", "Z")
        return d

    def line(self) -> str:
        return (f"{self.severity.upper():6} {self.alert:9} {self.slo:14} {self.pool}: burning {self.long_burn:.1f}× "
                f"over {self.long_win} and {self.short_burn:.1f}× over {self.short_win} (threshold "
                f"{self.burn_rate:g}×, target {100 * self.target:g}%)")


def firing(con: duckdb.DuckDBPyConnection, pool: Optional[str] = None) -> list[Alert]:
    """The firing alerts of `con` (analytics.views.connect), pages first, then by SLO and pool."""
    rows = con.execute("""
        SELECT severity, alert, slo, pool, burn_rate, long_win, long_burn, short_win, short_burn, target, evaluated_at
        FROM burn_alerts WHERE firing AND ($pool IS NULL OR pool = $pool)
        ORDER BY severity = 'page' DESC, alert, slo, pool""", {"pool": pool}).fetchall()
    return [Alert(*r) for r in rows]


def exit_status(alerts: list[Alert]) -> int:
    if any(a.severity == "page" for a in alerts):
        return EXIT_PAGE
    return EXIT_TICKET if alerts else EXIT_OK
