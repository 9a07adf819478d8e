"""`chipledger metrics history`: the lake's history as OpenMetrics, for `promtool tsdb create-blocks-from openmetrics`.

An SRE who points Grafana at Prometheus for an existing lake sees nothing before Prometheus started scraping. This
writes the samples /metrics would have served at every `step` of the lake's event time, had a worker folded the
lake's events as they happened and been scraped then: the same series names and labels (streams/metrics.py, the
one collector), so the recording rules of `chipledger slo rules` (backfilled in turn with `promtool tsdb
create-blocks-from rules`) and the dashboard work over the blocks.

How: the lake's `events` rows (read through analytics' connect, in the views' order: `applied_at, topic,
partition, offset`) are folded again with the ledger core, as `serve-metrics` does; before the first event applied
after an instant T of the grid (multiples of `step` seconds), the collector is read and its samples are written
with timestamp T. The state read is the one after every event applied at or before T, as a scrape at T would have
read it. One difference from a live scrape, on purpose: a live worker's availability counters reach its pool
clock (the last event), a grid sample's reach T itself (the collector is handed the state with its clock at T:
`Books.accrued` extends the open hour's constant rates to T, which is exact, since nothing changes between two
events). Without that, a pool whose events are minutes apart would have flat counters and a 5m rate of 0/0.

Not written: the worker's own health (last fold wall time, fold durations, consumer lag, `process_*`): they say
nothing about the past. Dead letters are counted at their `seen_at` from the lake's `deadletters` rows.

OpenMetrics wants each family's samples together, each series' samples together and in time order: each family is
spilled to its own temporary file while the lake is folded; then, one family at a time (the memory it takes is that
of the largest family's samples), its samples are grouped by series and written, then `# EOF`.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

from schemas import Rejection, parse_event

#: families of the collector that describe the process, not the pools' history
SKIPPED = frozenset({"chipledger_pool_last_fold_timestamp_seconds", "chipledger_fold_duration_seconds",
                     "chipledger_consumer_lag_records"})


class _At:
    """A pool state read as of instant `t` ≥ its clock: every attribute is the state's, the clock is `t`."""

    __slots__ = ("_state", "clock")

    def __init__(self, state, t: int):
        self._state = state
        self.clock = t

    def __getattr__(self, name):
        return getattr(self._state, name)


@dataclass
class HistorySummary:
    events: int = 0          # events folded
    skipped: int = 0         # event rows that did not fold again (another [ledger]/[policy] configuration?)
    samples: int = 0
    series: int = 0
    steps: int = 0
    first_s: Optional[int] = None
    last_s: Optional[int] = None
    families: int = 0


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _value(v: float) -> str:
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


class _Spill:
    """One temporary file per metric family: its samples in the order written (the grid's time order)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files: dict[str, TextIO] = {}
        self.meta: dict[str, tuple[str, str]] = {}  # family -> (type, help)
        self.series: set = set()
        self.samples = 0

    def add(self, family, t: int) -> None:
        name = family.name
        f = self.files.get(name)
        if f is None:
            f = self.files[name] = open(self.folder / f"{len(self.files)}.om", "w+", encoding="utf-8")
            self.meta[name] = (family.type, family.documentation)
        ts = str(t)
        lines = []
        for s in family.samples:
            labels = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(s.labels.items()))
            key = f"{s.name}{{{labels}}}"
            self.series.add(key)
            lines.append(f"{key} {_value(s.value)} {ts}\n")
        f.writelines(lines)
        self.samples += len(lines)

    def write(self, out: TextIO) -> int:
        for name, f in self.files.items():
            kind, doc = self.meta[name]
            f.flush()
            f.seek(0)
            out.write(f"# TYPE {name} {kind}\n")
            if doc:
                out.write(f"# HELP {name} {_escape(doc)}\n")
            by_series: dict[str, list[str]] = {}  # one family in memory at a time: its series' samples together
            for line in f:
                by_series.setdefault(line.rsplit(" ", 2)[0], []).append(line)
            f.close()
            for lines in by_series.values():
                out.writelines(lines)
        out.write("# EOF\n")
        return len(self.files)


def write_history(lake: Path, fold_config, out: TextIO, step_s: int = 60, start_s: Optional[int] = None,
                  end_s: Optional[int] = None, batch: int = 50_000) -> HistorySummary:
    """Fold the lake's events and write the collector's samples at every multiple of `step_s` from the first
    event (or `start_s`) to the last (or `end_s`) into `out` (OpenMetrics text, `# EOF` last)."""
    from analytics.views import connect
    from ledger import Fleet
    from streams.metrics import MetricsCollector

    if step_s <= 0:
        raise ValueError("the step must be a positive number of seconds")
    con = connect(Path(lake))
    first, last = con.execute("SELECT min(epoch(applied_at))::BIGINT, max(epoch(applied_at))::BIGINT "
                              "FROM event_log").fetchone()
    summary = HistorySummary()
    if first is None:
        out.write("# EOF\n")
        return summary
    lo = first if start_s is None else max(first, start_s)
    hi = last if end_s is None else end_s
    fleet = Fleet(fold_config)
    collector = MetricsCollector(fleet.pools, fold_config, states_dead_letters=False)
    dead = con.execute("SELECT epoch(seen_at)::BIGINT, error_code FROM deadletters ORDER BY seen_at").fetchall()
    dead_i = 0

    with tempfile.TemporaryDirectory(prefix="chipledger-history-") as tmp:
        spill = _Spill(Path(tmp))
        t = -(-lo // step_s) * step_s  # the first grid instant at or after the start

        def sample(at: int) -> None:
            nonlocal dead_i
            while dead_i < len(dead) and dead[dead_i][0] <= at:
                collector.dead_letter(dead[dead_i][1])
                dead_i += 1
            for fam in collector.gauges():
                if fam.samples:
                    spill.add(fam, at)
            # the counters with the pools' clocks at `at` (the availability counters accrue up to it)
            live = collector.states
            collector.states = {p: _At(s, max(at, s.clock)) for p, s in live.items()}
            try:
                for fam in collector.counters():
                    if fam.name not in SKIPPED and fam.samples:
                        spill.add(fam, at)
            finally:
                collector.states = live
            summary.steps += 1
            summary.first_s = at if summary.first_s is None else summary.first_s
            summary.last_s = at

        cur = con.execute('SELECT epoch(applied_at)::BIGINT, body FROM event_log '
                          'ORDER BY applied_at, topic, "partition", "offset"')
        apply = fleet.apply
        while True:
            rows = cur.fetchmany(batch)
            if not rows:
                break
            for at, body in rows:
                while t < at and t <= hi:
                    if t >= lo:
                        sample(t)
                    t += step_s
                if at > hi:
                    break
                event = parse_event(body.encode() if isinstance(body, str) else body)
                if isinstance(event, Rejection) or not apply(event).applied:
                    summary.skipped += 1
                    continue
                summary.events += 1
            else:
                continue
            break
        end = hi if end_s is not None else -(-last // step_s) * step_s  # the grid instant closing the last event
        while t <= end:
            if t >= lo:
                sample(t)
            t += step_s
        summary.families = spill.write(out)
        summary.samples = spill.samples
        summary.series = len(spill.series)
    return summary
