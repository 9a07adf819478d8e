"""Event-loop stalls of a process: how long its asyncio loop did not run, and what held it.

A task in the loop stamps a heartbeat every `TICK_S`; a daemon thread looks at the stamp every `TICK_S`. While the
loop has not stamped for longer than the threshold, the thread samples the loop thread's stack
(`sys._current_frames`) at each look; when the loop stamps again, the stall is logged once with its length and the
places the samples found (the innermost frames, and the innermost one of chipledger's own code), most frequent
first. So a log line says which code held the loop and for how long, without a profiler.

The worker runs it with `--log-stalls-ms N` (`[worker] log_stalls_ms`); bench/stream.py turns it on for its latency
run and sums the lines. It costs one thread wake-up every 10 ms (the GIL for a few microseconds).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections import Counter
from typing import Optional

log = logging.getLogger(__name__)

TICK_S = 0.01
OWN_CODE = ("/streams/", "/ledger/", "/schemas/", "/chipledger/")
STALL_LOG_PREFIX = "stall: event loop held"  # bench/stream.py finds the lines by it


def where(frame, depth: int = 3) -> str:
    """A stack in one line: the innermost `depth` frames (innermost first) and, when none of them is ours, the
    innermost frame of our own code (streams/, ledger/, schemas/, chipledger/) after ' @ '."""
    inner: list[str] = []
    own = None
    f = frame
    while f is not None:
        code = f.f_code
        name = code.co_filename
        short = "/".join(name.rsplit("/", 2)[-2:])
        place = f"{short}:{f.f_lineno} {code.co_name}"
        if len(inner) < depth:
            inner.append(place)
        if own is None and any(part in name for part in OWN_CODE) and "/site-packages/" not in name:
            own = place
            if len(inner) <= depth:
                break
        f = f.f_back
    text = " < ".join(inner)
    if own is not None and own not in inner:
        text += f" @ {own}"
    return text


class StallWatch:
    """Watches one asyncio loop (the one `start` runs in) from a daemon thread; logs each stall longer than
    `threshold_ms` with what held the loop. `stalls` counts them, `held_ms` sums their lengths, `longest_ms`."""

    def __init__(self, threshold_ms: float):
        self.threshold_s = threshold_ms / 1000
        self.stalls = 0
        self.held_ms = 0.0
        self.longest_ms = 0.0
        self._beat = time.monotonic()
        self._loop_thread: Optional[int] = None
        self._stop = threading.Event()
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        """Start the heartbeat task in the running loop and the watching thread."""
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._task = asyncio.ensure_future(self._heartbeat())
        threading.Thread(target=self._watch, name="chipledger-stall-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()

    async def _heartbeat(self) -> None:
        while not self._stop.is_set():
            self._beat = time.monotonic()
            await asyncio.sleep(TICK_S)

    def _watch(self) -> None:
        samples: Counter = Counter()
        began = None
        while not self._stop.wait(TICK_S):
            beat = self._beat
            late = time.monotonic() - beat - TICK_S
            if late > self.threshold_s:
                if began is None:
                    began, samples = beat, Counter()
                frame = sys._current_frames().get(self._loop_thread)
                if frame is not None:
                    samples[where(frame)] += 1
                del frame
            elif began is not None and beat > began:
                self._report((beat - began - TICK_S) * 1000, samples)
                began = None

    def _report(self, held_ms: float, samples: Counter) -> None:
        self.stalls += 1
        self.held_ms += held_ms
        self.longest_ms = max(self.longest_ms, held_ms)
        places = "; ".join(f"{n}x {place}" for place, n in samples.most_common(3)) or "no sample"
        log.warning("%s %.0f ms: %s", STALL_LOG_PREFIX, held_ms, places)
