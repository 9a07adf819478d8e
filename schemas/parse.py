"""Parsing at the boundary: raw bytes (or a decoded object) to a typed event, or a Rejection.

Nothing here raises for bad input: every failure becomes a `Rejection` with the code of highest precedence,
checked in this order: size (`too_large`, before any byte is parsed), JSON (`not_json`; a message nested
beyond the JSON parser's own depth limit of 1024 is `too_deep`, since the parser stops there), one object
(`not_json`), depth (`too_deep`: deeper than MAX_DEPTH), `type` (`unknown_type`), fields (`schema_invalid`; a
key repeated in one object too: JSON parsers disagree on which copy wins, so the contract takes neither).
No detail ever repeats an input value whole: a type is quoted up to 64 characters, a container by its kind.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Union

import orjson
from pydantic import ValidationError

from schemas.codes import MAX_DETAIL, Rejection, RejectionCode, cap_detail
from schemas.events import EVENT_MODELS, MAX_TIME, MIN_TIME, NO_CONTROL, TEXT_FIELDS, TEXT_PATTERN

_MAX_DETAIL = MAX_DETAIL  # (kept for importers of the old name)
# The largest message value accepted, in bytes ([ledger] max_event_bytes). Well under Kafka's default 1 MiB
# record limit: a dead letter carries the raw bytes in base64 (4/3 larger) and still fits one record. A
# job.started listing 20,000 chip ids of 25 bytes fits.
DEFAULT_MAX_EVENT_BYTES = 512 * 1024
# The deepest JSON nesting accepted in a message: no event nests deeper than 2 (an object holding chip_ids).
MAX_DEPTH = 32
_KNOWN = ", ".join(sorted(EVENT_MODELS))
_DEPTH_LIMIT_MSG = "depth limit exceeded"  # orjson's message when a value nests beyond its limit (1024)


_MIN_YEAR, _MAX_YEAR = MIN_TIME.year, MAX_TIME.year - 1  # years strictly between are inside the range
_ID_BAD = re.compile(NO_CONTROL.replace("^[^", "[").replace("]*$", "]"))
_TEXT_BAD = re.compile(TEXT_PATTERN.replace("^[^", "[").replace("]*$", "]"))


def control_characters(obj: dict):
    """The first field of a (validated) event that holds a control character, as a Rejection, else None: ids
    and names may hold none (C0, DEL, C1), free text no C0 character but tab and line breaks."""
    for key, value in obj.items():
        bad = _TEXT_BAD if key in TEXT_FIELDS and not (key == "reason" and obj.get("type") == "job.waiting") else _ID_BAD
        values = value if value.__class__ is list else (value,)
        for v in values:
            if v.__class__ is str and bad.search(v):
                return Rejection(RejectionCode.schema_invalid,
                                 f"{obj['type']}: {str(key)[:64]}: must not contain control characters")
    return None


def _may_hold_controls(raw: bytes) -> bool:
    """Whether a JSON text can decode to a string with a control character: C0 characters must be escaped in
    JSON (a backslash), DEL is itself, and C1 characters are not ASCII. (`find`, not `in`: 3x faster on bytes.)"""
    return raw.find(b"\\") >= 0 or raw.find(b"\x7f") >= 0 or not raw.isascii()


def _time_range(event) -> Any:
    """schema_invalid when the event's time is outside [MIN_TIME, MAX_TIME), else None (the year settles it
    but at the two edges, where a zone offset can cross it)."""
    ts = event.occurred_at
    if MIN_TIME.year < ts.year < MAX_TIME.year - 1 or MIN_TIME <= ts < MAX_TIME:
        return None
    return Rejection(RejectionCode.schema_invalid,
                     f"{event.type}: occurred_at: must be at or after {MIN_TIME:%Y-%m-%dT%H:%M:%SZ} and before "
                     f"{MAX_TIME:%Y-%m-%dT%H:%M:%SZ}")


_KEY_SPACED = re.compile(rb'"[ \t\n\r]+:')  # a key followed by white space before its colon


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def duplicate_key(raw: bytes, obj: dict):
    """The first key repeated in an object of the message (orjson, like most parsers, keeps the last one), as a
    `schema_invalid` Rejection, else None. Cheap on the common path: each key of the top-level object ends with
    `":` (or `"` and white space before its colon), so when the count of those equals the object's keys and no
    key is spaced from its colon, no key repeats; otherwise (nested objects, a `":` inside a string, spaced keys)
    the message is read again with a hook that sees every key."""
    if raw.count(b'":') == len(obj) and _KEY_SPACED.search(raw) is None:
        return None
    try:
        json.loads(raw, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as dup:
        return Rejection(RejectionCode.schema_invalid, f"{obj['type']}: key {_quote(dup.args[0])} "
                                                       f"appears more than once in one object")
    except ValueError:  # orjson read it; should the standard parser not (it is stricter nowhere we rely on), keep it
        return None
    return None


def _describe(err: ValidationError) -> str:
    parts = []
    for e in err.errors(include_url=False)[:5]:
        loc = ".".join(str(p)[:64] for p in e["loc"]) or "event"
        kind = e["type"]
        if kind == "string_pattern_mismatch":
            msg = "must not contain control characters"
        elif kind in ("less_than", "greater_than_equal") and e["loc"] == ("occurred_at",):
            msg = f"must be at or after {MIN_TIME:%Y-%m-%dT%H:%M:%SZ} and before {MAX_TIME:%Y-%m-%dT%H:%M:%SZ}"
        else:
            msg = e["msg"]
        parts.append(f"{loc}: {msg}")
    return cap_detail("; ".join(parts))


def too_deep(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether a decoded JSON value nests lists or objects deeper than `limit` (iterative: never recurses,
    and stops at the first value found too deep)."""
    stack = [(obj, 1)]
    pop = stack.pop
    push = stack.append
    while stack:
        value, depth = pop()
        if depth > limit:
            return True
        cls = value.__class__
        if cls is dict:
            value = value.values()
        elif cls is not list:
            continue
        for v in value:
            c = v.__class__
            if c is dict or c is list:
                push((v, depth + 1))
    return False


def _deep(obj: Any) -> Rejection:
    return Rejection(RejectionCode.too_deep, f"JSON nested deeper than {MAX_DEPTH} levels (no event nests beyond 2)")


def _quote(value: Any) -> str:
    """An input value for a detail: a string quoted up to 64 characters, anything else by its kind."""
    if isinstance(value, str):
        return repr(value) if len(value) <= 64 else f"{value[:64]!r}… ({len(value)} characters)"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)[:64]
    return f"a JSON {'object' if isinstance(value, dict) else 'array' if isinstance(value, list) else type(value).__name__}"


def parse_payload(obj: Any, _clean: bool = False):
    """Validate an already-decoded JSON value. Returns an event model or a Rejection. (`_clean`: the caller
    knows no string in it holds a control character.)"""
    if not isinstance(obj, dict):
        return Rejection(RejectionCode.not_json, f"expected one JSON object, got {type(obj).__name__}")
    kind = obj.get("type")
    # the depth is looked at only on the way to a rejection: a valid event nests 2 deep at most, so an event
    # that validates cannot be too deep, and the common path pays nothing
    model = EVENT_MODELS.get(kind) if kind.__class__ is str else None
    if model is None:
        if too_deep(obj):
            return _deep(obj)
        return Rejection(RejectionCode.unknown_type, f"type {_quote(kind)} is not one of: {_KNOWN}")
    try:
        event = model.model_validate(obj)
    except ValidationError as err:
        if too_deep(obj):
            return _deep(obj)
        return Rejection(RejectionCode.schema_invalid, f"{kind}: {_describe(err)}")
    except RecursionError:  # not seen with pydantic-core's own guard; a value, should a validator ever recurse
        return _deep(obj)
    year = event.occurred_at.year
    bad = None if _MIN_YEAR < year < _MAX_YEAR else _time_range(event)
    if bad is None and not _clean:
        bad = control_characters(obj)
    return event if bad is None else bad


def size_rejection(size: int, max_bytes: int, sha256: str = "") -> Rejection:
    """`too_large` for a message of `size` bytes; `sha256` (of the whole message, when known) identifies it,
    since its dead letter keeps only its first `max_bytes` bytes."""
    digest = f" (sha256 {sha256})" if sha256 else ""
    return Rejection(RejectionCode.too_large, f"message of {size:,} bytes{digest} is over the limit of "
                                              f"{max_bytes:,} bytes ([ledger] max_event_bytes)")


def parse_event(raw: Union[bytes, str], max_bytes: int = DEFAULT_MAX_EVENT_BYTES):
    """Decode and validate one message value. Returns an event model or a Rejection; never raises.

    A value over `max_bytes` bytes is `too_large` without being parsed."""
    cls = raw.__class__
    if cls is not bytes:
        if cls is str:
            raw = raw.encode("utf-8", "surrogatepass")  # type: ignore[union-attr]  (orjson rejects the surrogates)
        elif cls is not bytearray and cls is not memoryview:
            return Rejection(RejectionCode.not_json, f"not JSON: expected bytes or str, got {cls.__name__}")
    size = len(raw)
    if size > max_bytes:
        return size_rejection(size, max_bytes, hashlib.sha256(raw).hexdigest())
    try:
        obj = orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError, UnicodeDecodeError) as err:
        text = str(err)
        if text.startswith(_DEPTH_LIMIT_MSG):
            return _deep(None)
        return Rejection(RejectionCode.not_json, cap_detail(f"not JSON: {text}"))
    event = parse_payload(obj, cls is bytes and not _may_hold_controls(raw))
    if event.__class__ is Rejection:
        return event
    dup = duplicate_key(raw, obj)  # (obj is a dict: parse_payload accepted it)
    return event if dup is None else dup
