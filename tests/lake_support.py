"""Tests that build a lake by hand (LakeWriter straight into the tables' folders) commit what they wrote, as the
run and the sink do: only committed files are read (analytics/commits.py)."""

from __future__ import annotations

from pathlib import Path

from analytics.commits import commit, read_manifest, unlisted_parquet
from analytics.lake import TABLES


def commit_written(lake: Path) -> int:
    """Commit every Parquet file in the lake's tables' folders that no commit names yet (every table present)."""
    m = read_manifest(lake)
    listed = {f for fs in (m or {}).get("tables", {}).values() for f in fs}
    files = {t: [f for f in fs if f not in listed] for t, fs in unlisted_parquet(lake).items()}
    return commit(lake, add={t: files.get(t, []) for t in TABLES}, by="test: files written by hand", adopt=True)
