"""One rank of the bundled trainer: build the mesh, model stage, optimizer and data, then train.

Role in the data flow: ``launch.py`` (``megascope train --nproc N``) or torchrun runs
:func:`train_rank` once per process. Everything it does is stamped through the collector into the
run directory: a ``step`` span per step, ``data`` wait, per-micro-batch ``forward``/``backward``
per stage (and per block, via ``instrument_module``), every TP/PP/DP/world communication call,
``optimizer``; and the metrics ``loss``, ``grad_norm``, ``lr`` and ``tokens`` per step. Rank 0
writes ``run.json`` with model FLOPs and tokens per step, device name and peak FLOP/s.

Nothing in the step waits for the device: loss and gradient norm stay tensors until the collector
resolves them; the only host sync is the list of losses returned after the last step (and, with
``--collector-ab``, one at every block boundary: :mod:`megascope.trainer.ab`). Step times
returned are host wall-clock between step ends (exact on CPU; on CUDA the host runs ahead of the
device by a bounded launch queue, so they match device time only averaged over steady state).

Example::

    result = train_rank(cfg, rank=0, world_size=1, local_rank=0, init_method="file:///tmp/x")
    result.losses, result.step_seconds
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megascope.collectors.runid import job_run_id, new_run_id
from megascope.schema import RunMeta, RunSource, SpanKind
from megascope.topology import Mesh
from megascope.trainer.ab import ab_switch
from megascope.trainer.affinity import bind_to_device, describe
from megascope.trainer.config import TrainConfig
from megascope.trainer.data import Prefetcher, Source, SyntheticLanguage, TokenFile
from megascope.trainer.faults import Burner, DeviceStretch, FaultPlan
from megascope.trainer.flops import model_flops_per_step, peak_flops
from megascope.trainer.hoststats import HostMeter
from megascope.trainer.instrument import Comm, instrument_blocks, open_collector
from megascope.trainer.model import GPTStage
from megascope.trainer.parallel import ParallelState
from megascope.trainer.peers import nvrx_detector, nvrx_steps, step_profiler
from megascope.trainer.pipeline import MicroBatch, StageIO, run_1f1b
from megascope.trainer.tp import TPContext
from megascope.trainer.zero import ShardedOptimizer, lr_at

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankResult:
    losses: list[float]  # global loss per step (the same on every rank)
    step_seconds: list[float]  # this rank's host time per step
    # --collector-ab: whether the collector recorded each step, and the host seconds of each
    # flush that ended a recorded block (megascope.trainer.ab).
    collector_on: list[bool] | None = None
    ab_flush_seconds: list[float] | None = None
    # CUDA: seconds per step the host waited for the device to end the step before (loop.py keeps
    # it at most a step ahead); near 0 when the host is what sets the pace.
    step_wait_seconds: list[float] | None = None


def pick_device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def run_meta(cfg: TrainConfig, *, device: torch.device, start_ns: int) -> RunMeta:
    """``run.json`` for this run (rank 0 writes it through the collector). The run id is the
    launcher's where it names the job (``megascope train --nproc``, torchrun), which every rank
    stamps into its parts; else rank 0's, which the others read from run.json
    (:mod:`megascope.collectors.runid`)."""
    device_name, peak = peak_flops(device) if cfg.peak_flops is None else (
        torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", cfg.peak_flops)
    m = cfg.model
    return RunMeta(
        run_id=job_run_id() or new_run_id(cfg.out, start_ns),
        source=RunSource.TRAINER,
        world_size=cfg.world_size,
        mesh_sizes=cfg.mesh_sizes,
        start_ns=start_ns,
        model_flops_per_step=model_flops_per_step(m, tokens=cfg.tokens_per_step),
        tokens_per_step=cfg.tokens_per_step,
        device_name=device_name,
        peak_flops_per_device=peak,
        micro_batches=cfg.micro_batches,
        config={
            "model": {"layers": m.layers, "hidden": m.hidden, "heads": m.heads, "vocab": m.vocab,
                      "seq_len": m.seq_len, "ffn_mult": m.ffn_mult, "parallel_block": m.parallel_block,
                      "window": m.window},
            "seed": cfg.seed, "global_batch": cfg.global_batch, "steps": cfg.steps,
            "optimizer": cfg.optimizer, "lr": cfg.lr, "sequence_parallel": cfg.sequence_parallel,
            "inject": cfg.faults.specs(), "collective_timeout_s": cfg.collective_timeout_s,
            "flush_interval_s": cfg.flush_interval_s,
            "overlap": sorted(cfg.overlap), "bucket_mb": cfg.bucket_mb,
            "cpu_bind": cfg.cpu_bind if device.type == "cuda" else "none",
            "layer_spans": cfg.layer_spans, "tp_comm_spans": cfg.tp_comm_spans_on(device.type),
            "dp_comm_spans": cfg.dp_comm_spans_on(device.type),
            "data": str(cfg.data) if cfg.data else "synthetic",
            "dtype": "bf16-autocast" if device.type == "cuda" else "fp32",
            "profile_steps": cfg.profile_steps, "nvrx_straggler": cfg.nvrx_straggler,
        },
    )


def _source(cfg: TrainConfig) -> Source:
    m = cfg.model
    if cfg.data is not None:
        return TokenFile(cfg.data, dtype=cfg.data_dtype, vocab=m.vocab, seq_len=m.seq_len, seed=cfg.seed)
    return SyntheticLanguage(vocab=m.vocab, seq_len=m.seq_len, seed=cfg.seed)


def train_rank(cfg: TrainConfig, *, rank: int, world_size: int, local_rank: int,
               init_method: str | None = None, progress: Path | None = None) -> RankResult:
    """Train this rank; returns the global loss of every step. ``progress``, when given, is a file
    whose time is set each time the rank ends a step (the local launcher's sign of life)."""
    if world_size != cfg.world_size:
        raise ValueError(f"launched {world_size} ranks for a config of {cfg.world_size}")
    device = pick_device(cfg, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if cfg.cpu_bind != "none":
            # Before anything is allocated or started: memory is placed on the node of the core
            # that first touches it, and the data worker and marker agent inherit the cores.
            cores = bind_to_device(device, cfg.cpu_bind)
            log.info("rank %d on %s: cores %s", rank, device, describe(cores))
    timeout = timedelta(seconds=cfg.collective_timeout_s)
    if device.type == "cuda":
        # Before any NCCL group exists: a collective timeout then dumps every rank's flight
        # recorder into the run, the second witness `localize` joins with the markers.
        from megascope.collectors.evidence import enable_nccl_flight_recorder

        enable_nccl_flight_recorder(cfg.out)
    start_ns = time.time_ns()
    meta = run_meta(cfg, device=device, start_ns=start_ns) if rank == 0 else None
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                            rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    # Destroyed only after a clean end: on NCCL, destroying it flushes the calls in flight, and a
    # rank that failed leaves calls its peers never finish, so it would wait for their timeout
    # before its process could exit (seen on 2x H200: a raising rank's job took 70 s to end, a
    # killed one's 28 s). The process's exit frees what a failed rank leaves.
    result = _train(cfg, rank=rank, device=device, meta=meta, timeout=timeout, progress=progress)
    dist.destroy_process_group()
    return result


def _train(cfg: TrainConfig, *, rank: int, device: torch.device, meta: RunMeta | None,
           timeout: timedelta, progress: Path | None = None) -> RankResult:
    mesh = Mesh.for_world(cfg.world_size, tp=cfg.tp, pp=cfg.pp, dp=cfg.dp)
    ps = ParallelState.build(mesh, rank, timeout=timeout)
    col = open_collector(cfg.out, rank=rank, world_size=cfg.world_size, coords=ps.coords, groups=ps.groups(),
                         meta=meta, device=device, flush_interval_s=cfg.flush_interval_s,
                         sampling=cfg.sampled_comm(device.type),
                         collective_timeout_s=cfg.collective_timeout_s)
    try:
        ps.register(col)
        return _loop(cfg, ps, col, device, progress)
    finally:
        col.close()


def _autocast(device: torch.device) -> Callable[[], Any]:
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def _loop(cfg: TrainConfig, ps: ParallelState, col: Any, device: torch.device,
          progress: Path | None = None) -> RankResult:
    m = cfg.model
    plan = FaultPlan(cfg.faults, rank=ps.rank, collector=col)
    # A receive timeout for gloo, which does not apply one to point-to-point waits by itself. Not on
    # NCCL: there a wait with a timeout blocks the host until the transfer completes (a device
    # sync at every pipeline receive), and NCCL's watchdog already enforces the group's timeout.
    comm = Comm(col, gate=plan.gate, recv_timeout_s=cfg.collective_timeout_s if device.type == "cpu" else None)
    tp = TPContext(comm=comm, pg=ps.tp.pg, size=ps.tp.size, index=ps.tp_index,
                   sequence_parallel=cfg.sequence_parallel, overlap="tp" in cfg.overlap)
    stage = GPTStage(m, tp, stage=ps.pp_index, stages=ps.pp.size, seed=cfg.seed, device=device)
    if cfg.layer_spans != "none":
        instrument_blocks(col, stage, [f"layers.{i}" for i in stage.layer_ids],
                          microbatches={0} if cfg.layer_spans == "first" else None)
    autocast = _autocast(device)
    if plan.factor > 1.0:
        if plan.mode == "time" and device.type == "cuda":
            plan.set_burner(DeviceStretch(plan.factor, device))
        else:
            plan.set_burner(Burner(stage.matmul_weights(), tokens=m.seq_len * cfg.micro_batch_size,
                                   factor=plan.factor, autocast=autocast, timed=plan.mode == "time"))
    opt = ShardedOptimizer(stage, comm=comm, tp=ps.tp, dp=ps.dp, world=ps.world, dp_index=ps.dp_index,
                           tp_index=ps.tp_index, sequence_parallel=cfg.sequence_parallel, optimizer=cfg.optimizer,
                           lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                           bucket_mb=cfg.bucket_mb, device=device, collector=col, overlap="dp" in cfg.overlap)
    # The parameter all-gathers after each step overlap the next forward: each watched module
    # waits for its own buckets. The stage's own forward reads the embeddings; ln_f's hook also
    # covers the output layer, which the stage multiplies by directly.
    first_reads = [p for p in (stage.pos, stage.embed.weight if stage.embed is not None else None) if p is not None]
    opt.watch(stage, first_reads)
    for block in stage.layers.values():
        opt.watch(block)
    if stage.ln_f is not None and stage.lm_head is not None:
        opt.watch(stage.ln_f, [*stage.ln_f.parameters(), stage.lm_head.weight])
    if ps.dp.size > 1 and (missing := opt.unwatched(stage)):
        raise RuntimeError(f"parameters read before any forward waits for their all-gather: {', '.join(missing)}")
    members = ps.pp.members
    seq_local = m.seq_len // ps.tp.size if cfg.sequence_parallel else m.seq_len
    io = StageIO(comm=comm, pg=ps.pp.pg,
                 prev=members[ps.pp_index - 1] if not ps.first_stage else None,
                 next=members[ps.pp_index + 1] if not ps.last_stage else None,
                 shape=(seq_local, cfg.micro_batch_size, m.hidden), device=device, overlap="pp" in cfg.overlap)

    def before_last_backward() -> None:
        # The DP gradient sync starts inside the last backward (bucket by bucket): the skew pause
        # goes just before that backward, outside every span, as a real host hiccup would.
        plan.before_dp_sync()
        opt.arm()

    local_batch = cfg.global_batch // ps.dp.size
    rows = slice(ps.dp_index * local_batch, (ps.dp_index + 1) * local_batch)
    loss_scale = 1.0 / (cfg.micro_batches * ps.dp.size)
    counts_loss = ps.last_stage and ps.tp_index == 0
    losses: list[torch.Tensor] = []
    step_ends = [time.perf_counter()]
    ab_on: list[bool] = []
    ab_flushes: list[float] = []
    previous_step_done: torch.cuda.Event | None = None
    waits: list[float] = []
    meter = HostMeter() if cfg.host_stats is not None else None
    # On GPUs the batches come from a worker process: the synthetic language's token-by-token
    # build would otherwise take the training thread's interpreter lock thousands of times a step.
    prefetch = Prefetcher(_source(cfg), steps=range(cfg.steps), global_batch=cfg.global_batch, rows=rows,
                          device=device, process=device.type == "cuda")
    with manual_gc(cfg.gc_interval) as collect_now, prefetch as data, \
            step_profiler(cfg.profile_steps, cfg.steps, cfg.out, rank=ps.rank, device=device) as profiled, \
            nvrx_detector(cfg.nvrx_straggler, cfg.out, rank=ps.rank,
                          until=nvrx_steps(cfg.steps, cfg.profile_steps)) as nvrx:
        for step in range(cfg.steps):
            if cfg.collector_ab:
                flushed = ab_switch(col, step, cfg.collector_ab, device)
                if flushed is not None:
                    ab_flushes.append(flushed)
                ab_on.append(col.recording)
            plan.set_step(step)
            lr = lr_at(step, base=cfg.lr, warmup=cfg.warmup_steps, total=cfg.steps)
            with col.step(step), nvrx.section(step):
                if collect_now(step):
                    gc.collect()  # the collector records it as a gc.gen2 host span
                with col.span("data", kind=SpanKind.DATA):
                    batch = data.next()
                micro = [MicroBatch(tokens=c[:, :-1].t(), targets=c[:, 1:].t())
                         for c in batch.chunk(cfg.micro_batches, dim=0)]
                loss = run_1f1b(stage, io, micro, stage_index=ps.pp_index, stages=ps.pp.size, collector=col,
                                loss_scale=loss_scale, before_last_backward=before_last_backward, autocast=autocast,
                                burn=plan.burn, burn_begin=plan.begin)
                grad_norm, global_loss = opt.step(lr, loss if counts_loss else None)
            if device.type == "cuda":
                # Keep the host at most one step ahead of the device: the wait on the previous step's
                # end (already done in the steady state) releases the GIL, so the collector's writer
                # keeps flushing markers even when a peer hangs and the device stops. Left to run
                # ahead, the host would block inside a kernel launch holding the GIL instead.
                step_done = torch.cuda.Event()
                step_done.record()
                if previous_step_done is not None:
                    waited = time.perf_counter()
                    previous_step_done.synchronize()
                    waits.append(time.perf_counter() - waited)
                else:
                    waits.append(0.0)
                previous_step_done = step_done
            col.metric("loss", global_loss, step=step)
            col.metric("grad_norm", grad_norm, step=step)
            col.metric("lr", lr, step=step)
            col.metric("tokens", float(cfg.tokens_per_step), step=step)
            losses.append(global_loss.detach())
            step_ends.append(time.perf_counter())
            if meter is not None:
                meter.tick()
            if progress is not None:
                os.utime(progress)
            nvrx.after_step(step)
            profiled(step)
        # Inside the profiler's window: a collective still in flight when the profiler stops ends
        # its recorded call after the profiler's state is gone (a crash seen on gloo).
        opt.wait_params()
    if meter is not None and cfg.host_stats is not None:
        meter.write(cfg.host_stats, rank=ps.rank)
    return RankResult(losses=torch.stack(losses).tolist(),
                      step_seconds=[b - a for a, b in zip(step_ends, step_ends[1:], strict=False)],
                      collector_on=ab_on if cfg.collector_ab else None,
                      ab_flush_seconds=ab_flushes if cfg.collector_ab else None,
                      step_wait_seconds=waits if device.type == "cuda" else None)


@contextlib.contextmanager
def manual_gc(interval: int) -> Iterator[Callable[[int], bool]]:
    """Python's garbage collector by hand for the length of the block (``interval`` > 0).

    Automatic collection starts whenever a rank's allocations cross a threshold, so each rank
    stops for its own full collections at its own moments, and in a synchronous job every other
    rank waits (Megatron's ``--manual-gc`` and torchtitan's GC interval do this for the same
    reason). Here what exists after setup is frozen (never scanned again), automatic collection
    is off, and the block gets ``collect_now(step)``: true every ``interval`` steps, the same
    steps on every rank. ``interval`` 0 leaves the collector automatic and ``collect_now`` false.
    Afterwards collection is automatic again; the freeze is undone only if nothing was frozen
    before (a forked rank freezes what it inherited and must never collect it).
    """
    if interval <= 0:
        yield lambda step: False
        return
    was_enabled, was_frozen = gc.isenabled(), gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield lambda step: step > 0 and step % interval == 0
    finally:
        if not was_frozen:
            gc.unfreeze()
        if was_enabled:
            gc.enable()


def env_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's environment, or None outside torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))

