"""Cost and budget views (DESIGN §9; docs/statements.md "Cost", docs/policy.md "Prices, budgets and bands").

The fold prices every journal posting (ledger/costs.py) and writes the `costs` facts (raw view `cost_postings`):
these views only sum them. Cost stays exact as `cost_scaled` (1/3,600,000 of the price's unit, integers summed as
HUGEINT); `cost` is the same in the unit, for people. A journal row with no price in effect has no cost row: its
`cost` is NULL (unknown), never zero. Chip-hours of unlike flavors are never added here: totals across pools are
in money or billing units only (a `unit`).

- `cost`: per pool, flavor, hour, account (in_quota, borrowed, burst, idle, unavailable), team and unit.
- `run_cost`: each run of a priced pool as it ended, per unit (the fold's `run_costs` facts, ledger/costs.py):
  cost as run, peak chip-hours, the off-peak start and the cost started there, the saving; NULL where unknown.
- `budget`: per team, period (month | quarter, UTC), period start and unit: the budget (the sum over pools of
  each pool's budgets in effect in the period: a budget id set again replaces its earlier setting), spent (the
  team's in_quota + borrowed + burst cost in the period), left, the share of the period elapsed at the evaluation
  instant (`calc_now`), and the forecast of the period's end at the period's rate so far.
- `budget_burn`: per team, unit and window (1 h, 6 h, 1 d, 3 d ending at the evaluation instant): burn rate = the
  window's spend rate / the budget's rate (budget / the current period's length); an hour's cost counts by its
  share inside the window.
- `budget_alerts`: the SLO burn alerts' shape (severity, alert, slo = 'budget', pool = '*', burn_rate, long_win,
  long_burn, short_win, short_burn, target, evaluated_at, firing) plus team, unit, period, spent, budget and
  forecast: `budget_page` (1 d and 1 h both burn ≥ 2×), `budget_ticket` (3 d and 6 h both ≥ 1×: at this rate the
  budget is spent before the period ends). `chipledger slo rules` gives Prometheus the same rules.
"""

from __future__ import annotations

COST_SCALE = 3_600_000  # ledger.costs.COST_SCALE (the core is not imported by analytics' views)

COST_RAW_VIEW_NAMES = {"costs": "cost_postings"}

# the budget alert rules: (alert, severity, burn rate, long window, short window)
# (chipledger/monitoring/slo_rules.py gives Prometheus the same rules over the same windows)
BUDGET_RULES = (("budget_page", "page", 2.0, "1d", "1h"), ("budget_ticket", "ticket", 1.0, "3d", "6h"))
BUDGET_WINDOWS_S = {"1h": 3600, "6h": 6 * 3600, "1d": 86400, "3d": 3 * 86400}

_PERIOD_END = ("CASE b.period WHEN 'month' THEN p.period_start + INTERVAL 1 MONTH "
               "ELSE p.period_start + INTERVAL 3 MONTH END")

COST_VIEWS: dict[str, str] = {
    # each pool's flavor, from its last pool.configured
    "pool_flavors": """
        SELECT pool, arg_max(json_extract_string(body, '$.flavor'), applied_at) AS flavor
        FROM event_log WHERE type = 'pool.configured' GROUP BY pool
    """,
    "cost": f"""
        WITH c AS (
            SELECT pool, hour, account, team, unit, sum(amount_mchip_s)::BIGINT AS priced_mchip_s,
                   sum(cost_scaled::HUGEINT) AS cost_scaled, arg_max(price_id, per_chip_hour) AS price_id
            FROM cost_postings GROUP BY ALL
        ), j AS (
            SELECT pool, hour, account, team, sum(amount_mchip_s)::BIGINT AS amount_mchip_s
            FROM journal_postings WHERE account IN ('in_quota', 'borrowed', 'burst', 'idle', 'unavailable')
            GROUP BY ALL
        )
        SELECT j.pool, f.flavor, j.hour, j.account, j.team, j.amount_mchip_s, j.amount_mchip_s / 3600000.0 AS chip_h,
               c.unit, c.cost_scaled, c.cost_scaled / {COST_SCALE}.0 AS cost, c.priced_mchip_s
        FROM j LEFT JOIN c ON c.pool = j.pool AND c.hour = j.hour AND c.account = j.account
                            AND c.team IS NOT DISTINCT FROM j.team
               LEFT JOIN pool_flavors f ON f.pool = j.pool
    """,
    # each run of a priced pool as it ended, per unit (the fold's `run_costs` facts), in the unit and in chip-hours:
    # its cost as run, its peak chip-hours, and its cost started at its off-peak start (ledger/costs.py run_ended);
    # NULL where the fold wrote none (a second without a price; no off-peak start with room), never 0
    "run_cost": f"""
        SELECT r.pool, f.flavor, r.job_id, r.team, r.run_index, r.chips_milli / 1000.0 AS chips, r.started_at,
               r.ended_at, r.end_reason, r.unit, r.allocated_mchip_s / 3600000.0 AS chip_h,
               r.peak_mchip_s / 3600000.0 AS peak_chip_h, r.cost_scaled / {COST_SCALE}.0 AS cost, r.off_peak_at,
               (epoch(r.started_at) - epoch(r.off_peak_at))::BIGINT AS moved_earlier_s,
               r.off_peak_cost_scaled / {COST_SCALE}.0 AS off_peak_cost,
               (r.cost_scaled - r.off_peak_cost_scaled) / {COST_SCALE}.0 AS saving
        FROM run_costs r LEFT JOIN pool_flavors f ON f.pool = r.pool
    """,
    # the periods a budget applies to: each month or quarter from the budget's start to the evaluation instant
    "budget": f"""
        WITH now AS (SELECT to_timestamp(as_of_s) AS now_at, as_of_s FROM calc_now),
        b AS (SELECT * FROM budgets),
        p0 AS (SELECT team, period, unit, min(effective_from) AS first_at FROM b GROUP BY ALL),
        p AS (
            SELECT team, period, unit,
                   unnest(generate_series(date_trunc(period, first_at), date_trunc(period, now_at),
                                          CASE period WHEN 'month' THEN INTERVAL 1 MONTH ELSE INTERVAL 3 MONTH END))
                       AS period_start
            FROM p0 CROSS JOIN now
        ), eff AS (
            -- per pool and budget id, the setting in effect for the period: the last one set that starts before
            -- the period's end
            SELECT p.team, p.period, p.unit, p.period_start, {_PERIOD_END} AS period_end, b.pool, b.budget_id,
                   arg_max(b.amount, b.set_at) AS amount
            FROM p JOIN b ON b.team = p.team AND b.period = p.period AND b.unit = p.unit
                         AND b.effective_from < {_PERIOD_END}
            GROUP BY ALL
        ), amounts AS (
            SELECT team, period, unit, period_start, period_end, sum(amount)::BIGINT AS budget,
                   count(DISTINCT pool) AS pools
            FROM eff GROUP BY ALL
        ), spent AS (
            SELECT a.team, a.period, a.unit, a.period_start, sum(c.cost_scaled::HUGEINT) AS spent_scaled
            FROM amounts a JOIN cost_postings c ON c.team = a.team AND c.unit = a.unit
                 AND c.hour >= a.period_start AND c.hour < a.period_end
                 AND c.account IN ('in_quota', 'borrowed', 'burst')
            GROUP BY ALL
        )
        SELECT a.team, a.period, a.period_start, a.period_end, a.unit, a.budget, a.pools,
               coalesce(s.spent_scaled, 0) / {COST_SCALE}.0 AS spent,
               a.budget - coalesce(s.spent_scaled, 0) / {COST_SCALE}.0 AS "left",
               coalesce(s.spent_scaled, 0) AS spent_scaled,
               greatest(1, least(now.as_of_s, epoch(a.period_end)) - epoch(a.period_start))
                   / (epoch(a.period_end) - epoch(a.period_start)) AS elapsed_share,
               coalesce(s.spent_scaled, 0) / {COST_SCALE}.0
                   / (greatest(1, least(now.as_of_s, epoch(a.period_end)) - epoch(a.period_start))
                      / (epoch(a.period_end) - epoch(a.period_start))) AS forecast_end,
               now.now_at AS evaluated_at
        FROM amounts a LEFT JOIN spent s USING (team, period, unit, period_start) CROSS JOIN now
    """,
    # the current period's burn per window ending at the evaluation instant: (the team's spend in the window / its
    # length) / (budget / the period's length). An hour's cost rows count by the share of the hour inside the window
    # (spread evenly over the hour), as Prometheus' rate() over the counter of /metrics sees it
    "budget_burn": f"""
        WITH now AS (SELECT as_of_s FROM calc_now),
        cur AS (
            SELECT b.* FROM budget b CROSS JOIN now
            WHERE epoch(b.period_start) <= now.as_of_s AND now.as_of_s < epoch(b.period_end)
        ), wins AS ({" UNION ALL ".join(f"SELECT '{k}' AS win, {v} AS len_s" for k, v in BUDGET_WINDOWS_S.items())}),
        w AS (SELECT cur.*, wins.win, wins.len_s, now.as_of_s - wins.len_s AS from_s, now.as_of_s
              FROM cur CROSS JOIN wins CROSS JOIN now),
        s AS (
            SELECT w.team, w.unit, w.period, w.win, any_value(w.len_s) AS len_s, any_value(w.budget) AS budget,
                   any_value(w.period_start) AS period_start, any_value(w.period_end) AS period_end,
                   coalesce(sum(c.cost_scaled::HUGEINT
                                * (least(epoch(c.hour)::BIGINT + 3600, w.as_of_s)
                                   - greatest(epoch(c.hour)::BIGINT, w.from_s)) / 3600.0), 0) AS spent_scaled
            FROM w LEFT JOIN cost_postings c ON c.team = w.team AND c.unit = w.unit
                 AND epoch(c.hour) + 3600 > w.from_s AND epoch(c.hour) < w.as_of_s
                 AND c.account IN ('in_quota', 'borrowed', 'burst')
            GROUP BY w.team, w.unit, w.period, w.win
        )
        SELECT team, unit, period, period_start, win, spent_scaled / {COST_SCALE}.0 AS spent, budget,
               CASE WHEN budget > 0 THEN (spent_scaled / {COST_SCALE}.0 / len_s)
                    / (budget / (epoch(period_end) - epoch(period_start))) END AS burn
        FROM s
    """,
    "budget_alerts": f"""
        WITH rules AS ({" UNION ALL ".join(
            f"SELECT '{a}' AS alert, '{s}' AS severity, {r} AS burn_rate, '{lw}' AS long_win, '{sw}' AS short_win"
            for a, s, r, lw, sw in BUDGET_RULES)}),
        keys AS (SELECT DISTINCT team, unit, period, period_start FROM budget_burn), b AS (
            SELECT r.severity, r.alert, 'budget' AS slo, '*' AS pool, r.burn_rate, r.long_win,
                   (SELECT burn FROM budget_burn x WHERE x.team = k.team AND x.unit = k.unit AND x.period = k.period
                    AND x.win = r.long_win) AS long_burn,
                   r.short_win,
                   (SELECT burn FROM budget_burn x WHERE x.team = k.team AND x.unit = k.unit AND x.period = k.period
                    AND x.win = r.short_win) AS short_burn,
                   1.0 AS target, k.team, k.unit, k.period, k.period_start
            FROM rules r CROSS JOIN keys k
        )
        SELECT b.severity, b.alert, b.slo, b.pool, b.burn_rate, b.long_win, b.long_burn, b.short_win, b.short_burn,
               b.target, g.evaluated_at, b.team, b.unit, b.period, g.spent, g.budget, g.forecast_end,
               coalesce(b.long_burn >= b.burn_rate AND b.short_burn >= b.burn_rate, false) AS firing
        FROM b JOIN budget g ON g.team = b.team AND g.unit = b.unit AND g.period = b.period
                             AND g.period_start = b.period_start
    """,
}
