"""What timing one collective costs the training thread, by who times it (one CUDA device).

In an NCCL world of one (real collective kernels, a 4 KiB all-reduce), the training thread's CPU
time per call (``time.thread_time_ns``, median of repeats) of:

* ``plain``: ``dist.all_reduce`` alone;
* ``+ 2 timing events``: the same between two ``torch.cuda.Event(enable_timing=True)`` records,
  what any span timed on the device adds at the least;
* ``megascope comm span, device clock`` / ``host clock``: the call inside ``col.comm(...)``; with
  the device clock also with the writer parked (no pass during the measurement: what the writer's
  passes take from the training thread) and with the markers kept in the process (no marker
  agent: what its shared-memory ring costs);
* ``plain, TORCH_NCCL_ENABLE_TIMING=1``: torch's own start/end events per collective, recorded in
  C++ (the flight recorder keeps their durations);
* ``made asynchronous and waited``: the same, ``async_op=True`` and ``wait()``, nothing kept;
* ``torch durations, kept``: the same, its work object kept with a host stamp for a reader
  thread that takes each duration (``Work._get_duration``) once the work completed;
* ``torch durations, flight recorder read``: the plain call with torch's timing, and a reader
  thread that dumps the flight recorder (its buffer one repeat's calls long) once per repeat, after
  its calls, each dump unpickled and its durations counted: durations read in bulk.

``--durations`` checks what torch's duration measures instead (TORCH_NCCL_ENABLE_TIMING=1): a
device delay (``torch.cuda._sleep``) queued before the call on the compute stream, the call's
duration against two timing events around it on that stream. The start event is recorded on
NCCL's stream once it has waited for the compute stream, so a delay before the call must not count;
with peers it would count the wait for the last of them. Also: the reader's cost per duration, and
what a duration asked for before the work completed gives.

Each configuration runs in a fresh process (the NCCL variable is read when the group is made),
the processes interleaved, ``--rounds`` times. Prints a table; with ``OUT`` set, writes
``$OUT/nccl_timing.json``.

    python bench/gpu_nccl_timing.py --rounds 3
    python bench/gpu_nccl_timing.py --rounds 3 --only torch-kept --only torch-fr
    python bench/gpu_nccl_timing.py --durations
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

VARIANTS = ("plain", "events", "span-device", "span-device-parked", "span-device-no-agent", "span-host", "torch-timing",
            "torch-async", "torch-kept", "torch-fr")
LABELS = {
    "plain": "plain",
    "events": "+ 2 timing events",
    "span-device": "megascope comm span, device clock",
    "span-device-parked": "the same, writer parked",
    "span-device-no-agent": "the same, markers kept in process",
    "span-host": "megascope comm span, host clock",
    "torch-timing": "plain, TORCH_NCCL_ENABLE_TIMING=1",
    "torch-async": "the same, made asynchronous and waited",
    "torch-kept": "torch durations, kept for a reader",
    "torch-fr": "torch durations, flight recorder read",
}
TORCH_TIMED = ("torch-timing", "torch-async", "torch-kept", "torch-fr")


def child(variant: str, calls: int, repeats: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from megascope.collectors import Collector, CollectorConfig

    tmp = Path(tempfile.mkdtemp(prefix="megascope-nccl-timing-"))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp / 'init'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    x = torch.ones(1024, device="cuda")
    col = None
    if variant.startswith("span-"):
        col = Collector(CollectorConfig(run_dir=tmp / "run", device=torch.device("cuda"),
                                        clock=variant.split("-")[1], handle_sigterm=False,
                                        flush_interval_s=3600.0 if variant.endswith("-parked") else 0.5,
                                        max_buffered_rows=4 * calls * (repeats + 1),
                                        marker_agent=not variant.endswith("-no-agent")), rank=0, world_size=1)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    kept: collections.deque[tuple[int, Any]] = collections.deque()
    durations: list[float] = []
    stop = threading.Event()

    def reader() -> None:
        # Takes the kept works in order, each once it completed (the writer thread's side).
        while not stop.is_set() or kept:
            if not kept:
                time.sleep(0.001)
                continue
            _, work = kept[0]
            if not work.is_completed():
                time.sleep(0.0002)
                continue
            kept.popleft()
            durations.append(work._get_duration())

    dumps_wanted = threading.Semaphore(0)
    dump_stats: list[tuple[float, int, int]] = []  # (reader CPU ms a dump, entries with a duration, entries)

    def fr_reader() -> None:
        from megascope.collectors.flight_recorder import dump_entries, dump_functions

        dump = dump_functions()
        while True:
            dumps_wanted.acquire()
            if stop.is_set():
                return
            t0 = time.thread_time_ns()
            entries = dump_entries(dump)
            timed = sum(1 for e in entries if e.get("duration_ms") is not None)
            dump_stats.append(((time.thread_time_ns() - t0) / 1e6, timed, len(entries)))

    side = None
    if variant == "torch-kept":
        side = threading.Thread(target=reader, daemon=True)
    elif variant == "torch-fr":
        side = threading.Thread(target=fr_reader, daemon=True)
    if side is not None:
        side.start()

    def run(k: int) -> None:
        for _ in range(k):
            if variant == "torch-kept":
                stamp = time.perf_counter_ns()
                work = dist.all_reduce(x, async_op=True)
                work.wait()
                kept.append((stamp, work))
            elif variant == "torch-async":
                dist.all_reduce(x, async_op=True).wait()
            elif variant == "events":
                begin.record()
                dist.all_reduce(x)
                end.record()
            elif col is not None:
                with col.comm(op="all_reduce", group="world", bytes=4096):
                    dist.all_reduce(x)
            else:
                dist.all_reduce(x)

    cpu, wall = [], []
    for step in range(repeats + 1):
        torch.cuda.synchronize()
        t0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        if col is not None:
            with col.step(step):
                run(calls)
        else:
            run(calls)
        if variant == "torch-fr":
            dumps_wanted.release()  # the reader dumps while the next repeat runs
        cpu.append((time.thread_time_ns() - t0) / calls / 1e3)
        wall.append((time.perf_counter_ns() - w0) / calls / 1e3)
    torch.cuda.synchronize()
    if side is not None:
        stop.set()
        dumps_wanted.release()
        side.join()
    if col is not None:
        col.close()
    dist.destroy_process_group()
    # The first repeat warms NCCL and the event pool up: left out.
    result = {"cpu_us": statistics.median(cpu[1:]), "wall_us": statistics.median(wall[1:])}
    if durations:
        result["durations_read"] = len(durations)
        result["duration_median_us"] = statistics.median(durations) * 1e3
    if dump_stats:
        result["dump_cpu_ms"] = statistics.median(d for d, _, _ in dump_stats)
        result["dump_timed_entries"] = statistics.median(n for _, n, _ in dump_stats)
        result["dump_entries"] = statistics.median(n for _, _, n in dump_stats)
    return result


def check_durations(trials: int) -> dict[str, Any]:
    """What ``Work._get_duration`` measures (see the module's doc); run with TORCH_NCCL_ENABLE_TIMING=1."""
    import torch
    import torch.distributed as dist

    from megascope.trainer.faults import sleep_cycles_per_ns

    tmp = Path(tempfile.mkdtemp(prefix="megascope-nccl-durations-"))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp / 'init'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    x = torch.ones(1024, device="cuda")
    per_ns = sleep_cycles_per_ns(torch.device("cuda", 0))
    rows = []
    for delay_us in (0, 200, 2000):
        torch_us, events_us = [], []
        for _ in range(trials):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if delay_us:
                torch.cuda._sleep(int(delay_us * 1e3 * per_ns))
            a.record()
            work = dist.all_reduce(x, async_op=True)
            work.wait()
            b.record()
            torch.cuda.synchronize()
            torch_us.append(work._get_duration() * 1e3)
            events_us.append(a.elapsed_time(b) * 1e3)
        rows.append({"delay_before_us": delay_us, "torch_duration_us": statistics.median(torch_us),
                     "events_around_us": statistics.median(events_us)})
    # A duration asked for while the work is still queued (behind a 20 ms delay).
    torch.cuda._sleep(int(20e6 * per_ns))
    work = dist.all_reduce(x, async_op=True)
    early: dict[str, Any] = {"completed": work.is_completed()}
    try:
        early["duration_ms"] = work._get_duration()
    except Exception as exc:  # noqa: BLE001 - what torch raises is the finding
        early["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    torch.cuda.synchronize()
    # The reader's cost: one duration read from a completed work, CPU time.
    works = [dist.all_reduce(x, async_op=True) for _ in range(2000)]
    torch.cuda.synchronize()
    t0 = time.thread_time_ns()
    for w in works:
        w.is_completed()
        w._get_duration()
    read_us = (time.thread_time_ns() - t0) / len(works) / 1e3
    dist.destroy_process_group()
    return {"rows": rows, "early": early, "read_us": read_us}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", action="append", choices=VARIANTS, help="only these (repeatable)")
    parser.add_argument("--durations", action="store_true", help="check what torch's per-collective duration measures")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--durations-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.calls, args.repeats)))
        return 0
    if args.durations_child:
        print("RESULT " + json.dumps(check_durations(trials=args.repeats * 3)))
        return 0
    if args.durations:
        return durations_table(args.repeats)
    chosen = tuple(v for v in VARIANTS if not args.only or v in args.only or v == "plain")
    results: dict[str, list[dict[str, float]]] = {v: [] for v in chosen}
    for r in range(args.rounds):
        order = chosen if r % 2 == 0 else tuple(reversed(chosen))
        for variant in order:
            env = dict(os.environ, TORCH_NCCL_ENABLE_TIMING="1" if variant in TORCH_TIMED else "0")
            if variant == "torch-fr":
                # One repeat's calls (the variable's name before and since torch 2.7).
                env["TORCH_FR_BUFFER_SIZE"] = env["TORCH_NCCL_TRACE_BUFFER_SIZE"] = str(args.calls)
            proc = subprocess.run([sys.executable, __file__, "--child", variant, "--calls", str(args.calls),
                                   "--repeats", str(args.repeats)], capture_output=True, text=True, env=env)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"{variant}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                return 1
            results[variant].append(json.loads(line[7:]))
    base = statistics.median(x["cpu_us"] for x in results["plain"])
    rows: list[dict[str, Any]] = []
    print(f"\nHost CPU time per 4 KiB all-reduce, NCCL world of one, {args.rounds} rounds x {args.repeats} repeats "
          f"x {args.calls} calls (median of the rounds' medians)\n")
    print(f"| {'how it is timed':<36} | CPU us / call | over plain | wall us / call |")
    print(f"|{'-' * 38}|---------------|------------|---------------|")
    for variant in chosen:
        cpu = statistics.median(x["cpu_us"] for x in results[variant])
        wall = statistics.median(x["wall_us"] for x in results[variant])
        rows.append({"variant": variant, "cpu_us": cpu, "over_plain_us": cpu - base, "wall_us": wall,
                     "rounds": results[variant]})
        print(f"| {LABELS[variant]:<36} | {cpu:13.2f} | {cpu - base:+10.2f} | {wall:13.2f} |")
    for variant in chosen:
        extra = {k: v for k, v in results[variant][-1].items() if k not in ("cpu_us", "wall_us")}
        if extra:
            print(f"{LABELS[variant]}, last round: {extra}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "nccl_timing.json").write_text(json.dumps(rows, indent=1))
    return 0


def durations_table(repeats: int) -> int:
    env = dict(os.environ, TORCH_NCCL_ENABLE_TIMING="1")
    proc = subprocess.run([sys.executable, __file__, "--durations-child", "--repeats", str(repeats)],
                          capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        print(f"durations: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
        return 1
    found = json.loads(line[7:])
    print("\nWhat torch's per-collective duration measures (4 KiB all-reduce, NCCL world of one, medians)\n")
    print("| device delay queued before the call | torch's duration, us | two events around the call, us |")
    print("|---|---|---|")
    for row in found["rows"]:
        print(f"| {row['delay_before_us']} us | {row['torch_duration_us']:.1f} | {row['events_around_us']:.1f} |")
    print(f"\nasked for before completion: {found['early']}")
    print(f"reading one duration of a completed work: {found['read_us']:.2f} us of CPU")
    out = os.environ.get("OUT")
    if out:
        Path(out, "nccl_durations.json").write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
