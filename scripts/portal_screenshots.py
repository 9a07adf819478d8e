"""The portal's screenshots in docs/screenshots/ (docs/portal.md): the seeded demo's events up to a moment when jobs
wait, folded into a lake, served by `chipledger serve`'s application, and shown by headless Chromium signed in as a
member of a team (scripts/chromium.sh installs chromium + chromium-driver).

    .venv/bin/python scripts/portal_screenshots.py [--out docs/screenshots] [--team vision] [--keep 0.5]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from typer.testing import CliRunner  # noqa: E402

import browser as browser_mod  # noqa: E402
from chipledger.cli import app  # noqa: E402


def main() -> int:
    import uvicorn
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from chipledger.web.app import Portal, build_app
    from chipledger.web.auth import new_token
    from chipledger.web.lake import LakeReader
    from store.repo import open_store
    from tests.web_support import portal_config

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    ap.add_argument("--team", default=None, help="default: the team with the most jobs pending")
    ap.add_argument("--keep", type=float, default=0.5, help="share of the demo's events folded (jobs wait then; "
                                                              "a little more is folded until some job waits)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="chipledger-portal-shots-"))
    try:
        demo = work / "demo"
        r = CliRunner().invoke(app, ["demo", "--out", str(demo)])
        assert r.exit_code == 0, r.output
        lines = (demo / "events.jsonl").read_text().splitlines()
        events = work / "events.jsonl"
        url = f"sqlite:///{work / 'store.db'}"
        keep = args.keep
        while True:
            events.write_text("\n".join(lines[:int(len(lines) * keep)]) + "\n")
            r = CliRunner().invoke(app, ["run", "--events", str(events), "--lake", str(work / "lake"), "--store", url,
                                         "--overwrite"])
            assert r.exit_code == 0, r.output
            reader = LakeReader(work / "lake")
            reader.refresh(force=True)
            waiting = reader.snapshot.rows("SELECT team, count(*) AS n FROM portal_queue GROUP BY team "
                                           "ORDER BY n DESC, team")
            if (waiting and (args.team is None or args.team in [w["team"] for w in waiting])) or keep >= 1:
                break
            keep += 0.01
        # the waiting team whose jobs were preempted most: its job page shows a preemption and lost work
        preempted = {r["team"]: r["n"] for r in reader.snapshot.rows(
            "SELECT team, sum(preemptions) AS n FROM jobs GROUP BY team")}
        team = args.team or (max(waiting, key=lambda w: (preempted.get(w["team"]) or 0, w["n"]))["team"]
                             if waiting else "vision")
        args.team = team
        st = open_store(url)
        _, token = new_token(st, "alice", args.team)
        # the job page shows the job preempted most (its team made alice's second team, by configuration)
        top = reader.snapshot.rows("SELECT job_id, team FROM jobs ORDER BY preemptions DESC, lost_mchip_s DESC, "
                                   "job_id LIMIT 1")[0]
        members = f"root=*:admin, alice={top['team']}:member"
        portal = Portal(cfg=portal_config(members=members), reader=reader, store=st,
                        accuracy={"text": "see docs/portal.md, \"How good is the estimate\""})
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        srv = uvicorn.Server(uvicorn.Config(build_app(portal), host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=srv.run, daemon=True).start()
        while not srv.started:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        args.out.mkdir(parents=True, exist_ok=True)
        b = browser_mod.Browser()
        d = b.driver

        def shot(path: str, name: str, before=None):
            d.set_window_size(1280, 900)
            d.get(base + path)
            if before:
                before()
            h = d.execute_script("return Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)")
            d.set_window_size(1280, min(4000, h + 40))
            d.get_screenshot_as_file(str(args.out / name))
            print(f"wrote {args.out / name}")

        try:
            d.get(base + "/login")
            d.find_element(By.ID, "token").send_keys(token)
            d.find_element(By.ID, "signin").click()
            WebDriverWait(d, 15).until(lambda drv: not drv.current_url.endswith("/login"))
            shot(f"/teams/{args.team}", "portal-home.png")
            shot(f"/teams/{args.team}/queue", "portal-queue.png")
            shot(f"/jobs/{top['job_id']}", "portal-job.png")
            t = reader.snapshot.rows("SELECT books_closed_at FROM portal_pools ORDER BY pool LIMIT 1")[0][
                "books_closed_at"]

            def dry():
                d.find_element(By.ID, "chips").clear()
                d.find_element(By.ID, "chips").send_keys("16")
                d.find_element(By.ID, "window_start").send_keys(f"{t:%Y-%m-%d}T{(t.hour + 2) % 24:02d}:00")
                d.find_element(By.ID, "window_end").send_keys(f"{t:%Y-%m-%d}T{(t.hour + 8) % 24:02d}:00")
                d.find_element(By.ID, "reason").send_keys("eval sweep before the release")
                d.find_element(By.ID, "dry-run").click()

            shot(f"/teams/{args.team}/bursts", "portal-burst.png", dry)
            shot("/fleet", "portal-fleet.png")
        finally:
            b.close()
            srv.should_exit = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
