"""Bounded in-memory queues between the training thread and the writer thread.

Role in the data flow: the training thread appends finished rows (and spans still waiting for their
device events) here without taking a lock (``deque.append`` is atomic under the GIL); the writer
thread drains them into Parquet parts. A queue at capacity drops the new row and counts it: the
collector's memory stays bounded however far the disk falls behind.

Example::

    buf = RowBuffer(capacity=1000)
    buf.put((0, 1, "loss", 2.5, 123))
    rows = buf.drain()                      # [(0, 1, "loss", 2.5, 123)]
    table = rows_to_table(rows, schema.METRICS)
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pyarrow as pa


class RowBuffer:
    """A FIFO of row tuples holding at most ``capacity`` rows; extra rows are counted in ``dropped``."""

    __slots__ = ("_rows", "capacity", "dropped")

    def __init__(self, capacity: int) -> None:
        self._rows: deque[Any] = deque()
        self.capacity = capacity
        self.dropped = 0

    def put(self, row: Any) -> bool:
        if len(self._rows) >= self.capacity:
            self.dropped += 1
            return False
        self._rows.append(row)
        return True

    def push_front(self, rows: list[Any]) -> None:
        """Return rows that could not be handled yet (e.g. spans whose events are still running)."""
        self._rows.extendleft(reversed(rows))

    def drain(self, limit: int | None = None) -> list[Any]:
        """Remove and return the rows present now (at most ``limit``), oldest first."""
        n = len(self._rows) if limit is None else min(limit, len(self._rows))
        popleft = self._rows.popleft
        return [popleft() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._rows)


def rows_to_table(rows: list[tuple[Any, ...]], schema: pa.Schema) -> pa.Table:
    """Row tuples in ``schema`` column order -> a table of exactly ``schema``."""
    if not rows:
        return schema.empty_table()
    columns = list(zip(*rows, strict=True))
    arrays = [pa.array(col, type=field.type) for col, field in zip(columns, schema, strict=True)]
    return pa.Table.from_arrays(arrays, schema=schema)
