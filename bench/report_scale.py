"""Benchmark: ``megascope report`` at scale, cold and again (targets, issue 23: 1,024 x 1,000 under
10 s; 12,288 x 100 under 30 s and a second report under 5 s; peak memory under 4 GB; 2 cores).

Each run is written once with ``megascope synth`` (tp=8, pp=8, a straggler planted at rank 517, or 517 mod ranks,
``--factor`` times slower: 1.3 by default, which the report names, so its what-if replay is measured too) into
``--dir`` and kept for re-runs. Per size, in fresh processes (so each peak RSS is its own):

* cold: the analysis cache (``RUN/_cache``) removed first, so the base tables are built from the parts;
* again: a second report, which reads the base tables the first one kept.

Columns: the whole report (open + base tables + the rest, what ``megascope report --json`` does
minus printing), its parts, and the peak resident memory. The base tables are counted until the
first section starts; writing them to the run's cache goes on beside the sections, in the rest.
``--phases`` prints where a cold report's time goes, phase by phase (the report's own progress
messages).

    python bench/report_scale.py --dir /big/disk/bench                     # both sizes
    python bench/report_scale.py --dir D --ranks 1024 --steps 100 --phases  # one size
    python bench/report_scale.py --dir D --compact                          # then compacted (megascope compact --all)

With ``--compact`` each size is measured on its parts, then compacted in place (timed) and measured
again; the run then stays compacted (delete it to measure parts again).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from megascope.store import open_run
from megascope.analysis import report
marks = []
def say(msg):
    marks.append((msg, time.perf_counter()))
run = open_run(sys.argv[1], memory_limit=sys.argv[2])
t1 = time.perf_counter()
r = report(run, progress=say)
t3 = time.perf_counter()
# The base tables are ready when the first section starts (their cache goes on being written beside the sections).
t2 = next((t for m, t in marks if m == "localizing hangs"), t1)
phases = [(m, round(b - a, 2)) for (m, a), (_, b) in zip(marks, marks[1:] + [("end", t3)])]
print("RESULT " + json.dumps({"open": t1 - t0, "base": t2 - t1, "rest": t3 - t2, "total": t3 - t0,
                  "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "phases": phases,
                  "found": [(s["rank"], s["cause"]) for s in r["stragglers"]]}))
"""

STRAGGLER_RANK = 517


def ensure_run(root: Path, ranks: int, steps: int, tp: int, pp: int, factor: float) -> Path:
    out = root / f"r{ranks}x{steps}-f{factor:g}"
    if not (out / "run.json").exists():
        print(f"writing {out} (once) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "megascope", "synth", "--ranks", str(ranks), "--steps", str(steps),
                        "--tp", str(tp), "--pp", str(pp), "--inject", f"straggler:rank={STRAGGLER_RANK % ranks},factor={factor:g}",
                        "-o", str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


def one(run: Path, memory_limit: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(run), memory_limit],
                          capture_output=True, text=True, check=True)
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="Where the synthetic runs are kept.")
    parser.add_argument("--ranks", type=int, action="append")
    parser.add_argument("--steps", type=int, action="append")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--factor", type=float, default=1.3, help="The planted straggler's slowdown.")
    parser.add_argument("--memory-limit", default="3GB", help="DuckDB memory_limit, as the CLI sets it.")
    parser.add_argument("--phases", action="store_true", help="Print a cold report's time per phase.")
    parser.add_argument("--compact", action="store_true", help="Also measure after megascope compact --all.")
    args = parser.parse_args()
    configs = list(zip(args.ranks, args.steps, strict=True)) if args.ranks else [(1024, 1000), (12288, 100)]
    print(f"{'ranks':>7} {'steps':>6} {'layout':>9} {'files':>8} | {'cold s':>7} {'open':>6} {'base':>6} {'rest':>6} "
          f"{'peak MB':>8} | {'again s':>7} {'open':>6} {'base':>6} {'rest':>6} {'peak MB':>8} | {'load 1m':>7}  found")
    for ranks, steps in configs:
        run = ensure_run(args.dir, ranks, steps, args.tp, args.pp, args.factor)
        # Without --compact the run is measured as it is (compacted by an earlier --compact, or not).
        as_is = "compacted" if any((run / "compacted").rglob("*.parquet")) else "parts"
        layouts = ["parts", "compacted"] if args.compact else [as_is]
        for layout in layouts:
            if layout == "compacted":
                from megascope.compact import compact

                t = time.perf_counter()
                compact(run, everything=True, min_age_s=0.0, keep_newest=0, grace_s=0.0)
                print(f"    compacted in {time.perf_counter() - t:.1f} s", flush=True)
            measure(run, ranks, steps, layout, args)


def measure(run: Path, ranks: int, steps: int, layout: str, args: argparse.Namespace) -> None:
    files = sum(1 for f in run.rglob("*.parquet") if "_cache" not in f.parts)
    shutil.rmtree(run / "_cache", ignore_errors=True)
    load = os.getloadavg()[0]
    cold = one(run, args.memory_limit)
    again = one(run, args.memory_limit)
    load = max(load, os.getloadavg()[0])
    print(f"{ranks:>7,} {steps:>6,} {layout:>9} {files:>8,} | {cold['total']:>7.1f} {cold['open']:>6.1f} "
          f"{cold['base']:>6.1f} {cold['rest']:>6.1f} {cold['peak_bytes'] / 2**20:>8,.0f} | {again['total']:>7.1f} "
          f"{again['open']:>6.1f} {again['base']:>6.1f} {again['rest']:>6.1f} {again['peak_bytes'] / 2**20:>8,.0f} | "
          f"{load:>7.1f}  {cold['found']}", flush=True)
    if args.phases:
        for label, result in (("cold", cold), ("again", again)):
            for name, seconds in result["phases"]:  # type: ignore[attr-defined]
                print(f"    {label:<5} {seconds:>7.2f} s  {name}")

if __name__ == "__main__":
    main()
