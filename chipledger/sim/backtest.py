"""`chipledger backtest`: the demand of a real log replayed through the simulated cluster
(`chipledger.sim.simcluster`) under one or more configurations, with the ledger core deciding as it would live.

The demand is what the log says each job asked for: its pool, team, chips, priority, whether it may be
preempted, when it was submitted, and how long it ran (the sum of its observed runs). Capacity is the chips
registered per pool; quotas are the log's grants, overridden per configuration by `[backtest] quota` or
`--quota`. What the cluster then does (when jobs start, who is preempted) is simulated; docs/backtest.md says
how, and what that leaves out. Fidelity: the simulated waits against the observed ones, per pool.
"""

from __future__ import annotations

import json
import math
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from chipledger.sim.simcluster import BurstRequest, Cluster, SimJob, SimPool
from schemas import Rejection, parse_payload
from schemas.events import epoch_s

MILLI = 1000


class BacktestError(ValueError):
    """Bad input to a backtest (file, quota text): the CLI prints it without a traceback. `exit_code` follows
    docs/cli.md's scheme: 2 for a wrong option value or an unknown name, 1 for a file that cannot be used."""

    exit_code = 1


class BacktestUsageError(BacktestError):
    exit_code = 2


@dataclass
class Demand:
    """What a log asked for, and what it observed."""

    pools: dict = field(default_factory=dict)        # pool -> [chips registered, chips_per_node, flavor]
    quotas: dict = field(default_factory=dict)       # pool -> team -> chips granted (revokes applied)
    jobs: list = field(default_factory=list)         # SimJob, observed demand
    observed_wait: dict = field(default_factory=dict)  # job id -> observed first start - submit (s)
    bursts: list = field(default_factory=list)
    # pool -> [(instant, price.set fields)]: every price setting of the log, in the log's order, at the instant the
    # log's pool clock had reached when it came (its event time, or later for a late event): the simulated pool is
    # sent the same settings at the same instants, and the fold's own price rules (ledger/costs.py: effective
    # forward, bands, a setting replacing an earlier one of its id) price the simulated use (DESIGN §9)
    prices: dict = field(default_factory=dict)
    start: int = 0
    end: int = 0
    lines: int = 0
    invalid: int = 0
    first_invalid: str = ""


def parse_quota(text: str, pools, teams=None, allow_new_team: bool = False) -> dict:
    """`team=chips,…` (in every pool) or `pool:team=chips,…` as {pool: {team: chips}}. With `teams` (the log's),
    a team the log does not know is an error naming the known ones, unless `allow_new_team`: a typo never
    becomes a new team silently."""
    out: dict = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, eq, value = part.rpartition("=")
        if not eq or not name:
            raise BacktestUsageError(f"quota {part!r}: expected team=chips or pool:team=chips")
        try:
            chips = float(value)
        except ValueError:
            raise BacktestUsageError(f"quota {part!r}: {value!r} is not a number of chips") from None
        if not math.isfinite(chips) or chips < 0:
            raise BacktestUsageError(f"quota {part!r}: chips must be a non-negative number")
        pool, colon, team = name.rpartition(":")
        targets = [pool] if colon else list(pools)
        if colon and pool not in pools:
            raise BacktestUsageError(f"quota {part!r}: no pool {pool!r} in the log (pools: {', '.join(sorted(pools))})")
        if not team:
            raise BacktestUsageError(f"quota {part!r}: empty team name")
        if teams is not None and team not in teams and not allow_new_team:
            raise BacktestUsageError(f"quota {part!r}: no team {team!r} in the log (teams: {', '.join(sorted(teams))}); "
                                f"--new-team to add a team the log does not have")
        for p in targets:
            out.setdefault(p, {})[team] = chips
    return out


def _demand_record(raw: bytes):
    """What load_demand needs of one line: None for a blank line; ("invalid", why) for a line that is not a valid
    event; else (occurred second, type, pool, the type's fields, or None for a type the demand does not use). A
    function of the line alone, so lines can be read in any process and applied in file order in one."""
    if not raw.strip():
        return None
    try:
        e = parse_payload(json.loads(raw))
    except (ValueError, TypeError) as err:
        return ("invalid", f"not JSON ({err})")
    if isinstance(e, Rejection):
        return ("invalid", f"{getattr(e.code, 'value', e.code)}: {e.detail}")
    t = epoch_s(e.occurred_at)
    typ = e.type
    if typ == "pool.configured":
        fields: Optional[tuple] = (e.chips_per_node, e.flavor)
    elif typ in ("chip.registered", "chip.retired"):
        fields = ()
    elif typ == "quota.granted":
        fields = (e.grant_id, e.team, e.chips_milli)
    elif typ == "quota.revoked":
        fields = (e.grant_id,)
    elif typ == "price.set":
        fields = (e.model_dump(mode="json", include={"price_id", "per_chip_hour", "unit", "effective_from",
                                                     "effective_until", "hours_of_week"}, exclude_none=True),)
    elif typ == "job.submitted":
        fields = (e.job_id, e.team, e.chips_milli, e.priority, e.preemptible)
    elif typ in ("job.started", "job.preempted", "job.finished"):
        fields = (e.job_id,)
    elif typ == "burst.requested":
        fields = (e.request_id, e.team, e.chips_milli, epoch_s(e.window_start), epoch_s(e.window_end))
    else:
        fields = None
    return (t, typ, e.pool, fields)


class _DemandReader:
    """load_demand's state while it applies the lines' records in file order."""

    def __init__(self) -> None:
        self.d = Demand()
        self.grants: dict = {}  # grant id -> (pool, team, chips)
        self.subs: dict = {}    # job id -> [pool, team, milli, prio, preemptible, submitted]
        self.run_start: dict = {}
        self.ran: dict = {}
        self.first_start: dict = {}
        self.ended: dict = {}
        self.t_min: Optional[int] = None
        self.t_max: Optional[int] = None
        self.clock: dict = {}  # pool -> the latest event time of the pool so far (the pool clock the log reached)

    def invalid(self, lineno: int, why: str) -> None:
        d = self.d
        d.lines += 1
        d.invalid += 1
        if not d.first_invalid:
            d.first_invalid = f"line {lineno}: {why}"

    def times(self, t_min: int, t_max: int) -> None:
        """The earliest and latest occurred times of events applied elsewhere (their types unused here)."""
        self.t_min = t_min if self.t_min is None or t_min < self.t_min else self.t_min
        self.t_max = t_max if self.t_max is None or t_max > self.t_max else self.t_max

    def seen(self, pool: str, t: int) -> None:
        """Events of `pool` applied elsewhere (their types unused here) reached time `t`: the pool's clock."""
        if t > self.clock.get(pool, t - 1):
            self.clock[pool] = t

    def apply(self, t: int, typ: str, pool: str, f: Optional[tuple]) -> None:
        d = self.d
        d.lines += 1
        self.t_min = t if self.t_min is None or t < self.t_min else self.t_min
        self.t_max = t if self.t_max is None or t > self.t_max else self.t_max
        if t > self.clock.get(pool, t - 1):
            self.clock[pool] = t
        if f is None:
            return
        if typ == "pool.configured":
            p = d.pools.setdefault(pool, [0, f[0] or 8, f[1]])
            p[1], p[2] = f[0] or p[1], f[1]
        elif typ == "chip.registered":
            d.pools.setdefault(pool, [0, 8, "unknown"])[0] += 1
        elif typ == "chip.retired":
            if pool in d.pools:
                d.pools[pool][0] -= 1
        elif typ == "quota.granted":
            self.grants[f[0]] = (pool, f[1], f[2] / MILLI)
        elif typ == "quota.revoked":
            self.grants.pop(f[0], None)
        elif typ == "price.set":
            d.prices.setdefault(pool, []).append((self.clock[pool], f[0]))
        elif typ == "job.submitted":
            if f[0] not in self.subs:
                self.subs[f[0]] = [pool, f[1], f[2], f[3], f[4], t]
        elif typ == "job.started":
            self.run_start[f[0]] = t
            self.first_start.setdefault(f[0], t)
        elif typ in ("job.preempted", "job.finished"):
            s0 = self.run_start.pop(f[0], None)
            if s0 is not None:
                self.ran[f[0]] = self.ran.get(f[0], 0) + (t - s0)
            if typ == "job.finished":
                self.ended[f[0]] = t
        elif typ == "burst.requested":
            d.bursts.append(BurstRequest(pool, t, f[0], f[1], f[2] / MILLI, f[3], f[4]))

    def demand(self, path: Path, days: Optional[float]) -> Demand:
        d, t_min, t_max = self.d, self.t_min, self.t_max
        if t_min is None or t_max is None:
            raise BacktestError(f"{path}: no valid events ({d.invalid} invalid line(s)"
                                f"{'; ' + d.first_invalid if d.first_invalid else ''})")
        d.start, d.end = t_min, t_max
        for pool, team, chips in self.grants.values():
            q = d.quotas.setdefault(pool, {})
            q[team] = q.get(team, 0) + chips
        limit = None if days is None else t_min + int(days * 86400)
        for jid, (pool, team, milli, prio, preemptible, sub) in self.subs.items():
            if limit is not None and sub >= limit:
                continue
            if pool not in d.pools or d.pools[pool][0] <= 0:
                continue
            s0 = self.run_start.get(jid)
            work = self.ran.get(jid, 0) + ((t_max - s0) if s0 is not None else 0)
            if jid in self.first_start:
                d.observed_wait[jid] = self.first_start[jid] - sub
                job = SimJob(jid, pool, team, milli, prio, sub, max(work, 1), preemptible)
            else:  # never started in the log: it waits, and leaves its queue when it left the log's
                job = SimJob(jid, pool, team, milli, prio, sub, max(work, 1), preemptible,
                             cancel_at=max(self.ended.get(jid, t_max), sub))
            d.jobs.append(job)
        d.jobs.sort(key=lambda j: (j.submitted, j.jid))
        return d


def load_demand(path: Path, days: Optional[float] = None, jobs: int = 1) -> Demand:
    """Read an event log (JSONL, the wire contract) into the demand of a backtest. Lines that are not valid
    events are counted and skipped (the first one is named). `days`: only jobs submitted within that many days
    of the log's first event. With `jobs` > 1 (where processes can fork) the lines are parsed (the cost of
    reading a log) by that many processes, a part of the file each, and applied here in file order: the same
    demand as with one."""
    try:
        fh = open(path, "rb")
    except OSError as err:
        raise BacktestError(f"cannot read {path}: {err.strerror}") from None
    reader = _DemandReader()
    with fh:
        parts = _file_parts(fh, jobs)
        if len(parts) < 2:
            for lineno, raw in enumerate(fh, 1):
                rec = _demand_record(raw)
                if rec is None:
                    continue
                if rec[0] == "invalid":
                    reader.invalid(lineno, rec[1])
                else:
                    reader.apply(*rec)
        else:
            _read_in_processes(path, parts, jobs, reader)
    return reader.demand(path, days)


#: the least bytes of the file a process parses at a time (smaller logs are read by one process)
PART_MIN_BYTES = 1 << 20
#: the most (the records of a part wait in memory until the parts before it are applied)
PART_MAX_BYTES = 16 << 20


def _file_parts(fh, jobs: int) -> list[tuple[int, int]]:
    """(start, end) byte ranges of the file, each beginning a line, about 4 per process (so a slow part holds
    the others up little), each between PART_MIN_BYTES and PART_MAX_BYTES; [] for one process or a small file."""
    import multiprocessing
    import os

    size = os.fstat(fh.fileno()).st_size
    if jobs < 2 or size < 2 * PART_MIN_BYTES or "fork" not in multiprocessing.get_all_start_methods():
        return []
    step = min(PART_MAX_BYTES, max(PART_MIN_BYTES, size // (4 * jobs)))
    starts = [0]
    while starts[-1] + step < size:
        fh.seek(starts[-1] + step)
        fh.readline()  # the rest of the line the step lands in belongs to this part
        if fh.tell() >= size:
            break
        starts.append(fh.tell())
    fh.seek(0)
    return list(zip(starts, starts[1:] + [size]))


_PARTS: list = []  # (path, parts) of a parallel read, inherited by its forked processes


def _read_part(i: int) -> tuple:
    """The records of part i of the file: (lines in the part, [(line in the part, record)] of the invalid lines and
    of the events the demand uses, the other valid events: their number, earliest and latest times (None when
    none)). The other events' times move their pools' clocks (what a price takes effect at): a ("clock", pool, t)
    record before each price of the pool, and one per pool at the part's end."""
    path, parts = _PARTS
    start, end = parts[i]
    out: list = []
    t_min = t_max = None
    n = other = 0
    skipped: dict = {}  # pool -> the latest time of its skipped events not yet sent (the pool clock they reached)
    with open(path, "rb") as fh:
        fh.seek(start)
        pos = start
        while pos < end:
            raw = fh.readline()
            if not raw:
                break
            pos += len(raw)
            n += 1
            rec = _demand_record(raw)
            if rec is None:
                continue
            if rec[0] != "invalid" and rec[3] is None:  # only its time counts: kept as the part's min and max
                t = rec[0]
                t_min = t if t_min is None or t < t_min else t_min
                t_max = t if t_max is None or t > t_max else t_max
                if t > skipped.get(rec[2], t - 1):
                    skipped[rec[2]] = t
                other += 1
            else:
                if rec[0] != "invalid" and rec[1] == "price.set" and rec[2] in skipped:
                    # a price takes effect at the pool clock: the pool's events skipped before it move it first
                    out.append((n, ("clock", rec[2], skipped.pop(rec[2]))))
                out.append((n, rec))
    out.extend((n, ("clock", pool, t)) for pool, t in skipped.items())  # for the prices of later parts
    return n, out, other, t_min, t_max


def _read_in_processes(path: Path, parts: list, jobs: int, reader: _DemandReader) -> None:
    """The parts parsed by `jobs` forked processes; their records applied here in file order as they come."""
    _PARTS[:] = [path, parts]
    try:
        size = parts[-1][1]
        part = (lambda i: f"reading {path}: the process parsing part {i + 1} of {len(parts)} (bytes "
                          f"{parts[i][0]:,}-{parts[i][1]:,} of {size:,})")
        with closing(_in_processes(_read_part, len(parts), jobs, part)) as results:
            first = 0  # the line number before the part
            for n, records, other, t_min, t_max in results:
                for k, rec in records:
                    if rec[0] == "invalid":
                        reader.invalid(first + k, rec[1])
                    elif rec[0] == "clock":
                        reader.seen(rec[1], rec[2])
                    else:
                        reader.apply(*rec)
                reader.d.lines += other
                if t_min is not None:
                    reader.times(t_min, t_max)
                first += n
    finally:
        _PARTS.clear()


def _pct(xs: list, p: float) -> Optional[float]:
    """Nearest-rank percentile of sorted xs."""
    if not xs:
        return None
    k = max(0, min(len(xs) - 1, math.ceil(p * len(xs)) - 1))
    return float(xs[k])


def _waits(waits: list) -> dict:
    w = sorted(waits)
    return {"jobs": len(w), "p50_s": _pct(w, 0.50), "p90_s": _pct(w, 0.90), "p99_s": _pct(w, 0.99)}


def run_backtest(demand: Demand, fold_config, quotas: dict, sched_slo_s: int = 600, act_delay_s: int = 10,
                 coop_share: float = 0.0) -> dict:
    """One configuration over the demand: the figures of the report (plain data, JSON-ready)."""
    import copy

    jobs = [copy.copy(j) for j in demand.jobs]
    pools = [SimPool(p, v[0], v[1], v[2]) for p, v in sorted(demand.pools.items()) if v[0] > 0]
    cluster = Cluster(pools, quotas, fold_config, act_delay_s=act_delay_s, coop_share=coop_share,
                      source="backtest", prices=demand.prices)
    res = cluster.run(jobs, demand.bursts, t0=demand.start)
    if demand.prices:  # the books closed at the end: the last hour's use priced too
        cluster.fleet.close()
        cluster.costs.extend(cluster.fleet.close_facts().get("costs", []))
    per_team: dict = {}
    per_pool: dict = {}
    never: dict = {}
    honoured = quick = 0
    for j in jobs:
        if j.in_quota_at_submit:
            honoured += 1
            if j.first_start is not None and j.first_start - j.submitted <= sched_slo_s:
                quick += 1
        if j.first_start is None:
            never[j.team] = never.get(j.team, 0) + 1
            continue
        w = j.first_start - j.submitted
        per_team.setdefault(j.team, []).append(w)
        per_pool.setdefault(j.pool, []).append(w)
    used = sum(res.used_mchip_s.values())
    cap = sum(res.capacity_mchip_s.values())
    borrowed = sum(res.borrowed_mchip_s.values())
    return {
        "quota": {p: dict(sorted(q.items())) for p, q in sorted(quotas.items())},
        "quota_honoured": (quick / honoured) if honoured else None,
        "in_quota_jobs": honoured,
        "waits_by_team": {t: _waits(w) for t, w in sorted(per_team.items())},
        "waits_by_pool": {p: _waits(w) for p, w in sorted(per_pool.items())},
        "never_started_by_team": dict(sorted(never.items())),
        "lost_work_chip_h": res.lost_mchip_s / MILLI / 3600,
        "preemptions": res.preemptions,
        "decisions": res.decisions,
        "utilisation": used / cap if cap else None,
        "utilisation_by_pool": {p: (res.used_mchip_s[p] / res.capacity_mchip_s[p]) if res.capacity_mchip_s[p]
                                else None for p in sorted(res.capacity_mchip_s)},
        "borrowed_share": borrowed / used if used else 0.0,
        "fairness": {"f_excess_of_victims": (res.f_excess_sum / res.f_excess_chips) if res.f_excess_chips else None,
                     "jain_usage_per_share_borrowers": (res.jain_sum / res.jain_n) if res.jain_n else None},
        "bursts": dict(res.bursts),
        "events_folded": res.events,
        "jobs": len(jobs),
        "cost": _cost(cluster.costs, demand.prices),
    }


def _timed(args) -> dict:
    """run_backtest of one configuration, with its `seconds`."""
    import time

    t0 = time.perf_counter()
    r = run_backtest(args[0], args[1], args[2], sched_slo_s=args[3], act_delay_s=args[4], coop_share=args[5])
    r["seconds"] = round(time.perf_counter() - t0, 3)
    return r


_SWEEP: list = []  # the configurations of a parallel sweep, inherited by its forked processes


def _sweep_one(i: int) -> dict:
    return _timed(_SWEEP[i])


def _simulate(runs: list, jobs: int, names: Optional[list] = None) -> list[dict]:
    """The reports of the configurations `runs` (run_backtest's arguments, named `names`), in their order: one at a
    time, or up to `jobs` at once in forked processes (each configuration folds the whole demand in its own
    process)."""
    import multiprocessing

    jobs = min(jobs, len(runs))
    if jobs < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return [_timed(a) for a in runs]
    names = names or [f"#{i + 1}" for i in range(len(runs))]
    _SWEEP[:] = runs
    try:
        with closing(_in_processes(_sweep_one, len(runs), jobs,
                                   lambda i: f"the process simulating configuration {names[i]!r}")) as results:
            return list(results)
    finally:
        _SWEEP.clear()


class BacktestProcessDied(BacktestError):
    """A process of a parallel backtest (`--jobs`) stopped without its answer: killed (the kernel's out-of-memory
    killer, kill -9), crashed, or exited. Not bad input, but one clear line all the same (exit code 1)."""


def _in_processes(work, n: int, jobs: int, what) -> Iterator:
    """`work(i)` for i in 0..n-1 by up to `jobs` forked processes, each given its next i when it answers the last;
    the answers yielded in the order of i. A process that dies while it works (a signal: the OOM killer, kill -9, a
    segmentation fault; an exit) ends this at once with BacktestProcessDied: `what(i)` and how it ended (a pool of
    multiprocessing waits forever for the answer of a dead worker: CI hung on it). An exception of `work(i)` is
    raised here. The processes ignore SIGINT: Ctrl-C reaches the whole process group, and this process's
    KeyboardInterrupt (or any error, or closing the generator) ends them. Use it in `contextlib.closing`."""
    import multiprocessing
    import multiprocessing.connection

    from chipledger.parallel import end_processes, how_it_ended

    ctx = multiprocessing.get_context("fork")
    procs: list = []
    conns: list = []
    doing: list = []  # the i each process works on (None: idle)
    answers: dict = {}
    todo = iter(range(n))

    def give(k: int) -> None:
        i = next(todo, None)
        doing[k] = i
        if i is not None:
            try:
                conns[k].send(i)
            except OSError:  # (the pipe's other end is gone: the process died between two answers)
                raise BacktestProcessDied(f"{what(i)} stopped: {how_it_ended(procs[k])}") from None

    try:
        for k in range(min(jobs, n)):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=_backtest_worker, args=(work, what, child_end, list(conns)),
                            name=f"chipledger-backtest-{k}", daemon=True)
            with _sigint_held():  # (a Ctrl-C between the fork and the append would leave the process running)
                p.start()
                procs.append(p)
            child_end.close()
            conns.append(parent_end)
            doing.append(None)
            give(k)
        for i in range(n):
            while i not in answers:
                busy = [k for k in range(len(procs)) if doing[k] is not None]
                ready = set(multiprocessing.connection.wait([conns[k] for k in busy] +
                                                            [procs[k].sentinel for k in busy]))
                for k in busy:
                    if conns[k] not in ready and procs[k].sentinel not in ready:
                        continue
                    try:  # (a dead process's pipe reads its last answer, if any, then end of file)
                        status, got = conns[k].recv() if conns[k].poll() else (None, None)
                    except (EOFError, OSError):
                        status = None
                    if status is None:
                        raise BacktestProcessDied(f"{what(doing[k])} stopped: {how_it_ended(procs[k])}")
                    if status != "ok":
                        raise got
                    answers[doing[k]] = got
                    give(k)
            yield answers.pop(i)
        for c in conns:
            try:
                c.send(None)  # the end: each process returns
            except OSError:  # (one that died after its last answer: nothing of it is missing)
                pass
        for p in procs:
            p.join()
    finally:
        end_processes(procs, conns)


@contextmanager
def _sigint_held():
    """SIGINT held back while the block runs (in the main thread; elsewhere a no-op): a Ctrl-C raises
    KeyboardInterrupt where the block ends."""
    import signal
    import threading

    held = hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
    if held:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        if held:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _backtest_worker(work, what, conn, others: list) -> None:
    """A process of `_in_processes`: answers ("ok", work(i)) or ("error", the exception) for each i it receives, until
    None (or the end of the pipe)."""
    import signal
    import traceback

    from chipledger.embedded import forked_child

    # Ctrl-C reaches the whole process group: the backtest's process decides (it ends this one), so no second
    # KeyboardInterrupt and traceback from here
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # (forked while the backtest's process held SIGINT back)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    forked_child()  # what came with the fork is not this process's garbage
    for c in others:  # the other processes' pipes, which came with the fork: not this one's to hold open
        c.close()
    while True:
        try:
            i = conn.recv()
        except EOFError:
            return
        if i is None:
            return
        try:
            answer = ("ok", work(i))
        except Exception as exc:  # noqa: BLE001 - raised in the backtest's process
            if not isinstance(exc, BacktestError):  # (a bug: where it happened, in the traceback printed there)
                exc.add_note("".join(["in a process of the backtest:\n", *traceback.format_tb(exc.__traceback__)]))
            answer = ("error", exc)
        try:
            conn.send(answer)
        except OSError:  # the backtest's process is gone
            return
        except Exception as exc:  # noqa: BLE001 - an answer that does not pickle (nothing of it was sent)
            conn.send(("error", BacktestError(f"{what(i)} could not send its answer: {type(exc).__name__}: {exc}")))


def _cost(rows: list, prices: dict) -> dict:
    """The simulated use and idle chips priced by the fold (the log's prices, `Demand.prices`), per unit, and the
    share of the teams' priced use in peak hours (priced by a band: a price id the log sets with hours of the week;
    a price raised for every hour is not a peak): what a price band does to the peaks. Empty when the log sets no
    price (cost unknown, not zero)."""
    banded = {(pool, f["price_id"]) for pool, settings in prices.items() for _, f in settings
              if f.get("hours_of_week") is not None}
    out: dict = {}
    for r in rows:
        u = out.setdefault(r.unit, {"use": 0, "idle": 0, "use_mchip_s": 0, "peak_mchip_s": 0})
        if r.team is not None:
            u["use"] += r.cost_scaled
            u["use_mchip_s"] += r.amount_mchip_s
            if (r.pool, r.price_id) in banded:
                u["peak_mchip_s"] += r.amount_mchip_s
        elif r.account == "idle":
            u["idle"] += r.cost_scaled
    return {unit: {"use": u["use"] / 3_600_000, "idle": u["idle"] / 3_600_000,
                   "peak_share": u["peak_mchip_s"] / u["use_mchip_s"] if u["use_mchip_s"] else None}
            for unit, u in sorted(out.items())}


def observed(demand: Demand) -> dict:
    """The observed waits of the log, per pool and team (jobs that started in the log)."""
    per_pool: dict = {}
    per_team: dict = {}
    for j in demand.jobs:
        w = demand.observed_wait.get(j.jid)
        if w is None:
            continue
        per_pool.setdefault(j.pool, []).append(w)
        per_team.setdefault(j.team, []).append(w)
    return {"waits_by_pool": {p: _waits(w) for p, w in sorted(per_pool.items())},
            "waits_by_team": {t: _waits(w) for t, w in sorted(per_team.items())}}


def fidelity(sim: dict, obs: dict) -> dict:
    """Per pool: simulated − observed p50/p90/p99 (seconds)."""
    out = {}
    for p, o in obs["waits_by_pool"].items():
        s = sim["waits_by_pool"].get(p)
        row = {}
        for k in ("p50_s", "p90_s", "p99_s"):
            sv = s[k] if s else None
            ov = o[k]
            row[k] = {"simulated": sv, "observed": ov, "gap": (sv - ov) if sv is not None and ov is not None else None}
        out[p] = row
    return out


# ---------------------------------------------------------------------------------------------------------
# the page
# ---------------------------------------------------------------------------------------------------------

def _mpl(text: str) -> str:
    """A label for matplotlib: `$` would start mathtext (an untrusted team name could break the chart)."""
    return text.replace("\\", "\\\\").replace("$", r"\$")


def _fmt(v, kind="s") -> str:
    if v is None:
        return "–"
    if kind == "pct":
        return f"{v:.1%}"
    if kind == "f":
        return f"{v:.3f}"
    if kind == "h":
        return f"{v:,.1f}"
    return f"{v:,.0f}"


def svg_text(fig) -> str:
    """The figure as inline SVG without the date matplotlib stamps in: the same report gives the same page."""
    import io

    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": "chipledger-backtest"}):  # element ids from a fixed salt
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _gap(v) -> str:
    return "–" if v is None else f"{v:+,.0f}"


def html_report(report: dict) -> str:
    """The report as one self-contained page: tables side by side and charts (every string escaped)."""
    from chipledger.reports.charts import Figure, html_page, html_table

    names = list(report["configs"])
    rows = []
    for label, key, kind in (("quota honoured", "quota_honoured", "pct"),
                             ("lost work, chip-h", "lost_work_chip_h", "h"),
                             ("preemptions", "preemptions", "s"), ("utilisation", "utilisation", "pct"),
                             ("borrowed share of use", "borrowed_share", "pct")):
        rows.append([label] + [_fmt(report["configs"][n][key], kind) for n in names])
    rows.append(["F excess of victims"] + [_fmt(report["configs"][n]["fairness"]["f_excess_of_victims"], "f")
                                            for n in names])
    rows.append(["Jain's index, usage/share of borrowers"] +
                [_fmt(report["configs"][n]["fairness"]["jain_usage_per_share_borrowers"], "f") for n in names])
    rows.append(["bursts approved / partial / denied"] +
                ["{approved} / {partial} / {denied}".format(**{k: report["configs"][n]["bursts"].get(k, 0)
                                                              for k in ("approved", "partial", "denied")})
                 for n in names])
    blocks = [("Side by side", html_table(["figure"] + names, rows))]
    teams = sorted({t for n in names for t in report["configs"][n]["waits_by_team"]})
    wrows = []
    for t in teams:
        row = [t]
        for n in names:
            w = report["configs"][n]["waits_by_team"].get(t)
            row.append(" / ".join(_fmt(w[k]) for k in ("p50_s", "p90_s", "p99_s")) if w else "–")
        wrows.append(row)
    blocks.append(("Waits per team, p50 / p90 / p99 (s)", html_table(["team"] + names, wrows)))
    # chart: p90 wait per team, one bar per configuration
    fig = Figure(figsize=(9, max(2.5, 0.5 * len(teams) * max(1, len(names)) / 2 + 1.4)), layout="constrained")
    ax = fig.add_subplot()
    h = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        vals = [(report["configs"][n]["waits_by_team"].get(t) or {}).get("p90_s") or 0 for t in teams]
        ax.barh([y + i * h for y in range(len(teams))], vals, h, label=_mpl(n))
    ax.set_yticks([y + 0.4 - h / 2 for y in range(len(teams))], [_mpl(t) for t in teams])
    ax.invert_yaxis()
    ax.set_xlabel("p90 wait, first start − submit (s)")
    ax.legend(frameon=False)
    ax.set_title("p90 wait per team")
    blocks.append(("Chart: p90 wait per team", svg_text(fig)))
    fig = Figure(figsize=(9, 3), layout="constrained")
    ax = fig.add_subplot()
    ax.bar([_mpl(n) for n in names], [report["configs"][n]["lost_work_chip_h"] for n in names], color="#c92a2a")
    ax.set_ylabel("chip-hours")
    ax.set_title("Work lost to preemptions")
    blocks.append(("Chart: lost work", svg_text(fig)))
    frows = []
    for n in names:
        for p, row in report["fidelity"][n].items():
            frows.append([n, p] + [f"{_fmt(row[k]['simulated'])} vs {_fmt(row[k]['observed'])} ({_gap(row[k]['gap'])})"
                                   for k in ("p50_s", "p90_s", "p99_s")])
    blocks.append(("Fidelity: simulated vs observed waits per pool, s (gap)",
                   html_table(["configuration", "pool", "p50", "p90", "p99"], frows)))
    sub = (f"{report['events']} · {report['jobs']} jobs over {report['days']:.1f} days · "
           f"{len(report['pools'])} pool(s) · simulation assumptions: docs/backtest.md")
    return html_page("chipledger backtest", blocks, subtitle=sub)


# ---------------------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------------------

def demand_teams(demand: Demand) -> set:
    """The teams a log knows: those with a grant and those that submitted a job."""
    return {t for q in demand.quotas.values() for t in q} | {j.team for j in demand.jobs}


def oversized_quotas(quotas: dict, pools: dict) -> list[str]:
    """A sentence for each grant larger than its pool's registered chips (legal, as in a real cluster, but
    most often a typo)."""
    return [f"quota {team}={chips:g} in {pool} is more than the pool's {pools[pool][0]:g} registered chips"
            for pool, q in sorted(quotas.items()) if pool in pools for team, chips in sorted(q.items())
            if chips > pools[pool][0]]


SIM_STARTS_AT_ONCE = ("the simulated cluster starts a job as soon as the ledger allows it (no scheduling cycle, "
                      "no image pull), so quota honoured is 100% unless chips are short; compare the waits")


def run_cli(events: Path, alt_cfg, base_cfg, alt_name: str, base_name: str, quota: Optional[str],
            days: Optional[float], out: Optional[Path], allow_new_team: bool = False, *, more: tuple = (),
            jobs: int = 1) -> dict:
    """`chipledger backtest`: the baseline and each configuration (`alt_cfg`, then the (name, config) pairs of
    `more`: a sweep) over the log's demand; writes backtest.json and backtest.html into `out` when given; returns
    the report. With `jobs` > 1 (where processes can fork) up to that many configurations are simulated at once,
    each in a process of its own; the report is the same (but for each configuration's `seconds`)."""
    from chipledger.config import fold_config

    if days is not None and not (days > 0 and math.isfinite(days)):
        raise BacktestUsageError(f"--days must be a positive number, got {days}")
    demand = load_demand(Path(events), days, jobs)
    if not demand.jobs:
        raise BacktestError(f"{events}: no job with chips in a pool with registered chips to replay")
    obs = observed(demand)
    teams = demand_teams(demand)
    warnings: list[str] = []
    configs = {}
    fid = {}
    runs = []
    for name, cfg, extra in ((base_name, base_cfg, None), (alt_name, alt_cfg, quota),
                             *((n, c, quota) for n, c in more)):
        while name in [r[0] for r in runs]:
            name = f"{name} (2)"
        quotas = {p: dict(q) for p, q in demand.quotas.items()}
        for text in (cfg.backtest.quota, extra):
            if text:
                for p, q in parse_quota(text, demand.pools, teams, allow_new_team).items():
                    quotas.setdefault(p, {}).update(q)
        warnings += [w for w in oversized_quotas(quotas, demand.pools) if w not in warnings]
        from dataclasses import replace

        fold = replace(fold_config(cfg), policy_rows=False)
        runs.append((name, cfg, (demand, fold, quotas, cfg.slo.sched_slo_s, cfg.backtest.act_delay_s,
                                 cfg.backtest.coop_share)))
    for (name, cfg, _), r in zip(runs, _simulate([a for _, _, a in runs], jobs, [name for name, _, _ in runs])):
        r["policy"] = {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf")
                       for k, v in cfg.policy.fold_kwargs().items()}
        configs[name] = r
        fid[name] = fidelity(r, obs)
    report = {"events": str(events), "lines": demand.lines, "invalid_lines": demand.invalid,
              "first_invalid": demand.first_invalid, "jobs": len(demand.jobs),
              "days": (max(j.submitted for j in demand.jobs) - demand.start) / 86400,
              "pools": {p: {"chips": v[0], "chips_per_node": v[1], "flavor": v[2]}
                        for p, v in sorted(demand.pools.items())},
              "observed": obs, "configs": configs, "fidelity": fid, "warnings": warnings}
    if all(c["quota_honoured"] in (None, 1.0) for c in configs.values()):
        report["notes"] = [f"quota honoured: {SIM_STARTS_AT_ONCE}"]
    if out is not None:
        out = Path(out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / "backtest.json").write_text(json.dumps(report, indent=1, sort_keys=True))
            (out / "backtest.html").write_text(html_report(report))
        except OSError as err:
            raise BacktestError(f"cannot write into {out}: {err.strerror}") from None
        report["written"] = [str(out / "backtest.json"), str(out / "backtest.html")]
    return report


def print_report(report: dict, console) -> None:
    from rich.table import Table

    from chipledger.reports.tables import print_table

    names = list(report["configs"])
    if report["invalid_lines"]:
        console.print(f"skipped {report['invalid_lines']} invalid line(s) of {report['lines']}; first: "
                      f"{report['first_invalid']}", markup=False, highlight=False)
    t = Table(title=f"backtest of {report['events']}: {report['jobs']:,} jobs, {report['days']:.1f} days")
    t.add_column("figure")
    for n in names:
        t.add_column(n, justify="right", no_wrap=True)
    c = report["configs"]
    for label, key, kind in (("quota honoured", "quota_honoured", "pct"), ("in-quota jobs", "in_quota_jobs", "s"),
                             ("lost work, chip-h", "lost_work_chip_h", "h"), ("preemptions", "preemptions", "s"),
                             ("utilisation", "utilisation", "pct"), ("borrowed share of use", "borrowed_share", "pct"),
                             ("seconds to simulate", "seconds", "f")):
        t.add_row(label, *[_fmt(c[n][key], kind) for n in names])
    t.add_row("F excess of victims", *[_fmt(c[n]["fairness"]["f_excess_of_victims"], "f") for n in names])
    t.add_row("Jain's index, borrowers", *[_fmt(c[n]["fairness"]["jain_usage_per_share_borrowers"], "f")
                                            for n in names])
    for unit in sorted({u for n in names for u in c[n].get("cost", {})}):
        t.add_row(f"cost of use / idle, {unit}",
                  *[" / ".join(f"{(c[n]['cost'].get(unit) or {}).get(k, 0):,.0f}" for k in ("use", "idle"))
                    for n in names])
        t.add_row(f"use in peak hours, {unit}", *[_fmt((c[n]["cost"].get(unit) or {}).get("peak_share"), "pct")
                                                  for n in names])
    t.add_row("bursts approved/partial/denied",
              *["/".join(str(c[n]["bursts"].get(k, 0)) for k in ("approved", "partial", "denied")) for n in names])
    teams = sorted({tm for n in names for tm in c[n]["waits_by_team"]})
    for tm in teams:
        t.add_row(f"wait p50/p90/p99 s: {tm}",
                  *[" / ".join(_fmt((c[n]["waits_by_team"].get(tm) or {}).get(k)) for k in ("p50_s", "p90_s", "p99_s"))
                    for n in names])
    _escape_table(t)
    print_table(t, console)
    for note in report.get("notes", []):
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    f = Table(title="fidelity: simulated vs observed waits per pool, s (gap = simulated − observed)")
    for col in ("configuration", "pool", "p50", "p90", "p99"):
        f.add_column(col, justify="right" if col.startswith("p") and col != "pool" else "left")
    for n in names:
        for p, row in report["fidelity"][n].items():
            f.add_row(n, p, *[f"{_fmt(row[k]['simulated'])} vs {_fmt(row[k]['observed'])} ({_gap(row[k]['gap'])})"
                              for k in ("p50_s", "p90_s", "p99_s")])
    _escape_table(f)
    print_table(f, console)
    for path in report.get("written", []):
        console.print(f"wrote {path}", markup=False, highlight=False)


def _escape_table(t) -> None:
    """Rich markup in untrusted names (team, pool, file) is printed as text."""
    from rich.markup import escape

    for col in t.columns:
        col._cells = [escape(x) if isinstance(x, str) else x for x in col._cells]
        col.header = escape(col.header) if isinstance(col.header, str) else col.header
    if isinstance(t.title, str):
        t.title = escape(t.title)
