"""A benchmark script of bench/ loaded as a module (bench/ is no package), for the tests that check what it
measures or generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench_module(name: str):
    """bench/`name`.py, loaded afresh as the module `bench_<name>`."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
