"""Detection sweep: plant one fault (or none) in synthetic runs of many sizes and layouts, and count
how often the analysis names it (rank and cause) and how often it names anything else.

    python bench/analysis_sweep.py                 # the default grid (~100 runs, a few minutes)
    python bench/analysis_sweep.py --seeds 1       # quicker

Per fault kind it prints runs, detected (top finding is the planted rank with the right cause /
hang root), and false positives (runs with any other straggler or hang suspect named).
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

from megascope import analysis
from megascope.inject import parse_injects
from megascope.store import open_run
from megascope.synth import SynthConfig, synth_run

# (ranks, tp, pp): pure DP, TP only, PP only, 3D, and 3D with TP across hosts.
LAYOUTS = [(8, 1, 1), (16, 2, 1), (16, 1, 4), (32, 2, 2), (64, 4, 4), (64, 8, 2), (128, 8, 4), (96, 4, 2),
           (256, 8, 8)]
STEPS = 10


def faults_for(kind: str, ranks: int, rng: random.Random) -> list[str]:
    rank = rng.randrange(ranks)
    if kind == "straggler":
        return [f"straggler:rank={rank},factor={rng.choice([1.1, 1.2, 1.5])}"]
    if kind == "skew":
        return [f"skew:rank={rank},ms={rng.choice([15, 30, 60])}"]
    if kind == "hang":
        return [f"hang:rank={rank},step={rng.randrange(1, STEPS)}"]
    return []


def judge(kind: str, specs: list[str], run_dir: Path) -> tuple[bool, bool]:
    """(detected, false_positive) for one run."""
    run = open_run(run_dir)
    planted = parse_injects(specs).faults[0].rank if specs else None
    if kind == "hang":
        found = analysis.localize(run)
        named = [s["rank"] for s in found["suspects"]]
        return bool(found["hung"] and named[:1] == [planted]), any(r != planted for r in named)
    slow = analysis.stragglers(run)
    ranks = list(slow["rank"])
    hang = analysis.localize(run)
    extra = any(r != planted for r in ranks) or hang["hung"]
    if kind == "healthy":
        return True, extra
    cause = {"straggler": "compute", "skew": "host"}[kind]
    return bool(ranks[:1] == [planted] and slow.iloc[0]["cause"] == cause), extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(2026)
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    misses: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="analysis-sweep-"))
    try:
        for ranks, tp, pp in LAYOUTS:
            for seed in range(args.seeds):
                for kind in ("healthy", "straggler", "skew", "hang"):
                    specs = faults_for(kind, ranks, rng)
                    out = root / f"{ranks}-{tp}-{pp}-{seed}-{kind}"
                    synth_run(out, SynthConfig(ranks=ranks, steps=STEPS, tp=tp, pp=pp, seed=seed,
                                               faults=parse_injects(specs)))
                    detected, false_positive = judge(kind, specs, out)
                    t = totals[kind]
                    t[0] += 1
                    t[1] += detected
                    t[2] += false_positive
                    if not detected or false_positive:
                        misses.append(f"ranks={ranks} tp={tp} pp={pp} seed={seed} {kind} {specs}: "
                                      f"detected={detected} false_positive={false_positive}")
                    shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("| planted | runs | named (rank + cause) | runs with a false positive |")
    print("|---|---|---|---|")
    for kind in ("healthy", "straggler", "skew", "hang"):
        runs, detected, fp = totals[kind]
        named = "-" if kind == "healthy" else f"{detected}/{runs} ({100 * detected / runs:.0f}%)"
        print(f"| {kind} | {runs} | {named} | {fp}/{runs} ({100 * fp / runs:.0f}%) |")
    for line in misses:
        print("miss:", line)


if __name__ == "__main__":
    main()
