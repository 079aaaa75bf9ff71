"""Table of the GPU trainer benchmark: per layout, collector on/off, median step time and MFU.

Step times come from the trainer's own result (rank 0's host clock between step ends, which on a
GPU equals device time in the steady state) so that runs with the collector off, which write no
spans, are measured the same way as runs with it on. MFU = run.json's model FLOPs per step / step
time / GPUs / peak.

    python bench/gpu_trainer_table.py RUNS_DIR BASELINE_JSON
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

WARMUP = 3  # steps left out of the medians (allocator, NCCL and kernel warm-up)


def main() -> None:
    runs, baseline_path = Path(sys.argv[1]), Path(sys.argv[2])
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    meta: dict[str, dict] = {}
    for result in sorted(runs.glob("*.json")):
        m = re.match(r"(.+)-r\d+-(on|off)$", result.stem)
        if not m:
            continue
        layout, mode = m.groups()
        steps = json.loads(result.read_text())["step_seconds"][WARMUP:]
        groups[(layout, mode)].extend(steps)
        run_json = runs / result.stem / "run.json"  # the collector (on) writes it
        if run_json.exists():
            meta[layout] = json.loads(run_json.read_text())
    lines = [line for line in baseline_path.read_text().splitlines() if line.startswith("{")]
    base = json.loads(lines[-1]) if lines else None
    print(f"{'layout':<12} {'collector':<9} {'steps':>5} {'step ms':>9} {'tokens/s':>10} {'MFU':>6}")
    if base:
        print(f"{'baseline':<12} {'-':<9} {'':>5} {base['step_s_median'] * 1e3:>9.1f} {base['tokens_per_s']:>10,.0f} "
              f"{base['mfu']:>6.1%}")
    for (layout, mode), steps in sorted(groups.items()):
        if layout not in meta:
            continue
        run = meta[layout]
        gpus = run["world_size"]
        med = statistics.median(steps)
        mfu = run["model_flops_per_step"] / med / gpus / run["peak_flops_per_device"]
        print(f"{layout:<12} {mode:<9} {len(steps):>5} {med * 1e3:>9.1f} {run['tokens_per_step'] / med:>10,.0f} {mfu:>6.1%}")
    print()
    for layout in sorted(meta):
        on, off = groups.get((layout, "on")), groups.get((layout, "off"))
        if on and off:
            print(f"collector overhead {layout}: {statistics.median(on) / statistics.median(off) - 1:+.2%} "
                  f"(median step {statistics.median(on) * 1e3:.1f} vs {statistics.median(off) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
