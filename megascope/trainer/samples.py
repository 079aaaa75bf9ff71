"""Regenerate ``sample_traces/``: small real runs of the bundled trainer, healthy and with one
planted fault each, plus the README that says what is planted where.

Role in the data flow: the sample run directories are what the docs, the dashboard demo and new
users open first; they are made by this trainer on CPU (8 gloo ranks, a 2x2x2 mesh), so every span
in them was really measured.

Usage::

    python -m megascope.trainer.samples [OUT_DIR]      # default: ./sample_traces
"""

from __future__ import annotations

import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from megascope.inject import parse_injects
from megascope.topology import Mesh
from megascope.trainer.config import ModelConfig, TrainConfig, TrainingError
from megascope.trainer.launch import train

log = logging.getLogger(__name__)

MODEL = ModelConfig(layers=4, hidden=64, heads=4, vocab=256, seq_len=64)
MESH = {"tp": 2, "pp": 2, "dp": 2}
STEPS = 8


@dataclass(frozen=True)
class Sample:
    name: str
    inject: tuple[str, ...]
    what: str


SAMPLES = (
    Sample("healthy", (), "nothing planted"),
    Sample("straggler", ("straggler:rank=5,factor=3",),
           "rank 5 computes 3x longer in every forward and backward (real extra matmuls)"),
    Sample("hang", ("hang:rank=6,step=4",),
           "rank 6 stops before its first collective of step 4; the others time out after 5 s and the job fails"),
    Sample("skew", ("skew:rank=3,ms=150",),
           "rank 3 pauses 150 ms on the host before every data-parallel gradient sync"),
)


def sample_config(sample: Sample, out: Path) -> TrainConfig:
    return TrainConfig(out=out, world_size=8, steps=STEPS, seed=0, global_batch=16, micro_batches=4, model=MODEL,
                       faults=parse_injects(sample.inject), collective_timeout_s=5.0, flush_interval_s=2.0,
                       bucket_mb=0.05, tp=MESH["tp"], pp=MESH["pp"], dp=MESH["dp"])


def readme() -> str:
    mesh = Mesh.from_mapping(MESH)
    lines = [
        "# Sample traces",
        "",
        "Real runs of the bundled trainer (`megascope train`) on a 2-core CPU machine: 8 gloo ranks on a",
        f"pp={MESH['pp']} x dp={MESH['dp']} x tp={MESH['tp']} mesh, a {MODEL.layers}-layer GPT (hidden {MODEL.hidden}, "
        f"{MODEL.heads} heads, vocabulary {MODEL.vocab}, sequence {MODEL.seq_len}), global batch 16 in 4 micro-batches "
        f"per data-parallel rank, {STEPS} steps, seed 0, fp32. Timings are what that shared machine measured;",
        "8 processes on 2 cores make every collective cost milliseconds, so read them relative to each other.",
        "",
        "Regenerate with `python -m megascope.trainer.samples sample_traces`.",
        "",
        "| run | planted | where in the mesh |",
        "|---|---|---|",
    ]
    for sample in SAMPLES:
        where = "-"
        if sample.inject:
            rank = parse_injects(sample.inject).faults[0].rank
            where = f"rank {rank}: {mesh.describe(rank)}"
        spec = ", ".join(f"`--inject {s}`" for s in sample.inject) or "-"
        lines.append(f"| `{sample.name}/` | {sample.what} ({spec}) | {where} |")
    lines += [
        "",
        "Rank layout: tp varies fastest, then dp, then pp (rank = pp*4 + dp*2 + tp); the `ranks` table of",
        "each run holds every rank's coordinates. In `hang/`, the job ended with a collective timeout, so",
        "the last steps are missing and rank 6's markers stop at its last completed collective.",
        "",
    ]
    return "\n".join(lines)


def make_samples(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for sample in SAMPLES:
        run = out_dir / sample.name
        if run.exists():
            shutil.rmtree(run)
        try:
            train(sample_config(sample, run), nproc=8)
        except TrainingError as exc:
            if not any(s.startswith("hang:") for s in sample.inject):
                raise
            log.info("%s: failed as planted: %s", sample.name, exc)
        written.append(run)
    (out_dir / "README.md").write_text(readme())
    return written


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("sample_traces")
    for path in make_samples(target):
        log.info("wrote %s", path)
