"""Which logical CPUs of this machine share a physical core, found by timing rather than by what the
machine reports (a virtual machine's lscpu often says one thread per core, whatever lies beneath).

A busy loop pinned to CPU 0 runs alone, then beside the same loop pinned to each other CPU in turn.
Where the pair shares a core (hyperthread siblings, or two virtual CPUs on one physical thread), CPU
0's loop slows down. A host-bound rank whose launching thread lands on such a pair with another busy
thread runs its host that much slower. Prints one line per CPU whose neighbour slowed CPU 0 by more
than ``--threshold``, and a summary line. Before that, each CPU's loop rate alone: a virtual CPU
whose physical core is busy with another tenant's work runs slower than its peers.

    python bench/smt_probe.py [--seconds 0.3] [--threshold 0.15]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any


def _spin(cpu: int, seconds: float, start: Any, out: Any) -> None:
    os.sched_setaffinity(0, {cpu})
    start.wait()
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            n += 1
    out.put((cpu, n / seconds))


def _rates(cpus: list[int], seconds: float) -> dict[int, float]:
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_spin, args=(c, seconds, start, out)) for c in cpus]
    for p in procs:
        p.start()
    time.sleep(0.05)
    start.set()
    rates = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--threshold", type=float, default=0.15, help="slowdown of CPU 0 that counts as shared")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    base, others = cpus[0], cpus[1:]
    alone = {c: _rates([c], args.seconds)[c] for c in cpus}
    ordered = sorted(alone.values())
    median = ordered[len(ordered) // 2]
    slow_cpus = [c for c, r in alone.items() if r < (1 - args.threshold) * median]
    print(f"each cpu alone: min {ordered[0] / 1e6:.1f}M, median {median / 1e6:.1f}M, max {ordered[-1] / 1e6:.1f}M "
          f"loops/s; {len(slow_cpus)} more than {args.threshold:.0%} below the median: {slow_cpus}")
    solo = sorted(_rates([base], args.seconds)[base] for _ in range(3))[1]
    shared = []
    for c in others:
        slow = 1 - _rates([base, c], args.seconds)[base] / solo
        if slow > args.threshold:
            shared.append((c, slow))
            print(f"cpu {base} with cpu {c}: {slow:.0%} slower")
    print(f"{len(cpus)} cpus; cpu {base} alone {solo / 1e6:.1f}M loops/s; "
          f"{len(shared)} of {len(others)} other cpus slow it by more than {args.threshold:.0%}")


if __name__ == "__main__":
    main()
