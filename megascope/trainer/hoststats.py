"""Where a rank's host time goes, step by step: for benchmarks of what the collector costs.

Role in the data flow: beside the training loop only (``megascope train --host-stats DIR``). A host
that sets the pace of its device turns everything that slows its training thread into lost step
time, and whole-run step times alone cannot say what that was. Per step this records

* ``thread_cpu_s``: CPU time of the training thread itself (``time.thread_time``): the work it did,
  the collector's hooks included;
* ``process_cpu_s``: CPU time of the whole process, every thread (the collector's writer and
  heartbeat, the backend's own threads);
* ``voluntary`` / ``involuntary``: the training thread's context switches (Linux,
  ``/proc/thread-self/status``). It switches voluntarily when it blocks (a device wait, a full
  launch queue, the interpreter lock held by another thread) and involuntarily when the kernel takes
  its CPU away for another thread.

Step ``i`` runs from the end of step ``i - 1`` to the end of step ``i`` (the first from the meter's
start), as ``step_seconds`` does. Each rank writes ``DIR/rank-<rank>.json``.

Example::

    meter = HostMeter()
    for step in ...:
        ...
        meter.tick()
    meter.write(Path("host"), rank=0)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

_STATUS = Path("/proc/thread-self/status")


def _switches() -> tuple[int, int] | None:
    """The calling thread's (voluntary, involuntary) context switches, or None off Linux."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            found[key] = int(value)
    if len(found) != 2:
        return None
    return found["voluntary_ctxt_switches"], found["nonvoluntary_ctxt_switches"]


class HostMeter:
    """Per-step host counters of the thread that calls :meth:`tick` (the training thread)."""

    def __init__(self) -> None:
        self.steps: dict[str, list[float]] = {"seconds": [], "thread_cpu_s": [], "process_cpu_s": [],
                                              "voluntary": [], "involuntary": []}
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float, tuple[int, int] | None]:
        return time.perf_counter(), time.thread_time(), time.process_time(), _switches()

    def tick(self) -> None:
        """End a step: the counters' growth since the last tick."""
        now = self._read()
        wall0, thread0, proc0, sw0 = self._last
        wall1, thread1, proc1, sw1 = now
        self.steps["seconds"].append(wall1 - wall0)
        self.steps["thread_cpu_s"].append(thread1 - thread0)
        self.steps["process_cpu_s"].append(proc1 - proc0)
        if sw0 is not None and sw1 is not None:
            self.steps["voluntary"].append(float(sw1[0] - sw0[0]))
            self.steps["involuntary"].append(float(sw1[1] - sw0[1]))
        self._last = now

    def write(self, directory: Path, *, rank: int) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank-{rank}.json"
        path.write_text(json.dumps({"rank": rank, **self.steps}) + "\n")
        return path
