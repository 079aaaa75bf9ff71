"""Map one rank's collected Kineto events onto megascope spans and markers.

Role in the data flow: after :mod:`megascope.ingest.kineto_events`, before the Parquet parts are
written. The rules (docs/ingest.md has the user's view):

* time: ``baseTimeNanoseconds + ts * 1000`` = epoch ns (older traces with absolute µs: base 0);
* ``ProfilerStep#N`` -> a ``step`` span on stream ``host``; every other span takes the step whose
  host range holds its launch (GPU work) or its start (host work);
* GPU kernels, memcpy, memset -> spans on stream ``cuda:<stream id>``; their kind comes from the
  top-level host op that launched them: a ``fwdbwd`` flow start (or nothing backward about it
  before the backward) -> ``forward``, an autograd function / autograd thread / flow end ->
  ``backward``, ``Optimizer.*`` -> ``optimizer``, ``enumerate(DataLoader)*`` -> ``data``, else
  ``compute``;
* CPU-only traces (no GPU activity): the top-level host ops themselves are the compute spans;
* NCCL kernels -> ``collective`` / ``send`` / ``recv`` spans that start at the kernel's start (the
  rank's arrival on the device) and end at its end, with op, bytes, group, seq and peer from the
  ``record_param_comms`` that launched them (or the kernel's own arguments);
* gloo: each ``c10d::*`` call (enqueue) is paired with the next ``gloo:*`` execution of the same op
  on a worker thread; the span is the execution, the markers are enqueue -> execution end;
* seq: the trace's ``Seq`` where present, else the call's order in its group on this rank
  (1-based); p2p: the order per (sender, receiver) pair.

Host ops and GPU spans, most of a trace's rows, are mapped column by column (numpy searches and
Arrow arrays, no Python loop per kernel); the communication calls, a few per step, one at a time.
A host op whose time is NaN (only the standard library reads such a file) is refused.

Example::

    tables = map_rank(events, rank=3, pg_groups={"0": ("world", (0, 1, 2, 3))})
    tables.spans.num_rows, tables.markers.num_rows
"""

from __future__ import annotations

import bisect
import functools
import logging
import re
from collections import Counter, defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import repeat
from operator import is_not
from typing import Any

import numpy as np
import pyarrow as pa

from megascope import schema
from megascope.errors import IngestError
from megascope.ingest.kineto_events import CommCall, DeviceEvent, RankEvents
from megascope.schema import CollectiveOp, MarkerState, SpanKind, Stream

log = logging.getLogger(__name__)

_DTYPE_BYTES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "bfloat16": 2, "half": 2, "float16": 2,
    "long": 8, "int64": 8, "int": 4, "int32": 4, "short": 2, "int16": 2, "byte": 1, "uint8": 1,
    "char": 1, "int8": 1, "bool": 1, "complexfloat": 8, "complexdouble": 16,
}
_P2P_NAME = re.compile(r"(send|recv)\s+(\d+)\s*(?:->|<-)\s*(\d+)")
_EPOCH_US = 1e15  # µs since the epoch are > 1e15 after 2001: an absolute (base-less) timestamp
_BACKWARD_PREFIX = "autograd::engine::evaluate_function"
# Column order of the rows built for each communication call.
_COMM_SPAN_COLUMNS = ("step", "name", "kind", "stream", "start_ns", "dur_ns", "group", "seq", "op", "bytes", "peer")
_MARKER_COLUMNS = ("state", "time_ns", "group", "seq", "op", "step", "bytes", "peer")
_NO_THREAD = object()
_NO_LAUNCH = (_NO_THREAD, float("nan"))  # a kernel's launch where the trace has none


@functools.lru_cache(maxsize=4096)
def normalize_op(name: str) -> str:
    """``c10d::allreduce_``, ``nccl:all_reduce``, ``_allgather_base``, ``allreduce`` -> a CollectiveOp."""
    base = name.split("::")[-1].split(":")[-1].strip().split(" ")[0]
    key = base.lower().replace("_", "")
    if key.startswith("allreduce"):
        return CollectiveOp.ALL_REDUCE
    if key.startswith("allgather"):
        return CollectiveOp.ALL_GATHER
    if key.startswith(("reducescatter", "reducescattertensor")):
        return CollectiveOp.REDUCE_SCATTER
    if key.startswith("alltoall"):
        return CollectiveOp.ALL_TO_ALL
    for op in ("broadcast", "barrier", "send", "recv", "reduce", "gather", "scatter"):
        if key.startswith(op):
            return CollectiveOp(op)
    return CollectiveOp.OTHER


def dtype_bytes(dtype: object) -> int | None:
    if not isinstance(dtype, str):
        return None
    return _dtype_name_bytes(dtype)


@functools.lru_cache(maxsize=256)
def _dtype_name_bytes(dtype: str) -> int | None:
    return _DTYPE_BYTES.get(dtype.lower().replace("c10::", "").replace("torch.", ""))


def _as_int(value: object) -> int | None:
    try:
        return int(value)  # type: ignore[call-overload, no-any-return]
    except (TypeError, ValueError):
        return None


def base_time_ns(events: RankEvents, path: str) -> int:
    """The epoch ns that ``ts == 0`` stands for."""
    for source in (events.header, events.trailer):
        value = source.get("baseTimeNanoseconds")
        if isinstance(value, int | float):
            return int(value)
    if events.first_ts is not None and events.first_ts > _EPOCH_US:
        return 0
    raise IngestError(
        f"{path}: no baseTimeNanoseconds and timestamps are not epoch microseconds; cannot place events in time"
    )


class _Steps:
    """Step lookup by host time."""

    def __init__(self, steps: list[tuple[int, float, float]]) -> None:
        ordered = sorted(steps, key=lambda s: s[1])
        self.starts = [s[1] for s in ordered]
        self.ends = [s[1] + s[2] for s in ordered]
        self.numbers = [s[0] for s in ordered]

    def at(self, ts: float) -> int | None:
        i = bisect.bisect_right(self.starts, ts) - 1
        if i >= 0 and ts <= self.ends[i]:
            return self.numbers[i]
        return None

    def at_many(self, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`at` of every time in ``ts`` (float64): whether a step holds it, and that step's
        number (0 where none does)."""
        index = _containing_many(np.asarray(self.starts, dtype=np.float64), np.asarray(self.ends, dtype=np.float64), ts)
        found = index >= 0
        if not self.numbers:
            return found, np.zeros(len(ts), dtype=np.int64)
        return found, np.asarray(self.numbers, dtype=np.int64)[np.where(found, index, 0)]


@dataclass
class _TopLevel:
    """One thread's top-level host ops, in start order."""

    starts: np.ndarray  # float64, µs
    ends: np.ndarray
    names: list[str]
    kinds: np.ndarray  # object array of SpanKind values


# Name prefixes that decide a top-level op's kind whatever its thread or flows.
_NAMED_KINDS = (("Optimizer.", SpanKind.OPTIMIZER), ("enumerate(DataLoader)", SpanKind.DATA),
                (_BACKWARD_PREFIX, SpanKind.BACKWARD))


def _named_kind(name: str) -> str | None:
    for prefix, kind in _NAMED_KINDS:
        if name.startswith(prefix):
            return kind
    return None


def _flows_in(flows: list[float], starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """For each ``[start, end]``, whether a flow time falls inside it."""
    if not flows:
        return np.zeros(len(starts), dtype=bool)
    times = np.sort(np.asarray(flows, dtype=np.float64))
    i = np.searchsorted(times, starts, side="left")
    inside = i < len(times)
    return inside & (times[np.minimum(i, len(times) - 1)] <= ends)


def _top_level(starts: np.ndarray, ends: np.ndarray) -> list[int]:
    """Indices of the intervals (sorted by start, longest first) that start at or after the
    end of the last one picked before them, the first one included.

    After interval ``i`` the next one picked is the first later one that starts at or after its
    end: found for every ``i`` by one binary search over the whole array, then followed from the
    first interval, a step per pick.
    """
    n = len(starts)
    following = np.maximum(np.searchsorted(starts, ends, side="left"), np.arange(1, n + 1)).tolist()
    picked = []
    i = 0
    while i < n:
        picked.append(i)
        i = following[i]
    return picked


def top_level_ops(events: RankEvents) -> dict[int | str, _TopLevel]:
    """Per thread, the host ops not nested in another op, each with its phase kind.

    In (start, longest first) order an op is top-level when it starts at or after the end of the
    last top-level op (:func:`_top_level`). Kinds come from the name (its prefix, looked up once
    per name), the thread (autograd) and the ``fwdbwd`` flows inside the op, decided for all ops
    of a thread at once.
    """
    out: dict[int | str, _TopLevel] = {}
    named: dict[str, str | None] = {}
    for tid, ops in events.ops.items():
        if not ops:
            continue
        all_starts, all_ends, all_names = zip(*ops, strict=True)
        starts_array = np.asarray(all_starts, dtype=np.float64)
        ends_array = np.asarray(all_ends, dtype=np.float64)
        if np.isnan(starts_array).any() or np.isnan(ends_array).any():
            raise ValueError(f"a host op on thread {tid} has a NaN time or duration")
        order = np.lexsort((-ends_array, starts_array))  # stable, as sorting by (start, -end) is
        chosen = order[_top_level(starts_array[order], ends_array[order])]
        starts = starts_array[chosen]
        ends = ends_array[chosen]
        names = [all_names[j] for j in chosen.tolist()]
        autograd = "autograd" in events.thread_names.get(tid, "")
        backward = _flows_in(events.flow_bwd.get(tid, []), starts, ends) | autograd
        forward = _flows_in(events.flow_fwd.get(tid, []), starts, ends)
        kinds = np.where(backward, SpanKind.BACKWARD, np.where(forward, SpanKind.FORWARD, SpanKind.COMPUTE)).astype(object)
        for name in dict.fromkeys(names):
            if name not in named:
                named[name] = _named_kind(name)
        for j in [j for j, name in enumerate(names) if named[name] is not None]:
            kinds[j] = named[names[j]]
        out[tid] = _TopLevel(starts, ends, names, kinds)
    return out


def _containing_many(starts: np.ndarray, ends: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """For each time in ``ts``, the index of the last interval starting at or before it if the
    interval holds it, else -1 (``starts`` sorted)."""
    i = np.searchsorted(starts, ts, side="right") - 1
    if not len(starts):
        return i
    held = (i >= 0) & (ts <= ends[np.maximum(i, 0)])
    return np.where(held, i, -1)


def _containing(starts: list[float], ends: list[float], ts: float) -> int | None:
    i = bisect.bisect_right(starts, ts) - 1
    if i >= 0 and ts <= ends[i]:
        return i
    return None


@dataclass
class RankTables:
    spans: pa.Table
    markers: pa.Table
    stats: Counter[str] = field(default_factory=Counter)
    steps: list[int] = field(default_factory=list)
    start_ns: int | None = None
    device_index: int | None = None


class _Columns:
    """A table's rows, added one at a time (``add``: one dict each, absent keys are nulls) or many
    at once (``extend``: one list, array or Arrow array, or one scalar, per column), turned into
    columns once at the end in the order they were added."""

    def __init__(self, table_schema: pa.Schema) -> None:
        self.schema = table_schema
        self._parts: list[tuple[int, Any]] = []  # (rows, list of row dicts) or (rows, column dict)
        self._rows: list[dict[str, Any]] = []
        self._n = 0

    def add(self, **row: Any) -> None:
        if not self._parts or self._parts[-1][1] is not self._rows:
            self._rows = []
            self._parts.append((0, self._rows))
        self._rows.append(row)
        self._n += 1

    def extend(self, rows: int, **columns: Any) -> None:
        """``rows`` rows: a list, array or Arrow array (of ``rows`` values) or one scalar per column named."""
        if rows:
            self._parts.append((rows, columns))
            self._n += rows

    def __len__(self) -> int:
        return self._n

    def table(self) -> pa.Table:
        chunks: dict[str, list[pa.Array]] = {f.name: [] for f in self.schema}
        for rows, part in self._parts:
            for f in self.schema:
                if isinstance(part, list):
                    values: Any = [r.get(f.name) for r in part]
                elif isinstance(part.get(f.name), pa.Array):
                    chunks[f.name].append(part[f.name].cast(f.type))
                    continue
                else:
                    values = part.get(f.name)
                    if values is None or isinstance(values, (str, int, float)):
                        values = [values] * rows
                chunks[f.name].append(pa.array(values, type=f.type))
        columns = [pa.chunked_array(chunks[f.name], type=f.type).combine_chunks() for f in self.schema]
        return pa.Table.from_arrays(columns, schema=self.schema)


def _ns_array(base: int, ts: np.ndarray) -> np.ndarray:
    """``base + round(t * 1000)`` for every ``t`` (µs to ns), as ``ns`` computes it one at a time."""
    return np.rint(np.asarray(ts, dtype=np.float64) * 1000.0).astype(np.int64) + np.int64(base)


def _ns_checked(base: int, ts: np.ndarray) -> np.ndarray:
    """:func:`_ns_array`, refusing what ``int(round(t * 1000.0))`` refuses one at a time (NaN, infinity)
    and what no 64-bit nanosecond count holds."""
    scaled = np.asarray(ts, dtype=np.float64) * 1000.0
    if not np.isfinite(scaled).all():
        raise ValueError("a time or duration is not a finite number")
    if len(scaled) and np.abs(scaled).max() >= 2.0**63:
        raise OverflowError("a time or duration does not fit 64-bit nanoseconds")
    return _ns_array(base, ts)


def _host_spans(spans: _Columns, levels: _TopLevel, index: np.ndarray, *, rank: int, base: int, steps: _Steps) -> None:
    """The top-level host ops ``index`` of one thread as spans on stream ``host``."""
    starts = levels.starts[index]
    ends = levels.ends[index]
    found, numbers = steps.at_many(starts)
    spans.extend(len(index), rank=rank, step=pa.array(numbers, type=pa.int64(), mask=~found),
                 name=[levels.names[i] for i in index.tolist()], kind=levels.kinds[index], stream=Stream.HOST,
                 start_ns=_ns_checked(base, starts), dur_ns=_ns_checked(0, ends - starts))


@dataclass
class _Comm:
    """One communication call on this rank, resolved."""

    ts: float  # enqueue (host)
    tid: int | str
    op: str
    group: str | None
    pg_ranks: tuple[int, ...]
    nbytes: int | None
    seq_hint: int | None
    peer: int | None
    step: int | None
    exec_start: float | None = None  # device or worker execution
    exec_end: float | None = None
    stream: str = Stream.COMM
    name: str = ""


def map_rank(
    events: RankEvents,
    *,
    rank: int,
    pg_groups: Mapping[str, tuple[str, tuple[int, ...]]],
    path: str = "",
) -> RankTables:
    """Spans and markers of one rank. ``pg_groups``: torch pg name -> (megascope group id, members)."""
    base = base_time_ns(events, path)
    stats: Counter[str] = Counter()

    def ns(ts: float) -> int:
        return base + int(round(ts * 1000.0))

    steps = _Steps(events.steps)
    top = top_level_ops(events)
    spans = _Columns(schema.SPANS)
    markers = _Columns(schema.MARKERS)

    for number, ts, dur in events.steps:
        spans.add(rank=rank, step=number, name=f"ProfilerStep#{number}", kind=SpanKind.STEP,
                  stream=Stream.HOST, start_ns=ns(ts), dur_ns=int(round(dur * 1000.0)))

    # ---------------------------------------------------------------- compute
    device_index = None
    nccl_device: list[DeviceEvent] = []
    if events.device:
        # Column by column (these are most of a GPU trace's spans): each kernel takes the kind of
        # the top-level host op that launched it and the step that holds the launch. The columns
        # come from one transposition of the collected tuples, and every step after that runs in
        # C (map, numpy, Arrow), never in a Python loop per kernel.
        names, cats, starts, durs, streams, devices, correlations, _ = zip(*events.device, strict=True)
        indexes = Counter(devices)
        indexes.pop(None, None)
        device_index = indexes.most_common(1)
        keep = None
        nccl = {name for name in set(names) if name.startswith("nccl")}
        if nccl:
            keep = ~np.fromiter(map(nccl.__contains__, names), dtype=bool, count=len(names))
            nccl_device = [events.device[i] for i in np.flatnonzero(~keep).tolist()]
        launches = list(map(events.runtime.get, correlations, repeat(_NO_LAUNCH)))
        launched = np.fromiter(map(is_not, launches, repeat(_NO_LAUNCH)), dtype=bool, count=len(launches))
        launch_tids, launch_times = zip(*launches, strict=True)
        launch_ts = np.asarray(launch_times, dtype=np.float64)
        kinds = np.full(len(names), SpanKind.COMPUTE, dtype=object)
        tid_codes = {tid: code for code, tid in enumerate(dict.fromkeys(launch_tids))}
        codes = np.fromiter(map(tid_codes.__getitem__, launch_tids), dtype=np.int64, count=len(launch_tids))
        for tid, code in tid_codes.items():
            levels = top.get(tid) if tid is not _NO_THREAD else None
            if levels is None:
                continue
            on_thread = np.flatnonzero(codes == code)
            index = _containing_many(levels.starts, levels.ends, launch_ts[on_thread])
            held = index >= 0
            kinds[on_thread[held]] = levels.kinds[index[held]]
        step_found, step_numbers = steps.at_many(launch_ts)
        step_missing = ~(step_found & launched)
        kinds[(np.asarray(cats, dtype=object) != "kernel") & (kinds == SpanKind.COMPUTE)] = SpanKind.OTHER
        stream_names = {stream: f"cuda:{stream}" for stream in dict.fromkeys(streams)}
        columns = {
            "step": pa.array(step_numbers, type=pa.int64(), mask=step_missing),
            "name": pa.array(names, type=pa.string()),
            "kind": pa.array(kinds, type=pa.string()),
            "stream": pa.array(list(map(stream_names.__getitem__, streams)), type=pa.string()),
        }
        ts_array = np.asarray(starts, dtype=np.float64)
        dur_array = np.asarray(durs, dtype=np.float64)
        if keep is not None:
            launched, ts_array, dur_array = launched[keep], ts_array[keep], dur_array[keep]
            columns = {key: column.filter(pa.array(keep)) for key, column in columns.items()}
        columns["start_ns"] = pa.array(_ns_array(base, ts_array))
        columns["dur_ns"] = pa.array(_ns_array(0, dur_array))
        if not launched.all():
            stats["device events without a launch in the trace"] += int((~launched).sum())
        spans.extend(len(launched), rank=rank, **columns)
        # Data loading shows only on the host; keep it as data spans.
        for levels in top.values():
            data = np.flatnonzero(levels.kinds == SpanKind.DATA)
            if len(data):
                _host_spans(spans, levels, data, rank=rank, base=base, steps=steps)
    else:
        for levels in top.values():
            _host_spans(spans, levels, np.arange(len(levels.names)), rank=rank, base=base, steps=steps)

    # ----------------------------------------------------------- communication
    comms = _resolve_comms(events, nccl_device, rank=rank, pg_groups=pg_groups, steps=steps, stats=stats)
    _assign_seq(comms, rank)
    span_rows = []
    marker_rows = []
    for c in comms:
        if c.exec_start is None or c.exec_end is None:
            stats["communication calls with no execution in the trace"] += 1
            continue
        kind = SpanKind.SEND if c.op == CollectiveOp.SEND else SpanKind.RECV if c.op == CollectiveOp.RECV else SpanKind.COLLECTIVE
        start = max(c.exec_start, c.ts) if c.stream == Stream.COMM else c.exec_start
        span_rows.append((c.step, c.name, kind, c.stream, ns(start), max(0, int(round((c.exec_end - start) * 1000.0))),
                          c.group, c.seq_hint, c.op, c.nbytes, c.peer))
        if c.group is not None and c.seq_hint is not None:
            marker_rows.append((MarkerState.ENQUEUED, ns(c.ts), c.group, c.seq_hint, c.op, c.step, c.nbytes, c.peer))
            marker_rows.append((MarkerState.COMPLETED, ns(c.exec_end), c.group, c.seq_hint, c.op, c.step, c.nbytes,
                                c.peer))
    if span_rows:
        spans.extend(len(span_rows), rank=rank, **dict(zip(_COMM_SPAN_COLUMNS, zip(*span_rows, strict=True), strict=True)))
    if marker_rows:
        markers.extend(len(marker_rows), rank=rank,
                       **dict(zip(_MARKER_COLUMNS, zip(*marker_rows, strict=True), strict=True)))
    stats["spans"] = len(spans)
    stats["markers"] = len(markers)
    start_ns = ns(events.first_ts) if events.first_ts is not None else None
    return RankTables(
        spans=spans.table(),
        markers=markers.table(),
        stats=stats,
        steps=sorted(s[0] for s in events.steps),
        start_ns=start_ns,
        device_index=_as_int(device_index[0][0]) if device_index else None,
    )


def _pg_of(args: dict[str, Any], pg_groups: Mapping[str, tuple[str, tuple[int, ...]]]) -> tuple[str | None, tuple[int, ...]]:
    name = args.get("Process Group Name")
    if name is not None and str(name) in pg_groups:
        return pg_groups[str(name)]
    return None, ()


def _peer(call_name: str, op: str, args: dict[str, Any], rank: int, pg_ranks: tuple[int, ...]) -> int | None:
    if op not in (CollectiveOp.SEND, CollectiveOp.RECV):
        return None
    direct = _as_int(args.get("Dst Rank" if op == CollectiveOp.SEND else "Src Rank"))
    if direct is not None:
        return direct
    local = _as_int(args.get("Rank"))
    if local is not None and 0 <= local < len(pg_ranks) and pg_ranks[local] != rank:
        return pg_ranks[local]
    match = _P2P_NAME.search(call_name)
    if match:
        a, b = int(match.group(2)), int(match.group(3))
        if a == rank:
            return b
        if pg_ranks and a < len(pg_ranks) and pg_ranks[a] == rank and b < len(pg_ranks):
            return pg_ranks[b]
    return None


def _resolve_comms(
    events: RankEvents,
    nccl_device: list[DeviceEvent],
    *,
    rank: int,
    pg_groups: Mapping[str, tuple[str, tuple[int, ...]]],
    steps: _Steps,
    stats: Counter[str],
) -> list[_Comm]:
    # torch (2.10 and later) also records each Work.wait() as a record_param_comms named "wait",
    # with no message and no kernel: not a call. Counted as one, it would take a place in its
    # group's sequence, and a rank that waits more often would pair its collectives with the
    # wrong calls of its peers.
    rpc = [c for c in events.comm_calls if c.source == "rpc" and c.args.get("Collective name") != "wait"]
    if rpc or nccl_device:
        return _nccl_comms(events, rpc, nccl_device, _Annotations(events.comm_calls), rank=rank, pg_groups=pg_groups,
                           steps=steps, stats=stats)
    return _gloo_comms(events, rank=rank, pg_groups=pg_groups, steps=steps, stats=stats)


class _Annotations:
    """``gloo:*`` / ``nccl:*`` annotations per thread, found by time."""

    def __init__(self, calls: list[CommCall]) -> None:
        per_tid: dict[int | str, list[CommCall]] = defaultdict(list)
        for c in calls:
            if c.source == "annot":
                per_tid[c.tid].append(c)
        self.names: dict[int | str, list[str]] = {}
        self.starts: dict[int | str, list[float]] = {}
        for tid, lst in per_tid.items():
            lst.sort(key=lambda c: c.ts)
            self.names[tid] = [c.name for c in lst]
            self.starts[tid] = [c.ts for c in lst]

    def first_in(self, tid: int | str, start: float, end: float) -> str | None:
        starts = self.starts.get(tid)
        if not starts:
            return None
        i = bisect.bisect_left(starts, start)
        if i < len(starts) and starts[i] <= end:
            return self.names[tid][i]
        return None


def _nccl_comms(
    events: RankEvents,
    rpc: list[CommCall],
    nccl_device: list[DeviceEvent],
    annots: _Annotations,
    *,
    rank: int,
    pg_groups: Mapping[str, tuple[str, tuple[int, ...]]],
    steps: _Steps,
    stats: Counter[str],
) -> list[_Comm]:
    by_tid: dict[int | str, list[int]] = defaultdict(list)
    rpc.sort(key=lambda c: c.ts)
    for i, c in enumerate(rpc):
        by_tid[c.tid].append(i)
    starts = {tid: [rpc[i].ts for i in idx] for tid, idx in by_tid.items()}
    ends = {tid: [rpc[i].end for i in idx] for tid, idx in by_tid.items()}
    comms: list[_Comm | None] = [None] * len(rpc)
    extra: list[_Comm] = []

    def make(call_name: str, args: dict[str, Any], ts: float, tid: int | str) -> _Comm:
        op = normalize_op(str(args.get("Collective name") or call_name))
        group, pg_ranks = _pg_of(args, pg_groups)
        nelems = _as_int(args.get("In msg nelems"))
        size = dtype_bytes(args.get("dtype"))
        return _Comm(
            ts=ts, tid=tid, op=op, group=group, pg_ranks=pg_ranks,
            nbytes=nelems * size if nelems is not None and size is not None else None,
            seq_hint=_as_int(args.get("Seq")),
            peer=_peer(call_name, op, args, rank, pg_ranks), step=steps.at(ts),
        )

    for name, _, ts, dur, stream, _, correlation, device_args in nccl_device:
        launch = events.runtime.get(correlation) if correlation is not None else None
        if launch is None:
            # Launched before the profiler's host window opened: no call, no step, no sequence.
            stats["NCCL kernels launched outside the trace window (skipped)"] += 1
            continue
        tid, lts = launch
        index = None
        if tid in by_tid:
            j = _containing(starts[tid], ends[tid], lts)
            if j is not None:
                index = by_tid[tid][j]
        kernel_args = device_args or {}
        if index is None and kernel_args:
            comm = make(name, kernel_args, lts, tid)
            comm.name = annots.first_in(tid, lts - 50.0, lts) or comm.op
            extra.append(comm)
        elif index is None:
            stats["NCCL kernels with no record_param_comms (skipped)"] += 1
            continue
        else:
            known = comms[index]
            if known is None:
                call = rpc[index]
                args = {**kernel_args, **call.args}
                known = make(call.name, args, call.ts, call.tid)
                annot = annots.first_in(call.tid, call.ts, call.end)
                known.name = annot or f"nccl:{known.op}"
                if known.peer is None and annot:
                    known.peer = _peer(annot, known.op, {}, rank, known.pg_ranks)
                comms[index] = known
            comm = known
        comm.stream = f"cuda:{stream}"
        comm.exec_start = ts if comm.exec_start is None else min(comm.exec_start, ts)
        end = ts + dur
        comm.exec_end = end if comm.exec_end is None else max(comm.exec_end, end)
    # Calls whose kernel never showed up keep their place in the sequence but get no span.
    resolved = []
    for i, maybe in enumerate(comms):
        if maybe is None:
            call = rpc[i]
            maybe = make(call.name, call.args, call.ts, call.tid)
        resolved.append(maybe)
    resolved.extend(extra)
    resolved.sort(key=lambda c: c.ts)
    return resolved


def _host_bytes(args: dict[str, Any]) -> int | None:
    """Message size from a gloo annotation's (or c10d op's) first input; None if the dtype is unknown."""
    dims = args.get("Input Dims")
    types = args.get("Input type")
    if not isinstance(dims, list) or not dims or not isinstance(types, list) or not types:
        return None
    first = dims[0]
    # c10d ops take a TensorList: [[d0, d1]] inside the first argument.
    if isinstance(first, list) and first and isinstance(first[0], list):
        first = first[0]
    if not isinstance(first, list) or not all(isinstance(d, int) for d in first):
        return None
    size = dtype_bytes(types[0])
    if size is None:
        return None
    n = 1
    for d in first:
        n *= d
    return n * size


# gloo has no reduce-scatter of its own: ProcessGroupGloo runs ``_reduce_scatter_base`` (FSDP's
# gradient reduction, the bundled trainer's) as an all-reduce, and the trace shows a
# ``gloo:all_reduce`` execution for it.
_GLOO_RUNS_AS: dict[str, str] = {CollectiveOp.REDUCE_SCATTER: CollectiveOp.ALL_REDUCE}


def _gloo_comms(
    events: RankEvents,
    *,
    rank: int,
    pg_groups: Mapping[str, tuple[str, tuple[int, ...]]],
    steps: _Steps,
    stats: Counter[str],
) -> list[_Comm]:
    calls = sorted((c for c in events.comm_calls if c.source == "c10d"), key=lambda c: c.ts)
    execs: dict[str, deque[CommCall]] = defaultdict(deque)
    for c in sorted((c for c in events.comm_calls if c.source == "annot" and c.name.startswith("gloo:")), key=lambda c: c.ts):
        execs[normalize_op(c.name)].append(c)
    # gloo events do not name their process group: attribute to the only group, if there is one.
    distinct = {v for v in pg_groups.values()}
    group, pg_ranks = next(iter(distinct)) if len(distinct) == 1 else (None, ())
    if len(distinct) > 1 and calls:
        stats["gloo calls with an unknown process group (several groups)"] += len(calls)
    comms = []
    for call in calls:
        op = normalize_op(call.name)
        if op == CollectiveOp.OTHER:
            continue
        queue = execs.get(_GLOO_RUNS_AS.get(op, op))
        # An execution that started before this call belongs to a call outside the trace window.
        while queue and queue[0].ts < call.ts - 1.0:
            queue.popleft()
            stats["gloo executions without an enqueue in the trace (skipped)"] += 1
        execution = queue.popleft() if queue else None
        peer = None
        if op in (CollectiveOp.SEND, CollectiveOp.RECV):
            concrete = call.args.get("Concrete Inputs")
            local = _as_int(concrete[2]) if isinstance(concrete, list) and len(concrete) > 2 else None
            if local is not None:
                peer = pg_ranks[local] if pg_ranks and 0 <= local < len(pg_ranks) else local
        args = execution.args if execution is not None else call.args
        comm = _Comm(ts=call.ts, tid=call.tid, op=op, group=group, pg_ranks=pg_ranks,
                     nbytes=_host_bytes(args) if execution is not None else _host_bytes(call.args),
                     seq_hint=None, peer=peer, step=steps.at(call.ts), name=execution.name if execution else call.name)
        if execution is not None:
            comm.exec_start, comm.exec_end = execution.ts, execution.end
        comms.append(comm)
    for queue in execs.values():
        stats["gloo executions without an enqueue in the trace (skipped)"] += len(queue)
    return comms


def _assign_seq(comms: list[_Comm], rank: int) -> None:
    """Seq per group for collectives, per (sender, receiver) pair for p2p, where the trace has none."""
    per_group: Counter[str] = Counter()
    per_pair: Counter[tuple[int, int]] = Counter()
    for c in comms:
        if c.op in (CollectiveOp.SEND, CollectiveOp.RECV):
            if c.peer is None:
                c.seq_hint = None
                continue
            pair = (rank, c.peer) if c.op == CollectiveOp.SEND else (c.peer, rank)
            per_pair[pair] += 1
            c.seq_hint = per_pair[pair]
        elif c.group is not None:
            per_group[c.group] += 1
            if c.seq_hint is None:
                c.seq_hint = per_group[c.group]

