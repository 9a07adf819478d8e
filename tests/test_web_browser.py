"""The portal in headless Chromium, as a team member: sign in with a token, read the home, the queue and a job page;
the numbers on the pages equal `chipledger sql` on the same lake. (tests/browser.py: skipped without Chromium.)"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from chipledger.cli import app as cli_app
from chipledger.web.app import Portal
from chipledger.web.auth import TokenCache, new_token
from chipledger.web.lake import LakeReader
from store.repo import open_store
from tests.web_support import portal_config, run_lake, served


@pytest.fixture(scope="module")
def server(demo_lake_of, tmp_path_factory):
    _, lake, url = run_lake(demo_lake_of(3, 7), tmp_path_factory.mktemp("portal-browser"))
    st = open_store(url)
    _, token = new_token(st, "alice", "vision")
    reader = LakeReader(lake)
    reader.refresh(force=True)
    portal = Portal(cfg=portal_config(), reader=reader, store=st, tokens=TokenCache(st))
    with served(portal) as base:
        yield {"base": base, "token": token, "lake": lake, "portal": portal}


def _sql(lake, query):
    res = CliRunner().invoke(cli_app, ["sql", "--lake", str(lake), "--format", "json", query])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_member_signs_in_and_reads_home_queue_job(browser, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser.driver
    d.delete_all_cookies()
    d.get(server["base"] + "/teams/vision")
    assert d.current_url.endswith("/login")
    d.find_element(By.ID, "token").send_keys(server["token"])
    d.find_element(By.ID, "signin").click()
    WebDriverWait(d, 15).until(lambda drv: not drv.current_url.endswith("/login"))
    assert d.current_url.endswith("/teams/vision")
    assert d.find_element(By.ID, "team").text == "vision"
    assert "alice" in d.find_element(By.ID, "whoami").text
    # the home's numbers equal chipledger sql's
    rows = _sql(server["lake"], "SELECT b.pool, b.nominal_chips, b.used_chips, b.borrowed_chips FROM balances b "
                                "WHERE team = 'vision' AND \"at\" = (SELECT max(\"at\") FROM balance_log l "
                                "WHERE l.pool = b.pool) ORDER BY pool")
    shown = {}
    for tr in d.find_elements(By.CSS_SELECTOR, "#balances tbody tr"):
        pool = tr.get_attribute("data-pool")
        shown[pool] = tuple(float(tr.find_element(By.CSS_SELECTOR, f"td.{c}").text.replace(",", ""))
                            for c in ("nominal", "used", "borrowed"))
    assert shown == {r["pool"]: (round(r["nominal_chips"], 1), round(r["used_chips"], 1),
                                 round(r["borrowed_chips"], 1)) for r in rows}
    # the cost block: totals per unit equal chipledger sql's (the demo has prices)
    tot = _sql(server["lake"], "SELECT unit, round(sum(cost_scaled::HUGEINT) / 3600000.0, 2) AS total "
                               "FROM cost_postings WHERE team = 'vision' AND hour >= date_trunc('month', "
                               "(SELECT to_timestamp(as_of_s) FROM calc_now)) GROUP BY unit ORDER BY unit")
    assert tot, "the demo has prices"
    shown_tot = {tr.get_attribute("data-unit"): float(tr.find_element(By.CSS_SELECTOR, "td.n").text.replace(",", ""))
                 for tr in d.find_elements(By.CSS_SELECTOR, "#costs tbody tr.total")}
    assert shown_tot == {r["unit"]: r["total"] for r in tot}
    # the queue: vision's pending jobs, in the order and with the reasons `chipledger pending` reads
    d.find_element(By.LINK_TEXT, "queue").click()
    jobs = [a.text for a in d.find_elements(By.CSS_SELECTOR, "#queue tbody td:first-child a")]
    pending = _sql(server["lake"], "SELECT job_id FROM pending WHERE team = 'vision' "
                                   "ORDER BY pool, priority DESC, waiting_since, job_id")
    assert jobs == [r["job_id"] for r in pending]
    # a job page: its timeline and numbers
    job = _sql(server["lake"], "SELECT job_id, chips, preemptions, allocated_mchip_s FROM jobs WHERE team = 'vision' "
                               "ORDER BY preemptions DESC, allocated_mchip_s DESC, job_id LIMIT 1")[0]
    d.get(server["base"] + f"/jobs/{job['job_id']}")
    assert d.find_element(By.ID, "job").text == job["job_id"]
    assert int(d.find_element(By.ID, "preemptions").text) == job["preemptions"]
    assert d.find_element(By.ID, "allocated").text == f"{job['allocated_mchip_s'] / 3600000:.2f} chip-hours"
    kinds = [td.text for td in d.find_elements(By.CSS_SELECTOR, "#timeline tbody td:nth-child(2)")]
    assert kinds[0] == "job.submitted" and "job.started" in kinds
    # another team's job is not found
    other = _sql(server["lake"], "SELECT job_id FROM jobs WHERE team = 'ads-ml' LIMIT 1")[0]["job_id"]
    d.get(server["base"] + f"/jobs/{other}")
    assert "no such job" in d.find_element(By.TAG_NAME, "h1").text
    # the burst form without Kafka says so, and the dry run answers with the core's verdict
    d.get(server["base"] + "/teams/vision/bursts")
    assert d.find_element(By.ID, "nokafka").is_displayed()
    d.find_element(By.ID, "window_start").send_keys("2026-11-04T08:00")
    d.find_element(By.ID, "window_end").send_keys("2026-11-04T12:00")
    d.find_element(By.ID, "dry-run").click()
    verdict = WebDriverWait(d, 30).until(lambda drv: drv.find_elements(By.ID, "verdict"))[0]
    assert verdict.text in ("approved", "partial", "denied")


def test_signing_out_in_the_browser_ends_the_session(browser, server):
    """Sign in, keep a copy of the session cookie, click "sign out", put the copy back: the portal refuses it (the
    page sends the browser to /login)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser.driver
    d.delete_all_cookies()
    d.get(server["base"] + "/login")
    d.find_element(By.ID, "token").send_keys(server["token"])
    d.find_element(By.ID, "signin").click()
    WebDriverWait(d, 15).until(lambda drv: not drv.current_url.endswith("/login"))
    copy = d.get_cookie("clp_session")
    assert copy and copy["httpOnly"] and copy["value"] != server["token"]
    d.find_element(By.CSS_SELECTOR, "form.who button").click()
    WebDriverWait(d, 15).until(lambda drv: drv.current_url.endswith("/login"))
    assert d.get_cookie("clp_session") is None
    d.add_cookie({k: copy[k] for k in ("name", "value", "path", "httpOnly") if k in copy})
    d.get(server["base"] + "/teams/vision")
    assert d.current_url.endswith("/login")
