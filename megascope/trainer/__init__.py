"""The bundled 3D-parallel trainer: a GPT trained on a ``pp x dp x tp`` mesh, every phase and
collective stamped by the collector, faults planted for real.

Role in the data flow: the trainer is a *writer* of run directories (through
``megascope.collectors``); ``megascope train`` launches it, ``sample_traces/`` is made with it.

Modules: ``config`` (validated settings), ``parallel`` (process groups), ``tp`` (tensor + sequence
parallel layers), ``model`` (the GPT stage), ``pipeline`` (1F1B), ``zero`` (ZeRO-1 data parallel,
AdamW / LAMB), ``data`` (synthetic language, token files), ``faults`` (straggler, hang, skew),
``flops`` (MFU inputs), ``loop`` (one rank), ``launch`` (N local ranks or torchrun).

Example::

    from megascope.trainer import ModelConfig, TrainConfig, train
    cfg = TrainConfig(out=Path("runs/a"), world_size=8, tp=2, pp=2, dp=2, steps=5, global_batch=16)
    train(cfg, nproc=8).losses
"""

from typing import TYPE_CHECKING, Any

from megascope.trainer.config import ModelConfig, TrainConfig, TrainingError

if TYPE_CHECKING:
    from megascope.trainer.launch import TrainResult, train

__all__ = ["ModelConfig", "TrainConfig", "TrainResult", "TrainingError", "train"]


def __getattr__(name: str) -> Any:
    """``train`` and ``TrainResult`` import torch: only when asked for, so that ``megascope train``
    checks its arguments and output directory (``trainer.config``) without it."""
    if name in ("TrainResult", "train"):
        from megascope.trainer import launch

        return getattr(launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
