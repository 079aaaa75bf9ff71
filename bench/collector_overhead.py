"""What the in-job collector costs: host microseconds per span (CPU) and step-time overhead (GPU).

One command, prints tables, writes ``$OUT/collector_overhead.json`` when ``OUT`` is set::

    python bench/collector_overhead.py                 # CPU part; GPU part too when CUDA is there
    python bench/collector_overhead.py --gpu-only --repeats 7 --drift-s 60
    python bench/collector_overhead.py --gpu-only --span-cost-only     # host cost per span by clock

CPU part: the host cost of one span, comm span (with its markers) and metric, and of module hooks,
each against a bare loop in the same process (medians of repeats). Then the writer stall: how long
one background pass of the writer keeps a stand-in training thread (Python work, then a wait that
releases the interpreter lock, like a blocked kernel launch) from running, paced and unpaced (also
on CUDA, with device events). Then the Python garbage collections that spans set off in a
process with a million other objects alive, against a disabled collector.

GPU part (needs one CUDA device): first the host CPU time of one empty span under each clock
(``device``, ``side-stream``, ``host``, and ``device`` through torch's public event API only),
on the training thread and in the writer, and the device time a timing event adds between two
kernels when the host is far ahead (so the figure is the device's alone). Then, in an NCCL
world of one (real collective kernels), a ~1B-parameter bf16 MLP-block model,
forward+backward+AdamW, one all-reduce per block's gradients. Configurations, interleaved in every
repeat: no collector; a disabled collector; the collector with per-layer forward/backward spans
and per-collective spans. Reports the median step time of each and the
overhead, the device synchronizations seen by ``torch.cuda.set_sync_debug_mode("warn")`` with and
without the collector, and the drift of the device clock against the host wall clock from one
anchor (how far apart anchors may be).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from megascope.collectors import Collector, CollectorConfig, instrument_module

from megascope.schema import SpanKind


def _table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    print(f"\n{title}")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)) + " |")


# ---------------------------------------------------------------------------------------------- CPU
def _per_call_us(fn: Any, n: int, repeats: int) -> float:
    # CPU time of the calling (training) thread: on a shared machine wall time mostly measures the
    # neighbours, while this is what the collector takes from the training loop itself.
    samples = []
    for _ in range(repeats):
        t0 = time.thread_time_ns()
        fn(n)
        samples.append((time.thread_time_ns() - t0) / n / 1e3)
    return statistics.median(samples)


def bench_cpu(n: int, repeats: int) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="megascope-bench-"))
    col = Collector(CollectorConfig(run_dir=tmp / "on", device=torch.device("cpu"), max_buffered_rows=4 * n * repeats,
                                    flush_interval_s=3600.0, handle_sigterm=False), rank=0, world_size=1)
    off = Collector(CollectorConfig(run_dir=tmp / "off", enabled=False), rank=0, world_size=1)
    # Markers kept in the process (the writer thread writes them) rather than put in the marker
    # agent's shared-memory ring: what the ring costs on the training thread.
    inproc = Collector(CollectorConfig(run_dir=tmp / "inproc", device=torch.device("cpu"), marker_agent=False,
                                       max_buffered_rows=4 * n * repeats, flush_interval_s=3600.0,
                                       handle_sigterm=False), rank=0, world_size=1)

    def bare(k: int) -> None:
        for _ in range(k):
            pass

    def span_on(k: int) -> None:
        for _ in range(k):
            with col.span("x", kind=SpanKind.COMPUTE):
                pass

    def span_off(k: int) -> None:
        for _ in range(k):
            with off.span("x", kind=SpanKind.COMPUTE):
                pass

    def comm_on(k: int) -> None:
        for _ in range(k):
            with col.comm(op="all_reduce", group="tp:0", bytes=1024):
                pass

    def comm_inproc(k: int) -> None:
        for _ in range(k):
            with inproc.comm(op="all_reduce", group="tp:0", bytes=1024):
                pass

    def metric_on(k: int) -> None:
        for i in range(k):
            col.metric("loss", 1.0, step=i)

    with col.step(0):
        base = _per_call_us(bare, n, repeats)
        out = {
            "span_enabled_us": _per_call_us(span_on, n, repeats) - base,
            "span_disabled_us": _per_call_us(span_off, n, repeats) - base,
            "comm_enabled_us": _per_call_us(comm_on, n, repeats) - base,
            "comm_markers_in_process_us": _per_call_us(comm_inproc, n, repeats) - base,
            "metric_float_us": _per_call_us(metric_on, n, repeats) - base,
        }
        col.flush()
        # The writer's share (on its own thread in a job): resolving and writing one span, timed here
        # by flushing on this thread; the background flush is parked by a long interval.
        span_on(n)
        t0 = time.thread_time_ns()
        col.flush()
        out["writer_per_span_us"] = (time.thread_time_ns() - t0) / n / 1e3

    # Module hooks: 32 chained small blocks, forward + backward, with and without instrumentation.
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(32)])

    def fwd_bwd(k: int) -> None:
        for _ in range(k):
            model(torch.randn(8, 32, requires_grad=True)).sum().backward()

    m = max(20, n // 500)
    plain = _per_call_us(fwd_bwd, m, repeats)
    handles = instrument_module(model, ["*"], collector=col)
    with col.step(1):
        hooked = _per_call_us(fwd_bwd, m, repeats)
    for h in handles:
        h.remove()
    out["module_hooks_per_module_us"] = (hooked - plain) / 32
    col.close()
    inproc.close()
    out["rows_dropped"] = col.stats["rows_dropped"]
    return out


# ---------------------------------------------------------------------------------------------- GPU
class _Block(torch.nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, 4 * h, bias=False)
        self.down = torch.nn.Linear(4 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _gpu_setup(hidden: int, layers: int, tokens: int) -> tuple[Any, Any, Any]:
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList(_Block(hidden) for _ in range(layers))})
    model = model.to("cuda", torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return model, opt, x


def _train_step(model: Any, opt: Any, x: Any, col: Collector | None, step: int) -> None:
    import torch.distributed as dist

    def body() -> None:
        h = x
        for layer in model["layers"]:
            h = layer(h)
        h.float().pow(2).mean().backward()
        for layer in model["layers"]:  # one gradient all-reduce per block, as a bucketed DDP would
            flat = layer.up.weight.grad
            if col is None:
                dist.all_reduce(flat)
            else:
                col.dist.all_reduce(flat)
        opt.step()
        opt.zero_grad(set_to_none=False)

    if col is None:
        body()
    else:
        with col.step(step):
            body()


def _hooks(model: Any, col: Collector | None) -> list[Any]:
    """Per-layer spans only for the configuration being timed (hooks stay on a model until removed)."""
    return instrument_module(model, ["layers.*"], collector=col) if col is not None else []


def _time_steps(model: Any, opt: Any, x: Any, col: Collector | None, steps: int, first_step: int) -> float:
    handles = _hooks(model, col)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        _train_step(model, opt, x, col, first_step + i)
    torch.cuda.synchronize()  # the measurement's own sync, outside the steps
    elapsed = time.perf_counter() - t0
    for h in handles:
        h.remove()
    return elapsed / steps * 1e3


def _count_syncs(model: Any, opt: Any, x: Any, col: Collector | None, steps: int) -> int:
    handles = _hooks(model, col)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for i in range(steps):
                _train_step(model, opt, x, col, 10_000 + i)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for h in handles:
        h.remove()
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def _drift(seconds: float, model: Any, opt: Any, x: Any) -> list[dict[str, float]]:
    """Device-clock drift against the host wall clock, measured from one anchor taken at an idle stream."""
    from megascope.collectors.timing import CudaTimer

    torch.cuda.synchronize()
    timer = CudaTimer(torch.device("cuda"), anchor_interval_s=1e9)
    anchor = timer.anchor
    out = []
    checkpoints = [c for c in (1, 5, 10, 30, 60, 120, 300) if c <= seconds]
    start = time.monotonic()
    for c in checkpoints:
        while time.monotonic() - start < c:
            _train_step(model, opt, x, None, 0)
        torch.cuda.synchronize()
        probe = torch.cuda.Event(enable_timing=True)
        w0 = time.time_ns()
        probe.record()
        probe.synchronize()
        w1 = time.time_ns()
        predicted = anchor.wall_ns + round(anchor.mark.elapsed_time(probe) * 1e6)  # what wall_ns computes
        err_us = (predicted - (w0 + w1) / 2) / 1e3
        elapsed = (w1 - anchor.wall_ns) / 1e9
        out.append({"after_s": round(elapsed, 1), "error_us": round(err_us, 1),
                    "bracket_us": round((w1 - w0) / 1e3, 1), "ppm": round(err_us / elapsed, 2)})
    return out


def bench_gpu_spans(n: int, repeats: int) -> dict[str, dict[str, float]]:
    """Host cost of one empty span on a CUDA device under each clock: the training thread's CPU time
    per span, and the writer's (resolving the span's two events and writing it), timed by flushing on
    this thread."""
    from megascope.collectors.config import CLOCKS

    tmp = Path(tempfile.mkdtemp(prefix="megascope-bench-spans-"))
    out: dict[str, dict[str, float]] = {}
    for variant in (*CLOCKS, "device-public-api"):
        clock = variant.removesuffix("-public-api")
        col = Collector(CollectorConfig(run_dir=tmp / variant, device=torch.device("cuda"), clock=clock,
                                        max_buffered_rows=2 * n * (repeats + 1), flush_interval_s=3600.0,
                                        handle_sigterm=False), rank=0, world_size=1)
        if variant != clock:  # the timer as it was before its private-API hot path: the baseline
            timer: Any = col._timer
            timer._raw_current = None
            timer._rec = None  # the records through the driver need the raw stream handle
            timer._record, timer._query = torch.cuda.Event.record, torch.cuda.Event.query
            timer._elapsed = torch.cuda.Event.elapsed_time

        def span_on(k: int, col: Collector = col) -> None:
            for _ in range(k):
                with col.span("x", kind=SpanKind.COMPUTE):
                    pass

        # Events come back to the pool when the writer resolves their spans: a flush before every
        # sample, as the background writer does in a job, so that no sample creates events.
        with col.step(0):
            span_on(n)  # fills the pool
            samples = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                col.flush()
                t0 = time.thread_time_ns()
                span_on(n)
                samples.append((time.thread_time_ns() - t0) / n / 1e3)
            per_span = statistics.median(samples)
            torch.cuda.synchronize()
            col.flush()
            span_on(n)
            torch.cuda.synchronize()
            t0 = time.thread_time_ns()
            col.flush()
            writer = (time.thread_time_ns() - t0) / n / 1e3
        col.close()
        out[variant] = {"span_us": per_span, "writer_per_span_us": writer}
    return out


def bench_event_device_cost(repeats: int, iters: int = 300) -> dict[str, dict[str, float]]:
    """Device time the collector's stamps add between kernels, with the host far ahead of the device.

    A ``torch.cuda._sleep`` kernel first holds the stream while the host queues ``iters`` kernels
    (fewer than the launch queue holds), each inside a span of the given clock (two stamps), so the
    figure is the device's alone: device microseconds per stamp against the bare chain. "1 timing
    event" records one raw timing event per kernel; "plain event" one event without timing (what
    the side-stream clock leaves on the work stream). The "fork" and "join" rows place one stamp
    where a collective puts a cross-stream dependency anyway: before the event a communication
    stream waits for (a launch), and after waiting for a communication stream's event (``wait()``);
    their cost is against the chain with the dependency and without the stamp.
    """
    from megascope.collectors.timing import CudaTimer

    x = torch.randn(8 << 20, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    kernels: dict[str, Any] = {
        "elementwise 8M bf16": lambda: x.mul_(1.0),
        "mm 1024 bf16": lambda: torch.mm(a, a),
        "mm 4096 bf16": lambda: torch.mm(b, b),
    }
    timers = {"span, device clock": CudaTimer("cuda"), "span, side-stream clock": CudaTimer("cuda", side_stream=True)}
    device_timer = timers["span, device clock"]
    timed = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    plain = [torch.cuda.Event(enable_timing=False) for _ in range(iters)]
    comm = torch.cuda.Stream()
    comm_done = torch.cuda.Event(enable_timing=False)
    comm_done.record(comm)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def chain(kernel: Any, variant: str) -> float:
        timer = timers.get(variant)
        tokens: list[Any] = []
        main = torch.cuda.current_stream()
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # ~25 ms at ~2 GHz: the host queues everything meanwhile
        start.record()
        for i in range(iters):
            if timer is not None:
                tokens.append(timer.stamp())
            if variant.startswith("fork"):
                if variant.endswith("stamp"):
                    tokens.append(device_timer.stamp())
                plain[i].record(main)
                comm.wait_event(plain[i])
            kernel()
            if timer is not None:
                tokens.append(timer.stamp())
            elif variant == "1 timing event":
                timed[i].record()
            elif variant == "plain event":
                plain[i].record()
            elif variant.startswith("join"):
                main.wait_event(comm_done)
                if variant.endswith("stamp"):
                    tokens.append(device_timer.stamp())
        end.record()
        end.synchronize()
        for token in tokens:
            (timer or device_timer).release(token)
        return start.elapsed_time(end) * 1e3 / iters

    variants = ("bare", "1 timing event", "plain event", *timers, "fork", "fork + stamp", "join", "join + stamp")
    out: dict[str, dict[str, float]] = {}
    for name, kernel in kernels.items():
        for v in variants:  # warm-up, and the timers' event pools
            chain(kernel, v)
        samples: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(repeats):
            for v in variants:
                samples[v].append(chain(kernel, v))
        med = {v: statistics.median(s) for v, s in samples.items()}
        out[name] = {"bare": med["bare"]}
        for v in ("1 timing event", "plain event", *timers):
            out[name][v] = (med[v] - med["bare"]) / (2 if v in timers else 1)
        out[name]["fork (no stamp)"] = med["fork"] - med["bare"]
        out[name]["stamp at a fork"] = med["fork + stamp"] - med["fork"]
        out[name]["join (no stamp)"] = med["join"] - med["bare"]
        out[name]["stamp at a join"] = med["join + stamp"] - med["join"]
    return out


def _launch_loop(done: threading.Event) -> list[float]:
    """A stand-in training thread until ``done``: 10 us of Python (holding the interpreter lock),
    then a wait without it (a kernel launch blocked on a full launch queue). Returns the gaps
    between iterations in ms."""
    gaps, last = [], time.perf_counter()
    while not done.is_set():
        until = time.perf_counter_ns() + 10_000
        while time.perf_counter_ns() < until:
            pass
        time.sleep(0.00005)
        now = time.perf_counter()
        gaps.append((now - last) * 1e3)
        last = now
    return gaps


def bench_writer_stall(device: Any, spans: int, repeats: int) -> dict[str, dict[str, float]]:
    """How long the writer's background pass over ``spans`` spans stalls a training thread, paced
    (the default duty) and unpaced (duty 1). A gap over 1 ms in the stand-in loop (normally ~0.1 ms)
    is a stall: the thread wanted the interpreter lock and the writer had it."""
    tmp = Path(tempfile.mkdtemp(prefix="megascope-bench-stall-"))
    out: dict[str, dict[str, float]] = {}
    for duty in (1.0, CollectorConfig(run_dir=tmp).writer_duty):
        col = Collector(CollectorConfig(run_dir=tmp / f"duty{duty}", device=device, writer_duty=duty,
                                        max_buffered_rows=8 * spans, flush_interval_s=3600.0, handle_sigterm=False),
                        rank=0, world_size=1)
        rows: dict[str, list[float]] = {"pass_ms": [], "stalled_ms": [], "longest_gap_ms": [], "writer_cpu_ms": []}
        for rep in range(repeats + 1):  # the first fills the event pool and is left out
            with col.step(rep):
                for _ in range(spans):
                    with col.span("x", kind=SpanKind.COMPUTE):
                        pass
            if getattr(device, "type", "cpu") == "cuda":
                torch.cuda.synchronize()
            done = threading.Event()
            cpu = [0]

            def writer_pass(col: Collector = col, done: threading.Event = done, cpu: list[int] = cpu) -> None:
                t0 = time.thread_time_ns()
                col._writer.flush(paced=True)
                cpu[0] = time.thread_time_ns() - t0
                done.set()

            thread = threading.Thread(target=writer_pass)
            t0 = time.perf_counter()
            thread.start()
            gaps = _launch_loop(done)
            wall = (time.perf_counter() - t0) * 1e3
            thread.join()
            if rep:
                rows["pass_ms"].append(wall)
                rows["stalled_ms"].append(sum(g for g in gaps if g > 1.0))
                rows["longest_gap_ms"].append(max(gaps, default=0.0))
                rows["writer_cpu_ms"].append(cpu[0] / 1e6)
        col.close()
        out[f"duty {duty:g}"] = {k: statistics.median(v) for k, v in rows.items()}
    return out


def bench_gc_churn(spans: int, heap_objects: int) -> dict[str, dict[str, float]]:
    """Python garbage collections the collector's spans set off in a process with a job-sized heap.

    ``heap_objects`` long-lived objects stand in for a training process (torch, the model, the
    autograd machinery), then ``spans`` empty spans go through a collector with its writer in the
    background, 1,000 a step. A span lives as Python objects until written, about a second, so it
    outlives the young generations and counts towards the next full collection, which scans the
    whole heap and stops every thread. Returns collections and milliseconds per generation, with
    the collector disabled as the baseline.
    """
    import gc

    heap = [{"i": i} for i in range(heap_objects)]
    gc.collect()
    out: dict[str, dict[str, float]] = {}
    for variant in ("disabled", "enabled"):
        tmp = Path(tempfile.mkdtemp(prefix="megascope-bench-gc-"))
        col = Collector(CollectorConfig(run_dir=tmp, flush_interval_s=0.2, handle_sigterm=False,
                                        enabled=variant == "enabled", gc_span_min_ms=None), rank=0, world_size=1)
        counts = {0: [0, 0], 1: [0, 0], 2: [0, 0]}
        started = [0]

        def watch(phase: str, info: dict[str, Any], counts: dict[int, list[int]] = counts,
                  started: list[int] = started) -> None:
            if phase == "start":
                started[0] = time.perf_counter_ns()
            else:
                counts[info["generation"]][0] += 1
                counts[info["generation"]][1] += time.perf_counter_ns() - started[0]

        gc.collect()
        gc.callbacks.append(watch)
        try:
            for step in range(spans // 1000):
                with col.step(step):
                    for _ in range(1000):
                        with col.span("layers.3", kind=SpanKind.FORWARD, microbatch=0):
                            pass
                time.sleep(0.005)  # the rest of a step: the writer runs meanwhile
        finally:
            gc.callbacks.remove(watch)
        col.close()
        out[variant] = {f"gen{g}_{what}": (n if what == "collections" else ns / 1e6)
                        for g, (n, ns) in counts.items() for what in ("collections", "ms")}
    del heap
    return out


def _stall_table(device: Any, spans: int, repeats: int, result: dict[str, Any]) -> None:
    stall = bench_writer_stall(device, spans, repeats)
    result[f"writer_stall_{getattr(device, 'type', 'cpu')}"] = stall
    _table(f"Writer pass over {spans} spans ({device}) next to a stand-in training thread (median of {repeats})",
           ["writer", "writer CPU ms", "pass ms", "training thread stalled ms", "longest gap ms"],
           [[k, f"{v['writer_cpu_ms']:.1f}", f"{v['pass_ms']:.1f}", f"{v['stalled_ms']:.1f}",
             f"{v['longest_gap_ms']:.2f}"] for k, v in stall.items()])


def bench_gpu(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    tmp = Path(tempfile.mkdtemp(prefix="megascope-bench-gpu-"))
    dist.init_process_group("nccl", init_method=f"file://{tmp / 'init'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    model, opt, x = _gpu_setup(args.hidden, args.layers, args.tokens)
    params = sum(p.numel() for p in model.parameters())
    on = Collector(CollectorConfig(run_dir=tmp / "on", device=torch.device("cuda"), handle_sigterm=False),
                   rank=0, world_size=1)
    off = Collector(CollectorConfig(run_dir=tmp / "off", enabled=False), rank=0, world_size=1)
    # The same with markers kept for the writer thread instead of the marker agent's ring.
    no_agent = Collector(CollectorConfig(run_dir=tmp / "no-agent", device=torch.device("cuda"), marker_agent=False,
                                         handle_sigterm=False), rank=0, world_size=1)
    configs: dict[str, Collector | None] = {"none": None, "disabled": off, "enabled": on,
                                            "enabled, no marker agent": no_agent}
    for col in configs.values():  # warm-up: allocator, cuBLAS, NCCL, event pool
        _time_steps(model, opt, x, col, 3, 0)
    samples: dict[str, list[float]] = {k: [] for k in configs}
    step = 100
    for _ in range(args.repeats):
        for name, col in configs.items():
            samples[name].append(_time_steps(model, opt, x, col, args.steps, step))
            step += args.steps
    med = {k: statistics.median(v) for k, v in samples.items()}
    syncs = {k: _count_syncs(model, opt, x, configs[k], 3) for k in ("none", "enabled")}
    drift = _drift(args.drift_s, model, opt, x)
    on.close()
    no_agent.close()
    spans = on.stats["rows_written_by_table"]["spans"]
    dist.destroy_process_group()
    return {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "params": params,
        "tokens_per_step": args.tokens, "steps_per_sample": args.steps, "repeats": args.repeats,
        "step_ms_median": med, "step_ms_samples": samples,
        "overhead_pct": {k: (med[k] - med["none"]) / med["none"] * 100
                         for k in ("disabled", "enabled", "enabled, no marker agent")},
        "syncs_in_3_steps": syncs, "drift": drift, "spans_written": spans,
        "spans_per_step": (2 * args.layers + args.layers + 1), "collector_stats": on.stats,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50_000, help="CPU: calls per sample")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gpu-only", action="store_true")
    parser.add_argument("--cpu-only", action="store_true")
    parser.add_argument("--span-cost-only", action="store_true", help="GPU: only the host cost per span by clock")
    parser.add_argument("--stall-spans", type=int, default=20_000,
                        help="spans in the writer-stall pass (CPU; a quarter of it on CUDA)")
    parser.add_argument("--gc-spans", type=int, default=200_000, help="CPU: spans in the garbage-collection count")
    parser.add_argument("--gc-heap", type=int, default=1_000_000, help="CPU: other live objects during that count")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)  # 8 x 2 x 4096 x 16384 = 1.07 B parameters
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10, help="GPU: steps per timed sample")
    parser.add_argument("--drift-s", type=float, default=60.0, help="GPU: how long to watch the clock drift")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:]}

    if not args.gpu_only:
        cpu = bench_cpu(args.n, args.repeats)
        result["cpu"] = cpu
        _table(f"CPU time of the training thread per call (median of {args.repeats} x {args.n}, bare loop subtracted)",
               ["what", "us per call"],
               [[k.removesuffix("_us"), f"{v:.2f}"] for k, v in cpu.items() if k.endswith("_us")])
        _stall_table(torch.device("cpu"), args.stall_spans, args.repeats, result)
        churn = bench_gc_churn(args.gc_spans, args.gc_heap)
        result["gc_churn"] = churn
        _table(f"Python garbage collections during {args.gc_spans:,} spans, {args.gc_heap:,} other objects alive",
               ["collector", "gen0 n", "gen1 n", "gen2 (full) n", "gen2 ms"],
               [[k, int(v["gen0_collections"]), int(v["gen1_collections"]), int(v["gen2_collections"]),
                 f"{v['gen2_ms']:.0f}"] for k, v in churn.items()])
    if not args.cpu_only and torch.cuda.is_available():
        spans = bench_gpu_spans(args.n // 5, args.repeats)
        result["gpu_span_cost"] = spans
        _table(f"CUDA device: host CPU time per empty span by clock (median of {args.repeats} x {args.n // 5})",
               ["clock", "training thread us", "writer us"],
               [[k, f"{v['span_us']:.2f}", f"{v['writer_per_span_us']:.2f}"] for k, v in spans.items()])
        _stall_table(torch.device("cuda"), args.stall_spans // 4, args.repeats, result)
        events = bench_event_device_cost(max(args.repeats, 5))
        result["gpu_event_device_cost"] = events
        _table("CUDA device: device us each stamp adds between kernels, host far ahead "
               f"(median of {max(args.repeats, 5)} chains of 300 kernels)",
               ["kernel", "bare kernel us", *list(next(iter(events.values())))[1:]],
               [[k, *(f"{v:.2f}" for v in d.values())] for k, d in events.items()])
    if not args.cpu_only and torch.cuda.is_available() and not args.span_cost_only:
        gpu = bench_gpu(args)
        result["gpu"] = gpu
        med = gpu["step_ms_median"]
        _table(f"GPU step time, {gpu['device']}, {gpu['params'] / 1e9:.2f} B params bf16, "
               f"{gpu['tokens_per_step']} tokens/step (median of {args.repeats} x {args.steps} steps)",
               ["collector", "step ms", "overhead %"],
               [[k, f"{med[k]:.2f}", "-" if k == "none" else f"{gpu['overhead_pct'][k]:+.2f}"] for k in med])
        _table("Device synchronizations in 3 steps (set_sync_debug_mode('warn'))", ["collector", "syncs"],
               [[k, v] for k, v in gpu["syncs_in_3_steps"].items()])
        _table("Device clock vs host wall clock from one anchor", ["after s", "error us", "bracket us", "ppm"],
               [[d["after_s"], d["error_us"], d["bracket_us"], d["ppm"]] for d in gpu["drift"]])
    elif not args.cpu_only and not torch.cuda.is_available():
        print("\n(no CUDA device: GPU part skipped)")

    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "collector_overhead.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
