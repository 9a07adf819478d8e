"""Compile the ledger core with mypyc into <venv>/chipledger-core (or $CHIPLEDGER_CORE_DIR).

    .venv/bin/python scripts/build_core.py [--require]

Run by `make` after installing (and again whenever ledger/'s core modules change). The modules listed in
ledger/_compiled.py are copied to a temporary folder and compiled there, then their native modules and a
manifest (the sources' digest and the interpreter's tag) replace the previous build. `ledger` loads them only
when the manifest matches its sources (ledger/_compiled.py), so a stale or missing build means plain Python,
never wrong code.

Without a C compiler or mypy this prints why and exits 0 (the core then runs as plain Python, ~1.5x slower on
the fold); with --require (CI) it exits 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_compiled_module():
    """ledger/_compiled.py on its own: importing the `ledger` package would load the core (and warn that the
    build is stale, which is why this runs)."""
    spec = importlib.util.spec_from_file_location("_chipledger_compiled", ROOT / "ledger" / "_compiled.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_c = _load_compiled_module()
MANIFEST, MODULES, build_tag, core_dir, sources_digest = (
    _c.MANIFEST, _c.MODULES, _c.build_tag, _c.core_dir, _c.sources_digest)


def build(dest: Path) -> float:
    """Compile into `dest` (replaced). Returns the seconds it took. Raises RuntimeError with mypyc's output."""
    t0 = time.perf_counter()
    src = ROOT / "ledger"
    digest = sources_digest(src)
    with tempfile.TemporaryDirectory(prefix="chipledger-core-") as tmp:
        work = Path(tmp)
        (work / "ledger").mkdir()
        (work / "ledger" / "__init__.py").write_text("")  # the package's loader is not part of the build
        for name in MODULES:
            shutil.copy2(src / f"{name}.py", work / "ledger" / f"{name}.py")
        # schemas and the libraries are imported as they are (untyped to mypyc): only the fold is native
        cmd = [sys.executable, "-m", "mypyc", "--ignore-missing-imports", "--follow-imports=silent",
               *(f"ledger/{name}.py" for name in MODULES)]
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            errors = [ln for ln in lines if "error" in ln.lower()] or lines[-20:]
            raise RuntimeError("\n".join(errors[:40]))
        staged = Path(tempfile.mkdtemp(prefix=".core-", dir=dest.parent))  # renamed over dest: same file system
        (staged / "ledger").mkdir()
        for lib in work.glob("*__mypyc*.so"):
            shutil.copy2(lib, staged / lib.name)
        built = sorted((work / "ledger").glob("*.so"))
        if {p.name.split(".")[0] for p in built} != set(MODULES):
            raise RuntimeError(f"mypyc built {[p.name for p in built]}, expected {list(MODULES)}")
        for mod in built:
            shutil.copy2(mod, staged / "ledger" / mod.name)
        (staged / MANIFEST).write_text(json.dumps({
            "sources": digest, "tag": build_tag(), "modules": list(MODULES),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }, indent=2) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    staged.rename(dest)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--require", action="store_true", help="fail when the core cannot be compiled")
    args = ap.parse_args()
    dest = core_dir()
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        manifest = json.loads((dest / MANIFEST).read_text())
        if manifest.get("sources") == sources_digest() and manifest.get("tag") == build_tag():
            print(f"compiled ledger core in {dest} is up to date")
            (dest / MANIFEST).touch()  # newer than the sources make compares it with
            return 0
    except (OSError, ValueError):
        pass
    print(f"compiling the ledger core with mypyc into {dest} (about 30 s) ...", flush=True)
    try:
        seconds = build(dest)
    except (RuntimeError, OSError) as exc:
        print(f"WARNING: could not compile the ledger core; it runs as plain Python (slower). Why:\n{exc}",
              file=sys.stderr)
        return 1 if args.require else 0
    print(f"compiled the ledger core in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
