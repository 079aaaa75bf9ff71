"""Data parallelism with a sharded optimizer (ZeRO-1): bucketed reduce-scatter during backward,
optimizer step on this rank's shard, all-gather of the updated parameters (left in flight: the
next step's forward waits for each bucket just before the first module that reads it).

Role in the data flow: ``loop.py`` builds one :class:`ShardedOptimizer` per rank. Each parameter's
``.grad`` is a view into a flat fp32 buffer cut into buckets, so autograd accumulates every
micro-batch's gradient straight into the bucket (no copy, no per-step gradient allocation; torch
DDP's ``gradient_as_bucket_view``). During the *last* micro-batch's backward, a
``post_accumulate_grad`` hook counts each bucket's parameters and reduce-scatters the bucket over the
dp group as soon as it is full, so the sync overlaps the rest of the backward pass (``overlap=False``
issues every bucket after the backward instead, the "before" of the overlap measurement).
Every reduce-scatter, all-gather and all-reduce goes through the collector (``dp:*``, ``tp:*``,
``world`` groups).

Written by hand (not FSDP2 / ``ZeroRedundancyOptimizer``): the buckets are explicit, so each
collective is stamped where it is issued, and the same code runs on gloo and NCCL. On gloo a
reduce-scatter is an all-reduce inside (dp times the traffic); fine for CPU tests, not for timing.

Each bucket's length is a multiple of dp; rank k of the dp group owns the k-th slice of every
bucket. Two buffers keep weight decay off norms (1-D parameters). Under sequence parallelism the
gradients of TP-replicated parameters are summed over the tp group before the dp sync. The global
gradient norm counts every logical element once (replicated parameters on tp rank 0 only) and
travels with the loss in one ``world`` all-reduce per step. It is one fused ``_foreach_norm`` over
the counted ranges (no temporaries the size of the model), and clipping rides on the fused AdamW
kernel's gradient scale instead of a separate pass over the gradients.

Optimizers: AdamW (fused ``torch.optim.AdamW`` on the flat shard on CUDA, the same update written
out on CPU) and LAMB (hand-written;
its per-parameter trust ratio needs the norms of whole parameters, summed over dp and tp shards).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megascope.schema import SpanKind
from megascope.trainer.instrument import Comm
from megascope.trainer.parallel import Axis

log = logging.getLogger(__name__)

ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8


@dataclass
class _Bucket:
    start: int
    end: int
    params: int  # how many parameters must report before the bucket is ready
    shard_start: int  # where this bucket's slice starts in a dp rank's shard of the buffer
    replicated: list[tuple[int, int]] = field(default_factory=list)  # TP-replicated (start, end) ranges
    ready: int = 0
    work: Any = None

    @property
    def size(self) -> int:
        return self.end - self.start


class FlatBuffer:
    """Parameters viewed into one flat fp32 buffer, their gradients accumulated into another."""

    def __init__(self, params: list[nn.Parameter], *, dp: int, bucket_elems: int, device: torch.device) -> None:
        self.params = params
        self.dp = dp
        self.buckets: list[_Bucket] = []
        self.offsets: dict[int, tuple[int, int]] = {}  # id(param) -> (offset, bucket index)
        offset = 0
        current: list[nn.Parameter] = []
        bucket_start = 0

        def close_bucket() -> None:
            nonlocal offset, bucket_start, current
            if not current:
                return
            pad = (-(offset - bucket_start)) % dp
            offset += pad
            shard_start = self.buckets[-1].shard_start + self.buckets[-1].size // dp if self.buckets else 0
            self.buckets.append(_Bucket(bucket_start, offset, len(current), shard_start))
            bucket_start = offset
            current = []

        for p in params:
            self.offsets[id(p)] = (offset, len(self.buckets))
            offset += p.numel()
            current.append(p)
            if offset - bucket_start >= bucket_elems:
                close_bucket()
        close_bucket()
        self.numel = offset
        self.param_flat = torch.zeros(offset, dtype=torch.float32, device=device)
        self.grad_flat = torch.zeros(offset, dtype=torch.float32, device=device)
        for p in params:
            start, b = self.offsets[id(p)]
            view = self.param_flat[start:start + p.numel()].view_as(p)
            view.copy_(p.data)
            p.data = view
            if getattr(p, "tp_replicated", False):
                self.buckets[b].replicated.append((start, start + p.numel()))
        self.attach_grads()

    def attach_grads(self) -> None:
        """Point every ``p.grad`` at its slice of ``grad_flat``: autograd then adds into it in place."""
        for p in self.params:
            p.grad = self.grad_view(p)

    def grad_view(self, p: nn.Parameter) -> torch.Tensor:
        start, _ = self.offsets[id(p)]
        return self.grad_flat[start:start + p.numel()].view_as(p)

    def shard_slices(self, dp_index: int) -> list[tuple[int, int]]:
        """(start, end) in the flat buffers of this rank's slice of each bucket."""
        out = []
        for bucket in self.buckets:
            chunk = bucket.size // self.dp
            out.append((bucket.start + dp_index * chunk, bucket.start + (dp_index + 1) * chunk))
        return out


class ShardedOptimizer:
    """ZeRO-1 over the dp axis for one pipeline stage of one TP rank."""

    def __init__(self, model: nn.Module, *, comm: Comm | None, tp: Axis, dp: Axis, world: Axis,
                 dp_index: int, tp_index: int, sequence_parallel: bool, optimizer: str, lr: float,
                 weight_decay: float, grad_clip: float, bucket_mb: float, device: torch.device,
                 collector: Any, overlap: bool = True) -> None:
        self.comm = comm
        self.overlap = overlap
        self.tp, self.dp, self.world = tp, dp, world
        self.dp_index = dp_index
        self.sync_tp = sequence_parallel and tp.size > 1
        self.grad_clip = grad_clip
        self.col = collector
        self.kind = optimizer
        bucket_elems = max(1, int(bucket_mb * 2**20 / 4))
        # Reverse definition order approximates the order gradients arrive in backward, so early
        # buckets fill (and their reduce-scatter starts) first.
        params = list(reversed([p for p in model.parameters() if p.requires_grad]))
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        self.buffers = [FlatBuffer(ps, dp=dp.size, bucket_elems=bucket_elems, device=device)
                        for ps in (decay, no_decay) if ps]
        self.weight_decays = [weight_decay if ps is decay else 0.0 for ps in (decay, no_decay) if ps]
        self._armed = False
        # Parameter all-gathers left in flight after the step, by id(bucket); forward pre-hooks of
        # the watched modules wait for them (watch()).
        self._param_gathers: dict[int, Any] = {}
        self._users: list[Any] = []
        self._watched: set[int] = set()
        self._watched_params: set[int] = set()
        self._bucket_of: dict[int, _Bucket] = {}  # id(param) -> its bucket, built on the first watch()
        # Master shards: this rank's slice of each buffer, as one flat fp32 parameter per buffer, and
        # the reduced gradient of that slice (the reduce-scatters write straight into it).
        self.masters: list[nn.Parameter] = []
        self.grad_shards: list[torch.Tensor] = []
        self.norm_ranges: list[list[tuple[int, int]]] = []  # per buffer: shard ranges counted in the norm
        self._norm_weights: list[torch.Tensor] | None = None  # LAMB only, built on first use
        self.segments: list[tuple[torch.Tensor, int]] = []  # LAMB: element -> parameter index
        for buf in self.buffers:
            slices = buf.shard_slices(dp_index)
            if dp.size == 1:
                # Without data parallelism the shard is the whole buffer: update the parameters in
                # place instead of keeping (and copying back) a second fp32 copy.
                master = buf.param_flat
                self.grad_shards.append(buf.grad_flat)
            else:
                master = torch.cat([buf.param_flat[s:e] for s, e in slices]).clone()
                self.grad_shards.append(torch.zeros_like(master))
            self.masters.append(nn.Parameter(master))
            self.norm_ranges.append(self._counted_ranges(buf, slices, tp_index))
            self.segments.append(self._segment_ids(buf, slices, device) if optimizer == "lamb" else (master, 0))
        for buf in self.buffers:
            for p in buf.params:
                p.register_post_accumulate_grad_hook(self._make_hook(buf, p))
        self.inner: torch.optim.Optimizer | None = None
        if optimizer == "adamw" and device.type == "cuda":
            groups = [{"params": [m], "weight_decay": wd} for m, wd in zip(self.masters, self.weight_decays, strict=True)]
            self.inner = torch.optim.AdamW(groups, lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, fused=True)
        # On CPU, AdamW is the few lines in _adamw: constructing any torch.optim optimizer imports
        # torch._dynamo (~4 s of CPU per process), which 8 ranks on 2 cores pay at every start.
        self.moments = [(torch.zeros_like(m), torch.zeros_like(m)) for m in self.masters] if self.inner is None else []
        self.opt_step = 0

    # --- shard bookkeeping -------------------------------------------------------------------
    @staticmethod
    def _counted_ranges(buf: FlatBuffer, slices: list[tuple[int, int]], tp_index: int) -> list[tuple[int, int]]:
        """Ranges of the shard (in shard coordinates) this rank counts in the global norm: all of it,
        except, on tp ranks > 0, the TP-replicated parameters (tp rank 0 counts them once)."""
        skip = sorted(r for bucket in buf.buckets for r in bucket.replicated) if tp_index > 0 else []
        out: list[tuple[int, int]] = []
        base = 0
        for s, e in slices:
            cursor = s
            for rs, re_ in skip:
                lo, hi = max(rs, s), min(re_, e)
                if lo >= hi:
                    continue
                if lo > cursor:
                    out.append((base + cursor - s, base + lo - s))
                cursor = max(cursor, hi)
            if cursor < e:
                out.append((base + cursor - s, base + e - s))
            base += e - s
        return out

    def _norm_weight(self, i: int) -> torch.Tensor:
        """1 for the shard elements of buffer ``i`` counted in the norm, 0 elsewhere (LAMB's trust ratios)."""
        if self._norm_weights is None:
            self._norm_weights = []
            for master, ranges in zip(self.masters, self.norm_ranges, strict=True):
                w = torch.zeros(master.numel(), device=master.device)
                for s, e in ranges:
                    w[s:e] = 1.0
                self._norm_weights.append(w)
        return self._norm_weights[i]

    def _segment_ids(self, buf: FlatBuffer, slices: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, int]:
        ids = torch.full((buf.numel,), len(buf.params), dtype=torch.long, device=device)  # padding: extra id
        for i, p in enumerate(buf.params):
            start, _ = buf.offsets[id(p)]
            ids[start:start + p.numel()] = i
        return torch.cat([ids[s:e] for s, e in slices]), len(buf.params) + 1

    # --- gradient sync -----------------------------------------------------------------------
    def _make_hook(self, buf: FlatBuffer, p: nn.Parameter) -> Callable[[torch.Tensor], None]:
        bucket = buf.buckets[buf.offsets[id(p)][1]]

        def hook(param: torch.Tensor) -> None:
            # Autograd has already added this micro-batch's gradient into the bucket (p.grad is a view).
            if self._armed:
                bucket.ready += 1
                if bucket.ready == bucket.params and self.overlap:
                    self._launch(buf, bucket)

        return hook

    def arm(self) -> None:
        """The next backward is the step's last: launch each bucket's sync as it fills."""
        self._armed = True

    def _launch(self, buf: FlatBuffer, bucket: _Bucket) -> None:
        if not (self.sync_tp and bucket.replicated) and self.dp.size == 1:
            return
        assert self.comm is not None
        # Once a step, though launched from the last micro-batch's backward: step-level calls, timed
        # where the TP calls of that micro-batch are not (--tp-comm-spans rotate/first), or one in
        # N by their place in the step (--dp-comm-spans rotate).
        with self.comm.col.step_level():
            if self.sync_tp and bucket.replicated:
                parts = [buf.grad_flat[s:e] for s, e in bucket.replicated]
                if len(parts) == 1:
                    self.comm.all_reduce(parts[0], self.tp.pg)
                else:
                    # One collective for the bucket's norms and biases, not one each: a small
                    # all-reduce costs its launch and latency whatever its size.
                    packed = self.comm.all_reduce(torch.cat(parts), self.tp.pg)
                    torch._foreach_copy_(parts, list(packed.split([p.numel() for p in parts])))
            if self.dp.size > 1:
                # Into this bucket's slice of the reduced-gradient shard: a separate buffer (an output
                # aliasing the input is not something gloo promises to handle), and no concatenation
                # later.
                chunk = bucket.size // self.dp.size
                out = self.grad_shards[self.buffers.index(buf)][bucket.shard_start:bucket.shard_start + chunk]
                bucket.work = self.comm.reduce_scatter_async(out, buf.grad_flat[bucket.start:bucket.end],
                                                             self.dp.pg)

    def _finish_sync(self) -> list[torch.Tensor]:
        """Wait for every bucket; return each buffer's reduced gradient shard."""
        self._armed = False
        for buf in self.buffers:
            for bucket in buf.buckets:
                if bucket.ready != bucket.params:
                    raise RuntimeError(f"gradient bucket [{bucket.start}, {bucket.end}) never filled "
                                       f"({bucket.ready}/{bucket.params} parameters reported)")
                if not self.overlap:
                    self._launch(buf, bucket)
        for buf in self.buffers:
            for bucket in buf.buckets:
                bucket.ready = 0
                if bucket.work is not None:
                    bucket.work.wait()
                    bucket.work = None
        return self.grad_shards

    # --- the step ------------------------------------------------------------------------------
    def step(self, lr: float, loss: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Finish the gradient sync, clip, update the shard, all-gather the parameters.

        ``loss`` is this rank's scaled loss sum (last stage, tp rank 0 contributes) or None.
        Returns (global grad norm, global loss) as tensors.
        """
        # Waiting for the overlapped reduce-scatters to drain: not compute, not a collective itself.
        with self.col.span("grad_sync_wait", kind=SpanKind.OTHER):
            grads = self._finish_sync()
        device = self.masters[0].device
        stats = torch.zeros(2, device=device)
        pieces = [g[s:e] for g, ranges in zip(grads, self.norm_ranges, strict=True) for s, e in ranges]
        if pieces:
            stats[0] = torch.stack(torch._foreach_norm(pieces)).square().sum()
        if loss is not None:
            stats[1] += loss.float()
        if self.comm is not None and self.world.size > 1:
            self.comm.all_reduce(stats, self.world.pg)
        grad_norm = stats[0].sqrt()
        clip = (self.grad_clip / (grad_norm + 1e-6)).clamp(max=1.0) if self.grad_clip > 0 else torch.ones((), device=device)
        with self.col.span("optimizer", kind=SpanKind.OPTIMIZER):
            for master, g in zip(self.masters, grads, strict=True):
                master.grad = g
            if self.inner is not None:
                for group in self.inner.param_groups:
                    group["lr"] = lr
                # The fused kernel divides each gradient by this scale as it reads it: clipping
                # without a pass of its own over the gradients.
                self.inner.grad_scale = 1.0 / clip  # type: ignore[attr-defined]
                self.inner.step()
            else:
                for g in grads:
                    g.mul_(clip)
                if self.kind == "adamw":
                    self._adamw(lr)
                else:
                    self._lamb(lr)
            for master in self.masters:
                master.grad = None
        self._gather_params()
        for buf in self.buffers:
            buf.grad_flat.zero_()
        return grad_norm, stats[1]

    def _gather_params(self) -> None:
        """All-gather the updated parameters, bucket by bucket. With overlap and ``watch()``ed
        modules, the gathers are left in flight (launched in forward order) and each is waited on
        by the first forward that reads its bucket; otherwise they are waited on here."""
        if self.dp.size == 1:
            return  # the optimizer updated the parameters in place
        assert self.comm is not None
        deferred = self.overlap and bool(self._users)
        # The small buffer of 1-D parameters (norms) first: every block needs some of it. Within a
        # buffer, buckets hold parameters in reverse definition order: launch the last bucket (the
        # first layers) first, so the forward that waits for it waits least.
        for buf, master in reversed(list(zip(self.buffers, self.masters, strict=True))):
            for bucket in reversed(buf.buckets):
                chunk = bucket.size // self.dp.size
                piece = master.detach()[bucket.shard_start:bucket.shard_start + chunk]
                work = self.comm.all_gather_async(buf.param_flat[bucket.start:bucket.end], piece, self.dp.pg)
                if deferred and id(bucket) in self._watched:
                    self._param_gathers[id(bucket)] = work
                else:
                    work.wait()

    def watch(self, module: nn.Module, params: list[nn.Parameter] | None = None) -> None:
        """Before ``module``'s forward, wait for the parameter all-gathers of ``params`` (default:
        its own parameters). Every parameter must be covered by a module whose forward runs before
        it is read: only buckets with a watched parameter are left in flight, and a bucket is
        waited on by the first watched forward that needs it."""
        if not self._bucket_of:
            self._bucket_of = {id(p): buf.buckets[buf.offsets[id(p)][1]] for buf in self.buffers for p in buf.params}
        chosen = [p for p in (params if params is not None else module.parameters()) if id(p) in self._bucket_of]
        self._watched_params.update(id(p) for p in chosen)
        needed = [self._bucket_of[id(p)] for p in chosen]
        if not needed:
            return
        buckets = list({id(b): b for b in needed}.values())
        self._users.append(module.register_forward_pre_hook(lambda *_: self._wait_buckets(buckets)))
        self._watched.update(id(b) for b in buckets)

    def unwatched(self, model: nn.Module) -> list[str]:
        """Names of ``model``'s trained parameters no ``watch()`` covers (should be none)."""
        return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in self._watched_params]

    def _wait_buckets(self, buckets: list[_Bucket]) -> None:
        for bucket in buckets:
            work = self._param_gathers.pop(id(bucket), None)
            if work is not None:
                work.wait()

    def wait_params(self) -> None:
        """Wait for every parameter all-gather still in flight (the end of training, or a caller
        that reads the parameters outside a watched forward)."""
        works, self._param_gathers = list(self._param_gathers.values()), {}
        for work in works:
            work.wait()

    @torch.no_grad()
    def _adamw(self, lr: float) -> None:
        """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments), on the flat shard."""
        self.opt_step += 1
        t = self.opt_step
        b1, b2 = ADAMW_BETAS
        for master, (m, v), wd in zip(self.masters, self.moments, self.weight_decays, strict=True):
            g = master.grad
            assert g is not None
            master.mul_(1 - lr * wd)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v / (1 - b2**t)).sqrt_().add_(ADAMW_EPS)
            master.addcdiv_(m, denom, value=-lr / (1 - b1**t))

    def _lamb(self, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6) -> None:
        self.opt_step += 1
        t = self.opt_step
        b1, b2 = betas
        for i, (master, (m, v), wd, (seg, nseg)) in enumerate(zip(self.masters, self.moments, self.weight_decays,
                                                                  self.segments, strict=True)):
            w = self._norm_weight(i)
            g = master.grad
            assert g is not None
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            update = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + wd * master.detach()
            # Trust ratio per whole parameter: sum squares over this shard, then over dp and tp.
            norms = torch.zeros(2, nseg, device=master.device)
            norms[0].index_add_(0, seg, master.detach().square() * w)
            norms[1].index_add_(0, seg, update.square() * w)
            if self.comm is not None:
                if self.dp.size > 1:
                    self.comm.all_reduce(norms, self.dp.pg)
                if self.tp.size > 1:
                    self.comm.all_reduce(norms, self.tp.pg)
            w_norm, u_norm = norms[0].sqrt(), norms[1].sqrt()
            ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm.clamp(min=1e-30), torch.ones_like(w_norm))
            with torch.no_grad():
                master.sub_(update * ratio[seg] * lr)


def lr_at(step: int, *, base: float, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to ``floor * base``."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

