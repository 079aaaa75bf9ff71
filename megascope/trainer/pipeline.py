"""The 1F1B pipeline schedule over micro-batches, with paired asynchronous send/receive.

Role in the data flow: ``loop.py`` calls :func:`run_1f1b` once per step. Each micro-batch's
forward and backward on this stage is a collector span (``forward`` / ``backward`` with its
micro-batch index); each activation or gradient exchange is a pair of ``isend``/``irecv`` stamped
as ``send``/``recv`` spans on the pp group.

Written by hand rather than with ``torch.distributed.pipelining``: the schedule is ~80 lines, gives
the collector a direct span per micro-batch phase and per transfer, and needs no metadata-inference
forward on the first step. Blocking ``send``/``recv`` pairs deadlock on gloo, so every transfer
posts both directions first and then waits (as Megatron's ``send_forward_recv_backward`` does).
Sends are asynchronous: the stage waits only for what it receives and goes on computing while its
sends drain; they are waited on at the end of the schedule (:meth:`StageIO.drain`). With
``overlap=False`` every send is waited on where it is posted (the "before" of the overlap measurement).

Schedule per stage ``p`` of ``P`` with ``M`` micro-batches: ``min(P-p-1, M)`` warm-up forwards, then
one-forward-one-backward until every forward is done, then the remaining backwards.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megascope.schema import SpanKind
from megascope.trainer.instrument import Comm
from megascope.trainer.model import GPTStage


@dataclass
class StageIO:
    """What this stage exchanges with its neighbours."""

    comm: Comm | None
    pg: Any
    prev: int | None  # global rank of the previous stage (None on the first)
    next: int | None  # global rank of the next stage (None on the last)
    shape: tuple[int, ...]  # the hidden state crossing a stage boundary: [seq/tp, micro_batch, hidden]
    device: torch.device
    overlap: bool = True  # leave sends in flight until drain()
    _in_flight: list[tuple[Any, torch.Tensor]] = field(default_factory=list)

    def _buf(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=torch.float32, device=self.device)

    def _exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
        if sends or recvs:
            assert self.comm is not None
            works = self.comm.exchange(sends, recvs, self.pg, wait_sends=not self.overlap)
            if works:  # keep each sent tensor alive until its send is waited on
                self._in_flight.extend(zip(works, (t for t, _ in sends), strict=True))

    def drain(self) -> None:
        """Wait for every send still in flight."""
        for work, _ in self._in_flight:
            assert self.comm is not None
            self.comm.wait(work)
        self._in_flight.clear()

    def recv_forward(self) -> torch.Tensor | None:
        if self.prev is None:
            return None
        buf = self._buf()
        self._exchange([], [(buf, self.prev)])
        return buf.requires_grad_()

    def send_forward(self, y: torch.Tensor) -> None:
        if self.next is not None:
            self._exchange([(y.detach(), self.next)], [])

    def send_forward_recv_backward(self, y: torch.Tensor) -> torch.Tensor | None:
        if self.next is None:
            return None
        grad = self._buf()
        self._exchange([(y.detach(), self.next)], [(grad, self.next)])
        return grad

    def send_backward(self, g: torch.Tensor | None) -> None:
        if self.prev is not None and g is not None:
            self._exchange([(g, self.prev)], [])

    def send_backward_recv_forward(self, g: torch.Tensor | None) -> torch.Tensor | None:
        if self.prev is None:
            return None
        buf = self._buf()
        assert g is not None
        self._exchange([(g, self.prev)], [(buf, self.prev)])
        return buf.requires_grad_()

    def recv_backward(self) -> torch.Tensor | None:
        if self.next is None:
            return None
        grad = self._buf()
        self._exchange([], [(grad, self.next)])
        return grad


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [s, b]
    targets: torch.Tensor  # [s, b]


def run_1f1b(stage: GPTStage, io: StageIO, batches: list[MicroBatch], *, stage_index: int, stages: int,
             collector: Any, loss_scale: float, before_last_backward: Callable[[], None],
             autocast: Callable[[], Any], burn: Callable[[str, float], None],
             burn_begin: Callable[[str], None] = lambda phase: None) -> torch.Tensor | None:
    """Forward and backward every micro-batch on this stage; returns the summed scaled loss on the
    last stage (a tensor, no host sync), else None.

    ``before_last_backward`` arms the gradient sync; ``burn(phase, seconds)`` is the straggler's extra
    work (host time is read only for it and costs no device sync); ``burn_begin(phase)`` runs as
    the phase starts.
    """
    m = len(batches)
    warmup = min(stages - stage_index - 1, m)
    pending: deque[tuple[int, torch.Tensor | None, torch.Tensor]] = deque()
    losses: list[torch.Tensor] = []
    next_fwd = 0
    next_bwd = 0

    def forward(inp: torch.Tensor | None) -> torch.Tensor:
        nonlocal next_fwd
        i = next_fwd
        next_fwd += 1
        with collector.span("forward", kind=SpanKind.FORWARD, microbatch=i), autocast():
            burn_begin("forward")
            t0 = time.perf_counter()
            mb = batches[i]
            out = stage(mb.tokens if inp is None else inp, targets=mb.targets)
            if stage.last:
                out = out.float().mean() * loss_scale
                losses.append(out.detach())
            burn("forward", time.perf_counter() - t0)
        pending.append((i, inp, out))
        return out

    def backward(grad: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal next_bwd
        i, inp, out = pending.popleft()
        next_bwd += 1
        if next_bwd == m:
            before_last_backward()
        with collector.span("backward", kind=SpanKind.BACKWARD, microbatch=i):
            burn_begin("backward")
            t0 = time.perf_counter()
            torch.autograd.backward(out, grad_tensors=None if grad is None else grad)
            burn("backward", time.perf_counter() - t0)
        return None if inp is None else inp.grad

    for _ in range(warmup):
        io.send_forward(forward(io.recv_forward()))
    inp = io.recv_forward() if m > warmup else None
    steady = m - warmup
    for k in range(steady):
        grad = io.send_forward_recv_backward(forward(inp))
        in_grad = backward(grad)
        if k == steady - 1:
            io.send_backward(in_grad)
            inp = None
        else:
            inp = io.send_backward_recv_forward(in_grad)
    for _ in range(warmup):
        io.send_backward(backward(io.recv_backward()))
    io.drain()
    return torch.stack(losses).sum() if losses else None
