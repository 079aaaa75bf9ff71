"""Keep the analysis' base tables beside the run, so that a second report, a restarted dashboard
or another process reuses them instead of scanning every span again.

Role in the data flow: :func:`megascope.analysis.base.prepare` asks :func:`load` before building
the base tables and :func:`save` after; everything else reads ``ms_cache`` as before. Layout::

    RUN/_cache/key.json                  what the tables were built from, each file's size and sha256
    RUN/_cache/<table>-<key>.parquet     rank_info, clock_offsets, rank_clock, inst, rank_step

The key is a digest of what the store's views read: every file they name or glob (path relative
to the run, size, modification time), the views' definitions (paths made relative), ``run.json``,
and the code that builds the tables (``sql/base.sql`` and :data:`CACHE_VERSION`). A new part, a
part rewritten or removed (compaction), a moved-but-intact run (``cp -a``, ``rsync -a``) keep or
change the key as they should.

Never a wrong answer, never a failed report:

* a key that differs, a file missing, of another size or another sha256, a table of other columns
  or types, any error reading it: the cache is ignored and the tables are built from the parts;
* a run directory that cannot be written (read-only, full): the tables stay in memory, silently;
* files are written under hidden temporary names and renamed, ``key.json`` last; a reader sees the
  old cache, the new one, or none.

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
import time
import uuid
from importlib import resources
from pathlib import Path
from typing import Any

import duckdb

from megascope.analysis import _sql

log = logging.getLogger(__name__)

CACHE_DIR = "_cache"
KEY_FILE = "key.json"
# Bump when the meaning of a persisted table changes in a way base.sql's text does not show.
CACHE_VERSION = 1
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
    text = resources.files("megascope.analysis").joinpath("sql", "base.sql").read_text()
    return hashlib.sha256(f"{CACHE_VERSION}\n{text}".encode()).hexdigest()


def _views(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str]]:
    return [(str(n), str(s)) for n, s in con.execute(
        "SELECT view_name, sql FROM duckdb_views() WHERE NOT internal AND schema_name = 'main' "
        "AND view_name <> 'store_parts' ORDER BY view_name"
    ).fetchall()]


def _is_path(literal: str) -> bool:
    return literal.endswith(".parquet") and ("/" in literal or os.sep in literal)


def key(con: duckdb.DuckDBPyConnection, root: Path) -> str:
    """The digest of everything the base tables are built from (see the module's doc)."""
    root_abs = os.path.abspath(root)
    digest = hashlib.sha256()
    digest.update(_code_digest().encode())
    files: set[str] = set()
    for name, sql in _views(con):
        literals = [m.replace("''", "'") for m in _LITERAL.findall(sql)]
        relative = sql
        for lit in literals:
            if not _is_path(lit):
                continue
            absolute = os.path.abspath(lit)
            relative = relative.replace(lit.replace("'", "''"), os.path.relpath(absolute, root_abs))
            if glob.has_magic(lit):
                files.update(os.path.abspath(f) for f in glob.glob(absolute))
            else:
                files.add(absolute)
        digest.update(f"view {name}\n{relative}\n".encode())
    for f in sorted(files):
        try:
            st = os.stat(f)
            stamp = f"{st.st_size} {st.st_mtime_ns}"
        except OSError:
            stamp = "missing"
        digest.update(f"{os.path.relpath(f, root_abs)} {stamp}\n".encode())
    try:
        digest.update(b"run.json\n" + (Path(root_abs) / "run.json").read_bytes())
    except OSError:
        digest.update(b"run.json missing\n")
    return digest.hexdigest()


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


def load(con: duckdb.DuckDBPyConnection, root: Path, digest: str, tables: list[str]) -> bool:
    """Fill ``ms_cache.<table>`` for each of ``tables`` from the cache, if it was built for
    ``digest`` and every file is intact. All or nothing: False leaves none of them loaded."""
    where = cache_dir(root)
    try:
        meta = json.loads((where / KEY_FILE).read_text())
        if not isinstance(meta, dict) or meta.get("key") != digest or meta.get("version") != CACHE_VERSION:
            return False
        entries = meta["tables"]
        for table in tables:
            entry = entries[table]
            path = where / str(entry["file"])
            if path.parent != where or path.stat().st_size != int(entry["bytes"]) or _sha256(path) != entry["sha256"]:
                log.info("analysis cache %s: %s does not match its key; rebuilding", where, path.name)
                _drop(con, tables)
                return False
            casts = ", ".join(f'CAST("{c}" AS {t}) AS "{c}"' for c, t in entry["columns"])
            con.execute(f"CREATE OR REPLACE TABLE {_sql.CACHE_SCHEMA}.{table} AS "
                        f"SELECT {casts} FROM read_parquet({_quote(path)})")
            row = _sql.first(con.execute(f"SELECT count(*) FROM {_sql.CACHE_SCHEMA}.{table}"))
            if not row or int(row[0]) != int(entry["rows"]) or _columns(con, table) != entry["columns"]:
                log.info("analysis cache %s: %s is not the table its key describes; rebuilding", where, path.name)
                _drop(con, tables)
                return False
    except (OSError, ValueError, KeyError, TypeError, duckdb.Error) as exc:
        log.info("analysis cache %s unusable (%s); rebuilding", where, exc)
        _drop(con, tables)
        return False
    return True


def _drop(con: duckdb.DuckDBPyConnection, tables: list[str]) -> None:
    for table in tables:
        with contextlib.suppress(duckdb.Error):
            con.execute(f"DROP TABLE IF EXISTS {_sql.CACHE_SCHEMA}.{table}")


def save(con: duckdb.DuckDBPyConnection, root: Path, digest: str, tables: list[str]) -> bool:
    """Write ``ms_cache.<table>`` for each of ``tables`` under ``RUN/_cache`` for ``digest``.
    Returns whether it did; any failure (a read-only run, a full disk) leaves the run as it was,
    but for temporary files it could not remove."""
    where = cache_dir(root)
    tag = uuid.uuid4().hex[:12]
    written: list[Path] = []
    try:
        where.mkdir(exist_ok=True)
        entries: dict[str, Any] = {}
        for table in tables:
            final = where / f"{table}-{digest[:16]}.parquet"
            tmp = where / f".tmp-{tag}-{table}.parquet"
            written.append(tmp)
            con.execute(f"COPY {_sql.CACHE_SCHEMA}.{table} TO {_quote(tmp)} (FORMAT parquet, COMPRESSION zstd)")
            row = _sql.first(con.execute(f"SELECT count(*) FROM {_sql.CACHE_SCHEMA}.{table}"))
            entries[table] = {"file": final.name, "bytes": tmp.stat().st_size, "sha256": _sha256(tmp),
                              "rows": int(row[0]) if row else 0, "columns": _columns(con, table)}
        for table in tables:
            tmp = where / f".tmp-{tag}-{table}.parquet"
            os.replace(tmp, where / entries[table]["file"])
            written.remove(tmp)
            written.append(where / entries[table]["file"])
        key_tmp = where / f".tmp-{tag}-{KEY_FILE}"
        written.append(key_tmp)
        key_tmp.write_text(json.dumps({"version": CACHE_VERSION, "key": digest, "written_ns": time.time_ns(),
                                       "tables": entries}, indent=1))
        os.replace(key_tmp, where / KEY_FILE)
    except (OSError, duckdb.Error) as exc:
        log.info("analysis cache not written to %s (%s); kept in memory", where, exc)
        for path in written:
            with contextlib.suppress(OSError):
                if path.name.startswith(".tmp-"):
                    path.unlink()
        return False
    _prune(where, {entries[t]["file"] for t in tables} | {KEY_FILE})
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
