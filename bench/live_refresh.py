"""The dashboard's live refresh against a job writing one part per rank per tick.

A synthetic job (``megascope.synth.LiveSynth``: the collector's layout, one spans part with its
step sums twin, one markers part and, on the ranks that log metrics, one metrics part per rank and
step) is written tick by tick; after each tick (one second of a job flushing every second) the
refresh is timed (``--steps-per-part K``: each part holds K steps, a writer flushing every K
seconds; a tick is then K seconds of the job), wall clock and CPU of this process (DuckDB's threads included):

* ``current``: what the dashboard's watcher does today: ``ServedRun.poll()`` (the partition
  directories' times, then ``Run.refresh()``: the store's views rebuilt) and the results it
  precomputes for the overview, topology and ``/metrics`` (``data.WARM``: MFU per step, hang
  localization, run state, stragglers, rank states, loss), each timed;
* ``live``: :class:`megascope.live.StepSumsTail` as the dashboard makes it: what each rank appended
  to its step log since the last look read, the sums kept;
* ``twins``: the same reader following the twins instead (``source="twins"``, how it follows a
  run without step logs): the new twins listed and read.

Writing is not timed. The target (issue 23): each tick's refresh costs under one second of this
machine's time, and the files read per refresh do not grow with the run's length.

    python bench/live_refresh.py --ranks 1024 --ticks 12 --work WORK --paths current,live
    python bench/live_refresh.py --ranks 12288 --ticks 4 --work WORK --paths live,twins
    python bench/live_refresh.py --ranks 1024 --ticks 12 --work WORK --paths current --phases --history 40 \
        --compact-every 3 --grace-s 60
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megascope.live import StepSumsTail
from megascope.synth import LiveSynth, SynthConfig


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, value


def _files(run: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(run))


def _prepare_phases(served: Any) -> dict[str, float]:
    """The analysis' base tables built (or extended) for the new data, seconds per phase as
    ``prepare`` names them (the MFU's ``per_step`` then finds them current)."""
    from megascope.analysis.base import prepare

    phases: dict[str, float] = {}
    marks = [("start", time.perf_counter())]

    def say(message: str) -> None:
        marks.append((message, time.perf_counter()))

    with served.locked() as run:
        prepare(run.con, progress=say)
    marks.append(("end", time.perf_counter()))
    for (name, t0), (_, t1) in zip(marks, marks[1:], strict=False):
        phases[name] = round(phases.get(name, 0.0) + t1 - t0, 3)
    return phases


def _compact_nodes(run: Path, ranks: int, per_node: int, grace_s: float) -> tuple[float, int]:
    """One scoped pass per node, as each node's own process runs it: parts of any age, each rank's
    newest two kept, the merged ones removed ``grace_s`` after the commit; heartbeats are left out
    (the synth job writes none). Seconds, parts merged."""
    from megascope.compact import Scope, compact

    t0, merged = time.perf_counter(), 0
    for lo in range(0, ranks, per_node):
        scope = Scope(ranks=(lo, min(lo + per_node, ranks) - 1))
        merged += compact(run, min_age_s=0, keep_newest=2, grace_s=grace_s, scope=scope).parts_merged
    return round(time.perf_counter() - t0, 2), merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=10)
    parser.add_argument("--paths", default="current,live", help="comma-separated: current, live, twins")
    parser.add_argument("--work", type=Path, required=True, help="directory for the run (replaced)")
    parser.add_argument("--json", type=Path, help="append one JSON line per tick here")
    parser.add_argument("--write-threads", type=int, default=2)
    parser.add_argument("--phases", action="store_true",
                        help="current path: time the analysis' base tables phase by phase before the results")
    parser.add_argument("--steps-per-part", type=int, default=1,
                        help="steps (seconds of the job) each rank's part holds: a writer flushing less often")
    parser.add_argument("--compact-every", type=int, default=0, metavar="TICKS",
                        help="every TICKS ticks, before the refresh, a compaction pass per node (untimed: the "
                             "nodes' own CPUs run it), as MEGASCOPE_COMPACT_EVERY_S does; 0: none")
    parser.add_argument("--node-ranks", type=int, default=8, help="ranks per node for --compact-every")
    parser.add_argument("--grace-s", type=float, default=0.0,
                        help="seconds (of this machine's clock) a pass leaves the parts it merged for readers, as "
                             "node passes do (60); 0: removed at once")
    parser.add_argument("--history", type=int, default=0, metavar="STEPS",
                        help="steps the job has run before the first tick (a dashboard opened on a job that "
                             "has been going a while): written as one part per rank and compacted, untimed")
    args = parser.parse_args()
    paths = set(args.paths.split(","))
    run = args.work / f"live-{args.ranks}"
    shutil.rmtree(run, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)

    cfg = SynthConfig(ranks=args.ranks, steps=1_000_000, tp=args.tp, pp=args.pp, seed=23)
    t0 = time.perf_counter()
    job = LiveSynth(run, cfg, threads=args.write_threads)
    print(f"# {args.ranks} ranks (tp={args.tp} pp={args.pp}), run.json/ranks/groups in {time.perf_counter() - t0:.1f} s; "
          f"load {_load()}", flush=True)
    if args.history:
        from megascope.compact import compact

        t0 = time.perf_counter()
        job.write_step(args.history)
        compact(run, everything=True, grace_s=0)
        print(f"# history: {args.history} steps written and compacted in {time.perf_counter() - t0:.1f} s", flush=True)

    served = registry = None
    tails = {name: StepSumsTail(run, source="twins" if name == "twins" else "auto")
             for name in ("live", "twins") if name in paths}
    for tick in range(args.ticks):
        t0 = time.perf_counter()
        written = job.write_step(args.steps_per_part)
        write_s = time.perf_counter() - t0
        row: dict[str, Any] = {"tick": tick, "ranks": args.ranks, "steps_per_part": args.steps_per_part,
                               "written": written, "write_s": round(write_s, 2)}
        if args.compact_every and (tick + 1) % args.compact_every == 0:
            row["compact_s"], row["compacted_parts"] = _compact_nodes(run, args.ranks, args.node_ranks, args.grace_s)
        row.update({"files": _files(run), "load_before": _load()})
        if "current" in paths:
            from megascope.dashboard import data
            from megascope.dashboard.runs import RunRegistry

            if registry is None:
                wall, cpu, registry = _timed(lambda: RunRegistry([run]))
                served = registry.get(registry.ids[0])
                row["open_s"], row["open_cpu_s"] = round(wall, 3), round(cpu, 3)
            else:
                wall, cpu, changed = _timed(served.poll)
                row["poll_s"], row["poll_cpu_s"], row["changed"] = round(wall, 3), round(cpu, 3), changed
            assert served is not None
            total_wall = row.get("open_s", row.get("poll_s", 0.0))
            total_cpu = row.get("open_cpu_s", row.get("poll_cpu_s", 0.0))
            if args.phases and served.run is not None:
                row["prepare_phases"] = _prepare_phases(served)
                total_wall += sum(row["prepare_phases"].values())
            for fetch in data.WARM:
                try:
                    wall, cpu, _ = _timed(functools.partial(fetch, served))
                except Exception as exc:  # noqa: BLE001 - the bench reports it and goes on
                    row[f"{fetch.__name__}_error"] = str(exc)[:120]
                    wall = cpu = float("nan")
                row[f"{fetch.__name__}_s"], row[f"{fetch.__name__}_cpu_s"] = round(wall, 3), round(cpu, 3)
                total_wall += wall
                total_cpu += cpu
            row["current_s"], row["current_cpu_s"] = round(total_wall, 3), round(total_cpu, 3)
            last = data.per_step(served)
            row["current_last_step"] = int(last["step"].max()) if len(last) else None
        # The two readers take turns going first (the page cache favours the second).
        for name in sorted(tails, reverse=tick % 2 == 1):
            tail = tails[name]
            wall, cpu, stats = _timed(tail.update)
            w2, c2, per_step = _timed(tail.per_step)
            w3, c3, _ = _timed(tail.rank_step)
            row.update({f"{name}_s": round(wall + w2 + w3, 3), f"{name}_cpu_s": round(cpu + c2 + c3, 3),
                        f"{name}_source": tail.source,
                        f"{name}_list_s": round(stats.list_s, 3), f"{name}_read_s": round(stats.read_s, 3),
                        f"{name}_check_s": round(stats.check_s, 3),
                        f"{name}_merge_s": round(stats.merge_s, 3), f"{name}_answers_s": round(w2 + w3, 3),
                        f"{name}_dirs": stats.dirs_listed, f"{name}_files_read": stats.files_read,
                        f"{name}_last_step": int(per_step["step"].max()) if len(per_step) else None})
        row["load_after"] = _load()
        row["utc"] = time.strftime("%H:%M:%S", time.gmtime())
        print(json.dumps(row), flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")
    job.close()
    for tail in tails.values():
        tail.close()
    if registry is not None:
        registry.stop()


if __name__ == "__main__":
    main()
