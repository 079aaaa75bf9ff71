"""``megascope train``: the bundled 3D-parallel trainer (``--nproc N`` local ranks, or under torchrun)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from megascope.cli.common import inject_option, out_run_option


@click.command()
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Start this many local ranks (else run this process's rank under torchrun).")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline stages.")
@click.option("--dp", type=click.IntRange(min=1), default=None, help="Data-parallel size [default: world / (tp*pp)].")
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed = same data and start on every mesh.")
@click.option("--global-batch", type=click.IntRange(min=1), default=16, show_default=True, help="Sequences per step.")
@click.option("--micro-batches", type=click.IntRange(min=1), default=4, show_default=True,
              help="Micro-batches per step on each data-parallel rank.")
@click.option("--layers", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--hidden", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--heads", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--vocab", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--window", type=click.IntRange(min=1), default=None, help="Sliding-window attention span.")
@click.option("--serial-block", is_flag=True, help="Classic serial block instead of MegaScale's parallel block.")
@click.option("--no-sequence-parallel", is_flag=True, help="Plain TP (all-reduce) without sequence parallelism.")
@click.option("--optimizer", type=click.Choice(["adamw", "lamb"]), default="adamw", show_default=True)
@click.option("--lr", type=float, default=3e-3, show_default=True)
@click.option("--data", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Flat token file (nanoGPT-style .bin) [default: a seeded synthetic language].")
@click.option("--data-dtype", type=click.Choice(["uint16", "uint32"]), default="uint16", show_default=True)
@click.option("--collective-timeout", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds before a blocked collective fails the job.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--no-overlap", "no_overlap", type=click.Choice(["tp", "pp", "dp", "all"]), multiple=True,
              help="Wait for this dimension's communication where it is issued instead of overlapping it "
                   "with compute (repeatable; the baseline of an overlap measurement).")
@click.option("--bucket-mb", type=click.FloatRange(min=0, min_open=True), default=4.0, show_default=True,
              help="Gradient bucket size of the data-parallel reduce-scatter.")
@click.option("--layer-spans", type=click.Choice(["all", "first", "none"]), default="first", show_default=True,
              help="Forward/backward spans per transformer block: in every micro-batch, in the first of each "
                   "step, or none (each span costs the device ~2 us).")
@click.option("--no-layer-spans", is_flag=True, help="Same as --layer-spans none.")
@click.option("--tp-comm-spans", type=click.Choice(["auto", "all", "rotate", "first"]), default="auto",
              show_default=True,
              help="Spans of the TP collectives in every micro-batch; in one micro-batch a step, a different "
                   "one each step (rotate); or in the first of each step (the untimed calls keep their "
                   "enqueued/completed markers; on a GPU each span costs the device 2-3 timing events); "
                   "auto: rotate on CUDA, all on CPU.")
@click.option("--dp-comm-spans", type=click.Choice(["auto", "all", "rotate"]), default="auto", show_default=True,
              help="Spans of the DP calls (one per gradient bucket): all of them, or one in 4 by their place "
                   "in the step, a different one each step (rotate; the others keep their markers; a group "
                   "issuing fewer than 32 a step keeps all); auto: rotate on CUDA, all on CPU.")
@click.option("--collector-ab", type=click.IntRange(min=0), default=0, show_default=True,
              help="Measure the collector's cost in this run: it records blocks of this many steps and "
                   "is paused for the blocks between (0: always on; see --result-json).")
@click.option("--gc-interval", type=click.IntRange(min=0), default=0, show_default=True,
              help="Run Python's garbage collector by hand every this many steps, on every rank at the "
                   "same step, instead of whenever one rank's allocations trigger it (0: automatic).")
@click.option("--cpu-bind", type=click.Choice(["node", "slice", "none"]), default="node", show_default=True,
              envvar="MEGASCOPE_CPU_BIND",
              help="On GPUs, run each rank on the CPU cores of its GPU's NUMA node (node; nothing changes on a "
                   "machine of one node), on its own share of them (slice), or wherever the scheduler puts "
                   "it (none).")
@click.option("--profile", "profile_steps", type=click.IntRange(min=0), default=0, show_default=True,
              help="Write PyTorch-profiler (Kineto) traces of the last this many steps, one file per rank "
                   "under RUN/profiler/ (for Holistic Trace Analysis, Perfetto or megascope ingest).")
@click.option("--nvrx-straggler", is_flag=True,
              help="Also run NVIDIA's straggler detector (the nvidia-resiliency-ext package) in the job; "
                   "rank 0 writes its scores and the ranks it names to RUN/nvrx_straggler.json.")
@click.option("--host-stats", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Also write, per rank and step, the training thread's CPU time and context switches and "
                   "the process's CPU time to DIR/rank-N.json (for benchmarks of the collector's cost).")
@click.option("--result-json", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Also write the loss and host seconds of every step here (for benchmarks).")
@click.option("--compact/--no-compact", "compact_parts", default=True, show_default=True,
              help="Once the job has ended, merge each rank's parts but its newest into a few sorted files "
                   "(megascope compact; launched with --nproc only, where every rank has stopped writing).")
@inject_option
@out_run_option
def train(nproc: int | None, tp: int, pp: int, dp: int | None, steps: int, seed: int, global_batch: int,
          micro_batches: int, layers: int, hidden: int, heads: int, vocab: int, seq_len: int, window: int | None,
          serial_block: bool, no_sequence_parallel: bool, optimizer: str, lr: float, data: Path | None,
          data_dtype: str, collective_timeout: float, device: str, no_overlap: tuple[str, ...], bucket_mb: float,
          layer_spans: str, no_layer_spans: bool, tp_comm_spans: str, dp_comm_spans: str, collector_ab: int,
          gc_interval: int,
          cpu_bind: str, profile_steps: int, nvrx_straggler: bool, host_stats: Path | None, result_json: Path | None, compact_parts: bool, injects: tuple[str, ...], out: Path) -> None:
    """Train the bundled GPT on a TP x PP x DP mesh, fully instrumented, with optional planted faults."""
    from megascope.inject import parse_injects
    from megascope.trainer.config import OVERLAP_DIMS, ModelConfig, TrainConfig

    world = nproc if nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))
    model = ModelConfig(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq_len,
                        parallel_block=not serial_block, window=window)
    cfg = TrainConfig(out=out, world_size=world, tp=tp, pp=pp, dp=dp, steps=steps, seed=seed,
                      global_batch=global_batch, micro_batches=micro_batches, model=model, optimizer=optimizer,
                      lr=lr, sequence_parallel=not no_sequence_parallel, data=data, data_dtype=data_dtype,
                      faults=parse_injects(injects), collective_timeout_s=collective_timeout, device=device,
                      layer_spans="none" if no_layer_spans else layer_spans, tp_comm_spans=tp_comm_spans,
                      dp_comm_spans=dp_comm_spans,
                      bucket_mb=bucket_mb,
                      collector_ab=collector_ab, gc_interval=gc_interval, cpu_bind=cpu_bind,
                      profile_steps=profile_steps, nvrx_straggler=nvrx_straggler, host_stats=host_stats,
                      overlap=frozenset() if "all" in no_overlap else frozenset(OVERLAP_DIMS) - set(no_overlap))
    # Never into an existing run: new parts would mix with the old ones. Under torchrun every rank
    # checks here, before the rendezvous, so no rank can have written anything yet.
    from megascope import layout

    if result_json is not None:
        layout.check_output_file(result_json, replace=True, runs=(out,))
    if host_stats is not None:
        layout.check_counters_dir(host_stats, run=out)
    if nvrx_straggler:
        import importlib.util

        from megascope.errors import ConfigError

        if importlib.util.find_spec("nvidia_resiliency_ext") is None:
            raise ConfigError("--nvrx-straggler needs the nvidia-resiliency-ext package, which is not installed "
                              "(pip install nvidia-resiliency-ext)")
    layout.prepare_run_dir(out)
    # Only now, with every argument checked, does anything start.
    from megascope.trainer.launch import train as run_training

    result = run_training(cfg, nproc=nproc)
    if result_json is not None and int(os.environ.get("RANK", "0")) == 0:
        import json

        record: dict[str, object] = {"losses": result.losses, "step_seconds": result.step_seconds}
        if result.step_wait_seconds is not None:
            record["step_wait_seconds"] = result.step_wait_seconds
        if result.collector_on is not None:
            record.update(collector_on=result.collector_on, ab_flush_seconds=result.ab_flush_seconds)
        result_json.write_text(json.dumps(record) + "\n")
    if int(os.environ.get("RANK", "0")) == 0:
        from megascope.topology import ranks_text

        click.echo(f"{out}: {steps} steps on {ranks_text(world)} (pp={cfg.pp} dp={cfg.dp} tp={cfg.tp}), "
                   f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
    # Under torchrun each rank runs this command and the others may still be flushing: only the
    # launcher that waited for every rank (--nproc) compacts.
    if compact_parts and nproc is not None:
        _compact_at_end(out)


def _compact_at_end(out: Path) -> None:
    """Merge the finished run's parts; a failure leaves the parts as they are and says so."""
    from megascope.errors import MegascopeError

    try:
        from megascope.compact import compact
    except ImportError as exc:  # numpy missing from a minimal install: the parts stay as they are
        click.echo(f"warning: {out}: parts not compacted ({exc})", err=True)
        return
    try:
        # Each rank's newest part stays, so that every rank keeps its own partition directory
        # (tools that glob spans/rank=*/ find every rank); everything older is merged.
        compact(out, min_age_s=0, keep_newest=1, grace_s=0)
    except (MegascopeError, OSError) as exc:
        click.echo(f"warning: {out}: parts not compacted ({exc}); run 'megascope compact {out} --all' later",
                   err=True)


def register(group: click.Group) -> None:
    group.add_command(train)
