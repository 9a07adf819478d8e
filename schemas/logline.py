"""A line of `chipledger log export`: an input record's bytes with what the edge knew about it.

The fold on Kafka gets two inputs besides the record (DESIGN §3, issue 31): the broker's append time
(LogAppendTime) and the cluster the record was accepted from (its verified principal's). So that `chipledger run`
on an export applies the same `clock_ahead` check and the same per-cluster dedup, and gives the same books, the
export writes each record that has them as

    {"log":{"appended_s":1733356800,"origin":"us-east1-a","principal":"slurm-east"},"event":<the record's bytes>}

with the record's bytes spliced in as they are (a duplicate is still told from a conflict by its exact bytes). A
line that does not start with `{"log":` is a plain event, as in any events file. No event can be mistaken for a
log line: an event's first key is never `log` (extra fields are refused).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import orjson

PREFIX = b'{"log":'
_SEP = b',"event":'


class LogLine(NamedTuple):
    raw: bytes
    appended_s: Optional[int]
    origin: Optional[str]
    principal: Optional[str]


def log_line(raw: bytes, appended_s: Optional[int], origin: Optional[str], principal: Optional[str] = None) -> bytes:
    """The export line of a record (without its line end); the plain bytes when there is nothing to add."""
    meta = {}
    if appended_s is not None:
        meta["appended_s"] = int(appended_s)
    if origin:
        meta["origin"] = origin
    if principal:
        meta["principal"] = principal
    if not meta:
        return raw
    return PREFIX + orjson.dumps(meta) + _SEP + raw + b"}"


def split_log_line(line: bytes) -> Optional[LogLine]:
    """The parts of an export line, None when `line` is a plain event (or not a well-formed log line: then it is
    read as a plain event and dead-lettered by the parser as any bad line is)."""
    if not line.startswith(PREFIX):
        return None
    # the meta object holds no '"' unescaped inside its strings, so its end is the first `},"event":`
    end = line.find(b"}" + _SEP, len(PREFIX))
    if end < 0 or not line.endswith(b"}"):
        return None
    try:
        meta = orjson.loads(line[len(PREFIX):end + 1])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(meta, dict):
        return None
    appended = meta.get("appended_s")
    origin = meta.get("origin")
    principal = meta.get("principal")
    return LogLine(line[end + 1 + len(_SEP):-1], appended if isinstance(appended, int) else None,
                   origin if isinstance(origin, str) else None, principal if isinstance(principal, str) else None)
