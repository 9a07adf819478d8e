"""An independent reckoning of /metrics' counters from lake rows (the tests' oracle).

The core keeps the counters in the pool states (ledger/state.py) and /metrics reads them; this module adds up the
rows the fold wrote instead (the way the collector counted before the core kept them), so a test can check that
the two agree: from a lake (`lake_counters`) or from `(pool, table, lake row)` triples (`rows_counters`).
Returned like tests/test_metrics.py's `by`: {metric name: {label values: value}}.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Sequence

import orjson

from analytics.lake import SCHEMAS
from analytics.lake_rows import read_rows

TABLES = ("job_runs", "waits", "progress", "decisions", "deadletters", "events")


def _ix(table: str) -> dict:
    return {n: i for i, n in enumerate(SCHEMAS[table].names)}


def rows_counters(rows: Iterable[tuple[str, str, Sequence]], sched_slo_s: int = 600) -> dict:
    """The counters of /metrics from (pool, table, lake row) triples."""
    out: dict = defaultdict(lambda: defaultdict(float))
    jr, wt, pg, dc, dl = _ix("job_runs"), _ix("waits"), _ix("progress"), _ix("decisions"), _ix("deadletters")
    for pool, table, r in rows:
        # a run's close postings are not ended yet (the lakes here close the books only at the end of the run)
        if table == "job_runs" and r[jr["ended_at"]] is not None:
            k = (pool, r[jr["team"]])
            a, lost = r[jr["allocated_mchip_s"]], r[jr["lost_mchip_s"]]
            out["chipledger_allocated_chip_seconds_total"][k] += a / 1000
            out["chipledger_useful_chip_seconds_total"][k] += (a - lost) / 1000
            out["chipledger_lost_chip_seconds_total"][k] += lost / 1000
        elif table == "waits" and r[wt["end"]] != "open":
            k = (pool, r[wt["team"]])
            started = r[wt["end"]] == "started"
            ok = started and r[wt["ended_at"]] - r[wt["began_at"]] <= sched_slo_s
            for name, add in (("in_quota_waits_total", r[wt["in_quota"]]),
                              ("in_quota_waits_honoured_total", r[wt["in_quota"]] and ok),
                              ("started_waits_total", started), ("started_waits_within_slo_total", ok)):
                out[f"chipledger_{name}"][k] += 1 if add else 0
        elif table == "progress" and r[pg["slow"]] is not None:
            k = (pool, r[pg["team"]])
            c = r[pg["charged_mchip_s"]]
            out["chipledger_progress_judged_chip_seconds_total"][k] += c / 1000
            out["chipledger_progress_at_rate_chip_seconds_total"][k] += 0 if r[pg["slow"]] else c / 1000
        elif table == "decisions":
            body = orjson.loads(r[dc["body"]])
            rule = r[dc["rule"]]
            out["chipledger_decisions_total"][(pool, r[dc["type"]].removeprefix("decision."), rule,
                                               body.get("verdict") or "")] += 1
            for v in body.get("victims") or ():
                out["chipledger_preemption_victims_total"][(pool, v["team"], rule)] += 1
                out["chipledger_preemption_lost_work_chip_seconds_total"][(pool, v["team"], rule)] += \
                    v["lost_work_chip_s"]
        elif table == "deadletters":
            out["chipledger_dead_letters_total"][(r[dl["error_code"]],)] += 1
        elif table == "events":
            out["chipledger_events_applied_total"][(pool,)] += 1
    return {name: dict(v) for name, v in out.items()}


def lake_counters(lake, sched_slo_s: int = 600) -> dict:
    """The counters of /metrics from the rows of a lake."""
    def rows():
        for table in TABLES:
            pool_at = _ix(table)["pool"]
            for r in read_rows(lake, table):
                yield r[pool_at], table, r
    return rows_counters(rows(), sched_slo_s)
