"""`chipledger why JOB_ID` and `chipledger pending`: why a job is pending (or what became of it), and the
queue of pending jobs, from the lake's policy views.

The reason is the one recorded at the latest close of the books of the job's pool (each close of an hour and
the end of a run): see docs/policy.md for every reason. The answer also lists every reason the job had, when
it changed (a finished job's too), the preemption decisions that named it as beneficiary or victim and, for a
pending job, its place in the queue (the core's order: highest priority, longest waiting, job id), how long
it has waited and what would unblock it. For a job that reports its progress, each run's throughput against
the job's reference rate, and when and how much it slowed, with the unhealthy chips it held then (the fold's
`progress` facts; docs/analytics.md, "throughput").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Explanation:
    job_id: str
    found: bool
    pool: Optional[str] = None
    team: Optional[str] = None
    status: Optional[str] = None          # pending | running | held | finished | cancelled (before it ever ran)
    outcome: Optional[str] = None         # a finished job's outcome: succeeded | failed | cancelled
    as_of: Optional[str] = None           # the instant the reason was recorded (UTC)
    reason: Optional[str] = None
    message: Optional[str] = None
    history: list = field(default_factory=list)    # [(at, reason, message)] when the reason changed
    decisions: list = field(default_factory=list)  # [(at, decision_id, role, message)]
    position: Optional[int] = None        # pending: place in the pool's queue (1 = next), of queue_length
    queue_length: Optional[int] = None
    team_position: Optional[int] = None   # pending: place in its team's queue (the rules look at heads first)
    waiting_since: Optional[str] = None
    waited_s: Optional[int] = None
    unblock: Optional[str] = None         # pending: what would let it start
    # the scheduler's own reason for its wait (its last job.waiting since it was last started or submitted), and at
    scheduler_reason: Optional[str] = None
    scheduler_message: Optional[str] = None
    scheduler_reason_at: Optional[str] = None
    # progress reported: per run (run, unit, units per chip-second, reference, slow seconds, share of judged chip
    # time at or above the fraction), and each slow stretch (run, from, until, seconds, worst fraction of the
    # reference, unhealthy chips held)
    throughput: list = field(default_factory=list)
    slowdowns: list = field(default_factory=list)
    # pending: a sentence when it cannot start under the current grants or in this pool at all, whatever else runs
    never: Optional[str] = None
    short_chips: Optional[float] = None   # ... by how many chips
    # what happened to it, in the log's order: [(at, what)] (submitted, started, preempted, released, finished)
    timeline: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def lines(self) -> list[str]:
        if not self.found:
            return [f"job {self.job_id}: not in the lake (never submitted in the folded events?)"]
        status = self.status
        if self.status == "finished" and self.outcome:
            status = f"finished, {self.outcome}"
        elif self.status == "cancelled":
            status = "cancelled before it ever started"
        out = [f"job {self.job_id} (team {self.team}, pool {self.pool}): {status}"]
        if self.never:
            out.append(f"  cannot start: {self.never}")
        if self.reason is not None:
            out.append(f"  why, as of {self.as_of}: {self.reason}: {self.message}")
        if self.scheduler_reason is not None:
            said = f": {self.scheduler_message}" if self.scheduler_message else ""
            out.append(f"  the scheduler says, as of {self.scheduler_reason_at}: {self.scheduler_reason}{said}")
        if self.position is not None:
            out.append(f"  queue: {self.position} of {self.queue_length} pending in the pool, {self.team_position} "
                       f"in its team's queue; waiting since {self.waiting_since} ({_duration(self.waited_s)})")
        if self.unblock:
            out.append(f"  would start when: {self.unblock}")
        if self.history:
            out.append("  reasons recorded while it waited (each change):")
            out.extend(f"    {at}  {reason}: {message}" for at, reason, message in self.history)
        if self.decisions:
            out.append("  decisions naming it:")
            out.extend(f"    {at}  {did} ({role}): {message}" for at, did, role, message in self.decisions)
        if self.throughput:
            out.append("  throughput (units of the job per chip-second, against its own reference rate):")
            for run, unit, rate, ref, slow_s, attained in self.throughput:
                ref_text = f"reference {ref:.4g}" if ref is not None else "reference not known yet"
                judged = "" if attained is None else f", {100 * attained:.1f}% of its judged chip time at rate"
                out.append(f"    run {run}: {_rate(rate)} {unit}/chip-s, {ref_text}; slow {_duration(slow_s)}{judged}")
        if self.slowdowns:
            out.append("  slowed down:")
            for run, since, until, secs, worst, chips in self.slowdowns:
                cause = f"; unhealthy chips held: {chips}" if chips else "; every chip it held was healthy"
                out.append(f"    run {run}: {since} … {until} ({_duration(secs)}), down to {100 * worst:.0f}% of "
                           f"its reference rate{cause}")
        if self.timeline:
            out.append("  timeline:")
            out.extend(f"    {at}  {what}" for at, what in self.timeline)
        return out


# what would let a job pending for each reason start (docs/policy.md, "Why is my job pending?")
UNBLOCK = {
    "ready": "nothing: it fits its team's unused quota and the free chips; the cluster can start it now",
    "would_borrow": "nothing: the chips it would borrow are free and allowed; the cluster can start it now",
    "not_on_whole_nodes": "enough whole nodes free (jobs finishing on partly used nodes), or a smaller "
                          "chips_per_node",
    "waiting_grace": "the preemption grace ending (then the ledger decides a preemption of borrowers), or "
                     "chips freed by jobs finishing before that",
    "preemption_in_flight": "the cluster preempting the decision's victims (the chips are promised to it)",
    "waiting_for_chips": "jobs finishing, or borrowers' jobs becoming preemptible (min_runtime, max_preemptions)",
    "over_borrowing_limit": "its team's own jobs finishing, a larger quota or borrowing_limit, or an approved "
                            "burst",
    "nothing_to_lend": "other teams' jobs finishing or their quota becoming lendable, or an approved burst",
    "not_recorded": "the next close of the books records its reason (each hour, and at the end of a run)",
}


def _rate(v: Optional[float]) -> str:
    return "–" if v is None else f"{v:.4g}"


def _duration(s: Optional[int]) -> str:
    if s is None:
        return "unknown"
    d, r = divmod(int(s), 86400)
    h, r = divmod(r, 3600)
    m, sec = divmod(r, 60)
    return " ".join(f"{v}{u}" for v, u in ((d, "d"), (h, "h"), (m, "m"), (sec, "s")) if v) or "0s"


# the queue at each pool's latest close of the books at or before an instant (`pending` is the latest of all)
PENDING_AT_SQL = """(
        SELECT p.* FROM pending_history p
        JOIN (SELECT pool, max("at") AS "at" FROM balance_log WHERE "at" <= $at GROUP BY pool) latest
        USING (pool, "at"))"""

QUEUE_SQL = """
    SELECT * FROM (
        SELECT pool, team, job_id, priority, chips, waiting_since, waited_s, reason, message, "at",
               row_number() OVER (PARTITION BY pool ORDER BY priority DESC, waiting_since, job_id) AS position,
               count(*) OVER (PARTITION BY pool) AS queue_length,
               row_number() OVER (PARTITION BY pool, team ORDER BY priority DESC, waiting_since, job_id)
                   AS team_position
        FROM pending)
    WHERE ($pool IS NULL OR pool = $pool) AND ($team IS NULL OR team = $team) AND ($job IS NULL OR job_id = $job)
    ORDER BY pool, position"""


def pending_queue(con, pool: Optional[str] = None, team: Optional[str] = None, at=None) -> list[dict]:
    """The jobs pending at each pool's latest close of the books (at or before `at`, a datetime, when given), in the
    pool's queue order (as Kueue's pending-workloads view): position, team position, priority, chips, waited, reason;
    `at` in each row is the close of the books it was recorded at."""
    if at is None:
        cur = con.execute(QUEUE_SQL, {"pool": pool, "team": team, "job": None})
    else:
        cur = con.execute(QUEUE_SQL.replace("FROM pending)", f"FROM {PENDING_AT_SQL})"),
                          {"pool": pool, "team": team, "job": None, "at": at})
    cols = [c[0] for c in cur.description]
    out = []
    for r in cur.fetchall():
        row = dict(zip(cols, r))
        row["waiting_since"], row["at"] = _fmt(row["waiting_since"]), _fmt(row["at"])
        row["waited_s"] = None if row["waited_s"] is None else int(row["waited_s"])
        out.append(row)
    return out


def books_as_of(con, pool: Optional[str] = None, at=None) -> Optional[str]:
    """The instant the queue is as of: the latest close of the books (of `pool`, at or before `at`)."""
    row = con.execute('SELECT max("at") FROM balance_log WHERE ($pool IS NULL OR pool = $pool) '
                      'AND ($at IS NULL OR "at" <= $at)', {"pool": pool, "at": at}).fetchone()
    return _fmt(row[0]) if row else None


def _fmt(ts) -> Optional[str]:
    return None if ts is None else ts.strftime("%Y-%m-%dT%H:%M:%SZ")


def explain(con, job_id: str) -> Explanation:
    """The explanation of one job from a connection made by analytics.views.connect."""
    job = con.execute(
        "SELECT pool, team, finished_at, first_started_at FROM jobs WHERE job_id = ? "
        "ORDER BY submitted_at DESC LIMIT 1", [job_id]).fetchone()
    current = con.execute(
        'SELECT pool, team, "at", reason, message FROM pending WHERE job_id = ? ORDER BY "at" DESC LIMIT 1',
        [job_id]).fetchone()
    if job is None and current is None:
        return Explanation(job_id, False)
    ex = Explanation(job_id, True)
    if current is not None:
        ex.pool, ex.team = current[0], current[1]
        ex.status = "pending"
        ex.as_of, ex.reason, ex.message = _fmt(current[2]), current[3], current[4]
        q = con.execute(QUEUE_SQL, {"pool": ex.pool, "team": None, "job": job_id}).fetchone()
        if q is not None:
            ex.waiting_since, ex.waited_s = _fmt(q[5]), None if q[6] is None else int(q[6])
            ex.position, ex.queue_length, ex.team_position = int(q[10]), int(q[11]), int(q[12])
    else:
        ex.pool, ex.team = job[0], job[1]
        last = con.execute(
            "SELECT type, body->>'$.held', applied_at FROM events WHERE job_id = ? AND pool = ? "
            "ORDER BY applied_at DESC, \"offset\" DESC LIMIT 1", [job_id, ex.pool]).fetchone()
        kind = last[0] if last else ""
        if kind == "job.preempted" and last[1] == "true":
            kind = "held"
        ex.status = {"job.finished": "finished", "job.preempted": "pending", "job.submitted": "pending",
                     "job.released": "pending", "held": "held"}.get(kind, "running")
        if ex.status == "finished":
            ex.outcome = con.execute(
                "SELECT outcome FROM events WHERE job_id = ? AND pool = ? AND type = 'job.finished' "
                "ORDER BY applied_at DESC, \"offset\" DESC LIMIT 1", [job_id, ex.pool]).fetchone()[0]
            if ex.outcome == "cancelled" and job is not None and job[3] is None:
                ex.status = "cancelled"  # it never ran: not "finished"
        if ex.status == "held":
            ex.as_of, ex.reason = _fmt(last[2]), "held"
            ex.message = ("back in the queue but not eligible yet (job.preempted with held): not pending demand "
                          "and not waiting until its job.released")
        if ex.status == "pending":
            ex.reason = "not_recorded"
            ex.message = ("pending, but no reason was recorded after its last event: reasons are recorded at "
                          "each close of an hour and at the end of a run")
    prev = None
    for at, reason, message in con.execute(
            'SELECT "at", reason, message FROM pending_history WHERE job_id = ? AND pool = ? ORDER BY "at"',
            [job_id, ex.pool]).fetchall():
        if reason != prev:
            ex.history.append((_fmt(at), reason, message))
            prev = reason
    for at, did, role, message in con.execute(
            """SELECT "at", decision_id, 'beneficiary', message FROM decisions
               WHERE beneficiary_job_id = ? AND pool = ?
               UNION ALL
               SELECT d."at", d.decision_id, 'victim', d.message FROM decision_victims v
               JOIN decisions d USING (decision_id) WHERE v.job_id = ? AND v.pool = ?
               ORDER BY 1, 2""", [job_id, ex.pool, job_id, ex.pool]).fetchall():
        ex.decisions.append((_fmt(at), did, role, message))
    if ex.status in ("pending", "held"):
        ex.unblock = UNBLOCK.get(ex.reason or "") if ex.status == "pending" else None
        _scheduler_reason(con, ex)
    if ex.status == "pending":
        _never_fits(con, ex)
    elif ex.status != "held":
        _timeline(con, ex)
    _throughput(con, ex)
    return ex


def _chips_text(milli: int) -> str:
    return f"{milli / 1000:g}"


def _never_fits(con, ex: Explanation) -> None:
    """Whether the pending job can start at all: more chips than the pool has registered, or than its team may hold
    under the grants in effect (their quota plus their borrowing limits, when every grant has one), whatever else
    runs; and by how much. The reason the core records says what blocks it now; this says that waiting cannot help."""
    row = con.execute("SELECT chips_milli FROM jobs WHERE job_id = ? AND pool = ? ORDER BY submitted_at DESC LIMIT 1",
                      [ex.job_id, ex.pool]).fetchone()
    if row is None or row[0] is None:
        return
    chips = int(row[0])
    cap = con.execute("SELECT registered_milli FROM base_free_chips WHERE pool = ? ORDER BY at_s DESC LIMIT 1",
                      [ex.pool]).fetchone()
    if cap is not None and cap[0] is not None and chips > cap[0]:
        ex.short_chips = (chips - cap[0]) / 1000
        ex.never = (f"it asks for {_chips_text(chips)} chips and pool {ex.pool} has {_chips_text(cap[0])} registered: "
                    f"{_chips_text(chips - cap[0])} chips short, whatever else runs")
        ex.unblock = f"more chips registered in {ex.pool}, or a job of at most {_chips_text(cap[0])} chips"
        return
    grants = con.execute(
        """SELECT g.grant_id, g.chips_milli,
                  (SELECT e.body->>'$.borrowing_limit' FROM events e
                   WHERE e.type = 'quota.granted' AND e.pool = g.pool AND e.grant_id = g.grant_id
                   ORDER BY e.applied_at DESC, e."offset" DESC LIMIT 1) AS borrowing_limit
           FROM grant_intervals g JOIN (SELECT max("at") AS at FROM pending WHERE pool = $pool) n ON true
           WHERE g.pool = $pool AND g.team = $team AND g.effective_from <= n.at
                 AND (g.effective_until IS NULL OR g.effective_until > n.at)""",
        {"pool": ex.pool, "team": ex.team}).fetchall()
    if not grants or any(limit is None for _, _, limit in grants):
        return  # no grant (it may borrow all it can find) or one without a limit: no bound from the grants
    nominal = sum(int(m) for _, m, _ in grants)
    limit = sum(round(float(b) * 1000) for _, _, b in grants)
    if chips > nominal + limit:
        ex.short_chips = (chips - nominal - limit) / 1000
        ex.never = (f"it asks for {_chips_text(chips)} chips and team {ex.team} may hold at most "
                    f"{_chips_text(nominal + limit)} in {ex.pool} under the current grants (quota "
                    f"{_chips_text(nominal)} + borrowing limit {_chips_text(limit)}): {_chips_text(chips - nominal - limit)}"
                    f" chips short, whatever else runs")
        ex.unblock = (f"a larger quota or borrowing_limit for team {ex.team} (by at least "
                      f"{_chips_text(chips - nominal - limit)} chips), an approved burst, or a smaller job")


_TIMELINE_TYPES = ("job.submitted", "job.started", "job.preempted", "job.released", "job.finished")


def _timeline(con, ex: Explanation) -> None:
    """What happened to the job, in the log's order (its latest submission's events)."""
    rows = con.execute(
        f"""SELECT occurred_at, type, chips_milli, priority, outcome, body->>'$.cause', body->>'$.decision_id',
                   body->>'$.held', body->>'$.reason'
            FROM events WHERE job_id = ? AND pool = ? AND type IN {_TIMELINE_TYPES}
            ORDER BY applied_at, "offset" """, [ex.job_id, ex.pool]).fetchall()
    starts = [i for i, r in enumerate(rows) if r[1] == "job.submitted"]
    rows = rows[starts[-1]:] if starts else rows
    runs = 0
    for at, kind, chips, prio, outcome, cause, decision, held, reason in rows:
        if kind == "job.submitted":
            what = f"submitted: {_chips_text(chips)} chips, priority {prio}"
        elif kind == "job.started":
            runs += 1
            what = f"started (run {runs})"
        elif kind == "job.preempted":
            what = {"requeued": "requeued by an admin", "failure": "interrupted by a failure"}.get(cause or "",
                                                                                                  "preempted")
            what += (f" by decision {decision}" if decision else "") + (f" ({reason})" if reason else "")
            what += ", held" if held == "true" else ""
        elif kind == "job.released":
            what = "released (pending again)"
        else:
            what = f"finished: {outcome}" + ("" if runs else " (it never ran)")
        ex.timeline.append((_fmt(at), what))


def _scheduler_reason(con, ex: Explanation) -> None:
    """The scheduler's own reason (job.waiting) for the job's current wait: its latest job.waiting after the job's
    latest start or submission (the fold keeps the same on the job and clears it as the job starts)."""
    row = con.execute(
        """SELECT body->>'$.reason', body->>'$.message', applied_at FROM events
           WHERE job_id = ? AND pool = ? AND type = 'job.waiting'
             AND applied_at >= coalesce((SELECT max(applied_at) FROM events WHERE job_id = ? AND pool = ?
                                         AND type IN ('job.started', 'job.submitted')), '-infinity'::TIMESTAMPTZ)
           ORDER BY applied_at DESC, "offset" DESC LIMIT 1""", [ex.job_id, ex.pool, ex.job_id, ex.pool]).fetchone()
    if row is not None:
        ex.scheduler_reason, ex.scheduler_message, ex.scheduler_reason_at = row[0], row[1], _fmt(row[2])


def _throughput(con, ex: Explanation) -> None:
    """The job's throughput per run and its slow stretches (consecutive slow intervals of a run, merged), from its
    latest submission's progress facts."""
    key = [ex.job_id, ex.pool]
    latest = "(SELECT max(submitted_at) FROM progress WHERE job_id = ? AND pool = ?)"
    for run, unit, rate, ref, slow_s, attained in con.execute(
            f"""SELECT run_index, unit, units_per_chip_s, reference_units_per_chip_s, slow_s, attainment
                FROM throughput WHERE job_id = ? AND pool = ? AND submitted_at = {latest} ORDER BY run_index""",
            key + key).fetchall():
        ex.throughput.append((int(run), unit, rate, ref, int(slow_s or 0), attained))
    cur = None
    for run, began, ended, fraction, chips in con.execute(
            f"""SELECT run_index, began_at, ended_at, units_per_chip_s / reference_units_per_chip_s, unhealthy_chips
                FROM progress WHERE job_id = ? AND pool = ? AND submitted_at = {latest} AND slow
                ORDER BY run_index, began_at""", key + key).fetchall():
        if cur is not None and cur[0] == run and cur[2] == began:
            cur[2] = ended
            cur[3] = min(cur[3], fraction)
            cur[4].update(c for c in chips.split(",") if c)
        else:
            if cur is not None:
                ex.slowdowns.append(_stretch(cur))
            cur = [int(run), began, ended, fraction, {c for c in chips.split(",") if c}]
    if cur is not None:
        ex.slowdowns.append(_stretch(cur))


def _stretch(cur: list) -> tuple:
    run, began, ended, worst, chips = cur
    return (run, _fmt(began), _fmt(ended), int((ended - began).total_seconds()), worst, ",".join(sorted(chips)))
