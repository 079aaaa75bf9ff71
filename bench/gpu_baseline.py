"""Plain-PyTorch baseline for the bundled trainer's MFU: one GPU, no megascope, nothing clever.

The same GPT shape as the trainer's parallel-block model (attention and MLP read one normalized
input), written as the simplest single-GPU loop: bf16 autocast, SDPA attention, fused AdamW.
Prints one JSON line: tokens/s, step time, MFU from the analytic FLOPs, and the FLOPs that
``torch.utils.flop_counter`` counts for one step (the independent check of the formula).

    python bench/gpu_baseline.py --layers 24 --hidden 2048 --heads 16 --seq 2048 --batch 8 --steps 30
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, parallel: bool) -> None:
        super().__init__()
        self.heads = heads
        self.parallel = parallel
        self.ln1 = nn.LayerNorm(hidden)
        self.ln2 = None if parallel else nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, 4 * hidden, bias=False)
        self.fc2 = nn.Linear(4 * hidden, hidden, bias=False)

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            y = self.ln1(x)
            return x + self.attn(y) + self.mlp(y)
        x = x + self.attn(self.ln1(x))
        assert self.ln2 is not None
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq: int, parallel: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, parallel) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def analytic_flops(*, vocab: int, hidden: int, layers: int, seq: int, tokens: int) -> float:
    """Forward + backward FLOPs of one step, the usual MFU convention (as megascope's trainer counts):
    6 x matmul params x tokens, logits included, plus 12 x layers x hidden x seq x tokens for the
    attention scores and values (the whole score matrix, as if not causal)."""
    matmul_params = layers * 12 * hidden * hidden + vocab * hidden
    return 6.0 * matmul_params * tokens + 12.0 * layers * hidden * seq * tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--serial", action="store_true", help="serial block instead of the parallel block")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--device", default="cuda", help="cpu only for a quick check of the script itself")
    args = p.parse_args()

    torch.manual_seed(0)
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq, not args.serial).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=dev)
    x, y = data[:, :-1], data[:, 1:]

    def step() -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().view(-1, args.vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    counted = float(counter.get_total_flops())
    for _ in range(args.warmup):
        step()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    tokens = args.batch * args.seq
    flops = analytic_flops(vocab=args.vocab, hidden=args.hidden, layers=args.layers, seq=args.seq, tokens=tokens)
    med = statistics.median(times)
    params = sum(p.numel() for p in model.parameters())
    # The flop counter charges SDPA for the whole score matrix, as the analytic count does. (Where no
    # SDPA kernel is registered, e.g. the CPU math path, it counts no attention at all.)
    by_op = counter.get_flop_counts().get("Global", {})
    attention_counted = float(sum(v for op, v in by_op.items() if "attention" in str(op)))
    print(json.dumps({
        "what": "baseline", "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "params": params, "tokens_per_step": tokens,
        "device_type": dev.type, "step_s_median": med, "step_s_min": min(times), "tokens_per_s": tokens / med,
        "flops_analytic": flops, "flops_counted": counted, "attention_flops_counted": attention_counted, "analytic_over_counted": flops / counted if counted else math.nan,
        # Without attention: flash attention's backward recomputes the scores, which the counter
        # charges (2.5x the forward) and model FLOPs do not; the matmul part must agree exactly.
        "matmul_analytic_over_counted": (flops - 12.0 * args.layers * args.hidden * args.seq * tokens)
        / (counted - attention_counted) if counted else math.nan,
        "mfu": flops / med / (args.peak_tflops * 1e12), "peak_tflops": args.peak_tflops,
        "max_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else None,
    }))


if __name__ == "__main__":
    main()
