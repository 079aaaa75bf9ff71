"""Stream the selected spans out of the store in chunks of whole ranks, clocks corrected.

Role in the data flow: the one reader both exporters use. It asks DuckDB how many spans each
selected rank has, packs consecutive ranks into chunks of about ``chunk_rows`` spans, and reads one
chunk at a time (the run's files are partitioned by rank, so each query touches only that chunk's
files). Memory therefore follows the chunk, not the run: a 12,288-rank run costs what a 64-rank one
does, per chunk. A chunk holds whole ranks so that the slices of one track are ordered in one place.

Each chunk comes back as a :class:`SpanChunk`: numpy columns, with ``start_ns`` already shifted by
its host's clock offset and spans outside the time window dropped.

Example::

    for chunk in iter_span_chunks(run, resolved):
        chunk.start_ns, chunk.rank, chunk.name.dictionary
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from megascope.export.selection import Resolved
from megascope.store import Run

log = logging.getLogger(__name__)

DEFAULT_CHUNK_ROWS = 400_000

_COLUMNS = ["rank", "step", "name", "kind", "stream", "start_ns", "dur_ns", "microbatch", "chunk",
            "group", "seq", "op", "bytes", "peer"]
_STRINGS = ("name", "kind", "stream", "group", "op")


@dataclass
class SpanChunk:
    """Spans of a few whole ranks. Strings are dictionary-encoded; nullable ints carry a mask."""

    rank: npt.NDArray[np.int64]
    start_ns: npt.NDArray[np.int64]  # corrected
    dur_ns: npt.NDArray[np.int64]
    ints: dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]]  # step, microbatch, ... -> (values, valid)
    strings: dict[str, pa.DictionaryArray]  # name, kind, stream, group, op

    def __len__(self) -> int:
        return len(self.rank)

    def take(self, rows: npt.NDArray[np.int64]) -> SpanChunk:
        idx = pa.array(rows)
        return SpanChunk(
            rank=self.rank[rows],
            start_ns=self.start_ns[rows],
            dur_ns=self.dur_ns[rows],
            ints={k: (v[rows], m[rows]) for k, (v, m) in self.ints.items()},
            strings={k: v.take(idx) for k, v in self.strings.items()},
        )

    def codes(self, column: str) -> tuple[npt.NDArray[np.int64], list[str | None]]:
        """Dictionary indices (-1 for null) and the dictionary's values."""
        arr = self.strings[column]
        indices = arr.indices.to_numpy(zero_copy_only=False)
        if arr.null_count:
            indices = np.where(arr.is_valid().to_numpy(zero_copy_only=False), indices, -1)
        return indices.astype(np.int64), arr.dictionary.to_pylist()


def _int_column(table: pa.Table, name: str) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    col = table.column(name).combine_chunks()
    valid = col.is_valid().to_numpy(zero_copy_only=False) if col.null_count else np.ones(len(col), dtype=np.bool_)
    values = pc.fill_null(col, 0).to_numpy(zero_copy_only=False).astype(np.int64)
    return values, valid


def _rank_counts(run: Run, resolved: Resolved) -> list[tuple[int, int]]:
    cur = run.cursor()
    cur.register("_export_ranks", pa.table({"rank": pa.array(resolved.ranks, pa.int32())}))
    return [(int(r), int(n)) for r, n in cur.execute(
        f"SELECT rank, count(*) FROM spans WHERE rank IN (SELECT rank FROM _export_ranks) "
        f"AND {resolved.span_filter_sql()} GROUP BY rank ORDER BY rank"
    ).fetchall()]


def plan_chunks(counts: list[tuple[int, int]], chunk_rows: int) -> list[list[int]]:
    """Consecutive ranks packed into chunks of about ``chunk_rows`` spans (a rank is never split)."""
    chunks: list[list[int]] = []
    current: list[int] = []
    rows = 0
    for rank, n in counts:
        if current and rows + n > chunk_rows:
            chunks.append(current)
            current, rows = [], 0
        current.append(rank)
        rows += n
    if current:
        chunks.append(current)
    return chunks


def iter_span_chunks(run: Run, resolved: Resolved, *, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Iterator[SpanChunk]:
    """The selected spans, a few whole ranks at a time, in rank order."""
    cols = ", ".join(f'"{c}"' for c in _COLUMNS)
    where = resolved.span_filter_sql()
    for ranks in plan_chunks(_rank_counts(run, resolved), chunk_rows):
        listed = ", ".join(map(str, ranks))
        table = run.cursor().sql(
            f"SELECT {cols} FROM spans WHERE rank BETWEEN {ranks[0]} AND {ranks[-1]} "
            f"AND rank IN ({listed}) AND {where} "
            # a total order, so that the same run always gives the same bytes
            f"ORDER BY rank, start_ns, dur_ns DESC, stream, name, kind, seq, peer, microbatch, step"
        ).to_arrow_table()
        rank = table.column("rank").to_numpy().astype(np.int64)
        offsets = resolved.rank_offsets_ns[rank] if len(resolved.rank_offsets_ns) else np.zeros_like(rank)
        start = table.column("start_ns").to_numpy().astype(np.int64) + offsets
        dur = np.maximum(table.column("dur_ns").to_numpy().astype(np.int64), 0)
        chunk = SpanChunk(
            rank=rank,
            start_ns=start,
            dur_ns=dur,
            ints={c: _int_column(table, c) for c in ("step", "microbatch", "chunk", "seq", "bytes", "peer")},
            strings={c: pc.dictionary_encode(table.column(c).combine_chunks()) for c in _STRINGS},
        )
        if resolved.window is not None:
            lo, hi = resolved.window  # corrected epoch ns, without the non-negativity shift
            keep = (start - resolved.shift_ns <= hi) & (start + dur - resolved.shift_ns >= lo)
            if not keep.all():
                chunk = chunk.take(np.flatnonzero(keep))
        if len(chunk):
            yield chunk
