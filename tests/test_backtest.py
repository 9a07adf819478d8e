"""`chipledger backtest` (chipledger/sim/backtest.py over chipledger/sim/simcluster.py): a hand-computed replay with exact
waits, determinism, bad input, HTML escaping, and the command on the real Alibaba openb trace (skipped
without ../shared)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chipledger.cli import app

runner = CliRunner()
T0 = 1_793_606_400  # 2026-11-02T08:00:00Z
OPENB = Path(__file__).resolve().parents[2] / "shared" / "traces" / "alibaba-gpu-v2023-openb"


def iso(off: int) -> str:
    return datetime.fromtimestamp(T0 + off, timezone.utc).isoformat().replace("+00:00", "Z")


def log(tmp_path: Path, team_a: str = "a", extra=(), head=()) -> Path:
    """4 chips. b1 (team b, 4 chips, preemptible) ran 0-1000 s; a1 (team a, 2 chips) ran 100-150 s. `head`: rows
    after the chips' registration, `extra`: rows at the end of the log."""
    n = iter(range(1, 10_000))
    rows = [{"type": "pool.configured", "at": 0, "flavor": "h100", "chips_per_node": 4}]
    rows += [{"type": "chip.registered", "at": 0, "chip_id": f"c{i}", "node": "n0"} for i in range(4)]
    rows += list(head)
    rows += [{"type": "job.submitted", "at": 0, "job_id": "b1", "team": "b", "chips": 4, "priority": 0},
             {"type": "job.started", "at": 0, "job_id": "b1"},
             {"type": "job.submitted", "at": 100, "job_id": "a1", "team": team_a, "chips": 2, "priority": 0},
             {"type": "job.started", "at": 100, "job_id": "a1"},
             {"type": "job.finished", "at": 150, "job_id": "a1", "outcome": "succeeded"},
             {"type": "job.finished", "at": 1000, "job_id": "b1", "outcome": "succeeded"}]
    rows += list(extra)
    lines = []
    for r in rows:
        r = dict(r)
        at = r.pop("at")
        lines.append(json.dumps({"event_id": f"e{next(n)}", "occurred_at": iso(at), "pool": "p/h100",
                                 "source": "test", **r}))
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def configs(tmp_path: Path):
    alt = tmp_path / "alt.toml"
    alt.write_text("[policy]\npreemption_grace_s = 60\nmin_runtime_s = 0\n")
    base = tmp_path / "base.toml"
    base.write_text("[policy]\npreemption_grace_s = 60\nmin_runtime_s = 0\n")
    return alt, base


def backtest(*args):
    res = runner.invoke(app, ["backtest", *map(str, args), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_hand_computed_backtest_exact_waits(tmp_path):
    alt, base = configs(tmp_path)
    r = backtest("--events", log(tmp_path), "--config", alt, "--baseline", base, "--quota", "a=4")
    b, a = r["configs"]["base.toml"], r["configs"]["alt.toml + --quota a=4"]
    # baseline: no quota anywhere, nobody is reclaimed from: a1 waits for b1 to finish at 1000 s
    assert b["waits_by_team"]["a"] == {"jobs": 1, "p50_s": 900.0, "p90_s": 900.0, "p99_s": 900.0}
    assert b["waits_by_team"]["b"]["p99_s"] == 0.0
    assert b["quota_honoured"] is None and b["in_quota_jobs"] == 0 and b["preemptions"] == 0
    assert b["lost_work_chip_h"] == 0 and b["borrowed_share"] == 1.0
    # utilisation: b1 4 chips × 1000 s, a1 2 × 50 from 1000 s, over 4 chips × 1050 s
    assert b["utilisation"] == pytest.approx((4000 + 100) / (4 * 1050))
    # alt: a=4. a1 fits its quota at 100 s, no chip free: short since 100, grace 60 s; the pool's first quiet
    # minute ends at 160 s (a tick, as the worker sends): reclaim decision, acted on 10 s later: b1 preempted at
    # 170 s (4 chips × 170 s lost, no checkpoint), a1 starts at 170 (waited 70 s), finishes at 220; b1 restarts
    # at 220 and runs its 1000 s again (ends 1220)
    assert a["waits_by_team"]["a"] == {"jobs": 1, "p50_s": 70.0, "p90_s": 70.0, "p99_s": 70.0}
    assert a["waits_by_team"]["b"]["p50_s"] == 0.0
    assert a["quota"] == {"p/h100": {"a": 4.0}}
    assert a["preemptions"] == 1 and a["decisions"] == 1
    assert a["lost_work_chip_h"] == pytest.approx(4 * 170 / 3600)
    assert a["quota_honoured"] == 1.0 and a["in_quota_jobs"] == 1
    assert a["utilisation"] == pytest.approx((4 * 170 + 2 * 50 + 4 * 1000) / (4 * 1220))
    assert a["borrowed_share"] == pytest.approx((4 * 170 + 4 * 1000) / (4 * 170 + 2 * 50 + 4 * 1000))
    # observed: both started at once; fidelity gap = simulated − observed
    assert r["observed"]["waits_by_pool"]["p/h100"]["p50_s"] == 0.0
    assert r["fidelity"]["alt.toml + --quota a=4"]["p/h100"]["p99_s"] == {"simulated": 70.0, "observed": 0.0, "gap": 70.0}


def test_same_inputs_same_report(tmp_path):
    alt, base = configs(tmp_path)
    src = log(tmp_path)
    one = backtest("--events", src, "--config", alt, "--quota", "a=2", "--out", tmp_path / "o1")
    two = backtest("--events", src, "--config", alt, "--quota", "a=2", "--out", tmp_path / "o2")
    for r in (one, two):
        for c in r["configs"].values():
            c.pop("seconds")
        r.pop("written")
    assert one == two
    page1 = (tmp_path / "o1" / "backtest.html").read_text()
    assert page1 == (tmp_path / "o2" / "backtest.html").read_text()
    assert json.loads((tmp_path / "o1" / "backtest.json").read_text())["configs"]["alt.toml + --quota a=2"]["quota"] == {
        "p/h100": {"a": 2.0}}


def test_team_names_are_escaped_in_the_page_and_the_table(tmp_path):
    alt, _ = configs(tmp_path)
    evil = "<img src=x onerror=alert(1)>$\\alpha$[bold]"
    src = log(tmp_path, team_a=evil)
    res = runner.invoke(app, ["backtest", "--events", str(src), "--config", str(alt), "--out", str(tmp_path / "o"),
                              "--quota", f"{evil}=2"])
    assert res.exit_code == 0, res.output
    page = (tmp_path / "o" / "backtest.html").read_text()
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "[bold]" in res.output  # printed as text, not as markup


def test_bad_input_is_a_clear_error(tmp_path):
    alt, _ = configs(tmp_path)
    src = log(tmp_path)
    for args, msg in ((["--quota", "a=lots"], "is not a number of chips"), (["--quota", "nope"], "expected team=chips"),
                      (["--quota", "q/x:a=1"], "no pool 'q/x' in the log"), (["--days", "-1"], "--days must be")):
        res = runner.invoke(app, ["backtest", "--events", str(src), "--config", str(alt), *args])
        assert res.exit_code == 2 and msg in res.output, res.output  # a wrong option value: docs/cli.md
    res = runner.invoke(app, ["backtest", "--events", str(tmp_path / "none.jsonl"), "--config", str(alt)])
    assert res.exit_code == 1 and "cannot read" in res.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text(src.read_text() + "not json\n" + '{"type": "job.started"}\n')
    r = backtest("--events", bad, "--config", alt)
    assert r["invalid_lines"] == 2 and r["first_invalid"].startswith("line 12: not JSON")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("x\n")
    res = runner.invoke(app, ["backtest", "--events", str(garbage), "--config", str(alt)])
    assert res.exit_code == 1 and "no valid events" in res.output


def test_backtest_on_the_real_openb_trace(tmp_path):
    if not OPENB.is_dir():
        pytest.skip(f"{OPENB} not found: the real-trace backtest needs ../shared/traces beside the repository")
    from chipledger.adapters.importers.alibaba_openb import import_alibaba_openb

    events = tmp_path / "openb.jsonl"
    import_alibaba_openb(OPENB, events)
    alt = tmp_path / "alt.toml"
    alt.write_text('[backtest]\nquota = "qos/ls=300,qos/be=50"\n')
    res = runner.invoke(app, ["backtest", "--events", str(events), "--config", str(alt), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "fidelity: simulated vs observed waits per pool" in res.output
    r = json.loads((tmp_path / "o" / "backtest.json").read_text())
    assert r["jobs"] == 7064 and r["invalid_lines"] == 0 and len(r["pools"]) == 7
    assert sum(p["chips"] for p in r["pools"].values()) == 6212
    g2 = r["fidelity"]["alt.toml"]["alibaba-openb/g2"]
    assert g2["p90_s"]["observed"] > 0 and g2["p90_s"]["gap"] == g2["p90_s"]["simulated"] - g2["p90_s"]["observed"]
    for c in r["configs"].values():
        assert c["jobs"] == 7064 and 0 < c["utilisation"] < 1
    assert r["configs"]["alt.toml"]["quota"]["alibaba-openb/g2"] == {"qos/be": 50.0, "qos/ls": 300.0}
    page = (tmp_path / "o" / "backtest.html").read_text()
    assert "<svg" in page and "Fidelity" in page


def test_the_page_in_chromium_shows_hostile_names_as_text(tmp_path, browser):
    """The page opened in headless Chromium (the session's `browser` fixture, tests/browser.py): a team name
    that is markup is shown as text, and no script of it runs."""
    alt, _ = configs(tmp_path)
    evil = "<img src=x onerror=\"window.__pwned=1;document.title='pwned'\">"
    res = runner.invoke(app, ["backtest", "--events", str(log(tmp_path, team_a=evil)), "--config", str(alt),
                              "--quota", f"{evil}=4", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    driver = browser.open(tmp_path / "o" / "backtest.html")
    assert browser.alert_text() is None
    assert driver.execute_script("return window.__pwned === undefined")
    assert driver.title == "chipledger backtest"
    assert driver.execute_script("return document.querySelectorAll('img').length") == 0
    assert driver.execute_script("return document.querySelectorAll('svg').length") >= 2
    text = driver.execute_script("return document.documentElement.textContent")
    assert evil in text and "Waits per team" in text and "Fidelity" in text


def test_a_team_name_of_the_contracts_full_length_is_backtested(tmp_path):
    """The simulated grant of a team is named after it: a 256-character team (the contract's limit) made a grant
    id over the limit, and the backtest died with a traceback (review of issue 17)."""
    alt, _ = configs(tmp_path)
    team = "t" * 256
    res = runner.invoke(app, ["backtest", "--events", str(log(tmp_path, team_a=team)), "--config", str(alt),
                              "--quota", f"{team}=2", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["configs"][f"alt.toml + --quota {team}=2"]["quota"] == {"p/h100": {team: 2.0}}


def test_a_quota_for_a_team_the_log_does_not_have_is_an_error_unless_asked(tmp_path):
    """Issue 35, item 3: `--quota llm-pretrian=60` (a typo) was a new team's grant, without a word; now one
    error line naming the log's teams (exit 2), and --new-team adds it on purpose. A grant larger than its pool
    warns. The change's column is named by what changed (item 11)."""
    src = log(tmp_path)
    res = runner.invoke(app, ["backtest", "--events", str(src), "--quota", "aa=2"])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines() == [
        "error: quota 'aa=2': no team 'aa' in the log (teams: a, b); --new-team to add a team the log does not have"]
    res = runner.invoke(app, ["backtest", "--events", str(src), "--quota", "aa=2", "--new-team", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["configs"]["--quota aa=2"]["quota"] == {"p/h100": {"aa": 2.0}}
    res = runner.invoke(app, ["backtest", "--events", str(src), "--quota", "a=600"])
    assert res.exit_code == 0, res.output
    assert "warning: quota a=600 in p/h100 is more than the pool's 4 registered chips" in res.stderr
    assert "--quota a=600" in res.stdout and "alt.toml" not in res.stdout
    # without a change to try, nothing to compare
    res = runner.invoke(app, ["backtest", "--events", str(src)])
    assert res.exit_code == 2 and "give --config FILE or --quota" in res.stderr


def test_quota_honoured_at_100_percent_says_why(tmp_path):
    """Issue 35, item 11: the simulated cluster starts jobs at once, so quota honoured is 100% in both columns:
    the table says so."""
    res = runner.invoke(app, ["backtest", "--events", str(log(tmp_path)), "--quota", "a=4"])
    assert res.exit_code == 0, res.output
    assert "note: quota honoured: the simulated cluster starts a job as soon as the ledger allows it" in res.stdout


def test_backtest_prices_a_configuration(tmp_path):
    """The log's price (360 cents a chip-hour: 0.1 a chip-second) prices the simulated use. Baseline: b1 4 chips ×
    1000 s and a1 2 × 50 s = 4100 chip-s (410 cents), idle 4 × 1050 − 4100 = 100 chip-s (10 cents). No price in
    the log: no cost (unknown, not zero)."""
    alt, base = configs(tmp_path)
    price = {"type": "price.set", "at": 0, "price_id": "std", "per_chip_hour": 360, "unit": "USD-cent"}
    r = backtest("--events", log(tmp_path, head=[price]), "--config", alt, "--baseline", base)
    b = r["configs"]["base.toml"]
    assert b["cost"] == {"USD-cent": {"use": pytest.approx(410.0), "idle": pytest.approx(10.0), "peak_share": 0.0}}
    assert backtest("--events", log(tmp_path), "--config", alt)["configs"]["alt.toml"]["cost"] == {}
    # the same price at the end of the log (its event time 0 is late: the pool clock had reached 1000 s) holds
    # from 1000 s, as the fold of the log applies it; the simulated cluster runs on to 1050 s (a1 waited for b1):
    # a1 2 chips x 50 s = 10 cents of use, 2 idle chips x 50 s = 10 cents
    late = backtest("--events", log(tmp_path, extra=[price]), "--config", alt, "--baseline", base)
    assert late["configs"]["base.toml"]["cost"] == {
        "USD-cent": {"use": pytest.approx(10.0), "idle": pytest.approx(10.0), "peak_share": 0.0}}


def test_backtest_applies_the_logs_price_history_as_chipledger_run_does(tmp_path):
    """Issue 36: the backtest priced the whole run at each price id's last setting. Now the log's price.set events
    are folded in order at their instants, by the core's own price rules, so the baseline configuration's cost equals
    the cost view of `chipledger run`'s lake of the same log. 4 chips, b1 (team b) 2 chips 0-3000 s, a1 (team a) 2
    chips 100-1900 s (both start at once in the simulation too). Prices, USD-cent per chip-hour: `std` 360 from 0,
    720 set at 1000 s, 1080 set at 1200 s from 2000 s; `peak` 1440 in hour of the week 8 (T0 is Monday 08:00) set at
    2500 s (a band beats a whole-week price). Per chip-second 0.1 / 0.2 / 0.3 / 0.4 over [0, 1000, 2000, 2500,
    3000): b1 2 x (100 + 200 + 150 + 200) = 1300, a1 2 x (90 + 180) = 540: use 1840; idle 2 x 100 x 0.1 + 2 x (100
    x 0.2 + 500 x 0.3 + 500 x 0.4) = 760. The last settings alone would give 4 chips x 3000 s x 0.4 = 4800."""
    rows = [{"type": "pool.configured", "at": 0, "flavor": "h100", "chips_per_node": 4},
            *({"type": "chip.registered", "at": 0, "chip_id": f"c{i}", "node": "n0"} for i in range(4)),
            {"type": "price.set", "at": 0, "price_id": "std", "per_chip_hour": 360, "unit": "USD-cent"},
            {"type": "job.submitted", "at": 0, "job_id": "b1", "team": "b", "chips": 2, "priority": 0},
            {"type": "job.started", "at": 0, "job_id": "b1"},
            {"type": "job.submitted", "at": 100, "job_id": "a1", "team": "a", "chips": 2, "priority": 0},
            {"type": "job.started", "at": 100, "job_id": "a1"},
            {"type": "price.set", "at": 1000, "price_id": "std", "per_chip_hour": 720, "unit": "USD-cent"},
            {"type": "price.set", "at": 1200, "price_id": "std", "per_chip_hour": 1080, "unit": "USD-cent",
             "effective_from": iso(2000)},
            {"type": "job.finished", "at": 1900, "job_id": "a1", "outcome": "succeeded"},
            {"type": "price.set", "at": 2500, "price_id": "peak", "per_chip_hour": 1440, "unit": "USD-cent",
             "hours_of_week": [8]},
            {"type": "job.finished", "at": 3000, "job_id": "b1", "outcome": "succeeded"}]
    path = tmp_path / "priced.jsonl"
    path.write_text("".join(json.dumps({"event_id": f"e{i}", "occurred_at": iso(r.pop("at")), "pool": "p/h100",
                                        "source": "test", **r}) + "\n" for i, r in enumerate(rows)))
    run = runner.invoke(app, ["run", "--events", str(path), "--lake", str(tmp_path / "lake"),
                              "--store", f"sqlite:///{tmp_path / 'run.db'}"])
    assert run.exit_code == 0, run.output
    sql = runner.invoke(app, ["sql", "--lake", str(tmp_path / "lake"), "--format", "json",
                              "SELECT CASE WHEN team IS NULL THEN account ELSE 'use' END AS what, unit, "
                              "sum(cost) AS cost FROM cost WHERE account IN ('in_quota', 'borrowed', 'burst', 'idle') "
                              "GROUP BY ALL ORDER BY ALL"])
    assert sql.exit_code == 0, sql.output
    lake_cost = {(r["what"], r["unit"]): r["cost"] for r in json.loads(sql.stdout)}
    assert lake_cost == {("idle", "USD-cent"): pytest.approx(760.0), ("use", "USD-cent"): pytest.approx(1840.0)}
    alt, base = configs(tmp_path)
    b = backtest("--events", path, "--config", alt, "--baseline", base)["configs"]["base.toml"]
    assert b["waits_by_team"]["a"]["p99_s"] == 0.0 and b["preemptions"] == 0  # the simulation ran the log's runs
    assert b["cost"]["USD-cent"]["use"] == pytest.approx(lake_cost[("use", "USD-cent")])
    assert b["cost"]["USD-cent"]["idle"] == pytest.approx(lake_cost[("idle", "USD-cent")])
    # use in peak hours: the band's, b1 2 chips x 500 s of 2 x 3000 + 2 x 1800 chip-s (std raised is not a peak)
    assert b["cost"]["USD-cent"]["peak_share"] == pytest.approx(1000 / 9600)
