"""`chipledger why JOB_ID`: why a job is pending (or what became of it), from the lake's policy views.

The reason is the one recorded at the latest close of the books of the job's pool (each close of an hour and
the end of a run): see docs/policy.md for every reason. The answer also lists the job's earlier reasons when
they changed, and the preemption decisions that named it as beneficiary or victim.
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
    status: Optional[str] = None          # pending | running | finished | unknown
    as_of: Optional[str] = None           # the instant the reason was recorded (UTC)
    reason: Optional[str] = None
    message: Optional[str] = None
    history: list = field(default_factory=list)    # [(at, reason, message)] when the reason changed
    decisions: list = field(default_factory=list)  # [(at, decision_id, role, message)]

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def lines(self) -> list[str]:
        if not self.found:
            return [f"job {self.job_id}: not in the lake (never submitted in the folded events?)"]
        out = [f"job {self.job_id} (team {self.team}, pool {self.pool}): {self.status}"]
        if self.reason is not None:
            out.append(f"  why, as of {self.as_of}: {self.reason}: {self.message}")
        if len(self.history) > 1:
            out.append("  earlier reasons:")
            out.extend(f"    {at}  {reason}: {message}" for at, reason, message in self.history[:-1])
        if self.decisions:
            out.append("  decisions naming it:")
            out.extend(f"    {at}  {did} ({role}): {message}" for at, did, role, message in self.decisions)
        return out


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
    else:
        ex.pool, ex.team = job[0], job[1]
        last = con.execute(
            "SELECT type FROM events WHERE job_id = ? AND pool = ? ORDER BY applied_at DESC, \"offset\" DESC LIMIT 1",
            [job_id, ex.pool]).fetchone()
        ex.status = {"job.finished": "finished", "job.preempted": "pending", "job.submitted": "pending"}.get(
            last[0] if last else "", "running")
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
    return ex
