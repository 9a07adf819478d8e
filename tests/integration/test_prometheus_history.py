"""An existing lake's history in a real Prometheus, as docs/monitoring.md ("History") tells an SRE to do it:
`chipledger metrics history` → `promtool tsdb create-blocks-from openmetrics` into a data folder → Prometheus
started on it with the rules of `chipledger slo rules` → the recording rules backfilled with `promtool tsdb
create-blocks-from rules` (twice: the budget-left rules read the ratios the first pass recorded) → Prometheus
restarted with those blocks → the dashboard's SLO expressions answered at an instant of the lake's past: not empty,
not NaN, and the availability burn rates equal the lake's own (`burn_alerts`) to the chip-second.

Skipped loudly without the binaries (`bash scripts/prometheus.sh ensure`), a failure under
CHIPLEDGER_REQUIRE_PROMETHEUS=1."""

from __future__ import annotations

import math
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path

import pytest
from typer.testing import CliRunner

from analytics.slo_views import WINDOWS_S, SloParams
from analytics.views import connect
from chipledger.cli import app
from chipledger.embedded import run_file
from chipledger.monitoring.grafana import dashboard
from chipledger.monitoring.slo_rules import ratio_rule, specs
from chipledger.sim.scenario import write_jsonl
from ledger import FoldConfig
from streams.metrics import SLO_COUNTERS
from tests.monitoring_scenario import outage_events
from tests.prom_support import Prometheus, promtool, tool

FOLD = FoldConfig(capacity_slo_target=SloParams().availability)
AT = datetime(2026, 11, 4, 10, 0, tzinfo=timezone.utc)  # inside the outage (hours 49 to 71 since 2026-11-02)
RUNBOOK = "https://runbooks.example/chipledger/{slo}#{alert}"


def _promtool_ok(*args: str) -> str:
    p = promtool(*args)
    assert p.returncode == 0, (args, p.stdout.decode()[-2000:], p.stderr.decode()[-2000:])
    return p.stdout.decode()


def _move_blocks(src: Path, data: Path) -> int:
    n = 0
    for d in src.iterdir():
        if d.is_dir() and (d / "meta.json").exists():
            shutil.move(str(d), str(data / d.name))
            n += 1
    return n


def _slo_exprs() -> list[tuple[str, str]]:
    """(panel title, expression) of the dashboard's SLO panels, variables set to everything."""
    out = []
    for p in dashboard()["panels"]:
        for t in p.get("targets", []):
            if "slo_" in t["expr"] and "ALERTS" not in t["expr"]:
                out.append((p["title"], t["expr"].replace("$pool", ".*").replace("$team", ".*")))
    return out


def test_the_lakes_history_backfilled_into_prometheus_answers_the_dashboards_slo_queries(tmp_path):
    tool("prometheus")
    tool("promtool")
    events = tmp_path / "events.jsonl"
    write_jsonl(outage_events(days=3, outage_at_h=49, outage_hours=22), events)
    lake = tmp_path / "lake"
    run_file(events, lake, fold_config=FOLD)
    cfg = tmp_path / "chipledger.toml"
    cfg.write_text(f'[slo]\nrunbook_url = "{RUNBOOK}"\n')
    history, rules, data = tmp_path / "history.om", tmp_path / "rules.yml", tmp_path / "data"
    cli = CliRunner()
    r = cli.invoke(app, ["metrics", "history", "--lake", str(lake), "--out", str(history), "--step", "60s"])
    assert r.exit_code == 0, r.output
    r = cli.invoke(app, ["slo", "rules", "--out", str(rules), "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    data.mkdir()
    _promtool_ok("tsdb", "create-blocks-from", "openmetrics", str(history), str(data))

    at = int(AT.timestamp())
    prom = Prometheus(tmp_path / "p1", data=data, retention="100y")
    try:
        prom.configure([], [rules])
        # the raw series are there, at the lake's instants
        assert prom.query("chipledger_registered_chip_seconds_total", at)
        # the alerts carry the runbook from [slo] runbook_url
        alerting = [r for g in prom.api("rules")["data"]["groups"] for r in g["rules"] if r["type"] == "alerting"]
        assert alerting and all(r["annotations"]["runbook_url"] == RUNBOOK.format(slo=r["labels"]["slo"],
                                                                                   alert=r["labels"]["alert"])
                                for r in alerting)
        # the recording rules backfilled over the two hours up to AT (promtool's --end is not evaluated), twice (the budget-left rules read the
        # 30d ratio the first pass recorded; the second pass's copies of the others are the same samples)
        for k in (1, 2):
            out = tmp_path / f"rules-blocks-{k}"
            _promtool_ok("tsdb", "create-blocks-from", "rules", "--start", str(at - 7200), "--end", str(at + 60),
                         "--eval-interval", "60s", "--url", prom.url, "--output-dir", str(out), str(rules))
            prom.stop()
            assert _move_blocks(out, data) > 0
            prom = Prometheus(tmp_path / f"p{k + 1}", data=data, retention="100y")
            prom.configure([], [rules])
        # the dashboard's SLO panels at AT: every expression answers, with numbers
        exprs = _slo_exprs()
        assert len(exprs) >= 5 + 1 + 6  # a stat per SLO, the budget-left series, two windows per burn panel
        # (the scenario reports no progress: the throughput SLO has no events, hence no series, and its stat says so)
        counted = {slo for slo, (total, _, _) in SLO_COUNTERS.items() if prom.query(total, at)}
        assert counted == set(SLO_COUNTERS) - {"throughput"}
        for title, expr in exprs:
            res = prom.query(expr.replace("$__rate_interval", "5m"), at)
            if not any(f'slo="{slo}"' in expr for slo in set(SLO_COUNTERS) - counted):
                assert res, (title, expr)
            values = [float(x["value"][1]) for x in res]
            assert not any(math.isnan(v) for v in values), (title, expr, res)
        # equal to the lake's numbers: the availability burn rate over each window (the lake's burn_alerts at AT)
        con = connect(lake, as_of=AT)
        lake_burn = {(w, pool): b for w, pool, b in con.execute(
            "SELECT long_win, pool, long_burn FROM burn_alerts WHERE slo = 'availability' "
            "AND alert != 'budget_exhausted' UNION "
            "SELECT short_win, pool, short_burn FROM burn_alerts WHERE slo = 'availability' "
            "AND alert != 'budget_exhausted'").fetchall()}  # the burn-rate rules' windows
        assert lake_burn and max(lake_burn.values()) > 14.4
        spec = next(s for s in specs(SloParams()) if s.slo == "availability")
        for (w, pool), b in sorted(lake_burn.items()):
            # the rule's own expression over the backfilled counters, at AT
            (got,) = prom.query(f"({ratio_rule(spec, w)['expr']}) / {spec.budget}", at)
            # and what the backfilled recording rule holds at AT: the same expression, evaluated by promtool on its
            # own grid of instants (within a step of AT)
            sel = f'{{slo="availability", pool="{pool}"}}'
            (rec,) = prom.query(f"chipledger:slo_errors:ratio_rate{w}{sel} / on (slo) group_left () "
                                "chipledger:slo_error_budget:ratio", at)
            (ts,) = prom.query(f"timestamp(chipledger:slo_errors:ratio_rate{w}{sel})", at)
            (raw_then,) = prom.query(f"({ratio_rule(spec, w)['expr']}) / {spec.budget}", float(ts["value"][1]))
            assert float(rec["value"][1]) == pytest.approx(float(raw_then["value"][1]), rel=1e-9), (w, ts, at)
            assert at - 60 < float(ts["value"][1]) <= at
            # a window inside the history is exact (samples at both ends); one reaching before the lake's first event
            # (3d at AT) is extrapolated by Prometheus' rate() towards its start: close, not equal
            inside = at - WINDOWS_S[w] >= int(datetime(2026, 11, 2, tzinfo=timezone.utc).timestamp())
            assert float(got["value"][1]) == pytest.approx(b, rel=1e-6 if inside else 1e-2), (w, pool)
        # the budget left over the 30-day window: the lake's error_budget at AT (the window reaches before the lake's
        # first event: Prometheus extrapolates towards its start, so close, not equal)
        lake_left = dict(con.execute("SELECT pool, remaining FROM error_budget "
                                     "WHERE slo = 'availability' AND pool IS NOT NULL").fetchall())
        got = {r["metric"]["pool"]: float(r["value"][1])
               for r in prom.query('chipledger:slo_error_budget_remaining:ratio{slo="availability"}', at)}
        assert got.keys() == lake_left.keys()
        for pool, left in lake_left.items():
            assert got[pool] == pytest.approx(left, rel=1e-2, abs=1e-2), pool
    finally:
        prom.stop()

