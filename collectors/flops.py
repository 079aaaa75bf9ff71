"""MFU without arithmetic: the model FLOPs of a step and the device's peak, into run.json.

Role in the data flow: part of the in-job collector. MFU per step needs ``model_flops_per_step``
(the whole job's, forward and backward) and ``peak_flops_per_device`` in ``run.json``; these
helpers fill them from what a job has at hand, on rank 0:

- from the parameter count: ``6 x parameters x tokens`` (the usual dense-transformer estimate;
  attention's sequence-length term and embeddings' lookups are not counted);
- or counted: ``torch.utils.flop_counter`` over one step (``count_flops``), this rank's count times
  the world size, which holds when every rank does an equal share of the model's work.

The peak is a table for CUDA devices (bf16 dense) and a short fp32 matmul measurement on a CPU;
pass ``peak_flops_per_device`` to say what it is.

Example::

    col.set_model_flops(model, tokens_per_step=global_batch * seq_len)
    # or, for any model, counted during the first step:
    with col.step(0), col.count_flops(tokens_per_step=global_batch * seq_len):
        ...
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megascope.collectors.collector import Collector

log = logging.getLogger(__name__)


def parameter_count(model: Any) -> int:
    """Parameters of ``model``, counted once each; a sharded (DTensor) parameter counts whole."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += int(p.numel())
    return total


def estimate_flops_per_step(model: Any, tokens_per_step: int) -> float:
    """``6 x parameters x tokens``: forward (2) and backward (4) FLOPs per parameter per token."""
    return 6.0 * parameter_count(model) * int(tokens_per_step)


def device_peak(device: Any) -> tuple[str | None, float | None]:
    """(device name, peak FLOP/s per device): a table for CUDA, a one-thread fp32 measurement on CPU."""
    try:
        from megascope.trainer.flops import peak_flops

        return peak_flops(device)
    except Exception:
        log.warning("megascope: the device's peak FLOP/s is unknown; MFU needs peak_flops_per_device",
                    exc_info=True)
        return None, None


def set_model_flops(col: Collector, model: Any = None, *, tokens_per_step: int | None = None,
                    flops_per_step: float | None = None, peak_flops_per_device: float | None = None) -> None:
    """Write the step's model FLOPs (given, or estimated from ``model``), tokens and the peak to run.json."""
    if flops_per_step is None and model is not None and tokens_per_step is not None:
        flops_per_step = estimate_flops_per_step(model, tokens_per_step)
    if flops_per_step is None:
        col._warn_once("flops-args", "megascope collector: set_model_flops needs flops_per_step, or a model and "
                       "tokens_per_step; MFU stays unknown")
        return
    _write(col, flops_per_step, tokens_per_step, peak_flops_per_device)


def _write(col: Collector, flops_per_step: float, tokens_per_step: int | None, peak: float | None) -> None:
    if col.rank != 0 or not col.enabled:
        return
    name = None
    if peak is None:
        name, peak = device_peak(col.device)
    meta = col._meta
    changes: dict[str, Any] = {"model_flops_per_step": float(flops_per_step), "peak_flops_per_device": peak}
    if tokens_per_step is not None:
        changes["tokens_per_step"] = int(tokens_per_step)
    if name is not None and meta.device_name is None:
        changes["device_name"] = name
    col._meta = dataclasses.replace(meta, **changes)
    col._writer.set_run_meta(col._meta)


class CountFlops:
    """``with col.count_flops(tokens_per_step=...)``: count this rank's FLOPs over the block
    (``torch.utils.flop_counter``), then write ``count x world size`` as the step's model FLOPs."""

    def __init__(self, col: Collector, tokens_per_step: int | None, peak_flops_per_device: float | None) -> None:
        self._col = col
        self._tokens = tokens_per_step
        self._peak = peak_flops_per_device
        self._mode: Any = None

    def __enter__(self) -> CountFlops:
        try:
            from torch.utils.flop_counter import FlopCounterMode

            self._mode = FlopCounterMode(display=False)
            self._mode.__enter__()
        except Exception:
            self._mode = None
            self._col._internal_error("flop counter start")
        return self

    def __exit__(self, *exc: object) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        try:
            mode.__exit__(None, None, None)
            counted = float(mode.get_total_flops())
            if counted > 0 and exc[0] is None:
                _write(self._col, counted * self._col.world_size, self._tokens, self._peak)
        except Exception:
            self._col._internal_error("flop counter")
