"""An FSDP2 + tensor-parallel training script on a 2-D DeviceMesh, with megascope's lines added.

Run it under ``torchrun --standalone --nproc-per-node 4 tests/jobs/fsdp_tp_job.py RUN`` (dp = 2,
tp = 2; ``--tp T`` gives dp = world / T, ``--cuda`` NCCL on the GPU of LOCAL_RANK). Faults for the tests: ``--straggler RANK,FACTOR`` (that rank is FACTOR times slower: on CPU it does
FACTOR times a step's matrix work; on GPU, where this small model leaves the device idle and extra
work would only fill the gaps, its stream sleeps FACTOR-1 times the step's measured time, as a slow
GPU would), ``--hang RANK,STEP`` (that rank sleeps before its forward in STEP).
"""

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from megascope.collectors import Collector
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--straggler", default=None)
parser.add_argument("--hang", default=None)
parser.add_argument("--timeout", type=float, default=10.0)
parser.add_argument("--tp", type=int, default=2)
parser.add_argument("--cuda", action="store_true", help="NCCL on the GPU of LOCAL_RANK")
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.cuda else torch.device("cpu")
if args.cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if args.cuda else "gloo", timeout=timedelta(seconds=args.timeout))
mesh = init_device_mesh(device.type, (dist.get_world_size() // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
col = Collector.from_env(args.run_dir, mesh=mesh, flush_interval_s=0.25, stacks_after_s=args.timeout / 2)  # megascope
rank = dist.get_rank()
torch.manual_seed(0)
dim = 128
model = nn.Sequential(*[Block(dim) for _ in range(2)]).to(device)
for block in model:
    parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(block, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
slow_rank, factor = (int(v) if i == 0 else float(v) for i, v in enumerate(args.straggler.split(","))) \
    if args.straggler else (-1, 1.0)
hang_rank, hang_step = (int(v) for v in args.hang.split(",")) if args.hang else (-1, -1)
if rank == slow_rank and args.cuda:
    from megascope.trainer.faults import sleep_cycles_per_ns
    cycles_per_ns = sleep_cycles_per_ns(device)
gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())  # TP peers see the same batch
extra = torch.randn(256, 4 * dim, device=device), torch.randn(4 * dim, 4 * dim, device=device)
warm_steps: list[float] = []  # GPU straggler: the step's time, measured on its first steps
for step in range(args.steps):
    began = time.perf_counter()
    with col.step(step):                                                                        # megascope
        x = torch.randn(256, dim, generator=gen).to(device)
        if rank == hang_rank and step == hang_step:
            time.sleep(3600)
        if rank == slow_rank and not args.cuda:  # local matrix work, no collective: this rank alone is slower
            for _ in range(round(12 * (factor - 1))):
                torch.tanh(extra[0] @ extra[1])
        if rank == slow_rank and args.cuda and len(warm_steps) == 3:  # a slow device, whatever the work
            torch.cuda._sleep(int((factor - 1) * sorted(warm_steps)[1] * 1e9 * cycles_per_ns))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if rank == slow_rank and args.cuda and len(warm_steps) < 3 and step >= 2:
        torch.cuda.synchronize()  # measuring steps only, before the fault starts
        warm_steps.append(time.perf_counter() - began)
    col.metric("loss", loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
col.close()
dist.destroy_process_group()
