"""Megatron-style tensor parallelism with sequence parallelism, written by hand.

Role in the data flow: the model (``model.py``) builds its linears, embedding and loss from these
pieces; every TP collective they issue goes through :class:`~megascope.trainer.instrument.Comm`, so
the collector stamps each one at its call site with group, sequence number, bytes and arrival.
DTensor's ``parallelize_module`` would compute the same thing, but its functional collectives are
invisible to a call-site hook on gloo (no flight-recorder times, no profiler comm events) and cost
twice the CPU time at small sizes; hence hand-written.

Activations are laid out ``[seq, batch, hidden]`` so that splitting or gathering the sequence is a
split of dim 0, i.e. a flat contiguous buffer for gloo and NCCL alike.

* Sequence parallel (default): between blocks each TP rank holds ``seq/tp`` positions. Entering a
  TP region all-gathers the sequence (backward: reduce-scatter); leaving it reduce-scatters the
  partial sums (backward: all-gather).
* Without sequence parallelism: entering is identity (backward: all-reduce) and leaving is an
  all-reduce (backward: identity): Megatron's ``f`` and ``g``.

Parameters replicated across TP ranks (norms, position embedding) see only their sequence shard
under SP; their gradients are summed over the TP group before the data-parallel sync (``zero.py``).

Entering a TP region and the column-parallel GEMMs that read the entered input are one autograd
function (:meth:`TPContext.column_in`), which is where communication overlaps compute:

* the input is cast to the autocast dtype *before* it is gathered (bf16 on the wire, not fp32), and
  cast once for every GEMM that reads it (the parallel block's qkv and fc1 share one cast);
* forward (SP): the all-gather runs asynchronously while the GEMMs multiply the rows this rank
  already holds; the other rows follow once the gather lands;
* backward: the input gradient (``dY1 W1 + dY2 W2``, one output) is reduce-scattered (SP) or
  all-reduced asynchronously while the weight-gradient GEMMs run (Megatron's overlap of the
  input-gradient collective with the weight gradient).

``overlap=False`` waits for each collective where it is issued: the "before" of the overlap
measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megascope.trainer.instrument import Comm


@dataclass
class TPContext:
    """The TP group as the model sees it."""

    comm: Comm | None
    pg: Any
    size: int
    index: int
    sequence_parallel: bool
    overlap: bool = True  # overlap TP collectives with GEMMs inside column_in

    @property
    def active(self) -> bool:
        return self.size > 1

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a column-parallel region: every rank needs the whole (replicated) input."""
        if not self.active:
            return x
        return (_GatherSeq if self.sequence_parallel else _CopyToTP).apply(x, self)

    def exit(self, x: torch.Tensor) -> torch.Tensor:
        """Out of a row-parallel region: sum the partial outputs (and keep my sequence shard under SP)."""
        if not self.active:
            return x
        return (_ScatterSeq if self.sequence_parallel else _ReduceFromTP).apply(x, self)

    def column_in(self, x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tp.enter(x)`` followed by ``F.linear(., w)`` for each column-parallel ``w``, as one op that
        overlaps its communication with the GEMMs (see the module docstring). Outputs are in the
        autocast dtype when autocast is on, like ``F.linear``'s."""
        return list(_ColumnIn.apply(x, self, *weights))

    def local_seq(self, seq_len: int) -> slice:
        """The positions this rank holds between blocks."""
        if not (self.active and self.sequence_parallel):
            return slice(0, seq_len)
        n = seq_len // self.size
        return slice(self.index * n, (self.index + 1) * n)

    def _comm(self) -> Comm:
        assert self.comm is not None, "TP collective without a communicator"
        return self.comm


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return tp._comm().all_gather_seq(x, tp.pg, tp.size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        tp: TPContext = ctx.tp
        return tp._comm().reduce_scatter_seq(grad, tp.pg, tp.size), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return tp._comm().reduce_scatter_seq(x, tp.pg, tp.size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        tp: TPContext = ctx.tp
        return tp._comm().all_gather_seq(grad, tp.pg, tp.size), None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _mm_into(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> None:
    """``out = a @ w.T`` over the leading dims, written in place (``out`` contiguous)."""
    torch.mm(a.reshape(-1, a.shape[-1]), w.t(), out=out.view(-1, out.shape[-1]))


class _ColumnIn(torch.autograd.Function):
    """Enter the TP region (gather / copy) and apply column-parallel weights, overlapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cdt = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            xc = x.to(cdt).contiguous()
            ws = [w.to(cdt) for w in weights]
            gather = tp.active and tp.sequence_parallel
            rows = xc.shape[0]
            full_rows = rows * tp.size if gather else rows
            outs = [torch.empty((full_rows, *xc.shape[1:-1], w.shape[0]), dtype=cdt, device=x.device) for w in ws]
            if gather:
                full = torch.empty((full_rows, *xc.shape[1:]), dtype=cdt, device=x.device)
                work = tp._comm().all_gather_async(full, xc, tp.pg)
                if not tp.overlap:
                    work.wait()
                mine = slice(tp.index * rows, (tp.index + 1) * rows)
                for out, w in zip(outs, ws, strict=True):
                    _mm_into(out[mine], xc, w)  # rows already here, while the gather runs
                if tp.overlap:
                    work.wait()
                for part in (slice(0, mine.start), slice(mine.stop, full_rows)):
                    if part.stop > part.start:
                        for out, w in zip(outs, ws, strict=True):
                            _mm_into(out[part], full[part], w)
            else:
                full = xc
                for out, w in zip(outs, ws, strict=True):
                    _mm_into(out, xc, w)
        ctx.tp = tp
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(full, *ws)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        tp: TPContext = ctx.tp
        full, *ws = ctx.saved_tensors
        with torch.autocast(full.device.type, enabled=False):
            gs = [None if g is None else g.to(full.dtype).reshape(-1, g.shape[-1]) for g in grads]
            dx: torch.Tensor | None = None
            for g, w in zip(gs, ws, strict=True):
                if g is not None:
                    dx = torch.mm(g, w) if dx is None else torch.addmm(dx, g, w, out=dx)
            assert dx is not None, "no gradient reached a column-parallel input"
            dx = dx.view(full.shape)
            out, work = dx, None
            if tp.active:
                if tp.sequence_parallel:
                    out = torch.empty((full.shape[0] // tp.size, *full.shape[1:]), dtype=dx.dtype, device=dx.device)
                    work = tp._comm().reduce_scatter_async(out, dx, tp.pg)
                else:
                    work = tp._comm().all_reduce_async(dx, tp.pg)
                if not tp.overlap:
                    work.wait()
            # The weight gradients run while the input gradient's collective is in flight.
            flat_in = full.reshape(-1, full.shape[-1])
            dws = [None if g is None else torch.mm(g.t(), flat_in) for g in gs]
            if work is not None and tp.overlap:
                work.wait()
        return (out.to(ctx.x_dtype), None, *dws)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        tp: TPContext = ctx.tp
        return tp._comm().all_reduce(grad.contiguous(), tp.pg), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        return tp._comm().all_reduce(x.contiguous().clone(), tp.pg)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ColumnParallelLinear(nn.Module):
    """``y = x W^T`` with W's output rows split over TP ranks (no bias, no communication)."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, *, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features, device=device))
        self.weight.tp_split_dim = 0  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """``y = x W^T`` with W's input columns split over TP ranks: each rank yields a partial sum."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, *, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size, device=device))
        self.weight.tp_split_dim = 1  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over TP ranks; returns partial sums (zero rows for
    tokens another rank owns), to be summed by ``tp.exit``."""

    def __init__(self, vocab: int, hidden: int, tp: TPContext, *, device: torch.device) -> None:
        super().__init__()
        self.part = vocab // tp.size
        self.start = tp.index * self.part
        self.weight = nn.Parameter(torch.empty(self.part, hidden, device=device))
        self.weight.tp_split_dim = 0  # type: ignore[attr-defined]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.part)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits whose vocabulary is split across TP ranks: three small all-reduces
    (max, sum of exponentials, target logit) instead of gathering ``[tokens, vocab]``."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, tp: TPContext, start: int) -> torch.Tensor:
        logits = logits.float()
        part = logits.shape[-1]
        logits_max = logits.max(dim=-1).values
        if tp.active:
            tp._comm().all_reduce(logits_max, tp.pg, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        local = target - start
        outside = (local < 0) | (local >= part)
        local = local.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if tp.active:
            both = torch.stack([sum_exp, target_logit])
            tp._comm().all_reduce(both, tp.pg)
            sum_exp, target_logit = both[0], both[1]
        loss = sum_exp.log() - target_logit
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        hit = (~outside).to(grad_logits.dtype)
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: TPContext, start: int) -> torch.Tensor:
    """Per-token loss (same shape as ``target``) from this rank's vocabulary slice of the logits."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp, start)
