"""Collect what megascope needs from one rank's Kineto trace into compact per-rank records.

Role in the data flow: between the streamed JSON reader (:mod:`megascope.ingest.jsonstream`) and
the mapping onto the schema (:mod:`megascope.ingest.kineto_map`). One pass over the events keeps,
as small tuples, only what the mapping uses:

* ``ProfilerStep#N`` annotations (steps), thread names, ``fwdbwd`` flow ends (forward/backward
  linkage);
* CPU ops and user annotations (their nesting tells which phase launched a kernel, and on CPU-only
  traces they are the compute);
* runtime calls by correlation id (the launch of each GPU kernel);
* GPU kernels, memcpy and memset (one plain tuple each; an NCCL kernel's with its collective
  arguments);
* communication calls: ``record_param_comms`` (NCCL: group, sizes, sequence), ``c10d::*``
  (enqueue on the calling thread), ``gloo:*`` / ``nccl:*`` annotations (gloo: the real execution
  on the worker thread).

Where the compiled scanner (``_kscan``, plain C built at install, megascope/ingest/_kscan.c) is
there, it reads the text itself and appends the same tuples and calls to the same containers,
with no Python object for an event the mapping ignores: ~2.5x less CPU than the path below on a
50k-event rank file. A file it is not sure to read exactly as that path does (odd types, a key
twice, escapes in keys, malformed JSON) is read again by that path;
``MEGASCOPE_KINETO_SCANNER=0`` forces that path.

Otherwise, where ``msgspec`` is installed, each batch of events is parsed straight into :class:`Event`
objects that hold only the keys named here (a compiled parser that skips the rest of every
event's ``args``): several times faster than building every event as a dict. Without it, or for
a batch it refuses, the standard library's dicts are turned into the same objects. The loop over
them is the one per-event Python step of the import, so it does as little as it can: a host op
whose name was seen before as a plain op costs one dictionary look-up and one append.

Example::

    events = collect(trace_reader(path))
    len(events.device), len(events.comm_calls)
"""

from __future__ import annotations

import operator
import os
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megascope.ingest.jsonstream import TraceReader

try:  # a compiled decoder that builds only the fields below; the standard library's otherwise
    import msgspec
except ImportError:  # pragma: no cover - exercised by forcing the fallback in tests
    msgspec = None  # type: ignore[assignment]

try:  # the compiled scanner (megascope/ingest/_kscan.c), built where a C compiler was at install
    from megascope.ingest import _kscan  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - an install without a compiler
    _kscan = None

# MEGASCOPE_KINETO_SCANNER=0 forces the Python path (tests, A/B measurements).
SCANNER_ENV = "MEGASCOPE_KINETO_SCANNER"

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver", "privateuse1_runtime", "privateuse1_driver"})
HOST_CATS = frozenset({"cpu_op", "user_annotation"})
# record_param_comms arguments the mapping reads (the rest, group sizes and members included, is
# skipped by the parser: fewer fields to fill per event): JSON key -> attribute.
COMM_ARGS = {
    "Collective name": "collective_name",
    "Process Group Name": "pg_name",
    "In msg nelems": "in_nelems",
    "dtype": "dtype",
    "Seq": "seq",
    "Rank": "rank",
    "Src Rank": "src_rank",
    "Dst Rank": "dst_rank",
}
COMM_ARG_KEYS = tuple(COMM_ARGS)
# c10d ops and gloo annotations: shapes and scalar inputs (message size, p2p peer).
HOST_COMM_ARGS = {"Input Dims": "input_dims", "Input type": "input_type", "Concrete Inputs": "concrete_inputs"}
_comm_values = operator.attrgetter(*COMM_ARGS.values())
_host_comm_values = operator.attrgetter(*HOST_COMM_ARGS.values())
_ARG_FIELDS = {"stream": "stream", "device": "device", "correlation": "correlation",
               "name": "name", **COMM_ARGS, **HOST_COMM_ARGS}


# The event as the mapping reads it: only these keys are decoded, everything else is skipped
# by the parser. Values keep their JSON types (``Any``): a trace with an odd type in one field
# must not fail the file; the checks below treat such values as absent.
if msgspec is not None:

    # gc=False: these objects hold no reference cycles, so the cyclic collector need not track them.
    # Fields are declared in the order Kineto writes the keys: the parser tries the field after the
    # last one it matched first, so in-order keys skip a search (8% fewer instructions per event).
    class EventArgs(msgspec.Struct, omit_defaults=True, gc=False):
        device: Any = None
        stream: Any = None
        correlation: Any = None
        name: Any = None
        collective_name: Any = msgspec.field(default=None, name="Collective name")
        in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
        dtype: Any = None
        pg_name: Any = msgspec.field(default=None, name="Process Group Name")
        seq: Any = msgspec.field(default=None, name="Seq")
        rank: Any = msgspec.field(default=None, name="Rank")
        src_rank: Any = msgspec.field(default=None, name="Src Rank")
        dst_rank: Any = msgspec.field(default=None, name="Dst Rank")
        input_dims: Any = msgspec.field(default=None, name="Input Dims")
        input_type: Any = msgspec.field(default=None, name="Input type")
        concrete_inputs: Any = msgspec.field(default=None, name="Concrete Inputs")

    class Event(msgspec.Struct, gc=False):
        ph: Any = None
        cat: Any = None
        name: Any = ""
        pid: Any = None
        tid: Any = 0
        ts: Any = None
        dur: Any = None
        args: EventArgs | None = None

    _BATCH = msgspec.json.Decoder(list[Event])

    def decode_batch(text: str) -> list[Any] | None:
        """The events of a JSON array of event objects; None if the compiled parser refuses it
        (malformed text, or an element that is not an object): the caller then takes the
        standard library's path, which finds the error or keeps the objects."""
        try:
            return _BATCH.decode(text)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

else:  # pragma: no cover - the same shapes without msgspec

    class EventArgs:  # type: ignore[no-redef]
        __slots__ = tuple(_ARG_FIELDS.values())

        def __init__(self) -> None:
            for attr in self.__slots__:
                setattr(self, attr, None)

    class Event:  # type: ignore[no-redef]
        __slots__ = ("ph", "cat", "name", "ts", "dur", "tid", "pid", "args")

        def __init__(self, ph: Any, cat: Any, name: Any, ts: Any, dur: Any, tid: Any, pid: Any,
                     args: EventArgs | None) -> None:
            self.ph, self.cat, self.name, self.ts, self.dur = ph, cat, name, ts, dur
            self.tid, self.pid, self.args = tid, pid, args

    decode_batch = None  # type: ignore[assignment]


def event_from_json(value: Any) -> Event | None:
    """An :class:`Event` from a decoded JSON value (the standard library's path); None if not an object."""
    if not isinstance(value, dict):
        return None
    raw_args = value.get("args")
    args = None
    if isinstance(raw_args, dict):
        args = EventArgs()
        for key, attr in _ARG_FIELDS.items():
            if key in raw_args:
                setattr(args, attr, raw_args[key])
    return Event(ph=value.get("ph"), cat=value.get("cat"), name=value.get("name", ""), ts=value.get("ts"),
                 dur=value.get("dur"), tid=value.get("tid", 0), pid=value.get("pid"), args=args)


def trace_reader(path: Any, *, compiled: bool = True) -> TraceReader:
    """A reader whose batches are :class:`Event` lists (``compiled=False``: the standard library only)."""
    fast: Callable[[str], list[Any] | None] | None = decode_batch if compiled else None
    return TraceReader(path, decode_batch=fast, convert=event_from_json)


@dataclass
class CommCall:
    """One communication-related host event."""

    source: str  # "rpc" (record_param_comms), "c10d" (c10d::* cpu op), "annot" (gloo:* / nccl:*)
    tid: int | str
    ts: float  # µs, trace clock
    end: float
    name: str
    args: dict[str, Any]


DeviceEvent = tuple[str, str, float, float, Any, Any, Any, "dict[str, Any] | None"]


@dataclass
class RankEvents:
    """The parts of one rank's trace that the mapping needs."""

    header: dict[str, Any]
    trailer: dict[str, Any] = field(default_factory=dict)
    thread_names: dict[int | str, str] = field(default_factory=dict)
    pid: int | None = None
    steps: list[tuple[int, float, float]] = field(default_factory=list)  # (step, ts, dur)
    ops: dict[int | str, list[tuple[float, float, str]]] = field(default_factory=lambda: defaultdict(list))
    flow_fwd: dict[int | str, list[float]] = field(default_factory=lambda: defaultdict(list))
    flow_bwd: dict[int | str, list[float]] = field(default_factory=lambda: defaultdict(list))
    runtime: dict[int, tuple[int | str, float]] = field(default_factory=dict)
    # GPU kernels, memcpy and memset, one plain tuple each (built faster than any object), turned
    # into columns by the mapping: (name, cat, ts, dur, stream, device, correlation, args), where
    # args is an NCCL kernel's collective arguments (:func:`comm_args`), else None.
    device: list[DeviceEvent] = field(default_factory=list)
    comm_calls: list[CommCall] = field(default_factory=list)
    first_ts: float | None = None
    last_ts: float | None = None
    events: int = 0


def comm_args(args: EventArgs | None) -> dict[str, Any]:
    """The ``record_param_comms`` arguments of an event (an NCCL kernel's, where the trace has them)."""
    if args is None:
        return {}
    return {key: value for key, value in zip(COMM_ARG_KEYS, _comm_values(args), strict=True) if value is not None}


def _host_comm_args(args: EventArgs | None) -> dict[str, Any]:
    """Shapes and scalar inputs of a c10d op or gloo annotation (message size, p2p peer)."""
    if args is None:
        return {}
    return {key: value for key, value in zip(HOST_COMM_ARGS, _host_comm_values(args), strict=True) if value is not None}


_NUMBER = (int, float)


def scanner_enabled() -> bool:
    """Whether :func:`collect` uses the compiled scanner: built, and not switched off by the environment."""
    return _kscan is not None and os.environ.get(SCANNER_ENV, "1") != "0"


def collect(reader: TraceReader, *, scan: bool | None = None) -> RankEvents:
    """Read every event of ``reader`` (made by :func:`trace_reader`) once and keep what the mapping needs.

    ``scan`` (default :func:`scanner_enabled`): read the text with the compiled scanner, which
    keeps the same values in the same order; a file it refuses is read again with the Python path.
    """
    if scan is None:
        scan = scanner_enabled()
    if scan and _kscan is not None:
        out = RankEvents(header=reader.read_header())
        scanner = _kscan.Collector(out.ops, out.runtime, out.device, out.comm_calls, out.steps, out.flow_fwd,
                                   out.flow_bwd, out.thread_names, CommCall)
        if reader.scan_events(scanner.scan):
            out.pid = scanner.pid
            out.trailer = reader.trailer
            out.events = scanner.count
            out.first_ts = scanner.first
            out.last_ts = scanner.last
            return out
        reader = reader.reopen()
    return _collect_events(reader)


def _collect_events(reader: TraceReader) -> RankEvents:
    """:func:`collect` in Python, over the decoded events of ``reader``'s batches."""
    header = reader.read_header()
    out = RankEvents(header=header)
    intern = sys.intern
    ops = out.ops
    runtime = out.runtime
    device = out.device
    comm_calls = out.comm_calls
    steps = out.steps
    # Host op names seen before that are plain ops (no step, no communication call), each mapped to
    # its interned copy: one dictionary look-up instead of a chain of prefix tests per event.
    plain_ops: dict[str, str] = {}
    pid = None
    first = float("inf")
    last = float("-inf")
    count = 0
    for batch in reader.iter_batches():
        count += len(batch)
        for e in batch:
            ph = e.ph
            if ph == "X":
                ts = e.ts
                if type(ts) not in _NUMBER:
                    continue
                cat = e.cat
                dur = e.dur
                if type(dur) not in _NUMBER:
                    dur = 0.0
                end = ts + dur
                if ts < first:
                    first = ts
                if end > last:
                    last = end
                if cat in HOST_CATS:
                    name = e.name
                    if type(name) is not str:
                        name = ""
                    plain = plain_ops.get(name)
                    if plain is not None:
                        if pid is None and isinstance(e.pid, int):
                            pid = e.pid
                        ops[e.tid].append((ts, end, plain))
                        continue
                    tid = e.tid
                    if name.startswith("ProfilerStep#"):
                        number = name[13:]
                        if number.isdigit():
                            steps.append((int(number), ts, dur))
                        continue
                    if pid is None and isinstance(e.pid, int):
                        pid = e.pid
                    if name == "record_param_comms":
                        comm_calls.append(CommCall("rpc", tid, ts, end, name, comm_args(e.args)))
                        continue
                    if name.startswith("c10d::"):
                        comm_calls.append(CommCall("c10d", tid, ts, end, intern(name), _host_comm_args(e.args)))
                        continue
                    if name.startswith(("gloo:", "nccl:")):
                        comm_calls.append(CommCall("annot", tid, ts, end, intern(name), _host_comm_args(e.args)))
                        continue
                    plain = plain_ops[name] = intern(name)
                    ops[tid].append((ts, end, plain))
                elif cat in RUNTIME_CATS:
                    args = e.args
                    if args is not None:
                        corr = args.correlation
                        if corr is not None:
                            runtime[corr] = (e.tid, ts)
                elif cat in DEVICE_CATS:
                    name = e.name
                    if type(name) is not str:
                        name = ""
                    args = e.args
                    if args is None:
                        device.append((name, cat, ts, dur, e.tid, None, None, None))
                    else:
                        stream = args.stream
                        # Only an NCCL kernel keeps its arguments (its collective's are among them).
                        device.append((name, cat, ts, dur, e.tid if stream is None else stream, args.device,
                                       args.correlation,
                                       comm_args(args) if cat == "kernel" and name.startswith("nccl") else None))
            elif ph == "M":
                if e.name == "thread_name":
                    out.thread_names[e.tid] = str(e.args.name if e.args is not None and e.args.name is not None else "")
            elif (ph == "s" or ph == "f") and e.cat == "fwdbwd":
                ts = e.ts
                if type(ts) in _NUMBER:
                    (out.flow_fwd if ph == "s" else out.flow_bwd)[e.tid].append(ts)
    out.pid = pid
    out.trailer = reader.trailer
    out.events = count
    out.first_ts = first if count and first != float("inf") else None
    out.last_ts = last if count and last != float("-inf") else None
    return out
