"""Streaming benchmark: events/s through the worker (sequencer + log + fold) and the sink against a raw aiokafka
consumer, a no-op Faust app and the embedded run of the same events, all in the same run; decision latency
(produce -> output record) at a steady input rate; and the takeover time after a `kill -9` of one of two workers.

    .venv/bin/python bench/stream.py [--events 60000] [--rate 1000] [--seconds 20] [--bootstrap HOST:PORT]
    .venv/bin/python bench/stream.py --events 40000 --metrics-compare 3   # /metrics' cost (issue 20) only

Without --bootstrap it starts its own broker (`chipledger kafka up` machinery) in a temporary folder, on a free
port, and stops it at the end. Prints the figures; nothing is asserted (docs/benchmarks.md records them).

1. throughput: a seeded fleet (3 pools) of --events events is emitted first (LedgerProducer). Then, in turn:
   - raw: an aiokafka consumer reads the three input topics from the beginning to their end (decoding nothing);
   - Faust floor: a Faust app with the worker's own settings (streams.worker.faust_settings) whose agents do
     nothing but acknowledge each record (subprocess, new consumer group) reads the same records: what any Faust
     worker costs before it does any work, counted from its first record to its last;
   - pipeline: `chipledger worker` (subprocess, rocksdb table, no ticks) and the sink (in this process) run until
     the sink has written an `events` row for every event; the rate counts from the worker's first output record
     to the sink's last write (the worker's start-up, ~3 s of Faust and table recovery, is reported apart).
   - embedded: `chipledger run`'s fold (chipledger.embedded.run_file) of the same events into a lake.
2. latency: the same worker (restarted: it resumes at the end of the log) follows new input while a producer
   sends the scenario's next --rate x --seconds events at --rate events/s; a consumer of the output topics takes, for
   every folded input record, the time from its send to the arrival of its output record; decisions apart.
3. takeover (on a second broker, 2 partitions, 8 pools): two workers in a new group share the partitions while a
   producer sends 300 events/s; one is killed
   with SIGKILL; per input partition, the longest pause of its outputs around the kill is the time the group
   took to notice (session timeout), rebalance and restore the tables on the survivor; the largest is reported.

--metrics-compare N replaces all of that by N pipeline runs each way, alternating, of the worker with and without
`--metrics-port` (scraped every 5 s, and once at the end): the worker's CPU seconds (from /proc, from its first output
to the sink's last write: start-up left out) and the pipeline's wall time, min and median, and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import orjson  # noqa: E402

from chipledger.sim.scenario import generate, iter_jsonl  # noqa: E402
from schemas import INPUT_TOPICS  # noqa: E402
from schemas.topics import TOPIC_DECISIONS, TOPIC_JOURNAL, TOPIC_LOG  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scenario_lines(seed: int, n: int, pools: int = 3) -> list[bytes]:
    days = 1
    while True:
        lines = [line.encode() for line in iter_jsonl(generate(seed=seed, days=days, pools=pools, teams=6))]
        if len(lines) >= n or days > 400:
            return lines
        days = max(days + 1, int(days * n / max(1, len(lines))) + 1)


def emit(bootstrap: str, lines: list[bytes]) -> float:
    from streams.producer import LedgerProducer, emit_lines

    t0 = time.monotonic()
    with LedgerProducer(bootstrap) as p:
        report = emit_lines(p, lines, flush_timeout=120)
    assert report.sent == len(lines) and not report.invalid, report
    return time.monotonic() - t0


async def raw_read(bootstrap: str, total: int) -> float:
    """Seconds for a raw aiokafka consumer to read `total` records of the input topics from the beginning."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                         auto_offset_reset="earliest", max_partition_fetch_bytes=16 << 20, fetch_max_bytes=64 << 20)
    await c.start()
    try:
        from streams.topics import describe_partitions

        counts = describe_partitions(bootstrap, INPUT_TOPICS)
        tps = [TopicPartition(t, p) for t in INPUT_TOPICS for p in range(counts[t])]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        n = 0
        t0 = time.monotonic()
        while n < total:
            got = await c.getmany(timeout_ms=500, max_records=10_000)
            n += sum(len(v) for v in got.values())
        return time.monotonic() - t0
    finally:
        await c.stop()


def faust_floor(bootstrap: str, total: int, work: Path) -> dict:
    """Run the no-op Faust app (this file with --faust-floor) until it has read `total` records; its rate."""
    app_id = f"bench-floor-{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, __file__, "--faust-floor", str(total), "--app-id", app_id,
                          "--bootstrap", bootstrap, "--work", str(work / app_id)],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    found = [line for line in (out.stdout + out.stderr).splitlines() if "FLOOR " in line]
    if not found:
        raise RuntimeError(f"the Faust floor run failed: {(out.stdout + out.stderr)[-2000:]}")
    n, seconds = found[-1].split("FLOOR ", 1)[1].split()[:2]
    return {"records": int(n), "seconds": float(seconds), "total_s": time.monotonic() - t0}


def faust_floor_child(bootstrap: str, total: int, app_id: str, work: Path) -> None:
    """The no-op app: the worker's Faust settings, one agent per input topic that only acknowledges records."""
    import faust

    from streams.worker import WorkerSettings, faust_settings

    settings = WorkerSettings(bootstrap=bootstrap, app_id=app_id, data_dir=work, table_store="memory")
    work.mkdir(parents=True, exist_ok=True)
    app = faust.App(app_id, **faust_settings(settings))
    seen = {"n": 0, "t0": 0.0}

    def make_agent(name: str):
        async def agent(stream):
            async for event in stream.noack().events():
                if not seen["n"]:
                    seen["t0"] = time.monotonic()
                seen["n"] += 1
                event.ack()
                if seen["n"] >= total:
                    print(f"FLOOR {seen['n']} {time.monotonic() - seen['t0']:.3f}", flush=True)
                    os._exit(0)
        agent.__name__ = agent.__qualname__ = f"noop_{name.split('.')[-1]}"
        app.agent(app.topic(name, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw"),
                  name=agent.__name__)(agent)

    for name in INPUT_TOPICS:
        make_agent(name)
    sys.argv = [sys.argv[0], "worker", "-l", "warn"]
    app.main()


WORKER_ARGS: list[str] = []  # more `chipledger worker` options (--worker-arg)


def worker_proc(bootstrap: str, data_dir: Path, app_id: str, log: Path, more: tuple = ()) -> subprocess.Popen:
    out = open(log, "ab")
    return subprocess.Popen([sys.executable, "-m", "chipledger.cli", "worker", "--bootstrap", bootstrap, "--data-dir",
                             str(data_dir), "--app-id", app_id, "--tick-interval", "0", "--loglevel", "warning",
                             *WORKER_ARGS, *more],
                            stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process (Linux /proc/PID/stat), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return len(r.read())


def pipeline(bootstrap: str, work: Path, total_events: int, *, metrics_port: int | None = None,
             scrape_every_s: float = 5.0) -> dict:
    """Worker + sink over the input topics from their beginning (a new group). With `metrics_port` the worker
    serves /metrics there and this process scrapes it every `scrape_every_s` (as Prometheus would)."""
    from store import open_store
    from streams.sink import Sink

    run = work / f"run-{uuid.uuid4().hex[:6]}"
    run.mkdir(parents=True)
    sink = Sink(run / "lake", open_store(f"sqlite:///{run / 'sink.db'}"), bootstrap=bootstrap, name="bench")
    t_start = time.monotonic()
    app_id = f"bench-{uuid.uuid4().hex[:6]}"
    more = ("--metrics-port", str(metrics_port)) if metrics_port is not None else ()
    proc = worker_proc(bootstrap, run / "worker", app_id, work / "worker.log", more)
    first = None
    scrapes, next_scrape = 0, time.monotonic() + scrape_every_s
    try:
        deadline = time.monotonic() + 900
        while sink.stats.rows["events"] < total_events:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited: {(work / 'worker.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"pipeline too slow: {sink.stats.as_dict()}")
            if sink.poll_once(timeout_ms=100) and first is None:
                first = time.monotonic()
                cpu_first = cpu_seconds(proc.pid)
            if metrics_port is not None and first is not None and time.monotonic() >= next_scrape:
                scrape(f"http://127.0.0.1:{metrics_port}/metrics")
                scrapes += 1
                next_scrape = time.monotonic() + scrape_every_s
        last = time.monotonic()
        if metrics_port is not None:  # one more at the end: the collector saw every record
            size = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
            assert size > 0
            scrapes += 1
        cpu = cpu_seconds(proc.pid) - cpu_first
    finally:
        stop(proc)
        sink.close()
    return {"startup_s": first - t_start, "seconds": last - first, "total_s": last - t_start, "worker_cpu_s": cpu,
            "scrapes": scrapes, "sink": sink.stats.as_dict(), "app_id": app_id, "data_dir": run / "worker"}


def metrics_compare(bootstrap: str, work: Path, total_events: int, repeat: int) -> dict:
    """The worker with and without /metrics (issue 20), `repeat` runs each, alternating, same events: the
    worker's CPU seconds from its first output to the sink's last write (start-up left out) and the pipeline's
    wall time over the same span."""
    runs: dict[str, list[dict]] = {"without": [], "with": []}
    for i in range(repeat):
        for mode in (("without", "with") if i % 2 == 0 else ("with", "without")):
            r = pipeline(bootstrap, work, total_events, metrics_port=free_port() if mode == "with" else None)
            runs[mode].append(r)
            print(f"  {mode:>7} /metrics: worker CPU {r['worker_cpu_s']:.2f} s, worker + sink {r['seconds']:.1f} s"
                  + (f" ({r['scrapes']} scrapes)" if mode == "with" else ""), flush=True)
    out = {}
    for key in ("worker_cpu_s", "seconds"):
        w = sorted(r[key] for r in runs["with"])
        wo = sorted(r[key] for r in runs["without"])
        out[key] = {"without": (wo[0], statistics.median(wo)), "with": (w[0], statistics.median(w)),
                    "ratio": (w[0] / wo[0], statistics.median(w) / statistics.median(wo))}
    return out


def output_consumer(bootstrap: str, ready, halt, count, out_path: str) -> None:
    """In its own process (so that it and the producer do not share a GIL): read the output topics from their end,
    note the arrival time of every input record's output, and write them to `out_path` when told to stop."""
    from kafka import KafkaConsumer, TopicPartition

    # fetch_max_wait_ms: kafka-python holds a fetch up to 500 ms by default, which would be measured as latency
    from streams.sequencer import unpack_batch

    cons = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, fetch_max_wait_ms=10)
    # the log too: its records' timestamps (set by the worker when it sends them) split the latency into stages
    tps = [TopicPartition(t, p) for t in (TOPIC_JOURNAL, TOPIC_DECISIONS, TOPIC_LOG)
           for p in sorted(cons.partitions_for_topic(t))]
    cons.assign(tps)
    cons.seek_to_end(*tps)
    for tp in tps:
        cons.position(tp)
    ready.set()
    got = []
    while not halt.is_set():
        for recs in cons.poll(timeout_ms=100).values():
            now = time.time()
            for r in recs:
                if r.topic == TOPIC_LOG:
                    for e in unpack_batch(r.value):
                        got.append((r.topic, [e.topic, e.partition, e.offset], now, r.timestamp / 1000))
                    continue
                v = orjson.loads(r.value)
                if v.get("kind") != "rows":
                    continue
                for item in v["items"]:
                    got.append((r.topic, item["origin"], now, r.timestamp / 1000))
                    if r.topic == TOPIC_JOURNAL:
                        count.value += 1
    cons.close()
    Path(out_path).write_bytes(orjson.dumps(got))


def latency(bootstrap: str, work: Path, rate: int, lines: list[bytes], app_id: str, data_dir: Path,
            more: tuple = ()) -> dict:
    """Produce at `rate` events/s for `seconds` while the worker of the throughput run (same app id and table
    state: it resumes at the end of the log) follows; latency of every output, taken by a consumer of the output
    topics in another process."""
    import multiprocessing

    from streams.producer import LedgerProducer

    ctx = multiprocessing.get_context("spawn")
    ready, halt, count = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
    out_path = work / "latency-outputs.json"
    reader = ctx.Process(target=output_consumer, args=(bootstrap, ready, halt, count, str(out_path)), daemon=True)
    reader.start()
    if not ready.wait(60):
        raise RuntimeError("the output consumer did not start")
    wlog = work / f"worker-lat-{uuid.uuid4().hex[:6]}.log"
    proc = worker_proc(bootstrap, data_dir, app_id, wlog, ("--log-stalls-ms", str(STALL_MS), *more))
    sent_at: dict[tuple, float] = {}  # (topic, partition, offset) -> send wall time (s)
    lat_all: list[float] = []
    lat_dec: list[float] = []
    try:
        time.sleep(10)  # the worker's start-up: join the group, open its table, reach the end of the log
        p = LedgerProducer(bootstrap, linger_ms=0)
        interval = 1.0 / rate
        load_before = os.getloadavg()[0]
        log_from = wlog.stat().st_size if wlog.exists() else 0  # the stalls of the measured run only (not start-up)
        cpu0 = cpu_seconds(proc.pid)
        t0 = time.monotonic()
        futures = []
        for i, line in enumerate(lines):
            target = t0 + i * interval
            delay = target - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            futures.append((time.time(), p.send(line)))
        p.flush(60)
        send_s = time.monotonic() - t0
        for at, f in futures:
            md = f.get(30)
            sent_at[(md.topic, md.partition, md.offset)] = at
        p.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and count.value < len(sent_at):
            time.sleep(0.5)
        worker_cpu_s = cpu_seconds(proc.pid) - cpu0
        load_after = os.getloadavg()[0]
    finally:
        halt.set()
        reader.join(60)
        stop(proc)
    stalls = stall_lines(wlog, log_from)
    pending = orjson.loads(out_path.read_bytes()) if out_path.exists() else []
    logged_at = {tuple(origin): ts for topic, origin, _, ts in pending if topic == TOPIC_LOG}
    stages: dict[str, list] = {"send_to_log": [], "log_to_output": [], "output_to_reader": []}
    for topic, origin, now, ts in pending:
        origin = tuple(origin)
        at = sent_at.get(origin)
        if at is None or topic == TOPIC_LOG:
            continue
        (lat_dec if topic == TOPIC_DECISIONS else lat_all).append((now - at) * 1000)
        if topic == TOPIC_JOURNAL and origin in logged_at:
            # the worker's send times of the log record and of the output record (broker timestamps: CreateTime)
            stages["send_to_log"].append((logged_at[origin] - at) * 1000)
            stages["log_to_output"].append((ts - logged_at[origin]) * 1000)
            stages["output_to_reader"].append((now - ts) * 1000)

    def pct(xs, q):
        if not xs:
            return float("nan")
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {"events": len(lines), "send_s": send_s, "outputs": len(lat_all), "decisions": len(lat_dec),
            "p50_ms": pct(lat_all, 0.5), "p99_ms": pct(lat_all, 0.99), "max_ms": max(lat_all, default=float("nan")),
            "dec_p50_ms": pct(lat_dec, 0.5), "dec_p99_ms": pct(lat_dec, 0.99),
            "stages": {k: (pct(v, 0.5), pct(v, 0.99)) for k, v in stages.items()},
            "mean_ms": statistics.fmean(lat_all) if lat_all else float("nan"),
            "worker_cpu_us_per_event": worker_cpu_s / max(1, len(lines)) * 1e6, "load": (load_before, load_after),
            "stalls": stalls}


STALL_MS = 40  # the latency run's worker logs event-loop stalls longer than this (streams/stalls.py)


def stall_lines(log_path: Path, start: int = 0) -> dict:
    """The worker's stall lines (streams.stalls) from byte `start` of its log: count, total and longest ms, and the
    places most often sampled."""
    from collections import Counter

    from streams.stalls import STALL_LOG_PREFIX

    held: list[float] = []
    places: Counter = Counter()
    text = ""
    if log_path.exists():
        with open(log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
    for line in text.splitlines():
        if STALL_LOG_PREFIX not in line:
            continue
        rest = line.split(STALL_LOG_PREFIX, 1)[1].strip()
        ms, _, where = rest.partition(" ms: ")
        held.append(float(ms))
        for part in where.split("; "):
            n, _, place = part.partition("x ")
            if place:
                places[place] += int(n) if n.isdigit() else 1
    return {"count": len(held), "total_ms": sum(held), "longest_ms": max(held, default=0.0),
            "places": places.most_common(5)}


def embedded(lines: list[bytes], work: Path) -> float:
    from chipledger.embedded import run_file

    path = work / "embedded.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    t0 = time.monotonic()
    run_file(path, work / "embedded-lake")
    return time.monotonic() - t0


def takeover(bootstrap: str, work: Path, lines: list[bytes], rate: int = 300) -> dict:
    """Two workers of a new group, a steady stream, kill -9 of one after 12 s: the longest output pause per
    input partition around the kill (see the module doc)."""
    import multiprocessing

    from streams.producer import LedgerProducer

    ctx = multiprocessing.get_context("spawn")
    ready, halt, count = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
    out_path = work / "takeover-outputs.json"
    reader = ctx.Process(target=output_consumer, args=(bootstrap, ready, halt, count, str(out_path)), daemon=True)
    reader.start()
    if not ready.wait(60):
        raise RuntimeError("the output consumer did not start")
    app_id = f"bench-to-{uuid.uuid4().hex[:6]}"
    procs = [worker_proc(bootstrap, work / f"to-w{k}", app_id, work / f"to-w{k}.log") for k in range(2)]
    try:
        time.sleep(12)  # both joined: the partitions are shared
        p = LedgerProducer(bootstrap, linger_ms=0)
        t0 = time.monotonic()
        killed_at = None
        for i, line in enumerate(lines):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            p.send(line)
            if killed_at is None and time.monotonic() - t0 >= 10:
                os.killpg(procs[0].pid, signal.SIGKILL)
                procs[0].wait()
                killed_at = time.time()
        p.flush(60)
        p.close()
        time.sleep(5)
    finally:
        halt.set()
        reader.join(60)
        for pr in procs:
            stop(pr)
    got = orjson.loads(out_path.read_bytes()) if out_path.exists() else []
    by_part: dict[int, list[float]] = {}
    for topic, origin, now, _ in got:
        if topic == TOPIC_JOURNAL:
            by_part.setdefault(origin[1], []).append(now)
    gaps = {}
    for part, times in by_part.items():
        times.sort()
        spans = [(b - a) for a, b in zip(times, times[1:]) if b >= killed_at and a <= killed_at + 60]
        gaps[part] = max(spans, default=0.0)
    return {"gaps_s": gaps, "takeover_s": max(gaps.values(), default=float("nan"))}


def print_latency(args, lat: dict) -> None:
    print(f"latency at {args.rate:,} events/s for {args.seconds:g} s ({lat['events']:,} events sent in "
          f"{lat['send_s']:.1f} s): outputs {lat['outputs']:,}: p50 {lat['p50_ms']:.0f} ms, p99 "
          f"{lat['p99_ms']:.0f} ms, max {lat['max_ms']:.0f} ms; decisions {lat['decisions']:,}: p50 "
          f"{lat['dec_p50_ms']:.0f} ms, p99 {lat['dec_p99_ms']:.0f} ms (target p99 < 250 ms)", flush=True)
    print("  per stage, p50 / p99: " + "; ".join(f"{k.replace('_', ' ')} {a:.0f} / {b:.0f} ms"
                                                 for k, (a, b) in lat["stages"].items()), flush=True)
    st = lat["stalls"]
    print(f"  load average {lat['load'][0]:.1f} -> {lat['load'][1]:.1f}; worker CPU {lat['worker_cpu_us_per_event']:.0f} "
          f"us per event; worker event-loop stalls > {STALL_MS} ms: {st['count']}, {st['total_ms']:.0f} ms in all, "
          f"longest {st['longest_ms']:.0f} ms", flush=True)
    for place, n in st["places"]:
        print(f"    {n:4d} samples  {place}", flush=True)


def print_repeats(runs: list[dict]) -> None:
    """Min and median over the latency runs of each figure."""
    figures = {"outputs p50": [r["p50_ms"] for r in runs], "outputs p99": [r["p99_ms"] for r in runs],
               "decisions p99": [r["dec_p99_ms"] for r in runs],
               "worker CPU us/event": [r["worker_cpu_us_per_event"] for r in runs]}
    for stage in runs[0]["stages"]:
        figures[f"{stage.replace('_', ' ')} p50"] = [r["stages"][stage][0] for r in runs]
        figures[f"{stage.replace('_', ' ')} p99"] = [r["stages"][stage][1] for r in runs]
    print(f"over {len(runs)} runs, min / median:", flush=True)
    for name, xs in figures.items():
        print(f"  {name}: {min(xs):.0f} / {statistics.median(xs):.0f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=60_000)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--bootstrap")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                    help="pass an option to `chipledger worker`, e.g. --worker-arg=--sequencer-wait-ms=5000")
    ap.add_argument("--latency-only", action="store_true",
                    help="only the latency run (after the worker folded a backlog of --events), with its stages")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="with --latency-only: N latency runs one after the other (new events each), min / median")
    ap.add_argument("--variant", action="append", default=[], metavar="ARGS",
                    help="with --latency-only: worker options (space-separated) of a variant; the runs alternate "
                         "between the worker as given and each variant, and min / median are printed per variant")
    ap.add_argument("--metrics-compare", type=int, metavar="N",
                    help="only compare the worker with and without /metrics (scraped every 5 s), N runs each")
    ap.add_argument("--faust-floor", type=int, help=argparse.SUPPRESS)  # child: the no-op Faust app
    ap.add_argument("--app-id", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    WORKER_ARGS[:] = args.worker_arg
    if args.faust_floor:
        faust_floor_child(args.bootstrap, args.faust_floor, args.app_id, args.work)
        return 0

    from streams import broker
    from streams.topics import create_topics

    tmp = Path(tempfile.mkdtemp(prefix="chipledger-bench-"))
    data_dir = None
    try:
        if args.bootstrap:
            bootstrap = args.bootstrap
        else:
            data_dir = tmp / "kafka"
            bootstrap = broker.up(port=free_port(), data_dir=data_dir, timeout_s=180, secure=False)["bootstrap_servers"]
        create_topics(bootstrap, partitions=3, timeout_s=60)
        variants = [""] + args.variant if args.latency_only else [""]
        more = int(args.rate * args.seconds) * (args.repeat * len(variants) if args.latency_only else 1)
        everything = scenario_lines(args.seed, args.events + more)
        lines, later = everything[: args.events], everything[args.events: args.events + more]
        print(f"scenario: {len(lines):,} events, then {len(later):,} more for the latency run, 3 pools; "
              f"broker {bootstrap}", flush=True)
        emit_s = emit(bootstrap, lines)
        print(f"emit (LedgerProducer, kafka-python): {emit_s:.1f} s = {len(lines) / emit_s:,.0f} events/s", flush=True)
        if args.metrics_compare:
            cmp = metrics_compare(bootstrap, tmp, len(lines), args.metrics_compare)
            for key, label in (("worker_cpu_s", "worker CPU"), ("seconds", "worker + sink wall")):
                c = cmp[key]
                print(f"{label}: without /metrics min {c['without'][0]:.2f} / median {c['without'][1]:.2f} s; with "
                      f"min {c['with'][0]:.2f} / median {c['with'][1]:.2f} s; ratio with/without min "
                      f"{c['ratio'][0]:.3f} / median {c['ratio'][1]:.3f}", flush=True)
            return 0
        if args.latency_only:  # a backlog of --events first (the worker's start), then the latency run alone
            res = pipeline(bootstrap, tmp, len(lines))
            print(f"worker + sink caught up with {len(lines):,} events in {res['seconds']:.1f} s", flush=True)
            each = int(args.rate * args.seconds)
            runs: dict[str, list] = {v: [] for v in variants}
            k = 0
            for r in range(args.repeat):
                for v in (variants if r % 2 == 0 else variants[::-1]):
                    lat = latency(bootstrap, tmp, args.rate, later[k * each:(k + 1) * each], res["app_id"],
                                  res["data_dir"], tuple(v.split()))
                    k += 1
                    print(f"run {r + 1} of {args.repeat}, worker {v or '(as given)'}:", flush=True)
                    print_latency(args, lat)
                    runs[v].append(lat)
            for v, rs in runs.items():
                if args.repeat > 1 or len(variants) > 1:
                    print(f"worker {v or '(as given)'}:", flush=True)
                    print_repeats(rs)
            return 0
        raw_s = asyncio.run(raw_read(bootstrap, len(lines)))
        raw_rate = len(lines) / raw_s
        print(f"raw aiokafka consumer: {raw_s:.2f} s = {raw_rate:,.0f} events/s", flush=True)
        fl = faust_floor(bootstrap, len(lines), tmp)
        fl_rate = fl["records"] / fl["seconds"]
        print(f"Faust floor (no-op agents, the worker's Faust settings): {fl['seconds']:.2f} s = {fl_rate:,.0f} "
              f"events/s; ratio to raw: {fl_rate / raw_rate:.3f}x", flush=True)
        res = pipeline(bootstrap, tmp, len(lines))
        rate = len(lines) / res["seconds"]
        print(f"worker + sink: {res['seconds']:.1f} s = {rate:,.0f} events/s (start-up {res['startup_s']:.1f} s, "
              f"total {res['total_s']:.1f} s); ratio to raw: {rate / raw_rate:.3f}x (target >= 0.5x); to the Faust floor: {rate / fl_rate:.2f}x", flush=True)
        print(f"  sink: {res['sink']}", flush=True)
        emb_s = embedded(lines, tmp)
        print(f"embedded run (chipledger run's fold, same events): {emb_s:.1f} s = {len(lines) / emb_s:,.0f} "
              f"events/s; worker + sink / embedded: {rate * emb_s / len(lines):.2f}x", flush=True)
        print_latency(args, latency(bootstrap, tmp, args.rate, later, res["app_id"], res["data_dir"]))
        to_lines = scenario_lines(args.seed + 1, 300 * 30, pools=8)[: 300 * 30]  # pools on every partition
        # on a broker of its own: a new group on this one would fold everything above first
        second = tmp / "kafka-takeover"
        bs2 = broker.up(port=free_port(), data_dir=second, timeout_s=180, secure=False)["bootstrap_servers"]
        try:
            create_topics(bs2, partitions=2, timeout_s=60)  # one partition per worker, pools on both
            to = takeover(bs2, tmp, to_lines)
        finally:
            broker.down(second, timeout_s=30)
        print(f"takeover after kill -9 of one of two workers: {to['takeover_s']:.1f} s (longest output pause per "
              f"input partition: {', '.join(f'{p}: {g:.1f} s' for p, g in sorted(to['gaps_s'].items()))})",
              flush=True)
    finally:
        if data_dir is not None:
            broker.down(data_dir, timeout_s=30)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
