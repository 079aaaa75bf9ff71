"""Stragglers named by megascope and by Holistic Trace Analysis on the same GPU-shaped traces.

HTA's straggler analysis (``TraceAnalysis.get_potential_stragglers``) reads NCCL kernels named
``ncclKernel*`` on GPU streams; CPU (gloo) profiler traces have none, so it has nothing to read on
the bundled trainer's CPU runs. This benchmark therefore writes GPU-shaped Kineto traces with a
generator (``--gen``, the same shape torch.profiler writes on GPUs; planted computational
straggler), both NCCL kernel namings, and asks each tool for its first straggler. HTA runs in its
own virtualenv (``--hta-python``), one trace set at a time.

    python bench/straggler_vs_hta.py --gen GEN_KINETO.py --hta-python HTA_VENV/bin/python --work /tmp/svh
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

HTA_SNIPPET = """
import json, logging, sys, warnings
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
try:
    ranks = TraceAnalysis(trace_dir=sys.argv[1]).get_potential_stragglers(num_candidates=1)
    print(json.dumps({"ranks": [int(r) for r in ranks]}))
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__ + ": " + str(exc).splitlines()[0][:80]}))
"""


def cases(seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    for names in ("legacy", "dev"):
        for slowdown in (1.05, 1.1, 1.2, None):
            rank = rng.randrange(8) if slowdown else None
            out.append({"names": names, "slowdown": slowdown, "rank": rank})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gen", type=Path, required=True, help="the Kineto trace generator script")
    parser.add_argument("--hta-python", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=22)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    print("| NCCL kernel names | planted | megascope first (cause, confidence) | HTA first |")
    print("|---|---|---|---|")
    for i, c in enumerate(cases(args.seed)):
        traces = args.work / f"t{i}"
        cmd = [sys.executable, str(args.gen), "--out", str(traces), "--ranks", "8", "--steps", str(args.steps),
               "--tp", "2", "--pp", "2", "--nccl-names", str(c["names"]), "--seed", str(i)]
        # The generator takes the extra fraction (0.2 = 20% slower) and plants a default rank
        # unless told -1.
        if c["slowdown"]:
            cmd += ["--straggler-rank", str(c["rank"]), "--straggler-slowdown", f"{float(c['slowdown']) - 1:.3f}"]
        else:
            cmd += ["--straggler-rank", "-1"]
        subprocess.run(cmd, check=True, capture_output=True)
        run = args.work / f"r{i}"
        subprocess.run([sys.executable, "-m", "megascope", "ingest", "kineto", str(traces), "-o", str(run)],
                       check=True, capture_output=True)
        rep = json.loads(subprocess.run([sys.executable, "-m", "megascope", "report", str(run), "--json", "--no-whatif"],
                                        check=True, capture_output=True, text=True).stdout)
        first = rep["stragglers"][0] if rep["stragglers"] else None
        ours = f"{first['rank']} ({first['cause']}, {first['confidence']:.3f})" if first else "none"
        hta = json.loads(subprocess.run([str(args.hta_python), "-c", HTA_SNIPPET, str(traces)], check=True,
                                        capture_output=True, text=True).stdout.strip().splitlines()[-1])
        theirs = hta.get("error") or (str(hta["ranks"][0]) if hta["ranks"] else "none")
        planted = f"rank {c['rank']} x{c['slowdown']}" if c["slowdown"] else "healthy"
        print(f"| {c['names']} | {planted} | {ours} | {theirs} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
