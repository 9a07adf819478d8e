"""The embedded run's cyclic garbage collector (chipledger/embedded.py, GcPause; docs/benchmarks-history.md, issue 22
part 5): automatic collection is off while `chipledger run` folds; every GC_FREEZE_MASK + 1 lines the objects made
since the last checkpoint are collected once (the cycles those lines made are freed, so memory stays bounded) and
what survives is frozen; after the run the collector is as the caller had it (after a failed run too:
tests/test_embedded_events_process.py)."""

from __future__ import annotations

import gc
import json
import weakref

from typer.testing import CliRunner

import chipledger.embedded as embedded
from chipledger.cli import app
from chipledger.demo import write_events
from chipledger.embedded import GcPause


class _Node:
    pass


def _cycle() -> weakref.ref:
    a = _Node()
    a.me = a  # only the cyclic collector frees it
    return weakref.ref(a)


def test_a_checkpoint_frees_the_cycles_made_since_the_last_one_and_freezes_what_lives():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    kept = _Node()
    with GcPause() as paused:
        assert not gc.isenabled()
        dead = _cycle()
        kept.me = kept
        for _ in range(10_000):  # far past the young generation's threshold: no automatic pass runs
            _Node().me = []
        assert dead() is not None
        paused.checkpoint()
        assert dead() is None  # freed at the checkpoint
        assert gc.get_freeze_count() > 0 and not gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == 0  # as it was found, nothing left frozen


def test_a_caller_that_turned_collection_off_keeps_it_off():
    gc.disable()
    try:
        with GcPause() as paused:
            paused.checkpoint()
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_chipledger_run_folds_with_automatic_collection_off_and_checkpoints_every_mask_lines(tmp_path, monkeypatch):
    events = tmp_path / "events.jsonl"
    write_events(events, seed=3, days=1)
    lines = len(events.read_bytes().splitlines())
    monkeypatch.setattr(embedded, "GC_FREEZE_MASK", 0x3F)  # a checkpoint every 64 lines
    seen: list = []
    checkpoint = GcPause.checkpoint

    def spy() -> None:
        seen.append(gc.isenabled())
        checkpoint()

    monkeypatch.setattr(GcPause, "checkpoint", staticmethod(spy))
    # --jobs 1: the fold in the run's own process, where the spy sees it (with --jobs 2 each forked fold process
    # runs the same fold_lines, and so the same GcPause, out of the spy's sight)
    res = CliRunner().invoke(app, ["run", "--events", str(events), "--lake", str(tmp_path / "lake"),
                                   "--store", f"sqlite:///{tmp_path / 's.db'}", "--json", "--jobs", "1"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["lines"] == lines > 1_000
    assert len(seen) == lines // 64 and not any(seen)  # every 64 lines, with automatic collection off
    assert gc.isenabled() and gc.get_freeze_count() == 0

