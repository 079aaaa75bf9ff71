"""Hand-built run directories for tests: every figure an analysis returns follows from the rows written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from megascope import layout, schema

MS = 1_000_000


def span(rank: int, step: int, kind: str, start: int, dur: int, *, group: str | None = None,
          seq: int | None = None, peer: int | None = None, name: str | None = None) -> dict[str, object]:
    return {"rank": rank, "step": step, "name": name or kind, "kind": kind, "stream": "compute", "start_ns": start,
            "dur_ns": dur, "microbatch": None, "chunk": None, "group": group, "seq": seq,
            "op": "all_reduce" if kind == "collective" else kind if kind in ("send", "recv") else None,
            "bytes": None, "peer": peer}


def hand_run(path: Path, spans: list[dict[str, object]], markers: list[dict[str, object]], world: int = 3,
              hosts: tuple[str, ...] = ("h0", "h0", "h1"), devices: tuple[str | None, ...] | None = None,
              source: str = "synth") -> Path:
    layout.write_run_meta(path, schema.RunMeta(run_id="hand", source=source, world_size=world,
                                               mesh_sizes={"pp": 1, "dp": world, "tp": 1}))
    for r in range(world):
        layout.write_part(path, "ranks", pa.Table.from_pylist(
            [{"rank": r, "host": hosts[r], "coords": {"pp": 0, "dp": r, "tp": 0}, "device": devices[r] if devices else None}],
            schema=schema.RANKS), rank=r)
        layout.write_part(path, "groups", pa.Table.from_pylist(
            [{"rank": r, "group": "dp:0", "kind": "dp", "group_rank": r, "members": list(range(world))}],
            schema=schema.GROUPS), rank=r)
        mine = [s for s in spans if s["rank"] == r]
        if mine:
            layout.write_part(path, "spans", pa.Table.from_pylist(mine, schema=schema.SPANS), rank=r)
        mk = [m for m in markers if m["rank"] == r]
        if mk:
            layout.write_part(path, "markers", pa.Table.from_pylist(mk, schema=schema.MARKERS), rank=r)
    return path


def host_bound_run(path: Path, *, devices: tuple[str | None, ...] | None = ("cuda:0", "cuda:1", "cpu"),
                   source: str = "collector", side_stream: bool = False) -> Path:
    """Three ranks, 40 all-reduces in one 1 s step. The host issues call i at 20i ms; the device
    reaches it 10 ms later on rank 0 (queued work ahead of it) and on rank 1 too, except every
    fourth call, reached 0.1 ms after issue (the device had run dry); rank 2 is timed by the host
    clock ("cpu"). ``side_stream``: rank 1's every fourth call was issued on a stream of its own
    (``cuda:13``, as FSDP issues its all-gathers), which reached it at once."""
    spans, markers = [], []
    for r in range(3):
        spans.append(span(r, 0, "step", 0, 1000 * MS))
        for i in range(40):
            issue = (20 * i) * MS
            lead = 100_000 if (r == 1 and i % 4 == 0) else 10 * MS
            row = span(r, 0, "collective", issue + lead, MS, group="dp:0", seq=i)
            spans.append({**row, "stream": "cuda:13"} if side_stream and lead < MS else row)
            markers.append({"rank": r, "group": "dp:0", "seq": i, "op": "all_reduce", "state": "enqueued",
                            "time_ns": issue, "step": 0, "bytes": None, "peer": None})
    return hand_run(path, spans, markers, devices=devices, source=source)


def overlapped_run(path: Path, *, seed: int, ranks: int = 8, late: int | None = None, offset_us: float = 300.0,
                   paused: int | None = None, pause_ms: float = 0.0, steps: int = 24, calls: int = 30,
                   on_gpus: bool = True, untimed: int = 0) -> Path:
    """``ranks`` ranks of one stage, per step a forward span (2% noise), then ``calls`` asynchronous
    all-reduces issued 1 ms apart, each completing 4 ms after its last member arrives (so they
    overlap, as a data-parallel job's gradient reductions do), the step ending 2 ms after the last.
    ``late`` arrives ``offset_us`` late at every call: a steady offset the overlapping calls carry
    through the step. ``paused`` pauses ``pause_ms`` before its first call. ``on_gpus``: the ranks
    ran on CUDA devices (their spans are device times), else they are timed by the host clock.
    ``untimed``: each rank also made that many calls a step that the collector did not time (its
    ``collector_calls:dp:0`` metric counts them all, as a collector timing the group's calls in
    some micro-batches only writes)."""
    rng = np.random.default_rng(seed)
    spans = []
    t0 = 0
    for step in range(steps):
        compute = 40 * MS * np.exp(rng.normal(0.0, 0.02, ranks))
        first = t0 + compute
        if paused is not None:
            first[paused] += pause_ms * MS
        arrivals = [first + k * MS + rng.normal(0.0, 20_000, ranks) for k in range(calls)]
        if late is not None:
            for a in arrivals:
                a[late] += offset_us * 1000
        ends = [int(a.max()) + 4 * MS for a in arrivals]
        end = max(ends) + 2 * MS
        for r in range(ranks):
            spans.append(span(r, step, "step", t0, end - t0))
            spans.append(span(r, step, "forward", t0, int(compute[r])))
            for k, a in enumerate(arrivals):
                spans.append(span(r, step, "collective", int(a[r]), ends[k] - int(a[r]), group="dp:0",
                                  seq=step * calls + k))
        t0 = end + 2 * MS
    hand_run(path, spans, [], world=ranks, hosts=tuple(f"h{r // 4}" for r in range(ranks)), source="collector",
             devices=tuple(f"cuda:{r % 4}" for r in range(ranks)) if on_gpus else None)
    if untimed:
        for r in range(ranks):
            rows = [{"rank": r, "step": step, "name": f"{schema.COLLECTOR_CALLS_METRIC}dp:0",
                     "value": float(calls + untimed), "time_ns": None} for step in range(steps)]
            layout.write_part(path, "metrics", pa.Table.from_pylist(rows, schema=schema.METRICS), rank=r)
    return path
