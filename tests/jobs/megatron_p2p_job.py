"""A two-stage pipeline that sends and receives the way Megatron-core's schedules do with
``overlap_p2p_comm`` (``batch_p2p_comm=False``): ``_p2p_ops`` in
``megatron.core.pipeline_parallel.p2p_communication`` issues ``isend``/``irecv`` one by one and
returns its requests by name, and the caller looks ``_p2p_ops`` up in that module at each call.
Megatron-core's models need CUDA; this stand-in of its module (megatron-core 0.16's ``_p2p_ops``,
shortened) runs on gloo, and so does Megatron's own ``_p2p_ops`` (``--real``, megatron-core installed). Megascope's three lines are marked.

    torchrun --standalone --nproc-per-node 2 tests/jobs/megatron_p2p_job.py RUN --steps 4 --micro-batches 3
"""

import argparse
import sys
import types

import torch
import torch.distributed as dist
from megascope.collectors import Collector


def _p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
             prev_pipeline_rank, next_pipeline_rank):
    reqs = {}
    if tensor_send_next is not None:
        reqs["send_next"] = dist.isend(tensor=tensor_send_next, dst=next_pipeline_rank, group=group)
    if tensor_recv_prev is not None:
        reqs["recv_prev"] = dist.irecv(tensor=tensor_recv_prev, src=prev_pipeline_rank, group=group)
    if tensor_send_prev is not None:
        reqs["send_prev"] = dist.isend(tensor=tensor_send_prev, dst=prev_pipeline_rank, group=group)
    if tensor_recv_next is not None:
        reqs["recv_next"] = dist.irecv(tensor=tensor_recv_next, src=next_pipeline_rank, group=group)
    return reqs


def communicate(**kwargs):
    reqs = sys.modules[__name__ + ".p2p"]._p2p_ops(**kwargs)  # looked up at each call, as Megatron's
    for req in reqs.values():
        req.wait()


parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--micro-batches", type=int, default=3)
parser.add_argument("--real", action="store_true", help="Megatron-core's own module (pip install megatron-core)")
args = parser.parse_args()

if args.real:
    import megatron.core.pipeline_parallel.p2p_communication as p2p
else:
    p2p = types.ModuleType("megatron.core.pipeline_parallel.p2p_communication")
    p2p._p2p_ops = _p2p_ops
    for name in ("megatron", "megatron.core", "megatron.core.pipeline_parallel"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[p2p.__name__] = p2p
sys.modules[__name__ + ".p2p"] = p2p

dist.init_process_group("gloo")
rank = dist.get_rank()
col = Collector.from_env(args.run_dir, groups={"pp": dist.group.WORLD}, flush_interval_s=0.25)   # megascope
layer = torch.nn.Linear(64, 64)
none = dict(tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=None, tensor_recv_next=None)
for step in range(args.steps):
    with col.step(step):                                                                           # megascope
        for _ in range(args.micro_batches):
            if rank == 0:  # the first stage: its activations forward, their gradient back
                out = layer(torch.randn(8, 64))
                communicate(**{**none, "tensor_send_next": out.detach()}, group=dist.group.WORLD,
                            prev_pipeline_rank=1, next_pipeline_rank=1)
                grad = torch.empty(8, 64)
                communicate(**{**none, "tensor_recv_next": grad}, group=dist.group.WORLD,
                            prev_pipeline_rank=1, next_pipeline_rank=1)
                out.backward(grad)
            else:
                x = torch.empty(8, 64)
                communicate(**{**none, "tensor_recv_prev": x}, group=dist.group.WORLD,
                            prev_pipeline_rank=0, next_pipeline_rank=0)
                x.requires_grad_()
                layer(x).square().mean().backward()
                communicate(**{**none, "tensor_send_prev": x.grad}, group=dist.group.WORLD,
                            prev_pipeline_rank=0, next_pipeline_rank=0)
col.close()                                                                                        # megascope
dist.destroy_process_group()
