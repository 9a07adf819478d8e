"""`chipledger metrics history` (chipledger/monitoring/history.py): the lake's history as OpenMetrics, the series
/metrics serves sampled on a grid of event time; and `serve-metrics` answering on its port while it folds.

The samples at the grid's last instant are what /metrics serves after the whole lake is folded (the availability
counters accrued up to that instant); `promtool check metrics` and `promtool tsdb create-blocks-from openmetrics`
accept the file when promtool is installed (the backfill into a real Prometheus is
tests/integration/test_prometheus_history.py)."""

from __future__ import annotations

import asyncio
import io
import threading
import urllib.request
from collections import defaultdict

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from typer.testing import CliRunner

from analytics.slo_views import SloParams
from chipledger.cli import app
from chipledger.embedded import run_file
from chipledger.monitoring.history import write_history
from chipledger.monitoring.server import LakeMetrics, run_server
from chipledger.sim.scenario import write_jsonl
from ledger import FoldConfig
from streams.metrics import exposition, registry_of
from tests.monitoring_scenario import outage_events
from tests.prom_support import free_port, promtool
from tests.test_metrics import samples

FOLD = FoldConfig(capacity_slo_target=SloParams().availability)


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    root = tmp_path_factory.mktemp("history")
    write_jsonl(outage_events(days=1.5, outage_at_h=20, outage_hours=2), root / "events.jsonl")
    run_file(root / "events.jsonl", root / "lake", fold_config=FOLD)
    return root / "lake"


def _series(text: str) -> dict:
    """{(sample name, sorted labels): [(timestamp, value)]} of an OpenMetrics text."""
    out = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))].append((float(s.timestamp), s.value))
    return out


def test_history_is_openmetrics_of_the_served_series_and_ends_at_what_metrics_serves(lake, tmp_path):
    out = io.StringIO()
    summary = write_history(lake, FOLD, out, step_s=300)
    text = out.getvalue()
    assert text.endswith("# EOF\n") and summary.events > 0 and summary.skipped == 0
    series = _series(text)  # the OpenMetrics parser of prometheus_client: families together, one # EOF
    assert len(series) == summary.series and sum(map(len, series.values())) == summary.samples
    for key, points in series.items():
        ts = [t for t, _ in points]
        assert ts == sorted(ts) and all(t % 300 == 0 for t in ts), key
        if key[0].endswith("_total"):  # counters never go back
            assert all(a[1] <= b[1] for a, b in zip(points, points[1:])), key
    # the last instant: every series /metrics serves after the whole lake (but the process' own), same values
    lm = LakeMetrics(lake, FOLD)
    lm.poll()
    served = {k: v for k, v in samples(exposition(registry_of(lm, process=False)).decode()).items()
              if not k[0].startswith(("chipledger_pool_last_fold", "chipledger_fold_duration", "chipledger_metrics"))}
    last = {k: p[-1][1] for k, p in series.items() if p[-1][0] == summary.last_s}
    assert set(last) == set(served)
    for k, v in served.items():
        if k[0] in ("chipledger_registered_chip_seconds_total", "chipledger_available_chip_seconds_total"):
            assert last[k] >= v  # accrued up to the grid instant, at or after the pool clock
        else:
            assert last[k] == pytest.approx(v), k
    # the availability counters move with event time between events (a rate over a few minutes is never 0/0)
    ((_, reg),) = [(k, p) for k, p in series.items() if k[0] == "chipledger_registered_chip_seconds_total"]
    assert all(b[1] > a[1] for a, b in zip(reg, reg[1:]))


def test_history_cli_writes_a_file_promtool_accepts(lake, tmp_path):
    out = tmp_path / "history.om"
    r = CliRunner().invoke(app, ["metrics", "history", "--lake", str(lake), "--out", str(out), "--step", "5m",
                                 "--start", "2026-11-02T06:00:00Z", "--end", "2026-11-02T12:00:00Z"])
    assert r.exit_code == 0, r.output
    assert "series" in r.output and "instants 2026-11-02T06:00:00Z .. 2026-11-02T12:00:00Z" in r.output
    ts = {t for p in _series(out.read_text()).values() for t, _ in p}
    assert min(ts) == 1793599200 and max(ts) == 1793620800 and len(ts) == 73
    r = CliRunner().invoke(app, ["metrics", "history", "--lake", str(lake), "--out", str(out), "--step", "0s"])
    assert r.exit_code == 2 and "--step" in r.output
    blocks = tmp_path / "blocks"
    p = promtool("tsdb", "create-blocks-from", "openmetrics", str(out), str(blocks))
    assert p.returncode == 0, p.stderr.decode() + p.stdout.decode()
    assert [d for d in blocks.iterdir() if d.is_dir()]


def test_serve_metrics_answers_on_its_port_while_it_folds(lake):
    """The port is bound before the first fold: meanwhile /metrics says `chipledger_metrics_loading 1`, then every
    series with `chipledger_metrics_loading 0`."""
    release = threading.Event()

    class Slow(LakeMetrics):
        def poll(self):
            release.wait(30)
            return super().poll()

    lm = Slow(lake, FOLD)
    port = free_port()
    stop = asyncio.Event()
    seen = {}

    def get():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.status, r.read().decode()

    async def main():
        loaded, listening = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(run_server(lm, "127.0.0.1", port, 60.0, stop=stop,
                                              started=lambda bound: listening.set(),
                                              loaded=lambda n: (seen.setdefault("n", n), loaded.set())))
        await asyncio.wait_for(listening.wait(), 30)
        seen["during"] = await asyncio.to_thread(get)
        release.set()
        await asyncio.wait_for(loaded.wait(), 60)
        seen["after"] = await asyncio.to_thread(get)
        stop.set()
        await task

    asyncio.run(main())
    status, body = seen["during"]
    assert status == 200 and "chipledger_metrics_loading 1.0" in body and "chipledger_pool_info" not in body
    status, body = seen["after"]
    assert status == 200 and "chipledger_metrics_loading 0.0" in body and "chipledger_pool_info{" in body
    assert seen["n"] > 0
