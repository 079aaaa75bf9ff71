"""Merge a run's many small part files into a few large, sorted ones (``megascope compact``).

Role in the data flow: a maintenance pass over a run directory, beside the writers. A job writes
one part per rank per flush interval; at 12,288 ranks that is ~100k files after a few minutes, and
every reader pays per file. Compaction merges each table's parts into files of up to
:data:`FILE_ROWS` rows under ``compacted/<table>/``, sorted for the questions asked of each table
(markers and metrics by step, then rank; spans by step, then kind, then rank), with row groups cut
at step boundaries (spans: also wherever the kind changes) so that a step range, a rank range or
one kind of span reads only its row groups. Depends on pyarrow and the standard library
only: the bundled trainer's launcher runs it at the end of a job without the analysis extra.

One pass, and why a reader never sees half of it (docs/run-directory.md, "Compaction"):

1. take ``compacted/.lock`` (one compaction per run at a time; the lock dies with its process);
2. finish what an interrupted pass left: remove compacted files no manifest commits (a pass
   killed while writing), then the files that committed manifests replace;
3. per table, merge the parts older than ``min_age_s`` (never a rank's ``keep_newest`` newest:
   the job may still be writing beside them, and run state reads them) into new files, each
   written under a temporary name, flushed and renamed;
4. commit: a manifest (``c-<id>.manifest.json``, written atomically) names the new files and every
   file they replace. The store reads a committed manifest's files and skips the parts it names;
   it ignores compacted files no manifest commits. Before the commit the old parts are the data,
   after it the new files are: there is no moment where a row counts twice or not at all;
5. remove the replaced parts (after ``grace_s``: a reader that opened the run before the commit
   reads through its old file list until it refreshes).

Each compacted spans file gets its per-(rank, step, group) sums (``compacted/step_sums/``, the
same name; :func:`megascope.layout.write_sums_twin`), rebuilt from its rows and written before the
commit; the merged parts' sums are replaced with them. A compacted spans file without sums (one
compacted by an older version) is aggregated by the analysis.

A scoped pass (``scope=Scope(ranks=(8, 15), host="node1")``, ``megascope compact --ranks``) does
the same for those ranks' and that host's partitions only, so each node of a big job can compact
its own: see :class:`Scope`.

A SIGKILL at any point leaves either the old parts (and an uncommitted file that the next pass
removes) or a committed manifest (and replaced parts that the next pass removes); both read the
same rows.

Example::

    from megascope.compact import compact
    result = compact("runs/demo", everything=True)   # the job has ended: merge every part
    result.parts_merged, result.files_written
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from megascope import layout
from megascope.errors import RunDirError
from megascope.schema import RANKS_V1_COORD_COLUMNS, TABLES

log = logging.getLogger(__name__)

# A part younger than this may belong to a flush still being renamed into place next to it, and
# run state reads the newest ones: a few of the collector's 1 s flush intervals, with margin.
DEFAULT_MIN_AGE_S = 60.0
# Newest parts left per rank (or host) directory while a job may still write: run state reads a
# rank's two newest marker parts for its last progress.
DEFAULT_KEEP_NEWEST = 2
# Replaced parts of a live run stay this long after the commit: a reader that opened the run
# before it reads them until its next refresh (the dashboard refreshes every few seconds).
DEFAULT_GRACE_S = 60.0
# Rows per compacted file (memory: one file's rows are sorted in memory, ~100 bytes a span row).
FILE_ROWS = 4_000_000
# Rows per row group at most; row groups hold whole steps where a step fits.
ROW_GROUP_ROWS = 131_072
# A committed compacted file smaller than this is merged again by the next pass, so that a live
# run compacted every minute keeps a few files, not one per pass.
REMERGE_ROWS = FILE_ROWS // 4

# Sort order per table: what each is asked by. The second item cuts row groups (None: by size).
SORT_KEYS: dict[str, tuple[list[str], str | None]] = {
    # kind after step: the analysis reads one kind of span at a time (the collectives for their
    # instances), and a row group of one kind lets every other row group be skipped by its statistics
    "spans": (["step", "kind", "rank", "start_ns"], "step"),
    "markers": (["step", "rank", "time_ns"], "step"),
    "metrics": (["step", "rank", "name"], "step"),
    "heartbeats": (["time_ns", "host"], None),
    "diagnostics": (["time_ns", "host"], None),
    "ranks": (["rank"], None),
    "groups": (["rank", "group"], None),
}

_TMP_SUFFIX = ".tmp"


@dataclass
class TableResult:
    table: str
    parts_merged: int = 0
    rows: int = 0
    files_written: int = 0
    skipped: list[str] = field(default_factory=list)  # parts left as they are, and why


@dataclass
class CompactResult:
    run_dir: Path
    tables: dict[str, TableResult] = field(default_factory=dict)
    removed: int = 0  # files removed (replaced parts, leftovers of interrupted passes)
    seconds: float = 0.0

    @property
    def parts_merged(self) -> int:
        return sum(t.parts_merged for t in self.tables.values())

    @property
    def files_written(self) -> int:
        return sum(t.files_written for t in self.tables.values())

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables.values())


@dataclass(frozen=True)
class Scope:
    """The partitions one pass may touch: a rank range (inclusive) and/or one host's directory.

    What scoped passes are for: on a job of thousands of ranks, each host compacts its own ranks'
    parts (a sidecar per node: ``megascope compact RUN --ranks 8-15 --host node1 --every 60``), so
    the work grows with the host's ranks, not the job's. Passes of disjoint scopes run at once;
    an unscoped pass waits for none and runs alone. Single-file tables (``ranks``, ``groups``) and
    ``diagnostics`` belong to no scope: the job's last, unscoped pass merges them.
    """

    ranks: tuple[int, int] | None = None
    host: str | None = None

    def __post_init__(self) -> None:
        if self.ranks is None and self.host is None:
            raise RunDirError("compaction scope: give a rank range, a host, or both")
        if self.ranks is not None:
            lo, hi = self.ranks
            if not 0 <= lo <= hi <= 99_999:
                raise RunDirError(f"compaction scope: ranks {lo}-{hi} are not a range of ranks (0-99999, low-high)")
        if self.host is not None and not self.host.strip():
            raise RunDirError("compaction scope: the host name is empty")

    def tag(self, table: str) -> str | None:
        """The scope's name in ``table``'s compacted file names; None: ``table`` is not in the scope."""
        if table in layout.RANK_PARTITIONED and self.ranks is not None:
            return f"r{self.ranks[0]:05d}_{self.ranks[1]:05d}"
        if table in layout.HOST_PARTITIONED and self.host is not None:
            return "h" + layout.host_dir_name(self.host).split("=", 1)[1]
        return None

    def partitions(self, table: str) -> list[str]:
        """The partition directories of ``table`` in the scope (``rank=00008``, ``host=node1``)."""
        if self.tag(table) is None:
            return []
        if table in layout.RANK_PARTITIONED:
            assert self.ranks is not None
            return [layout.rank_dir_name(r) for r in range(self.ranks[0], self.ranks[1] + 1)]
        assert self.host is not None
        return [layout.host_dir_name(self.host)]

    def touches(self, table: str, name: str) -> bool:
        """Whether the manifest named ``name`` may cover partitions of this scope: an unscoped
        pass's, an overlapping rank range's, or this host's."""
        other = layout.compacted_scope(name)
        if other is None:
            return True
        mine = self.tag(table)
        if mine is None or other[0] != mine[0]:
            return False
        if other[0] == "h":
            return other == mine
        try:
            lo, hi = (int(x) for x in other[1:].split("_"))
        except ValueError:
            return True  # not a range this version writes: read it rather than risk merging twice
        assert self.ranks is not None
        return lo <= self.ranks[1] and self.ranks[0] <= hi

    def __str__(self) -> str:
        parts = []
        if self.ranks is not None:
            parts.append(f"ranks {self.ranks[0]}-{self.ranks[1]}")
        if self.host is not None:
            parts.append(f"host {self.host}")
        return " and ".join(parts)


# Test hook: called with a stage name ("written", "committed", "removing") inside a pass, so a
# test can stop a pass where a SIGKILL could.
_Hook = Callable[[str], None]


def compact(
    run_dir: Path | str,
    *,
    min_age_s: float = DEFAULT_MIN_AGE_S,
    keep_newest: int = DEFAULT_KEEP_NEWEST,
    everything: bool = False,
    grace_s: float = 0.0,
    tables: tuple[str, ...] | None = None,
    threads: int | None = None,
    scope: Scope | None = None,
    _hook: _Hook | None = None,
) -> CompactResult:
    """One compaction pass over ``run_dir`` (see the module docstring).

    ``everything``: the job has ended; merge every part whatever its age, each rank's newest and
    the single-file tables (``ranks``, ``groups``) too. ``grace_s``: replaced files are removed
    once their manifest is this old (0: right after the commit). ``scope``: touch only these
    ranks' and this host's partitions (:class:`Scope`); the tables outside every scope are left.
    """
    run_dir = Path(run_dir)
    t0 = time.perf_counter()
    run_id = _run_id(run_dir)
    if min_age_s < 0 or keep_newest < 0 or grace_s < 0:
        raise RunDirError("compaction: --min-age, --keep-newest and --grace must be >= 0")
    result = CompactResult(run_dir=run_dir)
    chosen = tables or tuple(TABLES)
    for table in chosen:
        if table not in TABLES:
            raise RunDirError(f"compaction: unknown table {table!r} (one of {', '.join(TABLES)})")
    if scope is not None:
        chosen = tuple(t for t in chosen if scope.tag(t) is not None)
    hook = _hook or (lambda stage: None)
    with _locked(run_dir, scope, chosen):
        now_ns = time.time_ns()
        for table in chosen:
            result.removed += _clean(run_dir, table, now_ns=now_ns, grace_s=grace_s, scope=scope)
        for table in chosen:
            res = _compact_table(run_dir, table, run_id, now_ns=now_ns, min_age_s=min_age_s,
                                 keep_newest=keep_newest, everything=everything, threads=threads, hook=hook,
                                 scope=scope)
            result.tables[table] = res
            if res.files_written:
                hook("committed")
                result.removed += _clean(run_dir, table, now_ns=time.time_ns(), grace_s=grace_s, hook=hook,
                                         scope=scope)
        if everything and scope is None:
            _remove_empty_partitions(run_dir, chosen)
    result.seconds = time.perf_counter() - t0
    return result


def _remove_empty_partitions(run_dir: Path, tables: tuple[str, ...]) -> None:
    """Remove the partition directories left empty (``spans/rank=00017/``), which every reader would
    list again. Only once the job has ended (``everything``): a live writer creates its directory
    before it writes into it, and could lose a part to a directory removed in between."""
    dirs = [t for t in tables if t not in layout.SINGLE_FILE_TABLES and t not in layout.UNPARTITIONED]
    if "spans" in tables:
        dirs.append(layout.STEP_SUMS_DIR)  # the spans parts' sums go with them
    for table in dirs:
        try:
            entries = list(os.scandir(run_dir / table))
        except OSError:
            continue
        for entry in entries:
            if "=" in entry.name and entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):  # not empty: a part left (skipped, or newer)
                    os.rmdir(entry.path)


def _run_id(run_dir: Path) -> str:
    if not run_dir.exists():
        raise RunDirError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: not a directory")
    meta = run_dir / layout.RUN_JSON
    if not meta.exists():
        raise RunDirError(f"{run_dir}: not a megascope run directory (no {layout.RUN_JSON})")
    try:
        data = layout.read_run_json(run_dir)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise RunDirError(f"{meta}: unreadable ({exc})") from None
    run_id = data.get("run_id") if isinstance(data, dict) else None
    if not isinstance(run_id, str):
        raise RunDirError(f"{meta}: invalid run metadata (run_id is {run_id!r})")
    return run_id


class CompactionBusy(RunDirError):
    """Another pass holds the run, or a partition of this pass's scope."""


# Per-partition locks of scoped passes (``compacted/.locks/rank=00017``).
_LOCKS_DIR = ".locks"


@contextlib.contextmanager
def _locked(run_dir: Path, scope: Scope | None = None, tables: tuple[str, ...] = ()) -> Iterator[None]:
    """Hold the run's compaction lock for the pass: alone (unscoped), or shared with passes of
    other scopes, each partition of the scope held alone. Every lock dies with its process."""
    base = run_dir / layout.COMPACTED_DIR
    fds: list[IO[bytes]] = []

    def take(path: Path, how: int, busy: str) -> None:
        try:
            fd: IO[bytes] = open(path, "ab")  # noqa: SIM115 - held for the whole pass
        except OSError as exc:
            raise RunDirError(f"{exc.filename or path}: cannot write ({exc.strerror or exc}); "
                              "compaction needs write access to the run directory") from None
        fds.append(fd)
        try:
            fcntl.flock(fd.fileno(), how | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CompactionBusy(busy) from None
            raise

    try:
        try:
            base.mkdir(exist_ok=True)
        except OSError as exc:
            raise RunDirError(f"{exc.filename or base}: cannot write ({exc.strerror or exc}); "
                              "compaction needs write access to the run directory") from None
        if scope is None:
            take(base / ".lock", fcntl.LOCK_EX, f"{run_dir}: another compaction of this run is running")
        else:
            take(base / ".lock", fcntl.LOCK_SH, f"{run_dir}: a compaction of the whole run is running")
            locks = base / _LOCKS_DIR
            try:
                locks.mkdir(exist_ok=True)
            except OSError as exc:
                raise RunDirError(f"{locks}: cannot write ({exc.strerror or exc}); "
                                  "compaction needs write access to the run directory") from None
            names = sorted({name for t in tables for name in scope.partitions(t)})
            for name in names:
                take(locks / name, fcntl.LOCK_EX, f"{run_dir}: {name} is being compacted by another pass")
        yield
    finally:
        for fd in fds:
            fd.close()


# ------------------------------------------------------------------------------------ cleaning


def _clean(run_dir: Path, table: str, *, now_ns: int, grace_s: float, hook: _Hook | None = None,
           scope: Scope | None = None) -> int:
    """Remove what committed manifests replace (once ``grace_s`` old) and compacted files no
    manifest commits (a pass killed before its commit). Returns the number of files removed.

    A scoped pass cleans after its own scope's passes only: other scopes' passes may be writing
    beside it, and what an unscoped pass left is the next unscoped pass's to clean."""
    base = layout.compacted_dir(run_dir, table)
    if not base.is_dir():
        return 0
    manifests, _problems = layout.read_manifests(run_dir, table, _manifest_filter(scope, table))
    ours = _ours(scope, table)
    named = {f.path for m in manifests for f in m.files}
    removed = 0
    for entry in os.scandir(base):
        if not ours(entry.name):
            continue
        rel = f"{layout.COMPACTED_DIR}/{table}/{entry.name}"
        stale_tmp = entry.name.startswith(".") and entry.name.endswith(_TMP_SUFFIX)
        if stale_tmp or (entry.name.endswith(".parquet") and rel not in named):
            # We hold the lock (of these partitions): no other pass is writing these.
            removed += _unlink(Path(entry.path))
    if table == "spans":
        removed += _clean_sums(run_dir, named, ours)
    due = [m for m in layout.active_manifests(manifests)
           if now_ns - m.committed_ns >= grace_s * 1e9 and ours(m.path.name)]
    if not due:
        return removed
    if hook:
        hook("removing")
    # Parts first, replaced compacted files next, their manifests last: a manifest outlives the
    # files it commits, and a replaced one stays replaced (named by the active one) until removed.
    ordered = sorted({rel for m in due for rel in m.replaces},
                     key=lambda rel: (rel.startswith(layout.COMPACTED_DIR + "/"), rel.endswith(layout.MANIFEST_SUFFIX)))
    stamps = {k: v for m in due for k, v in m.stamps.items()}
    dirs: dict[Path, tuple[int, int] | None] = {}
    for rel in ordered:
        path = run_dir / rel
        if rel in stamps and not _same_stamp(path, stamps[rel]):
            continue  # rewritten by its writer since it was merged: the new version stays
        parent = path.parent
        if parent not in dirs:
            dirs[parent] = _dir_times(parent)
        removed += _unlink(path)
    _restore_dir_times(dirs)
    # What is gone need not be named any more: a manifest that lists 100k removed parts costs
    # every reader time to parse. Rewritten atomically; what still exists stays listed.
    for m in due:
        left = tuple(rel for rel in m.replaces if (run_dir / rel).exists())
        if left != m.replaces:
            layout.write_manifest(dataclasses.replace(m, replaces=left,
                                                      stamps={k: v for k, v in m.stamps.items() if k in left}))
    return removed


def _ours(scope: Scope | None, table: str) -> Callable[[str], bool]:
    """Whether a compacted file or manifest name is this pass's to merge again and clean after:
    every one for an unscoped pass, its own scope's for a scoped one."""
    tag = scope.tag(table) if scope is not None else None
    return lambda name: tag is None or layout.compacted_scope(name) == tag


def _manifest_filter(scope: Scope | None, table: str) -> Callable[[str], bool] | None:
    """Which manifests a pass reads: all (unscoped), or those that may touch the scope."""
    if scope is None:
        return None
    return functools.partial(scope.touches, table)


def _clean_sums(run_dir: Path, named: set[str], ours: Callable[[str], bool]) -> int:
    """Remove the compacted spans files' sums whose spans file no manifest names (a pass killed
    before its commit, or the file removed since) and temporary files of killed writes."""
    base = run_dir / layout.COMPACTED_DIR / layout.STEP_SUMS_DIR
    if not base.is_dir():
        return 0
    removed = 0
    for entry in os.scandir(base):
        if not ours(entry.name):
            continue
        spans_rel = f"{layout.COMPACTED_DIR}/spans/{entry.name}"
        if entry.name.endswith(_TMP_SUFFIX) or (entry.name.endswith(".parquet") and spans_rel not in named):
            removed += _unlink(Path(entry.path))
    return removed


def _unlink(path: Path) -> int:
    try:
        path.unlink()
        return 1
    except FileNotFoundError:
        return 0


def _same_stamp(path: Path, stamp: tuple[int, int]) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    return (st.st_size, st.st_mtime_ns) == stamp


def _dir_times(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_atime_ns, st.st_mtime_ns


def _restore_dir_times(dirs: dict[Path, tuple[int, int] | None]) -> None:
    """Give each directory back the modification time of its newest write.

    Removing a merged part moves its directory's mtime, which run state and the dashboard's
    watcher read as "the job wrote something" (one stat per rank directory, no listing). The
    directory keeps the later of its old mtime and its newest remaining file's; the dashboard
    notices a compaction by ``compacted/<table>/`` instead.
    """
    for path, times in dirs.items():
        if times is None:
            continue
        atime, mtime = times
        try:
            newest = max((e.stat().st_mtime_ns for e in os.scandir(path)), default=mtime)
            os.utime(path, ns=(atime, max(mtime, newest)))
        except OSError:
            continue


# ------------------------------------------------------------------------------------ merging


@dataclass
class _Input:
    path: Path
    rel: str
    rows: int
    stamp: tuple[int, int] | None = None  # single-file tables: (size, mtime_ns) when read
    manifest: layout.Manifest | None = None  # a compacted file merged again


def _eligible_parts(run_dir: Path, table: str, ignored: set[str], *, now_ns: int, min_age_s: float,
                    keep_newest: int, everything: bool, scope: Scope | None = None) -> list[Path]:
    if table in layout.SINGLE_FILE_TABLES and not everything:
        return []  # rewritten in place by a live writer: merged only once the job has ended
    if scope is None:
        files = sorted(run_dir.glob(layout.table_glob(table)))
    else:  # the scope's partition directories alone, never a listing of the whole table
        files = []
        for name in scope.partitions(table):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                files += [Path(e.path) for e in os.scandir(run_dir / table / name)
                          if e.name.endswith(".parquet") and not e.name.startswith(".")]
        files.sort()
    files = [f for f in files if f.relative_to(run_dir).as_posix() not in ignored]
    if everything:
        return files
    by_dir: dict[Path, list[Path]] = {}
    for f in files:
        by_dir.setdefault(f.parent, []).append(f)
    limit_ns = now_ns - int(min_age_s * 1e9)
    chosen = []
    for parts in by_dir.values():
        # Part names start with their write time: the name order is the write order.
        parts.sort(key=lambda p: p.name)
        older = parts[: max(0, len(parts) - keep_newest)]
        for p in older:
            try:
                if p.stat().st_mtime_ns <= limit_ns:
                    chosen.append(p)
            except FileNotFoundError:
                continue
    return sorted(chosen)


def _load(item: _Input, table: str, run_id: str) -> tuple[pa.Table | None, str | None]:
    """A part's rows in the table's schema, or why it must stay out of the merge.

    What the store would skip (unreadable, missing columns, another run's) stays where it is,
    skipped and named by the store as before. One open per file: footer, then the rows."""
    try:
        if table in layout.SINGLE_FILE_TABLES:
            st = item.path.stat()
            item.stamp = (st.st_size, st.st_mtime_ns)
        pf = pq.ParquetFile(item.path)
        names = set(pf.schema_arrow.names)
        required = {f.name for f in TABLES[table] if not f.nullable}
        if not required <= names:
            return None, f"{item.path}: not a megascope {table} part; left as it is"
        stamped = layout.run_id_in(pf.metadata.metadata)
        if stamped is not None and stamped != run_id:
            return None, f"{item.path}: a part of another run; left as it is"
        data = pf.read()
    except (OSError, pa.ArrowException) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, f"{item.path}: not a readable Parquet file ({reason}); left as it is"
    columns = []
    for f in TABLES[table]:
        if f.name in data.column_names:
            columns.append(data.column(f.name).cast(f.type))
        elif table == "ranks" and f.name == "coords":
            columns.append(_v1_coords(data, f.type))
        else:
            columns.append(pa.nulls(data.num_rows, f.type))
    return pa.Table.from_arrays(columns, schema=TABLES[table]), None


def _v1_coords(data: pa.Table, map_type: pa.DataType) -> pa.Array:
    """``ranks.coords`` from a schema 1 part's ``pp``, ``dp``, ``tp`` columns (as the store reads them)."""
    legacy = [c for c in RANKS_V1_COORD_COLUMNS if c in data.column_names]
    if not legacy:
        return pa.nulls(data.num_rows, map_type)
    values = [data.column(c).to_pylist() for c in legacy]
    rows = [[(c, v) for c, v in zip(legacy, row, strict=True) if v is not None] for row in zip(*values, strict=True)]
    return pa.array(rows, type=map_type)


def _footer_ok(path: Path) -> bool:
    try:
        pq.read_metadata(path)
        return True
    except (OSError, pa.ArrowException):
        return False


# Files read ahead of the merge, in parallel (memory: their rows, at most a file's worth more).
_READ_AHEAD = 256


def _compact_table(run_dir: Path, table: str, run_id: str, *, now_ns: int, min_age_s: float, keep_newest: int,
                   everything: bool, threads: int | None, hook: _Hook, scope: Scope | None = None) -> TableResult:
    res = TableResult(table)
    tag = scope.tag(table) if scope is not None else None
    ours = _ours(scope, table)
    manifests, _problems = layout.read_manifests(run_dir, table, _manifest_filter(scope, table))
    active = [m for m in layout.active_manifests(manifests) if m.run_id in (None, run_id)]
    ignored = {rel for m in active for rel in m.replaces} if table not in layout.SINGLE_FILE_TABLES else set()
    parts = _eligible_parts(run_dir, table, ignored, now_ns=now_ns, min_age_s=min_age_s,
                            keep_newest=keep_newest, everything=everything, scope=scope)
    if not parts:
        return res
    inputs = [_Input(p, p.relative_to(run_dir).as_posix(), 0) for p in parts]
    # Small compacted files of earlier passes go in again, whole manifests at a time: a scoped
    # pass merges its own scope's only (it holds no lock on the partitions of the others).
    single = table in layout.SINGLE_FILE_TABLES
    for m in active:
        if not ours(m.path.name):
            continue
        # Single-file tables (one row per rank or group) are always merged whole again, so that a
        # rank's file rewritten since the last pass replaces its merged rows instead of adding to them.
        small = single or sum(f.rows for f in m.files) < REMERGE_ROWS
        if small and all(_footer_ok(run_dir / f.path) for f in m.files):
            inputs += [_Input(run_dir / f.path, f.path, f.rows, manifest=m) for f in m.files]
    base = layout.compacted_dir(run_dir, table)
    base.mkdir(parents=True, exist_ok=True)
    stem = f"c-{time.time_ns():019d}-{os.getpid()}" + (f"-{tag}" if tag is not None else "")
    written: list[layout.CompactedFile] = []
    merged: list[_Input] = []
    fresh: set[int] = set()  # single-file tables: ranks whose current file is being merged
    pending: list[pa.Table] = []
    rows = 0

    def flush() -> None:
        nonlocal pending, rows
        data = pa.concat_tables(pending)
        name = f"{stem}-{len(written):03d}.parquet"
        ranks = _write_sorted(base / name, table, data, run_id)
        if table == "spans":
            # Its sums, rebuilt from its rows, written before the commit: a pass killed in between
            # leaves an uncommitted file and its twin, which the next pass removes.
            layout.write_sums_twin(base / name, data, run_id=run_id)
        written.append(layout.CompactedFile(f"{layout.COMPACTED_DIR}/{table}/{name}", data.num_rows, ranks))
        res.rows += data.num_rows
        pending, rows = [], 0
        hook("written")

    workers = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for lo in range(0, len(inputs), _READ_AHEAD):
            chunk = inputs[lo:lo + _READ_AHEAD]
            for item, (data, problem) in zip(chunk, pool.map(lambda i: _load(i, table, run_id), chunk), strict=True):
                if data is None:
                    if item.manifest is not None:  # a committed file unreadable: leave its whole manifest be
                        raise RunDirError(f"compaction: {problem}")
                    res.skipped.append(problem or f"{item.path}: skipped")
                    continue
                if single and item.manifest is None:
                    fresh.update(data.column("rank").to_pylist())
                elif single and fresh:
                    keep = pc.invert(pc.is_in(data.column("rank"), value_set=pa.array(sorted(fresh), pa.int32())))
                    data = data.filter(keep)
                if pending and rows + data.num_rows > FILE_ROWS:
                    flush()
                pending.append(data)
                rows += data.num_rows
                merged.append(item)
    if not any(i.manifest is None for i in merged):
        # Nothing new (every part skipped): rewriting the earlier compacted files alone gains nothing.
        for name in (f.path for f in written):
            _unlink(run_dir / name)
        return res
    if pending:
        flush()
    # A compacted file keeps the newest write time of what it merged, not the time of the merge:
    # run state reads the age of a run's data from modification times.
    newest = max((_mtime_ns(i.path) for i in merged), default=None)
    if newest is not None:
        for f in written:
            with contextlib.suppress(OSError):
                os.utime(run_dir / f.path, ns=(newest, newest))
    replaces = [i.rel for i in merged]
    if table == "spans":
        # The merged files' sums go with them (the new files have their own).
        twins = (layout.sums_twin(i.path) for i in merged)
        replaces += [t.relative_to(run_dir).as_posix() for t in twins if t.exists()]
    for m in {id(i.manifest): i.manifest for i in merged if i.manifest is not None}.values():
        replaces.append(m.name)
        # What it replaced and is still there (a pass killed while removing) stays replaced.
        replaces += [rel for rel in m.replaces if (run_dir / rel).exists()]
    manifest = layout.Manifest(
        path=base / f"{stem}{layout.MANIFEST_SUFFIX}",
        table=table,
        run_id=run_id,
        committed_ns=time.time_ns(),
        files=tuple(written),
        replaces=tuple(dict.fromkeys(replaces)),
        stamps={i.rel: i.stamp for i in merged if i.stamp is not None},
    )
    layout.write_manifest(manifest)
    res.parts_merged = sum(1 for i in merged if i.manifest is None)
    res.files_written = len(written)
    return res


def _mtime_ns(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _write_sorted(path: Path, table: str, data: pa.Table, run_id: str) -> tuple[tuple[int, int], ...]:
    """Sort ``data`` and write it to ``path`` atomically, row groups cut at step boundaries (spans:
    :func:`_span_row_groups`).

    Returns the ranks it holds, as inclusive ranges."""
    keys, align = SORT_KEYS[table]
    if table == "spans":
        data, bounds = _span_row_groups(data)
    else:
        data = data.sort_by([(k, "ascending") for k in keys])  # nulls last (the default)
        bounds = _row_groups(data, align)
    data = data.replace_schema_metadata({layout.RUN_ID_KEY: run_id.encode()})
    tmp = path.with_name(f".{path.name}{_TMP_SUFFIX}")
    try:
        with pq.ParquetWriter(tmp, data.schema, compression="zstd") as writer:
            for lo, hi in bounds:
                writer.write_table(data.slice(lo, hi - lo), row_group_size=hi - lo)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    layout.fsync_dir(path.parent)
    return _rank_ranges(data)


def _row_groups(data: pa.Table, align: str | None) -> list[tuple[int, int]]:
    """Row group bounds: at most ROW_GROUP_ROWS rows, cut where ``align`` (sorted) changes when a
    change lies inside the window, else where ``rank`` changes (one step of many ranks)."""
    n = data.num_rows
    if n == 0:
        return [(0, 0)]
    if align is None:
        return [(lo, min(lo + ROW_GROUP_ROWS, n)) for lo in range(0, n, ROW_GROUP_ROWS)]
    keys = _codes(data.column(align))
    cuts = np.flatnonzero(np.diff(keys)) + 1
    rank_cuts = np.flatnonzero(np.diff(_codes(data.column("rank"))) | np.diff(keys)) + 1
    bounds = []
    lo = 0
    while lo < n:
        hi = lo + ROW_GROUP_ROWS
        if hi >= n:
            bounds.append((lo, n))
            break
        for candidates in (cuts, rank_cuts):
            i = int(np.searchsorted(candidates, hi, side="right")) - 1
            if i >= 0 and candidates[i] > lo:
                hi = int(candidates[i])
                break
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _span_row_groups(data: pa.Table) -> tuple[pa.Table, list[tuple[int, int]]]:
    """Spans sorted by (step, kind, rank, start_ns), and row group bounds that hold one kind each.

    Steps are taken in bands as :func:`_row_groups` would cut them: whole steps up to
    ROW_GROUP_ROWS rows a band (at 1,024 ranks and more, a step a band). Within a band the rows go
    kind by kind, each kind's rows one row group: ``kind = 'collective'`` reads only the
    collectives' row groups, skipping the others by their statistics. A step of more rows than
    that (many ranks) is cut into ranges of ranks of at most ROW_GROUP_ROWS rows (all kinds
    together), and each kind of it at the same rank boundaries, so that a few ranks read one range
    of each step, as they would in a file sorted by (step, rank). A rank with more rows of one
    kind than that is cut anywhere. Sorted by (band, kind, step, rank, start_ns): the same order as
    (step, kind, rank, start_ns) where each band is one step.
    """
    n = data.num_rows
    if n == 0:
        return data, [(0, 0)]
    step = pa.array(_codes(data.column("step")))  # nulls last, as sorted
    counted = pc.value_counts(step)
    values = counted.field("values").to_numpy()
    by_value = np.argsort(values)
    counts = counted.field("counts").to_numpy()[by_value]
    step_bands = _bands(counts)  # per distinct step, in order
    band = step_bands[pc.index_in(step, value_set=pa.array(values[by_value])).to_numpy()]
    kind = pc.dictionary_encode(data.column("kind").combine_chunks())
    kind_place = np.argsort(np.argsort(np.array(kind.dictionary.to_pylist(), dtype=object)))
    kind_code = kind_place[kind.indices.to_numpy()]  # in the kinds' (string) order
    keys = pa.table({"band": band, "kind": kind_code, "step": step, "rank": data.column("rank"),
                     "start_ns": data.column("start_ns")})
    order = pc.sort_indices(keys, sort_keys=[(k, "ascending") for k in keys.column_names])
    data = data.take(order)
    order_np = order.to_numpy()
    band, kind_code = band[order_np], kind_code[order_np]
    change = (np.diff(band) != 0) | (np.diff(kind_code) != 0)
    # Steps of more rows than a row group (each a band of its own): cut at the same rank bounds.
    band_starts = np.concatenate([[0], np.flatnonzero(np.diff(band)) + 1, [n]])
    for lo, hi in zip(band_starts[:-1].tolist(), band_starts[1:].tolist(), strict=True):
        if hi - lo <= ROW_GROUP_ROWS:
            continue
        rank = _codes(data.column("rank").slice(lo, hi - lo))
        lowest = int(rank.min())
        rank_band = _bands(np.bincount(rank - lowest))[rank - lowest]
        change[lo:hi - 1] |= np.diff(rank_band) != 0
    cuts = np.concatenate([[0], np.flatnonzero(change) + 1, [n]]).tolist()
    bounds = []
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        bounds += [(a, min(a + ROW_GROUP_ROWS, hi)) for a in range(lo, hi, ROW_GROUP_ROWS)]
    return data, bounds


def _bands(counts: np.ndarray) -> np.ndarray:
    """Consecutive items of ``counts`` rows each cut into bands of at most ROW_GROUP_ROWS rows
    (an item of more is a band of its own): each item's band, 0, 1, ..."""
    ends = np.cumsum(counts)
    band = np.zeros(len(counts), dtype=np.int64)
    i = done = b = 0
    while i < len(counts):
        j = max(int(np.searchsorted(ends, done + ROW_GROUP_ROWS, side="right")), i + 1)
        band[i:j] = b
        done, i, b = int(ends[j - 1]), j, b + 1
    return band


def _codes(column: pa.ChunkedArray) -> np.ndarray:
    """Integer keys of a sorted column, nulls last (as sorted)."""
    filled = pc.fill_null(column.cast(pa.int64()), np.iinfo(np.int64).max).combine_chunks()
    return np.asarray(filled.to_numpy(zero_copy_only=False), dtype=np.int64)


def _rank_ranges(data: pa.Table) -> tuple[tuple[int, int], ...]:
    if "rank" not in data.column_names:
        return ()
    ranks = pc.unique(data.column("rank").combine_chunks().drop_null()).to_numpy(zero_copy_only=False)
    if not len(ranks):
        return ()
    ranks = np.sort(ranks.astype(np.int64))
    breaks = np.flatnonzero(np.diff(ranks) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(ranks)]]) - 1
    return tuple((int(ranks[a]), int(ranks[b])) for a, b in zip(starts, ends, strict=True))
