"""Planted faults, done for real: a straggler computes more, a hung rank stops, a skewed rank pauses.

Role in the data flow: ``loop.py`` builds one :class:`FaultPlan` per rank from the ``--inject``
specs (grammar in :mod:`megascope.inject`); the run directory then records the fault the way a
real incident would look, for the analyses to find.

* ``straggler:rank=R,factor=F[,mode=time|flops]``: each micro-batch's forward and backward on
  rank R take longer, inside their spans, with no communication.

  ``mode=time`` (the default) stretches the phase to F times its own duration, as a slow or
  throttled device is slow whatever the work: on GPU the stream runs ``torch.cuda._sleep`` for
  ``F-1`` times the phase's device time (measured with events from earlier micro-batches of the
  same phase, no synchronisation; cycles per nanosecond calibrated once at start), so host-bound
  and device-bound runs slow alike; on CPU the rank keeps multiplying the stage's weights for
  ``F-1`` times the phase's measured wall time.

  ``mode=flops`` adds ``F-1`` (``2(F-1)``) forward passes' worth of the stage's GEMMs (attention and
  element-wise work are not repeated, so the factor is approximate). On a host-bound GPU run that
  work fills idle device time and may slow nothing: a FLOP straggler, not a slow device.
* ``hang:rank=R,step=S``: rank R blocks before its next communication call in step S (a wait that
  never returns) while its collector's writer thread keeps flushing the markers written so far. The
  other ranks then block in collectives that time out after ``--collective-timeout`` seconds.
* ``freeze:rank=R,step=S``: rank R stops before its next communication call in step S inside a C
  call that keeps the interpreter lock (``sleep`` from the C library through ``ctypes.PyDLL``), as a
  rank stuck in a driver or a C extension does: every Python thread of the process stops with it,
  the collector's writer and heartbeats included. Nothing is flushed first: what reaches the disk
  is what the collector got out of the process on its own (the marker agent, faulthandler).
* ``crash:rank=R,step=S``: rank R raises :class:`PlantedCrash` (a RuntimeError) before its next
  communication call in step S, inside the step: the collector records how the step ended, the
  launcher reports the rank's message, and its peers fail or time out waiting for it.
* ``kill:rank=R,step=S``: rank R sends itself SIGKILL before its next communication call in step
  S: no exception, no flush, as a rank the OOM killer or a lost node ends. What reaches the disk
  is what was flushed before and the marker agent's last pass.
* ``skew:rank=R,ms=M``: a host sleep of M ms just before the rank starts its data-parallel
  gradient sync. That sync begins inside the step's last backward (bucket by bucket), so the
  pause comes right before that backward, outside every span (like a GC pause, nothing labels it);
  the rank arrives M ms late at its dp reduce-scatters and its TP peers wait for it.

Example::

    plan = FaultPlan(faults, rank=3, collector=col)
    plan.set_step(step); plan.gate()        # blocks forever on the hung rank's step
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from megascope.inject import Faults

log = logging.getLogger(__name__)


class FaultPlan:
    def __init__(self, faults: Faults, *, rank: int, collector: Any) -> None:
        self.rank = rank
        self.col = collector
        self.factor = faults.straggler_factor(rank)
        self.mode = faults.straggler_mode(rank)
        self.hang_step = faults.hang_step(rank, ("hang",))
        self.freeze_step = faults.hang_step(rank, ("freeze",))
        self.crash_step = faults.hang_step(rank, ("crash",))
        self.kill_step = faults.hang_step(rank, ("kill",))
        self.skew_s = faults.skew_ms(rank) / 1000.0
        self.step: int | None = None
        self._burner: Callable[[str, float], None] | None = None

    def set_step(self, step: int) -> None:
        self.step = step

    def gate(self) -> None:
        """Runs before every communication call."""
        if self.hang_step is not None and self.step == self.hang_step:
            log.info("rank %d: planted hang before a collective in step %d", self.rank, self.step)
            try:
                self.col.flush()
            except Exception:  # the hang must happen whatever the collector does
                log.exception("flush before the planted hang failed")
            while True:  # the markers written so far stay; the collector's thread keeps flushing
                time.sleep(1.0)
        if self.freeze_step is not None and self.step == self.freeze_step:
            log.info("rank %d: planted freeze before a collective in step %d", self.rank, self.step)
            freeze()
        if self.crash_step is not None and self.step == self.crash_step:
            raise PlantedCrash(f"planted crash on rank {self.rank} in step {self.step}")
        if self.kill_step is not None and self.step == self.kill_step:
            log.info("rank %d: planted kill before a collective in step %d", self.rank, self.step)
            os.kill(os.getpid(), signal.SIGKILL)

    def before_dp_sync(self) -> None:
        if self.skew_s > 0:
            time.sleep(self.skew_s)

    def set_burner(self, burner: Callable[[str, float], None]) -> None:
        self._burner = burner

    def burn(self, phase: str, elapsed_s: float) -> None:
        if self._burner is not None:
            self._burner(phase, elapsed_s)

    def begin(self, phase: str) -> None:
        """Runs as a phase starts (the device stretch records an event there)."""
        begin = getattr(self._burner, "begin", None)
        if begin is not None:
            begin(phase)


class PlantedCrash(RuntimeError):
    """What ``crash:rank=R,step=S`` raises: an exception of the rank's own, as a failing step's."""


def freeze() -> None:
    """Never return, holding the interpreter lock: ``PyDLL`` keeps it across the C call.

    Signals are blocked on this thread first: a signal would cut ``sleep`` short and run Python
    handlers (the collector's SIGTERM flush), which a rank stuck in a driver call never does.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    libc = ctypes.PyDLL(None)
    libc.sleep.argtypes = [ctypes.c_uint]
    while True:
        libc.sleep(3600)


class Burner:
    """Extra GEMMs over the stage's weights, sized by FLOPs (``timed=False``) or by time (``timed=True``)."""

    def __init__(self, weights: list[torch.Tensor], *, tokens: int, factor: float, autocast: Callable[[], Any],
                 timed: bool = False) -> None:
        self.weights = [w.detach() for w in weights]
        self.factor = factor
        self.autocast = autocast
        self.timed = timed
        device = self.weights[0].device
        gen = torch.Generator(device="cpu").manual_seed(1234)
        # One scratch input per distinct input width, shaped like the real full-sequence activation.
        self.inputs = {w.shape[1]: torch.randn(tokens, w.shape[1], generator=gen).to(device) for w in self.weights}
        self.tokens = tokens
        self.sink: torch.Tensor | None = None

    def __call__(self, phase: str, elapsed_s: float = 0.0) -> None:
        """Extra work after ``phase`` ("forward" or "backward"), which itself took ``elapsed_s``."""
        if self.timed:
            deadline = time.perf_counter() + (self.factor - 1.0) * elapsed_s
            with torch.no_grad(), self.autocast():
                while time.perf_counter() < deadline:
                    self._pass(self.tokens)
            return
        units = (self.factor - 1.0) * (2.0 if phase == "backward" else 1.0)
        if units <= 0:
            return
        whole = math.floor(units)
        partial = int(round((units - whole) * self.tokens))
        with torch.no_grad(), self.autocast():
            for _ in range(whole):
                self._pass(self.tokens)
            if partial:
                self._pass(partial)

    def _pass(self, rows: int) -> None:
        for w in self.weights:
            self.sink = self.inputs[w.shape[1]][:rows] @ w.t()  # kept so the work is not optimised away


def sleep_cycles_per_ns(device: torch.device) -> float:
    """GPU clock cycles per nanosecond of ``torch.cuda._sleep``, measured once (one synchronise, at setup)."""
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        torch.cuda._sleep(1_000_000)  # warm-up
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    return cycles / max(start.elapsed_time(end) * 1e6, 1.0)


class DeviceStretch:
    """A slow GPU: after each phase the stream sleeps ``factor-1`` times the phase's device time.

    The phase's device time comes from event pairs of its earlier micro-batches, read when they have
    completed (``query()``, never a synchronise); until the first pair completes, the phase's host
    time stands in. The end event is recorded before the sleep, so estimates never include it.
    """

    def __init__(self, factor: float, device: torch.device) -> None:
        self.factor = factor
        self.cycles_per_ns = sleep_cycles_per_ns(device)
        self._open: dict[str, torch.cuda.Event] = {}
        self._pending: deque[tuple[str, torch.cuda.Event, torch.cuda.Event]] = deque()
        self._device_ns: dict[str, float] = {}

    def begin(self, phase: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._open[phase] = event

    def __call__(self, phase: str, elapsed_s: float = 0.0) -> None:
        start = self._open.pop(phase, None)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((phase, start, end))
        while self._pending and self._pending[0][2].query():
            done, s, e = self._pending.popleft()
            self._device_ns[done] = s.elapsed_time(e) * 1e6
        ns = self._device_ns.get(phase, elapsed_s * 1e9)
        cycles = int((self.factor - 1.0) * ns * self.cycles_per_ns)
        if cycles > 0:
            torch.cuda._sleep(cycles)
