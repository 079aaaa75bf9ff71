"""Chrome trace-event JSON export, for tools that read only that (chrome://tracing, HTA, Perfetto).

Role in the data flow: store -> export, beside :mod:`megascope.export.perfetto`, with the same
selection, clock correction and chunked reading. Each span becomes one complete event (``"ph":
"X"``): ``pid`` is rank + 1 (named like the Perfetto processes), ``tid`` a stream lane, ``ts`` and
``dur`` in microseconds with nanosecond decimals, ``cat`` the span kind and ``args`` its step,
micro-batch, group, seq, op, bytes and peer. Each send is linked to the end of its receive by a
flow (``s``/``f``); collective members carry ``group`` and ``seq`` in their args instead of arrows,
since a JSON flow chain needs the members' arrival order, which only the whole run knows.

The JSON text is built column-wise with Arrow string kernels, one chunk of ranks at a time, so it
streams like the Perfetto export. ``split_ranks`` writes one file per rank into a directory, each
with ``distributedInfo.rank``, the layout Holistic Trace Analysis loads.

Example::

    from megascope.export import export_chrome
    export_chrome("runs/demo", Path("demo.json"), ranks=[0, 1, 2, 3])
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from megascope import layout
from megascope.errors import ExportError
from megascope.export.common import CountingWriter, ExportStats, as_run, make_selection, output_stream
from megascope.export.perfetto import p2p_flow_ids
from megascope.export.selection import Resolved, resolve
from megascope.export.source import DEFAULT_CHUNK_ROWS, SpanChunk, iter_span_chunks
from megascope.export.tracks import assign_lanes, stream_code, stream_sort_key, track_base
from megascope.schema import SpanKind
from megascope.store import Run
from megascope.topology import format_coords

log = logging.getLogger(__name__)

_INT_ARGS = ("step", "microbatch", "chunk", "seq", "bytes", "peer")


def _micros(ns: npt.NDArray[np.int64]) -> pa.Array:
    """Epoch ns -> JSON microseconds with three decimals (exact, no float rounding)."""
    whole = pa.array(ns // 1000)
    frac = pc.utf8_slice_codeunits(pc.cast(pa.array(ns % 1000 + 1000), pa.string()), 1)
    return pc.binary_join_element_wise(pc.cast(whole, pa.string()), frac, ".")


def _json_strings(values: list[str | None]) -> pa.Array:
    return pa.array([json.dumps(v) if v is not None else None for v in values], pa.string())


def _lit(text: str, n: int) -> pa.Array:
    return pa.array(np.full(n, text, dtype=object), pa.string())


class _ChromeWriter:
    def __init__(self, run: Run, resolved: Resolved, stats: ExportStats) -> None:
        self.run = run
        self.resolved = resolved
        self.stats = stats
        self.threads_named: set[tuple[int, int]] = set()
        # Timestamps are written relative to a whole second before the first event, which goes to the
        # document as Kineto's ``baseTimeNanoseconds``: epoch microseconds need 16+ digits, more than
        # a JSON reader's double keeps, so absolute ``ts`` values would lose their nanoseconds.
        (first,) = run.cursor().execute("SELECT min(start_ns) FROM spans").fetchone() or (None,)
        lowest = int(first) + int(resolved.rank_offsets_ns.min(initial=0)) if first is not None else 0
        self.base_ns = max(0, lowest // 1_000_000_000 * 1_000_000_000 - 1_000_000_000)

    def process_events(self, ranks: Iterable[int]) -> list[dict[str, Any]]:
        info = self.resolved.rank_info
        events: list[dict[str, Any]] = []
        stragglers = set(self.resolved.stragglers)
        for rank in ranks:
            host, coords = info.get(rank, ("unknown host", {}))
            placed = format_coords(coords)
            name = f"rank {rank} · {host}" + (f" · {placed}" if placed else "")
            name += " · straggler" if rank in stragglers else ""
            events.append({"ph": "M", "pid": rank + 1, "tid": 0, "name": "process_name", "args": {"name": name}})
            events.append({"ph": "M", "pid": rank + 1, "tid": 0, "name": "process_labels",
                           "args": {"labels": f"host={host}"}})
        self.stats.ranks += len(events) // 2
        return events

    def chunk_lines(self, chunk: SpanChunk) -> tuple[pa.Array, npt.NDArray[np.int64], list[str]]:
        """One JSON text per event (spans, then flows), their ranks, and thread-name lines.

        Spans go out by rank, then start time, longer first, whatever order the store read them in
        (part files are in time order per rank, compacted files by step)."""
        order = np.lexsort((-chunk.dur_ns, chunk.start_ns, chunk.rank))
        if (np.diff(order) != 1).any():
            chunk = chunk.take(order)
        n = len(chunk)
        stream_idx, stream_dict = chunk.codes("stream")
        codes = np.array([stream_code(s or "") for s in stream_dict], dtype=np.int64)
        start, dur = chunk.start_ns, chunk.dur_ns
        track, _, _ = assign_lanes(track_base(chunk.rank, codes[stream_idx]), start, start + dur)
        tid = (track & np.uint64(0xFFFFFF)).astype(np.int64)
        meta_lines = []
        for rank, t in sorted({(int(r), int(x)) for r, x in zip(chunk.rank.tolist(), tid.tolist(), strict=True)}):
            if (rank, t) in self.threads_named:
                continue
            self.threads_named.add((rank, t))
            code, lane = t >> 8, t & 0xFF
            stream = next((s or "" for s, c in zip(stream_dict, codes.tolist(), strict=True) if c == code), str(code))
            label = stream if lane == 0 else f"{stream} #{lane + 1}"
            meta_lines.append(json.dumps({"ph": "M", "pid": rank + 1, "tid": t, "name": "thread_name",
                                          "args": {"name": label}}))
            meta_lines.append(json.dumps({"ph": "M", "pid": rank + 1, "tid": t, "name": "thread_sort_index",
                                          "args": {"sort_index": stream_sort_key(stream)[0] * 256 + lane}}))
        self.stats.tracks += len(meta_lines) // 2

        name_idx, name_dict = chunk.codes("name")
        kind_idx, kind_dict = chunk.codes("kind")
        names = _json_strings(name_dict).take(pa.array(name_idx))
        kinds = _json_strings(kind_dict).take(pa.array(kind_idx))
        args = []
        for column in _INT_ARGS:
            values, ok = chunk.ints[column]
            text = pc.binary_join_element_wise(_lit(f'"{column}":', n), pc.cast(pa.array(values), pa.string()), "")
            args.append(pc.if_else(pa.array(ok), text, pa.nulls(n, pa.string())))
        for column in ("group", "op"):
            idx, dictionary = chunk.codes(column)
            text = _json_strings(dictionary).take(pa.array(np.where(idx >= 0, idx, 0))) if dictionary else _lit("", n)
            text = pc.binary_join_element_wise(_lit(f'"{column}":', n), text, "")
            args.append(pc.if_else(pa.array(idx >= 0), text, pa.nulls(n, pa.string())))
        joined_args = pc.binary_join_element_wise(*args, ",", null_handling="skip")
        pid = pc.cast(pa.array(chunk.rank + 1), pa.string())
        tids = pc.cast(pa.array(tid), pa.string())
        lines = pc.binary_join_element_wise(
            _lit('{"ph":"X","pid":', n), pid, _lit(',"tid":', n), tids, _lit(',"ts":', n), _micros(start - self.base_ns),
            _lit(',"dur":', n), _micros(dur), _lit(',"name":', n), names, _lit(',"cat":', n), kinds,
            _lit(',"args":{', n), joined_args, _lit("}}", n), "")
        event_rank = chunk.rank

        # send -> receive flows: start at the send's arrival, finish inside the receive's last ns
        kinds_np = np.array(kind_dict, dtype=object)[kind_idx] if n else np.array([], dtype=object)
        seq, seq_ok = chunk.ints["seq"]
        peer, peer_ok = chunk.ints["peer"]
        flows = []
        for kind, phase in ((SpanKind.SEND, "s"), (SpanKind.RECV, "f")):
            rows = np.flatnonzero((kinds_np == kind) & seq_ok & peer_ok)
            if not len(rows):
                continue
            own, other = chunk.rank[rows], peer[rows]
            sender, receiver = (own, other) if phase == "s" else (other, own)
            ids = p2p_flow_ids(sender, receiver, seq[rows])
            ts = start[rows] if phase == "s" else start[rows] + np.maximum(dur[rows] - 1, 0)
            m = len(rows)
            extra = ',"bp":"e"' if phase == "f" else ""
            flows.append((pc.binary_join_element_wise(
                _lit(f'{{"ph":"{phase}","cat":"p2p","name":"send to recv","id":"0x', m),
                pa.array([format(int(i), "x") for i in ids.tolist()], pa.string()),
                _lit('","pid":', m), pc.cast(pa.array(own + 1), pa.string()), _lit(',"tid":', m),
                pc.cast(pa.array(tid[rows]), pa.string()), _lit(',"ts":', m), _micros(ts - self.base_ns), _lit(f"{extra}}}", m), ""),
                own))
            self.stats.flows += m
        if flows:
            lines = pa.concat_arrays([lines, *(f for f, _ in flows)])
            event_rank = np.concatenate([event_rank, *(r for _, r in flows)])
        self.stats.spans += n
        return lines, event_rank, meta_lines


class _JsonFile:
    """One streamed ``{"traceEvents": [...]}`` document."""

    def __init__(self, stream: CountingWriter, other: dict[str, Any], top: dict[str, Any] | None = None) -> None:
        self.stream = stream
        self.first = True
        head = {"displayTimeUnit": "ns", "otherData": other, **(top or {})}
        text = json.dumps(head, sort_keys=True)
        stream.write((text[:-1] + ',"traceEvents":[\n').encode())

    def lines(self, lines: Iterable[str] | pa.Array) -> None:
        if isinstance(lines, pa.Array):
            if not len(lines):
                return
            body = pc.binary_join(pa.array([lines], pa.list_(pa.string())), ",\n")[0].as_py()
            self._write(body)
            return
        for line in lines:
            self._write(line)

    def _write(self, text: str) -> None:
        self.stream.write(((",\n" if not self.first else "") + text).encode())
        self.first = False

    def close(self) -> None:
        self.stream.write(b"\n]}\n")


def export_chrome(
    run: Run | Path | str,
    out: Path | str | IO[bytes],
    *,
    ranks: Iterable[int] | None = None,
    steps: tuple[int, int] | None = None,
    window: tuple[int, int] | None = None,
    around_stragglers: bool = False,
    split_ranks: bool = False,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    clock: str = "estimated",
) -> ExportStats:
    """Write ``run`` (or the selected part) as Chrome trace-event JSON.

    Same selection arguments as :func:`megascope.export.export_perfetto`. With ``split_ranks``,
    ``out`` is a directory that receives ``rank-00017.json`` per rank (for HTA). ``clock``:
    ``"estimated"`` (host clock offsets added) or ``"raw"`` (host clocks as recorded).
    """
    began = time.perf_counter()
    run = as_run(run)
    resolved = resolve(run, make_selection(ranks, steps, window, around_stragglers), clock=clock)
    stats = ExportStats(format="chrome", clock_correction=resolved.clock_source,
                        selection=resolved.selection.describe(), stragglers=resolved.stragglers)
    writer = _ChromeWriter(run, resolved, stats)
    other = {"megascope": {"run_id": run.meta.run_id, "world_size": run.meta.world_size,
                           "mesh": run.meta.mesh_sizes, **resolved.metadata()}}
    if split_ranks:
        _export_split(run, resolved, writer, Path(out) if not hasattr(out, "write") else None, other, chunk_rows)
    else:
        with output_stream(out) as stream:
            doc = _JsonFile(stream, other, {"baseTimeNanoseconds": writer.base_ns})
            doc.lines(json.dumps(e) for e in writer.process_events(int(r) for r in resolved.ranks))
            for chunk in iter_span_chunks(run, resolved, chunk_rows=chunk_rows):
                lines, _, meta = writer.chunk_lines(chunk)
                doc.lines(meta)
                doc.lines(lines)
            doc.close()
            stats.bytes = stream.bytes
    stats.seconds = time.perf_counter() - began
    log.info("chrome export: %d spans, %d bytes in %.2fs", stats.spans, stats.bytes, stats.seconds)
    return stats


def _export_split(run: Run, resolved: Resolved, writer: _ChromeWriter, out: Path | None,
                  other: dict[str, Any], chunk_rows: int) -> None:
    if out is None:
        raise ExportError("split_ranks needs a directory path, not a stream")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory")
    outer = layout.enclosing_run(out)
    if outer is not None:
        raise ExportError(f"{out}: inside the run directory {outer}; write exports outside the run")
    out.mkdir(parents=True, exist_ok=True)
    world = run.meta.world_size
    written: set[int] = set()

    def write_rank(rank: int, lines: pa.Array | None, meta: list[str]) -> None:
        with output_stream(out / f"rank-{rank:05d}.json") as stream:
            # HTA reads each file's rank from distributedInfo
            doc = _JsonFile(stream, other, {"distributedInfo": {"rank": rank, "world_size": world},
                                            "baseTimeNanoseconds": writer.base_ns})
            doc.lines(json.dumps(e) for e in writer.process_events([rank]))
            doc.lines(meta)
            if lines is not None:
                doc.lines(lines)
            doc.close()
            writer.stats.bytes += stream.bytes
        written.add(rank)

    for chunk in iter_span_chunks(run, resolved, chunk_rows=chunk_rows):
        lines, event_rank, meta = writer.chunk_lines(chunk)
        for rank in np.unique(event_rank).tolist():
            rows = np.flatnonzero(event_rank == rank)
            prefix = f'"pid": {rank + 1},'  # json.dumps spacing of the thread-name lines
            write_rank(rank, lines.take(pa.array(rows)), [m for m in meta if prefix in m])
    for rank in resolved.ranks.tolist():
        if rank not in written:
            write_rank(rank, None, [])
