"""The self-tests one rank runs for ``megascope diagnose``: GEMM, memory copy, host/peer copies, all-reduce.

Role in the data flow: in-job *collect* for health. Each function measures one thing on this
rank's device and returns a :class:`Measurement` (a value, a unit, whether its result checked
out); ``megascope.health.diagnose`` runs them on every rank, gathers the results and names the
outliers. Needs torch only.

Every test checks its own result, because a fast wrong answer is worse than a slow one:

* GEMM: the column sums of ``A @ B`` must equal ``colsum(A) @ B`` (an algorithm-based checksum,
  computed in higher precision), which catches silent data corruption at O(n^2) cost;
* copies: the destination must equal the source bit for bit;
* all-reduce: a pattern of -1/0/1 per rank whose exact sum every rank can compute alone.

Times are per iteration (CUDA events on the GPU, ``perf_counter_ns`` on the CPU), summarised by
the median on GPUs and the best iteration on CPUs (``Sizes.best_of``), so one preempted
iteration does not make a rank look slow.

Example::

    sizes = Sizes.for_device(torch.device("cpu"))
    m = gemm(torch.device("cpu"), sizes)      # Measurement(value=..., unit="TFLOP/s", ok=True, ...)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """Problem sizes and repetitions; ``for_device`` picks GPU-scale or CI-scale ones."""

    gemm_n: int
    gemm_dtype: torch.dtype
    copy_bytes: int
    allreduce_bytes: int
    iters: int
    warmup: int
    # How iterations are summarised: the median on GPUs (an intermittent slowdown shows), the best
    # on a shared CPU, where noise only ever adds time and slow hardware is never fast.
    best_of: bool = False

    def seconds(self, per_iter: list[float]) -> float:
        return min(per_iter) if self.best_of else statistics.median(per_iter)

    @classmethod
    def for_device(cls, device: torch.device, *, iters: int | None = None) -> Sizes:
        if device.type == "cuda":
            # Big enough to reach the card's steady clocks and bandwidth, small enough for seconds.
            return cls(gemm_n=8192, gemm_dtype=torch.bfloat16, copy_bytes=1 << 30, allreduce_bytes=256 << 20,
                       iters=iters or 20, warmup=5)
        # CPU (CI): the same code paths at sizes a shared 2-core machine runs in well under a second.
        return cls(gemm_n=192, gemm_dtype=torch.float32, copy_bytes=32 << 20, allreduce_bytes=1 << 20,
                   iters=iters or 8, warmup=2, best_of=True)


@dataclass(frozen=True)
class Measurement:
    value: float | None
    unit: str
    ok: bool
    detail: str | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_iters(fn: Callable[[], object], device: torch.device, iters: int, warmup: int,
               before: Callable[[], object] | None = None) -> list[float]:
    """Seconds per call of ``fn``, one entry per iteration. ``before`` runs untimed before each."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for start, end in zip(starts, ends, strict=True):
            if before is not None:
                before()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True)]
    out = []
    for _ in range(iters):
        if before is not None:
            before()
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e9)
    return out


def gemm(device: torch.device, sizes: Sizes, *, repeat: int = 1, seed: int = 0) -> Measurement:
    """Square matmul throughput in TFLOP/s. ``repeat`` > 1 does the work that many times per
    iteration while counting it once (the ``--slow-rank`` test hook)."""
    n = sizes.gemm_n
    gen = torch.Generator(device="cpu").manual_seed(seed)
    a = (torch.rand(n, n, generator=gen) * 2 - 1).to(device=device, dtype=sizes.gemm_dtype)
    b = (torch.rand(n, n, generator=gen) * 2 - 1).to(device=device, dtype=sizes.gemm_dtype)
    c = torch.empty(n, n, device=device, dtype=sizes.gemm_dtype)

    def step() -> None:
        for _ in range(repeat):
            torch.matmul(a, b, out=c)

    seconds = sizes.seconds(time_iters(step, device, sizes.iters, sizes.warmup))
    tflops = 2.0 * n**3 / seconds / 1e12
    # Checksum: colsum(A @ B) == colsum(A) @ B. Reference in float64; the tolerance follows the
    # output precision (bf16 keeps ~3 digits), far below what a flipped exponent bit changes.
    ref = a.double().sum(0) @ b.double()
    got = c.double().sum(0)
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    tol = 1e-9 if sizes.gemm_dtype == torch.float64 else 1e-5 if sizes.gemm_dtype == torch.float32 else 2e-2
    ok = bool(torch.isfinite(got).all()) and err <= tol
    detail = None if ok else f"checksum mismatch: relative error {err:.2e} > {tol:.0e} ({n}x{n} {sizes.gemm_dtype})"
    return Measurement(tflops, "TFLOP/s", ok, detail)


def _copy_bandwidth(src: torch.Tensor, dst: torch.Tensor, device: torch.device, sizes: Sizes,
                    *, traffic: int, repeat: int) -> Measurement:
    def step() -> None:
        for _ in range(repeat):
            dst.copy_(src, non_blocking=True)

    seconds = sizes.seconds(time_iters(step, device, sizes.iters, sizes.warmup))
    # Bitwise: the pattern holds every int32 bit pattern, so compare bits, not float values.
    ok = bool(torch.equal(dst.to(src.device).view(torch.int32), src.view(torch.int32)))
    return Measurement(traffic / seconds / 1e9, "GB/s", ok, None if ok else "copy differs from its source")


def _pattern(nbytes: int, device: torch.device) -> torch.Tensor:
    n = max(1, nbytes // 4)
    return torch.arange(n, dtype=torch.int32, device=device).view(torch.float32)  # every bit pattern distinct


def membw(device: torch.device, sizes: Sizes, *, repeat: int = 1) -> Measurement:
    """Device memory bandwidth of a copy, GB/s, counting bytes read plus bytes written."""
    src = _pattern(sizes.copy_bytes, device)
    dst = torch.empty_like(src)
    return _copy_bandwidth(src, dst, device, sizes, traffic=2 * src.numel() * 4, repeat=repeat)


def h2d(device: torch.device, sizes: Sizes, *, repeat: int = 1) -> Measurement:
    """Pinned host memory to this GPU, GB/s (the PCIe or C2C link)."""
    src = _pattern(sizes.copy_bytes, torch.device("cpu")).pin_memory()
    dst = torch.empty(src.shape, dtype=src.dtype, device=device)
    return _copy_bandwidth(src, dst, device, sizes, traffic=src.numel() * 4, repeat=repeat)


def d2d(device: torch.device, peer: torch.device, sizes: Sizes, *, repeat: int = 1) -> Measurement:
    """This GPU to a peer GPU of the same host, GB/s (NVLink or PCIe peer-to-peer)."""
    src = _pattern(sizes.copy_bytes, device)
    dst = torch.empty(src.shape, dtype=src.dtype, device=peer)
    m = _copy_bandwidth(src, dst, device, sizes, traffic=src.numel() * 4, repeat=repeat)
    return Measurement(m.value, m.unit, m.ok, m.detail if m.ok else f"{m.detail} ({device} -> {peer})")


def _expected_allreduce(members: list[int], n: int, device: torch.device) -> torch.Tensor:
    # Each rank r contributes ((r + i) % 3) - 1 at index i; the sum depends only on i % 3.
    per_class = [float(sum(((m + k) % 3) - 1 for m in members)) for k in range(3)]
    idx = torch.arange(n, device=device) % 3
    return torch.tensor(per_class, device=device)[idx]


def allreduce(pg: dist.ProcessGroup | None, members: list[int], rank: int, device: torch.device,
              sizes: Sizes, *, delay_s: float = 0.0) -> Measurement:
    """All-reduce bus bandwidth of one group, GB/s (nccl-tests' convention: algorithm bandwidth
    times 2(n-1)/n), and an exact check of the sum. ``delay_s`` stalls this rank before each
    iteration (the ``--slow-rank`` test hook)."""
    n = max(1, sizes.allreduce_bytes // 4)
    scratch = torch.zeros(n, dtype=torch.float32, device=device)

    def stall() -> None:
        if delay_s:
            time.sleep(delay_s)

    dist.barrier(group=pg)
    seconds = sizes.seconds(
        time_iters(lambda: dist.all_reduce(scratch, group=pg), device, sizes.iters, sizes.warmup, before=stall))
    size = len(members)
    busbw = n * 4 / seconds * 2 * (size - 1) / size / 1e9
    x = ((torch.arange(n, device=device) + rank) % 3 - 1).to(torch.float32)
    dist.all_reduce(x, group=pg)
    expected = _expected_allreduce(members, n, device)
    wrong = (x != expected).nonzero()
    ok = wrong.numel() == 0
    detail = None
    if not ok:
        i = int(wrong[0])
        detail = (f"wrong sum at {wrong.numel()} of {n} elements (first: index {i}, "
                  f"got {float(x[i]):g}, expected {float(expected[i]):g})")
    return Measurement(busbw, "GB/s", ok, detail)
