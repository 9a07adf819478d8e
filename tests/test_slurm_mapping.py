"""The Slurm mapping, the watcher and the actuator on outputs captured from a real Slurm 22.05.8 (no Slurm needed).

tests/fixtures/slurm/ holds what scripts/slurm.sh's cluster printed for a small workload (jobs.txt names them):
job 1 completed; job 2 requeued by an admin (`scontrol requeue`), then completed; job 3 held and cancelled (not
listed: sacct leaves it out); job 4 preempted by job 7 (QOS high, PreemptMode=REQUEUE), then completed; array
5_0, 5_1 failed; node n2 drained ("fan") while sinfo.json was taken. Files: sacct.json (`sacct -a -D -X --json`),
sacct-D.txt (the same records, `--parsable2` with Eligible and AdminComment), sacct-no-D.txt (without -D),
sinfo.json, squeue.json, assoc.txt (`sacctmgr -P show assoc format=id,account,user,partition,grptres`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from chipledger.adapters.importers.sacct import import_sacct
from chipledger.adapters.slurm import commands
from chipledger.adapters.slurm.actuate import Actuator, Ops, decisions_from_jsonl
from chipledger.adapters.slurm.mapping import (BILLING_UNIT, CHIP_MIN_UNIT, billing_prices, budgets_of)
from chipledger.adapters.slurm.mapping import (Assoc, MapReport, Node, Run, chip_ids, decision_of, gpu_limits, gres_gpus,
                                      grants_of, hostnames, job_events, node_state_events, pools_of, runs_by_job)
from chipledger.adapters.slurm.watch import Slurm, Watcher, WatchError, _not_in_accounting_yet

from tests.adapter_support import ListSink  # noqa: F401 (tests/integration/test_slurm_kafka.py imports it from here)

FIX = Path(__file__).parent / "fixtures" / "slurm"
CLUSTER = "chipledger"
S, R, C, P, F = "job.submitted", "job.started", "job.checkpointed", "job.preempted", "job.finished"
L = "job.released"


def _load(name):
    return json.loads((FIX / name).read_text())


@pytest.fixture(scope="module")
def runs():
    return commands.runs_from_sacct_json(_load("sacct.json"))


@pytest.fixture(scope="module")
def nodes():
    return commands.nodes_from_sinfo_json(_load("sinfo.json"))


@pytest.fixture(scope="module")
def assocs():
    return commands.assocs_from_text((FIX / "assoc.txt").read_text())


def _job_events(runs, **kw):
    report = MapReport()
    out = {}
    for job, rs in runs_by_job(runs).items():
        out[job] = [(e.body["type"], e.body["occurred_at"], e.body.get("outcome"), e.body.get("decision_id"))
                    for e in job_events(CLUSTER, f"{CLUSTER}/slurm", rs, report, **kw)]
    return out, report


def test_runs_from_sacct_json(runs):
    by = runs_by_job(runs)
    assert sorted(by) == ["1", "2", "4", "5_0", "5_1", "7"]
    assert [r.state for r in sorted(by["2"], key=lambda r: r.submit)] == ["REQUEUED", "COMPLETED"]
    r4 = sorted(by["4"], key=lambda r: r.submit)[0]
    assert (r4.account, r4.partition, r4.gpus, r4.nodes, r4.state, r4.gpu_type) == ("speech", "h100", 16, 2,
                                                                                    "PREEMPTED", "h100")


def test_job_events_tell_requeue_from_preemption(runs):
    jobs, report = _job_events(runs)
    kinds = {j: [t for t, _, _, _ in evs] for j, evs in jobs.items()}
    assert kinds["1"] == [S, R, F]
    assert kinds["2"] == [S, R, C, P, L, R, F]  # admin requeue: checkpointed, so no work is lost
    assert kinds["4"] == [S, R, P, L, R, F]  # preempted by QOS: its run's work is lost
    assert jobs["5_0"][-1][2] == "failed"
    # the first wait starts at Eligible (5_0: Submit 11:37:23, Eligible :24)
    assert jobs["5_0"][0][1] == "2026-12-03T11:37:24Z"
    assert report.notes["admin requeues (no work lost)"] == 1
    # a requeued job is held from its End until the next run's Eligible (End + cred_expire + 1 s), then waits
    by = {j: sorted(rs, key=lambda r: r.submit) for j, rs in runs_by_job(runs).items()}
    for job in ("2", "4"):
        first, second = by[job]
        times = {t: at for t, at, _, _ in jobs[job]}
        assert times[P] == commands.utc_text(first.end) + "Z" and times[L] == commands.utc_text(second.eligible) + "Z"
        assert second.eligible > first.end  # the hold-off Slurm imposes, which is not demand


def test_a_requeued_job_is_held_until_its_next_eligible_and_ids_are_stable():
    first = Run("20", "vision", "u", "a100", 100, 100, 110, 150, "PREEMPTED", 2, 1)
    second = Run("20", "vision", "u", "a100", 150, 171, 180, 200, "COMPLETED", 2, 1)
    evs = job_events(CLUSTER, "s", [second, first], MapReport())
    assert [(e.body["type"], e.at, e.body.get("held"), e.body["event_id"]) for e in evs] == [
        (S, 100, None, "slurm:chipledger:20:100:submitted"), (R, 110, None, "slurm:chipledger:20:100:started"),
        (P, 150, True, "slurm:chipledger:20:100:preempted"), (L, 171, None, "slurm:chipledger:20:150:released"),
        (R, 180, None, "slurm:chipledger:20:150:started"), (F, 200, None, "slurm:chipledger:20:150:finished")]
    # before the next run is in accounting, the preemption is the same event (same id, same body): held
    before = job_events(CLUSTER, "s", [first], MapReport())
    assert [e.body for e in before] == [e.body for e in evs[:3]]
    # a next run still pending with its Eligible to come: the release is its Eligible
    pending = replace(second, start=None, end=None, state="PENDING")
    assert [(e.body["type"], e.at) for e in job_events(CLUSTER, "s", [first, pending], MapReport())][3:] == [(L, 171)]
    # a dump without the Eligible column: pending at once, as before (no held, no release)
    flat = job_events(CLUSTER, "s", [first, second], MapReport(), eligible=False)
    assert [e.body["type"] for e in flat] == [S, R, P, R, F] and "held" not in flat[2].body


def test_a_job_released_started_and_cancelled_in_one_second_keeps_that_order_when_sorted():
    """Seen on the live Slurm: job 10 requeued at :32, eligible, started and cancelled at :34. The watcher sorts a
    poll's events by (instant, rank, pool, id), frees before takes; the job's own events must stay in the order they
    happened, else the cancel comes first and the release and start are dead letters."""
    from ledger import Fleet, FoldConfig
    from schemas import parse_payload

    first = Run("10", "speech", "u", "a100", 29, 29, 29, 32, "REQUEUED", 1, 1)
    second = Run("10", "speech", "u", "a100", 32, 34, 34, 34, "CANCELLED", 1, 1)
    evs = job_events(CLUSTER, "s", [first, second], MapReport())
    evs.sort(key=lambda e: (e.at, e.rank, e.body["pool"], e.body["event_id"]))  # as slurm watch sorts a poll
    assert [(e.body["type"], e.at) for e in evs][-3:] == [(L, 34), (R, 34), (F, 34)]
    fleet = Fleet(FoldConfig(check_invariants=True))
    pool = evs[0].body["pool"]
    head = [{"event_id": "p", "type": "pool.configured", "occurred_at": "1970-01-01T00:00:00Z", "pool": pool,
             "source": "s", "flavor": "a100", "chips_per_node": 1},
            {"event_id": "c", "type": "chip.registered", "occurred_at": "1970-01-01T00:00:00Z", "pool": pool,
             "source": "s", "chip_id": "g0", "node": "n0"}]
    for body in [*head, *(e.body for e in evs)]:
        step = fleet.apply(parse_payload(body))
        assert step.rejection is None, (body, step.rejection)


def test_a_requeued_job_cancelled_while_held_is_never_demand_again():
    """Measured on Slurm 22.05: `scontrol requeue` (or requeuehold) then `scancel` within the hold-off: the next
    run's record has its Eligible after its End and no Start. Held from the requeue to the cancel: no release."""
    first = Run("21", "vision", "u", "a100", 100, 100, 110, 150, "REQUEUED", 1, 1)
    cancelled = Run("21", "vision", "u", "a100", 150, 156, None, 151, "CANCELLED", 1, 1)
    report = MapReport()
    evs = job_events(CLUSTER, "s", [first, cancelled], report)
    assert [(e.body["type"], e.at) for e in evs] == [(S, 100), (R, 110), (C, 150), (P, 150), (F, 151)]
    assert evs[3].body["held"] is True and evs[4].body["outcome"] == "cancelled"
    assert report.notes["requeued runs never eligible (held, then ended): no demand"] == 1
    # cancelled at the very second it would have become eligible: never eligible either (a release at that
    # second would come after the finish)
    at_eligible = replace(cancelled, end=156)
    assert L not in [e.body["type"] for e in job_events(CLUSTER, "s", [first, at_eligible], MapReport())]
    # accounting can give such a run a Start, equal to its End (the cancel), before its Eligible (measured on
    # 22.05.8 by the live test: the watcher released, started and cancelled it at once): no start, no release
    with_start = replace(cancelled, start=151)
    evs = job_events(CLUSTER, "s", [first, with_start], MapReport())
    assert [(e.body["type"], e.at) for e in evs] == [(S, 100), (R, 110), (C, 150), (P, 150), (F, 151)]


def test_actuator_mark_makes_the_requeue_a_preemption_of_that_decision(runs):
    marked = [replace(r, admin_comment="chipledger-preempt:dec-42") if r.job_id == "2" and r.state == "REQUEUED"
              else r for r in runs]
    jobs, _ = _job_events(marked)
    assert [(t, d) for t, _, _, d in jobs["2"]] == [(S, None), (R, None), (P, "dec-42"), (L, None), (R, None),
                                                   (F, None)]


def test_cancel_by_the_actuator_is_a_preemption_then_the_end():
    run = Run("9", "speech", "u", "a100", 100, 100, 110, 150, "CANCELLED", 2, 1,
              admin_comment="chipledger-preempt:dec-7")
    jobs, _ = _job_events([run])
    assert [(t, d) for t, _, _, d in jobs["9"]] == [(S, None), (R, None), (P, "dec-7"), (F, None)]


def test_the_submission_carries_the_user_and_ids_do_not_depend_on_it(runs):
    """Slurm's User is the submission's `user` (per-user books); the event ids stay those derived from Slurm's ids,
    so events a watcher sent before `user` existed are not sent again."""
    r = Run("9", "speech", "alice", "a100", 100, 100, 110, 150, "COMPLETED", 2, 1)
    with_user = job_events(CLUSTER, f"{CLUSTER}/slurm", [r], MapReport())
    without = job_events(CLUSTER, f"{CLUSTER}/slurm", [replace(r, user="")], MapReport())
    assert [e.body["event_id"] for e in with_user] == [e.body["event_id"] for e in without] == [
        "slurm:chipledger:9:100:submitted", "slurm:chipledger:9:100:started", "slurm:chipledger:9:100:finished"]
    assert with_user[0].body["user"] == "alice" and "user" not in without[0].body
    assert all("user" not in e.body for e in with_user[1:])  # only the submission says who
    # a requeued job: the user of its first run; the fixture's jobs all ran as root
    by = runs_by_job(runs)
    for job, rs in by.items():
        (sub,) = [e.body for e in job_events(CLUSTER, "s", rs, MapReport()) if e.body["type"] == S]
        assert sub["user"] == "root" and sub["event_id"] == f"slurm:{CLUSTER}:{job}:{min(x.submit for x in rs)}:submitted"


def test_held_jobs_are_not_demand():
    held_cancelled = Run("10", "vision", "u", "a100", 100, None, None, 130, "CANCELLED", 1, 1)
    held = Run("11", "vision", "u", "a100", 100, None, None, None, "PENDING", 1, 1)
    later = Run("12", "vision", "u", "a100", 100, 160, None, None, "PENDING", 1, 1)  # --begin / released
    jobs, report = _job_events([held_cancelled, held, later])
    assert jobs["10"] == [] and jobs["11"] == []
    assert jobs["12"] == [(S, "1970-01-01T00:02:40Z", None, None)]
    assert report.skipped["cancelled_while_held"] == 1


def test_since_moves_earlier_times_to_it():
    run = Run("13", "nlp", "u", "a100", 100, 100, 120, 200, "COMPLETED", 4, 1)
    jobs, _ = _job_events([run], since=150)
    assert [t for _, t, _, _ in jobs["13"]] == ["1970-01-01T00:02:30Z"] * 2 + ["1970-01-01T00:03:20Z"]


def test_nodes_pools_and_states(nodes):
    by = {n.name: n for n in nodes}
    assert (by["n1"].gpus, by["n1"].gpu_type, by["n1"].partitions) == (8, "a100", ("a100",))
    assert "DRAIN" in by["n2"].states and by["n2"].reason == "fan"
    assert "DRAIN" not in by["n1"].states
    pools = pools_of(CLUSTER, nodes)
    assert {p: (s.flavor, s.chips_per_node, len(s.nodes)) for p, s in pools.items()} == {
        "chipledger/a100": ("a100", 8, 2), "chipledger/h100": ("h100", 8, 2)}


def test_scontrol_show_node_text_gives_the_same_nodes(nodes):
    text_nodes = commands.nodes_from_scontrol_text((FIX / "scontrol-show-node.txt").read_text())
    by = {n.name: n for n in text_nodes}
    assert by["n2"].states == ("IDLE", "DRAIN") and by["n2"].reason == "fan failure"
    assert [(n.name, n.gpus, n.gpu_type, n.partitions) for n in text_nodes] == \
        [(n.name, n.gpus, n.gpu_type, n.partitions) for n in nodes]
    shape = lambda ps: {p: (s.flavor, s.chips_per_node, [n.name for n in s.nodes]) for p, s in ps.items()}  # noqa: E731
    assert shape(pools_of(CLUSTER, text_nodes)) == shape(pools_of(CLUSTER, nodes))


@pytest.mark.parametrize("gres, expected", [
    ("gpu:a100:8", (8, "a100")), ("gpu:8", (8, "")), ("gpu:a100:8(S:0-1)", (8, "a100")),
    ("gpu:a100:4,gpu:h100:4", (8, "a100")), ("", (0, "")), ("(null)", (0, "")), ("mps:100", (0, "")),
])
def test_gres_gpus(gres, expected):
    assert gres_gpus(gres) == expected


@pytest.mark.parametrize("tres, limits", [
    ("gres/gpu:a100=4,gres/gpu:h100=8", (("a100", 4), ("h100", 8))), ("cpu=10,gres/gpu=12", (("", 12),)),
    ("gres/gpu=12,gres/gpu:a100=8", (("a100", 8),)), ("cpu=4", ()), ("", ()),
])
def test_gpu_limits(tres, limits):
    assert gpu_limits(tres) == limits


def test_grants_from_associations(nodes, assocs):
    pools = pools_of(CLUSTER, nodes)
    assert grants_of(CLUSTER, pools, assocs) == {("3", "chipledger/a100", "vision"): 8,
                                                 ("4", "chipledger/a100", "nlp"): 4,
                                                 ("4", "chipledger/h100", "nlp"): 8}
    untyped = [Assoc("9", "speech", "", "", (("", 4),)), Assoc("10", "speech", "", "h100", (("", 2),)),
               Assoc("11", "speech", "alice", "", (("a100", 1),))]  # a user's limit is inside the account's
    report = MapReport()
    assert grants_of(CLUSTER, pools, untyped, report) == {("10", "chipledger/h100", "speech"): 2}
    assert report.notes["untyped gres/gpu limits on a cluster of several pools, not mapped"] == 1


def test_node_events_to_chip_states(nodes):
    """`sacctmgr -n -P show event event=node format=nodename,start,end,state,reason` as 22.05.8 prints it."""
    text = "n2|2026-12-03T11:43:15|2026-12-03T11:43:20|DRAIN|fan\nn4|2026-12-03T11:43:18|Unknown|DOWN|psu\n"
    evs = commands.node_events_from_text(text)
    assert evs == [("n2", 1796298195, 1796298200, "DRAIN", "fan"), ("n4", 1796298198, None, "DOWN", "psu")]
    out = node_state_events(CLUSTER, "s", pools_of(CLUSTER, nodes), evs, since=1796298196)
    got = sorted({(e.body["chip_id"][:2], e.body["state"], e.at) for e in out})
    assert got == [("n2", "down", 1796298196), ("n2", "healthy", 1796298200), ("n4", "down", 1796298198)]
    assert len(out) == 24
    assert node_state_events(CLUSTER, "s", pools_of(CLUSTER, nodes), evs, since=1796298300)[0].body["chip_id"] == "n4-gpu0"


def test_maintenance_reservations_to_chip_states(nodes):
    """`sacctmgr -n -P show reservation format=name,nodenames,start,end,flags` as 22.05.8 prints it: MAINT
    reservations (not IGNORE_JOBS) are maintenance from their start to their end, to the second; a node down
    inside one is down, then in maintenance again until the reservation ends."""
    text = ("mx|n4|2026-12-03T11:40:00|2026-12-03T11:40:30|MAINT,SPEC_NODES\n"
            "m2|n[1-2]|2026-12-03T11:41:00|Unknown|MAINT\n"
            "ij|n3|2026-12-03T11:40:00|2026-12-03T11:50:00|MAINT,IGNORE_JOBS\n"  # jobs run on: not PLND Down
            "big|n3|2026-12-03T11:40:00|2026-12-03T11:50:00|SPEC_NODES\n")  # an ordinary reservation
    maint = commands.reservations_from_text(text)
    assert maint == [("n4", 1796298000, 1796298030, "mx"), ("n1", 1796298060, None, "m2"),
                     ("n2", 1796298060, None, "m2")]
    down = [("n4", 1796298010, 1796298020, "DOWN", "psu")]
    out = node_state_events(CLUSTER, "s", pools_of(CLUSTER, nodes), down, since=0, maintenance=maint)
    n4 = [(e.at, e.body["state"], e.body.get("reason")) for e in out if e.body["chip_id"] == "n4-gpu0"]
    assert n4 == [(1796298000, "maintenance", "MAINT reservation mx"), (1796298010, "down", "DOWN: psu"),
                  (1796298020, "maintenance", "MAINT reservation mx"), (1796298030, "healthy", None)]
    assert {(e.body["chip_id"][:2], e.body["state"], e.at) for e in out if e.body["chip_id"][:2] != "n4"} == \
        {("n1", "maintenance", 1796298060), ("n2", "maintenance", 1796298060)}
    assert len({e.body["event_id"] for e in out}) == len(out) == 4 * 8 + 2 * 8


def test_hostnames():
    assert hostnames("n4") == ["n4"]
    assert hostnames("n[1-2],gpu[08-10,3]x") == ["n1", "n2", "gpu08x", "gpu09x", "gpu10x", "gpu3x"]
    assert hostnames("") == []


def test_decision_of():
    assert decision_of("chipledger-preempt:abc-1") == "abc-1"
    assert decision_of("chipledger-preempt:") is None
    assert decision_of("rebooted node") is None and decision_of("") is None


# ------------------------------------------------------------------------------------------------------------
# the watcher, on the captured outputs
# ------------------------------------------------------------------------------------------------------------



class FakeSlurm:
    def __init__(self, nodes, assocs, runs, registered=1796297700):
        self.nodes_, self.assocs_, self.runs_, self.queue_ = list(nodes), list(assocs), list(runs), []
        self.registered = registered
        self.node_events_ = [("n2", 1796297849, None, "DRAIN", "fan")]  # drained at 11:37:29, still
        self.reservations_ = []
        self.parents_ = {"vision": "root", "nlp": "root", "speech": "root"}

    def slurm(self):
        return Slurm(nodes=lambda: self.nodes_, assocs=lambda c: self.assocs_, runs=lambda since: self.runs_,
                     registered_at=lambda c: self.registered, queue=lambda: self.queue_,
                     node_events=lambda c, since: self.node_events_,
                     reservations=lambda c, since: self.reservations_, account_parents=lambda c: self.parents_)


NOW = 1796298000  # 2026-12-03T11:40:00Z, after every captured record (11:37:23 … 11:37:35)


def _watcher(tmp_path, fake, sink, now=NOW, since=1796297600):
    return Watcher(CLUSTER, tmp_path / "w.state", sink, since=since, settle_s=5, slurm=fake.slurm(),
                   clock=lambda: now)


def test_watcher_sends_once_and_restarts_without_repeats(tmp_path, nodes, assocs, runs):
    fake = FakeSlurm(nodes, assocs, runs)
    sink = ListSink()
    res = _watcher(tmp_path, fake, sink).poll()
    types = [e["type"] for e in sink.events]
    assert res.by_type["chip.registered"] == 32 and res.by_type["quota.granted"] == 3
    assert res.by_type["chip.state_changed"] == 8  # n2 is drained (slurmdbd's node event)
    down = {(e["chip_id"], e["state"], e["occurred_at"], e["reason"]) for e in sink.events
            if e["type"] == "chip.state_changed"}
    assert down == {(f"n2-gpu{i}", "down", "2026-12-03T11:37:29Z", "DRAIN: fan") for i in range(8)}
    assert res.by_type["pool.tick"] == 2 and types[-2:] == ["pool.tick", "pool.tick"]
    first = [e for e in sink.events if e["type"] in ("pool.configured", "chip.registered", "quota.granted")]
    assert {e["occurred_at"] for e in first} == {"2026-12-03T11:35:00Z"}  # the cluster's registration
    assert all(e["source"] == "chipledger/slurm" for e in sink.events)
    assert len({e["event_id"] for e in sink.events}) == len(sink.events)
    again = ListSink()
    _watcher(tmp_path, fake, again, now=NOW + 10).poll()  # a restart, later
    assert [e["type"] for e in again.events] == ["pool.tick", "pool.tick"]
    same = ListSink()
    _watcher(tmp_path, fake, same, now=NOW + 10).poll()  # the same instant again: nothing at all
    assert same.events == []


def test_watcher_turns_limit_and_node_changes_into_events(tmp_path, nodes, assocs, runs):
    fake = FakeSlurm(nodes, assocs, runs)
    _watcher(tmp_path, fake, ListSink()).poll()
    fake.assocs_ = [Assoc("3", "vision", "", "", (("a100", 12),)), *[a for a in assocs if a.account != "vision"]]
    fake.node_events_ = [("n2", 1796297849, 1796298030, "DRAIN", "fan")]  # resumed at 11:40:30
    fake.nodes_ = [Node(n.name, n.gpus, n.gpu_type, n.partitions, ("IDLE", "MAINTENANCE") if n.name == "n4"
                        else ("IDLE",)) for n in nodes]  # n4 in a maintenance reservation since 11:40:40
    fake.reservations_ = [("n4", 1796298040, 1796298340, "maint")]  # (planned to end at 11:45:40)
    sink = ListSink()
    _watcher(tmp_path, fake, sink, now=NOW + 60).poll()
    quota = [(e["type"], e["grant_id"], e.get("chips")) for e in sink.events if e["type"].startswith("quota.")]
    assert quota == [("quota.revoked", "slurm:chipledger:assoc3:chipledger/a100:v1", None),
                     ("quota.granted", "slurm:chipledger:assoc3:chipledger/a100:v2", 12)]
    states = {(e["chip_id"], e["state"], e["occurred_at"]) for e in sink.events if e["type"] == "chip.state_changed"}
    assert states == {(f"n2-gpu{i}", "healthy", "2026-12-03T11:40:30Z") for i in range(8)} | {
        (f"n4-gpu{i}", "maintenance", "2026-12-03T11:40:40Z") for i in range(8)}  # to the second it began
    # what only the controller shows is stamped with the poll's watermark (now - settle)
    assert {e["occurred_at"] for e in sink.events if e["type"].startswith("quota.")} == {"2026-12-03T11:40:55Z"}


def test_watcher_waits_for_what_accounting_does_not_show_yet(tmp_path, nodes, assocs, runs):
    """A job the controller started that sacct does not list yet holds the watermark just before its start."""
    fake = FakeSlurm(nodes, assocs, runs)
    fake.queue_ = [("99", "RUNNING", NOW - 60, NOW - 50, None)]
    sink = ListSink()
    res = _watcher(tmp_path, fake, sink).poll()
    assert res.watermark == NOW - 51
    assert _not_in_accounting_yet([("1", "COMPLETED", 1796297843, 1796297844, 1796297847)], runs, NOW) == NOW  # it is there
    assert _not_in_accounting_yet([("1", "COMPLETED", 1796297843, 1796297844, 1796297849)], runs, NOW) == 1796297848
    assert _not_in_accounting_yet(commands.queue_from_squeue_json(_load("squeue.json")), runs, NOW) == NOW


def test_watcher_state_of_another_cluster_is_refused(tmp_path, nodes, assocs, runs):
    fake = FakeSlurm(nodes, assocs, runs)
    _watcher(tmp_path, fake, ListSink()).poll()
    with pytest.raises(WatchError, match="belongs to cluster"):
        Watcher("other", tmp_path / "w.state", ListSink(), slurm=fake.slurm())
    with pytest.raises(WatchError, match="--since"):
        Watcher(CLUSTER, tmp_path / "none.state", ListSink(), slurm=fake.slurm())


def test_the_same_mapping_for_import_sacct(tmp_path, runs):
    """sacct's text dump of the same records, imported, gives each job the events `slurm watch` gives it."""
    out = tmp_path / "import.jsonl"
    report = import_sacct(FIX / "sacct-D.txt", out, cluster=CLUSTER)
    imported: dict = {}
    for e in map(json.loads, out.read_text().splitlines()):
        if "job_id" in e:
            imported.setdefault(e["job_id"], []).append((e["type"], e["occurred_at"], e.get("outcome"),
                                                         e.get("decision_id")))
    watched, _ = _job_events(runs)
    assert imported == watched
    assert not any("WARNING" in n for n in report.notes)
    # the User column is each submission's user, as the watcher reads it from sacct --json
    users = {e["job_id"]: e.get("user") for e in map(json.loads, out.read_text().splitlines()) if e["type"] == S}
    assert users == {r.job_id: r.user for r in runs} and set(users.values()) == {"root"}


def test_import_sacct_says_loudly_what_is_missing(tmp_path):
    report = import_sacct(FIX / "sacct-no-D.txt", tmp_path / "e.jsonl")
    warnings = [n for n in report.notes if n.startswith("WARNING")]
    assert len(warnings) == 2 and "-D" in warnings[0] and "Eligible" in warnings[1]


def test_import_sacct_with_inventory_and_quotas(tmp_path):
    out = tmp_path / "e.jsonl"
    (tmp_path / "ev.txt").write_text("n2|2026-12-03T11:37:29|2026-12-03T11:37:40|DRAIN|fan\n")
    import_sacct(FIX / "sacct-D.txt", out, cluster=CLUSTER, nodes=FIX / "sinfo.json", assoc=FIX / "assoc.txt",
                 inventory_at=1796297800, node_events=tmp_path / "ev.txt")
    text = tmp_path / "text.jsonl"  # the inventory from `scontrol show node -o` instead: the same events
    import_sacct(FIX / "sacct-D.txt", text, cluster=CLUSTER, nodes=FIX / "scontrol-show-node.txt",
                 assoc=FIX / "assoc.txt", inventory_at=1796297800, node_events=tmp_path / "ev.txt")
    strip = lambda p: [{k: v for k, v in json.loads(x).items() if k != "event_id"} for x in p.read_text().splitlines()]  # noqa: E731
    assert strip(text) == strip(out)
    evs = [json.loads(x) for x in out.read_text().splitlines()]
    assert sum(e["type"] == "chip.registered" for e in evs) == 32
    grants = sorted((e["pool"], e["team"], e["chips"]) for e in evs if e["type"] == "quota.granted")
    assert grants == [("chipledger/a100", "nlp", 4), ("chipledger/a100", "vision", 8), ("chipledger/h100", "nlp", 8)]
    assert {e["pool"] for e in evs} == {"chipledger/a100", "chipledger/h100"}
    states = Counter((e["state"], e["occurred_at"]) for e in evs if e["type"] == "chip.state_changed")
    assert states == {("down", "2026-12-03T11:37:29Z"): 8, ("healthy", "2026-12-03T11:37:40Z"): 8}


# ------------------------------------------------------------------------------------------------------------
# the actuator
# ------------------------------------------------------------------------------------------------------------

class FakeOps:
    def __init__(self, states):
        self.states = dict(states)
        self.calls = []

    def ops(self):
        return Ops(job_state=lambda j: self.states.get(j), mark=lambda j, c: self.calls.append(("mark", j, c)),
                   requeue=lambda j: self.calls.append(("requeue", j)), cancel=lambda j: self.calls.append(("cancel", j)))


def _decision(did="d-1", pool="chipledger/h100", victims=("4",)):
    return {"decision_id": did, "type": "decision.preempt", "pool": pool, "rule": "reclaim",
            "beneficiary": {"job_id": "7", "team": "nlp"},
            "victims": [{"job_id": v, "team": "speech", "chips": 16} for v in victims]}


def test_actuator_requeues_once_per_decision(tmp_path):
    fake = FakeOps({"4": "RUNNING"})
    a = Actuator(CLUSTER, tmp_path / "a.state", ops=fake.ops())
    out = a.apply(_decision())
    assert out.applied == [("4", "requeue")]
    assert fake.calls == [("mark", "4", "chipledger-preempt:d-1"), ("requeue", "4")]
    again = Actuator(CLUSTER, tmp_path / "a.state", ops=fake.ops())  # restarted
    assert again.apply(_decision()).skipped == "applied before" and len(fake.calls) == 2


def test_actuator_skips_gone_victims_other_clusters_and_dry_runs(tmp_path):
    logs = []
    fake = FakeOps({"4": "PENDING", "5": "RUNNING"})
    a = Actuator(CLUSTER, tmp_path / "a.state", ops=fake.ops(), log=logs.append)
    out = a.apply(_decision(victims=("4", "6")))
    assert out.applied == [] and out.gone == [("4", "PENDING"), ("6", None)] and fake.calls == []
    assert any("gone" in m for m in logs) and any("pending" in m for m in logs)
    assert a.apply(_decision("d-2", pool="other/h100")).skipped.startswith("pool other/h100 is not")
    assert a.apply({"decision_id": "b", "type": "decision.burst", "pool": "chipledger/h100"}).skipped
    dry = Actuator(CLUSTER, tmp_path / "dry.state", ops=fake.ops(), dry_run=True)
    assert dry.apply(_decision("d-3", victims=("5",))).applied == [("5", "would requeue")]
    assert fake.calls == [] and not (tmp_path / "dry.state").exists()
    cancel = Actuator(CLUSTER, tmp_path / "c.state", ops=fake.ops(), action="cancel")
    cancel.apply(_decision("d-4", victims=("5",)))
    assert fake.calls == [("mark", "5", "chipledger-preempt:d-4"), ("cancel", "5")]


def test_decisions_from_jsonl(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(_decision()) + "\n\n" + json.dumps({"type": "pool.tick"}) + "\n")
    assert [d["decision_id"] for d in decisions_from_jsonl(p)] == ["d-1"]


def test_a_future_node_stays_in_the_inventory(nodes):
    """Measured on Slurm 22.05.8: `scontrol update nodename=n4 state=future` leaves n4 in the cluster's TRES and
    records a DOWN node event ("Set to State=FUTURE": sreport counts it as Down); sinfo stops listing it and
    `scontrol -F -o show node` shows it as below. The watcher keeps its GPUs (down for that event), not retired."""
    line = ("NodeName=n4 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=16 CPUTot=16 Gres=gpu:h100:8 "
            "NodeAddr=127.0.0.1 RealMemory=64000 State=FUTURE ThreadsPerCore=1 Partitions=h100  "
            "CfgTRES=cpu=16,mem=62.50G,billing=16,gres/gpu=8,gres/gpu:h100=8 AllocTRES=")
    future = commands.nodes_from_scontrol_text(line)
    assert [(n.name, n.gpus, n.states, n.partitions) for n in future] == [("n4", 8, ("FUTURE",), ("h100",))]
    listed = [n for n in nodes if n.name != "n4"]  # what sinfo shows while n4 is FUTURE
    both = commands.with_future(listed, future)
    def chips(ns):
        return {p: [c for n in spec.nodes for c in chip_ids(n)] for p, spec in pools_of(CLUSTER, ns).items()}

    assert chips(both) == chips(nodes)  # the same pools and chips as before
    assert commands.with_future(nodes, future) == nodes  # a node sinfo lists is taken from sinfo
    evs = node_state_events(CLUSTER, "s", pools_of(CLUSTER, both),
                            [("n4", 1000, None, "DOWN", "Set to State=FUTURE")])
    assert {(e.body["chip_id"], e.body["state"], e.body["reason"]) for e in evs} == {
        (f"n4-gpu{i}", "down", "DOWN: Set to State=FUTURE") for i in range(8)}


def test_a_powered_down_node_is_down_for_its_node_event(nodes):
    """Measured on Slurm 22.05.8 with power saving (SuspendProgram/ResumeProgram set): `scontrol update
    nodename=n3 state=power_down` gives the node event below (`IDLE~`), ended by `state=power_up`; sreport counted
    its 8 GPUs x 16 s as Down. A resume that times out gives a `DOWN~` event: down again."""
    text = ("n3|2026-12-04T12:06:08|2026-12-04T12:06:24|IDLE~|Powered down after SuspendTimeout\n"
            "n3|2026-12-04T12:06:57|Unknown|DOWN~|ResumeTimeout reached\n")
    events = commands.node_events_from_text(text)
    evs = node_state_events(CLUSTER, "s", pools_of(CLUSTER, nodes), events)
    by_time = {}
    for e in evs:
        assert e.body["chip_id"].startswith("n3-gpu")
        by_time.setdefault(e.body["occurred_at"], set()).add((e.body["state"], e.body.get("reason")))
    assert by_time == {
        "2026-12-04T12:06:08Z": {("down", "IDLE~: Powered down after SuspendTimeout")},
        "2026-12-04T12:06:24Z": {("healthy", None)},
        "2026-12-04T12:06:57Z": {("down", "DOWN~: ResumeTimeout reached")}}
    assert len(evs) == 3 * 8


def test_the_account_hierarchy_names_teams_org_slash_team(tmp_path, nodes, assocs, runs):
    """`sacctmgr show assoc format=account,user,parentname`: an account under a parent account other than root is
    the team `parent/account`, deeper ones `a/b/account`; its jobs and its GrpTRES grants carry that name."""
    from chipledger.adapters.slurm.commands import account_parents_from_text
    from chipledger.adapters.slurm.mapping import team_paths

    text = ("Account|User|Par Name\nroot||\nroot|root|\nresearch||root\nvision||research\nvision|alice|\n"
            "cv||vision\nspeech||root\n")
    parents = account_parents_from_text(text)
    assert parents == {"research": "root", "vision": "research", "cv": "vision", "speech": "root"}
    assert team_paths(parents) == {"research": "research", "vision": "research/vision", "cv": "research/vision/cv",
                                   "speech": "speech"}
    assert account_parents_from_text("vision||research\nspeech||root\n") == {"vision": "research", "speech": "root"}
    assert team_paths({"a": "b", "b": "a"}) == {"a": "b/a", "b": "a/b"}  # a cycle (never in Slurm) ends
    fake = FakeSlurm(nodes, assocs, runs)
    fake.parents_ = {"vision": "research", "nlp": "research", "research": "root", "speech": "root"}
    sink = ListSink()
    _watcher(tmp_path, fake, sink).poll()
    teams = {e["team"] for e in sink.events if e["type"] in ("job.submitted", "quota.granted")}
    assert teams and teams <= {"research/vision", "research/nlp", "speech"}
    assert "research/vision" in teams


# --- prices and budgets from Slurm's billing (issue 36) -----------------------------------------------------------

PARTITIONS = ("PartitionName=a100 AllowGroups=ALL Nodes=n[1-2] TRESBillingWeights=CPU=1.0,Mem=0.25G,GRES/gpu=2.0\n"
              "PartitionName=h100 Nodes=n[3-4] TRESBillingWeights=CPU=1.0,GRES/gpu=3.0,GRES/gpu:h100=4.5\n"
              "PartitionName=debug Nodes=n5\n")
ASSOC_MINS = ("ID|Account|User|Partition|GrpTRESMins\n"
              "3|vision|||gres/gpu:a100=60000\n"
              "4|nlp||h100|billing=500000\n"
              "5|nlp|alice||gres/gpu=10\n"
              "6|speech|||cpu=100\n")


def test_billing_weights_and_tres_mins_map_to_prices_and_budgets(nodes):
    pools = pools_of(CLUSTER, nodes)
    weights = commands.partition_billing_from_text(PARTITIONS)
    assert weights == {"a100": "CPU=1.0,Mem=0.25G,GRES/gpu=2.0", "h100": "CPU=1.0,GRES/gpu=3.0,GRES/gpu:h100=4.5"}
    # a GPU's weight × 60 billing-minutes per chip-hour; the typed weight of the pool's flavor first
    assert billing_prices(CLUSTER, pools, weights) == {"chipledger/a100": 120, "chipledger/h100": 270}
    mins = commands.assoc_mins_from_text(ASSOC_MINS)
    assert [m[0] for m in mins] == ["3", "4", "5"]  # speech caps CPUs only
    # GPU-minutes → chip-minutes in the pools of the type; billing-minutes in the partition's pool; a user's is not
    assert budgets_of(CLUSTER, pools, mins) == {("3", "chipledger/a100", "vision", CHIP_MIN_UNIT): 60000,
                                                ("4", "chipledger/h100", "nlp", BILLING_UNIT): 500000}
    # the team is the account's path under its parents, as the grants and jobs name it (team_paths)
    assert budgets_of(CLUSTER, pools, mins, teams={"vision": "research/vision", "nlp": "research/nlp"}) == {
        ("3", "chipledger/a100", "research/vision", CHIP_MIN_UNIT): 60000,
        ("4", "chipledger/h100", "research/nlp", BILLING_UNIT): 500000}


def test_watcher_with_prices_sends_price_and_budget_events_once(tmp_path, nodes, assocs, runs):
    fake = FakeSlurm(nodes, assocs, runs)
    slurm = fake.slurm()
    slurm.billing = lambda: commands.partition_billing_from_text(PARTITIONS)
    slurm.assoc_mins = lambda c: commands.assoc_mins_from_text(ASSOC_MINS)
    sink = ListSink()
    w = Watcher(CLUSTER, tmp_path / "w.state", sink, since=1796297600, settle_s=5, slurm=slurm, clock=lambda: NOW,
                prices=True)
    w.poll()
    got = sorted((e["type"], e["pool"], e.get("unit"), e.get("per_chip_hour"), e.get("amount"), e.get("team"))
                 for e in sink.events if e["type"] in ("price.set", "budget.set"))
    assert got == [("budget.set", "chipledger/a100", CHIP_MIN_UNIT, None, 60000, "vision"),
                   ("budget.set", "chipledger/h100", BILLING_UNIT, None, 500000, "nlp"),
                   ("price.set", "chipledger/a100", CHIP_MIN_UNIT, 60, None, None),
                   ("price.set", "chipledger/a100", BILLING_UNIT, 120, None, None),
                   ("price.set", "chipledger/h100", BILLING_UNIT, 270, None, None)]
    from schemas import parse_event
    assert all(not hasattr(parse_event(json.dumps(e).encode()), "code") for e in sink.events
               if e["type"] in ("price.set", "budget.set"))  # valid events of the contract
    again = ListSink()
    Watcher(CLUSTER, tmp_path / "w.state", again, settle_s=5, slurm=slurm, clock=lambda: NOW + 10, prices=True).poll()
    assert not [e for e in again.events if e["type"] in ("price.set", "budget.set")]
