"""Benchmark: how fast ``megascope synth`` writes runs at scale.

Each configuration runs in a fresh subprocess so that its peak memory is its own.

    python bench/synth_scale.py                       # 1,024 x 100 and 12,288 x 20 (tp 8, pp 8)
    python bench/synth_scale.py --ranks 256 --steps 20
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, resource, sys
from megascope.synth import SynthConfig, synth_run
ranks, steps, tp, pp, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
stats = synth_run(out, SynthConfig(ranks=ranks, steps=steps, tp=tp, pp=pp))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"rows": stats.rows, "spans": stats.spans, "markers": stats.markers, "files": stats.files,
                  "seconds": stats.seconds, "peak_bytes": peak}))
"""


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, action="append")
    parser.add_argument("--steps", type=int, action="append")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    args = parser.parse_args()
    configs = list(zip(args.ranks, args.steps, strict=True)) if args.ranks else [(1024, 100), (12288, 20)]
    print(f"{'ranks':>7} {'steps':>6} {'tp':>3} {'pp':>3} {'rows':>12} {'files':>8} {'MB':>8} {'seconds':>8} {'rows/s':>11} {'peak MB':>8}")
    for ranks, steps in configs:
        tmp = Path(tempfile.mkdtemp(prefix="synth-bench-"))
        try:
            out = tmp / "run"
            proc = subprocess.run([sys.executable, "-c", CHILD, str(ranks), str(steps), str(args.tp), str(args.pp), str(out)],
                                  capture_output=True, text=True, check=True)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            size = du(out)
            print(f"{ranks:>7} {steps:>6} {args.tp:>3} {args.pp:>3} {r['rows']:>12,} {r['files']:>8,} {size / 1e6:>8.0f} "
                  f"{r['seconds']:>8.1f} {r['rows'] / r['seconds']:>11,.0f} {r['peak_bytes'] / 1e6:>8.0f}", flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
