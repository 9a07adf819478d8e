"""bench/replay.py's instruction counts (perf stat where the kernel gives a hardware counter, else valgrind's
callgrind): each phase, run in its own child process on the same tiny sample, gives a positive count. Without
perf's counter and without valgrind: skipped loudly, or a failure with CHIPLEDGER_REQUIRE_VALGRIND=1 (CI).
Under valgrind this takes about a minute (five Python processes, mostly their imports)."""

from __future__ import annotations

import os
import shutil
from itertools import islice
from pathlib import Path

import pytest

from tests.bench_support import bench_module


def _replay():
    return bench_module("replay")


def test_instruction_counts_per_phase(tmp_path):
    replay = _replay()
    tool = replay.instruction_tool()
    if tool is None:
        msg = ("INSTRUCTION COUNT TEST NOT RUN: no hardware counter for `perf stat -e instructions` and no "
               "valgrind (Debian: apt-get install valgrind; scripts/valgrind.sh ensure)")
        if os.environ.get("CHIPLEDGER_REQUIRE_VALGRIND") == "1":
            pytest.fail(f"{msg} (CHIPLEDGER_REQUIRE_VALGRIND=1)", pytrace=False)
        pytest.skip(msg)
    from chipledger.sim.scenario import generate, write_jsonl

    sample = tmp_path / "sample.jsonl"
    # 3,000 events: each phase's count includes ~1.3 G instructions of start-up that vary by a few million between
    # processes, so the fold's own work (fold - validate: ~60,000 per event) must be well above that (300 events
    # once gave fold_alone = -2.2 M)
    written = write_jsonl(islice(generate(seed=replay.SEED, days=1, scale=replay.SCALE), 3000), sample)
    c = replay.count_instructions(sample, tool)
    assert c["tool"] == tool and c["events"] == written == 3000
    for key in ("setup", "validate", "fold", "embedded", "embedded_inline", "validation", "fold_alone", "lake_writer",
                "lake_writer_inline"):
        assert isinstance(c[key], int) and c[key] > 0, (key, c)
    # each phase does strictly more than the one before it on the same sample
    assert c["setup"] < c["validate"] < c["fold"] < c["embedded"]
    assert c["fold"] < c["embedded_inline"]
    if tool == "callgrind":  # one count per process: the events table's process is counted apart
        assert c["events_process"] > 0


def test_no_tool_is_a_clear_error(tmp_path, monkeypatch):
    replay = _replay()
    monkeypatch.setattr(replay, "instruction_tool", lambda: None)
    with pytest.raises(RuntimeError, match="cannot count instructions.*valgrind"):
        replay.count_instructions(tmp_path / "none.jsonl")


def test_metrics_collector_instruction_counts():
    """bench/metrics.py --instructions: the fold alone, and the worker's path without and with /metrics (and with
    scrapes), each phase in its own child on the same events; each loop costs more than parsing alone, the worker's
    path more than the fold alone, and scrapes more than none."""
    replay = _replay()
    tool = replay.instruction_tool()
    if tool is None:
        msg = "INSTRUCTION COUNT TEST NOT RUN: no perf counter and no valgrind (scripts/valgrind.sh ensure)"
        if os.environ.get("CHIPLEDGER_REQUIRE_VALGRIND") == "1":
            pytest.fail(f"{msg} (CHIPLEDGER_REQUIRE_VALGRIND=1)", pytrace=False)
        pytest.skip(msg)
    metrics = bench_module("metrics")
    c = metrics.count_instructions(300, 11, tool)
    assert c["tool"] == tool and c["events"] == 300
    assert c["setup"] < c["fold"] < c["without"] and c["setup"] < c["with"] < c["scrapes"]
    assert c["without_net"] == c["without"] - c["setup"] and c["metrics"] == c["with"] - c["without"]
    assert c["scrape"] == (c["scrapes"] - c["with"]) // metrics.SCRAPES_COUNTED > 0


def test_later_sample_counts_only_its_events(tmp_path):
    """--instructions-from K: the events after the first K, the state folded up to them not counted (callgrind
    collects inside sys.call_tracing only). Counted were the imports (~1.3 G instructions) or the fold of the
    2,000 events before the sample (tens of thousands per event each), the 100 counted events would cost far
    more than parsing and folding them."""
    replay = _replay()
    tool = replay.instruction_tool()
    if tool != "callgrind":  # perf counts whole processes (a machine with a hardware counter skips this)
        msg = f"LATER-SAMPLE INSTRUCTION TEST NOT RUN: it needs valgrind's callgrind (counting tool here: {tool})"
        if tool is None and os.environ.get("CHIPLEDGER_REQUIRE_VALGRIND") == "1":
            pytest.fail(f"{msg} (CHIPLEDGER_REQUIRE_VALGRIND=1)", pytrace=False)
        pytest.skip(msg)
    from chipledger.sim.scenario import generate, write_jsonl

    sample = tmp_path / "sample.jsonl"
    write_jsonl(islice(generate(seed=replay.SEED, days=1, scale=replay.SCALE), 2100), sample)
    c = replay.count_instructions(sample, tool, skip=2000)
    assert c["skip"] == 2000 and c["events"] == 100
    assert 0 < c["validate"] < c["fold"]
    assert c["validation"] == c["validate"] and c["fold_alone"] == c["fold"] - c["validate"] > 0
    assert c["validation"] < 100 * 500_000  # parsing is ~50,000 per event; the imports alone are ~1.3 G
    assert c["fold_alone"] < 5 * c["validation"]  # the fold is ~1-2x parsing per event; the prefix's ~20x


def test_later_sample_needs_callgrind(tmp_path):
    replay = _replay()
    with pytest.raises(RuntimeError, match="callgrind only"):
        replay.count_instructions(tmp_path / "none.jsonl", "perf", skip=10)


def _later_sample(tmp_path, replay, n: int) -> Path:
    from chipledger.sim.scenario import generate, write_jsonl

    sample = tmp_path / "sample.jsonl"
    write_jsonl(islice(generate(seed=replay.SEED, days=1, scale=replay.SCALE), 2000 + n), sample)
    return sample


def test_cache_simulation_gives_each_phase_its_misses(tmp_path):
    """--cache-sim: callgrind's cache and branch simulation on a later sample; each phase's collected events are
    kept, and the per-event figures are the same differences as the instruction counts."""
    replay = _replay()
    if replay.instruction_tool() != "callgrind":
        msg = "CACHE SIMULATION TEST NOT RUN: it needs valgrind's callgrind"
        if os.environ.get("CHIPLEDGER_REQUIRE_VALGRIND") == "1":
            pytest.fail(f"{msg} (CHIPLEDGER_REQUIRE_VALGRIND=1)", pytrace=False)
        pytest.skip(msg)
    sample = _later_sample(tmp_path, replay, 100)
    c = replay.count_instructions(sample, "callgrind", skip=2000,
                                  cache_sim="--D1=32768,8,64 --LL=1048576,8,64 --branch-sim=yes")
    assert c["fold_collected"]["Ir"] == c["fold"] and c["validate_collected"]["Ir"] == c["validate"]
    per = replay.cache_per_event(c)
    assert list(per) == ["validation", "fold alone"]
    assert per["fold alone"]["Ir"] == c["fold_alone"] / 100
    for d in per.values():
        assert d["Ir"] > 0 and d["Dr"] > 0 and d["D1m"] > 0 and d["Bc"] > 0
        assert d["D1m"] == d["D1mr"] + d["D1mw"] and d["DLm"] <= d["D1m"]  # a last-level miss missed D1 first
    with pytest.raises(RuntimeError, match="callgrind"):
        replay.count_instructions(sample, "perf", cache_sim="yes")


def test_native_profile_samples_only_the_counted_region(tmp_path):
    """--native-profile: `perf record -e cpu-clock` in each phase's child, enabled only around the counted events.
    Sampled from the start, the imports and the fold of the 2,000 events before the sample (over a second of CPU)
    would give thousands of samples; the 1,000 counted events take tens of milliseconds."""
    replay = _replay()
    if shutil.which("perf") is None:
        pytest.skip("NATIVE PROFILE TEST NOT RUN: no perf (Debian: linux-perf)")
    sample = _later_sample(tmp_path, replay, 1000)
    prof = replay.native_profile(sample, 2000, repeat=1)
    v, f = prof["validate"], prof["fold"]
    assert v["events"] == f["events"] == 1000
    assert 0 < v["cpu_s"][0] < f["cpu_s"][0] < 1.0
    for o in (v, f):  # as many samples as the region's own CPU time gives at 4,999 per second: the region only
        assert 0 < o["samples"] <= o["cpu_s"][0] * 4999 * 1.5 + 20
    assert any(obj.startswith("libpython") for obj, _ in f["symbols"])


def test_gc_timer_counts_the_collectors_passes_while_it_measures():
    """--gc-time: GcTimer counts the passes (by generation) and their time while the measured function runs, and
    stops counting after it."""
    import gc

    replay = _replay()
    timer = replay.GcTimer()

    def work() -> str:
        gc.collect(0)
        gc.collect(2)
        return "done"

    assert timer.measure(work) == "done"
    assert timer.passes == [1, 0, 1] and timer.seconds > 0
    gc.collect()
    assert timer.passes == [1, 0, 1] and timer not in gc.callbacks
