"""Bundled trainer on CPU: step time per mesh, with the collector on and off.

The model and batch match the gloo probe's tiny GPT (4 layers, hidden 128, 4 heads, vocabulary
512, sequence 128, 32 sequences per step in 4 micro-batches per data-parallel rank), so the
figures compare with the hand-written 2x2x2 probe (~0.5 s per step on the same kind of machine).
Each row is a fresh launch; the step time is the median of rank 0's host time per step, leaving
out the first step (warm-up). "collector off" sets ``MEGASCOPE_DISABLE=1``.

    python bench/trainer_cpu.py [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from megascope.trainer import ModelConfig, TrainConfig, train

MODEL = ModelConfig(layers=4, hidden=128, heads=4, vocab=512, seq_len=128)
MESHES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)]


def run(tp: int, pp: int, dp: int, *, steps: int, collector: bool, root: Path) -> tuple[float, float, int]:
    if collector:
        os.environ.pop("MEGASCOPE_DISABLE", None)
    else:
        os.environ["MEGASCOPE_DISABLE"] = "1"
    out = root / f"t{tp}p{pp}d{dp}-{'on' if collector else 'off'}"
    cfg = TrainConfig(out=out, world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp, steps=steps, global_batch=32,
                      micro_batches=4, model=MODEL, peak_flops=1e9)
    t0 = time.perf_counter()
    result = train(cfg, nproc=tp * pp * dp)
    wall = time.perf_counter() - t0
    files = sum(1 for p in out.rglob("*.parquet"))
    return statistics.median(result.step_seconds[1:]), wall, files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    print("| tp | pp | dp | ranks | step, collector off | step, collector on | overhead | launch to exit (on) | parquet files |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for tp, pp, dp in MESHES:
            off, _, _ = run(tp, pp, dp, steps=args.steps, collector=False, root=Path(tmp))
            on, wall, files = run(tp, pp, dp, steps=args.steps, collector=True, root=Path(tmp))
            print(f"| {tp} | {pp} | {dp} | {tp * pp * dp} | {off * 1e3:.0f} ms | {on * 1e3:.0f} ms | "
                  f"{(on / off - 1) * 100:+.0f}% | {wall:.1f} s | {files} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
