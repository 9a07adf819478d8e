"""DuckDB views of the policy layer (fair share, decisions, why pending): `balances`, `decision_victims`,
`pending`, org totals. Kept apart from analytics/views.py so the policy views and the SLO views evolve
independently; `analytics.views.connect` defines these after its own views, so they may use them."""

from __future__ import annotations

POLICY_VIEWS: dict[str, str] = {}
