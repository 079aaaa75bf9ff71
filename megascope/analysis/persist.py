"""Keep the analysis' base tables beside the run, so that a second report, a restarted dashboard
or another process reuses them instead of scanning every span again.

Role in the data flow: :func:`megascope.analysis.base.prepare` asks :func:`load` before building
the base tables and :func:`save` after; everything else reads ``ms_cache`` as before. Layout::

    RUN/_cache/key.json                  what the tables were built from, each file's size and sha256
    RUN/_cache/<table>-<key>.parquet     rank_info, group_kind, clock_offsets, rank_clock, inst, rank_step

The key is a digest of what the base tables are built from, as the store reads it: every file the
views ``spans``, ``step_sums``, ``metrics``, ``ranks`` and ``groups`` name or glob (path relative to the run,
size, modification time), the definitions of ``ranks`` and ``groups`` (paths made relative),
``run.json``, and the code that builds the tables and the views (``sql/base.sql``, ``base.py``,
the store's module and :data:`CACHE_VERSION`). New markers or
heartbeats leave it as it is. A new part, a
part rewritten or removed (compaction), a moved-but-intact run (``cp -a``, ``rsync -a``) keep or
change the key as they should. The growing tables' views (spans, step_sums, metrics) enter by
their files alone: a compaction pass reshapes them (compacted files beside the parts) and keeps
every row, so a cache whose parts were merged since is extended, not rebuilt (:func:`appended`).

Never a wrong answer, never a failed report:

* a key that differs, a file missing, of another size or another sha256, a table of other columns
  or types, any error reading it: the cache is ignored and the tables are built from the parts;
* a run directory that cannot be written (read-only, full): the tables stay in memory, silently;
* files are written under hidden temporary names and renamed, ``key.json`` last; a reader sees the
  old cache, the new one, or none.

Writing the cache can go on beside the analysis (:func:`save_later`, what ``report`` does): one
writer thread with a cursor of its own writes the base tables, then the extras and memos asked for
meanwhile, in that order (each extra copied aside first, so that the analysis may drop or replace
its table at once). Until it is done a reader of this process finds no extra for the new key (there
is none yet) and computes it; :func:`wait_saves` returns when everything asked for is written.

``_cache`` matches no table's glob (``spans/rank=*/*.parquet`` ...) and starts with ``_``, which
Hive-style readers (pyarrow datasets, Spark) skip. Deleting it is always safe.

Example::

    from megascope.analysis import persist
    persist.cache_dir(run.path)      # RUN/_cache
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import duckdb

from megascope import layout
from megascope.analysis import _sql

log = logging.getLogger(__name__)

CACHE_DIR = "_cache"
KEY_FILE = "key.json"
# Bump when the meaning of a persisted table changes in a way base.sql's text does not show
# (2: the what-if replay's events and memos hold asynchronous calls' waits).
CACHE_VERSION = 2
# Temporary files of a writer that died are removed once they are this old.
_STALE_TMP_S = 3600.0
_LITERAL = re.compile(r"'((?:[^']|'')*)'")


def cache_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CACHE_DIR


def run_dir(con: duckdb.DuckDBPyConnection) -> Path | None:
    """The run directory behind ``con``: the directory holding ``run.json`` above the files the
    store's views read, or None (no views over files, e.g. a run without data)."""
    try:
        views = _views(con)
    except duckdb.Error:
        return None
    for _, sql in views:
        for match in _LITERAL.finditer(sql):
            literal = match.group(1).replace("''", "'")
            if not _is_path(literal):
                continue
            for parent in Path(os.path.abspath(literal)).parents:
                if (parent / "run.json").is_file():
                    return parent
            return None
    return None


def _code_digest() -> str:
    """The code that builds the base tables: its SQL and the Python around it (clock estimation),
    and the store's, which makes the views they read (how a file's rows read)."""
    package = resources.files("megascope.analysis")
    text = (package.joinpath("sql", "base.sql").read_text() + package.joinpath("base.py").read_text()
            + resources.files("megascope").joinpath("store.py").read_text())
    return hashlib.sha256(f"{CACHE_VERSION}\n{text}".encode()).hexdigest()


# The store's views the base tables are built from (markers, heartbeats and diagnostics are not:
# a marker agent's new part leaves them as they are).
# step_sums: the spans files' sums, read in their place (spans_unsummed, the other spans files, is
# told by the two).
SOURCE_VIEWS = ("groups", "metrics", "ranks", "spans", "step_sums")


def _views(con: duckdb.DuckDBPyConnection, names: tuple[str, ...] = SOURCE_VIEWS) -> list[tuple[str, str]]:
    return [(str(n), str(s)) for n, s in con.execute(
        "SELECT view_name, sql FROM duckdb_views() WHERE NOT internal AND schema_name = 'main' "
        "AND list_contains(?, view_name) ORDER BY view_name", [list(names)]
    ).fetchall()]


def _is_path(literal: str) -> bool:
    return literal.endswith(".parquet") and ("/" in literal or os.sep in literal)


def view_files(con: duckdb.DuckDBPyConnection, view: str) -> list[str] | None:
    """The files the store's ``view`` reads, as its definition names them; None where it names a
    glob (a run's parts: the view stays small however many there are) or no such view."""
    found = _views(con, (view,))
    if not found:
        return None
    paths = [m.group(1).replace("''", "'") for m in _LITERAL.finditer(found[0][1])]
    paths = [p for p in paths if _is_path(p)]
    if any(glob.has_magic(p) for p in paths):
        return None
    return paths


# Tables whose new parts may extend the cache instead of replacing it (a live run's growth).
GROWING_VIEWS = ("metrics", "spans", "step_sums")


@dataclass(frozen=True)
class Key:
    """What the base tables are built from: ``digest`` of all of it; ``base`` of all but the
    growing tables' file lists; ``files`` those lists (path relative to the run -> table, size,
    modification time)."""

    digest: str
    base: str
    files: dict[str, tuple[str, int, int]]


def key(con: duckdb.DuckDBPyConnection, root: Path) -> Key:
    """The key of the base tables as the store reads the run now (see the module's doc)."""
    root_abs = os.path.abspath(root)
    base = hashlib.sha256()
    base.update(_code_digest().encode())
    fixed: set[str] = set()
    growing: dict[str, str] = {}
    for name, sql in _views(con):
        found: list[str] = []

        def relative(match: re.Match[str], found: list[str] = found, name: str = name) -> str:
            literal = match.group(1).replace("''", "'")
            if not _is_path(literal):
                return match.group(0)
            found.append(os.path.abspath(literal))
            # A growing table's file list is compared file by file (Key.files), not hashed here.
            return "'<files>'" if name in GROWING_VIEWS else "'" + os.path.relpath(found[-1], root_abs) + "'"

        text = _LITERAL.sub(relative, sql)
        # A growing table's view changes its shape as the run is stored otherwise (a glob of parts,
        # a list of them while merged ones wait for removal, compacted files beside them) with the
        # same rows: it is told by its files, compared one by one, and the store's code above.
        base.update(f"view {name}\n{'<files>' if name in GROWING_VIEWS else text}\n".encode())
        for lit in found:
            for f in (glob.glob(lit) if glob.has_magic(lit) else [lit]):
                if name in GROWING_VIEWS:
                    growing[os.path.abspath(f)] = name
                else:
                    fixed.add(os.path.abspath(f))
    for f in sorted(fixed):
        base.update(f"{os.path.relpath(f, root_abs)} {_stamp(f)}\n".encode())
    try:
        base.update(b"run.json\n" + (Path(root_abs) / "run.json").read_bytes())
    except OSError:
        base.update(b"run.json missing\n")
    base_digest = base.hexdigest()
    files: dict[str, tuple[str, int, int]] = {}
    full = hashlib.sha256(base_digest.encode())
    for f in sorted(growing):
        try:
            st = os.stat(f)
            entry = (growing[f], st.st_size, st.st_mtime_ns)
        except OSError:
            entry = (growing[f], -1, -1)
        rel = os.path.relpath(f, root_abs)
        files[rel] = entry
        full.update(f"{rel} {entry}\n".encode())
    return Key(full.hexdigest(), base_digest, files)


def _stamp(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "missing"
    return f"{st.st_size} {st.st_mtime_ns}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _columns(con: duckdb.DuckDBPyConnection, table: str) -> list[list[str]]:
    return [[str(n), str(t)] for n, t in con.execute(
        "SELECT column_name, data_type FROM duckdb_columns() WHERE schema_name = ? AND table_name = ? "
        "ORDER BY column_index", [_sql.CACHE_SCHEMA, table]).fetchall()]


def _quote(path: Path) -> str:
    return "'" + str(path).replace("'", "''") + "'"


def read_meta(root: Path) -> dict[str, Any] | None:
    """The cache's ``key.json``, or None (none, unreadable, of another version)."""
    try:
        meta = json.loads((cache_dir(root) / KEY_FILE).read_text())
    except (OSError, ValueError) as exc:
        log.debug("analysis cache %s: no key (%s)", cache_dir(root), exc)
        return None
    if not isinstance(meta, dict) or meta.get("version") != CACHE_VERSION or not isinstance(meta.get("tables"), dict):
        return None
    return meta


def _checked(where: Path, entry: dict[str, Any]) -> Path:
    """The file of a ``key.json`` entry, after checking its size and sha256 (ValueError if off)."""
    path = where / str(entry["file"])
    if path.parent != where or path.stat().st_size != int(entry["bytes"]) or _sha256(path) != entry["sha256"]:
        raise ValueError(f"{path.name} does not match its key")
    return path


def load(con: duckdb.DuckDBPyConnection, root: Path, meta: dict[str, Any], tables: list[str], *,
         prefix: str = "") -> bool:
    """Fill ``ms_cache.<prefix><table>`` for each of ``tables`` from the cache ``meta`` describes,
    if every file is intact and reads as the table it recorded. All or nothing: False leaves none
    of them."""
    where = cache_dir(root)
    try:
        for table in tables:
            entry = meta["tables"][table]
            path = _checked(where, entry)
            casts = ", ".join(f'CAST("{c}" AS {t}) AS "{c}"' for c, t in entry["columns"])
            con.execute(f"CREATE OR REPLACE TABLE {_sql.CACHE_SCHEMA}.{prefix}{table} AS "
                        f"SELECT {casts} FROM read_parquet({_quote(path)})")
            row = _sql.first(con.execute(f"SELECT count(*) FROM {_sql.CACHE_SCHEMA}.{prefix}{table}"))
            if not row or int(row[0]) != int(entry["rows"]) or _columns(con, prefix + table) != entry["columns"]:
                raise ValueError(f"{path.name} is not the table its key describes")
    except (OSError, ValueError, KeyError, TypeError, duckdb.Error) as exc:
        log.info("analysis cache %s unusable (%s); rebuilding", where, exc)
        drop(con, tables, prefix=prefix)
        return False
    return True


@dataclass(frozen=True)
class Growth:
    """What :func:`appended` found: the new files by table (absolute paths), and the step range
    (lowest, highest) of each file the cache was built from, by path relative to the run, where
    its file list kept one."""

    new: dict[str, list[str]]
    ranges: dict[str, tuple[int, int]]


def appended(con: duckdb.DuckDBPyConnection, root: Path, meta: dict[str, Any],
             now: Key) -> Growth | None:
    """The growing tables' files that are new since the cache ``meta`` describes was built, by
    table (absolute paths), when that is all that changed: the same code, ``run.json``, ranks and
    groups, and every file it was built from still there as it was, or merged by a committed
    compaction into files holding only such rows (:func:`_merged`: those are not new). None
    otherwise."""
    if meta.get("base_key") != now.base or meta.get("key") == now.digest:
        return None
    try:
        manifest = _checked(cache_dir(root), meta["files"])
        listed = con.execute(f'SELECT path, "table", bytes, mtime_ns, step_lo, step_hi '
                             f'FROM read_parquet({_quote(manifest)})').fetchall()
        old = {str(path): (str(table), int(size), int(mtime)) for path, table, size, mtime, _, _ in listed}
        ranges = {str(path): (int(lo), int(hi)) for path, _, _, _, lo, hi in listed if lo is not None and hi is not None}
    except (OSError, ValueError, KeyError, TypeError, duckdb.Error) as exc:
        log.info("analysis cache %s: no file list (%s)", cache_dir(root), exc)
        return None
    if any(path in now.files and now.files[path] != tuple(entry) for path, entry in old.items()):
        return None
    gone = {path for path in old if path not in now.files}
    moved = _merged(root, set(old), gone, now) if gone else set()
    if moved is None:
        return None
    new: dict[str, list[str]] = {}
    for path, (table, _, _) in now.files.items():
        if path not in old and path not in moved:
            new.setdefault(table, []).append(str(Path(os.path.abspath(root)) / path))
    return Growth(new, {path: r for path, r in ranges.items() if path in now.files})


# The growing tables a compaction pass merges (step_sums follow their spans files).
_MERGED_TABLES = ("spans", "metrics")


def _merged(root: Path, old: set[str], gone: set[str], now: Key) -> set[str] | None:
    """The files of ``now`` that hold only rows the cache was built from, where every file of
    ``old`` that is ``gone`` was merged by a committed compaction into them (with their step sums);
    None where one was not, or a compaction merged a file the cache never saw into one of them (its
    rows are partly new: the tables are built again).

    A pass keeps each row (docs/run-directory.md, "Compaction"): the rows are where they were, in
    other files; a dashboard refreshing every few seconds sees each part well before a pass merges
    it."""
    explained: set[str] = set()
    moved: set[str] = set()
    for table in _MERGED_TABLES:
        manifests, _ = layout.read_manifests(root, table)
        # A pass that merges a compacted file again names, beside it, the parts the earlier pass
        # replaced and left for readers: their rows are in that file, which the cache holds.
        held = {rel for m in manifests if m.files and all(f.path in old for f in m.files)
                for rel in m.replaces}
        for manifest in layout.active_manifests(manifests):
            merged = [rel for rel in manifest.replaces if rel.endswith(".parquet")]
            if not any(rel in old for rel in merged):
                continue  # merged nothing the cache holds: its files are new, or were counted before
            if any((rel not in old and rel not in held) or rel in now.files for rel in merged):
                return None
            for rel in merged:
                explained.add(rel)
                if table == "spans":
                    explained.add(_twin(root, rel))
            for f in manifest.files:
                if f.path not in now.files:
                    return None
                moved.add(f.path)
                if table == "spans":
                    moved.add(_twin(root, f.path))
    return moved if gone <= explained else None


def _twin(root: Path, rel: str) -> str:
    """The step sums twin of the spans file ``rel`` (both relative to the run); ``rel`` itself
    where it is a twin already (a spans manifest names the twins it replaces too)."""
    root_abs = os.path.abspath(root)
    try:
        return os.path.relpath(layout.sums_twin(os.path.join(root_abs, rel)), root_abs)
    except ValueError:
        return rel


def drop(con: duckdb.DuckDBPyConnection, tables: list[str], *, prefix: str = "") -> None:
    for table in tables:
        with contextlib.suppress(duckdb.Error):
            con.execute(f"DROP TABLE IF EXISTS {_sql.CACHE_SCHEMA}.{prefix}{table}")


def save(con: duckdb.DuckDBPyConnection, root: Path, now: Key, tables: list[str],
         params: dict[str, Any] | None = None, ranges: dict[str, tuple[int, int]] | None = None) -> bool:
    """Write ``ms_cache.<table>`` for each of ``tables`` under ``RUN/_cache`` for key ``now``, with
    the build's ``params`` (compared by a later extension) and, in its file list, the step range of
    each file where ``ranges`` (path relative to the run -> lowest, highest step) has it. Returns
    whether it did; any failure (a read-only run, a full disk) leaves the run as it was, but for
    temporary files it could not remove."""
    where = cache_dir(root)
    tag = uuid.uuid4().hex[:12]
    suffix = now.digest[:16]
    staged: dict[Path, Path] = {}  # temporary -> final
    try:
        where.mkdir(exist_ok=True)
        entries: dict[str, Any] = {}
        for table in tables:
            tmp = where / f".tmp-{tag}-{table}.parquet"
            staged[tmp] = where / f"{table}-{suffix}.parquet"
            con.execute(f"COPY {_sql.CACHE_SCHEMA}.{table} TO {_quote(tmp)} (FORMAT parquet)")
            row = _sql.first(con.execute(f"SELECT count(*) FROM {_sql.CACHE_SCHEMA}.{table}"))
            entries[table] = {"file": staged[tmp].name, "bytes": tmp.stat().st_size, "sha256": _sha256(tmp),
                              "rows": int(row[0]) if row else 0, "columns": _columns(con, table)}
        tmp = where / f".tmp-{tag}-files.parquet"
        staged[tmp] = where / f"files-{suffix}.parquet"
        paths = sorted(now.files)
        known = ranges or {}
        # Written by DuckDB, not pyarrow: a report then never loads pyarrow's Parquet module.
        con.execute('COPY (SELECT unnest(?::VARCHAR[]) AS path, unnest(?::VARCHAR[]) AS "table", '
                    "unnest(?::BIGINT[]) AS bytes, unnest(?::BIGINT[]) AS mtime_ns, unnest(?::BIGINT[]) AS step_lo, "
                    f"unnest(?::BIGINT[]) AS step_hi) TO {_quote(tmp)} (FORMAT parquet, COMPRESSION zstd)",
                    [paths, [now.files[p][0] for p in paths], [now.files[p][1] for p in paths],
                     [now.files[p][2] for p in paths], [known[p][0] if p in known else None for p in paths],
                     [known[p][1] if p in known else None for p in paths]])
        files_entry: dict[str, Any] = {"file": staged[tmp].name, "bytes": tmp.stat().st_size, "sha256": _sha256(tmp)}
        for tmp, final in list(staged.items()):
            os.replace(tmp, final)
            del staged[tmp]
        key_tmp = where / f".tmp-{tag}-{KEY_FILE}"
        staged[key_tmp] = where / KEY_FILE
        key_tmp.write_text(json.dumps({"version": CACHE_VERSION, "key": now.digest, "base_key": now.base,
                                       "written_ns": time.time_ns(), "params": params or {},
                                       "files": files_entry, "tables": entries}, indent=1))
        os.replace(key_tmp, where / KEY_FILE)
    except (OSError, duckdb.Error) as exc:
        log.info("analysis cache not written to %s (%s); kept in memory", where, exc)
        for tmp in staged:
            with contextlib.suppress(OSError):
                tmp.unlink()
        return False
    _prune(where, {e["file"] for e in entries.values()} | {files_entry["file"], KEY_FILE})
    return True


def _prune(where: Path, keep: set[str]) -> None:
    """Remove the cache's files of earlier keys (and temporary files of writers long gone)."""
    now = time.time()
    try:
        entries = list(os.scandir(where))
    except OSError:
        return
    for entry in entries:
        if entry.name in keep or not entry.is_file():
            continue
        with contextlib.suppress(OSError):
            if entry.name.startswith(".tmp-") and now - entry.stat().st_mtime < _STALE_TMP_S:
                continue  # another process may be writing it now
            os.unlink(entry.path)


# Derived tables beyond the base ones (e.g. the what-if replay's sampled spans) kept under the same
# key: ``key.json`` lists them under "extra"; a new key drops them with the rest.
_KEPT = "cache_source"


def remember(con: duckdb.DuckDBPyConnection, root: Path | None, digest: str | None) -> None:
    """Note, for the analyses after :func:`megascope.analysis.base.prepare`, which cache (run
    directory and key) the base tables in ``ms_cache`` stand for."""
    con.execute(f"CREATE OR REPLACE TABLE {_sql.CACHE_SCHEMA}.{_KEPT} AS SELECT ?::VARCHAR AS root, ?::VARCHAR AS key",
                [str(root) if root is not None else None, digest])


def forget(con: duckdb.DuckDBPyConnection) -> None:
    """Note that the base tables in ``ms_cache`` stand for no cache (they are being rebuilt)."""
    remember(con, None, None)


def holds(con: duckdb.DuckDBPyConnection, root: Path, meta: dict[str, Any]) -> bool:
    """Whether the base tables in ``ms_cache`` are those of the cache ``meta`` of run ``root``:
    built, extended or read for its key in this process, and not touched since."""
    source = _source(con)
    return source is not None and source == (Path(root), meta.get("key"))


def _source(con: duckdb.DuckDBPyConnection) -> tuple[Path, str] | None:
    try:
        row = _sql.first(con.execute(f"SELECT root, key FROM {_sql.CACHE_SCHEMA}.{_KEPT}"))
    except duckdb.Error:
        return None
    return (Path(row[0]), str(row[1])) if row and row[0] and row[1] else None


# Saves going on beside the analysis: (run directory, key) -> the last job asked for it. One
# writer thread runs them in the order they were asked for.
_pending: dict[tuple[str, str], Future[Any]] = {}
_pending_lock = threading.Lock()
_writer: ThreadPoolExecutor | None = None


def _in_flight(source: tuple[Path, str]) -> bool:
    with _pending_lock:
        job = _pending.get((str(source[0]), source[1]))
    return job is not None and not job.done()


def _queue(con: duckdb.DuckDBPyConnection, key: tuple[str, str],
           job: Callable[[duckdb.DuckDBPyConnection], Any]) -> None:
    """Run ``job`` on the cache's writer thread with a cursor of its own (closed when it is done),
    as the last job of ``key``. Called with ``_pending_lock`` held."""
    global _writer
    cursor = con.cursor()

    def run() -> Any:
        try:
            return job(cursor)
        finally:
            cursor.close()

    if _writer is None:
        _writer = ThreadPoolExecutor(1, thread_name_prefix="megascope-cache")
    _pending[key] = _writer.submit(run)


def _after_save(con: duckdb.DuckDBPyConnection, source: tuple[Path, str],
                job: Callable[[duckdb.DuckDBPyConnection], Any]) -> bool:
    """Queue ``job`` behind the save of ``source`` still going on (True), or tell the caller to run
    it now (False)."""
    key = (str(source[0]), source[1])
    with _pending_lock:
        last = _pending.get(key)
        if last is None or last.done():
            return False
        _queue(con, key, job)
    return True


def save_later(con: duckdb.DuckDBPyConnection, root: Path, now: Key, tables: list[str],
               params: dict[str, Any] | None = None, ranges: dict[str, tuple[int, int]] | None = None) -> None:
    """:func:`save`, on the cache's writer thread: the caller goes on at once. Whatever the tables
    become meanwhile, the files hold them as they were (the analysis does not change a base table
    once built). :func:`wait_saves` waits for it."""
    with _pending_lock:
        _queue(con, (str(root), now.digest), lambda cursor: save(cursor, root, now, tables, params, ranges))


def wait_saves() -> None:
    """Return once every save asked for by :func:`save_later`, and everything queued behind it
    before this call, is written (or has failed, which the job logs)."""
    with _pending_lock:
        jobs = list(_pending.values())
    for job in jobs:
        with contextlib.suppress(Exception):  # each job logs its own failure
            job.result()
    with _pending_lock:
        for key, job in list(_pending.items()):
            if job.done():
                del _pending[key]


def load_extra(con: duckdb.DuckDBPyConnection, name: str, *, table: str | None = None) -> bool:
    """Fill ``ms_cache.<table>`` (default ``name``) from what :func:`save_extra` kept as ``name``
    for the current key."""
    source = _source(con)
    if source is None or _in_flight(source):  # a key being written has no extras yet
        return False
    root, digest = source
    meta = read_meta(root)
    extra = meta.get("extra") if meta is not None and meta.get("key") == digest else None
    if not isinstance(extra, dict) or name not in extra:
        return False
    target = table or name
    return load(con, root, {"tables": {target: extra[name]}}, [target])


def save_extra(con: duckdb.DuckDBPyConnection, name: str, *, table: str | None = None) -> bool:
    """Keep ``ms_cache.<table>`` (default ``name``) in the cache as ``name`` under the current key
    (if the run can be written and the cache is still the one the base tables came from). While
    the key's tables are still being written, a copy of the table is written after them."""
    source = _source(con)
    if source is None:
        return False
    table = table or name
    if not _in_flight(source):
        return _write_extra(con, source, name, table, table)
    aside = f"_aside_{uuid.uuid4().hex[:12]}"
    try:
        con.execute(f"CREATE TABLE {_sql.CACHE_SCHEMA}.{aside} AS SELECT * FROM {_sql.CACHE_SCHEMA}.{table}")
    except duckdb.Error as exc:
        log.info("analysis cache: %s not kept (%s)", table, exc)
        return False

    def later(cursor: duckdb.DuckDBPyConnection) -> bool:
        try:
            return _write_extra(cursor, source, name, aside, table)
        finally:
            with contextlib.suppress(duckdb.Error):
                cursor.execute(f"DROP TABLE IF EXISTS {_sql.CACHE_SCHEMA}.{aside}")

    if _after_save(con, source, later):
        return True
    return later(con)


def _write_extra(con: duckdb.DuckDBPyConnection, source: tuple[Path, str], name: str, table: str,
                 shown: str) -> bool:
    root, digest = source
    where = cache_dir(root)
    tag = uuid.uuid4().hex[:12]
    tmp = where / f".tmp-{tag}-{name}.parquet"
    key_tmp = where / f".tmp-{tag}-{KEY_FILE}"
    try:
        meta = read_meta(root)
        if meta is None or meta.get("key") != digest:
            return False
        con.execute(f"COPY {_sql.CACHE_SCHEMA}.{table} TO {_quote(tmp)} (FORMAT parquet)")
        row = _sql.first(con.execute(f"SELECT count(*) FROM {_sql.CACHE_SCHEMA}.{table}"))
        final = where / f"{name}-{digest[:16]}.parquet"
        entry = {"file": final.name, "bytes": tmp.stat().st_size, "sha256": _sha256(tmp),
                 "rows": int(row[0]) if row else 0, "columns": _columns(con, table)}
        os.replace(tmp, final)
        meta.setdefault("extra", {})[name] = entry
        key_tmp.write_text(json.dumps(meta, indent=1))
        os.replace(key_tmp, where / KEY_FILE)
    except (OSError, duckdb.Error) as exc:
        log.info("analysis cache: %s not kept (%s)", shown, exc)
        for path in (tmp, key_tmp):
            with contextlib.suppress(OSError):
                path.unlink()
        return False
    return True


def memo_get(con: duckdb.DuckDBPyConnection, name: str) -> Any:
    """A small JSON value kept under the current key by :func:`memo_put`, or None."""
    source = _source(con)
    if source is None or _in_flight(source):  # a key being written has no memos yet
        return None
    meta = read_meta(source[0])
    if meta is None or meta.get("key") != source[1]:
        return None
    memo = meta.get("memo")
    return memo.get(name) if isinstance(memo, dict) else None


def memo_put(con: duckdb.DuckDBPyConnection, name: str, value: Any, *, before: int | None = None) -> bool:
    """Keep ``value`` (plain JSON) in ``key.json`` under the current key: a result derived from the
    base tables alone that costs more than reading it back (the what-if replay). While the key's
    tables are still being written, it is kept after them. ``before``: the value was read from
    steps before this one only, so an extension from this step or a later one keeps it
    (:func:`carry_memos`)."""
    source = _source(con)
    if source is None:
        return False
    if _after_save(con, source, lambda _cursor: _write_memo(source, name, value, before)):
        return True
    return _write_memo(source, name, value, before)


def carry_memos(con: duckdb.DuckDBPyConnection, old: dict[str, Any], first: int) -> None:
    """Keep under the current key the memos of the cache ``old`` (the one an extension from step
    ``first`` started from) that were read from steps before ``first`` only: the extension left
    those steps' rows as they were."""
    memos, bounds = old.get("memo"), old.get("memo_before")
    if not isinstance(memos, dict) or not isinstance(bounds, dict):
        return
    for name, value in memos.items():
        bound = bounds.get(name)
        if isinstance(bound, int) and bound <= first:
            memo_put(con, name, value, before=bound)


def _write_memo(source: tuple[Path, str], name: str, value: Any, before: int | None = None) -> bool:
    root, digest = source
    key_tmp = cache_dir(root) / f".tmp-{uuid.uuid4().hex[:12]}-{KEY_FILE}"
    try:
        meta = read_meta(root)
        if meta is None or meta.get("key") != digest:
            return False
        meta.setdefault("memo", {})[name] = value
        if before is not None:
            meta.setdefault("memo_before", {})[name] = int(before)
        key_tmp.write_text(json.dumps(meta, indent=1))
        os.replace(key_tmp, cache_dir(root) / KEY_FILE)
    except (OSError, TypeError, ValueError) as exc:
        log.info("analysis cache: %s not kept (%s)", name, exc)
        with contextlib.suppress(OSError):
            key_tmp.unlink()
        return False
    return True
