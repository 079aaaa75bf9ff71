"""The collector A/B: what the collector costs a training job, measured inside one process.

Role in the data flow: ``megascope train --collector-ab K`` records blocks of K steps and pauses
the collector (:meth:`Collector.pause`) for the blocks between; :func:`ab_switch` does that at the
start of each step, and :func:`ab_cost` turns the run's step times into the comparison
(``bench/gpu_trainer.sh`` PARTS=ab prints it). Recorded and unrecorded steps share the process's
NCCL communicators, memory layout, GPU clocks and neighbours, which separate runs do not: on two
GPUs, whole runs of the same configuration differ by a few percent, more than the cost measured.

At each boundary the device is synchronized (at both kinds, so that both kinds of block start the
same way), and before a pause the recorded block's spans still waiting are flushed, on the training
thread and timed. The first step of every block is left out of the comparison. The flush is what
the writer would otherwise have done in the background, paced, beside the training: charged in
full to the recorded steps it gives an upper bound (``cost_charged``); left out, a lower one
(``cost``).

Example::

    cost = ab_cost(result.step_seconds, result.collector_on, result.ab_flush_seconds, warmup=3)
    cost["cost"], cost["cost_charged"]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch


def ab_switch(col: Any, step: int, block: int, device: torch.device) -> float | None:
    """The collector A/B at the start of ``step``: record blocks 0, 2, 4, ... of ``block`` steps.

    At a block boundary the device is synchronized (at both kinds of boundary), and before a pause
    the recorded block's spans are flushed: returns that flush's host seconds (see :func:`ab_cost`).
    Elsewhere returns None.
    """
    if step == 0 or step % block:
        return None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if (step // block) % 2 == 0:
        col.resume()
        return None
    t0 = time.perf_counter()
    col.flush()
    col.pause()
    return time.perf_counter() - t0


def ab_cost(step_seconds: Sequence[float], collector_on: Sequence[bool], flush_seconds: Sequence[float],
            *, warmup: int) -> dict[str, float]:
    """Recorded vs unrecorded steps of one A/B run (steps before ``warmup`` and the first step of
    every block left out): means, medians, and the collector's cost as a fraction of a step."""
    if len(step_seconds) != len(collector_on):
        raise ValueError(f"{len(step_seconds)} step times but {len(collector_on)} on/off flags")
    on: list[float] = []
    off: list[float] = []
    flushed_on_steps = 0  # recorded steps whose block ended in a pause, i.e. in a timed flush
    block_on_steps = 0
    for i, (seconds, rec) in enumerate(zip(step_seconds, collector_on, strict=True)):
        first = i == 0 or rec != collector_on[i - 1]
        if first and not rec and i > 0:
            flushed_on_steps += block_on_steps
        if first:
            block_on_steps = 0
        block_on_steps += rec
        if i >= warmup and not first:
            (on if rec else off).append(seconds)
    if not on or not off:
        raise ValueError("an A/B comparison needs recorded and unrecorded steps after the warm-up")
    on_mean, off_mean = statistics.fmean(on), statistics.fmean(off)
    flush_per_step = sum(flush_seconds) / flushed_on_steps if flushed_on_steps else 0.0
    return {
        "on_steps": len(on), "off_steps": len(off),
        "on_mean_s": on_mean, "off_mean_s": off_mean,
        "on_median_s": statistics.median(on), "off_median_s": statistics.median(off),
        "flush_per_step_s": flush_per_step,
        "cost": on_mean / off_mean - 1,
        "cost_median": statistics.median(on) / statistics.median(off) - 1,
        "cost_charged": (on_mean + flush_per_step) / off_mean - 1,
    }
