"""How long after a flush its steps show on a served live run, and what serving it costs.

A synthetic job (``megascope.synth.LiveSynth``, the collector's layout) is written by another
process, one flush every ``--interval`` seconds (or as fast as this machine writes, if slower).
This process serves the run as ``megascope serve`` does (``RunRegistry`` with the watcher, its
precomputed results and the step sums follower, threads started) and looks every 0.1 s at what a
page would show: the overview's steps (``data.live_per_step``: the analyses', then the follower's)
and the analyses' own (``per_step`` as last precomputed). For each flush: seconds from the end of
its write (every rank's part written) to its step showing on the overview with every rank's
step time, and in the analyses. And the dashboard's CPU
(this process) per second of wall clock.

    python bench/live_serve.py --ranks 1024 --flushes 10 --interval 5 --work /tmp/live
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from megascope.synth import LiveSynth, SynthConfig


def _write(run: str, ranks: int, tp: int, pp: int, flushes: int, interval: float, queue: Any) -> None:
    job = LiveSynth(run, SynthConfig(ranks=ranks, steps=1_000_000, tp=tp, pp=pp, seed=23), threads=1)
    queue.put(("ready", -1, time.time()))
    for _ in range(flushes):
        started = time.time()
        job.write_step()
        queue.put(("flush", job.step - 1, time.time()))
        time.sleep(max(0.0, interval - (time.time() - started)))
    job.close()
    queue.put(("done", -1, time.time()))


def _last(frame: Any, ranks: int) -> int:
    """The last step every rank finished, in a per-step frame (its ``ranks`` column)."""
    if frame is None or not len(frame):
        return -1
    whole = frame[frame["ranks"] >= ranks]
    return int(whole["step"].max()) if len(whole) else -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--flushes", type=int, default=10)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between flushes of the job")
    parser.add_argument("--poll", type=float, default=2.0, help="the dashboard's poll interval")
    parser.add_argument("--settle", type=float, default=120.0, help="seconds to wait after the last flush")
    parser.add_argument("--work", type=Path, required=True, help="directory for the run (replaced)")
    args = parser.parse_args()
    run = args.work / f"serve-{args.ranks}"
    shutil.rmtree(run, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)

    from megascope.dashboard import data
    from megascope.dashboard.runs import RunRegistry

    queue: Any = multiprocessing.get_context("spawn").Queue()
    writer = multiprocessing.get_context("spawn").Process(
        target=_write, args=(str(run), args.ranks, args.tp, args.pp, args.flushes, args.interval, queue))
    writer.start()
    assert queue.get()[0] == "ready"
    registry = RunRegistry([run], wait=True, poll_interval_s=args.poll)
    for fetch in data.WARM:
        registry.add_warmer(fetch)
    served = registry.get(registry.ids[0])
    assert served is not None
    registry.start()
    wall0, cpu0 = time.time(), time.process_time()
    flushed: dict[int, float] = {}
    on_overview: dict[int, float] = {}
    in_analyses: dict[int, float] = {}
    done_at = None
    while True:
        while not queue.empty():
            kind, step, when = queue.get()
            if kind == "flush":
                flushed[step] = when
            elif kind == "done":
                done_at = when
        now = time.time()
        full = served.cached(("per_step",)) if served.run is not None else None
        followed = served.live_steps()
        analysed = _last(full, args.ranks)
        shown = max(analysed, _last(followed, args.ranks))
        for step in flushed:
            if step <= shown and step not in on_overview:
                on_overview[step] = now
            if step <= analysed and step not in in_analyses:
                in_analyses[step] = now
        if done_at is not None and (len(in_analyses) == len(flushed) or now - done_at > args.settle):
            break
        time.sleep(0.1)
    wall, cpu = time.time() - wall0, time.process_time() - cpu0
    registry.stop()
    writer.join()
    overview = [on_overview[s] - flushed[s] for s in sorted(flushed) if s in on_overview]
    analyses = [in_analyses[s] - flushed[s] for s in sorted(flushed) if s in in_analyses]
    print(json.dumps({
        "ranks": args.ranks, "flushes": len(flushed), "interval_s": args.interval,
        "overview_delay_s": [round(d, 1) for d in overview],
        "analyses_delay_s": [round(d, 1) for d in analyses],
        "overview_delay_median_s": round(statistics.median(overview), 1) if overview else None,
        "analyses_delay_median_s": round(statistics.median(analyses), 1) if analyses else None,
        "not_on_overview": len(flushed) - len(overview), "not_in_analyses": len(flushed) - len(analyses),
        "dashboard_cpu_s_per_s": round(cpu / wall, 2), "wall_s": round(wall, 1),
    }))


if __name__ == "__main__":
    main()
