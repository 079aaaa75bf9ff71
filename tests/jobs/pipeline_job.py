"""A pipeline-parallel job laid out as torchtitan lays one out, with megascope's three lines added:
a ``(dp, pp)`` device mesh, each rank's stage (``torch.distributed.pipelining.PipelineStage``)
sharded over its data-parallel peers with ``fully_shard``, and a 1F1B schedule over the
micro-batches.

Run it under ``torchrun --standalone --nproc-per-node N tests/jobs/pipeline_job.py RUN --pp P``
(dp = N / P). Faults for the tests: ``--straggler RANK,FACTOR`` (that rank's stage does about FACTOR
times the matrix work, forward and backward: its first block runs its first layer again
4 x (FACTOR - 1) times, rounded), ``--pause RANK,MS`` (that rank sleeps MS milliseconds each
step before the schedule runs: its host, outside the model). ``--no-shard`` leaves the stages
unsharded: the replicas then share no gradients (pipelines side by side, no DP collectives).
"""

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from megascope.collectors import Collector
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("--pp", type=int, default=2)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--micro-batches", type=int, default=4)
parser.add_argument("--straggler", default=None)
parser.add_argument("--pause", default=None)
parser.add_argument("--no-shard", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world // args.pp, args.pp), mesh_dim_names=("dp", "pp"))
col = Collector.from_env(args.run_dir, mesh=mesh, flush_interval_s=0.25)                          # megascope
pp_rank = mesh["pp"].get_local_rank()
slow_rank, factor = (int(v) if i == 0 else float(v) for i, v in enumerate(args.straggler.split(","))) \
    if args.straggler else (-1, 1.0)
pause_rank, pause_ms = (int(v) if i == 0 else float(v) for i, v in enumerate(args.pause.split(","))) \
    if args.pause else (-1, 0.0)


class Block(nn.Module):
    def __init__(self, repeats: int) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(256, 1024), nn.Linear(1024, 256)
        self.repeats = repeats  # a slow rank's extra matrix work, in its own forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        for _ in range(self.repeats):
            h = h + 0.0 * torch.relu(self.first(x))
        return x + self.second(h)


torch.manual_seed(pp_rank)
repeats = round(4 * (factor - 1)) if rank == slow_rank else 0  # a layer is a quarter of the stage's work
stage_module = nn.Sequential(Block(repeats), Block(0))
if not args.no_shard:
    for block in stage_module:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage_module, mesh=mesh["dp"])
stage = PipelineStage(stage_module, pp_rank, args.pp, torch.device("cpu"), group=mesh["pp"].get_group())
schedule = Schedule1F1B(stage, n_microbatches=args.micro_batches,
                        loss_fn=lambda out, target: (out - target).square().mean())
opt = torch.optim.SGD(stage_module.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())  # pipeline peers read the same batch
for step in range(args.steps):
    x, y = (torch.randn(16 * args.micro_batches, 256, generator=gen) for _ in range(2))  # 16 rows a micro-batch
    with col.step(step):                                                                           # megascope
        if rank == pause_rank:
            time.sleep(pause_ms / 1000)
        if pp_rank == 0:
            schedule.step(x)
        elif pp_rank == args.pp - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
col.close()                                                                                        # megascope
dist.destroy_process_group()
