"""The bundled GPT, as one pipeline stage of one tensor-parallel rank.

Role in the data flow: ``loop.py`` builds a :class:`GPTStage` per rank; the pipeline schedule
(``pipeline.py``) runs it per micro-batch. Blocks live in ``self.layers`` keyed by their *global*
index, so module names (``layers.5``) and the collector's per-block spans mean the same layer on
every mesh.

The block is MegaScale's parallel transformer block by default: attention and MLP read one
normalized input, and their row-parallel outputs are summed before a single TP reduce (one
reduce-scatter per block instead of two). ``parallel_block=False`` gives the serial block. Attention
is ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels on GPU), causal, with an
optional sliding window expressed as a boolean mask.

Initialisation is mesh-independent: each logical (unsharded) weight is drawn from its own
generator seeded by ``(seed, name)`` and this rank keeps its TP slice, so every layout starts from
the same model. Embeddings are not tied to the output layer (tying across pipeline stages would need
one more all-reduce between the first and last stage every step).

Example::

    stage = GPTStage(model_cfg, tp_ctx, stage=0, stages=2, seed=0, device=torch.device("cpu"))
    hidden = stage(tokens)                       # first stage: [seq/tp, batch, hidden]
    loss = last_stage(hidden, targets=targets)   # last stage: per-token loss [seq, batch]
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from megascope.trainer.config import ModelConfig
from megascope.trainer.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

INIT_STD = 0.02


def _mark_replicated(module: nn.Module) -> None:
    # Replicated over TP: under sequence parallelism each copy only sees its sequence shard.
    for p in module.parameters():
        p.tp_replicated = True  # type: ignore[attr-defined]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, device: torch.device) -> None:
        super().__init__()
        self.heads = cfg.heads // tp.size
        self.head_dim = cfg.head_dim
        self.window = cfg.window
        # Rows of the full qkv weight are ordered (head, q/k/v, head_dim): a contiguous TP slice
        # holds whole heads with their q, k and v.
        self.qkv = ColumnParallelLinear(cfg.hidden, 3 * cfg.hidden, tp, device=device)
        self.proj = RowParallelLinear(cfg.hidden, cfg.hidden, tp, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the full sequence ``[s, b, hidden]``; returns this rank's partial projection."""
        return self.attend(self.qkv(x))

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """From this rank's ``qkv`` projection ``[s, b, 3 * hidden / tp]`` to its partial output projection."""
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))  # [b, heads, s, d]
        if self.window is None or self.window >= s:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            pos = torch.arange(s, device=qkv.device)
            dist = pos.view(-1, 1) - pos.view(1, -1)
            mask = (dist >= 0) & (dist < self.window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, device: torch.device) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden, cfg.ffn_hidden, tp, device=device)
        self.fc2 = RowParallelLinear(cfg.ffn_hidden, cfg.hidden, tp, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))

    @staticmethod
    def act(h: torch.Tensor) -> torch.Tensor:
        return F.gelu(h, approximate="tanh")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, device: torch.device) -> None:
        super().__init__()
        self.tp = tp
        self.parallel = cfg.parallel_block
        self.ln1 = nn.LayerNorm(cfg.hidden, device=device)
        self.ln2 = None if self.parallel else nn.LayerNorm(cfg.hidden, device=device)
        self.attn = Attention(cfg, tp, device)
        self.mlp = MLP(cfg, tp, device)
        _mark_replicated(self.ln1)
        if self.ln2 is not None:
            _mark_replicated(self.ln2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        attn, mlp = self.attn, self.mlp
        if self.parallel:
            # One entry for both branches (one gather, one cast); the MLP's output GEMM adds the
            # attention's partial output in its epilogue (addmm) instead of a separate pass.
            qkv, h = tp.column_in(self.ln1(x), [attn.qkv.weight, mlp.fc1.weight])
            a = attn.attend(qkv)
            h = mlp.act(h)
            partial = torch.addmm(a.flatten(0, 1), h.flatten(0, 1), mlp.fc2.weight.t()).view_as(a)
            return x + tp.exit(partial)
        assert self.ln2 is not None
        (qkv,) = tp.column_in(self.ln1(x), [attn.qkv.weight])
        x = x + tp.exit(attn.attend(qkv))
        (h,) = tp.column_in(self.ln2(x), [mlp.fc1.weight])
        return x + tp.exit(mlp.fc2(mlp.act(h)))


class GPTStage(nn.Module):
    """Layers ``[stage * L/stages, (stage+1) * L/stages)`` of the GPT, plus the embedding on the first
    stage and the final norm, output layer and loss on the last."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, *, stage: int, stages: int, seed: int,
                 device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.first = stage == 0
        self.last = stage == stages - 1
        per_stage = cfg.layers // stages
        self.layer_ids = list(range(stage * per_stage, (stage + 1) * per_stage))
        self.embed: VocabParallelEmbedding | None = None
        self.pos: nn.Parameter | None = None
        if self.first:
            self.embed = VocabParallelEmbedding(cfg.vocab, cfg.hidden, tp, device=device)
            self.pos = nn.Parameter(torch.empty(cfg.seq_len, cfg.hidden, device=device))
            self.pos.tp_replicated = True  # type: ignore[attr-defined]
        self.layers = nn.ModuleDict({str(i): Block(cfg, tp, device) for i in self.layer_ids})
        self.ln_f: nn.LayerNorm | None = None
        self.lm_head: ColumnParallelLinear | None = None
        if self.last:
            self.ln_f = nn.LayerNorm(cfg.hidden, device=device)
            _mark_replicated(self.ln_f)
            self.lm_head = ColumnParallelLinear(cfg.hidden, cfg.vocab, tp, device=device)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Draw every full weight from a generator seeded by (seed, name) and keep this rank's slice."""
        residual_std = INIT_STD / math.sqrt(2 * self.cfg.layers)
        for name, p in self.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
                p.fill_(1.0)
                continue
            if name.endswith(".bias"):
                p.zero_()
                continue
            split = getattr(p, "tp_split_dim", None)
            full_shape = list(p.shape)
            if split is not None:
                full_shape[split] *= self.tp.size
            gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            std = residual_std if name.endswith(("proj.weight", "fc2.weight")) else INIT_STD
            full = torch.randn(full_shape, generator=gen) * std
            if split is not None:
                full = full.narrow(split, self.tp.index * p.shape[split], p.shape[split])
            p.copy_(full)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: ``x`` is tokens ``[s, b]``; others: hidden ``[s/tp, b, h]``.

        Returns the hidden state to send on, or on the last stage the per-token loss ``[s, b]``.
        """
        if self.first:
            assert self.embed is not None and self.pos is not None
            seq = self.tp.local_seq(x.shape[0])
            x = self.tp.exit(self.embed(x)) + self.pos[seq].unsqueeze(1)
        for block in self.layers.values():
            x = block(x)
        if not self.last:
            return x
        assert self.ln_f is not None and self.lm_head is not None and targets is not None
        (logits,) = self.tp.column_in(self.ln_f(x), [self.lm_head.weight])
        if not self.tp.active:
            # The whole vocabulary is here: torch's fused cross-entropy makes fewer passes over the
            # [tokens, vocab] logits than the vocab-parallel form, and computes the same loss.
            flat = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
            return flat.view_as(targets)
        return vocab_parallel_cross_entropy(logits, targets, self.tp, self.tp.index * logits.shape[-1])

    def matmul_weights(self) -> list[torch.Tensor]:
        """The local weights that forward multiplies full-sequence activations with (for the
        straggler fault's extra work)."""
        out: list[torch.Tensor] = [p for n, p in self.named_parameters() if n.endswith(("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight"))]
        if self.lm_head is not None:
            out.append(self.lm_head.weight)
        return out
