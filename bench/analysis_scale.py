"""Benchmark: ``megascope report`` on synthetic runs at scale (targets: 1,024 x 1,000 in 10 s,
12,288 x 100 in 30 s, under 4 GB peak, on 2 cores).

Each run is written once with ``megascope synth`` (a straggler planted, so the report has work to
do) into ``--dir`` and kept for re-runs; each report runs in a fresh subprocess so that its peak
memory (ru_maxrss, DuckDB included) is its own. Times: opening the run (store), building the base
tables, the rest of the report, and the whole.

    python bench/analysis_scale.py --dir /big/disk/bench            # both sizes
    python bench/analysis_scale.py --dir D --ranks 256 --steps 50    # one custom size
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from megascope.store import open_run
from megascope.analysis import report
from megascope.analysis.base import prepare
run = open_run(sys.argv[1], memory_limit=sys.argv[2])
t1 = time.perf_counter()
prepare(run.con)
t2 = time.perf_counter()
r = report(run)
t3 = time.perf_counter()
rows = run.con.execute("SELECT (SELECT count(*) FROM spans) + (SELECT count(*) FROM markers)").fetchone()[0]
print("RESULT " + json.dumps({"open": t1 - t0, "base": t2 - t1, "rest": t3 - t2, "total": t3 - t0, "rows": rows,
                  "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "found": [(s["rank"], s["cause"]) for s in r["stragglers"]]}))
"""

STRAGGLER_RANK = 517


def ensure_run(root: Path, ranks: int, steps: int, tp: int, pp: int) -> Path:
    out = root / f"r{ranks}x{steps}"
    if not (out / "run.json").exists():
        print(f"writing {out} (once) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "megascope", "synth", "--ranks", str(ranks), "--steps", str(steps),
                        "--tp", str(tp), "--pp", str(pp), "--inject", f"straggler:rank={STRAGGLER_RANK},factor=1.1",
                        "-o", str(out)], check=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="Where the synthetic runs are kept.")
    parser.add_argument("--ranks", type=int, action="append")
    parser.add_argument("--steps", type=int, action="append")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--memory-limit", default="3GB", help="DuckDB memory_limit, as the CLI sets it.")
    args = parser.parse_args()
    configs = list(zip(args.ranks, args.steps, strict=True)) if args.ranks else [(1024, 1000), (12288, 100)]
    print(f"{'ranks':>7} {'steps':>6} {'rows':>12} {'open s':>7} {'base s':>7} {'rest s':>7} {'total s':>8} "
          f"{'rows/s':>11} {'peak MB':>8}  found")
    for ranks, steps in configs:
        run = ensure_run(args.dir, ranks, steps, args.tp, args.pp)
        proc = subprocess.run([sys.executable, "-c", CHILD, str(run), args.memory_limit],
                              capture_output=True, text=True, check=True)
        r = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
        print(f"{ranks:>7,} {steps:>6,} {r['rows']:>12,} {r['open']:>7.1f} {r['base']:>7.1f} {r['rest']:>7.1f} "
              f"{r['total']:>8.1f} {r['rows'] / r['total']:>11,.0f} {r['peak_bytes'] / 2**20:>8,.0f}  {r['found']}",
              flush=True)


if __name__ == "__main__":
    main()
