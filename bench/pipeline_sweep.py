"""Real pipeline-parallel jobs laid out as torchtitan lays one out, one fault planted per job,
recorded by megascope's collector, then `megascope report`: is the planted rank named first, with
the right cause, and is no other rank named?

Each job is ``tests/jobs/pipeline_job.py`` under torchrun on gloo: a ``(dp, pp)`` device mesh, each
stage (``torch.distributed.pipelining.PipelineStage``) sharded with ``fully_shard`` over its DP
peers, a 1F1B schedule over 4 micro-batches. A job gets one of ``slow F`` (the planted rank's
stage does about F times the matrix work: its first block runs its first layer again
4 x (F - 1) times, rounded), ``pause MS`` (the planted rank sleeps MS milliseconds a step before
its schedule runs, outside the model) or ``healthy``. Jobs run one at a time; the table is
bench/ddp_sweep.py's.

    python bench/pipeline_sweep.py -o DIR [--seed 3 --meshes 2x2,2x3,3x2 --factors 1.3,1.6,2.0
                                           --pause-ms 30,60 --healthy 6 --each 3 --steps 14 --keep]

``--meshes`` names ``PPxDP`` (a stage needs a DP peer for its rank to be told from its peers).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_sweep import _numbers, print_table, report_and_log  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def mesh(text: str) -> tuple[int, int]:
    pp, dp = (int(v) for v in text.lower().split("x"))
    if pp < 2 or dp < 2:
        raise argparse.ArgumentTypeError(f"{text}: a mesh needs pp >= 2 and dp >= 2")
    return pp, dp


def plan(seed: int, meshes: list[tuple[int, int]], factors: list[float], pauses: list[float], healthy: int,
         each: int) -> list[dict]:
    rng = random.Random(seed)
    cases = [{"fault": "slow", "amount": f} for f in factors for _ in range(each)]
    cases += [{"fault": "pause", "amount": ms} for ms in pauses for _ in range(each)]
    cases += [{"fault": "healthy", "amount": 0} for _ in range(healthy)]
    for case in cases:
        case["pp"], case["dp"] = rng.choice(meshes)
        case["world"] = case["pp"] * case["dp"]
        case["planted"] = rng.randrange(case["world"]) if case["fault"] != "healthy" else -1
    rng.shuffle(cases)
    return cases


def run_job(case: dict, run_dir: Path, steps: int, timeout_s: float) -> float:
    fault = []
    if case["fault"] == "slow":
        fault = ["--straggler", f"{case['planted']},{case['amount']}"]
    elif case["fault"] == "pause":
        fault = ["--pause", f"{case['planted']},{case['amount']}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGASCOPE_RUN_DIR"):
        env.pop(name, None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(case["world"]), str(ROOT / "tests" / "jobs" / "pipeline_job.py"), str(run_dir),
                           "--pp", str(case["pp"]), "--steps", str(steps), *fault],
                          capture_output=True, text=True, env=env, timeout=timeout_s)
    if proc.returncode:
        raise RuntimeError(f"job failed: {proc.stderr.strip()[-400:]}")
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--out", type=Path, required=True, help="work directory (the runs)")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--meshes", type=lambda t: [mesh(m) for m in t.split(",")], default=[(2, 2), (2, 3), (3, 2)])
    parser.add_argument("--factors", type=lambda t: _numbers(t, float), default=[1.3, 1.6, 2.0])
    parser.add_argument("--pause-ms", type=lambda t: _numbers(t, float), default=[30, 60])
    parser.add_argument("--healthy", type=int, default=6)
    parser.add_argument("--each", type=int, default=3, help="jobs per fault and amount")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--keep", action="store_true", help="keep each job's run")
    args = parser.parse_args()
    if args.healthy < 0 or args.each < 1 or args.steps < 6:
        parser.error("--healthy must be >= 0, --each >= 1 and --steps >= 6")
    if any(f <= 1 or f > 3 for f in args.factors):
        parser.error("--factors: each must be above 1 and at most 3")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    log = (args.out / "results.jsonl").open("a")
    for i, case in enumerate(plan(args.seed, args.meshes, args.factors, args.pause_ms, args.healthy, args.each)):
        run_dir = args.out / f"job{i:03d}"
        shutil.rmtree(run_dir, ignore_errors=True)
        load = os.getloadavg()[0]
        wall = run_job(case, run_dir, args.steps, args.timeout_s)
        results.append(report_and_log(i, case, run_dir, f"pp{case['pp']} x dp{case['dp']}", load, wall, log))
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    print()
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
