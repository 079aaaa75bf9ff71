"""All the CPU the collector takes, not only the training thread's: per communication call, on the
training thread, on its own threads (writer, heartbeat) and in its marker agent process.

On a machine whose CPUs slow each other (docs/benchmarks-log.md, "Why one rank's host runs twice as
slow on the 4-GPU machines"), work on any CPU can slow a host-bound rank's launching thread, so the
whole of it counts. A stand-in training loop issues STEPS steps of CALLS communication calls each
(host clock, group ``tp:0``, a span and two markers per call; every fourth step's calls untimed, as
with sampled TP calls) and sleeps between steps, as a rank waits for its device; the same loop runs
with the collector disabled, and the difference is the collector's. CPU times come from the
kernel: the training thread's (``time.thread_time``), the process's (``getrusage``) and the agent's
(``/proc/PID/stat``), each including its close.

    python bench/collector_cpu.py [--steps 20 --calls 2000 --sleep-s 0.2 --repeats 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
from megascope.collectors import Collector, CollectorConfig

from megascope.schema import RunMeta
from megascope.topology import Group

_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _loop(run: Path, *, enabled: bool, steps: int, calls: int, sleep_s: float) -> dict[str, float]:
    cfg = CollectorConfig(run_dir=run, enabled=enabled, flush_interval_s=1.0, device=torch.device("cpu"),
                          handle_sigterm=False, comm_sample_kinds=("tp",), comm_sample_every=4)
    col = Collector(cfg, rank=0, world_size=2, coords={"pp": 0, "dp": 0, "tp": 0},
                    groups=[Group("tp:0", "tp", (0, 1))], meta=RunMeta(run_id="bench", source="collector", world_size=2))
    link = getattr(col, "_agent", None)  # a disabled collector has none
    agent = link.proc.pid if link is not None else None
    if link is not None:
        link.flush(timeout_s=30.0)  # started and answering: its start-up is not counted
    agent0 = _proc_cpu_s(agent) if agent else 0.0
    thread0, process0, wall0 = time.thread_time(), _process_cpu_s(), time.perf_counter()
    for step in range(steps):
        with col.step(step):
            for m in range(4):
                with col.span("forward", microbatch=m):
                    for _ in range(calls // 4):
                        col.comm_begin("all_gather", group="tp:0", bytes=1 << 20).end()
        time.sleep(sleep_s)
    agent_s = _proc_cpu_s(agent) - agent0 if agent else 0.0
    # close() ends the agent: read its CPU just before, then add what the close takes here.
    col.close()
    return {"thread": time.thread_time() - thread0, "process": _process_cpu_s() - process0,
            "agent": agent_s, "wall": time.perf_counter() - wall0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--calls", type=int, default=2000, help="communication calls a step")
    parser.add_argument("--sleep-s", type=float, default=0.2, help="between steps")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                rows[mode].append(_loop(Path(tmp) / f"{mode}{r}", enabled=mode == "on", steps=args.steps,
                                        calls=args.calls, sleep_s=args.sleep_s))
    n = args.steps * args.calls
    med = {mode: {k: statistics.median(x[k] for x in xs) for k in xs[0]} for mode, xs in rows.items()}
    train = med["on"]["thread"] - med["off"]["thread"]
    others = (med["on"]["process"] - med["on"]["thread"]) - (med["off"]["process"] - med["off"]["thread"])
    agent = med["on"]["agent"]
    print(f"collector CPU per communication call ({args.steps} steps x {args.calls} calls, {args.sleep_s} s "
          f"between steps, medians of {args.repeats}; load {os.getloadavg()[0]:.1f})")
    print("| where | us per call | share |")
    print("|---|---|---|")
    total = train + others + agent
    for name, s in (("training thread", train), ("its other threads (writer, heartbeat)", others),
                    ("marker agent process", agent), ("all", total)):
        print(f"| {name} | {1e6 * s / n:.2f} | {s / total:.0%} |")


if __name__ == "__main__":
    main()
