"""Open a run directory as DuckDB views, keeping what is readable and naming what is not.

Role in the data flow: the one reader of run directories. Analyses, exports and the dashboard take
a :class:`Run` (or its connection) and query the views ``ranks``, ``groups``, ``spans``,
``markers``, ``metrics``, ``heartbeats`` and ``diagnostics``; they never glob files themselves.

What can go wrong with a run directory, and what happens:

* not a directory, or no ``run.json`` and no parts at all -> :class:`RunDirError`;
* ``run.json`` unreadable, or of an unknown schema version -> :class:`RunDirError` /
  :class:`SchemaVersionError` naming the file;
* a truncated or foreign part (not Parquet, or missing required columns) -> skipped, and a line in
  ``Run.problems`` names the file; the rest stays readable;
* ranks of the mesh that wrote nothing -> a line in ``Run.problems`` (silence is information for
  the hang analysis, not an error).

Two more views stand for ``spans`` where only the per-(rank, step, group) sums are wanted (the
analysis' base tables): ``step_sums``, the sums files written beside the spans files read (their
twins, ``layout.sums_twin``), and
``spans_unsummed``, the spans files read that have no such twin. Together they give the same sums
as ``spans``.

Compacted runs (``megascope compact``, docs/run-directory.md): each view also reads the files under
``compacted/<table>/`` that a committed manifest names, and skips the parts those manifests
replace; a compacted file no manifest names (a pass still writing, or killed) is not read.

Example::

    from megascope.store import open_run
    run = open_run("runs/demo")
    run.con.sql("SELECT rank, count(*) FROM spans GROUP BY rank").df()
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar, cast

import duckdb
import pyarrow as pa

from megascope import layout
from megascope.errors import RunDirError, SchemaVersionError
from megascope.schema import (
    RANKS_V1_COORD_COLUMNS,
    STEP_SUMS,
    SUPPORTED_SCHEMA_VERSIONS,
    TABLES,
    RunMeta,
)
from megascope.topology import Mesh

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# Partition columns DuckDB reads from directory names; typed so they agree with the file columns.
_HIVE_TYPES = {"spans": "rank", "markers": "rank", "metrics": "rank"}


def _sql_str(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _required_columns(table: str) -> set[str]:
    return {f.name for f in TABLES[table] if not f.nullable}


@dataclass
class Run:
    """An opened run directory: its metadata, a DuckDB connection with one view per table, and
    the problems met while opening it."""

    path: Path
    meta: RunMeta
    con: duckdb.DuckDBPyConnection
    problems: list[str] = field(default_factory=list)
    files: dict[str, list[Path]] = field(default_factory=dict)  # every file a view reads: parts, then compacted
    compacted: dict[str, list[Path]] = field(default_factory=dict)  # the committed compacted files among them
    _compacted_ranks: dict[Path, tuple[tuple[int, int], ...]] = field(default_factory=dict, repr=False)
    # Per parted table, the parts already found stamped with this run's id: a part is never
    # rewritten (a new one is written beside it), so a refresh reads only the new parts' metadata.
    _stamped: dict[str, set[str]] = field(default_factory=dict, repr=False)
    _twins: dict[Path, Path] = field(default_factory=dict, repr=False)  # spans file -> its twin's path
    # Per table, whether its parts all have the schema's columns (stamped with this run's id).
    _uniform: dict[str, bool] = field(default_factory=dict, repr=False)
    # Per question, each file's answer (see per_file), under a lock of its own: the views are
    # built under _lock and ask it too.
    _per_file: dict[str, dict[Path, object]] = field(default_factory=dict, repr=False)
    _per_file_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def mesh(self) -> Mesh:
        sizes = {a: self.meta.mesh_sizes.get(a, 1) for a in self.meta.mesh_axes}
        if not self.meta.mesh_sizes:
            sizes = {a: 1 for a in self.meta.mesh_axes}
            sizes[self.meta.mesh_axes[-1]] = self.meta.world_size
        return Mesh.from_mapping(sizes, order=tuple(self.meta.mesh_axes))

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A cursor for the calling thread (Dash serves callbacks on threads)."""
        with self._lock:
            return self.con.cursor()

    def with_cursor(self) -> Run:
        """This run read through a fresh :meth:`cursor`: what an analysis on another thread is
        given (close its ``con`` when done)."""
        return replace(self, con=self.cursor())

    def has_rows(self, table: str) -> bool:
        return bool(self.files.get(table))

    def file_gone(self) -> Path | None:
        """A file the views were built over that is no longer there (a compaction pass merged and
        removed it), or None. Stats every listed file: for after a read failed, not before each."""
        return next((f for files in self.files.values() for f in files if not os.path.lexists(f)), None)

    def ranks_written(self, tables: tuple[str, ...] = ("spans", "markers")) -> set[int]:
        """Ranks with any file of ``tables``: from part directory names and the compaction
        manifests, without reading a file."""
        ranks: set[int] = set()
        for table in tables:
            for f in self.files.get(table, []):
                ranges = self._compacted_ranks.get(f)
                if ranges is not None:
                    for lo, hi in ranges:
                        ranks.update(range(lo, hi + 1))
                    continue
                name = f.stem if table in layout.SINGLE_FILE_TABLES else f.parent.name
                if name.startswith("rank=") and name[5:].isdigit():
                    ranks.add(int(name[5:]))
        return ranks

    def rank_source(self, table: str, ranks: Iterable[int]) -> str:
        """A SQL subquery over ``table``'s rows of ``ranks`` only, typed as the schema says.

        Reads only the files that can hold those ranks (their part directories, and the compacted
        files whose manifest names them): binding a view over the ~100k parts of a 12,288-rank run
        costs seconds per query, reading a few files milliseconds.
        """
        wanted = sorted({int(r) for r in ranks})
        names = {layout.rank_dir_name(r) for r in wanted}
        single = table in layout.SINGLE_FILE_TABLES
        parts = [f for f in self.files.get(table, []) if f not in self._compacted_ranks
                 and (f.stem if single else f.parent.name) in names]
        # A rewritten single file (ranks, groups) wins over the rows compaction merged earlier.
        live = {int(f.stem[5:]) for f in parts} if single else set()
        need = [r for r in wanted if r not in live]
        compacted = [f for f in self.compacted.get(table, [])
                     if any(lo <= r <= hi for r in need for lo, hi in self._compacted_ranks.get(f, ()))]
        selects = []
        if parts:
            selects.append(_select(self.con, table, _list_sql(parts), _read_options(table, uniform=False)))
        if compacted:
            rank_list = ", ".join(map(str, need))
            selects.append(f"SELECT * FROM ({_select(self.con, table, _list_sql(compacted), _COMPACTED_OPTIONS)}) "
                           f"WHERE rank IN ({rank_list})")
        return "(" + (" UNION ALL ".join(selects) or _empty_select(table)) + ")"

    def per_file(self, question: str, files: list[Path], ask: Callable[[list[Path]], dict[Path, _T]]) -> dict[Path, _T]:
        """The answer to ``question`` for each of ``files`` (a table's parts or compacted files),
        asking ``ask`` only about the files it was not asked about before.

        A part or a compacted file is never rewritten (a new one with a new name is written
        instead), so an answer read from it holds for its life; on a live run a refresh asks about
        its new files only. ``ask`` returns an answer per file it can tell; a file it leaves out is
        asked about again next time (and is missing from the result). Answers of files no longer
        in ``files`` are forgotten (compaction removed them). Not for ``ranks`` or ``groups``,
        whose files are rewritten in place. ``ask``'s errors reach the caller.
        """
        with self._per_file_lock:
            known = self._per_file.get(question, {})
            missing = [f for f in files if f not in known]
        found = ask(missing) if missing else {}
        with self._per_file_lock:
            known = {**self._per_file.get(question, {}), **found}
            self._per_file[question] = answers = {f: known[f] for f in files if f in known}
        return cast(dict[Path, _T], answers)

    def refresh(self) -> list[str]:
        """Re-scan the directory for new parts (a live run) and rebuild the views.

        Returns the problems newly found.
        """
        before = len(self.problems)
        with self._lock:
            _create_views(self)
        return self.problems[before:]


def read_meta(path: Path) -> RunMeta:
    """Read and validate ``run.json``."""
    meta_path = path / layout.RUN_JSON
    try:
        data = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise RunDirError(f"{meta_path}: missing (not a megascope run directory?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunDirError(f"{meta_path}: unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise RunDirError(f"{meta_path}: expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise SchemaVersionError(
            f"{meta_path}: schema_version {version!r} is not one this megascope reads "
            f"({', '.join(map(str, sorted(SUPPORTED_SCHEMA_VERSIONS)))}); upgrade megascope or re-create the run"
        )
    problem = _meta_type_problem(data)
    if problem:
        raise RunDirError(f"{meta_path}: invalid run metadata ({problem})")
    try:
        return RunMeta.from_json(data)
    except (TypeError, ValueError, OverflowError) as exc:
        raise RunDirError(f"{meta_path}: invalid run metadata ({exc})") from None


_INT64_MAX = 2**63 - 1
# world_size and every mesh size stay below this: more ranks than any job has, few enough to count.
_MAX_RANKS = 1 << 24


def _is_int(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: object, low: float, high: float) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and low <= value <= high)


def _is_axes(value: object) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(isinstance(a, str) for a in value)


def _is_sizes(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and _is_int(v, 1, _MAX_RANKS) for k, v in value.items())


def _meta_type_problem(data: dict[str, object]) -> str | None:
    """What in ``run.json`` has the wrong type or an impossible value, or None."""
    checks: list[tuple[str, bool, bool]] = [  # field, required, ok
        ("run_id", True, isinstance(data.get("run_id"), str)),
        ("source", True, isinstance(data.get("source"), str)),
        ("world_size", True, _is_int(data.get("world_size"), 1, _MAX_RANKS)),
        ("mesh_axes", False, _is_axes(data.get("mesh_axes"))),
        ("mesh_sizes", False, _is_sizes(data.get("mesh_sizes"))),
        ("start_ns", False, _is_int(data.get("start_ns"), 0, _INT64_MAX)),
        ("model_flops_per_step", False, _is_number(data.get("model_flops_per_step"), 0, 1e30)),
        ("tokens_per_step", False, _is_int(data.get("tokens_per_step"), 0, _INT64_MAX)),
        ("device_name", False, isinstance(data.get("device_name"), str)),
        ("peak_flops_per_device", False, _is_number(data.get("peak_flops_per_device"), 1e-300, 1e30)),
        ("micro_batches", False, _is_int(data.get("micro_batches"), 1, _INT64_MAX)),
        ("config", False, isinstance(data.get("config"), dict)),
    ]
    for name, required, ok in checks:
        if ok or (not required and data.get(name) is None):
            continue
        shown = repr(data.get(name))
        return f"{name} is {shown if len(shown) <= 40 else shown[:37] + '...'}"
    return None


def _foreign(path: Path, part_run_id: str, run_id: str) -> str:
    return f"{path}: a part of another run ({part_run_id!r}, not {run_id!r}); skipped"


def _check_part(path: Path, table: str, run_id: str, con: duckdb.DuckDBPyConnection | None = None) -> str | None:
    """Why ``path`` cannot be read as a part of ``table`` of run ``run_id``, or None if it can.

    With ``con``, DuckDB reads the footer too (it parses some damaged footers pyarrow accepts)."""
    # Imported here, not with the module: only parts that fail the cheap checks get here, and
    # pyarrow's Parquet module (with the filesystems it brings) is ~10 MB of a report's memory.
    import pyarrow.parquet as pq

    try:
        footer = pq.read_metadata(path)  # once: a compacted file's footer holds hundreds of row groups
        schema = footer.schema.to_arrow_schema()
        part_run_id = layout.run_id_in(footer.metadata)
        if con is not None:
            con.execute("DESCRIBE SELECT * FROM read_parquet(?)", [str(path)]).fetchall()
    except (OSError, pa.ArrowException, duckdb.Error) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"{path}: not a readable Parquet file ({reason}); skipped"
    missing = _required_columns(table) - set(schema.names)
    if missing:
        return f"{path}: not a megascope {table} part (missing columns {', '.join(sorted(missing))}); skipped"
    if part_run_id is not None and part_run_id != run_id:
        return _foreign(path, part_run_id, run_id)
    return None


@dataclass
class _Parts:
    """The readable parts of one table and how to read them."""

    files: list[Path]
    whole: bool  # every file the glob matches is readable: views may use the glob itself
    uniform: bool  # every file has the same columns: no union_by_name (which reads every footer per query)


def _scan(run: Run, table: str, *, thorough: bool = False, ignored: frozenset[str] = frozenset()) -> _Parts:
    """Finished parts of ``table``: checked cheaply as a whole, file by file only on failure (or when
    ``thorough``: after the whole failed to read). Parts in ``ignored`` (merged into a committed
    compacted file, not yet removed) are left out."""
    every = sorted(run.path.glob(layout.table_glob(table)))
    files = [f for f in every if str(f) not in ignored] if ignored else every
    # The glob, not a list of every path: one statement stays small at 100k+ files. While merged
    # parts wait for removal, the list of the others (few, beside the compacted files).
    whole_glob = len(files) == len(every)
    if not files:
        return _Parts([], True, True)
    if thorough:
        return _scan_each(run, table, files, whole_glob=whole_glob)
    if table not in layout.SINGLE_FILE_TABLES and _known_stamped(run, table, files):
        return _Parts(files, whole_glob, True)
    required = _required_columns(table)
    glob = str(run.path / layout.table_glob(table))
    source = glob if whole_glob else [str(f) for f in files]
    try:
        # Parts stamped with another run's id (copied in from elsewhere) are not this run's data.
        stamped = stamped_run_ids(run.con, source)
        foreign = {Path(name) for name, part_run_id in stamped.items() if part_run_id != run.meta.run_id}
        if not foreign and len(stamped) >= len(files):
            # Every part is this run's, written through layout.write_part: its columns are the schema's.
            if table not in layout.SINGLE_FILE_TABLES:
                run._stamped[table] = set(map(str, files))
            return _Parts(files, whole_glob, True)
        rows = run.con.execute(
            "SELECT file_name, list(name ORDER BY name) FROM parquet_schema(?) GROUP BY file_name", [source],
        ).fetchall()
        bad = foreign | {Path(name) for name, cols in rows if not required <= set(cols)}
        if not bad and len(rows) >= len(files):
            return _Parts(files, whole_glob, len({tuple(cols) for _, cols in rows}) == 1)
    except duckdb.Error:
        pass
    return _scan_each(run, table, files, thorough=False, whole_glob=whole_glob)


def stamped_run_ids(con: duckdb.DuckDBPyConnection, source: str | list[str]) -> dict[str, str]:
    """File name -> the run id stamped into it (:func:`megascope.layout.write_part`), for the
    Parquet files of ``source`` (a glob or a list of paths) that carry one, from their footers only."""
    return dict(con.execute(
        "SELECT file_name, decode(value) FROM parquet_kv_metadata(?) WHERE decode(key) = ?",
        [source, layout.RUN_ID_KEY.decode()],
    ).fetchall())


def _known_stamped(run: Run, table: str, files: list[Path]) -> bool:
    """Whether every one of ``files`` is stamped with this run's id, reading the metadata of
    those not seen so on an earlier scan only (a live run's refresh: the new parts). False sends
    the caller to the full check."""
    known = run._stamped.get(table)
    if known is None:
        return False
    names = set(map(str, files))
    fresh = sorted(names - known)
    if fresh:
        try:
            stamped = stamped_run_ids(run.con, fresh)
        except duckdb.Error:
            stamped = {}
        if len(stamped) < len(fresh) or any(part_run_id != run.meta.run_id for part_run_id in stamped.values()):
            del run._stamped[table]
            return False
    run._stamped[table] = names  # parts removed since (compaction) are forgotten
    return True


def _scan_each(run: Run, table: str, files: list[Path], *, thorough: bool = True, whole_glob: bool = True) -> _Parts:
    good = []
    for f in files:
        problem = _check_part(f, table, run.meta.run_id, run.con if thorough else None)
        if problem is None:
            good.append(f)
        elif not os.path.lexists(f):
            # Listed, then removed (a compaction pass merged it, its rows now in a compacted file
            # the manifests name): nothing is wrong with the run, and a problem kept in
            # run.problems would outlive the refresh that no longer lists it.
            continue
        elif problem not in run.problems:
            run.problems.append(problem)
            log.info(problem)  # reported through Run.problems (the CLI prints each once)
    return _Parts(good, whole_glob and len(good) == len(files), False)


# How often the views are built again when a file listed for them was removed before DuckDB read
# it: a compaction pass commits the manifest naming a part's rows before it removes the part, so
# listing the directory again finds those rows in the compacted file.
_VANISHED_RETRIES = 3


def _create_views(run: Run) -> None:
    for attempt in range(_VANISHED_RETRIES + 1):
        try:
            _create_views_once(run)
            return
        except duckdb.IOException as exc:
            gone = run.file_gone()
            if gone is None or attempt == _VANISHED_RETRIES:
                raise
            log.info("%s: %s was removed while the views were built (%s); listing the run again",
                     run.path, gone, str(exc).splitlines()[0])


def _create_views_once(run: Run) -> None:
    _create_table_views(run)
    _create_sums_views(run)
    # The table views read through globs and do not change as parts arrive; this one does, so that
    # anything keyed on the views' definitions (the analysis' derived tables) sees new data.
    names = [*TABLES, SUMS_VIEW, UNSUMMED_VIEW]
    digest = hashlib.sha1("\n".join(str(f) for t in names for f in run.files[t]).encode()).hexdigest()
    counts = ", ".join(f"{len(run.files[t])} AS {t}" for t in names)
    # Whether a table's parts all have the schema's columns: a view over some of them (subset_views)
    # then reads them without union_by_name, which reads every file's footer at each query.
    uniform = ", ".join(f"{str(run._uniform.get(t, False)).lower()} AS {t}_uniform" for t in _SUBSET_TABLES)
    run.con.execute(f"CREATE OR REPLACE VIEW store_parts AS SELECT '{digest}' AS digest, {counts}, {uniform}")


# The spans files' sums (layout.sums_twin) the analysis reads in place of their spans, and the
# spans files that have none (an older writer, a writer killed between the two writes).
SUMS_VIEW = "step_sums"
UNSUMMED_VIEW = "spans_unsummed"


def _create_sums_views(run: Run) -> None:
    """Views ``step_sums`` (the twins of the spans files read) and ``spans_unsummed`` (the spans
    files read that have none): together they stand for ``spans`` in the per-rank-step sums."""
    spans = run.files["spans"]
    compacted = set(run.compacted.get("spans", []))
    present = set(run.path.glob(layout.sums_glob()))
    present.update(run.path.glob(f"{layout.COMPACTED_DIR}/{layout.STEP_SUMS_DIR}/*.parquet"))
    # Paired by name (a part's name is unique: write time, pid, counter), so a twin is this run's
    # when its spans file is; no footer is read here (that would cost seconds at 100k+ parts). A
    # twin DuckDB cannot read makes the analysis aggregate the spans instead (base._rank_step).
    known = run._twins
    twin = {f: known.get(f) or layout.sums_twin(f) for f in spans}
    run._twins = twin  # a refresh computes the new files' twin paths only
    summed = [twin[f] for f in spans if twin[f] in present]
    unsummed = [f for f in spans if twin[f] not in present]
    if summed:
        try:
            run.con.execute(f"CREATE OR REPLACE VIEW {SUMS_VIEW} AS {_sums_select(run, summed, present)}")
        except duckdb.Error as exc:  # the twin DuckDB binds the view with is damaged: sum the spans
            log.info("%s: step sums unreadable (%s); the spans are summed instead", run.path, exc)
            summed, unsummed = [], spans
    if not summed:
        run.con.execute(f"CREATE OR REPLACE VIEW {SUMS_VIEW} AS {_empty_select(SUMS_VIEW)}")
    run.files[SUMS_VIEW] = summed
    run.files[UNSUMMED_VIEW] = unsummed
    if not unsummed:
        body = _empty_select("spans")
    elif not summed:
        body = "SELECT * FROM spans"
    else:
        selects = []
        parts = [f for f in unsummed if f not in compacted]
        if parts:
            selects.append(_select(run.con, "spans", _list_sql(parts), _read_options("spans", uniform=False)))
        if len(parts) < len(unsummed):
            selects.append(_select(run.con, "spans", _list_sql([f for f in unsummed if f in compacted]),
                                   _COMPACTED_OPTIONS))
        body = " UNION ALL ".join(selects)
    run.con.execute(f"CREATE OR REPLACE VIEW {UNSUMMED_VIEW} AS {body}")


def _sums_select(run: Run, summed: list[Path], present: set[Path]) -> str:
    """The ``step_sums`` view's body over the twins ``summed`` (``present``: every twin found)."""
    parts = [t for t in summed if t.parent.parent.name == layout.STEP_SUMS_DIR]
    # The glob where it reads exactly these parts (the view stays small at 100k+ files).
    every_part = len(parts) == sum(1 for t in present if t.parent.parent.name == layout.STEP_SUMS_DIR)
    sources = ([_sql_str(str(run.path / layout.sums_glob()))] if parts and every_part
               else [_list_sql(parts)] if parts else [])
    if len(parts) < len(summed):
        sources.append(_list_sql([t for t in summed if t.parent.parent.name != layout.STEP_SUMS_DIR]))
    return " UNION ALL ".join(f"SELECT * FROM read_parquet({src}, hive_partitioning=false)" for src in sources)


# The tables subset_views reads parts of.
_SUBSET_TABLES = ("spans", "metrics")


def _parts_uniform(con: duckdb.DuckDBPyConnection) -> dict[str, bool]:
    """Per table of :data:`_SUBSET_TABLES`, whether the store's view found its parts all of the
    schema's columns (then any of them read alike without union_by_name); False where not told."""
    try:
        row = con.execute(f"SELECT {', '.join(f'{t}_uniform' for t in _SUBSET_TABLES)} FROM store_parts").fetchone()
    except duckdb.Error:
        return {}
    return {t: bool(v) for t, v in zip(_SUBSET_TABLES, row or (), strict=False)}


def subset_views(con: duckdb.DuckDBPyConnection, schema: str, root: Path, spans: list[Path],
                 metrics: list[Path], summed: set[Path]) -> None:
    """Views ``spans``, ``step_sums``, ``spans_unsummed`` and ``metrics`` in ``schema``, read as the
    store's views of the run at ``root`` read them, over these spans and metrics files of it only
    (parts and compacted files alike), each spans file's twin read where it is in ``summed`` (the
    twins the store's ``step_sums`` reads): what an analysis that needs some steps only reads,
    under ``SET search_path`` (the analysis' cache extending itself by the files that may hold its
    new steps)."""
    compacted_dir = os.path.join(os.path.abspath(root), layout.COMPACTED_DIR, "")
    uniform = _parts_uniform(con)

    def body(table: str, files: list[Path]) -> str:
        merged = [f for f in files if os.path.abspath(f).startswith(compacted_dir)]
        parts = [f for f in files if not os.path.abspath(f).startswith(compacted_dir)]
        selects = []
        if parts:
            selects.append(_select(con, table, _list_sql(parts), _read_options(table, uniform=uniform.get(table, False))))
        if merged:
            selects.append(_select(con, table, _list_sql(merged), _COMPACTED_OPTIONS))
        return " UNION ALL ".join(selects) or _empty_select(table)

    twins = {f: layout.sums_twin(f) for f in spans}
    read = [twins[f] for f in spans if twins[f] in summed]
    unsummed = [f for f in spans if twins[f] not in summed]
    con.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
    con.execute(f"CREATE OR REPLACE VIEW {schema}.spans AS {body('spans', spans)}")
    con.execute(f"CREATE OR REPLACE VIEW {schema}.{UNSUMMED_VIEW} AS {body('spans', unsummed)}")
    sums = (f"SELECT * FROM read_parquet({_list_sql(read)}, hive_partitioning=false)" if read
            else _empty_select(SUMS_VIEW))
    con.execute(f"CREATE OR REPLACE VIEW {schema}.{SUMS_VIEW} AS {sums}")
    con.execute(f"CREATE OR REPLACE VIEW {schema}.metrics AS {body('metrics', metrics)}")


@dataclass
class _Compaction:
    """What the committed compaction manifests of one table say: files to read, parts to skip."""

    files: list[Path]
    ranks: dict[Path, tuple[tuple[int, int], ...]]
    ignored: frozenset[str]  # absolute paths, as strings (cheap to build for 100k replaced parts)


def _compaction(run: Run, table: str) -> _Compaction:
    manifests, problems = layout.read_manifests(run.path, table)
    files: list[Path] = []
    ranks: dict[Path, tuple[tuple[int, int], ...]] = {}
    ignored: set[str] = set()
    superseded: set[str] | None = None  # manifests replaced since they were read (read on demand)
    active = layout.active_manifests(manifests)
    # A compacted file is never rewritten: one found good is read again only where it is gone.
    named = [run.path / f.path for m in active if m.run_id in (None, run.meta.run_id) for f in m.files]
    good = run.per_file(f"compacted_good:{table}", named,
                        lambda paths: {p: True for p in paths if _check_part(p, table, run.meta.run_id) is None})
    for m in active:
        if m.run_id is not None and m.run_id != run.meta.run_id:
            problems.append(f"{m.path}: a compaction manifest of another run ({m.run_id!r}, not "
                            f"{run.meta.run_id!r}); ignored")
            continue
        for f in m.files:
            path = run.path / f.path
            problem = None if path in good and os.path.lexists(path) else _check_part(path, table, run.meta.run_id)
            if problem is not None:
                if not os.path.lexists(path):
                    # A later pass may have merged this manifest's files again and removed them
                    # since the manifests were read: then its manifest is replaced (or already
                    # removed itself), not broken.
                    if not m.path.exists():
                        continue
                    if superseded is None:
                        superseded = {rel for later in layout.read_manifests(run.path, table)[0]
                                      for rel in later.replaces}
                    if m.name in superseded:
                        continue
                problems.append(problem)
                continue
            files.append(path)
            ranks[path] = f.ranks
        if table not in layout.SINGLE_FILE_TABLES:
            # Single files (ranks, groups) are rewritten in place by writers: a file present wins
            # over its merged rows (see _create_table_view), it is never skipped by name.
            root = f"{run.path}/"
            ignored.update(root + rel for rel in m.replaces)
    for problem in problems:
        if problem not in run.problems:
            run.problems.append(problem)
            log.info(problem)  # reported through Run.problems (the CLI prints each once)
    return _Compaction(sorted(files), ranks, frozenset(ignored))


def _create_table_views(run: Run, tables: Iterable[str] = TABLES) -> None:
    run._compacted_ranks = {}
    for table in tables:
        compaction = _compaction(run, table)
        run.compacted[table] = compaction.files
        run._compacted_ranks.update(compaction.ranks)
        try:
            _create_table_view(run, table, _scan(run, table, ignored=compaction.ignored), compaction.files)
        except duckdb.Error:
            # A part whose footer DuckDB cannot parse though the quick checks passed: find it, skip it.
            run._stamped.pop(table, None)
            try:
                _create_table_view(run, table, _scan(run, table, thorough=True, ignored=compaction.ignored),
                                   compaction.files)
            except duckdb.Error as exc:
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise RunDirError(f"{run.path}: the {table} parts cannot be read ({reason})") from None


def _list_sql(files: list[Path]) -> str:
    return "[" + ", ".join(_sql_str(str(f)) for f in files) + "]"


def _read_options(table: str, *, uniform: bool) -> str:
    hive = _HIVE_TYPES.get(table)
    options = f", hive_partitioning=true, hive_types={{'{hive}': INTEGER}}" if hive else ", hive_partitioning=false"
    if not uniform:
        options += ", union_by_name=true"
    return options


# Compacted files carry every column of the schema (rank too); they sit in no partition directory.
_COMPACTED_OPTIONS = ", hive_partitioning=false, union_by_name=true"


def _empty_select(table: str) -> str:
    # A typed empty relation in SQL, not a registered Arrow table: registrations are local to
    # one connection, and cursors (one per thread) must see every view.
    fields = STEP_SUMS if table == SUMS_VIEW else TABLES[table]
    nulls = ", ".join(f'CAST(NULL AS {_DUCK_TYPES[str(f.type)]}) AS "{f.name}"' for f in fields)
    return f"SELECT {nulls} WHERE false"


def _select(con: duckdb.DuckDBPyConnection, table: str, source: str, options: str) -> str:
    """``SELECT`` of ``read_parquet(source options)`` with the schema's columns in order, each cast
    to its declared type, so that a writer's older file or a missing nullable column still reads as
    the schema says."""
    described = {name for name, *_ in con.execute(f"DESCRIBE SELECT * FROM read_parquet({source}{options})").fetchall()}
    casts = []
    for f in TABLES[table]:
        duck_type = _DUCK_TYPES[str(f.type)]
        if table == "ranks" and f.name == "coords":
            casts.append(f'{_coords_select(described, duck_type)} AS "coords"')
        elif f.name in described:
            casts.append(f'CAST("{f.name}" AS {duck_type}) AS "{f.name}"')
        else:
            casts.append(f'CAST(NULL AS {duck_type}) AS "{f.name}"')
    return f"SELECT {', '.join(casts)} FROM read_parquet({source}{options})"


def _coords_select(described: set[str], duck_type: str) -> str:
    """``ranks.coords`` as schema 2 has it, from schema 1's columns ``pp``, ``dp``, ``tp`` where
    the files have those (a null column is an axis left out), from ``coords`` where they have that."""
    legacy = [c for c in RANKS_V1_COORD_COLUMNS if c in described]
    if not legacy:
        return f'CAST({"coords" if "coords" in described else "NULL"} AS {duck_type})'
    entries = ", ".join(f"{{'key': '{c}', 'value': CAST(\"{c}\" AS INTEGER)}}" for c in legacy)
    folded = f"CAST(map_from_entries(list_filter([{entries}], lambda e: e.value IS NOT NULL)) AS {duck_type})"
    return f"coalesce(CAST(coords AS {duck_type}), {folded})" if "coords" in described else folded


def _create_table_view(run: Run, table: str, parts: _Parts, compacted: list[Path] | None = None) -> None:
    compacted = compacted or []
    files = parts.files
    run._uniform[table] = parts.uniform
    run.files[table] = files + compacted
    selects = []
    if files:
        # Read through the glob when every part is good (new parts of a live run then show up without
        # a refresh, and the view stays small at 100k+ files); through the list of good parts otherwise.
        source = _sql_str(str(run.path / layout.table_glob(table))) if parts.whole else _list_sql(files)
        selects.append(_select(run.con, table, source, _read_options(table, uniform=parts.uniform)))
    if compacted:
        merged = _select(run.con, table, _list_sql(compacted), _COMPACTED_OPTIONS)
        if files and table in layout.SINGLE_FILE_TABLES:
            # A rank's file present beside the merged rows (rewritten since, or not yet removed)
            # is the current one: its rank's merged rows step aside.
            merged = f"SELECT * FROM ({merged}) WHERE rank NOT IN (SELECT rank FROM ({selects[0]}))"
        selects.append(merged)
    body = " UNION ALL ".join(selects) if selects else _empty_select(table)
    run.con.execute(f"CREATE OR REPLACE VIEW {table} AS {body}")


_DUCK_TYPES = {
    "int32": "INTEGER",
    "int64": "BIGINT",
    "string": "VARCHAR",
    "double": "DOUBLE",
    "bool": "BOOLEAN",
    "list<item: int32>": "INTEGER[]",
    "map<string, int32>": "MAP(VARCHAR, INTEGER)",
}


def _missing_ranks(run: Run) -> None:
    if not run.files.get("spans") and not run.files.get("markers"):
        return
    world = run.meta.world_size
    if run.ranks_written(("spans", "markers")) >= set(range(world)):
        return  # every rank has files (part directories, compacted files' rank ranges): no scan
    seen = {
        r
        for (r,) in run.con.execute(
            "SELECT DISTINCT rank FROM spans UNION SELECT DISTINCT rank FROM markers"
        ).fetchall()
    }
    missing = sorted(set(range(world)) - seen)
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
        problem = f"{run.path}: {len(missing)} of {world} ranks wrote no spans or markers: {shown}"
        run.problems.append(problem)
        log.info(problem)  # reported through Run.problems (the CLI prints each once)


def open_run(path: Path | str, *, threads: int | None = None, memory_limit: str | None = None,
             tables: tuple[str, ...] | None = None) -> Run:
    """Open ``path`` as a run: validate ``run.json``, create one DuckDB view per table.

    ``tables``: views of these tables only (``("ranks",)`` for a live viewer that needs the ranks'
    places: opening every table of a big live run lists and checks hundreds of thousands of parts);
    such a run answers queries on them alone."""
    path = Path(path)
    if not path.exists():
        raise RunDirError(f"{path}: no such run directory")
    if not path.is_dir():
        raise RunDirError(f"{path}: not a directory")
    has_meta = (path / layout.RUN_JSON).exists()
    if not has_meta:
        any_part = any(any(path.glob(layout.table_glob(t))) or any(path.glob(layout.compacted_glob(t))) for t in TABLES)
        if not any_part:
            raise RunDirError(f"{path}: not a megascope run directory (no run.json and no data)")
        raise RunDirError(f"{path / layout.RUN_JSON}: missing, though the directory holds data; was the run copied whole?")
    meta = read_meta(path)
    config: dict[str, str | bool | int | float | list[str]] = {}
    if threads:
        config["threads"] = threads
    if memory_limit:
        config["memory_limit"] = memory_limit
    con = duckdb.connect(config=config)
    # No progress bar: DuckDB draws it on stdout, where `--json` output goes.
    con.execute("SET enable_progress_bar = false")
    run = Run(path=path, meta=meta, con=con)
    if tables is not None:
        unknown = sorted(set(tables) - set(TABLES))
        if unknown:
            raise ValueError(f"unknown tables {unknown} (known: {', '.join(TABLES)})")
        _create_table_views(run, tables)
        return run
    _create_views(run)
    if not any(run.files.values()):
        problem = f"{path}: run.json present but no data written yet"
        run.problems.append(problem)
        log.info(problem)  # reported through Run.problems (the CLI prints each once)
    _missing_ranks(run)
    return run
