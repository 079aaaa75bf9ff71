"""A Megatron-core GPT training script, written the way Megatron-core's own examples are, with
megascope's four statements added (five lines, marked ``# megascope``).

Run it on GPUs under ``torchrun --standalone --nproc-per-node N tests/jobs/megatron_job.py RUN
--tp T --pp P`` (dp = N / (T * P); needs ``pip install megatron-core``, no Transformer Engine or
Apex). Megatron makes its own process groups (``parallel_state``); megascope is given the three
it lays the job out by and sees every collective through them. (Sequence parallelism needs
Transformer Engine or Apex layer norms, so it is off here.)

Faults for the checks: ``--straggler RANK,FACTOR`` (that rank's GPU is FACTOR times slower: its
stream sleeps FACTOR-1 times the step's measured time inside the model's own work, a third in the
forward passes and two thirds in the backward, as a slow GPU stretches its kernels),
``--hang RANK,STEP`` (that rank sleeps before STEP: its peers wait in a collective until NCCL's
timeout). Rank 0 prints each step's wall
time (``step N ms``, the step ends at a device synchronization); ``MEGASCOPE_DISABLE=1`` runs the
same job without megascope.
"""

import argparse
import os
import time
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from megascope.collectors import Collector  # megascope
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("--tp", type=int, default=2)
parser.add_argument("--pp", type=int, default=1)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--layers", type=int, default=8)
parser.add_argument("--hidden", type=int, default=1024)
parser.add_argument("--heads", type=int, default=16)
parser.add_argument("--seq", type=int, default=512)
parser.add_argument("--vocab", type=int, default=8192)
parser.add_argument("--micro-batch", type=int, default=4)
parser.add_argument("--micro-batches", type=int, default=4)
parser.add_argument("--straggler", default=None)
parser.add_argument("--hang", default=None)
parser.add_argument("--timeout", type=float, default=60.0)
args = parser.parse_args()

local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl", timeout=timedelta(seconds=args.timeout))
ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                            distributed_timeout_minutes=args.timeout / 60)  # its groups time out too
col = Collector.from_env(args.run_dir, groups={"tp": ps.get_tensor_model_parallel_group(),  # megascope
                         "pp": ps.get_pipeline_model_parallel_group(), "dp": ps.get_data_parallel_group()})
model_parallel_cuda_manual_seed(1234)
rank = dist.get_rank()

config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                           tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                           pipeline_dtype=torch.float32, use_cpu_initialization=True)
model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                 max_sequence_length=args.seq, pre_process=ps.is_pipeline_first_stage(),
                 post_process=ps.is_pipeline_last_stage()).cuda()
model = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
    overlap_grad_reduce=False, use_distributed_optimizer=False))
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
forward_backward = get_forward_backward_func()

slow_rank, factor = (int(v) if i == 0 else float(v) for i, v in enumerate(args.straggler.split(","))) \
    if args.straggler else (-1, 1.0)
hang_rank, hang_step = (int(v) for v in args.hang.split(",")) if args.hang else (-1, -1)
cycles_per_ns = 0.0
if rank == slow_rank:
    from megascope.trainer.faults import sleep_cycles_per_ns
    cycles_per_ns = sleep_cycles_per_ns(torch.device("cuda", local_rank))

gen = torch.Generator().manual_seed(ps.get_data_parallel_rank())  # TP and PP peers read the same batch
causal = torch.triu(torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool), diagonal=1).cuda()
positions = torch.arange(args.seq).unsqueeze(0).expand(args.micro_batch, -1).cuda()


def batches():
    while True:
        tokens = torch.randint(args.vocab, (args.micro_batch, args.seq + 1), generator=gen)
        yield tokens[:, :-1].cuda(non_blocking=True), tokens[:, 1:].cuda(non_blocking=True)


def loss_func(output):
    loss = output.float().mean()
    return loss, {"lm loss": loss}


def forward_step(data, model):
    tokens, labels = next(data)
    return model(tokens, positions, causal, labels=labels), partial(loss_func)


data = batches()
warm: list[float] = []


def slow_gpu(layer, inputs, output):  # the first layer of the stage, each micro-batch: forward and backward sleep
    if len(warm) == 3:
        cycles = int((factor - 1) * sorted(warm)[1] * 1e9 * cycles_per_ns / (3 * args.micro_batches))
        torch.cuda._sleep(cycles)
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: torch.cuda._sleep(2 * cycles))


if rank == slow_rank:
    model.module.decoder.layers[0].register_forward_hook(slow_gpu)
last = time.perf_counter()
for step in range(args.steps):
    with col.step(step):                                                                  # megascope
        if rank == hang_rank and step == hang_step:
            time.sleep(3600)
        opt.zero_grad()
        model.zero_grad_buffer()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=data, model=model,
                                  num_microbatches=args.micro_batches, seq_length=args.seq,
                                  micro_batch_size=args.micro_batch, forward_only=False)
        finalize_model_grads([model])
        opt.step()
    torch.cuda.synchronize()
    now = time.perf_counter()
    if len(warm) < 3 and step >= 2:
        warm.append(now - last)
    if rank == 0:
        print(f"step {step} {(now - last) * 1e3:.2f} ms", flush=True)
    last = now
col.close()                                                                               # megascope
dist.destroy_process_group()
