"""Reading a run through an fsspec filesystem registered in DuckDB, without torn reads.

Role in the data flow: beside the store, for runs that are not on a local disk (docs/run-directory.md,
"Reading a run that is not on the local disk"). DuckDB reads a Parquet file's column chunks from
several threads through one Python file object of a registered fsspec filesystem, each read a
``seek`` then a ``read``. Two threads that interleave move each other's position, and one reads
another's bytes: DuckDB fails with "Out of buffer" or decodes the wrong chunk. Compacted spans (a
row group per kind of each step) read through fsspec's local filesystem failed that way in 13 of 30
reads on a 2-core machine (DuckDB 2.0.1, fsspec 2026.9); the same file on the local disk never did.

:func:`positional` returns the filesystem to register instead: the same class and options, whose
files keep a position per thread and make every read one locked seek and read.

Example::

    import duckdb, fsspec
    con = duckdb.connect()
    con.register_filesystem(positional(fsspec.filesystem("gcs")))
"""

from __future__ import annotations

import threading
from typing import Any


class PositionalFile:
    """A file object read by several threads at once: each thread has its own position, and a read
    seeks the shared file and reads under one lock. Everything else passes through."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._lock = threading.Lock()
        self._where = threading.local()

    def tell(self) -> int:
        return int(getattr(self._where, "pos", 0))

    def seek(self, loc: int, whence: int = 0) -> int:
        if whence == 0:
            pos = loc
        elif whence == 1:
            pos = self.tell() + loc
        else:
            with self._lock:
                pos = self._raw.seek(loc, 2)
        self._where.pos = pos
        return pos

    def read(self, size: int = -1) -> bytes:
        with self._lock:
            self._raw.seek(self.tell())
            data = self._raw.read(size)
        self._where.pos = self.tell() + len(data)
        return data  # type: ignore[no-any-return]

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer)))
        memoryview(buffer)[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> PositionalFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def positional(fs: Any) -> Any:
    """``fs`` (an fsspec filesystem) as one whose files opened for reading are :class:`PositionalFile`s:
    the same class, protocol and storage options, to pass to DuckDB's ``register_filesystem``."""
    cls = type(fs)

    def _open(self: Any, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        raw = cls._open(self, path, mode, *args, **kwargs)
        return PositionalFile(raw) if mode == "rb" else raw

    wrapped = type(f"Positional{cls.__name__}", (cls,), {"_open": _open, "cachable": False})
    return wrapped(*getattr(fs, "storage_args", ()), **getattr(fs, "storage_options", {}))
