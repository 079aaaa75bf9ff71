"""Small, seeded Kineto traces and flight-recorder dumps built in tests (no committed trace files)."""

from __future__ import annotations

import gzip
import json
import pickle
import random
from pathlib import Path
from typing import Any

BASE_NS = 1_790_000_000_000_000_000
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
GEN_KINETO = Path(__file__).resolve().parents[1].parent / "shared" / "tools" / "gen_kineto.py"


def gpu_trace(rank: int, world: int, *, steps: int = 3, slow_rank: int | None = None, factor: float = 1.5,
              seed: int = 0, waits: int = 0,
              pgs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A GPU-style trace: per step one forward and one backward kernel, then one NCCL all-reduce
    (and ``waits`` times the ``record_param_comms`` named "wait" that torch writes for Work.wait()).

    The all-reduce kernel starts when the slowest rank arrives (simulated with the same seed on
    every rank), so the slow rank arrives last and its peers' kernels hold the wait.
    """
    rng = random.Random(seed)
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": 100 + rank, "tid": 1, "ts": 0, "args": {"name": "thread 1 (python)"}},
        {"ph": "M", "name": "thread_name", "pid": 100 + rank, "tid": 2, "ts": 0, "args": {"name": "thread 2 (pt_autograd_0)"}},
    ]
    corr = 1000
    ext = 1
    t = 1000.0
    for step in range(steps):
        step_start = t
        # every rank's kernel time this step (same seed everywhere), for the rendezvous
        durations = [(100.0 + rng.random()) * (factor if r == slow_rank else 1.0) for r in range(world)]
        mine = durations[rank]
        # forward: top-level aten::linear with a fwdbwd flow start, launching a kernel
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 100 + rank, "tid": 1,
                       "ts": t, "dur": 20.0, "args": {"External id": ext}})
        events.append({"ph": "s", "cat": "fwdbwd", "name": "fwdbwd", "id": ext, "pid": 100 + rank, "tid": 1, "ts": t})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100 + rank, "tid": 1,
                       "ts": t + 5.0, "dur": 4.0, "args": {"correlation": corr, "External id": ext}})
        events.append({"ph": "X", "cat": "kernel", "name": "gemm_fwd", "pid": 0, "tid": 7, "ts": t + 10.0,
                       "dur": mine, "args": {"device": 0, "stream": 7, "correlation": corr}})
        corr += 1
        ext += 1
        t_bwd = t + 10.0 + mine
        # backward on the autograd thread
        events.append({"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: MmBackward0",
                       "pid": 100 + rank, "tid": 2, "ts": t + 30.0, "dur": 20.0, "args": {"External id": ext}})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100 + rank, "tid": 2,
                       "ts": t + 35.0, "dur": 4.0, "args": {"correlation": corr, "External id": ext}})
        events.append({"ph": "X", "cat": "kernel", "name": "gemm_bwd", "pid": 0, "tid": 7, "ts": t_bwd,
                       "dur": mine, "args": {"device": 0, "stream": 7, "correlation": corr}})
        corr += 1
        ext += 1
        # all-reduce: arrival = end of this rank's backward; completion = last arrival + 30 µs
        arrive = t_bwd + mine
        last = max(t + 10.0 + 2 * d for d in durations)
        events.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 100 + rank, "tid": 2,
                       "ts": t + 60.0, "dur": 10.0,
                       "args": {"External id": ext, "Collective name": "allreduce", "Process Group Name": "0",
                                "Process Group Ranks": str(list(range(world))), "In msg nelems": 1024,
                                "Out msg nelems": 1024, "Group size": world, "dtype": "BFloat16"}})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernelExC", "pid": 100 + rank, "tid": 2,
                       "ts": t + 62.0, "dur": 4.0, "args": {"correlation": corr, "External id": ext}})
        events.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
                       "pid": 0, "tid": 13, "ts": arrive, "dur": last + 30.0 - arrive,
                       "args": {"device": 0, "stream": 13, "correlation": corr}})
        corr += 1
        ext += 1
        for i in range(waits):
            events.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 100 + rank, "tid": 1,
                           "ts": t + 70.0 + i, "dur": 0.5,
                           "args": {"External id": ext, "Collective name": "wait", "Process Group Name": "0",
                                    "Process Group Ranks": str(list(range(world))), "In msg nelems": 0,
                                    "Out msg nelems": 0, "Group size": world, "dtype": "Float"}})
            ext += 1
        t = last + 40.0
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step + 5}", "pid": 100 + rank,
                       "tid": 1, "ts": step_start, "dur": t - step_start, "args": {}})
        t += 10.0
    rng.shuffle(events)  # Kineto does not sort events; neither may the importer assume it
    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world, "pg_count": 1,
                            "pg_config": pgs if pgs is not None else [
                                {"pg_name": "0", "pg_desc": "default_pg", "pg_size": world, "ranks": list(range(world))}]},
        "deviceProperties": [{"id": 0, "name": "Test GPU"}],
        "traceEvents": events,
        "traceName": f"rank{rank}",
        "baseTimeNanoseconds": BASE_NS,
    }


def write_trace(path: Path, trace: dict[str, Any]) -> Path:
    text = json.dumps(trace, indent=1)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def fr_entry(record_id: int, seq: int, *, pg: tuple[str, str] = ("0", "default_pg"), created: int,
             completed: int | None, name: str = "nccl:all_reduce", nelems: int = 256,
             is_p2p: bool = False) -> dict[str, Any]:
    return {
        "record_id": record_id, "pg_id": int(pg[0]), "process_group": pg, "collective_seq_id": seq,
        "p2p_seq_id": 0, "op_id": seq, "profiling_name": name, "time_created_ns": created,
        "duration_ms": 0.5 if completed is not None else None,
        "input_sizes": [[nelems]], "input_dtypes": ["Float"], "output_sizes": [[nelems]], "output_dtypes": ["Float"],
        "state": "completed" if completed is not None else "scheduled",
        "time_discovered_started_ns": completed - 600_000 if completed is not None else None,
        "time_discovered_completed_ns": completed, "retired": completed is not None, "timeout_ms": 600000,
        "is_p2p": is_p2p, "frames": [],
    }


def fr_dump(entries: list[dict[str, Any]], pg_config: dict[str, Any]) -> dict[str, Any]:
    return {"version": "2.10", "comm_lib_version": "2.21.5", "pg_config": pg_config, "pg_status": {},
            "entries": entries}


def write_pickle(path: Path, obj: Any) -> Path:
    path.write_bytes(pickle.dumps(obj))
    return path
