"""One line of a `log export`: an input record's value with what the log knows of it (docs/streaming.md).

The fold checks an event against its broker append time (`clock_ahead`) and deduplicates ids per origin (the
cluster it was accepted from): both come from the log record, not from the event, so an export carries them for
`chipledger run` to apply the same checks and give the same books. A line of an export is

    {"log":1,"appended_at":"2026-11-02T08:00:00.123Z","origin":"us-east1-a","value":"<the record's value>"}

with the keys in this order (`run` knows such a line by its first bytes): `appended_at` is the record's append
time (RFC 3339, UTC, milliseconds; null when not known), `origin` the cluster of the principal it was accepted
from (null when not known: the event's `source` then stands in), `value` the record's value as a JSON string
(byte for byte once encoded as UTF-8), or `value_b64` (base64) for a value that is not UTF-8. Any other line is a
plain event, as before.
"""

from __future__ import annotations

import base64
import binascii
from datetime import datetime, timezone
from typing import Optional, Union

import orjson

from schemas.codes import Rejection, RejectionCode

PREFIX = b'{"log":1,'  # how a wrapped line starts (the writer below puts "log" first)


def wrap(value: bytes, appended_ms: Optional[int], origin: Optional[str]) -> bytes:
    """The export line (without its newline) of a record's value, append time (epoch ms) and origin."""
    at = None
    if appended_ms is not None:
        at = datetime.fromtimestamp(appended_ms // 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S") + \
            f".{appended_ms % 1000:03d}Z"
    try:
        body = {"value": value.decode("utf-8")}
    except UnicodeDecodeError:
        body = {"value_b64": base64.b64encode(value).decode("ascii")}
    return b'{"log":1,' + orjson.dumps({"appended_at": at, "origin": origin, **body})[1:]


def is_wrapped(line: bytes) -> bool:
    return line.startswith(PREFIX)


def unwrap(line: bytes) -> Union[tuple[bytes, Optional[str], Optional[int]], Rejection]:
    """(value, origin, appended_s) of an export line, or a `schema_invalid` Rejection when it is not one."""
    def bad(why: str) -> Rejection:
        return Rejection(RejectionCode.schema_invalid, f"log export line: {why}")
    try:
        d = orjson.loads(line)
    except orjson.JSONDecodeError as err:
        return bad(f"not JSON ({str(err)[:120]})")
    if not isinstance(d, dict) or d.get("log") != 1:
        return bad("expected an object with \"log\": 1")
    extra = set(d) - {"log", "appended_at", "origin", "value", "value_b64"}
    if extra:
        return bad(f"unknown keys {', '.join(sorted(str(k)[:32] for k in extra))}")
    at = d.get("appended_at")
    appended_s = None
    if at is not None:
        try:
            ts = datetime.fromisoformat(at) if isinstance(at, str) else None
        except ValueError:
            ts = None
        if ts is None or ts.tzinfo is None:
            return bad("appended_at must be an RFC 3339 time with a zone, or null")
        appended_s = int(ts.timestamp() // 1)
    origin = d.get("origin")
    if origin is not None and (not isinstance(origin, str) or not origin or "/" in origin or len(origin) > 256):
        return bad("origin must be a cluster name (no '/'), or null")
    if "value" in d and isinstance(d["value"], str) and "value_b64" not in d:
        value = d["value"].encode("utf-8", "surrogatepass")
    elif "value_b64" in d and isinstance(d["value_b64"], str) and "value" not in d:
        try:
            value = base64.b64decode(d["value_b64"], validate=True)
        except (binascii.Error, ValueError):
            return bad("value_b64 is not base64")
    else:
        return bad("exactly one of value (a string) or value_b64 is needed")
    return value, origin, appended_s
