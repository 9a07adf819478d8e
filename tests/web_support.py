"""A lake for the portal's tests: the demo's first events (so the books end with jobs pending), a team with a
hostile name, expected runtimes on some jobs; a store with tokens; a Portal over them (chipledger/web/)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from chipledger.config import Config, ServeConfig

HOSTILE_TEAM = 'evil"><script>alert(1)</script>'
PATH_TEAM = "org/ml"  # team names may be paths
EVENTS_KEPT = 4000


def make_events(demo_events: Path, out: Path) -> Path:
    lines = demo_events.read_text().splitlines()[:EVENTS_KEPT]
    last = json.loads(lines[-1])
    pool = "us-west4-a/tpu-v5e"
    extra = [
        {"event_id": "hostile-grant", "type": "quota.granted", "occurred_at": last["occurred_at"], "pool": pool,
         "source": "fleet-admin/quota-api", "grant_id": "hostile-grant", "team": HOSTILE_TEAM, "chips": 1,
         "effective_from": last["occurred_at"]},
        {"event_id": "hostile-job", "type": "job.submitted", "occurred_at": last["occurred_at"], "pool": pool,
         "source": "cluster-c/kueue", "job_id": "job-<b>hostile</b>", "team": HOSTILE_TEAM, "chips": 1000,
         "expected_runtime_s": 3600},
        {"event_id": "path-grant", "type": "quota.granted", "occurred_at": last["occurred_at"], "pool": pool,
         "source": "fleet-admin/quota-api", "grant_id": "path-grant", "team": PATH_TEAM, "chips": 1,
         "effective_from": last["occurred_at"]},
        {"event_id": "path-job", "type": "job.submitted", "occurred_at": last["occurred_at"], "pool": pool,
         "source": "cluster-c/kueue", "job_id": "job-org-ml-1", "team": PATH_TEAM, "chips": 1000},
    ]
    out.write_text("\n".join(lines + [json.dumps(e) for e in extra]) + "\n")
    return out


def run_lake(demo_lake: Path, root: Path) -> tuple[Path, Path, str]:
    """`chipledger run` of make_events' events (beside `demo_lake`) into `root`/lake with a SQLite store in `root`:
    (events file, lake, store URL)."""
    from typer.testing import CliRunner

    from chipledger.cli import app as cli_app

    events = make_events(demo_lake.parent / "events.jsonl", root / "events.jsonl")
    lake = root / "lake"
    store_url = f"sqlite:///{root / 'store.db'}"
    res = CliRunner().invoke(cli_app, ["run", "--events", str(events), "--lake", str(lake), "--store", store_url])
    assert res.exit_code == 0, res.output
    return events, lake, store_url


def portal_config(**serve) -> Config:
    # every request is counted (the limiter runs) but the tests' hundreds of requests a minute are not refused: the
    # limit itself is tested with its own portals
    base = {"members": "root=*:admin, group:oncall=*:sre, carol=vision:admin", "trusted_proxies": "testclient",
            "requests_per_minute": 1_000_000}
    base.update(serve)
    return dataclasses.replace(Config(), serve=ServeConfig(**base))
