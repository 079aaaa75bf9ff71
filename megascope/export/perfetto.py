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

import hashlib
import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder

from megascope.export import perfetto_layouts as lay
from megascope.export.common import ExportStats, as_run, make_selection, output_stream
from megascope.export.overlap import BackgroundWriter, prefetch
from megascope.export.protowire import encode
from megascope.export.selection import Resolved, resolve
from megascope.export.source import DEFAULT_CHUNK_ROWS, SpanChunk, iter_span_chunks
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

log = logging.getLogger(__name__)

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]

JOB_TRACK_UUID = 1 << 60
_HOST_TRACK_BIT = 1 << 61
_HEARTBEAT_TRACK_BIT = 1 << 62
_P2P_SALT = 0x5EED0FF10D2D
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


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
    """Per-sequence interning tables; new entries go out in one InternedData packet per chunk."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, int]] = {"names": {}, "categories": {}, "strings": {}}
        self.pending: dict[str, list[tuple[int, str]]] = {k: [] for k in self.tables}

    def iids(self, table: str, values: list[str | None]) -> U64:
        """iid per dictionary value (0 for null)."""
        known = self.tables[table]
        out = np.zeros(len(values), dtype=np.uint64)
        for i, value in enumerate(values):
            if value is None:
                continue
            iid = known.get(value)
            if iid is None:
                iid = known[value] = len(known) + 1
                self.pending[table].append((iid, value))
            out[i] = iid
        return out

    def flush(self, builder: StreamingTraceProtoBuilder, *, first: bool = False) -> None:
        if not first and not any(self.pending.values()):
            return
        packet = builder.create_packet()
        packet.trusted_packet_sequence_id = lay.SEQUENCE_ID
        packet.sequence_flags = lay.SEQ_INCREMENTAL_STATE_CLEARED if first else lay.SEQ_NEEDS_INCREMENTAL_STATE
        interned = packet.interned_data
        if first:
            packet.first_packet_on_sequence = True
            for name, iid, _ in lay.ANNOTATIONS:
                interned.debug_annotation_names.add(iid=iid, name=name)
        for iid, name in self.pending["names"]:
            interned.event_names.add(iid=iid, name=name)
        for iid, name in self.pending["categories"]:
            interned.event_categories.add(iid=iid, name=name)
        for iid, text in self.pending["strings"]:
            interned.debug_annotation_string_values.add(iid=iid, str=text.encode())
        builder.write_packet(packet)
        self.pending = {k: [] for k in self.tables}


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
        self.group_hashes: dict[str, int] = {}
        self.ranks_with_processes: set[int] = set()
        self.job_steps: dict[int, tuple[int, int]] = {}  # step -> (first start, slowest rank's duration)

    # ---- descriptors and metadata ------------------------------------------------------------

    def _packet(self) -> pb.TracePacket:
        packet = self.builder.create_packet()
        packet.trusted_packet_sequence_id = lay.SEQUENCE_ID
        return packet

    def write_header(self) -> None:
        self.interner.flush(self.builder, first=True)
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
            placed = " ".join(f"{a}={v}" for a, v in coords.items() if v is not None)
            name = f"rank {rank} · {host}" + (f" · {placed}" if placed else "")
            if rank in stragglers:
                name += " · straggler"
            packet = self._packet()
            desc = packet.track_descriptor
            desc.uuid = process_uuid(rank)
            desc.process.pid = rank + 1
            desc.process.process_name = name
            offset = int(self.resolved.rank_offsets_ns[rank]) if rank < len(self.resolved.rank_offsets_ns) else 0
            desc.process.process_labels.extend(
                [f"host={host}", *(f"{a}={v}" for a, v in coords.items() if v is not None),
                 f"clock_offset_ns={offset}"] + (["straggler"] if rank in stragglers else [])
            )
            desc.child_ordering = pb.TrackDescriptor.ChildTracksOrdering.EXPLICIT
            self.builder.write_packet(packet)
            self.ranks_with_processes.add(rank)
            self.stats.tracks += 1
        self.stats.ranks = len(ordered)

    def _add_track(self, uuid: int, name: str, *, parent: int, unit: str | None = None, order: int | None = None) -> None:
        packet = self._packet()
        desc = packet.track_descriptor
        desc.uuid = uuid
        desc.parent_uuid = parent
        desc.name = name
        if order is not None:
            desc.sibling_order_rank = order
        if unit is not None:
            desc.counter.unit_name = unit
        self.builder.write_packet(packet)
        self.tracks_written.add(uuid)
        self.stats.tracks += 1

    def _stream_tracks(self, uuids: U64) -> None:
        for uuid in np.unique(uuids).tolist():
            if uuid in self.tracks_written:
                continue
            rank, code, lane = (uuid >> 24) - 1, (uuid >> 8) & 0xFFFF, uuid & 0xFF
            stream = self.stream_names[code]
            kind_order, _ = stream_sort_key(stream)
            name = stream if lane == 0 else f"{stream} #{lane + 1}"
            self._add_track(uuid, name, parent=process_uuid(rank), order=kind_order * 256 + lane)

    # ---- spans -------------------------------------------------------------------------------

    def _group_hashes(self, groups: list[str | None]) -> U64:
        out = np.zeros(len(groups), dtype=np.uint64)
        for i, g in enumerate(groups):
            if g is not None:
                if g not in self.group_hashes:
                    self.group_hashes[g] = _hash64(g)
                out[i] = self.group_hashes[g]
        return out

    def write_chunk(self, chunk: SpanChunk) -> None:
        n = len(chunk)
        stream_idx, stream_dict = chunk.codes("stream")
        codes_of_dict = np.array([stream_code(s or "") for s in stream_dict], dtype=np.int64)
        for s, c in zip(stream_dict, codes_of_dict.tolist(), strict=True):
            self.stream_names.setdefault(c, s or "")
        start = chunk.start_ns
        end = start + chunk.dur_ns
        track, span_index, is_end = assign_lanes(track_base(chunk.rank, codes_of_dict[stream_idx]), start, end)
        self._stream_tracks(track)

        name_idx, name_dict = chunk.codes("name")
        kind_idx, kind_dict = chunk.codes("kind")
        name_iid = self.interner.iids("names", name_dict)[name_idx]
        kind_iid = self.interner.iids("categories", kind_dict)[kind_idx]
        group_idx, group_dict = chunk.codes("group")
        op_idx, op_dict = chunk.codes("op")
        strings = {
            "group": (self.interner.iids("strings", group_dict)[group_idx], group_idx >= 0),
            "op": (self.interner.iids("strings", op_dict)[op_idx], op_idx >= 0),
        }
        self.interner.flush(self.builder)

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
            flow[is_send] = p2p_flow_ids(chunk.rank[is_send], peer[is_send], seq[is_send])
        if is_recv.any():
            flow[is_recv] = p2p_flow_ids(peer[is_recv], chunk.rank[is_recv], seq[is_recv])
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

        ev_sig = np.where(is_end, (1 << 20) + is_recv[span_index].astype(np.int64), signature[span_index])
        by_sig = np.argsort(ev_sig, kind="stable")
        bounds = np.flatnonzero(np.diff(ev_sig[by_sig])) + 1
        arrays = []
        for rows in np.split(by_sig, bounds):
            spans = span_index[rows]
            sig = int(ev_sig[rows[0]])
            if sig >= 1 << 20:
                node = lay.slice_end(end[spans].astype(np.uint64), track[spans],
                                     flow[spans] if sig & 1 else None)
            else:
                anns = [(iid, is_string, values[b][spans])
                        for b, (_, iid, is_string) in enumerate(lay.ANNOTATIONS) if sig >> b & 1]
                node = lay.slice_begin(start[spans].astype(np.uint64), track[spans], name_iid[spans],
                                       kind_iid[spans], anns,
                                       flow[spans] if sig >> len(lay.ANNOTATIONS) & 1 else None)
            arrays.append(_fixed_rows(encode(node, len(spans))))
        combined = pa.concat_arrays(arrays)
        inverse = np.empty(len(by_sig), dtype=np.int64)
        inverse[by_sig] = np.arange(len(by_sig))
        self._write_binary(pc.take(combined, pa.array(inverse)))
        self.stats.spans += n

        is_step = _is_kind(kind_idx, kind_dict, SpanKind.STEP)
        if is_step.any():
            self._step_counters(chunk.rank[is_step], start[is_step], chunk.dur_ns[is_step])
            step, step_ok = chunk.ints["step"]
            for s, t, d in zip(step[is_step & step_ok].tolist(), start[is_step & step_ok].tolist(),
                               chunk.dur_ns[is_step & step_ok].tolist(), strict=True):
                first, slowest = self.job_steps.get(s, (t, d))
                self.job_steps[s] = (min(first, t), max(slowest, d))

    def _step_counters(self, ranks: I64, start: I64, dur: I64) -> None:
        for rank in np.unique(ranks).tolist():
            uuid = step_counter_uuid(rank)
            if uuid not in self.tracks_written:
                self._add_track(uuid, "step time (ms)", parent=process_uuid(rank), unit="ms", order=0)
        uuids = np.uint64(step_counter_uuid(0) - process_uuid(0)) | (
            (ranks.astype(np.uint64) + np.uint64(1)) << np.uint64(24))
        order = np.lexsort((start, uuids))
        self._write_counters(start[order], uuids[order], dur[order] / 1e6)

    def _write_counters(self, ts: I64, track: U64, values: npt.NDArray[np.float64]) -> None:
        if len(ts):
            self.out.write(encode(lay.counter(ts.astype(np.uint64), track, values), len(ts)).tobytes())
            self.stats.counter_samples += len(ts)

    def _write_binary(self, arr: pa.Array) -> None:
        offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32, count=len(arr) + 1, offset=arr.offset * 4)
        data = arr.buffers()[2]
        if data is not None:
            self.out.write(memoryview(data)[int(offsets[0]):int(offsets[-1])])

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


def _fixed_rows(block: npt.NDArray[np.uint8]) -> pa.Array:
    """A binary array whose i-th value is row i of ``block``."""
    rows, width = block.shape
    offsets = np.arange(rows + 1, dtype=np.int32) * np.int32(width)
    return pa.Array.from_buffers(pa.binary(), rows, [None, pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(block))])


def export_perfetto(
    run: Run | Path | str,
    out: Path | str | IO[bytes],
    *,
    ranks: Iterable[int] | None = None,
    steps: tuple[int, int] | None = None,
    window: tuple[int, int] | None = None,
    around_stragglers: bool = False,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    clock: str = "estimated",
) -> ExportStats:
    """Write ``run`` (or the selected part) as a Perfetto protobuf trace to ``out``.

    ``ranks``: ranks to keep; ``steps``: inclusive ``(first, last)``; ``window``: ``(start_ns,
    end_ns)`` in corrected epoch ns, keeping spans that overlap it; ``around_stragglers``: keep only
    the stragglers and the peers they make wait; ``clock``: ``"estimated"`` adds each
    host's estimated clock offset (an estimate that fails is an error), ``"raw"`` keeps the host
    clocks as recorded. ``out`` is a path (written atomically) or a
    binary stream. Memory follows ``chunk_rows`` spans, not the run: the scan runs one chunk
    ahead of the encoding and the writes a bounded queue behind it.
    """
    began = time.perf_counter()
    run = as_run(run)
    resolved = resolve(run, make_selection(ranks, steps, window, around_stragglers), clock=clock)
    stats = ExportStats(format="perfetto", clock_correction=resolved.clock_source,
                        selection=resolved.selection.describe(), stragglers=resolved.stragglers)
    with output_stream(out) as stream:
        with BackgroundWriter(stream) as background:
            writer = _PerfettoWriter(run, resolved, background, stats)
            writer.write_header()
            for chunk in prefetch(iter_span_chunks(run, resolved, chunk_rows=chunk_rows)):
                writer.write_chunk(chunk)
            writer.write_job_counters()
            writer.write_heartbeats()
        stats.bytes = stream.bytes
    stats.seconds = time.perf_counter() - began
    log.info("perfetto export: %d spans, %d bytes in %.2fs", stats.spans, stats.bytes, stats.seconds)
    return stats
