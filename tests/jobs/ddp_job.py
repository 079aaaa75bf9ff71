"""A plain DDP training script of the kind people write, with megascope's three lines added.

Run it under ``torchrun --standalone --nproc-per-node N tests/jobs/ddp_job.py RUN``. Faults for
the tests: ``--straggler RANK,FACTOR`` (that rank's forward does FACTOR times the work),
``--hang RANK,STEP`` (that rank sleeps before its forward in STEP: its peers wait in DDP's
all-reduce until the collective timeout), ``--fail RANK,STEP,HOW`` (that rank fails before its
forward in STEP: ``raise`` a ValueError, ``exit`` without a word, or ``kill`` itself with SIGKILL).
``--wrap fsdp1`` wraps the same model in
FullyShardedDataParallel instead, layer by layer (an auto-wrap policy), then as a whole.
"""

import argparse
import copy
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from megascope.collectors import Collector
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--straggler", default=None)
parser.add_argument("--hang", default=None)
parser.add_argument("--timeout", type=float, default=10.0)
parser.add_argument("--fail", default=None, help="RANK,STEP,raise|exit|kill")
parser.add_argument("--cuda", action="store_true", help="NCCL on the GPU of LOCAL_RANK")
parser.add_argument("--wrap", choices=["ddp", "fsdp1"], default="ddp")
args = parser.parse_args()

col = Collector.from_env(args.run_dir, flush_interval_s=0.25, stacks_after_s=args.timeout / 2)   # megascope
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.cuda else torch.device("cpu")
if args.cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if args.cuda else "gloo", timeout=timedelta(seconds=args.timeout))
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
layers = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 16)).to(device)
if args.wrap == "fsdp1":
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    twin = copy.deepcopy(layers)  # a slow rank's extra work, local: FSDP's own modules would all-gather
    model = FSDP(layers, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=device)
else:
    model = DDP(layers, bucket_cap_mb=0.5)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
slow_rank, factor = (int(v) if i == 0 else float(v) for i, v in enumerate(args.straggler.split(","))) \
    if args.straggler else (-1, 1.0)
hang_rank, hang_step = (int(v) for v in args.hang.split(",")) if args.hang else (-1, -1)
fail_rank, fail_step, fail_how = args.fail.split(",") if args.fail else ("-1", "-1", "")
if args.wrap == "fsdp1" and rank == slow_rank:  # the same extra forwards, inside the model's forward
    def _slower(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        with torch.no_grad():
            for _ in range(round(3 * (factor - 1))):
                twin(inputs[0].new_ones(256, 256))

    layers[1].register_forward_hook(_slower)
gen = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    with col.step(step):                                                                        # megascope
        x, y = (torch.randn(256, 256, generator=gen).to(device), torch.randn(256, 16, generator=gen).to(device))
        if rank == hang_rank and step == hang_step:
            time.sleep(3600)
        if rank == int(fail_rank) and step == int(fail_step):
            if fail_how == "raise":
                raise ValueError(f"bad batch on rank {rank} in step {step}")
            if fail_how == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
        loss = nn.functional.mse_loss(model(x), y)
        if rank == slow_rank and args.wrap == "ddp":  # extra forwards outside the autograd graph: a forward
            # is ~1/3 of a step's compute
            with torch.no_grad():
                for _ in range(round(3 * (factor - 1))):
                    model.module(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    col.metric("loss", loss)
col.close()
dist.destroy_process_group()
print(f"rank {rank} of {world} done", flush=True) if os.environ.get("JOB_VERBOSE") else None
