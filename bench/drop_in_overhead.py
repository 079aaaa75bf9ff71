"""What seeing every collective without code costs a DDP job: step time with and without.

Runs tests/jobs/ddp_job.py under torchrun, alternating MEGASCOPE_INTERCEPT=1 and =0 (the
collector is on in both; only the interception and DDP's recording hook differ), and prints the
median step time of each run and the median over runs of each arm, with the load average.

    python bench/drop_in_overhead.py --nproc 2 --steps 40 --repeats 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(nproc: int, steps: int, intercept: bool, out: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MEGASCOPE_INTERCEPT": str(int(intercept))}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                    str(ROOT / "tests" / "jobs" / "ddp_job.py"), str(out), "--steps", str(steps)],
                   check=True, env=env, capture_output=True, timeout=600)
    from megascope.store import open_run

    row = open_run(out).con.execute(
        "SELECT median(dur_ns) FROM spans WHERE kind = 'step' AND step >= 3").fetchone()  # warm-up left out
    assert row is not None
    return float(row[0]) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    arms: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for intercept in ((True, False) if i % 2 == 0 else (False, True)):
                ms = one_run(args.nproc, args.steps, intercept, Path(tmp) / f"r{i}-{int(intercept)}")
                arms[intercept].append(ms)
                print(f"repeat {i} intercept={int(intercept)} step {ms:.2f} ms  load {os.getloadavg()[0]:.1f}",
                      flush=True)
    on, off = statistics.median(arms[True]), statistics.median(arms[False])
    print(f"median step: intercepted {on:.2f} ms, not {off:.2f} ms, {100 * (on / off - 1):+.1f}%")


if __name__ == "__main__":
    main()
