"""Stream the selected spans out of the store in chunks of whole ranks, clocks corrected.

Role in the data flow: the one reader both exporters use. It reads the selected spans in one
streaming scan, rank by rank, and cuts the stream into chunks of about ``chunk_rows`` spans at rank
boundaries. Memory therefore follows the chunk, not the run: a 12,288-rank run costs what a 64-rank one
does, per chunk. A chunk holds whole ranks so that the slices of one track are ordered in one place.

Each chunk comes back as a :class:`SpanChunk`: numpy columns, with ``start_ns`` already shifted by
its host's clock offset and spans outside the time window dropped.

Example::

    for chunk in iter_span_chunks(run, resolved):
        chunk.start_ns, chunk.rank, chunk.codes("name")
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from megascope.errors import ExportError
from megascope.export.selection import Resolved
from megascope.schema import SPANS
from megascope.store import Run

log = logging.getLogger(__name__)

DEFAULT_CHUNK_ROWS = 400_000
# Rows of a compacted run's row groups kept decoded for the blocks after (at least four chunks):
# a step-sorted file of a 1,024-rank run holds every rank in each row group.
READ_AHEAD_ROWS = 1_600_000
# Rows of one file's row groups read in one call at most (a row group per kind of each step): no
# more than a row group of the old layout, so that a kept slice holds as much memory as before.
READ_ROWS = 131_072

_COLUMNS = ["rank", "step", "name", "kind", "stream", "start_ns", "dur_ns", "microbatch", "chunk",
            "group", "seq", "op", "bytes", "peer"]
_STRINGS = ("name", "kind", "stream", "group", "op")


@dataclass
class SpanChunk:
    """Spans of a few whole ranks. Strings are dictionary-encoded; nullable ints carry a mask."""

    rank: npt.NDArray[np.int64]
    start_ns: npt.NDArray[np.int64]  # corrected (unless read with corrected=False)
    dur_ns: npt.NDArray[np.int64]
    ints: dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]]  # step, microbatch, ... -> (values, valid)
    strings: dict[str, pa.DictionaryArray]  # name, kind, stream, group, op
    # codes() of each string column asked for: the order stage and the encoder share them
    known_codes: dict[str, tuple[npt.NDArray[np.int64], list[str | None]]] = field(default_factory=dict, repr=False)

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
        known = self.known_codes.get(column)
        if known is None:
            arr = self.strings[column]
            indices = arr.indices.to_numpy(zero_copy_only=False)
            if arr.null_count:
                indices = np.where(arr.is_valid().to_numpy(zero_copy_only=False), indices, -1)
            known = self.known_codes[column] = (indices.astype(np.int64), arr.dictionary.to_pylist())
        return known

    def corrected(self, rank_offsets_ns: npt.NDArray[np.int64]) -> SpanChunk:
        """The chunk with each rank's clock offset (``Resolved.rank_offsets_ns``) added to its
        starts; a start that lands before the epoch is an :class:`ExportError` naming its rank."""
        start = self.start_ns + rank_offsets_ns[self.rank] if len(rank_offsets_ns) else self.start_ns
        if len(start) and int(start.min()) < 0:
            bad = int(np.argmin(start))
            raise ExportError(f"rank {int(self.rank[bad])} has a span at {int(start[bad])} ns after clock correction, "
                              "before the epoch; its recorded start_ns is not a wall-clock time")
        return replace(self, start_ns=start)


def _int_column(table: pa.Table, name: str) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    col = table.column(name).combine_chunks()
    valid = col.is_valid().to_numpy(zero_copy_only=False) if col.null_count else np.ones(len(col), dtype=np.bool_)
    values = pc.fill_null(col, 0).to_numpy(zero_copy_only=False).astype(np.int64)
    return values, valid


def _to_chunk(table: pa.Table, resolved: Resolved, *, corrected: bool) -> SpanChunk:
    rank = table.column("rank").to_numpy().astype(np.int64)
    chunk = SpanChunk(
        rank=rank,
        start_ns=table.column("start_ns").to_numpy().astype(np.int64),
        dur_ns=np.maximum(table.column("dur_ns").to_numpy().astype(np.int64), 0),
        ints={c: _int_column(table, c) for c in ("step", "microbatch", "chunk", "seq", "bytes", "peer")},
        strings={c: pc.dictionary_encode(table.column(c).combine_chunks()) for c in _STRINGS},
    )
    if not corrected:
        return chunk
    chunk = chunk.corrected(resolved.rank_offsets_ns)
    if resolved.window is not None:
        lo, hi = resolved.window  # corrected epoch ns, without the non-negativity shift
        start, dur = chunk.start_ns, chunk.dur_ns
        keep = (start - resolved.shift_ns <= hi) & (start + dur - resolved.shift_ns >= lo)
        if not keep.all():
            chunk = chunk.take(np.flatnonzero(keep))
    return chunk


def iter_span_chunks(run: Run, resolved: Resolved, *, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                     corrected: bool = True) -> Iterator[SpanChunk]:
    """The selected spans, a few whole ranks at a time, in rank order.

    ``corrected=False``: starts as recorded, for a caller that adds the offsets later
    (:meth:`SpanChunk.corrected`); only without a time window, which is placed in corrected time.

    One streaming scan: the store lists each rank's parts in rank order and DuckDB keeps that
    order (``preserve_insertion_order``), so batches arrive rank by rank; a chunk is cut at the
    last rank boundary once ``chunk_rows`` rows are buffered and the open rank carries over.
    """
    if not corrected and resolved.window is not None:
        raise ValueError("a time window needs corrected times")
    if not len(resolved.ranks):
        return
    compacted = run.compacted.get("spans")
    if compacted:
        if set(run.files.get("spans", [])) == set(compacted):
            yield from _iter_compacted_files(compacted, resolved, chunk_rows, corrected)
        else:  # compacted files beside parts: the store's view merges them
            yield from _iter_rank_blocks(run, resolved, chunk_rows, corrected)
        return
    cols = ", ".join(f'"{c}"' for c in _COLUMNS)
    # plain range filters only: a semi-join would let DuckDB return rows out of file order
    lo, hi = int(resolved.ranks[0]), int(resolved.ranks[-1])
    reader = run.cursor().sql(
        f"SELECT {cols} FROM spans WHERE rank BETWEEN {lo} AND {hi} AND {resolved.span_filter_sql()}"
    ).to_arrow_reader(min(chunk_rows, 1 << 17))
    every_rank = len(resolved.ranks) == hi - lo + 1
    pending: list[pa.RecordBatch] = []
    rows = 0
    done_below = -1  # every rank <= this one has been emitted
    for batch in reader:
        if not every_rank:
            batch = batch.filter(pa.array(np.isin(batch.column(0).to_numpy(), resolved.ranks)))
        if not batch.num_rows:
            continue
        ranks = batch.column(0).to_numpy()
        if int(ranks.min()) <= done_below or (len(ranks) > 1 and (np.diff(ranks) < 0).any()):
            raise ExportError(f"{run.path}: spans did not arrive in rank order; cannot stream the export")
        pending.append(batch)
        rows += batch.num_rows
        if rows < chunk_rows:
            continue
        table = pa.Table.from_batches(pending)
        last = int(ranks[-1])
        cut = int(np.searchsorted(table.column("rank").to_numpy(), last, side="left"))
        if cut == 0:  # one rank bigger than a chunk: keep reading it
            continue
        chunk = _to_chunk(table.slice(0, cut), resolved, corrected=corrected)
        pending = table.slice(cut).to_batches()
        rows = table.num_rows - cut
        done_below = last - 1
        if len(chunk):
            yield chunk
    if pending:
        chunk = _to_chunk(pa.Table.from_batches(pending), resolved, corrected=corrected)
        if len(chunk):
            yield chunk


def _iter_rank_blocks(run: Run, resolved: Resolved, chunk_rows: int, corrected: bool) -> Iterator[SpanChunk]:
    """The selected spans of a compacted run, a block of whole ranks per query.

    A compacted file holds many ranks sorted by step (spans: then kind), so file order is not rank order: count the
    rows per rank first (two columns), then read blocks of about ``chunk_rows`` rows, each sorted
    in DuckDB (memory follows the block). Row groups hold a range of steps and ranks, so a block
    reads the row groups that can hold its ranks.
    """
    cur = run.cursor()
    where = resolved.span_filter_sql()
    lo, hi = int(resolved.ranks[0]), int(resolved.ranks[-1])
    counts = cur.execute(
        f"SELECT rank, count(*) FROM spans WHERE rank BETWEEN {lo} AND {hi} AND {where} GROUP BY rank ORDER BY rank"
    ).fetchall()
    wanted = set(resolved.ranks.tolist())
    blocks: list[tuple[int, int]] = []
    start: int | None = None
    prev = rows = 0
    for rank, n in counts:
        if rank not in wanted:
            continue
        if start is not None and rows + n > chunk_rows:
            blocks.append((start, prev))
            start, rows = None, 0
        if start is None:
            start = rank
        rows += n
        prev = rank
    if start is not None:
        blocks.append((start, prev))
    cols = ", ".join(f'"{c}"' for c in _COLUMNS)
    every_rank = len(resolved.ranks) == hi - lo + 1
    for a, b in blocks:
        table = cur.sql(
            f"SELECT {cols} FROM spans WHERE rank BETWEEN {a} AND {b} AND {where}"
        ).to_arrow_table()
        if not every_rank:
            table = table.filter(pa.array(np.isin(table.column("rank").to_numpy(), resolved.ranks)))
        chunk = _to_chunk(table, resolved, corrected=corrected)
        if len(chunk):
            yield chunk


@dataclass
class _Group:
    """One row group of a compacted file that may hold selected spans."""

    file: pq.ParquetFile
    index: int
    ranks: tuple[int, int]  # lowest and highest rank (the whole range when the file has no statistics)


def _minmax(row_group: pq.RowGroupMetaData, column: int | None) -> tuple[float, float]:
    stats = row_group.column(column).statistics if column is not None else None
    if stats is None or not stats.has_min_max:
        return (-np.inf, np.inf)
    return (stats.min, stats.max)


class _CompactedReader:
    """Row groups of compacted span files read with pyarrow, strings kept as the file's
    dictionaries, the selection applied in numpy and each group's rows put in rank order."""

    def __init__(self, paths: list, resolved: Resolved) -> None:
        self.resolved = resolved
        ranks = resolved.ranks
        self.lo, self.hi = int(ranks[0]), int(ranks[-1])
        self.every_rank = len(ranks) == self.hi - self.lo + 1
        self.groups: list[_Group] = []
        for path in paths:
            file = pq.ParquetFile(path, read_dictionary=list(_STRINGS))
            names = file.schema_arrow.names
            rank_col = names.index("rank") if "rank" in names else None
            step_col = names.index("step") if "step" in names else None
            meta = file.metadata
            for i in range(meta.num_row_groups):
                row_group = meta.row_group(i)
                if not row_group.num_rows:
                    continue
                r_lo, r_hi = _minmax(row_group, rank_col)
                if r_hi < self.lo or r_lo > self.hi:
                    continue
                if resolved.steps is not None:
                    s_lo, s_hi = _minmax(row_group, step_col)
                    if s_hi < resolved.steps[0] or s_lo > resolved.steps[1]:
                        continue
                bounds = (int(max(r_lo, self.lo)), int(min(r_hi, self.hi)))
                self.groups.append(_Group(file, i, bounds))

    def _keep(self, table: pa.Table) -> npt.NDArray[np.bool_] | None:
        """The rows of ``table`` the selection keeps (``span_filter_sql`` in numpy), or None for all."""
        rank = table.column("rank").to_numpy()
        keep = None
        if not self.every_rank:
            keep = np.isin(rank, self.resolved.ranks)
        elif int(rank.min()) < self.lo or int(rank.max()) > self.hi:
            keep = (rank >= self.lo) & (rank <= self.hi)
        masks = []
        if self.resolved.steps is not None:
            step = table.column("step")
            first, last = self.resolved.steps
            ok = step.is_valid().to_numpy(zero_copy_only=False) if step.null_count else None
            values = pc.fill_null(step, first - 1).to_numpy(zero_copy_only=False) if step.null_count else step.to_numpy()
            in_range = (values >= first) & (values <= last)
            masks.append(in_range if ok is None else in_range & ok)
        if self.resolved.window is not None:
            margin = self.resolved.max_abs_offset_ns + self.resolved.shift_ns
            start = table.column("start_ns").to_numpy()
            dur = table.column("dur_ns").to_numpy()
            masks.append((start <= int(self.resolved.window[1]) + margin)
                         & (start + dur >= int(self.resolved.window[0]) - margin))
        for mask in masks:
            keep = mask if keep is None else keep & mask
        return keep

    def counts(self) -> npt.NDArray[np.int64]:
        """Selected spans per rank, ``lo`` to ``hi``: reads only the columns the selection needs."""
        columns = ["rank"] + (["step"] if self.resolved.steps is not None else []) + (
            ["start_ns", "dur_ns"] if self.resolved.window is not None else [])
        counts = np.zeros(self.hi - self.lo + 1, dtype=np.int64)
        for group in self.groups:
            table = _conform(group.file.read_row_group(group.index, columns=columns, use_threads=False), columns)
            keep = self._keep(table)
            rank = table.column("rank").to_numpy()
            if keep is not None:
                rank = rank[keep]
            counts += np.bincount(rank - self.lo, minlength=len(counts))
        return counts

    def read(self, groups: list[_Group]) -> list[tuple[pa.Table, npt.NDArray[np.int64]]]:
        """Each group's selected rows in rank order (stable), and their ranks.

        Groups of one file are read together, up to READ_ROWS rows a read: a compacted spans file
        has a row group per kind of each step, many of them small, and each read has a fixed cost."""
        tables: dict[int, pa.Table] = {}
        batch: list[_Group] = []
        for group in [*groups, None]:
            rows = sum(g.file.metadata.row_group(g.index).num_rows for g in batch)
            if batch and (group is None or group.file is not batch[0].file
                          or rows + group.file.metadata.row_group(group.index).num_rows > READ_ROWS):
                table = _conform(batch[0].file.read_row_groups([g.index for g in batch], columns=_COLUMNS,
                                                               use_threads=False), _COLUMNS)
                offset = 0
                for g in batch:
                    n = g.file.metadata.row_group(g.index).num_rows
                    tables[id(g)] = table.slice(offset, n)
                    offset += n
                batch = []
            if group is not None:
                batch.append(group)
        return [self._ordered(tables[id(g)]) for g in groups]

    def _ordered(self, table: pa.Table) -> tuple[pa.Table, npt.NDArray[np.int64]]:
        keep = self._keep(table)
        if keep is not None:
            table = table.filter(pa.array(keep))
        rank = table.column("rank").to_numpy()
        if len(rank) > 1 and (np.diff(rank) < 0).any():  # several steps in one group (a band of small steps)
            order = np.argsort(rank, kind="stable")
            table, rank = table.take(pa.array(order)), rank[order]
        return table, rank.astype(np.int64)


def _conform(table: pa.Table, columns: list[str]) -> pa.Table:
    """``columns`` of ``table`` typed as the schema says (strings as dictionaries), missing ones null."""
    arrays = []
    for name in columns:
        field = SPANS.field(name)
        want = pa.dictionary(pa.int32(), pa.string()) if name in _STRINGS else field.type
        if name not in table.column_names:
            arrays.append(pa.nulls(table.num_rows, want))
            continue
        column = table.column(name)
        if column.type != want:
            column = column.cast(want)
        arrays.append(column)
    return pa.table(arrays, names=columns)


def _iter_compacted_files(paths: list, resolved: Resolved, chunk_rows: int, corrected: bool) -> Iterator[SpanChunk]:
    """The selected spans of a fully compacted run, a block of whole ranks per chunk, in one pass.

    A compacted file is sorted by step and kind, so a block of ranks has rows in every row group
    of each step (one a kind, or a range of ranks of one kind where a step is cut by rank).
    Each row group is read once (pyarrow, strings as the file's dictionaries), put in rank order
    and kept, for the blocks after, with the rows it still holds, up to ``READ_AHEAD_ROWS`` rows
    or four chunks in all, whichever is more: memory stays bounded whatever the run's size. A group
    that does not fit is read again by the next block that needs it.
    """
    reader = _CompactedReader(paths, resolved)
    counts = reader.counts()
    blocks: list[tuple[int, int]] = []
    start: int | None = None
    prev = rows = 0
    for rank in (resolved.ranks - reader.lo).tolist():
        n = int(counts[rank])
        if not n:
            continue
        if start is not None and rows + n > chunk_rows:
            blocks.append((start, prev))
            start, rows = None, 0
        if start is None:
            start = rank + reader.lo
        rows += n
        prev = rank + reader.lo
    if start is not None:
        blocks.append((start, prev))
    budget = max(4 * chunk_rows, READ_AHEAD_ROWS)
    kept: dict[int, tuple[pa.Table, npt.NDArray[np.int64], int]] = {}  # group -> (rows, ranks, rows read)
    kept_rows = 0
    for a, b in blocks:
        pieces = []
        needed = [g for g, group in enumerate(reader.groups) if group.ranks[1] >= a and group.ranks[0] <= b]
        unread = [g for g in needed if g not in kept]
        fresh = dict(zip(unread, reader.read([reader.groups[g] for g in unread]), strict=True))
        for g in needed:
            if g in kept:
                table, rank, size = kept.pop(g)
                kept_rows -= size
            else:
                table, rank = fresh.pop(g)
                size = len(rank)
            i = int(np.searchsorted(rank, a, side="left"))
            j = int(np.searchsorted(rank, b, side="right"))
            if j > i:
                pieces.append(table.slice(i, j - i))
            if j < len(rank) and kept_rows + size <= budget:
                kept[g] = (table.slice(j), rank[j:], size)
                kept_rows += size
        if not pieces:
            continue
        chunk = _to_chunk(pa.concat_tables(pieces).unify_dictionaries(), resolved, corrected=corrected)
        if len(chunk):
            yield chunk
