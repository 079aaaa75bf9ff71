"""Bounded in-memory queues between the training thread and the writer thread.

Role in the data flow: the training thread appends finished rows (and spans still waiting for their
device events) here without taking a lock (``deque.append`` is atomic under the GIL); the writer
thread drains them into Parquet parts. A queue at capacity drops the new row and counts it: the
collector's memory stays bounded however far the disk falls behind.

Rows are plain tuples (a tuple costs the garbage collector nothing to track once its items are
atomic; a dict or object per row does: docs/benchmarks.md). Their field order is declared once,
here: :data:`SPAN_ROW`, :data:`MARKER_ROW` and :data:`METRIC_ROW` are the tables' column orders
(``megascope.schema``; a test checks that they agree), :data:`PENDING_SPAN_ROW`,
:data:`PENDING_MARK_ROW` and :data:`PENDING_METRIC_ROW` the layouts of what waits for the device.
Every place that builds or unpacks a row names the layout it follows.

Example::

    buf = RowBuffer(capacity=1000)
    buf.put((0, 1, "loss", 2.5, 123))       # a METRIC_ROW
    rows = buf.drain()                      # [(0, 1, "loss", 2.5, 123)]
    table, bad = rows_to_table_dropping(rows, schema.METRICS)
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pyarrow as pa

# The columns of a row of each table, in order: the table's schema (megascope.schema).
SPAN_ROW = ("rank", "step", "name", "kind", "stream", "start_ns", "dur_ns", "microbatch", "chunk", "group", "seq",
            "op", "bytes", "peer")
MARKER_ROW = ("rank", "group", "seq", "op", "state", "time_ns", "step", "bytes", "peer")
METRIC_ROW = ("rank", "step", "name", "value", "time_ns")
# What waits for the device, in the writer's pending queues (megascope.collectors.writer.Sink):
# a span closed on the host (its start and end stamps, the clock anchor, the span's fields, and
# the stamp where a wait on it began, or None);
PENDING_SPAN_ROW = ("start", "end", "anchor", "step", "name", "kind", "stream", "microbatch", "chunk", "group",
                    "seq", "op", "bytes", "peer", "wait")
# an untimed communication call whose completion is still to be seen (a timing-free mark);
PENDING_MARK_ROW = ("mark", "step", "group", "seq", "op", "bytes", "peer")
# a device scalar being copied into a pinned host scalar, done when its mark is.
PENDING_METRIC_ROW = ("step", "name", "value", "host_tensor", "mark", "time_ns")


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
    """Row tuples in ``schema`` column order -> a table of exactly ``schema``; raises on a row that
    does not fit (a wrong length, a value of the wrong type, a null where none may be)."""
    if not rows:
        return schema.empty_table()
    columns = list(zip(*rows, strict=True))
    arrays = [pa.array(col, type=field.type) for col, field in zip(columns, schema, strict=True)]
    table = pa.Table.from_arrays(arrays, schema=schema)
    for array, field in zip(arrays, schema, strict=True):
        if not field.nullable and array.null_count:
            raise ValueError(f"null in non-nullable column {field.name}")
    return table


def rows_to_table_dropping(rows: list[tuple[Any, ...]], schema: pa.Schema) -> tuple[pa.Table, int]:
    """Like :func:`rows_to_table`, but a row that does not fit is left out instead of failing the
    batch: (table of the good rows, how many were left out). The whole batch is converted at once;
    only a batch that fails is split, in halves, down to the rows at fault."""
    try:
        return rows_to_table(rows, schema), 0
    except Exception:
        if len(rows) <= 1:
            return schema.empty_table(), len(rows)
    half = len(rows) // 2
    first, bad_first = rows_to_table_dropping(rows[:half], schema)
    second, bad_second = rows_to_table_dropping(rows[half:], schema)
    return pa.concat_tables([first, second]), bad_first + bad_second
