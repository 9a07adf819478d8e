"""`chipledger report`, `chipledger sql` interactive and the [slo] configuration, as a user meets them: through
the CLI on the hand-computed lake of tests/test_slo_views.py (its numbers are derived there)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from chipledger.cli import app
from chipledger.config import ConfigError, load_config
from test_slo_views import run_slo_lake

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    return run_slo_lake(tmp_path_factory.mktemp("report"))


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Tables as on a 200-column terminal (the CLI's rich console is made at import, 80 columns under pytest)."""
    from chipledger import cli

    monkeypatch.setattr(cli.console, "width", 200)


def invoke(*args, input=None, env=None):
    return CliRunner().invoke(app, list(args), input=input, env=env)


def cells(output: str) -> list[list[str]]:
    """The rows of every rich table in the output, as lists of stripped cells."""
    return [[c.strip() for c in line.strip().strip("│").split("│")] for line in output.splitlines()
            if line.lstrip().startswith("│")]


def test_report_prints_the_slo_summary(lake):
    res = invoke("report", "--lake", str(lake))
    assert res.exit_code == 0, res.output
    out = res.output
    assert "error budgets: 30 days to 2026-11-04 00:00 UTC" in out
    # error budgets: quota honoured 1 of 2 against 95%: 10x the budget
    rows = cells(out)
    assert ["quota_honoured", "95.00%", "50.000%", "1 / 2 waits", "1000.0%", "-900.0%"] in rows
    assert ["availability", "99.00%", "99.884%", "1,035,600,000 / 1,036,800,000 mchip_s", "11.6%", "88.4%"] in rows
    assert ["2026-11-02", "p/h100", "144.0", "143.7", "99.769%"] in rows
    assert ["2026-11-03", "p/h100", "144.0", "144.0", "100.000%"] in rows
    # nothing burns fast at the end, but the spent budgets are tickets, per pool and team (issue 35, item 6)
    assert ["ticket", "budget_exhausted", "quota_honoured", "p/h100", "a", "1×", "30d: 10.0×", "30d: 10.0×"] in rows
    assert ["p/h100", "a", "2", "1", "1", "0", "50.00%", "95.00%"] in rows  # quota honoured
    # latency: B1's waits 300, 1200, 1200; A1 300 and A3 1200
    assert ["p/h100", "1", "borrowing", "3", "1", "2", "1,200", "1,200", "1,200", "1,200", "33.33%"] in rows
    assert ["p/h100", "5", "in_quota", "2", "2", "0", "300", "1,200", "1,200", "1,200", "50.00%"] in rows
    assert ["p/h100", "b", "4.2", "1.8", "56.00%", "90.00%"] in rows  # goodput: 15.0M allocated, 6.6M lost
    assert ["p/h100", "17.92", "Mon 01:00, Mon 02:00", "a 55%, b 45%", "45", "6.0"] in rows


def test_report_for_a_period_and_its_charts(lake, tmp_path):
    out = tmp_path / "charts"
    res = invoke("report", "--lake", str(lake), "--pool", "p/h100", "--since", "2026-11-02T00:00:00Z",
                 "--until", "2026-11-02T03:00:00Z", "--out", str(out))
    assert res.exit_code == 0, res.output
    # at 03:00 the 6-hour page on scheduling latency fires (see test_slo_views)
    assert ["page", "page_6h", "sched_latency", "p/h100", "b", "6×", "6h: 6.7×", "30m: 10.0×"] in cells(res.output)
    assert "2026-11-03" not in res.output.split("Availability by day")[1].split("Quota honoured")[0]
    for name in ("capacity", "latency", "demand_heatmap"):
        data = (out / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    page = (out / "report.html").read_text()
    assert page.count("<svg") == 3 and "Scheduling latency percentiles" in page
    assert "<td>sched_latency</td>" in page and "<td>page_6h</td>" in page


def test_report_refuses_bad_periods(lake):
    res = invoke("report", "--lake", str(lake), "--since", "yesterday")
    assert res.exit_code == 2 and "not an ISO 8601 date" in res.output
    res = invoke("report", "--lake", str(lake), "--since", "2026-11-03", "--until", "2026-11-02")
    assert res.exit_code == 2 and "--until must be after --since" in res.output
    res = invoke("report", "--lake", str(lake / "nope"))
    assert res.exit_code == 1 and "does not exist" in res.output


def test_slo_targets_from_the_config_file_reach_the_views(lake, tmp_path):
    cfg = tmp_path / "chipledger.toml"
    cfg.write_text("[slo]\nquota_honoured = 0.5\nsched_slo_s = 1200\nwindow_days = 7\n")
    res = invoke("sql", "--lake", str(lake), "--config", str(cfg), "--format", "json",
                 "SELECT slo, target, good, total, consumed FROM error_budget WHERE pool IS NULL ORDER BY slo")
    assert res.exit_code == 0, res.output
    rows = {r["slo"]: r for r in json.loads(res.stdout)}
    # with 20 minutes every wait is within; availability keeps its default target
    assert (rows["quota_honoured"]["target"], rows["quota_honoured"]["good"], rows["quota_honoured"]["total"]) == (
        0.5, 2, 2)
    assert rows["availability"]["target"] == 0.99 and rows["sched_latency"]["consumed"] == 0.0
    # the environment overrides the file
    res = invoke("sql", "--lake", str(lake), "--config", str(cfg), "--format", "json",
                 "SELECT target FROM slo_targets WHERE slo = 'quota_honoured'",
                 env={"CHIPLEDGER_SLO_QUOTA_HONOURED": "0.75"})
    assert json.loads(res.stdout) == [{"target": 0.75}]


def test_slo_config_defaults_and_errors(tmp_path):
    cfg = load_config(None, env={})
    assert (cfg.slo.availability, cfg.slo.quota_honoured, cfg.slo.sched_latency, cfg.slo.goodput,
            cfg.slo.sched_slo_s, cfg.slo.window_days) == (0.99, 0.95, 0.9, 0.9, 600, 30)
    f = tmp_path / "c.toml"
    f.write_text("[slo]\navailability = 1.5\n")
    with pytest.raises(ConfigError, match=r"c.toml: \[slo\] availability must be a target between 0 and 1"):
        load_config(f, env={})
    f.write_text("[slo]\ngoodput = 'high'\n")
    with pytest.raises(ConfigError, match=r"\[slo\] goodput must be a float"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match="CHIPLEDGER_SLO_SCHED_SLO_S: .*sched_slo_s must be a positive"):
        load_config(None, env={"CHIPLEDGER_SLO_SCHED_SLO_S": "0"})
    res = invoke("report", "--config", str(f))
    assert res.exit_code == 2 and "goodput must be a float" in res.output


def test_lake_memory_limit_and_spill_dir_reach_duckdb(lake, tmp_path):
    """[lake] memory_limit and spill_dir are DuckDB's settings for every command that reads the lake: a report
    within them is the same report; a limit it cannot fit in is one line of error that names the settings; a value
    that is not an amount of memory is a configuration error."""
    cfg = tmp_path / "chipledger.toml"
    cfg.write_text(f'[lake]\nmemory_limit = "300MB"\nspill_dir = "{tmp_path / "spill"}"\n')
    res = invoke("sql", "--lake", str(lake), "--config", str(cfg), "--format", "json",
                 "SELECT current_setting('memory_limit') AS m, current_setting('temp_directory') AS t")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == [{"m": "286.1 MiB", "t": str(tmp_path / "spill")}]  # DuckDB shows 300 MB in MiB
    plain = invoke("report", "--lake", str(lake), "--json")
    limited = invoke("report", "--lake", str(lake), "--json", "--config", str(cfg))
    assert plain.exit_code == 0 and limited.exit_code == 0, limited.output
    assert json.loads(limited.stdout) == json.loads(plain.stdout)
    cfg.write_text('[lake]\nmemory_limit = "1MB"\n')
    res = invoke("report", "--lake", str(lake), "--config", str(cfg))
    assert res.exit_code == 1
    assert "within DuckDB's memory" in res.output and "raise [lake] memory_limit" in res.output
    assert "Traceback" not in res.output
    res = invoke("alerts", "--lake", str(lake), "--config", str(cfg))  # a monitor's error: exit 3, one line
    assert res.exit_code == 3 and "raise [lake] memory_limit" in res.output and len(res.output.splitlines()) == 1
    for args in (("pending",), ("sql", "SELECT count(*) FROM burn_alerts")):  # one line there too, no traceback
        res = invoke(*args, "--lake", str(lake), "--config", str(cfg))
        assert res.exit_code == 1 and "raise [lake] memory_limit" in res.output, res.output
        assert len(res.output.splitlines()) == 1 and "SET memory_limit" not in res.output
    (tmp_path / "a-file").write_text("")
    for bad, says in (('memory_limit = "0B"', "memory_limit must be an amount of memory from 1MB"),
                      ('memory_limit = "99999999999TB"', "memory_limit must be an amount of memory from 1MB"),
                      (f'spill_dir = "{tmp_path / "a-file"}"', "spill_dir must be a folder")):
        cfg.write_text(f"[lake]\n{bad}\n")
        res = invoke("report", "--lake", str(lake), "--config", str(cfg))
        assert res.exit_code == 2 and says in res.output, res.output
    cfg.write_text('[lake]\nmemory_limit = "lots"\n')
    res = invoke("report", "--lake", str(lake), "--config", str(cfg))
    assert res.exit_code == 2 and "[lake] memory_limit must be an amount of memory" in res.output
    res = invoke("statements", "--lake", str(lake), "--period", "2026-11", "--out", str(tmp_path / "st"),
                 "--config", str(cfg))
    assert res.exit_code == 2 and "[lake] memory_limit must be an amount of memory" in res.output


def test_sql_shell_reads_statements_until_quit(lake):
    script = ("SELECT count(*) AS n\n  FROM sched_waits;\n"
              ".format csv\n"
              "SELECT job_id, wait_s FROM sched_waits WHERE slo_result = 'late' ORDER BY waiting_since;\n"
              ".quit\n"
              "SELECT 'never run';\n")
    res = invoke("sql", "--lake", str(lake), input=script)
    assert res.exit_code == 0, res.output
    assert "│ 6 │" in res.output
    assert "job_id,wait_s\nB1,1200\nA3,1200\nB1,1200\n" in res.output
    assert "never run" not in res.output


def test_sql_shell_goes_on_after_an_error_and_runs_what_is_left_at_eof(lake):
    res = invoke("sql", "--lake", str(lake), "--format", "json",
                 input="SELECT nope FROM nowhere;\n.tables\nSELECT 40 + 2 AS answer")
    assert res.exit_code == 1  # a statement failed: a script sees it
    assert "nowhere" in res.output and "error_budget" in res.output and "fragmentation" in res.output
    assert '[{"answer": 42}]' in res.output


def test_report_and_alerts_on_a_lake_without_events(tmp_path):
    (tmp_path / "lake").mkdir()
    res = invoke("report", "--lake", str(tmp_path / "lake"))
    assert res.exit_code == 0, res.output
    assert "error budgets: 30 days to –" in res.output and "no chips registered in the period" in res.output
    res = invoke("alerts", "--lake", str(tmp_path / "lake"))  # a monitor must not read "all clear" here
    assert res.exit_code == 3 and res.stdout == "" and "the lake has no events" in res.stderr


def test_report_page_puts_the_summary_first_and_marks_what_is_missed(lake, tmp_path):
    res = invoke("report", "--lake", str(lake), "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    page = (tmp_path / "report.html").read_text()
    heads = [h.split("</h2>")[0] for h in page.split("<h2>")[1:]]
    assert heads[0].startswith("Error budgets") and heads[1] == "Burn-rate alerts firing"
    assert heads[2].startswith("Capacity by account") and heads.index("Availability by day") > 4
    # quota honoured 50% of a 95% target: attained and the negative budget left are marked
    row = page.split("<td>quota_honoured</td>")[1].split("</tr>")[0]
    assert "<td class='bad'>50.000%</td>" in row and "<td class='bad'>-900.0%</td>" in row
    assert "<td>availability</td><td>99.00%</td><td>99.884%</td>" in page  # met: not marked


def test_long_tables_fold_and_charts_read_right():
    from chipledger.reports import charts

    rows = [[str(i), "x"] for i in range(20)]
    folded = charts.html_table(["a", "b"], rows, {(3, 1): "bad"})
    assert folded.startswith("<details><summary>20 rows, 1 missed (show)</summary><table>")
    assert not charts.html_table(["a"], [["1"]]).startswith("<details>")
    fig = charts.latency_chart(["g"], [300], [1200], [70_000], threshold_s=600)
    assert fig.axes[0].get_xscale() == "symlog"  # the 600 s line is visible beside a 70,000 s bar
    m = [[None] * 24 for _ in range(7)]
    m[0][0], m[0][1] = 50.0, 60.0
    assert charts.heatmap_chart(m).axes[0].images[0].norm.vmin == 0  # not 50: the scale starts at zero
