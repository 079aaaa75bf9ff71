"""Perfetto export: one protobuf trace of a whole run (or a selection), streamed chunk by chunk.

Role in the data flow: store -> export. ``megascope export perfetto RUN -o FILE`` and the
dashboard's "download this selection" call :func:`export_perfetto`. What the trace holds:

* one process per rank (pid = rank + 1), named ``rank 17 · node-03 · pp=1 dp=2 tp=1``, written in
  host order, labelled with host, coordinates and the clock offset applied;
* under each rank a track per stream (``host``, ``compute``, ``comm``...; ``comm #2`` where
  asynchronous spans overlap) with a slice per span, annotated with step, micro-batch, group, seq,
  op, bytes and peer;
* flows: the members of each collective instance (same group and seq) are chained in arrival order,
  so the last arrow ends at the rank everyone waited for; each send links to the end of its receive;
* counters: each rank's step time, the job's step time and MFU per step, and every numeric
  heartbeat metric (GPU, host, NIC) under its rank or host;
* trace metadata (Info and stats): run id, selection, clock correction and the offsets used.

Times are host wall-clock epoch ns plus the host's estimated clock offset
(``megascope.analysis.base.estimate_clock_offsets``), or as recorded with ``clock="raw"``; the
metadata says which.

Low-volume packets (descriptors, interned strings, metadata) go through the ``perfetto`` package's
``StreamingTraceProtoBuilder``; the per-span packets through :mod:`megascope.export.protowire`,
a vectorised encoder, because building one Python protobuf object per span costs microseconds. The same run
and selection always give the same bytes: track ids, flow ids and the write order derive from data.

Example::

    from megascope.export import export_perfetto
    stats = export_perfetto("runs/demo", Path("demo.pftrace"), steps=(10, 12))
    stats.spans, stats.bytes
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder

from megascope.export import perfetto_layouts as lay
from megascope.export.common import ExportStats, as_run, make_selection, output_stream
from megascope.export.memory import kept_heap
from megascope.export.overlap import BackgroundWriter, Prefetch
from megascope.export.protowire import Node, encode, varint_width
from megascope.export.selection import Resolved, Selection, check_clock, resolve, spans_to_read
from megascope.export.source import SpanChunk, iter_span_chunks
from megascope.export.tracks import (
    assign_lanes,
    process_uuid,
    step_counter_uuid,
    stream_code,
    stream_sort_key,
    track_base,
)
from megascope.schema import SpanKind
from megascope.store import Run
from megascope.topology import format_coords

log = logging.getLogger(__name__)

U8 = npt.NDArray[np.uint8]
U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]

# Spans per chunk: smaller chunks keep less memory in flight (three stages hold a chunk each) and
# fill the pipeline sooner; much smaller ones pay the per-chunk work more often.
CHUNK_ROWS = 200_000
JOB_TRACK_UUID = 1 << 60
_HOST_TRACK_BIT = 1 << 61
_HEARTBEAT_TRACK_BIT = 1 << 62
_P2P_SALT = 0x5EED0FF10D2D
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_EXPLICIT = pb.TrackDescriptor.ChildTracksOrdering.EXPLICIT


def _splitmix(x: U64) -> U64:
    """A 64-bit mixer (splitmix64's finaliser): distinct inputs -> well-spread flow ids."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return (z ^ (z >> np.uint64(31))) | np.uint64(1)


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def collective_flow_ids(group_hash: U64, seq: I64) -> U64:
    """One flow id per collective instance (group, seq), the same on every member."""
    with np.errstate(over="ignore"):
        return _splitmix(group_hash ^ (seq.astype(np.uint64) * _GOLDEN))


def p2p_flow_ids(sender: I64, receiver: I64, seq: I64) -> U64:
    """One flow id per (sender, receiver, seq): a send and its matching receive share it."""
    with np.errstate(over="ignore"):
        pair = _splitmix((sender.astype(np.uint64) << np.uint64(32)) ^ receiver.astype(np.uint64) ^ np.uint64(_P2P_SALT))
        return _splitmix(pair ^ (seq.astype(np.uint64) * _GOLDEN))


class _Interner:
    """Per-sequence interning tables. A value gets its iid where the lowest rank that uses it is
    written (iids in the order (that rank, value)), and goes out in one InternedData packet just
    before that rank's events: the same spans give the same packets however they are chunked."""

    TABLES = ("names", "categories", "strings")

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, int]] = {k: {} for k in self.TABLES}
        self.pending: dict[int, list[tuple[str, int, str]]] = {}  # rank -> (table, iid, value)

    def iids(self, table: str, columns: list[tuple[list[str | None], I64]], ranks: I64) -> list[U64]:
        """Per column (dictionary values, per-span codes with -1 for null): the iid of each
        dictionary value (0 for null or unused ones). ``ranks`` per span say which rank uses a
        value first; the columns of one table are numbered together."""
        known = self.tables[table]
        never = np.iinfo(np.int64).max
        first_use: dict[str, int] = {}
        for values, codes in columns:
            if all(v is None or v in known for v in values):
                continue
            first = np.full(len(values), never, dtype=np.int64)
            used = codes >= 0
            np.minimum.at(first, codes[used], ranks[used])
            for value, rank in zip(values, first.tolist(), strict=True):
                if value is not None and value not in known and rank != never:
                    first_use[value] = min(rank, first_use.get(value, never))
        for value in sorted(first_use, key=lambda v: (first_use[v], v)):
            iid = known[value] = len(known) + 1
            self.pending.setdefault(first_use[value], []).append((table, iid, value))
        return [np.array([0 if v is None else known.get(v, 0) for v in values], dtype=np.uint64)
                for values, _ in columns]

    def write_header(self, builder: StreamingTraceProtoBuilder) -> None:
        packet = builder.create_packet()
        packet.trusted_packet_sequence_id = lay.SEQUENCE_ID
        packet.sequence_flags = lay.SEQ_INCREMENTAL_STATE_CLEARED
        packet.first_packet_on_sequence = True
        for name, iid, _ in lay.ANNOTATIONS:
            packet.interned_data.debug_annotation_names.add(iid=iid, name=name)
        builder.write_packet(packet)

    def flush(self, builder: StreamingTraceProtoBuilder, rank: int) -> None:
        """The values first used by ``rank``, if any."""
        entries = self.pending.pop(rank, None)
        if not entries:
            return
        packet = builder.create_packet()
        packet.trusted_packet_sequence_id = lay.SEQUENCE_ID
        packet.sequence_flags = lay.SEQ_NEEDS_INCREMENTAL_STATE
        interned = packet.interned_data
        for table in self.TABLES:
            for kind, iid, value in entries:
                if kind != table:
                    continue
                if table == "names":
                    interned.event_names.add(iid=iid, name=value)
                elif table == "categories":
                    interned.event_categories.add(iid=iid, name=value)
                else:
                    interned.debug_annotation_string_values.add(iid=iid, str=value.encode())
        builder.write_packet(packet)


@dataclass
class _OrderedChunk:
    """A chunk with its spans placed on tracks and its begin/end events in write order."""

    chunk: SpanChunk
    track: U64
    span_index: I64
    is_end: npt.NDArray[np.bool_]
    streams: list[tuple[str, int]]  # (stream name, code) of the chunk's streams

    def corrected(self, rank_offsets_ns: I64) -> _OrderedChunk:
        """The same, its starts on the export's clock: a rank's offset moves all its spans
        alike, so tracks and event order stay as they are."""
        return dataclasses.replace(self, chunk=self.chunk.corrected(rank_offsets_ns))


def _order_chunk(chunk: SpanChunk) -> _OrderedChunk:
    """Tracks (lanes where spans overlap) and the event order of one chunk: pure, so it runs in
    the reading thread, beside the encoding of the chunk before."""
    stream_idx, stream_dict = chunk.codes("stream")
    codes_of_dict = np.array([stream_code(s or "") for s in stream_dict], dtype=np.int64)
    streams = [(s or "", c) for s, c in zip(stream_dict, codes_of_dict.tolist(), strict=True)]
    columns = [chunk.codes(c) for c in ("name", "kind", "group", "op")]

    def tiebreak(spans: I64) -> list[I64]:
        """What tells apart spans of one track with the same start and end: every field the
        begin event carries, strings by value rather than by their place in the chunk."""
        keys = [_value_order(idx[spans], values) for idx, values in columns]
        for column in ("step", "microbatch", "chunk", "seq", "bytes", "peer"):
            values, ok = chunk.ints[column]
            keys += [ok[spans].astype(np.int64), values[spans]]
        return keys

    start = chunk.start_ns
    track, span_index, is_end = assign_lanes(track_base(chunk.rank, codes_of_dict[stream_idx]), start,
                                             start + chunk.dur_ns, tiebreak)
    return _OrderedChunk(chunk, track, span_index, is_end, streams)


@dataclass
class _EncodedChunk:
    """A chunk's events encoded in write order, cut rank by rank."""

    data: U8
    bounds: list[int]  # where each rank's events begin in ``data``, and the end
    ranks: list[int]
    tracks: list[int]  # the chunk's tracks, ascending (so by rank)
    counters: dict[int, bytes]  # rank -> its step-time samples, encoded


class _PerfettoWriter:
    def __init__(self, run: Run, resolved: Resolved, out: BackgroundWriter, stats: ExportStats) -> None:
        self.run = run
        self.resolved = resolved
        self.out = out
        self.builder = StreamingTraceProtoBuilder(out)  # type: ignore[arg-type]
        self.stats = stats
        self.interner = _Interner()
        self.tracks_written: set[int] = set()
        self.stream_names: dict[int, str] = {}
        self.track_names: dict[int, tuple[str, int]] = {}  # stream code << 8 | lane -> (name, sibling order)
        self.group_hashes: dict[str, int] = {}
        self.ranks_with_processes: set[int] = set()
        self.job_steps: dict[int, tuple[int, int]] = {}  # step -> (first start, slowest rank's duration)

    # ---- descriptors and metadata ------------------------------------------------------------

    def _packet(self) -> pb.TracePacket:
        packet = self.builder.create_packet()
        packet.trusted_packet_sequence_id = lay.SEQUENCE_ID
        return packet

    def write_header(self) -> None:
        self.interner.write_header(self.builder)
        meta = self.run.meta
        packet = self._packet()
        bundle = packet.chrome_events
        entries = {
            "megascope.run_id": meta.run_id,
            "megascope.source": meta.source,
            "megascope.world_size": str(meta.world_size),
            "megascope.mesh": json.dumps(meta.mesh_sizes, sort_keys=True),
            **{f"megascope.{k}": v if isinstance(v, str) else json.dumps(v, sort_keys=True)
               for k, v in self.resolved.metadata().items()},
        }
        for name, value in entries.items():
            bundle.metadata.add(name=name, string_value=value)
        self.builder.write_packet(packet)

        job = self._packet()
        job.track_descriptor.uuid = JOB_TRACK_UUID
        job.track_descriptor.name = f"job {meta.run_id}"
        self.builder.write_packet(job)
        self._add_track(JOB_TRACK_UUID + 1, "step time (ms)", parent=JOB_TRACK_UUID, unit="ms")
        self._add_track(JOB_TRACK_UUID + 2, "MFU (%)", parent=JOB_TRACK_UUID, unit="%")
        self._write_processes()

    def _write_processes(self) -> None:
        hosts = self.resolved.rank_info
        selected = [int(r) for r in self.resolved.ranks]
        # host order groups a host's ranks together; ranks the ranks table misses come last
        ordered = sorted((r for r in selected if r in hosts), key=lambda r: (hosts[r][0], r))
        ordered += [r for r in selected if r not in hosts]
        stragglers = set(self.resolved.stragglers)
        for rank in ordered:
            rank = int(rank)
            host, coords = hosts.get(rank, ("unknown host", {}))
            placed = format_coords(coords)
            name = f"rank {rank} · {host}" + (f" · {placed}" if placed else "")
            if rank in stragglers:
                name += " · straggler"
            offset = int(self.resolved.rank_offsets_ns[rank]) if rank < len(self.resolved.rank_offsets_ns) else 0
            labels = [f"host={host}", *(f"{a}={v}" for a, v in coords.items()),
                      f"clock_offset_ns={offset}"] + (["straggler"] if rank in stragglers else [])
            self.out.write(lay.track_descriptor(process_uuid(rank), process=lay.process_descriptor(rank + 1, name, labels),
                                                child_ordering=_EXPLICIT))
            self.ranks_with_processes.add(rank)
            self.stats.tracks += 1
        self.stats.ranks = len(ordered)

    def _add_track(self, uuid: int, name: str, *, parent: int, unit: str | None = None, order: int | None = None) -> None:
        self.out.write(lay.track_descriptor(uuid, name=name, parent=parent, unit=unit, order=order))
        self.tracks_written.add(uuid)
        self.stats.tracks += 1

    def _stream_tracks(self, uuids: list[int]) -> None:
        for uuid in uuids:
            if uuid in self.tracks_written:
                continue
            kind = uuid & 0xFFFFFF  # stream code and lane
            named = self.track_names.get(kind)
            if named is None:
                stream, lane = self.stream_names[kind >> 8], kind & 0xFF
                name = stream if lane == 0 else f"{stream} #{lane + 1}"
                named = self.track_names[kind] = (name, stream_sort_key(stream)[0] * 256 + lane)
            self._add_track(uuid, named[0], parent=uuid & ~0xFFFFFF, order=named[1])

    # ---- spans -------------------------------------------------------------------------------

    def _group_hashes(self, groups: list[str | None]) -> U64:
        out = np.zeros(len(groups), dtype=np.uint64)
        for i, g in enumerate(groups):
            if g is not None:
                if g not in self.group_hashes:
                    self.group_hashes[g] = _hash64(g)
                out[i] = self.group_hashes[g]
        return out

    def encode_chunk(self, ordered: _OrderedChunk) -> _EncodedChunk | None:
        """The chunk's begin/end events and step-time samples, encoded, and where each rank's
        begin: runs in a thread of its own, a chunk ahead of :meth:`write_chunk`. It alone numbers
        interned strings (chunk after chunk, in order), so the iids are those of a serial export."""
        chunk, track, span_index, is_end = ordered.chunk, ordered.track, ordered.span_index, ordered.is_end
        n = len(chunk)
        if n == 0:
            return None
        rank = chunk.rank
        for s, c in ordered.streams:
            self.stream_names.setdefault(c, s)
        start = chunk.start_ns
        end = start + chunk.dur_ns
        name_idx, name_dict = chunk.codes("name")
        kind_idx, kind_dict = chunk.codes("kind")
        group_idx, group_dict = chunk.codes("group")
        op_idx, op_dict = chunk.codes("op")

        (name_iids,) = self.interner.iids("names", [(name_dict, name_idx)], rank)
        (kind_iids,) = self.interner.iids("categories", [(kind_dict, kind_idx)], rank)
        group_iids, op_iids = self.interner.iids("strings", [(group_dict, group_idx), (op_dict, op_idx)], rank)
        name_iid, kind_iid = name_iids[name_idx], kind_iids[kind_idx]
        strings = {"group": (group_iids[group_idx], group_idx >= 0), "op": (op_iids[op_idx], op_idx >= 0)}

        # Flows: every collective member starts or steps its instance's flow; a send starts the
        # flow that its receive's end terminates.
        seq, seq_ok = chunk.ints["seq"]
        peer, peer_ok = chunk.ints["peer"]
        is_coll = _is_kind(kind_idx, kind_dict, SpanKind.COLLECTIVE) & (group_idx >= 0) & seq_ok
        is_send = _is_kind(kind_idx, kind_dict, SpanKind.SEND) & peer_ok & seq_ok
        is_recv = _is_kind(kind_idx, kind_dict, SpanKind.RECV) & peer_ok & seq_ok
        flow = np.zeros(n, dtype=np.uint64)
        if is_coll.any():
            gh = self._group_hashes(group_dict)[group_idx]
            flow[is_coll] = collective_flow_ids(gh[is_coll], seq[is_coll])
        if is_send.any():
            flow[is_send] = p2p_flow_ids(rank[is_send], peer[is_send], seq[is_send])
        if is_recv.any():
            flow[is_recv] = p2p_flow_ids(peer[is_recv], rank[is_recv], seq[is_recv])
        begin_flow = is_coll | is_send
        self.stats.flows += int((is_coll | is_send | is_recv).sum())

        # Which annotations each span carries -> one layout per combination.
        present = []
        values = []
        for name, _, is_string in lay.ANNOTATIONS:
            if is_string:
                v, ok = strings[name]
            else:
                raw, ok = chunk.ints[name]
                v = lay.int_annotation_values(raw)
            present.append(ok)
            values.append(v)
        signature = np.zeros(n, dtype=np.int64)
        for bit, ok in enumerate(present):
            signature |= ok.astype(np.int64) << bit
        signature |= begin_flow.astype(np.int64) << len(present)

        # Every varint is written in its shortest form (the canonical encoding), so that a value
        # has the same bytes whatever else shares its chunk: events are grouped by layout and by
        # the byte widths of the fields whose width varies.
        begin_key = signature.copy()
        for column in (start, track, name_iid, kind_iid):
            begin_key = _with_width(begin_key, column, None)
        for column, ok in zip(values, present, strict=True):
            begin_key = _with_width(begin_key, column, ok)
        end_key = _with_width(_with_width(is_recv.astype(np.int64), end, None), track, None)
        ev_key = np.where(is_end, end_key[span_index] | _END_KEY, begin_key[span_index])

        def layout(rows: I64) -> Node:
            spans = span_index[rows]
            if is_end[rows[0]]:
                return lay.slice_end(end[spans].astype(np.uint64), track[spans],
                                     flow[spans] if is_recv[spans[0]] else None)
            sig = int(signature[spans[0]])
            anns = [(iid, is_string, values[b][spans])
                    for b, (_, iid, is_string) in enumerate(lay.ANNOTATIONS) if sig >> b & 1]
            return lay.slice_begin(start[spans].astype(np.uint64), track[spans], name_iid[spans],
                                   kind_iid[spans], anns,
                                   flow[spans] if sig >> len(lay.ANNOTATIONS) & 1 else None)

        data, event_bytes = _encode_grouped(ev_key, layout)
        self.stats.spans += n

        # Step-time counters, per rank in time order.
        is_step = _is_kind(kind_idx, kind_dict, SpanKind.STEP)
        counter_rows = self._step_counters(rank[is_step], start[is_step], chunk.dur_ns[is_step])
        step, step_ok = chunk.ints["step"]
        with_step = is_step & step_ok
        if with_step.any():  # per step: the chunk's first start and slowest step span
            by_step = np.argsort(step[with_step], kind="stable")
            steps = step[with_step][by_step]
            heads = np.concatenate([[0], np.flatnonzero(np.diff(steps)) + 1])
            firsts = np.minimum.reduceat(start[with_step][by_step], heads)
            slowests = np.maximum.reduceat(chunk.dur_ns[with_step][by_step], heads)
            for s, t, d in zip(steps[heads].tolist(), firsts.tolist(), slowests.tolist(), strict=True):
                first, slowest = self.job_steps.get(s, (t, d))
                self.job_steps[s] = (min(first, t), max(slowest, d))

        # Rank by rank (tracks sort by rank first, so each rank's events are one run).
        event_track = track[span_index]  # ascending: events sort by track first
        event_rank = (event_track >> np.uint64(24)).astype(np.int64) - 1
        cuts = np.flatnonzero(np.diff(event_rank)) + 1
        firsts = np.concatenate([[0], cuts])
        tracks_of = event_track[np.concatenate([[0], np.flatnonzero(np.diff(event_track)) + 1])].tolist()
        return _EncodedChunk(data, event_bytes[np.concatenate([firsts, [len(event_rank)]])].tolist(),
                             event_rank[firsts].tolist(), tracks_of, counter_rows)

    def write_chunk(self, encoded: _EncodedChunk | None) -> None:
        """The chunk's spans, rank by rank: each rank's new track descriptors and interned strings,
        its begin/end events, its step-time counter. Nothing depends on where the chunks are cut
        or on the order the spans came in, so a run gives the same bytes however it is stored."""
        if encoded is None:
            return
        data, bounds, tracks_of, counter_rows = encoded.data, encoded.bounds, encoded.tracks, encoded.counters
        track_ranks = [(t >> 24) - 1 for t in tracks_of]
        t_lo = 0
        for i, r in enumerate(encoded.ranks):
            t_hi = bisect.bisect_right(track_ranks, r, lo=t_lo)
            self._stream_tracks(tracks_of[t_lo:t_hi])
            t_lo = t_hi
            counters = counter_rows.get(r)
            if counters is not None and step_counter_uuid(r) not in self.tracks_written:
                self._add_track(step_counter_uuid(r), "step time (ms)", parent=process_uuid(r), unit="ms", order=0)
            self.interner.flush(self.builder, r)
            self.out.write(data[bounds[i]:bounds[i + 1]].data)
            if counters is not None:
                self.out.write(counters)

    def _step_counters(self, ranks: I64, start: I64, dur: I64) -> dict[int, bytes]:
        """Each rank's step-time samples, encoded, in (time, value) order."""
        if not len(ranks):
            return {}
        uuids = np.uint64(step_counter_uuid(0) - process_uuid(0)) | (
            (ranks.astype(np.uint64) + np.uint64(1)) << np.uint64(24))
        order = np.lexsort((dur, start, ranks))
        data, offsets = _encode_counters(start[order], uuids[order], dur[order] / 1e6)
        self.stats.counter_samples += len(order)
        sorted_ranks = ranks[order]
        cuts = np.flatnonzero(np.diff(sorted_ranks)) + 1
        out: dict[int, bytes] = {}
        for a, b in zip(np.concatenate([[0], cuts]).tolist(), np.concatenate([cuts, [len(order)]]).tolist(), strict=True):
            out[int(sorted_ranks[a])] = data[int(offsets[a]):int(offsets[b])].tobytes()
        return out

    def _write_counters(self, ts: I64, track: U64, values: npt.NDArray[np.float64]) -> None:
        if len(ts):
            data, _ = _encode_counters(ts, track, values)
            self.out.write(data.tobytes())
            self.stats.counter_samples += len(ts)

    # ---- job counters and heartbeats ---------------------------------------------------------

    def _offsets_table(self) -> None:
        offsets = self.resolved.rank_offsets_ns
        self.cur = self.run.cursor()
        self.cur.register("_export_offsets", pa.table({
            "rank": pa.array(np.arange(len(offsets)), pa.int32()), "offset_ns": pa.array(offsets, pa.int64())}))
        self.cur.register("_export_ranks", pa.table({"rank": pa.array(self.resolved.ranks, pa.int32())}))

    def write_job_counters(self) -> None:
        """The job's step time (its slowest rank) and MFU, per step, from the step spans seen."""
        self._offsets_table()
        if not self.job_steps:
            return
        steps = sorted(self.job_steps)
        ts = np.array([self.job_steps[s][0] for s in steps], dtype=np.int64)
        slowest = np.array([self.job_steps[s][1] for s in steps], dtype=np.float64)
        self._write_counters(ts, np.full(len(ts), JOB_TRACK_UUID + 1, dtype=np.uint64), slowest / 1e6)
        meta = self.run.meta
        if meta.model_flops_per_step and meta.peak_flops_per_device:
            mfu = meta.model_flops_per_step / (np.maximum(slowest, 1) / 1e9 * meta.world_size * meta.peak_flops_per_device)
            self._write_counters(ts, np.full(len(ts), JOB_TRACK_UUID + 2, dtype=np.uint64), mfu * 100)

    def write_heartbeats(self) -> None:
        if not self.run.has_rows("heartbeats"):
            return
        host_rows = self.cur.execute(
            "SELECT DISTINCT host FROM ranks WHERE rank IN (SELECT rank FROM _export_ranks) ORDER BY host").fetchall()
        hosts = [h for (h,) in host_rows]
        if not hosts:
            return
        offsets = {h: o for h, (o, _) in self.resolved.host_offsets.items()}
        self.cur.register("_export_hosts", pa.table({
            "host": pa.array(hosts, pa.string()), "offset_ns": pa.array([offsets.get(h, 0) + self.resolved.shift_ns for h in hosts], pa.int64())}))
        window = ""
        if self.resolved.window is not None:
            lo, hi = self.resolved.window
            margin = self.resolved.max_abs_offset_ns
            window = f"AND time_ns BETWEEN {lo - margin} AND {hi + margin}"
        reader = self.cur.sql(
            f"""SELECT h.host, h.rank, h.device, h.metric, h.time_ns + x.offset_ns AS t, h.value
                FROM heartbeats h JOIN _export_hosts x USING (host)
                WHERE h.value IS NOT NULL AND isfinite(h.value) AND h.time_ns + x.offset_ns >= 0
                  AND (h.rank IS NULL OR h.rank IN (SELECT rank FROM _export_ranks)) {window}
                ORDER BY h.host, h.rank NULLS FIRST, h.device NULLS FIRST, h.metric, t"""
        ).to_arrow_reader(200_000)
        for batch in reader:
            self._heartbeat_batch(pa.Table.from_batches([batch]))

    def _heartbeat_batch(self, table: pa.Table) -> None:
        keys = pc.binary_join_element_wise(
            pc.fill_null(table.column("host"), ""), pc.fill_null(pc.cast(table.column("rank"), pa.string()), ""),
            pc.fill_null(table.column("device"), ""), table.column("metric"), "\x1f")
        encoded = pc.dictionary_encode(keys).combine_chunks()
        uuids = np.zeros(len(encoded.dictionary), dtype=np.uint64)
        for i, key in enumerate(encoded.dictionary.to_pylist()):
            host, rank, device, metric = key.split("\x1f")
            uuid = _HEARTBEAT_TRACK_BIT | (_hash64(key) >> 4)
            uuids[i] = uuid
            if uuid in self.tracks_written:
                continue
            if rank and int(rank) in self.ranks_with_processes:
                parent = process_uuid(int(rank))
            else:
                parent = _HOST_TRACK_BIT | (_hash64(host) >> 4)
                if parent not in self.tracks_written:
                    self._add_host_track(parent, host)
            self._add_track(uuid, f"{metric} {device}".strip(), parent=parent, order=1 << 20)
        track = uuids[encoded.indices.to_numpy(zero_copy_only=False)]
        ts = table.column("t").to_numpy().astype(np.int64)
        values = table.column("value").to_numpy().astype(np.float64)
        self._write_counters(ts, track, values)

    def _add_host_track(self, uuid: int, host: str) -> None:
        packet = self._packet()
        packet.track_descriptor.uuid = uuid
        packet.track_descriptor.name = f"host {host}"
        self.builder.write_packet(packet)
        self.tracks_written.add(uuid)
        self.stats.tracks += 1


def _is_kind(kind_idx: I64, kind_dict: list[str | None], kind: str) -> npt.NDArray[np.bool_]:
    """Rows whose kind is ``kind``, compared on dictionary codes rather than strings."""
    codes = [i for i, k in enumerate(kind_dict) if k == kind]
    return kind_idx == codes[0] if codes else np.zeros(len(kind_idx), dtype=np.bool_)


_END_KEY = np.int64(1 << 62)
# The smallest value of each varint width past one byte: 2**7, 2**14, ... 2**63.
_VARINT_STEPS = np.array([1 << (7 * k) for k in range(1, 10)], dtype=np.uint64)


def _with_width(key: I64, column: npt.NDArray[np.integer[Any]], present: npt.NDArray[np.bool_] | None) -> I64:
    """``key`` extended by the shortest varint width of each row's value (where ``present``),
    unless every row's value takes the same width."""
    values = column.view(np.uint64) if column.dtype == np.int64 else column
    lo, hi = (int(values.min()), int(values.max())) if len(values) else (0, 0)
    narrow, wide = varint_width(lo), varint_width(hi)
    if narrow == wide:
        return key
    # the number of steps at or below each value (its width less one), counting only the
    # steps between the lowest and highest value's widths
    width = np.full(len(values), narrow - 1, dtype=np.int64)
    for step in _VARINT_STEPS[narrow - 1:wide - 1]:
        width += values >= step
    if present is not None:
        width *= present
    return key * 10 + width


def _encode_grouped(keys: I64, layout: Callable[[I64], Node]) -> tuple[U8, I64]:
    """Rows encoded by group (rows with equal ``keys`` share one layout), laid out in row order:
    the bytes, and where each row starts (one more offset: the end)."""
    # few distinct keys: as 16-bit codes, numpy's stable sort is a radix sort
    codes, uniques = pd.factorize(keys, sort=True)
    small = codes.astype(np.uint16) if len(uniques) <= 1 << 16 else codes
    by_key = np.argsort(small, kind="stable")
    bounds = np.flatnonzero(np.diff(small[by_key])) + 1
    groups = [(rows, layout(rows)) for rows in np.split(by_key, bounds)]
    widths = np.array([node.width() for _, node in groups], dtype=np.int64)
    offsets = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum(widths[codes], out=offsets[1:])
    if len(groups) == 1:
        rows, node = groups[0]
        return encode(node, len(rows)).reshape(-1), offsets
    out = np.empty(int(offsets[-1]), dtype=np.uint8)
    for (rows, node), width in zip(groups, widths.tolist(), strict=True):
        # every window of ``width`` bytes of ``out`` as one opaque item: the group's rows go to
        # their offsets, a copy of ``width`` bytes each
        item = np.dtype((np.void, width))
        windows = np.ndarray(shape=(len(out) - width + 1,), dtype=item, buffer=out, strides=(1,))
        windows[offsets[rows]] = encode(node, len(rows)).view(item).reshape(-1)
    return out, offsets


def _encode_counters(ts: I64, track: U64, values: npt.NDArray[np.float64]) -> tuple[U8, I64]:
    """Counter samples in canonical encoding, in the given order: bytes and row offsets."""
    keys = _with_width(_with_width(np.zeros(len(ts), dtype=np.int64), ts, None), track, None)
    return _encode_grouped(keys, lambda rows: lay.counter(ts[rows].astype(np.uint64), track[rows], values[rows]))


def _value_order(codes: I64, values: list[str | None]) -> I64:
    """Per span, the place of its dictionary value among the values sorted (-1 for null)."""
    order = sorted(range(len(values)), key=lambda i: (values[i] is not None, values[i] or ""))
    place = np.empty(len(values) + 1, dtype=np.int64)
    place[np.array(order, dtype=np.int64)] = np.arange(len(values))
    place[-1] = -1  # code -1 (null) indexes the last entry
    return place[codes]


def export_perfetto(
    run: Run | Path | str,
    out: Path | str | IO[bytes],
    *,
    ranks: Iterable[int] | None = None,
    steps: tuple[int, int] | None = None,
    window: tuple[int, int] | None = None,
    around_stragglers: bool = False,
    chunk_rows: int = CHUNK_ROWS,
    clock: str = "estimated",
) -> ExportStats:
    """Write ``run`` (or the selected part) as a Perfetto protobuf trace to ``out``.

    ``ranks``: ranks to keep; ``steps``: inclusive ``(first, last)``; ``window``: ``(start_ns,
    end_ns)`` in corrected epoch ns, keeping spans that overlap it; ``around_stragglers``: keep only
    the stragglers and the peers they make wait; ``clock``: ``"estimated"`` adds each
    host's estimated clock offset (an estimate that fails is an error), ``"raw"`` keeps the host
    clocks as recorded. ``out`` is a path (written atomically) or a
    binary stream. Memory follows ``chunk_rows`` spans, not the run: reading (and ordering),
    encoding and writing run in three threads, each a chunk (the writes a bounded queue) behind
    the one before.
    """
    began = time.perf_counter()
    run = as_run(run)
    check_clock(clock)
    selection = make_selection(ranks, steps, window, around_stragglers)
    with kept_heap():
        stats = _export(run, selection, out, clock=clock, chunk_rows=chunk_rows)
    stats.seconds = time.perf_counter() - began
    log.info("perfetto export: %d spans, %d bytes in %.2fs", stats.spans, stats.bytes, stats.seconds)
    return stats


def _export(run: Run, selection: Selection, out: Path | str | IO[bytes], *, clock: str, chunk_rows: int) -> ExportStats:
    """:func:`export_perfetto` once the selection is made, its memory kept for the next chunk."""
    # A host's clock offset moves all its ranks' spans alike, so the first chunks are read and
    # ordered on the recorded times while the ranks table is read and the clock estimated, and
    # the offsets are added before encoding (not with a window, placed in corrected time, nor
    # around the stragglers, whose ranks the analysis finds).
    reading = spans_to_read(run, selection)
    with ThreadPoolExecutor(1, thread_name_prefix="megascope-export-resolve") as pool:
        resolving = pool.submit(resolve, run, selection, clock=clock)
        if reading is not None:
            ordered = Prefetch(map(_order_chunk, iter_span_chunks(run, reading, chunk_rows=chunk_rows,
                                                                  corrected=False)))
        try:
            resolved = resolving.result()
        except BaseException:
            if reading is not None:
                ordered.close()
            raise
    chunks: Iterable[_OrderedChunk]
    if reading is not None:
        chunks = (o.corrected(resolved.rank_offsets_ns) for o in ordered)
    else:
        ordered = Prefetch(map(_order_chunk, iter_span_chunks(run, resolved, chunk_rows=chunk_rows)))
        chunks = ordered
    stats = ExportStats(format="perfetto", clock_correction=resolved.clock_source,
                        selection=resolved.selection.describe(), stragglers=resolved.stragglers)
    with ordered, output_stream(out) as stream:
        with BackgroundWriter(stream) as background:
            writer = _PerfettoWriter(run, resolved, background, stats)
            writer.write_header()
            # three stages in threads of their own: read and order, encode, write out
            with Prefetch(map(writer.encode_chunk, chunks)) as encoded_chunks:
                for encoded in encoded_chunks:
                    writer.write_chunk(encoded)
            writer.write_job_counters()
            writer.write_heartbeats()
        stats.bytes = stream.bytes
    return stats
