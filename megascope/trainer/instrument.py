"""The trainer's view of the collector, plus the fault gate every collective passes through.

Role in the data flow: every span, collective and metric of the trainer goes through
``megascope.collectors`` (the in-job hook that writes the run directory). This module opens that
collector for a rank and wraps its ``dist`` mirror in :class:`Comm`, which adds the two things the
trainer needs around each communication call: the hang fault (a rank stops before its next
collective) and the receive timeout gloo does not apply by itself to point-to-point waits.

Example::

    col = open_collector(cfg, rank=r, world_size=w, coords=..., groups=..., meta=meta)
    comm = Comm(col, gate=fault_gate)
    out = comm.all_gather_seq(x, tp)   # all-gather along dim 0, stamped as a tp collective
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Host, GPU and NIC heartbeats every 5 s (about 0.3 ms of a sampler thread per sample, measured in
# docs/benchmarks.md), so node health has data; MEGASCOPE_HEARTBEAT_S=0 turns them off.
HEARTBEAT_S = 5.0


def open_collector(run_dir: Any, *, rank: int, world_size: int, coords: dict[str, int],
                   groups: Sequence[Any], meta: Any, device: torch.device | None,
                   flush_interval_s: float, sampling: tuple[Sequence[str], int, int] = ((), 0, 0),
                   collective_timeout_s: float | None = None) -> Any:
    """The rank's collector (rank 0 writes ``run.json`` from ``meta``). ``sampling`` is
    (kinds, every, calls): communication on groups of these kinds is timed in one micro-batch in
    ``every``, rotating with the step (0: in the first micro-batch of each step only), and their
    step-level calls one in ``calls`` (0: all). A step still running at half the collective
    timeout gets every thread's stack dumped, before any abort."""
    from megascope.collectors import Collector, CollectorConfig

    kinds, every, calls = sampling
    stacks_after = max(1.0, collective_timeout_s / 2) if collective_timeout_s else 300.0
    cfg = CollectorConfig(run_dir=run_dir, flush_interval_s=flush_interval_s,
                          device=device if device is not None and device.type == "cuda" else None,
                          comm_sample_kinds=tuple(kinds), comm_sample_microbatches=(0,),
                          comm_sample_every=every, comm_sample_calls=calls,
                          heartbeat_interval_s=HEARTBEAT_S, stacks_after_s=stacks_after)
    return Collector(cfg, rank=rank, world_size=world_size, coords=coords, groups=list(groups), meta=meta)


def instrument_blocks(collector: Any, model: torch.nn.Module, names: list[str],
                      microbatches: set[int] | None = None) -> list[Any]:
    """Forward/backward spans per named submodule (the transformer blocks), in ``microbatches`` only
    when given."""
    from megascope.collectors import instrument_module

    return list(instrument_module(model, patterns=names, collector=collector, microbatches=microbatches) or [])


class Comm:
    """Collectives and point-to-point calls of the trainer, through the collector's ``dist`` mirror.

    ``gate`` runs before every communication call; the hang fault blocks there. Tensors are
    exchanged along dim 0 so every buffer stays flat for gloo (which rejects stacked outputs).
    """

    def __init__(self, collector: Any, *, gate: Callable[[], None] | None = None,
                 recv_timeout_s: float | None = None) -> None:
        self.col = collector
        self.dist = collector.dist
        self._gate = gate
        self._recv_timeout = timedelta(seconds=recv_timeout_s) if recv_timeout_s else None

    def gate(self) -> None:
        if self._gate is not None:
            self._gate()

    # --- collectives -----------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, pg: Any, *, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        self.gate()
        self.dist.all_reduce(t, group=pg, op=op)
        return t

    def all_gather_seq(self, t: torch.Tensor, pg: Any, size: int) -> torch.Tensor:
        """Concatenate every member's ``t`` along dim 0 (in group order)."""
        self.gate()
        t = t.contiguous()
        out = torch.empty((t.shape[0] * size, *t.shape[1:]), dtype=t.dtype, device=t.device)
        self.dist.all_gather_single(out, t, group=pg)
        return out

    def reduce_scatter_seq(self, t: torch.Tensor, pg: Any, size: int) -> torch.Tensor:
        """Sum over members, each keeping its 1/size slice of dim 0."""
        self.gate()
        t = t.contiguous()
        out = torch.empty((t.shape[0] // size, *t.shape[1:]), dtype=t.dtype, device=t.device)
        self.dist.reduce_scatter_single(out, t, group=pg, op=dist.ReduceOp.SUM)
        return out

    def reduce_scatter_async(self, out: torch.Tensor, inp: torch.Tensor, pg: Any) -> Any:
        self.gate()
        return self.dist.reduce_scatter_single(out, inp, group=pg, op=dist.ReduceOp.SUM, async_op=True)

    def all_gather_async(self, out: torch.Tensor, inp: torch.Tensor, pg: Any) -> Any:
        self.gate()
        return self.dist.all_gather_single(out, inp, group=pg, async_op=True)

    def all_reduce_async(self, t: torch.Tensor, pg: Any) -> Any:
        self.gate()
        return self.dist.all_reduce(t, group=pg, op=dist.ReduceOp.SUM, async_op=True)

    # --- point to point --------------------------------------------------------------------
    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
                 pg: Any, *, wait_sends: bool = True) -> list[Any]:
        """Post every send and receive at once, then wait for the receives (and the sends, unless
        ``wait_sends`` is False: then their works are returned, to be waited on later).

        Posting both directions before waiting is what keeps 1F1B deadlock-free when a send only
        completes once its receiver has posted the matching receive (gloo and NCCL alike).
        """
        if not sends and not recvs:
            return []
        self.gate()
        send_works = [self.dist.isend(t.contiguous(), dst, group=pg) for t, dst in sends]
        recv_works = [self.dist.irecv(t, src, group=pg) for t, src in recvs]
        for work in recv_works + (send_works if wait_sends else []):
            self.wait(work)
        return [] if wait_sends else send_works

    def wait(self, work: Any) -> None:
        """Wait for a point-to-point work, with the receive timeout where the backend has none."""
        if self._recv_timeout is not None and _accepts_timeout(work):
            work.wait(timeout=self._recv_timeout)
        else:
            work.wait()


def _accepts_timeout(work: Any) -> bool:
    # torch's Work.wait takes a timeout (its signature cannot be read: assumed), and so does the
    # collector's TimedWork; another wrapper may not, and then waits without one.
    try:
        import inspect

        return "timeout" in inspect.signature(work.wait).parameters
    except (TypeError, ValueError):
        return True
