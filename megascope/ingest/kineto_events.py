"""Collect what megascope needs from one rank's Kineto trace into compact per-rank records.

Role in the data flow: between the streamed JSON reader (:mod:`megascope.ingest.jsonstream`) and
the mapping onto the schema (:mod:`megascope.ingest.kineto_map`). One pass over the events keeps,
as small tuples, only what the mapping uses:

* ``ProfilerStep#N`` annotations (steps), thread names, ``fwdbwd`` flow ends (forward/backward
  linkage);
* CPU ops and user annotations (their nesting tells which phase launched a kernel, and on CPU-only
  traces they are the compute);
* runtime calls by correlation id (the launch of each GPU kernel);
* GPU kernels, memcpy and memset, with the collective arguments NCCL kernels may carry;
* communication calls: ``record_param_comms`` (NCCL: group, sizes, sequence), ``c10d::*``
  (enqueue on the calling thread), ``gloo:*`` / ``nccl:*`` annotations (gloo: the real execution
  on the worker thread).

Example::

    events = collect(TraceReader(path))
    len(events.device), len(events.comm_calls)
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from megascope.ingest.jsonstream import TraceReader

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver", "privateuse1_runtime", "privateuse1_driver"})
HOST_CATS = frozenset({"cpu_op", "user_annotation"})
# record_param_comms arguments kept (the rest is bulky and unused).
COMM_ARG_KEYS = (
    "Collective name",
    "Process Group Name",
    "Process Group Description",
    "Process Group Ranks",
    "In msg nelems",
    "Out msg nelems",
    "Group size",
    "dtype",
    "Seq",
    "Rank",
    "Src Rank",
    "Dst Rank",
)


@dataclass
class CommCall:
    """One communication-related host event."""

    source: str  # "rpc" (record_param_comms), "c10d" (c10d::* cpu op), "annot" (gloo:* / nccl:*)
    tid: int | str
    ts: float  # µs, trace clock
    end: float
    name: str
    args: dict[str, Any]


@dataclass
class DeviceEvent:
    cat: str
    name: str
    stream: int | str
    device: int | None
    ts: float
    dur: float
    correlation: int | None
    nbytes: int | None
    comm_args: dict[str, Any] | None  # NCCL kernels: collective args when the trace has them


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
    device: list[DeviceEvent] = field(default_factory=list)
    comm_calls: list[CommCall] = field(default_factory=list)
    first_ts: float | None = None
    last_ts: float | None = None
    events: int = 0


def _comm_args(args: dict[str, Any]) -> dict[str, Any]:
    return {k: args[k] for k in COMM_ARG_KEYS if k in args}


def _is_comm_name(name: str) -> bool:
    return name.startswith(("gloo:", "nccl:"))


def collect(reader: TraceReader) -> RankEvents:
    """Read every event of ``reader`` once and keep what the mapping needs."""
    header = reader.read_header()
    out = RankEvents(header=header)
    intern = sys.intern
    ops = out.ops
    runtime = out.runtime
    device = out.device
    comm_calls = out.comm_calls
    first = float("inf")
    last = float("-inf")
    count = 0
    for batch in reader.iter_batches():
        count += len(batch)
        for e in batch:
            ph = e.get("ph")
            if ph == "X":
                cat = e.get("cat")
                ts = e.get("ts")
                if not isinstance(ts, int | float):
                    continue
                dur = e.get("dur") or 0.0
                if ts < first:
                    first = ts
                if ts + dur > last:
                    last = ts + dur
                if cat in DEVICE_CATS:
                    args = e.get("args") or {}
                    name = e.get("name", "")
                    comm = _comm_args(args) if cat == "kernel" and name.startswith("nccl") else None
                    device.append(
                        DeviceEvent(
                            cat=cat,
                            name=intern(name),
                            stream=args.get("stream", e.get("tid", 0)),
                            device=args.get("device"),
                            ts=ts,
                            dur=dur,
                            correlation=args.get("correlation"),
                            nbytes=args.get("bytes"),
                            comm_args=comm or None,
                        )
                    )
                elif cat in HOST_CATS:
                    name = e.get("name", "")
                    tid = e.get("tid", 0)
                    if name.startswith("ProfilerStep#"):
                        number = name[13:]
                        if number.isdigit():
                            out.steps.append((int(number), ts, dur))
                        continue
                    if out.pid is None and isinstance(e.get("pid"), int):
                        out.pid = e["pid"]
                    if name == "record_param_comms":
                        comm_calls.append(CommCall("rpc", tid, ts, ts + dur, name, _comm_args(e.get("args") or {})))
                        continue
                    if name.startswith("c10d::"):
                        comm_calls.append(CommCall("c10d", tid, ts, ts + dur, intern(name), _host_comm_args(e)))
                        continue
                    if _is_comm_name(name):
                        comm_calls.append(CommCall("annot", tid, ts, ts + dur, intern(name), _host_comm_args(e)))
                        continue
                    ops[tid].append((ts, ts + dur, intern(name)))
                elif cat in RUNTIME_CATS:
                    corr = (e.get("args") or {}).get("correlation")
                    if corr is not None:
                        runtime[corr] = (e.get("tid", 0), ts)
            elif ph == "M":
                if e.get("name") == "thread_name":
                    out.thread_names[e.get("tid", 0)] = str((e.get("args") or {}).get("name", ""))
            elif ph in ("s", "f") and e.get("cat") == "fwdbwd":
                ts = e.get("ts")
                if isinstance(ts, int | float):
                    (out.flow_fwd if ph == "s" else out.flow_bwd)[e.get("tid", 0)].append(ts)
    out.trailer = reader.trailer
    out.events = count
    out.first_ts = first if count and first != float("inf") else None
    out.last_ts = last if count and last != float("-inf") else None
    return out


def _host_comm_args(e: dict[str, Any]) -> dict[str, Any]:
    """Shapes and scalar inputs of a c10d op or gloo annotation (message size, p2p peer)."""
    args = e.get("args") or {}
    keep = {}
    for key in ("Input Dims", "Input type", "Concrete Inputs"):
        if key in args:
            keep[key] = args[key]
    return keep
