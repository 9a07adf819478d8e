"""`chipledger report`: the SLO summary over the lake's views, as rich tables and, on request, as charts (PNG)
and one HTML page (the same charts inline as SVG, and the same tables).

Everything shown comes from the views of analytics/ (error_budget, burn_alerts, slo_capacity,
slo_quota_honoured, calc_waits through the scheduling-latency SQL, job runs, fragmentation, demand_shaping,
demand_peak_teams, journal); this module only filters by pool and period and formats.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import duckdb
from rich.console import Console
from rich.table import Table

from chipledger.reports.tables import print_table

from analytics.slo_views import sched_latency_sql
from chipledger.reports import charts

DAY_NAMES = charts.DAYS


@dataclass
class Section:
    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""
    marks: dict = field(default_factory=dict)  # (row, column) -> "bad" | "warn": missed SLOs, negative budgets
    summary: bool = False                      # shown first in the HTML page, before the charts


@dataclass
class Report:
    title: str
    subtitle: str
    sections: list[Section] = field(default_factory=list)
    capacity_hours: list[datetime] = field(default_factory=list)
    capacity_chips: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # pool -> account -> chips
    latency_labels: list[str] = field(default_factory=list)
    latency_p: tuple[list, list, list] = ([], [], [])
    heatmap: list[list[Optional[float]]] = field(default_factory=list)  # the one pool's (a --pool report), else empty
    # per pool: chips of unlike pools (A100, H100, TPU) are never added up, so one heat map each
    heatmaps: dict[str, list[list[Optional[float]]]] = field(default_factory=dict)
    sched_slo_s: int = 600
    firing_pages: int = 0


class Cell(str):
    """A cell as shown (a str, for tables and the page) that keeps the typed value it shows (`value`: a number, a
    fraction for a percentage, None for "–", or a dict for a composite such as good / total), for `--json`."""

    value: object

    def __new__(cls, text: str, value: object):
        cell = super().__new__(cls, text)
        cell.value = value
        return cell


def typed(cell):
    """What `report --json` holds for a cell: its typed value (numbers as numbers, fractions for percentages)."""
    return cell.value if isinstance(cell, Cell) else (None if cell == "–" else cell)


def pct(v: Optional[float], digits: int = 2) -> str:
    return Cell("–" if v is None else f"{100 * v:.{digits}f}%", None if v is None else float(v))


def num(v, digits: int = 1) -> str:
    if v is None:
        return Cell("–", None)
    return Cell(f"{v:,.{digits}f}" if isinstance(v, float) else f"{v:,}", v)


def _epoch(t: Optional[datetime]) -> Optional[int]:
    return None if t is None else int(t.timestamp())


def parse_instant(text: str) -> datetime:
    """An ISO 8601 date or instant; without a zone it is UTC."""
    t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: dict) -> list[tuple]:
    used = {k: v for k, v in params.items() if f"${k}" in sql}
    return con.execute(sql, used).fetchall()


def build_report(con: duckdb.DuckDBPyConnection, pool: Optional[str] = None, since: Optional[datetime] = None,
                 until: Optional[datetime] = None) -> Report:
    """Query the views of `con` (analytics.views.connect, with `as_of=until` so the error budgets end there)."""
    p = {"pool": pool, "since": _epoch(since), "until": _epoch(until)}
    in_pool = "($pool IS NULL OR pool = $pool)"
    as_of_s = con.execute("SELECT as_of_s FROM calc_now").fetchone()  # none: a lake without events
    as_of_s = as_of_s[0] if as_of_s else None
    sched_slo_s, window_days = con.execute("SELECT sched_slo_s, window_days FROM slo_settings").fetchone()
    as_of = "–" if as_of_s is None else datetime.fromtimestamp(as_of_s, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    period = f"{since:%Y-%m-%d %H:%M} … " if since else "start of the log … "
    period += f"{until:%Y-%m-%d %H:%M} UTC" if until else "end of the log"
    rep = Report(title=f"SLO report — {pool or 'all pools'}", subtitle=f"period {period}; error budgets: "
                 f"{window_days} days to {as_of}", sched_slo_s=int(sched_slo_s or 600))

    # error budgets: the pool's rows, or the fleet's (pool null) when no pool is chosen
    budget = _rows(con, """
        SELECT slo, target, sli, good, total, unit, consumed, remaining FROM error_budget
        WHERE CASE WHEN $pool IS NULL THEN pool IS NULL ELSE pool = $pool END ORDER BY slo""", p)
    marks = {}
    for i, (_, t, sli, _, _, _, _, r) in enumerate(budget):
        if sli is not None and t is not None and sli < t:
            marks[i, 2] = "bad"
        if r is not None and r < 0:
            marks[i, 5] = "bad"
    budget_rows = [[slo, pct(t), pct(sli, 3), Cell(f"{num(g, 0)} / {num(tot, 0)} {unit}",
                                                   {"good": g, "total": tot, "unit": unit}), pct(c, 1), pct(r, 1)]
                   for slo, t, sli, g, tot, unit, c, r in budget]
    if budget and not any(b[0] == "throughput" for b in budget):  # said, not left out: no job reported progress
        target = con.execute("SELECT target FROM slo_targets WHERE slo = 'throughput'").fetchone()[0]
        budget_rows.append(["throughput", pct(target), "–", "no progress reported", "–", "–"])
    rep.sections.append(Section(
        f"Error budgets (rolling {window_days} days to {as_of})",
        ["SLO", "target", "attained", "good / total", "budget consumed", "budget left"],
        budget_rows, marks=marks, summary=True))

    alerts = _rows(con, f"""
        SELECT severity, alert, slo, pool, coalesce(team, ''), burn_rate, long_win, long_burn, short_win, short_burn
        FROM burn_alerts WHERE firing AND {in_pool} ORDER BY severity, alert, slo, pool, team NULLS FIRST""", p)
    rep.firing_pages = sum(1 for a in alerts if a[0] == "page")
    rep.sections.append(Section(
        "Burn-rate alerts firing",
        ["severity", "alert", "SLO", "pool", "team", "threshold", "long window", "short window"],
        [[sev, alert, slo, pl, tm, Cell(f"{rate:g}×", rate), Cell(f"{lw}: {lb:.1f}×", {"window": lw, "burn": lb}),
          Cell(f"{sw}: {sb:.1f}×", {"window": sw, "burn": sb})]
         for sev, alert, slo, pl, tm, rate, lw, lb, sw, sb in alerts],
        note="" if alerts else "none", summary=True,
        marks={(i, 0): "bad" if a[0] == "page" else "warn" for i, a in enumerate(alerts)}))

    days = _rows(con, f"""
        SELECT day, pool, registered_mchip_s / 3.6e6, healthy_mchip_s / 3.6e6, availability FROM slo_capacity
        WHERE {in_pool} AND ($since IS NULL OR epoch(day) + 86400 > $since) AND ($until IS NULL OR epoch(day) < $until)
        ORDER BY day, pool""", p)
    rep.sections.append(Section("Availability by day", ["day", "pool", "registered chip-h", "available chip-h",
                                                        "availability"],
                                [[str(d), pl, num(r), num(h), pct(a, 3)] for d, pl, r, h, a in days],
                                note="" if days else "no chips registered in the period"))

    honoured = _rows(con, f"""
        SELECT pool, team, sum(in_quota_submissions), sum(honoured), sum(late), sum(open),
               sum(honoured) / nullif(sum(honoured) + sum(late), 0), any_value(target)
        FROM slo_quota_honoured
        WHERE {in_pool} AND ($since IS NULL OR epoch(day) + 86400 > $since) AND ($until IS NULL OR epoch(day) < $until)
        GROUP BY pool, team ORDER BY pool, team""", p)
    rep.sections.append(Section(
        f"Quota honoured (in-quota submissions started within {rep.sched_slo_s} s)",
        ["pool", "team", "in-quota submissions", "honoured", "late", "open", "attained", "target"],
        [[pl, tm, num(n), num(h), num(lt), num(o), pct(a), pct(t)] for pl, tm, n, h, lt, o, a, t in honoured],
        note="" if honoured else "no in-quota submissions in the period",
        marks={(i, 6): "bad" for i, r in enumerate(honoured) if r[6] is not None and r[7] is not None
               and r[6] < r[7]}))

    where = (f"{in_pool} AND ($since IS NULL OR since_s >= $since) AND ($until IS NULL OR since_s < $until)")
    latency = _rows(con, f"SELECT * FROM ({sched_latency_sql(where)}) ORDER BY pool, priority DESC, quota_class", p)
    rep.sections.append(Section(
        "Scheduling latency (seconds)",
        ["pool", "priority", "class", "waits", "first starts", "restarts", "p50", "p90", "p99", "max",
         f"within {rep.sched_slo_s} s"],
        [[pl, Cell(str(pr), pr), qc, num(w), num(fs), num(rs), num(a), num(b), num(c), num(m), pct(ws)]
         for pl, pr, qc, w, fs, rs, a, b, c, m, ws in latency],
        note="" if latency else "no job started in the period"))
    rep.latency_labels = [f"{pl} · prio {pr} · {qc}" for pl, pr, qc, *_ in latency]
    rep.latency_p = ([r[6] for r in latency], [r[7] for r in latency], [r[8] for r in latency])

    goodput = _rows(con, f"""
        SELECT pool, team, sum(allocated_mchip_s) / 3.6e6, sum(lost_mchip_s) / 3.6e6,
               (sum(allocated_mchip_s) - sum(lost_mchip_s)) / nullif(sum(allocated_mchip_s), 0),
               (SELECT target FROM slo_targets WHERE slo = 'goodput')
        FROM base_runs
        WHERE ended_s IS NOT NULL AND {in_pool} AND ($since IS NULL OR ended_s >= $since)
          AND ($until IS NULL OR ended_s < $until)
        GROUP BY pool, team ORDER BY pool, team""", p)
    rep.sections.append(Section("Goodput of the runs that ended in the period",
                                ["pool", "team", "allocated chip-h", "lost chip-h", "goodput", "target"],
                                [[pl, tm, num(a), num(lo), pct(g), pct(t)] for pl, tm, a, lo, g, t in goodput],
                                note="" if goodput else "no run ended in the period",
                                marks={(i, 4): "bad" for i, r in enumerate(goodput)
                                       if r[4] is not None and r[5] is not None and r[4] < r[5]}))

    rep.sections.append(throughput_section(con, p, in_pool))

    clip_lo = "greatest(from_s, coalesce($since, from_s))"
    clip_hi = "least(until_s, coalesce($until, until_s))"
    frag = _rows(con, f"""
        WITH f AS (
            SELECT pool, free_milli / 1000.0 AS free_chips, free_whole_nodes_milli / 1000.0 AS whole_node_free_chips,
                   largest_startable_milli / 1000.0 AS largest_chips, free_whole_nodes_milli IS NOT NULL AS known,
                   greatest(0, {clip_hi} - {clip_lo}) AS s FROM calc_free_steps WHERE {in_pool}
        )
        SELECT pool, sum(s) FILTER (WHERE known) / 3600.0 AS known_h, sum(s) / 3600.0 AS total_h,
               sum(s * (free_chips - whole_node_free_chips)) FILTER (WHERE known AND free_chips > 0)
                 / nullif(sum(s * free_chips) FILTER (WHERE known AND free_chips > 0), 0),
               min(largest_chips) FILTER (WHERE known AND s > 0),
               sum(s * free_chips) / nullif(sum(s), 0)
        FROM f GROUP BY pool HAVING sum(s) > 0 ORDER BY pool""", p)
    rep.sections.append(Section(
        "Fragmentation (free chips not on whole free nodes)",
        ["pool", "hours with placement known", "fragmented share of free chips", "smallest largest-job (chips)",
         "mean free chips"],
        [[pl, Cell(f"{num(k)} of {num(t)}", {"count": k, "of": t}), pct(fr, 1), num(mn, 0), num(mf)]
         for pl, k, t, fr, mn, mf in frag],
        note="" if frag else "no chip placement in the period"))

    hol = _rows(con, f"""
        SELECT pool, team, jobs_affected, blocked_chip_h, top_blockers FROM hol_blocking WHERE {in_pool}
        ORDER BY blocked_mchip_s DESC, pool, team LIMIT 10""", p)
    rep.sections.append(Section(
        "Head-of-line blocking (whole history: jobs that could have started and did not)",
        ["pool", "team", "jobs affected", "blocked chip-h", "waiting jobs ahead that held the chips"],
        [[pl, tm, num(n), num(h), bl or "–"] for pl, tm, n, h, bl in hol],
        note="" if hol else "none: every job that could start did"))

    peaks = _rows(con, f"""
        SELECT pool, max(peak_to_average),
               string_agg(printf('%s %02d:00', ['Mon','Tue','Wed','Thu','Fri','Sat','Sun'][day_of_week + 1],
                                 hour_of_day), ', ' ORDER BY demand_chips DESC) FILTER (WHERE pool_peak),
               count(*) FILTER (WHERE offpeak_idle),
               sum(idle_chips) FILTER (WHERE offpeak_idle) / nullif(count(*) FILTER (WHERE offpeak_idle), 0)
        FROM demand_shaping WHERE team IS NULL AND {in_pool} GROUP BY pool ORDER BY pool""", p)
    drivers = {}
    for pl, team, share in _rows(con, f"SELECT pool, team, share_of_peak FROM demand_peak_teams "
                                      f"WHERE {in_pool} AND rank <= 3 ORDER BY pool, rank", p):
        drivers.setdefault(pl, []).append(Cell(f"{team} {pct(share, 0)}", {"team": team, "share": share}))
    rep.sections.append(Section(
        "Demand shaping (hour of week, whole history)",
        ["pool", "peak / average", "peak hours (UTC)", "teams driving the peaks", "off-peak hours with idle chips",
         "mean idle chips then"],
        [[pl, num(pta, 2), _shorten(hours or "–"), Cell(", ".join(drivers.get(pl, [])) or "–", [d.value for d in drivers.get(pl, [])]), num(n), num(idle)]
         for pl, pta, hours, n, idle in peaks],
        note="" if peaks else "no demand recorded"))

    # cost (the fold's priced postings, ledger/costs.py): per pool and unit, the teams' use, idle and unavailable
    # chips; totals per unit only (money or billing units are the only totals across unlike chips)
    costs = _rows(con, f"""
        SELECT pool, unit,
               sum(cost_scaled::HUGEINT) FILTER (WHERE account IN ('in_quota', 'borrowed', 'burst')) / 3.6e6,
               sum(cost_scaled::HUGEINT) FILTER (WHERE account = 'idle') / 3.6e6,
               sum(cost_scaled::HUGEINT) FILTER (WHERE account = 'unavailable') / 3.6e6,
               sum(cost_scaled::HUGEINT) / 3.6e6
        FROM cost_postings
        WHERE {in_pool}
          AND ($since IS NULL OR epoch(hour) + 3600 > $since) AND ($until IS NULL OR epoch(hour) < $until)
        GROUP BY ALL ORDER BY ALL""", p)
    units: dict = {}
    for _, unit, _, _, _, total in costs:
        units[unit] = units.get(unit, 0) + (total or 0)
    rep.sections.append(Section(
        "Cost (priced by the fold; idle and unavailable are the pool's)",
        ["pool", "unit", "teams' use", "idle", "unavailable", "total"],
        [[pl, u, num(float(a or 0), 2), num(float(i or 0), 2), num(float(n or 0), 2), num(float(t), 2)]
         for pl, u, a, i, n, t in costs]
        + [["(total)", u, "", "", "", num(v, 2)] for u, v in sorted(units.items())],
        note="" if costs else "no price set (price.set): cost unknown, not zero"))
    budgets = _rows(con, """
        SELECT team, period, strftime(period_start, '%Y-%m-%d'), unit, budget, spent, "left", forecast_end
        FROM budget WHERE epoch(period_start) <= (SELECT as_of_s FROM calc_now)
          AND epoch(period_end) > (SELECT as_of_s FROM calc_now) ORDER BY ALL""", {})
    if budgets:
        sec = Section("Budgets (current period, all pools)",
                      ["team", "period", "from", "unit", "budget", "spent", "left", "forecast at end"],
                      [[tm, per, st, u, num(b, 0), num(sp, 2), num(lf, 2), num(fc, 2)]
                       for tm, per, st, u, b, sp, lf, fc in budgets])
        for i, row in enumerate(budgets):
            if row[6] < 0:
                sec.marks[(i, 6)] = "bad"
            elif row[7] > row[4]:
                sec.marks[(i, 7)] = "warn"
        rep.sections.append(sec)

    # charts: capacity by account, hourly; the latency bars above; the demand heat map
    # per pool: chips of different pools (an H100, a TPU core) are never added on one axis
    cap = _rows(con, f"""
        SELECT pool, hour, account, sum(amount_mchip_s) / 3.6e6 FROM journal
        WHERE {in_pool} AND account IN ('in_quota', 'borrowed', 'burst', 'idle', 'unavailable', 'overcommitted')
          AND ($since IS NULL OR epoch(hour) + 3600 > $since) AND ($until IS NULL OR epoch(hour) < $until)
        GROUP BY ALL ORDER BY hour""", p)
    hours = sorted({h for _, h, _, _ in cap})
    index = {h: i for i, h in enumerate(hours)}
    series: dict[str, dict[str, list[float]]] = {}
    for pl, h, account, chips in cap:
        series.setdefault(pl, {}).setdefault(account, [0.0] * len(hours))[index[h]] = chips
    rep.capacity_hours, rep.capacity_chips = hours, series
    heat = _rows(con, f"""
        SELECT pool, day_of_week, hour_of_day, demand_chips FROM demand_shaping
        WHERE team IS NULL AND {in_pool} ORDER BY pool""", p)
    for pl, d, h, v in heat:
        rep.heatmaps.setdefault(pl, [[None] * 24 for _ in range(7)])[d][h] = v
    if len(rep.heatmaps) == 1:
        rep.heatmap = next(iter(rep.heatmaps.values()))
    return rep


NO_PROGRESS = ("no job reported progress in the period: the throughput SLO needs job.progress events (or "
               "job.checkpointed with units); the importers and clusters that send none leave it empty")


def throughput_rows(con: duckdb.DuckDBPyConnection, p: dict, where: str) -> list[tuple]:
    """Per pool and team, of the progress intervals that ended in the period and satisfy `where`: jobs reporting,
    judged chip-hours, slow chip-hours, slow seconds, attainment, target, and the unhealthy chips held while slow
    (the 3 with the most slow chip-seconds, "chip:state"). Chip-seconds and seconds only: units are never added
    across jobs."""
    period = f"{where} AND ($since IS NULL OR ended_s >= $since) AND ($until IS NULL OR ended_s < $until)"
    rows = _rows(con, f"""
        SELECT pool, team, count(DISTINCT (job_id, submitted_s)),
               coalesce(sum(charged_mchip_s) FILTER (WHERE slow IS NOT NULL), 0) / 3.6e6,
               coalesce(sum(charged_mchip_s) FILTER (WHERE slow), 0) / 3.6e6, coalesce(sum(slow_s), 0),
               1 - coalesce(sum(charged_mchip_s) FILTER (WHERE slow), 0)
                   / nullif(sum(charged_mchip_s) FILTER (WHERE slow IS NOT NULL), 0),
               (SELECT target FROM slo_targets WHERE slo = 'throughput')
        FROM base_progress WHERE {period} GROUP BY pool, team ORDER BY pool, team""", p)
    causes: dict = {}
    for pl, tm, chip in _rows(con, f"""
            WITH c AS (
                SELECT pool, team, unnest(string_split(unhealthy_chips, ',')) AS chip, charged_mchip_s
                FROM base_progress WHERE slow AND unhealthy_chips <> '' AND {period}
            ), r AS (
                SELECT pool, team, chip, row_number() OVER (PARTITION BY pool, team
                                                            ORDER BY sum(charged_mchip_s) DESC, chip) AS rk
                FROM c GROUP BY pool, team, chip
            )
            SELECT pool, team, chip FROM r WHERE rk <= 3 ORDER BY pool, team, rk""", p):
        causes.setdefault((pl, tm), []).append(chip)
    return [(*r, ", ".join(causes.get((r[0], r[1]), []))) for r in rows]


def throughput_section(con: duckdb.DuckDBPyConnection, p: dict, in_pool: str) -> Section:
    rows = throughput_rows(con, p, in_pool)
    return Section(
        "Throughput of running jobs (share of judged chip time at or above [slo] throughput_fraction of the job's "
        "reference rate)",
        ["pool", "team", "jobs reporting", "judged chip-h", "slow chip-h", "slow s", "attained", "target",
         "unhealthy chips held while slow"],
        [[pl, tm, num(n), num(j), num(sl), num(s), pct(a), pct(t), c or "–"] for pl, tm, n, j, sl, s, a, t, c in rows],
        note="" if rows else NO_PROGRESS,
        marks={(i, 6): "bad" for i, r in enumerate(rows) if r[6] is not None and r[7] is not None and r[6] < r[7]})


def _shorten(text: str, n: int = 6) -> str:
    parts = text.split(", ")
    return ", ".join(parts[:n]) + (f" (+{len(parts) - n})" if len(parts) > n else "")


def print_report(rep: Report, console: Console) -> None:
    console.print(f"[bold]{rep.title}[/]")
    console.print(rep.subtitle, highlight=False)
    for s in rep.sections:
        t = Table(title=s.title, title_justify="left", title_style="bold")
        for i, c in enumerate(s.columns):
            t.add_column(c, justify="left" if i < 2 else "right")
        for r in s.rows:
            t.add_row(*r)
        if s.rows:
            print_table(t, console)
        else:
            console.print(f"[bold]{s.title}[/]: {s.note}", highlight=False)


def write_report(rep: Report, out: Path) -> list[Path]:
    """capacity.png, latency.png, demand_heatmap.png and report.html (the charts inline as SVG, and the
    tables) in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "capacity": ("Capacity by account and pool (chips, hourly mean)",
                     charts.capacity_charts(rep.capacity_hours, rep.capacity_chips)),
        "latency": ("Scheduling latency percentiles",
                    charts.latency_chart(rep.latency_labels, *rep.latency_p, threshold_s=rep.sched_slo_s)),
        "demand_heatmap": ("Demand by hour of week per pool (running + pending chips, mean)",
                           charts.heatmap_charts(rep.heatmaps)),
    }
    written = [charts.save_png(fig, out / f"{name}.png") for name, (_, fig) in figures.items()]
    def block(s: Section):
        return (s.title, charts.html_table(s.columns, s.rows, s.marks) if s.rows
                else f"<p>{html.escape(s.note)}</p>")

    # the summary (error budgets, alerts firing) first, then the charts, then the details
    blocks = [block(s) for s in rep.sections if s.summary]
    blocks += [(title, charts.svg_text(fig)) for title, fig in figures.values()]
    blocks += [block(s) for s in rep.sections if not s.summary]
    page = out / "report.html"
    page.write_text(charts.html_page(rep.title, blocks, rep.subtitle), encoding="utf-8")
    written.append(page)
    return written
