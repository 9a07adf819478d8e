"""The lake's commits: which Parquet files are the books, and the lake's layout version.

A file is part of a table only once a commit names it. The commit is one small JSON file, `LAKE/_lake.json` (the
manifest), written beside itself and swapped in with `os.replace`, so a reader sees the lake of one commit or of the
next, never a mix: files a writer has staged, an interrupted run's files and a file dropped into a table's folder
are all invisible. The manifest says:

    {"layout": 2, "commit": 7, "committed_at": "…", "by": "run 1f2e3d4c5b6a",
     "tables": {"events": ["events/day=2026-11-02/part-….parquet", …], "journal": […], …},
     "marks": {"sink:sink": 41},               # the last batch each sink committed (streams/sink.py)
     "retired": [["journal/day=…/part-….parquet", 1796083200], …]}   # replaced files, deleted after a grace

Writers (the embedded run, the sink, `lake upgrade`, `lake compact`) stage their files under `LAKE/_staging/<name>/`
in the tables' own layout and call `publish`: the files are moved into the tables' folders (still invisible), then
one commit names them. Commits are serialized by a lock file (`LAKE/_lake.lock`, flock), so a sink and a compaction
may commit to one lake. Readers never lock: they read the manifest once (`open_lake`) and the files it names.

`open_lake` is the one check every reader makes: a lake of an earlier layout (no manifest, or an older version), a
newer one, a broken manifest, a missing table or a missing committed file is a `LakeLayoutError` whose message is
one line saying what to run.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Optional

import orjson

from analytics.lake import TABLES, LakeError

#: the layout this version writes and reads: 1 = files by folder (before commits), 2 = committed by the manifest
LAYOUT_VERSION = 2
MANIFEST = "_lake.json"
LOCK = "_lake.lock"
STAGING = "_staging"
#: a staged folder's list of its files (relative to the lake), written before they move (see `publish`)
STAGED_LIST = "_files.json"
#: replaced files (compaction, a refold, `run --overwrite`) are deleted this long after the commit that replaced
#: them, so a reader that opened the lake before it still finds the files it was given
RETIRE_GRACE_S = 600


class LakeLayoutError(LakeError):
    """The lake cannot be read as it is; the message is one line saying what to run."""


@dataclass(frozen=True)
class LakeSnapshot:
    """The lake of one commit: each table's files (absolute paths, sorted)."""

    root: Path
    commit: int
    files: Mapping[str, tuple[str, ...]]

    def table_files(self, table: str) -> Optional[list[str]]:
        """The table's committed files, or None when it has none."""
        return list(self.files.get(table, ())) or None

    def all_files(self) -> list[str]:
        return [f for t in TABLES for f in self.files.get(t, ())]


def manifest_path(lake: Path) -> Path:
    return Path(lake) / MANIFEST


def read_manifest(lake: Path) -> Optional[dict]:
    """The lake's manifest as written, or None when it has none (raises LakeLayoutError when it is broken)."""
    path = manifest_path(lake)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        m = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise LakeLayoutError(_broken(lake, f"not JSON: {exc}")) from None
    if not isinstance(m, dict) or not isinstance(m.get("layout"), int) or not isinstance(m.get("tables"), dict):
        raise LakeLayoutError(_broken(lake, "no layout version or tables"))
    return m


def _broken(lake: Path, why: str) -> str:
    return (f"lake {lake}: its manifest {MANIFEST} is broken ({why}); restore it from a backup, or write the lake "
            f"again with `chipledger run --overwrite`")


def unlisted_parquet(lake: Path) -> dict[str, list[str]]:
    """The Parquet files in the tables' folders, relative to the lake, by table (what a lake of layout 1 is)."""
    lake = Path(lake)
    out = {}
    for t in TABLES:
        base = lake / t
        if base.is_dir():
            files = sorted(p.relative_to(lake).as_posix() for p in base.rglob("*.parquet") if p.is_file())
            if files:
                out[t] = files
    return out


def lake_layout(lake: Path) -> Optional[int]:
    """The lake's layout version: LAYOUT_VERSION or another from its manifest, 1 for Parquet files without a
    manifest (written before commits), None for a lake with neither (empty or not there)."""
    m = read_manifest(lake)
    if m is not None:
        return m["layout"]
    return 1 if unlisted_parquet(lake) else None


def upgrade_hint(lake: Path) -> str:
    return f"run `chipledger lake upgrade --lake {lake}`"


def open_lake(lake: Path, tables: Iterable[str] = TABLES, check_files: bool = True) -> LakeSnapshot:
    """The one check every reader makes, and what it reads: the committed files of `tables`. Raises
    LakeLayoutError (one line saying what to run) for a lake of an earlier or later layout, a broken manifest, a
    table the manifest lacks (an earlier version did not write it) or, with `check_files`, a committed file that is
    gone. A folder with neither manifest nor Parquet files is an empty lake (every table empty)."""
    lake = Path(lake)
    if not lake.is_dir():
        raise LakeLayoutError(f"lake {lake} does not exist (run `chipledger run` or `chipledger demo` first)")
    m = read_manifest(lake)
    if m is None:
        if unlisted_parquet(lake):
            raise LakeLayoutError(f"lake {lake} was written before commits (layout 1, this version reads layout "
                                  f"{LAYOUT_VERSION}): {upgrade_hint(lake)}")
        return LakeSnapshot(lake, 0, {})
    layout = m["layout"]
    if layout > LAYOUT_VERSION:
        raise LakeLayoutError(f"lake {lake} has layout {layout}, written by a newer chipledger (this one reads "
                              f"layout {LAYOUT_VERSION}): upgrade chipledger")
    if layout < LAYOUT_VERSION:
        raise LakeLayoutError(f"lake {lake} has layout {layout} (this version reads layout {LAYOUT_VERSION}): "
                              f"{upgrade_hint(lake)}")
    files: dict[str, tuple[str, ...]] = {}
    for t in tables:
        listed = m["tables"].get(t)
        if not isinstance(listed, list):
            raise LakeLayoutError(f"lake {lake} has no `{t}` table (written by an earlier version): "
                                  f"{upgrade_hint(lake)}")
        paths = tuple(sorted(str(lake / rel) for rel in listed))
        if check_files:
            for p in paths:
                if not os.path.isfile(p):
                    raise LakeLayoutError(f"lake {lake}: committed file {p} is missing; restore it from a backup, "
                                          f"or write the lake again with `chipledger run --overwrite`")
        files[t] = paths
    return LakeSnapshot(lake, int(m.get("commit", 0)), files)


def committed_rows_exist(lake: Path) -> bool:
    """Whether the lake holds books: committed files, or Parquet files of a lake written before commits."""
    m = read_manifest(lake)
    if m is None:
        return bool(unlisted_parquet(lake))
    return any(m["tables"].get(t) for t in TABLES)


# --- writing ---------------------------------------------------------------------------------------------------

WRITER_LOCK = "_writer.lock"


class LakeBusy(LakeError):
    """Another run or upgrade is writing the lake; the message names it (one line)."""


@contextmanager
def writing(lake: Path, what: str) -> Iterator[None]:
    """Held by a writer that replaces tables (`chipledger run`, `lake upgrade`) for as long as it writes: a second
    such writer on the same lake is refused at once (LakeBusy, naming the first and its process id) instead of
    removing the first one's staged files. The lock is an flock: it goes with the process, however it ends. Sinks and
    compaction do not take it (their commits add files and are serialized by the commit lock)."""
    lake = Path(lake)
    lake.mkdir(parents=True, exist_ok=True)
    with open(lake / WRITER_LOCK, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().decode("utf-8", "replace").strip() or "another process"
            raise LakeBusy(f"lake {lake} is being written by {holder}: wait for it to end, or choose another "
                           f"--lake") from None
        try:
            f.seek(0)
            f.truncate()
            f.write(f"{what} (pid {os.getpid()})".encode())
            f.flush()
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def _locked(lake: Path) -> Iterator[None]:
    lake.mkdir(parents=True, exist_ok=True)
    with open(lake / LOCK, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:  # the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def commit(lake: Path, *, add: Optional[Mapping[str, Iterable[str]]] = None, replace: Optional[Iterable[str]] = None,
           remove: Iterable[str] = (), marks: Optional[Mapping[str, int]] = None, by: str, adopt: bool = False,
           grace_s: int = RETIRE_GRACE_S) -> int:
    """One commit: the tables in `replace` hold exactly their files of `add` (the others replaced are retired); the
    other tables of `add` gain those files; the files of `remove` (relative paths) leave their tables; `marks` are
    set. Paths are relative to the lake. Files leaving their tables are retired and deleted `grace_s` after (at a
    later commit; 0: at this one). Returns the commit's number. A lake written before commits is refused
    (LakeLayoutError) unless `adopt` (`lake upgrade`). Retired files older than RETIRE_GRACE_S are deleted."""
    lake = Path(lake)
    replace = tuple(replace or ())
    with _locked(lake):
        m = read_manifest(lake)
        adding = {f for files in (add or {}).values() for f in files}
        if m is None:
            if not adopt and any(f not in adding for fs in unlisted_parquet(lake).values() for f in fs):
                raise LakeLayoutError(f"lake {lake} was written before commits (layout 1): {upgrade_hint(lake)}")
            # a new lake has every table (empty); an adopted one the tables its adoption names
            m = {"layout": LAYOUT_VERSION, "commit": 0, "tables": {} if adopt else {t: [] for t in TABLES},
                 "marks": {}, "retired": []}
        elif m["layout"] != LAYOUT_VERSION and not adopt:
            raise LakeLayoutError(f"lake {lake} has layout {m['layout']}: {upgrade_hint(lake)}")
        now = int(time.time())
        # the tables the manifest has (a table it lacks stays missing until a commit writes it: `lake upgrade`)
        tables = {t: list(m["tables"][t]) for t in TABLES if isinstance(m["tables"].get(t), list)}
        for t in (*(replace or ()), *(add or {})):
            if t not in TABLES:
                raise LakeError(f"commit to unknown table {t!r}")
            tables.setdefault(t, [])
        retired = [r for r in m.get("retired", []) if isinstance(r, list) and len(r) == 2]
        gone: set[str] = set(remove)
        listed_now = {f for fs in tables.values() for f in fs}
        if gone - listed_now:  # a concurrent commit (another compaction) took them out first: nothing is committed
            raise LakeError(f"lake {lake} changed while this commit was made ({len(gone - listed_now)} file(s) it "
                            f"replaces are no longer committed): run it again")
        replaced = set(replace or ())
        add = {t: list(v) for t, v in (add or {}).items()}
        for t in replaced:
            keep = set(add.get(t, ()))
            gone.update(f for f in tables[t] if f not in keep)
            tables[t] = []
        for t, files in add.items():
            have = set(tables[t])
            tables[t].extend(f for f in files if f not in have)
        for t in tables:
            if gone:
                tables[t] = [f for f in tables[t] if f not in gone]
            tables[t].sort()
        retired.extend([f, now - RETIRE_GRACE_S + grace_s] for f in sorted(gone))
        due = [f for f, at in retired if now - at >= RETIRE_GRACE_S]
        retired = [[f, at] for f, at in retired if now - at < RETIRE_GRACE_S]
        number = int(m.get("commit", 0)) + 1
        new = {"layout": LAYOUT_VERSION, "commit": number, "committed_at": datetime.now(timezone.utc).isoformat(),
               "by": by, "tables": tables, "marks": {**(m.get("marks") or {}), **(marks or {})}, "retired": retired}
        _write_atomically(manifest_path(lake), orjson.dumps(new, option=orjson.OPT_INDENT_2))
        listed = {f for files in tables.values() for f in files}
        for f in due:
            if f not in listed:
                try:
                    (lake / f).unlink()
                except FileNotFoundError:
                    pass
        return number


def mark(lake: Path, name: str) -> Optional[int]:
    """A mark the commits set (the last batch a sink committed), or None."""
    m = read_manifest(lake)
    v = None if m is None else (m.get("marks") or {}).get(name)
    return v if isinstance(v, int) else None


def staging_dir(lake: Path, name: str) -> Path:
    """Where a writer stages its files (in the tables' own layout) before `publish`."""
    return Path(lake) / STAGING / name


def staged_files(stage: Path) -> list[str]:
    """The files of a staged folder, relative to it (= relative to the lake, once moved). The list is written into
    the folder the first time (STAGED_LIST), so a publish cut short after moving some of them still knows them."""
    listing = stage / STAGED_LIST
    if listing.exists():
        return orjson.loads(listing.read_bytes())
    files = sorted(p.relative_to(stage).as_posix() for p in stage.rglob("*.parquet")) if stage.exists() else []
    if stage.exists():
        _write_atomically(listing, orjson.dumps(files))
    return files


def publish(lake: Path, stage: Path, *, by: str, replace: Optional[Iterable[str]] = None,
            marks: Optional[Mapping[str, int]] = None, adopt: bool = False, remove: Iterable[str] = (),
            grace_s: int = RETIRE_GRACE_S) -> int:
    """Move a staged folder's files into the lake's tables and commit them (one manifest swap), then remove the
    folder. Safe to call again after a crash at any point: the list of the staged files is kept in the folder, files
    already moved are not moved again. A staged file whose destination is a committed file of another commit is an
    error (never overwritten). Returns the commit's number."""
    lake = Path(lake)
    files = staged_files(stage)
    m = read_manifest(lake)
    committed = {f for fs in (m or {}).get("tables", {}).values() for f in (fs or ())} - set(remove)
    by_table: dict[str, list[str]] = {t: [] for t in (replace or ())}
    for rel in files:
        table = rel.split("/", 1)[0]
        if table not in TABLES:
            raise LakeError(f"{stage}: staged file {rel} is not in a table's folder")
        src, dest = stage / rel, lake / rel
        if src.exists():
            if rel in committed:
                raise LakeError(f"{stage}: staged file {rel} would overwrite a committed file of lake {lake}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dest)
        elif not dest.exists():
            raise LakeError(f"{stage}: staged file {rel} is neither staged nor in lake {lake}")
        by_table.setdefault(table, []).append(rel)
    number = commit(lake, add=by_table, replace=replace, marks=marks, by=by, adopt=adopt, remove=remove,
                    grace_s=grace_s)
    shutil.rmtree(stage, ignore_errors=True)
    return number


def clear_uncommitted(lake: Path) -> None:
    """Remove the files a run of this lake left staged and never committed (an interrupted run)."""
    base = Path(lake) / STAGING
    if base.is_dir():
        for d in base.iterdir():
            if d.name.startswith("run-"):
                shutil.rmtree(d, ignore_errors=True)


def adopt(lake: Path, refoldable: Iterable[str] = ()) -> dict[str, int]:
    """`lake upgrade`'s adoption of a lake written before commits (layout 1): its Parquet files in the tables'
    folders become the books, in one commit. A table of `refoldable` (the fact tables `chipledger/refold.py` can
    write again) is adopted only when it has a folder, so the upgrade still sees it missing and folds it; every other
    table is adopted, empty if it has no folder. Returns {table: files adopted}. A lake of this layout: nothing."""
    lake = Path(lake)
    m = read_manifest(lake)
    if m is not None and m["layout"] == LAYOUT_VERSION:
        return {}
    refoldable = set(refoldable)
    files = unlisted_parquet(lake)
    present = [t for t in TABLES if t not in refoldable or (lake / t).is_dir()]
    commit(lake, add={t: files.get(t, []) for t in present}, replace=present, by="lake upgrade: adopted layout 1",
           adopt=True)
    return {t: len(files.get(t, [])) for t in present}


def missing_tables(lake: Path) -> list[str]:
    """The tables a committed lake's manifest lacks (an earlier version did not write them)."""
    m = read_manifest(lake)
    if m is None:
        return []
    return [t for t in TABLES if not isinstance(m["tables"].get(t), list)]


def purge_retired(lake: Path) -> int:
    """Delete the retired files whose grace is over, in a commit of its own when there are any (a lake no writer
    commits to any more keeps them otherwise). Returns how many."""
    m = read_manifest(lake)
    now = int(time.time())
    due = [r for r in (m or {}).get("retired", []) if isinstance(r, list) and len(r) == 2
           and now - r[1] >= RETIRE_GRACE_S]
    if not due:
        return 0
    commit(lake, by="retired files deleted")
    return len(due)


def compact(lake: Path, min_files: int = 2, tables: Iterable[str] = TABLES) -> dict[str, int]:
    """Rewrite each day of each table that has at least `min_files` committed files (the sink's small files, one per
    batch) as one file, in one commit: the new files join and the old ones leave their tables together (retired,
    deleted RETIRE_GRACE_S later). Rows keep their order (files by name: the sink's batches in order). Returns
    {table: files replaced}."""
    lake = Path(lake)
    purge_retired(lake)
    snap = open_lake(lake)
    with open(lake / "_compact.lock", "a+b") as lock:
        try:  # one compaction of a lake at a time (commits of other writers go on beside it)
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LakeError(f"lake {lake}: another `lake compact` is running") from None
        return _compact(lake, snap, min_files, tables)


def _compact(lake: Path, snap: LakeSnapshot, min_files: int, tables: Iterable[str]) -> dict[str, int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from analytics.lake import SCHEMAS

    groups: dict[tuple[str, str], list[str]] = {}
    for t in tables:
        for f in snap.files.get(t, ()):
            rel = Path(f).relative_to(lake).as_posix()
            groups.setdefault((t, rel.rsplit("/", 1)[0]), []).append(rel)
    due = {k: sorted(v) for k, v in groups.items() if len(v) >= min_files}
    replaced = {t: 0 for t in tables}
    if not due:
        return replaced
    name = f"compact-{snap.commit + 1:08d}"
    stage = staging_dir(lake, name)
    shutil.rmtree(stage, ignore_errors=True)
    try:
        for (t, folder), files in sorted(due.items()):
            data = pa.concat_tables([pq.read_table(lake / f, schema=SCHEMAS[t], partitioning=None) for f in files])
            out = stage / folder
            out.mkdir(parents=True, exist_ok=True)
            pq.write_table(data, out / f"part-{name}-0001.parquet", compression="zstd")
            replaced[t] += len(files)
        publish(lake, stage, by=f"compact of commit {snap.commit}",
                remove=[f for files in due.values() for f in files])
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return replaced


__all__ = ["LAYOUT_VERSION", "MANIFEST", "LakeBusy",
           "LakeLayoutError", "LakeSnapshot", "adopt", "clear_uncommitted", "commit",
           "committed_rows_exist", "compact", "lake_layout", "mark", "missing_tables", "open_lake", "publish",
           "purge_retired", "read_manifest", "staged_files", "staging_dir", "unlisted_parquet", "writing"]
