"""Each GPU rank on the CPU cores next to its GPU (``megascope train --cpu-bind``).

Role in the data flow: the first thing a CUDA rank does (``loop.train_rank``), before it allocates
anything, so that its threads run, and the memory it first touches lives, on the NUMA node its GPU
hangs off. A host-bound rank (its device waits for its kernels to be launched) runs slower on the
other socket's cores: every launch and every host-to-device copy crosses the socket link, and the
scheduler may move it between sockets mid-step. ``numactl`` does the same for jobs launched by hand.

The cores are the GPU's PCI device's ``local_cpulist`` in sysfs, intersected with the cores this
process may use (a container's cpuset); with ``slice``, split evenly between the visible GPUs of
that node, each rank on its own slice (of at least :data:`MIN_SLICE` cores; else the whole node).
When the two do not meet, or sysfs says nothing, the rank keeps its affinity; on a machine of one
NUMA node, ``node`` changes nothing. The data worker and marker agent a rank starts afterwards
inherit the binding.

Example::

    cores = bind_to_device(torch.device("cuda", 1))   # the cores now used, or None if unchanged
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PCI_DEVICES = Path("/sys/bus/pci/devices")
MIN_SLICE = 4  # cores: below this a rank keeps its whole node (its data worker and agent run there too)


def parse_cpulist(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> ``{0, 1, 2, 3, 8, 10, 11}``; ValueError on anything else."""
    cores: set[int] = set()
    for item in text.strip().split(","):
        if not item:
            continue
        lo, _, hi = item.partition("-")
        first, last = int(lo), int(hi) if hi else int(lo)
        if last < first:
            raise ValueError(f"bad CPU range {item!r}")
        cores.update(range(first, last + 1))
    return cores


def pci_address(props: Any) -> str:
    """The sysfs name of a CUDA device's PCI function, from ``torch.cuda.get_device_properties``."""
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def device_cores(address: str, *, root: Path = PCI_DEVICES) -> set[int] | None:
    """The cores local to the PCI device at ``address``, or None when sysfs does not say."""
    try:
        cores = parse_cpulist((root / address / "local_cpulist").read_text())
    except (OSError, ValueError):
        return None
    return cores or None


def choose_cores(local: set[int] | None, allowed: set[int]) -> set[int] | None:
    """The cores to bind to: the device's local ones this process may use; None to leave it be
    (nothing known, or every allowed core is already local)."""
    if not local:
        return None
    chosen = local & allowed
    if not chosen or chosen == allowed:
        return None
    return chosen


def share_of(cores: set[int], index: int, count: int, *, min_cores: int = MIN_SLICE) -> set[int]:
    """The ``index``-th of ``count`` contiguous, disjoint slices of ``cores`` (all of them when a
    slice would have fewer than ``min_cores``)."""
    ordered = sorted(cores)
    if count <= 1 or len(ordered) // count < min_cores:
        return cores
    size = len(ordered) // count
    return set(ordered[index * size:(index + 1) * size])


def bind_to_device(device: Any, mode: str = "node") -> set[int] | None:
    """Bind this process to the cores of ``device``'s NUMA node (``mode="node"``), or to its share
    of them (``"slice"``: the node's cores split evenly between the visible GPUs on that node);
    returns the cores, or None if the affinity is unchanged."""
    import torch

    if device.type != "cuda" or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    try:
        local = [device_cores(pci_address(torch.cuda.get_device_properties(i))) for i in range(torch.cuda.device_count())]
    except (AttributeError, RuntimeError):
        return None
    mine = local[device.index]
    if mine is not None and mode == "slice" and mine & allowed:
        peers = [i for i, cores in enumerate(local) if cores == mine]
        mine = share_of(mine & allowed, peers.index(device.index), len(peers))
    chosen = choose_cores(mine, allowed)
    if chosen is None:
        return None
    try:
        os.sched_setaffinity(0, chosen)
    except OSError as exc:
        log.warning("could not bind to the cores of %s: %s", device, exc)
        return None
    return chosen


def describe(cores: set[int] | None) -> str:
    """A cpulist for the run's metadata (``"unbound"`` when the rank kept its affinity)."""
    if not cores:
        return "unbound"
    ordered = sorted(cores)
    runs: list[str] = []
    start = prev = ordered[0]
    for c in [*ordered[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        runs.append(f"{start}-{prev}" if prev > start else f"{start}")
        if c is not None:
            start = prev = c
    return ",".join(runs)
