"""The first SLO views on the hand-computed fixture (tests/fixtures/hand.jsonl, see tests/test_cli.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from chipledger.cli import app


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    d = tmp_path_factory.mktemp("slo")
    res = CliRunner().invoke(app, ["run", "--events", "tests/fixtures/hand.jsonl", "--lake", str(d / "lake"),
                                   "--store", f"sqlite:///{d / 'x.db'}"])
    assert res.exit_code == 0, res.output
    return d / "lake"


def sql(lake, query):
    res = CliRunner().invoke(app, ["sql", "--lake", str(lake), "--format", "json", query])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_slo_capacity(lake):
    # 4 chips registered 00:00-03:30 = 4 x 12,600 s; c1 down 01:30-02:30 = 3,600 s
    rows = sql(lake, "SELECT * FROM slo_capacity")
    assert rows == [{"day": "2026-11-02", "pool": "lab/a100", "registered_mchip_s": 50_400_000,
                     "healthy_mchip_s": 46_800_000, "availability": pytest.approx(46.8 / 50.4)}]


def test_oversubscription(lake):
    rows = sql(lake, "SELECT hour, entitled_mchip_s, capacity_mchip_s, ratio FROM oversubscription ORDER BY hour")
    # a has 2 of 4 chips from 00:00; b adds 1 from 01:00
    assert [(r["entitled_mchip_s"], r["capacity_mchip_s"], r["ratio"]) for r in rows] == [
        (7_200_000, 14_400_000, 0.5), (10_800_000, 14_400_000, 0.75), (10_800_000, 14_400_000, 0.75),
        (5_400_000, 7_200_000, 0.75)]


def test_goodput(lake):
    rows = sql(lake, "SELECT level, team, job_id, allocated_mchip_s, lost_mchip_s, goodput FROM goodput "
                     "ORDER BY level, team NULLS FIRST, job_id NULLS FIRST")
    # ja1: 21.6M allocated, 7.2M lost (1.8M at the preemption, 5.4M at the failure); jb1: 5.1M, none lost
    assert rows == [
        {"level": "job", "team": "a", "job_id": "ja1", "allocated_mchip_s": 21_600_000, "lost_mchip_s": 7_200_000,
         "goodput": pytest.approx(14.4 / 21.6)},
        {"level": "job", "team": "b", "job_id": "jb1", "allocated_mchip_s": 5_100_000, "lost_mchip_s": 0,
         "goodput": 1.0},
        {"level": "pool", "team": None, "job_id": None, "allocated_mchip_s": 26_700_000, "lost_mchip_s": 7_200_000,
         "goodput": pytest.approx(19.5 / 26.7)},
        {"level": "team", "team": "a", "job_id": None, "allocated_mchip_s": 21_600_000, "lost_mchip_s": 7_200_000,
         "goodput": pytest.approx(14.4 / 21.6)},
        {"level": "team", "team": "b", "job_id": None, "allocated_mchip_s": 5_100_000, "lost_mchip_s": 0,
         "goodput": 1.0},
    ]


def test_demand_hourly(lake):
    rows = sql(lake, "SELECT team, hour, running_mchip_s, pending_mchip_s, demand_mchip_s FROM demand_hourly "
                     "ORDER BY team, hour")
    got = {(r["team"], r["hour"][11:13]): (r["running_mchip_s"], r["pending_mchip_s"], r["demand_mchip_s"])
           for r in rows}
    # a: ja1 waits 00:30-00:40 and 02:00-02:10 (3 chips), runs as in test_cli's journal; b: jb1 waits 01:00-01:15
    assert got == {
        ("a", "00"): (3_600_000, 1_800_000, 5_400_000),
        ("a", "01"): (9_000_000, 0, 9_000_000),
        ("a", "02"): (9_000_000, 1_800_000, 10_800_000),
        ("a", "03"): (0, 0, 0),
        ("b", "01"): (2_700_000, 900_000, 3_600_000),
        ("b", "02"): (2_400_000, 0, 2_400_000),
        ("b", "03"): (0, 0, 0),
    }
