"""The portal under load: p50/p99 latency and requests/s per route with concurrent clients, while the lake grows,
against the same server returning a static file (the limit), in one run.

    python bench/serve.py --lake LAKE --store URL [--seconds 10] [--clients 8] [--grow-every 3]

It starts `chipledger serve` (a child process, [serve] refresh_s = 1), creates a token, and for each route runs
`--clients` threads of back-to-back requests for `--seconds`. Meanwhile a writer commits a copy of one of the lake's
`events` files under a new name every `--grow-every` seconds (the lake grows: each commit makes the portal build a
new snapshot in the background, as the sink's commits do). `--rounds R` times the whole list R times (the static file
in each round: the limit under the same load). Per route and round it also says how many cores the server, the
bench's own clients and the whole machine used meanwhile (on a 2-core machine, Python clients can take one of them).
Prints one JSON document.

    python bench/serve.py --lake LAKE --store URL --in-process 200 [--profile-out FILE]

What each route costs per request in one thread, no contention: one snapshot built in this process (the lake is
read, not copied nor grown), then per route one request to warm it (the answers a snapshot keeps) and `--in-process`
requests one after the other through the ASGI application (httpx's ASGI transport, the routes' thread-pool work run
inline in the one thread): min, median, p99 ms and the median CPU ms; with `--profile-out`, each route's cProfile (by
cumulative time) written there. No HTTP parsing (uvicorn's) is in these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import httpx

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, max(0, int(round(q * len(v))) - 1))]


def _proc_cpu_s(pid: int) -> Optional[float]:
    """A process's CPU seconds (user + system, all its threads), or None where /proc does not say."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy() -> Optional[tuple[int, int]]:
    """(busy, total) jiffies of all the machine's cores since boot (/proc/stat), or None."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except OSError:
        return None
    idle = v[3] + v[4]  # idle + iowait
    return sum(v) - idle, sum(v)


def run_route(base: str, path: str, headers: dict, seconds: float, clients: int, server_pid: Optional[int] = None) -> dict:
    lat: list[float] = []
    errors = 0
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker():
        nonlocal errors
        mine, bad = [], 0
        with httpx.Client(base_url=base, headers=headers, timeout=30) as c:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                r = c.get(path)
                mine.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    bad += 1
        with lock:
            lat.extend(mine)
            errors += bad

    ts = [threading.Thread(target=worker) for _ in range(clients)]
    # who used the CPU meanwhile, in cores (1.0: one core all the time): the server, these clients (this process:
    # its writer and watcher too, which are idle most of the time); and the share of all the machine's cores busy
    # (every other session too: 1.0 is every core all the time)
    srv0 = _proc_cpu_s(server_pid) if server_pid else None
    me0 = sum(os.times()[:2])
    busy0 = _machine_busy()
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    took = time.monotonic() - t0
    srv1, me1, busy1 = (_proc_cpu_s(server_pid) if server_pid else None), sum(os.times()[:2]), _machine_busy()
    out = {"route": path, "requests": len(lat), "errors": errors, "rps": round(len(lat) / took, 1),
           "p50_ms": round(1000 * _pct(lat, 0.5), 2), "p99_ms": round(1000 * _pct(lat, 0.99), 2),
           "mean_ms": round(1000 * statistics.fmean(lat), 2) if lat else None,
           "clients_cores": round((me1 - me0) / took, 2)}
    if srv0 is not None and srv1 is not None:
        out["server_cores"] = round((srv1 - srv0) / took, 2)
    if busy0 is not None and busy1 is not None and busy1[1] > busy0[1]:
        out["machine_busy"] = round((busy1[0] - busy0[0]) / (busy1[1] - busy0[1]), 2)
    return out


def summarize(rounds: list[list[dict]]) -> list[dict]:
    """Per route over the rounds: each round's p50 and p99, and their min and median."""
    out = []
    for i, first in enumerate(rounds[0]):
        mine = [r[i] for r in rounds]
        p50s, p99s = [r["p50_ms"] for r in mine], [r["p99_ms"] for r in mine]
        out.append({"route": first["route"], "p50_ms": p50s, "p99_ms": p99s,
                    "p99_ms_min": min(p99s), "p99_ms_median": round(statistics.median(p99s), 2),
                    "p50_ms_median": round(statistics.median(p50s), 2),
                    "rps_median": round(statistics.median(r["rps"] for r in mine), 1),
                    "errors": sum(r["errors"] for r in mine)})
    return out


def _peak_rss_mib(pid: int):
    """The server's peak resident memory (VmHWM), MiB, or None where /proc does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024)
    except OSError:
        return None
    return None


def routes_for(job_id: str) -> list[str]:
    """The routes timed: the static file (the limit) first, then every read route a team's member uses."""
    return ["/static/portal.css", "/api/v1/pools", "/api/v1/teams/vision/balances", "/api/v1/queue?team=vision",
            f"/api/v1/jobs/{job_id}", "/api/v1/decisions?limit=100", "/api/v1/slos", "/api/v1/head-of-line",
            "/teams/vision", "/teams/vision/queue"]


def in_process(a) -> dict:
    import cProfile
    import io
    import pstats

    import asyncio

    import anyio.to_thread

    sys.path.insert(0, str(ROOT))
    from chipledger.config import load_config
    from chipledger.web.app import Portal, build_app
    from chipledger.web.auth import TokenCache, new_token
    from chipledger.web.lake import LakeReader
    from store.repo import open_store

    cfg = load_config(a.config, env={**os.environ, "CHIPLEDGER_SERVE_REQUESTS_PER_MINUTE": "0"})
    reader = LakeReader(a.lake, refresh_s=3600, slo=cfg.slo, duckdb_config=cfg.lake.duckdb_config())
    t0 = time.monotonic()
    reader.refresh(force=True)
    build_s = time.monotonic() - t0
    st = open_store(a.store)
    _, token = new_token(st, "bench", "vision")
    portal = Portal(cfg=cfg, reader=reader, store=st, tokens=TokenCache(st))
    app = build_app(portal)
    h = {"Authorization": f"Bearer {token}"}
    job_id = reader.snapshot.rows("SELECT job_id FROM portal_jobs WHERE team = 'vision' "
                                  "ORDER BY preemptions DESC, job_id LIMIT 1")[0]["job_id"]

    # every sync route and dependency runs inline, in this thread (the server runs them in its thread pool): what
    # a request costs is then this thread's time, and cProfile sees all of it
    async def inline(func, *args, **_):
        return func(*args)

    anyio.to_thread.run_sync = inline
    results, profiles = [], []

    async def timed() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench",
                                     headers=h) as client:
            for route in routes_for(job_id):
                t0 = time.perf_counter()
                r = await client.get(route)
                first_ms = 1000 * (time.perf_counter() - t0)
                if r.status_code != 200:
                    raise SystemExit(f"{route}: {r.status_code} {r.text[:300]}")
                lat, cpu = [], []
                prof = cProfile.Profile() if a.profile_out else None
                for _ in range(a.in_process):
                    t0, c0 = time.perf_counter(), time.thread_time()
                    if prof is not None:
                        prof.enable()
                    await client.get(route)
                    if prof is not None:
                        prof.disable()
                    lat.append(time.perf_counter() - t0)
                    cpu.append(time.thread_time() - c0)
                results.append({"route": route, "first_ms": round(first_ms, 2), "bytes": len(r.content),
                                "min_ms": round(1000 * min(lat), 2), "p50_ms": round(1000 * _pct(lat, 0.5), 2),
                                "p99_ms": round(1000 * _pct(lat, 0.99), 2),
                                "cpu_p50_ms": round(1000 * _pct(cpu, 0.5), 2)})
                if prof is not None:
                    buf = io.StringIO()
                    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
                    profiles.append(f"==== {route} ({a.in_process} requests)\n{buf.getvalue()}")

    asyncio.run(timed())
    if a.profile_out:
        a.profile_out.write_text("\n".join(profiles))
    return {"lake": str(a.lake), "mode": "in-process", "requests_per_route": a.in_process,
            "snapshot_build_s": round(build_s, 1), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "routes": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lake", type=Path, required=True, help="a lake to copy (the copy grows; the original is kept)")
    ap.add_argument("--store", required=True)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--grow-every", type=float, default=3.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/chipledger-bench-serve"))
    ap.add_argument("--config", type=Path, default=None,
                    help="chipledger.toml for the server ([lake] memory_limit and spill_dir bound each snapshot's "
                         "DuckDB: a large lake's snapshot outgrows DuckDB's default of 80%% of the memory twice over, "
                         "the current one and the one being built)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every route (the static file too) this many times, one after the other, on the same "
                         "server: the summary gives each route's p99 per round, min and median")
    ap.add_argument("--in-process", type=int, default=0, metavar="N",
                    help="time each route's N requests in this process, one at a time (no server, no growth)")
    ap.add_argument("--profile-out", type=Path, default=None, help="with --in-process: each route's cProfile here")
    a = ap.parse_args()
    if a.in_process:
        print(json.dumps(in_process(a), indent=2))
        return
    py = sys.executable
    shutil.rmtree(a.work, ignore_errors=True)
    lake = a.work / "lake"
    shutil.copytree(a.lake, lake)
    # the bench's clients share one user's token: the per-user rate limit ([serve] requests_per_minute) off
    env = {**os.environ, "CHIPLEDGER_SERVE_REFRESH_S": "1", "CHIPLEDGER_SERVE_REQUESTS_PER_MINUTE": "0",
           "PYTHONWARNINGS": "ignore"}
    tok = subprocess.run([py, "-m", "chipledger.cli", "serve", "tokens", "create", "--user", "bench", "--team",
                          "vision", "--store", a.store], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    token = tok.stdout.strip().splitlines()[-1]
    port = _free_port()
    config = ["--config", str(a.config)] if a.config else []
    server = subprocess.Popen([py, "-m", "chipledger.cli", "serve", "--lake", str(lake), "--store", a.store,
                               "--port", str(port), *config], cwd=ROOT, env=env,
                              stderr=(a.work / "serve.err").open("w"))  # a file: a pipe no one reads would fill up
    base = f"http://127.0.0.1:{port}"
    h = {"Authorization": f"Bearer {token}"}
    try:
        t_start = time.monotonic()
        for _ in range(36000):  # a 10M-event lake's first snapshot takes minutes
            if server.poll() is not None:  # the server refused the lake (or failed): say why, do not wait on
                raise SystemExit(f"chipledger serve exited ({server.returncode}): "
                                 f"{(a.work / 'serve.err').read_text().strip()[-2000:]}")
            try:
                if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        first_build_s = round(time.monotonic() - t_start, 1)
        job = httpx.get(base + "/api/v1/decisions?limit=1", headers=h).json()
        first = httpx.get(base + "/api/v1/queue?team=vision", headers=h).json()["queue"]
        job_id = first[0]["job_id"] if first else None
        if job_id is None:
            sys.path.insert(0, str(ROOT))
            from analytics.views import connect

            job_id = connect(a.lake).execute("SELECT job_id FROM jobs WHERE team = 'vision' "
                                             "ORDER BY preemptions DESC LIMIT 1").fetchone()[0]
        routes = routes_for(job_id)
        stop = threading.Event()
        grown = []

        def grow():
            # as the sink does: a new events file, then a commit that names it (a file only dropped beside the others
            # is not part of the lake)
            sys.path.insert(0, str(ROOT))
            from analytics.commits import commit, open_lake

            files = open_lake(lake, ("events",)).table_files("events") or []
            i = 0
            while not stop.wait(a.grow_every):
                src = Path(files[i % len(files)])
                dst = src.with_name(f"grown-{i:05d}-{src.name}")
                shutil.copyfile(src, dst)
                commit(lake, add={"events": [dst.relative_to(lake).as_posix()]}, by="bench-serve")
                grown.append(dst.stat().st_size)
                i += 1

        builds = []

        def watch():
            # each snapshot the server swaps in: how long it took to build and to compute the previous one's answers
            seen = None
            while not stop.wait(0.5):
                try:
                    hz = httpx.get(base + "/healthz", timeout=5).json()
                except httpx.HTTPError:
                    continue
                if hz["snapshot"] != seen:
                    seen = hz["snapshot"]
                    builds.append({k: hz.get(k) for k in ("snapshot", "build_s", "rewarm_s")})

        g = threading.Thread(target=grow, daemon=True)
        w = threading.Thread(target=watch, daemon=True)
        load_before = os.getloadavg()
        g.start()
        w.start()
        rounds = []
        for _ in range(a.rounds):
            rounds.append([run_route(base, r, h, a.seconds, a.clients, server.pid) for r in routes])
        stop.set()
        g.join()
        w.join()
        health = httpx.get(base + "/healthz").json()
        out = {"lake": str(a.lake), "clients": a.clients, "seconds_per_route": a.seconds,
               "files_added_while_running": len(grown), "snapshots_built": health["snapshot"],
               "server_ready_s": first_build_s, "snapshots_seen": builds,
               "server_peak_rss_mib": _peak_rss_mib(server.pid),
               "cpus": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "rounds": a.rounds, "summary": summarize(rounds), "routes": rounds, "decision_sample": bool(job)}
        print(json.dumps(out, indent=2))
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
