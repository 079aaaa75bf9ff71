"""Datasheet peaks of common training GPUs, so a diagnose result reads as "% of what the card promises".

Role in the data flow: reference data for ``megascope diagnose``'s report. Figures are the
vendors' published dense (no sparsity) BF16 tensor throughput in TFLOP/s and memory bandwidth in
GB/s. A copy moves each byte twice (read and write), and a real copy kernel reaches roughly 80-90%
of the HBM figure, so ``membw`` is compared against the HBM figure itself.

Example::

    datasheet_for("NVIDIA H100 80GB HBM3")   # {"gemm": 989.0, "membw": 3350.0, ...}
"""

from __future__ import annotations

# (substring of torch.cuda.get_device_name, entry); first match wins, so specific names go first.
_CARDS: list[tuple[str, dict[str, float | str]]] = [
    ("H200", {"card": "H200 SXM", "gemm": 989.0, "membw": 4800.0, "nvlink_gbps": 900.0}),
    ("H100 PCIe", {"card": "H100 PCIe", "gemm": 756.0, "membw": 2000.0, "nvlink_gbps": 600.0}),
    ("H100 NVL", {"card": "H100 NVL", "gemm": 835.0, "membw": 3900.0, "nvlink_gbps": 600.0}),
    ("H100", {"card": "H100 SXM", "gemm": 989.0, "membw": 3350.0, "nvlink_gbps": 900.0}),
    ("A100-SXM4-80GB", {"card": "A100 SXM 80GB", "gemm": 312.0, "membw": 2039.0, "nvlink_gbps": 600.0}),
    ("A100-SXM4-40GB", {"card": "A100 SXM 40GB", "gemm": 312.0, "membw": 1555.0, "nvlink_gbps": 600.0}),
    ("A100", {"card": "A100 PCIe", "gemm": 312.0, "membw": 1935.0, "nvlink_gbps": 600.0}),
]


def datasheet_for(device_name: str | None) -> dict[str, float | str] | None:
    """The datasheet entry of a card by its torch device name, or None if unknown (CPU included).

    ``nvlink_gbps`` is total bidirectional NVLink bandwidth per GPU; an all-reduce's bus bandwidth
    on NVLink tops out near half of it (one direction).
    """
    if not device_name:
        return None
    for needle, entry in _CARDS:
        if needle in device_name:
            return dict(entry)
    return None
