"""Where each table of a run directory lives on disk, and how a part is written atomically.

Role in the data flow: every writer (the in-job collector, the trainer, ``synth``, the importers)
goes through :func:`write_part` and :func:`write_run_meta`; the reader (``megascope.store``) uses
:func:`table_glob`. Depends on pyarrow and the standard library only, so the collector inside a
training job can import it without duckdb or pandas.

Layout (ARCHITECTURE.md, contract)::

    RUN/run.json
    RUN/ranks/rank=00017.parquet
    RUN/groups/rank=00017.parquet
    RUN/spans/rank=00017/part-<time>-<pid>-<n>.parquet      (also markers/, metrics/)
    RUN/step_sums/rank=00017/part-<time>-<pid>-<n>.parquet  (its spans part's sums: the same name)
    RUN/heartbeats/host=NAME/part-*.parquet
    RUN/diagnostics/part-*.parquet
    RUN/compacted/spans/c-<id>-000.parquet                 (``megascope compact``: many parts merged)
    RUN/compacted/spans/c-<id>.manifest.json               (commits it: the files it holds, the parts it replaces)
    RUN/compacted/step_sums/c-<id>-000.parquet             (the compacted spans file's sums)

A part is written to a hidden temporary name in the same directory and renamed into place, so a
reader never sees half a file; temporary files end in ``.tmp`` and are never globbed. A writer that
passes ``run_id`` stamps it into the part's Parquet metadata, so that the reader can tell a part
copied in from another run.

Every spans file has a twin of the same name under ``step_sums/`` (:func:`sums_twin`): its
per-(rank, step, group) sums (``schema.STEP_SUMS``), written right after it by
:func:`write_spans_part`. The twin is derived data: a spans file without one (a writer killed
between the two, an older writer) is simply aggregated by the analysis, and a twin whose spans
file is gone is never read.

What may be written where (docs/promises.md): a new run only into a new or empty directory outside
any run (:func:`check_new_run_dir`, :func:`prepare_run_dir`); an export or heat-map never inside a
run, over an existing file only when asked (:func:`check_output_file`, :func:`check_output_dir`).

Example::

    from megascope import layout, schema
    layout.write_part(run_dir, "spans", table, rank=3)
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from megascope.errors import OutputError
from megascope.schema import STEP_SUMS_VERSION, TABLES, RunMeta
from megascope.stepsums import step_sums

RUN_JSON = "run.json"
# megascope compact's merged files and their manifests (``compacted/<table>/``).
COMPACTED_DIR = "compacted"
MANIFEST_SUFFIX = ".manifest.json"
MANIFEST_FORMAT = 1
# Parquet key-value metadata naming the run a part belongs to (``run.json``'s ``run_id``), so that
# parts copied in from another run are recognised and skipped instead of read as this run's data.
RUN_ID_KEY = b"megascope.run_id"
# The spans files' sums (schema.STEP_SUMS), beside the tables; and the key of the Parquet metadata
# stamping each with schema.STEP_SUMS_VERSION. Version 1 is plain "step_sums"; a later version is
# written under "step_sums_v<N>", where readers of version 1 never look.
STEP_SUMS_DIR = "step_sums" if STEP_SUMS_VERSION == 1 else f"step_sums_v{STEP_SUMS_VERSION}"
STEP_SUMS_VERSION_KEY = b"megascope.step_sums_version"

# Tables with one file per rank (written once, rewritten whole) versus many parts per rank.
SINGLE_FILE_TABLES = frozenset({"ranks", "groups"})
RANK_PARTITIONED = frozenset({"spans", "markers", "metrics"})
HOST_PARTITIONED = frozenset({"heartbeats"})
UNPARTITIONED = frozenset({"diagnostics"})

_counter = itertools.count()
# prepare_run_dir's write test; under torchrun several ranks may run it at once, so it never counts
# as content.
_PROBE = ".megascope-probe-"
_HOST_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def rank_dir_name(rank: int) -> str:
    return f"rank={rank:05d}"


def host_dir_name(host: str) -> str:
    return f"host={_HOST_SAFE.sub('_', host)}"


def part_name() -> str:
    """A part file name unique across processes and time, sortable by creation."""
    return f"part-{time.time_ns():019d}-{os.getpid()}-{next(_counter):06d}.parquet"


def table_path(run_dir: Path, table: str, *, rank: int | None = None, host: str | None = None) -> Path:
    """The file (single-file tables) or directory (parted tables) where new data of ``table`` goes."""
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}")
    base = Path(run_dir) / table
    if table in SINGLE_FILE_TABLES:
        if rank is None:
            raise ValueError(f"table {table} needs a rank")
        return base / f"{rank_dir_name(rank)}.parquet"
    if table in RANK_PARTITIONED:
        if rank is None:
            raise ValueError(f"table {table} needs a rank")
        return base / rank_dir_name(rank)
    if table in HOST_PARTITIONED:
        if host is None:
            raise ValueError(f"table {table} needs a host")
        return base / host_dir_name(host)
    return base


def table_glob(table: str) -> str:
    """The glob, relative to the run directory, that matches every finished part of ``table``."""
    if table in SINGLE_FILE_TABLES:
        return f"{table}/rank=*.parquet"
    if table in RANK_PARTITIONED:
        return f"{table}/rank=*/*.parquet"
    if table in HOST_PARTITIONED:
        return f"{table}/host=*/*.parquet"
    return f"{table}/*.parquet"


def compacted_dir(run_dir: Path | str, table: str) -> Path:
    """Where ``megascope compact`` puts the merged files of ``table`` and their manifests.

    Outside the table's own folder on purpose: a compacted file holds many ranks (``rank`` is a
    column), so it must not sit under ``rank=NNNNN`` directories, and a file without partition
    directories beside ``spans/rank=*/`` would break Hive partition parsing of ``spans/*/*.parquet``.
    """
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}")
    return Path(run_dir) / COMPACTED_DIR / table


def compacted_glob(table: str) -> str:
    """The glob, relative to the run directory, of ``table``'s compacted files (committed or not)."""
    return f"{COMPACTED_DIR}/{table}/*.parquet"


@dataclass(frozen=True)
class CompactedFile:
    """One file a manifest commits: its path relative to the run, rows, and the ranks it holds."""

    path: str
    rows: int
    ranks: tuple[tuple[int, int], ...]  # inclusive ranges, sorted; empty when no row has a rank


@dataclass(frozen=True)
class Manifest:
    """A committed compaction of one table: the files it wrote and the files they replace.

    Paths are relative to the run directory (``spans/rank=00003/part-...parquet``). ``stamps`` holds
    ``(size, mtime_ns)`` of replaced single-file tables' files (``ranks``, ``groups``), which a
    writer may rewrite: a file that changed since is not the one that was merged.
    """

    path: Path
    table: str
    run_id: str | None
    committed_ns: int
    files: tuple[CompactedFile, ...]
    replaces: tuple[str, ...]
    stamps: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{COMPACTED_DIR}/{self.table}/{self.path.name}"

    def to_json(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "table": self.table,
            "run_id": self.run_id,
            "committed_ns": self.committed_ns,
            "files": [{"path": f.path, "rows": f.rows, "ranks": [list(r) for r in f.ranks]} for f in self.files],
            "replaces": list(self.replaces),
            "stamps": {k: list(v) for k, v in sorted(self.stamps.items())},
        }


def _manifest_from_json(path: Path, table: str, data: Any) -> Manifest:
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or data.get("table") != table:
        raise ValueError("not a compaction manifest of this table")
    files = tuple(
        CompactedFile(str(f["path"]), int(f["rows"]), tuple((int(a), int(b)) for a, b in f.get("ranks", [])))
        for f in data["files"]
    )
    replaces = tuple(str(p) for p in data["replaces"])
    for rel in (*(f.path for f in files), *replaces):
        if rel.startswith("/") or "/../" in f"/{rel}/":
            raise ValueError(f"path {rel!r} outside the run")
    stamps = {str(k): (int(v[0]), int(v[1])) for k, v in (data.get("stamps") or {}).items()}
    run_id = data.get("run_id")
    return Manifest(path, table, run_id if isinstance(run_id, str) else None, int(data["committed_ns"]), files,
                    replaces, stamps)


# A compacted file's or manifest's name: ``c-<ns>-<pid>[-<scope>]`` then ``-NNN.parquet`` or the
# manifest suffix (a leading dot and a trailing ``.tmp`` while written). ``<scope>`` names the
# partitions a scoped pass (``megascope compact --ranks``/``--host``) covered: ``rLLLLL_HHHHH`` for
# a rank range, ``h<host>`` for one host's directory; an unscoped pass's names have none.
_COMPACTED_NAME = re.compile(r"^\.?c-\d+-\d+(?:-(?P<scope>[rh][A-Za-z0-9._-]*?))?(?:-\d{3}\.parquet|\.manifest\.json)")


def compacted_scope(name: str) -> str | None:
    """The scope a compacted file or manifest name carries (None: an unscoped pass wrote it)."""
    m = _COMPACTED_NAME.match(name)
    return m.group("scope") if m else None


def read_manifests(run_dir: Path | str, table: str,
                   names: Callable[[str], bool] | None = None) -> tuple[list[Manifest], list[str]]:
    """Every manifest of ``table`` that parses, and one line per one that does not. ``names``: read
    only the manifests whose file name it accepts (a scoped compaction reads those that may
    touch its partitions, never the whole cluster's)."""
    base = compacted_dir(run_dir, table)
    manifests: list[Manifest] = []
    problems: list[str] = []
    try:
        paths = sorted(p for p in base.iterdir()
                       if p.name.endswith(MANIFEST_SUFFIX) and (names is None or names(p.name)))
    except OSError:
        return [], []
    for path in paths:
        try:
            manifests.append(_manifest_from_json(path, table, json.loads(path.read_text())))
        except FileNotFoundError:
            continue  # removed by a compaction that superseded it
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError) as exc:
            problems.append(f"{path}: not a readable compaction manifest ({exc}); ignored")
    return manifests, problems


def active_manifests(manifests: list[Manifest]) -> list[Manifest]:
    """The manifests no other manifest replaced (a later compaction merged their files again)."""
    replaced = {rel for m in manifests for rel in m.replaces}
    return [m for m in manifests if m.name not in replaced]


def write_manifest(manifest: Manifest) -> None:
    """Commit ``manifest``: written under a temporary name, flushed to disk, renamed into place."""
    data = (json.dumps(manifest.to_json(), indent=1) + "\n").encode()
    tmp = manifest.path.with_name(f".{manifest.path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, manifest.path)
    fsync_dir(manifest.path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (where the platform allows a directory fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_run_dir(path: Path) -> bool:
    """True if ``path`` holds a run: its ``run.json``, or one of its tables' folders (a run being written,
    or one whose ``run.json`` was lost)."""
    path = Path(path)
    if (path / RUN_JSON).exists() or (path / COMPACTED_DIR).is_dir():
        return True
    return any(next((path / table).glob("rank=*"), None) is not None for table in ("spans", "markers", "ranks", "metrics"))


def enclosing_run(path: Path | str) -> Path | None:
    """The run directory that ``path`` is or lies inside of (symbolic links followed), else None."""
    real = Path(os.path.realpath(path))
    for candidate in (real, *real.parents):
        if candidate.is_dir() and is_run_dir(candidate):
            return candidate
    return None


def check_new_run_dir(out: Path | str) -> None:
    """Refuse ``out`` as a new run directory unless it is absent or an empty directory outside any run.

    megascope never writes into an existing run or a directory with anything in it: the new parts
    would mix with the old ones and ``run.json`` would be replaced.
    """
    out = Path(out)
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise OutputError(f"{out}: exists and is not a directory; choose a new -o directory")
        if any(not e.name.startswith(_PROBE) for e in out.iterdir()):
            what = " (a run directory)" if is_run_dir(out) else ""
            raise OutputError(f"{out}: already exists and is not empty{what}; megascope writes a new run only "
                              "into a new or empty directory: choose another -o")
    outer = enclosing_run(out.parent)
    if outer is not None:
        raise OutputError(f"{out}: inside the run directory {outer}; choose a path outside it")


def prepare_run_dir(out: Path | str) -> Path:
    """Check ``out`` (:func:`check_new_run_dir`), create it and make sure it can be written.

    A read-only or full filesystem is found here, in one line, before a job starts.
    """
    out = Path(out)
    check_new_run_dir(out)
    return _writable_dir(out)


def _writable_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) and write a probe file into it: an OutputError in one line
    where that fails (read-only or full filesystem, a file in the way)."""
    probe = path / f"{_PROBE}{os.getpid()}.tmp"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"0")
    except OSError as exc:
        raise OutputError(f"{exc.filename or path}: cannot write ({exc.strerror or exc})") from None
    finally:
        if path.is_dir():
            probe.unlink(missing_ok=True)
    return path


def _inside(path: Path, runs: tuple[Path | str, ...]) -> Path | None:
    real = Path(os.path.realpath(path))
    found = enclosing_run(real if real.is_dir() else real.parent)
    if found is not None:
        return found
    for run in runs:
        run_real = Path(os.path.realpath(run))
        if real == run_real or run_real in real.parents:
            return Path(run)
    return None


def check_output_file(path: Path | str, *, replace: bool = False, runs: tuple[Path | str, ...] = ()) -> Path:
    """Refuse an output file (an export, a heat-map) that would land inside a run directory (an existing
    one, or one of ``runs`` about to be written), or replace an existing file unless ``replace``."""
    path = Path(path)
    outer = _inside(path, runs)
    if outer is not None:
        raise OutputError(f"{path}: inside the run directory {outer}; write it outside the run")
    if path.is_dir():
        raise OutputError(f"{path}: is a directory; give a file name")
    if (path.exists() or path.is_symlink()) and not replace:
        raise OutputError(f"{path}: already exists; pass --force to replace it, or choose another -o")
    return path


def check_output_dir(path: Path | str, *, replace: bool = False) -> Path:
    """Refuse an output directory of files (``export chrome --split-ranks``) that is or lies inside a run
    directory, or that already holds something unless ``replace`` (which then replaces same-named files)."""
    path = Path(path)
    outer = _inside(path, ())
    if outer is not None:
        raise OutputError(f"{path}: inside the run directory {outer}; write exports outside the run")
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise OutputError(f"{path}: exists and is not a directory")
        if not replace and any(path.iterdir()):
            raise OutputError(f"{path}: not empty; pass --force to replace files of the same name in it, "
                              "or choose another -o")
    return path


def check_counters_dir(path: Path | str, *, run: Path | str) -> Path:
    """Create a directory that a job writes files into beside its run (``train --host-stats``) and make
    sure it can be written, before the job starts: not inside ``run`` (about to be written) nor any
    other run directory. Files of the same name in it are replaced."""
    path = Path(path)
    outer = _inside(path, (run,))
    if outer is not None:
        raise OutputError(f"{path}: inside the run directory {outer}; write it outside the run")
    return _writable_dir(path)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_table_atomic(path: Path, table: pa.Table, *, compression: str = "zstd") -> None:
    """Write ``table`` to ``path`` through a temporary file and a rename."""
    # Imported here, not with the module: a process that only reads runs (the report) never loads
    # pyarrow's Parquet module and the filesystems it brings (~10 MB resident).
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp, compression=compression)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_part(
    run_dir: Path | str,
    table: str,
    data: pa.Table,
    *,
    rank: int | None = None,
    host: str | None = None,
    run_id: str | None = None,
) -> Path:
    """Write ``data`` as one new part of ``table`` (or the whole file of a single-file table).

    ``data`` is cast to the table's schema, so a writer that built it column by column gets the
    same types as every other writer. ``run_id`` (``run.json``'s) is stamped into the part's
    metadata; every writer that knows it should pass it (a part without one is read as this run's).
    """
    schema = TABLES[table]
    if data.schema != schema:
        data = data.select(schema.names).cast(schema)
    # Only the writer's own run id: a table read from another run's part keeps that run's id in its
    # metadata, which must not travel into this run.
    metadata = {k: v for k, v in (data.schema.metadata or {}).items() if k != RUN_ID_KEY}
    if run_id is not None:
        metadata[RUN_ID_KEY] = run_id.encode()
    if metadata != (data.schema.metadata or {}):
        data = data.replace_schema_metadata(metadata or None)
    where = table_path(Path(run_dir), table, rank=rank, host=host)
    path = where if table in SINGLE_FILE_TABLES else where / part_name()
    write_table_atomic(path, data)
    return path


def sums_twin(spans_file: Path | str) -> Path:
    """The ``step_sums`` file paired with a spans file: ``spans/rank=00017/part-X.parquet`` ->
    ``step_sums/rank=00017/part-X.parquet``, ``compacted/spans/c-X.parquet`` ->
    ``compacted/step_sums/c-X.parquet``."""
    path = Path(spans_file)
    if path.parent.name == "spans":  # compacted/spans/<file>
        return path.parent.parent / STEP_SUMS_DIR / path.name
    if path.parent.parent.name != "spans":
        raise ValueError(f"{path}: not a spans file")
    return path.parent.parent.parent / STEP_SUMS_DIR / path.parent.name / path.name


def sums_glob() -> str:
    """The glob, relative to the run directory, of the spans parts' twins."""
    return f"{STEP_SUMS_DIR}/rank=*/*.parquet"


def write_sums_twin(spans_file: Path, spans: pa.Table, *, run_id: str | None = None,
                    sums: pa.Table | None = None) -> Path:
    """Write the sums of ``spans`` (the rows of ``spans_file``) as its twin, atomically; ``sums``:
    those sums, where the caller has them already."""
    data = step_sums(spans) if sums is None else sums
    metadata = {STEP_SUMS_VERSION_KEY: str(STEP_SUMS_VERSION).encode()}
    if run_id is not None:
        metadata[RUN_ID_KEY] = run_id.encode()
    path = sums_twin(spans_file)
    write_table_atomic(path, data.replace_schema_metadata(metadata))
    return path


def write_spans_part(run_dir: Path | str, data: pa.Table, *, rank: int, run_id: str | None = None,
                     sums: pa.Table | None = None) -> Path:
    """Write ``data`` as one new spans part (:func:`write_part`), then its sums (``sums``, where
    the caller has them already) as its twin.

    Spans first: a writer killed between the two leaves a spans part without a twin, which the
    analysis aggregates itself, never a twin without its spans."""
    path = write_part(run_dir, "spans", data, rank=rank, run_id=run_id)
    write_sums_twin(path, data, run_id=run_id, sums=sums)
    return path


def part_run_id(path: Path | str) -> str | None:
    """The run id stamped into a part, or None (a part written without one)."""
    import pyarrow.parquet as pq

    return run_id_in(pq.read_metadata(path).metadata)


def run_id_in(key_values: dict[bytes, bytes] | None) -> str | None:
    """The run id in a Parquet footer's key-value metadata, or None."""
    raw = (key_values or {}).get(RUN_ID_KEY)
    return raw.decode(errors="replace") if raw is not None else None


def write_run_meta(run_dir: Path | str, meta: RunMeta) -> Path:
    path = Path(run_dir) / RUN_JSON
    atomic_write_bytes(path, (json.dumps(meta.to_json(), indent=2, sort_keys=True) + "\n").encode())
    return path


def read_run_json(run_dir: Path | str) -> dict[str, Any]:
    """The raw ``run.json`` dict (validation is the store's job)."""
    return json.loads((Path(run_dir) / RUN_JSON).read_text())
