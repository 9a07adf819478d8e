"""The importers by name, for the CLI and the demo. Imports are lazy: each format loads only when used."""

from __future__ import annotations

from pathlib import Path

from chipledger.adapters.importers.base import ImportReport

FORMATS = ("alibaba-openb", "helios", "sacct")

# where `chipledger demo --trace NAME` looks for a trace when no --trace-dir is given (beside the repo)
SHARED_TRACE_DIRS = {"alibaba-openb": "alibaba-gpu-v2023-openb", "helios": "helios/Venus"}


def import_trace(fmt: str, src: Path, out: Path, **options) -> ImportReport:
    if fmt == "alibaba-openb":
        from chipledger.adapters.importers.alibaba_openb import import_alibaba_openb
        return import_alibaba_openb(Path(src), Path(out), **options)
    if fmt == "helios":
        from chipledger.adapters.importers.helios import import_helios
        return import_helios(Path(src), Path(out), **options)
    if fmt == "sacct":
        from chipledger.adapters.importers.sacct import import_sacct
        return import_sacct(Path(src), Path(out), **options)
    raise ValueError(f"unknown trace format {fmt!r} (known: {', '.join(FORMATS)})")


def find_shared_trace(fmt: str) -> Path | None:
    """The copy of a public trace in ../shared/traces beside the working directory or the repository."""
    sub = SHARED_TRACE_DIRS.get(fmt)
    if sub is None:
        return None
    repo = Path(__file__).resolve().parents[3]
    for base in (Path.cwd(), repo):
        cand = base.parent / "shared" / "traces" / sub
        if cand.is_dir():
            return cand
    return None
