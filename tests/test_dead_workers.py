"""A forked process of a command killed while it works (the kernel's OOM killer, kill -9): the command fails at once
with one line naming what died and how, never waits forever. CI once hung on `backtest --jobs 2` whose pool of
multiprocessing waited for the answer of a dead worker. Each test runs the real command in a process of its own,
finds its forked processes in /proc, kills one with SIGKILL while it works, and bounds the wait (a hang fails the
test instead of CI)."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chipledger.demo import write_events

pytestmark = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods() or
                                not Path("/proc/self/task").is_dir(), reason="no fork or no /proc here")

#: how long a test waits for the command to start its processes, and then to fail once one is killed
BOUND_S = 120


@pytest.fixture(scope="module")
def big_log(tmp_path_factory) -> Path:
    """The seeded fleet's file in 16 copies with their pools renamed (145k lines, 30 MB): read by a backtest in
    parts (each part ≥ 1 MiB), each configuration simulated for seconds."""
    d = tmp_path_factory.mktemp("dead")
    one = d / "fleet.jsonl"
    write_events(one, seed=3, days=3)
    data = one.read_bytes()
    path = d / "big.jsonl"
    with open(path, "wb") as f:
        for c in range(16):
            f.write(data.replace(b'"pool":"', f'"pool":"c{c}-'.encode()))  # (the demo writes compact JSON)
    return path


def children(pid: int) -> list[int]:
    """The processes `pid` forked (from any of its threads) that are still there."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # (the thread ended)
            pass
    return out


def simulating(pid: int) -> bool:
    """Whether `pid` runs (state R, not waiting for its next configuration) and has used CPU time (0.2 s: user +
    system, in clock ticks of 10 ms) beyond its start."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return fields[0] == "R" and int(fields[11]) + int(fields[12]) >= 20


def simulator(log: Path):
    """`working` for a backtest's process simulating a configuration: one never seen with the log open (the
    processes reading it have it open from their start: one of them that exits closes it first, and has used CPU
    too) that is `simulating`."""
    readers: set[int] = set()

    def working(pid: int) -> bool:
        if open_count(pid, log):
            readers.add(pid)
            return False
        return pid not in readers and simulating(pid)

    return working


def open_count(pid: int, path: Path) -> int:
    """How many of `pid`'s file descriptors are open on `path`."""
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            n += os.readlink(fd) == str(path)
        except OSError:  # (closed meanwhile)
            pass
    return n


def kill_a_worker(args: list[str], cwd: Path, working, ctrl_c: bool = False) -> tuple[int, str, list[int]]:
    """Run `python -c <args>` in a session of its own; once one of its forked processes is `working(pid)`, kill
    that one with SIGKILL (`ctrl_c`: send SIGINT to the whole group instead, as a terminal's Ctrl-C does); return
    (the command's exit code, its stderr, the processes of its session still there when it has ended: they are
    killed then). Fails when the command ends before, or does not end within BOUND_S after the signal (then it is
    killed, with its processes)."""
    out, err = cwd / "stdout", cwd / "stderr"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([sys.executable, "-c", *args], start_new_session=True, stdout=o, stderr=e,
                                cwd=os.getcwd())
    left: list[int] = []
    try:
        deadline = time.monotonic() + BOUND_S
        victim = None
        while victim is None:
            assert proc.poll() is None, f"ended before a process was seen working: {err.read_text()}"
            assert time.monotonic() < deadline, "no forked process was seen working"
            for pid in children(proc.pid):
                try:
                    if working(pid):
                        victim = pid
                        break
                except OSError:  # (it ended meanwhile)
                    pass
            time.sleep(0.005)
        if ctrl_c:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(victim, signal.SIGKILL)
        try:
            code = proc.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the command still waits {BOUND_S} s after {'Ctrl-C' if ctrl_c else 'a process was killed'}"
                        f" (a hang)")
        left = in_session(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in left:  # (the command's own processes: it made the session)
            os.kill(pid, signal.SIGKILL)
    return code, err.read_text(), left


def in_session(sid: int) -> list[int]:
    """The processes of session `sid` (zombies not counted)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # (it ended meanwhile)
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


CLI = "from chipledger.cli import app; app()"


def test_a_backtest_whose_process_reading_a_part_is_killed_fails_at_once(big_log, tmp_path):
    """The log is read in parts by forked processes: one killed while it parses its part (it has the log open a
    second time, beside the descriptor it came with) ends the backtest with the part and the signal."""
    config = tmp_path / "c.toml"
    config.write_text("[policy]\npreemption_grace_s = 60\n")
    code, err, left = kill_a_worker([CLI, "backtest", "--events", str(big_log), "--config", str(config),
                                     "--jobs", "2", "--json"], tmp_path, lambda pid: open_count(pid, big_log) >= 2)
    assert code == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: reading "), err  # one line, no traceback
    assert str(big_log.name) in err and re.search(r"the process parsing part \d+ of \d+ \(bytes [\d,]+-", err), err
    assert "stopped: killed by SIGKILL" in err, err
    assert not (tmp_path / "stdout").read_text() and not left  # the other one ended too


def test_a_backtest_whose_process_simulating_a_configuration_is_killed_fails_at_once(big_log, tmp_path):
    """Each configuration is simulated in a forked process (they are forked after the log is read: none has it
    open): one killed while it simulates (it runs, and has used CPU beyond its start) ends the backtest naming the
    configuration and the signal."""
    cfgs = []
    for grace in (60, 600, 3600):
        c = tmp_path / f"grace-{grace}.toml"
        c.write_text(f"[policy]\npreemption_grace_s = {grace}\n")
        cfgs += ["--config", str(c)]
    code, err, left = kill_a_worker([CLI, "backtest", "--events", str(big_log), *cfgs, "--jobs", "2", "--json"],
                                    tmp_path, simulator(big_log))
    assert code == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: the process simulating configuration "), err
    assert any(f"configuration '{name}' stopped: killed by SIGKILL" in err
               for name in ("defaults", "grace-60.toml", "grace-600.toml", "grace-3600.toml")), err
    assert not left  # the other one ended too


@pytest.mark.parametrize("phase", ["reading", "simulating"])
def test_ctrl_c_ends_a_parallel_backtest_and_its_processes(big_log, tmp_path, phase):
    """Ctrl-C (SIGINT to the whole process group) while the processes read the log or simulate: the processes
    ignore it, the backtest's process ends them and exits with the shell's code for SIGINT, no process of it left."""
    config = tmp_path / "c.toml"
    config.write_text("[policy]\npreemption_grace_s = 60\n")
    working = {"reading": lambda pid: open_count(pid, big_log) >= 2,
               "simulating": simulator(big_log)}[phase]
    code, err, left = kill_a_worker([CLI, "backtest", "--events", str(big_log), "--config", str(config),
                                     "--jobs", "2", "--json"], tmp_path, working, ctrl_c=True)
    assert code == 130, err
    assert "Traceback" not in err and not (tmp_path / "stdout").read_text()
    assert not left


def _answers(i: int) -> tuple:
    """Slower for the first items (a later answer comes back first), a fault of its own for some."""
    if i == 5:
        raise ZeroDivisionError("five")
    if i == 6:
        os._exit(3)
    if i == 7:
        import faulthandler

        faulthandler.disable()  # (pytest's would print a "Fatal Python error" and a stack to the suite's log)
        os.kill(os.getpid(), signal.SIGSEGV)
    sum(range((8 - i) * 200_000))
    return i, os.getpid()


def test_the_backtests_processes_answer_in_order_and_a_fault_is_one_clear_error():
    """chipledger.sim.backtest._in_processes, which reads the parts and simulates the configurations of
    `backtest --jobs`: the answers in the order asked whatever order they come back in, by more than one process;
    an exception of the work raised as it is; a process that exits or crashes named with its code or signal."""
    from contextlib import closing

    from chipledger.sim.backtest import BacktestProcessDied, _in_processes

    what = "item {}".format
    with closing(_in_processes(_answers, 5, 2, what)) as got:
        answers = list(got)
    assert [i for i, _ in answers] == [0, 1, 2, 3, 4]
    assert len({pid for _, pid in answers}) == 2 and os.getpid() not in {pid for _, pid in answers}
    with pytest.raises(ZeroDivisionError, match="five") as raised:
        with closing(_in_processes(_answers, 6, 2, what)) as got:
            list(got)
    assert "in a process of the backtest" in raised.value.__notes__[0]
    for item, how in ((6, "exit code 3"), (7, "killed by SIGSEGV (a crash)")):
        with pytest.raises(BacktestProcessDied, match=re.escape(f"item 1 stopped: {how}")):
            with closing(_in_processes(lambda i: _answers(item) if i == 1 else i, 3, 2, what)) as got:
                list(got)


def test_a_parallel_run_whose_fold_process_is_killed_fails_at_once_and_commits_nothing(big_log, tmp_path):
    """`run --jobs 2`: its fold processes answer through pipes the run's process waits on with their ends, so a
    killed one is seen at once (this never hung; it guards that): one line naming the process and the signal, and
    nothing of the run in the lake."""
    lake = tmp_path / "lake"
    code, err, left = kill_a_worker([CLI, "run", "--events", str(big_log), "--lake", str(lake), "--store",
                                     f"sqlite:///{tmp_path / 's.db'}", "--jobs", "2"], tmp_path, simulating)
    assert code == 1, err
    assert re.fullmatch(r"error: fold process \d stopped: killed by SIGKILL \(out of memory\? [^\n]*\)\n", err), err
    assert not left
    assert not (lake / "_lake.json").exists() and not list(lake.rglob("*.parquet"))


def test_a_lake_upgrade_whose_process_is_killed_fails_at_once_and_changes_nothing(big_log, tmp_path):
    """`lake upgrade --jobs 2` folding the fact tables again: a killed process is one line naming it and the
    signal (this never hung; it guards that), and the lake is as it was (the tables still to fold)."""
    import json

    from chipledger.refold import REFOLDABLE, missing_fact_tables

    lake = tmp_path / "lake"
    ran = subprocess.run([sys.executable, "-c", CLI, "run", "--events", str(big_log), "--lake", str(lake),
                          "--store", f"sqlite:///{tmp_path / 's.db'}", "--jobs", "1"], capture_output=True,
                         timeout=600, cwd=os.getcwd())
    assert ran.returncode == 0, ran.stderr
    manifest = lake / "_lake.json"
    m = json.loads(manifest.read_text())
    for t in REFOLDABLE:  # as a lake written before the fold wrote its facts
        del m["tables"][t]
    manifest.write_text(json.dumps(m))
    before = manifest.read_bytes()
    code, err, left = kill_a_worker([CLI, "lake", "upgrade", "--lake", str(lake), "--jobs", "2"], tmp_path,
                                    simulating)
    assert code == 1, err
    assert re.fullmatch(rf"error: {re.escape(str(lake))}: could not fold the lake's events again: refold process "
                        rf"\d stopped: killed by SIGKILL \(out of memory\? [^\n]*\)\n", err), err
    assert not left
    assert manifest.read_bytes() == before and set(missing_fact_tables(lake)) == set(REFOLDABLE)


def test_a_killed_events_process_fails_the_run_at_once_naming_the_signal(tmp_path):
    """`run --jobs 1`'s events process (it writes the events table and encodes the run's files) killed while the
    fold goes on: the run fails with one line naming the signal and commits nothing."""
    import chipledger.embedded as embedded
    from chipledger.demo import write_events

    events = tmp_path / "events.jsonl"
    write_events(events, seed=3, days=2)
    lake = tmp_path / "lake"
    sent = []
    real = embedded._EventsProcess._send

    def send_then_kill(self):  # the second batch: the process has work, and is killed under the run's feet
        sent.append(1)
        if len(sent) == 2:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.join(timeout=30)
        real(self)

    embedded._EventsProcess._send = send_then_kill
    try:
        with pytest.raises(embedded.RunError, match=r"events table and files stopped: killed by SIGKILL"):
            embedded.run_file(events, lake)
    finally:
        embedded._EventsProcess._send = real
    assert len(sent) == 2 and not (lake / "_lake.json").exists()
