"""What chips cost (ledger/costs.py, analytics/cost_views.py; docs/statements.md "Cost"), hand-computed.

Pool of 4 chips (c1–c4). T0 is Monday 2026-11-02 08:00 UTC: hour of the week 8. Team a holds 2 chips of quota and
runs j1 on 3 chips (2 in quota, 1 borrowed) from T0 to T0 + 3 h; one chip stays idle.

Prices in USD-cent per chip-hour: `std` 100 in every hour from T0, set again to 200 from T0 + 30 min (a price change
mid-run), and `peak` 400 in hour of the week 9 (T0 + 1 h … T0 + 2 h: a band beats a whole-week price). So a chip
costs 0.5 h × 100 + 0.5 h × 200 + 1 h × 400 + 1 h × 200 = 750 cents over the 3 h:
in_quota a = 2 × 750 = 1500, borrowed a = 750, idle = 750 (+ 10 s of 4 idle chips at 200 after j1 ends: 2.22…).
Team a's monthly budget is 2000 cents: it spends 2250, so the budget is crossed and `budget_page` fires.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timezone

import pytest

from ledger import Fleet, PoolState
from ledger.costs import COST_SCALE, CostRow, hour_of_week

from tests.cost_support import fold_costs, upgrade_a_lake_without, write_log
from tests.test_evolve import (
    CFG, POOL, T0, budget, chip, configured, finish, grant, price, start, submit, tick,
)

H = 3600
CHIPS = ["c1", "c2", "c3", "c4"]


def _events(with_prices: bool = True, end: int = 3 * H + 10):
    priced = [price("std", 100), price("peak", 400, hours_of_week=[9]), budget("ba", "a", 2000)] if with_prices else []
    return [configured(), *[chip(c) for c in CHIPS], grant("ga", "a", 2), grant("gb", "b", 1), *priced,
            submit("j1", "a", 3), start("j1", 0, chip_ids=CHIPS[:3]),
            *([price("std", 200, 1800)] if with_prices else []),
            finish("j1", "succeeded", 3 * H), tick(end)]


def _fold(events, pause_at=None) -> list[CostRow]:
    return fold_costs(events, pause_at)[1]


def _totals(rows):
    out: dict = defaultdict(int)
    for r in rows:
        out[(r.account, r.team)] += r.cost_scaled
    return dict(out)


def test_hour_of_week():
    assert hour_of_week(T0) == 8  # Monday 08:00
    assert hour_of_week(T0 - 8 * H) == 0
    assert hour_of_week(T0 - 8 * H - 1) == 167


def test_hand_computed_costs():
    rows = _fold(_events())
    assert _totals(rows) == {("in_quota", "a"): 1500 * COST_SCALE, ("borrowed", "a"): 750 * COST_SCALE,
                             ("idle", None): 750 * COST_SCALE + 10 * 4000 * 200}
    by_hour = defaultdict(int)
    for r in rows:
        if r.account == "in_quota":
            by_hour[(r.hour - T0, r.price_id, r.per_chip_hour)] += r.amount_mchip_s
    # the first hour split at the price change (T0 + 30 min), the second hour in the peak band
    assert dict(by_hour) == {(0, "std", 100): 2000 * 1800, (0, "std", 200): 2000 * 1800,
                             (H, "peak", 400): 2000 * H, (2 * H, "std", 200): 2000 * H}
    assert all(r.pool == POOL and r.unit == "USD-cent" and r.cost_scaled == r.amount_mchip_s * r.per_chip_hour
               for r in rows)


@pytest.mark.parametrize("pause_at", [9, 11, 12])
def test_costs_do_not_depend_on_where_the_fold_paused(pause_at):
    assert _totals(_fold(_events(), pause_at)) == _totals(_fold(_events()))


def test_no_price_no_cost_rows():
    assert _fold(_events(with_prices=False)) == []


def test_price_versions_survive_a_restart():
    fleet = Fleet(CFG)
    for e in _events()[:10]:
        fleet.apply(e)
    state = fleet.pools[POOL]
    again = PoolState.from_dict(state.to_dict())
    assert again.price_versions == state.price_versions and len(state.price_versions) == 2


def _lake(tmp_path, with_prices=True, end=3 * H + 10):
    from chipledger.embedded import run_file

    events = _events(with_prices, end)
    summary, _ = run_file(write_log(tmp_path / "events.jsonl", events), tmp_path / "lake", events_process=False)
    assert summary.accepted == len(events)
    return tmp_path / "lake"


def test_cost_and_budget_views(tmp_path):
    from analytics.views import connect

    con = connect(_lake(tmp_path))
    got = dict(con.execute("SELECT account || ':' || coalesce(team, ''), sum(cost_scaled) FROM cost "
                           "GROUP BY 1").fetchall())
    assert got == {"in_quota:a": 1500 * COST_SCALE, "borrowed:a": 750 * COST_SCALE,
                   "idle:": 750 * COST_SCALE + 10 * 4000 * 200}
    assert con.execute("SELECT DISTINCT flavor, unit FROM cost").fetchall() == [("h100", "USD-cent")]
    [(team, period, start, budget_, spent, left)] = con.execute(
        'SELECT team, period, period_start, budget, spent, "left" FROM budget').fetchall()
    assert (team, period, budget_, spent, left) == ("a", "month", 2000, 2250, -250)
    assert start == datetime(2026, 11, 1, tzinfo=timezone.utc)
    firing = con.execute("SELECT alert, severity, team, unit FROM budget_alerts WHERE firing").fetchall()
    assert ("budget_page", "page", "a", "USD-cent") in firing


def test_a_lake_with_no_prices_shows_no_costs(tmp_path):
    from analytics.views import connect

    con = connect(_lake(tmp_path, with_prices=False))
    assert con.execute("SELECT count(*) FROM cost_postings").fetchone() == (0,)
    assert con.execute("SELECT count(*), count(cost), count(unit) FROM cost").fetchone()[1:] == (0, 0)
    assert con.execute("SELECT count(*) FROM budget_alerts").fetchone() == (0,)


def test_statement_shows_cost_budget_and_peak(tmp_path):
    from analytics.views import connect
    from chipledger.reports.statements import parse_period, compute_statements, render_files

    con = connect(_lake(tmp_path))
    [st] = compute_statements(con, parse_period("2026-11-02..2026-11-02"), teams=["a"])
    cost = st["cost"]
    assert cost["priced"] and cost["totals"] == [{"unit": "USD-cent", "total_scaled": 2250 * COST_SCALE,
                                                  "total": 2250.0}]
    [pool] = cost["by_pool"]
    assert (pool["flavor"], pool["in_quota"], pool["borrowed"], pool["burst"]) == ("h100", 1500.0, 750.0, 0.0)
    [b] = cost["budgets"]
    assert (b["budget"], b["spent"], b["left"]) == (2000, 2250.0, -250.0)
    # j1 (3 chips) started at T0, off-peak: its own start is its off-peak start, so the comparison saves nothing; its
    # hour in the band (400 > the cheapest 100) is peak: 3 chip-hours of its 9
    [peak] = cost["peak"]
    assert (peak["runs"], peak["peak_mchip_s"], peak["peak_share"], peak["as_run_cost"], peak["off_peak_cost"],
            peak["saving"], peak["runs_no_off_peak_start"]) == (1, 3 * 3_600_000, round(1 / 3, 6), 2250.0, 2250.0, 0.0, 0)
    assert cost["peak_totals"] == [{"unit": "USD-cent", "runs_compared": 1, "as_run_cost_scaled": 2250 * COST_SCALE,
                                    "as_run_cost": 2250.0, "off_peak_cost_scaled": 2250 * COST_SCALE,
                                    "off_peak_cost": 2250.0, "saving": 0.0}]
    md = render_files(st, ("md",))
    assert any(b"2250.00 USD-cent" in v for v in md.values())


def test_report_shows_cost_per_pool_and_budgets(tmp_path):
    from analytics.views import connect
    from chipledger.reports.costs import pool_costs
    from chipledger.reports.report import build_report

    con = connect(_lake(tmp_path))
    rep = build_report(con)
    [cost] = [s for s in rep.sections if s.title.startswith("Cost")]
    # use 2250 + idle 750 + 10 s of 4 idle chips at 200 (2.22…)
    assert cost.rows[0] == [POOL, "USD-cent", "2,250.00", "752.22", "0.00", "3,002.22"]
    assert [r[0] for r in cost.rows] == [POOL, "(total)"]
    [budgets] = [s for s in rep.sections if s.title.startswith("Budgets")]
    assert budgets.rows[0][:4] == ["a", "month", "2026-11-01", "USD-cent"] and budgets.marks[(0, 6)] == "bad"
    [pc] = pool_costs(con)
    assert (pc["used"], pc["idle"], pc["unavailable"]) == (2250.0, 752.222222, 0.0)


def test_report_without_prices_says_cost_unknown(tmp_path):
    from analytics.views import connect
    from chipledger.reports.report import build_report

    rep = build_report(connect(_lake(tmp_path, with_prices=False)))
    [cost] = [s for s in rep.sections if s.title.startswith("Cost")]
    assert cost.rows == [] and "unknown" in cost.note
    assert not [s for s in rep.sections if s.title.startswith("Budgets")]


def test_a_lake_written_before_costs_is_upgraded_by_folding_again(tmp_path):
    """A committed lake whose manifest has no `costs` table (written before this version): readers say to run
    `lake upgrade`, which folds the events again and commits the costs."""
    upgrade_a_lake_without(_lake(tmp_path), "costs", "SELECT sum(cost_scaled) FROM cost_postings")


@pytest.mark.parametrize("pause_at", [None, 9, 12])
def test_the_states_cost_counter_is_the_teams_cost_rows_and_survives_a_restart(pause_at):
    """PoolState.cost_counts (what /metrics serves as chipledger_team_cost_total) is the sum of the cost rows with a
    team the fold posts, carried through to_dict/from_dict: 1500 + 750 cents for team a, idle not in it."""
    fleet = Fleet(CFG)
    rows: list[CostRow] = []
    for i, e in enumerate(_events()):
        rows += fleet.apply(e).costs
        if i == pause_at:
            fleet = Fleet.from_dict(fleet.to_dict(), CFG)
    fleet.close()
    rows += fleet.close_facts().get("costs", [])
    want: dict = defaultdict(int)
    for r in rows:
        if r.team is not None:
            want[(r.team, r.unit)] += r.cost_scaled
    assert fleet.pools[POOL].cost_counts == dict(want) == {("a", "USD-cent"): 2250 * COST_SCALE}
    assert PoolState.from_dict(fleet.pools[POOL].to_dict()).cost_counts == dict(want)


def test_metrics_cost_series_from_the_states():
    """streams/metrics.py (the worker's and serve-metrics' collector) serves the states' cost counters and budgets;
    a fold without prices serves no cost series (unknown, not zero)."""
    from prometheus_client.parser import text_string_to_metric_families

    from streams.metrics import MetricsCollector, exposition, period_bounds, registry_of

    def scrape(events):
        fleet = Fleet(CFG)
        for e in events:
            fleet.apply(e)
        fleet.close()
        text = exposition(registry_of(MetricsCollector(fleet.pools, CFG), process=False)).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith(("chipledger_team_cost", "chipledger_team_budget"))}

    start, end = period_bounds("month", T0)
    assert scrape(_events()) == {
        ("chipledger_team_cost_total", (("pool", POOL), ("team", "a"), ("unit", "USD-cent"))): 2250.0,
        ("chipledger_team_budget_rate", (("period", "month"), ("team", "a"), ("unit", "USD-cent"))):
            pytest.approx(2000 / (end - start)),
    }
    assert scrape(_events(with_prices=False)) == {}
