"""Benchmark: Perfetto and Chrome JSON export speed (spans/s) and peak memory against run size.

Writes synthetic runs with ``megascope.synth`` (or reuses them under ``--workdir``), then exports
each one in a fresh process so that peak memory (max RSS) belongs to that export alone. The target
for the Perfetto export is >= 1M spans/s on a 2-core machine, with memory flat in run size.

    python bench/export_speed.py                       # 256 and 1,024 ranks, 10 steps, tp=8 pp=8
    python bench/export_speed.py --ranks 1024 --steps 20 --formats perfetto
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, resource, sys, time
from megascope.export import export_chrome, export_perfetto
from megascope.store import open_run
fmt, run_dir, out = sys.argv[1:4]
run = open_run(run_dir)
began, cpu = time.perf_counter(), time.process_time()
stats = (export_perfetto if fmt == "perfetto" else export_chrome)(run, out)
seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
print(json.dumps({"spans": stats.spans, "bytes": stats.bytes, "seconds": seconds, "cpu": cpu,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _synth(path: Path, ranks: int, steps: int, tp: int, pp: int) -> None:
    if (path / "run.json").exists():
        return
    from megascope.synth import SynthConfig, synth_run

    synth_run(path, SynthConfig(ranks=ranks, steps=steps, tp=tp, pp=pp, seed=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--formats", nargs="+", default=["perfetto", "chrome"], choices=["perfetto", "chrome"])
    parser.add_argument("--workdir", type=Path, default=None, help="Keep runs and traces here (reused).")
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="megascope-export-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for ranks in args.ranks:
        run_dir = workdir / f"synth-{ranks}r-{args.steps}s"
        _synth(run_dir, ranks, args.steps, args.tp, args.pp)
        for fmt in args.formats:
            out = workdir / f"{run_dir.name}.{'pftrace' if fmt == 'perfetto' else 'json'}"
            proc = subprocess.run([sys.executable, "-c", _CHILD, fmt, str(run_dir), str(out)],
                                  capture_output=True, text=True, check=True)
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append((ranks, args.steps, fmt, result))
            out.unlink()

    # CPU seconds (all threads) next to wall seconds: on a shared machine wall time mostly measures the others
    print("| ranks | steps | format | spans | output | wall s | CPU s | spans/s (wall) | spans per CPU-s | peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ranks, steps, fmt, r in rows:
        print(f"| {ranks:,} | {steps} | {fmt} | {r['spans']:,} | {r['bytes'] / 1e6:,.0f} MB | {r['seconds']:.1f} | "
              f"{r['cpu']:.1f} | {r['spans'] / r['seconds']:,.0f} | {r['spans'] / r['cpu']:,.0f} | {r['rss_mb']:,.0f} MB |")


if __name__ == "__main__":
    main()
