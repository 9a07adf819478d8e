"""What each run cost, its peak use, and what it would have cost started off-peak (ledger/costs.py `run_ended`, fact
`run_costs`; docs/policy.md "Prices, budgets and bands"), hand-computed.

Pool of 4 chips (c1–c4), registered at T0 − 1 h. T0 is Monday 2026-11-02 08:00 UTC (hour of the week 8). From T0,
USD-cent per chip-hour: `std` 100 in every hour, `peak` 400 in hours of the week 10 and 11 (10:00–12:00: the band is
dearer than the cheapest price, 100, so those seconds are peak), and `std` set again to 200 at 12:00 (mid-run of j1).

  jc  a  1 chip  (c1)        08:30–10:15  starts off-peak: its own start; 1.5 h × 100 + 0.25 h × 400 = 250
  jb  b  3 chips (c2,c3,c4)  10:00–10:20  starts peak: 09:00 (hour 9 had 3 free: jc held c1) → 3 × ⅓ h × 100 = 100,
                                          as run 3 × ⅓ h × 400 = 400
  j1  a  2 chips (c1,c2)     10:30–12:30  starts peak: 10:00 is peak; 09:00 has no room (its window 09:00–11:00
                                          covers hour 10, which had 0 free chips at 10:00–10:15 and j1 ran only
                                          part of it); 08:00 (hours 8 and 9 had 3 free) → 2 × 2 h × 100 = 400;
                                          as run 2 × (1.5 h × 400 + 0.5 h × 200) = 1400
"""

from __future__ import annotations

import pytest

from ledger.costs import COST_SCALE, RunCostRow

from tests.cost_support import fold_costs, upgrade_a_lake_without, write_log
from tests.test_evolve import T0, chip, configured, finish, grant, price, start, submit, tick

H = 3600
MIN = 60
CHIPS = ["c1", "c2", "c3", "c4"]
MCHIP_H = 3_600_000  # milli-chip-seconds in a chip-hour


def _events():
    return [configured(-H), *[chip(c, -H) for c in CHIPS], grant("ga", "a", 2, -H), grant("gb", "b", 3, -H),
            price("std", 100), price("peak", 400, hours_of_week=[10, 11]),
            submit("jc", "a", 1, 30 * MIN), start("jc", 30 * MIN, chip_ids=["c1"]),
            submit("jb", "b", 3, 2 * H), start("jb", 2 * H, chip_ids=["c2", "c3", "c4"]),
            finish("jc", "succeeded", 2 * H + 15 * MIN), finish("jb", "succeeded", 2 * H + 20 * MIN),
            submit("j1", "a", 2, 2 * H + 30 * MIN), start("j1", 2 * H + 30 * MIN, chip_ids=["c1", "c2"]),
            price("std", 200, 4 * H), finish("j1", "succeeded", 4 * H + 30 * MIN), tick(5 * H)]


def _row(job, team, chips, started, ended, peak_chip_s, cost, off_at, off_cost):
    return RunCostRow("us-east1-a/h100", job, team, 1, chips * 1000, T0 + started, T0 + ended, "succeeded",
                      "USD-cent", chips * 1000 * (ended - started), peak_chip_s * 1000, cost * COST_SCALE,
                      None if off_at is None else T0 + off_at, None if off_cost is None else off_cost * COST_SCALE)


WANT = [
    _row("jc", "a", 1, 30 * MIN, 2 * H + 15 * MIN, 15 * MIN, 250, 30 * MIN, 250),
    _row("jb", "b", 3, 2 * H, 2 * H + 20 * MIN, 3 * 20 * MIN, 400, H, 100),
    _row("j1", "a", 2, 2 * H + 30 * MIN, 4 * H + 30 * MIN, 2 * 90 * MIN, 1400, 0, 400),
]


def test_hand_computed_run_costs():
    rows, _ = fold_costs(_events())
    assert rows == WANT


def test_run_costs_add_up_to_the_teams_costs():
    """Every run ended and every second of it was priced: the runs' costs are the teams' in-quota, borrowed and burst
    cost rows (the same charges at the same prices), per team."""
    rows, costs = fold_costs(_events())
    for team in ("a", "b"):
        assert sum(r.cost_scaled for r in rows if r.team == team) == sum(
            c.cost_scaled for c in costs if c.team == team)


@pytest.mark.parametrize("pause_at", [8, 12, 14])
def test_run_costs_do_not_depend_on_where_the_fold_paused(pause_at):
    assert fold_costs(_events(), pause_at)[0] == WANT


def test_a_pool_without_prices_writes_no_run_costs():
    events = [e for e in _events() if e.type != "price.set"]
    assert fold_costs(events)[0] == []


def _full_pool(before: bool):
    """jy (4 chips) runs 10:00–13:00 (peak hours 10 and 11, then 12 at 100). Its own chips are the pool's: in hours
    10 and 11, which it ran whole, they count as free for the moved run. With `before`, jz held all 4 chips 08:00–10:00:
    hours 8 and 9 had no room, and before T0 no price held: no off-peak start (None, never 0)."""
    return [configured(-H), *[chip(c, -H) for c in CHIPS], price("std", 100), price("peak", 400, hours_of_week=[10, 11]),
            *([submit("jz", "a", 4), start("jz", 0, chip_ids=CHIPS), finish("jz", "succeeded", 2 * H)] if before else []),
            submit("jy", "b", 4, 2 * H), start("jy", 2 * H, chip_ids=CHIPS), finish("jy", "succeeded", 5 * H)]


def test_the_runs_own_chips_are_room_in_the_hours_it_ran_whole():
    rows, _ = fold_costs(_full_pool(before=False))
    # 09:00: hours 9 (4 free), 10 and 11 (0 free + jy's 4) had room. Started there, the 3 h still cover the peak
    # hours 10 and 11: 4 × (100 + 400 + 400) = 3600, as run 4 × (400 + 400 + 100) = 3600. The nearest off-peak start,
    # not the cheapest: moving this run saves nothing, and the statement says so
    assert rows == [RunCostRow("us-east1-a/h100", "jy", "b", 1, 4000, T0 + 2 * H, T0 + 5 * H, "succeeded", "USD-cent",
                               4 * 3 * MCHIP_H, 4 * 2 * MCHIP_H, 3600 * COST_SCALE, T0 + H, 3600 * COST_SCALE)]


def test_no_off_peak_start_with_room_is_null_never_zero():
    rows, _ = fold_costs(_full_pool(before=True))
    jz, jy = rows
    assert (jz.off_peak_at, jz.off_peak_cost_scaled) == (T0, jz.cost_scaled)  # started off-peak: its own start
    assert (jy.cost_scaled, jy.off_peak_at, jy.off_peak_cost_scaled) == (3600 * COST_SCALE, None, None)


def test_a_second_without_a_price_leaves_the_run_cost_null():
    """jw runs 07:30–08:30: no price held before T0, so its cost is unknown (None); it started unpriced, and no
    earlier hour was priced, so it has no off-peak start either."""
    events = [configured(-H), *[chip(c, -H) for c in CHIPS], submit("jw", "a", 1, -30 * MIN),
              start("jw", -30 * MIN, chip_ids=["c1"]), price("std", 100), finish("jw", "succeeded", 30 * MIN)]
    [row] = fold_costs(events)[0]
    assert (row.unit, row.peak_mchip_s, row.cost_scaled, row.off_peak_at, row.off_peak_cost_scaled) == (
        "USD-cent", 0, None, None, None)


def _run(tmp_path, events, *args):
    """`chipledger run` on the events as a file, as a user does."""
    from typer.testing import CliRunner

    from chipledger.cli import app

    src = write_log(tmp_path / "events.jsonl", events)
    lake, store = tmp_path / "lake", f"sqlite:///{tmp_path / 'store.db'}"
    r = CliRunner().invoke(app, ["run", "--events", str(src), "--lake", str(lake), "--store", store, *args])
    assert r.exit_code == 0, r.output
    return lake, store


def test_statement_says_the_peak_share_and_what_the_runs_would_have_cost_started_off_peak(tmp_path):
    """Team a's runs jc and j1 (the module's log): 1 chip × 1 h 45 min + 2 chips × 2 h = 5.75 chip-hours, of which
    0.25 + 3 in peak seconds; as run 250 + 1400 = 1650 cents, started off-peak 250 + 400 = 650."""
    import json

    from typer.testing import CliRunner

    from chipledger.cli import app
    from chipledger.reports.statements import file_stem

    lake, store = _run(tmp_path, _events())
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["statements", "--lake", str(lake), "--store", store, "--out", str(out),
                                 "--period", "2026-11-02..2026-11-02", "--team", "a", "--format", "json,md"])
    assert r.exit_code == 0, r.output
    st = json.loads((out / "2026-11-02..2026-11-02" / f"{file_stem('a')}.json").read_text())
    [p] = st["cost"]["peak"]
    assert (p["pool"], p["unit"], p["runs"], p["used_mchip_s"], p["peak_mchip_s"], p["peak_share"]) == (
        "us-east1-a/h100", "USD-cent", 2, 20_700_000, 11_700_000, round(11_700 / 20_700, 6))
    assert (p["runs_compared"], p["as_run_cost"], p["off_peak_cost"], p["saving"], p["runs_no_off_peak_start"]) == (
        2, 1650.0, 650.0, 1000.0, 0)
    assert st["cost"]["peak_totals"] == [{"unit": "USD-cent", "runs_compared": 2, "as_run_cost_scaled": 1650 * COST_SCALE,
                                          "as_run_cost": 1650.0, "off_peak_cost_scaled": 650 * COST_SCALE,
                                          "off_peak_cost": 650.0, "saving": 1000.0}]
    md = (out / "2026-11-02..2026-11-02" / f"{file_stem('a')}.md").read_text()
    assert "Started off-peak, the same runs would have cost 650.00 USD-cent instead of 1650.00 USD-cent" in md
    assert "| us-east1-a/h100 | USD-cent | 2 | 3.2 | 56.5% | 2 | 1650.00 | 650.00 | 1000.00 | 0 |" in md


def test_statement_counts_runs_without_an_off_peak_start_never_at_zero(tmp_path):
    from analytics.views import connect
    from chipledger.reports.statements import compute_statements, parse_period

    lake, _ = _run(tmp_path, _full_pool(before=True))
    [st] = compute_statements(connect(lake), parse_period("2026-11-02..2026-11-02"), teams=["b"])
    [p] = st["cost"]["peak"]
    assert (p["runs"], p["runs_compared"], p["as_run_cost"], p["off_peak_cost"], p["saving"],
            p["runs_no_off_peak_start"], p["cost"]) == (1, 0, None, None, None, 1, 3600.0)
    assert st["cost"]["peak_totals"] == []


def test_lake_upgrade_folds_run_costs_into_a_lake_without_them(tmp_path):
    """A committed lake whose manifest has no `run_costs` table (written before this version): readers say to run
    `lake upgrade`, which folds the events again and commits the table, with the rows the run wrote."""
    lake, _ = _run(tmp_path, _events())
    want, output = upgrade_a_lake_without(lake, "run_costs", "SELECT * FROM run_costs ORDER BY ALL")
    assert len(want) == 3
    assert "run_costs" in output


def test_the_run_cost_view_reads_the_facts_in_units(tmp_path):
    from analytics.views import connect

    lake, _ = _run(tmp_path, _events())
    rows = connect(lake).execute("SELECT job_id, flavor, chips, chip_h, peak_chip_h, cost, moved_earlier_s, "
                                 "off_peak_cost, saving FROM run_cost ORDER BY ended_at").fetchall()
    assert rows == [("jc", "h100", 1.0, 1.75, 0.25, 250.0, 0, 250.0, 0.0),
                    ("jb", "h100", 3.0, 1.0, 1.0, 400.0, 3600, 100.0, 300.0),
                    ("j1", "h100", 2.0, 4.0, 3.0, 1400.0, 2 * H + 30 * MIN, 400.0, 1000.0)]


# versions as the fold keeps them: [price_id, per_chip_hour, unit, effective_from, effective_until, hours, set_at]
BASE = ["base", 100, "USD-cent", T0, None, None, T0]
DAY = ["day", 400, "USD-cent", T0, None, [10, 11], T0]          # dearer band: its hours are peak
NIGHT = ["night", 50, "USD-cent", T0, None, [26, 27], T0]       # cheaper band (Tuesday 02:00-04:00): not peak
SAME = ["same", 100, "USD-cent", T0, None, [10], T0]            # a band at the base price: not dearer, not peak
BILLING = ["bill", 7, "billing", T0, None, None, T0]


@pytest.mark.parametrize("versions, offset, want", [
    ([BASE, DAY], 2 * H, {"USD-cent": (400, True)}),                              # 10:00, in the dearer band
    ([BASE, DAY], H, {"USD-cent": (100, False)}),                                 # 09:00, the base price
    ([BASE, NIGHT], 2 * H, {"USD-cent": (100, False)}),                           # base hours beside a cheaper band
    ([BASE, NIGHT], 18 * H, {"USD-cent": (50, False)}),                           # Tuesday 02:00: the cheap band
    ([BASE, SAME], 2 * H, {"USD-cent": (100, False)}),
    ([NIGHT, DAY], 2 * H, {"USD-cent": (400, True)}),                             # bands only: dearer than the night's
    ([BASE, DAY, BILLING], 2 * H, {"USD-cent": (400, True), "billing": (7, False)}),  # per unit
    ([BASE, DAY], -H, {}),                                                        # before any price: none
    ([[*BASE[:4], T0 + H, None, T0], DAY], 2 * H, {"USD-cent": (400, False)}),    # the base ended: the band is the cheapest
])
def test_a_peak_second_is_a_band_dearer_than_the_cheapest_price_then(versions, offset, want):
    from ledger.costs import rates_at

    assert rates_at(versions, T0 + offset) == want


def test_a_preempted_run_with_a_chip_down_is_priced_piece_by_piece():
    """j (2 chips) runs 10:00–11:00 in the band (400), c2 down from 10:30: charged 2 chips for 30 min, then 1; as run
    400 × (1 + 0.5) = 600. Started at 09:00 (hour 9 had 4 free chips), the same pieces: 100 × (1 + 0.5) = 150."""
    from tests.test_evolve import chip_state, preempt

    events = [configured(-H), *[chip(c, -H) for c in CHIPS], price("std", 100), price("peak", 400, hours_of_week=[10]),
              submit("j", "a", 2, 2 * H), start("j", 2 * H, chip_ids=["c1", "c2"]), chip_state("c2", "down", 2 * H + 1800),
              preempt("j", 3 * H)]
    [row] = fold_costs(events)[0]
    assert row == RunCostRow("us-east1-a/h100", "j", "a", 1, 2000, T0 + 2 * H, T0 + 3 * H, "preempted", "USD-cent",
                             2000 * 1800 + 1000 * 1800, 2000 * 1800 + 1000 * 1800, 600 * COST_SCALE, T0 + H,
                             150 * COST_SCALE)
    assert fold_costs(events, pause_at=len(events) - 2)[0] == [row]  # its pieces survive a restart from the saved state
