"""A two-stage pipeline of the plainest kind: stage 0 sends activations forward with
``batch_isend_irecv``, stage 1 sends a reply back with a blocking ``send``, megascope's lines added.

Run it under ``torchrun --standalone --nproc-per-node 2 tests/jobs/p2p_job.py RUN``. Fault for the
tests: ``--hang RANK,STEP`` (that rank sleeps at the start of STEP: its peer waits in its receive
until the timeout).
"""

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from megascope.collectors import Collector

parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--hang", default=None)
parser.add_argument("--timeout", type=float, default=10.0)
args = parser.parse_args()

col = Collector.from_env(args.run_dir, flush_interval_s=0.25, stacks_after_s=args.timeout / 2)   # megascope
dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
rank = dist.get_rank()
hang_rank, hang_step = (int(v) for v in args.hang.split(",")) if args.hang else (-1, -1)
act, reply = torch.zeros(64, 64), torch.zeros(8)
for step in range(args.steps):
    with col.step(step):                                                                        # megascope
        if rank == hang_rank and step == hang_step:
            time.sleep(3600)
        if rank == 0:
            act = torch.tanh(torch.randn(64, 64) @ torch.randn(64, 64))
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, act, 1)]):
                work.wait()
            dist.recv(reply, src=1)
        else:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, act, 0)]):
                work.wait()
            reply = act.sum(dim=0)[:8]
            dist.send(reply, dst=0)
col.close()
dist.destroy_process_group()
