"""Parsing at the boundary: raw bytes (or a decoded object) to a typed event, or a Rejection.

Nothing here raises for bad input: every failure becomes a `Rejection` with the code of highest precedence,
checked in this order: size (`too_large`, before any byte is parsed), JSON (`not_json`; a message nested
beyond the JSON parser's own depth limit of 1024 is `too_deep`, since the parser stops there), one object
(`not_json`), depth (`too_deep`: deeper than MAX_DEPTH), `type` (`unknown_type`), fields (`schema_invalid`).
No detail ever repeats an input value whole: a type is quoted up to 64 characters, a container by its kind.
"""

from __future__ import annotations

import hashlib
from typing import Any, Union

import orjson
from pydantic import ValidationError

from schemas.codes import MAX_DETAIL, Rejection, RejectionCode, cap_detail
from schemas.events import EVENT_MODELS, MAX_TIME, MIN_TIME

_MAX_DETAIL = MAX_DETAIL  # (kept for importers of the old name)
# The largest message value accepted, in bytes ([ledger] max_event_bytes). Well under Kafka's default 1 MiB
# record limit: a dead letter carries the raw bytes in base64 (4/3 larger) and still fits one record. A
# job.started listing 20,000 chip ids of 25 bytes fits.
DEFAULT_MAX_EVENT_BYTES = 512 * 1024
# The deepest JSON nesting accepted in a message: no event nests deeper than 2 (an object holding chip_ids).
MAX_DEPTH = 32
_KNOWN = ", ".join(sorted(EVENT_MODELS))
_DEPTH_LIMIT_MSG = "depth limit exceeded"  # orjson's message when a value nests beyond its limit (1024)


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


def parse_payload(obj: Any):
    """Validate an already-decoded JSON value. Returns an event model or a Rejection."""
    if not isinstance(obj, dict):
        return Rejection(RejectionCode.not_json, f"expected one JSON object, got {type(obj).__name__}")
    kind = obj.get("type")
    # the depth is looked at only on the way to a rejection: a valid event nests 2 deep at most, so an event
    # that validates cannot be too deep, and the common path pays nothing
    if kind.__class__ is not str or kind not in EVENT_MODELS:
        if too_deep(obj):
            return _deep(obj)
        return Rejection(RejectionCode.unknown_type, f"type {_quote(kind)} is not one of: {_KNOWN}")
    try:
        return EVENT_MODELS[kind].model_validate(obj)
    except ValidationError as err:
        if too_deep(obj):
            return _deep(obj)
        return Rejection(RejectionCode.schema_invalid, f"{kind}: {_describe(err)}")
    except RecursionError:  # not seen with pydantic-core's own guard; a value, should a validator ever recurse
        return _deep(obj)


def size_rejection(size: int, max_bytes: int, sha256: str = "") -> Rejection:
    """`too_large` for a message of `size` bytes; `sha256` (of the whole message, when known) identifies it,
    since its dead letter keeps only its first `max_bytes` bytes."""
    digest = f" (sha256 {sha256})" if sha256 else ""
    return Rejection(RejectionCode.too_large, f"message of {size:,} bytes{digest} is over the limit of "
                                              f"{max_bytes:,} bytes ([ledger] max_event_bytes)")


def parse_event(raw: Union[bytes, str], max_bytes: int = DEFAULT_MAX_EVENT_BYTES):
    """Decode and validate one message value. Returns an event model or a Rejection; never raises.

    A value over `max_bytes` bytes is `too_large` without being parsed."""
    if raw.__class__ is str:
        raw = raw.encode("utf-8", "surrogatepass")  # type: ignore[union-attr]  (orjson rejects the surrogates)
    try:
        size = len(raw)
    except TypeError:
        size = 0
    if size > max_bytes:
        return size_rejection(size, max_bytes, hashlib.sha256(raw).hexdigest())
    try:
        obj = orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError, UnicodeDecodeError) as err:
        text = str(err)
        if text.startswith(_DEPTH_LIMIT_MSG):
            return _deep(None)
        return Rejection(RejectionCode.not_json, cap_detail(f"not JSON: {text}"))
    return parse_payload(obj)
