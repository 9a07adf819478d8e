"""`chipledger schema export`: one JSON Schema file per event, decision and dead-letter type."""

from __future__ import annotations

import json
from pathlib import Path

from schemas.events import EVENT_MODELS
from schemas.outputs import OUTPUT_MODELS


def export_json_schemas(out: Path) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, model in sorted({**EVENT_MODELS, **OUTPUT_MODELS}.items()):
        schema = model.model_json_schema(mode="validation")
        schema["$id"] = f"urn:chipledger:schema:{name}"
        schema.setdefault("title", name)
        path = out / f"{name}.schema.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written
