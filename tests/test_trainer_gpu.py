"""The bundled trainer on CUDA (NCCL, bf16 autocast): run on the GPU machine with ``-m gpu``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megascope.store import open_run
from megascope.trainer import ModelConfig, TrainConfig, train

pytestmark = pytest.mark.gpu

MODEL = ModelConfig(layers=4, hidden=256, heads=8, vocab=1024, seq_len=256)


def _cfg(out: Path, tp: int = 1, pp: int = 1, dp: int = 1) -> TrainConfig:
    return TrainConfig(out=out, world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp, steps=8, global_batch=16,
                       micro_batches=2, model=MODEL, device="cuda", collective_timeout_s=120.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_gpu_learns_and_records_device_time(tmp_path: Path) -> None:
    result = train(_cfg(tmp_path / "run"), nproc=1)
    assert result.losses[-1] < result.losses[0]
    run = open_run(result.out)
    assert run.meta.device_name and "cpu" not in run.meta.device_name
    assert run.meta.config["dtype"] == "bf16-autocast"
    steps = run.con.execute("SELECT count(*) FROM spans WHERE kind = 'step'").fetchone()
    assert steps == (8,)
    assert run.con.execute("SELECT count(*) FROM metrics WHERE name = 'loss'").fetchone() == (8,)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(("tp", "pp", "dp"), [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=str)
def test_two_gpu_layouts_match_one_gpu(tmp_path: Path, tp: int, pp: int, dp: int) -> None:
    """bf16 autocast rounds differently per layout: agreement within 2% over 8 steps."""
    ref = train(_cfg(tmp_path / "ref"), nproc=1).losses
    got = train(_cfg(tmp_path / "run", tp, pp, dp), nproc=2).losses
    assert got == pytest.approx(ref, rel=2e-2)
