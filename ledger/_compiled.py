"""The compiled core: the fold's modules built with mypyc, used only when built from exactly these sources.

`make` (scripts/build_core.py) compiles the modules in MODULES (`ledger/{books,state,step,...,fold,policy}.py`)
into native modules under `<venv>/chipledger-core/` (or `$CHIPLEDGER_CORE_DIR`) with a manifest holding a digest of
the sources it was built from. `activate` puts that folder first on the `ledger` package's path when the manifest
matches the sources on disk and this interpreter, so `import ledger.fold` loads the native module; otherwise (not
built, built from other sources, `CHIPLEDGER_PURE_PYTHON=1`) the same modules run as plain Python. Both give
identical outputs (tests/test_compiled_core.py); the compiled one folds about 1.5x faster (docs/benchmarks.md).
This module itself is never compiled.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path

# compiled together (they call each other natively): the fold's modules by concern (ledger/step.py lists them), the
# policy, the fleet and prices
MODULES = ("books", "state", "step", "rates", "hol", "waits", "chips", "grants", "jobs", "progress", "clock",
           "invariants", "fold", "policy", "fleet", "prices", "costs")
SOURCE_DIR = Path(__file__).resolve().parent
MANIFEST = "manifest.json"


def core_dir() -> Path:
    """Where the compiled modules live: `$CHIPLEDGER_CORE_DIR`, else `<sys.prefix>/chipledger-core`."""
    return Path(os.environ.get("CHIPLEDGER_CORE_DIR") or Path(sys.prefix) / "chipledger-core")


def sources_digest(source_dir: Path = SOURCE_DIR) -> str:
    """sha256 over the compiled modules' sources, in order: a build is used only for the sources it came from."""
    h = hashlib.sha256()
    for name in MODULES:
        h.update(name.encode() + b"\0")
        h.update((source_dir / f"{name}.py").read_bytes())
    return h.hexdigest()


def build_tag() -> str:
    """The interpreter a build is for (native modules are tied to its ABI)."""
    return f"{sys.implementation.cache_tag}-{sys.platform}"


def activate(package_path: list) -> str:
    """Put the compiled modules first on `package_path` (the `ledger` package's `__path__`) when they match.

    Returns what the core runs as: "compiled", or "python (<why>)"."""
    if os.environ.get("CHIPLEDGER_PURE_PYTHON"):
        return "python (CHIPLEDGER_PURE_PYTHON is set)"
    where = core_dir()
    try:
        manifest = json.loads((where / MANIFEST).read_text())
    except FileNotFoundError:
        return f"python (no compiled core in {where}; `make` builds it)"
    except (OSError, ValueError) as exc:
        return f"python (unreadable {where / MANIFEST}: {exc})"
    if manifest.get("tag") != build_tag():
        return f"python (the compiled core in {where} is for {manifest.get('tag')}, this is {build_tag()})"
    if manifest.get("sources") != sources_digest():
        # a developer edited the core since the last build: running the old native code would be wrong
        warnings.warn(f"the compiled ledger core in {where} was built from other sources than {SOURCE_DIR}; "
                      "running the pure Python core (run `make` to rebuild it)", RuntimeWarning, stacklevel=3)
        return "python (the compiled core is out of date: run `make` to rebuild it)"
    package_path.insert(0, str(where / "ledger"))
    if str(where) not in sys.path:
        sys.path.append(str(where))  # mypyc's shared library is a top-level module beside the package folder
    return "compiled"
