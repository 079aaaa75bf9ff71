"""Model FLOPs per step and each device's peak FLOP/s, for MFU.

Role in the data flow: the trainer writes both into ``run.json``; the MFU analysis divides.

Formula (documented once, here). With ``L`` layers, hidden ``h``, MLP width ``f``, vocabulary ``V``,
sequence ``s``, attention window ``w`` (``s`` when none) and ``T`` tokens per step::

    N_matmul = L * (4*h*h + 2*h*f) + V*h          # qkv + proj + fc1 + fc2, and the logits layer
    flops    = 6 * N_matmul * T + 12 * L * h * min(s, w) * T

``6 N T``: each weight does a multiply-add per token in forward (2 FLOPs) and twice that in
backward. ``12 L h s T``: QK^T and AV are each ``2 s h`` FLOPs per token per layer forward, times
three for forward and backward. As PaLM and Megatron count it, the causal mask's skipped half is
*not* subtracted, and re-computation is not counted. Embedding lookups and norms are not FLOPs of
note and are left out.

Example::

    model_flops_per_step(ModelConfig(), tokens=16 * 128)
"""

from __future__ import annotations

import time

import torch

from megascope.trainer.config import ModelConfig

# Dense bf16 tensor-core peak per device (no sparsity), by a substring of the CUDA device name.
_PEAK_BF16 = (
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.4e12),
    ("H800", 989.4e12),
    ("A100", 312.0e12),
    ("A800", 312.0e12),
    ("L40S", 362.0e12),
    ("L4", 121.0e12),
    ("A10", 125.0e12),
)


def matmul_params(cfg: ModelConfig) -> int:
    h, f = cfg.hidden, cfg.ffn_hidden
    return cfg.layers * (4 * h * h + 2 * h * f) + cfg.vocab * h


def model_flops_per_step(cfg: ModelConfig, *, tokens: int) -> float:
    context = cfg.seq_len if cfg.window is None else min(cfg.seq_len, cfg.window)
    return float(6 * matmul_params(cfg) * tokens + 12 * cfg.layers * cfg.hidden * context * tokens)


def peak_flops(device: torch.device) -> tuple[str, float | None]:
    """(device name, peak FLOP/s): a table for CUDA, a short fp32 matmul measurement for CPU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _PEAK_BF16:
            if key in name:
                return name, value
        return name, None
    return "cpu", measure_cpu_flops()


def measure_cpu_flops(n: int = 256, repeats: int = 40, min_s: float = 0.3) -> float:
    """Best-of fp32 matmul throughput of one thread (each CPU rank runs one): the practical peak for MFU.

    Best of many short products, so that a busy machine still shows what one free core can do;
    over ``min_s`` of wall time at least, not ``repeats`` products alone: 40 products took 8 ms,
    one scheduler slice, and a machine busy through that slice gave a peak 100x low (MFU 26% on
    a CPU run whose twins read 0.3%).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(n, n)
        b = torch.randn(n, n)
        best = float("inf")
        start = time.perf_counter()
        done = 0
        while done < repeats or (time.perf_counter() - start < min_s and done < 100 * repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
            done += 1
    finally:
        torch.set_num_threads(threads)
    return 2 * n**3 / max(best, 1e-9)
