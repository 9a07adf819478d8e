"""The sink's small files and its commits (docs/benchmarks-history.md, "Lake commits"): N sink batches without a broker
(each one journal and one events file, as a batch of one pool's hour writes), then what a commit costs with that
manifest, connect(materialize=True) over the N x 2 committed files, `lake compact`, and connect again.

    .venv/bin/python bench/lake_commits.py 850 [--out /tmp/chipledger-bench-commits]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import analytics.commits as c  # noqa: E402
from analytics.commits import compact, open_lake  # noqa: E402
from analytics.views import connect  # noqa: E402
from store import open_store  # noqa: E402
from streams.sink import Sink  # noqa: E402
from streams.worker import rows_record  # noqa: E402

POOL = "lab/a100"
H = 1_793_577_600  # 2026-11-02T00:00:00Z
J = "chipledger.journal"


def item(i):
    h = H + i * 3600
    return {"origin": ["chipledger.jobs", 0, i], "tables": {
        "journal": [[POOL, h, "idle", None, 1000]],
        "events": [[f"e{i}", "pool.tick", POOL, "src", h, h, 0, "chipledger.jobs", 0, i, "{}"]]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("batches", type=int)
    ap.add_argument("--out", type=Path, default=Path("/tmp/chipledger-bench-commits"))
    args = ap.parse_args()
    root, N = args.out, args.batches
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    sink = Sink(root / "lake", open_store(f"sqlite:///{root / 's.db'}"), name="sink", consumer=object())
    t0 = time.perf_counter()
    for i in range(N):
        sink.handle([SimpleNamespace(topic=J, partition=0, offset=i, value=rows_record(POOL, [item(i)]))])
    print(f"{N} batches: {time.perf_counter() - t0:.1f} s, {len(open_lake(root / 'lake').all_files())} committed files")
    t = time.perf_counter()
    c.commit(root / "lake", by="probe")
    print(f"one commit with that manifest: {time.perf_counter() - t:.3f} s, manifest "
          f"{(root / 'lake' / '_lake.json').stat().st_size / 1024:.0f} KiB")
    for label in ("before compaction", "after compaction"):
        best = 9e9
        for _ in range(3):
            t = time.perf_counter()
            con = connect(root / "lake", materialize=True)
            con.execute("SELECT count(*) FROM journal_postings").fetchone()
            best = min(best, time.perf_counter() - t)
            con.close()
        print(f"{label}: connect(materialize=True) + a count {best:.2f} s "
              f"({len(open_lake(root / 'lake').all_files())} files)")
        if label == "before compaction":
            t = time.perf_counter()
            r = compact(root / "lake")
            print(f"lake compact: {time.perf_counter() - t:.1f} s, {sum(r.values())} files replaced")


if __name__ == "__main__":
    main()
