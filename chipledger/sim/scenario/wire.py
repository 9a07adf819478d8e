"""The scenario's wire text: event times as RFC 3339 text, chips as the wire writes them, and compact JSON lines.

Every part of the scenario writes its events through these, so a scenario is the same bytes whichever part
emitted an event.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Iterable, Iterator

UTC = timezone.utc
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class _Clock:
    """Epoch seconds to RFC 3339 text ("2026-11-02T08:00:00Z"), cheaply: the text up to the minute is
    cached (one strftime per day), the seconds come from a table."""

    __slots__ = ("_days", "_hm", "_ss", "_min", "_min_s")

    def __init__(self) -> None:
        self._days: dict[int, str] = {}
        self._hm = [f"{h:02d}:{m:02d}:" for h in range(24) for m in range(60)]
        self._ss = [f"{s:02d}Z" for s in range(60)]
        self._min = -1
        self._min_s = ""

    def __call__(self, t: int) -> str:
        mi, sec = divmod(t, 60)
        if mi != self._min:
            d, r = divmod(mi, 1440)
            pre = self._days.get(d)
            if pre is None:
                pre = self._days[d] = (_EPOCH + timedelta(days=d)).strftime("%Y-%m-%dT")
            self._min = mi
            self._min_s = pre + self._hm[r]
        return self._min_s + self._ss[sec]


def _wire_chips(milli: int):
    return milli // 1000 if milli % 1000 == 0 else milli / 1000


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def iter_jsonl(events: Iterable[dict]) -> Iterator[str]:
    """Compact JSON text of each event (no newline)."""
    enc = _ENCODE
    for ev in events:
        yield enc(ev)


def write_jsonl(events: Iterable[dict], path) -> int:
    """Write one compact JSON object per line; return the number of lines written."""
    n = 0
    enc = _ENCODE
    with open(path, "w", encoding="utf-8") as fh:
        buf = []
        for ev in events:
            buf.append(enc(ev))
            if len(buf) >= 4096:
                fh.write("\n".join(buf))
                fh.write("\n")
                n += len(buf)
                buf.clear()
        if buf:
            fh.write("\n".join(buf))
            fh.write("\n")
            n += len(buf)
    return n
