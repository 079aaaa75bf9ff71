"""What the forward and backward spans the collector gives DDP's model cost, in one process.

A DDP job of one rank (NCCL on a GPU, or gloo on the CPU) runs blocks of steps under the collector,
alternating the model's spans on and off (off: the collector is told the job times its own compute,
so the spans stand aside), and prints the wall time and the process's CPU time (every thread: the
training thread, autograd's, the collector's writer) per step of each kind of block: the model's
spans are the only difference. The job's step is host-bound on purpose (a small MLP), which is where any
host cost shows in full; a whole-run comparison is bench/gpu_drop_in.sh's.

    python bench/gpu_model_spans.py [--device cuda|cpu --blocks 10 --steps 200 --hidden 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--blocks", type=int, default=10, help="blocks of steps, spans on and off in turn")
    parser.add_argument("--steps", type=int, default=200, help="steps per block")
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    if args.blocks < 2 or args.steps < 10 or args.hidden < 8:
        parser.error("--blocks >= 2, --steps >= 10 and --hidden >= 8")
    import torch
    import torch.distributed as dist
    from megascope.collectors import Collector
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_model_spans: no GPU here; use --device cpu", file=sys.stderr)
        return 2
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    work = Path(tempfile.mkdtemp(prefix="ddp-spans-"))
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    col = Collector.from_env(work / "run", flush_interval_s=1.0, marker_agent=False)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"file://{work / 'init'}",
                            rank=0, world_size=1, timeout=timedelta(seconds=60))
    h = args.hidden
    model = DDP(nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)).to(device),
                device_ids=[0] if args.device == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, h, device=device)

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    step = 0
    per_step: dict[bool, list[float]] = {True: [], False: []}
    cpu_step: dict[bool, list[float]] = {True: [], False: []}
    for block in range(args.blocks + 1):
        spans_on = block % 2 == 1  # block 0 warms up (spans off) and is not counted
        col._times_compute = not spans_on
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            with col.step(step):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            step += 1
        sync()
        if block:
            per_step[spans_on].append((time.perf_counter() - t0) / args.steps * 1e6)
            cpu_step[spans_on].append((time.process_time() - c0) / args.steps * 1e6)
    stats = col.stats
    col.close()
    dist.destroy_process_group()
    print("| device | blocks x steps | measure | spans off, us/step | spans on, us/step | difference | internal errors |")
    print("|---|---|---|---|---|---|---|")
    for label, data in (("wall", per_step), ("process CPU", cpu_step)):
        on, off = statistics.mean(data[True]), statistics.mean(data[False])
        print(f"| {args.device} | {args.blocks} x {args.steps} | {label} | {off:.1f} ({min(data[False]):.1f}-{max(data[False]):.1f}) "
              f"| {on:.1f} ({min(data[True]):.1f}-{max(data[True]):.1f}) | {on - off:+.1f} us ({on / off - 1:+.1%}) "
              f"| {stats['internal_errors']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
