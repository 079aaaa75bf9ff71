"""What other tools need from the bundled trainer, so that they judge the same runs as megascope.

- ``--profile N``: PyTorch-profiler (Kineto) traces of the last N steps, one file per rank under
  ``RUN/profiler/``, the traces Holistic Trace Analysis reads and ``megascope ingest`` imports.
  The last steps, with one warm-up step before them: the profiler's start costs the warm-up step,
  and its stop (collecting the events) and the writing of the trace come when the block ends,
  after the last step's span, so no measured step pauses for them on one rank and not another.
  The trainer waits for its last collectives inside the block: a call still in flight when the
  profiler stops would end its recorded event after the profiler's state is gone.
- ``--nvrx-straggler``: NVIDIA's straggler detector (the ``nvidia-resiliency-ext`` package) in the
  job. Each step runs inside its detection section; after its last step every rank joins its
  report and rank 0 writes the scores and the ranks it names to ``RUN/nvrx_straggler.json``. Its
  GPU score compares each kernel's median time with the fastest rank's, over kernels that every
  rank ran and leaving out NCCL's; the section score compares the step's host wall time. With
  ``--profile`` it times the steps before the profiler's (:func:`nvrx_steps`).

Neither is imported unless asked for. Example::

    with step_profiler(3, cfg.steps, out, rank=0, device=device) as profiled, \\
            nvrx_detector(True, out, rank=0, until=nvrx_steps(cfg.steps, 3)) as nvrx:
        for step in range(cfg.steps):
            with nvrx.section(step):
                ...
            nvrx.after_step(step)
            profiled(step)
        wait_for_collectives_in_flight()
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

PROFILER_DIR = "profiler"
NVRX_REPORT = "nvrx_straggler.json"
# identify_stragglers' default bars: a rank scoring under 0.75 of the best (1.33x slower) is named.
NVRX_THRESHOLD = 0.75


def profile_path(out: Path, rank: int) -> Path:
    return out / PROFILER_DIR / f"rank{rank:05d}.pt.trace.json.gz"


@contextlib.contextmanager
def step_profiler(last: int, steps: int, out: Path, *, rank: int,
                  device: torch.device) -> Iterator[Callable[[int], None]]:
    """Profile the last ``last`` steps of ``steps`` (0: nothing); yields the call to make after
    each step, with the step. The profiler stops and writes the trace when the block ends."""
    if last <= 0:
        yield lambda step: None
        return
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    first = steps - last
    warmup = 1 if first > 0 else 0
    path = profile_path(out, rank)

    def write(prof: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))

    with profile(activities=activities, schedule=schedule(wait=first - warmup, warmup=warmup, active=last, repeat=1),
                 on_trace_ready=write) as prof:
        # Not after the last step: the window then closes with the block (profile.__exit__).
        yield lambda step: prof.step() if step < steps - 1 else None


class _Nvrx:
    """NVIDIA's detector in a job: each step up to ``until`` in its detection section, then its
    report (a collective: every rank at the same step) and its shutdown."""

    def __init__(self, out: Path, rank: int, until: int) -> None:
        from nvidia_resiliency_ext import straggler  # type: ignore[import-not-found]

        self.detector, self.out, self.rank, self.until = straggler.Detector, out, rank, until
        # Reports are made once, at the end of its steps: no reporting interval inside the run.
        self.detector.initialize(scores_to_compute="all", gather_on_rank0=True, profiling_interval=1,
                                 report_time_interval=1e9)
        self.active = True

    def section(self, step: int) -> contextlib.AbstractContextManager[Any]:
        if not self.active or step >= self.until:
            return contextlib.nullcontext()
        return self.detector.detection_section("step", profile_cuda=True)

    def after_step(self, step: int) -> None:
        if self.active and step == self.until - 1:
            report = self.detector.generate_report()
            if self.rank == 0:
                (self.out / NVRX_REPORT).write_text(json.dumps(nvrx_summary(report), indent=1) + "\n")
            self.close()

    def close(self) -> None:
        if self.active:
            self.active = False
            self.detector.shutdown()


class _Off:
    def section(self, step: int) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def after_step(self, step: int) -> None:
        return None


@contextlib.contextmanager
def nvrx_detector(enabled: bool, out: Path, *, rank: int, until: int) -> Iterator[_Nvrx | _Off]:
    """NVIDIA's straggler detector around steps ``0 .. until-1`` (``enabled``); yields what the loop
    calls: ``section(step)`` around each step, ``after_step(step)`` after it.

    Its timing and the profiler's must not overlap: it reads kernel times through CUDA 12's CUPTI
    and the profiler through the one torch was built with, and while it holds the device's activity
    records the profiler's traces come out without a kernel. So with ``--profile`` it stops (report
    and shutdown) before the profiler's warm-up step: :func:`nvrx_steps`."""
    if not enabled:
        yield _Off()
        return
    nvrx = _Nvrx(out, rank, until)
    try:
        yield nvrx
    finally:
        nvrx.close()


def nvrx_steps(steps: int, profile_steps: int) -> int:
    """The steps NVIDIA's detector times: all, or those before the profiler's warm-up step."""
    return steps - profile_steps - 1 if profile_steps else steps


def nvrx_summary(report: Any) -> dict[str, Any]:
    """The detector's report as JSON: every score by rank, and the ranks it names at its default bars."""
    named = report.identify_stragglers(gpu_rel_threshold=NVRX_THRESHOLD, section_rel_threshold=NVRX_THRESHOLD,
                                       gpu_indiv_threshold=NVRX_THRESHOLD, section_indiv_threshold=NVRX_THRESHOLD)

    def ranks(ids: Any) -> list[int]:
        return sorted(int(s.rank) for s in ids)

    def scores(m: Any) -> dict[str, float]:
        return {str(int(r)): float(v) for r, v in sorted(m.items())}

    return {
        "threshold": NVRX_THRESHOLD,
        "gpu_relative": scores(report.gpu_relative_perf_scores),
        "gpu_individual": scores(report.gpu_individual_perf_scores),
        "section_relative": {s: scores(v) for s, v in report.section_relative_perf_scores.items()},
        "section_individual": {s: scores(v) for s, v in report.section_individual_perf_scores.items()},
        "named": {
            "gpu_relative": ranks(named["straggler_gpus_relative"]),
            "gpu_individual": ranks(named["straggler_gpus_individual"]),
            "section_relative": {s: ranks(v) for s, v in named["straggler_sections_relative"].items()},
            "section_individual": {s: ranks(v) for s, v in named["straggler_sections_individual"].items()},
        },
    }
