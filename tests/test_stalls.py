"""streams.stalls: an event-loop stall is logged once, with its length and the code that held the loop."""

from __future__ import annotations

import asyncio
import logging
import time

from streams.stalls import STALL_LOG_PREFIX, StallWatch


def hold_the_loop(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # busy, as a long fold or a state serialization is
        pass


def test_a_stall_is_logged_with_its_length_and_the_code_that_held_the_loop(caplog):
    async def go():
        watch = StallWatch(threshold_ms=100)
        watch.start()
        await asyncio.sleep(0.1)
        hold_the_loop(0.3)
        await asyncio.sleep(0.1)  # the loop runs again: the watcher reports the stall
        await asyncio.sleep(0.05)
        watch.stop()
        return watch
    with caplog.at_level(logging.WARNING, logger="streams.stalls"):
        watch = asyncio.run(go())
    # (a loaded machine may add a stall of its own: the one the test made is the one naming hold_the_loop)
    lines = [r.getMessage() for r in caplog.records if STALL_LOG_PREFIX in r.getMessage()]
    ours = [line for line in lines if "hold_the_loop" in line and "test_stalls.py" in line]
    assert len(ours) == 1 and watch.stalls == len(lines)
    held_ms = float(ours[0].split(STALL_LOG_PREFIX, 1)[1].split(" ms:")[0])
    assert 250 <= held_ms <= 2000 and watch.longest_ms >= held_ms - 1
