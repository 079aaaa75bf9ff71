"""Load the documented SQL modules in ``sql/*.sql`` and keep their derived tables per run.

Role in the data flow: every analysis is a SQL module (``megascope/analysis/sql/NAME.sql``) plus a
thin Python function. A module is a sequence of named statements, each introduced by a header
comment and documented column by column, in the manner of a SQL standard library::

    -- @statement rank_step
    -- One row per (rank, step) ...
    -- @column own_ns  ...
    CREATE OR REPLACE TABLE ms_cache.rank_step AS ...;

Placeholders ``{{name}}`` take Python values that this package validates (numbers, identifiers
it chose); user strings never reach SQL text.

Derived tables live in the schema ``ms_cache`` of the run's DuckDB database, so every cursor of
the connection (one per dashboard thread) shares them. They are tagged with a fingerprint of the
store's view definitions: after ``Run.refresh()`` finds new parts the fingerprint changes and the
tables are rebuilt on next use.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from functools import cache
from importlib import resources
from typing import Any

import duckdb

log = logging.getLogger(__name__)

CACHE_SCHEMA = "ms_cache"
_HEADER = re.compile(r"^-- @statement\s+(\w+)\s*$", re.MULTILINE)
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
_IDENT = re.compile(r"^[A-Za-z0-9_.:]*$")
# One lock for building derived tables: two dashboard threads asking at once build them once.
_build_lock = threading.RLock()


@cache
def statements(module: str) -> dict[str, str]:
    """The named statements of ``sql/<module>.sql``, in file order."""
    text = resources.files("megascope.analysis").joinpath("sql", f"{module}.sql").read_text()
    parts = _HEADER.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    return {parts[i]: parts[i + 1].strip() for i in range(1, len(parts), 2)}


class Raw(str):
    """A SQL fragment this package wrote itself (e.g. a column expression from a fixed table);
    inserted as is."""


def _literal(name: str, value: object) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str) and _IDENT.match(value):
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, int) for v in value):
        # Typed as narrow as the values allow: steps and ranks are INTEGER columns, and DuckDB
        # pushes list_contains(INTEGER[], step) into the Parquet scan (row groups skipped by their
        # step range) where a BIGINT[] list, needing a cast of the column, becomes a join over
        # every row read.
        narrow = all(-2**31 <= int(v) < 2**31 for v in value)
        return "[" + ", ".join(str(int(v)) for v in value) + ("]::INTEGER[]" if narrow else "]::BIGINT[]")
    raise ValueError(f"SQL placeholder {name}: unsupported value {value!r}")


def first(result: duckdb.DuckDBPyConnection) -> tuple[Any, ...] | None:
    """The first row of a result, reading it to the end: DuckDB refuses new work on a connection
    whose last result is still open."""
    rows = result.fetchall()
    return rows[0] if rows else None


def render(module: str, name: str, **params: object) -> str:
    sql = statements(module)[name]

    def sub(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in params:
            raise KeyError(f"{module}.sql/{name}: no value for placeholder {key}")
        return _literal(key, params[key])

    return _PLACEHOLDER.sub(sub, sql)


def execute(con: duckdb.DuckDBPyConnection, module: str, name: str, **params: object) -> duckdb.DuckDBPyConnection:
    sql = render(module, name, **params)
    log.debug("sql %s/%s", module, name)
    return con.execute(sql)


def query_df(con: duckdb.DuckDBPyConnection, module: str, name: str, **params: object):  # noqa: ANN201
    """Run a SELECT statement of a module and return a pandas DataFrame."""
    return execute(con, module, name, **params).df()


def fingerprint(con: duckdb.DuckDBPyConnection) -> str:
    """A hash of the store's view definitions (their file lists change when a run grows)."""
    rows = con.execute(
        "SELECT view_name, sql FROM duckdb_views() WHERE NOT internal AND schema_name = 'main' ORDER BY view_name"
    ).fetchall()
    return hashlib.sha1(repr(rows).encode()).hexdigest()


def cache_is_fresh(con: duckdb.DuckDBPyConnection, table: str) -> bool:
    """Whether ``ms_cache.<table>`` exists and was built for the current views."""
    try:
        row = first(con.execute(
            f"SELECT fingerprint FROM {CACHE_SCHEMA}.built WHERE name = ?", [table]
        ))
    except duckdb.CatalogException:
        return False
    return row is not None and row[0] == fingerprint(con)


def mark_built(con: duckdb.DuckDBPyConnection, table: str) -> None:
    con.execute(f"DELETE FROM {CACHE_SCHEMA}.built WHERE name = ?", [table])
    con.execute(f"INSERT INTO {CACHE_SCHEMA}.built VALUES (?, ?)", [table, fingerprint(con)])


def ensure_schema(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(f"CREATE SCHEMA IF NOT EXISTS {CACHE_SCHEMA}")
    con.execute(f"CREATE TABLE IF NOT EXISTS {CACHE_SCHEMA}.built (name VARCHAR, fingerprint VARCHAR)")


def build_lock() -> threading.RLock:
    return _build_lock
