"""Parsing at the boundary: raw bytes (or a decoded object) to a typed event, or a Rejection.

Nothing here raises for bad input: every failure becomes a `Rejection` with the code of highest precedence.
"""

from __future__ import annotations

from typing import Any, Union

import orjson
from pydantic import ValidationError

from schemas.codes import Rejection, RejectionCode
from schemas.events import EVENT_MODELS

_MAX_DETAIL = 500


def _describe(err: ValidationError) -> str:
    parts = []
    for e in err.errors(include_url=False)[:5]:
        loc = ".".join(str(p) for p in e["loc"]) or "event"
        parts.append(f"{loc}: {e['msg']}")
    text = "; ".join(parts)
    return text if len(text) <= _MAX_DETAIL else text[: _MAX_DETAIL - 1] + "…"


def parse_payload(obj: Any):
    """Validate an already-decoded JSON value. Returns an event model or a Rejection."""
    if not isinstance(obj, dict):
        return Rejection(RejectionCode.not_json, f"expected one JSON object, got {type(obj).__name__}")
    kind = obj.get("type")
    if not isinstance(kind, str) or kind not in EVENT_MODELS:
        known = ", ".join(sorted(EVENT_MODELS))
        return Rejection(RejectionCode.unknown_type, f"type {kind!r} is not one of: {known}")
    try:
        return EVENT_MODELS[kind].model_validate(obj)
    except ValidationError as err:
        return Rejection(RejectionCode.schema_invalid, f"{kind}: {_describe(err)}")


def parse_event(raw: Union[bytes, str]):
    """Decode and validate one message value. Returns an event model or a Rejection; never raises."""
    try:
        obj = orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError, UnicodeDecodeError) as err:
        return Rejection(RejectionCode.not_json, f"not JSON: {err}"[:_MAX_DETAIL])
    return parse_payload(obj)
