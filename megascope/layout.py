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
    RUN/heartbeats/host=NAME/part-*.parquet
    RUN/diagnostics/part-*.parquet

A part is written to a hidden temporary name in the same directory and renamed into place, so a
reader never sees half a file; temporary files end in ``.tmp`` and are never globbed.

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
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from megascope.schema import TABLES, RunMeta

RUN_JSON = "run.json"

# Tables with one file per rank (written once, rewritten whole) versus many parts per rank.
SINGLE_FILE_TABLES = frozenset({"ranks", "groups"})
RANK_PARTITIONED = frozenset({"spans", "markers", "metrics"})
HOST_PARTITIONED = frozenset({"heartbeats"})
UNPARTITIONED = frozenset({"diagnostics"})

_counter = itertools.count()
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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_table_atomic(path: Path, table: pa.Table, *, compression: str = "zstd") -> None:
    """Write ``table`` to ``path`` through a temporary file and a rename."""
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
) -> Path:
    """Write ``data`` as one new part of ``table`` (or the whole file of a single-file table).

    ``data`` is cast to the table's schema, so a writer that built it column by column gets the
    same types as every other writer.
    """
    schema = TABLES[table]
    if data.schema != schema:
        data = data.select(schema.names).cast(schema)
    where = table_path(Path(run_dir), table, rank=rank, host=host)
    path = where if table in SINGLE_FILE_TABLES else where / part_name()
    write_table_atomic(path, data)
    return path


def write_run_meta(run_dir: Path | str, meta: RunMeta) -> Path:
    path = Path(run_dir) / RUN_JSON
    atomic_write_bytes(path, (json.dumps(meta.to_json(), indent=2, sort_keys=True) + "\n").encode())
    return path


def read_run_json(run_dir: Path | str) -> dict[str, Any]:
    """The raw ``run.json`` dict (validation is the store's job)."""
    return json.loads((Path(run_dir) / RUN_JSON).read_text())
