"""`chipledger demo`: a seeded fleet scenario, run end to end on the embedded default, summarized.

The scenario (chipledger.sim.scenario) has several pools of different chips, ten teams with quotas, diurnal
demand, bursts of submissions, chip failures and repairs, checkpoints and failing jobs; its training jobs
report their progress, slowed down by the few chips that degrade (the throughput SLO); a few deliberately
bad lines show the dead-letter path.

The simulated cluster acts on the ledger's decisions, as a real one would through `chipledger slurm actuate`
or a Kueue controller: while the scenario is generated, each event is folded at once by the ledger core
(`LedgerLoop`), and the decisions it makes go back to the cluster, which preempts the victims naming the
decision and runs a burst's jobs only for the chips granted. The demo fleet is loaded and fails as a fleet
that mostly keeps its SLOs (DEMO_LOAD, DEMO_FAILURE_SCALE), so bursts are approved, cut and denied.
"""

from __future__ import annotations

import json
from pathlib import Path

import orjson

from rich.console import Console
from rich.table import Table

from chipledger.reports.tables import print_table

from analytics.views import connect
from chipledger.embedded import run_file
from chipledger.sim.scenario import corrupt, generate
from ledger import Fleet, FoldConfig
from store import open_store
from schemas import Rejection, parse_event

ACCOUNT_ORDER = ("capacity", "unavailable", "idle", "overcommitted", "in_quota", "borrowed", "burst")

POOL_SUMMARY_SQL = """
SELECT pool,
       {cols}
FROM journal WHERE team IS NULL OR account <> 'entitled'
GROUP BY pool ORDER BY pool
"""

TEAM_SUMMARY_SQL = """
SELECT pool, team,
       sum(amount_mchip_s) FILTER (WHERE account = 'entitled') / 3.6e6 AS quota_chip_h,
       sum(amount_mchip_s) FILTER (WHERE account IN ('in_quota', 'borrowed', 'burst')) / 3.6e6 AS used_chip_h,
       sum(amount_mchip_s) FILTER (WHERE account = 'borrowed') / 3.6e6 AS borrowed_chip_h
FROM journal WHERE team IS NOT NULL
GROUP BY pool, team ORDER BY pool, team
"""


# the demo fleet: offered load as a share of capacity, and chip failure/maintenance rates against the
# scenario's defaults (a chip down every 60 days): a busy fleet that mostly keeps its SLOs
DEMO_LOAD = 0.45
DEMO_FAILURE_SCALE = 0.5


class LedgerLoop:
    """The ledger core folding the scenario's events as the cluster emits them, handing each event's
    decisions back (as the JSON dicts of chipledger.decisions). The embedded run of the written file folds
    the same events again and so makes the same decisions, with the same ids."""

    def __init__(self, fold_config: FoldConfig = FoldConfig()):
        self.fleet = Fleet(fold_config)
        self.decisions = 0

    def __call__(self, ev: dict) -> list[dict]:
        raw = json.dumps(ev, separators=(",", ":")).encode()
        event = parse_event(raw)
        if isinstance(event, Rejection):
            return []
        step = self.fleet.apply(event, raw)
        if step.rejection is not None or not step.decisions:
            return []
        self.decisions += len(step.decisions)
        return [orjson.loads(d.body) for d in step.decisions]


# the demo's prices (USD-cent per chip-hour, by flavor; the scenario generator itself sets none): a base price in
# every hour and a peak band on weekdays 09:00–17:59 UTC at 1.6×, so a newcomer sees costs, budgets and peak use
DEMO_BASE_PRICE = {"h100": 250, "a100": 150, "tpu": 120}
DEMO_PEAK_HOURS = [d * 24 + h for d in range(5) for h in range(9, 18)]


def _base_price(flavor: str) -> int:
    return next((v for k, v in DEMO_BASE_PRICE.items() if k in flavor.lower()), 100)


def with_prices(events):
    """The scenario's events with the demo's prices and budgets: after each pool.configured, a base price and a
    peak band for the pool; after a team's first quota.granted in a pool, its monthly budget there (its quota's
    chips × 432 h at the base price, 60% of a month: a team that uses its quota all month, borrows or bursts
    crosses it, and its budget alerts fire)."""
    budgeted: set = set()
    prices: dict = {}
    for e in events:
        yield e
        if e.get("type") == "pool.configured":
            base = prices[e["pool"]] = _base_price(str(e.get("flavor", "")))
            common = {"occurred_at": e["occurred_at"], "pool": e["pool"], "source": "finance/demo", "unit": "USD-cent"}
            yield {"event_id": f"price-base-{e['pool']}", "type": "price.set", **common, "price_id": "base",
                   "per_chip_hour": base}
            yield {"event_id": f"price-peak-{e['pool']}", "type": "price.set", **common, "price_id": "peak",
                   "per_chip_hour": base * 16 // 10, "hours_of_week": DEMO_PEAK_HOURS}
        elif e.get("type") == "quota.granted" and (e["pool"], e["team"]) not in budgeted and e["pool"] in prices:
            budgeted.add((e["pool"], e["team"]))
            yield {"event_id": f"budget-{e['pool']}-{e['team']}", "type": "budget.set",
                   "occurred_at": e["occurred_at"], "pool": e["pool"], "source": "finance/demo",
                   "budget_id": f"{e['team']}-monthly", "team": e["team"], "period": "month",
                   "amount": int(float(e["chips"]) * 432 * prices[e["pool"]]), "unit": "USD-cent"}


def write_events(path: Path, seed: int, days: float, fold_config: FoldConfig = FoldConfig()) -> int:
    n = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    events = with_prices(generate(seed=seed, days=days, follow=LedgerLoop(fold_config), load=DEMO_LOAD,
                                  failure_scale=DEMO_FAILURE_SCALE, progress=True))
    lines = (json.dumps(e, separators=(",", ":")) for e in events)
    with open(path, "w") as f:
        for line in corrupt(lines, seed=seed, every=2000):
            f.write(line + "\n")
            n += 1
    return n


def run_demo(out: Path, seed: int = 7, days: float = 14, console: Console | None = None,
             fold_config: FoldConfig = FoldConfig()) -> dict:
    """The seeded scenario: write it, fold it, summarize it."""
    console = console or Console()
    out = Path(out)
    events = out / "events.jsonl"
    n = write_events(events, seed, days, fold_config)
    console.print(f"scenario: seed {seed}, {days:g} days, {n:,} lines → {events}")
    return fold_and_summarize(events, out, console, fold_config)


def run_trace_demo(trace: str, trace_dir: Path, out: Path, console: Console | None = None,
                   fold_config: FoldConfig = FoldConfig()) -> dict:
    """A real trace: import it, fold it, summarize it."""
    from chipledger.adapters.importers.registry import import_trace

    console = console or Console()
    out = Path(out)
    events = out / "events.jsonl"
    report = import_trace(trace, trace_dir, events)
    skipped = ", ".join(f"{k} {v:,}" for k, v in sorted(report.skipped.items())) or "none"
    console.print(f"trace {trace}: {report.rows_read:,} rows → {report.events_written:,} events → {events} "
                  f"(skipped: {skipped}; {report.first_at} … {report.last_at})")
    return fold_and_summarize(events, out, console, fold_config)


def fold_and_summarize(events: Path, out: Path, console: Console, fold_config: FoldConfig = FoldConfig()) -> dict:
    store_url = f"sqlite:///{(out / 'chipledger.db').resolve()}"
    summary, fleet = run_file(events, out / "lake", overwrite=True, store=open_store(store_url),
                              fold_config=fold_config)
    console.print(
        f"folded in {summary.seconds:.2f} s: {summary.accepted:,} accepted, {summary.duplicates:,} duplicates, "
        f"{summary.dead_letter_total:,} dead letters "
        f"({', '.join(f'{k} {v}' for k, v in sorted(summary.dead_letters.items())) or 'none'})"
    )
    con = connect(out / "lake")
    cols = ",\n       ".join(
        f"coalesce(sum(amount_mchip_s) FILTER (WHERE account = '{a}'), 0) / 3.6e6 AS {a}" for a in ACCOUNT_ORDER)
    pools = con.execute(POOL_SUMMARY_SQL.format(cols=cols)).fetchall()
    t = Table(title="chip-hours by account per pool")
    t.add_column("account", no_wrap=True)
    for row in pools:
        t.add_column(row[0].replace("/", "/\n"), justify="right", no_wrap=True)
    for i, a in enumerate(ACCOUNT_ORDER, start=1):
        t.add_row(a, *(f"{row[i]:,.0f}" for row in pools))
    print_table(t, console)
    teams = con.execute(TEAM_SUMMARY_SQL).fetchall()
    t = Table(title="each team's use against its quota (chip-hours)")
    for c in ("pool", "team", "quota", "used", "of quota", "borrowed"):
        t.add_column(c, justify="left" if c in ("pool", "team") else "right", no_wrap=True)
    for pool, team, quota, used, borrowed in teams:
        quota, used, borrowed = quota or 0.0, used or 0.0, borrowed or 0.0
        share = f"{used / quota:.0%}" if quota else "no quota"
        t.add_row(pool, team, f"{quota:,.0f}", f"{used:,.0f}", share, f"{borrowed:,.0f}")
    print_table(t, console)
    console.print(f"lake: {out / 'lake'}   store: {store_url}")
    statements = _first_week_statements(out, con, console)
    _next_commands(out, con, console)
    return {"summary": summary.as_dict(), "pools": pools, "teams": teams, "statements": statements}


def _next_commands(out: Path, con, console: Console) -> None:
    """What to run next on the demo's lake. From the folder `make demo` ran in, with the default --out, the
    commands need no --lake: a reading command falls back to demo/lake when there is no ./lake."""
    lake = "" if out == Path("demo") else f" --lake {out / 'lake'}"
    job = con.execute("SELECT job_id FROM jobs WHERE preemptions > 0 ORDER BY preemptions DESC, job_id LIMIT 1"
                      ).fetchone()
    console.print("next, on this lake" + ("" if lake else " (demo/lake is read when there is no ./lake)") + ":",
                  highlight=False)
    for cmd in (f"chipledger report{lake}", f"chipledger pending{lake}",
                f"chipledger why {job[0] if job else 'JOB_ID'}{lake}", f"chipledger alerts{lake}",
                f'chipledger sql{lake} "SELECT * FROM jobs ORDER BY allocated_mchip_s DESC LIMIT 5"'):
        console.print(f"  {cmd}", highlight=False, markup=False, soft_wrap=True)


def _first_week_statements(out: Path, con, console: Console) -> list:
    """The teams' quota statements for the first ISO week whose books are closed, if any."""
    from chipledger.reports.statements import books_closed_through_files, closed_periods, issue

    first = con.execute("SELECT min(hour) FROM journal_postings").fetchone()[0]
    closed = books_closed_through_files(out / "lake")
    weeks = closed_periods("week", first, min(closed.values())) if first is not None and closed else []
    if not weeks:
        return []
    # recorded in the demo's store, so the portal's statements archive lists them (docs/portal.md)
    store = open_store(f"sqlite:///{(out / 'chipledger.db').resolve()}")
    issued = issue(out / "lake", weeks[0], out / "statements", formats=("md", "html", "json"), store=store)
    console.print(f"quota statements for {weeks[0].label}: {len(issued)} teams → {out / 'statements' / weeks[0].label}"
                  f" (chipledger statements --lake {out / 'lake'} --period …)")
    return issued
