"""The screenshots in docs/screenshots/: the report page and a team's statement of the seeded demo, as headless
Chromium shows them (Debian's chromium + chromium-driver, driven by selenium; scripts/chromium.sh installs them).

    .venv/bin/python scripts/screenshots.py [--out docs/screenshots] [--team ads-ml]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from typer.testing import CliRunner  # noqa: E402

import browser as browser_mod  # noqa: E402  (tests/browser.py: the same flags as the tests)
from chipledger.cli import app  # noqa: E402


def shoot(b, page: Path, png: Path, width: int = 1280, max_height: int = 6000) -> None:
    d = b.open(page)
    height = d.execute_script("return Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)")
    d.set_window_size(width, min(max_height, height + 40))
    d.get_screenshot_as_file(str(png))
    print(f"wrote {png} ({width}x{min(max_height, height + 40)})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    ap.add_argument("--team", default="ads-ml")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="chipledger-shots-"))
    try:
        demo = work / "demo"
        r = CliRunner().invoke(app, ["demo", "--out", str(demo)])
        if r.exit_code:
            print(r.output, file=sys.stderr)
            return 1
        r = CliRunner().invoke(app, ["report", "--lake", str(demo / "lake"), "--out", str(work / "report")])
        if r.exit_code:
            print(r.output, file=sys.stderr)
            return 1
        statement = next((demo / "statements").glob(f"*/{args.team}.html"))
        args.out.mkdir(parents=True, exist_ok=True)
        b = browser_mod.Browser()
        try:
            shoot(b, work / "report" / "report.html", args.out / "report.png")
            shoot(b, statement, args.out / "statement.png", width=1100)
        finally:
            b.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
